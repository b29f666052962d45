//! Estimates of what a placed plan costs, for the passes' decisions: per-call sizes, times and
//! memory from the cost model, the layouts a call can use on a number of devices, the
//! ReaL-style heuristic placement, parameter-reallocation volumes, and a list schedule of the
//! whole iteration ([`iteration_time`]) — the objective of `place`'s search.
//!
//! These are closed formulas and a cheap list schedule, not the discrete-event simulator
//! (`sim/`), which the CLI and `sample-split` use where streaming and the long tail matter.
//! Nothing here decides; it prices what it is given.

use std::collections::BTreeMap;

use braid_ir::graph::{NodeId, Op};

use crate::annotated::{Annotated, Placement};
use crate::cost::{CostModel, Layout, MemoryNeeds, MemoryUse, ModelShape};
use crate::fused_pipeline::{PipelineModel, PipelineProblem, SearchOptions, lower_bound};
use crate::prng::Rng;

/// How much work one model call does.
#[derive(Clone, Debug, PartialEq)]
pub struct CallSize {
    /// Sequences in the call's rollout (prompts × samples per prompt).
    pub samples: u64,
    /// Samples per prompt (`n` of the `generate`): they share the prompt's prefill.
    pub per_prompt: u64,
    pub prompt_len: u64,
    /// The generation limit of the rollout.
    pub max_new: u64,
    /// Generated lengths drawn from the workload (seeded), one per sample.
    pub lengths: Vec<u64>,
    /// Prompt lengths drawn from the workload (seeded), one per sample (a prompt's samples
    /// share its length); empty when every prompt is `prompt_len` long or no lengths were
    /// drawn.
    pub prompt_lens: Vec<u64>,
    /// Whether passes are priced at the length their micro-batches pad to
    /// ([`CallSize::padded_seq`]): when the workload gives prompt lengths
    /// (`--prompt-lengths`, a run's `prompt-lengths.txt`).
    pub pads: bool,
    /// Sequence length for memory (prompt + limit) and the mean for time.
    pub max_seq: u64,
    pub mean_seq: u64,
    /// `(epochs, minibatches)` of a `train`.
    pub train: Option<(u64, u64)>,
    /// Sequences per forward pass pinned by `micro_batch`.
    pub micro_batch: Option<u64>,
}

/// The size of call `id`, or `None` for a node that is not a model call.
pub fn call_size(a: &Annotated, id: NodeId) -> Option<CallSize> {
    size_of(a, id, true)
}

/// [`call_size`], drawing the generated lengths only when `lengths` (memory needs only the
/// limit; without them `lengths` is empty and `mean_seq` is `max_seq`).
fn size_of(a: &Annotated, id: NodeId, lengths: bool) -> Option<CallSize> {
    let g = &a.plan.graph;
    let node = g.node(id)?;
    if !node.op.is_model_call() {
        return None;
    }
    let gen_id = g.rollout_of(id)?;
    let Op::Generate { params, .. } = &g.node(gen_id)?.op else {
        return None;
    };
    let prompts = g
        .inputs(gen_id)
        .first()
        .and_then(|p| match g.node(*p).map(|n| &n.op) {
            Some(Op::Next { count, .. }) => Some(*count),
            _ => None,
        })
        .unwrap_or(1)
        .max(1) as u64;
    let samples = prompts * params.n.max(1) as u64;
    let max_new = params.max_new_tokens.max(1) as u64;
    let lengths = if lengths {
        sample_lengths(a, gen_id, samples, max_new)
    } else {
        Vec::new()
    };
    let mean = if lengths.is_empty() {
        max_new as f64
    } else {
        lengths.iter().sum::<u64>() as f64 / lengths.len() as f64
    };
    let prompt_len = a.workload.prompt_len.max(1);
    let prompt_lens = match &a.workload.prompt_lengths {
        Some(dist) if !lengths.is_empty() => {
            let mut rng = Rng::new(a.seed ^ (u64::from(gen_id.0) << 32) ^ 0x7072_6f6d_7074);
            let per = params.n.max(1) as u64;
            (0..prompts)
                .flat_map(|_| {
                    let l = dist.sample(&mut rng).max(1);
                    std::iter::repeat_n(l, per as usize)
                })
                .collect()
        }
        _ => Vec::new(),
    };
    let train = match node.op {
        Op::Train {
            epochs,
            minibatches,
            ..
        } => Some((epochs.max(1) as u64, minibatches.max(1) as u64)),
        _ => None,
    };
    Some(CallSize {
        samples,
        per_prompt: params.n.max(1) as u64,
        prompt_len,
        max_new,
        lengths,
        prompt_lens,
        pads: a.workload.prompt_lengths.is_some(),
        max_seq: prompt_len + max_new,
        mean_seq: prompt_len + mean.round() as u64,
        train,
        micro_batch: node.micro_batch.map(|m| m.max(1) as u64),
    })
}

impl CallSize {
    /// The length a pass over `per_pass` sequences pads to, averaged over the passes of the
    /// call: the runtime pads every micro-batch to its longest sequence (prompt and
    /// completion), so a pass over samples of unequal lengths costs its longest one. The
    /// samples go in rollout order, as inference takes them, or `shuffled` (seeded by
    /// `seed`), as training's mini-batches take them. Without drawn lengths, or when the
    /// workload gives no prompt lengths (`pads` false), the mean sequence: the datasheet
    /// entries carry no per-pass overhead, so priced on them the padding alone would make one
    /// sequence per micro-batch look fastest, and on this CPU that trained the quickstart in
    /// 237 ms per step against 121 ms with the calibrated profile's 8 micro-batches.
    pub fn padded_seq(&self, per_pass: u64, shuffled: Option<u64>) -> u64 {
        if self.lengths.is_empty() || !self.pads {
            return self.mean_seq;
        }
        let prompt = |i: usize| self.prompt_lens.get(i).copied().unwrap_or(self.prompt_len);
        let mut seqs: Vec<u64> = (0..self.lengths.len())
            .map(|i| prompt(i) + self.lengths[i])
            .collect();
        if let Some(seed) = shuffled {
            let mut rng = Rng::new(seed);
            // Fisher–Yates, as the runtime shuffles a mini-batch's samples.
            for i in (1..seqs.len()).rev() {
                let j = rng.range_inclusive(0, i as u64) as usize;
                seqs.swap(i, j);
            }
        }
        let per = per_pass.max(1) as usize;
        let (mut sum, mut passes) = (0u64, 0u64);
        for c in seqs.chunks(per) {
            sum += c.iter().copied().max().unwrap_or(0);
            passes += 1;
        }
        (sum as f64 / passes.max(1) as f64).round() as u64
    }
}

/// The generated lengths of one iteration of `generate` node `gen_id`, seeded by the plan and
/// the node, clipped to the limit.
pub fn sample_lengths(a: &Annotated, gen_id: NodeId, samples: u64, max_new: u64) -> Vec<u64> {
    let mut rng = Rng::new(a.seed ^ (u64::from(gen_id.0) << 32));
    (0..samples)
        .map(|_| a.workload.lengths.sample(&mut rng).clamp(1, max_new))
        .collect()
}

/// Decode time of one engine instance holding `lengths` (in the order they are admitted),
/// as Braid's engine runs them: at most `max_batch` running ([`crate::sim::ENGINE_MAX_BATCH`]
/// for Braid's engine, `None` for no limit), the rest prefilled and admitted as rows free (continuous
/// batching); once none wait, lock-step (the live batch shrinks as samples finish). An
/// instance with pipeline stages decodes as [`CostModel::pipelined_decode_step_time`] says.
/// The samples come `per_prompt` to a prompt, which each admission prefills once.
pub fn instance_generate_time(
    cost: &CostModel,
    shape: &ModelShape,
    layout: Layout,
    lengths: &[u64],
    prompt_len: u64,
    per_prompt: u64,
    max_batch: Option<u64>,
) -> f64 {
    if lengths.is_empty() {
        return 0.0;
    }
    let cap = max_batch.map_or(usize::MAX, |m| m.max(1) as usize);
    let mut waiting: std::collections::VecDeque<u64> = lengths.iter().copied().collect();
    // Running samples as (tokens left, context).
    let mut running: Vec<(u64, u64)> = Vec::new();
    let mut t = 0.0;
    let admit = |running: &mut Vec<(u64, u64)>, waiting: &mut std::collections::VecDeque<u64>| {
        let n = cap.saturating_sub(running.len()).min(waiting.len());
        running.extend(waiting.drain(..n).map(|len| (len, prompt_len)));
        n as u64
    };
    let n = admit(&mut running, &mut waiting);
    t += cost.pipelined_shared_prefill_time(shape, layout, n, prompt_len, per_prompt);
    while !waiting.is_empty() {
        let live = running.len() as u64;
        let ctx = running.iter().map(|r| r.1).sum::<u64>() / live.max(1);
        t += cost.pipelined_decode_step_time(shape, layout, live, ctx + 1);
        for r in &mut running {
            r.0 -= 1;
            r.1 += 1;
        }
        running.retain(|r| r.0 > 0);
        let n = admit(&mut running, &mut waiting);
        if n > 0 {
            t += cost.pipelined_shared_prefill_time(shape, layout, n, prompt_len, per_prompt);
        }
    }
    // Nothing waits: lock-step over what runs.
    running.sort_unstable();
    let b = running.len() as u64;
    let ctx0 = running.iter().map(|r| r.1).sum::<u64>() / b.max(1);
    let mut prev = 0u64;
    for (k, &(left, _)) in running.iter().enumerate() {
        if left > prev {
            let live = b - k as u64;
            let mid = ctx0 + (prev + left) / 2;
            t += (left - prev) as f64 * cost.pipelined_decode_step_time(shape, layout, live, mid);
            prev = left;
        }
    }
    t
}

/// Generation time on a placement: samples dealt round-robin over `dp` instances, each
/// tensor- (and pipeline-) parallel inside; the slowest instance decides.
pub fn generate_time(
    cost: &CostModel,
    shape: &ModelShape,
    p: &Placement,
    size: &CallSize,
    max_batch: Option<u64>,
) -> f64 {
    let inst = Layout {
        dp: 1,
        tp: p.tp,
        pp: p.pp,
    };
    let dp = p.dp.max(1) as usize;
    let mut worst = 0.0f64;
    for i in 0..dp {
        let mine: Vec<u64> = size.lengths.iter().skip(i).step_by(dp).copied().collect();
        worst = worst.max(instance_generate_time(
            cost,
            shape,
            inst,
            &mine,
            size.prompt_len,
            size.per_prompt,
            max_batch,
        ));
    }
    worst
}

/// Sequences each data-parallel replica handles, and per micro-batch.
fn per_replica(samples: u64, p: &Placement) -> (u64, u64) {
    let per = samples.div_ceil(p.dp.max(1));
    (per, per.div_ceil(p.microbatches.max(1)).max(1))
}

/// Time of one call on a placement, in seconds.
pub fn call_time(a: &Annotated, id: NodeId, p: &Placement) -> f64 {
    let (Some(node), Some(size)) = (a.plan.graph.node(id), call_size(a, id)) else {
        return 0.0;
    };
    let Some((slot, shape)) = node.op.model().and_then(|m| Some((m, a.shape(m)?))) else {
        return 0.0;
    };
    let cost = a.cost_of(slot);
    match node.op {
        Op::Generate { .. } => generate_time(&cost, shape, p, &size, a.engine_max_batch),
        Op::Train { .. } => {
            let (epochs, mbs) = size.train.unwrap_or((1, 1));
            let global = size.samples.div_ceil(mbs).max(1);
            let step = cost.train_step_time(
                shape,
                p.layout(),
                global,
                train_seq(a, id, &size, global, p),
                p.microbatches.max(1),
                checkpointing(a, slot),
            );
            step.total * (epochs * mbs) as f64 + metric_sums_time(a, id, &cost, p)
        }
        // Taken from the training forward pass (`sample-split`): it runs nothing.
        _ if a.decisions.reused_logprobs.contains_key(&id) => 0.0,
        _ => {
            // Chunks issued back to back through the pipeline stages, as the simulator runs
            // them (`Work::inference`): `k` chunks take `k + pp − 1` stage times.
            let (per, chunk) = per_replica(size.samples, p);
            let k = per.div_ceil(chunk) as f64;
            let pp = p.pp.max(1) as f64;
            let seq = size.padded_seq(chunk, None);
            (k + pp - 1.0) / pp * cost.forward_time(shape, p.layout(), chunk, seq)
        }
    }
}

/// What a training on several data-parallel replicas ends with, beyond its optimizer steps
/// (`runtime/src/exec/train.rs`): one sum over its replicas of its loss, entropy and token
/// count (three f64) and, where its loss declares metrics, a sum and a count per metric name.
/// Small as it is, on Gloo it costs an all-reduce's fixed time, over a millisecond
/// (`DeviceSpec::allreduce`).
fn metric_sums_time(a: &Annotated, id: NodeId, cost: &CostModel, p: &Placement) -> f64 {
    if p.dp <= 1 {
        return 0.0;
    }
    let metrics = a
        .plan
        .graph
        .inputs(id)
        .get(1)
        .and_then(|&l| a.plan.graph.node(l))
        .map_or(0, |n| match &n.op {
            Op::Loss { objective } => objective
                .metrics
                .iter()
                .map(|m| m.name.as_str())
                .collect::<std::collections::BTreeSet<_>>()
                .len(),
            _ => 0,
        });
    cost.allreduce_time(8.0 * (3 + 2 * metrics) as f64, p.dp, p.tp)
}

/// The length train `id`'s micro-batches pad to, on average: `global` sequences per optimizer
/// step shuffled, split over the replicas and the micro-batches of placement `p`.
fn train_seq(a: &Annotated, id: NodeId, size: &CallSize, global: u64, p: &Placement) -> u64 {
    let per_pass = global.div_ceil(p.dp.max(1) * p.microbatches.max(1));
    size.padded_seq(per_pass, Some(a.seed ^ u64::from(id.0)))
}

/// Whether model `slot` trains with activation checkpointing.
fn checkpointing(a: &Annotated, slot: u32) -> bool {
    a.plan
        .models
        .get(slot as usize)
        .is_some_and(|m| m.gradient_checkpointing)
}

/// Memory one device of the call's mesh needs, in the model's dtype.
pub fn call_memory(a: &Annotated, id: NodeId, p: &Placement) -> Option<MemoryNeeds> {
    let node = a.plan.graph.node(id)?;
    let size = size_of(a, id, false)?;
    let slot = node.op.model()?;
    let shape = a.shape(slot)?;
    let use_ = match node.op {
        Op::Generate { .. } => MemoryUse {
            kv_batch: size.samples.div_ceil(p.dp.max(1)),
            kv_context: size.max_seq,
            ..MemoryUse::default()
        },
        Op::Train { .. } => {
            let (_, mbs) = size.train.unwrap_or((1, 1));
            let global = size.samples.div_ceil(mbs).max(1);
            MemoryUse {
                train: true,
                shard_optimizer: true,
                microbatch_seqs: global.div_ceil(p.dp * p.microbatches.max(1)).max(1),
                seq_len: size.max_seq,
                microbatches: p.microbatches.max(1),
                checkpointing: checkpointing(a, slot),
                ..MemoryUse::default()
            }
        }
        _ => MemoryUse::default(),
    };
    Some(a.cost_of(slot).memory(shape, p.layout(), &use_))
}

/// How far the device most over its memory is from holding what `placements` put on it at
/// once, in bytes (0 when every device holds its share). A trained model keeps its gradients
/// and optimizer state on its training devices between calls, and its weights wherever its
/// calls put them (the largest share over its calls on a device: reshards move weights
/// between layouts, they do not copy them); the largest transient need of a call on the
/// device comes on top (its activations or KV cache, and a frozen model's weights, which
/// `reshard-insert` offloads between its calls when they crowd another call). `memory` gives a
/// call's needs on a placement (a cache of [`call_memory`]). This is what `place` searches
/// within. `braid plan`'s `E0504` for a device's residents counts a trained model's
/// weights, gradients and optimizer state as one, the largest over its calls, which a
/// generation's weights can hide: this account is the stricter of the two.
pub fn memory_overflow(
    a: &Annotated,
    placements: &BTreeMap<NodeId, Placement>,
    memory: &mut dyn FnMut(NodeId, &Placement) -> Option<MemoryNeeds>,
) -> u64 {
    let usable = a.cost.device.usable_memory();
    let n = a.cluster.devices() as usize;
    // Per device and trained model: (largest weights, gradients + optimizer state).
    let mut resident: Vec<BTreeMap<u32, (u64, u64)>> = vec![BTreeMap::new(); n];
    let mut transient = vec![0u64; n];
    for (&id, p) in placements {
        let (Some(m), Some(mem)) = (
            a.plan.graph.node(id).and_then(|x| x.op.model()),
            memory(id, p),
        ) else {
            continue;
        };
        let trained = a.is_trained(m);
        let here = mem.activations
            + mem.kv_cache
            + if trained {
                0
            } else {
                mem.weights + mem.gradients + mem.optimizer
            };
        for d in p.devices() {
            let d = d as usize;
            if d >= n {
                continue;
            }
            if trained {
                let e = resident[d].entry(m).or_default();
                e.0 = e.0.max(mem.weights);
                e.1 = e.1.max(mem.gradients + mem.optimizer);
            }
            transient[d] = transient[d].max(here);
        }
    }
    (0..n)
        .map(|d| {
            let held: u64 = resident[d].values().map(|(w, s)| w + s).sum();
            (held + transient[d]).saturating_sub(usable)
        })
        .max()
        .unwrap_or(0)
}

/// Whether a placement fits its devices' memory.
pub fn fits(a: &Annotated, id: NodeId, p: &Placement) -> bool {
    call_memory(a, id, p).is_some_and(|m| m.fits(&a.cost.device).is_ok())
}

/// Every layout of call `id` on `count` devices starting at 0 (tensor-parallel degrees are
/// powers of two inside a node that divide the heads and the feed-forward width; pipeline
/// degrees divide the layers; generation, and inference that may stream under it, run without
/// pipeline stages: the layouts the runtime runs), with its micro-batch choices. Not filtered by
/// memory. Deterministic order.
pub fn layout_options(a: &Annotated, id: NodeId, count: u64) -> Vec<Placement> {
    let (Some(node), Some(size)) = (a.plan.graph.node(id), call_size(a, id)) else {
        return Vec::new();
    };
    let Some(shape) = node.op.model().and_then(|m| a.shape(m)) else {
        return Vec::new();
    };
    let is_gen = matches!(node.op, Op::Generate { .. });
    // Generation runs without pipeline stages, and so does an inference call that may stream
    // under it (the runtime streams single-stage replicas only).
    let single_stage = is_gen || streamable(a, id);
    let per_node = a.cluster.per_node.max(1);
    let mut out = Vec::new();
    let mut tp = 1u64;
    while tp <= per_node.min(count) {
        // The runtime's tensor parallelism splits heads and the feed-forward width evenly.
        if shape.heads.is_multiple_of(tp)
            && shape.intermediate.is_multiple_of(tp)
            && count.is_multiple_of(tp)
        {
            for pp in 1..=shape.layers.min(count / tp) {
                if (single_stage && pp > 1)
                    || !shape.layers.is_multiple_of(pp)
                    || !count.is_multiple_of(tp * pp)
                {
                    continue;
                }
                let dp = count / (tp * pp);
                let base = Placement {
                    first: 0,
                    count,
                    dp,
                    tp,
                    pp,
                    microbatches: 1,
                };
                for m in microbatch_options(&base, &size, is_gen, streamable(a, id)) {
                    out.push(Placement {
                        microbatches: m,
                        ..base
                    });
                }
            }
        }
        tp *= 2;
    }
    out
}

/// An inference call that reads a generation's rollout directly: one `sample-split` may
/// stream. Its sequences are always cut into at least [`STREAM_MICROBATCHES`] micro-batches, so
/// that it can run on the first samples to finish — and, streamed or not, it runs the same
/// micro-batches, so that streaming changes when it runs and never what it computes.
pub fn streamable(a: &Annotated, id: NodeId) -> bool {
    let g = &a.plan.graph;
    g.node(id).is_some_and(|n| {
        matches!(
            n.op,
            Op::Logprobs { .. } | Op::Values { .. } | Op::Score { .. }
        ) && g
            .inputs(id)
            .first()
            .and_then(|r| g.node(*r))
            .is_some_and(|r| matches!(r.op, Op::Generate { .. }))
    })
}

/// The fewest micro-batches per replica a [`streamable`] call runs in (when it has as many
/// sequences).
pub const STREAM_MICROBATCHES: u64 = 8;

fn microbatch_options(p: &Placement, size: &CallSize, is_gen: bool, streamable: bool) -> Vec<u64> {
    if is_gen {
        return vec![1];
    }
    let seqs = match size.train {
        Some((_, mbs)) => size.samples.div_ceil(mbs).div_ceil(p.dp).max(1),
        None => size.samples.div_ceil(p.dp).max(1),
    };
    if let Some(mb) = size.micro_batch {
        return vec![seqs.div_ceil(mb).max(1)];
    }
    // Powers of two up to the sequences (and 128), from the least a call may take.
    let least = if streamable {
        STREAM_MICROBATCHES.min(seqs)
    } else {
        1
    };
    let mut v = vec![least];
    let mut m = least.next_power_of_two();
    if m == least {
        m *= 2;
    }
    while m <= seqs.min(128) {
        v.push(m);
        m *= 2;
    }
    v
}

/// The fitting layouts of call `id` on `count` devices, fastest first (ties in
/// [`layout_options`] order).
pub fn fitting_options(a: &Annotated, id: NodeId, count: u64) -> Vec<(f64, Placement)> {
    let mut v: Vec<(f64, Placement)> = layout_options(a, id, count)
        .into_iter()
        .filter(|p| fits(a, id, p))
        .map(|p| (call_time(a, id, &p), p))
        .collect();
    v.sort_by(|x, y| x.0.total_cmp(&y.0));
    v
}

/// The layout needing the least memory per device on `count` devices (for reporting a plan
/// that cannot fit).
pub fn smallest_option(a: &Annotated, id: NodeId, count: u64) -> Option<Placement> {
    layout_options(a, id, count)
        .into_iter()
        .min_by_key(|p| call_memory(a, id, p).map_or(u64::MAX, |m| m.total()))
}

/// The ReaL-style heuristic: every call on all devices with the fastest layout that fits (or,
/// when none fits, the one needing least memory, so that the overflow can be reported).
pub fn heuristic_placement(a: &Annotated, id: NodeId) -> Option<Placement> {
    let n = a.cluster.devices();
    fitting_options(a, id, n)
        .first()
        .map(|x| x.1)
        .or_else(|| smallest_option(a, id, n))
}

/// DeepSpeed-Chat style: one layout per model on all devices — the one its most expensive call
/// (a `train` if it has one) prefers — used by all its calls.
pub fn per_model_placements(a: &Annotated) -> BTreeMap<NodeId, Placement> {
    let mut by_model: BTreeMap<u32, Vec<NodeId>> = BTreeMap::new();
    for id in a.calls() {
        if let Some(m) = a.plan.graph.node(id).and_then(|n| n.op.model()) {
            by_model.entry(m).or_default().push(id);
        }
    }
    let mut out = BTreeMap::new();
    for ids in by_model.values() {
        let lead = ids
            .iter()
            .copied()
            .find(|i| matches!(a.plan.graph.node(*i).map(|n| &n.op), Some(Op::Train { .. })))
            .unwrap_or(ids[0]);
        let Some(p) = heuristic_placement(a, lead) else {
            continue;
        };
        for &i in ids {
            // Same devices and degrees; micro-batches as the call prefers.
            let mine = layout_options(a, i, p.count)
                .into_iter()
                .filter(|q| q.same_layout(&p))
                .min_by(|x, y| call_time(a, i, x).total_cmp(&call_time(a, i, y)))
                .unwrap_or(p);
            out.insert(i, mine);
        }
    }
    out
}

/// The placement of every call: the decided one, else the heuristic.
pub fn placements(a: &Annotated) -> BTreeMap<NodeId, Placement> {
    let mut out = BTreeMap::new();
    for id in a.calls() {
        let p = a
            .decisions
            .placements
            .get(&id)
            .copied()
            .or_else(|| heuristic_placement(a, id));
        if let Some(p) = p {
            out.insert(id, p);
        }
    }
    out
}

/// The model calls each node waits for, through compute nodes.
pub fn call_deps(a: &Annotated) -> BTreeMap<NodeId, Vec<NodeId>> {
    let g = &a.plan.graph;
    let mut anc: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
    let mut out = BTreeMap::new();
    for id in g.topo_order().unwrap_or_else(|| g.node_ids()) {
        let mut mine: Vec<NodeId> = Vec::new();
        for i in g.inputs(id) {
            if g.node(i).is_some_and(|n| n.op.is_model_call()) {
                mine.push(i);
            } else if let Some(v) = anc.get(&i) {
                mine.extend(v.iter().copied());
            }
        }
        mine.sort();
        mine.dedup();
        if g.node(id).is_some_and(|n| n.op.is_model_call()) {
            out.insert(id, mine.clone());
        }
        anc.insert(id, mine);
    }
    out
}

/// The share of the parameters device `d` holds under placement `p`: a rectangle of the unit
/// square (layers along one side, the tensor-parallel split along the other).
fn shard_rect(p: &Placement, d: u64) -> Option<(f64, f64, f64, f64)> {
    if !p.devices().contains(&d) {
        return None;
    }
    let r = d - p.first;
    let t = r % p.tp;
    let s = r / (p.tp * p.dp);
    let (pp, tp) = (p.pp as f64, p.tp as f64);
    Some((
        s as f64 / pp,
        (s + 1) as f64 / pp,
        t as f64 / tp,
        (t + 1) as f64 / tp,
    ))
}

/// Parameter bytes that must move to go from placement `from` to `to`: for every device of
/// `to`, the part of its shard it does not already hold. Returns (total, most any device
/// receives).
pub fn reshard_bytes(
    shape: &ModelShape,
    dtype_bytes: u64,
    from: &Placement,
    to: &Placement,
) -> (u64, u64) {
    let weights = (shape.params() * dtype_bytes) as f64;
    let mut total = 0.0;
    let mut most = 0.0f64;
    for d in to.devices() {
        let Some(want) = shard_rect(to, d) else {
            continue;
        };
        let area = (want.1 - want.0) * (want.3 - want.2);
        let have = shard_rect(from, d).map_or(0.0, |h| {
            let x = (want.1.min(h.1) - want.0.max(h.0)).max(0.0);
            let y = (want.3.min(h.3) - want.2.max(h.2)).max(0.0);
            x * y
        });
        let need = (area - have).max(0.0) * weights;
        total += need;
        most = most.max(need);
    }
    (total.round() as u64, most.round() as u64)
}

/// Time to reshard: the busiest receiver's bytes over NVLink when both meshes sit in one node,
/// over the network otherwise.
pub fn reshard_seconds(a: &Annotated, most_bytes: u64, from: &Placement, to: &Placement) -> f64 {
    if most_bytes == 0 {
        return 0.0;
    }
    let per_node = a.cluster.per_node.max(1);
    let lo = from.first.min(to.first);
    let hi = (from.first + from.count).max(to.first + to.count);
    let d = &a.cost.device;
    let (bw, lat) = if lo / per_node == (hi - 1) / per_node {
        (d.intra_node_bandwidth, d.intra_node_latency)
    } else {
        (d.inter_node_bandwidth, d.inter_node_latency)
    };
    most_bytes as f64 / (bw * d.network_efficiency) + lat
}

/// Host ↔ device bandwidth per GPU for offloading (PCIe Gen5 ×16 is 64 GB/s per direction on
/// paper; 25 GB/s is what pinned-memory copies reach in practice with several GPUs per host
/// sharing the root complex).
pub const HOST_BANDWIDTH: f64 = 25e9;

/// A frozen model whose weights go to host memory after its last call and come back before its
/// first, because another call on its devices would not fit next to them.
#[derive(Clone, Debug, PartialEq)]
pub struct Offload {
    pub model: u32,
    pub first: NodeId,
    pub last: NodeId,
    /// The call that needs the room, and what it needs per device.
    pub other: NodeId,
    pub need: u64,
    /// Weight bytes per device.
    pub weights: u64,
    /// One direction (offload or reload): the weights over [`HOST_BANDWIDTH`].
    pub seconds: f64,
}

/// The offloads a placement needs (what `reshard-insert` inserts and `place` prices): a frozen
/// model is offloaded when some other model's call on its devices fits alone but not next to
/// its weights.
pub fn offloads(a: &Annotated, placements: &BTreeMap<NodeId, Placement>) -> Vec<Offload> {
    let usable = a.cost.device.usable_memory();
    let mut by_model: BTreeMap<u32, Vec<NodeId>> = BTreeMap::new();
    for id in a.calls() {
        if let Some(m) = a.plan.graph.node(id).and_then(|n| n.op.model()) {
            by_model.entry(m).or_default().push(id);
        }
    }
    let mut out = Vec::new();
    for (&model, calls) in &by_model {
        if a.is_trained(model) {
            continue;
        }
        let (Some(&first), Some(&last)) = (calls.first(), calls.last()) else {
            continue;
        };
        let Some(pm) = placements.get(&first) else {
            continue;
        };
        let Some(weights) = call_memory(a, first, pm).map(|m| m.weights) else {
            continue;
        };
        for (&other, po) in placements {
            if a.plan.graph.node(other).and_then(|n| n.op.model()) == Some(model)
                || !po.overlaps(pm)
            {
                continue;
            }
            let need = call_memory(a, other, po).map_or(0, |m| m.total());
            if need <= usable && need + weights > usable {
                out.push(Offload {
                    model,
                    first,
                    last,
                    other,
                    need,
                    weights,
                    seconds: weights as f64 / HOST_BANDWIDTH,
                });
                break;
            }
        }
    }
    out
}

/// Two `train` calls that can run as one fused pipeline schedule (RLHFuse intra-stage fusion):
/// the fused problem per data-parallel group and what it takes in seconds.
#[derive(Clone, Debug)]
pub struct FusedTrain {
    pub forward: NodeId,
    pub reverse: NodeId,
    pub problem: PipelineProblem,
    pub unit_seconds: f64,
    /// Optimizer steps (each one fused pipeline).
    pub steps: u64,
    /// Per step: both models' gradient all-reduces and optimizer updates.
    pub per_step_extra: f64,
    /// Both trainings one after the other, in seconds.
    pub serial_seconds: f64,
}

impl FusedTrain {
    /// Seconds of the whole fused training with a pipeline latency of `latency` units.
    pub fn seconds(&self, latency: u64) -> f64 {
        self.steps as f64 * (latency as f64 * self.unit_seconds + self.per_step_extra)
    }
}

/// The fused problem of trains `x` and `y`, when they share devices and tensor-parallel degree,
/// at least one is pipelined, the smaller pipeline divides the larger, and they take the same
/// number of optimizer steps.
pub fn fused_train(
    a: &Annotated,
    x: NodeId,
    px: &Placement,
    y: NodeId,
    py: &Placement,
) -> Option<FusedTrain> {
    if (px.first, px.count, px.tp) != (py.first, py.count, py.tp) || px.pp.max(py.pp) < 2 {
        return None;
    }
    let (f, pf, r, pr) = if py.pp > px.pp {
        (y, py, x, px)
    } else {
        (x, px, y, py)
    };
    if !pf.pp.is_multiple_of(pr.pp) {
        return None;
    }
    let parts = |id: NodeId, p: &Placement| {
        let node = a.plan.graph.node(id)?;
        let slot = node.op.model()?;
        let shape = a.shape(slot)?;
        let size = call_size(a, id)?;
        let (epochs, mbs) = size.train?;
        let global = size.samples.div_ceil(mbs).max(1);
        let t = a.cost_of(slot).train_step_time(
            shape,
            p.layout(),
            global,
            train_seq(a, id, &size, global, p),
            p.microbatches,
            checkpointing(a, slot),
        );
        let mem = call_memory(a, id, p)?;
        let per_mb = mem.activations / p.pp.min(p.microbatches).max(1);
        Some((epochs * mbs, t, per_mb))
    };
    let (steps_f, tf, mem_f) = parts(f, pf)?;
    let (steps_r, tr, mem_r) = parts(r, pr)?;
    if steps_f != steps_r {
        return None;
    }
    let unit = tf.forward.min(tr.forward) / 5.0;
    if unit <= 0.0 || !unit.is_finite() {
        return None;
    }
    let ticks = |s: f64| ((s / unit).round() as u64).max(1);
    let mb = |b: u64| (b / (1 << 20)).max(1);
    let problem = PipelineProblem {
        stages: pf.pp as usize,
        models: vec![
            PipelineModel {
                name: Some(a.call_name(f)),
                pp: pf.pp as usize,
                microbatches: pf.microbatches as usize,
                fwd: ticks(tf.forward),
                bwd: ticks(tf.backward),
                mem_per_microbatch: mb(mem_f),
            },
            PipelineModel {
                name: Some(a.call_name(r)),
                pp: pr.pp as usize,
                microbatches: pr.microbatches as usize,
                fwd: ticks(tr.forward),
                bwd: ticks(tr.backward),
                mem_per_microbatch: mb(mem_r),
            },
        ],
        search: SearchOptions {
            seed: a.seed,
            improvement_rounds: 60,
            latency_iterations: 6_000,
            memory_rounds: 20,
            memory_iterations: 2_000,
        },
    };
    problem.validate().ok()?;
    Some(FusedTrain {
        forward: f,
        reverse: r,
        problem,
        unit_seconds: unit,
        steps: steps_f,
        per_step_extra: tf.grad_allreduce + tf.optimizer + tr.grad_allreduce + tr.optimizer,
        serial_seconds: steps_f as f64 * (tf.total + tr.total),
    })
}

/// What [`iteration_time`] assumes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EstimateOptions {
    /// Price two trainings that share devices as one fused pipeline at its lower bound.
    pub fused_training: bool,
}

/// The iteration time of a placement by list scheduling: calls in topological order, each
/// starting when the calls it reads are done and all its devices are free; a call on a model
/// whose previous call used another layout first waits for the reshard; the parameters go back
/// to the first call's layout for the next iteration.
pub fn iteration_time(
    a: &Annotated,
    placements: &BTreeMap<NodeId, Placement>,
    deps: &BTreeMap<NodeId, Vec<NodeId>>,
    times: &mut dyn FnMut(NodeId, &Placement) -> f64,
    opts: EstimateOptions,
) -> f64 {
    let n = a.cluster.devices() as usize;
    let mut free = vec![0.0f64; n];
    let mut end: BTreeMap<NodeId, f64> = BTreeMap::new();
    let mut last_on_model: BTreeMap<u32, Placement> = BTreeMap::new();
    let mut first_on_model: BTreeMap<u32, Placement> = BTreeMap::new();
    let calls = a.calls();
    let fused = if opts.fused_training {
        fused_pairs(a, placements)
    } else {
        Vec::new()
    };
    let mut done_fused: BTreeMap<NodeId, f64> = BTreeMap::new();
    // Offloads and reloads, as `reshard-insert` will insert them and the simulator runs them:
    // a reload on the first call's devices as soon as they are free, an offload on the last
    // call's devices right after it.
    let moves = offloads(a, placements);
    let reload_before: BTreeMap<NodeId, f64> = moves.iter().map(|o| (o.first, o.seconds)).collect();
    let offload_after: BTreeMap<NodeId, f64> = moves.iter().map(|o| (o.last, o.seconds)).collect();
    for &id in &calls {
        let (Some(p), Some(model)) = (
            placements.get(&id),
            a.plan.graph.node(id).and_then(|x| x.op.model()),
        ) else {
            continue;
        };
        if let Some(&e) = done_fused.get(&id) {
            end.insert(id, e);
            last_on_model.insert(model, *p);
            continue;
        }
        let ready = |end: &BTreeMap<NodeId, f64>, id: NodeId| {
            deps.get(&id).map_or(0.0, |v| {
                v.iter()
                    .map(|d| end.get(d).copied().unwrap_or(0.0))
                    .fold(0.0, f64::max)
            })
        };
        let mut start = ready(&end, id);
        let devs = p.first as usize..(p.first + p.count) as usize;
        let mut devices_free = 0.0f64;
        for d in devs.clone() {
            devices_free = devices_free.max(free.get(d).copied().unwrap_or(0.0));
        }
        start = start.max(devices_free);
        if let Some(secs) = reload_before.get(&id) {
            start = start.max(devices_free + secs);
        }
        let mut reshard = 0.0;
        if let (Some(shape), Some(prev)) = (a.shape(model), last_on_model.get(&model))
            && !prev.same_layout(p)
        {
            let (_, most) = reshard_bytes(shape, a.dtype_bytes(model), prev, p);
            reshard = reshard_seconds(a, most, prev, p);
        }
        let mut dur = times(id, p);
        let mut partner = None;
        if let Some((f, other, secs)) = fused.iter().find(|x| x.0 == id || x.1 == id) {
            let o = if *f == id { *other } else { *f };
            start = start.max(ready(&end, o));
            dur = *secs;
            partner = Some(o);
        }
        let e = start + reshard + dur;
        let busy_until = e + offload_after.get(&id).copied().unwrap_or(0.0);
        for d in devs {
            if let Some(f) = free.get_mut(d) {
                *f = busy_until;
            }
        }
        end.insert(id, e);
        first_on_model.entry(model).or_insert(*p);
        last_on_model.insert(model, *p);
        if let Some(o) = partner {
            done_fused.insert(o, e);
        }
    }
    let mut total = free.iter().copied().fold(0.0, f64::max);
    // Back to each model's first layout for the next iteration.
    for (m, last) in &last_on_model {
        if let (Some(first), Some(shape)) = (first_on_model.get(m), a.shape(*m))
            && !first.same_layout(last)
        {
            let (_, most) = reshard_bytes(shape, a.dtype_bytes(*m), last, first);
            total += reshard_seconds(a, most, last, first);
        }
    }
    total
}

/// Pairs of trains that would run fused, with the fused time estimated at the lower bound.
pub fn fused_pairs(
    a: &Annotated,
    placements: &BTreeMap<NodeId, Placement>,
) -> Vec<(NodeId, NodeId, f64)> {
    let trains: Vec<NodeId> = a
        .calls()
        .into_iter()
        .filter(|i| matches!(a.plan.graph.node(*i).map(|n| &n.op), Some(Op::Train { .. })))
        .collect();
    let mut out = Vec::new();
    let mut used = std::collections::BTreeSet::new();
    for (i, &x) in trains.iter().enumerate() {
        for &y in &trains[i + 1..] {
            if used.contains(&x) || used.contains(&y) {
                continue;
            }
            if let (Some(px), Some(py)) = (placements.get(&x), placements.get(&y))
                && let Some(f) = fused_train(a, x, px, y, py)
            {
                out.push((x, y, f.seconds(lower_bound(&f.problem))));
                used.insert(x);
                used.insert(y);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(prompts: Vec<u64>, lengths: Vec<u64>) -> CallSize {
        let mean = lengths.iter().sum::<u64>() / lengths.len().max(1) as u64;
        CallSize {
            per_prompt: 1,
            samples: lengths.len() as u64,
            prompt_len: 10,
            max_new: 100,
            lengths,
            prompt_lens: prompts,
            pads: true,
            max_seq: 110,
            mean_seq: 10 + mean,
            train: None,
            micro_batch: None,
        }
    }

    #[test]
    fn equal_sequences_pad_to_themselves() {
        let s = size(vec![], vec![20; 8]);
        for per in [1, 2, 8, 100] {
            assert_eq!(s.padded_seq(per, None), 30);
            assert_eq!(s.padded_seq(per, Some(7)), 30);
        }
    }

    #[test]
    fn without_prompt_lengths_passes_are_priced_at_the_mean() {
        let mut s = size(vec![], vec![5, 5, 5, 85]);
        s.pads = false;
        assert_eq!(s.padded_seq(4, None), s.mean_seq);
    }

    #[test]
    fn a_pass_pays_its_longest_sequence() {
        // One long completion among short ones: alone in a pass of one, it costs only its own
        // pass; in one pass of all, every sequence pays its length.
        let s = size(vec![], vec![5, 5, 5, 85]);
        assert_eq!(s.padded_seq(1, None), (15 * 3 + 95) / 4);
        assert_eq!(s.padded_seq(2, None), (15 + 95) / 2);
        assert_eq!(s.padded_seq(4, None), 95);
        // Prompts count too: the longest prompt plus its completion.
        let s = size(vec![40, 40, 10, 10], vec![5, 5, 5, 5]);
        assert_eq!(s.padded_seq(2, None), (45 + 15) / 2);
        assert_eq!(s.padded_seq(4, None), 45);
        // A shuffle changes which share a pass, never the longest of one pass of all.
        assert_eq!(s.padded_seq(4, Some(3)), 45);
    }
}
