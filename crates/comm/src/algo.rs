//! Which algorithm an all-reduce runs, and `auto`'s rule for choosing one by message size and
//! group size, as NCCL chooses among its algorithms per size.
//!
//! ```text
//!   algorithm   steps          bytes a rank sends     good for
//!   ring        2(p-1)         2(p-1)/p · S           large messages: bandwidth-optimal, pipelined
//!   tree        2·⌊log2 p⌋     S up + S per child     small messages: few steps
//!   rhd         2·log2 p (+2)  2(p-1)/p · S (+S)      between: few steps, bandwidth-optimal
//! ```
//!
//! (rhd is recursive halving-doubling; the `+` terms are the fold of a group that is not a
//! power of two.) An [`AutoRule`] for one group size is a list of size bands, each naming the
//! algorithm for messages up to its size, and the algorithm beyond the last band:
//!
//! ```text
//!   ranks 8: up to 4 KiB tree, up to 1 MiB rhd, beyond ring
//! ```
//!
//! Every rank of a group computes the same choice from the same rule, the message's size and
//! the group's size; the CPU backend also sends it in the op's header, so ranks configured
//! differently fail with a mismatch instead of running two algorithms against each other.

use serde::{Deserialize, Serialize};

/// The all-reduce algorithms of the CPU backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AllReduceAlgo {
    /// Ring reduce-scatter + ring all-gather (`cpu/ring.rs`).
    Ring,
    /// Binary-tree reduce then broadcast, pipelined in pieces (`cpu/binary_tree.rs`).
    Tree,
    /// Reduce-scatter by recursive halving, all-gather by recursive doubling
    /// (`cpu/halving_doubling.rs`).
    Rhd,
}

impl AllReduceAlgo {
    pub const ALL: [AllReduceAlgo; 3] =
        [AllReduceAlgo::Ring, AllReduceAlgo::Tree, AllReduceAlgo::Rhd];

    /// The name on the command line and in tables: `ring`, `tree`, `rhd`.
    pub fn name(self) -> &'static str {
        match self {
            AllReduceAlgo::Ring => "ring",
            AllReduceAlgo::Tree => "tree",
            AllReduceAlgo::Rhd => "rhd",
        }
    }
}

impl std::fmt::Display for AllReduceAlgo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Messages up to `up_to_bytes` (inclusive) run `algo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Band {
    pub up_to_bytes: u64,
    pub algo: AllReduceAlgo,
}

/// `auto`'s choice for groups of `ranks` ranks: the first band whose size a message does not
/// exceed, else `beyond`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AutoRule {
    pub ranks: usize,
    pub beyond: AllReduceAlgo,
    /// In increasing `up_to_bytes`.
    #[serde(default)]
    pub bands: Vec<Band>,
}

impl AutoRule {
    /// The rule that picks, at each size, the fastest algorithm of `best` (pairs of message
    /// bytes and the algorithm fastest there, in increasing size): each run of sizes with one
    /// winner becomes a band reaching to the largest size of the run, and the winner at the
    /// largest size runs beyond. Sizes between two measured ones go with the smaller.
    pub fn from_best(ranks: usize, best: &[(u64, AllReduceAlgo)]) -> AutoRule {
        let mut bands: Vec<Band> = Vec::new();
        for &(bytes, algo) in best {
            match bands.last_mut() {
                Some(last) if last.algo == algo => last.up_to_bytes = bytes,
                _ => bands.push(Band {
                    up_to_bytes: bytes,
                    algo,
                }),
            }
        }
        let beyond = bands.pop().map_or(AllReduceAlgo::Ring, |b| b.algo);
        AutoRule {
            ranks,
            bands,
            beyond,
        }
    }

    /// The algorithm for a message of `bytes`.
    pub fn pick(&self, bytes: u64) -> AllReduceAlgo {
        self.bands
            .iter()
            .find(|b| bytes <= b.up_to_bytes)
            .map_or(self.beyond, |b| b.algo)
    }

    /// One line: `ranks 8: up to 4096 B tree, up to 1048576 B rhd, beyond ring`.
    pub fn describe(&self) -> String {
        let mut s = format!("ranks {}:", self.ranks);
        for b in &self.bands {
            s.push_str(&format!(" up to {} B {},", b.up_to_bytes, b.algo));
        }
        s.push_str(&format!(" beyond {}", self.beyond));
        s
    }
}

/// How a group picks its all-reduce algorithm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AlgoChoice {
    /// Always this one.
    Fixed(AllReduceAlgo),
    /// By message size and group size: the rule of the group's size, else of the nearest size
    /// (the ring when there is none).
    Auto(Vec<AutoRule>),
}

impl Default for AlgoChoice {
    fn default() -> Self {
        AlgoChoice::Fixed(AllReduceAlgo::Ring)
    }
}

impl AlgoChoice {
    /// The algorithm of an all-reduce of `bytes` over `ranks` ranks.
    pub fn pick(&self, bytes: u64, ranks: usize) -> AllReduceAlgo {
        match self {
            AlgoChoice::Fixed(a) => *a,
            AlgoChoice::Auto(rules) => rules
                .iter()
                .min_by_key(|r| r.ranks.abs_diff(ranks))
                .map_or(AllReduceAlgo::Ring, |r| r.pick(bytes)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::AllReduceAlgo::{Rhd, Ring, Tree};
    use super::*;

    #[test]
    fn a_rule_from_the_winners_picks_them_back() {
        let best = [
            (8, Tree),
            (64, Tree),
            (4096, Rhd),
            (1 << 20, Ring),
            (1 << 26, Ring),
        ];
        let rule = AutoRule::from_best(8, &best);
        assert_eq!(
            rule.describe(),
            "ranks 8: up to 64 B tree, up to 4096 B rhd, beyond ring"
        );
        for (bytes, algo) in best {
            assert_eq!(rule.pick(bytes), algo, "{bytes} B");
        }
        assert_eq!(rule.pick(65), Rhd);
        assert_eq!(rule.pick(4097), Ring);
        let choice = AlgoChoice::Auto(vec![rule, AutoRule::from_best(2, &[(8, Ring)])]);
        assert_eq!(choice.pick(8, 6), Tree, "the rule of the nearest size");
        assert_eq!(choice.pick(8, 3), Ring);
        assert_eq!(AlgoChoice::Auto(vec![]).pick(8, 3), Ring);
        assert_eq!(AlgoChoice::Fixed(Rhd).pick(1 << 30, 8), Rhd);
    }
}
