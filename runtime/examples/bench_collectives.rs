//! All-reduce and broadcast bandwidth of `braid_runtime::dist` on Gloo, 2 ranks on this
//! machine over 127.0.0.1, at 1 MiB and 64 MiB of f32. It starts its own ranks (this binary
//! again, told its rank through torchrun's variables) and rank 0 prints a table: seconds per
//! operation (the slower rank's mean) and algorithmic bandwidth, bytes / seconds.
//!
//!     cargo run -p braid-runtime --example bench_collectives

use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use braid_runtime::dist::{GroupOptions, ProcessGroup, ReduceOp, World};
use tch::{Kind, Tensor};

const RANK_VAR: &str = "BRAID_BENCH_RANK";
const RANKS: usize = 2;
/// (bytes, timed iterations)
const SIZES: [(usize, usize); 2] = [(1 << 20, 50), (64 << 20, 5)];

/// The ranks this process started, killed by pid when dropped (also on a panic).
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn main() -> ExitCode {
    if std::env::var_os(RANK_VAR).is_some() {
        return match bench_rank() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("bench_collectives: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let exe = std::env::current_exe().expect("this binary's path");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let mut children = Children(Vec::new());
    for rank in 0..RANKS {
        let child = Command::new(&exe)
            .env(RANK_VAR, rank.to_string())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", RANKS.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("GLOO_SOCKET_IFNAME", "lo")
            .stdin(Stdio::null())
            .spawn()
            .expect("start a rank");
        children.0.push(child);
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut ok = true;
    for (rank, child) in children.0.iter_mut().enumerate() {
        let status = loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                break status;
            }
            if Instant::now() > deadline {
                eprintln!("bench_collectives: rank {rank} still running after 300 s");
                return ExitCode::FAILURE;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if !status.success() {
            eprintln!("bench_collectives: rank {rank} failed ({status})");
            ok = false;
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
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
                    "{:<12} {:>5} MiB {:>6} {:>12.6} {:>10.3}",
                    op,
                    bytes >> 20,
                    iters,
                    seconds,
                    bytes as f64 / seconds / 1e9
                );
            }
        }
    }
    group.shutdown()
}
