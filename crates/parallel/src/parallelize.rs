//! 4D composition: one top-down function that turns full weights and a validated
//! [`ParallelPlan`] into this rank's part of the model, applying the techniques in a fixed order:
//!
//! ```text
//!   full weights (every rank, same seed)
//!     │ 1. TP  tensor_parallel::build over the tp group: column/row shards, vocab-parallel wte,
//!     │        sequence-parallel blocks                   (or expert_parallel::build_segments: EP)
//!     │ 2. PP  PipelineStages::from_segments: keep the segments of this rank's stage(s)
//!     │ 3. DP  DDP: gradients all-reduced over dp (experts: over edp) after the pipeline flush,
//!     │        or with one stage inside its last backward (ddp::OverlappedDpReduce)
//!     │        ZeRO: one Fsdp per stage chunk over the dp group, driven by the pipeline's hooks
//!     ▼
//!   ParallelModel  (forward_backward / optimizer_step / full_state / ...)
//!
//!   rank = (dp_idx · pp + pp_idx) · tp + tp_idx      e.g. dp 2 × pp 2 × tp 2:
//!             tp=0 tp=1
//!   dp=0 pp=0:  0    1     stage 0: embedding, h.0, h.1   (wte rows 0..V/2 on rank 0, V/2..V on 1)
//!   dp=0 pp=1:  2    3     stage 1: h.2, h.3, head
//!   dp=1 pp=0:  4    5     the same shards again: ranks 0 and 4 average their gradients (dp)
//!   dp=1 pp=1:  6    7
//! ```
//!
//! **Every layout is a pipeline.** With pp = 1 the model is one stage and the executor's
//! micro-batches are plain gradient accumulation, so there is one code path for every plan.
//!
//! **Data parallelism under the pipeline.** The executor runs the engine's passes; it hands each
//! pass the engine hooks of its chunk ([`StageHooks`]) and says which backward is the chunk's last
//! of the step. Under ZeRO those hooks are [`Fsdp`]'s own: at stage 3 the units are gathered
//! before each segment and freed after it in every micro-batch's forward and backward, and
//! stages 2 and 3 reduce-scatter after every micro-batch's backward (stage 1 after the chunk's
//! last one), so `--pp 2 --dp 2 --zero 3` really holds 1/dp of each stage's weights. Under DDP
//! the gradients accumulate over the micro-batches and are all-reduced once after the flush
//! (Megatron's default, without overlapping the reduction with the backward; the bucketed,
//! overlapped reduction of [`crate::ddp::Ddp`] is the standalone strategy's, and [`DdpConfig`]'s
//! bucket sizes do not apply here). Expert gradients are averaged over their edp replicas
//! ([`expert_parallel::sync_grads`]).
//!
//! **Linear fix-ups after the reduction.** Two gradients are incomplete on a single rank: under
//! sequence parallelism the LayerNorms, `wpe` and row-parallel biases saw only 1/tp of the tokens
//! (Σ over tp), and the tied `wte` on the first and last stage saw only one of its two uses (Σ
//! over those two pp ranks). Both are sums, and sums commute with the data-parallel average, so
//! they are applied once, after it, to whatever the strategy keeps: full gradients
//! ([`ShardLayout::sync_partial_grads`], [`PipelineStages::sync_tied_grads`]) or ZeRO shards
//! ([`Fsdp::all_reduce_grads_of`]; for `wte`, the full gradient gathered over dp, exchanged over
//! pp, and the peer's part added to the shard).
//!
//! **Gradient norm.** Σ g² over every element of the model once: each rank weighs a parameter 1
//! or 0 (counted on tp rank 0 if it is replicated over tp, on the first stage if it is the tied
//! `wte`, on dp rank 0 if its gradient is replicated over dp — ZeRO shards are disjoint and
//! always count, an expert on its edp replica 0) and one all-reduce over the world adds it up.
//!
//! **Mixed precision** ([`ParallelPlan::precision`]). Every technique is built from the bf16
//! cast of the full weights, so weights, activations, pipeline sends and tensor-parallel
//! collectives are bf16; fp32 masters are cut from the fp32 weights like the optimizer moments
//! (tp slice, then ZeRO shard pieces) and AdamW steps them ([`MasterWeights`]). Gradients are cast
//! to the reduce dtype before the first reduction (dp, sequence-parallel sums, tied `wte`); ZeRO
//! reduce-scatters in it. `full_state` gathers the masters, so checkpoints stay fp32.
//!
//! **Layout-independent state.** Every rank knows every name and shape from
//! [`param_specs`]. `full_state` first gathers over dp (ZeRO) and tp ([`ShardLayout`]), then
//! broadcasts each tensor over the world from its owner (dp 0, tp 0, the pp rank of its stage; an
//! expert from the ep rank holding it): every rank ends with the whole model, and a plan loads it
//! by slicing. The optimizer moments travel the same way.
//!
//! Refused: tensor parallelism of an MoE model (experts are split by ep), ZeRO of an
//! expert-parallel model, an interleaved schedule without pipeline ranks.
//!
//! Legend: `B` batch, `T` time, `C` width, `V` vocabulary, `M` micro-batches, `S` model stages.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::Arc;

use candle_core::{DType, Device, Shape, Tensor};
use mtrain_comm::{chunk_range, Comm, CommError, Coords, DeviceMesh, MeshDims, ReduceOp};
use mtrain_model::init::param_specs;
use mtrain_model::optim::{clip_coef, AdamW, AdamWState, OptimItem};
use mtrain_model::{Engine, Gpt, GptConfig, Grads, Hooks, MoeStats, NoHooks, Param, Segment};

use crate::ddp::{
    grads_for_reduction, replicated_items, scale_all, set_weight, sq_sum_f64, sum_f64,
    verify_same_init, CommStats, DataParallel, DdpConfig, DpError, MasterWeights, MixedPrecision,
    ModelStateBytes, OverlappedDpReduce,
};
use crate::expert_parallel::{self, is_expert_param, EpError};
use crate::fsdp::{Fsdp, FsdpConfig, FsdpHooks, ZeroStage};
use crate::pipeline::{
    NoStageHooks, PipelineError, PipelineExecutor, PipelineStages, Schedule, ScheduleKind,
    StageHooks, StageLayout, StepReport,
};
use crate::tensor_parallel::{self, shard::shard, Placement, ShardLayout, TpError};

/// Errors of composing the strategies.
#[derive(Debug, thiserror::Error)]
pub enum ParallelizeError {
    #[error("invalid parallel plan: {0}")]
    Plan(String),
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

/// How the data-parallel replicas share their work.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DataParallelKind {
    /// Full replicas; gradients averaged over dp.
    Ddp(DdpConfig),
    /// ZeRO stage 1, 2 or 3 over dp.
    Zero(FsdpConfig),
}

/// Everything that decides how the model is split.
#[derive(Debug, Clone, PartialEq)]
pub struct ParallelPlan {
    /// dp × pp × tp (= world size), ep carved out of dp.
    pub dims: MeshDims,
    /// DDP or a ZeRO stage over the dp group.
    pub data: DataParallelKind,
    /// Sequence parallelism inside the tp group (no effect when tp = 1).
    pub sequence_parallel: bool,
    /// Pipeline schedule (ignored when pp = 1: the one stage runs its micro-batches in turn).
    pub schedule: ScheduleKind,
    /// Micro-batches per step M; each rank's batch must split into M equal parts.
    pub microbatches: usize,
    /// Blocks per model stage (pp · v entries); None splits evenly.
    pub stage_counts: Option<Vec<usize>>,
    /// Activation checkpointing: keep only segment inputs, recompute in backward.
    pub checkpointing: bool,
    /// Compute dtype and gradient-reduction dtype (bf16 compute keeps fp32 masters).
    pub precision: MixedPrecision,
}

impl ParallelPlan {
    /// A plain plan: `dims`, DDP, no sequence parallelism, 1F1B with one micro-batch, even stages.
    pub fn new(dims: MeshDims) -> Self {
        Self {
            dims,
            data: DataParallelKind::Ddp(DdpConfig::default()),
            sequence_parallel: false,
            schedule: ScheduleKind::OneFOneB,
            microbatches: 1,
            stage_counts: None,
            checkpointing: false,
            precision: MixedPrecision::default(),
        }
    }

    /// The schedule actually run: a single stage has nothing to interleave.
    fn effective_schedule(&self) -> ScheduleKind {
        if self.dims.pp == 1 {
            ScheduleKind::GPipe
        } else {
            self.schedule
        }
    }

    /// Model stages S = pp · v.
    fn num_stages(&self) -> usize {
        self.dims.pp * self.effective_schedule().virtual_stages()
    }

    /// Every reason a layout cannot work, with the arithmetic: `dp(2) * pp(2) * tp(2) = 8 != world
    /// size 4`, `pp 5 > n_layer 4`, `n_head 6 is not divisible by tp 4`, `ep 3 does not divide dp
    /// 4`, `n_experts 4 is not divisible by ep 3`, `--ep needs an MoE model`, micro-batches not
    /// dividing the batch, ... `batch_size` is the global batch of one micro-step (sequences).
    pub fn validate(&self, cfg: &GptConfig, world_size: usize, batch_size: usize) -> Result<()> {
        let mut why = self.layout_problems(cfg, world_size);
        let (dp, m) = (self.dims.dp, self.microbatches);
        if dp > 0 && !batch_size.is_multiple_of(dp) {
            why.push(format!("batch {batch_size} is not divisible by dp {dp}"));
        } else if dp > 0 && m > 0 && !(batch_size / dp).is_multiple_of(m) {
            why.push(format!(
                "per-rank batch {} (batch {batch_size} / dp {dp}) is not divisible by microbatches {m}",
                batch_size / dp
            ));
        }
        explain(why)
    }

    fn layout_problems(&self, cfg: &GptConfig, world_size: usize) -> Vec<String> {
        let MeshDims { dp, pp, tp, ep } = self.dims;
        let mut why = Vec::new();
        if let Err(e) = cfg.validate() {
            why.push(e.to_string());
        }
        for (name, v) in [
            ("dp", dp),
            ("pp", pp),
            ("tp", tp),
            ("ep", ep),
            ("microbatches", self.microbatches),
        ] {
            if v == 0 {
                why.push(format!("{name} must be at least 1, got 0"));
            }
        }
        if !why.is_empty() {
            return why;
        }
        if dp * pp * tp != world_size {
            why.push(format!(
                "dp({dp}) * pp({pp}) * tp({tp}) = {} != world size {world_size}",
                dp * pp * tp
            ));
        }
        if !dp.is_multiple_of(ep) {
            why.push(format!("ep {ep} does not divide dp {dp}"));
        }
        let v = self.schedule.virtual_stages();
        if pp == 1 && v > 1 {
            why.push(format!("an interleaved schedule (v = {v}) needs pp > 1"));
        }
        let s = self.num_stages();
        if v == 0 {
            why.push("an interleaved schedule needs at least one virtual stage, got v = 0".into());
        } else if let Some(counts) = &self.stage_counts {
            let total: usize = counts.iter().sum();
            if counts.len() != s {
                why.push(format!(
                    "stage_counts has {} entries but there are {s} model stages",
                    counts.len()
                ));
            } else if total != cfg.n_layer {
                why.push(format!(
                    "stage_counts {counts:?} add up to {total} != n_layer {}",
                    cfg.n_layer
                ));
            } else if let Some(k) = (1..s.saturating_sub(1)).find(|&k| counts[k] == 0) {
                why.push(format!(
                    "stage {k} of stage_counts {counts:?} holds no block"
                ));
            }
        } else if s > cfg.n_layer {
            why.push(match v {
                1 => format!("pp {pp} > n_layer {}", cfg.n_layer),
                _ => format!(
                    "pp {pp} x v {v} = {s} model stages > n_layer {}",
                    cfg.n_layer
                ),
            });
        }
        if let ScheduleKind::Interleaved1F1B { .. } = self.effective_schedule() {
            if !self.microbatches.is_multiple_of(pp) {
                why.push(format!(
                    "interleaved 1F1B needs microbatches {} to be a multiple of pp {pp}",
                    self.microbatches
                ));
            }
        }
        if tp > 1 {
            if cfg.moe.is_some() {
                why.push(format!(
                    "tp {tp} with an MoE model: expert blocks are split by --ep, not tensor parallelism"
                ));
            }
            for (what, value) in [
                ("n_head", cfg.n_head),
                ("4 * n_embd", 4 * cfg.n_embd),
                ("vocab_size", cfg.vocab_size),
            ] {
                if !value.is_multiple_of(tp) {
                    why.push(format!("{what} {value} is not divisible by tp {tp}"));
                }
            }
        }
        if ep > 1 {
            match &cfg.moe {
                None => why.push(format!(
                    "--ep {ep} needs an MoE model (the config has no `moe` section)"
                )),
                Some(m) if !m.n_experts.is_multiple_of(ep) => why.push(format!(
                    "n_experts {} is not divisible by ep {ep}",
                    m.n_experts
                )),
                Some(_) => {}
            }
            if let DataParallelKind::Zero(z) = self.data {
                why.push(format!(
                    "ZeRO stage {} with ep {ep}: expert parameters live on ep ranks and are not sharded over dp; use DDP",
                    z.stage as u8
                ));
            }
        }
        why
    }
}

fn explain(why: Vec<String>) -> Result<()> {
    match why.is_empty() {
        true => Ok(()),
        false => Err(ParallelizeError::Plan(why.join("; "))),
    }
}

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

/// How the data-parallel part keeps gradients.
enum Replicas {
    /// Full local gradients in `ParallelModel::grads`, averaged over dp (experts over edp).
    Full,
    /// One ZeRO strategy per stage chunk; gradients live in its shards.
    Zero(Vec<Fsdp>),
}

/// ZeRO's hooks for every chunk of a pipeline step.
struct ZeroStageHooks<'a> {
    hooks: Vec<FsdpHooks<'a>>,
    /// Stages 2 and 3 reduce-scatter after every backward.
    every_backward: bool,
    /// The step's last micro-step: stage 1 reduces after each chunk's last backward.
    sync: bool,
}

impl StageHooks for ZeroStageHooks<'_> {
    fn hooks(&mut self, chunk: usize, last_backward: bool) -> &mut dyn Hooks {
        let reduce = self.every_backward || (self.sync && last_backward);
        let h = &mut self.hooks[chunk];
        h.set_reduce(reduce);
        h
    }
}

/// This rank's part of the model under a plan, with the training-step API.
pub struct ParallelModel {
    plan: ParallelPlan,
    cfg: GptConfig,
    coords: Coords,
    world: Comm,
    dp: Comm,
    pp: Comm,
    tp: Comm,
    edp: Comm,
    engine: Engine,
    stages: PipelineStages,
    executor: PipelineExecutor,
    /// The tensor-parallel placement of every parameter (tp > 1).
    layout: Option<ShardLayout>,
    /// Parameters whose gradient is partial over tp (sequence parallelism), held here.
    partial: BTreeSet<String>,
    /// Tied parameters held by this rank's first or last stage (pp > 1).
    tied: BTreeSet<String>,
    /// This rank's parameters, each once, in model order.
    params: Vec<Param>,
    replicas: Replicas,
    /// fp32 masters of `params` under mixed precision with full replicas (ZeRO keeps its
    /// master shards in each [`Fsdp`]).
    masters: Option<MasterWeights>,
    grads: Grads,
    current: CommStats,
    /// This step's gradients were averaged over dp during the last backward.
    reduced: bool,
    last: CommStats,
}

/// Builds this rank's part of the model: TP → pipeline split → EP → FSDP or DDP (see the module
/// doc). A collective on every group of `mesh`: every rank calls it with the same full weights.
pub fn parallelize(
    cfg: &GptConfig,
    weights: &BTreeMap<String, Tensor>,
    plan: &ParallelPlan,
    mesh: &DeviceMesh,
    device: &Device,
) -> Result<ParallelModel> {
    if plan.dims != mesh.dims {
        return Err(ParallelizeError::Plan(format!(
            "the plan is for {:?} but the mesh is {:?}",
            plan.dims, mesh.dims
        )));
    }
    explain(plan.layout_problems(cfg, mesh.dims.world_size()))?;
    plan.precision.validate()?;
    let fp32_weights = weights;
    // The compute copy every technique below is built from (bf16 under mixed precision).
    let cast: BTreeMap<String, Tensor>;
    let weights = match plan.precision.is_mixed() {
        true => {
            let dtype = plan.precision.param_dtype;
            cast = weights
                .iter()
                .map(|(n, t)| Ok((n.clone(), t.to_dtype(dtype)?)))
                .collect::<candle_core::Result<_>>()?;
            &cast
        }
        false => weights,
    };
    let MeshDims { pp, tp, ep, .. } = plan.dims;
    let c = mesh.coords;
    let sp = plan.sequence_parallel && tp > 1;

    // 1. Tensor (or expert) parallelism: this rank's segments [embedding, h.0 …, head].
    let (segments, layout): (Vec<Arc<dyn Segment>>, Option<ShardLayout>) = if tp > 1 {
        let m = tensor_parallel::build(cfg, weights, &mesh.tp, sp, device)?;
        (m.segments, Some(m.layout))
    } else if ep > 1 {
        (
            expert_parallel::build_segments(cfg, weights, &mesh.ep, device)?,
            None,
        )
    } else {
        (Gpt::new(cfg.clone(), weights, device)?.segments, None)
    };

    // 2. Pipeline: keep this rank's stages.
    let kind = plan.effective_schedule();
    let stage_layout = match &plan.stage_counts {
        Some(counts) => StageLayout::from_counts(cfg.n_layer, counts)?,
        None => StageLayout::even(cfg.n_layer, plan.num_stages())?,
    };
    let mut stages =
        PipelineStages::from_segments(&segments, cfg.n_layer, cfg.n_embd, stage_layout, c.pp, pp)?;
    if sp {
        stages = stages.with_sequence_split(tp, c.tp);
    }
    drop(segments);
    let executor = PipelineExecutor::new(
        Schedule::new(kind, pp, plan.microbatches).map_err(PipelineError::from)?,
        Engine::new(plan.checkpointing),
    );
    let params = stages.params();
    let held: BTreeSet<String> = params.iter().map(|p| p.name().to_string()).collect();
    let partial = layout
        .iter()
        .flat_map(|l| l.specs())
        .filter(|s| sp && s.placement == Placement::Replicated { partial_grad: true })
        .filter(|s| held.contains(&s.name))
        .map(|s| s.name.clone())
        .collect();
    let tied = stages
        .tied_names()
        .iter()
        .filter(|n| held.contains(*n))
        .cloned()
        .collect();

    // 3. Data parallelism (experts: over edp) on each chunk.
    let replicas = match plan.data {
        DataParallelKind::Zero(z) => Replicas::Zero(
            stages
                .chunks()
                .iter()
                .map(|ch| Fsdp::new(mesh.dp.clone(), ch.segments.clone(), z))
                .collect::<std::result::Result<_, _>>()?,
        ),
        DataParallelKind::Ddp(_) => {
            let (experts, dense): (Vec<Param>, Vec<Param>) = params
                .iter()
                .cloned()
                .partition(|p| is_expert_param(p.name()));
            verify_same_init(&mesh.dp, &dense)?;
            verify_same_init(&mesh.edp, &experts)?;
            Replicas::Full
        }
    };
    let mut pm = ParallelModel {
        plan: plan.clone(),
        cfg: cfg.clone(),
        coords: c,
        world: mesh.world.clone(),
        dp: mesh.dp.clone(),
        pp: mesh.pp.clone(),
        tp: mesh.tp.clone(),
        edp: mesh.edp.clone(),
        engine: Engine::new(plan.checkpointing),
        stages,
        executor,
        layout,
        partial,
        tied,
        params,
        replicas,
        masters: None,
        grads: Grads::new(),
        current: CommStats::default(),
        reduced: false,
        last: CommStats::default(),
    };
    if plan.precision.is_mixed() {
        pm.attach_masters(fp32_weights)?;
    }
    Ok(pm)
}

fn f64_of(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.to_vec1::<f64>()?)
}

impl ParallelModel {
    /// fp32 masters from the full fp32 weights, cut like this rank's optimizer state (tp slice,
    /// then ZeRO shard pieces).
    fn attach_masters(&mut self, fp32_weights: &BTreeMap<String, Tensor>) -> Result<()> {
        let local = self.local_slices(fp32_weights, "weight")?;
        let precision = self.plan.precision;
        match &mut self.replicas {
            Replicas::Full => self.masters = Some(MasterWeights::new(local)?),
            Replicas::Zero(fsdps) => {
                for f in fsdps.iter_mut() {
                    f.set_mixed_precision(precision, &local)?;
                }
            }
        }
        Ok(())
    }

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

    /// One micro-step on this rank's data-parallel slice (B_local, T); all tp/pp ranks of one dp
    /// index pass the same batch. Gradients accumulate; `sync` marks the last micro-step, after
    /// which the gradients are reduced and complete. `loss_scale` multiplies the gradients (1/K
    /// for K micro-steps).
    pub fn forward_backward(
        &mut self,
        idx: &Tensor,
        targets: &Tensor,
        loss_scale: f64,
        sync: bool,
    ) -> Result<StepOut> {
        let t = std::time::Instant::now();
        let pp = self.pp.as_ref();
        // One stage and gradients to average: the average starts inside the last backward.
        let overlap = sync
            && self.plan.dims.pp == 1
            && self.stages.chunks().len() == 1
            && self.plan.dims.dp > 1;
        let report = match &mut self.replicas {
            Replicas::Full if overlap => {
                let dtype = self
                    .plan
                    .precision
                    .is_mixed()
                    .then_some(self.plan.precision.reduce_dtype);
                let mut hooks = OverlappedDpReduce::new(
                    &self.stages.chunks()[0].segments,
                    &self.dp,
                    &self.edp,
                    dtype,
                );
                let report = self.executor.step_with_hooks(
                    &self.stages,
                    pp,
                    idx,
                    targets,
                    loss_scale,
                    &mut self.grads,
                    &mut hooks,
                )?;
                let w = std::time::Instant::now();
                let (n, bytes) = hooks.finish(&mut self.grads)?;
                self.current.exposed_comm_s += w.elapsed().as_secs_f64();
                self.current.collectives += n;
                self.current.bytes += bytes;
                self.reduced = true;
                report
            }
            Replicas::Full => self.executor.step_with_hooks(
                &self.stages,
                pp,
                idx,
                targets,
                loss_scale,
                &mut self.grads,
                &mut NoStageHooks(NoHooks),
            )?,
            Replicas::Zero(fsdps) => {
                let every_backward = fsdps.first().is_some_and(|f| f.stage() >= ZeroStage::Two);
                let recompute = self.engine.checkpointing;
                let mut hooks = ZeroStageHooks {
                    hooks: fsdps.iter_mut().map(|f| f.hooks(recompute)).collect(),
                    every_backward,
                    sync,
                };
                let report = self.executor.step_with_hooks(
                    &self.stages,
                    pp,
                    idx,
                    targets,
                    loss_scale,
                    &mut self.grads,
                    &mut hooks,
                )?;
                for h in hooks.hooks {
                    h.finish()?;
                }
                report
            }
        };
        self.current.backward_s += t.elapsed().as_secs_f64();
        if sync {
            self.finish_grads()?;
        }
        // The loss is already the same on every pp rank; the aux losses are per stage.
        let aux = match self.plan.dims.pp {
            1 => report.aux_loss,
            _ => f64_of(&self.pp.all_reduce(
                &Tensor::new(&[report.aux_loss], self.pp.device())?,
                ReduceOp::Sum,
            )?)?[0],
        };
        let both = Tensor::new(&[report.loss, aux], self.dp.device())?;
        let avg = f64_of(&self.dp.all_reduce(&both, ReduceOp::Avg)?)?;
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

    /// After the last micro-step: average over dp, then the sums over tp (sequence-parallel
    /// partial gradients) and over the two ends of the pipeline (tied `wte`).
    fn finish_grads(&mut self) -> Result<()> {
        let t = std::time::Instant::now();
        match &mut self.replicas {
            Replicas::Full => {
                if self.plan.precision.is_mixed() {
                    // Every reduction below (dp, tp partial sums, tied wte) runs in this dtype.
                    let dtype = self.plan.precision.reduce_dtype;
                    grads_for_reduction(&self.params, &mut self.grads, dtype)?;
                }
                if self.reduced {
                    // Averaged during the backward (OverlappedDpReduce).
                    self.reduced = false;
                } else if self.plan.dims.dp > 1 {
                    let (n, bytes) = expert_parallel::sync_grads(
                        &self.params,
                        &mut self.grads,
                        &self.dp,
                        &self.edp,
                    )?;
                    self.current.collectives += n;
                    self.current.bytes += bytes;
                }
                if let Some(layout) = &self.layout {
                    if !self.partial.is_empty() {
                        layout.sync_partial_grads(&mut self.grads, &self.tp)?;
                    }
                }
                if !self.tied.is_empty() {
                    self.stages
                        .sync_tied_grads(self.pp.as_ref(), &mut self.grads)?;
                }
            }
            Replicas::Zero(fsdps) => {
                if !self.partial.is_empty() {
                    for f in fsdps.iter_mut() {
                        f.all_reduce_grads_of(&self.partial, &self.tp)?;
                    }
                }
                if !self.tied.is_empty() {
                    // Gather my dp-averaged tied gradient, add the other end's, keep the sum.
                    let mut mine = Grads::new();
                    for f in fsdps.iter() {
                        for (n, g) in f.full_grads_of(&self.tied)? {
                            mine.insert(n, g);
                        }
                    }
                    let mut total = Grads::new();
                    for (n, g) in mine.iter() {
                        total.insert(n.clone(), g.clone());
                    }
                    self.stages.sync_tied_grads(self.pp.as_ref(), &mut total)?;
                    let mut theirs = BTreeMap::new();
                    for (n, g) in total.iter() {
                        if let Some(m) = mine.get(n) {
                            theirs.insert(n.clone(), (g - m)?);
                        }
                    }
                    for f in fsdps.iter_mut() {
                        f.add_full_grads(&theirs)?;
                    }
                }
            }
        }
        self.current.exposed_comm_s += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// 1 if this rank counts `name`'s gradient elements in the global norm, else 0.
    fn norm_weight(&self, name: &str, sharded_over_dp: bool) -> f64 {
        let c = &self.coords;
        let over_dp = sharded_over_dp
            || match is_expert_param(name) {
                true => c.edp == 0,
                false => c.dp == 0,
            };
        let over_tp = match self.layout.as_ref().and_then(|l| l.get(name)) {
            Some(s) => matches!(s.placement, Placement::Sharded { .. }) || c.tp == 0,
            None => c.tp == 0,
        };
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
        let local = match &self.replicas {
            Replicas::Full => {
                let mut s = 0.0;
                for (name, g) in self.grads.iter() {
                    let w = self.norm_weight(name, false);
                    if w > 0.0 {
                        s += w * sq_sum_f64(g)?;
                    }
                }
                s
            }
            Replicas::Zero(fsdps) => {
                let mut s = 0.0;
                for f in fsdps {
                    s += f.local_grad_sq_norm(|n| self.norm_weight(n, true))?;
                }
                s
            }
        };
        let t = Tensor::new(&[local], self.world.device())?;
        Ok(f64_of(&self.world.all_reduce(&t, ReduceOp::Sum)?)?[0])
    }

    /// Clips to `max_grad_norm` (if given), steps `opt` over this rank's parameters or shards and
    /// clears the gradients. Returns the global gradient norm before clipping.
    pub fn optimizer_step(
        &mut self,
        opt: &mut AdamW,
        lr: f64,
        max_grad_norm: Option<f64>,
    ) -> Result<f64> {
        let norm = self.grad_norm_sq()?.sqrt();
        let clip = max_grad_norm.map_or(1.0, |m| clip_coef(norm, m));
        match &mut self.replicas {
            Replicas::Full => {
                if clip < 1.0 {
                    scale_all(&mut self.grads, clip)?;
                }
                let items = replicated_items(&self.params, &self.grads);
                match &self.masters {
                    Some(m) => m.step(opt, lr, &items)?,
                    None => opt.step(lr, &items)?,
                }
            }
            Replicas::Zero(fsdps) => {
                if clip < 1.0 {
                    for f in fsdps.iter_mut() {
                        f.scale_grads(clip)?;
                    }
                }
                let items: Vec<OptimItem> =
                    fsdps.iter().flat_map(|f| f.optimizer_items()).collect();
                let masters: Vec<&MasterWeights> =
                    fsdps.iter().filter_map(|f| f.masters()).collect();
                match masters.is_empty() {
                    true => opt.step(lr, &items)?,
                    false => MasterWeights::step_all(&masters, opt, lr, &items)?,
                }
                for f in fsdps.iter_mut() {
                    f.after_optimizer_step()?;
                }
            }
        }
        self.grads.clear();
        self.last = std::mem::take(&mut self.current);
        Ok(norm)
    }

    /// Mean loss of the batch without gradients, the same on every rank.
    pub fn eval_loss(&mut self, idx: &Tensor, targets: &Tensor) -> Result<f64> {
        let (b, t) = idx.dims2()?;
        let p = self.plan.dims.pp;
        let s_total = self.stages.layout().num_stages();
        let t_local = match self.stages.sequence_split() {
            Some((size, r)) => chunk_range(t, size, r).len(),
            None => t,
        };
        let act_shape = Shape::from((b, t_local, self.cfg.n_embd)); // (B, T/tp, C)
        let dtype = self.stages.activation_dtype();
        let mut x = idx.clone();
        let mut loss = 0.0;
        for (k, chunk) in self.stages.chunks().iter().enumerate() {
            let s = chunk.stage;
            if s > 0 && p > 1 {
                x = self.pp.recv((s - 1) % p, &act_shape, dtype)?;
            }
            let tgt = (s + 1 == s_total).then_some(targets);
            let out = match &mut self.replicas {
                Replicas::Full => {
                    self.engine
                        .forward(&chunk.segments, &x, tgt, &mut NoHooks)?
                        .output
                }
                Replicas::Zero(fsdps) => {
                    let out = {
                        let mut h = fsdps[k].hooks(false);
                        self.engine
                            .forward(&chunk.segments, &x, tgt, &mut h)?
                            .output
                    };
                    fsdps[k].release()?;
                    out
                }
            };
            if s + 1 == s_total {
                loss = sum_f64(&out)?;
            } else if p > 1 {
                self.pp.send(&out, (s + 1) % p)?;
            } else {
                x = out;
            }
        }
        if p > 1 {
            let mine = Tensor::new(&[loss], self.pp.device())?;
            loss = f64_of(&self.pp.broadcast(&mine, (s_total - 1) % p)?)?[0];
        }
        let avg = self
            .dp
            .all_reduce(&Tensor::new(&[loss], self.dp.device())?, ReduceOp::Avg)?;
        Ok(f64_of(&avg)?[0])
    }

    /// The model stage that holds parameter `name`.
    fn stage_of(&self, name: &str) -> usize {
        let layout = self.stages.layout();
        let last = layout.num_stages() - 1;
        if name.starts_with("ln_f.") {
            return last;
        }
        let block = name
            .strip_prefix("h.")
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<usize>().ok());
        match block {
            Some(i) => (0..=last)
                .find(|&s| layout.blocks(s).contains(&i))
                .unwrap_or(0),
            None => 0, // wte, wpe: the embedding's stage
        }
    }

    /// The world rank that broadcasts `name` in [`ParallelModel::full_state`].
    fn owner_of(&self, name: &str) -> usize {
        let dims = self.plan.dims;
        let pp_idx = self.stage_of(name) % dims.pp;
        let dp_idx = match (&self.cfg.moe, dims.ep > 1) {
            (Some(m), true) => {
                let e = name
                    .split(".moe.experts.")
                    .nth(1)
                    .and_then(|r| r.split('.').next())
                    .and_then(|e| e.parse::<usize>().ok());
                e.map_or(0, |e| e / (m.n_experts / dims.ep))
            }
            _ => 0,
        };
        dims.rank_of(dp_idx, pp_idx, 0)
    }

    /// From tensors of this rank's layout by name (full over dp) to every full tensor of the
    /// model on every rank: gather over tp, then one broadcast per name from its owner.
    fn assemble(&self, local: BTreeMap<String, Tensor>) -> Result<BTreeMap<String, Tensor>> {
        let mut mine = BTreeMap::new();
        for (name, t) in local {
            let full = match &self.layout {
                Some(l) => l.gather_full(&name, &t, &self.tp)?,
                None => t,
            };
            mine.insert(name, full);
        }
        let dtype = mine.values().next().map_or(DType::F32, |t| t.dtype());
        let me = self.world.rank();
        let mut out = BTreeMap::new();
        for (name, shape, _) in param_specs(&self.cfg) {
            let root = self.owner_of(&name);
            let x = match (root == me, mine.get(&name)) {
                (true, Some(t)) => t.to_dtype(dtype)?.contiguous()?,
                (true, None) => {
                    return Err(ParallelizeError::Plan(format!(
                        "rank {me} should own `{name}` but does not hold it"
                    )))
                }
                (false, _) => Tensor::zeros(shape, dtype, self.world.device())?,
            };
            out.insert(name, self.world.broadcast(&x, root)?);
        }
        Ok(out)
    }

    /// Every parameter as a full tensor by name, on every rank (a collective on all ranks).
    pub fn full_state(&self) -> Result<BTreeMap<String, Tensor>> {
        let local = match (&self.replicas, &self.masters) {
            (Replicas::Full, Some(m)) => m.tensors(),
            (Replicas::Full, None) => self
                .params
                .iter()
                .map(|p| (p.name().to_string(), p.tensor().detach()))
                .collect(),
            (Replicas::Zero(fsdps), _) => {
                let mut m = BTreeMap::new();
                for f in fsdps {
                    m.extend(f.full_state()?);
                }
                m
            }
        };
        self.assemble(local)
    }

    /// Every parameter's reduced gradient as a full tensor by name, on every rank (a collective;
    /// valid between the last micro-step and the optimizer step).
    pub fn full_grads(&self) -> Result<BTreeMap<String, Tensor>> {
        let local = match &self.replicas {
            Replicas::Full => self
                .grads
                .iter()
                .map(|(n, g)| (n.clone(), g.clone()))
                .collect(),
            Replicas::Zero(fsdps) => {
                let mut m = BTreeMap::new();
                for f in fsdps {
                    m.extend(f.full_grads()?);
                }
                m
            }
        };
        self.assemble(local)
    }

    /// The optimizer state as one device would hold it (full moments by parameter name), on
    /// every rank (a collective).
    pub fn full_optimizer_state(&self, opt: &AdamW) -> Result<AdamWState> {
        let state = opt.state();
        if state.m.is_empty() {
            return Ok(state);
        }
        let (m, v) = match &self.replicas {
            Replicas::Full => (state.m, state.v),
            Replicas::Zero(fsdps) => {
                let (mut m, mut v) = (BTreeMap::new(), BTreeMap::new());
                for f in fsdps {
                    let s = f.full_optimizer_state(opt)?;
                    m.extend(s.m);
                    v.extend(s.v);
                }
                (m, v)
            }
        };
        Ok(AdamWState {
            step: state.step,
            m: self.assemble(m)?,
            v: self.assemble(v)?,
        })
    }

    /// This rank's piece of each full tensor it holds (tp slice; ZeRO slices later).
    fn local_slices(
        &self,
        full: &BTreeMap<String, Tensor>,
        what: &str,
    ) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        for p in &self.params {
            let t = full.get(p.name()).ok_or_else(|| {
                ParallelizeError::Plan(format!("no {what} named `{}` to load", p.name()))
            })?;
            let t = match self.layout.as_ref().and_then(|l| l.get(p.name())) {
                Some(spec) => {
                    if t.dims() != spec.full_shape.as_slice() {
                        return Err(ParallelizeError::Plan(format!(
                            "{what} `{}` has shape {:?}, expected {:?}",
                            p.name(),
                            t.dims(),
                            spec.full_shape
                        )));
                    }
                    shard(t, spec.placement, self.coords.tp, self.plan.dims.tp)?
                }
                None => t.clone(),
            };
            out.insert(p.name().to_string(), t.to_device(self.world.device())?);
        }
        Ok(out)
    }

    /// Loads full weights by name (e.g. from [`ParallelModel::full_state`] under any plan).
    pub fn load_full_state(&mut self, full: &BTreeMap<String, Tensor>) -> Result<()> {
        let local = self.local_slices(full, "weight")?;
        match &mut self.replicas {
            Replicas::Full => {
                for p in &self.params {
                    if let Some(t) = local.get(p.name()) {
                        set_weight(p, t)?;
                    }
                }
                if let Some(m) = &self.masters {
                    m.load(&local)?;
                }
            }
            Replicas::Zero(fsdps) => {
                for f in fsdps.iter_mut() {
                    f.load_full_state(&local)?;
                }
            }
        }
        Ok(())
    }

    /// Loads a full optimizer state (from [`ParallelModel::full_optimizer_state`] under any plan)
    /// into `opt`, keeping this rank's part.
    pub fn load_optimizer_state(&mut self, opt: &mut AdamW, full: &AdamWState) -> Result<()> {
        if full.m.is_empty() {
            opt.load_state(full.clone())?;
            return Ok(());
        }
        let local = AdamWState {
            step: full.step,
            m: self.local_slices(&full.m, "first moment")?,
            v: self.local_slices(&full.v, "second moment")?,
        };
        let state = match &self.replicas {
            Replicas::Full => local,
            Replicas::Zero(fsdps) => {
                let (mut m, mut v) = (BTreeMap::new(), BTreeMap::new());
                for f in fsdps {
                    let s = f.shard_optimizer_state(&local)?;
                    m.extend(s.m);
                    v.extend(s.v);
                }
                AdamWState {
                    step: full.step,
                    m,
                    v,
                }
            }
        };
        opt.load_state(state)?;
        Ok(())
    }

    /// Bytes of the parameters, gradients and optimizer moments this rank holds right now.
    pub fn model_state_bytes(&self, opt: &AdamW) -> ModelStateBytes {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let grads: usize = self.grads.iter().map(|(_, g)| bytes(g)).sum();
        match &self.replicas {
            Replicas::Full => ModelStateBytes {
                params: self.params.iter().map(|p| bytes(&p.tensor())).sum(),
                grads,
                optimizer: opt.state_bytes() + self.masters.as_ref().map_or(0, |m| m.bytes()),
            },
            Replicas::Zero(fsdps) => {
                let mut s = ModelStateBytes {
                    params: 0,
                    grads,
                    optimizer: opt.state_bytes(),
                };
                for f in fsdps {
                    let b = f.model_state_bytes(opt);
                    s.params += b.params;
                    s.grads += b.grads;
                    s.optimizer += f.master_bytes();
                }
                s
            }
        }
    }

    /// Communication figures of the last completed optimizer step (ZeRO: its collectives; DDP:
    /// the reduction after the flush).
    pub fn comm_stats(&self) -> CommStats {
        match &self.replicas {
            Replicas::Full => self.last,
            Replicas::Zero(fsdps) => fsdps.iter().fold(self.last, |mut acc, f| {
                let s = f.comm_stats();
                acc.comm_s += s.comm_s;
                acc.exposed_comm_s += s.exposed_comm_s;
                acc.collectives += s.collectives;
                acc.bytes += s.bytes;
                acc
            }),
        }
    }
}

/// Whether tensor parallelism splits `name` (the rule `tensor_parallel::build` follows): the
/// vocabulary rows of `wte`, column layers (`c_attn`, `c_fc`, weight and bias) and the weights
/// of row layers (`c_proj`).
fn tp_sharded(name: &str) -> bool {
    name == "wte.weight"
        || name.contains(".c_attn.")
        || name.contains(".c_fc.")
        || name.ends_with(".c_proj.weight")
}

/// What `mtrain plan` prints beyond the mesh: the data-parallel mode and schedule, and the
/// layers and parameters per rank of each stage (the trainer's memory model turns the latter
/// into bytes, as its per-step report does).
pub fn describe(cfg: &GptConfig, plan: &ParallelPlan) -> String {
    let MeshDims { pp, tp, ep, .. } = plan.dims;
    let mut s = String::new();
    let kind = plan.effective_schedule();
    let n_stages = plan.num_stages();
    let layout = match &plan.stage_counts {
        Some(c) => StageLayout::from_counts(cfg.n_layer, c),
        None => StageLayout::even(cfg.n_layer, n_stages),
    };
    let layout = match layout {
        Ok(l) => l,
        Err(e) => return format!("no stage layout: {e}\n"),
    };
    let zero = match plan.data {
        DataParallelKind::Ddp(_) => None,
        DataParallelKind::Zero(z) => Some(z.stage),
    };
    let _ = writeln!(
        s,
        "plan: {} | {} micro-batch(es), schedule {kind}{}{}",
        match zero {
            None => "DDP".to_string(),
            Some(z) => format!("ZeRO-{}", z as u8),
        },
        plan.microbatches,
        if plan.sequence_parallel && tp > 1 {
            ", sequence parallel"
        } else {
            ""
        },
        if plan.checkpointing {
            ", activation checkpointing"
        } else {
            ""
        },
    );
    let specs = param_specs(cfg);
    let stage_of = |name: &str| -> usize {
        if name.starts_with("ln_f.") {
            return n_stages - 1;
        }
        name.strip_prefix("h.")
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<usize>().ok())
            .and_then(|i| (0..n_stages).find(|&st| layout.blocks(st).contains(&i)))
            .unwrap_or(0)
    };
    for st in 0..n_stages {
        let b = layout.blocks(st);
        let mut what = Vec::new();
        if st == 0 {
            what.push("embedding".to_string());
        }
        if !b.is_empty() {
            what.push(format!("h.{}..h.{}", b.start, b.end - 1));
        }
        if st + 1 == n_stages {
            what.push("head".to_string());
        }
        let mut n = 0usize;
        for (name, shape, _) in &specs {
            let numel: usize = shape.iter().product();
            let used_here = stage_of(name) == st || (name == "wte.weight" && st + 1 == n_stages);
            if !used_here || (name == "wte.weight" && st > 0 && st + 1 < n_stages) {
                continue;
            }
            let mut k = if tp_sharded(name) { numel / tp } else { numel };
            if is_expert_param(name) {
                k /= ep;
            }
            n += k;
        }
        let _ = writeln!(
            s,
            "stage {st} (pp rank {}): {:<28} {:>10} params per rank",
            st % pp,
            what.join(", "),
            n
        );
    }
    s
}
