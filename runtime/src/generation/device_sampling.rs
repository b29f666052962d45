//! Sampling on the device: the choice `sampling::sample_token` makes, as tensor operations on a
//! whole batch of logits, so that on a GPU only the chosen tokens and their log-probabilities
//! come back to the host — not `rows × vocabulary` logits at every decode step (for a 150 k
//! vocabulary and 128 rows, 77 MB per step in f32).
//!
//! The uniform number each row draws comes from that row's own generator on the host
//! (`Rng::uniform`, one per sample and step, as in `sample_token`), so a sample's text still
//! depends only on the seed, its prompt and its index, not on the batch. The arithmetic is the
//! host's: the temperature-scaled logits in f32, their log-sum-exp, probabilities in f64,
//! candidates in id order (sorted by probability, ties by id, under top-k or top-p), and the
//! first candidate whose cumulative probability exceeds `u · mass`. Two things differ in the
//! last bits: the log-sum-exp (libtorch's `exp` here, Braid's vectorised one on the host) and
//! the order in which a GPU adds the cumulative sums; a draw that lands within rounding of a
//! boundary between two tokens can pick the neighbour. Greedy choices are exact (the first
//! maximum, as on the host). Tests run this module on the CPU against `sample_token`.
//!
//! This module must not hold state or decide where it runs: the engine calls it for the rows of
//! a decode step when it samples on the device (`EngineOptions::sampling`).

use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use crate::generation::sampling::SamplingParams;

/// Chooses one token per row of `logits` (`[rows, vocab]`, any float kind, on any device);
/// `uniforms[r]` is row `r`'s draw in [0, 1) (ignored when greedy). Returns each row's token
/// and log-probability under `log_softmax(logits / T)` (T = 1 when greedy), as `sample_token`.
pub fn sample_rows(
    logits: &Tensor,
    params: &SamplingParams,
    uniforms: &[f64],
) -> Result<Vec<(i64, f32)>> {
    let (rows, vocab) = logits.size2().map_err(Error::Torch)?;
    if rows as usize != uniforms.len() && !params.greedy {
        return Err(Error::invalid(
            "sampling",
            format!("{rows} rows of logits but {} draws", uniforms.len()),
        ));
    }
    if rows == 0 {
        return Ok(Vec::new());
    }
    let device = logits.device();
    let (chosen, logp) = tch::no_grad(|| -> Result<(Tensor, Tensor)> {
        let x = logits.f_to_kind(Kind::Float)?;
        if params.greedy {
            let best = x.f_argmax(-1, true)?;
            let lse = x.f_logsumexp([-1], true)?;
            let lp = x.f_gather(1, &best, false)? - lse;
            return Ok((best.squeeze_dim(1), lp.squeeze_dim(1)));
        }
        let scaled = x / f64::from(params.temperature);
        let lse = scaled.f_logsumexp([-1], true)?;
        let logp = &scaled - lse;
        let u = Tensor::from_slice(uniforms)
            .f_to_device(device)?
            .unsqueeze(1);
        let truncated = (params.top_k > 0 && (params.top_k as i64) < vocab) || params.top_p < 1.0;
        let (probs, order) = if truncated {
            // Most likely first; a stable sort keeps the lower id first among ties.
            let (sorted, order) = logp.f_sort_stable(true, -1, true)?;
            let mut probs = sorted.f_to_kind(Kind::Double)?.exp();
            let positions = Tensor::arange(vocab, (Kind::Int64, device)).unsqueeze(0);
            if params.top_k > 0 && (params.top_k as i64) < vocab {
                let keep = positions.lt(params.top_k as i64).to_kind(Kind::Double);
                probs *= keep;
            }
            if params.top_p < 1.0 {
                // Keep a candidate while the mass before it is under top_p of the total: the
                // smallest set whose mass reaches top_p, as the host's walk.
                let mass = probs.f_sum_dim_intlist(-1, true, Kind::Double)?;
                let before = probs.f_cumsum(-1, Kind::Double)? - &probs;
                let keep = before
                    .f_lt_tensor(&(mass * f64::from(params.top_p)))?
                    .to_kind(Kind::Double);
                probs *= keep;
            }
            (probs, Some(order))
        } else {
            (logp.f_to_kind(Kind::Double)?.exp(), None)
        };
        let cdf = probs.f_cumsum(-1, Kind::Double)?;
        let mass = cdf.f_narrow(1, vocab - 1, 1)?;
        let target = u * mass;
        // The first position whose cumulative probability exceeds the target; a draw at the
        // very top (rounding) takes the last candidate, as the host does.
        let kept = probs.f_gt(0.0)?.f_sum_dim_intlist(-1, true, Kind::Int64)?;
        let last = (kept - 1).clamp_min(0);
        let at = target
            .f_searchsorted(&cdf, false, true, "right", None::<Tensor>)?
            .f_minimum(&last)?;
        let chosen = match order {
            Some(order) => order.f_gather(1, &at, false)?,
            None => at,
        };
        let lp = logp.f_gather(1, &chosen, false)?;
        Ok((chosen.squeeze_dim(1), lp.squeeze_dim(1)))
    })?;
    // One transfer back: the tokens and their log-probabilities side by side.
    let both = Tensor::stack(
        &[chosen.to_kind(Kind::Double), logp.to_kind(Kind::Double)],
        1,
    )
    .to_device(tch::Device::Cpu);
    let flat = Vec::<f64>::try_from(both.reshape([-1])).map_err(Error::Torch)?;
    Ok(flat.chunks(2).map(|p| (p[0] as i64, p[1] as f32)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generation::sampling::{Candidates, sample_token};
    use crate::rng::Rng;

    fn random_logits(rng: &mut Rng, rows: usize, vocab: usize) -> Vec<Vec<f32>> {
        (0..rows)
            .map(|_| (0..vocab).map(|_| (rng.normal() * 2.0) as f32).collect())
            .collect()
    }

    fn on_device(rows: &[Vec<f32>], params: &SamplingParams, u: &[f64]) -> Vec<(i64, f32)> {
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let t = Tensor::from_slice(&flat).reshape([rows.len() as i64, -1]);
        sample_rows(&t, params, u).unwrap()
    }

    /// Greedy: the host's first maximum (ties included) and its log-probability.
    #[test]
    fn greedy_rows_match_the_host() {
        crate::device::set_cpu_threads(1);
        let mut rng = Rng::new(1);
        let mut rows = random_logits(&mut rng, 20, 300);
        rows[3][7] = 50.0;
        rows[3][9] = 50.0; // a tie: the lower id wins on both
        let p = SamplingParams {
            greedy: true,
            ..SamplingParams::default()
        };
        let got = on_device(&rows, &p, &[]);
        for (row, (tok, lp)) in rows.iter().zip(&got) {
            let (want, want_lp) = sample_token(row, &p, &mut Rng::new(0));
            assert_eq!(*tok, want);
            assert!((lp - want_lp).abs() < 1e-5, "{lp} vs {want_lp}");
        }
        assert_eq!(got[3].0, 7);
    }

    /// Sampling with the same draws picks the host's token (all but draws within rounding of
    /// a boundary, which these are not) with its log-probability, with and without top-k and
    /// top-p; truncated choices stay among the host's candidates.
    #[test]
    fn sampled_rows_match_the_host_for_the_same_draws() {
        crate::device::set_cpu_threads(1);
        let mut rng = Rng::new(7);
        let cases = [
            SamplingParams::default(),
            SamplingParams {
                temperature: 0.7,
                ..SamplingParams::default()
            },
            SamplingParams {
                top_k: 5,
                ..SamplingParams::default()
            },
            SamplingParams {
                top_p: 0.8,
                temperature: 1.3,
                ..SamplingParams::default()
            },
            SamplingParams {
                top_k: 40,
                top_p: 0.5,
                ..SamplingParams::default()
            },
        ];
        for p in &cases {
            let rows = random_logits(&mut rng, 400, 97);
            // Each row's generator: its first draw is what `sample_token` will take from it.
            let gens: Vec<Rng> = (0..rows.len()).map(|i| Rng::new(1000 + i as u64)).collect();
            let u: Vec<f64> = gens.iter().map(|g| g.clone().uniform()).collect();
            let got = on_device(&rows, p, &u);
            let mut same = 0;
            for ((row, g), (tok, lp)) in rows.iter().zip(&gens).zip(&got) {
                let c = Candidates::new(row, p);
                assert!(
                    c.idx.contains(&(*tok as usize)),
                    "{p:?}: {tok} not a candidate"
                );
                let (want, want_lp) = sample_token(row, p, &mut g.clone());
                if *tok == want {
                    same += 1;
                    assert!((lp - want_lp).abs() < 1e-5, "{lp} vs {want_lp}");
                }
            }
            // Under top-k alone the host walks the k most likely tokens in the order its
            // selection left them, not sorted, so only the distribution is the same there
            // (next test).
            if p.top_k == 0 || p.top_p < 1.0 {
                assert_eq!(same, rows.len(), "{p:?}: {same} of {} agree", rows.len());
            }
        }
    }

    /// Top-k alone: the device's choices follow the host's distribution over the k most likely
    /// tokens (expected counts within five standard deviations).
    #[test]
    fn top_k_draws_follow_the_distribution() {
        crate::device::set_cpu_threads(1);
        let row: Vec<f32> = vec![2.0, 1.0, 0.5, 0.0, -1.0, 3.0];
        let p = SamplingParams {
            top_k: 3,
            ..SamplingParams::default()
        };
        let c = Candidates::new(&row, &p);
        let n = 6000;
        let mut rng = Rng::new(3);
        let rows = vec![row.clone(); n];
        let u: Vec<f64> = (0..n).map(|_| rng.uniform()).collect();
        let got = on_device(&rows, &p, &u);
        let mass = c.mass();
        for &i in &c.idx {
            let prob = c.prob(i) / mass;
            let seen = got.iter().filter(|(t, _)| *t as usize == i).count() as f64;
            let sd = (n as f64 * prob * (1.0 - prob)).sqrt();
            assert!(
                (seen - n as f64 * prob).abs() < 5.0 * sd,
                "token {i}: {seen}"
            );
        }
        assert!(got.iter().all(|(t, _)| c.idx.contains(&(*t as usize))));
    }
}
