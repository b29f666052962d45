//! The executable plan: the one contract between the compiler and the runtime, the way an
//! object file is between a compiler and a linker.
//!
//! An [`ExecPlan`] is the lowered [`Plan`] (task graph, models, datasets, run settings) with
//! everything the planner decided for a cluster: per model call its mesh and `(dp, tp, pp)`
//! layout and micro-batch count ([`Placement`]); which consumers of each `generate` stream and
//! in what chunks ([`StreamDecision`]); the long-tail migration threshold; speculative decoding
//! per `generate`; the fused schedule of two interleaved trainings; reshard, offload and reload
//! nodes with their transfer plans ([`crate::transfer`]); and which `logprobs` the runtime takes
//! from a training forward pass instead of running them. The planner writes these decisions,
//! the runtime reads them, and nothing else crosses: a runtime that needs to decide something
//! the plan does not say is a bug in the plan.
//!
//! **The JSON form** (`braid plan FILE --emit plan.json`, `RUN_DIR/plan.json`) is versioned:
//! `{"format": "braid-plan", "version": 2, …}`. Loading ([`ExecPlan::from_json`]) rejects another
//! format or version, unknown fields and unknown enum spellings with the path of the offending
//! field, then runs [`ExecPlan::verify`]: the task-graph verifier plus the consistency of every
//! decision with the graph, the models and the cluster. A plan edited into inconsistency is an
//! error naming the field, never a panic.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use braid_cost::cluster::ClusterSpec;
use braid_cost::cost::{CostModel, DeviceSpec, Layout, ModelShape};
use braid_cost::fused_pipeline::FusedSchedule;
use braid_cost::sim::LengthDist;
use serde::{Deserialize, Serialize};

use crate::graph::{ModelSource, NodeId, Op, Plan};
use crate::settings::Speculation;
use crate::transfer::TransferPlan;

/// The value of the `format` field of a plan file.
pub const PLAN_FORMAT: &str = "braid-plan";
/// The version of the plan format this build reads and writes. Bump it on any change to the
/// serialised form; older files are refused with a message saying which version they are.
/// Version 2: datasets name their messages field, where prompts come from and the record
/// fields the kernels read; kernels read record fields and compare texts.
pub const PLAN_VERSION: u32 = 2;

/// What one iteration processes, beyond what the graph says: how long prompts are and how long
/// generations turn out (declared, default, or profiled).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    /// The prompts' mean length in tokens (generation's prefill).
    pub prompt_len: u64,
    /// Generated lengths; clipped to each `generate`'s `max_new_tokens`.
    pub lengths: LengthDist,
    /// Prompt lengths, one drawn per prompt: what a pass over a micro-batch pads to (its
    /// longest prompt and completion). None: every prompt is `prompt_len` tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_lengths: Option<LengthDist>,
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
            prompt_lengths: None,
        }
    }
}

/// Where and how one model call runs: its mesh is devices `first..first+count` of the cluster,
/// with a layout whose `dp × tp × pp` is `count`, and (for `train` and inference) the number of
/// micro-batches each data-parallel replica splits its sequences into. A device's coordinates
/// in the layout follow [`Layout`]'s numbering: tensor-parallel innermost, then data-parallel,
/// then pipeline stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Placement {
    pub first: u64,
    pub count: u64,
    pub dp: u64,
    pub tp: u64,
    pub pp: u64,
    pub microbatches: u64,
}

/// A device's place in a call's layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Coords {
    pub dp: u64,
    pub tp: u64,
    pub pp: u64,
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

    /// The mesh as a list of cluster devices.
    pub fn mesh(&self) -> Vec<u64> {
        self.devices().collect()
    }

    pub fn overlaps(&self, other: &Placement) -> bool {
        self.first < other.first + other.count && other.first < self.first + self.count
    }

    /// The same devices and degrees (micro-batches aside): no parameters need to move.
    pub fn same_layout(&self, other: &Placement) -> bool {
        (self.first, self.count, self.dp, self.tp, self.pp)
            == (other.first, other.count, other.dp, other.tp, other.pp)
    }

    /// Where `device` sits in this layout, or `None` when it is not in the mesh.
    pub fn coords(&self, device: u64) -> Option<Coords> {
        if !self.devices().contains(&device) || self.tp == 0 || self.dp == 0 {
            return None;
        }
        let r = device - self.first;
        Some(Coords {
            tp: r % self.tp,
            dp: (r / self.tp) % self.dp,
            pp: r / (self.tp * self.dp),
        })
    }

    /// The device at `coords`.
    pub fn device_at(&self, c: Coords) -> u64 {
        self.first + c.pp * self.dp * self.tp + c.dp * self.tp + c.tp
    }
}

/// How far a consumer of a generation can run ahead of it (`sample-split`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
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
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamDecision {
    pub generate: NodeId,
    pub cut: Cut,
    /// For an inference call that streams (`cut` is `Sample`): the finished samples it takes
    /// per forward pass. 0 for nodes that do not run a model.
    pub chunk: u64,
    pub why: String,
}

/// `sample-split`'s long-tail migration for one `generate`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrationDecision {
    /// Migrate when no more than this many samples are still decoding.
    pub threshold: u64,
    /// Engine instances that keep the tail.
    pub to_instances: u64,
    /// Every candidate threshold with its simulated mean iteration time (seconds).
    pub candidates: Vec<(u64, f64)>,
    pub why: String,
    /// Pinned by `migrate below`: the runtime keeps it instead of re-choosing it from the
    /// lengths it observes.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pinned: bool,
}

/// `microbatch-interleave`'s fused schedule of two `train` calls sharing devices.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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
    /// The solver's schedule of one optimizer step: per device of the fused problem (device
    /// `d` is device `first + d` of the forward model's mesh), its micro-batch subtasks in
    /// order. Model 0 is `forward`, model 1 `reverse`.
    pub schedule: FusedSchedule,
    pub why: String,
}

/// What kind of drafting a `speculate` decision chose.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DraftKind {
    Off,
    Ngram,
    Draft,
}

impl DraftKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DraftKind::Off => "off",
            DraftKind::Ngram => "ngram",
            DraftKind::Draft => "draft",
        }
    }
}

/// `speculate`'s decision for one `generate`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpeculationDecision {
    pub mode: DraftKind,
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
    /// What the engine runs: the pin as written, else `auto` (drafts whose length the engine
    /// chooses per step from measured costs) where the cost model says drafting pays at some
    /// batch size, else `off`.
    pub run: Speculation,
    pub why: String,
}

/// `place`'s search record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferDecision {
    /// The cost model's estimate: per receiving device, the part of its new shard it does not
    /// hold already, summed.
    pub bytes: u64,
    pub collectives: Vec<String>,
    pub seconds: f64,
    /// Which slice of which parameter goes from which device to which.
    pub plan: TransferPlan,
    pub why: String,
}

/// Everything the passes decided. Keys are node ids of the plan's graph.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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
    /// `logprobs` calls of a trained model whose values the runtime takes (detached) from the
    /// forward pass of that model's `train` on the same rollout, which takes one optimizer
    /// step: the log-probabilities before the update, exactly. Value: that `train`.
    pub reused_logprobs: BTreeMap<NodeId, NodeId>,
    /// Decisions not taken, and why (e.g. no two trains share devices).
    pub notes: Vec<String>,
    /// Passes that ran, in order.
    pub passes_run: Vec<String>,
}

/// The executable plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecPlan {
    /// Always [`PLAN_FORMAT`].
    pub format: String,
    /// Always [`PLAN_VERSION`] for plans this build writes.
    pub version: u32,
    pub plan: Plan,
    /// The cluster the plan is for.
    pub cluster: ClusterSpec,
    /// The device entry the plan was priced with when it is not the cluster's datasheet entry
    /// (a calibrated profile, `braid plan --profile`); the runtime's own decisions (migration,
    /// reallocation) price with it too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<DeviceSpec>,
    /// One per model slot of the plan.
    pub shapes: Vec<ModelShape>,
    pub workload: Workload,
    /// The seed of every search and simulation.
    pub seed: u64,
    pub decisions: PlanDecisions,
    /// The directory relative model and data paths are read from: the program's, as the CLI
    /// found it when it compiled the program (`braid run --base-dir` overrides it).
    pub base_dir: String,
}

/// Why a plan file cannot be used: the field (a JSON path such as
/// `decisions.placements.n3.tp`) and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanError {
    pub field: String,
    pub what: String,
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            f.write_str(&self.what)
        } else {
            write!(f, "`{}`: {}", self.field, self.what)
        }
    }
}

impl std::error::Error for PlanError {}

fn bad<T>(field: impl Into<String>, what: impl Into<String>) -> Result<T, PlanError> {
    Err(PlanError {
        field: field.into(),
        what: what.into(),
    })
}

impl ExecPlan {
    pub fn new(
        plan: Plan,
        cluster: ClusterSpec,
        shapes: Vec<ModelShape>,
        workload: Workload,
        seed: u64,
        decisions: PlanDecisions,
    ) -> ExecPlan {
        ExecPlan {
            format: PLAN_FORMAT.into(),
            version: PLAN_VERSION,
            plan,
            cluster,
            device: None,
            shapes,
            workload,
            seed,
            decisions,
            base_dir: String::new(),
        }
    }

    /// The cost model the plan was priced with: its profile's device entry, else the
    /// cluster's datasheet entry.
    pub fn cost_model(&self) -> CostModel {
        match &self.device {
            Some(d) => self.cluster.cost_model_with(d.clone()),
            None => self.cluster.cost_model(),
        }
    }

    /// The JSON form, pretty-printed, ending with a newline.
    pub fn to_json(&self) -> String {
        // Serialising plain data with string-or-integer map keys cannot fail; a failure would be
        // a bug in a `Serialize` impl, reported as the file's content rather than a panic.
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
            + "\n"
    }

    /// Reads and verifies a plan file's text.
    pub fn from_json(text: &str) -> Result<ExecPlan, PlanError> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| PlanError {
            field: String::new(),
            what: format!("not JSON: {e}"),
        })?;
        match value.get("format").and_then(|f| f.as_str()) {
            Some(PLAN_FORMAT) => {}
            Some(other) => return bad("format", format!("is `{other}`, expected `{PLAN_FORMAT}`")),
            None => {
                return bad(
                    "format",
                    format!(
                        "missing; a plan file starts with {{\"format\": \"{PLAN_FORMAT}\", \"version\": {PLAN_VERSION}, …}}"
                    ),
                );
            }
        }
        match value.get("version").and_then(|v| v.as_u64()) {
            Some(v) if v == u64::from(PLAN_VERSION) => {}
            Some(v) => {
                return bad(
                    "version",
                    format!(
                        "this plan has format version {v}, this braid reads version {PLAN_VERSION}; re-plan the program with this braid (`braid plan FILE --emit plan.json`)"
                    ),
                );
            }
            None => return bad("version", "missing or not a number"),
        }
        let plan: ExecPlan = serde_path_to_error::deserialize(value).map_err(|e| {
            let path = e.path().to_string();
            PlanError {
                field: if path == "." { String::new() } else { path },
                what: e.into_inner().to_string(),
            }
        })?;
        plan.verify()?;
        Ok(plan)
    }

    /// Checks that the plan is one the runtime can execute: the graph verifies; every model,
    /// dataset and node reference resolves; every model call has a placement inside the
    /// cluster whose degrees multiply to its mesh and divide the model; every decision sits on
    /// a node of the kind it is about.
    pub fn verify(&self) -> Result<(), PlanError> {
        if self.format != PLAN_FORMAT {
            return bad("format", format!("expected `{PLAN_FORMAT}`"));
        }
        if self.version != PLAN_VERSION {
            return bad("version", format!("expected {PLAN_VERSION}"));
        }
        let p = &self.plan;
        let g = &p.graph;
        g.verify().map_err(|e| PlanError {
            field: "plan.graph".into(),
            what: e.0,
        })?;
        if self.cluster.nodes == 0 || self.cluster.per_node == 0 {
            return bad("cluster", "needs at least one node and one device per node");
        }
        if let Some(d) = &self.device {
            if d.kind != self.cluster.device {
                return bad(
                    "device.kind",
                    format!(
                        "is `{}`, but the cluster's devices are `{}`",
                        d.kind.name(),
                        self.cluster.device.name()
                    ),
                );
            }
            d.check().map_err(|what| PlanError {
                field: "device".into(),
                what,
            })?;
        }
        let devices = self.cluster.devices();
        if p.steps <= 0 {
            return bad("plan.steps", "must be positive");
        }
        let models = p.models.len();
        if self.shapes.len() != models {
            return bad(
                "shapes",
                format!("has {} entries for {models} models", self.shapes.len()),
            );
        }
        for (i, m) in p.models.iter().enumerate() {
            let field = format!("plan.models[{i}]");
            if m.dtype.is_none() {
                return bad(
                    format!("{field}.dtype"),
                    "missing: an executable plan names every model's dtype",
                );
            }
            if m.gradient_checkpointing && m.optimizer.is_none() {
                // The checker's E0416: it would change nothing for a model that is not trained.
                return bad(
                    format!("{field}.gradient_checkpointing"),
                    "is set on a model without an optimizer",
                );
            }
            // Frozen copies must end at a real source, without a cycle.
            let mut cur = i;
            for _ in 0..=models {
                match &p.models[cur].source {
                    ModelSource::FrozenOf(of) if (*of as usize) < models => cur = *of as usize,
                    ModelSource::FrozenOf(of) => {
                        return bad(
                            format!("{field}.source"),
                            format!("copies model {of}, which does not exist"),
                        );
                    }
                    _ => break,
                }
            }
            if matches!(p.models[cur].source, ModelSource::FrozenOf(_)) {
                return bad(format!("{field}.source"), "frozen copies form a cycle");
            }
            if let Some(o) = &m.optimizer
                && !(o.lr.is_finite()
                    && o.lr > 0.0
                    && o.eps > 0.0
                    && (0.0..1.0).contains(&o.beta1)
                    && (0.0..1.0).contains(&o.beta2)
                    && o.warmup >= 0)
            {
                return bad(
                    format!("{field}.optimizer"),
                    "needs lr > 0, eps > 0, betas in [0, 1) and warmup >= 0",
                );
            }
            let s = &self.shapes[i];
            if s.layers == 0 || s.heads == 0 || s.kv_heads == 0 || s.hidden == 0 || s.vocab == 0 {
                return bad(
                    format!("shapes[{i}]"),
                    "layers, hidden, heads, kv_heads and vocab must be positive",
                );
            }
        }
        self.workload.lengths.validate().map_err(|e| PlanError {
            field: "workload.lengths".into(),
            what: e.0,
        })?;
        let node = |id: NodeId| g.node(id);
        for id in g.node_ids() {
            let Some(n) = node(id) else { continue };
            if let Some(m) = n.op.model()
                && m as usize >= models
            {
                return bad(
                    format!("plan.graph (node {id})"),
                    format!("calls model {m}, which does not exist"),
                );
            }
            if let Op::Next { dataset, count } = n.op {
                if dataset as usize >= p.datasets.len() {
                    return bad(
                        format!("plan.graph (node {id})"),
                        format!("reads dataset {dataset}, which does not exist"),
                    );
                }
                if count <= 0 {
                    return bad(format!("plan.graph (node {id})"), "draws no prompts");
                }
            }
            if let Op::Reshard { model, .. } | Op::Offload { model, .. } | Op::Reload { model, .. } =
                n.op
                && model as usize >= models
            {
                return bad(
                    format!("plan.graph (node {id})"),
                    format!("moves model {model}, which does not exist"),
                );
            }
            if n.op.is_model_call() {
                let field = format!("decisions.placements.{}", id.0);
                let Some(pl) = self.decisions.placements.get(&id) else {
                    return bad(field, format!("missing: {} has no placement", n.op.name()));
                };
                self.verify_placement(&field, pl, n.op.model().unwrap_or(0) as usize, devices)?;
            }
        }
        let d = &self.decisions;
        for id in d.placements.keys() {
            if !node(*id).is_some_and(|n| n.op.is_model_call()) {
                return bad(
                    format!("decisions.placements.{}", id.0),
                    "is not a model call",
                );
            }
        }
        for (id, pl) in &d.subtask_placements {
            let field = format!("decisions.subtask_placements.{}", id.0);
            let Some(m) = node(*id).and_then(|n| n.op.model()) else {
                return bad(field, "is not a model call");
            };
            self.verify_placement(&field, pl, m as usize, devices)?;
        }
        for (id, s) in &d.streams {
            let field = format!("decisions.streams.{}", id.0);
            if node(*id).is_none() {
                return bad(field, "is not a node of the graph");
            }
            if !matches!(node(s.generate).map(|n| &n.op), Some(Op::Generate { .. }))
                || g.rollout_of(*id) != Some(s.generate)
            {
                return bad(
                    format!("{field}.generate"),
                    format!("{} is not the generate this node reads", s.generate),
                );
            }
            if s.cut == Cut::Sample
                && node(*id).is_some_and(|n| n.op.is_model_call())
                && s.chunk == 0
            {
                return bad(
                    format!("{field}.chunk"),
                    "a streamed call takes at least one sample per pass",
                );
            }
        }
        for (id, m) in &d.migrations {
            let field = format!("decisions.migrations.{}", id.0);
            let Some(pl) = d
                .placements
                .get(id)
                .filter(|_| matches!(node(*id).map(|n| &n.op), Some(Op::Generate { .. })))
            else {
                return bad(field, "is not a generate");
            };
            if m.to_instances == 0 || m.to_instances > pl.dp {
                return bad(
                    format!("{field}.to_instances"),
                    format!("must keep between 1 and {} instances", pl.dp),
                );
            }
        }
        for (id, s) in &d.speculation {
            let field = format!("decisions.speculation.{}", id.0);
            if !matches!(node(*id).map(|n| &n.op), Some(Op::Generate { .. })) {
                return bad(field, "is not a generate");
            }
            if let Speculation::Ngram { max_draft } = s.run
                && !(1..=crate::settings::MAX_DRAFT).contains(&max_draft)
            {
                return bad(
                    format!("{field}.run.max_draft"),
                    format!("must be from 1 to {}", crate::settings::MAX_DRAFT),
                );
            }
        }
        for (i, f) in d.interleave.iter().enumerate() {
            for (what, id) in [("forward", f.forward), ("reverse", f.reverse)] {
                if !matches!(node(id).map(|n| &n.op), Some(Op::Train { .. })) {
                    return bad(
                        format!("decisions.interleave[{i}].{what}"),
                        format!("{id} is not a train"),
                    );
                }
            }
        }
        for id in g.node_ids() {
            let is_transfer = matches!(
                node(id).map(|n| &n.op),
                Some(Op::Reshard { .. } | Op::Offload { .. } | Op::Reload { .. })
            );
            if is_transfer && !d.transfers.contains_key(&id) {
                return bad(
                    format!("decisions.transfers.{}", id.0),
                    "missing: every reshard, offload and reload node has a transfer plan",
                );
            }
        }
        for (id, t) in &d.transfers {
            let field = format!("decisions.transfers.{}", id.0);
            let Some(n) = node(*id) else {
                return bad(field, "is not a node of the graph");
            };
            match n.op {
                Op::Reshard {
                    model,
                    after,
                    before,
                    ..
                } => {
                    let (Some(a), Some(b)) = (d.placements.get(&after), d.placements.get(&before))
                    else {
                        return bad(field, "its calls have no placements");
                    };
                    t.plan
                        .verify(
                            &self.shapes[model as usize],
                            self.plan.models[model as usize].head,
                            a,
                            b,
                        )
                        .map_err(|what| PlanError {
                            field: format!("{field}.plan"),
                            what,
                        })?;
                }
                Op::Offload { .. } | Op::Reload { .. } => {}
                _ => return bad(field, "is not a reshard, offload or reload node"),
            }
        }
        let mut trains_reused: BTreeSet<NodeId> = BTreeSet::new();
        for (lp, train) in &d.reused_logprobs {
            let field = format!("decisions.reused_logprobs.{}", lp.0);
            let (
                Some(Op::Logprobs { model }),
                Some(Op::Train {
                    model: tm,
                    epochs: 1,
                    minibatches: 1,
                }),
            ) = (node(*lp).map(|n| &n.op), node(*train).map(|n| &n.op))
            else {
                return bad(
                    field,
                    "must map a logprobs call to a train with one epoch and one mini-batch",
                );
            };
            if model != tm || g.inputs(*lp).first() != g.inputs(*train).first() {
                return bad(
                    field,
                    "the train must be of the same model on the same rollout",
                );
            }
            trains_reused.insert(*train);
        }
        Ok(())
    }

    fn verify_placement(
        &self,
        field: &str,
        pl: &Placement,
        model: usize,
        devices: u64,
    ) -> Result<(), PlanError> {
        if pl.dp == 0 || pl.tp == 0 || pl.pp == 0 || pl.microbatches == 0 {
            return bad(field, "dp, tp, pp and microbatches must be at least 1");
        }
        if pl.dp.checked_mul(pl.tp).and_then(|x| x.checked_mul(pl.pp)) != Some(pl.count) {
            return bad(
                field,
                format!(
                    "dp {} × tp {} × pp {} is not its {} devices",
                    pl.dp, pl.tp, pl.pp, pl.count
                ),
            );
        }
        if pl
            .first
            .checked_add(pl.count)
            .is_none_or(|end| end > devices)
        {
            return bad(
                field,
                format!(
                    "devices {}..{} are outside the cluster's {devices}",
                    pl.first,
                    pl.first.saturating_add(pl.count)
                ),
            );
        }
        let s = &self.shapes[model];
        if !s.heads.is_multiple_of(pl.tp) {
            return bad(
                format!("{field}.tp"),
                format!("{} does not divide the model's {} heads", pl.tp, s.heads),
            );
        }
        if !s.layers.is_multiple_of(pl.pp) {
            return bad(
                format!("{field}.pp"),
                format!("{} does not divide the model's {} layers", pl.pp, s.layers),
            );
        }
        Ok(())
    }

    /// Where a model call runs (every model call of a verified plan has a placement).
    pub fn placement(&self, id: NodeId) -> Option<&Placement> {
        self.decisions.placements.get(&id)
    }

    /// The consumers that stream under `generate`, with their chunk sizes.
    pub fn streamed(&self, generate: NodeId) -> Vec<(NodeId, u64)> {
        self.decisions
            .streams
            .iter()
            .filter(|(id, s)| {
                s.generate == generate
                    && s.cut == Cut::Sample
                    && self.plan.graph.node(**id).is_some_and(|n| {
                        matches!(
                            n.op,
                            Op::Logprobs { .. } | Op::Values { .. } | Op::Score { .. }
                        )
                    })
                    && self.plan.graph.inputs(**id).first() == Some(&generate)
                    && !self.decisions.reused_logprobs.contains_key(id)
            })
            .map(|(id, s)| (*id, s.chunk))
            .collect()
    }

    /// What a `generate` speculates with: the planner's decision, else the pin on the node.
    pub fn speculation(&self, generate: NodeId) -> Speculation {
        if let Some(d) = self.decisions.speculation.get(&generate) {
            return d.run.clone();
        }
        match self.plan.graph.node(generate).map(|n| &n.op) {
            Some(Op::Generate { params, .. }) => {
                params.speculate.clone().unwrap_or(Speculation::Off)
            }
            _ => Speculation::Off,
        }
    }
}
