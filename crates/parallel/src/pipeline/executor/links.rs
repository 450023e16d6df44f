//! The executor's timeline and its links to the neighbouring stages: each pass, send issue and
//! wait as a [`Span`] from the step's start; sends issued asynchronously and reaped, receives
//! waited where a pass needs them, and messages to the rank itself through a mailbox.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use candle_core::{DType, Shape, Tensor};
use mtrain_comm::{Communicator, Work};

use super::super::schedule::PassKind;
use super::super::{PipelineError, Result};

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

/// Appends spans measured from one step start.
pub(super) struct Timeline {
    pub(super) t0: Instant,
    pub(super) spans: Vec<Span>,
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

impl Timeline {
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
}

/// Where a pass's input comes from or its output goes: another rank over the pipeline group,
/// or (one rank holding neighbouring stages, P = 1) this rank's own mailbox.
pub(super) struct Links<'a> {
    pub(super) pp: &'a dyn Communicator,
    pub(super) rank: usize,
    /// Messages to this rank itself, keyed by (is activation, micro-batch, receiving stage).
    pub(super) mailbox: HashMap<(bool, usize, usize), Tensor>,
    pub(super) sends: Vec<Work<()>>,
    pub(super) timeline: Timeline,
}

impl Links<'_> {
    /// Sends `x` for micro-batch `key.1`, issued from this rank's chunk `chunk`. Where sends
    /// complete without the receiver ([`Communicator::sends_complete_locally`]: the CPU backend)
    /// the send is waited, yielding the core, before the next pass: the CPU backend writes it
    /// into the socket on this thread when its group has nothing queued, and otherwise queues
    /// it on the communication thread, which shares the rank's core with the passes; a send
    /// left queued behind the next pass reached the neighbour up to 4 ms late (half a pass, at
    /// every step's start; docs/journal.md, "The bubble's overhead"). Elsewhere the `Work`
    /// is kept and reaped.
    pub(super) fn send(
        &mut self,
        x: Tensor,
        to_rank: usize,
        key: (bool, usize, usize),
        chunk: usize,
    ) -> Result<()> {
        if to_rank == self.rank {
            self.mailbox.insert(key, x);
        } else {
            let (pp, mb) = (self.pp, key.1);
            let work = self.timeline.time(SpanKind::Send, Some(mb), chunk, || {
                let work = pp.send_async(&x, to_rank);
                while pp.sends_complete_locally() && !work.is_done() {
                    std::thread::yield_now();
                }
                work
            });
            self.sends.push(work);
        }
        Ok(())
    }

    /// Receives the input of micro-batch `key.1` for this rank's chunk `chunk`, by the blocking
    /// `recv` (the CPU backend reads the socket on this thread when its group has nothing
    /// queued: a message already there costs one read, not a round trip through the
    /// communication thread).
    pub(super) fn recv(
        &mut self,
        from_rank: usize,
        key: (bool, usize, usize),
        chunk: usize,
        shape: &Shape,
        dtype: DType,
    ) -> Result<Tensor> {
        if from_rank == self.rank {
            return self.mailbox.remove(&key).ok_or_else(|| {
                PipelineError::Layout(format!(
                    "rank {}: nothing was sent to stage {} for micro-batch {}",
                    self.rank, key.2, key.1
                ))
            });
        }
        let (pp, mb) = (self.pp, key.1);
        let x = self
            .timeline
            .time(SpanKind::RecvWait, Some(mb), chunk, || {
                pp.recv(from_rank, shape, dtype)
            })?;
        Ok(x)
    }

    /// Wait the sends that already completed (surfacing their errors), keep the others.
    pub(super) fn reap_finished_sends(&mut self) -> Result<()> {
        let (done, pending): (Vec<_>, Vec<_>) = self.sends.drain(..).partition(|w| w.is_done());
        self.sends = pending;
        done.into_iter()
            .try_for_each(|w| w.wait().map_err(PipelineError::from))
    }

    pub(super) fn wait_all_sends(&mut self) -> Result<()> {
        if self.sends.is_empty() {
            return Ok(());
        }
        let sends: Vec<Work<()>> = self.sends.drain(..).collect();
        self.timeline.time(SpanKind::SendWait, None, 0, || {
            sends.into_iter().try_for_each(|w| w.wait())
        })?;
        Ok(())
    }
}
