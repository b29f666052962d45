//! Setting a run up: building each model from its source (frozen copies included),
//! replicas for generation, and which `logprobs` nodes are reused from training or streamed
//! under generation.

use super::*;

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
}

pub(super) fn kind_of(spec: &ModelSpec, device: Device) -> Kind {
    match spec.dtype {
        Some(d) => crate::models::model::kind_of(d),
        None if device == Device::Cpu => Kind::Float,
        None => Kind::BFloat16,
    }
}

/// Builds a model from its source (following frozen copies to the model they copy).
pub(super) fn build_model(
    plan: &Plan,
    slot: usize,
    base_dir: &Path,
    device: Device,
) -> Result<(Model, Tokenizer)> {
    let spec = &plan.models[slot];
    let head = spec.head;
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
pub(super) fn copy_weights(dst: &mut Model, src: &Model) -> Result<()> {
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

/// `logprobs` nodes that need no inference pass: on a trained model, every consumer a loss
/// whose every consumer is a `train` of that model on the same rollout with one epoch and one
/// mini-batch. That `train` takes a single optimizer step, so
/// its forward pass computes the model's log-probabilities before the update — exactly what
/// the node stands for (TRL does the same when the update is on-policy). The values are taken,
/// detached, from that forward pass; the node is filled in after the `train`.
pub(super) fn reusable_logprobs(plan: &Plan) -> BTreeSet<NodeId> {
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
            let trains = g.consumers(loss);
            !trains.is_empty()
                && trains.iter().all(|c| {
                    matches!(g.node(*c).map(|x| &x.op), Some(Op::Train {
                        model: m,
                        epochs: 1,
                        minibatches: 1,
                    }) if m == model && g.inputs(*c).first().copied() == rollout)
                })
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
pub(super) fn streamed(
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
