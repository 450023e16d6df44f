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
