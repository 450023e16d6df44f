//! An op's issue on the communication stream (ordered after the compute stream, watched by the
//! watchdog) and its phases as it is enqueued: copies, flag signals and waits, the barriers of
//! the protocol, and the two all-reduce algorithms.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Tensor};

use super::driver;
use super::group::{IpcGroup, Shared, State};
use super::kernels::Peers;
use super::protocol::{phase_flag, Numbered, Phase, WaitMode};
use super::work::{InFlight, IpcWork};
use crate::communicator::{OpKind, ReduceOp, Result};
use crate::nccl::with_device_addrs;
use crate::site::Site;
use crate::trace::{device, TraceEvent};

/// One op being enqueued: the group, its state (locked) and the op's collective target (the
/// value its phase flags are set to and waited for: `protocol::OpNumbers`).
pub(super) struct Issue<'a> {
    pub(super) g: &'a IpcGroup,
    pub(super) st: &'a mut State,
    pub(super) target: u64,
    pub(super) waits: &'a mut Vec<(usize, usize, u64)>,
}

impl Issue<'_> {
    pub(super) fn data(&self) -> &Shared {
        self.st
            .data
            .as_ref()
            .expect("ensure_data ran before the op")
    }

    pub(super) fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: every caller passes tensor addresses from `with_device_addrs` (alive until
        // the compute stream waits for the op) or buffer addresses checked against the
        // buffer's capacity by `ensure_data` / the mailbox growth.
        unsafe { driver::copy(&self.g.stream, dst, src, bytes) }.map_err(|e| self.g.err(e))
    }

    /// Write this op's target into `phase`'s flag of this rank in every peer's flag buffer.
    pub(super) fn signal(&mut self, phase: Phase) -> Result<()> {
        let g = self.g;
        let me = g.rank;
        let addrs: Vec<u64> = (0..g.size)
            .filter(|q| *q != me)
            .map(|q| g.flags.addr[q] + phase_flag(phase, me) as u64)
            .collect();
        self.write(&addrs, self.target)
    }

    pub(super) fn write(&self, addrs: &[u64], value: u64) -> Result<()> {
        let g = self.g;
        if addrs.is_empty() {
            return Ok(());
        }
        match g.opts.wait {
            WaitMode::Stream => {
                for a in addrs {
                    driver::write_flag(&g.stream, *a, value).map_err(|e| g.err(e))?;
                }
                Ok(())
            }
            WaitMode::Kernel => g
                .kernels
                .signal(&g.stream, Peers::of(addrs), addrs.len(), value)
                .map_err(|e| g.err(e)),
        }
    }

    /// Wait until each `(flag offset in this rank's buffer, writer)` reaches `target`.
    pub(super) fn wait(&mut self, flags: &[(usize, usize)], target: u64) -> Result<()> {
        let g = self.g;
        if flags.is_empty() || target == 0 {
            return Ok(());
        }
        let base = g.flags.addr[g.rank];
        let addrs: Vec<u64> = flags.iter().map(|(o, _)| base + *o as u64).collect();
        self.waits
            .extend(flags.iter().map(|(o, w)| (*o, *w, target)));
        match g.opts.wait {
            WaitMode::Stream => {
                for a in &addrs {
                    driver::wait_flag(&g.stream, *a, target).map_err(|e| g.err(e))?;
                }
                Ok(())
            }
            WaitMode::Kernel => g
                .kernels
                .wait(
                    &g.stream,
                    Peers::of(&addrs),
                    addrs.len(),
                    target,
                    g.opts.timeout.as_nanos() as u64,
                )
                .map_err(|e| g.err(e)),
        }
    }

    /// Signal `phase` to every peer and wait for every peer's.
    pub(super) fn barrier(&mut self, phase: Phase) -> Result<()> {
        self.signal(phase)?;
        let me = self.g.rank;
        let flags: Vec<(usize, usize)> = (0..self.g.size)
            .filter(|q| *q != me)
            .map(|q| (phase_flag(phase, q), q))
            .collect();
        self.wait(&flags, self.target)
    }

    /// Copy `bytes` of this rank's input (address `ax`) to the start of its data buffer and
    /// tell the peers (READY).
    pub(super) fn publish(&mut self, ax: u64, bytes: usize) -> Result<()> {
        let own = self.data().addr[self.g.rank];
        self.copy(own, ax, bytes)?;
        self.barrier(Phase::Ready)
    }

    pub(super) fn one_shot(
        &mut self,
        ax: u64,
        ao: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let bytes = count * dtype.size_in_bytes();
        let layout = super::protocol::DataLayout::new(bytes, 0);
        self.g.ensure_data(self.st, layout.bytes)?;
        self.publish(ax, bytes)?;
        let src = Peers::of(&self.data().addr);
        self.g
            .kernels
            .reduce(&self.g.stream, dtype, src, self.g.size, 0, ao, count, op)
            .map_err(|e| self.g.err(e))?;
        self.barrier(Phase::Done)
    }

    pub(super) fn two_shot(
        &mut self,
        ax: u64,
        ao: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        use super::protocol::{two_shot_chunk, vector_elems, DataLayout};
        let (n, r, es) = (self.g.size, self.g.rank, dtype.size_in_bytes());
        let align = vector_elems(es);
        let first = two_shot_chunk(count, n, 0, align).len();
        let layout = DataLayout::new(count * es, first * es);
        self.g.ensure_data(self.st, layout.bytes)?;
        self.publish(ax, count * es)?;
        // Reduce-scatter half: chunk r of every input into this rank's chunk area.
        let mine = two_shot_chunk(count, n, r, align);
        let src = Peers::of(&self.data().addr);
        let own_chunk = self.data().addr[r] + layout.chunk as u64;
        self.g
            .kernels
            .reduce(
                &self.g.stream,
                dtype,
                src,
                n,
                mine.start,
                own_chunk,
                mine.len(),
                op,
            )
            .map_err(|e| self.g.err(e))?;
        self.barrier(Phase::Mid)?;
        // All-gather half: chunk q from rank q's chunk area.
        for q in 0..n {
            let c = two_shot_chunk(count, n, q, align);
            let src = self.data().addr[q] + layout.chunk as u64;
            self.copy(ao + (c.start * es) as u64, src, c.len() * es)?;
        }
        self.barrier(Phase::Done)
    }
}

impl IpcGroup {
    /// Issue one op: order the communication stream after the compute stream, enqueue what
    /// `body` enqueues (given the device addresses of `bufs`), record `done`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn issue<T: Send + 'static>(
        &self,
        site: Site,
        op: OpKind,
        bytes: u64,
        bytes_sent: u64,
        peer: Option<usize>,
        bufs: Vec<Tensor>,
        result: T,
        body: impl FnOnce(&mut Issue<'_>, &[u64]) -> Result<()>,
    ) -> Result<IpcWork<T>> {
        self.check_poisoned()?;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let Numbered { seq, target } = st.numbers.issue(op);
        let start_us = self.tracer.now_us();
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.err(format!("{e:?}")))?;
        let ready = self
            .compute
            .record_event(None)
            .map_err(|e| self.err(format!("{e:?}")))?;
        self.stream
            .wait(&ready)
            .map_err(|e| self.err(format!("{e:?}")))?;
        let begin = self
            .stream
            .record_event(device::TIMED)
            .map_err(|e| self.err(format!("{e:?}")))?;
        let mut waits = Vec::new();
        with_device_addrs(&bufs, &self.stream, |addrs| {
            let mut is = Issue {
                g: self,
                st: &mut st,
                target,
                waits: &mut waits,
            };
            body(&mut is, addrs)
        })??;
        let done = Arc::new(
            self.stream
                .record_event(device::TIMED)
                .map_err(|e| self.err(format!("{e:?}")))?,
        );
        self.watch
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(InFlight {
                op,
                seq,
                site,
                issued: Instant::now(),
                done: done.clone(),
                waits,
            });
        Ok(IpcWork {
            begin: Some(begin),
            done: Some(done),
            compute: self.compute.clone(),
            keep: bufs,
            result: Some(result),
            tracer: self.tracer.clone(),
            event: TraceEvent {
                op,
                group: self.name.clone(),
                seq,
                bytes,
                bytes_sent,
                start_us,
                end_us: start_us,
                peer,
                site,
            },
            host_blocks: false,
            watch: self.watch.clone(),
            timeout: self.opts.timeout,
        })
    }
}
