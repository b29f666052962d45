//! Architecture invariants that are cheap to check from the sources: which crates may depend on
//! what, and that the compiler crates do no file I/O. ARCHITECTURE.md names this file.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

/// The `[dependencies]` of a crate's manifest (names only; dev-dependencies excluded).
fn dependencies(manifest: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(manifest).unwrap();
    let mut deps = Vec::new();
    let mut in_deps = false;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
            continue;
        }
        if in_deps
            && !line.is_empty()
            && !line.starts_with('#')
            && let Some(name) = line.split(['=', '.', ' ']).next()
        {
            deps.push(name.trim().to_string());
        }
    }
    deps
}

const COMPILER: &[&str] = &[
    "grammar",
    "compiler/diagnostics",
    "compiler/ir",
    "compiler/sema",
    "compiler/passes",
    "stdlib",
];

#[test]
fn only_the_runtime_links_libtorch_and_the_compiler_stays_lean() {
    for krate in COMPILER.iter().chain(["compiler/jit"].iter()) {
        let deps = dependencies(&Path::new(krate).join("Cargo.toml"));
        for banned in ["tch", "torch-sys", "lsp-server", "lsp-types"] {
            assert!(
                !deps.iter().any(|d| d == banned),
                "{krate} must not depend on {banned}"
            );
        }
    }
    // The IR is the contract between compiler and runtime: no parser, JIT or LSP in it.
    let ir = dependencies(Path::new("compiler/ir/Cargo.toml"));
    for banned in [
        "pest",
        "pest_derive",
        "cranelift-codegen",
        "cranelift-jit",
        "braid-syntax",
        "braid-sema",
    ] {
        assert!(
            !ir.iter().any(|d| d == banned),
            "braid-ir must not depend on {banned}"
        );
    }
    let runtime = dependencies(Path::new("runtime/Cargo.toml"));
    for banned in ["braid-syntax", "braid-sema", "pest"] {
        assert!(
            !runtime.iter().any(|d| d == banned),
            "the runtime takes plans, not programs: no {banned}"
        );
    }
}

#[test]
fn compiler_crates_do_no_file_io() {
    // The driver (the CLI) reads files and hands text to the compiler, which reads imports
    // through a `Loader`; so the language server and tests can serve files from memory.
    for krate in ["grammar", "compiler/diagnostics", "compiler/sema"] {
        let src = Path::new(krate).join("src");
        for entry in std::fs::read_dir(&src).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            // Unit tests at the bottom of a file may read fixtures.
            let code = text.split("#[cfg(test)]").next().unwrap_or("");
            for banned in [
                "std::fs",
                "File::open",
                "read_to_string(",
                "std::env::current_dir",
            ] {
                assert!(!code.contains(banned), "{} uses {banned}", path.display());
            }
        }
    }
}
