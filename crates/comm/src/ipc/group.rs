//! One IPC group: its options, its flag and data buffers (own and mapped) and their growth.
//! An op's issue and phases are `phases`, the ops `collectives`, the handle and the watchdog
//! `work`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaStream};
use candle_core::{DType, Device, Shape, Tensor};

use super::driver::{cuda_err, DevBuf, IpcHandle};
use super::kernels::Kernels;
use super::protocol::{grown_capacity, OpNumbers, WaitMode, FLAG_BYTES, MAX_WORLD, ONE_SHOT_MAX};
use super::work::{spawn_watchdog, IpcWork, Watch};
use crate::communicator::{Comm, CommError, OpKind, Result, Work};
use crate::store::StoreClient;
use crate::trace::Tracer;

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
pub(super) struct Shared {
    /// Held for the group's lifetime: the allocation peers map, and the mappings of theirs.
    pub(super) _own: DevBuf,
    pub(super) _peers: Vec<Option<DevBuf>>,
    /// Device address of rank q's buffer in this process (own included).
    pub(super) addr: Vec<u64>,
}

/// What the ops of a group change: their numbers and the buffers that grow.
pub(super) struct State {
    pub(super) numbers: OpNumbers,
    pub(super) data: Option<Shared>,
    pub(super) data_cap: usize,
    /// This rank's mailbox for messages to peer q, and how many it sent there.
    pub(super) out_box: Vec<Option<DevBuf>>,
    pub(super) sent: Vec<u64>,
    /// Peer q's mailbox for messages to this rank, mapped, and how many came from it.
    pub(super) in_box: Vec<Option<DevBuf>>,
    pub(super) received: Vec<u64>,
    /// Buffers replaced by larger ones: kept until the group is dropped, since work enqueued
    /// before the growth (here or on a peer) may still read them.
    pub(super) retired: Vec<DevBuf>,
    pub(super) retired_shared: Vec<Shared>,
}

/// One process group whose ranks read each other's GPU memory through CUDA IPC.
pub struct IpcGroup {
    pub(super) name: String,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) global_ranks: Vec<usize>,
    pub(super) device: Device,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) compute: Arc<CudaStream>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) kernels: Arc<Kernels>,
    pub(super) tracer: Tracer,
    /// The same ranks on the host backend: buffer handles and row counts travel through it.
    pub(super) host: Comm,
    /// Reductions of dtypes the kernels do not take (f64 loss sums, integer counts): `host`
    /// staged onto the device.
    pub(super) fallback: Comm,
    /// Mailbox handles travel through the store (one sender, one receiver, no group op),
    /// under keys starting with `key` (the group's name, ranks and creation count).
    pub(super) store: Option<Arc<StoreClient>>,
    pub(super) key: String,
    pub(super) opts: IpcOptions,
    pub(super) flags: Shared,
    pub(super) state: Mutex<State>,
    pub(super) watch: Arc<Watch>,
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
                numbers: OpNumbers::default(),
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

    pub(super) fn err(&self, e: impl std::fmt::Display) -> CommError {
        cuda_err(&self.name, e)
    }

    pub(super) fn invalid(&self, op: OpKind, msg: String) -> CommError {
        CommError::InvalidArgument {
            op,
            group: self.name.clone(),
            msg,
        }
    }

    pub(super) fn check_poisoned(&self) -> Result<()> {
        match *self
            .watch
            .poisoned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
        {
            None => Ok(()),
            Some((op, seq, rank, peer, site)) => Err(CommError::Timeout {
                op,
                group: self.name.clone(),
                seq,
                rank,
                peer,
                timeout_ms: self.opts.timeout.as_millis() as u64,
                site,
            }),
        }
    }

    /// `x` contiguous on this group's device.
    pub(super) fn input(&self, op: OpKind, x: &Tensor) -> Result<Tensor> {
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
    pub(super) fn ensure_data(&self, st: &mut State, needed: usize) -> Result<()> {
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

    pub(super) fn work<T: Send + 'static>(r: Result<IpcWork<T>>) -> Work<T> {
        match r {
            Ok(w) => Work::new(Box::new(w)),
            Err(e) => Work::ready(Err(e)),
        }
    }

    /// Everyone's `vals` (same length on every rank), through the host group.
    pub(super) fn host_gather(&self, vals: &[i64]) -> Result<Vec<Vec<i64>>> {
        let k = vals.len();
        let t = Tensor::from_slice(vals, (1, k), &Device::Cpu)?;
        let all = self.host.all_gather(&t)?.to_vec2::<i64>()?;
        Ok(all)
    }

    pub(super) fn reduce_dtype(&self, op: OpKind, dtype: DType) -> Result<()> {
        match dtype {
            DType::F32 | DType::BF16 => Ok(()),
            other => Err(self.invalid(op, format!("reductions take bf16 or f32, got {other:?}"))),
        }
    }
}

/// Allocate `bytes` uninitialised on `device` as a tensor of `shape` (every byte is written
/// by the op before anything reads it).
pub(super) fn uninit(shape: &Shape, dtype: DType, device: &Device) -> Result<Tensor> {
    Ok(crate::nccl::uninit(shape, dtype, device)?)
}

/// Publish `own` and map every peer's buffer of the same size (handles through `host`).
pub(super) fn exchange(
    host: &Comm,
    ctx: &Arc<CudaContext>,
    own: DevBuf,
    bytes: usize,
) -> Result<Shared> {
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

impl Drop for IpcGroup {
    fn drop(&mut self) {
        // Waits still enqueued end when the peers arrive, or when the watchdog releases them.
        let _ = self.stream.synchronize();
        self.watch.stop.store(true, Ordering::Relaxed);
    }
}

impl IpcGroup {
    pub(super) fn store_of(&self, op: OpKind) -> Result<&StoreClient> {
        self.store
            .as_deref()
            .ok_or_else(|| self.invalid(op, "send/recv needs the rendezvous store".into()))
    }

    /// The store key of the mailbox from group rank `src` to `dst` at capacity `cap`.
    pub(super) fn box_key(&self, src: usize, dst: usize, cap: usize) -> String {
        format!("ipc/{}/box/{src}-{dst}/{cap}", self.key)
    }

    pub(super) fn root_ok(&self, op: OpKind, root: usize) -> Result<()> {
        match root < self.size {
            true => Ok(()),
            false => Err(self.invalid(
                op,
                format!("root {root} is not a rank of a group of {}", self.size),
            )),
        }
    }

    pub(super) fn peer_ok(&self, op: OpKind, peer: usize) -> Result<()> {
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
