//! Printing diagnostics, and reading `.rlhf` files and their imports from disk for the
//! compiler (whose crates do no I/O of their own).

use std::io::IsTerminal;

use braid_diagnostics::{Diagnostic, RenderOptions, Severity, SourceMap};

/// How diagnostics are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Rendered for people, with source snippets (colour on a terminal unless NO_COLOR is set).
    Human,
    /// One JSON object per diagnostic per line, on stdout, for tools.
    Json,
}

/// Reads imports from the file system, relative to the importing file.
pub struct DiskLoader;

impl braid_sema::Loader for DiskLoader {
    fn load(&self, from: &str, path: &str) -> Result<(String, String), String> {
        let name = braid_sema::join(from, path);
        std::fs::read_to_string(&name)
            .map(|t| (name.clone(), t))
            .map_err(|e| e.to_string())
    }
}

fn color_wanted() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Prints diagnostics in the chosen format.
pub fn print(diags: &[Diagnostic], sources: &SourceMap, format: Format) {
    match format {
        Format::Json => {
            for d in diags {
                println!("{}", braid_diagnostics::render_json(d, sources));
            }
        }
        Format::Human => {
            let width = if color_wanted() {
                terminal_width()
            } else {
                100
            };
            let opts = RenderOptions {
                color: color_wanted(),
                width,
            };
            for d in diags {
                eprint!("{}", braid_diagnostics::render_terminal(d, sources, opts));
                eprintln!();
            }
        }
    }
}

fn terminal_width() -> usize {
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(100)
}

/// Counts errors and warnings.
pub fn counts(diags: &[Diagnostic]) -> (usize, usize) {
    let errors = diags
        .iter()
        .filter(|d| d.severity() == Severity::Error)
        .count();
    (errors, diags.len() - errors)
}

pub fn plural(n: usize, word: &str) -> String {
    if n == 1 {
        format!("{n} {word}")
    } else {
        format!("{n} {word}s")
    }
}
