//! The training step of a composed model: one micro-step's pipeline pass with the strategy's hooks,
//! the gradient fix-ups after the data-parallel reduction, the global gradient norm and the
//! optimizer step. [`ParallelModel`] is what [`crate::parallelize::parallelize`] builds; its
//! layout-independent state (gather, reshard) is in [`crate::state`].
//!
//! ```text
//!   for micro-step k of K:  forward_backward(x_k, y_k, 1/K, sync = k == K-1)
//!                             executor runs the schedule's actions with the chunk's hooks
//!                             (ZeRO: gather / free / reduce-scatter; one stage with dp > 1:
//!                             each gradient's dp average starts in the last backward)
//!                             sync: finish_grads = dp average, Σ tp partial, Σ tied wte
//!   norm² = grad_norm_sq()    one all-reduce over the world
//!   scaled_step(opt, lr, clip_coef(norm, max))   scale, AdamW (fp32 masters), ZeRO write-back
//! ```
//!
//! **Data parallelism under the pipeline.** The executor runs the engine's passes; it hands each
//! pass the engine hooks of its chunk ([`StageHooks`]) and says which backward is the chunk's last
//! of the step. Under ZeRO those hooks are [`crate::fsdp::Fsdp`]'s own: at stage 3 the units are
//! gathered before each segment and freed after it in every micro-batch's forward and backward, and
//! stages 2 and 3 reduce-scatter after every micro-batch's backward (stage 1 after the chunk's last
//! one), so `--pp 2 --dp 2 --zero 3` really holds 1/dp of each stage's weights. Under DDP with one
//! stage each gradient's average starts inside the last backward as soon as it is final
//! ([`crate::ddp::OverlappedDpReduce`]); with a pipeline the gradients accumulate over the
//! micro-batches and are averaged once after the flush (Megatron's default;
//! [`crate::ddp::average`]). Expert gradients are averaged over their edp replicas.
//!
//! **Linear fix-ups after the reduction.** Two gradients are incomplete on a single rank: under
//! sequence parallelism the LayerNorms, `wpe` and row-parallel biases saw only 1/tp of the tokens
//! (Σ over tp, [`crate::placement::sp_partial`]), and the tied `wte` on the first and last stage
//! saw only one of its two uses (Σ over those two pp ranks). Both are sums, and sums commute with
//! the data-parallel average, so they are applied once, after it, to whatever the strategy keeps:
//! full gradients ([`ShardLayout::sync_partial_grads`], [`PipelineStages::sync_tied_grads`]) or
//! ZeRO shards ([`crate::fsdp::Fsdp::all_reduce_grads_of`]; for `wte`, the full gradient gathered
//! over dp, exchanged over pp, and the peer's part added to the shard).
//!
//! **Gradient norm, once per step.** Σ g² over every element of the model: each rank weighs a
//! parameter 1 or 0 (counted on tp rank 0 if it is replicated over tp, on the first stage if it is
//! the tied `wte`, on dp rank 0 if its gradient is replicated over dp — ZeRO shards are disjoint
//! and always count, an expert on its edp replica 0) and one all-reduce over the world adds it up.
//! The loop asks for it ([`ParallelModel::grad_norm_sq`]) and passes the clip coefficient to
//! [`ParallelModel::scaled_step`], which uses it as given.
//!
//! **One sync interface** ([`grad_sync`]). What differs by the replicas' kind is chosen there: the
//! hooks a step runs (DDP's buckets, one average per parameter, the average after the flush, ZeRO's
//! hooks), the fix-ups on full gradients or on shards, which elements a rank counts in the norm,
//! and what the optimizer steps. This file calls the executor once, with the sync's hooks, and
//! asks the sync for the rest.
//!
//! **Mixed precision** ([`ParallelPlan::precision`]). Gradients are cast to the reduce dtype before
//! the first reduction (dp, sequence-parallel sums, tied `wte`); ZeRO reduce-scatters in it; AdamW
//! steps the fp32 masters ([`crate::mixed_precision::MasterWeights`]) and copies them into the bf16
//! weights.
//!
//! Legend: `B` batch, `T` time, `C` width, `M` micro-batches, `S` model stages.

use std::collections::BTreeSet;

use candle_core::{DType, Tensor};
use mtrain_comm::{Comm, CommError, Coords, ReduceOp};
use mtrain_model::optim::{AdamW, GradScale};
use mtrain_model::{Engine, GptConfig, Grads, Hooks, MoeStats, Param, SequenceChunks, StepDraw};

use crate::context_parallel::take_chunks;
use crate::ddp::DpError;
use crate::expert_parallel::{self, EpError};
use crate::mixed_precision::PrecisionError;
use crate::pipeline::{PipelineError, PipelineExecutor, PipelineStages, StageHooks, StepReport};
use crate::placement::{is_expert_param, tp_placement, Placement};
use crate::plan::{ParallelPlan, PlanError};
use crate::tensor_parallel::{ShardLayout, TpError};
use crate::toolbox::{clipped_step, CommStats, ModelStateBytes, StateError};

pub(crate) mod grad_sync;

use grad_sync::SyncCtx;
pub(crate) use grad_sync::{FullReplicas, Replicas};

/// Errors of composing the strategies.
#[derive(Debug, thiserror::Error)]
pub enum ParallelizeError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("the plan is for {plan} but the mesh is {mesh}")]
    MeshMismatch { plan: String, mesh: String },
    /// The model built differs from the holdings table ([`crate::holdings`]).
    #[error("the model built on rank {rank:?} does not hold what the holdings table says: {why}")]
    Holdings {
        rank: mtrain_comm::Coords,
        why: String,
    },
    #[error(transparent)]
    State(#[from] StateError),
    #[error(transparent)]
    Precision(#[from] PrecisionError),
    #[error(transparent)]
    Tp(#[from] TpError),
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    #[error(transparent)]
    Ep(#[from] EpError),
    #[error(transparent)]
    Dp(#[from] DpError),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, ParallelizeError>;

/// What one micro-step reports.
#[derive(Debug, Clone)]
pub struct StepOut {
    /// Mean loss over the global batch, identical on every rank.
    pub loss: f64,
    /// Auxiliary (MoE) loss over the whole model, averaged over the global batch.
    pub aux_loss: f64,
    /// The pipeline's measurements on this rank (None when pp = 1).
    pub pipeline: Option<StepReport>,
    /// Tokens per expert and drops of this rank's MoE layers, summed over the dp group.
    pub moe_load: Option<Vec<MoeStats>>,
}

/// This rank's part of the model under a plan, with the training-step API (built by
/// [`crate::parallelize::parallelize`]).
pub struct ParallelModel {
    pub(crate) plan: ParallelPlan,
    pub(crate) cfg: GptConfig,
    pub(crate) coords: Coords,
    pub(crate) world: Comm,
    /// The group gradients and losses are averaged over: dp, or dp × cp (dcp).
    pub(crate) dp: Comm,
    /// This rank's chunks of each sequence under context parallelism.
    pub(crate) chunks: Option<SequenceChunks>,
    pub(crate) pp: Comm,
    pub(crate) tp: Comm,
    pub(crate) edp: Comm,
    pub(crate) engine: Engine,
    pub(crate) stages: PipelineStages,
    pub(crate) executor: PipelineExecutor,
    /// The tensor-parallel placement of every parameter (tp > 1).
    pub(crate) layout: Option<ShardLayout>,
    /// Parameters whose gradient is partial over tp (sequence parallelism), held here.
    pub(crate) partial: BTreeSet<String>,
    /// Tied parameters held by this rank's first or last stage (pp > 1).
    pub(crate) tied: BTreeSet<String>,
    /// This rank's parameters, each once, in model order.
    pub(crate) params: Vec<Param>,
    /// The gradient sync, by kind ([`grad_sync`]).
    pub(crate) replicas: Replicas,
    pub(crate) grads: Grads,
    pub(crate) current: CommStats,
    pub(crate) last: CommStats,
    /// The dropout of the next micro-steps ([`ParallelModel::set_dropout`]).
    pub(crate) dropout: Option<StepDraw>,
}

/// Stage hooks that also call an observer at the rank's activation peak.
struct Observed<'a>(&'a mut dyn StageHooks, &'a mut dyn FnMut());

impl StageHooks for Observed<'_> {
    fn hooks(&mut self, chunk: usize, last_backward: bool) -> &mut dyn Hooks {
        self.0.hooks(chunk, last_backward)
    }
    fn at_activation_peak(&mut self) {
        self.0.at_activation_peak();
        (self.1)()
    }
}

pub(crate) fn f64_of(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.to_vec1::<f64>()?)
}

impl ParallelModel {
    /// The plan this model was built from.
    pub fn plan(&self) -> &ParallelPlan {
        &self.plan
    }

    /// This rank's pipeline stages.
    pub fn stages(&self) -> &PipelineStages {
        &self.stages
    }

    /// This rank's parameters (tp shards, its stages, its experts), each once.
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// The dropout of the following micro-steps (the loop sets it before each; None: none).
    /// This rank's rows of the global batch are rows `dp_rank · B_local ..` of `dp · B_local`.
    pub fn set_dropout(&mut self, draw: Option<StepDraw>) {
        self.dropout = draw;
    }

    /// One micro-step on this rank's data-parallel slice (B_local, T); all tp/pp/cp ranks of one
    /// dp index pass the same batch (under context parallelism each takes its chunks of it). Gradients accumulate; `sync` marks the last micro-step, after
    /// which the gradients are reduced and complete. `loss_scale` multiplies the gradients (1/K
    /// for K micro-steps).
    pub fn forward_backward(
        &mut self,
        idx: &Tensor,
        targets: &Tensor,
        loss_scale: f64,
        sync: bool,
    ) -> Result<StepOut> {
        self.forward_backward_observed(idx, targets, loss_scale, sync, &mut || {})
    }

    /// [`ParallelModel::forward_backward`], calling `before_backward` once, where this rank's
    /// activations peak ([`StageHooks::at_activation_peak`]: right before the first backward
    /// pass, or under a split backward the forward that first fills the schedule's peak; the
    /// memory report's "after forward" on a pipeline).
    pub fn forward_backward_observed(
        &mut self,
        idx: &Tensor,
        targets: &Tensor,
        loss_scale: f64,
        sync: bool,
        before_backward: &mut dyn FnMut(),
    ) -> Result<StepOut> {
        let t = std::time::Instant::now();
        let (idx, targets) = &self.own_chunks(idx, targets)?; // (B_local, T/cp) under cp
        // This rank's rows of the global batch: its dp index's (the cp ranks of one dp index
        // hold the same rows, each its chunks of them).
        let rows = idx.dim(0)?;
        let (dp_rank, dp) = (self.coords.dp, self.plan.dims.dp);
        let draw = self.dropout.map(|d| d.rows(dp_rank * rows, dp * rows));
        self.executor.set_dropout(draw);
        let ctx = SyncCtx {
            plan: &self.plan,
            dp: &self.dp,
            edp: &self.edp,
            tp: &self.tp,
            pp: &self.pp,
            params: &self.params,
            stages: &self.stages,
            layout: self.layout.as_ref(),
            partial: &self.partial,
            tied: &self.tied,
            recompute: self.engine.checkpointing,
        };
        // The step's gradient sync, by kind ([`grad_sync`]): the executor runs the step once,
        // with its hooks.
        let mut step_sync = self.replicas.begin(&ctx, sync);
        let report = self.executor.step_with_hooks(
            &self.stages,
            self.pp.as_ref(),
            idx,
            targets,
            loss_scale,
            &mut self.grads,
            &mut Observed(step_sync.hooks(), before_backward),
        )?;
        step_sync.finish(&mut self.grads, &self.dp, &mut self.current)?;
        self.current.backward_s += t.elapsed().as_secs_f64();
        if sync {
            self.replicas
                .finish_grads(&ctx, &mut self.grads, &mut self.current)?;
        }
        // The loss is already the same on every pp rank; the aux losses are per stage.
        let aux = match self.plan.dims.pp {
            1 => report.aux_loss,
            _ => f64_of(&self.pp.all_reduce(
                &Tensor::new(&[report.aux_loss], self.pp.device())?,
                ReduceOp::Sum,
            )?)?[0],
        };
        // A group of one has nothing to average (and no copy to make to the device and back).
        let avg = match self.dp.size() {
            1 => vec![report.loss, aux],
            _ => {
                let both = Tensor::new(&[report.loss, aux], self.dp.device())?;
                f64_of(&self.dp.all_reduce(&both, ReduceOp::Avg)?)?
            }
        };
        let moe_load = match (&self.cfg.moe, report.moe_stats.is_empty()) {
            (Some(_), false) => Some(
                expert_parallel::total_load(&report.moe_stats, &self.dp)
                    .map_err(ParallelizeError::from)?,
            ),
            _ => None,
        };
        Ok(StepOut {
            loss: avg[0],
            aux_loss: avg[1],
            pipeline: (self.plan.dims.pp > 1).then_some(report),
            moe_load,
        })
    }

    /// 1 if this rank counts `name`'s gradient elements in the global norm, else 0.
    fn norm_weight(&self, name: &str, sharded_over_dp: bool) -> f64 {
        let c = &self.coords;
        let over_dp = sharded_over_dp
            || match is_expert_param(name) {
                true => c.edp == 0,
                false => c.dp == 0 && c.cp == 0,
            };
        let over_tp = matches!(tp_placement(name, false), Placement::Sharded { .. }) || c.tp == 0;
        let over_pp = !self.tied.contains(name) || c.pp == 0;
        if over_dp && over_tp && over_pp {
            1.0
        } else {
            0.0
        }
    }

    /// Σ g² of the whole model's reduced gradient, every element counted once; the same on every
    /// rank (an all-reduce over the world).
    pub fn grad_norm_sq(&self) -> Result<f64> {
        Ok(f64_of(&self.grad_norm_sq_on_device()?.flatten_all()?)?[0])
    }

    /// [`ParallelModel::grad_norm_sq`] as one f64 on the world's device, not read back: on CUDA
    /// the sum, and the all-reduce over the world, are queued without the host waiting, so the
    /// clip coefficient and the optimizer step can be queued behind them
    /// ([`mtrain_model::optim::clip_coef_on_device`], [`ParallelModel::scaled_step`]).
    pub fn grad_norm_sq_on_device(&self) -> Result<Tensor> {
        let local = self.replicas.local_norm_sq_on_device(
            &self.grads,
            &|n, sharded| self.norm_weight(n, sharded),
            self.world.device(),
        )?;
        if self.world.size() == 1 {
            return Ok(local);
        }
        let t = local.reshape(1)?; // (1,)
        Ok(self.world.all_reduce(&t, ReduceOp::Sum)?.reshape(())?)
    }

    /// Clips to `max_grad_norm` (if given), steps `opt` over this rank's parameters or shards and
    /// clears the gradients. Returns the global gradient norm before clipping. The norm is
    /// computed once ([`ParallelModel::grad_norm_sq`]) and its coefficient handed to
    /// [`ParallelModel::scaled_step`]: a caller that already holds the norm calls that instead.
    pub fn optimizer_step(
        &mut self,
        opt: &mut AdamW,
        lr: f64,
        max_grad_norm: Option<f64>,
    ) -> Result<f64> {
        clipped_step(self.grad_norm_sq()?, max_grad_norm, |clip| {
            self.scaled_step(opt, lr, clip)
        })
    }

    /// Steps `opt` over this rank's parameters or shards with the gradients multiplied by
    /// `grad_scale` inside the update (the clip coefficient of the global norm, used as given; 1
    /// leaves them alone) and clears the gradients. No collective beyond ZeRO's write-back of
    /// the updated shards.
    pub fn scaled_step(
        &mut self,
        opt: &mut AdamW,
        lr: f64,
        grad_scale: impl Into<GradScale>,
    ) -> Result<()> {
        let busy = self.replicas.step(
            opt,
            lr,
            grad_scale.into(),
            &self.params,
            &self.grads,
            &self.dp,
        )?;
        self.grads.clear();
        if let Some(busy) = busy {
            self.current.comm_s = busy;
        }
        self.last = std::mem::take(&mut self.current);
        Ok(())
    }

    /// Mean loss of the batch without gradients, the same on every rank: the pipeline's
    /// forward ([`PipelineStages::forward_only`]), then the average over dp.
    pub fn eval_loss(&mut self, idx: &Tensor, targets: &Tensor) -> Result<f64> {
        let (idx, targets) = &self.own_chunks(idx, targets)?; // (B_local, T/cp) under cp
        let (engine, replicas) = (&self.engine, &mut self.replicas);
        let chunks = self.stages.chunks();
        let loss = self.stages.forward_only(self.pp.as_ref(), idx, targets, |k, x, tgt| {
            replicas.forward_chunk(k, |hooks| {
                Ok(engine.forward(&chunks[k].segments, x, tgt, hooks)?.output)
            })
        })?;
        let avg = self
            .dp
            .all_reduce(&Tensor::new(&[loss], self.dp.device())?, ReduceOp::Avg)?;
        Ok(f64_of(&avg)?[0])
    }

    /// This rank's rows of a batch: its two chunks of each sequence under context parallelism
    /// ([`crate::context_parallel::take_chunks`]), else the batch.
    fn own_chunks(&self, idx: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok(match self.chunks {
            Some(ch) => (take_chunks(idx, ch)?, take_chunks(targets, ch)?),
            None => (idx.clone(), targets.clone()),
        })
    }

    /// Bytes of the parameters, gradients and optimizer moments this rank holds right now.
    pub fn model_state_bytes(&self, opt: &AdamW) -> ModelStateBytes {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let grads: usize = self.grads.iter().map(|(_, g)| bytes(g)).sum();
        self.replicas.model_state_bytes(opt, &self.params, grads)
    }

    /// Communication figures of the last completed optimizer step (ZeRO: its collectives; DDP:
    /// the reduction after the flush).
    pub fn comm_stats(&self) -> CommStats {
        self.replicas.comm_stats(self.last)
    }
}
