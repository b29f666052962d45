//! `train`: epochs of mini-batches of micro-batches, the loss's objective evaluated on the
//! model's current outputs with autograd, AdamW steps, and the metrics of the update (the
//! trainer's own, and the ones the loss declares).

use super::*;
use comm::sample_block;
use stream::gather_rows;

impl<'p> Executor<'p> {
    /// Trains a model on a rollout: `epochs` passes, each over `minibatches` optimizer steps,
    /// each accumulating gradients over micro-batches of `micro` sequences. With data
    /// parallelism (the train's placement has `dp` replicas) every replica of the mesh takes
    /// its block of each mini-batch, normalises its loss by the whole mini-batch's token,
    /// sample and group counts (the objective's `BatchSum`s divide by them), and the gradients are summed over the replicas before every step: the
    /// update is the one-process update (up to the order of floating-point additions). Ranks
    /// outside the mesh only take part in gathering the model's log-probabilities.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn train(
        &mut self,
        id: NodeId,
        model: usize,
        r: &RolloutData,
        term: &LossTerm,
        epochs: i64,
        minibatches: i64,
        micro: usize,
        seed: u64,
    ) -> Result<Trained> {
        let n = r.samples.len();
        let mut stats: BTreeMap<String, f64> = BTreeMap::new();
        let p = *self
            .exec
            .placement(id)
            .ok_or_else(|| Error::invalid("plan", format!("{id} has no placement")))?;
        let rank = self.comm.rank as u64;
        // The log-probabilities of the first forward pass over each sample, before any update
        // (what a reused `logprobs` node stands for).
        let mut own: Vec<Option<Vec<f32>>> = vec![None; n];
        let wants_own = self
            .exec
            .decisions
            .reused_logprobs
            .values()
            .any(|t| *t == id);
        if n == 0 {
            return Ok((stats, None));
        }
        let plan = self.plan;
        let streams_off = self.streams_off;
        let objective = match plan.graph.node(term.node).map(|x| &x.op) {
            Some(Op::Loss { objective }) => objective,
            _ => {
                return Err(Error::invalid(
                    "plan",
                    format!("{}: the loss of a `train` is not a loss node", term.node),
                ));
            }
        };
        let len = |i: usize| r.samples[i].rollout.completion.len();
        let group_of = |i: usize| r.samples[i].prompt_index;
        if let Some(coords) = p.coords(rank) {
            let dp = p.dp.max(1) as usize;
            let replica = coords.dp as usize;
            // The replicas at this tensor rank sum gradients and metrics; the tensor ranks of
            // this replica sum the squares of their gradients for the norm.
            let group = self.comm.group(&comm::dp_ranks(
                &p,
                &comm::seating(self.exec, id)?,
                coords.tp,
                0,
            ))?;
            let tp_group = if p.tp > 1 {
                self.comm.group(&comm::replica_ranks(
                    &p,
                    &comm::seating(self.exec, id)?,
                    coords.dp,
                ))?
            } else {
                None
            };
            let leads = coords.tp == 0;
            let Slot {
                spec,
                model: m,
                home,
                opt,
                replica: gen_copy,
                replica_stale,
                replica_share,
                total_opt_steps,
                ..
            } = &mut self.slots[model];
            let Some(m) = m.as_ref() else {
                return Err(Error::invalid(
                    format!("model `{}`", spec.name),
                    "is trained on this rank but not built here",
                ));
            };
            let head = m.head();
            let grad_clip = spec.grad_clip;
            let Some(opt) = opt.as_mut() else {
                return Err(Error::invalid(
                    format!("model `{}`", spec.name),
                    "is trained but has no optimizer",
                ));
            };
            let per_mb = n.div_ceil(minibatches.max(1) as usize).max(1);
            let start_step = opt.step;
            let mut rng = Rng::new(seed);
            // Sums over this replica's tokens, reduced over the replicas at the end: loss,
            // entropy, tokens; and per metric the loss declares, the sum of its values and how
            // many there were.
            let mut local = [0.0f64; 3];
            let mut metrics: BTreeMap<String, (f64, f64)> = BTreeMap::new();
            let mut norm_sum = 0.0;
            let mut opt_steps = 0usize;
            // Optimizer steps that updated the model, and those skipped for non-finite
            // gradients.
            let mut taken = 0usize;
            let mut skipped = 0usize;
            let mut lr = 0.0;
            for _ in 0..epochs.max(1) {
                let mut perm: Vec<usize> = (0..n).collect();
                rng.shuffle(&mut perm);
                for mb in perm.chunks(per_mb) {
                    let mb_lens: Vec<usize> = mb.iter().map(|&i| len(i)).collect();
                    let mb_groups: Vec<usize> = mb.iter().map(|&i| group_of(i)).collect();
                    let part = &mb[sample_block(mb.len(), dp, replica)];
                    for chunk in part.chunks(micro) {
                        let seqs: Vec<&Rollout> =
                            chunk.iter().map(|&i| &r.samples[i].rollout).collect();
                        let lens: Vec<usize> = chunk.iter().map(|&i| len(i)).collect();
                        let groups: Vec<usize> = chunk.iter().map(|&i| group_of(i)).collect();
                        let t: usize = lens.iter().sum();
                        if t == 0 {
                            continue;
                        }
                        let layout = Layout::new(&lens, &groups, &mb_lens, &mb_groups);
                        let mut out = train_forward(
                            m,
                            &seqs,
                            r.temperature,
                            head,
                            spec.gradient_checkpointing,
                        )?;
                        let own_here = (opt.step == start_step).then_some(own.as_mut_slice());
                        let loss = micro_loss(
                            objective,
                            term,
                            chunk,
                            &lens,
                            &out,
                            &layout,
                            own_here,
                            &mut local,
                            &mut metrics,
                        )?;
                        // Times the loss scale for f16 models (1 otherwise); the gradients of
                        // a bf16 or f16 model then move into its f32 accumulators.
                        opt.scale_loss(&loss).backward();
                        if let Some(ck) = out.checkpoint.take() {
                            // Activation checkpointing: the layers' backward, recomputed.
                            m.backward_checkpointed(ck)?;
                        }
                        opt.accumulate();
                    }
                    if let Some(g) = group {
                        // A bf16 or f16 model's gradients are in its f32 accumulators.
                        match opt.accumulators() {
                            Some(acc) => comm::all_reduce_tensors(g, acc)?,
                            None => comm::all_reduce_gradients(g, &opt.parameters())?,
                        }
                    }
                    lr = opt.lr_at(opt.step, *total_opt_steps);
                    let outcome = match tp_group {
                        // The norm over the whole model: every tensor rank's slices once, a
                        // parameter whole on each of them counted once.
                        Some(g) => {
                            let tp = p.tp as f64;
                            let weight = |name: &str| {
                                if m.replicated_across_tp(name) {
                                    1.0 / tp
                                } else {
                                    1.0
                                }
                            };
                            let mut sq = [opt.grad_squares(&weight)];
                            comm::sum(g, &mut sq)?;
                            opt.step_with_norm(lr, grad_clip, sq[0].max(0.0).sqrt())
                        }
                        None => opt.step(lr, grad_clip),
                    };
                    if outcome.skipped {
                        skipped += 1;
                    } else {
                        norm_sum += outcome.norm;
                        taken += 1;
                    }
                    opt_steps += 1;
                }
            }
            // Every replica evaluates the same objective, so the metrics have the same names
            // in the same order everywhere.
            let mut metric_sums: Vec<f64> = metrics.values().flat_map(|&(s, c)| [s, c]).collect();
            if let Some(g) = group {
                // One all-reduce for both: on Gloo each collective costs round trips.
                let mut all: Vec<f64> = local.iter().copied().chain(metric_sums).collect();
                comm::sum(g, &mut all)?;
                let n = local.len();
                local.copy_from_slice(&all[..n]);
                metric_sums = all[n..].to_vec();
            }
            if let Some(rep) = gen_copy.as_mut()
                && *replica_share == *home
            {
                if streams_off {
                    // Not generated on in this step: refreshed before it generates again.
                    *replica_stale = true;
                } else {
                    copy_weights(rep, m)?;
                    *replica_stale = false;
                }
            }
            if !leads {
                // The first tensor rank's log-probabilities are gathered (they are the same).
                own.iter_mut().for_each(|o| *o = None);
            }
            let [loss_sum, ent_tok, tokens] = local;
            let k = opt_steps.max(1) as f64;
            stats.insert("loss".into(), loss_sum / k);
            // The norm of the steps that updated the model: a skipped step's is inf or NaN.
            if taken > 0 {
                stats.insert("grad_norm".into(), norm_sum / taken as f64);
            }
            stats.insert("skipped_steps".into(), skipped as f64);
            if m.kind() == Kind::Half {
                // The scale the next step starts with.
                stats.insert("loss_scale".into(), opt.loss_scale());
            }
            stats.insert("lr".into(), lr);
            for (name, sc) in metrics.keys().zip(metric_sums.chunks(2)) {
                stats.insert(
                    name.clone(),
                    sc[0] / sc.get(1).copied().unwrap_or(0.0).max(1.0),
                );
            }
            if head == Head::Lm {
                stats.insert("entropy".into(), ent_tok / tokens.max(1.0));
            }
        }
        if !wants_own {
            return Ok((stats, None));
        }
        // The reused log-probabilities: every rank takes every replica's.
        let rows: Vec<Option<PerSampleOut>> = own
            .into_iter()
            .map(|o| o.map(PerSampleOut::Tokens))
            .collect();
        let rows = gather_rows(&self.comm, rows)?;
        let own = rows
            .into_iter()
            .map(|r| match r {
                Some(PerSampleOut::Tokens(t)) => Some(t),
                _ => None,
            })
            .collect::<Option<Vec<_>>>();
        Ok((stats, own))
    }
}

/// A `train`'s metrics, and its model's log-probabilities before the update per sample (for
/// reused `logprobs` nodes).
pub(super) type Trained = (BTreeMap<String, f64>, Option<Vec<Vec<f32>>>);

/// The model's outputs on a micro-batch, with autograd.
pub(crate) struct TrainOut {
    /// Log-probabilities of the completion tokens `[T]` (language models).
    pub(crate) logp: Option<Tensor>,
    /// Per-token entropy `[T]`, detached unless an entropy bonus needs it.
    pub(crate) entropy: Option<Tensor>,
    /// Values at the completion tokens `[T]` (critics).
    pub(super) values: Option<Tensor>,
    /// With activation checkpointing: what the layers' recomputed backward needs.
    pub(super) checkpoint: Option<crate::models::model::Checkpoint>,
}

pub(crate) fn train_forward(
    model: &Model,
    seqs: &[&Rollout],
    temperature: f64,
    head: Head,
    checkpointing: bool,
) -> Result<TrainOut> {
    let (ids, mask) = infer::pad_batch(seqs, 0, model.device());
    let (hidden, checkpoint) = if checkpointing {
        let (h, ck) = model.hidden_states_checkpointed(&ids, Some(&mask))?;
        (h, Some(ck))
    } else {
        (model.hidden_states(&ids, Some(&mask))?, None)
    };
    let mut out = head_outputs(model, &hidden, seqs, temperature, head)?;
    out.checkpoint = checkpoint;
    Ok(out)
}

/// The head's outputs at the completion tokens of `seqs` from the final hidden states
/// `[B, T, hidden]` (a whole model's, or a pipeline's last stage's).
pub(super) fn head_outputs(
    model: &Model,
    hidden: &Tensor,
    seqs: &[&Rollout],
    temperature: f64,
    head: Head,
) -> Result<TrainOut> {
    let checkpoint = None;
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
            // With gradients: PPO's entropy bonus differentiates through the entropy.
            let (logp, entropy) =
                model.token_logprobs(&h, &Tensor::from_slice(&targets), temperature, true)?;
            Ok(TrainOut {
                logp: Some(logp),
                entropy,
                values: None,
                checkpoint,
            })
        }
        Head::Value => Ok(TrainOut {
            logp: None,
            entropy: None,
            values: Some(model.apply_head(&h)?.to_kind(Kind::Float)),
            checkpoint,
        }),
        Head::Score => Err(Error::invalid(
            "train",
            "a reward model (score head) cannot be trained by an RL loss",
        )),
    }
}

/// The objective on one micro-batch's outputs `out` (samples `chunk`, of `lens` completion
/// tokens): the model's own log-probabilities recorded into `own` when given (the first
/// forward pass over each sample), the loss's metrics added to `metrics` and the loss,
/// entropy and token sums to `local`. Returns the loss, unscaled.
#[allow(clippy::too_many_arguments)]
pub(super) fn micro_loss(
    objective: &braid_ir::loss::Objective,
    term: &LossTerm,
    chunk: &[usize],
    lens: &[usize],
    out: &TrainOut,
    layout: &Layout,
    own: Option<&mut [Option<Vec<f32>>]>,
    local: &mut [f64; 3],
    metrics: &mut BTreeMap<String, (f64, f64)>,
) -> Result<Tensor> {
    if let (Some(own), Some(lp)) = (own, &out.logp) {
        let flat: Vec<f32> =
            Vec::<f32>::try_from(lp.detach().to_kind(Kind::Float).to_device(Device::Cpu))
                .map_err(Error::Torch)?;
        let mut at = 0;
        for (&i, &l) in chunk.iter().zip(lens) {
            if own[i].is_none() {
                own[i] = Some(flat[at..at + l].to_vec());
            }
            at += l;
        }
    }
    let inputs = term
        .args
        .iter()
        .map(|a| input_tensor(a, chunk, out))
        .collect::<Result<Vec<Tensor>>>()?;
    let outputs = objective::Outputs {
        logp: out.logp.as_ref(),
        entropy: out.entropy.as_ref(),
        value: out.values.as_ref(),
    };
    let ev = objective::evaluate(objective, &inputs, &outputs, layout)?;
    for (name, sum, count) in ev.metrics {
        let m = metrics.entry(name).or_default();
        m.0 += sum;
        m.1 += count;
    }
    local[0] += ev.loss.double_value(&[]);
    if let Some(e) = &out.entropy {
        local[1] += e.detach().sum(Kind::Float).double_value(&[]);
    }
    local[2] += lens.iter().sum::<usize>() as f64;
    Ok(ev.loss)
}

/// An input of the objective for the samples `chunk` (indices into the rollout), in f32 on
/// the model's device: per-token values `[T]`, per-sample values `[N]`, or the model's own
/// log-probabilities, detached.
pub(super) fn input_tensor(arg: &LossArg, chunk: &[usize], out: &TrainOut) -> Result<Tensor> {
    let device = match (&out.logp, &out.values) {
        (Some(t), _) | (_, Some(t)) => t.device(),
        _ => Device::Cpu,
    };
    Ok(match arg {
        LossArg::Tokens(t) => {
            let mut v: Vec<f32> = Vec::new();
            for &i in chunk {
                v.extend(t.row(i).iter().map(|&x| x as f32));
            }
            Tensor::from_slice(&v).to_device(device)
        }
        LossArg::Samples(s) => {
            Tensor::from_slice(&chunk.iter().map(|&i| s[i] as f32).collect::<Vec<_>>())
                .to_device(device)
        }
        LossArg::CurrentLogp => out
            .logp
            .as_ref()
            .ok_or_else(|| {
                Error::invalid(
                    "loss",
                    "the model's own log-probabilities need a language model",
                )
            })?
            .detach(),
    })
}
