//! `braid launch … run` end to end on several CPU processes (Gloo over 127.0.0.1, a free port
//! the launcher picks): data parallelism gives the one-process run's numbers, a consumer on
//! another rank streams samples across processes, and a rank killed with SIGKILL makes the
//! others exit naming it, after which `--resume` finishes with no completed step lost. Every
//! process a test starts is ended by its pid, whatever happens; every wait is bounded.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![cfg(unix)]

use std::io::{BufRead, BufReader};
mod common;
use common::Tmp;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn braid() -> Command {
    Command::new(env!("CARGO_BIN_EXE_braid"))
}

fn tmp(name: &str) -> Tmp {
    Tmp::new("dist", name)
}

/// The pids of the ranks `braid launch` reported (`rank R pid P`).
fn rank_pids(stderr: &str) -> Vec<(usize, u32)> {
    let mut out = Vec::new();
    for line in stderr.lines().filter(|l| l.starts_with("braid launch:")) {
        for part in line.split(['(', ',', ')', ';']) {
            let words: Vec<&str> = part.split_whitespace().collect();
            if let ["rank", r, "pid", p] = words.as_slice()
                && let (Ok(r), Ok(p)) = (r.parse(), p.parse())
            {
                out.push((r, p));
            }
        }
    }
    out
}

/// A launched job whose processes are ended by pid when it is dropped.
struct Job {
    child: Child,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
}

/// Collects `pipe`'s lines into a shared string on a thread of its own.
fn collect(pipe: impl std::io::Read + Send + 'static) -> Arc<Mutex<String>> {
    let text = Arc::new(Mutex::new(String::new()));
    let sink = text.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            let mut s = sink.lock().unwrap();
            s.push_str(&line);
            s.push('\n');
        }
    });
    text
}

impl Job {
    fn start(args: &[&str]) -> Job {
        let mut child = braid()
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("braid launch starts");
        let stdout = collect(child.stdout.take().unwrap());
        let stderr = collect(child.stderr.take().unwrap());
        Job {
            child,
            stdout,
            stderr,
        }
    }

    fn stdout(&self) -> String {
        self.stdout.lock().unwrap().clone()
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Polls `done` until it holds, while the launcher runs: fails if the job ends first or
    /// `limit` passes (`what` names the awaited state in the message).
    fn wait_for(&mut self, what: &str, limit: Duration, done: impl Fn(&Job) -> bool) {
        let start = Instant::now();
        while !done(self) {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("the job ended before {what}: {status}\n{}", self.stderr());
            }
            assert!(
                start.elapsed() < limit,
                "not within {limit:?}: {what}\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits for the launcher to exit, at most `limit`.
    fn wait(&mut self, limit: Duration) -> std::process::ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                // Let the reader thread take the last lines.
                std::thread::sleep(Duration::from_millis(200));
                return s;
            }
            assert!(
                start.elapsed() < limit,
                "the job did not end within {limit:?}:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for (_, pid) in rank_pids(&self.stderr()) {
            let _ = Command::new("kill")
                .args(["-9", &pid.to_string()])
                .stderr(Stdio::null())
                .status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `braid launch --nproc-per-node N run ARGS…` to the end.
fn launch_run(n: usize, args: &[&str], limit: Duration) -> (bool, String) {
    let np = n.to_string();
    let mut all = vec!["launch", "--nproc-per-node", &np, "--grace", "30", "run"];
    all.extend_from_slice(args);
    let mut job = Job::start(&all);
    let status = job.wait(limit);
    (status.success(), job.stderr())
}

fn run_one(args: &[&str]) -> Output {
    braid().arg("run").args(args).output().expect("braid runs")
}

fn metrics(run_dir: &Path) -> Vec<serde_json::Map<String, serde_json::Value>> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .map(|v| v.as_object().unwrap().clone())
        .collect()
}

fn num(m: &serde_json::Map<String, serde_json::Value>, k: &str) -> f64 {
    m.get(k)
        .and_then(|v| v.as_f64())
        .unwrap_or_else(|| panic!("no `{k}` in {m:?}"))
}

/// The tolerance of data parallelism against one process: the same samples and micro-batch
/// normalisation, summed in another order (per replica, then over the ranks).
const TOL: f64 = 1e-5;

/// `examples/ppo_tiny.rlhf` for `steps` steps on a 2-CPU cluster with the `place` pins
/// `places` (one per line), written beside the example (so that its reward model's directory
/// resolves) under a name of this process's own; the caller removes it.
fn pinned_ppo_tiny(tag: &str, steps: u32, places: &[&str]) -> std::path::PathBuf {
    let src = std::fs::read_to_string("examples/ppo_tiny.rlhf").unwrap();
    let pins: String = places.iter().map(|p| format!("  place {p}\n")).collect();
    let program = format!(
        "{}\ncluster {{ cpus: 2 }}\n\nschedule {{\n{pins}}}\n",
        src.replace("steps: 80", &format!("steps: {steps}"))
    );
    let file = Path::new("examples").join(format!(".{tag}-{}.rlhf", std::process::id()));
    std::fs::write(&file, program).unwrap();
    file
}

/// `braid launch` of a pinned program (`pinned_ppo_tiny`) on 2 ranks into `run_dir`, without
/// checkpoints, with `extra` arguments after those.
fn run_pinned(file: &Path, run_dir: &Path, extra: &[&str], limit: Duration) -> (bool, String) {
    let mut args = vec![
        file.to_str().unwrap(),
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--checkpoint-every",
        "0",
    ];
    args.extend_from_slice(extra);
    launch_run(2, &args, limit)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= TOL * (1.0 + a.abs().max(b.abs()))
}

/// Every metric of each step of `a` (one process) in `b` (several): those named in `exact`
/// equal, the others within `TOL` (timings aside).
fn same_metrics(
    a: &[serde_json::Map<String, serde_json::Value>],
    b: &[serde_json::Map<String, serde_json::Value>],
    exact: &[&str],
) {
    for (x, y) in a.iter().zip(b) {
        for (k, v) in x {
            if k.starts_with("time/") || k.starts_with("memory/") || k == "tokens_per_s" {
                continue;
            }
            let (p, q) = (v.as_f64().unwrap(), num(y, k));
            if exact.contains(&k.as_str()) {
                assert_eq!(p, q, "step {}: {k}", x["step"]);
            } else {
                assert!(close(p, q), "step {}: {k}: {p} vs {q}", x["step"]);
            }
        }
    }
}

/// The quickstart on 2 ranks, data-parallel in every call, computes what one process does:
/// the same sampled texts (hence rewards), and losses, gradient norms and KL within `TOL`;
/// the final checkpoints' weights agree within the same tolerance.
#[test]
fn two_ranks_give_the_one_process_metrics() {
    let dir = tmp("dp");
    let one = dir.join("one");
    let two = dir.join("two");
    let out = run_one(&[
        "examples/quickstart.rlhf",
        "--run-dir",
        one.to_str().unwrap(),
        "--steps",
        "4",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (ok, stderr) = launch_run(
        2,
        &[
            "examples/quickstart.rlhf",
            "--run-dir",
            two.to_str().unwrap(),
            "--steps",
            "4",
        ],
        Duration::from_secs(600),
    );
    assert!(ok, "{stderr}");
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(two.join("plan.json")).unwrap()).unwrap();
    assert_eq!(
        plan["cluster"]["per_node"], 2,
        "planned for the world of 2 ranks"
    );
    let (a, b) = (metrics(&one), metrics(&two));
    assert_eq!(a.len(), 4);
    assert_eq!(b.len(), 4);
    same_metrics(&a, &b, &["reward_mean", "reward_std", "response_length"]);
    // The final weights: rank 0 wrote them; one safetensors file each.
    let read = |d: &Path| {
        std::fs::read(d.join("checkpoints/step-000004/models/policy/model.safetensors")).unwrap()
    };
    let (wa, wb) = (read(&one), read(&two));
    assert_eq!(wa.len(), wb.len(), "the checkpoints differ in size");
    let ta = safetensor_floats(&wa);
    let tb = safetensor_floats(&wb);
    assert_eq!(ta.len(), tb.len());
    let worst = ta
        .iter()
        .zip(&tb)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-4, "weights differ by up to {worst}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every f32 of a safetensors file's tensors, in file order (the header says where data
/// starts; the test models are f32 throughout).
fn safetensor_floats(bytes: &[u8]) -> Vec<f32> {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    bytes[8 + n..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// `ppo_tiny` planned for 4 CPU ranks runs the planner's own placement: generation and
/// inference data-parallel over the 4 ranks, both trainings pipeline-parallel (dp 2 × pp 2)
/// and interleaved as one fused schedule (the critic's stages in reverse), reshards between
/// the layouts. Its first steps compute what one process does (the same sampled lengths;
/// rewards — the reward model's scores, batched differently — losses and norms within
/// `TOL`), and over 40 steps its reward rises.
#[test]
fn ppo_tiny_on_4_ranks_runs_the_planners_placement_and_learns() {
    let dir = tmp("ppo4");
    let src = std::fs::read_to_string("examples/ppo_tiny.rlhf").unwrap();
    let forty = src.replace("steps: 80", "steps: 40");
    let file = Path::new("examples").join(format!(".ppo4-{}.rlhf", std::process::id()));
    let single = Path::new("examples").join(format!(".ppo1-{}.rlhf", std::process::id()));
    std::fs::write(&file, format!("{forty}\ncluster {{ cpus: 4 }}\n")).unwrap();
    std::fs::write(&single, &forty).unwrap();
    let (one, four) = (dir.join("one"), dir.join("four"));
    let out = run_one(&[
        single.to_str().unwrap(),
        "--run-dir",
        one.to_str().unwrap(),
        "--steps",
        "3",
    ]);
    let (ok, stderr) = launch_run(
        4,
        &[
            file.to_str().unwrap(),
            "--run-dir",
            four.to_str().unwrap(),
            "--checkpoint-every",
            "0",
        ],
        Duration::from_secs(900),
    );
    let _ = std::fs::remove_file(&file);
    let _ = std::fs::remove_file(&single);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(ok, "{stderr}");
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(four.join("plan.json")).unwrap()).unwrap();
    let d = &plan["decisions"];
    let layouts: std::collections::BTreeSet<(u64, u64, u64)> = d["placements"]
        .as_object()
        .unwrap()
        .values()
        .map(|p| {
            let f = |k: &str| p[k].as_u64().unwrap();
            (f("dp"), f("tp"), f("pp"))
        })
        .collect();
    assert!(layouts.len() > 1, "one layout for every call: {layouts:?}");
    assert!(layouts.iter().any(|l| l.2 > 1), "no pipeline: {layouts:?}");
    assert_eq!(d["interleave"].as_array().unwrap().len(), 1, "{d}");
    assert!(
        !d["transfers"].as_object().unwrap().is_empty(),
        "no reshard between the layouts"
    );
    let (a, b) = (metrics(&one), metrics(&four));
    assert_eq!(b.len(), 40);
    same_metrics(&a[..3], &b[..3], &["response_length"]);
    let mean = |r: &[serde_json::Map<String, serde_json::Value>]| {
        r.iter().map(|l| num(l, "reward_mean")).sum::<f64>() / r.len() as f64
    };
    let (first, last) = (mean(&b[..5]), mean(&b[35..]));
    assert!(
        last > 1.3 * first,
        "PPO's reward did not rise: {first} → {last}"
    );
    // The pipeline stages wrote their own shards of the checkpoint.
    let ck = four.join("checkpoints/step-000040");
    assert!(
        ck.join("models/policy/model.safetensors.index.json")
            .exists()
            && ck
                .join("optimizer/critic.stage-1-of-2.safetensors")
                .exists(),
        "{}",
        ck.display()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `ppo_tiny` with every call tensor-parallel over 2 ranks (`place … tp 2` pins): the same
/// numbers as one process (sampled texts from logits gathered whole, log-probabilities and
/// entropy from each rank's vocabulary slice, gradients and the clipped norm over the group);
/// the checkpoint is gathered whole into the Hugging Face layout, each rank writes its own
/// optimizer state, and `--resume` continues from them exactly.
#[test]
fn ppo_tiny_tensor_parallel_on_2_ranks_gives_the_one_process_metrics() {
    let dir = tmp("tp2");
    let src = std::fs::read_to_string("examples/ppo_tiny.rlhf").unwrap();
    let calls = [
        "generate(policy)",
        "logprobs(policy)",
        "logprobs(ref)",
        "values(critic)",
        "score(reward_model)",
        "train(policy)",
        "train(critic)",
    ];
    let pins: String = calls
        .iter()
        .map(|c| format!("  place {c} on 0..2 tp 2\n"))
        .collect();
    let file = Path::new("examples").join(format!(".tp2-{}.rlhf", std::process::id()));
    std::fs::write(
        &file,
        format!("{src}\ncluster {{ cpus: 2 }}\n\nschedule {{\n{pins}}}\n"),
    )
    .unwrap();
    let (one, two, resumed) = (dir.join("one"), dir.join("two"), dir.join("resumed"));
    let out = run_one(&[
        "examples/ppo_tiny.rlhf",
        "--run-dir",
        one.to_str().unwrap(),
        "--steps",
        "3",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let args = |run: &Path, steps: &str| {
        vec![
            file.to_str().unwrap().to_string(),
            "--run-dir".into(),
            run.to_str().unwrap().to_string(),
            "--steps".into(),
            steps.into(),
            "--checkpoint-every".into(),
            "1".into(),
        ]
    };
    let run = |a: Vec<String>| {
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        launch_run(2, &a, Duration::from_secs(600))
    };
    let (ok, stderr) = run(args(&two, "3"));
    assert!(ok, "{stderr}");
    let (ok2, stderr2) = run(args(&resumed, "2"));
    assert!(ok2, "{stderr2}");
    let (ok3, stderr3) = run(vec![
        "--resume".into(),
        resumed.to_str().unwrap().to_string(),
        "--steps".into(),
        "3".into(),
    ]);
    let _ = std::fs::remove_file(&file);
    assert!(ok3, "{stderr3}");
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(two.join("plan.json")).unwrap()).unwrap();
    for p in plan["decisions"]["placements"]
        .as_object()
        .unwrap()
        .values()
    {
        assert_eq!(p["tp"], 2, "{p}");
    }
    let (a, b, c) = (metrics(&one), metrics(&two), metrics(&resumed));
    assert_eq!(b.len(), 3);
    same_metrics(&a, &b, &["response_length"]);
    // The resumed run's last step is the uninterrupted run's.
    assert_eq!(c.len(), 3);
    same_metrics(&b[2..], &c[2..], &["response_length"]);
    // The tensor-parallel checkpoint is whole: its weights are the one-process run's.
    let ck = |run: &Path| run.join("checkpoints/step-000003");
    let w = |run: &Path| std::fs::read(ck(run).join("models/policy/model.safetensors")).unwrap();
    let (wa, wb) = (w(&one), w(&two));
    assert_eq!(wa.len(), wb.len(), "the same tensors, gathered whole");
    let worst = safetensor_floats(&wa)
        .iter()
        .zip(&safetensor_floats(&wb))
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-4, "weights differ by up to {worst}");
    for t in 0..2 {
        assert!(
            ck(&two)
                .join(format!("optimizer/critic.tp-{t}-of-2.safetensors"))
                .exists()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `ppo_tiny` for 4 ranks with `place` pins `pins`, run 3 steps under `braid launch`, and
/// the quickstart run 3 steps in one process: the two run directories (in `dir`) and the
/// pinned run's plan.
fn pinned_and_one_process(
    dir: &Path,
    tag: &str,
    pins: &[&str],
) -> (PathBuf, PathBuf, serde_json::Value) {
    let src = std::fs::read_to_string("examples/ppo_tiny.rlhf").unwrap();
    let pins: String = pins.iter().map(|p| format!("  place {p}\n")).collect();
    let file = Path::new("examples").join(format!(".{tag}-{}.rlhf", std::process::id()));
    std::fs::write(
        &file,
        format!("{src}\ncluster {{ cpus: 4 }}\n\nschedule {{\n{pins}}}\n"),
    )
    .unwrap();
    let (one, four) = (dir.join("one"), dir.join("four"));
    let out = run_one(&[
        "examples/ppo_tiny.rlhf",
        "--run-dir",
        one.to_str().unwrap(),
        "--steps",
        "3",
    ]);
    let (ok, stderr) = launch_run(
        4,
        &[
            file.to_str().unwrap(),
            "--run-dir",
            four.to_str().unwrap(),
            "--steps",
            "3",
        ],
        Duration::from_secs(600),
    );
    let _ = std::fs::remove_file(&file);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(ok, "{stderr}");
    let plan =
        serde_json::from_str(&std::fs::read_to_string(four.join("plan.json")).unwrap()).unwrap();
    (one, four, plan)
}

/// `ppo_tiny` on 4 ranks with a mix of layouts pinned (`place`): generation, the policy's and
/// the reward model's inference tp 2 over 2 replicas (streamed), the reference's log-probs
/// through tp 2 × pp 2 and the critic's values through dp 2 × pp 2 pipelines (after
/// generation: pipelines do not stream), the policy trained tp 2 × pp 2 and interleaved with
/// the critic's tp 2 training (one fused schedule), reshards between tp 1 and 2 and between
/// pp 1 and 2. The first steps compute what one process does.
#[test]
fn mixed_tensor_and_pipeline_layouts_on_4_ranks_give_the_one_process_metrics() {
    let dir = tmp("mix4");
    let pins = [
        "generate(policy) on 0..4 tp 2",
        "logprobs(policy) on 0..4 tp 2",
        "logprobs(ref) on 0..4 tp 2 pp 2",
        "values(critic) on 0..4 dp 2 pp 2",
        "score(reward_model) on 0..4 tp 2",
        "train(policy) on 0..4 tp 2 pp 2",
        "train(critic) on 0..4 tp 2 dp 2",
    ];
    let (one, four, plan) = pinned_and_one_process(&dir, "mix4", &pins);
    let d = &plan["decisions"];
    assert_eq!(d["interleave"].as_array().unwrap().len(), 1, "{d}");
    assert!(
        d["transfers"].as_object().unwrap().len() >= 4,
        "reshards between the layouts: {}",
        d["transfers"]
    );
    let (a, b) = (metrics(&one), metrics(&four));
    assert_eq!(b.len(), 3);
    same_metrics(&a, &b, &["response_length"]);
    // While the trainings run, the copies of the generation and inference layouts are
    // released (reshards refill them before their next use), from the first step on.
    for row in &b {
        assert!(num(row, "memory/weights_released_mb") > 0.0, "{row:?}");
        assert!(num(row, "memory/weights_mb") > 0.0, "{row:?}");
    }
    let ck = four.join("checkpoints/step-000003");
    for f in [
        "models/policy/model.safetensors.index.json",
        "optimizer/policy.stage-1-of-2.tp-1-of-2.safetensors",
        "optimizer/critic.tp-1-of-2.safetensors",
    ] {
        assert!(ck.join(f).exists(), "{f}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A call streamed under generation whose layout differs from the generation's (`logprobs`
/// dp 4 under generation tp 2 × dp 2, the planner's choice with only the generation pinned)
/// gets the trained weights before it streams: its reshard from the generation's copy runs
/// before the generation, not after it (where the plan orders it). Every step computes what
/// one process does.
#[test]
fn a_call_streamed_under_generation_in_another_layout_gets_the_trained_weights() {
    let dir = tmp("stream-reshard");
    let (one, four, plan) =
        pinned_and_one_process(&dir, "stream-reshard", &["generate(policy) on 0..4 tp 2"]);
    let streamed_elsewhere = plan["decisions"]["placements"]
        .as_object()
        .unwrap()
        .values()
        .any(|p| p["tp"] == 1 && p["dp"] == 4);
    assert!(streamed_elsewhere, "{}", plan["decisions"]["placements"]);
    let (a, b) = (metrics(&one), metrics(&four));
    assert_eq!(b.len(), 3);
    same_metrics(&a, &b, &["response_length"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// PPO with generation on rank 0 and the critic and reward model on rank 1 (`place` pins):
/// the critic's values and the reward model's scores stream from rank 0 to rank 1 sample by
/// sample under generation, the critic trains on rank 1 and the policy on rank 0, and the
/// reward rises.
#[test]
fn a_consumer_on_another_rank_streams_and_ppo_learns() {
    let dir = tmp("ppo2");
    let file = pinned_ppo_tiny(
        "ppo2",
        40,
        &[
            "generate(policy) on 0..1",
            "logprobs(policy) on 0..1",
            "logprobs(ref) on 0..1",
            "train(policy) on 0..1",
            "values(critic) on 1..2",
            "score(reward_model) on 1..2",
            "train(critic) on 1..2",
        ],
    );
    let run_dir = dir.join("run");
    let (ok, stderr) = run_pinned(&file, &run_dir, &[], Duration::from_secs(900));
    let _ = std::fs::remove_file(&file);
    assert!(ok, "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.starts_with("streaming under generate(policy)"))
        .unwrap_or_default();
    assert!(
        line.contains("values(critic)") && line.contains("score(rm)"),
        "{stderr}"
    );
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("plan.json")).unwrap()).unwrap();
    // The plan streams to rank 1: the critic's values run there.
    let placements = &plan["decisions"]["placements"];
    assert!(
        placements
            .as_object()
            .unwrap()
            .values()
            .any(|p| p["first"] == 1),
        "{placements}"
    );
    let m = metrics(&run_dir);
    assert_eq!(m.len(), 40);
    let mean = |r: &[serde_json::Map<String, serde_json::Value>]| {
        r.iter().map(|l| num(l, "reward_mean")).sum::<f64>() / r.len() as f64
    };
    let (first, last) = (mean(&m[..5]), mean(&m[35..]));
    assert!(
        last > 1.3 * first,
        "PPO's reward did not rise: {first} → {last}"
    );
    assert!(num(&m[39], "critic/loss").is_finite());
    let ck = run_dir.join("checkpoints/step-000040");
    assert!(
        ck.join("models/critic/model.safetensors").exists(),
        "rank 1 wrote the critic"
    );
    assert!(ck.join("models/policy/model.safetensors").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `braid run --alternate-streaming` on 2 ranks (PPO streaming four calls under its
/// generation): the steps without streaming — the 2nd and 4th — compute what the plan
/// streaming throughout does, and every rank agrees which steps those are.
#[test]
fn alternating_streaming_on_two_ranks_computes_what_streaming_does() {
    let dir = tmp("alternate");
    let mut runs = Vec::new();
    for (name, extra) in [
        ("alternating", Some("--alternate-streaming")),
        ("throughout", None),
    ] {
        let run_dir = dir.join(name);
        let mut args = vec![
            "examples/ppo_tiny.rlhf",
            "--steps",
            "4",
            "--run-dir",
            run_dir.to_str().unwrap(),
        ];
        args.extend(extra);
        let (ok, stderr) = launch_run(2, &args, Duration::from_secs(300));
        assert!(ok, "{stderr}");
        assert!(
            stderr.contains("streaming under generate(policy)"),
            "{stderr}"
        );
        runs.push(metrics(&run_dir));
    }
    let halves: Vec<f64> = runs[0].iter().map(|l| num(l, "unstreamed")).collect();
    assert_eq!(halves, [0.0, 1.0, 0.0, 1.0]);
    // Where nothing streams a replica that runs out of samples may take some of another's
    // (`migrate/reallocated`): where they go, not what is computed.
    let results = |m: &[serde_json::Map<String, serde_json::Value>]| -> Vec<_> {
        m.iter()
            .map(|l| {
                let mut l = l.clone();
                l.retain(|k, _| k != "unstreamed" && !k.starts_with("migrate/"));
                l
            })
            .collect()
    };
    same_metrics(&results(&runs[0]), &results(&runs[1]), &["reward_mean"]);
    let _ = std::fs::remove_dir_all(&dir);
}

const SMALL: &str = r#"use std::grpo

model policy = tiny(vocab: "bytes", layers: 1, hidden: 32, heads: 2, seed: 5) {
  train: adamw(lr: 1e-3)
}

dataset prompts = synthetic::letters(count: 256, seed: 2)

fn vowels(s: Sample) -> float {
  count(s.completion, r"[aeiou]") / max(len(s.completion), 1)
}

run grpo(policy, prompts, reward: vowels) {
  steps: 30
  batch: 8
  group: 2
  max_new_tokens: 8
  checkpoint_every: 2
}
"#;

/// A rank killed with SIGKILL in the middle of a run makes the other exit non-zero within 60 s
/// with a message naming the dead rank; every checkpoint left is whole; `--resume` on 2 ranks
/// then finishes the run with every step recorded once.
#[test]
fn a_killed_rank_is_named_and_the_run_resumes() {
    let dir = tmp("kill");
    let file = dir.join("small.rlhf");
    std::fs::write(&file, SMALL).unwrap();
    let run_dir = dir.join("run");
    let mut job = Job::start(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--grace",
        "60",
        "run",
        file.to_str().unwrap(),
        "--run-dir",
        run_dir.to_str().unwrap(),
    ]);
    job.wait_for("5 steps were recorded", Duration::from_secs(300), |_| {
        std::fs::read_to_string(run_dir.join("metrics.jsonl"))
            .map(|t| t.lines().count())
            .unwrap_or(0)
            >= 5
    });
    let pids = rank_pids(&job.stderr());
    let victim = pids.iter().find(|(r, _)| *r == 1).expect("rank 1's pid").1;
    Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .unwrap();
    let killed_at = Instant::now();
    let status = job.wait(Duration::from_secs(120));
    let waited = killed_at.elapsed();
    let stderr = job.stderr();
    assert!(!status.success(), "{stderr}");
    assert!(
        waited < Duration::from_secs(60),
        "took {waited:?} to stop:\n{stderr}"
    );
    // Rank 0 names rank 1 as the dead peer.
    assert!(
        stderr
            .lines()
            .any(|l| l.starts_with("error: rank 0:") && l.contains("rank 1") && l.contains("dead")),
        "{stderr}"
    );
    drop(job);
    let recorded = metrics(&run_dir).len();
    for entry in std::fs::read_dir(run_dir.join("checkpoints")).unwrap() {
        let p = entry.unwrap().path();
        if p.file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("step-")
        {
            assert!(
                p.join("state.json").exists(),
                "{} is incomplete",
                p.display()
            );
        }
    }
    let (ok, stderr) = launch_run(
        2,
        &["--resume", run_dir.to_str().unwrap()],
        Duration::from_secs(600),
    );
    assert!(ok, "{stderr}");
    assert!(stderr.contains("resuming"), "{stderr}");
    let m = metrics(&run_dir);
    let steps: Vec<f64> = m.iter().map(|l| num(l, "step")).collect();
    assert_eq!(
        steps,
        (1..=30).map(f64::from).collect::<Vec<_>>(),
        "steps lost or repeated"
    );
    assert!(recorded >= 5);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A program that declares its cluster is planned for it: launched into a world of another
/// size, every rank refuses before any work, saying why; and one process refuses it too.
#[test]
fn a_world_that_does_not_match_the_declared_cluster_is_refused() {
    let dir = tmp("mismatch");
    let file = dir.join("four.rlhf");
    std::fs::write(&file, format!("{SMALL}\ncluster {{ cpus: 4 }}\n")).unwrap();
    let run_dir = dir.join("run");
    let (ok, stderr) = launch_run(
        2,
        &[
            file.to_str().unwrap(),
            "--run-dir",
            run_dir.to_str().unwrap(),
        ],
        Duration::from_secs(300),
    );
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains("is for 4 devices (4xcpu) but this run has 2 processes"),
        "{stderr}"
    );
    assert!(!run_dir.join("metrics.jsonl").exists());
    let out = run_one(&[
        file.to_str().unwrap(),
        "--run-dir",
        run_dir.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("this run has 1 process"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `braid generate` under `braid launch`: each rank generates a block of the prompts and rank
/// 0 prints them all (ordered by prompt and sample), in the form and with the texts one
/// process gives.
#[test]
fn generate_on_two_ranks_prints_what_one_process_does() {
    let dir = tmp("generate");
    let prompts = dir.join("p.jsonl");
    std::fs::write(&prompts, "\"one\"\n\"two prompts\"\n\"three\"\n").unwrap();
    let args = [
        "generate",
        "--model",
        "tiny",
        "--prompts",
        prompts.to_str().unwrap(),
        "--n",
        "2",
        "--max-new-tokens",
        "12",
        "--seed",
        "9",
        "--format",
        "json",
    ];
    let one = braid().args(args).output().unwrap();
    assert!(
        one.status.success(),
        "{}",
        String::from_utf8_lossy(&one.stderr)
    );
    let mut all = vec!["launch", "--nproc-per-node", "2", "--grace", "30"];
    all.extend_from_slice(&args);
    let two = braid().args(&all).output().unwrap();
    let stderr = String::from_utf8_lossy(&two.stderr).into_owned();
    // End the ranks whatever happened.
    for (_, pid) in rank_pids(&stderr) {
        let _ = Command::new("kill")
            .args(["-9", &pid.to_string()])
            .stderr(Stdio::null())
            .status();
    }
    assert!(two.status.success(), "{stderr}");
    // One process prints samples as they finish; rank 0 prints them by prompt and sample.
    let sorted = |b: &[u8]| {
        let mut v: Vec<String> = String::from_utf8_lossy(b)
            .lines()
            .map(String::from)
            .collect();
        v.sort();
        v
    };
    assert_eq!(sorted(&two.stdout), sorted(&one.stdout));
    assert_eq!(String::from_utf8_lossy(&one.stdout).lines().count(), 6);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The fixture models of braid-runtime's parity tests (Hugging Face directories made by
/// transformers).
fn runtime_fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("runtime/tests/fixtures")
        .join(name)
}

/// `braid generate --tp 2` under `braid launch`: on 2 processes (one replica cut in two) and
/// on 4 (two replicas), greedy generation from Hugging Face directories of each architecture
/// prints the texts and tokens one process prints, in the same form.
#[test]
fn tensor_parallel_generate_prints_what_one_process_does() {
    let dir = tmp("generate-tp");
    let prompts = dir.join("p.jsonl");
    std::fs::write(&prompts, "\"one\"\n\"two prompts\"\n\"three\"\n").unwrap();
    // What must agree exactly: everything but the log-probabilities, which are sums in another
    // order (within 1e-4).
    let parse = |text: &str| -> Vec<(String, Vec<f64>)> {
        let mut v: Vec<(String, Vec<f64>)> = text
            .lines()
            .map(|l| {
                let mut j: serde_json::Value = serde_json::from_str(l).unwrap();
                let lp = j["logprobs"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect();
                j["logprobs"] = serde_json::Value::Null;
                (j.to_string(), lp)
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    for (model, processes) in [
        ("llama_gqa", 2),
        ("qwen2_bias", 2),
        ("mistral_window", 2),
        ("gpt2", 2),
        ("llama_tied", 4),
    ] {
        let path = runtime_fixture(model);
        let args = [
            "generate",
            "--model",
            path.to_str().unwrap(),
            "--prompts",
            prompts.to_str().unwrap(),
            "--greedy",
            "--max-new-tokens",
            "10",
            "--format",
            "json",
        ];
        let one = braid().args(args).output().unwrap();
        assert!(
            one.status.success(),
            "{}",
            String::from_utf8_lossy(&one.stderr)
        );
        let np = processes.to_string();
        let mut all = vec!["launch", "--nproc-per-node", &np, "--grace", "30"];
        all.extend_from_slice(&args);
        all.extend_from_slice(&["--tp", "2"]);
        let mut job = Job::start(&all);
        let status = job.wait(Duration::from_secs(300));
        assert!(status.success(), "{model}: {}", job.stderr());
        let (want, got) = (
            parse(&String::from_utf8_lossy(&one.stdout)),
            parse(&job.stdout()),
        );
        assert_eq!(want.len(), 3, "{model}");
        assert_eq!(
            want.iter().map(|w| &w.0).collect::<Vec<_>>(),
            got.iter().map(|g| &g.0).collect::<Vec<_>>(),
            "{model} on {processes} processes"
        );
        for (w, g) in want.iter().zip(&got) {
            for (a, b) in w.1.iter().zip(&g.1) {
                assert!(
                    (a - b).abs() < 1e-4,
                    "{model}: log-probability {a} against {b}"
                );
            }
        }
    }
    // --tp without enough processes says how to launch it.
    let out = braid()
        .args(["generate", "--model", "tiny", "--prompt", "a", "--tp", "2"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("braid launch --nproc-per-node 2"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `ppo_tiny` with room for a long tail (32 new tokens), written next to the example (its
/// reward model's path is relative) for `ranks` CPU ranks with `schedule` appended.
fn long_tail_program(tag: &str, ranks: usize, schedule: &str) -> std::path::PathBuf {
    let src = std::fs::read_to_string("examples/ppo_tiny.rlhf").unwrap();
    let text = src
        .replace("steps: 80", "steps: 40")
        .replace("max_new_tokens: 16", "max_new_tokens: 32");
    let file = Path::new("examples").join(format!(".{tag}-{}.rlhf", std::process::id()));
    std::fs::write(
        &file,
        format!("{text}\ncluster {{ cpus: {ranks} }}\nschedule {{\n  {schedule}\n}}\n"),
    )
    .unwrap();
    file
}

/// Log-normal output lengths with a long tail (median 9 of at most 32 tokens).
const LONG_TAIL: &str = "lognormal:2.2,0.7,32";

/// A run whose tail migrated: in every step the kept and released replicas met (the
/// counter reached `R_t`), samples and bytes moved in some, and streamed inference was partly
/// hidden; PPO's reward rose over the run.
fn assert_migrated_and_learned(run: &[serde_json::Map<String, serde_json::Value>]) {
    assert_eq!(run.len(), 40);
    for m in run {
        assert_eq!(num(m, "migrate/happened"), 1.0, "step {}", m["step"]);
        assert_eq!(num(m, "migrate/threshold"), 4.0, "step {}", m["step"]);
        let hidden = num(m, "time/infer_hidden");
        assert!(
            (0.0..=1.0).contains(&hidden),
            "step {}: {hidden}",
            m["step"]
        );
    }
    let moved: f64 = run.iter().map(|m| num(m, "migrate/samples")).sum();
    let bytes: f64 = run.iter().map(|m| num(m, "migrate/bytes")).sum();
    assert!(
        moved >= 10.0 && bytes > 1e4 * moved,
        "{moved} samples, {bytes} bytes"
    );
    assert!(run.iter().any(|m| num(m, "time/infer_hidden") > 0.0));
    let mean = |r: &[serde_json::Map<String, serde_json::Value>]| {
        r.iter().map(|l| num(l, "reward_mean")).sum::<f64>() / r.len() as f64
    };
    let (first, last) = (mean(&run[..5]), mean(&run[35..]));
    assert!(
        last > 1.3 * first,
        "PPO's reward did not rise: {first} → {last}"
    );
}

/// Long-tail migration at run time on 2 ranks: `ppo_tiny` with log-normal output lengths and
/// `migrate below 25%` hands the last 4 unfinished samples of rank 1 to rank 0 (with their KV
/// caches), learns, and reports what moved and the share of inference hidden; the same seed
/// with `migrate off` samples the same texts over all 40 steps, as does `fuse off` (nothing
/// streamed: a replica that runs out takes samples from the other), as do migrating by
/// re-prefill over its 8 and `fuse off` with `--reallocate off` over its 3.
#[test]
fn ppo_tiny_migrates_its_long_tail_on_2_ranks_and_samples_the_same_texts() {
    let dir = tmp("tail2");
    let on = long_tail_program("tail2-on", 2, "migrate below 25%");
    let off = long_tail_program("tail2-off", 2, "migrate off");
    let whole = long_tail_program("tail2-whole", 2, "fuse off");
    let run = |file: &Path, out: &Path, extra: &[&str]| {
        let mut args = vec![
            file.to_str().unwrap(),
            "--run-dir",
            out.to_str().unwrap(),
            "--gen-lengths",
            LONG_TAIL,
            "--checkpoint-every",
            "0",
        ];
        args.extend_from_slice(extra);
        launch_run(2, &args, Duration::from_secs(600))
    };
    let (a, b, c, d, e) = (
        dir.join("on"),
        dir.join("off"),
        dir.join("prefill"),
        dir.join("whole"),
        dir.join("alone"),
    );
    let on_run = run(&on, &a, &[]);
    let off_run = run(&off, &b, &[]);
    let prefill_run = run(&on, &c, &["--steps", "8", "--migrate-with", "prefill"]);
    let whole_run = run(&whole, &d, &[]);
    let alone_run = run(&whole, &e, &["--steps", "3", "--reallocate", "off"]);
    for f in [&on, &off, &whole] {
        let _ = std::fs::remove_file(f);
    }
    for (ok, stderr) in [&on_run, &off_run, &prefill_run, &whole_run, &alone_run] {
        assert!(ok, "{stderr}");
    }
    assert!(
        on_run.1.contains("migrating generate(policy)'s tail"),
        "{}",
        on_run.1
    );
    let (with, without, refilled, batched, alone) = (
        metrics(&a),
        metrics(&b),
        metrics(&c),
        metrics(&d),
        metrics(&e),
    );
    assert_migrated_and_learned(&with);
    assert!(without.iter().all(|m| !m.contains_key("migrate/happened")));
    // Every rank streams inference under generation: no replica is idle, none asks.
    assert!(without.iter().all(|m| num(m, "migrate/reallocated") == 0.0));
    // Without streaming, a replica that ran out takes some of the other's samples.
    let given = batched
        .iter()
        .map(|m| num(m, "migrate/reallocated"))
        .sum::<f64>();
    eprintln!("reallocated without streaming: {given} samples in 40 steps");
    assert!(given > 0.0, "no sample reallocated in 40 steps");
    assert!(alone.iter().all(|m| !m.contains_key("migrate/reallocated")));
    assert!(
        refilled
            .iter()
            .any(|m| num(m, "migrate/prefill_tokens") > 0.0),
        "no started sample prefilled again in 8 steps: {:?}",
        refilled
            .iter()
            .map(|m| (num(m, "migrate/samples"), num(m, "migrate/prefill_tokens")))
            .collect::<Vec<_>>()
    );
    assert!(refilled.iter().all(|m| num(m, "migrate/kv") == 0.0));
    // The same texts: every step's mean length and the mean and spread of its rewards (over
    // all 16 samples, the migrated ones among them), and the recorded completions (those of
    // the first prompts).
    for other in [&without, &refilled, &batched, &alone] {
        for (x, y) in with.iter().zip(other.iter()) {
            assert_eq!(num(x, "response_length"), num(y, "response_length"));
            assert!(close(num(x, "reward_mean"), num(y, "reward_mean")));
            assert!(close(num(x, "reward_std"), num(y, "reward_std")));
        }
    }
    let texts = |d: &Path, last: i64| -> Vec<(String, String)> {
        std::fs::read_to_string(d.join("samples.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|v| v["step"].as_i64().unwrap() <= last)
            .map(|v| (v["prompt"].to_string(), v["completion"].to_string()))
            .collect()
    };
    assert_eq!(texts(&a, 40).len(), 4 * 40);
    assert_eq!(texts(&a, 40), texts(&b, 40));
    assert_eq!(texts(&a, 8), texts(&c, 8));
    assert_eq!(texts(&a, 40), texts(&d, 40));
    assert_eq!(texts(&a, 3), texts(&e, 3));
    // Samples given to rank 0 before the tail (when it ran out first and the cost model said
    // it pays: how often depends on the ranks' timing) are among those compared.
    let given: f64 = with.iter().map(|m| num(m, "migrate/reallocated")).sum();
    eprintln!("reallocated before the tail: {given} samples in 40 steps");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The same on 4 ranks: ranks 1–3 release their tails to rank 0 and run the streamed
/// inference the plan moved onto them; the run learns as on 2 ranks.
#[test]
fn ppo_tiny_migrates_its_long_tail_on_4_ranks_and_learns() {
    let dir = tmp("tail4");
    let file = long_tail_program("tail4", 4, "migrate below 25%");
    let out = dir.join("run");
    let (ok, stderr) = launch_run(
        4,
        &[
            file.to_str().unwrap(),
            "--run-dir",
            out.to_str().unwrap(),
            "--gen-lengths",
            LONG_TAIL,
            "--checkpoint-every",
            "0",
        ],
        Duration::from_secs(900),
    );
    let _ = std::fs::remove_file(&file);
    assert!(ok, "{stderr}");
    let run = metrics(&out);
    assert_migrated_and_learned(&run);
    assert!(run.iter().all(|m| num(m, "migrate/kept") == 1.0));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Tensor-parallel generation replicas migrate too: on 4 ranks, generation `tp 2` over 2
/// replicas hands replica 1's tail to replica 0, each tensor rank its own shard of every
/// sample's cache (or the kept replica prefills them again, its collectives in step), and its
/// texts are those of a run that neither migrates nor reallocates.
#[test]
fn tensor_parallel_generation_replicas_migrate_their_tail_with_the_same_texts() {
    let dir = tmp("tail-tp");
    let on = long_tail_program(
        "tail-tp-on",
        4,
        "migrate below 25%\n  place generate(policy) on 0..4 tp 2\n  place logprobs(policy) on 0..4 tp 2",
    );
    let off = long_tail_program(
        "tail-tp-off",
        4,
        "migrate off\n  place generate(policy) on 0..4 tp 2\n  place logprobs(policy) on 0..4 tp 2",
    );
    let run = |file: &Path, out: &Path, extra: &[&str]| {
        let mut args = vec![
            file.to_str().unwrap(),
            "--run-dir",
            out.to_str().unwrap(),
            "--gen-lengths",
            LONG_TAIL,
            "--checkpoint-every",
            "0",
            "--steps",
            "6",
        ];
        args.extend_from_slice(extra);
        launch_run(4, &args, Duration::from_secs(900))
    };
    let (a, b, c) = (dir.join("on"), dir.join("off"), dir.join("prefill"));
    let on_run = run(&on, &a, &[]);
    let off_run = run(&off, &b, &["--reallocate", "off"]);
    let prefill_run = run(&on, &c, &["--migrate-with", "prefill"]);
    let _ = std::fs::remove_file(&on);
    let _ = std::fs::remove_file(&off);
    for (ok, stderr) in [&on_run, &off_run, &prefill_run] {
        assert!(ok, "{stderr}");
    }
    assert!(
        on_run.1.contains("migrating generate(policy)'s tail"),
        "{}",
        on_run.1
    );
    let (with, without, refilled) = (metrics(&a), metrics(&b), metrics(&c));
    assert_eq!(with.len(), 6);
    assert!(
        refilled
            .iter()
            .any(|m| num(m, "migrate/prefill_tokens") > 0.0)
    );
    for m in &with {
        assert_eq!(num(m, "migrate/happened"), 1.0, "step {}", m["step"]);
    }
    let moved: f64 = with.iter().map(|m| num(m, "migrate/samples")).sum();
    assert!(moved > 0.0, "no sample moved");
    assert!(
        without
            .iter()
            .all(|m| !m.contains_key("migrate/reallocated"))
    );
    for (x, y) in with.iter().zip(without.iter()) {
        assert_eq!(num(x, "response_length"), num(y, "response_length"));
        assert!(close(num(x, "reward_mean"), num(y, "reward_mean")));
    }
    let texts = |d: &Path| std::fs::read_to_string(d.join("samples.jsonl")).unwrap();
    let (tw, to, tp) = (texts(&a), texts(&b), texts(&c));
    assert!(!tw.is_empty());
    for other in [&to, &tp] {
        assert_eq!(tw.lines().count(), other.lines().count());
        for (x, y) in tw.lines().zip(other.lines()) {
            let (x, y): (serde_json::Value, serde_json::Value) = (
                serde_json::from_str(x).unwrap(),
                serde_json::from_str(y).unwrap(),
            );
            assert_eq!(x["completion"], y["completion"]);
        }
    }
    let sum = |k: &str| with.iter().map(|m| num(m, k)).sum::<f64>();
    eprintln!(
        "tensor-parallel tail: {} samples moved, {} bytes, {} reallocated in 6 steps",
        sum("migrate/samples"),
        sum("migrate/bytes"),
        sum("migrate/reallocated")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A migration the plan chose without a pin is re-chosen after every iteration from the lengths
/// that iteration produced (the plan simulated with them): the first step migrates at the
/// plan's `R_t`, later ones at what the observed lengths choose — here, not at all in some
/// steps and at other thresholds in others — and the texts do not change.
#[test]
fn an_unpinned_migration_is_rechosen_from_the_lengths_observed() {
    let dir = tmp("retune");
    let emit = |tag: &str, plan: &Path| {
        let file = long_tail_program(tag, 2, "migrate below 25%");
        let out = braid()
            .args([
                "plan",
                file.to_str().unwrap(),
                "--gen-lengths",
                LONG_TAIL,
                "--emit",
            ])
            .arg(plan)
            .output()
            .unwrap();
        let _ = std::fs::remove_file(&file);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let (free, fixed) = (dir.join("unpinned.json"), dir.join("pinned.json"));
    emit("retune", &free);
    emit("retune-pinned", &fixed);
    // The same decision, as the planner would record it unpinned.
    let mut p: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&free).unwrap()).unwrap();
    let migrations = p["decisions"]["migrations"].as_object_mut().unwrap();
    assert_eq!(migrations.len(), 1);
    for m in migrations.values_mut() {
        m.as_object_mut().unwrap().remove("pinned");
    }
    std::fs::write(&free, serde_json::to_string(&p).unwrap()).unwrap();
    let (a, b) = (dir.join("unpinned"), dir.join("pinned"));
    let mut runs = Vec::new();
    for (plan, out) in [(&free, &a), (&fixed, &b)] {
        runs.push(launch_run(
            2,
            &[
                plan.to_str().unwrap(),
                "--run-dir",
                out.to_str().unwrap(),
                "--gen-lengths",
                LONG_TAIL,
                "--steps",
                "6",
                "--checkpoint-every",
                "0",
            ],
            Duration::from_secs(600),
        ));
    }
    for (ok, stderr) in &runs {
        assert!(ok, "{stderr}");
    }
    assert!(
        runs[0].1.contains("re-chosen each iteration"),
        "{}",
        runs[0].1
    );
    let (unpinned, pinned) = (metrics(&a), metrics(&b));
    let thresholds: Vec<f64> = unpinned
        .iter()
        .map(|m| num(m, "migrate/threshold"))
        .collect();
    assert_eq!(thresholds[0], 4.0);
    assert!(thresholds[1..].iter().any(|t| *t != 4.0), "{thresholds:?}");
    assert!(pinned.iter().all(|m| num(m, "migrate/threshold") == 4.0));
    for (x, y) in unpinned.iter().zip(&pinned) {
        assert_eq!(num(x, "response_length"), num(y, "response_length"));
        assert!(close(num(x, "reward_mean"), num(y, "reward_mean")));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `braid launch … calibrate` on 2 ranks measures the all-reduce over Gloo and writes one
/// profile (rank 0's) with the measured collective constants in place of the datasheet's.
#[test]
fn calibrate_on_two_ranks_measures_the_all_reduce_and_the_ranks_spread() {
    let dir = tmp("calibrate");
    let path = dir.join("cpu2.json");
    let mut job = Job::start(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--grace",
        "30",
        "calibrate",
        "--min-seconds",
        "0.01",
        "-o",
        path.to_str().unwrap(),
    ]);
    let status = job.wait(Duration::from_secs(300));
    assert!(status.success(), "{}", job.stderr());
    let out = job.stdout();
    assert!(out.contains("all-reduce over 2 ranks"), "{out}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let d = &v["device"];
    assert_eq!(d["network_efficiency"], 1.0);
    assert!(d["intra_node_latency"].as_f64().unwrap() > 0.0);
    assert!(d["intra_node_bandwidth"].as_f64().unwrap() > 0.0);
    assert_eq!(v["measured"]["ranks"], 2, "{}", v["measured"]);
    let points = v["measured"]["timings"]["allreduce"].as_array().unwrap();
    assert!(points.len() >= 2, "{points:?}");
    // The ranks' spread on the same work: one excess per repetition, the spread fitted from
    // them (absent from the profile only when it came out zero), and said.
    let excess = v["measured"]["timings"]["rank_excess"].as_array().unwrap();
    assert_eq!(excess.len(), 24, "{excess:?}");
    assert!(
        excess.iter().all(|x| x.as_f64().unwrap() >= 0.0),
        "{excess:?}"
    );
    let spread = d.get("rank_spread").map_or(0.0, |x| x.as_f64().unwrap());
    assert!((0.0..1.0).contains(&spread), "{spread}");
    assert!(
        out.contains("the same work started on 2 ranks at once"),
        "{out}"
    );
}

/// A rank that generates and streams the policy's log-probabilities but does not train it
/// (its own generation copy), calls on disjoint ranks that run side by side (the critic's
/// training on rank 1 while the policy trains on rank 0, the policy's reshard after both),
/// and streaming that changes when the calls compute, never what.
#[test]
fn a_rank_that_only_generates_and_scores_streams_and_trains_beside_the_other() {
    let dir = tmp("side");
    let file = pinned_ppo_tiny(
        "side",
        4,
        &[
            "generate(policy) on 0..2",
            "logprobs(policy) on 1..2",
            "logprobs(ref) on 0..1",
            "train(policy) on 0..1",
            "values(critic) on 0..2",
            "score(reward_model) on 0..2",
            "train(critic) on 1..2",
        ],
    );
    let mut runs = Vec::new();
    for (name, extra) in [("fused", None), ("unfused", Some("--no-fuse"))] {
        let run_dir = dir.join(name);
        let mut args = vec!["--gen-lengths", "fixed:16"];
        args.extend(extra);
        let (ok, stderr) = run_pinned(&file, &run_dir, &args, Duration::from_secs(600));
        if !ok {
            let _ = std::fs::remove_file(&file);
            panic!("{name}: {stderr}");
        }
        if extra.is_none() {
            // The case under test: rank 1 streams the policy's log-probabilities.
            assert!(
                stderr
                    .lines()
                    .any(|l| l.starts_with("streaming under generate(policy): logprobs(policy)")),
                "{stderr}"
            );
        }
        runs.push(run_dir);
    }
    let _ = std::fs::remove_file(&file);
    let (fused, unfused) = (metrics(&runs[0]), metrics(&runs[1]));
    assert_eq!(fused.len(), 4);
    for (a, b) in fused.iter().zip(&unfused) {
        for k in ["reward_mean", "kl", "policy/loss", "critic/loss"] {
            assert!((num(a, k) - num(b, k)).abs() < TOL, "{k}: {a:?} vs {b:?}");
        }
    }
    // On rank 1 the policy's weights move to it after the critic trained there, not before.
    let timeline: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(runs[1].join("timeline.json")).unwrap())
            .unwrap();
    let span = |rank: usize, name: &str, cat: &str| {
        timeline["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["tid"] == rank && e["name"] == name && e["cat"] == cat)
            .map(|e| (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap()))
            .unwrap_or_else(|| panic!("no {name} {cat} span on rank {rank}: {timeline}"))
    };
    let (critic, critic_dur) = span(1, "train(critic)", "train");
    let (reshard, _) = span(1, "train(policy)", "transfer");
    assert!(reshard >= critic + critic_dur, "{timeline}");
    // On rank 0 the weights `logprobs(policy)` read on rank 1 move to the policy's training
    // after rank 0's own inference calls, as the plan runs them beside rank 1's: rank 0 does
    // not wait for rank 1 to finish before it starts its own.
    let (reference, reference_dur) = span(0, "logprobs(ref)", "inference");
    let (score, score_dur) = span(0, "score(rm)", "inference");
    let (to_training, _) = span(0, "logprobs(policy)", "transfer");
    assert!(
        to_training >= (reference + reference_dur).max(score + score_dur),
        "{timeline}"
    );
}

/// The CPUs process `pid` may run on (`Cpus_allowed_list` of its status), or `None` once it
/// has exited.
fn allowed_cpus(pid: u32) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|l| l.trim().to_string())
}

/// `braid launch` binds each rank to cores of its own where there is one per rank, and
/// `--cpu-bind cores` refuses more ranks than cores.
#[test]
#[cfg(target_os = "linux")]
fn ranks_are_bound_to_cores_of_their_own_or_refused() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // More ranks than cores: refused before any rank starts.
    let np = (cores + 1).to_string();
    let out = braid()
        .args([
            "launch",
            "--nproc-per-node",
            &np,
            "--cpu-bind",
            "cores",
            "run",
        ])
        .arg("examples/ppo_tiny.rlhf")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("--cpu-bind cores: {np} ranks on {cores} core")),
        "{stderr}"
    );
    assert!(rank_pids(&stderr).is_empty(), "no rank starts: {stderr}");
    if cores < 2 {
        return;
    }
    // Two ranks: each on its own block of the cores, read from the kernel while they run.
    let dir = tmp("bind");
    let run_dir = dir.join("run");
    let mut job = Job::start(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--cpu-bind",
        "cores",
        "--grace",
        "30",
        "run",
        "examples/ppo_tiny.rlhf",
        "--steps",
        "200",
        "--run-dir",
        run_dir.to_str().unwrap(),
    ]);
    // A rank's pid is `taskset`'s until it has set the affinity and exec'd the rank: read the
    // cores only after that.
    let execed = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() != "taskset")
    };
    job.wait_for(
        "both ranks and their cores were reported, and both ranks started",
        Duration::from_secs(60),
        |j| {
            let pids = rank_pids(&j.stderr());
            pids.len() == 2
                && j.stderr().contains("braid launch: cores:")
                && pids.iter().all(|(_, p)| execed(*p))
        },
    );
    let pids = rank_pids(&job.stderr());
    let lists: Vec<String> = pids
        .iter()
        .map(|(r, p)| allowed_cpus(*p).unwrap_or_else(|| panic!("rank {r} (pid {p}) is gone")))
        .collect();
    let stderr = job.stderr();
    for ((r, _), list) in pids.iter().zip(&lists) {
        assert!(
            stderr.contains(&format!("rank {r} on {list}")),
            "rank {r} runs on {list}, which the launcher did not say:\n{stderr}"
        );
    }
    let sets: Vec<Vec<usize>> = lists
        .iter()
        .map(|l| {
            l.split(',')
                .flat_map(|p| match p.split_once('-') {
                    Some((a, b)) => (a.parse::<usize>().unwrap()..=b.parse().unwrap()).collect(),
                    None => vec![p.parse().unwrap()],
                })
                .collect()
        })
        .collect();
    assert!(sets.iter().all(|s| !s.is_empty()), "{lists:?}");
    assert!(
        sets[0].iter().all(|c| !sets[1].contains(c)),
        "the ranks share cores: {lists:?}"
    );
    assert_eq!(sets[0].len() + sets[1].len(), cores, "{lists:?}");
    drop(job);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A step without streaming, with the critic's inference on rank 0, its training on rank 1
/// and the policy's training on rank 0: the critic's weights move to rank 1 before rank 0
/// trains the policy, so that the two trainings run side by side. Held until just before
/// `train(critic)`, which comes after `train(policy)` in the order, the transfer waited on
/// rank 0's training and the trainings ran one after the other (docs/benchmarks.md, stop 44).
#[test]
fn a_transfer_is_not_held_past_a_training_on_the_rank_it_leaves_from() {
    let dir = tmp("apart");
    let file = pinned_ppo_tiny(
        "apart",
        2,
        &[
            "generate(policy) on 0..2",
            "logprobs(policy) on 0..2",
            "logprobs(ref) on 0..2",
            "values(critic) on 0..1",
            "score(reward_model) on 0..2",
            "train(policy) on 0..1",
            "train(critic) on 1..2",
        ],
    );
    let run_dir = dir.join("run");
    let (ok, stderr) = run_pinned(
        &file,
        &run_dir,
        &["--gen-lengths", "fixed:16", "--no-fuse"],
        Duration::from_secs(600),
    );
    let _ = std::fs::remove_file(&file);
    assert!(ok, "{stderr}");
    let timeline: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("timeline.json")).unwrap())
            .unwrap();
    let start = |rank: usize, name: &str, cat: &str| {
        timeline["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["tid"] == rank && e["name"] == name && e["cat"] == cat)
            .map(|e| e["ts"].as_f64().unwrap())
            .unwrap_or_else(|| panic!("no {name} {cat} span on rank {rank}: {timeline}"))
    };
    // On rank 0: the critic's weights leave (the transfers after `values(critic)`) before it
    // trains the policy.
    let moved = start(0, "values(critic)", "transfer");
    let trains = start(0, "train(policy)", "train");
    assert!(moved < trains, "{timeline}");
}
