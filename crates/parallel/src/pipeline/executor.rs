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
//! through chunk 0", and the stage's position decides what to receive and where to send
//! (`executor/links.rs`). Sends are asynchronous: the `Work` is kept and compute goes on (on the
//! CPU backend once the bytes are in the socket or with the communication thread, so the
//! message leaves before the next pass takes the core); finished sends are reaped after every
//! action and the rest are waited at the end of the step. A receive is made when the action
//! needs its input, blocking. Schedules are built so that between two ranks the messages are
//! received in the order they were sent (a test in `schedule.rs` checks it), so no tags are
//! needed.
//!
//! The batch (B, T) is split into M micro-batches of B/M sequences. Each micro-batch's mean loss
//! is scaled by 1/M before its backward, so the gradients summed over micro-batches equal the
//! gradient of the full-batch mean loss, as on one device. A micro-batch's activations live from
//! its forward to its backward (which consumes them), or under a split backward until its W.
//!
//! What a step measures (the timeline of spans, the loss, the MoE statistics, the activation
//! peaks, the measured and the predicted bubble) is kept beside the loop by a recorder
//! (`executor/recorder.rs`), which the loop tells where each pass starts and ends.
//!
//! Data parallelism inside a pipeline hangs on [`StageHooks`]: [`PipelineExecutor::step_with_hooks`]
//! hands each pass the engine hooks of its chunk (FSDP's gather / free / reduce-scatter), and
//! says which backward (fused, or W) is the chunk's last of the step, after which its gradients
//! are final: DDP's buckets and ZeRO's reduce-scatters hang on the `post_backward` of W.
//! With sequence parallelism ([`PipelineStages::with_sequence_split`]) the activations passed
//! between stages are this rank's sequence shard (b, T/tp, C).
//!
//! Legend: B batch, b = B/M micro-batch, T time, C width, P pipeline ranks, M micro-batches.

mod check;
mod links;
mod recorder;

use std::collections::HashMap;

use candle_core::{Shape, Tensor};
use mtrain_comm::{chunk_range, Communicator};
use mtrain_model::{Activations, Draw, Engine, Grads, Hooks, NoHooks, PendingGrads};

use super::schedule::{Action, Schedule};
use super::stage::PipelineStages;
use super::{PipelineError, Result};
use check::check_layout;
use links::Links;
use recorder::Recorder;
pub use recorder::{gathered_f64s, Span, SpanKind, StepReport};

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
        let mut hooks = NoStageHooks(NoHooks);
        self.run(stages, pp, idx, targets, 1.0, grads, &mut hooks, true)
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

    /// The step: for each action of this rank's schedule, receive what it consumes, run the pass
    /// through the engine, send what it produced.
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
        let (sched, rank) = (&self.schedule, stages.rank());
        let b = check_layout(sched, stages, pp, idx, targets)?;
        let t = match stages.sequence_split() {
            Some((size, r)) => chunk_range(idx.dim(1)?, size, r).len(), // T/tp
            None => idx.dim(1)?,
        };
        let act_shape = Shape::from((b, t, stages.n_embd())); // (b, T, C) or (b, T/tp, C)
        let last_stage = sched.num_model_stages() - 1;
        let grad_scale = grad_scale * (1.0 / sched.num_microbatches() as f64);
        let last_backward = sched.last_backwards(rank);

        let mut links = Links::new(sched, pp, rank, act_shape, stages.activation_dtype());
        let mut rec = Recorder::new(sched, rank);
        // The micro-batches between their forward and their backward (or B), and what each B
        // left for its W, by (micro-batch, chunk).
        let mut alive: HashMap<(usize, usize), Activations> = HashMap::new();
        let mut owed: HashMap<(usize, usize), PendingGrads> = HashMap::new();
        for (i, action) in sched.actions(rank).iter().enumerate() {
            let (mb, chunk) = (action.mb(), action.chunk());
            let (stage, engine) = (&stages.chunks()[chunk], self.engine_of(mb, b));
            let (segs, last) = (&stage.segments, last_backward[chunk] == Some(i));
            let out_of_order = |pass: &str, before: &str| {
                let at = format!("micro-batch {mb} chunk {chunk}");
                PipelineError::Layout(format!("rank {rank}: {pass} of {at} before its {before}"))
            };
            // Receive: the previous stage's activation (F), the next one's gradient (backward, B).
            let input = match sched.input_stage(rank, action) {
                Some(from) => Some(links.recv(&mut rec, from, action)?), // (b, T, C)
                None => None,
            };
            let output = match action {
                Action::Forward { .. } => {
                    let x = match input {
                        Some(x) => x,
                        None => idx.narrow(0, mb * b, b)?, // (b, T) token ids
                    };
                    let mb_targets = targets.narrow(0, mb * b, b)?; // (b, T)
                    let tgt = (stage.stage == last_stage).then_some(&mb_targets);
                    let acts = rec.pass(action, || {
                        engine.forward(segs, &x, tgt, hooks.hooks(chunk, false))
                    })?;
                    rec.forward(chunk, &acts);
                    let out = acts.output.clone(); // (b, T, C), or the loss on the last stage
                    alive.insert((mb, chunk), acts);
                    Some(out)
                }
                Action::Backward { .. } => {
                    let acts = alive
                        .remove(&(mb, chunk))
                        .ok_or_else(|| out_of_order("backward", "forward"))?;
                    rec.release(acts.held_bytes());
                    let g = input.as_ref();
                    rec.pass(action, || {
                        engine.backward(segs, acts, g, grad_scale, grads, hooks.hooks(chunk, last))
                    })?
                }
                Action::InputGrad { .. } => {
                    let acts = alive
                        .remove(&(mb, chunk))
                        .ok_or_else(|| out_of_order("backward", "forward"))?;
                    rec.release(acts.held_bytes());
                    let g = input.as_ref();
                    let (grad_in, pending) = rec.pass(action, || {
                        engine.backward_input(segs, acts, g, grad_scale, hooks.hooks(chunk, false))
                    })?;
                    rec.hold(pending.held_bytes());
                    owed.insert((mb, chunk), pending);
                    grad_in
                }
                Action::WeightGrad { .. } => {
                    let pending = owed
                        .remove(&(mb, chunk))
                        .ok_or_else(|| out_of_order("W", "B"))?;
                    rec.release(pending.held_bytes());
                    rec.pass(action, || {
                        engine.backward_weights(segs, pending, grads, hooks.hooks(chunk, last))
                    })?;
                    None
                }
            };
            // Send: the activation on (F), the input gradient back (backward, B); the last
            // stage's forward output is the loss.
            match (sched.output_stage(rank, action), output) {
                (Some(to), Some(y)) => links.send(&mut rec, y, to, action)?, // (b, T, C)
                (Some(_), None) => {
                    return Err(PipelineError::Layout(format!(
                        "rank {rank}: stage {} produced no input gradient",
                        stage.stage
                    )))
                }
                (None, Some(loss)) if action.is_forward() => rec.loss(&loss)?,
                (None, _) => {}
            }
            if rec.at_activation_peak(i) {
                hooks.at_activation_peak();
            }
            links.reap_finished_sends()?;
        }
        links.wait_all_sends(&mut rec)?;
        rec.stop()?;

        if sync_tied {
            stages.sync_tied_grads(pp, grads)?;
        }
        let report = rec.report(sched, pp)?;
        tracing::debug!(pp_rank = rank, schedule = %sched.kind(), "{report}");
        Ok(report)
    }
}
