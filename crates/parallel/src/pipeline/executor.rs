//! The pipeline executor: runs one rank's [`Schedule`] actions for one training step.
//!
//! ```text
//!   Forward { mb, chunk }                         Backward { mb, chunk }
//!     x  = first stage ? idx[mb]                    g  = last stage ? None (the loss: scale 1/M)
//!                      : recv act  <- prev stage                   : recv grad <- next stage
//!     acts[mb, chunk] = engine.forward(x)           gx = engine.backward(acts.remove(mb, chunk), g)
//!     last stage ? loss += acts.output              first stage ? done
//!                : send act -> next stage (async)              : send gx -> prev stage (async)
//! ```
//!
//! The split backward of the zero-bubble schedules (ZB-H1, ZB-V) runs as two calls on the same
//! tapes ([`Engine::backward_input`], [`Engine::backward_weights`]):
//!
//! ```text
//!   InputGrad { mb, chunk }  (B)                   WeightGrad { mb, chunk }  (W)
//!     g  = recv grad <- next stage (or the loss)     owed.remove(mb, chunk)
//!     gx, owed[mb, chunk] = engine.backward_input      engine.backward_weights -> grads
//!              (acts consumed; weight products kept)   post_backward hooks fire here
//!     send gx -> prev stage (async)
//! ```
//!
//! Communication is implicit in the actions: a schedule only says "forward micro-batch 3
//! through chunk 0", and the stage's position decides what to receive and where to send.
//! Sends are asynchronous: the `Work` is kept and compute goes on (on the CPU backend once the
//! bytes are in the socket or with the communication thread, so the message leaves before the
//! next pass takes the core); finished sends are reaped after every action and the rest are
//! waited at the end of the step. A receive is made when the action needs its input, blocking.
//! Schedules are built so that between two ranks the messages are received in the order they
//! were sent (a test in `schedule.rs` checks it), so no tags are needed.
//!
//! The bubble, measured and predicted, counted the same way on this rank:
//! - **measured** = idle time / step time, where the step runs from the first action to the
//!   completion of the last send, and idle is everything in it that is not a pass (forward or
//!   backward): the receive waits, the send issues, the final wait for sends and the executor's
//!   own bookkeeping between spans (a pass is a forward, a fused backward, a B or a W);
//! - **predicted** = the same fraction on the schedule's grid simulated
//!   ([`Schedule::simulate_with`], [`rank_bubble_fraction`](super::Simulation::rank_bubble_fraction)) with this step's
//!   measured cost of each pass kind on each model stage: the mean F, backward (fused, or B)
//!   and W time of each chunk of each rank, gathered over the pipeline group with the loss.
//!   The simulation counts only passes as busy and sends as free, so the gap between the two
//!   is what the pipeline loses beyond its schedule (messages, bookkeeping, ranks sharing
//!   cores);
//! - **balanced** = the same simulation with every model stage at the mean of those costs:
//!   what the schedule gives this step's passes on even stages, so predicted − balanced is
//!   what the uneven stages cost (a last stage slowed by the head, a stage on a slower core);
//! - **ideal** = the schedule's bubble at equal costs, `(P − 1)/(v·M + P − 1)`.
//!
//! On passes of known cost (`tests/bubble.rs`: stages that sleep F, B and W) the measured and
//! the predicted figure agree within 0.03, under 1F1B, ZB-H1 and ZB-V.
//!
//! The executor runs the schedule it is given and does not rebuild it from the pass costs it
//! gathers. Those costs are gathered over the pipeline group only, and the ranks that must run
//! identical orders are not all in one: the tp ranks of a stage, and the dp replicas of it, each
//! sit in another pipeline group, gather other timings and would build other orders, and then
//! issue their tensor-parallel collectives, DDP buckets and ZeRO reduce-scatters in different
//! orders, a hang. The cost-aware order ([`Schedule::with_costs`]) is built instead from the
//! costs every rank is given (`--pass-costs F,B,W`, read by `ParallelPlan::schedule`): the same
//! numbers on every rank, the same order.
//!
//! The batch (B, T) is split into M micro-batches of B/M sequences. Each micro-batch's mean loss
//! is scaled by 1/M before its backward, so the gradients summed over micro-batches equal the
//! gradient of the full-batch mean loss, as on one device. A micro-batch's activations live from
//! its forward to its backward (which consumes them), or under a split backward until its W
//! (B consumes the activations and keeps the weight products' factors, which count too); their
//! high-water mark is reported (1F1B: at most P − r on rank r; GPipe: M; ZB-H1: min(P, M)).
//!
//! Every step also records this rank's timeline ([`StepReport::timeline`]): one [`Span`] per
//! forward, backward (or B and W), send issue, receive wait and the final wait for outstanding
//! sends, with start and end relative to the step's start (two clock reads per span, always
//! on). Drawn one row per rank it is the schedule's grid as it really ran; the gaps between
//! spans are the executor's own bookkeeping:
//!
//! ```text
//!   1F1B, P = 2, M = 2                    time ─▶
//!   rank 0  [F0]s[F1]s~~~~[B0]~~~~~[B1]
//!   rank 1  ~~~~~[F0][B0]s[F1][B1]s==
//!
//!   [F0] [B0]: compute   ~: waiting for a receive   s: a send issued   =: final wait for sends
//! ```
//!
//! Data parallelism inside a pipeline hangs on [`StageHooks`]: [`PipelineExecutor::step_with_hooks`]
//! hands each pass the engine hooks of its chunk (FSDP's gather / free / reduce-scatter), and
//! says which backward (fused, or W) is the chunk's last of the step, after which its gradients
//! are final: DDP's buckets and ZeRO's reduce-scatters hang on the `post_backward` of W.
//! With sequence parallelism ([`PipelineStages::with_sequence_split`]) the activations passed
//! between stages are this rank's sequence shard (b, T/tp, C).
//!
//! Legend: B batch, b = B/M micro-batch, T time, C width, P pipeline ranks, M micro-batches.

mod links;

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use candle_core::{DType, Shape, Tensor};
use mtrain_comm::{chunk_range, Communicator};
use mtrain_kernels::readback::ReadLater;
use mtrain_model::{Activations, Draw, Engine, Grads, Hooks, MoeStats, NoHooks, PendingGrads};

use super::schedule::{Action, PassCosts, Schedule};
use super::stage::PipelineStages;
use super::{PipelineError, Result};
use links::{Links, Timeline};
pub use links::{Span, SpanKind};

/// The f64s each pipeline rank contributes to the step's one all-gather: the loss share, then
/// per chunk the mean forward, backward (fused, or B) and W time.
pub fn gathered_f64s(virtual_stages: usize) -> usize {
    1 + 3 * virtual_stages
}

/// What one pipeline step measured on one rank.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// Mean loss over the batch (computed on the last stage, broadcast to every pipeline rank).
    pub loss: f64,
    /// Auxiliary losses (MoE) of this rank's segments, averaged over the micro-batches.
    pub aux_loss: f64,
    /// Wall time of the schedule on this rank, from the first action to the last send's completion.
    pub step_time: Duration,
    /// Part of `step_time` not spent in a pass: receive waits, send issues, the final wait for
    /// sends and bookkeeping.
    pub idle_time: Duration,
    /// `idle_time / step_time`: the measured bubble on this rank.
    pub bubble_fraction: f64,
    /// This rank's bubble on the schedule simulated with this step's pass costs (module doc).
    pub predicted_bubble_fraction: f64,
    /// The same with every stage at the mean of those costs: the schedule on even stages.
    pub balanced_bubble_fraction: f64,
    /// This step's mean cost of each pass kind on each model stage, in seconds (every rank's,
    /// gathered over the pipeline group).
    pub pass_costs: Vec<PassCosts>,
    /// The ideal-pipeline bubble of this schedule, (P − 1)/(v·M + P − 1).
    pub analytic_bubble_fraction: f64,
    /// Most micro-batches (per chunk) whose activations were alive at once on this rank.
    pub peak_in_flight: usize,
    /// Most bytes of saved stage inputs (and outputs, without checkpointing) alive at once,
    /// as counted by [`Activations::held_bytes`].
    pub peak_activation_bytes: usize,
    /// Routing statistics of this rank's MoE layers, summed over the micro-batches (empty for a
    /// dense model), chunk by chunk in segment order.
    pub moe_stats: Vec<MoeStats>,
    /// This rank's timeline of the step, in the order things happened.
    pub timeline: Vec<Span>,
    /// Wall-clock time of the step's start, to line up the timelines of ranks (processes) that
    /// share a clock.
    pub started_at: SystemTime,
}

impl std::fmt::Display for StepReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "loss {:.4} | step {:.1} ms, idle {:.1} ms | bubble {:.3} (predicted {:.3} from this \
             step's pass times, {:.3} on even stages; ideal {:.3}) | {} micro-batches in flight \
             ({:.1} KiB of activations)",
            self.loss,
            self.step_time.as_secs_f64() * 1e3,
            self.idle_time.as_secs_f64() * 1e3,
            self.bubble_fraction,
            self.predicted_bubble_fraction,
            self.balanced_bubble_fraction,
            self.analytic_bubble_fraction,
            self.peak_in_flight,
            self.peak_activation_bytes as f64 / 1024.0
        )
    }
}

/// The engine hooks each pass of a pipeline step runs with.
pub trait StageHooks {
    /// Hooks for one pass of this rank's chunk `chunk`. `last_backward` is true for the chunk's
    /// last backward pass (fused, or W) of the step: its gradients are final after it.
    fn hooks(&mut self, chunk: usize, last_backward: bool) -> &mut dyn Hooks;
    /// Called once per step, right after the forward that first brings this rank to the most
    /// activation sets its schedule holds at once (before the first backward under GPipe and
    /// 1F1B; later under ZB-H1 and ZB-V, whose W's hold a set past its B): the memory report
    /// reads its level here.
    fn at_activation_peak(&mut self) {}
}

/// No hooks for any pass.
pub struct NoStageHooks(pub NoHooks);

impl StageHooks for NoStageHooks {
    fn hooks(&mut self, _chunk: usize, _last_backward: bool) -> &mut dyn Hooks {
        &mut self.0
    }
}

/// Runs a [`Schedule`] over a rank's [`PipelineStages`] with a block-wise [`Engine`].
#[derive(Debug, Clone)]
pub struct PipelineExecutor {
    schedule: Schedule,
    engine: Engine,
}

impl PipelineExecutor {
    pub fn new(schedule: Schedule, engine: Engine) -> Self {
        Self { schedule, engine }
    }

    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The dropout of the next steps' passes: `draw` for the rank's whole batch, each
    /// micro-batch's rows offset within it (None: no dropout).
    pub fn set_dropout(&mut self, draw: Option<Draw>) {
        self.engine = self.engine.with_dropout(draw);
    }

    /// The engine of micro-batch `mb` of `b` rows: the step's dropout at that micro-batch's rows.
    fn engine_of(&self, mb: usize, b: usize) -> Engine {
        let draw = self.engine.dropout.map(|d| d.at_rows(mb * b));
        self.engine.with_dropout(draw)
    }

    /// One training step on this pipeline rank: run its actions over the batch `idx` / `targets`
    /// (both (B, T); every pipeline rank passes the same batch: the first stage reads `idx`, the
    /// last `targets`), add this rank's parameter gradients to `grads`, sum the tied gradients
    /// between first and last stage, and return the loss and the step's measurements.
    pub fn step(
        &self,
        stages: &PipelineStages,
        pp: &dyn Communicator,
        idx: &Tensor,
        targets: &Tensor,
        grads: &mut Grads,
    ) -> Result<StepReport> {
        self.run(
            stages,
            pp,
            idx,
            targets,
            1.0,
            grads,
            &mut NoStageHooks(NoHooks),
            true,
        )
    }

    /// [`PipelineExecutor::step`] with `hooks` around every pass and the gradients scaled by
    /// `loss_scale` (times 1/M), **without** summing the tied gradients: the caller does that
    /// once its data-parallel reduction is done (the sum over the two stages commutes with it).
    #[allow(clippy::too_many_arguments)]
    pub fn step_with_hooks(
        &self,
        stages: &PipelineStages,
        pp: &dyn Communicator,
        idx: &Tensor,
        targets: &Tensor,
        loss_scale: f64,
        grads: &mut Grads,
        hooks: &mut dyn StageHooks,
    ) -> Result<StepReport> {
        self.run(stages, pp, idx, targets, loss_scale, grads, hooks, false)
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        stages: &PipelineStages,
        pp: &dyn Communicator,
        idx: &Tensor,
        targets: &Tensor,
        grad_scale: f64,
        grads: &mut Grads,
        hooks: &mut dyn StageHooks,
        sync_tied: bool,
    ) -> Result<StepReport> {
        let sched = &self.schedule;
        let (p, m, rank) = (sched.num_ranks(), sched.num_microbatches(), stages.rank());
        if stages.num_ranks() != p
            || pp.size() != p
            || pp.rank() != rank
            || stages.chunks().len() != sched.virtual_stages()
        {
            return Err(PipelineError::Layout(format!(
                "schedule for P = {p} with v = {} chunks, but the stages are rank {rank} of {} with {} chunks \
                 and the pipeline group is rank {} of {}",
                sched.virtual_stages(),
                stages.num_ranks(),
                stages.chunks().len(),
                pp.rank(),
                pp.size()
            )));
        }
        if let Some(c) = (0..sched.virtual_stages())
            .find(|&c| stages.chunks()[c].stage != sched.model_stage(rank, c))
        {
            return Err(PipelineError::Layout(format!(
                "rank {rank}'s chunk {c} is model stage {}, but the {} schedule places stage {} there",
                stages.chunks()[c].stage,
                sched.kind(),
                sched.model_stage(rank, c)
            )));
        }
        let (batch, t) = idx.dims2()?;
        if batch % m != 0 || targets.dims() != idx.dims() {
            return Err(PipelineError::UnevenBatch {
                batch,
                microbatches: m,
            });
        }
        let b = batch / m;
        let t_local = match stages.sequence_split() {
            Some((size, r)) => chunk_range(t, size, r).len(), // T/tp
            None => t,
        };
        let act_shape = Shape::from((b, t_local, stages.n_embd())); // (b, T, C) or (b, T/tp, C)
        let act_dtype = stages.activation_dtype();
        let last_stage = sched.num_model_stages() - 1;
        let loss_scale = 1.0 / m as f64;
        let grad_scale = grad_scale * loss_scale;
        let last_backward = sched.last_backwards(rank);

        let mut links = Links {
            pp,
            rank,
            mailbox: HashMap::new(),
            sends: Vec::new(),
            timeline: Timeline {
                t0: Instant::now(),
                spans: Vec::with_capacity(6 * sched.actions(rank).len()),
            },
        };
        let mut alive: HashMap<(usize, usize), Activations> = HashMap::new();
        // What each B left for its W.
        let mut owed: HashMap<(usize, usize), PendingGrads> = HashMap::new();
        let (mut peak, mut loss_sum, mut aux_sum) = (0, 0.0, 0.0);
        // The micro-batches' losses on their way to the host: one stage reads them after its
        // last backward is queued (the device is never idle for the read); a pipeline stage
        // reads each at once, as its timeline has always been taken.
        let mut losses: Vec<ReadLater> = Vec::new();
        let mut moe_stats: Vec<Vec<MoeStats>> = vec![Vec::new(); stages.chunks().len()];
        let (mut alive_bytes, mut peak_bytes) = (0, 0);
        let peak_at = activation_peak_at(sched.actions(rank));
        let (start, started_at) = (links.timeline.t0, SystemTime::now());
        for (i, action) in sched.actions(rank).iter().enumerate() {
            let (mb, chunk) = (action.mb(), action.chunk());
            let stage = &stages.chunks()[chunk];
            let key = |s: usize| (action.is_forward(), mb, s);
            match action {
                Action::Forward { .. } => {
                    let x = match sched.input_stage(rank, action) {
                        None => idx.narrow(0, mb * b, b)?, // (b, T) token ids
                        Some(from) => links.recv(
                            sched.rank_of_stage(from),
                            key(stage.stage),
                            chunk,
                            &act_shape,
                            act_dtype,
                        )?,
                    };
                    let mb_targets = targets.narrow(0, mb * b, b)?; // (b, T)
                    let tgt = (stage.stage == last_stage).then_some(&mb_targets);
                    let acts = links
                        .timeline
                        .time(SpanKind::Forward, Some(mb), chunk, || {
                            self.engine_of(mb, b).forward(
                                &stage.segments,
                                &x,
                                tgt,
                                hooks.hooks(chunk, false),
                            )
                        })?;
                    aux_sum += acts.aux_loss;
                    add_stats(&mut moe_stats[chunk], &acts.stats);
                    match sched.output_stage(rank, action) {
                        None => {
                            let read = ReadLater::start(&acts.output.to_dtype(DType::F64)?)?;
                            match p {
                                1 => losses.push(read),
                                _ => loss_sum += read.wait()?,
                            }
                        }
                        Some(to) => links.send(
                            acts.output.clone(),
                            sched.rank_of_stage(to),
                            key(to),
                            chunk,
                        )?, // (b, T, C)
                    }
                    alive_bytes += acts.held_bytes();
                    peak_bytes = peak_bytes.max(alive_bytes);
                    alive.insert((mb, chunk), acts);
                    peak = peak.max(alive.len() + owed.len());
                }
                Action::WeightGrad { .. } => {
                    let pending = owed.remove(&(mb, chunk)).ok_or_else(|| {
                        PipelineError::Layout(format!(
                            "rank {rank}: W of micro-batch {mb} chunk {chunk} before its B"
                        ))
                    })?;
                    alive_bytes -= pending.held_bytes();
                    let final_pass = last_backward[chunk] == Some(i);
                    links
                        .timeline
                        .time(SpanKind::WeightGrad, Some(mb), chunk, || {
                            self.engine_of(mb, b).backward_weights(
                                &stage.segments,
                                pending,
                                grads,
                                hooks.hooks(chunk, final_pass),
                            )
                        })?;
                }
                Action::Backward { .. } | Action::InputGrad { .. } => {
                    let grad_out = match sched.input_stage(rank, action) {
                        None => None,
                        Some(from) => Some(links.recv(
                            sched.rank_of_stage(from),
                            key(stage.stage),
                            chunk,
                            &act_shape,
                            act_dtype,
                        )?),
                    };
                    let acts = alive.remove(&(mb, chunk)).ok_or_else(|| {
                        PipelineError::Layout(format!("rank {rank}: backward of micro-batch {mb} chunk {chunk} before its forward"))
                    })?;
                    alive_bytes -= acts.held_bytes();
                    let final_pass = last_backward[chunk] == Some(i);
                    let engine = self.engine_of(mb, b);
                    let grad_in = links.timeline.time(
                        SpanKind::of(action.kind()),
                        Some(mb),
                        chunk,
                        || -> Result<Option<Tensor>> {
                            let g = grad_out.as_ref();
                            if action.computes_weight_grads() {
                                let h = hooks.hooks(chunk, final_pass);
                                return Ok(engine.backward(
                                    &stage.segments,
                                    acts,
                                    g,
                                    grad_scale,
                                    grads,
                                    h,
                                )?);
                            }
                            let h = hooks.hooks(chunk, false);
                            let (grad_in, pending) =
                                engine.backward_input(&stage.segments, acts, g, grad_scale, h)?;
                            alive_bytes += pending.held_bytes();
                            peak_bytes = peak_bytes.max(alive_bytes);
                            owed.insert((mb, chunk), pending);
                            Ok(grad_in)
                        },
                    )?;
                    if let Some(to) = sched.output_stage(rank, action) {
                        let g = grad_in.ok_or_else(|| {
                            PipelineError::Layout(format!(
                                "rank {rank}: stage {} produced no input gradient",
                                stage.stage
                            ))
                        })?;
                        links.send(g, sched.rank_of_stage(to), key(to), chunk)?;
                        // (b, T, C)
                    }
                }
            }
            if peak_at == Some(i) {
                hooks.at_activation_peak();
            }
            links.reap_finished_sends()?;
        }
        links.wait_all_sends()?;
        for read in losses {
            loss_sum += read.wait()?;
        }
        let step_time = start.elapsed();

        if sync_tied {
            stages.sync_tied_grads(pp, grads)?;
        }
        // This rank's mean pass times per chunk: (count, seconds) of F, backward (fused or B), W.
        let v = sched.virtual_stages();
        let mut sums = vec![[(0usize, 0.0f64); 3]; v];
        let mut busy = Duration::ZERO;
        for sp in &links.timeline.spans {
            let k = match sp.kind {
                SpanKind::Forward => 0,
                SpanKind::Backward | SpanKind::InputGrad => 1,
                SpanKind::WeightGrad => 2,
                _ => continue,
            };
            let d = sp.end - sp.start;
            busy += d;
            let (n, t) = &mut sums[sp.chunk][k];
            *n += 1;
            *t += d.as_secs_f64();
        }
        let mean = |(n, t): (usize, f64)| if n == 0 { 0.0 } else { t / n as f64 };
        // [loss share, then (F, backward or B, W) per chunk]: one message for the loss (nonzero
        // on the last stage's rank only) and the pass times every rank's prediction needs.
        let mut mine = vec![loss_sum * loss_scale];
        mine.extend(sums.iter().flat_map(|c| c.map(mean)));
        let row = mine.len(); // gathered_f64s(v) = 1 + 3v
        let all = if p > 1 {
            pp.all_gather(&Tensor::new(mine.as_slice(), pp.device())?)?
                .to_vec1::<f64>()? // (P · (1 + 3v))
        } else {
            mine
        };
        let loss = all[sched.rank_of_stage(last_stage) * row];
        let pass_costs: Vec<PassCosts> = (0..sched.num_model_stages())
            .map(|stage| {
                let (q, c) = (sched.rank_of_stage(stage), sched.chunk_of_stage(stage));
                let at = |k: usize| all[q * row + 1 + 3 * c + k];
                let mut costs = PassCosts {
                    forward: at(0),
                    ..PassCosts::default()
                };
                match sched.kind().splits_backward() {
                    true => (costs.input_grad, costs.weight_grad) = (at(1), at(2)),
                    false => costs.backward = at(1),
                }
                costs
            })
            .collect();
        let bubble_at = |costs: &[PassCosts]| {
            sched
                .simulate_with(costs)
                .map(|sim| sim.rank_bubble_fraction(rank))
        };
        let predicted_bubble_fraction = bubble_at(&pass_costs)?;
        let balanced_bubble_fraction =
            bubble_at(&vec![PassCosts::mean(&pass_costs); pass_costs.len()])?;
        let idle_time = step_time.saturating_sub(busy);
        let report = StepReport {
            loss,
            aux_loss: aux_sum * loss_scale,
            step_time,
            idle_time,
            bubble_fraction: idle_time.as_secs_f64()
                / step_time.as_secs_f64().max(f64::MIN_POSITIVE),
            predicted_bubble_fraction,
            balanced_bubble_fraction,
            pass_costs,
            analytic_bubble_fraction: sched.analytic_bubble_fraction(),
            peak_in_flight: peak,
            peak_activation_bytes: peak_bytes,
            moe_stats: moe_stats.into_iter().flatten().collect(),
            timeline: links.timeline.spans,
            started_at,
        };
        tracing::debug!(pp_rank = rank, schedule = %sched.kind(), "{report}");
        Ok(report)
    }
}

/// The index of the action after which `actions` first hold the most activation sets: a
/// forward adds one, a fused backward or a W frees one.
fn activation_peak_at(actions: &[Action]) -> Option<usize> {
    let (mut alive, mut best) = (0usize, (0usize, None));
    for (i, a) in actions.iter().enumerate() {
        if a.is_forward() {
            alive += 1;
            if alive > best.0 {
                best = (alive, Some(i));
            }
        } else if a.computes_weight_grads() {
            alive -= 1;
        }
    }
    best.1
}

/// Adds one forward's routing statistics (one per MoE layer of a chunk) to the chunk's sums.
fn add_stats(acc: &mut Vec<MoeStats>, new: &[MoeStats]) {
    if acc.is_empty() {
        acc.extend_from_slice(new);
        return;
    }
    for (a, s) in acc.iter_mut().zip(new) {
        for (x, n) in a.tokens_per_expert.iter_mut().zip(&s.tokens_per_expert) {
            *x += n;
        }
        a.dropped += s.dropped;
    }
}
