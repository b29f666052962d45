//! End-to-end tests of `braid plan` and `braid sim FILE`: every example planned (text, JSON,
//! DOT) and simulated for `cpu`, one H100 and 32×8 H800s; output byte-identical on rerun and
//! snapshotted; bad flags are errors; a plan that does not fit is `E0504` before anything runs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

const EXAMPLES: [&str; 3] = ["quickstart", "ppo_tiny", "grpo_math"];
const CLUSTERS: [&str; 3] = ["cpu", "1x1xH100", "32x8xH800"];

fn braid(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_braid"))
        .args(args)
        .output()
        .expect("braid runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn ok(args: &[&str]) -> String {
    let (code, out, err) = braid(args);
    assert_eq!(code, 0, "braid {args:?} failed:\n{err}");
    out
}

#[test]
fn plan_every_example_on_every_cluster_deterministically() {
    for ex in EXAMPLES {
        let file = format!("examples/{ex}.rlhf");
        for cluster in CLUSTERS {
            let text = ok(&["plan", &file, "--cluster", cluster]);
            assert_eq!(
                text,
                ok(&["plan", &file, "--cluster", cluster]),
                "{ex} on {cluster}: not deterministic"
            );
            for call in ["generate(", "train("] {
                assert!(text.contains(call), "{ex} on {cluster}: no {call}\n{text}");
            }
            assert!(text.contains("memory per device") && text.contains("predicted iteration"));
            insta::assert_snapshot!(format!("plan_{ex}_{cluster}"), text);
            let json = ok(&["plan", &file, "--cluster", cluster, "--format", "json"]);
            let v: serde_json::Value = serde_json::from_str(&json).unwrap();
            assert!(v["calls"].as_array().is_some_and(|c| !c.is_empty()));
            let dot = ok(&["plan", &file, "--cluster", cluster, "--format", "dot"]);
            assert!(dot.starts_with("digraph") && dot.contains("xlabel"));
        }
    }
}

#[test]
fn dump_after_and_disable_pass() {
    let file = "examples/ppo_tiny.rlhf";
    let after_place = ok(&[
        "plan",
        file,
        "--cluster",
        "1x8xH100",
        "--dump-after",
        "place",
    ]);
    assert!(after_place.contains("passes: place\n"), "{after_place}");
    let without = ok(&[
        "plan",
        file,
        "--cluster",
        "1x8xH100",
        "--disable-pass",
        "speculate",
        "--disable-pass",
        "sample-split",
    ]);
    assert!(without.contains("passes: place, microbatch-interleave, reshard-insert\n"));
    assert!(!without.contains("speculate:"));
    let (code, _, err) = braid(&["plan", file, "--disable-pass", "fuse"]);
    assert_eq!(code, 2);
    assert!(err.contains("unknown pass `fuse`"), "{err}");
    let (code, _, err) = braid(&["plan", file, "--dump-after", "nope"]);
    assert_eq!(code, 2);
    assert!(err.contains("unknown pass `nope`"), "{err}");
}

#[test]
fn a_plan_that_does_not_fit_is_e0504() {
    let (code, out, err) = braid(&["plan", "tests/ui/E0504-plan-exceeds-memory.rlhf"]);
    assert_eq!(code, 1, "{out}");
    assert!(err.contains("E0504") && err.contains("train(policy)") && err.contains("bytes"));
    assert!(out.is_empty());
}

#[test]
fn sim_every_example_with_baselines_and_traces() {
    let dir = std::env::temp_dir().join(format!("braid-sim-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for ex in EXAMPLES {
        let file = format!("examples/{ex}.rlhf");
        for cluster in CLUSTERS {
            let trace = dir.join(format!("{ex}-{cluster}.json"));
            let svg = dir.join(format!("{ex}-{cluster}.svg"));
            let args = [
                "sim",
                &file,
                "--cluster",
                cluster,
                "--iterations",
                "1",
                "--gen-lengths",
                "lognormal:3,0.8,64",
                "--trace",
                trace.to_str().unwrap(),
                "--svg",
                svg.to_str().unwrap(),
            ];
            let text = ok(&args);
            for system in [
                "deepspeed-chat",
                "real-heuristic",
                "braid without fusion",
                "braid ",
            ] {
                assert!(
                    text.contains(system),
                    "{ex} on {cluster}: no {system}\n{text}"
                );
            }
            assert!(text.contains("fusion gain") && text.contains("gain of each pass"));
            let t: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
            assert!(t.is_object() || t.is_array());
            assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));
            if cluster != "32x8xH800" {
                assert_eq!(text, ok(&args), "{ex} on {cluster}: sim not deterministic");
            }
            insta::assert_snapshot!(format!("sim_{ex}_{cluster}"), text);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `fuse GEN -> SEL…` and `interleave SEL, SEL` pins in a program's `schedule` reach the
/// planner: only the listed consumers stream, and the listed trainings are fused (or a note
/// says why they cannot be).
#[test]
fn schedule_fuse_and_interleave_pins_steer_the_plan() {
    let dir = std::env::temp_dir().join(format!("braid-pins-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let program = |schedule: &str| {
        format!(
            r#"use std::ppo
model actor = hf("llama-7b") {{ train: adamw(lr: 1e-6) }}
model critic = hf("llama-7b") {{
  head: value
  train: adamw(lr: 1e-6)
}}
model rm = hf("llama-7b") {{ head: score }}
dataset prompts = synthetic::letters(count: 4096)
run ppo(actor, prompts, reward_model: rm, critic: critic) {{
  steps: 10
  batch: 128
  max_new_tokens: 512
  minibatches: 2
}}
{schedule}
"#
        )
    };
    let plain = dir.join("plain.rlhf");
    std::fs::write(&plain, program("")).unwrap();
    let pinned = dir.join("pinned.rlhf");
    std::fs::write(
        &pinned,
        program("schedule {\n  fuse generate -> logprobs(ref), score\n  interleave train(policy), train(critic)\n}"),
    )
    .unwrap();
    let args = |f: &std::path::Path| ok(&["plan", f.to_str().unwrap(), "--cluster", "2x8xH100"]);
    let free = args(&plain);
    let text = args(&pinned);
    assert_ne!(free, text);
    assert!(!free.contains("`fuse"), "{free}");
    assert!(
        text.contains("not listed in the `fuse generate(actor)` pin"),
        "{text}"
    );
    assert_eq!(
        text.matches("(listed in the `fuse` pin)").count(),
        2,
        "{text}"
    );
    assert!(
        text.contains("microbatch-interleave: train(actor)") || text.contains("`interleave` pin"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The planned memory of `train(policy)` on one H100 by role (`braid plan --format json`), and
/// its number of micro-batches.
fn train_memory(program: &str, name: &str) -> (serde_json::Value, u64) {
    let dir = std::env::temp_dir().join(format!("braid-plan-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("p.rlhf");
    std::fs::write(&file, program).unwrap();
    let text = ok(&[
        "plan",
        file.to_str().unwrap(),
        "--cluster",
        "1x1xH100",
        "--format",
        "json",
    ]);
    let _ = std::fs::remove_dir_all(&dir);
    let plan: serde_json::Value = serde_json::from_str(&text).unwrap();
    let call = plan["calls"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["call"] == "train(policy)")
        .unwrap_or_else(|| panic!("no train(policy) in {text}"))
        .clone();
    let mb = call["placement"]["microbatches"].as_u64().unwrap();
    (call["memory"].clone(), mb)
}

/// The plan counts what a model really holds, by role: a trained bf16 model 2 bytes of weights,
/// 2 + 4 of gradients (the f32 accumulator) and 8 + 4 of optimizer state (the f32 masters) per
/// parameter; an f32 model 4, 4 and 8; activations take twice bf16's bytes in f32; and
/// `gradient_checkpointing` keeps each layer's input instead of its activations.
#[test]
fn planned_memory_follows_dtype_and_checkpointing() {
    // Planned without the files: the directory's name is the Qwen2.5-0.5B preset.
    let base = std::fs::read_to_string("examples/grpo_math.rlhf").unwrap();
    assert!(base.contains("dtype: bf16"));
    let (bf16, mb16) = train_memory(&base, "bf16");
    let (f32, mb32) = train_memory(&base.replace("dtype: bf16", "dtype: f32"), "f32");
    let (ckpt, mbck) = train_memory(
        &base.replace("grad_clip: 1.0", "grad_clip: 1.0\n  gradient_checkpointing"),
        "ckpt",
    );
    let get = |m: &serde_json::Value, k: &str| m[k].as_f64().unwrap();
    let n = get(&bf16, "weights") / 2.0;
    for (m, per) in [(&bf16, [2.0, 6.0, 12.0]), (&f32, [4.0, 4.0, 8.0])] {
        for (k, b) in ["weights", "gradients", "optimizer"].iter().zip(per) {
            assert_eq!(get(m, k), b * n, "{k}: {m}");
        }
    }
    // Activations of the whole mini-batch (per micro-batch × micro-batches).
    let act = |m: &serde_json::Value, mb: u64| get(m, "activations") * mb as f64;
    let ratio = act(&f32, mb32) / act(&bf16, mb16);
    assert!((ratio - 2.0).abs() < 0.01, "f32/bf16 activations {ratio}");
    assert!(
        act(&ckpt, mbck) < 0.2 * act(&bf16, mb16),
        "checkpointed {ckpt} ({mbck} micro-batches) vs {bf16} ({mb16})"
    );
}

/// `braid plan FILE --emit PLAN.json` writes the executable plan; `braid plan PLAN.json` shows
/// it exactly as `braid plan FILE` did; a plan file edited into inconsistency, truncated, or of
/// another version is refused (exit 1) by `braid plan` and `braid run` with a message naming
/// the file and the field.
#[test]
fn plan_files_show_as_planned_and_bad_ones_are_refused() {
    let dir = std::env::temp_dir().join(format!("braid-plan-json-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for ex in EXAMPLES {
        let file = format!("examples/{ex}.rlhf");
        for cluster in CLUSTERS {
            let out = dir.join(format!("{ex}-{cluster}.json"));
            let text = ok(&[
                "plan",
                &file,
                "--cluster",
                cluster,
                "--emit",
                out.to_str().unwrap(),
            ]);
            assert_eq!(
                ok(&["plan", out.to_str().unwrap()]),
                text,
                "{ex} on {cluster}"
            );
        }
    }
    let good = dir.join("quickstart-cpu.json");
    let text = std::fs::read_to_string(&good).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let edits: Vec<(&str, serde_json::Value, &str)> = vec![
        (
            "version",
            {
                let mut x = v.clone();
                x["version"] = (braid_ir::exec_plan::PLAN_VERSION + 1).into();
                x
            },
            "version",
        ),
        (
            "dtype",
            {
                let mut x = v.clone();
                x["plan"]["models"][0]["dtype"] = "f8".into();
                x
            },
            "plan.models[0].dtype",
        ),
        (
            "steps",
            {
                let mut x = v.clone();
                x["plan"]["steps"] = 0.into();
                x
            },
            "plan.steps",
        ),
        (
            "tp",
            {
                let mut x = v.clone();
                x["decisions"]["placements"]["1"]["tp"] = 2.into();
                x
            },
            "decisions.placements.1",
        ),
    ];
    for (what, value, field) in edits {
        let path = dir.join(format!("bad-{what}.json"));
        std::fs::write(&path, value.to_string()).unwrap();
        for cmd in [
            vec!["plan", path.to_str().unwrap()],
            vec![
                "run",
                path.to_str().unwrap(),
                "--run-dir",
                dir.join("r").to_str().unwrap(),
            ],
        ] {
            let (code, _, err) = braid(&cmd);
            assert_eq!(code, 1, "{what} {cmd:?}: {err}");
            assert!(
                err.contains(path.to_str().unwrap()) && err.contains(field),
                "{what}: {err}"
            );
        }
    }
    let truncated = dir.join("truncated.json");
    std::fs::write(&truncated, &text[..text.len() / 2]).unwrap();
    let (code, _, err) = braid(&["plan", truncated.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("not JSON"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `braid sim study`: the ReaL figure's fixtures simulate; the measured speed-ups come from the
/// manifest (ReaL 0.917 PFLOP/s over the heuristic's 0.684: 1.34×), the summary lines are
/// printed — over all settings and over the held-out ones — JSON carries the per-system
/// results; a bad manifest names its file.
#[test]
fn sim_study_sets_simulated_beside_measured_speed_ups() {
    let manifest = "tests/fixtures/real/study.json";
    let only = "7B gen 128 on";
    let text = ok(&["sim", "study", manifest, "--only", only]);
    assert!(text.contains("scale-actor 7B gen 128 on 8 *"), "{text}");
    assert!(text.contains("scale-both 7B gen 128 on 16 "), "{text}");
    assert!(text.contains("1.34x"), "{text}");
    for line in [
        "compared with the simulated `real-symmetric`",
        "all settings: speed-up of Braid's plan (no fusion) over ReaL's heuristic within a quarter of the measured in",
        "held-out settings: speed-up of Braid's plan (no fusion) over ReaL's heuristic within a quarter of the measured in",
        "all settings: speed-up over DeepSpeed-Chat within a quarter of the measured in",
        "never slower than the simulated `real-symmetric` (3 settings)",
    ] {
        assert!(text.contains(line), "no {line:?}\n{text}");
    }
    let json = ok(&[
        "sim",
        "study",
        manifest,
        "--only",
        "scale-actor 7B gen 128",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["heuristic"], "real-symmetric");
    assert!(v["engine"]["host_decode"]["layer"].as_f64().unwrap() > 0.0);
    let row = &v["rows"][0];
    assert_eq!(row["calibration"], true);
    assert_eq!(row["systems"].as_array().map(Vec::len), Some(6));
    let measured = row["over_heuristic"][1].as_f64().unwrap();
    assert!((measured - 0.917 / 0.684).abs() < 1e-9);
    // The implied measured iteration is the counted FLOPs over the measured throughput.
    let flops = row["flops"].as_f64().unwrap();
    let real_s = row["measured_seconds"]["real"].as_f64().unwrap();
    assert!((real_s - flops / 0.917e15).abs() < 1e-6 * real_s);
    let dir = std::env::temp_dir().join(format!("braid-study-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.json");
    std::fs::write(&bad, "{\"title\": 1}").unwrap();
    let (code, _, err) = braid(&["sim", "study", bad.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(
        err.contains("bad.json") && err.contains("not a study manifest"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The study's committed compute efficiency is what `braid sim study --calibrate` fits on its
/// calibration settings: a copy of the fixtures, calibrated afresh, gets the same figure, and
/// every other field of the manifest is left as it was.
#[test]
fn the_study_engine_is_what_calibration_fits() {
    let src = std::path::Path::new("tests/fixtures/real");
    let dir = std::env::temp_dir().join(format!("braid-study-calibrate-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    let manifest = dir.join("study.json");
    let committed: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    let mut stale = committed.clone();
    stale["engine"]["compute_efficiency"] = serde_json::json!(0.5);
    std::fs::write(&manifest, serde_json::to_string_pretty(&stale).unwrap()).unwrap();
    let out = ok(&["sim", "study", manifest.to_str().unwrap(), "--calibrate"]);
    assert!(out.contains("compute efficiency"), "{out}");
    let fitted: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    assert_eq!(fitted, committed, "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}
