//! A small team of persistent threads for Braid's own CPU kernels (`gemm.rs`,
//! `attention.rs`): a call splits its work into chunks, and the calling thread and the team's
//! workers take chunks from a shared counter until none are left.
//!
//! The calling thread always works too and never waits for a chunk nobody has started: a
//! worker that is slow to wake (or, on a busy machine, waiting for a core) simply takes no
//! chunks, and the caller does them. Starting threads per call instead costs tens of
//! microseconds each, longer than a decode step's products take, and waits for every thread
//! it started. The team has `tch::get_num_threads() - 1` workers (libtorch's setting is the
//! one users already make); with one thread, calls run inline.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Runs `f(0)`, ..., `f(chunks - 1)`, each exactly once, on the calling thread and up to
/// `threads - 1` workers (fewer if the team has fewer), and returns when all have run.
pub(crate) fn for_each_chunk(threads: usize, chunks: usize, f: &(dyn Fn(usize) + Sync)) {
    if threads <= 1 || chunks <= 1 {
        (0..chunks).for_each(f);
        return;
    }
    let team = team();
    team.grow(threads - 1);
    // The closure's lifetime is erased so that workers can hold the job: they call it only for
    // a chunk index they took below `chunks`, and this function returns (or unwinds) only
    // after every such call has finished (`done == chunks`), so no call outlives the borrow.
    #[allow(unsafe_code)]
    // SAFETY: only the trait object's lifetime bound changes; see above for why no call
    // outlives it.
    let f: *const (dyn Fn(usize) + Sync + 'static) = unsafe {
        std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const (dyn Fn(usize) + Sync)>(f)
    };
    let job = Arc::new(Job {
        f,
        chunks,
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
    });
    team.post(&job);
    job.work();
    let mut spins = 0u32;
    while job.done.load(Ordering::Acquire) < chunks {
        spins += 1;
        if spins < 1 << 12 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    // A chunk that panicked (on any thread) is reported here, after all chunks have ended.
    assert!(
        !job.panicked.load(Ordering::Acquire),
        "a chunk of a Braid CPU kernel panicked"
    );
}

struct Job {
    /// The caller's closure, valid until `done == chunks` (see `for_each_chunk`).
    f: *const (dyn Fn(usize) + Sync),
    chunks: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    panicked: AtomicBool,
}

// SAFETY: `f` points to a `Sync` closure that outlives every call made through it (see
// `for_each_chunk`); the other fields are atomics.
#[allow(unsafe_code)]
unsafe impl Send for Job {}
#[allow(unsafe_code)]
unsafe impl Sync for Job {}

impl Job {
    /// Takes and runs chunks until none are left. A panicking chunk is caught and counted as
    /// done, so the caller never waits forever and never returns while a chunk runs.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.chunks {
                return;
            }
            // SAFETY: `i < chunks` was taken before `done` reached `chunks`, so the caller of
            // `for_each_chunk` is still waiting and the closure is alive.
            #[allow(unsafe_code)]
            let f = unsafe { &*self.f };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(i))).is_err() {
                self.panicked.store(true, Ordering::Release);
            }
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

struct Team {
    /// The latest job and a counter of posted jobs.
    slot: Mutex<(u64, Option<Arc<Job>>)>,
    wake: Condvar,
    posted: AtomicUsize,
    workers: Mutex<usize>,
}

fn team() -> &'static Team {
    static TEAM: OnceLock<Team> = OnceLock::new();
    TEAM.get_or_init(|| Team {
        slot: Mutex::new((0, None)),
        wake: Condvar::new(),
        posted: AtomicUsize::new(0),
        workers: Mutex::new(0),
    })
}

/// How long an idle worker keeps checking for the next job before it sleeps: a decode step
/// posts its products a few tens of microseconds apart.
const IDLE_SPIN: Duration = Duration::from_micros(50);

impl Team {
    /// Starts workers until there are `n` (the team never shrinks; idle workers sleep).
    fn grow(&'static self, n: usize) {
        let mut workers = self.workers.lock().unwrap_or_else(|e| e.into_inner());
        while *workers < n {
            let spawned = std::thread::Builder::new()
                .name(format!("braid-kernel-{}", *workers + 1))
                .spawn(move || self.serve());
            if spawned.is_err() {
                // No thread: the callers do the chunks themselves.
                return;
            }
            *workers += 1;
        }
    }

    fn post(&self, job: &Arc<Job>) {
        let mut slot = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        slot.0 += 1;
        slot.1 = Some(Arc::clone(job));
        self.posted.fetch_add(1, Ordering::Release);
        drop(slot);
        self.wake.notify_all();
    }

    /// A worker's loop: wait for a job newer than the last one seen, help with it, repeat.
    fn serve(&self) {
        let mut seen = 0u64;
        loop {
            let since = Instant::now();
            let before = self.posted.load(Ordering::Acquire);
            while self.posted.load(Ordering::Acquire) == before && since.elapsed() < IDLE_SPIN {
                std::hint::spin_loop();
            }
            let job = {
                let mut slot = self.slot.lock().unwrap_or_else(|e| e.into_inner());
                while slot.0 == seen {
                    slot = self.wake.wait(slot).unwrap_or_else(|e| e.into_inner());
                }
                seen = slot.0;
                slot.1.clone()
            };
            if let Some(job) = job {
                job.work();
            }
        }
    }
}

/// A shared output buffer that chunks write disjoint elements of.
#[derive(Clone, Copy)]
pub(crate) struct Out {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: `Out` is only a pointer and a length; the chunks that share it write disjoint
// elements (each kernel documents its split), and `for_each_chunk` returns only after all of
// them are done, while the buffer is still borrowed by the caller.
#[allow(unsafe_code)]
unsafe impl Send for Out {}
#[allow(unsafe_code)]
unsafe impl Sync for Out {}

impl Out {
    pub(crate) fn new(out: &mut [f32]) -> Self {
        Out {
            ptr: out.as_mut_ptr(),
            len: out.len(),
        }
    }

    /// Writes element `i`.
    #[inline(always)]
    pub(crate) fn set(&self, i: usize, v: f32) {
        assert!(i < self.len);
        // SAFETY: in bounds (asserted); no other chunk writes element `i` (see the type's docs).
        #[allow(unsafe_code)]
        unsafe {
            self.ptr.add(i).write(v)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_runs_once() {
        for threads in [1, 2, 4] {
            for chunks in [0, 1, 2, 7, 100] {
                let hits: Vec<AtomicUsize> = (0..chunks).map(|_| AtomicUsize::new(0)).collect();
                for_each_chunk(threads, chunks, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn a_panicking_chunk_is_reported_after_all_chunks_end() {
        let ran = AtomicUsize::new(0);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for_each_chunk(2, 8, &|i| {
                ran.fetch_add(1, Ordering::Relaxed);
                assert!(i != 3, "chunk 3 fails");
            })
        }));
        assert!(result.is_err());
        assert_eq!(ran.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn outputs_written_by_chunks_are_all_there() {
        let mut out = vec![0f32; 1000];
        let o = Out::new(&mut out);
        for_each_chunk(2, 10, &|c| {
            for i in c * 100..(c + 1) * 100 {
                o.set(i, i as f32);
            }
        });
        assert!(out.iter().enumerate().all(|(i, &v)| v == i as f32));
    }
}
