//! Tensor parallelism (Megatron-LM's layout) for the Llama family, Mistral, Qwen2 and GPT-2:
//! which slice of each parameter a rank of a tensor-parallel group keeps, and the
//! vocab-parallel log-probabilities and entropy that never gather the full logits.
//!
//! Layout on a group of `n` ranks, rank `r`:
//! - column-parallel (output features split, rank `r` keeps block `r`): query, key and value
//!   projections (GPT-2's fused `c_attn` block by block), gate and up projections (`c_fc`);
//!   their biases with them;
//! - row-parallel (input features split): the attention output and down projections
//!   (`c_proj`); the partial products are summed over the group and the bias, kept whole on
//!   every rank, is added once after the sum;
//! - attention heads split across the group; key/value heads split when `n` divides their
//!   number, otherwise kept whole on every rank (each rank's queries then read the heads of
//!   their groups, and the key/value projections' gradients are summed over the group);
//! - vocab-parallel embedding and language-model head: rank `r` keeps rows
//!   `[r·⌈V/n⌉, (r+1)·⌈V/n⌉)` of the vocabulary, padded with zero rows on the last rank when
//!   `n` does not divide `V` (GPT-2's 50,257); padded logits are `-inf`;
//! - norms, GPT-2's position embedding and value/score heads whole on every rank.
//!
//! A model is built whole and then cut (`Model::shard`): every rank reads the same checkpoint
//! (or draws the same seeded weights) and keeps its slices, so a tensor-parallel model holds
//! exactly the one-process model's values, bit for bit, and `gather_parameters` puts them back.

use std::sync::Arc;

use tch::{Device, Kind, Tensor};

use crate::dist::TensorParallel;
use crate::error::{Error, Result};
use crate::models::config::{Arch, ModelConfig};

/// How one tensor is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cut {
    /// Whole on every rank.
    Whole,
    /// Block `rank` of `n` along `dim`.
    Blocks { dim: i64 },
    /// GPT-2's fused query/key/value: block `rank` of each third along `dim`.
    Thirds { dim: i64 },
    /// Vocabulary rows, padded to `n · local` rows.
    Vocab,
}

/// Whether tensor parallelism over `n` ranks can cut a model of `config`: `n` must divide its
/// attention heads and its feed-forward width (key/value heads are split when it divides them
/// and kept whole otherwise; the vocabulary is padded). What the planner's layouts must meet.
pub fn check_split(config: &ModelConfig, n: i64) -> Result<()> {
    let c = config;
    let what = "tensor parallelism";
    if n < 1 {
        return Err(Error::invalid(what, "needs at least one rank"));
    }
    if c.num_heads % n != 0 {
        return Err(Error::invalid(
            what,
            format!(
                "{} attention heads do not split over {n} ranks (tp must divide the head count)",
                c.num_heads
            ),
        ));
    }
    if c.intermediate_size % n != 0 {
        return Err(Error::invalid(
            what,
            format!(
                "a feed-forward width of {} does not split over {n} ranks",
                c.intermediate_size
            ),
        ));
    }
    Ok(())
}

/// A model's tensor-parallel state: its group and the sizes of its local slices.
pub(crate) struct Shard {
    pub comm: Arc<TensorParallel>,
    pub rank: i64,
    pub size: i64,
    /// Query heads on this rank.
    pub heads: i64,
    /// Key/value heads this rank holds: its block, or all of them (`kv_split` false).
    pub kv_heads: i64,
    pub kv_split: bool,
    /// With key/value heads kept whole: the key/value head each local query head reads.
    pub kv_map: Option<Tensor>,
    /// Vocabulary rows on this rank (padded) and the first of them.
    pub vocab: i64,
    pub vocab_start: i64,
    /// The whole vocabulary.
    pub vocab_size: i64,
}

impl Shard {
    /// The layout of `config` on `comm`; refuses a model whose heads or feed-forward width the
    /// group does not divide (`check_split`).
    pub fn new(config: &ModelConfig, comm: Arc<TensorParallel>, device: Device) -> Result<Shard> {
        let n = comm.size() as i64;
        let r = comm.rank() as i64;
        let c = config;
        check_split(c, n)?;
        let heads = c.num_heads / n;
        let kv_split = c.num_kv_heads % n == 0;
        let (kv_heads, kv_map) = if kv_split {
            (c.num_kv_heads / n, None)
        } else {
            let group = c.num_heads / c.num_kv_heads;
            let map: Vec<i64> = (0..heads).map(|i| (r * heads + i) / group).collect();
            (
                c.num_kv_heads,
                Some(Tensor::from_slice(&map).to_device(device)),
            )
        };
        let vocab = (c.vocab_size + n - 1) / n;
        Ok(Shard {
            comm,
            rank: r,
            size: n,
            heads,
            kv_heads,
            kv_split,
            kv_map,
            vocab,
            vocab_start: r * vocab,
            vocab_size: c.vocab_size,
        })
    }

    /// How the parameter `name` is cut.
    pub fn cut(&self, name: &str, arch: Arch) -> Cut {
        let last = |suffix: &str| name.ends_with(suffix);
        if last("embed_tokens.weight") || last("lm_head.weight") || last("wte.weight") {
            return Cut::Vocab;
        }
        match arch {
            Arch::Llama => {
                if last("q_proj.weight")
                    || last("q_proj.bias")
                    || last("gate_proj.weight")
                    || last("gate_proj.bias")
                    || last("up_proj.weight")
                    || last("up_proj.bias")
                {
                    Cut::Blocks { dim: 0 }
                } else if last("k_proj.weight")
                    || last("k_proj.bias")
                    || last("v_proj.weight")
                    || last("v_proj.bias")
                {
                    if self.kv_split {
                        Cut::Blocks { dim: 0 }
                    } else {
                        Cut::Whole
                    }
                } else if last("o_proj.weight") || last("down_proj.weight") {
                    Cut::Blocks { dim: 1 }
                } else {
                    Cut::Whole
                }
            }
            Arch::Gpt2 => {
                if last("attn.c_attn.weight") {
                    Cut::Thirds { dim: 1 }
                } else if last("attn.c_attn.bias") {
                    Cut::Thirds { dim: 0 }
                } else if last("mlp.c_fc.weight") {
                    Cut::Blocks { dim: 1 }
                } else if last("mlp.c_fc.bias")
                    || last("attn.c_proj.weight")
                    || last("mlp.c_proj.weight")
                {
                    // The fc bias splits with its columns; the row-parallel projections (weights
                    // `[in, out]`) split their input rows.
                    Cut::Blocks { dim: 0 }
                } else {
                    Cut::Whole
                }
            }
        }
    }

    /// This rank's slice of the whole tensor `full`.
    pub fn slice(&self, full: &Tensor, cut: Cut) -> Result<Tensor> {
        let (n, r) = (self.size, self.rank);
        let t = match cut {
            Cut::Whole => full.shallow_clone(),
            Cut::Blocks { dim } => {
                let len = full.size()[dim as usize] / n;
                full.f_narrow(dim, r * len, len)?
            }
            Cut::Thirds { dim } => {
                let third = full.size()[dim as usize] / 3;
                let len = third / n;
                let parts = (0..3)
                    .map(|p| full.f_narrow(dim, p * third + r * len, len))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                Tensor::f_cat(&parts, dim)?
            }
            Cut::Vocab => {
                let have = (self.vocab_size - self.vocab_start).clamp(0, self.vocab);
                let rows = full.f_narrow(0, self.vocab_start.min(self.vocab_size), have)?;
                if have == self.vocab {
                    rows
                } else {
                    let mut shape = full.size();
                    shape[0] = self.vocab - have;
                    let pad = Tensor::f_zeros(&shape, (full.kind(), full.device()))?;
                    Tensor::f_cat(&[rows, pad], 0)?
                }
            }
        };
        Ok(t.f_contiguous()?)
    }

    /// The whole tensor from every rank's slice `local` (the inverse of `slice`), without
    /// gradient. Every rank of the group must call it with its slice of the same tensor.
    pub fn unslice(&self, local: &Tensor, cut: Cut) -> Result<Tensor> {
        let n = self.size;
        Ok(match cut {
            Cut::Whole => local.detach(),
            Cut::Blocks { dim } => self.comm.gather_along(local, dim)?,
            Cut::Thirds { dim } => {
                let all = self.comm.gather_along(local, dim)?;
                let len = local.size()[dim as usize] / 3;
                // Rank-major blocks of (q, k, v); put each third's blocks together.
                let mut parts = Vec::with_capacity((3 * n) as usize);
                for p in 0..3 {
                    for r in 0..n {
                        parts.push(all.f_narrow(dim, (r * 3 + p) * len, len)?);
                    }
                }
                Tensor::f_cat(&parts, dim)?
            }
            Cut::Vocab => self.comm.gather(local)?.f_narrow(0, 0, self.vocab_size)?,
        })
    }

    /// Whether the local vocabulary has padding rows (only the last rank's can).
    fn padded(&self) -> bool {
        self.vocab_start + self.vocab > self.vocab_size
    }

    /// `true` at the padding columns of local logits `[.., vocab]`.
    fn padding_mask(&self, device: Device) -> Tensor {
        let cols = Tensor::arange(self.vocab, (Kind::Int64, device)) + self.vocab_start;
        cols.ge(self.vocab_size)
    }

    /// The embedding of `ids` through the local vocabulary rows `table`, summed over the
    /// group (ids outside this rank's rows give zeros here and their row elsewhere).
    pub fn embed(&self, table: &Tensor, ids: &Tensor) -> Result<Tensor> {
        let local = ids - self.vocab_start;
        let here = local.ge(0).logical_and(&local.lt(self.vocab));
        let safe = local.where_scalarother(&here, 0);
        let e = Tensor::embedding(table, &safe, -1, false, false)
            * here.unsqueeze(-1).to_kind(table.kind());
        Ok(self.comm.reduce_sum(&e)?)
    }

    /// Local logits `[.., vocab]` with the padding columns at `-inf`, in f32.
    fn masked(&self, logits: &Tensor) -> Tensor {
        let z = logits.to_kind(Kind::Float);
        if self.padded() {
            z.masked_fill(&self.padding_mask(z.device()), f64::NEG_INFINITY)
        } else {
            z
        }
    }

    /// The whole logits `[.., V]` from local ones, without gradient (for sampling).
    pub fn gather_logits(&self, logits: &Tensor) -> Result<Tensor> {
        let all = self.comm.gather_along(logits, -1)?;
        let last = all.dim() as i64 - 1;
        Ok(all.f_narrow(last, 0, self.vocab_size)?)
    }

    /// Log-probabilities of `targets` `[N]` under `log_softmax(logits)` and, when asked, the
    /// entropy of each row, from local logits `[N, vocab]` (already divided by the
    /// temperature), computed over the group without gathering the logits: a maximum, a sum
    /// of exponentials, the target's logit and (for the entropy) `Σ e·z` are each reduced
    /// over the group. Differentiable in the logits.
    pub fn logprobs(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let z = self.masked(logits);
        let m = self
            .comm
            .reduce_max(&z.amax([-1i64].as_slice(), false).detach())?;
        let shifted = &z - m.unsqueeze(-1);
        let e = shifted.exp();
        let sum = self
            .comm
            .reduce_sum(&e.sum_dim_intlist(-1, false, Kind::Float))?;
        let lse = &m + sum.log();
        let local = targets - self.vocab_start;
        let here = local.ge(0).logical_and(&local.lt(self.vocab));
        let safe = local.where_scalarother(&here, 0).unsqueeze(-1);
        let zt = z
            .gather(-1, &safe, false)
            .squeeze_dim(-1)
            .where_scalarother(&here, 0.0);
        let zt = self.comm.reduce_sum(&zt)?;
        let logp = zt - &lse;
        let ent = if entropy {
            // Padding columns: e = 0 and z = -inf; their product must be 0, not NaN.
            let z0 = if self.padded() {
                z.masked_fill(&self.padding_mask(z.device()), 0.0)
            } else {
                z.shallow_clone()
            };
            let num = self
                .comm
                .reduce_sum(&(&e * z0).sum_dim_intlist(-1, false, Kind::Float))?;
            Some(lse - num / sum)
        } else {
            None
        };
        Ok((logp, ent))
    }
}
