//! `braid calibrate`: measures this device's cost-model constants on the ranks it runs on (one
//! process, or every rank under `braid launch`) and writes a device profile that `braid plan`,
//! `braid sim` and `braid run` take with `--profile FILE`. The measuring and fitting is
//! `braid_runtime::calibrate`'s; this command reports progress and writes the file.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use braid_cost::cost::{CollectiveTime, DeviceProfile};
use braid_runtime::Kind;
use braid_runtime::calibrate::{self, Measurements};
use braid_runtime::dist::{GroupOptions, ProcessGroup, World};

#[derive(clap::Args)]
pub struct Args {
    /// Where to write the device profile.
    #[arg(long, short, default_value = "profile.json")]
    out: PathBuf,
    /// Seconds each timing repeats for at least (longer is steadier on a busy machine).
    #[arg(long, value_name = "SECONDS", default_value_t = 0.2)]
    min_seconds: f64,
    /// Rounds of the timings on each rank: every product, memory and pass timing is taken
    /// this many times, a whole round apart, for `--min-seconds` in all, and their mean kept.
    #[arg(long, value_name = "N", default_value_t = 1)]
    rounds: usize,
    /// libtorch threads per process, as `braid run --threads` (default 1).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Seconds any rank waits for the others before giving up (several ranks).
    #[arg(long, value_name = "SECONDS", default_value_t = 600)]
    dist_timeout: u64,
}

pub fn run(args: Args) -> ExitCode {
    match calibrate_here(&args) {
        Ok(Some(summary)) => {
            println!("{summary}");
            ExitCode::SUCCESS
        }
        Ok(None) => ExitCode::SUCCESS,
        Err((msg, code)) => {
            eprintln!("error: {msg}");
            ExitCode::from(code)
        }
    }
}

/// Measures and, on rank 0, writes the profile; returns what rank 0 prints.
fn calibrate_here(args: &Args) -> Result<Option<String>, (String, u8)> {
    if !(args.min_seconds.is_finite() && args.min_seconds > 0.0) {
        return Err((
            format!(
                "--min-seconds {}: must be a positive number",
                args.min_seconds
            ),
            2,
        ));
    }
    if args.rounds == 0 {
        return Err(("--rounds 0: at least one round of timings".into(), 2));
    }
    let world = World::from_env().map_err(|e| (e.to_string(), 2))?;
    let (device, cluster) = crate::run::this_world(&world);
    braid_runtime::device::set_cpu_threads(args.threads.max(1));
    let lead = world.rank == 0;
    let group = if world.size > 1 {
        Some(
            ProcessGroup::init(
                &world,
                GroupOptions::gloo(Duration::from_secs(args.dist_timeout.max(1))),
            )
            .map_err(|e| (e.to_string(), 1))?,
        )
    } else {
        None
    };
    let kind = if device == braid_runtime::Device::Cpu {
        Kind::Float
    } else {
        Kind::BFloat16
    };
    if lead {
        eprintln!(
            "calibrating {} ({} rank{}, {} thread{} each): matmuls, memory bandwidth, the passes of tiny models{}",
            cluster.device.name(),
            world.size,
            if world.size == 1 { "" } else { "s" },
            args.threads.max(1),
            if args.threads.max(1) == 1 { "" } else { "s" },
            if world.size > 1 && device == braid_runtime::Device::Cpu {
                ", all-reduces, the ranks' spread"
            } else if world.size > 1 {
                ", the ranks' spread"
            } else {
                ""
            }
        );
    }
    let start = Instant::now();
    let options = calibrate::Options {
        min_seconds: args.min_seconds,
        rounds: args.rounds,
        device,
        kind,
    };
    let m = calibrate::measure(&options, group.as_ref()).map_err(|e| (e.to_string(), 1))?;
    let base = cluster.device.spec();
    let mut spec = calibrate::fit(&base, &m).map_err(|e| (e.to_string(), 1))?;
    if device == braid_runtime::Device::Cpu {
        // The host's cores (as this process may use them) shared by the ranks on it; under
        // `braid launch`'s binding, this rank's own block of them.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let local = world.local_size.unwrap_or(world.size).max(1);
        let bound = std::env::var_os("BRAID_CPUS").is_some();
        spec.host_cores = Some(braid_cost::cost::HostCores {
            cores: if bound { cores } else { (cores / local).max(1) } as u32,
            threads: args.threads.max(1) as u32,
        });
    }
    if let Some(g) = group {
        g.shutdown().map_err(|e| (e.to_string(), 1))?;
    }
    if !lead {
        return Ok(None);
    }
    let measured = measured_json(&m, &world, args, start.elapsed().as_secs_f64());
    let profile = DeviceProfile::new(spec, measured);
    let text = serde_json::to_string_pretty(&profile)
        .map_err(|e| (format!("cannot serialise the profile: {e}"), 1))?
        + "\n";
    std::fs::write(&args.out, text)
        .map_err(|e| (format!("{}: cannot write: {e}", args.out.display()), 1))?;
    let d = &profile.device;
    let o = &d.overheads;
    let mut s = format!(
        "wrote {} in {:.1} s\n  matmul {:.2}–{:.2} GFLOP/s over {} shapes{}; memory {:.1} GB/s\n  decode step: {:.0} µs + {:.0} µs per layer + {:.1} µs per row + {:.1} µs per row, layer and 1,000 units of width + {:.2} µs per row, layer, cached token and 1,000 units of key-value width\n  forward: {:.0} µs + {:.0} µs per layer + {:.2} µs per token + {:.2} µs per token, layer and 1,000 units of width + {:.2} µs per 1,000 attention scores and layer (prefill {:.0} µs + {:.2} µs per prompt token + {:.2} µs per prompt token, layer and 1,000 units of width + {:.1} µs per sample more)\n  backward: {:.0} µs + {:.0} µs per layer + {:.2} µs per token + {:.2} µs per token, layer and 1,000 units of width + {:.2} µs per 1,000 attention scores and layer\n  optimizer step: {:.0} µs + {:.0} µs per layer",
        args.out.display(),
        start.elapsed().as_secs_f64(),
        d.matmul
            .iter()
            .map(|r| r.flops)
            .fold(f64::INFINITY, f64::min)
            / 1e9,
        d.peak_flops / 1e9,
        d.matmul.len(),
        if d.step_matmul.is_empty() {
            String::new()
        } else {
            format!(
                " (the engine's cached steps' products, Braid's kernel: {:.2}–{:.2})",
                d.step_matmul
                    .iter()
                    .map(|r| r.flops)
                    .fold(f64::INFINITY, f64::min)
                    / 1e9,
                d.step_matmul.iter().map(|r| r.flops).fold(0.0, f64::max) / 1e9
            )
        },
        d.mem_bandwidth / 1e9,
        o.decode_step * 1e6,
        d.decode_layer_overhead * 1e6,
        o.decode_row * 1e6,
        o.decode_row_layer * 1e9,
        o.decode_cache * 1e9,
        o.forward * 1e6,
        o.forward_layer * 1e6,
        o.forward_token * 1e6,
        o.forward_token_layer * 1e9,
        o.forward_score * 1e9,
        o.prefill * 1e6,
        o.prefill_token * 1e6,
        o.prefill_token_layer * 1e9,
        o.prefill_sample * 1e6,
        o.microbatch * 1e6,
        o.backward_layer * 1e6,
        o.backward_token * 1e6,
        o.backward_token_layer * 1e9,
        o.backward_score * 1e9,
        o.train_step * 1e6,
        o.optimizer_layer * 1e6,
    );
    // How closely the fitted model prices what was measured.
    let errors = calibrate::fit_errors(d, &m).map_err(|e| (e.to_string(), 1))?;
    s.push_str("\n  the fitted model against the timings (median, worst):");
    for (kind, n, median, worst) in errors {
        s.push_str(&format!(
            "\n    {kind} ({n}): {:.0} %, {:.0} %",
            median * 100.0,
            worst * 100.0
        ));
    }
    if m.allreduce.is_empty() {
        s.push_str(
            "\n  collectives: not measured (one rank, or GPUs); the datasheet's figures are kept",
        );
    } else {
        let listed = |points: &[(u64, f64)]| {
            points
                .iter()
                .map(|&(b, t)| format!("{} {:.2} ms", CollectiveTime::size_label(b), t * 1e3))
                .collect::<Vec<_>>()
                .join(", ")
        };
        s.push_str(&format!(
            "\n  all-reduce over {} ranks: {}; priced from these times (a line through them: \
             latency {:.0} µs, bandwidth {:.2} GB/s)",
            world.size,
            listed(&m.allreduce),
            d.intra_node_latency * 1e6,
            d.intra_node_bandwidth / 1e9
        ));
        if !m.allgather.is_empty() {
            s.push_str(&format!(
                "\n  the runtime's exchange among {} ranks (all-gather, bytes in all): {}",
                world.size,
                listed(&m.allgather)
            ));
        }
        let mut skews: Vec<f64> = m.allgather_apart.iter().map(|p| p.0).collect();
        skews.sort_by(f64::total_cmp);
        skews.dedup();
        for skew in skews {
            let at: Vec<(u64, f64)> = m
                .allgather_apart
                .iter()
                .filter(|p| p.0 == skew)
                .map(|p| (p.1, p.2))
                .collect();
            s.push_str(&format!(
                "\n    to the last rank when it arrives {:.1} ms after the others: {}",
                skew * 1e3,
                listed(&at)
            ));
        }
    }
    if !m.rank_excess.is_empty() {
        let mean = m.rank_excess.iter().sum::<f64>() / m.rank_excess.len() as f64;
        s.push_str(&format!(
            "\n  the same work started on {} ranks at once: the slowest {:.1} % over their mean \
             ({} repetitions), a spread of {:.1} %: calls on several ranks are priced to end with \
             their slowest",
            world.size,
            mean * 100.0,
            m.rank_excess.len(),
            d.rank_spread * 100.0
        ));
    }
    if let Some(h) = d.host_cores {
        s.push_str(&format!(
            "\n  host: {} core{} per rank for {} compute thread{}: streamed inference {}",
            h.cores,
            if h.cores == 1 { "" } else { "s" },
            h.threads,
            if h.threads == 1 { "" } else { "s" },
            if d.spare_core() {
                "runs beside the generation on a core of its own"
            } else {
                "shares the generation's cores"
            }
        ));
    }
    Ok(Some(s))
}

/// What the profile records of its measurements, for the reader.
fn measured_json(m: &Measurements, world: &World, args: &Args, secs: f64) -> serde_json::Value {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_default();
    serde_json::json!({
        "by": format!("braid calibrate {}", env!("CARGO_PKG_VERSION")),
        "host": host,
        "cpu": cpu,
        "ranks": world.size,
        "threads_per_rank": args.threads.max(1),
        "min_seconds": args.min_seconds,
        "rounds": args.rounds,
        "seconds": secs,
        "tiny_model_layers": calibrate::LAYERS,
        "tiny_model_widths": calibrate::HIDDENS,
        "timings": m,
    })
}
