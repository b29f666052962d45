//! `microbatch-interleave` (RLHFuse intra-stage fusion): when two trained models (actor and
//! critic) train on the same devices with pipeline parallelism, their micro-batch pipelines run
//! as one fused schedule — the larger pipeline forward, the smaller one's replicas in reverse —
//! so that each fills the other's bubbles.
//!
//! The schedule comes from the fused-pipeline solver ([`crate::fused_pipeline::solve`]: a
//! greedy start, forward–backward improvement, annealing on latency and then on peak
//! activation memory without losing latency), on a problem whose durations are the cost
//! model's per-stage forward and backward times in integer units. The decision records the
//! latency against the lower bound and against the two pipelines run one after the other; it
//! is kept only when fusing is faster. `fuse off` turns the pass off.

use braid_ir::graph::{NodeId, Op};

use crate::annotated::{Annotated, InterleaveDecision, Placement};
use crate::estimate::{self, fused_train};
use crate::fused_pipeline::solve;
use crate::passes::{Pass, PassError};

pub struct MicrobatchInterleave;

impl Pass for MicrobatchInterleave {
    fn name(&self) -> &'static str {
        "microbatch-interleave"
    }

    fn summary(&self) -> &'static str {
        "fuse two trainings' pipelines on shared devices (RLHFuse intra-stage fusion)"
    }

    fn run(&self, a: &mut Annotated) -> Result<(), PassError> {
        if a.pins.fuse_off {
            a.decisions
                .notes
                .push("microbatch-interleave: `fuse off` is pinned".into());
            return Ok(());
        }
        let placements = estimate::placements(a);
        let trains: Vec<NodeId> = a
            .calls()
            .into_iter()
            .filter(|i| matches!(a.plan.graph.node(*i).map(|n| &n.op), Some(Op::Train { .. })))
            .collect();
        if trains.len() < 2 {
            a.decisions.notes.push(format!(
                "microbatch-interleave: {} trained model call(s); nothing to interleave",
                trains.len()
            ));
            return Ok(());
        }
        // `interleave` pins name the pairs; without them every pair may fuse.
        let pinned = pinned_pairs(a, &trains);
        let pairs: Vec<(NodeId, NodeId)> = if a.pins.interleave.is_empty() {
            trains
                .iter()
                .enumerate()
                .flat_map(|(i, &x)| trains[i + 1..].iter().map(move |&y| (x, y)))
                .collect()
        } else {
            for (pin, extra) in &pinned {
                for &e in extra {
                    a.decisions.notes.push(format!(
                        "microbatch-interleave: {} is also listed in the `interleave` pin, but a \
                         fused schedule interleaves two pipelines; it trains on its own",
                        a.call_name(e)
                    ));
                }
                if pin.is_none() {
                    a.decisions.notes.push(
                        "microbatch-interleave: an `interleave` pin names fewer than two train \
                         calls of this run; nothing to fuse for it"
                            .into(),
                    );
                }
            }
            pinned.iter().filter_map(|(p, _)| *p).collect()
        };
        let is_pinned = |x: NodeId, y: NodeId| {
            pinned
                .iter()
                .any(|(p, _)| *p == Some((x, y)) || *p == Some((y, x)))
        };
        let mut used: Vec<NodeId> = Vec::new();
        for (x, y) in pairs {
            {
                if used.contains(&x) || used.contains(&y) {
                    continue;
                }
                let (Some(px), Some(py)) = (placements.get(&x), placements.get(&y)) else {
                    continue;
                };
                let Some(f) = fused_train(a, x, px, y, py) else {
                    let why = why_not_fusable(px, py);
                    a.decisions.notes.push(if is_pinned(x, y) {
                        format!(
                            "microbatch-interleave: the `interleave` pin on {} and {} cannot be \
                             honoured: {why}",
                            a.call_name(x),
                            a.call_name(y)
                        )
                    } else {
                        format!(
                            "microbatch-interleave: {} and {} do not share devices with pipeline \
                             parallelism (one pipeline dividing the other, same tp and steps): \
                             {why}",
                            a.call_name(x),
                            a.call_name(y)
                        )
                    });
                    continue;
                };
                let s = solve(&f.problem).map_err(|e| PassError(e.0))?;
                let fused_seconds = f.seconds(s.latency);
                if fused_seconds >= f.serial_seconds && is_pinned(x, y) {
                    a.decisions.notes.push(format!(
                        "microbatch-interleave: {} and {} are fused as pinned by `interleave`, \
                         although in sequence they would be faster ({fused_seconds:.3} s vs \
                         {:.3} s)",
                        a.call_name(x),
                        a.call_name(y),
                        f.serial_seconds
                    ));
                } else if fused_seconds >= f.serial_seconds {
                    a.decisions.notes.push(format!(
                        "microbatch-interleave: fusing {} and {} would not be faster \
                         ({fused_seconds:.3} s vs {:.3} s)",
                        a.call_name(x),
                        a.call_name(y),
                        f.serial_seconds
                    ));
                    continue;
                }
                let why = format!(
                    "{} (pp {}) forward and {} (pp {}, {} replicas) in reverse on the same \
                     devices; fused latency {} units of {:.4} s, lower bound {}, the two 1F1B \
                     pipelines in sequence {}",
                    a.call_name(f.forward),
                    f.problem.models[0].pp,
                    a.call_name(f.reverse),
                    f.problem.models[1].pp,
                    f.problem.stages / f.problem.models[1].pp.max(1),
                    s.latency,
                    f.unit_seconds,
                    s.lower_bound,
                    s.serial_1f1b_latency
                );
                a.decisions.interleave.push(InterleaveDecision {
                    forward: f.forward,
                    reverse: f.reverse,
                    unit_seconds: f.unit_seconds,
                    latency: s.latency,
                    lower_bound: s.lower_bound,
                    serial_1f1b_latency: s.serial_1f1b_latency,
                    peak_memory: s.peak_memory,
                    fused_seconds,
                    serial_seconds: f.serial_seconds,
                    schedule: s,
                    why,
                });
                used.push(x);
                used.push(y);
            }
        }
        Ok(())
    }
}

/// One `interleave` pin's pair (absent when it selects fewer than two train calls) and the
/// other train calls it selects.
pub type PinnedPair = (Option<(NodeId, NodeId)>, Vec<NodeId>);

/// Per `interleave` pin: the first two train calls it selects (absent when it selects fewer)
/// and the others it selects, which a two-model fused schedule cannot take.
pub fn pinned_pairs(a: &Annotated, trains: &[NodeId]) -> Vec<PinnedPair> {
    a.pins
        .interleave
        .iter()
        .map(|sels| {
            let chosen: Vec<NodeId> = trains
                .iter()
                .copied()
                .filter(|&t| sels.iter().any(|s| a.selected(s, t)))
                .collect();
            match chosen.as_slice() {
                [x, y, rest @ ..] => (Some((*x, *y)), rest.to_vec()),
                _ => (None, Vec::new()),
            }
        })
        .collect()
}

/// Why two trains' placements cannot run as one fused pipeline schedule.
fn why_not_fusable(px: &Placement, py: &Placement) -> String {
    if (px.first, px.count) != (py.first, py.count) {
        format!(
            "they run on different devices ({}..{} and {}..{})",
            px.first,
            px.first + px.count,
            py.first,
            py.first + py.count
        )
    } else if px.tp != py.tp {
        format!(
            "their tensor-parallel degrees differ ({} and {})",
            px.tp, py.tp
        )
    } else if px.pp.max(py.pp) < 2 {
        "neither is pipelined, so there are no bubbles to fill".into()
    } else if !px.pp.max(py.pp).is_multiple_of(px.pp.min(py.pp)) {
        format!(
            "the smaller pipeline ({}) does not divide the larger ({})",
            px.pp.min(py.pp),
            px.pp.max(py.pp)
        )
    } else {
        "they take different numbers of optimizer steps, or no fitting fused problem exists".into()
    }
}
