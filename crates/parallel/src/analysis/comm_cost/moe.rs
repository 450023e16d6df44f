//! An MoE layer's all-to-alls in a step's tally: the counts exactly, the token rows as a
//! balanced-routing estimate (k·N/E tokens per expert, capped by the capacity). Under
//! `--ep-overlap` each token exchange is [`overlap::PARTS`] all-to-alls of a part of the rows
//! each, and those a computation runs beside are overlappable ([`overlap::parts`]): of the
//! forward's 2k part exchanges all but the first dispatch and the last combine hide behind
//! the neighbouring parts' experts, and of the backward's all but the first (its last hides
//! behind the weight products), so the exposed token rows are 3/(4k) of the inline layer's,
//! at the price of k − 1 more α per exchange.
//!
//! ```text
//!   inline        dispatch (exposed)              combine (exposed)
//!   --ep-overlap  D0 (exposed) | D1 … D(k−1) hidden  C0 … C(k−2) hidden | C(k−1) forward: exposed
//! ```

use mtrain_comm::OpKind;
use mtrain_model::moe::capacity;
use mtrain_model::MoeConfig;

use super::{Group, Phase, Tally};
use crate::expert_parallel::overlap;
use crate::expert_parallel::MoeExchange;

/// Exchange `e` of one micro-batch's layer (`first`: the first token exchange of its pass) on
/// `tokens` tokens of `row` bytes each, inline or in [`overlap::PARTS`] parts when `in_parts`.
pub(super) fn exchange(
    tally: &mut Tally,
    m: &MoeConfig,
    (e, first): (MoeExchange, bool),
    phase: Phase,
    tokens: usize,
    row: u64,
    in_parts: bool,
) {
    let ep = tally.dims.ep;
    let (parts, token_parts) = match in_parts {
        true => (overlap::parts(e, first), overlap::PARTS as u64),
        false => (vec![(e.what(), false)], 1),
    };
    let k = parts.len() as u64;
    for (i, (what, hidden)) in parts.into_iter().enumerate() {
        let (bytes, sent, estimate) = match e {
            MoeExchange::Counts => {
                // One u32 per expert and part of the tokens, E_l of them to each rank.
                let (e_total, el) = (m.n_experts as u64, (m.n_experts / ep) as u64);
                let per = 4 * token_parts;
                (e_total * per, (ep as u64 - 1) * el * per, false)
            }
            MoeExchange::Dispatch | MoeExchange::Combine => {
                let (rows, sent) = balanced_rows(m, tokens, ep);
                let share = |n: u64| n / k + u64::from((i as u64) < n % k);
                (share(rows) * row, share(sent) * row, true)
            }
        };
        let op = OpKind::AllToAll;
        tally.push(Group::Ep, op, what, phase, bytes, sent, hidden, estimate);
    }
}

/// (rows a rank's input holds, rows it sends to other ranks) of a token all-to-all under
/// balanced routing: k·N/E tokens per expert, capped by the capacity.
fn balanced_rows(m: &MoeConfig, tokens: usize, ep: usize) -> (u64, u64) {
    let cap = capacity(tokens, m.n_experts, m.top_k, m.capacity_factor);
    let per_expert = ((m.top_k * tokens) as f64 / m.n_experts as f64).round() as usize;
    let kept = per_expert.min(cap) * m.n_experts;
    let remote = kept * (ep - 1) / ep;
    (kept as u64, remote as u64)
}
