//! Checking items: collecting module scopes, then fns, pipelines, models, datasets, and the
//! run with its settings, cluster and schedule.

use std::collections::{BTreeMap, BTreeSet};

use braid_diagnostics::{Code, Diagnostic, Span};
use braid_syntax::ast;

use crate::check::{BodyCx, Checker, Global, LossCx, Place, mk, suggest};
use crate::hir::*;
use crate::load::Module;

fn err(code: Code, msg: impl Into<String>, span: Span, label: impl Into<String>) -> Diagnostic {
    Diagnostic::new(code, msg, span, label)
}

impl<'a> Checker<'a> {
    /// Declares every item of every module and builds each module's scope: its imports, then
    /// its own items (which shadow imports).
    pub(crate) fn collect(&mut self) {
        let mut own: Vec<BTreeMap<String, Global>> = Vec::new();
        let modules: &'a [Module] = self.modules;
        for (mi, m) in modules.iter().enumerate() {
            let mut scope: BTreeMap<String, Global> = BTreeMap::new();
            for item in &m.ast.items {
                let (name, def) = match item {
                    ast::Item::Fn(f) => {
                        let id = FnId(self.fn_asts.len() as u32);
                        self.fn_asts.push((mi, f));
                        (&f.name, Def::Fn(id))
                    }
                    ast::Item::Pipeline(p) => {
                        let id = PipelineId(self.pipeline_asts.len() as u32);
                        self.pipeline_asts.push((mi, p));
                        (&p.name, Def::Pipeline(id))
                    }
                    ast::Item::Model(d) => (&d.name, Def::Model(ModelId(u32::MAX))),
                    ast::Item::Dataset(d) => (&d.name, Def::Dataset(DatasetId(u32::MAX))),
                    _ => continue,
                };
                if name.name.is_empty() {
                    continue;
                }
                if let Some(prev) = scope.get(&name.name) {
                    let d = err(
                        Code::E0202,
                        format!("`{}` is defined twice", name.name),
                        name.span,
                        "defined again here",
                    )
                    .with_label(prev.span, "first defined here")
                    .with_help("rename one of them");
                    self.diags.push(d);
                    continue;
                }
                scope.insert(
                    name.name.clone(),
                    Global {
                        def,
                        span: name.span,
                    },
                );
            }
            own.push(scope);
        }
        for (mi, m) in self.modules.iter().enumerate() {
            let mut scope: BTreeMap<String, Global> = BTreeMap::new();
            for (imp, _) in &m.imports {
                for (k, v) in &own[*imp] {
                    scope.entry(k.clone()).or_insert(*v);
                }
            }
            for (k, v) in &own[mi] {
                scope.insert(k.clone(), *v);
            }
            self.scopes.push(scope);
        }
    }

    /// Rewrites model and dataset placeholders in scopes once their ids exist.
    fn bind_resource(&mut self, name: &str, span: Span, def: Def) {
        for s in &mut self.scopes {
            if let Some(g) = s.get_mut(name)
                && g.span == span
            {
                g.def = def;
            }
        }
    }

    // ------------------------------------------------------------------------------------------
    // Functions.

    pub(crate) fn fn_signatures(&mut self) {
        for i in 0..self.fn_asts.len() {
            let (mi, f) = self.fn_asts[i];
            let ret = self.sig_ty(&f.ret);
            let is_loss = ret == SigTy::Loss;
            let mut params: Vec<Param> = Vec::new();
            for p in &f.params {
                if let Some(prev) = params.iter().find(|q| q.name == p.name.name) {
                    let d = err(
                        Code::E0202,
                        format!("parameter `{}` is declared twice", p.name.name),
                        p.name.span,
                        "declared again",
                    )
                    .with_label(prev.span, "first declared here")
                    .with_help("rename one of them");
                    self.report(d);
                }
                let ty = self.sig_ty(&p.ty);
                if is_loss {
                    if !(matches!(
                        ty,
                        SigTy::Error | SigTy::Model | SigTy::PerToken | SigTy::PerSample
                    ) || ty.is_scalar())
                    {
                        self.report(
                            err(Code::E0301, format!("a loss parameter cannot be a {ty}"), p.ty.span(), "not allowed here")
                                .with_help("a loss takes the model it trains (`Model`), per-token and per-sample values computed outside it, and constants (int, float, bool, string)"),
                        );
                    }
                } else if !(matches!(ty, SigTy::Error) || ty.is_scalar() || ty.is_sample_valued()) {
                    self.report(
                        err(Code::E0301, format!("a `fn` parameter cannot be a {ty}"), p.ty.span(), "not allowed here")
                            .with_help("`fn` parameters are int, float, bool, string, Sample, PerToken or PerSample; models and data belong to pipelines (a loss, a `fn … -> Loss`, takes the `Model` it trains)"),
                    );
                }
                let default = p.default.as_ref().map(|d| self.const_default(mi, d, &ty));
                params.push(Param {
                    name: p.name.name.clone(),
                    ty,
                    default,
                    where_: None,
                    span: p.name.span,
                });
            }
            if !matches!(
                ret,
                SigTy::Int
                    | SigTy::Float
                    | SigTy::Bool
                    | SigTy::Str
                    | SigTy::PerToken
                    | SigTy::PerSample
                    | SigTy::Loss
                    | SigTy::Error
            ) {
                self.report(
                    err(Code::E0301, format!("a `fn` cannot return a {ret}"), f.ret.span(), "not allowed here")
                        .with_help("a `fn` returns a scalar (int, float, bool, string), a PerSample, a PerToken, or a Loss"),
                );
            }
            let where_locals = self.param_wheres(mi, f, &mut params);
            let loss = if is_loss {
                self.loss_signature(f, &params)
            } else {
                None
            };
            let per_sample = params.iter().any(|p| p.ty.is_sample_valued());
            let scope = match &f.over {
                None => Scope::Sample,
                Some(o) if is_loss => {
                    self.report(
                        err(Code::E0311, "a loss takes no `over`", o.span, "`over` here")
                            .with_help("a loss reduces over the mini-batch with `batch_mean`, `batch_sum` and `group_mean`"),
                    );
                    Scope::Sample
                }
                Some(o) => match o.name.as_str() {
                    "group" | "batch" if !per_sample => {
                        self.report(
                            err(Code::E0311, format!("`over {}` needs a per-sample parameter", o.name), o.span, "nothing to reduce over")
                                .with_help("give the function a `PerSample` or `PerToken` parameter to reduce over the group or batch"),
                        );
                        Scope::Sample
                    }
                    "group" => Scope::Group,
                    "batch" => Scope::Batch,
                    other => {
                        self.report(
                            err(
                                Code::E0308,
                                format!("`over {other}` is not a scope"),
                                o.span,
                                "unknown scope",
                            )
                            .with_help("write `over group` or `over batch`"),
                        );
                        Scope::Sample
                    }
                },
            };
            let module = self.modules[mi].name.clone();
            let file = self.modules[mi].file;
            self.program.fns.push(Fn {
                name: f.name.name.clone(),
                file,
                module,
                params,
                ret,
                scope,
                body: Body {
                    lets: vec![],
                    value: Box::new(mk(ExprKind::Error, Ty::Error, Granularity::Scalar, f.span)),
                },
                locals: vec![],
                loss,
                where_locals,
                name_span: f.name.span,
                span: f.span,
            });
            self.fn_calls.push(BTreeSet::new());
        }
    }

    /// The `where` conditions of a `fn`'s parameters: bools over its constant parameters,
    /// satisfied by the defaults. Returns the locals the conditions refer to.
    fn param_wheres(&mut self, mi: usize, f: &ast::FnDecl, params: &mut [Param]) -> Vec<Local> {
        if f.params.iter().all(|p| p.where_.is_none()) {
            return Vec::new();
        }
        let mut cx = BodyCx::new(Place::Const, mi);
        for (pi, p) in params.iter().enumerate() {
            if p.ty.is_scalar() {
                let id = cx.add_local(
                    &p.name,
                    LocalKind::Param(pi as u32),
                    p.ty.in_fn_body(),
                    p.span,
                );
                cx.locals[id.0 as usize].uses += 1;
            }
        }
        let mut defaults: BTreeMap<String, Value> = BTreeMap::new();
        for p in &f.params {
            if let Some(v) = p
                .default
                .as_ref()
                .and_then(|d| self.const_eval(d, &BTreeMap::new()).ok())
            {
                defaults.insert(p.name.name.clone(), v);
            }
        }
        for (pi, p) in f.params.iter().enumerate() {
            let Some(w) = &p.where_ else { continue };
            let ty = params.get(pi).map_or(SigTy::Error, |x| x.ty.clone());
            if !ty.is_scalar() && ty != SigTy::Error {
                self.report(
                    err(Code::E0301, format!("a `where` condition on a {ty} parameter"), w.span, "not a constant parameter")
                        .with_help("`where` says which constants a parameter accepts: put it on an int, float, bool or string parameter"),
                );
                continue;
            }
            let x = self.expr(&mut cx, w);
            if !matches!(x.ty, Ty::Bool | Ty::Error) {
                self.report(
                    err(
                        Code::E0301,
                        format!(
                            "a `where` condition must be a bool, not a {}",
                            x.ty.describe()
                        ),
                        x.span,
                        "not a bool",
                    )
                    .with_help(format!(
                        "write a comparison such as `{} > 0.0`",
                        p.name.name
                    )),
                );
            } else if p.default.is_some()
                && let Ok(Value::Bool(false)) = self.const_eval(w, &defaults)
            {
                let cond = self.sources.snippet(w.span).to_string();
                let span = p.default.as_ref().map_or(p.span, |d| d.span);
                self.report(
                    err(
                        Code::E0404,
                        format!("the default of `{}` must satisfy `{cond}`", p.name.name),
                        span,
                        "default here",
                    )
                    .with_label(w.span, "required here")
                    .with_help("choose a default the condition accepts"),
                );
            }
            if let Some(param) = params.get_mut(pi) {
                param.where_ = Some(x);
            }
        }
        cx.locals
    }

    /// A loss takes the model it trains as exactly one `Model` parameter.
    fn loss_signature(&mut self, f: &ast::FnDecl, params: &[Param]) -> Option<LossFn> {
        let models: Vec<usize> = params
            .iter()
            .enumerate()
            .filter(|(_, p)| p.ty == SigTy::Model)
            .map(|(i, _)| i)
            .collect();
        match models.as_slice() {
            [one] => Some(LossFn {
                model_param: *one as u32,
                outputs: Vec::new(),
                metrics: Vec::new(),
            }),
            [] => {
                self.report(
                    err(Code::E0301, format!("the loss `{}` has no `Model` parameter", f.name.name), f.name.span, "no model to train")
                        .with_help("a loss takes the model it trains, whose outputs it reads: `fn my_loss(policy: Model, …) -> Loss { … policy.logp … }`"),
                );
                None
            }
            [first, second, ..] => {
                self.report(
                    err(Code::E0301, format!("the loss `{}` has more than one `Model` parameter", f.name.name), f.params[*second].ty.span(), "a second model")
                        .with_help("a `train` call updates one model: a loss reads the outputs of one; pass what other models compute (`logprobs(ref, rollout)`) as per-token arguments"),
                );
                // The body is checked as a loss of the first.
                Some(LossFn {
                    model_param: *first as u32,
                    outputs: Vec::new(),
                    metrics: Vec::new(),
                })
            }
        }
    }

    pub(crate) fn fn_bodies(&mut self) {
        for i in 0..self.fn_asts.len() {
            let (mi, f) = self.fn_asts[i];
            let (params, scope, ret) = {
                let func = &self.program.fns[i];
                (func.params.clone(), func.scope, func.ret.clone())
            };
            let is_loss = ret == SigTy::Loss;
            // A loss is written for one sample too, like a per-sample `fn`.
            let per_sample = is_loss || params.iter().any(|p| p.ty.is_sample_valued());
            let mut cx = BodyCx::new(Place::Fn { scope, per_sample }, mi);
            let model_param = self.program.fns[i].loss.as_ref().map(|l| l.model_param);
            if is_loss {
                cx.loss = Some(LossCx {
                    // Without a valid `Model` parameter (reported), no name is the model.
                    model: LocalId(u32::MAX),
                    outputs: BTreeSet::new(),
                });
            }
            for (pi, p) in params.iter().enumerate() {
                let gran = if p.ty.is_sample_valued() {
                    Granularity::PerSample
                } else {
                    Granularity::Scalar
                };
                let id = cx.add_local_gran(
                    &p.name,
                    LocalKind::Param(pi as u32),
                    p.ty.in_fn_body(),
                    gran,
                    p.span,
                );
                // Parameters need not be used: a reward may ignore its sample.
                cx.locals[id.0 as usize].uses += 1;
                if model_param == Some(pi as u32)
                    && let Some(l) = cx.loss.as_mut()
                {
                    l.model = id;
                }
            }
            let body = self.block(&mut cx, &f.body);
            let got = body.value.ty.clone();
            let ok = matches!(
                (&ret, &got),
                (_, Ty::Error)
                    | (SigTy::Error, _)
                    | (SigTy::Loss, Ty::Loss(..))
                    | (SigTy::PerToken, Ty::Tokens)
                    | (SigTy::Float | SigTy::PerSample, Ty::Int | Ty::Float)
                    | (SigTy::Int, Ty::Int)
                    | (SigTy::Bool, Ty::Bool)
                    | (SigTy::Str, Ty::Str)
            );
            if !ok {
                let d = err(
                    Code::E0301,
                    format!(
                        "`{}` returns {} but its body is a {}",
                        f.name.name,
                        ret,
                        got.describe()
                    ),
                    body.value.span,
                    format!("this is a {}", got.describe()),
                )
                .with_label(f.ret.span(), format!("declared to return {ret}"))
                .with_help(if ret == SigTy::PerToken {
                    "a per-token result comes from per-token arithmetic or a `scan`"
                } else if ret == SigTy::Loss {
                    "a loss ends in a reduction over the mini-batch: `batch_mean(x)` (token mean), `batch_mean(mean(x))` (sequence mean), `batch_sum(x) / c`, `group_mean(x)`"
                } else {
                    "make the body's last expression match the declared return type"
                });
                self.report(d);
            }
            self.fn_calls[i] = cx.calls.clone();
            let metrics = std::mem::take(&mut cx.metrics);
            let outputs: Vec<ModelOutput> = cx
                .loss
                .as_ref()
                .map(|l| l.outputs.iter().copied().collect())
                .unwrap_or_default();
            let func = &mut self.program.fns[i];
            func.body = body;
            func.locals = cx.locals;
            if let Some(l) = func.loss.as_mut() {
                l.metrics = metrics;
                l.outputs = outputs;
            }
        }
        self.recursion();
        self.check_losses();
    }

    fn recursion(&mut self) {
        // A cycle in the call graph is reported once, at the first function of the cycle.
        let n = self.fn_calls.len();
        let mut state = vec![0u8; n];
        let mut reported = BTreeSet::new();
        for start in 0..n {
            let mut stack: Vec<usize> = Vec::new();
            self.dfs(start, &mut state, &mut stack, &mut reported);
        }
    }

    fn dfs(
        &mut self,
        f: usize,
        state: &mut [u8],
        stack: &mut Vec<usize>,
        reported: &mut BTreeSet<usize>,
    ) {
        if state[f] == 2 {
            return;
        }
        if state[f] == 1 {
            if let Some(pos) = stack.iter().position(|&s| s == f) {
                let cycle: Vec<usize> = stack[pos..].to_vec();
                let first = *cycle.iter().min().unwrap_or(&f);
                if reported.insert(first) {
                    let names: Vec<String> = cycle
                        .iter()
                        .chain([&f])
                        .map(|&i| format!("`{}`", self.program.fns[i].name))
                        .collect();
                    let func = &self.program.fns[first];
                    let d = err(
                        Code::E0313,
                        format!(
                            "functions call each other in a cycle: {}",
                            names.join(" → ")
                        ),
                        func.name_span,
                        "part of a cycle",
                    )
                    .with_help("the language has no recursion; write the recurrence with `scan`");
                    self.report(d);
                }
            }
            return;
        }
        state[f] = 1;
        stack.push(f);
        let callees: Vec<FnId> = self.fn_calls[f].iter().copied().collect();
        for c in callees {
            self.dfs(c.0 as usize, state, stack, reported);
        }
        stack.pop();
        state[f] = 2;
    }

    /// A default of a `fn` or pipeline parameter: a constant of the parameter's type.
    fn const_default(&mut self, mi: usize, e: &ast::Expr, ty: &SigTy) -> Expr {
        let mut cx = BodyCx::new(Place::Const, mi);
        let x = self.expr(&mut cx, e);
        if x.ty.is_error() {
            return x;
        }
        if let Err(span) = self.const_eval(e, &BTreeMap::new()) {
            self.report(
                err(
                    Code::E0412,
                    "a default must be a constant",
                    span,
                    "not a constant",
                )
                .with_help("write a literal such as `0.95`, or arithmetic on literals"),
            );
            return x;
        }
        if !scalar_accepts(ty, &x.ty) {
            self.report(
                err(
                    Code::E0301,
                    format!(
                        "default of type {} for a parameter of type {ty}",
                        x.ty.describe()
                    ),
                    x.span,
                    format!("expected {ty}"),
                )
                .with_help(format!("write a {ty} literal")),
            );
        }
        x
    }

    /// Evaluates a constant expression over known settings. `Err` is the span of the first
    /// part that is not constant.
    pub(crate) fn const_eval(
        &self,
        e: &ast::Expr,
        env: &BTreeMap<String, Value>,
    ) -> Result<Value, Span> {
        use ast::BinaryOp as B;
        Ok(match &e.kind {
            ast::ExprKind::Int(i) => Value::Int(*i),
            ast::ExprKind::Float(f) => Value::Float(*f),
            ast::ExprKind::Bool(b) => Value::Bool(*b),
            ast::ExprKind::Str(s) => Value::Str(s.value.clone()),
            ast::ExprKind::Paren(x) => self.const_eval(x, env)?,
            ast::ExprKind::Path(p) => match p.as_single().and_then(|i| env.get(&i.name)) {
                Some(v) => v.clone(),
                None => return Err(e.span),
            },
            ast::ExprKind::Unary { op, operand } => match (op, self.const_eval(operand, env)?) {
                (ast::UnaryOp::Neg, Value::Int(i)) => Value::Int(i.checked_neg().ok_or(e.span)?),
                (ast::UnaryOp::Neg, Value::Float(f)) => Value::Float(-f),
                (ast::UnaryOp::Not, Value::Bool(b)) => Value::Bool(!b),
                _ => return Err(e.span),
            },
            ast::ExprKind::Binary { op, lhs, rhs } => {
                let l = self.const_eval(lhs, env)?;
                let r = self.const_eval(rhs, env)?;
                match (op, &l, &r) {
                    (B::And, Value::Bool(a), Value::Bool(b)) => Value::Bool(*a && *b),
                    (B::Or, Value::Bool(a), Value::Bool(b)) => Value::Bool(*a || *b),
                    (B::Eq, Value::Str(a), Value::Str(b)) => Value::Bool(a == b),
                    (B::Ne, Value::Str(a), Value::Str(b)) => Value::Bool(a != b),
                    (B::Eq, Value::Bool(a), Value::Bool(b)) => Value::Bool(a == b),
                    (B::Ne, Value::Bool(a), Value::Bool(b)) => Value::Bool(a != b),
                    (_, Value::Int(a), Value::Int(b)) if *op != B::Div => match op {
                        B::Add => Value::Int(a.checked_add(*b).ok_or(e.span)?),
                        B::Sub => Value::Int(a.checked_sub(*b).ok_or(e.span)?),
                        B::Mul => Value::Int(a.checked_mul(*b).ok_or(e.span)?),
                        B::Rem => Value::Int(a.checked_rem(*b).ok_or(e.span)?),
                        B::Eq => Value::Bool(a == b),
                        B::Ne => Value::Bool(a != b),
                        B::Lt => Value::Bool(a < b),
                        B::Le => Value::Bool(a <= b),
                        B::Gt => Value::Bool(a > b),
                        B::Ge => Value::Bool(a >= b),
                        _ => return Err(e.span),
                    },
                    _ => {
                        let (Some(a), Some(b)) = (l.as_f64(), r.as_f64()) else {
                            return Err(e.span);
                        };
                        match op {
                            B::Add => Value::Float(a + b),
                            B::Sub => Value::Float(a - b),
                            B::Mul => Value::Float(a * b),
                            B::Div => Value::Float(a / b),
                            B::Rem => Value::Float(a % b),
                            B::Eq => Value::Bool(a == b),
                            B::Ne => Value::Bool(a != b),
                            B::Lt => Value::Bool(a < b),
                            B::Le => Value::Bool(a <= b),
                            B::Gt => Value::Bool(a > b),
                            B::Ge => Value::Bool(a >= b),
                            _ => return Err(e.span),
                        }
                    }
                }
            }
            _ => return Err(e.span),
        })
    }

    // ------------------------------------------------------------------------------------------
    // Pipelines.

    pub(crate) fn pipelines(&mut self) {
        for i in 0..self.pipeline_asts.len() {
            let (mi, p) = self.pipeline_asts[i];
            let pl = self.pipeline(mi, p);
            self.program.pipelines.push(pl);
        }
    }

    fn pipeline(&mut self, mi: usize, p: &ast::Pipeline) -> Pipeline {
        let mut cx = BodyCx::new(Place::Pipeline, mi);
        let mut names: BTreeMap<String, Span> = BTreeMap::new();
        let mut dup = |this: &mut Self, name: &ast::Ident| {
            if let Some(prev) = names.get(&name.name) {
                this.report(
                    err(
                        Code::E0202,
                        format!("`{}` is declared twice in this pipeline", name.name),
                        name.span,
                        "declared again",
                    )
                    .with_label(*prev, "first declared here")
                    .with_help("rename one of them"),
                );
            } else {
                names.insert(name.name.clone(), name.span);
            }
        };
        let mut params = Vec::new();
        for (pi, sp) in p.params.iter().enumerate() {
            dup(self, &sp.name);
            let ty = self.sig_ty(&sp.ty);
            let default = sp.default.as_ref().map(|d| self.const_default(mi, d, &ty));
            let body_ty = match &ty {
                SigTy::Model => Ty::Model,
                SigTy::Dataset => Ty::Dataset,
                SigTy::Fn(s) => Ty::Fn(s.clone()),
                SigTy::Int => Ty::Int,
                SigTy::Float => Ty::Float,
                SigTy::Bool => Ty::Bool,
                SigTy::Str => Ty::Str,
                SigTy::Error => Ty::Error,
                other => {
                    self.report(
                        err(Code::E0301, format!("a pipeline parameter cannot be a {other}"), sp.ty.span(), "not allowed here")
                            .with_help("pipeline parameters are models, datasets, functions (`fn(Sample) -> float`) and scalars; values such as rollouts are made in the body"),
                    );
                    Ty::Error
                }
            };
            let id = cx.add_local(
                &sp.name.name,
                LocalKind::Param(pi as u32),
                body_ty,
                sp.name.span,
            );
            cx.locals[id.0 as usize].uses += 1;
            params.push(Param {
                name: sp.name.name.clone(),
                ty,
                default,
                where_: None,
                span: sp.name.span,
            });
        }
        let mut settings: Vec<Setting> = Vec::new();
        for (si, s) in p.settings.iter().enumerate() {
            dup(self, &s.name);
            let ty = self.sig_ty(&s.ty);
            if !matches!(ty, SigTy::Error) && !ty.is_scalar() {
                self.report(
                    err(Code::E0301, format!("a `param` must be a scalar, not a {ty}"), s.ty.span(), "not a scalar")
                        .with_help("`param`s are int, float, bool or string settings; models and data are pipeline parameters"),
                );
            }
            // Defaults may use earlier params; `where` conditions may use all of them.
            // Defaults and `where` conditions are checked in the pipeline's own scope (so their
            // locals index `Pipeline::locals`), as constants: a default sees the earlier params.
            let default = s.default.as_ref().map(|d| {
                cx.place = Place::Const;
                let x = self.expr(&mut cx, d);
                cx.place = Place::Pipeline;
                if !x.ty.is_error() && !scalar_accepts(&ty, &x.ty) {
                    self.report(
                        err(
                            Code::E0301,
                            format!(
                                "default of type {} for a `param` of type {ty}",
                                x.ty.describe()
                            ),
                            x.span,
                            format!("expected {ty}"),
                        )
                        .with_help(format!("write a {ty} literal")),
                    );
                }
                x
            });
            let id = cx.add_local(
                &s.name.name,
                LocalKind::Setting(si as u32),
                ty.in_fn_body(),
                s.name.span,
            );
            cx.locals[id.0 as usize].uses += 1;
            settings.push(Setting {
                name: s.name.name.clone(),
                ty,
                default,
                where_: None,
                span: s.name.span,
            });
        }
        for (si, s) in p.settings.iter().enumerate() {
            if let Some(w) = &s.where_ {
                cx.place = Place::Const;
                let x = self.expr(&mut cx, w);
                cx.place = Place::Pipeline;
                if !matches!(x.ty, Ty::Bool | Ty::Error) {
                    self.report(
                        err(
                            Code::E0301,
                            format!(
                                "a `where` condition must be a bool, not a {}",
                                x.ty.describe()
                            ),
                            x.span,
                            "not a bool",
                        )
                        .with_help("write a comparison such as `clip > 0.0`"),
                    );
                }
                settings[si].where_ = Some(x);
            }
        }
        let mut models = Vec::new();
        for (li, m) in p.models.iter().enumerate() {
            dup(self, &m.name);
            let mut frozen_of = None;
            let src = m.source.path.text();
            if src == "frozen" {
                match m.source.args.positional.first() {
                    Some(a)
                        if m.source.args.positional.len() == 1
                            && m.source.args.named.is_empty() =>
                    {
                        let x = self.expr(&mut cx, a);
                        match (&x.kind, &x.ty) {
                            (ExprKind::Ref(Def::Local(l)), Ty::Model) => frozen_of = Some(*l),
                            (_, Ty::Error) => {}
                            _ => self.report(
                                err(
                                    Code::E0301,
                                    format!("`frozen` copies a model, not a {}", x.ty.describe()),
                                    x.span,
                                    "not a model",
                                )
                                .with_help(
                                    "pass a model parameter of the pipeline: `frozen(policy)`",
                                ),
                            ),
                        }
                    }
                    _ => self.report(
                        err(
                            Code::E0302,
                            "`frozen` takes one model",
                            m.source.span,
                            "expected `frozen(model)`",
                        )
                        .with_help("copy one model: `model ref = frozen(policy)`"),
                    ),
                }
            } else {
                self.report(
                    err(Code::E0210, format!("a pipeline's local model must be `frozen(…)`, not `{src}(…)`"), m.source.path.span, "unknown source here")
                        .with_help("declare new models at top level and pass them in as pipeline parameters; inside, `frozen(m)` makes a reference copy"),
                );
            }
            if let Some(o) = &m.options {
                self.report(
                    err(
                        Code::E0207,
                        "a frozen copy takes no options",
                        o.span,
                        "options here",
                    )
                    .with_help("a frozen copy shares the options of the model it copies"),
                );
            }
            let local = cx.add_local(
                &m.name.name,
                LocalKind::Model(li as u32),
                Ty::Model,
                m.name.span,
            );
            models.push(LocalModel {
                name: m.name.name.clone(),
                local,
                frozen_of,
                span: m.span,
            });
        }
        let each = p.each.as_ref().map(|e| self.each(&mut cx, e));
        // A local model never used is dead weight in every step.
        for m in &models {
            if cx.locals[m.local.0 as usize].uses == 0 {
                self.report(
                    err(
                        Code::W0002,
                        format!("model `{}` is never used", m.name),
                        cx.locals[m.local.0 as usize].span,
                        "declared here",
                    )
                    .with_help("remove it, or use it in the `each` body"),
                );
            }
        }
        // Training a frozen copy is an error whatever the run binds.
        for (op, l, span) in &cx.model_calls {
            if *op == ModelOp::Train
                && let Some(m) = models.iter().find(|m| m.local == *l)
            {
                self.report(
                    err(
                        Code::E0401,
                        format!("`{}` is a frozen copy and cannot be trained", m.name),
                        *span,
                        "trained here",
                    )
                    .with_label(m.span, "declared frozen here")
                    .with_help("train the model it copies instead"),
                );
            }
        }
        let file = self.modules[mi].file;
        Pipeline {
            name: p.name.name.clone(),
            file,
            module: self.modules[mi].name.clone(),
            params,
            settings,
            models,
            each,
            locals: std::mem::take(&mut cx.locals),
            name_span: p.name.span,
            span: p.span,
        }
    }

    fn each(&mut self, cx: &mut BodyCx, e: &ast::Each) -> Each {
        let count = self.expr(cx, &e.count);
        if !matches!(count.ty, Ty::Int | Ty::Error) {
            self.report(
                err(
                    Code::E0301,
                    format!(
                        "`each … in` takes a number of steps (an int), not a {}",
                        count.ty.describe()
                    ),
                    count.span,
                    "not an int",
                )
                .with_help("iterate over an int `param`: `each step in steps`"),
            );
        }
        let var = cx.add_local(&e.var.name, LocalKind::EachVar, Ty::Int, e.var.span);
        cx.locals[var.0 as usize].uses += 1;
        let mut stmts = Vec::new();
        let mut lets = Vec::new();
        for s in &e.stmts {
            match s {
                ast::Stmt::Let(l) => {
                    let v = self.expr(cx, &l.value);
                    if matches!(v.ty, Ty::Model | Ty::Dataset | Ty::Fn(_)) {
                        // Model calls are matched to models by name (heads, training, pins);
                        // an alias would hide which model a call runs.
                        self.report(
                            err(Code::E0301, format!("a {} cannot be bound with `let`", v.ty.describe()), v.span, "not a value")
                                .with_help("use the parameter itself; a pipeline makes a reference copy with `model ref = frozen(policy)`"),
                        );
                    }
                    let id = cx.add_local_gran(
                        &l.name.name,
                        LocalKind::Let,
                        v.ty.clone(),
                        v.gran,
                        l.name.span,
                    );
                    lets.push((id, v.clone()));
                    stmts.push(Stmt::Let(id, v));
                }
                ast::Stmt::Expr(x) => {
                    let v = self.expr(cx, x);
                    if !matches!(v.ty, Ty::Unit | Ty::Error) {
                        self.report(
                            err(
                                Code::W0003,
                                format!("this {} is computed but never used", v.ty.describe()),
                                v.span,
                                "value unused",
                            )
                            .with_help("bind it with `let` and use it, or remove it"),
                        );
                    }
                    stmts.push(Stmt::Expr(v));
                }
            }
        }
        self.unused_lets(cx, &lets);
        Each {
            var,
            count,
            stmts,
            span: e.span,
        }
    }

    // ------------------------------------------------------------------------------------------
    // Models and datasets.

    pub(crate) fn resources(&mut self) {
        // Models first in file order; `frozen(m)` refers to a model declared anywhere in scope.
        let mut decls: Vec<(usize, &'a ast::ModelDecl, bool)> = Vec::new();
        let modules: &'a [Module] = self.modules;
        for (mi, m) in modules.iter().enumerate() {
            for item in &m.ast.items {
                match item {
                    ast::Item::Model(d) => decls.push((mi, d, true)),
                    ast::Item::Dataset(d) => decls.push((mi, d, false)),
                    _ => {}
                }
            }
        }
        for (mi, d, is_model) in &decls {
            if d.name.name.is_empty() {
                continue;
            }
            if *is_model {
                let id = ModelId(self.program.models.len() as u32);
                self.bind_resource(&d.name.name, d.name.span, Def::Model(id));
                let file = self.modules[*mi].file;
                self.program.models.push(Model {
                    name: d.name.name.clone(),
                    file,
                    source: ModelSource::Hf { dir: String::new() },
                    dtype: None,
                    head: Head::Lm,
                    train: None,
                    grad_clip: None,
                    max_len: None,
                    gradient_checkpointing: false,
                    name_span: d.name.span,
                    span: d.span,
                });
            } else {
                let id = DatasetId(self.program.datasets.len() as u32);
                self.bind_resource(&d.name.name, d.name.span, Def::Dataset(id));
                let file = self.modules[*mi].file;
                self.program.datasets.push(Dataset {
                    name: d.name.name.clone(),
                    file,
                    source: DatasetSource::Jsonl {
                        path: String::new(),
                    },
                    prompt_field: "prompt".into(),
                    answer_field: "answer".into(),
                    messages_field: "messages".into(),
                    prompt_from: PromptFrom::Either,
                    shuffle: false,
                    seed: 0,
                    chat_template: false,
                    epochs: None,
                    name_span: d.name.span,
                    span: d.span,
                });
            }
        }
        let (mut mi_count, mut di_count) = (0usize, 0usize);
        for (mi, d, is_model) in &decls {
            if d.name.name.is_empty() {
                continue;
            }
            if *is_model {
                self.model(*mi, d, mi_count);
                mi_count += 1;
            } else {
                self.dataset(*mi, d, di_count);
                di_count += 1;
            }
        }
        // A frozen copy of a frozen copy is fine; a cycle of copies is not resolvable.
        for i in 0..self.program.models.len() {
            let mut seen = BTreeSet::new();
            let mut cur = i;
            while let ModelSource::Frozen(next) = self.program.models[cur].source {
                if !seen.insert(cur) {
                    let m = &self.program.models[i];
                    let d = err(Code::E0313, format!("model `{}` is a frozen copy of itself", m.name), m.name_span, "copies itself through `frozen`")
                        .with_help("a frozen copy must end at a model with its own source, such as `tiny(…)` or `hf(\"…\")`");
                    self.report(d);
                    break;
                }
                cur = next.0 as usize;
            }
        }
    }
}

/// Whether a constant of type `got` may initialise a parameter of type `want`.
pub(crate) fn scalar_accepts(want: &SigTy, got: &Ty) -> bool {
    matches!(
        (want, got),
        (_, Ty::Error)
            | (SigTy::Error, _)
            | (SigTy::Int, Ty::Int)
            | (SigTy::Float | SigTy::PerSample, Ty::Int | Ty::Float)
            | (SigTy::Bool, Ty::Bool)
            | (SigTy::Str, Ty::Str)
    )
}

pub(crate) fn closest(name: &str, options: &[&str]) -> Option<String> {
    suggest(name, options.iter().copied())
}
