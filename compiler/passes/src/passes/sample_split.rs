//! `sample-split` (RLHFuse inter-stage fusion): consumers of a generation that work sample by
//! sample become streaming subtasks that start on the samples already finished, while the
//! long tail still decodes.
//!
//! Granularity bounds the cut: a node whose value is complete per sample streams; a per-group
//! node waits for its prompt's group; a per-batch node (whitening, a loss, `train`) waits for
//! the whole batch. Long-tail migration: when no more than `R_t` samples are still decoding,
//! they move onto fewer engine instances and the freed devices run the streaming inference
//! calls (which this pass moves onto those devices when they shared the generation's mesh).
//! `R_t` is chosen by simulating the placed plan with the declared or default output-length
//! distribution for each candidate ([`crate::sim::pick_migration_threshold`]);
//! `migrate below P%` pins it and `migrate off` / `fuse off` turn the pass's decisions off.

use braid_ir::graph::{Gran, NodeId, Op};

use crate::annotated::{Annotated, Cut, MigrationDecision, Placement, StreamDecision};
use crate::estimate::{self, call_size};
use crate::passes::{Pass, PassError};
use crate::sim::{SimOptions, pick_migration_threshold, simulate};
use crate::to_sim::to_dag;

pub struct SampleSplit;

impl Pass for SampleSplit {
    fn name(&self) -> &'static str {
        "sample-split"
    }

    fn summary(&self) -> &'static str {
        "stream per-sample consumers of generate; migrate the long tail at a simulated R_t"
    }

    fn run(&self, a: &mut Annotated) -> Result<(), PassError> {
        if a.pins.fuse_off {
            a.decisions
                .notes
                .push("sample-split: `fuse off` is pinned; nothing streams".into());
            return Ok(());
        }
        let g = &a.plan.graph;
        let mut streams = Vec::new();
        for id in g.topo_order().unwrap_or_else(|| g.node_ids()) {
            let Some(node) = g.node(id) else { continue };
            if matches!(
                node.op,
                Op::Generate { .. }
                    | Op::Next { .. }
                    | Op::Reshard { .. }
                    | Op::Offload { .. }
                    | Op::Reload { .. }
            ) {
                continue;
            }
            let Some(gen_id) = g.rollout_of(id) else {
                continue;
            };
            let (cut, why) = match node.gran {
                Gran::Scalar | Gran::Sample => (
                    Cut::Sample,
                    "per-sample: runs on each sample as soon as it is generated".to_string(),
                ),
                Gran::Group => (
                    Cut::Group,
                    "per-group: waits for the samples of its prompt's group".to_string(),
                ),
                Gran::Batch => (
                    Cut::Batch,
                    format!("per-batch: `{}` needs the whole batch", node.op.name()),
                ),
            };
            streams.push((
                id,
                StreamDecision {
                    generate: gen_id,
                    cut,
                    why,
                },
            ));
        }
        for (id, s) in streams {
            a.decisions.streams.insert(id, s);
        }
        let placements = estimate::placements(a);
        let gens: Vec<NodeId> = a
            .calls()
            .into_iter()
            .filter(|i| {
                matches!(
                    a.plan.graph.node(*i).map(|n| &n.op),
                    Some(Op::Generate { .. })
                )
            })
            .collect();
        for gen_id in gens {
            let (Some(gp), Some(size)) = (placements.get(&gen_id), call_size(a, gen_id)) else {
                continue;
            };
            if a.pins.migrate_off {
                a.decisions
                    .notes
                    .push(format!("sample-split: {gen_id}: `migrate off` is pinned"));
                continue;
            }
            if gp.dp < 2 {
                a.decisions.notes.push(format!(
                    "sample-split: {} runs as one engine instance; no long tail to consolidate",
                    a.call_name(gen_id)
                ));
                continue;
            }
            let to_instances = (gp.dp / 8).max(1);
            // Streaming consumers that shared the generation's devices move onto the devices
            // that migration frees.
            let kept = to_instances * gp.tp * gp.pp;
            let freed = Placement {
                first: gp.first + kept,
                count: gp.count - kept,
                ..*gp
            };
            for (&id, s) in &a.decisions.streams {
                if s.generate != gen_id || s.cut != Cut::Sample {
                    continue;
                }
                let Some(p) = placements.get(&id) else {
                    continue;
                };
                if !p.overlaps(gp) {
                    continue;
                }
                if let Some(sub) = subtask_placement(a, id, p, &freed) {
                    a.decisions.subtask_placements.insert(id, sub);
                }
            }
            let samples = size.samples;
            let candidates: Vec<u64> = match a.pins.migrate_below {
                Some(frac) => vec![((samples as f64 * frac).ceil() as u64).max(1)],
                None => {
                    let mut v: Vec<u64> = [64u64, 32, 16, 8, 4]
                        .iter()
                        .map(|d| (samples / d).max(1))
                        .collect();
                    v.dedup();
                    v
                }
            };
            let mut probe = a.clone();
            probe.decisions.migrations.insert(
                gen_id,
                MigrationDecision {
                    threshold: candidates[0],
                    to_instances,
                    candidates: Vec::new(),
                    why: String::new(),
                },
            );
            let (dag, tasks) = to_dag(&probe, true).map_err(PassError)?;
            let Some(&task) = tasks.get(&gen_id) else {
                continue;
            };
            let opts = SimOptions {
                iterations: 2,
                seed: a.seed,
            };
            let (threshold, results) = pick_migration_threshold(&dag, task, &candidates, &opts)
                .map_err(|e| PassError(e.0))?;
            let why = if a.pins.migrate_below.is_some() {
                format!("pinned by `migrate below`: {threshold} of {samples} samples")
            } else {
                format!(
                    "fastest simulated iteration over {} candidates ({} of {samples} samples)",
                    results.len(),
                    threshold
                )
            };
            a.decisions.migrations.insert(
                gen_id,
                MigrationDecision {
                    threshold,
                    to_instances,
                    candidates: results,
                    why,
                },
            );
            // Keep migration (and the moved subtasks) only if it beats streaming without it.
            let with = simulated(a, &opts)?;
            let mut without = a.clone();
            without.decisions.migrations.remove(&gen_id);
            without.decisions.subtask_placements.retain(|id, _| {
                a.decisions
                    .streams
                    .get(id)
                    .is_none_or(|s| s.generate != gen_id)
            });
            let plain = simulated(&without, &opts)?;
            if plain <= with {
                a.decisions.notes.push(format!(
                    "sample-split: migrating {}'s tail would not pay ({with:.3} s vs {plain:.3} s \
                     simulated per iteration); it streams without migrating",
                    a.call_name(gen_id)
                ));
                a.decisions.migrations = without.decisions.migrations;
                a.decisions.subtask_placements = without.decisions.subtask_placements;
            }
        }
        // Streaming at all must beat the plan without it.
        let opts = SimOptions {
            iterations: 2,
            seed: a.seed,
        };
        let fused = simulated(a, &opts)?;
        let (dag, _) = to_dag(a, false).map_err(PassError)?;
        let unfused = simulate(&dag, &opts)
            .map_err(|e| PassError(e.0))?
            .mean_iteration_time;
        if unfused < fused {
            a.decisions.notes.push(format!(
                "sample-split: streaming would not pay ({fused:.3} s vs {unfused:.3} s simulated \
                 per iteration); nothing streams"
            ));
            a.decisions.streams.clear();
            a.decisions.migrations.clear();
            a.decisions.subtask_placements.clear();
        }
        Ok(())
    }
}

/// Call `id` (placed at `p`) moved onto `freed`: the same tensor and pipeline degrees, as many
/// data-parallel replicas as fit, the same sequences per micro-batch.
fn subtask_placement(
    a: &Annotated,
    id: NodeId,
    p: &Placement,
    freed: &Placement,
) -> Option<Placement> {
    let group = p.tp * p.pp;
    let dp = freed.count / group;
    if dp == 0 {
        return None;
    }
    let size = call_size(a, id)?;
    let chunk = size
        .samples
        .div_ceil(p.dp)
        .div_ceil(p.microbatches.max(1))
        .max(1);
    let per = size.samples.div_ceil(dp);
    Some(Placement {
        first: freed.first,
        count: dp * group,
        dp,
        tp: p.tp,
        pp: p.pp,
        microbatches: per.div_ceil(chunk).max(1),
    })
}

/// Mean simulated iteration time of the plan with its fusion decisions.
fn simulated(a: &Annotated, opts: &SimOptions) -> Result<f64, PassError> {
    let (dag, _) = to_dag(a, true).map_err(PassError)?;
    Ok(simulate(&dag, opts)
        .map_err(|e| PassError(e.0))?
        .mean_iteration_time)
}
