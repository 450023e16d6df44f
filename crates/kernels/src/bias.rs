//! Bias add `y = x + b`: the fused kernel with a coalesced bias gradient, the op that picks it
//! or `broadcast_add`, and the graph-free residual add and bias gradient.
//!
//! ```text
//!   x (N, C) ──+ b (C,) ──> y (N, C)          forward: one elementwise kernel
//!   dx = dy                                  backward: dy passed through, no copy
//!   db = Σ_rows dy   ┌─────── C columns ───────┐
//!                    │ t0 t1 t2 ...            │ 128 rows per block row, thread j sums
//!                    │ t0 t1 t2 ...            │ column j (neighbouring threads read
//!                    └─────────────────────────┘ neighbouring addresses), f32 atomics
//! ```
//!
//! candle's `broadcast_add` backward sums dy over the rows with its generic reduction, one
//! thread block per column whose threads read addresses C elements apart; here a warp reads
//! 32 neighbouring columns of one row at once. Arithmetic in f32, x, b and y in x's dtype.

use candle_core::{CustomOp2, Layout, Result, Shape, Tensor};

use crate::msg;
use crate::plain::upcast;

/// Whether the fused kernels can add `b` to `x`: both on CUDA in one supported dtype, `b` of
/// shape (C,) for `x` (..., C).
fn fuses(x: &Tensor, b: &Tensor) -> bool {
    crate::fused_for(x)
        && b.dtype() == x.dtype()
        && b.rank() == 1
        && x.rank() >= 1
        && x.dims().last() == b.dims().first()
}

/// `x + b` for x (..., C), b (C,); differentiable in both. The fused kernel where it applies,
/// else `broadcast_add`.
pub fn bias_add(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    crate::profile::elementwise("bias", &[x, b], || match fuses(x, b) {
        true => fused(x, b),
        false => x.broadcast_add(b),
    })
}

/// `r + (x + b)` for r, x (N, C) and b (C,), recording no graph: the residual add after a
/// linear layer with that layer's bias folded in (db is then Σ_rows of the output gradient,
/// [`grad`]). One pass on CUDA and on CPU in f32, two candle adds elsewhere.
pub fn residual_add(r: &Tensor, x: &Tensor, b: &Tensor) -> Result<Tensor> {
    crate::profile::elementwise("residual", &[x, r, b], || {
        if fuses(x, b) && r.dtype() == x.dtype() {
            return fused_residual_add(r, x, b);
        }
        if crate::cpu::takes(&[r, x, b]) {
            return crate::cpu::residual_add(r, x, b);
        }
        r + x.broadcast_add(b)?
    })
}

/// db = Σ over the rows of dy (N, C), in b's dtype (summed in f32), recording no graph.
pub fn grad(dy: &Tensor, b: &Tensor) -> Result<Tensor> {
    crate::profile::elementwise("bias grad", &[dy, b], || {
        if crate::fused_for(dy) && b.dtype() == dy.dtype() {
            return fused_grad(&dy.contiguous()?, b);
        }
        if crate::cpu::takes(&[dy, b]) && dy.dims().last() == b.dims().first() {
            return crate::cpu::row_sum(dy);
        }
        upcast(dy)?.sum(0)?.to_dtype(b.dtype())
    })
}

/// The fused kernel under autograd (CUDA only).
pub(crate) fn fused(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    let c = b.dim(0)?;
    if x.dims().last() != Some(&c) {
        return Err(msg(format!(
            "bias_add: x {:?} does not end in the bias length {c}",
            x.dims()
        )));
    }
    x.contiguous()?.apply_op2(&b.contiguous()?, BiasAdd)
}

struct BiasAdd;

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "bias-add"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        Err(msg(
            "the fused bias_add runs on CUDA only; the CPU path is broadcast_add".into(),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((imp::forward(x, lx, b, lb)?, lx.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let db = fused_grad(&grad.contiguous()?, b)?;
        Ok((Some(grad.clone()), Some(db)))
    }
}

/// [`residual_add`] in one pass of the fused kernel (CUDA only).
#[allow(unused_variables)]
pub(crate) fn fused_residual_add(r: &Tensor, x: &Tensor, b: &Tensor) -> Result<Tensor> {
    let c = b.dim(0)?;
    if r.dims() != x.dims()
        || x.dims().last() != Some(&c)
        || r.dtype() != x.dtype()
        || b.dtype() != x.dtype()
    {
        return Err(msg(format!(
            "bias_residual_add: r {:?} {:?}, x {:?} {:?}, b {:?} {:?} must be (..., C), (..., C), (C,) of one dtype",
            r.dims(),
            r.dtype(),
            x.dims(),
            x.dtype(),
            b.dims(),
            b.dtype()
        )));
    }
    #[cfg(feature = "cuda")]
    {
        imp::bias_residual(&r.contiguous()?, &x.contiguous()?, &b.contiguous()?)
    }
    #[cfg(not(feature = "cuda"))]
    Err(msg("the fused residual_add runs on CUDA only".into()))
}

/// Σ over rows of dy (..., C), in b's dtype, by the fused kernel (CUDA only).
#[allow(unused_variables)]
fn fused_grad(dy: &Tensor, b: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        imp::bias_grad(dy, b)
    }
    #[cfg(not(feature = "cuda"))]
    Err(msg("the fused bias_add backward runs on CUDA only".into()))
}

#[cfg(feature = "cuda")]
mod imp {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, Layout, Result, Tensor};

    use super::super::cuda::{
        by_dtype, column_blocks, device, grid_stride, kernel, slice, storage, tensor, view,
    };
    use super::super::msg;

    /// Rows per block of `bias_grad` (BIAS_ROWS in kernels.cu) and its threads (LN_WARPS
    /// warps).
    const ROWS: usize = 64;
    const THREADS: usize = 256;

    pub fn forward(
        x: &CudaStorage,
        lx: &Layout,
        b: &CudaStorage,
        lb: &Layout,
    ) -> Result<CudaStorage> {
        if !lx.is_contiguous() || !lb.is_contiguous() || x.dtype() != b.dtype() {
            return Err(msg(format!(
                "bias_add: x {:?} {:?} and b {:?} {:?} must be contiguous and of one dtype",
                lx.dims(),
                x.dtype(),
                lb.dims(),
                b.dtype()
            )));
        }
        by_dtype!("bias_add", x.dtype(), fwd(x, lx, b, lb))
    }

    fn fwd<T: CudaDType + DeviceRepr>(
        x: &CudaStorage,
        lx: &Layout,
        b: &CudaStorage,
        lb: &Layout,
    ) -> Result<CudaStorage> {
        let dev = &x.device;
        let n = lx.shape().elem_count();
        let c = lb.shape().elem_count();
        let xs = view::<T>(x, lx)?;
        let bs = view::<T>(b, lb)?;
        // SAFETY: every element is written by the kernel's grid-stride loop.
        let y = unsafe { dev.alloc::<T>(n)? };
        let f = kernel(dev, None, x.dtype(), "bias_add_fwd")?;
        let (n64, c32) = (n as i64, c as i32);
        let mut bl = f.builder();
        bl.arg(&xs).arg(&bs).arg(&y).arg(&n64).arg(&c32);
        // SAFETY: argument types and order match `bias_add_fwd` in kernels.cu.
        unsafe { bl.launch(grid_stride(n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    }

    pub fn bias_grad(dy: &Tensor, b: &Tensor) -> Result<Tensor> {
        by_dtype!("bias_add", dy.dtype(), grad(dy, b))
    }

    pub fn bias_residual(r: &Tensor, x: &Tensor, b: &Tensor) -> Result<Tensor> {
        by_dtype!("bias_residual_add", x.dtype(), residual(r, x, b))
    }

    fn residual<T: CudaDType + DeviceRepr>(r: &Tensor, x: &Tensor, b: &Tensor) -> Result<Tensor> {
        let (n, c) = (x.elem_count(), b.dim(0)?);
        let dev = device(x)?;
        let (gr, or) = storage(r, "residual")?;
        let (gx, ox) = storage(x, "x")?;
        let (gb, ob) = storage(b, "bias")?;
        let (rs, xs, bs) = (
            slice::<T>(&gr)?.slice(or..),
            slice::<T>(&gx)?.slice(ox..),
            slice::<T>(&gb)?.slice(ob..),
        );
        // SAFETY: every element is written by the kernel's grid-stride loop.
        let y = unsafe { dev.alloc::<T>(n)? };
        let f = kernel(&dev, None, x.dtype(), "bias_residual_fwd")?;
        let (n64, c32) = (n as i64, c as i32);
        let mut bl = f.builder();
        bl.arg(&rs).arg(&xs).arg(&bs).arg(&y).arg(&n64).arg(&c32);
        // SAFETY: argument types and order match `bias_residual_fwd` in kernels.cu.
        unsafe { bl.launch(grid_stride(n)) }.w()?;
        drop((rs, xs, bs));
        drop((gr, gx, gb));
        Ok(tensor(&dev, y, x.shape().clone()))
    }

    fn grad<T: CudaDType + DeviceRepr>(dy: &Tensor, b: &Tensor) -> Result<Tensor> {
        let c = b.dim(0)?;
        let n = dy.elem_count() / c.max(1);
        let dev = device(dy)?;
        let (gd, od) = storage(dy, "bias gradient")?;
        let ds = slice::<T>(&gd)?.slice(od..);
        let db = dev.alloc_zeros::<f32>(c)?;
        let f = kernel(&dev, None, dy.dtype(), "bias_grad")?;
        let (n32, c32) = (n as i32, c as i32);
        let mut bl = f.builder();
        bl.arg(&ds).arg(&db).arg(&n32).arg(&c32);
        // SAFETY: argument types and order match `bias_grad` in kernels.cu.
        // A block takes 32 lanes × 16 bytes of columns at a time.
        let cols = 32 * 16 / std::mem::size_of::<T>();
        unsafe { bl.launch(column_blocks(n, c, ROWS, THREADS, cols)) }.w()?;
        drop(ds);
        drop(gd);
        tensor(&dev, db, c).to_dtype(b.dtype())
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use crate::testing::{cuda, rel_err};
    use candle_core::{DType, Var};

    /// y, dx and db against broadcast_add and its autograd computed in f32 from the same inputs.
    fn check(rows: usize, c: usize, dtype: DType, tol: f64) {
        let dev = cuda();
        let x = Tensor::randn(0f32, 1f32, (2, rows, c), &dev).unwrap();
        let b = (Tensor::randn(0f32, 1f32, c, &dev).unwrap() + 2.0).unwrap();
        let g = Tensor::randn(0f32, 1f32, (2, rows, c), &dev).unwrap();
        let run = |fused: bool, dt: DType| {
            let cast = |t: &Tensor| t.to_dtype(dtype).unwrap().to_dtype(dt).unwrap();
            let (xv, bv) = (
                Var::from_tensor(&cast(&x)).unwrap(),
                Var::from_tensor(&cast(&b)).unwrap(),
            );
            let y = if fused {
                super::fused(xv.as_tensor(), bv.as_tensor()).unwrap()
            } else {
                xv.as_tensor().broadcast_add(bv.as_tensor()).unwrap()
            };
            let grads = (&y * cast(&g))
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let dx = grads.get(xv.as_tensor()).unwrap().clone();
            let db = grads.get(bv.as_tensor()).unwrap().clone();
            (y, dx, db)
        };
        let (y, dx, db) = run(true, dtype);
        let (y_ref, dx_ref, db_ref) = run(false, DType::F32);
        for (name, a, r) in [
            ("y", &y, &y_ref),
            ("dx", &dx, &dx_ref),
            ("db", &db, &db_ref),
        ] {
            let e = rel_err(a, r);
            assert!(
                e < tol,
                "{name} rel err {e} >= {tol} ({rows}x{c}, {dtype:?})"
            );
        }
        assert_eq!(db.dims(), &[c]);
        assert_eq!(db.dtype(), dtype);
    }

    #[test]
    fn matches_broadcast_add() {
        // 2 x 300 rows: a partial last row block (600 = 4 x 128 + 88); C not a multiple of 256.
        check(300, 2304, DType::BF16, 1e-2);
        check(70, 100, DType::F32, 1e-5);
        // Rows that are not whole 16-byte words: the one-element path.
        check(50, 100, DType::BF16, 1e-2);
        check(70, 101, DType::F32, 1e-5);
    }

    /// r + (x + b) against the two candle adds in f32, on the 16-byte path and the one-element one.
    #[test]
    fn residual_matches_two_adds() {
        let dev = cuda();
        for (c, dtype, tol) in [
            (768, DType::BF16, 1e-2),
            (100, DType::BF16, 1e-2),
            (768, DType::F32, 1e-6),
            (101, DType::F32, 1e-6),
        ] {
            let t = |s: (usize, usize, usize)| {
                Tensor::randn(0f32, 1f32, s, &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
            };
            let (r, x) = (t((2, 33, c)), t((2, 33, c)));
            let b = Tensor::randn(0f32, 1f32, c, &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let y = fused_residual_add(&r, &x, &b).unwrap();
            let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let want = (f(&r) + f(&x).broadcast_add(&f(&b)).unwrap()).unwrap();
            let e = rel_err(&y, &want);
            assert!(e < tol, "rel err {e} >= {tol} (C = {c}, {dtype:?})");
            assert_eq!(y.dims(), x.dims());
        }
    }
}
