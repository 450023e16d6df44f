//! 4D composition: one top-down function that turns a parameter source and a [`ValidPlan`] (a
//! [`ParallelPlan`] its check accepted) into this rank's part of the model, applying the techniques in a fixed order:
//!
//! ```text
//!   parameter source (the seeded initialisation, a checkpoint, a Hugging Face file)
//!     │ 0.     read this rank's pieces only: the holdings table's parameters (its stages, its
//!     │        experts), each its tensor-parallel piece (Placement::runs); under ZeRO-3 none
//!     │ 1. TP  tensor_parallel::Builder: column/row shards, vocab-parallel wte,
//!     │        sequence-parallel blocks                   (or expert_parallel::segment: EP,
//!     │        context_parallel::segment: the ring's blocks and chunked positions, CP)
//!     │ 2. PP  PipelineStages::build: only the segments of this rank's stage(s) are created
//!     │ 3. DP  DDP: full replicas, checked equal; gradients averaged over dp (experts: edp;
//!     │        with cp, over dp × cp: the dcp group)
//!     │        ZeRO: one Fsdp per stage chunk over the dp group, driven by the pipeline's hooks;
//!     │        each unit reads its shard's runs from the source (stage 3: nothing else exists)
//!     ▼
//!   ParallelModel  (runtime.rs: forward_backward / grad_norm_sq / scaled_step;
//!                   state.rs: full_state / load_full_state / pieces / ...)
//!
//!   rank = (dp_idx · pp + pp_idx) · tp + tp_idx      e.g. dp 2 × pp 2 × tp 2:
//!             tp=0 tp=1
//!   dp=0 pp=0:  0    1     stage 0: embedding, h.0, h.1   (wte rows 0..V/2 on rank 0, V/2..V on 1)
//!   dp=0 pp=1:  2    3     stage 1: h.2, h.3, head
//!   dp=1 pp=0:  4    5     the same shards again: ranks 0 and 4 average their gradients (dp)
//!   dp=1 pp=1:  6    7
//! ```
//!
//! **No rank creates a tensor it does not hold.** Every element of every parameter is read from
//! the source by its place in the single-device tensor, so the layouts start from the numbers
//! of one device bit for bit, and a rank's startup memory is its own part of the model (plus
//! one tensor in flight).
//!
//! **Every layout is a pipeline.** With pp = 1 the model is one stage and the executor's
//! micro-batches are plain gradient accumulation, so there is one code path for every plan.
//!
//! Who holds what is decided by [`crate::placement`] (the tensor-parallel split rule, stages,
//! experts) and the plan's stage layout; this function only applies it. The step it returns is
//! [`crate::runtime`]'s, the state's gather and reshard [`crate::state`]'s.
//!
//! **Mixed precision** ([`ParallelPlan::precision`]). Every piece is cast to bf16 as it is read,
//! so weights, activations, pipeline sends and tensor-parallel collectives are bf16; fp32
//! masters are read from the source like the optimizer moments are cut (tp piece, then ZeRO
//! shard pieces).
//!
//! Refused by the plan's check ([`ParallelPlan::validate`], before a `ValidPlan` exists):
//! tensor parallelism of an MoE model (experts are split by ep), ZeRO of an expert-parallel
//! model, an interleaved schedule without pipeline ranks.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use mtrain_comm::{Coords, DeviceMesh, MeshDims};
use mtrain_model::gpt::ParamStore;
use mtrain_model::source::{read_tensor, ParamSource};
use mtrain_model::{Gpt, GptConfig, Grads, Param, Segment, SequenceChunks};

use crate::context_parallel;
use crate::ddp::{assign_buckets, verify_same_init, CommStats};
use crate::expert_parallel;
use crate::fsdp::{Fsdp, Region, ZeroStage};
use crate::holdings::Holdings;
use crate::pipeline::{PipelineExecutor, PipelineStages, Schedule};
use crate::placement::{is_expert_param, TIED};
use crate::runtime::{FullReplicas, Replicas};
use crate::tensor_parallel;
use crate::toolbox::final_after;

pub use crate::holdings::describe;
pub use crate::plan::{DataParallelKind, ParallelPlan, PlanError, ValidPlan};
pub use crate::runtime::{ParallelModel, ParallelizeError, Result, StepOut};

/// Builds this rank's part of the model: its pieces read from `source` → TP → its pipeline
/// stages → EP → FSDP or DDP (see the module doc). A collective on every group of `mesh`: every
/// rank calls it with a source of the same values (fp32; cast under mixed precision).
pub fn parallelize(
    cfg: &GptConfig,
    source: &dyn ParamSource,
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
    let MeshDims { pp, tp, ep, cp, .. } = plan.dims;
    let c = mesh.coords;
    let sp = plan.sequence_parallel && tp > 1;
    // The compute dtype every piece is cast to (bf16 under mixed precision).
    let dtype = match plan.precision.is_mixed() {
        true => plan.precision.param_dtype,
        false => DType::F32,
    };
    let zero3 = matches!(plan.data, DataParallelKind::Zero(z) if z.stage == ZeroStage::Three);

    // 0. This rank's pieces: what its stages use, its tp piece of each, only its experts. Under
    //    ZeRO-3 the parameters are empty placeholders; the units read their shards (step 3).
    let table = Holdings::of_rank(cfg, plan, c)?;
    let mut regions = BTreeMap::new();
    let mut pieces = BTreeMap::new();
    for h in table.unique() {
        let runs = h.placement.runs(&h.full_shape, c.tp, tp);
        let (full_shape, shape) = (h.full_shape.clone(), h.shape.clone());
        let param = match (zero3, dtype) {
            (true, _) => Param::new(h.name.as_str(), Tensor::zeros(0, dtype, device)?)?,
            (false, DType::F32) => {
                // The values read become the parameter's storage: no second copy.
                let data = source.read(&h.name, &full_shape, &runs)?;
                Param::from_var(h.name.as_str(), Var::from_vec(data, shape.as_slice(), device)?)
            }
            (false, _) => {
                let t = read_tensor(source, &h.name, &full_shape, &runs, &shape, device)?;
                Param::new(h.name.as_str(), t.to_dtype(dtype)?)?
            }
        };
        pieces.insert(h.name.clone(), (full_shape.clone(), param));
        let region = Region {
            shape,
            full_shape,
            runs,
        };
        regions.insert(h.name.clone(), region);
    }

    // 1.–2. Tensor (or expert) parallelism, segment by segment, for this rank's stages only.
    let stage_layout = plan.stage_layout(cfg.n_layer)?;
    let shared = [TIED.to_string()];
    let build = |segment: &mut dyn FnMut(usize) -> Result<Arc<dyn Segment>>| {
        PipelineStages::build(cfg.n_embd, stage_layout.clone(), c.pp, pp, &shared, segment)
    };
    let (mut stages, layout) = if tp > 1 {
        let mut b = tensor_parallel::Builder::new(cfg, &pieces, plan, &mesh.tp, sp)?;
        if cp > 1 {
            b = b.with_cp(mesh.cp.clone());
        }
        let stages = build(&mut |i| Ok(b.segment(i)?))?;
        (stages, Some(b.layout))
    } else {
        let store = ParamStore::from_params(
            pieces.iter().map(|(n, (_, p))| (n.clone(), p.clone())).collect(),
        );
        let stages = match (ep > 1, cp > 1) {
            (true, _) => build(&mut |i| {
                Ok(expert_parallel::segment(cfg, i, &store, &mesh.ep, plan.ep_overlap)?)
            })?,
            (false, true) => build(&mut |i| Ok(context_parallel::segment(cfg, i, &store, &mesh.cp)?))?,
            (false, false) => build(&mut |i| Ok(Gpt::segment(cfg, i, &store)?))?,
        };
        (stages, None)
    };
    drop(pieces);
    if sp {
        stages = stages.with_sequence_split(tp, c.tp);
    }
    let table = check_holdings(table, c, &stages, |p| match zero3 {
        true => regions.get(p.name()).map(|r| r.shape.clone()).unwrap_or_default(),
        false => p.shape().dims().to_vec(),
    })?;
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
    //    unit), each unit reading its shard from the source; DDP keeps full replicas (their tp
    //    pieces), which must start equal.
    let replicas = match plan.data {
        DataParallelKind::Zero(z) => {
            let chunks = stages.chunks().iter().map(|ch| ch.segments.clone());
            let fsdp = Fsdp::over_chunks_from(mesh.dcp.clone(), chunks.collect(), z, source, &regions)?;
            check_shared_units(&fsdp, executor.schedule(), c.pp)?;
            Replicas::Zero(Box::new(fsdp))
        }
        DataParallelKind::Ddp(_) => {
            let (experts, dense): (Vec<Param>, Vec<Param>) = params
                .iter()
                .cloned()
                .partition(|p| is_expert_param(p.name()));
            verify_same_init(&mesh.dcp, &dense)?;
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
        dp: mesh.dcp.clone(),
        chunks: (cp > 1).then_some(SequenceChunks { n: cp, i: c.cp }),
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
        pm.attach_masters(source)?;
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
/// parameters by name and local shape (`shape_of`: a ZeRO-3 placeholder's is its region's), in
/// order; the table, which then says which gradients are partial. A builder that drifts from
/// the table is an error here rather than a wrong figure in the cost model or the memory report.
fn check_holdings(
    table: Holdings,
    c: Coords,
    stages: &PipelineStages,
    shape_of: impl Fn(&Param) -> Vec<usize>,
) -> Result<Holdings> {
    let built: Vec<(usize, Vec<(String, Vec<usize>)>)> = stages
        .chunks()
        .iter()
        .flat_map(|ch| stages.layout().segments(ch.stage).zip(&ch.segments))
        .map(|(index, seg)| {
            let params = seg.params();
            let named = params.iter().map(|p| (p.name().to_string(), shape_of(p)));
            (index, named.collect())
        })
        .collect();
    table
        .check(&built)
        .map_err(|why| ParallelizeError::Holdings { rank: c, why })?;
    Ok(table)
}
