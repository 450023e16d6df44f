//! Tree all-reduce: a binary-tree reduce to the root, then a binary-tree broadcast from it,
//! each pipelined in pieces.
//!
//! The ranks form a binary tree in heap order: rank v's parent is (v-1)/2, its children 2v+1
//! and 2v+2. For p = 8 (depth D = ⌊log2 p⌋ = 3):
//!
//! ```text
//!                 0                 reduce (D steps, deepest level first):
//!             /       \               step 0: 7 -> 3
//!           1           2             step 1: 3 -> 1, 4 -> 1, 5 -> 2, 6 -> 2
//!         /   \       /   \           step 2: 1 -> 0, 2 -> 0
//!        3     4     5     6        each receiver adds what it gets to its own values; the
//!       /                           root ends with the sum over all ranks.
//!      7                            broadcast (D steps): the same edges, downwards, copied.
//! ```
//!
//! Every rank but the root sends the whole message (N bytes) once to its parent, and every
//! rank sends it once to each child: N per level of the tree it takes part in. Only 2·D steps
//! (against the ring's 2(p−1)), so small messages finish sooner; but an inner rank receives
//! from two children and sends to two, so large messages move at about half a link's speed.
//!
//! **Pipelined.** A phase is walked once per piece of [`TREE_PIECE_BYTES`]: a rank forwards
//! piece k to its parent as soon as both children's piece k arrived, while they already send
//! piece k+1, so the depth costs one piece's time per level instead of the whole message's.
//! With k pieces of s = N/k bytes and f = min(2, p−1) children per inner rank, the α-β cost is
//!
//! ```text
//!   T_tree = 2·(D + k − 1)·(α + f·s/β)
//! ```
//!
//! (`comm_cost::all_reduce_time`). Partial sums and the broadcast result travel in the
//! accumulation type (f32 for half precision), like the ring's reduce-scatter.

use super::schedule::{Phase, Schedule, Step, Transfer};
use crate::algo::AllReduceAlgo;

/// Size of a pipeline piece.
pub const TREE_PIECE_BYTES: usize = 256 << 10;

/// Depth of rank v in the heap-ordered tree: ⌊log2(v+1)⌋.
fn depth(v: usize) -> usize {
    (usize::BITS - 1 - (v + 1).leading_zeros()) as usize
}

/// The tree all-reduce over `n` ranks: the data is one block; `D` reduce steps, deepest level
/// first, then `D` broadcast steps from the root down.
pub(crate) fn schedule(n: usize) -> Schedule {
    let d = depth(n - 1);
    let at_level = |level: usize| (0..n).filter(move |&v| depth(v) == level);
    let mut steps = Vec::new();
    for level in (1..=d).rev() {
        let transfers = at_level(level)
            .map(|v| Transfer {
                from: v,
                to: (v - 1) / 2,
                blocks: 0..1,
                reduce: true,
            })
            .collect();
        steps.push(Step {
            phase: Phase::Reduce,
            transfers,
        });
    }
    for level in 0..d {
        let transfers = at_level(level)
            .flat_map(|v| [2 * v + 1, 2 * v + 2])
            .filter(|&c| c < n)
            .map(|c| Transfer {
                from: (c - 1) / 2,
                to: c,
                blocks: 0..1,
                reduce: false,
            })
            .collect();
        steps.push(Step {
            phase: Phase::Broadcast,
            transfers,
        });
    }
    Schedule {
        algo: AllReduceAlgo::Tree,
        ranks: n,
        blocks: 1,
        steps,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tree_of_eight_is_the_picture() {
        let s = schedule(8);
        let edges: Vec<Vec<(usize, usize)>> = s
            .steps
            .iter()
            .map(|st| st.transfers.iter().map(|t| (t.from, t.to)).collect())
            .collect();
        assert_eq!(
            edges,
            vec![
                vec![(7, 3)],
                vec![(3, 1), (4, 1), (5, 2), (6, 2)],
                vec![(1, 0), (2, 0)],
                vec![(0, 1), (0, 2)],
                vec![(1, 3), (1, 4), (2, 5), (2, 6)],
                vec![(3, 7)],
            ]
        );
    }
}
