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
//! CPU, so one tape serves both devices. A segment has a tape for dense layers in f32 or bf16;
//! a sharded layer or a mixture of experts returns none and is differentiated by autograd.
//! Where the engine runs the tapes is its [`Backward`](crate::engine::Backward) value. The
//! tests (`explicit::tests`) compare them with autograd on a GPU and on CPU.
//!
//! Legend: `B` batch, `T` time, `C` width, `H` heads, `D` head size, `V` vocabulary, `N = B·T`.

use candle_core::{DType, Result, Tensor};
use mtrain_kernels::{attention, bias, cross_entropy, embedding, gelu, layer_norm};

use crate::layers::{CausalSelfAttention, DenseLinear, FeedForward, LayerNorm};
use crate::param::Param;
use crate::tape::{Tape, TapeGrads};

/// Whether the tapes take tensors of this dtype (the fused kernels' f32 and bf16).
fn taped_dtype(x: &Tensor) -> bool {
    matches!(x.dtype(), DType::F32 | DType::BF16)
}

fn err(s: String) -> candle_core::Error {
    candle_core::Error::Msg(s)
}

/// A dense layer's weight (out, in) and bias (out,), detached: the tape differentiates by hand.
struct Dense {
    w_name: String,
    b_name: String,
    w: Tensor,
    b: Tensor,
}

impl Dense {
    fn of(l: &DenseLinear, x: &Tensor) -> Option<Dense> {
        let b = l.bias.as_ref()?;
        let (w, bt) = (l.weight.tensor().detach(), b.tensor().detach());
        if w.dtype() != x.dtype() || bt.dtype() != x.dtype() || !taped_dtype(&w) {
            return None;
        }
        Some(Dense {
            w_name: l.weight.name().to_string(),
            b_name: b.name().to_string(),
            w,
            b: bt,
        })
    }

    /// x (N, in) -> x Wᵀ + b (N, out).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        mtrain_kernels::bias_add(&x.matmul(&self.w.t()?)?, &self.b)
    }

    /// r + x Wᵀ + b for x (N, in), r (N, out): the layer and the residual add after it, the bias
    /// added in the same pass as the residual.
    fn forward_residual(&self, r: &Tensor, x: &Tensor) -> Result<Tensor> {
        bias::residual_add(r, &x.matmul(&self.w.t()?)?, &self.b)
    }

    /// From the input x (N, in) and dy (N, out): dx (N, in); dW and db pushed to `grads`.
    fn backward(
        &self,
        x: &Tensor,
        dy: &Tensor,
        grads: &mut Vec<(String, Tensor)>,
    ) -> Result<Tensor> {
        let dx = dy.matmul(&self.w)?; // (N, in)
        let dw = dy.t()?.matmul(x)?; // (out, in)
        let db = bias::grad(dy, &self.b)?; // (out,)
        grads.push((self.w_name.clone(), dw));
        grads.push((self.b_name.clone(), db));
        Ok(dx)
    }
}

/// A LayerNorm's parameters, detached.
struct Norm {
    w_name: String,
    b_name: String,
    w: Tensor,
    b: Tensor,
    eps: f64,
}

impl Norm {
    fn of(ln: &LayerNorm, x: &Tensor) -> Option<Norm> {
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
    fn forward(&self, x: &Tensor) -> Result<(Tensor, Stats)> {
        let (y, mean, rstd) = layer_norm::forward(x, &self.w, &self.b, self.eps)?;
        Ok((y, Stats { mean, rstd }))
    }

    /// dx (N, C) from x, its statistics and dy; dw and db pushed to `grads`.
    fn backward(
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
struct Stats {
    mean: Tensor,
    rstd: Tensor,
}

/// The weights of a dense block, when every layer has a hand-written backward here.
struct BlockWeights {
    ln_1: Norm,
    c_attn: Dense,
    c_proj: Dense,
    ln_2: Norm,
    c_fc: Dense,
    mlp_proj: Dense,
    n_head: usize,
    head_dim: usize,
}

impl BlockWeights {
    fn of(
        ln_1: &LayerNorm,
        attn: &CausalSelfAttention,
        ln_2: &LayerNorm,
        ffn: &dyn FeedForward,
        x: &Tensor,
    ) -> Option<BlockWeights> {
        let mlp = ffn.as_mlp()?;
        Some(BlockWeights {
            ln_1: Norm::of(ln_1, x)?,
            c_attn: Dense::of(attn.c_attn.as_dense()?, x)?,
            c_proj: Dense::of(attn.c_proj.as_dense()?, x)?,
            ln_2: Norm::of(ln_2, x)?,
            c_fc: Dense::of(mlp.c_fc.as_dense()?, x)?,
            mlp_proj: Dense::of(mlp.c_proj.as_dense()?, x)?,
            n_head: attn.n_head,
            head_dim: attn.head_dim,
        })
    }
}

/// A block's forward kept for its backward (see the module picture).
struct BlockTape {
    wts: BlockWeights,
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
/// tape, or None where it has no hand-written backward (a sharded layer, a mixture of experts,
/// a dtype other than f32 or bf16).
pub fn block_tape(
    ln_1: &LayerNorm,
    attn: &CausalSelfAttention,
    ln_2: &LayerNorm,
    ffn: &dyn FeedForward,
    x: &Tensor,
) -> Result<Option<Box<dyn Tape>>> {
    let Some(wts) = BlockWeights::of(ln_1, attn, ln_2, ffn, x) else {
        return Ok(None);
    };
    let (b, t, c) = x.dims3()?;
    let (h, d) = (wts.n_head, wts.head_dim);
    if h * d != c {
        return Ok(None);
    }
    let n = b * t;
    let x = x.detach().reshape((n, c))?; // (N, C)
    let (h1, s1) = wts.ln_1.forward(&x)?; // (N, C)
    let qkv = wts.c_attn.forward(&h1)?.reshape((b, t, 3 * c))?; // (B, T, 3C)
    let qkv = mtrain_kernels::split_heads(&qkv, 3, h)?; // (3, B, H, T, D)
    let scale = 1.0 / (d as f64).sqrt();
    let (y, lse) = attention::forward(&qkv, scale)?; // (B, H, T, D)
    let ym = mtrain_kernels::merge_heads(&y.unsqueeze(0)?)?.reshape((n, c))?; // (N, C)
    let x1 = wts.c_proj.forward_residual(&x, &ym)?; // (N, C) = x + attention
    let (h2, s2) = wts.ln_2.forward(&x1)?;
    let f = wts.c_fc.forward(&h2)?; // (N, 4C)
    let g = mtrain_kernels::gelu(&f)?; // (N, 4C)
    let out = wts.mlp_proj.forward_residual(&x1, &g)?.reshape((b, t, c))?; // (B, T, C) = x1 + MLP
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
        let n = b * t;
        let mut grads = Vec::with_capacity(12);
        let dout = dout.to_dtype(x.dtype())?.reshape((n, c))?.contiguous()?; // (N, C)
                                                                             // MLP branch.
        let dg = wts.mlp_proj.backward(&g, &dout, &mut grads)?; // (N, 4C)
        drop(g);
        let df = gelu::backward(&f, &dg)?; // (N, 4C)
        drop((f, dg));
        let dh2 = wts.c_fc.backward(&h2, &df, &mut grads)?; // (N, C)
        drop((h2, df));
        let dx1 = (dout + wts.ln_2.backward(&x1, &s2, &dh2, &mut grads)?)?; // (N, C)
        drop((x1, dh2));
        // Attention branch.
        let dym = wts.c_proj.backward(&ym, &dx1, &mut grads)?; // (N, C)
        drop(ym);
        let dy =
            mtrain_kernels::split_heads(&dym.reshape((b, t, c))?, 1, wts.n_head)?.squeeze(0)?; // (B, H, T, D)
        let scale = 1.0 / (wts.head_dim as f64).sqrt();
        let dqkv = attention::backward(&qkv, &y, &dy, &lse, scale)?; // (3, B, H, T, D)
        drop((qkv, y, dy, lse));
        let dqkv = mtrain_kernels::merge_heads(&dqkv)?.reshape((n, 3 * c))?; // (N, 3C)
        let dh1 = wts.c_attn.backward(&h1, &dqkv, &mut grads)?; // (N, C)
        drop((h1, dqkv));
        let dx = (dx1 + wts.ln_1.backward(&x, &s1, &dh1, &mut grads)?)?; // (N, C)
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
        // d(loss)/d(row loss) = s / N for the mean; s is loss_scale, or the given scalar gradient.
        let s_out = match grad_out {
            None => loss_scale,
            Some(g) => mtrain_kernels::reduce::sum_f64(g)?,
        };
        let g = Tensor::full((s_out / n as f64) as f32, n, x.device())?; // (N,)
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
        let dwpe = dx.sum(0)?; // (T, C)
        let dwpe = if t < self.block_size {
            dwpe.pad_with_zeros(0, 0, self.block_size - t)? // (block_size, C)
        } else {
            dwpe
        };
        Ok(TapeGrads {
            params: vec![(self.wte_name, dwte), (self.wpe_name, dwpe)],
            input: None,
        })
    }
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

    /// On CPU the tapes' operations run as candle ops, so an engine that runs the tapes on
    /// every device ([`Backward::Tapes`]) checks their backward wiring without a GPU. The
    /// default engine keeps autograd on CPU.
    #[test]
    fn tapes_match_autograd_on_cpu() -> Result<()> {
        check(&Device::Cpu, DType::F32, 1e-5)?;
        let default = Engine::new(false).backward;
        assert!(
            !default.tapes_on(&Device::Cpu),
            "CPU tapes are off by default"
        );
        assert!(Backward::Tapes.tapes_on(&Device::Cpu));
        assert!(!Backward::Autograd.tapes_on(&Device::Cpu));
        Ok(())
    }
}
