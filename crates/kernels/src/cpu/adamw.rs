//! AdamW's update of one f32 tensor on the CPU in one pass over its elements, with the arithmetic
//! of [`crate::adamw::plain_update`] (candle ops, one pass and one buffer each) element for
//! element, so the two give the same bits:
//!
//! ```text
//!   candle op                    as candle computes it in f32 (c = the f64 constant cast once)
//!   g·s (clip, s ≠ 1)            g·s + 0
//!   m·β1 + g·(1−β1)              (m·β1 + 0) + (g·(1−β1) + 0)      m absent: g·(1−β1) + 0
//!   v·β2 + g²·(1−β2)             (v·β2 + 0) + (g·g·(1−β2) + 0)    v absent: g·g·(1−β2) + 0
//!   √(v/bc2) + ε                 √(v·(1/bc2) + 0)·1 + ε
//!   (m/bc1) / denom              (m·(1/bc1) + 0) / denom
//!   p·(1−lr·wd) − update·lr      (p·(1−lr·wd) + 0) − (update·lr + 0)   wd = 0: p − (update·lr + 0)
//! ```
//!
//! (`x·c + 0` is candle's affine map; the `+ 0` turns a −0 into +0, so it is kept.)

use candle_core::{DType, Result, Tensor};

use crate::adamw::AdamWHyper;

/// Whether [`update`] takes these: `p` f32 on the CPU, `g` f32 or bf16 there with as many
/// elements, the moments (where given) f32 there with as many.
pub(crate) fn takes(p: &Tensor, g: &Tensor, m: Option<&Tensor>, v: Option<&Tensor>) -> bool {
    let n = p.elem_count();
    let f32_cpu = |t: &Tensor| super::takes(&[t]) && t.elem_count() == n;
    f32_cpu(p)
        && g.device().is_cpu()
        && matches!(g.dtype(), DType::F32 | DType::BF16)
        && g.elem_count() == n
        && m.into_iter().chain(v).all(f32_cpu)
}

/// The new `(p, m, v)`, all f32 in `p`'s shape, as [`crate::adamw::plain_update`] computes them;
/// the caller checked [`takes`].
pub(crate) fn update(
    p: &Tensor,
    g: &Tensor,
    m: Option<&Tensor>,
    v: Option<&Tensor>,
    h: &AdamWHyper,
) -> Result<(Tensor, Tensor, Tensor)> {
    let t = h.step as i32;
    let (b1, b2) = (h.beta1, h.beta2);
    let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
    let c = |x: f64| x as f32;
    let clip = (h.grad_scale != 1.0).then(|| c(h.grad_scale));
    let (beta1, one_m_b1, beta2, one_m_b2) = (c(b1), c(1.0 - b1), c(b2), c(1.0 - b2));
    let (inv_bc1, inv_bc2, eps, lr) = (c(1.0 / bc1), c(1.0 / bc2), c(h.eps), c(h.lr));
    let decay = (h.weight_decay != 0.0).then(|| c(1.0 - h.lr * h.weight_decay));
    let g = g.to_dtype(DType::F32)?;
    let mut ins: Vec<&Tensor> = vec![p, &g];
    ins.extend(m.into_iter().chain(v));
    let n = p.elem_count();
    let (mut np, mut nm, mut nv) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
    super::with(&ins, |xs| {
        let (ps, gs) = (xs[0], xs[1]);
        let (ms, vs) = match (m.is_some(), v.is_some()) {
            (true, true) => (Some(xs[2]), Some(xs[3])),
            (true, false) => (Some(xs[2]), None),
            (false, true) => (None, Some(xs[2])),
            (false, false) => (None, None),
        };
        for i in 0..n {
            let g = match clip {
                Some(s) => gs[i] * s + 0.0,
                None => gs[i],
            };
            let mi = match ms {
                Some(ms) => (ms[i] * beta1 + 0.0) + (g * one_m_b1 + 0.0),
                None => g * one_m_b1 + 0.0,
            };
            let g2 = g * g;
            let vi = match vs {
                Some(vs) => (vs[i] * beta2 + 0.0) + (g2 * one_m_b2 + 0.0),
                None => g2 * one_m_b2 + 0.0,
            };
            let denom = (vi * inv_bc2 + 0.0).sqrt() * 1.0 + eps;
            let step = (mi * inv_bc1 + 0.0) / denom;
            let kept = match decay {
                Some(d) => ps[i] * d + 0.0,
                None => ps[i],
            };
            (np[i], nm[i], nv[i]) = (kept - (step * lr + 0.0), mi, vi);
        }
        Ok(())
    })?;
    let shape = p.shape();
    Ok((
        Tensor::from_vec(np, shape, p.device())?,
        Tensor::from_vec(nm, shape, p.device())?,
        Tensor::from_vec(nv, shape, p.device())?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn bits(t: &Tensor) -> Vec<u32> {
        let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// The one-pass update gives plain_update's bits: first and later steps, with and without
    /// decay and clipping, an f32 and a bf16 gradient, zeros of both signs among the values.
    #[test]
    fn one_pass_is_plain_update_bit_for_bit() -> Result<()> {
        let dev = Device::Cpu;
        let n = 4099;
        let signed_zeros = |t: Tensor| -> Result<Tensor> {
            let mut v = t.to_vec1::<f32>()?;
            for (i, x) in v.iter_mut().enumerate().step_by(97) {
                *x = if i % 2 == 0 { 0.0 } else { -0.0 };
            }
            Tensor::from_vec(v, n, &dev)
        };
        let p = signed_zeros(Tensor::randn(0f32, 1.0, n, &dev)?)?;
        let g = signed_zeros(Tensor::randn(0f32, 1e-2, n, &dev)?)?;
        let m = signed_zeros(Tensor::randn(0f32, 1e-3, n, &dev)?)?;
        let v = signed_zeros(Tensor::randn(0f32, 1e-3, n, &dev)?.abs()?)?;
        for (step, wd, clip, bf16, moments) in [
            (1, 0.1, 1.0, false, false),
            (7, 0.1, 0.37, false, true),
            (3, 0.0, 1.0, true, true),
            (2, 0.0, 0.5, true, false),
        ] {
            let h = AdamWHyper {
                lr: 6e-4,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: wd,
                step,
                grad_scale: clip,
            };
            let g = if bf16 {
                g.to_dtype(DType::BF16)?
            } else {
                g.clone()
            };
            let (m, v) = if moments {
                (Some(&m), Some(&v))
            } else {
                (None, None)
            };
            assert!(takes(&p, &g, m, v));
            let want = crate::adamw::plain_update(&p, &g, m, v, &h)?;
            let got = update(&p, &g, m, v, &h)?;
            assert_eq!(bits(&got.0), bits(&want.0), "p at step {step}");
            assert_eq!(bits(&got.1), bits(&want.1), "m at step {step}");
            assert_eq!(bits(&got.2), bits(&want.2), "v at step {step}");
        }
        Ok(())
    }
}
