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

/// The size from which [`steady_host_allocator`] has glibc serve an allocation with a mapping
/// of its own: 32 MiB, the ceiling of glibc's own moving threshold.
pub const MMAP_THRESHOLD: usize = 32 << 20;

/// The free memory at the top of the heap that [`steady_host_allocator`] lets glibc keep rather
/// than give back to the system: 64 MiB, twice [`MMAP_THRESHOLD`], as glibc's own rule keeps it.
pub const TRIM_THRESHOLD: usize = 64 << 20;

/// glibc's variables for the two thresholds; where the user sets either (or sets one of them
/// through `GLIBC_TUNABLES`), [`steady_host_allocator`] leaves the allocator as configured.
const USER_SETTINGS: [(&str, &str); 2] = [
    ("MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold"),
    ("MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold"),
];

/// The variable that chooses between the fixed thresholds (`fixed`, the default) and glibc's
/// moving ones (`glibc`).
pub const THRESHOLDS_VAR: &str = "BRAID_MALLOC_THRESHOLDS";

/// What [`steady_host_allocator`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostAllocator {
    /// Both thresholds are fixed: [`MMAP_THRESHOLD`] and [`TRIM_THRESHOLD`].
    Fixed,
    /// `BRAID_MALLOC_THRESHOLDS=glibc`: glibc's moving thresholds are kept.
    Glibc,
    /// The user set this variable; the allocator is left as they configured it.
    UserSet(&'static str),
    /// glibc refused the setting named (`mallopt` returned 0); the allocator keeps its default.
    Refused(&'static str),
    /// Not glibc on Linux: nothing to set.
    NotGlibc,
}

/// Fixes glibc's two malloc thresholds for the rest of the process, unless the user set either
/// or chose glibc's own (`BRAID_MALLOC_THRESHOLDS=glibc`).
///
/// By default glibc serves an allocation of 128 KiB or more with a fresh mapping — zeroed pages,
/// faulted in on first touch, unmapped when freed — and raises that threshold to the size of
/// each mapped block freed (up to 32 MiB), the trim threshold with it. A tensor's allocation then
/// costs what the process happened to free before it: a step runs at a speed that depends on the
/// steps before it, and a calibration measures a speed the run it prices may not have. Fixing
/// the thresholds where glibc's rule ends (32 MiB, 64 MiB) serves every tensor under 32 MiB from
/// reused heap memory from the first step on. Measured in docs/benchmarks.md ("The host
/// allocator"). Call it first thing, before any thread starts.
///
/// # Errors
/// `BRAID_MALLOC_THRESHOLDS` set to anything but `fixed` or `glibc`.
pub fn steady_host_allocator() -> Result<HostAllocator, String> {
    let var = |name: &str| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
    match var(THRESHOLDS_VAR).as_deref() {
        None | Some("fixed") => {}
        Some("glibc") => return Ok(HostAllocator::Glibc),
        Some(other) => {
            return Err(format!(
                "{THRESHOLDS_VAR}={other:?} is not a choice: `fixed` (the default) or `glibc`"
            ));
        }
    }
    if let Some(var) = user_setting(var) {
        return Ok(HostAllocator::UserSet(var));
    }
    Ok(set_thresholds())
}

/// The variable through which the user set either threshold, if any; `var` reads the
/// environment.
fn user_setting(var: impl Fn(&str) -> Option<String>) -> Option<&'static str> {
    for (name, tunable) in USER_SETTINGS {
        if var(name).is_some() {
            return Some(name);
        }
        if var("GLIBC_TUNABLES")
            .is_some_and(|t| t.split(':').any(|kv| kv.split('=').next() == Some(tunable)))
        {
            return Some("GLIBC_TUNABLES");
        }
    }
    None
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn set_thresholds() -> HostAllocator {
    for (param, value, name) in [
        (libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD, "M_MMAP_THRESHOLD"),
        (libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD, "M_TRIM_THRESHOLD"),
    ] {
        let value = libc::c_int::try_from(value).unwrap_or(libc::c_int::MAX);
        // SAFETY: `mallopt` takes two integers and changes only the allocator's parameters,
        // under the allocator's own lock; it returns 0 where it refuses a value.
        if unsafe { libc::mallopt(param, value) } == 0 {
            return HostAllocator::Refused(name);
        }
    }
    HostAllocator::Fixed
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_thresholds() -> HostAllocator {
    HostAllocator::NotGlibc
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

    #[test]
    fn a_threshold_the_user_set_is_left_to_them() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(user_setting(env(&[])), None);
        assert_eq!(user_setting(env(&[("MALLOC_ARENA_MAX", "1")])), None);
        assert_eq!(
            user_setting(env(&[("MALLOC_TRIM_THRESHOLD_", "0")])),
            Some("MALLOC_TRIM_THRESHOLD_")
        );
        assert_eq!(
            user_setting(env(&[("MALLOC_MMAP_THRESHOLD_", "65536")])),
            Some("MALLOC_MMAP_THRESHOLD_")
        );
        assert_eq!(
            user_setting(env(&[(
                "GLIBC_TUNABLES",
                "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=4096"
            )])),
            Some("GLIBC_TUNABLES")
        );
        assert_eq!(
            user_setting(env(&[("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")])),
            None
        );
    }

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
