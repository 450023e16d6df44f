//! The graph-free operations the hand-written backward passes ([`crate::explicit`]) are written
//! in: the fused CUDA kernels on a GPU, and the same functions in plain candle ops on CPU, where
//! the tapes run only when asked ([`crate::explicit::set_cpu`]) so that CI can check their
//! backward wiring against autograd without a GPU.
//!
//! Every function takes and returns detached tensors. Legend as in `explicit`: `N` rows, `C`
//! width, `S` packed parts, `B` batch, `H` heads, `T` time, `D` head size, `V` vocabulary.

use candle_core::{DType, Result, Tensor, Var, D};

use crate::kernels;
use crate::layers::{
    causal_attention, gelu as plain_gelu, layer_norm_parts, log_softmax_last_dim, upcast,
};

fn on_gpu(x: &Tensor) -> bool {
    x.device().is_cuda()
}

/// LayerNorm of x (N, C): y and the per-row statistics mean, rstd (N,) in f32.
pub fn layer_norm_fwd(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    if on_gpu(x) {
        return kernels::layer_norm::forward_saved(x, w, b, eps);
    }
    let (y, mean, std) = layer_norm_parts(x, w, b, eps)?; // statistics (N, 1)
    Ok((
        y,
        mean.squeeze(D::Minus1)?,
        std.recip()?.squeeze(D::Minus1)?,
    ))
}

/// (dx, dw, db) of LayerNorm from x, w, dy and the forward's statistics.
pub fn layer_norm_bwd(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    if on_gpu(x) {
        return kernels::layer_norm::backward(x, w, dy, mean, rstd);
    }
    let (mean, rstd) = (mean.unsqueeze(D::Minus1)?, rstd.unsqueeze(D::Minus1)?); // (N, 1)
    let xhat = upcast(x)?.broadcast_sub(&mean)?.broadcast_mul(&rstd)?; // (N, C)
    let dyf = upcast(dy)?;
    let dw = (&dyf * &xhat)?.sum(0)?.to_dtype(w.dtype())?; // (C,)
    let db = dyf.sum(0)?.to_dtype(w.dtype())?; // (C,)
                                               // dx = rstd · (dŷ − mean(dŷ) − x̂ · mean(dŷ · x̂)) with dŷ = dy · w
    let dyw = dyf.broadcast_mul(&upcast(w)?)?;
    let m1 = dyw.mean_keepdim(D::Minus1)?;
    let m2 = (&dyw * &xhat)?.mean_keepdim(D::Minus1)?;
    let dx = dyw
        .broadcast_sub(&m1)?
        .sub(&xhat.broadcast_mul(&m2)?)?
        .broadcast_mul(&rstd)?
        .to_dtype(x.dtype())?;
    Ok((dx, dw, db))
}

/// x + b for x (N, C), b (C,).
pub fn bias_add(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    if on_gpu(x) {
        return kernels::bias_add(x, b);
    }
    x.broadcast_add(b)
}

/// r + (x + b) for r, x (N, C), b (C,).
pub fn bias_residual_add(r: &Tensor, x: &Tensor, b: &Tensor) -> Result<Tensor> {
    if on_gpu(x) {
        return kernels::bias::bias_residual_add(r, x, b);
    }
    r + x.broadcast_add(b)?
}

/// Σ over the rows of dy (N, C), in b's dtype.
pub fn bias_grad(dy: &Tensor, b: &Tensor) -> Result<Tensor> {
    if on_gpu(dy) {
        return kernels::bias::bias_grad(dy, b);
    }
    upcast(dy)?.sum(0)?.to_dtype(b.dtype())
}

/// GELU (tanh approximation).
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if on_gpu(x) {
        return kernels::gelu(x);
    }
    plain_gelu(x)
}

/// dx of GELU at x for the output gradient dy.
pub fn gelu_bwd(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    if on_gpu(x) {
        return kernels::gelu::backward(x, dy);
    }
    // d/dx [x/2 (1 + tanh u)], u = k (x + a x³): (1 + th)/2 + x/2 (1 − th²) k (1 + 3a x²)
    let (k, a) = ((2.0 / std::f64::consts::PI).sqrt(), 0.044715);
    let xf = upcast(x)?;
    let x2 = xf.sqr()?;
    let th = ((&xf + (&xf * &x2)?.affine(a, 0.0)?)?.affine(k, 0.0)?).tanh()?;
    let left = th.affine(0.5, 0.5)?;
    let right = (&xf * th.sqr()?.affine(-1.0, 1.0)?)?
        .affine(0.5 * k, 0.0)?
        .mul(&x2.affine(3.0 * a, 1.0)?)?;
    ((left + right)? * upcast(dy)?)?.to_dtype(x.dtype())
}

/// (B, T, S·H·D) -> (S, B, H, T, D).
pub fn split_heads(x: &Tensor, s: usize, h: usize) -> Result<Tensor> {
    if on_gpu(x) {
        return kernels::split_heads(x, s, h);
    }
    let (b, t, f) = x.dims3()?;
    let d = f / (s * h);
    x.reshape((b, t, s, h, d))?
        .permute((2, 0, 3, 1, 4))?
        .contiguous()
}

/// (S, B, H, T, D) -> (B, T, S·H·D).
pub fn merge_heads(x: &Tensor) -> Result<Tensor> {
    if on_gpu(x) {
        return kernels::merge_heads(x);
    }
    let (s, b, h, t, d) = x.dims5()?;
    x.permute((1, 3, 0, 2, 4))?
        .contiguous()?
        .reshape((b, t, s * h * d))
}

/// Causal attention of packed qkv (3, B, H, T, D): the output (B, H, T, D) and what the backward
/// needs besides (the log-sum-exp on a GPU; on CPU the backward recomputes, and this is empty).
pub fn attention_fwd(qkv: &Tensor, scale: f64) -> Result<(Tensor, Tensor)> {
    if on_gpu(qkv) {
        return kernels::flash_attention::packed_forward_saved(qkv, scale);
    }
    let y = causal_attention(&qkv.get(0)?, &qkv.get(1)?, &qkv.get(2)?, scale)?;
    Ok((y, Tensor::zeros(0, DType::F32, qkv.device())?))
}

/// The gradient (3, B, H, T, D) of packed causal attention for the output gradient dy.
pub fn attention_bwd(
    qkv: &Tensor,
    y: &Tensor,
    dy: &Tensor,
    lse: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    if on_gpu(qkv) {
        return kernels::flash_attention::packed_backward(qkv, y, dy, lse, scale);
    }
    let vars = (0..3)
        .map(|i| Var::from_tensor(&qkv.get(i)?))
        .collect::<Result<Vec<_>>>()?;
    let out = causal_attention(
        vars[0].as_tensor(),
        vars[1].as_tensor(),
        vars[2].as_tensor(),
        scale,
    )?;
    let grads = (out * dy)?.sum_all()?.backward()?;
    let parts = vars
        .iter()
        .map(|v| {
            grads
                .get(v.as_tensor())
                .cloned()
                .map_or_else(|| v.as_tensor().zeros_like(), Ok)
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::stack(&parts, 0)
}

/// Per-row cross-entropy (N,) f32 of logits (N, V) against u32 targets (N,), and the per-row
/// log-sum-exp the backward needs.
pub fn cross_entropy_fwd(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    if on_gpu(logits) {
        return kernels::cross_entropy::rows_forward_saved(logits, targets);
    }
    let lf = upcast(logits)?;
    let logp = log_softmax_last_dim(&lf)?; // (N, V)
    let picked = logp.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)?; // (N,)
    let lse = (lf.narrow(1, 0, 1)?.squeeze(1)? - logp.narrow(1, 0, 1)?.squeeze(1)?)?; // (N,)
    Ok((picked.neg()?, lse))
}

/// dlogits (N, V) = (softmax − onehot) · g for per-row gradients g (N,) f32.
pub fn cross_entropy_bwd(
    logits: &Tensor,
    targets: &Tensor,
    lse: &Tensor,
    g: &Tensor,
) -> Result<Tensor> {
    if on_gpu(logits) {
        return kernels::cross_entropy::backward(logits, targets, lse, g);
    }
    let (n, v) = logits.dims2()?;
    let p = upcast(logits)?.broadcast_sub(&lse.unsqueeze(1)?)?.exp()?; // softmax (N, V)
    let ids: Vec<u32> = targets.to_vec1::<u32>()?;
    let mut onehot = vec![0f32; n * v];
    for (row, &id) in ids.iter().enumerate() {
        if (id as usize) < v {
            onehot[row * v + id as usize] = 1.0;
        }
    }
    let onehot = Tensor::from_vec(onehot, (n, v), logits.device())?;
    (p - onehot)?
        .broadcast_mul(&g.unsqueeze(1)?)?
        .to_dtype(logits.dtype())
}

/// Rows `idx` (N,) of the table (V, C); the ids are checked.
pub fn embedding(wte: &Tensor, idx: &Tensor) -> Result<Tensor> {
    kernels::embedding(wte, idx)
}

/// The table gradient (V, C) of rows `idx` for dy (N, C); the ids were checked by the forward.
pub fn embedding_grad(idx: &Tensor, dy: &Tensor, vocab: usize) -> Result<Tensor> {
    kernels::embedding::grad(idx, dy, vocab, false)
}
