//! The interface between a hand-written backward pass and the engine: a segment's graph-free
//! forward returns a [`Tape`] holding what its backward needs, and the engine calls
//! [`Tape::backward`] in place of autograd ([`crate::engine::Backward`] says where).
//! The tapes of the GPT's segments are in [`crate::explicit`]. A sharded layer hands its
//! tape the communication it needs as values of the two traits below: [`Collective`]
//! (tensor and sequence parallelism) and [`Exchange`] (expert parallelism).

use candle_core::{Result, Tensor};

use crate::moe::stats::MoeStats;

/// Gradients a tape's backward returns.
pub struct TapeGrads {
    /// Parameter gradients by name, in the parameters' dtype.
    pub params: Vec<(String, Tensor)>,
    /// Gradient w.r.t. the segment's input (None for integer token ids).
    pub input: Option<Tensor>,
}

/// What a segment's graph-free forward keeps, and the backward that consumes it.
pub trait Tape: Send {
    /// The segment's output (the scalar loss for a head given targets).
    fn output(&self) -> &Tensor;
    /// The segment's auxiliary loss (already times its coefficients; a mixture of experts'
    /// load-balancing and z-losses), whose gradient times `loss_scale` [`Tape::backward`]
    /// adds, as the engine adds `loss_scale · aux` to autograd's objective. None: no such loss.
    fn aux_loss(&self) -> Option<&Tensor> {
        None
    }
    /// Routing statistics, for a segment with a mixture of experts.
    fn stats(&self) -> Option<MoeStats> {
        None
    }
    /// Gradients for `grad_out`, the gradient w.r.t. the output; None when the output is the
    /// scalar loss, whose gradient is `loss_scale`.
    fn backward(self: Box<Self>, grad_out: Option<&Tensor>, loss_scale: f64) -> Result<TapeGrads>;
}

/// A collective that a sharded layer puts into a tape's forward, and its conjugate, which the
/// tape's backward runs on the gradient at the same place: tensor parallelism's f and g and
/// their sequence-parallel halves. Both directions take and return activations (B, T, F). The
/// model crate knows no ranks; the parallel crate implements this for its layers.
pub trait Collective: Send + Sync {
    /// The forward communication (f: none; g: all-reduce; sequence parallelism: all-gather or
    /// reduce-scatter along T).
    fn forward(&self, x: &Tensor) -> Result<Tensor>;
    /// The conjugate on the gradient (f: all-reduce; g: none; the other sequence half).
    fn backward(&self, dy: &Tensor) -> Result<Tensor>;
}

/// Expert parallelism's row exchange, as a tape runs it: the rows of this rank's kept
/// (token, expert) pairs go to the ranks holding their experts (dispatch) and the experts'
/// outputs come back (combine). Both are one all-to-all along dim 0 with the splits swapped,
/// so the backward of a dispatch is a combine over the same counts and vice versa. The model
/// crate knows no ranks; the parallel crate implements this over its ep group.
pub trait Exchange: Send + Sync {
    /// Ranks of the group; rank p holds experts `p · E_l .. (p + 1) · E_l`.
    fn size(&self) -> usize;
    /// The counts all-to-all: `counts` (ranks · E_l,) are the rows this rank sends to each
    /// expert; returns (ranks · E_l,), entry `s · E_l + j` the rows rank s sends to this rank's
    /// local expert j.
    fn counts(&self, counts: &[usize]) -> Result<Vec<usize>>;
    /// The rows all-to-all: block p of x (`send[p]` rows, F) goes to rank p; returns the
    /// blocks received from ranks 0, 1, … (`recv[s]` rows each).
    fn rows(&self, x: &Tensor, send: &[usize], recv: &[usize]) -> Result<Tensor>;
    /// The dispatch as the autograd path records it: [`Exchange::rows`] of x (S, F) by the
    /// dispatch's splits, whose backward sends the gradient back the reverse way.
    fn dispatch(&self, x: &Tensor, send: &[usize], recv: &[usize]) -> Result<Tensor>;
    /// The combine, recorded likewise: y (R, F) back by the dispatch's splits swapped.
    fn combine(&self, y: &Tensor, send: &[usize], recv: &[usize]) -> Result<Tensor>;
}
