//! AdamW's update of one f32 tensor on the CPU in one pass over its elements: the arithmetic of
//! [`super::plain_update`]'s candle ops, element for element, so the bits are the same,
//! without their fourteen passes over the tensor and the fresh tensor each pass makes.
//!
//! ```text
//!   candle op (plain_update)        is, per element (f32)          here
//!   g · s, m · β₁, ...              affine map  x · c + 0          x * c + 0.0
//!   v / bc₂, m / bc₁                affine map  x · f32(1/c) + 0   x * (1/c) + 0.0
//!   √ + ε                           sqrt, then  x · 1 + ε          x.sqrt() * 1.0 + eps
//!   m + g·(1−β₁), decayed − u·lr    binary add / sub               + / −
//! ```
//!
//! The constants are [`AdamWHyper::constants`]': each the f64 expression rounded to f32 once, as
//! candle's affine map takes it.
//! The `+ 0` stays: it turns a −0 into +0, as the candle op does.

use std::mem::MaybeUninit;

use candle_core::{Result, Tensor};

use super::AdamWHyper;
use crate::cpu::{tensor, with};

/// The new `(p, m, v)` (f32, `p`'s shape) from f32 CPU tensors `p`, `g` and the moments (None:
/// zero, the first step): [`super::plain_update`]'s result, bit for bit.
pub(super) fn update(
    p: &Tensor,
    g: &Tensor,
    m: Option<&Tensor>,
    v: Option<&Tensor>,
    h: &AdamWHyper,
) -> Result<(Tensor, Tensor, Tensor)> {
    let k = h.constants()?;
    let decay = (h.weight_decay != 0.0).then_some(k.decay);
    let (b1, ob1, b2, ob2) = (k.beta1, k.one_m_b1, k.beta2, k.one_m_b2);
    let (ibc1, ibc2, eps, lr, s) = (k.inv_bc1, k.inv_bc2, k.eps, k.lr, k.gscale);
    let zeros;
    let (m, v) = match (m, v) {
        (Some(m), Some(v)) => (m, v),
        // Zero moments give the first step's bits: (0 · β + 0) + x is x for every x the
        // update makes (its `+ 0` leaves no −0).
        _ => {
            zeros = p.zeros_like()?;
            (&zeros, &zeros)
        }
    };
    // The gradient is scaled even by 1 (`g · 1 + 0` differs from g only at −0, and every use
    // of g, `g · (1 − β₁) + 0` and g², gives +0 for both zeros); the decay is not: a −0 weight
    // would come out +0.
    with(&[p, g, m, v], |e| {
        let n = e[0].len();
        // Written into spare capacity, element by element, then given their length: no pass
        // to zero them first.
        let (mut np, mut nm, mut nv) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
        let one = |i: usize, decayed: f32| {
            let g = e[1][i] * s + 0.0;
            let m = (e[2][i] * b1 + 0.0) + (g * ob1 + 0.0);
            let v = (e[3][i] * b2 + 0.0) + (g * g * ob2 + 0.0);
            let denom = (v * ibc2 + 0.0).sqrt() * 1.0 + eps;
            let update = (m * ibc1 + 0.0) / denom;
            (decayed - (update * lr + 0.0), m, v)
        };
        {
            let outs = np.spare_capacity_mut()[..n]
                .iter_mut()
                .zip(&mut nm.spare_capacity_mut()[..n])
                .zip(&mut nv.spare_capacity_mut()[..n])
                .enumerate();
            type Out<'a> = &'a mut MaybeUninit<f32>;
            let put = |i: usize, ((a, b), c): ((Out, Out), Out), d: f32| {
                let (x, y, z) = one(i, d);
                (a.write(x), b.write(y), c.write(z));
            };
            match decay {
                Some(d) => outs.for_each(|(i, o)| put(i, o, e[0][i] * d + 0.0)),
                None => outs.for_each(|(i, o)| put(i, o, e[0][i])),
            }
        }
        // SAFETY: the loop above wrote each of the first n elements of all three.
        unsafe {
            np.set_len(n);
            nm.set_len(n);
            nv.set_len(n);
        }
        let shape = p.shape().clone();
        Ok((
            tensor(np, shape.clone())?,
            tensor(nm, shape.clone())?,
            tensor(nv, shape)?,
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The one pass gives plain_update's bits: the first step and a later one, with and without
    /// weight decay and a gradient scale, zero gradients and weights of both signs included.
    #[test]
    fn one_pass_is_plain_update_bit_for_bit() -> Result<()> {
        let dev = Device::Cpu;
        let mut gv = Tensor::randn(0f32, 1e-2, 3001, &dev)?.to_vec1::<f32>()?;
        gv[..4].copy_from_slice(&[0.0, -0.0, 1e-30, -1e-30]);
        let g = Tensor::from_vec(gv, 3001, &dev)?;
        let mut pv = Tensor::randn(0f32, 0.02, 3001, &dev)?.to_vec1::<f32>()?;
        pv[..2].copy_from_slice(&[-0.0, 0.0]);
        let p = Tensor::from_vec(pv, 3001, &dev)?;
        let m = Tensor::randn(0f32, 1e-3, 3001, &dev)?;
        let v = (Tensor::randn(0f32, 1e-3, 3001, &dev)?.sqr()? + 1e-9)?;
        let bits = |t: &Tensor| -> Result<Vec<u32>> {
            Ok(t.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect())
        };
        for (step, wd, scale) in [(1, 0.1, 1.0), (1, 0.0, 0.37), (7, 0.1, 0.37), (200, 0.0, 1.0)] {
            let h = AdamWHyper {
                lr: 6e-4,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: wd,
                step,
                grad_scale: scale,
            };
            let (mm, vv) = match step {
                1 => (None, None),
                _ => (Some(&m), Some(&v)),
            };
            let want = super::super::plain_update(&p, &g, mm, vv, &h)?;
            let got = update(&p, &g, mm, vv, &h)?;
            for (what, a, b) in [("p", &got.0, &want.0), ("m", &got.1, &want.1), ("v", &got.2, &want.2)] {
                assert!(bits(a)? == bits(b)?, "step {step} wd {wd} scale {scale}: {what} differs");
            }
        }
        Ok(())
    }
}
