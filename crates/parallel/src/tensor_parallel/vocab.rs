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
//! The loss needs three all-reduces of N numbers instead of gathering N·V logits. Each rank ends
//! with the same loss; the gradient of its logits is `softmax_r − onehot_r`, which autograd gets
//! from the g's (identity backward: every rank's S and z_t feed the same loss) and the f in front
//! of the head (the ranks' partial gradients of h are summed).
//!
//! With sequence parallelism the embedding's sum becomes a reduce-scatter along T (each rank
//! keeps its tokens) and the head first all-gathers the sequence.
//!
//! Legend: `B` batch, `T` sequence, `C` width, `V` vocabulary, `N = B·T`.

use candle_core::{DType, Result, Tensor, D};
use mtrain_comm::{chunk_range, Comm, ReduceOp};
use mtrain_model::layers::linear;
use mtrain_model::{LayerNorm, Param, Segment, SegmentOut};

use super::SEQ_DIM;
use crate::ops::{
    comm_err, copy_to_tp_region, gather_from_sequence_parallel_region, gather_from_tp_region,
    reduce_from_tp_region, reduce_scatter_to_sequence_parallel_region,
};

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
        let pos = wpe.narrow(0, 0, t)?; // (T, C)
        let (tok, pos) = if self.sequence_parallel {
            let r = chunk_range(t, self.group.size(), self.group.rank());
            let tok = reduce_scatter_to_sequence_parallel_region(&tok, SEQ_DIM, &self.group)?; // (B, T/tp, C)
            (tok, pos.narrow(0, r.start, r.len())?) // (T/tp, C)
        } else {
            (reduce_from_tp_region(&tok, &self.group)?, pos) // (B, T, C)
        };
        Ok(SegmentOut::plain(tok.broadcast_add(&pos)?))
    }

    fn params(&self) -> Vec<Param> {
        vec![self.wte.clone(), self.wpe.clone()]
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
}

impl Segment for VocabParallelHead {
    fn name(&self) -> String {
        "head".to_string()
    }

    fn forward(&self, x: &Tensor, targets: Option<&Tensor>) -> Result<SegmentOut> {
        let h = self.ln_f.forward(x)?; // (B, T, C), or (B, T/tp, C) with SP
        let h = match self.sequence_parallel {
            true => gather_from_sequence_parallel_region(&h, SEQ_DIM, &self.group)?, // (B, T, C)
            false => copy_to_tp_region(&h, &self.group)?,
        };
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
