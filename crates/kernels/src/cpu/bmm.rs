//! The matrix products on the CPU: candle's gemm calls, with outputs the gemm writes whole left
//! unzeroed, and batches of small matrices split over the compute pool.
//!
//! candle's matmul zeroes every output before the gemm overwrites it (`C = 0·C + A·B` with C
//! not read): at the tiny preset's width 256 that is about 90 MB of stores a step at one
//! thread. [`matmul`] passes the gemm candle's arguments for the same product, so the bits are
//! candle's, into an output it never zeroes: a rank-2 product as a batch of one (the gemm
//! splits it over the pool itself above its threading threshold), a rank-4 batch as below.
//!
//! Attention's products are (B, H, M, K) · (B, H, K, N): B·H matrices of T × D or T × T each
//! (64 × 64 at the tiny preset's width 256). candle hands each matrix to the gemm in turn, and
//! each is below the gemm's threading threshold ([`gemm::get_threading_threshold`] multiply-adds),
//! so all of them run on the calling thread while the other workers wait. Here the B·H products
//! are shared out over the pool instead, each written into its own part of one output:
//!
//! ```text
//!   out (B·H, M, N)    matrices 0 .. B·H/2   worker 0   each one gemm(a[i], b[i]) call, the
//!                      matrices B·H/2 .. B·H worker 1   same arguments candle passes, so the
//!                                                       same bits as candle's matmul
//! ```
//!
//! A larger product of at least 2 · [`ROWS_MIN`] rows is cut by rows into one part a thread,
//! each part one single-threaded gemm call, which the pool's threads claim
//! ([`claimed`](super::split::claimed)): the caller spins for the last part instead of
//! sleeping in a join (the gemm's own split sleeps there, which on a virtual machine halts the
//! CPU; docs/journal.md, "The products' parts claimed"). Other larger matrices (the gemm
//! splits each itself) and products below [`split_min`](super::split_min) output elements in all
//! run in turn, each as candle runs it.
//! A matrix may sit at any strides, so attention reads q, k, v (B, H, T, D) as views of c_attn's
//! token-major output (B, T, 3·H·D), which candle's matmul does not take. Other ranks, dtypes
//! or devices and a broadcast batch go to candle's matmul.

use candle_core::{Layout, Result, Storage, Tensor};
use rayon::prelude::*;

/// The fewest rows of a part of a product cut by rows: each part packs the whole right side
/// again (a product of 256 rows of a long K cut in two lost 12%, docs/journal.md), so a
/// product of fewer than twice this many rows keeps the gemm's own split.
const ROWS_MIN: usize = 256;

/// The most rows one gemm call computes: a longer matrix goes in blocks of at most this many
/// rows (balanced, so each has more than half of it), each block's call writing its rows of the
/// one output. The gemm's packing buffers grow with the rows of its call (for the tied head's
/// dwte = dzᵀ·h at GPT-2's vocabulary and 128 tokens, one of V × N f32, 24.6 MiB, beside the
/// 147 MiB output), so a block bounds them by ROWS_BLOCK rows; the gemm's depth blocks depend
/// on K alone, so each element is the same sum in the same order.
const ROWS_BLOCK: usize = 2048;

/// `a · b` for a (M, K) and b (K, N), or a (B, H, M, K) and b (B, H, K, N): (M, N) or
/// (B, H, M, N), as `a.matmul(b)`.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    crate::profile::op(a.device(), || product(a, b), |_| gemm_cost(a, b))
}

/// The row `gemm MxKxN` (batches folded into M) of a (..., M, K) · (..., K, N), 2·M·K·N FLOPs.
fn gemm_cost(a: &Tensor, b: &Tensor) -> (String, crate::profile::Cost) {
    let (m, k) = match a.dims() {
        [.., m, k] => (*m, *k),
        _ => (1, a.elem_count()),
    };
    let n = b.dims().last().copied().unwrap_or(1);
    let batch = a.elem_count() / (m * k).max(1);
    let cost = crate::profile::Cost::gemm(batch, (m, k, n), a.dtype().size_in_bytes());
    (crate::profile::gemm_name("gemm", (batch * m, k, n)), cost)
}

/// The fewest elements of a weight W for which x · Wᵀ of few rows runs as (W · xᵀ)ᵀ: 2 MiB of
/// f32, more than a core's L2.
const WEIGHT_MIN: usize = 1 << 19;

/// The most rows of x for which it does.
const ROWS_MAX: usize = 256;

/// [`matmul`] itself.
///
/// A layer's product x · Wᵀ reads W (N, K) row-major as a transposed right side, which the gemm
/// streams unpacked from memory once per block of rows; with few rows and a W larger than the
/// cache that dominates. Multiplied the other way round, (W · xᵀ)ᵀ, W is the left side, read in
/// the gemm's row blocks, and the small xᵀ is what is streamed; the result, transposed into
/// place, has the same bits (every element the same sum over K, blocked by K alone). Measured at
/// one thread (AMD EPYC, `weight_products` example): 1024 → 2048, 128 rows 10.7 → 5.7 ms, 256
/// rows 16.6 → 12.2, 512 rows no gain (26.9 → 26.3); 512 → 1024, 128 rows 2.3 → 1.7, 256 rows
/// 3.5 → 3.0, 512 rows a loss (5.7 → 7.9); 256 → 1024 no gain at any; hence the bounds above.
fn product(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.rank() == 2 && b.rank() == 2 {
        // One matrix of a batch of one: the same gemm call, split by the gemm itself.
        let four = |t: &Tensor| t.unsqueeze(0)?.unsqueeze(0);
        let (m, w) = (a.dim(0)?, b.t()?); // w: the weight (N, K) if b is its transposed view
        if m <= ROWS_MAX && w.is_contiguous() && w.elem_count() >= WEIGHT_MIN && super::takes(&[a, b]) {
            let yt = batched(&four(&w)?, &four(&a.t()?)?, 1.0)?.squeeze(0)?.squeeze(0)?; // (N, M)
            return yt.t()?.contiguous(); // (M, N)
        }
        return batched(&four(a)?, &four(b)?, 1.0)?.squeeze(0)?.squeeze(0);
    }
    batched(a, b, 1.0)
}

/// `s · (a · b)` for a (B, H, M, K) and b (B, H, K, N), the factor applied by the gemm to each
/// product as it stores it (one rounding; for a power of two, the bits of `(s · a) · b`, the
/// only factor attention passes it).
pub(crate) fn matmul_scaled(a: &Tensor, b: &Tensor, s: f32) -> Result<Tensor> {
    batched(a, b, s)
}

/// The batched products of [`matmul`] and [`matmul_scaled`].
fn batched(a: &Tensor, b: &Tensor, scale: f32) -> Result<Tensor> {
    let candle = || match scale == 1.0 {
        true => a.matmul(b),
        false => a.matmul(b)? * scale as f64,
    };
    let (Ok((bb, h, m, k)), Ok((b2, h2, k2, n))) = (a.dims4(), b.dims4()) else {
        return candle();
    };
    let mats = bb * h;
    if !super::takes(&[a, b]) || (bb, h, k) != (b2, h2, k2) || k == 0 || mats * m * n == 0 {
        return candle();
    }
    let (sa, la) = a.storage_and_layout();
    let (sb, lb) = b.storage_and_layout();
    let (Storage::Cpu(ca), Storage::Cpu(cb)) = (&*sa, &*sb) else {
        return candle();
    };
    let (va, vb) = (ca.as_slice::<f32>()?, cb.as_slice::<f32>()?);
    let (oa, ob) = (Offsets::of(la, h), Offsets::of(lb, h));
    if oa.broadcast() || ob.broadcast() {
        return candle();
    }
    let threads = rayon::current_num_threads();
    // Small products split over the pool, one matrix a task. A larger one with rows enough is
    // cut into parts of at least ROWS_MIN rows that the pool's threads claim (`claimed`);
    // others go in turn, each split by the gemm itself as candle's are.
    let small = m * n * k < gemm::get_threading_threshold();
    let split = mats >= 2 && small && super::split::splits(mats * m * n);
    let parts = match split || small || threads == 1 {
        true => 1,
        false => (m / ROWS_MIN).min(threads),
    };
    let parallelism = match split || threads == 1 || parts >= 2 {
        true => gemm::Parallelism::None,
        false => gemm::Parallelism::Rayon(threads),
    };
    // Rows r0.. of matrix i into `dst`, those rows of its (M, N) output, row-major: one call.
    let call = |i: usize, r0: usize, dst: &mut [std::mem::MaybeUninit<f32>]| {
        // SAFETY: the offsets and strides are those of valid layouts of `a` and `b` over `va`
        // and `vb` (any strides: the heads of a token-major tensor included), so every element
        // the gemm reads of rows r0.. of matrix i lies in them; `dst` is whole rows of one
        // (M, N) row-major matrix of `out`'s capacity. The arguments are candle's own
        // (`cpu_backend::MatMul`): C = 0·C + s·A·B, C not read, every element written (s = 1:
        // candle's call). The gemm's depth blocks depend on K alone, so every element is the
        // same sum in the same order whichever rows share its call.
        unsafe {
            gemm::gemm(
                dst.len() / n,
                n,
                k,
                dst.as_mut_ptr() as *mut f32,
                1,
                n as isize,
                false,
                va.as_ptr().add(oa.start(i)).offset(r0 as isize * oa.rs),
                oa.cs,
                oa.rs,
                vb.as_ptr().add(ob.start(i)),
                ob.cs,
                ob.rs,
                0f32,
                scale,
                false,
                false,
                false,
                parallelism,
            )
        }
    };
    // The same rows in blocks of at most ROWS_BLOCK rows, one call each (n ≥ 2: a single
    // column is a gemv, left whole; blocks of over ROWS_BLOCK / 2 rows stay clear of the
    // gemm's small-matrix paths).
    let rows = |i: usize, r0: usize, dst: &mut [std::mem::MaybeUninit<f32>]| {
        let len = dst.len() / n;
        let blocks = match n >= 2 {
            true => len.div_ceil(ROWS_BLOCK),
            false => 1,
        };
        if blocks <= 1 {
            return call(i, r0, dst);
        }
        let bounds = |p: usize| p * len / blocks;
        for p in 0..blocks {
            let (b0, b1) = (bounds(p), bounds(p + 1));
            call(i, r0 + b0, &mut dst[b0 * n..b1 * n]);
        }
    };
    // Not zeroed first: the gemm writes every element of C without reading it (k > 0).
    let mut out: Vec<f32> = Vec::with_capacity(mats * m * n);
    let dst = &mut out.spare_capacity_mut()[..mats * m * n];
    if split {
        dst.par_chunks_mut(m * n)
            .with_min_len(mats.div_ceil(threads))
            .enumerate()
            .for_each(|(i, d)| rows(i, 0, d));
    } else if parts >= 2 {
        // Part p: rows p·M/P .. (p + 1)·M/P of the matrix.
        let bounds = |p: usize| p * m / parts;
        for (i, d) in dst.chunks_mut(m * n).enumerate() {
            let base = d.as_mut_ptr() as usize;
            super::split::claimed(parts, &|p| {
                let (r0, r1) = (bounds(p), bounds(p + 1));
                // SAFETY: the parts' row ranges are disjoint and inside the matrix, so each
                // part's rows are written by that part alone while `d` is borrowed here.
                let rows_out = unsafe {
                    std::slice::from_raw_parts_mut(
                        (base as *mut std::mem::MaybeUninit<f32>).add(r0 * n),
                        (r1 - r0) * n,
                    )
                };
                rows(i, r0, rows_out)
            });
        }
    } else {
        dst.chunks_mut(m * n).enumerate().for_each(|(i, d)| rows(i, 0, d));
    }
    // SAFETY: the products wrote all mats · m · n elements.
    unsafe { out.set_len(mats * m * n) };
    drop((sa, sb));
    Tensor::from_vec(out, (bb, h, m, n), a.device())
}

/// Where matrix `i` = (batch i / H, head i % H) of a 4-D layout starts, and its strides.
struct Offsets {
    start: usize,
    h: usize,
    s0: usize,
    s1: usize,
    rs: isize,
    cs: isize,
}

impl Offsets {
    fn of(l: &Layout, h: usize) -> Self {
        let s = l.stride();
        Self {
            start: l.start_offset(),
            h,
            s0: s[0],
            s1: s[1],
            rs: s[2] as isize,
            cs: s[3] as isize,
        }
    }

    /// Whether a batch dimension repeats one matrix (stride 0): candle folds those differently.
    fn broadcast(&self) -> bool {
        self.s0 == 0 || (self.h > 1 && self.s1 == 0)
    }

    fn start(&self, i: usize) -> usize {
        self.start + (i / self.h) * self.s0 + (i % self.h) * self.s1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, D};

    fn bits(t: &Tensor) -> Result<Vec<u32>> {
        Ok(t.flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .map(|x| x.to_bits())
            .collect())
    }

    /// Every product attention takes (a plain pair, a transposed right side, a transposed left
    /// side, a view at an offset) gives candle's bits on two threads; a large or a mismatched
    /// product is candle's own.
    #[test]
    fn split_products_are_candle_bit_for_bit() -> Result<()> {
        let dev = Device::Cpu;
        let qkv = Tensor::randn(0f32, 1.0, (3, 4, 4, 64, 32), &dev)?;
        let (q, k) = (qkv.get(0)?, qkv.get(1)?);
        let s = Tensor::randn(0f32, 1.0, (4, 4, 64, 64), &dev)?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let kt = k.t()?;
        let st = s.t()?;
        let cases: [(&Tensor, &Tensor); 4] = [(&q, &kt), (&s, &k), (&st, &q), (&s, &q)];
        for (a, b) in cases {
            let want = a.matmul(b)?;
            let got = pool.install(|| matmul(a, b))?;
            assert_eq!(got.dims(), want.dims());
            assert_eq!(bits(&got)?, bits(&want)?);
        }
        let wide = Tensor::randn(0f32, 1.0, (2, 1, 256, 256), &dev)?;
        let got = pool.install(|| matmul(&wide, &wide))?;
        assert_eq!(bits(&got)?, bits(&wide.matmul(&wide)?)?);
        // The heads as views of a token-major (B, T, 3·H·D) tensor, at one and two threads.
        let tok = Tensor::randn(0f32, 1.0, (4, 64, 3 * 4 * 32), &dev)?;
        let view = |j: usize| -> Result<Tensor> {
            tok.reshape((4, 64, 3, 4, 32))?.narrow(2, j, 1)?.squeeze(2)?.transpose(1, 2)
        };
        let (qv, kv) = (view(0)?, view(1)?);
        let want = qv.contiguous()?.matmul(&kv.contiguous()?.t()?)?;
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let got = pool.install(|| matmul(&qv, &kv.t()?))?;
            assert_eq!(bits(&got)?, bits(&want)?, "{threads} threads");
        }
        // The factor applied in the gemm: for a power of two the bits of scaling a first; for
        // another, one rounding of the scaled product.
        let kt = k.t()?;
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let got = pool.install(|| matmul_scaled(&q, &kt, 0.125))?;
            assert_eq!(bits(&got)?, bits(&(&q * 0.125)?.matmul(&kt)?)?, "{threads} threads");
            let got = pool.install(|| matmul_scaled(&q, &kt, 0.3))?;
            let want = (q.matmul(&kt)? * 0.3f32 as f64)?;
            let err = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let top = want.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(err <= top * 1e-6, "{threads} threads: {err} against {top}");
        }
        let bad = pool.install(|| matmul(&q, &s.narrow(D::Minus1, 0, 16)?));
        assert!(
            bad.is_err(),
            "a (.., 64, 32) by (.., 64, 16) product must fail"
        );
        Ok(())
    }

    /// The linear layers' three products (x wᵀ, dy w, dyᵀ x), above and below the gemm's
    /// threading threshold, cut into row blocks and, for x wᵀ, multiplied the other way round, a view at an offset and a single row give
    /// candle's bits at one and two threads; a non-matching pair fails as candle's does.
    #[test]
    fn rank_two_products_are_candle_bit_for_bit() -> Result<()> {
        let dev = Device::Cpu;
        // Then: products of more rows than ROWS_BLOCK (x wᵀ, and dyᵀ x of 5000 rows); x wᵀ of a
        // weight of WEIGHT_MIN elements or more as (w xᵀ)ᵀ (64, 128 and 256 rows), and in the plain order
        // past ROWS_MAX.
        let shapes = [
            (1024, 256, 768),
            (48, 20, 12),
            (1, 64, 32),
            (4200, 48, 40),
            (128, 64, 5000),
            (64, 1024, 1024),
            (128, 512, 1024),
            (256, 1024, 1024),
            (ROWS_MAX + 88, 1024, 1024),
        ];
        for (rows, i, o) in shapes {
            let x = Tensor::randn(0f32, 1.0, (rows, i), &dev)?;
            let w = Tensor::randn(0f32, 1.0, (o, i), &dev)?;
            let dy = Tensor::randn(0f32, 1.0, (rows, o), &dev)?;
            let big = Tensor::randn(0f32, 1.0, (rows + 3, o), &dev)?;
            let view = big.narrow(0, 3, rows)?;
            let (wt, dyt) = (w.t()?, dy.t()?);
            let cases: [(&Tensor, &Tensor); 4] = [(&x, &wt), (&dy, &w), (&dyt, &x), (&view, &w)];
            for threads in [1, 2] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                for (a, b) in cases {
                    let want = a.matmul(b)?;
                    let got = pool.install(|| matmul(a, b))?;
                    assert_eq!(got.dims(), want.dims());
                    assert_eq!(bits(&got)?, bits(&want)?, "{:?} x {:?}", a.dims(), b.dims());
                }
            }
        }
        let (a, b) = (Tensor::zeros((4, 5), DType::F32, &dev)?, Tensor::zeros((6, 3), DType::F32, &dev)?);
        assert!(matmul(&a, &b).is_err(), "a (4, 5) by (6, 3) product must fail");
        Ok(())
    }
}
