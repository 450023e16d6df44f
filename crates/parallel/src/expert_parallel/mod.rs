//! Expert parallelism: the experts of a mixture-of-experts layer are spread over the ep group,
//! and tokens travel to their experts and back with two all-to-alls (Megatron's all-to-all token
//! dispatcher, DeepSpeed's capacity gating).
//!
//! ```text
//!   ep = 2, E = 4: rank 0 holds experts 0 1, rank 1 holds experts 2 3
//!
//!   x (N, C) ─router─> probs (N, E) ─route (top-k, capacity)─> kept (token, expert) pairs
//!     │ permute: x[tokens of e0] x[e1] | x[e2] x[e3]          (S, C) ordered by expert = by rank
//!     │ counts all-to-all: how many rows each rank will send me, per local expert
//!     │ dispatch all-to-all (send_splits → recv_splits)       (R, C) ordered [source rank][local expert]
//!     │ sort to [local expert][source rank], run each local expert on its slab, sort back
//!     │ combine all-to-all (recv_splits → send_splits)        (S, C) in the permuted order again
//!     ▼ un-permute: out[token] += y · gate(token, expert)     (N, C)
//! ```
//!
//! The three exchanges and their backward order are [`MOE_EXCHANGES`]; the layer runs them and
//! the cost model counts them. With `--ep-overlap` the tokens go in parts, pipelined: each
//! part's dispatch and combine on the wire while a neighbouring part's experts compute
//! ([`overlap`]).
//!
//! Routing is the model's own ([`mtrain_model::moe::route`] and friends), computed by each rank on
//! its **local** tokens: capacity `ceil(k · N_local / E · cf)` is per rank, per step, as in
//! DeepSpeed and Megatron. The single-device run that reproduces it is therefore the global batch
//! cut into the same micro-batches (one per data-parallel rank, gradients accumulated with
//! weight 1/dp): same tokens per routing group, same capacity, same drops. A dropped choice
//! contributes zero and the block's residual carries the token through.
//!
//! # Gradients
//! The all-to-all is a custom op whose backward is the reverse all-to-all
//! ([`all_to_all::all_to_all`]), so the router, the gate and everything below the layer get the
//! gradient of this rank's own loss, exactly as on one device. An expert's weights, though, see
//! tokens from every rank of its ep group: their local gradient is already `Σ_{r ∈ ep} ∂loss_r/∂W`.
//! [`sync_grads`] (the data-parallel average, `ddp/average.rs`) therefore averages
//! - non-expert gradients over **dp** (as DDP does): `(1/dp) Σ_{dp} g`,
//! - expert gradients over the expert's own replicas, the **edp** group, with the same 1/dp
//!   weight: `(1/dp) Σ_{edp} g` (Megatron's `expert_gradient_scaling_factor`). The ep group is
//!   never reduced over: its ranks hold different experts.
//!
//! Both give the gradient of the mean loss over the global batch. The composed model runs it
//! for a plan with `ep > 1` (`parallelize`, dp-only plans included); [`sync_grads`] is the
//! average on its own, after a backward.
//!
//! **One layer.** The layer is the model's own ([`MoeLayer`], written once in
//! `mtrain_model::moe`): [`moe_layer`] gives it this rank's experts and the ep group as an
//! [`EpExchange`], through which its forward sends the counts and the rows (the differentiable
//! all-to-all on the autograd path). The hand-written backward (`mtrain_model::explicit`'s MoE
//! tape, which the engine runs wherever it runs the other tapes) takes the same layer apart
//! (`FeedForward::moe_parts`) with the same exchange: the counts, dispatch and combine
//! all-to-alls in its forward, and in its backward the dispatch of the gradient where the
//! combine was and the combine where the dispatch was. Both paths build the rows by
//! [`mtrain_model::moe::Permutation`] and run the experts in [`mtrain_model::moe::ExpertMajor`]
//! order, so they issue the same collectives.
//!
//! Legend: `N` local tokens, `C` width, `E` experts, `E_l = E / ep` local experts, `S` rows this
//! rank sends (its kept pairs), `R` rows it receives.

mod all_to_all;
mod exchange;
pub mod overlap;

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use mtrain_comm::{Comm, CommError, ReduceOp};
use mtrain_model::gpt::{Embedding, Head, ParamStore};
use mtrain_model::{
    Block, CausalSelfAttention, DenseLinear, GptConfig, LayerNorm, Linear, Mlp, MoeConfig,
    MoeLayer, MoeStats, Param, Segment,
};

pub use crate::ddp::average::sync_grads;
use crate::placement::expert_of;
pub use crate::placement::is_expert_param;
pub use all_to_all::{all_to_all, MoeExchange, MOE_EXCHANGES};
pub use exchange::EpExchange;

/// Errors of expert parallelism.
#[derive(Debug, thiserror::Error)]
pub enum EpError {
    #[error("expert parallelism needs an MoE model, but the config has no `moe` section")]
    NotMoe,
    #[error("moe.n_experts ({n_experts}) must be divisible by ep ({ep}): each rank holds n_experts / ep experts")]
    ExpertsDontDivide { n_experts: usize, ep: usize },
    #[error("missing weight `{0}`")]
    MissingWeight(String),
    #[error("expert layout: {0}")]
    Layout(String),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, EpError>;

/// Number of experts each rank holds, or an error naming both numbers.
pub fn local_experts(cfg: &MoeConfig, ep: usize) -> Result<usize> {
    if ep == 0 || !cfg.n_experts.is_multiple_of(ep) {
        return Err(EpError::ExpertsDontDivide {
            n_experts: cfg.n_experts,
            ep,
        });
    }
    Ok(cfg.n_experts / ep)
}

/// The model's MoE layer ([`MoeLayer`]) with its experts across the ep group: this rank holds
/// experts `ep_rank · E_l .. (ep_rank + 1) · E_l` (`experts`, `cfg.n_experts / ep.size()` of
/// them), the router whole, and the rows travel over `ep` ([`EpExchange`]), in parts that
/// overlap their neighbours' experts when `overlap` (the hand-written backward's path).
pub fn moe_layer(
    router: Param,
    experts: Vec<Mlp>,
    cfg: MoeConfig,
    ep: Comm,
    overlap: bool,
) -> Result<MoeLayer> {
    let el = local_experts(&cfg, ep.size())?;
    if experts.len() != el {
        return Err(EpError::Layout(format!(
            "ep rank {} got {} experts, expected n_experts {} / ep {} = {el}",
            ep.rank(),
            experts.len(),
            cfg.n_experts,
            ep.size()
        )));
    }
    let exchange = EpExchange {
        device: router.tensor().device().clone(),
        group: ep,
        overlap,
    };
    Ok(MoeLayer::over(router, experts, cfg, Arc::new(exchange))?)
}

/// This rank's segments `[embedding, h.0 … h.{L-1}, head]` of an expert-parallel MoE GPT over
/// the group `ep`, from full weights by name: every non-expert parameter whole, and of each
/// block's experts only this rank's `E / ep` (keeping their global names, so gradients and
/// checkpoints line up with the single-device model); `overlap` as in [`moe_layer`].
pub fn build_segments(
    cfg: &GptConfig,
    weights: &BTreeMap<String, Tensor>,
    ep: &Comm,
    overlap: bool,
    device: &Device,
) -> Result<Vec<Arc<dyn Segment>>> {
    let mine = my_experts(cfg, ep)?;
    // Only this rank's experts reach the device.
    let local: BTreeMap<String, Tensor> = weights
        .iter()
        .filter(|(name, _)| expert_of(name).is_none_or(|e| mine.contains(&e)))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let p = ParamStore::new(&local, device)?;
    (0..cfg.n_layer + 2)
        .map(|i| segment(cfg, i, &p, ep, overlap))
        .collect()
}

/// The experts ep rank `ep.rank()` holds: `E / ep` consecutive ones.
pub fn my_experts(cfg: &GptConfig, ep: &Comm) -> Result<Range<usize>> {
    let moe = cfg.moe.as_ref().ok_or(EpError::NotMoe)?;
    let el = local_experts(moe, ep.size())?;
    Ok(ep.rank() * el..(ep.rank() + 1) * el)
}

/// Segment `index` of [`build_segments`] from the params of `p`, which must hold what it uses
/// (non-expert parameters whole, this rank's experts); the embedding and the head share `p`'s
/// one `wte`; `overlap` as in [`moe_layer`].
pub fn segment(
    cfg: &GptConfig,
    index: usize,
    p: &ParamStore,
    ep: &Comm,
    overlap: bool,
) -> Result<Arc<dyn Segment>> {
    let moe = cfg.moe.as_ref().ok_or(EpError::NotMoe)?;
    let mine = my_experts(cfg, ep)?;
    let get = |name: &str| {
        p.get(name)
            .map_err(|_| EpError::MissingWeight(name.to_string()))
    };
    let lin = |name: &str| -> Result<Box<dyn Linear>> {
        Ok(Box::new(DenseLinear::new(
            get(&format!("{name}.weight"))?,
            Some(get(&format!("{name}.bias"))?),
        )))
    };
    let ln = |name: &str| -> Result<LayerNorm> {
        Ok(LayerNorm::new(
            get(&format!("{name}.weight"))?,
            get(&format!("{name}.bias"))?,
        ))
    };
    if index == 0 {
        return Ok(Arc::new(Embedding::new(
            get("wte.weight")?,
            get("wpe.weight")?,
        )));
    }
    if index > cfg.n_layer {
        return Ok(Arc::new(Head::new(ln("ln_f")?, get("wte.weight")?)));
    }
    let h = format!("h.{}", index - 1);
    let attn = CausalSelfAttention::new(
        lin(&format!("{h}.attn.c_attn"))?,
        lin(&format!("{h}.attn.c_proj"))?,
        cfg.n_head,
        cfg.head_dim(),
    );
    let experts = mine
        .map(|e| {
            let prefix = format!("{h}.moe.experts.{e}");
            Ok(Mlp::new(
                lin(&format!("{prefix}.c_fc"))?,
                lin(&format!("{prefix}.c_proj"))?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let ffn = moe_layer(
        get(&format!("{h}.moe.router.weight"))?,
        experts,
        moe.clone(),
        ep.clone(),
        overlap,
    )?;
    Ok(Arc::new(Block::new(
        h.clone(),
        ln(&format!("{h}.ln_1"))?,
        attn,
        ln(&format!("{h}.ln_2"))?,
        Box::new(ffn),
    )))
}

/// The expert load of the whole dp group: tokens kept per expert and drops, summed over the
/// ranks' routing groups (one `MoeStats` per MoE layer, as the engine reports them).
pub fn total_load(stats: &[MoeStats], dp: &Comm) -> Result<Vec<MoeStats>> {
    let flat: Vec<i64> = stats
        .iter()
        .flat_map(|s| {
            s.tokens_per_expert
                .iter()
                .map(|&n| n as i64)
                .chain([s.dropped as i64])
        })
        .collect();
    let n = flat.len();
    let sum = dp
        .all_reduce(&Tensor::from_vec(flat, n, dp.device())?, ReduceOp::Sum)?
        .to_vec1::<i64>()?;
    let mut out = Vec::with_capacity(stats.len());
    let mut at = 0;
    for s in stats {
        let e = s.tokens_per_expert.len();
        out.push(MoeStats {
            tokens_per_expert: sum[at..at + e].iter().map(|&v| v as usize).collect(),
            dropped: sum[at + e] as usize,
        });
        at += e + 1;
    }
    Ok(out)
}
