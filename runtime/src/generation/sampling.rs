//! Choosing the next token from logits: greedy, or sampling with temperature, top-k and top-p
//! from a caller-owned generator. The reported log-probability is that of the chosen token
//! under `log_softmax(logits / temperature)` (temperature 1 when greedy), before top-k/top-p
//! truncation, which is what `infer::logprobs` recomputes with the same temperature (test
//! `engine::tests::engine_logprobs_match_batched_logprobs`). This module must not touch
//! tensors: it works on one row of logits already copied to the host.

use crate::error::{Error, Result};
use crate::rng::Rng;

/// How to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Upper bound on generated tokens per sample (default 64).
    pub max_new_tokens: usize,
    /// Take the most likely token (ties: the lowest id) instead of sampling.
    pub greedy: bool,
    /// Softmax temperature (default 1.0); must be positive when sampling.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`; 1.0 keeps all.
    pub top_p: f32,
    /// Seed; each sample's generator derives from (seed, prompt index, sample index).
    pub seed: u64,
    /// Samples per prompt (default 1); they share the prompt's prefill.
    pub n: usize,
    /// Stop when the completion's text contains one of these (the text is cut before it).
    pub stop: Vec<String>,
    /// Stop at the tokenizer's end-of-sequence ids (default true; off for benchmarks).
    pub stop_at_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_new_tokens: 64,
            greedy: false,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            n: 1,
            stop: Vec::new(),
            stop_at_eos: true,
        }
    }
}

impl SamplingParams {
    /// Checks the parameters; errors name the option.
    pub fn validate(&self) -> Result<()> {
        let usable_temperature = self.temperature > 0.0 && self.temperature.is_finite();
        if !self.greedy && !usable_temperature {
            return Err(Error::invalid(
                "temperature",
                format!("must be positive, found {}", self.temperature),
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::invalid(
                "top_p",
                format!("must be in (0, 1], found {}", self.top_p),
            ));
        }
        if self.n == 0 {
            return Err(Error::invalid("n", "must be at least 1"));
        }
        if self.max_new_tokens == 0 {
            return Err(Error::invalid("max_new_tokens", "must be at least 1"));
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(Error::invalid("stop", "stop strings must not be empty"));
        }
        Ok(())
    }

    /// The temperature the reported log-probabilities use.
    pub fn logprob_temperature(&self) -> f32 {
        if self.greedy { 1.0 } else { self.temperature }
    }
}

pub(crate) fn log_sum_exp(xs: &[f32]) -> f32 {
    let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return max;
    }
    max + crate::kernels::step::sum_exp(xs, max).ln() as f32
}

/// The first maximum of a row of logits (greedy decoding's choice).
pub(crate) fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best
}

/// The tokens sampling may pick from one row of logits: temperature, then top-k, then top-p,
/// ties broken by id, in the order `sample_token` walks them.
pub(crate) struct Candidates {
    scaled: Vec<f32>,
    lse: f32,
    pub(crate) idx: Vec<usize>,
}

impl Candidates {
    pub(crate) fn new(logits: &[f32], params: &SamplingParams) -> Candidates {
        let t = params.temperature;
        let scaled: Vec<f32> = logits.iter().map(|&x| x / t).collect();
        let lse = log_sum_exp(&scaled);
        let mut c = Candidates {
            idx: (0..scaled.len()).collect(),
            scaled,
            lse,
        };
        let mut idx = std::mem::take(&mut c.idx);
        // Most likely first; ties broken by id so the order is a total order.
        let by_prob = |a: &usize, b: &usize| c.scaled[*b].total_cmp(&c.scaled[*a]).then(a.cmp(b));
        if params.top_k > 0 && params.top_k < idx.len() {
            idx.select_nth_unstable_by(params.top_k - 1, by_prob);
            idx.truncate(params.top_k);
        }
        if params.top_p < 1.0 {
            idx.sort_unstable_by(by_prob);
            let mass: f64 = idx.iter().map(|&i| c.prob(i)).sum();
            let mut cum = 0.0;
            let mut keep = idx.len();
            for (n, &i) in idx.iter().enumerate() {
                cum += c.prob(i);
                if cum >= f64::from(params.top_p) * mass {
                    keep = n + 1;
                    break;
                }
            }
            idx.truncate(keep);
        }
        c.idx = idx;
        c
    }

    /// Probability of token `i` under the temperature-scaled softmax (before truncation).
    pub(crate) fn prob(&self, i: usize) -> f64 {
        f64::from(self.scaled[i] - self.lse).exp()
    }

    /// The candidates' total probability (what truncation renormalises by).
    pub(crate) fn mass(&self) -> f64 {
        self.idx.iter().map(|&i| self.prob(i)).sum()
    }
}

/// Picks a token from one row of logits; returns it and its log-probability.
pub fn sample_token(logits: &[f32], params: &SamplingParams, rng: &mut Rng) -> (i64, f32) {
    if params.greedy {
        let best = argmax(logits);
        return (best as i64, logits[best] - log_sum_exp(logits));
    }
    let c = Candidates::new(logits, params);
    let mut u = rng.uniform() * c.mass();
    let mut chosen = c.idx.last().copied().unwrap_or(0);
    for &i in &c.idx {
        u -= c.prob(i);
        if u < 0.0 {
            chosen = i;
            break;
        }
    }
    (chosen as i64, c.scaled[chosen] - c.lse)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SamplingParams {
        SamplingParams::default()
    }

    #[test]
    fn greedy_takes_first_maximum() {
        let (t, lp) = sample_token(
            &[0.0, 2.0, 2.0, 1.0],
            &SamplingParams {
                greedy: true,
                ..params()
            },
            &mut Rng::new(0),
        );
        assert_eq!(t, 1);
        assert!(lp < 0.0);
    }

    #[test]
    fn top_k_one_is_greedy_and_logprob_is_untruncated() {
        let logits = [0.5, 3.0, 1.0, -1.0];
        let p = SamplingParams {
            top_k: 1,
            ..params()
        };
        let mut rng = Rng::new(3);
        for _ in 0..20 {
            let (t, lp) = sample_token(&logits, &p, &mut rng);
            assert_eq!(t, 1);
            let expected = 3.0 - log_sum_exp(&logits);
            assert!((lp - expected).abs() < 1e-6);
        }
    }

    #[test]
    fn top_p_excludes_the_tail() {
        // Probabilities about 0.665, 0.245, 0.090: top_p 0.8 keeps the first two.
        let logits = [2.0, 1.0, 0.0];
        let p = SamplingParams {
            top_p: 0.8,
            ..params()
        };
        let mut rng = Rng::new(5);
        let mut seen = [0usize; 3];
        for _ in 0..2000 {
            seen[sample_token(&logits, &p, &mut rng).0 as usize] += 1;
        }
        assert_eq!(seen[2], 0);
        assert!(seen[0] > seen[1] && seen[1] > 0);
    }

    #[test]
    fn sampling_follows_the_distribution() {
        let logits = [0.0f32, (3.0f32).ln()];
        let mut rng = Rng::new(11);
        let ones = (0..4000)
            .filter(|_| sample_token(&logits, &params(), &mut rng).0 == 1)
            .count();
        // Expected 3000 of 4000; a 5-sigma band is about ±140.
        assert!((2850..=3150).contains(&ones), "{ones}");
    }

    #[test]
    fn bad_parameters_are_rejected() {
        assert!(
            SamplingParams {
                temperature: 0.0,
                ..params()
            }
            .validate()
            .is_err()
        );
        assert!(
            SamplingParams {
                temperature: 0.0,
                greedy: true,
                ..params()
            }
            .validate()
            .is_ok()
        );
        assert!(
            SamplingParams {
                top_p: 0.0,
                ..params()
            }
            .validate()
            .is_err()
        );
        assert!(SamplingParams { n: 0, ..params() }.validate().is_err());
    }
}
