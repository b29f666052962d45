//! The executor's side of multi-process runs: this process's rank in the plan's cluster, the
//! process groups the plan needs (created up front, in plan order, by their members only), and
//! the exchanges a step makes — values gathered onto every rank, gradients all-reduced in
//! buckets, finished samples streamed from generation ranks to the ranks of their consumers,
//! parameters sent by reshard transfer plans.
//!
//! One process per device (SPMD): every rank runs the same plan and walks the same task graph
//! in the same order, so every collective is called by the same ranks in the same order. With
//! one process nothing here talks to anyone: every exchange is the identity.
//!
//! Values every node computes are small next to the models (tokens and numbers of a batch), so
//! a model call's results are gathered onto every rank, and compute nodes (`fn` kernels,
//! arithmetic, losses) run on every rank on the same inputs, giving the same outputs. The
//! gather waits until a node first reads the results (its place in the order is the same on
//! every rank), so calls the plan puts on disjoint ranks run at the same time; likewise the
//! reshards after a training into the next iteration's calls wait for the end of the step
//! when no later call of the step uses the model they move.

use std::collections::BTreeMap;
use std::time::Duration;

use braid_cost::cost::exchange_inline_bytes;
use braid_ir::exec_plan::{Coords, ExecPlan, Placement};
use braid_ir::graph::{NodeId, Op};
use tch::{Device, Kind, Tensor};

use crate::dist::{GroupOptions, ProcessGroup, ReduceOp, World};
use crate::error::{Error, Result};

use super::Share;

/// Gradients are all-reduced in buckets of about this many bytes (as PyTorch's DDP does, 25
/// MB): few enough collectives to amortise their latency, small enough to bound the extra
/// memory of the flattened bucket.
pub const BUCKET_BYTES: usize = 25 << 20;

/// How a multi-process run reaches its peers.
#[derive(Debug, Clone)]
pub struct DistOptions {
    pub world: World,
    /// The longest any collective waits for a peer.
    pub timeout: Duration,
}

/// This rank's groups.
pub(super) struct Comm {
    pub(super) rank: usize,
    pub(super) size: usize,
    world: Option<ProcessGroup>,
    /// Per member list (global ranks, sorted): the group of the ranks of a model call's mesh.
    meshes: BTreeMap<Vec<usize>, ProcessGroup>,
    /// Per (generate, source rank, destination rank): the group of two that carries the
    /// generation's finished samples from one to the other, used by one thread on each side.
    streams: BTreeMap<(NodeId, usize, usize), ProcessGroup>,
    /// Per (model, share, generation replica): the group of a tensor-parallel copy this rank
    /// holds, one per copy (copies are used by different threads).
    tps: BTreeMap<TpCopy, ProcessGroup>,
    /// Per (generate, this rank, peer): the group of two samples travel on between two of its
    /// replicas, migrating or reallocated (`tail_pairs`).
    tails: BTreeMap<(NodeId, usize, usize), ProcessGroup>,
    /// Per generate: the group of this rank's tensor-parallel replica, on which its first
    /// rank tells the others what the replica does with its samples (`tail_deciders`).
    deciders: BTreeMap<NodeId, ProcessGroup>,
    /// A connection of its own to the run's store, for the generation threads' counters.
    counter: Option<crate::dist::Store>,
}

/// A tensor-parallel copy of a model: (model, share, whether it is the generation replica).
pub(super) type TpCopy = (u32, Share, bool);

impl Comm {
    /// One process: no peers.
    pub(super) fn single() -> Comm {
        Comm {
            rank: 0,
            size: 1,
            world: None,
            meshes: BTreeMap::new(),
            streams: BTreeMap::new(),
            tps: BTreeMap::new(),
            tails: BTreeMap::new(),
            deciders: BTreeMap::new(),
            counter: None,
        }
    }

    /// Joins the world and creates every group the plan needs, in plan order, each by its
    /// members only: the mesh of every model call with more than one device, then per
    /// `generate` the pairs of ranks its streamed samples travel between, then the group of
    /// every tensor-parallel copy in `tp_copies` (the same list, in the same order, on every
    /// rank).
    pub(super) fn connect(
        exec: &ExecPlan,
        dist: &DistOptions,
        tp_copies: &[TpCopy],
    ) -> Result<Comm> {
        let w = &dist.world;
        let world = ProcessGroup::init(w, GroupOptions::gloo(dist.timeout))?;
        let mut comm = Comm {
            rank: w.rank,
            size: w.size,
            world: None,
            meshes: BTreeMap::new(),
            streams: BTreeMap::new(),
            tps: BTreeMap::new(),
            tails: BTreeMap::new(),
            deciders: BTreeMap::new(),
            counter: None,
        };
        for members in mesh_groups(exec) {
            if members.contains(&comm.rank) {
                let g = world.subgroup(&members)?;
                comm.meshes.insert(members, g);
            }
        }
        for (generate, src, dst) in stream_pairs(exec) {
            if comm.rank == src || comm.rank == dst {
                let g = world.subgroup(&[src, dst])?;
                comm.streams.insert((generate, src, dst), g);
            }
        }
        for key in tp_copies {
            let members = key.1.tp_ranks();
            if members.contains(&comm.rank) {
                let g = world.subgroup(&members)?;
                comm.tps.insert(*key, g);
            }
        }
        let pairs = tail_pairs(exec);
        for &(generate, a, b) in &pairs {
            if comm.rank == a || comm.rank == b {
                let g = world.subgroup(&[a, b])?;
                let peer = if comm.rank == a { b } else { a };
                comm.tails.insert((generate, comm.rank, peer), g);
            }
        }
        for (generate, members) in tail_deciders(exec) {
            if members.contains(&comm.rank) {
                let g = world.subgroup(&members)?;
                comm.deciders.insert(generate, g);
            }
        }
        if !pairs.is_empty() {
            comm.counter = Some(world.store().reconnect()?);
        }
        comm.world = Some(world);
        Ok(comm)
    }

    /// The tensor-parallel group of copy `key` of a model, for `Model::shard`.
    pub(super) fn tensor_parallel(
        &self,
        key: &TpCopy,
    ) -> Result<std::sync::Arc<crate::dist::TensorParallel>> {
        let g = self.tps.get(key).ok_or_else(|| {
            Error::invalid(
                "plan",
                format!(
                    "rank {} has no tensor-parallel group for ranks {:?}",
                    self.rank,
                    key.1.tp_ranks()
                ),
            )
        })?;
        Ok(std::sync::Arc::new(g.tensor_parallel()?))
    }

    pub(super) fn is_single(&self) -> bool {
        self.size <= 1
    }

    /// The group of a mesh this rank belongs to (`None` with one device).
    pub(super) fn mesh(&self, p: &Placement) -> Result<Option<&ProcessGroup>> {
        if p.count <= 1 {
            return Ok(None);
        }
        let members: Vec<usize> = p.devices().map(|d| d as usize).collect();
        self.meshes.get(&members).map(Some).ok_or_else(|| {
            Error::invalid(
                "plan",
                format!("rank {} has no group for the mesh {members:?}", self.rank),
            )
        })
    }

    /// The group of `members` (global ranks, sorted), which `mesh_groups` lists.
    pub(super) fn group(&self, members: &[usize]) -> Result<Option<&ProcessGroup>> {
        if members.len() <= 1 {
            return Ok(None);
        }
        let mut m = members.to_vec();
        m.sort_unstable();
        self.meshes.get(&m).map(Some).ok_or_else(|| {
            Error::invalid(
                "plan",
                format!("rank {} has no group for the ranks {m:?}", self.rank),
            )
        })
    }

    /// The world group (`None` with one process).
    pub(super) fn world(&self) -> Option<&ProcessGroup> {
        self.world.as_ref()
    }

    /// Takes the group that carries samples of `generate` from `src` to `dst`, for the thread
    /// that uses it.
    pub(super) fn take_stream(
        &mut self,
        generate: NodeId,
        src: usize,
        dst: usize,
    ) -> Result<ProcessGroup> {
        self.streams.remove(&(generate, src, dst)).ok_or_else(|| {
            Error::invalid(
                "plan",
                format!(
                    "rank {}: no stream group {src} -> {dst} for {generate}",
                    self.rank
                ),
            )
        })
    }

    /// Gives a stream group back after its thread ended.
    pub(super) fn put_stream(&mut self, generate: NodeId, src: usize, dst: usize, g: ProcessGroup) {
        self.streams.insert((generate, src, dst), g);
    }

    /// Takes the group of two between this rank and `peer` that generation `generate`'s
    /// migrating tail travels on, for the generation thread.
    pub(super) fn take_tail(
        &mut self,
        generate: NodeId,
        rank: usize,
        peer: usize,
    ) -> Result<ProcessGroup> {
        self.tails.remove(&(generate, rank, peer)).ok_or_else(|| {
            Error::invalid(
                "plan",
                format!("rank {rank}: no migration group with rank {peer} for {generate}"),
            )
        })
    }

    /// Gives a migration group back after the generation thread ended.
    pub(super) fn put_tail(&mut self, generate: NodeId, rank: usize, peer: usize, g: ProcessGroup) {
        self.tails.insert((generate, rank, peer), g);
    }

    /// The group of this rank's replica of tensor-parallel generation `generate`, for the
    /// generation thread (given back with `put_decider`).
    pub(super) fn take_decider(&mut self, generate: NodeId) -> Option<ProcessGroup> {
        self.deciders.remove(&generate)
    }

    pub(super) fn put_decider(&mut self, generate: NodeId, g: ProcessGroup) {
        self.deciders.insert(generate, g);
    }

    /// The store connection for migration counters.
    pub(super) fn counter(&self) -> Result<crate::dist::Store> {
        self.counter
            .clone()
            .ok_or_else(|| Error::invalid("plan", "this run has no migration counter"))
    }

    /// Every rank's `mine`, by rank.
    pub(super) fn all_gather_bytes(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let Some(world) = &self.world else {
            return Ok(vec![mine]);
        };
        all_gather_bytes(world, mine)
    }

    pub(super) fn barrier(&self) -> Result<()> {
        if let Some(world) = &self.world {
            world.barrier()?;
        }
        Ok(())
    }

    /// Ends the run in order (every rank).
    pub(super) fn shutdown(&mut self) -> Result<()> {
        self.meshes.clear();
        self.streams.clear();
        self.tps.clear();
        self.tails.clear();
        self.deciders.clear();
        if let Some(world) = self.world.take() {
            world.shutdown()?;
        }
        Ok(())
    }
}

/// Every rank's bytes over `group`. One all-gather carries each rank's length and its first
/// [`exchange_inline_bytes`] bytes (padded to that); where a message is longer, a second
/// carries every rank's rest, padded to the longest rest. Every rank learns every length from
/// the first, so all agree on whether the second runs and on its size.
pub fn all_gather_bytes(group: &ProcessGroup, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
    let n = group.size();
    let cap = exchange_inline_bytes(n);
    let slot = LEN_BYTES + cap;
    let head = mine.len().min(cap);
    let mut first = vec![0u8; slot];
    first[..LEN_BYTES].copy_from_slice(&(mine.len() as u64).to_le_bytes());
    first[LEN_BYTES..LEN_BYTES + head].copy_from_slice(&mine[..head]);
    let all = gather_slots(group, &first)?;
    let mut lens = Vec::with_capacity(n);
    for r in 0..n {
        let mut b = [0u8; LEN_BYTES];
        b.copy_from_slice(&all[r * slot..r * slot + LEN_BYTES]);
        let len = u64::from_le_bytes(b);
        if len > MAX_MESSAGE {
            return Err(Error::invalid(
                "exchange",
                format!("rank {r} announced a message of {len} bytes"),
            ));
        }
        lens.push(len as usize);
    }
    let mut messages: Vec<Vec<u8>> = (0..n)
        .map(|r| {
            let at = r * slot + LEN_BYTES;
            all[at..at + lens[r].min(cap)].to_vec()
        })
        .collect();
    let rest = lens
        .iter()
        .map(|l| l.saturating_sub(cap))
        .max()
        .unwrap_or(0);
    if rest > 0 {
        let mut padded = mine[head..].to_vec();
        padded.resize(rest, 0);
        let all = gather_slots(group, &padded)?;
        for (r, m) in messages.iter_mut().enumerate() {
            m.extend_from_slice(&all[r * rest..r * rest + lens[r].saturating_sub(cap)]);
        }
    }
    Ok(messages)
}

/// Every rank's `slot` (of one length on every rank) over `group`, end to end in rank order.
fn gather_slots(group: &ProcessGroup, slot: &[u8]) -> Result<Vec<u8>> {
    let mut out = Tensor::zeros(
        [(group.size() * slot.len()) as i64],
        (Kind::Uint8, Device::Cpu),
    );
    group.all_gather(&mut out, &Tensor::from_slice(slot))?;
    Vec::<u8>::try_from(&out).map_err(Error::Torch)
}

/// The bytes of a message's length in [`all_gather_bytes`]'s first all-gather.
const LEN_BYTES: usize = 8;

/// The longest message [`all_gather_bytes`] takes a peer's word for (1 TiB): a longer one is
/// a corrupt exchange, not something to allocate.
const MAX_MESSAGE: u64 = 1 << 40;

/// Sums `values` over `group`, in place (in f64, so counts stay exact).
pub(super) fn sum(group: &ProcessGroup, values: &mut [f64]) -> Result<()> {
    if values.is_empty() {
        return Ok(());
    }
    let mut t = Tensor::from_slice(values);
    group.all_reduce(&mut t, ReduceOp::Sum)?;
    let out: Vec<f64> = Vec::<f64>::try_from(&t).map_err(Error::Torch)?;
    values.copy_from_slice(&out);
    Ok(())
}

/// Sums the gradients of `params` over `group` in buckets of about [`BUCKET_BYTES`], in place,
/// so that every rank of a data-parallel group steps with the whole batch's gradient. A
/// parameter whose gradient this rank never produced (its shard had no tokens) takes part
/// with zeros, so that every rank reduces the same list.
pub(super) fn all_reduce_gradients(group: &ProcessGroup, params: &[Tensor]) -> Result<()> {
    // Which gradients exist anywhere in the group: a parameter with one on some rank gets a
    // zero gradient on the others first.
    let mut defined: Vec<f64> = params
        .iter()
        .map(|p| f64::from(u8::from(p.grad().defined())))
        .collect();
    sum(group, &mut defined)?;
    let mut grads = Vec::new();
    for (p, &d) in params.iter().zip(&defined) {
        if d == 0.0 {
            continue;
        }
        if !p.grad().defined() {
            // A zero gradient of the parameter's shape, through autograd (tch has no setter).
            (p * 0.0).sum(Kind::Float).backward();
        }
        grads.push(p.grad());
    }
    all_reduce_tensors(group, grads)
}

/// Sums `tensors` over the group in place, in buckets of about `BUCKET_BYTES` (one coalesced
/// collective each).
pub(super) fn all_reduce_tensors(group: &ProcessGroup, tensors: Vec<Tensor>) -> Result<()> {
    let mut bucket: Vec<Tensor> = Vec::new();
    let mut bytes = 0usize;
    for g in tensors {
        bytes += g.numel() * g.kind().elt_size_in_bytes();
        bucket.push(g);
        if bytes >= BUCKET_BYTES {
            group.all_reduce_coalesced(&mut bucket, ReduceOp::Sum)?;
            bucket.clear();
            bytes = 0;
        }
    }
    if !bucket.is_empty() {
        group.all_reduce_coalesced(&mut bucket, ReduceOp::Sum)?;
    }
    Ok(())
}

/// The member lists of the groups the plan's model calls need beyond the world, in plan
/// order (topological), each once: the mesh of every call with more than one device, and for
/// every `train` cut by pipeline or tensor parallelism, or fused with another, the ranks of each (stage, tensor rank)
/// across its data-parallel replicas (which sum their gradients) and all ranks of each replica
/// (which sum the squares of their gradients for the norm).
pub fn mesh_groups(exec: &ExecPlan) -> Vec<Vec<usize>> {
    let g = &exec.plan.graph;
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut add = |mut members: Vec<usize>| {
        members.sort_unstable();
        if members.len() > 1 && !out.contains(&members) {
            out.push(members);
        }
    };
    for id in g.topo_order().unwrap_or_else(|| g.node_ids()) {
        for p in exec
            .decisions
            .placements
            .get(&id)
            .into_iter()
            .chain(exec.decisions.subtask_placements.get(&id))
        {
            add(p.devices().map(|d| d as usize).collect());
        }
        let fused = exec
            .decisions
            .interleave
            .iter()
            .any(|f| f.forward == id || f.reverse == id);
        if let (Some(Op::Train { .. }), Some(p)) = (g.node(id).map(|n| &n.op), exec.placement(id))
            && (p.pp > 1 || p.tp > 1 || fused)
        {
            let seats = seating(exec, id).unwrap_or_default();
            for s in 0..p.pp {
                for t in 0..p.tp {
                    add(dp_ranks(p, &seats, t, s));
                }
            }
            for k in 0..p.dp {
                add(replica_ranks(p, &seats, k));
            }
        }
    }
    out
}

/// The share of its model that call `id` runs on at `rank` (`None` when `rank` plays no
/// device of its mesh): its pipeline stage, and its tensor-parallel group.
pub(super) fn share_at(exec: &ExecPlan, id: NodeId, rank: usize) -> Result<Option<Share>> {
    let Some(p) = exec.placement(id) else {
        return Ok(None);
    };
    let seats = seating(exec, id)?;
    let Some(c) = played_by(&seats, rank).and_then(|d| p.coords(d)) else {
        return Ok(None);
    };
    let mut share = Share::WHOLE;
    if p.pp > 1 {
        share.stage = c.pp;
        share.stages = p.pp;
    }
    if p.tp > 1 {
        let ranks: Vec<usize> = (0..p.tp)
            .map(|t| {
                seat(
                    &seats,
                    p.device_at(Coords {
                        dp: c.dp,
                        tp: t,
                        pp: c.pp,
                    }),
                )
            })
            .collect();
        if ranks.windows(2).any(|w| w[1] != w[0] + 1) {
            return Err(Error::invalid(
                "plan",
                format!("{id}: the tensor-parallel ranks {ranks:?} are not consecutive"),
            ));
        }
        share.tp = p.tp;
        share.tp_first = ranks[0] as u64;
    }
    Ok(Some(share))
}

/// The ranks of (stage `stage`, tensor rank `tp`) of every data-parallel replica of a call on
/// `p`, by replica: the ranks that sum a training's gradients.
pub fn dp_ranks(p: &Placement, seats: &BTreeMap<u64, u64>, tp: u64, stage: u64) -> Vec<usize> {
    (0..p.dp)
        .map(|k| {
            seat(
                seats,
                p.device_at(Coords {
                    dp: k,
                    tp,
                    pp: stage,
                }),
            )
        })
        .collect()
}

/// The stages of replica `k` of a pipeline on `p` at tensor rank `tp`, in stage order: one
/// lane of the pipeline (activations are whole on every tensor rank, so each lane carries its
/// own).
pub fn lane_ranks(p: &Placement, seats: &BTreeMap<u64, u64>, k: u64, tp: u64) -> Vec<usize> {
    (0..p.pp)
        .map(|s| seat(seats, p.device_at(Coords { dp: k, tp, pp: s })))
        .collect()
}

/// Every rank of replica `k` of a call on `p` (its stages and tensor ranks), sorted.
pub fn replica_ranks(p: &Placement, seats: &BTreeMap<u64, u64>, k: u64) -> Vec<usize> {
    let mut out: Vec<usize> = (0..p.pp)
        .flat_map(|s| (0..p.tp).map(move |t| (s, t)))
        .map(|(s, t)| {
            seat(
                seats,
                p.device_at(Coords {
                    dp: k,
                    tp: t,
                    pp: s,
                }),
            )
        })
        .collect();
    out.sort_unstable();
    out
}

/// The rank that plays layout device `d` under `seats` (itself when not listed).
pub fn seat(seats: &BTreeMap<u64, u64>, d: u64) -> usize {
    seats.get(&d).copied().unwrap_or(d) as usize
}

/// The layout device rank `rank` plays under `seats` (the inverse of [`seat`]), or `None` when
/// its own device is seated elsewhere and it plays none.
pub fn played_by(seats: &BTreeMap<u64, u64>, rank: usize) -> Option<u64> {
    let r = rank as u64;
    match seats.iter().find(|(_, v)| **v == r) {
        Some((d, _)) => Some(*d),
        None if seats.contains_key(&r) => None,
        None => Some(r),
    }
}

/// Where the layout devices of `train` node `id` actually run: empty (each device itself)
/// unless it is the reverse model of a fused schedule (`microbatch-interleave`), whose
/// replica `r` of stage `s` the solver puts on device `stages - 1 - (r·pp + s)` of each forward
/// pipeline (`braid_cost::fused_pipeline::device_of`), so that the two models' pipelines run
/// in opposite directions. Refuses a pair of layouts the schedule cannot seat.
pub fn seating(exec: &ExecPlan, id: NodeId) -> Result<BTreeMap<u64, u64>> {
    let mut out = BTreeMap::new();
    let Some(f) = exec.decisions.interleave.iter().find(|f| f.reverse == id) else {
        return Ok(out);
    };
    let (Some(pf), Some(pr)) = (exec.placement(f.forward), exec.placement(f.reverse)) else {
        return Err(Error::invalid(
            "plan",
            format!(
                "the fused schedule of {} and {id} has no placements",
                f.forward
            ),
        ));
    };
    let per = pf.pp / pr.pp.max(1);
    if (pf.first, pf.count, pf.tp) != (pr.first, pr.count, pr.tp)
        || pr.pp == 0
        || !pf.pp.is_multiple_of(pr.pp)
        || pr.dp != pf.dp * per
    {
        return Err(Error::invalid(
            "plan",
            format!(
                "{id} is interleaved with {} on layouts the fused schedule cannot seat (dp {} pp {} against dp {} pp {})",
                f.forward, pr.dp, pr.pp, pf.dp, pf.pp
            ),
        ));
    }
    for j in 0..pr.dp {
        let (k, r) = (j / per, j % per);
        for s in 0..pr.pp {
            let stage = braid_cost::fused_pipeline::device_of(
                pf.pp as usize,
                1,
                pr.pp as usize,
                r as usize,
                s as usize,
            ) as u64;
            for t in 0..pr.tp {
                let layout = pr.device_at(braid_ir::exec_plan::Coords {
                    dp: j,
                    tp: t,
                    pp: s,
                });
                let actual = pf.device_at(braid_ir::exec_plan::Coords {
                    dp: k,
                    tp: t,
                    pp: stage,
                });
                out.insert(layout, actual);
            }
        }
    }
    Ok(out)
}

/// The data-parallel replica of a `generate` on placement `g` with `prompts` prompts of `n`
/// samples that generates sample `s`: prompts are split over its replicas in contiguous
/// blocks.
pub fn generating_replica(g: &Placement, prompts: usize, n: usize, s: usize) -> u64 {
    let dp = (g.dp.max(1)) as usize;
    let per = prompts.div_ceil(dp).max(1);
    ((s / n.max(1)) / per).min(dp - 1) as u64
}

/// The rank that gives sample `s` of a `generate` on `g` to rank `dst`: `dst` itself when it
/// is one of the (tensor-parallel) ranks that generate it, every one of which holds it;
/// otherwise one of them, chosen by `dst` so that the sends spread over the group.
pub fn sample_source(g: &Placement, prompts: usize, n: usize, s: usize, dst: usize) -> usize {
    let k = generating_replica(g, prompts, n, s);
    let tp = g.tp.max(1);
    let ranks: Vec<usize> = (0..tp)
        .map(|t| {
            g.device_at(Coords {
                dp: k,
                tp: t,
                pp: 0,
            }) as usize
        })
        .collect();
    if ranks.contains(&dst) {
        dst
    } else {
        ranks[dst % ranks.len()]
    }
}

/// The prompts replica `k` of `dp` generates: a contiguous block.
pub fn prompt_block(prompts: usize, dp: usize, k: usize) -> std::ops::Range<usize> {
    let per = prompts.div_ceil(dp.max(1)).max(1);
    (k * per).min(prompts)..((k + 1) * per).min(prompts)
}

/// The samples replica `k` of `dp` of an inference call (or a train's shard) takes: a
/// contiguous block.
pub fn sample_block(samples: usize, dp: usize, k: usize) -> std::ops::Range<usize> {
    let per = samples.div_ceil(dp.max(1)).max(1);
    (k * per).min(samples)..((k + 1) * per).min(samples)
}

/// The ranks of replica `k` of a call on placement `p` (pipeline rank 0), by tensor rank.
pub fn replica_tp_ranks(p: &Placement, k: usize) -> Vec<usize> {
    (0..p.tp.max(1))
        .map(|t| {
            p.device_at(Coords {
                dp: k as u64,
                tp: t,
                pp: 0,
            }) as usize
        })
        .collect()
}

/// The size of a generation's batch: prompts drawn by its `next` input, times `n`.
pub fn generation_size(exec: &ExecPlan, generate: NodeId) -> Option<(usize, usize)> {
    let g = &exec.plan.graph;
    let Some(Op::Generate { params, .. }) = g.node(generate).map(|n| &n.op) else {
        return None;
    };
    let prompts = g
        .inputs(generate)
        .first()
        .and_then(|p| match g.node(*p).map(|n| &n.op) {
            Some(Op::Next { count, .. }) => Some(*count as usize),
            _ => None,
        })?;
    Some((prompts, params.n.max(1) as usize))
}

/// Per `generate`, the (source, destination) pairs of ranks its streamed samples travel
/// between: from a rank that generates a sample (`sample_source`) to every other rank of a
/// streamed consumer's replica (each of its tensor ranks) needing it. In plan order.
pub fn stream_pairs(exec: &ExecPlan) -> Vec<(NodeId, usize, usize)> {
    let g = &exec.plan.graph;
    let mut out = Vec::new();
    for id in g.topo_order().unwrap_or_else(|| g.node_ids()) {
        let (Some(gp), Some((prompts, n))) = (exec.placement(id), generation_size(exec, id)) else {
            continue;
        };
        if !matches!(g.node(id).map(|x| &x.op), Some(Op::Generate { .. })) {
            continue;
        }
        let samples = prompts * n;
        let mut pairs: Vec<(usize, usize)> = Vec::new();
        for (c, _) in exec.streamed(id) {
            let Some(cp) = exec.placement(c) else {
                continue;
            };
            for k in 0..cp.dp.max(1) as usize {
                for dst in replica_tp_ranks(cp, k) {
                    for s in sample_block(samples, cp.dp.max(1) as usize, k) {
                        let src = sample_source(gp, prompts, n, s, dst);
                        if src != dst && !pairs.contains(&(src, dst)) {
                            pairs.push((src, dst));
                        }
                    }
                }
            }
        }
        pairs.sort_unstable();
        out.extend(pairs.into_iter().map(|(s, d)| (id, s, d)));
    }
    out
}

/// Whether generation `generate`'s replicas may hand samples to one another at run time: it
/// has data-parallel replicas (of any tensor-parallel width; the runtime generates without
/// pipeline stages).
pub fn reallocates(exec: &ExecPlan, generate: NodeId) -> bool {
    matches!(
        exec.plan.graph.node(generate).map(|n| &n.op),
        Some(Op::Generate { .. })
    ) && exec
        .placement(generate)
        .is_some_and(|p| p.pp <= 1 && p.dp >= 2)
}

/// Whether the runtime migrates generation `generate`'s tail: the plan decided it, and its
/// replicas may exchange samples (`reallocates`).
pub fn migrates(exec: &ExecPlan, generate: NodeId) -> bool {
    exec.decisions.migrations.contains_key(&generate) && reallocates(exec, generate)
}

/// Per `generate` whose replicas may exchange samples (`reallocates`), the pairs of ranks its
/// samples travel between: rank `t` of one replica with rank `t` of every other (a sample's
/// cache shard, and its copy of the sample, go from one tensor rank to the same one). In
/// plan order, each pair once, the lower rank first.
pub fn tail_pairs(exec: &ExecPlan) -> Vec<(NodeId, usize, usize)> {
    let g = &exec.plan.graph;
    let mut out = Vec::new();
    for id in g.topo_order().unwrap_or_else(|| g.node_ids()) {
        let Some(gp) = exec.placement(id).filter(|_| reallocates(exec, id)) else {
            continue;
        };
        let dp = gp.dp as usize;
        let mut pairs = Vec::new();
        for a in 0..dp {
            for b in a + 1..dp {
                let (ra, rb) = (replica_tp_ranks(gp, a), replica_tp_ranks(gp, b));
                for (x, y) in ra.into_iter().zip(rb) {
                    pairs.push((x.min(y), x.max(y)));
                }
            }
        }
        pairs.sort_unstable();
        pairs.dedup();
        out.extend(pairs.into_iter().map(|(k, r)| (id, k, r)));
    }
    out
}

/// Per `generate` whose tensor-parallel replicas may exchange samples, the ranks of each
/// replica: the group its first rank tells the others what the replica does next on.
pub fn tail_deciders(exec: &ExecPlan) -> Vec<(NodeId, Vec<usize>)> {
    let g = &exec.plan.graph;
    let mut out = Vec::new();
    for id in g.topo_order().unwrap_or_else(|| g.node_ids()) {
        let Some(gp) = exec.placement(id).filter(|_| reallocates(exec, id)) else {
            continue;
        };
        if gp.tp <= 1 {
            continue;
        }
        for k in 0..gp.dp as usize {
            out.push((id, replica_tp_ranks(gp, k)));
        }
    }
    out
}
