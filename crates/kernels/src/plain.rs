//! The plain versions of the ops: candle ops only, differentiable by autograd, on any device.
//! They are what an op runs where no fused kernel applies (on CPU above all), and the reference
//! every kernel and every hand-written backward is tested against.
//!
//! Legend: `B` batch, `H` heads, `T` time, `D` head size, `C` width, `N` rows, `V` vocabulary.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::{DType, Device, Result, Tensor, D};

use crate::msg;

/// Computes in f32 when the input is a 16-bit float (softmax, LayerNorm and loss statistics).
pub fn upcast(x: &Tensor) -> Result<Tensor> {
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

/// LayerNorm over the last dimension, `(x − mean) / √(var + eps) · w + b` (biased variance, as
/// `torch.nn.LayerNorm`), in f32 for 16-bit inputs. x (..., C), w and b (C,); returns x's
/// shape and dtype.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(layer_norm_parts(x, w, b, eps)?.0)
}

/// [`layer_norm`] with the statistics it computed: y, the row means and the row standard
/// deviations √(var + eps), both (..., 1) in f32 (or x's dtype when wider).
pub fn layer_norm_parts(
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

/// GELU with the tanh approximation (candle's `Tensor::gelu`).
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    x.gelu()
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

/// The causal attention scores `q kᵀ · scale + mask` (B, H, T, T) in f32 for q, k (B, H, T, D).
pub fn causal_scores(q: &Tensor, k: &Tensor, scale: f64) -> Result<Tensor> {
    let t = q.dim(2)?;
    // Scaling q (B, H, T, D) is cheaper than scaling the scores (B, H, T, T).
    let att = upcast(&(q * scale)?.matmul(&k.t()?)?)?; // (B, H, T, T)
    att.broadcast_add(&causal_mask(t, att.dtype(), att.device())?)
}

/// Causal attention `softmax(q kᵀ · scale + mask) v` with the scores (B, H, T, T) materialised
/// and the softmax in f32. q, k, v: (B, H, T, D); returns (B, H, T, D).
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let att = softmax_last_dim(&causal_scores(q, k, scale)?)?.to_dtype(v.dtype())?; // (B, H, T, T)
    att.matmul(v) // (B, H, T, D)
}

/// Mean cross-entropy of logits (..., V) against u32 targets (...), log-softmax in f32.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let v = logits.dim(D::Minus1)?;
    let n = check_targets(logits, targets)?;
    let logp = log_softmax_last_dim(&upcast(&logits.reshape((n, v))?)?)?; // (N, V)
    let picked = logp.gather(&targets.reshape((n, 1))?.to_dtype(DType::U32)?, 1)?; // (N, 1)
    picked.mean_all()?.neg()
}

/// The number of rows N of logits (..., V) for targets (...), or an error naming both shapes.
pub(crate) fn check_targets(logits: &Tensor, targets: &Tensor) -> Result<usize> {
    let v = logits.dim(D::Minus1)?;
    let n = targets.elem_count();
    if logits.elem_count() != n * v {
        return Err(msg(format!(
            "cross_entropy: logits {:?} do not match targets {:?}",
            logits.dims(),
            targets.dims()
        )));
    }
    Ok(n)
}
