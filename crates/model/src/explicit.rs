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
//! loops on CPU (`mtrain_kernels::cpu`), so one tape serves both devices. A segment has a tape for layers in f32 or bf16 that
//! say what they are ([`Linear::parts`], [`FeedForward::moe_parts`](crate::layers::FeedForward::moe_parts)):
//! a dense layer, or a tensor-parallel column or row layer whose collectives ([`Collective`])
//! the same block tape runs where Megatron puts them ([`sharded_block_tape`]; the embedding and
//! head tapes run the vocabulary's split, [`crate::vocab`]); a block's feed-forward half is the
//! MLP or a mixture of experts, on one device or with its experts across an expert-parallel group
//! (the dispatch and combine all-to-alls, [`Exchange`](crate::tape::Exchange), inside the tape).
//! Whether the engine runs the tapes is its [`Backward`](crate::engine::Backward) value (by
//! default it does, on every device).
//!
//! Where each thing lives:
//! - here: what every tape is built from: `Dense` (a linear and its collectives), [`Norm`]
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

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};
use mtrain_kernels::{bias, gelu, layer_norm, linear};

use crate::layers::{LayerNorm, Linear, Mlp};
use crate::tape::{Collective, WeightGrads};

pub use block::{block_tape, sharded_block_tape, BlockDropout};
pub use head::{embedding_tape, head_tape};

/// Whether the tapes take tensors of this dtype (the fused kernels' f32 and bf16).
pub fn taped_dtype(x: &Tensor) -> bool {
    matches!(x.dtype(), DType::F32 | DType::BF16)
}

fn err(s: String) -> candle_core::Error {
    candle_core::Error::Msg(s)
}

/// A linear layer's weight (out, in) and bias (out,), detached (the tape differentiates by
/// hand), and the collectives around its matmul ([`crate::layers::LinearParts`]): none for a
/// dense layer, f on the input of a column-parallel one, g or the sequence reduce-scatter on
/// the product of a row-parallel one. So one forward and one backward serve the dense and the
/// sharded block.
struct Dense {
    w_name: String,
    b_name: String,
    w: Tensor,
    b: Tensor,
    input: Option<Arc<dyn Collective>>,
    output: Option<Arc<dyn Collective>>,
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

impl Dense {
    fn of(l: &dyn Linear, x: &Tensor) -> Option<Dense> {
        let parts = l.parts()?;
        let b = parts.bias?;
        let (w, bt) = (parts.weight.tensor().detach(), b.tensor().detach());
        if w.dtype() != x.dtype() || bt.dtype() != x.dtype() || !taped_dtype(&w) {
            return None;
        }
        Some(Dense {
            w_name: parts.weight.name().to_string(),
            b_name: b.name().to_string(),
            w,
            b: bt,
            input: parts.input,
            output: parts.output,
        })
    }

    /// x (N, in) of a batch of `b` sequences -> (the matmul's input after the input
    /// collective, out(x Wᵀ) + b (N', out)).
    fn forward(&self, x: &Tensor, b: usize) -> Result<(Tensor, Tensor)> {
        let x = across(&self.input, x, b, fwd)?;
        let y = match &self.output {
            None => linear::forward(&x, &self.w, &self.b)?,
            Some(_) => mtrain_kernels::bias_add(&self.product(&x, b)?, &self.b)?,
        };
        Ok((x, y))
    }

    /// r + out(x Wᵀ) + b for x (N, in), r (N', out): the layer and the residual add after it,
    /// the bias added in the same pass as the residual; also the matmul's input, as `forward`.
    fn forward_residual(&self, r: &Tensor, x: &Tensor, b: usize) -> Result<(Tensor, Tensor)> {
        let x = across(&self.input, x, b, fwd)?;
        let y = match &self.output {
            None => linear::forward_residual(r, &x, &self.w, &self.b)?,
            Some(_) => bias::residual_add(r, &self.product(&x, b)?, &self.b)?,
        };
        Ok((x, y))
    }

    /// [`Dense::forward`] followed by GELU: (the matmul's input, f = out(x Wᵀ) + b, gelu(f)).
    fn forward_gelu(&self, x: &Tensor, b: usize) -> Result<(Tensor, Tensor, Tensor)> {
        if self.output.is_none() {
            let x = across(&self.input, x, b, fwd)?;
            let (f, g) = linear::forward_gelu(&x, &self.w, &self.b)?;
            return Ok((x, f, g));
        }
        let (x, f) = self.forward(x, b)?;
        let g = mtrain_kernels::gelu(&f)?;
        Ok((x, f, g))
    }

    /// out(x Wᵀ) (N', out), the output collective applied: where it sits between the product
    /// and the bias, the bias cannot be the GEMM's epilogue.
    fn product(&self, x: &Tensor, b: usize) -> Result<Tensor> {
        across(&self.output, &mtrain_kernels::matmul(x, &self.w.t()?)?, b, fwd)
    }

    /// From the matmul's input x (N, in) and dy (N', out): dx (rows of the layer's input), the
    /// conjugates of the collectives applied; db pushed to `grads`, and dW, or its factors
    /// when `grads` defers it to W. With `gelu_of` = f, where the layer's input x was gelu(f):
    /// the gradient carried through that GELU, df (in the GEMM's epilogue where no collective
    /// sits between them).
    fn backward(
        &self,
        x: &Tensor,
        dy: &Tensor,
        b: usize,
        grads: &mut WeightGrads,
        gelu_of: Option<&Tensor>,
    ) -> Result<Tensor> {
        let dy_b = dy; // (N', out), the rows the bias was added to
        let dy = across(&self.output, dy, b, bwd)?; // (N, out)
        let dx = match (gelu_of, &self.input) {
            (Some(f), None) => linear::input_grad_gelu(&dy, &self.w, f)?, // df (N, in)
            _ => mtrain_kernels::matmul(&dy, &self.w)?,                   // (N, in)
        };
        let names = (self.w_name.clone(), self.b_name.clone());
        match &self.output {
            // dW = dyᵀ·x (out, in) and db together, now or dW in W.
            None => grads.linear(names, &dy, x, &self.b)?,
            Some(_) => {
                let db = bias::grad(dy_b, &self.b)?; // (out,)
                grads.product(names.0, &dy, x)?; // dW, now or in W
                grads.push((names.1, db));
            }
        }
        let dx = across(&self.input, &dx, b, bwd)?;
        match (gelu_of, &self.input) {
            (Some(f), Some(_)) => gelu::backward(f, &dx),
            _ => Ok(dx),
        }
    }
}

/// A LayerNorm's parameters, detached: its forward keeps [`Stats`] and its backward pushes the
/// weight and bias gradients (every tape with a LayerNorm, here and in the sharded segments).
pub struct Norm {
    w_name: String,
    b_name: String,
    w: Tensor,
    b: Tensor,
    eps: f64,
}

impl Norm {
    /// The LayerNorm's tape parameters for an input like `x`, or None for another dtype.
    pub fn of(ln: &LayerNorm, x: &Tensor) -> Option<Norm> {
        let (w, b) = (ln.weight.tensor().detach(), ln.bias.tensor().detach());
        if !taped_dtype(x) || w.dtype() != x.dtype() || b.dtype() != x.dtype() {
            return None;
        }
        Some(Norm {
            w_name: ln.weight.name().to_string(),
            b_name: ln.bias.name().to_string(),
            w,
            b,
            eps: ln.eps,
        })
    }

    /// y and the (mean, rstd) statistics of x (N, C).
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, Stats)> {
        let (y, mean, rstd) = layer_norm::forward(x, &self.w, &self.b, self.eps)?;
        Ok((y, Stats { mean, rstd }))
    }

    /// dx (N, C) from x, its statistics and dy; dw and db pushed to `grads`.
    pub fn backward(
        &self,
        x: &Tensor,
        s: &Stats,
        dy: &Tensor,
        grads: &mut WeightGrads,
    ) -> Result<Tensor> {
        let (dx, dw, db) = layer_norm::backward(x, &self.w, dy, &s.mean, &s.rstd)?;
        grads.push((self.w_name.clone(), dw));
        grads.push((self.b_name.clone(), db));
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
        let (dx, dw, db) = layer_norm::backward_residual(x, &self.w, dy, &s.mean, &s.rstd, res)?;
        grads.push((self.w_name.clone(), dw));
        grads.push((self.b_name.clone(), db));
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
    c_fc: Dense,
    c_proj: Dense,
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
            c_fc: Dense::of(mlp.c_fc.as_ref(), x)?,
            c_proj: Dense::of(mlp.c_proj.as_ref(), x)?,
        })
    }

    /// `r + MLP(x)` for x (N, C) of a batch of `b` sequences (the residual added with c_proj's
    /// bias), or `MLP(x)` without `r`; and what the backward needs.
    fn forward(&self, x: &Tensor, r: Option<&Tensor>, b: usize) -> Result<(Tensor, MlpKept)> {
        let (h, f, g) = self.c_fc.forward_gelu(x, b)?; // f, g (N, 4C/tp)
        let (g, y) = match r {
            Some(r) => self.c_proj.forward_residual(r, &g, b)?, // (N_r, C) = r + MLP
            None => self.c_proj.forward(&g, b)?,                // (N_r, C)
        };
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
        for d in [&self.c_fc, &self.c_proj] {
            grads.push((d.w_name.clone(), d.w.zeros_like()?));
            grads.push((d.b_name.clone(), d.b.zeros_like()?));
        }
        Ok(())
    }
}
