//! Speculative decoding keeps the target's outputs: greedy text is identical in every mode, for
//! many prompts and batch sizes; sampled text with n-gram drafts is the very text of plain
//! decoding; sampled text with a draft model follows the target's distribution (a chi-square
//! test against the exact distribution, with a control showing the test would notice the draft
//! model's). Log-probabilities stay the target's.

// Each test sets one libtorch thread: tests run in parallel threads, and OpenMP threads
// spinning on a small shared machine slow the suite down about tenfold.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use braid_runtime::generation::spec::{SpeculateMode, distribution};
use braid_runtime::rng::Rng;
use braid_runtime::{
    EngineOptions, FinishReason, Head, InferOptions, Model, Rollout, Sample, SamplingParams,
    TinyConfig, Tokenizer, generate, logprobs, save_pretrained, tiny,
};
use tch::{Device, Kind, Tensor};

fn target() -> (Model, Tokenizer) {
    tiny(
        &TinyConfig {
            seed: 3,
            ..TinyConfig::default()
        },
        Head::Lm,
        Device::Cpu,
    )
    .unwrap()
}

/// A saved tiny model for `draft:DIR`.
fn draft_dir(name: &str, config: &TinyConfig, perturb: bool) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("braid-spec-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (mut m, tok) = tiny(config, Head::Lm, Device::Cpu).unwrap();
    if perturb {
        perturb_head(&mut m);
    }
    save_pretrained(&m, &tok, &dir).unwrap();
    dir
}

/// Scales each token's output row by one of 0.5, 0.9 or 1.3 (by id): a model that agrees with
/// the original on some tokens and not on others — a real but imperfect drafter.
fn perturb_head(m: &mut Model) {
    let vars = m.var_store_mut().variables();
    let mut w = vars["lm_head.weight"].shallow_clone();
    let rows = w.size()[0];
    let scale =
        (Tensor::arange(rows, (Kind::Float, Device::Cpu)).remainder(3.0) * 0.4 + 0.5).unsqueeze(1);
    tch::no_grad(|| {
        let scaled = &w * &scale;
        w.copy_(&scaled);
    });
}

/// The target's configuration (the draft models are the target, perturbed or not).
fn draft_config() -> TinyConfig {
    TinyConfig {
        seed: 3,
        ..TinyConfig::default()
    }
}

fn options(max_batch: usize, speculate: SpeculateMode, draft_len: Option<usize>) -> EngineOptions {
    EngineOptions {
        max_batch,
        speculate,
        draft_len,
        first_prompt: 0,
        ..EngineOptions::default()
    }
}

/// Random prompts: some random bytes, some built from repeated pieces (copy-heavy), of 1 to
/// 40 bytes.
fn random_prompts(rng: &mut Rng, tok: &Tokenizer, count: usize) -> Vec<Vec<i64>> {
    (0..count)
        .map(|_| {
            let len = 1 + (rng.next_u64() % 40) as usize;
            let alphabet = b"abcdefgh ijklmnop.,;";
            let text: Vec<u8> = if rng.uniform() < 0.5 {
                (0..len)
                    .map(|_| alphabet[(rng.next_u64() % alphabet.len() as u64) as usize])
                    .collect()
            } else {
                let piece: Vec<u8> = (0..1 + rng.next_u64() % 6)
                    .map(|_| alphabet[(rng.next_u64() % alphabet.len() as u64) as usize])
                    .collect();
                piece.iter().copied().cycle().take(len).collect()
            };
            tok.encode(std::str::from_utf8(&text).unwrap(), true)
                .unwrap()
        })
        .collect()
}

fn assert_same(case: &str, plain: &[Sample], spec: &[Sample]) {
    assert_eq!(plain.len(), spec.len(), "{case}");
    for (a, b) in plain.iter().zip(spec) {
        assert_eq!(
            (
                a.prompt_index,
                a.sample_index,
                &a.token_ids,
                &a.text,
                &a.finish
            ),
            (
                b.prompt_index,
                b.sample_index,
                &b.token_ids,
                &b.text,
                &b.finish
            ),
            "{case}"
        );
        assert_eq!(a.logprobs.len(), b.logprobs.len(), "{case}");
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert!((x - y).abs() < 1e-4, "{case}: logprob {x} vs {y}");
        }
    }
}

#[test]
fn greedy_generation_is_identical_in_every_mode() {
    braid_runtime::device::set_cpu_threads(1);
    let (m, tok) = target();
    let weak = draft_dir("greedy-weak", &draft_config(), true);
    // The target itself as its draft model: every draft is accepted.
    let same = draft_dir("greedy-same", &draft_config(), false);
    let modes: Vec<(SpeculateMode, Option<usize>)> = vec![
        (SpeculateMode::Auto, None),
        (SpeculateMode::Auto, Some(5)),
        (SpeculateMode::Ngram(1), None),
        (SpeculateMode::Ngram(3), None),
        (SpeculateMode::Ngram(16), None),
        (SpeculateMode::Draft(weak.clone()), None),
        (SpeculateMode::Draft(weak.clone()), Some(3)),
        (SpeculateMode::Draft(same.clone()), Some(6)),
    ];
    let mut rng = Rng::new(2024);
    let mut speculated = BTreeMap::new();
    for case in 0..10 {
        let count = 1 + (rng.next_u64() % 9) as usize;
        let prompts = random_prompts(&mut rng, &tok, count);
        let max_batch = [1, 2, 3, 5, 8, 16][(rng.next_u64() % 6) as usize];
        let mut params = SamplingParams {
            greedy: true,
            max_new_tokens: 1 + (rng.next_u64() % 48) as usize,
            n: 1 + (rng.next_u64() % 2) as usize,
            stop_at_eos: false,
            ..SamplingParams::default()
        };
        let plain = generate(
            &m,
            &tok,
            prompts.clone(),
            params.clone(),
            options(max_batch, SpeculateMode::Off, None),
        )
        .unwrap();
        // Every third case stops at a string taken from the middle of a completion.
        let mut plain = plain;
        if case % 3 == 2
            && let Some(s) = plain.iter().find(|s| s.text.len() > 8)
        {
            let stop: String = s.text.chars().skip(4).take(2).collect();
            params.stop = vec![stop];
            plain = generate(
                &m,
                &tok,
                prompts.clone(),
                params.clone(),
                options(max_batch, SpeculateMode::Off, None),
            )
            .unwrap();
            assert!(plain.iter().any(|s| s.finish == FinishReason::Stop));
        }
        for (mode, draft_len) in &modes {
            let label = format!("case {case}, {mode}, draft_len {draft_len:?}, batch {max_batch}");
            let mut stream = braid_runtime::generate_stream(
                &m,
                &tok,
                prompts.clone(),
                params.clone(),
                options(max_batch, mode.clone(), *draft_len),
            )
            .unwrap();
            let mut out: Vec<Sample> = stream.by_ref().map(Result::unwrap).collect();
            out.sort_by_key(|s| (s.prompt_index, s.sample_index));
            assert_same(&label, &plain, &out);
            let accepted: usize = stream.step_log().iter().map(|s| s.accepted).sum();
            *speculated
                .entry(format!("{mode} {draft_len:?}"))
                .or_insert(0) += accepted;
        }
    }
    // Every mode with a fixed draft length, and auto (drafts are free), did speculate, so the
    // equality above is not vacuous. (With a draft model as costly as the target, the adaptive
    // policy rightly stays off.)
    for (mode, accepted) in &speculated {
        if !mode.ends_with("None") || mode.starts_with("auto") || mode.starts_with("ngram") {
            assert!(*accepted > 0, "{mode} never accepted a draft");
        }
    }
}

#[test]
fn eos_inside_accepted_drafts_stops_the_sample_there() {
    braid_runtime::device::set_cpu_threads(1);
    let (m, tok) = target();
    let prompts = vec![tok.encode("abcabcabcabc", true).unwrap()];
    let params = SamplingParams {
        greedy: true,
        max_new_tokens: 40,
        stop_at_eos: true,
        ..SamplingParams::default()
    };
    let free = generate(
        &m,
        &tok,
        prompts.clone(),
        SamplingParams {
            stop_at_eos: false,
            ..params.clone()
        },
        EngineOptions::default(),
    )
    .unwrap();
    // Declare a token of the greedy text's repeating tail an end-of-sequence token.
    let eos = free[0].token_ids[20];
    let mut eos_tok = Tokenizer::bytes();
    eos_tok.set_eos(vec![eos]);
    let plain = generate(
        &m,
        &eos_tok,
        prompts.clone(),
        params.clone(),
        EngineOptions::default(),
    )
    .unwrap();
    assert_eq!(plain[0].finish, FinishReason::Eos);
    for mode in [SpeculateMode::Ngram(8), SpeculateMode::Auto] {
        let out = generate(
            &m,
            &eos_tok,
            prompts.clone(),
            params.clone(),
            options(4, mode.clone(), None),
        )
        .unwrap();
        assert_same(&mode.to_string(), &plain, &out);
    }
}

#[test]
fn sampled_text_with_ngram_drafts_is_the_text_without() {
    braid_runtime::device::set_cpu_threads(1);
    let (m, tok) = target();
    let mut rng = Rng::new(7);
    let prompts = random_prompts(&mut rng, &tok, 6);
    // A low temperature makes the tiny model repeat itself, so drafts are often accepted.
    for (temperature, top_k, top_p) in [(0.02f32, 0, 1.0f32), (0.05, 5, 0.9), (1.0, 0, 1.0)] {
        let params = SamplingParams {
            max_new_tokens: 40,
            temperature,
            top_k,
            top_p,
            n: 2,
            seed: 5,
            stop_at_eos: false,
            ..SamplingParams::default()
        };
        let plain = generate(
            &m,
            &tok,
            prompts.clone(),
            params.clone(),
            options(4, SpeculateMode::Off, None),
        )
        .unwrap();
        for mode in [SpeculateMode::Ngram(6), SpeculateMode::Auto] {
            let mut stream = braid_runtime::generate_stream(
                &m,
                &tok,
                prompts.clone(),
                params.clone(),
                options(4, mode.clone(), None),
            )
            .unwrap();
            let mut out: Vec<Sample> = stream.by_ref().map(Result::unwrap).collect();
            out.sort_by_key(|s| (s.prompt_index, s.sample_index));
            assert_same(&format!("T {temperature} {mode}"), &plain, &out);
            if temperature < 0.1 && mode == SpeculateMode::Ngram(6) {
                let accepted: usize = stream.step_log().iter().map(|s| s.accepted).sum();
                assert!(accepted > 20, "{accepted}");
            }
        }
    }
}

/// Upper 0.1 % point of the chi-square distribution (Wilson–Hilferty).
fn chi2_critical(df: usize) -> f64 {
    let d = df as f64;
    let z = 3.090_2;
    let a = 2.0 / (9.0 * d);
    d * (1.0 - a + z * a.sqrt()).powi(3)
}

/// Chi-square goodness of fit of observed triples against exact probabilities; cells with an
/// expected count under 5 are pooled. Returns (statistic, degrees of freedom).
fn chi2(
    observed: &BTreeMap<Vec<i64>, usize>,
    exact: &BTreeMap<Vec<i64>, f64>,
    n: usize,
) -> (f64, usize) {
    let (mut stat, mut cells) = (0.0, 0usize);
    let (mut pooled_obs, mut pooled_exp) = (0.0, 0.0);
    for (key, &p) in exact {
        let e = p * n as f64;
        let o = observed.get(key).copied().unwrap_or(0) as f64;
        if e < 5.0 {
            pooled_obs += o;
            pooled_exp += e;
        } else {
            stat += (o - e).powi(2) / e;
            cells += 1;
        }
    }
    // Outcomes the exact distribution gives no mass (there should be none).
    let outside: usize = observed
        .iter()
        .filter(|(k, _)| !exact.contains_key(*k))
        .map(|(_, &c)| c)
        .sum();
    pooled_obs += outside as f64;
    if pooled_exp > 0.0 {
        stat += (pooled_obs - pooled_exp).powi(2) / pooled_exp;
        cells += 1;
    } else if outside > 0 {
        stat = f64::INFINITY;
    }
    (stat, cells.saturating_sub(1))
}

/// The exact distribution of the first three sampled tokens after `prompt`.
fn exact_triples(m: &Model, prompt: &[i64], params: &SamplingParams) -> BTreeMap<Vec<i64>, f64> {
    let next = |prefix: &[i64]| -> Vec<f64> {
        let ids = Tensor::from_slice(prefix).unsqueeze(0);
        let logits = tch::no_grad(|| m.forward(&ids, None).unwrap())
            .get(0)
            .get(prefix.len() as i64 - 1);
        let logits: Vec<f32> = Vec::try_from(logits.to_kind(Kind::Float)).unwrap();
        distribution(&logits, params)
    };
    let mut out = BTreeMap::new();
    let mut seq = prompt.to_vec();
    for (a, pa) in next(&seq).into_iter().enumerate().filter(|x| x.1 > 0.0) {
        seq.push(a as i64);
        for (b, pb) in next(&seq).into_iter().enumerate().filter(|x| x.1 > 0.0) {
            seq.push(b as i64);
            for (c, pc) in next(&seq).into_iter().enumerate().filter(|x| x.1 > 0.0) {
                out.insert(vec![a as i64, b as i64, c as i64], pa * pb * pc);
            }
            seq.pop();
        }
        seq.pop();
    }
    out
}

fn triples(samples: &[Sample]) -> BTreeMap<Vec<i64>, usize> {
    let mut out = BTreeMap::new();
    for s in samples {
        *out.entry(s.token_ids[..3].to_vec()).or_insert(0) += 1;
    }
    out
}

#[test]
fn sampled_outputs_with_a_draft_model_follow_the_target_distribution() {
    braid_runtime::device::set_cpu_threads(1);
    let (m, tok) = target();
    let dir = draft_dir("chi2", &draft_config(), true);
    let prompt = tok.encode("the cat", true).unwrap();
    // A low-entropy distribution: a low temperature and the four likeliest tokens.
    let params = SamplingParams {
        max_new_tokens: 4,
        temperature: 0.02,
        top_k: 4,
        n: 3000,
        seed: 99,
        stop_at_eos: false,
        ..SamplingParams::default()
    };
    let exact = exact_triples(&m, &prompt, &params);
    assert!((exact.values().sum::<f64>() - 1.0).abs() < 1e-6);
    // Two drafts per step: tokens 2 and 3 come out of one verification (accept, or a draw from
    // the residual), token 4 is the bonus or the next step's.
    let mut stream = braid_runtime::generate_stream(
        &m,
        &tok,
        vec![prompt.clone()],
        params.clone(),
        options(64, SpeculateMode::Draft(dir.clone()), Some(2)),
    )
    .unwrap();
    let spec: Vec<Sample> = stream.by_ref().map(Result::unwrap).collect();
    let log = stream.step_log();
    let drafted: usize = log.iter().map(|s| s.drafted).sum();
    let accepted: usize = log.iter().map(|s| s.accepted).sum();
    // Both outcomes of verification are well represented.
    assert!(
        accepted > 1000 && drafted - accepted > 1000,
        "{accepted} of {drafted}"
    );
    let (stat, df) = chi2(&triples(&spec), &exact, spec.len());
    eprintln!(
        "exact: {} outcomes, {accepted} of {drafted} drafts accepted",
        exact.len()
    );
    assert!(df >= 10, "{df}");
    eprintln!(
        "speculative: chi2 {stat:.1} on {df} df (0.1 % point {:.1})",
        chi2_critical(df)
    );
    assert!(
        stat < chi2_critical(df),
        "speculative: chi2 {stat:.1} on {df} df"
    );

    // The same test on plain decoding passes, and on the draft model's own samples fails:
    // the test can tell the two distributions apart.
    let plain = generate(
        &m,
        &tok,
        vec![prompt.clone()],
        params.clone(),
        EngineOptions::default(),
    )
    .unwrap();
    let (stat, df) = chi2(&triples(&plain), &exact, plain.len());
    eprintln!("plain: chi2 {stat:.1} on {df} df");
    assert!(stat < chi2_critical(df), "plain: chi2 {stat:.1} on {df} df");
    let (mut dm, _) = tiny(&draft_config(), Head::Lm, Device::Cpu).unwrap();
    perturb_head(&mut dm);
    let own = generate(
        &dm,
        &tok,
        vec![prompt.clone()],
        params.clone(),
        EngineOptions::default(),
    )
    .unwrap();
    let (stat, df) = chi2(&triples(&own), &exact, own.len());
    eprintln!("draft model alone: chi2 {stat:.1} on {df} df");
    assert!(
        stat > 10.0 * chi2_critical(df),
        "draft model: chi2 {stat:.1} on {df} df"
    );

    // Log-probabilities are the target's, recomputed by batched inference.
    let rollouts: Vec<Rollout> = spec[..50]
        .iter()
        .map(|s| Rollout {
            prompt: prompt.clone(),
            completion: s.token_ids.clone(),
        })
        .collect();
    let recomputed = logprobs(
        &m,
        &rollouts,
        &InferOptions {
            micro_batch: 16,
            temperature: params.temperature,
        },
    )
    .unwrap();
    for (s, r) in spec.iter().zip(&recomputed) {
        for (a, b) in s.logprobs.iter().zip(r) {
            assert!((a - b).abs() < 1e-3, "{a} vs {b}");
        }
    }
}

#[test]
fn bad_speculation_options_are_errors() {
    braid_runtime::device::set_cpu_threads(1);
    let (m, tok) = target();
    let prompts = vec![tok.encode("hi", true).unwrap()];
    let err = |o: EngineOptions| {
        braid_runtime::generate_stream(&m, &tok, prompts.clone(), SamplingParams::default(), o)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert!(err(options(4, SpeculateMode::Ngram(0), None)).starts_with("speculate: "));
    assert!(err(options(4, SpeculateMode::Auto, Some(65))).starts_with("draft_len: "));
    let missing = std::env::temp_dir().join("braid-spec-no-such-model");
    assert!(
        err(options(4, SpeculateMode::Draft(missing.clone()), None))
            .starts_with(&missing.display().to_string())
    );
    let short = draft_dir(
        "short",
        &TinyConfig {
            max_len: 64,
            ..draft_config()
        },
        false,
    );
    let e = err(options(4, SpeculateMode::Draft(short.clone()), None));
    assert!(e.contains("fewer than the target's 512"), "{e}");
}
