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
//! The embedding is the dense [`Embedding`] over this rank's [`VocabShard`]: its forward, its
//! hand-written backward ([`mtrain_model::explicit::embedding_tape`]) and its dropout (the
//! output dropped at this rank's positions) are the dense embedding's, the shard's lookup and
//! sum in their places. The head also has a hand-written backward (a [`Tape`]): the same
//! collectives in the same order, the loss's gradient `(e^(z_r − m)/S − onehot_r)·s/N` written
//! out instead of recorded, and the tied head's backward of [`mtrain_model::explicit`].
//!
//! Legend: `B` batch, `T` sequence, `C` width, `V` vocabulary, `N = B·T`.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor, D};
use mtrain_comm::{chunk_range, Comm, ReduceOp};
use mtrain_model::explicit::TiedHead;
use mtrain_model::layers::{linear, VocabRows};
use mtrain_model::tape::{Collective, Tape, TapeGrads};
use mtrain_model::{Embedding, LayerNorm, Param, Segment, SegmentOut};

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
/// or (B, T/tp, C) with sequence parallelism. It is the dense [`Embedding`] over this rank's
/// [`VocabShard`]: one forward, tape and dropout, the shard's lookup and sum in their places.
pub type VocabParallelEmbedding = Embedding<VocabShard>;

/// This rank's rows of the vocabulary `[r·V/tp, (r+1)·V/tp)` and the tp group their lookups
/// are summed over (g, or with sequence parallelism a reduce-scatter along T).
///
/// ```text
///   forward:  tok_r = wte_r[rows]·mine  ─ g (or reduce-scatter T) ─ + wpe[range] ─► out
///   backward: dtok = gᵀ(dout) (identity, or all-gather T)
///             dwte_r = scatter-add of dtok·mine by row     dwpe = Σ_batch dout at range
/// ```
pub struct VocabShard {
    pub group: Comm,
    pub sequence_parallel: bool,
}

impl VocabShard {
    pub fn new(group: Comm, sequence_parallel: bool) -> Self {
        Self {
            group,
            sequence_parallel,
        }
    }

    /// Its mapping, from the embedding's table (what the cost model counts).
    pub fn mappings(&self) -> EmbeddingMappings {
        EmbeddingMappings::new(self.sequence_parallel)
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

impl VocabRows for VocabShard {
    fn rows(&self, ids: &Tensor, held: usize, dtype: DType) -> Result<(Tensor, Option<Tensor>)> {
        let (rows, mine) = local_rows(ids, self.group.rank() * held, held, dtype)?;
        Ok((rows, Some(mine)))
    }

    fn sum(&self, tok: &Tensor) -> Result<Tensor> {
        self.mappings().sum.mapping.apply(tok, &self.group)
    }

    fn sum_taped(&self) -> Option<Arc<dyn Collective>> {
        Some(self.mappings().sum.mapping.over(&self.group))
    }

    fn first_position(&self, t: usize) -> usize {
        match self.sequence_parallel {
            true => chunk_range(t, self.group.size(), self.group.rank()).start,
            false => 0,
        }
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
        drop(exp);
        head.backward(dz, Some(enter.as_ref()))
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
