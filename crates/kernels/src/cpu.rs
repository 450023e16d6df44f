//! The graph-free ops on CPU in f32, each written as one loop over rows where candle ops would
//! make a pass per operation: the CPU counterparts of the fused kernels, for the hand-written
//! backward passes (the model crate's tapes). Each op's module calls its loop here when every
//! tensor is an f32 CPU tensor, and keeps candle ops for other dtypes; the differentiable ops
//! and [`crate::plain`] (the autograd oracle) never run them.
//!
//! ```text
//!   op                       candle ops (passes over the tensor)        here
//!   gelu forward / backward  tanh, powers, products: 4 / ~14            one each, tanh from exp
//!   layer_norm fwd / bwd     mean, centre, square, ÷, ·w, +b: ~8 / ~14  one row at a time
//!   residual + bias          2                                          1
//!   bias add (graph-free)    1, on the calling thread                   1, rows split
//!   attention softmax        +mask, max, −, exp, Σ, ln, −, exp: 8       1, the masked half skipped
//!   attention dS             exp(s − lse), dy·y, Σ, −, ·: 5             1 (with δ = rowsum(dy∘y))
//!   cross-entropy fwd / bwd  log-softmax, gather / exp, one-hot, ·: ~6  one row at a time
//! ```
//!
//! The matrix products are candle's gemm calls ([`matmul`]: the outputs unzeroed, attention's
//! batches split over the pool). `exp` is a polynomial the compiler vectorises
//! (libm's `expf` is one call per element): `e^x = 2^n · e^r`, `n = round(x / ln 2)`,
//! `|r| ≤ ln 2 / 2`, `e^r ≈ 1 + r + r² p(r)` with Cephes' degree-5 `p`, a few units in the last
//! place; `tanh u = 1 − 2 / (e^(2u) + 1)`. Sums run in f32 in row order, as the kernels' do.
//!
//! Legend: `N` rows, `C` width, `V` vocabulary, `T` time, `D` head size.

use candle_core::{DType, Device, Result, Shape, Storage, StorageRef, Tensor, WithDType};

use crate::msg;

mod bmm;
mod each;
mod simd;
mod split;
pub use bmm::matmul;
pub(crate) use bmm::matmul_scaled;
pub use each::each_tensor;
pub use split::{set_split_min, split_min, DEFAULT_SPLIT_MIN};

/// Whether the CPU loops take these tensors: every one an f32 tensor on the CPU.
pub(crate) fn takes(ts: &[&Tensor]) -> bool {
    ts.iter()
        .all(|t| t.device().is_cpu() && t.dtype() == DType::F32)
}

/// A contiguous CPU tensor's elements, borrowed from its storage while this lives.
struct Elems<'a> {
    storage: StorageRef<'a>,
    start: usize,
    end: usize,
}

impl<'a> Elems<'a> {
    /// The elements of `t`, which the caller made contiguous.
    fn of(t: &'a Tensor) -> Result<Self> {
        let (storage, layout) = t.storage_and_layout();
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| msg(format!("cpu loop: tensor {:?} is not contiguous", t.dims())))?;
        Ok(Self {
            storage,
            start,
            end,
        })
    }

    fn get<T: WithDType>(&self) -> Result<&[T]> {
        match &*self.storage {
            Storage::Cpu(s) => Ok(&T::cpu_storage_as_slice(s)?[self.start..self.end]),
            _ => Err(msg("cpu loop: tensor is not on the CPU".into())),
        }
    }
}

/// Runs `f` on the f32 elements of each tensor of `ts` (made contiguous first).
pub(crate) fn with<R>(ts: &[&Tensor], f: impl FnOnce(&[&[f32]]) -> Result<R>) -> Result<R> {
    let owned: Vec<Tensor> = ts.iter().map(|t| t.contiguous()).collect::<Result<_>>()?;
    let elems: Vec<Elems> = owned.iter().map(Elems::of).collect::<Result<_>>()?;
    let slices: Vec<&[f32]> = elems
        .iter()
        .map(|e| e.get::<f32>())
        .collect::<Result<_>>()?;
    f(&slices)
}

pub(crate) fn tensor<S: Into<Shape>>(v: Vec<f32>, shape: S) -> Result<Tensor> {
    Tensor::from_vec(v, shape, &Device::Cpu)
}

/// e^x for f32 (module doc), vectorisable; inputs are clamped to [−87, 88], where e^x is a
/// normal f32.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2²³: adding and subtracting it rounds to an integer
    let x = x.clamp(-87.0, 88.0);
    let t = x * std::f32::consts::LOG2_E + ROUND; // n in the low bits of the mantissa
    let n = t - ROUND;
    // r = x − n ln 2, with ln 2 split in two so n · ln2_hi is exact.
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 0.166_666_65)
        * r
        + 0.5;
    let e = r * r * p + r + 1.0;
    // 2ⁿ: t's bits are 0x4B40_0000 + n, and shifted left by 23 only n is left (no float-to-int
    // conversion, which the compiler cannot vectorise with its saturation rule).
    f32::from_bits((t.to_bits() << 23).wrapping_add(127 << 23)) * e
}

/// tanh u = 1 − 2 / (e^(2u) + 1); |u| ≥ 9 gives ±1 to f32 precision.
#[inline(always)]
fn tanh(u: f32) -> f32 {
    1.0 - 2.0 / (exp(2.0 * u.clamp(-9.0, 9.0)) + 1.0)
}

/// √(2/π) and the cubic coefficient of the tanh GELU.
const GELU_K: f32 = 0.797_884_6;
const GELU_A: f32 = 0.044_715;

/// GELU (tanh approximation) of x, any shape: y = x/2 · (1 + tanh u), u = k (x + a x³).
pub(crate) fn gelu(x: &Tensor) -> Result<Tensor> {
    with(&[x], |s| {
        let y = split::fresh_spans(s[0].len(), |o, ys| simd::gelu(&s[0][o..o + ys.len()], ys));
        tensor(y, x.shape().clone())
    })
}

/// dx of GELU at x for dy: dy · [(1 + th)/2 + x/2 (1 − th²) k (1 + 3a x²)], th = tanh u.
pub(crate) fn gelu_backward(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    same_dims("gelu backward", &[x, dy])?;
    with(&[x, dy], |s| {
        let dx = split::fresh_spans(s[0].len(), |o, dxs| {
            let n = dxs.len();
            simd::gelu_backward(&s[0][o..o + n], &s[1][o..o + n], dxs)
        });
        tensor(dx, x.shape().clone())
    })
}

/// An error naming the shapes unless every tensor of `ts` has the first one's.
fn same_dims(what: &str, ts: &[&Tensor]) -> Result<()> {
    match ts.iter().all(|t| t.dims() == ts[0].dims()) {
        true => Ok(()),
        false => Err(msg(format!(
            "{what}: shapes {:?} must be equal",
            ts.iter().map(|t| t.dims()).collect::<Vec<_>>()
        ))),
    }
}

/// The size T of square scores s (..., T, T), or an error naming the shape.
fn square(what: &str, s: &Tensor) -> Result<usize> {
    match s.dims() {
        [.., a, b] if a == b => Ok(*b),
        d => Err(msg(format!("{what}: scores {d:?} must be (..., T, T)"))),
    }
}

/// The width C (last dimension) of x and its number of rows.
fn rows(x: &Tensor) -> Result<(usize, usize)> {
    let c = x.dims().last().copied().unwrap_or(0);
    if c == 0 {
        return Err(msg(format!("cpu loop: {:?} has no rows", x.dims())));
    }
    Ok((x.elem_count() / c, c))
}

/// LayerNorm of x (..., C) by w, b (C,): y, and per row the mean and rstd = 1/√(var + eps)
/// (x's leading dims), the variance biased.
pub(crate) fn layer_norm(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (n, c) = rows(x)?;
    if w.dims() != [c] || b.dims() != [c] {
        return Err(msg(format!(
            "layer_norm: weight {:?} and bias {:?} must be ({c},) for x {:?}",
            w.dims(),
            b.dims(),
            x.dims()
        )));
    }
    with(&[x, w, b], |s| {
        let (w, b) = (s[1], s[2]);
        let mut stats = vec![(0f32, 0f32); n];
        let y = split::fresh_rows(n * c, c, &mut stats, |i, yr, stat| {
            let xr = &s[0][i * c..(i + 1) * c];
            let m = xr.iter().sum::<f32>() / c as f32;
            let var = xr.iter().map(|&v| (v - m) * (v - m)).sum::<f32>() / c as f32;
            let r = 1.0 / (var + eps as f32).sqrt();
            for (((y, &v), &w), &b) in yr.iter_mut().zip(xr).zip(w).zip(b) {
                *y = (v - m) * r * w + b;
            }
            *stat = (m, r);
        });
        let (mean, rstd): (Vec<f32>, Vec<f32>) = stats.into_iter().unzip();
        let lead = &x.dims()[..x.rank() - 1];
        Ok((
            tensor(y, x.shape().clone())?,
            tensor(mean, lead)?,
            tensor(rstd, lead)?,
        ))
    })
}

/// LayerNorm's (dx, dw, db) from x (..., C), w, dy and the forward's mean and rstd:
/// with x̂ = (x − mean)·rstd and g = dy·w, dx = (g − mean(g) − x̂·mean(g·x̂))·rstd per row,
/// dw = Σ_rows dy·x̂, db = Σ_rows dy.
pub(crate) fn layer_norm_backward(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (n, c) = rows(x)?;
    if w.dims() != [c] || dy.dims() != x.dims() || mean.elem_count() != n || rstd.elem_count() != n
    {
        return Err(msg(format!(
            "layer_norm backward: x {:?}, weight {:?}, dy {:?}, mean {:?}, rstd {:?}",
            x.dims(),
            w.dims(),
            dy.dims(),
            mean.dims(),
            rstd.dims()
        )));
    }
    with(&[x, w, dy, mean, rstd], |s| {
        let (xs, w, dys, mean, rstd) = (s[0], s[1], s[2], s[3], s[4]);
        let dx = split::fresh_each_row(xs.len(), c, |i, dxr| {
            let (xr, dyr) = (&xs[i * c..(i + 1) * c], &dys[i * c..(i + 1) * c]);
            let (m, r) = (mean[i], rstd[i]);
            let (mut m1, mut m2) = (0f32, 0f32);
            for j in 0..c {
                let g = dyr[j] * w[j];
                m1 += g;
                m2 += g * ((xr[j] - m) * r);
            }
            let (m1, m2) = (m1 / c as f32, m2 / c as f32);
            for j in 0..c {
                dxr[j] = (dyr[j] * w[j] - m1 - (xr[j] - m) * r * m2) * r;
            }
        });
        let [dw, db] = split::column_sums(n, c, |cols, [dw, db]| {
            for i in 0..n {
                let (m, r) = (mean[i], rstd[i]);
                for (k, j) in cols.clone().enumerate() {
                    let xh = (xs[i * c + j] - m) * r;
                    dw[k] += dys[i * c + j] * xh;
                    db[k] += dys[i * c + j];
                }
            }
        });
        Ok((
            tensor(dx, x.shape().clone())?,
            tensor(dw, c)?,
            tensor(db, c)?,
        ))
    })
}

/// r + x + b for r, x (N, C) and b (C,), in one pass.
pub(crate) fn residual_add(r: &Tensor, x: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (n, c) = rows(x)?;
    if r.dims() != x.dims() || b.dims() != [c] {
        return Err(msg(format!(
            "residual_add: r {:?}, x {:?}, b {:?}",
            r.dims(),
            x.dims(),
            b.dims()
        )));
    }
    with(&[r, x, b], |s| {
        let y = split::fresh_each_row(n * c, c, |i, yr| {
            let (rr, xr) = (&s[0][i * c..(i + 1) * c], &s[1][i * c..(i + 1) * c]);
            for (((y, &r), &x), &b) in yr.iter_mut().zip(rr).zip(xr).zip(s[2]) {
                *y = r + x + b;
            }
        });
        tensor(y, x.shape().clone())
    })
}

/// x + b for x (N, C) and b (C,): candle's broadcast add element for element, its rows split
/// over the pool (candle's runs on the calling thread).
pub(crate) fn bias_add(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (n, c) = rows(x)?;
    if b.dims() != [c] {
        return Err(msg(format!("bias_add: x {:?}, b {:?}", x.dims(), b.dims())));
    }
    with(&[x, b], |s| {
        let y = split::fresh_each_row(n * c, c, |i, yr| {
            for ((y, &x), &b) in yr.iter_mut().zip(&s[0][i * c..(i + 1) * c]).zip(s[1]) {
                *y = x + b;
            }
        });
        tensor(y, x.shape().clone())
    })
}

/// Σ over the rows of dy (..., C): (C,).
pub(crate) fn row_sum(dy: &Tensor) -> Result<Tensor> {
    let (n, c) = rows(dy)?;
    with(&[dy], |s| {
        let [acc] = split::column_sums(n, c, |cols, [acc]| {
            for r in s[0].chunks_exact(c) {
                acc.iter_mut().zip(&r[cols.clone()]).for_each(|(a, &v)| *a += v);
            }
        });
        tensor(acc, c)
    })
}

/// The causal softmax of scores s (..., T, T) (no mask applied: keys after the query are
/// skipped): P with zeros above the diagonal, and each row's natural lse (..., T).
pub(crate) fn causal_softmax(s: &Tensor) -> Result<(Tensor, Tensor)> {
    let t = square("causal softmax", s)?;
    with(&[s], |e| {
        let mut lse = vec![0f32; e[0].len() / t];
        let p = split::fresh_rows(e[0].len(), t, &mut lse, |r, pr, lse| {
            let i = r % t; // the query's position: keys 0..=i
            let (sr, pr) = (&e[0][r * t..r * t + i + 1], &mut pr[..=i]);
            let max = sr.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            simd::exp_shifted(sr, max, 1.0, pr);
            let sum = pr.iter().fold(0f32, |a, &p| a + p);
            simd::scale(pr, 1.0 / sum);
            *lse = max + sum.ln();
        });
        let lead = &s.dims()[..s.rank() - 1];
        Ok((tensor(p, s.shape().clone())?, tensor(lse, lead)?))
    })
}

/// P = exp(s − lse) on and below the diagonal of s (..., T, T), zeros above: the forward's
/// probabilities rebuilt from its lse (..., T).
pub(crate) fn causal_probs(s: &Tensor, lse: &Tensor) -> Result<Tensor> {
    let t = square("causal probabilities", s)?;
    if lse.elem_count() * t != s.elem_count() {
        return Err(msg(format!(
            "causal probabilities: lse {:?} for scores {:?}",
            lse.dims(),
            s.dims()
        )));
    }
    with(&[s, lse], |e| {
        let p = split::fresh_each_row(e[0].len(), t, |r, pr| {
            let i = r % t;
            simd::exp_shifted(&e[0][r * t..r * t + i + 1], e[1][r], 1.0, &mut pr[..=i]);
        });
        tensor(p, s.shape().clone())
    })
}

/// The heads' gradients dq, dk, dv (B, H, T, D) as c_attn's output gradient (B, T, 3·H·D), in
/// one pass: each head's D values where the token's q | k | v of that head sit, dq and dk times
/// `scale` as candle's `x · scale + 0` (so the bits of `stack([dq·s, dk·s, dv])` merged).
pub(crate) fn tokens_grad(dq: &Tensor, dk: &Tensor, dv: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, h, t, d) = dq.dims4()?;
    same_dims("attention gradient", &[dq, dk, dv])?;
    let (c, s) = (h * d, scale as f32);
    with(&[dq, dk, dv], |e| {
        let out = split::fresh_each_row(b * t * 3 * c, 3 * c, |r, row| {
            let (bi, ti) = (r / t, r % t);
            for (j, part) in e.iter().enumerate() {
                for hh in 0..h {
                    let src = &part[((bi * h + hh) * t + ti) * d..][..d];
                    let dst = &mut row[j * c + hh * d..][..d];
                    match j {
                        2 => dst.copy_from_slice(src),
                        _ => dst.iter_mut().zip(src).for_each(|(o, &x)| *o = x * s + 0.0),
                    }
                }
            }
        });
        tensor(out, (b, t, 3 * c))
    })
}

/// dS = P ∘ (dP − δ) with δ = rowsum(dO ∘ O), for P, dP (..., T, T) and dO, O (..., T, D):
/// the softmax's backward in one pass over each row (zeros above the diagonal, where P is 0).
pub(crate) fn score_grad(p: &Tensor, dp: &Tensor, dy: &Tensor, y: &Tensor) -> Result<Tensor> {
    let t = square("attention dS", p)?;
    let d = y.dim(candle_core::D::Minus1)?;
    same_dims("attention dS", &[p, dp])?;
    same_dims("attention dS", &[dy, y])?;
    if y.elem_count() / d != p.elem_count() / t {
        return Err(msg(format!(
            "attention dS: output {:?} for scores {:?}",
            y.dims(),
            p.dims()
        )));
    }
    with(&[p, dp, dy, y], |e| {
        let ds = split::fresh_each_row(e[0].len(), t, |r, dsr| {
            let i = r % t;
            let (pr, dpr) = (&e[0][r * t..r * t + i + 1], &e[1][r * t..r * t + i + 1]);
            let (dyr, yr) = (&e[2][r * d..(r + 1) * d], &e[3][r * d..(r + 1) * d]);
            let delta: f32 = dyr.iter().zip(yr).map(|(a, b)| a * b).sum();
            dsr[..=i]
                .iter_mut()
                .zip(pr)
                .zip(dpr)
                .for_each(|((ds, &p), &dp)| *ds = p * (dp - delta));
        });
        tensor(ds, p.shape().clone())
    })
}

/// Per-row cross-entropy (N,) and natural lse (N,) of logits (N, V) against u32 targets (N,);
/// a target outside 0..V is an error naming it.
pub(crate) fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let (n, v) = logits.dims2()?;
    let ids = targets_of(targets, n, v)?;
    with(&[logits], |e| {
        let mut out = vec![(0f32, 0f32); n];
        split::row_stats(v, &mut out, |r, out| {
            let row = &e[0][r * v..(r + 1) * v];
            let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let sum: f32 = row.iter().map(|&x| exp(x - max)).sum();
            let l = max + sum.ln();
            *out = (l - row[ids[r] as usize], l);
        });
        let (loss, lse): (Vec<f32>, Vec<f32>) = out.into_iter().unzip();
        Ok((tensor(loss, n)?, tensor(lse, n)?))
    })
}

/// dlogits = (softmax − onehot(target)) · g per row written over the logits `x` (N·V, rows of
/// `v`), from the forward's lse and the per-row gradients g (N,).
pub(crate) fn cross_entropy_backward(
    x: &mut [f32],
    v: usize,
    targets: &Tensor,
    lse: &Tensor,
    g: &Tensor,
) -> Result<()> {
    let n = x.len() / v;
    let ids = targets_of(targets, n, v)?;
    if lse.elem_count() != n || g.elem_count() != n {
        return Err(msg(format!(
            "cross_entropy backward: lse {:?} and row gradients {:?} for logits ({n}, {v})",
            lse.dims(),
            g.dims(),
        )));
    }
    with(&[lse, g], |e| {
        split::each_row(x, v, |r, row| {
            let g = e[1][r];
            simd::exp_shifted_in_place(row, e[0][r], g);
            row[ids[r] as usize] -= g;
        });
        Ok(())
    })
}

/// The u32 targets (N,) for logits (N, V), each checked to be below V.
fn targets_of(targets: &Tensor, n: usize, v: usize) -> Result<Vec<u32>> {
    if targets.dims() != [n] || targets.dtype() != DType::U32 {
        return Err(msg(format!(
            "cross_entropy: targets {:?} {:?} must be u32 ({n},)",
            targets.dims(),
            targets.dtype()
        )));
    }
    let t = targets.contiguous()?;
    let e = Elems::of(&t)?;
    let ids = e.get::<u32>()?;
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= v) {
        return Err(msg(format!(
            "cross_entropy: target {bad} is outside the vocabulary of {v}"
        )));
    }
    Ok(ids.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The polynomial exp against libm's over the range the loops use.
    #[test]
    fn exp_is_within_a_few_ulp_of_libm() {
        let mut worst = 0f32;
        for i in 0..=200_000 {
            let x = -80.0 + 160.0 * i as f32 / 200_000.0;
            let (got, want) = (exp(x), x.exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 4.0 * f32::EPSILON, "worst relative error {worst:e}");
        assert_eq!(exp(-1000.0), (-87f32).exp());
    }

    /// Each loop against the candle ops of the same formula, on rows with a partial last
    /// vector and an offset view.
    #[test]
    fn loops_match_candle_ops() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 2f32, (7, 37), &dev)?;
        let dy = Tensor::randn(0f32, 1f32, (7, 37), &dev)?;
        let close = |a: &Tensor, b: &Tensor, what: &str| {
            let e = crate::testing::rel_err(a, b);
            assert!(e < 1e-5, "{what}: relative error {e:e}");
        };
        close(&gelu(&x)?, &x.gelu()?, "gelu");
        let w = Tensor::randn(1f32, 0.1f32, 37, &dev)?;
        let b = Tensor::randn(0f32, 0.1f32, 37, &dev)?;
        let (y, mean, rstd) = layer_norm(&x, &w, &b, 1e-5)?;
        let (y0, mean0, std0) = crate::plain::layer_norm_parts(&x, &w, &b, 1e-5)?;
        close(&y, &y0, "layer_norm");
        close(&mean, &mean0.squeeze(1)?, "mean");
        close(&rstd, &std0.recip()?.squeeze(1)?, "rstd");
        close(
            &residual_add(&x, &dy, &b)?,
            &(&x + dy.broadcast_add(&b)?)?,
            "residual",
        );
        let bits = |t: &Tensor| -> Result<Vec<u32>> {
            Ok(t.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
        };
        assert!(bits(&bias_add(&x, &b)?)? == bits(&x.broadcast_add(&b)?)?, "bias add");
        close(
            &row_sum(&dy.narrow(0, 2, 5)?)?,
            &dy.narrow(0, 2, 5)?.sum(0)?,
            "row sum",
        );
        let s = Tensor::randn(0f32, 3f32, (2, 5, 5), &dev)?;
        let (p, lse) = causal_softmax(&s)?;
        let masked = s.broadcast_add(&crate::plain::causal_mask(5, DType::F32, &dev)?)?;
        close(
            &p,
            &crate::plain::softmax_last_dim(&masked)?,
            "causal softmax",
        );
        close(&causal_probs(&s, &lse)?, &p, "probabilities from lse");
        Ok(())
    }

    /// Every loop gives the same bits on one thread as split over four (the split forced down
    /// to the smallest op), and in the baseline build as in the AVX2 one: rows, spans, column
    /// blocks and vector lanes change no arithmetic.
    #[test]
    fn a_split_changes_no_bit() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 2f32, (300, 37), &dev)?;
        let dy = Tensor::randn(0f32, 1f32, (300, 37), &dev)?;
        let w = Tensor::randn(1f32, 0.1f32, 37, &dev)?;
        let b = Tensor::randn(0f32, 0.1f32, 37, &dev)?;
        let s = Tensor::randn(0f32, 3f32, (3, 33, 33), &dev)?;
        let o = Tensor::randn(0f32, 1f32, (3, 33, 8), &dev)?;
        let logits = Tensor::randn(0f32, 2f32, (50, 77), &dev)?;
        let ids = Tensor::from_vec((0..50u32).map(|i| i * 3 % 77).collect(), 50, &dev)?;
        let all = || -> Result<Vec<Vec<u32>>> {
            let (y, mean, rstd) = layer_norm(&x, &w, &b, 1e-5)?;
            let (dx, dw, db) = layer_norm_backward(&x, &w, &dy, &mean, &rstd)?;
            let (p, lse) = causal_softmax(&s)?;
            let (loss, lse_ce) = cross_entropy(&logits, &ids)?;
            let outs = [
                gelu(&x)?,
                gelu_backward(&x, &dy)?,
                y,
                mean,
                rstd,
                dx,
                dw,
                db,
                residual_add(&x, &dy, &b)?,
                bias_add(&x, &b)?,
                row_sum(&dy)?,
                causal_probs(&s, &lse)?,
                score_grad(&p, &s, &o, &o)?,
                p,
                lse,
                crate::cross_entropy::backward_in_place(logits.copy()?, &ids, &lse_ce, &loss)?,
                loss,
                lse_ce,
            ];
            outs.iter()
                .map(|t| Ok(t.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect()))
                .collect()
        };
        let pool = |n| rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap();
        let before = split_min();
        set_split_min(0);
        let (one, four) = (pool(1).install(all), pool(4).install(all));
        set_split_min(before);
        let one = one?;
        assert!(one == four?, "an op's bits depend on the thread count");
        simd::force_baseline(true);
        let baseline = all();
        simd::force_baseline(false);
        assert!(one == baseline?, "the AVX2 build's bits differ from the baseline's");
        Ok(())
    }

    /// `exp`'s 2ⁿ from t's bits is the integer conversion's, bit for bit, over and past the
    /// clamped range.
    #[test]
    fn exp_scale_from_bits_is_the_conversion() {
        let by_conversion = |x: f32| {
            const ROUND: f32 = 12_582_912.0;
            let x = x.clamp(-87.0, 88.0);
            let n = (x * std::f32::consts::LOG2_E + ROUND) - ROUND;
            let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
            let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r
                + 4.166_579_6e-2)
                * r
                + 0.166_666_65)
                * r
                + 0.5;
            let e = r * r * p + r + 1.0;
            f32::from_bits(((n as i32 + 127) << 23) as u32) * e
        };
        let mut x = -100.0f32;
        while x < 100.0 {
            assert_eq!(exp(x).to_bits(), by_conversion(x).to_bits(), "e^{x}");
            x += 0.000_37;
        }
        for x in [-87.0f32, 88.0, -0.0, f32::MIN_POSITIVE, f32::MAX, f32::MIN] {
            assert_eq!(exp(x).to_bits(), by_conversion(x).to_bits(), "e^{x}");
        }
        assert!(exp(f32::NAN).is_nan());
    }

    /// Shapes that do not fit are errors that name them, not silently shortened loops.
    #[test]
    fn mismatched_shapes_are_errors() -> Result<()> {
        let dev = Device::Cpu;
        let z = |d: &[usize]| Tensor::zeros(d, DType::F32, &dev);
        let msg = |r: Result<Tensor>| r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg(gelu_backward(&z(&[4, 8])?, &z(&[4, 7])?)).contains("[4, 7]"));
        assert!(msg(causal_probs(&z(&[2, 5, 4])?, &z(&[2, 5])?)).contains("(..., T, T)"));
        let e = msg(score_grad(
            &z(&[2, 5, 5])?,
            &z(&[2, 5, 5])?,
            &z(&[3, 5, 8])?,
            &z(&[3, 5, 8])?,
        ));
        assert!(e.contains("[3, 5, 8]"), "{e}");
        let ids = Tensor::from_vec(vec![0u32, 9], 2, &dev)?;
        assert!(cross_entropy(&z(&[2, 4])?, &ids)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
            .contains("target 9"));
        Ok(())
    }
}
