//! Completion, chosen by what precedes the cursor: standard modules after `use std::`, `Sample`
//! fields after `s.`, option keys at the start of an entry of a `model`, `dataset`, `cluster` or
//! `run` block, and otherwise keywords, the names in scope and the built-ins.
//!
//! The context is read from the text with a small scanner (brackets outside strings and
//! comments), because the text being typed is often not a complete program; the names come from
//! the last check, which recovers at item boundaries.

use braid_stdlib::OptionSpec;
use lsp_types::{
    CompletionItem, CompletionItemKind, Documentation, MarkupContent, MarkupKind, Position,
};

use crate::analysis::Document;
use crate::hover::owners;
use crate::position;

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

pub fn complete(doc: &Document, pos: Position) -> Vec<CompletionItem> {
    let Some(file) = doc.file() else {
        return vec![];
    };
    let text = doc.text.as_str();
    let offset = (position::position_to_offset(file, pos) as usize).min(text.len());
    let line_start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let before = &text[line_start..offset];
    let word_start = before.trim_end_matches(is_ident);
    let head = before.trim_start();
    if let Some(rest) = head.strip_prefix("use")
        && rest.trim_start().starts_with("std::")
    {
        return braid_stdlib::MODULES
            .iter()
            .map(|m| CompletionItem {
                label: m.name.to_string(),
                kind: Some(CompletionItemKind::MODULE),
                detail: Some(format!("std::{}", m.name)),
                documentation: first_comment(m.source).map(markdown),
                ..CompletionItem::default()
            })
            .collect();
    }
    if let Some(base) = word_start.strip_suffix('.') {
        // `s.` but not `1.` (a float being typed).
        let name = &base[base.trim_end_matches(is_ident).len()..];
        if name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_') {
            return options(braid_stdlib::SAMPLE_FIELDS, CompletionItemKind::FIELD);
        }
    }
    let entry_start =
        word_start.trim_end().is_empty() || word_start.trim_end().ends_with([',', '{']);
    if entry_start && let Some(block) = enclosing_block(text, offset) {
        match block {
            Block::Model => {
                return options(braid_stdlib::MODEL_OPTIONS, CompletionItemKind::PROPERTY);
            }
            Block::Dataset => {
                return options(braid_stdlib::DATASET_OPTIONS, CompletionItemKind::PROPERTY);
            }
            Block::Cluster => {
                return options(braid_stdlib::CLUSTER_OPTIONS, CompletionItemKind::PROPERTY);
            }
            Block::Run(pipeline) => return run_settings(doc, &pipeline),
            Block::Other => {}
        }
    }
    general(doc, offset as u32)
}

fn markdown(value: String) -> Documentation {
    Documentation::MarkupContent(MarkupContent {
        kind: MarkupKind::Markdown,
        value,
    })
}

/// The leading `//` comment of a module: what it provides.
fn first_comment(source: &str) -> Option<String> {
    let lines: Vec<&str> = source
        .lines()
        .take_while(|l| l.starts_with("//"))
        .map(|l| l.trim_start_matches('/').trim())
        .collect();
    (!lines.is_empty()).then(|| lines.join(" "))
}

fn options(specs: &[OptionSpec], kind: CompletionItemKind) -> Vec<CompletionItem> {
    specs
        .iter()
        .map(|o| {
            let mut doc = o.doc.to_string();
            if !o.values.is_empty() {
                doc.push_str(&format!("\n\nOne of: {}", o.values.join(", ")));
            }
            CompletionItem {
                label: o.key.to_string(),
                kind: Some(kind),
                detail: Some(o.ty.to_string()),
                documentation: Some(markdown(doc)),
                ..CompletionItem::default()
            }
        })
        .collect()
}

fn run_settings(doc: &Document, pipeline: &str) -> Vec<CompletionItem> {
    let mut items = Vec::new();
    if let Some(p) = doc.checked.program.pipeline_by_name(pipeline) {
        for s in &p.settings {
            items.push(CompletionItem {
                label: s.name.clone(),
                kind: Some(CompletionItemKind::PROPERTY),
                detail: Some(s.ty.to_string()),
                documentation: Some(markdown(format!("a `param` of pipeline `{}`", p.name))),
                ..CompletionItem::default()
            });
        }
    }
    items.extend(options(
        braid_stdlib::RUN_SETTINGS,
        CompletionItemKind::PROPERTY,
    ));
    items
}

/// The doc of the option key at `offset` (`dtype` in `dtype: bf16`), with its byte range.
pub(crate) fn option_doc(doc: &Document, offset: usize) -> Option<(String, usize, usize)> {
    let text = doc.text.as_str();
    let offset = offset.min(text.len());
    let start = text[..offset].trim_end_matches(is_ident).len();
    let end = offset + (text[offset..].len() - text[offset..].trim_start_matches(is_ident).len());
    let key = &text[start..end];
    let after = text[end..].trim_start_matches([' ', '\t']);
    if key.is_empty() || !after.starts_with(':') || after.starts_with("::") {
        return None;
    }
    let specs: &[OptionSpec] = match enclosing_block(text, start)? {
        Block::Model => braid_stdlib::MODEL_OPTIONS,
        Block::Dataset => braid_stdlib::DATASET_OPTIONS,
        Block::Cluster => braid_stdlib::CLUSTER_OPTIONS,
        Block::Run(pipeline) => {
            if let Some(s) = doc
                .checked
                .program
                .pipeline_by_name(&pipeline)
                .and_then(|p| p.settings.iter().find(|s| s.name == key))
            {
                let text = format!(
                    "```braid\nparam {}: {}\n```\na setting of pipeline `{pipeline}`",
                    s.name, s.ty
                );
                return Some((text, start, end));
            }
            braid_stdlib::RUN_SETTINGS
        }
        Block::Other => return None,
    };
    let spec = specs.iter().find(|o| o.key == key)?;
    let mut text = format!("```braid\n{}: {}\n```\n{}", spec.key, spec.ty, spec.doc);
    if !spec.values.is_empty() {
        text.push_str(&format!("\n\nOne of: {}", spec.values.join(", ")));
    }
    Some((text, start, end))
}

fn general(doc: &Document, offset: u32) -> Vec<CompletionItem> {
    let program = &doc.checked.program;
    let mut items: Vec<CompletionItem> = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    let mut push = |item: CompletionItem, items: &mut Vec<CompletionItem>| {
        if seen.insert(item.label.clone()) {
            items.push(item);
        }
    };
    let mut bodies: Vec<_> = owners(program, doc.root())
        .filter(|o| o.span.start <= offset && offset <= o.span.end)
        .collect();
    // Inside a body that does not parse now: the locals of the body that was there when the
    // file last parsed (its span is from that text, so it is a close guess, not exact).
    if bodies.is_empty()
        && let Some(last) = &doc.last_parsed
    {
        bodies = owners(last, doc.root())
            .filter(|o| o.span.start <= offset && offset <= o.span.end.saturating_add(64))
            .collect();
    }
    for l in bodies.iter().flat_map(|o| o.locals.iter()) {
        push(
            CompletionItem {
                label: l.name.clone(),
                kind: Some(CompletionItemKind::VARIABLE),
                detail: Some(format!("{} · {}", l.ty, l.gran.as_str())),
                ..CompletionItem::default()
            },
            &mut items,
        );
    }
    for f in &program.fns {
        let detail =
            crate::hover::describe_def(program, braid_sema::hir::Def::Fn(fn_id(program, f)));
        push(
            CompletionItem {
                label: f.name.clone(),
                kind: Some(CompletionItemKind::FUNCTION),
                detail: Some(format!("fn from {}", f.module)),
                documentation: detail.map(markdown),
                ..CompletionItem::default()
            },
            &mut items,
        );
    }
    for p in &program.pipelines {
        push(
            CompletionItem {
                label: p.name.clone(),
                kind: Some(CompletionItemKind::MODULE),
                detail: Some(format!("pipeline from {}", p.module)),
                ..CompletionItem::default()
            },
            &mut items,
        );
    }
    for m in &program.models {
        push(
            CompletionItem {
                label: m.name.clone(),
                kind: Some(CompletionItemKind::VARIABLE),
                detail: Some("Model".into()),
                ..CompletionItem::default()
            },
            &mut items,
        );
    }
    for d in &program.datasets {
        push(
            CompletionItem {
                label: d.name.clone(),
                kind: Some(CompletionItemKind::VARIABLE),
                detail: Some("Dataset".into()),
                ..CompletionItem::default()
            },
            &mut items,
        );
    }
    for b in braid_stdlib::BUILTINS {
        push(
            CompletionItem {
                label: b.name.to_string(),
                kind: Some(CompletionItemKind::FUNCTION),
                detail: Some(b.signature()),
                documentation: Some(markdown(b.doc.to_string())),
                ..CompletionItem::default()
            },
            &mut items,
        );
    }
    for k in braid_syntax::KEYWORDS {
        push(
            CompletionItem {
                label: k.to_string(),
                kind: Some(CompletionItemKind::KEYWORD),
                ..CompletionItem::default()
            },
            &mut items,
        );
    }
    items
}

fn fn_id(program: &braid_sema::hir::Program, f: &braid_sema::hir::Fn) -> braid_sema::hir::FnId {
    let i = program
        .fns
        .iter()
        .position(|x| std::ptr::eq(x, f))
        .unwrap_or(0);
    braid_sema::hir::FnId(i as u32)
}

/// The kind of options block whose `{` encloses the cursor, if any.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Block {
    Model,
    Dataset,
    Cluster,
    /// A `run` block, with the name of the pipeline it runs.
    Run(String),
    Other,
}

pub(crate) fn enclosing_block(text: &str, offset: usize) -> Option<Block> {
    let bytes = &text.as_bytes()[..offset];
    let mut stack: Vec<usize> = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            b'"' => {
                let raw = i > 0 && bytes[i - 1] == b'r';
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' && bytes[i] != b'\n' {
                    if !raw && bytes[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
            }
            b'{' => stack.push(i),
            b'}' => {
                stack.pop();
            }
            _ => {}
        }
        i += 1;
    }
    let open = *stack.last()?;
    let line_start = text[..open].rfind('\n').map_or(0, |i| i + 1);
    let line = text[line_start..open].trim_start();
    let word: String = line.chars().take_while(|c| is_ident(*c)).collect();
    Some(match word.as_str() {
        "model" => Block::Model,
        "dataset" => Block::Dataset,
        "cluster" => Block::Cluster,
        "run" => {
            let name: String = line[3..]
                .trim_start()
                .chars()
                .take_while(|c| is_ident(*c) || *c == ':')
                .collect();
            Block::Run(name.rsplit("::").next().unwrap_or("").to_string())
        }
        _ => Block::Other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::test_document;

    fn labels_at_end(text: &str) -> Vec<String> {
        let doc = test_document(text);
        let file = braid_diagnostics::SourceFile::new("t", text);
        let end = position::offset_to_position(&file, text.len() as u32);
        complete(&doc, end).into_iter().map(|i| i.label).collect()
    }

    #[test]
    fn the_context_picks_the_list() {
        let fields = labels_at_end("fn f(s: Sample) -> float {\n  len(s.");
        assert_eq!(
            fields,
            [
                "prompt",
                "completion",
                "answer",
                "length",
                "group",
                "tokens"
            ]
        );
        let general = labels_at_end("fn f(s: Sample) -> float {\n  1.");
        assert!(general.iter().any(|l| l == "len") && !general.iter().any(|l| l == "prompt"));
        let cluster = labels_at_end("cluster {\n  gpus: 8\n  g");
        assert_eq!(cluster, ["gpus", "gpu", "nodes", "cpu", "cpus"]);
        let dataset = labels_at_end("dataset d = jsonl(\"x\") { shuffle: true, ");
        assert!(dataset.contains(&"fields".to_string()), "{dataset:?}");
        // A value position inside an options block is not a key position.
        let value = labels_at_end("model m = tiny() {\n  dtype: ");
        assert!(!value.contains(&"grad_clip".to_string()), "{value:?}");
    }

    #[test]
    fn the_enclosing_block_ignores_braces_in_strings_and_comments() {
        let text = "model m = tiny() {\n  // {\n  dtype: \"{\", ";
        assert_eq!(enclosing_block(text, text.len()), Some(Block::Model));
        let text = "run std::grpo(p, d) {\n  steps: 1,\n  ";
        assert_eq!(
            enclosing_block(text, text.len()),
            Some(Block::Run("grpo".into()))
        );
        let text = "model m = tiny() { dtype: f32 }\n";
        assert_eq!(enclosing_block(text, text.len()), None);
    }
}
