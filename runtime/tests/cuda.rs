//! The GPU path, on a CUDA device: sampling on the device, fused attention, the KV cache in
//! the model's dtype, streamed inference on its own CUDA stream, pinned host memory for
//! offloading and checkpoints, mixed-precision training and activation checkpointing's peak
//! memory. Every test needs a GPU and fails without one; they are `#[ignore]`d so that
//! `cargo test` on machines without a GPU does not count them as passed. `scripts/gpu-check`
//! runs them (`cargo test -p braid-runtime --test cuda -- --ignored`, or the binary it
//! carries). The CPU-side halves of the same code (device sampling on CPU tensors, the fused
//! attention path, checkpointing, master weights) are tested everywhere in the crate's own
//! tests.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use braid_ir::graph::{LrSchedule, Optimizer};
use braid_runtime::training::optim::AdamW;
use braid_runtime::{
    EngineOptions, Head, Model, SamplingParams, SamplingPlace, TinyConfig, Tokenizer, cuda,
    generate, tiny_in,
};
use tch::{Device, Kind, Tensor};

fn gpu() -> Device {
    assert!(
        tch::Cuda::is_available(),
        "no CUDA device: libtorch sees none (backend linked: {})",
        cuda::backend_linked()
    );
    Device::Cuda(0)
}

fn small() -> TinyConfig {
    TinyConfig {
        layers: 2,
        hidden: 128,
        heads: 4,
        kv_heads: 2,
        intermediate: 256,
        ..TinyConfig::default()
    }
}

fn model(kind: Kind, device: Device) -> (Model, Tokenizer) {
    tiny_in(&small(), Head::Lm, kind, device).unwrap()
}

fn prompts(tok: &Tokenizer) -> Vec<Vec<i64>> {
    ["hello", "a longer prompt here", "x", "one two three four"]
        .iter()
        .map(|t| tok.encode(t, true).unwrap())
        .collect()
}

/// Greedy generation on the GPU in f32 is the CPU's, token for token, whether tokens are
/// chosen on the device (the default there) or on the host; in bf16 the KV cache is bf16.
#[test]
#[ignore = "needs a CUDA device; scripts/gpu-check runs it"]
fn greedy_generation_on_the_gpu_matches_the_cpu() {
    let dev = gpu();
    let (cpu, tok) = model(Kind::Float, Device::Cpu);
    let (gpu_model, _) = model(Kind::Float, dev);
    let params = SamplingParams {
        greedy: true,
        max_new_tokens: 32,
        stop_at_eos: false,
        ..SamplingParams::default()
    };
    let want = generate(
        &cpu,
        &tok,
        prompts(&tok),
        params.clone(),
        EngineOptions::default(),
    )
    .unwrap();
    for sampling in [SamplingPlace::Auto, SamplingPlace::Host] {
        let got = generate(
            &gpu_model,
            &tok,
            prompts(&tok),
            params.clone(),
            EngineOptions {
                sampling,
                ..EngineOptions::default()
            },
        )
        .unwrap();
        for (w, g) in want.iter().zip(&got) {
            assert_eq!(w.token_ids, g.token_ids, "{sampling:?}");
        }
    }
    let (bf16, _) = model(Kind::BFloat16, dev);
    let cache = bf16.new_cache(2);
    assert_eq!(cache.kind(), Kind::BFloat16);
    let out = generate(&bf16, &tok, prompts(&tok), params, EngineOptions::default()).unwrap();
    assert!(out.iter().all(|s| s.token_ids.len() == 32));
}

/// Sampled generation on the GPU follows the per-sample draws: the same seed gives the same
/// text whatever the batch, with sampling on the device.
#[test]
#[ignore = "needs a CUDA device; scripts/gpu-check runs it"]
fn sampled_generation_on_the_gpu_is_reproducible_per_sample() {
    let dev = gpu();
    let (m, tok) = model(Kind::BFloat16, dev);
    let params = SamplingParams {
        max_new_tokens: 24,
        seed: 5,
        n: 2,
        top_p: 0.9,
        stop_at_eos: false,
        ..SamplingParams::default()
    };
    let run = |max_batch: usize| {
        generate(
            &m,
            &tok,
            prompts(&tok),
            params.clone(),
            EngineOptions {
                max_batch,
                ..EngineOptions::default()
            },
        )
        .unwrap()
    };
    let (a, b) = (run(8), run(3));
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.token_ids, y.token_ids);
    }
}

/// Fused causal attention (flash attention in bf16) agrees with the masked path on the GPU.
#[test]
#[ignore = "needs a CUDA device; scripts/gpu-check runs it"]
fn fused_attention_on_the_gpu_agrees_with_the_masked_path() {
    let dev = gpu();
    for kind in [Kind::Float, Kind::BFloat16] {
        let (m, _) = model(kind, dev);
        let ids = Tensor::arange_start(3, 131, (Kind::Int64, dev)).reshape([2, 64]);
        let fused = tch::no_grad(|| m.forward(&ids, None).unwrap()).to_kind(Kind::Float);
        m.set_fused_attention(false);
        let masked = tch::no_grad(|| m.forward(&ids, None).unwrap()).to_kind(Kind::Float);
        let d = (fused - masked).abs().max().double_value(&[]);
        let tol = if kind == Kind::Float { 1e-4 } else { 0.1 };
        assert!(d < tol, "{kind:?}: {d}");
    }
}

/// A pool stream is not the default stream, work queued on it finishes by the guard's end,
/// and the caching allocator's peak is readable and resettable.
#[test]
#[ignore = "needs a CUDA device; scripts/gpu-check runs it"]
fn streams_and_memory_statistics_work_on_the_gpu() {
    let dev = gpu();
    let s = cuda::Stream::from_pool(0).unwrap();
    let out = {
        let _g = s.make_current().unwrap();
        let a = Tensor::ones([512, 512], (Kind::Float, dev));
        a.matmul(&a).sum(Kind::Float)
    };
    assert_eq!(out.double_value(&[]), 512.0 * 512.0 * 512.0);
    cuda::reset_peak(0).unwrap();
    let (before, _) = cuda::memory(0).unwrap();
    let big = Tensor::zeros([64, 1024, 1024], (Kind::Float, dev));
    let (now, peak) = cuda::memory(0).unwrap();
    assert!(
        now >= before + (256 << 20) && peak >= now,
        "{before} {now} {peak}"
    );
    drop(big);
}

/// Offloading moves a model's weights to pinned host memory and back unchanged.
#[test]
#[ignore = "needs a CUDA device; scripts/gpu-check runs it"]
fn offload_and_reload_go_through_pinned_memory() {
    let dev = gpu();
    let (mut m, _) = model(Kind::BFloat16, dev);
    let ids = Tensor::arange_start(3, 40, (Kind::Int64, dev)).unsqueeze(0);
    let before = tch::no_grad(|| m.forward(&ids, None).unwrap());
    m.offload().unwrap();
    for (name, t) in m.named_parameters() {
        assert_eq!(t.device(), Device::Cpu, "{name}");
        assert!(t.is_pinned(dev), "{name} is not pinned");
    }
    m.reload().unwrap();
    for (name, t) in m.named_parameters() {
        assert_eq!(t.device(), dev, "{name}");
    }
    assert!(tch::no_grad(|| m.forward(&ids, None).unwrap()).equal(&before));
    // Checkpoint writes stage device tensors in pinned memory too.
    let copies = braid_runtime::device::host_copies(&m.named_parameters());
    assert!(copies.iter().all(|(_, t)| t.is_pinned(dev)));
}

/// A bf16 step with f32 masters on the GPU points where the f32 step does, and activation
/// checkpointing lowers the peak memory of a forward and backward.
#[test]
#[ignore = "needs a CUDA device; scripts/gpu-check runs it"]
fn mixed_precision_and_checkpointing_on_the_gpu() {
    let dev = gpu();
    let adamw = Optimizer {
        lr: 1e-5,
        weight_decay: 0.0,
        eps: 1e-8,
        beta1: 0.9,
        beta2: 0.999,
        warmup: 0,
        schedule: LrSchedule::Constant,
    };
    let ids = Tensor::arange_start(3, 259, (Kind::Int64, dev)).reshape([4, 64]);
    let step = |kind: Kind| {
        let (mut m, _) = model(Kind::Float, dev);
        let mut opt = if kind == Kind::Float {
            AdamW::new(&m, adamw.clone()).unwrap()
        } else {
            let masters = m.convert_keeping_masters(kind).unwrap();
            AdamW::with_masters(&m, adamw.clone(), masters).unwrap()
        };
        let before: Vec<Tensor> = opt.masters().iter().map(|(_, t)| t.copy()).collect();
        let loss = m
            .forward(&ids, None)
            .unwrap()
            .to_kind(Kind::Float)
            .log_softmax(-1, Kind::Float)
            .mean(Kind::Float);
        opt.scale_loss(&loss).backward();
        opt.accumulate();
        assert!(!opt.step(1e-5, Some(1.0)).skipped);
        let parts: Vec<Tensor> = opt
            .masters()
            .iter()
            .zip(&before)
            .map(|((_, a), b)| (a - b).reshape([-1]))
            .collect();
        Tensor::cat(&parts, 0)
    };
    let (d32, d16) = (step(Kind::Float), step(Kind::BFloat16));
    let cos = (&d32 * &d16).sum(Kind::Double).double_value(&[])
        / (d32.norm().double_value(&[]) * d16.norm().double_value(&[]));
    assert!(cos > 0.99, "cosine {cos}");
    let big = TinyConfig {
        layers: 8,
        hidden: 512,
        heads: 8,
        kv_heads: 8,
        intermediate: 2048,
        ..TinyConfig::default()
    };
    let (m, _) = tiny_in(&big, Head::Lm, Kind::BFloat16, dev).unwrap();
    let ids = Tensor::arange(8 * 512, (Kind::Int64, dev))
        .remainder(250)
        .reshape([8, 512]);
    let loss = |logits: Tensor| {
        logits
            .to_kind(Kind::Float)
            .log_softmax(-1, Kind::Float)
            .mean(Kind::Float)
    };
    let peak = |checkpointing: bool| {
        tch::Cuda::synchronize(0);
        cuda::reset_peak(0).unwrap();
        let (base, _) = cuda::memory(0).unwrap();
        if checkpointing {
            let (h, ck) = m.hidden_states_checkpointed(&ids, None).unwrap();
            loss(m.apply_head(&h).unwrap()).backward();
            m.backward_checkpointed(ck).unwrap();
        } else {
            loss(m.forward(&ids, None).unwrap()).backward();
        }
        tch::Cuda::synchronize(0);
        let (_, peak) = cuda::memory(0).unwrap();
        for (_, p) in m.named_parameters() {
            let mut g = p.grad();
            let _ = g.zero_();
        }
        peak - base
    };
    let (plain, ck) = (peak(false), peak(true));
    eprintln!("GPU peak of forward and backward: plain {plain} B, checkpointed {ck} B");
    assert!((ck as f64) < 0.6 * plain as f64, "{ck} vs {plain}");
}
