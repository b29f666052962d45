//! Checking losses: `fn`s that return `Loss`. Their body is typed like a `fn` body for one
//! sample, with what a differentiated objective adds — the outputs of the model it trains
//! (`policy.logp`, `.entropy`, `.value`), comparisons and `if` evaluated per token, the
//! reductions to the loss (`batch_mean`, `batch_sum`, `group_mean`) whose results combine only
//! linearly, `stop_grad`, and `metric` declarations — and, once every body is checked, which
//! values carry gradients (E0317, W0004) and whether every function a loss calls can be
//! differentiated (E0318). Calls of losses, in pipelines and in other losses, are typed here
//! too: a loss belongs to the model it is given (E0415 when `train` updates another).

use std::collections::BTreeMap;

use braid_diagnostics::{Code, Diagnostic, Span};
use braid_stdlib::Builtin;
use braid_syntax::ast;

use crate::check::{BodyCx, Checker, Place, mk, suggest};
use crate::hir::*;

fn err(code: Code, msg: impl Into<String>, span: Span, label: impl Into<String>) -> Diagnostic {
    Diagnostic::new(code, msg, span, label)
}

fn error_expr(span: Span) -> Expr {
    mk(ExprKind::Error, Ty::Error, Granularity::Scalar, span)
}

/// How deep the walks over called functions go; the checker rejects recursion (E0313), so
/// this only bounds work on programs that already have errors.
const MAX_DEPTH: usize = 64;

impl Checker<'_> {
    /// `policy.logp`: an output of the loss's model, per token, with gradients.
    pub(crate) fn model_output(
        &mut self,
        cx: &mut BodyCx,
        base: &Expr,
        name: &ast::Ident,
        span: Span,
    ) -> Expr {
        let Some(loss) = cx.loss.as_mut() else {
            return error_expr(span);
        };
        let output = ModelOutput::ALL
            .iter()
            .copied()
            .find(|o| o.name() == name.name);
        match (output, &base.kind) {
            (Some(output), ExprKind::Ref(Def::Local(l))) if *l == loss.model => {
                loss.outputs.insert(output);
                mk(
                    ExprKind::ModelOutput { model: *l, output },
                    Ty::Tokens,
                    Granularity::PerSample,
                    span,
                )
            }
            _ => {
                let names: Vec<&str> = braid_stdlib::MODEL_OUTPUTS.iter().map(|o| o.key).collect();
                let suggestion = suggest(&name.name, names.iter().copied());
                let help = match &suggestion {
                    Some(s) => format!("did you mean `.{s}`?"),
                    None => "a loss reads its model's `.logp`, `.entropy` and `.value`".into(),
                };
                self.report(
                    err(
                        Code::E0206,
                        format!("a model has no output `{}`", name.name),
                        name.span,
                        "no such output",
                    )
                    .with_help(help)
                    .with_suggestion(name.span, suggestion.as_deref()),
                );
                error_expr(span)
            }
        }
    }

    /// E0318 for a construct a loss cannot differentiate.
    pub(crate) fn not_differentiable(&mut self, span: Span, what: &str, help: &str) {
        self.report(
            err(
                Code::E0318,
                format!("{what} cannot be differentiated in a loss"),
                span,
                format!("{what} here"),
            )
            .with_help(help),
        );
    }

    /// Whether `factor` may scale a loss: a constant. A loss is one number for the mini-batch,
    /// so a per-sample factor has nothing to multiply (E0311).
    pub(crate) fn scales_a_loss(&mut self, factor: &Expr) -> bool {
        if factor.gran == Granularity::Scalar || factor.ty.is_error() {
            return true;
        }
        self.report(
            err(
                Code::E0311,
                "a loss is scaled by a per-sample value",
                factor.span,
                format!("{} value", factor.gran.as_str()),
            )
            .with_help("a loss is one number for the mini-batch; multiply per token or sample before the reduction: `batch_mean(w * x)`"),
        );
        false
    }

    /// E0415: a loss computed with one model's outputs meets another model: the model a
    /// `train` updates (`trained`), or another loss added to it.
    pub(crate) fn loss_of_another_model(
        &mut self,
        cx: &BodyCx,
        loss_model: LocalId,
        loss_span: Span,
        other: LocalId,
        other_span: Span,
        trained: bool,
    ) {
        let name = |l: LocalId| {
            cx.locals
                .get(l.0 as usize)
                .map_or(String::from("?"), |x| x.name.clone())
        };
        let (msg, label) = if trained {
            (
                format!(
                    "`train` updates `{}` with a loss computed with `{}`'s outputs",
                    name(other),
                    name(loss_model)
                ),
                format!("`{}` is trained", name(other)),
            )
        } else {
            (
                format!(
                    "a loss of `{}` is added to a loss of `{}`",
                    name(other),
                    name(loss_model)
                ),
                format!("a loss of `{}`", name(other)),
            )
        };
        self.report(
            err(Code::E0415, msg, other_span, label)
                .with_label(loss_span, format!("a loss of `{}`", name(loss_model)))
            .with_help("a `train` call updates one model: compute its loss with that model's outputs (pass it as the loss's model), and train the other model with its own loss"),
        );
    }

    /// `metric NAME = EXPR` in a loss body.
    pub(crate) fn metric(&mut self, cx: &mut BodyCx, l: &ast::Let) {
        let value = self.expr(cx, &l.value);
        if cx.loss.is_none() {
            self.report(
                err(
                    Code::E0407,
                    "`metric` can only be declared in the body of a loss",
                    l.span,
                    "declared here",
                )
                .with_help("a metric is reported by the `train` of a loss (a `fn … -> Loss`); a `fn` computes values, which a pipeline can bind with `let`"),
            );
            return;
        }
        let name = &l.name.name;
        if let Some(prev) = cx.metrics.iter().find(|m| &m.name == name) {
            self.report(
                err(
                    Code::E0202,
                    format!("metric `{name}` is declared twice"),
                    l.name.span,
                    "declared again",
                )
                .with_label(prev.span, "first declared here")
                .with_help("give each metric its own name"),
            );
            return;
        }
        if braid_stdlib::TRAINER_METRICS.contains(&name.as_str()) {
            self.report(
                err(
                    Code::E0202,
                    format!("`{name}` is a metric the trainer reports itself"),
                    l.name.span,
                    "already defined by the trainer",
                )
                .with_help(format!(
                    "the trainer reports {}; choose another name",
                    braid_stdlib::TRAINER_METRICS.join(", ")
                )),
            );
            return;
        }
        let per_element = match &value.ty {
            Ty::Tokens | Ty::TokenBools => true,
            Ty::Int | Ty::Float | Ty::Bool => value.gran >= Granularity::PerSample,
            Ty::Error => return,
            _ => false,
        };
        if !per_element || matches!(value.ty, Ty::Loss(..)) {
            self.report(
                err(
                    Code::E0301,
                    format!(
                        "a metric is a per-token or per-sample value, not a {}",
                        if value.gran == Granularity::Scalar && !matches!(value.ty, Ty::Loss(..)) {
                            "constant".to_string()
                        } else {
                            value.ty.describe()
                        }
                    ),
                    value.span,
                    "not per token or sample",
                )
                .with_help("the trainer reports the mean of a metric over every token or sample it trains on: `metric clip_frac = abs(ratio - 1.0) > clip`"),
            );
            return;
        }
        cx.metrics.push(Metric {
            name: name.clone(),
            span: l.name.span,
            value,
        });
    }

    /// A call of a loss, in a pipeline body (the loss of a `train`) or in another loss.
    pub(crate) fn call_loss(
        &mut self,
        cx: &mut BodyCx,
        f: FnId,
        name: &str,
        name_span: Span,
        args: &ast::Args,
        span: Span,
    ) -> Expr {
        let in_loss = cx.loss.is_some();
        if cx.place != Place::Pipeline && !in_loss {
            self.report(
                err(
                    Code::E0407,
                    format!("`{name}` is a loss: it can only be called in a pipeline body or in another loss"),
                    name_span,
                    "called here",
                )
                .with_help("pass the loss to `train` in the pipeline: `train(policy, rollout, loss: …)`"),
            );
            for a in &args.positional {
                self.expr(cx, a);
            }
            return error_expr(span);
        }
        let func = &self.program.fns[f.0 as usize];
        let params: Vec<Param> = func.params.clone();
        cx.calls.insert(f);
        let specs: Vec<(String, bool)> = params
            .iter()
            .map(|p| (p.name.clone(), p.default.is_some()))
            .collect();
        let bound = self.bind_named(&format!("`{name}`"), &specs, args, span);
        self.check_where_literals(f, &bound, span);
        let mut out = Vec::new();
        let mut ok = true;
        let mut rollout: Option<(RolloutId, Span)> = None;
        let mut model: Option<LocalId> = None;
        for (i, p) in params.iter().enumerate() {
            let arg = match bound.get(i).copied().flatten() {
                Some(a) => self.expr(cx, a),
                None => match &p.default {
                    Some(d) => {
                        let mut d = d.clone();
                        d.span = span;
                        d
                    }
                    None => {
                        ok = false;
                        continue;
                    }
                },
            };
            if arg.ty.is_error() {
                ok = false;
                out.push(arg);
                continue;
            }
            let accepted = match (&p.ty, &arg.ty) {
                (SigTy::Model, Ty::Model) => match arg.kind {
                    ExprKind::Ref(Def::Local(l)) => {
                        model = Some(l);
                        true
                    }
                    _ => false,
                },
                (SigTy::PerToken, Ty::PerToken(r) | Ty::PerSample(r))
                | (SigTy::PerSample, Ty::PerSample(r))
                    if !in_loss =>
                {
                    match rollout {
                        Some((r0, s0)) if r0 != *r => {
                            self.report_mixed(cx, r0, *r, s0, arg.span, span);
                            ok = false;
                        }
                        Some(_) => {}
                        None => rollout = Some((*r, arg.span)),
                    }
                    true
                }
                // A per-token parameter takes a per-sample value too: it is broadcast over
                // each sample's tokens.
                (SigTy::PerToken, Ty::Tokens) if in_loss => true,
                (SigTy::PerToken, Ty::Int | Ty::Float) if in_loss => {
                    arg.gran >= Granularity::PerSample
                }
                (SigTy::PerSample, Ty::Int | Ty::Float) if in_loss => true,
                (SigTy::Float, Ty::Int | Ty::Float) => arg.gran == Granularity::Scalar || !in_loss,
                (SigTy::Int, Ty::Int) | (SigTy::Bool, Ty::Bool) | (SigTy::Str, Ty::Str) => {
                    arg.gran == Granularity::Scalar || !in_loss
                }
                _ => false,
            };
            if !accepted {
                let want = match (&p.ty, in_loss) {
                    (SigTy::Model, _) => "the model the loss trains".to_string(),
                    (SigTy::PerToken, false) => "a PerToken or PerSample value".to_string(),
                    (SigTy::PerToken, true) => "a per-token or per-sample value".to_string(),
                    (SigTy::PerSample, true) => "a per-sample value".to_string(),
                    (t, true) if t.is_scalar() => format!("a constant {t}"),
                    (t, _) => format!("a {t}"),
                };
                let sig = self.program.fns[f.0 as usize].signature();
                self.report(
                    err(
                        Code::E0301,
                        format!(
                            "argument `{}` of `{name}` must be {want}, not {}",
                            p.name,
                            arg.ty.describe()
                        ),
                        arg.span,
                        format!("expected {want}"),
                    )
                    .with_help(format!("`{name}` has type {sig}")),
                );
                ok = false;
            }
            out.push(arg);
        }
        let ty = if !ok {
            Ty::Error
        } else if in_loss {
            Ty::Loss(None, None)
        } else {
            Ty::Loss(rollout.map(|r| r.0), model)
        };
        mk(
            ExprKind::Call {
                callee: Callee::Fn(f),
                args: out,
                mapped: false,
            },
            ty,
            Granularity::PerBatch,
            span,
        )
    }

    /// After every body is checked: in each loss, the functions it calls must be
    /// differentiable (E0318), its result must carry a gradient (E0317), and `stop_grad` of a
    /// value without one is pointless (W0004).
    pub(crate) fn check_losses(&mut self) {
        let mut blocked: BTreeMap<FnId, Option<(Span, &'static str)>> = BTreeMap::new();
        for i in 0..self.program.fns.len() {
            if !self.program.fns[i].is_loss() {
                continue;
            }
            let func = self.program.fns[i].clone();
            // Calls of `fn`s that use what a loss cannot differentiate.
            let mut calls: Vec<(FnId, Span)> = Vec::new();
            let mut collect = |e: &Expr| {
                visit(e, &mut |x| {
                    if let ExprKind::Call {
                        callee: Callee::Fn(g),
                        ..
                    } = &x.kind
                    {
                        calls.push((*g, x.span));
                    }
                });
            };
            for (_, e) in &func.body.lets {
                collect(e);
            }
            collect(&func.body.value);
            if let Some(l) = &func.loss {
                for m in &l.metrics {
                    collect(&m.value);
                }
            }
            let mut reported = false;
            for (g, span) in calls {
                if self
                    .program
                    .fns
                    .get(g.0 as usize)
                    .is_none_or(|x| x.is_loss())
                {
                    continue;
                }
                let why = self.blocking(g, &mut blocked, 0);
                if let Some((at, what)) = why {
                    let gname = self.program.fns[g.0 as usize].name.clone();
                    self.report(
                        err(
                            Code::E0318,
                            format!("`{gname}` uses {what}, which cannot be differentiated in a loss"),
                            span,
                            "called in a loss",
                        )
                        .with_label(at, format!("{what} here"))
                        .with_help("compute it outside the loss (in the pipeline) and pass the result in as a per-token or per-sample argument"),
                    );
                    reported = true;
                }
            }
            // Without a `Model` parameter (reported) there is nothing to carry a gradient.
            if reported || has_error(&func) || func.loss.is_none() {
                continue;
            }
            let mut env: BTreeMap<LocalId, bool> = BTreeMap::new();
            let mut warnings = Vec::new();
            let mut g = Grad {
                fns: &self.program.fns,
                warnings: &mut warnings,
            };
            let carries = g.body(&func, &func.body, &mut env, true, 0);
            if let Some(l) = &func.loss {
                for m in &l.metrics {
                    g.expr(&func, &m.value, &mut env, true, 0);
                }
            }
            for w in warnings {
                self.report(w);
            }
            if !carries {
                let model = func
                    .loss
                    .as_ref()
                    .and_then(|l| func.params.get(l.model_param as usize))
                    .map_or("the model".to_string(), |p| format!("`{}`", p.name));
                self.report(
                    err(
                        Code::E0317,
                        format!("the loss `{}` carries no gradient", func.name),
                        func.body.value.span,
                        format!("depends on none of {model}'s outputs"),
                    )
                    .with_label(func.name_span, "declared here")
                    .with_help(format!(
                        "training differentiates the loss with respect to {model}: use its outputs (`.logp`, `.entropy`, `.value`) outside `stop_grad`; arguments such as old log-probabilities are constants"
                    )),
                );
            }
        }
    }

    /// The first construct of `g` (or of what it calls) that a loss cannot differentiate.
    fn blocking(
        &self,
        g: FnId,
        memo: &mut BTreeMap<FnId, Option<(Span, &'static str)>>,
        depth: usize,
    ) -> Option<(Span, &'static str)> {
        if let Some(m) = memo.get(&g) {
            return *m;
        }
        let func = self.program.fns.get(g.0 as usize)?;
        if depth > MAX_DEPTH {
            return None;
        }
        let mut found: Option<(Span, &'static str)> = None;
        let mut callees = Vec::new();
        if func.scope != Scope::Sample {
            found = Some((func.name_span, "a group or batch scope"));
        }
        let mut look = |e: &Expr| {
            visit(e, &mut |x| {
                let what = match &x.kind {
                    ExprKind::Scan(_) => Some("`scan`"),
                    ExprKind::Index { .. } => Some("token indexing"),
                    ExprKind::Field { .. } => Some("a sample's fields"),
                    ExprKind::Call {
                        callee: Callee::Builtin(b),
                        args,
                        ..
                    } if TEXT_BUILTINS.contains(b) || (*b == "count" && args.len() == 2) => {
                        Some("a test of the sample's text")
                    }
                    ExprKind::Call {
                        callee: Callee::Fn(h),
                        ..
                    } => {
                        callees.push(*h);
                        None
                    }
                    _ => None,
                };
                if found.is_none()
                    && let Some(w) = what
                {
                    found = Some((x.span, w));
                }
            });
        };
        for (_, e) in &func.body.lets {
            look(e);
        }
        look(&func.body.value);
        if found.is_none() {
            for h in callees {
                if let Some(f) = self.blocking(h, memo, depth + 1) {
                    found = Some(f);
                    break;
                }
            }
        }
        memo.insert(g, found);
        found
    }

    /// Binds arguments to named parameters (`(name, optional)`), reporting unknown, duplicate,
    /// missing and surplus arguments.
    pub(crate) fn bind_named<'e>(
        &mut self,
        what: &str,
        params: &[(String, bool)],
        args: &'e ast::Args,
        span: Span,
    ) -> Vec<Option<&'e ast::Expr>> {
        let specs: Vec<crate::check::ParamSpec> = params
            .iter()
            .map(|(n, o)| crate::check::ParamSpec {
                name: n.clone(),
                optional: *o,
            })
            .collect();
        self.bind_args(what, &specs, args, span)
    }
}

/// Built-ins that read a sample's text: a loss has no sample.
const TEXT_BUILTINS: &[&str] = &[
    "matches",
    "contains",
    "starts_with",
    "ends_with",
    "answer_matches",
];

fn has_error(f: &Fn) -> bool {
    let mut bad = false;
    let mut look = |e: &Expr| {
        visit(e, &mut |x| {
            if x.ty.is_error() {
                bad = true;
            }
        })
    };
    for (_, e) in &f.body.lets {
        look(e);
    }
    look(&f.body.value);
    bad
}

/// Which values carry gradients: the model's outputs and what is computed from them, except
/// through `stop_grad` and booleans (a comparison's derivative is zero).
struct Grad<'a> {
    fns: &'a [Fn],
    warnings: &'a mut Vec<Diagnostic>,
}

impl Grad<'_> {
    fn body(
        &mut self,
        f: &Fn,
        b: &Body,
        env: &mut BTreeMap<LocalId, bool>,
        report: bool,
        depth: usize,
    ) -> bool {
        for (l, e) in &b.lets {
            let g = self.expr(f, e, env, report, depth);
            env.insert(*l, g);
        }
        self.expr(f, &b.value, env, report, depth)
    }

    fn expr(
        &mut self,
        f: &Fn,
        e: &Expr,
        env: &mut BTreeMap<LocalId, bool>,
        report: bool,
        depth: usize,
    ) -> bool {
        let g = match &e.kind {
            ExprKind::Lit(_) | ExprKind::Error => false,
            ExprKind::Ref(Def::Local(l)) => env.get(l).copied().unwrap_or(false),
            ExprKind::Ref(_) => false,
            ExprKind::ModelOutput { .. } => true,
            ExprKind::Field { base, .. } => self.expr(f, base, env, report, depth),
            ExprKind::Index { base, index } => {
                let a = self.expr(f, base, env, report, depth);
                self.expr(f, index, env, report, depth);
                a
            }
            ExprKind::Unary { operand, .. } => self.expr(f, operand, env, report, depth),
            ExprKind::Binary { lhs, rhs, .. } => {
                let a = self.expr(f, lhs, env, report, depth);
                let b = self.expr(f, rhs, env, report, depth);
                a || b
            }
            ExprKind::If { cond, then, else_ } => {
                self.expr(f, cond, env, report, depth);
                let a = self.body(f, then, env, report, depth);
                let b = self.expr(f, else_, env, report, depth);
                a || b
            }
            ExprKind::Block(b) => self.body(f, b, env, report, depth),
            ExprKind::Scan(s) => {
                let mut any = self.expr(f, &s.init, env, report, depth);
                for (l, x) in &s.lets {
                    let g = self.expr(f, x, env, report, depth);
                    env.insert(*l, g);
                    any |= g;
                }
                any | self.expr(f, &s.value, env, report, depth)
            }
            ExprKind::Call {
                callee: Callee::Builtin("stop_grad"),
                args,
                ..
            } => {
                let inner = args
                    .first()
                    .is_some_and(|a| self.expr(f, a, env, report, depth));
                if report && !inner {
                    self.warnings.push(
                        err(
                            Code::W0004,
                            "`stop_grad` of a value that carries no gradient",
                            e.span,
                            "already a constant for the gradient",
                        )
                        .with_help("only the model's outputs and what is computed from them carry gradients; remove `stop_grad` here"),
                    );
                }
                false
            }
            ExprKind::Call {
                callee: Callee::Fn(h),
                args,
                ..
            } => {
                let grads: Vec<bool> = args
                    .iter()
                    .map(|a| self.expr(f, a, env, report, depth))
                    .collect();
                match self.fns.get(h.0 as usize) {
                    Some(callee) if depth < MAX_DEPTH => {
                        // The callee's body with its parameters' gradients.
                        let mut inner: BTreeMap<LocalId, bool> = BTreeMap::new();
                        for (li, local) in callee.locals.iter().enumerate() {
                            if let LocalKind::Param(i) = local.kind {
                                inner.insert(
                                    LocalId(li as u32),
                                    grads.get(i as usize).copied().unwrap_or(false),
                                );
                            }
                        }
                        self.body(callee, &callee.body, &mut inner, false, depth + 1)
                    }
                    _ => grads.iter().any(|g| *g),
                }
            }
            ExprKind::Call { args, .. } => {
                let mut any = false;
                for a in args {
                    any |= self.expr(f, a, env, report, depth);
                }
                any
            }
        };
        // Booleans have a zero derivative: nothing flows through a comparison.
        g && !matches!(e.ty, Ty::Bool | Ty::TokenBools)
    }
}

/// The reductions to the loss, and `stop_grad`.
pub(crate) fn loss_builtin(
    ch: &mut Checker<'_>,
    cx: &mut BodyCx,
    b: &'static Builtin,
    bound: &[Option<&ast::Expr>],
    span: Span,
) -> Expr {
    let args: Vec<Expr> = bound.iter().flatten().map(|a| ch.expr(cx, a)).collect();
    let call = |ty: Ty, gran: Granularity, args: Vec<Expr>| {
        mk(
            ExprKind::Call {
                callee: Callee::Builtin(b.name),
                args,
                mapped: false,
            },
            ty,
            gran,
            span,
        )
    };
    let Some(x) = args.first() else {
        return error_expr(span);
    };
    if x.ty.is_error() {
        return call(Ty::Error, Granularity::PerBatch, args);
    }
    if b.name == "stop_grad" {
        return match x.ty {
            Ty::Tokens | Ty::Int | Ty::Float => {
                let (ty, gran) = (x.ty.clone(), x.gran);
                call(ty, gran, args)
            }
            _ => {
                ch.report(wrong(b, x, "a number or a per-token value"));
                call(Ty::Error, x.gran, args)
            }
        };
    }
    // batch_mean, batch_sum, group_mean: of per-token or per-sample values.
    let ok = match x.ty {
        Ty::Tokens => true,
        Ty::Int | Ty::Float => x.gran >= Granularity::PerSample,
        _ => false,
    };
    if !ok {
        let what = if matches!(x.ty, Ty::Int | Ty::Float) {
            "constant".to_string()
        } else {
            x.ty.describe()
        };
        ch.report(
            err(
                Code::E0301,
                format!(
                    "`{}` reduces per-token or per-sample values, not a {what}",
                    b.name
                ),
                x.span,
                "expected a per-token or per-sample value",
            )
            .with_help(if matches!(x.ty, Ty::Loss(..)) {
                "this is already a loss; add it to the others with `+`"
            } else {
                "reduce a value computed from the model's outputs, such as `batch_mean(-(adv * ratio))`"
            }),
        );
        return call(Ty::Error, Granularity::PerBatch, args);
    }
    call(Ty::Loss(None, None), Granularity::PerBatch, args)
}

fn wrong(b: &Builtin, got: &Expr, want: &str) -> Diagnostic {
    err(
        Code::E0301,
        format!(
            "argument `{}` of `{}` must be {want}, not {}",
            b.params.first().map_or("x", |p| p.name),
            b.name,
            got.ty.describe()
        ),
        got.span,
        format!("expected {want}"),
    )
    .with_help(format!("`{}`", b.signature()))
}
