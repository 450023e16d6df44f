//! The gradient sync of a composed model, by kind: the one interface through which the runtime
//! runs a step's hooks, finishes the reduction, counts the norm and steps the optimizer. The
//! runtime asks it and never which kind it is.
//!
//! ```text
//!   kind                  during the step (hooks)            after it         after the last
//!   Full: DDP buckets     BucketedDpReduce, last backward    wait, write      Σ tp, Σ tied wte
//!   Full: overlapped      OverlappedDpReduce, last backward  wait, write      Σ tp, Σ tied wte
//!   Full: after flush     nothing (pipeline, naive DDP)      -                dp avg, Σ tp, tied
//!   Zero: ZeRO 1/2/3      Fsdp's hooks on each chunk's pass  last reductions  Σ tp, tied (shards)
//!
//!   norm: Full counts a gradient on its dp (edp) replica 0; Zero's shards are disjoint over dp
//!   step: Full steps the replicated parameters (fp32 masters under mixed precision);
//!         Zero steps every chunk's shards, then writes them back (all-gather)
//! ```
//!
//! Gradients are cast to the reduce dtype before the first reduction (mixed precision); ZeRO
//! reduce-scatters in it.

use std::collections::{BTreeMap, BTreeSet};

use candle_core::{Device, Tensor};
use mtrain_comm::Comm;
use mtrain_kernels::reduce::sq_sum_f64_all_on_device;
use mtrain_model::optim::{AdamW, GradScale, OptimItem};
use mtrain_model::{Grads, Hooks, NoHooks, Param};

use crate::ddp::{average, Bucket, BucketedDpReduce, DdpMode, OverlappedDpReduce};
use crate::fsdp::{Fsdp, FsdpHooks, ZeroStage};
use crate::mixed_precision::{grads_for_reduction, MasterWeights};
use crate::pipeline::{NoStageHooks, PipelineStages, StageHooks};
use crate::plan::{DataParallelKind, ParallelPlan};
use crate::tensor_parallel::ShardLayout;
use crate::toolbox::{replicated_items, CommStats, ModelStateBytes, OpTimer};

use super::Result;

/// Full replicas: every rank's gradients in the model's `grads`, averaged over dp (experts over
/// edp).
#[derive(Default)]
pub(crate) struct FullReplicas {
    /// The DDP buckets ([`ParallelPlan::dp_buckets`]; indices into the model's params), or
    /// empty: one average per parameter.
    pub(crate) buckets: Vec<Bucket>,
    /// fp32 masters of the params under mixed precision.
    pub(crate) masters: Option<MasterWeights>,
    /// This step's gradients were averaged over dp during the last backward.
    reduced: bool,
    /// The dp group's busy time of the step in progress.
    dp_timer: Option<OpTimer>,
}

impl FullReplicas {
    /// Full replicas averaged in `buckets` (empty: one average per parameter).
    pub(crate) fn new(buckets: Vec<Bucket>) -> Self {
        Self {
            buckets,
            ..Self::default()
        }
    }
}

/// How the data-parallel part keeps and syncs gradients.
pub(crate) enum Replicas {
    Full(FullReplicas),
    /// One ZeRO strategy over every stage chunk of the rank ([`Fsdp::over_chunks`]); gradients
    /// live in its shards.
    Zero(Box<Fsdp>),
}

/// What the sync reads of the model around it.
pub(crate) struct SyncCtx<'m> {
    pub plan: &'m ParallelPlan,
    pub dp: &'m Comm,
    pub edp: &'m Comm,
    pub tp: &'m Comm,
    pub pp: &'m Comm,
    pub params: &'m [Param],
    pub stages: &'m PipelineStages,
    pub layout: Option<&'m ShardLayout>,
    /// Parameters whose gradient is partial over tp (sequence parallelism).
    pub partial: &'m BTreeSet<String>,
    /// Tied parameters held by this rank's first or last stage.
    pub tied: &'m BTreeSet<String>,
    /// Activation checkpointing (ZeRO-3 re-gathers for the recompute).
    pub recompute: bool,
}

/// One micro-step's sync: the hooks the executor runs, and what is finished after it.
pub(crate) enum StepSync<'a> {
    /// DDP in buckets, launched as the last backward makes them final (one stage).
    Buckets {
        hooks: BucketedDpReduce<'a>,
        timer: &'a mut Option<OpTimer>,
        reduced: &'a mut bool,
    },
    /// One average per parameter started inside the last backward (one stage; experts over
    /// edp).
    Overlapped {
        hooks: OverlappedDpReduce<'a>,
        reduced: &'a mut bool,
    },
    /// Nothing during the step: the average runs after the flush (a pipeline, DDP's naive
    /// mode, or not the last micro-step).
    AfterFlush(NoStageHooks),
    /// ZeRO's hooks on every chunk: gathers, frees, reduce-scatters.
    Zero(ZeroStageHooks<'a>),
}

/// ZeRO's hooks for every chunk of a pipeline step.
pub(crate) struct ZeroStageHooks<'a> {
    hooks: FsdpHooks<'a>,
    /// Stages 2 and 3 reduce-scatter after every backward.
    every_backward: bool,
    /// The step's last micro-step: stage 1 reduces after each chunk's last backward.
    sync: bool,
}

impl StageHooks for ZeroStageHooks<'_> {
    fn hooks(&mut self, chunk: usize, last_backward: bool) -> &mut dyn Hooks {
        let reduce = self.every_backward || (self.sync && last_backward);
        self.hooks.set_chunk(chunk);
        self.hooks.set_reduce(reduce);
        &mut self.hooks
    }
}

impl Replicas {
    /// The fp32 masters under mixed precision (keyed like the optimizer's items).
    pub(crate) fn masters(&self) -> Option<&MasterWeights> {
        match self {
            Replicas::Full(f) => f.masters.as_ref(),
            Replicas::Zero(fsdp) => fsdp.masters(),
        }
    }

    /// Whether the dp ranks hold disjoint shards (ZeRO) rather than replicas (DDP).
    pub(crate) fn sharded_over_dp(&self) -> bool {
        matches!(self, Replicas::Zero(_))
    }

    /// The sync of one micro-step (`sync`: the step's last). With one stage, dp > 1 and not
    /// DDP's naive mode (the textbook version, which waits for the whole backward), the
    /// average starts inside the last backward, in buckets or one per parameter.
    pub(crate) fn begin<'a>(&'a mut self, ctx: &SyncCtx<'a>, sync: bool) -> StepSync<'a> {
        let plan = ctx.plan;
        let naive = matches!(plan.data, DataParallelKind::Ddp(d) if d.mode == DdpMode::Naive);
        let overlap = sync
            && !naive
            && plan.dims.pp == 1
            && ctx.stages.chunks().len() == 1
            && ctx.dp.size() > 1;
        match self {
            Replicas::Full(f) => {
                if ctx.dp.size() > 1 && f.dp_timer.is_none() {
                    f.dp_timer = Some(OpTimer::start(ctx.dp));
                }
                match (overlap, f.buckets.is_empty()) {
                    (true, false) => StepSync::Buckets {
                        hooks: BucketedDpReduce::new(
                            ctx.dp,
                            ctx.params,
                            &f.buckets,
                            plan.precision.grad_reduce_dtype(),
                        ),
                        timer: &mut f.dp_timer,
                        reduced: &mut f.reduced,
                    },
                    (true, true) => StepSync::Overlapped {
                        hooks: OverlappedDpReduce::new(
                            &ctx.stages.chunks()[0].segments,
                            ctx.dp,
                            ctx.edp,
                            plan.precision
                                .is_mixed()
                                .then_some(plan.precision.reduce_dtype),
                        ),
                        reduced: &mut f.reduced,
                    },
                    (false, _) => StepSync::AfterFlush(NoStageHooks(NoHooks)),
                }
            }
            Replicas::Zero(fsdp) => {
                let every_backward = fsdp.stage() >= ZeroStage::Two;
                StepSync::Zero(ZeroStageHooks {
                    hooks: fsdp.hooks(ctx.recompute),
                    every_backward,
                    sync,
                })
            }
        }
    }

    /// After the last micro-step: average over dp (unless the backward did), then the sums over
    /// tp (sequence-parallel partial gradients) and over the two ends of the pipeline (tied
    /// `wte`), on full gradients or ZeRO's shards.
    pub(crate) fn finish_grads(
        &mut self,
        ctx: &SyncCtx<'_>,
        grads: &mut Grads,
        stats: &mut CommStats,
    ) -> Result<()> {
        let t = std::time::Instant::now();
        let plan = ctx.plan;
        match self {
            Replicas::Full(f) => {
                let reduces = ctx.dp.size() > 1 || !ctx.partial.is_empty() || !ctx.tied.is_empty();
                if plan.precision.is_mixed() && reduces {
                    // Every reduction below (dp, tp partial sums, tied wte) runs in this dtype;
                    // with none (a world of one) the gradients stay as the backward left them.
                    grads_for_reduction(ctx.params, grads, plan.precision.reduce_dtype)?;
                }
                if f.reduced {
                    f.reduced = false;
                } else if ctx.dp.size() > 1 {
                    let (n, bytes) = average::sync_grads(ctx.params, grads, ctx.dp, ctx.edp)?;
                    stats.collectives += n;
                    stats.bytes += bytes;
                }
                if let Some(layout) = ctx.layout {
                    if !ctx.partial.is_empty() {
                        layout.sync_partial_grads(grads, ctx.tp)?;
                    }
                }
                if !ctx.tied.is_empty() {
                    ctx.stages.sync_tied_grads(ctx.pp.as_ref(), grads)?;
                }
            }
            Replicas::Zero(fsdp) => {
                if !ctx.partial.is_empty() {
                    fsdp.all_reduce_grads_of(ctx.partial, ctx.tp)?;
                }
                if !ctx.tied.is_empty() {
                    // Gather my dp-averaged tied gradient, add the other end's, keep the sum.
                    let mut mine = Grads::new();
                    for (n, g) in fsdp.full_grads_of(ctx.tied)? {
                        mine.insert(n, g);
                    }
                    let mut total = Grads::new();
                    for (n, g) in mine.iter() {
                        total.insert(n.clone(), g.clone());
                    }
                    ctx.stages.sync_tied_grads(ctx.pp.as_ref(), &mut total)?;
                    let mut theirs = BTreeMap::new();
                    for (n, g) in total.iter() {
                        if let Some(m) = mine.get(n) {
                            theirs.insert(n.clone(), (g - m)?);
                        }
                    }
                    fsdp.add_full_grads(&theirs)?;
                }
            }
        }
        stats.exposed_comm_s += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Σ g² of the gradient elements this rank counts: `weight(name, sharded_over_dp)` is the
    /// model's rule (1 or 0); full replicas are replicated over dp, ZeRO's shards are not.
    /// The sum is one f64 on `device`, not read back where the gradients are full (on CUDA the
    /// one-launch sum, [`mtrain_kernels::reduce::sq_sum_f64_all_on_device`]).
    pub(crate) fn local_norm_sq_on_device(
        &self,
        grads: &Grads,
        weight: &dyn Fn(&str, bool) -> f64,
        device: &Device,
    ) -> Result<Tensor> {
        Ok(match self {
            Replicas::Full(_) => {
                let counted = grads.iter().filter(|(n, _)| weight(n, false) > 0.0);
                sq_sum_f64_all_on_device(counted.map(|(_, g)| g), device)?
            }
            Replicas::Zero(fsdp) => {
                Tensor::new(fsdp.local_grad_sq_norm(|n| weight(n, true))?, device)?
            }
        })
    }

    /// Steps `opt` over what this rank updates with the gradients times `grad_scale`, then
    /// (ZeRO) writes the updated shards back. Returns the dp group's busy time of the step, when
    /// it was timed.
    pub(crate) fn step(
        &mut self,
        opt: &mut AdamW,
        lr: f64,
        grad_scale: GradScale,
        params: &[Param],
        grads: &Grads,
        dp: &Comm,
    ) -> Result<Option<f64>> {
        match self {
            Replicas::Full(f) => {
                let items = replicated_items(params, grads);
                match &f.masters {
                    Some(m) => m.step(opt, lr, grad_scale, &items)?,
                    None => {
                        opt.step_with_copies(lr, grad_scale, &items, None)?;
                    }
                }
                Ok(f.dp_timer.take().map(|mut t| {
                    t.collect(dp);
                    t.busy_s()
                }))
            }
            Replicas::Zero(fsdp) => {
                let items: Vec<OptimItem> = fsdp.optimizer_items();
                match fsdp.masters() {
                    None => {
                        opt.step_with_copies(lr, grad_scale, &items, None)?;
                    }
                    Some(m) => MasterWeights::step_all(&[m], opt, lr, grad_scale, &items)?,
                }
                fsdp.after_optimizer_step()?;
                Ok(None)
            }
        }
    }

    /// Chunk `k`'s forward without gradients, through `forward` with the hooks its kind needs
    /// (ZeRO gathers each unit and frees it after).
    pub(crate) fn forward_chunk(
        &mut self,
        k: usize,
        forward: impl FnOnce(&mut dyn Hooks) -> Result<Tensor>,
    ) -> Result<Tensor> {
        match self {
            Replicas::Full(_) => forward(&mut NoHooks),
            Replicas::Zero(fsdp) => {
                let mut hooks = fsdp.hooks(false);
                hooks.set_chunk(k);
                let out = forward(&mut hooks)?;
                fsdp.release()?;
                Ok(out)
            }
        }
    }

    /// Bytes of the parameters, gradients and optimizer moments this rank holds right now;
    /// `grads` is the bytes of the model's own gradient map.
    pub(crate) fn model_state_bytes(
        &self,
        opt: &AdamW,
        params: &[Param],
        grads: usize,
    ) -> ModelStateBytes {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        match self {
            Replicas::Full(f) => ModelStateBytes {
                params: params.iter().map(|p| bytes(&p.tensor())).sum(),
                grads,
                optimizer: opt.state_bytes() + f.masters.as_ref().map_or(0, |m| m.bytes()),
            },
            Replicas::Zero(fsdp) => {
                let b = fsdp.model_state_bytes(opt);
                ModelStateBytes {
                    params: b.params,
                    grads: grads + b.grads,
                    optimizer: opt.state_bytes() + fsdp.master_bytes(),
                }
            }
        }
    }

    /// `last` (the model's own figures of the last step) with ZeRO's collectives added.
    pub(crate) fn comm_stats(&self, last: CommStats) -> CommStats {
        match self {
            Replicas::Full(_) => last,
            Replicas::Zero(fsdp) => {
                let (mut acc, s) = (last, fsdp.comm_stats());
                acc.comm_s += s.comm_s;
                acc.exposed_comm_s += s.exposed_comm_s;
                acc.collectives += s.collectives;
                acc.bytes += s.bytes;
                acc
            }
        }
    }
}

impl<'a> StepSync<'a> {
    /// The hooks the executor runs this micro-step.
    pub(crate) fn hooks(&mut self) -> &mut dyn StageHooks {
        match self {
            StepSync::Buckets { hooks, .. } => hooks,
            StepSync::Overlapped { hooks, .. } => hooks,
            StepSync::AfterFlush(h) => h,
            StepSync::Zero(h) => h,
        }
    }

    /// After the executor: the averages started in the backward waited on and written back
    /// (counted into `stats`), ZeRO's last reductions.
    pub(crate) fn finish(self, grads: &mut Grads, dp: &Comm, stats: &mut CommStats) -> Result<()> {
        match self {
            StepSync::Buckets {
                hooks,
                timer,
                reduced,
            } => {
                let (n, bytes) = hooks.finish(grads, &mut stats.exposed_comm_s)?;
                if let Some(timer) = timer {
                    timer.collect(dp);
                }
                stats.collectives += n;
                stats.bytes += bytes;
                *reduced = true;
            }
            StepSync::Overlapped { hooks, reduced } => {
                let w = std::time::Instant::now();
                let (n, bytes) = hooks.finish(grads)?;
                stats.exposed_comm_s += w.elapsed().as_secs_f64();
                stats.collectives += n;
                stats.bytes += bytes;
                *reduced = true;
            }
            StepSync::AfterFlush(_) => {}
            StepSync::Zero(hooks) => hooks.hooks.finish()?,
        }
        Ok(())
    }
}
