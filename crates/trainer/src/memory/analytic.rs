//! Analytic memory: what one rank should hold, from the plan alone. Used by the per-step report
//! (next to the measured figures) and by `mtrain plan` (before anything runs), so both print
//! the same numbers.
//!
//! Model state ([`ModelStateLayout`]): bytes per parameter of each category, what the layout
//! divides each by, and the copies ZeRO-1/2 keep beside the full tensors. Activations
//! ([`rank_activation_bytes`]): Korthikanti et al. (2022) per block, per rank under a plan.

use mtrain_model::init::param_specs;
use mtrain_model::GptConfig;
use mtrain_parallel::ddp::DdpMode;
use mtrain_parallel::parallelize::{DataParallelKind, ParallelPlan};
use mtrain_parallel::pipeline::{Schedule, ScheduleKind, StageLayout};
use mtrain_parallel::placement::{is_expert_param, tp_placement, used_on_stage};
use serde::Serialize;

use super::kept::{self, BackwardPath, Dims, Routing, SegmentCost};

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
        let dp = plan.dims.dp.max(1) as u64;
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

/// Bytes of the gradient buckets standalone bucketed DDP holds for `n_params` parameters
/// (`standalone`: the layout runs that DDP): each bucket's flattened gradients and its
/// all-reduce's result, in the reduce dtype, both held until the bucket is waited on after the
/// backward (`parallel/src/ddp/buckets.rs`, `Ddp::finish_bucketed`) — two copies of the
/// gradients. A group of one averages nothing and has no bucket (the world of one).
pub fn bucket_bytes(plan: &ParallelPlan, n_params: u64, standalone: bool) -> u64 {
    match plan.data {
        DataParallelKind::Ddp(d) if standalone && d.mode == DdpMode::Bucketed && plan.dims.dp > 1 => {
            2 * plan.precision.grad_reduce_dtype().size_in_bytes() as u64 * n_params
        }
        _ => 0,
    }
}

/// Parameters pipeline rank `pp_rank` owns under `plan` (any tp or ep rank of it alike), from
/// the model's parameter list: the blocks of its stages (stage s runs on rank `s % pp`), the
/// embedding with the first stage, the final LayerNorm and the tied LM head (a copy of `wte`)
/// with the last; a weight counts what the tensor-parallel split rule leaves it ([`tp_placement`]), the experts 1/ep.
pub fn rank_params(
    cfg: &GptConfig,
    plan: &ParallelPlan,
    pp_rank: usize,
) -> Result<u64, ActivationLayoutError> {
    let (_, layout) = stage_layout(cfg, plan)?;
    let pp = plan.dims.pp.max(1);
    let mine: Vec<usize> = (0..layout.num_stages())
        .filter(|s| s % pp == pp_rank)
        .collect();
    let (tp, ep) = (plan.dims.tp.max(1), plan.dims.ep.max(1));
    let n = param_specs(cfg)
        .into_iter()
        .filter(|(name, _, _)| mine.iter().any(|&s| used_on_stage(name, s, &layout)))
        .map(|(name, shape, _)| {
            let numel: usize = shape.iter().product();
            let numel = if is_expert_param(&name) {
                numel / ep
            } else {
                numel
            };
            tp_placement(&name, false).local_numel(numel, tp)
        })
        .sum::<usize>();
    Ok(n as u64)
}

/// The schedule a plan actually runs and its blocks per model stage.
fn stage_layout(
    cfg: &GptConfig,
    plan: &ParallelPlan,
) -> Result<(ScheduleKind, StageLayout), ActivationLayoutError> {
    let layout = plan
        .stage_layout(cfg.n_layer)
        .map_err(|e| ActivationLayoutError::Pipeline(e.to_string()))?;
    Ok((plan.effective_schedule(), layout))
}

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
    /// ZeRO-3 (FSDP): each segment's weights are gathered for its forward.
    pub gathers_weights: bool,
    /// The rows each of this rank's MoE blocks dispatched per pass, in block order (empty: an
    /// even split with every slot filled, [`Routing::even`]).
    pub routing: Vec<Routing>,
    /// Parameters of each of this rank's segments in forward order (the embedding, the blocks,
    /// the head; the tied `wte` with the head where the rank holds it, whose backward runs first).
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

/// Parameters of each segment on `stages` in forward order, counted as [`rank_params`] counts.
fn segment_params(
    cfg: &GptConfig,
    plan: &ParallelPlan,
    layout: &StageLayout,
    stages: &[usize],
) -> Vec<u64> {
    let (tp, ep) = (plan.dims.tp.max(1), plan.dims.ep.max(1));
    let last = layout.num_stages() - 1;
    let holds_head = stages.contains(&last);
    let mut blocks: Vec<usize> = stages.iter().flat_map(|&s| layout.blocks(s)).collect();
    blocks.sort_unstable();
    // Slot 0: embedding, 1..=blocks: the blocks, last: the head.
    let mut per = vec![0u64; blocks.len() + 2];
    for (name, shape, _) in param_specs(cfg) {
        if !stages.iter().any(|&s| used_on_stage(&name, s, layout)) {
            continue;
        }
        let numel: usize = shape.iter().product();
        let numel = if is_expert_param(&name) {
            numel / ep
        } else {
            numel
        };
        let n = tp_placement(&name, false).local_numel(numel, tp) as u64;
        let slot = match name.split('.').collect::<Vec<_>>().as_slice() {
            ["h", i, ..] => i
                .parse::<usize>()
                .ok()
                .and_then(|i| blocks.iter().position(|&b| b == i))
                .map_or(0, |p| p + 1),
            ["ln_f", ..] => per.len() - 1,
            ["wte", ..] if holds_head => per.len() - 1,
            _ => 0,
        };
        per[slot] += n;
    }
    let mut out = Vec::with_capacity(per.len());
    if stages.contains(&0) {
        out.push(per[0]);
    }
    out.extend(&per[1..per.len() - 1]);
    if holds_head {
        out.push(per[per.len() - 1]);
    }
    out
}

impl ActivationLayout {
    /// The whole model on one device: every segment, one micro-batch of `batch` rows.
    pub fn single_device(cfg: &GptConfig, batch: usize) -> Self {
        let plan = ParallelPlan::new(mtrain_comm::MeshDims::new(1, 1, 1, 1));
        let layout = StageLayout::even(cfg.n_layer, 1).expect("one stage holds every block");
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
            gathers_weights: false,
            routing: Vec::new(),
            segment_params: segment_params(cfg, &plan, &layout, &[0]),
        }
    }

    /// Pipeline rank `pp_rank`'s part under `plan`, for a per-rank batch of `batch` rows: its
    /// blocks from the plan's stage layout (model stage s runs on rank `s % pp`), the micro-batch
    /// `batch / M`, and the peak in flight from the schedule's simulation (1F1B: `min(P − r, M)`,
    /// GPipe: `M`).
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
        let (kind, layout) = stage_layout(cfg, plan)?;
        let err = |e: String| ActivationLayoutError::Pipeline(e);
        let mine: Vec<usize> = (0..layout.num_stages())
            .filter(|s| s % pp == pp_rank)
            .collect();
        let sim = Schedule::new(kind, pp, m)
            .and_then(|s| s.simulate())
            .map_err(|e| err(e.to_string()))?;
        let zero3 = matches!(plan.data, DataParallelKind::Zero(z) if z.stage as u8 == 3)
            && plan.dims.dp > 1;
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
            gathers_weights: zero3,
            routing: Vec::new(),
            segment_params: segment_params(cfg, plan, &layout, &mine),
        })
    }
}

/// What one rank holds through a step beyond the model state it starts the step with,
/// predicted from what the segments keep (`memory/kept.rs`): the moments the report measures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StepMemory {
    /// Held at the end of the forward (before the first backward): what every segment pass in
    /// flight keeps, the engine's leaf copies of the segment inputs included.
    pub activations: u64,
    /// ZeRO-3 weights gathered by the forward still held at its end: by its graphs until
    /// their backward, or (checkpointing) the last segment's.
    pub gathered: u64,
    /// Gradients already written when the reported forward ends: the earlier micro-steps'
    /// under gradient accumulation (the report reads the last micro-step's forward).
    pub earlier_grads: u64,
    /// The step's highest level above its start: the largest moment of the first backward
    /// (what is still held, the segment's backward at its worst, the gradients so far), or the
    /// end of the forward if that is higher.
    pub peak: u64,
}

/// The step memory of one rank with layout `layout`, `seq` tokens per row, `dtype_bytes` per
/// value, on the backward path `path`; `param_bytes` and `grad_bytes` per parameter of the
/// rank's model state (gathered weights, gradients written during the backward).
///
/// ```text
///   pass      = Σ over the rank's segments of (input copy + kept)          (one micro-batch, all chunks)
///   checkpointing: pass = Σ input copies, and each backward first recomputes its segment (+ kept)
///   activations = n/v · pass                   (n (micro-batch, chunk) pairs in flight over v chunks)
///   peak      = max over the first backward's segments j (last to first) of
///               activations − Σ_{i after j} (input + kept)_i / v + transient_j (+ kept_j recomputed)
///               + gradients of the segments after j and j + gathered weights not yet released
///   (with M > 1 passes also the last backward: one pass in flight, every gradient written)
/// ```
///
/// On one device (`n = v = tp = 1`, `b = B`) this is the whole model's single pass.
#[allow(clippy::too_many_arguments)]
pub fn rank_step_memory(
    cfg: &GptConfig,
    layout: &ActivationLayout,
    seq: usize,
    dtype_bytes: usize,
    checkpointing: bool,
    path: BackwardPath,
    param_bytes: u64,
    grad_bytes: f64,
) -> StepMemory {
    let d = Dims {
        b: layout.micro_batch as f64,
        t: seq as f64,
        c: cfg.n_embd as f64,
        h: cfg.n_head as f64,
        v: cfg.vocab_size as f64,
        tp: layout.tp.max(1) as f64,
        sp: layout.sequence_parallel,
        w: dtype_bytes as f64,
    };
    let block_cost = |i: usize| match &cfg.moe {
        None => kept::block(&d, path),
        Some(m) => {
            let even = Routing::even(d.b * d.t, m.n_experts, m.top_k, layout.ep);
            let r = layout.routing.get(i).copied().unwrap_or(even);
            kept::moe_block(&d, m.n_experts, layout.ep, &r)
        }
    };
    let mut segs: Vec<SegmentCost> = Vec::with_capacity(layout.blocks + 2);
    if layout.holds_embedding {
        segs.push(kept::embedding(&d, path));
    }
    segs.extend((0..layout.blocks).map(block_cost));
    if layout.holds_head {
        segs.push(kept::head(&d, path));
    }
    let held = |s: &SegmentCost| match checkpointing {
        true => s.input,
        false => s.input + s.kept,
    };
    let v = layout.chunks.max(1) as f64;
    let n = layout.in_flight.max(1) as f64;
    // A stage that ends in a block also keeps its output (sent on) under checkpointing.
    let sent = match checkpointing && !layout.holds_head {
        true => d.nc_local() * d.w,
        false => 0.0,
    };
    let pass: f64 = segs.iter().map(held).sum::<f64>() + sent;
    let activations = n / v * pass;

    let params = &layout.segment_params;
    let total_params = params.iter().sum::<u64>().max(1) as f64;
    // Without checkpointing the graphs hold every gathered weight; with it, the forward frees
    // each segment's weights when the next one starts, so the last segment's stay.
    let gathered = match (layout.gathers_weights, checkpointing) {
        (true, false) => (param_bytes as f64) * total_params,
        (true, true) => (param_bytes * params.last().copied().unwrap_or(0)) as f64,
        (false, _) => 0.0,
    };
    // Under checkpointing ZeRO-3 gathers a segment again for its recompute, with the previous
    // one prefetched: the two largest consecutive segments.
    let regathered = match layout.gathers_weights && checkpointing {
        true => {
            params
                .windows(2)
                .map(|w| (w[0] + w[1]) as f64)
                .fold(params.first().copied().unwrap_or(0) as f64, f64::max)
                * param_bytes as f64
        }
        false => 0.0,
    };
    let mut peak = activations + gathered;
    let (mut freed, mut done) = (0.0, 0.0);
    for (j, s) in segs.iter().enumerate().rev() {
        let p = params.get(j).copied().unwrap_or(0) as f64;
        done += p;
        let recomputed = if checkpointing { s.kept } else { 0.0 };
        let level = activations - freed
            + recomputed
            + s.transient
            + grad_bytes * done
            + gathered * (1.0 - (done - p) / total_params)
            + regathered;
        peak = peak.max(level);
        freed += held(s) / v;
    }
    // The step's last backward (with M > 1 passes): one pass left in flight, every gradient of
    // the rank already written by the earlier ones (and no gathered weights of the others).
    if layout.accumulates {
        let last = pass / v;
        let (mut freed, mut done) = (0.0, 0.0);
        for (j, s) in segs.iter().enumerate().rev() {
            let p = params.get(j).copied().unwrap_or(0) as f64;
            let recomputed = if checkpointing { s.kept } else { 0.0 };
            let left = gathered / n * (1.0 - done / total_params);
            let level = last - freed
                + recomputed
                + s.transient
                + grad_bytes * total_params
                + left
                + regathered;
            peak = peak.max(level);
            freed += held(s) / v;
            done += p;
        }
    }
    StepMemory {
        activations: activations as u64,
        gathered: gathered as u64,
        earlier_grads: 0,
        peak: peak as u64,
    }
}

/// [`rank_step_memory`] for a rank holding `state`: its weights' bytes per parameter for the
/// gathers, its gradient bytes spread over its parameters for the backward's gradients; with
/// `grad_accum > 1` micro-steps the later backwards run with every gradient written.
#[allow(clippy::too_many_arguments)]
pub fn step_memory(
    cfg: &GptConfig,
    layout: &ActivationLayout,
    state: &ModelStateLayout,
    seq: usize,
    dtype_bytes: usize,
    checkpointing: bool,
    path: BackwardPath,
    grad_accum: usize,
) -> StepMemory {
    let grad_per_param = state.grads() as f64 / state.n_params.max(1) as f64;
    let layout = ActivationLayout {
        accumulates: layout.accumulates || grad_accum > 1,
        ..layout.clone()
    };
    let step = rank_step_memory(
        cfg,
        &layout,
        seq,
        dtype_bytes,
        checkpointing,
        path,
        state.param_bytes,
        grad_per_param,
    );
    // The optimizer step, after the activations are gone: the gradients and its own worst
    // moment; the largest tensor it steps is a block's widest weight (or the tied embedding),
    // or under ZeRO a block unit's decayed shard.
    let (c, tp) = (cfg.n_embd as f64, layout.tp.max(1) as f64);
    let widest = (4.0 * c * c / tp).max(cfg.vocab_size as f64 * c / tp);
    let largest = match state.optim_shards > 1 {
        true => 12.0 * c * c / tp / state.optim_shards as f64,
        false => widest,
    } * 4.0;
    let gathered = match state.param_copy_shards {
        0 => 0.0,
        n => state.n_params as f64 * state.param_bytes as f64 * (1.0 + 1.0 / n as f64),
    };
    let optimizer = state.grads() as f64 + kept::optimizer_step(largest, gathered, path);
    StepMemory {
        earlier_grads: match grad_accum > 1 {
            true => state.grads(),
            false => 0,
        },
        peak: step.peak.max(optimizer as u64),
        ..step
    }
}

/// Estimated activation bytes one rank keeps at the end of its forward
/// ([`rank_step_memory`]'s `activations` on the autograd path).
pub fn rank_activation_bytes(
    cfg: &GptConfig,
    layout: &ActivationLayout,
    seq: usize,
    dtype_bytes: usize,
    checkpointing: bool,
) -> u64 {
    rank_step_memory(
        cfg,
        layout,
        seq,
        dtype_bytes,
        checkpointing,
        BackwardPath::Autograd,
        0,
        0.0,
    )
    .activations
}

/// The activation bytes of the whole model on one device for one batch of `batch` rows
/// ([`rank_activation_bytes`] with [`ActivationLayout::single_device`]).
pub fn activation_bytes(
    cfg: &GptConfig,
    batch: usize,
    seq: usize,
    dtype_bytes: usize,
    checkpointing: bool,
) -> u64 {
    rank_activation_bytes(
        cfg,
        &ActivationLayout::single_device(cfg, batch),
        seq,
        dtype_bytes,
        checkpointing,
    )
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

    fn small() -> GptConfig {
        GptConfig {
            vocab_size: 16,
            block_size: 4,
            n_layer: 4,
            n_head: 2,
            n_embd: 8,
            moe: None,
        }
    }

    fn step(cfg: &GptConfig, l: &ActivationLayout, ckpt: bool) -> StepMemory {
        rank_step_memory(cfg, l, 4, 4, ckpt, BackwardPath::Autograd, 4, 4.0)
    }

    /// One device: every segment's input copy and kept tensors, and a peak above them by at
    /// least one block's backward; each segment's parameters once (the tied `wte` once).
    #[test]
    fn single_device_holds_every_segment() {
        let cfg = small();
        let one = ActivationLayout::single_device(&cfg, 4);
        assert_eq!(
            one.segment_params.iter().sum::<u64>(),
            cfg.n_params() as u64,
            "{:?}",
            one.segment_params
        );
        assert_eq!(one.segment_params.len(), cfg.n_layer + 2);
        let d = Dims {
            b: 4.0,
            t: 4.0,
            c: 8.0,
            h: 2.0,
            v: 16.0,
            tp: 1.0,
            sp: false,
            w: 4.0,
        };
        let (e, b, h) = (
            kept::embedding(&d, BackwardPath::Autograd),
            kept::block(&d, BackwardPath::Autograd),
            kept::head(&d, BackwardPath::Autograd),
        );
        let pass = e.kept + 4.0 * (b.input + b.kept) + h.input + h.kept;
        let s = step(&cfg, &one, false);
        assert_eq!(s.activations, pass as u64);
        assert!(s.peak as f64 >= pass - h.input - h.kept + b.transient);
        assert_eq!(activation_bytes(&cfg, 4, 4, 4, false), s.activations);
        // Checkpointing keeps the five float inputs only.
        let c = step(&cfg, &one, true);
        assert_eq!(c.activations, (4.0 * b.input + h.input) as u64);
        assert!(c.peak < s.peak);
    }

    #[test]
    fn pipeline_1f1b_holds_its_stage_times_micro_batches_in_flight() {
        let cfg = small();
        let mut plan = ParallelPlan::new(mtrain_comm::MeshDims::new(1, 2, 1, 1));
        plan.microbatches = 2;
        plan.schedule = ScheduleKind::OneFOneB;
        let r0 = ActivationLayout::for_plan(&cfg, &plan, 0, 4).expect("rank 0");
        let r1 = ActivationLayout::for_plan(&cfg, &plan, 1, 4).expect("rank 1");
        assert_eq!(
            (
                r0.blocks,
                r0.micro_batch,
                r0.in_flight,
                r0.holds_head,
                r0.holds_embedding
            ),
            (2, 2, 2, false, true)
        );
        assert_eq!(
            (
                r1.blocks,
                r1.micro_batch,
                r1.in_flight,
                r1.holds_head,
                r1.holds_embedding
            ),
            (2, 2, 1, true, false)
        );
        // Rank 0 holds two micro-batches of half the rows: its pass over 2 blocks, twice.
        let half = ActivationLayout {
            in_flight: 1,
            ..r0.clone()
        };
        assert_eq!(
            step(&cfg, &r0, false).activations,
            2 * step(&cfg, &half, false).activations
        );
        // GPipe keeps all M = 2 micro-batches on the last stage too.
        plan.schedule = ScheduleKind::GPipe;
        let g1 = ActivationLayout::for_plan(&cfg, &plan, 1, 4).expect("gpipe rank 1");
        assert_eq!(
            step(&cfg, &g1, false).activations,
            2 * step(&cfg, &r1, false).activations
        );
        // A batch that does not split into M micro-batches is refused, naming both.
        let e = ActivationLayout::for_plan(&cfg, &plan, 0, 3).expect_err("3 rows, M = 2");
        assert!(e.to_string().contains("batch 3") && e.to_string().contains('2'));
    }

    /// ZeRO-3 without checkpointing: the forward's graphs hold every gathered weight.
    #[test]
    fn fsdp_forward_holds_the_gathered_weights() {
        use mtrain_parallel::fsdp::{FsdpConfig, ZeroStage};
        let cfg = small();
        let mut plan = ParallelPlan::new(mtrain_comm::MeshDims::new(2, 1, 1, 1));
        plan.data = DataParallelKind::Zero(FsdpConfig {
            stage: ZeroStage::Three,
            ..FsdpConfig::default()
        });
        let l = ActivationLayout::for_plan(&cfg, &plan, 0, 4).expect("fsdp");
        assert!(l.gathers_weights);
        let s = step(&cfg, &l, false);
        assert_eq!(s.gathered, 4 * cfg.n_params() as u64);
        // With checkpointing only the last segment's weights are still gathered: the head's.
        let head = *l.segment_params.last().expect("a head");
        assert_eq!(step(&cfg, &l, true).gathered, 4 * head);
    }

    #[test]
    fn checkpointing_shrinks_the_activation_estimate() {
        let cfg = GptConfig::gpt2_124m();
        let full = activation_bytes(&cfg, 8, 1024, 2, false);
        let ckpt = activation_bytes(&cfg, 8, 1024, 2, true);
        assert!(ckpt * 3 < full, "{ckpt} vs {full}");
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
