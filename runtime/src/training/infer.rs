//! Batched inference over finished rollouts: per-token log-probabilities (actor, reference),
//! per-token values (critic) and per-sequence scores (reward model).
//!
//! Sequences are prompt + completion, right-padded into micro-batches of a given size; the
//! attention mask hides the padding, so a sequence's numbers do not depend on what it is
//! batched with (test `infer::tests::micro_batch_size_does_not_change_results`). Alignment:
//! entry `i` of `logprobs` and `values` belongs to completion token `i` and is read at the
//! position that predicts it (the previous token), as in TRL's PPO. `score` reads the reward
//! head at the last token of the sequence. Everything runs under `no_grad`; training will use
//! `Model::forward` with the same `pad_batch`. This module must not sample or decode text.

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::generation::engine::Sample;
use crate::models::model::{Head, Model};

/// One prompt and its completion, as token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rollout {
    pub prompt: Vec<i64>,
    pub completion: Vec<i64>,
}

impl Rollout {
    /// The rollout of a generated sample.
    pub fn from_sample(prompt: &[i64], sample: &Sample) -> Rollout {
        Rollout {
            prompt: prompt.to_vec(),
            completion: sample.token_ids.clone(),
        }
    }

    fn len(&self) -> usize {
        self.prompt.len() + self.completion.len()
    }
}

/// How to batch inference.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InferOptions {
    /// Sequences per forward pass.
    pub micro_batch: usize,
    /// Logits are divided by this before `log_softmax` (use the sampling temperature so the
    /// numbers match the engine's).
    pub temperature: f32,
}

impl Default for InferOptions {
    fn default() -> Self {
        InferOptions {
            micro_batch: 8,
            temperature: 1.0,
        }
    }
}

/// Right-pads sequences into `ids` and `attention_mask`, both `[B, T]`; pads with `pad`.
pub fn pad_batch(seqs: &[&Rollout], pad: i64, device: Device) -> (Tensor, Tensor) {
    let t = seqs.iter().map(|r| r.len()).max().unwrap_or(0);
    let mut ids = Vec::with_capacity(seqs.len() * t);
    let mut mask = Vec::with_capacity(seqs.len() * t);
    for r in seqs {
        ids.extend_from_slice(&r.prompt);
        ids.extend_from_slice(&r.completion);
        ids.extend(std::iter::repeat_n(pad, t - r.len()));
        mask.extend(std::iter::repeat_n(1i64, r.len()));
        mask.extend(std::iter::repeat_n(0i64, t - r.len()));
    }
    let shape = [seqs.len() as i64, t as i64];
    (
        Tensor::from_slice(&ids).reshape(shape).to_device(device),
        Tensor::from_slice(&mask).reshape(shape).to_device(device),
    )
}

fn check(
    model: &Model,
    seqs: &[Rollout],
    options: &InferOptions,
    head: Head,
    what: &str,
) -> Result<()> {
    if model.head() != head {
        return Err(Error::invalid(
            model.source().display().to_string(),
            format!(
                "{what} needs a model loaded with the {head:?} head, this one has {:?}",
                model.head()
            ),
        ));
    }
    if options.micro_batch == 0 {
        return Err(Error::invalid("micro_batch", "must be at least 1"));
    }
    if options.temperature.is_nan() || options.temperature <= 0.0 {
        return Err(Error::invalid(
            "temperature",
            format!("must be positive, found {}", options.temperature),
        ));
    }
    let max_len = model.config().max_position_embeddings as usize;
    for (i, r) in seqs.iter().enumerate() {
        let name = format!("rollout {i}");
        if r.prompt.is_empty() {
            return Err(Error::invalid(name, "has an empty prompt"));
        }
        if r.len() > max_len {
            return Err(Error::invalid(
                name,
                format!("has {} tokens; the model takes at most {max_len}", r.len()),
            ));
        }
        model.check_ids(&r.prompt, &name)?;
        model.check_ids(&r.completion, &name)?;
    }
    Ok(())
}

/// Where a micro-batch's final hidden states `[B, T, hidden]` (`pad_batch`'s layout, after the
/// final norm) come from: the whole model's forward, or a pipeline's last stage, which ran
/// every micro-batch (in order) through the stages before.
pub type HiddenOf<'a> = dyn FnMut(&[&Rollout]) -> Result<Tensor> + 'a;

/// The whole model's final hidden states of a micro-batch.
fn forward_hidden(model: &Model) -> impl FnMut(&[&Rollout]) -> Result<Tensor> + '_ {
    move |batch| {
        let (ids, mask) = pad_batch(batch, 0, model.device());
        model.hidden_states(&ids, Some(&mask))
    }
}

/// Hidden states `[sum of completion lengths, hidden]` at the positions that predict each
/// completion token, for one micro-batch, in order.
fn completion_hidden(model: &Model, batch: &[&Rollout], hidden: &Tensor) -> Tensor {
    let mut rows = Vec::new();
    let mut cols = Vec::new();
    for (b, r) in batch.iter().enumerate() {
        let p = r.prompt.len() as i64;
        for i in 0..r.completion.len() as i64 {
            rows.push(b as i64);
            cols.push(p - 1 + i);
        }
    }
    let dev = model.device();
    hidden.index(&[
        Some(Tensor::from_slice(&rows).to_device(dev)),
        Some(Tensor::from_slice(&cols).to_device(dev)),
    ])
}

fn split(flat: Vec<f32>, batch: &[&Rollout], out: &mut Vec<Vec<f32>>) {
    let mut at = 0;
    for r in batch {
        out.push(flat[at..at + r.completion.len()].to_vec());
        at += r.completion.len();
    }
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(Vec::<f32>::try_from(
        t.to_kind(Kind::Float).to_device(Device::Cpu).reshape([-1]),
    )?)
}

/// Log-probability of each completion token under `model` (a language model), computed as
/// `log_softmax(logits / temperature)`.
pub fn logprobs(model: &Model, seqs: &[Rollout], options: &InferOptions) -> Result<Vec<Vec<f32>>> {
    logprobs_with(model, seqs, options, &mut forward_hidden(model))
}

/// [`logprobs`] with each micro-batch's hidden states from `hidden` (called for every
/// micro-batch, in order).
pub fn logprobs_with(
    model: &Model,
    seqs: &[Rollout],
    options: &InferOptions,
    hidden: &mut HiddenOf<'_>,
) -> Result<Vec<Vec<f32>>> {
    check(model, seqs, options, Head::Lm, "logprobs")?;
    let mut out = Vec::with_capacity(seqs.len());
    for chunk in seqs.chunks(options.micro_batch) {
        let batch: Vec<&Rollout> = chunk.iter().collect();
        let targets: Vec<i64> = batch
            .iter()
            .flat_map(|r| r.completion.iter().copied())
            .collect();
        let flat = tch::no_grad(|| {
            let h = hidden(&batch)?;
            if targets.is_empty() {
                return Ok(Vec::new());
            }
            let h = completion_hidden(model, &batch, &h);
            let t = Tensor::from_slice(&targets);
            let (lp, _) = model.token_logprobs(&h, &t, f64::from(options.temperature), false)?;
            host(&lp)
        })?;
        split(flat, &batch, &mut out);
    }
    Ok(out)
}

/// The critic's value at each completion token (read where that token is predicted).
pub fn values(critic: &Model, seqs: &[Rollout], options: &InferOptions) -> Result<Vec<Vec<f32>>> {
    values_with(critic, seqs, options, &mut forward_hidden(critic))
}

/// [`values`] with each micro-batch's hidden states from `hidden`.
pub fn values_with(
    critic: &Model,
    seqs: &[Rollout],
    options: &InferOptions,
    hidden: &mut HiddenOf<'_>,
) -> Result<Vec<Vec<f32>>> {
    check(critic, seqs, options, Head::Value, "values")?;
    let mut out = Vec::with_capacity(seqs.len());
    for chunk in seqs.chunks(options.micro_batch) {
        let batch: Vec<&Rollout> = chunk.iter().collect();
        let any = batch.iter().any(|r| !r.completion.is_empty());
        let flat = tch::no_grad(|| {
            let h = hidden(&batch)?;
            if any {
                host(&critic.apply_head(&completion_hidden(critic, &batch, &h))?)
            } else {
                Ok(Vec::new())
            }
        })?;
        split(flat, &batch, &mut out);
    }
    Ok(out)
}

/// The reward model's score of each sequence, read at its last token (label 0).
pub fn score(rm: &Model, seqs: &[Rollout], options: &InferOptions) -> Result<Vec<f32>> {
    score_with(rm, seqs, options, &mut forward_hidden(rm))
}

/// [`score`] with each micro-batch's hidden states from `hidden`.
pub fn score_with(
    rm: &Model,
    seqs: &[Rollout],
    options: &InferOptions,
    hidden: &mut HiddenOf<'_>,
) -> Result<Vec<f32>> {
    check(rm, seqs, options, Head::Score, "score")?;
    let mut out = Vec::with_capacity(seqs.len());
    for chunk in seqs.chunks(options.micro_batch) {
        let batch: Vec<&Rollout> = chunk.iter().collect();
        let flat = tch::no_grad(|| {
            let hidden = hidden(&batch)?;
            let dev = rm.device();
            let rows = Tensor::arange(batch.len() as i64, (Kind::Int64, dev));
            let last: Vec<i64> = batch.iter().map(|r| r.len() as i64 - 1).collect();
            let h = hidden.index(&[Some(rows), Some(Tensor::from_slice(&last).to_device(dev))]);
            host(&rm.apply_head(&h)?.select(1, 0))
        })?;
        out.extend(flat);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    // Each test sets one libtorch thread: tests run in parallel threads, and OpenMP threads
    // spinning on a small shared machine slow the suite down about tenfold.
    use super::*;
    use crate::generation::engine::{EngineOptions, generate};
    use crate::generation::sampling::SamplingParams;
    use crate::models::tiny::{TinyConfig, tiny};

    fn rollouts() -> Vec<Rollout> {
        vec![
            Rollout {
                prompt: vec![256, 104, 105],
                completion: vec![33, 33, 10, 257],
            },
            Rollout {
                prompt: vec![256, 120],
                completion: vec![1, 2, 3, 4, 5, 6, 7],
            },
            Rollout {
                prompt: vec![256, 97, 98, 99, 100, 101],
                completion: vec![],
            },
            Rollout {
                prompt: vec![256],
                completion: vec![42],
            },
        ]
    }

    #[test]
    fn engine_logprobs_match_batched_logprobs() {
        crate::device::set_cpu_threads(1);
        let (m, tok) = tiny(
            &TinyConfig {
                seed: 5,
                ..TinyConfig::default()
            },
            Head::Lm,
            Device::Cpu,
        )
        .unwrap();
        let prompts: Vec<Vec<i64>> = ["abc", "hello there", "z"]
            .iter()
            .map(|t| tok.encode(t, true).unwrap())
            .collect();
        let params = SamplingParams {
            temperature: 0.7,
            max_new_tokens: 12,
            n: 2,
            seed: 1,
            ..SamplingParams::default()
        };
        let samples =
            generate(&m, &tok, prompts.clone(), params, EngineOptions::default()).unwrap();
        let seqs: Vec<Rollout> = samples
            .iter()
            .map(|s| Rollout::from_sample(&prompts[s.prompt_index], s))
            .collect();
        let lps = logprobs(
            &m,
            &seqs,
            &InferOptions {
                micro_batch: 4,
                temperature: 0.7,
            },
        )
        .unwrap();
        for (s, lp) in samples.iter().zip(&lps) {
            assert_eq!(s.logprobs.len(), lp.len());
            for (a, b) in s.logprobs.iter().zip(lp) {
                assert!((a - b).abs() < 1e-4, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn micro_batch_size_does_not_change_results() {
        crate::device::set_cpu_threads(1);
        let cfg = TinyConfig {
            seed: 2,
            ..TinyConfig::default()
        };
        let (lm, _) = tiny(&cfg, Head::Lm, Device::Cpu).unwrap();
        let (critic, _) = tiny(&cfg, Head::Value, Device::Cpu).unwrap();
        let (rm, _) = tiny(&cfg, Head::Score, Device::Cpu).unwrap();
        let seqs = rollouts();
        let one = InferOptions {
            micro_batch: 1,
            ..InferOptions::default()
        };
        let all = InferOptions {
            micro_batch: 4,
            ..InferOptions::default()
        };
        let close = |a: &[f32], b: &[f32]| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5)
        };
        let (l1, l4) = (
            logprobs(&lm, &seqs, &one).unwrap(),
            logprobs(&lm, &seqs, &all).unwrap(),
        );
        let (v1, v4) = (
            values(&critic, &seqs, &one).unwrap(),
            values(&critic, &seqs, &all).unwrap(),
        );
        for i in 0..seqs.len() {
            assert_eq!(l1[i].len(), seqs[i].completion.len());
            assert!(close(&l1[i], &l4[i]));
            assert!(close(&v1[i], &v4[i]));
        }
        let (s1, s4) = (
            score(&rm, &seqs, &one).unwrap(),
            score(&rm, &seqs, &all).unwrap(),
        );
        assert_eq!(s1.len(), 4);
        assert!(close(&s1, &s4));
        // A fresh value head starts small.
        assert!(v4.iter().flatten().all(|v| v.abs() < 0.1));
    }

    #[test]
    fn logprobs_match_full_forward() {
        crate::device::set_cpu_threads(1);
        let (m, _) = tiny(&TinyConfig::default(), Head::Lm, Device::Cpu).unwrap();
        let r = &rollouts()[0];
        let ids: Vec<i64> = r.prompt.iter().chain(&r.completion).copied().collect();
        let lp = tch::no_grad(|| m.forward(&Tensor::from_slice(&ids).unsqueeze(0), None))
            .unwrap()
            .log_softmax(-1, Kind::Float);
        let got = logprobs(&m, std::slice::from_ref(r), &InferOptions::default()).unwrap();
        for (i, &tok) in r.completion.iter().enumerate() {
            let want = lp.double_value(&[0, (r.prompt.len() + i - 1) as i64, tok]) as f32;
            assert!((got[0][i] - want).abs() < 1e-5);
        }
    }

    #[test]
    fn wrong_head_and_bad_ids_are_errors() {
        crate::device::set_cpu_threads(1);
        let (m, _) = tiny(&TinyConfig::default(), Head::Lm, Device::Cpu).unwrap();
        let msg = values(&m, &rollouts(), &InferOptions::default())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            msg.starts_with("tiny: values needs a model loaded with the Value head"),
            "{msg}"
        );
        let bad = vec![Rollout {
            prompt: vec![256],
            completion: vec![5000],
        }];
        let msg = logprobs(&m, &bad, &InferOptions::default())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            msg.starts_with("rollout 0: token id 5000 outside the vocabulary"),
            "{msg}"
        );
    }
}
