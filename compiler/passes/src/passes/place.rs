//! `place` (ReaL): a device mesh, a `(dp, tp, pp)` layout and a micro-batch count for every
//! model call, found by Markov-chain Monte Carlo search on the cost model.
//!
//! The chain starts from the heuristic plan (every call on all devices with its fastest layout
//! that fits, [`estimate::heuristic_placement`]) and proposes moves on one unpinned call at a
//! time: a new mesh (an aligned power-of-two block of devices, or all of them) with one of its
//! faster fitting layouts, or another fitting layout on the same mesh. The objective is the
//! iteration time of a list schedule with reshard costs ([`estimate::iteration_time`]);
//! moves are accepted by the Metropolis rule at a temperature that cools geometrically. The
//! best state seen is kept, so the searched plan is never worse than the heuristic one (the
//! pass asserts it). `schedule { place … }` pins fix their calls' placements. Layouts that do
//! not fit device memory are never proposed.

use std::collections::BTreeMap;

use braid_ir::graph::NodeId;

use crate::annotated::{Annotated, PinTarget, Placement, SearchRecord};
use crate::estimate::{self, EstimateOptions};
use crate::passes::{Pass, PassError};
use crate::prng::Rng;

pub struct Place;

/// Proposals per model call (the chain's length is this times the number of free calls).
const ITERATIONS_PER_CALL: u64 = 600;

impl Pass for Place {
    fn name(&self) -> &'static str {
        "place"
    }

    fn summary(&self) -> &'static str {
        "device mesh, (dp, tp, pp) and micro-batches per model call by MCMC on the cost model"
    }

    fn run(&self, a: &mut Annotated) -> Result<(), PassError> {
        let calls = a.calls();
        let mut current: BTreeMap<NodeId, Placement> = BTreeMap::new();
        let mut why: BTreeMap<NodeId, String> = BTreeMap::new();
        let mut free: Vec<NodeId> = Vec::new();
        for &id in &calls {
            if let Some(p) = pinned(a, id) {
                current.insert(id, p);
                why.insert(id, "pinned by `place` in the schedule".into());
                continue;
            }
            let Some(p) = estimate::heuristic_placement(a, id) else {
                continue;
            };
            current.insert(id, p);
            free.push(id);
        }
        let deps = estimate::call_deps(a);
        let opts = EstimateOptions {
            fused_training: a.will_run("microbatch-interleave") && !a.pins.fuse_off,
        };
        let mut time_cache: BTreeMap<(NodeId, u64, u64, u64, u64), f64> = BTreeMap::new();
        let mut cost = |a: &Annotated, pl: &BTreeMap<NodeId, Placement>| {
            let mut times = |id: NodeId, p: &Placement| {
                *time_cache
                    .entry((id, p.dp, p.tp, p.pp, p.microbatches))
                    .or_insert_with(|| estimate::call_time(a, id, p))
            };
            estimate::iteration_time(a, pl, &deps, &mut times, opts)
        };
        let heuristic = current.clone();
        let heuristic_cost = cost(a, &heuristic);
        let n = a.cluster.devices();
        let sizes = mesh_sizes(n);
        let mut options: BTreeMap<(NodeId, u64), Vec<Placement>> = BTreeMap::new();
        let mut rng = Rng::new(a.seed ^ 0x504C_4143);
        let mut best = current.clone();
        let mut best_cost = heuristic_cost;
        let mut cur_cost = heuristic_cost;
        let iterations = ITERATIONS_PER_CALL * free.len() as u64;
        let mut accepted = 0;
        let t0 = 0.05 * heuristic_cost.max(1e-9);
        let t1 = 1e-4 * heuristic_cost.max(1e-9);
        for it in 0..iterations {
            let id = free[rng.below(free.len())];
            let Some(old) = current.get(&id).copied() else {
                continue;
            };
            let count = if rng.next_f64() < 0.5 {
                sizes[rng.below(sizes.len())]
            } else {
                old.count
            };
            let opts_here = options
                .entry((id, count))
                .or_insert_with(|| {
                    estimate::fitting_options(a, id, count)
                        .into_iter()
                        .map(|x| x.1)
                        .collect()
                })
                .clone();
            if opts_here.is_empty() {
                continue;
            }
            // Bias towards the faster layouts: the better of two uniform picks.
            let k = rng.below(opts_here.len()).min(rng.below(opts_here.len()));
            let first = if count == old.count && rng.next_f64() < 0.7 {
                old.first
            } else {
                count * rng.below((n / count) as usize) as u64
            };
            let proposal = Placement {
                first,
                ..opts_here[k]
            };
            if proposal == old {
                continue;
            }
            current.insert(id, proposal);
            let c = cost(a, &current);
            let frac = it as f64 / iterations.max(1) as f64;
            let temp = t0 * (t1 / t0).powf(frac);
            let accept = c <= cur_cost || rng.next_f64() < (-(c - cur_cost) / temp).exp();
            if accept {
                accepted += 1;
                cur_cost = c;
                if c < best_cost {
                    best_cost = c;
                    best = current.clone();
                }
            } else {
                current.insert(id, old);
            }
        }
        assert!(
            best_cost <= heuristic_cost,
            "place: the searched plan ({best_cost} s) is worse than the heuristic ({heuristic_cost} s)"
        );
        for &id in &free {
            let (Some(b), Some(h)) = (best.get(&id), heuristic.get(&id)) else {
                continue;
            };
            let text = if b == h {
                format!(
                    "heuristic kept: the fastest layout on all {n} devices that fits{}",
                    if estimate::fits(a, id, b) {
                        ""
                    } else {
                        " (none fits)"
                    }
                )
            } else {
                format!(
                    "search moved it from {} to {} (iteration {:.3} s → {:.3} s)",
                    describe(h),
                    describe(b),
                    heuristic_cost,
                    best_cost
                )
            };
            why.insert(id, text);
        }
        a.decisions.placements = best;
        a.decisions.placement_why = why;
        a.decisions.search = Some(SearchRecord {
            heuristic_seconds: heuristic_cost,
            searched_seconds: best_cost,
            iterations,
            accepted,
            seed: a.seed,
        });
        Ok(())
    }
}

/// `devices 0..8 dp 2 tp 4 pp 1 mb 4`.
pub fn describe(p: &Placement) -> String {
    format!(
        "devices {}..{} dp {} tp {} pp {} mb {}",
        p.first,
        p.first + p.count,
        p.dp,
        p.tp,
        p.pp,
        p.microbatches
    )
}

/// Mesh sizes the search tries: powers of two dividing `n`, and `n`.
fn mesh_sizes(n: u64) -> Vec<u64> {
    let mut v = Vec::new();
    let mut s = 1;
    while s < n {
        if n.is_multiple_of(s) {
            v.push(s);
        }
        s *= 2;
    }
    v.push(n.max(1));
    v
}

/// The placement a `place` pin gives call `id`: its devices and degrees, with the fastest
/// micro-batch count that fits (or the first, if none does).
fn pinned(a: &Annotated, id: NodeId) -> Option<Placement> {
    let node = a.plan.graph.node(id)?;
    let name = node.op.model().map(|m| a.model_name(m)).unwrap_or_default();
    let pin = a
        .pins
        .place
        .iter()
        .rev()
        .find(|p| a.pins.selects(&p.target, &node.op, &name))?;
    let count = pin.to.saturating_sub(pin.from).max(1);
    let tp = pin.tp.unwrap_or(1).max(1);
    let pp = pin.pp.unwrap_or(1).max(1);
    let dp = pin.dp.unwrap_or(count / (tp * pp)).max(1);
    let count = dp * tp * pp;
    let want = |p: &Placement| (p.dp, p.tp, p.pp) == (dp, tp, pp);
    let options = estimate::layout_options(a, id, count);
    let mut candidates: Vec<Placement> = options.into_iter().filter(want).collect();
    if candidates.is_empty() {
        // A layout the option enumeration skips (e.g. pipeline stages for generation): keep it
        // as pinned, with one micro-batch.
        candidates.push(Placement {
            first: 0,
            count,
            dp,
            tp,
            pp,
            microbatches: 1,
        });
    }
    let best = candidates
        .iter()
        .filter(|p| estimate::fits(a, id, p))
        .min_by(|x, y| estimate::call_time(a, id, x).total_cmp(&estimate::call_time(a, id, y)))
        .or(candidates.first())
        .copied()?;
    Some(Placement {
        first: pin.from,
        ..best
    })
}

/// Whether a pin target names call `id` (for tests).
pub fn pin_selects(a: &Annotated, target: &PinTarget, id: NodeId) -> bool {
    a.plan.graph.node(id).is_some_and(|n| {
        let name = n.op.model().map(|m| a.model_name(m)).unwrap_or_default();
        a.pins.selects(target, &n.op, &name)
    })
}
