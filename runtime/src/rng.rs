//! Small deterministic random number generators. Sampling and tiny-model initialisation use
//! them instead of libtorch's global generator, because that generator is shared by every
//! thread of the process: with it, the same seed would give different text depending on what
//! else ran. This module must stay free of global state.

/// SplitMix64: a tiny, well-mixed generator; also used to derive independent seeds.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A seed derived from `seed` and `stream` (a step, a node): different streams give
/// independent seeds.
pub fn derive(seed: u64, stream: u64) -> u64 {
    mix(seed ^ stream.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

impl Rng {
    /// A generator seeded from `seed`.
    pub fn new(seed: u64) -> Self {
        Rng {
            state: mix(seed ^ 0x5851_f42d_4c95_7f2d),
        }
    }

    /// The generator of one sample: derived from (seed, prompt index, sample index) only, so a
    /// sample's tokens do not depend on which other samples share its batch.
    pub fn for_sample(seed: u64, prompt_index: usize, sample_index: usize) -> Self {
        let a = mix(seed.wrapping_add(0x9e37_79b9_7f4a_7c15));
        let b = mix(a ^ (prompt_index as u64).wrapping_mul(0xd6e8_feb8_6659_fd93));
        let c = mix(b ^ (sample_index as u64).wrapping_mul(0xa076_1d64_78bd_642f));
        Rng { state: c }
    }

    /// The generator's state: [`Rng::from_state`] continues the same stream (a sample that
    /// migrates to another engine carries its generator this way).
    pub fn state(&self) -> u64 {
        self.state
    }

    /// The generator whose state is `state`.
    pub fn from_state(state: u64) -> Self {
        Rng { state }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.state)
    }

    /// A uniform number in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Shuffles `v` in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }

    /// A standard normal number (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_streams_are_distinct_and_reproducible() {
        let a: Vec<u64> = (0..4)
            .map(|_| 0)
            .scan(Rng::for_sample(7, 0, 0), |r, _: u64| Some(r.next_u64()))
            .collect();
        let b: Vec<u64> = (0..4)
            .map(|_| 0)
            .scan(Rng::for_sample(7, 0, 0), |r, _: u64| Some(r.next_u64()))
            .collect();
        let c: Vec<u64> = (0..4)
            .map(|_| 0)
            .scan(Rng::for_sample(7, 0, 1), |r, _: u64| Some(r.next_u64()))
            .collect();
        let d: Vec<u64> = (0..4)
            .map(|_| 0)
            .scan(Rng::for_sample(7, 1, 0), |r, _: u64| Some(r.next_u64()))
            .collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(a, d);
        assert_ne!(c, d);
    }

    #[test]
    fn uniform_is_in_unit_interval_and_normal_is_centred() {
        let mut r = Rng::new(1);
        let mut sum = 0.0;
        for _ in 0..10_000 {
            let u = r.uniform();
            assert!((0.0..1.0).contains(&u));
            sum += r.normal();
        }
        assert!((sum / 10_000.0).abs() < 0.05);
    }
}
