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
use braid_cost::cost::{DeviceKind, ModelShape};
use braid_cost::sim::LengthDist;
use braid_passes::annotated::{
    Annotated, FusePin, PinTarget, Pins, PlacePin, SpeculatePin, default_workload, shapes_from_plan,
};
use braid_passes::passes::{PassManager, pass_names};
use braid_passes::render::{self, PlanSpans};
use braid_sema::hir::{Cluster, LocalKind, Program, RunArg};
use braid_syntax::ast::{LayoutKind, PinKind, Selector, SpeculateMode};

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
    /// Prompt length in tokens (default 128).
    #[arg(long)]
    pub prompt_len: Option<u64>,
    /// Disable a pass (repeatable): place, sample-split, microbatch-interleave,
    /// reshard-insert, speculate.
    #[arg(long = "disable-pass", value_name = "NAME")]
    pub disable_pass: Vec<String>,
}

#[derive(clap::Args)]
pub struct Args {
    /// The `.rlhf` file whose run to plan.
    file: PathBuf,
    #[command(flatten)]
    inputs: PlanInputs,
    /// Output format.
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
    /// Print the plan as it is after this pass, and stop.
    #[arg(long, value_name = "PASS")]
    dump_after: Option<String>,
}

/// A prepared plan: the annotated plan before the passes, and what diagnostics need.
pub struct Prepared {
    pub annotated: Annotated,
    pub spans: PlanSpans,
    pub sources: braid_diagnostics::SourceMap,
}

fn fail(path: &Path, what: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {}: {what}", path.display());
    ExitCode::from(2)
}

/// Checks, lowers and annotates `file`'s run. `Err` carries the exit code after reporting.
pub fn prepare(file: &Path, inputs: &PlanInputs) -> Result<Prepared, ExitCode> {
    let name = file.display().to_string();
    let text = std::fs::read_to_string(file).map_err(|e| fail(file, e))?;
    let checked = braid_sema::check(&name, &text, &DiskLoader);
    if checked.has_errors() {
        diag::print(&checked.diagnostics, &checked.sources, diag::Format::Human);
        return Err(ExitCode::from(1));
    }
    let program = &checked.program;
    let plan = braid_sema::lower_graph::lower_run(program)
        .map_err(|e| fail(file, format!("cannot plan: {}", e.0)))?;
    let cluster = cluster_of(program, inputs.cluster.as_deref()).map_err(|e| fail(file, e))?;
    let dir = file.parent().unwrap_or(Path::new("."));
    let shapes = shapes_from_plan(&plan, &mut |d| hf_shape(dir, d)).map_err(|e| fail(file, e))?;
    let mut workload = default_workload(&plan);
    if let Some(spec) = &inputs.gen_lengths {
        workload.lengths = lengths(spec).map_err(|e| fail(file, e))?;
    }
    if let Some(p) = inputs.prompt_len {
        workload.prompt_len = p.max(1);
    }
    let pins = pins_of(program, &plan);
    let mut spans = PlanSpans::default();
    if let Some(run) = &program.run {
        spans.run = run.span;
    }
    for m in &program.models {
        if m.file == program.root {
            spans.models.insert(m.name.clone(), m.name_span);
        }
    }
    let cost = cluster.cost_model();
    Ok(Prepared {
        annotated: Annotated::new(plan, cluster, cost, shapes, workload, pins),
        spans,
        sources: checked.sources,
    })
}

/// The `--cluster` spec, else the program's `cluster` block, else `cpu`.
fn cluster_of(program: &Program, flag: Option<&str>) -> Result<ClusterSpec, String> {
    if let Some(s) = flag {
        return ClusterSpec::parse(s).map_err(|e| e.to_string());
    }
    match &program.cluster {
        Some(Cluster::Gpus { gpus, gpu, nodes }) => {
            let device = DeviceKind::parse(gpu).ok_or_else(|| format!("unknown device `{gpu}`"))?;
            let nodes = (*nodes).max(1) as u64;
            Ok(ClusterSpec {
                nodes,
                per_node: ((*gpus).max(1) as u64 / nodes).max(1),
                device,
            })
        }
        Some(Cluster::Cpu) | None => ClusterSpec::parse("cpu").map_err(|e| e.to_string()),
    }
}

/// A Hugging Face model's shape: `config.json` in its directory (relative to the program),
/// else a preset named by the directory (`llama-13b`, `qwen2.5-0.5b-instruct`).
fn hf_shape(base: &Path, dir: &str) -> Result<ModelShape, String> {
    #[cfg(feature = "runtime")]
    {
        // A GGUF file: its metadata, as the config.json a Hugging Face directory would hold.
        let file = base.join(dir);
        if braid_runtime::models::gguf::is_gguf(&file) {
            let json = braid_runtime::models::gguf::GgufFile::open(&file)
                .and_then(|g| g.config_json())
                .map_err(|e| e.to_string())?;
            return ModelShape::from_hf_config(dir, &json).map_err(|e| e.to_string());
        }
    }
    let path = base.join(dir).join("config.json");
    if let Ok(text) = std::fs::read_to_string(&path) {
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        return ModelShape::from_hf_config(dir, &json).map_err(|e| e.to_string());
    }
    ModelShape::preset_for_path(dir).ok_or_else(|| {
        format!(
            "no {} and no preset named like `{dir}` (presets: {}, qwen2.5-0.5b)",
            path.display(),
            ModelShape::PRESETS.join(", ")
        )
    })
}

/// A length distribution spec, or a histogram file.
pub fn lengths(spec: &str) -> Result<LengthDist, String> {
    if Path::new(spec).is_file() {
        let text = std::fs::read_to_string(spec).map_err(|e| format!("{spec}: {e}"))?;
        return LengthDist::from_histogram(&text).map_err(|e| format!("{spec}: {e}"));
    }
    LengthDist::parse(spec).map_err(|e| e.to_string())
}

fn target(s: &Selector) -> PinTarget {
    PinTarget {
        op: s.op.name.clone(),
        model: s.model.as_ref().map(|m| m.name.clone()),
    }
}

/// The schedule's pins, and the pipeline-parameter names of each model slot.
pub(crate) fn pins_of(program: &Program, plan: &braid_ir::graph::Plan) -> Pins {
    let mut pins = Pins::default();
    if let (Some(run), Some(pipeline)) = (
        &program.run,
        program
            .run
            .as_ref()
            .and_then(|r| program.pipelines.get(r.pipeline.0 as usize)),
    ) {
        for local in &pipeline.locals {
            if let LocalKind::Param(i) = local.kind
                && let Some(RunArg::Model(m)) = run.args.get(i as usize)
                && let Some(model) = program.models.get(m.0 as usize)
                && let Some(slot) = plan.models.iter().position(|s| s.name == model.name)
            {
                pins.aliases
                    .entry(slot as u32)
                    .or_default()
                    .push(local.name.clone());
            }
        }
    }
    let Some(schedule) = &program.schedule else {
        return pins;
    };
    for pin in &schedule.pins {
        match &pin.kind {
            PinKind::FuseOff => pins.fuse_off = true,
            PinKind::MigrateOff => pins.migrate_off = true,
            PinKind::MigrateBelow { percent, .. } => pins.migrate_below = Some(percent / 100.0),
            PinKind::Place {
                target: t,
                from,
                to,
                layout,
            } => {
                let get = |k: LayoutKind| {
                    layout
                        .iter()
                        .find(|(kind, _)| *kind == k)
                        .map(|(_, v)| v.value.max(1) as u64)
                };
                pins.place.push(PlacePin {
                    target: target(t),
                    from: from.value.max(0) as u64,
                    to: to.value.max(0) as u64,
                    tp: get(LayoutKind::Tp),
                    pp: get(LayoutKind::Pp),
                    dp: get(LayoutKind::Dp),
                });
            }
            PinKind::Speculate { target: t, mode } => {
                let mode = match mode {
                    SpeculateMode::Off => SpeculatePin::Off,
                    SpeculateMode::Ngram { n, max } => SpeculatePin::Ngram {
                        n: n.value.max(1) as u64,
                        max: max.as_ref().map(|m| m.value.max(0) as u64),
                    },
                    SpeculateMode::Draft(m) => SpeculatePin::Draft {
                        model: m.name.clone(),
                    },
                };
                pins.speculate.push((t.as_ref().map(target), mode));
            }
            PinKind::Fuse { from, to } => pins.fuse.push(FusePin {
                from: target(from),
                to: to.iter().map(target).collect(),
            }),
            PinKind::Interleave(sels) => pins.interleave.push(sels.iter().map(target).collect()),
            PinKind::MicroBatch { .. } => {}
        }
    }
    pins
}

/// Runs the passes; reports `E0504` diagnostics (exit 1) when a call does not fit.
pub fn plan(
    prepared: &mut Prepared,
    disabled: &[String],
    mut after: impl FnMut(&str, &Annotated),
) -> Result<(), ExitCode> {
    let manager = PassManager::new().disable(disabled).map_err(|e| {
        eprintln!("error: {e}");
        ExitCode::from(2)
    })?;
    manager
        .run(&mut prepared.annotated, &mut after)
        .map_err(|e| {
            eprintln!("error: planning failed: {e}");
            ExitCode::from(1)
        })?;
    let diags = render::memory_diagnostics(&prepared.annotated, &prepared.spans);
    if !diags.is_empty() {
        diag::print(&diags, &prepared.sources, diag::Format::Human);
        eprintln!(
            "the plan does not fit: {}",
            diag::plural(diags.len(), "error")
        );
        return Err(ExitCode::from(1));
    }
    Ok(())
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
    let mut prepared = match prepare(&args.file, &args.inputs) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let mut dumped = None;
    let result = plan(&mut prepared, &args.inputs.disable_pass, |name, a| {
        if dumped.is_none() && args.dump_after.as_deref() == Some(name) {
            dumped = Some(render(a, args.format));
        }
    });
    if let Some(text) = dumped {
        print!("{text}");
        return ExitCode::SUCCESS;
    }
    if let Err(code) = result {
        return code;
    }
    if let Some(p) = &args.dump_after {
        eprintln!("error: pass `{p}` is disabled, so there is nothing to dump after it");
        return ExitCode::from(2);
    }
    print!("{}", render(&prepared.annotated, args.format));
    ExitCode::SUCCESS
}
