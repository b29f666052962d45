//! The cost model: roofline times and per-device memory of model calls under a parallel layout
//! `(dp, tp, pp)`, for the planner's search and the simulator.
//!
//! Every estimate is a closed formula over a [`ModelShape`], a [`DeviceSpec`] and a [`Layout`]
//! (formulas and sources in `docs/planning.md`). The module is pure: it must not read files,
//! measure the clock (only [`device::measure_cpu_flops`] does, when asked) or print. It returns
//! data — an [`Overflow`] says which memory term overflows by how many bytes; turning that into
//! an `E05xx` diagnostic naming the call is the planner's job.

pub mod device;
pub mod model;

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

pub use device::{
    CollectiveTime, DeviceKind, DeviceProfile, DeviceSpec, HostCores, HostDecode, MatmulRate,
    Overheads, PROFILE_FORMAT, PROFILE_VERSION, measure_cpu_flops,
};
pub use model::{BYTE_VOCAB, ModelShape};

/// An error in the cost model's inputs (a bad config, an impossible layout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CostError(pub String);

impl fmt::Display for CostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CostError {}

/// How a model call is split over devices: data-, tensor- and pipeline-parallel degrees.
/// Ranks are numbered tensor-parallel innermost, then data-parallel, then pipeline, so
/// tensor-parallel groups stay inside a node when they can (they talk every layer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    pub dp: u64,
    pub tp: u64,
    pub pp: u64,
}

impl Layout {
    pub const SINGLE: Layout = Layout {
        dp: 1,
        tp: 1,
        pp: 1,
    };

    pub fn devices(&self) -> u64 {
        self.dp * self.tp * self.pp
    }

    /// Checks the layout against a model: degrees positive, heads divisible by `tp` (and
    /// key-value heads, or `tp` a multiple of them), layers by `pp`.
    pub fn check(&self, model: &ModelShape) -> Result<(), CostError> {
        if self.dp == 0 || self.tp == 0 || self.pp == 0 {
            return Err(CostError(format!(
                "layout {self:?}: degrees must be positive"
            )));
        }
        if !model.heads.is_multiple_of(self.tp) {
            return Err(CostError(format!(
                "{}: {} heads do not split over tp={}",
                model.name, model.heads, self.tp
            )));
        }
        if !model.layers.is_multiple_of(self.pp) {
            return Err(CostError(format!(
                "{}: {} layers do not split over pp={}",
                model.name, model.layers, self.pp
            )));
        }
        Ok(())
    }
}

/// The device a call runs on and how many of them share a node (which decides whether a
/// collective crosses NVLink or the network), and the bytes per element of the model the call
/// runs (its `dtype`: weights, activations, KV cache). `CostModel::new` starts at bf16 (2
/// bytes); the planner prices each model with its own dtype ([`CostModel::for_dtype`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CostModel {
    pub device: DeviceSpec,
    pub devices_per_node: u64,
    pub dtype_bytes: u64,
}

/// Bytes per parameter that a model holds, by role, as Braid's runtime allocates them
/// (`braid_runtime::training::optim`). A frozen model holds its weights in its dtype. A trained
/// model also holds gradients in its dtype, AdamW's two f32 moments and, when its dtype is
/// narrower than f32, f32 master weights and an f32 accumulator that sums the micro-batches'
/// gradients: 16 bytes per parameter in f32, 20 in bf16 or f16.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ParamBytes {
    pub weights: u64,
    /// The gradients the backward writes, and their f32 accumulator (bf16, f16).
    pub gradients: u64,
    /// AdamW's moments, and the f32 masters (bf16, f16).
    pub optimizer: u64,
}

/// Attention scores per layer on one device of `layout` for `seqs` sequences of `len` tokens:
/// `seqs · heads / tp · len²`, every query against every key of its sequence (what a masked
/// attention kernel computes before the mask drops the future).
pub fn attention_scores(model: &ModelShape, layout: Layout, seqs: f64, len: u64) -> f64 {
    let heads = (model.heads / layout.tp.max(1)).max(1) as f64;
    seqs * heads * (len as f64) * (len as f64)
}

/// [`ParamBytes`] of a model whose dtype has `dtype_bytes` bytes per element.
pub fn param_bytes(dtype_bytes: u64, trained: bool) -> ParamBytes {
    if !trained {
        return ParamBytes {
            weights: dtype_bytes,
            gradients: 0,
            optimizer: 0,
        };
    }
    let master = if dtype_bytes < 4 { 4 } else { 0 };
    ParamBytes {
        weights: dtype_bytes,
        gradients: dtype_bytes + master,
        optimizer: 8 + master,
    }
}

/// Times of one training step of one model, in seconds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TrainStepTime {
    /// Forward of one micro-batch on one pipeline stage, tensor-parallel all-reduces included.
    pub forward: f64,
    /// Backward of one micro-batch on one stage: twice the forward's FLOPs and the same
    /// all-reduces.
    pub backward: f64,
    /// 1F1B pipeline: `(M + pp - 1)(forward + backward)`.
    pub pipeline: f64,
    /// Fraction of the pipeline time each stage idles: `(pp - 1) / (M + pp - 1)`.
    pub bubble_fraction: f64,
    /// Data-parallel gradient all-reduce (not overlapped with the backward, to stay safe), with
    /// the sum of which gradients exist that precedes it for f32 gradients.
    pub grad_allreduce: f64,
    /// AdamW update: reads and writes fp32 master weights and both moments, reads gradients.
    pub optimizer: f64,
    pub total: f64,
}

/// Bytes of each rank's message that the runtime's exchange among `ranks` ranks carries in
/// its first all-gather, beside the message's length: an exchange whose every message fits is
/// one collective; a longer one sends the rest in a second. 64 KiB over all ranks, at least
/// 1 KiB each: the padding every rank sends is then small beside a second collective's
/// start-up on a host network, and stays small however many ranks gather.
pub fn exchange_inline_bytes(ranks: usize) -> usize {
    ((64 << 10) / ranks.max(1)).max(1 << 10)
}

impl CostModel {
    pub fn new(device: DeviceSpec, devices_per_node: u64) -> CostModel {
        CostModel {
            device,
            devices_per_node: devices_per_node.max(1),
            dtype_bytes: 2,
        }
    }

    /// The same device, for a model whose dtype has `dtype_bytes` bytes per element.
    pub fn for_dtype(&self, dtype_bytes: u64) -> CostModel {
        CostModel {
            dtype_bytes: dtype_bytes.max(1),
            ..self.clone()
        }
    }

    /// How much longer a call on `ranks` ranks that wait for one another takes than one rank's
    /// priced time: the expected largest of `ranks` draws from a normal distribution about 1
    /// with the device's measured [`DeviceSpec::rank_spread`] (`1 + spread · E[max of ranks
    /// standard normals]`). Exactly 1 on one rank or without a measured spread.
    pub fn slowest_of(&self, ranks: u64) -> f64 {
        let s = self.device.rank_spread;
        if ranks <= 1 || s.is_nan() || s <= 0.0 {
            return 1.0;
        }
        1.0 + s * expected_max_normal(ranks)
    }

    /// The expected spread of the times at which `ranks` ranks doing the same work finish, per
    /// second of that work: the expected range of `ranks` draws from a normal distribution
    /// with the device's measured [`DeviceSpec::rank_spread`] (`spread · 2 · E[max of ranks
    /// standard normals]`). 0 on one rank or without a measured spread.
    pub fn arrival_range(&self, ranks: u64) -> f64 {
        let s = self.device.rank_spread;
        if ranks <= 1 || s.is_nan() || s <= 0.0 {
            return 0.0;
        }
        s * 2.0 * expected_max_normal(ranks)
    }

    /// Ring all-reduce of `bytes` over `ranks` devices spaced `stride` ranks apart: every rank
    /// sends and receives `2(n-1)/n` of the buffer, plus one start-up latency (NCCL's
    /// low-latency protocol makes small all-reduces cost about that, whatever the ring size).
    /// The group uses NVLink when it fits in one node, else the network.
    ///
    /// Where the device's profile has all-reduces measured on `ranks` ranks
    /// ([`DeviceSpec::allreduce`], Gloo's on CPU ranks) and the group fits in one node, those
    /// times, interpolated.
    pub fn allreduce_time(&self, bytes: f64, ranks: u64, stride: u64) -> f64 {
        if ranks <= 1 {
            return 0.0;
        }
        if ranks * stride <= self.devices_per_node
            && let Some(t) = self.device.measured_allreduce(bytes, ranks)
        {
            return t;
        }
        let (bw, lat) = self.link(ranks * stride);
        let n = ranks as f64;
        2.0 * (n - 1.0) / n * bytes / (bw * self.device.network_efficiency) + lat
    }

    /// The bandwidth and latency of a group spanning `span` consecutive ranks: the node's
    /// links when it fits in one node, else the network.
    fn link(&self, span: u64) -> (f64, f64) {
        let d = &self.device;
        if span <= self.devices_per_node {
            (d.intra_node_bandwidth, d.intra_node_latency)
        } else {
            (d.inter_node_bandwidth, d.inter_node_latency)
        }
    }

    /// An all-gather over the host network of `bytes` in all (every rank's share together)
    /// among `ranks` processes, as the runtime exchanges rollouts and inference rows between
    /// its ranks (Gloo over TCP, CPU tensors): every rank receives the others' `(n-1)/n` of
    /// the bytes, plus one start-up latency per collective: one where every rank's share fits
    /// in [`exchange_inline_bytes`], else two (the runtime's exchange carries each rank's
    /// length and its first bytes in one all-gather, the rest in a second). Priced only where
    /// the device is the host (the
    /// CPU), whose calibrated collective figures are those of the same Gloo groups; `None`
    /// on accelerators, whose collective figures are their own interconnect's, not the
    /// hosts' TCP.
    ///
    /// With a calibrated profile's measured exchanges on `ranks` ranks of one node
    /// ([`DeviceSpec::allgather`]), those, interpolated.
    pub fn host_allgather_time(&self, bytes: f64, ranks: u64) -> Option<f64> {
        if ranks <= 1 || self.device.kind != DeviceKind::Cpu {
            return None;
        }
        if ranks <= self.devices_per_node
            && let Some(t) = self.device.measured_allgather(bytes, ranks)
        {
            return Some(t);
        }
        let (bw, lat) = self.link(ranks);
        let n = ranks as f64;
        let collectives = if bytes / n <= exchange_inline_bytes(ranks as usize) as f64 {
            1.0
        } else {
            2.0
        };
        Some((n - 1.0) / n * bytes / (bw * self.device.network_efficiency) + collectives * lat)
    }

    /// [`CostModel::host_allgather_time`] to the last of the ranks when it arrives `skew`
    /// seconds after the first, from the profile's exchanges measured so
    /// ([`DeviceSpec::measured_allgather_apart`]): on this machine's 2 ranks an exchange of a
    /// few kilobytes cost 2.7–4.0 ms when every rank arrived at once, and 0.5–0.8 ms to a
    /// rank that arrived 0.5 ms or more after the other (docs/planning.md). Without such
    /// measurements the skew changes nothing.
    pub fn host_allgather_time_apart(&self, bytes: f64, ranks: u64, skew: f64) -> Option<f64> {
        let together = self.host_allgather_time(bytes, ranks)?;
        if ranks <= self.devices_per_node
            && let Some(t) = self.device.measured_allgather_apart(bytes, ranks, skew)
        {
            return Some(t);
        }
        Some(together)
    }

    /// The arrival skews at which the profile measured the exchange among `ranks` ranks (the
    /// points where [`CostModel::host_allgather_time_apart`] changes slope), 0 first.
    pub fn exchange_skews(&self, ranks: u64) -> Vec<f64> {
        let mut skews = vec![0.0];
        if ranks <= self.devices_per_node {
            skews.extend(self.device.allgather_skews(ranks));
        }
        skews
    }

    /// Weight bytes one device holds under `layout`.
    fn stage_weight_bytes(&self, model: &ModelShape, layout: Layout) -> f64 {
        (model.params() * self.dtype_bytes) as f64 / (layout.tp * layout.pp) as f64
    }

    /// Tensor-parallel all-reduces of one stage pass over `tokens` tokens: two per layer
    /// (after attention and after the MLP), each of the activations `tokens · hidden`.
    fn tp_comm(&self, model: &ModelShape, layout: Layout, tokens: f64) -> f64 {
        let per = self.allreduce_time(
            tokens * (model.hidden * self.dtype_bytes) as f64,
            layout.tp,
            1,
        );
        2.0 * (model.layers / layout.pp) as f64 * per
    }

    /// Roofline time of one pass of `tokens` tokens attending to `context` tokens on average
    /// through one pipeline stage: the larger of compute time and the time to read the stage's
    /// weights (plus `extra_bytes`, e.g. a KV cache), then the tensor-parallel all-reduces.
    fn stage_pass(
        &self,
        model: &ModelShape,
        layout: Layout,
        tokens: f64,
        context: f64,
        extra_bytes: f64,
    ) -> f64 {
        self.stage_pass_at(model, layout, (tokens, context), extra_bytes, false)
    }

    /// [`CostModel::stage_pass`], its products at the rates of the engine's cached steps when
    /// `cached` ([`DeviceSpec::step_flops_at`]).
    fn stage_pass_at(
        &self,
        model: &ModelShape,
        layout: Layout,
        (tokens, context): (f64, f64),
        extra_bytes: f64,
        cached: bool,
    ) -> f64 {
        let flops = tokens * model.forward_flops_per_token(context.round() as u64)
            / (layout.tp * layout.pp) as f64;
        let bytes = self.stage_weight_bytes(model, layout) + extra_bytes;
        let width = (model.hidden / layout.tp).max(1);
        let rate = if cached {
            self.device.step_flops_at(tokens, width)
        } else {
            self.device.flops_at(tokens, width)
        };
        let compute = flops / rate;
        let memory = bytes / self.device.effective_mem_bandwidth();
        compute.max(memory) + self.tp_comm(model, layout, tokens)
    }

    /// Prefill of `batch` prompts of `prompt_len` tokens with one sample each
    /// ([`CostModel::shared_prefill_time`] with as many prompts as samples).
    pub fn prefill_time(
        &self,
        model: &ModelShape,
        layout: Layout,
        batch: u64,
        prompt_len: u64,
    ) -> f64 {
        self.shared_prefill_time(model, layout, batch, batch, prompt_len)
    }

    /// Prefill of `prompts` prompts of `prompt_len` tokens that admit `samples` samples
    /// (compute-bound): every stage in turn, since one batch flows through the pipeline once;
    /// attention averages half the prompt. The prompts' tokens go through the model once, as
    /// Braid's engine runs them (`n` samples of a prompt share its prefill); each sample then
    /// pays [`Overheads::prefill_sample`] (its first token, its copy of the cache rows).
    pub fn shared_prefill_time(
        &self,
        model: &ModelShape,
        layout: Layout,
        prompts: u64,
        samples: u64,
        prompt_len: u64,
    ) -> f64 {
        let tokens = (prompts * prompt_len) as f64;
        let o = &self.device.overheads;
        // The engine prefills through its cached steps (the host step on a CPU: see
        // `decode_step_time`).
        layout.pp as f64
            * self.stage_pass_at(model, layout, (tokens, prompt_len as f64 / 2.0), 0.0, true)
            + o.forward_terms(
                model.layers as f64,
                tokens,
                (model.hidden / layout.tp) as f64,
                attention_scores(model, layout, prompts as f64, prompt_len),
            )
            + o.prefill
            + tokens * o.prefill_token
            + model.layers as f64
                * tokens
                * (model.hidden / layout.tp) as f64
                * o.prefill_token_layer
            + samples as f64 * o.prefill_sample
    }

    /// Prefill of `batch` prompts on a pipelined instance (`layout.pp` stages), as ReaL's
    /// pipelined generation runs it: the prompts split into `m = min(pp, batch)` micro-batches
    /// issued back to back, so the prefill takes `m + pp − 1` stage times of one micro-batch
    /// (each with the host's hand-over on a host-bound engine) rather than the whole batch
    /// crossing every stage alone. With one stage this is [`CostModel::prefill_time`].
    pub fn pipelined_prefill_time(
        &self,
        model: &ModelShape,
        layout: Layout,
        batch: u64,
        prompt_len: u64,
    ) -> f64 {
        self.pipelined_shared_prefill_time(model, layout, batch, prompt_len, 1)
    }

    /// [`CostModel::pipelined_prefill_time`] of `samples` samples drawn `per_prompt` to a
    /// prompt: each micro-batch prefills its samples' prompts once
    /// ([`CostModel::shared_prefill_time`]).
    pub fn pipelined_shared_prefill_time(
        &self,
        model: &ModelShape,
        layout: Layout,
        samples: u64,
        prompt_len: u64,
        per_prompt: u64,
    ) -> f64 {
        let per_prompt = per_prompt.max(1);
        self.pipelined(
            layout,
            samples,
            |b| self.shared_prefill_time(model, layout, b.div_ceil(per_prompt), b, prompt_len),
            |m, pp| m + pp - 1,
        )
    }

    /// A pass of `batch` sequences through a pipelined instance that splits them into
    /// `m = min(pp, batch)` micro-batches: `steps(m, pp)` schedule steps, each a stage's share of
    /// `pass` over one micro-batch (`pass(b)` crosses every stage with `b` sequences) and, on a
    /// host-bound engine, the hand-over between stages. Without stages, `pass(batch)`.
    fn pipelined(
        &self,
        layout: Layout,
        batch: u64,
        pass: impl Fn(u64) -> f64,
        steps: fn(u64, u64) -> u64,
    ) -> f64 {
        let pp = layout.pp.max(1);
        if pp == 1 || batch == 0 {
            return pass(batch);
        }
        let m = pp.min(batch);
        let stage = pass(batch.div_ceil(m)) / pp as f64;
        let hand_over = self
            .device
            .host_decode
            .as_ref()
            .map_or(0.0, |h| h.schedule_step);
        steps(m, pp) as f64 * (stage + hand_over)
    }

    /// One decode step for `batch` live sequences with `context` tokens each: memory-bound at
    /// small batch — every step reads all weights and the whole KV cache — and compute-bound
    /// only at large batch. Summed over pipeline stages, since a token crosses them all, plus
    /// the device's fixed per-layer decode overhead. On an engine whose decode steps are
    /// host-bound ([`DeviceSpec::host_decode`]) the step takes the larger of that and the
    /// host's time to launch it.
    pub fn decode_step_time(
        &self,
        model: &ModelShape,
        layout: Layout,
        batch: u64,
        context: u64,
    ) -> f64 {
        if batch == 0 {
            return 0.0;
        }
        let kv = (batch * context * model.kv_bytes_per_token(self.dtype_bytes)) as f64
            / (layout.tp * layout.pp) as f64;
        let device = layout.pp as f64
            // Braid's host step, whose kernel `step_matmul` times, runs unsharded models.
            // Tensor-parallel layers decode through libtorch with an all-reduce per layer,
            // which calibration does not time: they are priced at the same rates. (Priced at
            // the matmul table's beside a host step at the kernel's, the quickstart's
            // generation on 2 CPU ranks came out at 74 ms with tp 2, the planner chose it, and
            // it measured 370–560 ms; docs/planning.md, "Not yet".)
            * self.stage_pass_at(model, layout, (batch as f64, context as f64), kv, true)
            + model.layers as f64 * self.device.decode_layer_overhead
            + self.device.overheads.decode_terms(
                model.layers as f64,
                batch as f64,
                (model.hidden / layout.tp) as f64,
                context as f64,
                ((model.kv_heads / layout.tp).max(1) * model.head_dim()) as f64,
            );
        match &self.device.host_decode {
            Some(h) => device.max(h.pass(model.layers as f64, layout.tp)),
            None => device,
        }
    }

    /// One decode step of `batch` live sequences on a pipelined instance (`layout.pp` stages),
    /// as ReaL's pipelined generation runs it: the batch splits into `m = min(pp, batch)`
    /// micro-batches that cycle through the stages, so a step — every sequence one token
    /// further — takes `max(m, pp)` stage times of one micro-batch. Decode is memory-bound, so
    /// each stage still reads its weights once per micro-batch: pipelining decode on `pp`
    /// devices costs about what one device holding the whole model would, where tensor
    /// parallelism over them divides the weight reads. On a host-bound engine each of those
    /// schedule steps also pays the engine's `schedule_step` (the hand-over between stages
    /// and its synchronisation). With one stage this is [`CostModel::decode_step_time`].
    pub fn pipelined_decode_step_time(
        &self,
        model: &ModelShape,
        layout: Layout,
        batch: u64,
        context: u64,
    ) -> f64 {
        self.pipelined(
            layout,
            batch,
            |b| self.decode_step_time(model, layout, b, context),
            |m, pp| m.max(pp),
        )
    }

    /// Forward (inference, e.g. log-probs or values) of `seqs` sequences of `seq_len` tokens on
    /// one data-parallel replica: stage passes one after the other for a single micro-batch.
    pub fn forward_time(&self, model: &ModelShape, layout: Layout, seqs: u64, seq_len: u64) -> f64 {
        let tokens = (seqs * seq_len) as f64;
        let o = &self.device.overheads;
        layout.pp as f64 * self.stage_pass(model, layout, tokens, seq_len as f64 / 2.0, 0.0)
            + o.forward_terms(
                model.layers as f64,
                tokens,
                (model.hidden / layout.tp) as f64,
                attention_scores(model, layout, seqs as f64, seq_len),
            )
            + o.forward
    }

    /// One training step over `global_seqs` sequences of `seq_len` tokens, split over `dp`
    /// replicas and `microbatches` micro-batches each, with 1F1B pipelining. With `recompute`
    /// (activation checkpointing) the backward runs each layer's forward again first.
    pub fn train_step_time(
        &self,
        model: &ModelShape,
        layout: Layout,
        global_seqs: u64,
        seq_len: u64,
        microbatches: u64,
        recompute: bool,
    ) -> TrainStepTime {
        let m = microbatches.max(1);
        let seqs_per_mb = (global_seqs as f64 / (layout.dp * m) as f64).max(1.0);
        let tokens = seqs_per_mb * seq_len as f64;
        let o = &self.device.overheads;
        let stage_layers = (model.layers / layout.pp) as f64;
        let pass = self.stage_pass(model, layout, tokens, seq_len as f64 / 2.0, 0.0);
        // A micro-batch's fixed cost is charged with its forward.
        let scores = attention_scores(model, layout, seqs_per_mb, seq_len);
        let forward =
            pass + o.forward_terms(
                stage_layers,
                tokens,
                (model.hidden / layout.tp) as f64,
                scores,
            ) + o.microbatch;
        // Backward: twice the forward FLOPs (gradients for activations and for weights), the
        // same all-reduces; weights are re-read once, so compute dominates except at tiny sizes.
        let fwd_comm = self.tp_comm(model, layout, tokens);
        let backward = 2.0 * (pass - fwd_comm)
            + fwd_comm
            + o.backward_terms(
                stage_layers,
                tokens,
                (model.hidden / layout.tp) as f64,
                scores,
            )
            + if recompute { forward } else { 0.0 };
        let stages = layout.pp as f64;
        let pipeline = (m as f64 + stages - 1.0) * (forward + backward);
        let bubble_fraction = (stages - 1.0) / (m as f64 + stages - 1.0);
        let grad_bytes = self.stage_weight_bytes(model, layout);
        // Before the gradients, the runtime sums over the replicas which gradients exist on each
        // (`comm::all_reduce_gradients`: one f64 per parameter tensor, so that a replica whose
        // share had no tokens takes part with zeros) where it reduces the model's own f32
        // gradients; a bf16 or f16 model reduces its f32 accumulators, every one present. On
        // Gloo those few hundred bytes cost a good part of what the gradients' all-reduce does
        // (`braid calibrate` times both sizes).
        let presence = if layout.dp > 1 && self.dtype_bytes == 4 {
            let tensors = model.param_tensors().div_ceil(layout.pp) as f64;
            self.allreduce_time(8.0 * tensors, layout.dp, layout.tp)
        } else {
            0.0
        };
        let grad_allreduce = self.allreduce_time(grad_bytes, layout.dp, layout.tp) + presence;
        let params_here = model.params() as f64 / (layout.tp * layout.pp) as f64;
        // Master (or the f32 weight), m, v: read and written (24 B); the gradient read and the
        // model's weight written in its dtype.
        let optimizer = params_here * (24 + 2 * self.dtype_bytes) as f64
            / self.device.effective_mem_bandwidth();
        TrainStepTime {
            forward,
            backward,
            pipeline,
            bubble_fraction,
            grad_allreduce,
            optimizer: optimizer + o.train_step + stage_layers * o.optimizer_layer,
            total: pipeline
                + grad_allreduce
                + optimizer
                + o.train_step
                + stage_layers * o.optimizer_layer,
        }
    }

    /// Memory one device needs for a call described by `use_`, for a model in this cost
    /// model's dtype ([`param_bytes`] per parameter and role).
    pub fn memory(&self, model: &ModelShape, layout: Layout, use_: &MemoryUse) -> MemoryNeeds {
        let shard = (layout.tp * layout.pp) as f64;
        let params = model.params() as f64 / shard;
        let b = self.dtype_bytes as f64;
        let per = param_bytes(self.dtype_bytes, use_.train);
        let weights = params * per.weights as f64;
        // The optimizer's state (moments and masters) optionally sharded over data-parallel
        // ranks (ZeRO-1).
        let opt_shard = if use_.shard_optimizer {
            layout.dp as f64
        } else {
            1.0
        };
        let gradients = params * per.gradients as f64;
        let optimizer = params * per.optimizer as f64 / opt_shard;
        // Activations kept for the backward, per layer and micro-batch, with flash attention:
        // tokens · hidden · (10 + 24 / tp) bytes in a 2-byte dtype (Korthikanti et al. 2022,
        // eq. 2 without the s²-term that flash attention removes), scaled to the model's dtype.
        // With activation checkpointing only each layer's input (tokens · hidden elements)
        // stays, and one layer's activations exist while it is recomputed. 1F1B keeps up to
        // `pp` micro-batches in flight on the first stage.
        let activations = if use_.train {
            let tokens = (use_.microbatch_seqs * use_.seq_len) as f64;
            let per_layer =
                tokens * model.hidden as f64 * (10.0 + 24.0 / layout.tp as f64) * b / 2.0;
            let in_flight = layout.pp.min(use_.microbatches.max(1)) as f64;
            let layers = (model.layers / layout.pp) as f64;
            if use_.checkpointing {
                tokens * model.hidden as f64 * b * layers * in_flight + per_layer
            } else {
                per_layer * layers * in_flight
            }
        } else {
            0.0
        };
        let kv_cache =
            (use_.kv_batch * use_.kv_context * model.kv_bytes_per_token(self.dtype_bytes)) as f64
                / shard;
        MemoryNeeds {
            weights: weights.ceil() as u64,
            gradients: gradients.ceil() as u64,
            optimizer: optimizer.ceil() as u64,
            activations: activations.ceil() as u64,
            kv_cache: kv_cache.ceil() as u64,
        }
    }
}

/// What a call keeps in memory: training state and activations, and/or a KV cache.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemoryUse {
    pub train: bool,
    pub shard_optimizer: bool,
    pub microbatch_seqs: u64,
    pub seq_len: u64,
    pub microbatches: u64,
    /// Sequences whose KV cache is resident (generation's batch).
    pub kv_batch: u64,
    /// Tokens per sequence the cache holds (prompt + generated).
    pub kv_context: u64,
    /// Activation checkpointing (training): each layer is recomputed in the backward.
    pub checkpointing: bool,
}

/// The terms of a device's memory, in the order [`MemoryNeeds::fits`] adds them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryTerm {
    Weights,
    Gradients,
    OptimizerState,
    Activations,
    KvCache,
}

impl fmt::Display for MemoryTerm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MemoryTerm::Weights => "weights",
            MemoryTerm::Gradients => "gradients",
            MemoryTerm::OptimizerState => "optimizer state",
            MemoryTerm::Activations => "activations",
            MemoryTerm::KvCache => "KV cache",
        })
    }
}

/// Bytes per device, by term.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MemoryNeeds {
    pub weights: u64,
    pub gradients: u64,
    pub optimizer: u64,
    pub activations: u64,
    pub kv_cache: u64,
}

/// Why a call does not fit: adding `term` took the total past the device's usable memory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Overflow {
    pub term: MemoryTerm,
    /// Total bytes needed with every term.
    pub needed: u64,
    pub usable: u64,
    pub over_by: u64,
}

impl fmt::Display for Overflow {
    /// `needs A GB, B GB usable: over by C GB (C·10⁹ bytes), overflowing at the optimizer
    /// state` — the planner puts this in its `E05xx` message.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gb = |b: u64| b as f64 / 1e9;
        write!(
            f,
            "needs {:.1} GB, {:.1} GB usable: over by {:.1} GB ({} bytes), overflowing at the {}",
            gb(self.needed),
            gb(self.usable),
            gb(self.over_by),
            self.over_by,
            self.term
        )
    }
}

impl MemoryNeeds {
    pub fn terms(&self) -> [(MemoryTerm, u64); 5] {
        [
            (MemoryTerm::Weights, self.weights),
            (MemoryTerm::Gradients, self.gradients),
            (MemoryTerm::OptimizerState, self.optimizer),
            (MemoryTerm::Activations, self.activations),
            (MemoryTerm::KvCache, self.kv_cache),
        ]
    }

    pub fn total(&self) -> u64 {
        self.terms().iter().map(|(_, b)| b).sum()
    }

    /// Whether the terms fit the device's usable memory; if not, the first term (in the order
    /// weights, gradients, optimizer, activations, KV cache — from least to most negotiable)
    /// at which the running sum overflows, and by how many bytes the total does.
    pub fn fits(&self, device: &DeviceSpec) -> Result<(), Overflow> {
        let usable = device.usable_memory();
        let needed = self.total();
        if needed <= usable {
            return Ok(());
        }
        let mut sum = 0u64;
        let mut term = MemoryTerm::KvCache;
        for (t, b) in self.terms() {
            sum += b;
            if sum > usable {
                term = t;
                break;
            }
        }
        Err(Overflow {
            term,
            needed,
            usable,
            over_by: needed - usable,
        })
    }
}

/// The expected largest of `k` independent standard normal draws (0 for one; 1/√π for two,
/// about 1.03 for four, 1.42 for eight), by integrating `x · k φ(x) Φ(x)^(k−1)` over
/// [−8, 8] with Φ accumulated along the way.
pub fn expected_max_normal(k: u64) -> f64 {
    if k <= 1 {
        return 0.0;
    }
    thread_local! {
        static KNOWN: std::cell::RefCell<BTreeMap<u64, f64>> = const {
            std::cell::RefCell::new(BTreeMap::new())
        };
    }
    if let Some(e) = KNOWN.with(|m| m.borrow().get(&k).copied()) {
        return e;
    }
    let e = integrate_max_normal(k);
    KNOWN.with(|m| m.borrow_mut().insert(k, e));
    e
}

fn integrate_max_normal(k: u64) -> f64 {
    const STEPS: usize = 16_000;
    let (lo, hi) = (-8.0f64, 8.0f64);
    let h = (hi - lo) / STEPS as f64;
    let phi = |x: f64| (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
    let k = k as f64;
    let mut cdf = 0.0f64;
    let mut sum = 0.0f64;
    let mut prev = phi(lo);
    for i in 1..=STEPS {
        let x = lo + h * i as f64;
        let p = phi(x);
        // Φ at x by the trapezoid rule, then the integrand at the midpoint of the step.
        let mid_cdf = cdf + 0.25 * h * (prev + p);
        cdf += 0.5 * h * (prev + p);
        let xm = x - 0.5 * h;
        sum += h * xm * k * phi(xm) * mid_cdf.clamp(0.0, 1.0).powf(k - 1.0);
        prev = p;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h100_node() -> CostModel {
        CostModel::new(DeviceKind::H100.spec(), 8)
    }

    fn llama7b() -> ModelShape {
        ModelShape::preset("llama-7b").expect("preset")
    }

    #[test]
    fn pipelined_decode_reads_each_stage_once_per_micro_batch() {
        let c = h100_node();
        let m = llama7b();
        let pp4 = Layout {
            dp: 1,
            tp: 1,
            pp: 4,
        };
        // One stage: the plain decode step.
        assert_eq!(
            c.pipelined_decode_step_time(&m, Layout::SINGLE, 32, 256),
            c.decode_step_time(&m, Layout::SINGLE, 32, 256)
        );
        // Four stages, 32 sequences: four micro-batches of 8 cycle through, each stage reading
        // its quarter of the weights four times — about one device's whole-model step, far
        // slower than four-way tensor parallelism over the same devices (which divides the reads).
        let piped = c.pipelined_decode_step_time(&m, pp4, 32, 256);
        let stage = c.decode_step_time(&m, pp4, 8, 256) / 4.0;
        assert!((piped - 4.0 * stage).abs() < 1e-12);
        let whole = c.decode_step_time(&m, Layout::SINGLE, 8, 256);
        assert!((piped / whole - 1.0).abs() < 0.1, "{piped} vs {whole}");
        let tp4 = Layout {
            dp: 1,
            tp: 4,
            pp: 1,
        };
        let split = c.decode_step_time(&m, tp4, 32, 256);
        assert!(piped > split, "{piped} vs {split}");
        // Fewer sequences than stages: one micro-batch each, still `pp` stage times a step.
        let two = c.pipelined_decode_step_time(&m, pp4, 2, 256);
        assert!((two - 4.0 * c.decode_step_time(&m, pp4, 1, 256) / 4.0).abs() < 1e-12);
    }

    #[test]
    fn a_host_bound_engine_decodes_at_the_hosts_pace_until_the_device_is_slower() {
        let mut c = h100_node();
        let m = llama7b();
        let device_only = |b: u64, l: Layout| c.decode_step_time(&m, l, b, 512);
        let (one, big) = (
            device_only(1, Layout::SINGLE),
            device_only(4096, Layout::SINGLE),
        );
        c.device.host_decode = Some(HostDecode {
            layer: 0.5e-3,
            collective: 0.3e-3,
            schedule_step: 1e-3,
        });
        // Batch 1: the host's 32 × 0.5 ms, far above the device's ~6.4 ms.
        let host = c.decode_step_time(&m, Layout::SINGLE, 1, 512);
        assert!(
            (host - 32.0 * 0.5e-3).abs() < 1e-12 && host > one,
            "{host} {one}"
        );
        // A batch large enough that the device is slower: the device's time, unchanged.
        assert_eq!(c.decode_step_time(&m, Layout::SINGLE, 4096, 512), big);
        assert!(big > 32.0 * 0.5e-3);
        // Tensor parallelism adds two collective calls a layer on the host.
        let tp2 = Layout {
            dp: 1,
            tp: 2,
            pp: 1,
        };
        let t = c.decode_step_time(&m, tp2, 1, 512);
        assert!((t - 32.0 * (0.5e-3 + 2.0 * 0.3e-3)).abs() < 1e-12, "{t}");
        // Pipelined: each of the max(micro-batches, stages) schedule steps runs a stage's share
        // of the layers and hands over.
        let pp4 = Layout {
            dp: 1,
            tp: 1,
            pp: 4,
        };
        let piped = c.pipelined_decode_step_time(&m, pp4, 8, 512);
        let expected = 4.0 * (8.0 * 0.5e-3 + 1e-3);
        assert!((piped - expected).abs() < 1e-12, "{piped} vs {expected}");
    }

    #[test]
    fn pipelined_prefill_issues_micro_batches_back_to_back() {
        let c = h100_node();
        let m = llama7b();
        assert_eq!(
            c.pipelined_prefill_time(&m, Layout::SINGLE, 64, 128),
            c.prefill_time(&m, Layout::SINGLE, 64, 128)
        );
        let pp4 = Layout {
            dp: 1,
            tp: 1,
            pp: 4,
        };
        // Four micro-batches of 16 through four stages: seven stage times of one micro-batch,
        // well under the whole batch crossing the four stages one after the other.
        let piped = c.pipelined_prefill_time(&m, pp4, 64, 128);
        let stage = c.prefill_time(&m, pp4, 16, 128) / 4.0;
        assert!((piped - 7.0 * stage).abs() < 1e-12, "{piped} vs {stage}");
        assert!(piped < 0.6 * c.prefill_time(&m, pp4, 64, 128));
    }

    /// The `n` samples of a prompt share its prefill, as Braid's engine runs them: the
    /// prompts' tokens are priced once, each sample its own part.
    #[test]
    fn samples_of_one_prompt_share_its_prefill() {
        let mut c = h100_node();
        c.device.overheads.prefill_sample = 3e-6;
        c.device.overheads.prefill_token = 1e-6;
        let m = llama7b();
        let one = Layout::SINGLE;
        let alone = c.prefill_time(&m, one, 8, 128);
        let shared = c.shared_prefill_time(&m, one, 8, 32, 128);
        assert!(
            (shared - alone - 24.0 * 3e-6).abs() < 1e-12,
            "{shared} vs {alone}"
        );
        assert!(shared < 0.5 * c.prefill_time(&m, one, 32, 128));
        // One sample a prompt is the plain prefill; on stages, each micro-batch's samples
        // share their prompts.
        assert_eq!(
            c.pipelined_shared_prefill_time(&m, one, 32, 128, 1),
            c.prefill_time(&m, one, 32, 128)
        );
        assert_eq!(
            c.pipelined_shared_prefill_time(&m, one, 32, 128, 4),
            c.shared_prefill_time(&m, one, 8, 32, 128)
        );
        let pp2 = Layout {
            dp: 1,
            tp: 1,
            pp: 2,
        };
        let piped = c.pipelined_shared_prefill_time(&m, pp2, 32, 128, 4);
        let stage = c.shared_prefill_time(&m, pp2, 4, 16, 128) / 2.0;
        assert!((piped - 3.0 * stage).abs() < 1e-12, "{piped} vs {stage}");
    }

    #[test]
    fn decode_is_memory_bound_at_small_batch_and_grows_with_batch() {
        let c = h100_node();
        let m = llama7b();
        let one = c.decode_step_time(&m, Layout::SINGLE, 1, 512);
        // Reading 13.5 GB of weights and 512 tokens of cache at 0.75 × 3.35 TB/s (about
        // 5.5 ms), plus 30 µs per layer of small kernels: about 6.4 ms.
        let bytes = 2.0 * m.params() as f64 + 512.0 * m.kv_bytes_per_token(2) as f64;
        let expected = bytes / (3.35e12 * 0.75) + m.layers as f64 * 30e-6;
        assert!((one / expected - 1.0).abs() < 1e-9, "{one} vs {expected}");
        let b64 = c.decode_step_time(&m, Layout::SINGLE, 64, 512);
        let b512 = c.decode_step_time(&m, Layout::SINGLE, 512, 512);
        assert!(b64 > one && b512 > b64);
        // Batching amortises the weight reads: per-sequence cost falls steeply.
        assert!(b64 / 64.0 < one / 10.0);
        assert_eq!(c.decode_step_time(&m, Layout::SINGLE, 0, 512), 0.0);
    }

    #[test]
    fn tensor_parallelism_cuts_decode_time_but_adds_all_reduces() {
        let c = h100_node();
        let m = llama7b();
        let tp1 = c.decode_step_time(&m, Layout::SINGLE, 8, 1024);
        let tp4 = c.decode_step_time(
            &m,
            Layout {
                dp: 1,
                tp: 4,
                pp: 1,
            },
            8,
            1024,
        );
        assert!(tp4 < tp1 / 2.0 && tp4 > tp1 / 4.0, "{tp1} {tp4}");
        let weights_read = tp1 / 4.0;
        // 64 all-reduces of a few kilobytes: about their latency each.
        assert!(tp4 - weights_read > 64.0 * 10e-6, "{tp4}");
    }

    #[test]
    fn prefill_is_compute_bound() {
        let c = h100_node();
        let m = llama7b();
        let t = c.prefill_time(&m, Layout::SINGLE, 32, 1024);
        let flops = 32.0 * 1024.0 * m.forward_flops_per_token(512);
        let compute = flops / (989e12 * 0.5);
        assert!((t / compute - 1.0).abs() < 1e-9, "{t} {compute}");
    }

    #[test]
    fn training_step_has_backward_twice_forward_and_the_1f1b_bubble() {
        let c = h100_node();
        let m = llama7b();
        let layout = Layout {
            dp: 2,
            tp: 1,
            pp: 4,
        };
        let t = c.train_step_time(&m, layout, 64, 1024, 8, false);
        assert!((t.backward / t.forward - 2.0).abs() < 1e-9);
        assert!((t.pipeline - 11.0 * (t.forward + t.backward)).abs() < 1e-9);
        assert!((t.bubble_fraction - 3.0 / 11.0).abs() < 1e-12);
        assert!(t.grad_allreduce > 0.0 && t.optimizer > 0.0);
        assert!((t.total - (t.pipeline + t.grad_allreduce + t.optimizer)).abs() < 1e-9);
        let more_mb = c.train_step_time(&m, layout, 64, 1024, 32, false);
        assert!(more_mb.bubble_fraction < t.bubble_fraction);
    }

    #[test]
    fn replicas_reducing_f32_gradients_first_sum_which_exist() {
        let mut c = h100_node();
        let m = llama7b();
        let layout = Layout {
            dp: 2,
            tp: 1,
            pp: 1,
        };
        let bf16 = c.train_step_time(&m, layout, 64, 1024, 8, false);
        let gradients = c.allreduce_time((m.params() * 2) as f64, 2, 1);
        assert!((bf16.grad_allreduce - gradients).abs() < 1e-12);
        c.dtype_bytes = 4;
        let f32 = c.train_step_time(&m, layout, 64, 1024, 8, false);
        let gradients = c.allreduce_time((m.params() * 4) as f64, 2, 1);
        let presence = c.allreduce_time(8.0 * (32 * 9 + 3) as f64, 2, 1);
        assert!((f32.grad_allreduce - gradients - presence).abs() < 1e-12);
        // One replica: nothing to sum.
        let one = c.train_step_time(&m, Layout::SINGLE, 64, 1024, 8, false);
        assert_eq!(one.grad_allreduce, 0.0);
    }

    #[test]
    fn the_slowest_of_several_ranks_follows_the_normal_order_statistics() {
        // Known values: E[max of 2] = 1/√π; of 3, 3/(2√π); of 4 and 8 from the tables of
        // normal order statistics (Harter 1961).
        assert!((expected_max_normal(2) - 1.0 / std::f64::consts::PI.sqrt()).abs() < 1e-6);
        assert!((expected_max_normal(3) - 1.5 / std::f64::consts::PI.sqrt()).abs() < 1e-6);
        assert!((expected_max_normal(4) - 1.029_375).abs() < 1e-5);
        assert!((expected_max_normal(8) - 1.423_600).abs() < 1e-5);
        assert_eq!(expected_max_normal(1), 0.0);
        let mut d = DeviceKind::Cpu.spec();
        // The datasheets have no spread: every rank takes the priced time.
        assert_eq!(CostModel::new(d.clone(), 2).slowest_of(2), 1.0);
        d.rank_spread = 0.1;
        let c = CostModel::new(d, 2);
        assert_eq!(c.slowest_of(1), 1.0);
        assert!((c.slowest_of(2) - (1.0 + 0.1 / std::f64::consts::PI.sqrt())).abs() < 1e-6);
        assert!(c.slowest_of(8) > c.slowest_of(4) && c.slowest_of(4) > c.slowest_of(2));
    }

    #[test]
    fn host_exchanges_are_priced_on_cpus_only() {
        let mut d = DeviceKind::Cpu.spec();
        d.intra_node_latency = 500e-6;
        d.intra_node_bandwidth = 1e9;
        d.network_efficiency = 1.0;
        let c = CostModel::new(d, 2);
        // Each of 2 ranks receives the other's half of 1 MB, after two latencies (the
        // lengths and first bytes' all-gather, then the rest's).
        let t = c.host_allgather_time(1e6, 2).expect("priced on a CPU");
        assert!((t - (0.5e6 / 1e9 + 2.0 * 500e-6)).abs() < 1e-12, "{t}");
        // Shares that fit in the first all-gather take one latency; one byte more, two.
        let fits = (2 * exchange_inline_bytes(2)) as f64;
        let t = c.host_allgather_time(fits, 2).expect("priced");
        assert!((t - (fits / 2.0 / 1e9 + 500e-6)).abs() < 1e-12, "{t}");
        let t = c.host_allgather_time(fits + 2.0, 2).expect("priced");
        assert!(
            (t - ((fits + 2.0) / 2.0 / 1e9 + 2.0 * 500e-6)).abs() < 1e-12,
            "{t}"
        );
        assert_eq!(exchange_inline_bytes(2), 32 << 10);
        assert_eq!(exchange_inline_bytes(1000), 1 << 10);
        assert_eq!(c.host_allgather_time(1e6, 1), None);
        assert_eq!(h100_node().host_allgather_time(1e6, 8), None);
        // With the runtime's exchanges measured on 2 ranks: those times, interpolated; on 4
        // ranks (not measured) the line still.
        let mut d = c.device.clone();
        d.allgather =
            CollectiveTime::on_ranks(2, &[(64, 0.4e-3), (4096, 1.6e-3), (1 << 20, 3.0e-3)]);
        d.check().expect("a valid table");
        let m = CostModel::new(d.clone(), 4);
        let at = m.host_allgather_time(4096.0, 2).expect("priced");
        assert!((at - 1.6e-3).abs() < 1e-12, "{at}");
        let mid = m.host_allgather_time(512.0, 2).expect("priced");
        assert!((mid - (0.4e-3f64 * 1.6e-3).sqrt()).abs() < 1e-9, "{mid}");
        let line = CostModel::new(c.device.clone(), 4).host_allgather_time(4096.0, 4);
        assert_eq!(m.host_allgather_time(4096.0, 4), line);
        d.allgather[1].ranks = 1;
        assert!(d.check().unwrap_err().contains("device.allgather"));
    }

    #[test]
    fn a_late_rank_pays_what_the_exchange_measured_apart_cost_it() {
        let mut d = DeviceKind::Cpu.spec();
        d.allgather = CollectiveTime::on_ranks(2, &[(64, 3.0e-3), (1 << 20, 6.0e-3)]);
        // Without skewed measurements, the skew changes nothing.
        let c = CostModel::new(d.clone(), 2);
        assert_eq!(c.exchange_skews(2), vec![0.0]);
        assert_eq!(
            c.host_allgather_time_apart(64.0, 2, 1e-3),
            c.host_allgather_time(64.0, 2)
        );
        d.allgather.extend(CollectiveTime::apart_on_ranks(
            2,
            &[
                (0.5e-3, 64, 0.5e-3),
                (0.5e-3, 1 << 20, 2.0e-3),
                (2e-3, 64, 0.7e-3),
                (2e-3, 1 << 20, 2.5e-3),
            ],
        ));
        d.check().expect("a valid table");
        let c = CostModel::new(d.clone(), 2);
        assert_eq!(c.exchange_skews(2), vec![0.0, 0.5e-3, 2e-3]);
        let at = |skew: f64| c.host_allgather_time_apart(64.0, 2, skew).expect("a CPU");
        // Together: the together table; at a measured skew, its entry; between two, the line
        // between them; beyond the last, the last.
        assert!((at(0.0) - 3.0e-3).abs() < 1e-12);
        assert!((at(0.25e-3) - 1.75e-3).abs() < 1e-12, "{}", at(0.25e-3));
        assert!((at(0.5e-3) - 0.5e-3).abs() < 1e-12);
        assert!((at(1.25e-3) - 0.6e-3).abs() < 1e-12, "{}", at(1.25e-3));
        assert!((at(10e-3) - 0.7e-3).abs() < 1e-12);
        // The together time itself is unchanged by the skewed entries.
        assert!((c.host_allgather_time(64.0, 2).expect("a CPU") - 3.0e-3).abs() < 1e-12);
        // Larger exchanges interpolate in size within each skew's table.
        let big = c.host_allgather_time_apart((1 << 20) as f64, 2, 0.5e-3);
        assert!((big.expect("a CPU") - 2.0e-3).abs() < 1e-12);
        // Not measured on 4 ranks: no skews, the line.
        let four = CostModel::new(d.clone(), 4);
        assert_eq!(four.exchange_skews(4), vec![0.0]);
        d.allgather[3].skew = -1.0;
        assert!(d.check().unwrap_err().contains("skew"));
    }

    #[test]
    fn ranks_arrive_apart_by_the_expected_range_of_their_spread() {
        let mut d = DeviceKind::Cpu.spec();
        d.rank_spread = 0.0;
        let c = CostModel::new(d.clone(), 2);
        assert_eq!(c.arrival_range(2), 0.0);
        d.rank_spread = 0.1;
        let c = CostModel::new(d, 4);
        assert_eq!(c.arrival_range(1), 0.0);
        // Two ranks: E|X1 − X2| = 2σ/√π.
        let two = c.arrival_range(2);
        assert!(
            (two - 0.2 / std::f64::consts::PI.sqrt()).abs() < 1e-6,
            "{two}"
        );
        assert!(c.arrival_range(4) > two);
    }

    #[test]
    fn collectives_leave_the_node_when_the_group_does() {
        let c = h100_node();
        let gb = 1e9;
        let inside = c.allreduce_time(gb, 8, 1);
        let across = c.allreduce_time(gb, 16, 1);
        assert!(across > 5.0 * inside);
        assert_eq!(c.allreduce_time(gb, 1, 1), 0.0);
        // 2·7/8 GB over 450 GB/s × 0.8, plus one start-up latency.
        assert!((inside - (1.75 / 360.0 + 10e-6)).abs() < 1e-9);
    }

    #[test]
    fn measured_all_reduces_are_interpolated_on_their_rank_count_within_a_node() {
        let mut d = DeviceKind::Cpu.spec();
        d.intra_node_latency = 240e-6;
        d.intra_node_bandwidth = 1.5e9;
        d.network_efficiency = 1.0;
        let line = CostModel::new(d.clone(), 2);
        // Gloo's shape: a scalar is quick, a kilobyte to a megabyte over a millisecond.
        d.allreduce = CollectiveTime::on_ranks(
            2,
            &[
                (4, 0.3e-3),
                (1024, 1.2e-3),
                (1 << 20, 1.6e-3),
                (4 << 20, 4.0e-3),
            ],
        );
        d.check().expect("a valid table");
        let c = CostModel::new(d.clone(), 2);
        // On a measured size: its time; between two: between them, in logarithms.
        assert!((c.allreduce_time(1024.0, 2, 1) - 1.2e-3).abs() < 1e-12);
        let mid = c.allreduce_time(32.0 * 1024.0, 2, 1);
        let geo = (1.2e-3f64.ln() + 0.5 * (1.6e-3f64.ln() - 1.2e-3f64.ln())).exp();
        assert!((mid - geo).abs() < 1e-9, "{mid} against {geo}");
        // Below the smallest: its time; beyond the largest: the last two points' slope.
        assert!((c.allreduce_time(1.0, 2, 1) - 0.3e-3).abs() < 1e-12);
        let big = c.allreduce_time(8.0 * (1 << 20) as f64, 2, 1);
        let slope = (4.0e-3 - 1.6e-3) / (3 << 20) as f64;
        assert!(
            (big - (4.0e-3 + slope * (4 << 20) as f64)).abs() < 1e-9,
            "{big}"
        );
        // Where the line priced 24 bytes at its latency, the table prices what was measured.
        assert!(line.allreduce_time(24.0, 2, 1) < 0.25e-3);
        assert!(c.allreduce_time(24.0, 2, 1) > 0.45e-3);
        // Another rank count, or a group across nodes, is not in the table: the line.
        assert_eq!(
            c.allreduce_time(1024.0, 4, 1),
            line.allreduce_time(1024.0, 4, 1)
        );
        assert_eq!(
            c.allreduce_time(1024.0, 2, 2),
            line.allreduce_time(1024.0, 2, 2)
        );
        // A bad entry is an error that names the table.
        d.allreduce[0].seconds = 0.0;
        assert!(d.check().unwrap_err().contains("device.allreduce"));
    }

    #[test]
    fn training_7b_on_one_h100_overflows_in_the_optimizer_state() {
        let c = h100_node();
        let m = llama7b();
        let use_ = MemoryUse {
            train: true,
            microbatch_seqs: 1,
            seq_len: 2048,
            microbatches: 1,
            ..MemoryUse::default()
        };
        let need = c.memory(&m, Layout::SINGLE, &use_);
        // bf16 weights 2, gradients 2 + an f32 accumulator 4, moments 8 + f32 masters 4 bytes
        // per parameter: 20 × 6.74 G = 134.8 GB.
        assert_eq!(need.weights, 2 * m.params());
        assert_eq!(need.gradients, 6 * m.params());
        assert_eq!(need.optimizer, 12 * m.params());
        let o = need.fits(&c.device).expect_err("too big");
        assert_eq!(o.term, MemoryTerm::OptimizerState);
        assert_eq!(o.over_by, need.total() - c.device.usable_memory());
        let msg = o.to_string();
        assert!(msg.starts_with("needs 1"), "{msg}");
        assert!(msg.ends_with("overflowing at the optimizer state"), "{msg}");
        assert!(msg.contains(&format!("({} bytes)", o.over_by)), "{msg}");
        // Sharded 8 ways it fits.
        let sharded = c.memory(
            &m,
            Layout {
                dp: 1,
                tp: 8,
                pp: 1,
            },
            &use_,
        );
        assert!(sharded.fits(&c.device).is_ok());
    }

    /// Each role in the bytes the runtime holds: a frozen model its weights in its dtype; a
    /// trained f32 model no masters (16 bytes per parameter), a bf16 one f32 masters and an
    /// f32 gradient accumulator (20); activations and the KV cache in the dtype; activation
    /// checkpointing keeps each layer's input and one layer's activations.
    #[test]
    fn memory_counts_each_role_in_the_model_dtype() {
        let c = h100_node();
        let m = llama7b();
        let n = m.params();
        let frozen = MemoryUse {
            kv_batch: 8,
            kv_context: 1024,
            ..MemoryUse::default()
        };
        for bytes in [4, 2] {
            let need = c.for_dtype(bytes).memory(&m, Layout::SINGLE, &frozen);
            assert_eq!(need.weights, bytes * n);
            assert_eq!(
                (need.gradients, need.optimizer, need.activations),
                (0, 0, 0)
            );
            assert_eq!(need.kv_cache, 8 * 1024 * m.kv_bytes_per_token(bytes));
        }
        let train = MemoryUse {
            train: true,
            microbatch_seqs: 4,
            seq_len: 2048,
            microbatches: 1,
            ..MemoryUse::default()
        };
        let f32 = c.for_dtype(4).memory(&m, Layout::SINGLE, &train);
        let bf16 = c.for_dtype(2).memory(&m, Layout::SINGLE, &train);
        assert_eq!(f32.weights + f32.gradients + f32.optimizer, 16 * n);
        assert_eq!(bf16.weights + bf16.gradients + bf16.optimizer, 20 * n);
        assert_eq!(param_bytes(2, true).optimizer, 12);
        assert_eq!(f32.activations, 2 * bf16.activations);
        let ck = c.for_dtype(2).memory(
            &m,
            Layout::SINGLE,
            &MemoryUse {
                checkpointing: true,
                ..train.clone()
            },
        );
        let tokens = 4 * 2048;
        let per_layer = bf16.activations / m.layers;
        assert_eq!(ck.activations, tokens * m.hidden * 2 * m.layers + per_layer);
        assert!(ck.activations * 10 < bf16.activations, "{ck:?}");
        // Recomputation costs one more forward per micro-batch.
        let plain = c.train_step_time(&m, Layout::SINGLE, 64, 1024, 4, false);
        let again = c.train_step_time(&m, Layout::SINGLE, 64, 1024, 4, true);
        assert!((again.backward - plain.backward - plain.forward).abs() < 1e-12);
    }

    #[test]
    fn kv_cache_is_the_term_that_overflows_generation() {
        let c = h100_node();
        let m = llama7b();
        let use_ = MemoryUse {
            kv_batch: 512,
            kv_context: 4096,
            ..MemoryUse::default()
        };
        let need = c.memory(&m, Layout::SINGLE, &use_);
        // 0.5 MiB per token for LLaMA-7B in bf16.
        assert_eq!(m.kv_bytes_per_token(2), 524_288);
        let o = need.fits(&c.device).expect_err("too big");
        assert_eq!(o.term, MemoryTerm::KvCache);
        assert!(o.over_by > 0);
    }

    #[test]
    fn layouts_are_checked_against_the_model() {
        let m = llama7b();
        assert!(
            Layout {
                dp: 1,
                tp: 8,
                pp: 4
            }
            .check(&m)
            .is_ok()
        );
        assert!(
            Layout {
                dp: 1,
                tp: 3,
                pp: 1
            }
            .check(&m)
            .is_err()
        );
        assert!(
            Layout {
                dp: 1,
                tp: 1,
                pp: 5
            }
            .check(&m)
            .is_err()
        );
        assert!(
            Layout {
                dp: 0,
                tp: 1,
                pp: 1
            }
            .check(&m)
            .is_err()
        );
    }
}
