//! Decode attention on the CPU: a few new queries per row (one in plain decoding, the last
//! token and its drafts in speculative verification) over that row's cached keys.
//!
//! For so few queries libtorch's CPU scaled-dot-product attention runs two small BLAS products
//! (matrix-vector for a single query) per (row, head). Once the KV cache outgrows the last-level cache (a
//! batch of 32 rows of the benchmark model at 108 positions holds 28 MB over 4 layers) those
//! calls read it at about a third of the bandwidth the machine streams memory at, and
//! attention became the largest part of a decode step. This kernel walks each (row, head)'s
//! keys and then its values once, front to back, in f32.
//!
//! It is used only where it computes exactly what `model::attend` would: f32 tensors on the
//! CPU, at most `MAX_QUERIES` queries per row, no sliding window, and the causal mask of a
//! cached step: the row's `i`-th new query, at position `len + i`, sees keys `0..=len + i`.
//! Everything else (prefill, windows, GPUs, other dtypes) goes to libtorch.

use tch::{Device, Kind, Tensor};

use crate::kernels::step::exp_f32;
use crate::kernels::team::{self, Out};

/// Most queries per row the kernel takes; longer blocks (prefill) are products libtorch's
/// attention does well.
pub const MAX_QUERIES: i64 = 17;

/// Attention of `T` new queries per row. `q`: `[B, H, T, D]`; `keys`, `values`: the cache
/// tensors `[B, Hkv, capacity, D]` (contiguous) with the new keys already written; `lens[b]`:
/// row `b`'s length before them, so its `i`-th query sees `lens[b] + i + 1` positions. Returns
/// `[B, T, H * D]`, the layout `attend` returns, or `None` when the inputs are not ones this
/// kernel handles.
pub fn decode_attention(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    lens: &[i64],
) -> Option<Tensor> {
    let cpu_f32 = |t: &Tensor| t.device() == Device::Cpu && t.kind() == Kind::Float;
    if !(cpu_f32(q) && cpu_f32(keys) && cpu_f32(values)) {
        return None;
    }
    let (b, h, t, d) = q.size4().ok()?;
    let (kb, hkv, cap, kd) = keys.size4().ok()?;
    if !(1..=MAX_QUERIES).contains(&t)
        || kb != b
        || kd != d
        || values.size() != keys.size()
        || hkv == 0
        || h % hkv != 0
        || lens.len() != b as usize
        || lens.iter().any(|&n| n < 0 || n + t > cap)
        || !keys.is_contiguous()
        || !values.is_contiguous()
    {
        return None;
    }
    let q = q.contiguous();
    let (b, h, t, hkv, cap, d) = (
        b as usize,
        h as usize,
        t as usize,
        hkv as usize,
        cap as usize,
        d as usize,
    );
    // SAFETY: the three tensors are contiguous f32 CPU tensors of the sizes checked above,
    // alive for the whole function, and only read.
    #[allow(unsafe_code)]
    let (qs, ks, vs) = unsafe {
        (
            std::slice::from_raw_parts(q.data_ptr() as *const f32, b * h * t * d),
            std::slice::from_raw_parts(keys.data_ptr() as *const f32, b * hkv * cap * d),
            std::slice::from_raw_parts(values.data_ptr() as *const f32, b * hkv * cap * d),
        )
    };
    let shape = Shape {
        b,
        h,
        t,
        hkv,
        cap,
        d,
        q_by_token: false,
    };
    let mut out = vec![0f32; b * t * h * d];
    attend_host(qs, ks, vs, lens, shape, &mut out);
    Some(Tensor::from_slice(&out).reshape([b as i64, t as i64, (h * d) as i64]))
}

/// The kernel on host slices: `qs` laid out `[B, H, T, D]`, or `[B, T, H, D]` when
/// `s.q_by_token` (the layout the query projection produces); `ks`, `vs`: `[B, Hkv, cap, D]`;
/// `out`: `[B, T, H, D]`.
pub(crate) fn attend_host(
    qs: &[f32],
    ks: &[f32],
    vs: &[f32],
    lens: &[i64],
    s: Shape,
    out: &mut [f32],
) {
    assert!(out.len() >= s.b * s.t * s.h * s.d && lens.len() >= s.b);
    assert!(qs.len() >= s.b * s.h * s.t * s.d && s.hkv > 0 && s.h.is_multiple_of(s.hkv));
    assert!(ks.len() >= s.b * s.hkv * s.cap * s.d);
    assert!(vs.len() >= s.b * s.hkv * s.cap * s.d);
    assert!(
        lens[..s.b]
            .iter()
            .all(|&l| l >= 0 && l as usize + s.t <= s.cap)
    );
    let o = Out::new(out);
    // Rows are independent: the calling thread and the kernel team (`team.rs`) take them one
    // at a time, each writing only its own row's outputs.
    let threads = (tch::get_num_threads().max(1) as usize).min(s.b);
    team::for_each_chunk(threads, s.b, &|row| {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above); the asserts above
            // keep every (row, head, query, key) index of the kernel inside the slices.
            #[allow(unsafe_code)]
            let done = unsafe {
                match s.d {
                    16 => fma::attend_row::<2>(qs, ks, vs, lens, s, row, o),
                    32 => fma::attend_row::<4>(qs, ks, vs, lens, s, row, o),
                    64 => fma::attend_row::<8>(qs, ks, vs, lens, s, row, o),
                    128 => fma::attend_row::<16>(qs, ks, vs, lens, s, row, o),
                    _ => false,
                }
            };
            if done {
                return;
            }
        }
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            #[allow(unsafe_code)]
            unsafe {
                attend_avx2(qs, ks, vs, lens, s, row, o)
            };
            return;
        }
        attend_row(qs, ks, vs, lens, s, row, o);
    });
}

/// Sizes of a `decode_attention` call: rows, query heads, new tokens per row, key/value heads,
/// cache capacity, head size, and the query layout (see `attend_host`).
#[derive(Clone, Copy)]
pub(crate) struct Shape {
    pub b: usize,
    pub h: usize,
    pub t: usize,
    pub hkv: usize,
    pub cap: usize,
    pub d: usize,
    pub q_by_token: bool,
}

/// `attend_row` compiled for AVX2: eight floats per vector instruction instead of four.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn attend_avx2(qs: &[f32], ks: &[f32], vs: &[f32], lens: &[i64], s: Shape, row: usize, out: Out) {
    attend_row(qs, ks, vs, lens, s, row, out);
}

/// The kernel for one row: for every (head, query), scores against the keys the query sees,
/// softmax, and the weighted sum of their values. A row's keys and values are a few tens of
/// KB, so the queries after the first read them from cache.
#[inline(always)]
fn attend_row(qs: &[f32], ks: &[f32], vs: &[f32], lens: &[i64], s: Shape, row: usize, out: Out) {
    let Shape {
        h,
        t,
        hkv,
        cap,
        d,
        q_by_token,
        ..
    } = s;
    let rep = h / hkv;
    let scale = 1.0 / (d as f32).sqrt();
    let mut scores = vec![0f32; cap];
    let mut o = vec![0f32; d];
    for head in 0..h {
        let base = (row * hkv + head / rep) * cap * d;
        for i in 0..t {
            let n = lens[row] as usize + i + 1;
            let at = if q_by_token {
                ((row * t + i) * h + head) * d
            } else {
                ((row * h + head) * t + i) * d
            };
            let query = &qs[at..][..d];
            let mut max = f32::NEG_INFINITY;
            for (l, s) in scores[..n].iter_mut().enumerate() {
                *s = dot(query, &ks[base + l * d..][..d]) * scale;
                max = max.max(*s);
            }
            let mut sum = 0f32;
            for s in &mut scores[..n] {
                *s = exp_f32(*s - max);
                sum += *s;
            }
            o.fill(0.0);
            for (l, &p) in scores[..n].iter().enumerate() {
                let v = &vs[base + l * d..][..d];
                for (o, &v) in o.iter_mut().zip(v) {
                    *o += p * v;
                }
            }
            let inv = 1.0 / sum;
            let at = ((row * t + i) * h + head) * d;
            for (j, &o) in o.iter().enumerate() {
                out.set(at + j, o * inv);
            }
        }
    }
}

/// The kernel for head sizes of 16, 32, 64 and 128 with AVX2 and FMA intrinsics: the query
/// (pre-scaled) and the output accumulator live in `D8` vector registers each; scores are
/// computed four keys at a time (four independent accumulator chains, summed with one
/// horizontal-add tree), and each value row is folded into the accumulators with fused
/// multiply-adds.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod fma {
    use std::arch::x86_64::*;

    use super::Shape;
    use crate::kernels::step::exp_f32;
    use crate::kernels::team::Out;

    /// One row (see `attend_row`); returns `true` (the head size is `8 * D8`).
    ///
    /// # Safety
    /// The CPU supports AVX2 and FMA, `s.d == 8 * D8`, and the slices and lengths satisfy the
    /// asserts of `attend_host`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn attend_row<const D8: usize>(
        qs: &[f32],
        ks: &[f32],
        vs: &[f32],
        lens: &[i64],
        s: Shape,
        row: usize,
        out: Out,
    ) -> bool {
        let (h, t, hkv, cap, d) = (s.h, s.t, s.hkv, s.cap, s.d);
        debug_assert_eq!(d, 8 * D8);
        let rep = h / hkv;
        let scale = _mm256_set1_ps(1.0 / (d as f32).sqrt());
        let mut scores = vec![0f32; cap + 4];
        for head in 0..h {
            let base = (row * hkv + head / rep) * cap * d;
            let kp = ks[base..].as_ptr();
            let vp = vs[base..].as_ptr();
            // Keys and values are fetched a phase ahead of their use (a row's keys and values
            // are a few KB per head, too short a stream for the hardware prefetcher to get
            // ahead): the score loop prefetches the values of the same keys, and the value
            // loop the next key/value head's keys. A prefetch is only a hint and reads nothing.
            let next_keys = if head + 1 < h && (head + 1) / rep != head / rep {
                ks[base + cap * d..].as_ptr()
            } else if head + 1 == h && row + 1 < s.b {
                ks[((row + 1) * hkv) * cap * d..].as_ptr()
            } else {
                std::ptr::null()
            };
            for i in 0..t {
                let n = lens[row] as usize + i + 1;
                let at = if s.q_by_token {
                    ((row * t + i) * h + head) * d
                } else {
                    ((row * h + head) * t + i) * d
                };
                let qp = qs[at..at + d].as_ptr();
                // SAFETY (this block): `n <= cap` keys and values of `d` floats from `base` lie
                // inside `ks` and `vs`, and `scores` holds `cap + 4` entries.
                unsafe {
                    let mut q = [_mm256_setzero_ps(); D8];
                    for (c, q) in q.iter_mut().enumerate() {
                        *q = _mm256_mul_ps(_mm256_loadu_ps(qp.add(8 * c)), scale);
                    }
                    let mut l = 0;
                    while l + 4 <= n {
                        for line in (0..4 * d).step_by(16) {
                            _mm_prefetch::<_MM_HINT_T0>(vp.wrapping_add(l * d + line) as *const i8);
                        }
                        let mut acc = [_mm256_setzero_ps(); 4];
                        for (c, &qc) in q.iter().enumerate() {
                            for (j, a) in acc.iter_mut().enumerate() {
                                let k = _mm256_loadu_ps(kp.add((l + j) * d + 8 * c));
                                *a = _mm256_fmadd_ps(qc, k, *a);
                            }
                        }
                        let s01 = _mm256_hadd_ps(acc[0], acc[1]);
                        let s23 = _mm256_hadd_ps(acc[2], acc[3]);
                        let s4 = _mm256_hadd_ps(s01, s23);
                        let sum =
                            _mm_add_ps(_mm256_castps256_ps128(s4), _mm256_extractf128_ps::<1>(s4));
                        _mm_storeu_ps(scores.as_mut_ptr().add(l), sum);
                        l += 4;
                    }
                    while l < n {
                        let mut a = _mm256_setzero_ps();
                        for (c, &qc) in q.iter().enumerate() {
                            a = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kp.add(l * d + 8 * c)), a);
                        }
                        let h2 =
                            _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
                        let h2 = _mm_add_ps(h2, _mm_movehl_ps(h2, h2));
                        let h1 = _mm_add_ss(h2, _mm_shuffle_ps::<0b01>(h2, h2));
                        scores[l] = _mm_cvtss_f32(h1);
                        l += 1;
                    }
                }
                let max = scores[..n]
                    .iter()
                    .copied()
                    .fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for x in &mut scores[..n] {
                    *x = exp_f32(*x - max);
                    sum += *x;
                }
                let mut o = [_mm256_setzero_ps(); D8];
                // SAFETY: as above.
                unsafe {
                    for (l, &p) in scores[..n].iter().enumerate() {
                        if !next_keys.is_null() && i + 1 == t {
                            for line in (0..d).step_by(16) {
                                _mm_prefetch::<_MM_HINT_T0>(
                                    next_keys.wrapping_add(l * d + line) as *const i8
                                );
                            }
                        }
                        let p = _mm256_set1_ps(p);
                        for (c, o) in o.iter_mut().enumerate() {
                            *o = _mm256_fmadd_ps(p, _mm256_loadu_ps(vp.add(l * d + 8 * c)), *o);
                        }
                    }
                }
                let inv = _mm256_set1_ps(1.0 / sum);
                let mut lanes = [0f32; 8];
                let dst = ((row * t + i) * h + head) * d;
                for (c, &o) in o.iter().enumerate() {
                    // SAFETY: `lanes` holds eight floats.
                    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_mul_ps(o, inv)) };
                    for (j, &v) in lanes.iter().enumerate() {
                        out.set(dst + 8 * c + j, v);
                    }
                }
            }
        }
        true
    }
}

/// Dot product with eight independent accumulators, which the compiler turns into vector
/// instructions.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut sum = acc.iter().sum::<f32>();
    for (x, y) in ar.iter().zip(br) {
        sum += x * y;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel against libtorch's attention with the cached-step mask, for grouped and
    /// plain heads, one and several queries per row, and rows of different lengths.
    #[test]
    fn agrees_with_libtorch_attention() {
        tch::manual_seed(3);
        // Head sizes 16 and 64 take the FMA kernel, 24 the portable one.
        for (h, hkv, t, d) in [
            (4, 4, 1, 16),
            (4, 2, 1, 16),
            (6, 1, 1, 64),
            (4, 4, 3, 24),
            (4, 2, 5, 64),
            (2, 2, 2, 24),
        ] {
            let (b, cap) = (5i64, 24i64);
            let o = (Kind::Float, Device::Cpu);
            let q = Tensor::randn([b, h, t, d], o);
            let k = Tensor::randn([b, hkv, cap, d], o);
            let v = Tensor::randn([b, hkv, cap, d], o);
            let lens = [0i64, 6, cap - t, 12, 1];
            let got = decode_attention(&q, &k, &v, &lens).expect("handled");
            let used = lens.iter().map(|l| l + t).max().unwrap_or(1);
            // [B, 1, T, used]: key position <= the query's position `len + i`.
            let k_pos = Tensor::arange(used, (Kind::Int64, Device::Cpu)).view([1, 1, used]);
            let q_pos = (Tensor::from_slice(&lens).view([b, 1, 1])
                + Tensor::arange(t, (Kind::Int64, Device::Cpu)).view([1, t, 1]))
            .expand([b, t, 1], false);
            let mask = k_pos.le_tensor(&q_pos).unsqueeze(1);
            let rep = h / hkv;
            let kr = k
                .narrow(2, 0, used)
                .repeat_interleave_self_int(rep, 1, None);
            let vr = v
                .narrow(2, 0, used)
                .repeat_interleave_self_int(rep, 1, None);
            let want = Tensor::scaled_dot_product_attention(
                &q,
                &kr,
                &vr,
                Some(&mask),
                0.0,
                false,
                None::<f64>,
                false,
            )
            .transpose(1, 2)
            .reshape([b, t, h * d]);
            let diff = (&got - &want).abs().max().double_value(&[]);
            assert!(
                diff < 1e-5,
                "heads {h}/{hkv}, {t} queries, head size {d}: max difference {diff}"
            );
        }
    }

    #[test]
    fn declines_what_it_does_not_handle() {
        let o = (Kind::Float, Device::Cpu);
        let k = Tensor::zeros([2, 2, 32, 4], o);
        let q = Tensor::zeros([2, 2, 1, 4], o);
        assert!(decode_attention(&q, &k, &k, &[0, 31]).is_some());
        // A prefill-sized block goes to libtorch.
        let long = Tensor::zeros([2, 2, MAX_QUERIES + 1, 4], o);
        assert!(decode_attention(&long, &k, &k, &[0, 0]).is_none());
        // f64, and a row whose queries would read past the cache.
        assert!(decode_attention(&q.to_kind(Kind::Double), &k, &k, &[0, 0]).is_none());
        assert!(decode_attention(&q, &k, &k, &[0, 32]).is_none());
        let three = Tensor::zeros([2, 2, 3, 4], o);
        assert!(decode_attention(&three, &k, &k, &[0, 30]).is_none());
        assert!(decode_attention(&three, &k, &k, &[0, 29]).is_some());
    }
}
