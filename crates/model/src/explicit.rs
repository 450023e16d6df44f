//! Hand-written backward passes: a segment's forward that records no autograd graph, keeps what
//! its backward needs on a [`Tape`], and a backward written out layer by layer.
//!
//! candle's autograd gives every edge of the graph its own gradient buffer: it allocates zeros
//! for the first contribution and adds each contribution into it, so a block's ~50 edges cost
//! ~50 extra elementwise passes over (N, C)..(N, 4C) tensors. The tapes below compute the same
//! gradients with one buffer per quantity and one add per residual branch:
//!
//! ```text
//!   block forward (kept: x, h1, qkv, y, ym, x1, h2, f, g, LayerNorm stats, lse)
//!     x ─ln_1─> h1 ─c_attn─> qkv (N, 3C) ─split─> (3, B, H, T, D) ─flash─> y ─merge─> ym ─c_proj─> a
//!     x1 = x + a ─ln_2─> h2 ─c_fc─> f (N, 4C) ─gelu─> g ─c_proj─> m        out = x1 + m
//!
//!   block backward, given dout:
//!     dg  = dout·W_mp      dW_mp = doutᵀ·g     db_mp = Σ_rows dout
//!     df  = gelu'(f, dg)
//!     dh2 = df·W_fc        dW_fc = dfᵀ·h2      db_fc = Σ_rows df
//!     dx1 = dout + ln_2ᵀ(dh2)                               (one add: the residual)
//!     dym = dx1·W_p        dW_p  = dx1ᵀ·ym     db_p  = Σ_rows dx1
//!     dqkv = merge(flash'(split(dym)))                      (3, B, H, T, D) -> (N, 3C)
//!     dh1 = dqkv·W_a       dW_a  = dqkvᵀ·h1    db_a  = Σ_rows dqkv
//!     dx  = dx1 + ln_1ᵀ(dh1)                                (one add: the residual)
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
//! `attention::backward`, ...): the fused kernels on CUDA, the same algorithms in candle ops on
//! CPU, so one tape serves both devices. A segment has a tape for layers in f32 or bf16 that
//! say what they are ([`Linear::parts`]): a dense layer, or a tensor-parallel column or row
//! layer whose collectives ([`Collective`]) the same block tape runs where Megatron puts them
//! ([`sharded_block_tape`]; the parallel crate's segments build on it and on [`Norm`]). A
//! mixture of experts returns none and is differentiated by autograd.
//! Whether the engine runs the tapes is its [`Backward`](crate::engine::Backward) value (by
//! default it does, on every device). The tests (`explicit::tests`) compare them with autograd
//! on a GPU and on CPU.
//!
//! Legend: `B` batch, `T` time, `C` width, `H` heads, `D` head size, `V` vocabulary, `N = B·T`.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};
use mtrain_kernels::{attention, bias, cross_entropy, embedding, gelu, layer_norm};

use crate::layers::{CausalSelfAttention, FeedForward, LayerNorm, Linear};
use crate::param::Param;
use crate::tape::{Collective, Tape, TapeGrads};

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
        let y = across(&self.output, &x.matmul(&self.w.t()?)?, b, fwd)?;
        Ok((x, mtrain_kernels::bias_add(&y, &self.b)?))
    }

    /// r + out(x Wᵀ) + b for x (N, in), r (N', out): the layer and the residual add after it,
    /// the bias added in the same pass as the residual; also the matmul's input, as `forward`.
    fn forward_residual(&self, r: &Tensor, x: &Tensor, b: usize) -> Result<(Tensor, Tensor)> {
        let x = across(&self.input, x, b, fwd)?;
        let y = across(&self.output, &x.matmul(&self.w.t()?)?, b, fwd)?;
        Ok((x, bias::residual_add(r, &y, &self.b)?))
    }

    /// From the matmul's input x (N, in) and dy (N', out): dx (rows of the layer's input), the
    /// conjugates of the collectives applied; dW and db pushed to `grads`.
    fn backward(
        &self,
        x: &Tensor,
        dy: &Tensor,
        b: usize,
        grads: &mut Vec<(String, Tensor)>,
    ) -> Result<Tensor> {
        let db = bias::grad(dy, &self.b)?; // (out,), over the rows the bias was added to
        let dy = across(&self.output, dy, b, bwd)?; // (N, out)
        let dx = dy.matmul(&self.w)?; // (N, in)
        let dw = dy.t()?.matmul(x)?; // (out, in)
        grads.push((self.w_name.clone(), dw));
        grads.push((self.b_name.clone(), db));
        across(&self.input, &dx, b, bwd)
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
        grads: &mut Vec<(String, Tensor)>,
    ) -> Result<Tensor> {
        let (dx, dw, db) = layer_norm::backward(x, &self.w, dy, &s.mean, &s.rstd)?;
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

/// The weights of a block, when every layer has a hand-written backward here, and the
/// collective that enters both sub-layers' column layers from their LayerNorm.
struct BlockWeights {
    ln_1: Norm,
    c_attn: Dense,
    c_proj: Dense,
    ln_2: Norm,
    c_fc: Dense,
    mlp_proj: Dense,
    /// Heads this block computes (all of them, or this rank's under tensor parallelism).
    n_head: usize,
    head_dim: usize,
    enter: Option<Arc<dyn Collective>>,
}

impl BlockWeights {
    fn of(
        ln_1: &LayerNorm,
        attn: &CausalSelfAttention,
        ln_2: &LayerNorm,
        ffn: &dyn FeedForward,
        x: &Tensor,
        enter: Option<Arc<dyn Collective>>,
    ) -> Option<BlockWeights> {
        let mlp = ffn.as_mlp()?;
        Some(BlockWeights {
            ln_1: Norm::of(ln_1, x)?,
            c_attn: Dense::of(attn.c_attn.as_ref(), x)?,
            c_proj: Dense::of(attn.c_proj.as_ref(), x)?,
            ln_2: Norm::of(ln_2, x)?,
            c_fc: Dense::of(mlp.c_fc.as_ref(), x)?,
            mlp_proj: Dense::of(mlp.c_proj.as_ref(), x)?,
            n_head: attn.n_head,
            head_dim: attn.head_dim,
            enter,
        })
    }
}

/// A block's forward kept for its backward (see the module picture). `h1` and `h2` are the
/// column layers' inputs after their collectives (the whole sequence under sequence
/// parallelism), `x`, `x1` and the output this rank's rows.
struct BlockTape {
    wts: BlockWeights,
    /// (B, T of the input and output, C)
    dims: (usize, usize, usize),
    x: Tensor,
    s1: Stats,
    h1: Tensor,
    qkv: Tensor,
    y: Tensor,
    lse: Tensor,
    ym: Tensor,
    x1: Tensor,
    s2: Stats,
    h2: Tensor,
    f: Tensor,
    g: Tensor,
    out: Tensor,
}

/// The graph-free forward of the block `x + attn(ln_1(x))`, then `+ ffn(ln_2(·))`, with its
/// tape, or None where it has no hand-written backward (a mixture of experts, a layer without
/// [`Linear::parts`], a dtype other than f32 or bf16).
pub fn block_tape(
    ln_1: &LayerNorm,
    attn: &CausalSelfAttention,
    ln_2: &LayerNorm,
    ffn: &dyn FeedForward,
    x: &Tensor,
) -> Result<Option<Box<dyn Tape>>> {
    sharded_block_tape(ln_1, attn, ln_2, ffn, x, None)
}

/// [`block_tape`] for a block whose layers may be sharded: the collectives of its linears
/// ([`Linear::parts`]) run where the layers put them, and `enter` (sequence parallelism's
/// all-gather along T, whose conjugate reduce-scatters) between each LayerNorm and its column
/// layer. With no collectives anywhere this is the dense block.
///
/// ```text
///   x ─ln_1─> enter ─ in(c_attn) ─ attention ─ out(c_proj) + b ─(+x)─> x1     (the same for
///   backward: dx = dx1 + ln_1ᵀ(enterᵀ(inᵀ(dqkv·W_a)))                       the MLP half)
/// ```
pub fn sharded_block_tape(
    ln_1: &LayerNorm,
    attn: &CausalSelfAttention,
    ln_2: &LayerNorm,
    ffn: &dyn FeedForward,
    x: &Tensor,
    enter: Option<Arc<dyn Collective>>,
) -> Result<Option<Box<dyn Tape>>> {
    let Some(wts) = BlockWeights::of(ln_1, attn, ln_2, ffn, x, enter) else {
        return Ok(None);
    };
    let (b, t, c) = x.dims3()?;
    let (h, d) = (wts.n_head, wts.head_dim);
    if wts.c_attn.w.dim(0)? != 3 * h * d || wts.c_proj.w.dim(1)? != h * d {
        return Ok(None);
    }
    let x = x.detach().reshape((b * t, c))?; // (N_r, C), this rank's rows
    let (h1, s1) = wts.ln_1.forward(&x)?; // (N_r, C)
    let h1 = across(&wts.enter, &h1, b, fwd)?; // (N, C)
    let (h1, qkv) = wts.c_attn.forward(&h1, b)?; // (N, 3HD)
    let (n, _) = qkv.dims2()?;
    let qkv = qkv.reshape((b, n / b, 3 * h * d))?; // (B, T, 3HD)
    let qkv = mtrain_kernels::split_heads(&qkv, 3, h)?; // (3, B, H, T, D)
    let scale = 1.0 / (d as f64).sqrt();
    let (y, lse) = attention::forward(&qkv, scale)?; // (B, H, T, D)
    let ym = mtrain_kernels::merge_heads(&y.unsqueeze(0)?)?.reshape((n, h * d))?; // (N, HD)
    let (ym, x1) = wts.c_proj.forward_residual(&x, &ym, b)?; // (N_r, C) = x + attention
    let (h2, s2) = wts.ln_2.forward(&x1)?;
    let h2 = across(&wts.enter, &h2, b, fwd)?; // (N, C)
    let (h2, f) = wts.c_fc.forward(&h2, b)?; // (N, 4C/tp)
    let g = mtrain_kernels::gelu(&f)?; // (N, 4C/tp)
    let (g, out) = wts.mlp_proj.forward_residual(&x1, &g, b)?; // (N_r, C) = x1 + MLP
    let out = out.reshape((b, t, c))?;
    Ok(Some(Box::new(BlockTape {
        wts,
        dims: (b, t, c),
        x,
        s1,
        h1,
        qkv,
        y,
        lse,
        ym,
        x1,
        s2,
        h2,
        f,
        g,
        out,
    })))
}

impl Tape for BlockTape {
    fn output(&self) -> &Tensor {
        &self.out
    }

    fn backward(self: Box<Self>, grad_out: Option<&Tensor>, _loss_scale: f64) -> Result<TapeGrads> {
        let BlockTape {
            wts,
            dims: (b, t, c),
            x,
            s1,
            h1,
            qkv,
            y,
            lse,
            ym,
            x1,
            s2,
            h2,
            f,
            g,
            out,
        } = *self;
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
        let mut grads = Vec::with_capacity(12);
        let dout = dout
            .to_dtype(x.dtype())?
            .reshape((b * t, c))?
            .contiguous()?; // (N_r, C)
                            // MLP branch.
        let dg = wts.mlp_proj.backward(&g, &dout, b, &mut grads)?; // (N, 4C/tp)
        drop(g);
        let df = gelu::backward(&f, &dg)?; // (N, 4C/tp)
        drop((f, dg));
        let dh2 = wts.c_fc.backward(&h2, &df, b, &mut grads)?; // (N, C)
        drop((h2, df));
        let dh2 = across(&wts.enter, &dh2, b, bwd)?; // (N_r, C)
        let dx1 = (dout + wts.ln_2.backward(&x1, &s2, &dh2, &mut grads)?)?; // (N_r, C)
        drop((x1, dh2));
        // Attention branch.
        let dym = wts.c_proj.backward(&ym, &dx1, b, &mut grads)?; // (N, HD)
        drop(ym);
        let (n, hd) = dym.dims2()?;
        let dy = mtrain_kernels::split_heads(&dym.reshape((b, n / b, hd))?, 1, wts.n_head)?
            .squeeze(0)?; // (B, H, T, D)
        let scale = 1.0 / (wts.head_dim as f64).sqrt();
        let dqkv = attention::backward(&qkv, &y, &dy, &lse, scale)?; // (3, B, H, T, D)
        drop((qkv, y, dy, lse));
        let dqkv = mtrain_kernels::merge_heads(&dqkv)?.reshape((n, 3 * hd))?; // (N, 3HD)
        let dh1 = wts.c_attn.backward(&h1, &dqkv, b, &mut grads)?; // (N, C)
        drop((h1, dqkv));
        let dh1 = across(&wts.enter, &dh1, b, bwd)?; // (N_r, C)
        let dx = (dx1 + wts.ln_1.backward(&x, &s1, &dh1, &mut grads)?)?; // (N_r, C)
        Ok(TapeGrads {
            params: grads,
            input: Some(dx.reshape((b, t, c))?),
        })
    }
}

/// The head's forward kept for its backward.
struct HeadTape {
    ln_f: Norm,
    wte_name: String,
    wte: Tensor,
    x: Tensor,
    s: Stats,
    h: Tensor,
    logits: Tensor,
    targets: Tensor,
    lse: Tensor,
    dims: (usize, usize, usize),
    loss: Tensor,
}

/// The graph-free forward of the head (`ln_f`, the LM head tied to `wte`) to the mean loss,
/// with its tape, or None where it has no hand-written backward (no targets, a dtype other
/// than f32 or bf16).
pub fn head_tape(
    ln_f: &LayerNorm,
    wte: &Param,
    x: &Tensor,
    targets: Option<&Tensor>,
) -> Result<Option<Box<dyn Tape>>> {
    let Some(targets) = targets else {
        return Ok(None);
    };
    let Some(ln_f) = Norm::of(ln_f, x) else {
        return Ok(None);
    };
    let (wte_name, wte) = (wte.name().to_string(), wte.tensor().detach());
    if wte.dtype() != x.dtype() {
        return Ok(None);
    }
    let (b, t, c) = x.dims3()?;
    let n = b * t;
    if targets.elem_count() != n {
        return Err(err(format!(
            "head: targets {:?} do not match the input {:?}",
            targets.dims(),
            x.dims()
        )));
    }
    let x = x.detach().reshape((n, c))?; // (N, C)
    let (h, s) = ln_f.forward(&x)?; // (N, C)
    let logits = h.matmul(&wte.t()?)?; // (N, V)
    let targets = targets.flatten_all()?.to_dtype(DType::U32)?; // (N,)
    let (rows, lse) = cross_entropy::forward(&logits, &targets)?; // (N,)
    let loss = rows.mean_all()?; // scalar, f32
    Ok(Some(Box::new(HeadTape {
        ln_f,
        wte_name,
        wte,
        x,
        s,
        h,
        logits,
        targets,
        lse,
        dims: (b, t, c),
        loss,
    })))
}

impl Tape for HeadTape {
    fn output(&self) -> &Tensor {
        &self.loss
    }

    fn backward(self: Box<Self>, grad_out: Option<&Tensor>, loss_scale: f64) -> Result<TapeGrads> {
        let HeadTape {
            ln_f,
            wte_name,
            wte,
            x,
            s,
            h,
            logits,
            targets,
            lse,
            dims: (b, t, c),
            loss: _,
        } = *self;
        let n = b * t;
        let g = Tensor::full(row_loss_grad(grad_out, loss_scale, n)? as f32, n, x.device())?; // (N,)
        let dlogits = cross_entropy::backward(&logits, &targets, &lse, &g)?; // (N, V)
        drop(logits);
        let mut grads = Vec::with_capacity(3);
        let dh = dlogits.matmul(&wte)?; // (N, C)
        grads.push((wte_name, dlogits.t()?.matmul(&h)?)); // (V, C)
        drop((dlogits, h));
        let dx = ln_f.backward(&x, &s, &dh, &mut grads)?; // (N, C)
        Ok(TapeGrads {
            params: grads,
            input: Some(dx.reshape((b, t, c))?),
        })
    }
}

/// d(loss)/d(row loss) of a mean over `n` rows: s / N, where s is `loss_scale` when the loss is
/// the objective (`grad_out` None) or the given scalar gradient of the loss. Every head tape's
/// backward starts from it.
pub fn row_loss_grad(grad_out: Option<&Tensor>, loss_scale: f64, n: usize) -> Result<f64> {
    let s = match grad_out {
        None => loss_scale,
        Some(g) => mtrain_kernels::reduce::sum_f64(g)?,
    };
    Ok(s / n as f64)
}

/// The embedding's forward kept for its backward: the ids and the sizes.
struct EmbeddingTape {
    wte_name: String,
    wpe_name: String,
    vocab: usize,
    block_size: usize,
    ids: Tensor,
    out: Tensor,
}

/// The graph-free forward of the token plus position embedding `wte[idx] + wpe[0..T]` with its
/// tape, or None where it has no hand-written backward (ids not u32, a dtype other than f32 or
/// bf16).
pub fn embedding_tape(wte: &Param, wpe: &Param, idx: &Tensor) -> Result<Option<Box<dyn Tape>>> {
    let (wte_name, wpe_name) = (wte.name().to_string(), wpe.name().to_string());
    let (wte, wpe) = (wte.tensor().detach(), wpe.tensor().detach());
    let ids = idx.flatten_all()?; // (N,)
    if !taped_dtype(&wte) || ids.dtype() != DType::U32 || wpe.dtype() != wte.dtype() {
        return Ok(None);
    }
    let (b, t) = idx.dims2()?;
    let (vocab, c) = wte.dims2()?;
    let block_size = wpe.dim(0)?;
    if t > block_size {
        return Err(err(format!(
            "embedding: sequence length {t} exceeds block_size {block_size}"
        )));
    }
    let tok = embedding::forward(&wte, &ids)?.reshape((b, t, c))?; // (B, T, C), ids checked
    let out = tok.broadcast_add(&wpe.narrow(0, 0, t)?)?; // (B, T, C)
    Ok(Some(Box::new(EmbeddingTape {
        wte_name,
        wpe_name,
        vocab,
        block_size,
        ids,
        out,
    })))
}

impl Tape for EmbeddingTape {
    fn output(&self) -> &Tensor {
        &self.out
    }

    fn backward(self: Box<Self>, grad_out: Option<&Tensor>, _loss_scale: f64) -> Result<TapeGrads> {
        let dx = grad_out
            .ok_or_else(|| err("embedding backward: the output is not a loss".into()))?
            .to_dtype(self.out.dtype())?;
        let (b, t, c) = dx.dims3()?;
        let dx = dx.contiguous()?;
        // The forward checked the ids; no read-back here.
        let dwte = embedding::backward(&self.ids, &dx.reshape((b * t, c))?, self.vocab)?; // (V, C)
        let dwpe = position_grad(&dx, 0, self.block_size)?; // (block_size, C)
        Ok(TapeGrads {
            params: vec![(self.wte_name, dwte), (self.wpe_name, dwpe)],
            input: None,
        })
    }
}

/// The gradient (block_size, C) of the position table `wpe` whose rows `offset..offset + T`
/// were added to every sequence of dx (B, T, C): Σ over the batch there, zero elsewhere.
pub fn position_grad(dx: &Tensor, offset: usize, block_size: usize) -> Result<Tensor> {
    let t = dx.dim(1)?;
    if offset + t > block_size {
        return Err(err(format!(
            "position gradient: rows {offset}..{} exceed block_size {block_size}",
            offset + t
        )));
    }
    let dwpe = dx.sum(0)?; // (T, C)
    if t == block_size {
        return Ok(dwpe);
    }
    dwpe.pad_with_zeros(0, offset, block_size - offset - t) // (block_size, C)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use candle_core::{DType, Device, Result, Tensor};

    use mtrain_kernels::testing::{cuda, rel_err};

    use crate::config::GptConfig;
    use crate::engine::{Backward, Engine, NoHooks};
    use crate::gpt::Gpt;
    use crate::init::init_weights;
    use crate::param::Grads;

    /// The engine's step through the tapes, with and without checkpointing (which recomputes
    /// each tape), against candle's autograd over the whole graph (the same operations,
    /// recorded): loss and every parameter gradient, for 2 dense blocks with head size 64 (bf16
    /// runs the tensor-core attention), the head and the tied embedding.
    fn check(dev: &Device, dtype: DType, tol: f64) -> Result<()> {
        let cfg = GptConfig {
            vocab_size: 320,
            block_size: 128,
            n_layer: 2,
            n_head: 2,
            n_embd: 128,
            moe: None,
        };
        let w: BTreeMap<String, Tensor> = init_weights(&cfg, 7)?
            .into_iter()
            .map(|(k, t)| Ok((k, t.to_dtype(dtype)?)))
            .collect::<Result<_>>()?;
        let gpt = Gpt::new(cfg.clone(), &w, dev)?;
        let (b, t) = (3, 120); // T < block_size: the position gradient is zero-padded
        let ids = |seed: u32| -> Result<Tensor> {
            let v: Vec<u32> = (0..(b * t) as u32)
                .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 7) % 320)
                .collect();
            Tensor::from_vec(v, (b, t), dev)
        };
        let (idx, tgt) = (ids(1)?, ids(99)?);

        let x = Tensor::randn(0f32, 1f32, (b, t, cfg.n_embd), dev)?.to_dtype(dtype)?;
        let last = cfg.n_layer + 1;
        assert!(
            gpt.segments[0].forward_taped(&idx, None)?.is_some(),
            "embedding tape"
        );
        assert!(
            gpt.segments[1].forward_taped(&x, None)?.is_some(),
            "block tape"
        );
        assert!(
            gpt.segments[last].forward_taped(&x, Some(&tgt))?.is_some(),
            "head tape"
        );

        let whole = gpt.forward_loss(&idx, &tgt)?.loss;
        let want_loss = whole.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let store = whole.backward()?;
        for checkpointing in [false, true] {
            let mut grads = Grads::new();
            let engine = Engine::new(checkpointing).with_backward(Backward::Tapes);
            let (loss, _) = engine.forward_backward(
                &gpt.segments,
                &idx,
                &tgt,
                1.0,
                &mut grads,
                &mut NoHooks,
            )?;
            let what = format!(
                "{:?} {dtype:?} checkpointing {checkpointing}",
                dev.location()
            );
            assert!(
                (loss - want_loss).abs() <= tol * want_loss.abs(),
                "{what}: loss {loss} through the tapes vs {want_loss} by autograd"
            );
            for p in gpt.params() {
                let want = store
                    .get(&p.tensor())
                    .unwrap_or_else(|| panic!("autograd gave no gradient for {}", p.name()));
                let got = grads
                    .get(p.name())
                    .unwrap_or_else(|| panic!("the tapes gave no gradient for {}", p.name()));
                assert_eq!(got.dims(), want.dims(), "{}", p.name());
                let e = rel_err(got, want);
                assert!(
                    e < tol,
                    "{what} {}: relative error {e:.2e} >= {tol:.0e}",
                    p.name()
                );
            }
        }
        Ok(())
    }

    #[test]
    fn tapes_match_autograd_f32() -> Result<()> {
        let Some(dev) = cuda() else {
            return Ok(());
        };
        check(&dev, DType::F32, 1e-4)
    }

    #[test]
    fn tapes_match_autograd_bf16() -> Result<()> {
        let Some(dev) = cuda() else {
            return Ok(());
        };
        check(&dev, DType::BF16, 2e-2)
    }

    /// On CPU the tapes run on the kernels crate's CPU versions of their ops, so the tapes'
    /// backward wiring is checked without a GPU; the default engine runs the tapes everywhere.
    #[test]
    fn tapes_match_autograd_on_cpu() -> Result<()> {
        check(&Device::Cpu, DType::F32, 1e-5)?;
        assert_eq!(Engine::new(false).backward, Backward::Tapes, "the default");
        assert!(Backward::Tapes.uses_tapes());
        assert!(!Backward::Autograd.uses_tapes());
        Ok(())
    }
}
