//! Device selection and the facts about libtorch that the CLI reports.

use tch::Device;

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
