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
//! Speculative decoding (`EngineOptions::speculate`, pieces in `spec.rs`) happens in
//! `decode_step`: before each step the batch's draft length is chosen (fixed for `ngram:N`,
//! from measured costs and acceptance rates for `auto` and `draft:DIR`); a speculative step
//! feeds each row its last token plus its drafts through one `Model::forward_cached` call,
//! verifies them, appends the accepted prefix and the target's next token, and rolls each row
//! back over the rejected drafts with `KvCache::truncate`. A draft model keeps its own cache
//! with the same rows, prefilled with the target's, and catches up on the tokens it has not
//! seen when it next drafts.
//!
//! This module must not print, and must not tokenize more than the stop-string check needs.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::thread;
use std::time::Instant;

use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use crate::generation::sampling::{SamplingParams, sample_token};
use crate::generation::spec::{
    self, AUTO_MAX_DRAFT, Acceptance, CostModel, DRAFT_MODEL_MAX_DRAFT, MAX_DRAFT, NgramIndex,
    RowOutlook, SpeculateMode, StepRecord,
};
use crate::models::cache::KvCache;
use crate::models::model::{Head, Model};
use crate::models::tokenizer::Tokenizer;
use crate::rng::Rng;
use braid_cost::sim::LengthDist;

/// Engine settings that do not change the result's distribution. (Greedy text never changes;
/// sampled text is the same with `off`, `auto` and `ngram`, and follows the same distribution
/// but differs with a draft model.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineOptions {
    /// Most samples decoded together (rows of the KV cache).
    pub max_batch: usize,
    /// Speculative decoding (default off).
    pub speculate: SpeculateMode,
    /// Forces the draft length of `Auto` and `Draft` at every step instead of choosing it from
    /// measured costs (for tests and reproducible draft-model sampling); `None` by default.
    pub draft_len: Option<usize>,
    /// The index, in the whole batch, of the first prompt given: a data-parallel replica
    /// generates a block of a batch's prompts, and each sample's random stream is drawn from
    /// its index in the whole batch, so that it samples the text one process would (0 by
    /// default).
    pub first_prompt: usize,
    /// Where tokens are chosen (default: on a GPU where the model is on one).
    pub sampling: SamplingPlace,
    /// Lengths to generate, for benchmarks (`braid run --gen-lengths`): each sample draws its
    /// length from a distribution and the engine holds back end-of-sequence tokens until then
    /// (`None` by default: the model decides).
    pub lengths: Option<TargetLengths>,
}

/// Output lengths the engine imposes: sample `(p, s)` (prompt `p` of the whole batch) draws
/// its length from `dist` with a generator of its own, derived from `seed`, `p` and `s` only
/// (so a migrated sample keeps its length); until it has that many tokens the end-of-sequence
/// tokens are masked out, and then it ends with one. `max_new_tokens` still caps it; without
/// `stop_at_eos` nothing is imposed.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetLengths {
    pub dist: LengthDist,
    pub seed: u64,
}

// The distribution's parameters are finite numbers (`LengthDist::validate`).
impl Eq for TargetLengths {}

impl TargetLengths {
    /// The length sample `sample` of prompt `prompt` (of the whole batch) ends at.
    pub fn of(&self, prompt: usize, sample: usize) -> usize {
        let stream = (prompt as u64).wrapping_mul(0x1_0000_0001) ^ sample as u64;
        let mut rng = braid_cost::prng::Rng::new(crate::rng::derive(self.seed, stream));
        self.dist.sample(&mut rng).max(1) as usize
    }
}

/// Where the engine chooses tokens from the logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SamplingPlace {
    /// On the model's device when it is a GPU, else on the host.
    #[default]
    Auto,
    /// On the host, from logits copied back at every step: the CPU path.
    Host,
    /// On the model's device with `device_sampling`: only the chosen tokens and their
    /// log-probabilities come back. Steps that verify drafts copy their logits to the host
    /// (verification walks them there) whatever this says.
    Device,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_batch: braid_cost::sim::ENGINE_MAX_BATCH as usize,
            speculate: SpeculateMode::Off,
            draft_len: None,
            sampling: SamplingPlace::Auto,
            first_prompt: 0,
            lengths: None,
        }
    }
}

/// The logits a prefilled prompt's samples start from: host values, or a row left on the
/// device for `device_sampling`.
enum RowLogits {
    Host(Vec<f32>),
    Device(Tensor),
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
    /// The prompt and completion so far, indexed for n-gram drafts (n-gram modes only).
    ngram: Option<NgramIndex>,
    /// How often this sample's drafts are accepted.
    acceptance: Acceptance,
    /// The length `EngineOptions::lengths` imposes.
    target: Option<usize>,
}

/// A sample that leaves one engine unfinished to continue on another (long-tail migration,
/// sample reallocation): everything its next token depends on, so that it continues exactly
/// as it would have where it was. Its KV cache travels with it, or is rebuilt by a prefill of
/// the prompt and the tokens so far where it lands (`kv: None`).
#[derive(Debug)]
pub struct Migrant {
    /// The prompt's index in the whole batch (what its random stream is drawn from).
    pub batch_index: usize,
    pub sample_index: usize,
    pub prompt: Vec<i64>,
    pub tokens: Vec<i64>,
    pub logprobs: Vec<f32>,
    /// Its generator's state (`Rng::state`).
    pub rng: u64,
    /// Keys and values of its cache row, `[kv_heads, len, head_dim]` per layer; `len` is the
    /// prompt and every token but the last (which the next step feeds).
    pub kv: Option<(Vec<Tensor>, Vec<Tensor>)>,
}

impl Migrant {
    /// Bytes its KV cache takes (0 without one).
    pub fn kv_bytes(&self) -> usize {
        self.kv.as_ref().map_or(0, |(k, v)| {
            k.iter()
                .chain(v)
                .map(|t| t.numel() * t.kind().elt_size_in_bytes())
                .sum()
        })
    }
}

/// How drafts are made.
enum Drafter {
    Ngram,
    /// A draft model and its cache, whose rows are the target cache's rows.
    Model {
        model: Box<Model>,
        cache: KvCache,
    },
}

/// What the draft model proposed in one step.
struct ModelDrafts {
    /// Per row, its drafted tokens.
    drafts: Vec<Vec<i64>>,
    /// Per row, the draft logits each token was sampled from (`drafts × vocab`; only when
    /// sampling).
    logits: Vec<Vec<f32>>,
    /// The draft model's vocabulary size.
    vocab: usize,
}

/// Speculation state of a generation.
struct Speculator {
    drafter: Drafter,
    /// `Some(k)`: always draft `k` tokens; `None`: choose per step, up to `max_len`.
    fixed: Option<usize>,
    max_len: usize,
    /// Seconds of one draft-model pass by tokens fed.
    draft_cost: CostModel,
}

impl Speculator {
    fn new(options: &EngineOptions, model: &Model, tokenizer: &Tokenizer) -> Result<Option<Self>> {
        if let Some(k) = options.draft_len
            && k > MAX_DRAFT
        {
            return Err(Error::invalid(
                "draft_len",
                format!("must be at most {MAX_DRAFT}, found {k}"),
            ));
        }
        let (drafter, fixed, max_len) = match &options.speculate {
            SpeculateMode::Off => return Ok(None),
            SpeculateMode::Auto => (Drafter::Ngram, options.draft_len, AUTO_MAX_DRAFT),
            SpeculateMode::Ngram(n) => {
                if !(1..=MAX_DRAFT).contains(n) {
                    return Err(Error::invalid(
                        "speculate",
                        format!("the n-gram draft length must be from 1 to {MAX_DRAFT}, found {n}"),
                    ));
                }
                (Drafter::Ngram, Some(*n), *n)
            }
            SpeculateMode::Draft(dir) => {
                let draft = spec::load_draft(dir, model, tokenizer)?;
                let cache = draft.new_cache(0);
                (
                    Drafter::Model {
                        model: Box::new(draft),
                        cache,
                    },
                    options.draft_len,
                    DRAFT_MODEL_MAX_DRAFT,
                )
            }
        };
        Ok(Some(Speculator {
            drafter,
            fixed,
            max_len: fixed.unwrap_or(max_len),
            draft_cost: CostModel::default(),
        }))
    }

    fn draft_model(&self) -> Option<&Model> {
        match &self.drafter {
            Drafter::Model { model, .. } => Some(model),
            Drafter::Ngram => None,
        }
    }
}

impl Running {
    /// Appends a generated token (and indexes it for n-gram drafts).
    fn push(&mut self, token: i64, logprob: f32) {
        self.tokens.push(token);
        self.logprobs.push(logprob);
        if let Some(ix) = &mut self.ngram {
            ix.push(token);
        }
    }
}

/// Prefilled prompts whose samples are not all admitted yet.
struct Prefilled {
    cache: KvCache,
    /// The draft model's cache of the same prompts (with a draft model only).
    draft_cache: Option<KvCache>,
    /// Per cache row: prompt index, logits after the prompt, samples still to admit.
    rows: Vec<(usize, RowLogits, usize)>,
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
    spec: Option<Speculator>,
    steps: Vec<StepRecord>,
    /// Tokens are chosen on the model's device (`EngineOptions::sampling`).
    on_device: bool,
    /// Per prompt here, its index in the whole batch (the prompts given, from
    /// `first_prompt`, then those of adopted migrants).
    origin: Vec<usize>,
    /// Adopted samples waiting for a free row.
    parked: VecDeque<Migrant>,
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
    // Tensor-parallel ranks must issue the same steps: a draft length chosen from each
    // rank's own measured timings could differ between them.
    if model.tensor_parallel().0 > 1
        && matches!(
            options.speculate,
            SpeculateMode::Auto | SpeculateMode::Draft(_)
        )
    {
        return Err(Error::invalid(
            "speculate",
            "`auto` and `draft:DIR` choose each step's draft length from this process's own timings, which the ranks of a tensor-parallel group would not agree on; use `off` or `ngram[:N]` with tensor parallelism",
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
    if options.lengths.is_some() && options.speculate != SpeculateMode::Off {
        return Err(Error::invalid(
            "speculate",
            "imposed output lengths (`--gen-lengths`) and speculative decoding do not combine: \
             verification would have to mask end-of-sequence tokens too; turn one of them off",
        ));
    }
    if let Some(t) = &options.lengths {
        t.dist
            .validate()
            .map_err(|e| Error::invalid("gen-lengths", e.0))?;
    }
    let spec = Speculator::new(&options, model, tokenizer)?;
    // Imposed lengths mask the logits on the host.
    let on_device = options.lengths.is_none()
        && match options.sampling {
            SamplingPlace::Auto => model.device().is_cuda(),
            SamplingPlace::Host => false,
            SamplingPlace::Device => true,
        };
    let origin = (0..prompts.len())
        .map(|p| options.first_prompt + p)
        .collect();
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
        spec,
        steps: Vec::new(),
        on_device,
        origin,
        parked: VecDeque::new(),
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

/// One uniform number from each run's generator (none when greedy): what `sample_token` would
/// take from it for this token, for `device_sampling`.
fn draws<'a>(greedy: bool, runs: impl Iterator<Item = &'a mut Running>) -> Vec<f64> {
    if greedy {
        return Vec::new();
    }
    runs.map(|run| run.rng.uniform()).collect()
}

/// The model's log-probability of `token` under the sampling temperature, over the whole
/// vocabulary (what a token forced or sampled from masked logits is scored with).
fn model_logprob(logits: &[f32], params: &SamplingParams, token: i64) -> f32 {
    let t = params.logprob_temperature().max(1e-6);
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = logits
        .iter()
        .map(|&x| ((x - max) / t).exp())
        .sum::<f32>()
        .ln();
    usize::try_from(token)
        .ok()
        .and_then(|i| logits.get(i))
        .map_or(f32::NEG_INFINITY, |&x| (x - max) / t - lse)
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
    /// Samples not finished yet (running, waiting or adopted and parked).
    pub fn pending(&self) -> usize {
        self.running.len() + self.waiting.len() + self.parked.len()
    }

    /// The index in the whole batch of prompt `local` of this generation (a `Sample`'s
    /// `prompt_index`): `first_prompt + local` for the prompts given, an adopted migrant's own
    /// for the prompts that came with migrants.
    pub fn batch_index(&self, local: usize) -> usize {
        self.origin.get(local).copied().unwrap_or(local)
    }

    /// The shape of this generation's KV cache rows: layers, key/value heads, head width and
    /// element type (what a migrant's cache must have to land here).
    pub fn kv_layout(&self) -> (usize, i64, i64, Kind) {
        let (layers, heads, dim) = self.cache.layout();
        (layers, heads, dim, self.cache.kind())
    }

    /// Runs one step (admission, then one decode step of every running sample) and returns
    /// the samples that finished in it; nothing when nothing is pending.
    pub fn step(&mut self) -> Result<Vec<Sample>> {
        if self.failed {
            return Err(Error::invalid("generation", "an earlier step failed"));
        }
        if (!self.running.is_empty() || !self.waiting.is_empty() || !self.parked.is_empty())
            && let Err(e) = self.advance()
        {
            self.failed = true;
            return Err(e);
        }
        Ok(self.done.drain(..).collect())
    }

    fn advance(&mut self) -> Result<()> {
        self.admit()?;
        if self.running.is_empty() {
            Ok(())
        } else {
            self.decode_step()
        }
    }

    /// Hands over every unfinished sample (running, waiting, parked) and leaves this
    /// generation empty; with `kv` a running sample takes its cache row along, else the
    /// engine it lands on prefills its prompt and tokens again. Samples already finished and
    /// not yet yielded stay. A draft model's cache does not migrate: generations with a draft
    /// model refuse.
    pub fn release(&mut self, kv: bool) -> Result<Vec<Migrant>> {
        self.check_migratable()?;
        let mut out: Vec<Migrant> = self.parked.drain(..).collect();
        for row in 0..self.running.len() {
            out.push(self.running_migrant(row, kv)?);
        }
        self.running.clear();
        self.cache = self.model.new_cache(0);
        for (p, s) in std::mem::take(&mut self.waiting) {
            out.push(self.waiting_migrant(p, s));
        }
        self.prefilled.clear();
        Ok(out)
    }

    /// Samples of a generation that drafts with a draft model do not move: the draft model's
    /// cache would have to move with them.
    fn check_migratable(&self) -> Result<()> {
        if matches!(
            self.spec.as_ref().map(|sp| &sp.drafter),
            Some(Drafter::Model { .. })
        ) {
            return Err(Error::invalid(
                "migration",
                "a generation that drafts with a draft model does not migrate (its cache would \
                 have to move too)",
            ));
        }
        Ok(())
    }

    /// Running sample `row` as a migrant (with its cache row when `kv`).
    fn running_migrant(&self, row: usize, kv: bool) -> Result<Migrant> {
        let run = &self.running[row];
        Ok(Migrant {
            batch_index: self.batch_index(run.prompt),
            sample_index: run.sample,
            prompt: self.prompts[run.prompt].clone(),
            tokens: run.tokens.clone(),
            logprobs: run.logprobs.clone(),
            rng: run.rng.state(),
            kv: if kv {
                Some(self.cache.row_parts(row)?)
            } else {
                None
            },
        })
    }

    /// Waiting sample `s` of prompt `p` as a migrant: not started, its generator fresh.
    fn waiting_migrant(&self, p: usize, s: usize) -> Migrant {
        let batch_index = self.batch_index(p);
        Migrant {
            batch_index,
            sample_index: s,
            prompt: self.prompts[p].clone(),
            tokens: Vec::new(),
            logprobs: Vec::new(),
            rng: Rng::for_sample(self.params.seed, batch_index, s).state(),
            kv: None,
        }
    }

    /// Hands over up to `count` unfinished samples, those with the most work likely left
    /// first: parked and waiting ones (not started), then running ones with the fewest tokens
    /// (`kv` as for [`Generation::release`]); the rest keep running here. For sample
    /// reallocation before the tail.
    pub fn release_some(&mut self, count: usize, kv: bool) -> Result<Vec<Migrant>> {
        if count >= self.pending() {
            return self.release(kv);
        }
        self.check_migratable()?;
        let mut out: Vec<Migrant> = Vec::new();
        while out.len() < count {
            let Some(m) = self.parked.pop_back() else {
                break;
            };
            out.push(m);
        }
        while out.len() < count {
            let Some((p, s)) = self.waiting.pop_back() else {
                break;
            };
            // A prefilled prompt has one sample fewer to admit.
            if let Some(row) = self
                .prefilled
                .iter_mut()
                .flat_map(|pf| pf.rows.iter_mut())
                .find(|r| r.0 == p && r.2 > 0)
            {
                row.2 -= 1;
            }
            out.push(self.waiting_migrant(p, s));
        }
        self.prefilled.retain(|pf| pf.rows.iter().any(|r| r.2 > 0));
        if out.len() >= count {
            return Ok(out);
        }
        let mut rows: Vec<usize> = (0..self.running.len()).collect();
        rows.sort_by_key(|&r| (self.running[r].tokens.len(), r));
        let mut moving: Vec<usize> = rows[..(count - out.len()).min(rows.len())].to_vec();
        moving.sort_unstable();
        for &row in &moving {
            out.push(self.running_migrant(row, kv)?);
        }
        let keep: Vec<usize> = (0..self.running.len())
            .filter(|r| moving.binary_search(r).is_err())
            .collect();
        // (No draft model's cache to cut: `check_migratable`.)
        self.cache.retain_rows(&keep);
        let running = std::mem::take(&mut self.running);
        self.running = running
            .into_iter()
            .enumerate()
            .filter(|(r, _)| moving.binary_search(r).is_err())
            .map(|(_, run)| run)
            .collect();
        Ok(out)
    }

    /// Tokens generated so far by each running sample.
    pub fn running_lengths(&self) -> Vec<usize> {
        self.running.iter().map(|r| r.tokens.len()).collect()
    }

    /// Takes samples another engine released ([`Generation::release`]): they continue here
    /// with their own generators, as free rows allow.
    pub fn adopt(&mut self, migrants: Vec<Migrant>) -> Result<()> {
        let max_len = self.model.config().max_position_embeddings;
        for m in &migrants {
            let what = format!(
                "migrated sample {} of prompt {}",
                m.sample_index, m.batch_index
            );
            if m.prompt.is_empty() || (m.prompt.len() + m.tokens.len()) as i64 >= max_len {
                return Err(Error::invalid(
                    what,
                    "has no prompt, or more tokens than the model takes",
                ));
            }
            if m.sample_index >= self.params.n || m.tokens.len() != m.logprobs.len() {
                return Err(Error::invalid(
                    what,
                    "does not match this generation's request",
                ));
            }
            self.model.check_ids(&m.prompt, &what)?;
            self.model.check_ids(&m.tokens, &what)?;
        }
        self.parked.extend(migrants);
        Ok(())
    }

    /// The prompt here of a migrant's prompt (added when this generation does not have it).
    fn local_prompt(&mut self, batch_index: usize, prompt: &[i64]) -> usize {
        if let Some(p) = self
            .origin
            .iter()
            .position(|&o| o == batch_index)
            .filter(|&p| self.prompts[p] == prompt)
        {
            return p;
        }
        self.prompts.push(prompt.to_vec());
        self.origin.push(batch_index);
        self.prompts.len() - 1
    }

    /// Moves parked migrants into free rows: a fresh one waits for its prefill like any
    /// sample; a started one gets its cache row, carried along or prefilled again (prompt
    /// and every token but the last, in one right-padded batch).
    fn admit_parked(&mut self) -> Result<()> {
        let mut free = self.options.max_batch.saturating_sub(self.running.len());
        let mut refill: Vec<Running> = Vec::new();
        while free > 0 {
            let Some(m) = self.parked.pop_front() else {
                break;
            };
            let p = self.local_prompt(m.batch_index, &m.prompt);
            if m.tokens.is_empty() {
                self.waiting.push_back((p, m.sample_index));
                continue;
            }
            free -= 1;
            let run = self.resumed(p, &m);
            match m.kv {
                Some((keys, values)) => {
                    let row = self.cache.row_from_parts(keys, values)?;
                    let want = (m.prompt.len() + m.tokens.len() - 1) as i64;
                    if row.lens()[0] != want {
                        return Err(Error::invalid(
                            "a migrated sample's KV cache",
                            format!("holds {} positions, its text {want}", row.lens()[0]),
                        ));
                    }
                    self.cache.push_rows(&row, &[0]);
                    self.running.push(run);
                }
                None => refill.push(run),
            }
        }
        if refill.is_empty() {
            return Ok(());
        }
        let feeds: Vec<Vec<i64>> = refill
            .iter()
            .map(|r| {
                let mut f = self.prompts[r.prompt].clone();
                f.extend_from_slice(&r.tokens[..r.tokens.len() - 1]);
                f
            })
            .collect();
        let lens: Vec<i64> = feeds.iter().map(|f| f.len() as i64).collect();
        let t = lens.iter().copied().max().unwrap_or(1);
        let mut ids = Vec::with_capacity(feeds.len() * t as usize);
        for f in &feeds {
            ids.extend_from_slice(f);
            ids.extend(std::iter::repeat_n(0, t as usize - f.len()));
        }
        let ids = Tensor::from_slice(&ids).reshape([feeds.len() as i64, t]);
        let mut cache = self.model.new_cache(feeds.len());
        let _ = self.model.forward_cached(&mut cache, &ids, &lens)?;
        let rows: Vec<usize> = (0..feeds.len()).collect();
        self.cache.push_rows(&cache, &rows);
        self.running.extend(refill);
        Ok(())
    }

    /// The running state of a started migrant at prompt `p` here.
    fn resumed(&self, p: usize, m: &Migrant) -> Running {
        let room =
            (self.model.config().max_position_embeddings as usize).saturating_sub(m.prompt.len());
        let ngram = match self.spec.as_ref().map(|sp| &sp.drafter) {
            Some(Drafter::Ngram) => {
                let mut ix = NgramIndex::new(&m.prompt);
                for &t in &m.tokens {
                    ix.push(t);
                }
                Some(ix)
            }
            _ => None,
        };
        Running {
            prompt: p,
            sample: m.sample_index,
            rng: Rng::from_state(m.rng),
            tokens: m.tokens.clone(),
            logprobs: m.logprobs.clone(),
            budget: self.params.max_new_tokens.min(room),
            ngram,
            acceptance: Acceptance::default(),
            target: self
                .options
                .lengths
                .as_ref()
                .map(|t| t.of(m.batch_index, m.sample_index)),
        }
    }

    /// The next token of `run` from its logits (host values): sampled, or with imposed
    /// lengths sampled without the end-of-sequence tokens until the sample's length, then an
    /// end-of-sequence token (its log-probability the model's).
    fn choose(&self, logits: &[f32], run: &mut Running) -> (i64, f32) {
        let (Some(target), Some(&eos)) = (run.target, self.eos.first()) else {
            return sample_token(logits, &self.params, &mut run.rng);
        };
        if run.tokens.len() + 1 >= target {
            // One draw per token whatever happens, as for any other token.
            let _ = run.rng.uniform();
            return (eos, model_logprob(logits, &self.params, eos));
        }
        let mut masked = logits.to_vec();
        for &e in &self.eos {
            if let Some(x) = usize::try_from(e).ok().and_then(|i| masked.get_mut(i)) {
                *x = f32::NEG_INFINITY;
            }
        }
        let (tok, _) = sample_token(&masked, &self.params, &mut run.rng);
        (tok, model_logprob(logits, &self.params, tok))
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
            let hidden = self.model.forward_cached(&mut cache, &ids, &lens)?;
            let rows = Tensor::arange(chunk.len() as i64, (Kind::Int64, hidden.device()));
            let last = Tensor::from_slice(&lens).to_device(hidden.device()) - 1;
            let logits = self
                .model
                .apply_head_cached(&hidden.index(&[Some(rows), Some(last)]))?;
            let rows = if self.on_device {
                chunk
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| (p, RowLogits::Device(logits.get(i as i64)), self.params.n))
                    .collect()
            } else {
                let flat = to_host(&logits)?;
                let v = flat.len() / chunk.len().max(1);
                chunk
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| {
                        (
                            p,
                            RowLogits::Host(flat[i * v..(i + 1) * v].to_vec()),
                            self.params.n,
                        )
                    })
                    .collect()
            };
            let draft_cache = self
                .spec
                .as_ref()
                .and_then(Speculator::draft_model)
                .map(|draft| -> Result<KvCache> {
                    let mut c = draft.new_cache(chunk.len());
                    let _ = draft.forward_cached(&mut c, &ids, &lens)?;
                    Ok(c)
                })
                .transpose()?;
            self.prefilled.push(Prefilled {
                cache,
                draft_cache,
                rows,
            });
        }
        Ok(())
    }

    /// Fills free rows with waiting samples.
    fn admit(&mut self) -> Result<()> {
        self.admit_parked()?;
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
            // The admitted samples with their prefilled row, before their first token.
            let mut admitted: Vec<(usize, usize, Running)> = Vec::new();
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
                let ngram = match self.spec.as_ref().map(|sp| &sp.drafter) {
                    Some(Drafter::Ngram) => Some(NgramIndex::new(&self.prompts[p])),
                    _ => None,
                };
                let batch_index = self.batch_index(p);
                let run = Running {
                    prompt: p,
                    sample: s,
                    target: self.options.lengths.as_ref().map(|t| t.of(batch_index, s)),
                    rng: Rng::for_sample(self.params.seed, batch_index, s),
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                    budget: self.params.max_new_tokens.min(room),
                    ngram,
                    acceptance: Acceptance::default(),
                };
                admitted.push((b, r, run));
            }
            let first = self.first_tokens(&mut admitted)?;
            for ((b, r, mut run), (tok, lp)) in admitted.into_iter().zip(first) {
                run.push(tok, lp);
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
                if let (Some(src), Some(Drafter::Model { cache, .. })) = (
                    &self.prefilled[b].draft_cache,
                    self.spec.as_mut().map(|sp| &mut sp.drafter),
                ) {
                    cache.push_rows(src, rows);
                }
            }
            order.sort_by_key(|(b, _)| *b);
            self.running.extend(order.into_iter().map(|(_, run)| run));
            self.prefilled.retain(|pf| pf.rows.iter().any(|r| r.2 > 0));
        }
    }

    /// The first token of each admitted sample (prefilled batch `b`, row `r`), from its
    /// prompt's logits: one batch on the device, or row by row on the host.
    fn first_tokens(&self, admitted: &mut [(usize, usize, Running)]) -> Result<Vec<(i64, f32)>> {
        if !self.on_device {
            let mut out = Vec::with_capacity(admitted.len());
            for (b, r, run) in admitted.iter_mut() {
                let chosen = match &self.prefilled[*b].rows[*r].1 {
                    RowLogits::Host(logits) => self.choose(logits, run),
                    RowLogits::Device(t) => self.choose(&to_host(t)?, run),
                };
                out.push(chosen);
            }
            return Ok(out);
        }
        if admitted.is_empty() {
            return Ok(Vec::new());
        }
        let mut rows = Vec::with_capacity(admitted.len());
        for (b, r, _) in admitted.iter() {
            match &self.prefilled[*b].rows[*r].1 {
                RowLogits::Device(t) => rows.push(t.shallow_clone()),
                RowLogits::Host(v) => {
                    rows.push(Tensor::from_slice(v).to_device(self.model.device()))
                }
            }
        }
        let uniforms = draws(
            self.params.greedy,
            admitted.iter_mut().map(|(_, _, run)| run),
        );
        crate::generation::device_sampling::sample_rows(
            &Tensor::stack(&rows, 0),
            &self.params,
            &uniforms,
        )
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

    /// What each decode step did, in order (rows, draft length, drafted, accepted and
    /// emitted tokens, wall time).
    pub fn step_log(&self) -> &[StepRecord] {
        &self.steps
    }

    /// Decodes one step for every running sample: one token, or with speculation the accepted
    /// drafts plus the target's next token.
    fn decode_step(&mut self) -> Result<()> {
        let start = Instant::now();
        let rows = self.running.len();
        let (k, mut drafts) = self.plan_drafts();
        let mut draft_logits: Vec<Vec<f32>> = Vec::new();
        let mut draft_vocab = 0;
        let mut draft_secs = 0.0;
        // Per row: the sequence length before this step (prompt and completion).
        let seq_lens: Vec<i64> = self
            .running
            .iter()
            .map(|r| (self.prompts[r.prompt].len() + r.tokens.len()) as i64)
            .collect();
        let with_model = matches!(
            self.spec.as_ref().map(|sp| &sp.drafter),
            Some(Drafter::Model { .. })
        );
        if k > 0 && with_model {
            let caps: Vec<usize> = drafts.iter().map(Vec::len).collect();
            let t0 = Instant::now();
            let made = self.draft_with_model(k, &caps)?;
            (drafts, draft_logits, draft_vocab) = (made.drafts, made.logits, made.vocab);
            draft_secs = t0.elapsed().as_secs_f64();
        }
        // One pass of the target over each row's last token and its drafts (right-padded).
        let t = k + 1;
        let mut ids = Vec::with_capacity(rows * t);
        let mut valid = Vec::with_capacity(rows);
        for (run, d) in self.running.iter().zip(&drafts) {
            ids.push(run.tokens.last().copied().unwrap_or(0));
            ids.extend_from_slice(d);
            ids.extend(std::iter::repeat_n(0, k - d.len()));
            valid.push(1 + d.len() as i64);
        }
        let old_lens = self.cache.lens().to_vec();
        let ids = Tensor::from_slice(&ids).reshape([rows as i64, t as i64]);
        let hidden = self.model.forward_cached(&mut self.cache, &ids, &valid)?;
        let logits = if k == 0 {
            self.model.apply_head_cached(&hidden.squeeze_dim(1))?
        } else {
            // Only the positions that verify something: row r's first 1 + drafts.
            let mut at = Vec::with_capacity(valid.iter().sum::<i64>() as usize);
            for (r, &n) in valid.iter().enumerate() {
                at.extend((0..n).map(|j| (r * t) as i64 + j));
            }
            let at = Tensor::from_slice(&at).to_device(hidden.device());
            let flat = hidden.reshape([(rows * t) as i64, -1]).index_select(0, &at);
            self.model.apply_head_cached(&flat)?
        };
        // Without drafts on the device, only each row's token and log-probability come back;
        // verification reads the logits on the host.
        let sampled = if k == 0 && self.on_device {
            let uniforms = draws(self.params.greedy, self.running.iter_mut());
            Some(crate::generation::device_sampling::sample_rows(
                &logits,
                &self.params,
                &uniforms,
            )?)
        } else {
            None
        };
        let flat = match sampled {
            Some(_) => Vec::new(),
            None => to_host(&logits)?,
        };
        let positions: usize = valid.iter().map(|&n| n as usize).sum();
        let v = flat.len() / positions.max(1);
        let mut keep = Vec::with_capacity(rows);
        let mut still = Vec::with_capacity(rows);
        let mut record = StepRecord {
            rows,
            draft_len: k,
            ..StepRecord::default()
        };
        let mut offset = 0;
        let mut truncate = Vec::with_capacity(rows);
        let running = std::mem::take(&mut self.running);
        for (i, mut run) in running.into_iter().enumerate() {
            let d = &drafts[i];
            let n = d.len() + 1;
            let target = &flat[(offset * v).min(flat.len())..((offset + n) * v).min(flat.len())];
            offset += n;
            let out = if let Some(s) = &sampled {
                vec![s[i]]
            } else if d.is_empty() {
                vec![self.choose(target, &mut run)]
            } else if with_model && !self.params.greedy {
                spec::verify_sampled(
                    target,
                    v,
                    &draft_logits[i],
                    draft_vocab,
                    d,
                    &self.params,
                    &mut run.rng,
                )
            } else {
                spec::verify_point(target, v, d, &self.params, &mut run.rng)
            };
            let accepted = out.len() - 1;
            run.acceptance.observe(d.len(), accepted);
            record.drafted += d.len();
            record.accepted += accepted;
            let mut finished = None;
            for (tok, lp) in out {
                run.push(tok, lp);
                record.emitted += 1;
                finished = self.finished(&run);
                if finished.is_some() {
                    break;
                }
            }
            match finished {
                Some(done) => self.done.push_back(done),
                None => {
                    // Keep the last token and the accepted drafts; drop the rejected ones.
                    if !d.is_empty() {
                        self.cache.truncate(i, old_lens[i] + 1 + accepted as i64)?;
                    }
                    truncate.push(seq_lens[i] + accepted as i64);
                    keep.push(i);
                    still.push(run);
                }
            }
        }
        self.cache.retain_rows(&keep);
        self.running = still;
        if let Some(sp) = &mut self.spec
            && let Drafter::Model { cache, .. } = &mut sp.drafter
        {
            cache.retain_rows(&keep);
            // The draft model's cache holds what it read while drafting; keep the part that
            // is still the sample's text.
            for (row, &want) in truncate.iter().enumerate() {
                let have = cache.lens()[row];
                if have > want {
                    cache.truncate(row, want)?;
                }
            }
        }
        record.secs = start.elapsed().as_secs_f64();
        // Seconds of a step without the draft model's passes, by tokens verified: kept on the
        // model, so a request starts with what earlier ones measured.
        self.model.observe_step(rows * t, record.secs - draft_secs);
        self.steps.push(record);
        Ok(())
    }

    /// Chooses this step's draft length and, for the n-gram drafter, each row's drafts (for a
    /// draft model, vectors of its length limits, which `draft_with_model` fills).
    fn plan_drafts(&mut self) -> (usize, Vec<Vec<i64>>) {
        let rows = self.running.len();
        let none = || (0, vec![Vec::new(); rows]);
        let Some(sp) = &self.spec else {
            return none();
        };
        // A row may emit at most its remaining budget: drafts + 1 ≤ remaining.
        let caps: Vec<usize> = self
            .running
            .iter()
            .map(|r| {
                r.budget
                    .saturating_sub(r.tokens.len())
                    .saturating_sub(1)
                    .min(sp.max_len)
            })
            .collect();
        let mut drafts: Vec<Vec<i64>> = match &sp.drafter {
            Drafter::Ngram => self
                .running
                .iter()
                .zip(&caps)
                .map(|(r, &cap)| r.ngram.as_ref().map(|ix| ix.draft(cap)).unwrap_or_default())
                .collect(),
            Drafter::Model { .. } => caps.iter().map(|&c| vec![0; c]).collect(),
        };
        let available: Vec<usize> = drafts.iter().map(Vec::len).collect();
        let longest = available.iter().copied().max().unwrap_or(0);
        let k = match sp.fixed {
            Some(k) => k.min(longest),
            None => {
                let outlook: Vec<RowOutlook> = self
                    .running
                    .iter()
                    .zip(&available)
                    .map(|(r, &a)| RowOutlook {
                        alpha: r.acceptance.rate(),
                        alpha_hi: r.acceptance.optimistic(),
                        available: a,
                    })
                    .collect();
                let draft_cost = match sp.drafter {
                    Drafter::Model { .. } => Some(&sp.draft_cost),
                    Drafter::Ngram => None,
                };
                self.model.with_step_costs(|target| {
                    spec::choose_draft_len(&outlook, sp.max_len, target, draft_cost)
                })
            }
        };
        if k == 0 {
            for (r, &a) in self.running.iter_mut().zip(&available) {
                if a > 0 {
                    r.acceptance.idle();
                }
            }
            return none();
        }
        for d in &mut drafts {
            d.truncate(k);
        }
        let k = drafts.iter().map(Vec::len).max().unwrap_or(0);
        (k, drafts)
    }

    /// Drafts `k` tokens per row with the draft model (rows keep the first `caps[r]`), after
    /// feeding it the tokens of each row it has not read yet.
    fn draft_with_model(&mut self, k: usize, caps: &[usize]) -> Result<ModelDrafts> {
        let rows = self.running.len();
        let Some(Speculator {
            drafter: Drafter::Model { model, cache },
            draft_cost,
            ..
        }) = &mut self.spec
        else {
            return Ok(ModelDrafts {
                drafts: vec![Vec::new(); rows],
                logits: Vec::new(),
                vocab: 0,
            });
        };
        let keep_logits = !self.params.greedy;
        let mut drafts: Vec<Vec<i64>> = vec![Vec::with_capacity(k); rows];
        let mut logits_out: Vec<Vec<f32>> = vec![Vec::new(); rows];
        let mut vocab = 0;
        // First pass: everything each row's cache lacks (at least the last token).
        let mut feeds: Vec<Vec<i64>> = Vec::with_capacity(rows);
        for (run, &have) in self.running.iter().zip(cache.lens()) {
            let prompt = &self.prompts[run.prompt];
            let have = have as usize;
            let mut f: Vec<i64> = prompt.get(have..).unwrap_or_default().to_vec();
            f.extend_from_slice(&run.tokens[have.saturating_sub(prompt.len())..]);
            feeds.push(f);
        }
        let width = feeds.iter().map(Vec::len).max().unwrap_or(1).max(1);
        let mut ids = Vec::with_capacity(rows * width);
        let mut valid = Vec::with_capacity(rows);
        for f in &feeds {
            ids.extend_from_slice(f);
            ids.extend(std::iter::repeat_n(0, width - f.len()));
            valid.push(f.len() as i64);
        }
        let mut ids = Tensor::from_slice(&ids).reshape([rows as i64, width as i64]);
        let mut last: Vec<i64> = valid.iter().map(|&n| (n - 1).max(0)).collect();
        for step in 0..k {
            let t0 = Instant::now();
            let hidden = model.forward_cached(cache, &ids, &valid)?;
            let r = Tensor::arange(rows as i64, (Kind::Int64, hidden.device()));
            let at = Tensor::from_slice(&last).to_device(hidden.device());
            let logits = model.apply_head_cached(&hidden.index(&[Some(r), Some(at)]))?;
            let flat = to_host(&logits)?;
            draft_cost.observe(rows * ids.size()[1] as usize, t0.elapsed().as_secs_f64());
            vocab = flat.len() / rows.max(1);
            let mut next = Vec::with_capacity(rows);
            for (i, run) in self.running.iter_mut().enumerate() {
                // Past a row's limit its drafts are not used (and cut from the cache after
                // verification): feed anything, draw nothing from its generator.
                let mut tok = 0;
                if step < caps[i] {
                    let row = &flat[i * vocab..(i + 1) * vocab];
                    tok = sample_token(row, &self.params, &mut run.rng).0;
                    drafts[i].push(tok);
                    if keep_logits {
                        logits_out[i].extend_from_slice(row);
                    }
                }
                next.push(tok);
            }
            if step + 1 < k {
                ids = Tensor::from_slice(&next).reshape([rows as i64, 1]);
                valid = vec![1; rows];
                last = vec![0; rows];
            }
        }
        Ok(ModelDrafts {
            drafts,
            logits: logits_out,
            vocab,
        })
    }
}

impl Iterator for Generation<'_> {
    type Item = Result<Sample>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(s) = self.done.pop_front() {
                return Some(Ok(s));
            }
            if self.failed {
                return None;
            }
            if self.running.is_empty() && self.waiting.is_empty() && self.parked.is_empty() {
                return None;
            }
            if let Err(e) = self.advance() {
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
    use crate::models::tiny::{TinyConfig, tiny};
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
                tch::no_grad(|| model.forward(&Tensor::from_slice(&seq).unsqueeze(0), None))
                    .unwrap();
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

    /// Sampling on the device (the GPU path, run here on the CPU) generates the host path's
    /// text: greedily token for token, and with temperature, top-k (distribution only, see
    /// `device_sampling`) and top-p from the same per-sample draws; log-probabilities agree.
    #[test]
    fn device_sampling_generates_the_host_text() {
        crate::device::set_cpu_threads(1);
        let (m, tok) = model();
        let ps = prompts(&tok, &["hello", "a much longer prompt here", "x", "yz"]);
        let run = |params: &SamplingParams, sampling: SamplingPlace| {
            generate(
                &m,
                &tok,
                ps.clone(),
                params.clone(),
                EngineOptions {
                    max_batch: 3,
                    sampling,
                    ..EngineOptions::default()
                },
            )
            .unwrap()
        };
        let sampled = SamplingParams {
            max_new_tokens: 40,
            seed: 9,
            n: 3,
            temperature: 0.9,
            top_p: 0.9,
            ..SamplingParams::default()
        };
        for params in [greedy(30), sampled] {
            let host = run(&params, SamplingPlace::Host);
            let device = run(&params, SamplingPlace::Device);
            assert_eq!(host.len(), device.len());
            for (h, d) in host.iter().zip(&device) {
                assert_eq!(h.token_ids, d.token_ids, "{params:?}");
                assert_eq!(h.finish, d.finish);
                for (a, b) in h.logprobs.iter().zip(&d.logprobs) {
                    assert!((a - b).abs() < 1e-4, "{a} vs {b}");
                }
            }
        }
    }

    /// Generates prompts `[a, b)` of `all` on one engine until `after` steps, releases what is
    /// unfinished (`kv`: with cache rows), adopts it into an engine generating prompts `[b, ..)`
    /// and returns every sample of both, by (batch prompt, sample).
    fn migrated(
        all: &[Vec<i64>],
        b: usize,
        after: usize,
        kv: bool,
        max_batch: usize,
    ) -> Vec<Sample> {
        let (m, tok) = model();
        let params = SamplingParams {
            max_new_tokens: 20,
            seed: 5,
            n: 2,
            stop_at_eos: false,
            top_k: 40,
            ..SamplingParams::default()
        };
        let opts = |first| EngineOptions {
            max_batch,
            first_prompt: first,
            ..EngineOptions::default()
        };
        let mut out = Vec::new();
        let keep = |g: &Generation, s: Vec<Sample>, out: &mut Vec<Sample>| {
            for mut x in s {
                x.prompt_index = g.batch_index(x.prompt_index);
                out.push(x);
            }
        };
        let mut src =
            generate_stream(&m, &tok, all[..b].to_vec(), params.clone(), opts(0)).unwrap();
        for _ in 0..after {
            let done = src.step().unwrap();
            keep(&src, done, &mut out);
        }
        let moving = src.release(kv).unwrap();
        assert!(
            moving.iter().any(|x| !x.tokens.is_empty()),
            "nothing had started"
        );
        assert_eq!(src.pending(), 0);
        assert_eq!(
            moving.iter().all(|x| x.kv.is_some() || x.tokens.is_empty()),
            kv
        );
        let mut dst = generate_stream(&m, &tok, all[b..].to_vec(), params, opts(b)).unwrap();
        dst.adopt(moving).unwrap();
        while dst.pending() > 0 {
            let done = dst.step().unwrap();
            keep(&dst, done, &mut out);
        }
        out.sort_by_key(|s| (s.prompt_index, s.sample_index));
        out
    }

    #[test]
    fn a_released_sample_continues_its_text_on_another_engine() {
        crate::device::set_cpu_threads(1);
        let (m, tok) = model();
        let all = prompts(&tok, &["one", "two prompts", "three", "four!", "five"]);
        let params = SamplingParams {
            max_new_tokens: 20,
            seed: 5,
            n: 2,
            stop_at_eos: false,
            top_k: 40,
            ..SamplingParams::default()
        };
        let reference = generate(&m, &tok, all.clone(), params, EngineOptions::default()).unwrap();
        // Migrated with their caches and prefilled again; with a batch of 3 some samples of the
        // first engine are still waiting (not started) when it releases them.
        for (kv, max_batch) in [(true, 32), (false, 32), (true, 3), (false, 3)] {
            let got = migrated(&all, 3, 6, kv, max_batch);
            assert_eq!(got.len(), reference.len());
            for (a, b) in reference.iter().zip(&got) {
                assert_eq!(
                    (a.prompt_index, a.sample_index, &a.token_ids, &a.text),
                    (b.prompt_index, b.sample_index, &b.token_ids, &b.text),
                    "kv {kv}, batch {max_batch}"
                );
            }
        }
    }

    #[test]
    fn samples_reallocated_mid_generation_keep_their_texts() {
        crate::device::set_cpu_threads(1);
        let (m, tok) = model();
        let all = prompts(&tok, &["one", "two prompts", "three", "four!"]);
        let params = SamplingParams {
            max_new_tokens: 20,
            seed: 5,
            n: 2,
            stop_at_eos: false,
            top_k: 40,
            ..SamplingParams::default()
        };
        let opts = EngineOptions {
            max_batch: 5,
            ..EngineOptions::default()
        };
        let reference = generate(&m, &tok, all.clone(), params.clone(), opts.clone()).unwrap();
        for kv in [true, false] {
            let mut out = Vec::new();
            let mut a =
                generate_stream(&m, &tok, all.clone(), params.clone(), opts.clone()).unwrap();
            for _ in 0..4 {
                for mut x in a.step().unwrap() {
                    x.prompt_index = a.batch_index(x.prompt_index);
                    out.push(x);
                }
            }
            let before = a.pending();
            let mut lengths = a.running_lengths();
            lengths.sort_unstable();
            let waiting = before - lengths.len();
            let moving = a.release_some(4, kv).unwrap();
            assert_eq!((moving.len(), a.pending()), (4, before - 4));
            // Waiting samples go first, then the running ones with the fewest tokens.
            let mut started: Vec<usize> = moving
                .iter()
                .map(|x| x.tokens.len())
                .filter(|&l| l > 0)
                .collect();
            started.sort_unstable();
            assert_eq!(started.len(), 4 - waiting.min(4));
            assert_eq!(started, lengths[..started.len()]);
            let mut b = generate_stream(
                &m,
                &tok,
                vec![all[0].clone()],
                params.clone(),
                EngineOptions {
                    first_prompt: 99,
                    ..opts.clone()
                },
            )
            .unwrap();
            // `b` has a prompt of its own (batch index 99) and takes the four.
            b.adopt(moving).unwrap();
            for g in [&mut a, &mut b] {
                while g.pending() > 0 {
                    for mut x in g.step().unwrap() {
                        x.prompt_index = g.batch_index(x.prompt_index);
                        out.push(x);
                    }
                }
            }
            out.retain(|x| x.prompt_index != 99);
            out.sort_by_key(|s| (s.prompt_index, s.sample_index));
            assert_eq!(out.len(), reference.len());
            for (x, y) in reference.iter().zip(&out) {
                assert_eq!(
                    (x.prompt_index, x.sample_index, &x.token_ids),
                    (y.prompt_index, y.sample_index, &y.token_ids),
                    "kv {kv}"
                );
            }
        }
    }

    #[test]
    fn a_migrant_that_does_not_fit_the_model_is_refused() {
        let (m, tok) = model();
        let mut g = generate_stream(
            &m,
            &tok,
            prompts(&tok, &["a"]),
            SamplingParams::default(),
            EngineOptions::default(),
        )
        .unwrap();
        let bad = Migrant {
            batch_index: 0,
            sample_index: 0,
            prompt: vec![1, 2],
            tokens: vec![i64::MAX],
            logprobs: vec![0.0],
            rng: 0,
            kv: None,
        };
        assert!(g.adopt(vec![bad]).is_err());
    }

    #[test]
    fn imposed_lengths_end_each_sample_at_its_drawn_length() {
        crate::device::set_cpu_threads(1);
        let (m, tok) = model();
        let lengths = TargetLengths {
            dist: LengthDist::Uniform { lo: 2, hi: 30 },
            seed: 9,
        };
        let params = SamplingParams {
            max_new_tokens: 24,
            seed: 1,
            n: 3,
            ..SamplingParams::default()
        };
        assert!(params.stop_at_eos);
        let out = generate(
            &m,
            &tok,
            prompts(&tok, &["one", "two prompts", "three"]),
            params,
            EngineOptions {
                first_prompt: 4,
                lengths: Some(lengths.clone()),
                ..EngineOptions::default()
            },
        )
        .unwrap();
        let eos = tok.special().eos.clone();
        let mut distinct = std::collections::BTreeSet::new();
        for s in &out {
            let want = lengths.of(4 + s.prompt_index, s.sample_index);
            let len = s.token_ids.len();
            distinct.insert(len);
            if want <= 24 {
                assert_eq!(len, want, "{s:?}");
                assert_eq!(s.finish, FinishReason::Eos);
                assert!(eos.contains(&s.token_ids[len - 1]));
            } else {
                assert_eq!((len, &s.finish), (24, &FinishReason::Length));
            }
            // No end-of-sequence token before the end.
            assert!(s.token_ids[..len - 1].iter().all(|t| !eos.contains(t)));
            assert!(s.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0));
        }
        assert!(distinct.len() > 3, "{distinct:?}");
        // Speculation would verify drafts without the mask: refused.
        let refused = generate_stream(
            &m,
            &tok,
            prompts(&tok, &["one"]),
            SamplingParams::default(),
            EngineOptions {
                lengths: Some(lengths),
                speculate: SpeculateMode::Ngram(2),
                ..EngineOptions::default()
            },
        );
        assert!(refused.is_err());
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
            EngineOptions {
                max_batch: 12,
                ..EngineOptions::default()
            },
        )
        .unwrap();
        // Small batches force continuous batching: rows free up and later samples take them.
        let small = generate(
            &m,
            &tok,
            all.clone(),
            params.clone(),
            EngineOptions {
                max_batch: 2,
                ..EngineOptions::default()
            },
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
            EngineOptions {
                max_batch: 5,
                ..EngineOptions::default()
            },
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
            EngineOptions {
                max_batch: 3,
                ..EngineOptions::default()
            },
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
        let (rx, handle) = spawn_generation(
            m,
            tok,
            ps,
            params,
            EngineOptions {
                max_batch: 2,
                ..EngineOptions::default()
            },
        );
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
