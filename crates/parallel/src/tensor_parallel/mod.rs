//! Tensor parallelism (Megatron-LM): every weight matrix split across the `tp` ranks of a group.
//!
//! A linear `y = x Wᵀ` splits two ways. **Column-parallel** splits W on its output dim; each rank
//! computes a slice of the output features from the whole input. **Row-parallel** splits W on its
//! input dim; each rank multiplies its slice of the input features and the partial outputs are
//! summed:
//!
//! ```text
//!   column-parallel                          row-parallel
//!   W = [W1; W2]   (out split)               W = [W1 | W2]   (in split)
//!
//!   x ─f─┬─ x W1ᵀ = y1 (B,T,out/tp)          x1 ─ x1 W1ᵀ ─┐
//!        └─ x W2ᵀ = y2                        x2 ─ x2 W2ᵀ ─┴─ g: Σ ─ + b ─ y (B,T,out)
//! ```
//!
//! Chaining a column layer into a row layer needs no communication in between: the column
//! layer's output slice is exactly the row layer's input slice. So attention (c_attn column,
//! heads split across ranks; c_proj row) and the MLP (c_fc column; c_proj row) each cost one
//! all-reduce in forward (g) and one in backward (f). [`column`] and [`row`] hold each layer's
//! forward and hand-written backward as the training step runs them, f and g issued where they
//! sit, and its autograd forward (the tests' oracle). Which mapping each segment kind runs
//! where is one table per kind ([`mapping`]); the layers are built from it and the cost model
//! counts it.
//!
//! **Vocabulary parallelism** ([`vocab`]): the tied `wte` is split by rows; each rank embeds the
//! tokens in its range, and the loss is computed from vocab-sharded logits without gathering them.
//!
//! **Sequence parallelism** ([`sequence`]): between the linear layers (LayerNorm, residual adds)
//! every rank holds the same activations; with `sequence_parallel` each rank keeps only 1/tp of the
//! sequence there, and each all-reduce becomes a reduce-scatter (leaving a layer) plus an
//! all-gather (entering the next) — the same bytes, and 1/tp of the activation memory.
//!
//! Every rank reads its pieces of the same weights ([`shard`] cuts them from full tensors,
//! [`Builder`] wraps pieces read alone), so tp = N starts from the single-device numbers, and
//! [`ShardLayout::full_grads`] turns a rank's gradients back into full tensors.
//!
//! Legend: `B` batch, `T` sequence, `C` width, `V` vocabulary, `tp` group size.

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use mtrain_comm::{Comm, CommError};
use mtrain_model::gpt::Block;
use mtrain_model::{CausalSelfAttention, GptConfig, LayerNorm, Linear, Mlp, Param, Segment};

use crate::context_parallel::{self, RingBlock};
use crate::placement::tp_placement;
use crate::plan::ValidPlan;

pub mod column;
pub mod mapping;
pub mod overlap;
pub mod ring;
pub mod row;
pub mod sequence;
pub mod shard;
pub mod vocab;

pub use column::{ColumnInput, ColumnParallelLinear};
pub use mapping::{BlockMappings, EmbeddingMappings, HeadMappings, Mapping, Site, TpCollective};
pub use crate::plan::TpOverlap;
pub use row::{RowOutput, RowParallelLinear};
pub use sequence::SequenceParallelBlock;
pub use shard::{shard, Placement, ShardLayout, ShardSpec};
pub use vocab::{
    vocab_parallel_cross_entropy, VocabParallelEmbedding, VocabParallelHead, VocabShard,
};

/// The sequence dim of activations (B, T, C).
pub const SEQ_DIM: usize = 1;

/// Errors building a tensor-parallel model.
#[derive(Debug, thiserror::Error)]
pub enum TpError {
    #[error("tensor parallelism: missing weight `{0}`")]
    MissingWeight(String),
    #[error("tensor parallelism: `{0}` is not a parameter of this model")]
    UnknownParam(String),
    #[error("tensor parallelism: cannot shard `{name}`: {msg}")]
    Shard { name: String, msg: String },
    #[error("tensor parallelism: {0}")]
    Unsupported(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Comm(#[from] CommError),
}

pub type Result<T> = std::result::Result<T, TpError>;

/// A tensor-parallel GPT on one rank: its segments `[embedding, h.0 … h.{L-1}, head]` and where
/// every parameter lives.
pub struct TpModel {
    pub segments: Vec<Arc<dyn Segment>>,
    pub layout: ShardLayout,
    pub sequence_parallel: bool,
}

impl TpModel {
    /// Every parameter once (the tied `wte` shard appears once), in segment order.
    pub fn params(&self) -> Vec<Param> {
        let mut seen = std::collections::BTreeSet::new();
        self.segments
            .iter()
            .flat_map(|s| s.params())
            .filter(|p| seen.insert(p.name().to_string()))
            .collect()
    }
}

/// Builds this rank's segments of a tensor-parallel GPT over the group `tp` from the full
/// weights (by GPT-2 name, as [`mtrain_model::init_weights`] gives them). Parameters keep their
/// full-model names and hold this rank's shard. `plan` is the proof that `cfg` splits over its
/// tp ranks (heads, MLP width, vocabulary: [`crate::placement::tp_problems`], checked once by
/// [`ParallelPlan::validate`](crate::plan::ParallelPlan::validate)); `tp` must be its tp group.
///
/// A training step on every tp rank: run the segments with the engine, then (with
/// `sequence_parallel`) `layout.sync_partial_grads(&mut grads, tp)`, then step each local
/// parameter with its local gradient. `layout.full_grads` gives full tensors by name.
pub fn build(
    cfg: &GptConfig,
    weights: &BTreeMap<String, Tensor>,
    plan: &ValidPlan,
    tp: &Comm,
    sequence_parallel: bool,
    device: &Device,
) -> Result<TpModel> {
    check_group(plan, tp)?;
    let mut pieces = BTreeMap::new();
    for (name, full) in weights {
        let placement = tp_placement(name, sequence_parallel);
        let piece = shard(full, placement, tp.rank(), tp.size()).map_err(|e| TpError::Shard {
            name: name.clone(),
            msg: e.to_string(),
        })?;
        let param = Param::new(name, piece.to_device(device)?)?;
        pieces.insert(name.clone(), (full.dims().to_vec(), param));
    }
    let mut b = Builder::new(cfg, &pieces, plan, tp, sequence_parallel)?;
    let segments = (0..cfg.n_layer + 2)
        .map(|i| b.segment(i))
        .collect::<Result<_>>()?;
    Ok(TpModel {
        segments,
        layout: b.layout,
        sequence_parallel,
    })
}

/// That `tp` is the plan's tp group (its size).
fn check_group(plan: &ValidPlan, tp: &Comm) -> Result<()> {
    if plan.dims.tp != tp.size() {
        return Err(TpError::Unsupported(format!(
            "the plan's tp {} is not the group's size {}",
            plan.dims.tp,
            tp.size()
        )));
    }
    Ok(())
}

/// This rank's tensor-parallel segments, one at a time, from its pieces of the weights: by
/// GPT-2 name, the single-device shape and this rank's piece as a parameter (cut by the split
/// rule, [`crate::placement::tp_placement`]). It records each parameter's placement as it uses
/// it.
pub struct Builder<'a> {
    cfg: &'a GptConfig,
    pieces: &'a BTreeMap<String, (Vec<usize>, Param)>,
    /// Where every parameter wrapped so far lives.
    pub layout: ShardLayout,
    tp: &'a Comm,
    sp: bool,
    overlap: TpOverlap,
    /// The tied `wte`, one `Param` for the embedding and the head.
    wte: Option<Param>,
    /// The cp group where context parallelism splits the sequence (its blocks' attention is
    /// the ring, its embedding at the rank's chunks).
    cp: Option<Comm>,
}

impl<'a> Builder<'a> {
    /// A builder over `pieces` for the tp group `tp` (the plan's, see [`build`]).
    pub fn new(
        cfg: &'a GptConfig,
        pieces: &'a BTreeMap<String, (Vec<usize>, Param)>,
        plan: &ValidPlan,
        tp: &'a Comm,
        sequence_parallel: bool,
    ) -> Result<Self> {
        check_group(plan, tp)?;
        if tp.size() > 1 && plan.tp_overlap == TpOverlap::Ring && !sequence_parallel {
            return Err(TpError::Unsupported(
                "--tp-overlap ring decomposes sequence parallelism's all-gather and reduce-scatter: build with sequence parallelism, or use --tp-overlap chunked".into(),
            ));
        }
        Ok(Builder {
            cfg,
            pieces,
            layout: ShardLayout::new(tp.rank(), tp.size()),
            tp,
            sp: sequence_parallel,
            overlap: plan.tp_overlap,
            wte: None,
            cp: None,
        })
    }

    /// The same builder for a rank of the cp group `cp` (without sequence parallelism).
    pub fn with_cp(self, cp: Comm) -> Self {
        Self {
            cp: Some(cp),
            ..self
        }
    }

    /// Segment `index` of `[embedding, h.0 … h.(L−1), head]`.
    pub fn segment(&mut self, index: usize) -> Result<Arc<dyn Segment>> {
        let (cfg, tp, sp) = (self.cfg, self.tp, self.sp);
        if index == 0 {
            let (wte, wpe) = (self.wte()?, self.param("wpe.weight")?);
            let shard = VocabShard::new(tp.clone(), sp);
            let emb = VocabParallelEmbedding::over(wte, wpe, shard);
            return Ok(match &self.cp {
                Some(cp) => Arc::new(emb.in_chunks(context_parallel::chunks_of(cp))),
                None => Arc::new(emb),
            });
        }
        if index > cfg.n_layer {
            let (ln_f, wte) = (self.layer_norm("ln_f")?, self.wte()?);
            let shard = VocabShard::new(tp.clone(), sp);
            return Ok(Arc::new(VocabParallelHead::over(ln_f, wte, shard)));
        }
        let h = format!("h.{}", index - 1);
        let heads = cfg.n_head / tp.size();
        let sub = BlockMappings::new(sp); // attention's and the MLP's
        let (input, output) = (
            ColumnInput::entered_through(sub.enter.mapping, self.overlap),
            RowOutput::left_through(sub.leave.mapping),
        );
        let c_attn = self.column(&format!("{h}.attn.c_attn"), input)?;
        let c_proj = self.row(&format!("{h}.attn.c_proj"), output)?;
        let attn = CausalSelfAttention::new(c_attn, c_proj, heads, cfg.head_dim())
            .sharded_heads(tp.rank() * heads, cfg.n_head); // this rank's heads of the layer's
        let mlp = Mlp::new(
            self.column(&format!("{h}.mlp.c_fc"), input)?,
            self.row(&format!("{h}.mlp.c_proj"), output)?,
        );
        let (ln_1, ln_2) = (
            self.layer_norm(&format!("{h}.ln_1"))?,
            self.layer_norm(&format!("{h}.ln_2"))?,
        );
        Ok(match (sp, &self.cp) {
            (false, cp) => {
                let block = Block::new(h, ln_1, attn, ln_2, Box::new(mlp));
                match cp {
                    Some(cp) => Arc::new(RingBlock::new(block, cp.clone())),
                    None => Arc::new(block),
                }
            }
            (true, _) => Arc::new(SequenceParallelBlock::new(
                h,
                ln_1,
                attn,
                ln_2,
                mlp,
                tp.clone(),
                self.overlap == TpOverlap::Ring,
            )),
        })
    }

    fn wte(&mut self) -> Result<Param> {
        if self.wte.is_none() {
            self.wte = Some(self.param("wte.weight")?);
        }
        Ok(self.wte.clone().expect("just set"))
    }

    fn param(&mut self, name: &str) -> Result<Param> {
        let (full_shape, param) = self
            .pieces
            .get(name)
            .ok_or_else(|| TpError::MissingWeight(name.to_string()))?;
        self.layout
            .register(name, full_shape.clone(), tp_placement(name, self.sp));
        Ok(param.clone())
    }

    fn column(&mut self, prefix: &str, input: ColumnInput) -> Result<Box<dyn Linear>> {
        Ok(Box::new(ColumnParallelLinear {
            weight: self.param(&format!("{prefix}.weight"))?, // (out/tp, in)
            bias: Some(self.param(&format!("{prefix}.bias"))?), // (out/tp,)
            input,
            gather_output: false,
            group: self.tp.clone(),
            overlap: self.overlap,
        }))
    }

    fn row(&mut self, prefix: &str, output: RowOutput) -> Result<Box<dyn Linear>> {
        Ok(Box::new(RowParallelLinear {
            weight: self.param(&format!("{prefix}.weight"))?, // (out, in/tp)
            bias: Some(self.param(&format!("{prefix}.bias"))?), // (out,)
            output,
            group: self.tp.clone(),
            overlap: self.overlap,
        }))
    }

    fn layer_norm(&mut self, prefix: &str) -> Result<LayerNorm> {
        Ok(LayerNorm::new(
            self.param(&format!("{prefix}.weight"))?,
            self.param(&format!("{prefix}.bias"))?,
        ))
    }
}
