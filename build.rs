//! Sets an rpath to libtorch's `lib/` so the `braid` binary runs without
//! `LD_LIBRARY_PATH`. torch-sys exports the folder it linked against.
fn main() {
    // torch-sys declares `links = "tch"`, so cargo names the variable after that key.
    for var in ["DEP_TCH_LIBTORCH_LIB", "DEP_TORCH_SYS_LIBTORCH_LIB"] {
        println!("cargo:rerun-if-env-changed={var}");
        if let Ok(lib) = std::env::var(var) {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
            return;
        }
    }
}
