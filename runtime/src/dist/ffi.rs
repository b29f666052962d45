//! The one FFI boundary of `dist`: the C functions of `runtime/csrc/c10d_shim.h`, declared by
//! hand, and two owning handles (`RawStore`, `RawGroup`) whose methods are the only callers.
//! Everything above this module is safe Rust; nothing here decides policy (timeouts, naming
//! dead ranks, poisoning a group): it converts arguments, calls, and turns the shim's error
//! strings into `Err(String)`.
//!
//! Why the `unsafe` in this module is sound, once for all calls:
//! - Every shim function catches every C++ exception and returns it as a `malloc`ed string
//!   (`c10d_shim.cpp`'s `guarded`), so no unwinding crosses the boundary, and `take_error` frees
//!   each string exactly once.
//! - Handles are created only by the shim's constructors, owned by exactly one `RawStore` /
//!   `RawGroup`, and freed once in `Drop`; no method is reachable after `Drop`.
//! - Byte and key arguments are Rust slices passed as (pointer, length) and only read during
//!   the call; the shim copies what it keeps.
//! - Tensor arguments are tch's `C_tensor` pointers, which point to a live `torch::Tensor`
//!   (torch-sys's `libtch/torch_api.h`) for as long as the borrowed `tch::Tensor` lives, that
//!   is, for the whole call. The shim copies the `at::Tensor` handle (a reference count), never
//!   the pointer, and writes only into the storage of tensors passed as `&mut`.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void};
use std::time::Duration;

#[repr(C)]
struct BraidStore {
    _opaque: [u8; 0],
}

#[repr(C)]
struct BraidGroup {
    _opaque: [u8; 0],
}

#[repr(C)]
struct BraidTp {
    _opaque: [u8; 0],
}

unsafe extern "C" {
    fn braid_c10d_free(ptr: *mut c_void);
    fn braid_tp_new(
        group: *const BraidGroup,
        timeout_ms: i64,
        out: *mut *mut BraidTp,
    ) -> *mut c_char;
    fn braid_tp_free(tp: *mut BraidTp);
    fn braid_tp_copy(tp: *const BraidTp, input: *mut c_void, out: *mut *mut c_void) -> *mut c_char;
    fn braid_tp_reduce(
        tp: *const BraidTp,
        input: *mut c_void,
        op: c_int,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    fn braid_tp_all_gather(
        tp: *const BraidTp,
        input: *mut c_void,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    fn braid_store_tcp(
        host: *const c_char,
        host_len: usize,
        port: u16,
        is_server: c_int,
        world_size: u32,
        timeout_ms: i64,
        out: *mut *mut BraidStore,
    ) -> *mut c_char;
    fn braid_store_prefix(
        base: *const BraidStore,
        prefix: *const c_char,
        prefix_len: usize,
        out: *mut *mut BraidStore,
    ) -> *mut c_char;
    fn braid_store_clone(store: *const BraidStore, out: *mut *mut BraidStore) -> *mut c_char;
    fn braid_store_free(store: *mut BraidStore);
    fn braid_store_set(
        store: *const BraidStore,
        key: *const c_char,
        key_len: usize,
        value: *const u8,
        value_len: usize,
    ) -> *mut c_char;
    fn braid_store_get(
        store: *const BraidStore,
        key: *const c_char,
        key_len: usize,
        timeout_ms: i64,
        value: *mut *mut u8,
        value_len: *mut usize,
    ) -> *mut c_char;
    fn braid_store_add(
        store: *const BraidStore,
        key: *const c_char,
        key_len: usize,
        delta: i64,
        out: *mut i64,
    ) -> *mut c_char;
    fn braid_store_wait(
        store: *const BraidStore,
        keys: *const *const c_char,
        key_lens: *const usize,
        n: usize,
        timeout_ms: i64,
    ) -> *mut c_char;
    fn braid_group_gloo(
        store: *const BraidStore,
        rank: c_int,
        size: c_int,
        timeout_ms: i64,
        out: *mut *mut BraidGroup,
    ) -> *mut c_char;
    #[cfg(feature = "nccl")]
    fn braid_group_nccl(
        store: *const BraidStore,
        rank: c_int,
        size: c_int,
        device: c_int,
        timeout_ms: i64,
        out: *mut *mut BraidGroup,
    ) -> *mut c_char;
    fn braid_group_free(group: *mut BraidGroup);
    fn braid_group_all_reduce(
        group: *mut BraidGroup,
        tensors: *const *mut c_void,
        n: usize,
        op: c_int,
        timeout_ms: i64,
    ) -> *mut c_char;
    fn braid_group_broadcast(
        group: *mut BraidGroup,
        tensor: *mut c_void,
        root: c_int,
        timeout_ms: i64,
    ) -> *mut c_char;
    fn braid_group_all_gather(
        group: *mut BraidGroup,
        output: *mut c_void,
        input: *mut c_void,
        timeout_ms: i64,
    ) -> *mut c_char;
    fn braid_group_reduce_scatter(
        group: *mut BraidGroup,
        output: *mut c_void,
        input: *mut c_void,
        op: c_int,
        timeout_ms: i64,
    ) -> *mut c_char;
    fn braid_group_send(
        group: *mut BraidGroup,
        tensor: *mut c_void,
        dst: c_int,
        tag: c_int,
        timeout_ms: i64,
    ) -> *mut c_char;
    fn braid_group_recv(
        group: *mut BraidGroup,
        tensor: *mut c_void,
        src: c_int,
        tag: c_int,
        timeout_ms: i64,
    ) -> *mut c_char;
    fn braid_group_barrier(group: *mut BraidGroup, timeout_ms: i64) -> *mut c_char;
}

/// The shim's reduction codes (`BRAID_REDUCE_*` in c10d_shim.h).
pub(crate) const REDUCE_SUM: c_int = 0;
pub(crate) const REDUCE_AVG: c_int = 1;
pub(crate) const REDUCE_MAX: c_int = 2;
pub(crate) const REDUCE_MIN: c_int = 3;

type FfiResult<T> = std::result::Result<T, String>;

/// Turns the shim's returned error (NULL on success) into a `Result`, freeing the string.
fn take_error(err: *mut c_char) -> FfiResult<()> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null return is a NUL-terminated string the shim allocated for us; it is
    // read once here and freed once below.
    let message = unsafe { std::ffi::CStr::from_ptr(err) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: `err` came from the shim's allocator and has not been freed.
    unsafe { braid_c10d_free(err.cast()) };
    Err(message)
}

/// Milliseconds for the shim, which rejects zero; sub-millisecond timeouts round up.
fn millis(timeout: Duration) -> i64 {
    let ms = timeout.as_millis().max(1);
    i64::try_from(ms).unwrap_or(i64::MAX)
}

fn c_int_of(value: usize, what: &str) -> FfiResult<c_int> {
    c_int::try_from(value).map_err(|_| format!("{what} {value} does not fit a C int"))
}

/// An owned `c10d::Store` handle (a TCPStore or a PrefixStore over one).
#[derive(Debug)]
pub(crate) struct RawStore(*mut BraidStore);

// SAFETY: c10d's stores serialise their own operations (TCPStore holds a mutex around each
// request; PrefixStore forwards to its base), so the handle may move between and be shared by
// threads.
unsafe impl Send for RawStore {}
// SAFETY: as above; every method takes `&self` and the C++ side locks.
unsafe impl Sync for RawStore {}

impl RawStore {
    pub(crate) fn tcp(
        host: &str,
        port: u16,
        is_server: bool,
        world_size: u32,
        timeout: Duration,
    ) -> FfiResult<RawStore> {
        let mut out = std::ptr::null_mut();
        // SAFETY: see the module documentation; `out` is written only on success.
        take_error(unsafe {
            braid_store_tcp(
                host.as_ptr().cast(),
                host.len(),
                port,
                c_int::from(is_server),
                world_size,
                millis(timeout),
                &mut out,
            )
        })?;
        Ok(RawStore(out))
    }

    pub(crate) fn prefixed(&self, prefix: &str) -> FfiResult<RawStore> {
        let mut out = std::ptr::null_mut();
        // SAFETY: see the module documentation.
        take_error(unsafe {
            braid_store_prefix(self.0, prefix.as_ptr().cast(), prefix.len(), &mut out)
        })?;
        Ok(RawStore(out))
    }

    pub(crate) fn reconnect(&self) -> FfiResult<RawStore> {
        let mut out = std::ptr::null_mut();
        // SAFETY: see the module documentation.
        take_error(unsafe { braid_store_clone(self.0, &mut out) })?;
        Ok(RawStore(out))
    }

    pub(crate) fn set(&self, key: &str, value: &[u8]) -> FfiResult<()> {
        // SAFETY: see the module documentation.
        take_error(unsafe {
            braid_store_set(
                self.0,
                key.as_ptr().cast(),
                key.len(),
                value.as_ptr(),
                value.len(),
            )
        })
    }

    pub(crate) fn get(&self, key: &str, timeout: Duration) -> FfiResult<Vec<u8>> {
        let mut data: *mut u8 = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: see the module documentation; on success `data` is NULL (empty value) or a
        // `malloc`ed buffer of `len` bytes that we copy and free once.
        take_error(unsafe {
            braid_store_get(
                self.0,
                key.as_ptr().cast(),
                key.len(),
                millis(timeout),
                &mut data,
                &mut len,
            )
        })?;
        if data.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: as above.
        let value = unsafe { std::slice::from_raw_parts(data, len) }.to_vec();
        // SAFETY: as above.
        unsafe { braid_c10d_free(data.cast()) };
        Ok(value)
    }

    pub(crate) fn add(&self, key: &str, delta: i64) -> FfiResult<i64> {
        let mut out = 0i64;
        // SAFETY: see the module documentation.
        take_error(unsafe {
            braid_store_add(self.0, key.as_ptr().cast(), key.len(), delta, &mut out)
        })?;
        Ok(out)
    }

    pub(crate) fn wait(&self, keys: &[&str], timeout: Duration) -> FfiResult<()> {
        let ptrs: Vec<*const c_char> = keys.iter().map(|k| k.as_ptr().cast()).collect();
        let lens: Vec<usize> = keys.iter().map(|k| k.len()).collect();
        // SAFETY: see the module documentation; `ptrs` and `lens` have `keys.len()` entries
        // and outlive the call.
        take_error(unsafe {
            braid_store_wait(
                self.0,
                ptrs.as_ptr(),
                lens.as_ptr(),
                keys.len(),
                millis(timeout),
            )
        })
    }
}

impl Drop for RawStore {
    fn drop(&mut self) {
        // SAFETY: the handle is owned by this value and freed only here.
        unsafe { braid_store_free(self.0) }
    }
}

/// An owned `c10d::Backend` handle (ProcessGroupGloo or ProcessGroupNCCL).
#[derive(Debug)]
pub(crate) struct RawGroup(*mut BraidGroup);

// SAFETY: a c10d backend is not tied to the thread that created it: ProcessGroupGloo queues
// work for its own worker threads under a mutex, ProcessGroupNCCL sets the tensor's device on
// every call, and torch's Python bindings call both from whichever thread holds the GIL. It is
// not `Sync`: collectives must be issued in one order on every rank, which concurrent callers
// would break.
unsafe impl Send for RawGroup {}

impl RawGroup {
    pub(crate) fn gloo(
        store: &RawStore,
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> FfiResult<RawGroup> {
        let mut out = std::ptr::null_mut();
        let (rank, size) = (c_int_of(rank, "rank")?, c_int_of(size, "size")?);
        // SAFETY: see the module documentation.
        take_error(unsafe { braid_group_gloo(store.0, rank, size, millis(timeout), &mut out) })?;
        Ok(RawGroup(out))
    }

    #[cfg(feature = "nccl")]
    pub(crate) fn nccl(
        store: &RawStore,
        rank: usize,
        size: usize,
        device: usize,
        timeout: Duration,
    ) -> FfiResult<RawGroup> {
        let mut out = std::ptr::null_mut();
        let (rank, size) = (c_int_of(rank, "rank")?, c_int_of(size, "size")?);
        let device = c_int_of(device, "CUDA device")?;
        // SAFETY: see the module documentation.
        take_error(unsafe {
            braid_group_nccl(store.0, rank, size, device, millis(timeout), &mut out)
        })?;
        Ok(RawGroup(out))
    }

    pub(crate) fn all_reduce(
        &self,
        tensors: &mut [tch::Tensor],
        op: c_int,
        timeout: Duration,
    ) -> FfiResult<()> {
        let ptrs: Vec<*mut c_void> = tensors.iter_mut().map(|t| t.as_mut_ptr().cast()).collect();
        // SAFETY: see the module documentation; `ptrs` outlives the call.
        take_error(unsafe {
            braid_group_all_reduce(self.0, ptrs.as_ptr(), ptrs.len(), op, millis(timeout))
        })
    }

    pub(crate) fn broadcast(
        &self,
        tensor: &mut tch::Tensor,
        root: usize,
        timeout: Duration,
    ) -> FfiResult<()> {
        let root = c_int_of(root, "root")?;
        // SAFETY: see the module documentation.
        take_error(unsafe {
            braid_group_broadcast(self.0, tensor.as_mut_ptr().cast(), root, millis(timeout))
        })
    }

    pub(crate) fn all_gather(
        &self,
        output: &mut tch::Tensor,
        input: &tch::Tensor,
        timeout: Duration,
    ) -> FfiResult<()> {
        // SAFETY: see the module documentation; the shim only reads `input` (the `*mut` is
        // the C signature's, c10d takes tensors by non-const reference).
        take_error(unsafe {
            braid_group_all_gather(
                self.0,
                output.as_mut_ptr().cast(),
                input.as_ptr().cast_mut().cast(),
                millis(timeout),
            )
        })
    }

    pub(crate) fn reduce_scatter(
        &self,
        output: &mut tch::Tensor,
        input: &tch::Tensor,
        op: c_int,
        timeout: Duration,
    ) -> FfiResult<()> {
        // SAFETY: as in `all_gather`.
        take_error(unsafe {
            braid_group_reduce_scatter(
                self.0,
                output.as_mut_ptr().cast(),
                input.as_ptr().cast_mut().cast(),
                op,
                millis(timeout),
            )
        })
    }

    pub(crate) fn send(
        &self,
        tensor: &tch::Tensor,
        dst: usize,
        tag: u32,
        timeout: Duration,
    ) -> FfiResult<()> {
        let (dst, tag) = (
            c_int_of(dst, "destination rank")?,
            c_int_of(tag as usize, "tag")?,
        );
        // SAFETY: as in `all_gather`: a send only reads the tensor.
        take_error(unsafe {
            braid_group_send(
                self.0,
                tensor.as_ptr().cast_mut().cast(),
                dst,
                tag,
                millis(timeout),
            )
        })
    }

    pub(crate) fn recv(
        &self,
        tensor: &mut tch::Tensor,
        src: usize,
        tag: u32,
        timeout: Duration,
    ) -> FfiResult<()> {
        let (src, tag) = (
            c_int_of(src, "source rank")?,
            c_int_of(tag as usize, "tag")?,
        );
        // SAFETY: see the module documentation.
        take_error(unsafe {
            braid_group_recv(
                self.0,
                tensor.as_mut_ptr().cast(),
                src,
                tag,
                millis(timeout),
            )
        })
    }

    pub(crate) fn barrier(&self, timeout: Duration) -> FfiResult<()> {
        // SAFETY: see the module documentation.
        take_error(unsafe { braid_group_barrier(self.0, millis(timeout)) })
    }
}

impl Drop for RawGroup {
    fn drop(&mut self) {
        // SAFETY: the handle is owned by this value and freed only here.
        unsafe { braid_group_free(self.0) }
    }
}

/// An owned tensor-parallel handle (`BraidTp`): a reference to a group's backend that the
/// autograd nodes of `braid_tp_copy` / `braid_tp_reduce` share, so that it lives as long as any
/// graph that needs it.
#[derive(Debug)]
pub(crate) struct RawTp(*mut BraidTp);

// SAFETY: as for `RawGroup`: the backend is not tied to a thread; callers issue one operation
// at a time (the model that owns the handle runs on one thread at a time).
unsafe impl Send for RawTp {}
// SAFETY: every method takes `&self` and the shim's state is immutable after creation; the
// order of collectives is the callers' concern, as for a group.
unsafe impl Sync for RawTp {}

impl RawTp {
    pub(crate) fn new(group: &RawGroup, timeout: Duration) -> FfiResult<RawTp> {
        let mut out = std::ptr::null_mut();
        // SAFETY: see the module documentation; the shim copies the backend reference.
        take_error(unsafe { braid_tp_new(group.0, millis(timeout), &mut out) })?;
        Ok(RawTp(out))
    }

    /// A tensor the shim allocated (`new at::Tensor`), owned from here on by tch.
    fn owned(call: impl FnOnce(*mut *mut c_void) -> *mut c_char) -> FfiResult<tch::Tensor> {
        let mut out: *mut c_void = std::ptr::null_mut();
        take_error(call(&mut out))?;
        if out.is_null() {
            return Err("the tensor-parallel shim returned no tensor".into());
        }
        // SAFETY: on success `out` is a `torch::Tensor*` allocated with `new` for the caller,
        // which is exactly what tch's `C_tensor` owning pointer is (torch-sys's torch_api.h).
        Ok(unsafe { tch::Tensor::from_ptr(out.cast()) })
    }

    pub(crate) fn copy(&self, input: &tch::Tensor) -> FfiResult<tch::Tensor> {
        // SAFETY: see the module documentation; the shim only reads `input`.
        Self::owned(|out| unsafe { braid_tp_copy(self.0, input.as_ptr() as *mut c_void, out) })
    }

    pub(crate) fn reduce(&self, input: &tch::Tensor, op: c_int) -> FfiResult<tch::Tensor> {
        // SAFETY: see the module documentation; the shim only reads `input`.
        Self::owned(|out| unsafe {
            braid_tp_reduce(self.0, input.as_ptr() as *mut c_void, op, out)
        })
    }

    pub(crate) fn all_gather(&self, input: &tch::Tensor) -> FfiResult<tch::Tensor> {
        // SAFETY: see the module documentation; the shim only reads `input`.
        Self::owned(|out| unsafe {
            braid_tp_all_gather(self.0, input.as_ptr() as *mut c_void, out)
        })
    }
}

impl Drop for RawTp {
    fn drop(&mut self) {
        // SAFETY: the handle is owned by this value and freed only here; graphs that still
        // need the backend hold their own reference to it.
        unsafe { braid_tp_free(self.0) }
    }
}
