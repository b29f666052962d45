//! `reshard-insert` (ReaL parameter reallocation): where consecutive calls on one model use
//! different meshes or layouts, an explicit `reshard` node between them with the bytes that
//! move and the collectives that move them (and one from the model's last call back to its
//! first, for the next iteration). Frozen models whose devices other calls need get `offload`
//! and `reload` nodes: their weights go to host memory after their last call and come back
//! before their first.
//!
//! Bytes are counted per receiving device — the part of its new shard it does not already
//! hold ([`estimate::reshard_bytes`]); time is the busiest receiver's bytes over NVLink or the
//! network. Host transfers use [`HOST_BANDWIDTH`].

use std::collections::BTreeMap;

use braid_ir::graph::{DataTy, Gran, Node, NodeId, Op};
use braid_ir::transfer::{TransferPlan, plan_reshard};

use crate::annotated::{Annotated, Placement, TransferDecision};
use crate::estimate::{self, reshard_bytes, reshard_seconds};
use crate::passes::{Pass, PassError};

pub use crate::estimate::HOST_BANDWIDTH;

pub struct ReshardInsert;

impl Pass for ReshardInsert {
    fn name(&self) -> &'static str {
        "reshard-insert"
    }

    fn summary(&self) -> &'static str {
        "reshard nodes between calls on one model with different layouts; offload frozen models"
    }

    fn run(&self, a: &mut Annotated) -> Result<(), PassError> {
        let placements = estimate::placements(a);
        let mut by_model: BTreeMap<u32, Vec<NodeId>> = BTreeMap::new();
        for id in a.calls() {
            if let Some(m) = a.plan.graph.node(id).and_then(|n| n.op.model()) {
                by_model.entry(m).or_default().push(id);
            }
        }
        for (&model, calls) in &by_model {
            let Some(shape) = a.shape(model).cloned() else {
                continue;
            };
            let mut pairs: Vec<(NodeId, NodeId, bool)> =
                calls.windows(2).map(|w| (w[0], w[1], false)).collect();
            if calls.len() > 1
                && let (Some(&first), Some(&last)) = (calls.first(), calls.last())
            {
                pairs.push((last, first, true));
            }
            for (after, before, wrap) in pairs {
                let (Some(pa), Some(pb)) = (placements.get(&after), placements.get(&before)) else {
                    continue;
                };
                if pa.same_layout(pb) {
                    continue;
                }
                let (bytes, most) = reshard_bytes(&shape, a.dtype_bytes(model), pa, pb);
                let seconds = reshard_seconds(a, most, pa, pb);
                let id = insert(
                    a,
                    Op::Reshard {
                        model,
                        after,
                        before,
                        bytes,
                    },
                    after,
                );
                let why = format!(
                    "{} uses {}, {} uses {}{}",
                    a.call_name(after),
                    crate::passes::place::describe(pa),
                    a.call_name(before),
                    crate::passes::place::describe(pb),
                    if wrap {
                        " (for the next iteration)"
                    } else {
                        ""
                    }
                );
                a.decisions.transfers.insert(
                    id,
                    TransferDecision {
                        bytes,
                        collectives: collectives(pa, pb, bytes),
                        seconds,
                        plan: plan_reshard(&shape, a.plan.models[model as usize].head, pa, pb),
                        why,
                    },
                );
            }
        }
        // Offload frozen models whose weights would crowd out another model's call.
        let usable = a.cost.device.usable_memory();
        for o in estimate::offloads(a, &placements) {
            let (model, first, last, other, need, weights) =
                (o.model, o.first, o.last, o.other, o.need, o.weights);
            let Some(pm) = placements.get(&first) else {
                continue;
            };
            let bytes = weights * pm.count;
            let seconds = o.seconds;
            let why = format!(
                "{} needs {:.1} GB per device and {}'s weights take {:.1} GB of the {:.1} GB usable",
                a.call_name(other),
                need as f64 / 1e9,
                a.model_name(model),
                weights as f64 / 1e9,
                usable as f64 / 1e9
            );
            let off = insert(
                a,
                Op::Offload {
                    model,
                    after: last,
                    bytes,
                },
                last,
            );
            a.decisions.transfers.insert(
                off,
                TransferDecision {
                    bytes,
                    collectives: vec!["device-to-host copy".into()],
                    seconds,
                    // Every device of the mesh copies its own shard to host memory.
                    plan: TransferPlan::default(),
                    why: why.clone(),
                },
            );
            let re = insert(
                a,
                Op::Reload {
                    model,
                    before: first,
                    bytes,
                },
                first,
            );
            a.decisions.transfers.insert(
                re,
                TransferDecision {
                    bytes,
                    collectives: vec!["host-to-device copy".into()],
                    seconds,
                    // Every device of the mesh copies its own shard back from host memory.
                    plan: TransferPlan::default(),
                    why,
                },
            );
        }
        Ok(())
    }
}

/// Adds a transfer node with the span of the call it belongs to.
fn insert(a: &mut Annotated, op: Op, near: NodeId) -> NodeId {
    let span = a.plan.graph.node(near).map_or((0, 0), |n| n.span);
    a.plan.graph.add_node(Node {
        op,
        ty: DataTy::Unit,
        gran: Gran::Batch,
        span,
        label: None,
        micro_batch: None,
    })
}

/// The collectives that move parameters from `from` to `to`.
fn collectives(from: &Placement, to: &Placement, bytes: u64) -> Vec<String> {
    let mut v = Vec::new();
    if from.pp != to.pp {
        v.push(format!(
            "point-to-point send/recv of layers (pp {} → {})",
            from.pp, to.pp
        ));
    }
    if to.tp < from.tp {
        v.push(format!(
            "all-gather over tensor-parallel groups (tp {} → {})",
            from.tp, to.tp
        ));
    } else if to.tp > from.tp {
        v.push(format!("local slicing (tp {} → {})", from.tp, to.tp));
    }
    if (from.first, from.count) != (to.first, to.count) {
        v.push(format!(
            "broadcast from devices {}..{} to {}..{}",
            from.first,
            from.first + from.count,
            to.first,
            to.first + to.count
        ));
    } else if to.dp > 1 && bytes > 0 && from.dp != to.dp {
        v.push(format!("broadcast over {} data-parallel replicas", to.dp));
    }
    if v.is_empty() {
        v.push("none (shards already in place)".into());
    }
    v
}
