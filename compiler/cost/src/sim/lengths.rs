//! Output-length distributions of generation: `fixed:N`, `uniform:A..B`,
//! `lognormal:MU,SIGMA[,MAX]` and empirical histograms (`len count` per line).
//!
//! Sampling draws from the caller's seeded [`Rng`], so a simulation is reproducible. This module
//! parses text it is given; it must not open files (the CLI reads a histogram file and passes
//! its text to [`LengthDist::from_histogram`]).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::prng::Rng;

/// A distribution of generated lengths, in tokens (always at least 1).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum LengthDist {
    Fixed {
        len: u64,
    },
    Uniform {
        lo: u64,
        hi: u64,
    },
    /// `exp(N(mu, sigma²))`, rounded, clipped to `1..=max` (the generation limit) — RLHF
    /// output lengths are long-tailed and this is the usual fit.
    LogNormal {
        mu: f64,
        sigma: f64,
        max: u64,
    },
    /// Lengths with their counts, sampled in proportion to the counts.
    Empirical {
        lens: Vec<u64>,
        /// Running totals of the counts, for inverse-CDF sampling.
        cumulative: Vec<u64>,
    },
}

/// A distribution spec that does not parse.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LengthError(pub String);

impl fmt::Display for LengthError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LengthError {}

/// Without a `max`, log-normal lengths stop here, like a generation limit would stop them.
pub const DEFAULT_MAX_LEN: u64 = 1 << 16;

impl LengthDist {
    /// Parses `fixed:N`, `uniform:A..B` or `lognormal:MU,SIGMA[,MAX]`. (Histograms come from
    /// files; see [`LengthDist::from_histogram`].)
    pub fn parse(spec: &str) -> Result<LengthDist, LengthError> {
        let err = |what: &str| {
            Err(LengthError(format!(
                "length distribution `{spec}`: {what}; expected `fixed:N`, `uniform:A..B`, \
                 `lognormal:MU,SIGMA[,MAX]` or a histogram file"
            )))
        };
        let Some((kind, args)) = spec.split_once(':') else {
            return err("no `:`");
        };
        let int = |s: &str| s.trim().parse::<u64>().ok().filter(|&n| n >= 1);
        match kind.trim() {
            "fixed" => match int(args) {
                Some(len) => Ok(LengthDist::Fixed { len }),
                None => err("the length must be a positive integer"),
            },
            "uniform" => {
                let Some((a, b)) = args.split_once("..") else {
                    return err("write the range as `A..B`");
                };
                match (int(a), int(b)) {
                    (Some(lo), Some(hi)) if lo <= hi => Ok(LengthDist::Uniform { lo, hi }),
                    (Some(_), Some(_)) => err("the range is empty"),
                    _ => err("the bounds must be positive integers"),
                }
            }
            "lognormal" => {
                let parts: Vec<&str> = args.split(',').collect();
                if parts.len() != 2 && parts.len() != 3 {
                    return err("give MU,SIGMA or MU,SIGMA,MAX");
                }
                let mu = parts[0]
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite());
                let sigma = parts[1]
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite());
                let (Some(mu), Some(sigma)) = (mu, sigma) else {
                    return err("MU and SIGMA must be numbers");
                };
                if sigma < 0.0 || mu > 20.0 {
                    return err("SIGMA must be non-negative and MU at most 20");
                }
                let max = match parts.get(2) {
                    None => DEFAULT_MAX_LEN,
                    Some(m) => match int(m) {
                        Some(m) => m,
                        None => return err("MAX must be a positive integer"),
                    },
                };
                Ok(LengthDist::LogNormal { mu, sigma, max })
            }
            _ => err(&format!("unknown kind `{}`", kind.trim())),
        }
    }

    /// Checks what parsing guarantees, for a distribution that came from elsewhere (a plan
    /// file): lengths ≥ 1, a non-empty range, finite parameters, a histogram with one running
    /// total per length, strictly increasing.
    pub fn validate(&self) -> Result<(), LengthError> {
        let bad = |what: &str| Err(LengthError(what.to_string()));
        match self {
            LengthDist::Fixed { len } if *len == 0 => bad("a fixed length must be at least 1"),
            LengthDist::Uniform { lo, hi } if *lo == 0 || lo > hi => {
                bad("a uniform range must be `lo..hi` with 1 <= lo <= hi")
            }
            LengthDist::LogNormal { mu, sigma, max }
                if !mu.is_finite()
                    || !sigma.is_finite()
                    || *sigma < 0.0
                    || *mu > 20.0
                    || *max == 0 =>
            {
                bad("a log-normal needs finite mu <= 20, sigma >= 0 and max >= 1")
            }
            LengthDist::Empirical { lens, cumulative } => {
                if lens.is_empty() || lens.len() != cumulative.len() {
                    return bad(
                        "a histogram needs one running total per length, and at least one length",
                    );
                }
                if lens.contains(&0) {
                    return bad("histogram lengths must be at least 1");
                }
                if cumulative.windows(2).any(|w| w[1] <= w[0]) || cumulative[0] == 0 {
                    return bad("histogram running totals must increase");
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Reads a histogram: one `len count` pair per line; blank lines and `#` comments are
    /// skipped. Errors name the line.
    pub fn from_histogram(text: &str) -> Result<LengthDist, LengthError> {
        let mut lens = Vec::new();
        let mut cumulative = Vec::new();
        let mut total = 0u64;
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            let parsed = match fields.as_slice() {
                [l, c] => l.parse::<u64>().ok().zip(c.parse::<u64>().ok()),
                _ => None,
            };
            let Some((len, count)) = parsed.filter(|&(l, _)| l >= 1) else {
                return Err(LengthError(format!(
                    "line {}: expected `LEN COUNT` with LEN ≥ 1, got `{line}`",
                    i + 1
                )));
            };
            if count == 0 {
                continue;
            }
            total = total
                .checked_add(count)
                .ok_or_else(|| LengthError(format!("line {}: counts overflow", i + 1)))?;
            lens.push(len);
            cumulative.push(total);
        }
        if total == 0 {
            return Err(LengthError(
                "the histogram has no lengths with a positive count".into(),
            ));
        }
        Ok(LengthDist::Empirical { lens, cumulative })
    }

    /// The mean length: exact for fixed, uniform and histogram lengths; for log-normal ones
    /// `exp(mu + sigma²/2)`, the unclipped mean, at most `max`.
    pub fn mean(&self) -> f64 {
        match self {
            LengthDist::Fixed { len } => *len as f64,
            LengthDist::Uniform { lo, hi } => (*lo + *hi) as f64 / 2.0,
            LengthDist::LogNormal { mu, sigma, max } => {
                (mu + sigma * sigma / 2.0).exp().clamp(1.0, *max as f64)
            }
            LengthDist::Empirical { lens, cumulative } => {
                let mut prev = 0u64;
                let mut sum = 0.0;
                for (l, c) in lens.iter().zip(cumulative) {
                    sum += *l as f64 * (c - prev) as f64;
                    prev = *c;
                }
                sum / prev.max(1) as f64
            }
        }
    }

    /// Draws one length.
    pub fn sample(&self, rng: &mut Rng) -> u64 {
        match self {
            LengthDist::Fixed { len } => *len,
            LengthDist::Uniform { lo, hi } => rng.range_inclusive(*lo, *hi),
            LengthDist::LogNormal { mu, sigma, max } => {
                let x = (mu + sigma * rng.normal()).exp().round();
                // NaN cannot occur (finite inputs); the clamp handles overflow to infinity.
                (x.clamp(1.0, *max as f64)) as u64
            }
            LengthDist::Empirical { lens, cumulative } => {
                let total = cumulative.last().copied().unwrap_or(1);
                let r = rng.range_inclusive(1, total);
                let i = cumulative.partition_point(|&c| c < r);
                lens.get(i).copied().unwrap_or(1)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn means_of_each_kind() {
        assert_eq!(LengthDist::parse("fixed:7").unwrap().mean(), 7.0);
        assert_eq!(LengthDist::parse("uniform:10..20").unwrap().mean(), 15.0);
        let h = LengthDist::from_histogram("# c\n10 1\n20 3\n").unwrap();
        assert_eq!(h.mean(), 17.5);
        let ln = LengthDist::parse("lognormal:2.0,0.5,1000").unwrap().mean();
        assert!((ln - (2.125f64).exp()).abs() < 1e-9, "{ln}");
    }

    #[test]
    fn parses_every_form() {
        assert_eq!(
            LengthDist::parse("fixed:128"),
            Ok(LengthDist::Fixed { len: 128 })
        );
        assert_eq!(
            LengthDist::parse("uniform:10..20"),
            Ok(LengthDist::Uniform { lo: 10, hi: 20 })
        );
        assert_eq!(
            LengthDist::parse("lognormal:5.5,0.8,2048"),
            Ok(LengthDist::LogNormal {
                mu: 5.5,
                sigma: 0.8,
                max: 2048
            })
        );
        assert!(matches!(
            LengthDist::parse("lognormal:5,1"),
            Ok(LengthDist::LogNormal {
                max: DEFAULT_MAX_LEN,
                ..
            })
        ));
    }

    #[test]
    fn bad_specs_say_why() {
        for (spec, needle) in [
            ("fixed", "no `:`"),
            ("fixed:0", "positive integer"),
            ("uniform:20..10", "empty"),
            ("uniform:5", "`A..B`"),
            ("lognormal:5", "MU,SIGMA"),
            ("lognormal:a,1", "numbers"),
            ("lognormal:5,-1", "non-negative"),
            ("zipf:1", "unknown kind `zipf`"),
        ] {
            let e = LengthDist::parse(spec).expect_err(spec);
            assert!(e.0.contains(needle), "{spec}: {e}");
        }
    }

    #[test]
    fn samples_stay_in_range_and_follow_the_shape() {
        let mut rng = Rng::new(5);
        let u = LengthDist::Uniform { lo: 3, hi: 5 };
        assert!((0..1000).all(|_| (3..=5).contains(&u.sample(&mut rng))));
        let ln = LengthDist::parse("lognormal:5,1,1000").expect("parses");
        let xs: Vec<u64> = (0..20_000).map(|_| ln.sample(&mut rng)).collect();
        assert!(xs.iter().all(|&x| (1..=1000).contains(&x)));
        let mut sorted = xs.clone();
        sorted.sort_unstable();
        // Median exp(5) ≈ 148; a long tail: the 99th percentile is far above it.
        let median = sorted[sorted.len() / 2] as f64;
        assert!((median / 148.4 - 1.0).abs() < 0.1, "{median}");
        assert!(sorted[sorted.len() * 99 / 100] > 5 * sorted[sorted.len() / 2]);
    }

    #[test]
    fn histograms_parse_and_sample_in_proportion() {
        let h = LengthDist::from_histogram("# len count\n10 3\n\n20 1\n30 0\n").expect("parses");
        let mut rng = Rng::new(9);
        let n = 40_000;
        let tens = (0..n).filter(|_| h.sample(&mut rng) == 10).count() as f64 / n as f64;
        assert!((tens - 0.75).abs() < 0.02, "{tens}");
        let e = LengthDist::from_histogram("10 3\n20 x\n").expect_err("bad line");
        assert!(e.0.contains("line 2"), "{e}");
        assert!(LengthDist::from_histogram("# nothing\n").is_err());
        assert!(LengthDist::from_histogram("0 5\n").is_err());
    }
}
