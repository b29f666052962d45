//! `braid calibrate`: measures, on the process (or the ranks) it runs on, the constants the cost
//! model prices a device with, and fits them into a [`DeviceSpec`] for a device profile.
//!
//! What is measured, each with the runtime's own code on this device:
//! - matrix products `rows × width` · `width × width` in the device's planning dtype, over a
//!   grid of shapes ([`MatmulRate`]; the cost model interpolates between them);
//! - memory bandwidth (a reduction over a buffer far larger than the caches);
//! - the engine's decode steps and prefill, inference forwards and training micro-batches
//!   (forward, backward) and optimizer steps of tiny Llama models with one and with three
//!   layers. What each costs beyond the cost model's roofline for that shape — priced with the
//!   measured rates above — is split into a part per layer and a part per pass
//!   ([`Overheads`], [`fit`]);
//! - the engine's generations as a run's go: on a thread started for each, the prefill after a
//!   training micro-batch (cold, as a run's generation follows its other work);
//! - with more than one CPU rank, Gloo all-reduces from 4 bytes to 16 MiB over all ranks: kept
//!   as measured ([`DeviceSpec::allreduce`]) and as a latency and a bandwidth
//!   ([`fit_collective`]). GPU collectives (NCCL) are not timed; a GPU profile keeps the
//!   datasheet's interconnect figures.
//!
//! Every rank measures at once, as the ranks of a run compute at once on a shared machine; the
//! figures are averaged over the ranks.

use std::time::Instant;

use braid_cost::cost::{
    CollectiveTime, CostModel, DeviceSpec, Layout, MatmulRate, ModelShape, Overheads,
    attention_scores, model::BYTE_VOCAB,
};
use tch::{Device, Kind, Tensor};

use crate::dist::{ProcessGroup, ReduceOp};
use crate::exec::train::train_forward;
use crate::generation::engine::{EngineOptions, Sample, generate_stream};
use crate::generation::sampling::SamplingParams;
use crate::models::model::{Head, Model};
use crate::models::tiny::{TinyConfig, tiny_in};
use crate::training::infer::{InferOptions, Rollout, logprobs};
use crate::training::objective;
use crate::training::optim::AdamW;
use crate::{Error, Result};

/// The shapes of the matmul grid: rows (tokens of a pass) and widths (hidden sizes).
pub const MATMUL_ROWS: [u64; 6] = [1, 4, 16, 64, 256, 1024];
pub const MATMUL_WIDTHS: [u64; 5] = [32, 64, 128, 256, 512];
/// Layer counts of the tiny models whose passes split overheads per layer and per pass.
pub const LAYERS: [u64; 2] = [1, 3];
/// The tiny models' widths (the examples' sizes, where per-operator costs dominate): the
/// element-wise terms are fitted per unit of width over both.
pub const HIDDENS: [u64; 2] = [64, 128];
const HEADS: u64 = 4;
/// Key-value heads of the tiny model of each width: grouped-query attention at width 64 (2,
/// as Llama models have), one per head at width 128 (as the examples' tiny models have), so
/// that a decode step's attention over the cache, which reads the key-value width, separates
/// from its terms in the width.
fn kv_heads(hidden: u64) -> u64 {
    if hidden >= 128 { HEADS } else { 2 }
}

/// Decode measurements: running rows, prompt length, and the steps whose times are kept: those
/// of a generation of [`NEW_LONG`] tokens after its first [`NEW_SHORT`].
pub const DECODE_ROWS: [u64; 3] = [4, 16, 32];
pub const PROMPT_LEN: usize = 8;
/// Prompt lengths the prefill and the decode steps are timed after (one sample per prompt,
/// [`DECODE_ROWS`] prompts): two, so that what the engine's prefill spends per sample (its
/// first token, its cache rows) separates from what it spends per prompt token, and a decode
/// step's attention over the cache from its other terms; at one length each pair is the same
/// feature of the fit. The examples' prompts run from 7 (the quickstart) to 108 tokens
/// (`chat_tiny`).
pub const PROMPT_LENS: [usize; 2] = [PROMPT_LEN, 64];
const NEW_SHORT: usize = 8;
const NEW_LONG: usize = 40;
/// Generations of [`NEW_LONG`] tokens each decode point is timed over, at least (and for at
/// least twice `--min-seconds`).
const DECODE_GENERATIONS: usize = 3;
/// Inference and training measurements: sequences per pass (down to one, as the examples'
/// inference micro-batches run, and up to 64, as the quickstart's training micro-batch on one
/// rank does: past the largest timed, a pass is priced by extrapolation, and with 16 sequences
/// at most the quickstart's micro-batches of 32 and 64 were priced 10–15 % short of what they
/// measured) and their lengths (several, so that the attention scores' term, which grows with
/// the square of the length, separates from the per-token terms).
pub const PASS_SEQS: [u64; 4] = [1, 4, 16, 64];
pub const PASS_LENS: [usize; 3] = [16, 48, 144];
/// All-reduce sizes in bytes: from a scalar through the runtime's sums of a few f64 (a
/// training's metrics: 24 bytes and up) and a tiny model's gradients (megabytes) to a bucket's
/// worth, closely enough spaced for [`DeviceSpec::allreduce`]'s interpolation: Gloo's times
/// jump between one element and a few (0.2 against 1.3 ms on this machine's two ranks).
pub const COLLECTIVE_BYTES: [u64; 11] = [
    4,
    8,
    24,
    64,
    1 << 10,
    4 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
];

/// Sizes, in bytes over all ranks, of the runtime's exchanges calibration times: from a few
/// metrics through a tiny example's rollout (kilobytes) to a large one's. On 2 ranks the
/// exchange is one all-gather up to 64 KiB and two beyond ([`exchange_inline_bytes`]): both
/// sides of that step are measured.
///
/// [`exchange_inline_bytes`]: braid_cost::cost::exchange_inline_bytes
pub const EXCHANGE_BYTES: [u64; 6] = [64, 1 << 10, 8 << 10, 64 << 10, 256 << 10, 1 << 20];

/// Seconds by which the last rank arrives after the others when calibration times the
/// exchange a second way ([`time_collective`]): the ranks of a run do not finish a call
/// together (on this machine's 2 ranks a tiny example's generations ended 0.2 to 7 ms apart),
/// and the exchange that follows costs the last of them far less than when all arrive at once
/// (`DeviceSpec::allgather`, `CollectiveTime::skew`).
pub const EXCHANGE_SKEWS: [f64; 3] = [0.5e-3, 2e-3, 8e-3];

/// How long and on what to measure.
#[derive(Clone, Debug)]
pub struct Options {
    /// Each timing repeats until at least this long has passed in all (and at least twice in
    /// each of its rounds).
    pub min_seconds: f64,
    /// How many times every timing on the rank itself (products, memory, the tiny models'
    /// passes) is taken, a whole round of them apart, each for `min_seconds / rounds`; the
    /// profile keeps their mean. A machine whose speed moves over seconds then weighs on a
    /// timing as on a run's steps, instead of as a sample of one moment.
    pub rounds: usize,
    pub device: Device,
    /// The dtype the device plans with (f32 on a CPU, bf16 on a GPU).
    pub kind: Kind,
}

/// One timing of a pass of a tiny model: its width, its layers, its rows (running samples of a decode
/// step or prefill, sequences of a forward or micro-batch; 0 for an optimizer step), the
/// tokens of each sequence of a forward or micro-batch (0 for the others) and the seconds it
/// took.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PassPoint {
    pub hidden: u64,
    pub layers: u64,
    pub rows: u64,
    #[serde(default)]
    pub len: u64,
    pub secs: f64,
}

/// The timings of each pass kind on the tiny models, over [`LAYERS`] and two row counts.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PassTimes {
    /// Seconds per decode step (the mean of generations' steps past their first
    /// [`NEW_SHORT`], each timed by the engine) after prompts of `len` tokens (0:
    /// [`PROMPT_LEN`]).
    pub decode_step: Vec<PassPoint>,
    /// Seconds of the prefill: a generation of one token from `rows` prompts of `len` tokens
    /// (`len` 0: [`PROMPT_LEN`]).
    pub prefill: Vec<PassPoint>,
    /// Seconds of one inference forward over `rows` sequences of `len` tokens ([`PASS_LENS`]).
    pub forward: Vec<PassPoint>,
    /// Seconds of one training micro-batch's forward and backward over the same sequences.
    pub train_microbatch: Vec<PassPoint>,
    /// Seconds of one optimizer step.
    pub optimizer: Vec<PassPoint>,
}

impl PassTimes {
    /// Every kind's timings, in one fixed order.
    fn all(&self) -> [&Vec<PassPoint>; 5] {
        [
            &self.decode_step,
            &self.prefill,
            &self.forward,
            &self.train_microbatch,
            &self.optimizer,
        ]
    }

    fn all_mut(&mut self) -> [&mut Vec<PassPoint>; 5] {
        [
            &mut self.decode_step,
            &mut self.prefill,
            &mut self.forward,
            &mut self.train_microbatch,
            &mut self.optimizer,
        ]
    }
}

/// Everything measured, before fitting.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Measurements {
    pub matmul: Vec<MatmulRate>,
    /// The same shapes through Braid's own product kernel, which the engine's cached steps
    /// (prefill, decode) multiply with on a CPU in f32 (empty elsewhere).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub step_matmul: Vec<MatmulRate>,
    /// Bytes per second read by a reduction over a large buffer.
    pub mem_bandwidth: f64,
    pub passes: PassTimes,
    /// `(bytes, seconds)` of all-reduces over every rank (empty on one rank).
    pub allreduce: Vec<(u64, f64)>,
    /// `(bytes in all, seconds)` of the runtime's exchanges among every rank (empty on one
    /// rank).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allgather: Vec<(u64, f64)>,
    /// `(skew, bytes in all, seconds)` of the same exchanges when the last rank arrives `skew`
    /// seconds after the others: its own time ([`EXCHANGE_SKEWS`]; empty on one rank).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allgather_apart: Vec<(f64, u64, f64)>,
    /// Ranks that measured at once.
    pub ranks: usize,
    /// Per repetition of the same training micro-batch started on every rank at once: the
    /// slowest rank's time over the ranks' mean, less 1 (empty on one rank).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rank_excess: Vec<f64>,
}

/// Seconds per repetition of `f`, repeated for at least `min_seconds` (and twice), after one
/// untimed warm-up call.
fn time(min_seconds: f64, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let start = Instant::now();
    let mut reps = 0u32;
    loop {
        f()?;
        reps += 1;
        let elapsed = start.elapsed().as_secs_f64();
        if reps >= 2 && elapsed >= min_seconds {
            return Ok(elapsed / f64::from(reps));
        }
    }
}

/// Seconds of a decode step: the mean wall time of the steps from the `from`-th on of each
/// generation's step log (`Generation::step_log`). Each step is timed where it runs, so a
/// generation's prefill and its thread's start, which last as long as many steps, weigh
/// nothing; and the mean over every step, slow ones with the fast, is what a run's
/// generation pays on average (its times are means over steps).
fn mean_step(logs: &[Vec<f64>], from: usize) -> Option<f64> {
    let steps: Vec<f64> = logs
        .iter()
        .flat_map(|log| log.iter().skip(from).copied())
        .collect();
    (!steps.is_empty()).then(|| steps.iter().sum::<f64>() / steps.len() as f64)
}

/// Seconds per call of `f`, each call after one of `before` (untimed), over `reps` calls after
/// one untimed pair.
fn time_after(
    reps: u32,
    mut before: impl FnMut() -> Result<()>,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    before()?;
    f()?;
    let mut total = 0.0;
    for _ in 0..reps.max(1) {
        before()?;
        let start = Instant::now();
        f()?;
        total += start.elapsed().as_secs_f64();
    }
    Ok(total / f64::from(reps.max(1)))
}

/// Repetitions of each cold prefill timing (each after a training micro-batch), and that
/// micro-batch's sequences and tokens per sequence.
const COLD_REPS: u32 = 12;
const COLD_SEQS: u64 = 16;
const COLD_LEN: usize = 48;

/// The tiny model of width `hidden` with `layers` layers that the pass measurements run.
pub fn tiny_config(hidden: u64, layers: u64) -> TinyConfig {
    TinyConfig {
        layers: layers as i64,
        hidden: hidden as i64,
        heads: HEADS as i64,
        kv_heads: kv_heads(hidden) as i64,
        intermediate: 4 * hidden as i64,
        ..TinyConfig::default()
    }
}

/// The cost model's shape of [`tiny_config`].
pub fn tiny_shape(hidden: u64, layers: u64) -> Result<ModelShape> {
    ModelShape::tiny(
        layers,
        hidden,
        HEADS,
        Some(kv_heads(hidden)),
        Some(4 * hidden),
        BYTE_VOCAB,
    )
    .map_err(|e| Error::invalid("calibrate", e.to_string()))
}

/// Runs every measurement on this process; with `group`, every rank runs them at once, the
/// figures are averaged over the ranks and the all-reduces are timed.
pub fn measure(options: &Options, group: Option<&ProcessGroup>) -> Result<Measurements> {
    let rounds = options.rounds.max(1);
    let each = Options {
        min_seconds: options.min_seconds / rounds as f64,
        ..options.clone()
    };
    let taken = (0..rounds)
        .map(|_| measure_here(&each))
        .collect::<Result<Vec<_>>>()?;
    let mut m = mean_of_rounds(taken);
    m.ranks = group.map_or(1, |g| g.size());
    if let Some(g) = group {
        average_over(g, &mut m)?;
        m.rank_excess = measure_rank_excess(options, g)?;
    }
    // The group is Gloo's: its all-reduces are what CPU ranks use. A GPU's collectives run
    // on NCCL, which this measurement does not time; its datasheet figures stay.
    if let Some(g) = group.filter(|_| options.device == Device::Cpu) {
        for &bytes in &COLLECTIVE_BYTES {
            let mut t = Tensor::zeros([(bytes / 4).max(1) as i64], (Kind::Float, options.device));
            let secs = time_collective(g, 0.0, || Ok(g.all_reduce(&mut t, ReduceOp::Sum)?))?;
            m.allreduce.push((bytes, secs));
        }
        // The runtime's exchange among its ranks (rollouts, inference rows, metrics), through
        // its own function: every rank's share of `bytes` to every rank.
        let n = g.size() as u64;
        for &bytes in &EXCHANGE_BYTES {
            let share = vec![7u8; (bytes / n).max(1) as usize];
            for skew in std::iter::once(0.0).chain(EXCHANGE_SKEWS) {
                let secs = time_collective(g, skew, || {
                    crate::exec::all_gather_bytes(g, share.clone()).map(|_| ())
                })?;
                if skew == 0.0 {
                    m.allgather.push((bytes, secs));
                } else {
                    m.allgather_apart.push((skew, bytes, secs));
                }
            }
        }
    }
    Ok(m)
}

/// The timings on this rank alone, once: products, memory bandwidth, the tiny models' passes.
fn measure_here(options: &Options) -> Result<Measurements> {
    let _guard = tch::no_grad_guard();
    let opts = (options.kind, options.device);
    let mut matmul = Vec::new();
    for &width in &MATMUL_WIDTHS {
        let w = Tensor::randn([width as i64, width as i64], opts);
        for &rows in &MATMUL_ROWS {
            let a = Tensor::randn([rows as i64, width as i64], opts);
            let secs = time(options.min_seconds, || {
                let c = a.matmul(&w);
                sync(&c, options.device);
                Ok(())
            })?;
            matmul.push(MatmulRate {
                rows,
                width,
                flops: 2.0 * (rows * width * width) as f64 / secs,
            });
        }
    }
    // The engine's cached steps (prefill, decode) on a CPU in f32 multiply with Braid's kernel
    // (the host step, `kernels::step`), at rates of their own: the same shapes through it.
    let mut step_matmul = Vec::new();
    if options.device == Device::Cpu && options.kind == Kind::Float {
        for &width in &MATMUL_WIDTHS {
            let n = width as usize;
            let w: Vec<f32> = (0..n * n)
                .map(|i| ((i * 7919) % 1000) as f32 * 1e-3)
                .collect();
            for &rows in &MATMUL_ROWS {
                let m = rows as usize;
                let x: Vec<f32> = (0..m * n)
                    .map(|i| ((i * 104_729) % 1000) as f32 * 1e-3)
                    .collect();
                let mut out = vec![0f32; m * n];
                let secs = time(options.min_seconds, || {
                    crate::kernels::gemm::product(&x, &w, None, m, n, n, &mut out);
                    Ok(())
                })?;
                step_matmul.push(MatmulRate {
                    rows,
                    width,
                    flops: 2.0 * (rows * width * width) as f64 / secs,
                });
            }
        }
    }
    // 256 MiB of f32: far beyond any cache, read once per repetition.
    let big = Tensor::ones([64 << 20], (Kind::Float, options.device));
    let secs = time(options.min_seconds, || {
        let s = big.sum(Kind::Float);
        sync(&s, options.device);
        Ok(())
    })?;
    let mem_bandwidth = (256u64 << 20) as f64 / secs;
    drop(big);
    let mut passes = PassTimes::default();
    for &hidden in &HIDDENS {
        for &layers in &LAYERS {
            measure_passes(options, hidden, layers, &mut passes)?;
        }
    }
    Ok(Measurements {
        matmul,
        step_matmul,
        mem_bandwidth,
        passes,
        ..Measurements::default()
    })
}

/// The rounds' timings as one: each pass's seconds their mean, each rate the work over the
/// mean of its seconds (the harmonic mean of the rates). Every round timed the same points
/// in the same order.
fn mean_of_rounds(mut taken: Vec<Measurements>) -> Measurements {
    if taken.len() < 2 {
        return taken.pop().unwrap_or_default();
    }
    let n = taken.len() as f64;
    let mut m = taken.pop().unwrap_or_default();
    let rate = |r: f64| if r > 0.0 { 1.0 / r } else { 0.0 };
    let back = |t: f64| if t > 0.0 { n / t } else { 0.0 };
    for r in m.matmul.iter_mut().chain(m.step_matmul.iter_mut()) {
        r.flops = rate(r.flops);
    }
    m.mem_bandwidth = rate(m.mem_bandwidth);
    for o in &taken {
        for (r, x) in m
            .matmul
            .iter_mut()
            .chain(m.step_matmul.iter_mut())
            .zip(o.matmul.iter().chain(&o.step_matmul))
        {
            r.flops += rate(x.flops);
        }
        m.mem_bandwidth += rate(o.mem_bandwidth);
        for (mine, theirs) in m.passes.all_mut().into_iter().zip(o.passes.all()) {
            for (p, q) in mine.iter_mut().zip(theirs) {
                p.secs += q.secs;
            }
        }
    }
    for r in m.matmul.iter_mut().chain(m.step_matmul.iter_mut()) {
        r.flops = back(r.flops);
    }
    m.mem_bandwidth = back(m.mem_bandwidth);
    for v in m.passes.all_mut() {
        for p in v.iter_mut() {
            p.secs /= n;
        }
    }
    m
}

/// Seconds per call of the collective `f` over `g`, as a run meets it: after every rank has
/// computed for [`COLLECTIVE_GAP`] since a barrier, one timed call. With `skew` 0 the ranks
/// arrive together, as the ranks of a data-parallel call would if they ran at one speed: the
/// slowest rank's mean over [`COLLECTIVE_REPS`] calls, after one untimed call. With a `skew`,
/// the last rank computes that much longer, and the time is its own mean: what the call costs
/// the rank that everyone waited for, which is what a run's ranks, finishing their calls
/// apart, meet (docs/planning.md, the calibration's collectives). Back to back, the same
/// collectives took a fraction of the together time on this machine's ranks: a run never
/// issues them so, and timing them so priced its exchanges short.
fn time_collective(g: &ProcessGroup, skew: f64, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    g.barrier()?;
    f()?;
    let work = Tensor::ones([128, 128], (Kind::Float, Device::Cpu));
    let last = g.rank() + 1 == g.size();
    let gap = COLLECTIVE_GAP + if last { skew } else { 0.0 };
    let mut total = 0.0;
    for _ in 0..COLLECTIVE_REPS {
        g.barrier()?;
        let computing = Instant::now();
        while computing.elapsed().as_secs_f64() < gap {
            let _ = std::hint::black_box(work.matmul(&work));
        }
        let start = Instant::now();
        f()?;
        total += start.elapsed().as_secs_f64();
    }
    let mine = if skew == 0.0 || last {
        total / COLLECTIVE_REPS as f64
    } else {
        0.0
    };
    let mut secs = Tensor::from_slice(&[mine]);
    g.all_reduce(&mut secs, ReduceOp::Max)?;
    Ok(secs.double_value(&[0]))
}

/// Seconds every rank computes before each timed collective ([`time_collective`]): about as
/// long as a tiny example's calls between two of its exchanges.
const COLLECTIVE_GAP: f64 = 0.02;

/// Timed calls per collective and size ([`time_collective`]).
const COLLECTIVE_REPS: usize = 16;

fn sync(t: &Tensor, device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
    std::hint::black_box(t);
}

/// Times the tiny model with `layers` layers: generation (two lengths, two batch sizes),
/// inference forwards and training micro-batches (two sizes), and an optimizer step.
fn measure_passes(options: &Options, hidden: u64, layers: u64, out: &mut PassTimes) -> Result<()> {
    let (mut model, tokenizer) = tiny_in(
        &tiny_config(hidden, layers),
        Head::Lm,
        options.kind,
        options.device,
    )?;
    // The work a run's generation follows (see the prefill below): a training micro-batch of
    // a second model of the same shape.
    let (other, _) = tiny_in(
        &tiny_config(hidden, layers),
        Head::Lm,
        options.kind,
        options.device,
    )?;
    let other_seqs = sequences(COLD_SEQS, COLD_LEN);
    let mut other_step = train_microbatch(&other, &other_seqs, options.device)?;
    let mut between = || tch::with_grad(&mut other_step);
    for rows in DECODE_ROWS {
        let prompts = |len: usize| -> Vec<Vec<i64>> {
            (0..rows as usize)
                .map(|p| {
                    (0..len)
                        .map(|t| 3 + ((p * 31 + t * 7) % 200) as i64)
                        .collect()
                })
                .collect()
        };
        let threads = tch::get_num_threads().max(1) as usize;
        // One generation of `new` tokens per prompt, as a run generates (`exec/stream.rs`): on
        // a thread started for it, which pays for its start and its cold state. Returns the
        // wall time of each of its decode steps.
        let mut generate_once = |prompts: &[Vec<i64>], new: usize| -> Result<Vec<f64>> {
            let params = SamplingParams {
                max_new_tokens: new,
                // Sampled at temperature 1, as training rollouts are.
                greedy: false,
                stop_at_eos: false,
                ..SamplingParams::default()
            };
            let (m, tok, prompts) = (&mut model, &tokenizer, prompts.to_vec());
            let (samples, steps) = std::thread::scope(|s| {
                s.spawn(move || -> Result<(Vec<Sample>, Vec<f64>)> {
                    crate::device::set_cpu_threads(threads);
                    let mut g = generate_stream(m, tok, prompts, params, EngineOptions::default())?;
                    let samples = g.by_ref().collect::<Result<Vec<_>>>()?;
                    let steps = g.step_log().iter().map(|r| r.secs).collect();
                    Ok((samples, steps))
                })
                .join()
            })
            .map_err(|_| Error::invalid("calibrate", "the generation thread panicked"))??;
            if samples.iter().any(|s| s.token_ids.len() != new) {
                return Err(Error::invalid(
                    "calibrate",
                    "a calibration sample stopped before its length",
                ));
            }
            Ok(steps)
        };
        // Decode steps after prompts of two lengths: attention over the cache grows with it.
        // Generations of `NEW_LONG` tokens, one untimed, then at least `DECODE_GENERATIONS`
        // for at least twice `min_seconds`; each step's own wall time, from the engine's step
        // log, past the first `NEW_SHORT` of each (so that the steps' mean context is
        // `decode_context`'s).
        let mut steps = Vec::new();
        for len in PROMPT_LENS {
            let p = prompts(len);
            generate_once(&p, NEW_LONG)?;
            let start = Instant::now();
            let mut logs = Vec::new();
            while logs.len() < DECODE_GENERATIONS
                || start.elapsed().as_secs_f64() < 2.0 * options.min_seconds
            {
                logs.push(generate_once(&p, NEW_LONG)?);
            }
            let step = mean_step(&logs, NEW_SHORT).ok_or_else(|| {
                Error::invalid(
                    "calibrate",
                    "a calibration generation logged no decode step",
                )
            })?;
            steps.push(step);
            out.decode_step.push(PassPoint {
                hidden,
                layers,
                rows,
                len: len as u64,
                secs: step,
            });
        }
        // The prefill as a run meets it: its generation starts after the iteration's other
        // work (a training micro-batch here, of a model of the same shape), whose memory
        // traffic and freed allocations leave the generation's weights, scratch and cache
        // pages cold, and it admits the prefilled rows into the running batch before its
        // first decode step. So: a generation of two tokens per prompt after a training
        // micro-batch, less one warm decode step timed above. (Timed back to back, the
        // prefill of `ppo_tiny`'s 8 prompts took about 1.5 ms where its runs took 2.5–3.4 ms
        // in their first step, read with temporary timing: docs/benchmarks.md; a one-token
        // generation leaves out the admission.)
        for (len, step) in PROMPT_LENS.into_iter().zip(steps) {
            let p = prompts(len);
            let secs = time_after(COLD_REPS, &mut between, || generate_once(&p, 2).map(drop))?;
            out.prefill.push(PassPoint {
                hidden,
                layers,
                rows,
                len: len as u64,
                secs: (secs - step).max(0.0),
            });
        }
    }
    let mut optimizer = AdamW::new(&model, optimizer_config())?;
    for len in PASS_LENS {
        for rows in PASS_SEQS {
            measure_pass(options, &model, hidden, layers, rows, len, out)?;
        }
    }
    // AdamW over every parameter (the gradients of the micro-batches above are there).
    let secs = tch::with_grad(|| {
        time(options.min_seconds, || {
            optimizer.step(1e-4, None);
            Ok(())
        })
    })?;
    out.optimizer.push(PassPoint {
        hidden,
        layers,
        rows: 0,
        len: 0,
        secs,
    });
    Ok(())
}

/// Times an inference forward and a training micro-batch of `model` over `rows` sequences of
/// `len` tokens (half prompt, half completion).
fn measure_pass(
    options: &Options,
    model: &Model,
    hidden: u64,
    layers: u64,
    rows: u64,
    len: usize,
    out: &mut PassTimes,
) -> Result<()> {
    let seqs = sequences(rows, len);
    let infer = InferOptions {
        micro_batch: rows as usize,
        temperature: 1.0,
    };
    let point = |secs| PassPoint {
        hidden,
        layers,
        rows,
        len: len as u64,
        secs,
    };
    out.forward.push(point(time(options.min_seconds, || {
        logprobs(model, &seqs, &infer).map(|_| ())
    })?));
    // Training: a micro-batch as the runtime's `train` runs it.
    let mut step = train_microbatch(model, &seqs, options.device)?;
    let secs = tch::with_grad(|| time(options.min_seconds, &mut step))?;
    out.train_microbatch.push(point(secs));
    Ok(())
}

/// `rows` sequences of `len` tokens (half prompt, half completion) of made-up token ids.
fn sequences(rows: u64, len: usize) -> Vec<Rollout> {
    (0..rows as usize)
        .map(|s| {
            let ids: Vec<i64> = (0..len)
                .map(|t| 3 + ((s * 13 + t * 5) % 200) as i64)
                .collect();
            Rollout {
                prompt: ids[..len / 2].to_vec(),
                completion: ids[len / 2..].to_vec(),
            }
        })
        .collect()
}

/// A training micro-batch of `model` over `seqs` as the runtime's `train` runs it — the
/// forward with gradients and the completion tokens' log-probabilities and entropy
/// (`train_forward`), PPO's clipped objective evaluated on them (`objective::evaluate`), the
/// loss and entropy read back for the step's metrics, and the backward — as a closure to time
/// (under `tch::with_grad`).
fn train_microbatch<'a>(
    model: &'a Model,
    seqs: &'a [Rollout],
    device: Device,
) -> Result<impl FnMut() -> Result<()> + 'a> {
    let lens: Vec<usize> = seqs.iter().map(|r| r.completion.len()).collect();
    let groups: Vec<usize> = (0..seqs.len()).collect();
    let layout = objective::Layout::new(&lens, &groups, &lens, &groups);
    let tokens: usize = lens.iter().sum();
    let ppo = ppo_objective()?;
    let inputs = [
        Tensor::zeros([tokens as i64], (Kind::Float, device)),
        Tensor::ones([seqs.len() as i64], (Kind::Float, device)),
    ];
    Ok(move || {
        let refs: Vec<&Rollout> = seqs.iter().collect();
        let out = train_forward(model, &refs, 1.0, Head::Lm, false)?;
        let ev = objective::evaluate(
            &ppo,
            &inputs,
            &objective::Outputs {
                logp: out.logp.as_ref(),
                entropy: out.entropy.as_ref(),
                value: None,
            },
            &layout,
        )?;
        let _loss = ev.loss.double_value(&[]);
        if let Some(e) = &out.entropy {
            let _entropy = e.detach().sum(Kind::Float).double_value(&[]);
        }
        ev.loss.backward();
        Ok(())
    })
}

/// Repetitions of [`measure_rank_excess`].
pub const SPREAD_REPS: usize = 24;

/// How far apart the ranks finish the same work started at once: [`SPREAD_REPS`] times, every
/// rank runs one training micro-batch of the width-128, 3-layer tiny model over 4 sequences of
/// 48 tokens (about as long as a tiny example's call) right after a barrier; per repetition,
/// the slowest rank's time over the ranks' mean, less 1.
fn measure_rank_excess(options: &Options, g: &ProcessGroup) -> Result<Vec<f64>> {
    let (model, _) = tiny_in(&tiny_config(128, 3), Head::Lm, options.kind, options.device)?;
    let seqs = sequences(4, 48);
    let mut step = train_microbatch(&model, &seqs, options.device)?;
    let n = g.size() as f64;
    tch::with_grad(|| {
        step()?;
        let mut out = Vec::with_capacity(SPREAD_REPS);
        for _ in 0..SPREAD_REPS {
            g.barrier()?;
            let start = Instant::now();
            step()?;
            if let Device::Cuda(i) = options.device {
                tch::Cuda::synchronize(i as i64);
            }
            let secs = start.elapsed().as_secs_f64();
            let mut most = Tensor::from_slice(&[secs]);
            let mut sum = Tensor::from_slice(&[secs]);
            g.all_reduce(&mut most, ReduceOp::Max)?;
            g.all_reduce(&mut sum, ReduceOp::Sum)?;
            let mean = sum.double_value(&[0]) / n;
            if mean > 0.0 {
                out.push(most.double_value(&[0]) / mean - 1.0);
            }
        }
        Ok(out)
    })
}

/// The ranks' spread ([`DeviceSpec::rank_spread`]: standard deviation over mean) from the
/// slowest rank's excess over the mean in each repetition on `ranks` ranks: their mean over
/// the expected largest of `ranks` standard normal draws. `None` on one rank or without
/// repetitions.
pub fn rank_spread(excess: &[f64], ranks: usize) -> Option<f64> {
    if ranks < 2 || excess.is_empty() {
        return None;
    }
    let mean = excess.iter().sum::<f64>() / excess.len() as f64;
    Some(mean.max(0.0) / braid_cost::cost::expected_max_normal(ranks as u64))
}

/// PPO's clipped surrogate (clip 0.2) with its clip fraction, as `std::ppo`'s `ppo_loss`
/// lowers: the objective the calibration's training micro-batches evaluate.
fn ppo_objective() -> Result<braid_ir::loss::Objective> {
    use braid_ir::loss::{BinOp, InputKind, ModelOutput, ObjectiveBuilder, UnOp};
    let mut b = ObjectiveBuilder::new("ppo_loss");
    let old = b.input(InputKind::PerToken);
    let adv = b.input(InputKind::PerSample);
    let logp = b.model(ModelOutput::Logp);
    let d = b.binary(BinOp::Sub, logp, old);
    let ratio = b.unary(UnOp::Exp, d);
    let (lo, hi) = (b.float(0.8), b.float(1.2));
    let a1 = b.binary(BinOp::Mul, adv, ratio);
    let pg1 = b.unary(UnOp::Neg, a1);
    let c = b.clamp(ratio, lo, hi);
    let a2 = b.binary(BinOp::Mul, adv, c);
    let pg2 = b.unary(UnOp::Neg, a2);
    let pg = b.binary(BinOp::Max, pg1, pg2);
    let one = b.float(1.0);
    let dev = b.binary(BinOp::Sub, ratio, one);
    let dev = b.unary(UnOp::Abs, dev);
    let clip = b.float(0.2);
    let clipped = b.binary(BinOp::Gt, dev, clip);
    b.metric("clip_frac", clipped);
    let loss = b.batch_sum(pg);
    b.finish(loss)
        .map_err(|e| Error::invalid("calibrate", format!("the PPO objective: {e}")))
}

fn optimizer_config() -> braid_ir::graph::Optimizer {
    braid_ir::graph::Optimizer {
        lr: 1e-4,
        weight_decay: 0.0,
        eps: 1e-8,
        beta1: 0.9,
        beta2: 0.999,
        warmup: 0,
        schedule: braid_ir::settings::LrSchedule::Constant,
    }
}

/// Replaces every rank's compute figures by their mean over the ranks.
fn average_over(g: &ProcessGroup, m: &mut Measurements) -> Result<()> {
    let mut flat: Vec<f64> = m
        .matmul
        .iter()
        .chain(&m.step_matmul)
        .map(|r| r.flops)
        .collect();
    flat.push(m.mem_bandwidth);
    for v in m.passes.all() {
        flat.extend(v.iter().map(|x| x.secs));
    }
    let mut t = Tensor::from_slice(&flat);
    g.all_reduce(&mut t, ReduceOp::Avg)?;
    let flat: Vec<f64> = Vec::<f64>::try_from(&t).map_err(Error::Torch)?;
    let mut it = flat.into_iter();
    for r in m.matmul.iter_mut().chain(m.step_matmul.iter_mut()) {
        r.flops = it.next().unwrap_or(r.flops);
    }
    m.mem_bandwidth = it.next().unwrap_or(m.mem_bandwidth);
    for v in m.passes.all_mut() {
        for x in v.iter_mut() {
            x.secs = it.next().unwrap_or(x.secs);
        }
    }
    Ok(())
}

/// Latency and bandwidth of a ring all-reduce over `ranks` ranks from `(bytes, seconds)`
/// points: the least-squares line `t = α + 2(n−1)/n · bytes / bw`. `None` when fewer than two
/// sizes were measured or the fit has no positive slope.
pub fn fit_collective(points: &[(u64, f64)], ranks: usize) -> Option<(f64, f64)> {
    if points.len() < 2 || ranks < 2 {
        return None;
    }
    let n = ranks as f64;
    let xs: Vec<f64> = points
        .iter()
        .map(|&(b, _)| 2.0 * (n - 1.0) / n * b as f64)
        .collect();
    let ys: Vec<f64> = points.iter().map(|&(_, t)| t).collect();
    let k = xs.len() as f64;
    let (mx, my) = (xs.iter().sum::<f64>() / k, ys.iter().sum::<f64>() / k);
    let sxx: f64 = xs.iter().map(|x| (x - mx) * (x - mx)).sum();
    let sxy: f64 = xs.iter().zip(&ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    if sxx <= 0.0 || sxy <= 0.0 {
        return None;
    }
    let slope = sxy / sxx;
    // The smallest message's time is the latency the cost model adds to every collective.
    let latency = points
        .iter()
        .min_by_key(|p| p.0)
        .map(|p| p.1)
        .unwrap_or(0.0);
    Some((latency.max(0.0), 1.0 / slope))
}

/// Least squares: the coefficients `c` minimising `Σ (features(p)·c − y(p))²`, by the normal
/// equations (Gaussian elimination with partial pivoting); `None` when they are singular.
fn least_squares(rows: &[(Vec<f64>, f64)]) -> Option<Vec<f64>> {
    let k = rows.first()?.0.len();
    let mut a = vec![vec![0.0; k + 1]; k];
    for (x, y) in rows {
        for i in 0..k {
            for j in 0..k {
                a[i][j] += x[i] * x[j];
            }
            a[i][k] += x[i] * y;
        }
    }
    for col in 0..k {
        let pivot = (col..k).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-30 {
            return None;
        }
        a.swap(col, pivot);
        let pivot_row = a[col].clone();
        for (r, row) in a.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / pivot_row[col];
                for (v, p) in row.iter_mut().zip(&pivot_row).skip(col) {
                    *v -= f * p;
                }
            }
        }
    }
    Some((0..k).map(|i| a[i][k] / a[i][i]).collect())
}

/// Non-negative least squares: the coefficients `c ≥ 0` minimising `Σ (features(p)·c − y(p))²`.
/// Exact, by enumerating supports: the optimum is the unconstrained least-squares solution on
/// its support, so it is the best of the supports whose solution is non-negative (a fit has at
/// most five terms: 32 small systems). Columns are scaled to unit size first, as the terms'
/// features span twelve orders of magnitude. `None` only without rows.
fn non_negative_least_squares(rows: &[(Vec<f64>, f64)]) -> Option<Vec<f64>> {
    let k = rows.first()?.0.len();
    assert!(k <= 16, "{k} terms: enumerating supports is for a handful");
    let scale: Vec<f64> = (0..k)
        .map(|j| {
            let m = rows.iter().map(|(x, _)| x[j].abs()).fold(0.0, f64::max);
            if m > 0.0 { m } else { 1.0 }
        })
        .collect();
    let residual = |c: &[f64]| -> f64 {
        rows.iter()
            .map(|(x, y)| {
                let fit: f64 = x.iter().zip(c).map(|(a, b)| a * b).sum();
                (fit - y).powi(2)
            })
            .sum()
    };
    let mut best: Option<(f64, Vec<f64>)> = None;
    for support in 1u32..(1 << k) {
        let cols: Vec<usize> = (0..k).filter(|j| support & (1 << j) != 0).collect();
        let reduced: Vec<(Vec<f64>, f64)> = rows
            .iter()
            .map(|(x, y)| (cols.iter().map(|&j| x[j] / scale[j]).collect(), *y))
            .collect();
        let Some(sol) = least_squares(&reduced) else {
            continue;
        };
        if sol.iter().any(|&v| v < 0.0 || !v.is_finite()) {
            continue;
        }
        let mut c = vec![0.0; k];
        for (&j, v) in cols.iter().zip(sol) {
            c[j] = v / scale[j];
        }
        let r = residual(&c);
        if best.as_ref().is_none_or(|(b, _)| r < *b) {
            best = Some((r, c));
        }
    }
    // No support with a non-negative solution: the optimum is to add nothing.
    Some(best.map_or_else(|| vec![0.0; k], |(_, c)| c))
}

/// The device entry the measurements give: `base` (the datasheet entry of the device's kind)
/// with its FLOP/s table, memory bandwidth, per-pass overheads and (with more than one CPU
/// rank) collective constants replaced by the measured ones. Efficiency factors become 1:
/// measured rates are achieved rates. Each pass kind's time beyond the roofline (priced with
/// the measured rates) is fitted to its [`Overheads`] terms by least squares over the tiny
/// models' layer and row counts, with every term non-negative (an overhead is time added).
pub fn fit(base: &DeviceSpec, m: &Measurements) -> Result<DeviceSpec> {
    let mut d = base.clone();
    d.matmul = m.matmul.clone();
    d.step_matmul = m.step_matmul.clone();
    let peak = m.matmul.iter().map(|r| r.flops).fold(0.0, f64::max);
    if peak > 0.0 {
        d.peak_flops = peak;
    }
    d.compute_efficiency = 1.0;
    if m.mem_bandwidth > 0.0 {
        d.mem_bandwidth = m.mem_bandwidth;
        d.memory_efficiency = 1.0;
    }
    d.decode_layer_overhead = 0.0;
    d.overheads = Overheads::default();
    if let Some((latency, bw)) = fit_collective(&m.allreduce, m.ranks) {
        d.intra_node_latency = latency;
        d.intra_node_bandwidth = bw;
        d.network_efficiency = 1.0;
        // The times themselves, which the line does not follow (`DeviceSpec::allreduce`).
        d.allreduce = CollectiveTime::on_ranks(m.ranks as u64, &m.allreduce);
        d.allgather = CollectiveTime::on_ranks(m.ranks as u64, &m.allgather);
        d.allgather.extend(CollectiveTime::apart_on_ranks(
            m.ranks as u64,
            &m.allgather_apart,
        ));
    }
    if let Some(spread) = rank_spread(&m.rank_excess, m.ranks) {
        d.rank_spread = spread;
    }
    // The roofline alone (no overheads), with the rates just measured.
    let cost = CostModel::new(d.clone(), 1).for_dtype(4);
    let p = &m.passes;
    let grid = HIDDENS.len() * LAYERS.len() * DECODE_ROWS.len();
    let passes = HIDDENS.len() * LAYERS.len() * PASS_SEQS.len() * PASS_LENS.len();
    for (v, what, n) in [
        (&p.decode_step, "decode", grid * PROMPT_LENS.len()),
        (&p.prefill, "prefill", grid * PROMPT_LENS.len()),
        (&p.forward, "forward", passes),
        (&p.train_microbatch, "training", passes),
        (&p.optimizer, "optimizer", HIDDENS.len() * LAYERS.len()),
    ] {
        if v.len() != n {
            return Err(Error::invalid(
                "calibrate",
                format!("{} {what} timings; the fit needs {n}", v.len()),
            ));
        }
    }
    let one = Layout::SINGLE;
    let shape = |q: &PassPoint| tiny_shape(q.hidden, q.layers);
    // Every timing weighs by its own length: the fit minimises the relative error, so that a
    // pass of one short sequence (the tiny examples' inference micro-batches) is priced as
    // closely as one of sixteen long ones, whose milliseconds would otherwise outweigh it.
    let relative = |features: Vec<f64>, left: f64, secs: f64| {
        let w = 1.0 / secs.max(1e-6);
        (
            features.into_iter().map(|x| x * w).collect::<Vec<f64>>(),
            left * w,
        )
    };
    let fitted = |rows: Vec<(Vec<f64>, f64)>, what: &str| -> Result<Vec<f64>> {
        non_negative_least_squares(&rows)
            .ok_or_else(|| Error::invalid("calibrate", format!("the {what} timings do not fit")))
    };
    let mut rows = Vec::new();
    for q in &p.decode_step {
        let context = decode_context(q);
        let s = shape(q)?;
        let roof = cost.decode_step_time(&s, one, q.rows, context);
        let (l, b, h) = (q.layers as f64, q.rows as f64, q.hidden as f64);
        let kv = (s.kv_heads * s.head_dim()) as f64;
        rows.push(relative(
            vec![1.0, l, b, l * b * h, l * b * context as f64 * kv],
            q.secs - roof,
            q.secs,
        ));
    }
    let c = fitted(rows, "decode")?;
    d.decode_layer_overhead = c[1];
    let mut o = Overheads {
        decode_step: c[0],
        decode_row: c[2],
        decode_row_layer: c[3],
        decode_cache: c[4],
        ..Overheads::default()
    };
    let tokens = |q: &PassPoint| (q.rows * q.len) as f64;
    let scores = |q: &PassPoint| -> Result<f64> {
        Ok(attention_scores(&shape(q)?, one, q.rows as f64, q.len))
    };
    let mut rows = Vec::new();
    for q in &p.forward {
        let roof = cost.forward_time(&shape(q)?, one, q.rows, q.len);
        let (l, t, h, s) = (q.layers as f64, tokens(q), q.hidden as f64, scores(q)?);
        rows.push(relative(
            vec![1.0, l, t, l * t * h, l * s],
            q.secs - roof,
            q.secs,
        ));
    }
    let c = fitted(rows, "forward")?;
    (
        o.forward,
        o.forward_layer,
        o.forward_token,
        o.forward_token_layer,
        o.forward_score,
    ) = (c[0], c[1], c[2], c[3], c[4]);
    // The prefill is a forward over the prompts: what is left after its forward terms is a
    // fixed part, a part per token, one per token, layer and unit of width and one per sample (its first token, its cache rows): fitted, not
    // averaged, or a prefill of a few rows is priced like one of many.
    let mut rows = Vec::new();
    for q in &p.prefill {
        let len = prefill_len(q);
        let roof = cost.prefill_time(&shape(q)?, one, q.rows, len);
        let t = (q.rows * len) as f64;
        let s = attention_scores(&shape(q)?, one, q.rows as f64, len);
        let left = q.secs - roof - o.forward_terms(q.layers as f64, t, q.hidden as f64, s);
        let (l, h) = (q.layers as f64, q.hidden as f64);
        rows.push(relative(
            vec![1.0, t, l * t * h, q.rows as f64],
            left,
            q.secs,
        ));
    }
    let c = fitted(rows, "prefill")?;
    (
        o.prefill,
        o.prefill_token,
        o.prefill_token_layer,
        o.prefill_sample,
    ) = (c[0], c[1], c[2], c[3]);
    // A micro-batch: its forward (with the forward's terms) and its backward.
    let mut rows = Vec::new();
    for q in &p.train_microbatch {
        let t = cost.train_step_time(&shape(q)?, one, q.rows, q.len, 1, false);
        let (l, tok, h, s) = (q.layers as f64, tokens(q), q.hidden as f64, scores(q)?);
        let left = q.secs - t.forward - t.backward - o.forward_terms(l, tok, h, s);
        rows.push(relative(
            vec![1.0, l, tok, l * tok * h, l * s],
            left,
            q.secs,
        ));
    }
    let c = fitted(rows, "training")?;
    (
        o.microbatch,
        o.backward_layer,
        o.backward_token,
        o.backward_token_layer,
        o.backward_score,
    ) = (c[0], c[1], c[2], c[3], c[4]);
    let mut rows = Vec::new();
    for q in &p.optimizer {
        let t = cost.train_step_time(&shape(q)?, one, 1, PASS_LENS[0] as u64, 1, false);
        rows.push(relative(
            vec![1.0, q.layers as f64],
            q.secs - t.optimizer,
            q.secs,
        ));
    }
    let c = fitted(rows, "optimizer")?;
    (o.train_step, o.optimizer_layer) = (c[0], c[1]);
    d.overheads = o;
    d.check().map_err(|e| Error::invalid("calibrate", e))?;
    Ok(d)
}

/// The mean context of a decode timing's steps: its prompt and half its completions.
fn decode_context(q: &PassPoint) -> u64 {
    prefill_len(q) + ((NEW_SHORT + NEW_LONG) / 2) as u64
}

/// The prompt length of a prefill timing (`len` 0, as written before prefills were timed at
/// several lengths: [`PROMPT_LEN`]).
fn prefill_len(q: &PassPoint) -> u64 {
    if q.len == 0 { PROMPT_LEN as u64 } else { q.len }
}

/// How closely a fitted `spec` prices the timings it was fitted on, per pass kind: the kind,
/// how many timings, the median and the largest relative error (predicted over measured, less
/// one, in absolute value).
pub fn fit_errors(
    spec: &DeviceSpec,
    m: &Measurements,
) -> Result<Vec<(&'static str, usize, f64, f64)>> {
    let cost = CostModel::new(spec.clone(), 1).for_dtype(4);
    let one = Layout::SINGLE;
    let shape = |q: &PassPoint| tiny_shape(q.hidden, q.layers);
    let p = &m.passes;
    let mut out = Vec::new();
    let mut kind = |name: &'static str,
                    v: &[PassPoint],
                    price: &dyn Fn(&PassPoint) -> Result<f64>|
     -> Result<()> {
        let mut errs = Vec::with_capacity(v.len());
        for q in v {
            errs.push((price(q)? / q.secs.max(1e-12) - 1.0).abs());
        }
        if errs.is_empty() {
            return Ok(());
        }
        errs.sort_by(f64::total_cmp);
        out.push((name, errs.len(), errs[errs.len() / 2], errs[errs.len() - 1]));
        Ok(())
    };
    kind("decode steps", &p.decode_step, &|q| {
        Ok(cost.decode_step_time(&shape(q)?, one, q.rows, decode_context(q)))
    })?;
    kind("prefills", &p.prefill, &|q| {
        Ok(cost.prefill_time(&shape(q)?, one, q.rows, prefill_len(q)))
    })?;
    kind("forwards", &p.forward, &|q| {
        Ok(cost.forward_time(&shape(q)?, one, q.rows, q.len))
    })?;
    kind("training micro-batches", &p.train_microbatch, &|q| {
        let t = cost.train_step_time(&shape(q)?, one, q.rows, q.len, 1, false);
        Ok(t.forward + t.backward)
    })?;
    kind("optimizer steps", &p.optimizer, &|q| {
        Ok(cost
            .train_step_time(&shape(q)?, one, 1, PASS_LENS[0] as u64, 1, false)
            .optimizer)
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_cost::cost::DeviceKind;

    #[test]
    fn a_decode_step_is_the_mean_of_the_steps_past_the_first() {
        // Two generations' step logs: their first steps (a cold start) are left out, every
        // later step counts, a slow one with the fast.
        let logs = vec![vec![9.0, 1.0, 1.0, 3.0], vec![7.0, 2.0, 1.0, 1.0]];
        assert_eq!(mean_step(&logs, 1), Some(9.0 / 6.0));
        assert_eq!(mean_step(&logs, 0), Some(25.0 / 8.0));
        assert_eq!(mean_step(&logs, 4), None);
        assert_eq!(mean_step(&[], 0), None);
    }

    #[test]
    fn rounds_keep_the_mean_seconds_of_every_timing() {
        // Two rounds of the same points: a product at 2 and at 1 GFLOP/s (its work in 1 and
        // 2 s: a mean of 1.5 s, so 4/3 GFLOP/s), memory likewise, a pass in 0.1 and 0.3 s.
        let round = |flops: f64, bw: f64, secs: f64| Measurements {
            matmul: vec![MatmulRate {
                rows: 8,
                width: 64,
                flops,
            }],
            mem_bandwidth: bw,
            passes: PassTimes {
                forward: vec![PassPoint {
                    hidden: 64,
                    layers: 1,
                    rows: 8,
                    len: 16,
                    secs,
                }],
                ..PassTimes::default()
            },
            ..Measurements::default()
        };
        let m = mean_of_rounds(vec![round(2e9, 10e9, 0.1), round(1e9, 5e9, 0.3)]);
        assert!((m.matmul[0].flops - 4e9 / 3.0).abs() < 1.0);
        assert!((m.mem_bandwidth - 20e9 / 3.0).abs() < 1.0);
        assert!((m.passes.forward[0].secs - 0.2).abs() < 1e-12);
        assert_eq!((m.matmul[0].rows, m.passes.forward[0].len), (8, 16));
        // One round is itself.
        assert_eq!(
            mean_of_rounds(vec![round(2e9, 10e9, 0.1)]),
            round(2e9, 10e9, 0.1)
        );
    }

    #[test]
    fn a_collective_line_is_recovered() {
        let (alpha, bw) = (50e-6, 2e9);
        let n = 2usize;
        let points: Vec<(u64, f64)> = COLLECTIVE_BYTES
            .iter()
            .map(|&b| (b, alpha + b as f64 / bw))
            .collect();
        let (lat, got) = fit_collective(&points, n).expect("fits");
        assert!((got - bw).abs() / bw < 1e-6, "{got}");
        assert!((lat - alpha).abs() < 1e-5, "{lat}");
        assert_eq!(fit_collective(&points[..1], n), None);
        assert_eq!(fit_collective(&points, 1), None);
    }

    /// Timings made by a cost model with known overheads are fitted back to those overheads.
    #[test]
    fn overheads_priced_by_a_known_spec_are_recovered() {
        let mut truth = DeviceSpec::cpu(5e9, 16 << 30);
        truth.compute_efficiency = 1.0;
        truth.memory_efficiency = 1.0;
        truth.decode_layer_overhead = 40e-6;
        truth.overheads = Overheads {
            decode_step: 300e-6,
            decode_row: 7e-6,
            decode_row_layer: 0.02e-6,
            decode_cache: 0.003e-6,
            prefill: 500e-6,
            prefill_token: 2e-6,
            prefill_token_layer: 0.01e-6,
            prefill_sample: 9e-6,
            forward: 800e-6,
            forward_layer: 60e-6,
            forward_token: 0.3e-6,
            forward_token_layer: 0.002e-6,
            forward_score: 0.001e-6,
            microbatch: 100e-6,
            backward_layer: 120e-6,
            backward_token: 0.5e-6,
            backward_token_layer: 0.004e-6,
            backward_score: 0.003e-6,
            train_step: 90e-6,
            optimizer_layer: 30e-6,
        };
        let cost = CostModel::new(truth.clone(), 1).for_dtype(4);
        let one = Layout::SINGLE;
        let mut p = PassTimes::default();
        for (&hidden, &layers) in HIDDENS
            .iter()
            .flat_map(|h| LAYERS.iter().map(move |l| (h, l)))
        {
            let s = tiny_shape(hidden, layers).unwrap();
            let pt = |rows, len, secs| PassPoint {
                hidden,
                layers,
                rows,
                len,
                secs,
            };
            for rows in DECODE_ROWS {
                for len in PROMPT_LENS.map(|l| l as u64) {
                    let ctx = decode_context(&pt(rows, len, 0.0));
                    p.decode_step
                        .push(pt(rows, len, cost.decode_step_time(&s, one, rows, ctx)));
                    p.prefill
                        .push(pt(rows, len, cost.prefill_time(&s, one, rows, len)));
                }
            }
            for len in PASS_LENS.map(|l| l as u64) {
                for rows in PASS_SEQS {
                    p.forward
                        .push(pt(rows, len, cost.forward_time(&s, one, rows, len)));
                    let t = cost.train_step_time(&s, one, rows, len, 1, false);
                    p.train_microbatch
                        .push(pt(rows, len, t.forward + t.backward));
                }
            }
            let t = cost.train_step_time(&s, one, 1, PASS_LENS[0] as u64, 1, false);
            p.optimizer.push(pt(0, 0, t.optimizer));
        }
        let m = Measurements {
            step_matmul: Vec::new(),
            matmul: MATMUL_WIDTHS
                .iter()
                .flat_map(|&width| {
                    MATMUL_ROWS.iter().map(move |&rows| MatmulRate {
                        rows,
                        width,
                        flops: 5e9,
                    })
                })
                .collect(),
            mem_bandwidth: truth.mem_bandwidth,
            passes: p,
            allreduce: Vec::new(),
            allgather: Vec::new(),
            allgather_apart: Vec::new(),
            ranks: 1,
            rank_excess: Vec::new(),
        };
        let base = DeviceKind::Cpu.spec();
        let got = fit(&base, &m).expect("fits");
        let close = |a: f64, b: f64| (a - b).abs() < 1e-10 + 1e-5 * b.abs();
        assert!(close(got.decode_layer_overhead, 40e-6), "{got:?}");
        let (o, t) = (&got.overheads, &truth.overheads);
        for (name, a, b) in [
            ("decode_step", o.decode_step, t.decode_step),
            ("decode_row", o.decode_row, t.decode_row),
            ("decode_row_layer", o.decode_row_layer, t.decode_row_layer),
            ("decode_cache", o.decode_cache, t.decode_cache),
            ("prefill", o.prefill, t.prefill),
            ("prefill_token", o.prefill_token, t.prefill_token),
            (
                "prefill_token_layer",
                o.prefill_token_layer,
                t.prefill_token_layer,
            ),
            ("prefill_sample", o.prefill_sample, t.prefill_sample),
            ("forward", o.forward, t.forward),
            ("forward_layer", o.forward_layer, t.forward_layer),
            ("forward_token", o.forward_token, t.forward_token),
            (
                "forward_token_layer",
                o.forward_token_layer,
                t.forward_token_layer,
            ),
            ("forward_score", o.forward_score, t.forward_score),
            ("microbatch", o.microbatch, t.microbatch),
            ("backward_layer", o.backward_layer, t.backward_layer),
            ("backward_token", o.backward_token, t.backward_token),
            (
                "backward_token_layer",
                o.backward_token_layer,
                t.backward_token_layer,
            ),
            ("backward_score", o.backward_score, t.backward_score),
            ("train_step", o.train_step, t.train_step),
            ("optimizer_layer", o.optimizer_layer, t.optimizer_layer),
        ] {
            assert!(close(a, b), "{name}: fitted {a}, priced with {b}");
        }
        // One rank: the collective constants stay the datasheet's, and no spread.
        assert_eq!(got.intra_node_latency, base.intra_node_latency);
        assert_eq!(got.rank_spread, 0.0);
        // Two ranks whose slowest finished 5.642 % over their mean: a spread of 0.1 (E[max of
        // two standard normals] = 1/√π = 0.5642).
        // Their all-reduces, kept as measured beside the line through them: Gloo's shape, a
        // scalar quick and a few bytes over a millisecond.
        let allreduce = vec![
            (4, 0.2e-3),
            (24, 1.3e-3),
            (1 << 20, 2.5e-3),
            (4 << 20, 4.5e-3),
        ];
        let allgather = vec![(64, 0.5e-3), (8 << 10, 1.1e-3)];
        // And the same exchanges to a last rank 2 ms late: 0.3 and 0.4 ms.
        let apart = vec![(2e-3, 64, 0.3e-3), (2e-3, 8 << 10, 0.4e-3)];
        let two = Measurements {
            ranks: 2,
            rank_excess: vec![0.04, 0.07284, 0.05642],
            allreduce: allreduce.clone(),
            allgather: allgather.clone(),
            allgather_apart: apart.clone(),
            ..m
        };
        let got = fit(&base, &two).expect("fits");
        assert!((got.rank_spread - 0.1).abs() < 1e-4, "{}", got.rank_spread);
        assert_eq!(got.intra_node_latency, 0.2e-3);
        let kept: Vec<(u64, u64, f64)> = got
            .allreduce
            .iter()
            .map(|c| (c.ranks, c.bytes, c.seconds))
            .collect();
        let want: Vec<(u64, u64, f64)> = allreduce.iter().map(|&(b, t)| (2, b, t)).collect();
        assert_eq!(kept, want);
        let exchanges: Vec<(u64, u64, f64, f64)> = got
            .allgather
            .iter()
            .map(|c| (c.ranks, c.bytes, c.seconds, c.skew))
            .collect();
        let want: Vec<(u64, u64, f64, f64)> = allgather
            .iter()
            .map(|&(b, t)| (2, b, t, 0.0))
            .chain(apart.iter().map(|&(s, b, t)| (2, b, t, s)))
            .collect();
        assert_eq!(exchanges, want);
        let c = CostModel::new(got, 2);
        let priced = c.allreduce_time(24.0, 2, 1);
        assert!((priced - 1.3e-3).abs() < 1e-9, "{priced}");
        let exchange = c
            .host_allgather_time(8192.0, 2)
            .expect("a CPU prices exchanges");
        assert!((exchange - 1.1e-3).abs() < 1e-9, "{exchange}");
        // The skewed entries price the late rank, and leave the together price alone.
        let late = c
            .host_allgather_time_apart(8192.0, 2, 2e-3)
            .expect("a CPU prices exchanges");
        assert!((late - 0.4e-3).abs() < 1e-9, "{late}");
        assert_eq!(c.exchange_skews(2), vec![0.0, 2e-3]);
    }

    #[test]
    fn the_ranks_spread_needs_two_ranks_and_repetitions() {
        assert_eq!(rank_spread(&[0.1], 1), None);
        assert_eq!(rank_spread(&[], 2), None);
        // A slowest rank is never under the mean; below it (rounding) reads as no spread.
        assert_eq!(rank_spread(&[-0.01], 2), Some(0.0));
        let four = rank_spread(&[0.1029375], 4).expect("four ranks");
        assert!((four - 0.1).abs() < 1e-5, "{four}");
    }

    #[test]
    fn least_squares_solves_an_exact_system_and_refuses_a_singular_one() {
        let rows = vec![
            (vec![1.0, 1.0], 3.0),
            (vec![1.0, 2.0], 5.0),
            (vec![1.0, 3.0], 7.0),
        ];
        let c = least_squares(&rows).unwrap();
        assert!(
            (c[0] - 1.0).abs() < 1e-12 && (c[1] - 2.0).abs() < 1e-12,
            "{c:?}"
        );
        assert_eq!(least_squares(&[(vec![1.0, 2.0], 1.0)]), None);
    }

    #[test]
    fn non_negative_least_squares_refits_without_a_term_that_would_go_negative() {
        // y = 2 + 3x exactly: both terms positive, recovered as they are.
        let rows: Vec<(Vec<f64>, f64)> = (0..5)
            .map(|i| (vec![1.0, i as f64], 2.0 + 3.0 * i as f64))
            .collect();
        let c = non_negative_least_squares(&rows).unwrap();
        assert!(
            (c[0] - 2.0).abs() < 1e-9 && (c[1] - 3.0).abs() < 1e-9,
            "{c:?}"
        );
        // y = 10 − x: the unconstrained slope is −1; clamping it would keep the intercept 10
        // and overpredict every point but the first. The constrained optimum drops the slope
        // and refits the intercept to the mean.
        let rows: Vec<(Vec<f64>, f64)> = (0..5)
            .map(|i| (vec![1.0, i as f64], 10.0 - i as f64))
            .collect();
        let unconstrained = least_squares(&rows).unwrap();
        assert!(unconstrained[1] < 0.0, "{unconstrained:?}");
        let c = non_negative_least_squares(&rows).unwrap();
        assert_eq!(c[1], 0.0, "{c:?}");
        assert!((c[0] - 8.0).abs() < 1e-9, "{c:?}");
        // Targets all below zero: nothing is added.
        let rows = vec![(vec![1.0, 1.0], -1.0), (vec![1.0, 2.0], -2.0)];
        assert_eq!(non_negative_least_squares(&rows), Some(vec![0.0, 0.0]));
    }

    /// The exact optimum is no worse than any non-negative point of a grid around it.
    #[test]
    fn non_negative_least_squares_beats_every_non_negative_grid_point() {
        let rows: Vec<(Vec<f64>, f64)> = (0..8)
            .map(|i| {
                let x = i as f64;
                let y = 1.0 + 0.5 * x - 0.3 * x * x + if i % 2 == 0 { 0.2 } else { -0.2 };
                (vec![1.0, x, x * x], y)
            })
            .collect();
        let r = |c: &[f64]| -> f64 {
            rows.iter()
                .map(|(x, y)| (x.iter().zip(c).map(|(a, b)| a * b).sum::<f64>() - y).powi(2))
                .sum()
        };
        let c = non_negative_least_squares(&rows).unwrap();
        assert!(c.iter().all(|&v| v >= 0.0), "{c:?}");
        let best = r(&c);
        for a in 0..=20 {
            for b in 0..=20 {
                for q in 0..=10 {
                    let g = [a as f64 * 0.25, b as f64 * 0.1, q as f64 * 0.01];
                    assert!(best <= r(&g) + 1e-9, "{g:?} fits better than {c:?}");
                }
            }
        }
    }

    #[test]
    fn missing_timings_are_an_error_not_a_panic() {
        let m = Measurements::default();
        let e = fit(&DeviceKind::Cpu.spec(), &m).unwrap_err().to_string();
        assert!(e.contains("timings"), "{e}");
    }
}
