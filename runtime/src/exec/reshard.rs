//! Parameter reallocation between calls (ReaL): the plan's `reshard`, `offload` and `reload`
//! nodes, run right after the call they follow. A reshard runs its transfer plan — every slice
//! of every parameter from its sender to its receivers — in the plan's order on every rank,
//! so sends and receives meet; a local copy is nothing to do, since a rank holds one copy of
//! each model for all its calls. Offload moves a model's weights to host memory and reload
//! brings them back (nothing to move on a CPU).

use super::*;
use braid_ir::transfer::{LayerPart, Param};

impl<'p> Executor<'p> {
    /// Runs the transfer nodes that follow call `after`.
    pub(super) fn transfers_after(&mut self, after: NodeId) -> Result<()> {
        let g = &self.plan.graph;
        let mut todo: Vec<NodeId> = Vec::new();
        for id in g.node_ids() {
            match g.node(id).map(|n| &n.op) {
                Some(Op::Reshard { after: a, .. }) | Some(Op::Offload { after: a, .. })
                    if *a == after =>
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
        let slot = &mut self.slots[model];
        for m in [slot.model.as_mut(), slot.replica.as_mut()]
            .into_iter()
            .flatten()
        {
            if device == Device::Cpu {
                m.offload()?;
            } else {
                m.reload()?;
            }
        }
        Ok(())
    }

    /// Runs reshard node `id` of model `model`: its transfer plan, in order.
    fn reshard(&mut self, id: NodeId, model: usize) -> Result<()> {
        let Some(t) = self.exec.decisions.transfers.get(&id) else {
            return Err(Error::invalid("plan", format!("{id} has no transfer plan")));
        };
        let rank = self.comm.rank as u64;
        let slot = &mut self.slots[model];
        let mut moved = false;
        for tr in &t.plan.transfers {
            let remote: Vec<u64> = tr.to.iter().copied().filter(|d| *d != tr.from).collect();
            if remote.is_empty() {
                continue;
            }
            let sending = tr.from == rank;
            let receiving = remote.contains(&rank);
            if !sending && !receiving {
                continue;
            }
            let m = slot.model.as_mut().ok_or_else(|| {
                Error::invalid(
                    format!("model `{}`", slot.spec.name),
                    format!("a transfer of {id} involves rank {rank}, which does not hold it"),
                )
            })?;
            let tensors = param_tensors(m, tr.slice.param)?;
            // Data-parallel layouts move whole parameters: the runtime has no tensor- or
            // pipeline-parallel shards to cut (refused when the run is set up).
            for mut t in tensors {
                if sending {
                    for d in &remote {
                        self.comm.send(&t.detach(), *d as usize)?;
                    }
                } else {
                    let mut buf = t.detach().zeros_like();
                    self.comm.recv(&mut buf, tr.from as usize)?;
                    tch::no_grad(|| t.copy_(&buf));
                    moved = true;
                }
            }
        }
        if moved && let (Some(m), Some(r)) = (slot.model.as_ref(), slot.replica.as_mut()) {
            copy_weights(r, m)?;
        }
        Ok(())
    }
}

/// The tensors of a parameter role in a Llama-family model (a projection's bias with its
/// weight).
fn param_tensors(m: &Model, p: Param) -> Result<Vec<Tensor>> {
    let names: Vec<String> = match p {
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
    };
    let all: BTreeMap<String, Tensor> = m.named_parameters().into_iter().collect();
    let first = names.first().cloned().unwrap_or_default();
    let out: Vec<Tensor> = names
        .iter()
        .filter_map(|n| all.get(n).map(Tensor::shallow_clone))
        .collect();
    if out.is_empty() {
        return Err(Error::invalid(
            "reshard",
            format!("the model has no `{first}` (reshards move Llama-family models)"),
        ));
    }
    Ok(out)
}
