//! The α-β cost of each all-reduce algorithm of the CPU backend, and the `auto` rule it
//! implies: at each message size, the algorithm the model says is fastest.
//!
//! ```text
//!   algorithm  time                                          D = ⌊log2 p⌋, p' = 2^⌊log2 p⌋
//!   ring       2(p−1)·α + 2(p−1)/p · S/β
//!   tree       2(D+k−1)·(α + f·S/(k·β))                      k pieces, f = min(2, p−1) children
//!   rhd        2·log2 p'·α + 2(p'−1)/p' · S/β  [+ 2(α + S/β) when p ≠ p': the fold]
//! ```
//!
//! In this model halving-doubling is never slower than the ring on a power of two (the same
//! bytes in fewer steps) and the tree wins only where its fewer steps matter; a machine's own
//! crossovers (the ring's pipelining, contention, copies) are what `bench-comm --fit` measures.

use mtrain_comm::cpu::TREE_PIECE_BYTES;
use mtrain_comm::{AllReduceAlgo, AutoRule, OpKind};

use super::{CostModel, OpTime};

/// Predicted time of an all-reduce of `bytes` over `n` ranks by `algo`.
pub fn all_reduce_time(model: &CostModel, algo: AllReduceAlgo, n: usize, bytes: u64) -> OpTime {
    if n <= 1 {
        return OpTime::default();
    }
    let (a, b, s) = (model.alpha_s, model.beta_bytes_per_s, bytes as f64);
    match algo {
        AllReduceAlgo::Ring => model.time(OpKind::AllReduce, n, bytes),
        AllReduceAlgo::Tree => {
            let depth = (usize::BITS - 1 - n.leading_zeros()) as f64;
            let pieces = bytes.div_ceil(TREE_PIECE_BYTES as u64).max(1) as f64;
            let fan = n.min(3) as f64 - 1.0;
            let steps = 2.0 * (depth + pieces - 1.0);
            OpTime {
                latency_s: steps * a,
                bandwidth_s: steps * fan * s / pieces / b,
            }
        }
        AllReduceAlgo::Rhd => {
            let p2 = 1usize << (usize::BITS - 1 - n.leading_zeros());
            let log = p2.trailing_zeros() as f64;
            let fold = if p2 == n { 0.0 } else { 2.0 };
            OpTime {
                latency_s: (2.0 * log + fold) * a,
                bandwidth_s: (2.0 * (p2 as f64 - 1.0) / p2 as f64 + fold) * s / b,
            }
        }
    }
}

/// The algorithm the model says is fastest (the ring on a tie, then halving-doubling).
pub fn fastest_all_reduce(model: &CostModel, n: usize, bytes: u64) -> AllReduceAlgo {
    let mut best = AllReduceAlgo::Ring;
    let mut best_t = all_reduce_time(model, best, n, bytes).total_s();
    for algo in [AllReduceAlgo::Rhd, AllReduceAlgo::Tree] {
        let t = all_reduce_time(model, algo, n, bytes).total_s();
        if t < best_t {
            (best, best_t) = (algo, t);
        }
    }
    best
}

/// `auto`'s default rule for groups of `n`: the model's fastest algorithm at every power of
/// two from 1 B to 1 GiB.
pub fn default_auto_rule(model: &CostModel, n: usize) -> AutoRule {
    let best: Vec<(u64, AllReduceAlgo)> = (0..=30)
        .map(|k| (1u64 << k, fastest_all_reduce(model, n, 1 << k)))
        .collect();
    AutoRule::from_best(n, &best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_costs_are_the_tables() {
        let m = CostModel {
            alpha_s: 1e-5,
            beta_bytes_per_s: 1e9,
        };
        let s = 1u64 << 20;
        let ring = all_reduce_time(&m, AllReduceAlgo::Ring, 8, s);
        assert!((ring.latency_s - 14e-5).abs() < 1e-12);
        assert!((ring.bandwidth_s - 1.75 * s as f64 / 1e9).abs() < 1e-12);
        let rhd = all_reduce_time(&m, AllReduceAlgo::Rhd, 8, s);
        assert!((rhd.latency_s - 6e-5).abs() < 1e-12);
        assert_eq!(rhd.bandwidth_s, ring.bandwidth_s);
        // 6 ranks: p' = 4, two extra steps of the whole message for the fold.
        let rhd6 = all_reduce_time(&m, AllReduceAlgo::Rhd, 6, s);
        assert!((rhd6.latency_s - 6e-5).abs() < 1e-12);
        assert!((rhd6.bandwidth_s - 3.5 * s as f64 / 1e9).abs() < 1e-12);
        // One piece: 2·D steps of the whole message to two children.
        let tree = all_reduce_time(&m, AllReduceAlgo::Tree, 8, 1024);
        assert!((tree.latency_s - 6e-5).abs() < 1e-12);
        assert!((tree.bandwidth_s - 6.0 * 2.0 * 1024.0 / 1e9).abs() < 1e-15);
    }

    #[test]
    fn off_powers_of_two_the_default_rule_is_tree_then_ring() {
        let m = CostModel::CPU_LOOPBACK_DEFAULT;
        assert_eq!(fastest_all_reduce(&m, 8, 1 << 30), AllReduceAlgo::Rhd);
        let six = default_auto_rule(&m, 6);
        assert_eq!(six.pick(8), AllReduceAlgo::Tree, "4 steps against the fold's 6");
        assert_eq!(six.pick(1 << 30), AllReduceAlgo::Ring);
        assert_eq!(default_auto_rule(&m, 2).pick(1 << 20), AllReduceAlgo::Ring);
    }
}
