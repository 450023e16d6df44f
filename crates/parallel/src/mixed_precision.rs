//! Mixed precision: a bf16 compute copy of the weights, fp32 master weights that the optimizer
//! updates, and gradients reduced in fp32 (or bf16, configurable) — Micikevicius et al. (2018),
//! and the `MixedPrecision(param_dtype, reduce_dtype)` of PyTorch FSDP.
//!
//! ```text
//!   forward/backward   bf16 weights, bf16 activations, bf16 local gradients
//!   reduction          g.to(reduce_dtype) -> all-reduce / reduce-scatter   (f32 by default)
//!   optimizer          for each optimizer item (full tensor or flat ZeRO shard):
//!                        master_fp32 = AdamW(master_fp32, g.to(f32))      fp32 m, v keyed alike
//!                        compute_bf16 = master_fp32.to(bf16)              refreshed in place
//! ```
//!
//! On CUDA the three lines of the optimizer are one fused kernel per item
//! (`mtrain_kernels::adamw`): it reads the bf16 (or f32) gradient as it is, updates the
//! master, m and v, and writes the bf16 compute copy in the same pass; elsewhere the gradient is
//! widened to f32 and the copy cast, as written above, with the same numbers.
//!
//! One mechanism serves every strategy: [`MasterWeights`] holds an fp32 tensor under each
//! optimizer item's name (a parameter's name for DDP and tensor/pipeline/expert parallelism, a
//! shard piece's name under ZeRO), laid out exactly like AdamW's moments. So ZeRO shards the
//! masters as it shards `m` and `v`, and the per-parameter bytes read 2 (bf16 weight) + 2 (bf16
//! gradient) + 4 (master) + 8 (m, v) = 16, divided by whatever the stage shards. A strategy
//! builds the masters from the fp32 initial weights through the same slicing it applies to
//! optimizer moments, so every layout starts from the same fp32 numbers as one device; it gathers
//! them the same way for checkpoints, which therefore hold fp32 masters, layout-independent.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};
use mtrain_model::optim::{AdamW, GradScale, OptimItem};
use mtrain_model::Param;

/// A precision setting that cannot work, or a master weight that does not match.
#[derive(Debug, thiserror::Error)]
pub enum PrecisionError {
    #[error("invalid precision setting: {0}")]
    Config(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, PrecisionError>;

/// The dtypes of a mixed-precision run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MixedPrecision {
    /// Weights, activations and local gradients of forward and backward (F32 or BF16).
    pub param_dtype: DType,
    /// What gradients are reduced in over data, tensor and pipeline groups, and what the
    /// optimizer sees (F32 or BF16). Ignored when `param_dtype` is F32.
    pub reduce_dtype: DType,
}

impl Default for MixedPrecision {
    /// fp32 everywhere: no master copy.
    fn default() -> Self {
        Self {
            param_dtype: DType::F32,
            reduce_dtype: DType::F32,
        }
    }
}

impl MixedPrecision {
    /// bf16 compute with fp32 masters, gradients reduced in `reduce_dtype`.
    pub fn bf16(reduce_dtype: DType) -> Self {
        Self {
            param_dtype: DType::BF16,
            reduce_dtype,
        }
    }

    /// Whether the compute copy differs from the fp32 masters.
    pub fn is_mixed(&self) -> bool {
        self.param_dtype != DType::F32
    }

    /// The dtype gradients are reduced in: f32 without mixed precision.
    pub fn grad_reduce_dtype(&self) -> DType {
        match self.is_mixed() {
            true => self.reduce_dtype,
            false => DType::F32,
        }
    }

    /// Refuses dtypes other than F32 and BF16, naming the bad one.
    pub fn validate(&self) -> Result<()> {
        for (what, d) in [
            ("param dtype", self.param_dtype),
            ("gradient reduce dtype", self.reduce_dtype),
        ] {
            if !matches!(d, DType::F32 | DType::BF16) {
                return Err(PrecisionError::Config(format!(
                    "{what} must be f32 or bf16, got {d:?}"
                )));
            }
        }
        Ok(())
    }
}

/// `grads` cast to `dtype`, with zeros (in `dtype`) for every parameter of `params` that has
/// none: what a reduction sends, so every rank sends the same dtype for every tensor.
pub fn grads_for_reduction(
    params: &[Param],
    grads: &mut mtrain_model::Grads,
    dtype: DType,
) -> Result<()> {
    for p in params {
        let g = match grads.get(p.name()) {
            Some(g) if g.dtype() == dtype => continue,
            Some(g) => g.to_dtype(dtype)?,
            None => Tensor::zeros(p.shape(), dtype, p.var().device())?,
        };
        grads.insert(p.name(), g);
    }
    Ok(())
}

/// fp32 master weights keyed like the optimizer's state (see the module doc).
pub struct MasterWeights {
    masters: BTreeMap<String, Param>,
}

impl MasterWeights {
    /// fp32 copies of `tensors` (optimizer-item name -> this rank's part of the weight).
    pub fn new(tensors: BTreeMap<String, Tensor>) -> Result<Self> {
        let mut masters = BTreeMap::new();
        for (name, t) in tensors {
            let t = t.detach().to_dtype(DType::F32)?.copy()?;
            masters.insert(name.clone(), Param::new(name, t)?);
        }
        Ok(Self { masters })
    }

    /// The masters by item name (fp32, detached).
    pub fn tensors(&self) -> BTreeMap<String, Tensor> {
        self.masters
            .iter()
            .map(|(n, p)| (n.clone(), p.tensor().detach()))
            .collect()
    }

    /// Replaces every master from `tensors` (same names and shapes; cast to f32). A missing name
    /// or a different shape is an error naming it.
    pub fn load(&self, tensors: &BTreeMap<String, Tensor>) -> Result<()> {
        for (name, m) in &self.masters {
            let t = tensors.get(name).ok_or_else(|| {
                PrecisionError::Config(format!("no master weight named `{name}` to load"))
            })?;
            if t.dims() != m.shape().dims() {
                return Err(PrecisionError::Config(format!(
                    "master weight `{name}` has shape {:?} but this rank holds {:?}",
                    t.dims(),
                    m.shape().dims()
                )));
            }
            m.set(&t.to_device(m.var().device())?.to_dtype(DType::F32)?)?;
        }
        Ok(())
    }

    /// Bytes held by the masters.
    pub fn bytes(&self) -> usize {
        self.masters
            .values()
            .map(|p| p.elem_count() * DType::F32.size_in_bytes())
            .sum()
    }

    /// One AdamW step on the masters of `items` (gradients read as f32 and multiplied by
    /// `grad_scale`, the clip coefficient), then each item's compute parameter set to its
    /// master, cast to the parameter's dtype.
    pub fn step(
        &self,
        opt: &mut AdamW,
        lr: f64,
        grad_scale: impl Into<GradScale>,
        items: &[OptimItem],
    ) -> Result<()> {
        Self::step_all(&[self], opt, lr, grad_scale, items)
    }

    /// [`MasterWeights::step`] over masters spread across several holders (one per ZeRO stage
    /// chunk): one AdamW step, so the step count advances once.
    pub fn step_all(
        holders: &[&MasterWeights],
        opt: &mut AdamW,
        lr: f64,
        grad_scale: impl Into<GradScale>,
        items: &[OptimItem],
    ) -> Result<()> {
        let find = |name: &str| -> Result<&Param> {
            holders
                .iter()
                .find_map(|h| h.masters.get(name))
                .ok_or_else(|| {
                    PrecisionError::Config(format!(
                        "no fp32 master weight for optimizer item `{name}`"
                    ))
                })
        };
        let mut master_items = Vec::with_capacity(items.len());
        for it in items {
            // The gradient goes in as it is (bf16 or f32): AdamW reads it as f32.
            master_items.push(OptimItem {
                name: it.name,
                param: find(it.name)?,
                grad: it.grad,
                decay: it.decay,
            });
        }
        // The optimizer writes each updated master into its compute parameter, in that
        // parameter's dtype (in place from the fused kernel on CUDA, else a cast).
        let compute: Vec<&Param> = items.iter().map(|it| it.param).collect();
        opt.step_with_copies(lr, grad_scale, &master_items, Some(&compute))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use mtrain_model::optim::AdamWConfig;

    /// Values in [-2, 2) from a fixed sequence, so the test needs no random source.
    fn ramp(n: usize, phase: f32, dev: &Device) -> Result<Tensor> {
        let v: Vec<f32> = (0..n)
            .map(|i| (i as f32 * 0.37 + phase).sin() * 2.0)
            .collect();
        Ok(Tensor::from_vec(v, n, dev)?)
    }

    /// Three mixed-precision steps over masters split across two holders, with bf16 gradients,
    /// against AdamW run by hand on separate fp32 copies with the gradients cast to f32 first:
    /// the masters agree exactly, and every bf16 compute weight is its master rounded to bf16.
    #[test]
    fn mixed_step_equals_adamw_on_fp32_masters() -> Result<()> {
        let dev = Device::Cpu;
        let names = ["a.weight", "a.bias", "b.weight"];
        let sizes = [12usize, 3, 7];
        let init: Vec<Tensor> = sizes
            .iter()
            .enumerate()
            .map(|(k, &n)| ramp(n, k as f32, &dev))
            .collect::<Result<_>>()?;
        // Compute weights (bf16) and masters in two holders, as two ZeRO chunks would be.
        let compute: Vec<Param> = names
            .iter()
            .zip(&init)
            .map(|(n, t)| Ok(Param::new(*n, t.to_dtype(DType::BF16)?)?))
            .collect::<Result<_>>()?;
        let chunk = |range: std::ops::Range<usize>| {
            MasterWeights::new(
                range
                    .map(|k| (names[k].to_string(), init[k].clone()))
                    .collect(),
            )
        };
        let (first, second) = (chunk(0..2)?, chunk(2..3)?);
        // The reference: plain fp32 parameters and their own optimizer.
        let reference: Vec<Param> = names
            .iter()
            .zip(&init)
            .map(|(n, t)| Ok(Param::new(*n, t.clone())?))
            .collect::<Result<_>>()?;
        let cfg = AdamWConfig::default();
        let (mut opt, mut opt_ref) = (AdamW::new(cfg), AdamW::new(cfg));
        for step in 0..3 {
            let grads: Vec<Tensor> = sizes
                .iter()
                .map(|&n| Ok(ramp(n, 0.5 + step as f32, &dev)?.to_dtype(DType::BF16)?))
                .collect::<Result<_>>()?;
            let items: Vec<OptimItem> = (0..3)
                .map(|k| OptimItem {
                    name: names[k],
                    param: &compute[k],
                    grad: &grads[k],
                    decay: k != 1,
                })
                .collect();
            MasterWeights::step_all(&[&first, &second], &mut opt, 1e-2, 1.0, &items)?;
            let grads32: Vec<Tensor> = grads
                .iter()
                .map(|g| Ok(g.to_dtype(DType::F32)?))
                .collect::<Result<_>>()?;
            let ref_items: Vec<OptimItem> = (0..3)
                .map(|k| OptimItem {
                    name: names[k],
                    param: &reference[k],
                    grad: &grads32[k],
                    decay: k != 1,
                })
                .collect();
            opt_ref.step(1e-2, &ref_items)?;
        }
        let mut masters = first.tensors();
        masters.extend(second.tensors());
        for (k, name) in names.iter().enumerate() {
            let want = reference[k].tensor().to_vec1::<f32>()?;
            let master = masters[*name].to_vec1::<f32>()?;
            assert_eq!(master, want, "master `{name}`");
            let bf16 = compute[k].tensor();
            assert_eq!(bf16.dtype(), DType::BF16);
            assert_eq!(
                bf16.to_dtype(DType::F32)?.to_vec1::<f32>()?,
                masters[*name]
                    .to_dtype(DType::BF16)?
                    .to_dtype(DType::F32)?
                    .to_vec1::<f32>()?,
                "compute weight `{name}` is not its master rounded to bf16"
            );
            // Three steps of about lr moved every master away from its start.
            let start = init[k].to_vec1::<f32>()?;
            assert!(master.iter().zip(&start).all(|(a, b)| (a - b).abs() > 1e-3));
        }
        assert_eq!(opt.steps_taken(), 3);
        Ok(())
    }
}
