//! `braid calibrate` and `braid report --against-sim` end to end on one CPU process: the
//! profile calibrate writes is one `braid plan`, `braid sim` and `braid run` take with
//! `--profile`, a profile for another device kind or a malformed one is refused naming what is
//! wrong, and a run's report sets its measured times beside the simulator's prediction.
//! (`braid launch … calibrate` on two ranks is in tests/distributed.rs.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::Tmp;
use std::path::Path;
use std::process::{Command, Output};

fn braid(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_braid"))
        .args(args)
        .output()
        .expect("braid runs")
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "braid failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A quick calibration (short timings: the constants are noisy, their shape is what is checked).
fn calibrate(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("cpu.json");
    let out = braid(&["calibrate", "--min-seconds", "0.01", "-o", s(&path)]);
    let text = ok(&out);
    assert!(text.contains("matmul"), "{text}");
    // How closely the fitted model prices its own timings, per kind of pass.
    for kind in [
        "decode steps (",
        "prefills (",
        "forwards (",
        "training micro-batches (",
    ] {
        assert!(text.contains(kind), "no `{kind}` in:\n{text}");
    }
    path
}

#[test]
fn calibrate_writes_a_profile_that_plan_sim_and_run_take() {
    let dir = Tmp::new("calibrate", "profile");
    let path = calibrate(&dir);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(v["format"], "braid-device-profile");
    assert_eq!(v["version"], 1);
    let d = &v["device"];
    assert_eq!(d["kind"], "cpu");
    // Measured rates replace the datasheet's, and are achieved rates (efficiency 1).
    assert_eq!(d["compute_efficiency"], 1.0);
    let table = d["matmul"].as_array().unwrap();
    assert!(table.len() >= 4, "{table:?}");
    for r in table {
        assert!(r["flops"].as_f64().unwrap() > 0.0, "{r:?}");
    }
    let peak = d["peak_flops"].as_f64().unwrap();
    let best = table
        .iter()
        .map(|r| r["flops"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert_eq!(peak, best);
    assert!(d["mem_bandwidth"].as_f64().unwrap() > 1e8);
    // The passes' time beyond the roofline, fitted to the overhead terms: none negative (a
    // term fitted below zero is zero), and the tiny models' passes are not free.
    let o = d["overheads"].as_object().unwrap();
    assert!(o.len() >= 10, "{o:?}");
    for (k, t) in o {
        let t = t.as_f64().unwrap();
        assert!(t.is_finite() && t >= 0.0, "{k}: {t}");
    }
    assert!(o.values().any(|t| t.as_f64().unwrap() > 0.0), "{o:?}");
    let m = v["measured"]["timings"].as_object().unwrap();
    assert!(
        m.contains_key("matmul") && m.contains_key("passes"),
        "{m:?}"
    );

    // The profile prices the plan: the same program's plan differs from the datasheet one's.
    let with = ok(&braid(&[
        "plan",
        "examples/quickstart.rlhf",
        "--profile",
        s(&path),
    ]));
    let without = ok(&braid(&["plan", "examples/quickstart.rlhf"]));
    assert_ne!(with, without);
    let sim = ok(&braid(&[
        "sim",
        "examples/quickstart.rlhf",
        "--profile",
        s(&path),
        "--iterations",
        "1",
    ]));
    assert!(sim.contains("braid"), "{sim}");
    // A run takes it too, and records which device entry priced its plan.
    let run_dir = dir.join("run");
    ok(&braid(&[
        "run",
        "examples/quickstart.rlhf",
        "--steps",
        "1",
        "--run-dir",
        s(&run_dir),
        "--profile",
        s(&path),
    ]));
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("plan.json")).unwrap()).unwrap();
    assert_eq!(plan["device"]["peak_flops"].as_f64().unwrap(), peak);

    // A CPU profile does not price a GPU cluster.
    let out = braid(&[
        "sim",
        "examples/quickstart.rlhf",
        "--profile",
        s(&path),
        "--cluster",
        "1x1xH100",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let e = stderr(&out);
    assert!(
        e.contains("--profile") && e.contains("cpu") && e.contains("H100"),
        "{e}"
    );
    // A plan file was priced when it was planned.
    let plan_file = dir.join("plan.json");
    ok(&braid(&[
        "plan",
        "examples/quickstart.rlhf",
        "--emit",
        s(&plan_file),
    ]));
    let out = braid(&["run", s(&plan_file), "--profile", s(&path), "--steps", "1"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--profile"), "{}", stderr(&out));
}

#[test]
fn a_bad_profile_is_refused_naming_the_file() {
    let dir = Tmp::new("calibrate", "bad");
    let cases = [
        ("notjson.json", "{ not json".to_string(), ""),
        (
            "format.json",
            r#"{"format": "something-else", "version": 1}"#.to_string(),
            "braid-device-profile",
        ),
        (
            "version.json",
            r#"{"format": "braid-device-profile", "version": 99, "device": {}}"#.to_string(),
            "version",
        ),
    ];
    for (name, text, says) in cases {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        let out = braid(&["sim", "examples/quickstart.rlhf", "--profile", s(&path)]);
        let e = stderr(&out);
        assert!(!out.status.success(), "{name}: accepted");
        assert!(e.contains(name) && e.contains(says), "{name}: {e}");
        assert!(!e.contains("panicked"), "{name}: {e}");
    }
    // A well-formed profile whose constants cannot be (a negative bandwidth).
    let good = calibrate(&dir);
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&good).unwrap()).unwrap();
    v["device"]["mem_bandwidth"] = serde_json::json!(-1.0);
    let path = dir.join("negative.json");
    std::fs::write(&path, v.to_string()).unwrap();
    let out = braid(&["plan", "examples/quickstart.rlhf", "--profile", s(&path)]);
    let e = stderr(&out);
    assert!(!out.status.success(), "accepted: {e}");
    assert!(
        e.contains("negative.json") && e.contains("mem_bandwidth"),
        "{e}"
    );
    let out = braid(&[
        "sim",
        "examples/quickstart.rlhf",
        "--profile",
        "/no/such/profile.json",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("/no/such/profile.json"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn report_against_sim_sets_measured_beside_predicted() {
    let dir = Tmp::new("calibrate", "against");
    let profile = calibrate(&dir);
    let fused = dir.join("fused");
    let unfused = dir.join("unfused");
    for (run_dir, extra) in [(&fused, None), (&unfused, Some("--no-fuse"))] {
        let mut args = vec![
            "run",
            "examples/quickstart.rlhf",
            "--steps",
            "3",
            "--run-dir",
            s(run_dir),
            "--profile",
            s(&profile),
            "--gen-lengths",
            "fixed:8",
        ];
        args.extend(extra);
        ok(&braid(&args));
    }
    let text = ok(&braid(&[
        "report",
        s(&fused),
        "--against-sim",
        "--unfused",
        s(&unfused),
    ]));
    for needle in [
        "measured",
        "predicted",
        "iteration",
        "training",
        "gain of streaming",
    ] {
        assert!(text.contains(needle), "no `{needle}` in:\n{text}");
    }
    let json = ok(&braid(&[
        "report",
        s(&fused),
        "--against-sim",
        "--unfused",
        s(&unfused),
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    // The first step warms up and is left out.
    assert_eq!(v["run"]["steps"], 2);
    // Whether the two runs executed the same plan: not where the run streams, and said so
    // where they did (a run against itself).
    let plan = |d: &std::path::Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("plan.json")).unwrap()).unwrap()
    };
    let cut_per_sample = |d: &std::path::Path| {
        plan(d)["decisions"]["streams"]
            .as_object()
            .is_some_and(|m| m.values().any(|s| s["cut"] == "sample"))
    };
    // On one rank the quickstart streams its per-sample calls; without fusion nothing does.
    assert!(cut_per_sample(&fused) && !cut_per_sample(&unfused));
    assert_eq!(v["same_plan"], serde_json::json!(false), "{json}");
    let itself = ok(&braid(&[
        "report",
        s(&fused),
        "--against-sim",
        "--unfused",
        s(&fused),
    ]));
    assert!(itself.contains("executed the same plan"), "{itself}");
    // A run against itself: its training, priced alike, measured the same.
    assert!(
        itself.contains("(1.00x): how far the machine's speed moved"),
        "{itself}"
    );
    // Against the run without streaming: the measured trainings' ratio, where both plans price
    // the training alike.
    let (tf, tu) = (
        v["run"]["predicted"]["training"].as_f64().unwrap(),
        v["unfused"]["predicted"]["training"].as_f64().unwrap(),
    );
    if (tu / tf - 1.0).abs() < 1e-9 {
        let want = v["unfused"]["measured"]["training"].as_f64().unwrap()
            / v["run"]["measured"]["training"].as_f64().unwrap();
        let got = v["training_control"].as_f64().unwrap();
        assert!((got - want).abs() < 1e-9, "{got} vs {want}");
    } else {
        assert!(v["training_control"].is_null(), "{json}");
    }
    assert!(!text.contains("executed the same plan"), "{text}");
    let metrics = std::fs::read_to_string(fused.join("metrics.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mean_prompt = rows[1..]
        .iter()
        .map(|r| r["prompt_length"].as_f64().unwrap())
        .sum::<f64>()
        / (rows.len() - 1) as f64;
    assert_eq!(v["run"]["prompt_len"], mean_prompt.round() as u64);
    for run in ["run", "unfused"] {
        for side in ["measured", "predicted"] {
            for stage in ["iteration", "generation", "training"] {
                let t = v[run][side][stage].as_f64().unwrap();
                assert!(t > 0.0 && t < 60.0, "{run}.{side}.{stage} = {t}");
            }
        }
        let m = v[run]["measured"]["iteration"].as_f64().unwrap();
        let p = v[run]["predicted"]["iteration"].as_f64().unwrap();
        let err = v[run]["iteration_error"].as_f64().unwrap();
        assert!((err - (p / m - 1.0)).abs() < 1e-9, "{err} vs {p}/{m}");
    }
    // Inference after the generation, measured as the simulator counts it: from the end of
    // the generation to the end of the rollout phase, recorded per step.
    let mean_of = |k: &str| {
        rows[1..]
            .iter()
            .map(|r| r[k].as_f64().unwrap())
            .sum::<f64>()
            / (rows.len() - 1) as f64
    };
    for r in &rows {
        let (a, roll) = (
            r["time/after_generate"].as_f64().unwrap(),
            r["time/rollout"].as_f64().unwrap(),
        );
        assert!(a >= 0.0 && a <= roll, "{r}");
    }
    let after = v["run"]["measured"]["inference_after_generation"]
        .as_f64()
        .unwrap();
    assert!(
        (after - mean_of("time/after_generate")).abs() < 1e-9,
        "{after}"
    );
    assert_eq!(v["run"]["after_generation_recorded"], true);
    // A run recorded without it: the rollout phase less the generation, and the text says so.
    let older = dir.join("older");
    std::fs::create_dir_all(&older).unwrap();
    for f in ["plan.json", "prompt-lengths.txt"] {
        std::fs::copy(fused.join(f), older.join(f)).unwrap();
    }
    let stripped: Vec<String> = rows
        .iter()
        .map(|r| {
            let mut r = r.clone();
            r.as_object_mut().unwrap().remove("time/after_generate");
            r.to_string()
        })
        .collect();
    std::fs::write(older.join("metrics.jsonl"), stripped.join("\n") + "\n").unwrap();
    let text = ok(&braid(&["report", s(&older), "--against-sim"]));
    assert!(
        text.contains("recorded before `time/after_generate`"),
        "{text}"
    );
    let o: serde_json::Value = serde_json::from_str(&ok(&braid(&[
        "report",
        s(&older),
        "--against-sim",
        "--json",
    ])))
    .unwrap();
    let after = o["run"]["measured"]["inference_after_generation"]
        .as_f64()
        .unwrap();
    let expect = (mean_of("time/rollout") - mean_of("time/generate")).max(0.0);
    assert!((after - expect).abs() < 1e-9, "{after} vs {expect}");
    assert_eq!(o["run"]["after_generation_recorded"], false);
    let g = &v["streaming_gain"];
    let fm = v["run"]["measured"]["iteration"].as_f64().unwrap();
    let um = v["unfused"]["measured"]["iteration"].as_f64().unwrap();
    assert!((g["measured"].as_f64().unwrap() - um / fm).abs() < 1e-9);
    // Streaming cannot be predicted to slow the iteration: the unfused plan's prediction is
    // never the shorter.
    assert!(g["predicted"].as_f64().unwrap() >= 1.0 - 1e-9, "{g}");

    // `--trace` writes the simulated iteration of the run's plan, to set beside the run's own
    // timeline: every task of the plan's calls, the training among them.
    let trace = dir.join("sim-trace.json");
    ok(&braid(&[
        "report",
        s(&fused),
        "--against-sim",
        "--trace",
        s(&trace),
    ]));
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let spans: Vec<&serde_json::Value> = t["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .collect();
    for stage in ["generate", "train"] {
        assert!(
            spans.iter().any(|e| e["cat"] == stage),
            "no `{stage}` span in {spans:?}"
        );
    }
    // The report names what it cannot use.
    let out = braid(&["report", s(&dir.join("nothing")), "--against-sim"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("nothing"), "{}", stderr(&out));
}

#[test]
fn calibrate_refuses_options_it_cannot_honour() {
    let dir = Tmp::new("calibrate", "options");
    let path = dir.join("cpu.json");
    for (flag, value, says) in [
        (
            "--min-seconds",
            "0",
            "--min-seconds 0: must be a positive number",
        ),
        ("--min-seconds", "nan", "must be a positive number"),
        ("--rounds", "0", "--rounds 0: at least one round"),
    ] {
        let out = braid(&["calibrate", flag, value, "-o", s(&path)]);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{flag} {value}: {}",
            stderr(&out)
        );
        assert!(
            stderr(&out).contains(says),
            "{flag} {value}: {}",
            stderr(&out)
        );
        assert!(!path.exists(), "{flag} {value}: a profile was written");
    }
}
