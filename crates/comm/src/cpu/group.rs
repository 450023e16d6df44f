//! `CpuComm`: one process group of the CPU backend, and its communication thread.
//!
//! ```text
//!   caller thread                          communication thread of the group
//!   all_reduce_async(x) --job-->  queue -->  header exchange, ring, ... --> fills the Work slot
//!   ...compute...                            (ops run one at a time, in issue order)
//!   work.wait()  <----------------------------------------------------------'
//! ```
//!
//! Every op, sync or async, is a job on the group's queue; the sync methods are the async ones
//! followed by `wait()`. Because the transfer runs on its own thread, compute issued after an
//! async op really overlaps it. Two ops the caller would gain nothing by handing off run on the
//! caller's thread instead where the queue is empty (the job and its order unchanged, under the
//! group's lock): a send, which writes into the socket what it takes and never waits on the
//! receiver, and a blocking `recv`, whose caller waits for it anyway. After a failure the group
//! is poisoned: the queue keeps draining but every later op fails at once with
//! [`CommError::Poisoned`] naming the first error.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Shape, Tensor};

use super::core::GroupCore;
use super::link::LinkEmulator;
use super::wire::check_dtype;
use crate::communicator::{
    all_reduce_and_copy_back, check_in_place, CommError, Communicator, OpKind, PendingWork,
    ReduceOp, Result, Work,
};
use crate::site::Site;
use crate::trace::{TraceEvent, Tracer};

type Job = Box<dyn FnOnce(&mut GroupCore) + Send>;

/// Where the communication thread leaves an op's result, and when (on the tracer's clock) the
/// op finished.
struct Slot<T> {
    value: Mutex<Option<Result<T>>>,
    ready: Condvar,
    finished_us: AtomicU64,
}

/// The communication thread's end of a slot. If it is dropped unfilled (the thread died), the
/// waiter gets an error instead of hanging.
struct Promise<T> {
    slot: Option<Arc<Slot<T>>>,
    group: String,
}

impl<T> Promise<T> {
    fn fulfil(mut self, value: Result<T>, finished_us: u64) {
        if let Some(slot) = self.slot.take() {
            slot.finished_us.store(finished_us, Ordering::Release);
            *slot.value.lock().unwrap_or_else(|p| p.into_inner()) = Some(value);
            slot.ready.notify_all();
        }
    }
}

impl<T> Drop for Promise<T> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            let err = CommError::Poisoned {
                group: self.group.clone(),
                cause: "its communication thread stopped".into(),
            };
            *slot.value.lock().unwrap_or_else(|p| p.into_inner()) = Some(Err(err));
            slot.ready.notify_all();
        }
    }
}

/// The caller's end of a slot; waiting adds the time blocked before the op finished to the
/// group's [`Tracer`] totals (the step's exposed communication).
struct CpuWork<T>(Arc<Slot<T>>, Tracer, OpKind);

impl<T: Send> PendingWork<T> for CpuWork<T> {
    fn wait(self: Box<Self>) -> Result<T> {
        let from_us = self.1.now_us();
        let mut value = self.0.value.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(v) = value.take() {
                let finished = self.0.finished_us.load(Ordering::Acquire);
                self.1.add_blocked(self.2, finished.saturating_sub(from_us));
                self.1.add_held(self.2, self.1.now_us().saturating_sub(from_us));
                return v;
            }
            value = self.0.ready.wait(value).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn is_done(&self) -> bool {
        self.0
            .value
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }
}

/// One process group of the CPU backend.
pub struct CpuComm {
    /// The group's state: the communication thread's, lent to the caller for an op it runs
    /// itself ([`CpuComm::submit`]).
    core: Arc<Mutex<GroupCore>>,
    rank: usize,
    name: String,
    globals: Vec<usize>,
    device: Device,
    tracer: Tracer,
    /// Queue of the communication thread; `None` once the group is being dropped.
    jobs: Option<mpsc::Sender<Job>>,
    /// Ops queued and not yet finished by the communication thread.
    queued: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
    poison: Arc<Mutex<Option<String>>>,
    /// The emulated link the group's messages cross, if any.
    link: Option<LinkEmulator>,
}

impl Drop for CpuComm {
    /// Close the queue and let the communication thread finish what was issued, so a process that
    /// exits right after its last op (a final barrier) still puts those bytes on the wire: the
    /// thread drops the group's connections, and each connection flushes before it closes.
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            super::conn::join_within(thread, DRAIN_ON_DROP);
        }
    }
}

/// How long dropping a group waits for its communication thread to drain.
const DRAIN_ON_DROP: std::time::Duration = std::time::Duration::from_secs(10);

impl std::fmt::Debug for CpuComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuComm")
            .field("name", &self.name)
            .field("rank", &self.rank)
            .field("ranks", &self.globals)
            .finish()
    }
}

impl CpuComm {
    /// Start the communication thread for a group whose connections are already set up.
    pub(crate) fn start(core: GroupCore, link: Option<LinkEmulator>) -> Result<Self> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let (rank, name, globals, tracer, poison) = (
            core.rank,
            core.name.clone(),
            core.globals.clone(),
            core.tracer.clone(),
            core.poison_flag.clone(),
        );
        let thread_name = format!("comm-{}-r{}", name, globals[rank]);
        let core = Arc::new(Mutex::new(core));
        let theirs = core.clone();
        let thread = std::thread::Builder::new()
            .name(thread_name)
            .spawn(move || {
                for job in queue {
                    job(&mut theirs.lock().unwrap_or_else(|p| p.into_inner()));
                }
            })?;
        Ok(Self {
            core,
            rank,
            name,
            globals,
            device: Device::Cpu,
            tracer,
            jobs: Some(jobs),
            queued: Arc::new(AtomicU64::new(0)),
            thread: Some(thread),
            poison,
            link,
        })
    }

    /// A receive from `src`, queued or (`inline`) run by the caller ([`CpuComm::submit`]).
    #[track_caller]
    fn recv_job(&self, src: usize, shape: &Shape, dtype: DType, inline: bool) -> Work {
        if let Err(e) = check_dtype(OpKind::Recv, &self.name, dtype) {
            return Work::ready(Err(e));
        }
        let (shape, link) = (shape.clone(), self.link);
        self.submit(Site::caller(), OpKind::Recv, None, Some(src), inline, move |c| {
            let x = c.recv_from(src, &shape, dtype)?;
            hold_on_link(link, c, OpKind::Recv, (x.elem_count() * dtype.size_in_bytes()) as u64);
            Ok(x)
        })
    }

    /// Wait until the communication thread has run every op queued so far (nothing is sent
    /// and nothing traced). Returns at once if none is pending or the thread is gone.
    /// The wait is held time of `op`, the op about to be issued.
    fn drain(&self, op: OpKind) {
        if self.queued.load(Ordering::Acquire) == 0 {
            return;
        }
        let from_us = self.tracer.now_us();
        let (done, finished) = mpsc::channel::<()>();
        let job: Job = Box::new(move |_| {
            let _ = done.send(());
        });
        if let Some(jobs) = &self.jobs {
            if jobs.send(job).is_ok() {
                let _ = finished.recv();
            }
        }
        self.tracer.add_held(op, self.tracer.now_us().saturating_sub(from_us));
    }

    /// Queue `run` on the communication thread and hand back its `Work`. With `inline`, where
    /// nothing is queued, the calling thread runs it itself instead (it would have waited for
    /// it, or the op never waits on a peer), which saves two hand-offs between threads, each a
    /// wake-up that on a busy core waits for a time slice; the op still runs after every op
    /// issued before it, and before every later one, under the group's lock.
    fn submit<T: Send + 'static>(
        &self,
        site: Site,
        op: OpKind,
        input: Option<&Tensor>,
        peer: Option<usize>,
        inline: bool,
        run: impl FnOnce(&mut GroupCore) -> Result<T> + Send + 'static,
    ) -> Work<T> {
        if let Some(cause) = self
            .poison
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return Work::ready(Err(CommError::Poisoned {
                group: self.name.clone(),
                cause,
            }));
        }
        if let Some(x) = input {
            if let Err(e) = check_dtype(op, &self.name, x.dtype()) {
                return Work::ready(Err(e));
            }
        }
        let bytes = input
            .map(|x| (x.elem_count() * x.dtype().size_in_bytes()) as u64)
            .unwrap_or(0);
        let slot = Arc::new(Slot {
            value: Mutex::new(None),
            ready: Condvar::new(),
            finished_us: AtomicU64::new(0),
        });
        let promise = Promise {
            slot: Some(slot.clone()),
            group: self.name.clone(),
        };
        let start_us = self.tracer.now_us();
        let (queued, link) = (self.queued.clone(), self.link);
        let here = inline
            && queued
                .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
                .is_ok();
        if !here {
            queued.fetch_add(1, Ordering::AcqRel);
        }
        let job: Job = Box::new(move |core: &mut GroupCore| {
            core.begin(op, site);
            let result = match core.poisoned() {
                Some(e) => Err(e),
                None => {
                    let r = run(core);
                    match &r {
                        Err(e) => core.poison(e),
                        // A receive's size is its result's: it holds itself (`recv_job`).
                        Ok(_) if op != OpKind::Recv => hold_on_link(link, core, op, bytes),
                        Ok(_) => {}
                    }
                    r
                }
            };
            let end_us = core.tracer.now_us();
            core.tracer.record(TraceEvent {
                op,
                group: core.name.clone(),
                seq: core.cur_seq,
                bytes,
                bytes_sent: core.cur_sent,
                start_us,
                end_us,
                peer,
                site,
            });
            // Counted out before the caller can see the result, so its next in-place op does
            // not wait for this one again.
            queued.fetch_sub(1, Ordering::AcqRel);
            promise.fulfil(result, end_us);
        });
        if here {
            job(&mut self.core.lock().unwrap_or_else(|p| p.into_inner()));
            // The caller spent the op's time on it: exposed communication, as a wait would be,
            // up to the op's recorded end (so it never exceeds the op's busy time).
            let finished = slot.finished_us.load(Ordering::Acquire);
            self.tracer.add_blocked(op, finished.saturating_sub(start_us));
        } else if let Some(jobs) = &self.jobs {
            // If the thread is gone the job (and its promise) is dropped: the Work reports it.
            // Waking the thread may hand it the caller's core before `send` returns: held time.
            let _ = jobs.send(job);
        }
        self.tracer.add_held(op, self.tracer.now_us().saturating_sub(start_us));
        Work::new(Box::new(CpuWork(slot, self.tracer.clone(), op)))
    }
}

/// Under an emulated link, sleep until the op's messages would have arrived: from the moment
/// every rank was present, the wire time of `op` on `bytes` ([`LinkEmulator::op_time`]).
fn hold_on_link(link: Option<LinkEmulator>, core: &GroupCore, op: OpKind, bytes: u64) {
    if let (Some(link), Some(synced)) = (link, core.synced) {
        let algo = core.algo.pick(bytes, core.size);
        LinkEmulator::hold_until(synced, link.op_time(op, bytes, core.size, algo));
    }
}

impl Communicator for CpuComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.globals.len()
    }
    fn name(&self) -> &str {
        &self.name
    }
    fn global_ranks(&self) -> &[usize] {
        &self.globals
    }
    fn device(&self) -> &Device {
        &self.device
    }
    fn tracer(&self) -> &Tracer {
        &self.tracer
    }

    fn all_reduce_async(&self, x: &Tensor, op: ReduceOp) -> Work {
        let xc = x.clone();
        self.submit(Site::caller(), OpKind::AllReduce, Some(x), None, false, move |c| {
            c.all_reduce(&xc, op)
        })
    }
    /// The ring in place on `x`'s own storage (f32, f64 and the integer types; a half-precision
    /// tensor, which the ring accumulates in f32, takes the trait's reduce-and-copy).
    fn all_reduce_in_place(&self, x: &Tensor, op: ReduceOp) -> Result<()> {
        let ring_type = matches!(
            x.dtype(),
            DType::F32 | DType::F64 | DType::U8 | DType::U32 | DType::I64
        );
        if !ring_type {
            return all_reduce_and_copy_back(self, x, op);
        }
        check_in_place(&self.name, x)?;
        // An earlier op of this group may still have to read `x`: let it finish before the
        // write lock is taken, or it would wait on the lock while we wait on it.
        self.drain(OpKind::AllReduce);
        let ring = InPlaceRing {
            site: Site::caller(),
            comm: self,
            x,
            op,
            failed: Mutex::new(None),
        };
        let done = x.inplace_op1(&ring);
        match ring.failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(done?),
        }
    }
    fn reduce_async(&self, x: &Tensor, root: usize, op: ReduceOp) -> Work {
        let xc = x.clone();
        self.submit(Site::caller(), OpKind::Reduce, Some(x), Some(root), false, move |c| {
            c.reduce(&xc, root, op)
        })
    }
    fn broadcast_async(&self, x: &Tensor, root: usize) -> Work {
        let xc = x.clone();
        self.submit(Site::caller(), OpKind::Broadcast, Some(x), Some(root), false, move |c| {
            c.broadcast(&xc, root)
        })
    }
    fn all_gather_async(&self, x: &Tensor) -> Work {
        let xc = x.clone();
        self.submit(Site::caller(), OpKind::AllGather, Some(x), None, false, move |c| {
            c.all_gather(&xc)
        })
    }
    fn reduce_scatter_async(&self, x: &Tensor, op: ReduceOp) -> Work {
        let xc = x.clone();
        self.submit(Site::caller(), OpKind::ReduceScatter, Some(x), None, false, move |c| {
            c.reduce_scatter(&xc, op)
        })
    }
    fn scatter_async(&self, x: &Tensor, root: usize) -> Work {
        let xc = x.clone();
        self.submit(Site::caller(), OpKind::Scatter, Some(x), Some(root), false, move |c| {
            c.scatter(&xc, root)
        })
    }
    fn gather_async(&self, x: &Tensor, root: usize) -> Work {
        let xc = x.clone();
        self.submit(Site::caller(), OpKind::Gather, Some(x), Some(root), false, move |c| {
            c.gather(&xc, root)
        })
    }
    fn all_to_all_async(&self, x: &Tensor, send_splits: &[usize], recv_splits: &[usize]) -> Work {
        let (xc, s, r) = (x.clone(), send_splits.to_vec(), recv_splits.to_vec());
        self.submit(Site::caller(), OpKind::AllToAll, Some(x), None, false, move |c| {
            c.all_to_all(&xc, &s, &r)
        })
    }
    /// Run by the caller where nothing is queued ([`CpuComm::submit`]): the job never waits
    /// on the receiver.
    fn send_async(&self, x: &Tensor, dst: usize) -> Work<()> {
        let xc = x.clone();
        self.submit(Site::caller(), OpKind::Send, Some(x), Some(dst), true, move |c| {
            c.send_to(&xc, dst)
        })
    }
    /// The send job writes into the socket what it takes and queues the rest for the
    /// connection's writer thread (an unbounded channel); it never waits on the receiver.
    fn sends_complete_locally(&self) -> bool {
        true
    }
    fn recv_async(&self, src: usize, shape: &Shape, dtype: DType) -> Work {
        self.recv_job(src, shape, dtype, false)
    }
    /// Run by the caller where nothing is queued ([`CpuComm::submit`]): it reads the socket
    /// itself, so a message already there costs no round trip through the communication thread.
    fn recv(&self, src: usize, shape: &Shape, dtype: DType) -> Result<Tensor> {
        self.recv_job(src, shape, dtype, true).wait()
    }
    fn barrier_async(&self) -> Work<()> {
        self.submit(Site::caller(), OpKind::Barrier, None, None, false, |c| c.barrier())
    }
}

/// [`CpuComm::all_reduce_in_place`] as a candle in-place op: candle hands it the tensor's
/// storage under its write lock, and it runs the ring on those elements on the communication
/// thread, waiting for the ring to finish before it returns (so the storage stays locked, and
/// no one else sees it, while the thread writes).
struct InPlaceRing<'a> {
    /// Where the all-reduce was issued.
    site: Site,
    comm: &'a CpuComm,
    x: &'a Tensor,
    op: ReduceOp,
    /// The communication error, if any (candle's op returns only its own error type).
    failed: Mutex<Option<CommError>>,
}

/// A tensor's elements handed to the communication thread. Only [`InPlaceRing::run`] makes one,
/// and it waits for the job that uses it.
struct Elems<T>(*mut T, usize);
// SAFETY: the pointer is used by one thread at a time: the communication thread while the
// caller waits for it, under the storage's write lock.
unsafe impl<T> Send for Elems<T> {}

impl InPlaceRing<'_> {
    fn run<T: super::wire::AccElem + candle_core::WithDType>(
        &self,
        elems: &mut [T],
    ) -> candle_core::Result<()> {
        let raw = Elems(elems.as_mut_ptr(), elems.len());
        let (dtype, shape, op) = (self.x.dtype(), self.x.dims().to_vec(), self.op);
        let work = self
            .comm
            .submit(self.site, OpKind::AllReduce, Some(self.x), None, false, move |c| {
                let raw = raw;
                // SAFETY: `elems` is borrowed mutably for as long as `run` waits below, and the
                // job is the only user of the pointer until it fulfils its promise.
                let buf = unsafe { std::slice::from_raw_parts_mut(raw.0, raw.1) };
                c.all_reduce_in_place(buf, dtype, &shape, op)
            });
        match work.wait() {
            Ok(()) => Ok(()),
            Err(e) => {
                let msg = e.to_string();
                *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                Err(candle_core::Error::Msg(msg))
            }
        }
    }
}

impl InplaceOp1 for InPlaceRing<'_> {
    fn name(&self) -> &'static str {
        "all_reduce_in_place"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("all_reduce_in_place: the tensor is not contiguous");
        };
        match storage {
            CpuStorage::F32(v) => self.run(&mut v[start..end]),
            CpuStorage::F64(v) => self.run(&mut v[start..end]),
            CpuStorage::U8(v) => self.run(&mut v[start..end]),
            CpuStorage::U32(v) => self.run(&mut v[start..end]),
            CpuStorage::I64(v) => self.run(&mut v[start..end]),
            _ => candle_core::bail!("all_reduce_in_place: dtype {:?}", self.x.dtype()),
        }
    }
}
