//! `braid launch --nproc-per-node N [--nnodes M --node-rank I --master-addr H --master-port P]
//! SUBCOMMAND …`: starts the ranks of one node the way `torchrun` does — one `braid SUBCOMMAND
//! …` process per rank with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `GROUP_RANK`, `MASTER_ADDR` and `MASTER_PORT` set — and watches them: when one fails, it
//! says which (its rank, pid, and exit code or signal), gives the others the grace period to
//! notice and exit on their own (their collectives time out naming the dead rank), then ends
//! any still running, by pid. The launcher's exit code is the first failure's.
//!
//! On Linux each rank is bound to a block of the node's cores of its own (`--cpu-bind`, through
//! `taskset`), so that ranks sharing a node's CPUs do not move across one another's cores: the
//! one core per rank that `braid calibrate` and the cost model assume there, held as the run
//! goes.

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
    /// Binding of each rank to cores of its own: `auto` binds when the node has at least one
    /// core per rank (and says why not otherwise), `cores` binds or fails, `none` leaves the
    /// ranks to the scheduler. A rank's cores are a block of those the launcher may use; the
    /// rank finds them in `BRAID_CPUS`.
    #[arg(long, value_enum, value_name = "MODE", default_value = "auto")]
    cpu_bind: CpuBind,
    /// The braid subcommand each rank runs, with its arguments (`run FILE`, `generate …`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CpuBind {
    Auto,
    Cores,
    None,
}

/// The CPUs this process may run on, from the kernel's `Cpus_allowed_list` (Linux only).
fn allowed_cpus() -> Result<Vec<usize>, String> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("cannot read /proc/self/status: {e}"))?;
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .ok_or("/proc/self/status has no Cpus_allowed_list")?;
    parse_cpu_list(list.trim())
}

/// `0-3,8,10-11` → `[0, 1, 2, 3, 8, 10, 11]`.
fn parse_cpu_list(list: &str) -> Result<Vec<usize>, String> {
    let bad = || format!("`{list}` is not a list of CPUs");
    let mut cpus = Vec::new();
    for part in list.split(',').filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a, b),
            None => (part, part),
        };
        let a: usize = a.trim().parse().map_err(|_| bad())?;
        let b: usize = b.trim().parse().map_err(|_| bad())?;
        if b < a {
            return Err(bad());
        }
        cpus.extend(a..=b);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// `cpus` split into `ranks` blocks of consecutive entries, as even as they go (the first
/// blocks take one more when they do not divide); `None` with fewer CPUs than ranks.
fn cpu_blocks(cpus: &[usize], ranks: usize) -> Option<Vec<Vec<usize>>> {
    if ranks == 0 || cpus.len() < ranks {
        return None;
    }
    let (each, extra) = (cpus.len() / ranks, cpus.len() % ranks);
    let mut at = 0;
    Some(
        (0..ranks)
            .map(|i| {
                let n = each + usize::from(i < extra);
                let block = cpus[at..at + n].to_vec();
                at += n;
                block
            })
            .collect(),
    )
}

/// `[0, 1, 2, 5]` → `0-2,5`: the kernel's own notation, which `taskset -c` takes.
fn cpu_list(cpus: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if j == i {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

/// Each local rank's cores under `mode`, or why the ranks are not bound (`Err` with `cores`).
fn binding(mode: CpuBind, ranks: usize) -> Result<Option<Vec<Vec<usize>>>, String> {
    if mode == CpuBind::None {
        return Ok(None);
    }
    let why_not = |why: String| {
        if mode == CpuBind::Cores {
            Err(format!("--cpu-bind cores: {why}"))
        } else {
            eprintln!("braid launch: ranks not bound to cores: {why}");
            Ok(None)
        }
    };
    if !cfg!(target_os = "linux") {
        return why_not("binding is done on Linux only".into());
    }
    let cpus = match allowed_cpus() {
        Ok(c) => c,
        Err(e) => return why_not(e),
    };
    let Some(blocks) = cpu_blocks(&cpus, ranks) else {
        return why_not(format!(
            "{ranks} ranks on {} core{} (`--cpu-bind none` silences this)",
            cpus.len(),
            if cpus.len() == 1 { "" } else { "s" }
        ));
    };
    match Command::new("taskset").arg("--version").output() {
        Ok(o) if o.status.success() => Ok(Some(blocks)),
        _ => why_not("`taskset` (util-linux) is not on PATH".into()),
    }
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
    let blocks = match binding(args.cpu_bind, args.nproc_per_node) {
        Ok(b) => b,
        Err(e) => return fail(e),
    };
    let mut children: Vec<(usize, Child)> = Vec::new();
    for local in 0..args.nproc_per_node {
        let rank = args.node_rank * args.nproc_per_node + local;
        let cores = blocks.as_ref().map(|b| cpu_list(&b[local]));
        // `taskset` sets the affinity and execs the rank in its place: the pid is the rank's,
        // and every thread the rank starts inherits the cores.
        let mut cmd = match &cores {
            Some(list) => {
                let mut c = Command::new("taskset");
                c.args(["-c", list]).arg(&exe).env("BRAID_CPUS", list);
                c
            }
            None => {
                let mut c = Command::new(&exe);
                c.env_remove("BRAID_CPUS");
                c
            }
        };
        let spawned = cmd
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
    if let Some(b) = &blocks {
        let bound: Vec<String> = children
            .iter()
            .zip(b)
            .map(|((r, _), cores)| format!("rank {r} on {}", cpu_list(cores)))
            .collect();
        eprintln!("braid launch: cores: {}", bound.join(", "));
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_are_parsed_with_ranges() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11").unwrap(),
            vec![0, 1, 2, 3, 8, 10, 11]
        );
        assert_eq!(parse_cpu_list("5").unwrap(), vec![5]);
        assert!(parse_cpu_list("3-1").is_err());
        assert!(parse_cpu_list("a").is_err());
    }

    #[test]
    fn cores_are_split_into_disjoint_blocks_covering_them() {
        let cpus: Vec<usize> = (0..7).collect();
        let b = cpu_blocks(&cpus, 3).unwrap();
        assert_eq!(b, vec![vec![0, 1, 2], vec![3, 4], vec![5, 6]]);
        assert_eq!(cpu_blocks(&[0, 1], 2).unwrap(), vec![vec![0], vec![1]]);
        assert!(cpu_blocks(&[0, 1], 3).is_none());
        assert_eq!(cpu_list(&b[0]), "0-2");
        assert_eq!(cpu_list(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
        assert_eq!(
            parse_cpu_list(&cpu_list(&[3, 4, 9])).unwrap(),
            vec![3, 4, 9]
        );
    }
}
