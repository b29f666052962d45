//! `braid report RUN_DIR --against-sim`: a run's measured iteration and stage times beside
//! what the simulator predicts for the plan the run executed, on the same workload — the
//! plan's generated-length distribution (the one `braid run --gen-lengths` imposed, when it
//! was given), the prompts' mean length as the run recorded it and their lengths
//! (`RUN_DIR/prompt-lengths.txt`, which micro-batches pad to) — and, given a run of the
//! same program without streaming — or for a run that alternated streaming step by step
//! (`braid run --alternate-streaming`), its steps without streaming — the measured and the
//! predicted gain of streaming.

use std::fmt::Write as _;
use std::path::Path;

use braid_cost::sim::SimOptions;
use braid_ir::exec_plan::ExecPlan;
use braid_passes::annotated::Annotated;
use braid_passes::to_sim::{simulate_plan, summarise};

/// Seconds per iteration, by stage.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Times {
    pub iteration: f64,
    pub generation: f64,
    /// Inference left after the generation ended.
    pub inference_after_generation: f64,
    pub training: f64,
}

/// One run against its prediction.
#[derive(Clone, Debug, PartialEq)]
pub struct RunAgainstSim {
    pub run_dir: String,
    /// Steps whose times are averaged (the first, warm-up step is left out when there are
    /// more).
    pub steps: usize,
    pub prompt_len: u64,
    pub measured: Times,
    pub predicted: Times,
    /// Predicted over measured iteration time, less one (−0.1: predicted 10 % short).
    pub iteration_error: f64,
    /// Whether the run recorded `time/after_generate`; if not, the measured inference after
    /// the generation is its rollout phase less its generation (said in the text).
    pub after_generation_recorded: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct AgainstSim {
    pub device: String,
    pub run: RunAgainstSim,
    pub unfused: Option<RunAgainstSim>,
    /// Unfused over fused iteration time: measured and predicted.
    pub streaming_gain: Option<(f64, f64)>,
    /// Whether the run without streaming executed the same plan as the run (the planner
    /// streamed nothing in it): then any measured gain is the machine's run-to-run variation.
    pub same_plan: Option<bool>,
    /// Whether the two come from one run that alternated streaming step by step (`braid run
    /// --alternate-streaming`): measured side by side, the machine's drift on both alike.
    pub alternating: bool,
    /// The simulated iteration of the run's plan, and its device count (for `--trace`).
    pub simulated: (braid_cost::sim::SimReport, usize),
}

type Fail = (String, u8);

/// Whether two plans run the same work: the same program, cluster and decisions, whatever
/// their notes on what was not done and their searches' records say.
fn same_work(a: &ExecPlan, b: &ExecPlan) -> bool {
    let decided = |p: &ExecPlan| {
        let mut d = p.decisions.clone();
        d.notes.clear();
        d.passes_run.clear();
        d.search = None;
        d.placement_why.clear();
        d
    };
    a.plan == b.plan && a.cluster == b.cluster && decided(a) == decided(b)
}

type OneRun = (
    RunAgainstSim,
    String,
    braid_cost::sim::SimReport,
    usize,
    ExecPlan,
);

/// Which of a run's steps are compared: all of them, or one half of a run that alternated
/// streaming (`braid run --alternate-streaming`, which records `unstreamed` per step).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Half {
    All,
    Streamed,
    Unstreamed,
}

/// Whether the run alternated streaming step by step.
fn alternates(dir: &Path) -> Result<bool, Fail> {
    let (_, rows) = crate::report::read_metrics(dir)?;
    Ok(rows.iter().any(|r| r.contains_key("unstreamed")))
}

fn one_run(
    dir: &Path,
    profile: Option<&braid_cost::cost::DeviceSpec>,
    half: Half,
) -> Result<OneRun, Fail> {
    let (_, rows) = crate::report::read_metrics(dir)?;
    let rows: Vec<_> = match half {
        Half::All => rows,
        Half::Streamed | Half::Unstreamed => {
            let off = half == Half::Unstreamed;
            // A step without the mark (a run resumed without the flag) belongs to neither.
            let half: Vec<_> = rows
                .into_iter()
                .filter(|r| r.get("unstreamed").is_some_and(|v| (*v > 0.5) == off))
                .collect();
            if half.is_empty() {
                return Err((
                    format!(
                        "{}: no step {} streaming recorded (a run of --alternate-streaming runs its 2nd, 4th, … step without)",
                        dir.join("metrics.jsonl").display(),
                        if off { "without" } else { "with" }
                    ),
                    1,
                ));
            }
            half
        }
    };
    let plan_path = dir.join("plan.json");
    let text = std::fs::read_to_string(&plan_path)
        .map_err(|e| (format!("{}: cannot read: {e}", plan_path.display()), 2))?;
    let mut plan =
        ExecPlan::from_json(&text).map_err(|e| (format!("{}: {e}", plan_path.display()), 1))?;
    if let Some(d) = profile {
        if d.kind != plan.cluster.device {
            return Err((
                format!(
                    "the profile is for `{}`, the run in {} ran on `{}`",
                    d.kind.name(),
                    dir.display(),
                    plan.cluster.device.name()
                ),
                2,
            ));
        }
        plan.device = Some(d.clone());
    }
    if half == Half::Unstreamed {
        // Its steps ran the plan with nothing streamed, on the same placement.
        plan.decisions.streams.clear();
    }
    // The steady state: every step after the first (of the half), unless there is only one.
    let used: Vec<_> = if rows.len() > 1 {
        rows[1..].to_vec()
    } else {
        rows.clone()
    };
    if used.is_empty() {
        return Err((
            format!("{}: no steps recorded", dir.join("metrics.jsonl").display()),
            1,
        ));
    }
    let mean = |k: &str| -> f64 {
        used.iter()
            .map(|r| r.get(k).copied().unwrap_or(0.0))
            .sum::<f64>()
            / used.len() as f64
    };
    if used.iter().all(|r| !r.contains_key("time/step")) {
        return Err((
            format!(
                "{}: no `time/step` metric: not a training run of this braid",
                dir.join("metrics.jsonl").display()
            ),
            1,
        ));
    }
    // Inference after the generation as the simulator counts it: from the generation's end
    // to the end of the rollout phase (its inference and exchanges). `time/infer` is the
    // inference's whole time, streamed chunks hidden under the generation included. Runs
    // recorded before `time/after_generate` give the rollout phase less the generation.
    let after_recorded = used.iter().all(|r| r.contains_key("time/after_generate"));
    let measured = Times {
        iteration: mean("time/step"),
        generation: mean("time/generate"),
        inference_after_generation: if after_recorded {
            mean("time/after_generate")
        } else {
            (mean("time/rollout") - mean("time/generate")).max(0.0)
        },
        training: mean("time/train"),
    };
    let prompt = mean("prompt_length");
    if prompt >= 1.0 {
        plan.workload.prompt_len = prompt.round() as u64;
    }
    // The prompts' lengths as the run saw them: micro-batches pad to their longest.
    let prompts_path = dir.join("prompt-lengths.txt");
    if prompts_path.is_file() {
        let text = std::fs::read_to_string(&prompts_path)
            .map_err(|e| (format!("{}: cannot read: {e}", prompts_path.display()), 2))?;
        let d = braid_cost::sim::LengthDist::from_histogram(&text)
            .map_err(|e| (format!("{}: {e}", prompts_path.display()), 1))?;
        plan.workload.prompt_lengths = Some(d);
    }
    let a = Annotated::from_exec_plan(&plan);
    let r = simulate_plan(
        &a,
        true,
        &SimOptions {
            iterations: 1,
            seed: plan.seed,
        },
    )
    .map_err(|e| {
        (
            format!(
                "{}: the plan could not be simulated: {e}",
                plan_path.display()
            ),
            1,
        )
    })?;
    let s = summarise("braid", &r);
    let predicted = Times {
        iteration: s.mean_iteration_seconds,
        generation: s.breakdown.generation,
        inference_after_generation: s.breakdown.inference_after_generation,
        training: s.training_seconds,
    };
    let device = if plan.device.is_some() {
        format!("{} (profile)", plan.cluster)
    } else {
        format!("{} (datasheet)", plan.cluster)
    };
    Ok((
        RunAgainstSim {
            run_dir: dir.display().to_string(),
            steps: used.len(),
            prompt_len: plan.workload.prompt_len,
            iteration_error: predicted.iteration / measured.iteration.max(1e-12) - 1.0,
            after_generation_recorded: after_recorded,
            measured,
            predicted,
        },
        device,
        r,
        plan.cluster.devices() as usize,
        plan,
    ))
}

pub fn against_sim(
    run_dir: &Path,
    profile: Option<&Path>,
    unfused: Option<&Path>,
) -> Result<AgainstSim, Fail> {
    let profile = match profile {
        Some(p) => Some(crate::plan::profile(p).map_err(|e| (e, 2))?),
        None => None,
    };
    let alternating = alternates(run_dir)?;
    let half = if alternating {
        Half::Streamed
    } else {
        Half::All
    };
    let (run, device, report, devices, plan) = one_run(run_dir, profile.as_ref(), half)?;
    let (unfused, same_plan) = match unfused {
        Some(d) if alternating => {
            return Err((
                format!(
                    "{}: the run alternated streaming, its steps without streaming are the comparison; leave out --unfused {}",
                    run_dir.display(),
                    d.display()
                ),
                2,
            ));
        }
        Some(d) => {
            let (u, _, _, _, other) = one_run(d, profile.as_ref(), Half::All)?;
            (Some(u), Some(same_work(&plan, &other)))
        }
        None if alternating => {
            let (u, _, _, _, _) = one_run(run_dir, profile.as_ref(), Half::Unstreamed)?;
            (Some(u), Some(false))
        }
        None => (None, None),
    };
    let streaming_gain = unfused.as_ref().map(|u| {
        (
            u.measured.iteration / run.measured.iteration.max(1e-12),
            u.predicted.iteration / run.predicted.iteration.max(1e-12),
        )
    });
    Ok(AgainstSim {
        device,
        run,
        unfused,
        streaming_gain,
        same_plan,
        alternating,
        simulated: (report, devices),
    })
}

pub fn to_text(c: &AgainstSim) -> String {
    let mut s = String::new();
    let ms = |x: f64| format!("{:.1} ms", x * 1e3);
    let mut table = |r: &RunAgainstSim, title: &str| {
        let _ = writeln!(
            s,
            "{title}: {} ({} steps, prompts of {} tokens)",
            r.run_dir, r.steps, r.prompt_len
        );
        let _ = writeln!(
            s,
            "{:<28} {:>12} {:>12} {:>8}",
            "", "measured", "predicted", "error"
        );
        for (name, m, p) in [
            ("iteration", r.measured.iteration, r.predicted.iteration),
            ("generation", r.measured.generation, r.predicted.generation),
            (
                "inference after generation",
                r.measured.inference_after_generation,
                r.predicted.inference_after_generation,
            ),
            ("training", r.measured.training, r.predicted.training),
        ] {
            let err = if m > 0.0 {
                format!("{:+.0} %", (p / m - 1.0) * 100.0)
            } else {
                "—".into()
            };
            let _ = writeln!(s, "{name:<28} {:>12} {:>12} {:>8}", ms(m), ms(p), err);
        }
        if !r.after_generation_recorded {
            let _ = writeln!(
                s,
                "  (recorded before `time/after_generate`: inference after generation measured as `time/rollout` less `time/generate`)"
            );
        }
    };
    if c.alternating {
        table(
            &c.run,
            &format!("run on {}, its steps with streaming", c.device),
        );
        if let Some(u) = &c.unfused {
            table(
                u,
                "its steps without streaming (the plan with its streams taken out)",
            );
        }
    } else {
        table(&c.run, &format!("run on {}", c.device));
        if let Some(u) = &c.unfused {
            table(u, "without streaming");
        }
    }
    if let Some((m, p)) = c.streaming_gain {
        let _ = writeln!(
            s,
            "gain of streaming (iteration without over with): measured {m:.2}x, predicted {p:.2}x (difference {:+.2}x)",
            p - m
        );
        if let Some(u) = &c.unfused
            && let Some(ratio) = training_control(&c.run, u)
        {
            let _ = writeln!(
                s,
                "  training, priced alike in both plans: measured {} with streaming and {} without ({ratio:.2}x): how far the machine's speed moved between the two {}",
                ms(c.run.measured.training),
                ms(u.measured.training),
                if c.alternating {
                    "halves of the run"
                } else {
                    "runs"
                }
            );
        }
        if c.same_plan == Some(true) {
            let _ = writeln!(
                s,
                "  the two runs executed the same plan (nothing streams in it): the measured gain is the machine's run-to-run variation"
            );
        }
    }
    s
}

/// The measured training time without streaming over the one with, where the two plans price
/// their training alike (streaming leaves it alone, no interleaving of trainings differs): the
/// same work measured twice, the control of the comparison. `None` where the predictions differ
/// or a run recorded no training.
fn training_control(run: &RunAgainstSim, unfused: &RunAgainstSim) -> Option<f64> {
    let (a, b) = (run.predicted.training, unfused.predicted.training);
    let alike = a > 0.0 && (b / a - 1.0).abs() < 1e-9;
    (alike && run.measured.training > 0.0 && unfused.measured.training > 0.0)
        .then(|| unfused.measured.training / run.measured.training)
}

fn times_json(t: &Times) -> serde_json::Value {
    serde_json::json!({
        "iteration": t.iteration,
        "generation": t.generation,
        "inference_after_generation": t.inference_after_generation,
        "training": t.training,
    })
}

fn run_json(r: &RunAgainstSim) -> serde_json::Value {
    serde_json::json!({
        "run_dir": r.run_dir,
        "steps": r.steps,
        "prompt_len": r.prompt_len,
        "measured": times_json(&r.measured),
        "predicted": times_json(&r.predicted),
        "iteration_error": r.iteration_error,
        "after_generation_recorded": r.after_generation_recorded,
    })
}

/// The comparison as JSON (`--json`).
pub fn to_json(c: &AgainstSim) -> serde_json::Value {
    serde_json::json!({
        "device": c.device,
        "run": run_json(&c.run),
        "unfused": c.unfused.as_ref().map(run_json),
        "streaming_gain": c.streaming_gain.map(|(m, p)| serde_json::json!({"measured": m, "predicted": p})),
        "same_plan": c.same_plan,
        "alternating": c.alternating,
        "training_control": c.unfused.as_ref().and_then(|u| training_control(&c.run, u)),
    })
}
