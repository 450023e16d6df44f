//! The API every data-parallel strategy offers on its own (DDP, ZeRO, expert data parallelism;
//! the trainer drives their composition, [`crate::runtime::ParallelModel`]), its error type,
//! and the check that the replicas start from the same weights.
//!
//! The API in one picture:
//!
//! ```text
//!   for micro-step k in 0..K:   loss_k = dp.forward_backward(engine, x_k, y_k, 1/K, sync = k == K-1)
//!   norm² = dp.grad_norm_sq()                         one all-reduce
//!   dp.scaled_step(&mut adamw, lr, clip_coef(norm, max_norm))
//!            = adamw.step(optimizer_items, gradients × clip coefficient) -> after_optimizer_step
//!   (dp.optimizer_step(&mut adamw, lr, Some(max_norm)) does both and returns the norm)
//! ```

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};
use mtrain_comm::{Comm, CommError};
use mtrain_model::optim::{AdamW, AdamWState, OptimItem};
use mtrain_model::{Engine, Param};

use crate::mixed_precision::{MasterWeights, PrecisionError};
use crate::toolbox::{clipped_step, sum_f64, CommStats, ModelStateBytes, StateError};

/// Errors of the data-parallel strategies.
#[derive(Debug, thiserror::Error)]
pub enum DpError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(
        "rank {rank} initialised parameter '{name}' differently from rank 0 \
         (checksum {theirs} vs {ours}); every rank must build the model from the same seed"
    )]
    InitMismatch {
        rank: usize,
        name: String,
        ours: String,
        theirs: String,
    },
    #[error("rank {rank} has {theirs} parameters but rank 0 has {ours}; every rank must build the same model")]
    ParamCountMismatch {
        rank: usize,
        ours: usize,
        theirs: usize,
    },
    #[error("invalid data-parallel setting: {0}")]
    Config(String),
    #[error(transparent)]
    State(#[from] StateError),
    #[error(transparent)]
    Precision(#[from] PrecisionError),
}

pub type Result<T> = std::result::Result<T, DpError>;

/// The API a data-parallel strategy offers the training loop (DDP and FSDP/ZeRO alike):
///
/// ```text
///   for micro-step k in 0..K:  loss_k = dp.forward_backward(engine, x_k, y_k, 1/K, sync = k == K-1)
///   dp.optimizer_step(&mut adamw, lr, Some(max_norm))      // = clip + optimizer_items + after_optimizer_step
/// ```
pub trait DataParallel {
    /// Forward and backward of this rank's micro-batch; gradients accumulate until the optimizer
    /// step. `loss_scale` multiplies the loss (1/K for K micro-steps). `sync` marks the last
    /// micro-step, the one whose backward communicates. Returns this rank's loss (unscaled).
    fn forward_backward(
        &mut self,
        engine: &Engine,
        idx: &Tensor,
        targets: &Tensor,
        loss_scale: f64,
        sync: bool,
    ) -> Result<f64>;

    /// Σ g² of the global (averaged) gradient, the same on every rank, each element counted once.
    fn grad_norm_sq(&self) -> Result<f64>;

    /// What the optimizer updates: full tensors (DDP) or this rank's flat shards (ZeRO).
    fn optimizer_items(&self) -> Vec<OptimItem<'_>>;

    /// The fp32 masters the optimizer updates under mixed precision (None: it updates the
    /// parameters of [`DataParallel::optimizer_items`] themselves).
    fn masters(&self) -> Option<&MasterWeights> {
        None
    }

    /// After the optimizer: drop the gradients, and for ZeRO-1/2 all-gather the updated shards.
    fn after_optimizer_step(&mut self) -> Result<()>;

    /// Every parameter as a full tensor, by name (collective under ZeRO-3: call on every rank).
    fn full_state(&self) -> Result<BTreeMap<String, Tensor>>;

    /// Every parameter's averaged gradient as a full tensor, by name (collective under ZeRO-2/3).
    /// Valid between the last micro-step and the optimizer step.
    fn full_grads(&self) -> Result<BTreeMap<String, Tensor>>;

    /// Bytes of the parameters, gradients and optimizer moments this rank holds right now.
    fn model_state_bytes(&self, opt: &AdamW) -> ModelStateBytes;

    /// Communication figures of the last completed optimizer step.
    fn comm_stats(&self) -> CommStats;

    /// Loads full weights by name (e.g. from a checkpoint) into this rank's layout.
    fn load_full_state(&mut self, weights: &BTreeMap<String, Tensor>) -> Result<()>;

    /// The optimizer state as one device would hold it: every moment a full tensor under its
    /// parameter's name (collective under ZeRO: call on every rank).
    fn full_optimizer_state(&self, opt: &AdamW) -> Result<AdamWState>;

    /// This rank's part of a full optimizer state, ready for `AdamW::load_state`.
    fn shard_optimizer_state(&self, full: &AdamWState) -> Result<AdamWState>;

    /// Clip to `max_grad_norm` (if given), step the optimizer, finish the step. Returns the
    /// gradient norm before clipping: [`DataParallel::grad_norm_sq`] once, then
    /// [`DataParallel::scaled_step`] with its clip coefficient.
    fn optimizer_step(
        &mut self,
        opt: &mut AdamW,
        lr: f64,
        max_grad_norm: Option<f64>,
    ) -> Result<f64> {
        clipped_step(self.grad_norm_sq()?, max_grad_norm, |clip| {
            self.scaled_step(opt, lr, clip)
        })
    }

    /// Steps the optimizer with the gradients multiplied by `grad_scale` (the clip coefficient
    /// of a norm the caller already has, used as given; 1 leaves them alone) inside the update,
    /// and finishes the step. No norm is computed here.
    fn scaled_step(&mut self, opt: &mut AdamW, lr: f64, grad_scale: f64) -> Result<()> {
        match self.masters() {
            Some(m) => m.step(opt, lr, grad_scale, &self.optimizer_items())?,
            None => {
                opt.step_with_copies(lr, grad_scale, &self.optimizer_items(), None)?;
            }
        }
        self.after_optimizer_step()
    }
}

/// Checks that every rank holds the same initial weights: each rank computes (Σx, Σx², Σ i·x) of
/// every parameter in f64, the checksums of all ranks are gathered, and any difference from rank 0
/// fails on every rank with an error naming the rank and the parameter.
pub fn verify_same_init(comm: &Comm, params: &[Param]) -> Result<()> {
    if comm.size() == 1 {
        return Ok(()); // nobody to differ from
    }
    let device = comm.device().clone();
    let count = Tensor::new(&[params.len() as i64], &device)?;
    let counts = comm.all_gather(&count)?.to_vec1::<i64>()?;
    for (rank, &c) in counts.iter().enumerate() {
        if c != counts[0] {
            return Err(DpError::ParamCountMismatch {
                rank,
                ours: counts[0] as usize,
                theirs: c as usize,
            });
        }
    }
    let mut sums = Vec::with_capacity(3 * params.len());
    for p in params {
        let x = p.tensor().detach().flatten_all()?.to_dtype(DType::F64)?;
        let idx = Tensor::arange(0u32, x.elem_count() as u32, x.device())?.to_dtype(DType::F64)?;
        sums.push(sum_f64(&x)?);
        sums.push(sum_f64(&x.sqr()?)?);
        sums.push(sum_f64(&(&x * &idx)?)?);
    }
    // f64 bit patterns travel as i64 so the comparison is exact.
    let bits: Vec<i64> = sums.iter().map(|s| s.to_bits() as i64).collect();
    let n = bits.len();
    let all = comm
        .all_gather(&Tensor::from_vec(bits, n, &device)?)?
        .to_vec1::<i64>()?;
    for rank in 1..comm.size() {
        for (k, p) in params.iter().enumerate() {
            let mine = &all[3 * k..3 * k + 3];
            let theirs = &all[rank * n + 3 * k..rank * n + 3 * k + 3];
            if mine != theirs {
                let show = |s: &[i64]| {
                    format!(
                        "{:e}/{:e}",
                        f64::from_bits(s[0] as u64),
                        f64::from_bits(s[1] as u64)
                    )
                };
                return Err(DpError::InitMismatch {
                    rank,
                    name: p.name().to_string(),
                    ours: show(mine),
                    theirs: show(theirs),
                });
            }
        }
    }
    Ok(())
}
