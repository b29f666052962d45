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

/// Model shapes for fixtures: a `config.json` beside the fixture, else a preset named by the
/// directory.
struct FixtureConfigs;

impl braid_driver::ModelConfigs for FixtureConfigs {
    fn shape(&self, dir: &str) -> Result<braid_cost::cost::ModelShape, String> {
        let path = Path::new("tests/ui").join(dir).join("config.json");
        if let Ok(text) = std::fs::read_to_string(&path) {
            let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
            return braid_cost::cost::ModelShape::from_hf_config(dir, &json)
                .map_err(|e| e.to_string());
        }
        braid_driver::Presets.shape(dir)
    }
}

/// Checks and plans a fixture the way `braid plan` does (the driver: its run planned on its
/// `cluster` block, default `cpu`), so that the planner's `E05xx` diagnostics show too.
fn check_fixture(path: &Path) -> (Expectations, Expectations, String) {
    let name = path.to_string_lossy().replace('\\', "/");
    let text = std::fs::read_to_string(path).unwrap();
    let compiled = braid_driver::compile(
        &name,
        &text,
        &Disk,
        &FixtureConfigs,
        &braid_driver::Options::default(),
        &mut |_, _| {},
    );
    assert!(
        compiled.internal.is_none(),
        "{name}: {:?}",
        compiled.internal
    );
    let root = compiled.program.root;
    let mut actual = BTreeSet::new();
    let mut rendered = String::new();
    for d in &compiled.diagnostics {
        let span = d.span();
        assert!(!span.is_dummy(), "{name}: {} has no span", d.code);
        assert!(d.help.is_some(), "{name}: {} has no help line", d.code);
        if span.file == root {
            let line = compiled
                .sources
                .get(root)
                .unwrap()
                .line_col(span.start)
                .line;
            actual.insert((line, d.code.as_str().to_string()));
        } else {
            actual.insert((0, format!("{}@{}", d.code, compiled.sources.location(span))));
        }
        rendered.push_str(&render_terminal(
            d,
            &compiled.sources,
            RenderOptions {
                color: false,
                width: 100,
            },
        ));
        rendered.push('\n');
    }
    (expectations(&text), actual, rendered)
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
