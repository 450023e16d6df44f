//! Attention's CPU path (f32): the forward and backward of [`super::forward`] and
//! [`super::backward`] on q, k, v at any strides, so that [`super::forward_tokens`] reads the
//! heads of c_attn's token-major output in place and [`super::backward_tokens`] writes dq | dk |
//! dv per token in one pass ([`crate::cpu::tokens_grad`]); the products are
//! [`crate::cpu::matmul`]'s, the softmax parts the CPU loops'.

use candle_core::{Result, Tensor};

use crate::dropout::Mask;

/// [`super::forward`] on the CPU in f32 from q, k, v (B, H, T, D) at any strides (the heads of c_attn's
/// token-major output read in place): the products by gemm, the masked softmax in one pass.
pub(super) fn cpu_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    dropout: Option<&Mask>,
) -> Result<(Tensor, Tensor)> {
    let bmm = crate::cpu::matmul; // the B·H products shared over the pool
    let s = scores(q, k, scale)?; // (B, H, T, T), unmasked
    let (p, lse) = crate::cpu::causal_softmax(&s)?; // one pass: mask, max, exp, Σ
    drop(s);
    let p = match dropout {
        Some(m) => (p * super::probs_mask(m, q)?)?, // (B, H, T, T)
        None => p,
    };
    let y = bmm(&p, v)?; // (B, H, T, D)
    Ok((y, (lse * std::f64::consts::LOG2_E)?))
}

/// [`super::backward`] on the CPU in f32, as its comment's formulas, q, k, v, y, dy (B, H, T, D) at any
/// strides: (dQ, dK, dV) with dQ and dK not yet times `scale` (the caller folds it into the
/// pass that lays them out).
#[allow(clippy::too_many_arguments)]
pub(super) fn cpu_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    y: &Tensor,
    dy: &Tensor,
    lse2: &Tensor,
    scale: f64,
    dropout: Option<&Mask>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let mask = dropout.map(|m| super::probs_mask(m, q)).transpose()?; // (B, H, T, T) f32
    let masked = |t: &Tensor| match &mask {
        Some(m) => t * m,
        None => Ok(t.clone()),
    };
    let lse = (lse2 * std::f64::consts::LN_2)?; // (B, H, T)
    let bmm = crate::cpu::matmul; // the B·H products shared over the pool
    let s = scores(q, k, scale)?; // (B, H, T, T), unmasked
    let p = crate::cpu::causal_probs(&s, &lse)?; // (B, H, T, T)
    drop(s);
    let dp = masked(&bmm(dy, &v.t()?)?)?; // (B, H, T, T)
    let ds = crate::cpu::score_grad(&p, &dp, dy, y)?; // (B, H, T, T)
    drop(dp);
    let dq = bmm(&ds, k)?; // (B, H, T, D)
    let dk = bmm(&ds.t()?, q)?; // (B, H, T, D)
    drop(ds);
    let dv = bmm(&masked(&p)?.t()?, dy)?; // (B, H, T, D)
    Ok((dq, dk, dv))
}

/// The scores (q·scale) kᵀ (B, H, T, T): for a power-of-two factor (1/√D at D = 16, 64, 256)
/// the gemm applies it as it stores the products, the same bits as scaling q first, which the
/// other factors still do (a pass over q), so that every D keeps its bits.
fn scores(q: &Tensor, k: &Tensor, scale: f64) -> Result<Tensor> {
    let s = scale as f32;
    match s.to_bits() & 0x007f_ffff == 0 && s.is_normal() {
        true => crate::cpu::matmul_scaled(q, &k.t()?, s),
        false => crate::cpu::matmul(&(q * scale)?, &k.t()?),
    }
}

/// The heads of a token-major (B, T, n·H·D) tensor as n views (B, H, T, D), no copy.
pub(super) fn token_heads(x: &Tensor, n: usize, h: usize) -> Result<Vec<Tensor>> {
    let (b, t, w) = x.dims3()?;
    let x = x.reshape((b, t, n, h, w / (n * h)))?; // a view of the contiguous rows
    (0..n)
        .map(|j| x.narrow(2, j, 1)?.squeeze(2)?.transpose(1, 2))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::{backward, backward_tokens, forward, forward_tokens};
    use candle_core::{Device, Result, Tensor};

    fn bits(t: &Tensor) -> Result<Vec<u32>> {
        Ok(t.flatten_all()?.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect())
    }

    /// The tokens' path (heads read in place, the gradient laid out in one pass) gives the bits
    /// of the heads split apart, forward and backward, at one and two threads (B = 2, H = 3).
    #[test]
    fn tokens_path_is_heads_apart_bit_for_bit() -> Result<()> {
        let dev = Device::Cpu;
        let (b, t, h, d) = (2, 37, 3, 16);
        let qkv = Tensor::randn(0f32, 1.0, (b, t, 3 * h * d), &dev)?;
        let dy = Tensor::randn(0f32, 1.0, (b, t, h * d), &dev)?;
        let scale = 1.0 / (d as f64).sqrt();
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| -> Result<()> {
                let (y, saved) = forward_tokens(&qkv, h, scale, None)?;
                assert!(saved.in_place(), "the CPU keeps qkv as c_attn wrote it");
                let dqkv = backward_tokens(saved, &y, &dy, h, scale, None)?;
                let apart = crate::split_heads(&qkv, 3, h)?; // (3, B, H, T, D)
                let (ya, lse) = forward(&apart, scale, None)?;
                let dya = crate::split_heads(&dy, 1, h)?.squeeze(0)?;
                let ga = backward(&apart, &ya, &dya, &lse, scale, None)?;
                let ya = crate::merge_heads(&ya.unsqueeze(0)?)?; // (B, T, HD)
                let ga = crate::merge_heads(&ga)?; // (B, T, 3HD)
                assert_eq!(bits(&y)?, bits(&ya)?, "{threads} threads: the outputs differ");
                assert_eq!(bits(&dqkv)?, bits(&ga)?, "{threads} threads: the gradients differ");
                Ok(())
            })?;
        }
        Ok(())
    }
}
