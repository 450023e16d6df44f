//! A scalar's read-back started now and waited for later ([`ReadLater`]), so the host can queue
//! more work behind the value and then wait for the value alone, not for that work.
//!
//! ```text
//!   stream:  … backward ─ norm ─ [copy → pinned] ─ AdamW ──────────── next forward …
//!   host:    start() ──────────── queue AdamW ── wait() ─ next forward's launches …
//!                                                  └ returns when the copy is done, while
//!                                                    AdamW still runs
//! ```
//!
//! A plain `to_scalar` would be queued after AdamW and wait for it too, leaving the device idle
//! from AdamW's end until the host has queued the next step's first kernel. On CUDA the copy goes
//! into page-locked host memory with its own event; the buffers are kept for reuse (freeing
//! page-locked memory can wait for the whole device). On the CPU the value is read at once.

use candle_core::{DType, Result, Tensor};

use crate::msg;

/// The value of a one-element f64 tensor, on its way to the host.
pub struct ReadLater(Pending);

enum Pending {
    Ready(f64),
    #[cfg(feature = "cuda")]
    Copying(imp::Pinned),
}

impl ReadLater {
    /// Starts reading `t` (one f64 element): on CUDA an asynchronous copy queued on its
    /// stream now, behind the work that computes it; on the CPU the value itself.
    pub fn start(t: &Tensor) -> Result<Self> {
        if t.dtype() != DType::F64 || t.elem_count() != 1 {
            return Err(msg(format!(
                "ReadLater: expected one f64, got {:?} {:?}",
                t.dtype(),
                t.dims()
            )));
        }
        #[cfg(feature = "cuda")]
        if t.device().is_cuda() {
            return Ok(Self(Pending::Copying(imp::start(t)?)));
        }
        Ok(Self(Pending::Ready(t.flatten_all()?.to_vec1::<f64>()?[0])))
    }

    /// Waits for the copy (only for it: work queued after [`ReadLater::start`] may still run)
    /// and returns the value.
    pub fn wait(self) -> Result<f64> {
        match self.0 {
            Pending::Ready(x) => Ok(x),
            #[cfg(feature = "cuda")]
            Pending::Copying(p) => imp::wait(p),
        }
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use std::cell::RefCell;
    use std::sync::Arc;

    use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaEvent, PinnedHostSlice};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{Result, Tensor};

    use crate::cuda::{device, slice, storage};

    /// A page-locked value and the event recorded behind the copy into it. The event is ours:
    /// cudarc records a pinned buffer's own event only while it tracks events across several
    /// streams, which a training process turns off ([`crate::order_by_stream`]) and a
    /// one-stream context never does, and a wait on an unrecorded event returns at once, with
    /// the buffer's previous value.
    pub struct Pinned {
        host: PinnedHostSlice<f64>,
        copied: CudaEvent,
    }

    thread_local! {
        /// Page-locked one-value buffers (and their events) done with, for the next read on
        /// this thread.
        static FREE: RefCell<Vec<Pinned>> = const { RefCell::new(Vec::new()) };
    }

    fn take(ctx: &Arc<CudaContext>) -> Result<Pinned> {
        let reused = FREE.with(|f| {
            let mut f = f.borrow_mut();
            let at = f.iter().position(|p| Arc::ptr_eq(p.host.context(), ctx))?;
            Some(f.swap_remove(at))
        });
        match reused {
            Some(p) => Ok(p),
            None => Ok(Pinned {
                // SAFETY: the one value is written by the copy before `wait` reads it.
                host: unsafe { ctx.alloc_pinned_with_flags::<f64>(1, 0) }.w()?,
                copied: ctx.new_event(None).w()?,
            }),
        }
    }

    pub fn start(t: &Tensor) -> Result<Pinned> {
        let dev = device(t)?;
        let stream = dev.cuda_stream();
        let mut p = take(stream.context())?;
        let (st, off) = storage(t, "ReadLater")?;
        let src = slice::<f64>(&st)?.slice(off..off + 1);
        // Queued on the tensor's stream, the event right behind it.
        stream.memcpy_dtoh(&src, &mut p.host).w()?;
        p.copied.record(&stream).w()?;
        Ok(p)
    }

    pub fn wait(p: Pinned) -> Result<f64> {
        p.copied.synchronize().w()?; // the copy is done
        let x = p.host.as_slice().w()?[0];
        FREE.with(|f| f.borrow_mut().push(p));
        Ok(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value read later is the tensor's, on the CPU and (on a build with the `cuda` feature)
    /// on CUDA, also after more work was queued behind it, behind long work queued before it,
    /// and with the buffer reused; anything but one f64 is refused.
    #[test]
    fn reads_the_value_after_later_work() -> Result<()> {
        let devices = crate::testing::devices();
        for dev in devices {
            for round in 0..3 {
                let x = Tensor::new(&[1.5f64 + round as f64, -2.0], &dev)?;
                let sum = x.sum_all()?; // () f64
                let read = ReadLater::start(&sum)?;
                let later = (x.sqr()? * 3.0)?.sum_all()?; // queued behind the copy
                assert_eq!(read.wait()?, -0.5 + round as f64, "{dev:?}");
                assert!(later.to_scalar::<f64>()? > 0.0);
            }
            // Milliseconds of products queued before the value, so a wait that does not wait
            // for the copy reads the reused buffer's previous value.
            let a = Tensor::randn(0f32, 1f32, (2048, 2048), &dev)?;
            for round in 0..3 * dev.is_cuda() as usize {
                let mut h = a.clone();
                for _ in 0..8 {
                    h = (h.matmul(&a)? * 1e-3)?;
                }
                let v = ((h.sum_all()? * 0.0)?.to_dtype(DType::F64)? + (10 + round) as f64)?;
                assert_eq!(ReadLater::start(&v)?.wait()?, (10 + round) as f64, "{dev:?}");
            }
            let e = ReadLater::start(&Tensor::new(1f32, &dev)?).err().unwrap();
            assert!(e.to_string().contains("one f64"), "{e}");
        }
        Ok(())
    }
}
