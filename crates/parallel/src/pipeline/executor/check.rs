//! A step's inputs checked against its schedule before the first action runs.

use candle_core::Tensor;
use mtrain_comm::Communicator;

use super::super::schedule::Schedule;
use super::super::stage::PipelineStages;
use super::super::{PipelineError, Result};

/// Checks that `stages` and `pp` are the ranks and chunks `sched` places, and that the
/// batch splits into M micro-batches; returns b = B/M.
pub(super) fn check_layout(
    sched: &Schedule,
    stages: &PipelineStages,
    pp: &dyn Communicator,
    idx: &Tensor,
    targets: &Tensor,
) -> Result<usize> {
    let (p, m, rank) = (sched.num_ranks(), sched.num_microbatches(), stages.rank());
    if stages.num_ranks() != p
        || pp.size() != p
        || pp.rank() != rank
        || stages.chunks().len() != sched.virtual_stages()
    {
        return Err(PipelineError::Layout(format!(
            "schedule for P = {p} with v = {} chunks, but the stages are rank {rank} of {} with {} chunks \
             and the pipeline group is rank {} of {}",
            sched.virtual_stages(),
            stages.num_ranks(),
            stages.chunks().len(),
            pp.rank(),
            pp.size()
        )));
    }
    if let Some(c) = (0..sched.virtual_stages())
        .find(|&c| stages.chunks()[c].stage != sched.model_stage(rank, c))
    {
        return Err(PipelineError::Layout(format!(
            "rank {rank}'s chunk {c} is model stage {}, but the {} schedule places stage {} there",
            stages.chunks()[c].stage,
            sched.kind(),
            sched.model_stage(rank, c)
        )));
    }
    let (batch, _) = idx.dims2()?;
    if batch % m != 0 || targets.dims() != idx.dims() {
        return Err(PipelineError::UnevenBatch {
            batch,
            microbatches: m,
        });
    }
    Ok(batch / m)
}
