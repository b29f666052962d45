//! UI tests of diagnostics: every fixture in `tests/ui/` is checked, its diagnostics are
//! compared with the inline expectations (`//~ CODE` on the line of the primary label,
//! `//~^ CODE` for the line above), and the rendered output is snapshotted. Every code in the
//! table must have a fixture, a snapshot and a section in `docs/diagnostics.md`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use braid_diagnostics::{Code, RenderOptions, render_terminal};

struct Disk;

impl braid_sema::Loader for Disk {
    fn load(&self, from: &str, path: &str) -> Result<(String, String), String> {
        let name = braid_sema::join(from, path);
        std::fs::read_to_string(&name)
            .map(|t| (name.clone(), t))
            .map_err(|e| e.to_string())
    }
}

fn fixtures() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir("tests/ui")
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "rlhf"))
        .collect();
    v.sort();
    v
}

/// (line, code) pairs: what a fixture expects, or what checking it reported.
type Expectations = BTreeSet<(u32, String)>;

/// (line, code) pairs the fixture expects.
fn expectations(text: &str) -> Expectations {
    let mut out = BTreeSet::new();
    for (i, line) in text.lines().enumerate() {
        let Some(pos) = line.find("//~") else {
            continue;
        };
        let rest = &line[pos + 3..];
        let ups = rest.chars().take_while(|c| *c == '^').count();
        for code in rest[ups..].split_whitespace() {
            out.insert(((i + 1 - ups) as u32, code.to_string()));
        }
    }
    out
}

fn check_fixture(path: &Path) -> (Expectations, Expectations, String) {
    let name = path.to_string_lossy().replace('\\', "/");
    let text = std::fs::read_to_string(path).unwrap();
    let checked = braid_sema::check(&name, &text, &Disk);
    let root = checked.program.root;
    let mut actual = BTreeSet::new();
    let mut rendered = String::new();
    let mut diagnostics = checked.diagnostics.clone();
    if !checked.has_errors() && checked.program.run.is_some() {
        diagnostics.extend(plan_diagnostics(&checked.program));
    }
    for d in &diagnostics {
        let span = d.span();
        assert!(!span.is_dummy(), "{name}: {} has no span", d.code);
        assert!(d.help.is_some(), "{name}: {} has no help line", d.code);
        if span.file == root {
            let line = checked.sources.get(root).unwrap().line_col(span.start).line;
            actual.insert((line, d.code.as_str().to_string()));
        } else {
            actual.insert((0, format!("{}@{}", d.code, checked.sources.location(span))));
        }
        rendered.push_str(&render_terminal(
            d,
            &checked.sources,
            RenderOptions {
                color: false,
                width: 100,
            },
        ));
        rendered.push('\n');
    }
    (expectations(&text), actual, rendered)
}

/// The planner's diagnostics (`E05xx` that need the cost model) for a clean program: its run
/// planned on its `cluster` block (default `cpu`), models of `hf(...)` taken from the presets
/// named by their directories.
fn plan_diagnostics(program: &braid_sema::hir::Program) -> Vec<braid_diagnostics::Diagnostic> {
    use braid_cost::cluster::ClusterSpec;
    use braid_cost::cost::{DeviceKind, ModelShape};
    use braid_passes::annotated::{Annotated, Pins, default_workload, shapes_from_plan};
    use braid_passes::render::{PlanSpans, memory_diagnostics};
    let Ok(plan) = braid_sema::lower_graph::lower_run(program) else {
        return Vec::new();
    };
    let cluster = match &program.cluster {
        Some(braid_sema::hir::Cluster::Gpus { gpus, gpu, nodes }) => ClusterSpec {
            nodes: *nodes as u64,
            per_node: (*gpus / *nodes) as u64,
            device: DeviceKind::parse(gpu).unwrap(),
        },
        _ => ClusterSpec::parse("cpu").unwrap(),
    };
    let Ok(shapes) = shapes_from_plan(&plan, &mut |d| {
        ModelShape::preset_for_path(d).ok_or_else(|| d.to_string())
    }) else {
        return Vec::new();
    };
    let workload = default_workload(&plan);
    let cost = cluster.cost_model();
    let mut a = Annotated::new(plan, cluster, cost, shapes, workload, Pins::default());
    braid_passes::passes::PassManager::new()
        .run(&mut a, |_, _| {})
        .unwrap();
    let spans = PlanSpans {
        run: program.run.as_ref().unwrap().span,
        models: program
            .models
            .iter()
            .filter(|m| m.file == program.root)
            .map(|m| (m.name.clone(), m.name_span))
            .collect(),
    };
    memory_diagnostics(&a, &spans)
}

#[test]
fn fixtures_match_expectations_and_snapshots() {
    let mut failures = Vec::new();
    for path in fixtures() {
        let (expected, actual, rendered) = check_fixture(&path);
        if expected != actual {
            failures.push(format!(
                "{}:\n  expected {:?}\n  actual   {:?}",
                path.display(),
                expected,
                actual
            ));
        }
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        insta::with_settings!({snapshot_path => "ui/snapshots", prepend_module_to_snapshot => false, omit_expression => true}, {
            insta::assert_snapshot!(stem, rendered);
        });
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_code_has_a_fixture_a_snapshot_and_docs() {
    let docs = std::fs::read_to_string("docs/diagnostics.md").unwrap_or_default();
    let mut missing = Vec::new();
    for code in Code::ALL {
        let stem = format!("{}-{}", code.as_str(), code.name());
        let fixture = PathBuf::from(format!("tests/ui/{stem}.rlhf"));
        match std::fs::read_to_string(&fixture) {
            Err(_) => missing.push(format!("{code}: no fixture {}", fixture.display())),
            Ok(text) => {
                if !expectations(&text).iter().any(|(_, c)| c == code.as_str()) {
                    missing.push(format!("{code}: fixture expects no {code}"));
                }
            }
        }
        if !Path::new(&format!("tests/ui/snapshots/{stem}.snap")).exists() {
            missing.push(format!(
                "{code}: no snapshot tests/ui/snapshots/{stem}.snap"
            ));
        }
        if !docs.contains(&format!("## {} {}", code.as_str(), code.name())) {
            missing.push(format!(
                "{code}: no section `## {} {}` in docs/diagnostics.md",
                code.as_str(),
                code.name()
            ));
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}
