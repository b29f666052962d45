//! Go to definition, find references and the document outline, from the checker's
//! `references` (every resolved use of a name with its definition's span).

use braid_diagnostics::Span;
use braid_sema::hir::Def;
use lsp_types::{DocumentSymbol, Location, Position, SymbolKind};

use crate::analysis::Document;
use crate::hover::definitions;
use crate::position;

/// What the name at `offset` of the document stands for: its definition and span.
fn target(doc: &Document, offset: u32) -> Option<(Def, Span)> {
    let program = &doc.checked.program;
    let root = doc.root();
    let inside = |s: Span| s.file == root && s.start <= offset && offset <= s.end;
    if let Some(r) = program
        .references
        .iter()
        .filter(|r| inside(r.span))
        .min_by_key(|r| r.span.len())
    {
        return Some((r.def, r.def_span));
    }
    if let Some(found) = definitions(program).find(|(_, s)| inside(*s)) {
        return Some(found);
    }
    // A local's own definition (a `let`, a parameter): its span is its name.
    for owner in crate::hover::owners(program, root) {
        if let Some((n, l)) = owner
            .locals
            .iter()
            .enumerate()
            .find(|(_, l)| inside(l.span))
        {
            return Some((Def::Local(braid_sema::hir::LocalId(n as u32)), l.span));
        }
    }
    None
}

fn offset(doc: &Document, pos: Position) -> Option<u32> {
    Some(position::position_to_offset(doc.file()?, pos))
}

pub fn definition(doc: &Document, pos: Position) -> Option<Location> {
    let offset = offset(doc, pos)?;
    match target(doc, offset) {
        Some((_, span)) => doc.location(span),
        None => imported_module(doc, offset),
    }
}

/// On a `use` line: the start of the module it imports.
fn imported_module(doc: &Document, offset: u32) -> Option<Location> {
    let text = doc.text.as_str();
    let offset = (offset as usize).min(text.len());
    let start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let end = text[start..].find('\n').map_or(text.len(), |i| start + i);
    let rest = text[start..end].trim().strip_prefix("use")?.trim_start();
    let rest = rest.split("//").next().unwrap_or("").trim();
    let name = match rest.strip_prefix("std::") {
        Some(module) => braid_stdlib::file_name(module),
        None => braid_sema::join(&doc.name, rest.trim_matches('"')),
    };
    let (id, _) = doc.checked.sources.files().find(|(_, f)| f.name == name)?;
    doc.location(braid_diagnostics::Span::new(id, 0, 0))
}

/// Two uses refer to the same thing when their definitions are the same span (local ids are
/// per body, so the id alone is ambiguous); built-ins have no span and compare by name.
fn same(a: (Def, Span), r: &braid_sema::hir::Reference) -> bool {
    if a.1.is_dummy() {
        r.def == a.0 && r.def_span.is_dummy()
    } else {
        r.def_span == a.1
    }
}

pub fn references(doc: &Document, pos: Position, include_declaration: bool) -> Vec<Location> {
    let Some(t) = offset(doc, pos).and_then(|o| target(doc, o)) else {
        return vec![];
    };
    let program = &doc.checked.program;
    let mut spans: Vec<Span> = program
        .references
        .iter()
        .filter(|r| same(t, r))
        .map(|r| r.span)
        .collect();
    if include_declaration && !t.1.is_dummy() {
        spans.push(t.1);
    }
    spans.sort();
    spans.dedup();
    spans.into_iter().filter_map(|s| doc.location(s)).collect()
}

#[allow(deprecated)] // `DocumentSymbol::deprecated` must be written out; it is `None`.
fn symbol(
    doc: &Document,
    name: &str,
    detail: String,
    kind: SymbolKind,
    span: Span,
    name_span: Span,
) -> Option<DocumentSymbol> {
    let file = doc.file()?;
    let range = position::range(file, span.start, span.end);
    let mut selection = position::range(file, name_span.start, name_span.end);
    if !(range.start <= selection.start && selection.end <= range.end) {
        selection = range;
    }
    Some(DocumentSymbol {
        name: name.to_string(),
        detail: Some(detail),
        kind,
        tags: None,
        deprecated: None,
        range,
        selection_range: selection,
        children: None,
    })
}

/// The items of the document's own file, in source order.
pub fn symbols(doc: &Document) -> Vec<DocumentSymbol> {
    let p = &doc.checked.program;
    let root = doc.root();
    let mut out: Vec<(u32, DocumentSymbol)> = Vec::new();
    for f in p.fns.iter().filter(|f| f.file == root) {
        let detail = format!(
            "({}) -> {}",
            f.params
                .iter()
                .map(|x| format!("{}: {}", x.name, x.ty))
                .collect::<Vec<_>>()
                .join(", "),
            f.ret
        );
        out.extend(
            symbol(
                doc,
                &f.name,
                detail,
                SymbolKind::FUNCTION,
                f.span,
                f.name_span,
            )
            .map(|s| (f.span.start, s)),
        );
    }
    for pl in p.pipelines.iter().filter(|x| x.file == root) {
        let detail = format!(
            "pipeline({})",
            pl.params
                .iter()
                .map(|x| x.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        out.extend(
            symbol(
                doc,
                &pl.name,
                detail,
                SymbolKind::MODULE,
                pl.span,
                pl.name_span,
            )
            .map(|s| (pl.span.start, s)),
        );
    }
    for m in p.models.iter().filter(|x| x.file == root) {
        out.extend(
            symbol(
                doc,
                &m.name,
                "model".into(),
                SymbolKind::OBJECT,
                m.span,
                m.name_span,
            )
            .map(|s| (m.span.start, s)),
        );
    }
    for d in p.datasets.iter().filter(|x| x.file == root) {
        out.extend(
            symbol(
                doc,
                &d.name,
                "dataset".into(),
                SymbolKind::VARIABLE,
                d.span,
                d.name_span,
            )
            .map(|s| (d.span.start, s)),
        );
    }
    if let Some(run) = &p.run
        && run.span.file == root
    {
        let name = p
            .pipelines
            .get(run.pipeline.0 as usize)
            .map_or("run".to_string(), |pl| format!("run {}", pl.name));
        out.extend(
            symbol(
                doc,
                &name,
                "run".into(),
                SymbolKind::EVENT,
                run.span,
                run.span,
            )
            .map(|s| (run.span.start, s)),
        );
    }
    out.sort_by_key(|(start, _)| *start);
    out.into_iter().map(|(_, s)| s).collect()
}
