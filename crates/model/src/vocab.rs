//! The vocabulary as the two ends of the model see it: the tied `wte` (V, C) is held whole on
//! one device ([`AllRows`]), or under vocabulary parallelism split by rows, a rank holding
//! `[r·V/tp, (r+1)·V/tp)` (the parallel crate's shard). The embedding ([`VocabRows`]) looks up
//! the rows it holds and sums the holders' parts; the head ([`VocabLoss`]) takes the logits of
//! the rows it holds to the loss. The embedding, the head and their tapes
//! ([`crate::gpt::Embedding`], [`crate::gpt::Head`], [`crate::explicit`]) are written once over
//! these, the split's lookup, collectives and loss in their places.
//!
//! ```text
//!   embedding   ids ─rows─► wte_r[rows]·mine ─sum─► + wpe ─► x (B, T_r, C)
//!   head        x ─ln_f─► enter ─► h (N, C) ─·wte_rᵀ─► z (N, V_r) ─loss─► mean cross-entropy
//!   AllRows     rows = ids, no mask; sum, enter: none; loss: the kernels' cross-entropy
//! ```
//!
//! Legend: `B` batch, `T` time (`T_r` the positions a rank's output covers), `C` width, `V`
//! vocabulary (`V_r` the rows held here), `N = B·T`.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};
use mtrain_kernels::cross_entropy;

use crate::tape::Collective;

/// Which rows of the vocabulary a token embedding holds, and how the holders' lookups add up
/// to the embedding.
pub trait VocabRows: Send + Sync {
    /// Each id's row among the `held` rows of `wte`, with a (N,) 0/1 mask in `dtype` of the
    /// ids held here (None: all are) for ids (N,) u32.
    fn rows(&self, ids: &Tensor, held: usize, dtype: DType) -> Result<(Tensor, Option<Tensor>)>;
    /// The holders' token parts (B, T, C) summed, as autograd records it: (B, T, C), or this
    /// rank's positions (B, T_r, C).
    fn sum(&self, tok: &Tensor) -> Result<Tensor>;
    /// The same sum as a tape's collective (None: nothing to sum).
    fn sum_taped(&self) -> Option<Arc<dyn Collective>>;
    /// The first position of a sequence of `t` the output covers (0: it covers them all).
    fn first_position(&self, _t: usize) -> usize {
        0
    }
}

/// The head's end of the vocabulary: the collective entering the LM head after `ln_f`, and
/// the loss (or the full logits) from the logits of the rows held here.
pub trait VocabLoss: Send + Sync {
    /// `ln_f`'s output (B, T_r, C) entering the LM head, as autograd records it: (B, T, C).
    fn enter(&self, h: &Tensor) -> Result<Tensor>;
    /// The same as a tape's collective (None: none).
    fn enter_taped(&self) -> Option<Arc<dyn Collective>>;
    /// The full logits (B, T, V) from this holder's (B, T, V_r), for sampling.
    fn logits(&self, z: &Tensor) -> Result<Tensor>;
    /// The mean cross-entropy of the logits (B, T, V_r) against targets (B, T) u32, as
    /// autograd records it; the same scalar on every holder.
    fn loss(&self, z: &Tensor, targets: &Tensor) -> Result<Tensor>;
    /// The same loss computed graph-free from z (N, V_r) and targets (N,), and what its
    /// gradient needs of it. z is the loss's from here on: the gradient may be written over it.
    fn loss_taped(&self, z: Tensor, targets: &Tensor) -> Result<(Tensor, Box<dyn LogitsGrad>)>;
}

/// What a head's loss keeps of its graph-free forward for the gradient of the logits.
pub trait LogitsGrad: Send {
    /// dz (N, V_r), the logits' gradient for `g_row`, the gradient of each row's loss (s / N
    /// for a mean over N rows whose gradient is s).
    fn grad(self: Box<Self>, g_row: f64) -> Result<Tensor>;
}

/// The whole vocabulary on one device: each id is its own row, nothing to sum or enter, the
/// loss the kernels crate's cross-entropy.
pub struct AllRows;

impl VocabRows for AllRows {
    fn rows(&self, ids: &Tensor, _held: usize, _dtype: DType) -> Result<(Tensor, Option<Tensor>)> {
        Ok((ids.clone(), None))
    }

    fn sum(&self, tok: &Tensor) -> Result<Tensor> {
        Ok(tok.clone())
    }

    fn sum_taped(&self) -> Option<Arc<dyn Collective>> {
        None
    }
}

impl VocabLoss for AllRows {
    fn enter(&self, h: &Tensor) -> Result<Tensor> {
        Ok(h.clone())
    }

    fn enter_taped(&self) -> Option<Arc<dyn Collective>> {
        None
    }

    fn logits(&self, z: &Tensor) -> Result<Tensor> {
        Ok(z.clone())
    }

    fn loss(&self, z: &Tensor, targets: &Tensor) -> Result<Tensor> {
        mtrain_kernels::cross_entropy(z, targets)
    }

    fn loss_taped(&self, z: Tensor, targets: &Tensor) -> Result<(Tensor, Box<dyn LogitsGrad>)> {
        let targets = targets.to_dtype(DType::U32)?; // (N,)
        let (rows, lse) = cross_entropy::forward(&z, &targets)?; // (N,)
        let loss = rows.mean_all()?; // scalar, f32
        let logits = z;
        Ok((
            loss,
            Box::new(CrossEntropy {
                logits,
                targets,
                lse,
            }),
        ))
    }
}

/// The cross-entropy of all the logits, kept: z (N, V), the targets (N,) and log Σ e^z (N,).
/// Its gradient is written over z, which the tape alone holds.
struct CrossEntropy {
    logits: Tensor,
    targets: Tensor,
    lse: Tensor,
}

impl LogitsGrad for CrossEntropy {
    fn grad(self: Box<Self>, g_row: f64) -> Result<Tensor> {
        let n = self.logits.dim(0)?;
        let g = Tensor::full(g_row as f32, n, self.logits.device())?; // (N,)
        let dz = cross_entropy::backward_in_place(self.logits, &self.targets, &self.lse, &g)?;
        Ok(dz) // (N, V), in z's storage
    }
}
