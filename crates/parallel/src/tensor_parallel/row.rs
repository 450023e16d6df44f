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
//! With `--tp-overlap chunked` the forward computes and sends chunk by chunk ([`super::overlap`]).
//! With `--tp-overlap ring` the sequence reduce-scatter is a ring with the product
//! ([`super::ring`]).
//!
//! Legend: `N` rows (B·T), `in`/`out` the full layer's features, `tp` the group's size.

use candle_core::Tensor;
use mtrain_comm::Comm;
use mtrain_kernels::{bias, linear as fused};
use mtrain_model::explicit::DenseTape;
use mtrain_model::layers::{linear, weight_and_bias};
use mtrain_model::tape::{TapedLinear, WeightGrads};
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

    /// g(x_r W_rᵀ): the partial products summed over tp, (N, out) or (N/tp, out) under SP.
    fn summed_product(&self, x: &Tensor, b: usize) -> candle_core::Result<Tensor> {
        let w_t = self.dense.weight()?.t()?; // (in/tp, out)
        let Some(c) = self.g.forward() else {
            return mtrain_kernels::matmul(x, &w_t);
        };
        if self.ring() {
            return ring::row_forward(x, &w_t, b, &self.group); // Σ_tp (N/tp, out)
        }
        let Some(chunks) = chunks(self.overlap, b) else {
            let partial = mtrain_kernels::matmul(x, &w_t)?; // (N, out), partial
            return c.run_rows(&partial, b, &self.group); // all-reduce: Σ_tp (N', out)
        };
        // Chunk i's g on the wire while chunk i+1's product is computed.
        let mut in_flight = Vec::with_capacity(chunks.len());
        for seqs in &chunks {
            let partial = mtrain_kernels::matmul(&rows_of(x, b, seqs)?, &w_t)?; // (N/k, out)
            in_flight.push(c.start_rows(&partial, seqs.len(), &self.group)?);
        }
        let sums = in_flight
            .into_iter()
            .map(|f| f.finish())
            .collect::<candle_core::Result<Vec<_>>>()?; // k × (N'/k, out)
        Tensor::cat(&sums, 0) // (N', out)
    }
}

impl TapedLinear for RowTape {
    fn weight(&self) -> candle_core::Result<Tensor> {
        self.dense.weight()
    }

    /// x_r (N, in/tp) -> (x_r, Σ_tp x_r W_rᵀ + b (N', out)).
    fn forward(&self, x: &Tensor, b: usize) -> candle_core::Result<(Tensor, Tensor)> {
        let y = mtrain_kernels::bias_add(&self.summed_product(x, b)?, &self.dense.bias()?)?;
        Ok((x.clone(), y))
    }

    /// r + Σ_tp x_r W_rᵀ + b, the bias and the residual added in one pass.
    fn forward_residual(
        &self,
        r: &Tensor,
        x: &Tensor,
        b: usize,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let y = bias::residual_add(r, &self.summed_product(x, b)?, &self.dense.bias()?)?;
        Ok((x.clone(), y)) // (N', out)
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
