//! The column-parallel linear: W split on its output dim, each rank computing a slice of the
//! output features from the whole input. Its input enters through f (Megatron's
//! `copy_to_tp_region`): the identity in forward, the all-reduce of the input gradient in
//! backward, since every rank's copy of x fed a different W_r.
//!
//! ```text
//!   W = [W_0; W_1; …; W_{tp-1}]   rank r holds W_r (out/tp, in) and b_r (out/tp,)
//!
//!   forward    x (N, in) ──f: identity──> y_r = x W_rᵀ + b_r          (N, out/tp)
//!   backward   dx_r = dy_r W_r  ──f: all-reduce over tp──> dx = Σ_r dx_r   (N, in)
//!              dW_r = dy_rᵀ x    db_r = Σ_rows dy_r                     (no communication)
//! ```
//!
//! Under sequence parallelism the block all-gathers the sequence before the layer
//! ([`super::sequence`]) and reduce-scatters the gradient after it; the layer then issues
//! nothing ([`ColumnInput::SequenceGathered`]).
//!
//! With `--tp-overlap chunked` the input gradient is computed and all-reduced chunk by chunk,
//! each chunk's output gradient made by the layers after (attention's backward) as it is asked
//! for, and the weight gradient computed while the last chunks are on the wire
//! ([`super::overlap`]);
//! with `ring`, the sequence all-gather is the layer's, a ring with its product.
//!
//! Legend: `N` rows (B·T), `in`/`out` the full layer's features, `tp` the group's size.

use std::ops::Range;

use candle_core::Tensor;
use mtrain_comm::Comm;
use mtrain_model::explicit::DenseTape;
use mtrain_model::layers::{linear, weight_and_bias};
use mtrain_model::tape::{cat_rows, TapedLinear, WeightGrads};
use mtrain_model::{Linear, Param};

use super::mapping::{Mapping, TpCollective};
use super::overlap::{chunks, rows_of};
use super::ring;
use crate::plan::TpOverlap;
use crate::ops::gather_from_tp_region;

/// How a column-parallel layer receives its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColumnInput {
    /// The full input is replicated on every rank: pass it through f (all-reduce its gradient).
    Replicated,
    /// The input already came through `gather_from_sequence_parallel_region`, whose backward
    /// reduce-scatters (sums) the gradient: nothing more to do here.
    SequenceGathered,
    /// This rank's sequence part (N/tp, in), gathered around the ring ([`super::ring`]).
    SequenceRing,
}

impl ColumnInput {
    /// How the column layers of a sub-layer entered through `enter` ([`super::BlockMappings`]:
    /// f or the sequence all-gather) get their input: through f, which they issue, or already
    /// gathered by the block (or, under `--tp-overlap ring`, by the layer itself).
    pub fn entered_through(enter: Mapping, overlap: TpOverlap) -> Self {
        match (enter, overlap) {
            (Mapping::CopyToTp, _) => ColumnInput::Replicated,
            (_, TpOverlap::Ring) => ColumnInput::SequenceRing,
            _ => ColumnInput::SequenceGathered,
        }
    }

    /// The mapping the column layer itself issues on its input.
    pub fn mapping(self) -> Option<Mapping> {
        match self {
            ColumnInput::Replicated => Some(Mapping::CopyToTp),
            ColumnInput::SequenceGathered => None,
            ColumnInput::SequenceRing => Some(Mapping::GatherFromSequence),
        }
    }
}

/// `y = x Wᵀ + b` with W split on the output dim: this rank holds `W_r` (out/tp, in) and `b_r`.
pub struct ColumnParallelLinear {
    /// (out/tp, in)
    pub weight: Param,
    /// (out/tp,)
    pub bias: Option<Param>,
    pub input: ColumnInput,
    /// Gather the output slices into the full (…, out) on every rank (otherwise keep (…, out/tp)).
    pub gather_output: bool,
    pub group: Comm,
    /// Whether f's all-reduce of the input gradient is cut into chunks that overlap the products.
    pub overlap: TpOverlap,
}

impl Linear for ColumnParallelLinear {
    /// The layer under candle's autograd, f as a differentiable collective: the tests' oracle
    /// for [`ColumnTape`], which is what the training step runs.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = match self.input.mapping() {
            Some(m) => m.apply(x, &self.group)?,
            None => x.clone(),
        };
        let b = self.bias.as_ref().map(|b| b.tensor());
        let y = linear(&x, &self.weight.tensor(), b.as_ref())?; // (B, T, out/tp)
        if self.gather_output {
            gather_from_tp_region(&y, &self.group) // (B, T, out)
        } else {
            Ok(y)
        }
    }

    fn params(&self) -> Vec<Param> {
        weight_and_bias(&self.weight, self.bias.as_ref())
    }

    /// The layer in a block's tape; none with `gather_output` (not a block's layer).
    fn taped(&self, x: &Tensor) -> Option<Box<dyn TapedLinear>> {
        if self.gather_output {
            return None;
        }
        Some(Box::new(ColumnTape {
            dense: DenseTape::of(&self.weight, self.bias.as_ref()?, x)?,
            f: self.input.mapping(),
            ring: self.input == ColumnInput::SequenceRing,
            group: self.group.clone(),
            overlap: self.overlap,
        }))
    }
}

/// The column-parallel layer as the training step runs it: this rank's product (the dense
/// layer's tape over `W_r`, `b_r`) and f around it.
struct ColumnTape {
    dense: DenseTape,
    /// f, or None where the block's sequence all-gather entered instead.
    f: Option<Mapping>,
    /// The input is this rank's sequence part, gathered around the ring with the product.
    ring: bool,
    group: Comm,
    overlap: TpOverlap,
}

impl ColumnTape {
    /// f in forward on x (N, in): the identity (the table says so; kept for its symmetry).
    fn f_forward(&self, x: &Tensor, b: usize) -> candle_core::Result<Tensor> {
        match self.f.and_then(Mapping::forward) {
            Some(c) => c.run_rows(x, b, &self.group),
            None => Ok(x.clone()),
        }
    }

    /// f's conjugate on the input gradient: the all-reduce over tp, or None.
    fn f_backward(&self) -> Option<TpCollective> {
        self.f.and_then(Mapping::backward)
    }
}

impl ColumnTape {
    /// dx = Σ_tp dy_r W_r (N, in) with dy made chunk by chunk: chunk i's all-reduce on the wire
    /// while chunk i+1's dy is made and multiplied, then dW and db computed (or kept for W)
    /// while the last chunks are on the wire.
    fn chunked_input_grad(
        &self,
        f: TpCollective,
        x: &Tensor,
        chunks: Vec<Range<usize>>,
        grads: &mut WeightGrads,
        make: &mut dyn FnMut(Range<usize>) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        let w = self.dense.weight()?; // (out/tp, in)
        let mut dys = Vec::with_capacity(chunks.len());
        let mut in_flight = Vec::with_capacity(chunks.len());
        for seqs in chunks {
            let dy = make(seqs.clone())?; // (N/k, out/tp)
            let part = mtrain_kernels::matmul(&dy, &w)?; // (N/k, in), partial
            in_flight.push(f.start_rows(&part, seqs.len(), &self.group)?);
            dys.push(dy);
        }
        drop(w);
        let dy = cat_rows(dys)?; // (N, out/tp)
        grads.linear(self.dense.names(), &dy, x, &self.dense.bias()?)?;
        let sums = in_flight
            .into_iter()
            .map(|c| c.finish())
            .collect::<candle_core::Result<Vec<_>>>()?; // k × (N/k, in)
        cat_rows(sums) // Σ_tp (N, in)
    }
}

impl TapedLinear for ColumnTape {
    fn weight(&self) -> candle_core::Result<Tensor> {
        self.dense.weight()
    }

    /// x (N, in) -> (x, y_r = x W_rᵀ + b_r (N, out/tp)).
    fn forward(&self, x: &Tensor, b: usize) -> candle_core::Result<(Tensor, Tensor)> {
        if self.ring {
            let (x, y, _) = ring::column_forward(&self.dense, x, b, &self.group, false)?;
            return Ok((x, y)); // (N, in), (N, out/tp)
        }
        let x = self.f_forward(x, b)?; // (N, in), the same on every rank
        self.dense.forward(&x, b)
    }

    fn forward_residual(
        &self,
        r: &Tensor,
        x: &Tensor,
        b: usize,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        if self.ring {
            return self.forward(x, b).and_then(|(x, y)| Ok((x, (r + y)?))); // (N, out/tp)
        }
        let x = self.f_forward(x, b)?;
        self.dense.forward_residual(r, &x, b) // (N, out/tp)
    }

    fn forward_gelu(&self, x: &Tensor, b: usize) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        if self.ring {
            let (x, f, g) = ring::column_forward(&self.dense, x, b, &self.group, true)?;
            return Ok((x, f, g.expect("asked for gelu(f)"))); // (N, in), f, gelu(f) (N, out/tp)
        }
        let x = self.f_forward(x, b)?;
        self.dense.forward_gelu(&x, b) // f, gelu(f) (N, out/tp)
    }

    /// dx = Σ_tp dy_r W_r (N, in): the product here, the sum by f's conjugate; dW_r, db_r.
    fn backward(
        &self,
        x: &Tensor,
        dy: &Tensor,
        b: usize,
        grads: &mut WeightGrads,
        gelu_of: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        if self.ring {
            return ring::column_backward(&self.dense, x, dy, b, &self.group, grads, gelu_of);
        }
        let Some(f) = self.f_backward() else {
            // Nothing between the product and a GELU before it: one fused GEMM.
            return self.dense.backward(x, dy, b, grads, gelu_of); // (N, in)
        };
        let dx = match chunks(self.overlap, b) {
            None => {
                let dx = self.dense.backward(x, dy, b, grads, None)?; // dy_r W_r (N, in), partial
                f.run_rows(&dx, b, &self.group)? // all-reduce: Σ_tp (N, in)
            }
            Some(chunks) => {
                self.chunked_input_grad(f, x, chunks, grads, &mut |seqs| rows_of(dy, b, &seqs))?
            }
        };
        match gelu_of {
            Some(pre) => mtrain_kernels::gelu::backward(pre, &dx), // through the GELU before
            None => Ok(dx),
        }
    }

    /// The layer after made its input gradient chunk by chunk, each chunk's f-conjugate sent
    /// as the next is made.
    fn backward_from(
        &self,
        x: &Tensor,
        b: usize,
        grads: &mut WeightGrads,
        make: &mut dyn FnMut(Range<usize>) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        match (self.ring, self.f_backward(), chunks(self.overlap, b)) {
            (false, Some(f), Some(chunks)) => self.chunked_input_grad(f, x, chunks, grads, make),
            _ => {
                let dy = make(0..b)?; // (N, out/tp)
                self.backward(x, &dy, b, grads, None)
            }
        }
    }

    fn zero_grads(&self, grads: &mut WeightGrads) -> candle_core::Result<()> {
        self.dense.zero_grads(grads)
    }
}
