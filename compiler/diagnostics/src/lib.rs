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

/// A mechanical edit that resolves a diagnostic: replace the text of `span` with
/// `replacement`. Only set where the fix is certain enough to apply with one click (a "did you
/// mean" suggestion, a rename); the language server offers it as a code action.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Fix {
    pub span: Span,
    pub replacement: String,
    /// What the edit does, in a few words: "Replace with `grpo`".
    pub title: String,
}

/// A problem found in a program: what, where, and what to write instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    pub code: Code,
    pub message: String,
    pub labels: Vec<Label>,
    pub help: Option<String>,
    pub notes: Vec<String>,
    /// Edits that fix the problem, if one is mechanical.
    pub fixes: Vec<Fix>,
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
            fixes: Vec::new(),
        }
    }

    /// Adds a mechanical fix: replace `span` with `replacement`.
    pub fn with_fix(
        mut self,
        span: Span,
        replacement: impl Into<String>,
        title: impl Into<String>,
    ) -> Self {
        self.fixes.push(Fix {
            span,
            replacement: replacement.into(),
            title: title.into(),
        });
        self
    }

    /// Adds the fix for a "did you mean `x`?" suggestion, if there is one: replace the
    /// misspelt text at `span` with `suggestion`.
    pub fn with_suggestion(self, span: Span, suggestion: Option<&str>) -> Self {
        match suggestion {
            Some(s) => self.with_fix(span, s, format!("Replace with `{s}`")),
            None => self,
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
