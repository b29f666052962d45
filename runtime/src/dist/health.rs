//! Naming the rank that broke a collective. Gloo reports a dead peer by its socket address
//! ("Connection reset by peer [10.0.0.3]:40123") when the peer's process is gone, and only
//! "timed out" when the peer is alive but stopped (hung, paused, swapped out); NCCL says less.
//! So every process keeps a heartbeat in the store, a counter under `braid/alive/<rank>` that
//! a thread increments every `interval`, and marks `braid/exited/<rank>` when it shuts down in
//! order. After a failed operation the group reads its peers' counters twice, `GRACE`
//! intervals apart: a counter that did not move belongs to a dead or stopped process. The store
//! itself lives in rank 0's process, so a store that cannot be reached names rank 0.
//!
//! This module only observes; it must not decide whether an operation failed.

use std::sync::Mutex;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

use super::Store;

/// How many heartbeat intervals a live process is given to advance its counter. More than
/// one, so that a process descheduled for an interval on a loaded machine is not named.
const GRACE: u32 = 3;

/// The rank whose process hosts the TCP store.
const STORE_HOST: usize = 0;

/// What the heartbeats say about a group's peers after a failure.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Diagnosis {
    /// Global ranks that stopped heart-beating without shutting down (killed, crashed, hung),
    /// or rank 0 when its store cannot be reached.
    pub dead: Vec<usize>,
    /// Global ranks that shut their process group down in order before the failure.
    pub exited: Vec<usize>,
    /// One sentence for the error message.
    pub summary: String,
}

/// This process's heartbeat, shared by the world group and its sub-groups.
#[derive(Debug)]
pub(crate) struct Heartbeat {
    rank: usize,
    interval: Duration,
    /// A connection of its own, so that diagnosing never waits behind another request.
    probe: Store,
    /// The beating thread and the channel whose closing stops it; `None` once stopped.
    running: Mutex<Option<(Sender<()>, JoinHandle<()>)>>,
}

fn alive_key(rank: usize) -> String {
    format!("braid/alive/{rank}")
}

fn exited_key(rank: usize) -> String {
    format!("braid/exited/{rank}")
}

impl Heartbeat {
    /// Starts beating for global rank `rank` on two new connections to `store`.
    pub(crate) fn start(store: &Store, rank: usize, interval: Duration) -> super::Result<Self> {
        let beat = store.reconnect()?;
        let probe = store.reconnect()?;
        // The first beat before returning: a peer that fails later has a counter to compare.
        beat.add(&alive_key(rank), 1)?;
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("braid-heartbeat-{rank}"))
            .spawn(move || {
                let key = alive_key(rank);
                // Nothing is ever sent: the channel closing is the signal to stop.
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(interval) {
                    // A failed beat (the store host is gone) is not this thread's to report:
                    // the next collective fails and its diagnosis finds the store unreachable.
                    let _ = beat.add(&key, 1);
                }
                let _ = beat.add(&exited_key(rank), 1);
            })
            .map_err(|e| super::DistError::invalid(format!("cannot start a heartbeat: {e}")))?;
        Ok(Heartbeat {
            rank,
            interval,
            probe,
            running: Mutex::new(Some((stop, thread))),
        })
    }

    /// Stops beating and marks this rank as exited (at once: closing the channel wakes the
    /// thread). Later calls do nothing.
    pub(crate) fn stop(&self) {
        let running = self
            .running
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if let Some((stop, thread)) = running {
            drop(stop);
            // The thread only beats and sleeps; it cannot panic short of a broken allocator.
            let _ = thread.join();
        }
    }

    /// Waits up to `timeout` until each of `ranks` has marked itself exited.
    pub(crate) fn wait_exited(&self, ranks: &[usize], timeout: Duration) -> super::Result<()> {
        let keys: Vec<String> = ranks.iter().map(|&r| exited_key(r)).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        self.probe.wait(&keys, timeout)
    }

    /// How long [`Heartbeat::diagnose`] takes.
    pub(crate) fn diagnosis_time(&self) -> Duration {
        self.interval * GRACE
    }

    /// Which of `peers` (global ranks) are dead, watching their counters for
    /// [`Heartbeat::diagnosis_time`].
    pub(crate) fn diagnose(&self, peers: &[usize]) -> Diagnosis {
        let peers: Vec<usize> = peers.iter().copied().filter(|&r| r != self.rank).collect();
        let before = match self.read(&peers) {
            Ok(counts) => counts,
            Err(e) => return self.store_unreachable(&e),
        };
        std::thread::sleep(self.diagnosis_time());
        let after = match self.read(&peers) {
            Ok(counts) => counts,
            Err(e) => return self.store_unreachable(&e),
        };
        let mut diagnosis = Diagnosis::default();
        for ((&rank, (beats_before, _)), (beats_after, exited)) in
            peers.iter().zip(&before).zip(&after)
        {
            if *exited {
                diagnosis.exited.push(rank);
            } else if beats_after == beats_before {
                diagnosis.dead.push(rank);
            }
        }
        let ms = self.diagnosis_time().as_millis();
        diagnosis.summary = match (&diagnosis.dead[..], &diagnosis.exited[..]) {
            ([], []) => format!(
                "every peer is alive (each heartbeat advanced within {ms} ms): a peer is slow \
                 or did not make the same call"
            ),
            ([], exited) => format!("{} shut down before this call", ranks(exited)),
            (dead, []) => format!(
                "{} stopped heart-beating (no beat for {ms} ms): dead or hung",
                ranks(dead)
            ),
            (dead, exited) => format!(
                "{} stopped heart-beating (no beat for {ms} ms): dead or hung; {} shut down \
                 before this call",
                ranks(dead),
                ranks(exited)
            ),
        };
        diagnosis
    }

    fn read(&self, peers: &[usize]) -> super::Result<Vec<(i64, bool)>> {
        peers
            .iter()
            .map(|&rank| {
                let beats = self.probe.add(&alive_key(rank), 0)?;
                let exited = self.probe.add(&exited_key(rank), 0)? > 0;
                Ok((beats, exited))
            })
            .collect()
    }

    fn store_unreachable(&self, error: &super::DistError) -> Diagnosis {
        if self.rank == STORE_HOST {
            // The store runs in this process: it cannot be gone while we run.
            return Diagnosis {
                summary: format!("the heartbeats could not be read: {error}"),
                ..Diagnosis::default()
            };
        }
        Diagnosis {
            dead: vec![STORE_HOST],
            exited: Vec::new(),
            summary: format!(
                "rank {STORE_HOST}, which hosts the store, is unreachable (dead?): {error}"
            ),
        }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.stop();
    }
}

/// "rank 2" or "ranks 1, 3".
pub(crate) fn ranks(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match ranks.len() {
        1 => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    }
}
