//! The generation engine: prompts in, samples out, as a stream.
//!
//! A `Generation` holds a batch of at most `max_batch` running samples in one `KvCache`.
//! Each `next()` admits waiting samples into free rows, then decodes one token for every
//! running sample, and yields samples the moment they finish, so a consumer (the executor's
//! inference workers) can start on early samples while long ones still decode. Admission is
//! continuous: a finished sample frees its row and the next waiting sample takes it.
//!
//! The `n` samples of a prompt share its prefill: the prompt is run once (prompts are
//! prefilled in right-padded batches), its cache row is kept until all its samples are
//! admitted, and each sample gets a copy. Sample `(p, s)` draws from its own generator,
//! `Rng::for_sample(seed, p, s)`, so its text does not depend on the batch it ran in (test
//! `same_seed_same_text_whatever_the_batch`).
//!
//! Speculative decoding (a later issue) plugs in at `decode_step`: feed each row its last token
//! plus k drafted tokens through `Model::forward_cached` (which appends any number of tokens
//! per row and returns the hidden state of each), accept a prefix, and roll each row back with
//! `KvCache::truncate`.
//!
//! This module must not print, and must not tokenize more than the stop-string check needs.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::thread;

use tch::{Kind, Tensor};

use crate::cache::KvCache;
use crate::error::{Error, Result};
use crate::model::{Head, Model};
use crate::rng::Rng;
use crate::sampling::{SamplingParams, sample_token};
use crate::tokenizer::Tokenizer;

/// Engine settings that do not change the result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineOptions {
    /// Most samples decoded together (rows of the KV cache).
    pub max_batch: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions { max_batch: 32 }
    }
}

/// Why a sample stopped.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// It produced an end-of-sequence token (included in `token_ids`).
    Eos,
    /// Its text reached a stop string (the text is cut before it; the tokens are kept).
    Stop,
    /// It reached `max_new_tokens` or the model's longest sequence.
    Length,
}

/// One finished completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Index of the prompt in the request.
    pub prompt_index: usize,
    /// Which of the prompt's `n` samples this is.
    pub sample_index: usize,
    /// Generated token ids (an end-of-sequence token is included).
    pub token_ids: Vec<i64>,
    /// Log-probability of each generated token (see `sampling`).
    pub logprobs: Vec<f32>,
    /// The completion's text (special tokens removed, cut before a stop string).
    pub text: String,
    pub finish: FinishReason,
}

struct Running {
    prompt: usize,
    sample: usize,
    rng: Rng,
    tokens: Vec<i64>,
    logprobs: Vec<f32>,
    /// Generated tokens allowed for this sample (`max_new_tokens`, capped by the model's length).
    budget: usize,
}

/// Prefilled prompts whose samples are not all admitted yet.
struct Prefilled {
    cache: KvCache,
    /// Per cache row: prompt index, logits after the prompt, samples still to admit.
    rows: Vec<(usize, Vec<f32>, usize)>,
}

/// A running generation request: an iterator over finished samples, in finishing order.
pub struct Generation<'m> {
    model: &'m Model,
    tokenizer: &'m Tokenizer,
    params: SamplingParams,
    options: EngineOptions,
    prompts: Vec<Vec<i64>>,
    eos: Vec<i64>,
    /// Samples not yet admitted, in order.
    waiting: VecDeque<(usize, usize)>,
    prefilled: Vec<Prefilled>,
    cache: KvCache,
    running: Vec<Running>,
    done: VecDeque<Sample>,
    failed: bool,
}

/// Starts generating `params.n` samples for each prompt (token ids). Nothing runs until the
/// first `next()`.
pub fn generate_stream<'m>(
    model: &'m Model,
    tokenizer: &'m Tokenizer,
    prompts: Vec<Vec<i64>>,
    params: SamplingParams,
    options: EngineOptions,
) -> Result<Generation<'m>> {
    params.validate()?;
    if options.max_batch == 0 {
        return Err(Error::invalid("max_batch", "must be at least 1"));
    }
    if model.head() != Head::Lm {
        return Err(Error::invalid(
            model.source().display().to_string(),
            "generation needs a language-model head",
        ));
    }
    let max_len = model.config().max_position_embeddings;
    for (i, p) in prompts.iter().enumerate() {
        if p.is_empty() {
            return Err(Error::invalid(format!("prompt {i}"), "is empty"));
        }
        if p.len() as i64 >= max_len {
            return Err(Error::invalid(
                format!("prompt {i}"),
                format!(
                    "has {} tokens; the model takes at most {max_len} in all",
                    p.len()
                ),
            ));
        }
        model.check_ids(p, &format!("prompt {i}"))?;
    }
    let waiting = (0..prompts.len())
        .flat_map(|p| (0..params.n).map(move |s| (p, s)))
        .collect();
    let eos = if params.stop_at_eos {
        tokenizer.special().eos.clone()
    } else {
        Vec::new()
    };
    Ok(Generation {
        model,
        tokenizer,
        params,
        options,
        prompts,
        eos,
        waiting,
        prefilled: Vec::new(),
        cache: model.new_cache(0),
        running: Vec::new(),
        done: VecDeque::new(),
        failed: false,
    })
}

/// Generates all samples and returns them ordered by (prompt, sample).
pub fn generate(
    model: &Model,
    tokenizer: &Tokenizer,
    prompts: Vec<Vec<i64>>,
    params: SamplingParams,
    options: EngineOptions,
) -> Result<Vec<Sample>> {
    let mut out =
        generate_stream(model, tokenizer, prompts, params, options)?.collect::<Result<Vec<_>>>()?;
    out.sort_by_key(|s| (s.prompt_index, s.sample_index));
    Ok(out)
}

/// Runs a generation on its own thread (which owns the model and tokenizer) and sends each
/// sample through a channel as soon as it finishes; the thread hands the model and tokenizer
/// back when done. This is how the executor overlaps generation with inference.
pub fn spawn_generation(
    model: Model,
    tokenizer: Tokenizer,
    prompts: Vec<Vec<i64>>,
    params: SamplingParams,
    options: EngineOptions,
) -> (
    mpsc::Receiver<Result<Sample>>,
    thread::JoinHandle<(Model, Tokenizer)>,
) {
    let (tx, rx) = mpsc::channel();
    let handle = thread::spawn(move || {
        match generate_stream(&model, &tokenizer, prompts, params, options) {
            Ok(stream) => {
                for item in stream {
                    if tx.send(item).is_err() {
                        break; // The receiver hung up: stop generating.
                    }
                }
            }
            Err(e) => {
                let _ = tx.send(Err(e));
            }
        }
        (model, tokenizer)
    });
    (rx, handle)
}

/// Most padding a prefill chunk may carry, as a share of its real tokens: prompts are grouped
/// by length so that right-padding does not waste much of the prefill's compute.
const MAX_PREFILL_PADDING: f64 = 0.1;

/// Splits prompts (indices into `prompts`) into prefill batches of at most `max_batch`,
/// grouping similar lengths: sorted by length, a batch closes when adding the next prompt
/// would make its padding exceed `MAX_PREFILL_PADDING` of its tokens.
fn prefill_chunks(prompts: &[Vec<i64>], which: &[usize], max_batch: usize) -> Vec<Vec<usize>> {
    let mut sorted = which.to_vec();
    sorted.sort_by_key(|&p| (prompts[p].len(), p));
    let mut chunks: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut tokens = 0usize;
    for p in sorted {
        let len = prompts[p].len();
        // Sorted ascending, so `len` is the longest in the chunk if `p` joins.
        let padded = len * (current.len() + 1);
        let fits = current.len() < max_batch
            && (padded - (tokens + len)) as f64 <= MAX_PREFILL_PADDING * (tokens + len) as f64;
        if !fits && !current.is_empty() {
            chunks.push(std::mem::take(&mut current));
            tokens = 0;
        }
        current.push(p);
        tokens += len;
    }
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
}

/// Copies logits `[rows, V]` to the host as one flat vector of `rows × V` values.
fn to_host(logits: &Tensor) -> Result<Vec<f32>> {
    let flat = logits
        .to_kind(Kind::Float)
        .to_device(tch::Device::Cpu)
        .reshape([-1]);
    Ok(Vec::<f32>::try_from(&flat)?)
}

impl Generation<'_> {
    /// Samples not finished yet (running or waiting).
    pub fn pending(&self) -> usize {
        self.running.len() + self.waiting.len()
    }

    /// Prefills the prompts in `prompts` (indices) in right-padded batches.
    fn prefill(&mut self, prompts: &[usize]) -> Result<()> {
        for chunk in prefill_chunks(&self.prompts, prompts, self.options.max_batch.max(1)) {
            let chunk = chunk.as_slice();
            let lens: Vec<i64> = chunk
                .iter()
                .map(|&p| self.prompts[p].len() as i64)
                .collect();
            let t = lens.iter().copied().max().unwrap_or(1);
            let mut ids = Vec::with_capacity(chunk.len() * t as usize);
            for &p in chunk {
                ids.extend_from_slice(&self.prompts[p]);
                // Pad entries land past the row's length, where the mask hides them.
                ids.extend(std::iter::repeat_n(0, t as usize - self.prompts[p].len()));
            }
            let ids = Tensor::from_slice(&ids).reshape([chunk.len() as i64, t]);
            let mut cache = self.model.new_cache(chunk.len());
            let hidden = self.model.forward_cached(&mut cache, &ids, &lens);
            let rows = Tensor::arange(chunk.len() as i64, (Kind::Int64, hidden.device()));
            let last = Tensor::from_slice(&lens).to_device(hidden.device()) - 1;
            let logits = tch::no_grad(|| {
                self.model
                    .apply_head(&hidden.index(&[Some(rows), Some(last)]))
            });
            let flat = to_host(&logits)?;
            let v = flat.len() / chunk.len().max(1);
            let rows = chunk
                .iter()
                .enumerate()
                .map(|(i, &p)| (p, flat[i * v..(i + 1) * v].to_vec(), self.params.n))
                .collect();
            self.prefilled.push(Prefilled { cache, rows });
        }
        Ok(())
    }

    /// Fills free rows with waiting samples.
    fn admit(&mut self) -> Result<()> {
        loop {
            let free = self.options.max_batch.saturating_sub(self.running.len());
            if free == 0 || self.waiting.is_empty() {
                return Ok(());
            }
            let batch: Vec<(usize, usize)> =
                self.waiting.drain(..free.min(self.waiting.len())).collect();
            let mut need: Vec<usize> = Vec::new();
            for &(p, _) in &batch {
                let known = self
                    .prefilled
                    .iter()
                    .any(|pf| pf.rows.iter().any(|r| r.0 == p));
                if !known && !need.contains(&p) {
                    need.push(p);
                }
            }
            self.prefill(&need)?;
            // Rows to copy from each prefilled batch, in admission order.
            let mut copies: Vec<Vec<usize>> = vec![Vec::new(); self.prefilled.len()];
            let mut order: Vec<(usize, Running)> = Vec::new();
            for (p, s) in batch {
                let Some((b, r)) =
                    self.prefilled.iter().enumerate().find_map(|(b, pf)| {
                        pf.rows.iter().position(|row| row.0 == p).map(|r| (b, r))
                    })
                else {
                    continue; // Unreachable: every admitted prompt was prefilled above.
                };
                let row = &mut self.prefilled[b].rows[r];
                row.2 -= 1;
                let prompt_len = self.prompts[p].len();
                let room = (self.model.config().max_position_embeddings as usize)
                    .saturating_sub(prompt_len);
                let mut run = Running {
                    prompt: p,
                    sample: s,
                    rng: Rng::for_sample(self.params.seed, p, s),
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                    budget: self.params.max_new_tokens.min(room),
                };
                let (tok, lp) = sample_token(&row.1, &self.params, &mut run.rng);
                run.tokens.push(tok);
                run.logprobs.push(lp);
                if let Some(done) = self.finished(&run) {
                    self.done.push_back(done);
                } else {
                    copies[b].push(r);
                    order.push((b, run));
                }
            }
            // Copy rows batch by batch; keep `running` in the same order as cache rows.
            for (b, rows) in copies.iter().enumerate() {
                self.cache.push_rows(&self.prefilled[b].cache, rows);
            }
            order.sort_by_key(|(b, _)| *b);
            self.running.extend(order.into_iter().map(|(_, run)| run));
            self.prefilled.retain(|pf| pf.rows.iter().any(|r| r.2 > 0));
        }
    }

    /// Checks whether a sample is done after its latest token; if so builds its `Sample`.
    fn finished(&self, run: &Running) -> Option<Sample> {
        let last = *run.tokens.last()?;
        let mut finish = None;
        if self.eos.contains(&last) {
            finish = Some(FinishReason::Eos);
        }
        let mut text = None;
        if finish.is_none() && !self.params.stop.is_empty() {
            let t = self.tokenizer.decode(&run.tokens).unwrap_or_default();
            if let Some(cut) = self
                .params
                .stop
                .iter()
                .filter_map(|s| t.find(s.as_str()))
                .min()
            {
                finish = Some(FinishReason::Stop);
                text = Some(t[..cut].to_owned());
            } else {
                text = Some(t);
            }
        }
        if finish.is_none() && run.tokens.len() >= run.budget {
            finish = Some(FinishReason::Length);
        }
        let finish = finish?;
        let text = match text {
            Some(t) if finish == FinishReason::Stop => t,
            _ => self.tokenizer.decode(&run.tokens).unwrap_or_default(),
        };
        Some(Sample {
            prompt_index: run.prompt,
            sample_index: run.sample,
            token_ids: run.tokens.clone(),
            logprobs: run.logprobs.clone(),
            text,
            finish,
        })
    }

    /// Decodes one token for every running sample.
    fn decode_step(&mut self) -> Result<()> {
        let last: Vec<i64> = self
            .running
            .iter()
            .map(|r| r.tokens.last().copied().unwrap_or(0))
            .collect();
        let rows = last.len();
        let ids = Tensor::from_slice(&last).reshape([rows as i64, 1]);
        let hidden = self
            .model
            .forward_cached(&mut self.cache, &ids, &vec![1; rows]);
        let logits = tch::no_grad(|| self.model.apply_head(&hidden.squeeze_dim(1)));
        let flat = to_host(&logits)?;
        let v = flat.len() / rows.max(1);
        let mut keep = Vec::with_capacity(rows);
        let mut still = Vec::with_capacity(rows);
        let running = std::mem::take(&mut self.running);
        for (i, mut run) in running.into_iter().enumerate() {
            let (tok, lp) = sample_token(&flat[i * v..(i + 1) * v], &self.params, &mut run.rng);
            run.tokens.push(tok);
            run.logprobs.push(lp);
            match self.finished(&run) {
                Some(done) => self.done.push_back(done),
                None => {
                    keep.push(i);
                    still.push(run);
                }
            }
        }
        self.cache.retain_rows(&keep);
        self.running = still;
        Ok(())
    }
}

impl Iterator for Generation<'_> {
    type Item = Result<Sample>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(s) = self.done.pop_front() {
                return Some(Ok(s));
            }
            if self.failed || (self.running.is_empty() && self.waiting.is_empty()) {
                return None;
            }
            let step = self.admit().and_then(|()| {
                if self.running.is_empty() {
                    Ok(())
                } else {
                    self.decode_step()
                }
            });
            if let Err(e) = step {
                // A device error leaves the cache in an unknown state: end the stream.
                self.failed = true;
                return Some(Err(e));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    // Each test sets one libtorch thread: tests run in parallel threads, and OpenMP threads
    // spinning on a small shared machine slow the suite down about tenfold.
    use super::*;
    use crate::tiny::{TinyConfig, tiny};
    use tch::Device;

    fn model() -> (Model, Tokenizer) {
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

    fn prompts(tok: &Tokenizer, texts: &[&str]) -> Vec<Vec<i64>> {
        texts.iter().map(|t| tok.encode(t, true).unwrap()).collect()
    }

    fn greedy(max: usize) -> SamplingParams {
        SamplingParams {
            greedy: true,
            max_new_tokens: max,
            stop_at_eos: false,
            ..SamplingParams::default()
        }
    }

    /// Greedy decoding by recomputing the whole sequence each step (no cache).
    fn greedy_full(model: &Model, prompt: &[i64], steps: usize) -> Vec<i64> {
        let mut seq = prompt.to_vec();
        for _ in 0..steps {
            let logits =
                tch::no_grad(|| model.forward(&Tensor::from_slice(&seq).unsqueeze(0), None));
            let next = logits
                .get(0)
                .get(seq.len() as i64 - 1)
                .argmax(0, false)
                .int64_value(&[]);
            seq.push(next);
        }
        seq[prompt.len()..].to_vec()
    }

    #[test]
    fn greedy_with_cache_equals_full_recompute() {
        crate::device::set_cpu_threads(1);
        let (m, tok) = model();
        let ps = prompts(&tok, &["hello", "a much longer prompt here", "x"]);
        // Batched, with prompts of different lengths, through the cache.
        let out = generate(&m, &tok, ps.clone(), greedy(20), EngineOptions::default()).unwrap();
        for (p, s) in ps.iter().zip(&out) {
            assert_eq!(s.token_ids, greedy_full(&m, p, 20));
            assert_eq!(s.finish, FinishReason::Length);
        }
    }

    #[test]
    fn same_seed_same_text_whatever_the_batch() {
        crate::device::set_cpu_threads(1);
        let (m, tok) = model();
        let params = SamplingParams {
            max_new_tokens: 24,
            seed: 42,
            n: 3,
            stop_at_eos: false,
            top_p: 0.95,
            top_k: 50,
            ..SamplingParams::default()
        };
        let all = prompts(&tok, &["one", "two prompts", "three", "four!"]);
        let together = generate(
            &m,
            &tok,
            all.clone(),
            params.clone(),
            EngineOptions { max_batch: 12 },
        )
        .unwrap();
        // Small batches force continuous batching: rows free up and later samples take them.
        let small = generate(
            &m,
            &tok,
            all.clone(),
            params.clone(),
            EngineOptions { max_batch: 2 },
        )
        .unwrap();
        // Tokens and text are identical; log-probabilities agree to rounding (matrix products
        // of other shapes may round differently).
        assert_eq!(together.len(), small.len());
        for (a, b) in together.iter().zip(&small) {
            assert_eq!(
                (a.prompt_index, a.sample_index, &a.token_ids, &a.text),
                (b.prompt_index, b.sample_index, &b.token_ids, &b.text)
            );
            assert!(
                a.logprobs
                    .iter()
                    .zip(&b.logprobs)
                    .all(|(x, y)| (x - y).abs() < 1e-4)
            );
        }
        // Prompt 2 alone is prompt 0 of a new request: compare its samples' generators by
        // putting it at the same index with other prompts around it.
        let reordered = vec![
            all[3].clone(),
            all[1].clone(),
            all[2].clone(),
            all[0].clone(),
        ];
        let other = generate(
            &m,
            &tok,
            reordered,
            params.clone(),
            EngineOptions { max_batch: 5 },
        )
        .unwrap();
        let pick = |v: &[Sample], p: usize| {
            v.iter()
                .filter(|s| s.prompt_index == p)
                .map(|s| s.token_ids.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(pick(&together, 1), pick(&other, 1));
        assert_eq!(pick(&together, 2), pick(&other, 2));
        // The n samples of one prompt differ from each other.
        let p0 = pick(&together, 0);
        assert_ne!(p0[0], p0[1]);
        // Another seed gives other text.
        let reseeded = generate(
            &m,
            &tok,
            all,
            SamplingParams { seed: 43, ..params },
            EngineOptions::default(),
        )
        .unwrap();
        assert_ne!(pick(&together, 0), pick(&reseeded, 0));
    }

    #[test]
    fn stream_yields_each_sample_when_it_finishes() {
        crate::device::set_cpu_threads(1);
        // With max_len 12, a 3-token prompt may generate 9 tokens and a 9-token prompt only 3.
        let small = TinyConfig {
            seed: 3,
            max_len: 12,
            ..TinyConfig::default()
        };
        let (m, tok) = tiny(&small, Head::Lm, Device::Cpu).unwrap();
        let ps = prompts(&tok, &["ab", "abcdefgh"]);
        let mut stream =
            generate_stream(&m, &tok, ps, greedy(40), EngineOptions::default()).unwrap();
        let first = stream.next().unwrap().unwrap();
        assert_eq!((first.prompt_index, first.token_ids.len()), (1, 3));
        // The long sample is still running when the short one is handed out.
        assert_eq!(stream.pending(), 1);
        let second = stream.next().unwrap().unwrap();
        assert_eq!((second.prompt_index, second.token_ids.len()), (0, 9));
        assert!(stream.next().is_none());
    }

    #[test]
    fn stops_at_eos_and_stop_strings() {
        crate::device::set_cpu_threads(1);
        let (m, tok) = model();
        let ps = prompts(&tok, &["hello"]);
        let free = generate(&m, &tok, ps.clone(), greedy(30), EngineOptions::default()).unwrap();
        let text = free[0].text.clone();
        // A stop string taken from the middle of the free-running text cuts it there.
        let chars: Vec<char> = text.chars().collect();
        let stop: String = chars[5..7].iter().collect();
        let cut = text.find(&stop).unwrap();
        let params = SamplingParams {
            stop: vec![stop.clone()],
            ..greedy(30)
        };
        let stopped = generate(&m, &tok, ps.clone(), params, EngineOptions::default()).unwrap();
        assert_eq!(stopped[0].finish, FinishReason::Stop);
        assert_eq!(stopped[0].text, text[..cut]);
        assert!(stopped[0].token_ids.len() < 30);
        // Declaring the first generated token an end-of-sequence token stops right there.
        let first = free[0].token_ids[0];
        let mut eos_tok = Tokenizer::bytes();
        eos_tok.set_eos(vec![first]);
        let params = SamplingParams {
            stop_at_eos: true,
            ..greedy(30)
        };
        let s = generate(&m, &eos_tok, ps, params, EngineOptions::default()).unwrap();
        assert_eq!(s[0].finish, FinishReason::Eos);
        assert_eq!(s[0].token_ids, vec![first]);
    }

    #[test]
    fn n_samples_of_a_prompt_share_its_prefill_and_differ() {
        crate::device::set_cpu_threads(1);
        let (m, tok) = model();
        let ps = prompts(&tok, &["shared prefix"]);
        let params = SamplingParams {
            max_new_tokens: 10,
            n: 4,
            seed: 9,
            stop_at_eos: false,
            ..SamplingParams::default()
        };
        let out = generate(
            &m,
            &tok,
            ps.clone(),
            params.clone(),
            EngineOptions { max_batch: 3 },
        )
        .unwrap();
        assert_eq!(out.len(), 4);
        assert_eq!(
            out.iter().map(|s| s.sample_index).collect::<Vec<_>>(),
            vec![0, 1, 2, 3]
        );
        for s in &out {
            assert_eq!(s.token_ids.len(), 10);
            assert_eq!(s.logprobs.len(), 10);
            assert!(s.logprobs.iter().all(|&l| l <= 0.0 && l.is_finite()));
        }
        for i in 1..4 {
            assert_ne!(out[0].token_ids, out[i].token_ids);
        }
    }

    #[test]
    fn channel_stream_delivers_every_sample() {
        crate::device::set_cpu_threads(1);
        let (m, tok) = model();
        let ps = prompts(&tok, &["a", "b", "c"]);
        let params = SamplingParams {
            max_new_tokens: 5,
            n: 2,
            stop_at_eos: false,
            ..SamplingParams::default()
        };
        let (rx, handle) = spawn_generation(m, tok, ps, params, EngineOptions { max_batch: 2 });
        let got: Vec<Sample> = rx.iter().map(Result::unwrap).collect();
        assert_eq!(got.len(), 6);
        let (_model, _tok) = handle.join().unwrap();
    }

    #[test]
    fn prefill_chunks_bound_padding_and_batch_size() {
        crate::device::set_cpu_threads(1);
        let prompts: Vec<Vec<i64>> = [5, 40, 6, 41, 5, 100, 39]
            .iter()
            .map(|&n| vec![1; n])
            .collect();
        let chunks = prefill_chunks(&prompts, &[0, 1, 2, 3, 4, 5, 6], 2);
        assert_eq!(
            chunks,
            vec![vec![0, 4], vec![2], vec![6, 1], vec![3], vec![5]]
        );
        let all: usize = chunks.iter().map(Vec::len).sum();
        assert_eq!(all, 7);
        for c in &chunks {
            let max = c.iter().map(|&p| prompts[p].len()).max().unwrap();
            let sum: usize = c.iter().map(|&p| prompts[p].len()).sum();
            assert!((max * c.len() - sum) as f64 <= 0.1 * sum as f64);
        }
    }

    #[test]
    fn bad_requests_are_errors() {
        crate::device::set_cpu_threads(1);
        let (m, tok) = model();
        let err = |ps: Vec<Vec<i64>>| {
            generate(&m, &tok, ps, greedy(4), EngineOptions::default())
                .err()
                .map(|e| e.to_string())
        };
        assert_eq!(err(vec![vec![]]).unwrap(), "prompt 0: is empty");
        assert!(
            err(vec![vec![1, 9999]])
                .unwrap()
                .starts_with("prompt 0: token id 9999 outside the vocabulary")
        );
        assert!(err(vec![vec![1; 600]]).unwrap().contains("at most 512"));
    }
}
