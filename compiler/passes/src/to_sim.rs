//! From a placed plan to the simulator's DAG, and the comparison `braid sim` prints: the plan
//! against the baselines of [`crate::baselines`] (DeepSpeed-Chat, OpenRLHF, ReaL's heuristic)
//! and Braid's plan without and with fusion.
//!
//! One simulator task per model call and per inserted transfer node; compute nodes (`fn`
//! kernels, arithmetic, losses) are cheap next to model calls and are left out, their
//! dependencies carried through. Like the rest of the crate this computes values only.

use std::collections::BTreeMap;

use braid_ir::graph::{NodeId, Op};
use serde::Serialize;

use crate::annotated::{Annotated, Cut, Placement};
use crate::baselines;
use crate::cost::Layout;
use crate::estimate::{self, call_size};
use crate::passes::{PassError, PassManager};
use crate::sim::{
    Dag, DagBuilder, GenerateSpec, LengthDist, Migration, SimOptions, SimReport, TaskId, Work,
    simulate,
};

/// The length distribution with every length capped at `max`.
pub fn clip_lengths(d: &LengthDist, max: u64) -> LengthDist {
    match d {
        LengthDist::Fixed { len } => LengthDist::Fixed {
            len: (*len).clamp(1, max),
        },
        LengthDist::Uniform { lo, hi } => LengthDist::Uniform {
            lo: (*lo).clamp(1, max),
            hi: (*hi).clamp(1, max),
        },
        LengthDist::LogNormal { mu, sigma, max: m } => LengthDist::LogNormal {
            mu: *mu,
            sigma: *sigma,
            max: (*m).min(max),
        },
        LengthDist::Empirical { lens, cumulative } => {
            // Lengths past the limit are stopped by it.
            LengthDist::Empirical {
                lens: lens.iter().map(|l| (*l).clamp(1, max)).collect(),
                cumulative: cumulative.clone(),
            }
        }
    }
}

fn stage_of(op: &Op) -> &'static str {
    match op {
        Op::Generate { .. } => "generate",
        Op::Train { .. } => "train",
        Op::Reshard { .. } => "reshard",
        Op::Offload { .. } | Op::Reload { .. } => "offload",
        _ => "inference",
    }
}

/// Work a baseline system does around a model call that Braid's plan does not: a ZeRO-3
/// parameter gather, a weight broadcast to generation engines ([`crate::baselines`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Extra {
    pub call: NodeId,
    /// After the call (else before it, after what the call waits for).
    pub after: bool,
    pub label: String,
    pub stage: &'static str,
    /// The devices it holds; `None`: the call's.
    pub devices: Option<Vec<usize>>,
    pub seconds: f64,
}

/// The simulator DAG of a plan. With `fusion`, consumers that `sample-split` cut per sample
/// stream from their generation (on the devices it assigned them), generations migrate their
/// long tail, and interleaved trainings run as one fused task.
///
/// Braid's runtime on several processes also exchanges every generation's rollout and every
/// inference call's rows among all ranks (all-gathers over the world group, which every rank
/// joins): on a CPU these are tasks of stage `gather` on all devices, which the calls' readers
/// wait for ([`crate::cost::CostModel::host_allgather_time`]; when they happen: [`build_dag`]).
pub fn to_dag(a: &Annotated, fusion: bool) -> Result<(Dag, BTreeMap<NodeId, TaskId>), String> {
    build_dag(a, fusion, &[], true)
}

/// [`to_dag`] of a baseline system, with its `extras` around its calls and without Braid's
/// runtime's gathers (a baseline moves its data its own way).
pub fn to_dag_with(
    a: &Annotated,
    fusion: bool,
    extras: &[Extra],
) -> Result<(Dag, BTreeMap<NodeId, TaskId>), String> {
    build_dag(a, fusion, extras, false)
}

/// Bytes an all-gather of call `op`'s results moves in all: a rollout's token ids (8 bytes
/// each, prompt and completion), per-token rows of 4-byte floats, or one per sample.
fn gathered_bytes(op: &Op, size: &estimate::CallSize) -> Option<f64> {
    let samples = size.samples as f64;
    let completion = size.mean_seq.saturating_sub(size.prompt_len) as f64;
    match op {
        Op::Generate { .. } => Some(samples * size.mean_seq as f64 * 8.0),
        Op::Logprobs { .. } | Op::Values { .. } => Some(samples * completion * 4.0),
        Op::Score { .. } => Some(samples * 4.0),
        _ => None,
    }
}

/// The runtime's exchange of `bytes` in all among `ranks` CPU ranks: priced at each arrival
/// skew the profile measured it at ([`crate::cost::CostModel::host_allgather_time_apart`]), the
/// skew expected from the ranks' measured spread
/// ([`crate::cost::CostModel::arrival_range`]).
fn exchange_work(cost: &crate::cost::CostModel, bytes: f64, ranks: u64) -> Work {
    let by_skew = cost
        .exchange_skews(ranks)
        .into_iter()
        .map(|skew| {
            let secs = cost
                .host_allgather_time_apart(bytes, ranks, skew)
                .unwrap_or(0.0);
            (skew, secs)
        })
        .collect();
    Work::Exchange {
        by_skew,
        range: cost.arrival_range(ranks),
    }
}

/// A call whose results are not exchanged among the ranks yet (see [`build_dag`]).
#[derive(Clone, Copy, Debug)]
struct Unexchanged {
    task: TaskId,
    bytes: f64,
    /// The generation whose exchange it travels in (itself for a generation), or `None` for
    /// an inference call gathered where it is first read.
    generation: Option<NodeId>,
}

type Ungathered = BTreeMap<NodeId, Unexchanged>;

/// The exchanges that reading `deps` waits for, in the runtime's order: each generation's
/// (the rollout and the calls streamed under it, exchanged as the generation ends), then, when
/// it reads an inference call not exchanged yet, one of every such call (the runtime exchanges
/// them all at their first reader).
fn exchanges_for(ungathered: &Ungathered, deps: &[NodeId]) -> Vec<Vec<NodeId>> {
    let mut generations: Vec<NodeId> = Vec::new();
    let mut reads_calls = false;
    for d in deps {
        match ungathered.get(d).map(|u| u.generation) {
            Some(Some(g)) if !generations.contains(&g) => generations.push(g),
            Some(None) => reads_calls = true,
            _ => {}
        }
    }
    let calls: Vec<NodeId> = if reads_calls {
        ungathered
            .iter()
            .filter(|(_, u)| u.generation.is_none())
            .map(|(id, _)| *id)
            .collect()
    } else {
        Vec::new()
    };
    let mut out: Vec<Vec<NodeId>> = generations
        .iter()
        .map(|g| {
            ungathered
                .iter()
                .filter(|(_, u)| u.generation == Some(*g))
                .map(|(id, _)| *id)
                .collect()
        })
        .collect();
    if !calls.is_empty() {
        out.push(calls);
    }
    out
}

fn build_dag(
    a: &Annotated,
    fusion: bool,
    extras: &[Extra],
    runtime_gathers: bool,
) -> Result<(Dag, BTreeMap<NodeId, TaskId>), String> {
    let g = &a.plan.graph;
    let placements = estimate::placements(a);
    let deps = estimate::call_deps(a);
    let devices = a.cluster.devices() as usize;
    let mut b = DagBuilder::new(devices);
    // On a CPU the runtime generates on one thread and runs streamed inference on another,
    // beside it when the rank has a core to spare.
    b.threaded(a.cost.device.spare_core());
    let mut task_of: BTreeMap<NodeId, TaskId> = BTreeMap::new();
    // What a call's consumers wait for, where that is not the call's own task: its gather.
    let mut ready_of: BTreeMap<NodeId, TaskId> = BTreeMap::new();
    // Calls whose results are not exchanged among the ranks yet. The runtime exchanges a
    // rollout and the results streamed under its generation together as the generation ends,
    // and gathers an inference call's rows where they are first read (so that calls on
    // disjoint devices run side by side), those of all the calls a node reads in one
    // exchange; what no call read is exchanged at the end of the iteration.
    let mut ungathered: Ungathered = BTreeMap::new();
    let exchanges = runtime_gathers && a.cost.host_allgather_time(0.0, devices as u64).is_some();
    let all_devices: Vec<usize> = (0..devices).collect();
    let cost = &a.cost;
    // One exchange of the calls `ids` (whose tasks it follows): a task on every device.
    let exchange = |b: &mut DagBuilder,
                    ungathered: &mut Ungathered,
                    ready_of: &mut BTreeMap<NodeId, TaskId>,
                    ids: &[NodeId]| {
        let parts: Vec<(NodeId, TaskId, f64)> = ids
            .iter()
            .filter_map(|id| ungathered.remove(id).map(|u| (*id, u.task, u.bytes)))
            .collect();
        let Some(&(first, _, _)) = parts.first() else {
            return;
        };
        let bytes: f64 = parts.iter().map(|p| p.2).sum();
        let t = b.task(
            &format!("{first} gather"),
            "gather",
            all_devices.clone(),
            exchange_work(cost, bytes, all_devices.len() as u64),
        );
        for (id, call, _) in parts {
            b.after(t, call);
            ready_of.insert(id, t);
        }
    };
    let order = g.topo_order().unwrap_or_else(|| g.node_ids());
    let transfers: Vec<NodeId> = g
        .node_ids()
        .into_iter()
        .filter(|i| {
            g.node(*i).is_some_and(|n| {
                matches!(
                    n.op,
                    Op::Reshard { .. } | Op::Offload { .. } | Op::Reload { .. }
                )
            })
        })
        .collect();
    let pos: BTreeMap<NodeId, usize> = order.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let range =
        |p: &Placement| (p.first as usize..(p.first + p.count) as usize).collect::<Vec<_>>();
    let fused: BTreeMap<NodeId, (NodeId, f64)> = if fusion {
        a.decisions
            .interleave
            .iter()
            .flat_map(|d| {
                let secs = repriced_fused_seconds(a, d);
                [
                    (d.forward, (d.reverse, secs)),
                    (d.reverse, (d.forward, secs)),
                ]
            })
            .collect()
    } else {
        BTreeMap::new()
    };
    // Streaming consumers of a generation that run on its own model in its own layout, on
    // devices it frees: their weights are the generation's, already in place, so nothing is
    // resharded into them, and what follows them reshards from the generation's layout.
    let in_gen_layout: BTreeMap<NodeId, (NodeId, Placement)> = if fusion {
        a.decisions
            .streams
            .iter()
            .filter(|(_, s)| s.cut == Cut::Sample)
            .filter_map(|(&id, s)| {
                let gp = placements.get(&s.generate)?;
                let sub = a.decisions.subtask_placements.get(&id)?;
                let model = |n: NodeId| g.node(n).and_then(|x| x.op.model());
                let m = model(id)?;
                let shape = a.shape(m)?;
                let in_place = model(s.generate) == Some(m)
                    && estimate::reshard_bytes(shape, a.dtype_bytes(m), gp, sub).0 == 0;
                in_place.then_some((id, (s.generate, *gp)))
            })
            .collect()
    } else {
        BTreeMap::new()
    };
    let mut pending_after: Vec<(NodeId, NodeId)> = Vec::new();
    for &id in &order {
        let Some(node) = g.node(id) else { continue };
        if !node.op.is_model_call() {
            continue;
        }
        // Transfers that must happen before this call (reshards from an earlier call, reloads).
        let mut before_me = Vec::new();
        for &t in &transfers {
            let Some(tn) = g.node(t) else { continue };
            let (after, before) = match tn.op {
                Op::Reshard { after, before, .. } => (Some(after), Some(before)),
                Op::Reload { before, .. } => (None, Some(before)),
                Op::Offload { after, .. } => (Some(after), None),
                _ => continue,
            };
            if before != Some(id) {
                continue;
            }
            if after.is_some_and(|x| in_gen_layout.get(&id).is_some_and(|(g_id, _)| *g_id == x)) {
                continue;
            }
            let backwards = after.is_some_and(|x| pos.get(&x) >= pos.get(&id));
            if backwards {
                // Back to the first layout for the next iteration: at the end.
                if let Some(x) = after {
                    pending_after.push((t, x));
                }
                continue;
            }
            let Some(p) = placements.get(&id) else {
                continue;
            };
            let secs = match (&tn.op, after.and_then(|x| in_gen_layout.get(&x))) {
                (Op::Reshard { model, .. }, Some((_, gp))) => a.shape(*model).map_or(0.0, |sh| {
                    let (_, most) = estimate::reshard_bytes(sh, a.dtype_bytes(*model), gp, p);
                    estimate::reshard_seconds(a, most, gp, p)
                }),
                _ => a.decisions.transfers.get(&t).map_or(0.0, |d| d.seconds),
            };
            let task = b.task(
                &format!("{t} {}", tn.op.name()),
                stage_of(&tn.op),
                range(p),
                Work::Fixed { seconds: secs },
            );
            if let Some(x) = after.and_then(|x| task_of.get(&x)) {
                b.after(task, *x);
            }
            task_of.insert(t, task);
            before_me.push(task);
        }
        if let Some(&(partner, _)) = fused.get(&id)
            && let Some(&t) = task_of.get(&partner)
        {
            task_of.insert(id, t);
            continue;
        }
        let Some(p0) = placements.get(&id) else {
            continue;
        };
        let size = call_size(a, id).ok_or_else(|| format!("{id}: no size"))?;
        let shape = node
            .op
            .model()
            .and_then(|m| a.shape(m))
            .ok_or_else(|| format!("{id}: no model shape"))?;
        let stream_from = match a.decisions.streams.get(&id) {
            Some(s) if fusion && s.cut == Cut::Sample => Some(s.generate),
            _ => None,
        };
        let p = match (stream_from, a.decisions.subtask_placements.get(&id)) {
            (Some(_), Some(sub)) => *sub,
            _ => *p0,
        };
        let name = a.call_name(id);
        let work =
            match &node.op {
                Op::Generate { .. } => Work::Generate(Box::new(GenerateSpec {
                    samples: size.samples,
                    samples_per_prompt: size.per_prompt,
                    prompt_len: size.prompt_len,
                    instances: p.dp.max(1),
                    lengths: clip_lengths(&a.workload.lengths, size.max_new),
                    model: shape.clone(),
                    cost: node
                        .op
                        .model()
                        .map_or_else(|| a.cost.clone(), |m| a.cost_of(m)),
                    migration: a.decisions.migrations.get(&id).filter(|_| fusion).map(|m| {
                        Migration {
                            threshold: m.threshold,
                            to_instances: m.to_instances.min(p.dp.max(1)),
                        }
                    }),
                    max_batch: a.engine_max_batch,
                    stages: p.pp.max(1),
                })),
                Op::Train { .. } => {
                    let secs = match fused.get(&id) {
                        Some(&(_, s)) => s,
                        None => estimate::call_time(a, id, &p),
                    };
                    // Its ranks sum gradients after every mini-batch: each waits for the
                    // slowest.
                    let ranks = p.dp.max(1) * p.tp.max(1) * p.pp.max(1);
                    Work::Fixed {
                        seconds: secs * a.cost.slowest_of(ranks),
                    }
                }
                // Taken from the training forward pass: no work of its own.
                _ if a.decisions.reused_logprobs.contains_key(&id) => Work::Fixed { seconds: 0.0 },
                _ => {
                    let per = size.samples.div_ceil(p.dp.max(1));
                    let chunk = per.div_ceil(p.microbatches.max(1));
                    Work::inference(
                        &a.cost,
                        shape,
                        Layout {
                            dp: 1,
                            tp: p.tp,
                            pp: p.pp,
                        },
                        p.dp,
                        size.samples,
                        size.padded_seq(chunk, None),
                        chunk,
                    )
                }
            };
        let mut devs = range(&p);
        let mut my_deps: Vec<NodeId> = deps.get(&id).cloned().unwrap_or_default();
        if let Some(&(partner, _)) = fused.get(&id) {
            if let Some(pp) = placements.get(&partner) {
                devs.extend(range(pp));
            }
            my_deps.extend(deps.get(&partner).cloned().unwrap_or_default());
        }
        devs.sort_unstable();
        devs.dedup();
        let reads: Vec<NodeId> = my_deps
            .iter()
            .copied()
            .filter(|d| Some(*d) != stream_from)
            .collect();
        for ids in exchanges_for(&ungathered, &reads) {
            exchange(&mut b, &mut ungathered, &mut ready_of, &ids);
        }
        let label = if fused.contains_key(&id) {
            let partner = fused.get(&id).map(|x| a.call_name(x.0)).unwrap_or_default();
            format!("{name} + {partner} (fused)")
        } else {
            name
        };
        let mut pre = Vec::new();
        for x in extras.iter().filter(|x| x.call == id && !x.after) {
            let t = b.task(
                &format!("{id} {}", x.label),
                x.stage,
                x.devices.clone().unwrap_or_else(|| devs.clone()),
                Work::Fixed { seconds: x.seconds },
            );
            for d in &my_deps {
                if let Some(dt) = ready_of.get(d).or_else(|| task_of.get(d)) {
                    b.after(t, *dt);
                }
            }
            for &bt in &before_me {
                b.after(t, bt);
            }
            pre.push(t);
        }
        let task = b.task(
            &format!("{id} {label}"),
            stage_of(&node.op),
            devs.clone(),
            work,
        );
        for t in pre {
            b.after(task, t);
        }
        for d in my_deps {
            if Some(d) == stream_from {
                continue;
            }
            if let Some(t) = ready_of.get(&d).or_else(|| task_of.get(&d)) {
                b.after(task, *t);
            }
        }
        for t in before_me {
            b.after(task, t);
        }
        if let Some(gen_id) = stream_from
            && let Some(t) = task_of.get(&gen_id)
        {
            b.stream(task, *t);
        }
        task_of.insert(id, task);
        // A training whose first forward gives `logprobs` calls their values (`sample-split`)
        // hands those rows to every rank as it ends, in one exchange
        // (`runtime/src/exec/train.rs`).
        if exchanges && matches!(node.op, Op::Train { .. }) {
            let bytes: f64 = a
                .decisions
                .reused_logprobs
                .iter()
                .filter(|(_, t)| **t == id)
                .filter_map(|(lp, _)| {
                    let (ln, ls) = (g.node(*lp)?, call_size(a, *lp)?);
                    gathered_bytes(&ln.op, &ls)
                })
                .sum();
            if bytes > 0.0 {
                // Part of the training as the runtime times it (`time/train`).
                let t = b.task(
                    &format!("{id} gather of the reused log-probabilities"),
                    "train",
                    all_devices.clone(),
                    exchange_work(cost, bytes, all_devices.len() as u64),
                );
                b.after(t, task);
            }
        }
        let reused = a.decisions.reused_logprobs.contains_key(&id);
        if exchanges
            && !reused
            && let Some(bytes) = gathered_bytes(&node.op, &size)
        {
            let generation = match node.op {
                Op::Generate { .. } => Some(id),
                _ => stream_from,
            };
            ungathered.insert(
                id,
                Unexchanged {
                    task,
                    bytes,
                    generation,
                },
            );
        }
        for x in extras.iter().filter(|x| x.call == id && x.after) {
            let t = b.task(
                &format!("{id} {}", x.label),
                x.stage,
                x.devices.clone().unwrap_or_else(|| devs.clone()),
                Work::Fixed { seconds: x.seconds },
            );
            b.after(t, task);
        }
        // Offloads right after this call.
        for &t in &transfers {
            if let Some(Op::Offload { after, .. }) = g.node(t).map(|n| &n.op)
                && *after == id
            {
                let secs = a.decisions.transfers.get(&t).map_or(0.0, |d| d.seconds);
                let ot = b.task(
                    &format!("{t} offload"),
                    "offload",
                    range(&p),
                    Work::Fixed { seconds: secs },
                );
                b.after(ot, task);
                task_of.insert(t, ot);
            }
        }
    }
    let rest: Vec<NodeId> = ungathered.keys().copied().collect();
    for ids in exchanges_for(&ungathered, &rest) {
        exchange(&mut b, &mut ungathered, &mut ready_of, &ids);
    }
    for (t, after) in pending_after {
        let (Some(tn), Some(&at)) = (g.node(t), task_of.get(&after)) else {
            continue;
        };
        let Op::Reshard { before, .. } = tn.op else {
            continue;
        };
        let Some(p) = placements.get(&before) else {
            continue;
        };
        let secs = a.decisions.transfers.get(&t).map_or(0.0, |d| d.seconds);
        let task = b.task(
            &format!("{t} reshard (next iteration)"),
            "reshard",
            range(p),
            Work::Fixed { seconds: secs },
        );
        b.after(task, at);
        task_of.insert(t, task);
    }
    let dag = b.build().map_err(|e| e.0)?;
    Ok((dag, task_of))
}

/// One system's simulated iteration.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SystemResult {
    pub system: String,
    pub mean_iteration_seconds: f64,
    /// From the iteration's start to the end of the last generation or inference task.
    pub generation_inference_seconds: f64,
    /// From the first training task's start to the last one's end.
    pub training_seconds: f64,
    pub mean_utilisation: f64,
    pub bubble_fraction: f64,
    /// The stage breakdown behind the generation-plus-inference time.
    pub breakdown: Breakdown,
}

/// Where the generation-plus-inference time goes, mean over iterations (seconds).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Breakdown {
    /// The generation stage: first start to last end.
    pub generation: f64,
    /// The long tail: from when 90 % of the samples had finished to the generation's end.
    pub tail: f64,
    /// The inference stage: first start to last end (it overlaps generation when it streams).
    pub inference: f64,
    /// Inference left after the generation ended.
    pub inference_after_generation: f64,
    /// Reshard and offload tasks inside the generation-plus-inference window, summed over
    /// tasks (each on its devices).
    pub transfers_in_window: f64,
    /// Idle device-time over all device-time in the generation-plus-inference window.
    pub idle_fraction: f64,
}

/// Summarises a report: mean over iterations of the generation-plus-inference and training
/// spans, and the breakdown.
pub fn summarise(system: &str, r: &SimReport) -> SystemResult {
    let n = r.iterations.len().max(1) as f64;
    let devices = r.device_utilisation.len().max(1) as f64;
    let mut gi = 0.0;
    let mut tr = 0.0;
    let mut b = Breakdown::default();
    for it in &r.iterations {
        let stage = |name: &str| it.stages.iter().find(|s| s.stage == name);
        let end = it
            .stages
            .iter()
            .filter(|s| s.stage == "generate" || s.stage == "inference" || s.stage == "gather")
            .map(|s| s.end)
            .fold(it.start, f64::max);
        gi += end - it.start;
        tr += stage("train").map_or(0.0, |s| s.end - s.start);
        let gen_end = stage("generate").map_or(it.start, |s| s.end);
        b.generation += stage("generate").map_or(0.0, |s| s.end - s.start);
        b.inference += stage("inference").map_or(0.0, |s| s.end - s.start);
        b.inference_after_generation += (end - gen_end).max(0.0);
        b.tail += it
            .generations
            .iter()
            .map(|g| g.end - g.p90_at)
            .fold(0.0, f64::max);
        // Busy device-time inside the window; a span is one device's.
        let mut busy = 0.0;
        let mut tasks = std::collections::BTreeSet::new();
        for s in r.timeline.iter().filter(|s| s.iteration == it.index) {
            let (lo, hi) = (s.start.max(it.start), s.end.min(end));
            if hi > lo {
                busy += hi - lo;
                if (s.stage == "reshard" || s.stage == "offload")
                    && tasks.insert((s.task.clone(), s.start.to_bits()))
                {
                    b.transfers_in_window += hi - lo;
                }
            }
        }
        let window = (end - it.start) * devices;
        if window > 0.0 {
            b.idle_fraction += 1.0 - busy / window;
        }
    }
    for x in [
        &mut b.generation,
        &mut b.tail,
        &mut b.inference,
        &mut b.inference_after_generation,
        &mut b.transfers_in_window,
        &mut b.idle_fraction,
    ] {
        *x /= n;
    }
    let util = r.device_utilisation.iter().sum::<f64>() / r.device_utilisation.len().max(1) as f64;
    SystemResult {
        system: system.to_string(),
        mean_iteration_seconds: r.mean_iteration_time,
        generation_inference_seconds: gi / n,
        training_seconds: tr / n,
        mean_utilisation: util,
        bubble_fraction: r.bubble_fraction,
        breakdown: b,
    }
}

/// Simulates a placed plan.
pub fn simulate_plan(a: &Annotated, fusion: bool, opts: &SimOptions) -> Result<SimReport, String> {
    let (dag, _) = to_dag(a, fusion)?;
    simulate(&dag, opts).map_err(|e| e.0)
}

/// The comparison `braid sim` prints.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Comparison {
    pub systems: Vec<SystemResult>,
    /// Braid with fusion over Braid without: generation + inference, training, iteration.
    pub fusion_gain: Gains,
    /// Braid's plan with its fusion decisions over the same placements with streaming,
    /// migration and fused training switched off (RLHFuse's ablation on one parallel
    /// configuration).
    pub fusion_gain_same_placement: Gains,
    /// Iteration time with each pass disabled over the full plan's.
    pub pass_gains: Vec<(String, f64)>,
    pub searched_vs_heuristic: Option<(f64, f64)>,
    /// Baselines that cannot run the program on the cluster, or run it other than as
    /// modelled, and why (one line each, naming the system).
    pub notes: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Gains {
    pub generation_inference: f64,
    pub training: f64,
    pub end_to_end: f64,
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 1.0 }
}

/// The systems of a comparison, simulated: results in order (DeepSpeed-Chat, OpenRLHF, ReaL's
/// heuristic, ReaL's symmetric plan, Braid without fusion, Braid; a baseline that cannot run
/// is left out with a note), the notes, and Braid's plan and report.
pub struct Systems {
    pub results: Vec<SystemResult>,
    pub notes: Vec<String>,
    pub full: Annotated,
    pub full_report: SimReport,
    /// Braid with `sample-split` and `microbatch-interleave` off.
    pub nofuse: SystemResult,
}

/// Plans `base` six ways and simulates each: DeepSpeed-Chat, OpenRLHF, ReaL's heuristic and
/// ReaL's symmetric plan as [`crate::baselines`] models them, Braid without fusion
/// (`sample-split` and `microbatch-interleave` disabled) and Braid.
pub fn systems(
    base: &Annotated,
    disabled: &[String],
    opts: &SimOptions,
) -> Result<Systems, PassError> {
    let sim_err = |e: String| PassError(format!("simulation: {e}"));
    let plan_with = |extra: &[&str]| -> Result<Annotated, PassError> {
        let mut names: Vec<String> = disabled.to_vec();
        names.extend(extra.iter().map(|s| s.to_string()));
        names.sort();
        names.dedup();
        let mut a = base.clone();
        PassManager::new().disable(&names)?.run(&mut a, |_, _| {})?;
        Ok(a)
    };
    let mut systems = Vec::new();
    let mut notes = Vec::new();
    let baseline = |placements: BTreeMap<NodeId, Placement>,
                    max_batch: Option<u64>,
                    off: &[&str]|
     -> Result<Annotated, PassError> {
        let mut x = base.clone();
        x.decisions.placements = placements;
        x.engine_max_batch = max_batch;
        let names: Vec<String> = off.iter().map(|s| s.to_string()).collect();
        PassManager::new().disable(&names)?.run(&mut x, |_, _| {})?;
        Ok(x)
    };
    // DeepSpeed-Chat and OpenRLHF move weights their own way (the extras), not by reshards.
    let own_transfers = [
        "place",
        "sample-split",
        "microbatch-interleave",
        "reshard-insert",
        "speculate",
    ];
    match baselines::deepspeed_chat(base) {
        Ok((placements, extras, rows)) => {
            let ds = baseline(placements, Some(rows), &own_transfers)?;
            let (dag, _) = to_dag_with(&ds, false, &extras).map_err(sim_err)?;
            let r = simulate(&dag, opts).map_err(|e| sim_err(e.0))?;
            systems.push(summarise(
                "deepspeed-chat (hybrid engine, zero-3 on all devices)",
                &r,
            ));
        }
        Err(e) => notes.push(format!("deepspeed-chat not simulated: {e}")),
    }
    match baselines::openrlhf(base) {
        Ok((placements, extras, rows)) => {
            let o = baseline(placements, Some(rows), &own_transfers)?;
            let (dag, _) = to_dag_with(&o, false, &extras).map_err(sim_err)?;
            let r = simulate(&dag, opts).map_err(|e| sim_err(e.0))?;
            systems.push(summarise(
                "openrlhf (vllm engines, actor and critic groups, weight broadcast)",
                &r,
            ));
        }
        Err(e) => notes.push(format!("openrlhf not simulated: {e}")),
    }
    // ReaL's heuristic where its rule applies (PPO on nodes of 8 GPUs), else a layout per call
    // on all devices; parameters reallocated between calls by reshards.
    let (real, real_name) = match baselines::real_heuristic_placements(base) {
        Ok(p) => (
            baseline(p, base.engine_max_batch, &REALLOCATING_BASELINE)?,
            "real-heuristic (ReaL's allocation for PPO)".to_string(),
        ),
        Err(e) => {
            notes.push(format!(
                "real-heuristic: {e}; every call on all devices with its fastest layout instead"
            ));
            (
                plan_with(&REALLOCATING_BASELINE)?,
                "real-heuristic (layout per call on all devices)".to_string(),
            )
        }
    };
    let real_report = simulate_plan(&real, false, opts).map_err(sim_err)?;
    systems.push(summarise(&real_name, &real_report));
    // The plan of the "ReaL-Heuristic" bars in ReaL's figure: one Megatron-LM layout for
    // every call on all devices.
    match simulate_real_symmetric(base, opts)? {
        Ok(r) => systems.push(summarise(
            "real-symmetric (all devices, tp over a node, a stage per node)",
            &r,
        )),
        Err(e) => notes.push(format!("real-symmetric not simulated: {e}")),
    }
    // Without fusion: the same system — the same passes, `place` searching for a plan that
    // does not fuse — with `sample-split` and `microbatch-interleave` off (RLHFuse's
    // RLHFuse-Base), so the gain is the fusion's alone.
    let nofuse = plan_with(&["sample-split", "microbatch-interleave"])?;
    let nofuse_report = simulate_plan(&nofuse, false, opts).map_err(sim_err)?;
    let nofuse_sum = summarise("braid without fusion (same passes)", &nofuse_report);
    let full = plan_with(&[])?;
    systems.push(nofuse_sum.clone());
    let full_report = simulate_plan(&full, true, opts).map_err(sim_err)?;
    let full_sum = summarise("braid", &full_report);
    systems.push(full_sum);
    Ok(Systems {
        results: systems,
        notes,
        full,
        full_report,
        nofuse: nofuse_sum,
    })
}

/// The passes a ReaL baseline runs on its own placements: only `reshard-insert`, since ReaL
/// reallocates parameters between its calls' layouts.
const REALLOCATING_BASELINE: [&str; 4] = [
    "place",
    "sample-split",
    "microbatch-interleave",
    "speculate",
];

/// ReaL's symmetric plan ([`baselines::real_symmetric_placements`]) simulated on `base`
/// without fusion, parameters moved by reshards where layouts differ (they do not); the inner
/// error says why the plan does not apply to the program.
pub fn simulate_real_symmetric(
    base: &Annotated,
    opts: &SimOptions,
) -> Result<Result<SimReport, String>, PassError> {
    let placements = match baselines::real_symmetric_placements(base) {
        Ok(p) => p,
        Err(e) => return Ok(Err(e)),
    };
    let mut x = base.clone();
    x.decisions.placements = placements;
    let off: Vec<String> = REALLOCATING_BASELINE
        .iter()
        .map(|s| s.to_string())
        .collect();
    PassManager::new().disable(&off)?.run(&mut x, |_, _| {})?;
    simulate_plan(&x, false, opts)
        .map(Ok)
        .map_err(|e| PassError(format!("simulation: {e}")))
}

/// [`systems`], with the fusion gains and each pass's gain. Returns the comparison and
/// Braid's plan and report (for traces).
pub fn compare(
    base: &Annotated,
    disabled: &[String],
    opts: &SimOptions,
) -> Result<(Comparison, Annotated, SimReport), PassError> {
    let sim_err = |e: String| PassError(format!("simulation: {e}"));
    let plan_with = |extra: &[&str]| -> Result<Annotated, PassError> {
        let mut names: Vec<String> = disabled.to_vec();
        names.extend(extra.iter().map(|s| s.to_string()));
        names.sort();
        names.dedup();
        let mut a = base.clone();
        PassManager::new().disable(&names)?.run(&mut a, |_, _| {})?;
        Ok(a)
    };
    let Systems {
        results: systems,
        notes,
        full,
        full_report,
        nofuse: nofuse_sum,
    } = self::systems(base, disabled, opts)?;
    let full_sum = systems
        .last()
        .cloned()
        .ok_or_else(|| PassError("no systems".into()))?;
    let gains = |without: &SystemResult, with: &SystemResult| Gains {
        generation_inference: ratio(
            without.generation_inference_seconds,
            with.generation_inference_seconds,
        ),
        training: ratio(without.training_seconds, with.training_seconds),
        end_to_end: ratio(without.mean_iteration_seconds, with.mean_iteration_seconds),
    };
    let fusion_gain = gains(&nofuse_sum, &full_sum);
    let same_placement = summarise(
        "braid's placement without fusion",
        &simulate_plan(&full, false, opts).map_err(sim_err)?,
    );
    let fusion_gain_same_placement = gains(&same_placement, &full_sum);
    let mut pass_gains = Vec::new();
    for name in crate::passes::pass_names() {
        if disabled.iter().any(|d| d == name) {
            continue;
        }
        let without = plan_with(&[name])?;
        let fusion = name != "sample-split" || without.will_run("sample-split");
        let r = simulate_plan(&without, fusion, opts).map_err(sim_err)?;
        pass_gains.push((
            name.to_string(),
            ratio(r.mean_iteration_time, full_report.mean_iteration_time),
        ));
    }
    let searched_vs_heuristic = full
        .decisions
        .search
        .as_ref()
        .map(|s| (s.heuristic_seconds, s.searched_seconds));
    Ok((
        Comparison {
            systems,
            fusion_gain,
            fusion_gain_same_placement,
            pass_gains,
            searched_vs_heuristic,
            notes,
        },
        full,
        full_report,
    ))
}

/// Seconds of interleaved training decision `d` on `a`'s workload and cost model: the decided
/// schedule with every duration scaled as the two trainings' serial time scales from the
/// planner's workload to this one (a plan simulated with the prompt lengths a run measured,
/// `braid report --against-sim`, prices its fused training on them, not on the planner's).
fn repriced_fused_seconds(a: &Annotated, d: &braid_ir::exec_plan::InterleaveDecision) -> f64 {
    let places = &a.decisions.placements;
    let (Some(pf), Some(pr)) = (places.get(&d.forward), places.get(&d.reverse)) else {
        return d.fused_seconds;
    };
    match estimate::fused_train(a, d.forward, pf, d.reverse, pr) {
        Some(now) if d.serial_seconds > 0.0 && now.serial_seconds > 0.0 => {
            d.fused_seconds * now.serial_seconds / d.serial_seconds
        }
        _ => d.fused_seconds,
    }
}
