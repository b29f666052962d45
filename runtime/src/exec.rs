//! The executor of a [`Plan`]: runs the task graph of one iteration `steps` times on the
//! runtime — generation, inference streamed under generation, `fn` kernels through the JIT,
//! element-wise arithmetic, losses and training — with checkpoints and per-step metrics.
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

use braid_ir::graph::{
    ArithOp, Const, LossKind, ModelSource, ModelSpec, NodeId, Op, Operand, Plan,
};
use braid_ir::kernel::{Arg, Batch, KernelExec, Output, ParamKind, Ragged, SampleText, ScalarTy};
use braid_jit::{CompiledKernel, Jit};
use tch::{Device, Kind, Tensor};

use crate::checkpoint::{self, State};
use crate::data::{Dataset, Record};
use crate::engine::{EngineOptions, Sample, generate_stream};
use crate::error::{Error, Result};
use crate::infer::{self, InferOptions, Rollout};
use crate::loss::{self, Agg, Layout};
use crate::model::{Head, LoadOptions, Model};
use crate::optim::AdamW;
use crate::rng::{Rng, derive};
use crate::sampling::SamplingParams;
use crate::spec::SpeculateMode;
use crate::tiny::{TinyConfig, TinyVocab, tiny};
use crate::tokenizer::{ChatMessage, Tokenizer};

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
    /// Stream inference under generation (inter-stage fusion).
    pub fuse: bool,
    /// Consumers of a rollout that must wait for the whole batch even when `fuse` is on (the
    /// schedule's `fuse off` / `fuse GEN -> A, B` pins, resolved by the caller).
    pub no_stream: BTreeSet<NodeId>,
    pub device: Device,
}

/// What the executor reports as it goes.
#[derive(Debug)]
pub enum Event<'a> {
    /// The run starts (or resumes) at `first_step` of `total`.
    Start { first_step: i64, total: i64 },
    /// Step `step` (1-based) finished with these metrics.
    Step {
        step: i64,
        total: i64,
        metrics: &'a BTreeMap<String, f64>,
    },
    /// A checkpoint of step `step` was written.
    Checkpoint { step: i64, dir: &'a Path },
}

/// A model of the run.
struct Slot {
    spec: ModelSpec,
    model: Model,
    tokenizer: Tokenizer,
    opt: Option<AdamW>,
    /// Optimizer steps over the whole run (for the learning-rate schedule).
    total_opt_steps: i64,
    /// A copy that generation uses while the streamed consumers use `model`.
    replica: Option<Model>,
}

/// One generated sample with its prompt.
#[derive(Debug, Clone)]
struct GenSample {
    prompt_index: usize,
    rollout: Rollout,
    text: String,
}

/// A finished rollout, samples ordered by (prompt, sample).
#[derive(Debug)]
struct RolloutData {
    samples: Vec<GenSample>,
    records: Vec<Record>,
    max_new_tokens: i64,
    /// The temperature the log-probabilities of this rollout are computed at.
    temperature: f64,
}

impl RolloutData {
    fn lengths(&self) -> Vec<usize> {
        self.samples
            .iter()
            .map(|s| s.rollout.completion.len())
            .collect()
    }
}

/// Per-token values of a rollout: values plus offsets (sample i is `offsets[i]..offsets[i+1]`).
#[derive(Debug, Clone, PartialEq)]
struct Tokens {
    values: Vec<f64>,
    offsets: Vec<usize>,
}

impl Tokens {
    fn from_rows(rows: &[Vec<f32>]) -> Tokens {
        let mut values = Vec::new();
        let mut offsets = vec![0];
        for r in rows {
            values.extend(r.iter().map(|&x| f64::from(x)));
            offsets.push(values.len());
        }
        Tokens { values, offsets }
    }

    fn row(&self, i: usize) -> &[f64] {
        &self.values[self.offsets[i]..self.offsets[i + 1]]
    }
}

/// A loss operand, resolved.
#[derive(Debug, Clone)]
enum LossArg {
    Tokens(Tokens),
    Samples(Vec<f64>),
    Const(Const),
    /// The trained model's own log-probabilities before its update, taken (detached) from the
    /// training forward pass: see `Executor::reused`.
    CurrentLogp,
}

#[derive(Debug, Clone)]
struct LossTerm {
    kind: LossKind,
    args: Vec<LossArg>,
}

#[derive(Debug)]
enum Val {
    Prompts {
        records: Vec<Record>,
        chat_template: bool,
    },
    Rollout(Arc<RolloutData>),
    PerToken(Tokens),
    PerSample(Vec<f64>),
    Loss(Vec<LossTerm>),
    Unit,
}

fn head_of(spec: &ModelSpec) -> Head {
    match spec.head.as_str() {
        "value" => Head::Value,
        "score" => Head::Score,
        _ => Head::Lm,
    }
}

fn kind_of(spec: &ModelSpec, device: Device) -> Kind {
    match spec.dtype.as_deref() {
        Some("bf16") => Kind::BFloat16,
        Some("f16") => Kind::Half,
        Some(_) => Kind::Float,
        None if device == Device::Cpu => Kind::Float,
        None => Kind::BFloat16,
    }
}

/// Builds a model from its source (following frozen copies to the model they copy).
fn build_model(
    plan: &Plan,
    slot: usize,
    base_dir: &Path,
    device: Device,
) -> Result<(Model, Tokenizer)> {
    let spec = &plan.models[slot];
    let head = head_of(spec);
    let mut src = slot;
    for _ in 0..=plan.models.len() {
        match &plan.models[src].source {
            ModelSource::FrozenOf(of) => src = *of as usize,
            _ => break,
        }
    }
    let root = &plan.models[src];
    match &root.source {
        ModelSource::Tiny {
            layers,
            hidden,
            heads,
            kv_heads,
            intermediate,
            max_len,
            seed,
        } => {
            let config = TinyConfig {
                vocab: TinyVocab::Bytes,
                layers: *layers,
                hidden: *hidden,
                heads: *heads,
                kv_heads: *kv_heads,
                intermediate: *intermediate,
                max_len: root.max_len.unwrap_or(*max_len),
                seed: *seed as u64,
            };
            tiny(&config, head, device)
        }
        ModelSource::Hf { dir } => {
            let path = if Path::new(dir).is_absolute() {
                PathBuf::from(dir)
            } else {
                base_dir.join(dir)
            };
            let model = Model::load(
                &path,
                &LoadOptions {
                    head,
                    dtype: Some(kind_of(root, device)),
                    device,
                },
            )?;
            let tokenizer = Tokenizer::from_dir(&path, model.config())?;
            Ok((model, tokenizer))
        }
        ModelSource::FrozenOf(_) => Err(Error::invalid(
            format!("model `{}`", spec.name),
            "is a frozen copy of itself",
        )),
    }
}

/// Copies every parameter of `src` into `dst` (same architecture).
fn copy_weights(dst: &mut Model, src: &Model) -> Result<()> {
    let from: BTreeMap<String, Tensor> = src.named_parameters().into_iter().collect();
    tch::no_grad(|| -> Result<()> {
        for (name, t) in dst.named_parameters() {
            let s = from.get(&name).ok_or_else(|| {
                Error::invalid(
                    "replica",
                    format!("parameter `{name}` missing in the source"),
                )
            })?;
            let mut d = t.shallow_clone();
            d.f_copy_(s)?;
        }
        Ok(())
    })
}

/// The executor.
pub struct Executor<'p> {
    plan: &'p Plan,
    options: RunOptions,
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
    total_steps: i64,
    first_step: i64,
}

impl<'p> Executor<'p> {
    /// Builds the models, loads the data, compiles the kernels, and restores the latest
    /// checkpoint when resuming.
    pub fn new(plan: &'p Plan, options: RunOptions) -> Result<Executor<'p>> {
        crate::device::set_cpu_threads(options.threads);
        let total_steps = options.steps.unwrap_or(plan.steps).min(plan.steps).max(0);
        let order = plan
            .graph
            .topo_order()
            .ok_or_else(|| Error::invalid("plan", "the task graph has a cycle"))?;
        let mut datasets = Vec::new();
        for d in &plan.datasets {
            datasets.push(Dataset::load(d, &options.base_dir)?);
        }
        // Optimizer steps per train node and per model, for the schedules.
        let mut opt_steps: BTreeMap<u32, i64> = BTreeMap::new();
        let reused = reusable_logprobs(plan);
        // Models that generate while a streamed consumer runs on the same model: they need a
        // replica to generate on.
        let mut needs_replica: BTreeSet<u32> = Default::default();
        for id in &order {
            let Some(node) = plan.graph.node(*id) else {
                continue;
            };
            if let Op::Train {
                model,
                epochs,
                minibatches,
            } = &node.op
            {
                *opt_steps.entry(*model).or_default() += epochs * minibatches * total_steps;
            }
            if let Op::Generate { model, .. } = &node.op
                && options.fuse
                && streamed(plan, *id, &reused, &options.no_stream)
                    .iter()
                    .any(|c| plan.graph.node(*c).and_then(|n| n.op.model()) == Some(*model))
            {
                needs_replica.insert(*model);
            }
        }
        let mut slots = Vec::new();
        for (i, spec) in plan.models.iter().enumerate() {
            let (model, tokenizer) = build_model(plan, i, &options.base_dir, options.device)?;
            let trained = opt_steps.contains_key(&(i as u32));
            let opt = match (&spec.optimizer, trained) {
                (Some(c), true) => Some(AdamW::new(&model, c.clone())?),
                (None, true) => {
                    return Err(Error::invalid(
                        format!("model `{}`", spec.name),
                        "is trained but declares no `train:` optimizer",
                    ));
                }
                _ => None,
            };
            slots.push(Slot {
                spec: spec.clone(),
                model,
                tokenizer,
                opt,
                total_opt_steps: opt_steps.get(&(i as u32)).copied().unwrap_or(0),
                replica: None,
            });
        }
        // Every model must understand the policy's tokens: same vocabulary size.
        if let Some(first) = slots.first() {
            let v = first.model.config().vocab_size;
            for s in &slots[1..] {
                if s.model.config().vocab_size != v {
                    return Err(Error::invalid(
                        format!("model `{}`", s.spec.name),
                        format!(
                            "has a vocabulary of {} tokens but `{}` has {v}; the models of a pipeline must share a tokenizer",
                            s.model.config().vocab_size,
                            first.spec.name
                        ),
                    ));
                }
            }
        }
        let jit = Jit::new().map_err(|e| Error::invalid("jit", e.to_string()))?;
        let mut kernels = BTreeMap::new();
        for id in &order {
            if let Some(Op::Kernel { func, kernel, .. }) = plan.graph.node(*id).map(|n| &n.op) {
                let k = jit
                    .compile(kernel)
                    .map_err(|e| Error::invalid(format!("fn `{func}`"), e.to_string()))?;
                kernels.insert(*id, k);
            }
        }
        let main_rollout = order.iter().find_map(|id| match plan.graph.node(*id) {
            Some(n) if matches!(n.op, Op::Train { .. }) => plan.graph.inputs(*id).first().copied(),
            _ => None,
        });
        let reward_node = main_rollout.and_then(|r| {
            order.iter().copied().find(|id| {
                let Some(n) = plan.graph.node(*id) else {
                    return false;
                };
                let inputs = plan.graph.inputs(*id);
                inputs.first() == Some(&r)
                    && match &n.op {
                        Op::Score { .. } => true,
                        Op::Kernel { kernel, .. } => {
                            kernel.params.first() == Some(&ParamKind::Sample)
                                && n.ty == braid_ir::graph::DataTy::PerSample
                        }
                        _ => false,
                    }
            })
        });
        let mut ex = Executor {
            plan,
            options,
            slots,
            datasets,
            cursors: vec![0; plan.datasets.len()],
            kernels,
            order,
            main_rollout,
            reward_node,
            reused,
            total_steps,
            first_step: 0,
        };
        for model in needs_replica {
            let i = model as usize;
            if ex.slots[i].opt.is_some() {
                let (mut replica, _) =
                    build_model(plan, i, &ex.options.base_dir, ex.options.device)?;
                copy_weights(&mut replica, &ex.slots[i].model)?;
                ex.slots[i].replica = Some(replica);
            }
        }
        if ex.options.resume {
            ex.restore()?;
        }
        Ok(ex)
    }

    /// The step the run starts at (0, or the checkpoint's step when resuming).
    pub fn first_step(&self) -> i64 {
        self.first_step
    }

    pub fn total_steps(&self) -> i64 {
        self.total_steps
    }

    /// Per `generate`, the inference calls that stream under it (none with `fuse` off, or
    /// where the schedule's `fuse` pins keep them waiting for the whole batch).
    pub fn streaming(&self) -> Vec<(NodeId, Vec<NodeId>)> {
        self.plan
            .graph
            .node_ids()
            .into_iter()
            .filter(|id| {
                matches!(
                    self.plan.graph.node(*id).map(|n| &n.op),
                    Some(Op::Generate { .. })
                )
            })
            .map(|g| {
                let on = if self.options.fuse {
                    streamed(self.plan, g, &self.reused, &self.options.no_stream)
                } else {
                    Vec::new()
                };
                (g, on)
            })
            .collect()
    }

    fn restore(&mut self) -> Result<()> {
        let Some((step, dir)) = checkpoint::latest(&self.options.run_dir)? else {
            return Ok(());
        };
        let state = checkpoint::read_state(&dir)?;
        let fingerprint = fingerprint(self.plan);
        if state.fingerprint != fingerprint {
            return Err(Error::file(
                dir.join("state.json"),
                "the checkpoint was made by a different program or different run settings; resume with the program that made it",
            ));
        }
        for slot in self.slots.iter_mut() {
            let Some(opt) = slot.opt.as_mut() else {
                continue;
            };
            let mdir = dir.join("models").join(&slot.spec.name);
            let loaded = Model::load(
                &mdir,
                &LoadOptions {
                    head: slot.model.head(),
                    dtype: Some(slot.model.kind()),
                    device: self.options.device,
                },
            )?;
            copy_weights(&mut slot.model, &loaded)?;
            opt.load(
                &dir.join("optimizer")
                    .join(format!("{}.safetensors", slot.spec.name)),
            )?;
            if let Some(r) = slot.replica.as_mut() {
                copy_weights(r, &slot.model)?;
            }
        }
        for (i, d) in self.plan.datasets.iter().enumerate() {
            self.cursors[i] = state.cursors.get(&d.name).copied().unwrap_or(0);
        }
        self.first_step = step;
        Ok(())
    }

    /// Runs the remaining steps, reporting each; writes checkpoints and `metrics.jsonl`.
    pub fn run(&mut self, on_event: &mut dyn FnMut(Event<'_>)) -> Result<()> {
        std::fs::create_dir_all(&self.options.run_dir)
            .map_err(|e| Error::file(&self.options.run_dir, format!("cannot create: {e}")))?;
        let metrics_path = self.options.run_dir.join("metrics.jsonl");
        checkpoint::truncate_metrics(&metrics_path, self.first_step)?;
        checkpoint::write_atomic(
            &self.options.run_dir.join("plan.txt"),
            self.plan.graph_text().as_bytes(),
        )?;
        on_event(Event::Start {
            first_step: self.first_step,
            total: self.total_steps,
        });
        let every = self
            .options
            .checkpoint_every
            .unwrap_or(self.plan.checkpoint_every)
            .max(0);
        let mut lengths_seen: Vec<usize> = Vec::new();
        let mut tb =
            crate::tensorboard::EventWriter::create(&self.options.run_dir.join("tensorboard"))?;
        for step in self.first_step..self.total_steps {
            let (metrics, lengths) = self.step(step)?;
            lengths_seen.extend(lengths);
            let mut line = serde_json::Map::new();
            line.insert("step".into(), serde_json::json!(step + 1));
            for (k, v) in &metrics {
                line.insert(
                    k.clone(),
                    if v.is_finite() {
                        serde_json::json!(v)
                    } else {
                        serde_json::Value::Null
                    },
                );
            }
            checkpoint::append_line(&metrics_path, &serde_json::Value::Object(line).to_string())?;
            let scalars: Vec<(&str, f64)> = metrics.iter().map(|(k, v)| (k.as_str(), *v)).collect();
            tb.scalars(step + 1, &scalars)?;
            on_event(Event::Step {
                step: step + 1,
                total: self.total_steps,
                metrics: &metrics,
            });
            let done = step + 1;
            if (every > 0 && done % every == 0) || done == self.total_steps {
                let dir = self.checkpoint(done)?;
                on_event(Event::Checkpoint {
                    step: done,
                    dir: &dir,
                });
            }
        }
        if !lengths_seen.is_empty() {
            checkpoint::write_atomic(
                &self.options.run_dir.join("lengths.txt"),
                length_histogram(&lengths_seen).as_bytes(),
            )?;
        }
        Ok(())
    }

    fn checkpoint(&self, step: i64) -> Result<PathBuf> {
        let mut cursors = BTreeMap::new();
        for (i, d) in self.plan.datasets.iter().enumerate() {
            cursors.insert(d.name.clone(), self.cursors[i]);
        }
        let state = State {
            step,
            cursors,
            seed: self.plan.seed,
            pipeline: self.plan.pipeline.clone(),
            fingerprint: fingerprint(self.plan),
        };
        let trained: Vec<(&str, &Model, &Tokenizer, &AdamW)> = self
            .slots
            .iter()
            .filter_map(|s| {
                s.opt
                    .as_ref()
                    .map(|o| (s.spec.name.as_str(), &s.model, &s.tokenizer, o))
            })
            .collect();
        checkpoint::save(&self.options.run_dir, &state, &trained)
    }

    /// The trained models' final directories (the latest checkpoint's).
    pub fn final_models(&self) -> Result<Vec<(String, PathBuf)>> {
        let Some((_, dir)) = checkpoint::latest(&self.options.run_dir)? else {
            return Ok(Vec::new());
        };
        Ok(self
            .slots
            .iter()
            .filter(|s| s.opt.is_some())
            .map(|s| (s.spec.name.clone(), dir.join("models").join(&s.spec.name)))
            .collect())
    }

    /// One iteration of the graph.
    fn step(&mut self, step: i64) -> Result<(BTreeMap<String, f64>, Vec<usize>)> {
        let t_step = Instant::now();
        let mut vals: BTreeMap<NodeId, Val> = BTreeMap::new();
        let mut m: BTreeMap<String, f64> = BTreeMap::new();
        let mut time: BTreeMap<&'static str, f64> = BTreeMap::new();
        let mut lengths = Vec::new();
        let seed = derive(self.plan.seed as u64, step as u64);
        let order = self.order.clone();
        for id in order {
            if vals.contains_key(&id) {
                continue;
            }
            let Some(node) = self.plan.graph.node(id) else {
                continue;
            };
            let inputs = self.plan.graph.inputs(id);
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
                    let (rollout, streamed, stats) =
                        self.generate(id, &inputs, &vals, derive(seed, u64::from(id.0)))?;
                    *time.entry("generate").or_default() += stats.gen_seconds;
                    *time.entry("infer").or_default() += stats.infer_seconds;
                    m.insert("time/infer_hidden".into(), stats.hidden_share());
                    if Some(id) == self.main_rollout {
                        let toks: usize = rollout.lengths().iter().sum();
                        m.insert(
                            "tokens_per_s".into(),
                            toks as f64 / stats.gen_seconds.max(1e-9),
                        );
                        lengths = rollout.lengths();
                    }
                    for (n, v) in streamed {
                        vals.insert(n, v);
                    }
                    vals.insert(id, Val::Rollout(rollout));
                    continue;
                }
                Op::Logprobs { .. } if self.reused.contains(&id) => {
                    // Filled in by the `train` that reads it (see `reusable_logprobs`).
                    continue;
                }
                Op::Logprobs { model } | Op::Values { model } | Op::Score { model } => {
                    let r = rollout_of(&vals, inputs.first())?;
                    let seqs: Vec<Rollout> = r.samples.iter().map(|s| s.rollout.clone()).collect();
                    let v = self.infer(&node.op, *model, &seqs, r.temperature, node.micro_batch)?;
                    *time.entry("infer").or_default() += t0.elapsed().as_secs_f64();
                    v
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
                Op::Loss { kind, args } => {
                    let mut resolved = Vec::new();
                    for a in args {
                        resolved.push(match a {
                            Operand::Const(c) => LossArg::Const(c.clone()),
                            Operand::Input(p)
                                if inputs
                                    .get(*p as usize)
                                    .is_some_and(|n| self.reused.contains(n)) =>
                            {
                                LossArg::CurrentLogp
                            }
                            Operand::Input(p) => {
                                match inputs.get(*p as usize).and_then(|n| vals.get(n)) {
                                    Some(Val::PerToken(t)) => LossArg::Tokens(t.clone()),
                                    Some(Val::PerSample(s)) => LossArg::Samples(s.clone()),
                                    _ => {
                                        return Err(Error::invalid(
                                            "plan",
                                            format!("{id}: loss operand ${p} is not a value"),
                                        ));
                                    }
                                }
                            }
                        });
                    }
                    Val::Loss(vec![LossTerm {
                        kind: *kind,
                        args: resolved,
                    }])
                }
                Op::LossSum { .. } => {
                    let mut terms = Vec::new();
                    for i in inputs.iter().skip(1) {
                        if let Some(Val::Loss(t)) = vals.get(i) {
                            terms.extend(t.iter().cloned());
                        }
                    }
                    Val::Loss(terms)
                }
                // The runtime runs a plan on one device, where every layout is the same
                // placement: the planner's reshard, offload and reload nodes move nothing.
                Op::Reshard { .. } | Op::Offload { .. } | Op::Reload { .. } => Val::Unit,
                Op::Train {
                    model,
                    epochs,
                    minibatches,
                } => {
                    let r = rollout_of(&vals, inputs.first())?;
                    let terms = match inputs.get(1).and_then(|n| vals.get(n)) {
                        Some(Val::Loss(t)) => t.clone(),
                        _ => return Err(Error::invalid("plan", format!("{id}: no loss"))),
                    };
                    let micro = node.micro_batch.unwrap_or(self.plan.micro_batch).max(1) as usize;
                    let (stats, own_logp) = self.train(
                        *model as usize,
                        &r,
                        &terms,
                        *epochs,
                        *minibatches,
                        micro,
                        derive(seed, 0x7EA1 ^ u64::from(id.0)),
                    )?;
                    // The reused log-probability nodes of this model on this rollout.
                    for n in self.reused.clone() {
                        let same = self.plan.graph.node(n).and_then(|x| x.op.model())
                            == Some(*model)
                            && self.plan.graph.inputs(n).first() == inputs.first();
                        if same && let Some(rows) = &own_logp {
                            vals.insert(n, Val::PerToken(Tokens::from_rows(rows)));
                        }
                    }
                    let name = self.slots[*model as usize].spec.name.clone();
                    for (k, v) in stats {
                        m.insert(format!("{name}/{k}"), v);
                    }
                    *time.entry("train").or_default() += t0.elapsed().as_secs_f64();
                    Val::Unit
                }
            };
            vals.insert(id, v);
        }
        // Rewards, KL and lengths of the rollout the policy learns from.
        if let Some(Val::PerSample(r)) = self.reward_node.and_then(|n| vals.get(&n)) {
            let (mean, std) = mean_std(r);
            m.insert("reward_mean".into(), mean);
            m.insert("reward_std".into(), std);
        }
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
        Ok((m, lengths))
    }

    /// The mean over samples of Σ_t (logp − ref_logp), when the trained rollout has the
    /// log-probabilities of a trained model and of a frozen one.
    fn kl_metric(&self, vals: &BTreeMap<NodeId, Val>) -> Option<f64> {
        let r = self.main_rollout?;
        let mut trained = None;
        let mut frozen = None;
        for id in self.plan.graph.consumers(r) {
            let node = self.plan.graph.node(id)?;
            if let Op::Logprobs { model } = node.op {
                let is_trained = self.slots.get(model as usize)?.opt.is_some();
                if is_trained && trained.is_none() {
                    trained = Some(id);
                } else if !is_trained && frozen.is_none() {
                    frozen = Some(id);
                }
            }
        }
        let (Some(Val::PerToken(a)), Some(Val::PerToken(b))) =
            (vals.get(&trained?), vals.get(&frozen?))
        else {
            return None;
        };
        let n = a.offsets.len().saturating_sub(1);
        if n == 0 {
            return None;
        }
        let total: f64 = a.values.iter().zip(&b.values).map(|(x, y)| x - y).sum();
        Some(total / n as f64)
    }

    /// Runs a `logprobs`, `values` or `score` node on sequences.
    fn infer(
        &self,
        op: &Op,
        model: u32,
        seqs: &[Rollout],
        temperature: f64,
        micro: Option<i64>,
    ) -> Result<Val> {
        let slot = &self.slots[model as usize];
        let opts = InferOptions {
            micro_batch: micro.unwrap_or(self.plan.micro_batch).max(1) as usize,
            temperature: temperature as f32,
        };
        Ok(collect_rows(
            op,
            infer_per_sample(&slot.model, op, seqs, &opts)?,
        ))
    }

    /// Generates a rollout; the nodes that read it directly run on micro-batches of finished
    /// samples in this thread while generation continues in another.
    fn generate(
        &mut self,
        id: NodeId,
        inputs: &[NodeId],
        vals: &BTreeMap<NodeId, Val>,
        seed: u64,
    ) -> Result<Generated> {
        let Some(Op::Generate { model, params }) = self.plan.graph.node(id).map(|n| &n.op) else {
            return Err(Error::invalid(
                "plan",
                format!("{id} is not a generate node"),
            ));
        };
        let model = *model as usize;
        let Some(Val::Prompts {
            records,
            chat_template,
        }) = inputs.first().and_then(|n| vals.get(n))
        else {
            return Err(Error::invalid("plan", format!("{id}: no prompts")));
        };
        let tokenizer = &self.slots[model].tokenizer;
        let mut prompt_ids = Vec::with_capacity(records.len());
        for (i, r) in records.iter().enumerate() {
            let ids = if *chat_template {
                let text = tokenizer.apply_chat_template(
                    &[ChatMessage {
                        role: "user".into(),
                        content: r.prompt.clone(),
                    }],
                    true,
                )?;
                tokenizer.encode(&text, false)?
            } else {
                tokenizer.encode(&r.prompt, true)?
            };
            if ids.is_empty() {
                return Err(Error::invalid(
                    format!("prompt {i}"),
                    format!("`{}` encodes to no tokens", r.prompt),
                ));
            }
            prompt_ids.push(ids);
        }
        let sampling = SamplingParams {
            max_new_tokens: params.max_new_tokens.max(1) as usize,
            greedy: params.greedy,
            temperature: params.temperature as f32,
            top_k: params.top_k.max(0) as usize,
            top_p: params.top_p as f32,
            seed,
            n: params.n.max(1) as usize,
            stop: Vec::new(),
            stop_at_eos: true,
        };
        let temperature = f64::from(sampling.logprob_temperature());
        let consumers: Vec<NodeId> = if self.options.fuse {
            streamed(self.plan, id, &self.reused, &self.options.no_stream)
        } else {
            Vec::new()
        };
        let total = prompt_ids.len() * sampling.n;
        let micro = self.plan.micro_batch.max(1) as usize;
        let threads = self.options.threads;
        let mut stats = GenStats::default();
        let mut samples: Vec<Option<(Sample, Rollout)>> = vec![None; total];
        // Per consumer: per-sample results, filled as micro-batches finish.
        let mut partial: BTreeMap<NodeId, Vec<Option<PerSampleOut>>> =
            consumers.iter().map(|c| (*c, vec![None; total])).collect();
        let n = sampling.n;
        let engine = EngineOptions {
            speculate: match params.speculate.as_deref() {
                None => SpeculateMode::Off,
                Some(s) => match SpeculateMode::parse(s)? {
                    SpeculateMode::Draft(dir) if dir.is_relative() => {
                        SpeculateMode::Draft(self.options.base_dir.join(dir))
                    }
                    other => other,
                },
            },
            ..EngineOptions::default()
        };
        // Split borrows: generation gets the replica (or the model when nothing streams).
        let mut gen_model: Option<&mut Model> = None;
        let mut tok: Option<&Tokenizer> = None;
        let mut others: Vec<(usize, &Model)> = Vec::new();
        for (i, s) in self.slots.iter_mut().enumerate() {
            let Slot {
                model: m,
                replica,
                tokenizer,
                ..
            } = s;
            if i == model {
                tok = Some(tokenizer);
                // A replica exists only when a streamed consumer runs on this model.
                match (replica, consumers.is_empty()) {
                    (Some(r), false) => {
                        gen_model = Some(r);
                        others.push((i, m));
                    }
                    _ => gen_model = Some(m),
                }
            } else {
                others.push((i, m));
            }
        }
        let (Some(gen_model), Some(tok)) = (gen_model, tok) else {
            return Err(Error::invalid("plan", "no model to generate with"));
        };
        let plan = self.plan;
        let t_gen = Instant::now();
        let (tx, rx) = mpsc::channel::<Result<Sample>>();
        let result: Result<()> = std::thread::scope(|scope| {
            let prompts = prompt_ids.clone();
            let sampling = sampling.clone();
            let handle = scope.spawn(move || -> f64 {
                crate::device::set_cpu_threads(threads);
                let model: &Model = gen_model;
                match generate_stream(model, tok, prompts, sampling, engine) {
                    Ok(stream) => {
                        for item in stream {
                            if tx.send(item).is_err() {
                                break;
                            }
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                    }
                }
                t_gen.elapsed().as_secs_f64()
            });
            let mut pending: Vec<usize> = Vec::new();
            let mut outcome: Result<()> = Ok(());
            let mut run_chunk = |pending: &mut Vec<usize>,
                                 samples: &Vec<Option<(Sample, Rollout)>>,
                                 stats: &mut GenStats|
             -> Result<()> {
                if pending.is_empty() || consumers.is_empty() {
                    pending.clear();
                    return Ok(());
                }
                let t0 = Instant::now();
                let seqs: Vec<Rollout> = pending
                    .iter()
                    .filter_map(|&i| samples[i].as_ref().map(|(_, r)| r.clone()))
                    .collect();
                for c in &consumers {
                    let Some(node) = plan.graph.node(*c) else {
                        continue;
                    };
                    let Some(m) = node.op.model() else { continue };
                    let Some((_, mm)) = others.iter().find(|(i, _)| *i == m as usize) else {
                        return Err(Error::invalid("plan", format!("{c}: model busy")));
                    };
                    let opts = InferOptions {
                        micro_batch: node.micro_batch.unwrap_or(plan.micro_batch).max(1) as usize,
                        temperature: temperature as f32,
                    };
                    let out = infer_per_sample(mm, &node.op, &seqs, &opts)?;
                    let dst = partial
                        .get_mut(c)
                        .ok_or_else(|| Error::invalid("plan", format!("{c}: no result buffer")))?;
                    for (&i, o) in pending.iter().zip(out) {
                        dst[i] = Some(o);
                    }
                }
                let start = t0.duration_since(t_gen).as_secs_f64();
                let end = t_gen.elapsed().as_secs_f64();
                stats.infer_seconds += end - start;
                stats.chunks.push((start, end));
                pending.clear();
                Ok(())
            };
            for item in rx.iter() {
                let sample = match item {
                    Ok(s) => s,
                    Err(e) => {
                        outcome = Err(e);
                        break;
                    }
                };
                let slot = sample.prompt_index * n + sample.sample_index;
                let r = Rollout::from_sample(&prompt_ids[sample.prompt_index], &sample);
                if slot < samples.len() {
                    samples[slot] = Some((sample, r));
                    pending.push(slot);
                }
                if pending.len() >= micro
                    && let Err(e) = run_chunk(&mut pending, &samples, &mut stats)
                {
                    outcome = Err(e);
                    break;
                }
            }
            drop(rx);
            let gen_seconds = handle.join().unwrap_or(0.0);
            stats.gen_seconds = gen_seconds;
            outcome?;
            run_chunk(&mut pending, &samples, &mut stats)?;
            // Inference is hidden under generation only where a chunk's interval overlaps the
            // generation thread's (which ends when it has handed over the last sample).
            stats.hidden_seconds = stats
                .chunks
                .iter()
                .map(|(a, b)| (b.min(gen_seconds) - a).max(0.0))
                .sum();
            Ok(())
        });
        result?;
        let mut out_samples = Vec::with_capacity(total);
        for (i, s) in samples.into_iter().enumerate() {
            let Some((sample, rollout)) = s else {
                return Err(Error::invalid(
                    "generation",
                    format!("sample {i} of the rollout never finished"),
                ));
            };
            out_samples.push(GenSample {
                prompt_index: sample.prompt_index,
                rollout,
                text: sample.text,
            });
        }
        let rollout = Arc::new(RolloutData {
            samples: out_samples,
            records: records.clone(),
            max_new_tokens: params.max_new_tokens,
            temperature,
        });
        let mut streamed = Vec::new();
        for (c, rows) in partial {
            let rows: Vec<PerSampleOut> = rows.into_iter().flatten().collect();
            if rows.len() != total {
                return Err(Error::invalid(
                    "plan",
                    format!("{c}: missing streamed results"),
                ));
            }
            let Some(node) = self.plan.graph.node(c) else {
                continue;
            };
            streamed.push((c, collect_rows(&node.op, rows)));
        }
        Ok((rollout, streamed, stats))
    }

    /// Trains a model on a rollout: `epochs` passes, each over `minibatches` optimizer steps,
    /// each accumulating gradients over micro-batches.
    #[allow(clippy::too_many_arguments)]
    fn train(
        &mut self,
        model: usize,
        r: &RolloutData,
        terms: &[LossTerm],
        epochs: i64,
        minibatches: i64,
        micro: usize,
        seed: u64,
    ) -> Result<Trained> {
        let n = r.samples.len();
        let mut stats: BTreeMap<String, f64> = BTreeMap::new();
        if n == 0 {
            return Ok((stats, None));
        }
        // The log-probabilities of the first forward pass over each sample, before any update
        // (what a reused `logprobs` node stands for).
        let mut own: Vec<Option<Vec<f32>>> = vec![None; n];
        let slot = &mut self.slots[model];
        let head = slot.model.head();
        let grad_clip = slot.spec.grad_clip;
        let Some(opt) = slot.opt.as_mut() else {
            return Err(Error::invalid(
                format!("model `{}`", slot.spec.name),
                "is trained but has no optimizer",
            ));
        };
        let per_mb = n.div_ceil(minibatches.max(1) as usize).max(1);
        let start_step = opt.step;
        let mut rng = Rng::new(seed);
        let mut loss_sum = 0.0;
        let mut norm_sum = 0.0;
        let mut opt_steps = 0usize;
        let mut clip_tok = 0.0;
        let mut ent_tok = 0.0;
        let mut tokens = 0.0;
        let mut lr = 0.0;
        for _ in 0..epochs.max(1) {
            let mut perm: Vec<usize> = (0..n).collect();
            rng.shuffle(&mut perm);
            for mb in perm.chunks(per_mb) {
                let mb_tokens: usize = mb
                    .iter()
                    .map(|&i| r.samples[i].rollout.completion.len())
                    .sum();
                let mut mb_loss = 0.0;
                for chunk in mb.chunks(micro) {
                    let seqs: Vec<&Rollout> =
                        chunk.iter().map(|&i| &r.samples[i].rollout).collect();
                    let lens: Vec<usize> = seqs.iter().map(|s| s.completion.len()).collect();
                    let t: usize = lens.iter().sum();
                    if t == 0 {
                        continue;
                    }
                    let layout = layout_for(&lens, mb_tokens, mb.len(), r.max_new_tokens);
                    let out = train_forward(&slot.model, &seqs, r.temperature, head)?;
                    if opt.step == start_step
                        && let Some(lp) = &out.logp
                    {
                        let flat: Vec<f32> = Vec::<f32>::try_from(
                            lp.detach().to_kind(Kind::Float).to_device(Device::Cpu),
                        )
                        .map_err(Error::Torch)?;
                        let mut at = 0;
                        for (&i, &l) in chunk.iter().zip(&lens) {
                            if own[i].is_none() {
                                own[i] = Some(flat[at..at + l].to_vec());
                            }
                            at += l;
                        }
                    }
                    let mut total: Option<Tensor> = None;
                    for term in terms {
                        let (l, s) = term_loss(term, &out, chunk, &layout)?;
                        clip_tok += s.clip_frac * t as f64;
                        total = Some(match total {
                            Some(x) => x + l,
                            None => l,
                        });
                    }
                    if let Some(total) = total {
                        mb_loss += total.double_value(&[]);
                        total.backward();
                    }
                    if let Some(e) = &out.entropy {
                        ent_tok += e.detach().sum(Kind::Float).double_value(&[]);
                    }
                    tokens += t as f64;
                }
                lr = opt.lr_at(opt.step, slot.total_opt_steps);
                let norm = opt.step(lr, grad_clip);
                norm_sum += norm;
                loss_sum += mb_loss;
                opt_steps += 1;
            }
        }
        if let Some(rep) = slot.replica.as_mut() {
            copy_weights(rep, &slot.model)?;
        }
        let k = opt_steps.max(1) as f64;
        stats.insert("loss".into(), loss_sum / k);
        stats.insert("grad_norm".into(), norm_sum / k);
        stats.insert("lr".into(), lr);
        if terms
            .iter()
            .any(|t| matches!(t.kind, LossKind::Ppo | LossKind::Grpo))
        {
            stats.insert("clip_frac".into(), clip_tok / tokens.max(1.0));
        }
        if head == Head::Lm {
            stats.insert("entropy".into(), ent_tok / tokens.max(1.0));
        }
        let own = own.into_iter().collect::<Option<Vec<_>>>();
        Ok((stats, own))
    }
}

/// `logprobs` nodes that need no inference pass: on a trained model, every consumer a loss
/// whose every consumer (directly or through `+`) is a `train` of that model on the same
/// rollout with one epoch and one mini-batch. That `train` takes a single optimizer step, so
/// its forward pass computes the model's log-probabilities before the update — exactly what
/// the node stands for (TRL does the same when the update is on-policy). The values are taken,
/// detached, from that forward pass; the node is filled in after the `train`.
fn reusable_logprobs(plan: &Plan) -> BTreeSet<NodeId> {
    let g = &plan.graph;
    let mut out = BTreeSet::new();
    for id in g.node_ids() {
        let Some(Op::Logprobs { model }) = g.node(id).map(|n| &n.op) else {
            continue;
        };
        let trained = plan
            .models
            .get(*model as usize)
            .is_some_and(|m| m.optimizer.is_some());
        let rollout = g.inputs(id).first().copied();
        let consumers = g.consumers(id);
        let trains_ok = |loss: NodeId| -> bool {
            // Follow loss sums to the trains.
            let mut frontier = vec![loss];
            let mut found = false;
            while let Some(n) = frontier.pop() {
                for c in g.consumers(n) {
                    match g.node(c).map(|x| &x.op) {
                        Some(Op::LossSum { .. }) => frontier.push(c),
                        Some(Op::Train {
                            model: m,
                            epochs: 1,
                            minibatches: 1,
                        }) if m == model && g.inputs(c).first().copied() == rollout => found = true,
                        _ => return false,
                    }
                }
            }
            found
        };
        if trained
            && !consumers.is_empty()
            && consumers.iter().all(|c| {
                matches!(g.node(*c).map(|x| &x.op), Some(Op::Loss { .. })) && trains_ok(*c)
            })
        {
            out.insert(id);
        }
    }
    out
}

/// The logprobs/values/score nodes that read a rollout directly and need an inference pass
/// (not reused from training): the consumers streamed under its generation.
fn streamed(
    plan: &Plan,
    generate: NodeId,
    reused: &BTreeSet<NodeId>,
    no_stream: &BTreeSet<NodeId>,
) -> Vec<NodeId> {
    plan.graph
        .consumers(generate)
        .into_iter()
        .filter(|c| {
            !reused.contains(c)
                && !no_stream.contains(c)
                && plan.graph.node(*c).is_some_and(|n| {
                    matches!(
                        n.op,
                        Op::Logprobs { .. } | Op::Values { .. } | Op::Score { .. }
                    )
                })
                && plan.graph.inputs(*c).first() == Some(&generate)
        })
        .collect()
}

/// A `train`'s metrics, and its model's log-probabilities before the update per sample (for
/// reused `logprobs` nodes).
type Trained = (BTreeMap<String, f64>, Option<Vec<Vec<f32>>>);

/// A rollout, the streamed consumers' results, and timings.
type Generated = (Arc<RolloutData>, Vec<(NodeId, Val)>, GenStats);

#[derive(Debug, Default)]
struct GenStats {
    gen_seconds: f64,
    infer_seconds: f64,
    /// Inference time spent while generation was still running.
    hidden_seconds: f64,
    /// Each streamed chunk's (start, end), in seconds from the start of generation.
    chunks: Vec<(f64, f64)>,
}

impl GenStats {
    fn hidden_share(&self) -> f64 {
        if self.infer_seconds <= 0.0 {
            0.0
        } else {
            self.hidden_seconds / self.infer_seconds
        }
    }
}

#[derive(Debug, Clone)]
enum PerSampleOut {
    Tokens(Vec<f32>),
    Scalar(f32),
}

fn infer_per_sample(
    model: &Model,
    op: &Op,
    seqs: &[Rollout],
    opts: &InferOptions,
) -> Result<Vec<PerSampleOut>> {
    Ok(match op {
        Op::Logprobs { .. } => infer::logprobs(model, seqs, opts)?
            .into_iter()
            .map(PerSampleOut::Tokens)
            .collect(),
        Op::Values { .. } => infer::values(model, seqs, opts)?
            .into_iter()
            .map(PerSampleOut::Tokens)
            .collect(),
        Op::Score { .. } => infer::score(model, seqs, opts)?
            .into_iter()
            .map(PerSampleOut::Scalar)
            .collect(),
        other => {
            return Err(Error::invalid(
                "plan",
                format!("`{}` is not an inference call", other.name()),
            ));
        }
    })
}

/// An inference node's value from its per-sample results: one number per sample for `score`,
/// per-token values otherwise.
fn collect_rows(op: &Op, rows: Vec<PerSampleOut>) -> Val {
    if let Op::Score { .. } = op {
        return Val::PerSample(
            rows.into_iter()
                .map(|r| match r {
                    PerSampleOut::Scalar(x) => f64::from(x),
                    PerSampleOut::Tokens(_) => 0.0,
                })
                .collect(),
        );
    }
    let rows: Vec<Vec<f32>> = rows
        .into_iter()
        .map(|r| match r {
            PerSampleOut::Tokens(t) => t,
            PerSampleOut::Scalar(x) => vec![x],
        })
        .collect();
    Val::PerToken(Tokens::from_rows(&rows))
}

fn rollout_of(vals: &BTreeMap<NodeId, Val>, id: Option<&NodeId>) -> Result<Arc<RolloutData>> {
    match id.and_then(|i| vals.get(i)) {
        Some(Val::Rollout(r)) => Ok(r.clone()),
        _ => Err(Error::invalid("plan", "input 0 is not a rollout")),
    }
}

fn run_kernel(
    k: &CompiledKernel,
    args: &[Operand],
    inputs: &[NodeId],
    vals: &BTreeMap<NodeId, Val>,
) -> Result<Val> {
    let r = rollout_of(vals, inputs.first())?;
    let lengths = r.lengths();
    let groups: Vec<i64> = r.samples.iter().map(|s| s.prompt_index as i64).collect();
    let texts: Vec<SampleText> = r
        .samples
        .iter()
        .map(|s| {
            let rec = r.records.get(s.prompt_index);
            SampleText {
                prompt: rec.map(|x| x.prompt.clone()).unwrap_or_default(),
                completion: s.text.clone(),
                answer: rec.map(|x| x.answer.clone()).unwrap_or_default(),
            }
        })
        .collect();
    let kernel = k.kernel();
    let mut kargs: Vec<Arg<'_>> = Vec::with_capacity(args.len());
    for (i, a) in args.iter().enumerate() {
        let kind = kernel.params.get(i).copied();
        kargs.push(match (a, kind) {
            (_, Some(ParamKind::Sample)) => Arg::Sample,
            (Operand::Const(c), Some(ParamKind::Scalar(t))) => match (c, t) {
                (Const::Int(x), ScalarTy::Int) => Arg::Int(*x),
                (Const::Bool(x), ScalarTy::Bool) => Arg::Bool(*x),
                (c, ScalarTy::Float) => Arg::Float(c.as_f64().unwrap_or(0.0)),
                (c, _) => {
                    return Err(Error::invalid(
                        "plan",
                        format!("constant {c} does not fit kernel parameter {i}"),
                    ));
                }
            },
            (Operand::Input(p), _) => match inputs.get(*p as usize).and_then(|n| vals.get(n)) {
                Some(Val::PerToken(t)) => Arg::PerToken(Ragged {
                    values: &t.values,
                    offsets: &t.offsets,
                }),
                Some(Val::PerSample(s)) => Arg::PerSample(s),
                Some(Val::Rollout(_)) => Arg::Sample,
                _ => {
                    return Err(Error::invalid(
                        "plan",
                        format!("kernel operand ${p} has no value"),
                    ));
                }
            },
            (Operand::Const(c), _) => {
                return Err(Error::invalid(
                    "plan",
                    format!("constant {c} passed to a non-scalar kernel parameter"),
                ));
            }
        });
    }
    let batch = Batch {
        n_samples: r.samples.len(),
        lengths: Some(&lengths),
        groups: Some(&groups),
        texts: Some(&texts),
    };
    let out = k
        .run(&batch, &kargs)
        .map_err(|e| Error::invalid(format!("fn `{}`", kernel.name), e.to_string()))?;
    Ok(match out {
        Output::PerSample(v) => Val::PerSample(v),
        Output::PerToken { values, offsets } => Val::PerToken(Tokens { values, offsets }),
    })
}

/// A value of an element-wise operation: per sample `i`, token `t`.
enum Elem<'a> {
    C(f64),
    S(&'a [f64]),
    T(&'a Tokens),
}

impl Elem<'_> {
    fn at(&self, i: usize, t: usize) -> f64 {
        match self {
            Elem::C(c) => *c,
            Elem::S(s) => s.get(i).copied().unwrap_or(0.0),
            Elem::T(tk) => tk.row(i).get(t).copied().unwrap_or(0.0),
        }
    }
}

fn elem<'a>(a: &Operand, inputs: &[NodeId], vals: &'a BTreeMap<NodeId, Val>) -> Result<Elem<'a>> {
    Ok(match a {
        Operand::Const(c) => Elem::C(
            c.as_f64()
                .ok_or_else(|| Error::invalid("plan", format!("{c} is not a number")))?,
        ),
        Operand::Input(p) => match inputs.get(*p as usize).and_then(|n| vals.get(n)) {
            Some(Val::PerSample(s)) => Elem::S(s),
            Some(Val::PerToken(t)) => Elem::T(t),
            _ => return Err(Error::invalid("plan", format!("operand ${p} has no value"))),
        },
    })
}

fn arith(
    op: ArithOp,
    args: &[Operand],
    inputs: &[NodeId],
    vals: &BTreeMap<NodeId, Val>,
) -> Result<Val> {
    let r = rollout_of(vals, inputs.first())?;
    let es: Vec<Elem<'_>> = args
        .iter()
        .map(|a| elem(a, inputs, vals))
        .collect::<Result<_>>()?;
    let f = |i: usize, t: usize| -> f64 {
        let a = es[0].at(i, t);
        let b = es.get(1).map_or(0.0, |e| e.at(i, t));
        match op {
            ArithOp::Add => a + b,
            ArithOp::Sub => a - b,
            ArithOp::Mul => a * b,
            ArithOp::Div => a / b,
            ArithOp::Neg => -a,
        }
    };
    let n = r.samples.len();
    if es.iter().any(|e| matches!(e, Elem::T(_))) {
        let mut values = Vec::new();
        let mut offsets = vec![0];
        for (i, len) in r.lengths().into_iter().enumerate() {
            for t in 0..len {
                values.push(f(i, t));
            }
            offsets.push(values.len());
        }
        Ok(Val::PerToken(Tokens { values, offsets }))
    } else {
        Ok(Val::PerSample((0..n).map(|i| f(i, 0)).collect()))
    }
}

fn by_prompt(inputs: &[NodeId], vals: &BTreeMap<NodeId, Val>) -> Result<Val> {
    let like = rollout_of(vals, inputs.first())?;
    let from = rollout_of(vals, inputs.get(2))?;
    let Some(Val::PerSample(v)) = inputs.get(1).and_then(|n| vals.get(n)) else {
        return Err(Error::invalid("plan", "by_prompt needs a per-sample value"));
    };
    let mut first_of: BTreeMap<usize, f64> = BTreeMap::new();
    for (i, s) in from.samples.iter().enumerate() {
        first_of
            .entry(s.prompt_index)
            .or_insert(v.get(i).copied().unwrap_or(0.0));
    }
    let mut out = Vec::with_capacity(like.samples.len());
    for s in &like.samples {
        out.push(first_of.get(&s.prompt_index).copied().ok_or_else(|| {
            Error::invalid(
                "by_prompt",
                format!(
                    "prompt {} has no sample in the other rollout",
                    s.prompt_index
                ),
            )
        })?);
    }
    Ok(Val::PerSample(out))
}

fn mean_std(x: &[f64]) -> (f64, f64) {
    if x.is_empty() {
        return (0.0, 0.0);
    }
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// The generated lengths as a histogram in the planner's format (`LEN COUNT` per line, `#`
/// comments): `braid plan FILE --gen-lengths RUN_DIR/lengths.txt` plans with the observed
/// distribution.
fn length_histogram(lengths: &[usize]) -> String {
    let mut counts: BTreeMap<usize, u64> = BTreeMap::new();
    for &l in lengths {
        *counts.entry(l.max(1)).or_default() += 1;
    }
    let mut out = format!(
        "# generated lengths of the policy's rollouts: {} samples (LEN COUNT)\n",
        lengths.len()
    );
    for (l, c) in counts {
        out.push_str(&format!("{l} {c}\n"));
    }
    out
}

/// What identifies a run's program: its graph and settings.
pub fn fingerprint(plan: &Plan) -> String {
    let mut text = plan.graph_text();
    for (k, v) in &plan.settings {
        text.push_str(&format!("{k}={v}\n"));
    }
    text.push_str(&format!("seed={}\n", plan.seed));
    for m in &plan.models {
        text.push_str(&format!("{m:?}\n"));
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// The model's outputs on a micro-batch, with autograd.
struct TrainOut {
    /// Log-probabilities of the completion tokens `[T]` (language models).
    logp: Option<Tensor>,
    /// Per-token entropy `[T]`, detached unless an entropy bonus needs it.
    entropy: Option<Tensor>,
    /// Values at the completion tokens `[T]` (critics).
    values: Option<Tensor>,
}

fn train_forward(
    model: &Model,
    seqs: &[&Rollout],
    temperature: f64,
    head: Head,
) -> Result<TrainOut> {
    let (ids, mask) = infer::pad_batch(seqs, 0, model.device());
    let hidden = model.hidden_states(&ids, Some(&mask));
    let mut rows = Vec::new();
    let mut cols = Vec::new();
    let mut targets = Vec::new();
    for (b, r) in seqs.iter().enumerate() {
        let p = r.prompt.len() as i64;
        for (i, &tok) in r.completion.iter().enumerate() {
            rows.push(b as i64);
            cols.push(p - 1 + i as i64);
            targets.push(tok);
        }
    }
    let dev = model.device();
    let h = hidden.index(&[
        Some(Tensor::from_slice(&rows).to_device(dev)),
        Some(Tensor::from_slice(&cols).to_device(dev)),
    ]);
    match head {
        Head::Lm => {
            let logits = model.apply_head(&h).to_kind(Kind::Float) / temperature.max(1e-6);
            let lsm = logits.log_softmax(-1, Kind::Float);
            let tgt = Tensor::from_slice(&targets).to_device(dev).unsqueeze(1);
            let logp = lsm.gather(1, &tgt, false).squeeze_dim(1);
            // With gradients: PPO's entropy bonus differentiates through it.
            let entropy = -(lsm.exp() * &lsm).sum_dim_intlist(-1, false, Kind::Float);
            Ok(TrainOut {
                logp: Some(logp),
                entropy: Some(entropy),
                values: None,
            })
        }
        Head::Value => Ok(TrainOut {
            logp: None,
            entropy: None,
            values: Some(model.apply_head(&h).to_kind(Kind::Float)),
        }),
        Head::Score => Err(Error::invalid(
            "train",
            "a reward model (score head) cannot be trained by an RL loss",
        )),
    }
}

fn layout_for(lens: &[usize], mb_tokens: usize, mb_samples: usize, max_new: i64) -> Layout {
    let mut sample_of = Vec::new();
    let mut inv = Vec::new();
    for (i, &l) in lens.iter().enumerate() {
        for _ in 0..l {
            sample_of.push(i as i64);
            inv.push(1.0 / l as f64);
        }
    }
    Layout {
        sample_of: Tensor::from_slice(&sample_of),
        inv_len: Tensor::from_slice(&inv).to_kind(Kind::Float),
        minibatch_tokens: mb_tokens as f64,
        minibatch_samples: mb_samples as f64,
        max_new_tokens: max_new as f64,
    }
}

/// A per-token operand for the samples `chunk` (indices into the rollout): per-token values as
/// they are, per-sample values broadcast over the sample's tokens.
fn token_tensor(arg: &LossArg, chunk: &[usize], lens: &Layout, device: Device) -> Result<Tensor> {
    let mut out: Vec<f32> = Vec::new();
    match arg {
        LossArg::Tokens(t) => {
            for &i in chunk {
                out.extend(t.row(i).iter().map(|&x| x as f32));
            }
        }
        LossArg::Samples(s) => {
            return Ok(
                Tensor::from_slice(&chunk.iter().map(|&i| s[i] as f32).collect::<Vec<_>>())
                    .to_device(device)
                    .index_select(0, &lens.sample_of.to_device(device)),
            );
        }
        LossArg::Const(c) => {
            return Err(Error::invalid(
                "loss",
                format!("a constant {c} where per-token values are needed"),
            ));
        }
        LossArg::CurrentLogp => {
            return Err(Error::invalid(
                "loss",
                "the model's own log-probabilities are resolved by the caller",
            ));
        }
    }
    Ok(Tensor::from_slice(&out).to_device(device))
}

fn const_f(arg: Option<&LossArg>, what: &str) -> Result<f64> {
    match arg {
        Some(LossArg::Const(c)) => c
            .as_f64()
            .ok_or_else(|| Error::invalid("loss", format!("`{what}` must be a number"))),
        _ => Err(Error::invalid(
            "loss",
            format!("`{what}` must be a constant"),
        )),
    }
}

fn const_s<'a>(arg: Option<&'a LossArg>, what: &str) -> Result<&'a str> {
    match arg {
        Some(LossArg::Const(Const::Str(s))) => Ok(s),
        _ => Err(Error::invalid("loss", format!("`{what}` must be a string"))),
    }
}

/// One loss term on a micro-batch.
fn term_loss(
    term: &LossTerm,
    out: &TrainOut,
    chunk: &[usize],
    layout: &Layout,
) -> Result<(Tensor, loss::PolicyStats)> {
    let a = &term.args;
    let need_logp = || {
        out.logp.as_ref().ok_or_else(|| {
            Error::invalid(
                "loss",
                format!("`{}` needs a language model", term.kind.as_str()),
            )
        })
    };
    let dev = match (&out.logp, &out.values) {
        (Some(t), _) | (_, Some(t)) => t.device(),
        _ => Device::Cpu,
    };
    let tok = |i: usize| -> Result<Tensor> {
        let arg = a
            .get(i)
            .ok_or_else(|| Error::invalid("loss", "missing operand"))?;
        if let LossArg::CurrentLogp = arg {
            return Ok(need_logp()?.detach());
        }
        token_tensor(arg, chunk, layout, dev)
    };
    match term.kind {
        LossKind::Ppo => {
            let logp = need_logp()?;
            let (old, adv) = (tok(0)?, tok(1)?);
            let clip = const_f(a.get(2), "clip")?;
            let dual = const_f(a.get(3), "dual_clip")?;
            let ent_coef = const_f(a.get(4), "entropy_coef")?;
            let agg = Agg::parse(const_s(a.get(5), "agg")?).ok_or_else(|| {
                Error::invalid(
                    "ppo_loss",
                    "`agg` must be \"token\", \"sequence\" or \"sum\"",
                )
            })?;
            let (mut per, stats) = loss::ppo_per_token(logp, &old, &adv, clip, dual);
            if ent_coef != 0.0 {
                let ent = out.entropy.as_ref().ok_or_else(|| {
                    Error::invalid("ppo_loss", "the entropy bonus needs a language model")
                })?;
                per -= ent * ent_coef;
            }
            Ok((layout.aggregate(&per, agg), stats))
        }
        LossKind::Grpo => {
            let logp = need_logp()?;
            let (old, reflp, adv) = (tok(0)?, tok(1)?, tok(2)?);
            let clip = const_f(a.get(3), "clip")?;
            let kl_coef = const_f(a.get(4), "kl_coef")?;
            let est = const_s(a.get(5), "kl_estimator")?;
            let variant = const_s(a.get(6), "variant")?;
            let (per, stats) = loss::ppo_per_token(logp, &old, &adv, clip, 0.0);
            let per = if kl_coef != 0.0 {
                per + loss::kl(logp, &reflp, est) * kl_coef
            } else {
                per
            };
            let agg = if variant == "dr_grpo" {
                Agg::Sum
            } else {
                Agg::Sequence
            };
            Ok((layout.aggregate(&per, agg), stats))
        }
        LossKind::Kl => {
            let logp = need_logp()?;
            let reflp = tok(0)?;
            let coef = const_f(a.get(1), "coef")?;
            let est = const_s(a.get(2), "estimator")?;
            let per = loss::kl(logp, &reflp, est) * coef;
            Ok((
                layout.aggregate(&per, Agg::Token),
                loss::PolicyStats::default(),
            ))
        }
        LossKind::Value => {
            let v = out
                .values
                .as_ref()
                .ok_or_else(|| Error::invalid("value_loss", "needs a model with a value head"))?;
            let (old, ret) = (tok(0)?, tok(1)?);
            let clip = const_f(a.get(2), "clip")?;
            let coef = const_f(a.get(3), "coef")?;
            let per = loss::value_per_token(v, &old, &ret, clip) * coef;
            Ok((
                layout.aggregate(&per, Agg::Token),
                loss::PolicyStats::default(),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(src: &str) -> Plan {
        let checked = braid_sema::check("t.rlhf", src, &braid_sema::NoImports);
        assert!(!checked.has_errors(), "{:?}", checked.diagnostics);
        braid_sema::lower_graph::lower_run(&checked.program).unwrap()
    }

    const MODELS: &str = "model policy = tiny(vocab: \"bytes\", layers: 1, hidden: 32, heads: 2) {\n  train: adamw(lr: 1e-3)\n}\nmodel critic = tiny(vocab: \"bytes\", layers: 1, hidden: 32, heads: 2) {\n  head: value\n  train: adamw(lr: 1e-3)\n}\ndataset d = synthetic::letters(count: 8)\nfn r(s: Sample) -> float { len(s.completion) }\n";

    fn reused_labels(p: &Plan) -> Vec<String> {
        reusable_logprobs(p)
            .into_iter()
            .map(|n| p.graph.node(n).unwrap().label.clone().unwrap_or_default())
            .collect()
    }

    /// The policy's own log-probabilities come from its training forward pass only when the
    /// update is a single optimizer step and nothing but the loss reads them.
    #[test]
    fn on_policy_logprobs_are_reused_only_when_exact() {
        let one = plan(&format!(
            "use std::grpo\n{MODELS}run grpo(policy, d, reward: r) {{\n  steps: 1\n  batch: 2\n  group: 2\n}}\n"
        ));
        assert_eq!(reused_labels(&one), vec!["old_logp".to_string()]);
        let epochs = plan(&format!(
            "use std::grpo\n{MODELS}run grpo(policy, d, reward: r) {{\n  steps: 1\n  batch: 2\n  group: 2\n  epochs: 2\n}}\n"
        ));
        assert!(reused_labels(&epochs).is_empty());
        let minibatches = plan(&format!(
            "use std::grpo\n{MODELS}run grpo(policy, d, reward: r) {{\n  steps: 1\n  batch: 2\n  group: 2\n  minibatches: 2\n}}\n"
        ));
        assert!(reused_labels(&minibatches).is_empty());
        // PPO shapes rewards with old_logp (a kernel reads it): computed by inference.
        let ppo = plan(&format!(
            "use std::ppo\n{MODELS}run ppo_fn(policy, d, reward: r, critic: critic) {{\n  steps: 1\n  batch: 2\n  minibatches: 1\n}}\n"
        ));
        assert!(reused_labels(&ppo).is_empty());
    }
}
