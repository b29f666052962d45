//! braid-driver: the one compile path. A program's text goes through parse and check
//! (`braid-sema`), lowering of its run to a task graph, the planner's passes for the target
//! cluster (`braid-passes`) and the memory check, and comes out as an [`ExecPlan`] — the typed
//! contract the runtime executes — with every diagnostic found on the way.
//!
//! Every command that needs a plan (`braid plan`, `braid sim`, `braid run`, the UI tests) goes
//! through [`compile`] (or [`prepare`] and [`plan`], for `braid sim`, which compares the plan
//! with baselines built from the same unplanned input), so a program is read, checked and
//! lowered once per command and every command sees the same plan.
//!
//! Architecture Invariant: like every compiler crate, this one does no file I/O. Imports come
//! through a [`Loader`], model architectures through [`ModelConfigs`]; the CLI implements both
//! on the file system. API Boundary: [`compile`], [`Options`], [`Compiled`].

use std::collections::BTreeMap;

use braid_cost::cluster::ClusterSpec;
use braid_cost::cost::{DeviceKind, DeviceSpec, ModelShape};
use braid_cost::sim::LengthDist;
use braid_diagnostics::{Code, Diagnostic, SourceMap};
use braid_ir::exec_plan::ExecPlan;
use braid_ir::graph::{Dtype, ModelSource, Op, Plan};
use braid_passes::annotated::{
    Annotated, FusePin, PinTarget, Pins, PlacePin, SpeculatePin, default_workload,
};
use braid_passes::passes::PassManager;
use braid_passes::render::{self, PlanSpans};
use braid_sema::Loader;
use braid_sema::hir::{self, Cluster, LocalKind, Program, RunArg};

/// Where the architecture of an `hf(…)` model comes from: the caller reads the directory's
/// `config.json` (or knows a preset); the compiler does no I/O.
pub trait ModelConfigs {
    /// The shape of the model in `dir` (as written in the program), or what is wrong.
    fn shape(&self, dir: &str) -> Result<ModelShape, String>;
}

/// Model shapes from the presets named by their directories only (`llama-13b`,
/// `qwen2.5-0.5b-instruct`): for tests and tools that have no file system.
#[derive(Debug, Default, Clone, Copy)]
pub struct Presets;

impl ModelConfigs for Presets {
    fn shape(&self, dir: &str) -> Result<ModelShape, String> {
        ModelShape::preset_for_path(dir).ok_or_else(|| {
            format!(
                "no preset named like `{dir}` (presets: {}, qwen2.5-0.5b)",
                ModelShape::PRESETS.join(", ")
            )
        })
    }
}

/// What to plan for, beyond the program.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// The cluster, whatever the program declares (`--cluster`).
    pub cluster: Option<ClusterSpec>,
    /// The cluster for a program without a `cluster` block (`braid run`: the world it runs
    /// in); `None`: one CPU.
    pub default_cluster: Option<ClusterSpec>,
    /// Stream nothing under generation, as a `fuse off` pin would (`braid run --no-fuse`).
    pub fuse_off: bool,
    /// Generated lengths; `None`: log-normal with the median at a quarter of `max_new_tokens`.
    pub lengths: Option<LengthDist>,
    /// Prompt length in tokens; `None`: 128.
    pub prompt_len: Option<u64>,
    /// Prompt lengths, one drawn per prompt (what micro-batches pad to); `None`: every prompt
    /// `prompt_len` long. Their mean is the prompt length unless `prompt_len` is given.
    pub prompt_lengths: Option<LengthDist>,
    /// Passes not to run (names as `braid plan --disable-pass` takes them).
    pub disabled_passes: Vec<String>,
    /// The device entry to price the plan with (a calibrated profile, `--profile FILE`);
    /// `None`: the cluster's datasheet entry.
    pub profile: Option<DeviceSpec>,
}

/// Everything one compile produced.
pub struct Compiled {
    pub program: Program,
    pub sources: SourceMap,
    /// Sorted by position; the checker's first, then the planner's.
    pub diagnostics: Vec<Diagnostic>,
    /// Where the planner's diagnostics point.
    pub spans: PlanSpans,
    /// The annotated plan before the passes, when the program checked clean and has a run.
    pub prepared: Option<Annotated>,
    /// The planned plan, when planning ran (it may still have `E0504` diagnostics).
    pub planned: Option<Annotated>,
    /// A failure that is Braid's fault, not the program's (a lowering or pass bug).
    pub internal: Option<String>,
    /// An option that does not fit the program (a device profile for another kind of device
    /// than the cluster's); the caller reports it as a usage error.
    pub usage: Option<String>,
}

impl Compiled {
    pub fn has_errors(&self) -> bool {
        self.internal.is_some()
            || self.usage.is_some()
            || self.diagnostics.iter().any(|d| d.is_error())
    }

    /// The executable plan, when the program compiled without errors.
    pub fn exec_plan(&self) -> Option<ExecPlan> {
        if self.has_errors() {
            return None;
        }
        self.planned.as_ref().map(Annotated::to_exec_plan)
    }
}

/// Checks, lowers and plans `text` (the file `name`) for the target: [`prepare`], then [`plan`].
/// `after` sees the annotated plan after each pass (`braid plan --dump-after`).
pub fn compile(
    name: &str,
    text: &str,
    loader: &dyn Loader,
    configs: &dyn ModelConfigs,
    options: &Options,
    after: &mut dyn FnMut(&str, &Annotated),
) -> Compiled {
    let mut c = prepare(name, text, loader, configs, options);
    plan(&mut c, options, after);
    c
}

/// Checks and lowers `text`, resolves what the target decides (the cluster, every model's
/// shape and dtype, the workload, the schedule's pins), and stops before the passes.
pub fn prepare(
    name: &str,
    text: &str,
    loader: &dyn Loader,
    configs: &dyn ModelConfigs,
    options: &Options,
) -> Compiled {
    let checked = braid_sema::check(name, text, loader);
    let mut c = Compiled {
        program: checked.program,
        sources: checked.sources,
        diagnostics: checked.diagnostics,
        spans: PlanSpans::default(),
        prepared: None,
        planned: None,
        internal: None,
        usage: None,
    };
    if c.has_errors() || c.program.run.is_none() {
        return c;
    }
    let program = &c.program;
    if let Some(run) = &program.run {
        c.spans.run = run.span;
    }
    for m in &program.models {
        if m.file == program.root {
            c.spans.models.insert(m.name.clone(), m.name_span);
        }
    }
    let mut lowered = match braid_sema::lower_graph::lower_run(program) {
        Ok(p) => p,
        Err(e) => {
            c.internal = Some(format!("cannot lower the run: {}", e.0));
            return c;
        }
    };
    let cluster = match (options.cluster, &program.cluster, options.default_cluster) {
        (Some(c), _, _) => c,
        (None, None, Some(c)) => c,
        _ => cluster_of(program),
    };
    if let Some(d) = &options.profile
        && d.kind != cluster.device
    {
        c.usage = Some(format!(
            "the device profile given with --profile is for `{}`, but the run's cluster `{cluster}` has `{}` devices (give `--cluster` with the profile's kind, or calibrate on the cluster's devices)",
            d.kind.name(),
            cluster.device.name()
        ));
        return c;
    }
    // The target decides the dtype a program leaves open: f32 on CPUs, bf16 on GPUs.
    let default_dtype = if cluster.device == DeviceKind::Cpu {
        Dtype::F32
    } else {
        Dtype::Bf16
    };
    for m in &mut lowered.models {
        m.dtype.get_or_insert(default_dtype);
    }
    // Each `hf(…)` directory's shape, read once; a directory that cannot be read is a
    // diagnostic at its model's declaration.
    let mut known: BTreeMap<String, ModelShape> = BTreeMap::new();
    for m in &lowered.models {
        let ModelSource::Hf { dir } = &m.source else {
            continue;
        };
        if known.contains_key(dir) {
            continue;
        }
        match configs.shape(dir) {
            Ok(s) => {
                known.insert(dir.clone(), s);
            }
            Err(why) => {
                let span = program
                    .models
                    .iter()
                    .find(|d| d.name == m.name)
                    .map_or(c.spans.run, |d| d.span);
                c.diagnostics.push(
                    Diagnostic::new(
                        Code::E0505,
                        format!(
                            "cannot read the architecture of model `{}` from `{dir}`: {why}",
                            m.name
                        ),
                        span,
                        format!("`{}` is declared here", m.name),
                    )
                    .with_help(
                        "point `hf(\"…\")` at a Hugging Face model directory with a `config.json` (relative to the program), or name a preset (llama-7b, llama-13b, qwen2.5-0.5b, …) to plan without weights",
                    ),
                );
            }
        }
    }
    if c.has_errors() {
        return c;
    }
    let shapes = match braid_passes::annotated::shapes_from_plan(&lowered, &mut |dir| {
        known
            .get(dir)
            .cloned()
            .ok_or_else(|| format!("`{dir}` was not read"))
    }) {
        Ok(s) => s,
        Err(e) => {
            c.internal = Some(e);
            return c;
        }
    };
    c.diagnostics
        .extend(token_alignment(&lowered, &shapes, &c.spans));
    let mut workload = default_workload(&lowered);
    if let Some(l) = &options.lengths {
        workload.lengths = l.clone();
    }
    if let Some(d) = &options.prompt_lengths {
        workload.prompt_len = d.mean().round().max(1.0) as u64;
        workload.prompt_lengths = Some(d.clone());
    }
    if let Some(p) = options.prompt_len {
        workload.prompt_len = p.max(1);
    }
    let mut pins = pins_of(program, &lowered);
    pins.fuse_off |= options.fuse_off;
    let cost = match &options.profile {
        Some(d) => cluster.cost_model_with(d.clone()),
        None => cluster.cost_model(),
    };
    c.prepared = Some(Annotated::new(
        lowered, cluster, cost, shapes, workload, pins,
    ));
    c
}

/// Runs the passes on a prepared compile, completes the decisions the runtime needs (every
/// call placed), and adds the memory diagnostics (`E0504`).
pub fn plan(c: &mut Compiled, options: &Options, after: &mut dyn FnMut(&str, &Annotated)) {
    let Some(prepared) = &c.prepared else {
        return;
    };
    let manager = match PassManager::new().disable(&options.disabled_passes) {
        Ok(m) => m,
        Err(e) => {
            c.internal = Some(e.to_string());
            return;
        }
    };
    let mut a = prepared.clone();
    if let Err(e) = manager.run(&mut a, |name, a| after(name, a)) {
        c.internal = Some(format!("planning failed: {e}"));
        return;
    }
    // A call no pass placed (`place` disabled) runs where the heuristic puts it; the plan says
    // so explicitly, so that the runtime never decides.
    let placements = braid_passes::estimate::placements(&a);
    for (id, p) in placements {
        a.decisions.placements.entry(id).or_insert(p);
    }
    let mut diags = render::memory_diagnostics(&a, &c.spans);
    diags.extend(render::resident_memory_diagnostics(&a, &c.spans));
    c.diagnostics.extend(diags);
    c.planned = Some(a);
}

/// `E0506 token-misaligned`: a `logprobs` or `values` call gives one number per token of a
/// rollout, so its model must read the generating model's token ids with their meaning. What
/// the shapes show for certain: a model whose embedding has fewer rows than the generator's
/// vocabulary cannot read every id the generator may sample, and a `tiny` model's byte
/// vocabulary is another tokenizer than any vocabulary of another size. (Two Hugging Face
/// models whose sizes differ otherwise may share a tokenizer with padded embeddings, as the
/// sizes of one family do; the runtime compares their vocabularies.) A reward model is not
/// checked: `score` reads text it re-tokenises when its tokenizer differs.
fn token_alignment(plan: &Plan, shapes: &[ModelShape], spans: &PlanSpans) -> Vec<Diagnostic> {
    let is_tiny = |slot: u32| {
        let mut s = slot as usize;
        for _ in 0..=plan.models.len() {
            match plan.models.get(s).map(|m| &m.source) {
                Some(ModelSource::FrozenOf(of)) => s = *of as usize,
                Some(ModelSource::Tiny { .. }) => return true,
                _ => return false,
            }
        }
        false
    };
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for id in plan.graph.node_ids() {
        let Some(node) = plan.graph.node(id) else {
            continue;
        };
        let (Op::Logprobs { model } | Op::Values { model }) = &node.op else {
            continue;
        };
        let Some(writer) =
            plan.graph
                .inputs(id)
                .first()
                .and_then(|r| match plan.graph.node(*r).map(|n| &n.op) {
                    Some(Op::Generate { model, .. }) => Some(*model),
                    _ => None,
                })
        else {
            continue;
        };
        let (Some(rs), Some(ws)) = (shapes.get(*model as usize), shapes.get(writer as usize))
        else {
            continue;
        };
        let misaligned =
            rs.vocab != ws.vocab && (rs.vocab < ws.vocab || is_tiny(*model) || is_tiny(writer));
        if !misaligned || !seen.insert((*model, writer)) {
            continue;
        }
        let name = |m: u32| plan.models.get(m as usize).map_or("?", |s| s.name.as_str());
        let (reader, maker) = (name(*model), name(writer));
        let span = spans.models.get(reader).copied().unwrap_or(spans.run);
        let mut d = Diagnostic::new(
            Code::E0506,
            format!(
                "model `{reader}` cannot read the tokens `{maker}` generates: its vocabulary has {} entries, `{maker}`'s {}",
                rs.vocab, ws.vocab
            ),
            span,
            format!("`{}` reads `{maker}`'s token ids", node.op.name()),
        )
        .with_help(format!(
            "`{}` gives a number per generated token, so `{reader}` must use `{maker}`'s tokenizer: start it from `{maker}`'s checkpoint or a model of its family; only a reward model, read through `score`, may have its own tokenizer (it scores the decoded text)",
            node.op.name()
        ));
        if let Some(w) = spans.models.get(maker) {
            d = d.with_label(*w, format!("`{maker}` generates the rollout"));
        }
        out.push(d);
    }
    out
}

/// The program's `cluster` block, else one CPU.
pub fn cluster_of(program: &Program) -> ClusterSpec {
    match &program.cluster {
        Some(Cluster::Gpus { gpus, gpu, nodes }) => {
            let nodes = (*nodes).max(1) as u64;
            ClusterSpec {
                nodes,
                per_node: ((*gpus).max(1) as u64 / nodes).max(1),
                // The checker accepts only the device table's names.
                device: DeviceKind::parse(gpu).unwrap_or(DeviceKind::H100),
            }
        }
        Some(Cluster::Cpu { ranks }) => ClusterSpec {
            nodes: 1,
            per_node: (*ranks).max(1) as u64,
            device: DeviceKind::Cpu,
        },
        None => ClusterSpec {
            nodes: 1,
            per_node: 1,
            device: DeviceKind::Cpu,
        },
    }
}

fn target(s: &hir::Selector) -> PinTarget {
    PinTarget {
        op: s.op.clone(),
        model: s.model.clone(),
    }
}

/// The schedule's pins for the planner, and the pipeline-parameter names of each model slot.
pub fn pins_of(program: &Program, plan: &braid_ir::graph::Plan) -> Pins {
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
            hir::PinKind::FuseOff => pins.fuse_off = true,
            hir::PinKind::MigrateOff => pins.migrate_off = true,
            hir::PinKind::MigrateBelow(frac) => pins.migrate_below = Some(*frac),
            hir::PinKind::Place {
                target: t,
                from,
                to,
                tp,
                pp,
                dp,
            } => pins.place.push(PlacePin {
                target: target(t),
                from: *from,
                to: *to,
                tp: *tp,
                pp: *pp,
                dp: *dp,
            }),
            hir::PinKind::Speculate { target: t, mode } => {
                let mode = match mode {
                    hir::SpeculatePin::Off => SpeculatePin::Off,
                    hir::SpeculatePin::Ngram { n, max } => SpeculatePin::Ngram { n: *n, max: *max },
                    hir::SpeculatePin::Draft { model } => SpeculatePin::Draft {
                        model: model.clone(),
                    },
                };
                pins.speculate.push((t.as_ref().map(target), mode));
            }
            hir::PinKind::Fuse { from, to } => pins.fuse.push(FusePin {
                from: target(from),
                to: to.iter().map(target).collect(),
            }),
            hir::PinKind::Interleave(sels) => {
                pins.interleave.push(sels.iter().map(target).collect())
            }
            hir::PinKind::MicroBatch { .. } => {}
        }
    }
    pins
}
