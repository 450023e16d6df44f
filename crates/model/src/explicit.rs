//! Hand-written backward passes: a segment's forward that records no autograd graph, keeps what
//! its backward needs on a [`Tape`], and a backward written out layer by layer.
//!
//! candle's autograd gives every edge of the graph its own gradient buffer: it allocates zeros
//! for the first contribution and adds each contribution into it, so a block's ~50 edges cost
//! ~50 extra elementwise passes over (N, C)..(N, 4C) tensors. The tapes compute the same
//! gradients with one buffer per quantity, each residual branch's gradient added by the
//! LayerNorm backward that meets it:
//!
//! ```text
//!   block forward (kept: x, h1, qkv, ym, x1, h2, f, g, LayerNorm stats, lse)
//!     x ─ln_1─> h1 ─c_attn─> qkv (N, 3C) ─flash─> ym (N, C) ─c_proj─> a      (attention on the
//!                                          tokens' layout: attention::forward_tokens)
//!     x1 = x + a ─ln_2─> h2 ─c_fc─> f (N, 4C) ─gelu─> g ─c_proj─> m        out = x1 + m
//!
//!   block backward, given dout:
//!     dg  = dout·W_mp      dW_mp = doutᵀ·g     db_mp = Σ_rows dout
//!     df  = gelu'(f, dg)
//!     dh2 = df·W_fc        dW_fc = dfᵀ·h2      db_fc = Σ_rows df
//!     dx1 = dout + ln_2ᵀ(dh2)                               (the residual, added by ln_2ᵀ)
//!     dym = dx1·W_p        dW_p  = dx1ᵀ·ym     db_p  = Σ_rows dx1
//!     dqkv = flash'(qkv, ym, dym)                           (N, 3C)
//!     dh1 = dqkv·W_a       dW_a  = dqkvᵀ·h1    db_a  = Σ_rows dqkv
//!     dx  = dx1 + ln_1ᵀ(dh1)                                (the residual, added by ln_1ᵀ)
//!
//!   embedding: x = wte[idx] + wpe[0..T]     dwte = scatter-add of dx rows by id   dwpe = Σ_batch dx
//!
//!   head forward: x ─ln_f─> h ─·wteᵀ─> logits (N, V) ─cross-entropy─> mean loss
//!   head backward: dlogits = (softmax − onehot)·s/N     dh = dlogits·wte
//!                  dwte = dlogitsᵀ·h                     dx = ln_fᵀ(dh)
//! ```
//!
//! Linear weights are (out, in) and `y = x Wᵀ + b`, so `dx = dy W` and `dW = dyᵀ x`.
//! The tapes are written in the graph-free ops of `mtrain_kernels` (`layer_norm::forward`,
//! `attention::backward`, ...): the fused kernels on CUDA, the same algorithms as one-pass f32
//! loops on CPU (`mtrain_kernels::cpu`), so one tape serves both devices. A segment has a tape
//! for layers in f32 or bf16 that say how they run in one ([`Linear::taped`](crate::layers::Linear::taped),
//! [`FeedForward::moe_parts`](crate::layers::FeedForward::moe_parts)): each linear is a
//! [`TapedLinear`] — the dense [`DenseTape`] here, or tensor parallelism's column and row layers,
//! which issue f and g where Megatron puts them (the parallel crate's `tensor_parallel/`) —
//! and the same block tape runs them all ([`sharded_block_tape`]; the embedding and head tapes
//! run the vocabulary's split, [`crate::vocab`]); a block's feed-forward half is the MLP or a
//! mixture of experts, on one device or with its experts across an expert-parallel group (the
//! dispatch and combine all-to-alls, [`Exchange`](crate::tape::Exchange), inside the tape).
//! Whether the engine runs the tapes is its [`Backward`](crate::engine::Backward) value (by
//! default it does, on every device).
//!
//! Where each thing lives:
//! - here: what every tape is built from: [`DenseTape`] (the dense linear), [`Norm`]
//!   (a LayerNorm), `MlpWeights` (the MLP of a block and of each expert);
//! - `block.rs`: the block tape ([`block_tape`], [`sharded_block_tape`]), attention and the
//!   feed-forward half;
//! - `moe.rs`: the mixture-of-experts half of a block: the router's and the aux losses'
//!   gradients, the experts' MLPs, and under expert parallelism the all-to-alls' conjugates;
//! - `head.rs`: the ends of the model, the embedding and the head with its loss
//!   ([`embedding_tape`], [`head_tape`]), the vocabulary whole or split by tp;
//! - `tests.rs`: every tape against autograd, on a GPU and on CPU.
//!
//! Legend: `B` batch, `T` time, `C` width, `H` heads, `D` head size, `V` vocabulary, `N = B·T`.

mod block;
mod head;
mod moe;
#[cfg(test)]
mod tests;

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Result, Tensor};
use mtrain_kernels::{layer_norm, linear};

use crate::layers::{LayerNorm, Mlp};
use crate::param::Param;
use crate::tape::{cat_rows, rows_of, Collective, SlotWeight, TapedLinear, WeightGrads};

pub use block::{block_tape, sharded_block_tape, BlockDropout, LocalAttention};
pub use head::{embedding_tape, head_tape};

/// Whether the tapes take tensors of this dtype (the fused kernels' f32 and bf16).
pub fn taped_dtype(x: &Tensor) -> bool {
    matches!(x.dtype(), DType::F32 | DType::BF16)
}

fn err(s: String) -> candle_core::Error {
    candle_core::Error::Msg(s)
}

/// `c` applied to x (rows, F) viewed as (B, rows/B, F), as (rows', F); x itself where `c` is
/// None. Each collective is called with the activation's (B, T, F) shape.
fn across(
    c: &Option<Arc<dyn Collective>>,
    x: &Tensor,
    b: usize,
    dir: fn(&dyn Collective, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let Some(c) = c else {
        return Ok(x.clone());
    };
    let (rows, f) = x.dims2()?;
    let y = dir(c.as_ref(), &x.reshape((b, rows / b, f))?)?; // (B, T', F)
    let (b2, t2, f2) = y.dims3()?;
    y.reshape((b2 * t2, f2))
}

/// [`across`] in the forward direction.
fn fwd(c: &dyn Collective, x: &Tensor) -> Result<Tensor> {
    c.forward(x)
}

/// [`across`] in the backward direction (the conjugate).
fn bwd(c: &dyn Collective, dy: &Tensor) -> Result<Tensor> {
    c.backward(dy)
}

/// The dense linear layer as a tape runs it: the slots of its weight (out, in) and bias (out,)
/// ([`SlotWeight`]: read, detached, by each pass; the tape differentiates by hand), each
/// product with its bias, residual or GELU in the GEMM's epilogue ([`linear`]). Tensor
/// parallelism's column and row layers are the other [`TapedLinear`]s; they reach this one's
/// tensors and names through its accessors.
pub struct DenseTape {
    w: SlotWeight,
    b: SlotWeight,
}

impl DenseTape {
    /// The tape of the layer with these parameters, for an input like `x`; None for a dtype
    /// the tapes do not take or that differs from the input's.
    pub fn of(weight: &Param, bias: &Param, x: &Tensor) -> Option<DenseTape> {
        let (w, b) = (SlotWeight::of(weight), SlotWeight::of(bias));
        if w.dtype() != x.dtype() || b.dtype() != x.dtype() || !taped_dtype(x) {
            return None;
        }
        Some(DenseTape { w, b })
    }

    /// The bias (out,), read from its slot.
    pub fn bias(&self) -> Result<Tensor> {
        self.b.get()
    }

    /// The weight's and the bias's names.
    pub fn names(&self) -> (String, String) {
        (self.w.name().to_string(), self.b.name().to_string())
    }
}

impl TapedLinear for DenseTape {
    fn weight(&self) -> Result<Tensor> {
        self.w.get()
    }

    /// x (N, in) -> (x, x Wᵀ + b (N, out)).
    fn forward(&self, x: &Tensor, _b: usize) -> Result<(Tensor, Tensor)> {
        let y = linear::forward(x, &self.w.get()?, &self.b.get()?)?; // (N, out)
        Ok((x.clone(), y))
    }

    fn forward_residual(&self, r: &Tensor, x: &Tensor, _b: usize) -> Result<(Tensor, Tensor)> {
        let y = linear::forward_residual(r, x, &self.w.get()?, &self.b.get()?)?; // (N, out)
        Ok((x.clone(), y))
    }

    fn forward_gelu(&self, x: &Tensor, _b: usize) -> Result<(Tensor, Tensor, Tensor)> {
        let (f, g) = linear::forward_gelu(x, &self.w.get()?, &self.b.get()?)?; // (N, out) each
        Ok((x.clone(), f, g))
    }

    /// dx = dy·W (N, in), or df = gelu'(f) ∘ dy·W in the GEMM's epilogue; dW = dyᵀ·x and
    /// db = Σ_rows dy, now or dW in W.
    fn backward(
        &self,
        x: &Tensor,
        dy: &Tensor,
        _b: usize,
        grads: &mut WeightGrads,
        gelu_of: Option<&Tensor>,
    ) -> Result<Tensor> {
        let w = self.w.get()?; // (out, in), gathered again under ZeRO-3
        let dx = match gelu_of {
            Some(f) => linear::input_grad_gelu(dy, &w, f)?, // df (N, in)
            None => mtrain_kernels::matmul(dy, &w)?,      // (N, in)
        };
        drop(w);
        grads.linear(self.names(), dy, x, &self.b.get()?)?;
        Ok(dx)
    }

    fn zero_grads(&self, grads: &mut WeightGrads) -> Result<()> {
        grads.push((self.w.name().to_string(), self.w.zeros()?));
        grads.push((self.b.name().to_string(), self.b.zeros()?));
        Ok(())
    }
}

/// A LayerNorm's parameter slots ([`SlotWeight`]): its forward keeps [`Stats`] and its
/// backward pushes the weight and bias gradients (every tape with a LayerNorm, here and in the
/// sharded segments).
pub struct Norm {
    w: SlotWeight,
    b: SlotWeight,
    eps: f64,
}

impl Norm {
    /// The LayerNorm's tape parameters for an input like `x`, or None for another dtype.
    pub fn of(ln: &LayerNorm, x: &Tensor) -> Option<Norm> {
        let (w, b) = (SlotWeight::of(&ln.weight), SlotWeight::of(&ln.bias));
        if !taped_dtype(x) || w.dtype() != x.dtype() || b.dtype() != x.dtype() {
            return None;
        }
        Some(Norm { w, b, eps: ln.eps })
    }

    /// y and the (mean, rstd) statistics of x (N, C).
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, Stats)> {
        let (y, mean, rstd) = layer_norm::forward(x, &self.w.get()?, &self.b.get()?, self.eps)?;
        Ok((y, Stats { mean, rstd }))
    }

    fn names(&self) -> (String, String) {
        (self.w.name().to_string(), self.b.name().to_string())
    }

    /// dx (N, C) from x, its statistics and dy; dw and db pushed to `grads`.
    pub fn backward(
        &self,
        x: &Tensor,
        s: &Stats,
        dy: &Tensor,
        grads: &mut WeightGrads,
    ) -> Result<Tensor> {
        let (dx, dw, db) = layer_norm::backward(x, &self.w.get()?, dy, &s.mean, &s.rstd)?;
        let (w_name, b_name) = self.names();
        grads.push((w_name, dw));
        grads.push((b_name, db));
        Ok(dx)
    }

    /// `res + dx` (N, C): [`Norm::backward`] with the residual branch's gradient `res` added in
    /// the same pass ([`layer_norm::backward_residual`]), as each residual of a block needs.
    pub fn backward_residual(
        &self,
        x: &Tensor,
        s: &Stats,
        dy: &Tensor,
        res: &Tensor,
        grads: &mut WeightGrads,
    ) -> Result<Tensor> {
        let w = self.w.get()?;
        let (dx, dw, db) = layer_norm::backward_residual(x, &w, dy, &s.mean, &s.rstd, res)?;
        let (w_name, b_name) = self.names();
        grads.push((w_name, dw));
        grads.push((b_name, db));
        Ok(dx)
    }
}

/// LayerNorm statistics per row: mean and 1/√(var + eps), (N,) f32.
pub struct Stats {
    mean: Tensor,
    rstd: Tensor,
}

/// An MLP's two linears, `c_proj(gelu(c_fc(x)))`: the feed-forward half of a dense block and
/// every expert of a mixture of experts.
struct MlpWeights {
    c_fc: Box<dyn TapedLinear>,
    c_proj: Box<dyn TapedLinear>,
}

/// What an MLP's forward keeps: c_fc's input after its collective, c_fc's output and its GELU.
struct MlpKept {
    h: Tensor,
    f: Tensor,
    g: Tensor,
}

impl MlpWeights {
    fn of(mlp: &Mlp, x: &Tensor) -> Option<MlpWeights> {
        Some(MlpWeights {
            c_fc: mlp.c_fc.taped(x)?,
            c_proj: mlp.c_proj.taped(x)?,
        })
    }

    /// `r + MLP(x)` for x (N, C) of a batch of `b` sequences (the residual added with c_proj's
    /// bias), or `MLP(x)` without `r`; and what the backward needs.
    /// c_fc runs on the chunks of sequences c_proj asks for ([`TapedLinear::forward_from`]).
    fn forward(&self, x: &Tensor, r: Option<&Tensor>, b: usize) -> Result<(Tensor, MlpKept)> {
        let mut kept = Vec::new();
        let mut fc = |seqs: Range<usize>| -> Result<Tensor> {
            let (h, f, g) = self.c_fc.forward_gelu(&rows_of(x, b, &seqs)?, seqs.len())?;
            kept.push((h, f)); // f, g (N_s, 4C/tp)
            Ok(g)
        };
        let (g, y) = self.c_proj.forward_from(r, b, &mut fc)?; // (N_r, C), + r when given
        let (h, f): (Vec<_>, Vec<_>) = kept.into_iter().unzip();
        let (h, f) = (cat_rows(h)?, cat_rows(f)?); // (N, C), (N, 4C/tp)
        Ok((y, MlpKept { h, f, g }))
    }

    /// dx (rows of x) from dy (N_r, C); the four gradients pushed to `grads`.
    fn backward(
        &self,
        kept: MlpKept,
        dy: &Tensor,
        b: usize,
        grads: &mut WeightGrads,
    ) -> Result<Tensor> {
        let MlpKept { h, f, g } = kept;
        let df = self.c_proj.backward(&g, dy, b, grads, Some(&f))?; // (N, 4C/tp)
        drop((f, g));
        self.c_fc.backward(&h, &df, b, grads, None) // (N, C)
    }

    /// Zero gradients for the four parameters of an MLP that saw no rows (an expert no token
    /// reached), as autograd's engine gives a parameter its backward did not reach.
    fn zero_grads(&self, grads: &mut WeightGrads) -> Result<()> {
        self.c_fc.zero_grads(grads)?;
        self.c_proj.zero_grads(grads)
    }
}
