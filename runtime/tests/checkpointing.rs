//! Activation checkpointing (`gradient_checkpointing`): the recomputed backward gives the
//! gradients of the plain backward (within 1e-6 in f32) on every architecture — Llama with
//! grouped-query attention and padding on either side, Mistral's sliding window, Qwen2's
//! biases, GPT-2 — and lowers the process's measured peak memory (each measurement runs in a
//! child process of this test binary, so that the peaks of other tests do not mix in).

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::path::PathBuf;
use std::process::Command;

use braid_runtime::{Head, LoadOptions, Model, TinyConfig, tiny};
use tch::{Device, Kind, Tensor};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A loss that reaches every parameter: the log-softmax of every position, weighted.
fn loss(logits: &Tensor) -> Tensor {
    let lsm = logits.to_kind(Kind::Float).log_softmax(-1, Kind::Float);
    let w = Tensor::arange(lsm.size()[2], (Kind::Float, Device::Cpu)) / 100.0;
    (lsm * w).mean(Kind::Float)
}

/// Gradients of every parameter by name after `backward`, and clears them.
fn take_grads(model: &Model) -> Vec<(String, Tensor)> {
    model
        .named_parameters()
        .into_iter()
        .map(|(name, p)| {
            let mut g = p.grad();
            let copy = g.copy();
            let _ = g.zero_();
            (name, copy)
        })
        .collect()
}

fn max_diff(model: &Model, ids: &Tensor, mask: Option<&Tensor>) -> f64 {
    loss(&model.forward(ids, mask).unwrap()).backward();
    let plain = take_grads(model);
    let (hidden, ck) = model.hidden_states_checkpointed(ids, mask).unwrap();
    loss(&model.apply_head(&hidden).unwrap()).backward();
    model.backward_checkpointed(ck).unwrap();
    let checkpointed = take_grads(model);
    let mut worst = 0.0f64;
    for ((name, a), (_, b)) in plain.iter().zip(&checkpointed) {
        let scale = a.abs().max().double_value(&[]).max(1e-3);
        let d = (a - b).abs().max().double_value(&[]) / scale;
        assert!(d.is_finite(), "{name}");
        worst = worst.max(d);
    }
    worst
}

#[test]
fn checkpointed_gradients_equal_plain_gradients() {
    braid_runtime::device::set_cpu_threads(1);
    let (m, _) = tiny(
        &TinyConfig {
            layers: 3,
            hidden: 48,
            heads: 4,
            kv_heads: 2,
            intermediate: 96,
            ..TinyConfig::default()
        },
        Head::Lm,
        Device::Cpu,
    )
    .unwrap();
    let ids =
        Tensor::from_slice(&[256i64, 5, 6, 7, 8, 9, 256, 10, 11, 258, 258, 258]).reshape([2, 6]);
    let right = Tensor::from_slice(&[1i64, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]).reshape([2, 6]);
    let left = Tensor::from_slice(&[1i64, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1]).reshape([2, 6]);
    for (what, mask) in [
        ("right padding", Some(&right)),
        ("left padding", Some(&left)),
        ("no mask", None),
    ] {
        let d = max_diff(&m, &ids, mask);
        assert!(d < 1e-6, "tiny Llama, {what}: gradients differ by {d}");
    }
    // The fused causal path (CUDA's default) too.
    m.set_fused_attention(true);
    let d = max_diff(&m, &ids, Some(&right));
    assert!(d < 1e-6, "fused attention: gradients differ by {d}");
    for name in ["mistral_window", "qwen2_bias", "gpt2", "llama_tied"] {
        let model = Model::load(&fixture(name), &LoadOptions::default()).unwrap();
        let vocab = model.config().vocab_size;
        let ids = Tensor::arange(10, (Kind::Int64, Device::Cpu))
            .remainder(vocab)
            .reshape([2, 5]);
        let d = max_diff(
            &model,
            &ids,
            Some(&Tensor::ones([2, 5], (Kind::Int64, Device::Cpu))),
        );
        assert!(d < 1e-6, "{name}: gradients differ by {d}");
    }
}

/// A line of `/proc/self/status` in bytes (`VmRSS`, `VmHWM`).
fn status_bytes(key: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with(key)).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

/// The child's work: one forward and backward of a model whose activations dwarf its weights
/// (8 layers, 8 sequences of 384 tokens). Returns how far its peak resident memory (`VmHWM`)
/// rose above what it held before the forward (libraries, weights, inputs).
fn child_peak(checkpointing: bool) -> (u64, f64) {
    braid_runtime::device::set_cpu_threads(1);
    let (m, _) = tiny(
        &TinyConfig {
            layers: 8,
            hidden: 256,
            heads: 4,
            kv_heads: 4,
            intermediate: 1024,
            ..TinyConfig::default()
        },
        Head::Lm,
        Device::Cpu,
    )
    .unwrap();
    let ids = Tensor::arange(8 * 384, (Kind::Int64, Device::Cpu))
        .remainder(250)
        .reshape([8, 384]);
    let before = status_bytes("VmRSS:");
    let start = std::time::Instant::now();
    if checkpointing {
        let (h, ck) = m.hidden_states_checkpointed(&ids, None).unwrap();
        loss(&m.apply_head(&h).unwrap()).backward();
        m.backward_checkpointed(ck).unwrap();
    } else {
        loss(&m.forward(&ids, None).unwrap()).backward();
    }
    (
        status_bytes("VmHWM:").saturating_sub(before),
        start.elapsed().as_secs_f64(),
    )
}

#[test]
fn checkpointing_lowers_peak_memory() {
    if let Ok(mode) = std::env::var("BRAID_CHECKPOINT_CHILD") {
        let (peak, seconds) = child_peak(mode == "checkpointed");
        println!("seconds={seconds:.3} peak_bytes={peak}");
        return;
    }
    let measure = |mode: &str| -> (u64, String) {
        let out = Command::new(std::env::current_exe().unwrap())
            .args([
                "checkpointing_lowers_peak_memory",
                "--exact",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env("BRAID_CHECKPOINT_CHILD", mode)
            // Every large block from mmap, so that freed activations leave the resident set
            // (glibc's heap would otherwise keep them and the peak would read high).
            .env("MALLOC_MMAP_THRESHOLD_", "65536")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line = stdout
            .lines()
            .find(|l| l.contains("peak_bytes="))
            .unwrap_or_else(|| panic!("no peak in {stdout}"));
        let peak = line
            .split("peak_bytes=")
            .nth(1)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let seconds = line
            .split("seconds=")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .unwrap_or("?")
            .to_string();
        (peak, seconds)
    };
    let (plain, plain_s) = measure("plain");
    let (checkpointed, checkpointed_s) = measure("checkpointed");
    eprintln!(
        "peak memory of forward and backward: plain {plain} B in {plain_s} s, checkpointed {checkpointed} B in {checkpointed_s} s"
    );
    // The plain backward keeps every layer's activations; the checkpointed one each layer's
    // input and one layer's activations at a time.
    assert!(
        (checkpointed as f64) < 0.5 * plain as f64,
        "checkpointing did not lower the peak: {checkpointed} vs {plain} bytes"
    );
}
