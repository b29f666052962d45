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

use crate::annotated::{Annotated, Cut, FusePin, MigrationDecision, Placement, StreamDecision};
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
        // On-policy log-probabilities come from the training forward pass, streamed or not.
        let reused = reusable_logprobs(&a.plan);
        a.decisions.reused_logprobs = reused.clone();
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
            let (mut cut, mut why) = match node.gran {
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
            // A `fuse GEN -> SEL…` pin: of this generation's model calls, only those listed
            // stream; the others wait for the batch.
            if node.op.is_model_call()
                && let Some(pin) = fuse_pin(a, gen_id)
            {
                let listed = pin.to.iter().any(|t| a.selected(t, id));
                match (listed, cut) {
                    (true, Cut::Sample) => why.push_str(" (listed in the `fuse` pin)"),
                    (true, _) => why.push_str(
                        " (listed in the `fuse` pin, but its granularity does not allow streaming)",
                    ),
                    (false, Cut::Sample) => {
                        cut = Cut::Batch;
                        why = format!(
                            "not listed in the `fuse {}` pin: waits for the whole batch",
                            a.call_name(gen_id)
                        );
                    }
                    (false, _) => {}
                }
            }
            let mut chunk = 0;
            if let Some(train) = reused.get(&id) {
                cut = Cut::Batch;
                why = format!(
                    "taken from the forward pass of {} (one optimizer step: the log-probabilities \
                     before the update), so it runs no inference of its own",
                    a.call_name(*train)
                );
            } else if cut == Cut::Sample && node.op.is_model_call() {
                // Set by `set_chunks` once the placements it streams on are known.
                chunk = 1;
            }
            streams.push((
                id,
                StreamDecision {
                    generate: gen_id,
                    cut,
                    chunk,
                    why,
                },
            ));
        }
        for (id, s) in streams {
            a.decisions.streams.insert(id, s);
        }
        let placements = estimate::placements(a);
        // A call through pipeline stages runs once its whole batch is there: the runtime
        // streams only calls whose replicas are single stages.
        for (id, s) in a.decisions.streams.iter_mut() {
            if let Some(p) = placements.get(id)
                && p.pp > 1
                && s.cut == Cut::Sample
            {
                s.cut = Cut::Batch;
                s.chunk = 0;
                s.why = format!(
                    "runs through {} pipeline stages, which do not stream: waits for the whole batch",
                    p.pp
                );
            }
        }
        // Every simulation below runs on the plan as the later passes will leave it (fused
        // training, reshards and offloads), which the streaming decisions do not change.
        let base = crate::passes::completed(a, a.will_run("microbatch-interleave"))?;
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
            let samples = size.samples;
            let candidates: Vec<u64> = match a.pins.migrate_below {
                Some(frac) => vec![((samples as f64 * frac).ceil() as u64).max(1)],
                None => threshold_candidates(samples),
            };
            // How many instances keep the tail: fewer free more devices for the streaming
            // consumers, more keep the tail's batch (and KV reads) per instance small. Chosen
            // with R_t by simulating each pair.
            let mut kept_options: Vec<u64> = [8u64, 4, 2]
                .iter()
                .map(|d| (gp.dp / d).max(1))
                .filter(|k| *k < gp.dp)
                .collect();
            kept_options.dedup();
            let opts = SimOptions {
                iterations: 2,
                seed: a.seed,
            };
            let mut best: Option<Candidate> = None;
            let mut others: Vec<String> = Vec::new();
            let mut tried: Vec<Probe> = Vec::new();
            for (to_instances, fold) in kept_options.iter().flat_map(|&k| [(k, false), (k, true)]) {
                // Streaming consumers that shared the generation's devices move onto the
                // devices that migration frees.
                let kept = to_instances * gp.tp * gp.pp;
                let freed = Placement {
                    first: gp.first + kept,
                    count: gp.count - kept,
                    ..*gp
                };
                // The moved consumers share the freed devices chunk by chunk, so their weights
                // (and the generating model's) must all stay resident there: with their own
                // tensor-parallel degrees if that fits, else at least the generation's.
                let usable = a.cost.device.usable_memory();
                let mut chosen: Option<Probe> = None;
                let mut need = 0;
                for min_tp in [1, gp.tp] {
                    let subs = moved_consumers(a, gen_id, gp, &placements, &freed, min_tp, fold);
                    need = resident_weights(a, gen_id, gp, &subs);
                    if need <= usable {
                        chosen = Some(subs);
                        break;
                    }
                }
                // Folding changes nothing when no moved consumer has pipeline stages.
                if let Some(subs) = &chosen {
                    if tried.contains(subs) {
                        continue;
                    }
                    tried.push(subs.clone());
                }
                let label = if fold {
                    format!("{to_instances} instance(s), pipelines folded into tp")
                } else {
                    format!("{to_instances} instance(s)")
                };
                let Some(subs) = chosen else {
                    others.push(format!(
                        "{label}: the consumers' weights need {:.1} GB per freed device, {:.1} \
                         GB usable",
                        need as f64 / 1e9,
                        usable as f64 / 1e9
                    ));
                    continue;
                };
                // The receivers must hold the tail's KV caches: at most as many sequences per
                // instance as fit next to the weights at the full length.
                let capacity = estimate::call_memory(a, gen_id, gp).map_or(u64::MAX, |m| {
                    let per = samples.div_ceil(gp.dp.max(1)).max(1);
                    let per_seq = (m.kv_cache / per).max(1);
                    usable.saturating_sub(m.weights) / per_seq
                });
                let fitting: Vec<u64> = candidates
                    .iter()
                    .copied()
                    .filter(|r| r.div_ceil(to_instances) <= capacity)
                    .collect();
                if fitting.is_empty() {
                    others.push(format!("{label}: no threshold's tail fits their KV caches"));
                    continue;
                }
                let mut probe = in_context(&base, a);
                probe
                    .decisions
                    .subtask_placements
                    .extend(subs.iter().copied());
                probe.decisions.migrations.insert(
                    gen_id,
                    MigrationDecision {
                        threshold: fitting[0],
                        to_instances,
                        candidates: Vec::new(),
                        why: String::new(),
                        pinned: false,
                    },
                );
                let (dag, tasks) = to_dag(&probe, true).map_err(PassError)?;
                let Some(&task) = tasks.get(&gen_id) else {
                    continue;
                };
                let (threshold, results) = pick_migration_threshold(&dag, task, &fitting, &opts)
                    .map_err(|e| PassError(e.0))?;
                let t = results
                    .iter()
                    .find(|r| r.0 == threshold)
                    .map_or(f64::INFINITY, |r| r.1);
                others.push(format!("{label}: {t:.2} s at {threshold}"));
                if best.as_ref().is_none_or(|b| t < b.0) {
                    best = Some((t, to_instances, threshold, results, subs));
                }
            }
            let Some((_, to_instances, threshold, results, subs)) = best else {
                continue;
            };
            a.decisions.subtask_placements.extend(subs);
            let why = if a.pins.migrate_below.is_some() {
                format!("pinned by `migrate below`: {threshold} of {samples} samples")
            } else {
                format!(
                    "fastest simulated iteration over {} thresholds ({} of {samples} samples), \
                     {} tail sizes and the consumers' layouts ({})",
                    results.len(),
                    threshold,
                    kept_options.len(),
                    others.join(", ")
                )
            };
            a.decisions.migrations.insert(
                gen_id,
                MigrationDecision {
                    threshold,
                    to_instances,
                    candidates: results,
                    why,
                    pinned: a.pins.migrate_below.is_some(),
                },
            );
            // Keep migration (and the moved subtasks) only if it beats streaming without it.
            let with = simulated(&in_context(&base, a), &opts)?;
            let mut without = a.clone();
            without.decisions.migrations.remove(&gen_id);
            without.decisions.subtask_placements.retain(|id, _| {
                a.decisions
                    .streams
                    .get(id)
                    .is_none_or(|s| s.generate != gen_id)
            });
            let plain = simulated(&in_context(&base, &without), &opts)?;
            if plain <= with && a.pins.migrate_below.is_some() {
                a.decisions.notes.push(format!(
                    "sample-split: migrating {}'s tail is pinned by `migrate below` although it \
                     simulates slower ({with:.3} s vs {plain:.3} s per iteration)",
                    a.call_name(gen_id)
                ));
            } else if plain <= with {
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
        let fused = simulated(&in_context(&base, a), &opts)?;
        let mut plain = in_context(&base, a);
        plain.decisions.streams.clear();
        plain.decisions.migrations.clear();
        plain.decisions.subtask_placements.clear();
        let unfused = simulated(&plain, &opts)?;
        let pinned = a.pins.migrate_below.is_some()
            || a.calls().into_iter().any(|g| fuse_pin(a, g).is_some());
        if unfused < fused && pinned {
            a.decisions.notes.push(format!(
                "sample-split: streaming is pinned (`fuse`, `migrate below`) although it simulates slower \
                 ({fused:.3} s vs {unfused:.3} s per iteration)"
            ));
        } else if unfused < fused {
            a.decisions.notes.push(format!(
                "sample-split: streaming would not pay ({fused:.3} s vs {unfused:.3} s simulated \
                 per iteration); nothing streams"
            ));
            a.decisions.streams.clear();
            a.decisions.migrations.clear();
            a.decisions.subtask_placements.clear();
        }
        set_chunks(a);
        Ok(())
    }
}

/// Records each streamed call's chunk, for the placement it streams on (the devices migration
/// frees, when it moved there).
fn set_chunks(a: &mut Annotated) {
    let placements = estimate::placements(a);
    let mut chunks = Vec::new();
    for (id, s) in &a.decisions.streams {
        if s.chunk == 0 {
            continue;
        }
        let p = a
            .decisions
            .subtask_placements
            .get(id)
            .or_else(|| placements.get(id));
        if let Some(p) = p {
            chunks.push((*id, stream_chunk(a, *id, p)));
        }
    }
    for (id, chunk) in chunks {
        if let Some(s) = a.decisions.streams.get_mut(&id) {
            s.chunk = chunk;
            s.why.push_str(&format!(", {chunk} per forward pass"));
        }
    }
}

/// The streaming consumers of `gen_id` that shared its devices, moved onto `freed` with a
/// tensor-parallel degree of at least `min_tp` (where the model's heads and the node allow).
/// A consumer on the generating model itself runs in the generation's layout: the freed
/// devices already hold its weights that way, so nothing is resharded before it (and it need
/// not wait for the generation's end). With `fold`, the others fold pipeline stages into
/// tensor parallelism inside a node (the same devices per replica and weights per device):
/// streamed samples arrive a few at a time, and every run through a pipeline pays its fill.
fn moved_consumers(
    a: &Annotated,
    gen_id: NodeId,
    gp: &Placement,
    placements: &std::collections::BTreeMap<NodeId, Placement>,
    freed: &Placement,
    min_tp: u64,
    fold: bool,
) -> Probe {
    let model_of = |id: NodeId| a.plan.graph.node(id).and_then(|n| n.op.model());
    let mut subs = Vec::new();
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
        if model_of(id).is_some() && model_of(id) == model_of(gen_id) {
            let q = Placement {
                tp: gp.tp,
                pp: gp.pp,
                ..*p
            };
            if let Some(sub) = subtask_placement(a, id, &q, freed) {
                subs.push((id, sub));
            }
            continue;
        }
        let heads = model_of(id)
            .and_then(|m| a.shape(m))
            .map_or(1, |sh| sh.heads);
        let per_node = a.cluster.per_node.max(1);
        let (mut tp, mut pp) = (p.tp, p.pp);
        while fold && pp.is_multiple_of(2) && tp * 2 <= per_node && heads.is_multiple_of(tp * 2) {
            tp *= 2;
            pp /= 2;
        }
        while tp < min_tp
            && (tp * 2) * pp <= freed.count
            && tp * 2 <= per_node
            && heads.is_multiple_of(tp * 2)
        {
            tp *= 2;
        }
        let q = Placement { tp, pp, ..*p };
        if let Some(sub) = subtask_placement(a, id, &q, freed) {
            subs.push((id, sub));
        }
    }
    subs
}

/// Weight bytes per freed device when the moved consumers and the generating model all stay
/// resident (a model's weights counted once, at its largest shard).
fn resident_weights(a: &Annotated, gen_id: NodeId, gp: &Placement, subs: &Probe) -> u64 {
    let mut resident: std::collections::BTreeMap<u32, u64> = Default::default();
    for (id, p) in subs.iter().chain(std::iter::once(&(gen_id, *gp))) {
        let (Some(m), Some(mem)) = (
            a.plan.graph.node(*id).and_then(|n| n.op.model()),
            estimate::call_memory(a, *id, p),
        ) else {
            continue;
        };
        let e = resident.entry(m).or_default();
        *e = (*e).max(mem.weights);
    }
    resident.values().sum()
}

/// Subtask placements of one migration candidate.
type Probe = Vec<(NodeId, Placement)>;

/// A migration candidate: simulated iteration, instances kept, threshold, every threshold's
/// time, the moved consumers.
type Candidate = (f64, u64, u64, Vec<(u64, f64)>, Probe);

/// The last `fuse` pin whose source selects generation `gen_id`.
fn fuse_pin(a: &Annotated, gen_id: NodeId) -> Option<&FusePin> {
    let is_gen = matches!(
        a.plan.graph.node(gen_id).map(|n| &n.op),
        Some(Op::Generate { .. })
    );
    if !is_gen {
        return None;
    }
    a.pins
        .fuse
        .iter()
        .rev()
        .find(|p| a.selected(&p.from, gen_id))
}

/// Finished samples a streamed inference call takes per forward pass on placement `p`: its
/// sequences per micro-batch, the same micro-batches it runs without streaming (placement
/// gives such calls at least [`estimate::STREAM_MICROBATCHES`] of them). The runtime runs each
/// micro-batch — consecutive samples of the rollout — as soon as all its samples have finished.
pub fn stream_chunk(a: &Annotated, id: NodeId, p: &Placement) -> u64 {
    let Some(size) = call_size(a, id) else {
        return 1;
    };
    let per = size.samples.div_ceil(p.dp.max(1));
    per.div_ceil(p.microbatches.max(1)).max(1)
}

/// `logprobs` calls that need no inference pass: on a trained model, every consumer a loss
/// (a `train`'s objective, sums included) whose every consumer is a `train` of that model on
/// the same rollout with one epoch and one mini-batch. That `train` takes a single optimizer step, so
/// its forward pass computes the model's log-probabilities before the update — exactly what
/// the node stands for (TRL does the same when the update is on-policy). The runtime takes the
/// values, detached, from that forward pass. Value: the `train`.
pub fn reusable_logprobs(
    plan: &braid_ir::graph::Plan,
) -> std::collections::BTreeMap<NodeId, NodeId> {
    let g = &plan.graph;
    let mut out = std::collections::BTreeMap::new();
    for id in g.node_ids() {
        let Some(Op::Logprobs { model }) = g.node(id).map(|n| &n.op) else {
            continue;
        };
        let trained = plan
            .models
            .get(*model as usize)
            .is_some_and(|m| m.optimizer.is_some());
        let rollout = g.inputs(id).first().copied();
        let consumers = g.consumers(id);
        let mut train_of = None;
        let mut trains_ok = |loss: NodeId| -> bool {
            let mut found = false;
            for c in g.consumers(loss) {
                match g.node(c).map(|x| &x.op) {
                    Some(Op::Train {
                        model: m,
                        epochs: 1,
                        minibatches: 1,
                    }) if m == model && g.inputs(c).first().copied() == rollout => {
                        found = true;
                        if train_of.is_none_or(|t| t == c) {
                            train_of = Some(c);
                        } else {
                            return false;
                        }
                    }
                    _ => return false,
                }
            }
            found
        };
        if trained
            && !consumers.is_empty()
            && consumers.iter().all(|c| {
                matches!(g.node(*c).map(|x| &x.op), Some(Op::Loss { .. })) && trains_ok(*c)
            })
            && let Some(t) = train_of
        {
            out.insert(id, t);
        }
    }
    out
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

/// The thresholds `R_t` tried for a generation of `samples` samples: 1/64 to 1/2 of them.
pub fn threshold_candidates(samples: u64) -> Vec<u64> {
    let mut v: Vec<u64> = [64u64, 32, 16, 8, 4, 2]
        .iter()
        .map(|d| (samples / d).max(1))
        .collect();
    v.dedup();
    v
}

/// Re-chooses generation `generate`'s long-tail migration from output lengths observed at run time
/// (`observed`, one per sample of the last iteration): the threshold from the candidates the
/// pass tries, and the instances kept from 1 to `max_kept` (the plan's, so that the devices
/// the plan freed for the streamed consumers stay free), by simulating plan `a` (a completed
/// plan, as `braid plan --emit` writes it) with the observed lengths in place of the declared
/// distribution. Returns `(threshold, kept)`, or `None` when streaming without migration
/// simulates at least as fast. Deterministic: every rank of a run gets the same answer.
pub fn retune_migration(
    a: &Annotated,
    generate: NodeId,
    observed: &[u64],
    max_kept: u64,
) -> Result<Option<(u64, u64)>, String> {
    let mut counts: std::collections::BTreeMap<u64, u64> = std::collections::BTreeMap::new();
    for &l in observed {
        *counts.entry(l.max(1)).or_default() += 1;
    }
    if counts.is_empty() {
        return Err("no lengths were observed".into());
    }
    let mut lens = Vec::new();
    let mut cumulative = Vec::new();
    let mut total = 0;
    for (l, c) in counts {
        total += c;
        lens.push(l);
        cumulative.push(total);
    }
    let mut base = a.clone();
    base.workload.lengths = braid_cost::sim::LengthDist::Empirical { lens, cumulative };
    let placements = estimate::placements(&base);
    let (Some(gp), Some(size)) = (placements.get(&generate), call_size(&base, generate)) else {
        return Err(format!("{generate} is not a placed generation"));
    };
    let opts = SimOptions {
        iterations: 2,
        seed: a.seed,
    };
    let candidates = threshold_candidates(size.samples);
    let usable = base.cost.device.usable_memory();
    let capacity = estimate::call_memory(&base, generate, gp).map_or(u64::MAX, |m| {
        let per = size.samples.div_ceil(gp.dp.max(1)).max(1);
        let per_seq = (m.kv_cache / per).max(1);
        usable.saturating_sub(m.weights) / per_seq
    });
    let mut best: Option<(f64, u64, u64)> = None;
    for kept in 1..=max_kept.min(gp.dp.saturating_sub(1)) {
        let fitting: Vec<u64> = candidates
            .iter()
            .copied()
            .filter(|r| r.div_ceil(kept) <= capacity)
            .collect();
        let Some(&first) = fitting.first() else {
            continue;
        };
        let mut probe = base.clone();
        probe.decisions.migrations.insert(
            generate,
            MigrationDecision {
                threshold: first,
                to_instances: kept,
                candidates: Vec::new(),
                why: String::new(),
                pinned: false,
            },
        );
        let (dag, tasks) = to_dag(&probe, true)?;
        let Some(&task) = tasks.get(&generate) else {
            continue;
        };
        let (threshold, results) =
            pick_migration_threshold(&dag, task, &fitting, &opts).map_err(|e| e.0)?;
        let t = results
            .iter()
            .find(|r| r.0 == threshold)
            .map_or(f64::INFINITY, |r| r.1);
        if best.is_none_or(|b| t < b.0) {
            best = Some((t, threshold, kept));
        }
    }
    let mut plain = base.clone();
    plain.decisions.migrations.remove(&generate);
    let without = simulated(&plain, &opts).map_err(|e| e.0)?;
    Ok(best
        .filter(|b| b.0 < without)
        .map(|(_, threshold, kept)| (threshold, kept)))
}

/// `base` (the plan completed by the later passes) with `a`'s streaming decisions.
fn in_context(base: &Annotated, a: &Annotated) -> Annotated {
    let mut probe = base.clone();
    probe.decisions.streams = a.decisions.streams.clone();
    probe.decisions.migrations = a.decisions.migrations.clone();
    probe.decisions.subtask_placements = a.decisions.subtask_placements.clone();
    probe
}

/// Mean simulated iteration time of the plan with its fusion decisions.
fn simulated(a: &Annotated, opts: &SimOptions) -> Result<f64, PassError> {
    let (dag, _) = to_dag(a, true).map_err(PassError)?;
    Ok(simulate(&dag, opts)
        .map_err(|e| PassError(e.0))?
        .mean_iteration_time)
}
