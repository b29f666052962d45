//! Differential fuzzing of the kernel JIT: bytes become a random well-typed kernel and inputs
//! (`braid_ir::kernel::random`), which run on the interpreter and on freshly compiled native
//! code; the results must agree bit for bit (NaN-aware) and nothing may crash.
//!
//! Run: `cargo +nightly fuzz run kernel_jit` from the repository root.
#![no_main]

use braid_ir::kernel::random::random_case;
use braid_ir::kernel::{Interpreter, KernelExec, Output};
use braid_jit::Jit;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

fn same(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn agree(a: &Output, b: &Output) -> bool {
    match (a, b) {
        (Output::PerSample(x), Output::PerSample(y)) => x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(*a, *b)),
        (Output::PerToken { values: x, offsets: ox }, Output::PerToken { values: y, offsets: oy }) => {
            ox == oy && x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(*a, *b))
        }
        _ => false,
    }
}

fuzz_target!(|data: &[u8]| {
    static JIT: OnceLock<Jit> = OnceLock::new();
    let jit = JIT.get_or_init(|| Jit::new().expect("host ISA"));
    let case = random_case(data).expect("the generator makes only valid kernels");
    let interp = Interpreter::new(case.kernel.clone()).expect("verified");
    // Uncached, so that every input compiles (and frees) its own code.
    let compiled = jit.compile_uncached(&case.kernel).expect("a verified kernel compiles");
    let args = case.inputs.args();
    let batch = case.inputs.batch();
    let a = interp.run(&batch, &args);
    let b = compiled.run(&batch, &args);
    match (&a, &b) {
        (Ok(x), Ok(y)) => assert!(agree(x, y), "interpreter {x:?}\njit {y:?}\n{}", case.kernel),
        (Err(x), Err(y)) => assert_eq!(x, y),
        _ => panic!("interpreter {a:?}, jit {b:?}\n{}", case.kernel),
    }
});
