//! `braid lsp`: the language server on stdin and stdout, for editors (`editors/vscode/`).
//! Everything protocol-related lives in `braid-lsp`; this only starts it and maps how the
//! session ended to an exit code: 0 after `shutdown` and `exit`, 1 otherwise.

use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Accepted for clients that pass it (vscode-languageclient does): stdio is the only
    /// transport.
    #[arg(long)]
    stdio: bool,
}

pub fn run(args: Args) -> ExitCode {
    let _ = args.stdio;
    match braid_lsp::run_stdio() {
        Ok(braid_lsp::Exit::Clean) => ExitCode::SUCCESS,
        Ok(braid_lsp::Exit::Abrupt) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: braid lsp: {e}");
            ExitCode::from(1)
        }
    }
}
