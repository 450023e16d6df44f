//! The data-parallel average of a composed plan's gradients, as one device's gradient of the
//! mean loss: dense gradients averaged over dp, an expert's summed over its edp replicas and
//! divided by dp (each expert already saw the tokens of its whole ep group).
//!
//! ```text
//!   dp = 4, ep = 2      ep groups (different experts):     [0 1] [2 3]
//!                       edp groups (same experts):         [0 2] [1 3]
//!   non-expert grads:   (1/dp) Σ over dp  = [0 1 2 3]      (as DDP)
//!   expert grads:       (1/dp) Σ over edp = [0 2] or [1 3] (never over ep)
//! ```
//!
//! One average per parameter, started by [`start_average`] and finished by [`finish_averages`]:
//! after the flush by [`sync_grads`] (a pipeline),
//! or from inside the last backward by [`super::OverlappedDpReduce`] (one stage). It lives under
//! `ddp/` because it is data parallelism of whatever model the plan built — the dense, tensor-
//! and expert-parallel ones alike; expert parallelism only decides which group an expert's
//! gradient is summed over ([`is_expert_param`]).

use candle_core::Tensor;
use mtrain_comm::{Comm, ReduceOp, Work};
use mtrain_model::{Grads, Param};

use super::Result;
use crate::placement::is_expert_param;

/// Averages one step's gradients: non-expert gradients over `dp`, expert gradients summed over
/// `edp` and divided by `dp.size()`. Every rank of both groups must pass the parameters of the
/// same model layout in the same order (as [`crate::expert_parallel::build_segments`] gives them); a parameter
/// with no gradient counts as zero. Returns the number of collectives and their input bytes.
pub fn sync_grads(
    params: &[Param],
    grads: &mut Grads,
    dp: &Comm,
    edp: &Comm,
) -> Result<(usize, u64)> {
    let mut pending = Vec::with_capacity(params.len());
    let mut bytes = 0u64;
    for p in params {
        let g = match grads.get(p.name()) {
            Some(g) => g.contiguous()?,
            None => Tensor::zeros(p.shape(), p.var().dtype(), p.var().device())?,
        };
        bytes += (g.elem_count() * g.dtype().size_in_bytes()) as u64;
        pending.push(start_average(p.name(), &g, dp, edp));
    }
    let n = pending.len();
    finish_averages(pending, grads, dp)?;
    Ok((n, bytes))
}

/// A gradient average in flight: the parameter's name, whether it is an expert's, the work.
pub type Averaging = (String, bool, Work);

/// Starts averaging `g`, the gradient of `name`, over the data-parallel replicas: dense
/// gradients by an all-reduce Avg over `dp`; an expert's by an all-reduce Sum over `edp`, divided
/// by dp's size in [`finish_averages`] (each expert sees the tokens of all dp ranks).
pub fn start_average(name: &str, g: &Tensor, dp: &Comm, edp: &Comm) -> Averaging {
    let expert = is_expert_param(name);
    let work = match expert {
        true => edp.all_reduce_async(g, ReduceOp::Sum),
        false => dp.all_reduce_async(g, ReduceOp::Avg),
    };
    (name.to_string(), expert, work)
}

/// Waits for the averages [`start_average`] began and stores them in `grads`.
pub fn finish_averages(pending: Vec<Averaging>, grads: &mut Grads, dp: &Comm) -> Result<()> {
    let inv_dp = 1.0 / dp.size() as f64;
    for (name, expert, work) in pending {
        let g = work.wait()?;
        let g = if expert { (g * inv_dp)? } else { g };
        grads.insert(name, g);
    }
    Ok(())
}
