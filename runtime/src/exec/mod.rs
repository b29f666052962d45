//! The executor of an [`ExecPlan`]: runs the task graph of one iteration `steps` times on the
//! runtime — generation, inference streamed under generation, `fn` kernels through the JIT,
//! element-wise arithmetic, losses and training — with checkpoints and per-step metrics. It
//! runs what the plan decided: which calls stream and in what chunks, how each call splits
//! its sequences into micro-batches, how each `generate` speculates, which log-probabilities
//! come from a training forward pass; it decides none of these itself.
//!
//! **Streaming (inter-stage fusion on one machine).** The `logprobs`, `values` and `score`
//! nodes that read a rollout directly run on micro-batches of finished samples while
//! generation goes on in another thread. A `Tensor` is `Send` but not `Sync`, so two threads
//! cannot share one model: when a model that generates is also trained, generation runs on a
//! replica of it whose weights are copied from the trained model after every update (the way
//! RLHF systems keep their inference engine's weights). Every other model is used by one
//! thread at a time.
//!
//! **Determinism.** Every random choice derives from the run's seed and the step: sampling
//! seeds, data order, mini-batch shuffles. Checkpoints hold the trained models' weights, the
//! optimizer state, the data cursors and the step, so a resumed run computes the same numbers
//! as an uninterrupted one (on the CPU, at a fixed thread count).
//!
//! This module must not print: progress goes to the caller through [`Event`]s.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Instant;

use braid_cost::sim::Span;
use braid_ir::exec_plan::ExecPlan;
use braid_ir::graph::{ArithOp, Const, ModelSource, ModelSpec, NodeId, Op, Operand, Plan};
use braid_ir::kernel::{Arg, Batch, KernelExec, Output, ParamKind, Ragged, SampleText, ScalarTy};
use braid_jit::{CompiledKernel, Jit};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::exec::data::{Dataset, Record};
use crate::generation::engine::{
    EngineOptions, FinishReason, Sample, TargetLengths, generate_stream,
};
use crate::generation::sampling::SamplingParams;
use crate::generation::spec::SpeculateMode;
use crate::models::model::{Head, LoadOptions, Model};
use crate::models::tiny::{TinyConfig, TinyVocab, tiny_in};
use crate::models::tokenizer::{ChatMessage, Tokenizer};
use crate::rng::{Rng, derive};
use crate::training::checkpoint::{self, State};
use crate::training::infer::{self, InferOptions, Rollout};
use crate::training::objective::{self, Layout};
use crate::training::optim::AdamW;

mod comm;
mod compute;
pub mod data;
mod eval;
mod migrate;
mod pipelined;
pub mod realloc;
mod record;
mod reshard;
mod setup;
pub(super) mod stream;
pub mod tensorboard;
mod tokens;
pub(crate) mod train;
mod values;

use comm::Comm;
pub use comm::{
    DistOptions, all_gather_bytes, mesh_groups, migrates, prompt_block, reallocates, stream_pairs,
    tail_deciders, tail_pairs,
};
use compute::*;
pub use record::fingerprint;
use record::*;
use setup::*;
use tokens::*;
use values::*;
pub use values::{decode_samples, encode_samples};

/// How to run a plan.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Where checkpoints, metrics and the plan are written.
    pub run_dir: PathBuf,
    /// Relative model and data paths are read from here (the program's directory).
    pub base_dir: PathBuf,
    /// Continue from the run directory's latest checkpoint.
    pub resume: bool,
    /// libtorch threads of each working thread.
    pub threads: usize,
    /// Stop after this many steps in all (the plan's `steps` when `None`).
    pub steps: Option<i64>,
    /// Checkpoint every K steps (the plan's `checkpoint_every` when `None`); 0: only at the end.
    pub checkpoint_every: Option<i64>,
    pub device: Device,
    /// The world of a multi-process run (`None`: one process).
    pub dist: Option<DistOptions>,
    /// Output lengths imposed on every training generation, for benchmarks (`braid run
    /// --gen-lengths`): each sample ends at a length drawn from this distribution.
    pub gen_lengths: Option<braid_cost::sim::LengthDist>,
    /// How migrated samples travel: with their KV cache (`Some(true)`), prefilled again where
    /// they land (`Some(false)`), or as the cost model prefers for the plan's devices (`None`).
    pub migrate_kv: Option<bool>,
    /// No sample reallocation between a generation's replicas (`braid run --reallocate off`).
    pub no_realloc: bool,
    /// Re-chooses a migrating generation's threshold and kept instances from the lengths its
    /// last iteration produced (`None`: the plan's choice throughout).
    pub tail_tuner: Option<TailTuner>,
    /// Every other step (the 2nd, 4th, …) runs without streaming: inference waits for the
    /// whole batch, as in the plan with its streams taken out, on the same placement (`braid
    /// run --alternate-streaming`). Streaming's gain is then measured side by side in one run,
    /// where the machine's drift weighs on both alike; each step records `unstreamed` (1 or 0).
    pub alternate_streaming: bool,
}

/// Chooses long-tail migration from observed output lengths: called with the generation, the
/// lengths of every sample of its last iteration and the most instances it may keep (the
/// plan's); returns the threshold and instances to keep, or `None` where streaming without
/// migration is faster. Every rank calls it with the same arguments and must get the same
/// answer (the binary simulates the plan: a deterministic computation).
#[derive(Clone)]
pub struct TailTuner(pub Arc<TailTunerFn>);

/// What a [`TailTuner`] calls.
pub type TailTunerFn =
    dyn Fn(NodeId, &[u64], u64) -> std::result::Result<Option<(u64, u64)>, String> + Send + Sync;

impl std::fmt::Debug for TailTuner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TailTuner")
    }
}

/// How a generation's replicas exchange samples as the run goes: its long-tail migration (the
/// plan's choice, then what the observed lengths choose, unless `migrate below` pinned it) and
/// reallocation.
#[derive(Clone, Debug)]
pub(super) struct TailState {
    /// This iteration's choice (`None`: it does not migrate).
    pub(super) current: Option<TailChoice>,
    /// The plan's choice (`None`: the plan does not migrate this generation).
    pub(super) planned: Option<TailChoice>,
    pub(super) pinned: bool,
    /// Started samples travel with their KV cache (else they are prefilled again).
    pub(super) kv: bool,
    /// What decides reallocation before the tail (`None`: off).
    pub(super) realloc: Option<migrate::Realloc>,
}

/// Migrate when no more than `threshold` samples are unfinished, onto `kept` instances.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TailChoice {
    pub(super) threshold: u64,
    pub(super) kept: u64,
}

/// What the executor reports as it goes.
#[derive(Debug)]
pub enum Event<'a> {
    /// The run starts (or resumes) at `first_step` of `total`.
    Start { first_step: i64, total: i64 },
    /// Step `step` (1-based) finished with these metrics; `samples` are the generations it
    /// wrote to `samples.jsonl`.
    Step {
        step: i64,
        total: i64,
        metrics: &'a BTreeMap<String, f64>,
        samples: &'a [serde_json::Value],
    },
    /// A checkpoint of step `step` was written.
    Checkpoint { step: i64, dir: &'a Path },
    /// The held-out prompts were evaluated after `step` steps (0: before training); `metrics`
    /// holds the `eval/…` values (with the step's, when it follows a step).
    Eval {
        step: i64,
        metrics: &'a BTreeMap<String, f64>,
    },
}

/// Which copy of a model a call runs on, on this rank: the whole model, one pipeline stage's
/// share of it (a pipeline-parallel `train`), and either cut for tensor parallelism over the
/// `tp` consecutive ranks from `tp_first` (the same key on every rank of that group).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Share {
    pub(super) stage: u64,
    pub(super) stages: u64,
    pub(super) tp: u64,
    /// The global rank of the group's tensor rank 0 (0 when `tp` is 1).
    pub(super) tp_first: u64,
}

impl Share {
    pub(super) const WHOLE: Share = Share {
        stage: 0,
        stages: 1,
        tp: 1,
        tp_first: 0,
    };

    /// The ranks of its tensor-parallel group, in tensor-rank order.
    pub(super) fn tp_ranks(&self) -> Vec<usize> {
        (self.tp_first..self.tp_first + self.tp.max(1))
            .map(|r| r as usize)
            .collect()
    }

    /// Whether `rank` speaks for its tensor-parallel group (its tensor rank 0): the one whose
    /// results are gathered, where every rank of the group computes the same.
    pub(super) fn leads(&self, rank: usize) -> bool {
        self.tp <= 1 || self.tp_first as usize == rank
    }

    fn describe(&self) -> String {
        let mut s = if self.stages > 1 {
            format!("stage {} of {}", self.stage, self.stages)
        } else {
            "the whole model".to_string()
        };
        if self.tp > 1 {
            s.push_str(&format!(
                " cut over tensor-parallel ranks {}..{}",
                self.tp_first,
                self.tp_first + self.tp
            ));
        }
        s
    }
}

/// A model of the run, as this rank holds it: one copy per way its calls here hold it (the
/// whole model, or a pipeline stage's share), which reshards keep in step.
struct Slot {
    spec: ModelSpec,
    /// The copy the model trains on here (its training layout's, with the optimizer), or
    /// else the first its calls here use; `None` on ranks where no call of the model runs.
    model: Option<Model>,
    /// Which copy `model` is.
    home: Share,
    /// The other copies this rank's calls of the model run on.
    views: BTreeMap<Share, Model>,
    /// Every rank has every model's tokenizer: prompts are encoded and samples decoded
    /// wherever their values are needed.
    tokenizer: Tokenizer,
    opt: Option<AdamW>,
    /// Optimizer steps over the whole run (for the learning-rate schedule).
    total_opt_steps: i64,
    /// A copy that generation uses while the streamed consumers use `model`.
    replica: Option<Model>,
    /// Whether `replica` missed an update of its share in a step without streaming (which
    /// generates on the share's copy): refreshed before it generates again.
    replica_stale: bool,
    /// Which copy `replica` mirrors (the generation's share), refreshed from it.
    replica_share: Share,
    /// This rank's stage of the pipeline it trains in (pipeline-parallel trainings).
    pipeline: Option<crate::models::pipeline::Pipeline>,
}

impl Slot {
    /// The weights, which a verified plan puts on every rank that runs a call of the model.
    fn model(&self) -> Result<&Model> {
        self.model.as_ref().ok_or_else(|| {
            Error::invalid(
                format!("model `{}`", self.spec.name),
                "is not on this rank (the plan runs none of its calls here)",
            )
        })
    }

    fn model_mut(&mut self) -> Result<&mut Model> {
        let name = self.spec.name.clone();
        self.model.as_mut().ok_or_else(|| {
            Error::invalid(
                format!("model `{name}`"),
                "is not on this rank (the plan runs none of its calls here)",
            )
        })
    }

    /// The copy `c` of the model, which must hold its weights (not released since its last
    /// use without a reshard refilling it).
    fn copy(&self, c: Share) -> Result<&Model> {
        let m = self.copy_any(c)?;
        if m.is_released() {
            return Err(Error::invalid(
                format!("model `{}`", self.spec.name),
                format!(
                    "its copy for {} was released after its last use in the iteration and no reshard refilled it",
                    c.describe()
                ),
            ));
        }
        Ok(m)
    }

    /// Brings the generation replica up to its share's copy when a step without streaming left
    /// it behind (`RunOptions::alternate_streaming`).
    fn refresh_stale_replica(&mut self) -> Result<()> {
        if self.replica_stale
            && let Some(r) = self.replica.as_ref()
        {
            setup::copy_weights(r, self.copy(self.replica_share)?)?;
        }
        self.replica_stale = false;
        Ok(())
    }

    /// The copy `c`, released or not.
    fn copy_any(&self, c: Share) -> Result<&Model> {
        if c == self.home && self.model.is_some() {
            return self.model();
        }
        self.views.get(&c).ok_or_else(|| {
            Error::invalid(
                format!("model `{}`", self.spec.name),
                format!("has no copy for {} on this rank", c.describe()),
            )
        })
    }

    fn copy_mut(&mut self, c: Share) -> Result<&mut Model> {
        if c == self.home && self.model.is_some() {
            return self.model_mut();
        }
        let name = self.spec.name.clone();
        self.views.get_mut(&c).ok_or_else(|| {
            Error::invalid(
                format!("model `{name}`"),
                format!("has no copy for {} on this rank", c.describe()),
            )
        })
    }

    /// The whole model (what one process runs every call on).
    fn whole(&self) -> Result<&Model> {
        self.copy(Share::WHOLE)
    }

    /// Every copy this rank holds, the generation replica included.
    fn copies_mut(&mut self) -> impl Iterator<Item = &mut Model> {
        self.model
            .as_mut()
            .into_iter()
            .chain(self.views.values_mut())
            .chain(self.replica.as_mut())
    }
}

/// The executor.
pub struct Executor<'p> {
    exec: &'p ExecPlan,
    /// `exec.plan`: the graph, models, datasets and settings.
    plan: &'p Plan,
    options: RunOptions,
    /// This rank and its groups.
    comm: Comm,
    slots: Vec<Slot>,
    datasets: Vec<Dataset>,
    cursors: Vec<u64>,
    kernels: BTreeMap<NodeId, Arc<CompiledKernel>>,
    order: Vec<NodeId>,
    /// The rollout that the (first) trained model learns from, and the node of its reward.
    main_rollout: Option<NodeId>,
    reward_node: Option<NodeId>,
    /// `logprobs` nodes of a trained model whose values are taken from that model's training
    /// forward pass instead of a separate inference pass.
    reused: BTreeSet<NodeId>,
    /// `score` calls of a reward model whose tokenizer differs from the generating model's:
    /// they score the rollout's text re-tokenised (`tokens.rs`).
    retokenize: BTreeSet<NodeId>,
    total_steps: i64,
    first_step: i64,
    /// The generations of the last step to record in `samples.jsonl`.
    last_samples: Vec<serde_json::Value>,
    /// What this rank ran in the current step and when (seconds from the step's start).
    timeline: Vec<Span>,
    /// This rank's stage of each inference call that runs through pipeline stages.
    infer_pipes: BTreeMap<NodeId, crate::models::pipeline::Pipeline>,
    /// Per model call: the copies (model, share) whose last use in an iteration it is, released
    /// after the transfers that follow it (a reshard refills them before their next use).
    release_after: BTreeMap<NodeId, Vec<(usize, Share)>>,
    /// Per generation whose replicas exchange samples (`comm::reallocates`).
    tails: BTreeMap<NodeId, TailState>,
    /// Migrations started so far (each counts its finished samples under a key of its own).
    tail_round: u64,
    /// Per call, the calls whose transfers wait to run just before it (`transfers_defer`).
    deferred_transfers: BTreeMap<NodeId, Vec<NodeId>>,
    /// When this rank started its current step, in seconds since the Unix epoch (the one clock
    /// every rank's timeline is set on).
    step_started: f64,
    /// Whether the current step runs without streaming (`RunOptions::alternate_streaming`).
    streams_off: bool,
}

impl Executor<'_> {
    /// The consumers streamed under `generate` in the current step: the plan's, or none in a
    /// step that runs without streaming.
    fn streamed(&self, generate: NodeId) -> Vec<(NodeId, u64)> {
        if self.streams_off {
            Vec::new()
        } else {
            self.exec.streamed(generate)
        }
    }

    /// `generate(policy)`: how a call is named in timelines.
    fn call_name(&self, id: NodeId) -> String {
        match self.plan.graph.node(id) {
            Some(n) => match n.op.model().and_then(|m| self.plan.models.get(m as usize)) {
                Some(m) => format!("{}({})", n.op.name(), m.name),
                None => n.op.name().to_string(),
            },
            None => id.to_string(),
        }
    }

    /// Records that this rank ran node `id` from `start` to `end` (seconds into the step).
    fn span(&mut self, step: i64, id: NodeId, stage: &str, start: f64, end: f64) {
        let label = match self.plan.graph.node(id).map(|n| &n.op) {
            Some(Op::Kernel { func, .. }) => func.clone(),
            _ => self.call_name(id),
        };
        self.timeline.push(Span {
            device: self.comm.rank,
            iteration: step as u32,
            task: format!("{id} {label}"),
            stage: stage.to_string(),
            label,
            start,
            end,
        });
    }
}

impl<'p> Executor<'p> {
    /// After call `id` ran (or was skipped here): its transfers and the release of the copies
    /// they read, now or — when they may wait (`transfers_wait`) — at the end of the step.
    fn after_call(
        &mut self,
        id: NodeId,
        at_end: &mut Vec<NodeId>,
        step: i64,
        t_step: Instant,
    ) -> Result<()> {
        if self.transfers_wait(id) {
            at_end.push(id);
            return Ok(());
        }
        if let Some(before) = self.transfers_defer(id) {
            self.deferred_transfers.entry(before).or_default().push(id);
            return Ok(());
        }
        self.run_transfers(id, step, t_step)
    }

    /// Runs the transfers deferred to just before call `before` (`transfers_defer`), in the
    /// order of the calls they follow.
    fn transfers_before(&mut self, before: NodeId, step: i64, t_step: Instant) -> Result<()> {
        for after in self.deferred_transfers.remove(&before).unwrap_or_default() {
            self.run_transfers(after, step, t_step)?;
        }
        Ok(())
    }

    /// Where the transfers after call `id` may wait until just before a later call of this
    /// iteration: they are all reshards into calls later in the order (none streamed under a
    /// generation, whose reshards run before it starts), no call of a model they move runs in
    /// between, and the earliest of those later calls is returned — or, where sooner, the
    /// first training on `id`'s devices before them. Then the ranks that only
    /// receive go on with their own calls first instead of waiting at once for the call `id`
    /// to end elsewhere (`logprobs(ref)` on one rank beside `logprobs(policy)` on another,
    /// the policy's weights moving to its training afterwards), as the plan's schedule and the
    /// simulator run them. Every rank decides the same from the plan, so the transfers still
    /// meet in the same order everywhere.
    fn transfers_defer(&self, id: NodeId) -> Option<NodeId> {
        if self.comm.is_single() {
            return None;
        }
        let g = &self.plan.graph;
        let pos = |n: NodeId| self.order.iter().position(|&x| x == n);
        let at = pos(id)?;
        let streamed = |c: NodeId| {
            self.order.iter().any(|&n| {
                matches!(g.node(n).map(|x| &x.op), Some(Op::Generate { .. }))
                    && self.streamed(n).iter().any(|(s, _)| *s == c)
            })
        };
        let mut first: Option<usize> = None;
        for n in g.node_ids() {
            match g.node(n).map(|x| &x.op) {
                Some(Op::Reshard {
                    model,
                    after,
                    before,
                    ..
                }) if *after == id => {
                    let b = pos(*before).filter(|&b| b > at)?;
                    if streamed(*before) || self.calls_model(&self.order[at + 1..b], *model) {
                        return None;
                    }
                    // Not past a training on the devices the transfer leaves from: those
                    // ranks would reach it only after training, and the ranks waiting for
                    // them would wait that long (the critic's reshard after `values(critic)`
                    // held past `train(policy)` on the same rank serialized the two trainings
                    // the plan runs side by side on two ranks; docs/benchmarks.md, stop 44).
                    // Shorter calls it may pass, as the other ranks' own calls meanwhile.
                    let b = (at + 1..b)
                        .find(|&k| self.trains_on_devices_of(self.order[k], id))
                        .unwrap_or(b);
                    first = Some(first.map_or(b, |f| f.min(b)));
                }
                Some(Op::Offload { after, .. }) if *after == id => return None,
                _ => {}
            }
        }
        first.map(|b| self.order[b])
    }

    /// Whether `call` is a training placed on any device of call `of`'s placement.
    fn trains_on_devices_of(&self, call: NodeId, of: NodeId) -> bool {
        let trains = matches!(
            self.plan.graph.node(call).map(|x| &x.op),
            Some(Op::Train { .. })
        );
        match (self.exec.placement(call), self.exec.placement(of)) {
            (Some(c), Some(o)) if trains => c.devices().any(|d| o.devices().contains(&d)),
            _ => false,
        }
    }

    /// Whether any of `nodes` is a call of `model`.
    fn calls_model(&self, nodes: &[NodeId], model: u32) -> bool {
        nodes.iter().any(|&n| {
            self.plan
                .graph
                .node(n)
                .is_some_and(|x| x.op.is_model_call() && x.op.model() == Some(model))
        })
    }

    /// Runs the transfers after call `id` and releases the copies they read, with a timeline
    /// span when they take time.
    fn run_transfers(&mut self, id: NodeId, step: i64, t_step: Instant) -> Result<()> {
        let t1 = t_step.elapsed().as_secs_f64();
        self.transfers_after(id)?;
        self.release_copies(id)?;
        let t2 = t_step.elapsed().as_secs_f64();
        if t2 - t1 > 1e-4 {
            self.span(step, id, "transfer", t1, t2);
        }
        Ok(())
    }

    /// Whether the transfers after call `id` may wait for the end of the step: there are some,
    /// every one is a reshard into a call of the next iteration (earlier in the order), and no
    /// later call of this iteration runs on a model they move. Then the ranks that do not take
    /// part in `id` go on with their own calls (a critic training beside the policy's) instead
    /// of waiting for the weights to move. Every rank decides the same from the plan, so the
    /// transfers still meet in the same order everywhere.
    fn transfers_wait(&self, id: NodeId) -> bool {
        if self.comm.is_single() {
            return false;
        }
        let g = &self.plan.graph;
        let pos = |n: NodeId| self.order.iter().position(|&x| x == n);
        let Some(at) = pos(id) else {
            return false;
        };
        let mut any = false;
        for n in g.node_ids() {
            match g.node(n).map(|x| &x.op) {
                Some(Op::Reshard {
                    model,
                    after,
                    before,
                    ..
                }) if *after == id => {
                    let next_iteration = pos(*before).is_some_and(|b| b <= at);
                    if !next_iteration || self.calls_model(&self.order[at + 1..], *model) {
                        return false;
                    }
                    any = true;
                }
                Some(Op::Offload { after, .. }) if *after == id => return false,
                _ => {}
            }
        }
        any
    }

    /// Gathers the rows of the inference calls `ids` (in that order, the same on every rank)
    /// onto every rank, as their values.
    fn gather_pending(
        &mut self,
        ids: &[NodeId],
        ungathered: &mut BTreeMap<NodeId, (Op, Vec<Option<PerSampleOut>>)>,
        vals: &mut BTreeMap<NodeId, Val>,
        (step, t_step): (i64, Instant),
    ) -> Result<()> {
        let mut calls = Vec::new();
        let mut rows = Vec::new();
        for id in ids {
            if let Some((op, r)) = ungathered.remove(id) {
                calls.push((*id, op));
                rows.push(r);
            }
        }
        let Some(&(first, _)) = calls.first() else {
            return Ok(());
        };
        // One exchange for all of them; its wait for the other ranks' rows is on the
        // timeline where it happens.
        let t0 = t_step.elapsed().as_secs_f64();
        let (_, gathered) = stream::gather_with_rows(&self.comm, None, rows)?;
        let names: Vec<String> = calls.iter().map(|(id, _)| self.call_name(*id)).collect();
        self.timeline.push(Span {
            device: self.comm.rank,
            iteration: step as u32,
            task: format!("{first} gather"),
            stage: "gather".into(),
            label: format!("gather: {}", names.join(", ")),
            start: t0,
            end: t_step.elapsed().as_secs_f64(),
        });
        for ((id, op), r) in calls.into_iter().zip(gathered) {
            let r: Option<Vec<PerSampleOut>> = r.into_iter().collect();
            let r = r.ok_or_else(|| {
                Error::invalid("plan", format!("{id}: a replica's results are missing"))
            })?;
            vals.insert(id, collect_rows(&op, r));
        }
        Ok(())
    }
}

/// A `train` with its inputs, ready to run (or waiting for the one it is interleaved with).
struct PendingTrain {
    id: NodeId,
    model: usize,
    rollout: Arc<RolloutData>,
    term: LossTerm,
    epochs: i64,
    minibatches: i64,
    micro: usize,
    seed: u64,
    /// The rollout's node.
    input: Option<NodeId>,
}

/// Generations per step written to `samples.jsonl`: the first sample of each of this many
/// prompts, enough to read what the policy does without the file growing with the batch.
const SAMPLES_PER_STEP: usize = 4;

/// What one step gives back: this rank's metrics, the generated lengths of the main rollout,
/// and its prompts' lengths (one per prompt).
type StepOut = (BTreeMap<String, f64>, Vec<usize>, Vec<usize>);

impl<'p> Executor<'p> {
    /// One iteration of the graph: this rank's metrics, the generated lengths of the main rollout and its
    /// prompts' lengths (one per prompt).
    fn step(&mut self, step: i64) -> Result<StepOut> {
        let t_step = Instant::now();
        self.step_started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.timeline.clear();
        self.deferred_transfers.clear();
        self.streams_off = self.options.alternate_streaming && step % 2 == 1;
        let mut vals: BTreeMap<NodeId, Val> = BTreeMap::new();
        let mut m: BTreeMap<String, f64> = BTreeMap::new();
        let mut time: BTreeMap<&'static str, f64> = BTreeMap::new();
        let mut lengths = Vec::new();
        let mut prompt_lengths = Vec::new();
        // When the rollout and every inference call on it were done (seconds into the step).
        let mut rollout_done: f64 = 0.0;
        // When this rank's generations ended (seconds into the step; none where it generates
        // nothing).
        let mut generated_until: Option<f64> = None;
        let seed = derive(self.plan.seed as u64, step as u64);
        let order = self.order.clone();
        // Trainings waiting for the one they are interleaved with.
        let mut deferred: BTreeMap<NodeId, PendingTrain> = BTreeMap::new();
        // Inference calls whose rows are not gathered yet (see `Executor::infer_call`).
        let mut ungathered: BTreeMap<NodeId, (Op, Vec<Option<PerSampleOut>>)> = BTreeMap::new();
        // Calls whose transfers wait for the end of the step (see `transfers_wait`).
        let mut at_end: Vec<NodeId> = Vec::new();
        for id in order {
            self.transfers_before(id, step, t_step)?;
            if vals.contains_key(&id) {
                continue;
            }
            let Some(node) = self.plan.graph.node(id) else {
                continue;
            };
            let inputs = self.plan.graph.inputs(id);
            // A node that reads a call not exchanged yet waits for one exchange of every call
            // not exchanged yet (each has run by now, and every rank holds the same list):
            // the ones it does not read would otherwise cost an exchange of their own, and a
            // wait for the other ranks, at their first reader.
            let pending: Vec<NodeId> = if inputs.iter().any(|n| ungathered.contains_key(n)) {
                ungathered.keys().copied().collect()
            } else {
                Vec::new()
            };
            if !pending.is_empty() {
                let t0 = t_step.elapsed().as_secs_f64();
                self.gather_pending(&pending, &mut ungathered, &mut vals, (step, t_step))?;
                let t1 = t_step.elapsed().as_secs_f64();
                *time.entry("infer").or_default() += t1 - t0;
                rollout_done = rollout_done.max(t1);
            }
            if node.op.is_model_call() {
                self.reloads_before(id)?;
            }
            let t0 = Instant::now();
            let v = match &node.op {
                Op::Next { dataset, count } => {
                    let d = *dataset as usize;
                    let records = self.datasets[d].draw(self.cursors[d], *count as u64)?;
                    self.cursors[d] += *count as u64;
                    Val::Prompts {
                        records,
                        chat_template: self.datasets[d].chat_template,
                    }
                }
                Op::Generate { .. } => {
                    let early = self.reshards_into_streamed(id)?;
                    let (rollout, streamed, stats) =
                        self.generate(id, &inputs, &vals, derive(seed, u64::from(id.0)))?;
                    let g0 = t0.duration_since(t_step).as_secs_f64();
                    if stats.gen_seconds > 0.0 {
                        self.span(step, id, "generate", g0, g0 + stats.gen_seconds);
                        let end = g0 + stats.gen_seconds;
                        generated_until = Some(generated_until.map_or(end, |t| t.max(end)));
                    }
                    let consumers: Vec<String> = self
                        .streamed(id)
                        .iter()
                        .map(|(c, _)| self.call_name(*c))
                        .collect();
                    for (a, b) in &stats.chunks {
                        self.timeline.push(Span {
                            device: self.comm.rank,
                            iteration: step as u32,
                            task: format!("{id} streamed"),
                            stage: "inference (streamed)".into(),
                            label: format!(
                                "streamed under {}: {}",
                                self.call_name(id),
                                consumers.join(", ")
                            ),
                            start: g0 + a,
                            end: g0 + b,
                        });
                    }
                    let end = t_step.elapsed().as_secs_f64();
                    rollout_done = rollout_done.max(end);
                    // After the generation (and the chunks streamed under it): waiting for the
                    // streams from and to the other ranks to end, then the exchange of the
                    // rollout and the streamed results among all ranks.
                    let busy_until = stats
                        .chunks
                        .iter()
                        .map(|c| c.1)
                        .fold(stats.gen_seconds.max(0.0), f64::max);
                    let exchange = stats.exchange_start.max(busy_until);
                    if exchange - busy_until > 1e-4 {
                        self.span(step, id, "wait", g0 + busy_until, g0 + exchange);
                    }
                    self.span(step, id, "gather", g0 + exchange, end);
                    *time.entry("generate").or_default() += stats.gen_seconds;
                    *time.entry("infer").or_default() += stats.infer_seconds;
                    m.insert("time/infer_hidden".into(), stats.hidden_share());
                    // Summed over ranks, for the share hidden over the whole world.
                    m.insert("stream/infer_s".into(), stats.infer_seconds);
                    m.insert("stream/hidden_s".into(), stats.hidden_seconds);
                    self.record_tail(step, id, g0, &stats, &rollout, &mut m)?;
                    if Some(id) == self.main_rollout {
                        // This rank's own generation (summed over ranks into the step's).
                        if stats.gen_seconds > 0.0 {
                            m.insert(
                                "tokens_per_s".into(),
                                stats.tokens as f64 / stats.gen_seconds.max(1e-9),
                            );
                        }
                        lengths = rollout.lengths();
                        // The prompts' mean length, for `braid report --against-sim`.
                        let prompts: Vec<f64> = rollout
                            .samples
                            .iter()
                            .map(|s| s.rollout.prompt.len() as f64)
                            .collect();
                        if !prompts.is_empty() {
                            m.insert("prompt_length".into(), mean_std(&prompts).0);
                        }
                        let mut seen = BTreeSet::new();
                        prompt_lengths = rollout
                            .samples
                            .iter()
                            .filter(|s| seen.insert(s.prompt_index))
                            .map(|s| s.rollout.prompt.len())
                            .collect();
                    }
                    let consumers: Vec<NodeId> = streamed.iter().map(|(n, _)| *n).collect();
                    for (n, v) in streamed {
                        vals.insert(n, v);
                    }
                    vals.insert(id, Val::Rollout(rollout));
                    self.transfers_after_but(id, &early)?;
                    self.release_copies(id)?;
                    // The streamed consumers ran under the generation: their transfers follow.
                    for c in consumers {
                        self.transfers_after(c)?;
                        self.release_copies(c)?;
                    }
                    continue;
                }
                Op::Logprobs { .. } if self.reused.contains(&id) => {
                    // Filled in by the `train` that reads it (see `reusable_logprobs`).
                    continue;
                }
                Op::Logprobs { model } | Op::Values { model } | Op::Score { model } => {
                    let r = rollout_of(&vals, inputs.first())?;
                    let seqs = self.sequences_of(id, *model, &r)?;
                    let inferred = self.infer_call(id, &node.op, *model, &seqs, r.temperature)?;
                    *time.entry("infer").or_default() += t0.elapsed().as_secs_f64();
                    rollout_done = rollout_done.max(t_step.elapsed().as_secs_f64());
                    match inferred {
                        Inferred::Value(v) => v,
                        Inferred::Rows(rows) => {
                            if self.share_of(id)?.is_some() {
                                let (a, b) = (
                                    t0.duration_since(t_step).as_secs_f64(),
                                    t_step.elapsed().as_secs_f64(),
                                );
                                self.span(step, id, "inference", a, b);
                            }
                            ungathered.insert(id, (node.op.clone(), rows));
                            self.after_call(id, &mut at_end, step, t_step)?;
                            continue;
                        }
                    }
                }
                Op::Kernel { args, .. } => {
                    let k = self.kernels.get(&id).cloned().ok_or_else(|| {
                        Error::invalid("plan", format!("kernel {id} was not compiled"))
                    })?;
                    let v = run_kernel(&k, args, &inputs, &vals)?;
                    *time.entry("kernels").or_default() += t0.elapsed().as_secs_f64();
                    v
                }
                Op::Arith { op, args } => arith(*op, args, &inputs, &vals)?,
                Op::ByPrompt => by_prompt(&inputs, &vals)?,
                Op::Loss { .. } => {
                    // Input 0 is the rollout; the others are the objective's inputs in order.
                    let mut resolved = Vec::new();
                    for (k, n) in inputs.iter().enumerate().skip(1) {
                        resolved.push(if self.reused.contains(n) {
                            LossArg::CurrentLogp
                        } else {
                            match vals.get(n) {
                                Some(Val::PerToken(t)) => LossArg::Tokens(t.clone()),
                                Some(Val::PerSample(s)) => LossArg::Samples(s.clone()),
                                _ => {
                                    return Err(Error::invalid(
                                        "plan",
                                        format!("{id}: loss input {k} is not a value"),
                                    ));
                                }
                            }
                        });
                    }
                    Val::Loss(LossTerm {
                        node: id,
                        args: resolved,
                    })
                }
                // Transfer nodes run right after the call they follow (`transfers_after`),
                // not where the topological order puts them (they have no data inputs).
                Op::Reshard { .. } | Op::Offload { .. } | Op::Reload { .. } => Val::Unit,
                Op::Train {
                    model,
                    epochs,
                    minibatches,
                } => {
                    // The weights this rank holds while it trains, and those released since
                    // their last use (the copies of other layouts, refilled by reshards).
                    let (held, freed) = self
                        .slots
                        .iter_mut()
                        .flat_map(|s| s.copies_mut().map(|m| m.weight_bytes()).collect::<Vec<_>>())
                        .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
                    for (k, v) in [
                        ("memory/weights_mb", held),
                        ("memory/weights_released_mb", freed),
                    ] {
                        let e = m.entry(k.into()).or_insert(0.0);
                        *e = e.max(v as f64 / 1e6);
                    }
                    let r = rollout_of(&vals, inputs.first())?;
                    let term = match inputs.get(1).and_then(|n| vals.get(n)) {
                        Some(Val::Loss(t)) => t.clone(),
                        _ => return Err(Error::invalid("plan", format!("{id}: no loss"))),
                    };
                    let per_minibatch = r.samples.len().div_ceil((*minibatches).max(1) as usize);
                    let micro = self.micro_size(id, per_minibatch);
                    let seed_t = derive(seed, 0x7EA1 ^ u64::from(id.0));
                    let pp = self.exec.placement(id).map_or(1, |p| p.pp);
                    let fused = self
                        .exec
                        .decisions
                        .interleave
                        .iter()
                        .find(|f| f.forward == id || f.reverse == id)
                        .map(|f| (f.forward, f.reverse));
                    let pending = PendingTrain {
                        id,
                        model: *model as usize,
                        rollout: r.clone(),
                        term,
                        epochs: *epochs,
                        minibatches: *minibatches,
                        micro,
                        seed: seed_t,
                        input: inputs.first().copied(),
                    };
                    // A training interleaved with another waits for it (the later in the
                    // order), then both run as one fused schedule.
                    let batch: Vec<PendingTrain> = match fused {
                        Some((f, rv)) => {
                            let partner = if f == id { rv } else { f };
                            match deferred.remove(&partner) {
                                None => {
                                    deferred.insert(id, pending);
                                    continue;
                                }
                                Some(other) => {
                                    if other.id == f {
                                        vec![other, pending]
                                    } else {
                                        vec![pending, other]
                                    }
                                }
                            }
                        }
                        None => vec![pending],
                    };
                    let results: Vec<train::Trained> = if batch.len() > 1 || pp > 1 {
                        let jobs: Vec<pipelined::Job<'_>> = batch
                            .iter()
                            .map(|b| pipelined::Job {
                                id: b.id,
                                model: b.model,
                                rollout: &b.rollout,
                                term: &b.term,
                                epochs: b.epochs,
                                minibatches: b.minibatches,
                                micro: b.micro,
                                seed: b.seed,
                            })
                            .collect();
                        self.train_pipelined(&jobs)?
                    } else {
                        let b = &batch[0];
                        vec![self.train(
                            b.id,
                            b.model,
                            &b.rollout,
                            &b.term,
                            b.epochs,
                            b.minibatches,
                            b.micro,
                            b.seed,
                        )?]
                    };
                    let (a, e) = (
                        t0.duration_since(t_step).as_secs_f64(),
                        t_step.elapsed().as_secs_f64(),
                    );
                    for (b, (stats, own_logp)) in batch.iter().zip(results) {
                        // The reused log-probability nodes of this model on this rollout.
                        for n in self.reused.clone() {
                            let same = self.plan.graph.node(n).and_then(|x| x.op.model())
                                == Some(b.model as u32)
                                && self.plan.graph.inputs(n).first() == b.input.as_ref();
                            if same && let Some(rows) = &own_logp {
                                vals.insert(n, Val::PerToken(Tokens::from_rows(rows)));
                            }
                        }
                        let name = self.slots[b.model].spec.name.clone();
                        for (k, v) in stats {
                            m.insert(format!("{name}/{k}"), v);
                        }
                        if b.id != id {
                            self.span(step, b.id, "train", a, e);
                            vals.insert(b.id, Val::Unit);
                            self.after_call(b.id, &mut at_end, step, t_step)?;
                        }
                    }
                    *time.entry("train").or_default() += t0.elapsed().as_secs_f64();
                    Val::Unit
                }
            };
            let stage = match &node.op {
                Op::Logprobs { .. } | Op::Values { .. } | Op::Score { .. } => Some("inference"),
                Op::Kernel { .. } => Some("kernels"),
                Op::Train { .. } => Some("train"),
                _ => None,
            };
            if let Some(stage) = stage {
                let (a, b) = (
                    t0.duration_since(t_step).as_secs_f64(),
                    t_step.elapsed().as_secs_f64(),
                );
                self.span(step, id, stage, a, b);
            }
            vals.insert(id, v);
            self.after_call(id, &mut at_end, step, t_step)?;
        }
        if let Some(id) = deferred.keys().next() {
            return Err(Error::invalid(
                "plan",
                format!("{id} is interleaved with a training that never ran"),
            ));
        }
        // The results no node of the step read (the metrics below may).
        let rest: Vec<NodeId> = ungathered.keys().copied().collect();
        self.gather_pending(&rest, &mut ungathered, &mut vals, (step, t_step))?;
        if let Some((before, _)) = self.deferred_transfers.pop_first() {
            return Err(Error::invalid(
                "plan",
                format!("transfers wait for {before}, which never ran"),
            ));
        }
        // The transfers into the next iteration's calls, in the order of their calls.
        for id in at_end {
            self.run_transfers(id, step, t_step)?;
        }
        // Rewards, KL and lengths of the rollout the policy learns from.
        if let Some(Val::PerSample(r)) = self.reward_node.and_then(|n| vals.get(&n)) {
            let (mean, std) = mean_std(r);
            m.insert("reward_mean".into(), mean);
            m.insert("reward_std".into(), std);
        }
        self.last_samples = self.sample_lines(step, &vals);
        if let Some(kl) = self.kl_metric(&vals) {
            m.insert("kl".into(), kl);
        }
        if !lengths.is_empty() {
            let l: Vec<f64> = lengths.iter().map(|&x| x as f64).collect();
            m.insert("response_length".into(), mean_std(&l).0);
        }
        for (k, v) in time {
            m.insert(format!("time/{k}"), v);
        }
        m.insert("time/step".into(), t_step.elapsed().as_secs_f64());
        if self.options.alternate_streaming {
            // Which half of an alternating run the step belongs to (`braid report` splits them).
            m.insert("unstreamed".into(), f64::from(u8::from(self.streams_off)));
        }
        // Generation and inference together: the rollout phase of the step.
        m.insert("time/rollout".into(), rollout_done);
        // What the rollout phase took after the generation: the inference and exchanges left
        // (`braid report --against-sim` sets it beside the simulator's).
        if let Some(g) = generated_until {
            m.insert("time/after_generate".into(), (rollout_done - g).max(0.0));
        }
        Ok((m, lengths, prompt_lengths))
    }
}
