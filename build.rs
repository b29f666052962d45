//! Sets an rpath to libtorch's `lib/` so the `braid` binary runs without
//! `LD_LIBRARY_PATH`, and keeps `libtorch_cuda.so` linked. torch-sys exports the folder it
//! linked against.
//!
//! torch-sys asks for `-ltorch_cuda`, but nothing in the binary calls into that library (CUDA
//! kernels register themselves from its static initialisers), so a linker that defaults to
//! `--as-needed` drops it and the binary never sees a GPU: `tch::Cuda::is_available()` is
//! false on a CUDA machine. `--no-as-needed` around it keeps it (`runtime/build.rs` does the
//! same for the runtime's tests and examples).
use std::path::Path;

fn main() {
    // torch-sys declares `links = "tch"`, so cargo names the variable after that key.
    for var in ["DEP_TCH_LIBTORCH_LIB", "DEP_TORCH_SYS_LIBTORCH_LIB"] {
        println!("cargo:rerun-if-env-changed={var}");
        if let Ok(lib) = std::env::var(var) {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
            if Path::new(&lib).join("libtorch_cuda.so").exists() {
                println!("cargo:rustc-link-arg=-L{lib}");
                println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
            }
            return;
        }
    }
}
