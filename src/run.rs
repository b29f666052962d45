//! `braid run FILE.rlhf | PLAN.json`: compile the program once with the driver (or read a
//! plan `braid plan --emit` wrote), check that the plan is for this process's device and fits
//! its memory before any weight is read, and execute it on the runtime with checkpoints and
//! metrics in a run directory. The run directory keeps the plan (`plan.json`); `--resume
//! RUN_DIR` continues from the latest checkpoint with that plan.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use braid_cost::cluster::ClusterSpec;
use braid_cost::cost::DeviceKind;
use braid_ir::exec_plan::ExecPlan;
use std::time::Duration;

use braid_runtime::dist::World;
use braid_runtime::exec::{DistOptions, Event, Executor, RunOptions};

#[derive(clap::Args)]
pub struct Args {
    /// The program to run, or a plan file (`braid plan FILE --emit PLAN.json`); optional with
    /// --resume (the run directory keeps its plan).
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
    /// Plan with nothing streamed under generation (the `fuse off` pin); for programs only: a
    /// plan file says what streams.
    #[arg(long)]
    no_fuse: bool,
    /// Run every other step (the 2nd, 4th, …) without streaming, on the same placement, to
    /// measure streaming's gain side by side in one run: `braid report RUN --against-sim` sets
    /// the two halves beside their predictions. For plans that stream and do not migrate.
    #[arg(long, conflicts_with_all = ["no_fuse", "eval_only"])]
    alternate_streaming: bool,
    /// Read the plan's relative model and data paths from DIR instead of the directory the
    /// program was compiled in (for a plan moved to another machine).
    #[arg(long, value_name = "DIR")]
    base_dir: Option<PathBuf>,
    /// Print one plain line per step even on a terminal.
    #[arg(long)]
    plain: bool,
    /// In a multi-process run, the longest any rank waits for the others in one collective
    /// (a dead rank is noticed at once; a hung one after this long).
    #[arg(long, value_name = "SECONDS", default_value_t = 1800)]
    dist_timeout: u64,
    /// Print one of each step's generations (prompt, completion, reward, advantage), as
    /// written to RUN_DIR/samples.jsonl.
    #[arg(long)]
    show_samples: bool,
    /// Evaluate the policy of a checkpoint (a `checkpoints/step-N` directory, or a run
    /// directory for its latest) on the run's `eval` prompts, print the metrics and exit.
    #[arg(long, value_name = "CHECKPOINT", conflicts_with_all = ["resume", "steps"])]
    eval_only: Option<PathBuf>,
    /// Make every training generation follow this output-length distribution, for benchmarks
    /// of streaming and migration on small models: `fixed:N`, `uniform:A..B`,
    /// `lognormal:MU,SIGMA[,MAX]` or a histogram file, as for `braid sim`. Each sample holds
    /// back end-of-sequence tokens until its drawn length (at most max_new_tokens); a program
    /// is also planned with it. Give it again with --resume.
    #[arg(long, value_name = "SPEC")]
    gen_lengths: Option<String>,
    /// How migrated samples travel: `kv` (with their KV cache) or `prefill` (prefilled again
    /// where they land); by default, whichever the cost model finds faster on the plan's
    /// devices.
    #[arg(long, value_name = "HOW", value_parser = ["kv", "prefill"])]
    migrate_with: Option<String>,
    /// Whether a generation replica that runs out of samples may take some from the replica
    /// holding the most (RLHFSpec's sample reallocation; the cost model decides each time
    /// whether it pays): `on` (the default) or `off`.
    #[arg(long, value_name = "ON_OFF", value_parser = ["on", "off"], default_value = "on")]
    reallocate: String,
    /// Plan the program with a device profile written by `braid calibrate` (for the kind of
    /// device the run uses) instead of the datasheet entry; the plan records it.
    #[arg(long, value_name = "FILE")]
    profile: Option<PathBuf>,
}

struct Fail(String, u8);

pub fn run(args: Args) -> ExitCode {
    match execute(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Fail(msg, code)) => {
            if !msg.is_empty() {
                // In a multi-process run every rank reports its own failure: say whose.
                match World::from_env() {
                    Ok(w) if w.size > 1 => eprintln!("error: rank {}: {msg}", w.rank),
                    _ => eprintln!("error: {msg}"),
                }
            }
            ExitCode::from(code)
        }
    }
}

fn runtime_err(e: braid_runtime::Error) -> Fail {
    Fail(e.to_string(), 1)
}

/// The device this process runs on, and the cluster a program with no `cluster` block is
/// planned for: one device per process of the world it was launched into (CPU processes, or
/// one GPU per process on each node).
pub(crate) fn this_world(world: &World) -> (braid_runtime::Device, ClusterSpec) {
    let gpu = braid_runtime::device::default_device() != braid_runtime::Device::Cpu;
    let device = if gpu {
        braid_runtime::Device::Cuda(world.local_rank)
    } else {
        braid_runtime::Device::Cpu
    };
    let kind = if gpu {
        // The cost model needs a device kind; libtorch does not name the GPU, so an unknown
        // GPU is planned as an H100-class device.
        DeviceKind::H100
    } else {
        DeviceKind::Cpu
    };
    let per_node = world
        .local_size
        .filter(|l| *l > 0 && world.size.is_multiple_of(*l))
        .unwrap_or(world.size)
        .max(1) as u64;
    (
        device,
        ClusterSpec {
            nodes: (world.size as u64 / per_node).max(1),
            per_node,
            device: kind,
        },
    )
}

/// Compiles the program for this process's device (the `cluster` block when it has one; the
/// runtime refuses a plan for another world) and returns its executable plan.
fn compile(file: &Path, args: &Args, world: ClusterSpec) -> Result<ExecPlan, Fail> {
    let name = file.display().to_string();
    let lengths = match &args.gen_lengths {
        Some(spec) => Some(gen_lengths(spec)?),
        None => None,
    };
    let profile = match &args.profile {
        Some(p) => Some(crate::plan::profile(p).map_err(|e| Fail(e, 2))?),
        None => None,
    };
    let options = braid_driver::Options {
        default_cluster: Some(world),
        fuse_off: args.no_fuse,
        lengths,
        profile,
        ..braid_driver::Options::default()
    };
    let compiled = crate::plan::compile(file, &options, true, &mut |_, _| {})
        .map_err(|_| Fail(String::new(), 1))?;
    let plan = crate::plan::exec_plan(&compiled, file)
        .ok_or_else(|| Fail(format!("{name}: the program did not plan"), 1))?;
    Ok(plan)
}

/// A `--gen-lengths` spec.
fn gen_lengths(spec: &str) -> Result<braid_cost::sim::LengthDist, Fail> {
    crate::plan::lengths(spec).map_err(|e| Fail(format!("--gen-lengths: {e}"), 2))
}

fn execute(args: &Args) -> Result<(), Fail> {
    let launched = World::from_env().map_err(|e| Fail(e.to_string(), 2))?;
    let (device, world) = this_world(&launched);
    // Only rank 0 reports progress and writes the run directory; every rank reports errors.
    let lead = launched.rank == 0;
    // The plan, and the run directory it runs in.
    let (plan, run_dir, resume) = match (&args.resume, &args.file) {
        (Some(dir), file) => {
            let recorded = dir.join("plan.json");
            if !recorded.is_file() {
                return Err(Fail(
                    format!(
                        "{}: not a run directory of this braid (no plan.json); start the run again with `braid run FILE --overwrite`",
                        dir.display()
                    ),
                    2,
                ));
            }
            let plan = crate::plan::read_plan(&recorded).map_err(|e| Fail(e, 1))?;
            if let Some(f) = file {
                // The program given again must still plan to the same plan.
                let again = if crate::plan::is_plan_file(f) {
                    crate::plan::read_plan(f).map_err(|e| Fail(e, 1))?
                } else {
                    compile(f, args, world)?
                };
                if again != plan {
                    return Err(Fail(
                        format!(
                            "{}: plans differently from the run in {} (the program, its settings or the target changed); resume with `braid run --resume {}` alone to continue the run as it was planned",
                            f.display(),
                            dir.display(),
                            dir.display()
                        ),
                        1,
                    ));
                }
            }
            (plan, dir.clone(), true)
        }
        (None, Some(file)) => {
            let plan = if crate::plan::is_plan_file(file) {
                if args.no_fuse {
                    return Err(Fail(
                        format!(
                            "{}: a plan file says what streams; plan the program with `braid plan FILE --emit PLAN.json` and a `fuse off` pin instead of --no-fuse",
                            file.display()
                        ),
                        2,
                    ));
                }
                if args.profile.is_some() {
                    return Err(Fail(
                        format!(
                            "{}: a plan file was priced when it was planned; give --profile to `braid plan FILE --emit PLAN.json` instead",
                            file.display()
                        ),
                        2,
                    ));
                }
                crate::plan::read_plan(file).map_err(|e| Fail(e, 1))?
            } else {
                compile(file, args, world)?
            };
            let stem = file
                .file_stem()
                .map(|s| s.to_string_lossy().to_string())
                .unwrap_or_else(|| "run".into());
            let dir = args
                .run_dir
                .clone()
                .unwrap_or_else(|| PathBuf::from("runs").join(stem));
            (plan, dir, false)
        }
        (None, None) => {
            return Err(Fail(
                "give a program (braid run FILE.rlhf), a plan (braid run PLAN.json) or a run to resume (--resume RUN_DIR)".into(),
                2,
            ));
        }
    };
    if let Some(ckpt) = &args.eval_only {
        let base_dir = match &args.base_dir {
            Some(d) => d.clone(),
            None => PathBuf::from(&plan.base_dir),
        };
        return eval_only(&plan, ckpt, base_dir, args, device);
    }
    if lead && !resume && run_dir.exists() {
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
    if lead {
        std::fs::create_dir_all(&run_dir)
            .map_err(|e| Fail(format!("{}: cannot create: {e}", run_dir.display()), 1))?;
    }
    let base_dir = match &args.base_dir {
        Some(d) => d.clone(),
        None => PathBuf::from(&plan.base_dir),
    };
    let options = RunOptions {
        run_dir: run_dir.clone(),
        base_dir,
        resume,
        threads: args.threads.max(1),
        steps: args.steps,
        checkpoint_every: args.checkpoint_every,
        device,
        dist: (launched.size > 1).then(|| DistOptions {
            world: launched.clone(),
            timeout: Duration::from_secs(args.dist_timeout.max(1)),
        }),
        gen_lengths: match &args.gen_lengths {
            Some(spec) => Some(gen_lengths(spec)?),
            None => None,
        },
        migrate_kv: args.migrate_with.as_deref().map(|w| w == "kv"),
        no_realloc: args.reallocate == "off",
        tail_tuner: tail_tuner(&plan),
        alternate_streaming: args.alternate_streaming,
    };
    if lead {
        if args.gen_lengths.is_some() {
            if plan
                .decisions
                .speculation
                .values()
                .any(|d| !d.pinned && d.run != braid_ir::graph::Speculation::Off)
            {
                eprintln!(
                    "note: --gen-lengths imposes output lengths; the planner's speculative decoding is off for this run"
                );
            }
        } else {
            for note in speculation_notes(&plan) {
                eprintln!("{note}");
            }
        }
    }
    let mut ex = Executor::new(&plan, options).map_err(runtime_err)?;
    let names = plan.plan.model_names();
    let call = |id| {
        plan.plan.graph.node(id).map_or_else(String::new, |n| {
            let model = n.op.model().and_then(|m| names.get(m as usize));
            format!("{}({})", n.op.name(), model.map_or("", String::as_str))
        })
    };
    for (g, on) in ex.streaming() {
        if !lead {
            break;
        }
        if on.is_empty() {
            eprintln!("{}: inference waits for the whole batch", call(g));
        } else {
            let list: Vec<String> = on
                .into_iter()
                .map(|(c, chunk)| format!("{} ({chunk} per pass)", call(c)))
                .collect();
            eprintln!("streaming under {}: {}", call(g), list.join(", "));
        }
    }
    if lead && args.alternate_streaming {
        eprintln!(
            "alternating: steps 2, 4, … run without streaming (inference waits for the whole batch), on the same placement"
        );
    }
    for (g, m) in &plan.decisions.migrations {
        if !lead {
            break;
        }
        if braid_runtime::exec::migrates(&plan, *g) {
            let how = if m.pinned {
                "pinned by `migrate below`"
            } else {
                "re-chosen each iteration from the lengths observed"
            };
            eprintln!(
                "migrating {}'s tail: its last {} samples onto {} instance(s) at first ({how})",
                call(*g),
                m.threshold,
                m.to_instances
            );
        } else {
            // Said, not silently skipped: the plan decided it, this runtime does not do it.
            eprintln!(
                "note: the plan migrates {}'s last {} samples onto {} instance(s), but it has one data-parallel replica here: nothing to migrate",
                call(*g),
                m.threshold,
                m.to_instances
            );
        }
    }
    for g in plan.plan.graph.node_ids() {
        if !lead || !braid_runtime::exec::reallocates(&plan, g) {
            continue;
        }
        let drafts = args.gen_lengths.is_none()
            && matches!(
                plan.speculation(g),
                braid_ir::graph::Speculation::Draft { .. }
            );
        if args.reallocate == "off" {
            eprintln!("{}: no sample reallocation (--reallocate off)", call(g));
        } else if drafts {
            eprintln!(
                "note: {} drafts with a draft model, whose cache does not move with a sample: its replicas do not reallocate samples",
                call(g)
            );
        } else {
            eprintln!(
                "{}: a replica that runs out of samples takes some from the busiest when the cost model says it pays",
                call(g)
            );
        }
    }
    for rm in ex.retokenizing_models() {
        eprintln!(
            "reward model `{rm}` has its own tokenizer: it scores each rollout's decoded text, re-tokenised"
        );
    }
    let total = ex.total_steps();
    let first = ex.first_step();
    if !lead {
        return ex.run(&mut |_| {}).map_err(runtime_err);
    }
    eprintln!(
        "braid: {} `{}`, steps {}..{} of {}, run directory {}",
        if first > 0 { "resuming" } else { "running" },
        plan.plan.pipeline,
        first + 1,
        total,
        plan.plan.steps,
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
            samples,
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
            if args.show_samples
                && let Some(s) = samples.first()
            {
                if fancy {
                    eprintln!();
                }
                eprintln!("{}", sample_text(s));
            }
        }
        Event::Checkpoint { step, dir } => {
            if fancy {
                eprint!("\r\x1b[2K");
            }
            eprintln!("checkpoint: step {step} → {}", dir.display());
        }
        Event::Eval { step, metrics } => {
            if fancy {
                eprint!("\r\x1b[2K");
            }
            eprintln!("{}", eval_line(step, metrics));
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

/// One line per `generate`: how it speculates, and why (the planner's reason).
fn speculation_notes(plan: &ExecPlan) -> Vec<String> {
    let names = plan.plan.model_names();
    plan.decisions
        .speculation
        .iter()
        .map(|(id, d)| {
            let model = plan
                .plan
                .graph
                .node(*id)
                .and_then(|n| n.op.model())
                .and_then(|m| names.get(m as usize))
                .map_or("?", String::as_str);
            format!(
                "speculation for generate({model}): {} (planner: {})",
                d.run, d.why
            )
        })
        .collect()
}

/// `--eval-only CHECKPOINT`: the run's evaluation of a saved policy. Prints the metrics as one
/// JSON object on stdout and the usual eval line on stderr; writes nothing.
fn eval_only(
    plan: &ExecPlan,
    ckpt: &Path,
    base_dir: PathBuf,
    args: &Args,
    device: braid_runtime::Device,
) -> Result<(), Fail> {
    if plan.plan.eval.is_none() {
        return Err(Fail(
            "--eval-only: the run has no `eval` setting (add `eval: { every: …, prompts: … }` to the run)".into(),
            2,
        ));
    }
    // A run directory stands for its latest checkpoint.
    let dir = if ckpt.join("state.json").exists() {
        ckpt.to_path_buf()
    } else {
        match braid_runtime::training::checkpoint::latest(ckpt).map_err(runtime_err)? {
            Some((_, d)) => d,
            None => {
                return Err(Fail(
                    format!(
                        "{}: not a checkpoint (no state.json) nor a run directory with checkpoints",
                        ckpt.display()
                    ),
                    2,
                ));
            }
        }
    };
    let options = RunOptions {
        run_dir: ckpt.to_path_buf(),
        base_dir,
        resume: false,
        threads: args.threads.max(1),
        steps: None,
        checkpoint_every: None,
        device,
        dist: None,
        gen_lengths: None,
        migrate_kv: None,
        no_realloc: true,
        tail_tuner: None,
        alternate_streaming: false,
    };
    let mut ex = Executor::new(plan, options).map_err(runtime_err)?;
    ex.load_trained(&dir).map_err(runtime_err)?;
    let metrics = ex.evaluate().map_err(runtime_err)?;
    eprintln!("{}: {}", dir.display(), eval_line(-1, &metrics));
    let json: serde_json::Map<String, serde_json::Value> = metrics
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::json!(v)))
        .collect();
    println!("{}", serde_json::Value::Object(json));
    Ok(())
}

/// One line of `samples.jsonl` for the terminal (`--show-samples`).
fn sample_text(s: &serde_json::Value) -> String {
    let text = |k: &str| s.get(k).and_then(|v| v.as_str()).unwrap_or("");
    let num = |k: &str| {
        s.get(k)
            .and_then(|v| v.as_f64())
            .map_or_else(|| "-".to_string(), |x| format!("{x:.3}"))
    };
    format!(
        "  sample  reward {}  advantage {}\n  prompt: {:?}\n  completion: {:?}",
        num("reward"),
        num("advantage"),
        text("prompt"),
        text("completion")
    )
}

/// `eval after step N: reward R  accuracy A  (length L)`.
fn eval_line(step: i64, metrics: &std::collections::BTreeMap<String, f64>) -> String {
    let mut parts = vec![if step < 0 {
        "eval:".to_string()
    } else if step == 0 {
        "eval before training:".to_string()
    } else {
        format!("eval after step {step}:")
    }];
    if let Some(r) = metrics.get("eval/reward_mean") {
        parts.push(format!("reward {r:.4}"));
    }
    if let Some(a) = metrics.get("eval/accuracy") {
        parts.push(format!("accuracy {a:.3}"));
    }
    if let Some(l) = metrics.get("eval/response_length") {
        parts.push(format!("length {l:.1}"));
    }
    parts.join("  ")
}

fn clock(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else {
        format!("{}m{:02}s", s / 60, s % 60)
    }
}

/// Re-chooses each migrating generation's `R_t` and kept instances from the lengths the last
/// iteration produced, by simulating the plan with them (`retune_migration`).
fn tail_tuner(plan: &ExecPlan) -> Option<braid_runtime::exec::TailTuner> {
    if plan.decisions.migrations.is_empty() {
        return None;
    }
    let a = braid_passes::annotated::Annotated::from_exec_plan(plan);
    Some(braid_runtime::exec::TailTuner(std::sync::Arc::new(
        move |generate, lengths, max_kept| {
            braid_passes::passes::sample_split::retune_migration(&a, generate, lengths, max_kept)
        },
    )))
}
