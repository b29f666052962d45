//! `braid sim`: simulation and scheduling studies on the planner's models, without GPUs.
//!
//! `braid sim FILE.rlhf --cluster SPEC` plans the program's run (as `braid plan` does) and
//! simulates N iterations of it next to the baselines — DeepSpeed-Chat, OpenRLHF and ReaL's
//! heuristic as `braid_passes::baselines` models them, Braid's plan without fusion and with
//! it — printing iteration, generation plus
//! inference and training times, utilisation, bubbles, the fusion gains and each pass's gain,
//! and writing Braid's timeline as Chrome-trace JSON or SVG.
//!
//! `braid sim pipeline SPEC.json` solves a fused-pipeline problem (RLHFuse's intra-stage
//! fusion) and prints the result as pretty JSON. The command reads files and prints; the work is
//! done in `braid-passes`, which does neither. Bad input is reported as
//! `error: <file>: <what is wrong>` with a non-zero exit status, never a panic.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use braid_cost::fused_pipeline::{PipelineSpec, RealSchedule, solve};
use braid_cost::sim::{SimOptions, to_chrome_trace, to_svg};
use braid_passes::to_sim::{Comparison, compare};

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    command: Option<SimCommand>,
    /// The `.rlhf` program whose run to plan and simulate.
    file: Option<PathBuf>,
    #[command(flatten)]
    inputs: crate::plan::PlanInputs,
    /// Iterations to simulate.
    #[arg(long, default_value_t = 3)]
    iterations: u32,
    /// Write Braid's timeline as Chrome-trace JSON (opens in Perfetto).
    #[arg(long, value_name = "FILE.json")]
    trace: Option<PathBuf>,
    /// Write Braid's timeline as SVG.
    #[arg(long, value_name = "FILE.svg")]
    svg: Option<PathBuf>,
    /// Print the comparison as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Subcommand)]
enum SimCommand {
    /// Schedule two or more trained models' pipelines fused on shared devices (RLHFuse
    /// intra-stage fusion) and print latency, lower bound, peak memory and the schedule.
    Pipeline(PipelineArgs),
    /// Simulate the settings of a published throughput study (a manifest such as
    /// tests/fixtures/real/study.json) and print simulated against measured speed-ups.
    Study(crate::study::StudyArgs),
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
    match (&args.command, &args.file) {
        (Some(SimCommand::Pipeline(a)), _) => run_pipeline(a),
        (Some(SimCommand::Study(a)), _) => crate::study::run(a),
        (None, Some(file)) => run_program(file, &args),
        (None, None) => {
            eprintln!(
                "error: give a program (`braid sim FILE.rlhf`) or `braid sim pipeline SPEC.json`"
            );
            ExitCode::from(2)
        }
    }
}

fn run_program(file: &Path, args: &Args) -> ExitCode {
    let options = match crate::plan::options(&args.inputs, file) {
        Ok(o) => o,
        Err(code) => return code,
    };
    // Planned once to refuse plans that do not fit before simulating them; the comparison
    // plans the same prepared input again with and without each pass.
    let compiled = match crate::plan::compile(file, &options, true, &mut |_, _| {}) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let Some(prepared) = compiled.prepared else {
        return ExitCode::from(1);
    };
    let opts = SimOptions {
        iterations: args.iterations.max(1),
        seed: prepared.seed,
    };
    let (cmp, planned, report) = match compare(&prepared, &args.inputs.disable_pass, &opts) {
        Ok(x) => x,
        Err(e) => return fail(file, e),
    };
    let devices = planned.cluster.devices() as usize;
    if let Some(path) = &args.trace
        && let Err(e) = std::fs::write(path, to_chrome_trace(&report, devices))
    {
        return fail(path, e);
    }
    if let Some(path) = &args.svg
        && let Err(e) = std::fs::write(path, to_svg(&report, devices))
    {
        return fail(path, e);
    }
    if args.json {
        match serde_json::to_string_pretty(&cmp) {
            Ok(j) => println!("{j}"),
            Err(e) => return fail(file, e),
        }
    } else {
        print!(
            "{}",
            comparison_text(&planned, &cmp, &report, opts.iterations)
        );
    }
    ExitCode::SUCCESS
}

fn comparison_text(
    a: &braid_passes::annotated::Annotated,
    cmp: &Comparison,
    report: &braid_cost::sim::SimReport,
    iterations: u32,
) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "simulated `{}` on {} for {iterations} iterations; generated lengths {}",
        a.plan.pipeline,
        a.cluster,
        serde_json::to_string(&a.workload.lengths).unwrap_or_default()
    );
    let _ = writeln!(
        o,
        "\n{:<66} {:>12} {:>14} {:>12} {:>8} {:>8}",
        "system", "iteration", "gen+inference", "training", "util", "bubble"
    );
    for s in &cmp.systems {
        let _ = writeln!(
            o,
            "{:<66} {:>12} {:>14} {:>12} {:>7.1}% {:>7.1}%",
            s.system,
            secs(s.mean_iteration_seconds),
            secs(s.generation_inference_seconds),
            secs(s.training_seconds),
            100.0 * s.mean_utilisation,
            100.0 * s.bubble_fraction
        );
    }
    let _ = writeln!(
        o,
        "\n{:<66} {:>11} {:>9} {:>11} {:>11} {:>11} {:>8}",
        "generation + inference breakdown (mean)",
        "generation",
        "tail",
        "inference",
        "inf. after",
        "transfers",
        "idle"
    );
    for s in &cmp.systems {
        let b = &s.breakdown;
        let _ = writeln!(
            o,
            "{:<66} {:>11} {:>9} {:>11} {:>11} {:>11} {:>7.1}%",
            s.system,
            secs(b.generation),
            secs(b.tail),
            secs(b.inference),
            secs(b.inference_after_generation),
            secs(b.transfers_in_window),
            100.0 * b.idle_fraction
        );
    }
    for n in &cmp.notes {
        let _ = writeln!(o, "note: {n}");
    }
    let g = &cmp.fusion_gain;
    let _ = writeln!(
        o,
        "\nfusion gain (braid over braid without fusion): generation+inference {:.2}x, training {:.2}x, end to end {:.2}x",
        g.generation_inference, g.training, g.end_to_end
    );
    let g = &cmp.fusion_gain_same_placement;
    let _ = writeln!(
        o,
        "fusion gain on braid's placement (fusion off on the same meshes): generation+inference {:.2}x, training {:.2}x, end to end {:.2}x",
        g.generation_inference, g.training, g.end_to_end
    );
    if let Some((h, s)) = cmp.searched_vs_heuristic {
        let _ = writeln!(
            o,
            "placement (cost model): searched {} vs heuristic {} per iteration",
            secs(s),
            secs(h)
        );
    }
    if let Some(s) = &a.decisions.search
        && !s.simulated.is_empty()
    {
        let c: Vec<String> = s
            .simulated
            .iter()
            .map(|(n, t)| format!("{n} {}", secs(*t)))
            .collect();
        let _ = writeln!(
            o,
            "placement (simulator, before streaming): {}; kept {}",
            c.join(", "),
            s.kept
        );
    }
    let gains: Vec<String> = cmp
        .pass_gains
        .iter()
        .map(|(n, r)| format!("{n} {r:.2}x"))
        .collect();
    let _ = writeln!(
        o,
        "gain of each pass (iteration time without it / with all): {}",
        gains.join(", ")
    );
    let stages: Vec<String> = report
        .stages
        .iter()
        .map(|s| format!("{} {}", s.stage, secs(s.mean_time)))
        .collect();
    let _ = writeln!(
        o,
        "braid stages (mean span per iteration): {}",
        stages.join(", ")
    );
    o
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
    let mut spec = match PipelineSpec::from_json(&text) {
        Ok(p) => p,
        Err(e) => return fail(&args.spec, e),
    };
    if let Some(seed) = args.seed {
        spec.search.seed = seed;
    }
    // The solver runs on integer ticks; real-valued durations and memory are put on the
    // finest decimal grid that holds them (the output says which, in `grid`).
    let (problem, grid) = match spec.to_problem() {
        Ok(p) => p,
        Err(e) => return fail(&args.spec, e),
    };
    if grid.rounded {
        eprintln!(
            "note: {}: values with more than six decimals were rounded to millionths",
            args.spec.display()
        );
    }
    let result = match solve(&problem) {
        Ok(r) => r,
        Err(e) => return fail(&args.spec, e),
    };
    match RealSchedule::new(&result, grid).to_json() {
        Ok(json) => {
            println!("{json}");
            ExitCode::SUCCESS
        }
        Err(e) => fail(&args.spec, e),
    }
}

/// Seconds with a unit that keeps three significant decimals for tiny models.
fn secs(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.3} µs", s * 1e6)
    }
}
