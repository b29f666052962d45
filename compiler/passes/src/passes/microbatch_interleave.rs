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

use crate::annotated::{Annotated, InterleaveDecision};
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
        let mut used: Vec<NodeId> = Vec::new();
        for (i, &x) in trains.iter().enumerate() {
            for &y in &trains[i + 1..] {
                if used.contains(&x) || used.contains(&y) {
                    continue;
                }
                let (Some(px), Some(py)) = (placements.get(&x), placements.get(&y)) else {
                    continue;
                };
                let Some(f) = fused_train(a, x, px, y, py) else {
                    a.decisions.notes.push(format!(
                        "microbatch-interleave: {} and {} do not share devices with pipeline \
                         parallelism (one pipeline dividing the other, same tp and steps)",
                        a.call_name(x),
                        a.call_name(y)
                    ));
                    continue;
                };
                let s = solve(&f.problem).map_err(|e| PassError(e.0))?;
                let fused_seconds = f.seconds(s.latency);
                if fused_seconds >= f.serial_seconds {
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
                    why,
                });
                used.push(x);
                used.push(y);
            }
        }
        Ok(())
    }
}
