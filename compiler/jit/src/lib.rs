//! braid-jit: compiles kernel IR (`braid_ir::kernel`) to native code with Cranelift, and runs
//! it through the same driver and the same public API ([`KernelExec`]) as the interpreter.
//!
//! A [`Jit`] owns the target ISA and a cache of compiled kernels keyed by the kernel's
//! structural hash (checked for full structural equality on a hit). A [`CompiledKernel`] owns
//! its code and checks, before every call into it, every size the generated code relies on (see
//! `codegen`'s module doc). The crate's only unsafe code is in `native`. It must not define
//! semantics of its own: whatever the interpreter computes, bit for bit, is what it computes.

mod codegen;
mod frame;
mod native;

use braid_ir::kernel::exec::{self, SampleCtx, SampleEval};
use braid_ir::kernel::host::HostFns;
use braid_ir::kernel::{
    Arg, Batch, Kernel, KernelExec, Output, ParamKind, ResultKind, RunError, VerifyError, fsem,
    verify,
};
use codegen::Layout;
use cranelift_codegen::isa::OwnedTargetIsa;
use cranelift_codegen::settings::{self, Configurable};
use cranelift_frontend::FunctionBuilderContext;
use cranelift_jit::{JITBuilder, JITModule};
use cranelift_module::{Module, default_libcall_names};
use frame::{Frame, HostEnv};
use native::KernelFn;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub use braid_ir::kernel;

/// Why a kernel could not be compiled.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum JitError {
    #[error(transparent)]
    Verify(#[from] VerifyError),
    #[error("this machine is not supported by Cranelift: {0}")]
    Isa(String),
    #[error("code generation failed: {0}")]
    Codegen(String),
}

/// The JIT: a target ISA and a cache of compiled kernels.
pub struct Jit {
    isa: OwnedTargetIsa,
    cache: Mutex<HashMap<u64, Vec<Arc<CompiledKernel>>>>,
}

impl std::fmt::Debug for Jit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jit")
            .field("isa", &self.isa.name())
            .finish_non_exhaustive()
    }
}

impl Jit {
    /// A JIT for the host machine, with Cranelift's `speed` optimisation level.
    pub fn new() -> Result<Jit, JitError> {
        let mut flags = settings::builder();
        let set = |f: &mut settings::Builder, k: &str, v: &str| {
            f.set(k, v)
                .map_err(|e| JitError::Isa(format!("{k}={v}: {e}")))
        };
        set(&mut flags, "opt_level", "speed")?;
        set(&mut flags, "use_colocated_libcalls", "false")?;
        set(&mut flags, "is_pic", "false")?;
        let isa = cranelift_native::builder()
            .map_err(|e| JitError::Isa(e.to_string()))?
            .finish(settings::Flags::new(flags))
            .map_err(|e| JitError::Isa(e.to_string()))?;
        Ok(Jit {
            isa,
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// Compiles a kernel, or returns the cached compilation of a structurally equal one.
    pub fn compile(&self, kernel: &Kernel) -> Result<Arc<CompiledKernel>, JitError> {
        let h = kernel.structural_hash();
        if let Some(hit) = self
            .lock()
            .get(&h)
            .and_then(|v| v.iter().find(|c| c.kernel.same_structure(kernel)))
        {
            return Ok(Arc::clone(hit));
        }
        let compiled = Arc::new(self.compile_uncached(kernel)?);
        self.lock()
            .entry(h)
            .or_default()
            .push(Arc::clone(&compiled));
        Ok(compiled)
    }

    /// The number of kernels in the cache.
    pub fn cached(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Vec<Arc<CompiledKernel>>>> {
        // The cache holds no invariant a panic could break halfway; a poisoned lock is usable.
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Compiles a kernel without looking at or filling the cache (what the compile-latency
    /// benchmark measures).
    pub fn compile_uncached(&self, kernel: &Kernel) -> Result<CompiledKernel, JitError> {
        verify(kernel)?;
        let host = HostFns::compile(&kernel.host_calls).map_err(|e| VerifyError {
            kernel: kernel.name.clone(),
            message: e.to_string(),
        })?;
        let mut jb = JITBuilder::with_isa(self.isa.clone(), default_libcall_names());
        jb.symbol(
            codegen::SYM_EXP,
            fsem::exp as extern "C" fn(f64) -> f64 as *const u8,
        );
        jb.symbol(
            codegen::SYM_LOG,
            fsem::log as extern "C" fn(f64) -> f64 as *const u8,
        );
        jb.symbol(
            codegen::SYM_FMOD,
            fsem::fmod as extern "C" fn(f64, f64) -> f64 as *const u8,
        );
        jb.symbol(
            codegen::SYM_HOST,
            frame::braid_host_call as extern "C" fn(&HostEnv<'_>, u64) -> i64 as *const u8,
        );
        let mut module = JITModule::new(jb);
        let layout = Layout::of(kernel);
        let imports = codegen::declare_imports(&mut module)?;
        let unit = codegen::Unit {
            kernel,
            layout: &layout,
            imports,
        };
        let mut ctx = module.make_context();
        let mut fctx = FunctionBuilderContext::new();
        let main_id = codegen::define(&mut module, &mut ctx, &mut fctx, &unit, None)?;
        let mut pre_ids = Vec::new();
        for level in 1..=layout.max_level {
            pre_ids.push(codegen::define(
                &mut module,
                &mut ctx,
                &mut fctx,
                &unit,
                Some(level),
            )?);
        }
        module
            .finalize_definitions()
            .map_err(|e| JitError::Codegen(e.to_string()))?;
        let main = native::kernel_fn(&module, main_id);
        let prepass = pre_ids
            .into_iter()
            .map(|id| native::kernel_fn(&module, id))
            .collect();
        let result_kind = kernel
            .result_kind()
            .ok_or_else(|| JitError::Codegen("the kernel has no result".into()))?;
        Ok(CompiledKernel {
            kernel: kernel.clone(),
            host,
            layout,
            result_kind,
            main,
            prepass,
            module: Mutex::new(Some(module)),
        })
    }
}

/// A kernel compiled to native code; run it with [`KernelExec::run`].
pub struct CompiledKernel {
    kernel: Kernel,
    host: HostFns,
    layout: Layout,
    result_kind: ResultKind,
    main: KernelFn,
    /// Pre-pass `L` is `prepass[L - 1]`.
    prepass: Vec<KernelFn>,
    /// Owns the code `main` and `prepass` point into; freed on drop.
    module: Mutex<Option<JITModule>>,
}

impl std::fmt::Debug for CompiledKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledKernel")
            .field("kernel", &self.kernel.name)
            .finish_non_exhaustive()
    }
}

impl Drop for CompiledKernel {
    fn drop(&mut self) {
        let module = match self.module.get_mut() {
            Ok(m) => m.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        if let Some(m) = module {
            native::free(m);
        }
    }
}

impl KernelExec for CompiledKernel {
    fn kernel(&self) -> &Kernel {
        &self.kernel
    }

    fn run(&self, batch: &Batch<'_>, args: &[Arg<'_>]) -> Result<Output, RunError> {
        let mut ev = JitEval {
            ck: self,
            slots: vec![0; self.kernel.params.len()],
            scratch: Vec::new(),
            red_ptrs: vec![0; self.layout.reductions.len()],
        };
        exec::run_kernel(&self.kernel, batch, args, &mut ev)
    }
}

/// Per-run buffers of a compiled kernel.
struct JitEval<'c> {
    ck: &'c CompiledKernel,
    slots: Vec<u64>,
    scratch: Vec<f64>,
    red_ptrs: Vec<u64>,
}

fn refuse(s: &SampleCtx<'_>, message: String) -> RunError {
    RunError::Backend {
        sample: s.index,
        message,
    }
}

impl JitEval<'_> {
    /// Fills the parameter slots and scratch for one sample, checking every size the code
    /// relies on.
    fn prepare(&mut self, s: &SampleCtx<'_>) -> Result<(), RunError> {
        for (p, kind) in self.ck.kernel.params.iter().enumerate() {
            self.slots[p] = match kind {
                ParamKind::PerToken => {
                    let t = s.tokens.get(p).copied().unwrap_or(&[]);
                    if t.len() != s.len {
                        return Err(refuse(
                            s,
                            format!("parameter {p} has {} tokens, not {}", t.len(), s.len),
                        ));
                    }
                    t.as_ptr() as usize as u64
                }
                _ => s.scalar_bits(p),
            };
        }
        let need = self.ck.layout.n_scratch * s.len;
        if self.scratch.len() < need {
            self.scratch.resize(need, 0.0);
        }
        Ok(())
    }

    fn call(&mut self, f: KernelFn, s: &SampleCtx<'_>, out: &mut [f64], scope_vals: &[f64]) {
        let env = HostEnv {
            fns: &self.ck.host,
            text: s.text,
        };
        let frame = Frame {
            len: s.len as u64,
            group: s.group,
            slots: self.slots.as_ptr() as usize as u64,
            scratch: self.scratch.as_mut_ptr() as usize as u64,
            out: out.as_mut_ptr() as usize as u64,
            scope_vals: scope_vals.as_ptr() as usize as u64,
            red_out: self.red_ptrs.as_ptr() as usize as u64,
            host: &env as *const HostEnv<'_> as usize as u64,
        };
        f(&frame);
    }
}

impl SampleEval for JitEval<'_> {
    fn prepass(
        &mut self,
        level: u32,
        s: &SampleCtx<'_>,
        scope_vals: &[f64],
        outs: &mut [&mut [f64]],
    ) -> Result<(), RunError> {
        let Some(&f) = (level as usize)
            .checked_sub(1)
            .and_then(|i| self.ck.prepass.get(i))
        else {
            return Err(refuse(s, format!("no pre-pass {level}")));
        };
        self.prepare(s)?;
        if outs.len() != self.red_ptrs.len() || scope_vals.len() != self.red_ptrs.len() {
            return Err(refuse(s, "wrong number of reduction buffers".into()));
        }
        for (r, (o, &(_, tokens, l))) in outs.iter_mut().zip(&self.ck.layout.reductions).enumerate()
        {
            // Pre-pass `level` writes only the arguments of this level's reductions.
            if l != level {
                self.red_ptrs[r] = 0;
                continue;
            }
            let want = if tokens { s.len } else { 1 };
            if o.len() != want {
                return Err(refuse(
                    s,
                    format!("reduction buffer {r} has {} entries, not {want}", o.len()),
                ));
            }
            self.red_ptrs[r] = o.as_mut_ptr() as usize as u64;
        }
        self.call(f, s, &mut [], scope_vals);
        Ok(())
    }

    fn eval(
        &mut self,
        s: &SampleCtx<'_>,
        scope_vals: &[f64],
        out: &mut [f64],
    ) -> Result<(), RunError> {
        self.prepare(s)?;
        let want = if self.ck.result_kind == ResultKind::PerToken {
            s.len
        } else {
            1
        };
        if out.len() != want {
            return Err(refuse(
                s,
                format!("output has {} entries, not {want}", out.len()),
            ));
        }
        if scope_vals.len() != self.red_ptrs.len() {
            return Err(refuse(s, "wrong number of scope values".into()));
        }
        // The main function never writes reduction arguments; clear stale pointers anyway.
        self.red_ptrs.iter_mut().for_each(|p| *p = 0);
        self.call(self.ck.main, s, out, scope_vals);
        Ok(())
    }
}
