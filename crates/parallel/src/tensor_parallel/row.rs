//! The row-parallel linear: W split on its input dim, each rank multiplying its slice of the
//! input features; the partial products leave through g (Megatron's `reduce_from_tp_region`):
//! the all-reduce in forward, the identity in backward. The bias is added once, after the sum.
//!
//! ```text
//!   W = [W_0 | W_1 | … | W_{tp-1}]   rank r holds W_r (out, in/tp); b (out,) on every rank
//!
//!   forward    x_r (N, in/tp) ── x_r W_rᵀ (N, out), partial ──g: all-reduce──> Σ_r + b  (N, out)
//!   backward   dy (N, out) ──g: identity──> dx_r = dy W_r (N, in/tp)
//!              dW_r = dyᵀ x_r    db = Σ_rows dy                     (no communication)
//! ```
//!
//! Under sequence parallelism g becomes a reduce-scatter along T in forward (each rank keeps
//! the sums of its T/tp positions, (N/tp, out)) and an all-gather of the gradient in backward
//! ([`RowOutput::ReduceScatterSequence`]).
//!
//! With `--tp-overlap chunked` the forward asks the sub-layer before for its input chunk by
//! chunk and sends each chunk's sum while the next is made ([`super::overlap`]).
//! With `--tp-overlap ring` the sequence reduce-scatter is a ring with the product
//! ([`super::ring`]).
//!
//! Legend: `N` rows (B·T), `in`/`out` the full layer's features, `tp` the group's size.

use std::ops::Range;

use candle_core::Tensor;
use mtrain_comm::Comm;
use mtrain_kernels::{bias, linear as fused};
use mtrain_model::explicit::DenseTape;
use mtrain_model::layers::{linear, weight_and_bias};
use mtrain_model::tape::{cat_rows, TapedLinear, WeightGrads};
use mtrain_model::{Linear, Param};

use super::mapping::Mapping;
use super::overlap::{chunks, rows_of};
use super::ring;
use crate::plan::TpOverlap;

/// Where a row-parallel layer's partial sums go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowOutput {
    /// All-reduce (g): every rank gets the full output.
    AllReduce,
    /// Reduce-scatter along the sequence: every rank gets the full sum for 1/tp of the tokens.
    ReduceScatterSequence,
}

impl RowOutput {
    /// The row layers of a sub-layer left through `leave` ([`super::BlockMappings`]: g or the
    /// sequence reduce-scatter).
    pub fn left_through(leave: Mapping) -> Self {
        match leave {
            Mapping::ReduceScatterToSequence => RowOutput::ReduceScatterSequence,
            _ => RowOutput::AllReduce,
        }
    }

    /// The mapping the row layer issues on its partial sums.
    pub fn mapping(self) -> Mapping {
        match self {
            RowOutput::AllReduce => Mapping::ReduceFromTp,
            RowOutput::ReduceScatterSequence => Mapping::ReduceScatterToSequence,
        }
    }
}

/// `y = x Wᵀ + b` with W split on the input dim: this rank holds `W_r` (out, in/tp) and reads
/// its slice `x_r` (…, in/tp) of the input; the partial products are summed over the group and
/// the full bias `b` (out,) is added once, after the sum.
pub struct RowParallelLinear {
    /// (out, in/tp)
    pub weight: Param,
    /// (out,), replicated
    pub bias: Option<Param>,
    pub output: RowOutput,
    pub group: Comm,
    /// Whether g is cut into chunks that overlap the product.
    pub overlap: TpOverlap,
}

impl Linear for RowParallelLinear {
    /// The layer under candle's autograd, g as a differentiable collective: the tests' oracle
    /// for [`RowTape`], which is what the training step runs.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let partial = linear(x, &self.weight.tensor(), None)?; // (B, T, out), partial sum
        let y = self.output.mapping().apply(&partial, &self.group)?; // (B, T, out) or (B, T/tp, out)
        match &self.bias {
            Some(b) => y.broadcast_add(&b.tensor()),
            None => Ok(y),
        }
    }

    fn params(&self) -> Vec<Param> {
        weight_and_bias(&self.weight, self.bias.as_ref())
    }

    fn taped(&self, x: &Tensor) -> Option<Box<dyn TapedLinear>> {
        Some(Box::new(RowTape {
            dense: DenseTape::of(&self.weight, self.bias.as_ref()?, x)?,
            g: self.output.mapping(),
            group: self.group.clone(),
            overlap: self.overlap,
        }))
    }
}

/// The row-parallel layer as the training step runs it: this rank's product over `W_r`, g on
/// it, then the bias (g sits between the product and the bias, so the bias cannot be the
/// GEMM's epilogue as in the dense layer).
struct RowTape {
    dense: DenseTape,
    /// g, or the sequence reduce-scatter.
    g: Mapping,
    group: Comm,
    overlap: TpOverlap,
}

impl RowTape {
    /// Whether g is sequence parallelism's reduce-scatter, run around the ring.
    fn ring(&self) -> bool {
        self.overlap == TpOverlap::Ring && self.g == Mapping::ReduceScatterToSequence
    }

    /// g(x_r W_rᵀ) of the input `make` gives ([`TapedLinear::forward_from`]), chunk by chunk
    /// under `chunked`: the input x_r (N, in/tp) and the partial products summed over tp,
    /// (N, out) or (N/tp, out) under SP.
    fn summed_product_from(
        &self,
        b: usize,
        make: &mut dyn FnMut(Range<usize>) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let w_t = self.dense.weight()?.t()?; // (in/tp, out)
        let whole = match (self.g.forward(), self.ring()) {
            (Some(c), false) => chunks(self.overlap, b).map(|chunks| (c, chunks)),
            _ => None,
        };
        let Some((c, chunks)) = whole else {
            let x = make(0..b)?; // (N, in/tp)
            let y = match self.g.forward() {
                None => mtrain_kernels::matmul(&x, &w_t)?,
                Some(_) if self.ring() => ring::row_forward(&x, &w_t, b, &self.group)?, // (N/tp, out)
                Some(c) => {
                    let partial = mtrain_kernels::matmul(&x, &w_t)?; // (N, out), partial
                    c.run_rows(&partial, b, &self.group)? // all-reduce: Σ_tp (N', out)
                }
            };
            return Ok((x, y));
        };
        // Chunk i's g on the wire while chunk i+1 is made (the sub-layer before) and multiplied.
        let mut inputs = Vec::with_capacity(chunks.len());
        let mut in_flight = Vec::with_capacity(chunks.len());
        for seqs in chunks {
            let x = make(seqs.clone())?; // (N/k, in/tp)
            let partial = mtrain_kernels::matmul(&x, &w_t)?; // (N/k, out)
            in_flight.push(c.start_rows(&partial, seqs.len(), &self.group)?);
            inputs.push(x);
        }
        let sums = in_flight
            .into_iter()
            .map(|f| f.finish())
            .collect::<candle_core::Result<Vec<_>>>()?; // k × (N'/k, out)
        Ok((cat_rows(inputs)?, cat_rows(sums)?)) // (N, in/tp), (N', out)
    }
}

impl TapedLinear for RowTape {
    fn weight(&self) -> candle_core::Result<Tensor> {
        self.dense.weight()
    }

    /// x_r (N, in/tp) -> (x_r, Σ_tp x_r W_rᵀ + b (N', out)).
    fn forward(&self, x: &Tensor, b: usize) -> candle_core::Result<(Tensor, Tensor)> {
        self.forward_from(None, b, &mut |seqs| rows_of(x, b, &seqs))
    }

    /// r + Σ_tp x_r W_rᵀ + b, the bias and the residual added in one pass.
    fn forward_residual(
        &self,
        r: &Tensor,
        x: &Tensor,
        b: usize,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        self.forward_from(Some(r), b, &mut |seqs| rows_of(x, b, &seqs)) // (N', out)
    }

    /// The sub-layer before made chunk by chunk, each chunk's g sent as the next is made.
    fn forward_from(
        &self,
        r: Option<&Tensor>,
        b: usize,
        make: &mut dyn FnMut(Range<usize>) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (x, sum) = self.summed_product_from(b, make)?; // (N, in/tp), (N', out)
        let bias = self.dense.bias()?;
        let y = match r {
            Some(r) => bias::residual_add(r, &sum, &bias)?,
            None => mtrain_kernels::bias_add(&sum, &bias)?,
        };
        Ok((x, y))
    }

    fn forward_gelu(&self, x: &Tensor, b: usize) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let (x, f) = self.forward(x, b)?;
        let g = mtrain_kernels::gelu(&f)?;
        Ok((x, f, g))
    }

    /// dx_r = dy W_r (N, in/tp), dW_r = dyᵀ x_r, db = Σ_rows dy; g's conjugate (the identity,
    /// or the sequence all-gather of dy) first.
    fn backward(
        &self,
        x: &Tensor,
        dy: &Tensor,
        b: usize,
        grads: &mut WeightGrads,
        gelu_of: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let dy_rows = dy; // (N', out), the rows the bias was added to
        if self.ring() {
            return ring::row_backward(&self.dense, x, dy_rows, b, &self.group, grads, gelu_of);
        }
        let (w_name, b_name) = self.dense.names();
        let dy = match self.g.backward() {
            Some(c) => c.run_rows(dy, b, &self.group)?, // SP: all-gather T (N, out)
            None => dy.clone(),                         // g: the identity
        };
        let w = self.dense.weight()?; // (out, in/tp), gathered again under ZeRO-3
        let dx = match gelu_of {
            Some(f) => fused::input_grad_gelu(&dy, &w, f)?, // df (N, in/tp)
            None => mtrain_kernels::matmul(&dy, &w)?,       // (N, in/tp)
        };
        drop(w);
        let db = bias::grad(dy_rows, &self.dense.bias()?)?; // (out,)
        grads.product(w_name, &dy, x)?; // dW_r (out, in/tp), now or in W
        grads.push((b_name, db));
        Ok(dx)
    }

    fn zero_grads(&self, grads: &mut WeightGrads) -> candle_core::Result<()> {
        self.dense.zero_grads(grads)
    }
}
