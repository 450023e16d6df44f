//! AdamW with decoupled weight decay, the warmup + cosine learning-rate schedule, and global-norm
//! clipping.
//!
//! One step for a parameter `p` with gradient `g` (Loshchilov & Hutter 2019, as `torch.optim.AdamW`):
//!
//! ```text
//! t  = t + 1
//! m  = β1·m + (1-β1)·g                    first moment
//! v  = β2·v + (1-β2)·g²                   second moment
//! m̂  = m / (1-β1ᵗ)      v̂ = v / (1-β2ᵗ)    bias correction
//! p  = p·(1 - lr·wd)  -  lr · m̂ / (√v̂ + ε)  decay is applied to p directly, not mixed into g
//! ```
//!
//! On CUDA the whole step is one kernel over every tensor ([`mtrain_kernels::adamw::step_in_place`]):
//! it reads p, g, m, v once and writes p, m, v (and, for mixed precision, the bf16 compute copy)
//! back into their own storage; everywhere else each tensor's update is
//! [`mtrain_kernels::adamw::step`], the same formulas as candle ops.
//!
//! The optimizer is shape-agnostic: it keeps `m` and `v` by name, elementwise, so a sharded strategy
//! can hand it flat 1-D shards instead of full tensors. Whether a tensor is decayed therefore comes
//! from the caller ([`OptimItem::decay`]); nanoGPT decays only the ≥2-D weights (matmuls and
//! embeddings), never biases and LayerNorm gains.
//!
//! Learning rate ([`lr_at`]), as nanoGPT:
//!
//! ```text
//! lr │   ╱‾‾‾‾‾‾‾‾╲__
//!    │  ╱            ‾‾╲__
//!    │ ╱                  ‾‾‾‾───── min_lr
//!    └┴───────┴──────────────────┴── step
//!     0    warmup            total_steps
//! ```

use std::collections::BTreeMap;

use candle_core::{DType, Result, Tensor};

use crate::param::Param;
use mtrain_kernels::adamw::{self, AdamWHyper};

/// AdamW hyper-parameters (the learning rate is passed per step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Decay of the first-moment average.
    pub beta1: f64,
    /// Decay of the second-moment average.
    pub beta2: f64,
    /// Added to √v̂ to keep the update finite.
    pub eps: f64,
    /// Decoupled weight decay, applied to items with `decay: true`.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    /// nanoGPT's GPT-2 settings: β = (0.9, 0.95), ε = 1e-8, weight decay 0.1.
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

/// One tensor to update: its state key, the parameter, its gradient and whether it is decayed.
pub struct OptimItem<'a> {
    /// Key of the `m`/`v` state (the parameter name, or a shard's name).
    pub name: &'a str,
    /// The parameter, updated in place with [`Param::set`].
    pub param: &'a Param,
    /// Its gradient, same element count and shape as the parameter.
    pub grad: &'a Tensor,
    /// Apply weight decay to this tensor.
    pub decay: bool,
}

/// The optimizer's state, by name, for checkpoints.
#[derive(Debug, Clone)]
pub struct AdamWState {
    /// Steps taken (t in the bias correction).
    pub step: u64,
    /// First moments.
    pub m: BTreeMap<String, Tensor>,
    /// Second moments.
    pub v: BTreeMap<String, Tensor>,
}

/// AdamW over named tensors.
pub struct AdamW {
    cfg: AdamWConfig,
    step: u64,
    m: BTreeMap<String, Tensor>,
    v: BTreeMap<String, Tensor>,
}

impl AdamW {
    /// A fresh optimizer (zero moments, step 0).
    pub fn new(cfg: AdamWConfig) -> Self {
        Self {
            cfg,
            step: 0,
            m: BTreeMap::new(),
            v: BTreeMap::new(),
        }
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }

    /// Steps taken so far.
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// One AdamW step with learning rate `lr` over `items` (moments start at zero on first sight).
    pub fn step(&mut self, lr: f64, items: &[OptimItem]) -> Result<()> {
        self.step_with_copies(lr, 1.0, items, None)
    }

    /// [`AdamW::step`] with every gradient multiplied by `grad_scale` (the clip coefficient, 1
    /// for none) inside the update, and, with `copies` (one per item), each updated parameter
    /// written into `copies[k]` in that parameter's own dtype: the compute copy of
    /// mixed-precision training.
    ///
    /// Where every item is what [`adamw::fuses_in_place`] takes (CUDA f32 parameters and
    /// moments, gradients all f32 or all bf16, bf16 copies), the whole step is one kernel that
    /// updates parameters, moments and copies in their own storage. Otherwise each item takes
    /// [`adamw::step`] (one fused kernel per tensor where [`adamw::fuses`] says so, candle ops
    /// elsewhere) and its copy is set from the kernel's bf16 output or a cast. The gradient may
    /// be in any float dtype: it is read as f32.
    pub fn step_with_copies(
        &mut self,
        lr: f64,
        grad_scale: impl Into<GradScale>,
        items: &[OptimItem],
        copies: Option<&[&Param]>,
    ) -> Result<()> {
        let grad_scale = grad_scale.into();
        if let Some(c) = copies {
            if c.len() != items.len() {
                candle_core::bail!(
                    "AdamW: {} compute copies for {} parameters",
                    c.len(),
                    items.len()
                );
            }
        }
        for it in items {
            if *it.grad.shape() != it.param.shape() {
                candle_core::bail!(
                    "AdamW: gradient of `{}` has shape {:?} but the parameter has {:?}",
                    it.name,
                    it.grad.dims(),
                    it.param.shape().dims()
                );
            }
        }
        self.step += 1;
        let (cfg, step) = (self.cfg, self.step);
        let hyper = |decay: bool, grad_scale: f64| AdamWHyper {
            lr,
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.eps,
            weight_decay: if decay { cfg.weight_decay } else { 0.0 },
            step,
            grad_scale,
        };
        let (host_scale, device_scale) = match &grad_scale {
            GradScale::By(x) => (*x, None),
            GradScale::OnDevice(t) => (1.0, Some(t)),
        };
        if self.step_in_place(items, copies, &hyper(false, host_scale), device_scale)? {
            return Ok(());
        }
        // The paths below take the scale as a number: a device one is read back here.
        let grad_scale = grad_scale.value()?;
        // Each tensor's update is independent of the others: on the CPU they are spread over
        // the compute pool (`mtrain_kernels::each_tensor`), each computed as it would be alone
        // and stored as soon as it is done, so no more than one new tensor per worker is alive
        // beside the old state (in order on one thread, as a plain loop).
        let jobs: Vec<(&OptimItem, Option<&Param>)> = items
            .iter()
            .enumerate()
            .map(|(k, it)| (it, copies.map(|c| c[k])))
            .collect();
        let moments = std::sync::Mutex::new((&mut self.m, &mut self.v));
        let moments_of = |name: &str| {
            let mv = moments.lock().expect("the moments' lock");
            (mv.0.get(name).cloned(), mv.1.get(name).cloned())
        };
        mtrain_kernels::each_tensor(
            &jobs,
            |(it, _)| it.grad, // the parameter's device and size
            |&(it, copy)| {
                let (m, v) = moments_of(it.name);
                let h = hyper(it.decay, grad_scale);
                // On the CPU, without a compute copy, the parameter's and the moments' own
                // storage are written in place.
                let in_place = match copy {
                    None => {
                        let p = it.param.tensor();
                        adamw::step_in_place_cpu(&p, it.grad, m.as_ref(), v.as_ref(), &h)?
                    }
                    Some(_) => None,
                };
                let (m, v) = match in_place {
                    Some(mv) => mv,
                    None => {
                        let (p, g) = (it.param.tensor().detach(), it.grad.detach());
                        let dtype = copy.map(|c| c.var().dtype());
                        let out = adamw::step(&p, &g, m.as_ref(), v.as_ref(), &h, dtype)?;
                        it.param.set(&out.p)?;
                        if let Some(c) = copy {
                            match out.copy {
                                Some(w) if w.dtype() == c.var().dtype() => c.set(&w)?,
                                _ => c.set(&out.p.to_dtype(c.var().dtype())?)?,
                            }
                        }
                        (out.m, out.v)
                    }
                };
                let mut mv = moments.lock().expect("the moments' lock");
                mv.0.insert(it.name.to_string(), m);
                mv.1.insert(it.name.to_string(), v);
                Ok(())
            },
        )?;
        Ok(())
    }

    /// The whole step as one in-place kernel ([`adamw::step_in_place`]) when every item takes
    /// it; false (nothing done) otherwise. Moments seen for the first time start as zeros.
    fn step_in_place(
        &mut self,
        items: &[OptimItem],
        copies: Option<&[&Param]>,
        h: &AdamWHyper,
        scale: Option<&Tensor>,
    ) -> Result<bool> {
        let params: Vec<Tensor> = items.iter().map(|it| it.param.tensor()).collect();
        let targets: Option<Vec<Tensor>> = copies.map(|c| c.iter().map(|p| p.tensor()).collect());
        let zeros = |p: &Tensor| Tensor::zeros(p.shape(), DType::F32, p.device());
        let probe: Vec<adamw::InPlace> = items
            .iter()
            .zip(&params)
            .enumerate()
            .map(|(k, (it, p))| adamw::InPlace {
                p,
                g: it.grad,
                m: p,
                v: p,
                copy: targets.as_ref().map(|t| &t[k]),
                weight_decay: 0.0,
            })
            .collect();
        if !adamw::fuses_in_place(&probe) {
            return Ok(false);
        }
        for (it, p) in items.iter().zip(&params) {
            if !self.m.contains_key(it.name) {
                self.m.insert(it.name.to_string(), zeros(p)?);
                self.v.insert(it.name.to_string(), zeros(p)?);
            }
        }
        let launch: Vec<adamw::InPlace> = probe
            .iter()
            .zip(items)
            .map(|(t, it)| adamw::InPlace {
                m: &self.m[it.name],
                v: &self.v[it.name],
                weight_decay: if it.decay { self.cfg.weight_decay } else { 0.0 },
                ..*t
            })
            .collect();
        if !adamw::fuses_in_place(&launch) {
            return Ok(false); // a moment loaded in another dtype or layout
        }
        // SAFETY: the parameters and copies are `Var`s (which `Param::set` overwrites the same
        // way), and the moments are this optimizer's alone: `state` and `load_state` copy them.
        unsafe { adamw::step_in_place(&launch, h, scale)? };
        Ok(true)
    }

    /// A copy of the state (the moments are copied: the optimizer updates its own in place).
    pub fn state(&self) -> Result<AdamWState> {
        let copy = |m: &BTreeMap<String, Tensor>| {
            m.iter()
                .map(|(k, t)| Ok((k.clone(), t.copy()?)))
                .collect::<Result<BTreeMap<_, _>>>()
        };
        Ok(AdamWState {
            step: self.step,
            m: copy(&self.m)?,
            v: copy(&self.v)?,
        })
    }

    /// Replaces the state, e.g. from a checkpoint. Every `m` needs its `v` and vice versa. The
    /// moments are copied, so the caller's tensors never change.
    pub fn load_state(&mut self, state: AdamWState) -> Result<()> {
        for name in state.m.keys().chain(state.v.keys()) {
            let (m, v) = (state.m.get(name), state.v.get(name));
            match (m, v) {
                (Some(m), Some(v)) if m.shape() == v.shape() => {}
                (Some(m), Some(v)) => candle_core::bail!(
                    "AdamW state for `{name}`: m has shape {:?} but v has {:?}",
                    m.dims(),
                    v.dims()
                ),
                _ => candle_core::bail!("AdamW state for `{name}` has only one of m and v"),
            }
        }
        let copy = |m: BTreeMap<String, Tensor>| {
            m.into_iter()
                .map(|(k, t)| Ok((k, t.copy()?)))
                .collect::<Result<BTreeMap<_, _>>>()
        };
        self.step = state.step;
        self.m = copy(state.m)?;
        self.v = copy(state.v)?;
        Ok(())
    }

    /// The first and second moment of item `name`, as the optimizer holds them (no copy);
    /// None before its first step.
    pub fn moments(&self, name: &str) -> Option<(&Tensor, &Tensor)> {
        Some((self.m.get(name)?, self.v.get(name)?))
    }

    /// Replaces the state with `state`'s moments as they are, without a copy: the optimizer
    /// updates them in place afterwards, so they must be tensors nothing else shares (freshly
    /// read from a checkpoint). Every `m` needs its `v` of the same shape.
    pub fn load_state_owned(&mut self, state: AdamWState) -> Result<()> {
        for name in state.m.keys().chain(state.v.keys()) {
            match (state.m.get(name), state.v.get(name)) {
                (Some(m), Some(v)) if m.shape() == v.shape() => {}
                _ => candle_core::bail!("AdamW state for `{name}` lacks m or v of one shape"),
            }
        }
        self.step = state.step;
        self.m = state.m;
        self.v = state.v;
        Ok(())
    }

    /// Bytes held by the moments.
    pub fn state_bytes(&self) -> usize {
        self.m
            .values()
            .chain(self.v.values())
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }
}

/// The learning-rate schedule: linear warmup, then cosine decay to `min_lr` at `total_steps`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// Peak learning rate, reached at the end of warmup.
    pub lr: f64,
    /// Floor reached at `total_steps` and kept afterwards.
    pub min_lr: f64,
    /// Steps of linear warmup.
    pub warmup_steps: u64,
    /// Step at which the cosine reaches `min_lr`.
    pub total_steps: u64,
}

/// Learning rate for 0-based `step`: `lr·(step+1)/(warmup+1)` during warmup, then
/// `min_lr + ½(1 + cos(π·r))·(lr - min_lr)` with `r = (step - warmup)/(total - warmup)`.
pub fn lr_at(step: u64, s: &LrSchedule) -> f64 {
    if step < s.warmup_steps {
        return s.lr * (step + 1) as f64 / (s.warmup_steps + 1) as f64;
    }
    if step >= s.total_steps || s.total_steps <= s.warmup_steps {
        return s.min_lr;
    }
    let r = (step - s.warmup_steps) as f64 / (s.total_steps - s.warmup_steps) as f64;
    s.min_lr + 0.5 * (1.0 + (std::f64::consts::PI * r).cos()) * (s.lr - s.min_lr)
}

pub use mtrain_kernels::adamw::{clip_coef, clip_coef_on_device};

/// What every gradient is multiplied by inside an AdamW step: the clip coefficient.
#[derive(Debug, Clone)]
pub enum GradScale {
    /// A number the host holds (1: none).
    By(f64),
    /// One f32 on the parameters' device that the host has not read
    /// ([`clip_coef_on_device`]): the one-launch step on CUDA reads it there, so the step is
    /// queued without waiting for the norm; every other path reads it back first.
    OnDevice(Tensor),
}

impl From<f64> for GradScale {
    fn from(x: f64) -> Self {
        Self::By(x)
    }
}

impl GradScale {
    /// The factor as a number (a device one read back).
    pub fn value(&self) -> Result<f64> {
        match self {
            Self::By(x) => Ok(*x),
            Self::OnDevice(t) => Ok(t.flatten_all()?.to_vec1::<f32>()?[0] as f64),
        }
    }
}

/// Σ x² over `tensors`, in f64 (a sharded strategy all-reduces this before taking the root),
/// with one read-back for all of them ([`mtrain_kernels::reduce::sq_sum_f64_all`]).
pub fn sq_norm<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> Result<f64> {
    mtrain_kernels::reduce::sq_sum_f64_all(tensors)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Two steps of AdamW on a 2-element parameter, against the formulas evaluated by hand in f64.
    #[test]
    fn two_steps_match_a_hand_computation() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let p = Param::new("w", Tensor::new(&[1.0f32, -2.0], &dev)?)?;
        let b = Param::new("b", Tensor::new(&[0.5f32], &dev)?)?;
        let mut opt = AdamW::new(cfg);
        let lr = 0.01;
        let grads = [[0.5f64, -1.0], [0.25, 2.0]];
        let bgrads = [0.3f64, -0.6];
        for s in 0..2 {
            let g = Tensor::new(&[grads[s][0] as f32, grads[s][1] as f32], &dev)?;
            let gb = Tensor::new(&[bgrads[s] as f32], &dev)?;
            opt.step(
                lr,
                &[
                    OptimItem {
                        name: "w",
                        param: &p,
                        grad: &g,
                        decay: true,
                    },
                    OptimItem {
                        name: "b",
                        param: &b,
                        grad: &gb,
                        decay: false,
                    },
                ],
            )?;
        }
        // Hand computation, element by element.
        let adam = |p0: f64, g: [f64; 2], decay: bool| {
            let (mut p, mut m, mut v) = (p0, 0.0, 0.0);
            for (t, g) in g.iter().enumerate() {
                let t = t as i32 + 1;
                m = 0.9 * m + 0.1 * g;
                v = 0.99 * v + 0.01 * g * g;
                let mh = m / (1.0 - 0.9f64.powi(t));
                let vh = v / (1.0 - 0.99f64.powi(t));
                if decay {
                    p *= 1.0 - lr * 0.1;
                }
                p -= lr * mh / (vh.sqrt() + 1e-8);
            }
            p
        };
        let want_w = [
            adam(1.0, [grads[0][0], grads[1][0]], true),
            adam(-2.0, [grads[0][1], grads[1][1]], true),
        ];
        let want_b = adam(0.5, bgrads, false);
        let got_w = p.tensor().to_vec1::<f32>()?;
        let got_b = b.tensor().to_vec1::<f32>()?;
        for (g, w) in got_w.iter().zip(want_w) {
            assert!((*g as f64 - w).abs() < 1e-6, "got {g}, want {w}");
        }
        assert!(
            (got_b[0] as f64 - want_b).abs() < 1e-6,
            "got {}, want {want_b}",
            got_b[0]
        );
        // Sanity of the hand formula itself: with a constant gradient m̂/√v̂ = 1, so each step moves by lr.
        assert!((adam(0.0, [0.5, 0.5], false) + 0.02).abs() < 1e-9);
        assert_eq!(opt.steps_taken(), 2);
        Ok(())
    }

    #[test]
    fn state_round_trips_and_continues_identically() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = AdamWConfig::default();
        let g = Tensor::new(&[0.1f32, -0.2, 0.3], &dev)?;
        let run = |resume: bool| -> Result<Vec<f32>> {
            let p = Param::new("p", Tensor::new(&[1f32, 2., 3.], &dev)?)?;
            let mut opt = AdamW::new(cfg);
            opt.step(
                1e-2,
                &[OptimItem {
                    name: "p",
                    param: &p,
                    grad: &g,
                    decay: true,
                }],
            )?;
            if resume {
                let st = opt.state()?;
                opt = AdamW::new(cfg);
                opt.load_state(st)?;
            }
            opt.step(
                1e-2,
                &[OptimItem {
                    name: "p",
                    param: &p,
                    grad: &g,
                    decay: true,
                }],
            )?;
            p.tensor().to_vec1::<f32>()
        };
        assert_eq!(run(false)?, run(true)?);
        Ok(())
    }

    #[test]
    fn lr_schedule_values() {
        let s = LrSchedule {
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 10,
            total_steps: 110,
        };
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(lr_at(0, &s), 1e-3 / 11.0));
        assert!(close(lr_at(9, &s), 1e-3 * 10.0 / 11.0));
        assert!(close(lr_at(10, &s), 1e-3)); // cos(0) = 1: the peak
        assert!(close(lr_at(60, &s), 5.5e-4)); // halfway: the mean of lr and min_lr
        assert!(close(lr_at(110, &s), 1e-4));
        assert!(close(lr_at(500, &s), 1e-4));
        for k in 10..110 {
            assert!(
                lr_at(k + 1, &s) <= lr_at(k, &s),
                "cosine must not increase at step {k}"
            );
        }
    }

    #[test]
    fn clipping_coefficient() {
        assert_eq!(clip_coef(0.5, 1.0), 1.0);
        assert!((clip_coef(4.0, 1.0) - 1.0 / (4.0 + 1e-6)).abs() < 1e-15);
        assert_eq!(clip_coef(100.0, 0.0), 1.0);
    }

    /// `step_with_copies` on the CPU: the parameters move exactly as with `step`, and each copy
    /// holds the updated parameter cast to its own dtype (bf16 here).
    #[test]
    fn copies_are_the_updated_parameters_cast() -> Result<()> {
        let dev = Device::Cpu;
        let cfg = AdamWConfig::default();
        let g = Tensor::new(&[0.1f32, -0.2, 0.3], &dev)?;
        let gb = Tensor::new(&[0.05f32], &dev)?.to_dtype(DType::BF16)?;
        let run = |copies: bool| -> Result<(Vec<Param>, Vec<Param>)> {
            let p = Param::new("p", Tensor::new(&[1f32, 2., 3.], &dev)?)?;
            let b = Param::new("b", Tensor::new(&[0.5f32], &dev)?)?;
            let out = vec![
                Param::new("p16", Tensor::zeros(3, DType::BF16, &dev)?)?,
                Param::new("b16", Tensor::zeros(1, DType::BF16, &dev)?)?,
            ];
            let mut opt = AdamW::new(cfg);
            for _ in 0..2 {
                let items = [
                    OptimItem {
                        name: "p",
                        param: &p,
                        grad: &g,
                        decay: true,
                    },
                    OptimItem {
                        name: "b",
                        param: &b,
                        grad: &gb,
                        decay: false,
                    },
                ];
                match copies {
                    true => opt.step_with_copies(1e-2, 1.0, &items, Some(&[&out[0], &out[1]]))?,
                    false => opt.step(1e-2, &items)?,
                }
            }
            Ok((vec![p, b], out))
        };
        let (with, copies) = run(true)?;
        let (without, _) = run(false)?;
        assert_eq!(copies.len(), 2);
        for ((a, b), c) in with.iter().zip(&without).zip(&copies) {
            let a = a.tensor();
            assert_eq!(a.to_vec1::<f32>()?, b.tensor().to_vec1::<f32>()?);
            let c = c.tensor();
            assert_eq!(c.dtype(), DType::BF16);
            assert_eq!(
                c.to_dtype(DType::F32)?.to_vec1::<f32>()?,
                a.to_dtype(DType::BF16)?
                    .to_dtype(DType::F32)?
                    .to_vec1::<f32>()?
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod device_scale_tests;

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests;
