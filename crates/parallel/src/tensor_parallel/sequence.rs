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
//! Its hand-written backward is the dense block's ([`sharded_block_tape`]) with the all-gather
//! entering each sub-layer and the row layers' reduce-scatter, each conjugate in its place; so
//! is its dropout, the dense block's sites with this rank's positions of the residual branches
//! ([`BlockDropout::positions`]).

use candle_core::{Result, Tensor};
use mtrain_comm::{chunk_range, Comm};
use mtrain_model::dropout::BlockMasks;
use mtrain_model::explicit::{sharded_block_tape, BlockDropout};
use mtrain_model::tape::Tape;
use mtrain_model::Draw;
use mtrain_model::{CausalSelfAttention, FeedForward, LayerNorm, Mlp, Param, Segment, SegmentOut};

use super::BlockMappings;

/// A pre-LayerNorm transformer block whose input and output are this rank's sequence shard.
pub struct SequenceParallelBlock {
    /// `h.{i}`
    pub name: String,
    pub ln_1: LayerNorm,
    pub attn: CausalSelfAttention,
    pub ln_2: LayerNorm,
    pub mlp: Mlp,
    pub group: Comm,
    /// The block's index in the model (its dropout masks' layer).
    pub layer: usize,
}

impl SequenceParallelBlock {
    pub fn new(
        name: impl Into<String>,
        ln_1: LayerNorm,
        attn: CausalSelfAttention,
        ln_2: LayerNorm,
        mlp: Mlp,
        group: Comm,
    ) -> Self {
        let name = name.into();
        Self {
            layer: mtrain_model::gpt::layer_of(&name),
            name,
            ln_1,
            attn,
            ln_2,
            mlp,
            group,
        }
    }
}

/// The all-gather entering each sub-layer.
const ENTER: super::Mapping = BlockMappings::new(true).enter.mapping;

impl Segment for SequenceParallelBlock {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn forward(&self, x: &Tensor, _targets: Option<&Tensor>) -> Result<SegmentOut> {
        self.run(x, None)
    }

    fn forward_drawn(&self, x: &Tensor, _t: Option<&Tensor>, draw: &Draw) -> Result<SegmentOut> {
        self.run(x, Some(draw))
    }

    fn forward_taped_drawn(
        &self,
        x: &Tensor,
        _targets: Option<&Tensor>,
        draw: &Draw,
    ) -> Result<Option<Box<dyn Tape>>> {
        let first = |t: usize| self.positions(t).start;
        let dropout = BlockDropout {
            draw,
            layer: self.layer,
            positions: Some(&first),
        };
        sharded_block_tape(
            &self.ln_1,
            &self.attn,
            &self.ln_2,
            &self.mlp,
            x,
            Some(ENTER.over(&self.group)),
            Some(&dropout),
        )
    }

    fn params(&self) -> Vec<Param> {
        let mut p = self.ln_1.params();
        p.extend(self.attn.params());
        p.extend(self.ln_2.params());
        p.extend(FeedForward::params(&self.mlp));
        p
    }

    /// The block's hand-written backward with the sequence all-gather entering each sub-layer
    /// (its conjugate, the reduce-scatter of the gradient, in the backward).
    fn forward_taped(
        &self,
        x: &Tensor,
        _targets: Option<&Tensor>,
    ) -> Result<Option<Box<dyn Tape>>> {
        sharded_block_tape(
            &self.ln_1,
            &self.attn,
            &self.ln_2,
            &self.mlp,
            x,
            Some(ENTER.over(&self.group)),
            None,
        )
    }
}

impl SequenceParallelBlock {
    /// This rank's positions of a sequence of `t`.
    fn positions(&self, t: usize) -> std::ops::Range<usize> {
        chunk_range(t, self.group.size(), self.group.rank())
    }

    /// The block's forward, its dropout sites applied under `draw`.
    fn run(&self, x: &Tensor, draw: Option<&Draw>) -> Result<SegmentOut> {
        // x: (B, T/tp, C)
        let h = ENTER.apply(&self.ln_1.forward(x)?, &self.group)?; // (B, T, C)
        let (t, c) = (h.dim(1)?, h.dim(2)?);
        let masks = BlockMasks::new(draw, self.layer, (self.positions(t).start, t), c)?;
        let a = self.attn.forward_drawn(&h, draw, self.layer)?; // (B, T/tp, C): reduce-scattered
        let x = (x + masks.attn(&a)?)?; // (B, T/tp, C)
        let h = ENTER.apply(&self.ln_2.forward(&x)?, &self.group)?; // (B, T, C)
        let out = (x + masks.mlp(&self.mlp.forward(&h)?.out)?)?; // (B, T/tp, C)
        Ok(SegmentOut::plain(out))
    }
}
