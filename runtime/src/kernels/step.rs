//! A cached step of a Llama-family body on the CPU in f32, on host memory: the prefill, decode
//! and verification steps of the generation engine.
//!
//! A decode step of a small model on the CPU is mostly fixed cost when it runs as libtorch
//! operations: about sixty per layer (norms, products, rotary embedding, cache writes,
//! attention, residuals), each a dispatch and a fresh allocation, for tensors of a few
//! thousand values. This module runs the whole layer stack on slices instead: Braid's product
//! kernel (`gemm.rs`), its attention kernel (`attention.rs`), and loops for the norms, the
//! rotary embedding, the gated activation and the residual additions, writing new keys and
//! values straight into the cache. It computes what `Model::forward_cached` computes with
//! libtorch, up to the order of floating-point additions; `model.rs` tests the two against
//! each other and chooses this path only where it applies (see `Model::forward_cached`). For
//! a prefill (tens of new tokens per row) the same loops apply: each query attends to the keys
//! before it, and the products have more rows.

use crate::kernels::attention::{Shape, attend_host};
use crate::kernels::gemm;

/// A linear layer's weight `[n, k]` and optional bias `[n]`, on the host.
pub(crate) struct Lin<'a> {
    pub w: &'a [f32],
    pub b: Option<&'a [f32]>,
}

/// One layer's weights on the host.
pub(crate) struct LayerView<'a> {
    pub q: Lin<'a>,
    pub k: Lin<'a>,
    pub v: Lin<'a>,
    pub o: Lin<'a>,
    pub gate: Lin<'a>,
    pub up: Lin<'a>,
    pub down: Lin<'a>,
    pub input_norm: &'a [f32],
    pub post_norm: &'a [f32],
}

/// Sizes of a step.
#[derive(Clone, Copy)]
pub(crate) struct Dims {
    /// Rows (sequences) and new tokens per row.
    pub rows: usize,
    pub t: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    /// Positions allocated per row in the cache.
    pub cap: usize,
    pub eps: f32,
}

/// Runs `layers` over the hidden states `x` (`[rows * t, hidden]`, updated in place). Row `r`'s
/// new tokens sit at positions `lens[r]..lens[r] + t`; `cos` and `sin` (`[rows * t, head_dim]`)
/// are the rotary tables of those positions, `sin` signed as `Model::rope` makes it. `caches`
/// holds each layer's keys and values `[rows, kv_heads, cap, head_dim]`; the new ones are
/// written at the rows' positions.
pub(crate) fn llama_layers(
    x: &mut [f32],
    layers: &[LayerView<'_>],
    caches: &mut [(&mut [f32], &mut [f32])],
    lens: &[i64],
    (cos, sin): (&[f32], &[f32]),
    s: Dims,
) {
    let m = s.rows * s.t;
    let (qd, kvd) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    // Intermediate buffers come from this thread's scratch, reused from step to step: fresh
    // allocations of this size go back to the kernel when freed, and every step would fault
    // its pages in again.
    SCRATCH.with_borrow_mut(|scratch| {
        let sizes = [
            m * s.hidden,
            m * qd,
            m * kvd,
            m * kvd,
            m * qd,
            m * s.hidden,
            m * s.intermediate,
            m * s.intermediate,
        ];
        let total: usize = sizes.iter().sum();
        if scratch.len() < total {
            scratch.resize(total, 0.0);
        }
        let (h, rest) = scratch.split_at_mut(sizes[0]);
        let (q, rest) = rest.split_at_mut(sizes[1]);
        let (k, rest) = rest.split_at_mut(sizes[2]);
        let (v, rest) = rest.split_at_mut(sizes[3]);
        let (a, rest) = rest.split_at_mut(sizes[4]);
        let (proj, rest) = rest.split_at_mut(sizes[5]);
        let (g, rest) = rest.split_at_mut(sizes[6]);
        let u = &mut rest[..sizes[7]];
        // Every element of these buffers is written before it is read, so stale contents
        // from an earlier step do not matter.
        run_layers(
            x,
            layers,
            caches,
            lens,
            (cos, sin),
            s,
            [h, q, k, v, a, proj, g, u],
        );
    });
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The layer loop of `llama_layers`, with its intermediate buffers: normalised hidden states,
/// queries, keys, values, attention outputs, projections, gate and up activations.
fn run_layers(
    x: &mut [f32],
    layers: &[LayerView<'_>],
    caches: &mut [(&mut [f32], &mut [f32])],
    lens: &[i64],
    (cos, sin): (&[f32], &[f32]),
    s: Dims,
    [h, q, k, v, a, proj, g, u]: [&mut [f32]; 8],
) {
    let m = s.rows * s.t;
    let (qd, kvd) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let linear = |l: &Lin<'_>, x: &[f32], n: usize, kk: usize, out: &mut [f32]| {
        gemm::product(x, l.w, l.b, m, n, kk, out);
    };
    for (layer, (kc, vc)) in layers.iter().zip(caches.iter_mut()) {
        rms_norm(x, layer.input_norm, s.eps, h);
        linear(&layer.q, h, qd, s.hidden, q);
        linear(&layer.k, h, kvd, s.hidden, k);
        linear(&layer.v, h, kvd, s.hidden, v);
        rope(q, s.heads, s.head_dim, cos, sin);
        rope(k, s.kv_heads, s.head_dim, cos, sin);
        // New keys and values into the cache: token i of row r at position lens[r] + i.
        for (r, &len) in lens.iter().enumerate().take(s.rows) {
            for i in 0..s.t {
                let pos = len as usize + i;
                for head in 0..s.kv_heads {
                    let src = ((r * s.t + i) * s.kv_heads + head) * s.head_dim;
                    let dst = ((r * s.kv_heads + head) * s.cap + pos) * s.head_dim;
                    kc[dst..dst + s.head_dim].copy_from_slice(&k[src..src + s.head_dim]);
                    vc[dst..dst + s.head_dim].copy_from_slice(&v[src..src + s.head_dim]);
                }
            }
        }
        let shape = Shape {
            b: s.rows,
            h: s.heads,
            t: s.t,
            hkv: s.kv_heads,
            cap: s.cap,
            d: s.head_dim,
            q_by_token: true,
        };
        attend_host(q, kc, vc, lens, shape, a);
        linear(&layer.o, a, s.hidden, qd, proj);
        add_into(x, proj);
        rms_norm(x, layer.post_norm, s.eps, h);
        linear(&layer.gate, h, s.intermediate, s.hidden, g);
        linear(&layer.up, h, s.intermediate, s.hidden, u);
        silu_mul(g, u);
        linear(&layer.down, g, s.hidden, s.intermediate, proj);
        add_into(x, proj);
    }
}

/// RMS normalisation of each row of `x` into `out`, scaled by `weight`, in f32 as libtorch's
/// `rms_norm` computes it for f32 inputs.
pub(crate) fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    for (row, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let mut acc = [0f32; 8];
        let (body, tail) = row.split_at(n / 8 * 8);
        for c in body.chunks_exact(8) {
            for (a, &v) in acc.iter_mut().zip(c) {
                *a += v * v;
            }
        }
        let sum = acc.iter().sum::<f32>() + tail.iter().map(|v| v * v).sum::<f32>();
        let inv = 1.0 / (sum / n as f32 + eps).sqrt();
        for ((o, &v), &w) in o.iter_mut().zip(row).zip(weight) {
            *o = v * inv * w;
        }
    }
}

/// The rotary embedding in place on `x` (`[tokens, heads, d]`): element `j` of a head becomes
/// `x[j] * cos[j] + x[(j + d/2) % d] * sin[j]`, with the token's `cos` and signed `sin` rows
/// (see `model::apply_rope`).
fn rope(x: &mut [f32], heads: usize, d: usize, cos: &[f32], sin: &[f32]) {
    let half = d / 2;
    let mut tmp = vec![0f32; d];
    for (tok, xs) in x.chunks_exact_mut(heads * d).enumerate() {
        let (c, sn) = (&cos[tok * d..][..d], &sin[tok * d..][..d]);
        for head in xs.chunks_exact_mut(d) {
            tmp.copy_from_slice(head);
            let (lo, hi) = head.split_at_mut(half);
            for j in 0..half {
                lo[j] = tmp[j] * c[j] + tmp[j + half] * sn[j];
                hi[j] = tmp[j + half] * c[j + half] + tmp[j] * sn[j + half];
            }
        }
    }
}

/// `g = silu(g) * u`, elementwise.
fn silu_mul(g: &mut [f32], u: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA, checked just above.
        #[allow(unsafe_code)]
        unsafe {
            silu_mul_avx2(g, u)
        };
        return;
    }
    silu_mul_portable(g, u);
}

/// `silu_mul` compiled for AVX2 and FMA, where `exp_f32` vectorises.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn silu_mul_avx2(g: &mut [f32], u: &[f32]) {
    silu_mul_portable(g, u);
}

#[inline(always)]
fn silu_mul_portable(g: &mut [f32], u: &[f32]) {
    for (g, &u) in g.iter_mut().zip(u) {
        *g = *g / (1.0 + exp_f32(-*g)) * u;
    }
}

/// `Σ e^(x - max)` over `xs`, with `exp_f32` in eight f32 lanes summed in f64 at the end
/// (the softmax denominator of a row of logits; libm's `exp` per element is most of a
/// sampling step's time otherwise).
pub(crate) fn sum_exp(xs: &[f32], max: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA, checked just above.
        #[allow(unsafe_code)]
        return unsafe { sum_exp_avx2(xs, max) };
    }
    sum_exp_portable(xs, max)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn sum_exp_avx2(xs: &[f32], max: f32) -> f64 {
    sum_exp_portable(xs, max)
}

#[inline(always)]
fn sum_exp_portable(xs: &[f32], max: f32) -> f64 {
    let mut lanes = [0f32; 8];
    let (body, tail) = xs.split_at(xs.len() / 8 * 8);
    for c in body.chunks_exact(8) {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l += exp_f32(x - max);
        }
    }
    let tail: f64 = tail.iter().map(|&x| f64::from(exp_f32(x - max))).sum();
    lanes.iter().map(|&l| f64::from(l)).sum::<f64>() + tail
}

/// `e^x` in f32 without a library call, so that loops over it vectorise: Cody-Waite range
/// reduction `x = n ln 2 + r` and Cephes' degree-6 polynomial for `e^r` on `|r| <= ln 2 / 2`
/// (within 2 ulp of the exact value; libm's `expf` calls take a quarter of a decode step's
/// activation time otherwise). Inputs are clamped to the finite range of f32 results.
#[inline(always)]
#[allow(clippy::excessive_precision)] // Cephes' constants as published
pub(crate) fn exp_f32(x: f32) -> f32 {
    let x = x.clamp(-87.3, 88.3);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let z = r * r;
    let p = ((((1.987_569_15e-4 * r + 1.398_199_95e-3) * r + 8.333_451_9e-3) * r + 4.166_579_6e-2)
        * r
        + 1.666_666_55e-1)
        * r
        + 5.000_000_12e-1;
    let e = p * z + r + 1.0;
    e * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// A contiguous f32 CPU tensor's elements, borrowed for as long as the tensor is.
pub(crate) fn host(t: &tch::Tensor) -> Option<&[f32]> {
    if t.device() != tch::Device::Cpu || t.kind() != tch::Kind::Float || !t.is_contiguous() {
        return None;
    }
    let n = t.numel();
    if n == 0 {
        return Some(&[]);
    }
    // SAFETY: a contiguous f32 CPU tensor holds `numel` floats from `data_ptr`; the borrow of
    // `t` keeps it alive, and Braid does not write to a tensor another borrow is reading.
    #[allow(unsafe_code)]
    Some(unsafe { std::slice::from_raw_parts(t.data_ptr() as *const f32, n) })
}

/// As `host`, writable: for tensors the caller owns exclusively (the KV cache).
pub(crate) fn host_mut(t: &mut tch::Tensor) -> Option<&mut [f32]> {
    if t.device() != tch::Device::Cpu || t.kind() != tch::Kind::Float || !t.is_contiguous() {
        return None;
    }
    let n = t.numel();
    if n == 0 {
        return Some(&mut []);
    }
    // SAFETY: as in `host`; the exclusive borrow of `t` stands for exclusive use of its
    // storage, which holds for the cache's tensors (each its own allocation, never shared).
    #[allow(unsafe_code)]
    Some(unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, n) })
}

/// `x += y`, elementwise.
fn add_into(x: &mut [f32], y: &[f32]) {
    for (x, &y) in x.iter_mut().zip(y) {
        *x += y;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_a_few_ulp_of_libm() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp_f32(x), x.exp());
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 4.0 * f32::EPSILON, "worst relative error {worst}");
        // Far outside the range: finite, and zero-ish or huge as expected.
        assert!(exp_f32(-1e4) >= 0.0 && exp_f32(-1e4) < 1e-37);
        assert!(exp_f32(1e4).is_finite() && exp_f32(1e4) > 1e38);
    }

    #[test]
    fn silu_mul_matches_the_formula() {
        let xs: Vec<f32> = (-400..400).map(|i| i as f32 * 0.05).collect();
        let us: Vec<f32> = (0..800).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let mut g = xs.clone();
        silu_mul(&mut g, &us);
        for ((&x, &u), &got) in xs.iter().zip(&us).zip(&g) {
            let want = x / (1.0 + (-x).exp()) * u;
            assert!(
                (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                "silu({x}) * {u}"
            );
        }
    }
}
