//! The collectives of a tensor-parallel forward over one group: Megatron-LM's differentiable
//! pair (`copy`, `reduce_sum`) and the plain ones vocab-parallel log-probabilities and
//! generation need (`reduce_max`, `gather`). `models::parallel` builds tensor-parallel layers
//! on them; nothing else should.
//!
//! The operations return new tensors and record autograd where their inputs do: `copy` is the
//! identity forward and sums gradients over the group backward (where a replicated activation
//! enters column-parallel products), `reduce_sum` sums forward and passes gradients through
//! (after row-parallel products). Under `no_grad` `copy` costs nothing. Every rank of the group
//! must issue the same operations in the same order; the backward pass issues its reductions
//! in the order of the (identical) graphs.

use std::sync::Arc;
use std::time::Duration;

use tch::Tensor;

use super::ffi::{self, RawTp};
use super::health::Heartbeat;
use super::{DistError, Result};

/// A tensor-parallel group: this rank's place in it and a handle on its backend.
#[derive(Debug)]
pub struct TensorParallel {
    raw: RawTp,
    rank: usize,
    size: usize,
    name: String,
    global_ranks: Vec<usize>,
    timeout: Duration,
    heartbeat: Arc<Heartbeat>,
}

impl TensorParallel {
    pub(crate) fn new(
        raw: RawTp,
        rank: usize,
        global_ranks: Vec<usize>,
        name: String,
        timeout: Duration,
        heartbeat: Arc<Heartbeat>,
    ) -> TensorParallel {
        TensorParallel {
            raw,
            rank,
            size: global_ranks.len(),
            name,
            global_ranks,
            timeout,
            heartbeat,
        }
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks share each layer.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The members' global ranks; index = rank in the group.
    pub fn global_ranks(&self) -> &[usize] {
        &self.global_ranks
    }

    /// The identity, whose gradient is summed over the group (Megatron's `f`).
    pub fn copy(&self, x: &Tensor) -> Result<Tensor> {
        self.run("tensor-parallel copy", || self.raw.copy(x))
    }

    /// The sum over the group, whose gradient passes through (Megatron's `g`).
    pub fn reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        self.run("tensor-parallel sum", || {
            self.raw.reduce(x, ffi::REDUCE_SUM)
        })
    }

    /// The element-wise maximum over the group, of a tensor without gradient.
    pub fn reduce_max(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.detach();
        self.run("tensor-parallel max", || {
            self.raw.reduce(&x, ffi::REDUCE_MAX)
        })
    }

    /// Every rank's `x` concatenated along dimension 0 in rank order, without gradient.
    pub fn gather(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.detach();
        self.run("tensor-parallel gather", || self.raw.all_gather(&x))
    }

    /// Every rank's `x` concatenated along dimension `dim`, without gradient.
    pub fn gather_along(&self, x: &Tensor, dim: i64) -> Result<Tensor> {
        let moved = x.transpose(0, dim).contiguous();
        let g = self.gather(&moved)?;
        Ok(g.transpose(0, dim).contiguous())
    }

    fn run(
        &self,
        op: &'static str,
        call: impl FnOnce() -> std::result::Result<Tensor, String>,
    ) -> Result<Tensor> {
        call().map_err(|message| DistError::Collective {
            op,
            group: self.name.clone(),
            rank: self.rank,
            timeout: self.timeout,
            message,
            diagnosis: Box::new(self.heartbeat.diagnose(&self.global_ranks)),
        })
    }
}
