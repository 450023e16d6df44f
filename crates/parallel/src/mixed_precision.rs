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
use mtrain_model::optim::{AdamW, OptimItem};
use mtrain_model::Param;

use crate::ddp::{DpError, Result};

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
                return Err(DpError::Config(format!(
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
                DpError::Config(format!("no master weight named `{name}` to load"))
            })?;
            if t.dims() != m.shape().dims() {
                return Err(DpError::Config(format!(
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

    /// One AdamW step on the masters of `items` (gradients cast to f32), then each item's
    /// compute parameter set to its master, cast to the parameter's dtype.
    pub fn step(&self, opt: &mut AdamW, lr: f64, items: &[OptimItem]) -> Result<()> {
        Self::step_all(&[self], opt, lr, items)
    }

    /// [`MasterWeights::step`] over masters spread across several holders (one per ZeRO stage
    /// chunk): one AdamW step, so the step count advances once.
    pub fn step_all(
        holders: &[&MasterWeights],
        opt: &mut AdamW,
        lr: f64,
        items: &[OptimItem],
    ) -> Result<()> {
        let find = |name: &str| -> Result<&Param> {
            holders
                .iter()
                .find_map(|h| h.masters.get(name))
                .ok_or_else(|| {
                    DpError::Config(format!("no fp32 master weight for optimizer item `{name}`"))
                })
        };
        let mut grads = Vec::with_capacity(items.len());
        for it in items {
            grads.push(it.grad.to_dtype(DType::F32)?);
        }
        let mut master_items = Vec::with_capacity(items.len());
        for (it, g) in items.iter().zip(&grads) {
            master_items.push(OptimItem {
                name: it.name,
                param: find(it.name)?,
                grad: g,
                decay: it.decay,
            });
        }
        opt.step(lr, &master_items)?;
        for (it, m) in items.iter().zip(&master_items) {
            let w = m.param.tensor().detach().to_dtype(it.param.var().dtype())?;
            it.param.set(&w)?;
        }
        Ok(())
    }
}
