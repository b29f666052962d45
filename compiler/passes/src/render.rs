//! What `braid plan` shows: every model call with its devices and layout, the fusion decisions
//! and why, predicted time and memory per device — as text, JSON or DOT — and the `E0504`
//! diagnostics of calls that do not fit device memory.
//!
//! Output is deterministic: maps are ordered, floats printed with fixed precision. Rendering
//! decides nothing; it reads the decisions and prices them with `estimate`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use braid_diagnostics::{Code, Diagnostic, Span};
use braid_ir::graph::{NodeId, Op};
use serde::Serialize;

use crate::annotated::{
    Annotated, InterleaveDecision, MigrationDecision, Placement, SearchRecord, SpeculationDecision,
    StreamDecision, TransferDecision,
};
use crate::cost::MemoryNeeds;
use crate::estimate::{self, EstimateOptions};
use crate::passes::place::describe;

/// One model call in the report.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CallReport {
    pub node: NodeId,
    pub call: String,
    pub placement: Placement,
    pub seconds: f64,
    pub memory: MemoryNeeds,
    pub fits: bool,
    pub placement_why: String,
    pub stream: Option<StreamDecision>,
    /// Where it runs when it streams after migration.
    pub subtask_placement: Option<Placement>,
    pub speculation: Option<SpeculationDecision>,
}

/// The peak memory of a range of devices that share it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DeviceMemory {
    pub first: u64,
    pub end: u64,
    pub peak_bytes: u64,
    pub usable_bytes: u64,
    /// The call at the peak.
    pub call: String,
}

/// The whole plan report (`--format json`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlanReport {
    pub pipeline: String,
    pub cluster: String,
    pub device: String,
    pub devices: u64,
    pub passes: Vec<String>,
    pub calls: Vec<CallReport>,
    pub migrations: BTreeMap<NodeId, MigrationDecision>,
    pub interleave: Vec<InterleaveDecision>,
    pub transfers: BTreeMap<NodeId, TransferDecision>,
    pub search: Option<SearchRecord>,
    pub notes: Vec<String>,
    pub predicted_iteration_seconds: f64,
    pub memory: Vec<DeviceMemory>,
    pub graph: String,
}

/// Collects the report of a planned plan.
pub fn report(a: &Annotated) -> PlanReport {
    let placements = estimate::placements(a);
    let mut calls = Vec::new();
    for id in a.calls() {
        let Some(p) = placements.get(&id) else {
            continue;
        };
        let memory = estimate::call_memory(a, id, p).unwrap_or(MemoryNeeds {
            weights: 0,
            gradients: 0,
            optimizer: 0,
            activations: 0,
            kv_cache: 0,
        });
        let fits = memory.fits(&a.cost.device).is_ok();
        calls.push(CallReport {
            node: id,
            call: a.call_name(id),
            placement: *p,
            seconds: estimate::call_time(a, id, p),
            memory,
            fits,
            placement_why: a
                .decisions
                .placement_why
                .get(&id)
                .cloned()
                .unwrap_or_else(|| "heuristic (the `place` pass did not run)".into()),
            stream: a.decisions.streams.get(&id).cloned(),
            subtask_placement: a.decisions.subtask_placements.get(&id).copied(),
            speculation: a.decisions.speculation.get(&id).cloned(),
        });
    }
    let deps = estimate::call_deps(a);
    let mut times = |id: NodeId, p: &Placement| estimate::call_time(a, id, p);
    let predicted = estimate::iteration_time(
        a,
        &placements,
        &deps,
        &mut times,
        EstimateOptions {
            fused_training: !a.decisions.interleave.is_empty(),
        },
    );
    // Peak per device over the calls on it.
    let n = a.cluster.devices();
    let mut peak: Vec<(u64, String)> = vec![(0, String::new()); n as usize];
    for c in &calls {
        let total = c.memory.total();
        for d in c.placement.devices() {
            if let Some(slot) = peak.get_mut(d as usize)
                && total > slot.0
            {
                *slot = (total, c.call.clone());
            }
        }
    }
    let usable = a.cost.device.usable_memory();
    let mut memory: Vec<DeviceMemory> = Vec::new();
    for (d, (bytes, call)) in peak.into_iter().enumerate() {
        match memory.last_mut() {
            Some(m) if m.peak_bytes == bytes && m.call == call => m.end = d as u64 + 1,
            _ => memory.push(DeviceMemory {
                first: d as u64,
                end: d as u64 + 1,
                peak_bytes: bytes,
                usable_bytes: usable,
                call,
            }),
        }
    }
    PlanReport {
        pipeline: a.plan.pipeline.clone(),
        cluster: a.cluster.to_string(),
        device: a.cost.device.kind.name().to_string(),
        devices: n,
        passes: a.decisions.passes_run.clone(),
        calls,
        migrations: a.decisions.migrations.clone(),
        interleave: a.decisions.interleave.clone(),
        transfers: a.decisions.transfers.clone(),
        search: a.decisions.search.clone(),
        notes: a.decisions.notes.clone(),
        predicted_iteration_seconds: predicted,
        memory,
        graph: a.plan.graph_text(),
    }
}

fn gb(b: u64) -> String {
    format!("{:.2} GB", b as f64 / 1e9)
}

fn secs(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else {
        format!("{:.2} ms", s * 1e3)
    }
}

/// The text form of `braid plan`.
pub fn to_text(r: &PlanReport) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "plan `{}` on {} ({} × {})",
        r.pipeline, r.cluster, r.devices, r.device
    );
    let _ = writeln!(o, "passes: {}", r.passes.join(", "));
    o.push_str("\ncalls:\n");
    for c in &r.calls {
        let _ = writeln!(
            o,
            "  {} {}: {}; {}; {} per device{}",
            c.node,
            c.call,
            describe(&c.placement),
            secs(c.seconds),
            gb(c.memory.total()),
            if c.fits { "" } else { " — DOES NOT FIT" }
        );
        let _ = writeln!(o, "      place: {}", c.placement_why);
        if let Some(s) = &c.stream {
            let _ = writeln!(o, "      sample-split: {} (from {})", s.why, s.generate);
        }
        if let Some(p) = &c.subtask_placement {
            let _ = writeln!(
                o,
                "      sample-split: streams on the devices migration frees: {}",
                describe(p)
            );
        }
        if let Some(s) = &c.speculation {
            let policy: Vec<String> = s.policy.iter().map(|(b, k)| format!("≤{b}→{k}")).collect();
            let what = match (s.mode.as_str(), s.ngram, &s.draft_model) {
                ("ngram", Some(n), _) => format!("ngram({n})"),
                ("draft", _, Some(m)) => format!("draft({m})"),
                (m, _, _) => m.to_string(),
            };
            let _ = writeln!(
                o,
                "      speculate: {what}, draft length by live batch [{}]: {}",
                policy.join(", "),
                s.why
            );
        }
    }
    o.push_str("\nfusion:\n");
    if r.migrations.is_empty() && r.interleave.is_empty() {
        o.push_str("  none\n");
    }
    for (g, m) in &r.migrations {
        let cands: Vec<String> = m
            .candidates
            .iter()
            .map(|(t, s)| format!("{t}: {}", secs(*s)))
            .collect();
        let _ = writeln!(
            o,
            "  sample-split: {g}: migrate the long tail onto {} instance(s) when ≤ {} samples remain — {} [{}]",
            m.to_instances,
            m.threshold,
            m.why,
            cands.join(", ")
        );
    }
    for i in &r.interleave {
        let _ = writeln!(
            o,
            "  microbatch-interleave: {}; {} fused vs {} in sequence",
            i.why,
            secs(i.fused_seconds),
            secs(i.serial_seconds)
        );
    }
    if !r.transfers.is_empty() {
        o.push_str("\ntransfers:\n");
        for (id, t) in &r.transfers {
            let _ = writeln!(
                o,
                "  {id}: {} moved, {}; {} — {}",
                gb(t.bytes),
                secs(t.seconds),
                t.collectives.join("; "),
                t.why
            );
        }
    }
    if !r.notes.is_empty() {
        o.push_str("\nnotes:\n");
        for n in &r.notes {
            let _ = writeln!(o, "  {n}");
        }
    }
    o.push('\n');
    match &r.search {
        Some(s) => {
            let _ = writeln!(
                o,
                "predicted iteration: {} (heuristic placement {}, searched {}; {} proposals, {} accepted)",
                secs(r.predicted_iteration_seconds),
                secs(s.heuristic_seconds),
                secs(s.searched_seconds),
                s.iterations,
                s.accepted
            );
            if !s.simulated.is_empty() {
                let c: Vec<String> = s
                    .simulated
                    .iter()
                    .map(|(n, t)| format!("{n} {}", secs(*t)))
                    .collect();
                let _ = writeln!(
                    o,
                    "placement checked in the simulator: {}; kept {}",
                    c.join(", "),
                    s.kept
                );
            }
        }
        None => {
            let _ = writeln!(
                o,
                "predicted iteration: {}",
                secs(r.predicted_iteration_seconds)
            );
        }
    }
    o.push_str("memory per device (peak over calls):\n");
    for m in &r.memory {
        let devs = if m.end == m.first + 1 {
            format!("device {}", m.first)
        } else {
            format!("devices {}..{}", m.first, m.end)
        };
        let _ = writeln!(
            o,
            "  {devs}: {} of {} usable{}",
            gb(m.peak_bytes),
            gb(m.usable_bytes),
            if m.call.is_empty() {
                " (idle)".to_string()
            } else {
                format!(" ({})", m.call)
            }
        );
    }
    o.push_str("\ngraph:\n");
    for line in r.graph.lines() {
        let _ = writeln!(o, "  {line}");
    }
    o
}

/// DOT: the task graph, each model call labelled with its devices and layout.
pub fn to_dot(a: &Annotated) -> String {
    let r = report(a);
    let mut dot = a.plan.graph.to_dot(&a.plan.model_names());
    let mut extra = String::new();
    for c in &r.calls {
        let _ = writeln!(
            extra,
            "  {} [xlabel=\"{}\"];",
            c.node,
            describe(&c.placement).replace('"', "'")
        );
    }
    for i in &r.interleave {
        let _ = writeln!(
            extra,
            "  {} -> {} [style=dotted, dir=both, label=\"fused pipeline\", constraint=false];",
            i.forward, i.reverse
        );
    }
    if dot.ends_with("}\n") {
        dot.truncate(dot.len() - 2);
        dot.push_str(&extra);
        dot.push_str("}\n");
    }
    dot
}

/// Where diagnostics about a plan point: the run (primary) and each model's declaration when
/// it is in the same file.
#[derive(Clone, Debug, Default)]
pub struct PlanSpans {
    pub run: Span,
    pub models: BTreeMap<String, Span>,
}

/// `E0504 plan-exceeds-memory` for what a device holds at once, when every call fits on its
/// own: the weights of every model with a call on the device (with gradients and optimizer
/// state for trained ones) stay resident between calls, and the largest transient need of a
/// call there (its activations, its KV cache) comes on top. A model that `reshard-insert`
/// offloads is resident only while its own calls run. A trained model whose generation streams
/// a call on the same model generates on a copy of its weights (in its dtype), which the
/// runtime keeps next to the trained model on the generation's devices. One diagnostic per run
/// of devices with the same residents, naming the models and the bytes.
pub fn resident_memory_diagnostics(a: &Annotated, spans: &PlanSpans) -> Vec<Diagnostic> {
    let placements = estimate::placements(a);
    let exec = a.to_exec_plan();
    // Trained models with a generation copy, and the `generate` that uses it.
    let copies: Vec<(u32, braid_ir::graph::NodeId)> = a
        .calls()
        .into_iter()
        .filter_map(|id| match a.plan.graph.node(id).map(|n| &n.op) {
            Some(Op::Generate { model, .. }) => Some((*model, id)),
            _ => None,
        })
        .filter(|(m, g)| {
            a.plan
                .models
                .get(*m as usize)
                .is_some_and(|s| s.optimizer.is_some())
                && exec
                    .streamed(*g)
                    .iter()
                    .any(|(c, _)| a.plan.graph.node(*c).and_then(|n| n.op.model()) == Some(*m))
        })
        .collect();
    let usable = a.cost.device.usable_memory();
    let offloaded: std::collections::BTreeSet<u32> = a
        .plan
        .graph
        .node_ids()
        .into_iter()
        .filter_map(|id| match a.plan.graph.node(id).map(|n| &n.op) {
            Some(Op::Offload { model, .. }) => Some(*model),
            _ => None,
        })
        .collect();
    // Calls that do not fit on their own already have their diagnostic.
    let alone: std::collections::BTreeSet<u64> = placements
        .iter()
        .filter(|(id, p)| {
            estimate::call_memory(a, **id, p).is_some_and(|m| m.fits(&a.cost.device).is_err())
        })
        .flat_map(|(_, p)| p.devices())
        .collect();
    let mut out = Vec::new();
    let mut reported: Vec<(Vec<String>, u64)> = Vec::new();
    for d in 0..a.cluster.devices() {
        if alone.contains(&d) {
            continue;
        }
        // Per model on this device: its resident bytes (max over its calls here).
        let mut resident: BTreeMap<u32, u64> = BTreeMap::new();
        let mut transient = 0u64;
        for id in a.calls() {
            let Some(p) = placements.get(&id).filter(|p| p.devices().contains(&d)) else {
                continue;
            };
            let (Some(m), Some(mem)) = (
                a.plan.graph.node(id).and_then(|n| n.op.model()),
                estimate::call_memory(a, id, p),
            ) else {
                continue;
            };
            let state = mem.weights + mem.gradients + mem.optimizer;
            let mut here = mem.activations + mem.kv_cache;
            if offloaded.contains(&m) {
                here += state;
            } else {
                let e = resident.entry(m).or_default();
                *e = (*e).max(state);
            }
            transient = transient.max(here);
        }
        let mut copy_bytes: BTreeMap<u32, u64> = BTreeMap::new();
        for (m, g) in &copies {
            if let Some(p) = placements.get(g).filter(|p| p.devices().contains(&d))
                && let Some(mem) = estimate::call_memory(a, *g, p)
            {
                copy_bytes.insert(*m, mem.weights);
            }
        }
        let held: u64 = resident.values().sum::<u64>() + copy_bytes.values().sum::<u64>();
        let total = held + transient;
        if total <= usable {
            continue;
        }
        let names: Vec<String> = resident.keys().map(|m| a.model_name(*m)).collect();
        if let Some(last) = reported.last_mut()
            && last.0 == names
        {
            last.1 = d + 1;
            continue;
        }
        reported.push((names.clone(), d + 1));
        let parts: Vec<String> = resident
            .iter()
            .map(|(m, b)| format!("`{}` {}", a.model_name(*m), gb(*b)))
            .chain(
                copy_bytes
                    .iter()
                    .map(|(m, b)| format!("`{}`'s generation copy {}", a.model_name(*m), gb(*b))),
            )
            .collect();
        let mut diag = Diagnostic::new(
            Code::E0504,
            format!(
                "the models on device {d} ({}) need {total} bytes together, which is more than its {usable} usable",
                a.cost.device.kind.name()
            ),
            spans.run,
            "the models of this run do not fit together".to_string(),
        )
        .with_note(format!(
            "resident between calls: {}; the largest call's activations and KV cache add {}; {} usable",
            parts.join(", "),
            gb(transient),
            gb(usable)
        ))
        .with_help(
            "plan for more or larger devices (`cluster { gpus: … }` or `--cluster`), place the models on different devices (`place` pins), or use smaller models",
        );
        for n in &names {
            if let Some(s) = spans.models.get(n) {
                diag = diag.with_label(*s, format!("`{n}` is declared here"));
            }
        }
        out.push(diag);
    }
    out
}

/// `E0504 plan-exceeds-memory`: one diagnostic per call whose placement does not fit its
/// devices' memory, naming the call, the devices and the bytes.
pub fn memory_diagnostics(a: &Annotated, spans: &PlanSpans) -> Vec<Diagnostic> {
    let placements = estimate::placements(a);
    let mut out = Vec::new();
    for id in a.calls() {
        let Some(p) = placements.get(&id) else {
            continue;
        };
        let Some(mem) = estimate::call_memory(a, id, p) else {
            continue;
        };
        let Err(over) = mem.fits(&a.cost.device) else {
            continue;
        };
        let call = a.call_name(id);
        let model = a
            .plan
            .graph
            .node(id)
            .and_then(|n| n.op.model())
            .map(|m| a.model_name(m))
            .unwrap_or_default();
        let devices = if p.count == 1 {
            format!("device {}", p.first)
        } else {
            format!("each of devices {}..{}", p.first, p.first + p.count)
        };
        let mut d = Diagnostic::new(
            Code::E0504,
            format!(
                "`{call}` needs {} bytes on {devices} ({}), which has {} bytes usable",
                over.needed,
                a.cost.device.kind.name(),
                over.usable
            ),
            spans.run,
            format!("`{call}` does not fit in device memory"),
        )
        .with_note(format!(
            "with {}: {over}; weights {}, gradients {}, optimizer state {}, activations {}, KV cache {}",
            describe(p),
            gb(mem.weights),
            gb(mem.gradients),
            gb(mem.optimizer),
            gb(mem.activations),
            gb(mem.kv_cache)
        ))
        .with_help(match a.plan.graph.node(id).map(|n| &n.op) {
            Some(Op::Train { .. }) => format!(
                "plan for more or larger devices (`cluster {{ gpus: … }}` or `--cluster`), a smaller \
                 model, or fewer sequences per micro-batch (`micro_batch {call} 1` in `schedule`)"
            ),
            Some(Op::Generate { .. }) => "plan for more or larger devices, a smaller batch or \
                 fewer `max_new_tokens` (the KV cache grows with both)"
                .to_string(),
            _ => "plan for more or larger devices (`cluster { gpus: … }` or `--cluster`) or a \
                  smaller model"
                .to_string(),
        });
        if let Some(s) = spans.models.get(&model) {
            d = d.with_label(*s, format!("`{model}` is declared here"));
        }
        out.push(d);
    }
    out
}
