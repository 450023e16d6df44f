//! The differentiable all-to-all: rows go out by `send_splits`, rows come in by `recv_splits`;
//! in backward the gradient travels the reverse way (splits swapped).
//!
//! ```text
//!   forward   rank 0: [a0 a1 | b0]  ──>  rank 0: [a0 a1 | c0 c1 c2]     send_splits  [2, 1]
//!             rank 1: [c0 c1 c2 | d0]    rank 1: [b0 | d0]              recv_splits  [2, 3]
//!   backward  the same picture read right to left: dx = all_to_all(dy, recv_splits, send_splits)
//! ```
//!
//! An all-to-all only moves rows, it never combines them, so its adjoint is the all-to-all that
//! moves each row back to where it came from (Megatron's `_AllToAll` swaps the splits).
//!
//! Mechanism (the same as [`crate::ops`]): the forward result `v` is computed outside the graph
//! on a detached copy, then a two-input custom op `(x, v) ↦ v` is recorded whose `bwd` runs the
//! reverse all-to-all on the incoming gradient and hands it to `x`. The op is recorded whenever
//! `x` descends from a `Var`, **even when `x` or `v` has zero rows**: every rank of the group
//! must issue the backward all-to-all, including one that sent or received nothing, or its
//! peers would wait for it forever.

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CudaStorage, CustomOp2, Layout, Result, Shape, Tensor};
use mtrain_comm::Comm;

/// All-to-all along dim 0 whose backward is the reverse all-to-all.
///
/// `x` (Σ send_splits, …) → (Σ recv_splits, …). Row block `p` of `x` goes to rank `p` of
/// `group`; the output holds the blocks received from ranks 0, 1, … in order.
pub fn all_to_all(
    x: &Tensor,
    send_splits: &[usize],
    recv_splits: &[usize],
    group: &Comm,
) -> Result<Tensor> {
    let v = group
        .all_to_all(&x.detach().contiguous()?, send_splits, recv_splits)
        .map_err(candle_core::Error::wrap)?; // (Σ recv_splits, …)
    if !x.track_op() {
        return Ok(v);
    }
    x.apply_op2(
        &v,
        ReverseAllToAll {
            send_splits: send_splits.to_vec(),
            recv_splits: recv_splits.to_vec(),
            group: group.clone(),
        },
    )
}

/// `(x, v) ↦ v`; backward sends the gradient rows back: `dx = all_to_all(dv, recv, send)`.
struct ReverseAllToAll {
    send_splits: Vec<usize>,
    recv_splits: Vec<usize>,
    group: Comm,
}

/// A fresh contiguous copy of `(storage, layout)` on the same device.
fn copy_of<S>(s: &S, l: &Layout) -> Result<(S, Shape)>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    let mut dst = s.device().zeros_impl(l.shape(), s.dtype())?;
    if l.shape().elem_count() > 0 {
        s.copy_strided_src(&mut dst, 0, l)?;
    }
    Ok((dst, l.shape().clone()))
}

impl CustomOp2 for ReverseAllToAll {
    fn name(&self) -> &'static str {
        "ep-all-to-all"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        v: &CpuStorage,
        lv: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        copy_of(v, lv)
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        v: &CudaStorage,
        lv: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        copy_of(v, lv)
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _v: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dx = self
            .group
            .all_to_all(&grad.contiguous()?, &self.recv_splits, &self.send_splits)
            .map_err(candle_core::Error::wrap)?; // (Σ send_splits, …)
        Ok((Some(dx), None))
    }
}
