//! Setting a run up: checking that the plan is for the world it runs in, building each model
//! from its source (frozen copies included) in the plan's dtype, replicas for generation,
//! datasets and kernels.

use super::*;

impl<'p> Executor<'p> {
    /// Builds the models, loads the data, compiles the kernels, and restores the latest
    /// checkpoint when resuming.
    pub fn new(exec: &'p ExecPlan, options: RunOptions) -> Result<Executor<'p>> {
        let world = options.dist.as_ref().map_or(1, |d| d.world.size);
        let rank = options.dist.as_ref().map_or(0, |d| d.world.rank);
        check_world(exec, options.device, world)?;
        if options.alternate_streaming {
            check_alternating(exec)?;
        }
        let plan = &exec.plan;
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
        // Optimizer steps per train node and per model, for the schedules; and which models
        // this rank holds (those with a call here) and trains (those with a `train` here).
        let mut opt_steps: BTreeMap<u32, i64> = BTreeMap::new();
        let mut here: BTreeSet<u32> = BTreeSet::new();
        let mut trains_here: BTreeSet<u32> = BTreeSet::new();
        let reused: BTreeSet<NodeId> = exec.decisions.reused_logprobs.keys().copied().collect();
        for id in &order {
            let Some(node) = plan.graph.node(*id) else {
                continue;
            };
            let on_rank = |id: NodeId| {
                exec.placement(id)
                    .is_some_and(|p| p.devices().contains(&(rank as u64)))
            };
            if let (Some(m), true) = (node.op.model(), on_rank(*id)) {
                here.insert(m);
            }
            if let Op::Train {
                model,
                epochs,
                minibatches,
            } = &node.op
            {
                *opt_steps.entry(*model).or_default() += epochs * minibatches * total_steps;
                if on_rank(*id) {
                    trains_here.insert(*model);
                }
            }
        }
        // Which share of each model this rank's calls run on (the whole model, a pipeline
        // stage of a training, either cut for tensor parallelism), and the one it trains on.
        let mut shares: BTreeMap<u32, BTreeSet<Share>> = BTreeMap::new();
        let mut train_share: BTreeMap<u32, Share> = BTreeMap::new();
        for id in &order {
            let Some(node) = plan.graph.node(*id) else {
                continue;
            };
            let (Some(m), Some(p)) = (node.op.model(), exec.placement(*id)) else {
                continue;
            };
            let is_train = matches!(node.op, Op::Train { .. });
            if p.pp > 1 && matches!(node.op, Op::Generate { .. }) {
                return Err(Error::invalid(
                    "plan",
                    format!(
                        "{} generates through {} pipeline stages; this runtime generates without pipeline parallelism: plan it with a `place` pin of `pp 1`",
                        id, p.pp
                    ),
                ));
            }
            if p.pp > 1
                && exec
                    .plan
                    .graph
                    .node_ids()
                    .iter()
                    .any(|g| exec.streamed(*g).iter().any(|(c, _)| c == id))
            {
                return Err(Error::invalid(
                    "plan",
                    format!(
                        "{} streams under generation through {} pipeline stages; this runtime streams only calls without pipeline parallelism (the planner does not stream them)",
                        id, p.pp
                    ),
                ));
            }
            let Some(share) = comm::share_at(exec, *id, rank)? else {
                continue;
            };
            shares.entry(m).or_default().insert(share);
            if is_train
                && let Some(old) = train_share.insert(m, share)
                && old != share
            {
                return Err(Error::invalid(
                    "plan",
                    format!(
                        "model `{}` trains in two layouts on rank {rank}; this runtime trains a model in one",
                        plan.models[m as usize].name
                    ),
                ));
            }
        }
        // The generation replicas (a copy to generate on while streamed inference uses the
        // model's own), and the groups of every tensor-parallel copy, on every rank alike.
        let replicas = generation_replicas(exec, world)?;
        let tp_copies = tp_copies(exec, world, &replicas)?;
        let comm = match &options.dist {
            Some(d) if d.world.size > 1 => Comm::connect(exec, d, &tp_copies)?,
            _ => Comm::single(),
        };
        let mut slots = Vec::new();
        for (i, spec) in plan.models.iter().enumerate() {
            let slot = i as u32;
            let kind = kind_of(spec)?;
            let trained = trains_here.contains(&slot);
            let mine = shares.get(&slot).cloned().unwrap_or_default();
            let home = train_share
                .get(&slot)
                .copied()
                .or_else(|| mine.iter().next().copied())
                .unwrap_or(Share::WHOLE);
            let cut = |mut m: Model, s: Share, replica: bool| -> Result<Model> {
                if s.stages > 1 {
                    m.retain_stage(s.stage as usize, s.stages as usize)?;
                }
                if s.tp > 1 {
                    m = m.shard(comm.tensor_parallel(&(slot, s, replica))?)?;
                }
                Ok(m)
            };
            let (model, tokenizer, opt) = match (&spec.optimizer, trained, here.contains(&slot)) {
                (Some(c), true, true) => {
                    // Mixed precision: the source is read in f32 (its own precision, or more),
                    // those values become the optimizer's f32 masters, and the model computes
                    // on a copy rounded once into its dtype.
                    let (model, tokenizer) =
                        build_model(plan, i, &options.base_dir, options.device, Kind::Float)?;
                    let mut model = cut(model, home, false)?;
                    let opt = if kind == Kind::Float {
                        AdamW::new(&model, c.clone())?
                    } else {
                        let masters = model.convert_keeping_masters(kind)?;
                        AdamW::with_masters(&model, c.clone(), masters)?
                    };
                    (Some(model), tokenizer, Some(opt))
                }
                (None, true, _) => {
                    return Err(Error::invalid(
                        format!("model `{}`", spec.name),
                        "is trained but declares no `train:` optimizer",
                    ));
                }
                // Frozen models hold their dtype's weights only; a rank without a call of the
                // model holds only its tokenizer.
                (_, _, true) => {
                    let (model, tokenizer) =
                        build_model(plan, i, &options.base_dir, options.device, kind)?;
                    (Some(cut(model, home, false)?), tokenizer, None)
                }
                _ => (None, build_tokenizer(plan, i, &options.base_dir)?, None),
            };
            let mut views = BTreeMap::new();
            if model.is_some() {
                for &s in mine.iter().filter(|s| **s != home) {
                    let (m, _) = build_model(plan, i, &options.base_dir, options.device, kind)?;
                    views.insert(s, cut(m, s, false)?);
                }
            }
            // The generation replica: the generation's share, in the model's dtype, with the
            // values of that share's copy.
            let mut replica = None;
            let replica_share = replicas.get(&(slot, rank)).copied().unwrap_or(Share::WHOLE);
            if model.is_some() && replicas.contains_key(&(slot, rank)) {
                let (m, _) = build_model(plan, i, &options.base_dir, options.device, kind)?;
                let r = cut(m, replica_share, true)?;
                let src = if replica_share == home {
                    model.as_ref()
                } else {
                    views.get(&replica_share)
                };
                let src = src.ok_or_else(|| {
                    Error::invalid(
                        format!("model `{}`", spec.name),
                        "generates on a copy this rank does not hold",
                    )
                })?;
                copy_weights(&r, src)?;
                replica = Some(r);
            }
            slots.push(Slot {
                spec: spec.clone(),
                model,
                home,
                views,
                tokenizer,
                opt,
                total_opt_steps: opt_steps.get(&slot).copied().unwrap_or(0),
                replica,
                replica_stale: false,
                replica_share,
                pipeline: None,
            });
        }
        let retokenize = token_readers(plan, &order, &slots)?;
        if world > 1 && plan.eval.is_some() {
            return Err(Error::invalid(
                "eval",
                "evaluation during training runs in one process only for now; run without `eval`, or evaluate a checkpoint with `braid run --eval-only`",
            ));
        }
        if !exec.decisions.interleave.is_empty() && world <= 1 {
            return Err(Error::invalid(
                "plan",
                "interleaves two pipeline-parallel trainings, which needs their ranks: run it under `braid launch`",
            ));
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
        let main_rollout = plan.main_rollout();
        let reward_node = plan.reward_node();
        if options.gen_lengths.is_some()
            && let Some((id, _)) = exec
                .decisions
                .speculation
                .iter()
                .find(|(_, d)| d.pinned && d.run != braid_ir::graph::Speculation::Off)
        {
            return Err(Error::invalid(
                "--gen-lengths",
                format!(
                    "{id} pins speculative decoding, which imposed lengths do not combine with \
                     (verification would have to mask end-of-sequence tokens too); drop the \
                     `speculate` pin or --gen-lengths"
                ),
            ));
        }
        let options_kv = options.migrate_kv;
        let gen_lengths = options.gen_lengths.is_some();
        let realloc = !options.no_realloc;
        let mut ex = Executor {
            exec,
            plan,
            options,
            comm,
            slots,
            datasets,
            cursors: vec![0; plan.datasets.len()],
            kernels,
            order,
            main_rollout,
            reward_node,
            reused,
            retokenize,
            total_steps,
            first_step: 0,
            last_samples: Vec::new(),
            timeline: Vec::new(),
            infer_pipes: BTreeMap::new(),
            release_after: BTreeMap::new(),
            tails: migrate::tail_states(exec, options_kv, gen_lengths, realloc)?,
            tail_round: 0,
            deferred_transfers: BTreeMap::new(),
            step_started: 0.0,
            streams_off: false,
        };
        ex.connect_pipelines()?;
        ex.release_after = ex.last_uses()?;
        if ex.options.resume {
            ex.restore()?;
        }
        Ok(ex)
    }

    /// Creates this rank's stage of every pipeline-parallel training it takes part in, and of
    /// every training of a fused schedule (a pipeline of one stage when its `pp` is 1), in plan
    /// order on every rank (each pipeline's links are groups of its neighbouring stages).
    fn connect_pipelines(&mut self) -> Result<()> {
        for id in self.order.clone() {
            if let (Some(op), Some(p)) = (
                self.plan.graph.node(id).map(|n| &n.op),
                self.exec.placement(id),
            ) && matches!(
                op,
                Op::Logprobs { .. } | Op::Values { .. } | Op::Score { .. }
            ) && p.pp > 1
                && !self.reused.contains(&id)
            {
                self.connect_inference(id, op.model().unwrap_or(0) as usize, p)?;
                continue;
            }
            let (Some(Op::Train { model, .. }), Some(p)) = (
                self.plan.graph.node(id).map(|n| &n.op),
                self.exec.placement(id),
            ) else {
                continue;
            };
            let fused = self
                .exec
                .decisions
                .interleave
                .iter()
                .any(|f| f.forward == id || f.reverse == id);
            if p.pp <= 1 && !fused {
                continue;
            }
            let seats = comm::seating(self.exec, id)?;
            for k in 0..p.dp {
                let Some(ranks) = (0..p.tp)
                    .map(|t| comm::lane_ranks(p, &seats, k, t))
                    .find(|lane| lane.contains(&self.comm.rank))
                else {
                    continue;
                };
                let Some(world) = self.comm.world() else {
                    return Err(Error::invalid(
                        "plan",
                        format!(
                            "{id} trains in a pipeline of {} stages in one process",
                            p.pp
                        ),
                    ));
                };
                let slot = &mut self.slots[*model as usize];
                if slot.pipeline.is_some() {
                    return Err(Error::invalid(
                        format!("model `{}`", slot.spec.name),
                        "trains in two pipelines on one rank; this runtime trains a model in one",
                    ));
                }
                let pipe = crate::models::pipeline::Pipeline::new(world, &ranks, slot.model()?)?;
                slot.pipeline = Some(pipe);
            }
        }
        Ok(())
    }

    /// Per model call, the views (copies other than a model's training copy) whose last use in
    /// an iteration it is. Every view is refilled by the reshard into it before its next use
    /// (the planner puts one between any two calls of a model in different layouts, and one
    /// back to the first call for the next iteration); a view that is not makes its next call
    /// an error instead of running on freed weights.
    fn last_uses(&self) -> Result<BTreeMap<NodeId, Vec<(usize, Share)>>> {
        let mut last: BTreeMap<(usize, Share), NodeId> = BTreeMap::new();
        for id in &self.order {
            let Some(node) = self.plan.graph.node(*id) else {
                continue;
            };
            let (Some(m), true) = (node.op.model(), node.op.is_model_call()) else {
                continue;
            };
            if self.reused.contains(id) {
                continue;
            }
            let Some(share) = self.share_of(*id)? else {
                continue;
            };
            if self.slots[m as usize].views.contains_key(&share) {
                last.insert((m as usize, share), *id);
            }
        }
        let mut out: BTreeMap<NodeId, Vec<(usize, Share)>> = BTreeMap::new();
        for (k, id) in last {
            out.entry(id).or_default().push(k);
        }
        Ok(out)
    }

    /// This rank's stage of inference call `id` through pipeline stages (on `p`), if any.
    fn connect_inference(
        &mut self,
        id: NodeId,
        model: usize,
        p: &braid_ir::exec_plan::Placement,
    ) -> Result<()> {
        let Some(share) = comm::share_at(self.exec, id, self.comm.rank)? else {
            return Ok(());
        };
        let Some(c) = p.coords(self.comm.rank as u64) else {
            return Ok(());
        };
        let lane = comm::lane_ranks(p, &BTreeMap::new(), c.dp, c.tp);
        let Some(world) = self.comm.world() else {
            return Err(Error::invalid(
                "plan",
                format!("{id} runs through {} pipeline stages in one process", p.pp),
            ));
        };
        let m = self.slots[model].copy(share)?;
        let pipe = crate::models::pipeline::Pipeline::new(world, &lane, m)?;
        self.infer_pipes.insert(id, pipe);
        Ok(())
    }

    /// The step the run starts at (0, or the checkpoint's step when resuming).
    pub fn first_step(&self) -> i64 {
        self.first_step
    }

    pub fn total_steps(&self) -> i64 {
        self.total_steps
    }

    /// The reward models that score re-tokenised text because their tokenizer differs from the
    /// generating model's, by name (what `braid run` reports at start).
    pub fn retokenizing_models(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .retokenize
            .iter()
            .filter_map(|id| self.plan.graph.node(*id).and_then(|n| n.op.model()))
            .filter_map(|m| self.slots.get(m as usize).map(|s| s.spec.name.clone()))
            .collect();
        names.dedup();
        names
    }

    /// Per `generate`, the inference calls that stream under it, with the finished samples
    /// each takes per forward pass (as the plan says).
    pub fn streaming(&self) -> Vec<(NodeId, Vec<(NodeId, u64)>)> {
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
            .map(|g| (g, self.exec.streamed(g)))
            .collect()
    }
}

/// The generation replicas of the run, by (model, rank): a model that generates while a
/// streamed consumer runs on the same copy of it gets a second copy to generate on (two
/// threads cannot share one model), of the generation's share — on every such rank, whether
/// or not it trains the model (a rank that only generates and scores its samples needs one
/// too; reshards into the share refresh it). The tensor-parallel ranks of a
/// generation decide together: if one needs a replica, all generate on one, so that they issue
/// their collectives on the same group.
fn generation_replicas(exec: &ExecPlan, world: usize) -> Result<BTreeMap<(u32, usize), Share>> {
    let g = &exec.plan.graph;
    let mut out: BTreeMap<(u32, usize), Share> = BTreeMap::new();
    for id in g.topo_order().unwrap_or_else(|| g.node_ids()) {
        let Some(Op::Generate { model, .. }) = g.node(id).map(|n| &n.op) else {
            continue;
        };
        let m = *model;
        let mut needed: BTreeSet<Share> = BTreeSet::new();
        for r in 0..world {
            let Some(gs) = comm::share_at(exec, id, r)? else {
                continue;
            };
            let mut same = false;
            for (c, _) in exec.streamed(id) {
                if g.node(c).and_then(|n| n.op.model()) == Some(m)
                    && comm::share_at(exec, c, r)? == Some(gs)
                {
                    same = true;
                }
            }
            if same {
                needed.insert(gs);
            }
        }
        for gs in needed {
            let ranks = if gs.tp > 1 {
                gs.tp_ranks()
            } else {
                (0..world)
                    .filter(|r| comm::share_at(exec, id, *r).ok().flatten() == Some(gs))
                    .collect()
            };
            for r in ranks {
                if let Some(old) = out.insert((m, r), gs)
                    && old != gs
                {
                    return Err(Error::invalid(
                        "plan",
                        format!(
                            "model `{}` generates in two layouts on rank {r} while streamed inference runs on it; this runtime keeps one generation copy per model",
                            exec.plan.models[m as usize].name
                        ),
                    ));
                }
            }
        }
    }
    Ok(out)
}

/// Every tensor-parallel copy of a model some rank holds (a call's share with `tp > 1`, and
/// generation replicas of such shares), sorted: the order every rank creates their groups in.
fn tp_copies(
    exec: &ExecPlan,
    world: usize,
    replicas: &BTreeMap<(u32, usize), Share>,
) -> Result<Vec<comm::TpCopy>> {
    let g = &exec.plan.graph;
    let mut out: BTreeSet<comm::TpCopy> = BTreeSet::new();
    for id in g.node_ids() {
        let Some(m) = g.node(id).and_then(|n| n.op.model()) else {
            continue;
        };
        if !g.node(id).is_some_and(|n| n.op.is_model_call()) {
            continue;
        }
        for r in 0..world {
            if let Some(s) = comm::share_at(exec, id, r)?
                && s.tp > 1
            {
                out.insert((m, s, false));
            }
        }
    }
    for ((m, _), s) in replicas {
        if s.tp > 1 {
            out.insert((*m, *s, true));
        }
    }
    Ok(out.into_iter().collect())
}

/// Checks that every model reading a rollout's token ids can: a `logprobs` or `values` call
/// must share the vocabulary of the model that generated the rollout (its numbers are per
/// token), while a reward model with another vocabulary scores the decoded text re-tokenised
/// (`tokens.rs`). Returns those `score` calls.
fn token_readers(plan: &Plan, order: &[NodeId], slots: &[Slot]) -> Result<BTreeSet<NodeId>> {
    let mut retokenize = BTreeSet::new();
    for id in order {
        let Some(node) = plan.graph.node(*id) else {
            continue;
        };
        let (Op::Logprobs { model } | Op::Values { model } | Op::Score { model }) = &node.op else {
            continue;
        };
        let generator =
            plan.graph
                .inputs(*id)
                .first()
                .and_then(|r| match plan.graph.node(*r).map(|n| &n.op) {
                    Some(Op::Generate { model, .. }) => Some(*model),
                    _ => None,
                });
        let (Some(reader), Some(writer)) = (
            slots.get(*model as usize),
            generator.and_then(|g| slots.get(g as usize)),
        ) else {
            continue;
        };
        if reader.tokenizer.same_vocabulary(&writer.tokenizer) {
            continue;
        }
        if let Op::Score { .. } = node.op {
            retokenize.insert(*id);
            continue;
        }
        return Err(Error::invalid(
            format!("model `{}`", reader.spec.name),
            format!(
                "reads the tokens of `{w}`'s rollouts (`{op}`), but its tokenizer ({rt}) has another vocabulary than `{w}`'s ({wt}); per-token log-probabilities and values must line up with the generated tokens, so a reference model or a critic must share the policy's tokenizer (only a reward model, read through `score`, may have its own: it scores the decoded text, re-tokenised)",
                w = writer.spec.name,
                op = node.op.name(),
                rt = reader.tokenizer.source().display(),
                wt = writer.tokenizer.source().display(),
            ),
        ));
    }
    Ok(retokenize)
}

/// Whether a plan's streaming can be switched off every other step (`RunOptions::
/// alternate_streaming`): something streams, and nothing else of the sample-level split (a
/// long-tail migration, consumers moved onto the devices it frees) rests on it.
fn check_alternating(exec: &ExecPlan) -> Result<()> {
    let what = "--alternate-streaming";
    let streams = exec
        .decisions
        .streams
        .values()
        .any(|s| !exec.streamed(s.generate).is_empty());
    if !streams {
        return Err(Error::invalid(
            what,
            "nothing streams in this plan: there is no gain of streaming to measure",
        ));
    }
    if !exec.decisions.migrations.is_empty() || !exec.decisions.subtask_placements.is_empty() {
        return Err(Error::invalid(
            what,
            "this plan also migrates a generation's long tail, which rests on streaming: compare a run with a run of `--no-fuse` instead",
        ));
    }
    Ok(())
}

/// Refuses a plan made for another world: one process per device, so the plan's cluster must
/// have as many devices as the world has processes, of the kind this process has.
fn check_world(exec: &ExecPlan, device: Device, world: usize) -> Result<()> {
    let c = &exec.cluster;
    let want_cpu = c.device == braid_cost::cost::DeviceKind::Cpu;
    let have_cpu = device == Device::Cpu;
    if c.devices() != world as u64 {
        return Err(Error::invalid(
            "plan",
            format!(
                "is for {} devices ({c}) but this run has {world} process{} (one per device); launch one per device (`braid launch --nproc-per-node {}`) or plan for this world",
                c.devices(),
                if world == 1 { "" } else { "es" },
                c.devices()
            ),
        ));
    }
    if want_cpu != have_cpu {
        return Err(Error::invalid(
            "plan",
            format!(
                "is for {c} but this process runs on {}; plan it for this device",
                if have_cpu { "the CPU" } else { "a GPU" }
            ),
        ));
    }
    Ok(())
}

/// The dtype a verified plan names for every model.
pub(super) fn kind_of(spec: &ModelSpec) -> Result<Kind> {
    spec.dtype
        .map(crate::models::model::kind_of)
        .ok_or_else(|| Error::invalid(format!("model `{}`", spec.name), "the plan names no dtype"))
}

/// Builds model `slot` from its source (following frozen copies to the model they copy) with
/// parameters in `kind`: the slot's own dtype, or f32 for a trained model's masters. A frozen
/// copy computes in its own dtype, which may differ from the model it copies.
pub(super) fn build_model(
    plan: &Plan,
    slot: usize,
    base_dir: &Path,
    device: Device,
    kind: Kind,
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
            tiny_in(&config, head, kind, device)
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
                    dtype: Some(kind),
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

/// The tokenizer of a model this rank does not hold: the byte tokenizer of tiny models, or
/// the one of a Hugging Face directory or GGUF file (no weights are read).
pub(super) fn build_tokenizer(plan: &Plan, slot: usize, base_dir: &Path) -> Result<Tokenizer> {
    let mut src = slot;
    for _ in 0..=plan.models.len() {
        match &plan.models[src].source {
            ModelSource::FrozenOf(of) => src = *of as usize,
            _ => break,
        }
    }
    match &plan.models[src].source {
        ModelSource::Tiny { .. } => Ok(Tokenizer::bytes()),
        ModelSource::Hf { dir } => {
            let path = if Path::new(dir).is_absolute() {
                PathBuf::from(dir)
            } else {
                base_dir.join(dir)
            };
            let config = if crate::models::gguf::is_gguf(&path) {
                crate::models::gguf::GgufFile::open(&path)?.config()?
            } else {
                crate::models::config::ModelConfig::from_file(&path.join("config.json"))?
            };
            Tokenizer::from_dir(&path, &config)
        }
        ModelSource::FrozenOf(_) => Err(Error::invalid(
            format!("model `{}`", plan.models[slot].name),
            "is a frozen copy of itself",
        )),
    }
}

/// Copies every parameter `dst` holds from `src` (same architecture): `src` whole, or cut
/// exactly as `dst` is (the same pipeline stage and tensor-parallel slice).
pub(super) fn copy_weights(dst: &Model, src: &Model) -> Result<()> {
    let from: BTreeMap<String, Tensor> = src.named_parameters().into_iter().collect();
    let cut = src.tensor_parallel().0 == 1 && dst.tensor_parallel().0 > 1;
    if src.tensor_parallel().0 > 1 && src.tensor_parallel() != dst.tensor_parallel() {
        return Err(Error::invalid(
            "replica",
            "a tensor-parallel copy's values go only to a copy cut alike",
        ));
    }
    tch::no_grad(|| -> Result<()> {
        for (name, t) in dst.held_parameters() {
            let s = from.get(&name).ok_or_else(|| {
                Error::invalid(
                    "replica",
                    format!("parameter `{name}` missing in the source"),
                )
            })?;
            let s = if cut {
                dst.local_part(&name, s)?
            } else {
                s.shallow_clone()
            };
            let mut d = t.shallow_clone();
            d.f_copy_(&s)?;
        }
        Ok(())
    })
}
