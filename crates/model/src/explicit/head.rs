//! The tapes at the ends of the model: the token plus position embedding, and the head (final
//! LayerNorm, the LM head tied to `wte`, mean cross-entropy), each over the vocabulary's rows
//! it holds ([`crate::vocab`]): all of them, or a tp rank's, whose lookup, collectives and loss
//! the vocabulary split puts in their places.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};
use mtrain_kernels::{bias, embedding};

use super::{err, taped_dtype, Norm, Stats};
use crate::layers::LayerNorm;
use crate::param::Param;
use crate::tape::{Collective, SlotWeight, SplitGrads, Tape, TapeGrads, WeightGrads};
use crate::chunks::SequenceChunks;
use crate::vocab::{LogitsGrad, VocabLoss, VocabRows};

/// What the head tape keeps of the final LayerNorm and the LM head tied to `wte` (this rank's
/// rows of it under vocabulary parallelism), and its backward from the gradient of the logits.
///
/// ```text
///   forward:  x (N_r, C) ─ln_f─> enter ─> h (N, C) ─·wteᵀ─> z (N, V_r)
///   backward: dwte = dzᵀ·h    dx = ln_fᵀ(enterᵀ(dz·wte))
/// ```
struct TiedHead {
    pub ln_f: Norm,
    /// The slot of `wte` (V_r, C), read by the forward and again by the backward.
    pub wte: SlotWeight,
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
        let wte = SlotWeight::of(wte);
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
            wte,
            dims: (b, t, c),
            x,
            s,
            h,
        } = self;
        let dh = mtrain_kernels::matmul(&dz, &wte.get()?)?; // (N, C), this rank's part
        grads.product(wte.name().to_string(), &dz, &h)?; // (V_r, C)
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

/// The head's forward kept for its backward: the tied head, the collective entering it and
/// the loss.
///
/// ```text
///   forward:  h = enter(ln_f(x)) (N, C) ─► z = h·wteᵀ (N, V_r) ─► loss (the split's)
///   backward: dz = the loss's gradient (N, V_r)    dwte = dzᵀ·h    dx = ln_fᵀ(enterᵀ(dz·wte))
/// ```
struct HeadTape {
    head: TiedHead,
    enter: Option<Arc<dyn Collective>>,
    /// scalar f32
    loss: Tensor,
    grad: Box<dyn LogitsGrad>,
}

/// The graph-free forward of the head (`ln_f`, the LM head tied to the rows of `wte` that
/// `vocab` holds) to the mean loss, with its tape, or None where it has no hand-written
/// backward (no targets, a dtype other than f32 or bf16).
pub fn head_tape(
    ln_f: &LayerNorm,
    wte: &Param,
    vocab: &dyn VocabLoss,
    x: &Tensor,
    targets: Option<&Tensor>,
) -> Result<Option<Box<dyn Tape>>> {
    let Some(targets) = targets else {
        return Ok(None);
    };
    let enter = vocab.enter_taped();
    let Some(head) = TiedHead::forward(ln_f, wte, x, enter.as_deref())? else {
        return Ok(None);
    };
    let (b, _, c) = x.dims3()?;
    let n = head.h.dim(0)?;
    if targets.elem_count() != n {
        return Err(err(format!(
            "head: targets {:?} do not match the input {:?}",
            targets.dims(),
            (b, n / b, c)
        )));
    }
    let z = mtrain_kernels::matmul(&head.h, &head.wte.get()?.t()?)?; // (N, V_r)
    let (loss, grad) = vocab.loss_taped(z, &targets.flatten_all()?)?;
    Ok(Some(Box::new(HeadTape {
        head,
        enter,
        loss,
        grad,
    })))
}

impl Tape for HeadTape {
    fn output(&self) -> &Tensor {
        &self.loss
    }

    fn backward(self: Box<Self>, grad_out: Option<&Tensor>, loss_scale: f64) -> Result<TapeGrads> {
        let (head, dz, enter) = self.logits_grad(grad_out, loss_scale)?;
        head.backward(dz, enter.as_deref())
    }

    fn backward_input(
        self: Box<Self>,
        grad_out: Option<&Tensor>,
        loss_scale: f64,
    ) -> Result<SplitGrads> {
        let (head, dz, enter) = self.logits_grad(grad_out, loss_scale)?;
        head.backward_input(dz, enter.as_deref())
    }
}

impl HeadTape {
    /// The tied head, the logits' gradient dz (N, V_r) and the collective entering the head.
    fn logits_grad(
        self: Box<Self>,
        grad_out: Option<&Tensor>,
        loss_scale: f64,
    ) -> Result<(TiedHead, Tensor, Option<Arc<dyn Collective>>)> {
        let tape = *self;
        let head = tape.head;
        let g_row = row_loss_grad(grad_out, loss_scale, head.h.dim(0)?)?;
        let dz = tape.grad.grad(g_row)?.to_dtype(head.wte.dtype())?; // (N, V_r)
        Ok((head, dz, tape.enter))
    }
}

/// d(loss)/d(row loss) of a mean over `n` rows: s / N, where s is `loss_scale` when the loss is
/// the objective (`grad_out` None) or the given scalar gradient of the loss. The head tape's
/// backward starts from it.
fn row_loss_grad(grad_out: Option<&Tensor>, loss_scale: f64, n: usize) -> Result<f64> {
    let s = match grad_out {
        None => loss_scale,
        Some(g) => mtrain_kernels::reduce::sum_f64(g)?,
    };
    Ok(s / n as f64)
}

/// The embedding's forward kept for its backward: the rows looked up, the sizes, and where the
/// vocabulary is split, the mask of the ids held here and the sum over the holders.
///
/// ```text
///   forward:  tok = wte[rows]·mine ─ sum (none, g, or reduce-scatter T) ─ + wpe[offset..] ─► out
///   backward: dtok = sumᵀ(dout) (none, identity, or all-gather T)
///             dwte = scatter-add of dtok·mine by row     dwpe = Σ_batch dout at offset..
/// ```
struct EmbeddingTape {
    wte_name: String,
    wpe_name: String,
    /// Rows of `wte`: V, or this holder's V/tp.
    held: usize,
    block_size: usize,
    /// (N,) u32: each id's row in `wte`
    rows: Tensor,
    /// (N, 1): 1 for the ids held here (None: all are)
    mine: Option<Tensor>,
    sum: Option<Arc<dyn Collective>>,
    /// The runs of positions (first, length) the output's rows cover, in order.
    runs: Vec<(usize, usize)>,
    out: Tensor,
}

/// The graph-free forward of the token plus position embedding with its tape: `wte[idx] +
/// wpe[0..T]`, or with the vocabulary split ([`VocabRows`]) the holders' parts summed, then
/// `wpe` at the positions the output covers (context parallelism's two `chunks` where given).
/// None where it has no hand-written backward (ids not u32, a dtype other than f32 or bf16).
pub fn embedding_tape(
    wte: &Param,
    wpe: &Param,
    vocab: &dyn VocabRows,
    chunks: Option<SequenceChunks>,
    idx: &Tensor,
) -> Result<Option<Box<dyn Tape>>> {
    let (wte_name, wpe_name) = (wte.name().to_string(), wpe.name().to_string());
    let (wte, wpe) = (wte.tensor().detach(), wpe.tensor().detach());
    if !taped_dtype(&wte) || idx.dtype() != DType::U32 || wpe.dtype() != wte.dtype() {
        return Ok(None);
    }
    let (b, t) = idx.dims2()?;
    let (held, c) = wte.dims2()?;
    let block_size = wpe.dim(0)?;
    if t > block_size {
        return Err(err(format!(
            "embedding: sequence length {t} exceeds block_size {block_size}"
        )));
    }
    let (rows, mine) = vocab.rows(&idx.flatten_all()?, held, wte.dtype())?; // (N,)
    let mine = mine.map(|m| m.unsqueeze(1)).transpose()?; // (N, 1)
    let tok = held_here(embedding::forward(&wte, &rows)?, mine.as_ref())?; // (N, C), ids checked
    let sum = vocab.sum_taped();
    let tok = tok.reshape((b, t, c))?; // (B, T, C), this holder's part of the sum
    let tok = match &sum {
        Some(sum) => sum.forward(&tok)?,
        None => tok,
    }; // (B, T, C), or (B, T_r, C)
    // The positions' rows of wpe added to every sequence: a bias that repeats every T_r·C
    // elements (one pass of the bias kernel on CUDA, where candle's broadcast add indexes).
    let (bs, tr, _) = tok.dims3()?;
    let runs = match chunks {
        Some(ch) => ch.runs(tr).to_vec(),
        None => vec![(vocab.first_position(t), tr)],
    };
    let run_rows = |&(at, n): &(usize, usize)| wpe.narrow(0, at, n);
    let pos = Tensor::cat(&runs.iter().map(run_rows).collect::<Result<Vec<_>>>()?, 0)?; // (T_r, C)
    let pos = pos.flatten_all()?; // (T_r·C,)
    let out = bias::bias_add(&tok.reshape((bs, tr * c))?, &pos)?.reshape((bs, tr, c))?;
    Ok(Some(Box::new(EmbeddingTape {
        wte_name,
        wpe_name,
        held,
        block_size,
        rows,
        mine,
        sum,
        runs,
        out,
    })))
}

/// x (N, C) times the (N, 1) mask of the rows held here; x where all are.
fn held_here(x: Tensor, mine: Option<&Tensor>) -> Result<Tensor> {
    match mine {
        Some(mine) => x.broadcast_mul(mine),
        None => Ok(x),
    }
}

impl Tape for EmbeddingTape {
    fn output(&self) -> &Tensor {
        &self.out
    }

    fn backward(self: Box<Self>, grad_out: Option<&Tensor>, _loss_scale: f64) -> Result<TapeGrads> {
        let dout = grad_out
            .ok_or_else(|| err("embedding backward: the output is not a loss".into()))?
            .to_dtype(self.out.dtype())?
            .contiguous()?; // (B, T_r, C)
        let dtok = match &self.sum {
            Some(sum) => sum.backward(&dout)?,
            None => dout.clone(),
        }; // (B, T, C)
        let (b, t, c) = dtok.dims3()?;
        let dtok = held_here(dtok.reshape((b * t, c))?, self.mine.as_ref())?; // (N, C)
        let dwte = embedding::backward(&self.rows, &dtok, self.held)?; // (V or V/tp, C), rows checked
        let dwpe = position_grad(&dout, &self.runs, self.block_size)?; // (block_size, C)
        Ok(TapeGrads {
            params: vec![(self.wte_name, dwte), (self.wpe_name, dwpe)],
            input: None,
        })
    }
}

/// The gradient (block_size, C) of the position table `wpe` whose rows `runs` (first, length,
/// in order) were added to every sequence of dx (B, T, C): Σ over the batch there, zero
/// elsewhere.
fn position_grad(dx: &Tensor, runs: &[(usize, usize)], block_size: usize) -> Result<Tensor> {
    if let Some(&(at, n)) = runs.iter().find(|&&(at, n)| at + n > block_size) {
        return Err(err(format!(
            "position gradient: rows {at}..{} exceed block_size {block_size}",
            at + n
        )));
    }
    let dwpe = dx.sum(0)?; // (T, C)
    let c = dwpe.dim(1)?;
    match runs {
        [(_, t)] if *t == block_size => Ok(dwpe),
        [(at, t)] => dwpe.pad_with_zeros(0, *at, block_size - at - t), // (block_size, C)
        _ => {
            let mut out = Tensor::zeros((block_size, c), dwpe.dtype(), dwpe.device())?;
            let mut row = 0;
            for &(at, n) in runs {
                out = out.slice_assign(&[at..at + n, 0..c], &dwpe.narrow(0, row, n)?)?;
                row += n;
            }
            Ok(out) // (block_size, C)
        }
    }
}
