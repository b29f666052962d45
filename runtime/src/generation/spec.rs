//! Speculative decoding: drafters, verification and the choice of the draft length.
//!
//! A speculative step feeds the target model each row's last token plus `k` drafted tokens in
//! one `forward_cached` call, keeps the longest accepted prefix of the drafts plus one token of
//! the target's own, and rolls the row's KV cache back over the rejected rest
//! (`KvCache::truncate`). This module holds the pieces the engine (`engine.rs`) puts together:
//!
//! * **Drafters.** `NgramIndex` drafts by prompt lookup: the longest suffix (4, 3 or 2 tokens)
//!   of the sample's text so far (prompt and completion) that occurred before is continued
//!   with the tokens that followed it, periodically extended when the match runs into the end
//!   (a repetition loop). A draft model (`load_draft`) is any language model that shares the
//!   target's tokenizer; the engine keeps a KV cache for it with the same rows as the target's.
//! * **Verification.** Drafts of the n-gram drafter, and every draft under greedy decoding,
//!   are point masses: `verify_point` draws the target's token at each position with the same
//!   `sample_token` call and the same generator as decoding without speculation, and accepts
//!   the draft when the two agree. That is rejection sampling with `q` a point mass (accept
//!   with probability `p(d)`; on rejection the token follows `p` without `d`, which is
//!   `norm(max(p − q, 0))`), and because it consumes the generator exactly as plain decoding
//!   does, the text is the same as without speculation. Draft-model drafts under sampling go
//!   through `verify_sampled`: accept `d` with probability `min(1, p(d)/q(d))`, otherwise draw
//!   from `norm(max(p − q, 0))`, where `p` and `q` are the sampling distributions after
//!   temperature, top-k and top-p (`distribution`). Outputs follow the target's distribution
//!   exactly; the text differs from plain decoding (other random numbers are drawn).
//!   Log-probabilities are always the target's, as without speculation.
//! * **Choosing the draft length.** Before each step the engine asks `choose_draft_len` for one
//!   draft length `K` for the batch (rows take `min(K, what they have)`): the `K` that maximises
//!   expected tokens per second, `Σ_rows e(α_r, k_r) / (t(B·(K+1)) + K·t_draft(B))`, where
//!   `e(α, k) = 1 + α + … + α^k` is the expected number of tokens a step emits for a row whose
//!   drafts are accepted with probability `α` (per-sample `Acceptance`, decaying counts), and
//!   `t(n)` is the measured time of a verification step over `n` tokens (`CostModel`, learned
//!   online from every step). Costs beyond the measured range are explored by doubling, and
//!   only when an optimistic estimate promises a clear gain. Large batches make verification
//!   expensive relative to its gain and speculation switches off; as the batch shrinks in the
//!   long tail, longer drafts become cheap and `K` grows.
//!
//! This module must not print, and must not hold engine state beyond a row's own.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use braid_ir::settings::Speculation;

use crate::error::{Error, Result};
use crate::generation::sampling::{Candidates, SamplingParams, argmax, log_sum_exp, sample_token};
use crate::models::model::{Head, LoadOptions, Model};
use crate::models::tokenizer::Tokenizer;
use crate::rng::Rng;

/// Draft length of `ngram` without `:N`.
pub const DEFAULT_NGRAM_DRAFT: usize = 4;
/// Longest draft the engine accepts (`ngram:N`, `EngineOptions::draft_len`).
pub const MAX_DRAFT: usize = braid_ir::settings::MAX_DRAFT as usize;
/// Longest draft the adaptive policy considers with the n-gram drafter (drafts are free).
pub const AUTO_MAX_DRAFT: usize = 16;
/// Longest draft the adaptive policy considers with a draft model (each token costs a pass).
pub const DRAFT_MODEL_MAX_DRAFT: usize = 8;

/// Whether and how the engine speculates.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum SpeculateMode {
    /// Plain decoding: one token per sample per step.
    #[default]
    Off,
    /// Prompt-lookup (n-gram) drafts, with the draft length chosen before every step from
    /// measured costs and acceptance rates (0 where speculation does not pay).
    Auto,
    /// Prompt-lookup drafts of up to `N` tokens at every step where a match exists.
    Ngram(usize),
    /// Drafts from the language model in this directory (it must share the target's
    /// tokenizer), with the draft length chosen per step as in `Auto`.
    Draft(PathBuf),
}

impl SpeculateMode {
    /// Parses `off`, `auto`, `ngram`, `ngram:N` (1 ≤ N ≤ 64) or `draft:DIR`.
    pub fn parse(s: &str) -> Result<SpeculateMode> {
        let plan = Speculation::parse_flag(s, DEFAULT_NGRAM_DRAFT as u32)
            .map_err(|e| Error::invalid("speculate", e))?;
        Ok(SpeculateMode::from_plan(&plan, Path::new("")))
    }

    /// The engine's mode for a plan's speculation; a relative draft directory is read from
    /// `base_dir` (the program's directory).
    pub fn from_plan(s: &Speculation, base_dir: &Path) -> SpeculateMode {
        match s {
            Speculation::Off => SpeculateMode::Off,
            Speculation::Auto => SpeculateMode::Auto,
            Speculation::Ngram { max_draft } => SpeculateMode::Ngram(*max_draft as usize),
            Speculation::Draft { dir } => {
                let p = Path::new(dir);
                SpeculateMode::Draft(if p.is_relative() {
                    base_dir.join(p)
                } else {
                    p.to_path_buf()
                })
            }
        }
    }
}

impl fmt::Display for SpeculateMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SpeculateMode::Off => write!(f, "off"),
            SpeculateMode::Auto => write!(f, "auto"),
            SpeculateMode::Ngram(n) => write!(f, "ngram:{n}"),
            SpeculateMode::Draft(dir) => write!(f, "draft:{}", dir.display()),
        }
    }
}

/// What one decode step did (the engine keeps one record per step; see
/// `Generation::step_log`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepRecord {
    /// Rows (running samples) in the step.
    pub rows: usize,
    /// The batch's draft length `K` (0: a plain step).
    pub draft_len: usize,
    /// Drafted tokens verified (the sum of the rows' draft lengths).
    pub drafted: usize,
    /// Drafted tokens accepted.
    pub accepted: usize,
    /// Tokens appended to samples (accepted drafts plus one per row, up to where samples stop).
    pub emitted: usize,
    /// Wall time of the step, drafting and verification included.
    pub secs: f64,
}

// ---------------------------------------------------------------------------------------------
// The n-gram (prompt lookup) drafter.

/// Longest and shortest suffix the n-gram drafter matches.
const NGRAM_MAX: usize = 4;
const NGRAM_MIN: usize = 2;

fn ngram_key(tokens: &[i64]) -> u64 {
    let mut h = tokens.len() as u64;
    for &t in tokens {
        h = (h.rotate_left(7) ^ t as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    h
}

/// A sample's text (prompt and completion) with, for every n-gram of 2 to 4 tokens, where the
/// most recent occurrence that has a continuation ends.
#[derive(Debug, Clone, Default)]
pub struct NgramIndex {
    seq: Vec<i64>,
    /// n-gram key → position of the token that followed its latest occurrence.
    next: HashMap<u64, u32>,
}

impl NgramIndex {
    /// An index of `tokens` (usually the prompt).
    pub fn new(tokens: &[i64]) -> Self {
        let mut ix = NgramIndex {
            seq: Vec::with_capacity(tokens.len() + 64),
            next: HashMap::with_capacity(tokens.len() * 3),
        };
        for &t in tokens {
            ix.push(t);
        }
        ix
    }

    /// Appends a token: the n-grams ending just before it now have a continuation.
    pub fn push(&mut self, token: i64) {
        self.seq.push(token);
        let i = self.seq.len() - 1;
        for n in NGRAM_MIN..=NGRAM_MAX.min(i) {
            self.next.insert(ngram_key(&self.seq[i - n..i]), i as u32);
        }
    }

    /// Up to `max` drafted tokens: the continuation of the longest suffix seen before, or
    /// nothing.
    pub fn draft(&self, max: usize) -> Vec<i64> {
        let len = self.seq.len();
        if max == 0 {
            return Vec::new();
        }
        for n in (NGRAM_MIN..=NGRAM_MAX.min(len)).rev() {
            let suffix = &self.seq[len - n..];
            let Some(&at) = self.next.get(&ngram_key(suffix)) else {
                continue;
            };
            let at = at as usize;
            if at < n || &self.seq[at - n..at] != suffix {
                continue; // A hash collision.
            }
            // Copy what followed; past the end the copy reads its own output, which continues
            // a repetition loop with its period.
            let mut out: Vec<i64> = Vec::with_capacity(max);
            for j in 0..max {
                let idx = at + j;
                let t = if idx < len {
                    self.seq[idx]
                } else {
                    out[idx - len]
                };
                out.push(t);
            }
            return out;
        }
        Vec::new()
    }
}

// ---------------------------------------------------------------------------------------------
// Acceptance rates and the cost model.

/// Acceptance rate a sample starts with, and how many observations that prior is worth.
const PRIOR_RATE: f64 = 0.4;
const PRIOR_WEIGHT: f64 = 1.0;
/// Old counts keep this weight when a new verification is counted (acceptance changes fast:
/// a sample falls into a loop or leaves one).
const OBSERVED_DECAY: f64 = 0.7;
/// Per step in which a sample had a draft but did not speculate, its counts fade by this, so
/// its estimate drifts back to the prior and speculation is tried again now and then.
const IDLE_DECAY: f64 = 0.97;

/// A sample's estimated probability that a drafted token is accepted: verified drafts are
/// Bernoulli trials up to the first rejection; counts decay so the estimate follows changes.
#[derive(Debug, Clone, Copy, Default)]
pub struct Acceptance {
    accepted: f64,
    trials: f64,
}

impl Acceptance {
    /// The current estimate.
    pub fn rate(&self) -> f64 {
        (self.accepted + PRIOR_WEIGHT * PRIOR_RATE) / (self.trials + PRIOR_WEIGHT)
    }

    /// Counts a verification of `drafted` tokens of which the first `accepted` were accepted.
    pub fn observe(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.accepted = self.accepted * OBSERVED_DECAY + accepted as f64;
        self.trials = self.trials * OBSERVED_DECAY
            + accepted as f64
            + if accepted < drafted { 1.0 } else { 0.0 };
    }

    /// An optimistic estimate: the rate plus one standard deviation of a Beta posterior with
    /// these counts. A sample that has not been verified lately (few counts) gets a high
    /// value, so the policy probes it with a short draft instead of trusting the prior forever
    /// once the step costs are known (acceptance is only learned by drafting).
    pub fn optimistic(&self) -> f64 {
        let m = self.rate();
        let n = self.trials + PRIOR_WEIGHT;
        (m + (m * (1.0 - m) / (n + 1.0)).sqrt()).min(1.0)
    }

    /// A step passed in which the sample could have speculated but did not.
    pub fn idle(&mut self) {
        self.accepted *= IDLE_DECAY;
        self.trials *= IDLE_DECAY;
    }
}

/// Expected tokens a step emits for a row with `k` drafted tokens each accepted with
/// probability `alpha` (until the first rejection), plus the target's own token:
/// `1 + α + … + α^k`.
pub fn expected_tokens(alpha: f64, k: usize) -> f64 {
    let mut sum = 1.0;
    let mut term = 1.0;
    for _ in 0..k {
        term *= alpha;
        sum += term;
    }
    sum
}

/// Weight of a new measurement in a cost point's running mean.
const COST_EMA: f64 = 0.3;

/// Measured seconds of a forward step as a function of the tokens it processes (rows × tokens
/// per row), learned online: one running mean per token count seen, linear interpolation in
/// between.
#[derive(Debug, Clone, Default)]
pub struct CostModel {
    points: BTreeMap<usize, f64>,
}

impl CostModel {
    /// Records that a step over `tokens` tokens took `secs`.
    pub fn observe(&mut self, tokens: usize, secs: f64) {
        if !(secs.is_finite() && secs >= 0.0) || tokens == 0 {
            return;
        }
        self.points
            .entry(tokens)
            .and_modify(|t| *t += COST_EMA * (secs - *t))
            .or_insert(secs);
    }

    /// The largest token count measured.
    pub fn max_tokens(&self) -> Option<usize> {
        self.points.keys().next_back().copied()
    }

    /// Estimated seconds for `tokens` tokens when that is within the measured range (below
    /// it, the smallest measurement: a step never costs less than a smaller one did); `None`
    /// above the range.
    pub fn predict(&self, tokens: usize) -> Option<f64> {
        let below = self.points.range(..=tokens).next_back();
        let above = self.points.range(tokens..).next();
        match (below, above) {
            (Some((&n0, &t0)), Some((&n1, &t1))) => {
                if n1 == n0 {
                    Some(t0)
                } else {
                    let w = (tokens - n0) as f64 / (n1 - n0) as f64;
                    Some(t0 + w * (t1 - t0))
                }
            }
            (None, Some((_, &t1))) => Some(t1),
            _ => None,
        }
    }

    /// A lower bound for `tokens` above the measured range: the largest measurement (costs
    /// grow with tokens). `None` without measurements.
    pub fn optimistic(&self, tokens: usize) -> Option<f64> {
        self.predict(tokens)
            .or_else(|| self.points.values().next_back().copied())
    }
}

/// What the policy knows about one row before a step.
#[derive(Debug, Clone, Copy)]
pub struct RowOutlook {
    /// Estimated acceptance rate.
    pub alpha: f64,
    /// An optimistic acceptance rate (`Acceptance::optimistic`), for probing.
    pub alpha_hi: f64,
    /// Most tokens the row can draft this step (0: none available).
    pub available: usize,
}

/// How much better an optimistic estimate must be before the policy explores a draft length
/// whose cost it has not measured.
const EXPLORE_MARGIN: f64 = 1.1;
/// How much better than plain decoding speculation must look to be chosen (measurements on a
/// shared machine are noisy).
const MIN_GAIN: f64 = 1.03;
/// Longest draft of a probe: a step taken because optimistic acceptance rates make drafting
/// look worthwhile when the estimates do not. Short, so a probe of text that does not repeat
/// costs little.
const PROBE_MAX: usize = 2;

/// Chooses the batch's draft length, up to `max_len`: the one with the most expected tokens
/// per second under the measured costs (`target` per verification step, `draft` per drafting
/// pass of the draft model, `None` for the n-gram drafter, whose drafts cost nothing
/// measurable). Returns 0 when plain decoding is expected to be faster or nothing can be
/// drafted. Lengths whose cost is not measured yet are explored by doubling; when nothing pays
/// under the estimated acceptance rates but would under the optimistic ones, a short probe
/// (at most `PROBE_MAX` tokens) is taken so the estimates can learn.
pub fn choose_draft_len(
    rows: &[RowOutlook],
    max_len: usize,
    target: &CostModel,
    draft: Option<&CostModel>,
) -> usize {
    let b = rows.len();
    let longest = rows.iter().map(|r| r.available).max().unwrap_or(0);
    let max_len = max_len.min(longest);
    if b == 0 || max_len == 0 {
        return 0;
    }
    // The plain step's cost must be known (the first step always measures it).
    let Some(plain_cost) = target.predict(b) else {
        return 0;
    };
    let plain = b as f64 / plain_cost.max(1e-9);
    let draft_pass = match draft {
        Some(d) => d.predict(b).or_else(|| d.optimistic(b)),
        None => Some(0.0),
    };
    let choice = best_draft_len(rows, |r| r.alpha, max_len, target, draft_pass, plain);
    if choice.explore_k > 0 && choice.explore_best > choice.best.max(plain) * EXPLORE_MARGIN {
        // Measure a step at most twice as large as the largest measured one.
        let max_n = target.max_tokens().unwrap_or(b);
        let reach = (2 * max_n / b).saturating_sub(1).max(1);
        return choice.explore_k.min(reach).max(choice.best_k);
    }
    if choice.best_k == 0 {
        // Nothing pays under the estimates; probe rows whose acceptance is uncertain if their
        // optimistic rates would make a short draft pay (measured costs only).
        let probe = best_draft_len(
            rows,
            |r| r.alpha_hi,
            max_len.min(PROBE_MAX),
            target,
            draft_pass,
            plain,
        );
        return probe.best_k;
    }
    choice.best_k
}

/// The outcome of scoring draft lengths `1..=max_len`.
struct Choice {
    /// The best length with a measured cost (0: plain decoding) and its expected tokens per
    /// second (at least `plain × MIN_GAIN` to be chosen).
    best_k: usize,
    best: f64,
    /// The best length whose cost is not measured yet, by an optimistic cost.
    explore_k: usize,
    explore_best: f64,
}

fn best_draft_len(
    rows: &[RowOutlook],
    alpha: impl Fn(&RowOutlook) -> f64,
    max_len: usize,
    target: &CostModel,
    draft_pass: Option<f64>,
    plain: f64,
) -> Choice {
    let b = rows.len();
    let plain_cost = b as f64 / plain;
    let mut c = Choice {
        best_k: 0,
        best: plain * MIN_GAIN,
        explore_k: 0,
        explore_best: 0.0,
    };
    for k in 1..=max_len {
        let tokens: f64 = rows
            .iter()
            .map(|r| expected_tokens(alpha(r), k.min(r.available)))
            .sum();
        let n = b * (k + 1);
        // Drafting `k` tokens takes `k` passes of the draft model (the first also catches up
        // on the tokens of the previous step).
        let drafting = draft_pass.map(|t| t * k as f64);
        match (target.predict(n), drafting) {
            (Some(t), Some(d)) => {
                let rate = tokens / (t + d).max(1e-9);
                if rate > c.best {
                    (c.best_k, c.best) = (k, rate);
                }
            }
            (t, d) => {
                let t = t.or_else(|| target.optimistic(n)).unwrap_or(plain_cost);
                let rate = tokens / (t + d.unwrap_or(0.0)).max(1e-9);
                if rate > c.explore_best {
                    (c.explore_k, c.explore_best) = (k, rate);
                }
            }
        }
    }
    c
}

// ---------------------------------------------------------------------------------------------
// Verification.

/// The distribution `sample_token` draws from for these logits (temperature, then top-k,
/// then top-p, ties broken by id), as probabilities over the vocabulary; a point mass on the
/// first maximum when greedy.
pub fn distribution(logits: &[f32], params: &SamplingParams) -> Vec<f64> {
    let mut out = vec![0.0; logits.len()];
    if logits.is_empty() {
        return out;
    }
    if params.greedy {
        out[argmax(logits)] = 1.0;
        return out;
    }
    let c = Candidates::new(logits, params);
    let total = c.mass();
    for &i in &c.idx {
        out[i] = c.prob(i) / total.max(f64::MIN_POSITIVE);
    }
    out
}

/// Log-probability of `token` that the engine reports: `log_softmax(logits / T)` with T = 1
/// when greedy, as `sample_token` computes it.
fn reported_logprob(logits: &[f32], params: &SamplingParams, token: usize) -> f32 {
    let t = params.logprob_temperature();
    let scaled: Vec<f32> = logits.iter().map(|&x| x / t).collect();
    scaled[token] - log_sum_exp(&scaled)
}

/// Verifies point-mass drafts (n-gram drafts, or any drafts under greedy decoding).
/// `target` holds `drafts.len() + 1` rows of `vocab` logits: row `j` predicts the token after
/// the `j`-th draft. At each position the target's token is drawn exactly as plain decoding
/// draws it; the draft is accepted when they agree, and the first disagreement (or the row
/// after the last draft) ends the step with the target's token. Returns the tokens to append
/// with their log-probabilities.
pub fn verify_point(
    target: &[f32],
    vocab: usize,
    drafts: &[i64],
    params: &SamplingParams,
    rng: &mut Rng,
) -> Vec<(i64, f32)> {
    let mut out = Vec::with_capacity(drafts.len() + 1);
    for j in 0..=drafts.len() {
        let (tok, lp) = sample_token(&target[j * vocab..(j + 1) * vocab], params, rng);
        out.push((tok, lp));
        if j == drafts.len() || tok != drafts[j] {
            break;
        }
    }
    out
}

/// Draws a token from unnormalised non-negative weights.
fn draw(weights: &[f64], rng: &mut Rng) -> usize {
    let total: f64 = weights.iter().sum();
    let mut u = rng.uniform() * total;
    let mut last = 0;
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            last = i;
            u -= w;
            if u < 0.0 {
                return i;
            }
        }
    }
    last
}

/// Verifies drafts sampled from a draft model by rejection sampling. `target`: `k + 1` rows of
/// `vocab` logits (as in `verify_point`); `draft`: `k` rows of `draft_vocab` logits, row `j`
/// the draft model's logits that `drafts[j]` was sampled from (with the same `params`). Draft
/// `j` is accepted with probability `min(1, p(d)/q(d))`; the first rejection ends the step with
/// a token drawn from `norm(max(p − q, 0))`; if all are accepted the target adds a token from
/// its row `k`. The result follows the target's sampling distribution exactly.
pub fn verify_sampled(
    target: &[f32],
    vocab: usize,
    draft: &[f32],
    draft_vocab: usize,
    drafts: &[i64],
    params: &SamplingParams,
    rng: &mut Rng,
) -> Vec<(i64, f32)> {
    if params.greedy {
        return verify_point(target, vocab, drafts, params, rng);
    }
    let mut out = Vec::with_capacity(drafts.len() + 1);
    for (j, &d) in drafts.iter().enumerate() {
        let row = &target[j * vocab..(j + 1) * vocab];
        let p = distribution(row, params);
        let q = distribution(&draft[j * draft_vocab..(j + 1) * draft_vocab], params);
        let d = usize::try_from(d).unwrap_or(usize::MAX);
        let pd = p.get(d).copied().unwrap_or(0.0);
        let qd = q.get(d).copied().unwrap_or(0.0);
        // Accept with probability min(1, p/q): u·q < p.
        if rng.uniform() * qd < pd {
            out.push((d as i64, reported_logprob(row, params, d)));
            continue;
        }
        let residual: Vec<f64> = p
            .iter()
            .enumerate()
            .map(|(x, &px)| (px - q.get(x).copied().unwrap_or(0.0)).max(0.0))
            .collect();
        // If p ≤ q everywhere (only by rounding, since then rejection is impossible), fall
        // back to p itself.
        let x = if residual.iter().sum::<f64>() > 0.0 {
            draw(&residual, rng)
        } else {
            draw(&p, rng)
        };
        out.push((x as i64, reported_logprob(row, params, x)));
        return out;
    }
    let k = drafts.len();
    out.push(sample_token(
        &target[k * vocab..(k + 1) * vocab],
        params,
        rng,
    ));
    out
}

// ---------------------------------------------------------------------------------------------
// The draft model.

/// Text whose token ids the draft model's tokenizer must reproduce: a tokenizer shared with
/// the target (the ids are compared, so a draft model cannot propose what the target reads
/// differently).
const TOKENIZER_PROBE: &str =
    "The quick brown fox jumps over the lazy dog. 0123456789 ¿Qué tal? 日本語 \n\t{}";

/// Loads the draft model in `dir` onto the target's device and dtype, and checks that it can
/// draft for `target`: a language model, the same tokenizer (the same ids for a probe text
/// and the same end-of-sequence ids), a vocabulary and a context at least as large.
pub fn load_draft(dir: &Path, target: &Model, tokenizer: &Tokenizer) -> Result<Model> {
    let draft = Model::load(
        dir,
        &LoadOptions {
            head: Head::Lm,
            dtype: Some(target.kind()),
            device: target.device(),
        },
    )?;
    let mismatch = |what: String| Err(Error::file(dir, what));
    let draft_tok = Tokenizer::from_dir(dir, draft.config())?;
    let a = tokenizer.encode(TOKENIZER_PROBE, true)?;
    let b = draft_tok.encode(TOKENIZER_PROBE, true)?;
    if a != b || tokenizer.special().eos != draft_tok.special().eos {
        return mismatch(format!(
            "the draft model's tokenizer differs from the target's ({})",
            target.source().display()
        ));
    }
    let (dc, tc) = (draft.config(), target.config());
    if dc.max_position_embeddings < tc.max_position_embeddings {
        return mismatch(format!(
            "the draft model takes {} positions, fewer than the target's {}",
            dc.max_position_embeddings, tc.max_position_embeddings
        ));
    }
    if dc.vocab_size < tc.vocab_size {
        // The draft model would have no logits for some of the target's tokens (it reads the
        // target's tokens while catching up).
        return mismatch(format!(
            "the draft model's vocabulary ({}) is smaller than the target's ({})",
            dc.vocab_size, tc.vocab_size
        ));
    }
    Ok(draft)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_print_back() {
        for s in [
            "off",
            "auto",
            "ngram:4",
            "ngram:1",
            "ngram:64",
            "draft:/tmp/m",
        ] {
            assert_eq!(SpeculateMode::parse(s).unwrap().to_string(), s);
        }
        assert_eq!(
            SpeculateMode::parse("ngram").unwrap(),
            SpeculateMode::Ngram(DEFAULT_NGRAM_DRAFT)
        );
        for bad in [
            "", "on", "ngram:0", "ngram:65", "ngram:x", "ngram:", "draft:", "Auto",
        ] {
            let e = SpeculateMode::parse(bad).unwrap_err().to_string();
            assert!(e.starts_with("speculate: "), "{e}");
        }
    }

    #[test]
    fn ngram_drafts_continue_the_latest_match_and_loops() {
        let ix = NgramIndex::new(&[1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2]);
        // Suffix [1, 2] last occurred at 4..6, followed by 3, 7, 8, 1, 2 …
        assert_eq!(ix.draft(4), vec![3, 7, 8, 1]);
        // A loop of period 3: the copy reads its own output past the end.
        let ix = NgramIndex::new(&[5, 6, 4, 5, 6, 4, 5]);
        assert_eq!(ix.draft(7), vec![6, 4, 5, 6, 4, 5, 6]);
        // No earlier occurrence of any suffix of 2 or more tokens: no draft.
        let ix = NgramIndex::new(&[1, 2, 3, 4, 5]);
        assert!(ix.draft(4).is_empty());
        assert!(NgramIndex::new(&[1]).draft(3).is_empty());
        // Incremental pushes give the same index.
        let mut inc = NgramIndex::new(&[]);
        for t in [5, 6, 4, 5, 6, 4, 5] {
            inc.push(t);
        }
        assert_eq!(inc.draft(5), vec![6, 4, 5, 6, 4]);
    }

    #[test]
    fn expected_tokens_is_a_geometric_sum() {
        assert_eq!(expected_tokens(0.5, 0), 1.0);
        assert!((expected_tokens(0.5, 3) - 1.875).abs() < 1e-12);
        assert_eq!(expected_tokens(1.0, 4), 5.0);
        let mut a = Acceptance::default();
        assert!((a.rate() - PRIOR_RATE).abs() < 1e-12);
        for _ in 0..20 {
            a.observe(4, 4);
        }
        assert!(a.rate() > 0.95);
        for _ in 0..20 {
            a.observe(4, 0);
        }
        assert!(a.rate() < 0.1);
        for _ in 0..500 {
            a.idle();
        }
        assert!((a.rate() - PRIOR_RATE).abs() < 0.01);
    }

    fn cost(points: &[(usize, f64)]) -> CostModel {
        let mut c = CostModel::default();
        for &(n, t) in points {
            c.observe(n, t);
        }
        c
    }

    fn rows(b: usize, alpha: f64, available: usize) -> Vec<RowOutlook> {
        vec![
            RowOutlook {
                alpha,
                alpha_hi: alpha,
                available
            };
            b
        ]
    }

    #[test]
    fn cost_model_interpolates_and_knows_its_range() {
        let c = cost(&[(8, 1.0), (16, 2.0)]);
        assert_eq!(c.predict(12), Some(1.5));
        assert_eq!(c.predict(4), Some(1.0));
        assert_eq!(c.predict(17), None);
        assert_eq!(c.optimistic(100), Some(2.0));
        assert_eq!(CostModel::default().predict(1), None);
    }

    #[test]
    fn speculation_grows_as_the_batch_shrinks_and_stops_when_it_costs_more() {
        // Fixed overhead 1 ms plus 10 µs per token: cheap per token at small batches only.
        let mut c = CostModel::default();
        for n in 1..=1100 {
            c.observe(n, 1e-3 + 1e-5 * n as f64);
        }
        let big = choose_draft_len(&rows(64, 0.8, 16), 16, &c, None);
        let small = choose_draft_len(&rows(2, 0.8, 16), 16, &c, None);
        assert!(small > big, "{small} vs {big}");
        assert!(small >= 8);
        // Drafts that are never accepted are never worth a longer step.
        assert_eq!(choose_draft_len(&rows(2, 0.0, 16), 16, &c, None), 0);
        // Cost proportional to tokens: speculation can only lose unless acceptance is perfect.
        let mut lin = CostModel::default();
        for n in 1..=1100 {
            lin.observe(n, 1e-5 * n as f64);
        }
        assert_eq!(choose_draft_len(&rows(64, 0.9, 16), 16, &lin, None), 0);
        // Nothing to draft, nothing measured: plain decoding.
        assert_eq!(choose_draft_len(&rows(4, 0.9, 0), 16, &c, None), 0);
        assert_eq!(
            choose_draft_len(&rows(4, 0.9, 8), 16, &CostModel::default(), None),
            0
        );
        // A draft model as costly as the target never pays.
        assert_eq!(choose_draft_len(&rows(2, 0.8, 8), 8, &c, Some(&c)), 0);
    }

    #[test]
    fn unmeasured_lengths_are_explored_by_doubling() {
        // Only the plain step of 4 rows is measured; a high acceptance rate makes a longer
        // step look worth trying: the policy tries one twice as large.
        let c = cost(&[(4, 1e-3)]);
        assert_eq!(choose_draft_len(&rows(4, 0.9, 16), 16, &c, None), 1);
        let c = cost(&[(4, 1e-3), (8, 1.05e-3)]);
        assert_eq!(choose_draft_len(&rows(4, 0.9, 16), 16, &c, None), 3);
    }

    #[test]
    fn uncertain_rows_are_probed_with_short_drafts() {
        // A step of 2 tokens per row costs 1.47 plain steps: at the prior rate (0.4) drafting
        // does not pay, but a sample never verified might repeat its prompt: probe it.
        let mut c = CostModel::default();
        for k in 0..=16 {
            c.observe(32 * (k + 1), 10e-3 + 4.7e-3 * k as f64);
        }
        let fresh = Acceptance::default();
        assert!(fresh.optimistic() > fresh.rate());
        let outlook = |a: &Acceptance| RowOutlook {
            alpha: a.rate(),
            alpha_hi: a.optimistic(),
            available: 8,
        };
        let k = choose_draft_len(&vec![outlook(&fresh); 32], 16, &c, None);
        assert!((1..=PROBE_MAX).contains(&k), "{k}");
        // At the prior rate alone drafting does not pay: without optimism nothing is drafted.
        let prior_only = RowOutlook {
            alpha_hi: fresh.rate(),
            ..outlook(&fresh)
        };
        assert_eq!(choose_draft_len(&vec![prior_only; 32], 16, &c, None), 0);
        // Once the drafts are seen to be rejected, the probing stops.
        let mut bad = Acceptance::default();
        for _ in 0..3 {
            bad.observe(k, 0);
        }
        assert_eq!(choose_draft_len(&vec![outlook(&bad); 32], 16, &c, None), 0);
        // Accepted drafts make speculation the policy's own choice, beyond the probe length.
        let mut good = Acceptance::default();
        for _ in 0..3 {
            good.observe(4, 4);
        }
        assert!(choose_draft_len(&vec![outlook(&good); 32], 16, &c, None) > PROBE_MAX);
    }

    fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn distribution_matches_sample_token() {
        let logits = [0.3f32, 2.0, 1.0, -1.0, 2.0, 0.5];
        for p in [
            params(1.0, 0, 1.0),
            params(0.7, 3, 1.0),
            params(1.3, 0, 0.8),
            params(0.5, 4, 0.9),
        ] {
            let dist = distribution(&logits, &p);
            assert!((dist.iter().sum::<f64>() - 1.0).abs() < 1e-9);
            let mut rng = Rng::new(17);
            let mut seen = [0usize; 6];
            let draws = 20_000;
            for _ in 0..draws {
                seen[sample_token(&logits, &p, &mut rng).0 as usize] += 1;
            }
            for (i, &c) in seen.iter().enumerate() {
                let expect = dist[i] * draws as f64;
                assert!(
                    (c as f64 - expect).abs() <= 5.0 * expect.sqrt() + 1.0,
                    "{p:?} token {i}: {c} vs {expect}"
                );
            }
        }
    }

    #[test]
    fn rejection_sampling_follows_the_target() {
        // Target and draft disagree strongly; the verified first token follows the target.
        let target = [2.0f32, 0.0, 1.0, -1.0, 0.5, 0.5, 0.5, 0.5];
        let draft = [-1.0f32, 2.0, 0.0, 1.0];
        let p = params(1.0, 0, 1.0);
        let want = distribution(&target[..4], &p);
        let q = distribution(&draft, &p);
        let mut rng = Rng::new(5);
        let mut seen = [0usize; 4];
        let draws = 20_000;
        let mut accepted = 0;
        for _ in 0..draws {
            let (d, _) = sample_token(&draft, &p, &mut rng);
            let out = verify_sampled(&target, 4, &draft, 4, &[d], &p, &mut rng);
            seen[out[0].0 as usize] += 1;
            if out.len() == 2 {
                accepted += 1;
            }
        }
        for i in 0..4 {
            let expect = want[i] * draws as f64;
            assert!(
                (seen[i] as f64 - expect).abs() <= 5.0 * expect.sqrt() + 1.0,
                "token {i}: {} vs {expect}",
                seen[i]
            );
        }
        // Acceptance probability is Σ min(p, q).
        let overlap: f64 = want.iter().zip(&q).map(|(a, b)| a.min(*b)).sum();
        let rate = accepted as f64 / draws as f64;
        assert!((rate - overlap).abs() < 0.02, "{rate} vs {overlap}");
    }

    #[test]
    fn point_verification_draws_what_plain_decoding_draws() {
        let target: Vec<f32> = (0..3 * 5).map(|i| ((i * 7) % 5) as f32 * 0.4).collect();
        let p = params(0.8, 0, 1.0);
        for seed in 0..50 {
            let mut plain = Rng::new(seed);
            let plain_tokens: Vec<i64> = (0..3)
                .map(|j| sample_token(&target[j * 5..(j + 1) * 5], &p, &mut plain).0)
                .collect();
            // Drafting exactly the plain tokens accepts all of them, plus a bonus token.
            let mut rng = Rng::new(seed);
            let out = verify_point(&target, 5, &plain_tokens[..2], &p, &mut rng);
            assert_eq!(out.iter().map(|x| x.0).collect::<Vec<_>>(), plain_tokens);
            // A wrong first draft gives the plain first token and stops.
            let wrong = (plain_tokens[0] + 1) % 5;
            let mut rng = Rng::new(seed);
            let out = verify_point(&target, 5, &[wrong, 0], &p, &mut rng);
            assert_eq!(
                out.iter().map(|x| x.0).collect::<Vec<_>>(),
                vec![plain_tokens[0]]
            );
        }
    }
}
