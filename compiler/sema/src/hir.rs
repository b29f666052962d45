//! The typed program (HIR): what every later phase — lowering, planning, kernels, the language
//! server — reads. Names are resolved to ids, every expression carries its type, granularity and
//! span, defaults are filled in, and the run's settings are evaluated.

use braid_diagnostics::{FileId, Span};

pub use crate::ty::{Granularity, RolloutId, Scope, SigTy, Ty};
pub use braid_ir::loss::ModelOutput;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FnId(pub u32);
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PipelineId(pub u32);
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ModelId(pub u32);
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DatasetId(pub u32);
/// A local of one function or pipeline body: an index into its `locals`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LocalId(pub u32);

/// A constant value: a run setting, a default, an option.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
}

impl Value {
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Int(i) => Some(*i as f64),
            Value::Float(f) => Some(*f),
            _ => None,
        }
    }

    /// The type of the value.
    pub fn ty(&self) -> Ty {
        match self {
            Value::Int(_) => Ty::Int,
            Value::Float(_) => Ty::Float,
            Value::Bool(_) => Ty::Bool,
            Value::Str(_) => Ty::Str,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }
}

impl std::fmt::Display for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::Int(i) => write!(f, "{i}"),
            Value::Float(x) => write!(f, "{x:?}"),
            Value::Bool(b) => write!(f, "{b}"),
            Value::Str(s) => write!(f, "{s:?}"),
        }
    }
}

/// What a name in an expression refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Def {
    Fn(FnId),
    Pipeline(PipelineId),
    Model(ModelId),
    Dataset(DatasetId),
    Local(LocalId),
    Builtin(&'static str),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnaryOp {
    Neg,
    Not,
}

pub use braid_syntax::ast::BinaryOp;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SampleField {
    Prompt,
    Completion,
    Answer,
    Length,
    Group,
    Tokens,
}

impl SampleField {
    pub fn as_str(self) -> &'static str {
        match self {
            SampleField::Prompt => "prompt",
            SampleField::Completion => "completion",
            SampleField::Answer => "answer",
            SampleField::Length => "length",
            SampleField::Group => "group",
            SampleField::Tokens => "tokens",
        }
    }
}

/// The model calls: the nodes of the task graph that run a network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ModelOp {
    Generate,
    Logprobs,
    Values,
    Score,
    Train,
}

impl ModelOp {
    pub fn from_name(name: &str) -> Option<ModelOp> {
        Some(match name {
            "generate" => ModelOp::Generate,
            "logprobs" => ModelOp::Logprobs,
            "values" => ModelOp::Values,
            "score" => ModelOp::Score,
            "train" => ModelOp::Train,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ModelOp::Generate => "generate",
            ModelOp::Logprobs => "logprobs",
            ModelOp::Values => "values",
            ModelOp::Score => "score",
            ModelOp::Train => "train",
        }
    }
}

/// What a call calls.
#[derive(Debug, Clone, PartialEq)]
pub enum Callee {
    /// A model call; `args[0]` is the model.
    Model(ModelOp),
    /// Any other built-in, by its name in the stdlib table.
    Builtin(&'static str),
    Fn(FnId),
    /// A function-valued pipeline parameter, such as `reward`.
    FnValue(LocalId),
}

#[derive(Debug, Clone, PartialEq)]
pub enum ExprKind {
    Lit(Value),
    Ref(Def),
    /// `args` are in parameter order with defaults filled in (a default's span is the call's).
    /// `mapped` is true when a per-sample function is applied to every sample of a rollout.
    Call {
        callee: Callee,
        args: Vec<Expr>,
        mapped: bool,
    },
    Field {
        base: Box<Expr>,
        field: SampleField,
    },
    Index {
        base: Box<Expr>,
        index: Box<Expr>,
    },
    Unary {
        op: UnaryOp,
        operand: Box<Expr>,
    },
    Binary {
        op: BinaryOp,
        lhs: Box<Expr>,
        rhs: Box<Expr>,
    },
    If {
        cond: Box<Expr>,
        then: Body,
        else_: Box<Expr>,
    },
    Block(Body),
    Scan(Box<Scan>),
    /// `policy.logp` in the body of a loss: an output of the model the loss trains (the local
    /// of its `Model` parameter), per token, with gradients.
    ModelOutput {
        model: LocalId,
        output: ModelOutput,
    },
    /// Something that did not check; a diagnostic was reported.
    Error,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Expr {
    pub kind: ExprKind,
    pub ty: Ty,
    pub gran: Granularity,
    pub span: Span,
}

/// `let`s then a value.
#[derive(Debug, Clone, PartialEq)]
pub struct Body {
    pub lets: Vec<(LocalId, Expr)>,
    pub value: Box<Expr>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Scan {
    pub reverse: bool,
    pub var: LocalId,
    pub acc: LocalId,
    pub init: Expr,
    pub lets: Vec<(LocalId, Expr)>,
    pub value: Expr,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalKind {
    /// A signature parameter (index into the signature).
    Param(u32),
    /// A pipeline `param` (index into `settings`).
    Setting(u32),
    /// A pipeline's local `model`.
    Model(u32),
    Let,
    EachVar,
    ScanVar,
    ScanAcc,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Local {
    pub name: String,
    pub kind: LocalKind,
    pub ty: Ty,
    pub gran: Granularity,
    pub span: Span,
    pub uses: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Param {
    pub name: String,
    pub ty: SigTy,
    pub default: Option<Expr>,
    /// `where CONDITION` on a `fn` parameter: which values it accepts, checked wherever a call
    /// gives it a constant (E0404). Its locals are the function's own parameters.
    pub where_: Option<Expr>,
    pub span: Span,
}

/// What makes a `fn … -> Loss` a loss: the model it trains and the metrics it declares.
#[derive(Debug, Clone, PartialEq)]
pub struct LossFn {
    /// The index of the `Model` parameter: the model whose outputs the body reads.
    pub model_param: u32,
    /// The outputs the body reads directly (not through the losses it calls).
    pub outputs: Vec<ModelOutput>,
    /// `metric NAME = EXPR`, in order.
    pub metrics: Vec<Metric>,
}

/// A diagnostic a loss declares: reported as the mean of a per-token or per-sample value over
/// what its `train` call processes.
#[derive(Debug, Clone, PartialEq)]
pub struct Metric {
    pub name: String,
    pub span: Span,
    pub value: Expr,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Fn {
    pub name: String,
    pub file: FileId,
    pub module: String,
    pub params: Vec<Param>,
    pub ret: SigTy,
    pub scope: Scope,
    pub body: Body,
    pub locals: Vec<Local>,
    /// `Some` for a loss (a `fn` that returns `Loss`).
    pub loss: Option<LossFn>,
    /// Locals of the `where` conditions of the parameters (each condition's parameters).
    pub where_locals: Vec<Local>,
    pub name_span: Span,
    pub span: Span,
}

impl Fn {
    /// Whether this is a loss: a `fn` that returns `Loss`, differentiated rather than compiled
    /// to a kernel.
    pub fn is_loss(&self) -> bool {
        self.ret == SigTy::Loss
    }

    /// Whether the function is written for one sample and applied to every sample of a rollout.
    pub fn is_per_sample(&self) -> bool {
        self.params.iter().any(|p| p.ty.is_sample_valued())
    }

    pub fn signature(&self) -> crate::ty::FnSig {
        crate::ty::FnSig {
            params: self.params.iter().map(|p| p.ty.clone()).collect(),
            ret: Box::new(self.ret.clone()),
        }
    }
}

/// A pipeline `param`.
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    pub name: String,
    pub ty: SigTy,
    pub default: Option<Expr>,
    pub where_: Option<Expr>,
    pub span: Span,
}

/// A pipeline's local `model NAME = frozen(m)`.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalModel {
    pub name: String,
    pub local: LocalId,
    /// The model it copies: a Model-typed local of the pipeline.
    pub frozen_of: Option<LocalId>,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Stmt {
    Let(LocalId, Expr),
    Expr(Expr),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Each {
    pub var: LocalId,
    pub count: Expr,
    pub stmts: Vec<Stmt>,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Pipeline {
    pub name: String,
    pub file: FileId,
    pub module: String,
    pub params: Vec<Param>,
    pub settings: Vec<Setting>,
    pub models: Vec<LocalModel>,
    pub each: Option<Each>,
    pub locals: Vec<Local>,
    pub name_span: Span,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ModelSource {
    Tiny(TinyConfig),
    Hf { dir: String },
    Frozen(ModelId),
}

/// The architecture of a `tiny(...)` model.
#[derive(Debug, Clone, PartialEq)]
pub struct TinyConfig {
    pub layers: i64,
    pub hidden: i64,
    pub heads: i64,
    pub kv_heads: i64,
    pub intermediate: i64,
    pub max_len: i64,
    pub seed: i64,
}

// A model's head and dtype and an optimizer's schedule are the plan's own enums: the checker
// produces them, lowering copies them, and no string stands for them anywhere after parsing.
pub use braid_ir::settings::{Dtype, Head, LrSchedule, PromptFrom, Split, SyntheticKind};

#[derive(Debug, Clone, PartialEq)]
pub struct AdamW {
    pub lr: f64,
    pub weight_decay: f64,
    pub eps: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub warmup: i64,
    pub schedule: LrSchedule,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    pub name: String,
    pub file: FileId,
    pub source: ModelSource,
    pub dtype: Option<Dtype>,
    pub head: Head,
    pub train: Option<AdamW>,
    pub grad_clip: Option<f64>,
    pub max_len: Option<i64>,
    /// Recompute each layer's activations in the backward pass instead of keeping them.
    pub gradient_checkpointing: bool,
    pub name_span: Span,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
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
        split: Split,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    pub name: String,
    pub file: FileId,
    pub source: DatasetSource,
    pub prompt_field: String,
    pub answer_field: String,
    /// The field of a record's chat messages.
    pub messages_field: String,
    /// Which of the two the `fields` option named (neither: whichever a record has).
    pub prompt_from: PromptFrom,
    pub shuffle: bool,
    pub seed: i64,
    pub chat_template: bool,
    pub epochs: Option<i64>,
    pub name_span: Span,
    pub span: Span,
}

/// What a pipeline's signature parameter is bound to by the run.
#[derive(Debug, Clone, PartialEq)]
pub enum RunArg {
    Model(ModelId),
    Dataset(DatasetId),
    Fn(FnId),
    Value(Value),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    pub pipeline: PipelineId,
    /// In signature order.
    pub args: Vec<RunArg>,
    /// Every pipeline `param` with its value (set or default), in declaration order.
    pub settings: Vec<(String, Value)>,
    pub seed: i64,
    pub checkpoint_every: i64,
    /// The `eval` setting: held-out prompts and how often to score them.
    pub eval: Option<Eval>,
    pub span: Span,
}

/// The run's `eval: { every, prompts, n, greedy | temperature, max_new_tokens }`.
#[derive(Debug, Clone, PartialEq)]
pub struct Eval {
    pub every: i64,
    pub prompts: DatasetId,
    pub n: i64,
    pub greedy: bool,
    /// `None`: 1.0 (or greedy).
    pub temperature: Option<f64>,
    /// `None`: the run's `max_new_tokens`.
    pub max_new_tokens: Option<i64>,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Cluster {
    /// `cluster { cpu }` (one process) or `cluster { cpus: N }` (N CPU processes, one per rank,
    /// on this machine).
    Cpu {
        ranks: i64,
    },
    Gpus {
        gpus: i64,
        gpu: String,
        nodes: i64,
    },
}

/// A model-call selector of a schedule pin: `generate`, `logprobs(ref)`. The model is named
/// as the program or the pipeline names it; the planner resolves it against the plan's slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selector {
    /// `generate`, `logprobs`, `values`, `score` or `train`.
    pub op: String,
    pub model: Option<String>,
    pub span: Span,
}

/// How a `speculate` pin drafts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpeculatePin {
    Off,
    /// `ngram(n) [max k]`.
    Ngram {
        n: u64,
        max: Option<u64>,
    },
    /// `draft(m)`: the name of a declared model.
    Draft {
        model: String,
    },
}

/// A schedule pin as the checker accepted it.
#[derive(Debug, Clone, PartialEq)]
pub enum PinKind {
    /// `fuse off`.
    FuseOff,
    /// `fuse GEN -> A, B`.
    Fuse { from: Selector, to: Vec<Selector> },
    /// `migrate off`.
    MigrateOff,
    /// `migrate below P%`: the threshold as a fraction of the samples.
    MigrateBelow(f64),
    /// `interleave A, B`.
    Interleave(Vec<Selector>),
    /// `place SEL on devices FROM..TO [tp N] [pp N] [dp N]`.
    Place {
        target: Selector,
        from: u64,
        to: u64,
        tp: Option<u64>,
        pp: Option<u64>,
        dp: Option<u64>,
    },
    /// `speculate [SEL] MODE`.
    Speculate {
        target: Option<Selector>,
        mode: SpeculatePin,
    },
    /// `micro_batch SEL N`.
    MicroBatch { target: Selector, size: i64 },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Pin {
    pub kind: PinKind,
    pub span: Span,
}

/// The `schedule` block, lowered from the syntax tree once checked: the HIR holds no syntax
/// nodes.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Schedule {
    pub pins: Vec<Pin>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    /// The root file (the one given to `braid check`).
    pub root: FileId,
    pub fns: Vec<Fn>,
    pub pipelines: Vec<Pipeline>,
    pub models: Vec<Model>,
    pub datasets: Vec<Dataset>,
    pub run: Option<Run>,
    pub cluster: Option<Cluster>,
    pub schedule: Option<Schedule>,
    /// Every resolved use of a name: (where it is used, what it refers to, the definition's span).
    pub references: Vec<Reference>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    pub span: Span,
    pub def: Def,
    pub def_span: Span,
}

/// A model call of a pipeline body, found by walking it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelCall {
    pub op: ModelOp,
    /// The Model-typed local called (a parameter or a local frozen model).
    pub model: LocalId,
    pub span: Span,
}

/// A call of a loss in a pipeline body.
#[derive(Debug, Clone, PartialEq)]
pub struct LossCall {
    pub f: FnId,
    /// The Model-typed local passed as the loss's model.
    pub model: LocalId,
    pub span: Span,
}

impl Pipeline {
    /// The model calls of the `each` body, in source order.
    pub fn model_calls(&self) -> Vec<ModelCall> {
        fn walk(e: &Expr, out: &mut Vec<ModelCall>) {
            match &e.kind {
                ExprKind::Call { callee, args, .. } => {
                    for a in args {
                        walk(a, out);
                    }
                    if let (
                        Callee::Model(op),
                        Some(Expr {
                            kind: ExprKind::Ref(Def::Local(l)),
                            ..
                        }),
                    ) = (callee, args.first())
                    {
                        out.push(ModelCall {
                            op: *op,
                            model: *l,
                            span: e.span,
                        });
                    }
                }
                ExprKind::Unary { operand, .. } => walk(operand, out),
                ExprKind::Binary { lhs, rhs, .. } => {
                    walk(lhs, out);
                    walk(rhs, out);
                }
                ExprKind::Field { base, .. } => walk(base, out),
                ExprKind::Index { base, index } => {
                    walk(base, out);
                    walk(index, out);
                }
                _ => {}
            }
        }
        let mut out = Vec::new();
        if let Some(each) = &self.each {
            for s in &each.stmts {
                match s {
                    Stmt::Let(_, e) | Stmt::Expr(e) => walk(e, &mut out),
                }
            }
        }
        out.sort_by_key(|c| (c.span.start, c.span.end));
        out
    }

    /// The calls of losses in the `each` body, in source order: which loss, on which model.
    pub fn loss_calls(&self, fns: &[Fn]) -> Vec<LossCall> {
        fn walk(e: &Expr, fns: &[Fn], out: &mut Vec<LossCall>) {
            match &e.kind {
                ExprKind::Call { callee, args, .. } => {
                    for a in args {
                        walk(a, fns, out);
                    }
                    if let Callee::Fn(f) = callee
                        && let Some(loss) = fns.get(f.0 as usize).and_then(|x| x.loss.as_ref())
                        && let Some(Expr {
                            kind: ExprKind::Ref(Def::Local(l)),
                            ..
                        }) = args.get(loss.model_param as usize)
                    {
                        out.push(LossCall {
                            f: *f,
                            model: *l,
                            span: e.span,
                        });
                    }
                }
                ExprKind::Unary { operand, .. } => walk(operand, fns, out),
                ExprKind::Binary { lhs, rhs, .. } => {
                    walk(lhs, fns, out);
                    walk(rhs, fns, out);
                }
                _ => {}
            }
        }
        let mut out = Vec::new();
        if let Some(each) = &self.each {
            for s in &each.stmts {
                match s {
                    Stmt::Let(_, e) | Stmt::Expr(e) => walk(e, fns, &mut out),
                }
            }
        }
        out.sort_by_key(|c| (c.span.start, c.span.end));
        out
    }

    /// The model a Model-typed local stands for: its signature parameter index, following
    /// local frozen copies; and whether the path went through a frozen copy.
    pub fn model_param(&self, l: LocalId) -> Option<(u32, bool)> {
        let mut cur = l;
        let mut frozen = false;
        for _ in 0..=self.models.len() {
            let local = self.locals.get(cur.0 as usize)?;
            match local.kind {
                LocalKind::Param(i) => return Some((i, frozen)),
                LocalKind::Model(i) => {
                    frozen = true;
                    cur = self.models.get(i as usize)?.frozen_of?;
                }
                _ => return None,
            }
        }
        None
    }
}

impl Program {
    /// The model outputs a loss reads, directly or through the losses it calls.
    pub fn loss_outputs(&self, f: FnId) -> Vec<ModelOutput> {
        let mut out = Vec::new();
        let mut seen = std::collections::BTreeSet::new();
        let mut todo = vec![f];
        while let Some(g) = todo.pop() {
            if !seen.insert(g) {
                continue;
            }
            let Some(func) = self.fns.get(g.0 as usize) else {
                continue;
            };
            if let Some(loss) = &func.loss {
                out.extend(loss.outputs.iter().copied());
            }
            fn calls(e: &Expr, out: &mut Vec<FnId>) {
                crate::hir::visit(e, &mut |x| {
                    if let ExprKind::Call {
                        callee: Callee::Fn(f),
                        ..
                    } = &x.kind
                    {
                        out.push(*f);
                    }
                });
            }
            for (_, e) in &func.body.lets {
                calls(e, &mut todo);
            }
            calls(&func.body.value, &mut todo);
        }
        out.sort();
        out.dedup();
        out
    }

    pub fn fn_by_name(&self, name: &str) -> Option<&Fn> {
        self.fns.iter().find(|f| f.name == name)
    }

    pub fn pipeline_by_name(&self, name: &str) -> Option<&Pipeline> {
        self.pipelines.iter().find(|p| p.name == name)
    }
}

/// Calls `f` on `e` and every expression inside it, parents before children.
pub fn visit(e: &Expr, f: &mut dyn FnMut(&Expr)) {
    f(e);
    let body = |b: &Body, f: &mut dyn FnMut(&Expr)| {
        for (_, x) in &b.lets {
            visit(x, f);
        }
        visit(&b.value, f);
    };
    match &e.kind {
        ExprKind::Call { args, .. } => {
            for a in args {
                visit(a, f);
            }
        }
        ExprKind::Field { base, .. } => visit(base, f),
        ExprKind::Index { base, index } => {
            visit(base, f);
            visit(index, f);
        }
        ExprKind::Unary { operand, .. } => visit(operand, f),
        ExprKind::Binary { lhs, rhs, .. } => {
            visit(lhs, f);
            visit(rhs, f);
        }
        ExprKind::If { cond, then, else_ } => {
            visit(cond, f);
            body(then, f);
            visit(else_, f);
        }
        ExprKind::Block(b) => body(b, f),
        ExprKind::Scan(s) => {
            visit(&s.init, f);
            for (_, x) in &s.lets {
                visit(x, f);
            }
            visit(&s.value, f);
        }
        ExprKind::Lit(_) | ExprKind::Ref(_) | ExprKind::ModelOutput { .. } | ExprKind::Error => {}
    }
}
