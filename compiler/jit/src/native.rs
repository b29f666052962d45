//! The only `unsafe` code of the JIT: turning a finished function's address into a callable
//! Rust function pointer, and freeing a module's code when its kernel is dropped.
//!
//! Everything that makes a call sound is established by the safe code around it and written
//! down at each `unsafe` block; this module must not grow any other unsafe code. `unsafe_code`
//! is allowed on these two functions only.

use crate::frame::Frame;
use cranelift_jit::JITModule;

/// A compiled kernel function: one sample's evaluation (or pre-pass) over a [`Frame`].
pub(crate) type KernelFn = extern "C" fn(&Frame);

/// Casts the address of a finalised function of `module` to a [`KernelFn`].
///
/// The caller must have defined the function with the signature `fn(i64)` in the ISA's default
/// calling convention (SystemV or its platform equivalent, which is `extern "C"`), finalised
/// the module, and keep the module alive (not freed) while the pointer is used — the caller,
/// `CompiledKernel`, owns both and frees the module only on drop.
#[allow(unsafe_code)]
pub(crate) fn kernel_fn(module: &JITModule, id: cranelift_module::FuncId) -> KernelFn {
    let code = module.get_finalized_function(id);
    // SAFETY: `code` is the entry of a function that `codegen` built with exactly one pointer-
    // sized integer parameter and no results, in the default call convention of the host ISA,
    // i.e. `extern "C" fn(&Frame)` (a reference is passed as a pointer). The module was
    // finalised, so the code is executable, and it outlives the pointer (see above). What the
    // code reads and writes through the frame is bounded by the checks in `CompiledKernel`.
    unsafe { std::mem::transmute::<*const u8, KernelFn>(code) }
}

/// Frees a module's code and data.
///
/// Called only from `CompiledKernel`'s `Drop`, when no function pointer taken from the module
/// can be called any more.
#[allow(unsafe_code)]
pub(crate) fn free(module: JITModule) {
    // SAFETY: the only pointers into this module are the `KernelFn`s of the `CompiledKernel`
    // being dropped; `&self` methods cannot run during `drop`, so none is executing or will be
    // called again.
    unsafe { module.free_memory() }
}
