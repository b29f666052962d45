//! Shared by the JIT's test files: kernels of the standard library built with the builder, and
//! a runner that runs a kernel on both backends and insists they agree bit for bit.
#![allow(dead_code)]

use braid_ir::kernel::{
    Arg, Batch, BinOp, Interpreter, Kernel, KernelBuilder, KernelExec, Output, ParamKind, ReduceOp,
    RunError, ScalarTy, Scope,
};
use braid_jit::Jit;
use std::sync::OnceLock;

pub fn jit() -> &'static Jit {
    static JIT: OnceLock<Jit> = OnceLock::new();
    JIT.get_or_init(|| Jit::new().expect("host ISA"))
}

/// Equal bits, or both NaN (NaN payloads may legitimately differ: commutative operations may
/// have their operands swapped by either compiler).
pub fn same(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

pub fn same_output(a: &Output, b: &Output) -> bool {
    match (a, b) {
        (Output::PerSample(x), Output::PerSample(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(*a, *b))
        }
        (
            Output::PerToken {
                values: x,
                offsets: ox,
            },
            Output::PerToken {
                values: y,
                offsets: oy,
            },
        ) => ox == oy && x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(*a, *b)),
        _ => false,
    }
}

/// Runs on the interpreter and the JIT; panics unless both give the same result (or error).
pub fn run_both(k: &Kernel, batch: &Batch<'_>, args: &[Arg<'_>]) -> Result<Output, RunError> {
    let interp = Interpreter::new(k.clone()).expect("verified");
    let compiled = jit().compile(k).expect("compiles");
    let a = interp.run(batch, args);
    let b = compiled.run(batch, args);
    match (&a, &b) {
        (Ok(x), Ok(y)) => assert!(
            same_output(x, y),
            "interpreter {x:?}\njit {y:?}\nkernel:\n{k}"
        ),
        (Err(x), Err(y)) => assert_eq!(x, y),
        _ => panic!("interpreter {a:?}, jit {b:?}\nkernel:\n{k}"),
    }
    a
}

fn float_param(b: &mut KernelBuilder) -> braid_ir::kernel::Value {
    b.param(ParamKind::Scalar(ScalarTy::Float))
}

/// `fn gae(r, v, gamma, lambda) -> PerToken { scan reverse t with acc = 0.0 { … } }`
pub fn gae() -> Kernel {
    let mut b = KernelBuilder::new("gae", Scope::Sample);
    let r = b.param(ParamKind::PerToken);
    let v = b.param(ParamKind::PerToken);
    let gamma = float_param(&mut b);
    let lambda = float_param(&mut b);
    let zero = b.float(0.0);
    let adv = b.scan(true, zero, |b, t, acc| {
        let rt = b.index(r, t);
        let one = b.int(1);
        let t1 = b.add(t, one);
        let vn = b.index(v, t1);
        let gv = b.mul(gamma, vn);
        let s = b.add(rt, gv);
        let vt = b.index(v, t);
        let delta = b.sub(s, vt);
        let gl = b.mul(gamma, lambda);
        let gla = b.mul(gl, acc);
        b.add(delta, gla)
    });
    b.finish(adv).expect("gae builds")
}

/// `scan reverse t with acc = 0.0 { acc = r[t] + gamma * acc }`
pub fn discounted_returns() -> Kernel {
    let mut b = KernelBuilder::new("discounted_returns", Scope::Sample);
    let r = b.param(ParamKind::PerToken);
    let gamma = float_param(&mut b);
    let zero = b.float(0.0);
    let ret = b.scan(true, zero, |b, t, acc| {
        let rt = b.index(r, t);
        let ga = b.mul(gamma, acc);
        b.add(rt, ga)
    });
    b.finish(ret).expect("builds")
}

/// `(r - mean(r)) / (std(r) + eps)` over group (per-sample) or `whiten` over batch (per-token).
pub fn normalize(scope: Scope, per_token: bool) -> Kernel {
    let mut b = KernelBuilder::new(
        if per_token {
            "whiten"
        } else {
            "group_normalize"
        },
        scope,
    );
    let x = b.param(if per_token {
        ParamKind::PerToken
    } else {
        ParamKind::PerSample
    });
    let eps = float_param(&mut b);
    let m = b.scope_reduce(ReduceOp::Mean, x);
    let s = b.scope_reduce(ReduceOp::Std, x);
    let d = b.sub(x, m);
    let den = b.add(s, eps);
    let r = b.div(d, den);
    b.finish(r).expect("builds")
}

/// The KL estimators: k1 = logp - ref, k2 = 0.5 * d * d, k3 = exp(ref - logp) - (ref - logp) - 1.
pub fn kl(which: u8) -> Kernel {
    let mut b = KernelBuilder::new(format!("kl_k{which}"), Scope::Sample);
    let logp = b.param(ParamKind::PerToken);
    let refp = b.param(ParamKind::PerToken);
    let r = match which {
        1 => b.sub(logp, refp),
        2 => {
            let d = b.sub(logp, refp);
            let half = b.float(0.5);
            let hd = b.mul(half, d);
            b.mul(hd, d)
        }
        _ => {
            let d = b.sub(refp, logp);
            let e = b.exp(d);
            let x = b.sub(e, d);
            let one = b.float(1.0);
            b.sub(x, one)
        }
    };
    b.finish(r).expect("builds")
}

pub fn cmp_op(
    b: &mut KernelBuilder,
    op: BinOp,
    x: braid_ir::kernel::Value,
    y: braid_ir::kernel::Value,
) -> braid_ir::kernel::Value {
    b.cmp(op, x, y)
}
