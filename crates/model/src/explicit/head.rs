//! The tapes at the ends of the model: the token plus position embedding, and the head (final
//! LayerNorm, the LM head tied to `wte`, mean cross-entropy); what the vocab-parallel tapes
//! share with them: the tied head's kept forward and backward ([`TiedHead`]) and two rules
//! ([`row_loss_grad`], [`position_grad`]).

use candle_core::{DType, Result, Tensor};
use mtrain_kernels::{cross_entropy, embedding};

use super::{err, taped_dtype, Norm, Stats};
use crate::layers::LayerNorm;
use crate::param::Param;
use crate::tape::{Collective, SplitGrads, Tape, TapeGrads, WeightGrads};

/// What every head tape keeps of the final LayerNorm and the LM head tied to `wte` (this
/// rank's rows of it under vocabulary parallelism), and the backward they share from the
/// gradient of the logits.
///
/// ```text
///   forward:  x (N_r, C) ─ln_f─> enter ─> h (N, C) ─·wteᵀ─> z (N, V_r)
///   backward: dwte = dzᵀ·h    dx = ln_fᵀ(enterᵀ(dz·wte))
/// ```
pub struct TiedHead {
    pub ln_f: Norm,
    pub wte_name: String,
    pub wte: Tensor,
    /// (B, this rank's T, C)
    pub dims: (usize, usize, usize),
    /// (N_r, C): the head's input
    pub x: Tensor,
    pub s: Stats,
    /// (N, C): `ln_f(x)` after the entering collective
    pub h: Tensor,
}

impl TiedHead {
    /// `ln_f(x)` (N, C) after `enter` (None: no collective), kept; None where the head has no
    /// hand-written backward (a dtype other than f32 or bf16, `wte` in another than `x`'s).
    pub fn forward(
        ln_f: &LayerNorm,
        wte: &Param,
        x: &Tensor,
        enter: Option<&dyn Collective>,
    ) -> Result<Option<TiedHead>> {
        let Some(ln_f) = Norm::of(ln_f, x) else {
            return Ok(None);
        };
        let (wte_name, wte) = (wte.name().to_string(), wte.tensor().detach());
        if wte.dtype() != x.dtype() {
            return Ok(None);
        }
        let (b, t, c) = x.dims3()?;
        let x = x.detach().reshape((b * t, c))?; // (N_r, C)
        let (h, s) = ln_f.forward(&x)?; // (N_r, C)
        let h = match enter {
            Some(enter) => {
                let h = enter.forward(&h.reshape((b, t, c))?)?; // (B, T, C)
                let n = h.dim(0)? * h.dim(1)?;
                h.reshape((n, c))? // (N, C)
            }
            None => h,
        };
        Ok(Some(TiedHead {
            ln_f,
            wte_name,
            wte,
            dims: (b, t, c),
            x,
            s,
            h,
        }))
    }

    /// The tied weight's gradient `dzᵀ·h` and dx (B, T_r, C) from dz (N, V_r), `dz·wte` taken
    /// back through `enter` (None: no collective) and `ln_f`.
    pub fn backward(self, dz: Tensor, enter: Option<&dyn Collective>) -> Result<TapeGrads> {
        let mut grads = WeightGrads::now();
        let input = Some(self.backward_into(dz, enter, &mut grads)?);
        Ok(TapeGrads {
            params: grads.finish()?,
            input,
        })
    }

    /// B of [`TiedHead::backward`]: dx now, `dzᵀ·h` kept for W.
    pub fn backward_input(self, dz: Tensor, enter: Option<&dyn Collective>) -> Result<SplitGrads> {
        let mut weights = WeightGrads::deferred();
        let input = Some(self.backward_into(dz, enter, &mut weights)?);
        Ok(SplitGrads { input, weights })
    }

    /// dx (B, T_r, C); the tied weight's and ln_f's gradients into `grads`.
    fn backward_into(
        self,
        dz: Tensor,
        enter: Option<&dyn Collective>,
        grads: &mut WeightGrads,
    ) -> Result<Tensor> {
        let TiedHead {
            ln_f,
            wte_name,
            wte,
            dims: (b, t, c),
            x,
            s,
            h,
        } = self;
        let dh = dz.matmul(&wte)?; // (N, C), this rank's part
        grads.product(wte_name, &dz, &h)?; // (V_r, C)
        drop((dz, h));
        let dh = match enter {
            Some(enter) => {
                let n = dh.dim(0)?;
                let dh = enter.backward(&dh.reshape((b, n / b, c))?)?; // (B, T_r, C)
                dh.reshape((b * t, c))?
            }
            None => dh,
        }; // (N_r, C)
        let dx = ln_f.backward(&x, &s, &dh, grads)?; // (N_r, C)
        dx.reshape((b, t, c))
    }
}

/// The head's forward kept for its backward.
struct HeadTape {
    head: TiedHead,
    logits: Tensor,
    targets: Tensor,
    lse: Tensor,
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
    let Some(head) = TiedHead::forward(ln_f, wte, x, None)? else {
        return Ok(None);
    };
    let n = head.h.dim(0)?;
    if targets.elem_count() != n {
        return Err(err(format!(
            "head: targets {:?} do not match the input {:?}",
            targets.dims(),
            x.dims()
        )));
    }
    let logits = head.h.matmul(&head.wte.t()?)?; // (N, V)
    let targets = targets.flatten_all()?.to_dtype(DType::U32)?; // (N,)
    let (rows, lse) = cross_entropy::forward(&logits, &targets)?; // (N,)
    let loss = rows.mean_all()?; // scalar, f32
    Ok(Some(Box::new(HeadTape {
        head,
        logits,
        targets,
        lse,
        loss,
    })))
}

impl Tape for HeadTape {
    fn output(&self) -> &Tensor {
        &self.loss
    }

    fn backward(self: Box<Self>, grad_out: Option<&Tensor>, loss_scale: f64) -> Result<TapeGrads> {
        let (head, dlogits) = self.logits_grad(grad_out, loss_scale)?;
        head.backward(dlogits, None)
    }

    fn backward_input(
        self: Box<Self>,
        grad_out: Option<&Tensor>,
        loss_scale: f64,
    ) -> Result<SplitGrads> {
        let (head, dlogits) = self.logits_grad(grad_out, loss_scale)?;
        head.backward_input(dlogits, None)
    }
}

impl HeadTape {
    /// The tied head and the logits' gradient (N, V).
    fn logits_grad(
        self: Box<Self>,
        grad_out: Option<&Tensor>,
        loss_scale: f64,
    ) -> Result<(TiedHead, Tensor)> {
        let HeadTape {
            head,
            logits,
            targets,
            lse,
            loss: _,
        } = *self;
        let n = logits.dim(0)?;
        let g = Tensor::full(
            row_loss_grad(grad_out, loss_scale, n)? as f32,
            n,
            logits.device(),
        )?; // (N,)
        let dlogits = cross_entropy::backward(&logits, &targets, &lse, &g)?; // (N, V)
        Ok((head, dlogits))
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
