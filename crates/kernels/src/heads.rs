//! Head layout `(B, T, S·H·D) <-> (S, B, H, T, D)`, forward and backward: one pass of a
//! permutation kernel on CUDA, reshape and permute elsewhere.
//!
//! ```text
//!   c_attn output (B, T, 3·H·D) = [q | k | v] per token
//!
//!   plain candle: q = qkv.narrow(2, 0, C).reshape(B, T, H, D).transpose(1, 2).contiguous()
//!                 (and k, v): three strided copies; backward: each narrow pads its gradient
//!                 with zeros to (B, T, 3C) and the three are summed
//!   split_heads:  one kernel writes (3, B, H, T, D); backward, one kernel writes the one
//!                 (B, T, 3C) gradient
//!   merge_heads:  the inverse, (S, B, H, T, D) -> (B, T, S·H·D); with S = 1 it turns the
//!                 attention output (B, H, T, D) into (B, T, H·D) for c_proj
//! ```
//!
//! A permutation of elements: no arithmetic, the result is bit-identical to the plain ops.
//! The kernels move whole rows of `D` elements (contiguous on both sides) in 16-byte words
//! where the row size and offset allow it: one block per (s, b, h) plane, consecutive threads
//! on consecutive words, so reads and writes are coalesced (see kernels.cu, "Head layout").
//! Legend: `B` batch, `T` time, `S` parts (3 for q, k, v), `H` heads, `D` head size.

use candle_core::{CustomOp1, Layout, Result, Shape, Tensor};

use crate::msg;

/// (B, T, S·H·D) -> (S, B, H, T, D), differentiable: one permutation kernel on CUDA, else
/// reshape, permute and a contiguous copy.
pub fn split_heads(x: &Tensor, s: usize, h: usize) -> Result<Tensor> {
    let (b, t, f) = x.dims3()?;
    if s == 0 || h == 0 || f % (s * h) != 0 {
        return Err(msg(format!(
            "split_heads: {f} features do not split into {s} parts of {h} heads"
        )));
    }
    let d = f / (s * h);
    if !crate::fused_for(x) {
        return x
            .reshape((b, t, s, h, d))? // (B, T, S, H, D)
            .permute((2, 0, 3, 1, 4))? // (S, B, H, T, D)
            .contiguous();
    }
    let dims = HeadDims { b, t, s, h, d };
    x.contiguous()?.apply_op1(Heads { split: true, dims })
}

/// (S, B, H, T, D) -> (B, T, S·H·D), differentiable: the inverse of [`split_heads`].
pub fn merge_heads(x: &Tensor) -> Result<Tensor> {
    let (s, b, h, t, d) = x.dims5()?;
    if !crate::fused_for(x) {
        return x
            .permute((1, 3, 0, 2, 4))? // (B, T, S, H, D)
            .contiguous()?
            .reshape((b, t, s * h * d)); // (B, T, S·H·D)
    }
    let dims = HeadDims { b, t, s, h, d };
    x.contiguous()?.apply_op1(Heads { split: false, dims })
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct HeadDims {
    b: usize,
    t: usize,
    s: usize,
    h: usize,
    d: usize,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl HeadDims {
    fn split_shape(&self) -> Shape {
        (self.s, self.b, self.h, self.t, self.d).into()
    }
    fn merged_shape(&self) -> Shape {
        (self.b, self.t, self.s * self.h * self.d).into()
    }
}

/// `split`: (B, T, S·H·D) -> (S, B, H, T, D); otherwise the inverse.
struct Heads {
    split: bool,
    dims: HeadDims,
}

impl CustomOp1 for Heads {
    fn name(&self) -> &'static str {
        if self.split {
            "split-heads"
        } else {
            "merge-heads"
        }
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        Err(msg(
            "kernels::heads runs on CUDA only; the CPU path is narrow/transpose".into(),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        imp::permute(x, lx, self.split, self.dims)
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let g = grad.contiguous()?;
        let back = Heads {
            split: !self.split,
            dims: self.dims,
        };
        Ok(Some(g.detach().apply_op1_no_bwd(&back)?))
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, Layout, Result, Shape};

    use super::super::cuda::{blocks, by_dtype, kernel, view};
    use super::super::msg;
    use super::{unit_bytes, HeadDims};

    pub fn permute(
        x: &CudaStorage,
        lx: &Layout,
        split: bool,
        dims: HeadDims,
    ) -> Result<(CudaStorage, Shape)> {
        let (from, to) = if split {
            (dims.merged_shape(), dims.split_shape())
        } else {
            (dims.split_shape(), dims.merged_shape())
        };
        if !lx.is_contiguous() || lx.shape() != &from {
            return Err(msg(format!(
                "heads: input {:?} (contiguous: {}) is not the expected {:?}",
                lx.dims(),
                lx.is_contiguous(),
                from.dims()
            )));
        }
        let out = by_dtype!("heads", x.dtype(), run(x, lx, split, dims))?;
        Ok((out, to))
    }

    fn run<T: CudaDType + DeviceRepr>(
        x: &CudaStorage,
        lx: &Layout,
        split: bool,
        dims: HeadDims,
    ) -> Result<CudaStorage> {
        let HeadDims { b, t, s, h, d } = dims;
        let dev = &x.device;
        let n = b * t * s * h * d;
        let esize = std::mem::size_of::<T>();
        // CUDA allocations are at least 256-byte aligned, so the offset decides the alignment.
        let unit = unit_bytes(d * esize, lx.start_offset() * esize);
        let dv = d * esize / unit; // units per row of Dh elements
        let xs = view::<T>(x, lx)?;
        // SAFETY: every element is written: each (s, b, h) plane's T·Dv units by the
        // grid-stride loop of its block column.
        let y = unsafe { dev.alloc::<T>(n)? };
        if n == 0 {
            return Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()));
        }
        let name = format!("heads_{}_u{unit}", if split { "split" } else { "merge" });
        let f = kernel(dev, None, x.dtype(), &name)?;
        let planes = s * h * b;
        let units = t * dv; // per plane
        let int = |v: usize, what: &str| -> Result<i32> {
            i32::try_from(v).map_err(|_| {
                msg(format!(
                    "heads: {what} = {v} exceeds the kernel's 32-bit index ({dims:?})"
                ))
            })
        };
        let grid_x = int(planes, "S·B·H planes")? as usize;
        // j < T·Dv, and j + one grid stride must not wrap either.
        int(
            units + 65_535 * THREADS,
            "T·Dv units per plane plus one grid stride",
        )?;
        let [b, t, s, h, dv] = [
            int(b, "B")?,
            int(t, "T")?,
            int(s, "S")?,
            int(h, "H")?,
            int(dv, "Dv")?,
        ];
        let mut bl = f.builder();
        bl.arg(&xs).arg(&y).arg(&b).arg(&t).arg(&s).arg(&h).arg(&dv);
        let cfg = blocks((grid_x, units.div_ceil(THREADS).clamp(1, 65_535)), THREADS);
        // SAFETY: argument types and order match `heads_{split,merge}_u{16,8,4,2}` in
        // kernels.cu; `xs` and `y` hold n elements, n·size_of::<T>() / unit units.
        unsafe { bl.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    }

    const THREADS: usize = 256;
}

/// The widest word (16, 8, 4 or 2 bytes) that divides both a row of `row_bytes` and the
/// byte offset where the data starts, so that every row is copied in aligned units:
/// a bf16 row of 64 elements (128 bytes) at offset 0 goes in 16-byte units.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn unit_bytes(row_bytes: usize, offset_bytes: usize) -> usize {
    [16, 8, 4, 2]
        .into_iter()
        .find(|u| row_bytes % u == 0 && offset_bytes % u == 0)
        .unwrap_or(2)
}

/// CPU-checkable part of the launch: the unit width.
#[cfg(test)]
mod unit_tests {
    use super::unit_bytes;

    #[test]
    fn unit_is_widest_common_divisor_up_to_16() {
        assert_eq!(unit_bytes(128, 0), 16); // bf16, Dh = 64
        assert_eq!(unit_bytes(256, 0), 16); // f32, Dh = 64
        assert_eq!(unit_bytes(32, 0), 16); // bf16, Dh = 16
        assert_eq!(unit_bytes(24, 0), 8); // bf16, Dh = 12
        assert_eq!(unit_bytes(128, 8), 8); // offset by 4 bf16 elements
        assert_eq!(unit_bytes(128, 4), 4); // offset by one f32
        assert_eq!(unit_bytes(12, 0), 4); // f32, Dh = 3
        assert_eq!(unit_bytes(6, 0), 2); // bf16, Dh = 3
        assert_eq!(unit_bytes(128, 2), 2); // offset by one bf16
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use crate::testing::cuda;
    use candle_core::{DType, Var};

    /// split_heads and merge_heads, forward and backward, against narrow/reshape/transpose:
    /// a permutation, so the results must be bit-identical.
    #[test]
    fn matches_narrow_transpose_exactly() {
        let dev = cuda();
        let (b, t, h, d) = (2, 37, 3, 16);
        for dtype in [DType::BF16, DType::F32] {
            let x = Tensor::randn(0f32, 1f32, (b, t, 3 * h * d), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let w = Tensor::randn(0f32, 1f32, (b, t, 3 * h * d), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let run = |fused: bool| {
                let v = Var::from_tensor(&x).unwrap();
                let y = if fused {
                    let p = split_heads(v.as_tensor(), 3, h).unwrap(); // (3, B, H, T, D)
                    merge_heads(&(p * 2.0).unwrap()).unwrap() // (B, T, 3HD)
                } else {
                    let parts: Vec<Tensor> = (0..3)
                        .map(|i| {
                            v.as_tensor()
                                .narrow(2, i * h * d, h * d)
                                .unwrap()
                                .reshape((b, t, h, d))
                                .unwrap()
                                .transpose(1, 2)
                                .unwrap()
                                .contiguous()
                                .unwrap()
                        })
                        .collect();
                    let p = (Tensor::stack(&parts, 0).unwrap() * 2.0).unwrap();
                    let back: Vec<Tensor> = (0..3)
                        .map(|i| {
                            p.get(i)
                                .unwrap()
                                .transpose(1, 2)
                                .unwrap()
                                .reshape((b, t, h * d))
                                .unwrap()
                        })
                        .collect();
                    Tensor::cat(&back, 2).unwrap()
                };
                let g = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
                let gx = g.get(v.as_tensor()).unwrap().clone();
                (y, gx)
            };
            let (y, gx) = run(true);
            let (y_ref, gx_ref) = run(false);
            let diff = |a: &Tensor, b: &Tensor| {
                (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap())
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap()
            };
            assert_eq!(y.dims(), &[b, t, 3 * h * d]);
            assert_eq!(diff(&y, &y_ref), 0.0, "forward differs ({dtype:?})");
            assert_eq!(diff(&gx, &gx_ref), 0.0, "gradient differs ({dtype:?})");
            // The split layout itself: part 1 (k), batch 1, head 2, time 5 = x[1, 5, C + 2D ..].
            let p = split_heads(&x, 3, h).unwrap();
            let got = p
                .get(1)
                .unwrap()
                .get(1)
                .unwrap()
                .get(2)
                .unwrap()
                .get(5)
                .unwrap();
            let want = x
                .get(1)
                .unwrap()
                .get(5)
                .unwrap()
                .narrow(0, h * d + 2 * d, d)
                .unwrap();
            assert_eq!(diff(&got, &want), 0.0, "split layout ({dtype:?})");
        }
    }
}
