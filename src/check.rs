//! `braid check FILE…`: parse and check programs; exit 0 when clean (warnings allowed), 1 on
//! errors, 2 on usage errors such as a file that cannot be read.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::diag::{self, DiskLoader, Format};

#[derive(clap::Args)]
pub struct Args {
    /// The `.rlhf` files to check.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Output format of diagnostics.
    #[arg(long, value_enum, default_value = "human")]
    format: Format,
}

pub fn run(args: Args) -> ExitCode {
    let mut errors = 0;
    let mut warnings = 0;
    for path in &args.files {
        let name = path.display().to_string();
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("error: {name}: {e}");
                return ExitCode::from(2);
            }
        };
        let checked = braid_sema::check(&name, &text, &DiskLoader);
        diag::print(&checked.diagnostics, &checked.sources, args.format);
        let (e, w) = diag::counts(&checked.diagnostics);
        errors += e;
        warnings += w;
    }
    if args.format == Format::Human {
        let files = diag::plural(args.files.len(), "file");
        if errors == 0 && warnings == 0 {
            eprintln!("checked {files}: no problems");
        } else {
            eprintln!(
                "checked {files}: {}, {}",
                diag::plural(errors, "error"),
                diag::plural(warnings, "warning")
            );
        }
    }
    if errors > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
