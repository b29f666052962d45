//! Collectives between processes, one process per device (SPMD), on PyTorch's c10d: Gloo for
//! CPU tensors, NCCL for CUDA tensors (cargo feature `nccl`). What an RLHF runtime needs and
//! no more: data-parallel gradient all-reduce in buckets, parameter broadcast and
//! point-to-point resharding, metric reduction.
//!
//! - [`World`] reads which rank this process is from the launcher's variables.
//! - [`Store`] is c10d's TCP store hosted by rank 0, through which groups rendezvous.
//! - [`ProcessGroup`] runs collectives on `tch::Tensor`s in place. Every operation waits at
//!   most the group's timeout and returns a `Result`; when a peer died, the error names it
//!   ([`DistError::dead_ranks`]), from heartbeats every process keeps in the store.
//!
//! The C++ side is `runtime/csrc/` (a shim over c10d compiled against the libtorch that tch
//! links); `ffi` is the only module that crosses into it. docs/distributed.md says why the
//! shim is sound against the torch wheel. This module must not invent a transport of its own.

mod ffi;
mod group;
mod health;
mod store;
mod tp;
mod world;

pub use group::{Backend, GroupOptions, ProcessGroup, ReduceOp};
pub use health::Diagnosis;
pub use store::Store;
pub use tp::TensorParallel;
pub use world::{Launcher, World, first_host};

/// What can go wrong in `dist`.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// The launcher's variables are missing or inconsistent.
    #[error("launch environment: {0}")]
    Environment(String),
    /// A store request failed: the store cannot be reached, or a wait timed out.
    #[error("{store}: {op} {key:?}: {message}")]
    Store {
        store: String,
        op: &'static str,
        key: String,
        message: String,
    },
    /// A collective (or a group's creation) failed on this rank. `diagnosis` says which peers
    /// the heartbeats show dead; the group is unusable afterwards.
    #[error(
        "{op} on {group} (rank {rank}, timeout {timeout:?}) failed: {message}; {}",
        diagnosis.summary
    )]
    Collective {
        op: &'static str,
        /// The group's name, with its members' global ranks.
        group: String,
        /// This process's rank in the group.
        rank: usize,
        /// The group's timeout.
        timeout: std::time::Duration,
        /// The backend's own message.
        message: String,
        /// Boxed: errors travel by value through every `Result` of the group.
        diagnosis: Box<Diagnosis>,
    },
    /// An earlier operation of this group failed; c10d groups cannot recover from that.
    #[error("{op} on {group}: the group failed earlier and cannot be used: {first}")]
    Broken {
        op: &'static str,
        group: String,
        first: String,
    },
    /// A request the group refuses before sending anything (a rank out of range, a bad
    /// member list).
    #[error("{0}")]
    Invalid(String),
}

impl DistError {
    pub(crate) fn invalid(what: impl Into<String>) -> Self {
        DistError::Invalid(what.into())
    }

    /// The global ranks this error blames: dead or stopped peers of a failed collective, or
    /// rank 0 when the store it hosts is gone. Empty when no peer could be blamed.
    pub fn dead_ranks(&self) -> &[usize] {
        match self {
            DistError::Collective { diagnosis, .. } => &diagnosis.dead,
            _ => &[],
        }
    }
}

/// `dist`'s result type.
pub type Result<T> = std::result::Result<T, DistError>;
