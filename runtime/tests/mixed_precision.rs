//! Mixed precision trains like f32: on the same sequences and advantages, the first update of
//! a bf16 tiny Llama (f32 masters and AdamW state, forward and backward in bf16) points the way
//! f32's does and touches as many parameters; over several steps the bf16 copy the model
//! computes with follows its masters. The same training loop as the executor's: micro-batch
//! backwards accumulated into the optimizer, then one step.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use braid_ir::graph::{LrSchedule, Optimizer};
use braid_runtime::training::infer::pad_batch;
use braid_runtime::training::optim::AdamW;
use braid_runtime::{Head, Model, Rollout, TinyConfig, tiny_in};
use tch::{Device, Kind, Tensor};

fn config() -> TinyConfig {
    TinyConfig {
        layers: 2,
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        intermediate: 128,
        ..TinyConfig::default()
    }
}

fn adamw(lr: f64) -> Optimizer {
    Optimizer {
        lr,
        weight_decay: 0.0,
        eps: 1e-8,
        beta1: 0.9,
        beta2: 0.999,
        warmup: 0,
        schedule: LrSchedule::Constant,
    }
}

/// A trained model in `kind` as the executor builds it: read in f32, masters kept, converted.
fn trained(kind: Kind, lr: f64) -> (Model, AdamW) {
    let (mut m, _) = tiny_in(&config(), Head::Lm, Kind::Float, Device::Cpu).unwrap();
    let opt = if kind == Kind::Float {
        AdamW::new(&m, adamw(lr)).unwrap()
    } else {
        let masters = m.convert_keeping_masters(kind).unwrap();
        AdamW::with_masters(&m, adamw(lr), masters).unwrap()
    };
    (m, opt)
}

/// Sequences of byte tokens: a prompt of 6 and a completion of 10–25, seeded.
fn rollouts() -> (Vec<Rollout>, Vec<f32>) {
    let mut state = 12345u64;
    let mut next = |n: u64| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let mut seqs = Vec::new();
    let mut adv = Vec::new();
    for i in 0..16 {
        let prompt: Vec<i64> = std::iter::once(256)
            .chain((0..5).map(|_| 97 + next(26) as i64))
            .collect();
        let len = 10 + next(16) as usize;
        let completion: Vec<i64> = (0..len).map(|_| 97 + next(26) as i64).collect();
        seqs.push(Rollout { prompt, completion });
        adv.push(if i % 2 == 0 { 1.0 } else { -1.0 } * (0.5 + (i as f32) / 16.0));
    }
    (seqs, adv)
}

/// One optimizer step of a policy-gradient loss, `-A · log p(token)` averaged over the
/// completion tokens, in micro-batches of 4 sequences; returns the step's norm.
fn train_step(model: &Model, opt: &mut AdamW, seqs: &[Rollout], adv: &[f32]) -> f64 {
    let tokens: usize = seqs.iter().map(|s| s.completion.len()).sum();
    for (chunk, a) in seqs.chunks(4).zip(adv.chunks(4)) {
        let refs: Vec<&Rollout> = chunk.iter().collect();
        let (ids, mask) = pad_batch(&refs, 0, Device::Cpu);
        let lsm = model
            .forward(&ids, Some(&mask))
            .unwrap()
            .to_kind(Kind::Float)
            .log_softmax(-1, Kind::Float);
        let (mut rows, mut cols, mut targets, mut weights) = (vec![], vec![], vec![], vec![]);
        for (b, (r, &w)) in chunk.iter().zip(a).enumerate() {
            for (i, &t) in r.completion.iter().enumerate() {
                rows.push(b as i64);
                cols.push((r.prompt.len() + i) as i64 - 1);
                targets.push(t);
                weights.push(-w / tokens as f32);
            }
        }
        let picked = lsm
            .index(&[
                Some(Tensor::from_slice(&rows)),
                Some(Tensor::from_slice(&cols)),
            ])
            .gather(1, &Tensor::from_slice(&targets).unsqueeze(1), false)
            .squeeze_dim(1);
        let loss = (picked * Tensor::from_slice(&weights)).sum(Kind::Float);
        opt.scale_loss(&loss).backward();
        opt.accumulate();
    }
    let out = opt.step(1e-5, Some(1.0));
    assert!(!out.skipped);
    out.norm
}

fn flat(named: &[(String, Tensor)]) -> Tensor {
    let parts: Vec<Tensor> = named
        .iter()
        .map(|(_, t)| t.detach().to_kind(Kind::Float).reshape([-1]))
        .collect();
    Tensor::cat(&parts, 0)
}

fn snapshot(opt: &AdamW) -> Tensor {
    flat(&opt.masters()).copy()
}

fn changed_share(before: &Tensor, after: &Tensor) -> f64 {
    after
        .ne_tensor(before)
        .to_kind(Kind::Float)
        .mean(Kind::Float)
        .double_value(&[])
}

#[test]
fn a_bf16_step_updates_the_parameters_like_an_f32_step() {
    braid_runtime::device::set_cpu_threads(1);
    let (seqs, adv) = rollouts();
    let run = |kind: Kind| {
        let (model, mut opt) = trained(kind, 1e-5);
        let before = snapshot(&opt);
        let norm = train_step(&model, &mut opt, &seqs, &adv);
        let after = snapshot(&opt);
        (
            after - &before,
            changed_share(&before, &snapshot(&opt)),
            norm,
        )
    };
    let (d32, share32, norm32) = run(Kind::Float);
    let (d16, share16, norm16) = run(Kind::BFloat16);
    let cosine = (&d32 * &d16).sum(Kind::Double).double_value(&[])
        / (d32.norm().double_value(&[]) * d16.norm().double_value(&[]));
    eprintln!(
        "step 1: cosine {cosine:.4}; changed f32 {share32:.4}, bf16 {share16:.4}; norm f32 {norm32:.4}, bf16 {norm16:.4}"
    );
    assert!(
        cosine > 0.99,
        "cosine of the bf16 update with f32's: {cosine}"
    );
    assert!(
        (share32 - share16).abs() < 0.05,
        "f32 changed {share32:.3} of the parameters, bf16 {share16:.3}"
    );
    assert!(share16 > 0.5, "bf16 changed only {share16:.3}");
    assert!((norm16 / norm32 - 1.0).abs() < 0.02, "{norm16} vs {norm32}");
}

/// Three steps at lr 1e-5, the setting: writing AdamW's result into bf16 weights
/// changed under 1 % of them. With masters, as many master weights change as in f32; the bf16
/// copy is the masters rounded, and the model computes with it.
#[test]
fn three_small_bf16_steps_change_as_many_masters_as_f32() {
    braid_runtime::device::set_cpu_threads(1);
    let (seqs, adv) = rollouts();
    let run = |kind: Kind| {
        let (model, mut opt) = trained(kind, 1e-5);
        let before = snapshot(&opt);
        for _ in 0..3 {
            train_step(&model, &mut opt, &seqs, &adv);
        }
        let masters = opt.masters();
        for ((name, low), (_, master)) in model.named_parameters().iter().zip(&masters) {
            assert!(
                low.equal(&master.to_kind(kind)),
                "{name}: the model's copy is not its master rounded"
            );
        }
        changed_share(&before, &snapshot(&opt))
    };
    let f32_share = run(Kind::Float);
    let bf16_share = run(Kind::BFloat16);
    eprintln!("three steps: changed f32 {f32_share:.4}, bf16 {bf16_share:.4}");
    assert!(
        (f32_share - bf16_share).abs() < 0.05,
        "f32 changed {f32_share:.3}, bf16 {bf16_share:.3}"
    );
}
