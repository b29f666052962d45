//! `braid launch --nproc-per-node N [--nnodes M --node-rank I --master-addr H --master-port P]
//! SUBCOMMAND …`: starts the ranks of one node the way `torchrun` does — one `braid SUBCOMMAND
//! …` process per rank with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `GROUP_RANK`, `MASTER_ADDR` and `MASTER_PORT` set — and watches them: when one fails, it
//! says which (its rank, pid, and exit code or signal), gives the others the grace period to
//! notice and exit on their own (their collectives time out naming the dead rank), then ends
//! any still running, by pid. The launcher's exit code is the first failure's.

use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, ExitStatus};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    /// Processes (ranks) to start on this node.
    #[arg(long, value_name = "N")]
    nproc_per_node: usize,
    /// Nodes in the job (each runs its own `braid launch`).
    #[arg(long, value_name = "M", default_value_t = 1)]
    nnodes: usize,
    /// This node's index, 0..M.
    #[arg(long, value_name = "I", default_value_t = 0)]
    node_rank: usize,
    /// Host of rank 0, which hosts the rendezvous store (default 127.0.0.1 on one node).
    #[arg(long, value_name = "HOST")]
    master_addr: Option<String>,
    /// Port of the rendezvous store (default on one node: a free port; required on several).
    #[arg(long, value_name = "PORT")]
    master_port: Option<u16>,
    /// How long the other ranks may take to exit after one failed, before they are ended.
    #[arg(long, value_name = "SECONDS", default_value_t = 90)]
    grace: u64,
    /// The braid subcommand each rank runs, with its arguments (`run FILE`, `generate …`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<String>,
}

fn describe(status: ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            let name = match sig {
                9 => " (SIGKILL)",
                15 => " (SIGTERM)",
                11 => " (SIGSEGV)",
                6 => " (SIGABRT)",
                2 => " (SIGINT)",
                _ => "",
            };
            return format!("was killed by signal {sig}{name}");
        }
    }
    match status.code() {
        Some(c) => format!("exited with code {c}"),
        None => "ended".to_string(),
    }
}

/// A port nothing listens on now (the store binds it right after).
fn free_port() -> std::io::Result<u16> {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    Ok(l.local_addr()?.port())
}

/// Asks a child to stop (SIGTERM by pid, through `kill`), then kills it.
fn end(child: &mut Child, wait: Duration) {
    let pid = child.id().to_string();
    let _ = Command::new("kill").args(["-TERM", &pid]).status();
    let until = Instant::now() + wait;
    while Instant::now() < until {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

pub fn run(args: Args) -> ExitCode {
    let fail = |msg: String| {
        eprintln!("error: braid launch: {msg}");
        ExitCode::from(2)
    };
    if args.nproc_per_node == 0 || args.nnodes == 0 {
        return fail("--nproc-per-node and --nnodes must be at least 1".into());
    }
    if args.node_rank >= args.nnodes {
        return fail(format!(
            "--node-rank {} is not a node of --nnodes {}",
            args.node_rank, args.nnodes
        ));
    }
    if args.command.first().is_some_and(|c| c == "launch") {
        return fail("the ranks run a braid subcommand, not another launch".into());
    }
    let (addr, port) = match (args.nnodes, &args.master_addr, args.master_port) {
        (1, addr, port) => {
            let port = match port {
                Some(p) => p,
                None => match free_port() {
                    Ok(p) => p,
                    Err(e) => return fail(format!("no free port on 127.0.0.1: {e}")),
                },
            };
            (addr.clone().unwrap_or_else(|| "127.0.0.1".into()), port)
        }
        (_, Some(addr), Some(port)) => (addr.clone(), port),
        _ => {
            return fail(
                "a job of several nodes needs --master-addr and --master-port (rank 0's host and a port all nodes use)".into(),
            );
        }
    };
    let exe: PathBuf = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => return fail(format!("cannot find the braid binary: {e}")),
    };
    let world = args.nproc_per_node * args.nnodes;
    let mut children: Vec<(usize, Child)> = Vec::new();
    for local in 0..args.nproc_per_node {
        let rank = args.node_rank * args.nproc_per_node + local;
        let spawned = Command::new(&exe)
            .args(&args.command)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc_per_node.to_string())
            .env("GROUP_RANK", args.node_rank.to_string())
            .env("MASTER_ADDR", &addr)
            .env("MASTER_PORT", port.to_string())
            .spawn();
        match spawned {
            Ok(c) => children.push((rank, c)),
            Err(e) => {
                for (_, c) in &mut children {
                    end(c, Duration::from_secs(5));
                }
                return fail(format!("cannot start rank {rank}: {e}"));
            }
        }
    }
    let pids: Vec<String> = children
        .iter()
        .map(|(r, c)| format!("rank {r} pid {}", c.id()))
        .collect();
    eprintln!(
        "braid launch: {} rank{} of {world} on this node ({}); store at {addr}:{port}",
        children.len(),
        if children.len() == 1 { "" } else { "s" },
        pids.join(", ")
    );
    // Watch: the first failure is reported; the rest get the grace period.
    let mut first_failure: Option<(usize, ExitStatus)> = None;
    let mut deadline: Option<Instant> = None;
    let mut running: Vec<(usize, Child)> = children;
    while !running.is_empty() {
        let mut still = Vec::new();
        for (rank, mut child) in running {
            match child.try_wait() {
                Ok(Some(status)) => {
                    if !status.success() && first_failure.is_none() {
                        eprintln!(
                            "braid launch: rank {rank} (pid {}) {}; waiting up to {} s for the other ranks to stop",
                            child.id(),
                            describe(status),
                            args.grace
                        );
                        first_failure = Some((rank, status));
                        deadline = Some(Instant::now() + Duration::from_secs(args.grace));
                    }
                }
                Ok(None) => still.push((rank, child)),
                Err(e) => {
                    eprintln!("braid launch: cannot wait for rank {rank}: {e}");
                    end(&mut child, Duration::from_secs(5));
                }
            }
        }
        running = still;
        if let Some(d) = deadline
            && Instant::now() >= d
        {
            for (rank, child) in &mut running {
                eprintln!(
                    "braid launch: rank {rank} (pid {}) did not stop after rank {} failed; ending it",
                    child.id(),
                    first_failure.map_or(0, |f| f.0)
                );
                end(child, Duration::from_secs(10));
            }
            running.clear();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    match first_failure {
        None => ExitCode::SUCCESS,
        Some((_, status)) => ExitCode::from(status.code().map_or(1, |c| c.clamp(1, 255) as u8)),
    }
}
