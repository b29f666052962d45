//! Typing rules of the built-in functions. Their names, parameters, defaults and docs come
//! from the one table in `braid-stdlib`; what each returns, and the rules on rollouts and
//! granularity, are here.

use braid_diagnostics::{Code, Diagnostic, Span};
use braid_stdlib::Builtin;
use braid_syntax::ast;

use crate::check::{BodyCx, Checker, Place, mk};
use crate::hir::*;

/// A parameter's default, from the table's source text, as a literal at the call.
fn default_value(text: &str) -> Option<Value> {
    if text == "(none)" {
        return None;
    }
    if let Some(s) = text.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
        return Some(Value::Str(s.to_string()));
    }
    if text == "true" || text == "false" {
        return Some(Value::Bool(text == "true"));
    }
    if let Ok(i) = text.parse::<i64>() {
        return Some(Value::Int(i));
    }
    text.parse::<f64>().ok().map(Value::Float)
}

/// Checks the bound arguments, filling defaults; `None` for an absent argument without default.
fn args(
    ch: &mut Checker<'_>,
    cx: &mut BodyCx,
    b: &Builtin,
    bound: &[Option<&ast::Expr>],
    span: Span,
) -> Vec<Option<Expr>> {
    b.params
        .iter()
        .zip(bound)
        .map(|(p, a)| match a {
            Some(e) => Some(ch.expr(cx, e)),
            None => p
                .default
                .and_then(default_value)
                .map(|v| mk(ExprKind::Lit(v.clone()), v.ty(), Granularity::Scalar, span)),
        })
        .collect()
}

fn wrong_arg(name: &str, param: &str, want: &str, got: &Expr) -> Diagnostic {
    Diagnostic::new(
        Code::E0301,
        format!(
            "argument `{param}` of `{name}` must be {want}, not {}",
            got.ty.describe()
        ),
        got.span,
        format!("expected {want}"),
    )
    .with_help(match braid_stdlib::builtin(name) {
        Some(b) => format!("`{}`", b.signature()),
        None => format!("pass {want}"),
    })
}

fn finish(
    b: &Builtin,
    mut out: Vec<Option<Expr>>,
    callee: Callee,
    ty: Ty,
    gran: Granularity,
    span: Span,
) -> Expr {
    let _ = b;
    let args: Vec<Expr> = out.drain(..).flatten().collect();
    mk(
        ExprKind::Call {
            callee,
            args,
            mapped: false,
        },
        ty,
        gran,
        span,
    )
}

/// Built-ins of pipeline bodies: model calls, `next`, `by_prompt`, losses.
pub(crate) fn pipeline_builtin(
    ch: &mut Checker<'_>,
    cx: &mut BodyCx,
    b: &'static Builtin,
    bound: &[Option<&ast::Expr>],
    span: Span,
) -> Expr {
    let out = args(ch, cx, b, bound, span);
    let gran = out
        .iter()
        .flatten()
        .map(|e| e.gran)
        .max()
        .unwrap_or(Granularity::Scalar);
    if out.iter().flatten().any(|e| e.ty.is_error())
        || out
            .iter()
            .zip(b.params)
            .any(|(a, p)| a.is_none() && p.default.is_none())
    {
        return finish(b, out, Callee::Builtin(b.name), Ty::Error, gran, span);
    }
    // Type each argument against the table; rollout-valued arguments must share one rollout.
    let mut ok = true;
    let mut rollout: Option<(RolloutId, Span)> = None;
    let mut model_local: Option<LocalId> = None;
    for (a, p) in out.iter().zip(b.params) {
        let Some(a) = a else { continue };
        let accepted = match (p.ty, &a.ty) {
            ("Model", Ty::Model) => {
                if let ExprKind::Ref(Def::Local(l)) = a.kind {
                    model_local = Some(l);
                }
                true
            }
            ("Dataset", Ty::Dataset)
            | ("PromptBatch", Ty::PromptBatch(_))
            | ("Loss", Ty::Loss(..)) => true,
            ("int", Ty::Int)
            | ("float", Ty::Int | Ty::Float)
            | ("bool", Ty::Bool)
            | ("string", Ty::Str) => true,
            ("Rollout", Ty::Rollout(..))
            | ("PerToken", Ty::PerToken(_))
            | ("PerSample", Ty::PerSample(_)) => true,
            ("PerToken|PerSample", Ty::PerToken(_) | Ty::PerSample(_)) => true,
            _ => false,
        };
        if !accepted {
            ch.report(wrong_arg(
                b.name,
                p.name,
                p.ty.replace('|', " or ").as_str(),
                a,
            ));
            ok = false;
            continue;
        }
        if let Some(r) = a.ty.rollout() {
            // `by_prompt` takes a value of another rollout on purpose; its own rule is below.
            if b.name == "by_prompt" {
                continue;
            }
            match rollout {
                Some((r0, s0)) if r0 != r => {
                    ch.report_mixed(cx, r0, r, s0, a.span, span);
                    ok = false;
                }
                None => rollout = Some((r, a.span)),
                _ => {}
            }
        }
    }
    if !ok {
        return finish(b, out, Callee::Builtin(b.name), Ty::Error, gran, span);
    }
    let r = rollout.map(|x| x.0);
    let op = ModelOp::from_name(b.name);
    if let (Some(op), Some(l)) = (op, model_local) {
        cx.model_calls.push((op, l, span));
    }
    let (ty, gran) = match b.name {
        "generate" => {
            let batch = match out.get(1).and_then(|a| a.as_ref()).map(|a| &a.ty) {
                Some(Ty::PromptBatch(bid)) => *bid,
                _ => ch.new_batch(cx),
            };
            let rid = ch.new_rollout(cx, batch, span);
            (Ty::Rollout(rid, batch), Granularity::PerSample)
        }
        "logprobs" | "values" => (
            r.map_or(Ty::Error, Ty::PerToken),
            Granularity::PerSample.max(gran),
        ),
        "score" => (
            r.map_or(Ty::Error, Ty::PerSample),
            Granularity::PerSample.max(gran),
        ),
        "train" => {
            // The loss must be computed on the rollout being trained on (the loop above compared
            // the rollout argument with the loss's rollout), with the outputs of the model
            // trained.
            if let (Some(trained), Some(Some(loss))) = (model_local, out.get(2))
                && let Ty::Loss(_, Some(of)) = loss.ty
                && of != trained
            {
                let model_span = out
                    .first()
                    .and_then(|m| m.as_ref())
                    .map_or(span, |m| m.span);
                ch.loss_of_another_model(cx, of, loss.span, trained, model_span, true);
                return finish(b, out, Callee::Model(ModelOp::Train), Ty::Error, gran, span);
            }
            (Ty::Unit, Granularity::PerBatch)
        }
        "next" => (Ty::PromptBatch(ch.new_batch(cx)), Granularity::PerBatch),
        "by_prompt" => by_prompt(ch, cx, &out, span),
        _ => (Ty::Error, gran),
    };
    let callee = match op {
        Some(op) => Callee::Model(op),
        None => Callee::Builtin(b.name),
    };
    finish(b, out, callee, ty, gran, span)
}

fn by_prompt(
    ch: &mut Checker<'_>,
    cx: &mut BodyCx,
    out: &[Option<Expr>],
    span: Span,
) -> (Ty, Granularity) {
    let (Some(Some(value)), Some(Some(like))) = (out.first(), out.get(1)) else {
        return (Ty::Error, Granularity::PerGroup);
    };
    let (Ty::PerSample(from), Ty::Rollout(to, to_batch)) = (&value.ty, &like.ty) else {
        return (Ty::Error, Granularity::PerGroup);
    };
    let from_batch = ch.rollout_batch(cx, *from);
    if from_batch != Some(*to_batch) {
        let d = Diagnostic::new(
            Code::E0312,
            "`by_prompt` needs two rollouts of the same prompt batch",
            span,
            "rollouts of different prompt batches",
        )
        .with_label(ch.rollout_span_of(cx, *from), "this rollout…")
        .with_label(ch.rollout_span_of(cx, *to), "…and this one generate from different `next` calls")
        .with_help("bind the prompts once (`let p = next(prompts, batch)`) and generate both rollouts from `p`");
        ch.report(d);
        return (Ty::Error, Granularity::PerGroup);
    }
    (Ty::PerSample(*to), Granularity::PerGroup.max(value.gran))
}

/// Built-ins of `fn` bodies: math, reductions, strings and regexes.
pub(crate) fn fn_builtin(
    ch: &mut Checker<'_>,
    cx: &mut BodyCx,
    b: &'static Builtin,
    bound: &[Option<&ast::Expr>],
    span: Span,
) -> Expr {
    let out = args(ch, cx, b, bound, span);
    let scope = match cx.place {
        Place::Fn { scope, .. } => scope,
        _ => Scope::Sample,
    };
    let mut gran = out
        .iter()
        .flatten()
        .map(|e| e.gran)
        .max()
        .unwrap_or(Granularity::Scalar);
    if out.iter().flatten().any(|e| e.ty.is_error())
        || out
            .iter()
            .zip(b.params)
            .any(|(a, p)| a.is_none() && p.default.is_none())
    {
        return finish(b, out, Callee::Builtin(b.name), Ty::Error, gran, span);
    }
    if cx.loss.is_some()
        && (matches!(
            b.name,
            "matches" | "contains" | "starts_with" | "ends_with" | "answer_matches"
        ) || (b.name == "count" && out.get(1).is_some_and(|a| a.is_some())))
    {
        ch.not_differentiable(
            span,
            &format!("`{}`", b.name),
            "a loss has no sample text: compute text-based values in a reward `fn` and pass them in",
        );
        return finish(b, out, Callee::Builtin(b.name), Ty::Error, gran, span);
    }
    let arg = |i: usize| out.get(i).and_then(|a| a.as_ref());
    let num = |t: &Ty| matches!(t, Ty::Int | Ty::Float);
    let mut bad: Option<(usize, &str)> = None;
    let ty = match b.name {
        "exp" | "log" | "sqrt" | "abs" => match arg(0).map(|a| &a.ty) {
            Some(Ty::Int) if b.name == "abs" => Ty::Int,
            Some(Ty::Int | Ty::Float) => Ty::Float,
            Some(Ty::Tokens) => Ty::Tokens,
            _ => {
                bad = Some((0, "a number or PerToken"));
                Ty::Error
            }
        },
        "float" => match arg(0).map(|a| &a.ty) {
            Some(Ty::Int | Ty::Float) => Ty::Float,
            _ => {
                bad = Some((0, "a number"));
                Ty::Error
            }
        },
        "clamp" => {
            if !arg(1).is_some_and(|a| num(&a.ty)) {
                bad = Some((1, "a number"));
            } else if !arg(2).is_some_and(|a| num(&a.ty)) {
                bad = Some((2, "a number"));
            }
            match arg(0).map(|a| &a.ty) {
                Some(Ty::Tokens) => Ty::Tokens,
                Some(Ty::Int | Ty::Float) => Ty::Float,
                _ => {
                    bad = Some((0, "a number or PerToken"));
                    Ty::Error
                }
            }
        }
        "min" | "max" if arg(1).is_some() => match (arg(0).map(|a| &a.ty), arg(1).map(|a| &a.ty)) {
            (Some(Ty::Int), Some(Ty::Int)) => Ty::Int,
            (Some(a), Some(c)) if num(a) && num(c) => Ty::Float,
            (Some(a), Some(c)) if (num(a) || *a == Ty::Tokens) && (num(c) || *c == Ty::Tokens) => {
                Ty::Tokens
            }
            (Some(a), _) if !(num(a) || *a == Ty::Tokens) => {
                bad = Some((0, "a number or PerToken"));
                Ty::Error
            }
            _ => {
                bad = Some((1, "a number or PerToken"));
                Ty::Error
            }
        },
        "min" | "max" | "sum" | "mean" | "std" => match arg(0).map(|a| &a.ty) {
            Some(Ty::Tokens | Ty::Int | Ty::Float) => {
                gran = gran.max(scope.granularity());
                Ty::Float
            }
            _ => {
                bad = Some((0, "a PerToken or per-sample number"));
                Ty::Error
            }
        },
        "len" => match arg(0).map(|a| &a.ty) {
            Some(Ty::Str) => Ty::Int,
            Some(Ty::Tokens | Ty::Int | Ty::Float) => {
                gran = gran.max(scope.granularity());
                Ty::Int
            }
            _ => {
                bad = Some((0, "a string or PerToken"));
                Ty::Error
            }
        },
        "count" => match (arg(0).map(|a| &a.ty), arg(1)) {
            (Some(Ty::Str), Some(_)) => {
                if regex_literal(ch, b.name, bound.get(1).copied().flatten()) {
                    Ty::Int
                } else {
                    Ty::Error
                }
            }
            (Some(Ty::Str), None) => {
                ch.report(
                    Diagnostic::new(
                        Code::E0302,
                        "`count` of a string needs a pattern",
                        span,
                        "pattern missing",
                    )
                    .with_help("count matches of a regex: `count(s.completion, r\"[aeiou]\")`"),
                );
                Ty::Error
            }
            (Some(Ty::Tokens), None) => Ty::Int,
            _ => {
                bad = Some((0, "a string (with a pattern) or a PerToken"));
                Ty::Error
            }
        },
        "matches" => {
            if arg(0).map(|a| &a.ty) != Some(&Ty::Str) {
                bad = Some((0, "a string"));
                Ty::Error
            } else if regex_literal(ch, b.name, bound.get(1).copied().flatten()) {
                Ty::Bool
            } else {
                Ty::Error
            }
        }
        "field" | "field_int" | "field_float" | "field_bool" => {
            if arg(0).map(|a| &a.ty) != Some(&Ty::Sample) {
                bad = Some((0, "a Sample"));
                Ty::Error
            } else if field_name_literal(ch, b.name, bound.get(1).copied().flatten()) {
                match b.name {
                    "field" => Ty::Str,
                    "field_int" => Ty::Int,
                    "field_float" => Ty::Float,
                    _ => Ty::Bool,
                }
            } else {
                Ty::Error
            }
        }
        _ => {
            // contains, starts_with, ends_with, answer_matches: two strings.
            if arg(0).map(|a| &a.ty) != Some(&Ty::Str) {
                bad = Some((0, "a string"));
            } else if arg(1).map(|a| &a.ty) != Some(&Ty::Str) {
                bad = Some((1, "a string"));
            }
            Ty::Bool
        }
    };
    if let Some((i, want)) = bad {
        if let (Some(a), Some(p)) = (arg(i), b.params.get(i)) {
            ch.report(wrong_arg(b.name, p.name, want, a));
        }
        return finish(b, out, Callee::Builtin(b.name), Ty::Error, gran, span);
    }
    let gran = if matches!(cx.place, Place::Fn { .. }) {
        gran.max(Granularity::Scalar)
    } else {
        gran
    };
    finish(b, out, Callee::Builtin(b.name), ty, gran, span)
}

/// Checks that the name argument of a record-field reader is a non-empty string literal: the
/// plan lists the fields each dataset must hold, so the name has to be known before the run.
fn field_name_literal(ch: &mut Checker<'_>, name: &str, e: Option<&ast::Expr>) -> bool {
    let Some(e) = e else { return false };
    match &e.kind {
        ast::ExprKind::Str(s) if !s.value.is_empty() => true,
        ast::ExprKind::Str(_) => {
            ch.report(
                Diagnostic::new(
                    Code::E0316,
                    format!("the field name of `{name}` is empty"),
                    e.span,
                    "no field has an empty name",
                )
                .with_help(format!(
                    "name the record's field: `{name}(s, \"difficulty\")`"
                )),
            );
            false
        }
        _ => {
            ch.report(
                Diagnostic::new(Code::E0316, format!("the field name of `{name}` must be a string literal"), e.span, "not a literal")
                    .with_help(format!("write the name in place, `{name}(s, \"difficulty\")`: the run checks every record for the fields its rewards read when the data is loaded, so the names are needed before it starts")),
            );
            false
        }
    }
}

/// Checks that a pattern argument is a string literal holding a valid regex.
fn regex_literal(ch: &mut Checker<'_>, name: &str, e: Option<&ast::Expr>) -> bool {
    let Some(e) = e else { return false };
    let ast::ExprKind::Str(s) = &e.kind else {
        ch.report(
            Diagnostic::new(Code::E0316, format!("the pattern of `{name}` must be a string literal"), e.span, "not a literal")
                .with_help("write the regex in place, as a raw string: `r\"[0-9]+\"`; it is compiled once, before the run"),
        );
        return false;
    };
    match regex::Regex::new(&s.value) {
        Ok(_) => true,
        Err(why) => {
            let msg = why.to_string();
            let last = msg
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("invalid")
                .trim()
                .to_string();
            ch.report(
                Diagnostic::new(Code::E0314, format!("invalid regular expression: {last}"), s.span, "does not compile")
                    .with_help("patterns use Rust `regex` syntax; escape special characters with `\\` inside a raw string `r\"…\"`"),
            );
            false
        }
    }
}
