//! The Braid language server: the only crate that knows the Language Server Protocol.
//!
//! It serves one client over stdio (`braid lsp`) or over any [`lsp_server::Connection`] (tests
//! and the benchmark use an in-memory one). Analysis is `braid_sema::check` on the whole
//! document at every change; diagnostics, hover, definitions, references, completion, the
//! outline, formatting and quick fixes all read the checked program and the stdlib tables. The
//! server does no async: one thread handles messages in order. Positions are UTF-16 code units
//! on the wire and byte offsets inside ([`position`]).

mod actions;
mod analysis;
mod completion;
mod diagnostics;
pub mod hover;
mod navigate;
pub mod position;
mod server;
mod transport;

pub use server::{Exit, capabilities, serve};

/// Serves a client on stdin and stdout until it exits. Returns how the session ended, or the
/// I/O error that ended it.
pub fn run_stdio() -> std::io::Result<Exit> {
    let (conn, threads) = transport::stdio()?;
    let exit = serve(&conn);
    // Dropping the connection closes the writer's channel so that it can finish.
    drop(conn);
    threads.join()?;
    Ok(exit)
}

#[cfg(test)]
mod robustness {
    //! Every request handler at every position of every example, error-gallery program and
    //! stdlib module, and of truncated copies of them (half-typed programs): nothing panics.

    use std::path::Path;

    use braid_diagnostics::SourceFile;
    use lsp_types::Range;

    use crate::analysis::test_document;
    use crate::{actions, completion, hover, navigate, position};

    fn sources() -> Vec<String> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut out = Vec::new();
        for dir in ["examples", "examples/errors", "stdlib/std"] {
            let mut paths: Vec<_> = std::fs::read_dir(root.join(dir))
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|x| x == "rlhf"))
                .collect();
            paths.sort();
            out.extend(paths.iter().map(|p| std::fs::read_to_string(p).unwrap()));
        }
        assert!(out.len() >= 15, "found {} files", out.len());
        out
    }

    fn every_feature(text: &str, step: usize) {
        let doc = test_document(text);
        let file = SourceFile::new("t", text);
        let _ = navigate::symbols(&doc);
        let _ = actions::format(&doc);
        let whole = position::whole(&file);
        let _ = actions::code_actions(&doc, whole);
        let offsets = text
            .char_indices()
            .map(|(i, _)| i)
            .chain([text.len()])
            .step_by(step);
        for offset in offsets {
            let pos = position::offset_to_position(&file, offset as u32);
            let _ = hover::hover(&doc, pos);
            let _ = navigate::definition(&doc, pos);
            let _ = navigate::references(&doc, pos, true);
            let _ = completion::complete(&doc, pos);
            let _ = actions::code_actions(
                &doc,
                Range {
                    start: pos,
                    end: pos,
                },
            );
        }
    }

    #[test]
    fn every_handler_at_every_position_never_panics() {
        for text in sources() {
            every_feature(&text, 1);
            // Half-typed programs: every tenth prefix, queried at every seventh character.
            let cuts: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
            for cut in cuts.iter().step_by((cuts.len() / 10).max(1)) {
                every_feature(&text[..*cut], 7);
            }
        }
    }
}
