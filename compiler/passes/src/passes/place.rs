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
use crate::cost::MemoryNeeds;
use crate::estimate::{self, EstimateOptions};
use crate::passes::{Pass, PassError};
use crate::prng::Rng;
use crate::sim::{SimOptions, simulate};

pub struct Place;

/// Proposals per model call (the chain's length is this times the number of free calls).
const ITERATIONS_PER_CALL: u64 = 600;

/// How heavily the chain prices a plan whose devices cannot hold it at once: its time is
/// multiplied by `1 + OVERFLOW_PENALTY × (bytes over) / (usable bytes)`.
const OVERFLOW_PENALTY: f64 = 1e3;

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
        let mut priced = |a: &Annotated, pl: &BTreeMap<NodeId, Placement>, fused: bool| {
            let mut times = |id: NodeId, p: &Placement| {
                *time_cache
                    .entry((id, p.dp, p.tp, p.pp, p.microbatches))
                    .or_insert_with(|| estimate::call_time(a, id, p))
            };
            let o = EstimateOptions {
                fused_training: fused,
            };
            estimate::iteration_time(a, pl, &deps, &mut times, o)
        };
        // What every device holds at once (`estimate::memory_overflow`): the chain prices a
        // plan whose devices cannot hold it as if it took `1 + OVERFLOW_PENALTY × overflow /
        // usable memory` times as long, so it leaves such a plan for any that fits, and moves
        // towards plans that overflow less where all do.
        let mut memory_cache: BTreeMap<(NodeId, [u64; 5]), Option<MemoryNeeds>> = BTreeMap::new();
        let usable = a.cost.device.usable_memory().max(1) as f64;
        let mut overflow = |a: &Annotated, pl: &BTreeMap<NodeId, Placement>| {
            estimate::memory_overflow(a, pl, &mut |id, p| {
                memory_cache
                    .entry((id, [p.count, p.dp, p.tp, p.pp, p.microbatches]))
                    .or_insert_with(|| estimate::call_memory(a, id, p))
                    .clone()
            })
        };
        let heuristic = current.clone();
        let n = a.cluster.devices();
        let sizes = mesh_sizes(n);
        // With fused training priced, a second chain searches as if nothing fused (exactly
        // the chain of the same system without fusion, same seed): the simulator check below
        // then picks among both, so fusion never makes the kept plan worse than that system's.
        let pricings: Vec<bool> = if opts.fused_training {
            vec![true, false]
        } else {
            vec![false]
        };
        let mut chains: Vec<Chain> = Vec::new();
        let scale = priced(a, &heuristic, opts.fused_training);
        let heuristic_objective = {
            let mut objective = |a: &Annotated, pl: &BTreeMap<NodeId, Placement>, fused: bool| {
                let t = priced(a, pl, fused);
                t * (1.0 + OVERFLOW_PENALTY * overflow(a, pl) as f64 / usable)
            };
            for &fused in &pricings {
                chains.push(chain(a, &current, &free, &sizes, scale, &mut |a, pl| {
                    objective(a, pl, fused)
                }));
            }
            objective(a, &heuristic, opts.fused_training)
        };
        let iterations = chains.iter().map(|c| c.iterations).sum();
        let accepted = chains.iter().map(|c| c.accepted).sum();
        let mut best = chains[0].best.clone();
        assert!(
            chains[0].best_cost <= heuristic_objective,
            "place: the searched plan ({} s) is worse than the heuristic ({heuristic_objective} s)",
            chains[0].best_cost
        );
        let alternative = chains.get(1).map(|c| c.best.clone());
        let mut cost =
            |a: &Annotated, pl: &BTreeMap<NodeId, Placement>| priced(a, pl, opts.fused_training);
        let heuristic_cost = scale;
        let mut best_cost = cost(a, &best);
        // `interleave` pins: each pinned pair of trains gets the best joint placement the
        // fused schedule can use (one mesh, one tp, one pipeline dividing the other), the rest
        // of the plan as searched.
        let trains: Vec<NodeId> = calls
            .iter()
            .copied()
            .filter(|i| {
                matches!(
                    a.plan.graph.node(*i).map(|n| &n.op),
                    Some(braid_ir::graph::Op::Train { .. })
                )
            })
            .collect();
        let pinned_pairs: Vec<(NodeId, NodeId)> =
            crate::passes::microbatch_interleave::pinned_pairs(a, &trains)
                .into_iter()
                .filter_map(|(p, _)| p)
                .collect();
        let fusable = |pl: &BTreeMap<NodeId, Placement>| {
            pinned_pairs
                .iter()
                .all(|(x, y)| match (pl.get(x), pl.get(y)) {
                    (Some(px), Some(py)) => estimate::fused_train(a, *x, px, *y, py).is_some(),
                    _ => false,
                })
        };
        let mut pin_notes: Vec<String> = Vec::new();
        if !a.pins.fuse_off {
            for &(x, y) in &pinned_pairs {
                let (Some(bx), Some(by)) = (best.get(&x).copied(), best.get(&y).copied()) else {
                    continue;
                };
                if estimate::fused_train(a, x, &bx, y, &by).is_some() {
                    continue;
                }
                let mut found: Option<(f64, Placement, Placement)> = None;
                for &count in &sizes {
                    // A free call may take any layout that fits `count` devices; a pinned
                    // one keeps its placement if it has that many.
                    let options = |call, pinned: Placement| -> Vec<Placement> {
                        if free.contains(&call) {
                            estimate::fitting_options(a, call, count)
                                .into_iter()
                                .map(|o| o.1)
                                .collect()
                        } else if pinned.count == count {
                            vec![pinned]
                        } else {
                            Vec::new()
                        }
                    };
                    let (ox, oy) = (options(x, bx), options(y, by));
                    let starts: Vec<u64> = if !free.contains(&x) {
                        vec![bx.first]
                    } else if !free.contains(&y) {
                        vec![by.first]
                    } else {
                        (0..n / count).map(|k| k * count).collect()
                    };
                    for &first in &starts {
                        for px in &ox {
                            for py in &oy {
                                let px = Placement { first, ..*px };
                                let py = Placement { first, ..*py };
                                if estimate::fused_train(a, x, &px, y, &py).is_none() {
                                    continue;
                                }
                                let mut trial = best.clone();
                                trial.insert(x, px);
                                trial.insert(y, py);
                                let c = cost(a, &trial);
                                if found.as_ref().is_none_or(|f| c < f.0) {
                                    found = Some((c, px, py));
                                }
                            }
                        }
                    }
                }
                if let Some((c, px, py)) = found {
                    best.insert(x, px);
                    best.insert(y, py);
                    best_cost = c;
                    for id in [x, y] {
                        why.insert(
                            id,
                            format!(
                                "placed for the `interleave` pin: {} and {} share a pipelined \
                                 mesh (iteration {c:.3} s)",
                                a.call_name(x),
                                a.call_name(y)
                            ),
                        );
                    }
                } else {
                    pin_notes.push(format!(
                        "place: no mesh fits {} and {} with one tensor-parallel degree and one \
                         pipeline dividing the other, so the `interleave` pin cannot be honoured",
                        a.call_name(x),
                        a.call_name(y)
                    ));
                }
            }
        }
        // The list schedule is an estimate; the simulator has the last word. The searched,
        // heuristic and one-layout-per-model placements are simulated as the later passes will
        // leave them (trainings interleaved where they would be, reshards and offloads
        // inserted) and the fastest is kept, so the plan is never worse than either baseline in
        // the simulator either. Pinned calls keep their pins in every candidate.
        let mut candidates: Vec<(&str, BTreeMap<NodeId, Placement>)> =
            vec![("searched", best.clone())];
        // A candidate that breaks an `interleave` pin the searched plan keeps is not one, nor
        // one whose devices cannot hold it when the searched plan's can.
        let need_fusable = fusable(&best);
        let need_hold = overflow(a, &best) == 0;
        if let Some(alt) = alternative
            && alt != best
            && (!need_fusable || fusable(&alt))
            && (!need_hold || overflow(a, &alt) == 0)
        {
            candidates.push(("searched without fusion", alt));
        }
        if heuristic != best
            && (!need_fusable || fusable(&heuristic))
            && (!need_hold || overflow(a, &heuristic) == 0)
        {
            candidates.push(("heuristic", heuristic.clone()));
        }
        let mut per_model = estimate::per_model_placements(a);
        for (id, p) in &current {
            if !free.contains(id) {
                per_model.insert(*id, *p);
            }
        }
        if per_model != best
            && per_model != heuristic
            && (!need_fusable || fusable(&per_model))
            && per_model.iter().all(|(id, p)| estimate::fits(a, *id, p))
            && (!need_hold || overflow(a, &per_model) == 0)
        {
            candidates.push(("per-model", per_model));
        }
        let mut simulated = Vec::new();
        let mut kept = "searched".to_string();
        if candidates.len() > 1 {
            let mut fastest = f64::INFINITY;
            for (name, pl) in candidates {
                let t = simulate_placement(a, &pl, opts.fused_training)?;
                simulated.push((name.to_string(), t));
                if t < fastest {
                    fastest = t;
                    kept = name.to_string();
                    best = pl;
                }
            }
        }
        let best_cost = if kept == "searched" {
            best_cost
        } else {
            cost(a, &best)
        };
        for &id in &free {
            let (Some(b), Some(h)) = (best.get(&id), heuristic.get(&id)) else {
                continue;
            };
            if why.contains_key(&id) && kept == "searched" {
                continue;
            }
            let text = if kept == "per-model" {
                format!(
                    "one layout per model ({}) kept: it simulates faster than the searched plan",
                    describe(b)
                )
            } else if b == h {
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
        a.decisions.notes.extend(pin_notes);
        a.decisions.placements = best;
        a.decisions.placement_why = why;
        a.decisions.search = Some(SearchRecord {
            heuristic_seconds: heuristic_cost,
            searched_seconds: best_cost,
            iterations,
            accepted,
            seed: a.seed,
            simulated,
            kept,
        });
        Ok(())
    }
}

/// Mean simulated iteration of `placements` as the later passes leave them without streaming:
/// `microbatch-interleave` (when `interleave`) and `reshard-insert` run on a copy.
fn simulate_placement(
    a: &Annotated,
    placements: &BTreeMap<NodeId, Placement>,
    interleave: bool,
) -> Result<f64, PassError> {
    let mut with = a.clone();
    with.decisions.placements = placements.clone();
    let probe = crate::passes::completed(&with, interleave)?;
    let (dag, _) = crate::to_sim::to_dag(&probe, true).map_err(PassError)?;
    let opts = SimOptions {
        iterations: 2,
        seed: a.seed,
    };
    Ok(simulate(&dag, &opts)
        .map_err(|e| PassError(e.0))?
        .mean_iteration_time)
}

/// One Markov chain's result.
struct Chain {
    best: BTreeMap<NodeId, Placement>,
    best_cost: f64,
    iterations: u64,
    accepted: u64,
}

/// The Metropolis chain from `start` over the `free` calls: proposals on one call at a time (a
/// mesh size and aligned position, one of its faster fitting layouts), accepted at a
/// temperature cooling from 5 % to 0.01 % of `scale` (the start's time, without the memory
/// penalty a start that overflows pays, so that the chain settles as finely either way); the
/// best state is returned.
fn chain(
    a: &Annotated,
    start: &BTreeMap<NodeId, Placement>,
    free: &[NodeId],
    sizes: &[u64],
    scale: f64,
    cost: &mut dyn FnMut(&Annotated, &BTreeMap<NodeId, Placement>) -> f64,
) -> Chain {
    let n = a.cluster.devices();
    let mut current = start.clone();
    let start_cost = cost(a, &current);
    let mut options: BTreeMap<(NodeId, u64), Vec<Placement>> = BTreeMap::new();
    let mut rng = Rng::new(a.seed ^ 0x504C_4143);
    let mut best = current.clone();
    let mut best_cost = start_cost;
    let mut cur_cost = start_cost;
    let iterations = ITERATIONS_PER_CALL * free.len() as u64;
    let mut accepted = 0;
    let t0 = 0.05 * scale.max(1e-9);
    let t1 = 1e-4 * scale.max(1e-9);
    if free.is_empty() {
        return Chain {
            best,
            best_cost,
            iterations: 0,
            accepted: 0,
        };
    }
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
    Chain {
        best,
        best_cost,
        iterations,
        accepted,
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
