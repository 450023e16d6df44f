//! Analytic memory: what one rank should hold, from the plan alone. Used by the per-step report
//! (next to the measured figures) and by `mtrain plan` (before anything runs), so both print
//! the same numbers.
//!
//! ```text
//!   model state   ModelStateLayout      what a rank keeps between steps: bytes per parameter,     this file
//!                                       divided as the ZeRO stage says, over the parameters it
//!                                       owns (rank_params: its holdings table)
//!   its part      ActivationLayout      what its step runs: stages, chunks, micro-batches in       analytic/activation_layout.rs
//!                                       flight, tp/sp/ep, each segment's parameters
//!   the step      StepMemory            what the step adds above the model state: activations      analytic/step.rs
//!                                       at the end of the forward, gathered weights, the peak
//! ```
//!
//! The step is summed from what each segment keeps (`memory/kept.rs`).

mod activation_layout;
mod step;

use mtrain_model::GptConfig;
use mtrain_parallel::holdings::Holdings;
use mtrain_parallel::parallelize::{DataParallelKind, ParallelPlan};
use serde::Serialize;

pub use activation_layout::{ActivationLayout, ActivationLayoutError};
pub use step::{
    activation_bytes, rank_activation_bytes, rank_step_memory, step_memory, StepMemory, StepRun,
};

/// Bytes per parameter of each model-state category, what the layout divides each by, and the
/// shard copies ZeRO-1/2 keep beside the full tensors.
///
/// ```text
///   per rank, Φ parameters owned, N = dp     weights          gradients        optimizer (+ masters)
///   DDP                                      Φ·w              Φ·g              Φ·(o + m)
///   ZeRO-1                                   Φ·w + Φ·w/N      Φ·g + Φ·g/N      Φ·(o + m)/N
///   ZeRO-2                                   Φ·w + Φ·w/N      Φ·g/N            Φ·(o + m)/N
///   ZeRO-3 (FSDP)                            Φ·w/N            Φ·g/N            Φ·(o + m)/N
/// ```
///
/// The `+ Φ·w/N` is the shard the optimizer updates and all-gathers back into the full weights,
/// the `+ Φ·g/N` the reduced gradient shard ZeRO-1 keeps next to its full gradients
/// (`parallel/src/fsdp.rs` holds both). [`ModelStateLayout::with_zero`] alone is the ZeRO
/// paper's rule without them; [`ModelStateLayout::for_plan`] is what a rank of this
/// implementation holds, and what the report and `mtrain plan` print.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ModelStateLayout {
    /// Parameters this rank owns before any ZeRO sharding (Φ after TP/PP splits).
    pub n_params: u64,
    /// Bytes per parameter of the compute copy of the weights.
    pub param_bytes: u64,
    /// Bytes per parameter of the gradients.
    pub grad_bytes: u64,
    /// Bytes per parameter of an fp32 master copy (0 when the compute copy is fp32).
    pub master_bytes: u64,
    /// Bytes per parameter of optimizer state (8 for Adam's m and v in fp32).
    pub optim_bytes: u64,
    /// Ranks the parameters are sharded over (ZeRO-3 / FSDP: dp; otherwise 1).
    pub param_shards: u64,
    /// Ranks the gradients are sharded over (ZeRO-2 and up).
    pub grad_shards: u64,
    /// Ranks optimizer state and master weights are sharded over (ZeRO-1 and up).
    pub optim_shards: u64,
    /// Ranks the optimizer's copy of the weights is cut over, held beside the full weights
    /// (ZeRO-1/2: dp); 0 when there is no such copy.
    pub param_copy_shards: u64,
    /// Ranks the reduced gradient shard is cut over, held beside the full gradients (ZeRO-1: dp);
    /// 0 when there is none.
    pub grad_copy_shards: u64,
}

impl ModelStateLayout {
    /// fp32 weights, fp32 gradients, Adam: 4 + 4 + 8 = 16 bytes per parameter, nothing sharded.
    pub fn fp32_adam(n_params: u64) -> Self {
        Self {
            n_params,
            param_bytes: 4,
            grad_bytes: 4,
            master_bytes: 0,
            optim_bytes: 8,
            param_shards: 1,
            grad_shards: 1,
            optim_shards: 1,
            param_copy_shards: 0,
            grad_copy_shards: 0,
        }
    }

    /// bf16 weights and gradients, fp32 master and Adam state: 2 + 2 + 4 + 8 = 16 bytes per parameter.
    pub fn mixed_adam(n_params: u64) -> Self {
        Self {
            param_bytes: 2,
            grad_bytes: 2,
            master_bytes: 4,
            ..Self::fp32_adam(n_params)
        }
    }

    /// The same layout with ZeRO stage `stage` (0–3) over `dp` ranks: the paper's rule, without
    /// the shard copies of ZeRO-1/2.
    pub fn with_zero(mut self, stage: u8, dp: u64) -> Self {
        self.optim_shards = if stage >= 1 { dp } else { 1 };
        self.grad_shards = if stage >= 2 { dp } else { 1 };
        self.param_shards = if stage >= 3 { dp } else { 1 };
        self
    }

    /// What a rank holds under `plan` for the `n_params` parameters it owns after the tensor,
    /// pipeline and expert splits: the plan's precision (fp32, or bf16 with fp32 masters),
    /// sharded as its ZeRO stage says, with the shard copies of ZeRO-1/2 (the table above).
    pub fn for_plan(n_params: u64, plan: &ParallelPlan) -> Self {
        let base = match plan.precision.is_mixed() {
            true => Self::mixed_adam(n_params),
            false => Self::fp32_adam(n_params),
        };
        let stage = match plan.data {
            DataParallelKind::Ddp(_) => 0,
            DataParallelKind::Zero(z) => z.stage as u8,
        };
        // ZeRO shards over every rank that holds the same parameters: dp × cp.
        let dp = (plan.dims.dp * plan.dims.cp).max(1) as u64;
        Self {
            param_copy_shards: if matches!(stage, 1 | 2) { dp } else { 0 },
            grad_copy_shards: if stage == 1 { dp } else { 0 },
            ..base.with_zero(stage, dp)
        }
    }

    /// Bytes of parameters held (rounded up per shard), the optimizer's shard copy included.
    pub fn params(&self) -> u64 {
        let full = self.n_params * self.param_bytes;
        full.div_ceil(self.param_shards) + copy(full, self.param_copy_shards)
    }

    /// Bytes of gradients held, the reduced shard copy included.
    pub fn grads(&self) -> u64 {
        let full = self.n_params * self.grad_bytes;
        full.div_ceil(self.grad_shards) + copy(full, self.grad_copy_shards)
    }

    /// Bytes of the optimizer's moments alone, which its first step allocates (the masters
    /// exist from the start).
    pub fn moments(&self) -> u64 {
        (self.n_params * self.optim_bytes).div_ceil(self.optim_shards)
    }

    /// Bytes of optimizer state plus master weights held.
    pub fn optim(&self) -> u64 {
        (self.n_params * (self.optim_bytes + self.master_bytes)).div_ceil(self.optim_shards)
    }

    /// All model-state bytes held.
    pub fn total(&self) -> u64 {
        self.params() + self.grads() + self.optim()
    }
}

/// Bytes of a copy of `full` bytes cut over `shards` ranks (0 shards: no copy).
fn copy(full: u64, shards: u64) -> u64 {
    match shards {
        0 => 0,
        n => full.div_ceil(n),
    }
}

/// Bytes of the DDP gradient buckets a rank holds for its `n_params` parameters when the plan
/// averages in buckets ([`ParallelPlan::dp_buckets`]): each bucket's flattened gradients and
/// its all-reduce's result, in the reduce dtype, both held until the bucket is waited on after
/// the backward (`parallel/src/ddp/buckets.rs`, `write_back`) — two copies of the gradients. A
/// group of one averages nothing and has no bucket (the world of one).
pub fn bucket_bytes(plan: &ParallelPlan, n_params: u64) -> u64 {
    match plan.dp_buckets() {
        Some(_) => 2 * plan.precision.grad_reduce_dtype().size_in_bytes() as u64 * n_params,
        None => 0,
    }
}

/// Parameters pipeline rank `pp_rank` owns under `plan` (any dp, tp or ep rank of it alike):
/// the size of its holdings table ([`Holdings`]), each parameter once.
pub fn rank_params(
    cfg: &GptConfig,
    plan: &ParallelPlan,
    pp_rank: usize,
) -> Result<u64, ActivationLayoutError> {
    Ok(rank_holdings(cfg, plan, pp_rank)?.numel() as u64)
}

/// The highest number of bytes a rank holds while it builds its model, before its first step
/// (the startup figure of the memory report and of `mtrain plan`), by replaying the reads of
/// `parallel/src/parallelize.rs` in its order. A rank never creates a tensor of the model it
/// does not hold, so each read adds only its own piece:
///
/// ```text
///   each piece of the holdings table (not at ZeRO-3)   fp32: the values read are the parameter
///                                                       (4 an element); else fp32 values, then
///                                                       the cast's copy: 4 + w, w kept
///   ZeRO: each unit's shard, in segment order           4 + w, w kept (the optimizer's piece)
///   mixed precision: the fp32 masters                   all read (4 an element), then each
///                                                       copied (4 for the largest in flight)
/// ```
/// (`w`: the compute dtype's bytes.) Gradients and AdamW's moments come with the first step.
pub fn startup_bytes(table: &Holdings, plan: &ParallelPlan) -> u64 {
    let state = ModelStateLayout::for_plan(table.numel() as u64, plan);
    let w = state.param_bytes;
    let (mut held, mut peak) = (0u64, 0u64);
    let mut read = |n: u64, in_flight: u64, kept: u64| {
        peak = peak.max(held + n * in_flight);
        held += n * kept;
    };
    let stage = match plan.data {
        DataParallelKind::Ddp(_) => 0,
        DataParallelKind::Zero(z) => z.stage as u8,
    };
    let pieces: Vec<u64> = table.unique().iter().map(|h| h.numel() as u64).collect();
    if stage != 3 {
        let in_flight = if w == 4 { 4 } else { 4 + w };
        pieces.iter().for_each(|&n| read(n, in_flight, w));
    }
    let shards = match stage {
        0 => Vec::new(),
        _ => unit_shards(table, (plan.dims.dp * plan.dims.cp).max(1) as u64),
    };
    shards.iter().for_each(|&n| read(n, 4 + w, w));
    if plan.precision.is_mixed() {
        let masters = match stage {
            0 => &pieces,
            _ => &shards,
        };
        let all: u64 = masters.iter().sum();
        let largest = masters.iter().copied().max().unwrap_or(0);
        read(all, 4, 4);
        peak = peak.max(held + 4 * largest);
    }
    peak
}

/// A checkpoint's bound on one rank, from its holdings: (the bytes of its pieces — fp32 weights
/// or masters, Adam m and v, 12 per element it keeps state of — and of its largest piece of one
/// kind). Writing rises by at most the second, reading by at most their sum (the
/// `--mem-report` checkpoint line measures both). Under ZeRO a piece is at most a unit's shard.
pub fn checkpoint_bytes(table: &Holdings, plan: &ParallelPlan) -> (u64, u64) {
    let elements: Vec<u64> = match plan.data {
        DataParallelKind::Ddp(_) => table.unique().iter().map(|h| h.numel() as u64).collect(),
        DataParallelKind::Zero(_) => unit_shards(table, (plan.dims.dp * plan.dims.cp).max(1) as u64),
    };
    let largest = elements.iter().copied().max().unwrap_or(0);
    (12 * elements.iter().sum::<u64>(), 4 * largest)
}

/// [`checkpoint_bytes`] of pipeline rank `pp_rank`'s first rank (every rank of a pipeline rank
/// holds as many elements).
pub fn rank_checkpoint_bytes(
    cfg: &GptConfig,
    plan: &ParallelPlan,
    pp_rank: usize,
) -> Result<(u64, u64), ActivationLayoutError> {
    Ok(checkpoint_bytes(&rank_holdings(cfg, plan, pp_rank)?, plan))
}

/// The shard sizes (elements) of `table`'s ZeRO units over `dp` ranks, in segment order: each
/// segment's parameters not used by an earlier one, padded up to a multiple of dp.
fn unit_shards(table: &Holdings, dp: u64) -> Vec<u64> {
    let mut seen = std::collections::BTreeSet::new();
    let segments = table.chunks.iter().flat_map(|c| &c.segments);
    let units = segments.map(|s| {
        let owned = s.params.iter().filter(|h| seen.insert(h.name.clone()));
        owned.map(|h| h.numel() as u64).sum::<u64>()
    });
    units.map(|n| n.div_ceil(dp)).collect()
}

/// [`startup_bytes`] of pipeline rank `pp_rank` under `plan` (any of its dp, tp, ep ranks).
pub fn rank_startup_bytes(
    cfg: &GptConfig,
    plan: &ParallelPlan,
    pp_rank: usize,
) -> Result<u64, ActivationLayoutError> {
    Ok(startup_bytes(&rank_holdings(cfg, plan, pp_rank)?, plan))
}

/// The holdings table of the first rank (dp 0, tp 0) of pipeline rank `pp_rank`: every rank of
/// a pipeline rank holds as many elements (tp splits evenly, each ep rank holds E/ep experts).
fn rank_holdings(
    cfg: &GptConfig,
    plan: &ParallelPlan,
    pp_rank: usize,
) -> Result<Holdings, ActivationLayoutError> {
    let dims = plan.dims;
    if pp_rank >= dims.pp.max(1) {
        return Err(ActivationLayoutError::Pipeline(format!(
            "pipeline rank {pp_rank} is not in a pipeline of {}",
            dims.pp
        )));
    }
    Holdings::of_rank(cfg, plan, dims.coords(dims.rank_of(0, pp_rank, 0)))
        .map_err(|e| ActivationLayoutError::Pipeline(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sixteen_bytes_per_parameter_and_zero_division() {
        let n = 1_000_003;
        assert_eq!(ModelStateLayout::fp32_adam(n).total(), 16 * n);
        assert_eq!(ModelStateLayout::mixed_adam(n).total(), 16 * n);
        let z3 = ModelStateLayout::mixed_adam(n).with_zero(3, 8);
        assert_eq!(z3.params(), (2 * n).div_ceil(8));
        assert_eq!(z3.optim(), (12 * n).div_ceil(8));
        let z1 = ModelStateLayout::mixed_adam(n).with_zero(1, 4);
        assert_eq!(
            (z1.params(), z1.grads(), z1.optim()),
            (2 * n, 2 * n, (12 * n).div_ceil(4))
        );
    }
    /// In fp32 the plan's model state is the table `parallel/src/fsdp.rs` states and its tests
    /// check against the bytes the data-parallel wrappers hold (Φ a multiple of dp, so the
    /// two ways of rounding a shard agree); in bf16 the same table reads 2 + 2 + 12 bytes.
    #[test]
    fn the_plans_model_state_is_what_zero_holds() {
        use mtrain_parallel::fsdp::{analytic_model_state, FsdpConfig, ZeroStage};
        let n = 1_000_000u64;
        for zero in [
            None,
            Some(ZeroStage::One),
            Some(ZeroStage::Two),
            Some(ZeroStage::Three),
        ] {
            let mut plan = ParallelPlan::new(mtrain_comm::MeshDims::new(4, 1, 1, 1));
            if let Some(stage) = zero {
                plan.data = DataParallelKind::Zero(FsdpConfig {
                    stage,
                    ..FsdpConfig::default()
                });
            }
            let ours = ModelStateLayout::for_plan(n, &plan);
            let held = analytic_model_state(zero, n as usize, 4);
            assert_eq!(
                (ours.params(), ours.grads(), ours.optim()),
                (held.params as u64, held.grads as u64, held.optimizer as u64),
                "{zero:?}"
            );
        }
        let mut plan = ParallelPlan::new(mtrain_comm::MeshDims::new(4, 1, 1, 1));
        plan.precision.param_dtype = candle_core::DType::BF16;
        plan.data = DataParallelKind::Zero(FsdpConfig {
            stage: ZeroStage::One,
            ..FsdpConfig::default()
        });
        let z1 = ModelStateLayout::for_plan(n, &plan);
        assert_eq!(
            (z1.params(), z1.grads(), z1.optim()),
            (2 * n + 2 * n / 4, 2 * n + 2 * n / 4, 12 * n / 4)
        );
    }
}
