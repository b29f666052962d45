//! Parameter reallocation between calls (ReaL): the plan's `reshard`, `offload` and `reload`
//! nodes, run right after the call they follow (or, for reshards the plan lets wait, at the end
//! of the step or just before the call they serve: `Executor::transfers_wait`,
//! `Executor::transfers_defer`). A reshard runs its transfer plan — every slice
//! of every parameter from its sender to its receivers — in the plan's order on every rank
//! (`realloc::run_plan_mapped`), from the copy of the model the earlier call ran on here into
//! the copy the later one runs on (the whole model, a pipeline stage's share of it, either cut
//! for tensor parallelism: the planner's slices are the runtime's cuts, the vocabulary's
//! padding rows aside), so a training's updated weights reach its generation and inference
//! layouts. Offload moves a model's weights to host memory and reload
//! brings them back (nothing to move on a CPU).

use super::*;
use braid_cost::cost::ModelShape;
use braid_ir::transfer::{LayerPart, Param, Slice};
use realloc::{Mapping, Slices, run_plan_mapped};

impl<'p> Executor<'p> {
    /// Runs the transfer nodes that follow call `after`.
    pub(super) fn transfers_after(&mut self, after: NodeId) -> Result<()> {
        self.transfers_after_but(after, &[])
    }

    /// Runs the reshards from generation `generate`'s layout into that of a call streamed
    /// under it, before the generation starts: the plan puts them after the generation (the
    /// order of the calls), but a streamed call runs while it generates, on weights that do not
    /// change until the next training — so they move from the generation's copy first.
    /// Returns the reshards it ran (not to run again after the generation).
    pub(super) fn reshards_into_streamed(&mut self, generate: NodeId) -> Result<Vec<NodeId>> {
        let streamed: Vec<NodeId> = self
            .streamed(generate)
            .into_iter()
            .map(|(c, _)| c)
            .collect();
        let g = &self.plan.graph;
        let early: Vec<(NodeId, usize)> = g
            .node_ids()
            .into_iter()
            .filter_map(|id| match g.node(id).map(|n| &n.op) {
                Some(Op::Reshard {
                    model,
                    after,
                    before,
                    ..
                }) if *after == generate && streamed.contains(before) => {
                    Some((id, *model as usize))
                }
                _ => None,
            })
            .collect();
        for &(id, model) in &early {
            self.reshard(id, model)?;
        }
        Ok(early.into_iter().map(|(id, _)| id).collect())
    }

    /// Runs the transfer nodes that follow call `after`, but those in `done`.
    pub(super) fn transfers_after_but(&mut self, after: NodeId, done: &[NodeId]) -> Result<()> {
        let g = &self.plan.graph;
        let mut todo: Vec<NodeId> = Vec::new();
        for id in g.node_ids() {
            match g.node(id).map(|n| &n.op) {
                Some(Op::Reshard { after: a, .. }) | Some(Op::Offload { after: a, .. })
                    if *a == after && !done.contains(&id) =>
                {
                    todo.push(id)
                }
                _ => {}
            }
        }
        // A reload comes before the call it serves: run it after that call's predecessor in the
        // order, i.e. right before the call (handled by `reload_before`).
        for id in todo {
            match g.node(id).map(|n| n.op.clone()) {
                Some(Op::Reshard { model, .. }) => self.reshard(id, model as usize)?,
                Some(Op::Offload { model, .. }) => self.move_model(model as usize, Device::Cpu)?,
                _ => {}
            }
        }
        Ok(())
    }

    /// Releases the copies whose last use in the iteration is call `id` (after the transfers
    /// that read them): ReaL frees a layout's parameters once they have moved on.
    pub(super) fn release_copies(&mut self, id: NodeId) -> Result<()> {
        let Some(list) = self.release_after.get(&id).cloned() else {
            return Ok(());
        };
        for (m, s) in list {
            if let Some(v) = self.slots[m].views.get_mut(&s) {
                v.release()?;
            }
        }
        Ok(())
    }

    /// Runs the reload nodes that serve call `before`, just before it.
    pub(super) fn reloads_before(&mut self, before: NodeId) -> Result<()> {
        let g = &self.plan.graph;
        let reloads: Vec<u32> = g
            .node_ids()
            .into_iter()
            .filter_map(|id| match g.node(id).map(|n| &n.op) {
                Some(Op::Reload {
                    model, before: b, ..
                }) if *b == before => Some(*model),
                _ => None,
            })
            .collect();
        for model in reloads {
            self.move_model(model as usize, self.options.device)?;
        }
        Ok(())
    }

    /// Moves a model this rank holds (with its generation copy) to host memory (`Device::Cpu`)
    /// or back to its device: on a GPU through pinned host memory (`Model::offload`), so that
    /// the way back is one asynchronous DMA transfer per tensor.
    fn move_model(&mut self, model: usize, device: Device) -> Result<()> {
        for m in self.slots[model].copies_mut() {
            if device == Device::Cpu {
                m.offload()?;
            } else {
                m.reload()?;
            }
        }
        Ok(())
    }

    /// Which share of its model call `id` runs on here (`None` when this rank plays no device
    /// of its mesh).
    pub(super) fn share_of(&self, id: NodeId) -> Result<Option<Share>> {
        comm::share_at(self.exec, id, self.comm.rank)
    }

    /// Runs reshard node `id` of model `model`: its transfer plan from the layout of the call
    /// before it to the layout of the call after it (`realloc::run_plan_mapped`), from the
    /// copy the first runs on here into the copy the second runs on.
    fn reshard(&mut self, id: NodeId, model: usize) -> Result<()> {
        let Some(t) = self.exec.decisions.transfers.get(&id) else {
            return Err(Error::invalid("plan", format!("{id} has no transfer plan")));
        };
        let Some(Op::Reshard { after, before, .. }) =
            self.plan.graph.node(id).map(|n| n.op.clone())
        else {
            return Err(Error::invalid("plan", format!("{id} is not a reshard")));
        };
        let (Some(pa), Some(pb)) = (
            self.exec.placement(after).copied(),
            self.exec.placement(before).copied(),
        ) else {
            return Err(Error::invalid(
                "plan",
                format!("{id}: its calls have no placements"),
            ));
        };
        let (from, to) = (self.share_of(after)?, self.share_of(before)?);
        if from.is_none() && to.is_none() {
            return Ok(());
        }
        let Some(world) = self.comm.world() else {
            // One process: every call runs on the one whole model.
            return Ok(());
        };
        let (seat_from, seat_to) = (
            comm::seating(self.exec, after)?,
            comm::seating(self.exec, before)?,
        );
        if from.is_some() && from == to {
            // Both calls run on the same copy here: unless a slice moves between this rank and
            // another, every slice it would write is already in place (a reshard between two
            // data-parallel layouts on the same whole copy moves nothing here, as the plan's
            // zero bytes say, where copying the model onto itself showed as a 0.3–0.5 ms
            // `transfer` span in the timeline of `ppo_tiny` on 2 ranks).
            let rank = self.comm.rank as u64;
            let seat = |m: &BTreeMap<u64, u64>, d: u64| m.get(&d).copied().unwrap_or(d);
            let moves_here = t.plan.transfers.iter().any(|x| {
                let sender = seat(&seat_from, x.from);
                x.to.iter()
                    .map(|&d| seat(&seat_to, d))
                    .any(|r| r != sender && (sender == rank || r == rank))
            });
            if !moves_here {
                return Ok(());
            }
        }
        let slot = &self.slots[model];
        let any = slot.model()?;
        let shape = shape_of(any);
        let head = any.head();
        let kind = any.kind();
        let extra = extra_cols(any);
        let mut held = Slices::new();
        if let Some(f) = from {
            let m = slot.copy(f)?;
            let device = comm::played_by(&comm::seating(self.exec, after)?, self.comm.rank)
                .unwrap_or(u64::MAX);
            for s in braid_ir::transfer::shard(&shape, head, &pa, device) {
                held.insert(s, slice_tensor(m, &s)?);
            }
        }
        let map = Mapping {
            from: seat_from,
            to: seat_to,
            extra_cols: extra,
        };
        let out = run_plan_mapped(&t.plan, &shape, head, &pa, &pb, world, held, kind, &map)?;
        if let Some(b) = to {
            let slot = &mut self.slots[model];
            {
                let m = slot.copy_mut(b)?;
                // A copy released after its last use gets its storage back, then its values.
                m.materialize()?;
                for (s, t) in &out {
                    write_slice(m, s, t)?;
                }
            }
            if b == slot.replica_share
                && let Some(r) = slot.replica.as_ref()
            {
                if self.streams_off {
                    // Not generated on in this step: refreshed before it generates again.
                    slot.replica_stale = true;
                } else {
                    // The generation copy follows the copy of its share.
                    copy_weights(r, slot.copy(b)?)?;
                    slot.replica_stale = false;
                }
            }
        }
        Ok(())
    }
}

/// The planner's shape of `m` (what its transfer plans were made for).
pub(super) fn shape_of(m: &Model) -> ModelShape {
    let c = m.config();
    ModelShape {
        name: m.source().display().to_string(),
        layers: c.num_layers as u64,
        hidden: c.hidden_size as u64,
        heads: c.num_heads as u64,
        kv_heads: c.num_kv_heads as u64,
        intermediate: c.intermediate_size as u64,
        vocab: c.vocab_size as u64,
        tied_embeddings: c.tie_word_embeddings,
        declared_params: None,
    }
}

/// The parameters whose slices carry their bias as an extra column.
fn extra_cols(m: &Model) -> BTreeMap<Param, i64> {
    let names: BTreeSet<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
    let shape = shape_of(m);
    braid_ir::transfer::params(&shape, m.head())
        .into_iter()
        .filter(|p| {
            param_names(*p)
                .get(1)
                .is_some_and(|b| names.contains(b.as_str()))
        })
        .map(|p| (p, 1))
        .collect()
}

/// Where `m`'s tensors start along slice `s`'s dimension: a tensor-parallel copy holds exactly
/// its own slice of each parameter (the only slices a reshard reads from or writes into it),
/// starting at its row or column 0; a whole copy holds everything.
fn local(m: &Model, s: &Slice) -> Slice {
    if m.tensor_parallel().0 > 1 {
        Slice {
            start: 0,
            end: s.end - s.start,
            ..*s
        }
    } else {
        *s
    }
}

/// Slice `s` of `m`'s parameter as a `[rows, cols]` tensor (norms as one row), its bias (if
/// any) as one more column.
fn slice_tensor(m: &Model, s: &Slice) -> Result<Tensor> {
    let (w, b) = param_pair(m, s.param)?;
    let w2 = if w.dim() == 1 { w.unsqueeze(0) } else { w };
    let t = match b {
        Some(b) => Tensor::f_cat(&[w2, b.reshape([-1, 1]).to_kind(m.kind())], 1)?,
        None => w2,
    };
    Ok(realloc::cut(&t.detach(), &local(m, s))?.to_device(Device::Cpu))
}

/// Writes slice `s` (as `slice_tensor` gives it) into `m`'s parameter.
fn write_slice(m: &Model, s: &Slice, t: &Tensor) -> Result<()> {
    let (w, b) = param_pair(m, s.param)?;
    let s = &local(m, s);
    let device = w.device();
    let wcols = if w.dim() == 1 {
        w.size()[0]
    } else {
        w.size()[1]
    };
    let full = if w.dim() == 1 {
        w.unsqueeze(0)
    } else {
        w.shallow_clone()
    };
    let (mut wdst, mut bdst) = match s.dim {
        None => (full, b),
        Some(d) => {
            let len = (s.end - s.start) as i64;
            let bpart = match (&b, d) {
                (Some(b), 0) => Some(b.f_narrow(0, s.start as i64, len)?),
                (Some(b), _) => Some(b.shallow_clone()),
                (None, _) => None,
            };
            (full.f_narrow(i64::from(d), s.start as i64, len)?, bpart)
        }
    };
    let t = t.to_device(device);
    tch::no_grad(|| -> Result<()> {
        wdst.f_copy_(&t.f_narrow(1, 0, wdst.size()[1].min(wcols))?)?;
        if let Some(bd) = bdst.as_mut() {
            let col = t.f_narrow(1, t.size()[1] - 1, 1)?.reshape([-1]);
            if s.dim != Some(1) {
                bd.f_copy_(&col)?;
            }
        }
        Ok(())
    })
}

/// The weight of a parameter role and its bias, when the model has one.
fn param_pair(m: &Model, p: Param) -> Result<(Tensor, Option<Tensor>)> {
    let names = param_names(p);
    let all: BTreeMap<String, Tensor> = m.named_parameters().into_iter().collect();
    let w = all
        .get(&names[0])
        .map(Tensor::shallow_clone)
        .ok_or_else(|| {
            Error::invalid(
                "reshard",
                format!(
                    "the model has no `{}` (reshards move Llama-family models)",
                    names[0]
                ),
            )
        })?;
    let b = names
        .get(1)
        .and_then(|n| all.get(n))
        .map(Tensor::shallow_clone);
    Ok((w, b))
}

/// The Hugging Face names of a parameter role in a Llama-family model: the weight, and the
/// bias a projection may have.
fn param_names(p: Param) -> Vec<String> {
    match p {
        Param::Embed => vec!["model.embed_tokens.weight".into()],
        Param::FinalNorm => vec!["model.norm.weight".into()],
        Param::LmHead => vec!["lm_head.weight".into()],
        Param::Score => vec!["score.weight".into(), "score.bias".into()],
        Param::Layer { layer, part } => {
            let p = format!("model.layers.{layer}");
            let (module, norm) = match part {
                LayerPart::InputNorm => ("input_layernorm", true),
                LayerPart::PostNorm => ("post_attention_layernorm", true),
                LayerPart::Q => ("self_attn.q_proj", false),
                LayerPart::K => ("self_attn.k_proj", false),
                LayerPart::V => ("self_attn.v_proj", false),
                LayerPart::O => ("self_attn.o_proj", false),
                LayerPart::Gate => ("mlp.gate_proj", false),
                LayerPart::Up => ("mlp.up_proj", false),
                LayerPart::Down => ("mlp.down_proj", false),
            };
            if norm {
                vec![format!("{p}.{module}.weight")]
            } else {
                vec![format!("{p}.{module}.weight"), format!("{p}.{module}.bias")]
            }
        }
    }
}
