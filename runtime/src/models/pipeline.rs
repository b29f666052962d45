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
//! Every link between neighbours has one group per direction, and sends run on a thread of
//! their own, so that a stage never blocks on a send: with only receives blocking, the
//! schedule's dependencies (acyclic) decide the order and no two stages wait on each other.

use std::ops::Range;
use std::thread::JoinHandle;

use tch::{Kind, Tensor};

use crate::dist::{ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use crate::models::model::Model;

/// A group of two used in one direction: sends run on a background thread that owns the
/// group while it sends and hands it back when done.
struct Link {
    group: Option<ProcessGroup>,
    pending: Option<JoinHandle<(ProcessGroup, crate::dist::Result<()>)>>,
    /// The peer's rank in the two-rank group.
    peer: usize,
}

impl Link {
    fn new(group: ProcessGroup) -> Link {
        let peer = 1 - group.rank();
        Link {
            group: Some(group),
            pending: None,
            peer,
        }
    }

    /// Waits for the send in flight, if any.
    fn settle(&mut self) -> Result<()> {
        if let Some(h) = self.pending.take() {
            let (group, result) = h
                .join()
                .map_err(|_| Error::invalid("pipeline", "a send thread panicked"))?;
            self.group = Some(group);
            result?;
        }
        Ok(())
    }

    fn group(&mut self) -> Result<&ProcessGroup> {
        self.settle()?;
        self.group
            .as_ref()
            .ok_or_else(|| Error::invalid("pipeline", "a link lost its group"))
    }

    /// Sends `t` (detached, contiguous) without waiting for the peer to receive it.
    fn send(&mut self, t: &Tensor, tag: u32) -> Result<()> {
        self.settle()?;
        let group = self
            .group
            .take()
            .ok_or_else(|| Error::invalid("pipeline", "a link lost its group"))?;
        let t = t.detach().contiguous();
        let peer = self.peer;
        self.pending = Some(std::thread::spawn(move || {
            let r = group.send(&t, peer, tag);
            (group, r)
        }));
        Ok(())
    }

    fn recv(&mut self, like: &[i64], kind: Kind, device: tch::Device, tag: u32) -> Result<Tensor> {
        let peer = self.peer;
        let group = self.group()?;
        let mut t = Tensor::f_zeros(like, (kind, device))?;
        group.recv(&mut t, peer, tag)?;
        Ok(t)
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
            let fwd = Link::new(group.subgroup(&pair)?);
            let bwd = Link::new(group.subgroup(&pair)?);
            Ok((fwd, bwd))
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

    fn is_last(&self) -> bool {
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
        let n = micro.len();
        let warmup = (self.stages - self.stage - 1).min(n);
        let mut live: std::collections::VecDeque<(usize, Option<Tensor>, Tensor)> =
            Default::default();
        let mut losses = Vec::new();
        let mut next_fwd = 0;
        let mut next_bwd = 0;
        let tag = |m: usize| -> Result<u32> {
            u32::try_from(m).map_err(|_| Error::invalid("pipeline", "too many micro-batches"))
        };
        while next_bwd < n {
            let forward_now = next_fwd < n && (next_fwd < warmup || next_fwd <= next_bwd + warmup);
            if forward_now {
                let m = next_fwd;
                let (input, out) = self.forward(model, &micro[m], tag(m)?, true)?;
                let top = if self.is_last() {
                    let l = loss(m, &out)?;
                    losses.push(l.double_value(&[]));
                    l
                } else {
                    out
                };
                live.push_back((m, input, top));
                next_fwd += 1;
                continue;
            }
            let (m, input, top) = live
                .pop_front()
                .ok_or_else(|| Error::invalid("pipeline", "1F1B lost a micro-batch"))?;
            if self.is_last() {
                top.f_backward()?;
            } else {
                let shape = Self::act_shape(model, &micro[m]);
                let link = self
                    .grad_in
                    .as_mut()
                    .ok_or_else(|| Error::invalid("pipeline", "no link from the next stage"))?;
                let g = link.recv(&shape, top.kind(), model.device(), tag(m)?)?;
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
                link.send(&g, tag(m)?)?;
            }
            next_bwd += 1;
        }
        self.settle()?;
        if let Some(t) = &self.tied {
            let mut grads: Vec<Tensor> = model
                .embedding_parameter()
                .map(|e| e.grad())
                .filter(|g| g.defined())
                .into_iter()
                .collect();
            t.all_reduce_coalesced(&mut grads, ReduceOp::Sum)?;
        }
        Ok(losses)
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
