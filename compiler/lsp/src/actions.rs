//! Formatting and code actions: edits computed by the formatter and by the checker.
//!
//! Formatting replaces the whole document with `braid fmt`'s output, and makes no edit when
//! the file has syntax errors (the formatter refuses them rather than guess). Code actions are
//! the mechanical fixes the checker attached to its diagnostics (`Diagnostic::fixes`); this
//! module only turns them into workspace edits.

use std::collections::HashMap;

use lsp_types::{CodeAction, CodeActionKind, CodeActionOrCommand, Range, TextEdit, WorkspaceEdit};

use crate::analysis::Document;
use crate::{diagnostics, position};

pub fn format(doc: &Document) -> Vec<TextEdit> {
    let Some(file) = doc.file() else {
        return vec![];
    };
    match braid_syntax::format::format(&doc.text) {
        Ok(formatted) if formatted != doc.text => vec![TextEdit {
            range: position::whole(file),
            new_text: formatted,
        }],
        Ok(_) | Err(_) => vec![],
    }
}

fn overlaps(a: Range, b: Range) -> bool {
    a.start <= b.end && b.start <= a.end
}

/// The fixes of the diagnostics that touch `range`, one quick fix each.
pub fn code_actions(doc: &Document, range: Range) -> Vec<CodeActionOrCommand> {
    let Some(file) = doc.file() else {
        return vec![];
    };
    let mut out = Vec::new();
    for d in &doc.checked.diagnostics {
        let span = d.span();
        if span.file != doc.root() || d.fixes.is_empty() {
            continue;
        }
        if !overlaps(position::range(file, span.start, span.end), range) {
            continue;
        }
        let lsp_diag = diagnostics::to_lsp(doc, d);
        for fix in &d.fixes {
            if fix.span.file != doc.root() {
                continue;
            }
            let edit = TextEdit {
                range: position::range(file, fix.span.start, fix.span.end),
                new_text: fix.replacement.clone(),
            };
            #[allow(clippy::mutable_key_type)] // `Uri` caches nothing mutable that affects hashing.
            let changes = HashMap::from([(doc.uri.clone(), vec![edit])]);
            out.push(CodeActionOrCommand::CodeAction(CodeAction {
                title: fix.title.clone(),
                kind: Some(CodeActionKind::QUICKFIX),
                diagnostics: lsp_diag.clone().map(|x| vec![x]),
                edit: Some(WorkspaceEdit {
                    changes: Some(changes),
                    ..WorkspaceEdit::default()
                }),
                is_preferred: Some(d.fixes.len() == 1),
                ..CodeAction::default()
            }));
        }
    }
    out
}
