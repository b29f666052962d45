//! Parameter reallocation (ReaL) between any two layouts: a transfer plan
//! (`braid_ir::transfer::plan_reshard`) run on the ranks of a world group, from the slices each
//! rank holds under the source layout to the slices it must hold under the destination layout.
//!
//! Slices are named as the planner names them (`Slice`: a parameter role and a range of rows or
//! columns along its split dimension), so what moves is exactly what the plan says. Every rank
//! walks the plan's transfers in its (deterministic) order: the sender cuts the piece out of a
//! slice it holds, a local copy stays on the rank, a remote piece goes point to point to each
//! destination (tagged with the transfer's index); then each rank assembles its new slices from
//! the pieces, in order along the split dimension. Because every rank walks the same order, the
//! earliest unfinished transfer always has all its participants at it: no cycle of waits.
//! A source slice is dropped after the last transfer that reads it, so its memory is released
//! while the rest of the plan runs (when nothing else holds it).

use std::collections::BTreeMap;

use braid_cost::cost::ModelShape;
use braid_ir::exec_plan::Placement;
use braid_ir::settings::Head;
use braid_ir::transfer::{Param, Slice, TransferPlan, dims, shard, split_dim};
use tch::{Kind, Tensor};

use crate::dist::ProcessGroup;
use crate::error::{Error, Result};
use crate::exec::comm::BUCKET_BYTES;

/// The slices of one model a rank holds, by the planner's names.
pub type Slices = BTreeMap<Slice, Tensor>;

/// Rows × columns of parameter `p` as a tensor shape (norms and heads are one row).
fn param_shape(shape: &ModelShape, p: Param) -> (i64, i64) {
    let (r, c) = dims(shape, p);
    (r as i64, c as i64)
}

/// `slice` of the whole parameter `full` (`[rows, cols]`), contiguous.
pub fn cut(full: &Tensor, slice: &Slice) -> Result<Tensor> {
    let t = match slice.dim {
        None => full.shallow_clone(),
        Some(d) => full.f_narrow(
            i64::from(d),
            slice.start as i64,
            (slice.end - slice.start) as i64,
        )?,
    };
    Ok(t.f_contiguous()?)
}

/// The slices `device` holds under `layout`, cut from whole parameters (`whole(p)`,
/// `[rows, cols]`; norms as one row).
pub fn slices_of(
    shape: &ModelShape,
    head: Head,
    layout: &Placement,
    device: u64,
    whole: &dyn Fn(Param) -> Result<Tensor>,
) -> Result<Slices> {
    let mut out = Slices::new();
    for s in shard(shape, head, layout, device) {
        out.insert(s, cut(&whole(s.param)?, &s)?);
    }
    Ok(out)
}

/// Where two layouts' devices sit and what rides along with their slices, for
/// [`run_plan_mapped`]: `from` and `to` map a layout's device to the rank that holds what the
/// layout gives that device (a device not listed is its own rank), for a model whose stages
/// run on its mesh in another order than the layout's (the reverse model of a fused schedule);
/// `extra_cols` are columns appended to a parameter's slices (a projection's bias, one column
/// per row), which move with the rows they belong to.
#[derive(Clone, Debug, Default)]
pub struct Mapping {
    pub from: BTreeMap<u64, u64>,
    pub to: BTreeMap<u64, u64>,
    pub extra_cols: BTreeMap<Param, i64>,
}

/// Runs `plan` (from layout `from` to layout `to` of a model of `shape` and `head`) on rank
/// `rank` of `world`, whose ranks are the cluster's devices: `held` are this rank's slices
/// under `from` (empty off its mesh), consumed; returns its slices under `to` (empty off that
/// mesh), in `kind`. Checks the plan against the layouts first (`TransferPlan::verify`), so
/// every rank refuses a wrong plan before anything is sent.
#[allow(clippy::too_many_arguments)]
pub fn run_plan(
    plan: &TransferPlan,
    shape: &ModelShape,
    head: Head,
    from: &Placement,
    to: &Placement,
    world: &ProcessGroup,
    held: Slices,
    kind: Kind,
) -> Result<Slices> {
    run_plan_mapped(
        plan,
        shape,
        head,
        from,
        to,
        world,
        held,
        kind,
        &Mapping::default(),
    )
}

/// [`run_plan`] with the devices of either layout seated elsewhere and extra columns riding
/// along ([`Mapping`]).
#[allow(clippy::too_many_arguments)]
pub fn run_plan_mapped(
    plan: &TransferPlan,
    shape: &ModelShape,
    head: Head,
    from: &Placement,
    to: &Placement,
    world: &ProcessGroup,
    mut held: Slices,
    kind: Kind,
    map: &Mapping,
) -> Result<Slices> {
    plan.verify(shape, head, from, to)
        .map_err(|e| Error::invalid("reshard", e))?;
    for (p, &extra) in &map.extra_cols {
        if extra != 0 && split_dim(*p) == Some(1) && from.tp.max(to.tp) > 1 {
            return Err(Error::invalid(
                "reshard",
                format!("{p:?} splits its columns, so no extra column can ride along"),
            ));
        }
    }
    let rank = world.rank() as u64;
    let seat = |m: &BTreeMap<u64, u64>, d: u64| m.get(&d).copied().unwrap_or(d);
    // The layout device whose slices this rank holds (the inverse of the seating; none when
    // its own device is seated elsewhere).
    let device_of = |m: &BTreeMap<u64, u64>| {
        m.iter()
            .find(|(_, r)| **r == rank)
            .map(|(d, _)| *d)
            .unwrap_or(if m.contains_key(&rank) {
                u64::MAX
            } else {
                rank
            })
    };
    let (me_from, me_to) = (device_of(&map.from), device_of(&map.to));
    let wanted = shard(shape, head, to, me_to);
    for s in shard(shape, head, from, me_from) {
        if !held.contains_key(&s) {
            return Err(Error::invalid(
                "reshard",
                format!("rank {rank} does not hold {s:?}, which the source layout gives it"),
            ));
        }
    }
    // The last transfer that reads each held slice.
    let mut last_use: BTreeMap<Slice, usize> = BTreeMap::new();
    for (i, t) in plan.transfers.iter().enumerate() {
        if seat(&map.from, t.from) == rank
            && let Some(src) = source_of(&held, &t.slice)
        {
            last_use.insert(src, i);
        }
    }
    // Each transfer's receive shape (rows, columns of what it moves).
    let dims_of = |t: &braid_ir::transfer::Transfer| {
        let (rows, cols) = param_shape(shape, t.slice.param);
        let cols = cols + map.extra_cols.get(&t.slice.param).copied().unwrap_or(0);
        let len = (t.slice.end - t.slice.start) as i64;
        match t.slice.dim {
            None => [rows, cols],
            Some(0) => [len, cols],
            Some(_) => [rows, len],
        }
    };
    // The transfers between two ranks travel together, packed in buckets of about
    // `BUCKET_BYTES` (one message each instead of one per slice: on Gloo every message costs
    // a round of latency, which dominated the reshards of small models). Buckets go in the
    // order of their first transfer, the same on every rank, and each involves two ranks only,
    // so the earliest one not yet done always has both ranks at it: no rank waits forever.
    let elem = kind.elt_size_in_bytes() as i64;
    let mut buckets: Vec<(u64, u64, Vec<usize>)> = Vec::new();
    {
        let mut open: BTreeMap<(u64, u64), (usize, i64)> = BTreeMap::new();
        for (i, t) in plan.transfers.iter().enumerate() {
            let sender = seat(&map.from, t.from);
            let [r, c] = dims_of(t);
            for &d in &t.to {
                let receiver = seat(&map.to, d);
                if receiver == sender || (sender != rank && receiver != rank) {
                    continue;
                }
                let bytes = r * c * elem;
                match open.get_mut(&(sender, receiver)) {
                    Some((b, size)) if *size + bytes <= BUCKET_BYTES as i64 => {
                        buckets[*b].2.push(i);
                        *size += bytes;
                    }
                    _ => {
                        open.insert((sender, receiver), (buckets.len(), bytes));
                        buckets.push((sender, receiver, vec![i]));
                    }
                }
            }
        }
    }
    let mut pieces: BTreeMap<Param, Vec<(Slice, Tensor)>> = BTreeMap::new();
    // This rank's own pieces (sender and receiver here), and the slices its sends read.
    let mut outgoing: BTreeMap<usize, Tensor> = BTreeMap::new();
    for (i, t) in plan.transfers.iter().enumerate() {
        if seat(&map.from, t.from) != rank {
            continue;
        }
        let src = source_of(&held, &t.slice).ok_or_else(|| {
            Error::invalid(
                "reshard",
                format!("rank {rank} holds no slice covering {:?}", t.slice),
            )
        })?;
        let piece = sub_slice(&held[&src], &src, &t.slice)?;
        if t.to.iter().any(|&d| seat(&map.to, d) == rank) {
            pieces
                .entry(t.slice.param)
                .or_default()
                .push((t.slice, piece.copy()));
        }
        if t.to.iter().any(|&d| seat(&map.to, d) != rank) {
            outgoing.insert(i, piece);
        }
        if last_use.get(&src) == Some(&i) {
            // Its last reader: release it now (when the caller keeps no other handle).
            held.remove(&src);
        }
    }
    for (sender, receiver, list) in &buckets {
        let tag = u32::try_from(list[0]).map_err(|_| {
            Error::invalid("reshard", "a transfer plan of more than 2^32 transfers")
        })?;
        if *sender == rank {
            let flat: Vec<Tensor> =
                list.iter()
                    .map(|i| {
                        outgoing.get(i).map(|t| t.reshape([-1])).ok_or_else(|| {
                            Error::invalid("reshard", format!("transfer {i} unsent"))
                        })
                    })
                    .collect::<Result<_>>()?;
            let packed = Tensor::f_cat(&flat, 0)?.f_to_kind(kind)?;
            world.send(&packed, *receiver as usize, tag)?;
        } else {
            let shapes: Vec<[i64; 2]> = list.iter().map(|&i| dims_of(&plan.transfers[i])).collect();
            let total: i64 = shapes.iter().map(|[r, c]| r * c).sum();
            let mut buf = Tensor::f_zeros([total], (kind, tch::Device::Cpu))?;
            world.recv(&mut buf, *sender as usize, tag)?;
            let mut at = 0;
            for (&i, [r, c]) in list.iter().zip(&shapes) {
                let part = buf.f_narrow(0, at, r * c)?.f_reshape([*r, *c])?;
                at += r * c;
                let t = &plan.transfers[i];
                pieces
                    .entry(t.slice.param)
                    .or_default()
                    .push((t.slice, part));
            }
        }
    }
    let mut out = Slices::new();
    for need in wanted {
        let mut parts: Vec<(Slice, Tensor)> = pieces
            .get(&need.param)
            .map(|v| {
                v.iter()
                    .filter(|(s, _)| need.start <= s.start && s.end <= need.end)
                    .map(|(s, t)| (*s, t.shallow_clone()))
                    .collect()
            })
            .unwrap_or_default();
        parts.sort_by_key(|(s, _)| s.start);
        let covered: u64 = parts.iter().map(|(s, _)| s.end - s.start).sum();
        let contiguous = parts.windows(2).all(|w| w[0].0.end == w[1].0.start);
        if parts.is_empty()
            || covered != need.end - need.start
            || !contiguous
            || parts[0].0.start != need.start
        {
            return Err(Error::invalid(
                "reshard",
                format!("rank {rank} did not receive all of {need:?}"),
            ));
        }
        let tensor = match need.dim {
            Some(d) if parts.len() > 1 => {
                let ts: Vec<Tensor> = parts.into_iter().map(|(_, t)| t).collect();
                Tensor::f_cat(&ts, i64::from(d))?
            }
            _ => parts.remove(0).1,
        };
        out.insert(need, tensor);
    }
    Ok(out)
}

/// The held slice that covers `piece` (the first, in order, when several do).
fn source_of(held: &Slices, piece: &Slice) -> Option<Slice> {
    held.keys()
        .find(|s| {
            s.param == piece.param
                && s.dim == piece.dim
                && s.start <= piece.start
                && piece.end <= s.end
        })
        .copied()
}

/// `piece` of the held slice `src` (tensor `t`).
fn sub_slice(t: &Tensor, src: &Slice, piece: &Slice) -> Result<Tensor> {
    Ok(match piece.dim {
        None => t.shallow_clone(),
        Some(d) => t
            .f_narrow(
                i64::from(d),
                (piece.start - src.start) as i64,
                (piece.end - piece.start) as i64,
            )?
            .f_contiguous()?,
    })
}
