//! `braid plan FILE`: check and lower a program's run, run the planner's passes for a cluster
//! and print the plan — every model call with its devices and layout, the fusion decisions and
//! why, predicted time and memory per device — as text, JSON or DOT. Calls that do not fit
//! device memory are `E0504` diagnostics, reported before anything runs (exit 1).
//!
//! This module also prepares plans for `braid sim FILE`: it reads the files the compiler may
//! not (imports, a model directory's `config.json`, a length histogram) and turns the
//! program's `cluster` and `schedule` blocks into the planner's inputs. Output is
//! deterministic: the CPU's FLOP/s come from the device table, not a measurement.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use braid_cost::cluster::ClusterSpec;
use braid_cost::cost::ModelShape;
use braid_cost::sim::LengthDist;
use braid_driver::{Compiled, ModelConfigs, Options};
use braid_ir::exec_plan::ExecPlan;
use braid_passes::annotated::Annotated;
use braid_passes::passes::pass_names;
use braid_passes::render;

use crate::diag::{self, DiskLoader};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Text,
    Json,
    Dot,
}

/// What `plan` and `sim FILE` share.
#[derive(clap::Args, Debug, Clone)]
pub struct PlanInputs {
    /// The cluster: `NODESxPER_NODExDEVICE` (e.g. `32x8xH800`, `1x1xH100`) or `cpu`; default:
    /// the program's `cluster` block, else `cpu`.
    #[arg(long)]
    pub cluster: Option<String>,
    /// Generated lengths: `fixed:N`, `uniform:A..B`, `lognormal:MU,SIGMA[,MAX]`, or a histogram
    /// file (`len count` per line). Default: log-normal with the median at a quarter of
    /// `max_new_tokens`.
    #[arg(long)]
    pub gen_lengths: Option<String>,
    /// Prompt length in tokens (default 128; with --prompt-lengths, their mean).
    #[arg(long)]
    pub prompt_len: Option<u64>,
    /// Prompt lengths, one drawn per prompt, which micro-batches pad to: `fixed:N`,
    /// `uniform:A..B`, `lognormal:MU,SIGMA[,MAX]`, or a histogram file such as a run's
    /// `RUN_DIR/prompt-lengths.txt`. Default: every prompt --prompt-len long.
    #[arg(long)]
    pub prompt_lengths: Option<String>,
    /// Disable a pass (repeatable): place, sample-split, microbatch-interleave,
    /// reshard-insert, speculate.
    #[arg(long = "disable-pass", value_name = "NAME")]
    pub disable_pass: Vec<String>,
    /// Price the plan with a device profile written by `braid calibrate` instead of the
    /// device's datasheet entry (it must be for the cluster's kind of device).
    #[arg(long, value_name = "FILE")]
    pub profile: Option<PathBuf>,
}

/// The device entry of a profile file (`braid calibrate`); the message names the file.
pub fn profile(path: &Path) -> Result<braid_cost::cost::DeviceSpec, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    braid_cost::cost::DeviceProfile::from_json(&text)
        .map(|p| p.device)
        .map_err(|e| format!("{}: {e}", path.display()))
}

#[derive(clap::Args)]
pub struct Args {
    /// The `.rlhf` file whose run to plan, or a `plan.json` to show.
    file: PathBuf,
    #[command(flatten)]
    inputs: PlanInputs,
    /// Output format.
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
    /// Print the plan as it is after this pass, and stop.
    #[arg(long, value_name = "PASS")]
    dump_after: Option<String>,
    /// Also write the executable plan (versioned JSON) to this file; `braid run PLAN.json`
    /// runs it.
    #[arg(long, value_name = "PLAN.json")]
    emit: Option<PathBuf>,
}

fn fail(path: &Path, what: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {}: {what}", path.display());
    ExitCode::from(2)
}

/// Model shapes from the file system: `config.json` in the model's directory (relative to the
/// program), else a preset named by the directory (`llama-13b`, `qwen2.5-0.5b-instruct`).
pub struct DiskConfigs {
    pub base: PathBuf,
}

impl ModelConfigs for DiskConfigs {
    fn shape(&self, dir: &str) -> Result<ModelShape, String> {
        #[cfg(feature = "runtime")]
        {
            // A GGUF file: its metadata, as the config.json a Hugging Face directory would hold.
            let file = self.base.join(dir);
            if braid_runtime::models::gguf::is_gguf(&file) {
                let json = braid_runtime::models::gguf::GgufFile::open(&file)
                    .and_then(|g| g.config_json())
                    .map_err(|e| e.to_string())?;
                return ModelShape::from_hf_config(dir, &json).map_err(|e| e.to_string());
            }
        }
        let path = self.base.join(dir).join("config.json");
        if let Ok(text) = std::fs::read_to_string(&path) {
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
            return ModelShape::from_hf_config(dir, &json).map_err(|e| e.to_string());
        }
        ModelShape::preset_for_path(dir).ok_or_else(|| {
            format!(
                "no {} and no preset named like `{dir}` (presets: {})",
                path.display(),
                ModelShape::PRESETS.join(", ")
            )
        })
    }
}

/// A length distribution spec, or a histogram file.
pub fn lengths(spec: &str) -> Result<LengthDist, String> {
    if Path::new(spec).is_file() {
        let text = std::fs::read_to_string(spec).map_err(|e| format!("{spec}: {e}"))?;
        return LengthDist::from_histogram(&text).map_err(|e| format!("{spec}: {e}"));
    }
    LengthDist::parse(spec).map_err(|e| e.to_string())
}

/// The driver's options from the command line (`Err` after reporting a usage error).
pub fn options(inputs: &PlanInputs, file: &Path) -> Result<Options, ExitCode> {
    for p in &inputs.disable_pass {
        if !pass_names().contains(&p.as_str()) {
            eprintln!(
                "error: unknown pass `{p}`; the passes are {}",
                pass_names().join(", ")
            );
            return Err(ExitCode::from(2));
        }
    }
    let cluster = match &inputs.cluster {
        Some(s) => Some(ClusterSpec::parse(s).map_err(|e| fail(file, e))?),
        None => None,
    };
    let lengths = match &inputs.gen_lengths {
        Some(spec) => Some(lengths(spec).map_err(|e| fail(file, e))?),
        None => None,
    };
    let prompt_lengths = match &inputs.prompt_lengths {
        Some(spec) => Some(self::lengths(spec).map_err(|e| fail(file, e))?),
        None => None,
    };
    let profile = match &inputs.profile {
        Some(p) => Some(profile(p).map_err(|e| {
            eprintln!("error: {e}");
            ExitCode::from(2)
        })?),
        None => None,
    };
    Ok(Options {
        cluster,
        lengths,
        prompt_len: inputs.prompt_len,
        prompt_lengths,
        disabled_passes: inputs.disable_pass.clone(),
        profile,
        ..Options::default()
    })
}

/// Reads `file` and compiles it with the driver (`prepare` only when `planned` is false):
/// every diagnostic is printed; `Err` carries the exit code (1 for a program with errors, 2
/// for a file that cannot be read).
pub fn compile(
    file: &Path,
    options: &Options,
    planned: bool,
    after: &mut dyn FnMut(&str, &Annotated),
) -> Result<Compiled, ExitCode> {
    let name = file.display().to_string();
    let text = std::fs::read_to_string(file).map_err(|e| fail(file, e))?;
    let configs = DiskConfigs {
        base: file.parent().unwrap_or(Path::new(".")).to_path_buf(),
    };
    let c = if planned {
        braid_driver::compile(&name, &text, &DiskLoader, &configs, options, after)
    } else {
        braid_driver::prepare(&name, &text, &DiskLoader, &configs, options)
    };
    if !c.diagnostics.is_empty() {
        diag::print(&c.diagnostics, &c.sources, diag::Format::Human);
    }
    if let Some(e) = &c.usage {
        eprintln!("error: {name}: {e}");
        return Err(ExitCode::from(2));
    }
    if let Some(e) = &c.internal {
        eprintln!("error: {name}: internal error: {e}; please report it");
        return Err(ExitCode::from(1));
    }
    let errors = c.diagnostics.iter().filter(|d| d.is_error()).count();
    if errors > 0 {
        let memory = c
            .diagnostics
            .iter()
            .any(|d| d.code == braid_diagnostics::Code::E0504);
        if memory && c.planned.is_some() {
            eprintln!("the plan does not fit: {}", diag::plural(errors, "error"));
        }
        return Err(ExitCode::from(1));
    }
    if c.program.run.is_none() {
        eprintln!("error: {name}: the program has no `run` to plan");
        return Err(ExitCode::from(1));
    }
    Ok(c)
}

/// The executable plan of a compile, with the directory its relative model and data paths
/// are read from: the program's, as an absolute path.
pub fn exec_plan(compiled: &Compiled, file: &Path) -> Option<ExecPlan> {
    let mut plan = compiled.exec_plan()?;
    let dir = file.parent().unwrap_or(Path::new("."));
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    plan.base_dir = std::fs::canonicalize(dir)
        .unwrap_or_else(|_| dir.to_path_buf())
        .display()
        .to_string();
    Some(plan)
}

/// Reads and verifies a `plan.json`.
pub fn read_plan(path: &Path) -> Result<ExecPlan, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    ExecPlan::from_json(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Whether a path names a plan file rather than a program.
pub fn is_plan_file(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "json")
}

fn render(a: &Annotated, format: Format) -> String {
    match format {
        Format::Text => render::to_text(&render::report(a)),
        Format::Json => {
            serde_json::to_string_pretty(&render::report(a)).unwrap_or_else(|e| e.to_string())
                + "\n"
        }
        Format::Dot => render::to_dot(a),
    }
}

pub fn run(args: Args) -> ExitCode {
    if let Some(p) = &args.dump_after
        && !pass_names().contains(&p.as_str())
    {
        eprintln!(
            "error: unknown pass `{p}`; the passes are {}",
            pass_names().join(", ")
        );
        return ExitCode::from(2);
    }
    if is_plan_file(&args.file) {
        // A plan file is shown as planned; the planner's inputs belong to the program.
        if args.dump_after.is_some()
            || args.inputs.cluster.is_some()
            || args.inputs.gen_lengths.is_some()
            || args.inputs.prompt_len.is_some()
            || args.inputs.prompt_lengths.is_some()
            || !args.inputs.disable_pass.is_empty()
            || args.inputs.profile.is_some()
        {
            eprintln!(
                "error: {}: a plan file is already planned; --cluster, --gen-lengths, --prompt-len, --prompt-lengths, --disable-pass, --profile and --dump-after apply to programs",
                args.file.display()
            );
            return ExitCode::from(2);
        }
        let plan = match read_plan(&args.file) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(1);
            }
        };
        let a = Annotated::from_exec_plan(&plan);
        if let Some(out) = &args.emit
            && let Err(e) = std::fs::write(out, plan.to_json())
        {
            return fail(out, e);
        }
        print!("{}", render(&a, args.format));
        return ExitCode::SUCCESS;
    }
    let options = match options(&args.inputs, &args.file) {
        Ok(o) => o,
        Err(code) => return code,
    };
    let mut dumped = None;
    let result = compile(&args.file, &options, true, &mut |name, a| {
        if dumped.is_none() && args.dump_after.as_deref() == Some(name) {
            dumped = Some(render(a, args.format));
        }
    });
    if let Some(text) = dumped {
        print!("{text}");
        return ExitCode::SUCCESS;
    }
    let compiled = match result {
        Ok(c) => c,
        Err(code) => return code,
    };
    if let Some(p) = &args.dump_after {
        eprintln!("error: pass `{p}` is disabled, so there is nothing to dump after it");
        return ExitCode::from(2);
    }
    let (Some(planned), Some(plan)) = (&compiled.planned, exec_plan(&compiled, &args.file)) else {
        return ExitCode::from(1);
    };
    if let Some(out) = &args.emit
        && let Err(e) = std::fs::write(out, plan.to_json())
    {
        return fail(out, e);
    }
    print!("{}", render(planned, args.format));
    ExitCode::SUCCESS
}
