//! Where a decode step's time goes on the CPU, for the generation benchmark's shape: a Llama
//! with hidden 256, 4 layers, 4 heads, intermediate 1024, 32 rows at about 108 cached
//! positions, f32, one libtorch thread. Prints, medians of `--repeats` timings:
//!
//! * the read bandwidth of this machine on one thread (summing a 512 MB tensor);
//! * attention over 4 layers of KV caches too large to stay in the CPU cache together, by
//!   libtorch's `scaled_dot_product_attention` and by Braid's decode kernel
//!   (`braid_runtime::kernels::attention::decode_attention`), on the same tensors (checked to agree);
//! * the linear layers of one step (29 products of 32 rows), by libtorch's `linear` and by
//!   Braid's product kernel (`braid_runtime::kernels::gemm::linear`);
//! * one whole `forward_cached` decode step of the model, as libtorch operations (with the
//!   attention kernel) and on host memory with Braid's kernels (`step.rs`), interleaved.
//!
//! Usage: cargo run --release -p braid-runtime --example bench_decode_step [-- --repeats 30]

use std::time::Instant;

use braid_runtime::kernels::attention::decode_attention;
use braid_runtime::{Head, TinyConfig, tiny};
use tch::{Device, Kind, Tensor};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time(repeats: usize, mut f: impl FnMut()) -> f64 {
    f();
    median(
        (0..repeats)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn main() {
    let mut repeats = 30usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match (a.as_str(), args.next().and_then(|v| v.parse().ok())) {
            ("--repeats", Some(n)) => repeats = n,
            _ => {
                eprintln!("usage: bench_decode_step [--repeats N]");
                std::process::exit(2);
            }
        }
    }
    tch::set_num_threads(1);
    let _guard = tch::no_grad_guard();
    let f32cpu = (Kind::Float, Device::Cpu);

    let big = Tensor::randn([128 << 20], f32cpu);
    let t = time(repeats.min(10), || {
        let _ = big.sum(Kind::Float).double_value(&[]);
    });
    println!("read bandwidth, 1 thread: {:.1} GB/s", 0.5 / t);
    drop(big);

    let (b, h, cap, len, d) = (32i64, 4i64, 128i64, 108i64, 64i64);
    let layers: Vec<(Tensor, Tensor)> = (0..4)
        .map(|_| {
            (
                Tensor::randn([b, h, cap, d], f32cpu),
                Tensor::randn([b, h, cap, d], f32cpu),
            )
        })
        .collect();
    let q = Tensor::randn([b, 1, h, d], f32cpu).transpose(1, 2);
    let mask = Tensor::ones([b, 1, 1, len], (Kind::Bool, Device::Cpu));
    let lens = vec![len - 1; b as usize];
    let libtorch = |k: &Tensor, v: &Tensor| {
        Tensor::scaled_dot_product_attention(
            &q,
            &k.narrow(2, 0, len),
            &v.narrow(2, 0, len),
            Some(&mask),
            0.0,
            false,
            None::<f64>,
            false,
        )
        .transpose(1, 2)
        .reshape([b, 1, h * d])
    };
    let kernel = |k: &Tensor, v: &Tensor| decode_attention(&q, k, v, &lens).expect("handled");
    for (k, v) in &layers {
        let diff = (libtorch(k, v) - kernel(k, v))
            .abs()
            .max()
            .double_value(&[]);
        assert!(diff < 1e-5, "kernel and libtorch differ by {diff}");
    }
    let mb = (2 * 4 * b * h * len * d * 4) as f64 / 1e6;
    let t_lib = time(repeats, || {
        for (k, v) in &layers {
            let _ = libtorch(k, v);
        }
    });
    let t_ker = time(repeats, || {
        for (k, v) in &layers {
            let _ = kernel(k, v);
        }
    });
    println!(
        "attention, 4 layers x {b} rows x {len} positions ({mb:.0} MB of keys and values): libtorch {:.2} ms ({:.1} GB/s), kernel {:.2} ms ({:.1} GB/s)",
        t_lib * 1e3,
        mb / 1e3 / t_lib,
        t_ker * 1e3,
        mb / 1e3 / t_ker
    );

    // The linear layers of one step: per layer q, k, v, o (256 x 256), gate and up
    // (1024 x 256), down (256 x 1024); then the 1,000-way head.
    let mut shapes = Vec::new();
    for _ in 0..4 {
        shapes.extend([(256, 256); 4]);
        shapes.extend([(1024, 256), (1024, 256), (256, 1024)]);
    }
    shapes.push((1000, 256));
    let weights: Vec<Tensor> = shapes
        .iter()
        .map(|&(n, k)| Tensor::randn([n, k], f32cpu))
        .collect();
    let inputs: Vec<Tensor> = shapes
        .iter()
        .map(|&(_, k)| Tensor::randn([b, 1, k], f32cpu))
        .collect();
    for (x, w) in inputs.iter().zip(&weights) {
        let want = x.linear(w, None::<&Tensor>);
        let got = braid_runtime::kernels::gemm::linear(x, w, None).expect("handled");
        let diff = (want - got).abs().max().double_value(&[]);
        assert!(diff < 1e-3, "kernel and libtorch products differ by {diff}");
    }
    let flops: i64 = shapes.iter().map(|&(n, k)| 2 * b * n * k).sum();
    let t_lib = time(repeats, || {
        for (x, w) in inputs.iter().zip(&weights) {
            let _ = x.linear(w, None::<&Tensor>);
        }
    });
    let t_ker = time(repeats, || {
        for (x, w) in inputs.iter().zip(&weights) {
            let _ = braid_runtime::kernels::gemm::linear(x, w, None);
        }
    });
    println!(
        "linear layers of one step, {b} rows ({} products, {:.0} MFLOP): libtorch {:.2} ms ({:.1} GFLOP/s), kernel {:.2} ms ({:.1} GFLOP/s)",
        shapes.len(),
        flops as f64 / 1e6,
        t_lib * 1e3,
        flops as f64 / 1e9 / t_lib,
        t_ker * 1e3,
        flops as f64 / 1e9 / t_ker
    );

    let cfg = TinyConfig {
        layers: 4,
        hidden: 256,
        heads: 4,
        kv_heads: 4,
        intermediate: 1024,
        max_len: 512,
        ..TinyConfig::default()
    };
    let (m, _) = tiny(&cfg, Head::Lm, Device::Cpu).expect("tiny model");
    let mut cache = m.new_cache(b as usize);
    let prompt = Tensor::randint(250, [b, len - 16], (Kind::Int64, Device::Cpu));
    let _ = m
        .forward_cached(&mut cache, &prompt, &vec![len - 16; b as usize])
        .expect("prefill");
    let one = Tensor::randint(250, [b, 1], (Kind::Int64, Device::Cpu));
    let valid = vec![1i64; b as usize];
    // The same step as libtorch operations and on host memory (`step.rs`), interleaved.
    let (mut lib_steps, mut host_steps) = (Vec::new(), Vec::new());
    for i in 0..2 * repeats {
        if cache.lens()[0] >= len + 16 {
            for r in 0..b as usize {
                cache.truncate(r, len - 16).expect("rows exist");
            }
        }
        let libtorch = i % 2 == 0;
        m.set_libtorch_steps(libtorch);
        let t = Instant::now();
        let _ = m
            .forward_cached(&mut cache, &one, &valid)
            .expect("decode step");
        let secs = t.elapsed().as_secs_f64();
        if libtorch {
            &mut lib_steps
        } else {
            &mut host_steps
        }
        .push(secs);
    }
    println!(
        "decode step (forward_cached), {b} rows at {}-{} positions: libtorch operations {:.2} ms, host-memory step {:.2} ms",
        len - 16,
        len + 16,
        median(lib_steps) * 1e3,
        median(host_steps) * 1e3
    );
}
