//! End-to-end tests of `braid sim pipeline`: the built binary on the spec files in
//! `tests/fixtures/sim/`.

use std::path::PathBuf;
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/sim")
        .join(name)
}

fn braid(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_braid"))
        .args(args)
        .output()
        .expect("runs braid")
}

fn sim_pipeline(name: &str) -> Output {
    let path = fixture(name);
    braid(&["sim", "pipeline", path.to_str().expect("utf-8 path")])
}

#[test]
fn solves_the_published_actor8_critic4_problem_at_its_lower_bound() {
    let out = sim_pipeline("rlhfuse_actor8_critic4.json");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(v["latency"], 372);
    assert_eq!(v["lower_bound"], 372);
    assert_eq!(v["serial_1f1b_latency"], 477);
    assert!(v["peak_memory"].as_u64().expect("peak") >= 1);
    let schedule = v["schedule"].as_array().expect("schedule");
    assert_eq!(schedule.len(), 8);
    // Every device runs 16 actor micro-batches and 8 of one critic replica, fwd and bwd.
    for device in schedule {
        let tasks = device["tasks"].as_array().expect("tasks");
        assert_eq!(tasks.len(), 2 * 16 + 2 * 8);
        let end = tasks.last().expect("nonempty")["end"]
            .as_u64()
            .expect("end");
        assert!(end <= 372);
        assert!(["fwd", "bwd"].contains(&tasks[0]["kind"].as_str().expect("kind")));
    }
}

#[test]
fn output_is_byte_identical_across_runs() {
    let a = sim_pipeline("rlhfuse_actor8_critic4.json");
    let b = sim_pipeline("rlhfuse_actor8_critic4.json");
    assert!(a.status.success());
    assert_eq!(a.stdout, b.stdout);
}

#[test]
fn bad_specs_are_reported_with_the_file_name_and_exit_1() {
    for (name, needle) in [
        (
            "bad_pp.json",
            "models[1].pp must divide `stages` (8), got 3",
        ),
        ("truncated.json", "EOF while parsing"),
        ("does_not_exist.json", "No such file"),
    ] {
        let out = sim_pipeline(name);
        assert_eq!(out.status.code(), Some(1), "{name}");
        let err = String::from_utf8_lossy(&out.stderr);
        let path = fixture(name);
        let prefix = format!("error: {}: ", path.display());
        assert!(err.starts_with(&prefix), "{name}: {err}");
        assert!(err.contains(needle), "{name}: {err}");
        assert!(!err.contains("panicked"), "{name}: {err}");
        assert!(out.stdout.is_empty());
    }
}

/// Profiled figures are fractional: durations and memory per micro-batch are real numbers,
/// put on the finest decimal grid that holds them (hundredths here), and the schedule comes
/// back in the spec's units.
#[test]
fn real_valued_durations_and_memory_are_solved_in_their_units() {
    let out = sim_pipeline("fractional.json");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(v["grid"]["time_ticks_per_unit"], 100);
    assert_eq!(v["grid"]["memory_ticks_per_unit"], 100);
    assert_eq!(v["grid"]["rounded"], false);
    let f = |k: &str| v[k].as_f64().expect(k);
    assert!(f("lower_bound") <= f("latency") && f("latency") <= f("serial_1f1b_latency"));
    // Each subtask lasts its model's forward or backward; memory is a sum of 1.95s and 1.2s.
    let durations = [[0.37, 0.74], [0.3, 0.6]];
    for device in v["schedule"].as_array().expect("schedule") {
        for t in device["tasks"].as_array().expect("tasks") {
            let model = t["model"].as_u64().expect("model") as usize;
            let k = usize::from(t["kind"] == "bwd");
            let d = t["end"].as_f64().expect("end") - t["start"].as_f64().expect("start");
            assert!((d - durations[model][k]).abs() < 1e-9, "{t}");
        }
        let peak = device["peak_memory"].as_f64().expect("peak");
        let hundredths = (peak * 100.0).round();
        assert!((peak * 100.0 - hundredths).abs() < 1e-6, "{peak}");
        assert!(peak >= 1.2, "{peak}");
    }
    let bad = std::env::temp_dir().join(format!("braid-pipeline-neg-{}.json", std::process::id()));
    std::fs::write(
        &bad,
        std::fs::read_to_string(fixture("fractional.json"))
            .unwrap()
            .replace("\"fwd\": 0.3,", "\"fwd\": -0.3,"),
    )
    .unwrap();
    let out = braid(&["sim", "pipeline", bad.to_str().unwrap()]);
    let _ = std::fs::remove_file(&bad);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("models[1].fwd must be a positive number"),
        "{err}"
    );
}
