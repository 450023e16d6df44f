//! LayerNorm over the last dimension: the fused kernels (forward and backward, statistics in f32),
//! the op that picks them or [`plain::layer_norm`], and its graph-free forward and backward.
//!
//! ```text
//!   plain:  x ─> f32 ─> mean ─> x−mean ─> sqr ─> mean ─> +eps ─> sqrt ─> ÷ ─> ·w ─> +b ─> bf16
//!           (about 12 kernels forward, twice that backward, (N, C) f32 copies kept)
//!   fused:  forward   ln_fwd     one warp per row: mean, rstd = 1/√(var + eps), y
//!           backward  ln_bwd_dx  one warp per row: dx = rstd·(dy·w − mean(dy·w) − x̂·mean(dy·w·x̂)),
//!                                plus a residual branch's gradient where one is given
//!                     ln_bwd_dwdb 8 warps over 64 rows, a lane 16 bytes of columns: dw = Σ dy·x̂, db = Σ dy
//! ```
//!
//! Only mean and rstd (N,) f32 are kept for the backward; `x̂ = (x − mean)·rstd` is rebuilt.
//! Each access moves 16 bytes a lane (8 bf16 or 4 f32) where C and the pointers allow it.
//! Legend: `N` rows (tokens), `C` width.

use candle_core::{CustomOp3, Layout, Result, Shape, Tensor, D};

use crate::msg;
use crate::plain::{self, upcast};

/// Whether the fused kernels take x with weight and bias (or output gradient) `w`, `b`: CUDA,
/// bf16 or f32, one dtype.
fn fuses(x: &Tensor, w: &Tensor, b: &Tensor) -> bool {
    crate::fused_for(x) && w.dtype() == x.dtype() && b.dtype() == x.dtype()
}

/// LayerNorm of x (..., C) with weight and bias (C,), biased variance, in x's dtype;
/// differentiable in all three. The fused kernel where it applies, else [`plain::layer_norm`].
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    if fuses(x, w, b) {
        fused(x, w, b, eps)
    } else {
        plain::layer_norm(x, w, b, eps)
    }
}

/// The fused kernel under autograd (CUDA only).
pub(crate) fn fused(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let c = x.dims().last().copied().unwrap_or(0);
    if w.dims() != [c] || b.dims() != [c] {
        return Err(msg(format!(
            "layer_norm: weight {:?} and bias {:?} must be ({c},) for x {:?}",
            w.dims(),
            b.dims(),
            x.dims()
        )));
    }
    if w.dtype() != x.dtype() || b.dtype() != x.dtype() {
        return Err(msg(format!(
            "layer_norm: x {:?}, weight {:?}, bias {:?} must share a dtype",
            x.dtype(),
            w.dtype(),
            b.dtype()
        )));
    }
    x.contiguous()?
        .apply_op3(&w.contiguous()?, &b.contiguous()?, LayerNormOp::new(eps))
}

/// LayerNorm of x (N, C) recording no graph: y and the per-row statistics mean and
/// rstd = 1/√(var + eps), (N,) in f32, that [`backward`] takes.
pub fn forward(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<(Tensor, Tensor, Tensor)> {
    crate::profile::elementwise("layer_norm", &[x, w, b], || {
        if fuses(x, w, b) {
            return fused_forward(x, w, b, eps);
        }
        if crate::cpu::takes(&[x, w, b]) {
            return crate::cpu::layer_norm(x, w, b, eps);
        }
        let (y, mean, std) = plain::layer_norm_parts(x, w, b, eps)?; // statistics (N, 1)
        Ok((
            y,
            mean.squeeze(D::Minus1)?,
            std.recip()?.squeeze(D::Minus1)?,
        ))
    })
}

/// (dx, dw, db) of LayerNorm from x (N, C), w, dy and the statistics of [`forward`], recording
/// no graph. On CPU in candle ops: `dx = rstd · (dŷ − mean(dŷ) − x̂ · mean(dŷ · x̂))`, dŷ = dy · w.
pub fn backward(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    crate::profile::elementwise("layer_norm backward", &[x, w, dy, mean, rstd], || {
        if fuses(x, w, dy) {
            return fused_backward(x, w, dy, mean, rstd, None);
        }
        unfused_backward(x, w, dy, mean, rstd)
    })
}

/// [`backward`] with the gradient of a residual branch added to dx: `(res + dx, dw, db)` for
/// `res` like x, as a pre-LayerNorm block's backward needs it (`dx1 = dout + ln_2ᵀ(dh2)`). The
/// fused kernel adds it in the same pass over the rows (one rounding of the sum); elsewhere it is
/// one add after [`backward`].
pub fn backward_residual(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    res: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    crate::profile::elementwise("layer_norm backward", &[x, w, dy, mean, rstd, res], || {
        like_x("residual", res, x)?;
        if fuses(x, w, dy) {
            return fused_backward(x, w, dy, mean, rstd, Some(&res.contiguous()?));
        }
        let (dx, dw, db) = unfused_backward(x, w, dy, mean, rstd)?;
        Ok(((res + dx)?, dw, db))
    })
}

/// An error naming `what` unless `t` has x's shape and dtype.
fn like_x(what: &str, t: &Tensor, x: &Tensor) -> Result<()> {
    if t.dims() == x.dims() && t.dtype() == x.dtype() {
        return Ok(());
    }
    Err(msg(format!(
        "layer_norm: {what} {:?} {:?} does not match x {:?} {:?}",
        t.dims(),
        t.dtype(),
        x.dims(),
        x.dtype()
    )))
}

/// [`backward`] without the fused kernels: the one-pass CPU loops, else candle ops.
fn unfused_backward(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    if crate::cpu::takes(&[x, w, dy, mean, rstd]) {
        return crate::cpu::layer_norm_backward(x, w, dy, mean, rstd);
    }
    let (mean, rstd) = (mean.unsqueeze(D::Minus1)?, rstd.unsqueeze(D::Minus1)?); // (N, 1)
    let xhat = upcast(x)?.broadcast_sub(&mean)?.broadcast_mul(&rstd)?; // (N, C)
    let dyf = upcast(dy)?;
    let dw = (&dyf * &xhat)?.sum(0)?.to_dtype(w.dtype())?; // (C,)
    let db = dyf.sum(0)?.to_dtype(w.dtype())?; // (C,)
    let dyw = dyf.broadcast_mul(&upcast(w)?)?;
    let m1 = dyw.mean_keepdim(D::Minus1)?; // (N, 1)
    let m2 = (&dyw * &xhat)?.mean_keepdim(D::Minus1)?; // (N, 1)
    let dx = dyw
        .broadcast_sub(&m1)?
        .sub(&xhat.broadcast_mul(&m2)?)?
        .broadcast_mul(&rstd)?
        .to_dtype(x.dtype())?; // (N, C)
    Ok((dx, dw, db))
}

/// The fused forward without recording a graph: y and the statistics (CUDA only).
fn fused_forward(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<(Tensor, Tensor, Tensor)> {
    let op = LayerNormOp::new(eps);
    let y = x
        .contiguous()?
        .apply_op3_no_bwd(&w.contiguous()?, &b.contiguous()?, &op)?;
    let (mean, rstd) = op
        .stats
        .lock()
        .map_err(|_| msg("layer_norm: stats lock poisoned".into()))?
        .take()
        .ok_or_else(|| msg("layer_norm: the forward left no statistics".into()))?;
    Ok((y, mean, rstd))
}

/// The recorded op: its forward leaves (mean, rstd) here for its backward.
struct LayerNormOp {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    eps: f64,
    stats: std::sync::Mutex<Option<(Tensor, Tensor)>>,
}

impl LayerNormOp {
    fn new(eps: f64) -> Self {
        Self {
            eps,
            stats: std::sync::Mutex::new(None),
        }
    }
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "layer-norm"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        Err(msg(
            "the fused layer_norm runs on CUDA only; the CPU path is plain::layer_norm".into(),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (y, stats) = imp::forward(x, lx, w, lw, b, lb, self.eps)?;
        *self
            .stats
            .lock()
            .map_err(|_| msg("layer_norm: stats lock poisoned".into()))? = Some(stats);
        Ok((y, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (mean, rstd) = self
            .stats
            .lock()
            .map_err(|_| msg("layer_norm: stats lock poisoned".into()))?
            .clone()
            .ok_or_else(|| msg("layer_norm: backward before forward".into()))?;
        let (dx, dw, db) = fused_backward(x, w, &grad.contiguous()?, &mean, &rstd, None)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// (dx [+ res], dw, db) from x, w, dy and the forward's statistics, by the fused kernels (CUDA
/// only); `res` contiguous, like x.
#[allow(unused_variables)]
fn fused_backward(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    res: Option<&Tensor>,
) -> Result<(Tensor, Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    {
        imp::backward(x, w, dy, mean, rstd, res)
    }
    #[cfg(not(feature = "cuda"))]
    Err(msg("the fused layer_norm backward runs on CUDA only".into()))
}

#[cfg(feature = "cuda")]
mod imp {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, Layout, Result, Tensor};

    use super::super::cuda::{
        blocks, by_dtype, column_blocks, device, kernel, slice, storage, tensor, view,
    };
    use super::super::msg;

    /// One warp per row, 8 rows per block.
    const ROWS_PER_BLOCK: usize = 8;
    /// Rows per block of `ln_bwd_dwdb` (LN_ROWS in kernels.cu) and its threads (LN_WARPS
    /// warps); a block takes 32 lanes x 16 bytes of columns at a time.
    const DWDB_ROWS: usize = 64;
    const DWDB_THREADS: usize = 256;

    fn rows_config(n: usize) -> LaunchConfig {
        blocks((n.div_ceil(ROWS_PER_BLOCK), 1), 32 * ROWS_PER_BLOCK)
    }

    fn n_c(shape: &[usize]) -> Result<(usize, usize)> {
        match shape.split_last() {
            Some((&c, lead)) if c > 0 => Ok((lead.iter().product(), c)),
            _ => Err(msg(format!("layer_norm: bad input shape {shape:?}"))),
        }
    }

    #[allow(clippy::type_complexity)]
    pub fn forward(
        x: &CudaStorage,
        lx: &Layout,
        w: &CudaStorage,
        lw: &Layout,
        b: &CudaStorage,
        lb: &Layout,
        eps: f64,
    ) -> Result<(CudaStorage, (Tensor, Tensor))> {
        by_dtype!("layer_norm", x.dtype(), fwd(x, lx, w, lw, b, lb, eps))
    }

    #[allow(clippy::type_complexity)]
    fn fwd<T: CudaDType + DeviceRepr>(
        x: &CudaStorage,
        lx: &Layout,
        w: &CudaStorage,
        lw: &Layout,
        b: &CudaStorage,
        lb: &Layout,
        eps: f64,
    ) -> Result<(CudaStorage, (Tensor, Tensor))> {
        for (l, what) in [(lx, "x"), (lw, "weight"), (lb, "bias")] {
            if !l.is_contiguous() {
                return Err(msg(format!(
                    "layer_norm: {what} {:?} is not contiguous",
                    l.dims()
                )));
            }
        }
        let dev = &x.device;
        let (n, c) = n_c(lx.dims())?;
        let xs = view::<T>(x, lx)?;
        let ws = view::<T>(w, lw)?;
        let bs = view::<T>(b, lb)?;
        // SAFETY: every element is written by the kernel (one warp per row, every column).
        let y = unsafe { dev.alloc::<T>(n * c)? };
        let mean = unsafe { dev.alloc::<f32>(n)? };
        let rstd = unsafe { dev.alloc::<f32>(n)? };
        let f = kernel(dev, None, x.dtype(), "ln_fwd")?;
        let (n32, c32, eps32) = (n as i32, c as i32, eps as f32);
        let mut bl = f.builder();
        bl.arg(&xs).arg(&ws).arg(&bs).arg(&y).arg(&mean).arg(&rstd);
        bl.arg(&n32).arg(&c32).arg(&eps32);
        // SAFETY: argument types and order match `ln_fwd` in kernels.cu.
        unsafe { bl.launch(rows_config(n)) }.w()?;
        let stats = (tensor(dev, mean, n), tensor(dev, rstd, n));
        Ok((CudaStorage::wrap_cuda_slice(y, dev.clone()), stats))
    }

    pub fn backward(
        x: &Tensor,
        w: &Tensor,
        dy: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        res: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        by_dtype!("layer_norm", x.dtype(), bwd(x, w, dy, mean, rstd, res))
    }

    fn bwd<T: CudaDType + DeviceRepr>(
        x: &Tensor,
        w: &Tensor,
        dy: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        res: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let dev = device(x)?;
        let (n, c) = n_c(x.dims())?;
        super::like_x("gradient", dy, x)?;
        let (gx, ox) = storage(x, "x")?;
        let (gw, ow) = storage(w, "weight")?;
        let (gd, od) = storage(dy, "grad")?;
        let (gm, om) = storage(mean, "mean")?;
        let (gr, or) = storage(rstd, "rstd")?;
        let xs = slice::<T>(&gx)?.slice(ox..);
        let ws = slice::<T>(&gw)?.slice(ow..);
        let ds = slice::<T>(&gd)?.slice(od..);
        let ms = slice::<f32>(&gm)?.slice(om..);
        let rs = slice::<f32>(&gr)?.slice(or..);
        // SAFETY: every element of dx is written by `ln_bwd_dx`; dw and db are zeroed here.
        let dx = unsafe { dev.alloc::<T>(n * c)? };
        let dw = dev.alloc_zeros::<f32>(c)?;
        let db = dev.alloc_zeros::<f32>(c)?;
        let (n32, c32) = (n as i32, c as i32);

        let gres = res.map(|r| storage(r, "residual")).transpose()?;
        let res_s = match &gres {
            Some((g, o)) => Some(slice::<T>(g)?.slice(*o..)),
            None => None,
        };
        let add_res = i32::from(res.is_some());
        let f = kernel(&dev, None, x.dtype(), "ln_bwd_dx")?;
        let mut bl = f.builder();
        bl.arg(&xs).arg(&ws).arg(&ds).arg(&ms).arg(&rs).arg(&dx);
        // Without a residual, dy stands in for it (the kernel does not read it then).
        bl.arg(&n32)
            .arg(&c32)
            .arg(res_s.as_ref().unwrap_or(&ds))
            .arg(&add_res);
        // SAFETY: argument types and order match `ln_bwd_dx` in kernels.cu.
        unsafe { bl.launch(rows_config(n)) }.w()?;

        let f = kernel(&dev, None, x.dtype(), "ln_bwd_dwdb")?;
        let mut bl = f.builder();
        bl.arg(&xs).arg(&ds).arg(&ms).arg(&rs).arg(&dw).arg(&db);
        bl.arg(&n32).arg(&c32);
        let cols = 32 * 16 / std::mem::size_of::<T>();
        let cfg = column_blocks(n, c, DWDB_ROWS, DWDB_THREADS, cols);
        // SAFETY: argument types and order match `ln_bwd_dwdb` in kernels.cu.
        unsafe { bl.launch(cfg) }.w()?;

        let dtype = w.dtype();
        Ok((
            tensor(&dev, dx, x.shape().clone()),
            tensor(&dev, dw, c).to_dtype(dtype)?,
            tensor(&dev, db, c).to_dtype(dtype)?,
        ))
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use crate::testing::{cuda, rel_err};
    use candle_core::{DType, Var};

    /// Output and dx, dw, db of the fused kernel against `plain::layer_norm`'s candle ops
    /// computed in f32 from the same inputs.
    fn check(n: usize, c: usize, dtype: DType, tol: f64) {
        let dev = cuda();
        let r = |s: &[usize], mean: f32| {
            Tensor::randn(mean, 1f32, s, &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        };
        // An offset mean in x checks that the variance is taken about the mean.
        let (x, w, b, g) = (
            r(&[2, n, c], 3.0),
            r(&[c], 1.0),
            r(&[c], 0.0),
            r(&[2, n, c], 0.0),
        );
        let run = |fused: bool, dt: DType| {
            let vars: Vec<Var> = [&x, &w, &b]
                .iter()
                .map(|t| Var::from_tensor(&t.to_dtype(dt).unwrap()).unwrap())
                .collect();
            let (xv, wv, bv) = (
                vars[0].as_tensor(),
                vars[1].as_tensor(),
                vars[2].as_tensor(),
            );
            let y = if fused {
                super::fused(xv, wv, bv, 1e-5).unwrap()
            } else {
                plain::layer_norm(xv, wv, bv, 1e-5).unwrap()
            };
            let grads = (&y * g.to_dtype(dt).unwrap())
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let gs: Vec<Tensor> = vars
                .iter()
                .map(|v| grads.get(v.as_tensor()).unwrap().clone())
                .collect();
            (y, gs)
        };
        let (y, gs) = run(true, dtype);
        let (y_ref, gs_ref) = run(false, DType::F32);
        let e = rel_err(&y, &y_ref);
        assert!(
            e < tol,
            "forward rel err {e} >= {tol} (N={n}, C={c}, {dtype:?})"
        );
        for (name, (a, b)) in ["dx", "dw", "db"].iter().zip(gs.iter().zip(&gs_ref)) {
            let e = rel_err(a, b);
            assert!(
                e < tol,
                "{name} rel err {e} >= {tol} (N={n}, C={c}, {dtype:?})"
            );
        }
    }

    #[test]
    fn matches_plain_layer_norm() {
        // 16 bytes a lane (C a multiple of 8 bf16 or 4 f32), then one element a lane.
        check(300, 768, DType::BF16, 1e-2);
        check(70, 100, DType::F32, 1e-5);
        check(70, 100, DType::BF16, 1e-2);
        check(130, 771, DType::F32, 1e-5);
    }

    /// The residual added inside the fused backward against the f32 backward plus the residual.
    #[test]
    fn backward_adds_the_residual() {
        let dev = cuda();
        for (dtype, tol) in [(DType::BF16, 1e-2), (DType::F32, 1e-5)] {
            let (n, c) = (300, 768);
            let r = |s: &[usize], mean: f32| {
                Tensor::randn(mean, 1f32, s, &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
            };
            let (x, w, b, dy, res) = (
                r(&[n, c], 3.0),
                r(&[c], 1.0),
                r(&[c], 0.0),
                r(&[n, c], 0.0),
                r(&[n, c], 0.0),
            );
            let (_, mean, rstd) = forward(&x, &w, &b, 1e-5).unwrap();
            let (dx, dw, db) = backward_residual(&x, &w, &dy, &mean, &rstd, &res).unwrap();
            let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let (dx_ref, dw_ref, db_ref) =
                unfused_backward(&f(&x), &f(&w), &f(&dy), &mean, &rstd).unwrap();
            let dx_ref = (dx_ref + f(&res)).unwrap();
            for (name, a, b) in [
                ("dx", &dx, &dx_ref),
                ("dw", &dw, &dw_ref),
                ("db", &db, &db_ref),
            ] {
                let e = rel_err(a, b);
                assert!(e < tol, "{name} rel err {e} >= {tol} ({dtype:?})");
            }
        }
    }
}

#[cfg(test)]
mod cpu_tests {
    use super::*;
    use candle_core::{DType, Device};

    /// On CPU the residual is one add after the backward: the same dx as adding it by hand.
    #[test]
    fn backward_residual_is_backward_plus_the_residual() {
        let dev = Device::Cpu;
        let r = |s: &[usize], mean: f32| Tensor::randn(mean, 1f32, s, &dev).unwrap();
        let (x, w, b, dy, res) = (
            r(&[5, 24], 2.0),
            r(&[24], 1.0),
            r(&[24], 0.0),
            r(&[5, 24], 0.0),
            r(&[5, 24], 0.0),
        );
        let (_, mean, rstd) = forward(&x, &w, &b, 1e-5).unwrap();
        let (dx, dw, db) = backward(&x, &w, &dy, &mean, &rstd).unwrap();
        let (dxr, dwr, dbr) = backward_residual(&x, &w, &dy, &mean, &rstd, &res).unwrap();
        let diff = |a: &Tensor, b: &Tensor| {
            (a - b)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        assert_eq!(diff(&dxr, &(dx + &res).unwrap()), 0.0);
        assert_eq!(diff(&dwr, &dw), 0.0);
        assert_eq!(diff(&dbr, &db), 0.0);
        let bad = Tensor::zeros((5, 23), DType::F32, &dev).unwrap();
        let e = backward_residual(&x, &w, &dy, &mean, &rstd, &bad).unwrap_err();
        assert!(e.to_string().contains("residual"), "{e}");
    }
}
