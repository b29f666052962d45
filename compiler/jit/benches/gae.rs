//! GAE (and the elementwise KL k3) over 512 samples × 1,024 tokens by the JIT and by the
//! interpreter, and compile latency per kernel. Run: `cargo bench -p braid-jit --bench gae`. Results: `docs/benchmarks.md`.

use braid_ir::kernel::{
    Arg, Batch, Interpreter, Kernel, KernelBuilder, KernelExec, ParamKind, Ragged, ReduceOp,
    ScalarTy, Scope,
};
use braid_jit::Jit;
use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;

const SAMPLES: usize = 512;
const TOKENS: usize = 1024;

fn gae() -> Kernel {
    let mut b = KernelBuilder::new("gae", Scope::Sample);
    let r = b.param(ParamKind::PerToken);
    let v = b.param(ParamKind::PerToken);
    let gamma = b.param(ParamKind::Scalar(ScalarTy::Float));
    let lambda = b.param(ParamKind::Scalar(ScalarTy::Float));
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

fn kl_k3() -> Kernel {
    let mut b = KernelBuilder::new("kl_k3", Scope::Sample);
    let logp = b.param(ParamKind::PerToken);
    let refp = b.param(ParamKind::PerToken);
    let d = b.sub(refp, logp);
    let e = b.exp(d);
    let x = b.sub(e, d);
    let one = b.float(1.0);
    let r = b.sub(x, one);
    b.finish(r).expect("builds")
}

fn whiten() -> Kernel {
    let mut b = KernelBuilder::new("whiten", Scope::Batch);
    let a = b.param(ParamKind::PerToken);
    let eps = b.param(ParamKind::Scalar(ScalarTy::Float));
    let m = b.scope_reduce(ReduceOp::Mean, a);
    let s = b.scope_reduce(ReduceOp::Std, a);
    let d = b.sub(a, m);
    let den = b.add(s, eps);
    let r = b.div(d, den);
    b.finish(r).expect("builds")
}

fn bench(c: &mut Criterion) {
    let n = SAMPLES * TOKENS;
    // A deterministic pseudo-random fill; the values do not matter to the timing.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 11) as f64 / (1u64 << 53) as f64
    };
    let r: Vec<f64> = (0..n).map(|_| next()).collect();
    let v: Vec<f64> = (0..n).map(|_| next()).collect();
    let offsets: Vec<usize> = (0..=SAMPLES).map(|i| i * TOKENS).collect();
    let args = [
        Arg::PerToken(Ragged {
            values: &r,
            offsets: &offsets,
        }),
        Arg::PerToken(Ragged {
            values: &v,
            offsets: &offsets,
        }),
        Arg::Float(1.0),
        Arg::Float(0.95),
    ];
    let batch = Batch {
        n_samples: SAMPLES,
        ..Default::default()
    };
    let jit = Jit::new().expect("host ISA");
    let compiled = jit.compile(&gae()).expect("compiles");
    let interp = Interpreter::new(gae()).expect("verifies");
    assert_eq!(
        compiled.run(&batch, &args).expect("runs").values().len(),
        interp.run(&batch, &args).expect("runs").values().len()
    );

    let mut g = c.benchmark_group("gae_512x1024");
    g.sample_size(10);
    g.bench_function("jit", |b| {
        b.iter(|| black_box(compiled.run(&batch, black_box(&args))))
    });
    g.bench_function("interpreter", |b| {
        b.iter(|| black_box(interp.run(&batch, black_box(&args))))
    });
    g.finish();

    // An elementwise kernel (fusion, `exp` through the host ABI) on the same data.
    let kl = jit.compile(&kl_k3()).expect("compiles");
    let kl_interp = Interpreter::new(kl_k3()).expect("verifies");
    let kl_args = &args[..2];
    let mut g = c.benchmark_group("kl_k3_512x1024");
    g.sample_size(10);
    g.bench_function("jit", |b| {
        b.iter(|| black_box(kl.run(&batch, black_box(kl_args))))
    });
    g.bench_function("interpreter", |b| {
        b.iter(|| black_box(kl_interp.run(&batch, black_box(kl_args))))
    });
    g.finish();

    let mut g = c.benchmark_group("compile");
    for k in [gae(), kl_k3(), whiten()] {
        g.bench_function(k.name.clone(), |b| {
            b.iter(|| black_box(jit.compile_uncached(black_box(&k))))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
