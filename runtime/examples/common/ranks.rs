//! How the multi-process benchmarks start their ranks: the benchmark's binary again, once per
//! rank, told its rank through torchrun's variables (and `rank_var`, which marks a child),
//! talking over 127.0.0.1; every child is killed by pid when the parent returns or panics.

use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

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

/// In a child (`rank_var` set): runs `body` and reports its error. In the parent: starts
/// `ranks` children and waits at most `limit` for all of them.
pub fn run<E: std::fmt::Display>(
    name: &str,
    rank_var: &str,
    ranks: usize,
    limit: Duration,
    body: impl FnOnce() -> Result<(), E>,
) -> ExitCode {
    if std::env::var_os(rank_var).is_some() {
        return match body() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("{name}: {e}");
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
    for rank in 0..ranks {
        let child = Command::new(&exe)
            .env(rank_var, rank.to_string())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", ranks.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("GLOO_SOCKET_IFNAME", "lo")
            .stdin(Stdio::null())
            .spawn()
            .expect("start a rank");
        children.0.push(child);
    }
    let deadline = Instant::now() + limit;
    let mut ok = true;
    for (rank, child) in children.0.iter_mut().enumerate() {
        let status = loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                break status;
            }
            if Instant::now() > deadline {
                eprintln!("{name}: rank {rank} still running after {limit:?}");
                return ExitCode::FAILURE;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if !status.success() {
            eprintln!("{name}: rank {rank} failed ({status})");
            ok = false;
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
