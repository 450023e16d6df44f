//! One rank's part of a plan, as the step memory needs it ([`ActivationLayout`]): which
//! segments it runs, in how many chunks, on micro-batches of how many rows, how many of them in
//! flight at once (the schedule's own simulation), and under which tensor, sequence, expert and
//! ZeRO-3 splits.

use mtrain_model::GptConfig;
use mtrain_parallel::parallelize::{DataParallelKind, ParallelPlan};
use serde::Serialize;

use super::rank_holdings;
use crate::memory::Routing;

/// What one rank's step depends on under a parallel layout.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ActivationLayout {
    /// Blocks this rank holds, summed over its model chunks.
    pub blocks: usize,
    /// Model chunks (virtual stages) this rank holds: 1 except under interleaved 1F1B.
    pub chunks: usize,
    /// Whether this rank holds the first model stage (the embedding).
    pub holds_embedding: bool,
    /// Whether this rank holds the last model stage (final LayerNorm, LM head, loss).
    pub holds_head: bool,
    /// Rows of one pipeline micro-batch, `B / M`.
    pub micro_batch: usize,
    /// Peak (micro-batch, chunk) pairs whose forward ran here while their backward had not.
    pub in_flight: usize,
    /// Whether a later backward of the step runs with every gradient of the rank already
    /// written (pipeline micro-batches or gradient accumulation: M > 1 passes per step).
    pub accumulates: bool,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Expert-parallel degree (MoE blocks).
    pub ep: usize,
    /// Sequence parallelism inside the tp group.
    pub sequence_parallel: bool,
    /// Context-parallel degree: each rank holds T/cp tokens of every sequence.
    pub cp: usize,
    /// ZeRO-3 (FSDP): each segment's weights are gathered for its forward.
    pub gathers_weights: bool,
    /// ZeRO-3 frees each segment's gathered weights after its forward and gathers them again
    /// for its backward (`reshard_after_forward`); otherwise they are kept until then.
    pub reshards_after_forward: bool,
    /// Ranks a ZeRO-3 unit is sharded over (dp · cp): its gradient is reduce-scattered into
    /// that many shards.
    pub zero_shards: usize,
    /// The rows each of this rank's MoE blocks dispatched per pass, in block order (empty: an
    /// even split with every slot filled, [`Routing::even`]).
    pub routing: Vec<Routing>,
    /// Parameters of each of this rank's segments in forward order (the embedding, the blocks,
    /// the head; the tied `wte` with the head where the rank holds it, whose backward runs
    /// first), from its holdings table ([`mtrain_parallel::holdings::Holdings::segment_numels`]).
    pub segment_params: Vec<u64>,
}

/// Why a rank's part of a plan ([`ActivationLayout::for_plan`], [`rank_params`]) cannot be laid out.
#[derive(Debug, thiserror::Error)]
pub enum ActivationLayoutError {
    /// The batch does not split into the plan's micro-batches.
    #[error("batch {batch} does not split into {microbatches} equal micro-batches")]
    Microbatches { batch: usize, microbatches: usize },
    /// The stage layout or the schedule is invalid.
    #[error("pipeline layout: {0}")]
    Pipeline(String),
}

impl ActivationLayout {
    /// The whole model on one device: every segment, one micro-batch of `batch` rows.
    pub fn single_device(cfg: &GptConfig, batch: usize) -> Self {
        let plan = ParallelPlan::new(mtrain_comm::MeshDims::new(1, 1, 1, 1));
        let table = rank_holdings(cfg, &plan, 0).expect("one stage holds every block");
        Self {
            blocks: cfg.n_layer,
            chunks: 1,
            holds_embedding: true,
            holds_head: true,
            micro_batch: batch,
            in_flight: 1,
            accumulates: false,
            tp: 1,
            ep: 1,
            sequence_parallel: false,
            cp: 1,
            gathers_weights: false,
            reshards_after_forward: false,
            zero_shards: 1,
            routing: Vec::new(),
            segment_params: table
                .segment_numels()
                .into_iter()
                .map(|n| n as u64)
                .collect(),
        }
    }

    /// Pipeline rank `pp_rank`'s part under `plan`, for a per-rank batch of `batch` rows: its
    /// blocks from the plan's stage layout (model stage s runs on rank `s % pp`), the micro-batch
    /// `batch / M`, and the peak in flight from the simulation of the order the run trains under
    /// ([`ParallelPlan::schedule`]: the one built for the plan's pass costs where it has them,
    /// whose peak can be below the unit-clock order's; 1F1B: `min(P − r, M)`, GPipe: `M`).
    pub fn for_plan(
        cfg: &GptConfig,
        plan: &ParallelPlan,
        pp_rank: usize,
        batch: usize,
    ) -> Result<Self, ActivationLayoutError> {
        let pp = plan.dims.pp.max(1);
        let m = plan.microbatches.max(1);
        if !batch.is_multiple_of(m) {
            return Err(ActivationLayoutError::Microbatches {
                batch,
                microbatches: m,
            });
        }
        let err = |e: String| ActivationLayoutError::Pipeline(e);
        let layout = plan.stage_layout(cfg.n_layer).map_err(|e| err(e.to_string()))?;
        let mine: Vec<usize> = (0..layout.num_stages())
            .filter(|&s| layout.rank_of_stage(s, pp) == pp_rank)
            .collect();
        let sim = plan
            .schedule()
            .and_then(|s| Ok(s.simulate()?))
            .map_err(|e| err(e.to_string()))?;
        let zero3 = matches!(plan.data, DataParallelKind::Zero(z) if z.stage as u8 == 3)
            && plan.dims.dp * plan.dims.cp > 1;
        Ok(Self {
            blocks: mine.iter().map(|&s| layout.blocks(s).len()).sum(),
            chunks: mine.len().max(1),
            holds_embedding: mine.contains(&0),
            holds_head: mine.contains(&(layout.num_stages() - 1)),
            micro_batch: batch / m,
            in_flight: sim.peak_in_flight(pp_rank),
            accumulates: m > 1,
            tp: plan.dims.tp.max(1),
            ep: plan.dims.ep.max(1),
            sequence_parallel: plan.sequence_parallel && plan.dims.tp > 1,
            cp: plan.dims.cp.max(1),
            gathers_weights: zero3,
            reshards_after_forward: matches!(plan.data, DataParallelKind::Zero(z) if z.reshard_after_forward),
            zero_shards: (plan.dims.dp * plan.dims.cp).max(1),
            routing: Vec::new(),
            segment_params: rank_holdings(cfg, plan, pp_rank)?
                .segment_numels()
                .into_iter()
                .map(|n| n as u64)
                .collect(),
        })
    }
}
