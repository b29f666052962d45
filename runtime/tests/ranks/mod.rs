//! The multi-process harness of this crate's tests: a test re-executes its own binary as N
//! child processes (`--exact <test> --nocapture`), each told its rank through
//! `BRAID_DIST_TEST_RANK` and torchrun's variables; they talk over 127.0.0.1 only, on a port
//! the parent found free by binding port 0. Every wait is bounded, and `Ranks`' `Drop` kills
//! every child by its pid, also when the test fails. One multi-process test of a binary runs
//! at a time (`serial`), so timing bounds do not depend on how many others share the cores.
#![allow(dead_code)] // Each test binary uses part of the harness.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use braid_runtime::dist::{GroupOptions, ProcessGroup, World};

pub const RANK_VAR: &str = "BRAID_DIST_TEST_RANK";
/// What a rank prints once it is inside the loop a test will disturb.
pub const READY: &str = "BRAID-DIST-READY";

static SERIAL: Mutex<()> = Mutex::new(());

pub fn serial() -> MutexGuard<'static, ()> {
    // A test that failed while holding the lock has already reported; the others can go on.
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The rank this process plays, when it is a child of a test.
pub fn child_rank() -> Option<usize> {
    let rank = std::env::var(RANK_VAR).ok()?;
    Some(rank.parse().expect("BRAID_DIST_TEST_RANK is a rank"))
}

pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind port 0");
    listener.local_addr().expect("local address").port()
}

/// The children of one test, killed by pid when dropped.
pub struct Ranks {
    children: Vec<Child>,
    /// Everything each child printed, stdout and stderr interleaved by line.
    output: Vec<Arc<Mutex<String>>>,
}

impl Ranks {
    /// Starts `n` ranks of `test`, each with torchrun's variables and `env`.
    pub fn spawn(test: &str, n: usize, env: &[(&str, String)]) -> Ranks {
        let exe = std::env::current_exe().expect("test binary path");
        let port = free_port().to_string();
        let mut ranks = Ranks {
            children: Vec::new(),
            output: Vec::new(),
        };
        for rank in 0..n {
            let mut child = Command::new(&exe)
                .args(["--exact", test, "--nocapture", "--test-threads=1"])
                .env(RANK_VAR, rank.to_string())
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                // Gloo's sockets on the loopback interface, like the store's.
                .env("GLOO_SOCKET_IFNAME", "lo")
                .envs(env.iter().map(|(k, v)| (k, v)))
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn a rank");
            let output = Arc::new(Mutex::new(String::new()));
            forward(child.stdout.take().expect("stdout"), output.clone());
            forward(child.stderr.take().expect("stderr"), output.clone());
            ranks.children.push(child);
            ranks.output.push(output);
        }
        ranks
    }

    pub fn output(&self, rank: usize) -> String {
        self.output[rank]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn all_output(&self) -> String {
        (0..self.children.len())
            .map(|rank| format!("--- rank {rank} ---\n{}", self.output(rank)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Waits until each of `ranks` has printed `READY`.
    pub fn wait_ready(&self, ranks: &[usize], within: Duration) {
        let deadline = Instant::now() + within;
        while !ranks.iter().all(|&r| self.output(r).contains(READY)) {
            assert!(
                Instant::now() < deadline,
                "ranks {ranks:?} not ready within {within:?}:\n{}",
                self.all_output()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until each of `ranks` has printed a line starting with its `prefixes` entry, and
    /// returns when each was first seen (in the order of `ranks`); a rank that exits first
    /// fails the test.
    pub fn wait_printed(
        &mut self,
        ranks: &[usize],
        prefixes: &[String],
        within: Duration,
    ) -> Vec<Instant> {
        let deadline = Instant::now() + within;
        let printed = |out: &str, prefix: &str| out.lines().any(|l| l.starts_with(prefix));
        let mut seen: Vec<Option<Instant>> = vec![None; ranks.len()];
        loop {
            let mut all = true;
            for (k, (&rank, prefix)) in ranks.iter().zip(prefixes).enumerate() {
                if seen[k].is_some() {
                    continue;
                }
                if printed(&self.output(rank), prefix) {
                    seen[k] = Some(Instant::now());
                    continue;
                }
                all = false;
                if let Some(status) = self.children[rank].try_wait().expect("try_wait") {
                    // Its last lines may still be in the pipe.
                    std::thread::sleep(Duration::from_millis(100));
                    assert!(
                        printed(&self.output(rank), prefix),
                        "rank {rank} exited ({status}) without printing `{prefix}`:\n{}",
                        self.all_output()
                    );
                }
            }
            if all {
                return seen.into_iter().flatten().collect();
            }
            assert!(
                Instant::now() < deadline,
                "ranks {ranks:?} did not all report within {within:?}:\n{}",
                self.all_output()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for `ranks` to exit and asserts they succeeded; returns when the last one did.
    pub fn expect_success(&mut self, ranks: &[usize], within: Duration) -> Instant {
        let deadline = Instant::now() + within;
        let mut last = Instant::now();
        for &rank in ranks {
            let status = loop {
                match self.children[rank].try_wait().expect("try_wait") {
                    Some(status) => break status,
                    None if Instant::now() > deadline => panic!(
                        "rank {rank} still running after {within:?}:\n{}",
                        self.all_output()
                    ),
                    None => std::thread::sleep(Duration::from_millis(10)),
                }
            };
            last = last.max(Instant::now());
            assert!(
                status.success(),
                "rank {rank} failed ({status}):\n{}",
                self.all_output()
            );
        }
        last
    }

    pub fn expect_all_success(&mut self, within: Duration) {
        let all: Vec<usize> = (0..self.children.len()).collect();
        self.expect_success(&all, within);
    }

    pub fn pid(&self, rank: usize) -> u32 {
        self.children[rank].id()
    }

    /// SIGKILL, by pid.
    pub fn kill(&mut self, rank: usize) {
        self.children[rank].kill().expect("kill a rank");
    }

    /// SIGSTOP, by pid: the process stays, with its sockets open, and stops answering.
    pub fn stop(&self, rank: usize) {
        // The shell's built-in `kill`: std has no SIGSTOP, and /bin/kill (procps) is not on
        // every fresh machine.
        let status = Command::new("sh")
            .args(["-c", &format!("kill -STOP {}", self.pid(rank))])
            .status()
            .expect("run kill -STOP");
        assert!(status.success(), "kill -STOP failed");
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for child in &mut self.children {
            // SIGKILL by pid (also ends a stopped process); an exited child is only reaped.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub fn forward(pipe: impl Read + Send + 'static, into: Arc<Mutex<String>>) {
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            let mut out = into.lock().unwrap_or_else(|p| p.into_inner());
            out.push_str(&line);
            out.push('\n');
        }
    });
}

/// The world group of a child, from torchrun's variables.
pub fn world_group(timeout: Duration, heartbeat: Duration) -> ProcessGroup {
    let world = World::from_env().expect("the parent sets torchrun's variables");
    let options = GroupOptions {
        heartbeat,
        ..GroupOptions::gloo(timeout)
    };
    ProcessGroup::init(&world, options).expect("world group")
}
