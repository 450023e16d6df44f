//! Issuing an op on a group's communication stream, ordered against candle's compute stream by
//! two CUDA events (see the module doc's picture), and the [`Work`] handle that orders the
//! compute stream after the op and keeps its buffers alive.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaStream, DevicePtr, SyncOnDrop};
use candle_core::cuda_backend::cudarc::nccl::sys as nccl;
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{Storage, Tensor};

use super::group::{check, driver_err, NcclGroup};
use super::shared::InFlight;
use super::watchdog::abort;
use crate::communicator::{CommError, OpKind, PendingWork, Result, Work};
use crate::site::Site;
use crate::trace::{device, TraceEvent, Tracer};

impl NcclGroup {
    /// Issue one op: order the communication stream after the compute stream, enqueue the
    /// NCCL calls `enqueue` makes (given the device addresses of `bufs`), record `done`.
    ///
    /// `bufs` are the tensors the op reads or writes; they are kept alive by the returned
    /// handle. `enqueue` runs with the communicator locked and the CUDA context current.
    #[allow(clippy::too_many_arguments)]
    #[track_caller]
    pub(super) fn launch<T: Send + 'static>(
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
    #[track_caller]
    pub(super) fn try_launch<T: Send + 'static>(
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
        let site = Site::caller();
        self.check_poisoned()?;
        let _issue = self.issue.lock().unwrap_or_else(|p| p.into_inner());
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let start_us = self.tracer.now_us();
        let cu = |e| driver_err(self.name(), e);
        // Every value the compute stream wrote before this call is visible to the collective.
        let ready = self.compute.record_event(None).map_err(cu)?;
        self.comm_stream.wait(&ready).map_err(cu)?;
        let begin = self.comm_stream.record_event(device::TIMED).map_err(cu)?;
        self.shared.ctx.bind_to_thread().map_err(cu)?;
        with_device_addrs(&bufs, &self.comm_stream, |addrs| {
            let stream = self.comm_stream.cu_stream() as nccl::cudaStream_t;
            enqueue(self.shared.comm.0, stream, addrs)
        })?
        .map_err(|e| self.nccl_err(op, seq, site, e))?;
        let done = Arc::new(self.comm_stream.record_event(device::TIMED).map_err(cu)?);
        self.shared
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(InFlight {
                op,
                seq,
                site,
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
            site,
        };
        Ok(NcclWork {
            begin: Some(begin),
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
    #[track_caller]
    pub(super) fn exchange_host(&self, op: OpKind, vals: &[u64]) -> Result<Vec<Vec<u64>>> {
        let site = Site::caller();
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
            .map_err(|e| self.nccl_err(op, self.seq.load(Ordering::SeqCst), site, e))?;
        }
        // Poll (with the timeout) before copying back: the copy itself would wait forever for
        // a rank that never arrives.
        self.wait_stream(op, site)?;
        let mut host = vec![0u64; n * k];
        self.comm_stream.memcpy_dtoh(&recv, &mut host).map_err(cu)?;
        Ok(host.chunks(k.max(1)).map(|c| c.to_vec()).take(n).collect())
    }

    /// Synchronise the communication stream, giving up (and aborting) after the timeout.
    pub(super) fn wait_stream(&self, op: OpKind, site: Site) -> Result<()> {
        let cu = |e| driver_err(self.name(), e);
        let event = self.comm_stream.record_event(None).map_err(cu)?;
        let deadline = Instant::now() + self.shared.timeout;
        while !event.try_is_complete().map_err(cu)? {
            if Instant::now() > deadline {
                let seq = self.seq.load(Ordering::SeqCst);
                abort(&self.shared, op, seq, site);
                return self.check_poisoned();
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }
}

/// Run `f` with the device address of each tensor's first element. The storages stay locked
/// for reading while `f` enqueues work on `stream`, and cudarc records each buffer's "read"
/// event on `stream` afterwards, so a later reuse of the memory waits for the enqueued op.
pub(crate) fn with_device_addrs<R>(
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

pub(super) fn slice_addr<'a>(
    slice: &'a CudaStorageSlice,
    stream: &'a CudaStream,
) -> (u64, SyncOnDrop<'a>) {
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

/// The handle of an op in flight on the communication stream.
pub(super) struct NcclWork<T> {
    /// The op's start on the communication stream (`done` its end).
    pub(super) begin: Option<CudaEvent>,
    pub(super) done: Option<Arc<CudaEvent>>,
    pub(super) compute: Arc<CudaStream>,
    /// Inputs and outputs: alive until the compute stream is ordered after `done`.
    pub(super) keep: Vec<Tensor>,
    pub(super) result: Option<T>,
    pub(super) tracer: Tracer,
    pub(super) event: TraceEvent,
}

impl<T> NcclWork<T> {
    /// Make the compute stream wait for the op (the host does not block).
    pub(super) fn order_compute(&mut self) -> Result<()> {
        if let (Some(begin), Some(done)) = (self.begin.take(), self.done.take()) {
            device::order_after(&self.compute, begin, done, &self.tracer, &self.event)
                .map_err(|e| driver_err(&self.event.group, e))?;
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
