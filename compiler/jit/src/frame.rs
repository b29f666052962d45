//! The frame a compiled kernel function receives: the only data structure shared between
//! Rust and JIT code, so its layout is fixed (`repr(C)`, all fields 8 bytes) and the code
//! generator reads fields by the offsets defined here. It must not hold anything the generated
//! code could use to reach memory outside the buffers the caller checked.

use braid_ir::kernel::SampleText;
use braid_ir::kernel::host::HostFns;

/// Per-call data of one sample (pointers are stored as integers so that filling a frame needs
/// no unsafe code).
#[repr(C)]
#[derive(Debug)]
pub(crate) struct Frame {
    /// The sample's token count.
    pub len: u64,
    /// The sample's group id.
    pub group: i64,
    /// `*const u64`: one slot per parameter — a `*const f64` to the sample's tokens for a
    /// per-token parameter, else the value's bits (see `SampleCtx::scalar_bits`).
    pub slots: u64,
    /// `*mut f64`: `n_scratch * len` floats for materialised per-token values.
    pub scratch: u64,
    /// `*mut f64`: the output, `len` floats (per-token kernels) or one.
    pub out: u64,
    /// `*const f64`: the sample's scope reduction values.
    pub scope_vals: u64,
    /// `*const u64`: per scope reduction, a `*mut f64` to where the pre-pass writes its argument.
    pub red_out: u64,
    /// `&HostEnv`: for host calls.
    pub host: u64,
}

pub(crate) const OFF_LEN: i32 = 0;
pub(crate) const OFF_GROUP: i32 = 8;
pub(crate) const OFF_SLOTS: i32 = 16;
pub(crate) const OFF_SCRATCH: i32 = 24;
pub(crate) const OFF_OUT: i32 = 32;
pub(crate) const OFF_SCOPE_VALS: i32 = 40;
pub(crate) const OFF_RED_OUT: i32 = 48;
pub(crate) const OFF_HOST: i32 = 56;

/// What a host call needs: the kernel's compiled host functions and the sample's text.
#[derive(Debug)]
pub(crate) struct HostEnv<'a> {
    pub fns: &'a HostFns,
    pub text: Option<&'a SampleText>,
}

/// The host ABI's `braid_host_call(env, call) -> i64`: host call `call` of the kernel on the
/// current sample's text. Never panics (a panic cannot unwind through JIT frames).
pub(crate) extern "C" fn braid_host_call(env: &HostEnv<'_>, call: u64) -> i64 {
    match env.text {
        Some(t) => env.fns.call(usize::try_from(call).unwrap_or(usize::MAX), t),
        None => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn offsets_match_the_layout() {
        assert_eq!(offset_of!(Frame, len), OFF_LEN as usize);
        assert_eq!(offset_of!(Frame, group), OFF_GROUP as usize);
        assert_eq!(offset_of!(Frame, slots), OFF_SLOTS as usize);
        assert_eq!(offset_of!(Frame, scratch), OFF_SCRATCH as usize);
        assert_eq!(offset_of!(Frame, out), OFF_OUT as usize);
        assert_eq!(offset_of!(Frame, scope_vals), OFF_SCOPE_VALS as usize);
        assert_eq!(offset_of!(Frame, red_out), OFF_RED_OUT as usize);
        assert_eq!(offset_of!(Frame, host), OFF_HOST as usize);
    }
}
