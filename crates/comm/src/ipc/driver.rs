//! The CUDA driver calls of the IPC backend, each behind a safe function: device buffers that
//! can be shared (cuMemAlloc, cuIpcGetMemHandle), a peer's buffer mapped into this process
//! (cuIpcOpenMemHandle), copies and flag writes and waits on a stream.
//!
//! The only `unsafe` of the module is here; each block says which pointers it passes and why
//! they are valid.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaStream};

use crate::communicator::CommError;

/// The bytes of a CUDA IPC memory handle, as exchanged between processes.
pub type IpcHandle = [u8; 64];

/// A CUDA driver status as a message, or Ok.
pub fn check(status: sys::CUresult, what: &str) -> Result<(), String> {
    match status {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(format!("{what}: {other:?}")),
    }
}

/// A device buffer of this process (`Own`, freed on drop) or a peer's buffer mapped through
/// CUDA IPC (`Peer`, unmapped on drop).
pub struct DevBuf {
    ptr: u64,
    bytes: usize,
    own: bool,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is a plain device address; every use binds `ctx` first.
unsafe impl Send for DevBuf {}
unsafe impl Sync for DevBuf {}

impl DevBuf {
    /// `bytes` of zeroed device memory on `ctx`'s device that peers can map.
    pub fn alloc(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, String> {
        ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the context is current.
        check(
            unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) },
            "cuMemAlloc",
        )
        .map_err(|e| format!("{e} ({bytes} bytes for the IPC backend)"))?;
        let buf = Self {
            ptr,
            bytes,
            own: true,
            ctx: ctx.clone(),
        };
        // SAFETY: `ptr` addresses `bytes` bytes just allocated. The memset may run after the
        // call returns: the null stream is synchronised so no peer's flag write lands first.
        unsafe {
            check(sys::cuMemsetD8_v2(ptr, 0, bytes.max(1)), "cuMemsetD8")?;
            check(
                sys::cuStreamSynchronize(std::ptr::null_mut()),
                "cuStreamSynchronize",
            )?;
        }
        Ok(buf)
    }

    /// The handle a peer opens this buffer with.
    pub fn handle(&self) -> Result<IpcHandle, String> {
        self.ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `h` is a valid out-struct; `ptr` is the base of a cuMemAlloc allocation.
        check(
            unsafe { sys::cuIpcGetMemHandle(&mut h, self.ptr) },
            "cuIpcGetMemHandle",
        )?;
        Ok(h.reserved.map(|c| c as u8))
    }

    /// Map a peer's buffer of `bytes` bytes, given its handle.
    pub fn open(ctx: &Arc<CudaContext>, handle: &IpcHandle, bytes: usize) -> Result<Self, String> {
        ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        let h = sys::CUipcMemHandle {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the handle came from cuIpcGetMemHandle of a
        // live allocation in a peer process (the peer keeps it until the group is dropped).
        check(
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    h,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            },
            "cuIpcOpenMemHandle",
        )?;
        Ok(Self {
            ptr,
            bytes,
            own: false,
            ctx: ctx.clone(),
        })
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        // SAFETY: `ptr` is this buffer's own allocation or mapping, released once; the group
        // synchronises its stream before dropping buffers, so no enqueued work still uses it.
        unsafe {
            match self.own {
                true => sys::cuMemFree_v2(self.ptr),
                false => sys::cuIpcCloseMemHandle(self.ptr),
            };
        }
    }
}

/// Enqueue a copy of `bytes` bytes from device address `src` to `dst` on `stream`.
///
/// # Safety
/// `src` and `dst` must address at least `bytes` bytes of device memory that stay valid until
/// the copy ran.
pub unsafe fn copy(stream: &CudaStream, dst: u64, src: u64, bytes: usize) -> Result<(), String> {
    if bytes == 0 {
        return Ok(());
    }
    check(
        sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.cu_stream()),
        "cuMemcpyDtoDAsync",
    )
}

/// Enqueue on `stream`: write `value` to the u64 at device address `addr` (a peer's flag),
/// after every earlier write of the stream (the driver's default memory barrier).
pub fn write_flag(stream: &CudaStream, addr: u64, value: u64) -> Result<(), String> {
    // SAFETY: `addr` is an 8-byte-aligned word of a flag buffer (own or mapped) that lives as
    // long as the group.
    check(
        unsafe { sys::cuStreamWriteValue64_v2(stream.cu_stream(), addr, value, 0) },
        "cuStreamWriteValue64",
    )
}

/// Enqueue on `stream`: wait until the u64 at device address `addr` is at least `value`.
pub fn wait_flag(stream: &CudaStream, addr: u64, value: u64) -> Result<(), String> {
    // SAFETY: as in `write_flag`; GEQ = 0.
    check(
        unsafe {
            sys::cuStreamWaitValue64_v2(
                stream.cu_stream(),
                addr,
                value,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        },
        "cuStreamWaitValue64",
    )
}

/// Read `words` u64 at device address `addr` through `side`, a stream other than the
/// communication stream (which may be blocked), synchronously.
pub fn read_words(side: &CudaStream, addr: u64, words: usize) -> Result<Vec<u64>, String> {
    let mut host = vec![0u64; words];
    // SAFETY: `host` holds `words` u64; `addr` is a flag buffer of at least that size.
    side.context()
        .bind_to_thread()
        .map_err(|e| format!("{e:?}"))?;
    unsafe {
        check(
            sys::cuMemcpyDtoHAsync_v2(
                host.as_mut_ptr() as *mut _,
                addr,
                words * 8,
                side.cu_stream(),
            ),
            "cuMemcpyDtoHAsync",
        )?;
    }
    side.synchronize().map_err(|e| format!("{e:?}"))?;
    Ok(host)
}

/// Overwrite `words` u64 at `addr` with `value` through `side` and wait: the watchdog's way
/// to release waits on flags that will never come.
pub fn fill_words(side: &CudaStream, addr: u64, words: usize, value: u64) -> Result<(), String> {
    let host = vec![value; words];
    side.context()
        .bind_to_thread()
        .map_err(|e| format!("{e:?}"))?;
    // SAFETY: `host` holds `words` u64 and lives until the synchronize below.
    unsafe {
        check(
            sys::cuMemcpyHtoDAsync_v2(addr, host.as_ptr() as *const _, words * 8, side.cu_stream()),
            "cuMemcpyHtoDAsync",
        )?;
    }
    side.synchronize().map_err(|e| format!("{e:?}"))
}

/// A driver failure on group `group` as the communication error.
pub fn cuda_err(group: &str, e: impl std::fmt::Display) -> CommError {
    CommError::Candle(candle_core::Error::Msg(format!(
        "CUDA error on IPC group '{group}': {e}"
    )))
}
