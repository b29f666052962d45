//! Spans, source files and diagnostics as data.
//!
//! Every problem Braid reports about a user's program is a [`Diagnostic`]: a stable [`Code`]
//! from the one table in [`codes`], a message, labelled spans and a help line. Renderers turn
//! the same value into terminal output (miette), JSON for tools, or LSP messages. This crate
//! must not know how any phase finds problems; it only describes them.

pub mod codes;
mod render;
mod source;

pub use codes::{Code, Severity};
pub use render::{RenderOptions, render_json, render_terminal};
pub use source::{FileId, LineCol, SourceFile, SourceMap, Span};

/// One labelled place in a diagnostic.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Label {
    pub span: Span,
    pub message: String,
    /// The primary label marks the offending span; others point at related places.
    pub primary: bool,
}

/// A problem found in a program: what, where, and what to write instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    pub code: Code,
    pub message: String,
    pub labels: Vec<Label>,
    pub help: Option<String>,
    pub notes: Vec<String>,
}

impl Diagnostic {
    /// Starts a diagnostic with its primary label. Each code has one constructor in the phase
    /// that reports it; those constructors all go through here.
    pub fn new(
        code: Code,
        message: impl Into<String>,
        span: Span,
        label: impl Into<String>,
    ) -> Self {
        Diagnostic {
            code,
            message: message.into(),
            labels: vec![Label {
                span,
                message: label.into(),
                primary: true,
            }],
            help: None,
            notes: Vec::new(),
        }
    }

    pub fn with_label(mut self, span: Span, message: impl Into<String>) -> Self {
        self.labels.push(Label {
            span,
            message: message.into(),
            primary: false,
        });
        self
    }

    pub fn with_help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }

    pub fn with_note(mut self, note: impl Into<String>) -> Self {
        self.notes.push(note.into());
        self
    }

    pub fn severity(&self) -> Severity {
        self.code.severity()
    }

    pub fn is_error(&self) -> bool {
        self.severity() == Severity::Error
    }

    /// The span of the primary label.
    pub fn span(&self) -> Span {
        self.labels
            .iter()
            .find(|l| l.primary)
            .map_or(Span::DUMMY, |l| l.span)
    }
}

/// Sorts diagnostics by file and position, then code, so output is deterministic whatever the
/// order in which phases found them.
pub fn sort(diags: &mut [Diagnostic]) {
    diags.sort_by(|a, b| {
        let (sa, sb) = (a.span(), b.span());
        (sa.file, sa.start, sa.end, a.code.as_str(), &a.message).cmp(&(
            sb.file,
            sb.start,
            sb.end,
            b.code.as_str(),
            &b.message,
        ))
    });
}
