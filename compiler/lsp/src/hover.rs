//! Hover: what the name or expression under the cursor is.
//!
//! A name that refers to a built-in, a `fn`, a pipeline, a model or a dataset shows that item
//! (signature and docs; for a model its size); otherwise the innermost typed expression around
//! the cursor shows its type and granularity, and a `let` or parameter name shows its local's.
//! Everything is read from the checked program; nothing is re-analysed here.

use braid_diagnostics::Span;
use braid_sema::hir::{self, Def, Expr, ExprKind, Program};
use lsp_types::{Hover, HoverContents, MarkupContent, MarkupKind, Position};

use crate::analysis::Document;
use crate::position;

pub fn hover(doc: &Document, pos: Position) -> Option<Hover> {
    let file = doc.file()?;
    let offset = position::position_to_offset(file, pos);
    let (text, span) = describe_at(doc, offset)?;
    Some(Hover {
        contents: HoverContents::Markup(MarkupContent {
            kind: MarkupKind::Markdown,
            value: text,
        }),
        range: Some(position::range(file, span.start, span.end)),
    })
}

/// The hover text at a byte offset of the document, with the span it describes.
pub fn describe_at(doc: &Document, offset: u32) -> Option<(String, Span)> {
    let program = &doc.checked.program;
    let root = doc.root();
    let inside = |s: Span| s.file == root && s.start <= offset && offset < s.end.max(s.start + 1);
    // A name that refers to an item (not a local: those are shown with their type below).
    if let Some(r) = program
        .references
        .iter()
        .filter(|r| inside(r.span) && !matches!(r.def, Def::Local(_)))
        .min_by_key(|r| r.span.len())
        && let Some(text) = describe_def(program, r.def)
    {
        return Some((text, r.span));
    }
    // The name of an item's definition.
    for (def, span) in definitions(program) {
        if inside(span)
            && let Some(text) = describe_def(program, def)
        {
            return Some((text, span));
        }
    }
    if let Some(e) = innermost_expr(program, root, offset) {
        let mut text = format!("```braid\n{}\n```\n", e.ty);
        text.push_str(&format!("granularity: {}", e.gran.as_str()));
        return Some((text, e.span));
    }
    if let Some(local) = owners(program, root)
        .filter(|o| inside(o.span))
        .flat_map(|o| o.locals.iter())
        .find(|l| inside(l.span))
    {
        return Some((describe_local(local), local.span));
    }
    // An option key of a `model`, `dataset`, `cluster` or `run` block.
    let (text, start, end) = crate::completion::option_doc(doc, offset as usize)?;
    Some((text, Span::new(root, start, end)))
}

/// Every item defined in the program, by the span of its name.
pub fn definitions(program: &Program) -> impl Iterator<Item = (Def, Span)> + '_ {
    let fns = program
        .fns
        .iter()
        .enumerate()
        .map(|(i, f)| (Def::Fn(hir::FnId(i as u32)), f.name_span));
    let pipelines = program
        .pipelines
        .iter()
        .enumerate()
        .map(|(i, p)| (Def::Pipeline(hir::PipelineId(i as u32)), p.name_span));
    let models = program
        .models
        .iter()
        .enumerate()
        .map(|(i, m)| (Def::Model(hir::ModelId(i as u32)), m.name_span));
    let datasets = program
        .datasets
        .iter()
        .enumerate()
        .map(|(i, d)| (Def::Dataset(hir::DatasetId(i as u32)), d.name_span));
    fns.chain(pipelines).chain(models).chain(datasets)
}

/// A body with locals: a `fn` or a pipeline.
pub struct Owner<'a> {
    pub span: Span,
    pub locals: &'a [hir::Local],
    pub roots: Vec<&'a Expr>,
}

/// The `fn`s and pipelines defined in the file `root`.
pub fn owners(
    program: &Program,
    root: braid_diagnostics::FileId,
) -> impl Iterator<Item = Owner<'_>> {
    let fns = program.fns.iter().filter(move |f| f.file == root).map(|f| {
        let mut roots: Vec<&Expr> = f.params.iter().filter_map(|p| p.default.as_ref()).collect();
        roots.extend(f.body.lets.iter().map(|(_, e)| e));
        if let Some(l) = &f.loss {
            roots.extend(l.metrics.iter().map(|m| &m.value));
        }
        roots.push(&f.body.value);
        Owner {
            span: f.span,
            locals: &f.locals,
            roots,
        }
    });
    let pipelines = program
        .pipelines
        .iter()
        .filter(move |p| p.file == root)
        .map(|p| {
            let mut roots: Vec<&Expr> =
                p.params.iter().filter_map(|x| x.default.as_ref()).collect();
            for s in &p.settings {
                roots.extend(s.default.iter());
                roots.extend(s.where_.iter());
            }
            if let Some(each) = &p.each {
                roots.push(&each.count);
                for s in &each.stmts {
                    match s {
                        hir::Stmt::Let(_, e) | hir::Stmt::Expr(e) => roots.push(e),
                    }
                }
            }
            Owner {
                span: p.span,
                locals: &p.locals,
                roots,
            }
        });
    fns.chain(pipelines)
}

/// Calls `f` on `e` and every expression inside it, outermost first.
pub fn walk<'a>(e: &'a Expr, f: &mut dyn FnMut(&'a Expr)) {
    f(e);
    let body = |b: &'a hir::Body, f: &mut dyn FnMut(&'a Expr)| {
        for (_, x) in &b.lets {
            walk(x, f);
        }
        walk(&b.value, f);
    };
    match &e.kind {
        ExprKind::Call { args, .. } => args.iter().for_each(|a| walk(a, f)),
        ExprKind::Field { base, .. } => walk(base, f),
        ExprKind::Index { base, index } => {
            walk(base, f);
            walk(index, f);
        }
        ExprKind::Unary { operand, .. } => walk(operand, f),
        ExprKind::Binary { lhs, rhs, .. } => {
            walk(lhs, f);
            walk(rhs, f);
        }
        ExprKind::If { cond, then, else_ } => {
            walk(cond, f);
            body(then, f);
            walk(else_, f);
        }
        ExprKind::Block(b) => body(b, f),
        ExprKind::Scan(s) => {
            walk(&s.init, f);
            for (_, x) in &s.lets {
                walk(x, f);
            }
            walk(&s.value, f);
        }
        ExprKind::Lit(_) | ExprKind::Ref(_) | ExprKind::ModelOutput { .. } | ExprKind::Error => {}
    }
}

/// The smallest typed expression of the file `root` whose span contains `offset`.
pub fn innermost_expr(
    program: &Program,
    root: braid_diagnostics::FileId,
    offset: u32,
) -> Option<&Expr> {
    let mut best: Option<&Expr> = None;
    for owner in owners(program, root) {
        if !(owner.span.start <= offset && offset <= owner.span.end) {
            continue;
        }
        for r in owner.roots {
            walk(r, &mut |e| {
                let fits = e.span.file == root
                    && e.span.start <= offset
                    && offset < e.span.end
                    && !e.ty.is_error();
                // Strictly smaller only: filled-in defaults share their call's span, and the
                // call (visited first) is what the user sees there.
                if fits && best.is_none_or(|b| e.span.len() < b.span.len()) {
                    best = Some(e);
                }
            });
        }
    }
    best
}

fn describe_local(l: &hir::Local) -> String {
    let what = match l.kind {
        hir::LocalKind::Param(_) => "parameter",
        hir::LocalKind::Setting(_) => "param",
        hir::LocalKind::Model(_) => "model",
        hir::LocalKind::Let => "let",
        hir::LocalKind::EachVar => "each variable",
        hir::LocalKind::ScanVar => "scan variable",
        hir::LocalKind::ScanAcc => "scan accumulator",
    };
    format!(
        "```braid\n{}: {}\n```\n{what} · granularity: {}",
        l.name,
        l.ty,
        l.gran.as_str()
    )
}

fn params(ps: &[hir::Param]) -> String {
    ps.iter()
        .map(|p| format!("{}: {}", p.name, p.ty))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The hover text of an item.
pub fn describe_def(program: &Program, def: Def) -> Option<String> {
    Some(match def {
        Def::Builtin(name) => {
            let b = braid_stdlib::builtin(name)?;
            format!("```braid\n{}\n```\n{}", b.signature(), b.doc)
        }
        Def::Fn(id) => {
            let f = program.fns.get(id.0 as usize)?;
            let over = match f.scope {
                hir::Scope::Sample => "",
                hir::Scope::Group => " over group",
                hir::Scope::Batch => " over batch",
            };
            format!(
                "```braid\nfn {}({}) -> {}{over}\n```\nfrom `{}`",
                f.name,
                params(&f.params),
                f.ret,
                f.module
            )
        }
        Def::Pipeline(id) => {
            let p = program.pipelines.get(id.0 as usize)?;
            let mut text = format!(
                "```braid\npipeline {}({})\n```\nfrom `{}`",
                p.name,
                params(&p.params),
                p.module
            );
            if !p.settings.is_empty() {
                text.push_str("\n\nsettings:");
                for s in &p.settings {
                    text.push_str(&format!("\n- `{}: {}`", s.name, s.ty));
                }
            }
            text
        }
        Def::Model(id) => describe_model(program, program.models.get(id.0 as usize)?),
        Def::Dataset(id) => {
            let d = program.datasets.get(id.0 as usize)?;
            let source = match &d.source {
                hir::DatasetSource::Jsonl { path } => format!("jsonl(\"{path}\")"),
                hir::DatasetSource::Parquet { path } => format!("parquet(\"{path}\")"),
                hir::DatasetSource::Synthetic {
                    kind,
                    count,
                    seed,
                    split,
                    ..
                } => match split {
                    hir::Split::All => format!("synthetic::{kind}(count: {count}, seed: {seed})"),
                    s => format!(
                        "synthetic::{kind}(count: {count}, seed: {seed}, split: \"{}\")",
                        s.as_str()
                    ),
                },
            };
            format!(
                "```braid\ndataset {} = {source}\n```\nprompt field `{}`, answer field `{}`, shuffle: {}",
                d.name, d.prompt_field, d.answer_field, d.shuffle
            )
        }
        Def::Local(_) => return None,
    })
}

/// The byte vocabulary of `tiny` models: 256 bytes and 3 special tokens.
const BYTE_VOCAB: i64 = 259;

/// The parameter count of a `tiny(...)` model with the given head. Llama layout, untied:
/// embedding `259·h`; per layer the q and o projections `2·h²`, k and v `2·h·(h·kv/heads)`,
/// the gated MLP `3·h·i` and two norms `2·h`; a final norm `h`; the head `259·h` (lm) or `h`
/// (value, score).
pub fn tiny_parameters(c: &hir::TinyConfig, head: hir::Head) -> i64 {
    let h = c.hidden;
    let kv_dim = if c.heads > 0 {
        h * c.kv_heads / c.heads
    } else {
        h
    };
    let layer = 2 * h * h + 2 * h * kv_dim + 3 * h * c.intermediate + 2 * h;
    let head = match head {
        hir::Head::Lm => BYTE_VOCAB * h,
        hir::Head::Value | hir::Head::Score => h,
    };
    BYTE_VOCAB * h + c.layers * layer + h + head
}

fn bytes(n: f64) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    if n >= 1024.0 * MIB {
        format!("{:.2} GiB", n / (1024.0 * MIB))
    } else {
        format!("{:.2} MiB", n / MIB)
    }
}

fn count(n: i64) -> String {
    if n >= 1_000_000_000 {
        format!("{:.2} B", n as f64 / 1e9)
    } else if n >= 1_000_000 {
        format!("{:.2} M", n as f64 / 1e6)
    } else {
        format!("{:.1} K", n as f64 / 1e3)
    }
}

fn describe_model(program: &Program, m: &hir::Model) -> String {
    let mut text = String::new();
    let mut source = &m.source;
    let mut frozen_of = None;
    if let hir::ModelSource::Frozen(id) = source
        && let Some(base) = program.models.get(id.0 as usize)
    {
        frozen_of = Some(base.name.as_str());
        source = &base.source;
    }
    let dtype = match m.dtype {
        Some(hir::Dtype::F32) => Some(("f32", 4.0)),
        Some(hir::Dtype::Bf16) => Some(("bf16", 2.0)),
        Some(hir::Dtype::F16) => Some(("f16", 2.0)),
        None => None,
    };
    match source {
        hir::ModelSource::Tiny(c) => {
            text.push_str(&format!(
                "```braid\nmodel {} = tiny(layers: {}, hidden: {}, heads: {}, kv_heads: {}, intermediate: {}, max_len: {})\n```\n",
                m.name, c.layers, c.hidden, c.heads, c.kv_heads, c.intermediate, c.max_len
            ));
            let n = tiny_parameters(c, m.head);
            text.push_str(&format!("parameters: {} ({n})\n\n", count(n)));
            let weights = match dtype {
                Some((name, b)) => format!("weights: {} in {name}", bytes(n as f64 * b)),
                None => format!(
                    "weights: {} in f32 (CPU default), {} in bf16 (GPU default)",
                    bytes(n as f64 * 4.0),
                    bytes(n as f64 * 2.0)
                ),
            };
            text.push_str(&weights);
            if m.train.is_some() {
                // What the runtime holds besides the weights, by role, in the planner's table.
                let state = |b: u64| {
                    let per = braid_cost::cost::param_bytes(b, true);
                    let (grads, opt) = if per.optimizer > 8 {
                        (
                            "gradients + f32 accumulator",
                            "AdamW moments + f32 master weights",
                        )
                    } else {
                        ("gradients", "AdamW moments")
                    };
                    format!(
                        "{grads} {}, {opt} {}",
                        bytes(n as f64 * per.gradients as f64),
                        bytes(n as f64 * per.optimizer as f64)
                    )
                };
                match dtype {
                    Some((_, b)) => {
                        text.push_str(&format!("\n\ntraining state: {}", state(b as u64)));
                    }
                    None => text.push_str(&format!(
                        "\n\ntraining state in f32 (CPU default): {}; in bf16 (GPU default): {}",
                        state(4),
                        state(2)
                    )),
                }
                if m.gradient_checkpointing {
                    text.push_str(
                        "; activations: each layer's input only (`gradient_checkpointing`)",
                    );
                }
            }
        }
        hir::ModelSource::Hf { dir } => {
            text.push_str(&format!(
                "```braid\nmodel {} = hf(\"{dir}\")\n```\nHugging Face directory `{dir}` (relative to this file); its size is read from `config.json` when the run starts.",
                m.name
            ));
        }
        hir::ModelSource::Frozen(_) => {
            text.push_str(&format!("```braid\nmodel {}\n```\n", m.name));
        }
    }
    if let Some(base) = frozen_of {
        text.push_str(&format!("\n\nfrozen copy of `{base}`"));
    }
    text.push_str(&format!("\n\nhead: {}", m.head.as_str()));
    match &m.train {
        Some(t) => text.push_str(&format!(" · trained with AdamW, lr {}", t.lr)),
        None => text.push_str(" · frozen (no `train:`)"),
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::test_document;

    /// The hover text at the `nth` occurrence of `needle` (plus `delta` bytes).
    fn hover_at(text: &str, needle: &str, nth: usize, delta: u32) -> Option<(String, String)> {
        let doc = test_document(text);
        let at = text.match_indices(needle).nth(nth).unwrap().0 as u32 + delta;
        describe_at(&doc, at)
            .map(|(t, span)| (t, text[span.start as usize..span.end as usize].to_string()))
    }

    const PROGRAM: &str = "model m = hf(\"./ckpt\")\ndataset d = jsonl(\"x.jsonl\")\nfn f(s: Sample, w: float) -> float {\n  let n = len(s.completion)\n  n * w + 1.5\n}\n";

    #[test]
    fn the_innermost_expression_gives_type_and_granularity() {
        let (text, covered) = hover_at(PROGRAM, "1.5", 0, 1).unwrap();
        assert_eq!(covered, "1.5");
        assert!(text.contains("float") && text.contains("scalar"), "{text}");
        let (text, covered) = hover_at(PROGRAM, "* w", 0, 0).unwrap();
        assert_eq!(covered, "n * w");
        assert!(text.contains("float"), "{text}");
        let (text, covered) = hover_at(PROGRAM, "s.completion", 0, 3).unwrap();
        assert_eq!(covered, "s.completion");
        assert!(
            text.contains("string") && text.contains("per-sample"),
            "{text}"
        );
    }

    #[test]
    fn names_show_their_item_or_local() {
        let (text, covered) = hover_at(PROGRAM, "len", 0, 1).unwrap();
        assert_eq!(covered, "len");
        assert!(text.contains("len(") && text.contains("->"), "{text}");
        let (text, covered) = hover_at(PROGRAM, "n =", 0, 0).unwrap();
        assert_eq!(covered, "n");
        assert!(text.contains("n: int") && text.contains("let"), "{text}");
        let (text, _) = hover_at(PROGRAM, "m =", 0, 0).unwrap();
        assert!(text.contains("Hugging Face directory `./ckpt`"), "{text}");
        let (text, _) = hover_at(PROGRAM, "fn f(", 0, 3).unwrap();
        assert!(
            text.contains("fn f(s: Sample, w: float) -> float"),
            "{text}"
        );
        let options = "model m = tiny() {\n  dtype: bf16\n}\n";
        let (text, covered) = hover_at(options, "dtype", 0, 2).unwrap();
        assert_eq!(covered, "dtype");
        assert!(
            text.contains("precision") && text.contains("bf16"),
            "{text}"
        );
        // A trained bf16 model: f32 masters and accumulator on top of bf16 weights.
        let trained = "model m = tiny() {\n  dtype: bf16\n  train: adamw(lr: 1e-3)\n  gradient_checkpointing\n}\n";
        let (text, _) = hover_at(trained, "m =", 0, 0).unwrap();
        assert!(
            text.contains("f32 master weights") && text.contains("each layer's input"),
            "{text}"
        );
        let f32 = "model m = tiny() {\n  dtype: f32\n  train: adamw(lr: 1e-3)\n}\n";
        let (text, _) = hover_at(f32, "m =", 0, 0).unwrap();
        assert!(
            text.contains("training state: gradients") && !text.contains("master"),
            "{text}"
        );
        // Between items there is nothing to say.
        assert_eq!(hover_at(PROGRAM, "\nfn", 0, 0), None);
    }

    #[test]
    fn tiny_parameter_count_follows_the_documented_formula() {
        let c = hir::TinyConfig {
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 4,
            intermediate: 256,
            max_len: 512,
            seed: 0,
        };
        // 259·64 embedding + 2·(4·64² + 3·64·256 + 2·64) + 64 + 259·64 head.
        let want = 259 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 256 + 2 * 64) + 64 + 259 * 64;
        assert_eq!(tiny_parameters(&c, hir::Head::Lm), want);
        assert_eq!(
            tiny_parameters(&c, hir::Head::Lm) - tiny_parameters(&c, hir::Head::Value),
            258 * 64
        );
        // Grouped-query attention shrinks k and v.
        let gqa = hir::TinyConfig {
            kv_heads: 1,
            ..c.clone()
        };
        assert_eq!(
            tiny_parameters(&c, hir::Head::Lm) - tiny_parameters(&gqa, hir::Head::Lm),
            2 * 2 * 64 * (64 - 16)
        );
    }
}
