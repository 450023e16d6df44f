//! The model the training loop drives, split over ranks: [`Distributed`], over the
//! [`ParallelModel`] that [`parallelize`] builds for any dp × pp × tp (+ ep, + ZeRO) plan. One
//! device is the plan of a world of one, not a separate path: every layout runs this one step.
//!
//! ```text
//!   mtrain                      world of one: the same step, every group of one rank, no collective
//!   mtrain --dp 4, --tp 2 --dp 2   DDP of one stage: bucket all-reduces launched from the
//!                                  backward's hooks (ParallelPlan::dp_buckets)
//!   mtrain --tp 4 --pp 2, --dp 2 --fsdp, --dp 2 --ep 2, ...    the composed strategies
//!
//!   global batch of one micro-step = dp × B sequences; dp rank d reads rows d·B .. (d+1)·B;
//!   the tp and pp ranks of one dp index read the same rows.
//!
//!   micro-step k of K:  forward_backward(x_k, y_k, MicroStep { index: k, of: K }): the loop's
//!                       count; loss scale 1/K, sync = k == K−1
//!   optimizer step:     grad_sq_norm (one all-reduce) -> the loop's clip_coef -> optimizer_step:
//!                       AdamW on this rank's part with the gradients scaled by it (the norm
//!                       and the coefficient stay on the device until AdamW is queued)
//! ```
//!
//! The loss returned is the mean over the global batch, identical on every rank. After every
//! optimizer step [`Distributed::step_report`] says what the step cost: backward, communication
//! and exposed-communication time, and where they apply the pipeline bubble (measured against
//! the ideal (P−1)/(M+P−1)), the peak number of micro-batches in flight, and the expert load;
//! with pp > 1 also the rank's [`PipelineTimeline`] (forward, backward, send, receive wait per
//! micro-batch), which the loop writes to `RUN_DIR/pipeline-rank{N}.jsonl`.
//!
//! With `--dtype bf16` the plan's [`mtrain_parallel::mixed_precision::MixedPrecision`] makes every layout
//! compute in bf16 with fp32 masters (`parallel/src/mixed_precision.rs`), gradients reduced in
//! `--grad-reduce-dtype` (f32 by default), and the memory report uses the mixed-precision rule
//! (2 + 2 + 12 bytes per parameter, sharded as the ZeRO stage says).
//!
//! Checkpoints are layout-independent without a gather: [`Distributed::save_checkpoint`] has
//! every rank write the pieces it holds with their place in the single-device tensors, and
//! [`Distributed::new`] (the weights) and [`Distributed::load_moments`] have each rank read only
//! the runs of its own pieces from the checkpoint, so a
//! run saved under dp 4 with ZeRO-3 resumes under tp 2 × pp 2, or on one rank.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Context;
use candle_core::{Device, Tensor};
use mtrain_comm::DeviceMesh;
use mtrain_model::source::ParamSource;
use mtrain_model::optim::{AdamW, AdamWConfig, GradScale};
use mtrain_model::{GptConfig, MoeStats};
use mtrain_parallel::ddp::ModelStateBytes;
use mtrain_parallel::holdings::Holdings;
use mtrain_parallel::parallelize::{parallelize, ParallelModel, ParallelPlan, ValidPlan};
use mtrain_parallel::plan::DataParallelKind;
use mtrain_parallel::pipeline::executor::SpanKind;
use serde::Serialize;

use crate::checkpoint::{self, manifest::SavedLayout, Checkpoint};
use crate::memory::{
    step_memory, ActivationLayout, ModelStateLayout, Phase, Routing, StepMemory, StepRun,
};
use crate::micro_step::MicroStep;
use crate::trace::{CommMeter, RunPhase, Timeline};

/// Pipeline figures of one step on this rank.
#[derive(Debug, Clone, Serialize)]
pub struct PipelineFigures {
    /// Wall time of the schedule (ms).
    pub step_ms: f64,
    /// Time not spent in a pass: waits, send issues, bookkeeping (ms).
    pub idle_ms: f64,
    /// idle / step: the measured bubble.
    pub bubble: f64,
    /// The bubble of the schedule simulated with this step's pass times (the pipeline
    /// executor's module doc defines both).
    pub predicted_bubble: f64,
    /// The same schedule with every stage at the mean of those pass times: the schedule on even
    /// stages (predicted − balanced: what the uneven stages cost).
    pub balanced_bubble: f64,
    /// This step's mean pass times per model stage (seconds), behind the prediction.
    pub pass_costs: Vec<mtrain_parallel::pipeline::PassCosts>,
    /// (P − 1)/(v·M + P − 1): the ideal bubble of the schedule.
    pub ideal_bubble: f64,
    /// Most micro-batches alive at once.
    pub peak_in_flight: usize,
    /// Most bytes of saved activations alive at once.
    pub peak_activation_bytes: usize,
    /// What the rank did when (written to `pipeline-rank{N}.jsonl`, not to the step reports).
    #[serde(skip)]
    pub timeline: PipelineTimeline,
}

/// One pipeline step's timeline on this rank: a line of `RUN_DIR/pipeline-rank{N}.jsonl`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PipelineTimeline {
    /// Wall-clock start of the step (ms since the Unix epoch): lines up ranks on one machine.
    pub start_unix_ms: f64,
    /// Wall time of the schedule (ms).
    pub step_ms: f64,
    /// Time not spent in a pass (ms).
    pub idle_ms: f64,
    /// The spans, in the order they happened.
    pub spans: Vec<TimelineSpan>,
}

/// One span of a pipeline rank's step.
#[derive(Debug, Clone, Serialize)]
pub struct TimelineSpan {
    /// forward, backward, input_grad (B), weight_grad (W), send (issue), recv_wait or send_wait.
    pub kind: SpanKind,
    /// Micro-batch (absent for the final send wait).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mb: Option<usize>,
    /// This rank's chunk (0 unless interleaved).
    pub chunk: usize,
    /// Start, ms from the step's start.
    pub start_ms: f64,
    /// End, ms from the step's start.
    pub end_ms: f64,
}

impl PipelineTimeline {
    fn from_report(r: &mtrain_parallel::pipeline::StepReport) -> Self {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        Self {
            start_unix_ms: r
                .started_at
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, ms),
            step_ms: ms(r.step_time),
            idle_ms: ms(r.idle_time),
            spans: r
                .timeline
                .iter()
                .map(|s| TimelineSpan {
                    kind: s.kind,
                    mb: s.mb,
                    chunk: s.chunk,
                    start_ms: ms(s.start),
                    end_ms: ms(s.end),
                })
                .collect(),
        }
    }
}

/// Expert load of one MoE layer over the step, summed over the data-parallel group.
#[derive(Debug, Clone, Serialize)]
pub struct ExpertLoad {
    /// Tokens kept by each expert.
    pub tokens_per_expert: Vec<usize>,
    /// (token, expert) choices dropped at capacity.
    pub dropped: usize,
}

/// What one optimizer step cost on this rank (a field of each metrics.jsonl line).
///
/// The communication figures count every collective of the step on every group of more than one
/// rank (tensor-parallel, pipeline, expert, data-parallel, the loss and norm reductions), from the
/// groups' trace totals ([`crate::trace::CommMeter`]); `comm_ms` is at least `exposed_comm_ms`.
#[derive(Debug, Clone, Serialize)]
pub struct StepReport {
    /// Forward + backward wall time (ms).
    pub backward_ms: f64,
    /// Time the groups were busy with the step's collectives, summed over the groups (ms).
    pub comm_ms: f64,
    /// Time this rank sat blocked waiting for a collective: communication not hidden behind
    /// compute (ms).
    pub exposed_comm_ms: f64,
    /// The exposed time by group (`tp`, `ep`, `dp`, ...), the groups that made the rank wait.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub exposed_by_group: BTreeMap<String, f64>,
    /// Collectives of the step (what `mtrain plan` counts for this rank).
    pub collectives: u64,
    /// Bytes this rank sent to its peers (the plan's "sent/rank").
    pub comm_bytes: u64,
    /// Pipeline figures (pp > 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<PipelineFigures>,
    /// Expert load per MoE layer of this rank's stage (MoE models).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts: Option<Vec<ExpertLoad>>,
}

/// This rank's part of a model under a plan, driven by the training loop.
pub struct Distributed {
    pm: Box<ParallelModel>,
    opt: AdamW,
    cfg: GptConfig,
    plan: ParallelPlan,
    layout: ModelStateLayout,
    comm_buffer_bytes: u64,
    /// This rank's pipeline rank (which stages' activations it holds).
    pp_rank: usize,
    /// This rank's index in its expert-parallel group (which experts it computes).
    /// The experts this rank holds (its holdings table).
    experts_held: BTreeSet<usize>,
    /// Pipeline and expert figures of the step in progress.
    pipeline: Option<PipelineFigures>,
    experts: Option<Vec<ExpertLoad>>,
    last_report: Option<StepReport>,
    /// The step's communication, read from every group's trace totals.
    meter: CommMeter,
    /// Phases and compute spans for `--trace`.
    timeline: Timeline,
    /// Steps this process has started.
    steps_started: u64,
    /// A world of one: no communication to report.
    alone: bool,
    /// This rank and the world's size (checkpoint writing).
    rank: usize,
    world_size: usize,
}

impl Distributed {
    /// Builds this rank's part from `weights` (the seeded initialisation, a Hugging Face file or
    /// a checkpoint), each rank reading only what it holds. A collective over every group of
    /// `mesh`. Clipping is the loop's: it passes the coefficient to
    /// [`Distributed::optimizer_step`].
    pub fn new(
        cfg: &GptConfig,
        weights: &dyn ParamSource,
        plan: &ValidPlan,
        mesh: &DeviceMesh,
        device: &Device,
        optim: AdamWConfig,
    ) -> anyhow::Result<Self> {
        let pm = parallelize(cfg, weights, plan, mesh, device)
            .context("building this rank's part of the model")?;
        // What the model built holds (parallelize checked it against the table).
        let table = Holdings::of_rank(cfg, plan, mesh.coords)?;
        let n_local = table.numel() as u64;
        let experts_held = table.unique().iter().filter_map(|h| h.expert).collect();
        let comm_buffer_bytes = crate::memory::bucket_bytes(plan, n_local);
        Ok(Self {
            pm: Box::new(pm),
            opt: AdamW::new(optim),
            cfg: cfg.clone(),
            plan: ParallelPlan::clone(plan),
            layout: ModelStateLayout::for_plan(n_local, plan),
            comm_buffer_bytes,
            pp_rank: mesh.coords.pp,
            experts_held,
            pipeline: None,
            experts: None,
            last_report: None,
            meter: CommMeter::new(&crate::trace::mesh_groups(mesh)),
            timeline: Timeline::new(&crate::trace::mesh_groups(mesh), false),
            steps_started: 0,
            alone: mesh.world.size() == 1,
            rank: mesh.world.rank(),
            world_size: mesh.world.size(),
        })
    }

    /// Records phases and compute spans on `timeline` (the run's, written under `--trace`).
    pub fn with_timeline(mut self, timeline: Timeline) -> Self {
        self.timeline = timeline;
        self
    }

    /// The plan this model was built from.
    pub fn plan(&self) -> &ParallelPlan {
        &self.plan
    }

    /// The last step's expert load (summed over dp and the step's passes), per MoE block.
    fn last_expert_load(&self) -> Option<Vec<ExpertLoad>> {
        self.last_report.as_ref().and_then(|r| r.experts.clone())
    }

    /// The rows each MoE block dispatched on this rank per pass, from the step's expert load
    /// over its `grad_accum` micro-steps: this rank's tokens fill `1/dp` of the slots kept, its
    /// experts (those its holdings table lists) compute their kept tokens over the `dp/ep`
    /// replicas of each expert.
    fn routing(&self, load: &[ExpertLoad], grad_accum: usize) -> Vec<Routing> {
        let d = self.plan.dims;
        let passes = (grad_accum.max(1) * self.plan.microbatches.max(1)) as f64;
        let replicas = (d.dp / d.ep.max(1)).max(1) as f64;
        load.iter()
            .map(|l| {
                let mine: Vec<f64> = l
                    .tokens_per_expert
                    .iter()
                    .enumerate()
                    .filter(|(e, _)| self.experts_held.contains(e))
                    .map(|(_, &t)| t as f64 / replicas / passes)
                    .collect();
                Routing {
                    sent: l.tokens_per_expert.iter().sum::<usize>() as f64
                        / d.dp.max(1) as f64
                        / passes,
                    received: mine.iter().sum(),
                    busiest: mine.iter().copied().fold(0.0, f64::max),
                }
            })
            .collect()
    }

    /// Bytes of parameters, gradients and optimizer state this rank holds right now.
    pub fn model_state_bytes(&self) -> ModelStateBytes {
        self.pm.model_state_bytes(&self.opt)
    }
}

fn expert_load(stats: &[MoeStats]) -> Vec<ExpertLoad> {
    stats
        .iter()
        .map(|s| ExpertLoad {
            tokens_per_expert: s.tokens_per_expert.clone(),
            dropped: s.dropped,
        })
        .collect()
}

/// What the loop calls: the step, the evaluation, checkpoint state, and what the memory and
/// step reports read.
impl Distributed {
    /// Forward and backward of one micro-batch `(B, T)`, micro-step `micro` of the optimizer
    /// step, adding [`MicroStep::loss_scale`] × its gradients to the accumulated ones (the last
    /// micro-step syncs them); `mark` is called after the forward (on a pipeline, right before
    /// this rank's first backward, where its activations peak) and after the backward (memory
    /// report). Returns the micro-batch's mean loss over the global batch.
    pub fn forward_backward(
        &mut self,
        inputs: &Tensor,
        targets: &Tensor,
        micro: MicroStep,
        mark: &mut dyn FnMut(Phase),
    ) -> anyhow::Result<f64> {
        if micro.is_first() {
            self.pipeline = None;
            self.experts = None;
            self.meter.begin();
            self.timeline
                .enter(RunPhase::Step, Some(self.steps_started));
            self.steps_started += 1;
        }
        let (t_start, wall_start) = (self.timeline.now_us(), std::time::SystemTime::now());
        let sync = micro.is_last();
        self.pm.set_dropout(micro.dropout);
        // The pipeline interleaves forwards and backwards: "after forward" is read
        // right before this rank's first backward, where its activations peak.
        let mut before_backward = || mark(Phase::AfterForward);
        let out = self.pm.forward_backward_observed(
            inputs,
            targets,
            micro.loss_scale(),
            sync,
            &mut before_backward,
        )?;
        if let Some(r) = &out.pipeline {
            let f = PipelineFigures {
                step_ms: r.step_time.as_secs_f64() * 1e3,
                idle_ms: r.idle_time.as_secs_f64() * 1e3,
                bubble: r.bubble_fraction,
                predicted_bubble: r.predicted_bubble_fraction,
                balanced_bubble: r.balanced_bubble_fraction,
                pass_costs: r.pass_costs.clone(),
                ideal_bubble: r.analytic_bubble_fraction,
                peak_in_flight: r.peak_in_flight,
                peak_activation_bytes: r.peak_activation_bytes,
                timeline: PipelineTimeline::from_report(r),
            };
            // The schedule's spans, placed on the tracers' clock.
            let at = self.timeline.us_at(r.started_at.max(wall_start));
            for s in &r.timeline {
                let name = serde_json::to_value(s.kind)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default();
                let us = |d: std::time::Duration| at + d.as_micros() as u64;
                self.timeline.span(&name, s.mb, us(s.start), us(s.end));
            }
            self.pipeline = Some(f);
        }
        if let Some(load) = &out.moe_load {
            let new = expert_load(load);
            self.experts = Some(match self.experts.take() {
                None => new,
                Some(mut acc) => {
                    for (a, n) in acc.iter_mut().zip(new) {
                        for (x, y) in a.tokens_per_expert.iter_mut().zip(n.tokens_per_expert) {
                            *x += y;
                        }
                        a.dropped += n.dropped;
                    }
                    acc
                }
            });
        }
        let loss = out.loss;
        if self.plan.dims.pp == 1 {
            let end = self.timeline.now_us();
            self.timeline.span("forward+backward", None, t_start, end);
        }
        mark(Phase::AfterBackward);
        Ok(loss)
    }

    /// Mean loss of a batch without gradients.
    pub fn eval_loss(&mut self, inputs: &Tensor, targets: &Tensor) -> anyhow::Result<f64> {
        self.timeline.enter(RunPhase::Eval, None);
        let start = self.timeline.now_us();
        let loss = self.pm.eval_loss(inputs, targets)?;
        self.timeline
            .span("eval", None, start, self.timeline.now_us());
        Ok(loss)
    }

    /// Σ g² over all accumulated gradients of the whole model (a sharded model reduces it), as
    /// one f64 on the model's device: the loop reads it once the optimizer step is queued, so
    /// on a GPU the host does not wait for the norm in between.
    pub fn grad_sq_norm(&mut self) -> anyhow::Result<Tensor> {
        let start = self.timeline.now_us();
        let sq = self.pm.grad_norm_sq_on_device()?;
        self.timeline
            .span("grad norm", None, start, self.timeline.now_us());
        Ok(sq)
    }

    /// Scales the gradients by `grad_scale`, the loop's clip coefficient of the norm
    /// [`Distributed::grad_sq_norm`] gave (so the norm's all-reduce runs once per step), steps
    /// AdamW at `lr` over this rank's part, clears the gradients and keeps the step's report.
    pub fn optimizer_step(&mut self, lr: f64, grad_scale: GradScale) -> anyhow::Result<()> {
        let start = self.timeline.now_us();
        self.pm.scaled_step(&mut self.opt, lr, grad_scale)?;
        let end = self.timeline.now_us();
        self.timeline.span("optimizer", None, start, end);
        self.timeline.enter(RunPhase::Other, None);
        let c = self.pm.comm_stats();
        let (comm, groups) = self.meter.end();
        let exposed_by_group = groups
            .into_iter()
            .filter(|(_, t)| t.blocked_us > 0)
            .map(|(name, t)| (name, t.blocked_us as f64 * 1e-3))
            .collect();
        self.last_report = Some(StepReport {
            backward_ms: c.backward_s * 1e3,
            comm_ms: comm.busy_us as f64 * 1e-3,
            exposed_comm_ms: comm.blocked_us as f64 * 1e-3,
            exposed_by_group,
            collectives: comm.ops,
            comm_bytes: comm.bytes_sent,
            pipeline: self.pipeline.take(),
            experts: self.experts.take(),
        });
        Ok(())
    }

    /// Writes this rank's part of the checkpoint of `step` into `run_dir` without gathering
    /// anything: rank 0 prepares the temporary directory, every rank writes the pieces it
    /// stores (weights or fp32 masters, and AdamW's moments once it has stepped), and rank 0
    /// seals and publishes it (`crate::checkpoint`'s module doc). A collective on every rank;
    /// returns the directory on rank 0 and the bytes this rank wrote.
    pub fn save_checkpoint(
        &self,
        run_dir: &std::path::Path,
        step: u64,
        data_position: u64,
        config: &crate::config::TrainConfig,
    ) -> anyhow::Result<(Option<std::path::PathBuf>, u64)> {
        self.timeline.enter(RunPhase::Checkpoint, None);
        let start = self.timeline.now_us();
        let rank = self.rank;
        if rank == 0 {
            checkpoint::prepare_tmp(run_dir, step)?;
        }
        self.pm.barrier()?;
        let tmp = checkpoint::tmp_dir(run_dir, step);
        let pieces: Vec<_> = self.pm.pieces().into_iter().filter(|p| self.pm.stores(p)).collect();
        let optimizer_step = self.opt.steps_taken();
        let written = checkpoint::write_rank(&tmp, rank, &pieces, optimizer_step > 0, |p, k| {
            let t = self.pm.piece_values(&self.opt, p, k)?;
            let t = t.with_context(|| format!("no {k:?} of `{}` on rank {rank}", p.name))?;
            Ok(t.to_vec1::<f32>()?)
        })?;
        self.pm.barrier()?;
        let dir = match rank {
            0 => Some(checkpoint::finish_sharded(
                run_dir,
                &tmp,
                &checkpoint::ShardedMeta {
                    step,
                    config,
                    data_position,
                    optimizer_step,
                    layout: self.saved_layout(),
                    world_size: self.world_size,
                },
            )?),
            _ => None,
        };
        self.timeline
            .span("write shards", None, start, self.timeline.now_us());
        Ok((dir, written))
    }

    /// The layout recorded in a checkpoint's manifest.
    fn saved_layout(&self) -> SavedLayout {
        let d = self.plan.dims;
        SavedLayout {
            dp: d.dp,
            pp: d.pp,
            tp: d.tp,
            ep: d.ep,
            zero_stage: match &self.plan.data {
                DataParallelKind::Zero(z) => Some(z.stage as u8),
                DataParallelKind::Ddp(_) => None,
            },
            precision: if self.plan.precision.is_mixed() {
                "bf16".into()
            } else {
                "f32".into()
            },
        }
    }

    /// Restores AdamW's state of `ckpt`, written under any layout (the weights came from it
    /// through [`Distributed::new`]): each piece this rank holds reads only its own runs of
    /// each moment.
    pub fn load_moments(&mut self, ckpt: &Checkpoint) -> anyhow::Result<()> {
        if let Some((m, v, step)) = ckpt.moments() {
            self.pm.load_moments(&mut self.opt, &*m, &*v, step)?;
        }
        Ok(())
    }

    /// Bytes of the pieces this rank holds (weights and both moments: what it writes when it
    /// stores every one) and of its largest piece's values (one parameter's buffer).
    pub fn piece_bytes(&self) -> (u64, u64) {
        let pieces = self.pm.pieces();
        let all = pieces.iter().map(|p| p.len() as u64).sum::<u64>();
        let largest = pieces.iter().map(|p| p.len() as u64).max().unwrap_or(0);
        (12 * all, 4 * largest)
    }

    /// The bytes-per-parameter layout this rank holds (for the memory report).
    pub fn memory_layout(&self) -> ModelStateLayout {
        self.layout
    }

    /// What a step over `batch` rows of `seq` tokens adds to this rank's memory (activations,
    /// gathers, peak: [`crate::memory::rank_step_memory`]): this rank's blocks, micro-batches in
    /// flight, tp and ep splits and gathers ([`ActivationLayout::for_plan`]).
    pub fn step_memory(&self, cfg: &GptConfig, batch: usize, run: StepRun) -> StepMemory {
        let layout = ActivationLayout::for_plan(cfg, &self.plan, self.pp_rank, batch);
        let mut layout = layout.unwrap_or_else(|e| {
            tracing::warn!("memory estimate of the whole model (not per rank): {e}");
            ActivationLayout::single_device(cfg, batch)
        });
        if let (Some(_), Some(load)) = (&cfg.moe, &self.last_expert_load()) {
            layout.routing = self.routing(load, run.grad_accum);
        }
        step_memory(cfg, &layout, &self.layout, run)
    }

    /// Communication buffer bytes this rank holds.
    pub fn comm_bytes(&self) -> u64 {
        self.comm_buffer_bytes
    }

    /// Whether [`Distributed::step_memory`] counts the MoE rows the last step's router
    /// dispatched (then the report recomputes it after every step); false: an even split.
    pub fn routing_is_measured(&self) -> bool {
        self.cfg.moe.is_some() && self.last_expert_load().is_some()
    }

    /// What the last optimizer step cost beyond the loss (communication, pipeline bubble,
    /// expert load), as a JSON object; None in a world of one.
    pub fn step_report(&self) -> Option<serde_json::Value> {
        self.last_report
            .as_ref()
            .filter(|_| !self.alone)
            .and_then(|r| serde_json::to_value(r).ok())
    }

    /// The same as one human-readable line for the log.
    pub fn step_line(&self) -> Option<String> {
        self.last_report
            .as_ref()
            .filter(|_| !self.alone)
            .map(|r| r.to_string())
    }

    /// The last optimizer step's pipeline timeline on this rank (spans of forward, backward,
    /// send and receive wait per micro-batch), as a JSON object; None without a pipeline.
    pub fn pipeline_timeline(&self) -> Option<serde_json::Value> {
        let p = self.last_report.as_ref()?.pipeline.as_ref()?;
        serde_json::to_value(&p.timeline).ok()
    }
}

impl std::fmt::Display for StepReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "backward {:.1} ms | comm {:.1} ms, exposed {:.1} ms ({} collectives, {:.2} MiB)",
            self.backward_ms,
            self.comm_ms,
            self.exposed_comm_ms,
            self.collectives,
            self.comm_bytes as f64 / (1 << 20) as f64
        )?;
        if let Some(p) = &self.pipeline {
            write!(
                f,
                " | bubble {:.3} (predicted {:.3} from this step's pass times, {:.3} on even \
                 stages; ideal {:.3}), {} micro-batches in flight",
                p.bubble, p.predicted_bubble, p.balanced_bubble, p.ideal_bubble, p.peak_in_flight
            )?;
        }
        for (i, e) in self.experts.iter().flatten().enumerate() {
            write!(
                f,
                " | moe{i} tokens/expert {:?} dropped {}",
                e.tokens_per_expert, e.dropped
            )?;
        }
        Ok(())
    }
}
