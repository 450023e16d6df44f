//! Softmax cross-entropy per row, `loss_n = ln Σ_v e^(x_nv) − x_n,target`: the fused kernels, the
//! mean loss that picks them or [`plain::cross_entropy`], and the graph-free forward and backward.
//!
//! ```text
//!   plain:  logits (N, V) bf16 ─> f32 copy ─> x − max ─> exp ─> Σ ─> ln ─> gather
//!           every intermediate (N, V) f32 is kept for the backward (GPT-2: V = 50304)
//!   fused:  forward  one block per row: running (max, Σ e^(x−max)) ─> lse_n, loss_n
//!           (16 bytes of logits a thread and access where V and the pointers allow it)
//!           backward dlogits = (e^(x − lse) − onehot(target)) · g_n, in the logits' dtype
//! ```
//!
//! Only lse (N,) f32 is kept between forward and backward. The mean over rows stays a candle op,
//! so the caller may weight rows as it likes. Legend: `N` rows (tokens), `V` vocabulary.

use candle_core::{CustomOp2, DType, Layout, Result, Shape, Tensor, D};

use crate::msg;
use crate::plain::{self, log_softmax_last_dim, upcast};

/// Mean cross-entropy of logits (..., V) against u32 targets (...), differentiable in the
/// logits: the fused per-row kernel and a candle mean on CUDA, else [`plain::cross_entropy`].
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if !crate::fused_for(logits) {
        return plain::cross_entropy(logits, targets);
    }
    let v = logits.dim(D::Minus1)?;
    let n = plain::check_targets(logits, targets)?;
    let t = targets.flatten_all()?.to_dtype(DType::U32)?; // (N,)
    fused_rows(&logits.reshape((n, v))?, &t)?.mean_all() // scalar
}

/// Per-row cross-entropy (N,) f32 of logits (N, V) against u32 targets (N,) recording no graph,
/// and the per-row log-sum-exp (N,) f32 that [`backward`] takes.
pub fn forward(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    if crate::fused_for(logits) {
        return fused_forward(logits, targets);
    }
    if crate::cpu::takes(&[logits]) {
        return crate::cpu::cross_entropy(logits, targets);
    }
    let lf = upcast(logits)?;
    let logp = log_softmax_last_dim(&lf)?; // (N, V)
    let picked = logp.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)?; // (N,)
    let lse = (lf.narrow(1, 0, 1)?.squeeze(1)? - logp.narrow(1, 0, 1)?.squeeze(1)?)?; // (N,)
    Ok((picked.neg()?, lse))
}

/// dlogits (N, V) = (softmax − onehot(target)) · g in the logits' dtype, for per-row gradients
/// g (N,) f32 and the lse of [`forward`], recording no graph.
pub fn backward(logits: &Tensor, targets: &Tensor, lse: &Tensor, g: &Tensor) -> Result<Tensor> {
    if crate::fused_for(logits) {
        return fused_backward(logits, targets, lse, g);
    }
    if crate::cpu::takes(&[logits, lse, g]) {
        return crate::cpu::cross_entropy_backward(logits, targets, lse, g);
    }
    let v = logits.dim(1)?;
    let p = upcast(logits)?.broadcast_sub(&lse.unsqueeze(1)?)?.exp()?; // softmax (N, V)
    let ids = Tensor::arange(0u32, v as u32, logits.device())?.unsqueeze(0)?; // (1, V)
    let onehot = ids
        .broadcast_eq(&targets.unsqueeze(1)?)? // (N, V)
        .to_dtype(DType::F32)?;
    (p - onehot)?
        .broadcast_mul(&g.unsqueeze(1)?)?
        .to_dtype(logits.dtype())
}

/// Per-row cross-entropy (N,) f32 of logits (N, V) against u32 targets (N,) by the fused kernel
/// under autograd, differentiable in the logits. A target outside 0..V gives NaN for its row.
/// CUDA only.
pub(crate) fn fused_rows(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    check_rows(logits, targets)?;
    logits
        .contiguous()?
        .apply_op2(&targets.contiguous()?, CrossEntropy::default())
}

/// The targets of per-row losses must be u32 (N,) for logits (N, V).
fn check_rows(logits: &Tensor, targets: &Tensor) -> Result<()> {
    let (n, _v) = logits.dims2()?;
    if targets.dims() != [n] || targets.dtype() != DType::U32 {
        return Err(msg(format!(
            "cross_entropy: targets {:?} {:?} must be u32 ({n},) for logits {:?}",
            targets.dims(),
            targets.dtype(),
            logits.dims()
        )));
    }
    Ok(())
}

/// The fused forward without recording a graph: the per-row losses and the lse (CUDA only).
fn fused_forward(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    check_rows(logits, targets)?;
    let op = CrossEntropy::default();
    let loss = logits
        .contiguous()?
        .apply_op2_no_bwd(&targets.contiguous()?, &op)?;
    let lse = op
        .lse
        .lock()
        .map_err(|_| msg("cross_entropy: lse lock poisoned".into()))?
        .take()
        .ok_or_else(|| msg("cross_entropy: the forward left no lse".into()))?;
    Ok((loss, lse))
}

/// The recorded op: its forward leaves lse (N,) here for its backward.
#[derive(Default)]
struct CrossEntropy {
    lse: std::sync::Mutex<Option<Tensor>>,
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross-entropy"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        Err(msg(
            "cross_entropy_rows runs on CUDA only; the CPU path is gpt::cross_entropy".into(),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &candle_core::CudaStorage,
        ll: &Layout,
        targets: &candle_core::CudaStorage,
        lt: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (loss, lse) = imp::forward(logits, ll, targets, lt)?;
        *self
            .lse
            .lock()
            .map_err(|_| msg("cross_entropy: lse lock poisoned".into()))? = Some(lse);
        Ok((loss, Shape::from(ll.dims()[0])))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _loss: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let lse = self
            .lse
            .lock()
            .map_err(|_| msg("cross_entropy: lse lock poisoned".into()))?
            .clone()
            .ok_or_else(|| msg("cross_entropy: backward before forward".into()))?;
        let g = grad.to_dtype(DType::F32)?.contiguous()?;
        Ok((Some(fused_backward(logits, targets, &lse, &g)?), None))
    }
}

/// dlogits (N, V) in the logits' dtype, for per-row output gradients g (N,) f32, by the fused
/// kernel (CUDA only).
#[allow(unused_variables)]
fn fused_backward(logits: &Tensor, targets: &Tensor, lse: &Tensor, g: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        imp::backward(logits, targets, lse, g)
    }
    #[cfg(not(feature = "cuda"))]
    Err(msg(
        "the fused cross_entropy backward runs on CUDA only".into()
    ))
}

#[cfg(feature = "cuda")]
mod imp {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, Layout, Result, Tensor};

    use super::super::cuda::{blocks, by_dtype, device, kernel, slice, storage, tensor, view};

    const THREADS: usize = 512; // CE_THREADS in kernels.cu

    /// One block per row.
    fn rows(n: usize) -> LaunchConfig {
        blocks((n, 1), THREADS)
    }

    pub fn forward(
        logits: &CudaStorage,
        ll: &Layout,
        targets: &CudaStorage,
        lt: &Layout,
    ) -> Result<(CudaStorage, Tensor)> {
        by_dtype!(
            "cross_entropy",
            logits.dtype(),
            fwd(logits, ll, targets, lt)
        )
    }

    fn fwd<T: CudaDType + DeviceRepr>(
        logits: &CudaStorage,
        ll: &Layout,
        targets: &CudaStorage,
        lt: &Layout,
    ) -> Result<(CudaStorage, Tensor)> {
        let (n, v) = ll.shape().dims2()?;
        let dev = &logits.device;
        let xs = view::<T>(logits, ll)?;
        let ts = view::<u32>(targets, lt)?;
        // SAFETY: the kernel writes one loss and one lse per row.
        let (loss, lse) = unsafe { (dev.alloc::<f32>(n)?, dev.alloc::<f32>(n)?) };
        let f = kernel(dev, None, logits.dtype(), "ce_fwd")?;
        let v32 = v as i32;
        let mut b = f.builder();
        b.arg(&xs).arg(&ts).arg(&loss).arg(&lse).arg(&v32);
        // SAFETY: argument types and order match `ce_fwd` in kernels.cu.
        unsafe { b.launch(rows(n)) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(loss, dev.clone()),
            tensor(dev, lse, n),
        ))
    }

    pub fn backward(logits: &Tensor, targets: &Tensor, lse: &Tensor, g: &Tensor) -> Result<Tensor> {
        by_dtype!(
            "cross_entropy",
            logits.dtype(),
            bwd(logits, targets, lse, g)
        )
    }

    fn bwd<T: CudaDType + DeviceRepr>(
        logits: &Tensor,
        targets: &Tensor,
        lse: &Tensor,
        g: &Tensor,
    ) -> Result<Tensor> {
        let dev = device(logits)?;
        let (n, v) = logits.dims2()?;
        let (gx, ox) = storage(logits, "logits")?;
        let (gt, ot) = storage(targets, "targets")?;
        let (gl, ol) = storage(lse, "lse")?;
        let (gg, og) = storage(g, "grad")?;
        let xs = slice::<T>(&gx)?.slice(ox..);
        let ts = slice::<u32>(&gt)?.slice(ot..);
        let ls = slice::<f32>(&gl)?.slice(ol..);
        let gs = slice::<f32>(&gg)?.slice(og..);
        // SAFETY: the kernel writes every element of every row.
        let dx = unsafe { dev.alloc::<T>(n * v)? };
        let f = kernel(&dev, None, logits.dtype(), "ce_bwd")?;
        let v32 = v as i32;
        let mut b = f.builder();
        b.arg(&xs).arg(&ts).arg(&ls).arg(&gs).arg(&dx).arg(&v32);
        // SAFETY: argument types and order match `ce_bwd` in kernels.cu.
        unsafe { b.launch(rows(n)) }.w()?;
        Ok(tensor(&dev, dx, (n, v)))
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use crate::testing::{cuda, rel_err};
    use candle_core::Var;

    /// Mean loss and dlogits of the fused kernel against plain::cross_entropy in f32.
    fn check(n: usize, v: usize, dtype: DType, tol: f64) {
        let Some(dev) = cuda() else {
            return;
        };
        let x = (Tensor::randn(0f32, 1f32, (n, v), &dev).unwrap() * 3.0).unwrap();
        let x = x.to_dtype(dtype).unwrap();
        let t: Vec<u32> = (0..n).map(|i| ((i * 7919 + 13) % v) as u32).collect();
        let t = Tensor::from_vec(t, n, &dev).unwrap();
        let run = |fused: bool, dt: DType| {
            let xv = Var::from_tensor(&x.to_dtype(dt).unwrap()).unwrap();
            let loss = if fused {
                fused_rows(xv.as_tensor(), &t).unwrap().mean_all().unwrap()
            } else {
                plain::cross_entropy(xv.as_tensor(), &t).unwrap()
            };
            let g = loss.backward().unwrap();
            (loss, g.get(xv.as_tensor()).unwrap().clone())
        };
        let (l, g) = run(true, dtype);
        let (l_ref, g_ref) = run(false, DType::F32);
        let (l, l_ref) = (
            l.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap(),
            l_ref
                .to_dtype(DType::F64)
                .unwrap()
                .to_scalar::<f64>()
                .unwrap(),
        );
        assert!(
            (l - l_ref).abs() / l_ref.abs() < 1e-5,
            "loss {l} vs {l_ref}"
        );
        let e = rel_err(&g, &g_ref);
        assert!(
            e < tol,
            "dlogits rel err {e} >= {tol} ({n} x {v}, {dtype:?})"
        );
    }

    #[test]
    fn matches_plain_cross_entropy() {
        // 16 bytes a thread (V a multiple of 8 bf16 or 4 f32), then one logit a thread.
        check(300, 50304, DType::BF16, 1e-2);
        check(64, 1000, DType::F32, 1e-5);
        check(40, 50257, DType::BF16, 1e-2);
        check(33, 1001, DType::F32, 1e-5);
    }
}
