//! All-reduce and broadcast times and bandwidth of `braid_runtime::dist` on Gloo, 2 ranks on
//! this machine over 127.0.0.1, from one f32 to 64 MiB (Gloo's small all-reduces cost far
//! more than one element's: `DeviceSpec::allreduce`). It starts its own ranks (this binary
//! again, told its rank through torchrun's variables) and rank 0 prints a table: seconds per
//! operation (the slower rank's mean) and algorithmic bandwidth, bytes / seconds.
//!
//!     cargo run -p braid-runtime --example bench_collectives

#[path = "common/ranks.rs"]
mod ranks;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use braid_cost::cost::CollectiveTime;
use braid_runtime::dist::{GroupOptions, ProcessGroup, ReduceOp, World};
use tch::{Kind, Tensor};

const RANK_VAR: &str = "BRAID_BENCH_RANK";
const RANKS: usize = 2;
/// (bytes, timed iterations)
const SIZES: [(usize, usize); 5] = [
    (4, 200),
    (1 << 10, 200),
    (64 << 10, 100),
    (1 << 20, 50),
    (64 << 20, 5),
];

fn main() -> ExitCode {
    ranks::run(
        "bench_collectives",
        RANK_VAR,
        RANKS,
        Duration::from_secs(300),
        bench_rank,
    )
}

fn bench_rank() -> braid_runtime::dist::Result<()> {
    let world = World::from_env()?;
    let group = ProcessGroup::init(&world, GroupOptions::gloo(Duration::from_secs(120)))?;
    if group.rank() == 0 {
        println!(
            "Gloo, {} ranks on 127.0.0.1, f32, {} threads per rank",
            group.size(),
            tch::get_num_threads()
        );
        println!(
            "{:<12} {:>8} {:>6} {:>12} {:>10}",
            "operation", "size", "iters", "s/op", "GB/s"
        );
    }
    for (bytes, iters) in SIZES {
        for op in ["all_reduce", "broadcast"] {
            let mut t = Tensor::ones([(bytes / 4) as i64], (Kind::Float, tch::Device::Cpu));
            let run = |t: &mut Tensor| match op {
                "all_reduce" => group.all_reduce(t, ReduceOp::Sum),
                _ => group.broadcast(t, 0),
            };
            // Two untimed rounds: connections warm, pages of the buffer touched.
            for _ in 0..2 {
                run(&mut t)?;
            }
            group.barrier()?;
            let start = Instant::now();
            for _ in 0..iters {
                run(&mut t)?;
            }
            let mine = start.elapsed().as_secs_f64() / iters as f64;
            let mut slowest = Tensor::from_slice(&[mine]);
            group.all_reduce(&mut slowest, ReduceOp::Max)?;
            let seconds = slowest.double_value(&[0]);
            if group.rank() == 0 {
                println!(
                    "{:<12} {:>8} {:>6} {:>12.6} {:>10.3}",
                    op,
                    CollectiveTime::size_label(bytes as u64),
                    iters,
                    seconds,
                    bytes as f64 / seconds / 1e9
                );
            }
        }
    }
    group.shutdown()
}
