//! Differentiable collectives: communication that autograd can see through.
//!
//! Tensor parallelism needs collectives *inside* the model, and each one needs a conjugate in
//! backward. Megatron-LM names them by their effect on the forward pass (`mappings.py`); so do we:
//!
//! | function                                     | forward                    | backward                   |
//! |----------------------------------------------|----------------------------|----------------------------|
//! | [`copy_to_tp_region`] (Megatron's f)         | identity                   | all-reduce                 |
//! | [`reduce_from_tp_region`] (Megatron's g)     | all-reduce                 | identity                   |
//! | [`gather_from_tp_region`]                    | all-gather, last dim       | keep own slice, last dim   |
//! | [`scatter_to_tp_region`]                     | keep own slice, last dim   | all-gather, last dim       |
//! | [`gather_from_sequence_parallel_region`]     | all-gather along `dim`     | reduce-scatter along `dim` |
//! | [`reduce_scatter_to_sequence_parallel_region`]| reduce-scatter along `dim`| all-gather along `dim`     |
//!
//! Where f and g sit in a tensor-parallel MLP (one all-reduce in forward, one in backward):
//!
//! ```text
//!            ┌── f ──┐   column-parallel    row-parallel   ┌── g ──┐
//!   x ───────┤ id    ├── x W1ᵢᵀ ── gelu ──── h W2ᵢᵀ ────────┤ Σ_tp  ├─── y      forward
//!  dx ◄──────┤ Σ_tp  ├─────────────────────────────────────┤ id    ├◄── dy     backward
//!            └───────┘                                     └───────┘
//! ```
//!
//! # Mechanism
//! candle has no autograd `Function` with a user-written backward, but a [`CustomOp2`] has one.
//! Each op here first computes its forward result `v` outside the graph (a plain collective on a
//! detached tensor), then applies a two-input custom op `(x, v) ↦ v` whose `bwd` runs the conjugate
//! collective on the incoming gradient and hands it to `x` (nothing flows to `v`). The custom op
//! is recorded only when `x` descends from a `Var`; otherwise `v` is returned as is, since no
//! gradient can be asked of it. The op itself takes its backward as a closure
//! (`value_with_backward`), so expert parallelism's all-to-all records the same op with the
//! reverse all-to-all as its backward.
//!
//! Backward collectives run on the thread that calls `backward()`, in graph order; every rank
//! builds the same graph, so every rank issues them in the same order.
//!
//! Uneven splits follow [`chunk_range`]: rank r of n owns rows `chunk_range(len, n, r)`.

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CudaStorage, CustomOp2, Layout, Result, Shape, Tensor};
use mtrain_comm::{chunk_range, Comm, Communicator, ReduceOp};

/// Identity in forward, all-reduce (sum over the group) of the gradient in backward — Megatron's f.
///
/// Sits at the input of a column-parallel linear: every rank reads the same `x`, so the gradient
/// of `x` is the sum of the ranks' partial gradients.
#[track_caller]
pub fn copy_to_tp_region(x: &Tensor, group: &Comm) -> Result<Tensor> {
    with_conjugate(x, x.detach(), Conjugate::AllReduce, group)
}

/// All-reduce (sum over the group) in forward, identity in backward — Megatron's g.
///
/// Sits at the output of a row-parallel linear: each rank holds a partial sum of the output.
#[track_caller]
pub fn reduce_from_tp_region(x: &Tensor, group: &Comm) -> Result<Tensor> {
    let v = group
        .all_reduce(&x.detach().contiguous()?, ReduceOp::Sum)
        .map_err(comm_err)?;
    with_conjugate(x, v, Conjugate::Identity, group)
}

/// All-gather along the last dim in forward, keep this rank's slice of the gradient in backward.
///
/// `(…, d_r) → (…, Σ d_r)`; the pieces must follow [`chunk_range`] of the gathered size.
#[track_caller]
pub fn gather_from_tp_region(x: &Tensor, group: &Comm) -> Result<Tensor> {
    let dim = last_dim(x)?;
    let v = all_gather_along(group.as_ref(), &x.detach(), dim)?;
    with_conjugate(x, v, Conjugate::Split { dim }, group)
}

/// Keep this rank's slice of the last dim in forward, all-gather the gradient in backward.
///
/// `(…, D) → (…, D_r)` with the slice `chunk_range(D, tp, rank)`.
#[track_caller]
pub fn scatter_to_tp_region(x: &Tensor, group: &Comm) -> Result<Tensor> {
    let dim = last_dim(x)?;
    let v = split_along(group.as_ref(), &x.detach(), dim)?;
    with_conjugate(x, v, Conjugate::AllGather { dim }, group)
}

/// All-gather along `dim` (the sequence) in forward, reduce-scatter (sum) along `dim` in backward.
///
/// Sequence parallelism: `(B, T/tp, C) → (B, T, C)` before a column-parallel linear. Every rank's
/// gathered copy feeds a different weight shard, so the gradient is summed and scattered back.
#[track_caller]
pub fn gather_from_sequence_parallel_region(
    x: &Tensor,
    dim: usize,
    group: &Comm,
) -> Result<Tensor> {
    let v = all_gather_along(group.as_ref(), &x.detach(), dim)?;
    with_conjugate(x, v, Conjugate::ReduceScatter { dim }, group)
}

/// Reduce-scatter (sum) along `dim` (the sequence) in forward, all-gather along `dim` in backward.
///
/// Sequence parallelism: partial sums `(B, T, C) → (B, T/tp, C)` after a row-parallel linear,
/// replacing g's all-reduce with half of it.
#[track_caller]
pub fn reduce_scatter_to_sequence_parallel_region(
    x: &Tensor,
    dim: usize,
    group: &Comm,
) -> Result<Tensor> {
    let v = reduce_scatter_along(group.as_ref(), &x.detach(), dim)?;
    with_conjugate(x, v, Conjugate::AllGather { dim }, group)
}

/// Keep this rank's slice along `dim` in forward, all-gather the gradient along `dim` in backward.
///
/// The entry into a sequence-parallel region from a replicated tensor (no communication forward).
#[track_caller]
pub fn scatter_to_sequence_parallel_region(x: &Tensor, dim: usize, group: &Comm) -> Result<Tensor> {
    let v = split_along(group.as_ref(), &x.detach(), dim)?;
    with_conjugate(x, v, Conjugate::AllGather { dim }, group)
}

// ---------------------------------------------------------------------------------------------
// Plain (non-differentiable) collectives along any dim. The communicator works on dim 0, so the
// chosen dim is moved to the front and back.
// ---------------------------------------------------------------------------------------------

/// Concatenate every rank's `x` along `dim`.
#[track_caller]
pub fn all_gather_along(group: &dyn Communicator, x: &Tensor, dim: usize) -> Result<Tensor> {
    if dim == 0 {
        return group.all_gather(&x.contiguous()?).map_err(comm_err);
    }
    let front = x.transpose(0, dim)?.contiguous()?; // dim moved to the front
    let gathered = group.all_gather(&front).map_err(comm_err)?; // (Σ d_r, …)
    gathered.transpose(0, dim)?.contiguous()
}

/// Sum `x` over the ranks and keep this rank's `chunk_range` slice along `dim`.
#[track_caller]
pub fn reduce_scatter_along(group: &dyn Communicator, x: &Tensor, dim: usize) -> Result<Tensor> {
    if dim == 0 {
        return group
            .reduce_scatter(&x.contiguous()?, ReduceOp::Sum)
            .map_err(comm_err);
    }
    let front = x.transpose(0, dim)?.contiguous()?;
    let mine = group
        .reduce_scatter(&front, ReduceOp::Sum)
        .map_err(comm_err)?; // (D_r, …)
    mine.transpose(0, dim)?.contiguous()
}

/// This rank's `chunk_range` slice of `x` along `dim` (no communication).
pub fn split_along(group: &dyn Communicator, x: &Tensor, dim: usize) -> Result<Tensor> {
    let len = x.dim(dim)?;
    let r = chunk_range(len, group.size(), group.rank());
    x.narrow(dim, r.start, r.len())?.contiguous()
}

fn last_dim(x: &Tensor) -> Result<usize> {
    match x.rank() {
        0 => Err(candle_core::Error::Msg(
            "cannot split a scalar along its last dim".into(),
        )),
        r => Ok(r - 1),
    }
}

/// Wrap a communication error so it travels through candle's autograd as a candle error.
pub(crate) fn comm_err(e: mtrain_comm::CommError) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

// ---------------------------------------------------------------------------------------------
// The custom op: forward returns the precomputed value, backward runs the conjugate collective.
// ---------------------------------------------------------------------------------------------

/// What backward does to the incoming gradient.
#[derive(Debug, Clone, Copy)]
enum Conjugate {
    Identity,
    AllReduce,
    AllGather { dim: usize },
    ReduceScatter { dim: usize },
    Split { dim: usize },
}

impl Conjugate {
    fn op_name(self) -> &'static str {
        match self {
            Conjugate::Identity => "tp-value-identity-bwd",
            Conjugate::AllReduce => "tp-value-all-reduce-bwd",
            Conjugate::AllGather { .. } => "tp-value-all-gather-bwd",
            Conjugate::ReduceScatter { .. } => "tp-value-reduce-scatter-bwd",
            Conjugate::Split { .. } => "tp-value-split-bwd",
        }
    }

    fn apply(self, grad: &Tensor, g: &dyn Communicator) -> Result<Tensor> {
        match self {
            Conjugate::Identity => Ok(grad.clone()),
            Conjugate::AllReduce => g
                .all_reduce(&grad.contiguous()?, ReduceOp::Sum)
                .map_err(comm_err),
            Conjugate::AllGather { dim } => all_gather_along(g, grad, dim),
            Conjugate::ReduceScatter { dim } => reduce_scatter_along(g, grad, dim),
            Conjugate::Split { dim } => split_along(g, grad, dim),
        }
    }
}

/// `(x, v) ↦ v` in forward; `dx = conjugate(dy)` in backward.
fn with_conjugate(x: &Tensor, v: Tensor, conjugate: Conjugate, group: &Comm) -> Result<Tensor> {
    let group = group.clone();
    value_with_backward(x, v, conjugate.op_name(), move |grad| {
        conjugate.apply(grad, group.as_ref())
    })
}

/// `(x, v) ↦ v` in forward; `dx = backward(dy)` in backward, nothing to `v`.
///
/// The mechanism every differentiable collective shares (here and in
/// [`crate::expert_parallel::all_to_all`]): `v` was computed outside the graph, and this records
/// the op that connects it to `x`. Recorded whenever `x` descends from a `Var`, even when `x` or
/// `v` has no elements, so every rank issues the backward collective; otherwise `v` is returned.
pub(crate) fn value_with_backward<F>(
    x: &Tensor,
    v: Tensor,
    name: &'static str,
    backward: F,
) -> Result<Tensor>
where
    F: Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
{
    if !x.track_op() {
        return Ok(v);
    }
    x.apply_op2(&v, ValueWithBackward { name, backward })
}

struct ValueWithBackward<F> {
    name: &'static str,
    backward: F,
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

impl<F> CustomOp2 for ValueWithBackward<F>
where
    F: Fn(&Tensor) -> Result<Tensor> + Send + Sync,
{
    fn name(&self) -> &'static str {
        self.name
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
        Ok((Some((self.backward)(grad)?), None))
    }
}
