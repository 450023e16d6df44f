//! One process group on NCCL: the communicator handle and the state the group's ops share, its
//! creation from a unique id, and the [`Communicator`] methods, each an op of `collectives`.

use std::collections::VecDeque;
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::cuda_backend::cudarc::nccl::sys as nccl;
use candle_core::{DType, Device, Shape, Tensor};

use super::factory::GroupFactory;
use super::shared::{RawComm, Shared};
use super::watchdog::spawn_watchdog;
use crate::communicator::{Comm, CommError, Communicator, OpKind, ReduceOp, Result, Work};
use crate::site::Site;
use crate::trace::Tracer;

/// Turn an NCCL status into a message naming the NCCL error.
pub(super) fn check(status: nccl::ncclResult_t) -> std::result::Result<(), String> {
    match status {
        nccl::ncclResult_t::ncclSuccess | nccl::ncclResult_t::ncclInProgress => Ok(()),
        other => {
            // SAFETY: ncclGetErrorString returns a pointer to a static NUL-terminated string.
            let text = unsafe { CStr::from_ptr(nccl::ncclGetErrorString(other)) };
            Err(format!("{other:?}: {}", text.to_string_lossy()))
        }
    }
}

/// One process group on NCCL.
pub struct NcclGroup {
    pub(super) shared: Arc<Shared>,
    pub(super) global_ranks: Vec<usize>,
    pub(super) device: Device,
    pub(super) compute: Arc<CudaStream>,
    pub(super) comm_stream: Arc<CudaStream>,
    pub(super) tracer: Tracer,
    pub(super) check_args: bool,
    pub(super) seq: AtomicU64,
    /// Held while an op is enqueued: serialises NCCL calls and keeps seq order = issue order.
    pub(super) issue: Mutex<()>,
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
    pub(super) fn init(
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

    pub(super) fn name(&self) -> &str {
        &self.shared.name
    }

    pub(super) fn invalid(&self, op: OpKind, msg: String) -> CommError {
        CommError::InvalidArgument {
            op,
            group: self.name().to_string(),
            msg,
        }
    }

    pub(super) fn nccl_err(&self, op: OpKind, seq: u64, site: Site, e: String) -> CommError {
        CommError::PeerClosed {
            op,
            group: self.name().to_string(),
            seq,
            rank: self.shared.rank,
            peer: self.shared.rank,
            detail: format!("NCCL: {e}"),
            site,
        }
    }

    /// Fails when this group was aborted after an op stalled; the error names that op.
    pub(super) fn check_poisoned(&self) -> Result<()> {
        let poisoned = *self
            .shared
            .poisoned
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match poisoned {
            None => Ok(()),
            Some((op, seq, site)) => Err(CommError::Timeout {
                op,
                group: self.name().to_string(),
                seq,
                rank: self.shared.rank,
                // NCCL does not say which peer never arrived.
                peer: self.shared.rank,
                timeout_ms: self.shared.timeout.as_millis() as u64,
                site,
            }),
        }
    }

    /// Validates that `x` lives on this group's GPU, and returns it contiguous.
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
}

pub(super) fn driver_err(group: &str, e: impl std::fmt::Debug) -> CommError {
    CommError::Candle(candle_core::Error::Msg(format!(
        "CUDA error on group '{group}': {e:?}"
    )))
}

pub(super) fn or_error<T: Send + 'static>(r: Result<Work<T>>) -> Work<T> {
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
