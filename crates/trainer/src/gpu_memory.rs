//! Measured GPU memory: what the CUDA memory pool holds now, its high-water mark, and the device.
//!
//! candle allocates CUDA tensors with the stream-ordered allocator (`cuMemAllocAsync`), which
//! serves every allocation from the device's default memory pool. The pool keeps counters that
//! answer the memory report's questions without any bookkeeping of our own:
//!
//! ```text
//!   device memory (cuMemGetInfo: total, free)
//!   ├── other processes, CUDA context, cuBLAS workspace, NCCL buffers   (total - free - reserved)
//!   └── default memory pool                      reserved  (RESERVED_MEM_CURRENT / _HIGH)
//!       ├── live tensors                         used      (USED_MEM_CURRENT / USED_MEM_HIGH)
//!       └── freed, kept for reuse                reserved - used
//! ```
//!
//! `current` is `USED_MEM_CURRENT`: bytes of live allocations (PyTorch's "allocated").
//! `peak` is `USED_MEM_HIGH`, the high-water mark since the last `reset_peak`, which writes 0
//! to that attribute (the driver then restarts it from the current value). `reserved` and
//! `device_used` put the number in context: the pool's own footprint, and the whole card's use
//! as `nvidia-smi` shows it.

use candle_core::cuda_backend::cudarc::driver::{result, sys, CudaContext};
use candle_core::Device;
use std::sync::Arc;

/// Errors of the CUDA memory probe.
#[derive(Debug, thiserror::Error)]
pub enum GpuMemoryError {
    #[error("the CUDA memory probe needs a CUDA device, got {0:?}")]
    NotCuda(Device),
    #[error("CUDA driver call {call} failed: {detail}")]
    Driver { call: &'static str, detail: String },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// One reading of the device's memory, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct GpuMemorySnapshot {
    /// Live allocations in the default pool.
    pub used: u64,
    /// High-water mark of `used` since the last reset.
    pub used_high: u64,
    /// Memory the pool holds from the device (live + cached for reuse).
    pub reserved: u64,
    /// Device memory in use by anything (`total - free`, as `nvidia-smi` reports it).
    pub device_used: u64,
    /// Device memory in total.
    pub device_total: u64,
}

/// Reads the default memory pool of one CUDA device.
#[derive(Debug, Clone)]
pub struct CudaMemoryProbe {
    ctx: Arc<CudaContext>,
    pool: PoolHandle,
}

/// The pool handle: an opaque driver pointer, valid for the life of the context.
#[derive(Debug, Clone, Copy)]
struct PoolHandle(sys::CUmemoryPool);
// SAFETY: a CUmemoryPool is a process-wide driver handle; the driver's pool attribute calls are
// thread safe, and the default pool lives as long as the device's primary context, which
// `CudaMemoryProbe::ctx` keeps alive.
unsafe impl Send for PoolHandle {}
unsafe impl Sync for PoolHandle {}

fn driver(call: &'static str) -> impl Fn(result::DriverError) -> GpuMemoryError {
    move |e| GpuMemoryError::Driver {
        call,
        detail: format!("{e:?}"),
    }
}

impl CudaMemoryProbe {
    /// A probe for the CUDA device that `device` computes on.
    pub fn new(device: &Device) -> Result<Self, GpuMemoryError> {
        let Device::Cuda(cuda) = device else {
            return Err(GpuMemoryError::NotCuda(device.clone()));
        };
        let ctx = cuda.cuda_stream().context().clone();
        ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
        // SAFETY: the device handle comes from a live context.
        let pool = unsafe { result::device::get_default_mem_pool(ctx.cu_device()) }
            .map_err(driver("cuDeviceGetDefaultMemPool"))?;
        Ok(Self {
            ctx,
            pool: PoolHandle(pool),
        })
    }

    fn attribute(&self, attr: sys::CUmemPool_attribute) -> Result<u64, GpuMemoryError> {
        let mut value: u64 = 0;
        // SAFETY: the four attributes read here are all `cuuint64_t`, written into `value`.
        unsafe {
            sys::cuMemPoolGetAttribute(self.pool.0, attr, &mut value as *mut u64 as *mut _)
                .result()
                .map_err(driver("cuMemPoolGetAttribute"))?;
        }
        Ok(value)
    }

    /// Bytes of live allocations in the pool.
    pub fn current(&self) -> Result<u64, GpuMemoryError> {
        self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    }

    /// High-water mark of [`Self::current`] since the last [`Self::reset_peak`].
    pub fn peak(&self) -> Result<u64, GpuMemoryError> {
        self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)
    }

    /// Restart the high-water marks (used and reserved) from the current values.
    pub fn reset_peak(&self) -> Result<(), GpuMemoryError> {
        for attr in [
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        ] {
            let mut zero: u64 = 0;
            // SAFETY: the high-water attributes accept only 0, as a `cuuint64_t`.
            unsafe {
                sys::cuMemPoolSetAttribute(self.pool.0, attr, &mut zero as *mut u64 as *mut _)
                    .result()
                    .map_err(driver("cuMemPoolSetAttribute"))?;
            }
        }
        Ok(())
    }

    /// Every figure at once. Asynchronous frees only count once the stream reached them, so
    /// callers that want exact phase figures synchronise the device first.
    pub fn snapshot(&self) -> Result<GpuMemorySnapshot, GpuMemoryError> {
        let (free, total) = self.ctx.mem_get_info().map_err(driver("cuMemGetInfo"))?;
        Ok(GpuMemorySnapshot {
            used: self.current()?,
            used_high: self.peak()?,
            reserved: self
                .attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            device_used: (total - free) as u64,
            device_total: total as u64,
        })
    }

    /// Wait for all work on the device, so that the pool's counters include every free issued.
    pub fn synchronize(&self) -> Result<(), GpuMemoryError> {
        self.ctx.synchronize().map_err(driver("cuCtxSynchronize"))
    }
}

/// Free and total memory of every visible GPU, with its name, as the launcher reads it before
/// any worker starts (`crate::tools::gpu_fit`): each GPU's primary context is retained for the
/// query and released after it.
pub fn free_memory() -> Result<Vec<crate::tools::gpu_fit::GpuFree>, GpuMemoryError> {
    let n = CudaContext::device_count().map_err(driver("cuDeviceGetCount"))?;
    (0..n.max(0) as usize)
        .map(|gpu| {
            let ctx = CudaContext::new(gpu).map_err(driver("cuDevicePrimaryCtxRetain"))?;
            let (free, total) = ctx.mem_get_info().map_err(driver("cuMemGetInfo"))?;
            let name = ctx.name().map_err(driver("cuDeviceGetName"))?;
            Ok(crate::tools::gpu_fit::GpuFree {
                gpu,
                name,
                free: free as u64,
                total: total as u64,
            })
        })
        .collect()
}

/// The memory report's view: pool bytes in use and their high-water mark. A failing driver call
/// (which only happens when the device is lost) is logged and reads as 0.
impl crate::memory::MemoryProbe for CudaMemoryProbe {
    fn name(&self) -> &str {
        "cuda pool"
    }

    fn current(&self) -> u64 {
        CudaMemoryProbe::current(self).unwrap_or_else(|e| {
            tracing::warn!("GPU memory probe: {e}");
            0
        })
    }

    fn peak(&self) -> u64 {
        CudaMemoryProbe::peak(self).unwrap_or_else(|e| {
            tracing::warn!("GPU memory probe: {e}");
            0
        })
    }

    fn reset_peak(&self) {
        if let Err(e) = CudaMemoryProbe::reset_peak(self) {
            tracing::warn!("GPU memory probe: {e}");
        }
    }

    /// Phase figures count the frees the stream has reached: wait for it.
    fn settle(&self) {
        if let Err(e) = self.synchronize() {
            tracing::warn!("GPU memory probe: {e}");
        }
    }
}

/// Needs a CUDA GPU (run by `scripts/gpu-test.sh` through the trainer's test binary).
#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Tensor};

    #[test]
    fn pool_counters_follow_allocations() {
        let dev = Device::new_cuda(0).expect("needs a CUDA GPU");
        let probe = CudaMemoryProbe::new(&dev).unwrap();
        probe.synchronize().unwrap();
        probe.reset_peak().unwrap();
        let before = probe.current().unwrap();
        let bytes = 256u64 << 20;
        let t = Tensor::zeros((bytes / 4) as usize, DType::F32, &dev).unwrap();
        probe.synchronize().unwrap();
        let during = probe.current().unwrap();
        assert!(
            during >= before + bytes,
            "current {during} after a {bytes}-byte tensor (was {before})"
        );
        drop(t);
        probe.synchronize().unwrap();
        let after = probe.current().unwrap();
        assert!(
            after + bytes <= during,
            "freeing {bytes} bytes left current at {after} (was {during})"
        );
        assert!(probe.peak().unwrap() >= before + bytes);
        probe.reset_peak().unwrap();
        assert!(
            probe.peak().unwrap() < before + bytes,
            "reset_peak did not restart the mark"
        );
        let s = probe.snapshot().unwrap();
        assert!(s.device_total > s.device_used && s.device_used >= s.reserved);
    }
}
