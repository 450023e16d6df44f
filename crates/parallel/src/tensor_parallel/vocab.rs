//! Vocabulary parallelism: the tied token embedding `wte` (V, C) split by rows, rank r holding the
//! tokens `[r·V/tp, (r+1)·V/tp)`, used both by the embedding and by the LM head + loss.
//!
//! ```text
//!   embedding                                   head + loss (logits never gathered)
//!   ids ─► rows of my range, zero elsewhere     h ─f─► h · wte_rᵀ = z_r (N, V/tp)
//!        ─► Σ_tp (g) ─► + wpe ─► x (B,T,C)           m   = max over tp of max_j z_r      (no grad)
//!                                                    S   = Σ_tp Σ_j exp(z_r - m)          (g)
//!                                                    z_t = Σ_tp z_r[target] if mine else 0 (g)
//!                                                    loss = mean(ln S − (z_t − m))
//! ```
//!
//! The loss needs three all-reduces of N numbers ([`LOSS_ALL_REDUCES`]) instead of gathering
//! N·V logits. Each rank ends with the same loss; the gradient of its logits is
//! `softmax_r − onehot_r`, which autograd gets from the g's (identity backward: every rank's S
//! and z_t feed the same loss) and the f in front of the head (the ranks' partial gradients of h
//! are summed).
//!
//! With sequence parallelism the embedding's sum becomes a reduce-scatter along T (each rank
//! keeps its tokens) and the head first all-gathers the sequence. Both segments take their
//! mappings from the tables of [`super::mapping`].
//!
//! The embedding's dropout is the dense embedding's (its output dropped at this rank's
//! positions, [`mtrain_model::dropout::Dropped`]).
//!
//! Both segments also have a hand-written backward (a [`Tape`]): the same collectives in the
//! same order, the loss's gradient `(e^(z_r − m)/S − onehot_r)·s/N` written out instead of
//! recorded, and the LayerNorm and position-table rules of [`mtrain_model::explicit`].
//!
//! Legend: `B` batch, `T` sequence, `C` width, `V` vocabulary, `N = B·T`.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Result, Tensor, D};
use mtrain_comm::{chunk_range, Comm, ReduceOp};
use mtrain_kernels::embedding;
use mtrain_model::dropout::{self, embedding_mask, Dropped};
use mtrain_model::explicit::{position_grad, taped_dtype, TiedHead};

use mtrain_model::layers::linear;
use mtrain_model::tape::{Collective, SplitGrads, Tape, TapeGrads};
use mtrain_model::{Draw, LayerNorm, Param, Segment, SegmentOut};

use super::{EmbeddingMappings, HeadMappings};
use crate::ops::{comm_err, gather_from_tp_region, reduce_from_tp_region};

/// One of the vocab-parallel loss's all-reduces over tp: one f32 per token (N, 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LossAllReduce {
    pub of: &'static str,
    pub op: ReduceOp,
}

/// The vocab-parallel loss's collectives, in the order both of its implementations
/// ([`vocab_parallel_cross_entropy`] and the head's tape) issue them. The max carries no
/// gradient and the other two are g's (identity backward), so the loss's backward issues none.
pub const LOSS_ALL_REDUCES: [LossAllReduce; 3] = [
    LossAllReduce {
        of: "max logit",
        op: ReduceOp::Max,
    },
    LossAllReduce {
        of: "Σ exp",
        op: ReduceOp::Sum,
    },
    LossAllReduce {
        of: "target logit",
        op: ReduceOp::Sum,
    },
];

/// Token + position embedding with `wte` split by vocabulary rows: ids (B, T) u32 → (B, T, C),
/// or (B, T/tp, C) with sequence parallelism.
pub struct VocabParallelEmbedding {
    /// (V/tp, C): this rank's vocabulary rows, tied with the head
    pub wte: Param,
    /// (block_size, C), replicated
    pub wpe: Param,
    pub group: Comm,
    pub sequence_parallel: bool,
}

impl VocabParallelEmbedding {
    pub fn new(wte: Param, wpe: Param, group: Comm, sequence_parallel: bool) -> Self {
        Self {
            wte,
            wpe,
            group,
            sequence_parallel,
        }
    }

    /// Its mapping, from the embedding's table (what the cost model counts).
    pub fn mappings(&self) -> EmbeddingMappings {
        EmbeddingMappings::new(self.sequence_parallel)
    }

    /// The positions of a length-`t` sequence this rank's output covers.
    fn positions(&self, t: usize) -> Range<usize> {
        match self.sequence_parallel {
            true => chunk_range(t, self.group.size(), self.group.rank()),
            false => 0..t,
        }
    }
}

/// For each id: its row in this rank's shard `[start, start + len)` (0 when outside) and a 0/1 mask.
fn local_rows(ids: &Tensor, start: usize, len: usize, dtype: DType) -> Result<(Tensor, Tensor)> {
    let shifted = ids.to_dtype(DType::I64)?.affine(1.0, -(start as f64))?; // id − start
    let mine = shifted.ge(0i64)?.mul(&shifted.lt(len as i64)?)?; // u8, 1 inside the shard
    let rows = shifted
        .mul(&mine.to_dtype(DType::I64)?)?
        .to_dtype(DType::U32)?; // 0 outside
    Ok((rows, mine.to_dtype(dtype)?))
}

impl Segment for VocabParallelEmbedding {
    fn name(&self) -> String {
        "embedding".to_string()
    }

    fn forward(&self, idx: &Tensor, _targets: Option<&Tensor>) -> Result<SegmentOut> {
        self.embed(idx, None)
    }

    fn params(&self) -> Vec<Param> {
        vec![self.wte.clone(), self.wpe.clone()]
    }

    fn forward_taped(
        &self,
        idx: &Tensor,
        _targets: Option<&Tensor>,
    ) -> Result<Option<Box<dyn Tape>>> {
        embedding_tape(self, idx)
    }

    fn forward_drawn(&self, idx: &Tensor, _t: Option<&Tensor>, draw: &Draw) -> Result<SegmentOut> {
        self.embed(idx, Some(draw))
    }

    fn forward_taped_drawn(
        &self,
        idx: &Tensor,
        _targets: Option<&Tensor>,
        draw: &Draw,
    ) -> Result<Option<Box<dyn Tape>>> {
        let mask = self.mask(Some(draw), idx.dim(1)?)?;
        embedding_tape(self, idx)?
            .map(|tape| Dropped::wrap(tape, mask))
            .transpose()
    }
}

impl VocabParallelEmbedding {
    /// The embedding site's mask of this rank's output for a sequence of `t` under `draw`.
    fn mask(&self, draw: Option<&Draw>, t: usize) -> Result<Option<mtrain_kernels::dropout::Mask>> {
        let c = self.wte.tensor().dim(1)?;
        embedding_mask(draw, (self.positions(t).start, t), c)
    }

    /// The sum of the ranks' token rows plus wpe, dropped under `draw`.
    fn embed(&self, idx: &Tensor, draw: Option<&Draw>) -> Result<SegmentOut> {
        let (b, t) = idx.dims2()?;
        let (wte, wpe) = (self.wte.tensor(), self.wpe.tensor());
        if t > wpe.dim(0)? {
            return Err(candle_core::Error::Msg(format!(
                "embedding: sequence length {t} exceeds block_size {}",
                wpe.dim(0)?
            )));
        }
        let (v_local, c) = wte.dims2()?;
        let (rows, mine) = local_rows(
            &idx.flatten_all()?,
            self.group.rank() * v_local,
            v_local,
            wte.dtype(),
        )?;
        let tok = wte
            .index_select(&rows, 0)?
            .broadcast_mul(&mine.unsqueeze(1)?)?; // (N, C), 0 off-shard
        let tok = tok.reshape((b, t, c))?; // (B, T, C), this rank's part of the sum
        let tok = self.mappings().sum.mapping.apply(&tok, &self.group)?; // (B, T, C) or (B, T/tp, C)
        let r = self.positions(t);
        let pos = wpe.narrow(0, r.start, r.len())?; // (T, C) or (T/tp, C)
        let x = tok.broadcast_add(&pos)?;
        Ok(SegmentOut::plain(match self.mask(draw, t)? {
            Some(m) => dropout::recorded(&x, &m)?,
            None => x,
        }))
    }
}

/// The vocab-parallel embedding's forward kept for its backward.
///
/// ```text
///   forward:  tok_r = wte_r[rows]·mine  ─ g (or reduce-scatter T) ─ + wpe[range] ─► out
///   backward: dtok = gᵀ(dout) (identity, or all-gather T)
///             dwte_r = scatter-add of dtok·mine by row     dwpe = Σ_batch dout at range
/// ```
struct EmbeddingTape {
    wte_name: String,
    wpe_name: String,
    v_local: usize,
    block_size: usize,
    /// (N,) u32 rows of this rank's shard (0 off-shard), and (N, 1) 1 inside it
    rows: Tensor,
    mine: Tensor,
    /// The first position row this rank's output covers.
    offset: usize,
    reduce: Arc<dyn Collective>,
    out: Tensor,
}

fn embedding_tape(e: &VocabParallelEmbedding, idx: &Tensor) -> Result<Option<Box<dyn Tape>>> {
    let (wte, wpe) = (e.wte.tensor().detach(), e.wpe.tensor().detach());
    if !taped_dtype(&wte) || idx.dtype() != DType::U32 || wpe.dtype() != wte.dtype() {
        return Ok(None);
    }
    let (b, t) = idx.dims2()?;
    let block_size = wpe.dim(0)?;
    if t > block_size {
        return Err(candle_core::Error::Msg(format!(
            "embedding: sequence length {t} exceeds block_size {block_size}"
        )));
    }
    let (v_local, c) = wte.dims2()?;
    let (rows, mine) = local_rows(
        &idx.flatten_all()?,
        e.group.rank() * v_local,
        v_local,
        wte.dtype(),
    )?;
    let mine = mine.unsqueeze(1)?; // (N, 1)
    let tok = embedding::forward(&wte, &rows)?.broadcast_mul(&mine)?; // (N, C), 0 off-shard
    let tok = tok.reshape((b, t, c))?; // (B, T, C), this rank's part of the sum
    let range = e.positions(t);
    let reduce = e.mappings().sum.mapping.over(&e.group);
    let tok = reduce.forward(&tok)?; // (B, T, C), or (B, T/tp, C)
    let out = tok.broadcast_add(&wpe.narrow(0, range.start, range.len())?)?;
    Ok(Some(Box::new(EmbeddingTape {
        wte_name: e.wte.name().to_string(),
        wpe_name: e.wpe.name().to_string(),
        v_local,
        block_size,
        rows,
        mine,
        offset: range.start,
        reduce,
        out,
    })))
}

impl Tape for EmbeddingTape {
    fn output(&self) -> &Tensor {
        &self.out
    }

    fn backward(self: Box<Self>, grad_out: Option<&Tensor>, _loss_scale: f64) -> Result<TapeGrads> {
        let dout = grad_out
            .ok_or_else(|| {
                candle_core::Error::Msg("embedding backward: the output is not a loss".into())
            })?
            .to_dtype(self.out.dtype())?
            .contiguous()?; // (B, T_r, C)
        let dtok = self.reduce.backward(&dout)?; // (B, T, C)
        let (b, t, c) = dtok.dims3()?;
        let dtok = dtok.reshape((b * t, c))?.broadcast_mul(&self.mine)?; // (N, C), 0 off-shard
        let dwte = embedding::backward(&self.rows, &dtok, self.v_local)?; // (V/tp, C)
        let dwpe = position_grad(&dout, self.offset, self.block_size)?; // (block_size, C)
        Ok(TapeGrads {
            params: vec![(self.wte_name, dwte), (self.wpe_name, dwpe)],
            input: None,
        })
    }
}

/// Final LayerNorm, the LM head tied to the vocabulary-sharded `wte`, and the vocab-parallel loss.
/// Without targets it returns the full logits (B, T, V) (gathered, for sampling).
pub struct VocabParallelHead {
    pub ln_f: LayerNorm,
    /// (V/tp, C): the same Param as the embedding's
    pub wte: Param,
    pub group: Comm,
    pub sequence_parallel: bool,
}

impl VocabParallelHead {
    pub fn new(ln_f: LayerNorm, wte: Param, group: Comm, sequence_parallel: bool) -> Self {
        Self {
            ln_f,
            wte,
            group,
            sequence_parallel,
        }
    }

    /// Its mapping, from the head's table (what the cost model counts).
    pub fn mappings(&self) -> HeadMappings {
        HeadMappings::new(self.sequence_parallel)
    }
}

impl Segment for VocabParallelHead {
    fn name(&self) -> String {
        "head".to_string()
    }

    fn forward(&self, x: &Tensor, targets: Option<&Tensor>) -> Result<SegmentOut> {
        let h = self.ln_f.forward(x)?; // (B, T, C), or (B, T/tp, C) with SP
        let h = self.mappings().input.mapping.apply(&h, &self.group)?; // (B, T, C)
        let wte = self.wte.tensor();
        let logits = linear(&h, &wte, None)?; // (B, T, V/tp)
        match targets {
            None => Ok(SegmentOut::plain(gather_from_tp_region(
                &logits,
                &self.group,
            )?)), // (B, T, V)
            Some(t) => {
                let start = self.group.rank() * wte.dim(0)?;
                Ok(SegmentOut::plain(vocab_parallel_cross_entropy(
                    &logits,
                    t,
                    start,
                    &self.group,
                )?))
            }
        }
    }

    fn params(&self) -> Vec<Param> {
        let mut p = self.ln_f.params();
        p.push(self.wte.clone());
        p
    }

    fn forward_taped(&self, x: &Tensor, targets: Option<&Tensor>) -> Result<Option<Box<dyn Tape>>> {
        head_tape(self, x, targets)
    }
}

/// The vocab-parallel head's forward to the loss, kept for its backward.
///
/// ```text
///   forward:  h = f(ln_f(x)) (or all-gather T) ─► z_r = h·wte_rᵀ (N, V/tp)
///             m = max_tp (all-reduce max)   S = Σ_tp Σ_j e^(z_r − m)   z_t = Σ_tp z_r[target]
///             loss = mean(ln S − (z_t − m))                                 (three all-reduces)
///   backward: dz_r = (e^(z_r − m)/S − onehot_r)·s/N     (no communication: g's backward)
///             dh = fᵀ(dz_r·wte_r) (all-reduce, or reduce-scatter T)   dwte_r = dz_rᵀ·h
///             dx = ln_fᵀ(dh)
/// ```
struct HeadTape {
    head: TiedHead,
    enter: Arc<dyn Collective>,
    /// (N, V/tp) f32: e^(z_r − m)
    exp: Tensor,
    /// (N, 1) f32: S
    sum_exp: Tensor,
    /// (N, 1) u32 and f32: the target's row in this shard, 1 when it is in the shard
    rows: Tensor,
    mine: Tensor,
    loss: Tensor,
}

fn head_tape(
    hd: &VocabParallelHead,
    x: &Tensor,
    targets: Option<&Tensor>,
) -> Result<Option<Box<dyn Tape>>> {
    let Some(targets) = targets else {
        return Ok(None);
    };
    let enter = hd.mappings().input.mapping.over(&hd.group);
    let Some(head) = TiedHead::forward(&hd.ln_f, &hd.wte, x, Some(enter.as_ref()))? else {
        return Ok(None);
    };
    let (b, _, c) = x.dims3()?;
    let n = head.h.dim(0)?;
    if targets.elem_count() != n {
        return Err(candle_core::Error::Msg(format!(
            "vocab-parallel head: targets {:?} do not match the input {:?}",
            targets.dims(),
            (b, n / b, c)
        )));
    }
    let v_local = head.wte.dim(0)?;
    let z = head.h.matmul(&head.wte.t()?)?.to_dtype(DType::F32)?; // (N, V/tp)
    let all_reduce = |t: &Tensor, op: ReduceOp| -> Result<Tensor> {
        hd.group.all_reduce(&t.contiguous()?, op).map_err(comm_err)
    };
    let max = all_reduce(&z.max_keepdim(1)?, ReduceOp::Max)?; // (N, 1)
    let z = z.broadcast_sub(&max)?; // (N, V/tp)
    let exp = z.exp()?;
    let sum_exp = all_reduce(&exp.sum_keepdim(1)?, ReduceOp::Sum)?; // (N, 1)
    let (rows, mine) = local_rows(
        &targets.flatten_all()?,
        hd.group.rank() * v_local,
        v_local,
        DType::F32,
    )?;
    let (rows, mine) = (rows.unsqueeze(1)?, mine.unsqueeze(1)?); // (N, 1)
    let z_target = z.gather(&rows, 1)?.broadcast_mul(&mine)?; // (N, 1)
    let z_target = all_reduce(&z_target, ReduceOp::Sum)?; // (N, 1)
    let loss = (sum_exp.log()? - z_target)?.mean_all()?; // scalar f32
    Ok(Some(Box::new(HeadTape {
        head,
        enter,
        exp,
        sum_exp,
        rows,
        mine,
        loss,
    })))
}

impl Tape for HeadTape {
    fn output(&self) -> &Tensor {
        &self.loss
    }

    fn backward(self: Box<Self>, grad_out: Option<&Tensor>, loss_scale: f64) -> Result<TapeGrads> {
        let (head, dz, enter) = self.logits_grad(grad_out, loss_scale)?;
        head.backward(dz, Some(enter.as_ref()))
    }

    fn backward_input(
        self: Box<Self>,
        grad_out: Option<&Tensor>,
        loss_scale: f64,
    ) -> Result<SplitGrads> {
        let (head, dz, enter) = self.logits_grad(grad_out, loss_scale)?;
        head.backward_input(dz, Some(enter.as_ref()))
    }
}

impl HeadTape {
    /// The tied head, this rank's logits' gradient dz_r (N, V/tp) and the entering collective.
    fn logits_grad(
        self: Box<Self>,
        grad_out: Option<&Tensor>,
        loss_scale: f64,
    ) -> Result<(TiedHead, Tensor, Arc<dyn Collective>)> {
        let HeadTape {
            head,
            enter,
            exp,
            sum_exp,
            rows,
            mine,
            loss: _,
        } = *self;
        let (n, v_local) = exp.dims2()?;
        let g_row = mtrain_model::explicit::row_loss_grad(grad_out, loss_scale, n)?;
        let cols = Tensor::arange(0u32, v_local as u32, exp.device())?.unsqueeze(0)?; // (1, V/tp)
        let onehot = cols
            .broadcast_eq(&rows)?
            .to_dtype(DType::F32)?
            .broadcast_mul(&mine)?; // (N, V/tp)
        let dz = ((exp.broadcast_div(&sum_exp)? - onehot)? * g_row)?; // (N, V/tp)
        let dz = dz.to_dtype(head.wte.dtype())?;
        Ok((head, dz, enter))
    }
}

/// Mean cross-entropy from vocabulary-sharded logits (…, V/tp) whose first column is token
/// `vocab_start`, against u32 targets (…) over the full vocabulary; the same scalar on every rank.
pub fn vocab_parallel_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    vocab_start: usize,
    group: &Comm,
) -> Result<Tensor> {
    let v_local = logits.dim(D::Minus1)?;
    let n = targets.elem_count();
    if logits.elem_count() != n * v_local {
        return Err(candle_core::Error::Msg(format!(
            "vocab_parallel_cross_entropy: logits {:?} do not match targets {:?}",
            logits.dims(),
            targets.dims()
        )));
    }
    let z = logits.reshape((n, v_local))?; // (N, V/tp)
    let z = match z.dtype() {
        DType::BF16 | DType::F16 => z.to_dtype(DType::F32)?,
        _ => z,
    };
    // The max only keeps exp() in range; it cancels in the loss, so it carries no gradient.
    let local_max = z.max_keepdim(1)?.detach(); // (N, 1)
    let max = group
        .all_reduce(&local_max, ReduceOp::Max)
        .map_err(comm_err)?; // (N, 1)
    let z = z.broadcast_sub(&max)?; // (N, V/tp)
    let sum_exp = reduce_from_tp_region(&z.exp()?.sum_keepdim(1)?, group)?; // (N, 1)
    let (rows, mine) = local_rows(&targets.flatten_all()?, vocab_start, v_local, z.dtype())?;
    let z_target = z
        .gather(&rows.unsqueeze(1)?, 1)?
        .broadcast_mul(&mine.unsqueeze(1)?)?; // (N, 1)
    let z_target = reduce_from_tp_region(&z_target, group)?; // (N, 1)
    (sum_exp.log()? - z_target)?.mean_all()
}
