//! The task graph of one iteration of a pipeline, and the plan the runtime executes.
//!
//! Lowering (`braid_sema::lower_graph`) turns the body of a pipeline's `each` into a
//! [`TaskGraph`]: model calls (`generate`, `logprobs`, `values`, `score`, `train`) and compute
//! nodes (`fn` kernels, element-wise arithmetic, `by_prompt`, losses). Data edges carry the
//! value's type and granularity and the input port; parameter-version edges say that the first
//! call on a model in step i waits for that model's `train` in step i−1. Every node keeps the
//! byte span of the source expression it came from.
//!
//! A [`Plan`] is a graph plus what the runtime needs to build it: the models, the datasets and
//! the run's settings. It is plain data: the runtime depends on this crate, not on the checker.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use petgraph::Direction;
use petgraph::stable_graph::{EdgeIndex, NodeIndex, StableDiGraph};
use petgraph::visit::EdgeRef;
use serde::{Deserialize, Serialize};

use crate::kernel::{Kernel, RecordField};
use crate::loss::{InputKind, Objective};
pub use crate::settings::{Dtype, Head, LrSchedule, PromptFrom, Speculation, Split, SyntheticKind};

/// A node of a [`TaskGraph`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeId(pub u32);

impl NodeId {
    fn index(self) -> NodeIndex<u32> {
        NodeIndex::new(self.0 as usize)
    }
}

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "n{}", self.0)
    }
}

/// When a value is complete, from finest to coarsest (the checker's granularity).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Gran {
    Scalar,
    Sample,
    Group,
    Batch,
}

impl Gran {
    pub fn as_str(self) -> &'static str {
        match self {
            Gran::Scalar => "scalar",
            Gran::Sample => "per-sample",
            Gran::Group => "per-group",
            Gran::Batch => "per-batch",
        }
    }
}

/// The type of the value on a data edge. Rollout-valued data names the `generate` node that
/// made the rollout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DataTy {
    Prompts,
    Rollout,
    PerToken,
    PerSample,
    Loss,
    Unit,
}

impl DataTy {
    pub fn as_str(self) -> &'static str {
        match self {
            DataTy::Prompts => "PromptBatch",
            DataTy::Rollout => "Rollout",
            DataTy::PerToken => "PerToken",
            DataTy::PerSample => "PerSample",
            DataTy::Loss => "Loss",
            DataTy::Unit => "()",
        }
    }
}

/// An edge of the graph.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Edge {
    /// The source's value is input `port` of the target.
    Data { port: u32, ty: DataTy, gran: Gran },
    /// The target (a model's first call in a step) reads the parameters the source (that
    /// model's last `train` in the previous step) writes.
    Version { model: u32 },
}

/// A scalar constant operand.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Const {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
}

impl std::fmt::Display for Const {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Const::Int(i) => write!(f, "{i}"),
            Const::Float(x) => write!(f, "{x:?}"),
            Const::Bool(b) => write!(f, "{b}"),
            Const::Str(s) => write!(f, "{s:?}"),
        }
    }
}

impl Const {
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Const::Int(i) => Some(*i as f64),
            Const::Float(x) => Some(*x),
            Const::Bool(b) => Some(f64::from(u8::from(*b))),
            Const::Str(_) => None,
        }
    }
}

/// An operand of a compute node: an input port or a constant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Operand {
    Input(u32),
    Const(Const),
}

impl std::fmt::Display for Operand {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Operand::Input(p) => write!(f, "${p}"),
            Operand::Const(c) => write!(f, "{c}"),
        }
    }
}

/// How `generate` samples.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenParams {
    pub n: i64,
    pub max_new_tokens: i64,
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: i64,
    pub greedy: bool,
    /// Speculative decoding as the schedule pins it (`off`, `ngram(…) max N`, `draft(m)`).
    /// `None`: not pinned; the planner's `speculate` pass decides.
    #[serde(default)]
    pub speculate: Option<Speculation>,
}

/// Element-wise arithmetic on per-token or per-sample values (a per-sample value broadcasts
/// over its sample's tokens; a constant over everything).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ArithOp {
    Add,
    Sub,
    Mul,
    Div,
    Neg,
}

impl ArithOp {
    pub fn as_str(self) -> &'static str {
        match self {
            ArithOp::Add => "add",
            ArithOp::Sub => "sub",
            ArithOp::Mul => "mul",
            ArithOp::Div => "div",
            ArithOp::Neg => "neg",
        }
    }
}

/// What a node computes. Input 0 of every node that works on a rollout is that rollout (the
/// `generate` node), so that the executor knows the samples' texts, lengths and groups.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Op {
    /// `next(dataset, count)`: the next prompts. No inputs.
    Next {
        dataset: u32,
        count: i64,
    },
    /// Input 0: the prompts.
    Generate {
        model: u32,
        params: GenParams,
    },
    /// Input 0: the rollout.
    Logprobs {
        model: u32,
    },
    Values {
        model: u32,
    },
    Score {
        model: u32,
    },
    /// A `fn` compiled to a kernel. Input 0: the rollout; `args` gives each kernel parameter
    /// in order (a `Sample` parameter reads the rollout itself: `Input(0)`). `mapped`: a
    /// per-sample function applied to every sample.
    Kernel {
        func: String,
        kernel: Kernel,
        args: Vec<Operand>,
    },
    /// Input 0: the rollout; `args`: one operand (Neg) or two.
    Arith {
        op: ArithOp,
        args: Vec<Operand>,
    },
    /// `by_prompt(value, like)`: input 0 is `like` (the rollout the result belongs to), input
    /// 1 the value, input 2 the value's rollout.
    ByPrompt,
    /// The objective of a `train`: a loss lowered to the objective IR, its run's constants
    /// folded in. Input 0: the rollout; input `k + 1`: the objective's input `k` (a per-token
    /// or per-sample value computed outside the loss).
    Loss {
        objective: Objective,
    },
    /// Input 0: the rollout; input 1: the loss.
    Train {
        model: u32,
        epochs: i64,
        minibatches: i64,
    },
    /// Inserted by the planner (`reshard-insert`), never by lowering: move `model`'s
    /// parameters from the layout of call `after` to that of call `before` (`bytes` in all).
    /// No data inputs; `after` and `before` are calls on `model`.
    Reshard {
        model: u32,
        after: NodeId,
        before: NodeId,
        bytes: u64,
    },
    /// Inserted by the planner: copy a frozen model's weights to host memory after call
    /// `after`, freeing its devices for other models.
    Offload {
        model: u32,
        after: NodeId,
        bytes: u64,
    },
    /// Inserted by the planner: bring an offloaded model's weights back before call `before`.
    Reload {
        model: u32,
        before: NodeId,
        bytes: u64,
    },
}

impl Op {
    pub fn name(&self) -> &'static str {
        match self {
            Op::Next { .. } => "next",
            Op::Generate { .. } => "generate",
            Op::Logprobs { .. } => "logprobs",
            Op::Values { .. } => "values",
            Op::Score { .. } => "score",
            Op::Kernel { .. } => "kernel",
            Op::Arith { .. } => "arith",
            Op::ByPrompt => "by_prompt",
            Op::Loss { .. } => "loss",
            Op::Train { .. } => "train",
            Op::Reshard { .. } => "reshard",
            Op::Offload { .. } => "offload",
            Op::Reload { .. } => "reload",
        }
    }

    /// The model a model call runs.
    pub fn model(&self) -> Option<u32> {
        match self {
            Op::Generate { model, .. }
            | Op::Logprobs { model }
            | Op::Values { model }
            | Op::Score { model }
            | Op::Train { model, .. } => Some(*model),
            _ => None,
        }
    }

    /// Whether this node runs a network (the stages the planner places).
    pub fn is_model_call(&self) -> bool {
        self.model().is_some()
    }
}

/// A node: what it computes, what it yields, and where it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub op: Op,
    pub ty: DataTy,
    pub gran: Gran,
    /// Byte range in the source file of the pipeline.
    pub span: (u32, u32),
    /// The `let` it is bound to, if any (for reading the text form and metrics).
    pub label: Option<String>,
    /// Sequences per forward pass, when the schedule pins it for this call.
    pub micro_batch: Option<i64>,
}

/// The task graph of one iteration.
#[derive(Debug, Clone, Default)]
pub struct TaskGraph {
    graph: StableDiGraph<Node, Edge, u32>,
}

/// Two graphs are equal when they have the same nodes under the same ids and the same edges.
impl PartialEq for TaskGraph {
    fn eq(&self, other: &TaskGraph) -> bool {
        let ids = self.node_ids();
        ids == other.node_ids()
            && ids.iter().all(|id| self.node(*id) == other.node(*id))
            && self.edges() == other.edges()
    }
}

/// The serialised form of a [`TaskGraph`]: nodes with their ids (a graph a pass removed nodes
/// from has gaps, and decisions refer to nodes by id), then edges.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct GraphWire {
    nodes: Vec<(NodeId, Node)>,
    edges: Vec<(NodeId, NodeId, Edge)>,
}

impl Serialize for TaskGraph {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let nodes = self
            .node_ids()
            .into_iter()
            .filter_map(|id| self.node(id).map(|n| (id, n.clone())))
            .collect();
        GraphWire {
            nodes,
            edges: self.edges(),
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for TaskGraph {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<TaskGraph, D::Error> {
        use serde::de::Error as _;
        let wire = GraphWire::deserialize(d)?;
        let mut ids: Vec<NodeId> = wire.nodes.iter().map(|(id, _)| *id).collect();
        ids.sort();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return Err(D::Error::custom("two nodes have the same id"));
        }
        let max = ids.last().map_or(0, |id| id.0 as usize + 1);
        if max > 1 << 20 {
            return Err(D::Error::custom("node ids beyond 2^20"));
        }
        // Recreate the ids exactly: fill the gaps with placeholders, then remove them.
        let mut g = TaskGraph::new();
        let placeholder = Node {
            op: Op::ByPrompt,
            ty: DataTy::Unit,
            gran: Gran::Batch,
            span: (0, 0),
            label: None,
            micro_batch: None,
        };
        let mut by_id: BTreeMap<NodeId, Node> = wire.nodes.into_iter().collect();
        for i in 0..max {
            let id = NodeId(i as u32);
            let node = by_id.remove(&id).unwrap_or_else(|| placeholder.clone());
            g.add_node(node);
        }
        for i in 0..max {
            let id = NodeId(i as u32);
            if ids.binary_search(&id).is_err() {
                g.remove_node(id);
            }
        }
        for (a, b, e) in wire.edges {
            if g.node(a).is_none() || g.node(b).is_none() {
                return Err(D::Error::custom(format!(
                    "edge {a} -> {b} names a node that does not exist"
                )));
            }
            g.graph.add_edge(a.index(), b.index(), e);
        }
        Ok(g)
    }
}

/// What the verifier found wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyError(pub String);

impl std::fmt::Display for VerifyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for VerifyError {}

impl TaskGraph {
    pub fn new() -> Self {
        TaskGraph::default()
    }

    pub fn add_node(&mut self, node: Node) -> NodeId {
        NodeId(self.graph.add_node(node).index() as u32)
    }

    /// Makes `from`'s value input `port` of `to`.
    pub fn add_data(&mut self, from: NodeId, to: NodeId, port: u32) {
        let (ty, gran) = match self.graph.node_weight(from.index()) {
            Some(n) => (n.ty, n.gran),
            None => (DataTy::Unit, Gran::Batch),
        };
        self.graph
            .add_edge(from.index(), to.index(), Edge::Data { port, ty, gran });
    }

    pub fn add_version(&mut self, from: NodeId, to: NodeId, model: u32) {
        self.graph
            .add_edge(from.index(), to.index(), Edge::Version { model });
    }

    pub fn node(&self, id: NodeId) -> Option<&Node> {
        self.graph.node_weight(id.index())
    }

    pub fn node_mut(&mut self, id: NodeId) -> Option<&mut Node> {
        self.graph.node_weight_mut(id.index())
    }

    pub fn remove_node(&mut self, id: NodeId) -> Option<Node> {
        self.graph.remove_node(id.index())
    }

    pub fn len(&self) -> usize {
        self.graph.node_count()
    }

    pub fn is_empty(&self) -> bool {
        self.graph.node_count() == 0
    }

    /// Every node id, in increasing order.
    pub fn node_ids(&self) -> Vec<NodeId> {
        let mut v: Vec<NodeId> = self
            .graph
            .node_indices()
            .map(|i| NodeId(i.index() as u32))
            .collect();
        v.sort();
        v
    }

    /// The data inputs of a node, by port.
    pub fn inputs(&self, id: NodeId) -> Vec<NodeId> {
        let mut v: Vec<(u32, NodeId)> = self
            .graph
            .edges_directed(id.index(), Direction::Incoming)
            .filter_map(|e| match e.weight() {
                Edge::Data { port, .. } => Some((*port, NodeId(e.source().index() as u32))),
                Edge::Version { .. } => None,
            })
            .collect();
        v.sort();
        v.into_iter().map(|(_, n)| n).collect()
    }

    /// The nodes that read a node's value.
    pub fn consumers(&self, id: NodeId) -> Vec<NodeId> {
        let mut v: Vec<NodeId> = self
            .graph
            .edges_directed(id.index(), Direction::Outgoing)
            .filter(|e| matches!(e.weight(), Edge::Data { .. }))
            .map(|e| NodeId(e.target().index() as u32))
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// Every edge as (source, target, edge), sorted.
    pub fn edges(&self) -> Vec<(NodeId, NodeId, Edge)> {
        let mut v: Vec<(NodeId, NodeId, Edge)> = self
            .graph
            .edge_indices()
            .filter_map(|e: EdgeIndex<u32>| {
                let (a, b) = self.graph.edge_endpoints(e)?;
                Some((
                    NodeId(a.index() as u32),
                    NodeId(b.index() as u32),
                    *self.graph.edge_weight(e)?,
                ))
            })
            .collect();
        v.sort_by_key(|x| (x.0, x.1, port_of(&x.2)));
        v
    }

    /// The nodes in an order where every data input comes before its consumer; ties are
    /// broken by id, so the order is deterministic. Version edges are ignored (they cross
    /// iterations). `None` when the data edges have a cycle.
    pub fn topo_order(&self) -> Option<Vec<NodeId>> {
        let ids = self.node_ids();
        let mut indeg: BTreeMap<NodeId, usize> = ids.iter().map(|&i| (i, 0)).collect();
        for (_, b, e) in self.edges() {
            if matches!(e, Edge::Data { .. }) {
                *indeg.entry(b).or_default() += 1;
            }
        }
        let mut ready: std::collections::BTreeSet<NodeId> = indeg
            .iter()
            .filter(|(_, d)| **d == 0)
            .map(|(i, _)| *i)
            .collect();
        let mut out = Vec::with_capacity(ids.len());
        let edges = self.edges();
        while let Some(&n) = ready.iter().next() {
            ready.remove(&n);
            out.push(n);
            for (a, b, e) in &edges {
                if *a == n && matches!(e, Edge::Data { .. }) {
                    let d = indeg.entry(*b).or_default();
                    *d -= 1;
                    if *d == 0 {
                        ready.insert(*b);
                    }
                }
            }
        }
        (out.len() == ids.len()).then_some(out)
    }

    /// The `generate` node a rollout-valued node belongs to (following input 0).
    pub fn rollout_of(&self, id: NodeId) -> Option<NodeId> {
        let mut cur = id;
        for _ in 0..=self.len() {
            let node = self.node(cur)?;
            if matches!(node.op, Op::Generate { .. }) {
                return Some(cur);
            }
            cur = *self.inputs(cur).first()?;
        }
        None
    }

    /// Checks the structural rules every pass must keep: data edges acyclic, ports dense and
    /// unique, input types as each op expects, operands within the inputs, version edges from a
    /// `train` to a call on the same model.
    pub fn verify(&self) -> Result<(), VerifyError> {
        let bad = |id: NodeId, msg: String| Err(VerifyError(format!("{id}: {msg}")));
        if self.topo_order().is_none() {
            return Err(VerifyError("the data edges have a cycle".into()));
        }
        for id in self.node_ids() {
            let Some(node) = self.node(id) else { continue };
            let mut ports: Vec<(u32, DataTy)> = self
                .graph
                .edges_directed(id.index(), Direction::Incoming)
                .filter_map(|e| match e.weight() {
                    Edge::Data { port, ty, .. } => Some((*port, *ty)),
                    Edge::Version { .. } => None,
                })
                .collect();
            ports.sort_by_key(|p| p.0);
            for (i, (p, _)) in ports.iter().enumerate() {
                if *p != i as u32 {
                    return bad(id, format!("input ports are not 0..{}", ports.len()));
                }
            }
            let tys: Vec<DataTy> = ports.iter().map(|p| p.1).collect();
            let want_rollout = |n: usize| -> Result<(), VerifyError> {
                if tys.first() != Some(&DataTy::Rollout) {
                    return Err(VerifyError(format!(
                        "{id}: {} needs a rollout as input 0",
                        node.op.name()
                    )));
                }
                if tys.len() != n {
                    return Err(VerifyError(format!(
                        "{id}: {} has {} inputs, expected {n}",
                        node.op.name(),
                        tys.len()
                    )));
                }
                Ok(())
            };
            let operands_ok = |args: &[Operand]| {
                args.iter().all(|a| match a {
                    Operand::Input(p) => (*p as usize) < tys.len(),
                    Operand::Const(_) => true,
                })
            };
            match &node.op {
                Op::Next { .. } => {
                    if !tys.is_empty() {
                        return bad(id, "next takes no inputs".into());
                    }
                }
                Op::Generate { .. } => {
                    if tys != [DataTy::Prompts] {
                        return bad(id, "generate takes one prompt batch".into());
                    }
                }
                Op::Logprobs { .. } | Op::Values { .. } | Op::Score { .. } => want_rollout(1)?,
                Op::Kernel { args, kernel, .. } => {
                    if tys.first() != Some(&DataTy::Rollout) || !operands_ok(args) {
                        return bad(id, "kernel operands do not match its inputs".into());
                    }
                    if args.len() != kernel.params.len() {
                        return bad(
                            id,
                            format!(
                                "kernel has {} parameters and {} operands",
                                kernel.params.len(),
                                args.len()
                            ),
                        );
                    }
                }
                Op::Arith { op, args } => {
                    let n = if *op == ArithOp::Neg { 1 } else { 2 };
                    if tys.first() != Some(&DataTy::Rollout)
                        || args.len() != n
                        || !operands_ok(args)
                    {
                        return bad(id, "arith operands do not match its inputs".into());
                    }
                }
                Op::ByPrompt => {
                    if tys != [DataTy::Rollout, DataTy::PerSample, DataTy::Rollout] {
                        return bad(id, "by_prompt takes (rollout, PerSample, rollout)".into());
                    }
                }
                Op::Loss { objective } => {
                    let want: Vec<DataTy> = std::iter::once(DataTy::Rollout)
                        .chain(objective.inputs.iter().map(|k| match k {
                            InputKind::PerToken => DataTy::PerToken,
                            InputKind::PerSample => DataTy::PerSample,
                        }))
                        .collect();
                    if tys != want {
                        return bad(
                            id,
                            format!(
                                "loss `{}` takes a rollout and its inputs ({:?}), not {tys:?}",
                                objective.name, objective.inputs
                            ),
                        );
                    }
                    if let Err(e) = crate::loss::verify(objective) {
                        return bad(id, e.to_string());
                    }
                }
                Op::Train { .. } => {
                    if tys != [DataTy::Rollout, DataTy::Loss] {
                        return bad(id, "train takes a rollout and a loss".into());
                    }
                }
                Op::Reshard {
                    model,
                    after,
                    before,
                    ..
                } => {
                    if !tys.is_empty() {
                        return bad(id, "reshard takes no data inputs".into());
                    }
                    for call in [after, before] {
                        if self.node(*call).and_then(|n| n.op.model()) != Some(*model) {
                            return bad(id, format!("{call} is not a call on model {model}"));
                        }
                    }
                }
                Op::Offload {
                    model, after: call, ..
                }
                | Op::Reload {
                    model,
                    before: call,
                    ..
                } => {
                    if !tys.is_empty() {
                        return bad(id, format!("{} takes no data inputs", node.op.name()));
                    }
                    if self.node(*call).and_then(|n| n.op.model()) != Some(*model) {
                        return bad(id, format!("{call} is not a call on model {model}"));
                    }
                }
            }
        }
        for (a, b, e) in self.edges() {
            if let Edge::Version { model } = e {
                let ok = matches!(self.node(a).map(|n| &n.op), Some(Op::Train { model: m, .. }) if *m == model)
                    && self.node(b).and_then(|n| n.op.model()) == Some(model);
                if !ok {
                    return Err(VerifyError(format!(
                        "version edge {a} -> {b} is not from a train to a call on model {model}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// The text form: one line per node in topological order, then the version edges.
    pub fn to_text(&self, model_names: &[String], dataset_names: &[String]) -> String {
        let name = |names: &[String], i: u32| {
            names
                .get(i as usize)
                .cloned()
                .unwrap_or_else(|| format!("#{i}"))
        };
        let mut out = String::new();
        let order = self.topo_order().unwrap_or_else(|| self.node_ids());
        for id in order {
            let Some(n) = self.node(id) else { continue };
            let ins: Vec<String> = self.inputs(id).iter().map(|i| i.to_string()).collect();
            let detail = match &n.op {
                Op::Next { dataset, count } => format!("{} {count}", name(dataset_names, *dataset)),
                Op::Generate { model, params: p } => format!(
                    "{} n={} max_new_tokens={} temperature={:?} top_p={:?} top_k={} greedy={}{}",
                    name(model_names, *model),
                    p.n,
                    p.max_new_tokens,
                    p.temperature,
                    p.top_p,
                    p.top_k,
                    p.greedy,
                    p.speculate
                        .as_ref()
                        .map(|s| format!(" speculate={s}"))
                        .unwrap_or_default()
                ),
                Op::Logprobs { model } | Op::Values { model } | Op::Score { model } => {
                    name(model_names, *model)
                }
                Op::Kernel { func, args, .. } => format!("{func}({})", join(args)),
                Op::Arith { op, args } => format!("{}({})", op.as_str(), join(args)),
                Op::ByPrompt => String::new(),
                Op::Loss { objective } => objective.name.clone(),
                Op::Train {
                    model,
                    epochs,
                    minibatches,
                } => format!(
                    "{} epochs={epochs} minibatches={minibatches}",
                    name(model_names, *model)
                ),
                Op::Reshard {
                    model,
                    after,
                    before,
                    bytes,
                } => format!(
                    "{} after {after} before {before} bytes={bytes}",
                    name(model_names, *model)
                ),
                Op::Offload {
                    model,
                    after,
                    bytes,
                } => {
                    format!("{} after {after} bytes={bytes}", name(model_names, *model))
                }
                Op::Reload {
                    model,
                    before,
                    bytes,
                } => format!(
                    "{} before {before} bytes={bytes}",
                    name(model_names, *model)
                ),
            };
            let label = n
                .label
                .as_deref()
                .map(|l| format!(" ; {l}"))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "{id} = {} {detail} [{}] : {} {}{label}",
                n.op.name(),
                ins.join(", "),
                n.ty.as_str(),
                n.gran.as_str(),
            );
        }
        for (a, b, e) in self.edges() {
            if let Edge::Version { model } = e {
                let _ = writeln!(
                    out,
                    "version {} : {a} (step i-1) -> {b} (step i)",
                    name(model_names, model)
                );
            }
        }
        out
    }

    /// Graphviz DOT: model calls are boxes, compute nodes ellipses, version edges dashed.
    pub fn to_dot(&self, model_names: &[String]) -> String {
        let mut out = String::from("digraph iteration {\n  rankdir=TB;\n");
        for id in self.node_ids() {
            let Some(n) = self.node(id) else { continue };
            let title = match (&n.op, n.op.model()) {
                (Op::Kernel { func, .. }, _) => func.clone(),
                (_, Some(m)) => format!(
                    "{}({})",
                    n.op.name(),
                    model_names
                        .get(m as usize)
                        .cloned()
                        .unwrap_or_else(|| format!("#{m}"))
                ),
                _ => n.op.name().to_string(),
            };
            let label = match &n.label {
                Some(l) => format!("{l} = {title}"),
                None => title,
            };
            let shape = if n.op.is_model_call() {
                "box"
            } else {
                "ellipse"
            };
            let _ = writeln!(
                out,
                "  {id} [label=\"{}\", shape={shape}];",
                label.replace('"', "\\\"")
            );
        }
        for (a, b, e) in self.edges() {
            match e {
                Edge::Data { ty, gran, .. } => {
                    let _ = writeln!(
                        out,
                        "  {a} -> {b} [label=\"{} {}\"];",
                        ty.as_str(),
                        gran.as_str()
                    );
                }
                Edge::Version { .. } => {
                    let _ = writeln!(
                        out,
                        "  {a} -> {b} [style=dashed, label=\"next step\", constraint=false];"
                    );
                }
            }
        }
        out.push_str("}\n");
        out
    }
}

fn port_of(e: &Edge) -> u32 {
    match e {
        Edge::Data { port, .. } => *port,
        Edge::Version { model } => u32::MAX - *model,
    }
}

fn join(args: &[Operand]) -> String {
    args.iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Where a model's weights come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ModelSource {
    Tiny {
        layers: i64,
        hidden: i64,
        heads: i64,
        kv_heads: i64,
        intermediate: i64,
        max_len: i64,
        seed: i64,
    },
    Hf {
        dir: String,
    },
    /// A frozen copy, made at the start of the run, of another model of the plan.
    FrozenOf(u32),
}

/// AdamW and its learning-rate schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Optimizer {
    pub lr: f64,
    pub weight_decay: f64,
    pub eps: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub warmup: i64,
    pub schedule: LrSchedule,
}

/// A model of the plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// The name in the pipeline (`policy`, `ref`).
    pub name: String,
    pub source: ModelSource,
    pub head: Head,
    /// As declared; `None`: the target's default, which the driver resolves when it plans for a
    /// cluster (f32 on CPUs, bf16 on GPUs), so an executable plan always names one.
    pub dtype: Option<Dtype>,
    pub optimizer: Option<Optimizer>,
    pub grad_clip: Option<f64>,
    pub max_len: Option<i64>,
    /// Activation checkpointing in training: each layer's activations are recomputed in the
    /// backward pass. Written only when on, so plans without it keep their JSON form.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gradient_checkpointing: bool,
}

/// Where a dataset's records come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum DatasetSource {
    Jsonl {
        path: String,
    },
    Parquet {
        path: String,
    },
    Synthetic {
        kind: SyntheticKind,
        count: i64,
        seed: i64,
        digits: i64,
        /// Which part of the generated problems (`split:`).
        #[serde(default)]
        split: Split,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DatasetSpec {
    pub name: String,
    pub source: DatasetSource,
    pub prompt_field: String,
    pub answer_field: String,
    /// The field of a record's chat messages.
    #[serde(default = "messages_field")]
    pub messages_field: String,
    /// Whether prompts come from `prompt_field`, `messages_field`, or whichever a record has.
    #[serde(default)]
    pub prompt_from: PromptFrom,
    pub shuffle: bool,
    pub seed: i64,
    pub chat_template: bool,
    /// Passes over the data; `None`: as many as the run needs.
    pub epochs: Option<i64>,
    /// The record fields the run's kernels read from this dataset's samples (`field_int(s,
    /// "difficulty")`), with the type each is read as: every record must hold them, which the
    /// runtime checks when it loads the dataset — before the first step, not when a reward
    /// first meets a record without one.
    #[serde(default)]
    pub fields: Vec<RecordField>,
}

fn messages_field() -> String {
    "messages".into()
}

/// What the runtime executes: one iteration's graph, run `steps` times.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    pub pipeline: String,
    pub graph: TaskGraph,
    pub models: Vec<ModelSpec>,
    pub datasets: Vec<DatasetSpec>,
    pub steps: i64,
    pub seed: i64,
    pub checkpoint_every: i64,
    /// The run's settings, for the record.
    pub settings: Vec<(String, Const)>,
    /// Evaluation on held-out prompts during the run (the run's `eval` setting).
    pub eval: Option<EvalSpec>,
}

/// Evaluation during a run: every `every` steps (and before the first and after the last),
/// the trained policy answers every record of `dataset` and the run's reward scores them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalSpec {
    pub every: i64,
    /// Index into `Plan::datasets`.
    pub dataset: u32,
    /// Samples per prompt and how they are drawn; the tokens default to the run's.
    pub params: GenParams,
}

impl Plan {
    pub fn model_names(&self) -> Vec<String> {
        self.models.iter().map(|m| m.name.clone()).collect()
    }

    pub fn dataset_names(&self) -> Vec<String> {
        self.datasets.iter().map(|d| d.name.clone()).collect()
    }

    /// The rollout the (first) trained model learns from: the first `train`'s rollout, in
    /// topological order.
    pub fn main_rollout(&self) -> Option<NodeId> {
        let order = self.graph.topo_order()?;
        order.iter().find_map(|id| match self.graph.node(*id) {
            Some(n) if matches!(n.op, Op::Train { .. }) => self.graph.inputs(*id).first().copied(),
            _ => None,
        })
    }

    /// The run's reward: the first `score`, or per-sample `fn` of a `Sample`, on the main
    /// rollout (what `reward_mean` reports and what an evaluation scores with).
    pub fn reward_node(&self) -> Option<NodeId> {
        let r = self.main_rollout()?;
        let order = self.graph.topo_order()?;
        order.into_iter().find(|id| {
            let Some(n) = self.graph.node(*id) else {
                return false;
            };
            self.graph.inputs(*id).first() == Some(&r)
                && match &n.op {
                    Op::Score { .. } => true,
                    Op::Kernel { kernel, .. } => {
                        kernel.params.first() == Some(&crate::kernel::ParamKind::Sample)
                            && n.ty == DataTy::PerSample
                    }
                    _ => false,
                }
        })
    }

    /// The dataset whose prompts a rollout was generated from (through its `next`).
    pub fn dataset_of_rollout(&self, rollout: NodeId) -> Option<u32> {
        let Some(Op::Generate { .. }) = self.graph.node(rollout).map(|n| &n.op) else {
            return None;
        };
        let prompts = *self.graph.inputs(rollout).first()?;
        match self.graph.node(prompts).map(|n| &n.op) {
            Some(Op::Next { dataset, .. }) => Some(*dataset),
            _ => None,
        }
    }

    /// Records in each dataset the fields that the kernels scoring its samples read: every
    /// kernel on a rollout generated from the dataset's prompts, and the reward of an
    /// evaluation on it.
    pub fn collect_record_fields(&mut self) {
        let mut need: BTreeMap<u32, Vec<RecordField>> = BTreeMap::new();
        for id in self.graph.node_ids() {
            let Some(Op::Kernel { kernel, .. }) = self.graph.node(id).map(|n| &n.op) else {
                continue;
            };
            let fields = kernel.record_fields();
            if let Some(d) = self
                .graph
                .inputs(id)
                .first()
                .and_then(|r| self.dataset_of_rollout(*r))
                && !fields.is_empty()
            {
                need.entry(d).or_default().extend(fields);
            }
        }
        if let (Some(ev), Some(reward)) = (&self.eval, self.reward_node())
            && let Some(Op::Kernel { kernel, .. }) = self.graph.node(reward).map(|n| &n.op)
        {
            need.entry(ev.dataset)
                .or_default()
                .extend(kernel.record_fields());
        }
        for (d, mut fields) in need {
            if let Some(spec) = self.datasets.get_mut(d as usize) {
                fields.append(&mut spec.fields);
                fields.sort();
                fields.dedup();
                spec.fields = fields;
            }
        }
    }

    /// The graph's text form with model and dataset names.
    pub fn graph_text(&self) -> String {
        self.graph
            .to_text(&self.model_names(), &self.dataset_names())
    }

    /// The objective of every loss node, in node order, in the objective IR's text form: what
    /// each `train` differentiates (the graph's text form names the loss only).
    pub fn losses_text(&self) -> String {
        let mut out = String::new();
        for id in self.graph.node_ids() {
            if let Some(Node {
                op: Op::Loss { objective },
                ..
            }) = self.graph.node(id)
            {
                let _ = write!(out, "{id}: {objective}");
            }
        }
        out
    }
}
