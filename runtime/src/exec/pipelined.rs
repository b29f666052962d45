//! Pipeline-parallel `train` calls: each data-parallel replica of the training layout is a
//! pipeline of `pp` stages (`models::pipeline`), its share of every mini-batch cut into the
//! plan's micro-batches and run by 1F1B — or, when the planner interleaves two trainings
//! (`microbatch-interleave`, RLHFuse's intra-stage fusion), both models' micro-batch subtasks
//! run as one schedule in the fused-pipeline solver's order on the ranks they share. The loss,
//! the metrics and the update are the ones `train.rs` computes on a whole model: the last
//! stage evaluates the objective on its hidden states, the gradients of each stage are summed
//! over its data-parallel replicas, and the gradient norm over every stage of a replica.

use super::*;
use crate::models::pipeline::{FusedPart, MicroBatch, Pass, run_fused};
use comm::{dp_ranks, played_by, replica_ranks, sample_block, seating};
use stream::gather_rows;
use train::{Trained, head_outputs, micro_loss};

/// A micro-batch's loss from the last stage's hidden states.
type LossFn<'a> = dyn FnMut(usize, &Tensor) -> Result<Tensor> + 'a;

/// One pipeline-parallel training of a step.
pub(super) struct Job<'a> {
    pub(super) id: NodeId,
    pub(super) model: usize,
    pub(super) rollout: &'a RolloutData,
    pub(super) term: &'a LossTerm,
    pub(super) epochs: i64,
    pub(super) minibatches: i64,
    pub(super) micro: usize,
    pub(super) seed: u64,
}

/// What one job accumulates on this rank over its optimizer steps.
#[derive(Default)]
struct Tally {
    /// Loss, entropy and tokens, summed over this rank's micro-batches (last stage only).
    local: [f64; 3],
    metrics: BTreeMap<String, (f64, f64)>,
    norm_sum: f64,
    steps: usize,
    taken: usize,
    skipped: usize,
    lr: f64,
    /// The log-probabilities of the first forward pass over each sample.
    own: Vec<Option<Vec<f32>>>,
}

/// This rank's place in a job's layout.
struct Seat {
    dp: usize,
    replica: usize,
    stage: u64,
    stages: u64,
    /// This rank's tensor rank and the degree.
    tp_rank: u64,
    tp: u64,
}

impl<'p> Executor<'p> {
    /// Runs `jobs` — one pipeline-parallel training, or the two trainings of a fused schedule
    /// (forward model first) — and returns each one's metrics and reused log-probabilities.
    pub(super) fn train_pipelined(&mut self, jobs: &[Job<'_>]) -> Result<Vec<Trained>> {
        let rank = self.comm.rank;
        let mut seats: Vec<Option<Seat>> = Vec::new();
        for j in jobs {
            let p = self
                .exec
                .placement(j.id)
                .ok_or_else(|| Error::invalid("plan", format!("{} has no placement", j.id)))?;
            let s = seating(self.exec, j.id)?;
            seats.push(played_by(&s, rank).and_then(|d| p.coords(d)).map(|c| Seat {
                dp: p.dp.max(1) as usize,
                replica: c.dp as usize,
                stage: c.pp,
                stages: p.pp,
                tp_rank: c.tp,
                tp: p.tp.max(1),
            }));
        }
        let steps: Vec<i64> = jobs
            .iter()
            .map(|j| j.epochs.max(1) * j.minibatches.max(1))
            .collect();
        if jobs.len() > 1 && steps.iter().any(|s| *s != steps[0]) {
            return Err(Error::invalid(
                "plan",
                "the interleaved trainings take different numbers of optimizer steps",
            ));
        }
        let mut tallies: Vec<Tally> = jobs
            .iter()
            .map(|j| Tally {
                own: vec![None; j.rollout.samples.len()],
                ..Tally::default()
            })
            .collect();
        // Each job's mini-batches in order: a permutation per epoch, as `train` draws them.
        let mut batches: Vec<Vec<Vec<usize>>> = Vec::new();
        for j in jobs {
            let n = j.rollout.samples.len();
            let per_mb = n.div_ceil(j.minibatches.max(1) as usize).max(1);
            let mut rng = Rng::new(j.seed);
            let mut all = Vec::new();
            for _ in 0..j.epochs.max(1) {
                let mut perm: Vec<usize> = (0..n).collect();
                rng.shuffle(&mut perm);
                all.extend(perm.chunks(per_mb).map(<[usize]>::to_vec));
            }
            batches.push(all);
        }
        let here = seats.iter().any(Option::is_some);
        let rounds = batches.iter().map(Vec::len).max().unwrap_or(0);
        for step in 0..rounds {
            if !here {
                break;
            }
            self.pipeline_step(jobs, &seats, &batches, step, &mut tallies)?;
        }
        let mut out = Vec::new();
        for (k, j) in jobs.iter().enumerate() {
            out.push(self.finish_job(j, seats[k].as_ref(), std::mem::take(&mut tallies[k]))?);
        }
        Ok(out)
    }

    /// One optimizer step of every job on this rank: the micro-batches of its replica's share
    /// of the mini-batch through its pipeline (by 1F1B, or the fused schedule), then the
    /// gradients summed over the stage's replicas, the norm over the replica's stages, and
    /// the update.
    fn pipeline_step(
        &mut self,
        jobs: &[Job<'_>],
        seats: &[Option<Seat>],
        batches: &[Vec<Vec<usize>>],
        step: usize,
        tallies: &mut [Tally],
    ) -> Result<()> {
        let plan = self.plan;
        let exec = self.exec;
        let totals: Vec<i64> = jobs
            .iter()
            .map(|j| self.slots[j.model].total_opt_steps)
            .collect();
        // Per job here: its micro-batches (sample indices) and their padded tensors.
        let mut chunks: Vec<Vec<Vec<usize>>> = Vec::new();
        let mut micro: Vec<Vec<MicroBatch>> = Vec::new();
        for (k, j) in jobs.iter().enumerate() {
            let (Some(seat), Some(mb)) = (&seats[k], batches[k].get(step)) else {
                chunks.push(Vec::new());
                micro.push(Vec::new());
                continue;
            };
            let part = &mb[sample_block(mb.len(), seat.dp, seat.replica)];
            let len = |i: usize| j.rollout.samples[i].rollout.completion.len();
            let cs: Vec<Vec<usize>> = part
                .chunks(j.micro.max(1))
                .filter(|c| c.iter().map(|&i| len(i)).sum::<usize>() > 0)
                .map(<[usize]>::to_vec)
                .collect();
            let device = self.slots[j.model].model()?.device();
            let mbs = cs
                .iter()
                .map(|c| {
                    let seqs: Vec<&Rollout> =
                        c.iter().map(|&i| &j.rollout.samples[i].rollout).collect();
                    let (ids, mask) = infer::pad_batch(&seqs, 0, device);
                    MicroBatch { ids, mask }
                })
                .collect();
            chunks.push(cs);
            micro.push(mbs);
        }
        // The fused schedule's order of this rank's subtasks, when two jobs interleave.
        let fused_tasks = if jobs.len() > 1 {
            Some(self.fused_tasks(jobs, &micro)?)
        } else {
            None
        };
        // Split borrows of the jobs' slots.
        let mut slot_refs: Vec<Option<&mut Slot>> = self.slots.iter_mut().map(Some).collect();
        let mut parts_state = Vec::new();
        for j in jobs {
            let slot = slot_refs[j.model]
                .take()
                .ok_or_else(|| Error::invalid("plan", "two interleaved trainings of one model"))?;
            parts_state.push(slot);
        }
        let first: Vec<bool> = tallies.iter().map(|t| t.steps == 0).collect();
        let mut tally_refs = tallies.iter_mut();
        let mut losses_of: Vec<Box<LossFn<'_>>> = Vec::new();
        let mut pipes = Vec::new();
        let mut models = Vec::new();
        let mut opts = Vec::new();
        for (k, slot) in parts_state.iter_mut().enumerate() {
            let j = &jobs[k];
            let Slot {
                model,
                opt,
                pipeline,
                spec,
                ..
            } = &mut **slot;
            let m: &Model = model.as_ref().ok_or_else(|| {
                Error::invalid(format!("model `{}`", spec.name), "is not built here")
            })?;
            let opt: &mut AdamW = opt.as_mut().ok_or_else(|| {
                Error::invalid(format!("model `{}`", spec.name), "has no optimizer")
            })?;
            let first_pass = first[k];
            let objective = match plan.graph.node(j.term.node).map(|x| &x.op) {
                Some(Op::Loss { objective }) => objective,
                _ => {
                    return Err(Error::invalid(
                        "plan",
                        format!("{}: the loss of a `train` is not a loss node", j.term.node),
                    ));
                }
            };
            let mb: &[usize] = batches[k].get(step).map_or(&[], |v| v.as_slice());
            let r = j.rollout;
            let mb_lens: Vec<usize> = mb
                .iter()
                .map(|&i| r.samples[i].rollout.completion.len())
                .collect();
            let mb_groups: Vec<usize> = mb.iter().map(|&i| r.samples[i].prompt_index).collect();
            let cs = chunks[k].clone();
            let head = m.head();
            let scale = opt.loss_scale();
            let tally: &mut Tally = tally_refs
                .next()
                .ok_or_else(|| Error::invalid("train", "a job without a tally"))?;
            let term = j.term;
            let model_ref: &Model = m;
            let f = move |mi: usize, hidden: &Tensor| -> Result<Tensor> {
                let chunk = cs.get(mi).ok_or_else(|| {
                    Error::invalid("pipeline", format!("micro-batch {mi} is not in the step"))
                })?;
                let seqs: Vec<&Rollout> = chunk.iter().map(|&i| &r.samples[i].rollout).collect();
                let lens: Vec<usize> = chunk
                    .iter()
                    .map(|&i| r.samples[i].rollout.completion.len())
                    .collect();
                let groups: Vec<usize> = chunk.iter().map(|&i| r.samples[i].prompt_index).collect();
                let layout = Layout::new(&lens, &groups, &mb_lens, &mb_groups);
                let out = head_outputs(model_ref, hidden, &seqs, r.temperature, head)?;
                let Tally {
                    own,
                    local,
                    metrics,
                    ..
                } = &mut *tally;
                let loss = micro_loss(
                    objective,
                    term,
                    chunk,
                    &lens,
                    &out,
                    &layout,
                    first_pass.then_some(own.as_mut_slice()),
                    local,
                    metrics,
                )?;
                // Times the loss scale for f16 models (1 otherwise).
                Ok(if scale != 1.0 { &loss * scale } else { loss })
            };
            losses_of.push(Box::new(f));
            pipes.push(pipeline.as_mut());
            models.push(m);
            opts.push(opt);
        }
        match fused_tasks {
            None => {
                if let (Some(pipe), Some(m), Some(loss)) =
                    (pipes[0].as_mut(), models.first(), losses_of.first_mut())
                    && seats[0].is_some()
                {
                    pipe.train_1f1b(m, &micro[0], loss.as_mut())?;
                }
            }
            Some(tasks) => {
                let mut parts: Vec<FusedPart<'_>> = Vec::new();
                let mut it_l = losses_of.iter_mut();
                for (k, pipe) in pipes.iter_mut().enumerate() {
                    let (Some(pipe), Some(loss)) = (pipe.as_mut(), it_l.next()) else {
                        return Err(Error::invalid(
                            "plan",
                            format!("{} runs no pipeline stage on this rank", jobs[k].id),
                        ));
                    };
                    parts.push(FusedPart {
                        pipeline: pipe,
                        model: models[k],
                        micro: &micro[k],
                        loss: loss.as_mut(),
                    });
                }
                run_fused(&mut parts, &tasks)?;
            }
        }
        drop(losses_of);
        drop(tally_refs);
        let comm = &self.comm;
        // The update of each job's stage.
        for (k, j) in jobs.iter().enumerate() {
            let Some(seat) = &seats[k] else { continue };
            let p = *exec
                .placement(j.id)
                .ok_or_else(|| Error::invalid("plan", format!("{} has no placement", j.id)))?;
            let s = seating(exec, j.id)?;
            let opt = &mut opts[k];
            let m = models[k];
            opt.accumulate();
            if let Some(g) = comm.group(&dp_ranks(&p, &s, seat.tp_rank, seat.stage))? {
                match opt.accumulators() {
                    Some(acc) => comm::all_reduce_tensors(g, acc)?,
                    None => comm::all_reduce_gradients(g, &opt.parameters())?,
                }
            }
            // The embedding tied to the head is on the first and the last stage, with the
            // same (summed) gradient: counted once.
            let tied = m.config().tie_word_embeddings && seat.stages > 1;
            let embed = m.embedding_parameter().map(|e| e.data_ptr());
            let named: BTreeMap<String, Tensor> = m.named_parameters().into_iter().collect();
            // A parameter whole on every tensor rank has the same gradient on each: counted
            // once over the group.
            let tp = seat.tp as f64;
            let weight = |name: &str| {
                let w = if tied && embed.is_some() && named.get(name).map(|t| t.data_ptr()) == embed
                {
                    0.5
                } else {
                    1.0
                };
                if m.replicated_across_tp(name) {
                    w / tp
                } else {
                    w
                }
            };
            let mut sq = [opt.grad_squares(&weight)];
            if let Some(g) = comm.group(&replica_ranks(&p, &s, seat.replica as u64))? {
                comm::sum(g, &mut sq)?;
            }
            let norm = sq[0].max(0.0).sqrt();
            let clip = plan.models[j.model].grad_clip;
            let t = &mut tallies[k];
            t.lr = opt.lr_at(opt.step, totals[k]);
            let outcome = opt.step_with_norm(t.lr, clip, norm);
            if outcome.skipped {
                t.skipped += 1;
            } else {
                t.norm_sum += outcome.norm;
                t.taken += 1;
            }
            t.steps += 1;
        }
        Ok(())
    }

    /// This rank's subtasks of the fused schedule of `jobs` (forward model, reverse model), in
    /// the solver's order: the plan's schedule when the step's micro-batch counts are the ones
    /// it was solved for, otherwise the solver's schedule for the counts at hand (the same
    /// durations), which every rank of the fused pipelines computes alike.
    fn fused_tasks(
        &self,
        jobs: &[Job<'_>],
        micro: &[Vec<MicroBatch>],
    ) -> Result<Vec<(usize, usize, Pass)>> {
        use braid_cost::fused_pipeline::{self as fp, Kind as Fk, PipelineModel, PipelineProblem};
        let f = self
            .exec
            .decisions
            .interleave
            .iter()
            .find(|f| f.forward == jobs[0].id && f.reverse == jobs[1].id)
            .ok_or_else(|| Error::invalid("plan", "no fused schedule for these trainings"))?;
        let (Some(pf), Some(pr)) = (
            self.exec.placement(f.forward),
            self.exec.placement(f.reverse),
        ) else {
            return Err(Error::invalid(
                "plan",
                "the fused trainings have no placements",
            ));
        };
        let device = self
            .exec
            .placement(f.forward)
            .and_then(|p| p.coords(self.comm.rank as u64))
            .map(|c| c.pp as usize)
            .ok_or_else(|| Error::invalid("plan", "this rank is not in the fused pipelines"))?;
        let counts = [micro[0].len(), micro[1].len()];
        let planned = [pf.microbatches as usize, pr.microbatches as usize];
        let solved;
        let schedule = if counts == planned {
            &f.schedule
        } else {
            // Durations of each model's forward and backward, as the plan's schedule has them.
            let mut dur = [[1u64; 2]; 2];
            for d in &f.schedule.schedule {
                for t in &d.tasks {
                    let k = usize::from(t.kind == Fk::Bwd);
                    if t.model < 2 {
                        dur[t.model][k] = (t.end - t.start).max(1);
                    }
                }
            }
            let problem = PipelineProblem {
                stages: pf.pp as usize,
                models: (0..2)
                    .map(|i| PipelineModel {
                        name: None,
                        pp: [pf.pp, pr.pp][i] as usize,
                        microbatches: counts[i].max(1),
                        fwd: dur[i][0],
                        bwd: dur[i][1],
                        mem_per_microbatch: 1,
                    })
                    .collect(),
                search: Default::default(),
            };
            solved = fp::solve(&problem).map_err(|e| Error::invalid("fused schedule", e.0))?;
            &solved
        };
        let mine = schedule
            .schedule
            .iter()
            .find(|d| d.device == device)
            .ok_or_else(|| {
                Error::invalid("plan", format!("the fused schedule has no device {device}"))
            })?;
        Ok(mine
            .tasks
            .iter()
            .map(|t| (t.model, t.microbatch, Pass::from(t.kind)))
            .collect())
    }

    /// A job's metrics from its ranks' tallies (the last stages hold the loss's), summed over
    /// its mesh, and its reused log-probabilities gathered onto every rank.
    fn finish_job(&self, j: &Job<'_>, seat: Option<&Seat>, t: Tally) -> Result<Trained> {
        let mut stats = BTreeMap::new();
        if let Some(seat) = seat {
            let p = self
                .exec
                .placement(j.id)
                .ok_or_else(|| Error::invalid("plan", format!("{} has no placement", j.id)))?;
            // The last stage's first tensor rank speaks for its replica.
            let last = seat.stage + 1 == seat.stages && seat.tp_rank == 0;
            let mine = if last {
                serde_json::json!({"local": t.local, "metrics": t.metrics})
            } else {
                serde_json::json!({"local": [0.0, 0.0, 0.0], "metrics": {}})
            };
            let bytes =
                serde_json::to_vec(&mine).map_err(|e| Error::invalid("train", e.to_string()))?;
            let parts = match self.comm.mesh(p)? {
                Some(g) => comm::all_gather_bytes(g, bytes)?,
                None => vec![bytes],
            };
            let mut local = [0.0f64; 3];
            let mut metrics: BTreeMap<String, (f64, f64)> = BTreeMap::new();
            for part in parts {
                let v: serde_json::Value = serde_json::from_slice(&part)
                    .map_err(|e| Error::invalid("train", e.to_string()))?;
                if let Some(l) = v["local"].as_array() {
                    for (a, b) in local.iter_mut().zip(l) {
                        *a += b.as_f64().unwrap_or(0.0);
                    }
                }
                if let Some(m) = v["metrics"].as_object() {
                    for (name, sc) in m {
                        let e = metrics.entry(name.clone()).or_default();
                        e.0 += sc[0].as_f64().unwrap_or(0.0);
                        e.1 += sc[1].as_f64().unwrap_or(0.0);
                    }
                }
            }
            let [loss_sum, ent_tok, tokens] = local;
            let k = t.steps.max(1) as f64;
            stats.insert("loss".into(), loss_sum / k);
            if t.taken > 0 {
                stats.insert("grad_norm".into(), t.norm_sum / t.taken as f64);
            }
            stats.insert("skipped_steps".into(), t.skipped as f64);
            stats.insert("lr".into(), t.lr);
            for (name, (sum, count)) in metrics {
                stats.insert(name, sum / count.max(1.0));
            }
            let slot = &self.slots[j.model];
            let m = slot.model()?;
            if m.kind() == Kind::Half
                && let Some(o) = &slot.opt
            {
                stats.insert("loss_scale".into(), o.loss_scale());
            }
            if m.head() == Head::Lm {
                stats.insert("entropy".into(), ent_tok / tokens.max(1.0));
            }
        }
        let wants_own = self
            .exec
            .decisions
            .reused_logprobs
            .values()
            .any(|x| *x == j.id);
        if !wants_own {
            return Ok((stats, None));
        }
        let speaks = seat.is_none_or(|s| s.tp_rank == 0);
        let rows: Vec<Option<PerSampleOut>> = t
            .own
            .into_iter()
            .map(|o| o.filter(|_| speaks).map(PerSampleOut::Tokens))
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
