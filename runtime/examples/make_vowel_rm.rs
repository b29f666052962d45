//! Makes the reward model of `examples/ppo_tiny.rlhf`: a tiny byte-level Llama with a score
//! head, trained by regression to score a completion by its share of vowels (the quickstart's
//! reward), saved as a Hugging Face directory.
//!
//! cargo run --release -p braid-runtime --example make_vowel_rm -- examples/models/vowel_rm
//!
//! Training data: a few random letters as the prompt (like `synthetic::letters`), then a
//! completion of 1–24 bytes where each byte is a vowel with probability p ~ U(0, 1) and a
//! random byte otherwise. The target is the completion's vowel share. Deterministic (seeded);
//! prints the mean absolute error on held-out samples.

use std::path::PathBuf;

use braid_runtime::models::model::Head;
use braid_runtime::models::tiny::{TinyConfig, tiny};
use braid_runtime::rng::Rng;
use braid_runtime::training::infer::{self, Rollout};
use braid_runtime::{InferOptions, save_pretrained};
use tch::{Device, Kind, Tensor};

fn sample(rng: &mut Rng) -> (Rollout, f64) {
    let mut prompt = vec![256i64]; // BOS
    for _ in 0..3 + rng.next_u64() % 4 {
        prompt.push(i64::from(b'a') + (rng.next_u64() % 26) as i64);
    }
    prompt.push(i64::from(b' '));
    let p = rng.uniform();
    let len = 1 + (rng.next_u64() % 24) as usize;
    let vowels = b"aeiou";
    let mut completion = Vec::with_capacity(len);
    let mut hits = 0;
    for _ in 0..len {
        if rng.uniform() < p {
            completion.push(i64::from(vowels[(rng.next_u64() % 5) as usize]));
            hits += 1;
        } else {
            let b = (rng.next_u64() % 256) as u8;
            if vowels.contains(&b) {
                hits += 1;
            }
            completion.push(i64::from(b));
        }
    }
    (Rollout { prompt, completion }, hits as f64 / len as f64)
}

fn main() {
    let out: PathBuf = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "examples/models/vowel_rm".into())
        .into();
    braid_runtime::device::set_cpu_threads(1);
    let (model, tok) = match tiny(
        &TinyConfig {
            layers: 1,
            hidden: 32,
            heads: 2,
            kv_heads: 2,
            intermediate: 128,
            max_len: 512,
            seed: 3,
            ..TinyConfig::default()
        },
        Head::Score,
        Device::Cpu,
    ) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let params: Vec<Tensor> = model
        .named_parameters()
        .into_iter()
        .map(|(_, t)| t)
        .collect();
    let mut m: Vec<Tensor> = params.iter().map(|p| p.zeros_like()).collect();
    let mut v: Vec<Tensor> = params.iter().map(|p| p.zeros_like()).collect();
    let mut rng = Rng::new(11);
    let (lr, b1, b2) = (3e-3, 0.9, 0.999);
    for step in 1..=1500 {
        let batch: Vec<(Rollout, f64)> = (0..32).map(|_| sample(&mut rng)).collect();
        let seqs: Vec<&Rollout> = batch.iter().map(|(r, _)| r).collect();
        let (ids, mask) = infer::pad_batch(&seqs, 0, Device::Cpu);
        let hidden = model.hidden_states(&ids, Some(&mask)).expect("forward");
        let last: Vec<i64> = seqs
            .iter()
            .map(|r| (r.prompt.len() + r.completion.len()) as i64 - 1)
            .collect();
        let rows: Vec<i64> = (0..seqs.len() as i64).collect();
        let h = hidden.index(&[
            Some(Tensor::from_slice(&rows)),
            Some(Tensor::from_slice(&last)),
        ]);
        let pred = model.apply_head(&h).expect("head").reshape([-1]);
        let target = Tensor::from_slice(&batch.iter().map(|(_, y)| *y as f32).collect::<Vec<_>>());
        let loss = (pred - target).square().mean(Kind::Float);
        loss.backward();
        let t = f64::from(step);
        tch::no_grad(|| {
            for (i, p) in params.iter().enumerate() {
                let g = p.grad();
                let nm = &m[i] * b1 + &g * (1.0 - b1);
                let nv = &v[i] * b2 + g.square() * (1.0 - b2);
                let upd = (&nm / (1.0 - b1.powf(t))) / ((&nv / (1.0 - b2.powf(t))).sqrt() + 1e-8);
                let mut d = p.shallow_clone();
                d.copy_(&(p - upd * lr));
                m[i] = nm;
                v[i] = nv;
                let mut g = g;
                let _ = g.zero_();
            }
        });
        if step % 500 == 0 {
            println!("step {step}: mse {:.5}", loss.double_value(&[]));
        }
    }
    // Held-out error through the same path the executor's `score` uses.
    let mut test_rng = Rng::new(99);
    let held: Vec<(Rollout, f64)> = (0..256).map(|_| sample(&mut test_rng)).collect();
    let seqs: Vec<Rollout> = held.iter().map(|(r, _)| r.clone()).collect();
    let scores = infer::score(&model, &seqs, &InferOptions::default()).unwrap_or_default();
    let mae: f64 = held
        .iter()
        .zip(&scores)
        .map(|((_, y), s)| (f64::from(*s) - y).abs())
        .sum::<f64>()
        / held.len() as f64;
    println!("held-out mean absolute error {mae:.4} (targets in [0, 1])");
    if let Err(e) = save_pretrained(&model, &tok, &out) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
    println!("saved {}", out.display());
}
