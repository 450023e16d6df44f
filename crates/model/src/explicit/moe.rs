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
//! Dispatch, experts and combine run through [`Exchange::round_trip`] on the layer's tokens in
//! parts: one, or under the pipelined overlap as many as the exchange asks for (routed
//! together: one capacity, the same drops), each part's rows grouped by expert, all counts in
//! one all-to-all; `tokens`, `gate` and `y_back` hold part 0's rows, then part 1's, and so on.
//! The exchange decides when each part's all-to-alls wait (`expert_parallel/overlap.rs` in the
//! parallel crate). In the backward an expert's weight products are kept over the parts and
//! formed once on all its rows, in the exchange's tail (beside the last combine).
//!
//! Legend: `N` this rank's tokens, `C` width, `E` experts, `E_l` local experts, `S` rows this
//! rank sends (its kept pairs), `R` rows its experts receive.

use std::cell::RefCell;
use std::sync::Arc;

use candle_core::{DType, Result, Tensor};
use mtrain_kernels::plain::upcast;

use super::{err, taped_dtype, MlpKept, MlpWeights};
use crate::config::MoeConfig;
use crate::layers::MoeParts;
use crate::moe::{aux_loss, logsumexp, route, router_probs, ExpertMajor, MoeStats, Permutation};
use crate::tape::{Exchange, PartRows, SlotWeight, WeightGrads};

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

/// Where this rank's rows go and where its experts' rows come from, for each part of the
/// layer's tokens (one, or several under the pipelined overlap): the send splits of the rows
/// all-to-all, and the received rows' receive splits and expert-major order.
struct Route {
    exchange: Option<Arc<dyn Exchange>>,
    parts: Vec<PartRoute>,
}

/// One part's [`Route`].
struct PartRoute {
    /// (ranks,)
    send: Vec<usize>,
    slabs: ExpertMajor,
    /// S_i: the rows this rank sends (its kept pairs of the part's tokens).
    rows: usize,
}

impl Route {
    /// Exchanges the counts of every part of the permutation (one counts all-to-all, each
    /// rank's counts part by part) over `exchange`.
    fn of(
        exchange: Option<Arc<dyn Exchange>>,
        parts: &[Permutation],
        local: usize,
    ) -> Result<Route> {
        let (k, e_total) = (parts.len(), parts.first().map_or(0, |p| p.counts.len()));
        let ranks = e_total / local.max(1);
        // [rank p][part i][local expert j]
        let sent: Vec<usize> = (0..ranks)
            .flat_map(|p| {
                parts
                    .iter()
                    .flat_map(move |q| q.counts[p * local..(p + 1) * local].iter().copied())
            })
            .collect();
        let recv = match &exchange {
            Some(x) => x.counts(&sent)?,
            None => sent.clone(),
        };
        if recv.len() != sent.len() {
            return Err(err(format!(
                "moe tape: the counts all-to-all returned {} counts for {} sent",
                recv.len(),
                sent.len()
            )));
        }
        let parts = parts
            .iter()
            .enumerate()
            .map(|(i, q)| {
                // [source s][local expert j] of part i
                let got: Vec<usize> = (0..ranks)
                    .flat_map(|s| {
                        recv[(s * k + i) * local..(s * k + i + 1) * local]
                            .iter()
                            .copied()
                    })
                    .collect();
                Ok(PartRoute {
                    send: q.splits(local),
                    slabs: ExpertMajor::of(&got, local)?,
                    rows: q.tokens.len(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Route { exchange, parts })
    }

    /// Each part's rows `xs[i]` (S_i, F) by destination rank to the experts, `experts(i, rows)`
    /// on the (R_i, F) rows that arrived by source rank, and the result back (S_i, F): the
    /// dispatch and the combine ([`Exchange::round_trip`]), `tail()` beside the last combine;
    /// on one device `experts` on the rows, then `tail()`.
    fn round_trip(
        &self,
        xs: Vec<Tensor>,
        experts: &mut dyn FnMut(usize, Tensor) -> Result<Tensor>,
        tail: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Vec<Tensor>> {
        match &self.exchange {
            Some(e) => {
                let parts = xs
                    .into_iter()
                    .zip(&self.parts)
                    .map(|(x, p)| PartRows {
                        x,
                        send: &p.send,
                        recv: p.slabs.sources(),
                    })
                    .collect();
                e.round_trip(parts, experts, tail)
            }
            None => {
                let ys = xs
                    .into_iter()
                    .enumerate()
                    .map(|(i, x)| experts(i, x))
                    .collect();
                tail()?;
                ys
            }
        }
    }

    /// (S, F) cut into the parts' rows, (S_i, F) each.
    fn cut(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let mut at = 0;
        self.parts
            .iter()
            .map(|p| {
                let part = x.narrow(0, at, p.rows)?; // (S_i, F)
                at += p.rows;
                Ok(part)
            })
            .collect()
    }
}

/// The parts' results stacked back into one (S, F).
fn stacked(mut parts: Vec<Tensor>) -> Result<Tensor> {
    match parts.len() {
        1 => Ok(parts.remove(0)),
        _ => Tensor::cat(&parts, 0),
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
    /// Per part, per local expert, its MLP's tensors (None: no row of the part reached it).
    experts: Vec<Vec<Option<MlpKept>>>,
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
        let parts = self.exchange.as_ref().map_or(1, |x| x.parts());
        let perm = Permutation::of(&plan).split(n, parts); // rows of each part's tokens
        let route = Route::of(self.exchange.clone(), &perm, local)?;
        let (dev, s_rows): (_, usize) = (h.device(), perm.iter().map(|p| p.tokens.len()).sum());
        let cat = |f: fn(&Permutation) -> &Vec<u32>| perm.iter().flat_map(f).copied().collect();
        let tokens = Tensor::from_vec(cat(|p| &p.tokens), s_rows, dev)?; // (S,) part by part
        let gate_at = Tensor::from_vec(cat(|p| &p.gate_at), s_rows, dev)?; // (S,)
        let xs = route.cut(&h.index_select(&tokens, 0)?)?; // (S_i, C) each
        let mut experts = Vec::with_capacity(parts);
        let ys = route.round_trip(
            xs,
            &mut |i, x_recv| {
                let slabs = &route.parts[i].slabs;
                let x_sorted = slabs.sort(&x_recv)?; // (R_i, C) by expert
                drop(x_recv);
                let (mut kept, mut ys) = (Vec::with_capacity(local), Vec::with_capacity(local));
                let mut at = 0;
                for (expert, &rows) in self.experts.iter().zip(slabs.rows()) {
                    if rows == 0 {
                        kept.push(None);
                        continue;
                    }
                    let (y, k) = expert.forward(&x_sorted.narrow(0, at, rows)?, None, 1)?; // (n_j, C)
                    ys.push(y);
                    kept.push(Some(k));
                    at += rows;
                }
                experts.push(kept);
                match ys.is_empty() {
                    true => x_sorted.zeros_like(), // (0, C): nothing arrived
                    false => slabs.unsort(&Tensor::cat(&ys, 0)?), // (R_i, C) by source rank
                }
            },
            &mut || Ok(()),
        )?;
        let y_back = stacked(ys)?; // (S, C)
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
        // The experts, between the combine's conjugate and the dispatch's, part by part; an
        // expert's weight products kept over the parts, then, beside the last combine, its
        // gradients summed over them: each weight's product formed once on the parts' rows
        // stacked (one GEMM of the full depth) where `grads` forms its products.
        let per_expert = RefCell::new(
            (wts.experts.iter())
                .map(|_| WeightGrads::deferred())
                .collect::<Vec<_>>(),
        );
        let mut forwards = experts.into_iter(); // part by part, as the forward kept them
        let experts = &mut |i: usize, dy_recv: Tensor| -> Result<Tensor> {
            let slabs = &route.parts[i].slabs;
            let dy_sorted = slabs.sort(&dy_recv)?; // (R_i, C) by expert
            drop(dy_recv);
            let part = forwards
                .next()
                .ok_or_else(|| err(format!("moe tape: no forward of part {i}")))?;
            let mut dxs = Vec::with_capacity(part.len());
            let mut at = 0;
            let each = wts.experts.iter().zip(part).zip(slabs.rows());
            for (((expert, kept), &rows), g) in each.zip(per_expert.borrow_mut().iter_mut()) {
                if let Some(kept) = kept {
                    dxs.push(expert.backward(kept, &dy_sorted.narrow(0, at, rows)?, 1, g)?); // (n_j, C)
                    at += rows;
                }
            }
            match dxs.is_empty() {
                true => dy_sorted.zeros_like(),                // (0, C)
                false => slabs.unsort(&Tensor::cat(&dxs, 0)?), // (R_i, C) by source rank
            }
        };
        let weights = &mut || {
            for (expert, g) in wts.experts.iter().zip(per_expert.take()) {
                match g.is_empty() {
                    true => expert.zero_grads(grads)?, // no row of any part reached it
                    false => grads.append_summed(g)?,
                }
            }
            Ok(())
        };
        let dxs = route.round_trip(route.cut(&dy_back)?, experts, weights)?;
        drop(dy_back);
        let dx_perm = stacked(dxs)?; // (S, C)
        let dh = Tensor::zeros((n, c), h.dtype(), dev)?.index_add(&tokens, &dx_perm, 0)?; // (N, C)
        drop(dx_perm);
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
        grads.push((
            wts.router.name().to_string(),
            dw.to_dtype(wts.router.dtype())?,
        ));
        let dh_router = dlogits.matmul(&upcast(&wts.router.get()?)?)?; // (N, C) f32
        dh + dh_router.to_dtype(h.dtype())?
    }
}
