//! NCCL backend: the [`Communicator`] contract on CUDA tensors, one NCCL communicator per group.
//!
//! This is the only file in mtrain that calls NCCL or contains `unsafe`. CUDA is reached only
//! through candle (`candle_core::cuda_backend::cudarc`), so there is exactly one cudarc in the
//! build, and tensor memory is read and written through candle's `CudaStorage`.
//!
//! # Streams and events: how an async collective overlaps compute
//!
//! candle issues every kernel on its compute stream. Each group owns a second, *communication*
//! stream, and every op is ordered against the compute stream with two CUDA events:
//!
//! ```text
//!   compute  ──[backward blk 3]──●ready──[backward blk 2]──[backward blk 1]──⧗──[use result]──▶
//!                                 ╲                                         ╱
//!   comm     ──────────────────────⧗──[ncclAllReduce bucket 3]──●done──────╱
//!
//!   ● record an event       ⧗ the stream waits for that event (on the GPU, the host never blocks)
//! ```
//!
//! 1. issue: the result buffer is allocated on the compute stream, `ready` is recorded there and
//!    the communication stream waits for it, so the collective sees every value the compute
//!    stream produced before the call. The NCCL kernel is enqueued and `done` is recorded.
//! 2. `Work::wait()`: the *compute* stream waits for `done`. The host does not block, so the CPU
//!    keeps issuing kernels; everything issued before `wait()` overlaps the transfer. The sync
//!    forms (`all_reduce`, ...) are async + wait, so they do not block the host either.
//!
//! The [`Work`] keeps the input and output tensors alive until the compute stream is ordered
//! after `done` (in `wait()`, or in its `Drop` when a caller discards it), so the stream-ordered
//! allocator never reuses memory a collective still reads or writes. `wait()` must be called on
//! the thread that computes (candle's default CUDA stream is per thread).
//!
//! # One communicator per group
//!
//! The lowest global rank of a group creates an NCCL unique id and publishes it through the
//! rendezvous store under a key naming the group, its ranks and a creation counter; the other
//! members read it and every member calls `ncclCommInitRank`. A group of one needs no store.
//!
//! # Ops NCCL lacks
//!
//! NCCL's all-gather and reduce-scatter need equal chunks. Uneven splits (rows per
//! [`chunk_range`]) are done as:
//! - all_gather: every rank's row count is exchanged first (a tiny all-gather on the
//!   communication stream that the host waits for: a rendezvous, not a wait for compute), then
//!   one grouped broadcast per rank writes each rank's rows straight to their offset;
//! - reduce_scatter: the input is padded so each chunk occupies `ceil(D/n)` rows, reduced, and
//!   the padding dropped from the result;
//! - all_to_all, scatter, gather: grouped `ncclSend`/`ncclRecv` (gather and scatter exchange the
//!   row counts / the shape first, like all_gather).
//!
//! # Failures
//!
//! NCCL kernels of a mismatched or abandoned collective wait forever on the GPU. A watchdog
//! thread per group polls the `done` event of every op in flight; an op older than the group's
//! timeout aborts the communicator (`ncclCommAbort` makes the kernels return), and from then on
//! every op of that group fails with [`CommError::Timeout`] naming op, group, sequence number and
//! rank. With [`NcclOptions::check_args`] every op first exchanges a header (op, dtype, element
//! count, root) with the whole group and fails with [`CommError::Mismatch`] on every rank when
//! they differ, at the cost of one host rendezvous per op.
//!
//! # Send and Sync
//!
//! The only `!Send` state is the raw `ncclComm_t` handle. NCCL allows a communicator to be used
//! from any thread provided calls on it never run concurrently; every call on it here happens
//! under the group's `issue` mutex, except `ncclCommAbort`, which NCCL documents as callable from
//! another thread to unblock a hung communicator. CUDA streams and events are `Send + Sync` in
//! cudarc already.

use std::collections::VecDeque;
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver::{
    CudaContext, CudaEvent, CudaStream, DevicePtr, SyncOnDrop,
};
use candle_core::cuda_backend::cudarc::nccl::sys as nccl;
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{DType, Device, Shape, Storage, Tensor};

use crate::communicator::{
    chunk_range, Backend, Comm, CommError, Communicator, OpKind, PendingWork, ReduceOp, Result,
    Work,
};
use crate::trace::{TraceEvent, Tracer};

/// How ranks of a group agree on the group's NCCL unique id: the first rank publishes it, the
/// others read it. A launched job passes its rendezvous store; a single process needs none.
pub trait IdExchange: Send + Sync {
    /// Store `value` under `key`.
    fn publish(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Block until `key` exists (at most `timeout`) and return its value.
    fn fetch(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
}

impl IdExchange for crate::store::StoreClient {
    fn publish(&self, key: &str, value: &[u8]) -> Result<()> {
        self.set(key, value)
    }

    fn fetch(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.get_timeout(key, timeout)
    }
}

/// An [`IdExchange`] for ranks that are threads of one process (one GPU per thread).
#[derive(Debug, Default)]
pub struct InProcessExchange {
    values: Mutex<std::collections::HashMap<String, Vec<u8>>>,
    changed: std::sync::Condvar,
}

impl IdExchange for InProcessExchange {
    fn publish(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut values = self.values.lock().unwrap_or_else(|p| p.into_inner());
        values.insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn fetch(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut values = self.values.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(v) = values.get(key) {
                return Ok(v.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CommError::Store(format!(
                    "key '{key}' not published within {timeout:?}"
                )));
            }
            values = self
                .changed
                .wait_timeout(values, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// Settings shared by every group of a [`NcclBackend`].
#[derive(Debug, Clone)]
pub struct NcclOptions {
    /// An op still running after this long aborts its group with [`CommError::Timeout`].
    pub timeout: Duration,
    /// Exchange a header before every op and fail with [`CommError::Mismatch`] when ranks
    /// disagree (one host rendezvous per op: for debugging).
    pub check_args: bool,
    /// Record every op in each group's tracer (otherwise only the last few are kept).
    pub trace: bool,
}

impl Default for NcclOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(300),
            check_args: false,
            trace: false,
        }
    }
}

/// Creates NCCL groups for one process driving one GPU.
pub struct NcclBackend {
    factory: GroupFactory,
    world_size: usize,
    world: Comm,
    /// Rank 0 of a launched job hosts the rendezvous store for as long as the backend lives.
    _store_server: Option<crate::store::StoreServer>,
}

/// What every group of a backend is created from.
struct GroupFactory {
    device: Device,
    ctx: Arc<CudaContext>,
    rank: usize,
    exchange: Option<Arc<dyn IdExchange>>,
    opts: NcclOptions,
    epoch: Instant,
    groups_created: AtomicU64,
}

impl std::fmt::Debug for NcclBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclBackend(rank {} of {}, {:?})",
            self.factory.rank, self.world_size, self.factory.device
        )
    }
}

impl NcclBackend {
    /// The backend of global rank `rank` of `world_size`, computing on `device` (a CUDA device,
    /// usually `Device::new_cuda(local_rank)`). `exchange` is required when `world_size > 1`.
    /// Every rank must call this at the same time: it creates the world communicator.
    pub fn new(
        device: Device,
        rank: usize,
        world_size: usize,
        exchange: Option<Arc<dyn IdExchange>>,
        opts: NcclOptions,
    ) -> Result<Self> {
        if rank >= world_size {
            return Err(CommError::InvalidArgument {
                op: OpKind::Barrier,
                group: "world".into(),
                msg: format!("rank {rank} is not below world size {world_size}"),
            });
        }
        let ctx = device.as_cuda_device()?.cuda_stream().context().clone();
        let factory = GroupFactory {
            device,
            ctx,
            rank,
            exchange,
            opts,
            epoch: Instant::now(),
            groups_created: AtomicU64::new(0),
        };
        let ranks: Vec<usize> = (0..world_size).collect();
        let world = factory.create_group(&ranks, "world")?;
        Ok(Self {
            factory,
            world_size,
            world,
            _store_server: None,
        })
    }

    /// The backend of a launched worker: GPU `env.local_rank`, NCCL ids exchanged through the
    /// job's rendezvous store (hosted by rank 0 at `MASTER_ADDR:MASTER_PORT`).
    pub fn init(env: &crate::env::LaunchEnv, opts: NcclOptions) -> Result<Self> {
        env.validate()?;
        let device = Device::new_cuda(env.local_rank)?;
        if env.world_size == 1 {
            return Self::new(device, 0, 1, None, opts);
        }
        let (server, client) = crate::store::rendezvous(env, opts.timeout)?;
        let exchange: Arc<dyn IdExchange> = Arc::new(client);
        let mut backend = Self::new(device, env.rank, env.world_size, Some(exchange), opts)?;
        backend._store_server = server;
        Ok(backend)
    }

    /// The version of the NCCL library loaded at run time, e.g. 22809 for 2.28.9.
    pub fn nccl_version() -> Result<i32> {
        let mut v = 0;
        // SAFETY: `v` is a valid out-pointer.
        unsafe { check(nccl::ncclGetVersion(&mut v)) }.map_err(CommError::Store)?;
        Ok(v)
    }
}

impl GroupFactory {
    fn create_group(&self, ranks: &[usize], name: &str) -> Result<Comm> {
        let generation = self.groups_created.fetch_add(1, Ordering::SeqCst);
        let group_rank = ranks.iter().position(|&r| r == self.rank).ok_or_else(|| {
            CommError::InvalidArgument {
                op: OpKind::Barrier,
                group: name.into(),
                msg: format!("rank {} is not a member of group {ranks:?}", self.rank),
            }
        })?;
        let id = self.unique_id(ranks, name, generation, group_rank)?;
        NcclGroup::init(self, ranks, group_rank, name, id)
    }

    /// The first member creates the id; the others read it from the store.
    fn unique_id(
        &self,
        ranks: &[usize],
        name: &str,
        generation: u64,
        group_rank: usize,
    ) -> Result<nccl::ncclUniqueId> {
        let key = format!(
            "nccl/{generation}/{name}/{}",
            ranks
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
        let store_err = |e: String| CommError::Store(format!("NCCL id for group '{name}': {e}"));
        if group_rank == 0 {
            let mut id = std::mem::MaybeUninit::<nccl::ncclUniqueId>::uninit();
            // SAFETY: ncclGetUniqueId fills the whole 128-byte id it is given.
            let id = unsafe {
                check(nccl::ncclGetUniqueId(id.as_mut_ptr())).map_err(store_err)?;
                id.assume_init()
            };
            if ranks.len() > 1 {
                let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
                self.exchange(name)?.publish(&key, &bytes)?;
            }
            Ok(id)
        } else {
            let bytes = self.exchange(name)?.fetch(&key, self.opts.timeout)?;
            if bytes.len() != 128 {
                return Err(store_err(format!(
                    "store key '{key}' holds {} bytes, an NCCL id has 128",
                    bytes.len()
                )));
            }
            let mut internal = [0 as std::ffi::c_char; 128];
            for (dst, src) in internal.iter_mut().zip(bytes) {
                *dst = src as std::ffi::c_char;
            }
            Ok(nccl::ncclUniqueId { internal })
        }
    }

    fn exchange(&self, group: &str) -> Result<&Arc<dyn IdExchange>> {
        self.exchange.as_ref().ok_or_else(|| {
            CommError::Store(format!(
                "group '{group}' spans several ranks but the NCCL backend was created without a store"
            ))
        })
    }
}

impl Backend for NcclBackend {
    fn world(&self) -> Comm {
        self.world.clone()
    }

    fn new_group(&self, ranks: &[usize], name: &str) -> Result<Comm> {
        if ranks.is_empty() || ranks.windows(2).any(|w| w[0] >= w[1]) {
            return Err(CommError::InvalidArgument {
                op: OpKind::Barrier,
                group: name.into(),
                msg: format!("group ranks must be sorted, distinct and non-empty, got {ranks:?}"),
            });
        }
        if let Some(&r) = ranks.iter().find(|&&r| r >= self.world_size) {
            return Err(CommError::InvalidArgument {
                op: OpKind::Barrier,
                group: name.into(),
                msg: format!("rank {r} is not below world size {}", self.world_size),
            });
        }
        self.factory.create_group(ranks, name)
    }

    fn device(&self) -> Device {
        self.factory.device.clone()
    }
}

/// Turn an NCCL status into a message naming the NCCL error.
fn check(status: nccl::ncclResult_t) -> std::result::Result<(), String> {
    match status {
        nccl::ncclResult_t::ncclSuccess | nccl::ncclResult_t::ncclInProgress => Ok(()),
        other => {
            // SAFETY: ncclGetErrorString returns a pointer to a static NUL-terminated string.
            let text = unsafe { CStr::from_ptr(nccl::ncclGetErrorString(other)) };
            Err(format!("{other:?}: {}", text.to_string_lossy()))
        }
    }
}

/// The raw communicator handle, only ever used under [`NcclGroup::issue`] (see the file doc).
struct RawComm(nccl::ncclComm_t);
// SAFETY: see "Send and Sync" in the file doc: the handle is an opaque pointer NCCL lets any
// thread use, it never changes after creation, and calls through it are serialised by the
// group's issue mutex (ncclCommAbort excepted, which NCCL allows from another thread).
unsafe impl Send for RawComm {}
unsafe impl Sync for RawComm {}

/// An op whose `done` event the watchdog watches.
struct InFlight {
    op: OpKind,
    seq: u64,
    issued: Instant,
    done: Arc<CudaEvent>,
}

struct Shared {
    name: String,
    rank: usize,
    size: usize,
    timeout: Duration,
    ctx: Arc<CudaContext>,
    comm: RawComm,
    in_flight: Mutex<VecDeque<InFlight>>,
    /// Set once the group was aborted: every later op fails with this error's text.
    poisoned: Mutex<Option<(OpKind, u64)>>,
    aborted: AtomicBool,
}

impl Drop for Shared {
    fn drop(&mut self) {
        if !self.aborted.load(Ordering::SeqCst) && !self.comm.0.is_null() {
            // SAFETY: the handle came from ncclCommInitRank, is not aborted, and nothing else
            // can use it any more (this is the last reference to the group).
            let _ = unsafe { nccl::ncclCommDestroy(self.comm.0) };
        }
    }
}

/// One process group on NCCL.
pub struct NcclGroup {
    shared: Arc<Shared>,
    global_ranks: Vec<usize>,
    device: Device,
    compute: Arc<CudaStream>,
    comm_stream: Arc<CudaStream>,
    tracer: Tracer,
    check_args: bool,
    seq: AtomicU64,
    /// Held while an op is enqueued: serialises NCCL calls and keeps seq order = issue order.
    issue: Mutex<()>,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclGroup('{}', rank {} of {}, ranks {:?})",
            self.shared.name, self.shared.rank, self.shared.size, self.global_ranks
        )
    }
}

impl NcclGroup {
    fn init(
        backend: &GroupFactory,
        ranks: &[usize],
        group_rank: usize,
        name: &str,
        id: nccl::ncclUniqueId,
    ) -> Result<Comm> {
        let cuda = backend.device.as_cuda_device()?;
        let compute = cuda.cuda_stream();
        let ctx = backend.ctx.clone();
        let comm_stream = ctx.new_stream().map_err(|e| driver_err(name, e))?;
        ctx.bind_to_thread().map_err(|e| driver_err(name, e))?;
        let mut raw: nccl::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; size, id and rank are the same on every member.
        unsafe {
            check(nccl::ncclCommInitRank(
                &mut raw,
                ranks.len() as i32,
                id,
                group_rank as i32,
            ))
        }
        .map_err(|e| {
            CommError::Store(format!(
                "ncclCommInitRank for group '{name}' (rank {group_rank} of {}): {e}",
                ranks.len()
            ))
        })?;
        let shared = Arc::new(Shared {
            name: name.to_string(),
            rank: group_rank,
            size: ranks.len(),
            timeout: backend.opts.timeout,
            ctx,
            comm: RawComm(raw),
            in_flight: Mutex::new(VecDeque::new()),
            poisoned: Mutex::new(None),
            aborted: AtomicBool::new(false),
        });
        spawn_watchdog(Arc::downgrade(&shared));
        Ok(Arc::new(NcclGroup {
            shared,
            global_ranks: ranks.to_vec(),
            device: backend.device.clone(),
            compute,
            comm_stream,
            tracer: {
                let t = Tracer::new(backend.epoch);
                t.set_recording(backend.opts.trace);
                t
            },
            check_args: backend.opts.check_args,
            seq: AtomicU64::new(0),
            issue: Mutex::new(()),
        }))
    }

    fn name(&self) -> &str {
        &self.shared.name
    }

    fn invalid(&self, op: OpKind, msg: String) -> CommError {
        CommError::InvalidArgument {
            op,
            group: self.name().to_string(),
            msg,
        }
    }

    fn nccl_err(&self, op: OpKind, seq: u64, e: String) -> CommError {
        CommError::PeerClosed {
            op,
            group: self.name().to_string(),
            seq,
            rank: self.shared.rank,
            peer: self.shared.rank,
            detail: format!("NCCL: {e}"),
        }
    }

    /// Fails when this group was aborted after an op stalled; the error names that op.
    fn check_poisoned(&self) -> Result<()> {
        let poisoned = *self
            .shared
            .poisoned
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match poisoned {
            None => Ok(()),
            Some((op, seq)) => Err(CommError::Timeout {
                op,
                group: self.name().to_string(),
                seq,
                rank: self.shared.rank,
                // NCCL does not say which peer never arrived.
                peer: self.shared.rank,
                timeout_ms: self.shared.timeout.as_millis() as u64,
            }),
        }
    }

    /// Validates that `x` lives on this group's GPU, and returns it contiguous.
    fn input(&self, op: OpKind, x: &Tensor) -> Result<Tensor> {
        if !x.device().same_device(&self.device) {
            return Err(self.invalid(
                op,
                format!(
                    "tensor is on {:?}, the group computes on {:?}",
                    x.device(),
                    self.device
                ),
            ));
        }
        Ok(x.contiguous()?)
    }

    /// Issue one op: order the communication stream after the compute stream, enqueue the
    /// NCCL calls `enqueue` makes (given the device addresses of `bufs`), record `done`.
    ///
    /// `bufs` are the tensors the op reads or writes; they are kept alive by the returned
    /// handle. `enqueue` runs with the communicator locked and the CUDA context current.
    #[allow(clippy::too_many_arguments)]
    fn launch<T: Send + 'static>(
        &self,
        op: OpKind,
        bytes: u64,
        bytes_sent: u64,
        peer: Option<usize>,
        bufs: Vec<Tensor>,
        result: T,
        enqueue: impl FnOnce(
            nccl::ncclComm_t,
            nccl::cudaStream_t,
            &[u64],
        ) -> std::result::Result<(), String>,
    ) -> Work<T> {
        match self.try_launch(op, bytes, bytes_sent, peer, bufs, result, enqueue) {
            Ok(w) => Work::new(Box::new(w)),
            Err(e) => Work::ready(Err(e)),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn try_launch<T: Send + 'static>(
        &self,
        op: OpKind,
        bytes: u64,
        bytes_sent: u64,
        peer: Option<usize>,
        bufs: Vec<Tensor>,
        result: T,
        enqueue: impl FnOnce(
            nccl::ncclComm_t,
            nccl::cudaStream_t,
            &[u64],
        ) -> std::result::Result<(), String>,
    ) -> Result<NcclWork<T>> {
        self.check_poisoned()?;
        let _issue = self.issue.lock().unwrap_or_else(|p| p.into_inner());
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let start_us = self.tracer.now_us();
        let cu = |e| driver_err(self.name(), e);
        // Every value the compute stream wrote before this call is visible to the collective.
        let ready = self.compute.record_event(None).map_err(cu)?;
        self.comm_stream.wait(&ready).map_err(cu)?;
        self.shared.ctx.bind_to_thread().map_err(cu)?;
        with_device_addrs(&bufs, &self.comm_stream, |addrs| {
            let stream = self.comm_stream.cu_stream() as nccl::cudaStream_t;
            enqueue(self.shared.comm.0, stream, addrs)
        })?
        .map_err(|e| self.nccl_err(op, seq, e))?;
        let done = Arc::new(self.comm_stream.record_event(None).map_err(cu)?);
        self.shared
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(InFlight {
                op,
                seq,
                issued: Instant::now(),
                done: done.clone(),
            });
        let event = TraceEvent {
            op,
            group: self.name().to_string(),
            seq,
            bytes,
            bytes_sent,
            start_us,
            end_us: start_us,
            peer,
        };
        Ok(NcclWork {
            done: Some(done),
            compute: self.compute.clone(),
            keep: bufs,
            result: Some(result),
            tracer: self.tracer.clone(),
            event,
        })
    }

    /// All-gather `vals` (the same length on every rank) over the communication stream and
    /// return them per rank on the host. The host waits for the group: a rendezvous that does
    /// not wait for pending compute, since the values come from the host.
    fn exchange_host(&self, op: OpKind, vals: &[u64]) -> Result<Vec<Vec<u64>>> {
        self.check_poisoned()?;
        let n = self.shared.size;
        let k = vals.len();
        let _issue = self.issue.lock().unwrap_or_else(|p| p.into_inner());
        let cu = |e| driver_err(self.name(), e);
        let send = self.comm_stream.clone_htod(vals).map_err(cu)?;
        let recv = self.comm_stream.alloc_zeros::<u64>(n * k).map_err(cu)?;
        {
            let (s, _s) = send.device_ptr(&self.comm_stream);
            let (r, _r) = recv.device_ptr(&self.comm_stream);
            // SAFETY: `send` holds k u64 and `recv` n * k, both on this group's device, alive
            // until the stream is synchronised below.
            unsafe {
                check(nccl::ncclAllGather(
                    s as *const _,
                    r as *mut _,
                    k,
                    nccl::ncclDataType_t::ncclUint64,
                    self.shared.comm.0,
                    self.comm_stream.cu_stream() as _,
                ))
            }
            .map_err(|e| self.nccl_err(op, self.seq.load(Ordering::SeqCst), e))?;
        }
        // Poll (with the timeout) before copying back: the copy itself would wait forever for
        // a rank that never arrives.
        self.wait_stream(op)?;
        let mut host = vec![0u64; n * k];
        self.comm_stream.memcpy_dtoh(&recv, &mut host).map_err(cu)?;
        Ok(host.chunks(k.max(1)).map(|c| c.to_vec()).take(n).collect())
    }

    /// Synchronise the communication stream, giving up (and aborting) after the timeout.
    fn wait_stream(&self, op: OpKind) -> Result<()> {
        let cu = |e| driver_err(self.name(), e);
        let event = self.comm_stream.record_event(None).map_err(cu)?;
        let deadline = Instant::now() + self.shared.timeout;
        while !event.try_is_complete().map_err(cu)? {
            if Instant::now() > deadline {
                let seq = self.seq.load(Ordering::SeqCst);
                abort(&self.shared, op, seq);
                return self.check_poisoned();
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }

    /// With `check_args`, compare (op, dtype, count, root) across the group.
    fn check_header(
        &self,
        op: OpKind,
        dtype: DType,
        count: usize,
        root: Option<usize>,
    ) -> Result<()> {
        if !self.check_args || self.shared.size == 1 {
            return Ok(());
        }
        let mine = [
            op as u64,
            dtype_code(dtype),
            count as u64,
            root.map_or(u64::MAX, |r| r as u64),
        ];
        let all = self.exchange_host(op, &mine)?;
        for (peer, theirs) in all.iter().enumerate() {
            if theirs.as_slice() != mine {
                return Err(CommError::Mismatch {
                    group: self.name().to_string(),
                    rank: self.shared.rank,
                    peer,
                    mine: describe_header(&mine),
                    theirs: describe_header(theirs),
                });
            }
        }
        Ok(())
    }

    /// `(rows, elements per row)` of a tensor split on dim 0.
    fn rows(&self, op: OpKind, x: &Tensor) -> Result<(usize, usize)> {
        let dims = x.dims();
        if dims.is_empty() {
            return Err(self.invalid(op, "needs a tensor with at least one dimension".into()));
        }
        let per_row = dims[1..].iter().product::<usize>();
        Ok((dims[0], per_row))
    }
}

/// Run `f` with the device address of each tensor's first element. The storages stay locked
/// for reading while `f` enqueues work on `stream`, and cudarc records each buffer's "read"
/// event on `stream` afterwards, so a later reuse of the memory waits for the enqueued op.
fn with_device_addrs<R>(
    tensors: &[Tensor],
    stream: &CudaStream,
    f: impl FnOnce(&[u64]) -> R,
) -> Result<R> {
    let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let mut addrs = Vec::with_capacity(tensors.len());
    let mut records: Vec<SyncOnDrop<'_>> = Vec::with_capacity(tensors.len());
    for (t, (storage, layout)) in tensors.iter().zip(guards.iter()) {
        let Storage::Cuda(cuda) = &**storage else {
            return Err(candle_core::Error::Msg(format!(
                "NCCL needs CUDA tensors, got one on {:?}",
                t.device()
            ))
            .into());
        };
        let (base, record) = slice_addr(&cuda.slice, stream);
        addrs.push(base + (layout.start_offset() * t.dtype().size_in_bytes()) as u64);
        records.push(record);
    }
    let out = f(&addrs);
    drop(records);
    Ok(out)
}

fn slice_addr<'a>(slice: &'a CudaStorageSlice, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
    use CudaStorageSlice as S;
    match slice {
        S::U8(s) | S::F6E2M3(s) | S::F6E3M2(s) | S::F4(s) | S::F8E8M0(s) => s.device_ptr(stream),
        S::U32(s) => s.device_ptr(stream),
        S::I16(s) => s.device_ptr(stream),
        S::I32(s) => s.device_ptr(stream),
        S::I64(s) => s.device_ptr(stream),
        S::BF16(s) => s.device_ptr(stream),
        S::F16(s) => s.device_ptr(stream),
        S::F32(s) => s.device_ptr(stream),
        S::F64(s) => s.device_ptr(stream),
        S::F8E4M3(s) => s.device_ptr(stream),
    }
}

fn driver_err(group: &str, e: impl std::fmt::Debug) -> CommError {
    CommError::Candle(candle_core::Error::Msg(format!(
        "CUDA error on group '{group}': {e:?}"
    )))
}

/// NCCL's element type for reductions (data movement ships bytes and accepts every dtype).
fn reduce_type(dtype: DType) -> Option<nccl::ncclDataType_t> {
    use nccl::ncclDataType_t as T;
    Some(match dtype {
        DType::U8 => T::ncclUint8,
        DType::U32 => T::ncclUint32,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        DType::BF16 => T::ncclBfloat16,
        DType::F16 => T::ncclFloat16,
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        _ => return None,
    })
}

fn reduce_op(op: ReduceOp) -> nccl::ncclRedOp_t {
    match op {
        ReduceOp::Sum => nccl::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => nccl::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => nccl::ncclRedOp_t::ncclMax,
        ReduceOp::Min => nccl::ncclRedOp_t::ncclMin,
    }
}

fn dtype_code(d: DType) -> u64 {
    DTYPES
        .iter()
        .position(|&x| x == d)
        .map_or(u64::MAX, |i| i as u64)
}

const DTYPES: [DType; 9] = [
    DType::U8,
    DType::U32,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F64,
];

const OPS: [OpKind; 11] = OpKind::ALL;

fn describe_header(h: &[u64]) -> String {
    let op = OPS
        .get(h[0] as usize)
        .map_or("?".to_string(), |o| o.to_string());
    let dtype = DTYPES
        .get(h[1] as usize)
        .map_or("?".to_string(), |d| format!("{d:?}"));
    let root = if h[3] == u64::MAX {
        String::new()
    } else {
        format!(", root {}", h[3])
    };
    format!("{op}({dtype}, {} elements{root})", h[2])
}

/// Abort the group after a stalled op; later ops fail fast with a timeout naming it.
fn abort(shared: &Shared, op: OpKind, seq: u64) {
    if shared.aborted.swap(true, Ordering::SeqCst) {
        return;
    }
    *shared.poisoned.lock().unwrap_or_else(|p| p.into_inner()) = Some((op, seq));
    tracing::error!(
        group = %shared.name,
        rank = shared.rank,
        seq,
        "{op} did not finish within {:?}; aborting the NCCL communicator",
        shared.timeout
    );
    // SAFETY: NCCL documents ncclCommAbort as safe to call while another thread is blocked in
    // the communicator; `aborted` guarantees it runs once and Drop then skips ncclCommDestroy.
    let _ = unsafe { nccl::ncclCommAbort(shared.comm.0) };
}

/// Polls the `done` events of the ops in flight; aborts the group when one is older than the
/// timeout. Exits when the group is dropped.
fn spawn_watchdog(shared: Weak<Shared>) {
    let spawned = std::thread::Builder::new()
        .name("nccl-watchdog".into())
        .spawn(move || loop {
            std::thread::sleep(Duration::from_millis(20));
            let Some(shared) = shared.upgrade() else {
                return;
            };
            if shared.aborted.load(Ordering::SeqCst) {
                return;
            }
            if shared.ctx.bind_to_thread().is_err() {
                return;
            }
            let mut stalled = None;
            {
                let mut q = shared.in_flight.lock().unwrap_or_else(|p| p.into_inner());
                while let Some(front) = q.front() {
                    if front.done.is_complete() {
                        q.pop_front();
                    } else {
                        if front.issued.elapsed() > shared.timeout {
                            stalled = Some((front.op, front.seq));
                        }
                        break;
                    }
                }
            }
            if let Some((op, seq)) = stalled {
                abort(&shared, op, seq);
                return;
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("no NCCL watchdog thread ({e}): a stalled collective will hang");
    }
}

/// The handle of an op in flight on the communication stream.
struct NcclWork<T> {
    done: Option<Arc<CudaEvent>>,
    compute: Arc<CudaStream>,
    /// Inputs and outputs: alive until the compute stream is ordered after `done`.
    keep: Vec<Tensor>,
    result: Option<T>,
    tracer: Tracer,
    event: TraceEvent,
}

impl<T> NcclWork<T> {
    /// Make the compute stream wait for the op (the host does not block).
    fn order_compute(&mut self) -> Result<()> {
        if let Some(done) = self.done.take() {
            self.compute
                .wait(&done)
                .map_err(|e| driver_err(&self.event.group, e))?;
            if self.tracer.is_recording() {
                // Exact end time for traces; only when recording, since it blocks the host.
                done.synchronize()
                    .map_err(|e| driver_err(&self.event.group, e))?;
            }
            self.event.end_us = self.tracer.now_us();
            self.tracer.record(self.event.clone());
        }
        self.keep.clear();
        Ok(())
    }
}

impl<T: Send> PendingWork<T> for NcclWork<T> {
    fn wait(mut self: Box<Self>) -> Result<T> {
        self.order_compute()?;
        self.result.take().ok_or_else(|| {
            CommError::Candle(candle_core::Error::Msg("NCCL work waited twice".into()))
        })
    }

    fn is_done(&self) -> bool {
        self.done.as_ref().is_none_or(|d| d.is_complete())
    }
}

impl<T> Drop for NcclWork<T> {
    fn drop(&mut self) {
        // A discarded handle still orders the compute stream after the op, so the buffers it
        // holds are not freed (stream-ordered) while NCCL uses them.
        let _ = self.order_compute();
    }
}

impl NcclGroup {
    fn reduce_type(&self, op: OpKind, dtype: DType) -> Result<nccl::ncclDataType_t> {
        reduce_type(dtype)
            .ok_or_else(|| self.invalid(op, format!("NCCL cannot reduce {dtype:?} tensors")))
    }

    fn root_ok(&self, op: OpKind, root: usize) -> Result<()> {
        if root >= self.shared.size {
            return Err(self.invalid(
                op,
                format!(
                    "root {root} is not a rank of this group of {}",
                    self.shared.size
                ),
            ));
        }
        Ok(())
    }

    fn all_reduce_impl(&self, x: &Tensor, op: ReduceOp) -> Result<Work> {
        let k = OpKind::AllReduce;
        let x = self.input(k, x)?;
        let ty = self.reduce_type(k, x.dtype())?;
        self.check_header(k, x.dtype(), x.elem_count(), None)?;
        let out = uninit(x.shape(), x.dtype(), x.device())?; // same shape as x, NCCL writes it all
        let (n, count, bytes) = (self.shared.size as u64, x.elem_count(), nbytes(&x));
        Ok(self.launch(
            k,
            bytes,
            2 * (n - 1) * bytes / n,
            None,
            vec![x, out.clone()],
            out,
            {
                move |comm, stream, a| {
                    // SAFETY: a[0] and a[1] address `count` elements of type `ty` on this device.
                    check(unsafe {
                        nccl::ncclAllReduce(
                            a[0] as _,
                            a[1] as _,
                            count,
                            ty,
                            reduce_op(op),
                            comm,
                            stream,
                        )
                    })
                }
            },
        ))
    }

    fn reduce_impl(&self, x: &Tensor, root: usize, op: ReduceOp) -> Result<Work> {
        let k = OpKind::Reduce;
        self.root_ok(k, root)?;
        let x = self.input(k, x)?;
        let ty = self.reduce_type(k, x.dtype())?;
        self.check_header(k, x.dtype(), x.elem_count(), Some(root))?;
        let is_root = self.shared.rank == root;
        // The root receives into a new tensor; the others' result is their input, unchanged.
        let out = if is_root {
            uninit(x.shape(), x.dtype(), x.device())? // NCCL writes all of it on the root
        } else {
            x.clone()
        };
        let (count, bytes) = (x.elem_count(), nbytes(&x));
        let sent = if is_root { 0 } else { bytes };
        Ok(self.launch(
            k,
            bytes,
            sent,
            Some(root),
            // A non-root's result is its input: one buffer (its storage is locked only once).
            if is_root {
                vec![x, out.clone()]
            } else {
                vec![x]
            },
            out,
            move |comm, stream, a| {
                // SAFETY: a[0] (input) and the root's a[1] (output) hold `count` elements of
                // `ty`; NCCL writes the receive buffer on the root only.
                let recv = if is_root { a[1] } else { a[0] };
                check(unsafe {
                    nccl::ncclReduce(
                        a[0] as _,
                        recv as _,
                        count,
                        ty,
                        reduce_op(op),
                        root as i32,
                        comm,
                        stream,
                    )
                })
            },
        ))
    }

    fn broadcast_impl(&self, x: &Tensor, root: usize) -> Result<Work> {
        let k = OpKind::Broadcast;
        self.root_ok(k, root)?;
        let x = self.input(k, x)?;
        self.check_header(k, x.dtype(), x.elem_count(), Some(root))?;
        let out = uninit(x.shape(), x.dtype(), x.device())?; // shape of x, values of the root's x
        let bytes = nbytes(&x);
        let sent = if self.shared.rank == root { bytes } else { 0 };
        Ok(self.launch(
            k,
            bytes,
            sent,
            Some(root),
            vec![x, out.clone()],
            out,
            move |comm, stream, a| {
                // SAFETY: both buffers hold `bytes` bytes; the root reads a[0], every rank writes a[1].
                unsafe { broadcast_bytes(a[0], a[1], bytes as usize, root, comm, stream) }
            },
        ))
    }

    /// Everyone's (rows, elements per row, dtype), exchanged on the host.
    ///
    /// This is a host rendezvous: the host waits until every rank issued the op and this
    /// group's earlier ops finished on the GPU. A group of one skips it.
    fn row_counts(&self, k: OpKind, x: &Tensor, root: Option<usize>) -> Result<Vec<usize>> {
        let (rows, per_row) = self.rows(k, x)?;
        if self.shared.size == 1 {
            return Ok(vec![rows]);
        }
        let mine = [
            k as u64,
            dtype_code(x.dtype()),
            per_row as u64,
            root.map_or(u64::MAX, |r| r as u64),
        ];
        let all = self.exchange_host(k, &[mine[0], mine[1], mine[2], mine[3], rows as u64])?;
        let mut counts = Vec::with_capacity(all.len());
        for (peer, theirs) in all.iter().enumerate() {
            if theirs[..4] != mine {
                return Err(CommError::Mismatch {
                    group: self.name().to_string(),
                    rank: self.shared.rank,
                    peer,
                    mine: format!("{} with {per_row} elements per row", describe_header(&mine)),
                    theirs: format!(
                        "{} with {} elements per row",
                        describe_header(&theirs[..4]),
                        theirs[2]
                    ),
                });
            }
            counts.push(theirs[4] as usize);
        }
        Ok(counts)
    }

    fn all_gather_impl(&self, x: &Tensor) -> Result<Work> {
        let k = OpKind::AllGather;
        let x = self.input(k, x)?;
        let rows = self.row_counts(k, &x, None)?;
        let (_, per_row) = self.rows(k, &x)?;
        let total: usize = rows.iter().sum();
        let out = zeros_with_rows(&x, total)?; // (Σ d_r, ...)
        let row_bytes = per_row * x.dtype().size_in_bytes();
        let bytes = nbytes(&x);
        let sent = bytes * (self.shared.size as u64 - 1);
        let even = rows.iter().all(|&r| r == rows[0]);
        Ok(self.launch(
            k,
            bytes,
            sent,
            None,
            vec![x, out.clone()],
            out,
            move |comm, stream, a| {
                if even {
                    // SAFETY: a[0] holds rows[0] rows, a[1] holds n times as many.
                    return check(unsafe {
                        nccl::ncclAllGather(
                            a[0] as _,
                            a[1] as _,
                            rows[0] * row_bytes,
                            nccl::ncclDataType_t::ncclUint8,
                            comm,
                            stream,
                        )
                    });
                }
                // Uneven: rank r broadcasts its rows straight to their offset in everyone's output.
                group(|| {
                    let mut offset = 0u64;
                    for (r, &d) in rows.iter().enumerate() {
                        // SAFETY: rank r's a[0] holds d rows; a[1] + offset has room for them.
                        unsafe {
                            broadcast_bytes(a[0], a[1] + offset, d * row_bytes, r, comm, stream)
                        }?;
                        offset += (d * row_bytes) as u64;
                    }
                    Ok(())
                })
            },
        ))
    }

    fn reduce_scatter_impl(&self, x: &Tensor, op: ReduceOp) -> Result<Work> {
        let k = OpKind::ReduceScatter;
        let x = self.input(k, x)?;
        let ty = self.reduce_type(k, x.dtype())?;
        self.check_header(k, x.dtype(), x.elem_count(), None)?;
        let (d, per_row) = self.rows(k, &x)?;
        let (n, me) = (self.shared.size, self.shared.rank);
        let chunk = d.div_ceil(n);
        // Pad so that chunk r starts at row r * chunk: NCCL needs equal chunks.
        let padded = if d % n == 0 {
            x.clone()
        } else {
            pad_chunks(&x, n)?
        }; // (n * chunk, ...)
        let out = zeros_with_rows(&x, chunk)?; // (chunk, ...)
        let mine = chunk_range(d, n, me);
        let result = out.narrow(0, 0, mine.len())?; // (|chunk_range(D, n, r)|, ...)
        let bytes = nbytes(&x);
        let sent = (n as u64 - 1) * bytes / n as u64;
        let count = chunk * per_row;
        Ok(self.launch(
            k,
            bytes,
            sent,
            None,
            vec![padded, out],
            result,
            move |comm, stream, a| {
                // SAFETY: a[0] holds n * count elements of `ty`, a[1] holds count.
                check(unsafe {
                    nccl::ncclReduceScatter(
                        a[0] as _,
                        a[1] as _,
                        count,
                        ty,
                        reduce_op(op),
                        comm,
                        stream,
                    )
                })
            },
        ))
    }

    fn scatter_impl(&self, x: &Tensor, root: usize) -> Result<Work> {
        let k = OpKind::Scatter;
        self.root_ok(k, root)?;
        let x = self.input(k, x)?;
        let (n, me) = (self.shared.size, self.shared.rank);
        // The others learn the root's shape: (op, dtype, rank count, dims...). Only the root's
        // shape matters; a root with an unusable shape still joins the exchange (rank count
        // u64::MAX), so that every rank fails together instead of waiting for it.
        let root_dims_ok = (1..=MAX_DIMS).contains(&x.rank());
        let mut header = vec![k as u64, dtype_code(x.dtype()), 0];
        if me == root {
            header[2] = if root_dims_ok {
                x.rank() as u64
            } else {
                u64::MAX
            };
            if root_dims_ok {
                header.extend(x.dims().iter().map(|&d| d as u64));
            }
        }
        header.resize(3 + MAX_DIMS, 0);
        let all = self.exchange_host(k, &header)?;
        let root_header = &all[root];
        if root_header[..2] != header[..2] {
            return Err(CommError::Mismatch {
                group: self.name().to_string(),
                rank: me,
                peer: root,
                mine: format!("{k}({:?})", x.dtype()),
                theirs: describe_header(&[root_header[0], root_header[1], 0, root as u64]),
            });
        }
        if root_header[2] == u64::MAX {
            return Err(self.invalid(
                k,
                format!("the root (rank {root}) needs a tensor of 1 to {MAX_DIMS} dimensions"),
            ));
        }
        let dims: Vec<usize> = root_header[3..3 + root_header[2] as usize]
            .iter()
            .map(|&d| d as usize)
            .collect();
        let d = dims[0];
        let row_bytes = dims[1..].iter().product::<usize>() * x.dtype().size_in_bytes();
        let mut shape = dims.clone();
        shape[0] = chunk_range(d, n, me).len();
        let out = Tensor::zeros(shape, x.dtype(), x.device())?; // rows chunk_range(D, n, r)
        let bytes = nbytes(&x);
        let sent = if me == root { bytes } else { 0 };
        Ok(self.launch(
            k,
            bytes,
            sent,
            Some(root),
            vec![x, out.clone()],
            out,
            move |comm, stream, a| {
                group(|| {
                    if me == root {
                        for p in 0..n {
                            let c = chunk_range(d, n, p);
                            let at = a[0] + (c.start * row_bytes) as u64;
                            // SAFETY: rows c of the root's input lie within a[0].
                            unsafe { send_bytes(at, c.len() * row_bytes, p, comm, stream) }?;
                        }
                    }
                    let len = chunk_range(d, n, me).len() * row_bytes;
                    // SAFETY: a[1] holds exactly this rank's chunk.
                    unsafe { recv_bytes(a[1], len, root, comm, stream) }
                })
            },
        ))
    }

    fn gather_impl(&self, x: &Tensor, root: usize) -> Result<Work> {
        let k = OpKind::Gather;
        self.root_ok(k, root)?;
        let x = self.input(k, x)?;
        let rows = self.row_counts(k, &x, Some(root))?;
        let (_, per_row) = self.rows(k, &x)?;
        let row_bytes = per_row * x.dtype().size_in_bytes();
        let me = self.shared.rank;
        let out = if me == root {
            zeros_with_rows(&x, rows.iter().sum())? // (Σ d_r, ...)
        } else {
            x.clone()
        };
        let bytes = nbytes(&x);
        let sent = if me == root { 0 } else { bytes };
        Ok(self.launch(
            k,
            bytes,
            sent,
            Some(root),
            if me == root {
                vec![x, out.clone()]
            } else {
                vec![x]
            },
            out,
            move |comm, stream, a| {
                group(|| {
                    // SAFETY: a[0] holds rows[me] rows.
                    unsafe { send_bytes(a[0], rows[me] * row_bytes, root, comm, stream) }?;
                    if me == root {
                        let mut offset = 0u64;
                        for (p, &d) in rows.iter().enumerate() {
                            // SAFETY: a[1] + offset has room for rank p's d rows.
                            unsafe { recv_bytes(a[1] + offset, d * row_bytes, p, comm, stream) }?;
                            offset += (d * row_bytes) as u64;
                        }
                    }
                    Ok(())
                })
            },
        ))
    }

    fn all_to_all_impl(&self, x: &Tensor, send: &[usize], recv: &[usize]) -> Result<Work> {
        let k = OpKind::AllToAll;
        let x = self.input(k, x)?;
        let n = self.shared.size;
        let (d, per_row) = self.rows(k, &x)?;
        if send.len() != n || recv.len() != n {
            return Err(self.invalid(
                k,
                format!(
                    "{} send and {} recv splits for a group of {n}",
                    send.len(),
                    recv.len()
                ),
            ));
        }
        if send.iter().sum::<usize>() != d {
            return Err(self.invalid(
                k,
                format!("send splits {send:?} do not add up to the {d} input rows"),
            ));
        }
        self.check_header(k, x.dtype(), per_row, None)?;
        let out = zeros_with_rows(&x, recv.iter().sum())?; // (Σ recv, ...)
        let row_bytes = per_row * x.dtype().size_in_bytes();
        let me = self.shared.rank;
        let sent = send
            .iter()
            .enumerate()
            .filter(|&(p, _)| p != me)
            .map(|(_, &s)| (s * row_bytes) as u64)
            .sum();
        let (send, recv) = (send.to_vec(), recv.to_vec());
        Ok(self.launch(
            k,
            nbytes(&x),
            sent,
            None,
            vec![x, out.clone()],
            out,
            move |comm, stream, a| {
                group(|| {
                    let (mut so, mut ro) = (0u64, 0u64);
                    for p in 0..n {
                        if send[p] > 0 {
                            // SAFETY: rows [so, so + send[p]) of the input.
                            unsafe { send_bytes(a[0] + so, send[p] * row_bytes, p, comm, stream) }?;
                        }
                        if recv[p] > 0 {
                            // SAFETY: the output has room for recv[p] rows at ro.
                            unsafe { recv_bytes(a[1] + ro, recv[p] * row_bytes, p, comm, stream) }?;
                        }
                        so += (send[p] * row_bytes) as u64;
                        ro += (recv[p] * row_bytes) as u64;
                    }
                    Ok(())
                })
            },
        ))
    }

    fn send_impl(&self, x: &Tensor, dst: usize) -> Result<Work<()>> {
        let k = OpKind::Send;
        self.root_ok(k, dst)?;
        let x = self.input(k, x)?;
        let bytes = nbytes(&x);
        Ok(self.launch(
            k,
            bytes,
            bytes,
            Some(dst),
            vec![x],
            (),
            move |comm, stream, a| {
                // SAFETY: a[0] holds `bytes` bytes.
                unsafe { send_bytes(a[0], bytes as usize, dst, comm, stream) }
            },
        ))
    }

    fn recv_impl(&self, src: usize, shape: &Shape, dtype: DType) -> Result<Work> {
        let k = OpKind::Recv;
        self.root_ok(k, src)?;
        let out = uninit(shape, dtype, &self.device)?; // NCCL writes all of it
        let bytes = nbytes(&out);
        Ok(self.launch(
            k,
            bytes,
            0,
            Some(src),
            vec![out.clone()],
            out,
            move |comm, stream, a| {
                // SAFETY: a[0] has room for `bytes` bytes.
                unsafe { recv_bytes(a[0], bytes as usize, src, comm, stream) }
            },
        ))
    }
}

/// At most this many dimensions travel in a scatter's shape header.
const MAX_DIMS: usize = 8;

fn nbytes(x: &Tensor) -> u64 {
    (x.elem_count() * x.dtype().size_in_bytes()) as u64
}

// The byte-level point-to-point calls the ops above are made of. Every buffer is moved as raw
// bytes (`ncclUint8`): only reductions need NCCL to know the element type.

/// `ncclSend` of `len` bytes at device address `addr` to rank `peer`.
///
/// # Safety
/// `addr` must address at least `len` bytes on this communicator's device, alive until `stream`
/// has run the send.
unsafe fn send_bytes(
    addr: u64,
    len: usize,
    peer: usize,
    comm: nccl::ncclComm_t,
    stream: nccl::cudaStream_t,
) -> std::result::Result<(), String> {
    let u8t = nccl::ncclDataType_t::ncclUint8;
    // SAFETY: the caller guarantees the buffer.
    check(unsafe { nccl::ncclSend(addr as _, len, u8t, peer as i32, comm, stream) })
}

/// `ncclRecv` of `len` bytes from rank `peer` into device address `addr`.
///
/// # Safety
/// As [`send_bytes`], with `addr` writable.
unsafe fn recv_bytes(
    addr: u64,
    len: usize,
    peer: usize,
    comm: nccl::ncclComm_t,
    stream: nccl::cudaStream_t,
) -> std::result::Result<(), String> {
    let u8t = nccl::ncclDataType_t::ncclUint8;
    // SAFETY: the caller guarantees the buffer.
    check(unsafe { nccl::ncclRecv(addr as _, len, u8t, peer as i32, comm, stream) })
}

/// `ncclBroadcast` of `len` bytes: `root` reads them at `src`, every rank writes them at `dst`.
///
/// # Safety
/// `src` (on the root) and `dst` (on every rank) must address at least `len` bytes on this
/// communicator's device, alive until `stream` has run the broadcast.
unsafe fn broadcast_bytes(
    src: u64,
    dst: u64,
    len: usize,
    root: usize,
    comm: nccl::ncclComm_t,
    stream: nccl::cudaStream_t,
) -> std::result::Result<(), String> {
    let u8t = nccl::ncclDataType_t::ncclUint8;
    // SAFETY: the caller guarantees the buffers.
    check(unsafe { nccl::ncclBroadcast(src as _, dst as _, len, u8t, root as i32, comm, stream) })
}

/// Run the NCCL calls `f` makes as one group (ncclGroupStart / ncclGroupEnd), so that the sends
/// and receives of one op progress together instead of deadlocking on each other.
fn group(f: impl FnOnce() -> std::result::Result<(), String>) -> std::result::Result<(), String> {
    // SAFETY: group calls only mark the start and end of a batch on this thread.
    check(unsafe { nccl::ncclGroupStart() })?;
    let r = f();
    // The group is always closed, even after an error, or the thread's NCCL state is left open.
    let end = check(unsafe { nccl::ncclGroupEnd() });
    r.and(end)
}

/// A tensor whose every element the collective writes: allocated without the memset of
/// `Tensor::zeros`, which on a 1 GB all-reduce costs about a tenth of the transfer.
fn uninit(shape: &Shape, dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
    use candle_core::backend::BackendDevice;
    match device {
        Device::Cuda(d) => {
            // SAFETY: the caller hands the tensor to a collective that writes every element
            // before anything reads it (stream order: the compute stream waits on its event).
            let s = unsafe { d.alloc_uninit(shape, dtype)? };
            Ok(Tensor::from_storage(
                Storage::Cuda(s),
                shape.clone(),
                candle_core::op::BackpropOp::none(),
                false,
            ))
        }
        other => Tensor::zeros(shape, dtype, other),
    }
}

/// Zeros of `x`'s dtype, device and row shape, with `rows` rows: `(rows, ...)`.
fn zeros_with_rows(x: &Tensor, rows: usize) -> candle_core::Result<Tensor> {
    let mut shape = x.dims().to_vec();
    shape[0] = rows;
    Tensor::zeros(shape, x.dtype(), x.device())
}

/// Rows `chunk_range(D, n, r)` of `x` moved to rows `[r * c, r * c + len)` of a zero tensor of
/// `n * c` rows, `c = ceil(D / n)`: equal chunks for NCCL's reduce-scatter.
fn pad_chunks(x: &Tensor, n: usize) -> candle_core::Result<Tensor> {
    let d = x.dim(0)?;
    let c = d.div_ceil(n);
    let mut parts = Vec::with_capacity(2 * n);
    for r in 0..n {
        let range = chunk_range(d, n, r);
        parts.push(x.narrow(0, range.start, range.len())?); // (len_r, ...)
        if range.len() < c {
            parts.push(zeros_with_rows(x, c - range.len())?); // (c - len_r, ...)
        }
    }
    Tensor::cat(&parts, 0) // (n * c, ...)
}

fn or_error<T: Send + 'static>(r: Result<Work<T>>) -> Work<T> {
    r.unwrap_or_else(|e| Work::ready(Err(e)))
}

impl Communicator for NcclGroup {
    fn rank(&self) -> usize {
        self.shared.rank
    }
    fn size(&self) -> usize {
        self.shared.size
    }
    fn name(&self) -> &str {
        &self.shared.name
    }
    fn global_ranks(&self) -> &[usize] {
        &self.global_ranks
    }
    fn device(&self) -> &Device {
        &self.device
    }
    fn tracer(&self) -> &Tracer {
        &self.tracer
    }

    fn all_reduce_async(&self, x: &Tensor, op: ReduceOp) -> Work {
        or_error(self.all_reduce_impl(x, op))
    }
    fn reduce_async(&self, x: &Tensor, root: usize, op: ReduceOp) -> Work {
        or_error(self.reduce_impl(x, root, op))
    }
    fn broadcast_async(&self, x: &Tensor, root: usize) -> Work {
        or_error(self.broadcast_impl(x, root))
    }
    fn all_gather_async(&self, x: &Tensor) -> Work {
        or_error(self.all_gather_impl(x))
    }
    fn reduce_scatter_async(&self, x: &Tensor, op: ReduceOp) -> Work {
        or_error(self.reduce_scatter_impl(x, op))
    }
    fn scatter_async(&self, x: &Tensor, root: usize) -> Work {
        or_error(self.scatter_impl(x, root))
    }
    fn gather_async(&self, x: &Tensor, root: usize) -> Work {
        or_error(self.gather_impl(x, root))
    }
    fn all_to_all_async(&self, x: &Tensor, send_splits: &[usize], recv_splits: &[usize]) -> Work {
        or_error(self.all_to_all_impl(x, send_splits, recv_splits))
    }
    fn send_async(&self, x: &Tensor, dst: usize) -> Work<()> {
        or_error(self.send_impl(x, dst))
    }
    fn recv_async(&self, src: usize, shape: &Shape, dtype: DType) -> Work {
        or_error(self.recv_impl(src, shape, dtype))
    }
    /// Returns on the host once every rank reached it (a host rendezvous over NCCL) and every op
    /// this group issued before it has finished on the GPU: a timing point for benchmarks.
    fn barrier_async(&self) -> Work<()> {
        Work::ready(
            self.exchange_host(OpKind::Barrier, &[OpKind::Barrier as u64])
                .map(|_| ()),
        )
    }
}

/// These tests need a CUDA GPU: `scripts/gpu-test.sh` runs them on one. One GPU checks every
/// collective of a group of one against its closed form and the stream ordering; two or more
/// GPUs (one thread per GPU) check the multi-rank closed forms, uneven splits included.
#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::cuda_backend::cudarc::driver::CudaContext;

    fn gpu(ordinal: usize) -> Device {
        Device::new_cuda(ordinal).expect("these tests need a CUDA GPU")
    }

    fn single() -> NcclBackend {
        NcclBackend::new(gpu(0), 0, 1, None, NcclOptions::default()).expect("NCCL world of one")
    }

    fn host(t: &Tensor) -> Vec<f32> {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    }

    #[test]
    fn nccl_is_loaded() {
        let v = NcclBackend::nccl_version().unwrap();
        assert!(
            v >= 21000,
            "NCCL {v} is older than 2.10 (ncclAvg needs 2.10)"
        );
    }

    #[test]
    fn group_of_one_runs_every_collective() {
        let backend = single();
        let g = backend.world();
        let dev = backend.device();
        assert_eq!(
            (g.rank(), g.size(), g.global_ranks()),
            (0, 1, &[0usize][..])
        );
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            // (7, 3): 7 rows do not split evenly, so shapes are not trivially square.
            let x = Tensor::arange(0f32, 21., &dev)
                .unwrap()
                .reshape((7, 3))
                .unwrap();
            let x = x.to_dtype(dtype).unwrap();
            let want = host(&x);
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                assert_eq!(
                    host(&g.all_reduce(&x, op).unwrap()),
                    want,
                    "all_reduce {op:?} {dtype:?}"
                );
                assert_eq!(
                    host(&g.reduce(&x, 0, op).unwrap()),
                    want,
                    "reduce {op:?} {dtype:?}"
                );
                assert_eq!(
                    host(&g.reduce_scatter(&x, op).unwrap()),
                    want,
                    "reduce_scatter {op:?}"
                );
            }
            assert_eq!(
                host(&g.broadcast(&x, 0).unwrap()),
                want,
                "broadcast {dtype:?}"
            );
            let ag = g.all_gather(&x).unwrap();
            assert_eq!(
                (ag.dims(), host(&ag)),
                (&[7usize, 3][..], want.clone()),
                "all_gather"
            );
            assert_eq!(host(&g.scatter(&x, 0).unwrap()), want, "scatter {dtype:?}");
            assert_eq!(host(&g.gather(&x, 0).unwrap()), want, "gather {dtype:?}");
            assert_eq!(
                host(&g.all_to_all(&x, &[7], &[7]).unwrap()),
                want,
                "all_to_all"
            );
            g.barrier().unwrap();
        }
        // Integer dtypes reduce exactly.
        let xi = Tensor::new(&[[1u32, 2], [3, 4]], &dev).unwrap();
        let yi = g.all_reduce(&xi, ReduceOp::Sum).unwrap();
        assert_eq!(yi.to_vec2::<u32>().unwrap(), vec![vec![1, 2], vec![3, 4]]);
        let xl = Tensor::new(&[-5i64, 1 << 40], &dev).unwrap();
        assert_eq!(
            g.all_reduce(&xl, ReduceOp::Max)
                .unwrap()
                .to_vec1::<i64>()
                .unwrap(),
            vec![-5, 1 << 40]
        );
    }

    #[test]
    fn bad_arguments_are_named() {
        let backend = single();
        let g = backend.world();
        let x = Tensor::zeros((4, 2), DType::F32, &backend.device()).unwrap();
        let e = g.broadcast(&x, 3).unwrap_err().to_string();
        assert!(e.contains("root 3") && e.contains("world"), "{e}");
        let e = g.all_to_all(&x, &[3], &[4]).unwrap_err().to_string();
        assert!(e.contains("[3]") && e.contains("4 input rows"), "{e}");
        let cpu = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
        let e = g.all_reduce(&cpu, ReduceOp::Sum).unwrap_err().to_string();
        assert!(e.contains("Cpu"), "{e}");
    }

    /// The collective sees what the compute stream wrote just before it, and compute issued
    /// after `wait()` sees the collective's result, with no host synchronisation in between.
    #[test]
    fn async_ops_are_ordered_against_the_compute_stream() {
        let backend = single();
        let g = backend.world();
        let dev = backend.device();
        let n = 1 << 24; // 64 MiB of f32: long enough for the streams to really run concurrently
        let a = Tensor::ones(n, DType::F32, &dev).unwrap();
        let mut expected = 1f32;
        let mut x = a.clone();
        for step in 0..5 {
            x = ((x * 3.0).unwrap() - 1.0).unwrap(); // written on the compute stream
            expected = expected * 3.0 - 1.0;
            let work = g.all_reduce_async(&x, ReduceOp::Sum);
            // Compute issued while the op is in flight.
            let busy = a.affine(2.0, 0.5).unwrap();
            x = work.wait().unwrap();
            let got = x.sum_all().unwrap().to_scalar::<f32>().unwrap();
            assert_eq!(got, expected * n as f32, "step {step}");
            assert_eq!(busy.max(0).unwrap().to_scalar::<f32>().unwrap(), 2.5);
        }
        let t = g.tracer();
        t.set_recording(true);
        let w = g.all_gather_async(&x);
        assert_eq!(w.wait().unwrap().dims(), &[n]);
        let ev = t.events();
        assert_eq!(ev.len(), 1);
        assert_eq!((ev[0].op, ev[0].bytes), (OpKind::AllGather, 4 * n as u64));
        assert!(ev[0].end_us >= ev[0].start_us);
    }

    #[test]
    fn padding_puts_each_chunk_at_a_multiple_of_the_chunk_size() {
        let x = Tensor::arange(0f32, 7., &Device::Cpu)
            .unwrap()
            .reshape((7, 1))
            .unwrap();
        let p = pad_chunks(&x, 3).unwrap(); // chunks 3, 2, 2 -> rows of 3 each
        assert_eq!(
            p.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![0., 1., 2., 3., 4., 0., 5., 6., 0.]
        );
    }

    /// Every GPU of the machine is a rank (one thread each). Runs only with two or more GPUs.
    #[test]
    fn ranks_on_several_gpus_match_closed_forms() {
        let n = CudaContext::device_count().unwrap_or(0) as usize;
        if n < 2 {
            eprintln!("skipped: {n} GPU(s), the multi-rank test needs 2 or more");
            return;
        }
        let exchange: Arc<dyn IdExchange> = Arc::new(InProcessExchange::default());
        std::thread::scope(|s| {
            for r in 0..n {
                let exchange = exchange.clone();
                s.spawn(move || {
                    let b = NcclBackend::new(gpu(r), r, n, Some(exchange), NcclOptions::default())
                        .unwrap();
                    let g = b.world();
                    let dev = b.device();
                    let rows = 2 * n + 1; // uneven over n ranks
                                          // Rank r holds r + 1 rows of value r (all_gather / gather: uneven counts).
                    let mine = Tensor::full(r as f32, (r + 1, 2), &dev).unwrap();
                    let want: Vec<f32> = (0..n).flat_map(|p| vec![p as f32; 2 * (p + 1)]).collect();
                    assert_eq!(host(&g.all_gather(&mine).unwrap()), want, "all_gather");
                    let gathered = g.gather(&mine, n - 1).unwrap();
                    if r == n - 1 {
                        assert_eq!(host(&gathered), want, "gather");
                    }
                    let x = Tensor::arange(0f32, rows as f32, &dev)
                        .unwrap()
                        .affine(1.0, r as f64)
                        .unwrap();
                    let sum: Vec<f32> = (0..rows)
                        .map(|i| (0..n).map(|p| (i + p) as f32).sum())
                        .collect();
                    assert_eq!(
                        host(&g.all_reduce(&x, ReduceOp::Sum).unwrap()),
                        sum,
                        "all_reduce"
                    );
                    let c = chunk_range(rows, n, r);
                    assert_eq!(
                        host(&g.reduce_scatter(&x, ReduceOp::Sum).unwrap()),
                        sum[c.clone()].to_vec()
                    );
                    let from_root: Vec<f32> = (0..rows).map(|i| i as f32).collect();
                    assert_eq!(host(&g.broadcast(&x, 0).unwrap()), from_root, "broadcast");
                    assert_eq!(
                        host(&g.scatter(&x, 0).unwrap()),
                        from_root[c].to_vec(),
                        "scatter"
                    );
                    // all_to_all: rank r sends p + 1 rows of value 10 r + p to rank p.
                    let send: Vec<usize> = (0..n).map(|p| p + 1).collect();
                    let recv = vec![r + 1; n];
                    let parts: Vec<Tensor> = (0..n)
                        .map(|p| Tensor::full((10 * r + p) as f32, p + 1, &dev).unwrap())
                        .collect();
                    let y = g
                        .all_to_all(&Tensor::cat(&parts, 0).unwrap(), &send, &recv)
                        .unwrap();
                    let want: Vec<f32> = (0..n)
                        .flat_map(|p| vec![(10 * p + r) as f32; r + 1])
                        .collect();
                    assert_eq!(host(&y), want, "all_to_all");
                    // A ring of send/recv: even ranks send first, odd ranks receive first
                    // (a send on the communication stream waits for its matching receive).
                    let next = (r + 1) % n;
                    let prev = (r + n - 1) % n;
                    let token = Tensor::full(r as f32, 3, &dev).unwrap();
                    let got = if r % 2 == 0 {
                        g.send(&token, next).unwrap();
                        g.recv(prev, &Shape::from(3), DType::F32).unwrap()
                    } else {
                        let got = g.recv(prev, &Shape::from(3), DType::F32).unwrap();
                        g.send(&token, next).unwrap();
                        got
                    };
                    assert_eq!(host(&got), vec![prev as f32; 3], "send/recv");
                    g.barrier().unwrap();
                });
            }
        });
    }
}
