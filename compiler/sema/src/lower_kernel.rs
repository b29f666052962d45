//! Lowering typed `fn` bodies to the kernel IR (`braid_ir::kernel`), which the interpreter and
//! the Cranelift JIT run over a batch of samples.
//!
//! A kernel is what a function computes for one sample. Calls to other `fn`s are inlined (the
//! checker rejects recursion). String parameters are not kernel values: they are specialised —
//! the caller gives each a constant (a run setting such as `kl_estimator: "k3"`, or the
//! parameter's default), and string comparisons fold to constants. Strings of the sample
//! (`s.completion`, …, and the record's string fields, `field(s, "topic")`) are operands of
//! host calls only, comparisons with `==` included. This module must not decide anything
//! the checker has not checked: an input it cannot lower is a `LowerError`, never a panic.

use std::collections::BTreeMap;

use braid_ir::kernel::{
    self as k, BinOp, KernelBuilder, ParamKind, ReduceOp, SampleParam, ScalarTy, StrField,
};

use crate::hir::*;

/// Why a function could not become a kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LowerError(pub String);

impl std::fmt::Display for LowerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LowerError {}

/// A lowered function: the kernel, and for each of the function's parameters the index of its
/// kernel parameter (`None` for a specialised string parameter).
#[derive(Debug, Clone)]
pub struct LoweredKernel {
    pub kernel: k::Kernel,
    pub param_map: Vec<Option<usize>>,
}

/// A value during lowering: a kernel value, or a string known at compile time or read from the
/// sample.
#[derive(Debug, Clone)]
enum LVal {
    V(k::Value),
    Const(String),
    SampleStr(SampleParam, StrField),
    Sample(SampleParam),
    /// A condition known at compile time (a comparison of specialised strings): an `if` on it
    /// lowers only the branch taken, which keeps scope reductions out of nested blocks.
    ConstBool(bool),
}

fn err<T>(msg: impl Into<String>) -> Result<T, LowerError> {
    Err(LowerError(msg.into()))
}

/// Lowers function `f` of `program`. `strings` gives constants for string parameters by name;
/// a string parameter without one uses its default.
pub fn lower_fn(
    program: &Program,
    f: FnId,
    strings: &BTreeMap<String, String>,
) -> Result<LoweredKernel, LowerError> {
    let func = program
        .fns
        .get(f.0 as usize)
        .ok_or_else(|| LowerError(format!("no function #{}", f.0)))?;
    let scope = match func.scope {
        Scope::Sample => k::Scope::Sample,
        Scope::Group => k::Scope::Group,
        Scope::Batch => k::Scope::Batch,
    };
    let mut b = KernelBuilder::new(func.name.clone(), scope);
    let mut env: BTreeMap<LocalId, LVal> = BTreeMap::new();
    let mut param_map = Vec::new();
    let mut next_param = 0usize;
    for (i, p) in func.params.iter().enumerate() {
        let local = func
            .locals
            .iter()
            .position(|l| l.kind == LocalKind::Param(i as u32))
            .map(|x| LocalId(x as u32))
            .ok_or_else(|| {
                LowerError(format!(
                    "`{}`: parameter `{}` has no local",
                    func.name, p.name
                ))
            })?;
        let v = match &p.ty {
            SigTy::Sample => LVal::Sample(b.sample_param()),
            SigTy::PerToken => LVal::V(b.param(ParamKind::PerToken)),
            SigTy::PerSample => LVal::V(b.param(ParamKind::PerSample)),
            SigTy::Int => LVal::V(b.param(ParamKind::Scalar(ScalarTy::Int))),
            SigTy::Float => LVal::V(b.param(ParamKind::Scalar(ScalarTy::Float))),
            SigTy::Bool => LVal::V(b.param(ParamKind::Scalar(ScalarTy::Bool))),
            SigTy::Str => {
                let value = match strings.get(&p.name) {
                    Some(s) => s.clone(),
                    None => match &p.default {
                        Some(Expr {
                            kind: ExprKind::Lit(Value::Str(s)),
                            ..
                        }) => s.clone(),
                        _ => {
                            return err(format!(
                                "`{}`: string parameter `{}` needs a constant value",
                                func.name, p.name
                            ));
                        }
                    },
                };
                param_map.push(None);
                env.insert(local, LVal::Const(value));
                continue;
            }
            other => {
                return err(format!(
                    "`{}`: a parameter of type {other} cannot be lowered to a kernel",
                    func.name
                ));
            }
        };
        param_map.push(Some(next_param));
        next_param += 1;
        env.insert(local, v);
    }
    let mut cx = Lower {
        program,
        b,
        scope: func.scope,
    };
    let result = cx.body(&func.locals, &mut env, &func.body)?;
    let LVal::V(result) = result else {
        return err(format!(
            "`{}` returns a string, which a kernel cannot",
            func.name
        ));
    };
    let kernel =
        cx.b.finish(result)
            .map_err(|e| LowerError(format!("`{}`: {e}", func.name)))?;
    Ok(LoweredKernel { kernel, param_map })
}

struct Lower<'p> {
    program: &'p Program,
    b: KernelBuilder,
    scope: Scope,
}

impl Lower<'_> {
    fn body(
        &mut self,
        locals: &[Local],
        env: &mut BTreeMap<LocalId, LVal>,
        body: &Body,
    ) -> Result<LVal, LowerError> {
        for (l, e) in &body.lets {
            let v = self.expr(locals, env, e)?;
            env.insert(*l, v);
        }
        self.expr(locals, env, &body.value)
    }

    fn value(
        &mut self,
        locals: &[Local],
        env: &mut BTreeMap<LocalId, LVal>,
        e: &Expr,
    ) -> Result<k::Value, LowerError> {
        match self.expr(locals, env, e)? {
            LVal::V(v) => Ok(v),
            LVal::ConstBool(x) => Ok(self.b.bool(x)),
            _ => err("a string or sample is used where a number is needed"),
        }
    }

    fn expr(
        &mut self,
        locals: &[Local],
        env: &mut BTreeMap<LocalId, LVal>,
        e: &Expr,
    ) -> Result<LVal, LowerError> {
        Ok(match &e.kind {
            ExprKind::Lit(Value::Int(i)) => LVal::V(self.b.int(*i)),
            ExprKind::Lit(Value::Float(f)) => LVal::V(self.b.float(*f)),
            ExprKind::Lit(Value::Bool(x)) => LVal::V(self.b.bool(*x)),
            ExprKind::Lit(Value::Str(s)) => LVal::Const(s.clone()),
            ExprKind::Ref(Def::Local(l)) => match env.get(l) {
                Some(v) => v.clone(),
                None => {
                    return err(format!(
                        "`{}` has no value here",
                        locals.get(l.0 as usize).map_or("?", |x| x.name.as_str())
                    ));
                }
            },
            ExprKind::Ref(_) => return err("functions and models are not values in a kernel"),
            ExprKind::Field { base, field } => {
                let LVal::Sample(sp) = self.expr(locals, env, base)? else {
                    return err("a field of something that is not a sample");
                };
                match field {
                    SampleField::Prompt => LVal::SampleStr(sp, StrField::Prompt),
                    SampleField::Completion => LVal::SampleStr(sp, StrField::Completion),
                    SampleField::Answer => LVal::SampleStr(sp, StrField::Answer),
                    SampleField::Length => LVal::V(self.b.sample_int(sp, k::IntField::Length)),
                    SampleField::Group => LVal::V(self.b.sample_int(sp, k::IntField::Group)),
                    SampleField::Tokens => {
                        return err(
                            "`.tokens` is not available in kernels; pass token values as a PerToken parameter",
                        );
                    }
                }
            }
            ExprKind::Index { base, index } => {
                let t = self.value(locals, env, base)?;
                let i = self.value(locals, env, index)?;
                LVal::V(self.b.index(t, i))
            }
            ExprKind::Unary { op, operand } => {
                let x = self.value(locals, env, operand)?;
                LVal::V(match op {
                    UnaryOp::Neg => self.b.neg(x),
                    UnaryOp::Not => self.b.not(x),
                })
            }
            ExprKind::Binary { op, lhs, rhs } => self.binary(locals, env, *op, lhs, rhs)?,
            ExprKind::If { cond, then, else_ } => {
                let c = self.expr(locals, env, cond)?;
                // A condition known at compile time (a specialised string comparison) selects
                // one branch.
                if let LVal::ConstBool(taken) = c {
                    let mut inner = env.clone();
                    return if taken {
                        self.body(locals, &mut inner, then)
                    } else {
                        self.expr(locals, &mut inner, else_)
                    };
                }
                if let LVal::V(c) = c {
                    let mut h = self.b.begin_if(c);
                    let mut then_env = env.clone();
                    let t = self.body(locals, &mut then_env, then)?;
                    let LVal::V(t) = t else {
                        return err("an `if` branch yields a string");
                    };
                    self.b.begin_else(&mut h, t);
                    let mut else_env = env.clone();
                    let e2 = self.expr(locals, &mut else_env, else_)?;
                    let LVal::V(e2) = e2 else {
                        return err("an `if` branch yields a string");
                    };
                    LVal::V(self.b.end_if(h, e2))
                } else {
                    return err("an `if` condition is not a bool value");
                }
            }
            ExprKind::Block(body) => {
                let mut inner = env.clone();
                self.body(locals, &mut inner, body)?
            }
            ExprKind::Scan(s) => {
                let init = self.value(locals, env, &s.init)?;
                let (h, t, acc) = self.b.begin_scan(s.reverse, init);
                let mut inner = env.clone();
                inner.insert(s.var, LVal::V(t));
                inner.insert(s.acc, LVal::V(acc));
                for (l, e) in &s.lets {
                    let v = self.expr(locals, &mut inner, e)?;
                    inner.insert(*l, v);
                }
                let next = self.value(locals, &mut inner, &s.value)?;
                LVal::V(self.b.end_scan(h, next))
            }
            ExprKind::Call { callee, args, .. } => self.call(locals, env, callee, args)?,
            ExprKind::ModelOutput { .. } => {
                return err("a model's outputs are read only in a loss, not in a kernel");
            }
            ExprKind::Error => return err("the function has errors"),
        })
    }

    fn binary(
        &mut self,
        locals: &[Local],
        env: &mut BTreeMap<LocalId, LVal>,
        op: BinaryOp,
        lhs: &Expr,
        rhs: &Expr,
    ) -> Result<LVal, LowerError> {
        use BinaryOp as B;
        if matches!(op, B::And | B::Or) {
            // The builder's closure forms cannot propagate lowering errors, so short-circuits
            // are built from `begin_if`/`end_if` here.
            let a = self.value(locals, env, lhs)?;
            return self.short_circuit(locals, env, op, a, rhs);
        }
        let l = self.expr(locals, env, lhs)?;
        let r = self.expr(locals, env, rhs)?;
        if let (LVal::Const(a), LVal::Const(c)) = (&l, &r) {
            return match op {
                B::Eq => Ok(LVal::ConstBool(a == c)),
                B::Ne => Ok(LVal::ConstBool(a != c)),
                _ => err("strings are only compared with `==` and `!=`"),
            };
        }
        // A sample's text compared with a constant or with another of its texts: a host call.
        let text_eq = match (&l, &r) {
            (LVal::SampleStr(sp, f), LVal::Const(c)) | (LVal::Const(c), LVal::SampleStr(sp, f)) => {
                Some(self.b.str_equals(*sp, f.clone(), c))
            }
            (LVal::SampleStr(sa, fa), LVal::SampleStr(sb, fb)) if sa == sb => {
                Some(self.b.texts_equal(*sa, fa.clone(), fb.clone()))
            }
            _ => None,
        };
        if let Some(eq) = text_eq {
            return match op {
                B::Eq => Ok(LVal::V(eq)),
                B::Ne => Ok(LVal::V(self.b.not(eq))),
                _ => err("strings are only compared with `==` and `!=`"),
            };
        }
        let (LVal::V(a), LVal::V(c)) = (l, r) else {
            return err(
                "a sample's text can only be tested with built-ins such as `contains` or `matches`, or compared with `==`",
            );
        };
        let bop = match op {
            B::Add => BinOp::Add,
            B::Sub => BinOp::Sub,
            B::Mul => BinOp::Mul,
            B::Div => BinOp::Div,
            B::Rem => BinOp::Rem,
            B::Eq => BinOp::Eq,
            B::Ne => BinOp::Ne,
            B::Lt => BinOp::Lt,
            B::Le => BinOp::Le,
            B::Gt => BinOp::Gt,
            B::Ge => BinOp::Ge,
            B::And | B::Or => return err("unreachable: handled above"),
        };
        Ok(LVal::V(
            if matches!(op, B::Eq | B::Ne | B::Lt | B::Le | B::Gt | B::Ge) {
                self.b.cmp(bop, a, c)
            } else {
                self.b.binary(bop, a, c)
            },
        ))
    }

    /// `a && b` is `if a { b } else { false }`; `a || b` is `if a { true } else { b }`.
    fn short_circuit(
        &mut self,
        locals: &[Local],
        env: &mut BTreeMap<LocalId, LVal>,
        op: BinaryOp,
        a: k::Value,
        rhs: &Expr,
    ) -> Result<LVal, LowerError> {
        let mut h = self.b.begin_if(a);
        if op == BinaryOp::And {
            let mut inner = env.clone();
            let bval = self.value(locals, &mut inner, rhs)?;
            self.b.begin_else(&mut h, bval);
            let f = self.b.bool(false);
            Ok(LVal::V(self.b.end_if(h, f)))
        } else {
            let t = self.b.bool(true);
            self.b.begin_else(&mut h, t);
            let mut inner = env.clone();
            let bval = self.value(locals, &mut inner, rhs)?;
            Ok(LVal::V(self.b.end_if(h, bval)))
        }
    }

    fn call(
        &mut self,
        locals: &[Local],
        env: &mut BTreeMap<LocalId, LVal>,
        callee: &Callee,
        args: &[Expr],
    ) -> Result<LVal, LowerError> {
        match callee {
            Callee::Fn(f) => self.inline(locals, env, *f, args),
            Callee::Builtin(name) => self.builtin(locals, env, name, args),
            Callee::Model(op) => err(format!(
                "`{}` is a model call, not kernel code",
                op.as_str()
            )),
            Callee::FnValue(_) => err("a function parameter cannot be called inside a kernel"),
        }
    }

    fn inline(
        &mut self,
        locals: &[Local],
        env: &mut BTreeMap<LocalId, LVal>,
        f: FnId,
        args: &[Expr],
    ) -> Result<LVal, LowerError> {
        let program = self.program;
        let func = program
            .fns
            .get(f.0 as usize)
            .ok_or_else(|| LowerError(format!("no function #{}", f.0)))?;
        let mut callee_env: BTreeMap<LocalId, LVal> = BTreeMap::new();
        for (i, a) in args.iter().enumerate() {
            let v = self.expr(locals, env, a)?;
            let local = func
                .locals
                .iter()
                .position(|l| l.kind == LocalKind::Param(i as u32))
                .ok_or_else(|| {
                    LowerError(format!("`{}`: parameter #{i} has no local", func.name))
                })?;
            callee_env.insert(LocalId(local as u32), v);
        }
        let saved = self.scope;
        self.scope = func.scope;
        let r = self.body(&func.locals, &mut callee_env, &func.body);
        self.scope = saved;
        r
    }

    fn builtin(
        &mut self,
        locals: &[Local],
        env: &mut BTreeMap<LocalId, LVal>,
        name: &str,
        args: &[Expr],
    ) -> Result<LVal, LowerError> {
        let mut vals = Vec::new();
        for a in args {
            vals.push(self.expr(locals, env, a)?);
        }
        let num = |i: usize| -> Result<k::Value, LowerError> {
            match vals.get(i) {
                Some(LVal::V(v)) => Ok(*v),
                _ => err(format!("argument {} of `{name}` is not a number", i + 1)),
            }
        };
        let text = |i: usize| -> Result<(SampleParam, StrField), LowerError> {
            match vals.get(i) {
                Some(LVal::SampleStr(s, f)) => Ok((*s, f.clone())),
                _ => err(format!(
                    "argument {} of `{name}` must be a sample's text (`s.completion`, `s.prompt`, `s.answer` or `field(s, \"…\")`)",
                    i + 1
                )),
            }
        };
        let lit = |i: usize| -> Result<String, LowerError> {
            match vals.get(i) {
                Some(LVal::Const(s)) => Ok(s.clone()),
                _ => err(format!(
                    "argument {} of `{name}` must be a constant string",
                    i + 1
                )),
            }
        };
        let sample = |i: usize| -> Result<SampleParam, LowerError> {
            match vals.get(i) {
                Some(LVal::Sample(s)) => Ok(*s),
                _ => err(format!("argument {} of `{name}` must be a sample", i + 1)),
            }
        };
        let v = match name {
            // A string field is not a kernel value: like `s.completion`, it is an operand of
            // the host calls that test it.
            "field" => return Ok(LVal::SampleStr(sample(0)?, StrField::Record(lit(1)?))),
            "field_int" => self.b.record_field(sample(0)?, &lit(1)?, ScalarTy::Int),
            "field_float" => self.b.record_field(sample(0)?, &lit(1)?, ScalarTy::Float),
            "field_bool" => self.b.record_field(sample(0)?, &lit(1)?, ScalarTy::Bool),
            "exp" => self.b.exp(num(0)?),
            "log" => self.b.log(num(0)?),
            "sqrt" => self.b.sqrt(num(0)?),
            "abs" => self.b.abs(num(0)?),
            "float" => self.b.to_float(num(0)?),
            "clamp" => {
                let (x, lo, hi) = (num(0)?, num(1)?, num(2)?);
                self.b.clamp(x, lo, hi)
            }
            "min" | "max" if vals.len() == 2 => {
                let (a, c) = (num(0)?, num(1)?);
                if name == "min" {
                    self.b.min(a, c)
                } else {
                    self.b.max(a, c)
                }
            }
            "min" | "max" | "sum" | "mean" | "std" => {
                let op = match name {
                    "min" => ReduceOp::Min,
                    "max" => ReduceOp::Max,
                    "sum" => ReduceOp::Sum,
                    "mean" => ReduceOp::Mean,
                    _ => ReduceOp::Std,
                };
                self.reduce(op, num(0)?)?
            }
            "count" if vals.len() == 1 => self.reduce(ReduceOp::Count, num(0)?)?,
            "count" => {
                let (s, f) = text(0)?;
                let pattern = lit(1)?;
                self.b.count_regex(s, f, &pattern)
            }
            "len" => match vals.first() {
                Some(LVal::SampleStr(s, f)) => self.b.str_len(*s, f.clone()),
                Some(LVal::Const(c)) => self.b.int(c.chars().count() as i64),
                Some(LVal::V(x)) => {
                    let tokens = self.b.ty(*x) == Some(k::Ty::Tokens);
                    match (self.scope, tokens) {
                        (Scope::Sample, true) => self.b.len(),
                        (Scope::Sample, false) => self.b.int(1),
                        // The number of elements a reduction of `x` covers in the scope: all
                        // tokens of its samples, or its samples.
                        (_, true) => {
                            let n = self.b.len();
                            let n = self.b.to_float(n);
                            self.b.scope_reduce(ReduceOp::Sum, n)
                        }
                        (_, false) => {
                            let one = self.b.float(1.0);
                            self.b.scope_reduce(ReduceOp::Sum, one)
                        }
                    }
                }
                _ => return err("`len` of a sample"),
            },
            "matches" => {
                let (s, f) = text(0)?;
                let pattern = lit(1)?;
                self.b.matches_regex(s, f, &pattern)
            }
            "contains" | "starts_with" | "ends_with" => {
                let (s, f) = text(0)?;
                let part = lit(1)?;
                match name {
                    "contains" => self.b.contains(s, f, &part),
                    "starts_with" => self.b.starts_with(s, f, &part),
                    _ => self.b.ends_with(s, f, &part),
                }
            }
            "answer_matches" => {
                let (s, f) = text(0)?;
                let (s2, g) = text(1)?;
                if s2 != s {
                    return err("`answer_matches` compares two texts of the same sample");
                }
                self.b.answer_matches(s, f, g)
            }
            other => return err(format!("`{other}` cannot be used in a kernel")),
        };
        Ok(LVal::V(v))
    }

    /// A reduction: over the sample's tokens in a per-sample function (a per-sample number is
    /// its own reduction), over the group or batch in `over` functions.
    fn reduce(&mut self, op: ReduceOp, x: k::Value) -> Result<k::Value, LowerError> {
        if self.scope != Scope::Sample {
            return Ok(self.b.scope_reduce(op, x));
        }
        match self.b.ty(x) {
            Some(k::Ty::Tokens) => Ok(self.b.reduce(op, x)),
            Some(_) => Ok(match op {
                ReduceOp::Std => self.b.float(0.0),
                ReduceOp::Count => {
                    let zero = self.b.float(0.0);
                    let xf = self.b.to_float(x);
                    let ne = self.b.cmp(BinOp::Ne, xf, zero);
                    let one = self.b.int(1);
                    let none = self.b.int(0);
                    let mut h = self.b.begin_if(ne);
                    self.b.begin_else(&mut h, one);
                    self.b.end_if(h, none)
                }
                _ => self.b.to_float(x),
            }),
            None => err("a reduction of an unknown value"),
        }
    }
}
