//! The reference interpreter: the executable definition of the kernel IR's semantics, and the
//! oracle the JIT is tested against.
//!
//! It evaluates one instruction at a time, materialising every per-token value, and uses the
//! shared helpers of [`super::fsem`] and [`super::exec::reduce`] for every operation whose
//! result a backend could get subtly different. It must stay simple enough to be obviously
//! right; speed is not its job.

use super::exec::{self, Arg, Batch, KernelExec, Output, RunError, SampleCtx, SampleEval};
use super::host::HostFns;
use super::verify::{self, VerifyError};
use super::{BinOp, BlockId, IntField, Kernel, Op, ParamKind, Ty, UnOp, Value, fsem};
use std::rc::Rc;

/// A verified kernel ready to interpret (its regexes compiled once).
#[derive(Debug)]
pub struct Interpreter {
    kernel: Kernel,
    host: HostFns,
    level: Vec<u32>,
    /// For each value: its position among the scope reductions, if it is one.
    reduction_slot: Vec<Option<usize>>,
}

impl Interpreter {
    /// Verifies the kernel and prepares it.
    pub fn new(kernel: Kernel) -> Result<Interpreter, VerifyError> {
        verify::verify(&kernel)?;
        let host = HostFns::compile(&kernel.host_calls).map_err(|e| VerifyError {
            kernel: kernel.name.clone(),
            message: e.to_string(),
        })?;
        let level = verify::scope_levels(&kernel);
        let mut reduction_slot = vec![None; kernel.insts.len()];
        for (r, v) in kernel.scope_reductions().into_iter().enumerate() {
            reduction_slot[v.index()] = Some(r);
        }
        Ok(Interpreter {
            kernel,
            host,
            level,
            reduction_slot,
        })
    }
}

impl KernelExec for Interpreter {
    fn kernel(&self) -> &Kernel {
        &self.kernel
    }

    fn run(&self, batch: &Batch<'_>, args: &[Arg<'_>]) -> Result<Output, RunError> {
        let mut ev = Eval {
            it: self,
            env: vec![V::Unset; self.kernel.insts.len()],
        };
        exec::run_kernel(&self.kernel, batch, args, &mut ev)
    }
}

/// A runtime value.
#[derive(Clone, Debug)]
enum V {
    Unset,
    I(i64),
    F(f64),
    B(bool),
    T(Rc<[f64]>),
}

impl V {
    fn f(&self) -> f64 {
        match self {
            V::F(x) => *x,
            V::I(i) => *i as f64,
            V::B(b) => f64::from(u8::from(*b)),
            _ => 0.0,
        }
    }
    fn i(&self) -> i64 {
        match self {
            V::I(i) => *i,
            _ => 0,
        }
    }
    fn b(&self) -> bool {
        matches!(self, V::B(true))
    }
}

struct Eval<'a> {
    it: &'a Interpreter,
    env: Vec<V>,
}

/// What the current evaluation is for.
#[derive(Clone, Copy)]
struct Mode<'s> {
    /// In pre-pass `L`, values of scope level `L` or more are skipped.
    prepass: Option<u32>,
    scope_vals: &'s [f64],
}

impl SampleEval for Eval<'_> {
    fn prepass(
        &mut self,
        level: u32,
        s: &SampleCtx<'_>,
        scope_vals: &[f64],
        outs: &mut [&mut [f64]],
    ) -> Result<(), RunError> {
        let k = &self.it.kernel;
        self.block(
            k.entry,
            s,
            Mode {
                prepass: Some(level),
                scope_vals,
            },
        );
        for (r, v) in k.scope_reductions().into_iter().enumerate() {
            let Op::ScopeReduce(_, arg) = k.insts[v.index()].op else {
                continue;
            };
            let (Some(out), Some(val)) = (outs.get_mut(r), self.env.get(arg.index())) else {
                continue;
            };
            match val {
                V::T(t) => {
                    let n = out.len().min(t.len());
                    out[..n].copy_from_slice(&t[..n]);
                }
                other => {
                    if let Some(o) = out.first_mut() {
                        *o = other.f();
                    }
                }
            }
        }
        Ok(())
    }

    fn eval(
        &mut self,
        s: &SampleCtx<'_>,
        scope_vals: &[f64],
        out: &mut [f64],
    ) -> Result<(), RunError> {
        let r = self.block(
            self.it.kernel.entry,
            s,
            Mode {
                prepass: None,
                scope_vals,
            },
        );
        match r {
            V::T(t) => {
                let n = out.len().min(t.len());
                out[..n].copy_from_slice(&t[..n]);
            }
            other => {
                if let Some(o) = out.first_mut() {
                    *o = other.f();
                }
            }
        }
        Ok(())
    }
}

fn elementwise(a: &V, b: &V, f: impl Fn(f64, f64) -> f64) -> V {
    match (a, b) {
        (V::T(x), V::T(y)) => V::T(x.iter().zip(y.iter()).map(|(x, y)| f(*x, *y)).collect()),
        (V::T(x), y) => {
            let y = y.f();
            V::T(x.iter().map(|x| f(*x, y)).collect())
        }
        (x, V::T(y)) => {
            let x = x.f();
            V::T(y.iter().map(|y| f(x, *y)).collect())
        }
        (x, y) => V::F(f(x.f(), y.f())),
    }
}

fn map(a: &V, f: impl Fn(f64) -> f64) -> V {
    match a {
        V::T(x) => V::T(x.iter().map(|x| f(*x)).collect()),
        x => V::F(f(x.f())),
    }
}

impl Eval<'_> {
    fn get(&self, v: Value) -> &V {
        self.env.get(v.index()).unwrap_or(&V::Unset)
    }

    fn block(&mut self, id: BlockId, s: &SampleCtx<'_>, mode: Mode<'_>) -> V {
        let k = &self.it.kernel;
        let Some(block) = k.block(id) else {
            return V::Unset;
        };
        for &x in &block.insts {
            if mode.prepass.is_some_and(|l| self.it.level[x.index()] >= l) {
                continue;
            }
            let v = self.inst(x, s, mode);
            self.env[x.index()] = v;
        }
        block.result.map_or(V::Unset, |r| self.get(r).clone())
    }

    fn inst(&mut self, x: Value, s: &SampleCtx<'_>, mode: Mode<'_>) -> V {
        let k = &self.it.kernel;
        let inst = &k.insts[x.index()];
        match &inst.op {
            Op::ConstInt(i) => V::I(*i),
            Op::ConstFloat(bits) => V::F(f64::from_bits(*bits)),
            Op::ConstBool(b) => V::B(*b),
            Op::Param(n) => {
                let n = *n as usize;
                match k.params.get(n) {
                    Some(ParamKind::PerToken) => {
                        V::T(Rc::from(s.tokens.get(n).copied().unwrap_or(&[])))
                    }
                    _ => {
                        let bits = s.scalar_bits(n);
                        match inst.ty {
                            Ty::Int => V::I(bits as i64),
                            Ty::Bool => V::B(bits != 0),
                            _ => V::F(f64::from_bits(bits)),
                        }
                    }
                }
            }
            Op::SampleInt { field, .. } => match field {
                IntField::Length => V::I(s.len as i64),
                IntField::Group => V::I(s.group),
            },
            Op::Len => V::I(s.len as i64),
            Op::Unary(op, a) => {
                let a = self.get(*a);
                match (op, a) {
                    (UnOp::Neg, V::I(i)) => V::I(i.wrapping_neg()),
                    (UnOp::Neg, a) => map(a, |x| -x),
                    (UnOp::Abs, V::I(i)) => V::I(i.wrapping_abs()),
                    (UnOp::Abs, a) => map(a, f64::abs),
                    (UnOp::Not, a) => V::B(!a.b()),
                    (UnOp::Exp, a) => map(a, |x| fsem::exp(x)),
                    (UnOp::Log, a) => map(a, |x| fsem::log(x)),
                    (UnOp::Sqrt, a) => map(a, f64::sqrt),
                    (UnOp::IntToFloat, a) => V::F(a.i() as f64),
                }
            }
            Op::Binary(op, a, b) => {
                let (a, b) = (self.get(*a), self.get(*b));
                binary(*op, a, b)
            }
            Op::Index { tokens, index } => {
                let i = self.get(*index).i();
                match self.get(*tokens) {
                    V::T(t) => V::F(
                        usize::try_from(i)
                            .ok()
                            .and_then(|i| t.get(i))
                            .copied()
                            .unwrap_or(0.0),
                    ),
                    _ => V::F(0.0),
                }
            }
            Op::Reduce(op, a) => {
                let t: &[f64] = match self.get(*a) {
                    V::T(t) => t,
                    _ => &[],
                };
                let r = exec::reduce(*op, || t.iter().copied());
                if inst.ty == Ty::Int {
                    V::I(r as i64)
                } else {
                    V::F(r)
                }
            }
            Op::ScopeReduce(..) => {
                let r = self.it.reduction_slot[x.index()]
                    .and_then(|r| mode.scope_vals.get(r))
                    .copied()
                    .unwrap_or(0.0);
                if inst.ty == Ty::Int {
                    V::I(r as i64)
                } else {
                    V::F(r)
                }
            }
            Op::If {
                cond,
                then_block,
                else_block,
            } => {
                let b = if self.get(*cond).b() {
                    *then_block
                } else {
                    *else_block
                };
                self.block(b, s, mode)
            }
            Op::Scan {
                reverse,
                init,
                body,
            } => {
                let (body, reverse) = (*body, *reverse);
                let mut acc = self.get(*init).f();
                let mut out = vec![0.0; s.len];
                let params = k.block(body).map(|b| b.params.clone()).unwrap_or_default();
                let (Some(pt), Some(pa)) = (params.first(), params.get(1)) else {
                    return V::Unset;
                };
                for step in 0..s.len {
                    let t = if reverse { s.len - 1 - step } else { step };
                    self.env[pt.index()] = V::I(t as i64);
                    self.env[pa.index()] = V::F(acc);
                    acc = self.block(body, s, mode).f();
                    out[t] = acc;
                }
                V::T(Rc::from(out))
            }
            Op::BlockParam { .. } => self.get(x).clone(),
            Op::Host(n) => {
                let r = s.text.map_or(0, |t| self.it.host.call(*n as usize, t));
                match inst.ty {
                    Ty::Bool => V::B(r != 0),
                    // A float crosses the host ABI as its bits.
                    Ty::Float => V::F(f64::from_bits(r as u64)),
                    _ => V::I(r),
                }
            }
        }
    }
}

fn binary(op: BinOp, a: &V, b: &V) -> V {
    if let (V::I(x), V::I(y)) = (a, b) {
        let (x, y) = (*x, *y);
        return match op {
            BinOp::Add => V::I(x.wrapping_add(y)),
            BinOp::Sub => V::I(x.wrapping_sub(y)),
            BinOp::Mul => V::I(x.wrapping_mul(y)),
            BinOp::Rem => V::I(fsem::irem(x, y)),
            BinOp::Min => V::I(x.min(y)),
            BinOp::Max => V::I(x.max(y)),
            BinOp::Div => V::F(x as f64 / y as f64),
            BinOp::Eq => V::B(x == y),
            BinOp::Ne => V::B(x != y),
            BinOp::Lt => V::B(x < y),
            BinOp::Le => V::B(x <= y),
            BinOp::Gt => V::B(x > y),
            BinOp::Ge => V::B(x >= y),
            BinOp::And | BinOp::Or => V::B(false),
        };
    }
    if let (V::B(x), V::B(y)) = (a, b) {
        let (x, y) = (*x, *y);
        return V::B(match op {
            BinOp::And => x && y,
            BinOp::Or => x || y,
            BinOp::Eq => x == y,
            BinOp::Ne => x != y,
            _ => false,
        });
    }
    match op {
        BinOp::Add => elementwise(a, b, |x, y| x + y),
        BinOp::Sub => elementwise(a, b, |x, y| x - y),
        BinOp::Mul => elementwise(a, b, |x, y| x * y),
        BinOp::Div => elementwise(a, b, |x, y| x / y),
        BinOp::Rem => elementwise(a, b, |x, y| fsem::fmod(x, y)),
        BinOp::Min => elementwise(a, b, fsem::min),
        BinOp::Max => elementwise(a, b, fsem::max),
        BinOp::Eq => V::B(a.f() == b.f()),
        BinOp::Ne => V::B(a.f() != b.f()),
        BinOp::Lt => V::B(a.f() < b.f()),
        BinOp::Le => V::B(a.f() <= b.f()),
        BinOp::Gt => V::B(a.f() > b.f()),
        BinOp::Ge => V::B(a.f() >= b.f()),
        BinOp::And | BinOp::Or => V::B(false),
    }
}
