//! Dual-batch overlap of the MoE layer's all-to-alls with its experts (`--ep-overlap`): the
//! micro-batch's tokens are cut in two halves, a and b, routed together (one capacity, the
//! same drops), and while half a's experts compute, half b's dispatch is on the wire; while
//! half b's experts compute, half a's combine is (DeepEP's and Megatron's
//! `overlap_moe_expert_parallel_comm`, within one layer).
//!
//! ```text
//!   inline    compute  [route]            [ experts (all rows)    ]            [un-permute]
//!             comm            [ dispatch ]                         [ combine ]
//!
//!   --ep-overlap
//!             compute  [route]      [ experts a ][ experts b ]      [un-permute]
//!             comm            [D a ][ D b       ][ C a       ][C b ]
//!                             ^^^^^^ exposed                   ^^^^^ exposed
//! ```
//!
//! The group's all-to-alls cross the wire one after another in the order they were issued, so
//! the first half's dispatch and the last half's combine stay exposed: at best half of the
//! inline exchange, when each half's experts take at least as long as one half's all-to-all
//! (the cost model prices it so, `analysis/comm_cost/`). The backward runs the same timeline on
//! the gradients: the dispatch carries each half's output gradients to the experts, whose
//! backward (weight gradients summed over the halves) runs while the other half's rows travel,
//! and the combine brings the input gradients back. Each expert computes the rows of a half as
//! it would have computed them among all rows, so the layer's output is the inline one; its
//! weight gradient is the sum of the halves' products.
//!
//! Legend: `S_i` rows this rank sends of half i, `R_i` rows its experts receive, `F` features.

use candle_core::{Result, Tensor};
use mtrain_comm::Comm;
use mtrain_model::tape::PartRows;

use super::MoeExchange;
use crate::ops::comm_err;

/// The parts `--ep-overlap` cuts a micro-batch's tokens into.
pub const PARTS: usize = 2;

/// The all-to-alls exchange `e` is issued as under dual-batch overlap, in order: what each
/// carries and whether an expert computation runs while it crosses the wire (the timeline
/// above). `first`: `e` is its pass's first token exchange (the forward's dispatch, the
/// backward's conjugate of the combine), whose half a waits with nothing to compute; the
/// other's half b leaves after the last experts. The counts stay one all-to-all.
pub fn halves(e: MoeExchange, first: bool) -> Vec<(&'static str, bool)> {
    let what = match e {
        MoeExchange::Counts => return vec![(e.what(), false)],
        MoeExchange::Dispatch => ["expert dispatch, half a", "expert dispatch, half b"],
        MoeExchange::Combine => ["expert combine, half a", "expert combine, half b"],
    };
    vec![(what[0], !first), (what[1], first)]
}

/// Every part's dispatch issued at once; as part i's rows arrive, `experts(i, rows)` computes
/// while the next part's dispatch (and the previous part's combine) crosses the wire, and part
/// i's result leaves at once; returns each part's rows back (S_i, F), waited at the end.
pub fn dual_batch(
    group: &Comm,
    parts: Vec<PartRows<'_>>,
    experts: &mut dyn FnMut(usize, Tensor) -> Result<Tensor>,
) -> Result<Vec<Tensor>> {
    let arriving = parts
        .iter()
        .map(|p| Ok(group.all_to_all_async(&p.x.contiguous()?, p.send, p.recv))) // (R_i, F)
        .collect::<Result<Vec<_>>>()?;
    let mut leaving = Vec::with_capacity(parts.len());
    for (i, (p, work)) in parts.iter().zip(arriving).enumerate() {
        let x = work.wait().map_err(comm_err)?; // (R_i, F) by source rank
        let y = experts(i, x)?; // the next part's dispatch on the wire meanwhile
        leaving.push(group.all_to_all_async(&y.contiguous()?, p.recv, p.send)); // (S_i, F)
    }
    leaving
        .into_iter()
        .map(|w| w.wait().map_err(comm_err))
        .collect()
}
