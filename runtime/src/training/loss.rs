//! The RL losses as libtorch operations with autograd, over the completion tokens of a
//! micro-batch laid out flat: token `j` belongs to sample `sample_of[j]`.
//!
//! Every loss returns the micro-batch's share of the mini-batch loss (its sums divided by the
//! mini-batch's token or sample count), so that summing the micro-batches' gradients gives the
//! gradient of the whole mini-batch (gradient accumulation).

use tch::{Kind, Tensor};

/// How per-token losses become one number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Agg {
    /// Mean over all tokens of the mini-batch.
    Token,
    /// Mean over samples of each sample's token mean.
    Sequence,
    /// Sum over tokens divided by `max_new_tokens` × samples (Dr. GRPO's constant normaliser).
    Sum,
}

impl Agg {
    pub fn parse(s: &str) -> Option<Agg> {
        Some(match s {
            "token" => Agg::Token,
            "sequence" => Agg::Sequence,
            "sum" => Agg::Sum,
            _ => return None,
        })
    }
}

/// The layout of a micro-batch inside its mini-batch.
#[derive(Debug)]
pub struct Layout {
    /// For each token, the index of its sample within the micro-batch.
    pub sample_of: Tensor,
    /// For each token, 1 / (its sample's token count).
    pub inv_len: Tensor,
    /// Tokens in the whole mini-batch.
    pub minibatch_tokens: f64,
    /// Samples in the whole mini-batch.
    pub minibatch_samples: f64,
    pub max_new_tokens: f64,
}

impl Layout {
    /// Reduces per-token values `[T]` to the micro-batch's share of the mini-batch loss.
    pub fn aggregate(&self, per_token: &Tensor, agg: Agg) -> Tensor {
        match agg {
            Agg::Token => per_token.sum(Kind::Float) / self.minibatch_tokens.max(1.0),
            Agg::Sequence => {
                (per_token * &self.inv_len).sum(Kind::Float) / self.minibatch_samples.max(1.0)
            }
            Agg::Sum => {
                per_token.sum(Kind::Float)
                    / (self.max_new_tokens.max(1.0) * self.minibatch_samples.max(1.0))
            }
        }
    }
}

/// The per-token KL estimate between the policy (`logp`) and the reference (`ref_logp`).
pub fn kl(logp: &Tensor, ref_logp: &Tensor, estimator: &str) -> Tensor {
    match estimator {
        "k2" => (logp - ref_logp).square() * 0.5,
        "k3" => {
            let d = ref_logp - logp;
            d.exp() - &d - 1.0
        }
        _ => logp - ref_logp,
    }
}

/// Statistics of a policy loss, for the metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PolicyStats {
    /// Share of tokens whose ratio was clipped.
    pub clip_frac: f64,
    /// Mean of `old_logp - logp` (an estimate of KL(old ‖ new)).
    pub approx_kl: f64,
}

/// PPO's clipped surrogate per token: `max(-A·ρ, -A·clip(ρ, 1 ± clip))`, with the dual clip
/// `min(·, -A·dual_clip)` for negative advantages when `dual_clip > 1`.
pub fn ppo_per_token(
    logp: &Tensor,
    old_logp: &Tensor,
    adv: &Tensor,
    clip: f64,
    dual_clip: f64,
) -> (Tensor, PolicyStats) {
    let ratio = (logp - old_logp).exp();
    let pg1 = -(adv * &ratio);
    let pg2 = -(adv * ratio.clamp(1.0 - clip, 1.0 + clip));
    let mut loss = pg1.maximum(&pg2);
    if dual_clip > 1.0 {
        let bound = -(adv * dual_clip);
        let dual = loss.minimum(&bound);
        loss = dual.where_self(&adv.lt(0.0), &loss);
    }
    let stats = tch::no_grad(|| {
        let n = ratio.numel().max(1) as f64;
        PolicyStats {
            clip_frac: (&ratio - 1.0)
                .abs()
                .gt(clip)
                .to_kind(Kind::Float)
                .sum(Kind::Float)
                .double_value(&[])
                / n,
            approx_kl: (old_logp - logp).sum(Kind::Float).double_value(&[]) / n,
        }
    });
    (loss, stats)
}

/// PPO's clipped value loss per token: `max((v - R)², (old_v + clip(v - old_v, ±clip) - R)²)`.
pub fn value_per_token(v: &Tensor, old_v: &Tensor, returns: &Tensor, clip: f64) -> Tensor {
    let clipped = old_v + (v - old_v).clamp(-clip, clip);
    (v - returns)
        .square()
        .maximum(&(clipped - returns).square())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f64]) -> Tensor {
        Tensor::from_slice(v).to_kind(Kind::Float)
    }

    fn vals(x: &Tensor) -> Vec<f64> {
        Vec::<f64>::try_from(x.to_kind(Kind::Double).reshape([-1])).unwrap()
    }

    fn close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
        }
    }

    /// Hand-checked: ratios e^0 = 1, e^0.5 ≈ 1.6487, e^-0.5 ≈ 0.6065, with A = 1, 1, -1 and
    /// clip 0.2: token 0 → -1; token 1 → max(-1.6487, -1.2) = -1.2; token 2 → max(0.6065, 0.8)
    /// = 0.8.
    #[test]
    fn ppo_clipping_by_hand() {
        let logp = t(&[0.0, 0.5, -0.5]);
        let old = t(&[0.0, 0.0, 0.0]);
        let adv = t(&[1.0, 1.0, -1.0]);
        let (l, s) = ppo_per_token(&logp, &old, &adv, 0.2, 0.0);
        close(&vals(&l), &[-1.0, -1.2, 0.8]);
        assert!((s.clip_frac - 2.0 / 3.0).abs() < 1e-9);
        // Dual clip 3 with A = -1 and ratio e^2 ≈ 7.389: plain loss 7.389, bounded to 3.
        let (l, _) = ppo_per_token(&t(&[2.0]), &t(&[0.0]), &t(&[-1.0]), 0.2, 3.0);
        close(&vals(&l), &[3.0]);
    }

    #[test]
    fn value_clipping_by_hand() {
        // v moved from 0 to 1 with clip 0.2: clipped v = 0.2; R = 2 → max(1, 3.24) = 3.24.
        let l = value_per_token(&t(&[1.0]), &t(&[0.0]), &t(&[2.0]), 0.2);
        close(&vals(&l), &[3.24]);
        // Moving toward R within the clip: (0.1 - 0.1)² = 0 and clipped the same.
        let l = value_per_token(&t(&[0.1]), &t(&[0.0]), &t(&[0.1]), 0.2);
        close(&vals(&l), &[0.0]);
    }

    #[test]
    fn kl_estimators_by_hand() {
        let logp = t(&[-1.0]);
        let r = t(&[-2.0]);
        close(&vals(&kl(&logp, &r, "k1")), &[1.0]);
        close(&vals(&kl(&logp, &r, "k2")), &[0.5]);
        // k3: d = -1 → e^-1 + 1 - 1 = 0.36788
        close(&vals(&kl(&logp, &r, "k3")), &[(-1.0f64).exp()]);
    }

    #[test]
    fn aggregation_by_hand() {
        // Two samples: 1 token (loss 3) and 3 tokens (losses 1, 2, 3).
        let per = t(&[3.0, 1.0, 2.0, 3.0]);
        let layout = Layout {
            sample_of: Tensor::from_slice(&[0i64, 1, 1, 1]),
            inv_len: t(&[1.0, 1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0]),
            minibatch_tokens: 4.0,
            minibatch_samples: 2.0,
            max_new_tokens: 8.0,
        };
        close(&vals(&layout.aggregate(&per, Agg::Token)), &[9.0 / 4.0]);
        close(
            &vals(&layout.aggregate(&per, Agg::Sequence)),
            &[(3.0 + 2.0) / 2.0],
        );
        close(&vals(&layout.aggregate(&per, Agg::Sum)), &[9.0 / 16.0]);
    }
}
