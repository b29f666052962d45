//! A lowered [`Plan`] with what the planner knows and decides about it: the cluster, the shape
//! of every model, the workload (prompt length and generated-length distribution), the user's
//! schedule pins, and the decisions of the passes ([`PlanDecisions`]).
//!
//! The passes read and write an [`Annotated`]; the graph itself changes only where a pass
//! inserts nodes (`reshard-insert`). Everything here is plain data in `BTreeMap`s, so rendering
//! it is deterministic. This module decides nothing; the passes do.

use std::collections::BTreeMap;

use braid_ir::graph::{ModelSource, NodeId, Op, Plan};
use serde::Serialize;

use crate::cluster::ClusterSpec;
use crate::cost::{BYTE_VOCAB, CostModel, Layout, ModelShape};
use crate::sim::LengthDist;

/// What one iteration processes, beyond what the graph says: how long prompts are and how long
/// generations turn out (declared, default, or profiled).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Workload {
    pub prompt_len: u64,
    /// Generated lengths; clipped to each `generate`'s `max_new_tokens`.
    pub lengths: LengthDist,
}

impl Workload {
    /// Prompts of 128 tokens; lengths log-normal with the median at a quarter of the limit and
    /// σ = 0.6 — long-tailed, as RLHF generations are (RLHFuse Fig. 2).
    pub fn default_for(max_new_tokens: u64) -> Workload {
        let max = max_new_tokens.max(1);
        let mu = ((max as f64) / 4.0).max(1.0).ln();
        Workload {
            prompt_len: 128,
            lengths: LengthDist::LogNormal {
                mu,
                sigma: 0.6,
                max,
            },
        }
    }
}

/// A model-call selector of a schedule pin, with the model named as the program or the
/// pipeline names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PinTarget {
    /// `generate`, `logprobs`, `values`, `score`, `train`.
    pub op: String,
    pub model: Option<String>,
}

/// How a `speculate` pin fixes the drafting of a `generate`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum SpeculatePin {
    Off,
    Ngram { n: u64, max: Option<u64> },
    Draft { model: String },
}

/// A `place` pin: devices `from..to` with the given degrees (unspecified degrees are 1, and `dp`
/// fills the rest of the range).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PlacePin {
    pub target: PinTarget,
    pub from: u64,
    pub to: u64,
    pub tp: Option<u64>,
    pub pp: Option<u64>,
    pub dp: Option<u64>,
}

/// A `fuse SEL -> SEL, SEL…` pin.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FusePin {
    pub from: PinTarget,
    pub to: Vec<PinTarget>,
}

/// The schedule pins the planner must respect (checked already by `braid-sema`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Pins {
    pub place: Vec<PlacePin>,
    pub speculate: Vec<(Option<PinTarget>, SpeculatePin)>,
    /// `fuse off`.
    pub fuse_off: bool,
    /// `fuse SEL -> SEL, SEL…`: of the generation the first selector names, only the calls the
    /// others name stream; its other consumers wait for the whole batch.
    pub fuse: Vec<FusePin>,
    /// `interleave SEL, SEL…`: the trainings that run as one fused pipeline schedule (and no
    /// other pair does).
    pub interleave: Vec<Vec<PinTarget>>,
    /// `migrate off`.
    pub migrate_off: bool,
    /// `migrate below P%`: the threshold as a fraction of the samples.
    pub migrate_below: Option<f64>,
    /// Model names a selector may use for each model slot besides the slot's own name (the
    /// pipeline parameter it is bound to).
    pub aliases: BTreeMap<u32, Vec<String>>,
}

impl Pins {
    /// Whether `target` selects call `id` of `plan`.
    pub fn selects_call(&self, plan: &Plan, target: &PinTarget, id: NodeId) -> bool {
        plan.graph.node(id).is_some_and(|n| {
            let name =
                n.op.model()
                    .and_then(|m| plan.models.get(m as usize))
                    .map_or("", |m| m.name.as_str());
            self.selects(target, &n.op, name)
        })
    }

    /// Whether `target` selects node `op` (on model slot `model`, named `name`).
    pub fn selects(&self, target: &PinTarget, op: &Op, name: &str) -> bool {
        if op.name() != target.op {
            return false;
        }
        match (&target.model, op.model()) {
            (None, _) => true,
            (Some(m), Some(slot)) => {
                m == name
                    || self
                        .aliases
                        .get(&slot)
                        .is_some_and(|v| v.iter().any(|a| a == m))
            }
            (Some(_), None) => false,
        }
    }
}

/// Where and how one model call runs: devices `first..first+count` with a layout whose
/// `devices()` is `count`, and (for `train` and inference) the number of micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Placement {
    pub first: u64,
    pub count: u64,
    pub dp: u64,
    pub tp: u64,
    pub pp: u64,
    pub microbatches: u64,
}

impl Placement {
    pub fn layout(&self) -> Layout {
        Layout {
            dp: self.dp,
            tp: self.tp,
            pp: self.pp,
        }
    }

    pub fn devices(&self) -> std::ops::Range<u64> {
        self.first..self.first + self.count
    }

    pub fn overlaps(&self, other: &Placement) -> bool {
        self.first < other.first + other.count && other.first < self.first + self.count
    }

    /// The same devices and degrees (micro-batches aside): no parameters need to move.
    pub fn same_layout(&self, other: &Placement) -> bool {
        (self.first, self.count, self.dp, self.tp, self.pp)
            == (other.first, other.count, other.dp, other.tp, other.pp)
    }
}

/// How far a consumer of a generation can run ahead of it (`sample-split`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cut {
    /// Runs sample by sample as samples finish.
    Sample,
    /// Waits for each prompt's group.
    Group,
    /// Waits for the whole batch.
    Batch,
}

/// `sample-split`'s decision for one node that reads a rollout.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StreamDecision {
    pub generate: NodeId,
    pub cut: Cut,
    pub why: String,
}

/// `sample-split`'s long-tail migration for one `generate`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MigrationDecision {
    /// Migrate when no more than this many samples are still decoding.
    pub threshold: u64,
    /// Engine instances that keep the tail.
    pub to_instances: u64,
    /// Every candidate threshold with its simulated mean iteration time (seconds).
    pub candidates: Vec<(u64, f64)>,
    pub why: String,
}

/// `microbatch-interleave`'s fused schedule of two `train` calls sharing devices.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct InterleaveDecision {
    /// The model in forward direction (the larger pipeline) and the one in reverse.
    pub forward: NodeId,
    pub reverse: NodeId,
    /// One time unit of the fused problem, in seconds.
    pub unit_seconds: f64,
    pub latency: u64,
    pub lower_bound: u64,
    pub serial_1f1b_latency: u64,
    pub peak_memory: u64,
    /// The whole fused training (every optimizer step of both models), in seconds, against the
    /// two trainings one after the other.
    pub fused_seconds: f64,
    pub serial_seconds: f64,
    pub why: String,
}

/// `speculate`'s decision for one `generate`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SpeculationDecision {
    /// `off`, `ngram` or `draft`.
    pub mode: String,
    pub ngram: Option<u64>,
    pub draft_model: Option<String>,
    /// Draft length by live batch: `(up to this many live sequences, draft this many tokens)`,
    /// ascending; 0 means no drafting at that batch.
    pub policy: Vec<(u64, u64)>,
    /// Acceptance rate assumed per drafted token.
    pub acceptance: f64,
    /// Predicted decode time with and without speculation (seconds).
    pub predicted_seconds: f64,
    pub baseline_seconds: f64,
    pub pinned: bool,
    pub why: String,
}

/// `place`'s search record.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SearchRecord {
    pub heuristic_seconds: f64,
    pub searched_seconds: f64,
    pub iterations: u64,
    pub accepted: u64,
    pub seed: u64,
    /// The final check in the simulator: each candidate placement (`searched`, `heuristic`,
    /// `per-model`) with its simulated mean iteration (reshards and offloads inserted, trainings
    /// interleaved where they would be), in that order; the fastest is kept.
    pub simulated: Vec<(String, f64)>,
    pub kept: String,
}

/// What a transfer node inserted by `reshard-insert` moves and how.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TransferDecision {
    pub bytes: u64,
    pub collectives: Vec<String>,
    pub seconds: f64,
    pub why: String,
}

/// Everything the passes decided. Keys are node ids of the plan's graph.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PlanDecisions {
    pub placements: BTreeMap<NodeId, Placement>,
    /// Why each call got its placement.
    pub placement_why: BTreeMap<NodeId, String>,
    pub search: Option<SearchRecord>,
    pub streams: BTreeMap<NodeId, StreamDecision>,
    pub migrations: BTreeMap<NodeId, MigrationDecision>,
    /// Streaming consumers moved onto the devices a generation's migration frees.
    pub subtask_placements: BTreeMap<NodeId, Placement>,
    pub interleave: Vec<InterleaveDecision>,
    pub transfers: BTreeMap<NodeId, TransferDecision>,
    pub speculation: BTreeMap<NodeId, SpeculationDecision>,
    /// Decisions not taken, and why (e.g. no two trains share devices).
    pub notes: Vec<String>,
    /// Passes that ran, in order.
    pub passes_run: Vec<String>,
}

/// A plan with its planning context and decisions.
#[derive(Clone, Debug)]
pub struct Annotated {
    pub plan: Plan,
    pub cluster: ClusterSpec,
    pub cost: CostModel,
    /// One per model slot of the plan.
    pub shapes: Vec<ModelShape>,
    pub workload: Workload,
    pub pins: Pins,
    /// The seed of every search and simulation.
    pub seed: u64,
    /// Passes the manager will run (set by it; all of them by default), so that a pass can
    /// price what a later one does only when that one runs.
    pub enabled: Vec<String>,
    pub decisions: PlanDecisions,
}

impl Annotated {
    pub fn new(
        plan: Plan,
        cluster: ClusterSpec,
        cost: CostModel,
        shapes: Vec<ModelShape>,
        workload: Workload,
        pins: Pins,
    ) -> Annotated {
        let seed = plan.seed.unsigned_abs() ^ 0xB8A1_D000;
        Annotated {
            plan,
            cluster,
            cost,
            shapes,
            workload,
            pins,
            seed,
            enabled: crate::passes::pass_names()
                .iter()
                .map(|s| s.to_string())
                .collect(),
            decisions: PlanDecisions::default(),
        }
    }

    /// The model calls in topological order.
    pub fn calls(&self) -> Vec<NodeId> {
        let g = &self.plan.graph;
        g.topo_order()
            .unwrap_or_else(|| g.node_ids())
            .into_iter()
            .filter(|id| g.node(*id).is_some_and(|n| n.op.is_model_call()))
            .collect()
    }

    pub fn model_name(&self, slot: u32) -> String {
        self.plan
            .models
            .get(slot as usize)
            .map_or_else(|| format!("#{slot}"), |m| m.name.clone())
    }

    /// Whether pin selector `t` names call `id`.
    pub fn selected(&self, t: &PinTarget, id: NodeId) -> bool {
        self.pins.selects_call(&self.plan, t, id)
    }

    /// `generate(policy)`: how a call is named in messages.
    pub fn call_name(&self, id: NodeId) -> String {
        match self.plan.graph.node(id) {
            Some(n) => match n.op.model() {
                Some(m) => format!("{}({})", n.op.name(), self.model_name(m)),
                None => n.op.name().to_string(),
            },
            None => id.to_string(),
        }
    }

    /// Whether pass `name` is among those the manager runs.
    pub fn will_run(&self, name: &str) -> bool {
        self.enabled.iter().any(|n| n == name)
    }

    pub fn is_trained(&self, slot: u32) -> bool {
        self.plan
            .models
            .get(slot as usize)
            .is_some_and(|m| m.optimizer.is_some())
    }

    pub fn shape(&self, slot: u32) -> Option<&ModelShape> {
        self.shapes.get(slot as usize)
    }
}

/// The shape of every model of a plan: `tiny(...)` from its options (byte vocabulary), a
/// Hugging Face directory through `hf` (the caller reads `config.json`; this crate does no
/// I/O), a frozen copy like its original. `Err` names the model.
pub fn shapes_from_plan(
    plan: &Plan,
    hf: &mut dyn FnMut(&str) -> Result<ModelShape, String>,
) -> Result<Vec<ModelShape>, String> {
    let mut out: Vec<Option<ModelShape>> = vec![None; plan.models.len()];
    for (i, m) in plan.models.iter().enumerate() {
        let shape = match &m.source {
            ModelSource::Tiny {
                layers,
                hidden,
                heads,
                kv_heads,
                intermediate,
                ..
            } => {
                let u = |x: i64| x.max(1) as u64;
                let mut s = ModelShape::tiny(
                    u(*layers),
                    u(*hidden),
                    u(*heads),
                    Some(u(*kv_heads)),
                    Some(u(*intermediate)),
                    BYTE_VOCAB,
                )
                .map_err(|e| format!("model `{}`: {e}", m.name))?;
                s.name = m.name.clone();
                s
            }
            ModelSource::Hf { dir } => hf(dir).map_err(|e| format!("model `{}`: {e}", m.name))?,
            ModelSource::FrozenOf(_) => continue,
        };
        out[i] = Some(shape);
    }
    for (i, m) in plan.models.iter().enumerate() {
        if let ModelSource::FrozenOf(src) = m.source {
            let s = out
                .get(src as usize)
                .cloned()
                .flatten()
                .ok_or_else(|| format!("model `{}` copies an unknown model", m.name))?;
            out[i] = Some(s);
        }
    }
    out.into_iter()
        .enumerate()
        .map(|(i, s)| s.ok_or_else(|| format!("model #{i} has no shape")))
        .collect()
}

/// The default workload of a plan: for its longest `max_new_tokens`.
pub fn default_workload(plan: &Plan) -> Workload {
    let max = plan
        .graph
        .node_ids()
        .into_iter()
        .filter_map(|i| match plan.graph.node(i).map(|n| &n.op) {
            Some(Op::Generate { params, .. }) => Some(params.max_new_tokens.max(1) as u64),
            _ => None,
        })
        .max()
        .unwrap_or(256);
    Workload::default_for(max)
}
