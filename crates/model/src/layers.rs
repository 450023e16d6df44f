//! The swappable layers a transformer block is built from.
//!
//! Tensor and expert parallelism replace layers, not blocks: a [`Block`](crate::gpt::Block) holds
//! `Box<dyn Linear>` and `Box<dyn FeedForward>`, so a column- or row-sharded linear or an
//! expert-parallel MoE slots in without copying the block's code.
//!
//! Legend: `B` batch, `T` time, `C` width, `H` heads computed by this module, `D` head size,
//! `N` flattened tokens. Linear weights are `(out, in)`: `y = x Wᵀ + b`.

use std::sync::Arc;

use candle_core::{Result, Tensor};

use crate::config::MoeConfig;
use crate::moe::stats::MoeStats;
use crate::param::Param;
use crate::explicit::DenseTape;
use crate::tape::{Exchange, TapedLinear};

/// `x Wᵀ (+ b)` for `x` of shape (..., in), flattening leading dimensions for one matmul.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let (lead, inp) = dims.split_at(dims.len().saturating_sub(1));
    let (out_f, in_f) = weight.dims2()?;
    if inp != [in_f] {
        return Err(candle_core::Error::Msg(format!(
            "linear: input {:?} does not end in the weight's in_features {in_f} (weight ({out_f}, {in_f}))",
            dims
        )));
    }
    let n: usize = lead.iter().product();
    let y = x.reshape((n, in_f))?.matmul(&weight.t()?)?; // (N, out)
    let y = match bias {
        Some(b) => mtrain_kernels::bias_add(&y, b)?,
        None => y,
    };
    let mut out_dims = lead.to_vec();
    out_dims.push(out_f);
    y.reshape(out_dims) // (..., out)
}

/// A layer mapping (..., in) to (..., out); dense here, sharded in `tensor_parallel`.
pub trait Linear: Send + Sync {
    fn forward(&self, x: &Tensor) -> Result<Tensor>;
    fn params(&self) -> Vec<Param>;
    /// The layer as the hand-written backward ([`crate::explicit`]) runs it, for an input like
    /// `x`; None where it has no hand-written backward (another dtype, no bias).
    fn taped(&self, x: &Tensor) -> Option<Box<dyn TapedLinear>> {
        let _ = x;
        None
    }
}

/// A linear layer's parameters, in the order every [`Linear::params`] gives them: the weight,
/// then the bias.
pub fn weight_and_bias(weight: &Param, bias: Option<&Param>) -> Vec<Param> {
    std::iter::once(weight.clone())
        .chain(bias.cloned())
        .collect()
}

/// The ordinary fully connected layer `y = x Wᵀ + b`.
pub struct DenseLinear {
    /// (out, in)
    pub weight: Param,
    /// (out,)
    pub bias: Option<Param>,
}

impl DenseLinear {
    pub fn new(weight: Param, bias: Option<Param>) -> Self {
        Self { weight, bias }
    }
}

impl Linear for DenseLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let b = self.bias.as_ref().map(|b| b.tensor());
        linear(x, &self.weight.tensor(), b.as_ref())
    }

    fn params(&self) -> Vec<Param> {
        weight_and_bias(&self.weight, self.bias.as_ref())
    }

    fn taped(&self, x: &Tensor) -> Option<Box<dyn TapedLinear>> {
        let tape = DenseTape::of(&self.weight, self.bias.as_ref()?, x)?;
        Some(Box::new(tape))
    }
}

/// LayerNorm over the last dimension: `(x − mean) / √(var + eps) · weight + bias`
/// (biased variance, as `torch.nn.LayerNorm`), in f32 for 16-bit inputs.
pub struct LayerNorm {
    /// (C,)
    pub weight: Param,
    /// (C,)
    pub bias: Param,
    pub eps: f64,
}

impl LayerNorm {
    /// GPT-2's eps is 1e-5.
    pub fn new(weight: Param, bias: Param) -> Self {
        Self {
            weight,
            bias,
            eps: 1e-5,
        }
    }

    /// x (..., C) normalised ([`mtrain_kernels::layer_norm`]).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        mtrain_kernels::layer_norm(x, &self.weight.tensor(), &self.bias.tensor(), self.eps)
    }

    pub fn params(&self) -> Vec<Param> {
        vec![self.weight.clone(), self.bias.clone()]
    }
}

/// What a feed-forward layer returns: its output, and for a mixture of experts the auxiliary loss
/// (already multiplied by its coefficient) and routing statistics.
pub struct FfnOut {
    pub out: Tensor,
    pub aux_loss: Option<Tensor>,
    pub stats: Option<MoeStats>,
}

/// The position-wise half of a block: an MLP, or a mixture of experts.
pub trait FeedForward: Send + Sync {
    fn forward(&self, x: &Tensor) -> Result<FfnOut>;
    fn params(&self) -> Vec<Param>;
    /// This layer as the dense MLP, when it is one.
    fn as_mlp(&self) -> Option<&Mlp> {
        None
    }
    /// This layer as a mixture of experts taken apart for the hand-written backward
    /// ([`crate::explicit`]), when it is one.
    fn moe_parts(&self) -> Option<MoeParts<'_>> {
        None
    }
}

/// A mixture of experts ([`crate::moe`]) taken apart for a tape ([`crate::explicit`]): the
/// router, the experts this rank holds and, under expert parallelism, the all-to-alls that
/// carry rows to them and back.
pub struct MoeParts<'a> {
    /// (E, C)
    pub router: &'a Param,
    /// The `E / ranks` experts this rank holds, in global expert order.
    pub experts: &'a [Mlp],
    pub cfg: &'a MoeConfig,
    /// The expert-parallel group's row exchange; None: every expert is here.
    pub exchange: Option<Arc<dyn Exchange>>,
}

/// GPT-2's MLP: `c_proj(gelu(c_fc(x)))`, GELU with the tanh approximation.
pub struct Mlp {
    /// C -> 4C
    pub c_fc: Box<dyn Linear>,
    /// 4C -> C
    pub c_proj: Box<dyn Linear>,
}

impl Mlp {
    pub fn new(c_fc: Box<dyn Linear>, c_proj: Box<dyn Linear>) -> Self {
        Self { c_fc, c_proj }
    }

    /// The MLP as a plain function (..., C) -> (..., C).
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let h = mtrain_kernels::gelu(&self.c_fc.forward(x)?)?; // (..., 4C)
        self.c_proj.forward(&h) // (..., C)
    }
}

impl FeedForward for Mlp {
    fn forward(&self, x: &Tensor) -> Result<FfnOut> {
        Ok(FfnOut {
            out: self.apply(x)?,
            aux_loss: None,
            stats: None,
        })
    }

    fn params(&self) -> Vec<Param> {
        let mut p = self.c_fc.params();
        p.extend(self.c_proj.params());
        p
    }

    fn as_mlp(&self) -> Option<&Mlp> {
        Some(self)
    }
}

/// Multi-head causal self-attention.
///
/// `n_head` is the number of heads this module computes. Under tensor parallelism `c_attn` is
/// column-sharded so its output is `[q_local | k_local | v_local]` for `n_head / tp` heads, and
/// `c_proj` is row-sharded; the code below is the same in both cases.
pub struct CausalSelfAttention {
    /// C -> 3·H·D, output laid out q | k | v
    pub c_attn: Box<dyn Linear>,
    /// H·D -> C
    pub c_proj: Box<dyn Linear>,
    pub n_head: usize,
    pub head_dim: usize,
    /// The layer's index of this module's first head (its first head under tensor parallelism).
    pub head0: usize,
    /// Heads of the whole layer (`n_head` unless sharded): with `head0`, where this module's
    /// attention probabilities sit in the layer's, for their dropout mask.
    pub heads_global: usize,
}

impl CausalSelfAttention {
    pub fn new(
        c_attn: Box<dyn Linear>,
        c_proj: Box<dyn Linear>,
        n_head: usize,
        head_dim: usize,
    ) -> Self {
        Self {
            c_attn,
            c_proj,
            n_head,
            head_dim,
            head0: 0,
            heads_global: n_head,
        }
    }

    /// This module as heads `head0 .. head0 + n_head` of a layer of `heads_global`.
    pub fn sharded_heads(self, head0: usize, heads_global: usize) -> Self {
        Self {
            head0,
            heads_global,
            ..self
        }
    }

    /// The dropout mask of this module's attention probabilities for a sequence of `t` in
    /// `layer`, under `draw`.
    pub fn probs_mask(
        &self,
        draw: Option<&crate::Draw>,
        layer: usize,
        t: usize,
    ) -> Result<Option<mtrain_kernels::dropout::Mask>> {
        crate::Draw::active(draw)
            .map(|d| d.probs(layer, (self.head0, self.heads_global), t))
            .transpose()
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_drawn(x, None, 0)
    }

    /// The forward with dropout on the probabilities under `draw` (none without one).
    pub fn forward_drawn(
        &self,
        x: &Tensor,
        draw: Option<&crate::Draw>,
        layer: usize,
    ) -> Result<Tensor> {
        let (h, d) = (self.n_head, self.head_dim);
        let qkv = self.c_attn.forward(x)?; // (B, T, 3·H·D)
        if qkv.dim(2)? != 3 * h * d {
            return Err(candle_core::Error::Msg(format!(
                "attention: c_attn gives {} features, expected 3 * n_head {h} * head_dim {d} = {}",
                qkv.dim(2)?,
                3 * h * d
            )));
        }
        let scale = 1.0 / (d as f64).sqrt();
        let qkv = mtrain_kernels::split_heads(&qkv, 3, h)?; // (3, B, H, T, D)
        let mask = self.probs_mask(draw, layer, x.dim(1)?)?;
        let y = mtrain_kernels::causal_attention(&qkv, scale, mask.as_ref())?; // (B, H, T, D)
        let y = mtrain_kernels::merge_heads(&y.unsqueeze(0)?)?; // (B, T, H·D)
        self.c_proj.forward(&y) // (B, T, C)
    }

    pub fn params(&self) -> Vec<Param> {
        let mut p = self.c_attn.params();
        p.extend(self.c_proj.params());
        p
    }
}
