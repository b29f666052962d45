//! The `braid` command line: the only place in the workspace that prints.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod against;
#[cfg(feature = "runtime")]
mod calibrate;
mod check;
mod diag;
mod eval;
mod fmt;
#[cfg(feature = "runtime")]
mod generate;
#[cfg(feature = "runtime")]
mod launch;
mod lsp;
mod plan;
mod report;
#[cfg(feature = "runtime")]
mod run;
mod sim;
mod study;

#[derive(Parser)]
#[command(
    name = "braid",
    version,
    about = "A compiler and runtime for RLHF pipelines"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Measure this device's cost-model constants and write a device profile.
    #[cfg(feature = "runtime")]
    Calibrate(calibrate::Args),
    /// Parse and check programs; report diagnostics.
    Check(check::Args),
    /// Rewrite programs in the canonical layout.
    Fmt(fmt::Args),
    /// Evaluate a `fn` on recorded samples (JIT-compiled).
    Eval(eval::Args),
    /// Sample completions from a model directory or a tiny model.
    #[cfg(feature = "runtime")]
    Generate(generate::Args),
    /// Start the ranks of a multi-process job on this node, as torchrun does.
    #[cfg(feature = "runtime")]
    Launch(launch::Args),
    /// Start the language server on stdio.
    Lsp(lsp::Args),
    /// Write an HTML page with a run's metric plots and stage timeline.
    Report(report::Args),
    /// Train: execute a program's run, with checkpoints and metrics.
    #[cfg(feature = "runtime")]
    Run(run::Args),
    /// Plan a program's run for a cluster: devices, layouts, fusion, predicted time and memory.
    Plan(plan::Args),
    /// Simulate and schedule at cluster scale without GPUs.
    Sim(sim::Args),
}

fn main() -> ExitCode {
    #[cfg(feature = "runtime")]
    match braid_runtime::device::steady_host_allocator() {
        Ok(braid_runtime::device::HostAllocator::Refused(setting)) => eprintln!(
            "warning: glibc refused {setting}; tensors on the host are allocated with glibc's moving thresholds, and step times may vary with the steps before them"
        ),
        Ok(_) => {}
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    }
    let cli = Cli::parse();
    match cli.command {
        #[cfg(feature = "runtime")]
        Command::Calibrate(args) => calibrate::run(args),
        Command::Check(args) => check::run(args),
        Command::Fmt(args) => fmt::run(args),
        Command::Eval(args) => eval::run(args),
        #[cfg(feature = "runtime")]
        Command::Generate(args) => generate::run(args),
        #[cfg(feature = "runtime")]
        Command::Launch(args) => launch::run(args),
        Command::Lsp(args) => lsp::run(args),
        Command::Report(args) => report::run(args),
        #[cfg(feature = "runtime")]
        Command::Run(args) => run::run(args),
        Command::Plan(args) => plan::run(args),
        Command::Sim(args) => sim::run(args),
    }
}
