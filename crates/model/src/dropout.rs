//! Dropout where nanoGPT puts it, with masks that every layout draws alike.
//!
//! ```text
//!   embedding:  x = drop(wte[idx] + wpe)                                  site Embedding, layer 0
//!   block i:    x1 = x  + drop(c_proj(attention with drop(P)))            sites Attention and
//!               out = x1 + drop(mlp(ln_2(x1)))                              AttentionResidual,
//!                                                                           MlpResidual, layer i
//! ```
//!
//! A mask element is a pure function of the run's seed, the optimizer step, the micro-step, the
//! layer, the site and the element's place in the activation of the micro-step's *global* batch
//! ([`mtrain_kernels::dropout`]). A forward pass knows its rows of that batch from its [`Draw`]
//! (a data-parallel rank's slice, a pipeline micro-batch), and a layer knows the rest of its
//! place: its heads under tensor parallelism ([`CausalSelfAttention::head0`]), its positions
//! under sequence parallelism, its two chunks of each sequence under context parallelism
//! ([`Positions`]; the ring draws each block of the attention probabilities at its (query,
//! key) places, [`Mask::probs_block`]). So a rank draws exactly the elements one device draws for the
//! same places, a recompute draws them again, and no tape keeps a mask: each backward draws it
//! from the same coordinates. No [`Draw`], no dropout: evaluation and sampling pass none.
//!
//! [`CausalSelfAttention::head0`]: crate::layers::CausalSelfAttention::head0
//! [`Mask::probs_block`]: mtrain_kernels::dropout::Mask::probs_block

use candle_core::{DType, Result, Tensor};
use mtrain_kernels::dropout::{Mask, MaskKey, Place, Site};

use crate::chunks::Positions;
use crate::tape::{Tape, TapeGrads};

/// The mask of an activation (B, T_r, C) whose rows hold [`Positions`]: one [`Mask`] per run,
/// each with its rows' place in the global activation, with the run's row count.
#[derive(Debug, Clone, PartialEq)]
pub struct RowMask {
    runs: Vec<(Mask, usize)>,
}

impl RowMask {
    /// The drop probability.
    pub fn p(&self) -> f64 {
        self.runs.first().map_or(0.0, |(m, _)| m.p)
    }

    /// `x ∘ mask` for x (B, T_r, C), T_r the positions' rows: each run's rows by its mask
    /// ([`mtrain_kernels::dropout::apply`]), side by side again.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let rows: usize = self.runs.iter().map(|r| r.1).sum();
        if x.dim(1)? != rows {
            return Err(candle_core::Error::Msg(format!(
                "dropout: an activation of {} positions under a mask of {rows}",
                x.dim(1)?
            )));
        }
        if let [(m, _)] = self.runs.as_slice() {
            return mtrain_kernels::dropout::apply(x, m);
        }
        let mut at = 0;
        let mut parts = Vec::with_capacity(self.runs.len());
        for (m, n) in &self.runs {
            parts.push(mtrain_kernels::dropout::apply(&x.narrow(1, at, *n)?.contiguous()?, m)?);
            at += n;
        }
        Tensor::cat(&parts, 1) // (B, T_r, C)
    }
}

/// The run's dropout and the micro-step it is drawn for: a [`Draw`] before its rows are known.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepDraw {
    pub p: f64,
    pub seed: u64,
    pub step: u64,
    pub micro: u32,
}

impl StepDraw {
    /// The draw of a pass over rows `row ..` of a global batch of `rows`.
    pub fn rows(self, row: usize, rows: usize) -> Draw {
        let StepDraw {
            p,
            seed,
            step,
            micro,
        } = self;
        Draw {
            p,
            seed,
            step,
            micro,
            row,
            rows,
        }
    }
}

/// The dropout of one training forward pass: its probability and key, and where the pass's
/// rows sit in the micro-step's global batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Draw {
    /// Drop probability of every site, in [0, 1).
    pub p: f64,
    /// The run's seed.
    pub seed: u64,
    /// Optimizer step.
    pub step: u64,
    /// Micro-step of the optimizer step (gradient accumulation).
    pub micro: u32,
    /// First row of this pass in the global batch.
    pub row: usize,
    /// Rows of the global batch.
    pub rows: usize,
}

impl Draw {
    /// The same draw for a pass whose rows start `offset` rows further (a pipeline micro-batch).
    pub fn at_rows(self, offset: usize) -> Draw {
        Draw {
            row: self.row + offset,
            ..self
        }
    }

    /// Whether this draw drops anything.
    pub fn active(d: Option<&Draw>) -> Option<&Draw> {
        d.filter(|d| d.p > 0.0)
    }

    fn key(&self, layer: usize, site: Site) -> Result<MaskKey> {
        MaskKey::new(self.seed, self.step, self.micro, layer as u32, site)
            .map_err(candle_core::Error::wrap)
    }

    /// The mask of an activation (B, T, c) of this pass at `site` of `layer`, its positions
    /// `positions.0 ..` of a sequence of `positions.1`.
    pub fn activation(
        &self,
        layer: usize,
        site: Site,
        positions: (usize, usize),
        c: usize,
    ) -> Result<Mask> {
        Ok(Mask {
            key: self.key(layer, site)?,
            p: self.p,
            place: Place {
                global: [self.rows, positions.1, c],
                offset: [self.row, positions.0, 0],
            },
        })
    }

    /// The mask of an activation (B, T_r, c) of this pass at `site` of `layer`, its rows at
    /// `positions`.
    pub fn rows_mask(
        &self,
        layer: usize,
        site: Site,
        positions: &Positions,
        c: usize,
    ) -> Result<RowMask> {
        let runs = positions
            .runs
            .iter()
            .map(|&(first, n)| Ok((self.activation(layer, site, (first, positions.t), c)?, n)))
            .collect::<Result<_>>()?;
        Ok(RowMask { runs })
    }

    /// The mask of the attention probabilities (b, h, T, T) of `layer`, heads `heads.0 ..` of
    /// the layer's `heads.1`.
    pub fn probs(&self, layer: usize, heads: (usize, usize), t: usize) -> Result<Mask> {
        Ok(Mask {
            key: self.key(layer, Site::Attention)?,
            p: self.p,
            place: Place {
                global: [self.rows, heads.1, t * t],
                offset: [self.row, heads.0, 0],
            },
        })
    }
}

/// `x ∘ mask` recorded by autograd (x (B, T, C)): the mask as a tensor (the kernel applied to
/// ones), multiplied in f32.
pub fn recorded(x: &Tensor, mask: &RowMask) -> Result<Tensor> {
    let ones = Tensor::ones(x.dims3()?, DType::F32, x.device())?;
    let m = mask.apply(&ones)?; // (B, T, C) f32
    x.to_dtype(DType::F32)?.mul(&m)?.to_dtype(x.dtype())
}

/// `x ∘ mask` recording no graph, for x (N, C) of `b` sequences.
pub fn rows(x: &Tensor, b: usize, mask: &RowMask) -> Result<Tensor> {
    let (n, c) = x.dims2()?;
    mask.apply(&x.reshape((b, n / b, c))?)?.reshape((n, c))
}

/// A tape whose output is its inner tape's output dropped (the embedding site, dense or
/// vocab-parallel): the backward drops the gradient by the same mask, drawn again, and hands
/// it to the inner backward.
pub struct Dropped {
    inner: Box<dyn Tape>,
    mask: RowMask,
    out: Tensor,
}

impl Dropped {
    /// `inner`'s output (B, T, C) times `mask`; None where `mask` drops nothing.
    pub fn wrap(inner: Box<dyn Tape>, mask: Option<RowMask>) -> Result<Box<dyn Tape>> {
        let Some(mask) = mask.filter(|m| m.p() > 0.0) else {
            return Ok(inner);
        };
        let out = mask.apply(inner.output())?;
        Ok(Box::new(Dropped { inner, mask, out }))
    }
}

impl Tape for Dropped {
    fn output(&self) -> &Tensor {
        &self.out
    }

    fn backward(self: Box<Self>, grad_out: Option<&Tensor>, loss_scale: f64) -> Result<TapeGrads> {
        let g = grad_out
            .map(|g| self.mask.apply(&g.contiguous()?))
            .transpose()?;
        self.inner.backward(g.as_ref(), loss_scale)
    }
}

/// The embedding site's mask of an output (B, T_r, c) at `positions` under `draw` (None: no
/// dropout).
pub fn embedding_mask(
    draw: Option<&Draw>,
    positions: &Positions,
    c: usize,
) -> Result<Option<RowMask>> {
    Draw::active(draw)
        .map(|d| d.rows_mask(0, Site::Embedding, positions, c))
        .transpose()
}

/// The masks of a block's two residual branches (attention's output projection and the
/// feed-forward output), for its rows (B, T_r, c) at `positions` under a draw; none without
/// one.
pub struct BlockMasks {
    pub attn: Option<RowMask>,
    pub mlp: Option<RowMask>,
}

impl BlockMasks {
    pub fn new(
        draw: Option<&Draw>,
        layer: usize,
        positions: &Positions,
        c: usize,
    ) -> Result<Self> {
        let mask = |site| {
            Draw::active(draw)
                .map(|d| d.rows_mask(layer, site, positions, c))
                .transpose()
        };
        Ok(Self {
            attn: mask(Site::AttentionResidual)?,
            mlp: mask(Site::MlpResidual)?,
        })
    }

    /// The attention branch a (B, T, C), dropped (recorded by autograd).
    pub fn attn(&self, a: &Tensor) -> Result<Tensor> {
        Self::drop(a, &self.attn)
    }

    /// The feed-forward branch (B, T, C), dropped (recorded by autograd).
    pub fn mlp(&self, m: &Tensor) -> Result<Tensor> {
        Self::drop(m, &self.mlp)
    }

    fn drop(x: &Tensor, m: &Option<RowMask>) -> Result<Tensor> {
        match m {
            Some(m) => recorded(x, m),
            None => Ok(x.clone()),
        }
    }
}
