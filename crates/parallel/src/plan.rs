//! The parallel plan: everything that decides how the model is split, validated once.
//!
//! A [`ParallelPlan`] is data: the mesh dimensions (dp × pp × tp = world, ep carved out of dp),
//! the data-parallel strategy (DDP or a ZeRO stage), sequence parallelism, the pipeline schedule
//! and its micro-batches, the blocks per stage, activation checkpointing and the precision.
//! [`ParallelPlan::validate`] is the one place that checks a plan against a model, a world and a
//! batch, with the arithmetic in the message (`dp(2) * pp(2) * tp(2) = 8 != world size 4`; the
//! mesh's part is [`MeshDims::problems`]); what it returns, a [`ValidPlan`], is what the builder
//! and the trainer's run take, so neither checks again. The stage layout a plan gives a model
//! ([`ParallelPlan::stage_layout`]) is public so every part that needs it asks the plan instead
//! of deriving it again. What `mtrain plan` prints beyond the mesh is
//! [`crate::holdings::describe`], read from the holdings table.

use mtrain_comm::MeshDims;
use mtrain_model::{Backward, Engine, GptConfig};

use crate::ddp::{DdpConfig, DdpMode};
use crate::fsdp::FsdpConfig;
use crate::mixed_precision::MixedPrecision;
use crate::pipeline::{PassCosts, PipelineError, Schedule, ScheduleKind, StageLayout};
use crate::placement::tp_problems;

/// Why `costs` cannot be one stage's F, B and W (ms), if it cannot: they must be three positive
/// finite numbers. The one rule for `pass_costs`, wherever the numbers come from.
pub fn pass_costs_problem(costs: &[f64]) -> Option<String> {
    let ok = costs.len() == 3 && costs.iter().all(|c| c.is_finite() && *c > 0.0);
    (!ok).then(|| {
        format!("pass_costs (--pass-costs) takes three positive costs F,B,W in ms, got {costs:?}")
    })
}

/// A plan that cannot work, with every reason and its arithmetic, joined by `; `.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid parallel plan: {0}")]
pub struct PlanError(pub String);

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
    /// How the TP layers' collectives meet their products (`--tp-overlap`; no effect when tp = 1).
    pub tp_overlap: TpOverlap,
    /// Pipelined overlap of the MoE layers' all-to-alls (`--ep-overlap`, needs ep > 1 and the
    /// hand-written backward): each micro-batch's tokens in parts, each part's dispatch and
    /// combine on the wire while a neighbouring part's experts compute
    /// (`expert_parallel/overlap.rs`).
    pub ep_overlap: bool,
    /// Pipeline schedule (ignored when pp = 1: the one stage runs its micro-batches in turn).
    pub schedule: ScheduleKind,
    /// Micro-batches per step M; each rank's batch must split into M equal parts.
    pub microbatches: usize,
    /// Blocks per model stage (pp · v entries); None splits evenly.
    pub stage_counts: Option<Vec<usize>>,
    /// F, B and W of one stage (ms) that the zero-bubble orders are built for
    /// ([`Schedule::with_costs`]: every rank builds the same order from the same numbers);
    /// None: the unit-clock orders. The other schedules do not depend on costs.
    pub pass_costs: Option<[f64; 3]>,
    /// Activation checkpointing: keep only segment inputs, recompute in backward.
    pub checkpointing: bool,
    /// Compute dtype and gradient-reduction dtype (bf16 compute keeps fp32 masters).
    pub precision: MixedPrecision,
    /// Each segment's backward: its hand-written tape or candle's autograd.
    pub backward: Backward,
}

/// How the TP layers' collectives meet their products (`tensor_parallel/overlap.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TpOverlap {
    /// Product, then its collective, waited inline.
    #[default]
    None,
    /// The micro-batch's sequences in chunks, each chunk's collective on the wire while the
    /// next chunk's product is computed.
    Chunked,
    /// Sequence parallelism's all-gather and reduce-scatter decomposed into tp steps of
    /// send/receive around the group, each step's product on the part at hand while the next
    /// part is on the wire (collective matmul; needs sequence parallelism).
    Ring,
}

impl TpOverlap {
    pub fn name(self) -> &'static str {
        match self {
            TpOverlap::None => "none",
            TpOverlap::Chunked => "chunked",
            TpOverlap::Ring => "ring",
        }
    }
}

/// A plan [`ParallelPlan::validate`] accepted for a model, a world and a global batch. Only
/// `validate` makes one, so what takes a `ValidPlan` (the builder, the trainer's run) holds the
/// proof and checks nothing again; it reads as the plan it wraps.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidPlan(ParallelPlan);

impl std::ops::Deref for ValidPlan {
    type Target = ParallelPlan;

    fn deref(&self) -> &ParallelPlan {
        &self.0
    }
}

impl ParallelPlan {
    /// A plain plan: `dims`, DDP, no sequence parallelism, 1F1B with one micro-batch, even stages.
    pub fn new(dims: MeshDims) -> Self {
        Self {
            dims,
            data: DataParallelKind::Ddp(DdpConfig::default()),
            sequence_parallel: false,
            tp_overlap: TpOverlap::None,
            ep_overlap: false,
            schedule: ScheduleKind::OneFOneB,
            microbatches: 1,
            stage_counts: None,
            pass_costs: None,
            checkpointing: false,
            precision: MixedPrecision::default(),
            backward: Backward::default(),
        }
    }

    /// The engine every segment of this plan runs under: its checkpointing and backward path.
    pub fn engine(&self) -> Engine {
        Engine::new(self.checkpointing).with_backward(self.backward)
    }

    /// The DDP caps when the gradients are averaged in buckets during the backward: DDP in
    /// bucketed mode, dp > 1, one model stage (no pipeline to flush first) and every gradient
    /// averaged over dp (ep = 1; an expert's goes over its edp replicas). Otherwise None: one
    /// average per parameter, started in the last backward (one stage) or after the flush.
    pub fn dp_buckets(&self) -> Option<DdpConfig> {
        match self.data {
            DataParallelKind::Ddp(d)
                if d.mode == DdpMode::Bucketed
                    && self.dims.dp * self.dims.cp > 1
                    && self.dims.ep == 1
                    && self.num_stages() == 1 =>
            {
                Some(d)
            }
            _ => None,
        }
    }

    /// The schedule actually run: a single stage has nothing to interleave.
    pub fn effective_schedule(&self) -> ScheduleKind {
        if self.dims.pp == 1 {
            ScheduleKind::GPipe
        } else {
            self.schedule
        }
    }

    /// Model stages S = pp · v.
    pub fn num_stages(&self) -> usize {
        self.dims.pp * self.effective_schedule().virtual_stages()
    }

    /// Every reason a layout cannot work, with the arithmetic: `dp(2) * pp(2) * tp(2) = 8 != world
    /// size 4`, `pp 5 > n_layer 4`, `n_head 6 is not divisible by tp 4`, `ep(3) must divide
    /// dp(4)`, `n_experts 4 is not divisible by ep 3`, `--ep needs an MoE model`, micro-batches
    /// not dividing the batch, ... `batch_size` is the global batch of one micro-step
    /// (sequences). A plan that passes comes back as a [`ValidPlan`], the only way to make one.
    pub fn validate(
        &self,
        cfg: &GptConfig,
        world_size: usize,
        batch_size: usize,
    ) -> Result<ValidPlan, PlanError> {
        let mut why = self.layout_problems(cfg, world_size);
        let (dp, m) = (self.dims.dp, self.microbatches);
        if dp > 0 && !batch_size.is_multiple_of(dp) {
            why.push(format!("batch {batch_size} is not divisible by dp {dp}"));
        } else if dp > 0 && m > 0 && !(batch_size / dp).is_multiple_of(m) {
            why.push(format!(
                "per-rank batch {} (batch {batch_size} / dp {dp}) is not divisible by microbatches {m}: \
                 give --batch-size a multiple of {} or --microbatches a divisor of {}",
                batch_size / dp,
                dp * m,
                batch_size / dp
            ));
        }
        if let Some(problem) = self.pass_costs.and_then(|c| pass_costs_problem(&c)) {
            why.push(problem);
        }
        match why.is_empty() {
            true => Ok(ValidPlan(self.clone())),
            false => Err(PlanError(why.join("; "))),
        }
    }

    /// The pipeline's order of passes: the schedule's, built for `pass_costs` where given.
    pub fn schedule(&self) -> Result<Schedule, PipelineError> {
        let (kind, pp, m) = (self.effective_schedule(), self.dims.pp, self.microbatches);
        Ok(match self.pass_costs {
            Some(fbw) => {
                let costs = vec![PassCosts::of_stage(kind, fbw); pp * kind.virtual_stages()];
                Schedule::with_costs(kind, pp, m, &costs)?
            }
            None => Schedule::new(kind, pp, m)?,
        })
    }

    /// How `n_layer` blocks are split into this plan's model stages: `stage_counts`, or evenly;
    /// placed on the pipeline ranks as the schedule places them.
    pub fn stage_layout(&self, n_layer: usize) -> Result<StageLayout, PipelineError> {
        let layout = match &self.stage_counts {
            Some(counts) => StageLayout::from_counts(n_layer, counts),
            None => StageLayout::even(n_layer, self.num_stages()),
        };
        Ok(layout?.with_placement(self.effective_schedule().placement()))
    }

    fn layout_problems(&self, cfg: &GptConfig, world_size: usize) -> Vec<String> {
        let MeshDims { dp, pp, tp, ep, cp } = self.dims;
        let mut why = Vec::new();
        if let Err(e) = cfg.validate() {
            why.push(e.to_string());
        }
        if let Err(e) = self.precision.validate() {
            why.push(e.to_string());
        }
        if self.microbatches == 0 {
            why.push("microbatches must be at least 1, got 0".into());
        }
        // The mesh's own rule: no zero degree, dp·pp·tp = world, ep dividing dp.
        let mesh = self.dims.problems(world_size);
        if [dp, pp, tp, ep, cp].contains(&0) {
            why.extend(mesh);
            return why;
        }
        if !why.is_empty() {
            return why;
        }
        why.extend(mesh);
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
            why.extend(tp_problems(cfg, tp));
        }
        if tp > 1 && self.tp_overlap == TpOverlap::Ring {
            why.extend(ring_problems(self.sequence_parallel, cfg, tp));
        }
        if cp > 1 {
            why.extend(cp_problems(self, cfg));
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
        if self.ep_overlap && ep == 1 {
            why.push(
                "--ep-overlap overlaps the expert-parallel all-to-alls with the experts: it needs --ep 2 or more (and an MoE model)"
                    .to_string(),
            );
        }
        if self.ep_overlap && self.backward == Backward::Autograd {
            why.push(
                "--ep-overlap cuts the MoE layer's hand-written backward in parts; the autograd backward runs its all-to-alls inline: drop --backward autograd or --ep-overlap"
                    .to_string(),
            );
        }
        why
    }
}

/// What `--tp-overlap ring` needs: the all-gather and reduce-scatter it decomposes are
/// sequence parallelism's (as in Megatron-LM, whose `tp_comm_overlap` asserts
/// `sequence_parallel`: without it the layers' collective is an all-reduce of a product's whole
/// output, which no step of a ring has at hand), and every rank's part of a sequence the same
/// length, since each step receives a part the size of its own.
pub fn ring_problems(sequence_parallel: bool, cfg: &GptConfig, tp: usize) -> Vec<String> {
    let mut why = Vec::new();
    if !sequence_parallel {
        why.push(format!(
            "--tp-overlap ring decomposes sequence parallelism's all-gather and reduce-scatter: add --sequence-parallel, or use --tp-overlap chunked with --tp {tp}"
        ));
    }
    if !cfg.block_size.is_multiple_of(tp) {
        why.push(format!(
            "--tp-overlap ring passes equal parts of each sequence around the ring: block_size {} is not divisible by tp {tp}",
            cfg.block_size
        ));
    }
    why
}

/// What context parallelism (cp > 1) does not compose with yet, and what it needs: each rank
/// holds two chunks of every sequence, so block_size must split into 2·cp; the ring runs in
/// the hand-written backward only.
fn cp_problems(plan: &ParallelPlan, cfg: &GptConfig) -> Vec<String> {
    let MeshDims { tp, ep, cp, .. } = plan.dims;
    let mut why = Vec::new();
    if !cfg.block_size.is_multiple_of(2 * cp) {
        why.push(format!(
            "block_size {} is not divisible by 2·cp = {}: each of the {cp} context-parallel ranks holds two equal chunks of the sequence",
            cfg.block_size,
            2 * cp
        ));
    }
    if tp > 1 && plan.sequence_parallel {
        why.push(format!(
            "--cp {cp} with --sequence-parallel: context parallelism runs without sequence parallelism for now"
        ));
    }
    if ep > 1 || cfg.moe.is_some() {
        why.push(format!("--cp {cp} with an MoE model: context parallelism runs dense models for now"));
    }
    if plan.backward == Backward::Autograd {
        why.push(format!(
            "--cp {cp} needs the hand-written backward: ring attention has no autograd form"
        ));
    }
    why
}
