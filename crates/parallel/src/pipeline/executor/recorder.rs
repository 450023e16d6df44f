//! What a pipeline step measures on one rank, beside the loop that runs it: the timeline, the
//! loss, the MoE statistics, the activation peaks, and the bubble, measured and predicted.
//!
//! Every step records this rank's timeline ([`StepReport::timeline`]): one [`Span`] per
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
//! The bubble, measured and predicted, counted the same way on this rank:
//! - **measured** = idle time / step time, where the step runs from the first action to the
//!   completion of the last send, and idle is everything in it that is not a pass (forward or
//!   backward): the receive waits, the send issues, the final wait for sends and the executor's
//!   own bookkeeping between spans (a pass is a forward, a fused backward, a B or a W);
//! - **predicted** = the same fraction on the schedule's grid simulated
//!   ([`Schedule::simulate_with`], [`rank_bubble_fraction`](crate::pipeline::Simulation::rank_bubble_fraction))
//!   with this step's measured cost of each pass kind on each model stage: the mean F, backward
//!   (fused, or B) and W time of each chunk of each rank, gathered over the pipeline group with
//!   the loss. The simulation counts only passes as busy and sends as free, so the gap between
//!   the two is what the pipeline loses beyond its schedule (messages, bookkeeping, ranks
//!   sharing cores);
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
//! A micro-batch's activations live from its forward to its backward (which consumes them), or
//! under a split backward until its W (B consumes the activations and keeps the weight
//! products' factors, which count too); their high-water mark is reported (1F1B: at most P − r
//! on rank r; GPipe: M; ZB-H1: min(P, M)).

use std::time::{Duration, Instant, SystemTime};

use candle_core::{DType, Tensor};
use mtrain_comm::Communicator;
use mtrain_kernels::readback::ReadLater;
use mtrain_model::{Activations, MoeStats};

use super::super::schedule::{Action, PassCosts, PassKind, Schedule};
use super::super::Result;

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

/// What a [`Span`] of a rank's timeline was spent on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SpanKind {
    /// The engine's forward of one micro-batch through one chunk (hooks included).
    Forward,
    /// The engine's backward of one micro-batch through one chunk (hooks included).
    Backward,
    /// B of a split backward: the input gradient (pre-backward hooks included).
    InputGrad,
    /// W of a split backward: the weight gradients (post-backward hooks included).
    WeightGrad,
    /// Issuing an asynchronous send to a neighbour (the transfer itself overlaps what follows).
    Send,
    /// Waiting for a neighbour's activation or gradient to arrive: idle.
    RecvWait,
    /// Waiting, after the last action, for the sends still in flight: idle.
    SendWait,
}

impl SpanKind {
    /// Whether the span is a pass (compute), not a wait or a send.
    pub fn is_pass(&self) -> bool {
        matches!(
            self,
            SpanKind::Forward | SpanKind::Backward | SpanKind::InputGrad | SpanKind::WeightGrad
        )
    }

    /// The span of a pass of `kind`.
    pub fn of(kind: PassKind) -> SpanKind {
        match kind {
            PassKind::Forward => SpanKind::Forward,
            PassKind::Backward => SpanKind::Backward,
            PassKind::InputGrad => SpanKind::InputGrad,
            PassKind::WeightGrad => SpanKind::WeightGrad,
        }
    }
}

/// One span of a rank's pipeline timeline.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Span {
    /// What the rank did.
    pub kind: SpanKind,
    /// The micro-batch (None for [`SpanKind::SendWait`], which covers all of them).
    pub mb: Option<usize>,
    /// This rank's chunk (virtual stage index on the rank; 0 without interleaving).
    pub chunk: usize,
    /// Start, from the step's start.
    pub start: Duration,
    /// End, from the step's start.
    pub end: Duration,
}

/// One rank's measurements during one step, filled as its actions run and turned into a
/// [`StepReport`] at the end.
pub(super) struct Recorder {
    rank: usize,
    /// The step's start: spans are measured from it.
    t0: Instant,
    started_at: SystemTime,
    spans: Vec<Span>,
    /// The last stage's micro-batch losses on their way to the host, read by [`Self::stop`].
    losses: Vec<ReadLater>,
    /// Whether each loss is read at once (a pipeline of several ranks) or after the last pass.
    read_loss_at_once: bool,
    loss_sum: f64,
    aux_sum: f64,
    /// Per chunk, the routing statistics summed over the micro-batches.
    moe_stats: Vec<Vec<MoeStats>>,
    /// Activation sets alive now and at most: a forward adds one, a fused backward or W frees it.
    in_flight: usize,
    peak_in_flight: usize,
    held_bytes: usize,
    peak_bytes: usize,
    /// The action after which the rank first holds its most activation sets.
    peak_at: Option<usize>,
    step_time: Duration,
}

impl Recorder {
    /// Starts the clock of one step on `rank` of `sched`.
    pub(super) fn new(sched: &Schedule, rank: usize) -> Self {
        let t0 = Instant::now();
        Self {
            rank,
            t0,
            started_at: SystemTime::now(),
            spans: Vec::with_capacity(6 * sched.actions(rank).len()),
            losses: Vec::new(),
            read_loss_at_once: sched.num_ranks() > 1,
            loss_sum: 0.0,
            aux_sum: 0.0,
            moe_stats: vec![Vec::new(); sched.virtual_stages()],
            in_flight: 0,
            peak_in_flight: 0,
            held_bytes: 0,
            peak_bytes: 0,
            peak_at: activation_peak_at(sched.actions(rank)),
            step_time: Duration::ZERO,
        }
    }

    /// Runs `f`, recording it as a span of `kind`.
    pub(super) fn time<T>(
        &mut self,
        kind: SpanKind,
        mb: Option<usize>,
        chunk: usize,
        f: impl FnOnce() -> T,
    ) -> T {
        let start = self.t0.elapsed();
        let out = f();
        let end = self.t0.elapsed();
        self.spans.push(Span {
            kind,
            mb,
            chunk,
            start,
            end,
        });
        out
    }

    /// Runs the pass `f` of `action`, recording its span, and counts the activation sets alive
    /// after it.
    pub(super) fn pass<T>(&mut self, action: &Action, f: impl FnOnce() -> T) -> T {
        let kind = SpanKind::of(action.kind());
        let out = self.time(kind, Some(action.mb()), action.chunk(), f);
        if action.is_forward() {
            self.in_flight += 1;
            self.peak_in_flight = self.peak_in_flight.max(self.in_flight);
        } else if action.computes_weight_grads() {
            self.in_flight -= 1;
        }
        out
    }

    /// A forward's auxiliary loss and routing statistics, and the activations it keeps.
    pub(super) fn forward(&mut self, chunk: usize, acts: &Activations) {
        self.aux_sum += acts.aux_loss;
        add_stats(&mut self.moe_stats[chunk], &acts.stats);
        self.hold(acts.held_bytes());
    }

    /// `bytes` more of activations (or a B's weight products) alive.
    pub(super) fn hold(&mut self, bytes: usize) {
        self.held_bytes += bytes;
        self.peak_bytes = self.peak_bytes.max(self.held_bytes);
    }

    /// `bytes` of activations (or a B's weight products) consumed by a pass.
    pub(super) fn release(&mut self, bytes: usize) {
        self.held_bytes -= bytes;
    }

    /// A micro-batch's loss (the last stage's forward output), started on its way to the host:
    /// read at once in a pipeline of several ranks, as its timeline has always been taken; on
    /// one rank after its last backward is queued (the device is never idle for the read).
    pub(super) fn loss(&mut self, loss: &Tensor) -> Result<()> {
        let read = ReadLater::start(&loss.to_dtype(DType::F64)?)?;
        match self.read_loss_at_once {
            true => self.loss_sum += read.wait()?,
            false => self.losses.push(read),
        }
        Ok(())
    }

    /// Whether action `i` is the one after which the rank first holds its most activation sets.
    pub(super) fn at_activation_peak(&self, i: usize) -> bool {
        self.peak_at == Some(i)
    }

    /// Reads the losses still on their way and stops the step's clock.
    pub(super) fn stop(&mut self) -> Result<()> {
        for read in self.losses.drain(..) {
            self.loss_sum += read.wait()?;
        }
        self.step_time = self.t0.elapsed();
        Ok(())
    }

    /// The step's report: the loss and every rank's pass times gathered over the pipeline
    /// group `pp` (one all-gather), and the bubble they predict beside the one measured.
    pub(super) fn report(self, sched: &Schedule, pp: &dyn Communicator) -> Result<StepReport> {
        let (p, rank) = (sched.num_ranks(), self.rank);
        let loss_scale = 1.0 / sched.num_microbatches() as f64;
        // This rank's mean pass times per chunk: (count, seconds) of F, backward (fused or B), W.
        let mut sums = vec![[(0usize, 0.0f64); 3]; sched.virtual_stages()];
        let mut busy = Duration::ZERO;
        for sp in &self.spans {
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
        let mut mine = vec![self.loss_sum * loss_scale];
        mine.extend(sums.iter().flat_map(|c| c.map(mean)));
        let row = mine.len(); // gathered_f64s(v) = 1 + 3v
        let all = if p > 1 {
            pp.all_gather(&Tensor::new(mine.as_slice(), pp.device())?)?
                .to_vec1::<f64>()? // (P · (1 + 3v))
        } else {
            mine
        };
        let loss = all[sched.rank_of_stage(sched.num_model_stages() - 1) * row];
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
        let (step_time, idle_time) = (self.step_time, self.step_time.saturating_sub(busy));
        Ok(StepReport {
            loss,
            aux_loss: self.aux_sum * loss_scale,
            step_time,
            idle_time,
            bubble_fraction: idle_time.as_secs_f64()
                / step_time.as_secs_f64().max(f64::MIN_POSITIVE),
            predicted_bubble_fraction,
            balanced_bubble_fraction,
            pass_costs,
            analytic_bubble_fraction: sched.analytic_bubble_fraction(),
            peak_in_flight: self.peak_in_flight,
            peak_activation_bytes: self.peak_bytes,
            moe_stats: self.moe_stats.into_iter().flatten().collect(),
            timeline: self.spans,
            started_at: self.started_at,
        })
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
