//! A text form of the typed program, without spans: for snapshots, for checking that
//! `braid fmt` preserves meaning (the formatted program prints the same), and for debugging.
//! Every expression shows its type and granularity.

use std::fmt::Write;

use crate::hir::*;

/// Prints the whole program.
pub fn program(p: &Program) -> String {
    let mut out = String::new();
    for f in &p.fns {
        write_fn(&mut out, p, f);
    }
    for pl in &p.pipelines {
        write_pipeline(&mut out, p, pl);
    }
    for m in &p.models {
        let _ = writeln!(
            out,
            "model {} = {:?} head={} dtype={:?} train={:?} grad_clip={:?} max_len={:?}{}",
            m.name,
            m.source,
            m.head.as_str(),
            m.dtype,
            m.train,
            m.grad_clip,
            m.max_len,
            if m.gradient_checkpointing {
                " gradient_checkpointing"
            } else {
                ""
            }
        );
    }
    for d in &p.datasets {
        let _ = writeln!(
            out,
            "dataset {} = {:?} prompt={:?} answer={:?} shuffle={} seed={} chat_template={} epochs={:?}",
            d.name,
            d.source,
            d.prompt_field,
            d.answer_field,
            d.shuffle,
            d.seed,
            d.chat_template,
            d.epochs
        );
        // Only when the program says something about chat messages, so that the typed form
        // of a dataset of plain prompts reads as it always did.
        if d.prompt_from != PromptFrom::Either || d.messages_field != "messages" {
            let _ = writeln!(
                out,
                "  messages={:?} prompt_from={:?}",
                d.messages_field, d.prompt_from
            );
        }
    }
    if let Some(r) = &p.run {
        let pl = &p.pipelines[r.pipeline.0 as usize];
        let args: Vec<String> = r
            .args
            .iter()
            .map(|a| match a {
                RunArg::Model(m) => format!("model {}", p.models[m.0 as usize].name),
                RunArg::Dataset(d) => format!("dataset {}", p.datasets[d.0 as usize].name),
                RunArg::Fn(f) => format!("fn {}", p.fns[f.0 as usize].name),
                RunArg::Value(v) => v.to_string(),
            })
            .collect();
        let settings: Vec<String> = r.settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = writeln!(
            out,
            "run {}({}) {{ {} }} seed={} checkpoint_every={}",
            pl.name,
            args.join(", "),
            settings.join(", "),
            r.seed,
            r.checkpoint_every
        );
    }
    if let Some(c) = &p.cluster {
        let _ = writeln!(out, "cluster {c:?}");
    }
    out
}

fn write_fn(out: &mut String, p: &Program, f: &Fn) {
    let params: Vec<String> = f
        .params
        .iter()
        .map(|x| {
            let mut s = match &x.default {
                Some(d) => format!("{}: {} = {}", x.name, x.ty, expr(p, &f.locals, d)),
                None => format!("{}: {}", x.name, x.ty),
            };
            if let Some(w) = &x.where_ {
                s.push_str(&format!(" where {}", expr(p, &f.where_locals, w)));
            }
            s
        })
        .collect();
    let _ = writeln!(
        out,
        "fn {}::{}({}) -> {} over {:?}",
        f.module,
        f.name,
        params.join(", "),
        f.ret,
        f.scope
    );
    for (l, e) in &f.body.lets {
        let _ = writeln!(
            out,
            "  let {} = {}",
            local(&f.locals, *l),
            expr(p, &f.locals, e)
        );
    }
    if let Some(l) = &f.loss {
        for m in &l.metrics {
            let _ = writeln!(
                out,
                "  metric {} = {}",
                m.name,
                expr(p, &f.locals, &m.value)
            );
        }
    }
    let _ = writeln!(out, "  {}", expr(p, &f.locals, &f.body.value));
}

fn write_pipeline(out: &mut String, p: &Program, pl: &Pipeline) {
    let params: Vec<String> = pl
        .params
        .iter()
        .map(|x| format!("{}: {}", x.name, x.ty))
        .collect();
    let _ = writeln!(
        out,
        "pipeline {}::{}({})",
        pl.module,
        pl.name,
        params.join(", ")
    );
    for s in &pl.settings {
        let d = s
            .default
            .as_ref()
            .map(|d| expr(p, &pl.locals, d))
            .unwrap_or_default();
        let w = s
            .where_
            .as_ref()
            .map(|w| expr(p, &pl.locals, w))
            .unwrap_or_default();
        let _ = writeln!(out, "  param {}: {} = {} where {}", s.name, s.ty, d, w);
    }
    for m in &pl.models {
        let of = m
            .frozen_of
            .map(|l| local(&pl.locals, l))
            .unwrap_or_default();
        let _ = writeln!(out, "  model {} = frozen({})", m.name, of);
    }
    if let Some(each) = &pl.each {
        let _ = writeln!(
            out,
            "  each {} in {}",
            local(&pl.locals, each.var),
            expr(p, &pl.locals, &each.count)
        );
        for s in &each.stmts {
            match s {
                Stmt::Let(l, e) => {
                    let _ = writeln!(
                        out,
                        "    let {} = {}",
                        local(&pl.locals, *l),
                        expr(p, &pl.locals, e)
                    );
                }
                Stmt::Expr(e) => {
                    let _ = writeln!(out, "    {}", expr(p, &pl.locals, e));
                }
            }
        }
    }
}

fn local(locals: &[Local], l: LocalId) -> String {
    locals
        .get(l.0 as usize)
        .map_or_else(|| format!("?{}", l.0), |x| x.name.clone())
}

/// One expression with its type and granularity: `(a + b : PerToken<r0> per-sample)`.
pub fn expr(p: &Program, locals: &[Local], e: &Expr) -> String {
    let inner = match &e.kind {
        ExprKind::Lit(v) => return v.to_string(),
        ExprKind::Ref(d) => match d {
            Def::Local(l) => local(locals, *l),
            Def::Fn(f) => p.fns[f.0 as usize].name.clone(),
            Def::Pipeline(x) => p.pipelines[x.0 as usize].name.clone(),
            Def::Model(m) => p
                .models
                .get(m.0 as usize)
                .map_or("?".into(), |m| m.name.clone()),
            Def::Dataset(d) => p
                .datasets
                .get(d.0 as usize)
                .map_or("?".into(), |d| d.name.clone()),
            Def::Builtin(b) => b.to_string(),
        },
        ExprKind::Call {
            callee,
            args,
            mapped,
        } => {
            let name = match callee {
                Callee::Model(op) => op.as_str().to_string(),
                Callee::Builtin(b) => b.to_string(),
                Callee::Fn(f) => p.fns[f.0 as usize].name.clone(),
                Callee::FnValue(l) => local(locals, *l),
            };
            let a: Vec<String> = args.iter().map(|x| expr(p, locals, x)).collect();
            format!(
                "{}{}({})",
                name,
                if *mapped { "[each sample]" } else { "" },
                a.join(", ")
            )
        }
        ExprKind::Field { base, field } => format!("{}.{}", expr(p, locals, base), field.as_str()),
        ExprKind::Index { base, index } => {
            format!("{}[{}]", expr(p, locals, base), expr(p, locals, index))
        }
        ExprKind::Unary { op, operand } => {
            format!(
                "{}{}",
                if *op == UnaryOp::Neg { "-" } else { "!" },
                expr(p, locals, operand)
            )
        }
        ExprKind::Binary { op, lhs, rhs } => {
            format!(
                "{} {} {}",
                expr(p, locals, lhs),
                op.as_str(),
                expr(p, locals, rhs)
            )
        }
        ExprKind::If { cond, then, else_ } => {
            format!(
                "if {} {{ {} }} else {{ {} }}",
                expr(p, locals, cond),
                body(p, locals, then),
                expr(p, locals, else_)
            )
        }
        ExprKind::Block(b) => body(p, locals, b),
        ExprKind::Scan(s) => {
            let lets: Vec<String> = s
                .lets
                .iter()
                .map(|(l, e)| format!("let {} = {}; ", local(locals, *l), expr(p, locals, e)))
                .collect();
            format!(
                "scan{} {} with {} = {} {{ {}{} }}",
                if s.reverse { " reverse" } else { "" },
                local(locals, s.var),
                local(locals, s.acc),
                expr(p, locals, &s.init),
                lets.join(""),
                expr(p, locals, &s.value)
            )
        }
        ExprKind::ModelOutput { model, output } => {
            format!("{}.{}", local(locals, *model), output.name())
        }
        ExprKind::Error => "<error>".to_string(),
    };
    format!("({inner} : {} {})", e.ty, e.gran.as_str())
}

fn body(p: &Program, locals: &[Local], b: &Body) -> String {
    let lets: Vec<String> = b
        .lets
        .iter()
        .map(|(l, e)| format!("let {} = {}; ", local(locals, *l), expr(p, locals, e)))
        .collect();
    format!("{}{}", lets.join(""), expr(p, locals, &b.value))
}
