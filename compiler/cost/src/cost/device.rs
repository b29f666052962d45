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
    }
}

/// What the cost model knows about one device. Bandwidths are bytes per second in one
/// direction; FLOP/s are dense bf16 peaks.
#[derive(Clone, Debug, PartialEq, Serialize)]
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
        }
    }

    /// FLOP/s the cost model plans with.
    pub fn effective_flops(&self) -> f64 {
        self.peak_flops * self.compute_efficiency
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
}
