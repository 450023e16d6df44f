//! The α-β cost of each all-reduce algorithm of the CPU backend on a topology of links, and the
//! `auto` rule it implies: at each message size, the algorithm the model says is fastest.
//!
//! The cost is the link emulator's (`mtrain_comm::cpu::all_reduce_cost`, the rule and its
//! picture in `crates/comm/src/cpu/topology.rs`): each step of the algorithm's schedule costs
//! α + L/β, L the bytes on its busiest link, the tree's phases pipelined in pieces. So
//! `--algo auto`'s default thresholds for a `--link` are the sizes where the emulated times
//! cross. At p = 8 (k tree pieces of s bytes):
//!
//! ```text
//!   algorithm  switch                               ring of links
//!   ring       14·α + 1.75·S/β                      the same: every step to a neighbour
//!   tree       2(k+2)·α + (10 + 4(k−1))·s/β          2(k+2)·α + (12 + 7(k−1))·s/β
//!   rhd        6·α + 1.75·S/β                       6·α + 3.25·S/β
//! ```
//!
//! (rhd on p not a power of two adds the fold and unfold, 2(α + S/β) on a switch.)
//! On a switch halving-doubling is never slower than the ring on a power of two (the same
//! bytes in fewer steps). On a ring of links its long-distance steps share links, so the ring
//! algorithm wins large messages there; a machine's own crossovers (the ring's pipelining, contention,
//! copies) are what `bench-comm --fit` measures.

use mtrain_comm::cpu::{all_reduce_cost, Topology};
use mtrain_comm::{AllReduceAlgo, AutoRule};

use super::{CostModel, OpTime};

/// Predicted time of an all-reduce of `bytes` over `n` ranks by `algo` on `topology`.
pub fn all_reduce_time(
    model: &CostModel,
    topology: Topology,
    algo: AllReduceAlgo,
    n: usize,
    bytes: u64,
) -> OpTime {
    let cost = all_reduce_cost(algo, n, bytes, topology);
    OpTime {
        latency_s: cost.steps * model.alpha_s,
        bandwidth_s: cost.link_bytes / model.beta_bytes_per_s,
    }
}

/// The algorithm the model says is fastest (the ring on a tie, then halving-doubling).
pub fn fastest_all_reduce(
    model: &CostModel,
    topology: Topology,
    n: usize,
    bytes: u64,
) -> AllReduceAlgo {
    let mut best = AllReduceAlgo::Ring;
    let mut best_t = all_reduce_time(model, topology, best, n, bytes).total_s();
    for algo in [AllReduceAlgo::Rhd, AllReduceAlgo::Tree] {
        let t = all_reduce_time(model, topology, algo, n, bytes).total_s();
        if t < best_t {
            (best, best_t) = (algo, t);
        }
    }
    best
}

/// `auto`'s default rule for groups of `n` on `topology`: the model's fastest algorithm at every
/// power of two from 1 B to 1 GiB.
pub fn default_auto_rule(model: &CostModel, topology: Topology, n: usize) -> AutoRule {
    let best: Vec<(u64, AllReduceAlgo)> = (0..=30)
        .map(|k| (1u64 << k, fastest_all_reduce(model, topology, n, 1 << k)))
        .collect();
    AutoRule::from_best(n, &best)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mtrain_comm::cpu::LinkEmulator;
    use mtrain_comm::OpKind;

    #[test]
    fn the_costs_are_the_tables() {
        let m = CostModel {
            alpha_s: 1e-5,
            beta_bytes_per_s: 1e9,
        };
        let sw = Topology::Switch;
        let s = 1u64 << 20;
        let ring = all_reduce_time(&m, sw, AllReduceAlgo::Ring, 8, s);
        assert!((ring.latency_s - 14e-5).abs() < 1e-12);
        assert!((ring.bandwidth_s - 1.75 * s as f64 / 1e9).abs() < 1e-12);
        let rhd = all_reduce_time(&m, sw, AllReduceAlgo::Rhd, 8, s);
        assert!((rhd.latency_s - 6e-5).abs() < 1e-12);
        assert_eq!(rhd.bandwidth_s, ring.bandwidth_s);
        // 6 ranks: p' = 4, two extra steps of the whole message for the fold.
        let rhd6 = all_reduce_time(&m, sw, AllReduceAlgo::Rhd, 6, s);
        assert!((rhd6.latency_s - 6e-5).abs() < 1e-12);
        assert!((rhd6.bandwidth_s - 3.5 * s as f64 / 1e9).abs() < 1e-12);
        // One piece: 2·D steps; 10 messages' worth on the busiest ports (the table).
        let tree = all_reduce_time(&m, sw, AllReduceAlgo::Tree, 8, 1024);
        assert!((tree.latency_s - 6e-5).abs() < 1e-12);
        assert!((tree.bandwidth_s - 10.0 * 1024.0 / 1e9).abs() < 1e-15);
        // On a ring of links the ring algorithm is unchanged and halving-doubling pays 3.25·S.
        let rg = Topology::Ring;
        assert_eq!(all_reduce_time(&m, rg, AllReduceAlgo::Ring, 8, s), ring);
        let rhd = all_reduce_time(&m, rg, AllReduceAlgo::Rhd, 8, s);
        assert!((rhd.bandwidth_s - 3.25 * s as f64 / 1e9).abs() < 1e-12);
    }

    #[test]
    fn off_powers_of_two_the_default_rule_is_tree_then_ring() {
        let m = CostModel::CPU_LOOPBACK_DEFAULT;
        let sw = Topology::Switch;
        assert_eq!(fastest_all_reduce(&m, sw, 8, 1 << 30), AllReduceAlgo::Rhd);
        let six = default_auto_rule(&m, sw, 6);
        assert_eq!(six.pick(8), AllReduceAlgo::Tree, "4 steps against the fold's 6");
        assert_eq!(six.pick(1 << 30), AllReduceAlgo::Ring);
        assert_eq!(default_auto_rule(&m, sw, 2).pick(1 << 20), AllReduceAlgo::Ring);
    }

    /// The link of the docs/results.md sweep: 1 ms per step, 50 MB/s per link.
    const SLOW: CostModel = CostModel {
        alpha_s: 1e-3,
        beta_bytes_per_s: 5e7,
    };

    #[test]
    fn on_a_ring_of_links_halving_doubling_hands_over_to_the_ring() {
        // Crossover where 8·α = 1.5·S/β: S = 267 kB, between 256 and 512 KiB.
        let rule = default_auto_rule(&SLOW, Topology::Ring, 8);
        assert_eq!(
            rule.describe(),
            "ranks 8: up to 262144 B rhd, beyond ring"
        );
        // On a switch nothing hands over to the ring.
        let switch = default_auto_rule(&SLOW, Topology::Switch, 8);
        assert_eq!(switch.pick(1 << 30), AllReduceAlgo::Rhd, "{}", switch.describe());
    }

    /// The emulator's held times at p = 8 on a ring of links, 8 B to 64 MiB: the tree or
    /// halving-doubling beat the ring up to 4 KiB, the ring beats both from 16 MiB, and
    /// `auto`'s default rule (from the cost model) is within 10% of the best at every size,
    /// on the powers of two and between them.
    #[test]
    fn the_emulated_crossover_at_eight_ranks_and_auto_within_ten_percent() {
        let link = LinkEmulator::new(SLOW.alpha_s * 1e6, SLOW.beta_bytes_per_s / 1e9)
            .expect("link")
            .on(Topology::Ring);
        let rule = default_auto_rule(&SLOW, Topology::Ring, 8);
        let sizes = (3..=26).flat_map(|k| [1u64 << k, 3 << (k - 1)]);
        for bytes in sizes.filter(|&b| b <= 1 << 26) {
            let t = |algo| link.op_time(OpKind::AllReduce, bytes, 8, algo).as_secs_f64();
            let [ring, tree, rhd] = AllReduceAlgo::ALL.map(t);
            let best = ring.min(tree).min(rhd);
            if bytes <= 4096 {
                assert!(tree.min(rhd) < ring, "{bytes} B: ring {ring} tree {tree} rhd {rhd}");
            }
            if bytes >= 16 << 20 {
                assert!(ring < tree.min(rhd), "{bytes} B: ring {ring} tree {tree} rhd {rhd}");
            }
            let auto = t(rule.pick(bytes));
            assert!(auto <= 1.10 * best, "{bytes} B: auto {auto} best {best}");
            // The cost model and the emulator are one rule.
            for algo in AllReduceAlgo::ALL {
                let model = all_reduce_time(&SLOW, Topology::Ring, algo, 8, bytes).total_s();
                assert!((model - t(algo)).abs() < 1e-6, "{algo} {bytes} B");
            }
        }
    }
}
