//! Attention of a block of queries to a block of keys, with the same statistic lse2 as the
//! causal kernels, so that partial outputs over different key blocks merge (ring attention's
//! blocks, `parallel/src/context_parallel/`): keys that all precede the queries (no mask), or
//! the queries' own positions (the causal diagonal); the probabilities times a dropout mask
//! where one is drawn ([`crate::dropout`]).
//!
//! ```text
//!   s = q kᵀ · scale (B, H, Tq, Tk)      lse = ln Σ_k e^s      P = e^(s − lse)      y = (P ∘ M) v
//!   backward, from the merged y, dy and lse of the whole row (Dao et al. 2022, Algorithm 2):
//!   δ = rowsum(dy ∘ y)      dS = P ∘ (dy vᵀ ∘ M − δ)      dq = scale · dS k      dk = scale · dSᵀ q
//!   dv = (P ∘ M)ᵀ dy
//! ```
//!
//! With the merged output y = Σ_blocks (P ∘ M) v over every key block, δ = rowsum(dy ∘ y) is
//! rowsum(P ∘ M ∘ dP) of the whole row, so each block's gradient needs only its own P and M.
//! Candle ops on whatever device the tensors live, products in f32, the (Tq, Tk) scores
//! materialised. Legend: `B` batch, `H` heads, `Tq` query rows, `Tk` key rows, `D` head size.

use candle_core::{Result, Tensor, D};

use super::logsumexp;
use crate::plain::{causal_mask, upcast};

/// How a block's probabilities are masked.
#[derive(Debug, Clone, Copy, Default)]
pub struct BlockMask<'a> {
    /// The keys are the queries' own positions, in order (Tq = Tk): the causal mask applies.
    pub causal: bool,
    /// The dropout mask of the block's probabilities (B, H, Tq, Tk) f32, where drawn.
    pub drop: Option<&'a Tensor>,
}

impl BlockMask<'_> {
    /// Scores q kᵀ · scale (B, H, Tq, Tk) in f32, −∞ above the diagonal when causal.
    fn scores(&self, q: &Tensor, k: &Tensor, scale: f64) -> Result<Tensor> {
        let s = (upcast(q)?.matmul(&upcast(k)?.t()?)? * scale)?;
        match self.causal {
            true => s.broadcast_add(&causal_mask(q.dim(2)?, s.dtype(), s.device())?),
            false => Ok(s),
        }
    }

    /// `x ∘ M` (B, H, Tq, Tk), x itself without a dropout mask.
    fn dropped(&self, x: &Tensor) -> Result<Tensor> {
        match self.drop {
            Some(m) => x * m,
            None => Ok(x.clone()),
        }
    }
}

/// Attention of q (B, H, Tq, D) to k, v (B, H, Tk, D) under `mask`: the output (B, H, Tq, D)
/// in f32 and lse2 (B, H, Tq) f32, log₂ of each row's softmax denominator (of the scores, the
/// dropout mask applying after the softmax).
pub fn full_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: BlockMask,
) -> Result<(Tensor, Tensor)> {
    let s = mask.scores(q, k, scale)?; // (B, H, Tq, Tk)
    let lse = logsumexp(&s)?; // (B, H, Tq)
    let p = s.broadcast_sub(&lse.unsqueeze(D::Minus1)?)?.exp()?; // (B, H, Tq, Tk)
    let y = mask.dropped(&p)?.matmul(&upcast(v)?)?; // (B, H, Tq, D)
    Ok((y, (lse * std::f64::consts::LOG2_E)?))
}

/// The gradients (dq, dk, dv) in f32 of [`full_forward`]'s block, where `y`, `dy` (B, H, Tq, D)
/// and `lse2` (B, H, Tq) are the whole rows' (every key block merged): the block's share of
/// dq, and its keys' dk and dv, under the forward's `mask`.
#[allow(clippy::too_many_arguments)]
pub fn full_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    y: &Tensor,
    dy: &Tensor,
    lse2: &Tensor,
    scale: f64,
    mask: BlockMask,
) -> Result<(Tensor, Tensor, Tensor)> {
    let lse = (lse2 * std::f64::consts::LN_2)?.unsqueeze(D::Minus1)?; // (B, H, Tq, 1)
    let p = mask.scores(q, k, scale)?.broadcast_sub(&lse)?.exp()?; // (B, H, Tq, Tk)
    let (qf, kf, vf, dyf) = (upcast(q)?, upcast(k)?, upcast(v)?, upcast(dy)?);
    let delta = (&dyf * upcast(y)?)?.sum_keepdim(D::Minus1)?; // (B, H, Tq, 1)
    let dp = mask.dropped(&dyf.matmul(&vf.t()?)?)?; // (B, H, Tq, Tk)
    let ds = (&p * dp.broadcast_sub(&delta)?)?; // (B, H, Tq, Tk)
    let dq = (ds.matmul(&kf)? * scale)?; // (B, H, Tq, D)
    let dk = (ds.t()?.matmul(&qf)? * scale)?; // (B, H, Tk, D)
    let dv = mask.dropped(&p)?.t()?.matmul(&dyf)?; // (B, H, Tk, D)
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
        let (yb, lb) = full_forward(&q, &k, &v, scale, BlockMask::default())?;
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
        let (dq, dk, dv) = full_backward(&q, &k, &v, &yr, &dy_row, &lr, scale, BlockMask::default())?;
        assert!(close(&dq, &g.get(0)?.narrow(2, tk - 1, 1)?)? < 1e-5);
        assert!(close(&dk, &g.get(1)?.narrow(2, 0, tk)?)? < 1e-5);
        assert!(close(&dv, &g.get(2)?.narrow(2, 0, tk)?)? < 1e-5);
        Ok(())
    }

    /// The causal diagonal with the probabilities' dropout drawn as a block of the (T, T)
    /// mask is the causal kernels' attention under that mask: output, lse2, dq, dk, dv.
    #[test]
    fn causal_block_with_dropout_is_the_causal_attention() -> Result<()> {
        use crate::dropout::{Mask, MaskKey, Place, Site};
        let dev = Device::Cpu;
        let (b, h, t, d) = (2, 3, 6, 8);
        let qkv = Tensor::randn(0f32, 1.0, (3, b, h, t, d), &dev)?;
        let dy = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev)?;
        let scale = 0.4;
        let m = Mask {
            key: MaskKey::new(5, 2, 0, 1, Site::Attention).map_err(candle_core::Error::wrap)?,
            p: 0.3,
            place: Place {
                global: [b, h, t * t],
                offset: [0, 0, 0],
            },
        };
        let (y, lse2) = crate::attention::forward(&qkv, scale, Some(&m))?;
        let lse2 = lse2.reshape((b, h, t))?;
        let g = crate::attention::backward(&qkv, &y, &dy, &lse2, scale, Some(&m))?;
        let drop = m.probs_block((b, h), t, (0, t), (0, t), &dev)?;
        let mask = BlockMask {
            causal: true,
            drop: Some(&drop),
        };
        let (q, k, v) = (qkv.get(0)?, qkv.get(1)?, qkv.get(2)?);
        let (yb, lb) = full_forward(&q, &k, &v, scale, mask)?;
        let (dq, dk, dv) = full_backward(&q, &k, &v, &y, &dy, &lse2, scale, mask)?;
        let close = |a: &Tensor, b: &Tensor| -> Result<f32> {
            (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
        };
        assert!(close(&yb, &y)? < 1e-5 && close(&lb, &lse2)? < 1e-5);
        for (i, got) in [dq, dk, dv].iter().enumerate() {
            assert!(close(got, &g.get(i)?)? < 1e-5, "gradient {i}");
        }
        // The mask dropped something: without it the output differs.
        let (y0, _) = full_forward(&q, &k, &v, scale, BlockMask { causal: true, drop: None })?;
        assert!(close(&y0, &y)? > 1e-2);
        Ok(())
    }
}
