//! `braid fmt [--check] FILE…`: rewrite files in the canonical layout, keeping comments.
//! `-` formats standard input to standard output.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use braid_diagnostics::SourceMap;

use crate::diag::{self, Format};

#[derive(clap::Args)]
pub struct Args {
    /// The `.rlhf` files to format, or `-` for standard input.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Do not write: list the files whose layout differs and exit 1 if any does.
    #[arg(long)]
    check: bool,
}

pub fn run(args: Args) -> ExitCode {
    let mut failed = false;
    let mut differ = Vec::new();
    for path in &args.files {
        let stdin = path.as_os_str() == "-";
        let name = if stdin {
            "<stdin>".to_string()
        } else {
            path.display().to_string()
        };
        let text = if stdin {
            let mut s = String::new();
            if let Err(e) = std::io::stdin().read_to_string(&mut s) {
                eprintln!("error: {name}: {e}");
                return ExitCode::from(2);
            }
            s
        } else {
            match std::fs::read_to_string(path) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("error: {name}: {e}");
                    return ExitCode::from(2);
                }
            }
        };
        match braid_syntax::format::format(&text) {
            Err(diags) => {
                let mut sources = SourceMap::new();
                sources.add(name.clone(), text);
                diag::print(&diags, &sources, Format::Human);
                eprintln!("error: {name}: not formatted: it has syntax errors");
                failed = true;
            }
            Ok(out) if stdin => print!("{out}"),
            Ok(out) if out == text => {}
            Ok(out) => {
                if args.check {
                    println!("{name}");
                    differ.push(name);
                } else if let Err(e) = write_atomically(path, &out) {
                    eprintln!("error: {name}: cannot write: {e}");
                    failed = true;
                }
            }
        }
    }
    if args.check && !differ.is_empty() {
        eprintln!(
            "{} not formatted; run `braid fmt` on {}",
            diag::plural(differ.len(), "file"),
            if differ.len() == 1 { "it" } else { "them" }
        );
        return ExitCode::from(1);
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// Writes through a temporary file and a rename, so an interrupted `fmt` never truncates a file.
fn write_atomically(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    let tmp = path.with_extension("rlhf.fmt-tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}
