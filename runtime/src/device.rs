//! Device selection, the facts about libtorch that the CLI reports, and copies between a GPU
//! and host memory.

use tch::{Device, Tensor};

/// The device a run uses when the user names none: the first CUDA device if libtorch sees one,
/// else the CPU.
pub fn default_device() -> Device {
    if tch::Cuda::is_available() {
        Device::Cuda(0)
    } else {
        Device::Cpu
    }
}

/// Gives the calling thread the least scheduling priority (nice 19), for a thread that keeps
/// the run's books — its files, its metrics — while the rank computes: on a rank bound to one
/// core (`braid launch`'s binding), it would otherwise take that core from the generation that
/// follows each step. Read with temporary timing on `ppo_tiny` on 2 ranks (docs/benchmarks.md,
/// stop 40): the file thread spent 0.5–1.3 ms of CPU a step, and rank 0's generation thread
/// waited 1.3–2.3 ms a step for its core where rank 1's waited 0.1–0.3. It still runs whenever the rank waits (every exchange),
/// and at 1/70 of the core when the rank never does, so its writes are late, never lost. Does
/// nothing off Linux or where the kernel refuses.
pub fn yield_to_compute() {
    #[cfg(target_os = "linux")]
    #[allow(unsafe_code)]
    // SAFETY: `gettid` takes no arguments and cannot fail; `setpriority` only reads its three
    // integer arguments, and on Linux `PRIO_PROCESS` with a thread id sets that thread's nice
    // value alone. A refusal returns -1, which changes nothing here.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 19);
    }
}

/// Sets the number of CPU threads libtorch uses for intra-op parallelism.
pub fn set_cpu_threads(threads: usize) {
    let threads = i32::try_from(threads.max(1)).unwrap_or(i32::MAX);
    tch::set_num_threads(threads);
}

/// Host copies of `tensors`, for writing them out (checkpoints): CPU tensors as they are; CUDA
/// tensors copied into pinned (page-locked) host memory, all copies queued without waiting and
/// then one synchronisation. A copy from device memory into pageable memory goes through a
/// staging buffer one chunk at a time and blocks per tensor; into pinned memory it is one
/// DMA transfer, and libtorch's caching host allocator keeps the pinned blocks for the next
/// checkpoint.
pub fn host_copies(tensors: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    let mut on_gpu: Vec<i64> = Vec::new();
    let out = tensors
        .iter()
        .map(|(name, t)| {
            let t = t.detach();
            let host = match t.device() {
                Device::Cuda(i) => {
                    if !on_gpu.contains(&(i as i64)) {
                        on_gpu.push(i as i64);
                    }
                    // non_blocking from CUDA to the CPU allocates the destination pinned.
                    t.to_device_(Device::Cpu, t.kind(), true, false)
                }
                _ => t,
            };
            (name.clone(), host)
        })
        .collect();
    for i in on_gpu {
        tch::Cuda::synchronize(i);
    }
    out
}

/// Moves `t` to host memory for a while (an offloaded model's weights): pinned on a GPU, so
/// that [`from_host`] is one asynchronous DMA transfer back; a CPU tensor stays where it is.
pub fn to_host_pinned(t: &Tensor) -> Tensor {
    match t.device() {
        Device::Cuda(_) => t.to_device_(Device::Cpu, t.kind(), true, false),
        _ => t.shallow_clone(),
    }
}

/// Copies a host tensor (pinned by [`to_host_pinned`]) to `device`; asynchronous from pinned
/// memory, ordered on the current stream before any kernel that reads it.
pub fn from_host(t: &Tensor, device: Device) -> Tensor {
    if t.device() == device {
        return t.shallow_clone();
    }
    t.to_device_(device, t.kind(), true, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    /// Proves that libtorch is installed and linked: a matmul and autograd on the CPU.
    #[test]
    fn libtorch_matmul_and_autograd_on_cpu() {
        let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).reshape([2, 2]);
        let b = Tensor::from_slice(&[5.0f32, 6.0, 7.0, 8.0]).reshape([2, 2]);
        let c = a.matmul(&b);
        let got: Vec<f32> = Vec::try_from(c.reshape([-1])).unwrap();
        assert_eq!(got, vec![19.0, 22.0, 43.0, 50.0]);

        let x = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
        let y = (&x * &x).sum(Kind::Float);
        y.backward();
        let g: Vec<f32> = Vec::try_from(x.grad()).unwrap();
        assert_eq!(g, vec![6.0]);
    }

    /// The nice value of the calling thread (field 19 of `/proc/thread-self/stat`, counted
    /// after the parenthesised command name, which may hold spaces).
    #[cfg(target_os = "linux")]
    fn own_nice() -> i64 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        let after = stat.rsplit(')').next().unwrap();
        // Fields from the third (state); nice is the nineteenth.
        after.split_whitespace().nth(16).unwrap().parse().unwrap()
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_bookkeeping_thread_yields_to_compute_and_only_it() {
        let (before, after) = std::thread::spawn(|| {
            let before = own_nice();
            yield_to_compute();
            (before, own_nice())
        })
        .join()
        .unwrap();
        assert_eq!(after, 19, "was {before}");
        // The thread that called it alone: this one keeps its priority.
        assert_eq!(own_nice(), before);
    }

    #[test]
    fn default_device_is_usable() {
        let t = Tensor::ones([3], (Kind::Float, default_device()));
        assert_eq!(t.sum(Kind::Float).double_value(&[]), 3.0);
    }
}
