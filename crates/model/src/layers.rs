//! The swappable layers a transformer block is built from.
//!
//! Tensor and expert parallelism replace layers, not blocks: a [`Block`](crate::gpt::Block) holds
//! `Box<dyn Linear>` and `Box<dyn FeedForward>`, so a column- or row-sharded linear or an
//! expert-parallel MoE slots in without copying the block's code.
//!
//! Legend: `B` batch, `T` time, `C` width, `H` heads computed by this module, `D` head size,
//! `N` flattened tokens. Linear weights are `(out, in)`: `y = x Wᵀ + b`.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::{DType, Device, Result, Tensor, D};

use crate::kernels;

use crate::moe::MoeStats;
use crate::param::Param;

/// Computes in f32 when the input is a 16-bit float (softmax, LayerNorm and loss statistics).
pub(crate) fn upcast(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::BF16 | DType::F16 => x.to_dtype(DType::F32),
        _ => Ok(x.clone()),
    }
}

/// Numerically stable softmax over the last dimension, from differentiable ops.
/// The subtracted row maximum is detached: it cancels in the result, so it carries no gradient.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// Log-softmax over the last dimension: `x - max - ln Σ exp(x - max)`.
pub fn log_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    shifted.broadcast_sub(&lse)
}

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
        Some(b) if kernels::bias::supported(&y, b) => kernels::bias_add(&y, b)?,
        Some(b) => y.broadcast_add(b)?,
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
    /// This layer as the ordinary dense layer, when it is one (the hand-written backward of
    /// [`crate::explicit`] covers only dense layers).
    fn as_dense(&self) -> Option<&DenseLinear> {
        None
    }
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
        std::iter::once(self.weight.clone())
            .chain(self.bias.clone())
            .collect()
    }

    fn as_dense(&self) -> Option<&DenseLinear> {
        Some(self)
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

    /// The fused kernel on CUDA ([`kernels::layer_norm`]), else [`layer_norm_plain`].
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (w, b) = (self.weight.tensor(), self.bias.tensor());
        if kernels::layer_norm::supported(x, &w, &b) {
            kernels::layer_norm(x, &w, &b, self.eps)
        } else {
            layer_norm_plain(x, &w, &b, self.eps)
        }
    }

    pub fn params(&self) -> Vec<Param> {
        vec![self.weight.clone(), self.bias.clone()]
    }
}

/// LayerNorm from plain candle ops, in f32 for 16-bit inputs: the path on CPU and the reference
/// for the fused kernel. x (..., C), w and b (C,); returns x's shape and dtype.
pub fn layer_norm_plain(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(layer_norm_parts(x, w, b, eps)?.0)
}

/// [`layer_norm_plain`] with the statistics it computed: y, the row means and the row standard
/// deviations √(var + eps), both (..., 1) in f32 (or x's dtype when wider).
pub(crate) fn layer_norm_parts(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dtype = x.dtype();
    let x = upcast(x)?;
    let mean = x.mean_keepdim(D::Minus1)?; // (..., 1)
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?; // (..., 1)
    let std = (var + eps)?.sqrt()?; // (..., 1)
    let xn = xc.broadcast_div(&std)?;
    let w = w.to_dtype(xn.dtype())?;
    let b = b.to_dtype(xn.dtype())?;
    let y = xn.broadcast_mul(&w)?.broadcast_add(&b)?.to_dtype(dtype)?;
    Ok((y, mean, std))
}

/// GELU (tanh approximation): the fused kernel on CUDA ([`kernels::gelu`]), else candle's.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if kernels::gelu::supported(x) {
        kernels::gelu(x)
    } else {
        x.gelu()
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
        let h = gelu(&self.c_fc.forward(x)?)?; // (..., 4C)
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

/// (T, T) additive causal mask: 0 on and below the diagonal, −∞ above. Built once per
/// (T, dtype, device) and cached, so a forward pass neither builds it on the host nor copies it.
pub fn causal_mask(t: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    type Key = (usize, DType, String);
    static CACHE: OnceLock<Mutex<HashMap<Key, Tensor>>> = OnceLock::new();
    let key = (t, dtype, format!("{:?}", device.location()));
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(m) = cache.lock().ok().and_then(|c| c.get(&key).cloned()) {
        return Ok(m);
    }
    let data: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    let mask = Tensor::from_vec(data, (t, t), device)?.to_dtype(dtype)?;
    if let Ok(mut c) = cache.lock() {
        c.insert(key, mask.clone());
    }
    Ok(mask)
}

/// Causal attention from plain candle ops: `softmax(q kᵀ · scale + mask) v` with the scores
/// (B, H, T, T) materialised and the softmax in f32. The reference for the fused kernel, and
/// the path on CPU. q, k, v: (B, H, T, D).
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let t = q.dim(2)?;
    // Scaling q (B, H, T, D) is cheaper than scaling the scores (B, H, T, T).
    let att = (q * scale)?.matmul(&k.t()?)?; // (B, H, T, T)
    let att = upcast(&att)?;
    let att = att.broadcast_add(&causal_mask(t, att.dtype(), att.device())?)?;
    let att = softmax_last_dim(&att)?.to_dtype(v.dtype())?; // (B, H, T, T)
    att.matmul(v) // (B, H, T, D)
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
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, _c) = x.dims3()?;
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
        if kernels::flash_attention::supported(&qkv, d) && kernels::heads::supported(&qkv) {
            // One permutation kernel each way instead of three strided copies (and, backward,
            // three zero-padded (B, T, 3·H·D) gradients summed); see kernels::heads.
            let qkv = kernels::split_heads(&qkv, 3, h)?; // (3, B, H, T, D)
            let y = kernels::flash_attention_packed(&qkv, scale)?; // (B, H, T, D)
            let y = kernels::merge_heads(&y.unsqueeze(0)?)?; // (B, T, H·D)
            return self.c_proj.forward(&y); // (B, T, C)
        }
        let heads = |i: usize| -> Result<Tensor> {
            qkv.narrow(2, i * h * d, h * d)? // (B, T, H·D)
                .reshape((b, t, h, d))? // (B, T, H, D)
                .transpose(1, 2)? // (B, H, T, D)
                .contiguous()
        };
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let y = if kernels::flash_attention::supported(&q, d) {
            kernels::flash_attention(&q, &k, &v, scale)? // (B, H, T, D), no (T, T) scores
        } else {
            causal_attention(&q, &k, &v, scale)? // (B, H, T, D)
        };
        let y = y.transpose(1, 2)?.reshape((b, t, h * d))?; // (B, T, H·D)
        self.c_proj.forward(&y) // (B, T, C)
    }

    pub fn params(&self) -> Vec<Param> {
        let mut p = self.c_attn.params();
        p.extend(self.c_proj.params());
        p
    }
}
