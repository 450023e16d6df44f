//! The handle of an op in flight, and the watchdog that names the peer an op waits for once
//! it outlives the timeout.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaStream};
use candle_core::Tensor;

use super::driver::{self, cuda_err};
use super::protocol::FLAG_WORDS;
use crate::communicator::{CommError, OpKind, PendingWork, Result};
use crate::site::Site;
use crate::trace::{device, TraceEvent, Tracer};

/// An op on the communication stream that the watchdog watches.
pub(super) struct InFlight {
    pub(super) op: OpKind,
    pub(super) seq: u64,
    /// Where the op was issued.
    pub(super) site: Site,
    pub(super) issued: Instant,
    pub(super) done: Arc<CudaEvent>,
    /// (byte offset in this rank's flag buffer, group rank of the writer, target) of each wait.
    pub(super) waits: Vec<(usize, usize, u64)>,
}

/// What the watchdog and the ops share.
pub(super) struct Watch {
    pub(super) in_flight: Mutex<VecDeque<InFlight>>,
    /// (op, seq, this rank, the late peer, where the op was issued), global ranks, once an op
    /// timed out.
    pub(super) poisoned: Mutex<Option<(OpKind, u64, usize, usize, Site)>>,
    pub(super) stop: AtomicBool,
}

/// The handle of an op in flight on the communication stream.
pub(super) struct IpcWork<T> {
    /// The op's start on the group's stream (`done` its end).
    pub(super) begin: Option<CudaEvent>,
    pub(super) done: Option<Arc<CudaEvent>>,
    pub(super) compute: Arc<CudaStream>,
    /// Inputs and outputs: alive until the compute stream is ordered after `done`.
    pub(super) keep: Vec<Tensor>,
    pub(super) result: Option<T>,
    pub(super) tracer: Tracer,
    pub(super) event: TraceEvent,
    /// Wait on the host (a barrier returns once every rank entered).
    pub(super) host_blocks: bool,
    pub(super) watch: Arc<Watch>,
    pub(super) timeout: Duration,
}

impl<T> IpcWork<T> {
    pub(super) fn order_compute(&mut self) -> Result<()> {
        if let (Some(begin), Some(done)) = (self.begin.take(), self.done.take()) {
            let err = |e| cuda_err(&self.event.group, format!("{e:?}"));
            let poll = self.host_blocks.then(|| done.clone());
            device::order_after(&self.compute, begin, done, &self.tracer, &self.event)
                .map_err(err)?;
            if let Some(done) = poll {
                // Poll with the timeout: the watchdog releases a wait that never comes.
                let deadline = Instant::now() + self.timeout + Duration::from_secs(5);
                while !done.is_complete() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
        }
        self.keep.clear();
        Ok(())
    }
}

impl<T: Send> PendingWork<T> for IpcWork<T> {
    fn wait(mut self: Box<Self>) -> Result<T> {
        self.order_compute()?;
        let poisoned = *self
            .watch
            .poisoned
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some((op, seq, rank, peer, site)) = poisoned {
            if seq <= self.event.seq {
                return Err(CommError::Timeout {
                    op,
                    group: self.event.group.clone(),
                    seq,
                    rank,
                    peer,
                    timeout_ms: self.timeout.as_millis() as u64,
                    site,
                });
            }
        }
        self.result.take().ok_or_else(|| {
            CommError::Candle(candle_core::Error::Msg("IPC work waited twice".into()))
        })
    }

    fn is_done(&self) -> bool {
        self.done.as_ref().is_none_or(|d| d.is_complete())
    }
}

impl<T> Drop for IpcWork<T> {
    fn drop(&mut self) {
        let _ = self.order_compute();
    }
}

/// The watchdog: an op older than the timeout names the first peer whose flag it still waits
/// for, poisons the group and releases the stream's waits (so the process can report and end).
pub(super) fn spawn_watchdog(
    watch: Arc<Watch>,
    side: Arc<CudaStream>,
    own_flags: u64,
    name: String,
    rank: usize,
    global: Vec<usize>,
    timeout: Duration,
) {
    let spawned = std::thread::Builder::new()
        .name(format!("ipc-watchdog-{name}"))
        .spawn(move || {
            while !watch.stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(5));
                // Ops finished within the timeout are done with; an older one (finished or
                // not: a spinning wait kernel gives up at the timeout) is late if a flag it
                // waits for is still short.
                let late = {
                    let mut q = watch.in_flight.lock().unwrap_or_else(|p| p.into_inner());
                    while q
                        .front()
                        .is_some_and(|f| f.issued.elapsed() <= timeout && f.done.is_complete())
                    {
                        q.pop_front();
                    }
                    match q.front() {
                        Some(f) if f.issued.elapsed() > timeout => {
                            Some((f.op, f.seq, f.site, f.waits.clone()))
                        }
                        _ => None,
                    }
                };
                let Some((op, seq, site, waits)) = late else { continue };
                let words = driver::read_words(&side, own_flags, FLAG_WORDS).unwrap_or_default();
                let short = waits
                    .iter()
                    .find(|(o, _, t)| words.get(o / 8).is_none_or(|v| v < t));
                let Some(&(_, peer, _)) = short else {
                    watch.in_flight.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
                    continue;
                };
                tracing::error!(
                    "{op} on IPC group '{name}' (seq {seq}) timed out after {} ms on rank {} waiting for rank {}, issued at {site}",
                    timeout.as_millis(),
                    global[rank],
                    global[peer]
                );
                *watch.poisoned.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some((op, seq, global[rank], global[peer], site));
                let _ = driver::fill_words(&side, own_flags, FLAG_WORDS, u64::MAX / 2);
                return;
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("IPC group '{}' runs without a watchdog: {e}", "?");
    }
}
