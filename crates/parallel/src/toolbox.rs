//! The crate's toolbox: small facts and helpers every technique uses, kept below all of them so
//! none imports another's module for them — parameters in model order and where each gradient
//! becomes final, the decay rule, f64 sums for losses and norms, the bookkeeping of whole
//! (replicated) parameters (scaling, optimizer items, state bytes, loading), the step's
//! communication figures and the timer that reads them from a group's trace.
//!
//! DDP, ZeRO, expert data parallelism and the composed model all use it, so it lives at the
//! crate root, not inside one technique.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use mtrain_comm::{Comm, CommError, TraceEvent, Work};
use mtrain_model::optim::{clip_coef, AdamW, OptimItem};
use mtrain_model::{Grads, Param, Segment};

/// A full tensor that does not fit this rank's layout, or a name that is not there.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("no {what} named `{name}` to load")]
    Missing { what: &'static str, name: String },
    #[error("{what} `{name}` has shape {got:?}, but this rank's layout expects {expected:?}")]
    Shape {
        what: &'static str,
        name: String,
        got: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("rank {rank} should own `{name}` but does not hold it")]
    NotHeld { rank: usize, name: String },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Hooks return candle's error type; a communication error travels inside it.
pub fn hook_err(e: impl std::error::Error + Send + Sync + 'static) -> candle_core::Error {
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
    let uses: Vec<Vec<String>> = segs
        .iter()
        .map(|s| s.params().iter().map(|p| p.name().to_string()).collect())
        .collect();
    final_after_names(&uses)
}

/// [`final_after`] from the names each segment uses (`uses[i]`: segment i's parameters).
pub fn final_after_names(uses: &[Vec<String>]) -> BTreeMap<String, usize> {
    let mut at = BTreeMap::new();
    for (i, names) in uses.iter().enumerate() {
        for n in names {
            at.entry(n.clone()).or_insert(i);
        }
    }
    at
}

/// nanoGPT's rule: decay matrices and embeddings (≥ 2-D), not biases or LayerNorm gains.
pub fn decays(shape: &[usize]) -> bool {
    shape.len() >= 2
}

/// Σ of every element of `t` as one f64: the loss the engine's last segment returns.
pub fn sum_f64(t: &Tensor) -> candle_core::Result<f64> {
    mtrain_kernels::reduce::sum_f64(t)
}

/// Σ t² over every element, computed in f64 (one tensor's part of a squared gradient norm).
pub fn sq_sum_f64(t: &Tensor) -> candle_core::Result<f64> {
    mtrain_kernels::reduce::sq_sum_f64(t)
}


/// What the optimizer updates when every parameter is held whole: each parameter that has a
/// gradient, with its gradient.
pub fn replicated_items<'a>(params: &'a [Param], grads: &'a Grads) -> Vec<OptimItem<'a>> {
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
pub fn replicated_state_bytes(params: &[Param], grads: &Grads, opt: &AdamW) -> ModelStateBytes {
    let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
    ModelStateBytes {
        params: params.iter().map(|p| bytes(&p.tensor())).sum(),
        grads: grads.iter().map(|(_, g)| bytes(g)).sum(),
        optimizer: opt.state_bytes(),
    }
}

/// The parameters' current values by name, detached from any graph.
pub fn named_weights(params: &[Param]) -> BTreeMap<String, Tensor> {
    params
        .iter()
        .map(|p| (p.name().to_string(), p.tensor().detach()))
        .collect()
}

/// The gradients by name.
pub fn named_grads(grads: &Grads) -> BTreeMap<String, Tensor> {
    grads.iter().map(|(n, g)| (n.clone(), g.clone())).collect()
}

/// Sets `p` to `t` cast to the parameter's dtype; a shape other than the parameter's is an error
/// naming both.
pub fn set_weight(p: &Param, t: &Tensor) -> Result<(), StateError> {
    if t.dims() != p.shape().dims() {
        return Err(StateError::Shape {
            what: "weight",
            name: p.name().to_string(),
            got: t.dims().to_vec(),
            expected: p.shape().dims().to_vec(),
        });
    }
    Ok(p.set(&t.to_dtype(p.var().dtype())?)?)
}

/// Loads every parameter from `weights` by name; a missing name is an error.
pub fn load_replicated(
    params: &[Param],
    weights: &BTreeMap<String, Tensor>,
) -> Result<(), StateError> {
    for p in params {
        let t = weights.get(p.name()).ok_or_else(|| StateError::Missing {
            what: "weight",
            name: p.name().to_string(),
        })?;
        set_weight(p, t)?;
    }
    Ok(())
}

/// Measures how long a group was busy with this step's collectives, from its trace.
///
/// The trace stamps each op when issued and when finished; ops run one after another in issue
/// order, so op k is busy from max(issued_k, finished_{k-1}) to finished_k.
#[derive(Debug, Default)]
pub struct OpTimer {
    after_seq: Option<u64>,
    ops: BTreeMap<u64, TraceEvent>,
}

impl OpTimer {
    /// Starts a step: ops already in the trace are not counted.
    pub fn start(comm: &Comm) -> Self {
        let after_seq = comm.tracer().recent().iter().map(|e| e.seq).max();
        Self {
            after_seq,
            ops: BTreeMap::new(),
        }
    }

    /// Picks up the ops finished so far (call after each wait: the trace keeps only recent ops).
    pub fn collect(&mut self, comm: &Comm) {
        for e in comm.tracer().recent() {
            if self.after_seq.is_none_or(|s| e.seq > s) {
                self.ops.insert(e.seq, e);
            }
        }
    }

    pub fn busy_s(&self) -> f64 {
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
pub fn timed_wait<T: Send + 'static>(work: Work<T>, exposed_s: &mut f64) -> Result<T, CommError> {
    let t = Instant::now();
    let out = work.wait();
    *exposed_s += t.elapsed().as_secs_f64();
    out
}

/// Global-norm clipping, in the one order every optimizer step takes: the norm from its square
/// (`norm_sq`, Σ g² over the whole model), then `scaled_step` with its clip coefficient for
/// `max_grad_norm` (1 without). Returns the norm before clipping.
pub fn clipped_step<E>(
    norm_sq: f64,
    max_grad_norm: Option<f64>,
    scaled_step: impl FnOnce(f64) -> Result<(), E>,
) -> Result<f64, E> {
    let norm = norm_sq.sqrt();
    scaled_step(max_grad_norm.map_or(1.0, |max| clip_coef(norm, max)))?;
    Ok(norm)
}
