//! Transfer plans of parameter reallocation (ReaL): which slice of which parameter goes from
//! which device to which when a model moves from one call's layout to another's.
//!
//! A Llama-family decoder's parameters are named by role ([`Param`]), the same way by the
//! planner (which has only the model's [`ModelShape`]) and the runtime (which maps roles to its
//! tensors). Under a layout, pipeline stage `s` holds layers `s·L/pp .. (s+1)·L/pp`, the first
//! stage the embedding, the last the final norm and the LM head (and the embedding too when
//! they are tied); tensor-parallel rank `t` holds its rows of the column-parallel projections
//! (query, key, value, gate, up; key and value only when the key/value heads divide by `tp`,
//! replicated otherwise), its columns of the row-parallel ones (output, down), its rows of the
//! vocabulary-parallel embedding and LM head, and the whole of every norm ([`shard`]). A bias
//! of a projection splits like the projection's rows.
//!
//! [`plan_reshard`] gives every device of the new layout exactly its new slices: a local copy
//! where the device already holds a piece, otherwise one sender per piece — spread over the
//! devices that hold it, so that no one device sends everything — to every device that needs
//! that piece (a broadcast when several do). [`TransferPlan::verify`] checks a plan against the
//! two layouts, so a plan read from a file is as trustworthy as one just computed.

use std::collections::BTreeMap;

use braid_cost::cost::ModelShape;
use serde::{Deserialize, Serialize};

use crate::exec_plan::Placement;
use crate::settings::Head;

/// The part of a decoder layer a parameter belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerPart {
    InputNorm,
    Q,
    K,
    V,
    O,
    PostNorm,
    Gate,
    Up,
    Down,
}

impl LayerPart {
    pub const ALL: [LayerPart; 9] = [
        LayerPart::InputNorm,
        LayerPart::Q,
        LayerPart::K,
        LayerPart::V,
        LayerPart::O,
        LayerPart::PostNorm,
        LayerPart::Gate,
        LayerPart::Up,
        LayerPart::Down,
    ];
}

/// A parameter of a Llama-family decoder, by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Param {
    Embed,
    Layer {
        layer: u32,
        part: LayerPart,
    },
    FinalNorm,
    /// A language model's output projection; absent when tied to the embedding.
    LmHead,
    /// A critic's or reward model's head (`score.weight`, one row per label).
    Score,
}

/// How tensor parallelism splits a parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds all of it.
    Replicated,
    /// Rows (`dim` 0) or columns (`dim` 1), in `units` equal groups of `unit` rows/columns
    /// (heads of `head_dim`, or single rows), split into `tp` contiguous runs of units.
    Dim { dim: u8, units: u64, unit: u64 },
}

/// Rows × columns of a parameter (a norm is one row of `hidden`).
pub fn dims(shape: &ModelShape, p: Param) -> (u64, u64) {
    let hd = head_dim(shape);
    let h = shape.hidden;
    match p {
        Param::Embed | Param::LmHead => (shape.vocab, h),
        Param::FinalNorm | Param::Score => (1, h),
        Param::Layer { part, .. } => match part {
            LayerPart::InputNorm | LayerPart::PostNorm => (1, h),
            LayerPart::Q => (shape.heads * hd, h),
            LayerPart::K | LayerPart::V => (shape.kv_heads * hd, h),
            LayerPart::O => (h, shape.heads * hd),
            LayerPart::Gate | LayerPart::Up => (shape.intermediate, h),
            LayerPart::Down => (h, shape.intermediate),
        },
    }
}

fn head_dim(shape: &ModelShape) -> u64 {
    shape.hidden / shape.heads.max(1)
}

/// How `tp` ranks split parameter `p`.
pub fn split(shape: &ModelShape, p: Param, tp: u64) -> Split {
    let hd = head_dim(shape);
    if tp <= 1 {
        return Split::Replicated;
    }
    match p {
        Param::Embed | Param::LmHead => Split::Dim {
            dim: 0,
            units: shape.vocab,
            unit: 1,
        },
        Param::FinalNorm | Param::Score => Split::Replicated,
        Param::Layer { part, .. } => match part {
            LayerPart::InputNorm | LayerPart::PostNorm => Split::Replicated,
            LayerPart::Q => Split::Dim {
                dim: 0,
                units: shape.heads,
                unit: hd,
            },
            LayerPart::K | LayerPart::V if shape.kv_heads.is_multiple_of(tp) => Split::Dim {
                dim: 0,
                units: shape.kv_heads,
                unit: hd,
            },
            LayerPart::K | LayerPart::V => Split::Replicated,
            LayerPart::O => Split::Dim {
                dim: 1,
                units: shape.heads,
                unit: hd,
            },
            LayerPart::Gate | LayerPart::Up => Split::Dim {
                dim: 0,
                units: shape.intermediate,
                unit: 1,
            },
            LayerPart::Down => Split::Dim {
                dim: 1,
                units: shape.intermediate,
                unit: 1,
            },
        },
    }
}

/// Every parameter of the model with head `head`, in order.
pub fn params(shape: &ModelShape, head: Head) -> Vec<Param> {
    let mut v = vec![Param::Embed];
    for layer in 0..shape.layers as u32 {
        v.extend(
            LayerPart::ALL
                .iter()
                .map(|&part| Param::Layer { layer, part }),
        );
    }
    v.push(Param::FinalNorm);
    match head {
        Head::Lm if !shape.tied_embeddings => v.push(Param::LmHead),
        Head::Lm => {}
        Head::Value | Head::Score => v.push(Param::Score),
    }
    v
}

/// A piece of a parameter: rows (`dim` 0) or columns (`dim` 1) `start..end` — always along the
/// parameter's split dimension ([`split_dim`]), the whole extent where a layout replicates it —
/// or, for a parameter never split (a norm, `dim` `None`), the whole of it (`0..1`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Slice {
    pub param: Param,
    pub dim: Option<u8>,
    pub start: u64,
    pub end: u64,
}

impl Slice {
    /// Elements in the slice.
    pub fn elements(&self, shape: &ModelShape) -> u64 {
        let (r, c) = dims(shape, self.param);
        match self.dim {
            None => r * c,
            Some(0) => (self.end - self.start) * c,
            Some(_) => (self.end - self.start) * r,
        }
    }
}

/// Whether pipeline stage `stage` of `pp` holds parameter `p`.
fn stage_holds(shape: &ModelShape, p: Param, stage: u64, pp: u64) -> bool {
    let last = pp.max(1) - 1;
    match p {
        Param::Embed => stage == 0 || (shape.tied_embeddings && stage == last),
        Param::FinalNorm | Param::LmHead | Param::Score => stage == last,
        Param::Layer { layer, .. } => {
            let per = shape.layers / pp.max(1);
            u64::from(layer) / per.max(1) == stage
        }
    }
}

/// The dimension tensor parallelism may split `p` along (`None`: never split, the norms).
pub fn split_dim(p: Param) -> Option<u8> {
    match p {
        Param::Embed | Param::LmHead => Some(0),
        Param::FinalNorm | Param::Score => None,
        Param::Layer { part, .. } => match part {
            LayerPart::InputNorm | LayerPart::PostNorm => None,
            LayerPart::Q | LayerPart::K | LayerPart::V | LayerPart::Gate | LayerPart::Up => Some(0),
            LayerPart::O | LayerPart::Down => Some(1),
        },
    }
}

/// The extent of `p` along `dim` (1 for the whole of a never-split parameter).
fn extent(shape: &ModelShape, p: Param, dim: Option<u8>) -> u64 {
    let (r, c) = dims(shape, p);
    match dim {
        None => 1,
        Some(0) => r,
        Some(_) => c,
    }
}

/// The part of `p` that tensor-parallel rank `t` of `tp` holds, along `p`'s split dimension
/// (the whole extent where this layout replicates it).
fn tp_slice(shape: &ModelShape, p: Param, t: u64, tp: u64) -> Slice {
    let dim = split_dim(p);
    match split(shape, p, tp) {
        Split::Replicated => Slice {
            param: p,
            dim,
            start: 0,
            end: extent(shape, p, dim),
        },
        Split::Dim { dim, units, unit } => {
            let per = units.div_ceil(tp);
            let lo = (t * per).min(units);
            let hi = ((t + 1) * per).min(units);
            Slice {
                param: p,
                dim: Some(dim),
                start: lo * unit,
                end: hi * unit,
            }
        }
    }
}

/// The slices `device` holds when the model (with head `head`) is laid out as `pl` (empty off
/// the mesh).
pub fn shard(shape: &ModelShape, head: Head, pl: &Placement, device: u64) -> Vec<Slice> {
    let Some(c) = pl.coords(device) else {
        return Vec::new();
    };
    params(shape, head)
        .into_iter()
        .filter(|p| stage_holds(shape, *p, c.pp, pl.pp))
        .map(|p| tp_slice(shape, p, c.tp, pl.tp))
        .filter(|s| s.start < s.end)
        .collect()
}

/// One move: `slice` from device `from` to every device of `to` (sorted). A destination equal
/// to `from` is a local copy.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Transfer {
    pub slice: Slice,
    pub from: u64,
    pub to: Vec<u64>,
}

/// Every move of one reshard, in a deterministic order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferPlan {
    pub transfers: Vec<Transfer>,
}

/// Whether `held` covers `start..end` along `dim` (slices of one parameter always share its
/// split dimension).
fn covers(held: &Slice, dim: Option<u8>, start: u64, end: u64) -> bool {
    held.dim == dim && held.start <= start && end <= held.end
}

/// The transfer plan that takes a model (with head `head`) laid out as `from` to the layout
/// `to`.
pub fn plan_reshard(
    shape: &ModelShape,
    head: Head,
    from: &Placement,
    to: &Placement,
) -> TransferPlan {
    // Per parameter, what each source device holds.
    let mut held: BTreeMap<Param, Vec<(u64, Slice)>> = BTreeMap::new();
    for d in from.devices() {
        for s in shard(shape, head, from, d) {
            held.entry(s.param).or_default().push((d, s));
        }
    }
    // Pieces each destination needs, cut at the sources' boundaries, with who can send them.
    // Key: the piece; value: (destinations, devices holding it).
    let mut pieces: BTreeMap<Slice, (Vec<u64>, Vec<u64>)> = BTreeMap::new();
    for d in to.devices() {
        for need in shard(shape, head, to, d) {
            let sources = held.get(&need.param).cloned().unwrap_or_default();
            // Boundaries of the source slices inside the needed range.
            let mut cuts = vec![need.start, need.end];
            for (_, s) in &sources {
                for b in [s.start, s.end] {
                    if need.start < b && b < need.end {
                        cuts.push(b);
                    }
                }
            }
            cuts.sort_unstable();
            cuts.dedup();
            for w in cuts.windows(2) {
                let piece = Slice {
                    start: w[0],
                    end: w[1],
                    ..need
                };
                let holders: Vec<u64> = sources
                    .iter()
                    .filter(|(_, s)| covers(s, piece.dim, piece.start, piece.end))
                    .map(|(dev, _)| *dev)
                    .collect();
                let e = pieces.entry(piece).or_default();
                e.0.push(d);
                e.1 = holders;
            }
        }
    }
    let mut transfers = Vec::new();
    for (i, (piece, (dests, holders))) in pieces.into_iter().enumerate() {
        let mut remote = Vec::new();
        for &d in &dests {
            if holders.contains(&d) {
                transfers.push(Transfer {
                    slice: piece,
                    from: d,
                    to: vec![d],
                });
            } else {
                remote.push(d);
            }
        }
        if remote.is_empty() || holders.is_empty() {
            continue;
        }
        // Spread the senders: consecutive pieces take consecutive holders.
        let from = holders[i % holders.len()];
        remote.sort_unstable();
        transfers.push(Transfer {
            slice: piece,
            from,
            to: remote,
        });
    }
    transfers.sort();
    TransferPlan { transfers }
}

/// A received piece of one parameter: its dimension and range.
type Piece = (Option<u8>, u64, u64);

impl TransferPlan {
    /// Bytes sent between devices (local copies excluded) at `dtype_bytes` per element.
    pub fn bytes_moved(&self, shape: &ModelShape, dtype_bytes: u64) -> u64 {
        self.transfers
            .iter()
            .map(|t| {
                let remote = t.to.iter().filter(|d| **d != t.from).count() as u64;
                t.slice.elements(shape) * dtype_bytes * remote
            })
            .sum()
    }

    /// Checks that the plan takes layout `from` to layout `to`: every transfer's sender holds
    /// its slice under `from`, and every device of `to` receives exactly its slices under
    /// `to`, each element once.
    pub fn verify(
        &self,
        shape: &ModelShape,
        head: Head,
        from: &Placement,
        to: &Placement,
    ) -> Result<(), String> {
        let mut got: BTreeMap<(u64, Param), Vec<Piece>> = BTreeMap::new();
        for (i, t) in self.transfers.iter().enumerate() {
            let s = &t.slice;
            if !params(shape, head).contains(&s.param) {
                return Err(format!("transfers[{i}]: the model has no {:?}", s.param));
            }
            if s.dim != split_dim(s.param) {
                return Err(format!(
                    "transfers[{i}]: {:?} is not sliced along that dimension",
                    s.param
                ));
            }
            if s.start >= s.end || s.end > extent(shape, s.param, s.dim) {
                return Err(format!(
                    "transfers[{i}]: slice {}..{} is out of range",
                    s.start, s.end
                ));
            }
            let sender_holds = shard(shape, head, from, t.from)
                .iter()
                .any(|h| h.param == s.param && covers(h, s.dim, s.start, s.end));
            if !sender_holds {
                return Err(format!(
                    "transfers[{i}]: device {} does not hold {:?} {}..{} in the source layout",
                    t.from, s.param, s.start, s.end
                ));
            }
            if t.to.is_empty() {
                return Err(format!("transfers[{i}]: no destination"));
            }
            for &d in &t.to {
                got.entry((d, s.param))
                    .or_default()
                    .push((s.dim, s.start, s.end));
            }
        }
        for d in to.devices() {
            for need in shard(shape, head, to, d) {
                let mut parts = got.remove(&(d, need.param)).unwrap_or_default();
                parts.sort_unstable();
                let (lo, hi) = (need.start, need.end);
                let mut at = lo;
                for (dim, s, e) in &parts {
                    if *dim != need.dim || *s != at {
                        return Err(format!(
                            "device {d} receives {:?} {s}..{e} but needs {lo}..{hi} once, in order",
                            need.param
                        ));
                    }
                    at = *e;
                }
                if at != hi {
                    return Err(format!(
                        "device {d} does not receive all of {:?} ({lo}..{hi})",
                        need.param
                    ));
                }
            }
        }
        if let Some(((d, p), _)) = got.into_iter().next() {
            return Err(format!(
                "device {d} receives {p:?}, which it does not hold in the new layout"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(layers: u64, heads: u64, kv: u64, tied: bool) -> ModelShape {
        ModelShape {
            name: "t".into(),
            layers,
            hidden: heads * 4,
            heads,
            kv_heads: kv,
            intermediate: 24,
            vocab: 37,
            tied_embeddings: tied,
            declared_params: None,
        }
    }

    fn layouts(devices: u64) -> Vec<Placement> {
        let mut v = Vec::new();
        for first in 0..devices {
            for dp in 1..=2u64 {
                for tp in 1..=2u64 {
                    for pp in 1..=2u64 {
                        let count = dp * tp * pp;
                        if first + count <= devices {
                            v.push(Placement {
                                first,
                                count,
                                dp,
                                tp,
                                pp,
                                microbatches: 1,
                            });
                        }
                    }
                }
            }
        }
        v
    }

    /// Every reshard between layouts of {dp 1–2, tp 1–2, pp 1–2} on overlapping and disjoint
    /// meshes of 4 devices gives each device exactly its new slices.
    #[test]
    fn every_reshard_between_small_layouts_verifies() {
        for (s, head) in [
            (shape(2, 4, 2, false), Head::Lm),
            (shape(4, 4, 1, true), Head::Lm),
            (shape(2, 2, 2, false), Head::Value),
        ] {
            let ls = layouts(4);
            for a in &ls {
                for b in &ls {
                    let plan = plan_reshard(&s, head, a, b);
                    plan.verify(&s, head, a, b)
                        .unwrap_or_else(|e| panic!("{a:?} -> {b:?}: {e}"));
                    if a.same_layout(b) {
                        assert!(
                            plan.transfers.iter().all(|t| t.to == [t.from]),
                            "{a:?}: only local copies"
                        );
                        assert_eq!(plan.bytes_moved(&s, 2), 0);
                    }
                }
            }
        }
    }

    #[test]
    fn verify_rejects_a_missing_or_wrong_piece() {
        let s = shape(2, 4, 2, false);
        let a = Placement {
            first: 0,
            count: 2,
            dp: 1,
            tp: 2,
            pp: 1,
            microbatches: 1,
        };
        let b = Placement {
            first: 2,
            count: 2,
            dp: 2,
            tp: 1,
            pp: 1,
            microbatches: 1,
        };
        let mut plan = plan_reshard(&s, Head::Lm, &a, &b);
        assert!(plan.bytes_moved(&s, 2) > 0);
        let t = plan.transfers.pop().expect("transfers");
        assert!(plan.verify(&s, Head::Lm, &a, &b).is_err());
        plan.transfers.push(Transfer { from: 3, ..t });
        assert!(
            plan.verify(&s, Head::Lm, &a, &b)
                .unwrap_err()
                .contains("does not hold")
        );
    }

    #[test]
    fn shards_partition_each_parameter() {
        let s = shape(4, 4, 2, false);
        let pl = Placement {
            first: 0,
            count: 4,
            dp: 1,
            tp: 2,
            pp: 2,
            microbatches: 1,
        };
        let mut q0: Vec<(u64, u64)> = Vec::new();
        for d in 0..4 {
            for sl in shard(&s, Head::Lm, &pl, d) {
                if sl.param
                    == (Param::Layer {
                        layer: 0,
                        part: LayerPart::Q,
                    })
                {
                    q0.push((sl.start, sl.end));
                }
            }
        }
        q0.sort_unstable();
        // Layer 0 is on stage 0 (devices 0 and 1), split by heads: rows 0..8 and 8..16.
        assert_eq!(q0, vec![(0, 8), (8, 16)]);
        let last = shard(&s, Head::Lm, &pl, 3);
        assert!(last.iter().any(|x| x.param == Param::LmHead));
        assert!(!last.iter().any(|x| x.param == Param::Embed));
    }
}
