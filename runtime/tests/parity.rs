//! Parity with transformers: logits and greedy generations of the fixtures made by
//! `scripts/make_fixtures.py` (tiny random models of each supported architecture).
//!
//! `BRAID_TEST_DEVICE=cuda` runs them on the first GPU (`scripts/gpu-check` does): the same
//! greedy tokens in f32, logits within 1e-3 in f32 (the GPU's kernels add in other orders) and
//! within bf16's tolerance in bf16; without a GPU that setting fails instead of testing the
//! CPU.

// Each test sets one libtorch thread: tests run in parallel threads, and OpenMP threads
// spinning on a small shared machine slow the suite down about tenfold.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::path::PathBuf;

use braid_runtime::{
    EngineOptions, Head, InferOptions, LoadOptions, Model, Rollout, SamplingParams, Tokenizer,
    generate, score,
};
use serde_json::Value;
use tch::{Device, Kind, Tensor};

/// A fixture directory: under `BRAID_FIXTURES` when set (a test binary carried to another
/// machine by `scripts/gpu-check`), else this crate's `tests/fixtures`.
fn fixture(name: &str) -> PathBuf {
    match std::env::var_os("BRAID_FIXTURES") {
        Some(dir) => PathBuf::from(dir).join(name),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name),
    }
}

fn expected(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// Greedy decoding through the KV cache, one token per step.
fn greedy_cached(model: &Model, prompt: &[i64], steps: usize) -> Vec<i64> {
    let mut cache = model.new_cache(1);
    let ids = Tensor::from_slice(prompt).unsqueeze(0);
    let h = model
        .forward_cached(&mut cache, &ids, &[prompt.len() as i64])
        .unwrap();
    let mut logits = model
        .apply_head(&h.narrow(1, prompt.len() as i64 - 1, 1))
        .unwrap();
    let mut out = Vec::new();
    for _ in 0..steps {
        let next = logits.reshape([-1]).argmax(0, false).int64_value(&[]);
        out.push(next);
        let h = model
            .forward_cached(&mut cache, &Tensor::from_slice(&[next]).unsqueeze(0), &[1])
            .unwrap();
        logits = model.apply_head(&h).unwrap();
    }
    out
}

/// The device the parity tests run on: the CPU, or the first GPU with `BRAID_TEST_DEVICE=cuda`.
fn device() -> Device {
    match std::env::var("BRAID_TEST_DEVICE").as_deref() {
        Ok("cuda") => {
            assert!(
                tch::Cuda::is_available(),
                "BRAID_TEST_DEVICE=cuda, but libtorch sees no GPU"
            );
            Device::Cuda(0)
        }
        Ok("cpu") | Err(_) => Device::Cpu,
        Ok(other) => panic!("BRAID_TEST_DEVICE must be `cpu` or `cuda`, not `{other}`"),
    }
}

/// Largest logit difference to transformers' (computed in f32 on the CPU) allowed on `device`.
fn f32_tolerance(device: Device) -> f32 {
    if device.is_cuda() { 1e-3 } else { 1e-4 }
}

fn check(name: &str) {
    let dir = fixture(name);
    let device = device();
    let model = Model::load(
        &dir,
        &LoadOptions {
            dtype: Some(Kind::Float),
            device,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    let tok = Tokenizer::from_dir(&dir, model.config()).unwrap();
    assert!(tok.vocab_size() <= model.config().vocab_size as usize);
    let exp = expected(name);
    let input = ids(&exp["input_ids"]);
    let want = floats(&exp["logits"]);
    let got = tch::no_grad(|| {
        model
            .forward(&Tensor::from_slice(&input).unsqueeze(0), None)
            .unwrap()
    });
    let got: Vec<f32> = Vec::try_from(
        got.to_kind(Kind::Float)
            .to_device(Device::Cpu)
            .reshape([-1]),
    )
    .unwrap();
    assert_eq!(got.len(), want.len());
    let max_diff = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let tol = f32_tolerance(device);
    assert!(max_diff < tol, "{name}: logits differ by {max_diff}");
    let prompt = ids(&exp["greedy"]["prompt"]);
    let tokens = ids(&exp["greedy"]["tokens"]);
    assert_eq!(
        greedy_cached(&model, &prompt, tokens.len()),
        tokens,
        "{name}: greedy tokens"
    );
    // The same through the engine, batched with another prompt.
    let params = SamplingParams {
        greedy: true,
        max_new_tokens: tokens.len(),
        stop_at_eos: false,
        ..SamplingParams::default()
    };
    let prompts = vec![input.clone(), prompt.clone()];
    let out = generate(&model, &tok, prompts, params, EngineOptions::default()).unwrap();
    assert_eq!(out[1].token_ids, tokens, "{name}: engine greedy tokens");
}

#[test]
fn llama_gqa_matches_transformers() {
    braid_runtime::device::set_cpu_threads(1);
    check("llama_gqa");
}

#[test]
fn llama_sharded_checkpoint_matches_transformers() {
    braid_runtime::device::set_cpu_threads(1);
    check("llama_sharded");
}

#[test]
fn llama_tied_embeddings_match_transformers() {
    braid_runtime::device::set_cpu_threads(1);
    check("llama_tied");
}

#[test]
fn llama3_rope_scaling_matches_transformers() {
    braid_runtime::device::set_cpu_threads(1);
    check("llama3_rope");
}

#[test]
fn llama_linear_rope_scaling_matches_transformers() {
    braid_runtime::device::set_cpu_threads(1);
    check("llama_linear_rope");
}

#[test]
fn qwen2_attention_biases_match_transformers() {
    braid_runtime::device::set_cpu_threads(1);
    check("qwen2_bias");
}

#[test]
fn mistral_sliding_window_matches_transformers() {
    braid_runtime::device::set_cpu_threads(1);
    check("mistral_window");
}

#[test]
fn gpt2_matches_transformers() {
    braid_runtime::device::set_cpu_threads(1);
    check("gpt2");
}

#[test]
fn reward_model_scores_match_transformers() {
    braid_runtime::device::set_cpu_threads(1);
    let dir = fixture("llama_rm");
    let model = Model::load(
        &dir,
        &LoadOptions {
            head: Head::Score,
            device: device(),
            ..LoadOptions::default()
        },
    )
    .unwrap();
    let exp = expected("llama_rm");
    let seqs: Vec<Vec<i64>> = exp["score_batch"]["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(ids)
        .collect();
    let want = floats(&exp["score_batch"]["scores"]);
    // One sequence at a time (no padding) and the batch (right padding) must both agree.
    for (seq, w) in seqs.iter().zip(&want) {
        let out = tch::no_grad(|| {
            model
                .forward(&Tensor::from_slice(seq).unsqueeze(0), None)
                .unwrap()
        })
        .to_kind(Kind::Float)
        .to_device(Device::Cpu);
        let last = out.double_value(&[0, seq.len() as i64 - 1, 0]) as f32;
        assert!(
            (last - w).abs() < f32_tolerance(device()),
            "score {last} vs {w}"
        );
    }
    // The batched scoring path, right-padded in one micro-batch.
    let rollouts: Vec<Rollout> = seqs
        .iter()
        .map(|s| Rollout {
            prompt: s[..3].to_vec(),
            completion: s[3..].to_vec(),
        })
        .collect();
    let got = score(&model, &rollouts, &InferOptions::default()).unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert!(
            (g - w).abs() < f32_tolerance(device()),
            "batched score {g} vs {w}"
        );
    }
}

#[test]
fn bf16_and_f16_weights_give_close_logits() {
    braid_runtime::device::set_cpu_threads(1);
    let dir = fixture("llama_gqa");
    let exp = expected("llama_gqa");
    let input = Tensor::from_slice(&ids(&exp["input_ids"])).unsqueeze(0);
    let want = Tensor::from_slice(&floats(&exp["logits"]));
    for kind in [Kind::BFloat16, Kind::Half] {
        let model = Model::load(
            &dir,
            &LoadOptions {
                dtype: Some(kind),
                device: device(),
                ..LoadOptions::default()
            },
        )
        .unwrap();
        assert_eq!(model.kind(), kind);
        let got = tch::no_grad(|| model.forward(&input, None).unwrap())
            .to_kind(Kind::Float)
            .to_device(Device::Cpu)
            .reshape([-1]);
        let diff = (got - &want).abs().max().double_value(&[]);
        // Reduced precision: 8 (bf16) or 11 (f16) mantissa bits over two layers.
        assert!(diff < 0.15, "{kind:?}: logits differ by {diff}");
    }
}
