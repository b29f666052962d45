//! `where` conditions on `fn` parameters (`estimator: string = "k1" where estimator == "k1" ||
//! …`): which constants a function accepts. Functions are specialised for their constant
//! arguments before they run (strings select branches, settings fold into the code), so an
//! argument outside the accepted values is an error of the program, reported before anything
//! runs (E0404):
//!
//! - at every call whose arguments are literals (in any body), as soon as the call is checked;
//! - for the run, by pushing its settings through the pipeline body and every function it
//!   calls, as the lowering will, checking each call on the way ([`Checker::check_run_wheres`]).
//!
//! This module decides nothing the lowering does not: it only reads values that are constant
//! for the run.

use std::collections::BTreeMap;

use braid_diagnostics::{Code, Diagnostic, Span};
use braid_syntax::ast;

use crate::check::Checker;
use crate::hir::*;

/// How deep the walk follows calls (the checker rejects recursion; this bounds the work on
/// programs that have errors).
const MAX_DEPTH: usize = 32;

/// A constant of the run and where it was written.
#[derive(Debug, Clone)]
struct Known {
    value: Value,
    span: Span,
}

impl Checker<'_> {
    /// Checks the `where` conditions of `f`'s parameters against the arguments of one call
    /// that are literals (and the defaults of the others).
    pub(crate) fn check_where_literals(
        &mut self,
        f: FnId,
        bound: &[Option<&ast::Expr>],
        call_span: Span,
    ) {
        let Some(&(_, decl)) = self.fn_asts.get(f.0 as usize) else {
            return;
        };
        if decl.params.iter().all(|p| p.where_.is_none()) {
            return;
        }
        let mut known: BTreeMap<String, Known> = BTreeMap::new();
        for (i, p) in decl.params.iter().enumerate() {
            let k = match bound.get(i).copied().flatten() {
                Some(a) => self.const_eval(a, &BTreeMap::new()).ok().map(|v| Known {
                    value: v,
                    span: a.span,
                }),
                None => p
                    .default
                    .as_ref()
                    .and_then(|d| self.const_eval(d, &BTreeMap::new()).ok())
                    .map(|v| Known {
                        value: v,
                        span: call_span,
                    }),
            };
            if let Some(k) = k {
                known.insert(p.name.name.clone(), k);
            }
        }
        self.check_wheres(f, &known, call_span, None);
    }

    /// Evaluates `f`'s `where` conditions over the known arguments; reports the false ones.
    /// `run` is the span to blame when a value was not written in the root file.
    fn check_wheres(
        &mut self,
        f: FnId,
        known: &BTreeMap<String, Known>,
        call_span: Span,
        run: Option<Span>,
    ) {
        let Some(&(_, decl)) = self.fn_asts.get(f.0 as usize) else {
            return;
        };
        let env: BTreeMap<String, Value> = known
            .iter()
            .map(|(k, v)| (k.clone(), v.value.clone()))
            .collect();
        let fname = decl.name.name.clone();
        for p in &decl.params {
            let Some(w) = &p.where_ else { continue };
            if let Ok(Value::Bool(false)) = self.const_eval(w, &env) {
                let cond = self.sources.snippet(w.span).to_string();
                let value = known.get(&p.name.name);
                let value_text = value.map_or(String::from("unset"), |v| v.value.to_string());
                let written = value.map(|v| v.span).filter(|s| *s != call_span);
                let root = self.program.root;
                let (primary, label) = match (written, run) {
                    (Some(s), Some(r)) if s.file != root => {
                        (r, format!("`{}` is {value_text}", p.name.name))
                    }
                    (Some(s), _) => (s, format!("`{}` is {value_text}", p.name.name)),
                    (None, Some(r)) if call_span.file != root => {
                        (r, format!("`{}` defaults to {value_text}", p.name.name))
                    }
                    (None, _) => (
                        call_span,
                        format!("`{}` defaults to {value_text}", p.name.name),
                    ),
                };
                let mut d = Diagnostic::new(
                    Code::E0404,
                    format!("`{}` of `{fname}` must satisfy `{cond}`", p.name.name),
                    primary,
                    label,
                )
                .with_label(w.span, "required here")
                .with_help(format!(
                    "pass a value of `{}` for which `{cond}` holds",
                    p.name.name
                ));
                let inside = primary.file == call_span.file
                    && call_span.start <= primary.start
                    && primary.end <= call_span.end;
                if !inside {
                    d = d.with_label(call_span, format!("`{fname}` called here"));
                }
                self.report(d);
            }
        }
    }

    /// Pushes the run's constants through the pipeline body and every function it calls,
    /// checking the `where` conditions of each call on the way. `settings` are the pipeline's
    /// `param`s with their values and where they were written; `run` is the `run` item.
    pub(crate) fn check_run_wheres(
        &mut self,
        pl: &Pipeline,
        settings: &BTreeMap<String, (Value, Span)>,
        args: &[RunArg],
        arg_spans: &[Span],
        run: Span,
    ) {
        let mut env: BTreeMap<LocalId, Known> = BTreeMap::new();
        for (li, local) in pl.locals.iter().enumerate() {
            let k = match local.kind {
                LocalKind::Setting(_) => settings.get(&local.name).map(|(v, s)| Known {
                    value: v.clone(),
                    span: *s,
                }),
                LocalKind::Param(i) => match args.get(i as usize) {
                    Some(RunArg::Value(v)) => Some(Known {
                        value: v.clone(),
                        span: arg_spans.get(i as usize).copied().unwrap_or(run),
                    }),
                    _ => None,
                },
                _ => None,
            };
            if let Some(k) = k {
                env.insert(LocalId(li as u32), k);
            }
        }
        let Some(each) = &pl.each else { return };
        let mut w = Walk {
            ch: self,
            fn_values: fn_values(pl, args),
            calls: Vec::new(),
        };
        for s in &each.stmts {
            match s {
                Stmt::Let(l, e) => {
                    if let Some(k) = w.expr(e, &mut env, 0) {
                        env.insert(*l, k);
                    }
                }
                Stmt::Expr(e) => {
                    w.expr(e, &mut env, 0);
                }
            }
        }
        for (f, known, span) in std::mem::take(&mut w.calls) {
            self.check_wheres(f, &known, span, Some(run));
        }
    }

    /// Whether a `where` condition of `f` is false for these arguments.
    fn where_fails(&self, f: FnId, known: &BTreeMap<String, Known>) -> bool {
        let Some(&(_, decl)) = self.fn_asts.get(f.0 as usize) else {
            return false;
        };
        let env: BTreeMap<String, Value> = known
            .iter()
            .map(|(k, v)| (k.clone(), v.value.clone()))
            .collect();
        decl.params.iter().any(|p| {
            p.where_
                .as_ref()
                .is_some_and(|w| matches!(self.const_eval(w, &env), Ok(Value::Bool(false))))
        })
    }
}

/// Function-valued parameters of the pipeline bound by the run.
fn fn_values(pl: &Pipeline, args: &[RunArg]) -> BTreeMap<LocalId, FnId> {
    let mut out = BTreeMap::new();
    for (li, local) in pl.locals.iter().enumerate() {
        if let LocalKind::Param(i) = local.kind
            && let Some(RunArg::Fn(f)) = args.get(i as usize)
        {
            out.insert(LocalId(li as u32), *f);
        }
    }
    out
}

/// The walk of one run: constant folding over the typed program, as the lowering does, and
/// every call of a function with its known arguments.
struct Walk<'c, 'a> {
    ch: &'c Checker<'a>,
    fn_values: BTreeMap<LocalId, FnId>,
    /// The calls whose `where` conditions fail: (function, its known arguments by parameter
    /// name, the call). The walk does not enter them: what they call would only repeat it.
    calls: Vec<(FnId, BTreeMap<String, Known>, Span)>,
}

impl Walk<'_, '_> {
    fn body(
        &mut self,
        b: &Body,
        env: &mut BTreeMap<LocalId, Known>,
        depth: usize,
    ) -> Option<Known> {
        for (l, e) in &b.lets {
            if let Some(k) = self.expr(e, env, depth) {
                env.insert(*l, k);
            }
        }
        self.expr(&b.value, env, depth)
    }

    /// Walks `e`, recording calls; its value when it is a constant of the run.
    fn expr(
        &mut self,
        e: &Expr,
        env: &mut BTreeMap<LocalId, Known>,
        depth: usize,
    ) -> Option<Known> {
        let known = |v: Value| {
            Some(Known {
                value: v,
                span: e.span,
            })
        };
        match &e.kind {
            ExprKind::Lit(v) => known(v.clone()),
            ExprKind::Ref(Def::Local(l)) => env.get(l).cloned(),
            ExprKind::Unary { op, operand } => {
                let x = self.expr(operand, env, depth)?;
                let v = match (op, x.value) {
                    (UnaryOp::Neg, Value::Int(i)) => Value::Int(i.checked_neg()?),
                    (UnaryOp::Neg, Value::Float(f)) => Value::Float(-f),
                    (UnaryOp::Not, Value::Bool(b)) => Value::Bool(!b),
                    _ => return None,
                };
                known(v)
            }
            ExprKind::Binary { op, lhs, rhs } => {
                let a = self.expr(lhs, env, depth);
                let b = self.expr(rhs, env, depth);
                known(fold(*op, &a?.value, &b?.value)?)
            }
            ExprKind::If { cond, then, else_ } => match self.expr(cond, env, depth) {
                Some(Known {
                    value: Value::Bool(true),
                    ..
                }) => self.body(then, env, depth),
                Some(Known {
                    value: Value::Bool(false),
                    ..
                }) => self.expr(else_, env, depth),
                _ => {
                    self.body(then, env, depth);
                    self.expr(else_, env, depth);
                    None
                }
            },
            ExprKind::Block(b) => self.body(b, env, depth),
            ExprKind::Call { callee, args, .. } => {
                let vals: Vec<Option<Known>> =
                    args.iter().map(|a| self.expr(a, env, depth)).collect();
                let f = match callee {
                    Callee::Fn(f) => Some(*f),
                    Callee::FnValue(l) => self.fn_values.get(l).copied(),
                    _ => None,
                };
                let fns = &self.ch.program.fns;
                if let Some(f) = f
                    && let Some(func) = fns.get(f.0 as usize)
                    && depth < MAX_DEPTH
                {
                    let mut by_name = BTreeMap::new();
                    let mut inner = BTreeMap::new();
                    for (i, p) in func.params.iter().enumerate() {
                        let Some(Some(k)) = vals.get(i) else { continue };
                        by_name.insert(p.name.clone(), k.clone());
                        if let Some(li) = func
                            .locals
                            .iter()
                            .position(|l| l.kind == LocalKind::Param(i as u32))
                        {
                            inner.insert(LocalId(li as u32), k.clone());
                        }
                    }
                    if self.ch.where_fails(f, &by_name) {
                        self.calls.push((f, by_name, e.span));
                    } else {
                        self.body(&func.body, &mut inner, depth + 1);
                    }
                }
                None
            }
            ExprKind::Field { base, .. } => {
                self.expr(base, env, depth);
                None
            }
            ExprKind::Index { base, index } => {
                self.expr(base, env, depth);
                self.expr(index, env, depth);
                None
            }
            ExprKind::Scan(s) => {
                self.expr(&s.init, env, depth);
                for (l, x) in &s.lets {
                    if let Some(k) = self.expr(x, env, depth) {
                        env.insert(*l, k);
                    }
                }
                self.expr(&s.value, env, depth);
                None
            }
            ExprKind::Ref(_) | ExprKind::ModelOutput { .. } | ExprKind::Error => None,
        }
    }
}

/// A binary operation on constants, with the language's semantics (`/` always a float, ints
/// that overflow are not constants).
pub(crate) fn fold(op: BinaryOp, a: &Value, b: &Value) -> Option<Value> {
    use BinaryOp as B;
    Some(match (a, b) {
        (Value::Int(x), Value::Int(y)) => match op {
            B::Add => Value::Int(x.checked_add(*y)?),
            B::Sub => Value::Int(x.checked_sub(*y)?),
            B::Mul => Value::Int(x.checked_mul(*y)?),
            B::Div => Value::Float(*x as f64 / *y as f64),
            B::Rem => Value::Int(x.checked_rem(*y)?),
            B::Eq => Value::Bool(x == y),
            B::Ne => Value::Bool(x != y),
            B::Lt => Value::Bool(x < y),
            B::Le => Value::Bool(x <= y),
            B::Gt => Value::Bool(x > y),
            B::Ge => Value::Bool(x >= y),
            B::And | B::Or => return None,
        },
        (Value::Bool(x), Value::Bool(y)) => match op {
            B::And => Value::Bool(*x && *y),
            B::Or => Value::Bool(*x || *y),
            B::Eq => Value::Bool(x == y),
            B::Ne => Value::Bool(x != y),
            _ => return None,
        },
        (Value::Str(x), Value::Str(y)) => match op {
            B::Eq => Value::Bool(x == y),
            B::Ne => Value::Bool(x != y),
            _ => return None,
        },
        _ => {
            let (x, y) = (a.as_f64()?, b.as_f64()?);
            match op {
                B::Add => Value::Float(x + y),
                B::Sub => Value::Float(x - y),
                B::Mul => Value::Float(x * y),
                B::Div => Value::Float(x / y),
                B::Rem => Value::Float(x % y),
                B::Eq => Value::Bool(x == y),
                B::Ne => Value::Bool(x != y),
                B::Lt => Value::Bool(x < y),
                B::Le => Value::Bool(x <= y),
                B::Gt => Value::Bool(x > y),
                B::Ge => Value::Bool(x >= y),
                B::And | B::Or => return None,
            }
        }
    })
}
