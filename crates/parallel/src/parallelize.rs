//! 4D composition: one top-down function that turns full weights and a [`ValidPlan`] (a
//! [`ParallelPlan`] its check accepted) into this rank's part of the model, applying the techniques in a fixed order:
//!
//! ```text
//!   full weights (every rank, same seed)
//!     │ 1. TP  tensor_parallel::build over the tp group: column/row shards, vocab-parallel wte,
//!     │        sequence-parallel blocks                   (or expert_parallel::build_segments: EP)
//!     │ 2. PP  PipelineStages::from_segments: keep the segments of this rank's stage(s)
//!     │ 3. DP  DDP: full replicas, checked equal; gradients averaged over dp (experts: edp)
//!     │        ZeRO: one Fsdp per stage chunk over the dp group, driven by the pipeline's hooks
//!     ▼
//!   ParallelModel  (runtime.rs: forward_backward / grad_norm_sq / scaled_step;
//!                   state.rs: full_state / load_full_state / ...)
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
//! Who holds what is decided by [`crate::placement`] (the tensor-parallel split rule, stages,
//! experts) and the plan's stage layout; this function only applies it. The step it returns is
//! [`crate::runtime`]'s, the state's gather and reshard [`crate::state`]'s.
//!
//! **Mixed precision** ([`ParallelPlan::precision`]). Every technique is built from the bf16
//! cast of the full weights, so weights, activations, pipeline sends and tensor-parallel
//! collectives are bf16; fp32 masters are cut from the fp32 weights like the optimizer moments
//! (tp slice, then ZeRO shard pieces).
//!
//! Refused by the plan's check ([`ParallelPlan::validate`], before a `ValidPlan` exists):
//! tensor parallelism of an MoE model (experts are split by ep), ZeRO of an expert-parallel
//! model, an interleaved schedule without pipeline ranks.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use candle_core::{Device, Tensor};
use mtrain_comm::{Coords, DeviceMesh, MeshDims};
use mtrain_model::{Gpt, GptConfig, Grads, Param, Segment};

use crate::ddp::{assign_buckets, verify_same_init, CommStats};
use crate::expert_parallel;
use crate::fsdp::Fsdp;
use crate::holdings::Holdings;
use crate::pipeline::{PipelineExecutor, PipelineStages, Schedule};
use crate::placement::is_expert_param;
use crate::runtime::{FullReplicas, Replicas};
use crate::tensor_parallel::{self, ShardLayout};
use crate::toolbox::final_after;

pub use crate::holdings::describe;
pub use crate::plan::{DataParallelKind, ParallelPlan, PlanError, ValidPlan};
pub use crate::runtime::{ParallelModel, ParallelizeError, Result, StepOut};

/// Builds this rank's part of the model: TP → pipeline split → EP → FSDP or DDP (see the module
/// doc). A collective on every group of `mesh`: every rank calls it with the same full weights.
pub fn parallelize(
    cfg: &GptConfig,
    weights: &BTreeMap<String, Tensor>,
    plan: &ValidPlan,
    mesh: &DeviceMesh,
    device: &Device,
) -> Result<ParallelModel> {
    if plan.dims != mesh.dims {
        return Err(ParallelizeError::MeshMismatch {
            plan: format!("{:?}", plan.dims),
            mesh: format!("{:?}", mesh.dims),
        });
    }
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
        let m = tensor_parallel::build(cfg, weights, plan, &mesh.tp, sp, device)?;
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
    let stage_layout = plan.stage_layout(cfg.n_layer)?;
    let mut stages =
        PipelineStages::from_segments(&segments, cfg.n_layer, cfg.n_embd, stage_layout, c.pp, pp)?;
    if sp {
        stages = stages.with_sequence_split(tp, c.tp);
    }
    drop(segments);
    let table = check_holdings(cfg, plan, c, &stages)?;
    let executor = PipelineExecutor::new(plan.schedule()?, plan.engine());
    let params = stages.params();
    let held: BTreeSet<String> = params.iter().map(|p| p.name().to_string()).collect();
    let partial = table
        .unique()
        .iter()
        .filter(|h| h.partial_grad)
        .map(|h| h.name.clone())
        .collect();
    let tied = stages
        .tied_names()
        .iter()
        .filter(|n| held.contains(*n))
        .cloned()
        .collect();

    // 3. Data parallelism (experts: over edp): ZeRO shards the segments of all this rank's
    //    chunks over dp as one strategy (a parameter two chunks use, ZB-V's tied wte, is one
    //    unit); DDP keeps full replicas, which must start equal.
    let replicas = match plan.data {
        DataParallelKind::Zero(z) => {
            let chunks = stages.chunks().iter().map(|ch| ch.segments.clone());
            let fsdp = Fsdp::over_chunks(mesh.dp.clone(), chunks.collect(), z)?;
            check_shared_units(&fsdp, executor.schedule(), c.pp)?;
            Replicas::Zero(Box::new(fsdp))
        }
        DataParallelKind::Ddp(_) => {
            let (experts, dense): (Vec<Param>, Vec<Param>) = params
                .iter()
                .cloned()
                .partition(|p| is_expert_param(p.name()));
            verify_same_init(&mesh.dp, &dense)?;
            verify_same_init(&mesh.edp, &experts)?;
            // DDP of one stage averages its gradients in buckets, as the backward makes them
            // final.
            let buckets = match plan.dp_buckets() {
                Some(d) => assign_buckets(
                    &params,
                    &final_after(&stages.chunks()[0].segments),
                    d.first_bucket_cap_bytes,
                    d.bucket_cap_bytes,
                ),
                None => Vec::new(),
            };
            Replicas::Full(FullReplicas::new(buckets))
        }
    };
    let mut pm = ParallelModel {
        plan: ParallelPlan::clone(plan),
        cfg: cfg.clone(),
        coords: c,
        world: mesh.world.clone(),
        dp: mesh.dp.clone(),
        pp: mesh.pp.clone(),
        tp: mesh.tp.clone(),
        edp: mesh.edp.clone(),
        engine: plan.engine(),
        stages,
        executor,
        layout,
        partial,
        tied,
        params,
        replicas,
        grads: Grads::new(),
        current: CommStats::default(),
        last: CommStats::default(),
        dropout: None,
    };
    if plan.precision.is_mixed() {
        pm.attach_masters(fp32_weights)?;
    }
    Ok(pm)
}

/// That every ZeRO unit two chunks use is reduced after all their gradients: in each step the
/// chunk owning it runs its last backward after the other users' ([`Fsdp::shared_across_chunks`];
/// ZB-V's V on pipeline rank 0: the embedding's chunk after the head's).
fn check_shared_units(fsdp: &Fsdp, schedule: &Schedule, pp_rank: usize) -> Result<()> {
    let last = schedule.last_backwards(pp_rank);
    for (owner, users) in fsdp.shared_across_chunks() {
        if let Some(&late) = users.iter().find(|&&k| last[k] > last[owner]) {
            return Err(ParallelizeError::Plan(PlanError(format!(
                "ZeRO under {}: pipeline rank {pp_rank}'s chunk {late} runs its last backward \
                 after chunk {owner}, which owns a parameter both use, so that parameter's \
                 gradient would be reduced before it is final",
                schedule.kind()
            ))));
        }
    }
    Ok(())
}

/// That the stages built hold exactly what [`Holdings`] says this rank holds: every segment's
/// parameters by name and local shape, in order; the table, which then says which gradients
/// are partial. A builder that drifts from the table is an
/// error here rather than a wrong figure in the cost model or the memory report.
fn check_holdings(
    cfg: &GptConfig,
    plan: &ParallelPlan,
    c: Coords,
    stages: &PipelineStages,
) -> Result<Holdings> {
    let table = Holdings::of_rank(cfg, plan, c)?;
    let built: Vec<(usize, Vec<(String, Vec<usize>)>)> = stages
        .chunks()
        .iter()
        .flat_map(|ch| stages.layout().segments(ch.stage).zip(&ch.segments))
        .map(|(index, seg)| {
            let params = seg.params();
            let named = params
                .iter()
                .map(|p| (p.name().to_string(), p.shape().dims().to_vec()));
            (index, named.collect())
        })
        .collect();
    table
        .check(&built)
        .map_err(|why| ParallelizeError::Holdings { rank: c, why })?;
    Ok(table)
}
