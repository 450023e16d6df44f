//! The block tape: attention, then the feed-forward half — the MLP (the module picture of
//! [`super`]), or a mixture of experts ([`super::moe`]) — each with its residual.
//!
//! Under a dropout draw ([`BlockDropout`]) the three sites of [`crate::dropout`] are in it, and
//! their rule is said here once for every block tape (dense, tensor-parallel, sequence-parallel):
//!
//! ```text
//!   forward:  y = attention(qkv; M_P)        x1 = x + M_a ∘ c_proj(ym)      out = x1 + M_m ∘ ffn(h2)
//!   backward: dffn = M_m ∘ dout              dc_proj = M_a ∘ dx1            attention'(·; M_P)
//!             (the residuals take dout and dx1 unmasked; every M drawn again, none kept)
//! ```

use std::ops::Range;
use std::sync::Arc;

use candle_core::{Result, Tensor};
use mtrain_kernels::attention;

use super::moe::{MoeTape, MoeWeights};
use super::{across, bwd, err, fwd, MlpKept, MlpWeights, Norm, Stats};
use crate::chunks::Positions;
use crate::dropout::{self, BlockMasks, Draw};
use crate::layers::{CausalSelfAttention, FeedForward, LayerNorm};
use crate::moe::MoeStats;
use crate::tape::{AttentionKept, Collective, SequenceAttention, SplitGrads, Tape, TapeGrads};
use crate::tape::{cat_rows, rows_of, TapedLinear, WeightGrads};
use mtrain_kernels::dropout::Mask;

/// The weights of a block's attention half and its second LayerNorm, when every layer has a
/// hand-written backward here, and the collective that enters both sub-layers' column layers
/// from their LayerNorm.
struct BlockWeights {
    ln_1: Norm,
    c_attn: Box<dyn TapedLinear>,
    c_proj: Box<dyn TapedLinear>,
    ln_2: Norm,
    /// Heads this block computes (all of them, or this rank's under tensor parallelism).
    n_head: usize,
    head_dim: usize,
    enter: Option<Arc<dyn Collective>>,
}

/// A block's feed-forward half as its tape sees it.
enum Ffn {
    Mlp(MlpWeights),
    Moe(MoeWeights),
}

impl BlockWeights {
    fn of(
        ln_1: &LayerNorm,
        attn: &CausalSelfAttention,
        ln_2: &LayerNorm,
        ffn: &dyn FeedForward,
        x: &Tensor,
        enter: Option<Arc<dyn Collective>>,
    ) -> Option<(BlockWeights, Ffn)> {
        let ffn = match (ffn.as_mlp(), ffn.moe_parts()) {
            (Some(mlp), _) => Ffn::Mlp(MlpWeights::of(mlp, x)?),
            // Experts are split by ep, never by a sequence-parallel group.
            (None, Some(parts)) if enter.is_none() => Ffn::Moe(MoeWeights::of(parts, x)?),
            _ => return None,
        };
        let wts = BlockWeights {
            ln_1: Norm::of(ln_1, x)?,
            c_attn: attn.c_attn.taped(x)?,
            c_proj: attn.c_proj.taped(x)?,
            ln_2: Norm::of(ln_2, x)?,
            n_head: attn.n_head,
            head_dim: attn.head_dim,
            enter,
        };
        Some((wts, ffn))
    }
}

/// A block's dropout under a training draw: the draw, the block's layer index, and under
/// sequence parallelism the first position of this rank's rows for a sequence of T (None: all
/// positions).
pub struct BlockDropout<'a> {
    pub draw: &'a Draw,
    pub layer: usize,
    pub positions: Option<&'a (dyn Fn(usize) -> usize + Sync)>,
}

/// What the feed-forward half kept: the MLP's tensors (`h` is `h2` after the entering
/// collective), or the mixture of experts' tape.
enum FfnKept {
    Mlp(MlpWeights, MlpKept),
    Moe(Box<MoeTape>),
}

/// A block's forward kept for its backward (see the module picture). `h1` is the column
/// layer's input after its collective (the whole sequence under sequence parallelism), `x`,
/// `x1` and the output this rank's rows.
struct BlockTape {
    wts: BlockWeights,
    /// (B, T of the input and output, C)
    dims: (usize, usize, usize),
    x: Tensor,
    s1: Stats,
    h1: Tensor,
    /// What attention kept for its backward (c_attn's output and lse2 on one device), for each
    /// chunk of sequences it ran on (one, or `--tp-overlap chunked`'s chunks).
    att: Vec<(Range<usize>, Box<dyn AttentionKept>)>,
    /// Attention's output (N, HD), c_proj's input.
    ym: Tensor,
    x1: Tensor,
    s2: Stats,
    ffn: FfnKept,
    out: Tensor,
    /// The masks of the two residual branches (keys, not values).
    masks: BlockMasks,
}

/// What c_attn and attention kept for one chunk of sequences (the forward's `attend`).
struct Kept {
    seqs: Range<usize>,
    /// c_attn's input rows of the chunk.
    h1: Tensor,
    att: Box<dyn AttentionKept>,
}

/// One device's attention over the whole sequence: the causal kernels
/// ([`attention::forward_tokens`]), the probabilities dropped where a mask is drawn.
pub struct LocalAttention;

/// What [`LocalAttention`] kept: the kernels' saved tensors and the sizes and mask to run their
/// backward with.
struct LocalKept {
    saved: attention::TokensSaved,
    h: usize,
    scale: f64,
    probs: Option<Mask>,
}

impl SequenceAttention for LocalAttention {
    fn positions(&self, t_r: usize) -> Positions {
        Positions::all(t_r)
    }

    fn forward(
        &self,
        qkv: &Tensor,
        h: usize,
        scale: f64,
        probs: Option<&Mask>,
    ) -> Result<(Tensor, Box<dyn AttentionKept>)> {
        let (y, saved) = attention::forward_tokens(qkv, h, scale, probs)?; // (B, T, HD)
        let probs = probs.cloned();
        Ok((y, Box::new(LocalKept { saved, h, scale, probs })))
    }
}

impl AttentionKept for LocalKept {
    fn backward(self: Box<Self>, y: &Tensor, dy: &Tensor) -> Result<Tensor> {
        let LocalKept { saved, h, scale, probs } = *self;
        attention::backward_tokens(saved, y, dy, h, scale, probs.as_ref()) // (B, T, 3HD)
    }
}

/// The graph-free forward of the block `x + attn(ln_1(x))`, then `+ ffn(ln_2(·))`, with its
/// tape, or None where it has no hand-written backward (a layer without [`Linear::taped`] or
/// [`FeedForward::moe_parts`], a dtype other than f32 or bf16).
///
/// [`Linear::taped`]: crate::layers::Linear::taped
pub fn block_tape(
    ln_1: &LayerNorm,
    attn: &CausalSelfAttention,
    ln_2: &LayerNorm,
    ffn: &dyn FeedForward,
    x: &Tensor,
) -> Result<Option<Box<dyn Tape>>> {
    sharded_block_tape(ln_1, attn, ln_2, ffn, x, None, None, None)
}

/// [`block_tape`] for a block whose layers may be sharded: the collectives of its linears
/// ([`Linear::taped`]) run where the layers put them, and `enter` (sequence parallelism's
/// all-gather along T, whose conjugate reduce-scatters) between each LayerNorm and its column
/// layer. With no collectives anywhere this is the dense block. A mixture of experts takes no
/// `enter` (its experts are split by ep; its all-to-alls are its own, [`super::moe`]).
/// `context` is the attention over the sequence where it is not this rank's alone (context
/// parallelism's ring); None: [`LocalAttention`].
///
/// ```text
///   x ─ln_1─> enter ─ in(c_attn) ─ attention ─ out(c_proj) + b ─(+x)─> x1     (the same for
///   backward: dx = dx1 + ln_1ᵀ(enterᵀ(inᵀ(dqkv·W_a)))                       the MLP half)
/// ```
///
/// [`Linear::taped`]: crate::layers::Linear::taped
#[allow(clippy::too_many_arguments)]
pub fn sharded_block_tape(
    ln_1: &LayerNorm,
    attn: &CausalSelfAttention,
    ln_2: &LayerNorm,
    ffn: &dyn FeedForward,
    x: &Tensor,
    enter: Option<Arc<dyn Collective>>,
    context: Option<Arc<dyn SequenceAttention>>,
    dropout_at: Option<&BlockDropout>,
) -> Result<Option<Box<dyn Tape>>> {
    let Some((wts, ffn)) = BlockWeights::of(ln_1, attn, ln_2, ffn, x, enter) else {
        return Ok(None);
    };
    let (b, t, c) = x.dims3()?;
    let (h, d) = (wts.n_head, wts.head_dim);
    if wts.c_attn.weight()?.dim(0)? != 3 * h * d || wts.c_proj.weight()?.dim(1)? != h * d {
        return Ok(None);
    }
    let x = x.detach().reshape((b * t, c))?; // (N_r, C), this rank's rows
    let (h1, s1) = wts.ln_1.forward(&x)?; // (N_r, C)
    let h1 = across(&wts.enter, &h1, b, fwd)?; // (N, C)
    let scale = 1.0 / (d as f64).sqrt();
    let draw = dropout_at.map(|o| o.draw);
    let layer = dropout_at.map_or(0, |o| o.layer);
    let context_ring = context.is_some();
    let context: Arc<dyn SequenceAttention> = context.unwrap_or_else(|| Arc::new(LocalAttention));
    // c_attn and attention for sequences `seqs`, made when c_proj asks for them: all at once,
    // or chunk by chunk where c_proj overlaps its collective with them.
    let mut kept = Vec::new();
    let mut t_att = 0; // the rows attention sees a sequence: T, or this rank's under cp
    let mut attend = |seqs: Range<usize>| -> Result<Tensor> {
        let bs = seqs.len();
        let (h1, qkv) = wts.c_attn.forward(&rows_of(&h1, b, &seqs)?, bs)?; // (N_s, 3HD)
        let n_s = qkv.dim(0)?;
        t_att = n_s / bs;
        let qkv = qkv.reshape((bs, t_att, 3 * h * d))?; // (B_s, T, 3HD)
        let probs = attn.probs_mask(draw, layer, context.positions(t_att).t)?;
        let probs = probs.map(|m| m.from_row(seqs.start)); // this chunk's sequences
        let (ym, att) = context.forward(&qkv, h, scale, probs.as_ref())?; // (B_s, T, HD)
        kept.push(Kept { seqs, h1, att });
        ym.reshape((n_s, h * d)) // (N_s, HD)
    };
    let dropped = Draw::active(draw).is_some();
    let (ym, a) = match dropped {
        false => wts.c_proj.forward_from(Some(&x), b, &mut attend)?, // (N_r, C) = x + attention
        true => wts.c_proj.forward_from(None, b, &mut attend)?,      // (N_r, C) = attention
    };
    // The masks' places in the whole sequence: context parallelism's chunks (the ring's
    // positions), else sequence parallelism's run of the rows attention sees, else all.
    let positions = match (&context_ring, dropout_at.and_then(|o| o.positions)) {
        (true, _) => context.positions(t),
        (false, Some(first)) => Positions::run(first(t_att), t, t_att),
        (false, None) => Positions::all(t),
    };
    let masks = BlockMasks::new(draw, layer, &positions, c)?;
    let x1 = match &masks.attn {
        Some(m) => (&x + dropout::rows(&a, b, m)?)?, // (N_r, C) = x + M_a ∘ attention
        None => a,
    };
    let h1 = cat_rows(kept.iter().map(|k| k.h1.clone()).collect())?; // (N, C)
    let att = kept.into_iter().map(|k| (k.seqs, k.att)).collect();
    let (h2, s2) = wts.ln_2.forward(&x1)?; // (N_r, C)
    let (out, ffn) = match ffn {
        Ffn::Mlp(mlp) => {
            let h2 = across(&wts.enter, &h2, b, fwd)?; // (N, C)
            let (out, kept) = match &masks.mlp {
                None => mlp.forward(&h2, Some(&x1), b)?, // (N_r, C) = x1 + MLP
                Some(mk) => {
                    let (m, kept) = mlp.forward(&h2, None, b)?; // (N_r, C)
                    ((&x1 + dropout::rows(&m, b, mk)?)?, kept) // (N_r, C) = x1 + M_m ∘ MLP
                }
            };
            (out, FfnKept::Mlp(mlp, kept))
        }
        Ffn::Moe(moe) => {
            let (m, tape) = moe.forward(&h2)?; // (N, C)
            let m = match &masks.mlp {
                Some(mk) => dropout::rows(&m, b, mk)?,
                None => m,
            };
            ((&x1 + m)?, FfnKept::Moe(Box::new(tape))) // (N, C) = x1 + experts
        }
    };
    let out = out.reshape((b, t, c))?;
    Ok(Some(Box::new(BlockTape {
        wts,
        dims: (b, t, c),
        x,
        s1,
        h1,
        att,
        ym,
        x1,
        s2,
        ffn,
        out,
        masks,
    })))
}

impl Tape for BlockTape {
    fn output(&self) -> &Tensor {
        &self.out
    }

    fn aux_loss(&self) -> Option<&Tensor> {
        match &self.ffn {
            FfnKept::Moe(m) => m.aux_loss(),
            FfnKept::Mlp(..) => None,
        }
    }

    fn stats(&self) -> Option<MoeStats> {
        match &self.ffn {
            FfnKept::Moe(m) => Some(m.stats()),
            FfnKept::Mlp(..) => None,
        }
    }

    fn backward(self: Box<Self>, grad_out: Option<&Tensor>, loss_scale: f64) -> Result<TapeGrads> {
        let mut grads = WeightGrads::now();
        let dx = self.run_backward(grad_out, loss_scale, &mut grads)?;
        Ok(TapeGrads {
            params: grads.finish()?,
            input: Some(dx),
        })
    }

    fn backward_input(
        self: Box<Self>,
        grad_out: Option<&Tensor>,
        loss_scale: f64,
    ) -> Result<SplitGrads> {
        let mut weights = WeightGrads::deferred();
        let dx = self.run_backward(grad_out, loss_scale, &mut weights)?;
        Ok(SplitGrads {
            input: Some(dx),
            weights,
        })
    }
}

impl BlockTape {
    /// dx (B, T, C) from dout; the weight gradients into `grads` (formed, or their products
    /// kept for W when `grads` defers them).
    fn run_backward(
        self,
        grad_out: Option<&Tensor>,
        loss_scale: f64,
        grads: &mut WeightGrads,
    ) -> Result<Tensor> {
        let BlockTape {
            wts,
            dims: (b, t, c),
            x,
            s1,
            h1,
            att,
            ym,
            x1,
            s2,
            ffn,
            out,
            masks,
        } = self;
        let dout = grad_out
            .ok_or_else(|| err("block backward: the block's output is not a loss".into()))?;
        if dout.dims() != out.dims() {
            return Err(err(format!(
                "block backward: output {:?} but gradient {:?}",
                out.dims(),
                dout.dims()
            )));
        }
        drop(out);
        let dout = dout
            .to_dtype(x.dtype())?
            .reshape((b * t, c))?
            .contiguous()?; // (N_r, C)
                            // Feed-forward branch: its output was M_m ∘ ffn, so its gradient is M_m ∘ dout.
        let dffn = match &masks.mlp {
            Some(m) => dropout::rows(&dout, b, m)?,
            None => dout.clone(),
        };
        let dh2 = match ffn {
            FfnKept::Mlp(mlp, kept) => {
                let dh2 = mlp.backward(kept, &dffn, b, grads)?; // (N, C)
                across(&wts.enter, &dh2, b, bwd)? // (N_r, C)
            }
            FfnKept::Moe(moe) => moe.backward(&dffn, loss_scale, grads)?, // (N, C)
        };
        drop(dffn);
        let dx1 = wts.ln_2.backward_residual(&x1, &s2, &dh2, &dout, grads)?; // (N_r, C)
        drop((x1, dh2, dout));
        // Attention branch: M_a ∘ dx1 into c_proj.
        let da = match &masks.attn {
            Some(m) => dropout::rows(&dx1, b, m)?,
            None => dx1.clone(),
        };
        let dym = wts.c_proj.backward(&ym, &da, b, grads, None)?; // (N, HD)
        drop(da);
        let hd = dym.dim(1)?;
        // Attention's backward for sequences `seqs`, made when c_attn asks for them: the chunks
        // the forward ran, taken in order; its inputs freed with the last.
        let mut att = att.into_iter().peekable();
        let mut inputs = Some((ym, dym));
        let mut attend_back = |seqs: Range<usize>| -> Result<Tensor> {
            let (ym, dym) = inputs.as_ref().ok_or_else(|| err("attention backward ran".into()))?;
            let mut parts = Vec::new();
            while let Some((s, kept)) = att.next_if(|(s, _)| s.start < seqs.end) {
                let tokens = |t: &Tensor| -> Result<Tensor> {
                    let rows = rows_of(t, b, &s)?; // (N_s, HD)
                    let n_s = rows.dim(0)?;
                    rows.reshape((s.len(), n_s / s.len(), hd)) // (B_s, T, HD)
                };
                let dqkv = kept.backward(&tokens(ym)?, &tokens(dym)?)?; // (B_s, T, 3HD)
                let n_s = dqkv.dim(0)? * dqkv.dim(1)?;
                parts.push(dqkv.reshape((n_s, 3 * hd))?); // (N_s, 3HD)
            }
            if att.peek().is_none() {
                inputs = None;
            }
            cat_rows(parts) // (N_seqs, 3HD)
        };
        let dh1 = wts.c_attn.backward_from(&h1, b, grads, &mut attend_back)?; // (N, C)
        drop(h1);
        let dh1 = across(&wts.enter, &dh1, b, bwd)?; // (N_r, C)
        let dx = wts.ln_1.backward_residual(&x, &s1, &dh1, &dx1, grads)?; // (N_r, C)
        dx.reshape((b, t, c))
    }
}
