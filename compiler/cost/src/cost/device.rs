//! The device table (peak bf16 FLOP/s, HBM bandwidth, memory, interconnects, efficiency
//! factors) and the CPU FLOP/s probe.
//!
//! Numbers are vendor datasheet peaks; sources are listed in `docs/planning.md`. The table is
//! data, not policy: it must not decide layouts. [`measure_cpu_flops`] is the one function in
//! this crate that reads the clock; it is never called implicitly, so plans stay deterministic
//! unless the caller asks for a measurement.

use std::time::Instant;

use serde::{Deserialize, Serialize};

const GB: f64 = 1e9;
const GIB: u64 = 1 << 30;

/// The kinds of device the planner knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DeviceKind {
    #[serde(rename = "H100-80G")]
    H100,
    #[serde(rename = "H200")]
    H200,
    #[serde(rename = "H800")]
    H800,
    #[serde(rename = "A100-80G")]
    A100,
    #[serde(rename = "cpu")]
    Cpu,
}

impl DeviceKind {
    pub const ALL: [DeviceKind; 5] = [
        DeviceKind::H100,
        DeviceKind::H200,
        DeviceKind::H800,
        DeviceKind::A100,
        DeviceKind::Cpu,
    ];

    /// The canonical name, as written in cluster specs and `cluster { gpu: "…" }`.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::H100 => "H100-80G",
            DeviceKind::H200 => "H200",
            DeviceKind::H800 => "H800",
            DeviceKind::A100 => "A100-80G",
            DeviceKind::Cpu => "cpu",
        }
    }

    /// Parses a device name, case-insensitively; `H100` and `A100` alone mean the 80 GB parts.
    pub fn parse(name: &str) -> Option<DeviceKind> {
        match name.to_ascii_lowercase().as_str() {
            "h100-80g" | "h100" | "h100-sxm" => Some(DeviceKind::H100),
            "h200" | "h200-141g" => Some(DeviceKind::H200),
            "h800" | "h800-80g" => Some(DeviceKind::H800),
            "a100-80g" | "a100" => Some(DeviceKind::A100),
            "cpu" => Some(DeviceKind::Cpu),
            _ => None,
        }
    }

    /// The datasheet entry. For the CPU, FLOP/s is a conservative placeholder; use
    /// [`DeviceSpec::cpu`] with [`measure_cpu_flops`] for a measured figure.
    pub fn spec(self) -> DeviceSpec {
        match self {
            // SXM5 parts: 989 TFLOP/s dense bf16; NVLink 4 900 GB/s both directions (450 each
            // way); one 400 Gb/s NDR InfiniBand NIC per GPU in DGX/HGX nodes.
            DeviceKind::H100 => gpu(self, 989e12, 3.35e12, 80, 450.0, 50.0),
            // Same compute as H100; HBM3e 4.8 TB/s, 141 GB.
            DeviceKind::H200 => gpu(self, 989e12, 4.8e12, 141, 450.0, 50.0),
            // The export variant of H100: same compute and memory, NVLink cut to 400 GB/s both
            // directions; RoCE at 200 Gb/s per GPU as in RLHFuse's cluster.
            DeviceKind::H800 => gpu(self, 989e12, 3.35e12, 80, 200.0, 25.0),
            // A100 SXM4 80 GB: 312 TFLOP/s bf16, 2.039 TB/s, NVLink 3 600 GB/s both directions,
            // 200 Gb/s HDR InfiniBand per GPU.
            DeviceKind::A100 => gpu(self, 312e12, 2.039e12, 80, 300.0, 25.0),
            DeviceKind::Cpu => DeviceSpec::cpu(50e9, 16 * GIB),
        }
    }
}

fn gpu(kind: DeviceKind, flops: f64, hbm: f64, mem_gb: u64, nvlink: f64, net: f64) -> DeviceSpec {
    DeviceSpec {
        kind,
        peak_flops: flops,
        mem_bandwidth: hbm,
        memory: mem_gb * 1_000_000_000,
        intra_node_bandwidth: nvlink * GB,
        inter_node_bandwidth: net * GB,
        // Large transformer matmuls reach 50–60 % of peak in Megatron-LM training (Narayanan
        // et al. 2021 report 52 % MFU on A100s); decoding reads memory at 70–80 % of peak;
        // NCCL's ring all-reduce reaches about 80 % of link bandwidth on large messages.
        compute_efficiency: 0.5,
        memory_efficiency: 0.75,
        network_efficiency: 0.8,
        // Per-collective latency: a few microseconds on NVLink, more across nodes.
        intra_node_latency: 10e-6,
        inter_node_latency: 30e-6,
        // A decode step's fixed time per layer beyond its weight and KV reads and its
        // all-reduces: the small kernels (norms, rotary, attention at small batch, activation,
        // residual adds), each with a minimum duration, and their launch gaps. Fitted to
        // published end-to-end decode latencies at batch 1–10 by subtracting what this model
        // charges without it:
        // - Llama-3-8B bf16, tp 8 on 8×H100, vLLM 0.6.0: 3.1–3.3 ms per token
        //   (LambdaLabsML/vllm-benchmark, results/prompt_10/8xH100-80GB-SXM); the model
        //   charges 1.47 ms, leaving 51–56 µs per layer;
        // - Llama-3-70B bf16, tp 8, same source: 11.3–12.2 ms; 8.83 ms charged, 31–42 µs;
        // - Llama-3.3-70B fp8, tp 2 on 2×H100, NVIDIA NIM 1.8 (docs.nvidia.com/nim/benchmarking,
        //   "Performance", 500 in / 2000 out, concurrency 1): 18.9 ms; 15.7 ms charged, 40 µs;
        // - Llama-3.1-8B bf16, tp 1 on A100-40GB, vLLM 0.23 (johnmusgrave.com, "vLLM
        //   throughput-latency sweep on NVIDIA A100"): 13.3 ms; 13.8 ms charged, nothing left.
        // 30 µs puts the model 22–26 % under the first, 1–8 % and 4 % under the 70B ones and
        // 11 % over the last. Without it a 13B decode step at tp 8 was about half the measured
        // time of a smaller model's.
        decode_layer_overhead: 30e-6,
        // CUDA context, cuBLAS workspace and allocator fragmentation.
        reserved_memory: 3 * GIB,
        // No published per-shape rates or per-pass constants for these parts: the efficiency
        // factors above stand for every shape, and `braid calibrate` measures the rest.
        overheads: Overheads::default(),
        matmul: Vec::new(),
        step_matmul: Vec::new(),
        allreduce: Vec::new(),
        allgather: Vec::new(),
        host_decode: None,
        host_cores: None,
        rank_spread: 0.0,
    }
}

/// Achieved matrix-multiply throughput for one shape: `rows × width` times `width × width`
/// (a layer's activations times a square weight), in FLOP/s (`2·rows·width²` per product).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatmulRate {
    pub rows: u64,
    pub width: u64,
    pub flops: f64,
}

/// A measured collective: `bytes` over `ranks` ranks of one node took `seconds` (`braid
/// calibrate`, the runtime's own collectives).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollectiveTime {
    pub ranks: u64,
    pub bytes: u64,
    pub seconds: f64,
    /// Seconds the last rank arrived after the others, and `seconds` is that rank's own time
    /// (the others waited for it); 0: every rank arrived at once, and `seconds` is the
    /// slowest rank's. Measured for the exchanges only
    /// ([`super::CostModel::host_allgather_time_apart`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub skew: f64,
}

impl CollectiveTime {
    /// A table of `(bytes, seconds)` measured on `ranks` ranks arriving together.
    pub fn on_ranks(ranks: u64, points: &[(u64, f64)]) -> Vec<CollectiveTime> {
        points
            .iter()
            .map(|&(bytes, seconds)| CollectiveTime {
                ranks,
                bytes,
                seconds,
                skew: 0.0,
            })
            .collect()
    }

    /// A table of `(skew, bytes, seconds)` measured on `ranks` ranks, the last arriving
    /// `skew` seconds after the others.
    pub fn apart_on_ranks(ranks: u64, points: &[(f64, u64, f64)]) -> Vec<CollectiveTime> {
        points
            .iter()
            .map(|&(skew, bytes, seconds)| CollectiveTime {
                ranks,
                bytes,
                seconds,
                skew,
            })
            .collect()
    }

    /// A measured size as it is printed: bytes, KiB or MiB (whole).
    pub fn size_label(bytes: u64) -> String {
        if bytes >= 1 << 20 {
            format!("{} MiB", bytes >> 20)
        } else if bytes >= 1 << 10 {
            format!("{} KiB", bytes >> 10)
        } else {
            format!("{bytes} B")
        }
    }
}

/// Seconds a pass costs beyond its roofline, by kind of pass, as a fixed part and parts per
/// layer, per row or token, and per row or token and layer: what the framework spends around
/// the matrix products (kernel launches, element-wise operators over the activations, sampling,
/// the optimizer's per-tensor loop). Measured by `braid calibrate` on the runtime's own passes
/// and fitted to these terms; zero for the GPU datasheet entries, which carry
/// `decode_layer_overhead` only (their efficiency factors stand for the rest).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Overheads {
    /// Per decode step, beyond its layers (the step's bookkeeping, the head).
    pub decode_step: f64,
    /// Per running row of a decode step (sampling, stop checks, the row's cache).
    pub decode_row: f64,
    /// Per running row, layer and unit of the hidden size of a decode step (the row's
    /// element-wise work: norms, activations, attention and cache updates).
    pub decode_row_layer: f64,
    /// Per running row, layer, cached token and unit of the KV width (key-value heads × head
    /// dimension) of a decode step: attention over the row's cache, whose keys and values the
    /// step reads and scores, beyond the bytes and FLOPs the roofline counts for them.
    pub decode_cache: f64,
    /// Per prefill pass over a batch of prompts, beyond its forward terms.
    pub prefill: f64,
    /// Per prompt token of a prefill pass, beyond its forward terms: the engine's work per
    /// token as it admits samples (their cache rows, their sampling state).
    pub prefill_token: f64,
    /// Per prompt token, layer and unit of the hidden size of a prefill pass, beyond its
    /// forward terms (the engine prefills through its cached steps, whose products the roofline
    /// prices at `DeviceSpec::step_matmul`'s rates).
    pub prefill_token_layer: f64,
    /// Per sample admitted by a prefill, beyond its prompt's tokens: its first token chosen
    /// from the prompt's logits, its cache rows copied from the prompt's. The samples of one
    /// prompt (`n` of a `generate`) share its prefill and pay this each.
    pub prefill_sample: f64,
    /// Per forward pass (an inference chunk), beyond its layers.
    pub forward: f64,
    /// Per layer of a forward pass (inference, prefill, a training micro-batch's forward).
    pub forward_layer: f64,
    /// Per token of a forward pass (the head's element-wise work, the log-softmax).
    pub forward_token: f64,
    /// Per token, layer and unit of the hidden size of a forward pass (norms, activations,
    /// attention's softmax).
    pub forward_token_layer: f64,
    /// Per attention score of a forward pass, per layer (`sequences · heads · length²` scores
    /// a layer: the scores' scaling, masking and softmax beyond the roofline's matmuls, which
    /// grow with the square of the length where every other term grows with it).
    pub forward_score: f64,
    /// Per training micro-batch, beyond its forward and backward terms.
    pub microbatch: f64,
    /// Per layer of a micro-batch's backward.
    pub backward_layer: f64,
    /// Per token of a micro-batch's backward.
    pub backward_token: f64,
    /// Per token, layer and unit of the hidden size of a micro-batch's backward.
    pub backward_token_layer: f64,
    /// Per attention score of a micro-batch's backward, per layer.
    pub backward_score: f64,
    /// Per optimizer step (the update's bookkeeping), beyond its layers.
    pub train_step: f64,
    /// Per layer of an optimizer step (the update's loop over a layer's tensors).
    pub optimizer_layer: f64,
}

impl Overheads {
    pub fn is_zero(&self) -> bool {
        *self == Overheads::default()
    }

    /// A forward pass's terms over `layers` layers of width `hidden`, `tokens` tokens and
    /// `scores` attention scores per layer (no fixed part).
    pub fn forward_terms(&self, layers: f64, tokens: f64, hidden: f64, scores: f64) -> f64 {
        layers * self.forward_layer
            + tokens * self.forward_token
            + layers * tokens * hidden * self.forward_token_layer
            + layers * scores * self.forward_score
    }

    /// A backward pass's terms over `layers` layers of width `hidden`, `tokens` tokens and
    /// `scores` attention scores per layer (no fixed part).
    pub fn backward_terms(&self, layers: f64, tokens: f64, hidden: f64, scores: f64) -> f64 {
        layers * self.backward_layer
            + tokens * self.backward_token
            + layers * tokens * hidden * self.backward_token_layer
            + layers * scores * self.backward_score
    }

    /// A decode step's terms over `layers` layers of width `hidden` and `rows` running rows
    /// attending to `context` cached tokens each over `kv_width` key-value units (beyond the
    /// device's `decode_layer_overhead`).
    pub fn decode_terms(
        &self,
        layers: f64,
        rows: f64,
        hidden: f64,
        context: f64,
        kv_width: f64,
    ) -> f64 {
        self.decode_step
            + rows * self.decode_row
            + layers * rows * hidden * self.decode_row_layer
            + layers * rows * context * kv_width * self.decode_cache
    }
}

/// What the cost model knows about one device. Bandwidths are bytes per second in one
/// direction; FLOP/s are dense bf16 peaks (for a CPU, the measured f32 rate).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    pub kind: DeviceKind,
    pub peak_flops: f64,
    pub mem_bandwidth: f64,
    pub memory: u64,
    pub intra_node_bandwidth: f64,
    pub inter_node_bandwidth: f64,
    pub compute_efficiency: f64,
    pub memory_efficiency: f64,
    pub network_efficiency: f64,
    pub intra_node_latency: f64,
    pub inter_node_latency: f64,
    /// Fixed seconds per layer of every decode step (kernel minimum durations and launch
    /// gaps that the roofline's reads and the all-reduces do not cover).
    pub decode_layer_overhead: f64,
    pub reserved_memory: u64,
    /// Fixed seconds per pass by kind, beyond the roofline (`braid calibrate`).
    #[serde(default, skip_serializing_if = "Overheads::is_zero")]
    pub overheads: Overheads,
    /// Achieved FLOP/s by matmul shape (`braid calibrate`); empty: `peak_flops ·
    /// compute_efficiency` for every shape.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub matmul: Vec<MatmulRate>,
    /// Achieved FLOP/s of the generation engine's cached steps' products (prefill and decode)
    /// by shape: on a CPU in f32 the host step (`runtime/src/kernels/step.rs`) multiplies
    /// them with Braid's own kernel (`runtime/src/kernels/gemm.rs`), not libtorch's matmul,
    /// and `braid calibrate` times that kernel on the `matmul` table's shapes; empty: the
    /// `matmul` table.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub step_matmul: Vec<MatmulRate>,
    /// All-reduces timed by size within one node (`braid calibrate` on several CPU ranks:
    /// Gloo's). Gloo's all-reduce does not follow one latency and one bandwidth: 4 bytes
    /// take a fraction of a millisecond, anything from about a kilobyte to a megabyte over a
    /// millisecond (`bench_collectives`), so a fitted line priced the
    /// runtime's gradient and metric sums at a fraction of what they take. Where it has the
    /// group's rank count, [`super::CostModel::allreduce_time`] interpolates it; empty (the
    /// datasheets): latency plus bytes over bandwidth.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allreduce: Vec<CollectiveTime>,
    /// The runtime's exchanges among CPU ranks timed by size (`braid calibrate`: its
    /// `all_gather_bytes`, the ranks' lengths and then their bytes, `bytes` in all over the
    /// ranks). Like Gloo's all-reduce, a few kilobytes cost far more than two of its smallest
    /// latencies; [`super::CostModel::host_allgather_time`] interpolates these where it has the
    /// rank count; empty: two latencies plus the bytes over the bandwidth. Entries with a
    /// [`CollectiveTime::skew`] are the same exchanges' cost to a last rank that arrived that
    /// long after the others ([`super::CostModel::host_allgather_time_apart`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allgather: Vec<CollectiveTime>,
    /// A generation engine that launches every kernel of a decode step from the host (no
    /// CUDA graphs) and waits for the device at every step, so that at small batches a step
    /// takes the host's time rather than the device's; `None`: the device's time
    /// (`decode_layer_overhead` standing for the launch gaps of an engine with CUDA graphs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_decode: Option<HostDecode>,
    /// On a CPU host: the cores each rank's threads share and the compute threads a rank runs
    /// (`braid calibrate` records both); `None`: a core for every thread the runtime starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_cores: Option<HostCores>,
    /// How far apart ranks doing the same work at the same moment finish: the standard
    /// deviation of their times over the mean, measured by `braid calibrate` on several ranks.
    /// A call on several ranks ends with its slowest rank ([`super::CostModel::slowest_of`]).
    /// 0 (the datasheets): every rank takes the time the model prices.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rank_spread: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// The cores a CPU rank's threads share: its compute threads (libtorch's, per rank) and, beside
/// them, the thread streamed inference runs on while the generation computes — which only gets a
/// core of its own when the rank has more cores than compute threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostCores {
    /// Cores per rank: the host's cores over the ranks on it.
    pub cores: u32,
    /// Compute threads per rank.
    pub threads: u32,
}

impl DeviceSpec {
    /// Whether a rank runs a second computation beside its first at full speed: a CPU rank with
    /// a core to spare for it (every CPU without a recorded host), never a GPU (one stream of
    /// kernels at a time, as the cost model prices it).
    pub fn spare_core(&self) -> bool {
        self.kind == DeviceKind::Cpu && self.host_cores.is_none_or(|h| h.cores > h.threads)
    }
}

/// The host's seconds in a decode step of an engine whose steps are host-bound: each layer's
/// kernels launched one by one, each tensor-parallel all-reduce a collective call that waits
/// for the slowest rank of its group, and — in pipelined generation — each schedule step's
/// blocking sends and receives between stages and its synchronisations. A step takes the
/// larger of this and the device's time (the kernels run while the host launches the next).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostDecode {
    /// Per layer of a decode pass, without tensor parallelism.
    pub layer: f64,
    /// Per tensor-parallel all-reduce of a decode pass (two per layer when `tp > 1`).
    pub collective: f64,
    /// Per schedule step of pipelined decoding: every stage runs one micro-batch, hands it
    /// to the next stage and synchronises; a token round takes `max(micro-batches, stages)`
    /// schedule steps.
    pub schedule_step: f64,
}

impl HostDecode {
    /// Host seconds of one decode pass over `layers` layers with `tp`-way tensor parallelism.
    pub fn pass(&self, layers: f64, tp: u64) -> f64 {
        let collectives = if tp > 1 { 2.0 } else { 0.0 };
        layers * (self.layer + collectives * self.collective)
    }
}

impl DeviceSpec {
    /// A CPU with a given FLOP/s (typically from [`measure_cpu_flops`]) and memory. The
    /// measurement is of real achieved throughput, so its efficiency factor is 1.
    pub fn cpu(flops: f64, memory: u64) -> DeviceSpec {
        DeviceSpec {
            kind: DeviceKind::Cpu,
            peak_flops: flops,
            mem_bandwidth: 20e9,
            memory,
            // Processes on one machine exchange through shared memory; across machines a
            // 10 Gb/s Ethernet link is the common case.
            intra_node_bandwidth: 10e9,
            inter_node_bandwidth: 1.25e9,
            compute_efficiency: 1.0,
            memory_efficiency: 0.7,
            network_efficiency: 0.7,
            intra_node_latency: 20e-6,
            inter_node_latency: 100e-6,
            // No published per-layer figure for CPU decoding; the measured FLOP/s already
            // include the CPU's overheads.
            decode_layer_overhead: 0.0,
            reserved_memory: GIB / 2,
            overheads: Overheads::default(),
            matmul: Vec::new(),
            step_matmul: Vec::new(),
            allreduce: Vec::new(),
            allgather: Vec::new(),
            host_decode: None,
            host_cores: None,
            rank_spread: 0.0,
        }
    }

    /// FLOP/s the cost model plans with where the shape is unknown (or not measured).
    pub fn effective_flops(&self) -> f64 {
        self.peak_flops * self.compute_efficiency
    }

    /// FLOP/s of a pass whose matrix products have `rows` rows (its tokens) and inner width
    /// `width` (the model's hidden size): interpolated in the logarithms of both between the
    /// measured shapes of [`DeviceSpec::matmul`] (clamped at the edges of the measured grid),
    /// [`DeviceSpec::effective_flops`] when nothing was measured.
    pub fn flops_at(&self, rows: f64, width: u64) -> f64 {
        rate_at(&self.matmul, rows, width).unwrap_or_else(|| self.effective_flops())
    }

    /// [`DeviceSpec::flops_at`] for the products of the engine's cached steps (prefill,
    /// decode): the `step_matmul` table where there is one.
    pub fn step_flops_at(&self, rows: f64, width: u64) -> f64 {
        rate_at(&self.step_matmul, rows, width).unwrap_or_else(|| self.flops_at(rows, width))
    }

    /// Seconds of an all-reduce of `bytes` over `ranks` ranks of one node from the measured
    /// [`DeviceSpec::allreduce`] times on that many ranks: interpolated in logarithms between
    /// the measured sizes, the smallest's time below them, and beyond the largest its time
    /// plus the rest at the slope of its last two points (bandwidth-bound there). `None`
    /// without measurements on `ranks` ranks.
    pub fn measured_allreduce(&self, bytes: f64, ranks: u64) -> Option<f64> {
        measured_collective(&self.allreduce, bytes, ranks, 0.0)
    }

    /// [`DeviceSpec::measured_allreduce`] for the runtime's exchanges among ranks
    /// ([`DeviceSpec::allgather`]), `bytes` in all over the ranks, every rank arriving at once.
    pub fn measured_allgather(&self, bytes: f64, ranks: u64) -> Option<f64> {
        measured_collective(&self.allgather, bytes, ranks, 0.0)
    }

    /// What the exchange of `bytes` costs its last rank when it arrives `skew` seconds after
    /// the first: interpolated linearly in the skew between the skews measured
    /// ([`CollectiveTime::skew`], the together times at 0), each at `bytes` as
    /// [`DeviceSpec::measured_allreduce`] interpolates sizes; beyond the largest skew measured,
    /// its time. `None` without exchanges measured on `ranks` ranks; the together time
    /// where none was measured apart.
    pub fn measured_allgather_apart(&self, bytes: f64, ranks: u64, skew: f64) -> Option<f64> {
        let together = self.measured_allgather(bytes, ranks)?;
        let mut pts = vec![(0.0, together)];
        for s in self.allgather_skews(ranks) {
            if let Some(t) = measured_collective(&self.allgather, bytes, ranks, s) {
                pts.push((s, t));
            }
        }
        Some(interpolate(&pts, skew.max(0.0)))
    }

    /// The arrival skews, above 0, at which exchanges were measured on `ranks` ranks
    /// ([`CollectiveTime::skew`]), in order.
    pub fn allgather_skews(&self, ranks: u64) -> Vec<f64> {
        let mut skews: Vec<f64> = self
            .allgather
            .iter()
            .filter(|c| c.ranks == ranks && c.skew > 0.0)
            .map(|c| c.skew)
            .collect();
        skews.sort_by(f64::total_cmp);
        skews.dedup();
        skews
    }
}

/// A collective's measured time at `bytes` on `ranks` ranks from `table`'s entries measured
/// at arrival skew `skew` (see [`DeviceSpec::measured_allreduce`]).
fn measured_collective(table: &[CollectiveTime], bytes: f64, ranks: u64, skew: f64) -> Option<f64> {
    let mut pts: Vec<(f64, f64)> = table
        .iter()
        .filter(|c| c.ranks == ranks && c.skew == skew)
        .map(|c| (c.bytes as f64, c.seconds))
        .collect();
    if pts.is_empty() {
        return None;
    }
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (last_b, last_t) = pts[pts.len() - 1];
    if bytes > last_b {
        let slope = match pts.len() {
            1 => 0.0,
            n => {
                let (b0, t0) = pts[n - 2];
                ((last_t - t0) / (last_b - b0)).max(0.0)
            }
        };
        return Some(last_t + (bytes - last_b) * slope);
    }
    let logs: Vec<(f64, f64)> = pts.iter().map(|&(b, t)| (b.ln(), t.ln())).collect();
    Some(interpolate(&logs, bytes.max(1.0).ln()).exp())
}

/// The rate of `table` at `rows × width`, interpolated in logarithms between its measured
/// shapes (clamped at the edges of the grid); `None` for an empty table.
fn rate_at(table: &[MatmulRate], rows: f64, width: u64) -> Option<f64> {
    if table.is_empty() {
        return None;
    }
    let mut widths: Vec<u64> = table.iter().map(|m| m.width).collect();
    widths.sort_unstable();
    widths.dedup();
    let w = (width.max(1) as f64).ln();
    let (lo, hi, t) = bracket(&widths, w);
    let at = |width: u64| {
        let mut pts: Vec<(f64, f64)> = table
            .iter()
            .filter(|m| m.width == width)
            .map(|m| ((m.rows.max(1) as f64).ln(), m.flops.max(1.0).ln()))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        interpolate(&pts, rows.max(1.0).ln())
    };
    Some(((1.0 - t) * at(lo) + t * at(hi)).exp())
}

/// The two neighbours of `x` (a logarithm) among sorted `values` and the weight of the upper
/// one; clamped to the first or last value outside their range.
fn bracket(values: &[u64], x: f64) -> (u64, u64, f64) {
    let ln = |v: u64| (v.max(1) as f64).ln();
    let first = values[0];
    let last = values[values.len() - 1];
    if x <= ln(first) {
        return (first, first, 0.0);
    }
    if x >= ln(last) {
        return (last, last, 0.0);
    }
    for pair in values.windows(2) {
        let (a, b) = (ln(pair[0]), ln(pair[1]));
        if x <= b {
            return (pair[0], pair[1], (x - a) / (b - a));
        }
    }
    (last, last, 0.0)
}

/// Piecewise-linear interpolation through sorted points, constant beyond the ends.
pub(crate) fn interpolate(points: &[(f64, f64)], x: f64) -> f64 {
    let (first, last) = (points[0], points[points.len() - 1]);
    if x <= first.0 {
        return first.1;
    }
    if x >= last.0 {
        return last.1;
    }
    for pair in points.windows(2) {
        let ((x0, y0), (x1, y1)) = (pair[0], pair[1]);
        if x <= x1 {
            let t = if x1 > x0 { (x - x0) / (x1 - x0) } else { 0.0 };
            return y0 + t * (y1 - y0);
        }
    }
    last.1
}

/// The format name a device profile file carries.
pub const PROFILE_FORMAT: &str = "braid-device-profile";
/// The profile format version this build reads and writes.
pub const PROFILE_VERSION: u32 = 1;

/// A device profile (`braid calibrate` writes it; `braid plan`/`braid sim --profile` read it):
/// the device entry the cost model plans with, and the measurements it was derived from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceProfile {
    pub format: String,
    pub version: u32,
    pub device: DeviceSpec,
    /// What was measured, for the reader (host, threads, ranks, raw timings).
    #[serde(default)]
    pub measured: serde_json::Value,
}

impl DeviceProfile {
    pub fn new(device: DeviceSpec, measured: serde_json::Value) -> DeviceProfile {
        DeviceProfile {
            format: PROFILE_FORMAT.into(),
            version: PROFILE_VERSION,
            device,
            measured,
        }
    }

    /// Reads a profile from its JSON text; the message says what is wrong (the caller names
    /// the file).
    pub fn from_json(text: &str) -> Result<DeviceProfile, String> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
        match v.get("format").and_then(|f| f.as_str()) {
            Some(PROFILE_FORMAT) => {}
            Some(other) => {
                return Err(format!(
                    "format `{other}` is not a device profile (expected `{PROFILE_FORMAT}`)"
                ));
            }
            None => {
                return Err(
                    "no `format` field: not a device profile (`braid calibrate` writes them)"
                        .to_string(),
                );
            }
        }
        match v.get("version").and_then(|f| f.as_u64()) {
            Some(n) if n == u64::from(PROFILE_VERSION) => {}
            Some(n) => {
                return Err(format!(
                    "profile version {n}; this build reads version {PROFILE_VERSION} (run `braid calibrate` again)"
                ));
            }
            None => return Err("no `version` field".into()),
        }
        let p: DeviceProfile =
            serde_json::from_value(v).map_err(|e| format!("not a device profile: {e}"))?;
        p.device.check()?;
        Ok(p)
    }
}

impl DeviceSpec {
    /// Refuses figures the cost model cannot plan with (zero or negative rates, non-finite
    /// numbers), naming the field.
    pub fn check(&self) -> Result<(), String> {
        let positive = [
            ("peak_flops", self.peak_flops),
            ("mem_bandwidth", self.mem_bandwidth),
            ("intra_node_bandwidth", self.intra_node_bandwidth),
            ("inter_node_bandwidth", self.inter_node_bandwidth),
            ("compute_efficiency", self.compute_efficiency),
            ("memory_efficiency", self.memory_efficiency),
            ("network_efficiency", self.network_efficiency),
        ];
        for (name, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!(
                    "`device.{name}` is {v}; it must be a positive number"
                ));
            }
        }
        let o = &self.overheads;
        let non_negative = [
            ("intra_node_latency", self.intra_node_latency),
            ("inter_node_latency", self.inter_node_latency),
            ("decode_layer_overhead", self.decode_layer_overhead),
            ("rank_spread", self.rank_spread),
            ("overheads.decode_step", o.decode_step),
            ("overheads.decode_row", o.decode_row),
            ("overheads.decode_row_layer", o.decode_row_layer),
            ("overheads.decode_cache", o.decode_cache),
            ("overheads.prefill", o.prefill),
            ("overheads.prefill_token", o.prefill_token),
            ("overheads.prefill_token_layer", o.prefill_token_layer),
            ("overheads.prefill_sample", o.prefill_sample),
            ("overheads.forward", o.forward),
            ("overheads.forward_layer", o.forward_layer),
            ("overheads.forward_token", o.forward_token),
            ("overheads.forward_token_layer", o.forward_token_layer),
            ("overheads.forward_score", o.forward_score),
            ("overheads.microbatch", o.microbatch),
            ("overheads.backward_layer", o.backward_layer),
            ("overheads.backward_token", o.backward_token),
            ("overheads.backward_token_layer", o.backward_token_layer),
            ("overheads.backward_score", o.backward_score),
            ("overheads.train_step", o.train_step),
            ("overheads.optimizer_layer", o.optimizer_layer),
        ]
        .into_iter()
        .chain(self.host_decode.iter().flat_map(|h| {
            [
                ("host_decode.layer", h.layer),
                ("host_decode.collective", h.collective),
                ("host_decode.schedule_step", h.schedule_step),
            ]
        }));
        for (name, v) in non_negative {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("`device.{name}` is {v}; it must be zero or more"));
            }
        }
        for (table, m) in self
            .matmul
            .iter()
            .map(|m| ("matmul", m))
            .chain(self.step_matmul.iter().map(|m| ("step_matmul", m)))
        {
            if m.rows == 0 || m.width == 0 || !(m.flops.is_finite() && m.flops > 0.0) {
                return Err(format!(
                    "`device.{table}` entry {} × {}: {} FLOP/s; rows, width and FLOP/s must be positive",
                    m.rows, m.width, m.flops
                ));
            }
        }
        for (table, c) in self
            .allreduce
            .iter()
            .map(|c| ("allreduce", c))
            .chain(self.allgather.iter().map(|c| ("allgather", c)))
        {
            if c.ranks < 2
                || c.bytes == 0
                || !(c.seconds.is_finite() && c.seconds > 0.0)
                || !(c.skew.is_finite() && c.skew >= 0.0)
            {
                return Err(format!(
                    "`device.{table}` entry of {} B on {} ranks: {} s after a skew of {} s; it needs at least 2 ranks, at least 1 byte, a positive time and a skew of at least 0",
                    c.bytes, c.ranks, c.seconds, c.skew
                ));
            }
        }
        if let Some(h) = self.host_cores
            && (h.cores == 0 || h.threads == 0)
        {
            return Err(format!(
                "`device.host_cores` has {} cores and {} threads per rank; both must be at least 1",
                h.cores, h.threads
            ));
        }
        if self.memory <= self.reserved_memory {
            return Err(format!(
                "`device.memory` ({} B) must exceed `device.reserved_memory` ({} B)",
                self.memory, self.reserved_memory
            ));
        }
        Ok(())
    }

    /// Bytes per second the cost model plans with for reading device memory.
    pub fn effective_mem_bandwidth(&self) -> f64 {
        self.mem_bandwidth * self.memory_efficiency
    }

    /// Memory left for weights, optimizer state, activations and caches.
    pub fn usable_memory(&self) -> u64 {
        self.memory.saturating_sub(self.reserved_memory)
    }
}

/// Measures this machine's single-thread f32 matmul throughput: a cache-friendly `i-k-j` loop
/// on 96×96 matrices, repeated for at least `min_seconds`, returning FLOP/s (`2n³` per
/// product). Single-threaded because that is what one CPU worker of the runtime gets per core
/// in a plan; the caller multiplies by cores if it plans threads.
pub fn measure_cpu_flops(min_seconds: f64) -> f64 {
    const N: usize = 96;
    let a: Vec<f32> = (0..N * N).map(|i| (i % 7) as f32 * 0.25).collect();
    let b: Vec<f32> = (0..N * N).map(|i| (i % 5) as f32 * 0.5).collect();
    let mut c = vec![0f32; N * N];
    let start = Instant::now();
    let mut reps = 0u64;
    loop {
        for i in 0..N {
            let row = &mut c[i * N..(i + 1) * N];
            for k in 0..N {
                let aik = a[i * N + k];
                let brow = &b[k * N..(k + 1) * N];
                for (cj, bj) in row.iter_mut().zip(brow) {
                    *cj += aik * bj;
                }
            }
        }
        reps += 1;
        let elapsed = start.elapsed().as_secs_f64();
        if elapsed >= min_seconds && reps >= 2 {
            // Keep the result observable so the loop is not optimised away.
            std::hint::black_box(&c);
            return 2.0 * (N * N * N) as f64 * reps as f64 / elapsed;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_aliases_resolve() {
        for k in DeviceKind::ALL {
            assert_eq!(DeviceKind::parse(k.name()), Some(k));
            assert_eq!(k.spec().kind, k);
        }
        assert_eq!(DeviceKind::parse("h100"), Some(DeviceKind::H100));
        assert_eq!(DeviceKind::parse("V100"), None);
    }

    #[test]
    fn table_orders_devices_sensibly() {
        let h100 = DeviceKind::H100.spec();
        let h200 = DeviceKind::H200.spec();
        let h800 = DeviceKind::H800.spec();
        let a100 = DeviceKind::A100.spec();
        assert!(h200.mem_bandwidth > h100.mem_bandwidth && h200.memory > h100.memory);
        assert_eq!(h800.peak_flops, h100.peak_flops);
        assert!(h800.intra_node_bandwidth < h100.intra_node_bandwidth);
        assert!(a100.peak_flops < h100.peak_flops / 3.0);
        for k in DeviceKind::ALL {
            let s = k.spec();
            assert!(s.usable_memory() > 0 && s.effective_flops() > 0.0);
            assert!(s.intra_node_bandwidth >= s.inter_node_bandwidth);
        }
    }

    #[test]
    fn cpu_probe_measures_a_plausible_rate() {
        let f = measure_cpu_flops(0.01);
        // Anything from an unoptimised debug build on a slow core to a fast vectorised loop.
        assert!(f > 1e6 && f < 1e12, "{f}");
    }

    fn with_table(rows: &[(u64, u64, f64)]) -> DeviceSpec {
        let mut d = DeviceKind::Cpu.spec();
        d.matmul = rows
            .iter()
            .map(|&(rows, width, flops)| MatmulRate { rows, width, flops })
            .collect();
        d
    }

    #[test]
    fn flops_at_interpolates_in_log_space_and_clamps_outside_the_table() {
        let d = with_table(&[
            (1, 64, 1e9),
            (100, 64, 1e11),
            (1, 256, 4e9),
            (100, 256, 4e11),
        ]);
        // On the grid: the measured rates.
        assert!((d.flops_at(1.0, 64) / 1e9 - 1.0).abs() < 1e-9);
        assert!((d.flops_at(100.0, 256) / 4e11 - 1.0).abs() < 1e-9);
        // Between rows, geometric: 10 rows of 1..100 is halfway in log space.
        assert!((d.flops_at(10.0, 64) / 1e10 - 1.0).abs() < 1e-9);
        // Between widths, likewise: 128 is halfway between 64 and 256.
        assert!((d.flops_at(1.0, 128) / 2e9 - 1.0).abs() < 1e-9);
        // Outside: the nearest edge, never an extrapolation.
        assert!((d.flops_at(1e6, 64) / 1e11 - 1.0).abs() < 1e-9);
        assert!((d.flops_at(0.0, 8) / 1e9 - 1.0).abs() < 1e-9);
        assert!((d.flops_at(1e6, 1 << 20) / 4e11 - 1.0).abs() < 1e-9);
        // Without a table: the datasheet's effective rate.
        let plain = DeviceKind::H100.spec();
        assert_eq!(plain.flops_at(7.0, 4096), plain.effective_flops());
    }

    /// The engine's cached steps are priced at the step table's rates (Braid's kernel) where
    /// there is one, at the matmul table's otherwise; a bad step-table entry is named.
    #[test]
    fn cached_steps_take_the_step_tables_rates() {
        let mut d = with_table(&[(1, 64, 1e9), (100, 64, 1e11)]);
        assert_eq!(d.step_flops_at(10.0, 64), d.flops_at(10.0, 64));
        d.step_matmul = vec![
            MatmulRate {
                rows: 1,
                width: 64,
                flops: 5e8,
            },
            MatmulRate {
                rows: 100,
                width: 64,
                flops: 5e10,
            },
        ];
        assert!((d.step_flops_at(10.0, 64) / 5e9 - 1.0).abs() < 1e-9);
        assert!((d.flops_at(10.0, 64) / 1e10 - 1.0).abs() < 1e-9);
        // A decode step and a prefill of a model whose products take all the time: twice as
        // long at half the rate; a forward (libtorch's matmul) is unchanged.
        let m = crate::cost::ModelShape::tiny(2, 64, 4, Some(4), Some(256), 256).unwrap();
        let mut slow = d.clone();
        slow.mem_bandwidth = 1e15;
        let mut fast = slow.clone();
        fast.step_matmul.clear();
        let (s, f) = (
            crate::cost::CostModel::new(slow, 1).for_dtype(4),
            crate::cost::CostModel::new(fast, 1).for_dtype(4),
        );
        let one = crate::cost::Layout::SINGLE;
        let ratio = s.decode_step_time(&m, one, 10, 16) / f.decode_step_time(&m, one, 10, 16);
        assert!((ratio - 2.0).abs() < 1e-6, "{ratio}");
        let ratio = s.prefill_time(&m, one, 1, 10) / f.prefill_time(&m, one, 1, 10);
        assert!((ratio - 2.0).abs() < 1e-6, "{ratio}");
        assert_eq!(
            s.forward_time(&m, one, 1, 10),
            f.forward_time(&m, one, 1, 10)
        );
        d.step_matmul[0].flops = 0.0;
        assert!(d.check().unwrap_err().contains("device.step_matmul"));
    }

    #[test]
    fn profiles_round_trip_and_malformed_ones_say_what_is_wrong() {
        let mut d = with_table(&[(4, 32, 2e9)]);
        d.overheads.decode_step = 3e-4;
        let p = DeviceProfile::new(d.clone(), serde_json::json!({"ranks": 1}));
        let text = serde_json::to_string(&p).unwrap();
        let back = DeviceProfile::from_json(&text).unwrap();
        assert_eq!(back.device, d);
        for (text, says) in [
            ("[1, 2", "not valid JSON"),
            (r#"{"version": 1}"#, "no `format`"),
            (
                r#"{"format": "braid-plan", "version": 1}"#,
                "not a device profile",
            ),
            (
                r#"{"format": "braid-device-profile", "version": 2}"#,
                "version 2",
            ),
            (r#"{"format": "braid-device-profile"}"#, "no `version`"),
        ] {
            let e = DeviceProfile::from_json(text).unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
        }
        // An unknown constant is refused, not ignored.
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["device"]["peak_flop"] = serde_json::json!(1.0);
        let e = DeviceProfile::from_json(&v.to_string()).unwrap_err();
        assert!(e.contains("peak_flop"), "{e}");
        // A constant out of range names its field.
        let mut bad = d.clone();
        bad.overheads.forward = -1.0;
        assert!(bad.check().unwrap_err().contains("overheads.forward"));
        let mut bad = d;
        bad.matmul[0].flops = f64::NAN;
        assert!(bad.check().is_err());
    }
}
