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
use crate::cost::{BYTE_VOCAB, CostModel, ModelShape};

// The passes' decisions are the executable plan's own types: what a pass records is what the
// runtime reads.
pub use braid_ir::exec_plan::{
    Cut, DraftKind, ExecPlan, InterleaveDecision, MigrationDecision, Placement, PlanDecisions,
    SearchRecord, SpeculationDecision, StreamDecision, TransferDecision, Workload,
};

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
    /// Running samples one generation instance holds at most: Braid's engine's
    /// [`crate::sim::ENGINE_MAX_BATCH`] by default; `None` for an engine that decodes the
    /// whole batch at once, memory permitting (ReaL's, which the validation study models).
    pub engine_max_batch: Option<u64>,
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
            engine_max_batch: Some(crate::sim::ENGINE_MAX_BATCH),
        }
    }

    /// The executable plan of this annotated plan: the plan, its cluster, shapes, workload and
    /// decisions. `braid plan --emit` writes it; [`Annotated::from_exec_plan`] reads it back to
    /// the same report.
    pub fn to_exec_plan(&self) -> ExecPlan {
        let mut e = ExecPlan::new(
            self.plan.clone(),
            self.cluster,
            self.shapes.clone(),
            self.workload.clone(),
            self.seed,
            self.decisions.clone(),
        );
        // A profile's entry travels with the plan; the datasheet's is implied by the cluster.
        if self.cost.device != self.cluster.device.spec() {
            e.device = Some(self.cost.device.clone());
        }
        e
    }

    /// An executable plan as the planner sees it again (for `braid plan plan.json`): the
    /// cost model is the plan's (its profile's device entry, else the cluster's), and no pins
    /// (they were applied when it was planned).
    pub fn from_exec_plan(e: &ExecPlan) -> Annotated {
        Annotated {
            plan: e.plan.clone(),
            cluster: e.cluster,
            cost: e.cost_model(),
            shapes: e.shapes.clone(),
            workload: e.workload.clone(),
            pins: Pins::default(),
            seed: e.seed,
            enabled: e.decisions.passes_run.clone(),
            decisions: e.decisions.clone(),
            engine_max_batch: Some(crate::sim::ENGINE_MAX_BATCH),
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

    /// Bytes per element of model `slot`'s dtype (its weights, activations and KV cache); the
    /// cluster's default when the plan leaves it open (the driver resolves it before
    /// planning).
    pub fn dtype_bytes(&self, slot: u32) -> u64 {
        self.plan
            .models
            .get(slot as usize)
            .and_then(|m| m.dtype)
            .map_or(self.cost.dtype_bytes, |d| d.bytes())
    }

    /// The cost model for calls of model `slot`: the cluster's device, the model's dtype.
    pub fn cost_of(&self, slot: u32) -> CostModel {
        self.cost.for_dtype(self.dtype_bytes(slot))
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
