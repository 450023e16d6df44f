//! Pipelined overlap of the MoE layer's all-to-alls with its experts (`--ep-overlap`): the
//! micro-batch's tokens are cut into [`PARTS`] parts, routed together (one capacity, the same
//! drops), and the parts' all-to-alls are issued so that while part i's experts compute, part
//! i+1's dispatch and part i−1's combine are on the wire (DeepEP's and Megatron's
//! `overlap_moe_expert_parallel_comm`, within one layer, over more than two parts).
//!
//! ```text
//!   inline    compute [route]          [ experts, all rows ]          [un-permute]
//!             comm           [ dispatch ]                   [ combine ]
//!
//!   --ep-overlap, k = 4 parts
//!             compute [route]     [  E 0   ][  E 1   ][  E 2   ][  E 3   ][ tail ] [un-permute]
//!             comm           [D0 ][D1 ]     [C0 ][D2 ][C1 ][D3 ][C2 ]     [C3 ]
//!                            ^^^^^ exposed                                ^^^^^ forward: exposed
//! ```
//!
//! The group's all-to-alls cross the wire one after another in the order they were issued, so
//! the order is D0 D1 C0 D2 C1 D3 C2 … C(k−1): part i+1's dispatch leaves before part i's
//! experts compute, and part i's combine right after them. Only the first part's dispatch and
//! the last part's combine have no expert beside them: at best 1/k of the inline exchange
//! stays exposed, when each part's experts take at least as long as two parts' all-to-alls (the
//! cost model prices it so, `analysis/comm_cost/`); on a slower wire the wire sets the pace and
//! the exposure is what it carries beyond the experts. The backward runs the same timeline on
//! the gradients: the dispatch carries each part's output gradients to the experts, whose
//! input gradients go back by the combine; the experts' weight products (dW = dyᵀ·x over the
//! rows of every part at once, one GEMM a weight) are the tail, computed while the last
//! combine crosses. Each expert computes the rows of a part as it would have computed them
//! among all rows, so the layer's output is the inline one; its weight gradient is the product
//! over all its rows.
//!
//! Legend: `S_i` rows this rank sends of part i, `R_i` rows its experts receive, `F` features,
//! `k` parts.

use std::collections::VecDeque;

use candle_core::{Result, Tensor};
use mtrain_comm::{Comm, Work};
use mtrain_model::tape::PartRows;

use super::MoeExchange;
use crate::ops::comm_err;

/// The parts `--ep-overlap` cuts a micro-batch's tokens into.
pub const PARTS: usize = 4;

/// The dispatches' labels, part by part.
const DISPATCH: [&str; PARTS] = [
    "expert dispatch, part 0",
    "expert dispatch, part 1",
    "expert dispatch, part 2",
    "expert dispatch, part 3",
];
/// The combines' labels, part by part.
const COMBINE: [&str; PARTS] = [
    "expert combine, part 0",
    "expert combine, part 1",
    "expert combine, part 2",
    "expert combine, part 3",
];

/// The all-to-alls exchange `e` is issued as under the pipelined overlap, part by part: what
/// each carries and whether a computation runs while it crosses the wire (the timeline
/// above). `first`: `e` is its pass's first token exchange (the forward's dispatch, the
/// backward's conjugate of the combine), whose part 0 waits with nothing to compute. The
/// other's last part leaves after the last experts: exposed in the forward (the combine),
/// beside the weight products in the backward (the dispatch's conjugate). The counts stay one
/// all-to-all.
pub fn parts(e: MoeExchange, first: bool) -> Vec<(&'static str, bool)> {
    let what = match e {
        MoeExchange::Counts => return vec![(e.what(), false)],
        MoeExchange::Dispatch => DISPATCH,
        MoeExchange::Combine => COMBINE,
    };
    let exposed = |i: usize| match (first, e) {
        (true, _) => i == 0,
        (false, MoeExchange::Combine) => i == PARTS - 1,
        (false, _) => false,
    };
    what.into_iter()
        .enumerate()
        .map(|(i, w)| (w, !exposed(i)))
        .collect()
}

/// The parts' round trips pipelined: parts 0 and 1's dispatches issued at once; as part i's
/// rows arrive, its combine's place on the wire is taken right after `experts(i, rows)`
/// (which computes while part i+1's dispatch and part i−1's combine cross), followed by part
/// i+2's dispatch; `tail()` runs while the last combine crosses; returns each part's rows
/// back (S_i, F), waited at the end.
pub fn pipelined(
    group: &Comm,
    parts: Vec<PartRows<'_>>,
    experts: &mut dyn FnMut(usize, Tensor) -> Result<Tensor>,
    tail: &mut dyn FnMut() -> Result<()>,
) -> Result<Vec<Tensor>> {
    let dispatch = |p: &PartRows<'_>| -> Result<Work> {
        Ok(group.all_to_all_async(&p.x.contiguous()?, p.send, p.recv)) // (R_i, F)
    };
    let mut arriving = parts
        .iter()
        .take(2)
        .map(dispatch)
        .collect::<Result<VecDeque<_>>>()?;
    let mut leaving = Vec::with_capacity(parts.len());
    for (i, p) in parts.iter().enumerate() {
        let work = arriving.pop_front().ok_or_else(|| {
            candle_core::Error::Msg(format!("ep overlap: part {i}'s dispatch was not issued"))
        })?;
        let x = work.wait().map_err(comm_err)?; // (R_i, F) by source rank
        let y = experts(i, x)?; // part i+1's dispatch, part i−1's combine on the wire meanwhile
        leaving.push(group.all_to_all_async(&y.contiguous()?, p.recv, p.send)); // (S_i, F)
        if let Some(next) = parts.get(i + 2) {
            arriving.push_back(dispatch(next)?);
        }
    }
    tail()?; // the last combine on the wire meanwhile
    leaving
        .into_iter()
        .map(|w| w.wait().map_err(comm_err))
        .collect()
}
