//! Analytic memory: what one rank should hold, from the plan alone. Used by the per-step report
//! (next to the measured figures) and by `mtrain plan` (before anything runs), so both print
//! the same numbers.
//!
//! Model state ([`ModelStateLayout`]): bytes per parameter of each category, what the layout
//! divides each by, and the copies ZeRO-1/2 keep beside the full tensors. Activations
//! ([`rank_activation_bytes`]): Korthikanti et al. (2022) per block, per rank under a plan.

use mtrain_model::init::param_specs;
use mtrain_model::GptConfig;
use mtrain_parallel::placement::{is_expert_param, tp_placement, used_on_stage};
use mtrain_parallel::parallelize::{DataParallelKind, ParallelPlan};
use mtrain_parallel::pipeline::{Schedule, ScheduleKind, StageLayout};
use serde::Serialize;

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

/// What one rank's activations depend on under a parallel layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ActivationLayout {
    /// Blocks this rank holds, summed over its model chunks.
    pub blocks: usize,
    /// Model chunks (virtual stages) this rank holds: 1 except under interleaved 1F1B.
    pub chunks: usize,
    /// Whether this rank holds the last model stage (final LayerNorm, LM head, loss).
    pub holds_head: bool,
    /// Rows of one pipeline micro-batch, `B / M`.
    pub micro_batch: usize,
    /// Peak (micro-batch, chunk) pairs whose forward ran here while their backward had not.
    pub in_flight: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Sequence parallelism inside the tp group.
    pub sequence_parallel: bool,
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
    /// The whole model on one device: every block, one micro-batch of `batch` rows.
    pub fn single_device(cfg: &GptConfig, batch: usize) -> Self {
        Self {
            blocks: cfg.n_layer,
            chunks: 1,
            holds_head: true,
            micro_batch: batch,
            in_flight: 1,
            tp: 1,
            sequence_parallel: false,
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
        Ok(Self {
            blocks: mine.iter().map(|&s| layout.blocks(s).len()).sum(),
            chunks: mine.len().max(1),
            holds_head: mine.contains(&(layout.num_stages() - 1)),
            micro_batch: batch / m,
            in_flight: sim.peak_in_flight(pp_rank),
            tp: plan.dims.tp.max(1),
            sequence_parallel: plan.sequence_parallel && plan.dims.tp > 1,
        })
    }
}

/// Estimated activation bytes one rank keeps between forward and backward at its peak.
///
/// Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022),
/// §4: a transformer block stores, at 2 bytes per value, for `b` rows of `t` tokens, width `c`,
/// `h` heads and tensor-parallel degree `tp`
///
/// ```text
///   no tp                         b·t·c·(34 + 5·h·t/c)
///   tp, no sequence parallelism   b·t·c·(10 + 24/tp + 5·h·t/(c·tp))   (eq. 2: LayerNorm inputs,
///                                                                       dropout masks, residuals
///                                                                       replicated; attention and
///                                                                       MLP internals split)
///   tp with sequence parallelism  b·t·c·(34/tp + 5·h·t/(c·tp))          (eq. 3)
/// ```
///
/// scaled by `dtype_bytes / 2`. The head stores the logits, their softmax and its gradient,
/// `3·b·t·V / tp` values (vocab-parallel), on the rank holding the last stage only. The
/// embedding's output is block 0's input, already inside block 0's `34` on the first stage (its
/// backward needs only the token ids). On a rank with `L_r` blocks over `v` chunks and a peak of
/// `n` (micro-batch, chunk) pairs in flight, with `b = B / M`:
///
/// ```text
///   activations_r = n/v · (L_r · block(b) + head(b))                  (v = 1 unless interleaved;
///                                                                       for v > 1 an average chunk)
///   with checkpointing: n/v · (L_r · b·t·c·s/(tp if SP) + head(b)) + block(b)
///                       (every block's input kept, one block recomputed at a time)
/// ```
///
/// On one device (`L_r = L`, `n = v = tp = 1`, `b = B`) this is the whole model's
/// `L · block(B) + head(B)`.
pub fn rank_activation_bytes(
    cfg: &GptConfig,
    layout: &ActivationLayout,
    seq: usize,
    dtype_bytes: usize,
    checkpointing: bool,
) -> u64 {
    let (b, t, c, h) = (
        layout.micro_batch as f64,
        seq as f64,
        cfg.n_embd as f64,
        cfg.n_head as f64,
    );
    let tp = layout.tp.max(1) as f64;
    let scale = dtype_bytes as f64 / 2.0;
    let attention = 5.0 * h * t / (c * tp);
    let per_value = if layout.sequence_parallel {
        34.0 / tp + attention
    } else {
        10.0 + 24.0 / tp + attention
    };
    let per_block = b * t * c * per_value * scale;
    let head = if layout.holds_head {
        3.0 * b * t * cfg.vocab_size as f64 * dtype_bytes as f64 / tp
    } else {
        0.0
    };
    let blocks = layout.blocks as f64;
    let in_flight = layout.in_flight as f64 / layout.chunks.max(1) as f64;
    let total = if checkpointing {
        let input = b * t * c * dtype_bytes as f64;
        let input = if layout.sequence_parallel {
            input / tp
        } else {
            input
        };
        let recomputed = if layout.blocks > 0 { per_block } else { 0.0 };
        in_flight * (blocks * input + head) + recomputed
    } else {
        in_flight * (blocks * per_block + head)
    };
    total as u64
}

/// Estimated activation bytes of the whole model on one device for one batch of `batch` rows
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

    /// L = 4, C = 8, H = 2, V = 16, T = 4, 2-byte activations: per block at b rows
    /// `b·4·8·(34 + 5·2·4/8) = 1248·b` bytes, head `3·b·4·16·2 = 384·b` bytes.
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

    #[test]
    fn single_device_estimate_is_the_whole_model() {
        let cfg = small();
        // 4 blocks · 1248·4 + 384·4 = 4992·4 + 1536 = 21504.
        assert_eq!(activation_bytes(&cfg, 4, 4, 2, false), 21_504);
        // Checkpointing: 4 block inputs of 4·4·8·2 bytes + one block + head = 1024 + 4992 + 1536.
        assert_eq!(activation_bytes(&cfg, 4, 4, 2, true), 7_552);
        // GPT-2 124M: the paper's closed form, 12·b·t·c·(34 + 5·h·t/c) + 3·b·t·V·2.
        let g = GptConfig::gpt2_124m();
        let (b, t, c, h, v) = (8.0, 1024.0, 768.0, 12.0, 50304.0);
        let closed = 12.0 * b * t * c * (34.0 + 5.0 * h * t / c) + 3.0 * b * t * v * 2.0;
        assert_eq!(activation_bytes(&g, 8, 1024, 2, false), closed as u64);
    }

    #[test]
    fn pipeline_1f1b_holds_its_stage_blocks_times_micro_batches_in_flight() {
        let cfg = small();
        let mut plan = ParallelPlan::new(mtrain_comm::MeshDims::new(1, 2, 1, 1));
        plan.microbatches = 2;
        plan.schedule = ScheduleKind::OneFOneB;
        // B = 4 rows, M = 2: micro-batch b = 2; per block 1248·2 = 2496, head 384·2 = 768.
        let r0 = ActivationLayout::for_plan(&cfg, &plan, 0, 4).expect("rank 0");
        let r1 = ActivationLayout::for_plan(&cfg, &plan, 1, 4).expect("rank 1");
        assert_eq!(
            (r0.blocks, r0.micro_batch, r0.in_flight, r0.holds_head),
            (2, 2, 2, false)
        );
        assert_eq!(
            (r1.blocks, r1.micro_batch, r1.in_flight, r1.holds_head),
            (2, 2, 1, true)
        );
        // Rank 0: min(P − 0, M) = 2 in flight · 2 blocks · 2496 = 9984.
        assert_eq!(rank_activation_bytes(&cfg, &r0, 4, 2, false), 9_984);
        // Rank 1: min(P − 1, M) = 1 in flight · (2 · 2496 + 768) = 5760.
        assert_eq!(rank_activation_bytes(&cfg, &r1, 4, 2, false), 5_760);
        // GPipe keeps all M = 2 micro-batches on the last stage too: 2 · 5760.
        plan.schedule = ScheduleKind::GPipe;
        let g1 = ActivationLayout::for_plan(&cfg, &plan, 1, 4).expect("gpipe rank 1");
        assert_eq!(rank_activation_bytes(&cfg, &g1, 4, 2, false), 11_520);
        // A batch that does not split into M micro-batches is refused, naming both.
        let e = ActivationLayout::for_plan(&cfg, &plan, 0, 3).expect_err("3 rows, M = 2");
        assert!(e.to_string().contains("batch 3") && e.to_string().contains('2'));
    }

    #[test]
    fn tensor_parallel_splits_the_sharded_part_and_sequence_parallel_the_rest() {
        let cfg = small();
        let mut plan = ParallelPlan::new(mtrain_comm::MeshDims::new(1, 1, 2, 1));
        let tp = ActivationLayout::for_plan(&cfg, &plan, 0, 4).expect("tp 2");
        // b·t·c = 128; per value 10 + 24/2 + 5·2·4/(8·2) = 24.5 → 3136 per block;
        // 4 blocks + logits 3·4·4·16·2/2 = 768: 12544 + 768.
        assert_eq!(rank_activation_bytes(&cfg, &tp, 4, 2, false), 13_312);
        plan.sequence_parallel = true;
        let sp = ActivationLayout::for_plan(&cfg, &plan, 0, 4).expect("tp 2 + sp");
        // per value 34/2 + 2.5 = 19.5 → 2496 per block; 4 · 2496 + 768.
        assert_eq!(rank_activation_bytes(&cfg, &sp, 4, 2, false), 10_752);
        // tp = 1 gives back the single-device figure.
        let one = ActivationLayout::for_plan(
            &cfg,
            &ParallelPlan::new(mtrain_comm::MeshDims::new(1, 1, 1, 1)),
            0,
            4,
        )
        .expect("one rank");
        assert_eq!(
            rank_activation_bytes(&cfg, &one, 4, 2, false),
            activation_bytes(&cfg, 4, 4, 2, false)
        );
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
