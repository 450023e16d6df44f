//! The executor's links to the neighbouring stages: sends issued asynchronously and reaped,
//! receives waited where a pass needs them, and messages to the rank itself through a mailbox.
//! Each send issue and receive wait is a span of the step's timeline ([`Recorder`]).

use std::collections::HashMap;

use candle_core::{DType, Shape, Tensor};
use mtrain_comm::{Communicator, OpKind, Work};

use super::super::schedule::{Action, Schedule};
use super::super::{PipelineError, Result};
use super::recorder::{Recorder, SpanKind};

/// Which message: (is an activation, micro-batch, receiving model stage).
type Key = (bool, usize, usize);

/// Where a pass's input comes from or its output goes: another rank over the pipeline group,
/// or (one rank holding neighbouring stages, P = 1) this rank's own mailbox.
pub(super) struct Links<'a> {
    sched: &'a Schedule,
    pp: &'a dyn Communicator,
    rank: usize,
    /// Every message's shape, (b, T, C) or (b, T/tp, C), and dtype.
    shape: Shape,
    dtype: DType,
    /// Messages to this rank itself.
    mailbox: HashMap<Key, Tensor>,
    sends: Vec<Work<()>>,
}

impl<'a> Links<'a> {
    /// The links of pipeline rank `rank` of `sched`, its messages of `shape` and `dtype`.
    pub(super) fn new(
        sched: &'a Schedule,
        pp: &'a dyn Communicator,
        rank: usize,
        shape: Shape,
        dtype: DType,
    ) -> Self {
        Self {
            sched,
            pp,
            rank,
            shape,
            dtype,
            mailbox: HashMap::new(),
            sends: Vec::new(),
        }
    }

    /// Sends `x`, the output of `action`, to model stage `to`. Where sends
    /// complete without the receiver ([`Communicator::sends_complete_locally`]: the CPU backend)
    /// the send is waited, yielding the core, before the next pass: the CPU backend writes it
    /// into the socket on this thread when its group has nothing queued, and otherwise queues
    /// it on the communication thread, which shares the rank's core with the passes; a send
    /// left queued behind the next pass reached the neighbour up to 4 ms late (half a pass, at
    /// every step's start; docs/journal.md, "The bubble's overhead"). Elsewhere the `Work`
    /// is kept and reaped.
    pub(super) fn send(
        &mut self,
        rec: &mut Recorder,
        x: Tensor,
        to: usize,
        action: &Action,
    ) -> Result<()> {
        let (to_rank, chunk) = (self.sched.rank_of_stage(to), action.chunk());
        let key = (action.is_forward(), action.mb(), to);
        if to_rank == self.rank {
            self.mailbox.insert(key, x);
        } else {
            let (pp, mb) = (self.pp, key.1);
            let work = rec.time(SpanKind::Send, Some(mb), chunk, || {
                let work = pp.send_async(&x, to_rank);
                let from = pp.tracer().now_us(); // the yields are the send's time too
                while pp.sends_complete_locally() && !work.is_done() {
                    std::thread::yield_now();
                }
                pp.tracer().add_held(OpKind::Send, pp.tracer().now_us().saturating_sub(from));
                work
            });
            self.sends.push(work);
        }
        Ok(())
    }

    /// Receives the input of `action` from model stage `from`, by the blocking
    /// `recv` (the CPU backend reads the socket on this thread when its group has nothing
    /// queued: a message already there costs one read, not a round trip through the
    /// communication thread).
    pub(super) fn recv(
        &mut self,
        rec: &mut Recorder,
        from: usize,
        action: &Action,
    ) -> Result<Tensor> {
        let (from_rank, chunk) = (self.sched.rank_of_stage(from), action.chunk());
        let key = (
            action.is_forward(),
            action.mb(),
            self.sched.model_stage(self.rank, chunk),
        );
        if from_rank == self.rank {
            return self.mailbox.remove(&key).ok_or_else(|| {
                PipelineError::Layout(format!(
                    "rank {}: nothing was sent to stage {} for micro-batch {}",
                    self.rank, key.2, key.1
                ))
            });
        }
        let (pp, mb, shape, dtype) = (self.pp, key.1, &self.shape, self.dtype);
        let x = rec.time(SpanKind::RecvWait, Some(mb), chunk, || {
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

    /// Waits the sends still in flight, as one span of the timeline.
    pub(super) fn wait_all_sends(&mut self, rec: &mut Recorder) -> Result<()> {
        if self.sends.is_empty() {
            return Ok(());
        }
        let sends: Vec<Work<()>> = self.sends.drain(..).collect();
        rec.time(SpanKind::SendWait, None, 0, || {
            sends.into_iter().try_for_each(|w| w.wait())
        })?;
        Ok(())
    }
}
