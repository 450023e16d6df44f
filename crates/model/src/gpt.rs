//! GPT-2 as a list of segments.
//!
//! ```text
//!   idx (B, T) u32
//!     │  Embedding: wte[idx] + wpe[0..T]                     segment 0
//!     ▼
//!   x (B, T, C) ─┬─> ln_1 ─> causal self-attention ─(+)─┐    segments 1..=L (one Block each)
//!                └──────────────────────────────────────┘
//!              ─┬─> ln_2 ─> MLP (or MoE) ──────────────(+)─┐
//!               └──────────────────────────────────────────┘
//!     ▼
//!   Head: ln_f ─> x · wteᵀ (tied) ─> logits (B, T, V) ─> mean cross-entropy    segment L+1
//! ```
//!
//! A segment is the unit the block-wise [`Engine`](crate::engine::Engine) runs, the unit a
//! pipeline stage owns a range of, and the unit FSDP gathers. Blocks are built from swappable
//! layers ([`Linear`], [`FeedForward`]) so tensor and expert parallelism reuse [`Block`] as is.
//!
//! Legend: `B` batch, `T` time, `C` width, `V` vocabulary, `N = B·T`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use candle_core::{Device, Result, Tensor};

use crate::config::GptConfig;
use crate::dropout::{self, embedding_mask, BlockMasks, Draw, RowMask};
use crate::explicit;
use crate::init::param_specs;
use crate::layers::{
    linear, CausalSelfAttention, DenseLinear, FeedForward, LayerNorm, Linear, Mlp,
};
use crate::moe::{MoeLayer, MoeStats};
use crate::param::Param;
use crate::chunks::{Positions, SequenceChunks};
use crate::tape::{Collective, SequenceAttention, Tape};
use crate::vocab::{AllRows, VocabLoss, VocabRows};

/// What a segment returns: its output (the scalar loss for a head given targets), and for MoE
/// blocks the auxiliary loss (already times its coefficient) and routing statistics.
pub struct SegmentOut {
    pub out: Tensor,
    pub aux_loss: Option<Tensor>,
    pub stats: Option<MoeStats>,
}

impl SegmentOut {
    /// A plain output with no auxiliary loss.
    pub fn plain(out: Tensor) -> Self {
        Self {
            out,
            aux_loss: None,
            stats: None,
        }
    }
}

/// One piece of the model the engine runs as a unit.
pub trait Segment: Send + Sync {
    /// `embedding`, `h.3`, `head`, ...
    fn name(&self) -> String;
    /// Maps the segment's input to its output; only the head uses `targets`.
    fn forward(&self, x: &Tensor, targets: Option<&Tensor>) -> Result<SegmentOut>;
    /// The parameters this segment uses (a tied weight appears in every segment using it).
    fn params(&self) -> Vec<Param>;
    /// A forward that records no autograd graph, with its hand-written backward, where this
    /// segment has one for `x` ([`crate::explicit`]); None: the engine differentiates
    /// [`Segment::forward`] with autograd. The engine's [`Backward`](crate::engine::Backward)
    /// decides whether it asks.
    fn forward_taped(
        &self,
        _x: &Tensor,
        _targets: Option<&Tensor>,
    ) -> Result<Option<Box<dyn Tape>>> {
        Ok(None)
    }
    /// [`Segment::forward`] of a training pass under `draw` ([`crate::dropout`]); a segment
    /// with dropout sites applies them here. By default (no sites) the plain forward.
    fn forward_drawn(
        &self,
        x: &Tensor,
        targets: Option<&Tensor>,
        _draw: &Draw,
    ) -> Result<SegmentOut> {
        self.forward(x, targets)
    }
    /// [`Segment::forward_taped`] under `draw`, as [`Segment::forward_drawn`].
    fn forward_taped_drawn(
        &self,
        x: &Tensor,
        targets: Option<&Tensor>,
        _draw: &Draw,
    ) -> Result<Option<Box<dyn Tape>>> {
        self.forward_taped(x, targets)
    }
    /// Whether this segment's backward reads its parameters' values (a weight freed after the
    /// forward must then be gathered again for it, [`crate::tape::SlotWeight`]); by default it
    /// does.
    fn backward_reads_params(&self) -> bool {
        true
    }
}

/// A pre-LayerNorm transformer block the engine runs: a [`Block`] on one device, or one whose
/// layers are sharded (sequence parallelism's, whose input and output are this rank's
/// positions). Its [`Segment`] methods are said once, below, from these.
pub trait BlockSegment: Send + Sync {
    /// Its name, layers and index in the model.
    fn block(&self) -> &Block;
    /// The collective entering each sub-layer after its LayerNorm (None: none).
    fn enter(&self) -> Option<Arc<dyn Collective>>;
    /// This rank's first position of a sequence of `t` (0 where the block sees them all).
    fn first_position(&self, _t: usize) -> usize {
        0
    }
    /// The attention over a sequence split across ranks (context parallelism's ring; None:
    /// this rank's attention over its whole sequence).
    fn attention(&self) -> Option<Arc<dyn SequenceAttention>> {
        None
    }
    /// The block's forward, its dropout sites applied under `draw`.
    fn run(&self, x: &Tensor, draw: Option<&Draw>) -> Result<SegmentOut>;
}

impl<B: BlockSegment> Segment for B {
    fn name(&self) -> String {
        self.block().name.clone()
    }

    fn forward(&self, x: &Tensor, _targets: Option<&Tensor>) -> Result<SegmentOut> {
        self.run(x, None)
    }

    fn forward_drawn(&self, x: &Tensor, _t: Option<&Tensor>, draw: &Draw) -> Result<SegmentOut> {
        self.run(x, Some(draw))
    }

    fn params(&self) -> Vec<Param> {
        let b = self.block();
        let mut p = b.ln_1.params();
        p.extend(b.attn.params());
        p.extend(b.ln_2.params());
        p.extend(b.ffn.params());
        p
    }

    fn forward_taped(&self, x: &Tensor, _t: Option<&Tensor>) -> Result<Option<Box<dyn Tape>>> {
        self.block().tape(x, self.enter(), self.attention(), None)
    }

    fn forward_taped_drawn(
        &self,
        x: &Tensor,
        _targets: Option<&Tensor>,
        draw: &Draw,
    ) -> Result<Option<Box<dyn Tape>>> {
        let first = |t: usize| self.first_position(t);
        let dropout = explicit::BlockDropout {
            draw,
            layer: self.block().layer,
            positions: Some(&first),
        };
        self.block().tape(x, self.enter(), self.attention(), Some(&dropout))
    }
}

fn err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(msg)
}

/// Token plus position embedding: idx (B, T) u32 -> (B, T, C); with the vocabulary split
/// ([`VocabRows`]), this holder's rows of `wte` looked up, the holders' parts summed, then
/// `wpe` at the positions the output covers: (B, T, C), or (B, T_r, C).
pub struct Embedding<V: VocabRows = AllRows> {
    /// (V, C), or the rows this holder keeps (V/tp, C); tied with the head
    pub wte: Param,
    /// (block_size, C)
    pub wpe: Param,
    /// Which vocabulary rows `wte` holds.
    pub vocab: V,
    /// The two chunks of each sequence this rank holds under context parallelism (None: the
    /// positions the vocabulary's split says, all of them without sequence parallelism).
    pub chunks: Option<SequenceChunks>,
}

impl Embedding {
    pub fn new(wte: Param, wpe: Param) -> Self {
        Self::over(wte, wpe, AllRows)
    }
}

impl<V: VocabRows> Embedding<V> {
    /// The embedding of the rows `vocab` says `wte` holds.
    pub fn over(wte: Param, wpe: Param, vocab: V) -> Self {
        Self {
            wte,
            wpe,
            vocab,
            chunks: None,
        }
    }

    /// The same embedding of the rows at `chunks`' positions.
    pub fn in_chunks(self, chunks: SequenceChunks) -> Self {
        Self {
            chunks: Some(chunks),
            ..self
        }
    }
}

impl<V: VocabRows> Segment for Embedding<V> {
    fn name(&self) -> String {
        "embedding".to_string()
    }

    fn forward(&self, idx: &Tensor, _targets: Option<&Tensor>) -> Result<SegmentOut> {
        self.embed(idx, None)
    }

    fn params(&self) -> Vec<Param> {
        vec![self.wte.clone(), self.wpe.clone()]
    }

    /// The gradients of `wte` and `wpe` are the output's gradient scattered by the ids and
    /// summed over the batch: no weight is read.
    fn backward_reads_params(&self) -> bool {
        false
    }

    fn forward_taped(
        &self,
        idx: &Tensor,
        _targets: Option<&Tensor>,
    ) -> Result<Option<Box<dyn Tape>>> {
        explicit::embedding_tape(&self.wte, &self.wpe, &self.vocab, self.chunks, idx)
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
        let tape = explicit::embedding_tape(&self.wte, &self.wpe, &self.vocab, self.chunks, idx)?;
        tape.map(|tape| {
            let mask = self.mask(Some(draw), idx.dim(1)?, tape.output().dim(1)?)?;
            dropout::Dropped::wrap(tape, mask)
        })
        .transpose()
    }
}

impl<V: VocabRows> Embedding<V> {
    /// The embedding site's mask of the output (B, `t_r`, C) of ids (B, `t`) under `draw`:
    /// its rows at the chunks' positions of a sequence of cp · t_r under context parallelism,
    /// else at the vocabulary split's (all of `t`, or sequence parallelism's run).
    fn mask(&self, draw: Option<&Draw>, t: usize, t_r: usize) -> Result<Option<RowMask>> {
        let c = self.wte.tensor().dim(1)?;
        let positions = match self.chunks {
            Some(ch) => Positions::chunks(ch, t_r),
            None => Positions::run(self.vocab.first_position(t), t_r, t),
        };
        embedding_mask(draw, &positions, c)
    }

    /// The (summed) token rows plus wpe, dropped under `draw`.
    fn embed(&self, idx: &Tensor, draw: Option<&Draw>) -> Result<SegmentOut> {
        let (b, t) = idx.dims2()?;
        let wpe = self.wpe.tensor();
        let block_size = wpe.dim(0)?;
        if t > block_size {
            return Err(err(format!(
                "embedding: sequence length {t} exceeds block_size {block_size}"
            )));
        }
        let wte = self.wte.tensor();
        let (held, c) = wte.dims2()?;
        let (rows, mine) = self.vocab.rows(&idx.flatten_all()?, held, wte.dtype())?; // (N,)
        let tok = mtrain_kernels::embedding(&wte, &rows)?; // (N, C)
        let tok = match mine {
            Some(mine) => tok.broadcast_mul(&mine.unsqueeze(1)?)?, // 0 for rows held elsewhere
            None => tok,
        };
        let tok = self.vocab.sum(&tok.reshape((b, t, c))?)?; // (B, T, C), or (B, T_r, C)
        let pos = match self.chunks {
            Some(ch) => {
                let runs = ch.runs(tok.dim(1)?).map(|(at, n)| wpe.narrow(0, at, n));
                Tensor::cat(&runs.into_iter().collect::<Result<Vec<_>>>()?, 0)? // (T_r, C)
            }
            None => wpe.narrow(0, self.vocab.first_position(t), tok.dim(1)?)?, // (T, C), or (T_r, C)
        };
        let x = tok.broadcast_add(&pos)?;
        Ok(SegmentOut::plain(match self.mask(draw, t, x.dim(1)?)? {
            Some(m) => dropout::recorded(&x, &m)?,
            None => x,
        }))
    }
}

/// A pre-LayerNorm transformer block: `x + attn(ln_1(x))`, then `x + ffn(ln_2(x))`.
pub struct Block {
    /// `h.{i}`
    pub name: String,
    pub ln_1: LayerNorm,
    pub attn: CausalSelfAttention,
    pub ln_2: LayerNorm,
    pub ffn: Box<dyn FeedForward>,
    /// The block's index in the model (the `i` of its name), which its dropout masks are
    /// keyed by.
    pub layer: usize,
}

/// The index `i` of a block named `h.{i}` (0 for any other name).
pub fn layer_of(name: &str) -> usize {
    name.strip_prefix("h.")
        .and_then(|i| i.parse().ok())
        .unwrap_or(0)
}

impl Block {
    pub fn new(
        name: impl Into<String>,
        ln_1: LayerNorm,
        attn: CausalSelfAttention,
        ln_2: LayerNorm,
        ffn: Box<dyn FeedForward>,
    ) -> Self {
        let name = name.into();
        Self {
            layer: layer_of(&name),
            name,
            ln_1,
            attn,
            ln_2,
            ffn,
        }
    }

    /// Its hand-written backward ([`explicit::sharded_block_tape`]), `enter` after each
    /// LayerNorm, attention over the sequence by `context` and the dropout sites of `dropout`.
    pub fn tape(
        &self,
        x: &Tensor,
        enter: Option<Arc<dyn Collective>>,
        context: Option<Arc<dyn SequenceAttention>>,
        dropout: Option<&explicit::BlockDropout>,
    ) -> Result<Option<Box<dyn Tape>>> {
        let (ln_1, attn, ln_2, ffn) = (&self.ln_1, &self.attn, &self.ln_2, self.ffn.as_ref());
        explicit::sharded_block_tape(ln_1, attn, ln_2, ffn, x, enter, context, dropout)
    }
}

impl Block {
    /// Block `i` with dense layers (an MoE feed-forward when `cfg.moe` is set) from named params.
    pub fn dense(cfg: &GptConfig, i: usize, p: &ParamStore) -> Result<Self> {
        let h = format!("h.{i}");
        let lin = |name: &str| -> Result<Box<dyn Linear>> {
            Ok(Box::new(DenseLinear::new(
                p.get(&format!("{name}.weight"))?,
                Some(p.get(&format!("{name}.bias"))?),
            )))
        };
        let ln = |name: &str| -> Result<LayerNorm> {
            Ok(LayerNorm::new(
                p.get(&format!("{name}.weight"))?,
                p.get(&format!("{name}.bias"))?,
            ))
        };
        let attn = CausalSelfAttention::new(
            lin(&format!("{h}.attn.c_attn"))?,
            lin(&format!("{h}.attn.c_proj"))?,
            cfg.n_head,
            cfg.head_dim(),
        );
        let mlp = |prefix: &str| -> Result<Mlp> {
            Ok(Mlp::new(
                lin(&format!("{prefix}.c_fc"))?,
                lin(&format!("{prefix}.c_proj"))?,
            ))
        };
        let ffn: Box<dyn FeedForward> = match &cfg.moe {
            None => Box::new(mlp(&format!("{h}.mlp"))?),
            Some(m) => {
                let experts = (0..m.n_experts)
                    .map(|e| mlp(&format!("{h}.moe.experts.{e}")))
                    .collect::<Result<Vec<_>>>()?;
                Box::new(MoeLayer::new(
                    p.get(&format!("{h}.moe.router.weight"))?,
                    experts,
                    m.clone(),
                ))
            }
        };
        Ok(Self::new(
            h.clone(),
            ln(&format!("{h}.ln_1"))?,
            attn,
            ln(&format!("{h}.ln_2"))?,
            ffn,
        ))
    }
}

impl BlockSegment for Block {
    fn block(&self) -> &Block {
        self
    }

    fn enter(&self) -> Option<Arc<dyn Collective>> {
        None
    }

    fn run(&self, x: &Tensor, draw: Option<&Draw>) -> Result<SegmentOut> {
        let (_, t, c) = x.dims3()?;
        let masks = BlockMasks::new(draw, self.layer, &Positions::all(t), c)?;
        let layer = self.layer;
        let a = self
            .attn
            .forward_drawn(&self.ln_1.forward(x)?, draw, layer)?; // (B, T, C)
        let x = (x + masks.attn(&a)?)?; // (B, T, C)
        let ffn = self.ffn.forward(&self.ln_2.forward(&x)?)?;
        Ok(SegmentOut {
            out: (x + masks.mlp(&ffn.out)?)?,
            aux_loss: ffn.aux_loss,
            stats: ffn.stats,
        })
    }
}

/// Final LayerNorm, LM head tied to `wte` (the rows of it `vocab` holds), and the loss.
/// Without targets the output is the logits (B, T, V); with targets (B, T) u32 it is the scalar
/// mean cross-entropy (over all rows [`mtrain_kernels::cross_entropy`], log-softmax in f32; with
/// the vocabulary split, the split's [`VocabLoss`]).
pub struct Head<V: VocabLoss = AllRows> {
    pub ln_f: LayerNorm,
    /// (V, C), or the rows this holder keeps (V/tp, C); the same Param as the embedding's
    pub wte: Param,
    /// Which vocabulary rows `wte` holds, and the loss over them.
    pub vocab: V,
}

impl Head {
    pub fn new(ln_f: LayerNorm, wte: Param) -> Self {
        Self::over(ln_f, wte, AllRows)
    }
}

impl<V: VocabLoss> Head<V> {
    /// The head of the rows `vocab` says `wte` holds.
    pub fn over(ln_f: LayerNorm, wte: Param, vocab: V) -> Self {
        Self { ln_f, wte, vocab }
    }
}

impl<V: VocabLoss> Segment for Head<V> {
    fn name(&self) -> String {
        "head".to_string()
    }

    fn forward(&self, x: &Tensor, targets: Option<&Tensor>) -> Result<SegmentOut> {
        let h = self.vocab.enter(&self.ln_f.forward(x)?)?; // (B, T, C)
        let logits = linear(&h, &self.wte.tensor(), None)?; // (B, T, V), or (B, T, V_r)
        Ok(SegmentOut::plain(match targets {
            None => self.vocab.logits(&logits)?, // (B, T, V)
            Some(t) => self.vocab.loss(&logits, t)?,
        }))
    }

    fn params(&self) -> Vec<Param> {
        let mut p = self.ln_f.params();
        p.push(self.wte.clone());
        p
    }

    fn forward_taped(&self, x: &Tensor, targets: Option<&Tensor>) -> Result<Option<Box<dyn Tape>>> {
        explicit::head_tape(&self.ln_f, &self.wte, &self.vocab, x, targets)
    }
}

/// Parameters by name, built once from a weight map, so every layer using a name shares one Param.
pub struct ParamStore {
    params: BTreeMap<String, Param>,
}

impl ParamStore {
    /// Wraps every tensor of `weights` (moved to `device`) in a Param.
    pub fn new(weights: &BTreeMap<String, Tensor>, device: &Device) -> Result<Self> {
        let params = weights
            .iter()
            .map(|(name, t)| {
                Ok((
                    name.clone(),
                    Param::new(name.clone(), t.to_device(device)?)?,
                ))
            })
            .collect::<Result<_>>()?;
        Ok(Self { params })
    }

    /// The store of `params`, by name.
    pub fn from_params(params: BTreeMap<String, Param>) -> Self {
        Self { params }
    }

    /// The Param called `name`, or an error naming it.
    pub fn get(&self, name: &str) -> Result<Param> {
        self.params
            .get(name)
            .cloned()
            .ok_or_else(|| err(format!("missing weight `{name}`")))
    }
}

/// The whole model: its config and its segments `[Embedding, Block × L, Head]`.
pub struct Gpt {
    pub cfg: GptConfig,
    pub segments: Vec<Arc<dyn Segment>>,
}

/// Loss of a whole-graph forward.
pub struct LossOut {
    /// Mean cross-entropy (scalar).
    pub loss: Tensor,
    /// Sum of the blocks' auxiliary losses (already times their coefficients).
    pub aux_loss: Option<Tensor>,
    pub stats: Vec<MoeStats>,
}

impl LossOut {
    /// What training minimises: loss + aux_loss.
    pub fn objective(&self) -> Result<Tensor> {
        match &self.aux_loss {
            Some(a) => &self.loss + a,
            None => Ok(self.loss.clone()),
        }
    }
}

impl Gpt {
    /// Builds the model from full weights by name (see [`crate::init::init_weights`]). The tensors
    /// keep their dtype; names `cfg` expects but `weights` lacks are reported, and so are extras.
    pub fn new(cfg: GptConfig, weights: &BTreeMap<String, Tensor>, device: &Device) -> Result<Gpt> {
        cfg.validate().map_err(candle_core::Error::wrap)?;
        let expected: BTreeSet<String> = param_specs(&cfg).into_iter().map(|(n, _, _)| n).collect();
        if let Some(extra) = weights.keys().find(|k| !expected.contains(*k)) {
            return Err(err(format!("unexpected weight `{extra}` for this config")));
        }
        for (name, shape, _) in param_specs(&cfg) {
            match weights.get(&name) {
                None => return Err(err(format!("missing weight `{name}`"))),
                Some(t) if t.dims() != shape.as_slice() => {
                    return Err(err(format!(
                        "weight `{name}` has shape {:?}, expected {shape:?}",
                        t.dims()
                    )))
                }
                Some(_) => {}
            }
        }
        let p = ParamStore::new(weights, device)?;
        let segments = (0..cfg.n_layer + 2)
            .map(|i| Gpt::segment(&cfg, i, &p))
            .collect::<Result<_>>()?;
        Ok(Gpt { cfg, segments })
    }

    /// Segment `index` of `[embedding, h.0 … h.(L−1), head]` from the params of `p` (only the
    /// ones it uses need be there; the embedding and the head share `p`'s one `wte`).
    pub fn segment(cfg: &GptConfig, index: usize, p: &ParamStore) -> Result<Arc<dyn Segment>> {
        Ok(match index {
            0 => Arc::new(Embedding::new(p.get("wte.weight")?, p.get("wpe.weight")?)),
            i if i <= cfg.n_layer => Arc::new(Block::dense(cfg, i - 1, p)?),
            _ => Arc::new(Head::new(
                LayerNorm::new(p.get("ln_f.weight")?, p.get("ln_f.bias")?),
                p.get("wte.weight")?,
            )),
        })
    }

    /// Every parameter once, in a fixed order: wte, wpe, h.0 …, ln_f.
    pub fn params(&self) -> Vec<Param> {
        let mut seen = BTreeSet::new();
        self.segments
            .iter()
            .flat_map(|s| s.params())
            .filter(|p| seen.insert(p.name().to_string()))
            .collect()
    }

    /// Whole-graph forward to the loss (for tests and evaluation).
    pub fn forward_loss(&self, idx: &Tensor, targets: &Tensor) -> Result<LossOut> {
        let mut x = idx.clone();
        let mut aux: Option<Tensor> = None;
        let mut stats = Vec::new();
        for seg in &self.segments {
            let o = seg.forward(&x, Some(targets))?;
            if let Some(a) = o.aux_loss {
                aux = Some(match aux {
                    Some(s) => (s + a)?,
                    None => a,
                });
            }
            stats.extend(o.stats);
            x = o.out;
        }
        Ok(LossOut {
            loss: x,
            aux_loss: aux,
            stats,
        })
    }

    /// Logits (B, T, V) for idx (B, T).
    pub fn logits(&self, idx: &Tensor) -> Result<Tensor> {
        let mut x = idx.clone();
        for seg in &self.segments {
            x = seg.forward(&x, None)?.out;
        }
        Ok(x)
    }
}
