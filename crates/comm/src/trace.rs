//! Collective trace: what every op of a group sent, when it started and when it ended.
//!
//! Each communicator owns a [`Tracer`]. It always keeps the last [`RECENT`] ops, so a failing
//! collective can say where its rank stood; with recording switched on (`--trace`) it also keeps
//! every event, which tests use to check the exact sequence of collectives a strategy issues and
//! the bytes each rank sends. Whether recording or not it keeps running [`TraceTotals`] (ops,
//! bytes sent, busy time, time callers sat blocked), so a training step's communication figures
//! are the difference of two readings: every collective of the group counts, whoever issued it.
//!
//! ```text
//!   group's ops:    |==op0==|   |====op1====|=op2=|        (op2 issued while op1 ran)
//!   busy:           |-------|   |-----------------|        op k from max(issued_k, finished_k-1)
//!   caller:   ...compute...  wait(op2) |xxxxxxx|           blocked: from wait() to op2's finish
//! ```
//!
//! A caller blocks only while an op it waits for is unfinished, and one thread waits for one op at
//! a time, so the blocked time of a step never exceeds the busy time of its groups.
//!
//! On a GPU the host does not wait: the compute stream does. There the blocked time is the
//! compute stream's stall, timed by two events around its wait on the op's `done` event, and
//! known only once the stream has passed them ([`Tracer::add_blocked_on_device`]). The op itself
//! is timed the same way, by events around it on its communication stream, and recorded with
//! that span when the totals are read ([`Tracer::record_on_device`]): the busy time is the
//! device's, and `--trace` does not make the host wait for each op:
//!
//! ```text
//!   comm stream:      ●begin|=====op=====|●done              the op: begin … done
//!   compute stream:   ..gemm..●before ⧗ wait(done) ●after ..next kernel..
//!   blocked:                  |xxxxxxx|             after − before, read when the totals are
//! ```

use std::collections::{HashMap, VecDeque};
use std::ops::{Add, Sub};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::op_kind::OpKind;
use crate::site::Site;

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
    /// The file and line that issued the op.
    pub site: Site,
}

/// Running totals of one group's ops since it was created (or last cleared).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TraceTotals {
    /// Ops completed.
    pub ops: u64,
    /// Bytes of the ops' inputs on this rank.
    pub bytes: u64,
    /// Payload bytes this rank wrote to its peers.
    pub bytes_sent: u64,
    /// Microseconds the group was busy: op k from max(issued_k, finished_{k−1}) to finished_k
    /// (ops run one after another in issue order; waiting for peers counts as busy).
    pub busy_us: u64,
    /// Microseconds callers sat in `wait()` on an op of this group before it finished: the
    /// communication that compute did not hide.
    pub blocked_us: u64,
    /// Microseconds callers spent inside the op's calls: issuing it and waiting for it, from
    /// entering the call to leaving it (the hand-off to the communication thread and the
    /// wake-up after the op finished included). What the op cost the caller's timeline, which
    /// `--profile-ops` rows; `blocked_us` stops at the op's finish.
    pub held_us: u64,
}

impl Add for TraceTotals {
    type Output = Self;
    fn add(self, o: Self) -> Self {
        Self {
            ops: self.ops + o.ops,
            bytes: self.bytes + o.bytes,
            bytes_sent: self.bytes_sent + o.bytes_sent,
            busy_us: self.busy_us + o.busy_us,
            blocked_us: self.blocked_us + o.blocked_us,
            held_us: self.held_us + o.held_us,
        }
    }
}

impl Sub for TraceTotals {
    type Output = Self;
    /// What happened between two readings (`later - earlier`).
    fn sub(self, o: Self) -> Self {
        Self {
            ops: self.ops.saturating_sub(o.ops),
            bytes: self.bytes.saturating_sub(o.bytes),
            bytes_sent: self.bytes_sent.saturating_sub(o.bytes_sent),
            busy_us: self.busy_us.saturating_sub(o.busy_us),
            blocked_us: self.blocked_us.saturating_sub(o.blocked_us),
            held_us: self.held_us.saturating_sub(o.held_us),
        }
    }
}

/// The microseconds a device stream waited for an op, readable once the device has passed
/// the wait (reading it waits for that).
pub type DeviceWait = Box<dyn FnOnce() -> u64 + Send>;

/// Where an op began and ended on the device (microseconds since the tracer's epoch),
/// readable once the device has passed its end (reading it waits for that).
pub type DeviceSpan = Box<dyn FnOnce() -> (u64, u64) + Send>;

/// Device waits and device-timed ops not yet read, in the order they were waited for.
#[derive(Default)]
struct Unsettled {
    waits: Vec<(OpKind, DeviceWait)>,
    ops: Vec<(TraceEvent, DeviceSpan)>,
}

impl std::fmt::Debug for Unsettled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} device waits, {} device ops",
            self.waits.len(),
            self.ops.len()
        )
    }
}

#[derive(Debug, Default)]
struct Inner {
    recent: VecDeque<TraceEvent>,
    all: Vec<TraceEvent>,
    totals: TraceTotals,
    /// The same totals per kind of op.
    by_op: HashMap<OpKind, TraceTotals>,
    /// When the group's latest op finished (the earliest the next one could start).
    last_end_us: u64,
    /// Device waits and device-timed ops, added up when the totals are next read.
    unsettled: Unsettled,
}

impl Inner {
    /// Record a finished op: its busy span from max(start, the previous op's end) to its end.
    fn record(&mut self, ev: TraceEvent, recording: bool) {
        let start = ev.start_us.max(self.last_end_us);
        let busy = ev.end_us.saturating_sub(start);
        for t in [&mut self.totals, self.by_op.entry(ev.op).or_default()] {
            t.ops += 1;
            t.bytes += ev.bytes;
            t.bytes_sent += ev.bytes_sent;
            t.busy_us += busy;
        }
        self.last_end_us = self.last_end_us.max(ev.end_us);
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(ev.clone());
        if recording {
            self.all.push(ev);
        }
    }

    /// Record every device-timed op (keeping it among the events if `recording`) and add
    /// every device wait to the blocked time (waiting for the device to pass them).
    fn settle(&mut self, recording: bool) {
        let mut ops: Vec<TraceEvent> = std::mem::take(&mut self.unsettled.ops)
            .into_iter()
            .map(|(mut ev, span)| {
                (ev.start_us, ev.end_us) = span();
                ev
            })
            .collect();
        // In the order they ran on the stream, which is the order they were issued in, not the
        // order they were waited for (a ring's sends are waited for after its receives).
        ops.sort_by_key(|ev| (ev.start_us, ev.seq));
        for ev in ops {
            self.record(ev, recording);
        }
        for (op, waited) in std::mem::take(&mut self.unsettled.waits) {
            let us = waited();
            self.totals.blocked_us += us;
            self.by_op.entry(op).or_default().blocked_us += us;
        }
    }
}

/// A cheap, cloneable handle to a group's trace.
#[derive(Debug, Clone)]
pub struct Tracer {
    epoch: Instant,
    recording: Arc<AtomicBool>,
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

    /// The instant timestamps count from.
    pub fn epoch(&self) -> Instant {
        self.epoch
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Record a finished op.
    pub fn record(&self, ev: TraceEvent) {
        let recording = self.is_recording();
        self.lock().record(ev, recording);
    }

    /// Record an op that runs on a device stream: `span` gives its start and end there once
    /// the device has passed it, and the op is recorded (in the order the ops ran) when the
    /// totals or the events are next read.
    pub fn record_on_device(&self, ev: TraceEvent, span: DeviceSpan) {
        self.lock().unsettled.ops.push((ev, span));
    }

    /// Every event recorded while recording was on, in completion order (device-timed ops
    /// once the device has passed them).
    pub fn events(&self) -> Vec<TraceEvent> {
        let mut inner = self.lock();
        inner.settle(self.is_recording());
        inner.all.clone()
    }

    /// The last few ops, recorded or not: what a timeout report prints. It never waits for the
    /// device: an op still unread there is listed as issued (its end is its start).
    pub fn recent(&self) -> Vec<TraceEvent> {
        let inner = self.lock();
        let pending = inner.unsettled.ops.iter().map(|(ev, _)| ev.clone());
        let all: Vec<_> = inner.recent.iter().cloned().chain(pending).collect();
        all[all.len().saturating_sub(RECENT)..].to_vec()
    }

    /// A caller waited `waited_us` for an `op` of this group that was still running.
    pub fn add_blocked(&self, op: OpKind, waited_us: u64) {
        let mut inner = self.lock();
        inner.totals.blocked_us += waited_us;
        inner.by_op.entry(op).or_default().blocked_us += waited_us;
    }

    /// A device stream waits for an `op` of this group; `waited` tells for how long once the
    /// device has passed the wait. It is added to the blocked time when the totals are next
    /// read, so read them where the host waits for the device anyway (a step's end).
    pub fn add_blocked_on_device(&self, op: OpKind, waited: DeviceWait) {
        self.lock().unsettled.waits.push((op, waited));
    }

    /// A caller spent `held_us` inside a call that issued or waited for an `op` of this group.
    pub fn add_held(&self, op: OpKind, held_us: u64) {
        let mut inner = self.lock();
        inner.totals.held_us += held_us;
        inner.by_op.entry(op).or_default().held_us += held_us;
    }

    /// The running totals (subtract two readings for what happened in between), device waits
    /// included.
    pub fn totals(&self) -> TraceTotals {
        let mut inner = self.lock();
        inner.settle(self.is_recording());
        inner.totals
    }

    /// The running totals of each kind of op this group has run, device waits included.
    pub fn totals_by_op(&self) -> HashMap<OpKind, TraceTotals> {
        let mut inner = self.lock();
        inner.settle(self.is_recording());
        inner.by_op.clone()
    }

    /// Total payload bytes this group has sent since creation (or the last `clear`).
    pub fn total_bytes_sent(&self) -> u64 {
        self.lock().totals.bytes_sent
    }

    pub fn clear(&self) {
        let mut inner = self.lock();
        inner.all.clear();
        inner.recent.clear();
        inner.totals = TraceTotals::default();
        inner.by_op.clear();
        inner.unsettled = Unsettled::default();
    }
}

/// A collective and the compute stream's wait on it, timed on the device (`cuda` feature): how
/// both GPU backends order their compute stream after an op ([`device::order_after`]).
#[cfg(feature = "cuda")]
pub(crate) mod device {
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    use candle_core::cuda_backend::cudarc::driver::{sys, CudaEvent, CudaStream, DriverError};

    use super::{DeviceSpan, TraceEvent, Tracer};
    use crate::op_kind::OpKind;

    /// The flags of the events that time an op: its `begin` and `done` on its stream.
    pub(crate) const TIMED: Option<sys::CUevent_flags> = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);

    /// One timing event per process and the host instant at which it completed: the device's
    /// times, as distances from it, become host instants (to within the f32 milliseconds CUDA
    /// gives: a microsecond in the first 16 s, 8 µs after two minutes).
    struct Anchor {
        event: CudaEvent,
        at: Instant,
    }

    /// The process's anchor, recorded on `stream` on first use (the host waits for it once).
    fn anchor(stream: &CudaStream) -> Result<Arc<Anchor>, DriverError> {
        static ANCHOR: Mutex<Option<Arc<Anchor>>> = Mutex::new(None);
        let mut held = ANCHOR.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = held
            .as_ref()
            .filter(|a| a.event.context() == stream.context())
        {
            return Ok(a.clone());
        }
        let event = stream.record_event(TIMED)?;
        event.synchronize()?;
        let a = Arc::new(Anchor {
            event,
            at: Instant::now(),
        });
        *held = Some(a.clone());
        Ok(a)
    }

    /// Make `compute` wait for the op `event` (`begin` … `done` on its communication stream)
    /// without the host waiting: the stall ([`wait_timed`]) and the op's span ([`span`]) go to
    /// `tracer`, read when its totals are next read.
    pub(crate) fn order_after(
        compute: &CudaStream,
        begin: CudaEvent,
        done: Arc<CudaEvent>,
        tracer: &Tracer,
        event: &TraceEvent,
    ) -> Result<(), DriverError> {
        wait_timed(compute, &done, tracer, event.op)?;
        let span = span(compute, begin, done, tracer.epoch())?;
        tracer.record_on_device(event.clone(), span);
        Ok(())
    }

    /// A recorded op's span on its stream, from its timed `begin` and `done` events, in the
    /// microseconds of a tracer counting from `epoch`.
    fn span(
        stream: &CudaStream,
        begin: CudaEvent,
        done: Arc<CudaEvent>,
        epoch: Instant,
    ) -> Result<DeviceSpan, DriverError> {
        let anchor = anchor(stream)?;
        Ok(Box::new(move || {
            let base = anchor.at.saturating_duration_since(epoch).as_micros() as f64;
            // Waits for the stream to pass `done`; a stream that failed gives the anchor.
            let us = |e: &CudaEvent| {
                let ms = anchor.event.elapsed_ms(e).unwrap_or(0.0);
                (base + f64::from(ms) * 1e3).max(0.0).round() as u64
            };
            let start = us(&begin);
            (start, us(&done).max(start))
        }))
    }

    /// Make `compute` wait for `done` (the op's end on its communication stream), between two
    /// timing events whose distance, the stall, `tracer` adds to the op's blocked time when its
    /// totals are next read. The host does not wait.
    fn wait_timed(
        compute: &CudaStream,
        done: &CudaEvent,
        tracer: &Tracer,
        op: OpKind,
    ) -> Result<(), DriverError> {
        let before = compute.record_event(TIMED)?;
        compute.wait(done)?;
        let after = compute.record_event(TIMED)?;
        tracer.add_blocked_on_device(
            op,
            Box::new(move || {
                // Waits for the stream to pass `after`; a stream that failed counts no time.
                let ms = before.elapsed_ms(&after).unwrap_or(0.0);
                (f64::from(ms) * 1e3).round() as u64
            }),
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A device wait is read once, at the next reading of the totals, into the op's blocked
    /// time and the group's.
    #[test]
    fn device_waits_are_read_with_the_totals() {
        let t = Tracer::default();
        let reads = Arc::new(AtomicUsize::new(0));
        for us in [300, 40] {
            let reads = reads.clone();
            t.add_blocked_on_device(
                OpKind::AllGather,
                Box::new(move || {
                    reads.fetch_add(1, Ordering::SeqCst);
                    us
                }),
            );
        }
        t.add_blocked(OpKind::AllReduce, 5);
        assert_eq!(reads.load(Ordering::SeqCst), 0, "added, not read");
        assert_eq!(t.totals().blocked_us, 345);
        assert_eq!(t.totals().blocked_us, 345, "each wait counts once");
        assert_eq!(t.totals_by_op()[&OpKind::AllGather].blocked_us, 340);
        assert_eq!(reads.load(Ordering::SeqCst), 2);
    }

    /// Ops timed on a device are recorded when the totals or events are next read, in the order
    /// they ran, with the device's start and end; until then a timeout report lists them as
    /// issued.
    #[test]
    fn device_ops_are_recorded_when_read() {
        let t = Tracer::default();
        t.set_recording(true);
        let reads = Arc::new(AtomicUsize::new(0));
        // Waited for in another order than issued (as a ring's sends, after its receives).
        for (seq, span) in [(1u64, (400, 500)), (0, (100, 400))] {
            let ev = TraceEvent {
                op: OpKind::AllReduce,
                group: "tp".into(),
                seq,
                bytes: 8,
                bytes_sent: 8,
                start_us: 10,
                end_us: 10,
                peer: None,
                site: Site::caller(),
            };
            let reads = reads.clone();
            t.record_on_device(
                ev,
                Box::new(move || {
                    reads.fetch_add(1, Ordering::SeqCst);
                    span
                }),
            );
        }
        let issued = t.recent();
        assert_eq!(
            issued.iter().map(|e| (e.seq, e.end_us)).collect::<Vec<_>>(),
            [(1, 10), (0, 10)]
        );
        assert_eq!(
            reads.load(Ordering::SeqCst),
            0,
            "a timeout report does not wait for the device"
        );
        let ev = t.events();
        assert_eq!(
            ev.iter()
                .map(|e| (e.start_us, e.end_us))
                .collect::<Vec<_>>(),
            [(100, 400), (400, 500)]
        );
        // Busy: 100..400, then 400..500: each op whole, in the order they ran.
        assert_eq!(t.totals().busy_us, 400);
        assert_eq!(t.totals().ops, 2);
        assert_eq!(reads.load(Ordering::SeqCst), 2, "each span is read once");
        // Not recording: counted in the totals, not kept among the events.
        t.set_recording(false);
        let ev = t.recent().pop().expect("an op");
        t.record_on_device(ev, Box::new(|| (600, 700)));
        assert_eq!(t.totals().ops, 3);
        assert_eq!(t.events().len(), 2);
    }
}
