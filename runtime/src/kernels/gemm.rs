//! Products of a few activation rows with a weight matrix on the CPU: the linear layers of a
//! decode or verification step.
//!
//! In a decode step every linear layer multiplies a thin block of rows (one new token per
//! running sample, 32 in the generation benchmark) by a weight matrix stored `[out, in]`.
//! libtorch hands that to MKL's general `sgemm`, which copies ("packs") the weight operand into
//! its own layout on every call; for such thin products the copy is about a third of the
//! product's time (`perf` on the benchmark, docs/benchmarks.md). This kernel reads the weight
//! where it lies: each output is a dot product of an activation row with a weight row, both
//! contiguous, computed for a tile of `ROWS` x `COLS` outputs at once so that every loaded
//! vector feeds several fused multiply-adds. A tile's weight rows stay in the L1 cache while
//! every block of activation rows passes over them, so the weights are read from memory once
//! per product; the next block's rows are prefetched into L2 while a block computes.
//!
//! It is used only where it computes what `Tensor::linear` computes (up to the order of the
//! additions): f32 tensors on the CPU, a contiguous `[out, in]` weight, at most `MAX_ROWS`
//! activation rows in `linear` (the host-memory step, `step.rs`, calls `product` directly for
//! its decode and verification blocks). Everything else (prefill, training, GPUs, other
//! dtypes) goes to libtorch.
//! With more than one libtorch thread, chunks of output columns are shared between the calling
//! thread and the kernel team (`team.rs`) when the product is large enough to pay for handing
//! work over (`threads`).

use tch::{Device, Kind, Tensor};

use crate::kernels::team::{self, Out};

/// Most activation rows the kernel takes. Taller blocks (prefill, training) are the products
/// MKL's packing pays off for.
pub const MAX_ROWS: usize = 96;

/// Outputs computed together: `ROWS` activation rows by `COLS` weight rows. 4 x 3 keeps twelve
/// 8-lane accumulators and seven operand vectors within AVX2's sixteen registers.
const ROWS: usize = 4;
const COLS: usize = 3;

/// Weight rows per block that one thread walks with all activation rows; 24 rows of a
/// 1,024-wide weight are 96 KB, which stays in L2 next to the activations.
const BLOCK_COLS: usize = 8 * COLS;

/// `x · wᵀ (+ bias)` for `x: [..., in]` and `w: [out, in]`, as `Tensor::linear` computes it, or
/// `None` when the inputs are not ones this kernel takes (see the module docs).
pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Option<Tensor> {
    let cpu_f32 = |t: &Tensor| t.device() == Device::Cpu && t.kind() == Kind::Float;
    if !(cpu_f32(x) && cpu_f32(w) && bias.is_none_or(cpu_f32)) || x.requires_grad() {
        return None;
    }
    let (n, k) = w.size2().ok()?;
    let dims = x.size();
    let (&last, lead) = dims.split_last()?;
    let m: i64 = lead.iter().product();
    if last != k
        || k == 0
        || n == 0
        || !(1..=MAX_ROWS as i64).contains(&m)
        || !w.is_contiguous()
        || bias.is_some_and(|b| b.size() != [n] || !b.is_contiguous())
    {
        return None;
    }
    let x = x.contiguous();
    let (m, n, k) = (m as usize, n as usize, k as usize);
    // SAFETY: `x` and `w` are contiguous f32 CPU tensors of `m * k` and `n * k` elements (checked
    // above), `bias` one of `n`, all alive for the whole function and only read.
    #[allow(unsafe_code)]
    let (xs, ws, bs) = unsafe {
        (
            std::slice::from_raw_parts(x.data_ptr() as *const f32, m * k),
            std::slice::from_raw_parts(w.data_ptr() as *const f32, n * k),
            bias.map(|b| std::slice::from_raw_parts(b.data_ptr() as *const f32, n)),
        )
    };
    let mut out = vec![0f32; m * n];
    product(xs, ws, bs, m, n, k, &mut out);
    let mut shape = lead.to_vec();
    shape.push(n as i64);
    Some(Tensor::from_slice(&out).reshape(shape))
}

/// `out[m × n] = x[m × k] · w[n × k]ᵀ (+ bias)`, on as many of the threads libtorch is
/// allowed as the product's size pays for.
pub(crate) fn product(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    m: usize,
    n: usize,
    k: usize,
    out: &mut [f32],
) {
    product_on(threads(m, n, k), x, w, bias, (m, n, k), out);
}

/// `product` on `threads` threads: chunks of whole blocks of output columns, taken by the
/// calling thread and the kernel team (`team.rs`); each writes only its own columns.
fn product_on(
    threads: usize,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    (m, n, k): (usize, usize, usize),
    out: &mut [f32],
) {
    assert!(x.len() >= m * k && w.len() >= n * k && out.len() >= m * n);
    assert!(bias.is_none_or(|b| b.len() >= n));
    let o = Out::new(out);
    // A chunk's first block of weight rows is not prefetched (the block before it may be on
    // another core), so chunks are few: about two per thread, whole blocks each.
    let per = n
        .div_ceil(2 * threads.max(1))
        .div_ceil(BLOCK_COLS)
        .max(CHUNK_BLOCKS)
        * BLOCK_COLS;
    let chunks = n.div_ceil(per);
    if threads <= 1 || chunks <= 1 {
        // One pass over all columns, so that every block but the first is prefetched.
        columns(x, w, bias, (m, n, k), (0, n), o);
        return;
    }
    team::for_each_chunk(threads.min(chunks), chunks, &|i| {
        let c0 = i * per;
        columns(x, w, bias, (m, n, k), (c0, (c0 + per).min(n)), o);
    });
}

/// Fewest blocks of weight rows per chunk of a split product.
const CHUNK_BLOCKS: usize = 2;

/// How many threads a product of this size uses: libtorch's thread count, but fewer when a
/// thread would get less than `MIN_WORK_PER_THREAD` multiply-adds, which takes about as long
/// as handing the work over costs.
fn threads(m: usize, n: usize, k: usize) -> usize {
    let allowed = tch::get_num_threads().max(1) as usize;
    allowed.min(m * n * k / MIN_WORK_PER_THREAD).max(1)
}

/// See `threads`: about 20 microseconds of one thread's work.
const MIN_WORK_PER_THREAD: usize = 1 << 20;

/// Output columns `[c0, c1)` of the `m × n` product, written into `out` (the whole output,
/// row-major). The caller has checked the slices against `(m, n, k)`.
fn columns(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    dims: (usize, usize, usize),
    cols: (usize, usize),
    out: Out,
) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA, checked just above.
        #[allow(unsafe_code)]
        unsafe {
            avx2::columns(x, w, bias, dims, cols, out)
        };
        return;
    }
    portable_columns(x, w, bias, dims, cols, out);
}

/// The same product without vector intrinsics, for CPUs without AVX2 and FMA.
fn portable_columns(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    (m, n, k): (usize, usize, usize),
    (c0, c1): (usize, usize),
    out: Out,
) {
    for c in c0..c1 {
        let wr = &w[c * k..][..k];
        let b = bias.map_or(0.0, |b| b[c]);
        for r in 0..m {
            let xr = &x[r * k..][..k];
            out.set(
                r * n + c,
                b + xr.iter().zip(wr).map(|(a, b)| a * b).sum::<f32>(),
            );
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{BLOCK_COLS, COLS, ROWS};
    use crate::kernels::team::Out;

    /// See `super::columns`. Blocks of `BLOCK_COLS` weight rows; within a block, tiles of
    /// `ROWS` x `COLS` outputs, with narrower tiles at the edges.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn columns(
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        (m, n, k): (usize, usize, usize),
        (c0, c1): (usize, usize),
        out: Out,
    ) {
        assert!(x.len() >= m * k && w.len() >= c1 * k && c1 <= n);
        assert!(bias.is_none_or(|b| b.len() >= c1));
        let mut b0 = c0;
        while b0 < c1 {
            let b1 = (b0 + BLOCK_COLS).min(c1);
            // While this block computes, the next block's weight rows are fetched into L2 a
            // few lines per tile: the first pass over a block would otherwise wait on memory
            // for every line (each weight row is read for only k / 16 lines at a time, too
            // short a stream for the hardware prefetcher to get ahead).
            let next = w[b1 * k..(b1 + BLOCK_COLS).min(c1) * k].as_ptr_range();
            let tiles = m.div_ceil(ROWS) * (b1 - b0).div_ceil(COLS);
            let lines_per_tile = ((next.end as usize - next.start as usize) / 64).div_ceil(tiles);
            let mut fetch = next.start;
            let mut r = 0;
            while r < m {
                let rows = (m - r).min(ROWS);
                let mut c = b0;
                while c < b1 {
                    for _ in 0..lines_per_tile {
                        if fetch < next.end {
                            // A prefetch is only a hint: it reads nothing architecturally.
                            _mm_prefetch::<_MM_HINT_T1>(fetch as *const i8);
                            fetch = fetch.wrapping_add(16);
                        }
                    }
                    let cols = (b1 - c).min(COLS);
                    let t = Tile { r, c, n, k };
                    // SAFETY: rows r..r+rows of x, weight rows c..c+cols and the outputs they
                    // make are inside the slices (asserted above: r + rows <= m, c + cols <= c1).
                    unsafe {
                        match (rows, cols) {
                            (4, 3) => tile::<4, 3>(x, w, bias, t, out),
                            (4, 2) => tile::<4, 2>(x, w, bias, t, out),
                            (4, 1) => tile::<4, 1>(x, w, bias, t, out),
                            (3, 3) => tile::<3, 3>(x, w, bias, t, out),
                            (3, 2) => tile::<3, 2>(x, w, bias, t, out),
                            (3, 1) => tile::<3, 1>(x, w, bias, t, out),
                            (2, 3) => tile::<2, 3>(x, w, bias, t, out),
                            (2, 2) => tile::<2, 2>(x, w, bias, t, out),
                            (2, 1) => tile::<2, 1>(x, w, bias, t, out),
                            (1, 3) => tile::<1, 3>(x, w, bias, t, out),
                            (1, 2) => tile::<1, 2>(x, w, bias, t, out),
                            _ => tile::<1, 1>(x, w, bias, t, out),
                        }
                    }
                    c += cols;
                }
                r += rows;
            }
            b0 = b1;
        }
    }

    /// Where a tile sits: its first activation row and weight row (output column), the
    /// output's row width and the inner dimension.
    #[derive(Clone, Copy)]
    struct Tile {
        r: usize,
        c: usize,
        n: usize,
        k: usize,
    }

    /// `R` x `C` outputs: eight lanes of the inner dimension per step in `R * C` accumulators,
    /// summed across lanes at the end, then the scalar remainder of the inner dimension.
    ///
    /// # Safety
    /// The CPU supports AVX2 and FMA; `x` holds rows `t.r..t.r + R` of length `t.k`, `w` rows
    /// `t.c..t.c + C`. Outputs are written through `Out`, which checks its bounds.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const R: usize, const C: usize>(
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        t: Tile,
        out: Out,
    ) {
        // SAFETY: the caller keeps every pointer below inside its slice (see `# Safety`).
        unsafe {
            let k = t.k;
            let xp = x.as_ptr().add(t.r * k);
            let wp = w.as_ptr().add(t.c * k);
            let mut acc = [[_mm256_setzero_ps(); C]; R];
            let full = k / 8 * 8;
            let mut i = 0;
            while i < full {
                let mut wv = [_mm256_setzero_ps(); C];
                for (j, v) in wv.iter_mut().enumerate() {
                    *v = _mm256_loadu_ps(wp.add(j * k + i));
                }
                for (rr, a) in acc.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(xp.add(rr * k + i));
                    for (j, a) in a.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(xv, wv[j], *a);
                    }
                }
                i += 8;
            }
            for (rr, a) in acc.iter().enumerate() {
                for (j, a) in a.iter().enumerate() {
                    let mut s = hsum(*a);
                    for ii in full..k {
                        s += *xp.add(rr * k + ii) * *wp.add(j * k + ii);
                    }
                    if let Some(b) = bias {
                        s += b[t.c + j];
                    }
                    out.set((t.r + rr) * t.n + t.c + j, s);
                }
            }
        }
    }

    /// The sum of a vector's eight lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel against `Tensor::linear` for shapes that exercise every tile edge: rows not
    /// a multiple of 4, outputs not a multiple of 3 or of a block, inner sizes not a multiple
    /// of 8, with and without a bias, and a 3-d input.
    #[test]
    fn agrees_with_libtorch_linear() {
        tch::manual_seed(11);
        let o = (Kind::Float, Device::Cpu);
        for (m, n, k) in [
            (1, 1, 1),
            (1, 7, 5),
            (5, 25, 19),
            (32, 256, 256),
            (7, 1000, 64),
            (33, 50, 1031),
            (MAX_ROWS as i64, 49, 16),
        ] {
            let x = Tensor::randn([m, k], o);
            let w = Tensor::randn([n, k], o);
            let b = Tensor::randn([n], o);
            for bias in [None, Some(&b)] {
                let got = linear(&x, &w, bias).expect("handled");
                let want = x.linear(&w, bias);
                let diff = (&got - &want).abs().max().double_value(&[]);
                let tol = 1e-5 * (k as f64).sqrt() * 4.0;
                assert!(diff < tol, "{m}x{n}x{k}: max difference {diff}");
            }
        }
        let x = Tensor::randn([2, 3, 40], o);
        let w = Tensor::randn([17, 40], o);
        let got = linear(&x, &w, None).expect("handled");
        assert_eq!(got.size(), [2, 3, 17]);
        let diff = (&got - x.linear(&w, None::<&Tensor>)).abs().max();
        assert!(diff.double_value(&[]) < 1e-4);
    }

    /// Threads split the output columns; the result is the one thread's, bit for bit.
    #[test]
    fn threads_split_columns_exactly() {
        tch::manual_seed(5);
        let o = (Kind::Float, Device::Cpu);
        let (m, n, k) = (64usize, 1000usize, 256usize);
        let x = Vec::<f32>::try_from(Tensor::randn([(m * k) as i64], o)).expect("f32");
        let w = Vec::<f32>::try_from(Tensor::randn([(n * k) as i64], o)).expect("f32");
        let mut one = vec![0f32; m * n];
        product_on(1, &x, &w, None, (m, n, k), &mut one);
        for threads in [2, 3] {
            let mut many = vec![0f32; m * n];
            product_on(threads, &x, &w, None, (m, n, k), &mut many);
            assert_eq!(one, many);
        }
    }

    #[test]
    fn declines_what_it_does_not_handle() {
        let o = (Kind::Float, Device::Cpu);
        let w = Tensor::zeros([8, 4], o);
        assert!(linear(&Tensor::zeros([2, 4], o), &w, None).is_some());
        // Too many rows, a mismatched inner size, f64, a transposed weight, a wrong bias.
        let tall = Tensor::zeros([MAX_ROWS as i64 + 1, 4], o);
        assert!(linear(&tall, &w, None).is_none());
        assert!(linear(&Tensor::zeros([2, 5], o), &w, None).is_none());
        let xd = Tensor::zeros([2, 4], (Kind::Double, Device::Cpu));
        assert!(linear(&xd, &w.to_kind(Kind::Double), None).is_none());
        let wt = Tensor::zeros([4, 8], o).transpose(0, 1);
        assert!(linear(&Tensor::zeros([2, 4], o), &wt, None).is_none());
        let bad_bias = Tensor::zeros([7], o);
        assert!(linear(&Tensor::zeros([2, 4], o), &w, Some(&bad_bias)).is_none());
        // Inputs that need gradients stay with autograd.
        let xg = Tensor::zeros([2, 4], o).set_requires_grad(true);
        assert!(linear(&xg, &w, None).is_none());
    }
}
