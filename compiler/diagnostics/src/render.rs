//! Renderers over the one [`Diagnostic`] type: the terminal (through miette) and JSON.
//!
//! miette is only an adapter here: nothing outside this module knows it exists. Labels that
//! point into another file than the primary label's become notes with a `file:line:col`, since
//! one miette report shows one source.

use std::fmt;

use miette::{GraphicalReportHandler, GraphicalTheme, LabeledSpan, NamedSource, SourceSpan};
use serde::Serialize;

use crate::{Diagnostic, Severity, SourceMap};

/// How the terminal renderer draws.
#[derive(Debug, Clone, Copy)]
pub struct RenderOptions {
    /// Colour and styling; the CLI turns it on only for a TTY without `NO_COLOR`.
    pub color: bool,
    /// Wrap width; snapshots use a fixed width so they do not depend on the terminal.
    pub width: usize,
}

impl Default for RenderOptions {
    fn default() -> Self {
        RenderOptions {
            color: false,
            width: 100,
        }
    }
}

struct MietteAdapter<'a> {
    diag: &'a Diagnostic,
    source: NamedSource<String>,
    labels: Vec<LabeledSpan>,
    help: Option<String>,
}

impl fmt::Debug for MietteAdapter<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MietteAdapter")
            .field("code", &self.diag.code)
            .finish()
    }
}

impl fmt::Display for MietteAdapter<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.diag.message)
    }
}

impl std::error::Error for MietteAdapter<'_> {}

impl miette::Diagnostic for MietteAdapter<'_> {
    fn code<'b>(&'b self) -> Option<Box<dyn fmt::Display + 'b>> {
        Some(Box::new(format!(
            "{}({})",
            self.diag.code.as_str(),
            self.diag.code.name()
        )))
    }

    fn severity(&self) -> Option<miette::Severity> {
        Some(match self.diag.severity() {
            Severity::Error => miette::Severity::Error,
            Severity::Warning => miette::Severity::Warning,
        })
    }

    fn help<'b>(&'b self) -> Option<Box<dyn fmt::Display + 'b>> {
        self.help
            .as_ref()
            .map(|h| Box::new(h) as Box<dyn fmt::Display>)
    }

    fn source_code(&self) -> Option<&dyn miette::SourceCode> {
        Some(&self.source)
    }

    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        Some(Box::new(self.labels.iter().cloned()))
    }
}

/// Renders one diagnostic for a terminal.
pub fn render_terminal(diag: &Diagnostic, sources: &SourceMap, opts: RenderOptions) -> String {
    let primary = diag.span();
    let (name, text) = match sources.get(primary.file) {
        Some(f) => (f.name.clone(), f.text.clone()),
        None => ("<builtin>".to_string(), String::new()),
    };
    let len = text.len();
    let mut labels = Vec::new();
    let mut notes = Vec::new();
    for l in &diag.labels {
        if l.span.file == primary.file && !l.span.is_dummy() {
            let start = (l.span.start as usize).min(len);
            let end = (l.span.end as usize).clamp(start, len);
            let span = SourceSpan::new(start.into(), end - start);
            let msg = if l.message.is_empty() {
                None
            } else {
                Some(l.message.clone())
            };
            labels.push(if l.primary {
                LabeledSpan::new_primary_with_span(msg, span)
            } else {
                LabeledSpan::new_with_span(msg, span)
            });
        } else if !l.span.is_dummy() {
            notes.push(format!("{}: {}", sources.location(l.span), l.message));
        }
    }
    notes.extend(diag.notes.iter().cloned());
    let help = match (&diag.help, notes.is_empty()) {
        (Some(h), true) => Some(h.clone()),
        (h, false) => {
            let mut s = notes
                .iter()
                .map(|n| format!("note: {n}"))
                .collect::<Vec<_>>()
                .join("\n");
            if let Some(h) = h {
                s = format!("{h}\n{s}");
            }
            Some(s)
        }
        (None, true) => None,
    };
    let adapter = MietteAdapter {
        diag,
        source: NamedSource::new(name, text),
        labels,
        help,
    };
    let theme = if opts.color {
        GraphicalTheme::unicode()
    } else {
        GraphicalTheme::unicode_nocolor()
    };
    let handler = GraphicalReportHandler::new_themed(theme)
        .with_width(opts.width)
        .with_links(false);
    let mut out = String::new();
    if handler.render_report(&mut out, &adapter).is_err() {
        // Rendering into a String cannot fail short of a bug in miette; fall back to one line.
        out = format!(
            "{}[{}]: {}\n",
            diag.severity_word(),
            diag.code,
            diag.message
        );
    }
    out
}

impl Diagnostic {
    fn severity_word(&self) -> &'static str {
        match self.severity() {
            Severity::Error => "error",
            Severity::Warning => "warning",
        }
    }
}

#[derive(Serialize)]
struct JsonLabel<'a> {
    file: &'a str,
    start: u32,
    end: u32,
    line: u32,
    column: u32,
    end_line: u32,
    end_column: u32,
    message: &'a str,
    primary: bool,
}

#[derive(Serialize)]
struct JsonDiagnostic<'a> {
    code: &'a str,
    name: &'a str,
    severity: Severity,
    message: &'a str,
    labels: Vec<JsonLabel<'a>>,
    help: Option<&'a str>,
    notes: &'a [String],
}

/// Renders one diagnostic as a single-line JSON object (for `--format json`).
pub fn render_json(diag: &Diagnostic, sources: &SourceMap) -> String {
    let labels = diag
        .labels
        .iter()
        .map(|l| {
            let file = sources.get(l.span.file);
            let (s, e) = match file {
                Some(f) => (f.line_col(l.span.start), f.line_col(l.span.end)),
                None => (
                    crate::LineCol { line: 0, col: 0 },
                    crate::LineCol { line: 0, col: 0 },
                ),
            };
            JsonLabel {
                file: file.map_or("<builtin>", |f| f.name.as_str()),
                start: l.span.start,
                end: l.span.end,
                line: s.line,
                column: s.col,
                end_line: e.line,
                end_column: e.col,
                message: &l.message,
                primary: l.primary,
            }
        })
        .collect();
    let j = JsonDiagnostic {
        code: diag.code.as_str(),
        name: diag.code.name(),
        severity: diag.severity(),
        message: &diag.message,
        labels,
        help: diag.help.as_deref(),
        notes: &diag.notes,
    };
    serde_json::to_string(&j).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Code, Span};

    #[test]
    fn terminal_and_json_show_code_span_and_help() {
        let mut sm = SourceMap::new();
        let f = sm.add("x.rlhf", "let a = b\n");
        let d = Diagnostic::new(
            Code::E0201,
            "unknown name `b`",
            Span::new(f, 8, 9),
            "not defined",
        )
        .with_help("define `b` first");
        let t = render_terminal(&d, &sm, RenderOptions::default());
        assert!(t.contains("E0201(unknown-name)"), "{t}");
        assert!(t.contains("x.rlhf:1:9"), "{t}");
        assert!(t.contains("define `b` first"), "{t}");
        assert!(!t.contains('\u{1b}'), "no colour codes when colour is off");
        let j: serde_json::Value = serde_json::from_str(&render_json(&d, &sm)).unwrap();
        assert_eq!(j["code"], "E0201");
        assert_eq!(j["labels"][0]["line"], 1);
        assert_eq!(j["labels"][0]["column"], 9);
    }
}
