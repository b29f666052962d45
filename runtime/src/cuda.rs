//! CUDA streams and the caching allocator's statistics, which tch does not expose, through the
//! C++ shim `csrc/cuda_shim.cpp`. The shim uses c10's device-generic interfaces only, so this
//! module compiles and links on every machine; without a CUDA device (or without libtorch's
//! CUDA backend) every function returns an error that says so. The executor runs streamed
//! inference on a stream of its own with [`StreamGuard`] so that it overlaps generation on the
//! default stream; tests and benchmarks read peak device memory with [`memory`].
//!
//! Why the `unsafe` in this module is sound: every shim function catches every C++ exception
//! and returns it as a `malloc`ed string, freed exactly once by `take_error`; output parameters
//! are plain integers owned by the caller for the call's duration; streams cross the boundary
//! as integers (c10's stream id and device index), never as pointers.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void};

use crate::error::{Error, Result};

unsafe extern "C" {
    fn braid_cuda_free(ptr: *mut c_void);
    fn braid_cuda_backend_linked() -> c_int;
    fn braid_cuda_pool_stream(device: c_int, stream_id: *mut i64) -> *mut c_char;
    fn braid_cuda_exchange_stream(device: c_int, stream_id: i64, previous: *mut i64)
    -> *mut c_char;
    fn braid_cuda_synchronize_stream(device: c_int, stream_id: i64) -> *mut c_char;
    fn braid_cuda_memory(device: c_int, allocated: *mut i64, peak: *mut i64) -> *mut c_char;
    fn braid_cuda_reset_peak(device: c_int) -> *mut c_char;
}

fn take_error(err: *mut c_char) -> Result<()> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null return is a NUL-terminated string the shim allocated for us; it is
    // read once here and freed once below.
    let message = unsafe { std::ffi::CStr::from_ptr(err) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: `err` came from the shim's allocator and has not been freed.
    unsafe { braid_cuda_free(err.cast()) };
    Err(Error::invalid("cuda", message))
}

fn device_index(device: usize) -> Result<c_int> {
    c_int::try_from(device)
        .map_err(|_| Error::invalid("cuda", format!("device index {device} is out of range")))
}

/// Whether libtorch's CUDA backend is loaded in this process (whether or not a GPU is
/// present). False means that this binary can never see a GPU: a CPU-only libtorch, or a
/// binary linked without `libtorch_cuda.so` (see `build.rs`).
pub fn backend_linked() -> bool {
    // SAFETY: takes no arguments and catches every exception.
    unsafe { braid_cuda_backend_linked() != 0 }
}

/// A CUDA stream of c10's pool (not the default stream). Streams of the pool live as long as
/// the process, so this is a plain value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream {
    device: usize,
    id: i64,
}

impl Stream {
    /// A stream of the pool of CUDA device `device`.
    pub fn from_pool(device: usize) -> Result<Stream> {
        let d = device_index(device)?;
        let mut id = 0i64;
        // SAFETY: `id` is a live local for the call; the shim writes it only on success.
        take_error(unsafe { braid_cuda_pool_stream(d, &mut id) })?;
        Ok(Stream { device, id })
    }

    /// Waits until every kernel queued on this stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        let d = device_index(self.device)?;
        // SAFETY: integers only.
        take_error(unsafe { braid_cuda_synchronize_stream(d, self.id) })
    }

    /// Makes this stream current for this thread until the guard is dropped: libtorch queues
    /// every kernel the thread launches on that device there. c10's current stream is per
    /// thread, so other threads keep theirs.
    pub fn make_current(&self) -> Result<StreamGuard> {
        let d = device_index(self.device)?;
        let mut previous = 0i64;
        // SAFETY: `previous` is a live local for the call; the shim writes it only on success.
        take_error(unsafe { braid_cuda_exchange_stream(d, self.id, &mut previous) })?;
        Ok(StreamGuard {
            stream: *self,
            previous,
        })
    }
}

/// Restores the thread's previous current stream when dropped, after waiting for the work
/// queued on the guarded stream: results computed there are complete once the guard is gone.
#[derive(Debug)]
pub struct StreamGuard {
    stream: Stream,
    previous: i64,
}

impl StreamGuard {
    /// The stream this guard made current.
    pub fn stream(&self) -> Stream {
        self.stream
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        // Errors here mean the device itself failed; the next libtorch call on it reports that
        // with its own message, so the guard only restores what it can.
        let _ = self.stream.synchronize();
        if let Ok(d) = device_index(self.stream.device) {
            let mut ignored = 0i64;
            // SAFETY: integers and a live local only.
            let err = unsafe { braid_cuda_exchange_stream(d, self.previous, &mut ignored) };
            let _ = take_error(err);
        }
    }
}

/// Bytes the caching allocator holds for tensors on CUDA device `device`: now, and at the
/// peak since the last [`reset_peak`].
pub fn memory(device: usize) -> Result<(u64, u64)> {
    let d = device_index(device)?;
    let (mut now, mut peak) = (0i64, 0i64);
    // SAFETY: live locals for the call, written only on success.
    take_error(unsafe { braid_cuda_memory(d, &mut now, &mut peak) })?;
    Ok((now.max(0) as u64, peak.max(0) as u64))
}

/// Starts a new peak for [`memory`].
pub fn reset_peak(device: usize) -> Result<()> {
    let d = device_index(device)?;
    // SAFETY: an integer only.
    take_error(unsafe { braid_cuda_reset_peak(d) })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The binaries keep libtorch's CUDA backend linked (see `build.rs`), so a GPU machine's
    /// devices are seen; without a device, stream and memory calls are errors naming the
    /// device, not crashes.
    #[test]
    fn the_cuda_backend_is_linked_and_missing_devices_are_errors() {
        // build.rs says whether the libtorch it linked has a CUDA backend.
        if env!("BRAID_LIBTORCH_HAS_CUDA") == "1" {
            assert!(
                backend_linked(),
                "libtorch_cuda.so is not loaded in this process"
            );
        }
        if !tch::Cuda::is_available() {
            let err = Stream::from_pool(0).map(|_| ()).unwrap_err().to_string();
            assert!(err.starts_with("cuda: "), "{err}");
            assert!(memory(0).is_err());
        }
        assert!(Stream::from_pool(usize::MAX).is_err());
    }
}
