//! The mixture-of-experts half of a block ([`crate::moe`]): the router with its gates and
//! auxiliary losses, the experts' MLPs, and under expert parallelism the dispatch and combine
//! all-to-alls, each with its conjugate in the backward where autograd would run it.
//!
//! ```text
//!   forward (kept: h, probs, lse, gate, y_back, each expert's MLP tensors)
//!     h (N, C) ─router─> logits (N, E) ─softmax─> probs ─route─> S kept (token, expert) pairs
//!     h[tokens] (S, C) ─dispatch─> (R, C) ─sort─> expert j on its n_j rows ─unsort─> (R, C)
//!       ─combine─> y_back (S, C)             out = index_add(tokens, y_back · gate)   (N, C)
//!     aux = a · E Σ_e f_e P_e  +  z · mean_t lse_t²                   (gate = probs[t, e])
//!
//!   backward, given dout (N, C) and s = loss_scale:
//!     dsel = dout[tokens]        dgate = Σ_C dsel · y_back (S, 1)     dy_back = dsel · gate
//!     dy_recv = dispatch(dy_back)                 combine's conjugate: the same counts
//!     each expert's MLP backward on sort(dy_recv): its n_j rows of dx, its four gradients
//!     dx_perm = combine(unsort(dx))               dispatch's conjugate
//!     dh = index_add(tokens, dx_perm)
//!     dprobs[t, e] = dgate of the kept pair (t, e), else 0   + s · a · E · f_e / N
//!     dlogits = probs ⊙ (dprobs − Σ_e dprobs ⊙ probs)        + s · z · 2 lse_t / N · probs
//!     dW_router = dlogitsᵀ · h                    dh += dlogits · W_router
//! ```
//!
//! The top-k choices and the capacity drops are constants of the step, as under autograd
//! (routing is [`crate::moe::route`], not differentiated): the router learns through the gates
//! and the auxiliary losses. With every expert on this rank (one device) there is no exchange:
//! dispatch and combine are the identity and the received rows are the sent ones. An expert no
//! row reached gets zero gradients; every rank runs both all-to-alls each way even when it
//! sends or receives nothing, or its peers would wait for it.
//!
//! Legend: `N` this rank's tokens, `C` width, `E` experts, `E_l` local experts, `S` rows this
//! rank sends (its kept pairs), `R` rows its experts receive.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};
use mtrain_kernels::plain::upcast;

use super::{err, taped_dtype, MlpKept, MlpWeights};
use crate::config::MoeConfig;
use crate::layers::MoeParts;
use crate::moe::{aux_loss, logsumexp, route, router_probs, ExpertMajor, MoeStats, Permutation};
use crate::tape::{Exchange, SlotWeight, WeightGrads};

/// A mixture of experts' weight slots ([`SlotWeight`]), and the exchange that reaches other
/// ranks' experts.
pub(super) struct MoeWeights {
    /// (E, C)
    router: SlotWeight,
    /// This rank's E_l experts, in global expert order.
    experts: Vec<MlpWeights>,
    cfg: MoeConfig,
    exchange: Option<Arc<dyn Exchange>>,
}

/// Where this rank's rows go and where its experts' rows come from: the send splits of the
/// rows all-to-all, and the received rows' receive splits and expert-major order.
struct Route {
    exchange: Option<Arc<dyn Exchange>>,
    /// (ranks,)
    send: Vec<usize>,
    slabs: ExpertMajor,
}

impl Route {
    /// Exchanges the counts of `perm` (the counts all-to-all) over `exchange`.
    fn of(exchange: Option<Arc<dyn Exchange>>, perm: &Permutation, local: usize) -> Result<Route> {
        let recv = match &exchange {
            Some(x) => x.counts(&perm.counts)?,
            None => perm.counts.clone(),
        };
        if recv.len() != perm.counts.len() {
            return Err(err(format!(
                "moe tape: the counts all-to-all returned {} counts for {} experts",
                recv.len(),
                perm.counts.len()
            )));
        }
        Ok(Route {
            send: perm.splits(local),
            slabs: ExpertMajor::of(&recv, local)?,
            exchange,
        })
    }

    /// Rows by destination rank (S, F) -> rows by source rank (R, F).
    fn dispatch(&self, x: &Tensor) -> Result<Tensor> {
        match &self.exchange {
            Some(e) => e.rows(x, &self.send, self.slabs.sources()),
            None => Ok(x.clone()),
        }
    }

    /// Rows by source rank (R, F) -> back where they came from (S, F): the dispatch with its
    /// splits swapped.
    fn combine(&self, y: &Tensor) -> Result<Tensor> {
        match &self.exchange {
            Some(e) => e.rows(y, self.slabs.sources(), &self.send),
            None => Ok(y.clone()),
        }
    }
}

/// The mixture of experts' forward kept for its backward (see the module picture).
pub(super) struct MoeTape {
    wts: MoeWeights,
    route: Route,
    /// (N, C): the router's input and the rows the experts' inputs were taken from.
    h: Tensor,
    /// (N, E) f32
    probs: Tensor,
    /// (N, 1) f32, the router logits' logsumexp, kept when the z-loss is on.
    lse: Option<Tensor>,
    /// (E,) tokens whose first choice each expert is (the load-balancing loss's f · N).
    first_choice: Vec<usize>,
    stats: MoeStats,
    aux: Option<Tensor>,
    /// (S,) u32
    tokens: Tensor,
    /// (S,) u32, each row's gate in the flattened probs
    gate_at: Tensor,
    /// (S, 1)
    gate: Tensor,
    /// (S, C): the experts' outputs back on this rank
    y_back: Tensor,
    /// Per local expert, its MLP's tensors (None: no row reached it).
    experts: Vec<Option<MlpKept>>,
}

impl MoeWeights {
    /// The tape's view of `parts` for an input like `x`, or None for another dtype.
    pub(super) fn of(parts: MoeParts<'_>, x: &Tensor) -> Option<MoeWeights> {
        let router = SlotWeight::of(parts.router);
        if !taped_dtype(x) || router.dtype() != x.dtype() {
            return None;
        }
        let experts = parts
            .experts
            .iter()
            .map(|m| MlpWeights::of(m, x))
            .collect::<Option<Vec<_>>>()?;
        Some(MoeWeights {
            router,
            experts,
            cfg: parts.cfg.clone(),
            exchange: parts.exchange,
        })
    }

    /// The layer's output (N, C) for h (N, C), this rank's tokens after ln_2, and its tape.
    pub(super) fn forward(self, h: &Tensor) -> Result<(Tensor, MoeTape)> {
        let (n, c) = h.dims2()?;
        let (local, e_total) = (self.experts.len(), self.cfg.n_experts);
        let ranks = self.exchange.as_ref().map_or(1, |x| x.size());
        if local * ranks != e_total {
            return Err(err(format!(
                "moe tape: {local} experts on each of {ranks} ranks, but moe.n_experts is {e_total}"
            )));
        }
        let (logits, probs) = router_probs(h, &self.router.get()?)?; // (N, E) f32
        if probs.dim(1)? != e_total {
            return Err(err(format!(
                "moe tape: the router has {} outputs but moe.n_experts is {e_total}",
                probs.dim(1)?
            )));
        }
        let plan = route(&probs, self.cfg.top_k, self.cfg.capacity_factor)?;
        let aux = aux_loss(&self.cfg, &logits, &probs, &plan)?;
        let lse = match self.cfg.z_loss_coef > 0.0 {
            true => Some(logsumexp(&logits)?), // (N, 1)
            false => None,
        };
        drop(logits);
        let perm = Permutation::of(&plan);
        let route = Route::of(self.exchange.clone(), &perm, local)?;
        let (dev, s_rows) = (h.device(), perm.tokens.len());
        let tokens = Tensor::from_vec(perm.tokens, s_rows, dev)?; // (S,)
        let gate_at = Tensor::from_vec(perm.gate_at, s_rows, dev)?; // (S,)
        let x_recv = route.dispatch(&h.index_select(&tokens, 0)?)?; // (R, C) by source rank
        let x_sorted = route.slabs.sort(&x_recv)?; // (R, C) by expert
        drop(x_recv);
        let mut experts = Vec::with_capacity(local);
        let mut ys = Vec::with_capacity(local);
        let mut at = 0;
        for (expert, &rows) in self.experts.iter().zip(route.slabs.rows()) {
            if rows == 0 {
                experts.push(None);
                continue;
            }
            let (y, kept) = expert.forward(&x_sorted.narrow(0, at, rows)?, None, 1)?; // (n_j, C)
            ys.push(y);
            experts.push(Some(kept));
            at += rows;
        }
        let y_recv = match ys.is_empty() {
            true => x_sorted.zeros_like()?, // (0, C): nothing arrived
            false => route.slabs.unsort(&Tensor::cat(&ys, 0)?)?, // (R, C) by source rank
        };
        drop((ys, x_sorted));
        let y_back = route.combine(&y_recv)?; // (S, C)
        drop(y_recv);
        let gate = probs
            .flatten_all()?
            .index_select(&gate_at, 0)?
            .reshape((s_rows, 1))?
            .to_dtype(y_back.dtype())?; // (S, 1)
        let out = Tensor::zeros((n, c), h.dtype(), dev)?.index_add(
            &tokens,
            &y_back.broadcast_mul(&gate)?,
            0,
        )?; // (N, C)
        let tape = MoeTape {
            wts: self,
            route,
            h: h.clone(),
            probs,
            lse,
            first_choice: plan.first_choice_counts.clone(),
            stats: plan.stats(),
            aux,
            tokens,
            gate_at,
            gate,
            y_back,
            experts,
        };
        Ok((out, tape))
    }
}

impl MoeTape {
    /// The auxiliary loss, already times its coefficients (None when both are 0).
    pub(super) fn aux_loss(&self) -> Option<&Tensor> {
        self.aux.as_ref()
    }

    pub(super) fn stats(&self) -> MoeStats {
        self.stats.clone()
    }

    /// dh (N, C) from dout (N, C), the gradient of the layer's output; with `loss_scale` the
    /// weight of the auxiliary loss in the objective. The router's and every local expert's
    /// gradients are pushed to `grads`.
    pub(super) fn backward(
        self,
        dout: &Tensor,
        loss_scale: f64,
        grads: &mut WeightGrads,
    ) -> Result<Tensor> {
        let MoeTape {
            wts,
            route,
            h,
            probs,
            lse,
            first_choice,
            stats: _,
            aux: _,
            tokens,
            gate_at,
            gate,
            y_back,
            experts,
        } = self;
        let (n, c) = h.dims2()?;
        let (dev, e_total) = (h.device(), probs.dim(1)?);
        // Un-permute: out = index_add(tokens, y_back · gate).
        let dsel = dout.index_select(&tokens, 0)?; // (S, C)
        let dgate = (&dsel * &y_back)?.sum_keepdim(1)?; // (S, 1)
        let dy_back = dsel.broadcast_mul(&gate)?; // (S, C)
        drop((dsel, y_back, gate));
        // The experts, between the combine's conjugate and the dispatch's.
        let dy_sorted = route.slabs.sort(&route.dispatch(&dy_back)?)?; // (R, C) by expert
        drop(dy_back);
        let mut dxs = Vec::with_capacity(experts.len());
        let mut at = 0;
        for ((expert, kept), &rows) in wts.experts.iter().zip(experts).zip(route.slabs.rows()) {
            match kept {
                None => expert.zero_grads(grads)?,
                Some(kept) => {
                    dxs.push(expert.backward(kept, &dy_sorted.narrow(0, at, rows)?, 1, grads)?); // (n_j, C)
                    at += rows;
                }
            }
        }
        let dx_recv = match dxs.is_empty() {
            true => dy_sorted.zeros_like()?,                      // (0, C)
            false => route.slabs.unsort(&Tensor::cat(&dxs, 0)?)?, // (R, C) by source rank
        };
        drop((dxs, dy_sorted));
        let dx_perm = route.combine(&dx_recv)?; // (S, C)
        let dh = Tensor::zeros((n, c), h.dtype(), dev)?.index_add(&tokens, &dx_perm, 0)?; // (N, C)
        drop((dx_recv, dx_perm));
        // The router: the gates' gradient and the auxiliary losses', through the softmax.
        let dprobs = Tensor::zeros(n * e_total, DType::F32, dev)?
            .index_add(&gate_at, &dgate.flatten_all()?.to_dtype(DType::F32)?, 0)?
            .reshape((n, e_total))?; // (N, E)
        let rows = n.max(1) as f64;
        let dprobs = match wts.cfg.aux_loss_coef > 0.0 {
            true => {
                let k = loss_scale * wts.cfg.aux_loss_coef * e_total as f64 / rows;
                let f: Vec<f32> = first_choice
                    .iter()
                    .map(|&cnt| (k * cnt as f64 / rows) as f32)
                    .collect();
                dprobs.broadcast_add(&Tensor::from_vec(f, (1, e_total), dev)?)? // (N, E)
            }
            false => dprobs,
        };
        let dot = (&dprobs * &probs)?.sum_keepdim(1)?; // (N, 1)
        let dlogits = (&probs * dprobs.broadcast_sub(&dot)?)?; // (N, E)
        let dlogits = match lse {
            Some(lse) => {
                let k = loss_scale * wts.cfg.z_loss_coef * 2.0 / rows;
                (dlogits + probs.broadcast_mul(&(lse * k)?)?)? // (N, E)
            }
            None => dlogits,
        };
        let hf = upcast(&h)?; // (N, C) f32
        let dw = dlogits.t()?.matmul(&hf)?; // (E, C)
        grads.push((wts.router.name().to_string(), dw.to_dtype(wts.router.dtype())?));
        let dh_router = dlogits.matmul(&upcast(&wts.router.get()?)?)?; // (N, C) f32
        dh + dh_router.to_dtype(h.dtype())?
    }
}
