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
//! Every rank slices the same full weights ([`shard`]), so tp = N starts from the single-device
//! numbers, and [`ShardLayout::full_grads`] turns a rank's gradients back into full tensors.
//!
//! Legend: `B` batch, `T` sequence, `C` width, `V` vocabulary, `tp` group size.

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use mtrain_comm::{Comm, CommError};
use mtrain_model::gpt::Block;
use mtrain_model::{CausalSelfAttention, GptConfig, LayerNorm, Linear, Mlp, Param, Segment};

use crate::placement::tp_placement;
use crate::plan::ValidPlan;

pub mod column;
pub mod mapping;
pub mod row;
pub mod sequence;
pub mod shard;
pub mod vocab;

pub use column::{ColumnInput, ColumnParallelLinear};
pub use mapping::{BlockMappings, EmbeddingMappings, HeadMappings, Mapping, Site, TpCollective};
pub use row::{RowOutput, RowParallelLinear};
pub use sequence::SequenceParallelBlock;
pub use shard::{Placement, ShardLayout, ShardSpec};
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
    if plan.dims.tp != tp.size() {
        return Err(TpError::Unsupported(format!(
            "the plan's tp {} is not the group's size {}",
            plan.dims.tp,
            tp.size()
        )));
    }
    let mut b = Builder {
        weights,
        layout: ShardLayout::new(tp.rank(), tp.size()),
        device,
        sp: sequence_parallel,
    };
    let wte = b.param("wte.weight")?;
    let wpe = b.param("wpe.weight")?;
    let mut segments: Vec<Arc<dyn Segment>> = vec![Arc::new(VocabParallelEmbedding::over(
        wte.clone(),
        wpe,
        VocabShard::new(tp.clone(), sequence_parallel),
    ))];
    let heads = cfg.n_head / tp.size();
    let sub = BlockMappings::new(sequence_parallel); // attention's and the MLP's
    let (input, output) = (
        ColumnInput::entered_through(sub.enter.mapping),
        RowOutput::left_through(sub.leave.mapping),
    );
    for i in 0..cfg.n_layer {
        let h = format!("h.{i}");
        let c_attn = b.column(&format!("{h}.attn.c_attn"), input, tp)?;
        let c_proj = b.row(&format!("{h}.attn.c_proj"), output, tp)?;
        let attn = CausalSelfAttention::new(c_attn, c_proj, heads, cfg.head_dim())
            .sharded_heads(tp.rank() * heads, cfg.n_head); // this rank's heads of the layer's
        let mlp = Mlp::new(
            b.column(&format!("{h}.mlp.c_fc"), input, tp)?,
            b.row(&format!("{h}.mlp.c_proj"), output, tp)?,
        );
        let (ln_1, ln_2) = (
            b.layer_norm(&format!("{h}.ln_1"))?,
            b.layer_norm(&format!("{h}.ln_2"))?,
        );
        segments.push(match sequence_parallel {
            false => Arc::new(Block::new(h, ln_1, attn, ln_2, Box::new(mlp))),
            true => Arc::new(SequenceParallelBlock::new(
                h,
                ln_1,
                attn,
                ln_2,
                mlp,
                tp.clone(),
            )),
        });
    }
    let ln_f = b.layer_norm("ln_f")?;
    segments.push(Arc::new(VocabParallelHead::over(
        ln_f,
        wte,
        VocabShard::new(tp.clone(), sequence_parallel),
    )));
    Ok(TpModel {
        segments,
        layout: b.layout,
        sequence_parallel,
    })
}

/// Slices full weights into this rank's Params by the split rule
/// ([`crate::placement::tp_placement`]) and records their placement.
struct Builder<'a> {
    weights: &'a BTreeMap<String, Tensor>,
    layout: ShardLayout,
    device: &'a Device,
    sp: bool,
}

impl Builder<'_> {
    fn param(&mut self, name: &str) -> Result<Param> {
        let full = self
            .weights
            .get(name)
            .ok_or_else(|| TpError::MissingWeight(name.to_string()))?;
        let local = self.layout.take(name, full, tp_placement(name, self.sp))?;
        Ok(Param::new(name, local.to_device(self.device)?)?)
    }

    fn column(
        &mut self,
        prefix: &str,
        input: ColumnInput,
        group: &Comm,
    ) -> Result<Box<dyn Linear>> {
        Ok(Box::new(ColumnParallelLinear {
            weight: self.param(&format!("{prefix}.weight"))?, // (out/tp, in)
            bias: Some(self.param(&format!("{prefix}.bias"))?), // (out/tp,)
            input,
            gather_output: false,
            group: group.clone(),
        }))
    }

    fn row(&mut self, prefix: &str, output: RowOutput, group: &Comm) -> Result<Box<dyn Linear>> {
        Ok(Box::new(RowParallelLinear {
            weight: self.param(&format!("{prefix}.weight"))?, // (out, in/tp)
            bias: Some(self.param(&format!("{prefix}.bias"))?), // (out,)
            output,
            group: group.clone(),
        }))
    }

    fn layer_norm(&mut self, prefix: &str) -> Result<LayerNorm> {
        Ok(LayerNorm::new(
            self.param(&format!("{prefix}.weight"))?,
            self.param(&format!("{prefix}.bias"))?,
        ))
    }
}
