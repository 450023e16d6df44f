//! Recursive halving-doubling all-reduce (Rabenseifner; Thakur, Rabenseifner and Gropp 2005,
//! "Optimization of Collective Communication Operations in MPICH", §4.4): a reduce-scatter by
//! recursive halving, then an all-gather by recursive doubling.
//!
//! For p' = 2^k ranks the data is cut into p' blocks. In halving step j (mask = p'/2^(j+1))
//! rank v exchanges with v XOR mask: of the blocks both still hold, v keeps the half on its
//! side of the mask bit, sends the other half and adds what it receives. After k steps rank v
//! holds block v summed over all ranks. Doubling walks back: in step j (mask = 2^j) rank v
//! sends everything it holds complete to v XOR mask, and the two hold the union. For p' = 8:
//!
//! ```text
//!   reduce-scatter (halving)          rank 0 holds     all-gather (doubling)    rank 0 holds
//!   step 0: v <-> v^4, 4 blocks each   blocks 0..4      step 0: v <-> v^1, 1 block   0..2
//!   step 1: v <-> v^2, 2 blocks each   blocks 0..2      step 1: v <-> v^2, 2 blocks  0..4
//!   step 2: v <-> v^1, 1 block each    block 0 (sum)    step 2: v <-> v^4, 4 blocks  0..8
//! ```
//!
//! Each rank sends N/2 + N/4 + ... + N/p' = (p'−1)/p' · N in each phase, 2(p'−1)/p' · N in all:
//! the ring's bytes in 2·log2 p' steps instead of 2(p'−1).
//!
//! **p not a power of two.** With p' the largest power of two below p and r = p − p' extra
//! ranks, the first 2r ranks pair up before the halving: each even rank 2i sends its whole
//! data to 2i+1, which adds it to its own (the fold), and sits out; the other p' ranks run the
//! algorithm above under new numbers (2i+1 is i, rank q ≥ 2r is q − r), and at the end each
//! odd 2i+1 sends the result back to 2i (the unfold). For p = 6 (p' = 4, r = 2): 0 -> 1 and
//! 2 -> 3 fold; ranks 1, 3, 4, 5 run as 0, 1, 2, 3; 1 -> 0 and 3 -> 2 unfold.
//!
//! The α-β cost (`comm_cost::all_reduce_time`), with the fold's two extra steps when p ≠ p':
//!
//! ```text
//!   T_rhd = 2·log2 p'·α + 2(p'−1)/p' · N/β  [+ 2·(α + N/β)]
//! ```

use super::schedule::{Phase, Schedule, Step, Transfer};
use crate::algo::AllReduceAlgo;

/// The largest power of two not above `n`.
pub fn power_below(n: usize) -> usize {
    1 << (usize::BITS - 1 - n.leading_zeros())
}

/// The halving-doubling all-reduce over `n` ranks, the data cut into p' blocks.
pub(crate) fn schedule(n: usize) -> Schedule {
    let p2 = power_below(n);
    let extra = n - p2;
    // The rank that plays new rank v in the power-of-two algorithm.
    let old = |v: usize| if v < extra { 2 * v + 1 } else { v + extra };
    let pairs = |f: &dyn Fn(usize) -> Transfer| (0..extra).map(f).collect::<Vec<_>>();
    let mut steps = Vec::new();
    if extra > 0 {
        steps.push(Step {
            phase: Phase::Fold,
            transfers: pairs(&|i| Transfer {
                from: 2 * i,
                to: 2 * i + 1,
                blocks: 0..p2,
                reduce: true,
            }),
        });
    }
    // Halving: before the step of `mask`, v holds the 2·mask blocks that share its bits above
    // `mask`; it keeps the half on its side of the bit and sends its partner the other half.
    let mut mask = p2 / 2;
    while mask > 0 {
        let transfers = (0..p2)
            .map(|v| {
                let w = v ^ mask;
                let start = (v & !(2 * mask - 1)) + (w & mask);
                Transfer {
                    from: old(v),
                    to: old(w),
                    blocks: start..start + mask,
                    reduce: true,
                }
            })
            .collect();
        steps.push(Step {
            phase: Phase::ReduceScatter,
            transfers,
        });
        mask /= 2;
    }
    // Doubling: before the step of `mask`, v holds the `mask` blocks that share its bits from
    // `mask` up, complete; it sends them all.
    let mut mask = 1;
    while mask < p2 {
        let transfers = (0..p2)
            .map(|v| {
                let start = v & !(mask - 1);
                Transfer {
                    from: old(v),
                    to: old(v ^ mask),
                    blocks: start..start + mask,
                    reduce: false,
                }
            })
            .collect();
        steps.push(Step {
            phase: Phase::AllGather,
            transfers,
        });
        mask *= 2;
    }
    if extra > 0 {
        steps.push(Step {
            phase: Phase::Unfold,
            transfers: pairs(&|i| Transfer {
                from: 2 * i + 1,
                to: 2 * i,
                blocks: 0..p2,
                reduce: false,
            }),
        });
    }
    Schedule {
        algo: AllReduceAlgo::Rhd,
        ranks: n,
        blocks: p2,
        steps,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eight_ranks_halve_then_double_as_the_table_says() {
        let s = schedule(8);
        let of_rank0: Vec<(usize, std::ops::Range<usize>)> = s
            .steps
            .iter()
            .map(|st| {
                let t = st
                    .transfers
                    .iter()
                    .find(|t| t.from == 0)
                    .expect("rank 0 sends");
                (t.to, t.blocks.clone())
            })
            .collect();
        // Rank 0 sends the half it gives away, then what it holds complete.
        assert_eq!(
            of_rank0,
            vec![
                (4, 4..8),
                (2, 2..4),
                (1, 1..2),
                (1, 0..1),
                (2, 0..2),
                (4, 0..4)
            ]
        );
    }

    #[test]
    fn six_ranks_fold_two_pairs() {
        let s = schedule(6);
        assert_eq!((s.blocks, s.steps.len()), (4, 6));
        let fold: Vec<_> = s.steps[0]
            .transfers
            .iter()
            .map(|t| (t.from, t.to))
            .collect();
        assert_eq!(fold, vec![(0, 1), (2, 3)]);
        let first: Vec<_> = s.steps[1]
            .transfers
            .iter()
            .map(|t| (t.from, t.to))
            .collect();
        assert_eq!(first, vec![(1, 4), (3, 5), (4, 1), (5, 3)]);
        assert_eq!(power_below(6), 4);
        assert_eq!(power_below(8), 8);
    }
}
