//! `braid run` end to end: a short quickstart learns, PPO with four models runs, a run killed
//! with SIGKILL resumes without losing a completed step and ends with the same metrics as an
//! uninterrupted run, and bad inputs give errors that name the file.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::Tmp;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn braid(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_braid"))
        .args(args)
        .output()
        .expect("braid runs")
}

/// `braid run FILE --run-dir RUN_DIR`.
fn run_into(file: &Path, run_dir: &Path) -> Output {
    braid(&[
        "run",
        file.to_str().unwrap(),
        "--run-dir",
        run_dir.to_str().unwrap(),
    ])
}

/// Asserts that a command succeeded, showing its stderr otherwise.
fn ok(out: &Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A JSON array of numbers.
fn numbers(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn tmp(name: &str) -> Tmp {
    Tmp::new("run", name)
}

/// A run's metrics. With `BRAID_TEST_METRICS_DIR` set, each run's `metrics.jsonl` is also
/// copied there (named after the test's directory and the run's), so that two builds' numbers
/// can be compared line by line (`scripts/compare_metrics.py`).
fn metrics(run_dir: &Path) -> Vec<serde_json::Map<String, serde_json::Value>> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    if let Some(out) = std::env::var_os("BRAID_TEST_METRICS_DIR") {
        let name = |p: Option<&Path>| {
            p.and_then(|p| p.file_name())
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        // `tmp` names directories `braid-run-NAME-PID`.
        let test = name(run_dir.parent());
        let test = test
            .strip_prefix("braid-run-")
            .and_then(|t| t.rsplit_once('-'))
            .map_or(test.as_str(), |t| t.0)
            .to_string();
        let out = PathBuf::from(out);
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(
            out.join(format!("{test}-{}.jsonl", name(Some(run_dir)))),
            &text,
        )
        .unwrap();
    }
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .map(|v| v.as_object().unwrap().clone())
        .collect()
}

fn num(m: &serde_json::Map<String, serde_json::Value>, k: &str) -> f64 {
    m.get(k)
        .and_then(|v| v.as_f64())
        .unwrap_or_else(|| panic!("no `{k}` in {m:?}"))
}

/// The quickstart with fewer steps: its reward doubles in 20 steps (the full 60-step run is in
/// the README).
#[test]
fn quickstart_learns_and_leaves_a_loadable_checkpoint() {
    let dir = tmp("quick");
    let src = std::fs::read_to_string("examples/quickstart.rlhf")
        .unwrap()
        .replace("steps: 60", "steps: 20");
    let file = dir.join("quick.rlhf");
    std::fs::write(&file, src).unwrap();
    let run_dir = dir.join("run");
    let out = run_into(&file, &run_dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("step 20/20"), "{stderr}");
    // The planner's speculate decision reaches the engine (no pin in the quickstart).
    assert!(
        stderr.contains("speculation for generate(policy): "),
        "{stderr}"
    );
    // The run directory keeps the plan it ran: the speculate decision is in it.
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("plan.json")).unwrap()).unwrap();
    let spec = &plan["decisions"]["speculation"]["1"]["run"]["mode"];
    assert!(spec.is_string(), "{plan}");
    let m = metrics(&run_dir);
    assert_eq!(m.len(), 20);
    for (i, line) in m.iter().enumerate() {
        assert_eq!(num(line, "step"), (i + 1) as f64);
        for k in [
            "reward_mean",
            "reward_std",
            "kl",
            "policy/loss",
            "policy/grad_norm",
            "policy/entropy",
            "policy/clip_frac",
            "response_length",
            "tokens_per_s",
            "time/generate",
            "time/train",
        ] {
            assert!(num(line, k).is_finite(), "{k} in step {}", i + 1);
        }
    }
    let first: f64 = m[..5].iter().map(|l| num(l, "reward_mean")).sum::<f64>() / 5.0;
    let last: f64 = m[15..].iter().map(|l| num(l, "reward_mean")).sum::<f64>() / 5.0;
    assert!(
        last >= 2.0 * first,
        "reward of the last 5 steps {last} is not twice that of the first 5 {first}"
    );
    // The final checkpoint is a Hugging Face directory that `braid generate` loads.
    let model = run_dir.join("checkpoints/step-000020/models/policy");
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(model.join(f).exists(), "{f} missing in {}", model.display());
    }
    let out = braid(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "abc ",
        "--max-new-tokens",
        "8",
        "--greedy",
    ]);
    ok(&out);
    // TensorBoard events and the HTML report.
    let tb: Vec<_> = std::fs::read_dir(run_dir.join("tensorboard"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(tb.len(), 1);
    assert!(std::fs::metadata(&tb[0]).unwrap().len() > 20 * 100);
    let out = braid(&["report", run_dir.to_str().unwrap()]);
    ok(&out);
    let html = std::fs::read_to_string(run_dir.join("report.html")).unwrap();
    assert!(html.contains("<title>reward_mean</title>") && html.contains("stage timeline"));
    assert!(html.matches("<svg").count() > 10);
    // The latest step's measured timeline (Chrome trace events) beside the simulated one.
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("timeline.json")).unwrap())
            .unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let cats: std::collections::BTreeSet<&str> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| e["cat"].as_str().unwrap())
        .collect();
    for stage in ["generate", "train"] {
        assert!(cats.contains(stage), "no {stage} span in {cats:?}");
    }
    for e in events.iter().filter(|e| e["ph"] == "X") {
        assert!(e["dur"].as_f64().unwrap() >= 0.0 && e["ts"].as_f64().unwrap() >= 0.0);
    }
    assert!(html.contains("Timeline of the latest step, measured"));
    assert!(html.contains("Timeline of one iteration, simulated"));
    let out = braid(&["report", dir.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("metrics.jsonl"));
    // A second run into the same directory is refused without --resume or --overwrite.
    let out = run_into(&file, &run_dir);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--resume"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// GRPO with GSPO's sequence-level loss (`variant: "gspo"`, the paper's clip ranges) learns the
/// quickstart task too, and reports the share of sequences it clips.
#[test]
fn grpo_with_the_gspo_loss_learns_the_quickstart_task() {
    let dir = tmp("gspo");
    let src = std::fs::read_to_string("examples/quickstart.rlhf")
        .unwrap()
        .replace(
            "steps: 60",
            "steps: 20, variant: \"gspo\", clip: 3e-4, clip_high: 4e-4",
        );
    assert!(
        src.contains("gspo"),
        "the quickstart's settings changed: {src}"
    );
    let file = dir.join("gspo.rlhf");
    std::fs::write(&file, src).unwrap();
    let run_dir = dir.join("run");
    let out = run_into(&file, &run_dir);
    ok(&out);
    let plan = std::fs::read_to_string(run_dir.join("plan.txt")).unwrap();
    assert!(
        plan.contains("token_mean") && plan.contains("sample bool"),
        "{plan}"
    );
    let m = metrics(&run_dir);
    assert_eq!(m.len(), 20);
    for line in &m {
        let clip = num(line, "policy/clip_frac");
        assert!((0.0..=1.0).contains(&clip), "{clip}");
        assert!(num(line, "policy/loss").is_finite());
    }
    let first: f64 = m[..5].iter().map(|l| num(l, "reward_mean")).sum::<f64>() / 5.0;
    let last: f64 = m[15..].iter().map(|l| num(l, "reward_mean")).sum::<f64>() / 5.0;
    assert!(
        last >= 1.5 * first,
        "GSPO: reward of the last 5 steps {last} is not 1.5 times that of the first 5 {first}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// PPO with a policy, a critic, a frozen reference and a reward model (a fixture trained to
/// score vowels): every model's numbers are recorded, only trained models are checkpointed, and
/// the reward rises.
#[test]
fn ppo_with_policy_critic_reference_and_reward_model_learns() {
    let dir = tmp("ppo");
    let run_dir = dir.join("run");
    let out = braid(&[
        "run",
        "examples/ppo_tiny.rlhf",
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--checkpoint-every",
        "0",
    ]);
    ok(&out);
    let m = metrics(&run_dir);
    let n = m.len();
    assert!(n >= 40, "{n} steps");
    for k in [
        "policy/loss",
        "critic/loss",
        "critic/grad_norm",
        "reward_mean",
        "kl",
    ] {
        assert!(num(&m[n - 1], k).is_finite(), "{k}");
    }
    let first: f64 = m[..5].iter().map(|l| num(l, "reward_mean")).sum::<f64>() / 5.0;
    let last: f64 = m[n - 5..]
        .iter()
        .map(|l| num(l, "reward_mean"))
        .sum::<f64>()
        / 5.0;
    assert!(
        last > 1.5 * first,
        "PPO's reward did not rise: {first} → {last}"
    );
    let ck = run_dir.join(format!("checkpoints/step-{n:06}"));
    assert!(ck.join("models/policy/model.safetensors").exists());
    assert!(ck.join("models/critic/model.safetensors").exists());
    assert!(ck.join("optimizer/critic.safetensors").exists());
    // Frozen models are not checkpointed: they are rebuilt from their source.
    assert!(!ck.join("models/rm").exists());
    assert!(!ck.join("models/ref").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

const SMALL: &str = r#"use std::grpo

model policy = tiny(vocab: "bytes", layers: 1, hidden: 32, heads: 2, seed: 5) {
  train: adamw(lr: 1e-3)
}

dataset prompts = synthetic::letters(count: 64, seed: 2)

fn vowels(s: Sample) -> float {
  count(s.completion, r"[aeiou]") / max(len(s.completion), 1)
}

run grpo(policy, prompts, reward: vowels) {
  steps: 10
  batch: 4
  group: 2
  max_new_tokens: 8
  checkpoint_every: 2
}
"#;

/// The metrics that must be reproduced exactly: everything but timings.
fn comparable(m: &[serde_json::Map<String, serde_json::Value>]) -> Vec<Vec<(String, String)>> {
    m.iter()
        .map(|line| {
            line.iter()
                // Timings, and the weights a layout holds (a generation replica when streaming),
                // are not results.
                .filter(|(k, _)| {
                    !k.starts_with("time/") && !k.starts_with("memory/") && *k != "tokens_per_s"
                })
                .map(|(k, v)| (k.clone(), v.to_string()))
                .collect()
        })
        .collect()
}

#[cfg(unix)]
#[test]
fn a_run_killed_mid_step_resumes_without_losing_a_completed_step() {
    let dir = tmp("kill");
    let file = dir.join("small.rlhf");
    std::fs::write(&file, SMALL).unwrap();
    // The uninterrupted run.
    let full = dir.join("full");
    let out = run_into(&file, &full);
    ok(&out);
    let want = comparable(&metrics(&full));
    assert_eq!(want.len(), 10);

    // The killed run: SIGKILL once five steps are recorded (during step 6 or its metrics).
    let killed = dir.join("killed");
    let mut child = Command::new(env!("CARGO_BIN_EXE_braid"))
        .args([
            "run",
            file.to_str().unwrap(),
            "--run-dir",
            killed.to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    loop {
        let n = std::fs::read_to_string(killed.join("metrics.jsonl"))
            .map(|t| t.lines().count())
            .unwrap_or(0);
        if n >= 5 {
            break;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the run ended before it could be killed: {status}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "the run made no progress"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    // Every completed checkpoint is whole: a `step-*` directory always has its state.
    let cks: Vec<PathBuf> = std::fs::read_dir(killed.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("step-")
        })
        .collect();
    assert!(!cks.is_empty());
    for ck in &cks {
        assert!(
            ck.join("state.json").exists(),
            "{} is incomplete",
            ck.display()
        );
        assert!(ck.join("models/policy/model.safetensors").exists());
    }
    let out = braid(&["run", "--resume", killed.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("resuming"), "{stderr}");
    let got = comparable(&metrics(&killed));
    assert_eq!(got.len(), 10, "steps lost or repeated");
    assert_eq!(
        got, want,
        "the resumed run's metrics differ from the uninterrupted run's"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_inputs_name_the_file() {
    let dir = tmp("bad");
    std::fs::write(
        dir.join("d.jsonl"),
        "{\"prompt\": \"hi\"}\n{\"text\": \"no prompt here\"}\n",
    )
    .unwrap();
    let prog = SMALL.replace(
        "synthetic::letters(count: 64, seed: 2)",
        "jsonl(\"d.jsonl\")",
    );
    let file = dir.join("bad.rlhf");
    std::fs::write(&file, prog).unwrap();
    let run_dir = dir.join("run");
    let out = run_into(&file, &run_dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("d.jsonl") && stderr.contains("line 2") && stderr.contains("`prompt`"),
        "{stderr}"
    );
    // A program with errors is not run.
    let broken = dir.join("broken.rlhf");
    std::fs::write(&broken, SMALL.replace("reward: vowels", "reward: vowel")).unwrap();
    let out = run_into(&broken, &run_dir);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("E0"));
    // Resuming something that is not a run directory.
    let out = braid(&["run", "--resume", dir.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("plan.json"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `speculate` pin reaches the engine: with n-gram drafts, sampled text is drawn exactly as
/// without speculation (docs/runtime.md), so the whole run computes the same numbers.
#[test]
fn a_speculate_pin_changes_speed_not_results() {
    let dir = tmp("spec");
    let plain = dir.join("plain.rlhf");
    std::fs::write(&plain, SMALL.replace("steps: 10", "steps: 3")).unwrap();
    let pinned = dir.join("pinned.rlhf");
    std::fs::write(
        &pinned,
        format!(
            "{}\nschedule {{\n  speculate generate(policy) ngram(2) max 4\n}}\n",
            SMALL.replace("steps: 10", "steps: 3")
        ),
    )
    .unwrap();
    let out = braid(&["check", pinned.to_str().unwrap()]);
    ok(&out);
    let mut runs = Vec::new();
    for (name, file) in [("plain", &plain), ("pinned", &pinned)] {
        let run_dir = dir.join(name);
        let out = run_into(file, &run_dir);
        ok(&out);
        runs.push(comparable(&metrics(&run_dir)));
    }
    let plan = std::fs::read_to_string(dir.join("pinned/plan.txt")).unwrap();
    assert!(plan.contains("speculate=ngram:4"), "{plan}");
    assert_eq!(runs[0], runs[1]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The schedule's `fuse` pins decide which inference calls stream under generation in
/// `braid run` (and `--no-fuse` turns all of it off); streaming changes when work runs, not
/// what it computes.
#[test]
fn fuse_pins_choose_what_streams_under_generation() {
    let dir = tmp("fuse");
    let base = format!(
        "use std::ppo\n{ALGO_MODELS}\nrun ppo_fn(policy, prompts, reward: vowels, critic: critic) {{\n  steps: 2\n  batch: 4\n  max_new_tokens: 6\n}}\n"
    );
    let cases = [
        ("default", String::new(), None),
        ("off", "fuse off".to_string(), None),
        (
            "values",
            "fuse generate(policy) -> values(critic)".to_string(),
            Some("streaming under generate(policy): values(critic) (1 per pass)"),
        ),
    ];
    let mut runs = Vec::new();
    for (name, pin, expect) in &cases {
        let file = dir.join(format!("{name}.rlhf"));
        let src = if pin.is_empty() {
            base.clone()
        } else {
            format!("{base}schedule {{\n  {pin}\n}}\n")
        };
        std::fs::write(&file, src).unwrap();
        let run_dir = dir.join(name);
        let out = run_into(&file, &run_dir);
        ok(&out);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let line = stderr
            .lines()
            .find(|l| l.contains("generate(policy)") && !l.starts_with("speculation"))
            .unwrap_or_default()
            .to_string();
        match (*name, expect) {
            ("default", _) => {
                // Without pins every per-sample consumer streams: the reference's log-probs
                // and the critic's values.
                assert!(
                    line.starts_with("streaming under generate(policy): "),
                    "{stderr}"
                );
                assert!(
                    line.contains("logprobs(ref)") && line.contains("values(critic)"),
                    "{line}"
                );
            }
            ("off", _) => assert_eq!(
                line,
                "generate(policy): inference waits for the whole batch"
            ),
            (_, Some(want)) => assert_eq!(line, *want),
            _ => unreachable!(),
        }
        runs.push(comparable(&metrics(&run_dir)));
    }
    assert_eq!(runs[0], runs[1]);
    assert_eq!(runs[0], runs[2]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `braid run --alternate-streaming` runs every other step without streaming, on the same
/// placement: each step records which half it is in, and the run computes exactly what a run
/// streaming throughout does — here the policy's own log-probabilities stream, so it generates
/// on a replica, which a step without streaming leaves behind the trained weights and which
/// is brought up to them before it generates again. `braid report --against-sim` sets the two
/// halves beside their predictions; a plan where nothing streams is refused.
#[test]
fn alternating_streaming_computes_what_streaming_does_and_reports_both_halves() {
    let dir = tmp("alternate");
    // Two minibatches: the policy's log-probabilities are not taken from its training pass,
    // they stream under its generation (on the same copy: the generation gets a replica).
    let src = std::fs::read_to_string("examples/quickstart.rlhf")
        .unwrap()
        .replace("  group: 4\n", "  group: 4\n  minibatches: 2\n");
    let file = dir.join("alternate.rlhf");
    std::fs::write(&file, &src).unwrap();
    let run = |name: &str, extra: &[&str]| {
        let run_dir = dir.join(name);
        let mut args = vec![
            "run",
            file.to_str().unwrap(),
            "--steps",
            "4",
            "--run-dir",
            run_dir.to_str().unwrap(),
        ];
        args.extend(extra);
        (braid(&args), run_dir)
    };
    let (out, alternating) = run("alternating", &["--alternate-streaming"]);
    ok(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("streaming under generate(policy): logprobs(policy)"),
        "{stderr}"
    );
    assert!(stderr.contains("alternating: steps 2, 4"), "{stderr}");
    let (out, throughout) = run("throughout", &[]);
    ok(&out);
    let a = metrics(&alternating);
    let halves: Vec<f64> = a
        .iter()
        .map(|l| l["unstreamed"].as_f64().unwrap())
        .collect();
    assert_eq!(halves, [0.0, 1.0, 0.0, 1.0]);
    let without_half: Vec<_> = a
        .into_iter()
        .map(|mut l| {
            l.remove("unstreamed");
            l
        })
        .collect();
    assert_eq!(comparable(&without_half), comparable(&metrics(&throughout)));
    // The report: the steps with streaming against the plan, those without against the plan
    // with its streams taken out; the first step of each half warms up.
    let report = |extra: &[&str]| {
        let mut args = vec!["report", alternating.to_str().unwrap(), "--against-sim"];
        args.extend(extra);
        braid(&args)
    };
    let out = report(&["--json"]);
    ok(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["alternating"], true);
    assert_eq!(v["same_plan"], false);
    assert_eq!(
        (v["run"]["steps"].as_u64(), v["unfused"]["steps"].as_u64()),
        (Some(1), Some(1))
    );
    let rows = metrics(&alternating);
    for (side, step) in [("run", 2), ("unfused", 3)] {
        let m = v[side]["measured"]["iteration"].as_f64().unwrap();
        assert_eq!(m, rows[step]["time/step"].as_f64().unwrap(), "{side}");
    }
    let (m, p) = (
        v["streaming_gain"]["measured"].as_f64().unwrap(),
        v["streaming_gain"]["predicted"].as_f64().unwrap(),
    );
    let iter = |side: &str, what: &str| v[side][what]["iteration"].as_f64().unwrap();
    assert_eq!(m, iter("unfused", "measured") / iter("run", "measured"));
    assert_eq!(p, iter("unfused", "predicted") / iter("run", "predicted"));
    // Streaming hides inference under generation: the plan without it is predicted slower.
    assert!(p > 1.0, "{v}");
    let out = report(&[]);
    ok(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("its steps without streaming"), "{text}");
    assert!(text.contains("between the two halves of the run"), "{text}");
    // Its comparison is in it: another run without streaming is refused.
    let out = report(&["--unfused", throughout.to_str().unwrap()]);
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains("alternated streaming") && e.contains("leave out --unfused"),
        "{e}"
    );
    // Nothing to compare where nothing streams.
    let off = dir.join("off.rlhf");
    std::fs::write(&off, format!("{src}schedule {{\n  fuse off\n}}\n")).unwrap();
    let out = braid(&[
        "run",
        off.to_str().unwrap(),
        "--steps",
        "2",
        "--run-dir",
        dir.join("off").to_str().unwrap(),
        "--alternate-streaming",
    ]);
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains("--alternate-streaming") && e.contains("nothing streams"),
        "{e}"
    );
    assert!(!e.contains("panicked"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

const ALGO_MODELS: &str = r#"
model policy = tiny(vocab: "bytes", layers: 1, hidden: 32, heads: 2, seed: 4) {
  train: adamw(lr: 1e-3, warmup: 1, schedule: "cosine")
  grad_clip: 1.0
}
model critic = tiny(vocab: "bytes", layers: 1, hidden: 32, heads: 2, seed: 6) {
  head: value
  train: adamw(lr: 1e-3)
}
dataset prompts = synthetic::letters(count: 64, seed: 3)
fn vowels(s: Sample) -> float {
  count(s.completion, r"[aeiou]") / max(len(s.completion), 1)
}
"#;

/// Every algorithm of the standard library runs as its pipeline (no Rust copy of any of them):
/// GRPO, Dr. GRPO, RLOO, REINFORCE++, ReMax, PPO with a reward function, and GRPO with DAPO's
/// and CISPO's losses, with epochs,
/// mini-batches, warm-up, a cosine schedule and gradient clipping; the generated lengths feed
/// `braid plan --gen-lengths`.
#[test]
fn every_stdlib_algorithm_runs_as_its_pipeline() {
    let dir = tmp("algos");
    let runs = [
        (
            "grpo",
            "grpo(policy, prompts, reward: vowels)",
            "group: 2\n  epochs: 2\n  minibatches: 2",
        ),
        (
            "grpo",
            "grpo(policy, prompts, reward: vowels)",
            "group: 2\n  variant: \"dr_grpo\"",
        ),
        ("rloo", "rloo(policy, prompts, reward: vowels)", "group: 2"),
        (
            "reinforce_pp",
            "reinforce_pp(policy, prompts, reward: vowels)",
            "group: 2",
        ),
        ("remax", "remax(policy, prompts, reward: vowels)", ""),
        (
            "ppo",
            "ppo_fn(policy, prompts, reward: vowels, critic: critic)",
            "minibatches: 2\n  entropy_coef: 0.01\n  dual_clip: 3.0",
        ),
        (
            "grpo",
            "grpo(policy, prompts, reward: vowels)",
            "group: 2\n  variant: \"dapo\"\n  epochs: 2",
        ),
        (
            "grpo",
            "grpo(policy, prompts, reward: vowels)",
            "group: 2\n  variant: \"cispo\"\n  minibatches: 2\n  kl_coef: 0.0",
        ),
    ];
    for (i, (module, call, extra)) in runs.iter().enumerate() {
        // Models a pipeline does not use are a warning only.
        let src = format!(
            "use std::{module}\n{ALGO_MODELS}\nrun {call} {{\n  steps: 2\n  batch: 4\n  max_new_tokens: 6\n  {extra}\n}}\n"
        );
        let file = dir.join(format!("algo{i}.rlhf"));
        std::fs::write(&file, src).unwrap();
        let run_dir = dir.join(format!("run{i}"));
        let out = run_into(&file, &run_dir);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{call}: {stderr}");
        let m = metrics(&run_dir);
        assert_eq!(m.len(), 2, "{call}");
        for line in &m {
            for k in [
                "reward_mean",
                "policy/loss",
                "policy/grad_norm",
                "policy/lr",
            ] {
                assert!(num(line, k).is_finite(), "{call}: {k}");
            }
        }
        // The cosine schedule after one warm-up step decays the learning rate.
        if *module == "grpo" && extra.contains("epochs") {
            assert!(
                num(&m[1], "policy/lr") < num(&m[0], "policy/lr") + 1e-12,
                "{m:?}"
            );
        }
        if call.contains("critic") {
            assert!(num(&m[1], "critic/loss").is_finite());
        }
        let lengths = run_dir.join("lengths.txt");
        let (total, text) = histogram_count(&lengths);
        let n = if module.contains("grpo") || *module == "rloo" || *module == "reinforce_pp" {
            16
        } else {
            8
        };
        assert_eq!(total, n, "{call}: {text}");
        // One prompt length per prompt: at most one per sample, at least one.
        let prompts = run_dir.join("prompt-lengths.txt");
        let (counted, text) = histogram_count(&prompts);
        assert!(counted >= 1 && counted <= n, "{call}: {text}");
        if i == 0 {
            let out = braid(&[
                "plan",
                file.to_str().unwrap(),
                "--gen-lengths",
                lengths.to_str().unwrap(),
                "--prompt-lengths",
                prompts.to_str().unwrap(),
            ]);
            ok(&out);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The total count of a `LEN COUNT` histogram file (`#` lines skipped), and its text.
fn histogram_count(path: &Path) -> (u64, String) {
    let text = std::fs::read_to_string(path).unwrap();
    let total = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap())
        .sum();
    (total, text)
}

/// The python that has `transformers`: `BRAID_TRANSFORMERS_PYTHON`, or `.venv/bin/python` with
/// `PYTHONPATH=.pydeps` when `.pydeps/transformers` exists (as `runtime/tests/save_load.rs`).
fn transformers_python() -> Option<(PathBuf, Option<PathBuf>)> {
    if let Ok(p) = std::env::var("BRAID_TRANSFORMERS_PYTHON") {
        return Some((PathBuf::from(p), None));
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let py = root.join(".venv/bin/python");
    let deps = root.join(".pydeps");
    (py.exists() && deps.join("transformers").exists()).then_some((py, Some(deps)))
}

/// The policy a run saves loads in `transformers`, which gives the log-probabilities Braid
/// reports for a greedy completion. Runs where Python with transformers is installed
/// (`.venv/bin/python -m pip install --target .pydeps transformers`); says so and passes
/// otherwise.
#[test]
fn the_trained_policy_loads_in_transformers() {
    let Some(py) = transformers_python() else {
        eprintln!(
            "skipped: no Python with transformers (set BRAID_TRANSFORMERS_PYTHON or install into .pydeps)"
        );
        return;
    };
    let dir = tmp("hf");
    let file = dir.join("small.rlhf");
    std::fs::write(&file, SMALL.replace("steps: 10", "steps: 3")).unwrap();
    let run_dir = dir.join("run");
    let out = run_into(&file, &run_dir);
    ok(&out);
    let model = run_dir.join("checkpoints/step-000003/models/policy");
    let out = braid(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "abc ",
        "--max-new-tokens",
        "6",
        "--greedy",
        "--format",
        "json",
    ]);
    ok(&out);
    let sample: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().next().unwrap()).unwrap();
    let completion: Vec<i64> = numbers(&sample["token_ids"])
        .into_iter()
        .map(|x| x as i64)
        .collect();
    let braid_lp = numbers(&sample["logprobs"]);
    // BOS, then the prompt's bytes (the byte tokenizer).
    let mut ids: Vec<i64> = vec![256];
    ids.extend("abc ".bytes().map(i64::from));
    let prompt_len = ids.len();
    ids.extend(&completion);
    let ids_arg: Vec<String> = ids.iter().map(i64::to_string).collect();
    let mut cmd = Command::new(&py.0);
    cmd.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/check_hf_load.py"))
        .arg(format!("{}:lm", model.display()))
        .args(["--ids", &ids_arg.join(",")]);
    if let Some(deps) = &py.1 {
        cmd.env("PYTHONPATH", deps);
    }
    let out = cmd.output().unwrap();
    ok(&out);
    let v: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().next().unwrap()).unwrap();
    let logits = numbers(&v["logits"]);
    let vocab = logits.len() / ids.len();
    assert_eq!(vocab, 259);
    for (i, &tok) in completion.iter().enumerate() {
        let row = &logits[(prompt_len - 1 + i) * vocab..(prompt_len + i) * vocab];
        let max = row.iter().copied().fold(f64::MIN, f64::max);
        let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
        let lp = row[tok as usize] - lse;
        assert!(
            (lp - braid_lp[i]).abs() < 1e-3,
            "token {i}: transformers {lp}, braid {}",
            braid_lp[i]
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

const EVAL_PROGRAM: &str = r#"use std::grpo

model policy = tiny(vocab: "bytes", layers: 1, hidden: 32, heads: 2) {
  train: adamw(lr: 1e-3)
}

dataset train = synthetic::arithmetic(count: 64, seed: 1, split: "train")
dataset held_out = synthetic::arithmetic(count: 6, seed: 1, split: "held_out")

fn r(s: Sample) -> float {
  if answer_matches(s.completion, s.answer) { 1.0 } else { 0.1 * len(s.completion) / 8 }
}

run grpo(policy, train, reward: r) {
  steps: 5
  batch: 2
  group: 2
  max_new_tokens: 8
  eval: { every: 2, prompts: held_out, n: 1, greedy }
}
"#;

/// Held-out evaluation before the first step, every `every` steps and at the end, as metrics
/// of their own; `samples.jsonl` holds a few generations per step with reward and advantage;
/// `--eval-only` on the final checkpoint reproduces the last evaluation.
#[test]
fn eval_metrics_samples_and_eval_only() {
    let dir = tmp("eval");
    let file = dir.join("ev.rlhf");
    std::fs::write(&file, EVAL_PROGRAM).unwrap();
    let run_dir = dir.join("run");
    let out = braid(&[
        "run",
        file.to_str().unwrap(),
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--show-samples",
        "--plain",
    ]);
    ok(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("eval before training:"), "{stderr}");
    assert!(stderr.contains("eval after step 4:"), "{stderr}");
    assert!(stderr.contains("  completion: "), "{stderr}");
    let m = metrics(&run_dir);
    let evaluated: Vec<i64> = m
        .iter()
        .filter(|l| l.contains_key("eval/reward_mean"))
        .map(|l| l["step"].as_i64().unwrap())
        .collect();
    assert_eq!(evaluated, vec![0, 2, 4, 5]);
    for l in m.iter().filter(|l| l.contains_key("eval/reward_mean")) {
        let acc = num(l, "eval/accuracy");
        assert!((0.0..=1.0).contains(&acc), "{l:?}");
        assert!(num(l, "eval/response_length") > 0.0);
    }
    // Step 0 holds only the evaluation; training steps have their own metrics beside it.
    assert!(!m[0].contains_key("reward_mean"));
    assert!(m[2].contains_key("reward_mean") && m[2].contains_key("eval/accuracy"));
    let samples: Vec<serde_json::Value> = std::fs::read_to_string(run_dir.join("samples.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // Batch 2: the first sample of each of the two prompts, every step.
    assert_eq!(samples.len(), 10);
    for (i, s) in samples.iter().enumerate() {
        assert_eq!(s["step"].as_i64(), Some(i as i64 / 2 + 1));
        assert!(s["prompt"].as_str().unwrap().ends_with(" ="), "{s}");
        assert!(s["answer"].as_str().unwrap().parse::<u64>().is_ok(), "{s}");
        assert!(
            s["reward"].as_f64().is_some() && s["advantage"].as_f64().is_some(),
            "{s}"
        );
    }
    let report = dir.join("report.html");
    ok(&braid(&[
        "report",
        run_dir.to_str().unwrap(),
        "-o",
        report.to_str().unwrap(),
    ]));
    let html = std::fs::read_to_string(&report).unwrap();
    assert!(html.contains("<h2>Samples</h2>") && html.contains("eval/accuracy"));
    // The saved policy evaluates to what the run logged after its last step.
    let out = braid(&[
        "run",
        file.to_str().unwrap(),
        "--eval-only",
        run_dir.to_str().unwrap(),
    ]);
    ok(&out);
    let again: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
    let last = m.last().unwrap();
    for k in ["eval/reward_mean", "eval/accuracy", "eval/response_length"] {
        assert_eq!(again[k].as_f64(), Some(num(last, k)), "{k}");
    }
    // A run without `eval` has nothing to evaluate: a usage error.
    let plain = dir.join("plain.rlhf");
    std::fs::write(
        &plain,
        EVAL_PROGRAM.replace(
            "  eval: { every: 2, prompts: held_out, n: 1, greedy }\n",
            "",
        ),
    )
    .unwrap();
    let out = braid(&[
        "run",
        plain.to_str().unwrap(),
        "--eval-only",
        run_dir.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no `eval` setting"));
}

/// The real-model example for two steps on the CPU (installs the model into .venv when
/// missing): GGUF loading, the chat template, word problems, held-out evaluation.
#[test]
fn smollm2_arith_example_runs_two_steps() {
    let setup = Command::new("scripts/setup_models").output().unwrap();
    ok(&setup);
    let dir = tmp("smollm2");
    let run_dir = dir.join("run");
    let out = braid(&[
        "run",
        "examples/smollm2_arith.rlhf",
        "--steps",
        "2",
        "--plain",
        "--run-dir",
        run_dir.to_str().unwrap(),
    ]);
    ok(&out);
    let m = metrics(&run_dir);
    let steps: Vec<i64> = m.iter().map(|l| l["step"].as_i64().unwrap()).collect();
    assert_eq!(steps, vec![0, 1, 2]);
    for l in [&m[0], &m[2]] {
        let acc = num(l, "eval/accuracy");
        assert!((0.0..=1.0).contains(&acc), "{l:?}");
    }
    assert!(num(&m[1], "policy/grad_norm").is_finite());
    let samples = std::fs::read_to_string(run_dir.join("samples.jsonl")).unwrap();
    assert_eq!(samples.lines().count(), 8);
    assert!(samples.contains("Answer:"));
    // The trained policy was saved as a Hugging Face directory.
    let policy = run_dir.join("checkpoints/step-000002/models/policy");
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(policy.join(f).exists(), "{f}");
    }
}

/// The f32 values of every tensor of a safetensors file (F32 and BF16), by name: the format is
/// an 8-byte header length, a JSON header of dtypes, shapes and offsets, then the data.
fn read_safetensors(path: &Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut out = std::collections::BTreeMap::new();
    for (name, t) in header.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        let at = numbers(&t["data_offsets"]);
        let raw = &data[at[0] as usize..at[1] as usize];
        let values = match t["dtype"].as_str().unwrap() {
            "F32" => raw
                .chunks(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            "BF16" => raw
                .chunks(2)
                .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
                .collect(),
            other => panic!("{}: {name} is {other}", path.display()),
        };
        out.insert(name.clone(), values);
    }
    out
}

/// The share of values that differ between two sets of tensors with the same names.
fn changed_share(
    a: &std::collections::BTreeMap<String, Vec<f32>>,
    b: &std::collections::BTreeMap<String, Vec<f32>>,
) -> f64 {
    let (mut changed, mut total) = (0usize, 0usize);
    for (name, x) in a {
        let y = &b[name];
        assert_eq!(x.len(), y.len(), "{name}");
        changed += x.iter().zip(y).filter(|(p, q)| p != q).count();
        total += x.len();
    }
    changed as f64 / total as f64
}

/// The issue's run: GRPO for 3 steps at lr 1e-5 on the `llama_gqa` fixture. With `dtype:
/// bf16`, AdamW wrote into bf16 weights and under 1 % of them changed (84 % in f32); with f32
/// masters as many masters change as f32 weights do. The checkpoint keeps the masters
/// (`master/policy.safetensors`) next to the Hugging Face directory in bf16, and a resumed
/// bf16 run continues from the masters: it computes what the uninterrupted run computes. f16
/// skips and counts the steps whose scaled gradients overflow.
#[test]
fn a_bf16_grpo_run_changes_its_parameters_like_f32_and_resumes_exactly() {
    let dir = tmp("bf16");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("runtime/tests/fixtures/llama_gqa");
    let program = |dtype: &str| {
        format!(
            r#"use std::grpo

model policy = hf("{}") {{
  dtype: {dtype}
  train: adamw(lr: 1e-5)
}}

dataset prompts = synthetic::letters(count: 64, seed: 2)

fn vowels(s: Sample) -> float {{
  count(s.completion, r"[aeiou]") / max(len(s.completion), 1)
}}

run grpo(policy, prompts, reward: vowels) {{
  steps: 3
  batch: 4
  group: 4
  max_new_tokens: 16
  checkpoint_every: 1
}}
"#,
            fixture.display()
        )
    };
    let initial = read_safetensors(&fixture.join("model.safetensors"));
    let mut shares = Vec::new();
    for dtype in ["f32", "bf16"] {
        let file = dir.join(format!("{dtype}.rlhf"));
        std::fs::write(&file, program(dtype)).unwrap();
        let run_dir = dir.join(dtype);
        ok(&run_into(&file, &run_dir));
        let ck = run_dir.join("checkpoints/step-000003");
        let hf = read_safetensors(&ck.join("models/policy/model.safetensors"));
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(ck.join("models/policy/config.json")).unwrap(),
        )
        .unwrap();
        let trained = if dtype == "f32" {
            assert!(!ck.join("master").exists(), "an f32 model needs no masters");
            hf
        } else {
            assert_eq!(config["torch_dtype"], "bfloat16", "{config}");
            let masters = read_safetensors(&ck.join("master/policy.safetensors"));
            // The Hugging Face directory holds the masters rounded to bf16.
            for (name, m) in &masters {
                let rounded: Vec<f32> = m
                    .iter()
                    .map(|x| {
                        let b = x.to_bits();
                        // Round to nearest even, as libtorch converts f32 to bf16.
                        let r = b + 0x7fff + ((b >> 16) & 1);
                        f32::from_bits(r & 0xffff_0000)
                    })
                    .collect();
                assert_eq!(&rounded, &hf[name], "{name}");
            }
            masters
        };
        shares.push(changed_share(&initial, &trained));
        for line in metrics(&run_dir) {
            assert_eq!(num(&line, "policy/skipped_steps"), 0.0);
        }
    }
    // f16 with loss scaling. This fixture's gradients exceed 1 (initializer range 0.2), so at
    // the starting scale of 2^16 they overflow f16's largest value, 65504: the first step is
    // skipped and counted, the scale halves, and the weights stay exactly the source's.
    let file = dir.join("f16.rlhf");
    std::fs::write(&file, program("f16")).unwrap();
    ok(&run_into(&file, &dir.join("f16")));
    let m = metrics(&dir.join("f16"));
    assert_eq!(num(&m[0], "policy/skipped_steps"), 1.0);
    assert_eq!(num(&m[0], "policy/loss_scale"), 32768.0);
    assert!(
        !m[0].contains_key("policy/grad_norm"),
        "a skipped step has no norm"
    );
    let mut scale = 32768.0;
    for line in &m[1..] {
        let skipped = num(line, "policy/skipped_steps");
        if skipped > 0.0 {
            scale /= 2.0;
        } else {
            assert!(num(line, "policy/grad_norm").is_finite());
        }
        assert_eq!(num(line, "policy/loss_scale"), scale);
    }
    let ck = |step: usize| {
        dir.join(format!(
            "f16/checkpoints/step-{step:06}/master/policy.safetensors"
        ))
    };
    assert_eq!(changed_share(&initial, &read_safetensors(&ck(1))), 0.0);
    assert!(m.iter().any(|l| num(l, "policy/skipped_steps") == 0.0));
    assert!(changed_share(&initial, &read_safetensors(&ck(3))) > 0.5);
    let (f32_share, bf16_share) = (shares[0], shares[1]);
    assert!(f32_share > 0.5, "f32 changed only {f32_share}");
    assert!(
        (f32_share - bf16_share).abs() < 0.05,
        "f32 changed {f32_share:.3} of the parameters, bf16 {bf16_share:.3}"
    );
    // Two steps, then a resume to three: the same numbers as the run of three.
    let file = dir.join("bf16.rlhf");
    let resumed = dir.join("resumed");
    let out = braid(&[
        "run",
        file.to_str().unwrap(),
        "--run-dir",
        resumed.to_str().unwrap(),
        "--steps",
        "2",
    ]);
    ok(&out);
    ok(&braid(&["run", "--resume", resumed.to_str().unwrap()]));
    assert_eq!(
        comparable(&metrics(&resumed)),
        comparable(&metrics(&dir.join("bf16"))),
        "the resumed bf16 run's metrics differ from the uninterrupted run's"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `gradient_checkpointing` changes memory, not results: on the CPU the recomputed layers give
/// the same gradients to the bit, so a run computes the same metrics with and without it.
#[test]
fn gradient_checkpointing_changes_memory_not_results() {
    let dir = tmp("ckpt");
    let mut runs = Vec::new();
    for (name, program) in [
        ("plain", SMALL.to_string()),
        (
            "checkpointed",
            SMALL.replace(
                "train: adamw(lr: 1e-3)",
                "train: adamw(lr: 1e-3)\n  gradient_checkpointing",
            ),
        ),
    ] {
        let file = dir.join(format!("{name}.rlhf"));
        std::fs::write(&file, &program).unwrap();
        let run_dir = dir.join(name);
        ok(&run_into(&file, &run_dir));
        let plan: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run_dir.join("plan.json")).unwrap())
                .unwrap();
        let on = plan["plan"]["models"][0]["gradient_checkpointing"] == true;
        assert_eq!(on, name == "checkpointed", "{}", plan["plan"]["models"]);
        runs.push(comparable(&metrics(&run_dir)));
    }
    assert_eq!(runs[0].len(), 10);
    assert_eq!(runs[0], runs[1], "checkpointing changed the run's numbers");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `braid run PLAN.json` runs exactly what `braid run FILE.rlhf` runs: the plan `braid plan
/// --emit` writes, read back, gives bit-identical metrics (the quickstart and PPO with four
/// models, whose reward model is read relative to the program's directory).
#[test]
fn a_plan_file_runs_like_its_program() {
    let dir = tmp("planfile");
    for (example, steps) in [("quickstart", "3"), ("ppo_tiny", "2")] {
        let file = format!("examples/{example}.rlhf");
        let plan = dir.join(format!("{example}.plan.json"));
        let out = braid(&["plan", &file, "--emit", plan.to_str().unwrap()]);
        ok(&out);
        let mut runs = Vec::new();
        for (name, input) in [("program", file.as_str()), ("plan", plan.to_str().unwrap())] {
            let run_dir = dir.join(format!("{example}-{name}"));
            let out = braid(&[
                "run",
                input,
                "--run-dir",
                run_dir.to_str().unwrap(),
                "--steps",
                steps,
            ]);
            ok(&out);
            // The run directory keeps the plan it ran: the same plan either way.
            let kept = std::fs::read_to_string(run_dir.join("plan.json")).unwrap();
            assert_eq!(
                kept,
                std::fs::read_to_string(&plan).unwrap(),
                "{example} {name}"
            );
            runs.push(comparable(&metrics(&run_dir)));
        }
        assert!(!runs[0].is_empty());
        assert_eq!(runs[0], runs[1], "{example}: the plan file ran differently");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A program whose `hf(…)` model cannot fit the device gets `E0504` from `braid run` before
/// any weight is read: the directory holds only a `config.json`, so reading weights would fail
/// with a file error instead.
#[test]
fn a_model_too_large_for_the_device_is_e0504_before_any_weight_is_read() {
    let dir = tmp("toolarge");
    let model = dir.join("big");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(
        model.join("config.json"),
        r#"{"model_type": "llama", "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256, "max_position_embeddings": 4096}"#,
    )
    .unwrap();
    let file = dir.join("big.rlhf");
    std::fs::write(
        &file,
        "use std::grpo\nmodel policy = hf(\"big\") { train: adamw(lr: 1e-6) }\ndataset prompts = synthetic::letters(count: 8)\nfn r(s: Sample) -> float { 1.0 }\nrun grpo(policy, prompts, reward: r) { steps: 1, batch: 2, group: 2 }\n",
    )
    .unwrap();
    let run_dir = dir.join("run");
    let out = run_into(&file, &run_dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("E0504"), "{stderr}");
    assert!(!stderr.contains("safetensors"), "{stderr}");
    assert!(!run_dir.exists(), "the run started");
    let _ = std::fs::remove_dir_all(&dir);
}
