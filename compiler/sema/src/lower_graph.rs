//! Lowering a checked run to a [`Plan`]: the body of the pipeline's `each` becomes a task graph
//! (`braid_ir::graph`), with the run's settings folded in as constants, every `fn` call lowered
//! to a kernel (`lower_kernel`), and the program's models and datasets described for the
//! runtime. Like `lower_kernel`, this decides nothing the checker has not checked: an input it
//! cannot lower is a [`LowerError`], never a panic.

use std::collections::BTreeMap;

use braid_ir::graph::{
    self as g, ArithOp, Const, DataTy, GenParams, Gran, Node, NodeId, Op, Operand, TaskGraph,
};
use braid_ir::loss::InputKind;

use crate::hir::*;
use crate::lower_kernel::{LowerError, lower_fn};
use crate::lower_loss::{LossArg, LossTree, lower_objective};

/// Drafted tokens of an `ngram(…)` pin without `max` (the engine's `--speculate ngram`).
pub const DEFAULT_NGRAM_DRAFT: u32 = 4;

fn err<T>(msg: impl Into<String>) -> Result<T, LowerError> {
    Err(LowerError(msg.into()))
}

/// A value while lowering the body.
#[derive(Debug, Clone)]
enum Lv {
    Node(NodeId),
    Const(Const),
    /// A model slot of the plan.
    Model(u32),
    Dataset(u32),
    /// A function-valued parameter bound to a `fn`.
    Fn(FnId),
    /// A loss, lowered to an objective node when a `train` receives it (so that one node holds
    /// the whole objective of the `train`, sums included).
    Loss(LossTree),
}

/// Lowers the program's run. `Err` when the program has no run or something cannot be lowered.
pub fn lower_run(program: &Program) -> Result<g::Plan, LowerError> {
    let Some(run) = &program.run else {
        return err("the program has no `run`");
    };
    let Some(pipeline) = program.pipelines.get(run.pipeline.0 as usize) else {
        return err("the run names no pipeline");
    };
    let Some(each) = &pipeline.each else {
        return err(format!("pipeline `{}` has no `each` block", pipeline.name));
    };
    let mut cx = Cx {
        program,
        pipeline,
        graph: TaskGraph::new(),
        env: BTreeMap::new(),
        models: Vec::new(),
        program_slots: BTreeMap::new(),
        datasets: Vec::new(),
        rollouts: BTreeMap::new(),
        nodes_in_order: Vec::new(),
    };
    // Bind the signature parameters and local models.
    for (li, local) in pipeline.locals.iter().enumerate() {
        let id = LocalId(li as u32);
        match local.kind {
            LocalKind::Param(i) => {
                let v = match run.args.get(i as usize) {
                    Some(RunArg::Model(m)) => Lv::Model(cx.program_model(*m)?),
                    Some(RunArg::Dataset(d)) => Lv::Dataset(cx.dataset(*d)?),
                    Some(RunArg::Fn(f)) => Lv::Fn(*f),
                    Some(RunArg::Value(v)) => Lv::Const(to_const(v)),
                    None => return err(format!("the run gives no value for `{}`", local.name)),
                };
                cx.env.insert(id, v);
            }
            LocalKind::Setting(i) => {
                let Some((_, v)) = run.settings.get(i as usize) else {
                    return err(format!("the run gives no value for `{}`", local.name));
                };
                cx.env.insert(id, Lv::Const(to_const(v)));
            }
            _ => {}
        }
    }
    for lm in &pipeline.models {
        let Some(of) = lm.frozen_of else {
            return err(format!("local model `{}` is not a frozen copy", lm.name));
        };
        let Some(Lv::Model(src)) = cx.env.get(&of).cloned() else {
            return err(format!(
                "`{}` copies something that is not a model",
                lm.name
            ));
        };
        let spec = g::ModelSpec {
            name: lm.name.clone(),
            source: g::ModelSource::FrozenOf(src),
            head: cx.models[src as usize].head,
            dtype: cx.models[src as usize].dtype,
            optimizer: None,
            grad_clip: None,
            max_len: cx.models[src as usize].max_len,
            gradient_checkpointing: false,
        };
        cx.models.push(spec);
        cx.env
            .insert(lm.local, Lv::Model(cx.models.len() as u32 - 1));
    }
    for stmt in &each.stmts {
        match stmt {
            Stmt::Let(l, e) => {
                let v = cx.expr(e)?;
                if let Lv::Node(n) = v
                    && let Some(node) = cx.graph.node_mut(n)
                    && node.label.is_none()
                {
                    node.label = pipeline.locals.get(l.0 as usize).map(|x| x.name.clone());
                }
                cx.env.insert(*l, v);
            }
            Stmt::Expr(e) => {
                cx.expr(e)?;
            }
        }
    }
    let steps = match cx.const_of(&each.count)? {
        Const::Int(n) if n > 0 => n,
        other => {
            return err(format!(
                "the step count must be a positive int, found {other}"
            ));
        }
    };
    cx.version_edges();
    cx.micro_batch_pins();
    cx.speculate_pins()?;
    if let Err(e) = cx.graph.verify() {
        return err(format!("internal: the lowered graph is malformed: {e}"));
    }
    let eval = match &run.eval {
        None => None,
        Some(ev) => {
            // The evaluation samples like the run's (first) generation, with its own n,
            // temperature or greedy decoding, and answer length where it sets them.
            let base = cx.graph.node_ids().into_iter().find_map(|id| {
                match cx.graph.node(id).map(|n| &n.op) {
                    Some(Op::Generate { params, .. }) => Some(params.clone()),
                    _ => None,
                }
            });
            let Some(base) = base else {
                return err("`eval` needs a run whose pipeline generates");
            };
            Some(g::EvalSpec {
                every: ev.every,
                dataset: cx.dataset(ev.prompts)?,
                params: GenParams {
                    n: ev.n,
                    max_new_tokens: ev.max_new_tokens.unwrap_or(base.max_new_tokens),
                    temperature: ev.temperature.unwrap_or(1.0),
                    greedy: ev.greedy,
                    speculate: None,
                    ..base
                },
            })
        }
    };
    let mut plan = g::Plan {
        pipeline: pipeline.name.clone(),
        graph: cx.graph,
        models: cx.models,
        datasets: cx.datasets,
        steps,
        seed: run.seed,
        checkpoint_every: run.checkpoint_every,
        settings: run
            .settings
            .iter()
            .map(|(k, v)| (k.clone(), to_const(v)))
            .collect(),
        eval,
    };
    plan.collect_record_fields();
    Ok(plan)
}

fn to_const(v: &Value) -> Const {
    match v {
        Value::Int(i) => Const::Int(*i),
        Value::Float(x) => Const::Float(*x),
        Value::Bool(b) => Const::Bool(*b),
        Value::Str(s) => Const::Str(s.clone()),
    }
}

fn gran(g: Granularity) -> Gran {
    match g {
        Granularity::Scalar => Gran::Scalar,
        Granularity::PerSample => Gran::Sample,
        Granularity::PerGroup => Gran::Group,
        Granularity::PerBatch => Gran::Batch,
    }
}

fn data_ty(t: &Ty) -> Option<DataTy> {
    Some(match t {
        Ty::PromptBatch(_) => DataTy::Prompts,
        Ty::Rollout(..) => DataTy::Rollout,
        Ty::PerToken(_) => DataTy::PerToken,
        Ty::PerSample(_) => DataTy::PerSample,
        Ty::Loss(..) => DataTy::Loss,
        Ty::Unit => DataTy::Unit,
        _ => return None,
    })
}

struct Cx<'p> {
    program: &'p Program,
    pipeline: &'p Pipeline,
    graph: TaskGraph,
    env: BTreeMap<LocalId, Lv>,
    models: Vec<g::ModelSpec>,
    program_slots: BTreeMap<ModelId, u32>,
    datasets: Vec<g::DatasetSpec>,
    rollouts: BTreeMap<RolloutId, NodeId>,
    nodes_in_order: Vec<NodeId>,
}

impl Cx<'_> {
    /// The slot of a program-level model, adding it (and what it copies) on first use.
    fn program_model(&mut self, id: ModelId) -> Result<u32, LowerError> {
        if let Some(s) = self.program_slots.get(&id) {
            return Ok(*s);
        }
        let Some(m) = self.program.models.get(id.0 as usize) else {
            return err(format!("no model #{}", id.0));
        };
        let source = match &m.source {
            ModelSource::Tiny(t) => g::ModelSource::Tiny {
                layers: t.layers,
                hidden: t.hidden,
                heads: t.heads,
                kv_heads: t.kv_heads,
                intermediate: t.intermediate,
                max_len: t.max_len,
                seed: t.seed,
            },
            ModelSource::Hf { dir } => g::ModelSource::Hf { dir: dir.clone() },
            ModelSource::Frozen(of) => g::ModelSource::FrozenOf(self.program_model(*of)?),
        };
        let spec = g::ModelSpec {
            name: m.name.clone(),
            source,
            head: m.head,
            dtype: m.dtype,
            optimizer: m.train.as_ref().map(|a| g::Optimizer {
                lr: a.lr,
                weight_decay: a.weight_decay,
                eps: a.eps,
                beta1: a.beta1,
                beta2: a.beta2,
                warmup: a.warmup,
                schedule: a.schedule,
            }),
            grad_clip: m.grad_clip,
            max_len: m.max_len,
            gradient_checkpointing: m.gradient_checkpointing,
        };
        self.models.push(spec);
        let slot = self.models.len() as u32 - 1;
        self.program_slots.insert(id, slot);
        Ok(slot)
    }

    fn dataset(&mut self, id: DatasetId) -> Result<u32, LowerError> {
        let Some(d) = self.program.datasets.get(id.0 as usize) else {
            return err(format!("no dataset #{}", id.0));
        };
        if let Some(i) = self.datasets.iter().position(|x| x.name == d.name) {
            return Ok(i as u32);
        }
        self.datasets.push(g::DatasetSpec {
            name: d.name.clone(),
            source: match &d.source {
                DatasetSource::Jsonl { path } => g::DatasetSource::Jsonl { path: path.clone() },
                DatasetSource::Parquet { path } => g::DatasetSource::Parquet { path: path.clone() },
                DatasetSource::Synthetic {
                    kind,
                    count,
                    seed,
                    digits,
                    split,
                } => g::DatasetSource::Synthetic {
                    kind: *kind,
                    count: *count,
                    seed: *seed,
                    digits: *digits,
                    split: *split,
                },
            },
            prompt_field: d.prompt_field.clone(),
            answer_field: d.answer_field.clone(),
            messages_field: d.messages_field.clone(),
            prompt_from: d.prompt_from,
            shuffle: d.shuffle,
            seed: d.seed,
            chat_template: d.chat_template,
            epochs: d.epochs,
            // Filled in once the graph is complete (`record_fields`).
            fields: Vec::new(),
        });
        Ok(self.datasets.len() as u32 - 1)
    }

    fn add(&mut self, op: Op, e: &Expr, inputs: &[NodeId]) -> Result<NodeId, LowerError> {
        let Some(ty) = data_ty(&e.ty) else {
            return err(format!("a value of type {} cannot be a task", e.ty));
        };
        let id = self.graph.add_node(Node {
            op,
            ty,
            gran: gran(e.gran),
            span: (e.span.start, e.span.end),
            label: None,
            micro_batch: None,
        });
        for (port, i) in inputs.iter().enumerate() {
            self.graph.add_data(*i, id, port as u32);
        }
        self.nodes_in_order.push(id);
        Ok(id)
    }

    /// The `generate` node of the rollout a value belongs to.
    fn rollout_node(&self, t: &Ty) -> Result<NodeId, LowerError> {
        match t.rollout().and_then(|r| self.rollouts.get(&r)) {
            Some(n) => Ok(*n),
            None => err(format!("a value of type {t} belongs to no rollout")),
        }
    }

    fn const_of(&mut self, e: &Expr) -> Result<Const, LowerError> {
        match self.expr(e)? {
            Lv::Const(c) => Ok(c),
            _ => err("expected a constant"),
        }
    }

    fn node_of(&mut self, e: &Expr) -> Result<NodeId, LowerError> {
        match self.expr(e)? {
            Lv::Node(n) => Ok(n),
            _ => err("expected a value computed by the pipeline"),
        }
    }

    fn model_of(&mut self, e: &Expr) -> Result<u32, LowerError> {
        match self.expr(e)? {
            Lv::Model(m) => Ok(m),
            _ => err("expected a model"),
        }
    }

    fn int_arg(&mut self, e: Option<&Expr>, what: &str) -> Result<i64, LowerError> {
        match e.map(|e| self.const_of(e)).transpose()? {
            Some(Const::Int(i)) => Ok(i),
            other => err(format!("`{what}` must be an int, found {other:?}")),
        }
    }

    fn float_arg(&mut self, e: Option<&Expr>, what: &str) -> Result<f64, LowerError> {
        match e.map(|e| self.const_of(e)).transpose()? {
            Some(Const::Float(x)) => Ok(x),
            Some(Const::Int(i)) => Ok(i as f64),
            other => err(format!("`{what}` must be a number, found {other:?}")),
        }
    }

    /// An operand: a constant, or a node made input `port` of the node being built.
    fn operand(&mut self, e: &Expr, inputs: &mut Vec<NodeId>) -> Result<Operand, LowerError> {
        Ok(match self.expr(e)? {
            Lv::Const(c) => Operand::Const(c),
            Lv::Node(n) => {
                let port = match inputs.iter().position(|x| *x == n) {
                    Some(p) => p,
                    None => {
                        inputs.push(n);
                        inputs.len() - 1
                    }
                };
                Operand::Input(port as u32)
            }
            _ => return err("a model, dataset or function is not a number"),
        })
    }

    fn expr(&mut self, e: &Expr) -> Result<Lv, LowerError> {
        match &e.kind {
            ExprKind::Lit(v) => Ok(Lv::Const(to_const(v))),
            ExprKind::Ref(Def::Local(l)) => match self.env.get(l) {
                Some(v) => Ok(v.clone()),
                None => err(format!(
                    "`{}` has no value when the graph is built (the step variable cannot be used in computations)",
                    self.pipeline
                        .locals
                        .get(l.0 as usize)
                        .map_or("?", |x| x.name.as_str())
                )),
            },
            ExprKind::Ref(Def::Model(m)) => Ok(Lv::Model(self.program_model(*m)?)),
            ExprKind::Ref(Def::Dataset(d)) => Ok(Lv::Dataset(self.dataset(*d)?)),
            ExprKind::Ref(Def::Fn(f)) => Ok(Lv::Fn(*f)),
            ExprKind::Ref(_) => err("this name is not a value of the pipeline"),
            ExprKind::Unary { op, operand } => match (op, self.expr(operand)?) {
                (UnaryOp::Neg, Lv::Const(Const::Int(i))) => Ok(Lv::Const(Const::Int(-i))),
                (UnaryOp::Neg, Lv::Const(Const::Float(x))) => Ok(Lv::Const(Const::Float(-x))),
                (UnaryOp::Not, Lv::Const(Const::Bool(b))) => Ok(Lv::Const(Const::Bool(!b))),
                (UnaryOp::Neg, Lv::Loss(l)) => Ok(Lv::Loss(LossTree::Neg(Box::new(l)))),
                (UnaryOp::Neg, Lv::Node(n)) => {
                    let r = self.rollout_node(&e.ty)?;
                    let mut inputs = vec![r];
                    inputs.push(n);
                    let op = Op::Arith {
                        op: ArithOp::Neg,
                        args: vec![Operand::Input(1)],
                    };
                    Ok(Lv::Node(self.add(op, e, &inputs)?))
                }
                _ => err("this unary operation cannot be lowered"),
            },
            ExprKind::Binary { op, lhs, rhs } => self.binary(e, *op, lhs, rhs),
            ExprKind::If { cond, then, else_ } => match self.const_of(cond)? {
                Const::Bool(true) => {
                    for (l, x) in &then.lets {
                        let v = self.expr(x)?;
                        self.env.insert(*l, v);
                    }
                    self.expr(&then.value)
                }
                Const::Bool(false) => self.expr(else_),
                _ => err("an `if` condition must be a bool"),
            },
            ExprKind::Block(b) => {
                for (l, x) in &b.lets {
                    let v = self.expr(x)?;
                    self.env.insert(*l, v);
                }
                self.expr(&b.value)
            }
            ExprKind::Call { callee, args, .. } => self.call(e, callee, args),
            ExprKind::Field { .. }
            | ExprKind::Index { .. }
            | ExprKind::Scan(_)
            | ExprKind::ModelOutput { .. } => {
                err("sample fields, indexing and `scan` belong in a `fn`")
            }
            ExprKind::Error => err("the program has errors"),
        }
    }

    fn binary(&mut self, e: &Expr, op: BinaryOp, lhs: &Expr, rhs: &Expr) -> Result<Lv, LowerError> {
        let a = self.expr(lhs)?;
        let b = self.expr(rhs)?;
        if let Ty::Loss(..) = &e.ty {
            let number = |c: &Const| c.as_f64().filter(|_| !matches!(c, Const::Bool(_)));
            let tree = match (op, a, b) {
                (BinaryOp::Add, Lv::Loss(x), Lv::Loss(y)) => {
                    LossTree::Add(Box::new(x), Box::new(y))
                }
                (BinaryOp::Sub, Lv::Loss(x), Lv::Loss(y)) => {
                    LossTree::Sub(Box::new(x), Box::new(y))
                }
                (BinaryOp::Mul, Lv::Loss(x), Lv::Const(c))
                | (BinaryOp::Mul, Lv::Const(c), Lv::Loss(x)) => match number(&c) {
                    Some(k) => LossTree::Scale(Box::new(x), k),
                    None => return err("a loss is scaled by something that is not a number"),
                },
                (BinaryOp::Div, Lv::Loss(x), Lv::Const(c)) => match number(&c) {
                    Some(k) => LossTree::Div(Box::new(x), k),
                    None => return err("a loss is divided by something that is not a number"),
                },
                _ => return err(format!("`{}` of losses cannot be lowered", op.as_str())),
            };
            return Ok(Lv::Loss(tree));
        }
        if let (Lv::Const(x), Lv::Const(y)) = (&a, &b) {
            return fold(op, x, y).map(Lv::Const);
        }
        let arith = match op {
            BinaryOp::Add => ArithOp::Add,
            BinaryOp::Sub => ArithOp::Sub,
            BinaryOp::Mul => ArithOp::Mul,
            BinaryOp::Div => ArithOp::Div,
            other => {
                return err(format!(
                    "`{}` on per-sample or per-token values belongs in a `fn`",
                    other.as_str()
                ));
            }
        };
        let r = self.rollout_node(&e.ty)?;
        let mut inputs = vec![r];
        let mut args = Vec::new();
        for v in [a, b] {
            args.push(match v {
                Lv::Const(c) => Operand::Const(c),
                Lv::Node(n) => {
                    inputs.push(n);
                    Operand::Input(inputs.len() as u32 - 1)
                }
                _ => return err("a model, dataset or function is not a number"),
            });
        }
        Ok(Lv::Node(self.add(
            Op::Arith { op: arith, args },
            e,
            &inputs,
        )?))
    }

    fn call(&mut self, e: &Expr, callee: &Callee, args: &[Expr]) -> Result<Lv, LowerError> {
        match callee {
            Callee::Model(mop) => self.model_call(e, *mop, args),
            Callee::Builtin(name) => self.builtin(e, name, args),
            Callee::Fn(f) => self.fn_call(e, *f, args),
            Callee::FnValue(l) => match self.env.get(l) {
                Some(Lv::Fn(f)) => {
                    let f = *f;
                    self.fn_call(e, f, args)
                }
                _ => err("a function parameter is not bound to a `fn`"),
            },
        }
    }

    fn model_call(&mut self, e: &Expr, mop: ModelOp, args: &[Expr]) -> Result<Lv, LowerError> {
        let model = self.model_of(args.first().ok_or_else(|| LowerError("no model".into()))?)?;
        let data = match args.get(1) {
            Some(a) => self.node_of(a)?,
            None => return err(format!("`{}` without its data", mop.as_str())),
        };
        let op = match mop {
            ModelOp::Generate => Op::Generate {
                model,
                params: GenParams {
                    n: self.int_arg(args.get(2), "n")?,
                    max_new_tokens: self.int_arg(args.get(3), "max_new_tokens")?,
                    temperature: self.float_arg(args.get(4), "temperature")?,
                    top_p: self.float_arg(args.get(5), "top_p")?,
                    top_k: self.int_arg(args.get(6), "top_k")?,
                    greedy: match args.get(7).map(|a| self.const_of(a)).transpose()? {
                        Some(Const::Bool(b)) => b,
                        _ => false,
                    },
                    speculate: None,
                },
            },
            ModelOp::Logprobs => Op::Logprobs { model },
            ModelOp::Values => Op::Values { model },
            ModelOp::Score => Op::Score { model },
            ModelOp::Train => {
                let Some(loss_expr) = args.get(2) else {
                    return err("`train` without a loss");
                };
                let Lv::Loss(tree) = self.expr(loss_expr)? else {
                    return err("`train` is given something that is not a loss");
                };
                if tree.models().iter().any(|m| *m != model) {
                    return err("`train` is given a loss of another model");
                }
                let (objective, nodes) = lower_objective(self.program, &tree)?;
                let mut inputs = vec![data];
                inputs.extend(nodes);
                let loss = self.add(Op::Loss { objective }, loss_expr, &inputs)?;
                let epochs = self.int_arg(args.get(3), "epochs")?;
                let minibatches = self.int_arg(args.get(4), "minibatches")?;
                let id = self.add(
                    Op::Train {
                        model,
                        epochs,
                        minibatches,
                    },
                    e,
                    &[data, loss],
                )?;
                return Ok(Lv::Node(id));
            }
        };
        let id = self.add(op, e, &[data])?;
        if let (ModelOp::Generate, Ty::Rollout(r, _)) = (mop, &e.ty) {
            self.rollouts.insert(*r, id);
        }
        Ok(Lv::Node(id))
    }

    fn builtin(&mut self, e: &Expr, name: &str, args: &[Expr]) -> Result<Lv, LowerError> {
        match name {
            "next" => {
                let Some(Lv::Dataset(d)) = args.first().map(|a| self.expr(a)).transpose()? else {
                    return err("`next` takes a dataset");
                };
                let count = self.int_arg(args.get(1), "n")?;
                let op = Op::Next { dataset: d, count };
                Ok(Lv::Node(self.add(op, e, &[])?))
            }
            "by_prompt" => {
                let (Some(v), Some(like)) = (args.first(), args.get(1)) else {
                    return err("`by_prompt` takes a value and a rollout");
                };
                let value = self.node_of(v)?;
                let like = self.node_of(like)?;
                let vr = self.rollout_node(&v.ty)?;
                Ok(Lv::Node(self.add(Op::ByPrompt, e, &[like, value, vr])?))
            }
            other => err(format!(
                "`{other}` on per-sample or per-token values belongs in a `fn`"
            )),
        }
    }

    /// A loss call: its arguments, kept until a `train` lowers the loss to an objective.
    fn loss_call(&mut self, f: FnId, args: &[Expr]) -> Result<Lv, LowerError> {
        let mut out = Vec::new();
        for a in args {
            out.push(match self.expr(a)? {
                Lv::Node(node) => {
                    let kind = match self.graph.node(node).map(|n| n.ty) {
                        Some(DataTy::PerToken) => InputKind::PerToken,
                        Some(DataTy::PerSample) => InputKind::PerSample,
                        _ => return err("a loss argument is not a per-token or per-sample value"),
                    };
                    LossArg::Node { node, kind }
                }
                Lv::Const(c) => LossArg::Const(match c {
                    Const::Int(i) => Value::Int(i),
                    Const::Float(x) => Value::Float(x),
                    Const::Bool(b) => Value::Bool(b),
                    Const::Str(s) => Value::Str(s),
                }),
                Lv::Model(m) => LossArg::Model(m),
                _ => return err("a loss argument is a dataset, a function or a loss"),
            });
        }
        Ok(Lv::Loss(LossTree::Call { f, args: out }))
    }

    fn fn_call(&mut self, e: &Expr, f: FnId, args: &[Expr]) -> Result<Lv, LowerError> {
        let Some(func) = self.program.fns.get(f.0 as usize) else {
            return err(format!("no function #{}", f.0));
        };
        if func.is_loss() {
            return self.loss_call(f, args);
        }
        // A kernel runs over a rollout's samples; a call on constants alone has none.
        let r = match e.ty.rollout() {
            Some(_) => self.rollout_node(&e.ty)?,
            None => return err(format!("`{}` computes no per-sample value here", func.name)),
        };
        let mut strings = BTreeMap::new();
        let mut inputs = vec![r];
        let mut operands: Vec<(usize, Operand)> = Vec::new();
        for (i, (p, a)) in func.params.iter().zip(args).enumerate() {
            match p.ty {
                SigTy::Str => match self.const_of(a)? {
                    Const::Str(s) => {
                        strings.insert(p.name.clone(), s);
                    }
                    other => return err(format!("`{}` must be a string, found {other}", p.name)),
                },
                SigTy::Sample => {
                    // The rollout the function is mapped over must be the context rollout.
                    let n = self.node_of(a)?;
                    if n != r {
                        return err(format!(
                            "`{}` is applied to a rollout other than its result's",
                            func.name
                        ));
                    }
                    operands.push((i, Operand::Input(0)));
                }
                SigTy::Float => {
                    let op = match self.operand(a, &mut inputs)? {
                        Operand::Const(Const::Int(x)) => Operand::Const(Const::Float(x as f64)),
                        o => o,
                    };
                    operands.push((i, op));
                }
                _ => {
                    let op = self.operand(a, &mut inputs)?;
                    operands.push((i, op));
                }
            }
        }
        let lowered = lower_fn(self.program, f, &strings)?;
        let mut kargs: Vec<Option<Operand>> = vec![None; lowered.kernel.params.len()];
        for (i, op) in operands {
            if let Some(Some(k)) = lowered.param_map.get(i)
                && let Some(slot) = kargs.get_mut(*k)
            {
                *slot = Some(op);
            }
        }
        let Some(kargs) = kargs.into_iter().collect::<Option<Vec<_>>>() else {
            return err(format!(
                "`{}`: a kernel parameter has no argument",
                func.name
            ));
        };
        let op = Op::Kernel {
            func: func.name.clone(),
            kernel: lowered.kernel,
            args: kargs,
        };
        Ok(Lv::Node(self.add(op, e, &inputs)?))
    }

    /// For every trained model: its last `train` in step i−1 comes before its first call in
    /// step i.
    fn version_edges(&mut self) {
        let order = self.nodes_in_order.clone();
        for slot in 0..self.models.len() as u32 {
            let calls: Vec<NodeId> = order
                .iter()
                .copied()
                .filter(|n| self.graph.node(*n).and_then(|x| x.op.model()) == Some(slot))
                .collect();
            let last_train = calls
                .iter()
                .rev()
                .copied()
                .find(|n| matches!(self.graph.node(*n).map(|x| &x.op), Some(Op::Train { .. })));
            if let (Some(t), Some(first)) = (last_train, calls.first()) {
                self.graph.add_version(t, *first, slot);
            }
            // A frozen copy reads the weights of the step-0 model only: no version edge.
        }
    }

    /// Applies `micro_batch` pins of the schedule to their calls.
    fn micro_batch_pins(&mut self) {
        let Some(schedule) = &self.program.schedule else {
            return;
        };
        let names = self.slot_names();
        for pin in &schedule.pins {
            if let PinKind::MicroBatch { target, size } = &pin.kind {
                for id in self.nodes_in_order.clone() {
                    if selects(target, self.graph.node(id), &names)
                        && let Some(n) = self.graph.node_mut(id)
                    {
                        n.micro_batch = Some(*size);
                    }
                }
            }
        }
    }

    /// Applies `speculate` pins to their `generate` calls. A draft model must be a Hugging Face
    /// directory: the engine loads drafts from one.
    fn speculate_pins(&mut self) -> Result<(), LowerError> {
        let Some(schedule) = &self.program.schedule else {
            return Ok(());
        };
        let names = self.slot_names();
        for pin in &schedule.pins {
            let PinKind::Speculate { target, mode } = &pin.kind else {
                continue;
            };
            let value = match mode {
                SpeculatePin::Off => g::Speculation::Off,
                SpeculatePin::Ngram { max, .. } => g::Speculation::Ngram {
                    max_draft: max.map_or(DEFAULT_NGRAM_DRAFT, |m| m as u32),
                },
                SpeculatePin::Draft { model } => {
                    let Some(m) = self.program.models.iter().find(|m| &m.name == model) else {
                        return err(format!("draft model `{model}` is not declared"));
                    };
                    match &m.source {
                        ModelSource::Hf { dir } => g::Speculation::Draft { dir: dir.clone() },
                        _ => {
                            return err(format!(
                                "draft model `{model}` must be a Hugging Face directory (`hf(\"…\")`) for the runtime to load it"
                            ));
                        }
                    }
                }
            };
            for id in self.nodes_in_order.clone() {
                let hit = match target {
                    Some(sel) => selects(sel, self.graph.node(id), &names),
                    None => matches!(
                        self.graph.node(id).map(|n| &n.op),
                        Some(Op::Generate { .. })
                    ),
                };
                if hit
                    && let Some(Node {
                        op: Op::Generate { params, .. },
                        ..
                    }) = self.graph.node_mut(id)
                {
                    params.speculate = Some(value.clone());
                }
            }
        }
        Ok(())
    }

    /// For each slot, the names a selector may use: the slot's name and, for a model bound
    /// to a pipeline parameter, that parameter's name.
    fn slot_names(&self) -> Vec<Vec<String>> {
        let mut names: Vec<Vec<String>> =
            self.models.iter().map(|m| vec![m.name.clone()]).collect();
        for (li, local) in self.pipeline.locals.iter().enumerate() {
            if let Some(Lv::Model(s)) = self.env.get(&LocalId(li as u32))
                && let Some(v) = names.get_mut(*s as usize)
            {
                v.push(local.name.clone());
            }
        }
        names
    }
}

fn selects(sel: &Selector, node: Option<&Node>, names: &[Vec<String>]) -> bool {
    let Some(node) = node else { return false };
    if node.op.name() != sel.op {
        return false;
    }
    match (&sel.model, node.op.model()) {
        (None, _) => true,
        (Some(m), Some(slot)) => names.get(slot as usize).is_some_and(|ns| ns.contains(m)),
        (Some(_), None) => false,
    }
}

/// Constant folding of a binary operation on two constants (run settings and literals).
fn fold(op: BinaryOp, a: &Const, b: &Const) -> Result<Const, LowerError> {
    use BinaryOp as B;
    Ok(match (a, b) {
        (Const::Int(x), Const::Int(y)) => match op {
            B::Add => Const::Int(x.wrapping_add(*y)),
            B::Sub => Const::Int(x.wrapping_sub(*y)),
            B::Mul => Const::Int(x.wrapping_mul(*y)),
            B::Div if *y != 0 => Const::Int(x.wrapping_div(*y)),
            B::Rem if *y != 0 => Const::Int(x.wrapping_rem(*y)),
            B::Div | B::Rem => return err("division by zero in a constant"),
            B::Lt => Const::Bool(x < y),
            B::Le => Const::Bool(x <= y),
            B::Gt => Const::Bool(x > y),
            B::Ge => Const::Bool(x >= y),
            B::Eq => Const::Bool(x == y),
            B::Ne => Const::Bool(x != y),
            _ => return err("this operation does not apply to ints"),
        },
        (Const::Bool(x), Const::Bool(y)) => match op {
            B::And => Const::Bool(*x && *y),
            B::Or => Const::Bool(*x || *y),
            B::Eq => Const::Bool(x == y),
            B::Ne => Const::Bool(x != y),
            _ => return err("this operation does not apply to bools"),
        },
        (Const::Str(x), Const::Str(y)) => match op {
            B::Eq => Const::Bool(x == y),
            B::Ne => Const::Bool(x != y),
            _ => return err("this operation does not apply to strings"),
        },
        _ => {
            let (Some(x), Some(y)) = (a.as_f64(), b.as_f64()) else {
                return err("this operation does not apply to these constants");
            };
            match op {
                B::Add => Const::Float(x + y),
                B::Sub => Const::Float(x - y),
                B::Mul => Const::Float(x * y),
                B::Div => Const::Float(x / y),
                B::Rem => Const::Float(x % y),
                B::Lt => Const::Bool(x < y),
                B::Le => Const::Bool(x <= y),
                B::Gt => Const::Bool(x > y),
                B::Ge => Const::Bool(x >= y),
                B::Eq => Const::Bool(x == y),
                B::Ne => Const::Bool(x != y),
                _ => return err("this operation does not apply to numbers"),
            }
        }
    })
}
