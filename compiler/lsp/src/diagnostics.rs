//! Braid diagnostics as LSP diagnostics: the LSP renderer next to the terminal and JSON ones.
//!
//! The message is the same as `braid check` prints, with the help line and notes appended
//! (LSP has no field for them); secondary labels become related information, also when they
//! point into another file.

use braid_diagnostics::{Diagnostic, Severity};
use lsp_types::{DiagnosticRelatedInformation, DiagnosticSeverity, NumberOrString};

use crate::analysis::Document;
use crate::position;

/// The diagnostics of the document's own file, converted.
pub fn for_document(doc: &Document) -> Vec<lsp_types::Diagnostic> {
    doc.checked
        .diagnostics
        .iter()
        .filter(|d| d.span().file == doc.root())
        .filter_map(|d| to_lsp(doc, d))
        .collect()
}

pub fn to_lsp(doc: &Document, d: &Diagnostic) -> Option<lsp_types::Diagnostic> {
    let primary = d.span();
    let file = doc.checked.sources.get(primary.file)?;
    let mut message = d.message.clone();
    if let Some(help) = &d.help {
        message.push_str("\nhelp: ");
        message.push_str(help);
    }
    for note in &d.notes {
        message.push_str("\nnote: ");
        message.push_str(note);
    }
    let related: Vec<DiagnosticRelatedInformation> = d
        .labels
        .iter()
        .filter(|l| !l.primary)
        .filter_map(|l| {
            Some(DiagnosticRelatedInformation {
                location: doc.location(l.span)?,
                message: l.message.clone(),
            })
        })
        .collect();
    Some(lsp_types::Diagnostic {
        range: position::range(file, primary.start, primary.end),
        severity: Some(match d.severity() {
            Severity::Error => DiagnosticSeverity::ERROR,
            Severity::Warning => DiagnosticSeverity::WARNING,
        }),
        code: Some(NumberOrString::String(d.code.as_str().to_string())),
        code_description: None,
        source: Some("braid".into()),
        message,
        related_information: (!related.is_empty()).then_some(related),
        tags: None,
        data: None,
    })
}
