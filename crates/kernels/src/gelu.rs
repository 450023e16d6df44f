//! GELU (tanh approximation): the fused kernels, one each way, the op that picks them or
//! [`plain::gelu`], and the graph-free backward.
//!
//! ```text
//!   y  = x/2 · (1 + tanh u),   u = √(2/π) · (x + 0.044715 x³)
//!   dx = dy · [ (1 + tanh u)/2 + x/2 · (1 − tanh² u) · √(2/π) · (1 + 3·0.044715 x²) ]
//!
//!   plain backward: x³, u, tanh, 1 − tanh², products and sums: about a dozen (N, 4C) kernels
//!   fused backward: gelu_bwd reads x and dy once, writes dx once
//! ```
//!
//! The same function as candle's `Tensor::gelu`; arithmetic is f32, input and output in x's dtype.

use candle_core::{CustomOp1, Layout, Result, Shape, Tensor};

use crate::msg;
use crate::plain::{self, upcast};

/// GELU of `x` (any shape), differentiable: the fused kernel on CUDA, else [`plain::gelu`].
/// On a tensor that records no graph it is also the graph-free forward (on CPU in f32 the
/// one-pass loop, since nothing is recorded).
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    crate::profile::elementwise("gelu", &[x], || {
        if crate::fused_for(x) {
            fused(x)
        } else if !x.track_op() && crate::cpu::takes(&[x]) {
            crate::cpu::gelu(x)
        } else {
            plain::gelu(x)
        }
    })
}

/// The fused kernel under autograd (CUDA only).
pub(crate) fn fused(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Gelu)
}

/// dx of GELU at x for the output gradient dy, recording no graph. On CPU one pass in f32, in
/// candle ops for other dtypes: d/dx [x/2 (1 + tanh u)], u = k (x + a x³), is
/// (1 + th)/2 + x/2 (1 − th²) k (1 + 3a x²).
pub fn backward(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    crate::profile::elementwise("gelu backward", &[x, dy], || {
        if crate::fused_for(x) && dy.dtype() == x.dtype() {
            return fused_backward(x, &dy.contiguous()?);
        }
        if crate::cpu::takes(&[x, dy]) {
            return crate::cpu::gelu_backward(x, dy);
        }
        let (k, a) = ((2.0 / std::f64::consts::PI).sqrt(), 0.044715);
        let xf = upcast(x)?;
        let x2 = xf.sqr()?;
        let th = ((&xf + (&xf * &x2)?.affine(a, 0.0)?)?.affine(k, 0.0)?).tanh()?;
        let left = th.affine(0.5, 0.5)?;
        let right = (&xf * th.sqr()?.affine(-1.0, 1.0)?)?
            .affine(0.5 * k, 0.0)?
            .mul(&x2.affine(3.0 * a, 1.0)?)?;
        ((left + right)? * upcast(dy)?)?.to_dtype(x.dtype())
    })
}

struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "gelu-tanh"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        Err(msg(
            "the fused gelu runs on CUDA only; the CPU path is plain::gelu".into(),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((imp::forward(x, lx)?, lx.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(fused_backward(x, &grad.contiguous()?)?))
    }
}

/// dx of GELU at x for the output gradient dy (same shape, contiguous), by the fused kernel.
#[allow(unused_variables)]
fn fused_backward(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        imp::backward(x, dy)
    }
    #[cfg(not(feature = "cuda"))]
    Err(msg("the fused gelu backward runs on CUDA only".into()))
}

#[cfg(feature = "cuda")]
mod imp {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, Layout, Result, Tensor};

    use super::super::cuda::{by_dtype, device, grid_stride, kernel, slice, storage, tensor, view};
    use super::super::msg;

    pub fn forward(x: &CudaStorage, lx: &Layout) -> Result<CudaStorage> {
        by_dtype!("gelu", x.dtype(), fwd(x, lx))
    }

    fn fwd<T: CudaDType + DeviceRepr>(x: &CudaStorage, lx: &Layout) -> Result<CudaStorage> {
        if !lx.is_contiguous() {
            return Err(msg(format!(
                "gelu: input {:?} is not contiguous",
                lx.dims()
            )));
        }
        let dev = &x.device;
        let n = lx.shape().elem_count();
        let xs = view::<T>(x, lx)?;
        // SAFETY: every element is written by the kernel's grid-stride loop.
        let y = unsafe { dev.alloc::<T>(n)? };
        let f = kernel(dev, None, x.dtype(), "gelu_fwd")?;
        let n64 = n as i64;
        let mut b = f.builder();
        b.arg(&xs).arg(&y).arg(&n64);
        // SAFETY: argument types and order match `gelu_fwd` in kernels.cu.
        unsafe { b.launch(grid_stride(n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    }

    pub fn backward(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
        if dy.dims() != x.dims() || dy.dtype() != x.dtype() {
            return Err(msg(format!(
                "gelu: gradient {:?} {:?} does not match x {:?} {:?}",
                dy.dims(),
                dy.dtype(),
                x.dims(),
                x.dtype()
            )));
        }
        by_dtype!("gelu", x.dtype(), bwd(x, dy))
    }

    fn bwd<T: CudaDType + DeviceRepr>(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
        let dev = device(x)?;
        let n = x.elem_count();
        let (gx, ox) = storage(x, "x")?;
        let (gd, od) = storage(dy, "grad")?;
        let xs = slice::<T>(&gx)?.slice(ox..);
        let ds = slice::<T>(&gd)?.slice(od..);
        // SAFETY: every element is written by the kernel's grid-stride loop.
        let dx = unsafe { dev.alloc::<T>(n)? };
        let f = kernel(&dev, None, x.dtype(), "gelu_bwd")?;
        let n64 = n as i64;
        let mut b = f.builder();
        b.arg(&xs).arg(&ds).arg(&dx).arg(&n64);
        // SAFETY: argument types and order match `gelu_bwd` in kernels.cu.
        unsafe { b.launch(grid_stride(n)) }.w()?;
        Ok(tensor(&dev, dx, x.shape().clone()))
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use crate::testing::{cuda, rel_err};
    use candle_core::{DType, Var};

    /// Output and dx against candle's `gelu` and its autograd, computed in f32.
    fn check(n: usize, dtype: DType, tol: f64) {
        let dev = cuda();
        let x = (Tensor::randn(0f32, 1f32, (n, 3), &dev).unwrap() * 3.0).unwrap();
        let g = Tensor::randn(0f32, 1f32, (n, 3), &dev).unwrap();
        let run = |fused: bool, dt: DType| {
            let v = Var::from_tensor(&x.to_dtype(dtype).unwrap().to_dtype(dt).unwrap()).unwrap();
            let y = if fused {
                super::fused(v.as_tensor()).unwrap()
            } else {
                v.as_tensor().gelu().unwrap()
            };
            let grads = (&y * g.to_dtype(dt).unwrap())
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            (y, grads.get(v.as_tensor()).unwrap().clone())
        };
        let (y, dx) = run(true, dtype);
        let (y_ref, dx_ref) = run(false, DType::F32);
        let e = rel_err(&y, &y_ref);
        assert!(e < tol, "forward rel err {e} >= {tol} ({dtype:?})");
        let e = rel_err(&dx, &dx_ref);
        assert!(e < tol, "dx rel err {e} >= {tol} ({dtype:?})");
    }

    #[test]
    fn matches_candle_gelu() {
        check(100_000, DType::BF16, 1e-2);
        check(1000, DType::F32, 1e-5);
    }
}
