//! Softmax cross-entropy per row, `loss_n = ln Σ_v e^(x_nv) − x_n,target`: the fused kernels, the
//! mean loss that picks them or [`plain::cross_entropy`], and the graph-free forward and backward.
//!
//! ```text
//!   plain:  logits (N, V) bf16 ─> f32 copy ─> x − max ─> exp ─> Σ ─> ln ─> gather
//!           every intermediate (N, V) f32 is kept for the backward (GPT-2: V = 50304)
//!   fused:  forward  one block per row: running (max, Σ e^(x−max)) ─> lse_n, loss_n
//!           (16 bytes of logits a thread and access where V and the pointers allow it)
//!           backward dlogits = (e^(x − lse) − onehot(target)) · g_n, in the logits' dtype
//!   taped:  backward_in_place writes dlogits over the logits: one (N, V) tensor, not two
//! ```
//!
//! Only lse (N,) f32 is kept between forward and backward. The mean over rows stays a candle op,
//! so the caller may weight rows as it likes. Legend: `N` rows (tokens), `V` vocabulary.

use candle_core::{CustomOp2, DType, InplaceOp1, Layout, Result, Shape, Tensor, D};

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
/// and the per-row log-sum-exp (N,) f32 that [`backward_in_place`] takes.
pub fn forward(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    crate::profile::elementwise("cross_entropy", &[logits, targets], || {
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
    })
}

/// dlogits (N, V) = (softmax − onehot(target)) · g in the logits' dtype, for per-row gradients
/// g (N,) f32 and the lse of [`forward`], recording no graph, **written over the logits**: the
/// caller (the head tape) owns them and reads them no more, so the step holds one (N, V) tensor
/// where it would hold two. Contiguous CUDA f32/bf16 logits (the fused kernel) and CPU f32
/// logits (the CPU loop) are overwritten and returned; other logits get a fresh tensor from
/// candle ops. Any other tensor sharing the logits' storage reads dlogits afterwards.
pub fn backward_in_place(
    logits: Tensor,
    targets: &Tensor,
    lse: &Tensor,
    g: &Tensor,
) -> Result<Tensor> {
    // In place: the logits are read and the gradient written over them.
    let read = crate::profile::bytes(&[&logits, targets, lse, g]);
    let (dev, elems) = (logits.device().clone(), logits.elem_count() as f64);
    crate::profile::op(&dev, || in_place_grad(logits, targets, lse, g), |dz| {
        let flops = crate::profile::per_element("cross_entropy backward") * elems;
        let bytes = read + crate::profile::bytes(&[dz]);
        ("cross_entropy backward".into(), crate::profile::Cost { flops, bytes })
    })
}

/// [`backward_in_place`] itself.
fn in_place_grad(logits: Tensor, targets: &Tensor, lse: &Tensor, g: &Tensor) -> Result<Tensor> {
    check_rows(&logits, targets)?;
    let n = logits.dim(0)?;
    if lse.dims() != [n] || g.dims() != [n] {
        return Err(msg(format!(
            "cross_entropy backward: lse {:?} and row gradients {:?} must be ({n},) for logits {:?}",
            lse.dims(),
            g.dims(),
            logits.dims()
        )));
    }
    let kernels = crate::fused_for(&logits) || crate::cpu::takes(&[&logits, lse, g]);
    if kernels && logits.is_contiguous() {
        let op = InPlace {
            targets: targets.contiguous()?,
            lse: lse.contiguous()?,
            g: g.contiguous()?,
        };
        logits.inplace_op1(&op)?;
        return Ok(logits);
    }
    let v = logits.dim(1)?;
    let p = upcast(&logits)?.broadcast_sub(&lse.unsqueeze(1)?)?.exp()?; // softmax (N, V)
    let ids = Tensor::arange(0u32, v as u32, logits.device())?.unsqueeze(0)?; // (1, V)
    let onehot = ids
        .broadcast_eq(&targets.unsqueeze(1)?)? // (N, V)
        .to_dtype(DType::F32)?;
    (p - onehot)?
        .broadcast_mul(&g.unsqueeze(1)?)?
        .to_dtype(logits.dtype())
}

/// [`backward_in_place`]'s op on the logits' storage: the CPU loop or the fused kernel.
struct InPlace {
    /// (N,) u32
    targets: Tensor,
    /// (N,) f32
    lse: Tensor,
    /// (N,) f32
    g: Tensor,
}

impl InplaceOp1 for InPlace {
    fn name(&self) -> &'static str {
        "cross-entropy backward in place"
    }

    fn cpu_fwd(&self, storage: &mut candle_core::CpuStorage, layout: &Layout) -> Result<()> {
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| msg("cross_entropy backward: the logits are not contiguous".into()))?;
        let candle_core::CpuStorage::F32(x) = storage else {
            return Err(msg("cross_entropy backward: CPU logits must be f32".into()));
        };
        crate::cpu::cross_entropy_backward(
            &mut x[start..end],
            layout.dims()[1],
            &self.targets,
            &self.lse,
            &self.g,
        )
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, storage: &mut candle_core::CudaStorage, layout: &Layout) -> Result<()> {
        imp::backward_in_place(storage, layout, &self.targets, &self.lse, &self.g)
    }
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
    use candle_core::cuda_backend::cudarc::driver::{CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
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
        let xs = slice::<T>(&gx)?.slice(ox..);
        // SAFETY: the kernel writes every element of every row.
        let dx = unsafe { dev.alloc::<T>(n * v)? };
        let f = kernel(&dev, None, logits.dtype(), "ce_bwd")?;
        let v32 = v as i32;
        per_row(targets, lse, g, |ts, ls, gs| {
            let mut b = f.builder();
            b.arg(&xs).arg(ts).arg(ls).arg(gs).arg(&dx).arg(&v32);
            // SAFETY: argument types and order match `ce_bwd` in kernels.cu.
            unsafe { b.launch(rows(n)) }.w().map(|_| ())
        })?;
        Ok(tensor(&dev, dx, (n, v)))
    }

    /// `launch` with the device views of the per-row inputs: targets (N,) u32, lse and g (N,) f32.
    fn per_row(
        targets: &Tensor,
        lse: &Tensor,
        g: &Tensor,
        launch: impl FnOnce(&CudaView<u32>, &CudaView<f32>, &CudaView<f32>) -> Result<()>,
    ) -> Result<()> {
        let (gt, ot) = storage(targets, "targets")?;
        let (gl, ol) = storage(lse, "lse")?;
        let (gg, og) = storage(g, "grad")?;
        let ts = slice::<u32>(&gt)?.slice(ot..);
        let ls = slice::<f32>(&gl)?.slice(ol..);
        let gs = slice::<f32>(&gg)?.slice(og..);
        launch(&ts, &ls, &gs)
    }

    /// The logits (N, V) at `l` in `x` overwritten by dlogits (`ce_bwd_in_place`).
    pub fn backward_in_place(
        x: &mut CudaStorage,
        l: &Layout,
        targets: &Tensor,
        lse: &Tensor,
        g: &Tensor,
    ) -> Result<()> {
        by_dtype!(
            "cross_entropy",
            x.dtype(),
            bwd_in_place(x, l, targets, lse, g)
        )
    }

    fn bwd_in_place<T: CudaDType + DeviceRepr>(
        x: &mut CudaStorage,
        l: &Layout,
        targets: &Tensor,
        lse: &Tensor,
        g: &Tensor,
    ) -> Result<()> {
        let (n, v) = l.shape().dims2()?;
        let f = kernel(&x.device, None, x.dtype(), "ce_bwd_in_place")?;
        let mut xs = x.as_cuda_slice_mut::<T>()?.slice_mut(l.start_offset()..);
        let v32 = v as i32;
        per_row(targets, lse, g, |ts, ls, gs| {
            let mut b = f.builder();
            b.arg(&mut xs).arg(ts).arg(ls).arg(gs).arg(&v32);
            // SAFETY: argument types and order match `ce_bwd_in_place` in kernels.cu; the
            // caller's layout is contiguous (N, V), every row read and written by one block.
            unsafe { b.launch(rows(n)) }.w().map(|_| ())
        })
    }
}

#[cfg(test)]
mod host_tests {
    use super::*;
    use candle_core::Device;

    /// dlogits written over the logits (a handle sharing them reads the gradient) equal the
    /// softmax-minus-one-hot formula in candle ops, and bad row gradients are named.
    #[test]
    fn backward_in_place_overwrites_the_logits_with_their_gradient() -> Result<()> {
        let dev = Device::Cpu;
        let (n, v) = (37, 301);
        let z = (Tensor::randn(0f32, 1f32, (n, v), &dev)? * 3.0)?;
        let ids: Vec<u32> = (0..n).map(|i| ((i * 7919 + 13) % v) as u32).collect();
        let t = Tensor::from_vec(ids, n, &dev)?;
        let (_, lse) = forward(&z, &t)?;
        let g = Tensor::randn(0f32, 1f32, n, &dev)?;
        let onehot = Tensor::arange(0u32, v as u32, &dev)?
            .unsqueeze(0)?
            .broadcast_eq(&t.unsqueeze(1)?)?
            .to_dtype(DType::F32)?; // (N, V)
        let want = (z.broadcast_sub(&lse.unsqueeze(1)?)?.exp()? - onehot)?
            .broadcast_mul(&g.unsqueeze(1)?)?;
        let logits = z.copy()?;
        let shared = logits.clone();
        let dz = backward_in_place(logits, &t, &lse, &g)?;
        let err = (&dz - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(err <= 1e-6 * scale, "dlogits max err {err} (scale {scale})");
        let same = (&shared - &dz)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(same, 0.0, "the logits' storage does not hold dlogits");
        let bad = backward_in_place(z.copy()?, &t, &lse, &g.narrow(0, 0, n - 1)?);
        assert!(bad.unwrap_err().to_string().contains("[36]"));
        Ok(())
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use crate::testing::{cuda, rel_err};
    use candle_core::Var;

    /// Mean loss and dlogits of the fused kernel against plain::cross_entropy in f32.
    fn check(n: usize, v: usize, dtype: DType, tol: f64) {
        let dev = cuda();
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

    /// The in-place backward writes the out-of-place kernel's bits over the logits.
    #[test]
    fn in_place_backward_matches_the_fused_backward() {
        let dev = cuda();
        for (n, v, dtype) in [(64, 50304, DType::BF16), (33, 1001, DType::F32)] {
            let x = (Tensor::randn(0f32, 1f32, (n, v), &dev).unwrap() * 3.0).unwrap();
            let x = x.to_dtype(dtype).unwrap();
            let t: Vec<u32> = (0..n).map(|i| ((i * 7919 + 13) % v) as u32).collect();
            let t = Tensor::from_vec(t, n, &dev).unwrap();
            let (_, lse) = forward(&x, &t).unwrap();
            let g = Tensor::randn(0f32, 1f32, n, &dev).unwrap();
            let want = fused_backward(&x, &t, &lse, &g).unwrap();
            let got = backward_in_place(x.copy().unwrap(), &t, &lse, &g).unwrap();
            let bits = |d: &Tensor| d.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(bits(&got) == bits(&want), "{n} x {v} {dtype:?}: other bits in place");
        }
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
