//! Mixture of experts on one device: the reference expert parallelism must reproduce.
//!
//! ```text
//!   x (N, C) ──router──> logits (N, E) ──softmax──> probs (N, E) ──top-k──> choices per token
//!        │                                                              │
//!        │          capacity = ceil(k · N / E · capacity_factor) slots per expert,
//!        │          filled in priority order: every token's 1st choice (token order),
//!        │          then every token's 2nd choice (token order); a choice that finds its
//!        │          expert full is dropped (GShard / Switch)
//!        ▼                                                              ▼
//!   expert e runs on its kept tokens x[idx_e] (n_e, C) ──> y_e · gate ──index_add──> out (N, C)
//! ```
//!
//! The gate of a kept (token t, expert e) pair is the router probability `probs[t, e]`, **not
//! renormalised** over the top-k (Switch's choice; it keeps the router trained through the output
//! even with k = 1). A dropped choice contributes zero; the block's residual connection carries
//! the token through unchanged.
//!
//! Auxiliary losses (each times its coefficient in [`MoeConfig`]):
//! - load balancing (Switch): `E · Σᵢ fᵢ · Pᵢ`, `fᵢ` = fraction of tokens whose first choice is `i`
//!   (a constant), `Pᵢ` = mean router probability of `i` (differentiable); 1.0 when uniform.
//! - router z-loss (ST-MoE): `mean_t (logsumexp_e logits[t, e])²`.
//!
//! [`route`], [`load_balancing_loss`] and [`z_loss`] are the pieces expert parallelism calls on
//! the same inputs, so routing and drops are identical across layouts; [`Permutation`] (the
//! kept pairs as rows, by expert) and [`ExpertMajor`] (received rows in the order the experts
//! run) are the layouts its autograd path and every MoE tape share. The layer is written once:
//! on one device its experts are all here and the rows go nowhere; under expert parallelism
//! ([`MoeLayer::over`]) it holds its rank's experts and the rows travel through the group's
//! [`Exchange`] (the parallel crate's). Its hand-written backward is `explicit/moe.rs`.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor, D};

use mtrain_kernels::plain::{log_softmax_last_dim, softmax_last_dim, upcast};

use crate::config::MoeConfig;
use crate::layers::{linear, FeedForward, FfnOut, Mlp, MoeParts};
use crate::param::Param;
use crate::tape::Exchange;

pub mod stats;
pub use stats::MoeStats;

/// One kept choice: `token` goes to an expert as its `choice`-th preference (0 = first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Assignment {
    pub token: usize,
    pub choice: usize,
}

/// The complete routing decision for N tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingPlan {
    pub n_tokens: usize,
    pub n_experts: usize,
    pub top_k: usize,
    /// Slots per expert.
    pub capacity: usize,
    /// Per token, its top-k experts, best first (ties go to the lower index).
    pub choices: Vec<Vec<usize>>,
    /// Per expert, the kept assignments in slot order.
    pub assignments: Vec<Vec<Assignment>>,
    /// Per expert, the number of tokens whose first choice it is (before drops).
    pub first_choice_counts: Vec<usize>,
    /// Choices dropped for lack of capacity.
    pub dropped: usize,
}

impl RoutingPlan {
    /// Token indices kept by `expert`, in slot order.
    pub fn tokens_of(&self, expert: usize) -> Vec<u32> {
        self.assignments[expert]
            .iter()
            .map(|a| a.token as u32)
            .collect()
    }

    /// Kept-token counts and drops.
    pub fn stats(&self) -> MoeStats {
        MoeStats {
            tokens_per_expert: self.assignments.iter().map(Vec::len).collect(),
            dropped: self.dropped,
        }
    }
}

/// Slots per expert: `ceil(top_k · n_tokens / n_experts · capacity_factor)`.
pub fn capacity(n_tokens: usize, n_experts: usize, top_k: usize, capacity_factor: f64) -> usize {
    ((top_k * n_tokens) as f64 / n_experts as f64 * capacity_factor).ceil() as usize
}

/// Router logits and probabilities for flattened tokens: x (N, C), weight (E, C) -> (N, E) twice,
/// in f32 for 16-bit inputs.
pub fn router_probs(x: &Tensor, router_weight: &Tensor) -> Result<(Tensor, Tensor)> {
    let x = upcast(x)?;
    let w = router_weight.to_dtype(x.dtype())?;
    let logits = linear(&x, &w, None)?; // (N, E)
    let probs = softmax_last_dim(&logits)?; // (N, E)
    Ok((logits, probs))
}

/// Top-k choices and capacity-limited assignment from router probabilities (N, E).
pub fn route(probs: &Tensor, top_k: usize, capacity_factor: f64) -> Result<RoutingPlan> {
    let (n, e) = probs.dims2()?;
    if top_k == 0 || top_k > e {
        return Err(candle_core::Error::Msg(format!(
            "route: top_k {top_k} must be in 1..={e} (n_experts)"
        )));
    }
    let rows = probs.to_dtype(DType::F64)?.to_vec2::<f64>()?;
    let choices: Vec<Vec<usize>> = rows
        .iter()
        .map(|row| {
            let mut order: Vec<usize> = (0..e).collect();
            // Stable sort: equal probabilities keep the lower expert index first.
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            order.truncate(top_k);
            order
        })
        .collect();
    let cap = capacity(n, e, top_k, capacity_factor);
    let mut assignments = vec![Vec::new(); e];
    let mut first_choice_counts = vec![0usize; e];
    let mut dropped = 0;
    for choice in 0..top_k {
        for (token, c) in choices.iter().enumerate() {
            let expert = c[choice];
            if choice == 0 {
                first_choice_counts[expert] += 1;
            }
            if assignments[expert].len() < cap {
                assignments[expert].push(Assignment { token, choice });
            } else {
                dropped += 1;
            }
        }
    }
    Ok(RoutingPlan {
        n_tokens: n,
        n_experts: e,
        top_k,
        capacity: cap,
        choices,
        assignments,
        first_choice_counts,
        dropped,
    })
}

/// Switch load-balancing loss `E · Σᵢ fᵢ · Pᵢ` (scalar), differentiable through `probs` (N, E).
pub fn load_balancing_loss(probs: &Tensor, plan: &RoutingPlan) -> Result<Tensor> {
    let n = plan.n_tokens.max(1) as f64;
    let f: Vec<f64> = plan
        .first_choice_counts
        .iter()
        .map(|&c| c as f64 / n)
        .collect();
    let f = Tensor::from_vec(f, plan.n_experts, probs.device())?.to_dtype(probs.dtype())?; // (E,)
    let p_mean = probs.mean(0)?; // (E,)
    (p_mean * f)?.sum_all()? * plan.n_experts as f64
}

/// ST-MoE router z-loss `mean_t (logsumexp logits[t, :])²` (scalar).
pub fn z_loss(logits: &Tensor) -> Result<Tensor> {
    logsumexp(logits)?.sqr()?.mean_all()
}

/// `logsumexp_e logits[t, e]` per row of logits (N, E), as (N, 1).
pub fn logsumexp(logits: &Tensor) -> Result<Tensor> {
    // logsumexp = x - log_softmax(x) for any column; use column 0 of each row.
    logits.narrow(D::Minus1, 0, 1)? - log_softmax_last_dim(logits)?.narrow(D::Minus1, 0, 1)?
}

/// The kept (token, expert) pairs of a routing plan as rows, grouped by expert in slot order:
/// the order tokens are sent in (under expert parallelism the experts of rank p are
/// `p · E_l .. (p + 1) · E_l`, so grouping by expert is grouping by destination rank).
#[derive(Debug, Clone, PartialEq)]
pub struct Permutation {
    /// (S,) the token of each row.
    pub tokens: Vec<u32>,
    /// (S,) each row's gate as an index into the flattened probabilities: `token · E + expert`.
    pub gate_at: Vec<u32>,
    /// (E,) rows per expert.
    pub counts: Vec<usize>,
}

impl Permutation {
    pub fn of(plan: &RoutingPlan) -> Self {
        let e_total = plan.n_experts;
        let mut tokens = Vec::new();
        let mut gate_at = Vec::new();
        for (e, kept) in plan.assignments.iter().enumerate() {
            for a in kept {
                tokens.push(a.token as u32);
                gate_at.push((a.token * e_total + e) as u32);
            }
        }
        let counts = plan.assignments.iter().map(Vec::len).collect();
        Self {
            tokens,
            gate_at,
            counts,
        }
    }

    /// The rows of each of `k` parts of the `n` tokens, part i holding tokens
    /// `i·n/k .. (i+1)·n/k` (whole sequences when k divides the batch), each grouped by expert
    /// in this order: the pipelined overlap's parts. Every row is in one part; with k = 1 the
    /// one part is this permutation.
    pub fn split(&self, n: usize, k: usize) -> Vec<Permutation> {
        let k = k.max(1);
        let part_of = |t: usize| (0..k).rev().find(|&i| i * n / k <= t).unwrap_or(0);
        let mut parts = vec![
            Permutation {
                tokens: Vec::new(),
                gate_at: Vec::new(),
                counts: vec![0; self.counts.len()],
            };
            k
        ];
        let mut row = 0;
        for (e, &c) in self.counts.iter().enumerate() {
            for r in row..row + c {
                let p = &mut parts[part_of(self.tokens[r] as usize)];
                p.tokens.push(self.tokens[r]);
                p.gate_at.push(self.gate_at[r]);
                p.counts[e] += 1;
            }
            row += c;
        }
        parts
    }

    /// Rows for each rank when every rank holds `local` consecutive experts: (E / local,).
    pub fn splits(&self, local: usize) -> Vec<usize> {
        self.counts
            .chunks(local.max(1))
            .map(|c| c.iter().sum())
            .collect()
    }
}

/// The rows a rank's experts receive, laid out `[source rank][local expert]` as they arrive,
/// and the expert-major order `[local expert][source rank]` the experts run in. Sorting is a
/// gather by `order`, unsorting the gather by its inverse; each is the other's adjoint (a
/// permutation's adjoint is its inverse), so a backward sorts and unsorts gradients alike.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertMajor {
    /// order[p] = the received row at position p of the expert-major layout.
    order: Vec<u32>,
    inverse: Vec<u32>,
    /// (E_l,) rows of each local expert.
    rows: Vec<usize>,
    /// (ranks,) rows from each source rank.
    sources: Vec<usize>,
}

impl ExpertMajor {
    /// From `recv` (ranks · E_l,): entry `s · E_l + j` is the rows rank s sends to local expert j.
    pub fn of(recv: &[usize], local: usize) -> Result<Self> {
        if local == 0 || !recv.len().is_multiple_of(local) {
            return Err(candle_core::Error::Msg(format!(
                "moe: {} received counts do not split into {local} local experts per rank",
                recv.len()
            )));
        }
        let counts: Vec<&[usize]> = recv.chunks(local).collect(); // [source][local expert]
        let mut starts = vec![vec![0usize; local]; counts.len()];
        let mut off = 0;
        for (s, row) in counts.iter().enumerate() {
            for (j, &c) in row.iter().enumerate() {
                starts[s][j] = off;
                off += c;
            }
        }
        let mut order: Vec<u32> = Vec::with_capacity(off);
        for j in 0..local {
            for (s, row) in counts.iter().enumerate() {
                order.extend((starts[s][j]..starts[s][j] + row[j]).map(|r| r as u32));
            }
        }
        let mut inverse = vec![0u32; off];
        for (p, &r) in order.iter().enumerate() {
            inverse[r as usize] = p as u32;
        }
        Ok(Self {
            order,
            inverse,
            rows: (0..local)
                .map(|j| counts.iter().map(|r| r[j]).sum())
                .collect(),
            sources: counts.iter().map(|r| r.iter().sum()).collect(),
        })
    }

    /// (E_l,) rows of each local expert, in the expert-major layout's order.
    pub fn rows(&self) -> &[usize] {
        &self.rows
    }

    /// (ranks,) rows received from each rank: the receive splits of the rows all-to-all.
    pub fn sources(&self) -> &[usize] {
        &self.sources
    }

    /// Received rows (R, F) -> expert-major (R, F).
    pub fn sort(&self, x: &Tensor) -> Result<Tensor> {
        self.gather(x, &self.order)
    }

    /// Expert-major rows (R, F) -> the received layout (R, F).
    pub fn unsort(&self, y: &Tensor) -> Result<Tensor> {
        self.gather(y, &self.inverse)
    }

    fn gather(&self, x: &Tensor, at: &[u32]) -> Result<Tensor> {
        if at.iter().enumerate().all(|(p, &r)| p == r as usize) {
            return Ok(x.clone()); // one source rank: the layouts coincide
        }
        x.index_select(&Tensor::from_vec(at.to_vec(), at.len(), x.device())?, 0)
    }
}

/// Mixture-of-experts feed-forward layer (replaces a block's [`Mlp`]): on one device every
/// expert is here; under expert parallelism this rank's `E / ranks` experts and the group's row
/// exchange ([`MoeLayer::over`]). One forward serves both: the kept rows go to their experts
/// (the exchange's dispatch, or nowhere on one device), run expert by expert, come back (its
/// combine) and are added to their tokens weighted by their gates.
pub struct MoeLayer {
    /// (E, C), the whole router on every rank.
    pub router: Param,
    /// The experts held here, in global expert order: all E, or rank p's `p · E_l .. (p + 1) · E_l`.
    pub experts: Vec<Mlp>,
    pub cfg: MoeConfig,
    /// The expert-parallel group's row exchange; None: every expert is here.
    pub exchange: Option<Arc<dyn Exchange>>,
}

impl MoeLayer {
    /// Every expert on this device.
    pub fn new(router: Param, experts: Vec<Mlp>, cfg: MoeConfig) -> Self {
        Self {
            router,
            experts,
            cfg,
            exchange: None,
        }
    }

    /// This rank's experts of a layer spread over `exchange`'s group (`E / ranks` each).
    pub fn over(
        router: Param,
        experts: Vec<Mlp>,
        cfg: MoeConfig,
        exchange: Arc<dyn Exchange>,
    ) -> Result<Self> {
        let ranks = exchange.size();
        if ranks == 0 || experts.len() * ranks != cfg.n_experts {
            return Err(candle_core::Error::Msg(format!(
                "moe: {} experts here over {ranks} ranks do not make n_experts {}",
                experts.len(),
                cfg.n_experts
            )));
        }
        Ok(Self {
            router,
            experts,
            cfg,
            exchange: Some(exchange),
        })
    }

    /// The coefficient-weighted auxiliary loss, or None when both coefficients are zero.
    pub fn aux_loss(
        &self,
        logits: &Tensor,
        probs: &Tensor,
        plan: &RoutingPlan,
    ) -> Result<Option<Tensor>> {
        aux_loss(&self.cfg, logits, probs, plan)
    }

    /// Runs the experts held here on the received rows (R, C), laid out [source rank][local
    /// expert] as `slabs` says; returns (R, C) in that layout.
    fn run_local_experts(&self, x_recv: &Tensor, slabs: &ExpertMajor) -> Result<Tensor> {
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
}

/// The auxiliary loss of one MoE layer, already times its coefficients: `aux_loss_coef ·`
/// load balancing `+ z_loss_coef ·` router z-loss (None when both coefficients are 0). Shared with
/// the expert-parallel layer so both add exactly the same term.
pub fn aux_loss(
    cfg: &MoeConfig,
    logits: &Tensor,
    probs: &Tensor,
    plan: &RoutingPlan,
) -> Result<Option<Tensor>> {
    let mut aux = None;
    if cfg.aux_loss_coef > 0.0 {
        aux = Some((load_balancing_loss(probs, plan)? * cfg.aux_loss_coef)?);
    }
    if cfg.z_loss_coef > 0.0 {
        let z = (z_loss(logits)? * cfg.z_loss_coef)?;
        aux = Some(match aux {
            Some(a) => (a + z)?,
            None => z,
        });
    }
    Ok(aux)
}

impl FeedForward for MoeLayer {
    fn forward(&self, x: &Tensor) -> Result<FfnOut> {
        let (el, e_total) = (self.experts.len(), self.cfg.n_experts);
        let dims = x.dims().to_vec();
        let c = *dims
            .last()
            .ok_or_else(|| candle_core::Error::Msg("moe: scalar input".into()))?;
        let n = x.elem_count() / c.max(1);
        let xf = x.reshape((n, c))?; // (N, C)
        let (logits, probs) = router_probs(&xf, &self.router.tensor())?; // (N, E)
        let ranks = self.exchange.as_ref().map_or(1, |ex| ex.size());
        if probs.dim(1)? != e_total || el * ranks != e_total {
            return Err(candle_core::Error::Msg(format!(
                "moe: router has {} outputs, moe.n_experts is {e_total}, and the layer holds {el} \
                 experts on each of {ranks} ranks",
                probs.dim(1)?,
            )));
        }
        let plan = route(&probs, self.cfg.top_k, self.cfg.capacity_factor)?;

        // Permute: kept pairs grouped by expert, hence by destination rank; `send` (ranks,).
        let perm = Permutation::of(&plan);
        let send = perm.splits(el);
        // Counts: how many rows every rank sends to each of the experts held here.
        let recv_counts = match &self.exchange {
            Some(ex) => ex.counts(&perm.counts)?,
            None => perm.counts.clone(),
        };
        let slabs = ExpertMajor::of(&recv_counts, el)?;
        let recv = slabs.sources().to_vec(); // (ranks,)

        let dev = x.device();
        let s_rows = perm.tokens.len();
        let idx = Tensor::from_vec(perm.tokens, s_rows, dev)?; // (S,)
        let x_perm = xf.index_select(&idx, 0)?; // (S, C)
        let x_recv = match &self.exchange {
            Some(ex) => ex.dispatch(&x_perm, &send, &recv)?, // (R, C)
            None => x_perm,
        };
        let y_recv = self.run_local_experts(&x_recv, &slabs)?; // (R, C)
        let y_back = match &self.exchange {
            Some(ex) => ex.combine(&y_recv, &send, &recv)?, // (S, C)
            None => y_recv,
        };

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
            aux_loss: self.aux_loss(&logits, &probs, &plan)?,
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

    fn moe_parts(&self) -> Option<MoeParts<'_>> {
        Some(MoeParts {
            router: &self.router,
            experts: &self.experts,
            cfg: &self.cfg,
            exchange: self.exchange.clone(),
        })
    }
}
