//! What every data-parallel strategy shares: the [`DataParallel`] API the training loop drives,
//! its error type, per-step communication figures, the same-initialisation check, a few facts
//! about parameters (which segment finalises a gradient, which tensors are decayed), and the
//! bookkeeping of replicated parameters that DDP, expert data parallelism and a composed layout
//! do alike (scaling, optimizer items, state bytes, loading full weights).
//!
//! The API in one picture:
//!
//! ```text
//!   for micro-step k in 0..K:   loss_k = dp.forward_backward(engine, x_k, y_k, 1/K, sync = k == K-1)
//!   norm = dp.optimizer_step(&mut adamw, lr, Some(max_norm))
//!            = grad_norm_sq -> scale_grads (clip) -> adamw.step(optimizer_items) -> after_optimizer_step
//! ```

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Tensor};
use mtrain_comm::{Comm, CommError, TraceEvent, Work};
use mtrain_model::optim::{clip_coef, AdamW, AdamWState, OptimItem};
use mtrain_model::{Engine, Grads, Param, Segment};

use crate::mixed_precision::MasterWeights;

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
}

pub type Result<T> = std::result::Result<T, DpError>;

/// Hooks return candle's error type; a communication error travels inside it.
pub(crate) fn hook_err(e: impl std::error::Error + Send + Sync + 'static) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// Timing and volume of one optimizer step's data-parallel communication.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CommStats {
    /// Wall time of the engine's backward passes (including launching collectives).
    pub backward_s: f64,
    /// Time the group spent running this step's collectives (from the comm trace).
    pub comm_s: f64,
    /// Time this rank sat blocked in `wait()`: the communication not hidden behind compute.
    pub exposed_comm_s: f64,
    /// Collectives issued.
    pub collectives: usize,
    /// Bytes of the inputs of those collectives on this rank.
    pub bytes: u64,
}

/// Bytes of model state one rank keeps (parameters, gradients, optimizer moments).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelStateBytes {
    pub params: usize,
    pub grads: usize,
    pub optimizer: usize,
}

impl ModelStateBytes {
    pub fn total(&self) -> usize {
        self.params + self.grads + self.optimizer
    }
}

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

    /// Multiplies the gradients the optimizer will see by `factor` (gradient clipping).
    fn scale_grads(&mut self, factor: f64) -> Result<()>;

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
    /// gradient norm before clipping.
    fn optimizer_step(
        &mut self,
        opt: &mut AdamW,
        lr: f64,
        max_grad_norm: Option<f64>,
    ) -> Result<f64> {
        let norm = self.grad_norm_sq()?.sqrt();
        if let Some(max) = max_grad_norm {
            let c = clip_coef(norm, max);
            if c < 1.0 {
                self.scale_grads(c)?;
            }
        }
        match self.masters() {
            Some(m) => m.step(opt, lr, &self.optimizer_items())?,
            None => opt.step(lr, &self.optimizer_items())?,
        }
        self.after_optimizer_step()?;
        Ok(norm)
    }
}

/// The segments' parameters, each name once, in model order.
pub fn unique_params(segs: &[Arc<dyn Segment>]) -> Vec<Param> {
    let mut seen = std::collections::BTreeSet::new();
    segs.iter()
        .flat_map(|s| s.params())
        .filter(|p| seen.insert(p.name().to_string()))
        .collect()
}

/// For each parameter name, the segment after whose backward its gradient is final: the
/// lowest-index segment using it (the embedding for the tied `wte`).
pub fn final_after(segs: &[Arc<dyn Segment>]) -> BTreeMap<String, usize> {
    let mut at = BTreeMap::new();
    for (i, s) in segs.iter().enumerate() {
        for p in s.params() {
            at.entry(p.name().to_string()).or_insert(i);
        }
    }
    at
}

/// nanoGPT's rule: decay matrices and embeddings (≥ 2-D), not biases or LayerNorm gains.
pub fn decays(shape: &[usize]) -> bool {
    shape.len() >= 2
}

/// Σ of every element of `t` as one f64: the loss the engine's last segment returns.
pub(crate) fn sum_f64(t: &Tensor) -> candle_core::Result<f64> {
    mtrain_model::reduce::sum_f64(t)
}

/// Σ t² over every element, computed in f64 (one tensor's part of a squared gradient norm).
pub(crate) fn sq_sum_f64(t: &Tensor) -> candle_core::Result<f64> {
    mtrain_model::reduce::sq_sum_f64(t)
}

/// Multiplies every gradient in `grads` by `factor` (gradient clipping).
pub(crate) fn scale_all(grads: &mut Grads, factor: f64) -> candle_core::Result<()> {
    for name in grads.names() {
        if let Some(g) = grads.get(&name) {
            let scaled = (g * factor)?;
            grads.insert(name, scaled);
        }
    }
    Ok(())
}

/// What the optimizer updates when every parameter is held whole: each parameter that has a
/// gradient, with its gradient.
pub(crate) fn replicated_items<'a>(params: &'a [Param], grads: &'a Grads) -> Vec<OptimItem<'a>> {
    params
        .iter()
        .filter_map(|p| {
            grads.get(p.name()).map(|g| OptimItem {
                name: p.name(),
                param: p,
                grad: g,
                decay: decays(g.dims()),
            })
        })
        .collect()
}

/// Bytes of whole parameters, their gradients and the optimizer's moments.
pub(crate) fn replicated_state_bytes(
    params: &[Param],
    grads: &Grads,
    opt: &AdamW,
) -> ModelStateBytes {
    let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
    ModelStateBytes {
        params: params.iter().map(|p| bytes(&p.tensor())).sum(),
        grads: grads.iter().map(|(_, g)| bytes(g)).sum(),
        optimizer: opt.state_bytes(),
    }
}

/// The parameters' current values by name, detached from any graph.
pub(crate) fn named_weights(params: &[Param]) -> BTreeMap<String, Tensor> {
    params
        .iter()
        .map(|p| (p.name().to_string(), p.tensor().detach()))
        .collect()
}

/// The gradients by name.
pub(crate) fn named_grads(grads: &Grads) -> BTreeMap<String, Tensor> {
    grads.iter().map(|(n, g)| (n.clone(), g.clone())).collect()
}

/// Sets `p` to `t` cast to the parameter's dtype; a shape other than the parameter's is an error
/// naming both.
pub(crate) fn set_weight(p: &Param, t: &Tensor) -> Result<()> {
    if t.dims() != p.shape().dims() {
        return Err(DpError::Config(format!(
            "weight `{}` has shape {:?} but this rank's parameter has {:?}",
            p.name(),
            t.dims(),
            p.shape().dims()
        )));
    }
    Ok(p.set(&t.to_dtype(p.var().dtype())?)?)
}

/// Loads every parameter from `weights` by name; a missing name is an error.
pub(crate) fn load_replicated(params: &[Param], weights: &BTreeMap<String, Tensor>) -> Result<()> {
    for p in params {
        let t = weights
            .get(p.name())
            .ok_or_else(|| DpError::Config(format!("no weight named `{}` to load", p.name())))?;
        set_weight(p, t)?;
    }
    Ok(())
}

/// Checks that every rank holds the same initial weights: each rank computes (Σx, Σx², Σ i·x) of
/// every parameter in f64, the checksums of all ranks are gathered, and any difference from rank 0
/// fails on every rank with an error naming the rank and the parameter.
pub fn verify_same_init(comm: &Comm, params: &[Param]) -> Result<()> {
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
        sums.push(x.sum_all()?.to_scalar::<f64>()?);
        sums.push(x.sqr()?.sum_all()?.to_scalar::<f64>()?);
        sums.push((&x * &idx)?.sum_all()?.to_scalar::<f64>()?);
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

/// Measures how long a group was busy with this step's collectives, from its trace.
///
/// The trace stamps each op when issued and when finished; ops run one after another in issue
/// order, so op k is busy from max(issued_k, finished_{k-1}) to finished_k.
#[derive(Debug, Default)]
pub(crate) struct OpTimer {
    after_seq: Option<u64>,
    ops: BTreeMap<u64, TraceEvent>,
}

impl OpTimer {
    /// Starts a step: ops already in the trace are not counted.
    pub(crate) fn start(comm: &Comm) -> Self {
        let after_seq = comm.tracer().recent().iter().map(|e| e.seq).max();
        Self {
            after_seq,
            ops: BTreeMap::new(),
        }
    }

    /// Picks up the ops finished so far (call after each wait: the trace keeps only recent ops).
    pub(crate) fn collect(&mut self, comm: &Comm) {
        for e in comm.tracer().recent() {
            if self.after_seq.is_none_or(|s| e.seq > s) {
                self.ops.insert(e.seq, e);
            }
        }
    }

    pub(crate) fn busy_s(&self) -> f64 {
        let mut prev_end = 0u64;
        let mut busy = 0u64;
        for e in self.ops.values() {
            let start = e.start_us.max(prev_end);
            busy += e.end_us.saturating_sub(start);
            prev_end = prev_end.max(e.end_us);
        }
        busy as f64 * 1e-6
    }
}

/// Waits for `work`, adding the blocked time to `exposed_s`.
pub(crate) fn timed_wait<T: Send + 'static>(work: Work<T>, exposed_s: &mut f64) -> Result<T> {
    let t = Instant::now();
    let out = work.wait();
    *exposed_s += t.elapsed().as_secs_f64();
    Ok(out?)
}
