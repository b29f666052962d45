//! GAE over 512 samples × 1,024 tokens, in one run: the standard library's `gae` (written in the
//! language) lowered to a kernel and run by the Cranelift JIT and by the reference interpreter,
//! and a libtorch loop over time steps on [512, 1024] tensors (one thread). Prints the median and
//! p90 of each, and the ratios.
//!
//! `cargo run --release -p braid-runtime --example bench_gae [RUNS]`

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Instant;

use braid_ir::kernel::{Arg, Batch, Interpreter, KernelExec, Output, Ragged};
use tch::{Device, Kind, Tensor};

const SAMPLES: usize = 512;
const TOKENS: usize = 1024;
const GAMMA: f64 = 1.0;
const LAMBDA: f64 = 0.95;

fn median_p90(mut xs: Vec<f64>) -> (f64, f64) {
    xs.sort_by(f64::total_cmp);
    (xs[xs.len() / 2], xs[(xs.len() * 9 / 10).min(xs.len() - 1)])
}

fn time<T>(runs: usize, mut f: impl FnMut() -> T) -> (f64, f64, T) {
    let mut times = Vec::new();
    let mut last = None;
    for _ in 0..runs {
        let start = Instant::now();
        let out = f();
        times.push(start.elapsed().as_secs_f64() * 1e3);
        last = Some(out);
    }
    let (m, p) = median_p90(times);
    (m, p, last.expect("at least one run"))
}

/// GAE with tensor ops, one time step at a time from the end: what a PyTorch implementation
/// (TRL, OpenRLHF) does.
fn gae_torch(r: &Tensor, v: &Tensor) -> Tensor {
    let zeros = Tensor::zeros([SAMPLES as i64], (Kind::Double, Device::Cpu));
    let mut acc = zeros.shallow_clone();
    let mut cols = Vec::with_capacity(TOKENS);
    for t in (0..TOKENS as i64).rev() {
        let next_v = if t + 1 < TOKENS as i64 {
            v.select(1, t + 1)
        } else {
            zeros.shallow_clone()
        };
        let delta = r.select(1, t) + next_v * GAMMA - v.select(1, t);
        acc = delta + &acc * (GAMMA * LAMBDA);
        cols.push(acc.shallow_clone());
    }
    cols.reverse();
    Tensor::stack(&cols, 1)
}

fn main() {
    let runs: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(15);
    tch::set_num_threads(1);
    let checked = braid_sema::check(
        "bench.rlhf",
        "use std::advantages\n",
        &braid_sema::NoImports,
    );
    let fid = checked
        .program
        .fns
        .iter()
        .position(|f| f.name == "gae")
        .expect("std::advantages has gae");
    let lowered = braid_sema::lower_kernel::lower_fn(
        &checked.program,
        braid_sema::hir::FnId(fid as u32),
        &BTreeMap::new(),
    )
    .expect("gae lowers");

    // Deterministic inputs.
    let n = SAMPLES * TOKENS;
    let r: Vec<f64> = (0..n)
        .map(|i| ((i * 7919) % 1000) as f64 / 1000.0 - 0.5)
        .collect();
    let v: Vec<f64> = (0..n)
        .map(|i| ((i * 104_729) % 997) as f64 / 997.0)
        .collect();
    let offsets: Vec<usize> = (0..=SAMPLES).map(|i| i * TOKENS).collect();
    let batch = Batch {
        n_samples: SAMPLES,
        lengths: None,
        groups: None,
        texts: None,
    };
    let args = [
        Arg::PerToken(Ragged {
            values: &r,
            offsets: &offsets,
        }),
        Arg::PerToken(Ragged {
            values: &v,
            offsets: &offsets,
        }),
        Arg::Float(GAMMA),
        Arg::Float(LAMBDA),
    ];

    let jit = braid_jit::Jit::new().expect("JIT");
    let compiled = jit.compile(&lowered.kernel).expect("compiles");
    let interp = Interpreter::new(lowered.kernel.clone()).expect("verifies");
    let rt = Tensor::from_slice(&r).reshape([SAMPLES as i64, TOKENS as i64]);
    let vt = Tensor::from_slice(&v).reshape([SAMPLES as i64, TOKENS as i64]);

    let (jm, jp, jout) = time(runs, || compiled.run(&batch, &args).expect("runs"));
    let (im, ip, iout) = time(runs.min(5), || interp.run(&batch, &args).expect("runs"));
    let (tm, tp, tout) = time(runs, || tch::no_grad(|| gae_torch(&rt, &vt)));

    // All three compute the same numbers (the JIT and the interpreter bit for bit).
    let Output::PerToken { values: jv, .. } = jout else {
        panic!("per-token output")
    };
    let Output::PerToken { values: iv, .. } = iout else {
        panic!("per-token output")
    };
    assert!(
        jv.iter().zip(&iv).all(|(a, b)| a.to_bits() == b.to_bits()),
        "JIT and interpreter differ"
    );
    let tv: Vec<f64> = Vec::try_from(tout.reshape([-1])).expect("f64 tensor");
    let max_diff = jv
        .iter()
        .zip(&tv)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(max_diff < 1e-9, "libtorch loop differs by {max_diff}");

    println!(
        "GAE, {SAMPLES} samples x {TOKENS} tokens (median / p90 of {runs} runs; interpreter {} runs)",
        runs.min(5)
    );
    println!("  JIT            {jm:9.2} ms / {jp:9.2} ms");
    println!("  interpreter    {im:9.2} ms / {ip:9.2} ms");
    println!("  libtorch loop  {tm:9.2} ms / {tp:9.2} ms   (1 thread)");
    println!(
        "  JIT vs interpreter: {:.1}x;  JIT vs libtorch loop: {:.1}x",
        im / jm,
        tm / jm
    );
}
