//! The checker: resolves names, types every expression, infers granularity, and enforces the
//! pipeline rules, turning syntax trees into the typed program of [`crate::hir`]. It reports
//! problems as diagnostics and keeps going: a wrong expression gets `Ty::Error`, which is
//! compatible with everything, so one mistake produces one diagnostic.

use std::collections::{BTreeMap, BTreeSet};

use braid_diagnostics::{Code, Diagnostic, SourceMap, Span};
use braid_syntax::ast;

use crate::hir::*;
use crate::load::Module;
use crate::ty::{BatchId, FnSig};

/// A name at module level.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Global {
    pub def: Def,
    pub span: Span,
}

/// Where an expression is checked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Place {
    /// A `fn` body with its reduction scope; `per_sample` when it has sample parameters.
    Fn { scope: Scope, per_sample: bool },
    /// A pipeline's `each` body.
    Pipeline,
    /// Defaults, `where` conditions and settings: constants only.
    Const,
}

/// The locals and scopes of one body.
pub(crate) struct BodyCx {
    pub place: Place,
    pub module: usize,
    pub locals: Vec<Local>,
    scopes: Vec<Vec<(String, LocalId)>>,
    /// Rollout → (the prompt batch it came from, the span of its `generate`).
    rollouts: Vec<(BatchId, Span)>,
    batches: u32,
    /// Functions called from this body, for the recursion check.
    pub calls: BTreeSet<FnId>,
    /// Model calls in a pipeline body: (op, model local, call span).
    pub model_calls: Vec<(ModelOp, LocalId, Span)>,
    /// In the body of a loss: its model and what the body reads of it.
    pub loss: Option<LossCx>,
    /// The metrics a loss body declares.
    pub metrics: Vec<Metric>,
}

/// What checking a loss body keeps track of.
#[derive(Debug, Clone)]
pub(crate) struct LossCx {
    /// The local of the loss's `Model` parameter.
    pub model: LocalId,
    /// The outputs of the model the body reads.
    pub outputs: BTreeSet<ModelOutput>,
}

impl BodyCx {
    pub fn new(place: Place, module: usize) -> Self {
        BodyCx {
            place,
            module,
            locals: Vec::new(),
            scopes: vec![Vec::new()],
            rollouts: Vec::new(),
            batches: 0,
            calls: BTreeSet::new(),
            model_calls: Vec::new(),
            loss: None,
            metrics: Vec::new(),
        }
    }

    /// Adds a local whose values are complete at `gran` (lets take their value's).
    pub fn add_local_gran(
        &mut self,
        name: &str,
        kind: LocalKind,
        ty: Ty,
        gran: Granularity,
        span: Span,
    ) -> LocalId {
        let id = self.add_local(name, kind, ty, span);
        self.locals[id.0 as usize].gran = gran;
        id
    }

    pub fn add_local(&mut self, name: &str, kind: LocalKind, ty: Ty, span: Span) -> LocalId {
        let id = LocalId(self.locals.len() as u32);
        self.locals.push(Local {
            name: name.to_string(),
            kind,
            ty,
            gran: Granularity::Scalar,
            span,
            uses: 0,
        });
        if let Some(s) = self.scopes.last_mut() {
            s.push((name.to_string(), id));
        }
        id
    }

    fn lookup(&self, name: &str) -> Option<LocalId> {
        self.scopes
            .iter()
            .rev()
            .find_map(|s| s.iter().rev().find(|(n, _)| n == name).map(|(_, id)| *id))
    }

    fn push(&mut self) {
        self.scopes.push(Vec::new());
    }

    fn pop(&mut self) {
        self.scopes.pop();
    }

    fn new_batch(&mut self) -> BatchId {
        self.batches += 1;
        BatchId(self.batches - 1)
    }

    fn new_rollout(&mut self, batch: BatchId, span: Span) -> RolloutId {
        self.rollouts.push((batch, span));
        RolloutId(self.rollouts.len() as u32 - 1)
    }

    fn rollout_span(&self, r: RolloutId) -> Span {
        self.rollouts.get(r.0 as usize).map_or(Span::DUMMY, |x| x.1)
    }
}

pub(crate) struct Checker<'a> {
    pub sources: &'a SourceMap,
    pub modules: &'a [Module],
    pub scopes: Vec<BTreeMap<String, Global>>,
    pub diags: Vec<Diagnostic>,
    pub program: Program,
    /// The syntax of every fn and pipeline, by id, for bodies checked after all signatures.
    pub fn_asts: Vec<(usize, &'a ast::FnDecl)>,
    pub pipeline_asts: Vec<(usize, &'a ast::Pipeline)>,
    pub fn_calls: Vec<BTreeSet<FnId>>,
}

fn err(code: Code, msg: impl Into<String>, span: Span, label: impl Into<String>) -> Diagnostic {
    Diagnostic::new(code, msg, span, label)
}

pub(crate) fn mk(kind: ExprKind, ty: Ty, gran: Granularity, span: Span) -> Expr {
    Expr {
        kind,
        ty,
        gran,
        span,
    }
}

fn error_expr(span: Span) -> Expr {
    mk(ExprKind::Error, Ty::Error, Granularity::Scalar, span)
}

/// Parameters of a callee for argument binding: name and whether it may be omitted.
pub(crate) struct ParamSpec {
    pub name: String,
    pub optional: bool,
}

impl<'a> Checker<'a> {
    pub fn report(&mut self, mut d: Diagnostic) {
        // Messages are built as "a {type}"; types and heads starting with a vowel sound take
        // "an" ("an int", "an `lm` head").
        d.message = articles(&d.message);
        for l in &mut d.labels {
            l.message = articles(&l.message);
        }
        d.help = d.help.map(|h| articles(&h));
        self.diags.push(d);
    }

    fn reference(&mut self, span: Span, def: Def, def_span: Span) {
        self.program.references.push(Reference {
            span,
            def,
            def_span,
        });
    }

    // ------------------------------------------------------------------------------------------
    // Types written in signatures.

    pub fn sig_ty(&mut self, t: &ast::TypeExpr) -> SigTy {
        match t {
            ast::TypeExpr::Named(id) => match SigTy::from_name(&id.name) {
                Some(t) => t,
                None => {
                    let mut d = err(
                        Code::E0315,
                        format!("unknown type `{}`", id.name),
                        id.span,
                        "not a type",
                    );
                    let suggestion = suggest(&id.name, SigTy::NAMES.iter().copied());
                    d = d.with_suggestion(id.span, suggestion.as_deref());
                    d = d.with_help(match suggestion {
                        Some(s) => format!(
                            "did you mean `{s}`? The types are {}",
                            SigTy::NAMES.join(", ")
                        ),
                        None => format!("the types are {}", SigTy::NAMES.join(", ")),
                    });
                    self.report(d);
                    SigTy::Error
                }
            },
            ast::TypeExpr::Fn { params, ret, .. } => {
                let params = params.iter().map(|p| self.sig_ty(p)).collect();
                let ret = Box::new(self.sig_ty(ret));
                SigTy::Fn(FnSig { params, ret })
            }
        }
    }

    // ------------------------------------------------------------------------------------------
    // Expressions.

    pub fn expr(&mut self, cx: &mut BodyCx, e: &ast::Expr) -> Expr {
        let span = e.span;
        match &e.kind {
            ast::ExprKind::Int(i) => mk(
                ExprKind::Lit(Value::Int(*i)),
                Ty::Int,
                Granularity::Scalar,
                span,
            ),
            ast::ExprKind::Float(f) => mk(
                ExprKind::Lit(Value::Float(*f)),
                Ty::Float,
                Granularity::Scalar,
                span,
            ),
            ast::ExprKind::Bool(b) => mk(
                ExprKind::Lit(Value::Bool(*b)),
                Ty::Bool,
                Granularity::Scalar,
                span,
            ),
            ast::ExprKind::Str(s) => mk(
                ExprKind::Lit(Value::Str(s.value.clone())),
                Ty::Str,
                Granularity::Scalar,
                span,
            ),
            ast::ExprKind::Paren(inner) => {
                let mut x = self.expr(cx, inner);
                x.span = span;
                x
            }
            ast::ExprKind::Path(p) => self.path_expr(cx, p),
            ast::ExprKind::Field { base, name } => self.field(cx, base, name, span),
            ast::ExprKind::Index { base, index } => self.index(cx, base, index, span),
            ast::ExprKind::Unary { op, operand } => self.unary(cx, *op, operand, span),
            ast::ExprKind::Binary { op, lhs, rhs } => self.binary(cx, *op, lhs, rhs, span),
            ast::ExprKind::Call { callee, args } => self.call(cx, callee, args, span),
            ast::ExprKind::If { cond, then, else_ } => self.if_expr(cx, cond, then, else_, span),
            ast::ExprKind::Block(b) => {
                let body = self.block(cx, b);
                let (ty, gran) = (body.value.ty.clone(), body.value.gran);
                mk(ExprKind::Block(body), ty, gran, span)
            }
            ast::ExprKind::Scan(s) => self.scan(cx, s, span),
            ast::ExprKind::Error => error_expr(span),
        }
    }

    fn not_in_pipeline(&mut self, cx: &BodyCx, what: &str, span: Span) -> bool {
        if cx.place == Place::Pipeline {
            self.report(
                err(Code::E0409, format!("{what} in a pipeline body"), span, format!("{what} here"))
                    .with_help("a pipeline body is a static dataflow graph; put the computation in a `fn` and call it"),
            );
            return true;
        }
        false
    }

    pub fn block(&mut self, cx: &mut BodyCx, b: &ast::Block) -> Body {
        cx.push();
        let mut lets = Vec::new();
        for l in &b.lets {
            if l.metric {
                self.metric(cx, l);
                continue;
            }
            let v = self.expr(cx, &l.value);
            let id = cx.add_local_gran(
                &l.name.name,
                LocalKind::Let,
                v.ty.clone(),
                v.gran,
                l.name.span,
            );
            lets.push((id, v));
        }
        let value = self.expr(cx, &b.value);
        self.unused_lets(cx, &lets);
        cx.pop();
        Body {
            lets,
            value: Box::new(value),
        }
    }

    pub fn unused_lets(&mut self, cx: &BodyCx, lets: &[(LocalId, Expr)]) {
        for (id, _) in lets {
            let l = &cx.locals[id.0 as usize];
            if l.uses == 0 && !l.name.starts_with('_') {
                self.report(
                    err(
                        Code::W0001,
                        format!("`{}` is never used", l.name),
                        l.span,
                        "bound here",
                    )
                    .with_help(format!(
                        "remove the binding, or name it `_{}` to keep it",
                        l.name
                    ))
                    .with_fix(
                        l.span,
                        format!("_{}", l.name),
                        format!("Rename to `_{}`", l.name),
                    ),
                );
            }
        }
    }

    fn path_expr(&mut self, cx: &mut BodyCx, p: &ast::Path) -> Expr {
        let span = p.span;
        let Some(id) = p.as_single() else {
            self.report(
                err(
                    Code::E0201,
                    format!("unknown name `{}`", p.text()),
                    span,
                    "not defined",
                )
                .with_help(
                    "paths with `::` name standard-library modules in `use`, and dataset sources",
                ),
            );
            return error_expr(span);
        };
        if let Some(l) = cx.lookup(&id.name) {
            let local = &mut cx.locals[l.0 as usize];
            local.uses += 1;
            let ty = local.ty.clone();
            let def_span = local.span;
            let gran = local.gran;
            self.reference(span, Def::Local(l), def_span);
            return mk(ExprKind::Ref(Def::Local(l)), ty, gran, span);
        }
        if let Some(g) = self.scopes[cx.module].get(&id.name).copied() {
            self.reference(span, g.def, g.span);
            let ty = match g.def {
                Def::Fn(f) => Ty::Fn(self.program.fns[f.0 as usize].signature()),
                Def::Model(_) => Ty::Model,
                Def::Dataset(_) => Ty::Dataset,
                _ => Ty::Error,
            };
            if cx.place == Place::Pipeline && matches!(g.def, Def::Model(_) | Def::Dataset(_)) {
                self.report(
                    err(Code::E0201, format!("`{}` is not a parameter of this pipeline", id.name), span, "declared outside the pipeline")
                        .with_label(g.span, "declared here")
                        .with_help("a pipeline sees only its parameters and local models: add a parameter and pass the model in `run`"),
                );
                return error_expr(span);
            }
            return mk(ExprKind::Ref(g.def), ty, Granularity::Scalar, span);
        }
        let mut candidates: Vec<String> =
            cx.scopes.iter().flatten().map(|(n, _)| n.clone()).collect();
        candidates.extend(self.scopes[cx.module].keys().cloned());
        let suggestion = suggest(&id.name, candidates.iter().map(|s| s.as_str()));
        let help = match &suggestion {
            Some(s) => format!("did you mean `{s}`?"),
            None => "define it with `let`, as a parameter, or import it with `use`".to_string(),
        };
        self.report(
            err(
                Code::E0201,
                format!("unknown name `{}`", id.name),
                span,
                "not defined",
            )
            .with_help(help)
            .with_suggestion(id.span, suggestion.as_deref()),
        );
        error_expr(span)
    }

    fn field(&mut self, cx: &mut BodyCx, base: &ast::Expr, name: &ast::Ident, span: Span) -> Expr {
        let b = self.expr(cx, base);
        if b.ty.is_error() {
            return error_expr(span);
        }
        if b.ty == Ty::Model && cx.loss.is_some() {
            return self.model_output(cx, &b, name, span);
        }
        if b.ty != Ty::Sample {
            self.report(
                err(Code::E0206, format!("`{}` has no field `{}`", b.ty.describe(), name.name), name.span, "no such field")
                    .with_label(b.span, format!("this is a {}", b.ty.describe()))
                    .with_help("only a `Sample` has fields: `.prompt`, `.completion`, `.answer`, `.length`, `.group`, `.tokens`"),
            );
            return error_expr(span);
        }
        let (field, ty) = match name.name.as_str() {
            "prompt" => (SampleField::Prompt, Ty::Str),
            "completion" => (SampleField::Completion, Ty::Str),
            "answer" => (SampleField::Answer, Ty::Str),
            "length" => (SampleField::Length, Ty::Int),
            "group" => (SampleField::Group, Ty::Int),
            "tokens" => (SampleField::Tokens, Ty::Tokens),
            other => {
                let names = braid_stdlib::SAMPLE_FIELDS.iter().map(|f| f.key);
                let suggestion = suggest(other, names);
                let help = match &suggestion {
                    Some(s) => format!("did you mean `.{s}`?"),
                    None => format!(
                        "a `Sample` has `.prompt`, `.completion`, `.answer`, `.length`, `.group` and `.tokens`; read another field of its dataset record with `field(s, \"{other}\")` (a string), `field_int`, `field_float` or `field_bool`"
                    ),
                };
                self.report(
                    err(
                        Code::E0206,
                        format!("`Sample` has no field `{other}`"),
                        name.span,
                        "no such field",
                    )
                    .with_help(help)
                    .with_suggestion(name.span, suggestion.as_deref()),
                );
                return error_expr(span);
            }
        };
        mk(
            ExprKind::Field {
                base: Box::new(b),
                field,
            },
            ty,
            Granularity::PerSample,
            span,
        )
    }

    fn index(&mut self, cx: &mut BodyCx, base: &ast::Expr, index: &ast::Expr, span: Span) -> Expr {
        let b = self.expr(cx, base);
        let i = self.expr(cx, index);
        if b.ty.is_error() || i.ty.is_error() {
            return error_expr(span);
        }
        if cx.loss.is_some() {
            self.not_differentiable(span, "indexing a token", "a loss is evaluated on all tokens at once; write the per-token expression (`x - y`) instead of `x[t]`");
            return error_expr(span);
        }
        if b.ty != Ty::Tokens {
            self.report(
                err(
                    Code::E0310,
                    format!("cannot index a {}", b.ty.describe()),
                    b.span,
                    format!("this is a {}", b.ty.describe()),
                )
                .with_help("inside a `fn`, index a per-token parameter by token: `x[t]`"),
            );
            return error_expr(span);
        }
        if i.ty != Ty::Int {
            self.report(
                err(
                    Code::E0310,
                    format!("a token index must be an int, not a {}", i.ty.describe()),
                    i.span,
                    "not an int",
                )
                .with_help("index with the scan variable or an int expression such as `t + 1`"),
            );
            return error_expr(span);
        }
        mk(
            ExprKind::Index {
                base: Box::new(b),
                index: Box::new(i),
            },
            Ty::Float,
            Granularity::PerSample,
            span,
        )
    }

    fn unary(
        &mut self,
        cx: &mut BodyCx,
        op: ast::UnaryOp,
        operand: &ast::Expr,
        span: Span,
    ) -> Expr {
        let x = self.expr(cx, operand);
        let gran = x.gran;
        let ty = match (op, &x.ty) {
            (_, Ty::Error) => Ty::Error,
            (
                ast::UnaryOp::Neg,
                Ty::Int
                | Ty::Float
                | Ty::Tokens
                | Ty::PerToken(_)
                | Ty::PerSample(_)
                | Ty::Loss(..),
            ) => x.ty.clone(),
            (ast::UnaryOp::Not, Ty::Bool | Ty::TokenBools) => x.ty.clone(),
            _ => {
                let (sym, want) = if op == ast::UnaryOp::Neg {
                    ("-", "a number")
                } else {
                    ("!", "a bool")
                };
                self.report(
                    err(
                        Code::E0306,
                        format!("`{sym}` does not apply to a {}", x.ty.describe()),
                        x.span,
                        format!("expected {want}"),
                    )
                    .with_help(if op == ast::UnaryOp::Neg {
                        "negate a number or a per-token value"
                    } else {
                        "`!` negates a bool"
                    }),
                );
                Ty::Error
            }
        };
        let op = if op == ast::UnaryOp::Neg {
            UnaryOp::Neg
        } else {
            UnaryOp::Not
        };
        mk(
            ExprKind::Unary {
                op,
                operand: Box::new(x),
            },
            ty,
            gran,
            span,
        )
    }

    /// Reports E0304. The primary label is the value of the second rollout, the secondary one
    /// the first (labels must not overlap, or the terminal renderer stacks them unreadably).
    fn mixed(&mut self, cx: &BodyCx, a: RolloutId, b: RolloutId, sa: Span, sb: Span, _span: Span) {
        let mut d = err(
            Code::E0304,
            "values of two different rollouts are combined",
            sb,
            format!(
                "from rollout {}, combined with rollout {}",
                b.0 + 1,
                a.0 + 1
            ),
        )
        .with_label(sa, format!("from rollout {}", a.0 + 1));
        let (ga, gb) = (cx.rollout_span(a), cx.rollout_span(b));
        if !ga.is_dummy() && !gb.is_dummy() {
            d = d
                .with_label(ga, format!("rollout {} generated here", a.0 + 1))
                .with_label(gb, format!("rollout {} generated here", b.0 + 1));
        }
        self.report(d.with_help("each sample's values line up only with the same rollout's samples; to compare rollouts of one prompt batch, use `by_prompt(value, rollout)`"));
    }

    fn binary(
        &mut self,
        cx: &mut BodyCx,
        op: ast::BinaryOp,
        lhs: &ast::Expr,
        rhs: &ast::Expr,
        span: Span,
    ) -> Expr {
        let l = self.expr(cx, lhs);
        let r = self.expr(cx, rhs);
        let gran = l.gran.max(r.gran);
        let ty = self.binary_ty(cx, op, &l, &r, span);
        mk(
            ExprKind::Binary {
                op,
                lhs: Box::new(l),
                rhs: Box::new(r),
            },
            ty,
            gran,
            span,
        )
    }

    fn binary_ty(&mut self, cx: &BodyCx, op: ast::BinaryOp, l: &Expr, r: &Expr, span: Span) -> Ty {
        use Ty::*;
        use ast::BinaryOp as B;
        if l.ty.is_error() || r.ty.is_error() {
            return Error;
        }
        let same = |this: &mut Self, a: RolloutId, b: RolloutId| -> bool {
            if a != b {
                this.mixed(cx, a, b, l.span, r.span, span);
                false
            } else {
                true
            }
        };
        let result = match op {
            B::Add | B::Sub | B::Mul | B::Div | B::Rem => match (&l.ty, &r.ty) {
                (Int, Int) => Some(if op == B::Div { Float } else { Int }),
                (Int | Float, Int | Float) => Some(Float),
                (Tokens, Int | Float | Tokens) | (Int | Float, Tokens) => Some(Tokens),
                (PerToken(a), PerToken(b))
                | (PerToken(a), PerSample(b))
                | (PerSample(a), PerToken(b)) => {
                    if !same(self, *a, *b) {
                        return Error;
                    }
                    Some(PerToken(*a))
                }
                (PerSample(a), PerSample(b)) => {
                    if !same(self, *a, *b) {
                        return Error;
                    }
                    Some(PerSample(*a))
                }
                (PerToken(a), Int | Float) | (Int | Float, PerToken(a)) => Some(PerToken(*a)),
                (PerSample(a), Int | Float) | (Int | Float, PerSample(a)) => Some(PerSample(*a)),
                (Loss(a, ma), Loss(b, mb)) if matches!(op, B::Add | B::Sub) => {
                    match (a, b) {
                        (Some(x), Some(y)) if x != y => {
                            self.mixed(cx, *x, *y, l.span, r.span, span);
                            return Error;
                        }
                        _ => {}
                    }
                    if let (Some(x), Some(y)) = (ma, mb)
                        && x != y
                    {
                        self.loss_of_another_model(cx, *x, l.span, *y, r.span, false);
                        return Error;
                    }
                    Some(Loss(a.or(*b), ma.or(*mb)))
                }
                (Loss(a, m), Int | Float) if matches!(op, B::Mul | B::Div) => {
                    if !self.scales_a_loss(r) {
                        return Error;
                    }
                    Some(Loss(*a, *m))
                }
                (Int | Float, Loss(a, m)) if op == B::Mul => {
                    if !self.scales_a_loss(l) {
                        return Error;
                    }
                    Some(Loss(*a, *m))
                }
                _ => None,
            },
            B::Eq | B::Ne | B::Lt | B::Le | B::Gt | B::Ge => match (&l.ty, &r.ty) {
                (Int | Float, Int | Float) => Some(Bool),
                (Bool, Bool) | (Str, Str) if matches!(op, B::Eq | B::Ne) => Some(Bool),
                // In a loss body, comparisons are evaluated on all tokens at once.
                (Tokens, Int | Float | Tokens) | (Int | Float, Tokens) if cx.loss.is_some() => {
                    Some(TokenBools)
                }
                _ => None,
            },
            B::And | B::Or => match (&l.ty, &r.ty) {
                (Bool, Bool) => Some(Bool),
                (TokenBools, Bool | TokenBools) | (Bool, TokenBools) => Some(TokenBools),
                _ => None,
            },
        };
        match result {
            Some(t) => t,
            None => {
                let help = match op {
                    B::And | B::Or => "`&&` and `||` join bools, such as comparisons",
                    B::Eq | B::Ne => {
                        "compare numbers with numbers, bools with bools, strings with strings"
                    }
                    B::Lt | B::Le | B::Gt | B::Ge => "order comparisons apply to numbers",
                    _ if matches!(l.ty, Loss(..)) || matches!(r.ty, Loss(..)) => {
                        "a loss is one number for the whole mini-batch and combines only linearly: add or subtract losses and scale them by constants; compute products per token before reducing (`batch_mean(a * b)`)"
                    }
                    _ => {
                        "arithmetic applies to numbers, per-token and per-sample values of one rollout, and losses (`+`, and `*` by a number)"
                    }
                };
                self.report(
                    err(
                        Code::E0306,
                        format!(
                            "`{}` does not apply to {} and {}",
                            op.as_str(),
                            l.ty.describe(),
                            r.ty.describe()
                        ),
                        span,
                        format!("{} {} {}", l.ty.describe(), op.as_str(), r.ty.describe()),
                    )
                    .with_label(l.span, l.ty.describe())
                    .with_label(r.span, r.ty.describe())
                    .with_help(help),
                );
                Error
            }
        }
    }

    fn if_expr(
        &mut self,
        cx: &mut BodyCx,
        cond: &ast::Expr,
        then: &ast::Block,
        else_: &ast::Expr,
        span: Span,
    ) -> Expr {
        let in_pipeline = self.not_in_pipeline(cx, "`if`", span);
        let c = self.expr(cx, cond);
        let elementwise = c.ty == Ty::TokenBools;
        if !matches!(c.ty, Ty::Bool | Ty::Error | Ty::TokenBools) {
            self.report(
                err(
                    Code::E0301,
                    format!(
                        "an `if` condition must be a bool, not a {}",
                        c.ty.describe()
                    ),
                    c.span,
                    "not a bool",
                )
                .with_help("compare it: `x > 0.0`"),
            );
        }
        let t = self.block(cx, then);
        let e = self.expr(cx, else_);
        if in_pipeline {
            return error_expr(span);
        }
        let gran = c.gran.max(t.value.gran).max(e.gran);
        let joined = match (&t.value.ty, &e.ty) {
            (Ty::Error, x) | (x, Ty::Error) => Some(x.clone()),
            (a, b) if a == b => Some(a.clone()),
            (Ty::Int, Ty::Float) | (Ty::Float, Ty::Int) => Some(Ty::Float),
            (Ty::Tokens, Ty::Int | Ty::Float) | (Ty::Int | Ty::Float, Ty::Tokens) => {
                Some(Ty::Tokens)
            }
            (Ty::TokenBools, Ty::Bool) | (Ty::Bool, Ty::TokenBools) => Some(Ty::TokenBools),
            _ => None,
        };
        // In a loss body an `if` on per-token or per-sample conditions selects per element; a
        // choice between losses must be known before the run.
        let joined = match joined {
            Some(Ty::Loss(..)) if c.gran > Granularity::Scalar && !c.ty.is_error() => {
                self.report(
                    err(Code::E0311, "a choice between losses depends on per-sample values", c.span, "per-sample condition")
                        .with_help("a loss is one number for the mini-batch: choose per token or sample inside the reduction (`batch_mean(if c { a } else { b })`), or on a constant"),
                );
                return error_expr(span);
            }
            Some(Ty::Int | Ty::Float) if elementwise => Some(Ty::Tokens),
            Some(Ty::Bool) if elementwise => Some(Ty::TokenBools),
            other => other,
        };
        let ty = match (joined, &t.value.ty, &e.ty) {
            (Some(t), _, _) => t,
            (None, a, b) => {
                self.report(
                    err(
                        Code::E0307,
                        format!(
                            "`if` branches have different types: {} and {}",
                            a.describe(),
                            b.describe()
                        ),
                        span,
                        "branches differ",
                    )
                    .with_label(t.value.span, a.describe())
                    .with_label(e.span, b.describe())
                    .with_help(
                        "make both branches the same type, e.g. both floats: `1.0` and `0.0`",
                    ),
                );
                Ty::Error
            }
        };
        mk(
            ExprKind::If {
                cond: Box::new(c),
                then: t,
                else_: Box::new(e),
            },
            ty,
            gran,
            span,
        )
    }

    fn scan(&mut self, cx: &mut BodyCx, s: &ast::Scan, span: Span) -> Expr {
        if self.not_in_pipeline(cx, "`scan`", span) {
            return error_expr(span);
        }
        if cx.loss.is_some() {
            self.not_differentiable(span, "`scan`", "compute recurrences such as returns or GAE outside the loss (a `fn` in the pipeline) and pass them in");
            return error_expr(span);
        }
        let per_sample = matches!(
            cx.place,
            Place::Fn {
                per_sample: true,
                ..
            }
        );
        if !per_sample {
            self.report(
                err(Code::E0309, "`scan` needs a sample to visit", span, "no per-token context here")
                    .with_help("`scan` visits one sample's tokens: give the function a `PerToken` or `Sample` parameter"),
            );
            return error_expr(span);
        }
        let init = self.expr(cx, &s.init);
        if !init.ty.is_numeric_scalar() {
            self.report(
                err(
                    Code::E0301,
                    format!(
                        "a scan accumulator starts from a number, not a {}",
                        init.ty.describe()
                    ),
                    init.span,
                    "not a number",
                )
                .with_help("start it from a float: `with acc = 0.0`"),
            );
        }
        cx.push();
        let var = cx.add_local_gran(
            &s.var.name,
            LocalKind::ScanVar,
            Ty::Int,
            Granularity::PerSample,
            s.var.span,
        );
        let acc = cx.add_local_gran(
            &s.acc.name,
            LocalKind::ScanAcc,
            Ty::Float,
            Granularity::PerSample,
            s.acc.span,
        );
        // The accumulator and index count as used: a scan may ignore either.
        cx.locals[var.0 as usize].uses += 1;
        cx.locals[acc.0 as usize].uses += 1;
        let mut lets = Vec::new();
        for l in &s.lets {
            let v = self.expr(cx, &l.value);
            let id = cx.add_local_gran(
                &l.name.name,
                LocalKind::Let,
                v.ty.clone(),
                v.gran,
                l.name.span,
            );
            lets.push((id, v));
        }
        let value = self.expr(cx, &s.value);
        if !value.ty.is_numeric_scalar() {
            self.report(
                err(
                    Code::E0301,
                    format!("a scan step yields a number, not a {}", value.ty.describe()),
                    value.span,
                    "not a number",
                )
                .with_help("index per-token values by the scan variable: `r[t]`"),
            );
        }
        self.unused_lets(cx, &lets);
        cx.pop();
        let scan = Scan {
            reverse: s.reverse,
            var,
            acc,
            init,
            lets,
            value,
        };
        mk(
            ExprKind::Scan(Box::new(scan)),
            Ty::Tokens,
            Granularity::PerSample,
            span,
        )
    }

    // ------------------------------------------------------------------------------------------
    // Calls.

    /// Binds positional and named arguments to parameters. Reports unknown, duplicate, missing
    /// and surplus arguments. Returns, per parameter, the argument expression if given.
    pub(crate) fn bind_args<'e>(
        &mut self,
        what: &str,
        params: &[ParamSpec],
        args: &'e ast::Args,
        call_span: Span,
    ) -> Vec<Option<&'e ast::Expr>> {
        let mut bound: Vec<Option<&ast::Expr>> = vec![None; params.len()];
        for (i, a) in args.positional.iter().enumerate() {
            if i < params.len() {
                bound[i] = Some(a);
            } else {
                self.report(
                    err(
                        Code::E0303,
                        format!(
                            "{what} takes {} argument{}, but {} were given",
                            params.len(),
                            plural(params.len()),
                            args.positional.len()
                        ),
                        a.span,
                        "surplus argument",
                    )
                    .with_help(format!(
                        "the parameters are: {}",
                        params
                            .iter()
                            .map(|p| p.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )),
                );
                break;
            }
        }
        for n in &args.named {
            match params.iter().position(|p| p.name == n.name.name) {
                None => {
                    let names: Vec<&str> = params.iter().map(|p| p.name.as_str()).collect();
                    self.report(unknown_argument(what, &n.name, &names));
                }
                Some(i) if bound[i].is_some() => {
                    let prev = bound[i].map_or(call_span, |e| e.span);
                    self.report(
                        err(
                            Code::E0209,
                            format!("argument `{}` is given twice", n.name.name),
                            n.span,
                            "given again",
                        )
                        .with_label(prev, "first given here")
                        .with_help("give each argument once"),
                    );
                }
                Some(i) => bound[i] = Some(&n.value),
            }
        }
        for (i, p) in params.iter().enumerate() {
            if bound[i].is_none() && !p.optional {
                self.report(
                    err(
                        Code::E0302,
                        format!("{what} is missing argument `{}`", p.name),
                        call_span,
                        format!("`{}` missing", p.name),
                    )
                    .with_help(format!("pass it by position or as `{}: …`", p.name)),
                );
            }
        }
        bound
    }

    fn call(&mut self, cx: &mut BodyCx, callee: &ast::Expr, args: &ast::Args, span: Span) -> Expr {
        let ast::ExprKind::Path(path) = &callee.kind else {
            // `s.field("x")`: the record-field readers are functions, like every built-in.
            let help = match &callee.kind {
                ast::ExprKind::Field { name, .. }
                    if braid_stdlib::builtin(&name.name)
                        .is_some_and(|b| b.params.first().is_some_and(|p| p.ty == "Sample")) =>
                {
                    format!(
                        "`{0}` is a built-in function, not a method: write `{0}(s, \"name\")`",
                        name.name
                    )
                }
                _ => "call a `fn`, a built-in, or a function parameter by name".into(),
            };
            self.report(
                err(
                    Code::E0305,
                    "only named functions can be called",
                    callee.span,
                    "not a function name",
                )
                .with_help(help),
            );
            return error_expr(span);
        };
        let Some(id) = path.as_single() else {
            self.report(err(Code::E0201, format!("unknown function `{}`", path.text()), path.span, "not defined")
                .with_help("`::` paths name dataset sources such as `synthetic::letters`, which appear only in `dataset` declarations"));
            return error_expr(span);
        };
        let name = id.name.as_str();
        // Locals first: a function-valued pipeline parameter.
        if let Some(l) = cx.lookup(name) {
            let local = &mut cx.locals[l.0 as usize];
            local.uses += 1;
            let def_span = local.span;
            let ty = local.ty.clone();
            self.reference(id.span, Def::Local(l), def_span);
            return match ty {
                Ty::Fn(sig) => self.call_sig(cx, Callee::FnValue(l), name, &sig, None, args, span),
                Ty::Error => error_expr(span),
                other => {
                    self.report(
                        err(
                            Code::E0305,
                            format!("`{name}` is a {}, not a function", other.describe()),
                            callee.span,
                            "called here",
                        )
                        .with_label(def_span, "defined here")
                        .with_help("only functions can be called"),
                    );
                    error_expr(span)
                }
            };
        }
        if let Some(g) = self.scopes[cx.module].get(name).copied() {
            self.reference(id.span, g.def, g.span);
            return match g.def {
                Def::Fn(f) if self.program.fns[f.0 as usize].is_loss() => {
                    self.call_loss(cx, f, name, id.span, args, span)
                }
                Def::Fn(f) => {
                    let func = &self.program.fns[f.0 as usize];
                    let sig = func.signature();
                    let scope = func.scope;
                    let defaults: Vec<Option<Expr>> =
                        func.params.iter().map(|p| p.default.clone()).collect();
                    let names: Vec<String> = func.params.iter().map(|p| p.name.clone()).collect();
                    cx.calls.insert(f);
                    if let Place::Fn { .. } = cx.place
                        && scope != Scope::Sample
                    {
                        self.report(
                                err(Code::E0311, format!("`{name}` works over a {}, so it cannot be called for one sample", if scope == Scope::Group { "group" } else { "batch" }), id.span, "called inside a `fn`")
                                    .with_label(g.span, "declared with `over`")
                                    .with_help("call it from the pipeline body, where whole groups and batches exist"),
                            );
                        return error_expr(span);
                    }
                    self.call_fn(
                        cx,
                        Callee::Fn(f),
                        name,
                        &sig,
                        scope,
                        &names,
                        &defaults,
                        args,
                        span,
                    )
                }
                Def::Pipeline(_) => {
                    self.report(
                        err(
                            Code::E0305,
                            format!("`{name}` is a pipeline; pipelines are run, not called"),
                            callee.span,
                            "called here",
                        )
                        .with_label(g.span, "pipeline declared here")
                        .with_help(format!("run it with `run {name}(…)`")),
                    );
                    error_expr(span)
                }
                _ => {
                    self.report(
                        err(
                            Code::E0305,
                            format!("`{name}` is not a function"),
                            callee.span,
                            "called here",
                        )
                        .with_label(g.span, "declared here")
                        .with_help("only functions can be called"),
                    );
                    error_expr(span)
                }
            };
        }
        if let Some(b) = braid_stdlib::builtin(name) {
            self.reference(id.span, Def::Builtin(b.name), Span::DUMMY);
            return self.call_builtin(cx, b, args, id.span, span);
        }
        let mut candidates: Vec<String> = self.scopes[cx.module].keys().cloned().collect();
        candidates.extend(braid_stdlib::BUILTINS.iter().map(|b| b.name.to_string()));
        let suggestion = suggest(name, candidates.iter().map(|s| s.as_str()));
        let help = match &suggestion {
            Some(s) => format!("did you mean `{s}`?"),
            None => "define it with `fn`, or import it: standard functions live in `std::advantages`, `std::kl` and `std::rewards`".into(),
        };
        self.report(
            err(
                Code::E0201,
                format!("unknown function `{name}`"),
                id.span,
                "not defined",
            )
            .with_help(help)
            .with_suggestion(id.span, suggestion.as_deref()),
        );
        for a in &args.positional {
            self.expr(cx, a);
        }
        error_expr(span)
    }

    /// Calls a function value (a pipeline parameter such as `reward`): all arguments required.
    #[allow(clippy::too_many_arguments)]
    fn call_sig(
        &mut self,
        cx: &mut BodyCx,
        callee: Callee,
        name: &str,
        sig: &FnSig,
        _scope: Option<Scope>,
        args: &ast::Args,
        span: Span,
    ) -> Expr {
        let names: Vec<String> = (0..sig.params.len()).map(|i| format!("arg{i}")).collect();
        let defaults = vec![None; sig.params.len()];
        self.call_fn(
            cx,
            callee,
            name,
            sig,
            Scope::Sample,
            &names,
            &defaults,
            args,
            span,
        )
    }

    /// Checks a call of a user function (or function value): per-sample application in a
    /// pipeline, a plain call in a `fn`.
    #[allow(clippy::too_many_arguments)]
    fn call_fn(
        &mut self,
        cx: &mut BodyCx,
        callee: Callee,
        name: &str,
        sig: &FnSig,
        scope: Scope,
        names: &[String],
        defaults: &[Option<Expr>],
        args: &ast::Args,
        span: Span,
    ) -> Expr {
        let specs: Vec<ParamSpec> = names
            .iter()
            .zip(defaults)
            .map(|(n, d)| ParamSpec {
                name: n.clone(),
                optional: d.is_some(),
            })
            .collect();
        let bound = self.bind_args(&format!("`{name}`"), &specs, args, span);
        if let Callee::Fn(f) = &callee {
            self.check_where_literals(*f, &bound, span);
        }
        let per_sample = sig.params.iter().any(|p| p.is_sample_valued());
        let mut out = Vec::new();
        let mut rollout: Option<(RolloutId, Span)> = None;
        let mut gran = if per_sample {
            scope.granularity()
        } else {
            Granularity::Scalar
        };
        let mut ok = true;
        for (i, pty) in sig.params.iter().enumerate() {
            let arg = match bound.get(i).copied().flatten() {
                Some(a) => self.expr(cx, a),
                None => match defaults.get(i).cloned().flatten() {
                    Some(mut d) => {
                        d.span = span;
                        d
                    }
                    None => {
                        ok = false;
                        continue;
                    }
                },
            };
            gran = gran.max(arg.gran);
            if arg.ty.is_error() {
                ok = false;
                out.push(arg);
                continue;
            }
            let accepted = match cx.place {
                Place::Pipeline => match (pty, &arg.ty) {
                    (SigTy::Sample, Ty::Rollout(r, _))
                    | (SigTy::PerToken, Ty::PerToken(r))
                    | (SigTy::PerSample, Ty::PerSample(r)) => {
                        if let Some((r0, s0)) = rollout {
                            if r0 != *r {
                                self.mixed(cx, r0, *r, s0, arg.span, span);
                                ok = false;
                            }
                        } else {
                            rollout = Some((*r, arg.span));
                        }
                        true
                    }
                    (SigTy::Float, Ty::Int | Ty::Float)
                    | (SigTy::Int, Ty::Int)
                    | (SigTy::Bool, Ty::Bool)
                    | (SigTy::Str, Ty::Str) => true,
                    _ => false,
                },
                _ => matches!(
                    (pty, &arg.ty),
                    (SigTy::Sample, Ty::Sample)
                        | (SigTy::PerToken, Ty::Tokens)
                        | (SigTy::PerSample | SigTy::Float, Ty::Int | Ty::Float)
                        | (SigTy::Int, Ty::Int)
                        | (SigTy::Bool, Ty::Bool)
                        | (SigTy::Str, Ty::Str)
                ),
            };
            if !accepted {
                let want = match (cx.place, pty) {
                    (Place::Pipeline, SigTy::Sample) => {
                        "a Rollout (the function is applied to every sample)".to_string()
                    }
                    (Place::Pipeline, t) => t.to_string(),
                    (_, t) => t.in_fn_body().describe(),
                };
                self.report(
                    err(
                        Code::E0301,
                        format!(
                            "argument {} of `{name}` must be {want}, not {}",
                            i + 1,
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
        if !ok {
            return mk(
                ExprKind::Call {
                    callee,
                    args: out,
                    mapped: per_sample,
                },
                Ty::Error,
                gran,
                span,
            );
        }
        let ty = match cx.place {
            Place::Pipeline if per_sample => {
                let r = rollout.map_or(RolloutId(u32::MAX), |r| r.0);
                match &*sig.ret {
                    SigTy::PerToken => Ty::PerToken(r),
                    _ => Ty::PerSample(r),
                }
            }
            _ => sig.ret.in_fn_body(),
        };
        let ty = if ty == Ty::Error { Ty::Error } else { ty };
        mk(
            ExprKind::Call {
                callee,
                args: out,
                mapped: per_sample && cx.place == Place::Pipeline,
            },
            ty,
            gran,
            span,
        )
    }

    fn call_builtin(
        &mut self,
        cx: &mut BodyCx,
        b: &'static braid_stdlib::Builtin,
        args: &ast::Args,
        name_span: Span,
        span: Span,
    ) -> Expr {
        use braid_stdlib::Place as BP;
        let wrong_place = match (b.place, cx.place) {
            (BP::Pipeline, Place::Pipeline) => false,
            (BP::Fn, Place::Fn { .. }) => false,
            (BP::Loss, Place::Fn { .. }) => cx.loss.is_none(),
            _ => true,
        };
        if wrong_place {
            let (msg, help) = if b.place == BP::Loss {
                (
                    format!("`{}` can only be called in the body of a loss", b.name),
                    "reductions to the loss and `stop_grad` belong in a `fn … -> Loss`, which `train` differentiates".to_string(),
                )
            } else if b.place == BP::Pipeline {
                (
                    format!("`{}` can only be called in a pipeline body", b.name),
                    "model calls, `next`, losses and `by_prompt` build the pipeline's dataflow graph; a `fn` computes on one sample's values".to_string(),
                )
            } else {
                (
                    format!("`{}` can only be called in a `fn` body", b.name),
                    format!(
                        "write a `fn` that uses `{}` and apply it to the rollout in the pipeline",
                        b.name
                    ),
                )
            };
            self.report(err(Code::E0407, msg, name_span, "called here").with_help(help));
            for a in &args.positional {
                self.expr(cx, a);
            }
            return error_expr(span);
        }
        let specs: Vec<ParamSpec> = b
            .params
            .iter()
            .map(|p| ParamSpec {
                name: p.name.to_string(),
                optional: p.default.is_some(),
            })
            .collect();
        let bound = self.bind_args(&format!("`{}`", b.name), &specs, args, span);
        match b.place {
            BP::Pipeline => crate::builtins::pipeline_builtin(self, cx, b, &bound, span),
            BP::Loss => crate::loss::loss_builtin(self, cx, b, &bound, span),
            BP::Fn => crate::builtins::fn_builtin(self, cx, b, &bound, span),
        }
    }

    // Helpers used by the built-in rules.

    pub(crate) fn new_rollout(&mut self, cx: &mut BodyCx, batch: BatchId, span: Span) -> RolloutId {
        cx.new_rollout(batch, span)
    }

    pub(crate) fn new_batch(&mut self, cx: &mut BodyCx) -> BatchId {
        cx.new_batch()
    }

    pub(crate) fn rollout_batch(&self, cx: &BodyCx, r: RolloutId) -> Option<BatchId> {
        cx.rollouts.get(r.0 as usize).map(|x| x.0)
    }

    pub(crate) fn report_mixed(
        &mut self,
        cx: &BodyCx,
        a: RolloutId,
        b: RolloutId,
        sa: Span,
        sb: Span,
        span: Span,
    ) {
        self.mixed(cx, a, b, sa, sb, span);
    }

    pub(crate) fn rollout_span_of(&self, cx: &BodyCx, r: RolloutId) -> Span {
        cx.rollout_span(r)
    }
}

fn articles(s: &str) -> String {
    let mut out = s.to_string();
    for word in ["int", "Optimizer", "`lm`", "`int`", "{unknown}"] {
        for lead in [" a ", "(a ", "\na "] {
            out = out.replace(
                &format!("{lead}{word}"),
                &format!("{}n {word}", lead.trim_end()),
            );
        }
        if let Some(rest) = out.strip_prefix(&format!("a {word}")) {
            out = format!("an {word}{rest}");
        }
    }
    out
}

/// E0208: a named argument matching no parameter of `what` (`` `tiny` ``, `` `grpo` ``, …),
/// with a "did you mean" help and quick fix when a parameter is close.
pub(crate) fn unknown_argument(what: &str, name: &ast::Ident, params: &[&str]) -> Diagnostic {
    let suggestion = suggest(&name.name, params.iter().copied());
    let help = match &suggestion {
        Some(s) => format!("did you mean `{s}`?"),
        None => format!("{what} takes {}", params.join(", ")),
    };
    err(
        Code::E0208,
        format!("{what} has no parameter `{}`", name.name),
        name.span,
        "unknown argument",
    )
    .with_help(help)
    .with_suggestion(name.span, suggestion.as_deref())
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// The candidate closest to `name` by edit distance, if it is close enough to suggest.
pub(crate) fn suggest<'s>(name: &str, candidates: impl Iterator<Item = &'s str>) -> Option<String> {
    let mut best: Option<(usize, &str)> = None;
    for c in candidates {
        if c == name {
            continue;
        }
        let d = edit_distance(name, c);
        let limit = (name.len().max(c.len()) / 3).max(1);
        if d <= limit && best.is_none_or(|(bd, bc)| (d, c) < (bd, bc)) {
            best = Some((d, c));
        }
    }
    best.map(|(_, c)| c.to_string())
}

fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for i in 1..=a.len() {
        let mut cur = vec![i; b.len() + 1];
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            cur[j] = (prev[j] + 1).min(cur[j - 1] + 1).min(prev[j - 1] + cost);
        }
        prev = cur;
    }
    prev[b.len()]
}
