//! Context parallelism: the cp ranks of a group split each sequence, and attention brings every
//! rank's keys and values around a ring (Liu et al. 2023, Ring Attention; the causal load
//! balance of Megatron's and torchtitan's context parallelism).
//!
//! **The chunks.** A sequence of T is cut into 2·n chunks; rank i holds chunks i and 2n−1−i
//! ([`SequenceChunks`]), T/n rows in all, so that under the causal mask every rank computes the
//! same number of blocks (the early chunk sees few keys, its partner many):
//!
//! ```text
//!   n = 2:      chunk   0    1    2    3          rows of rank 0: chunks 0, 3
//!               rank    0    1    1    0          rows of rank 1: chunks 1, 2
//!
//!   which key blocks each rank's queries see (■ causal diagonal, █ full block, · none):
//!                   keys of rank 0 (0,3)   keys of rank 1 (1,2)
//!   rank 0  q 0        ■    ·                 ·    ·
//!           q 3        █    ■                 █    █
//!   rank 1  q 1        █    ·                 ■    ·
//!           q 2        █    ·                 █    ■
//! ```
//!
//! **The ring, forward** ([`ring`]). Each rank starts with its own K, V; at every step it sends
//! the block it holds to rank i+1 and receives rank i−1's, the transfer issued before the
//! step's attention and waited after it, so it is in flight while the block is computed. The
//! partial outputs are merged with their log-sum-exp, as the flash kernels merge key tiles:
//!
//! ```text
//!   step 0: rank i holds KV_i      y, lse = causal(q, KV_i)                 send KV_i → i+1
//!   step 1: rank i holds KV_i−1    j < i: y ⊕= full(q, early chunk of KV_j)  send KV_i−1 → i+1
//!                                  j > i: y_late ⊕= full(q late chunk, KV_j)
//!   …       n − 1 steps of transfer in all; after step n − 1 every rank has seen every KV
//!   merge:  lse = log(e^lse_a + e^lse_b),  y = y_a·e^(lse_a − lse) + y_b·e^(lse_b − lse)
//! ```
//!
//! **The ring, backward.** The same steps: each block's gradient is rebuilt from the merged
//! output and lse (the flash backward's rule); dQ stays on the rank, and dK, dV of the block
//! are added to an accumulator that travels around the ring behind its K, V. After n passes
//! each accumulator is back with the rank that holds those keys:
//!
//! ```text
//!   step s: rank i holds KV_(i−s) and receives dKV_(i−s) from i−1, adds its block's part,
//!           passes it on to i+1;   one last pass after step n − 1 brings dKV_i home
//! ```
//!
//! **Everything else** is per token and needs no communication: the embedding adds `wpe` at
//! the chunks' positions ([`mtrain_model::Embedding::in_chunks`]); each rank's loss is the mean
//! over its T/n tokens of each sequence, and since every rank holds as many tokens, averaging
//! losses and gradients over dp × cp (the mesh's dcp group) gives the mean over the whole
//! sequence; [`take_chunks`] cuts each rank's rows out of the batch.

pub mod ring;

use std::sync::Arc;

use candle_core::{Result, Tensor};
use mtrain_comm::Comm;
use mtrain_model::gpt::ParamStore;
use mtrain_model::tape::SequenceAttention;
pub use mtrain_model::SequenceChunks;
use mtrain_model::{Block, BlockSegment, Draw, Embedding, Gpt, GptConfig, Segment, SegmentOut};

pub use ring::RingAttention;

/// This rank's rows (B, T/n) of a batch of sequences (B, T): chunks i and 2n−1−i, side by side.
/// T must be a multiple of 2·n.
pub fn take_chunks(x: &Tensor, chunks: SequenceChunks) -> Result<Tensor> {
    let t = x.dim(1)?;
    let n = chunks.n;
    if !t.is_multiple_of(2 * n) {
        return Err(candle_core::Error::Msg(format!(
            "context parallelism: sequence length {t} is not divisible by 2·cp = {}; \
             each of the {n} ranks holds two equal chunks (use a multiple of {})",
            2 * n,
            2 * n
        )));
    }
    let runs = chunks.runs(t / n);
    Tensor::cat(
        &[
            x.narrow(1, runs[0].0, runs[0].1)?,
            x.narrow(1, runs[1].0, runs[1].1)?,
        ],
        1,
    )
}

/// A transformer block whose attention is the ring over the cp group: the dense block's
/// layers, run on this rank's chunks.
pub struct RingBlock {
    pub block: Block,
    ring: Arc<RingAttention>,
}

impl RingBlock {
    pub fn new(block: Block, group: Comm) -> Self {
        let ring = Arc::new(RingAttention::new(group));
        Self { block, ring }
    }
}

impl BlockSegment for RingBlock {
    fn block(&self) -> &Block {
        &self.block
    }

    fn enter(&self) -> Option<Arc<dyn mtrain_model::tape::Collective>> {
        None
    }

    fn attention(&self) -> Option<Arc<dyn SequenceAttention>> {
        Some(self.ring.clone())
    }

    /// The forward through the hand-written path (the ring has no autograd form).
    fn run(&self, x: &Tensor, draw: Option<&Draw>) -> Result<SegmentOut> {
        let dropout = draw.map(|draw| mtrain_model::explicit::BlockDropout {
            draw,
            layer: self.block.layer,
            positions: None,
        });
        let tape = self
            .block
            .tape(x, None, self.attention(), dropout.as_ref())?
            .ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "{}: context parallelism runs blocks with f32 or bf16 weights and biases only",
                    self.block.name
                ))
            })?;
        Ok(SegmentOut {
            out: tape.output().clone(),
            aux_loss: tape.aux_loss().cloned(),
            stats: tape.stats(),
        })
    }
}

/// The chunks a rank of the cp `group` holds: its rank and 2n−1−rank.
pub fn chunks_of(group: &Comm) -> SequenceChunks {
    SequenceChunks {
        n: group.size(),
        i: group.rank(),
    }
}

/// Segment `index` of the model (embedding, blocks, head) for a rank of the cp `group`: the
/// embedding at its chunks' positions, the blocks over the ring.
pub fn segment(
    cfg: &GptConfig,
    index: usize,
    p: &ParamStore,
    group: &Comm,
) -> Result<Arc<dyn Segment>> {
    let chunks = chunks_of(group);
    Ok(match index {
        0 => Arc::new(Embedding::new(p.get("wte.weight")?, p.get("wpe.weight")?).in_chunks(chunks)),
        i if i <= cfg.n_layer => {
            Arc::new(RingBlock::new(Block::dense(cfg, i - 1, p)?, group.clone()))
        }
        _ => Gpt::segment(cfg, index, p)?,
    })
}
