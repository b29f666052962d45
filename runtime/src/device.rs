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

    #[test]
    fn default_device_is_usable() {
        let t = Tensor::ones([3], (Kind::Float, default_device()));
        assert_eq!(t.sum(Kind::Float).double_value(&[]), 3.0);
    }
}
