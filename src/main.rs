//! The `braid` command line: the only place in the workspace that prints.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[cfg(feature = "runtime")]
mod generate;

#[derive(Parser)]
#[command(name = "braid", version, about = "A compiler and runtime for RLHF pipelines")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Sample completions from a model directory or a tiny model.
    #[cfg(feature = "runtime")]
    Generate(generate::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        #[cfg(feature = "runtime")]
        Command::Generate(args) => generate::run(args),
    }
}
