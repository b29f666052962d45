//! `braid sim`: simulation and scheduling studies on the planner's models, without GPUs.
//!
//! `braid sim pipeline SPEC.json` solves a fused-pipeline problem (RLHFuse's intra-stage
//! fusion) and prints the result as pretty JSON. The command reads files and prints; the work is
//! done in `braid-passes`, which does neither. Bad input is reported as
//! `error: <file>: <what is wrong>` with exit status 1, never a panic.
//!
//! The subcommand layout leaves room for the program form, `braid sim FILE.rlhf --cluster
//! SPEC`: it will become optional positional arguments on [`Args`] next to an optional
//! subcommand, with clap's `args_conflicts_with_subcommands`, so `pipeline` keeps working.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use braid_passes::fused_pipeline::{PipelineProblem, solve};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: SimCommand,
}

#[derive(clap::Subcommand)]
enum SimCommand {
    /// Schedule two or more trained models' pipelines fused on shared devices (RLHFuse
    /// intra-stage fusion) and print latency, lower bound, peak memory and the schedule.
    Pipeline(PipelineArgs),
}

#[derive(clap::Args)]
struct PipelineArgs {
    /// A JSON problem: {"stages": S, "models": [{"pp", "microbatches", "fwd", "bwd",
    /// "mem_per_microbatch"}, …], "search": {"seed", …}}.
    spec: PathBuf,
    /// Overrides the search seed of the spec.
    #[arg(long)]
    seed: Option<u64>,
}

pub fn run(args: Args) -> ExitCode {
    match args.command {
        SimCommand::Pipeline(a) => run_pipeline(&a),
    }
}

fn fail(path: &Path, what: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {}: {what}", path.display());
    ExitCode::FAILURE
}

fn run_pipeline(args: &PipelineArgs) -> ExitCode {
    let text = match std::fs::read_to_string(&args.spec) {
        Ok(t) => t,
        Err(e) => return fail(&args.spec, e),
    };
    let mut problem = match PipelineProblem::from_json(&text) {
        Ok(p) => p,
        Err(e) => return fail(&args.spec, e),
    };
    if let Some(seed) = args.seed {
        problem.search.seed = seed;
    }
    let result = match solve(&problem) {
        Ok(r) => r,
        Err(e) => return fail(&args.spec, e),
    };
    match serde_json::to_string_pretty(&result) {
        Ok(json) => {
            println!("{json}");
            ExitCode::SUCCESS
        }
        Err(e) => fail(&args.spec, e),
    }
}
