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
//! The embedding and the head are the dense [`Embedding`] and [`Head`] over this rank's
//! [`VocabShard`]: their forwards, their hand-written backward
//! ([`mtrain_model::explicit::embedding_tape`], [`mtrain_model::explicit::head_tape`]) and the
//! embedding's dropout (the output dropped at this rank's positions) are the dense ones, the
//! shard's lookup, collectives and loss in their places. What is the shard's own: the rows of
//! its range, and the loss's tape, the same collectives as autograd's in the same order and
//! the logits' gradient `(e^(z_r − m)/S − onehot_r)·s/N` written out instead of recorded.
//!
//! Legend: `B` batch, `T` sequence, `C` width, `V` vocabulary, `N = B·T`.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor, D};
use mtrain_comm::{chunk_range, Comm, ReduceOp};
use mtrain_kernels::profile;
use mtrain_model::tape::Collective;
use mtrain_model::vocab::{LogitsGrad, VocabLoss, VocabRows};
use mtrain_model::{Embedding, Head};

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

/// This rank's rows of the vocabulary `[r·V/tp, (r+1)·V/tp)` and the tp group: the
/// embedding's lookups are summed over it (g, or with sequence parallelism a reduce-scatter
/// along T), the head's input enters through f (or the all-gather along T) and its loss takes
/// three all-reduces over it.
///
/// ```text
///   embedding forward:  tok_r = wte_r[rows]·mine  ─ g (or reduce-scatter T) ─ + wpe[range] ─► out
///             backward: dtok = gᵀ(dout) (identity, or all-gather T)
///                       dwte_r = scatter-add of dtok·mine by row   dwpe = Σ_batch dout at range
///   head      forward:  h = f(ln_f(x)) (or all-gather T) ─► z_r = h·wte_rᵀ (N, V/tp) ─► loss
///             backward: dz_r (below)   dh = fᵀ(dz_r·wte_r) (all-reduce, or reduce-scatter T)
///                       dwte_r = dz_rᵀ·h   dx = ln_fᵀ(dh)
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

    /// The embedding's mapping, from its table (what the cost model counts).
    pub fn embedding_mappings(&self) -> EmbeddingMappings {
        EmbeddingMappings::new(self.sequence_parallel)
    }

    /// The head's mapping, from its table (what the cost model counts).
    pub fn head_mappings(&self) -> HeadMappings {
        HeadMappings::new(self.sequence_parallel)
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
        self.embedding_mappings()
            .sum
            .mapping
            .apply(tok, &self.group)
    }

    fn sum_taped(&self) -> Option<Arc<dyn Collective>> {
        Some(self.embedding_mappings().sum.mapping.over(&self.group))
    }

    fn first_position(&self, t: usize) -> usize {
        match self.sequence_parallel {
            true => chunk_range(t, self.group.size(), self.group.rank()).start,
            false => 0,
        }
    }
}

/// Final LayerNorm, the LM head tied to the vocabulary-sharded `wte`, and the vocab-parallel
/// loss; without targets the full logits (B, T, V) (gathered, for sampling). It is the dense
/// [`Head`] over this rank's [`VocabShard`]: one forward and one tape, the shard's entering
/// collective and loss in their places.
pub type VocabParallelHead = Head<VocabShard>;

impl VocabLoss for VocabShard {
    /// f, or with sequence parallelism the all-gather along T.
    fn enter(&self, h: &Tensor) -> Result<Tensor> {
        self.head_mappings().input.mapping.apply(h, &self.group) // (B, T, C)
    }

    fn enter_taped(&self) -> Option<Arc<dyn Collective>> {
        Some(self.head_mappings().input.mapping.over(&self.group))
    }

    fn logits(&self, z: &Tensor) -> Result<Tensor> {
        gather_from_tp_region(z, &self.group) // (B, T, V)
    }

    fn loss(&self, z: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let start = self.group.rank() * z.dim(D::Minus1)?;
        vocab_parallel_cross_entropy(z, targets, start, &self.group)
    }

    /// The loss's three all-reduces ([`LOSS_ALL_REDUCES`]) on z_r (N, V/tp), in f32.
    fn loss_taped(&self, z: Tensor, targets: &Tensor) -> Result<(Tensor, Box<dyn LogitsGrad>)> {
        let v_local = z.dim(1)?;
        let z = z.to_dtype(DType::F32)?; // (N, V/tp)
        let all_reduce = |t: &Tensor, op: ReduceOp| -> Result<Tensor> {
            self.group
                .all_reduce(&t.contiguous()?, op)
                .map_err(comm_err)
        };
        // Each local part between the all-reduces is a call of the row `cross_entropy`: 1 FLOP
        // per logit for the max, 3 for z − m, e^· and Σ (the kernels' count, 4 per logit).
        let max = loss_part(1.0, &z, &[&z], || z.max_keepdim(1))?; // (N, 1)
        let max = all_reduce(&max, ReduceOp::Max)?; // (N, 1)
        let (z, exp, sum_exp) = loss_part(3.0, &z, &[&z, &max], || {
            let z = z.broadcast_sub(&max)?; // (N, V/tp)
            let exp = z.exp()?;
            let sum = exp.sum_keepdim(1)?; // (N, 1)
            Ok((z, exp, sum))
        })?;
        let sum_exp = all_reduce(&sum_exp, ReduceOp::Sum)?; // (N, 1)
        let start = self.group.rank() * v_local;
        let (rows, mine, z_target) = loss_part(0.0, &z, &[targets], || {
            let (rows, mine) = local_rows(targets, start, v_local, DType::F32)?;
            let (rows, mine) = (rows.unsqueeze(1)?, mine.unsqueeze(1)?); // (N, 1)
            let z_target = z.gather(&rows, 1)?.broadcast_mul(&mine)?; // (N, 1)
            Ok((rows, mine, z_target))
        })?;
        let z_target = all_reduce(&z_target, ReduceOp::Sum)?; // (N, 1)
        let loss = loss_part(0.0, &z, &[&sum_exp, &z_target], || {
            (sum_exp.log()? - &z_target)?.mean_all() // scalar f32
        })?;
        let kept = ShardLoss {
            exp,
            sum_exp,
            rows,
            mine,
        };
        Ok((loss, Box::new(kept)))
    }
}

/// The vocab-parallel loss's forward, kept for the gradient of this rank's logits.
///
/// ```text
///   forward:  m = max_tp (all-reduce max)   S = Σ_tp Σ_j e^(z_r − m)   z_t = Σ_tp z_r[target]
///             loss = mean(ln S − (z_t − m))                                 (three all-reduces)
///   backward: dz_r = (e^(z_r − m)/S − onehot_r)·s/N     (no communication: g's backward)
/// ```
struct ShardLoss {
    /// (N, V/tp) f32: e^(z_r − m)
    exp: Tensor,
    /// (N, 1) f32: S
    sum_exp: Tensor,
    /// (N, 1) u32 and f32: the target's row in this shard, 1 when it is in the shard
    rows: Tensor,
    mine: Tensor,
}

impl LogitsGrad for ShardLoss {
    /// The row `cross_entropy backward` of the kernels' profiler.
    fn grad(self: Box<Self>, g_row: f64) -> Result<Tensor> {
        let (exp, v_local) = (&self.exp, self.exp.dim(1)?);
        let read = [exp, &self.sum_exp, &self.rows, &self.mine];
        let name = "cross_entropy backward";
        profile::elementwise(name, &read, || {
            let cols = Tensor::arange(0u32, v_local as u32, exp.device())?.unsqueeze(0)?; // (1, V/tp)
            let onehot = cols
                .broadcast_eq(&self.rows)?
                .to_dtype(DType::F32)?
                .broadcast_mul(&self.mine)?; // (N, V/tp)
            (exp.broadcast_div(&self.sum_exp)? - onehot)? * g_row // (N, V/tp)
        })
    }
}

/// One local part of the vocab-parallel loss on the logits z (N, V/tp), a call of the
/// profiler's row `cross_entropy`: `per_logit` FLOPs on each logit, `inputs` read and what `f`
/// returns written.
fn loss_part<R: profile::Outputs>(
    per_logit: f64,
    z: &Tensor,
    inputs: &[&Tensor],
    f: impl FnOnce() -> Result<R>,
) -> Result<R> {
    profile::op(z.device(), f, |out| {
        let cost = profile::Cost::elementwise(per_logit, z, inputs, &out.tensors());
        ("cross_entropy".to_string(), cost)
    })
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
