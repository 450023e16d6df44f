//! Sequence parallelism: the parts of a block that are not split by tensor parallelism
//! (LayerNorm, residual adds) work on 1/tp of the sequence instead of repeating the full work.
//!
//! ```text
//!   x_r (B, T/tp, C) ── ln_1 ── all-gather T ── attn (column … row) ── reduce-scatter T ──(+)── …
//!   │                           (B, T, C)       heads split over tp    (B, T/tp, C)       │
//!   └──────────────────────────────────────────────────────────────────────────────────┘
//!   backward: the all-gather becomes a reduce-scatter of the gradient and vice versa
//! ```
//!
//! g's all-reduce is split into its two halves (reduce-scatter + all-gather) and the LayerNorm
//! runs between them, so the communication volume is unchanged while activations outside the
//! linear layers shrink by tp. The LayerNorm and row-parallel bias gradients each cover 1/tp of
//! the tokens; [`super::ShardLayout::sync_partial_grads`] sums them over the group.
//!
//! The mappings are [`BlockMappings::new`]`(true)`'s: the block runs `enter` (the all-gather)
//! after each LayerNorm, so its column layers take [`super::ColumnInput::SequenceGathered`], and
//! the row layers `leave` ([`super::RowOutput::ReduceScatterSequence`]).
//!
//! Under `--tp-overlap ring` the column layers take this rank's part themselves
//! ([`super::ColumnInput::SequenceRing`]) and run the all-gather as a ring with their product,
//! so the block enters nothing of its own.
//!
//! It is the dense [`Block`] and the tp group; its [`Segment`](mtrain_model::Segment) methods
//! are the dense block's ([`BlockSegment`]). Its hand-written backward is the dense block's
//! ([`mtrain_model::explicit::sharded_block_tape`]) with the all-gather entering each sub-layer
//! and the row layers' reduce-scatter, each conjugate in its place; so is its dropout, the
//! dense block's sites with this rank's positions of the residual branches
//! ([`mtrain_model::explicit::BlockDropout::positions`]).

use candle_core::{Result, Tensor};
use mtrain_comm::{chunk_range, Comm};
use mtrain_model::chunks::Positions;
use mtrain_model::dropout::BlockMasks;
use mtrain_model::tape::Collective;
use mtrain_model::Draw;
use mtrain_model::{Block, BlockSegment, CausalSelfAttention, LayerNorm, Mlp, SegmentOut};
use std::sync::Arc;

use super::BlockMappings;

/// A pre-LayerNorm transformer block whose input and output are this rank's sequence shard:
/// the dense block's layers (their linears split by tp) and the tp group.
pub struct SequenceParallelBlock {
    pub block: Block,
    pub group: Comm,
    /// The column layers gather the sequence themselves, around the ring (`--tp-overlap ring`).
    pub ring: bool,
}

impl SequenceParallelBlock {
    pub fn new(
        name: impl Into<String>,
        ln_1: LayerNorm,
        attn: CausalSelfAttention,
        ln_2: LayerNorm,
        mlp: Mlp,
        group: Comm,
        ring: bool,
    ) -> Self {
        Self {
            block: Block::new(name, ln_1, attn, ln_2, Box::new(mlp)),
            group,
            ring,
        }
    }

    /// The all-gather entering a sub-layer after its LayerNorm, where the block runs it (x
    /// itself where the column layer gathers around the ring).
    fn enter_on(&self, x: &Tensor) -> Result<Tensor> {
        match self.ring {
            true => Ok(x.clone()), // (B, T/tp, C): the column layer gathers
            false => ENTER.apply(x, &self.group), // (B, T, C)
        }
    }
}

/// The all-gather entering each sub-layer.
const ENTER: super::Mapping = BlockMappings::new(true).enter.mapping;

impl BlockSegment for SequenceParallelBlock {
    fn block(&self) -> &Block {
        &self.block
    }

    /// The sequence all-gather (its conjugate, the reduce-scatter of the gradient, in the
    /// backward); none under the ring, whose column layers run it.
    fn enter(&self) -> Option<Arc<dyn Collective>> {
        (!self.ring).then(|| ENTER.over(&self.group))
    }

    fn first_position(&self, t: usize) -> usize {
        self.positions(t).start
    }

    fn run(&self, x: &Tensor, draw: Option<&Draw>) -> Result<SegmentOut> {
        let b = &self.block;
        // x: (B, T/tp, C)
        let h = self.enter_on(&b.ln_1.forward(x)?)?; // (B, T, C), or (B, T/tp, C) under the ring
        let t = match self.ring {
            true => x.dim(1)? * self.group.size(), // T: the ring's parts are equal
            false => h.dim(1)?,
        };
        let c = h.dim(2)?;
        let mine = self.positions(t);
        let masks = BlockMasks::new(draw, b.layer, &Positions::run(mine.start, mine.len(), t), c)?;
        let a = b.attn.forward_drawn(&h, draw, b.layer)?; // (B, T/tp, C): reduce-scattered
        let x = (x + masks.attn(&a)?)?; // (B, T/tp, C)
        let h = self.enter_on(&b.ln_2.forward(&x)?)?; // (B, T, C)
        let out = (x + masks.mlp(&b.ffn.forward(&h)?.out)?)?; // (B, T/tp, C)
        Ok(SegmentOut::plain(out))
    }
}

impl SequenceParallelBlock {
    /// This rank's positions of a sequence of `t`.
    fn positions(&self, t: usize) -> std::ops::Range<usize> {
        chunk_range(t, self.group.size(), self.group.rank())
    }
}
