//! The differentiable all-to-all: rows go out by `send_splits`, rows come in by `recv_splits`;
//! in backward the gradient travels the reverse way (splits swapped).
//!
//! ```text
//!   forward   rank 0: [a0 a1 | b0]  ──>  rank 0: [a0 a1 | c0 c1 c2]     send_splits  [2, 1]
//!             rank 1: [c0 c1 c2 | d0]    rank 1: [b0 | d0]              recv_splits  [2, 3]
//!   backward  the same picture read right to left: dx = all_to_all(dy, recv_splits, send_splits)
//! ```
//!
//! An all-to-all only moves rows, it never combines them, so its adjoint is the all-to-all that
//! moves each row back to where it came from (Megatron's `_AllToAll` swaps the splits).
//!
//! Mechanism: [`crate::ops`]'s value with a custom backward. The forward result `v` is
//! computed outside the graph on a detached copy, then a two-input custom op `(x, v) ↦ v` is
//! recorded whose backward runs the reverse all-to-all on the incoming gradient and hands it to
//! `x`. The op is recorded whenever `x` descends from a `Var`, **even when `x` or `v` has zero
//! rows**: every rank of the group must issue the backward all-to-all, including one that sent or
//! received nothing, or its peers would wait for it forever.
//!
//! [`MoeExchange`] and [`MOE_EXCHANGES`] describe the MoE layer's three all-to-alls (counts,
//! dispatch, combine) and their backward order: the layer runs them through
//! [`MoeExchange::run`], the cost model counts them from the same list.

use candle_core::{Result, Tensor};
use mtrain_comm::Comm;

use crate::ops::value_with_backward;

/// All-to-all along dim 0 whose backward is the reverse all-to-all.
///
/// `x` (Σ send_splits, …) → (Σ recv_splits, …). Row block `p` of `x` goes to rank `p` of
/// `group`; the output holds the blocks received from ranks 0, 1, … in order.
pub fn all_to_all(
    x: &Tensor,
    send_splits: &[usize],
    recv_splits: &[usize],
    group: &Comm,
) -> Result<Tensor> {
    let v = group
        .all_to_all(&x.detach().contiguous()?, send_splits, recv_splits)
        .map_err(candle_core::Error::wrap)?; // (Σ recv_splits, …)
    let (send, recv, group) = (send_splits.to_vec(), recv_splits.to_vec(), group.clone());
    // Backward sends the gradient rows back: dx = all_to_all(dv, recv, send).
    value_with_backward(x, v, "ep-all-to-all", move |grad| {
        group
            .all_to_all(&grad.contiguous()?, &recv, &send)
            .map_err(candle_core::Error::wrap) // (Σ send_splits, …)
    })
}

/// One of the all-to-alls over ep an expert-parallel MoE layer issues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeExchange {
    /// The kept rows per expert, (E,) u32, `E_l` to each rank: how many rows each peer will
    /// send to each of this rank's experts. No gradient.
    Counts,
    /// The routed token rows (S, C) → (R, C), to the ranks of their experts.
    Dispatch,
    /// The experts' outputs (R, C) → (S, C), back to the tokens' ranks.
    Combine,
}

/// The MoE layer's exchanges in the order its forward issues them. Its backward runs the
/// reverse all-to-all of each one with a gradient, last first ([`MoeExchange::backward_order`]).
pub const MOE_EXCHANGES: [MoeExchange; 3] = [MoeExchange::Counts, MoeExchange::Dispatch, MoeExchange::Combine];

impl MoeExchange {
    /// Whether a gradient travels back through it.
    pub const fn differentiable(self) -> bool {
        !matches!(self, MoeExchange::Counts)
    }

    /// What it carries (the cost model's label).
    pub const fn what(self) -> &'static str {
        match self {
            MoeExchange::Counts => "expert counts",
            MoeExchange::Dispatch => "expert dispatch",
            MoeExchange::Combine => "expert combine",
        }
    }

    /// The exchanges of the layer's backward, in order: combine's reverse, then dispatch's.
    pub fn backward_order() -> impl Iterator<Item = MoeExchange> {
        MOE_EXCHANGES
            .into_iter()
            .rev()
            .filter(|e| e.differentiable())
    }

    /// Runs this exchange of `x` over `group`, given the splits of its own direction for the
    /// counts and of the dispatch for the token exchanges (`send` rows to each rank, `recv`
    /// from each): the combine sends them back the reverse way.
    pub fn run(self, x: &Tensor, send: &[usize], recv: &[usize], group: &Comm) -> Result<Tensor> {
        match self {
            MoeExchange::Counts => group
                .all_to_all(x, send, recv)
                .map_err(candle_core::Error::wrap),
            MoeExchange::Dispatch => all_to_all(x, send, recv, group),
            MoeExchange::Combine => all_to_all(x, recv, send, group),
        }
    }
}
