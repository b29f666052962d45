//! The systems `braid sim` compares Braid's plan with, modelled on how each runs an iteration
//! (sources in `docs/planning.md`, "Baselines"):
//!
//! - **DeepSpeed-Chat** ([`deepspeed_chat`]): every model ZeRO-3 data-parallel over all
//!   devices, calls one after the other. Its hybrid engine gathers the actor's ZeRO-3 shards
//!   before generation and generates with `inference_tp_size`-way tensor parallelism, the
//!   generation batch limited by what memory the gathered weights leave; every inference and
//!   training micro-batch gathers the model's parameters again (and training reduce-scatters
//!   its gradients), which is the communication ReaL's timeline shows it stalled on.
//! - **OpenRLHF** ([`openrlhf`]): Ray places vLLM engines on half the devices, the actor
//!   (with the reference) on a quarter and the critic (with the reward model) on the other
//!   quarter, each group ZeRO-3; after the actor's training its weights are gathered and
//!   broadcast to the engines.
//! - **ReaL's heuristic** ([`real_heuristic_placements`]): the allocation ReaL's code uses as
//!   its hand-written plan for PPO — pipelined generation on all devices, the two trainings
//!   side by side on node groups split by model size, inference on halves — with parameter
//!   reallocation between them (Braid's reshards).
//!
//! Each returns the placements (and, for DeepSpeed-Chat and OpenRLHF, the extra transfers
//! around calls, [`Extra`]) or why the system cannot run the program on the cluster (a model
//! that does not fit, a rule written for nodes of 8 GPUs); `compare` reports that instead of
//! a time. Like the rest of the crate this computes values only.

use std::collections::BTreeMap;

use braid_ir::graph::{NodeId, Op};

use crate::annotated::{Annotated, Placement};
use crate::cost::{CostModel, ModelShape, param_bytes};
use crate::estimate::{self, call_size};
use crate::to_sim::Extra;

/// A baseline's placements, the transfers around its calls, and the sequences one of its
/// generation instances holds at most.
pub type BaselinePlan = (BTreeMap<NodeId, Placement>, Vec<Extra>, u64);

/// vLLM's default `max_num_seqs`: running sequences an engine holds at most.
pub const VLLM_MAX_NUM_SEQS: u64 = 256;

/// The calls of a PPO-style iteration by role.
#[derive(Clone, Debug, Default)]
struct Roles {
    generate: Option<NodeId>,
    actor: Option<u32>,
    actor_train: Vec<NodeId>,
    critic_train: Vec<NodeId>,
    /// Log-probabilities (the reference's, the actor's own).
    logprobs: Vec<NodeId>,
    scores: Vec<NodeId>,
    values: Vec<NodeId>,
}

fn roles(a: &Annotated) -> Roles {
    let g = &a.plan.graph;
    let mut r = Roles::default();
    for id in a.calls() {
        if let Some(Op::Generate { model, .. }) = g.node(id).map(|n| &n.op) {
            r.generate.get_or_insert(id);
            r.actor.get_or_insert(*model);
        }
    }
    for id in a.calls() {
        match g.node(id).map(|n| &n.op) {
            Some(Op::Train { model, .. }) if Some(*model) == r.actor => r.actor_train.push(id),
            Some(Op::Train { .. }) => r.critic_train.push(id),
            Some(Op::Logprobs { .. }) => r.logprobs.push(id),
            Some(Op::Score { .. }) => r.scores.push(id),
            Some(Op::Values { .. }) => r.values.push(id),
            _ => {}
        }
    }
    r
}

fn model_of(a: &Annotated, id: NodeId) -> Option<u32> {
    a.plan.graph.node(id).and_then(|n| n.op.model())
}

fn shape_of(a: &Annotated, id: NodeId) -> Option<&ModelShape> {
    model_of(a, id).and_then(|m| a.shape(m))
}

fn weight_bytes(a: &Annotated, slot: u32) -> f64 {
    a.shape(slot)
        .map_or(0.0, |s| (s.params() * a.dtype_bytes(slot)) as f64)
}

/// Ring all-gather of a `bytes`-sized buffer sharded over `ranks` devices: each receives the
/// `(n − 1)/n` it lacks — half a ring all-reduce.
fn gather_seconds(cost: &CostModel, bytes: f64, ranks: u64) -> f64 {
    cost.allreduce_time(bytes, ranks, 1) / 2.0
}

/// The micro-batch count (of 1, 2, 4, …, 64) that makes call `id` fastest on `p`.
fn best_microbatches(a: &Annotated, id: NodeId, p: Placement) -> Placement {
    let mut best = p;
    let mut best_t = f64::INFINITY;
    for m in [1u64, 2, 4, 8, 16, 32, 64] {
        let q = Placement {
            microbatches: m,
            ..p
        };
        let t = estimate::call_time(a, id, &q);
        if t < best_t {
            best_t = t;
            best = q;
        }
    }
    best
}

/// A placement on devices `first..first + count` with degrees `tp`, `pp` (pipeline degree
/// lowered to the largest that divides the model's layers, data parallelism filling the rest).
fn place(a: &Annotated, id: NodeId, first: u64, count: u64, tp: u64, pp: u64) -> Placement {
    let layers = shape_of(a, id).map_or(1, |s| s.layers.max(1));
    let mut pp = pp.clamp(1, layers);
    while !layers.is_multiple_of(pp) || !(count / tp.max(1)).is_multiple_of(pp) {
        pp -= 1;
    }
    let p = Placement {
        first,
        count,
        dp: (count / (tp.max(1) * pp)).max(1),
        tp: tp.max(1),
        pp,
        microbatches: 1,
    };
    match a.plan.graph.node(id).map(|n| &n.op) {
        Some(Op::Generate { .. }) => p,
        _ => best_microbatches(a, id, p),
    }
}

/// ReaL's heuristic allocation for PPO (`_heuristic_rpc_allocation` of ReaL's PPO experiment,
/// ReaLHF repository): generation on all devices with `pp = max(2, nodes)` stages and no
/// tensor parallelism; on one node the actor trains on the first four devices and the critic
/// on the other four (`tp 2, dp 2` up to 7B, else `tp 4`); on more, the actor trains on the
/// first `min(⌈nodes · a/(a + c)⌉, nodes − 1)` nodes (`a`, `c` the models' sizes) and the
/// critic on the rest, each `dp 2, tp 4` and a pipeline stage per node; the reference's
/// inference on all devices (`dp 2, tp 4`, a stage per node); the reward model's on the first
/// half of the nodes and the critic's on the rest (`dp 2, tp 4`; on one node halves with
/// `dp 2, tp 2`). Written for nodes of 8 GPUs and PPO's calls; anything else is an error.
pub fn real_heuristic_placements(a: &Annotated) -> Result<BTreeMap<NodeId, Placement>, String> {
    if a.cluster.per_node != 8 {
        return Err(format!(
            "ReaL's heuristic is written for nodes of 8 GPUs (the cluster has {} per node)",
            a.cluster.per_node
        ));
    }
    let r = roles(a);
    let (Some(gen_id), Some(_)) = (r.generate, r.actor) else {
        return Err("ReaL's heuristic needs a generation".into());
    };
    if r.actor_train.is_empty() || r.critic_train.is_empty() {
        return Err("ReaL's heuristic is written for PPO: an actor and a critic that train".into());
    }
    let nodes = a.cluster.nodes.max(1);
    let n = a.cluster.devices();
    let size = |ids: &[NodeId]| {
        ids.first()
            .and_then(|i| shape_of(a, *i))
            .map_or(1.0, |s| s.params() as f64)
    };
    let (sa, sc) = (size(&r.actor_train), size(&r.critic_train));
    let small = |s: f64| s <= 7.5e9;
    let mut out = BTreeMap::new();
    let gpp = nodes.max(2);
    out.insert(gen_id, place(a, gen_id, 0, n, 1, gpp));
    if nodes == 1 {
        for (ids, s, first) in [(&r.actor_train, sa, 0), (&r.critic_train, sc, 4)] {
            let tp = if small(s) { 2 } else { 4 };
            for &id in ids {
                out.insert(id, place(a, id, first, 4, tp, 1));
            }
        }
        for (ids, first) in [(&r.scores, 0), (&r.values, 4)] {
            for &id in ids {
                out.insert(id, place(a, id, first, 4, 2, 1));
            }
        }
    } else {
        let an = ((nodes as f64 * sa / (sa + sc)).ceil() as u64).clamp(1, nodes - 1);
        for (ids, first, count) in [(&r.actor_train, 0, an), (&r.critic_train, an, nodes - an)] {
            for &id in ids {
                out.insert(id, place(a, id, first * 8, count * 8, 4, count));
            }
        }
        let rn = nodes.div_ceil(2);
        for (ids, first, count) in [(&r.scores, 0, rn), (&r.values, rn, nodes - rn)] {
            for &id in ids {
                out.insert(id, place(a, id, first * 8, count * 8, 4, count));
            }
        }
    }
    for &id in &r.logprobs {
        out.insert(id, place(a, id, 0, n, 4, nodes));
    }
    // Anything else the program calls: where the heuristic of a layout per call puts it.
    for id in a.calls() {
        if !out.contains_key(&id)
            && let Some(p) = estimate::heuristic_placement(a, id)
        {
            out.insert(id, p);
        }
    }
    Ok(out)
}

/// The plan behind the "ReaL-Heuristic" bars of ReaL's throughput figure: every call on all
/// devices with one Megatron-LM layout — tensor parallelism over a node's devices, a pipeline
/// stage per node, no data parallelism (`handpicked_model_device_mapping(mode="model_pipe")`
/// of ReaLHF's profiler, the mode the figure's plotting script labels "ReaL-Heuristic";
/// `docs/planning.md`, "Baselines"). Micro-batches are ReaL's defaults: generation and
/// inference `pp` (pipelined), training `2·pp` with a pipeline and one without. The
/// tensor-parallel degree is lowered to one dividing the model's heads, the pipeline degree
/// to one dividing its layers. One layout for every call means no parameter reallocation.
pub fn real_symmetric_placements(a: &Annotated) -> Result<BTreeMap<NodeId, Placement>, String> {
    let r = roles(a);
    if r.generate.is_none() {
        return Err("ReaL's symmetric plan needs a generation".into());
    }
    let n = a.cluster.devices();
    let nodes = a.cluster.nodes.max(1);
    let mut out = BTreeMap::new();
    for id in a.calls() {
        let heads = shape_of(a, id).map_or(1, |s| s.heads.max(1));
        let mut tp = a.cluster.per_node.max(1).min(n);
        while tp > 1 && !heads.is_multiple_of(tp) {
            tp /= 2;
        }
        let mut p = place(a, id, 0, n, tp, nodes);
        p.microbatches = match a.plan.graph.node(id).map(|x| &x.op) {
            Some(Op::Train { .. }) if p.pp > 1 => 2 * p.pp,
            Some(Op::Train { .. }) => 1,
            _ => p.pp,
        };
        out.insert(id, p);
    }
    Ok(out)
}

/// Bytes per device that every model's ZeRO-3 shards (weights, gradients, optimizer state)
/// hold over `ranks` devices, for the models in `slots`.
fn zero3_resident(a: &Annotated, slots: &[u32], trained: &[u32], ranks: u64) -> f64 {
    slots
        .iter()
        .map(|&m| {
            let per = param_bytes(a.dtype_bytes(m), trained.contains(&m));
            let params = a.shape(m).map_or(0, |s| s.params()) as f64;
            params * (per.weights + per.gradients + per.optimizer) as f64 / ranks.max(1) as f64
        })
        .sum()
}

/// The smallest tensor-parallel degree (a power of two inside a node, dividing the heads) at
/// which the gathered actor plus `resident` bytes leave room on each device for one sequence's
/// KV cache, and how many sequences an instance then holds (at most `cap`).
fn gathered_generation(
    a: &Annotated,
    gen_id: NodeId,
    resident: f64,
    max_tp: u64,
    cap: u64,
) -> Result<(u64, u64), String> {
    let slot = model_of(a, gen_id).ok_or("generation without a model")?;
    let shape = a.shape(slot).ok_or("generation without a model shape")?;
    let size = call_size(a, gen_id).ok_or("generation without a size")?;
    let usable = a.cost.device.usable_memory() as f64;
    let w = weight_bytes(a, slot);
    let kv_seq = (shape.kv_bytes_per_token(a.dtype_bytes(slot)) * size.max_seq) as f64;
    let mut tp = 1u64;
    let mut need_last = 0.0;
    while tp <= max_tp.max(1) {
        if shape.heads.is_multiple_of(tp) {
            let free = usable - resident - w / tp as f64;
            need_last = w / tp as f64 + resident;
            let rows = (free * tp as f64 / kv_seq).floor();
            if rows >= 1.0 {
                return Ok((tp, (rows as u64).min(cap)));
            }
        }
        tp *= 2;
    }
    Err(format!(
        "the gathered {} ({:.1} GB per device at tp {}) and its resident shards leave no room \
         for a sequence's KV cache in {:.1} GB",
        a.model_name(slot),
        need_last / 1e9,
        max_tp,
        usable / 1e9
    ))
}

/// ZeRO-3's extra transfers for call `id` with parameters sharded over `ranks` devices:
/// inference gathers the parameters once per micro-batch; training gathers them for each
/// micro-batch's forward and backward and reduce-scatters its gradients, of which the
/// data-parallel all-reduce the training time already charges (two gathers' worth per step)
/// is taken off.
fn zero3_extra(a: &Annotated, id: NodeId, p: &Placement, ranks: u64) -> Option<Extra> {
    let slot = model_of(a, id)?;
    let size = call_size(a, id)?;
    let cost = a.cost_of(slot);
    let gather = gather_seconds(&cost, weight_bytes(a, slot), ranks);
    let m = p.microbatches.max(1) as f64;
    let (label, seconds) = match a.plan.graph.node(id).map(|n| &n.op)? {
        Op::Train { .. } => {
            let (epochs, mbs) = size.train.unwrap_or((1, 1));
            let steps = (epochs * mbs) as f64;
            (
                "zero-3 gathers and reduce-scatters",
                steps * (3.0 * m - 2.0) * gather,
            )
        }
        Op::Generate { .. } => return None,
        _ => ("zero-3 gathers", m * gather),
    };
    (seconds > 0.0).then(|| Extra {
        call: id,
        after: false,
        label: label.to_string(),
        stage: "reshard",
        devices: None,
        seconds,
    })
}

/// DeepSpeed-Chat's placements and extra transfers (DeepSpeed-Chat's README and its hybrid
/// engine's description, DeepSpeed blog "DeepSpeed-Chat", 2023): every call on all devices,
/// ZeRO-3 data parallel; generation by the hybrid engine at the smallest
/// `inference_tp_size` that fits, after gathering the actor; the generation batch per
/// instance what memory leaves. Returns the placements, the extras and the generation batch.
pub fn deepspeed_chat(a: &Annotated) -> Result<BaselinePlan, String> {
    let n = a.cluster.devices();
    let r = roles(a);
    let gen_id = r.generate.ok_or("DeepSpeed-Chat needs a generation")?;
    let slots: Vec<u32> = (0..a.plan.models.len() as u32).collect();
    let trained: Vec<u32> = a
        .calls()
        .into_iter()
        .filter_map(|id| match a.plan.graph.node(id).map(|x| &x.op) {
            Some(Op::Train { model, .. }) => Some(*model),
            _ => None,
        })
        .collect();
    let resident = zero3_resident(a, &slots, &trained, n);
    let per_node = a.cluster.per_node.max(1).min(n);
    let (tp, rows) = gathered_generation(a, gen_id, resident, per_node, u64::MAX)
        .map_err(|e| format!("DeepSpeed-Chat's hybrid engine: {e}"))?;
    let mut out = BTreeMap::new();
    let mut extras = Vec::new();
    for id in a.calls() {
        if id == gen_id {
            out.insert(id, place(a, id, 0, n, tp, 1));
            let slot = r.actor.unwrap_or(0);
            extras.push(Extra {
                call: id,
                after: false,
                label: "hybrid engine: zero-3 gather of the actor".into(),
                stage: "reshard",
                devices: None,
                seconds: gather_seconds(&a.cost_of(slot), weight_bytes(a, slot), n),
            });
            continue;
        }
        let p = place(a, id, 0, n, 1, 1);
        extras.extend(zero3_extra(a, id, &p, n));
        out.insert(id, p);
    }
    Ok((out, extras, rows))
}

/// OpenRLHF's placements and extra transfers (OpenRLHF's README and `train_ppo_ray`'s
/// placement options: vLLM engines, `--colocate_actor_ref`, `--colocate_critic_reward`; its
/// paper, arXiv 2405.11143): vLLM engines on the first half of the devices at the smallest
/// tensor-parallel degree that fits, running up to [`VLLM_MAX_NUM_SEQS`] sequences each; the
/// actor and the reference on the next quarter, the critic and the reward model on the last,
/// each group ZeRO-3; after the actor's training its weights gathered and broadcast to the
/// engines. Returns the placements, the extras and the engines' batch.
pub fn openrlhf(a: &Annotated) -> Result<BaselinePlan, String> {
    let n = a.cluster.devices();
    if n < 4 {
        return Err(format!(
            "OpenRLHF places engines, actor and critic on separate devices: it needs at least \
             4 (the cluster has {n})"
        ));
    }
    let r = roles(a);
    let gen_id = r.generate.ok_or("OpenRLHF needs a generation")?;
    let actor = r.actor.unwrap_or(0);
    let g = n / 2;
    let q = (n - g) / 2;
    let (actor_first, critic_first) = (g, g + q);
    let critic_count = n - critic_first;
    let (tp, rows) = gathered_generation(
        a,
        gen_id,
        0.0,
        a.cluster.per_node.max(1).min(g),
        VLLM_MAX_NUM_SEQS,
    )
    .map_err(|e| format!("OpenRLHF's vLLM engines: {e}"))?;
    let mut out = BTreeMap::new();
    let mut extras = Vec::new();
    for id in a.calls() {
        if id == gen_id {
            out.insert(id, place(a, id, 0, g, tp, 1));
            continue;
        }
        let on_actor = model_of(a, id) == Some(actor)
            || matches!(
                a.plan.graph.node(id).map(|x| &x.op),
                Some(Op::Logprobs { .. })
            );
        let (first, count) = if on_actor {
            (actor_first, q)
        } else {
            (critic_first, critic_count)
        };
        let p = place(a, id, first, count, 1, 1);
        extras.extend(zero3_extra(a, id, &p, count));
        out.insert(id, p);
    }
    if let Some(&train) = r.actor_train.last() {
        let cost = a.cost_of(actor);
        let w = weight_bytes(a, actor);
        let d = &cost.device;
        // Engines on other nodes than the actor's rank 0 receive over the network.
        let (bw, lat) = if n <= a.cluster.per_node {
            (d.intra_node_bandwidth, d.intra_node_latency)
        } else {
            (d.inter_node_bandwidth, d.inter_node_latency)
        };
        let broadcast = w / (bw * d.network_efficiency) + lat;
        let mut devices: Vec<usize> = (0..g as usize).collect();
        devices.extend(actor_first as usize..(actor_first + q) as usize);
        extras.push(Extra {
            call: train,
            after: true,
            label: "weights gathered and broadcast to the vLLM engines".into(),
            stage: "reshard",
            devices: Some(devices),
            seconds: gather_seconds(&cost, w, q) + broadcast,
        });
    }
    Ok((out, extras, rows))
}
