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
use std::cell::RefCell;

use candle_core::{CpuStorage, InplaceOp1, Layout, Result, Tensor};

use super::AdamWHyper;
use crate::cpu::{tensor, with};
use crate::msg;

/// The per-element arithmetic of one step, its constants fixed.
#[derive(Clone, Copy)]
struct Rule {
    k: super::AdamWStep,
    /// `Some(1 − lr·wd)` where the tensor decays.
    decay: Option<f32>,
}

impl Rule {
    fn new(h: &AdamWHyper) -> Result<Self> {
        let k = h.constants()?;
        let decay = (h.weight_decay != 0.0).then_some(k.decay);
        Ok(Self { k, decay })
    }

    /// (p, m, v) after the step from their values before it and the gradient. The gradient is
    /// scaled even by 1 (`g · 1 + 0` differs from g only at −0, and every use of g,
    /// `g · (1 − β₁) + 0` and g², gives +0 for both zeros); the decay is not: a −0 weight would
    /// come out +0.
    #[inline(always)]
    fn apply(&self, p: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
        let k = &self.k;
        let decayed = match self.decay {
            Some(d) => p * d + 0.0,
            None => p,
        };
        let g = g * k.gscale + 0.0;
        let m = (m * k.beta1 + 0.0) + (g * k.one_m_b1 + 0.0);
        let v = (v * k.beta2 + 0.0) + (g * g * k.one_m_b2 + 0.0);
        let denom = (v * k.inv_bc2 + 0.0).sqrt() * 1.0 + k.eps;
        let update = (m * k.inv_bc1 + 0.0) / denom;
        (decayed - (update * k.lr + 0.0), m, v)
    }
}

/// Fresh vectors of `n` elements written element by element (no pass to zero them first):
/// `f(i, [a, b, c])` writes element i of each.
fn fresh3(n: usize, mut f: impl FnMut(usize, [&mut MaybeUninit<f32>; 3])) -> [Vec<f32>; 3] {
    let mut out: [Vec<f32>; 3] = std::array::from_fn(|_| Vec::with_capacity(n));
    {
        let [a, b, c] = &mut out;
        let outs = a.spare_capacity_mut()[..n]
            .iter_mut()
            .zip(&mut b.spare_capacity_mut()[..n])
            .zip(&mut c.spare_capacity_mut()[..n])
            .enumerate();
        outs.for_each(|(i, ((x, y), z))| f(i, [x, y, z]));
    }
    // SAFETY: the loop above wrote each of the first n elements of all three.
    out.iter_mut().for_each(|o| unsafe { o.set_len(n) });
    out
}

/// The new `(p, m, v)` (f32, `p`'s shape) from f32 CPU tensors `p`, `g` and the moments (None:
/// zero, the first step): [`super::plain_update`]'s result, bit for bit.
pub(super) fn update(
    p: &Tensor,
    g: &Tensor,
    m: Option<&Tensor>,
    v: Option<&Tensor>,
    h: &AdamWHyper,
) -> Result<(Tensor, Tensor, Tensor)> {
    let rule = Rule::new(h)?;
    let (m, v) = super::moments_or_zeros(p, m, v)?;
    with(&[p, g, &m, &v], |e| {
        let [np, nm, nv] = fresh3(e[0].len(), |i, [a, b, c]| {
            let (x, y, z) = rule.apply(e[0][i], e[1][i], e[2][i], e[3][i]);
            (a.write(x), b.write(y), c.write(z));
        });
        let shape = p.shape().clone();
        Ok((tensor(np, shape.clone())?, tensor(nm, shape.clone())?, tensor(nv, shape)?))
    })
}

/// One AdamW step on the CPU with `p`, `m` and `v` written in their own storage (a parameter's
/// variable, shared, and the optimizer's moments) and the moments `(m, v)` returned (fresh
/// zeros updated on the first step, None), the arithmetic and bits of [`super::step`]'s CPU loop;
/// `None`, nothing done, unless `p`, `g` and the moments are contiguous f32 CPU tensors of one
/// size. No fresh tensor is made and none is copied into the variable.
pub fn step_in_place_cpu(
    p: &Tensor,
    g: &Tensor,
    m: Option<&Tensor>,
    v: Option<&Tensor>,
    h: &AdamWHyper,
) -> Result<Option<(Tensor, Tensor)>> {
    let n = p.elem_count();
    let state = [m, v].into_iter().flatten().collect::<Vec<_>>();
    let takes = crate::cpu::takes(&[p, g])
        && crate::cpu::takes(&state)
        && p.is_contiguous()
        && state.iter().all(|t| t.is_contiguous())
        && g.elem_count() == n
        && state.iter().all(|t| t.elem_count() == n)
        && (m.is_some() == v.is_some());
    match takes {
        true => {
            // p, g, m, v read; p, m, v written (all of p's size, the moments f32 like p).
            let cost = crate::profile::Cost::elementwise(crate::profile::per_element("adamw"), p, &[p, g, p, p], &[p, p, p]);
            let mv = crate::profile::op(p.device(), || update_in_place(p, g, m, v, h), |_| ("adamw".into(), cost))?;
            Ok(Some(mv))
        }
        false => Ok(None),
    }
}

/// [`update`] with `p`, `m` and `v` written in their own storage (the parameter's variable, the
/// optimizer's moments), which it returns: no fresh tensor, and no copy of the parameter into
/// its variable. On the first step (None) the moments start as zeros of their own. `p`, `m`,
/// `v` must be contiguous f32 CPU tensors of one size, `g` an f32 CPU tensor of that size.
fn update_in_place(
    p: &Tensor,
    g: &Tensor,
    m: Option<&Tensor>,
    v: Option<&Tensor>,
    h: &AdamWHyper,
) -> Result<(Tensor, Tensor)> {
    let (m, v) = super::moments_or_zeros(p, m, v)?;
    let rule = Rule::new(h)?;
    // Each storage is borrowed mutably by candle's in-place op, the next one inside it.
    m.inplace_op1(&Slot::new(|m: &mut [f32]| {
        v.inplace_op1(&Slot::new(|v: &mut [f32]| {
            p.inplace_op1(&Slot::new(|p: &mut [f32]| {
                with(&[g], |e| {
                    let n = p.len();
                    if e[0].len() != n || m.len() != n || v.len() != n {
                        return Err(msg(format!(
                            "adamw in place: the gradient or a moment is not of {n} elements"
                        )));
                    }
                    for i in 0..n {
                        (p[i], m[i], v[i]) = rule.apply(p[i], e[0][i], m[i], v[i]);
                    }
                    Ok(())
                })
            }))
        }))
    }))?;
    Ok((m, v))
}

/// An in-place op that hands the contiguous f32 elements of its tensor to `f`, once.
struct Slot<F> {
    f: RefCell<Option<F>>,
}

impl<F: FnOnce(&mut [f32]) -> Result<()>> Slot<F> {
    fn new(f: F) -> Self {
        Self {
            f: RefCell::new(Some(f)),
        }
    }
}

impl<F: FnOnce(&mut [f32]) -> Result<()>> InplaceOp1 for Slot<F> {
    fn name(&self) -> &'static str {
        "adamw one pass in place"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| msg("adamw in place: a tensor is not contiguous".into()))?;
        let CpuStorage::F32(x) = storage else {
            return Err(msg("adamw in place: the tensors must be f32".into()));
        };
        let f = self.f.borrow_mut().take();
        let f = f.ok_or_else(|| msg("adamw in place: the op ran twice".into()))?;
        f(&mut x[start..end])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The one pass, fresh or in place, gives plain_update's bits: the first step and a later
    /// one, with and without weight decay and a gradient scale, zero gradients and weights of
    /// both signs included.
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
            // In place: the parameter's and the moments' own storage (copies here) take the
            // same bits.
            let var = candle_core::Var::from_tensor(&p)?;
            let (mc, vc) = (m.copy()?, v.copy()?);
            let (mm2, vv2) = match step {
                1 => (None, None),
                _ => (Some(&mc), Some(&vc)),
            };
            let (m2, v2) = update_in_place(var.as_tensor(), &g, mm2, vv2, &h)?;
            if step > 1 {
                assert_eq!(bits(&mc)?, bits(&want.1)?, "m is written in its own storage");
            }
            for (what, a, b) in [("p", var.as_tensor(), &want.0), ("m", &m2, &want.1), ("v", &v2, &want.2)] {
                assert!(bits(a)? == bits(b)?, "in place, step {step} wd {wd} scale {scale}: {what} differs");
            }
        }
        Ok(())
    }
}
