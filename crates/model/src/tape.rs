//! The interface between a hand-written backward pass and the engine: a segment's graph-free
//! forward returns a [`Tape`] holding what its backward needs, and the engine calls
//! [`Tape::backward`] in place of autograd ([`crate::engine::Backward`] says where).
//! The tapes of the GPT's segments are in [`crate::explicit`].

use candle_core::{Result, Tensor};

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
