//! Pipeline parallelism: a model's layers split into consecutive stages, one per rank of a
//! pipeline group, activations sent forward and their gradients backward between neighbours,
//! and training by the 1F1B schedule (PipeDream-Flush, as Megatron-LM runs it).
//!
//! Stage `s` of `pp` runs layers `s·L/pp .. (s+1)·L/pp` (the planner's split,
//! `braid_ir::transfer`); the first stage embeds, the last applies the final norm, and the
//! head is the caller's (`train_1f1b`'s `loss` gets the last stage's hidden states). A stage
//! keeps only its own parameters (`Model::retain_stage` releases the others); with tied
//! embeddings the first and last stages both keep the embedding and their gradients of it are
//! summed. Tensor parallelism composes: each stage may itself be tensor-parallel, and stage
//! `s`'s tensor-parallel rank `t` talks to rank `t` of the neighbouring stages.
//!
//! Every link between neighbours has one group per direction, and each sending side queues its
//! tensors to a thread of its own, so that a stage never blocks on a send: with only receives
//! blocking, the schedule's dependencies (acyclic) decide the order and no two stages wait on
//! each other.

use std::ops::Range;
use std::sync::mpsc;
use std::thread::JoinHandle;

use tch::{Kind, Tensor};

use crate::dist::{ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use crate::models::model::Model;

/// A group of two used in one direction. A sending link hands its group to a thread of its
/// own, which sends the queued tensors in order (c10d matches a group's messages in order), so
/// that the stage never waits for a send, not even for an earlier one on the same link: a
/// send completes only once the peer receives it, and the peer may first need something this
/// stage sends later on another link. A receiving link keeps its group on the stage's thread.
enum Link {
    Send(Sender),
    Recv { group: ProcessGroup, peer: usize },
}

struct Sender {
    queue: Option<mpsc::Sender<(Tensor, u32)>>,
    acks: mpsc::Receiver<crate::dist::Result<()>>,
    /// Sends queued and not yet acknowledged.
    queued: usize,
    worker: Option<JoinHandle<()>>,
}

impl Link {
    fn sending(group: ProcessGroup) -> Link {
        let peer = 1 - group.rank();
        let (queue, jobs) = mpsc::channel::<(Tensor, u32)>();
        let (ack, acks) = mpsc::channel();
        let worker = std::thread::spawn(move || {
            for (t, tag) in jobs {
                let r = group.send(&t, peer, tag);
                let failed = r.is_err();
                if ack.send(r).is_err() || failed {
                    break;
                }
            }
        });
        Link::Send(Sender {
            queue: Some(queue),
            acks,
            queued: 0,
            worker: Some(worker),
        })
    }

    fn receiving(group: ProcessGroup) -> Link {
        let peer = 1 - group.rank();
        Link::Recv { group, peer }
    }

    /// Waits until every queued send has been received.
    fn settle(&mut self) -> Result<()> {
        if let Link::Send(s) = self {
            while s.queued > 0 {
                let r = s.acks.recv().map_err(|_| {
                    Error::invalid("pipeline", "a send thread ended before its sends")
                })?;
                s.queued -= 1;
                r?;
            }
        }
        Ok(())
    }

    /// Queues `t` (detached, contiguous) for the peer without waiting.
    fn send(&mut self, t: &Tensor, tag: u32) -> Result<()> {
        let Link::Send(s) = self else {
            return Err(Error::invalid("pipeline", "a receiving link cannot send"));
        };
        let t = t.detach().contiguous();
        s.queue
            .as_ref()
            .and_then(|q| q.send((t, tag)).ok())
            .ok_or_else(|| Error::invalid("pipeline", "a send thread ended early"))?;
        s.queued += 1;
        Ok(())
    }

    fn recv(&mut self, like: &[i64], kind: Kind, device: tch::Device, tag: u32) -> Result<Tensor> {
        let Link::Recv { group, peer } = self else {
            return Err(Error::invalid("pipeline", "a sending link cannot receive"));
        };
        let mut t = Tensor::f_zeros(like, (kind, device))?;
        group.recv(&mut t, *peer, tag)?;
        Ok(t)
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        if let Link::Send(s) = self {
            // Closing the queue ends the worker once its last send returns (each is bounded
            // by the group's timeout).
            s.queue.take();
            if let Some(w) = s.worker.take() {
                let _ = w.join();
            }
        }
    }
}

/// This rank's place in a pipeline: its stage, its layers and its links to the neighbours.
pub struct Pipeline {
    stage: usize,
    stages: usize,
    layers: Range<usize>,
    /// Activations from the previous stage and gradients to it.
    act_in: Option<Link>,
    grad_out: Option<Link>,
    /// Activations to the next stage and gradients from it.
    act_out: Option<Link>,
    grad_in: Option<Link>,
    /// With tied embeddings: the first and last stages' group, which sums the embedding's
    /// gradients.
    tied: Option<ProcessGroup>,
    /// Micro-batches whose forward ran and whose backward has not: the stage's input (a leaf)
    /// and what the backward starts from (the loss on the last stage, the output elsewhere).
    live: std::collections::BTreeMap<usize, (Option<Tensor>, Tensor)>,
}

/// A pass of a micro-batch through a stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Forward,
    Backward,
}

impl From<braid_cost::fused_pipeline::Kind> for Pass {
    /// A subtask of the fused-pipeline solver's schedule.
    fn from(k: braid_cost::fused_pipeline::Kind) -> Pass {
        match k {
            braid_cost::fused_pipeline::Kind::Fwd => Pass::Forward,
            braid_cost::fused_pipeline::Kind::Bwd => Pass::Backward,
        }
    }
}

/// 1F1B's order on stage `stage` of `stages` for `n` micro-batches: `stages - stage - 1`
/// forwards, then one forward and one backward in turn, then the remaining backwards.
pub fn one_f_one_b(stage: usize, stages: usize, n: usize) -> Vec<(usize, Pass)> {
    let warmup = (stages - stage - 1).min(n);
    let mut order = Vec::with_capacity(2 * n);
    let (mut f, mut b) = (0, 0);
    while b < n {
        if f < n && f <= b + warmup {
            order.push((f, Pass::Forward));
            f += 1;
        } else {
            order.push((b, Pass::Backward));
            b += 1;
        }
    }
    order
}

/// One model's part of a fused schedule on this rank: its pipeline, weights, micro-batches and
/// loss.
pub struct FusedPart<'a> {
    pub pipeline: &'a mut Pipeline,
    pub model: &'a Model,
    pub micro: &'a [MicroBatch],
    pub loss: &'a mut dyn FnMut(usize, &Tensor) -> Result<Tensor>,
}

/// Runs several models' trainings on the same ranks as one schedule (RLHFuse's intra-stage
/// fusion): `tasks` is this rank's list of (part, micro-batch, pass) in the order to run them,
/// as the fused-pipeline solver gives it (`braid_cost::fused_pipeline`); each part's subtasks
/// run on its own pipeline, so the models' messages never mix. Returns each part's losses (on
/// its last stage).
pub fn run_fused(
    parts: &mut [FusedPart<'_>],
    tasks: &[(usize, usize, Pass)],
) -> Result<Vec<Vec<f64>>> {
    let mut losses: Vec<Vec<f64>> = parts
        .iter()
        .map(|p| {
            vec![
                0.0;
                if p.pipeline.is_last() {
                    p.micro.len()
                } else {
                    0
                }
            ]
        })
        .collect();
    for &(i, m, pass) in tasks {
        let part = parts.get_mut(i).ok_or_else(|| {
            Error::invalid(
                "pipeline",
                format!("the schedule names model {i}, which is not here"),
            )
        })?;
        part.pipeline
            .run_task(part.model, part.micro, part.loss, m, pass, &mut losses[i])?;
    }
    for p in parts.iter_mut() {
        p.pipeline.finish(p.model)?;
    }
    Ok(losses)
}

/// One micro-batch: token ids `[B, T]` and attention mask `[B, T]`, known to every stage.
pub struct MicroBatch {
    pub ids: Tensor,
    pub mask: Tensor,
}

impl Pipeline {
    /// The pipeline of `group`'s global ranks `stage_ranks` (stage order) for `model`, on the
    /// rank of `group` that is one of them; every rank of `stage_ranks` calls it with the same
    /// list. `stages` must divide the model's layers.
    pub fn new(group: &ProcessGroup, stage_ranks: &[usize], model: &Model) -> Result<Pipeline> {
        let stages = stage_ranks.len();
        let me = group.rank();
        let stage = stage_ranks.iter().position(|&r| r == me).ok_or_else(|| {
            Error::invalid(
                "pipeline",
                format!("rank {me} is not a stage of the pipeline {stage_ranks:?}"),
            )
        })?;
        let layers = model.stage_layers(stage, stages)?;
        // Links in increasing order of their lower stage, as every member creates them.
        let link = |a: usize, b: usize| -> Result<(Link, Link)> {
            let pair = [stage_ranks[a], stage_ranks[b]];
            let (fwd, bwd) = (group.subgroup(&pair)?, group.subgroup(&pair)?);
            // Stage `a` sends activations on `fwd` and receives gradients on `bwd`.
            Ok(if a == stage {
                (Link::sending(fwd), Link::receiving(bwd))
            } else {
                (Link::receiving(fwd), Link::sending(bwd))
            })
        };
        let (mut act_in, mut grad_out, mut act_out, mut grad_in) = (None, None, None, None);
        if stage > 0 {
            let (fwd, bwd) = link(stage - 1, stage)?;
            act_in = Some(fwd);
            grad_out = Some(bwd);
        }
        if stage + 1 < stages {
            let (fwd, bwd) = link(stage, stage + 1)?;
            act_out = Some(fwd);
            grad_in = Some(bwd);
        }
        let tied = if model.config().tie_word_embeddings
            && stages > 1
            && (stage == 0 || stage + 1 == stages)
        {
            Some(group.subgroup(&[stage_ranks[0], stage_ranks[stages - 1]])?)
        } else {
            None
        };
        Ok(Pipeline {
            stage,
            stages,
            layers,
            act_in,
            grad_out,
            act_out,
            grad_in,
            tied,
            live: Default::default(),
        })
    }

    /// This rank's stage and the number of stages.
    pub fn stage(&self) -> (usize, usize) {
        (self.stage, self.stages)
    }

    /// The layers this stage runs.
    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// Whether this is the last stage (where losses are computed).
    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }

    /// The shape of the activations between stages for `mb`: `[B, T, hidden]`.
    fn act_shape(model: &Model, mb: &MicroBatch) -> Vec<i64> {
        let mut s = mb.ids.size();
        s.push(model.config().hidden_size);
        s
    }

    /// One forward of micro-batch `m` on this stage: the stage's input (a leaf with gradient on
    /// every stage but the first) and its output (the final hidden states on the last stage).
    fn forward(
        &mut self,
        model: &Model,
        mb: &MicroBatch,
        m: u32,
        grad: bool,
    ) -> Result<(Option<Tensor>, Tensor)> {
        let input = match self.act_in.as_mut() {
            Some(link) => {
                let shape = Self::act_shape(model, mb);
                let x = link.recv(&shape, model.kind(), model.device(), m)?;
                Some(if grad { x.set_requires_grad(true) } else { x })
            }
            None => None,
        };
        let out = model.stage_forward(
            &mb.ids,
            Some(&mb.mask),
            input.as_ref(),
            self.layers.clone(),
            self.is_last(),
        )?;
        if let Some(link) = self.act_out.as_mut() {
            link.send(&out, m)?;
        }
        Ok((input, out))
    }

    /// Final hidden states of every micro-batch, without gradient (inference): on the last
    /// stage `Some`, in order; `None` elsewhere.
    pub fn forward_all(
        &mut self,
        model: &Model,
        micro: &[MicroBatch],
    ) -> Result<Option<Vec<Tensor>>> {
        let mut out = Vec::new();
        for (m, mb) in micro.iter().enumerate() {
            let (_, h) = tch::no_grad(|| self.forward(model, mb, m as u32, false))?;
            out.push(h);
        }
        self.settle()?;
        Ok(self.is_last().then_some(out))
    }

    /// Forward and backward passes of `micro` by 1F1B: each stage runs `stages - stage - 1`
    /// forwards, then alternates one forward and one backward, then drains the backwards, so
    /// that at most `stages` micro-batches' activations are alive on any stage. `loss(m, h)`
    /// gives micro-batch `m`'s scalar loss from the last stage's hidden states; the
    /// parameters' gradients accumulate over the micro-batches (as for `backward` of the sum of
    /// the losses). Returns the losses on the last stage, empty elsewhere.
    pub fn train_1f1b(
        &mut self,
        model: &Model,
        micro: &[MicroBatch],
        loss: &mut dyn FnMut(usize, &Tensor) -> Result<Tensor>,
    ) -> Result<Vec<f64>> {
        let order = one_f_one_b(self.stage, self.stages, micro.len());
        self.train_in_order(model, micro, loss, &order)
    }

    /// Forward and backward passes of `micro` in the stage-local `order` of (micro-batch,
    /// pass) — any order in which each backward follows its forward and micro-batches keep
    /// their order within each pass, such as 1F1B's or a fused schedule's share for this
    /// model. Returns the losses on the last stage (by micro-batch), empty elsewhere.
    pub fn train_in_order(
        &mut self,
        model: &Model,
        micro: &[MicroBatch],
        loss: &mut dyn FnMut(usize, &Tensor) -> Result<Tensor>,
        order: &[(usize, Pass)],
    ) -> Result<Vec<f64>> {
        let mut losses = vec![0.0; if self.is_last() { micro.len() } else { 0 }];
        for &(m, pass) in order {
            self.run_task(model, micro, loss, m, pass, &mut losses)?;
        }
        self.finish(model)?;
        Ok(losses)
    }

    /// One subtask: the forward or the backward of micro-batch `m` on this stage.
    fn run_task(
        &mut self,
        model: &Model,
        micro: &[MicroBatch],
        loss: &mut dyn FnMut(usize, &Tensor) -> Result<Tensor>,
        m: usize,
        pass: Pass,
        losses: &mut [f64],
    ) -> Result<()> {
        let mb = micro.get(m).ok_or_else(|| {
            Error::invalid("pipeline", format!("micro-batch {m} of {}", micro.len()))
        })?;
        let tag =
            u32::try_from(m).map_err(|_| Error::invalid("pipeline", "too many micro-batches"))?;
        match pass {
            Pass::Forward => {
                if self.live.contains_key(&m) {
                    return Err(Error::invalid(
                        "pipeline",
                        format!("micro-batch {m} runs forward twice"),
                    ));
                }
                let (input, out) = self.forward(model, mb, tag, true)?;
                let top = if self.is_last() {
                    let l = loss(m, &out)?;
                    losses[m] = l.double_value(&[]);
                    l
                } else {
                    out
                };
                self.live.insert(m, (input, top));
            }
            Pass::Backward => {
                let (input, top) = self.live.remove(&m).ok_or_else(|| {
                    Error::invalid(
                        "pipeline",
                        format!("micro-batch {m} runs backward before its forward"),
                    )
                })?;
                if self.is_last() {
                    top.f_backward()?;
                } else {
                    let shape = Self::act_shape(model, mb);
                    let link = self
                        .grad_in
                        .as_mut()
                        .ok_or_else(|| Error::invalid("pipeline", "no link from the next stage"))?;
                    let g = link.recv(&shape, top.kind(), model.device(), tag)?;
                    (top * g).f_sum(Kind::Float)?.f_backward()?;
                }
                if let (Some(x), Some(link)) = (input, self.grad_out.as_mut()) {
                    let g = x.grad();
                    if !g.defined() {
                        return Err(Error::invalid(
                            "pipeline",
                            "no gradient reached a stage's input",
                        ));
                    }
                    link.send(&g, tag)?;
                }
            }
        }
        Ok(())
    }

    /// Ends a training pass: every send delivered, no activation left, tied embeddings'
    /// gradients summed between the first and last stages.
    fn finish(&mut self, model: &Model) -> Result<()> {
        self.settle()?;
        if let Some(m) = self.live.keys().next() {
            return Err(Error::invalid(
                "pipeline",
                format!("micro-batch {m} ran forward but not backward"),
            ));
        }
        if let Some(t) = &self.tied {
            let mut grads: Vec<Tensor> = model
                .embedding_parameter()
                .map(|e| e.grad())
                .filter(|g| g.defined())
                .into_iter()
                .collect();
            t.all_reduce_coalesced(&mut grads, ReduceOp::Sum)?;
        }
        Ok(())
    }

    /// Waits for every send in flight.
    fn settle(&mut self) -> Result<()> {
        for link in [
            self.act_in.as_mut(),
            self.grad_out.as_mut(),
            self.act_out.as_mut(),
            self.grad_in.as_mut(),
        ]
        .into_iter()
        .flatten()
        {
            link.settle()?;
        }
        Ok(())
    }
}
