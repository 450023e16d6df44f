//! Collective trace: what every op of a group sent, when it started and when it ended.
//!
//! Each communicator owns a [`Tracer`]. It always keeps the last [`RECENT`] ops, so a failing
//! collective can say where its rank stood; with recording switched on (`--trace`) it also keeps
//! every event, which tests use to check the exact sequence of collectives a strategy issues and
//! the bytes each rank sends.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::communicator::OpKind;

/// How many recent ops a tracer keeps even when recording is off.
pub const RECENT: usize = 16;

/// One collective as seen by one rank.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TraceEvent {
    pub op: OpKind,
    pub group: String,
    /// Sequence number of the op within its group (0, 1, 2, ...).
    pub seq: u64,
    /// Size of this rank's input in bytes.
    pub bytes: u64,
    /// Payload bytes this rank actually wrote to its peers for this op.
    pub bytes_sent: u64,
    /// Microseconds since the tracer's epoch when the op was issued, and when it completed.
    pub start_us: u64,
    pub end_us: u64,
    /// Peer of a send/recv, root of a rooted op.
    pub peer: Option<usize>,
}

#[derive(Debug, Default)]
struct Inner {
    recent: VecDeque<TraceEvent>,
    all: Vec<TraceEvent>,
}

/// A cheap, cloneable handle to a group's trace.
#[derive(Debug, Clone)]
pub struct Tracer {
    epoch: Instant,
    recording: Arc<AtomicBool>,
    bytes_sent: Arc<AtomicU64>,
    inner: Arc<Mutex<Inner>>,
}

impl Default for Tracer {
    fn default() -> Self {
        Self::new(Instant::now())
    }
}

impl Tracer {
    /// A tracer whose timestamps count from `epoch` (share one epoch across a process's groups).
    pub fn new(epoch: Instant) -> Self {
        Self {
            epoch,
            recording: Arc::new(AtomicBool::new(false)),
            bytes_sent: Arc::new(AtomicU64::new(0)),
            inner: Arc::new(Mutex::new(Inner::default())),
        }
    }

    pub fn set_recording(&self, on: bool) {
        self.recording.store(on, Ordering::SeqCst);
    }

    pub fn is_recording(&self) -> bool {
        self.recording.load(Ordering::SeqCst)
    }

    /// Microseconds since this tracer's epoch.
    pub fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// Record a finished op.
    pub fn record(&self, ev: TraceEvent) {
        self.bytes_sent.fetch_add(ev.bytes_sent, Ordering::Relaxed);
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if inner.recent.len() == RECENT {
            inner.recent.pop_front();
        }
        inner.recent.push_back(ev.clone());
        if self.is_recording() {
            inner.all.push(ev);
        }
    }

    /// Every event recorded while recording was on, in completion order.
    pub fn events(&self) -> Vec<TraceEvent> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).all.clone()
    }

    /// The last few ops, recorded or not: what a timeout report prints.
    pub fn recent(&self) -> Vec<TraceEvent> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).recent.iter().cloned().collect()
    }

    /// Total payload bytes this group has sent since creation (or the last `clear`).
    pub fn total_bytes_sent(&self) -> u64 {
        self.bytes_sent.load(Ordering::Relaxed)
    }

    pub fn clear(&self) {
        self.bytes_sent.store(0, Ordering::Relaxed);
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.all.clear();
        inner.recent.clear();
    }
}
