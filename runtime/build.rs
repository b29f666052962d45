//! Sets an rpath to libtorch's `lib/` so this crate's test binaries run without
//! `LD_LIBRARY_PATH`, keeps `libtorch_cuda.so` linked (see `keep_cuda_linked`), and compiles
//! the C++ shim (`csrc/`: c10d for `braid_runtime::dist`, CUDA streams for `braid_runtime::cuda`)
//! against the same libtorch. torch-sys exports the folder it linked against.
use std::path::{Path, PathBuf};

fn main() {
    let lib = libtorch_lib();
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    keep_cuda_linked(&lib);
    compile_c10d_shim(&lib);
}

/// torch-sys asks for `-ltorch_cuda`, but no code calls into that library directly (its CUDA
/// kernels and hooks register themselves from static initialisers), so a linker defaulting to
/// `--as-needed` drops it and a test or example never sees a GPU. `--no-as-needed` around it
/// keeps it; the root `build.rs` does the same for the `braid` binary. A CPU-only libtorch has
/// no such library, and then nothing is added.
fn keep_cuda_linked(lib: &Path) {
    let has_cuda = lib.join("libtorch_cuda.so").exists();
    // For `cuda::tests`: whether the backend must be loaded in this build's binaries.
    println!(
        "cargo:rustc-env=BRAID_LIBTORCH_HAS_CUDA={}",
        if has_cuda { 1 } else { 0 }
    );
    if has_cuda {
        println!("cargo:rustc-link-arg=-L{}", lib.display());
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }
}

/// The `lib/` folder of the libtorch that torch-sys linked.
fn libtorch_lib() -> PathBuf {
    // torch-sys declares `links = "tch"`, so cargo names the variable after that key.
    for var in ["DEP_TCH_LIBTORCH_LIB", "DEP_TORCH_SYS_LIBTORCH_LIB"] {
        println!("cargo:rerun-if-env-changed={var}");
        if let Ok(lib) = std::env::var(var) {
            return PathBuf::from(lib);
        }
    }
    panic!("torch-sys did not export its libtorch folder (DEP_TCH_LIBTORCH_LIB)");
}

/// Compiles `csrc/c10d_shim.cpp` (and `csrc/c10d_nccl.cpp` with the `nccl` feature) with
/// libtorch's headers, C++17 and its C++11-ABI setting, as torch-sys compiles its own wrapper:
/// the shim passes `at::Tensor` and c10d objects across that boundary, so both must see the same
/// layouts. docs/distributed.md says why gloo's headers come from Debian's libgloo-dev.
fn compile_c10d_shim(lib: &Path) {
    for file in [
        "csrc/c10d_shim.h",
        "csrc/c10d_internal.hpp",
        "csrc/c10d_shim.cpp",
        "csrc/c10d_nccl.cpp",
        "csrc/cuda_shim.h",
        "csrc/cuda_shim.cpp",
        "csrc/tp_autograd.cpp",
    ] {
        println!("cargo:rerun-if-changed={file}");
    }
    for var in [
        "LIBTORCH_CXX11_ABI",
        "GLOO_INCLUDE",
        "BRAID_CUDA_INCLUDE",
        "CUDA_HOME",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let torch = lib
        .parent()
        .expect("libtorch's lib folder has a parent")
        .to_path_buf();
    let torch_include = torch.join("include");
    // torch-sys reads the same variable with the same default; a mismatch would show as
    // undefined `std::__cxx11` symbols at link time, not as silent corruption.
    let cxx11_abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", cxx11_abi.as_str())
        .define("USE_C10D_GLOO", None)
        .flag_if_supported("-Wno-interference-size")
        .file("csrc/c10d_shim.cpp")
        // Tensor parallelism's differentiable collectives (autograd nodes over c10d::Backend).
        .file("csrc/tp_autograd.cpp")
        // CUDA streams and allocator statistics: libtorch headers only (c10's device-generic
        // interfaces), so every build compiles it, with or without CUDA.
        .file("csrc/cuda_shim.cpp");
    // -isystem: libtorch's headers are not ours to warn about; the shim's own code still is.
    let mut system_includes = vec![
        torch_include.clone(),
        torch_include.join("torch/csrc/api/include"),
    ];
    // /usr/include is already the compiler's; naming it with -isystem would break the
    // `#include_next` of libstdc++'s headers.
    let gloo = gloo_include();
    if gloo != Path::new("/usr/include") {
        system_includes.push(gloo);
    }

    if std::env::var_os("CARGO_FEATURE_NCCL").is_some() {
        build
            .define("USE_C10D_NCCL", None)
            .define("USE_CUDA", None)
            .file("csrc/c10d_nccl.cpp");
        system_includes.extend(cuda_includes(&torch));
        // ProcessGroupNCCL lives in libtorch_cuda (torch-sys links it when the wheel has it);
        // c10::cuda::set_device in c10_cuda.
        if !lib.join("libtorch_cuda.so").exists() {
            panic!(
                "feature `nccl`: {} has no libtorch_cuda.so (a CPU-only libtorch)",
                lib.display()
            );
        }
        println!("cargo:rustc-link-lib=torch_cuda");
        println!("cargo:rustc-link-lib=c10_cuda");
    }
    for dir in &system_includes {
        build
            .flag("-isystem")
            .flag(dir.to_str().expect("UTF-8 include path"));
    }
    build.compile("braid_c10d");
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=torch_cpu");
    println!("cargo:rustc-link-lib=c10");
}

/// Where `gloo/context.h` is: `GLOO_INCLUDE`, else Debian's libgloo-dev in /usr/include.
fn gloo_include() -> PathBuf {
    let dir = std::env::var_os("GLOO_INCLUDE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/include"));
    if !dir.join("gloo/context.h").exists() {
        panic!(
            "gloo's headers are missing ({}/gloo/context.h): libtorch's c10d headers include \
             them but the torch wheel does not ship them. Install Debian's libgloo-dev \
             (scripts/setup does) or set GLOO_INCLUDE",
            dir.display()
        );
    }
    dir
}

/// CUDA and NCCL headers for ProcessGroupNCCL.hpp: the wheel's `nvidia/*` packages, a CUDA
/// toolkit (`CUDA_HOME`) and `BRAID_CUDA_INCLUDE` (a `:`-separated list). The wheel's
/// dependencies lack `crt/host_config.h` and `nv/target`; `nvidia-cuda-crt` and
/// `nvidia-cuda-cccl` (same CUDA version) or a toolkit provide them.
fn cuda_includes(torch: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(extra) = std::env::var_os("BRAID_CUDA_INCLUDE") {
        dirs.extend(std::env::split_paths(&extra));
    }
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        dirs.push(PathBuf::from(home).join("include"));
    }
    // `.venv/libtorch` is a link to the wheel's `torch/`: its real parent is site-packages.
    let torch = torch.canonicalize().unwrap_or_else(|_| torch.to_path_buf());
    if let Some(site_packages) = torch.parent() {
        let nvidia = site_packages.join("nvidia");
        for sub in ["cu13/include", "cu12/include", "nccl/include"] {
            dirs.push(nvidia.join(sub));
        }
        // nvidia-cuda-cccl puts libcu++ under include/cccl.
        dirs.push(nvidia.join("cu13/include/cccl"));
    }
    dirs.retain(|dir| dir.is_dir());
    for needed in ["cuda_runtime.h", "crt/host_config.h", "nv/target", "nccl.h"] {
        if !dirs.iter().any(|dir| dir.join(needed).exists()) {
            panic!(
                "feature `nccl`: no `{needed}` in {dirs:?}. Install a CUDA toolkit (CUDA_HOME) or \
                 `pip install nvidia-cuda-crt nvidia-cuda-cccl` matching the wheel's CUDA, or set \
                 BRAID_CUDA_INCLUDE"
            );
        }
    }
    dirs
}
