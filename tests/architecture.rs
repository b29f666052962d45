//! Architecture invariants checked from the dependency graph (`cargo metadata`) and the sources:
//! which crates may depend on what, and that the compiler crates do no file I/O.
//! ARCHITECTURE.md names this file.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

/// The workspace's crates and, for each, its normal dependencies (dev- and build-dependencies
/// excluded), read from `cargo metadata`.
fn dependency_graph() -> BTreeMap<String, Vec<String>> {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut graph = BTreeMap::new();
    for p in v["packages"].as_array().unwrap() {
        let deps = p["dependencies"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["kind"].is_null())
            .map(|d| d["name"].as_str().unwrap().to_string())
            .collect();
        graph.insert(p["name"].as_str().unwrap().to_string(), deps);
    }
    graph
}

/// Every crate `krate` depends on, directly or through other workspace crates (external
/// crates cannot depend on ours, so the workspace's edges are the whole story for ours).
fn closure(graph: &BTreeMap<String, Vec<String>>, krate: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut todo = vec![krate.to_string()];
    while let Some(k) = todo.pop() {
        for d in graph.get(&k).into_iter().flatten() {
            if seen.insert(d.clone()) {
                todo.push(d.clone());
            }
        }
    }
    seen
}

fn forbid(graph: &BTreeMap<String, Vec<String>>, krate: &str, banned: &[&str], why: &str) {
    assert!(
        graph.contains_key(krate),
        "no crate {krate} in the workspace"
    );
    let deps = closure(graph, krate);
    for b in banned {
        assert!(
            !deps.contains(*b),
            "{krate} must not depend on {b} (directly or not): {why}"
        );
    }
}

const COMPILER: &[&str] = &[
    "braid-syntax",
    "braid-diagnostics",
    "braid-ir",
    "braid-sema",
    "braid-cost",
    "braid-passes",
    "braid-driver",
    "braid-stdlib",
    "braid-jit",
    "braid-lsp",
];

#[test]
fn only_the_runtime_links_libtorch_and_the_compiler_stays_lean() {
    let g = dependency_graph();
    for krate in COMPILER {
        forbid(
            &g,
            krate,
            &["tch", "torch-sys", "braid-runtime"],
            "the compiler builds and runs without libtorch",
        );
    }
    for krate in COMPILER.iter().filter(|k| **k != "braid-lsp") {
        forbid(
            &g,
            krate,
            &["lsp-server", "lsp-types"],
            "only the language server knows the protocol",
        );
    }
    forbid(
        &g,
        "braid-ir",
        &[
            "pest",
            "pest_derive",
            "cranelift-codegen",
            "cranelift-jit",
            "braid-syntax",
            "braid-sema",
            "braid-passes",
            "braid-driver",
        ],
        "the IR is the contract between compiler and runtime",
    );
    forbid(
        &g,
        "braid-runtime",
        &[
            "braid-syntax",
            "braid-sema",
            "braid-passes",
            "braid-driver",
            "braid-lsp",
            "pest",
        ],
        "the runtime takes plans, not programs",
    );
    forbid(
        &g,
        "braid-cost",
        &[
            "braid-ir",
            "braid-syntax",
            "braid-sema",
            "braid-passes",
            "braid-diagnostics",
        ],
        "the cost model, simulator and solver know nothing of the IR",
    );
    // The closure really is the transitive one: the CLI reaches the syntax through the driver.
    assert!(closure(&g, "braid-driver").contains("braid-syntax"));
}

#[test]
fn compiler_crates_do_no_file_io() {
    // The CLI reads files and hands text to the compiler, which reads imports through a
    // `Loader` and model architectures through `ModelConfigs`; so the language server and tests
    // can serve files from memory.
    for krate in [
        "grammar",
        "compiler/diagnostics",
        "compiler/sema",
        "compiler/passes",
        "compiler/cost",
        "compiler/driver",
    ] {
        let src = Path::new(krate).join("src");
        let mut files = vec![src];
        while let Some(path) = files.pop() {
            if path.is_dir() {
                for entry in std::fs::read_dir(&path).unwrap() {
                    files.push(entry.unwrap().path());
                }
                continue;
            }
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
