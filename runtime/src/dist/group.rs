//! Process groups: a c10d backend (Gloo or NCCL) over some ranks, and the collectives an RLHF
//! runtime uses, in place on `tch::Tensor`s. Every operation is bounded by the group's timeout;
//! a failure is diagnosed through the heartbeats (`health`) and leaves the group unusable,
//! because a c10d group whose peers disagree on how many operations completed cannot be
//! resynchronised. Mistakes this rank can see before sending anything (a root out of range, an
//! output of the wrong size) are `DistError::Invalid` and leave the group usable: every rank of
//! an SPMD program makes the same mistake, so none of them sends.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tch::Tensor;

use super::ffi::{self, RawGroup};
use super::health::Heartbeat;
use super::{DistError, Result, Store, World};

/// The world group's key prefix in the store; sub-groups' prefixes extend it.
const WORLD_PREFIX: &str = "braid/group/world";

/// The reduction of `all_reduce` and `reduce_scatter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the group's size. Gloo has no average; it is a sum followed by a
    /// division there, so it needs floating-point tensors.
    Avg,
    Max,
    Min,
}

impl ReduceOp {
    fn code(self) -> std::ffi::c_int {
        match self {
            ReduceOp::Sum => ffi::REDUCE_SUM,
            ReduceOp::Avg => ffi::REDUCE_AVG,
            ReduceOp::Max => ffi::REDUCE_MAX,
            ReduceOp::Min => ffi::REDUCE_MIN,
        }
    }
}

/// Which c10d backend a group runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Gloo over TCP, for CPU tensors. Its sockets use the interfaces in `GLOO_SOCKET_IFNAME`,
    /// else the address this host's name resolves to (c10d's default).
    Gloo,
    /// NCCL on CUDA device `device` (this process's device, usually its local rank).
    #[cfg(feature = "nccl")]
    Nccl { device: usize },
}

/// How a group is created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupOptions {
    pub backend: Backend,
    /// The longest any operation of the group (and its creation) may wait for its peers.
    pub timeout: Duration,
    /// How often this process beats in the store. A failed operation watches its peers for
    /// three intervals before it returns, so an error takes at most `timeout + 3 * heartbeat`.
    pub heartbeat: Duration,
}

impl GroupOptions {
    /// Gloo with `timeout`, beating ten times per timeout (between every 10 ms and every 1 s).
    pub fn gloo(timeout: Duration) -> GroupOptions {
        GroupOptions {
            backend: Backend::Gloo,
            timeout,
            heartbeat: (timeout / 10).clamp(Duration::from_millis(10), Duration::from_secs(1)),
        }
    }

    /// NCCL on CUDA device `device` with `timeout`; the heartbeat as for [`GroupOptions::gloo`].
    #[cfg(feature = "nccl")]
    pub fn nccl(device: usize, timeout: Duration) -> GroupOptions {
        GroupOptions {
            backend: Backend::Nccl { device },
            ..GroupOptions::gloo(timeout)
        }
    }
}

/// A c10d process group. Its operations must be called in the same order on every member (as
/// in c10d); the type is `Send` but not `Sync` so that one thread issues them.
#[derive(Debug)]
pub struct ProcessGroup {
    raw: RawGroup,
    /// "group [0, 1, 2]": the members' global ranks, for messages.
    name: String,
    /// This process's rank in the group.
    rank: usize,
    /// The members' global ranks; index = rank in the group.
    global_ranks: Vec<usize>,
    options: GroupOptions,
    /// The store the world group was created on; sub-groups take prefixed views of it.
    store: Store,
    /// This group's key prefix in `store`.
    prefix: String,
    heartbeat: Arc<Heartbeat>,
    /// How many sub-groups with each member list this group created: the prefix of the next
    /// one. Only members count, and they create the same groups in the same order, so they
    /// agree on it without talking.
    subgroups: RefCell<BTreeMap<Vec<usize>, usize>>,
    /// The first failure, after which the group refuses every operation.
    failed: RefCell<Option<String>>,
}

impl ProcessGroup {
    /// The world group of the launcher's processes: the store at `MASTER_ADDR:MASTER_PORT`
    /// (hosted by rank 0) and a group of every rank on it.
    pub fn init(world: &World, options: GroupOptions) -> Result<ProcessGroup> {
        let store = Store::for_world(world, options.timeout)?;
        ProcessGroup::new(&store, world.rank, world.size, options)
    }

    /// The world group of `size` processes meeting in `store`, this one being `rank`. It starts
    /// this process's heartbeat. One world group per store: sub-groups come from
    /// [`ProcessGroup::subgroup`].
    pub fn new(
        store: &Store,
        rank: usize,
        size: usize,
        options: GroupOptions,
    ) -> Result<ProcessGroup> {
        if rank >= size {
            return Err(DistError::invalid(format!(
                "rank {rank} is not below the group size {size}"
            )));
        }
        if store.add(&format!("braid/world-groups/{rank}"), 1)? > 1 {
            return Err(DistError::invalid(format!(
                "rank {rank} already created a world group on this store; create sub-groups \
                 with ProcessGroup::subgroup"
            )));
        }
        let heartbeat = Arc::new(Heartbeat::start(store, rank, options.heartbeat)?);
        ProcessGroup::create(
            store.clone(),
            WORLD_PREFIX.to_owned(),
            rank,
            (0..size).collect(),
            options,
            heartbeat,
        )
    }

    fn create(
        store: Store,
        prefix: String,
        rank: usize,
        global_ranks: Vec<usize>,
        options: GroupOptions,
        heartbeat: Arc<Heartbeat>,
    ) -> Result<ProcessGroup> {
        let name = format!("group {global_ranks:?}");
        let size = global_ranks.len();
        let group_store = store.prefixed(&prefix)?;
        let raw = match options.backend {
            Backend::Gloo => RawGroup::gloo(group_store.raw(), rank, size, options.timeout),
            #[cfg(feature = "nccl")]
            Backend::Nccl { device } => {
                RawGroup::nccl(group_store.raw(), rank, size, device, options.timeout)
            }
        };
        let raw = raw.map_err(|message| DistError::Collective {
            op: "create",
            group: name.clone(),
            rank,
            timeout: options.timeout,
            message,
            diagnosis: Box::new(heartbeat.diagnose(&global_ranks)),
        })?;
        Ok(ProcessGroup {
            raw,
            name,
            rank,
            global_ranks,
            options,
            store,
            prefix,
            heartbeat,
            subgroups: RefCell::new(BTreeMap::new()),
            failed: RefCell::new(None),
        })
    }

    /// A group of `members` (ranks of this group, in any order; the new group numbers them in
    /// increasing order). Collective over the members only: each member calls it with the same
    /// list, in the same order relative to its other sub-group creations; other ranks do not
    /// call it. The caller must be a member.
    pub fn subgroup(&self, members: &[usize]) -> Result<ProcessGroup> {
        let mut members = members.to_vec();
        members.sort_unstable();
        if members.is_empty() {
            return Err(DistError::invalid("a sub-group needs at least one member"));
        }
        if let Some(pair) = members.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(DistError::invalid(format!(
                "sub-group member {} is listed twice",
                pair[0]
            )));
        }
        if let Some(&bad) = members.iter().find(|&&m| m >= self.size()) {
            return Err(DistError::invalid(format!(
                "sub-group member {bad} is not a rank of {} (size {})",
                self.name,
                self.size()
            )));
        }
        let Some(rank) = members.iter().position(|&m| m == self.rank) else {
            return Err(DistError::invalid(format!(
                "rank {} of {} is not in the sub-group {members:?}: only members create it",
                self.rank, self.name
            )));
        };
        let nth = {
            let mut created = self.subgroups.borrow_mut();
            let count = created.entry(members.clone()).or_insert(0);
            *count += 1;
            *count - 1
        };
        let list: Vec<String> = members.iter().map(usize::to_string).collect();
        let prefix = format!("{}/sub[{}]#{nth}", self.prefix, list.join(","));
        let global_ranks = members.iter().map(|&m| self.global_ranks[m]).collect();
        ProcessGroup::create(
            self.store.clone(),
            prefix,
            rank,
            global_ranks,
            self.options.clone(),
            self.heartbeat.clone(),
        )
    }

    /// The store this group meets in (without its key prefix): for counters the ranks share
    /// outside collectives.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Ends a run in order, on every rank of the world group: a barrier, then this process's
    /// heartbeat stops and marks it exited, and rank 0, whose process hosts the store, waits
    /// (up to the timeout) until every other rank has done so before closing it. Dropping the
    /// group instead is abrupt: peers still talking to rank 0's store see it vanish, and their
    /// diagnoses blame rank 0. Sub-groups are dropped, not shut down.
    pub fn shutdown(self) -> Result<()> {
        if self.prefix != WORLD_PREFIX {
            return Err(DistError::invalid(format!(
                "shutdown is for the world group; drop {} instead",
                self.name
            )));
        }
        self.barrier()?;
        self.heartbeat.stop();
        if self.rank == 0 {
            let others = &self.global_ranks[1..];
            self.heartbeat
                .wait_exited(others, self.options.timeout)
                .map_err(|e| DistError::Collective {
                    op: "shutdown",
                    group: self.name.clone(),
                    rank: self.rank,
                    timeout: self.options.timeout,
                    message: e.to_string(),
                    diagnosis: Box::new(self.heartbeat.diagnose(others)),
                })?;
        }
        Ok(())
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of members.
    pub fn size(&self) -> usize {
        self.global_ranks.len()
    }

    /// The members' global ranks, in group-rank order.
    pub fn global_ranks(&self) -> &[usize] {
        &self.global_ranks
    }

    /// The longest an operation waits for its peers.
    pub fn timeout(&self) -> Duration {
        self.options.timeout
    }

    /// This group as a tensor-parallel group (`dist::TensorParallel`): a handle on the same
    /// backend for the collectives of tensor-parallel layers, which autograd graphs keep alive.
    /// Its operations must not interleave with this group's own on another thread.
    pub fn tensor_parallel(&self) -> Result<super::TensorParallel> {
        if let Some(first) = self.failed.borrow().as_ref() {
            return Err(DistError::Broken {
                op: "tensor_parallel",
                group: self.name.clone(),
                first: first.clone(),
            });
        }
        let raw = ffi::RawTp::new(&self.raw, self.options.timeout).map_err(DistError::Invalid)?;
        Ok(super::TensorParallel::new(
            raw,
            self.rank,
            self.global_ranks.clone(),
            self.name.clone(),
            self.options.timeout,
            self.heartbeat.clone(),
        ))
    }

    /// Reduces `tensor` over the group, in place on every rank.
    pub fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
        check_defined("all_reduce", tensor)?;
        self.check_average("all_reduce", op, tensor)?;
        self.run("all_reduce", |raw, timeout| {
            raw.all_reduce(std::slice::from_mut(tensor), op.code(), timeout)
        })
    }

    /// Reduces each of `tensors` over the group in one operation (a gradient bucket), in place.
    /// They may differ in shape but must share a dtype and device. Nothing to reduce is no
    /// operation.
    pub fn all_reduce_coalesced(&self, tensors: &mut [Tensor], op: ReduceOp) -> Result<()> {
        if tensors.is_empty() {
            return Ok(());
        }
        for t in tensors.iter() {
            check_defined("all_reduce_coalesced", t)?;
            self.check_average("all_reduce_coalesced", op, t)?;
        }
        self.run("all_reduce_coalesced", |raw, timeout| {
            raw.all_reduce(tensors, op.code(), timeout)
        })
    }

    /// Copies `root`'s `tensor` into every other rank's `tensor`.
    pub fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<()> {
        check_defined("broadcast", tensor)?;
        self.check_rank("broadcast root", root)?;
        self.run("broadcast", |raw, timeout| {
            raw.broadcast(tensor, root, timeout)
        })
    }

    /// Gathers every rank's `input` into `output`, `size` blocks of `input`'s shape
    /// concatenated along dimension 0, in rank order.
    pub fn all_gather(&self, output: &mut Tensor, input: &Tensor) -> Result<()> {
        check_defined("all_gather", output)?;
        check_defined("all_gather", input)?;
        self.check_blocks("all_gather", output, input)?;
        self.run("all_gather", |raw, timeout| {
            raw.all_gather(output, input, timeout)
        })
    }

    /// Reduces `input` (`size` blocks of `output`'s shape along dimension 0) over the group
    /// and leaves block `rank` of the result in `output`.
    pub fn reduce_scatter(&self, output: &mut Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
        check_defined("reduce_scatter", output)?;
        check_defined("reduce_scatter", input)?;
        self.check_blocks("reduce_scatter", input, output)?;
        self.check_average("reduce_scatter", op, output)?;
        self.run("reduce_scatter", |raw, timeout| {
            raw.reduce_scatter(output, input, op.code(), timeout)
        })
    }

    /// Sends `tensor` to rank `dst`, matched by `dst`'s `recv(_, this rank, tag)`.
    pub fn send(&self, tensor: &Tensor, dst: usize, tag: u32) -> Result<()> {
        check_defined("send", tensor)?;
        self.check_peer("send to", dst, tag)?;
        self.run_with_peer("send", dst, |raw, timeout| {
            raw.send(tensor, dst, tag, timeout)
        })
    }

    /// Receives into `tensor` (of the sent shape and dtype) what rank `src` sends with `tag`.
    pub fn recv(&self, tensor: &mut Tensor, src: usize, tag: u32) -> Result<()> {
        check_defined("recv", tensor)?;
        self.check_peer("receive from", src, tag)?;
        self.run_with_peer("recv", src, |raw, timeout| {
            raw.recv(tensor, src, tag, timeout)
        })
    }

    /// Returns once every rank has called it (and this rank's earlier operations are done).
    pub fn barrier(&self) -> Result<()> {
        self.run("barrier", |raw, timeout| raw.barrier(timeout))
    }

    fn run(
        &self,
        op: &'static str,
        call: impl FnOnce(&RawGroup, Duration) -> std::result::Result<(), String>,
    ) -> Result<()> {
        self.run_among(op, &self.global_ranks, call)
    }

    /// A point-to-point operation only depends on one peer: only it is diagnosed.
    fn run_with_peer(
        &self,
        op: &'static str,
        peer: usize,
        call: impl FnOnce(&RawGroup, Duration) -> std::result::Result<(), String>,
    ) -> Result<()> {
        let peer = [self.global_ranks[peer]];
        self.run_among(op, &peer, call)
    }

    fn run_among(
        &self,
        op: &'static str,
        suspects: &[usize],
        call: impl FnOnce(&RawGroup, Duration) -> std::result::Result<(), String>,
    ) -> Result<()> {
        if let Some(first) = self.failed.borrow().as_ref() {
            return Err(DistError::Broken {
                op,
                group: self.name.clone(),
                first: first.clone(),
            });
        }
        let Err(message) = call(&self.raw, self.options.timeout) else {
            return Ok(());
        };
        let error = DistError::Collective {
            op,
            group: self.name.clone(),
            rank: self.rank,
            timeout: self.options.timeout,
            message,
            diagnosis: Box::new(self.heartbeat.diagnose(suspects)),
        };
        *self.failed.borrow_mut() = Some(error.to_string());
        Err(error)
    }

    fn check_rank(&self, what: &str, rank: usize) -> Result<()> {
        if rank >= self.size() {
            return Err(DistError::invalid(format!(
                "{what} {rank} is not a rank of {} (size {})",
                self.name,
                self.size()
            )));
        }
        Ok(())
    }

    fn check_peer(&self, what: &str, peer: usize, tag: u32) -> Result<()> {
        self.check_rank(what, peer)?;
        if i32::try_from(tag).is_err() {
            return Err(DistError::invalid(format!(
                "tag {tag} exceeds c10d's largest tag {}",
                i32::MAX
            )));
        }
        if peer == self.rank {
            return Err(DistError::invalid(format!(
                "rank {} of {} cannot {what} itself",
                self.rank, self.name
            )));
        }
        Ok(())
    }

    /// Gloo averages by dividing a sum, which an integer tensor cannot hold.
    fn check_average(&self, op: &str, reduce: ReduceOp, tensor: &Tensor) -> Result<()> {
        if reduce == ReduceOp::Avg
            && self.options.backend == Backend::Gloo
            && !tensor.is_floating_point()
            && !tensor.is_complex()
        {
            return Err(DistError::invalid(format!(
                "{op}: Gloo averages floating-point tensors only, got {:?}",
                tensor.kind()
            )));
        }
        Ok(())
    }

    /// `whole` must hold `size` blocks of `block`, of the same dtype.
    fn check_blocks(&self, op: &str, whole: &Tensor, block: &Tensor) -> Result<()> {
        let size = self.size();
        if whole.kind() != block.kind() {
            return Err(DistError::invalid(format!(
                "{op}: dtypes differ ({:?} and {:?})",
                whole.kind(),
                block.kind()
            )));
        }
        let (whole_n, block_n) = (whole.numel(), block.numel());
        if whole_n != block_n * size {
            return Err(DistError::invalid(format!(
                "{op} on {}: {whole_n} elements is not {size} blocks of {block_n}",
                self.name
            )));
        }
        Ok(())
    }
}

fn check_defined(op: &str, tensor: &Tensor) -> Result<()> {
    if !tensor.defined() {
        return Err(DistError::invalid(format!("{op}: undefined tensor")));
    }
    Ok(())
}

impl std::fmt::Display for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (rank {})", self.name, self.rank)
    }
}

#[cfg(test)]
mod tests {
    use super::super::health::ranks;
    use super::*;

    #[test]
    fn heartbeat_defaults_scale_with_the_timeout() {
        assert_eq!(
            GroupOptions::gloo(Duration::from_secs(5)).heartbeat,
            Duration::from_millis(500)
        );
        assert_eq!(
            GroupOptions::gloo(Duration::from_secs(600)).heartbeat,
            Duration::from_secs(1)
        );
        assert_eq!(
            GroupOptions::gloo(Duration::from_millis(20)).heartbeat,
            Duration::from_millis(10)
        );
        assert_eq!(ranks(&[2]), "rank 2");
        assert_eq!(ranks(&[1, 3]), "ranks 1, 3");
    }
}
