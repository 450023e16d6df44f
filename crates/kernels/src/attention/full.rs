//! Attention of a block of queries to a block of keys that all precede them: no mask, the
//! same statistic lse2 as the causal kernels, so that partial outputs over different key
//! blocks merge (ring attention's off-diagonal blocks, `parallel/src/context_parallel/`).
//!
//! ```text
//!   s = q kᵀ · scale (B, H, Tq, Tk)      lse = ln Σ_k e^s      P = e^(s − lse)      y = P v
//!   backward, from the merged y, dy and lse of the whole row (Dao et al. 2022, Algorithm 2):
//!   δ = rowsum(dy ∘ y)      dS = P ∘ (dy vᵀ − δ)      dq = scale · dS k      dk = scale · dSᵀ q
//!   dv = Pᵀ dy
//! ```
//!
//! Candle ops on whatever device the tensors live, products in f32, the (Tq, Tk) scores
//! materialised. Legend: `B` batch, `H` heads, `Tq` query rows, `Tk` key rows, `D` head size.

use candle_core::{Result, Tensor, D};

use super::logsumexp;
use crate::plain::upcast;

/// Scores q kᵀ · scale (B, H, Tq, Tk) in f32.
fn scores(q: &Tensor, k: &Tensor, scale: f64) -> Result<Tensor> {
    upcast(q)?.matmul(&upcast(k)?.t()?)? * scale
}

/// Unmasked attention of q (B, H, Tq, D) to k, v (B, H, Tk, D): the output (B, H, Tq, D) in
/// f32 and lse2 (B, H, Tq) f32, log₂ of each row's softmax denominator.
pub fn full_forward(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<(Tensor, Tensor)> {
    let s = scores(q, k, scale)?; // (B, H, Tq, Tk)
    let lse = logsumexp(&s)?; // (B, H, Tq)
    let p = s.broadcast_sub(&lse.unsqueeze(D::Minus1)?)?.exp()?; // (B, H, Tq, Tk)
    let y = p.matmul(&upcast(v)?)?; // (B, H, Tq, D)
    Ok((y, (lse * std::f64::consts::LOG2_E)?))
}

/// The gradients (dq, dk, dv) in f32 of [`full_forward`]'s block, where `y`, `dy` (B, H, Tq, D)
/// and `lse2` (B, H, Tq) are the whole rows' (every key block merged): the block's share of
/// dq, and its keys' dk and dv.
pub fn full_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    y: &Tensor,
    dy: &Tensor,
    lse2: &Tensor,
    scale: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let lse = (lse2 * std::f64::consts::LN_2)?.unsqueeze(D::Minus1)?; // (B, H, Tq, 1)
    let p = scores(q, k, scale)?.broadcast_sub(&lse)?.exp()?; // (B, H, Tq, Tk)
    let (qf, kf, vf, dyf) = (upcast(q)?, upcast(k)?, upcast(v)?, upcast(dy)?);
    let delta = (&dyf * upcast(y)?)?.sum_keepdim(D::Minus1)?; // (B, H, Tq, 1)
    let dp = dyf.matmul(&vf.t()?)?; // (B, H, Tq, Tk)
    let ds = (&p * dp.broadcast_sub(&delta)?)?; // (B, H, Tq, Tk)
    let dq = (ds.matmul(&kf)? * scale)?; // (B, H, Tq, D)
    let dk = (ds.t()?.matmul(&qf)? * scale)?; // (B, H, Tk, D)
    let dv = p.t()?.matmul(&dyf)?; // (B, H, Tk, D)
    Ok((dq, dk, dv))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// Queries after every key see them all: the causal attention of [keys | queries] gives
    /// the query rows the same output, and its gradients the same dq, dk, dv.
    #[test]
    fn full_block_is_the_causal_attention_of_later_queries() -> Result<()> {
        let dev = Device::Cpu;
        let (b, h, tk, tq, d) = (2, 3, 5, 4, 8);
        let t = tk + tq;
        let qkv = Tensor::randn(0f32, 1.0, (3, b, h, t, d), &dev)?;
        let scale = 0.3;
        let (y, lse2) = crate::attention::forward(&qkv, scale, None)?;
        let lse2 = lse2.reshape((b, h, t))?;
        let part = |i: usize, from: usize, n: usize| qkv.get(i)?.narrow(2, from, n);
        // Only the rows whose keys are all in [0, tk) are a full block: row tk-1 sees 0..tk.
        let (q, k, v) = (part(0, tk - 1, 1)?, part(1, 0, tk)?, part(2, 0, tk)?);
        let (yb, lb) = full_forward(&q, &k, &v, scale)?;
        let close = |a: &Tensor, b: &Tensor| -> Result<f32> {
            (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
        };
        assert!(close(&yb, &y.narrow(2, tk - 1, 1)?)? < 1e-5);
        assert!(close(&lb, &lse2.narrow(2, tk - 1, 1)?)? < 1e-5);
        // The gradient of one full row against the causal backward with only that row's dy.
        let dy_row = Tensor::randn(0f32, 1.0, (b, h, 1, d), &dev)?;
        let dy = Tensor::zeros((b, h, t, d), DType::F32, &dev)?
            .slice_assign(&[0..b, 0..h, tk - 1..tk, 0..d], &dy_row)?;
        let g = crate::attention::backward(&qkv, &y, &dy, &lse2, scale, None)?; // (3, B, H, T, D)
        let yr = y.narrow(2, tk - 1, 1)?;
        let lr = lse2.narrow(2, tk - 1, 1)?;
        let (dq, dk, dv) = full_backward(&q, &k, &v, &yr, &dy_row, &lr, scale)?;
        assert!(close(&dq, &g.get(0)?.narrow(2, tk - 1, 1)?)? < 1e-5);
        assert!(close(&dk, &g.get(1)?.narrow(2, 0, tk)?)? < 1e-5);
        assert!(close(&dv, &g.get(2)?.narrow(2, 0, tk)?)? < 1e-5);
        Ok(())
    }
}
