//! One IPC group: its flag and data buffers (own and mapped), the issue of an op on the
//! communication stream, the watchdog, and the [`Communicator`] methods.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use candle_core::{DType, Device, Shape, Tensor};

use super::driver::{self, DevBuf, IpcHandle};
use super::kernels::{Kernels, Peers};
use super::protocol::{
    grown_capacity, mail_flag, mail_targets, phase_flag, Mail, Phase, WaitMode, FLAG_BYTES,
    FLAG_WORDS, MAX_WORLD, ONE_SHOT_MAX,
};
use crate::communicator::{
    check_in_place, Comm, CommError, Communicator, OpKind, PendingWork, ReduceOp, Result, Work,
};
use crate::nccl::with_device_addrs;
use crate::store::StoreClient;
use crate::trace::{TraceEvent, Tracer};

/// Options of the IPC backend.
#[derive(Debug, Clone)]
pub struct IpcOptions {
    /// An op still unfinished after this long fails, naming the peer it waits for.
    pub timeout: Duration,
    /// How ranks wait for flags (`MTRAIN_IPC_WAIT`, default stream).
    pub wait: WaitMode,
    /// Largest all-reduce (bytes) that runs one-shot; larger ones run two-shot
    /// (`MTRAIN_IPC_ONE_SHOT_MAX`).
    pub one_shot_max: usize,
}

impl Default for IpcOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(300),
            wait: WaitMode::Stream,
            one_shot_max: ONE_SHOT_MAX,
        }
    }
}

impl IpcOptions {
    /// The defaults with `MTRAIN_IPC_WAIT` and `MTRAIN_IPC_ONE_SHOT_MAX` applied.
    pub fn from_env(timeout: Duration) -> Result<Self> {
        let mut o = Self {
            timeout,
            ..Self::default()
        };
        if let Ok(w) = std::env::var("MTRAIN_IPC_WAIT") {
            o.wait = WaitMode::parse(&w).map_err(CommError::Env)?;
        }
        if let Ok(m) = std::env::var("MTRAIN_IPC_ONE_SHOT_MAX") {
            o.one_shot_max = m.parse().map_err(|_| {
                CommError::Env(format!("MTRAIN_IPC_ONE_SHOT_MAX={m:?} is not a byte count"))
            })?;
        }
        Ok(o)
    }
}

/// A buffer of this rank and the same buffer of every peer, mapped here.
struct Shared {
    /// Held for the group's lifetime: the allocation peers map, and the mappings of theirs.
    _own: DevBuf,
    _peers: Vec<Option<DevBuf>>,
    /// Device address of rank q's buffer in this process (own included).
    addr: Vec<u64>,
}

/// What the ops of a group change: the sequence number and the buffers that grow.
struct State {
    seq: u64,
    data: Option<Shared>,
    data_cap: usize,
    /// This rank's mailbox for messages to peer q, and how many it sent there.
    out_box: Vec<Option<DevBuf>>,
    sent: Vec<u64>,
    /// Peer q's mailbox for messages to this rank, mapped, and how many came from it.
    in_box: Vec<Option<DevBuf>>,
    received: Vec<u64>,
    /// Buffers replaced by larger ones: kept until the group is dropped, since work enqueued
    /// before the growth (here or on a peer) may still read them.
    retired: Vec<DevBuf>,
    retired_shared: Vec<Shared>,
}

/// An op on the communication stream that the watchdog watches.
struct InFlight {
    op: OpKind,
    seq: u64,
    issued: Instant,
    done: Arc<CudaEvent>,
    /// (byte offset in this rank's flag buffer, group rank of the writer, target) of each wait.
    waits: Vec<(usize, usize, u64)>,
}

/// What the watchdog and the ops share.
struct Watch {
    in_flight: Mutex<VecDeque<InFlight>>,
    /// (op, seq, this rank, the late peer), global ranks, once an op timed out.
    poisoned: Mutex<Option<(OpKind, u64, usize, usize)>>,
    stop: AtomicBool,
}

/// One process group whose ranks read each other's GPU memory through CUDA IPC.
pub struct IpcGroup {
    name: String,
    rank: usize,
    size: usize,
    global_ranks: Vec<usize>,
    device: Device,
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    stream: Arc<CudaStream>,
    kernels: Arc<Kernels>,
    tracer: Tracer,
    /// The same ranks on the host backend: buffer handles and row counts travel through it.
    host: Comm,
    /// Reductions of dtypes the kernels do not take (f64 loss sums, integer counts): `host`
    /// staged onto the device.
    fallback: Comm,
    /// Mailbox handles travel through the store (one sender, one receiver, no group op),
    /// under keys starting with `key` (the group's name, ranks and creation count).
    store: Option<Arc<StoreClient>>,
    key: String,
    opts: IpcOptions,
    flags: Shared,
    state: Mutex<State>,
    watch: Arc<Watch>,
}

impl std::fmt::Debug for IpcGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "IpcGroup('{}', rank {} of {}, ranks {:?})",
            self.name, self.rank, self.size, self.global_ranks
        )
    }
}

fn cuda_err(group: &str, e: impl std::fmt::Display) -> CommError {
    CommError::Candle(candle_core::Error::Msg(format!(
        "CUDA error on IPC group '{group}': {e}"
    )))
}

impl IpcGroup {
    /// The group of `host`'s ranks on `device`: allocates this rank's flag buffer and maps
    /// every peer's (handles exchanged through `host`), starts the watchdog.
    pub fn new(
        host: Comm,
        store: Option<Arc<StoreClient>>,
        key: String,
        device: &Device,
        opts: IpcOptions,
    ) -> Result<Self> {
        let name = host.name().to_string();
        let (rank, size) = (host.rank(), host.size());
        if size > MAX_WORLD {
            return Err(CommError::InvalidGroup(format!(
                "the IPC backend takes groups of at most {MAX_WORLD} ranks; '{name}' has {size}"
            )));
        }
        let Device::Cuda(cuda) = device else {
            return Err(CommError::InvalidGroup(format!(
                "the IPC backend computes on a CUDA device, got {device:?}"
            )));
        };
        let compute = cuda.cuda_stream();
        let ctx = compute.context().clone();
        let err = |e: String| cuda_err(&name, e);
        let stream = ctx.new_stream().map_err(|e| err(format!("{e:?}")))?;
        let side = ctx.new_stream().map_err(|e| err(format!("{e:?}")))?;
        let kernels = Kernels::get(&ctx).map_err(err)?;
        let own = DevBuf::alloc(&ctx, FLAG_BYTES).map_err(err)?;
        let flags = exchange(&host, &ctx, own, FLAG_BYTES)?;
        let tracer = Tracer::new(host.tracer().epoch());
        tracer.set_recording(host.tracer().is_recording());
        let watch = Arc::new(Watch {
            in_flight: Mutex::new(VecDeque::new()),
            poisoned: Mutex::new(None),
            stop: AtomicBool::new(false),
        });
        spawn_watchdog(
            watch.clone(),
            side,
            flags.addr[rank],
            name.clone(),
            rank,
            host.global_ranks().to_vec(),
            opts.timeout,
        );
        Ok(Self {
            name,
            rank,
            size,
            global_ranks: host.global_ranks().to_vec(),
            device: device.clone(),
            ctx,
            compute,
            stream,
            kernels,
            tracer,
            fallback: crate::staged::staged(host.clone(), device),
            host,
            store,
            key,
            opts,
            flags,
            state: Mutex::new(State {
                seq: 0,
                data: None,
                data_cap: 0,
                out_box: (0..size).map(|_| None).collect(),
                sent: vec![0; size],
                in_box: (0..size).map(|_| None).collect(),
                received: vec![0; size],
                retired: Vec::new(),
                retired_shared: Vec::new(),
            }),
            watch,
        })
    }

    fn err(&self, e: impl std::fmt::Display) -> CommError {
        cuda_err(&self.name, e)
    }

    fn invalid(&self, op: OpKind, msg: String) -> CommError {
        CommError::InvalidArgument {
            op,
            group: self.name.clone(),
            msg,
        }
    }

    fn check_poisoned(&self) -> Result<()> {
        match *self
            .watch
            .poisoned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
        {
            None => Ok(()),
            Some((op, seq, rank, peer)) => Err(CommError::Timeout {
                op,
                group: self.name.clone(),
                seq,
                rank,
                peer,
                timeout_ms: self.opts.timeout.as_millis() as u64,
            }),
        }
    }

    /// `x` contiguous on this group's device.
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

    /// Grow the data buffers of every rank to hold `needed` bytes (called by every rank at
    /// the same op: `needed` is computed from values all ranks know).
    fn ensure_data(&self, st: &mut State, needed: usize) -> Result<()> {
        let cap = grown_capacity(st.data_cap, needed);
        if cap == st.data_cap && st.data.is_some() {
            return Ok(());
        }
        let own = DevBuf::alloc(&self.ctx, cap).map_err(|e| self.err(e))?;
        let shared = exchange(&self.host, &self.ctx, own, cap)?;
        if let Some(old) = st.data.replace(shared) {
            st.retired_shared.push(old);
        }
        st.data_cap = cap;
        Ok(())
    }

    /// Issue one op: order the communication stream after the compute stream, enqueue what
    /// `body` enqueues (given the device addresses of `bufs`), record `done`.
    #[allow(clippy::too_many_arguments)]
    fn issue<T: Send + 'static>(
        &self,
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
        st.seq += 1;
        let seq = st.seq;
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
        let mut waits = Vec::new();
        with_device_addrs(&bufs, &self.stream, |addrs| {
            let mut is = Issue {
                g: self,
                st: &mut st,
                seq,
                waits: &mut waits,
            };
            body(&mut is, addrs)
        })??;
        let done = Arc::new(
            self.stream
                .record_event(None)
                .map_err(|e| self.err(format!("{e:?}")))?,
        );
        self.watch
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(InFlight {
                op,
                seq,
                issued: Instant::now(),
                done: done.clone(),
                waits,
            });
        Ok(IpcWork {
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
            },
            host_blocks: false,
            watch: self.watch.clone(),
            timeout: self.opts.timeout,
        })
    }

    fn work<T: Send + 'static>(r: Result<IpcWork<T>>) -> Work<T> {
        match r {
            Ok(w) => Work::new(Box::new(w)),
            Err(e) => Work::ready(Err(e)),
        }
    }

    /// Everyone's `vals` (same length on every rank), through the host group.
    fn host_gather(&self, vals: &[i64]) -> Result<Vec<Vec<i64>>> {
        let k = vals.len();
        let t = Tensor::from_slice(vals, (1, k), &Device::Cpu)?;
        let all = self.host.all_gather(&t)?.to_vec2::<i64>()?;
        Ok(all)
    }

    fn reduce_dtype(&self, op: OpKind, dtype: DType) -> Result<()> {
        match dtype {
            DType::F32 | DType::BF16 => Ok(()),
            other => Err(self.invalid(op, format!("reductions take bf16 or f32, got {other:?}"))),
        }
    }

    /// All-reduce into `out` (a new tensor, or `x` itself for the in-place form).
    fn all_reduce_into(
        &self,
        x: &Tensor,
        out: Option<Tensor>,
        op: ReduceOp,
    ) -> Result<IpcWork<Tensor>> {
        let k = OpKind::AllReduce;
        let x = self.input(k, x)?;
        self.reduce_dtype(k, x.dtype())?;
        // In place, `x` is the only buffer and the result lands in it.
        let (out, bufs) = match out {
            Some(o) => (o, vec![x.clone()]),
            None => {
                let o = uninit(x.shape(), x.dtype(), &self.device)?;
                (o.clone(), vec![x.clone(), o])
            }
        };
        let (n, count, dtype) = (self.size, x.elem_count(), x.dtype());
        let bytes = count * dtype.size_in_bytes();
        let algo = super::protocol::choose_all_reduce(bytes, n, self.opts.one_shot_max);
        self.issue(
            k,
            bytes as u64,
            (n as u64 - 1) * bytes as u64,
            None,
            bufs,
            out,
            move |is, a| {
                let (ax, ao) = (a[0], *a.last().unwrap_or(&a[0]));
                match algo {
                    super::protocol::AllReduceAlgo::OneShot => {
                        is.one_shot(ax, ao, count, dtype, op)
                    }
                    super::protocol::AllReduceAlgo::TwoShot => {
                        is.two_shot(ax, ao, count, dtype, op)
                    }
                }
            },
        )
    }
}

/// Allocate `bytes` uninitialised on `device` as a tensor of `shape` (every byte is written
/// by the op before anything reads it).
fn uninit(shape: &Shape, dtype: DType, device: &Device) -> Result<Tensor> {
    Ok(crate::nccl::uninit(shape, dtype, device)?)
}

/// Publish `own` and map every peer's buffer of the same size (handles through `host`).
fn exchange(host: &Comm, ctx: &Arc<CudaContext>, own: DevBuf, bytes: usize) -> Result<Shared> {
    let (rank, size) = (host.rank(), host.size());
    let err = |e: String| cuda_err(host.name(), e);
    let mut addr = vec![0u64; size];
    addr[rank] = own.ptr();
    let mut peers: Vec<Option<DevBuf>> = (0..size).map(|_| None).collect();
    if size > 1 {
        let h = own.handle().map_err(err)?;
        let t = Tensor::from_slice(&h, (1, 64), &Device::Cpu)?;
        let all = host.all_gather(&t)?.to_vec2::<u8>()?;
        for (q, row) in all.iter().enumerate() {
            if q == rank {
                continue;
            }
            let mut hq: IpcHandle = [0; 64];
            hq.copy_from_slice(row);
            let b = DevBuf::open(ctx, &hq, bytes).map_err(err)?;
            addr[q] = b.ptr();
            peers[q] = Some(b);
        }
    }
    Ok(Shared {
        _own: own,
        _peers: peers,
        addr,
    })
}

/// One op being enqueued: the group, its state (locked) and the op's sequence number.
struct Issue<'a> {
    g: &'a IpcGroup,
    st: &'a mut State,
    seq: u64,
    waits: &'a mut Vec<(usize, usize, u64)>,
}

impl Issue<'_> {
    fn data(&self) -> &Shared {
        self.st
            .data
            .as_ref()
            .expect("ensure_data ran before the op")
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: every caller passes tensor addresses from `with_device_addrs` (alive until
        // the compute stream waits for the op) or buffer addresses checked against the
        // buffer's capacity by `ensure_data` / the mailbox growth.
        unsafe { driver::copy(&self.g.stream, dst, src, bytes) }.map_err(|e| self.g.err(e))
    }

    /// Write this op's seq into `phase`'s flag of this rank in every peer's flag buffer.
    fn signal(&mut self, phase: Phase) -> Result<()> {
        let g = self.g;
        let me = g.rank;
        let addrs: Vec<u64> = (0..g.size)
            .filter(|q| *q != me)
            .map(|q| g.flags.addr[q] + phase_flag(phase, me) as u64)
            .collect();
        self.write(&addrs, self.seq)
    }

    fn write(&self, addrs: &[u64], value: u64) -> Result<()> {
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
    fn wait(&mut self, flags: &[(usize, usize)], target: u64) -> Result<()> {
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
    fn barrier(&mut self, phase: Phase) -> Result<()> {
        self.signal(phase)?;
        let me = self.g.rank;
        let flags: Vec<(usize, usize)> = (0..self.g.size)
            .filter(|q| *q != me)
            .map(|q| (phase_flag(phase, q), q))
            .collect();
        self.wait(&flags, self.seq)
    }

    /// Copy `bytes` of this rank's input (address `ax`) to the start of its data buffer and
    /// tell the peers (READY).
    fn publish(&mut self, ax: u64, bytes: usize) -> Result<()> {
        let own = self.data().addr[self.g.rank];
        self.copy(own, ax, bytes)?;
        self.barrier(Phase::Ready)
    }

    fn one_shot(
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

    fn two_shot(
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

/// The handle of an op in flight on the communication stream.
struct IpcWork<T> {
    done: Option<Arc<CudaEvent>>,
    compute: Arc<CudaStream>,
    /// Inputs and outputs: alive until the compute stream is ordered after `done`.
    keep: Vec<Tensor>,
    result: Option<T>,
    tracer: Tracer,
    event: TraceEvent,
    /// Wait on the host (a barrier returns once every rank entered).
    host_blocks: bool,
    watch: Arc<Watch>,
    timeout: Duration,
}

impl<T> IpcWork<T> {
    fn order_compute(&mut self) -> Result<()> {
        if let Some(done) = self.done.take() {
            let err = |e| cuda_err(&self.event.group, format!("{e:?}"));
            self.compute.wait(&done).map_err(err)?;
            if self.host_blocks || self.tracer.is_recording() {
                // Poll with the timeout: the watchdog releases a wait that never comes.
                let deadline = Instant::now() + self.timeout + Duration::from_secs(5);
                while !done.is_complete() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
            self.event.end_us = self.tracer.now_us();
            self.tracer.record(self.event.clone());
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
        if let Some((op, seq, rank, peer)) = poisoned {
            if seq <= self.event.seq {
                return Err(CommError::Timeout {
                    op,
                    group: self.event.group.clone(),
                    seq,
                    rank,
                    peer,
                    timeout_ms: self.timeout.as_millis() as u64,
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
fn spawn_watchdog(
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
                            Some((f.op, f.seq, f.waits.clone()))
                        }
                        _ => None,
                    }
                };
                let Some((op, seq, waits)) = late else { continue };
                let words = driver::read_words(&side, own_flags, FLAG_WORDS).unwrap_or_default();
                let short = waits
                    .iter()
                    .find(|(o, _, t)| words.get(o / 8).is_none_or(|v| v < t));
                let Some(&(_, peer, _)) = short else {
                    watch.in_flight.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
                    continue;
                };
                tracing::error!(
                    "{op} on IPC group '{name}' (seq {seq}) timed out after {} ms on rank {} waiting for rank {}",
                    timeout.as_millis(),
                    global[rank],
                    global[peer]
                );
                *watch.poisoned.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some((op, seq, global[rank], global[peer]));
                let _ = driver::fill_words(&side, own_flags, FLAG_WORDS, u64::MAX / 2);
                return;
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("IPC group '{}' runs without a watchdog: {e}", "?");
    }
}

impl Drop for IpcGroup {
    fn drop(&mut self) {
        // Waits still enqueued end when the peers arrive, or when the watchdog releases them.
        let _ = self.stream.synchronize();
        self.watch.stop.store(true, Ordering::Relaxed);
    }
}

/// Whether the reduction kernels take `dtype` (others reduce through the host group).
fn reduces(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16)
}

/// The rows of dim 0 and the elements per row of `x` (a 0-dim tensor is one row).
fn rows_of(x: &Tensor) -> (usize, usize) {
    match x.dims().first() {
        Some(&d) if d > 0 => (d, x.elem_count() / d),
        Some(_) => (0, x.dims()[1..].iter().product()),
        None => (1, 1),
    }
}

fn with_rows(x: &Tensor, rows: usize) -> Shape {
    let mut dims = x.dims().to_vec();
    match dims.first_mut() {
        Some(d) => *d = rows,
        None => dims.push(rows),
    }
    Shape::from(dims)
}

impl Communicator for IpcGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn name(&self) -> &str {
        &self.name
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
        if !reduces(x.dtype()) {
            return self.fallback.all_reduce_async(x, op);
        }
        Self::work(self.all_reduce_into(x, None, op))
    }

    fn all_reduce_in_place(&self, x: &Tensor, op: ReduceOp) -> Result<()> {
        if !reduces(x.dtype()) {
            return crate::communicator::all_reduce_and_copy_back(&*self.fallback, x, op);
        }
        check_in_place(&self.name, x)?;
        Work::new(Box::new(self.all_reduce_into(x, Some(x.clone()), op)?))
            .wait()
            .map(|_| ())
    }

    fn reduce_async(&self, x: &Tensor, root: usize, op: ReduceOp) -> Work {
        if !reduces(x.dtype()) {
            return self.fallback.reduce_async(x, root, op);
        }
        let k = OpKind::Reduce;
        Self::work((|| {
            self.root_ok(k, root)?;
            let x = self.input(k, x)?;
            self.reduce_dtype(k, x.dtype())?;
            let is_root = self.rank == root;
            let out = match is_root {
                true => uninit(x.shape(), x.dtype(), &self.device)?,
                false => x.clone(),
            };
            let (n, count, dtype) = (self.size, x.elem_count(), x.dtype());
            let bytes = count * dtype.size_in_bytes();
            let bufs = match is_root {
                true => vec![x.clone(), out.clone()],
                false => vec![x.clone()],
            };
            self.issue(
                k,
                bytes as u64,
                bytes as u64,
                Some(root),
                bufs,
                out,
                move |is, a| {
                    is.g.ensure_data(is.st, bytes)?;
                    is.publish(a[0], bytes)?;
                    if is_root {
                        let src = Peers::of(&is.data().addr);
                        is.g.kernels
                            .reduce(&is.g.stream, dtype, src, n, 0, a[1], count, op)
                            .map_err(|e| is.g.err(e))?;
                    }
                    is.barrier(Phase::Done)
                },
            )
        })())
    }

    fn broadcast_async(&self, x: &Tensor, root: usize) -> Work {
        let k = OpKind::Broadcast;
        Self::work((|| {
            self.root_ok(k, root)?;
            let x = self.input(k, x)?;
            let bytes = x.elem_count() * x.dtype().size_in_bytes();
            let out = uninit(x.shape(), x.dtype(), &self.device)?;
            let is_root = self.rank == root;
            let sent = if is_root {
                (self.size as u64 - 1) * bytes as u64
            } else {
                0
            };
            self.issue(
                k,
                bytes as u64,
                sent,
                Some(root),
                vec![x, out.clone()],
                out,
                move |is, a| {
                    is.g.ensure_data(is.st, bytes)?;
                    match is_root {
                        true => is.publish(a[0], bytes)?,
                        false => is.barrier(Phase::Ready)?,
                    }
                    let src = is.data().addr[root];
                    is.copy(a[1], src, bytes)?;
                    is.barrier(Phase::Done)
                },
            )
        })())
    }

    fn all_gather_async(&self, x: &Tensor) -> Work {
        let k = OpKind::AllGather;
        Self::work((|| {
            let x = self.input(k, x)?;
            let (rows, row) = rows_of(&x);
            let es = x.dtype().size_in_bytes();
            let all = self.host_gather(&[rows as i64, row as i64])?;
            if let Some((q, r)) = all.iter().enumerate().find(|(_, r)| r[1] as usize != row) {
                return Err(self.invalid(
                    k,
                    format!(
                        "rank {q} gathers rows of {} elements, this rank of {row}",
                        r[1]
                    ),
                ));
            }
            let counts: Vec<usize> = all.iter().map(|r| r[0] as usize).collect();
            let total: usize = counts.iter().sum();
            let out = uninit(&with_rows(&x, total), x.dtype(), &self.device)?;
            let bytes = rows * row * es;
            let most = counts.iter().max().copied().unwrap_or(0) * row * es;
            let sent = (self.size as u64 - 1) * bytes as u64;
            self.issue(
                k,
                bytes as u64,
                sent,
                None,
                vec![x, out.clone()],
                out,
                move |is, a| {
                    is.g.ensure_data(is.st, most)?;
                    is.publish(a[0], bytes)?;
                    let mut off = 0;
                    for (q, c) in counts.iter().enumerate() {
                        let len = c * row * es;
                        is.copy(a[1] + off as u64, is.data().addr[q], len)?;
                        off += len;
                    }
                    is.barrier(Phase::Done)
                },
            )
        })())
    }

    fn reduce_scatter_async(&self, x: &Tensor, op: ReduceOp) -> Work {
        if !reduces(x.dtype()) {
            return self.fallback.reduce_scatter_async(x, op);
        }
        let k = OpKind::ReduceScatter;
        Self::work((|| {
            let x = self.input(k, x)?;
            self.reduce_dtype(k, x.dtype())?;
            let (rows, row) = rows_of(&x);
            let (n, dtype) = (self.size, x.dtype());
            let chunk = crate::communicator::chunk_range(rows, n, self.rank);
            let out = uninit(&with_rows(&x, chunk.len()), dtype, &self.device)?;
            let bytes = rows * row * dtype.size_in_bytes();
            let sent = ((n - 1) * bytes / n) as u64;
            self.issue(
                k,
                bytes as u64,
                sent,
                None,
                vec![x, out.clone()],
                out,
                move |is, a| {
                    is.g.ensure_data(is.st, bytes)?;
                    is.publish(a[0], bytes)?;
                    let src = Peers::of(&is.data().addr);
                    is.g.kernels
                        .reduce(
                            &is.g.stream,
                            dtype,
                            src,
                            n,
                            chunk.start * row,
                            a[1],
                            chunk.len() * row,
                            op,
                        )
                        .map_err(|e| is.g.err(e))?;
                    is.barrier(Phase::Done)
                },
            )
        })())
    }

    fn scatter_async(&self, x: &Tensor, root: usize) -> Work {
        let k = OpKind::Scatter;
        Self::work((|| {
            self.root_ok(k, root)?;
            let is_root = self.rank == root;
            // The root's shape, through the host (the others' x carries only the dtype).
            let mut dims = vec![0i64; 9];
            if is_root {
                dims[0] = x.rank() as i64;
                for (i, d) in x.dims().iter().enumerate().take(8) {
                    dims[i + 1] = *d as i64;
                }
            }
            let all = self.host_gather(&dims)?;
            let shape: Vec<usize> = all[root][1..=all[root][0] as usize]
                .iter()
                .map(|d| *d as usize)
                .collect();
            let x = match is_root {
                true => self.input(k, x)?,
                false => x.clone(),
            };
            let dtype = x.dtype();
            let es = dtype.size_in_bytes();
            let rows = shape.first().copied().unwrap_or(1);
            let row: usize = shape.iter().skip(1).product();
            let chunk = crate::communicator::chunk_range(rows, self.size, self.rank);
            let mut out_dims = shape.clone();
            if let Some(d) = out_dims.first_mut() {
                *d = chunk.len();
            }
            let out = uninit(&Shape::from(out_dims), dtype, &self.device)?;
            let bytes = rows * row * es;
            let bufs = match is_root {
                true => vec![out.clone(), x],
                false => vec![out.clone()],
            };
            self.issue(k, bytes as u64, 0, Some(root), bufs, out, move |is, a| {
                is.g.ensure_data(is.st, bytes)?;
                match is_root {
                    true => is.publish(a[1], bytes)?,
                    false => is.barrier(Phase::Ready)?,
                }
                let src = is.data().addr[root] + (chunk.start * row * es) as u64;
                is.copy(a[0], src, chunk.len() * row * es)?;
                is.barrier(Phase::Done)
            })
        })())
    }

    fn gather_async(&self, x: &Tensor, root: usize) -> Work {
        let k = OpKind::Gather;
        Self::work((|| {
            self.root_ok(k, root)?;
            let x = self.input(k, x)?;
            let (rows, row) = rows_of(&x);
            let es = x.dtype().size_in_bytes();
            let all = self.host_gather(&[rows as i64])?;
            let counts: Vec<usize> = all.iter().map(|r| r[0] as usize).collect();
            let total: usize = counts.iter().sum();
            let is_root = self.rank == root;
            let out = match is_root {
                true => uninit(&with_rows(&x, total), x.dtype(), &self.device)?,
                false => x.clone(),
            };
            let bytes = rows * row * es;
            let most = counts.iter().max().copied().unwrap_or(0) * row * es;
            let bufs = match is_root {
                true => vec![x, out.clone()],
                false => vec![x],
            };
            self.issue(
                k,
                bytes as u64,
                bytes as u64,
                Some(root),
                bufs,
                out,
                move |is, a| {
                    is.g.ensure_data(is.st, most)?;
                    is.publish(a[0], bytes)?;
                    if is_root {
                        let mut off = 0;
                        for (q, c) in counts.iter().enumerate() {
                            let len = c * row * es;
                            is.copy(a[1] + off as u64, is.data().addr[q], len)?;
                            off += len;
                        }
                    }
                    is.barrier(Phase::Done)
                },
            )
        })())
    }

    fn all_to_all_async(&self, x: &Tensor, send_splits: &[usize], recv_splits: &[usize]) -> Work {
        let k = OpKind::AllToAll;
        Self::work((|| {
            let n = self.size;
            if send_splits.len() != n || recv_splits.len() != n {
                return Err(self.invalid(
                    k,
                    format!(
                        "send_splits has {} entries and recv_splits {}, the group {n} ranks",
                        send_splits.len(),
                        recv_splits.len()
                    ),
                ));
            }
            let x = self.input(k, x)?;
            let (rows, row) = rows_of(&x);
            if send_splits.iter().sum::<usize>() != rows {
                return Err(self.invalid(
                    k,
                    format!("send_splits {send_splits:?} do not sum to the input's {rows} rows"),
                ));
            }
            let es = x.dtype().size_in_bytes();
            let mine: Vec<i64> = send_splits.iter().map(|s| *s as i64).collect();
            let table = self.host_gather(&mine)?;
            for (p, want) in recv_splits.iter().enumerate() {
                let sent = table[p][self.rank] as usize;
                if sent != *want {
                    return Err(CommError::Mismatch {
                        group: self.name.clone(),
                        rank: self.global_ranks[self.rank],
                        peer: self.global_ranks[p],
                        mine: format!("all_to_all expecting {want} rows from rank {p}"),
                        theirs: format!("all_to_all sending {sent} rows to rank {}", self.rank),
                    });
                }
            }
            let most = table
                .iter()
                .map(|t| t.iter().sum::<i64>() as usize)
                .max()
                .unwrap_or(0)
                * row
                * es;
            let total: usize = recv_splits.iter().sum();
            let out = uninit(&with_rows(&x, total), x.dtype(), &self.device)?;
            let bytes = rows * row * es;
            let me = self.rank;
            let recv = recv_splits.to_vec();
            let sent = (bytes - send_splits[me] * row * es) as u64;
            self.issue(
                k,
                bytes as u64,
                sent,
                None,
                vec![x, out.clone()],
                out,
                move |is, a| {
                    is.g.ensure_data(is.st, most)?;
                    is.publish(a[0], bytes)?;
                    let mut off = 0;
                    for (p, r) in recv.iter().enumerate() {
                        let splits: Vec<usize> = table[p].iter().map(|s| *s as usize).collect();
                        let from = super::protocol::all_to_all_offset(&splits, me, row) * es;
                        let len = r * row * es;
                        is.copy(a[1] + off as u64, is.data().addr[p] + from as u64, len)?;
                        off += len;
                    }
                    is.barrier(Phase::Done)
                },
            )
        })())
    }

    fn send_async(&self, x: &Tensor, dst: usize) -> Work<()> {
        let k = OpKind::Send;
        Self::work((|| {
            self.peer_ok(k, dst)?;
            let x = self.input(k, x)?;
            let bytes = x.elem_count() * x.dtype().size_in_bytes();
            self.issue(
                k,
                bytes as u64,
                bytes as u64,
                Some(dst),
                vec![x],
                (),
                move |is, a| {
                    let g = is.g;
                    let me = g.rank;
                    is.st.sent[dst] += 1;
                    let m = is.st.sent[dst];
                    let (ack, _) = mail_targets(m);
                    let cap = is.st.out_box[dst].as_ref().map_or(0, |b| b.bytes());
                    let grown = grown_capacity(cap, bytes);
                    if grown != cap || is.st.out_box[dst].is_none() {
                        let b = DevBuf::alloc(&g.ctx, grown).map_err(|e| g.err(e))?;
                        let h = b.handle().map_err(|e| g.err(e))?;
                        g.store_of(k)?.set(&g.box_key(me, dst, grown), &h)?;
                        if let Some(old) = is.st.out_box[dst].replace(b) {
                            is.st.retired.push(old);
                        }
                    }
                    // The previous message to dst was copied out: the mailbox may be overwritten.
                    is.wait(&[(mail_flag(Mail::Ack, dst), dst)], ack)?;
                    let slot = is.st.out_box[dst].as_ref().map_or(0, |b| b.ptr());
                    is.copy(slot, a[0], bytes)?;
                    let sig = g.flags.addr[dst] + mail_flag(Mail::Sig, me) as u64;
                    is.write(&[sig], m)
                },
            )
        })())
    }

    fn recv_async(&self, src: usize, shape: &Shape, dtype: DType) -> Work {
        let k = OpKind::Recv;
        Self::work((|| {
            self.peer_ok(k, src)?;
            let out = uninit(shape, dtype, &self.device)?;
            let bytes = shape.elem_count() * dtype.size_in_bytes();
            self.issue(
                k,
                bytes as u64,
                0,
                Some(src),
                vec![out.clone()],
                out,
                move |is, a| {
                    let g = is.g;
                    let me = g.rank;
                    is.st.received[src] += 1;
                    let m = is.st.received[src];
                    let (_, sig) = mail_targets(m);
                    let cap = is.st.in_box[src].as_ref().map_or(0, |b| b.bytes());
                    let grown = grown_capacity(cap, bytes);
                    if grown != cap || is.st.in_box[src].is_none() {
                        let raw = g.store_of(k)?.get(&g.box_key(src, me, grown))?;
                        let mut h: IpcHandle = [0; 64];
                        if raw.len() != 64 {
                            return Err(CommError::Store(format!(
                                "mailbox handle of {} bytes",
                                raw.len()
                            )));
                        }
                        h.copy_from_slice(&raw);
                        let b = DevBuf::open(&g.ctx, &h, grown).map_err(|e| g.err(e))?;
                        if let Some(old) = is.st.in_box[src].replace(b) {
                            is.st.retired.push(old);
                        }
                    }
                    is.wait(&[(mail_flag(Mail::Sig, src), src)], sig)?;
                    let slot = is.st.in_box[src].as_ref().map_or(0, |b| b.ptr());
                    is.copy(a[0], slot, bytes)?;
                    let ack = g.flags.addr[src] + mail_flag(Mail::Ack, me) as u64;
                    is.write(&[ack], m)
                },
            )
        })())
    }

    fn barrier_async(&self) -> Work<()> {
        let r = self.issue(OpKind::Barrier, 0, 0, None, vec![], (), |is, _| {
            is.barrier(Phase::Ready)
        });
        match r {
            Ok(mut w) => {
                w.host_blocks = true;
                Work::new(Box::new(w))
            }
            Err(e) => Work::ready(Err(e)),
        }
    }
}

impl IpcGroup {
    fn store_of(&self, op: OpKind) -> Result<&StoreClient> {
        self.store
            .as_deref()
            .ok_or_else(|| self.invalid(op, "send/recv needs the rendezvous store".into()))
    }

    /// The store key of the mailbox from group rank `src` to `dst` at capacity `cap`.
    fn box_key(&self, src: usize, dst: usize, cap: usize) -> String {
        format!("ipc/{}/box/{src}-{dst}/{cap}", self.key)
    }

    fn root_ok(&self, op: OpKind, root: usize) -> Result<()> {
        match root < self.size {
            true => Ok(()),
            false => Err(self.invalid(
                op,
                format!("root {root} is not a rank of a group of {}", self.size),
            )),
        }
    }

    fn peer_ok(&self, op: OpKind, peer: usize) -> Result<()> {
        match peer < self.size && peer != self.rank {
            true => Ok(()),
            false => Err(self.invalid(
                op,
                format!(
                    "peer {peer} is not another rank of a group of {} (this is rank {})",
                    self.size, self.rank
                ),
            )),
        }
    }
}
