//! How the ranks' links are wired, and what a step of an algorithm costs on them: the one rule
//! both the link emulator ([`super::link`]) and the cost model (`comm_cost::all_reduce_time`,
//! hence `auto`'s default thresholds) price collectives by.
//!
//! ```text
//!   switch: every pair one hop               ring (p = 8): a bidirectional link from r to r+1
//!                                            (each direction its own bandwidth β)
//!     0   1   2   3   4   5   6   7
//!     │   │   │   │   │   │   │   │              0 ─── 1 ─── 2 ─── 3
//!   ┌─┴───┴───┴───┴───┴───┴───┴───┴─┐            │                 │
//!   │            switch             │            7 ─── 6 ─── 5 ─── 4
//!   └───────────────────────────────┘
//!   a rank's port sends β and receives β     a message d places away crosses min(d, p−d)
//!   at once, whoever the peers are           links, sharing each with the other messages
//!                                            of its step that cross it
//! ```
//!
//! A step (messages that are all in flight at once) costs one α, paid once per message however
//! many links it crosses (the links forward it as it comes, as NVLink and torus routers do),
//! plus the bytes of its busiest directed link over β:
//!
//! ```text
//!   t_step = α + L/β
//!   switch:  L = max over ranks of max(bytes the rank sends, bytes it receives)
//!   ring:    L = max over links and directions of the bytes crossing it; a message from r to
//!            r+d (mod p) goes the shorter way round, over min(d, p−d) links, and half its
//!            bytes each way when d = p/2. When every rank sends b bytes d < p/2 away:
//!            L = b·d
//! ```
//!
//! So on a ring the ring algorithm's steps (every rank to its neighbour, d = 1) cost what they
//! cost on a switch, while halving-doubling's first step (d = p/2) loads every link with p/4 of
//! the half-messages: at p = 8 its bytes on the busiest link are 2·(1 + 1/2 + 1/8)·S = 3.25·S
//! against the ring algorithm's 1.75·S, in 6 steps against 14.
//!
//! A phase walked in k pieces (the tree's pipeline) overlaps its steps: piece i+1 enters a step
//! as piece i leaves it, so the phase costs its steps once for the first piece and its slowest
//! step for each further one:
//!
//! ```text
//!   T_phase = Σ_steps t_step(piece) + (k − 1)·max_steps t_step(piece)
//! ```
//!
//! On the ring topology the group's ranks lie on the ring in rank order; a group of two is one
//! link (the switch's cost).

use super::algorithms::all_reduce_schedule;
use super::binary_tree::TREE_PIECE_BYTES;
use crate::algo::AllReduceAlgo;

/// How the ranks of a group are wired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Topology {
    /// One full-duplex port per rank into a switch of full bisection.
    #[default]
    Switch,
    /// Ranks in order on a ring of bidirectional point-to-point links.
    Ring,
}

impl Topology {
    pub const ALL: [Topology; 2] = [Topology::Switch, Topology::Ring];

    /// The name on the command line: `switch`, `ring`.
    pub fn name(self) -> &'static str {
        match self {
            Topology::Switch => "switch",
            Topology::Ring => "ring",
        }
    }

    /// The topology called `name`, or `None`.
    pub fn parse(name: &str) -> Option<Topology> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    /// L: the most bytes one directed link carries when all of `messages` (from, to, bytes)
    /// between `ranks` ranks are in flight at once.
    pub fn busiest_link(self, ranks: usize, messages: &[(usize, usize, f64)]) -> f64 {
        match self {
            Topology::Ring if ranks > 2 => ring_busiest_link(ranks, messages),
            _ => {
                let (mut sent, mut received) = (vec![0.0; ranks], vec![0.0; ranks]);
                for &(from, to, bytes) in messages {
                    sent[from] += bytes;
                    received[to] += bytes;
                }
                sent.into_iter().chain(received).fold(0.0, f64::max)
            }
        }
    }
}

impl std::fmt::Display for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The ring's L: link r joins r and r+1; `up[r]` is its direction r → r+1, `down[r]` the
/// direction r+1 → r.
fn ring_busiest_link(p: usize, messages: &[(usize, usize, f64)]) -> f64 {
    let (mut up, mut down) = (vec![0.0; p], vec![0.0; p]);
    for &(from, to, bytes) in messages {
        let d = (to + p - from) % p;
        if d == 0 {
            continue;
        }
        let (up_share, down_share) = match (2 * d).cmp(&p) {
            std::cmp::Ordering::Less => (bytes, 0.0),
            std::cmp::Ordering::Equal => (bytes / 2.0, bytes / 2.0),
            std::cmp::Ordering::Greater => (0.0, bytes),
        };
        if up_share > 0.0 {
            for h in 0..d {
                up[(from + h) % p] += up_share;
            }
        }
        if down_share > 0.0 {
            for h in 0..p - d {
                down[(from + p - 1 - h) % p] += down_share;
            }
        }
    }
    up.into_iter().chain(down).fold(0.0, f64::max)
}

/// An op's time on the wire in α-β terms: `steps` each paying α, and `link_bytes` crossing the
/// busiest link of each step in turn, so that the time is `steps·α + link_bytes/β`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct WireCost {
    pub steps: f64,
    pub link_bytes: f64,
}

impl WireCost {
    /// The time on a link of `alpha_s` seconds per step and `bytes_per_s` per link.
    pub fn seconds(&self, alpha_s: f64, bytes_per_s: f64) -> f64 {
        self.steps * alpha_s + self.link_bytes / bytes_per_s
    }

    /// Steps one after another, each of its messages (from, to, bytes) at once.
    pub fn of_steps<'a>(
        topology: Topology,
        ranks: usize,
        steps: impl IntoIterator<Item = &'a [(usize, usize, f64)]>,
    ) -> WireCost {
        let mut cost = WireCost::default();
        for step in steps {
            cost.steps += 1.0;
            cost.link_bytes += topology.busiest_link(ranks, step);
        }
        cost
    }
}

/// The pieces a pipelined all-reduce of `bytes` by `algo` is walked in (the tree's pieces of
/// [`TREE_PIECE_BYTES`]; one for the others).
pub fn all_reduce_pieces(algo: AllReduceAlgo, bytes: u64) -> u64 {
    match algo {
        AllReduceAlgo::Tree => bytes.div_ceil(TREE_PIECE_BYTES as u64).max(1),
        _ => 1,
    }
}

/// The wire cost of an all-reduce of `bytes` over `ranks` ranks by `algo` on `topology`: its
/// schedule's steps ([`all_reduce_schedule`]), each phase pipelined over its pieces as the
/// module's doc says.
pub fn all_reduce_cost(
    algo: AllReduceAlgo,
    ranks: usize,
    bytes: u64,
    topology: Topology,
) -> WireCost {
    if ranks <= 1 {
        return WireCost::default();
    }
    let s = all_reduce_schedule(algo, ranks);
    let pieces = all_reduce_pieces(algo, bytes) as f64;
    let block = bytes as f64 / s.blocks as f64 / pieces;
    let mut cost = WireCost::default();
    for phase in s.steps.chunk_by(|a, b| a.phase == b.phase) {
        let loads: Vec<f64> = phase
            .iter()
            .map(|step| {
                let messages: Vec<(usize, usize, f64)> = step
                    .transfers
                    .iter()
                    .map(|t| (t.from, t.to, t.blocks.len() as f64 * block))
                    .collect();
                topology.busiest_link(ranks, &messages)
            })
            .collect();
        let widest = loads.iter().copied().fold(0.0, f64::max);
        cost.steps += loads.len() as f64 + (pieces - 1.0);
        cost.link_bytes += loads.iter().sum::<f64>() + (pieces - 1.0) * widest;
    }
    cost
}

#[cfg(test)]
mod tests {
    use super::*;
    use AllReduceAlgo::{Rhd, Ring, Tree};

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn a_ring_loads_each_link_with_the_messages_that_cross_it() {
        let ring = Topology::Ring;
        // Every rank of 8 sends 100 B three places on: each link in that direction carries three.
        let shift3: Vec<_> = (0..8).map(|r| (r, (r + 3) % 8, 100.0)).collect();
        assert_eq!(ring.busiest_link(8, &shift3), 300.0);
        // Five places on is three back: the same load, on the other direction.
        let shift5: Vec<_> = (0..8).map(|r| (r, (r + 5) % 8, 100.0)).collect();
        assert_eq!(ring.busiest_link(8, &shift5), 300.0);
        // Half-way round: half each way over 4 links, each link crossed by 4 half-messages.
        let half: Vec<_> = (0..8).map(|r| (r, (r + 4) % 8, 100.0)).collect();
        assert_eq!(ring.busiest_link(8, &half), 200.0);
        // Messages share a link only in the same direction: 3 -> 1 and 4 -> 1 both cross
        // 3 -> 2 and 2 -> 1; 1 -> 3 and 3 -> 1 cross the same links the two ways.
        assert_eq!(ring.busiest_link(8, &[(3, 1, 10.0), (4, 1, 10.0)]), 20.0);
        assert_eq!(ring.busiest_link(8, &[(1, 3, 10.0), (3, 1, 10.0)]), 10.0);
        // On a switch only the ports count: rank 1 receives both.
        let switch = Topology::Switch;
        assert_eq!(switch.busiest_link(8, &shift3), 100.0);
        assert_eq!(switch.busiest_link(8, &[(3, 1, 10.0), (4, 1, 10.0)]), 20.0);
        // A ring of two is one link.
        assert_eq!(ring.busiest_link(2, &[(0, 1, 10.0), (1, 0, 10.0)]), 10.0);
    }

    #[test]
    fn all_reduce_costs_by_hand_at_eight_ranks() {
        let s = 8.0 * 1024.0; // 8 KiB: one tree piece
        let b = s as u64;
        // Ring algorithm: 14 steps of S/8 to a neighbour, on either topology.
        for t in Topology::ALL {
            let c = all_reduce_cost(Ring, 8, b, t);
            assert!(
                close(c.steps, 14.0) && close(c.link_bytes, 1.75 * s),
                "{t}: {c:?}"
            );
        }
        // Halving-doubling on a switch: 6 steps, the ring's bytes.
        let c = all_reduce_cost(Rhd, 8, b, Topology::Switch);
        assert!(
            close(c.steps, 6.0) && close(c.link_bytes, 1.75 * s),
            "{c:?}"
        );
        // On a ring: halving steps at distance 4 (S/2, half each way over 4 links: S on a
        // link), 2 (S/4 over 2 links: S/2), 1 (S/8); the doubling the same backwards.
        let c = all_reduce_cost(Rhd, 8, b, Topology::Ring);
        assert!(
            close(c.steps, 6.0) && close(c.link_bytes, 3.25 * s),
            "{c:?}"
        );
        // Tree on a switch: reduce 7->3 (S), {3,4}->1 and {5,6}->2 (2S into 1 and 2),
        // {1,2}->0 (2S); the broadcast mirrors it.
        let c = all_reduce_cost(Tree, 8, b, Topology::Switch);
        assert!(
            close(c.steps, 6.0) && close(c.link_bytes, 10.0 * s),
            "{c:?}"
        );
        // Tree on a ring: 7->3 is half-way (S/2); 3->1, 4->1, 5->2 all cross 3->2, and half of
        // 6->2 too (3.5S); 1->0 and 2->1->0 share 1->0 (2S). Twice: 12S.
        let c = all_reduce_cost(Tree, 8, b, Topology::Ring);
        assert!(
            close(c.steps, 6.0) && close(c.link_bytes, 12.0 * s),
            "{c:?}"
        );
    }

    #[test]
    fn a_pipelined_phase_pays_its_slowest_step_for_each_further_piece() {
        // 1 MiB: 4 pieces of 256 KiB. Switch: per phase (1 + 2 + 2)·s + 3·2s = 11s.
        let s = TREE_PIECE_BYTES as f64;
        let c = all_reduce_cost(Tree, 8, 4 * TREE_PIECE_BYTES as u64, Topology::Switch);
        assert!(close(c.steps, 2.0 * (3.0 + 3.0)), "{c:?}");
        assert!(close(c.link_bytes, 2.0 * 11.0 * s), "{c:?}");
        assert_eq!(
            all_reduce_cost(Rhd, 1, 1 << 20, Topology::Ring),
            WireCost::default()
        );
        let w = WireCost {
            steps: 6.0,
            link_bytes: 2e9,
        };
        assert!(close(w.seconds(1e-3, 1e9), 2.006));
    }

    #[test]
    fn names_round_trip() {
        for t in Topology::ALL {
            assert_eq!(Topology::parse(t.name()), Some(t));
        }
        assert_eq!(Topology::parse("torus"), None);
    }
}
