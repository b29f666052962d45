//! `speculate` (RLHFSpec): for each `generate`, whether to draft tokens and verify them in one
//! forward pass, with what (an n-gram lookup in the prompt and the text so far, or a declared
//! draft model) and with which draft-length policy.
//!
//! Drafting pays when decoding is memory-bound: a verification step over `k + 1` tokens per
//! sequence reads the weights and KV cache once, like a plain step, but yields
//! `(1 − α^(k+1)) / (1 − α)` tokens on average for acceptance rate `α`. At large batch decoding
//! is compute-bound and the extra tokens cost time. So the policy is a draft length per live
//! batch size: the best `k` in `0..=8` (or the pinned `max`) for each power-of-two batch,
//! priced with the cost model at the generation's placement — long at the small-batch tail,
//! zero at full batch. `speculate … off | ngram(N) [max K] | draft(M)` pins are respected.
//! The acceptance rates are assumptions ([`NGRAM_ACCEPTANCE`], [`DRAFT_ACCEPTANCE`]) until the
//! runtime profiles them.

use braid_ir::graph::{NodeId, Op, Speculation};

use crate::annotated::{Annotated, DraftKind, SpeculatePin, SpeculationDecision};
use crate::cost::{CostModel, Layout, ModelShape};
use crate::estimate::{self, call_size};
use crate::passes::{Pass, PassError};

/// Per-token acceptance of n-gram (prompt-lookup) drafts on RL rollouts.
pub const NGRAM_ACCEPTANCE: f64 = 0.45;
/// Per-token acceptance of a small draft model of the same family.
pub const DRAFT_ACCEPTANCE: f64 = 0.7;
/// The longest draft considered without a pin.
pub const MAX_DRAFT: u64 = 8;

pub struct Speculate;

impl Pass for Speculate {
    fn name(&self) -> &'static str {
        "speculate"
    }

    fn summary(&self) -> &'static str {
        "per generate: drafting off, n-gram or draft model, and draft length by live batch"
    }

    fn run(&self, a: &mut Annotated) -> Result<(), PassError> {
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
            let (Some(node), Some(p), Some(size)) = (
                a.plan.graph.node(gen_id),
                placements.get(&gen_id),
                call_size(a, gen_id),
            ) else {
                continue;
            };
            let Some(model) = node.op.model() else {
                continue;
            };
            let pinned_run = match &node.op {
                Op::Generate { params, .. } => params.speculate.clone(),
                _ => None,
            };
            let Some(shape) = a.shape(model).cloned() else {
                continue;
            };
            // The target's dtype; a draft model runs on the target's device in its dtype.
            let cost = a.cost_of(model);
            let name = a.model_name(model);
            let pin = a
                .pins
                .speculate
                .iter()
                .rev()
                .find(|(t, _)| {
                    t.as_ref()
                        .is_none_or(|t| a.pins.selects(t, &node.op, &name))
                })
                .map(|x| x.1.clone());
            let layout = Layout {
                dp: 1,
                tp: p.tp,
                pp: p.pp,
            };
            let batch = size.samples.div_ceil(p.dp.max(1)).max(1);
            let ctx = size.prompt_len + size.max_new / 2;
            let (mode, ngram, draft_model, alpha, max_k, draft_shape, pinned) = match &pin {
                Some(SpeculatePin::Off) => ("off", None, None, 0.0, 0, None, true),
                Some(SpeculatePin::Ngram { n, max }) => (
                    "ngram",
                    Some(*n),
                    None,
                    NGRAM_ACCEPTANCE,
                    max.unwrap_or(MAX_DRAFT),
                    None,
                    true,
                ),
                Some(SpeculatePin::Draft { model: d }) => {
                    let ds = a
                        .plan
                        .models
                        .iter()
                        .position(|m| &m.name == d)
                        .and_then(|i| a.shape(i as u32).cloned());
                    (
                        "draft",
                        None,
                        Some(d.clone()),
                        DRAFT_ACCEPTANCE,
                        MAX_DRAFT,
                        ds,
                        true,
                    )
                }
                None => (
                    "ngram",
                    Some(3),
                    None,
                    NGRAM_ACCEPTANCE,
                    MAX_DRAFT,
                    None,
                    false,
                ),
            };
            let per_token = |b: u64, k: u64| -> f64 {
                step_cost(&cost, &shape, layout, b, ctx, k, draft_shape.as_ref())
                    / expected(alpha, k)
            };
            let mut policy = Vec::new();
            let mut b = 1u64;
            loop {
                let mut best = (0u64, per_token(b, 0));
                for k in 1..=max_k {
                    let c = per_token(b, k);
                    if c < best.1 * 0.999 {
                        best = (k, c);
                    }
                }
                policy.push((b, best.0));
                if b >= batch {
                    break;
                }
                b = (b * 2).min(batch);
            }
            // Merge neighbouring buckets with the same length.
            let mut merged: Vec<(u64, u64)> = Vec::new();
            for (b, k) in policy {
                match merged.last_mut() {
                    Some(last) if last.1 == k => last.0 = b,
                    _ => merged.push((b, k)),
                }
            }
            let lens: Vec<u64> = size
                .lengths
                .iter()
                .step_by(p.dp.max(1) as usize)
                .copied()
                .collect();
            let k_for = |live: u64| {
                merged
                    .iter()
                    .find(|(b, _)| live <= *b)
                    .or(merged.last())
                    .map_or(0, |x| x.1)
            };
            let baseline = decode_time(&lens, |live| per_token(live, 0));
            let predicted = decode_time(&lens, |live| per_token(live, k_for(live)));
            let drafting = merged.iter().any(|x| x.1 > 0);
            let (mode, why) = if mode == "off" {
                ("off", "pinned `off`".to_string())
            } else if !drafting {
                (
                    "off",
                    format!(
                        "no draft length pays at any batch up to {batch} (decoding is compute-bound \
                         or α = {alpha} is too low)"
                    ),
                )
            } else {
                (
                    mode,
                    format!(
                        "{}; decode {:.3} s → {:.3} s per instance, assuming acceptance {alpha}",
                        if pinned { "pinned" } else { "cost model" },
                        baseline,
                        predicted
                    ),
                )
            };
            let policy = if mode == "off" {
                vec![(batch, 0)]
            } else {
                merged
            };
            // A pin runs as written (lowering put it on the node, the draft model resolved to
            // its directory); otherwise the engine drafts adaptively where drafting pays —
            // except under tensor parallelism, whose ranks must take the same steps: there the
            // n-gram drafter runs with the policy's longest draft, fixed (an adaptive length
            // would follow each rank's own timings).
            let longest = policy.iter().map(|x| x.1).max().unwrap_or(0);
            let run = match (pinned, &pinned_run) {
                (true, Some(r)) => r.clone(),
                _ if mode != "off" && p.tp > 1 && longest > 0 => Speculation::Ngram {
                    max_draft: longest.min(u64::from(u32::MAX)) as u32,
                },
                _ if mode != "off" => Speculation::Auto,
                _ => Speculation::Off,
            };
            let why = if matches!(run, Speculation::Ngram { .. }) && !pinned {
                format!(
                    "{why}; n-gram drafts of at most {longest} tokens, fixed under tensor parallelism (its ranks must agree on every step)"
                )
            } else {
                why
            };
            let mode = match mode {
                "ngram" => DraftKind::Ngram,
                "draft" => DraftKind::Draft,
                _ => DraftKind::Off,
            };
            a.decisions.speculation.insert(
                gen_id,
                SpeculationDecision {
                    mode,
                    ngram: if mode == DraftKind::Ngram {
                        ngram
                    } else {
                        None
                    },
                    draft_model: if mode == DraftKind::Draft {
                        draft_model
                    } else {
                        None
                    },
                    policy,
                    acceptance: if mode == DraftKind::Off { 0.0 } else { alpha },
                    predicted_seconds: if mode == DraftKind::Off {
                        baseline
                    } else {
                        predicted
                    },
                    baseline_seconds: baseline,
                    pinned,
                    run,
                    why,
                },
            );
        }
        Ok(())
    }
}

/// Tokens accepted per verification step with draft length `k`.
fn expected(alpha: f64, k: u64) -> f64 {
    if k == 0 || alpha <= 0.0 {
        return 1.0;
    }
    (1.0 - alpha.powi(k as i32 + 1)) / (1.0 - alpha)
}

/// One verification step of `k + 1` tokens for `b` sequences, plus drafting: a plain decode
/// step's memory traffic or the compute of all verified tokens, whichever is larger; n-gram
/// drafts cost nothing on the device, a draft model `k` of its own decode steps.
fn step_cost(
    cost: &CostModel,
    shape: &ModelShape,
    layout: Layout,
    b: u64,
    ctx: u64,
    k: u64,
    draft: Option<&ModelShape>,
) -> f64 {
    let plain = cost.decode_step_time(shape, layout, b, ctx);
    if k == 0 {
        return plain;
    }
    let compute = (b * (k + 1)) as f64 * shape.forward_flops_per_token(ctx)
        / (layout.tp * layout.pp) as f64
        / cost.device.effective_flops();
    let verify = plain.max(compute * layout.pp as f64);
    let drafting = match draft {
        Some(d) => k as f64 * cost.decode_step_time(d, layout, b, ctx),
        None => 0.0,
    };
    verify + drafting
}

/// Decode time of one instance with lengths `lens` when a token costs `per_token(live)`.
fn decode_time(lens: &[u64], per_token: impl Fn(u64) -> f64) -> f64 {
    let mut sorted = lens.to_vec();
    sorted.sort_unstable();
    let b = sorted.len() as u64;
    let mut prev = 0;
    let mut t = 0.0;
    for (k, &len) in sorted.iter().enumerate() {
        if len > prev {
            t += (len - prev) as f64 * per_token(b - k as u64);
            prev = len;
        }
    }
    t
}
