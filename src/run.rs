//! `braid run FILE.rlhf`: check the program, lower its run to a plan, and execute it on the
//! runtime with checkpoints and metrics in a run directory. `--resume RUN_DIR` continues a run
//! from its latest checkpoint.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use braid_runtime::exec::{Event, Executor, RunOptions};

use crate::diag::{self, DiskLoader, Format};

#[derive(clap::Args)]
pub struct Args {
    /// The program to run (optional with --resume: the run directory records it).
    file: Option<PathBuf>,
    /// Where checkpoints, metrics.jsonl and the plan go (default: runs/<program name>).
    #[arg(long, value_name = "DIR")]
    run_dir: Option<PathBuf>,
    /// Continue the run in RUN_DIR from its latest checkpoint.
    #[arg(long, value_name = "RUN_DIR", conflicts_with = "run_dir")]
    resume: Option<PathBuf>,
    /// Replace an existing run directory instead of refusing to.
    #[arg(long)]
    overwrite: bool,
    /// Stop after this many steps in all (at most the run's `steps`).
    #[arg(long)]
    steps: Option<i64>,
    /// Checkpoint every K steps (default: the run's `checkpoint_every`); 0: only at the end.
    #[arg(long, value_name = "K")]
    checkpoint_every: Option<i64>,
    /// libtorch threads per working thread (default 1: generation and streamed inference
    /// each take a core).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Run inference after generation instead of streaming it under generation.
    #[arg(long)]
    no_fuse: bool,
    /// Print one plain line per step even on a terminal.
    #[arg(long)]
    plain: bool,
}

struct Fail(String, u8);

pub fn run(args: Args) -> ExitCode {
    match execute(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Fail(msg, code)) => {
            if !msg.is_empty() {
                eprintln!("error: {msg}");
            }
            ExitCode::from(code)
        }
    }
}

fn runtime_err(e: braid_runtime::Error) -> Fail {
    Fail(e.to_string(), 1)
}

fn execute(args: &Args) -> Result<(), Fail> {
    // Which program, which run directory.
    let (file, run_dir) = match (&args.resume, &args.file) {
        (Some(dir), file) => {
            let recorded = std::fs::read_to_string(dir.join("run.json"))
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .and_then(|v| v.get("program").and_then(|p| p.as_str()).map(PathBuf::from));
            let file = match (file, recorded) {
                (Some(f), _) => f.clone(),
                (None, Some(f)) => f,
                (None, None) => {
                    return Err(Fail(
                        format!(
                            "{}: not a run directory (no run.json); pass the program too: braid run FILE --resume {}",
                            dir.display(),
                            dir.display()
                        ),
                        2,
                    ));
                }
            };
            (file, dir.clone())
        }
        (None, Some(file)) => {
            let stem = file
                .file_stem()
                .map(|s| s.to_string_lossy().to_string())
                .unwrap_or_else(|| "run".into());
            let dir = args
                .run_dir
                .clone()
                .unwrap_or_else(|| PathBuf::from("runs").join(stem));
            (file.clone(), dir)
        }
        (None, None) => {
            return Err(Fail(
                "give a program (braid run FILE.rlhf) or a run to resume (--resume RUN_DIR)".into(),
                2,
            ));
        }
    };
    let name = file.display().to_string();
    let text = std::fs::read_to_string(&file).map_err(|e| Fail(format!("{name}: {e}"), 2))?;
    let checked = braid_sema::check(&name, &text, &DiskLoader);
    if checked.has_errors() {
        diag::print(&checked.diagnostics, &checked.sources, Format::Human);
        return Err(Fail(format!("{name} has errors"), 1));
    }
    if !checked.diagnostics.is_empty() {
        diag::print(&checked.diagnostics, &checked.sources, Format::Human);
    }
    let mut plan = braid_sema::lower_graph::lower_run(&checked.program)
        .map_err(|e| Fail(format!("{name}: cannot plan the run: {e}"), 1))?;
    let device = braid_runtime::device::default_device();
    for note in speculation_from_planner(&file, &mut plan, device) {
        eprintln!("{note}");
    }
    let no_stream = unstreamed(&plan, &crate::plan::pins_of(&checked.program, &plan));

    let resume = args.resume.is_some();
    if !resume && run_dir.exists() {
        let non_empty = std::fs::read_dir(&run_dir)
            .map(|mut d| d.next().is_some())
            .unwrap_or(false);
        if non_empty {
            if !args.overwrite {
                return Err(Fail(
                    format!(
                        "{}: the run directory exists; continue it with `braid run --resume {}`, or pass --overwrite to start again",
                        run_dir.display(),
                        run_dir.display()
                    ),
                    2,
                ));
            }
            std::fs::remove_dir_all(&run_dir)
                .map_err(|e| Fail(format!("{}: cannot remove: {e}", run_dir.display()), 1))?;
        }
    }
    std::fs::create_dir_all(&run_dir)
        .map_err(|e| Fail(format!("{}: cannot create: {e}", run_dir.display()), 1))?;
    let program = std::fs::canonicalize(&file).unwrap_or_else(|_| file.clone());
    let record = serde_json::json!({ "program": program, "pipeline": plan.pipeline });
    braid_runtime::training::checkpoint::write_atomic(
        &run_dir.join("run.json"),
        record.to_string().as_bytes(),
    )
    .map_err(runtime_err)?;

    let base_dir = file
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let options = RunOptions {
        run_dir: run_dir.clone(),
        base_dir,
        resume,
        threads: args.threads.max(1),
        steps: args.steps,
        checkpoint_every: args.checkpoint_every,
        fuse: !args.no_fuse,
        no_stream,
        device,
    };
    let mut ex = Executor::new(&plan, options).map_err(runtime_err)?;
    let names = plan.model_names();
    let call = |id| {
        plan.graph.node(id).map_or_else(String::new, |n| {
            let model = n.op.model().and_then(|m| names.get(m as usize));
            format!("{}({})", n.op.name(), model.map_or("", String::as_str))
        })
    };
    for (g, on) in ex.streaming() {
        if on.is_empty() {
            eprintln!("{}: inference waits for the whole batch", call(g));
        } else {
            let list: Vec<String> = on.into_iter().map(call).collect();
            eprintln!("streaming under {}: {}", call(g), list.join(", "));
        }
    }
    let total = ex.total_steps();
    let first = ex.first_step();
    eprintln!(
        "braid: {} `{}`, steps {}..{} of {}, run directory {}",
        if first > 0 { "resuming" } else { "running" },
        plan.pipeline,
        first + 1,
        total,
        plan.steps,
        run_dir.display()
    );
    let fancy = std::io::stderr().is_terminal() && !args.plain;
    let start = Instant::now();
    let mut rewards: Vec<f64> = Vec::new();
    let mut on_event = |e: Event<'_>| match e {
        Event::Start { .. } => {}
        Event::Step {
            step,
            total,
            metrics,
        } => {
            let done = (step - first).max(1) as f64;
            let eta = start.elapsed().as_secs_f64() / done * (total - step) as f64;
            let get = |k: &str| metrics.get(k).copied();
            if let Some(r) = get("reward_mean") {
                rewards.push(r);
            }
            let mut parts = vec![format!("step {step}/{total}")];
            if let Some(r) = get("reward_mean") {
                parts.push(format!("reward {r:.4}"));
            }
            if let Some(k) = get("kl") {
                parts.push(format!("kl {k:.4}"));
            }
            let loss = metrics
                .iter()
                .find(|(k, _)| k.ends_with("/loss"))
                .map(|(_, v)| *v);
            if let Some(l) = loss {
                parts.push(format!("loss {l:.4}"));
            }
            if let Some(t) = get("time/step") {
                parts.push(format!("{t:.1}s/step"));
            }
            parts.push(format!("ETA {}", clock(eta)));
            if fancy {
                let width = 20usize;
                let filled = ((step as f64 / total.max(1) as f64) * width as f64) as usize;
                let bar: String =
                    "█".repeat(filled.min(width)) + &"░".repeat(width - filled.min(width));
                eprint!("\r\x1b[2K{bar} {}", parts.join("  "));
                let _ = std::io::stderr().flush();
            } else {
                eprintln!("{}", parts.join("  "));
            }
        }
        Event::Checkpoint { step, dir } => {
            if fancy {
                eprint!("\r\x1b[2K");
            }
            eprintln!("checkpoint: step {step} → {}", dir.display());
        }
    };
    let result = ex.run(&mut on_event);
    if fancy {
        eprintln!();
    }
    result.map_err(runtime_err)?;
    let secs = start.elapsed().as_secs_f64();
    println!(
        "finished {} steps in {} ({:.2} s/step)",
        total - first,
        clock(secs),
        secs / (total - first).max(1) as f64
    );
    if rewards.len() >= 2 {
        let k = rewards.len().min(5);
        let head: f64 = rewards[..k].iter().sum::<f64>() / k as f64;
        let tail: f64 = rewards[rewards.len() - k..].iter().sum::<f64>() / k as f64;
        println!("mean reward: first {k} steps {head:.4}, last {k} steps {tail:.4}");
    }
    for (model, dir) in ex.final_models().map_err(runtime_err)? {
        println!("{model}: {}", dir.display());
    }
    println!("metrics: {}", run_dir.join("metrics.jsonl").display());
    Ok(())
}

/// The planner's `speculate` decision for every `generate` the schedule does not pin, for the
/// one device `braid run` uses (the `cpu` cluster, or one H100-class GPU): where the cost model
/// says drafting pays at some batch size, the engine runs its adaptive mode (`auto`: prompt-
/// lookup drafts with the length chosen before every step from measured costs, off where it
/// does not pay); a declared draft model becomes `draft:DIR`; otherwise `off`. Returns one note
/// per decision. When the program cannot be planned for this device, generation does not
/// speculate.
fn speculation_from_planner(
    file: &Path,
    plan: &mut braid_ir::graph::Plan,
    device: braid_runtime::Device,
) -> Vec<String> {
    use braid_ir::graph::{ModelSource, Node, Op};
    let needs = plan.graph.node_ids().into_iter().any(|id| {
        matches!(plan.graph.node(id).map(|n| &n.op), Some(Op::Generate { params, .. }) if params.speculate.is_none())
    });
    if !needs {
        return Vec::new();
    }
    let inputs = crate::plan::PlanInputs {
        cluster: Some(
            if device == braid_runtime::Device::Cpu {
                "cpu"
            } else {
                "1x1xH100"
            }
            .into(),
        ),
        gen_lengths: None,
        prompt_len: None,
        disable_pass: Vec::new(),
    };
    let Ok(prepared) = crate::plan::prepare(file, &inputs) else {
        return vec!["note: the planner could not plan this run for this device; generation does not speculate".into()];
    };
    let mut annotated = prepared.annotated;
    if let Err(e) = braid_passes::passes::PassManager::new().run(&mut annotated, |_, _| {}) {
        return vec![format!(
            "note: planning failed ({e}); generation does not speculate"
        )];
    }
    let names = plan.model_names();
    let hf_dir = |name: &str| {
        plan.models
            .iter()
            .find(|m| m.name == name)
            .and_then(|m| match &m.source {
                ModelSource::Hf { dir } => Some(dir.clone()),
                _ => None,
            })
    };
    let mut notes = Vec::new();
    for (id, d) in &annotated.decisions.speculation {
        let drafts = d.policy.iter().any(|(_, k)| *k > 0);
        let value = match (d.mode.as_str(), drafts) {
            ("ngram", true) => braid_ir::graph::Speculation::Auto,
            ("draft", true) => match d.draft_model.as_deref().and_then(hf_dir) {
                Some(dir) => braid_ir::graph::Speculation::Draft { dir },
                None => braid_ir::graph::Speculation::Off,
            },
            _ => braid_ir::graph::Speculation::Off,
        };
        if let Some(Node {
            op: Op::Generate { model, params },
            ..
        }) = plan.graph.node_mut(*id)
            && params.speculate.is_none()
        {
            notes.push(format!(
                "speculation for generate({}): {value} (planner: {})",
                names.get(*model as usize).map_or("?", String::as_str),
                d.why
            ));
            params.speculate = Some(value);
        }
    }
    notes
}

/// The consumers of a rollout the schedule's `fuse` pins keep from streaming: with `fuse off`
/// every consumer of every `generate`; with `fuse GEN -> A, B`, the consumers of that
/// generation other than the calls `A` and `B` select.
fn unstreamed(
    plan: &braid_ir::graph::Plan,
    pins: &braid_passes::annotated::Pins,
) -> std::collections::BTreeSet<braid_ir::graph::NodeId> {
    let mut out = std::collections::BTreeSet::new();
    for id in plan.graph.node_ids() {
        if !matches!(
            plan.graph.node(id).map(|n| &n.op),
            Some(braid_ir::graph::Op::Generate { .. })
        ) {
            continue;
        }
        for c in plan.graph.consumers(id) {
            let blocked = pins.fuse_off
                || pins.fuse.iter().any(|f| {
                    pins.selects_call(plan, &f.from, id)
                        && !f.to.iter().any(|t| pins.selects_call(plan, t, c))
                });
            if blocked {
                out.insert(c);
            }
        }
    }
    out
}

fn clock(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else {
        format!("{}m{:02}s", s / 60, s % 60)
    }
}
