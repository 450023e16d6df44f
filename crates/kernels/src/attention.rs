//! Causal attention `softmax(mask(q kᵀ · scale)) v` on packed heads (3, B, H, T, D), in one
//! place for every path it is differentiated by:
//!
//! ```text
//!   under autograd    causal_attention   the flash kernels (their backward as the op's bwd),
//!                                        else plain::causal_attention (the oracle)
//!   hand-written      forward, backward  the same flash kernels, else the same algorithm
//!                                        in candle ops (below), saved statistic lse2 either way
//! ```
//!
//! The flash kernels compute attention without the (T, T) score matrix:
//!
//! ```text
//!  keys ─────────────>         forward, one block per (64 queries, head):
//!  ┌──┬──┬──┬──┐  q rows        for each key tile (32 keys) on or below the diagonal:
//!  │██│  │  │  │  0..63           s = q·kᵀ·scale (masked above the diagonal)
//!  ├──┼──┼──┼──┤                  m' = max(m, max s);  l = l·e^(m-m') + Σ e^(s-m')
//!  │██│██│  │  │  64..127         acc = acc·e^(m-m') + e^(s-m') v
//!  ├──┼──┼──┼──┤                o = acc / l;  keep lse per row (B, H, T)
//!  │██│██│██│  │
//!  └──┴──┴──┴──┘  only the shaded tiles are ever computed
//! ```
//!
//! The backward (Dao et al. 2022, Algorithm 2, split into two passes so no thread block writes
//! another's output): `δ = rowsum(dO ∘ O)`; rebuilding `P = e^(s - lse)` from the saved lse, one
//! pass over query rows gives `dQ = scale · (P ∘ (dO vᵀ − δ)) K`, one pass over key rows gives
//! `dK = scale · dSᵀ Q` and `dV = Pᵀ dO`. Memory kept for backward: the output and lse, O(T)
//! per head instead of O(T²).
//!
//! Four implementations, chosen per call by [`Path`]:
//! - **Hopper warpgroups** (`flash_hopper_*` in `flash_hopper.cu`, bf16 with `D` in
//!   [`HOPPER_HEAD_DIMS`] on compute capability 9.0): the same algorithm with each product
//!   issued by a warpgroup of 4 warps as `wgmma` (64 rows × a whole staged tile per
//!   instruction, the operands read by the tensor cores from swizzled shared memory), 64 to
//!   192 rows a block; the default where it applies. Its backward runs in two passes, dQ over
//!   query rows then dK and dV over key rows; chosen with `MTRAIN_FLASH_KERNELS=hopper-one-pass`,
//!   in one pass over key rows that also adds `dQ` into an f32 buffer atomically
//!   (`flash_hopper_bwd`: S and dP computed once per tile pair, five products instead of
//!   seven; the price is a dq that differs in its last bits from run to run), which was the
//!   faster from T = 2048 on before the kernels of 2026-12-06
//!   ([`TcKernels::one_pass`](crate::attention_path::TcKernels::one_pass)).
//! - **wide tensor cores** (`flash_wide_*` in `flash_wide.cu`, bf16 with `D` in
//!   [`WIDE_HEAD_DIMS`]): the tensor-core algorithm below with 32 rows per warp (16 at
//!   D = 128) and blocks of 128 rows, so each operand fragment read from shared memory feeds
//!   two products; the default where the Hopper kernels do not apply.
//! - **tensor cores** (`flash_tc_*` in `kernels.cu`, bf16 with `D` in [`TC_HEAD_DIMS`]): warps
//!   of 16 rows, the readable version and the fallback, the
//!   products `q kᵀ`, `P v`, `dO vᵀ`, `dS k`, `Pᵀ dO`, `dSᵀ q` as `mma.sync` m16n8k16 bf16 tiles
//!   with f32 accumulators, the softmax statistics in f32 registers; `P` and `dS` go from the
//!   accumulators of one product to the operands of the next without touching memory.
//! - **CUDA cores** (`flash_*` in `kernels.cu`, any dtype of bf16/f32 and `D` in [`HEAD_DIMS`]): f32 FMAs, the
//!   fallback for f32 and for head sizes the tensor-core tiles do not cover.
//!
//! **Dropout** on the probabilities (nanoGPT's `attn_dropout`): every entry point takes an
//! optional [`Mask`] of the probabilities (B, H, T·T); the output is `(P ∘ M) v`, the backward
//! draws the mask again (the rule and where the kernels draw it: [`crate::dropout`]).
//!
//! Legend: `B` batch, `H` heads, `T` time, `D` head size.

use candle_core::{Layout, Result, Shape, Tensor, D};

pub use crate::attention_path::{
    path, uses_tensor_cores, Path, TcKernels, HOPPER_HEAD_DIMS, TC_HEAD_DIMS, WIDE_HEAD_DIMS,
};
use crate::dropout::Mask;
use crate::msg;
use crate::plain::{self, upcast};

/// Head sizes the kernels are instantiated for.
pub const HEAD_DIMS: [usize; 5] = [8, 16, 32, 64, 128];

/// Whether the fused kernels take packed heads of size `d` on `qkv`'s device and dtype.
fn fuses(qkv: &Tensor, d: usize) -> bool {
    crate::fused_for(qkv) && HEAD_DIMS.contains(&d)
}

/// The head size D of packed heads qkv (3, B, H, T, D); an error names any other shape.
fn head_size(qkv: &Tensor, what: &str) -> Result<usize> {
    let (three, _b, _h, _t, d) = qkv.dims5()?;
    if three != 3 {
        return Err(msg(format!(
            "{what}: qkv {:?} must be (3, B, H, T, D)",
            qkv.dims()
        )));
    }
    Ok(d)
}

/// The parts q, k, v (B, H, T, D) of packed heads qkv (3, B, H, T, D).
fn parts(qkv: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    Ok((qkv.get(0)?, qkv.get(1)?, qkv.get(2)?))
}

/// Causal attention of packed heads qkv (3, B, H, T, D) = q | k | v (as
/// [`split_heads`](crate::split_heads) writes them); returns (B, H, T, D). Differentiable in
/// qkv: the fused kernels where they apply (one (3, B, H, T, D) gradient, no (T, T) scores),
/// else [`plain::causal_attention`] on the three parts.
pub fn causal_attention(qkv: &Tensor, scale: f64, dropout: Option<&Mask>) -> Result<Tensor> {
    let dropout = dropout.filter(|m| m.p > 0.0);
    if fuses(qkv, head_size(qkv, "causal_attention")?) {
        return fused(qkv, scale, dropout);
    }
    let (q, k, v) = parts(qkv)?;
    let Some(m) = dropout else {
        return plain::causal_attention(&q, &k, &v, scale);
    };
    let p = plain::softmax_last_dim(&plain::causal_scores(&q, &k, scale)?)?; // (B, H, T, T)
    (p * probs_mask(m, &q)?)?.to_dtype(v.dtype())?.matmul(&v) // (B, H, T, D)
}

/// The dropout mask of probabilities for q (B, H, T, D): (B, H, T, T) f32.
fn probs_mask(m: &Mask, q: &Tensor) -> Result<Tensor> {
    let (b, h, t, _) = q.dims4()?;
    m.tensor([b, h, t * t], q.device())?.reshape((b, h, t, t))
}

/// The fused kernels under autograd (CUDA only).
pub(crate) fn fused(qkv: &Tensor, scale: f64, dropout: Option<&Mask>) -> Result<Tensor> {
    fused_with(qkv, scale, TcKernels::from_env(), dropout)
}

/// [`fused`] on the given tensor-core kernels.
pub(crate) fn fused_with(
    qkv: &Tensor,
    scale: f64,
    kernels: TcKernels,
    dropout: Option<&Mask>,
) -> Result<Tensor> {
    let d = head_size(qkv, "flash attention")?;
    if !HEAD_DIMS.contains(&d) {
        return Err(msg(format!(
            "flash attention: head size {d} not supported (one of {HEAD_DIMS:?})"
        )));
    }
    qkv.contiguous()?
        .apply_op1(FlashAttention::new(scale, kernels, dropout))
}

/// Causal attention of packed qkv (3, B, H, T, D) recording no graph: the output (B, H, T, D)
/// and lse2 (B, H, T) f32, log₂ of each row's softmax denominator, which [`backward`] takes
/// (with the same `dropout`).
pub fn forward(qkv: &Tensor, scale: f64, dropout: Option<&Mask>) -> Result<(Tensor, Tensor)> {
    let dropout = dropout.filter(|m| m.p > 0.0);
    if fuses(qkv, head_size(qkv, "attention forward")?) {
        let op = FlashAttention::new(scale, TcKernels::from_env(), dropout);
        let y = qkv.contiguous()?.apply_op1_no_bwd(&op)?;
        return Ok((y, op.take_lse()?));
    }
    let (q, k, v) = parts(qkv)?;
    if crate::cpu::takes(&[qkv]) {
        return cpu_forward(&q, &k, &v, scale, dropout);
    }
    let masked = |p: Tensor| match dropout {
        Some(m) => p * probs_mask(m, &q)?, // (B, H, T, T)
        None => Ok(p),
    };
    let s = plain::causal_scores(&q, &k, scale)?; // (B, H, T, T) f32
    let lse = logsumexp(&s)?; // (B, H, T)
    let p = s.broadcast_sub(&lse.unsqueeze(D::Minus1)?)?.exp()?; // (B, H, T, T)
    let y = masked(p)?.to_dtype(v.dtype())?.matmul(&v)?; // (B, H, T, D)
    Ok((y, (lse * std::f64::consts::LOG2_E)?))
}

/// The gradient (3, B, H, T, D) = dq | dk | dv of packed causal attention from its input qkv,
/// output y, output gradient dy (B, H, T, D) and the lse2 of [`forward`], recording no graph.
/// On CPU as the kernels do it (Dao et al. 2022, Algorithm 2), with the (T, T) scores
/// materialised: in f32 the products by gemm and the softmax parts in one pass each, in other
/// dtypes candle ops (`M` the dropout mask, all ones without `dropout`):
///
/// ```text
///   P = exp(s − lse)      δ = rowsum(dO ∘ O)      dS = P ∘ (dO vᵀ ∘ M − δ)
///   dQ = scale · dS K     dK = scale · dSᵀ Q      dV = (P ∘ M)ᵀ dO
/// ```
pub fn backward(
    qkv: &Tensor,
    y: &Tensor,
    dy: &Tensor,
    lse2: &Tensor,
    scale: f64,
    dropout: Option<&Mask>,
) -> Result<Tensor> {
    let dropout = dropout.filter(|m| m.p > 0.0);
    let d = head_size(qkv, "attention backward")?;
    let (q, k, v) = parts(qkv)?;
    if fuses(qkv, d) {
        let dy = dy.contiguous()?;
        return fused_backward(
            &q,
            &k,
            &v,
            y,
            &dy,
            lse2,
            scale,
            TcKernels::from_env(),
            dropout,
        );
    }
    if crate::cpu::takes(&[qkv, y, dy, lse2]) {
        let (dq, dk, dv) = cpu_backward(&q, &k, &v, y, dy, lse2, scale, dropout)?;
        return Tensor::stack(&[(dq * scale)?, (dk * scale)?, dv], 0); // (3, B, H, T, D)
    }
    let mask = dropout.map(|m| probs_mask(m, &q)).transpose()?; // (B, H, T, T) f32
    let masked = |t: &Tensor| match &mask {
        Some(m) => t * m,
        None => Ok(t.clone()),
    };
    let lse = (lse2 * std::f64::consts::LN_2)?.unsqueeze(D::Minus1)?; // (B, H, T, 1)
    let p = plain::causal_scores(&q, &k, scale)?
        .broadcast_sub(&lse)?
        .exp()?; // (B, H, T, T)
    let (qf, kf, vf, dyf) = (upcast(&q)?, upcast(&k)?, upcast(&v)?, upcast(dy)?);
    let delta = (&dyf * upcast(y)?)?.sum_keepdim(D::Minus1)?; // (B, H, T, 1)
    let dp = masked(&dyf.matmul(&vf.t()?)?)?; // (B, H, T, T)
    let ds = (&p * dp.broadcast_sub(&delta)?)?; // (B, H, T, T)
    let dq = (ds.matmul(&kf)? * scale)?; // (B, H, T, D)
    let dk = (ds.t()?.matmul(&qf)? * scale)?; // (B, H, T, D)
    let dv = masked(&p)?.t()?.matmul(&dyf)?; // (B, H, T, D)
    Tensor::stack(&[dq, dk, dv], 0)?.to_dtype(qkv.dtype()) // (3, B, H, T, D)
}

/// What [`forward_tokens`] keeps for [`backward_tokens`]: c_attn's output as the kernels read
/// it, and lse2.
pub struct TokensSaved {
    /// (B, T, 3·H·D) where the kernels or the CPU's products read the tokens' layout in place,
    /// else the heads split apart (3, B, H, T, D).
    qkv: Tensor,
    /// (B·H, T) or (B, H, T) f32.
    lse2: Tensor,
}

impl TokensSaved {
    /// Whether qkv is kept as c_attn wrote it (the kernels or the CPU read the tokens' layout).
    pub fn in_place(&self) -> bool {
        self.qkv.rank() == 3
    }
}

/// Causal attention straight from c_attn's output `qkv` (B, T, 3·H·D), per token q | k | v of
/// `h` heads, recording no graph: the output (B, T, H·D), c_proj's input, and what
/// [`backward_tokens`] takes. Where the Hopper kernels apply (bf16, D = 64, compute capability
/// 9.0, no dropout) they read q, k, v where c_attn wrote them and write the output where c_proj
/// reads it, so neither [`split_heads`](crate::split_heads) nor
/// [`merge_heads`](crate::merge_heads) runs, forward or backward; on the CPU (f32) the gemm
/// reads the heads in place (strided views) and the backward writes dq | dk | dv per token in
/// one pass:
///
/// ```text
///   Hopper:     qkv (B, T, 3HD) ─ flash_hopper_fwd (rows of 3HD) ─> y (B, T, HD)
///   CPU f32:    qkv (B, T, 3HD) ─ views (B, H, T, D) ─ forward ─> (B, H, T, D) ─ merge_heads ─> y
///   elsewhere:  qkv ─ split_heads ─> (3, B, H, T, D) ─ forward ─> (B, H, T, D) ─ merge_heads ─> y
/// ```
///
/// The same kernels do the same arithmetic either way: only the addresses differ.
pub fn forward_tokens(
    qkv: &Tensor,
    h: usize,
    scale: f64,
    dropout: Option<&Mask>,
) -> Result<(Tensor, TokensSaved)> {
    let run = || {
        let dropout = dropout.filter(|m| m.p > 0.0);
        #[cfg(feature = "cuda")]
        if imp::takes_tokens(qkv, h, TcKernels::from_env(), dropout.is_some())? {
            let (y, lse2) = imp::forward_tokens(qkv, h, scale)?;
            let qkv = qkv.clone();
            return Ok((y, TokensSaved { qkv, lse2 }));
        }
        if crate::cpu::takes(&[qkv]) {
            // The CPU's products read the heads where c_attn wrote them; qkv is kept as it is.
            let qkv = qkv.contiguous()?;
            let hv = token_heads(&qkv, 3, h)?;
            let (y, lse2) = cpu_forward(&hv[0], &hv[1], &hv[2], scale, dropout)?; // (B, H, T, D)
            let y = crate::merge_heads(&y.unsqueeze(0)?)?; // (B, T, H·D)
            return Ok((y, TokensSaved { qkv, lse2 }));
        }
        let qkv = crate::split_heads(qkv, 3, h)?; // (3, B, H, T, D)
        let (y, lse2) = forward(&qkv, scale, dropout)?; // (B, H, T, D)
        let y = crate::merge_heads(&y.unsqueeze(0)?)?; // (B, T, H·D)
        Ok((y, TokensSaved { qkv, lse2 }))
    };
    crate::profile::op(qkv.device(), run, |(y, saved)| {
        let moved = crate::profile::bytes(&[qkv, y, &saved.lse2]);
        crate::profile::attention("attention", qkv.dims(), 4.0, moved)
    })
}

/// The gradient (B, T, 3·H·D) of [`forward_tokens`] from what it kept, its output `y` and the
/// output's gradient `dy` (both (B, T, H·D)), with the same `h`, `scale` and `dropout`: in the
/// tokens' layout from the Hopper kernels and on the CPU (f32), else through [`backward`] on
/// the heads split apart.
pub fn backward_tokens(
    saved: TokensSaved,
    y: &Tensor,
    dy: &Tensor,
    h: usize,
    scale: f64,
    dropout: Option<&Mask>,
) -> Result<Tensor> {
    let read = crate::profile::bytes(&[&saved.qkv, &saved.lse2, y, dy]);
    let dims = saved.qkv.dims().to_vec();
    let run = || {
        let TokensSaved { qkv, lse2 } = saved;
        let dy = dy.contiguous()?;
        if qkv.rank() == 3 && crate::cpu::takes(&[&qkv, y, &dy, &lse2]) {
            let y = y.contiguous()?;
            let (hv, yv, dyv) = (token_heads(&qkv, 3, h)?, token_heads(&y, 1, h)?, token_heads(&dy, 1, h)?);
            let (dq, dk, dv) = cpu_backward(&hv[0], &hv[1], &hv[2], &yv[0], &dyv[0], &lse2, scale, dropout)?;
            return crate::cpu::tokens_grad(&dq, &dk, &dv, scale); // (B, T, 3·H·D)
        }
        if qkv.rank() == 3 {
            #[cfg(feature = "cuda")]
            return imp::backward_tokens(&qkv, &y.contiguous()?, &dy, &lse2, h, scale);
            #[cfg(not(feature = "cuda"))]
            return Err(msg("the tokens' attention backward runs on CUDA only".into()));
        }
        let apart = |t: &Tensor| crate::split_heads(t, 1, h)?.squeeze(0); // (B, H, T, D)
        let dqkv = backward(&qkv, &apart(y)?, &apart(&dy)?, &lse2, scale, dropout)?; // (3, B, H, T, D)
        crate::merge_heads(&dqkv) // (B, T, 3·H·D)
    };
    crate::profile::op(y.device(), run, |dqkv| {
        let moved = read + crate::profile::bytes(&[dqkv]);
        crate::profile::attention("attention backward", &dims, 8.0, moved)
    })
}

/// ln Σ exp over the last dimension of s (..., T), the row maximum taken out first.
fn logsumexp(s: &Tensor) -> Result<Tensor> {
    let max = s.max_keepdim(D::Minus1)?; // (..., 1)
    let sum = s.broadcast_sub(&max)?.exp()?.sum_keepdim(D::Minus1)?; // (..., 1)
    (sum.log()? + max)?.squeeze(D::Minus1)
}

/// The recorded op on one packed input (3, B, H, T, D): its forward leaves lse2 here for its
/// backward.
struct FlashAttention {
    scale: f64,
    kernels: TcKernels,
    /// The dropout mask of the probabilities, drawn again by the backward.
    dropout: Option<Mask>,
    lse: std::sync::Mutex<Option<Tensor>>,
}

impl FlashAttention {
    fn new(scale: f64, kernels: TcKernels, dropout: Option<&Mask>) -> Self {
        Self {
            scale,
            kernels,
            dropout: dropout.copied(),
            lse: std::sync::Mutex::new(None),
        }
    }

    /// The lse2 the forward left.
    fn lse(&self) -> Result<Tensor> {
        self.lse
            .lock()
            .map_err(|_| msg("flash attention: lse lock poisoned".into()))?
            .clone()
            .ok_or_else(|| msg("flash attention: backward before forward".into()))
    }

    /// The lse2 the forward left, taken out.
    fn take_lse(&self) -> Result<Tensor> {
        self.lse
            .lock()
            .map_err(|_| msg("flash attention: lse lock poisoned".into()))?
            .take()
            .ok_or_else(|| msg("flash attention: the forward left no lse".into()))
    }
}

impl candle_core::CustomOp1 for FlashAttention {
    fn name(&self) -> &'static str {
        "flash-attention"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        Err(msg(
            "flash attention runs on CUDA only; the CPU path is plain::causal_attention".into(),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qkv: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (_, b, h, t, d) = l.shape().dims5()?;
        if !l.is_contiguous() {
            return Err(msg(format!(
                "flash attention: qkv {:?} is not contiguous",
                l.dims()
            )));
        }
        let n = b * h * t * d;
        let part =
            |i: usize| Layout::contiguous_with_offset((b, h, t, d), l.start_offset() + i * n);
        let (lq, lk, lv) = (part(0), part(1), part(2));
        let (o, lse) = imp::forward(
            qkv,
            &lq,
            qkv,
            &lk,
            qkv,
            &lv,
            self.scale,
            self.kernels,
            self.dropout.as_ref(),
        )?;
        *self
            .lse
            .lock()
            .map_err(|_| msg("flash attention: lse lock poisoned".into()))? = Some(lse);
        Ok((o, lq.shape().clone()))
    }

    fn bwd(&self, qkv: &Tensor, out: &Tensor, grad_out: &Tensor) -> Result<Option<Tensor>> {
        let qkv = qkv.detach();
        let (q, k, v) = (qkv.get(0)?, qkv.get(1)?, qkv.get(2)?); // (B, H, T, D) views
        let g = fused_backward(
            &q,
            &k,
            &v,
            out,
            &grad_out.contiguous()?,
            &self.lse()?,
            self.scale,
            self.kernels,
            self.dropout.as_ref(),
        )?;
        Ok(Some(g)) // (3, B, H, T, D)
    }
}

/// Gradients of causal attention from the forward's output and lse (B, H, T), packed as
/// (3, B, H, T, D) = dq | dk | dv.
#[allow(unused_variables, clippy::too_many_arguments)]
fn fused_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
    scale: f64,
    kernels: TcKernels,
    dropout: Option<&Mask>,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        imp::backward(q, k, v, out, grad_out, lse, scale, kernels, dropout)
    }
    #[cfg(not(feature = "cuda"))]
    Err(msg("the flash attention backward runs on CUDA only".into()))
}

mod full;
pub use full::{full_backward, full_forward, BlockMask};
#[cfg(feature = "cuda")]
mod imp;
mod on_cpu;
use on_cpu::{cpu_backward, cpu_forward, token_heads};

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use crate::testing::{cuda, rel_err};
    use candle_core::{DType, Var};

    /// Forward and the three gradients of the fused kernel (the tensor-core kernels `kernels`
    /// where a bf16 case takes them) against the plain candle attention (the reference
    /// computed in f32 from the same inputs).
    #[allow(clippy::too_many_arguments)]
    fn check(b: usize, h: usize, t: usize, d: usize, dtype: DType, tol: f64, kernels: TcKernels) {
        let dev = cuda();
        let r = |s: &[usize]| {
            Tensor::randn(0f32, 1f32, s, &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        };
        let s = [b, h, t, d];
        let (q, k, v, w) = (r(&s), r(&s), r(&s), r(&s));
        let scale = 1.0 / (d as f64).sqrt();
        let run = |fused: bool, dt: DType| {
            let vars: Vec<Var> = [&q, &k, &v]
                .iter()
                .map(|x| Var::from_tensor(&x.to_dtype(dt).unwrap()).unwrap())
                .collect();
            let (qv, kv, vv) = (vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor());
            let y = if fused {
                let qkv = Tensor::stack(&[qv, kv, vv], 0).unwrap(); // (3, B, H, T, D)
                super::fused_with(&qkv, scale, kernels, None).unwrap()
            } else {
                plain::causal_attention(qv, kv, vv, scale).unwrap()
            };
            let g = (&y * w.to_dtype(dt).unwrap())
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let grads: Vec<Tensor> = vars
                .iter()
                .map(|x| g.get(x.as_tensor()).unwrap().clone())
                .collect();
            (y, grads)
        };
        let (y, gs) = run(true, dtype);
        let (y_ref, gs_ref) = run(false, DType::F32);
        let e = rel_err(&y, &y_ref);
        assert!(
            e < tol,
            "forward rel err {e} >= {tol} (T={t}, D={d}, {dtype:?}, {kernels:?})"
        );
        for (name, (g, g_ref)) in ["dq", "dk", "dv"].iter().zip(gs.iter().zip(&gs_ref)) {
            let e = rel_err(g, g_ref);
            assert!(
                e < tol,
                "{name} rel err {e} >= {tol} (T={t}, D={d}, {dtype:?}, {kernels:?})"
            );
        }
    }

    use TcKernels::{Hopper, HopperOnePass, Narrow, Wide};

    #[test]
    fn matches_plain_attention_bf16_d64() {
        // Tensor cores; T = 200 leaves a partial last tile of 8 rows (of 72 in a wide block).
        check(2, 3, 200, 64, DType::BF16, 1e-2, Narrow);
        check(2, 3, 200, 64, DType::BF16, 1e-2, Wide);
        check(2, 3, 200, 64, DType::BF16, 1e-2, Hopper);
    }

    /// The Hopper kernels (the wide ones on other devices), the backward in two passes: one
    /// partial block (T = 100), a block whose second warpgroup has no row (T = 60), several
    /// blocks with a partial last one (T = 517: 5 forward blocks of 128 rows, 9 dkdv blocks
    /// of 64 keys) and one long row set (T = 1000) where the forward walks 8 key tiles of 128;
    /// at D = 128 (rows of two 64-column swizzle atoms) the same lengths.
    #[test]
    fn matches_plain_attention_bf16_hopper_d64_d128() {
        for d in [64, 128] {
            check(1, 2, 60, d, DType::BF16, 1e-2, Hopper);
            check(2, 1, 100, d, DType::BF16, 1e-2, Hopper);
            check(1, 2, 517, d, DType::BF16, 1e-2, Hopper);
            check(1, 1, 1000, d, DType::BF16, 1e-2, Hopper);
        }
    }

    /// The backward in one pass: blocks of three warpgroups where only the first has keys
    /// (T = 60) or the last has none (T = 130), where the second has keys past T (T = 100),
    /// where some see a tile and others not (T = 517, 1000), and past 2048 (T = 2100); at
    /// D = 128 (blocks of one warpgroup) a partial block and several blocks.
    #[test]
    fn matches_plain_attention_bf16_hopper_one_pass_d64_d128() {
        check(2, 1, 100, 128, DType::BF16, 1e-2, HopperOnePass);
        check(1, 2, 517, 128, DType::BF16, 1e-2, HopperOnePass);
        check(1, 2, 60, 64, DType::BF16, 1e-2, HopperOnePass);
        check(2, 1, 100, 64, DType::BF16, 1e-2, HopperOnePass);
        check(1, 1, 130, 64, DType::BF16, 1e-2, HopperOnePass);
        check(1, 2, 517, 64, DType::BF16, 1e-2, HopperOnePass);
        check(1, 1, 1000, 64, DType::BF16, 1e-2, HopperOnePass);
        check(1, 1, 2100, 64, DType::BF16, 1e-2, HopperOnePass);
    }

    #[test]
    fn matches_plain_attention_bf16_tensor_cores_d16_d32() {
        check(1, 2, 130, 16, DType::BF16, 1e-2, Narrow);
        check(2, 1, 64, 32, DType::BF16, 1e-2, Narrow);
    }

    #[test]
    fn matches_plain_attention_bf16_cuda_cores_d8_d128() {
        check(1, 2, 100, 8, DType::BF16, 1e-2, Narrow);
        check(1, 2, 70, 128, DType::BF16, 1e-2, Narrow);
    }

    /// The wide kernels at every head size they take, with partial blocks, several blocks of
    /// query rows (T = 517: four wide blocks, the last of 5 rows) and warps that skip tiles.
    #[test]
    fn matches_plain_attention_bf16_wide_d16_to_d128() {
        check(1, 2, 130, 16, DType::BF16, 1e-2, Wide);
        check(2, 1, 64, 32, DType::BF16, 1e-2, Wide);
        check(1, 2, 517, 64, DType::BF16, 1e-2, Wide);
        check(1, 2, 70, 128, DType::BF16, 1e-2, Wide);
        check(1, 1, 300, 128, DType::BF16, 1e-2, Wide);
    }

    #[test]
    fn tensor_cores_cover_bf16_multiples_of_16_up_to_64() {
        use candle_core::DType::{BF16, F32};
        assert!(uses_tensor_cores(BF16, 64, &[0, 0, 8]));
        assert!(!uses_tensor_cores(BF16, 64, &[0, 4, 0]));
        assert!(!uses_tensor_cores(F32, 64, &[0, 0, 0]));
        assert!(!uses_tensor_cores(BF16, 128, &[0, 0, 0]));
        assert!(!uses_tensor_cores(BF16, 8, &[0, 0, 0]));
    }

    /// The packed entry point: output and its one (3, B, H, T, D) gradient against plain
    /// attention on the three parts, computed in f32.
    #[test]
    fn packed_matches_plain_attention_bf16_d64() {
        let dev = cuda();
        let (b, h, t, d) = (2, 3, 200, 64);
        let x = Tensor::randn(0f32, 1f32, (3, b, h, t, d), &dev).unwrap();
        let w = Tensor::randn(0f32, 1f32, (b, h, t, d), &dev).unwrap();
        let scale = 1.0 / (d as f64).sqrt();
        let run = |fused: bool, dt: DType| {
            let v =
                Var::from_tensor(&x.to_dtype(DType::BF16).unwrap().to_dtype(dt).unwrap()).unwrap();
            let p = v.as_tensor();
            let y = if fused {
                super::fused(p, scale, None).unwrap()
            } else {
                let part = |i| p.get(i).unwrap();
                plain::causal_attention(&part(0), &part(1), &part(2), scale).unwrap()
            };
            let g = (&y * w.to_dtype(dt).unwrap())
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            (y, g.get(p).unwrap().clone())
        };
        let (y, g) = run(true, DType::BF16);
        let (y_ref, g_ref) = run(false, DType::F32);
        assert_eq!(g.dims(), &[3, b, h, t, d]);
        let e = rel_err(&y, &y_ref);
        assert!(e < 1e-2, "forward rel err {e}");
        for i in 0..3 {
            let e = rel_err(&g.get(i).unwrap(), &g_ref.get(i).unwrap());
            assert!(e < 1e-2, "gradient part {i} rel err {e}");
        }
    }

    /// The tokens' layout (c_attn's output read in place, the output and dqkv written where
    /// c_proj and c_attn's backward take them) against the same kernels on the heads split
    /// apart: bit for bit where the backward runs in two passes (T = 60, 517, 1000: the same
    /// arithmetic at other addresses); from T = 2048 on (one pass, dq added atomically) dk
    /// and dv bit for bit and dq against plain attention in f32 at the tolerance of the
    /// other checks. B = 2, H = 3, so rows of several heads and batches interleave; at D = 128
    /// the same at T = 517.
    #[test]
    fn tokens_layout_matches_heads_apart_bf16_d64_d128() {
        let dev = cuda();
        let (b, h) = (2, 3);
        for (d, t) in [(64, 60), (64, 517), (64, 1000), (64, 2100), (128, 517)] {
            let r = |s: (usize, usize, usize)| {
                Tensor::randn(0f32, 1f32, s, &dev).unwrap().to_dtype(DType::BF16).unwrap()
            };
            let (qkv, dy) = (r((b, t, 3 * h * d)), r((b, t, h * d)));
            let scale = 1.0 / (d as f64).sqrt();
            let (y, saved) = forward_tokens(&qkv, h, scale, None).unwrap();
            if !saved.in_place() {
                return; // not a Hopper device: the tokens' path is the split one
            }
            let dqkv = backward_tokens(saved, &y, &dy, h, scale, None).unwrap();
            let apart = crate::split_heads(&qkv, 3, h).unwrap(); // (3, B, H, T, D)
            let (ya, lse) = forward(&apart, scale, None).unwrap();
            let dya = crate::split_heads(&dy, 1, h).unwrap().squeeze(0).unwrap();
            let ga = backward(&apart, &ya, &dya, &lse, scale, None).unwrap();
            let ya = crate::merge_heads(&ya.unsqueeze(0).unwrap()).unwrap(); // (B, T, HD)
            let ga = crate::merge_heads(&ga).unwrap(); // (B, T, 3HD)
            let bits = |x: &Tensor| x.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(bits(&y) == bits(&ya), "T = {t}: the outputs differ");
            let part = |g: &Tensor, i: usize| g.narrow(2, i * h * d, h * d).unwrap();
            let one_pass = TcKernels::from_env().one_pass();
            for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
                if i == 0 && one_pass {
                    let p = |x: &Tensor| x.get(0).unwrap().to_dtype(DType::F32).unwrap();
                    let (q, k, v) = (p(&apart), apart.get(1).unwrap(), apart.get(2).unwrap());
                    let (q, k, v) = (q, k.to_dtype(DType::F32).unwrap(), v.to_dtype(DType::F32).unwrap());
                    let q = Var::from_tensor(&q).unwrap();
                    let yr = plain::causal_attention(q.as_tensor(), &k, &v, scale).unwrap();
                    let dyf = dya.to_dtype(DType::F32).unwrap();
                    let g = (&yr * dyf).unwrap().sum_all().unwrap().backward().unwrap();
                    let dq_ref = crate::merge_heads(&g.get(q.as_tensor()).unwrap().unsqueeze(0).unwrap()).unwrap();
                    let e = rel_err(&part(&dqkv, 0), &dq_ref);
                    assert!(e < 1e-2, "T = {t}: dq rel err {e} against plain attention");
                    continue;
                }
                assert!(bits(&part(&dqkv, i)) == bits(&part(&ga, i)), "T = {t}: {name} differs");
            }
        }
    }

    #[test]
    fn matches_plain_attention_f32_d16_and_d128() {
        check(1, 2, 130, 16, DType::F32, 1e-4, Wide);
        check(1, 2, 70, 128, DType::F32, 1e-4, Wide);
    }
}
