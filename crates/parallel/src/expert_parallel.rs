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
//! the cost model counts them.
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
//! The hand-written backward (`mtrain_model::explicit`'s MoE tape, which the engine runs
//! wherever it runs the other tapes) takes this layer apart ([`FeedForward::moe_parts`]) with
//! its ep group as an [`EpExchange`]: the same counts, dispatch and combine all-to-alls in
//! its forward, and in its backward the dispatch of the gradient where the combine was and
//! the combine where the dispatch was. Both paths build the rows by
//! [`mtrain_model::moe::Permutation`] and run the experts in
//! [`mtrain_model::moe::ExpertMajor`] order, so they issue the same collectives.
//!
//! Legend: `N` local tokens, `C` width, `E` experts, `E_l = E / ep` local experts, `S` rows this
//! rank sends (its kept pairs), `R` rows it receives.

mod all_to_all;
mod exchange;

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use mtrain_comm::{Comm, CommError, ReduceOp};
use mtrain_model::gpt::{Embedding, Head, ParamStore};
use mtrain_model::layers::{FeedForward, FfnOut, MoeParts};
use mtrain_model::moe::{aux_loss, route, router_probs, ExpertMajor, Permutation};
use mtrain_model::tape::Exchange;
use mtrain_model::{
    Block, CausalSelfAttention, DenseLinear, GptConfig, LayerNorm, Linear, Mlp, MoeConfig,
    MoeStats, Param, Segment,
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

/// An MoE layer whose experts live across the ep group; this rank holds experts
/// `ep_rank · E_l .. (ep_rank + 1) · E_l`.
pub struct ExpertParallelMoe {
    /// (E, C), replicated on every rank.
    pub router: Param,
    /// This rank's experts, in global expert order.
    pub experts: Vec<Mlp>,
    pub cfg: MoeConfig,
    pub ep: Comm,
}

impl ExpertParallelMoe {
    /// `experts` are this rank's `cfg.n_experts / ep.size()` experts.
    pub fn new(router: Param, experts: Vec<Mlp>, cfg: MoeConfig, ep: Comm) -> Result<Self> {
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
        Ok(Self {
            router,
            experts,
            cfg,
            ep,
        })
    }

    /// Runs the local experts on the received rows (R, C), laid out [source rank][local expert]
    /// as `slabs` says; returns (R, C) in that layout.
    fn run_local_experts(
        &self,
        x_recv: &Tensor,
        slabs: &ExpertMajor,
    ) -> candle_core::Result<Tensor> {
        if x_recv.dim(0)? == 0 {
            // Nothing arrived; the (0, C) input stands in for the output so the combine
            // all-to-all is still recorded and its backward still runs on this rank.
            return Ok(x_recv.clone());
        }
        let x_sorted = slabs.sort(x_recv)?; // (R, C) by expert
        let mut outs = Vec::with_capacity(self.experts.len());
        let mut at = 0;
        for (expert, &n_j) in self.experts.iter().zip(slabs.rows()) {
            if n_j > 0 {
                outs.push(expert.apply(&x_sorted.narrow(0, at, n_j)?)?); // (n_j, C)
                at += n_j;
            }
        }
        slabs.unsort(&Tensor::cat(&outs, 0)?) // (R, C) by source rank
    }

    /// The ep group as the tapes and the counts exchange take it.
    fn exchange(&self) -> EpExchange {
        EpExchange {
            group: self.ep.clone(),
            device: self.router.tensor().device().clone(),
        }
    }
}

fn msg(s: String) -> candle_core::Error {
    candle_core::Error::Msg(s)
}

impl FeedForward for ExpertParallelMoe {
    fn forward(&self, x: &Tensor) -> candle_core::Result<FfnOut> {
        let (el, e_total) = (self.experts.len(), self.cfg.n_experts);
        let dims = x.dims().to_vec();
        let c = *dims
            .last()
            .ok_or_else(|| msg("expert-parallel moe: scalar input".into()))?;
        let n = x.elem_count() / c.max(1);
        let xf = x.reshape((n, c))?; // (N, C)
        let (logits, probs) = router_probs(&xf, &self.router.tensor())?; // (N, E)
        if probs.dim(1)? != e_total {
            return Err(msg(format!(
                "expert-parallel moe: router has {} outputs but moe.n_experts is {e_total}",
                probs.dim(1)?
            )));
        }
        let plan = route(&probs, self.cfg.top_k, self.cfg.capacity_factor)?;

        // Permute: kept pairs grouped by expert, hence by destination rank.
        let perm = Permutation::of(&plan);
        let send_splits = perm.splits(el); // (ep,)
                                           // Exchange counts: rank s learns how many rows every peer sends to each of its experts.
        let slabs = ExpertMajor::of(&self.exchange().counts(&perm.counts)?, el)?;
        let recv_splits = slabs.sources().to_vec(); // (ep,)

        let dev = x.device();
        let s_rows = perm.tokens.len();
        let idx = Tensor::from_vec(perm.tokens, s_rows, dev)?; // (S,)
        let x_perm = xf.index_select(&idx, 0)?; // (S, C)
        let (send, recv) = (&send_splits, &recv_splits);
        let x_recv = MoeExchange::Dispatch.run(&x_perm, send, recv, &self.ep)?; // (R, C)
        let y_recv = self.run_local_experts(&x_recv, &slabs)?; // (R, C)
        let y_back = MoeExchange::Combine.run(&y_recv, send, recv, &self.ep)?; // (S, C)

        // Un-permute, weighting each row by its (token, expert) router probability.
        let gate = probs
            .flatten_all()?
            .index_select(&Tensor::from_vec(perm.gate_at, s_rows, dev)?, 0)?
            .reshape((s_rows, 1))?
            .to_dtype(y_back.dtype())?; // (S, 1)
        let out = xf
            .zeros_like()?
            .index_add(&idx, &y_back.broadcast_mul(&gate)?, 0)?; // (N, C)
        Ok(FfnOut {
            out: out.reshape(dims)?,
            aux_loss: aux_loss(&self.cfg, &logits, &probs, &plan)?,
            stats: Some(plan.stats()),
        })
    }

    fn params(&self) -> Vec<Param> {
        let mut p = vec![self.router.clone()];
        for e in &self.experts {
            p.extend(e.params());
        }
        p
    }

    /// The router, this rank's experts and the ep group's exchange: the block's tape runs the
    /// dispatch and combine all-to-alls, and their conjugates in its backward.
    fn moe_parts(&self) -> Option<MoeParts<'_>> {
        Some(MoeParts {
            router: &self.router,
            experts: &self.experts,
            cfg: &self.cfg,
            exchange: Some(Arc::new(self.exchange())),
        })
    }
}

/// This rank's segments `[embedding, h.0 … h.{L-1}, head]` of an expert-parallel MoE GPT over
/// the group `ep`, from full weights by name: every non-expert parameter whole, and of each
/// block's experts only this rank's `E / ep` (keeping their global names, so gradients and
/// checkpoints line up with the single-device model).
pub fn build_segments(
    cfg: &GptConfig,
    weights: &BTreeMap<String, Tensor>,
    ep: &Comm,
    device: &Device,
) -> Result<Vec<Arc<dyn Segment>>> {
    let moe = cfg.moe.as_ref().ok_or(EpError::NotMoe)?;
    let el = local_experts(moe, ep.size())?;
    let mine = ep.rank() * el..(ep.rank() + 1) * el;
    // Only this rank's experts reach the device.
    let local: BTreeMap<String, Tensor> = weights
        .iter()
        .filter(|(name, _)| expert_of(name).is_none_or(|e| mine.contains(&e)))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let p = ParamStore::new(&local, device)?;
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
    let wte = get("wte.weight")?;
    let mut segments: Vec<Arc<dyn Segment>> =
        vec![Arc::new(Embedding::new(wte.clone(), get("wpe.weight")?))];
    for i in 0..cfg.n_layer {
        let h = format!("h.{i}");
        let attn = CausalSelfAttention::new(
            lin(&format!("{h}.attn.c_attn"))?,
            lin(&format!("{h}.attn.c_proj"))?,
            cfg.n_head,
            cfg.head_dim(),
        );
        let experts = mine
            .clone()
            .map(|e| {
                let prefix = format!("{h}.moe.experts.{e}");
                Ok(Mlp::new(
                    lin(&format!("{prefix}.c_fc"))?,
                    lin(&format!("{prefix}.c_proj"))?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let ffn = ExpertParallelMoe::new(
            get(&format!("{h}.moe.router.weight"))?,
            experts,
            moe.clone(),
            ep.clone(),
        )?;
        segments.push(Arc::new(Block::new(
            h.clone(),
            ln(&format!("{h}.ln_1"))?,
            attn,
            ln(&format!("{h}.ln_2"))?,
            Box::new(ffn),
        )));
    }
    segments.push(Arc::new(Head::new(ln("ln_f")?, wte)));
    Ok(segments)
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
