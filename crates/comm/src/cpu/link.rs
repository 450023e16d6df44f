//! The link emulator: every message of the CPU backend takes α + bytes/β on an emulated wire,
//! so a laptop shows what a slow link does to a layout, and a test can measure overlap on a busy
//! machine whose own loopback transfers are too fast and too noisy to show it.
//!
//! ```text
//!   rank 0 comm thread   [headers][real transfer]zzzzzzzzzzzzzzzzzzzzzzzz| result handed over
//!   rank 1 comm thread   [headers][real transfer]zzzzzzzzzzzzzzzzzzzzzzzz| result handed over
//!                                 ^ all ranks present       ^ synced + Σ_steps (α + bytes_step / β)
//! ```
//!
//! An op runs for real (its headers, then its algorithm over loopback TCP), and then the
//! thread that ran it sleeps until the emulated wire would have delivered it: the moment every
//! rank was present (its header exchange, or a receive's header read) plus the time of the
//! steps the op's algorithm takes one after another. A step's messages travel at once, and
//! the step costs α plus the bytes of its busiest link over β, on the link's [`Topology`]
//! (`switch`: a rank's port; `ring`: the ranks in order on a ring of links, where a message d
//! places away crosses min(d, p−d) of them): the rule and its picture are
//! [`super::topology`]'s, the same the cost model prices with.
//!
//! | op | steps (B: the op's input bytes, n ranks) |
//! | --- | --- |
//! | all-reduce | its algorithm's schedule ([`super::all_reduce_schedule`]), the tree's phases pipelined in pieces (ring: 2(n−1) steps of B/n to the next rank) |
//! | reduce-scatter | n−1 of B/n, each rank to the next |
//! | all-gather | n−1 of B (each rank's part), each rank to the next |
//! | broadcast, reduce | ⌈log₂ n⌉ of B (the binomial tree, root 0) |
//! | scatter, gather | n−1 of B/n (the root's, one after another) |
//! | all-to-all | n−1 of B/n: in step j every rank sends to the rank j on |
//! | send | none: the sender hands the bytes over and goes on |
//! | recv | one of B, held from its header's arrival |
//! | barrier | one empty message (α) |
//!
//! On a switch every step above but the tree all-reduce's costs α + (its largest message)/β.
//! The hold is a sleep on the thread that runs the op (an async op's communication thread), so
//! the emulated time is spent on the wire and not on a core: compute issued after an async op
//! really overlaps it, and the caller's `wait()` counts only what is left of it as exposed. The
//! op headers ride free. Presets of real links (`nvlink4`, `pcie4`, `ib-ndr`, …) are the cost
//! model's; this backend takes plain numbers.

use std::time::{Duration, Instant};

use super::topology::{all_reduce_cost, Topology, WireCost};
use crate::algo::AllReduceAlgo;
use crate::communicator::{CommError, OpKind, Result};

/// An emulated link: each step takes `alpha` plus its busiest link's bytes over `bytes_per_s`,
/// the links wired as `topology` says.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkEmulator {
    /// Latency of one message.
    pub alpha: Duration,
    /// Bandwidth of one link in one direction, bytes per second.
    pub bytes_per_s: f64,
    pub topology: Topology,
}

impl LinkEmulator {
    /// A link of `alpha_us` microseconds latency and `gb_per_s` GB/s (10⁹ bytes) bandwidth.
    pub fn new(alpha_us: f64, gb_per_s: f64) -> Result<Self> {
        if !(alpha_us.is_finite() && alpha_us >= 0.0) || !(gb_per_s.is_finite() && gb_per_s > 0.0) {
            return Err(CommError::InvalidGroup(format!(
                "an emulated link needs a latency ≥ 0 µs and a bandwidth > 0 GB/s; got {alpha_us} µs, {gb_per_s} GB/s"
            )));
        }
        Ok(Self {
            alpha: Duration::from_secs_f64(alpha_us * 1e-6),
            bytes_per_s: gb_per_s * 1e9,
            topology: Topology::Switch,
        })
    }

    /// The same link wired as `topology`.
    pub fn on(self, topology: Topology) -> Self {
        Self { topology, ..self }
    }

    /// The wire time of one message of `bytes`: α + bytes/β.
    pub fn message(&self, bytes: f64) -> Duration {
        self.alpha + Duration::from_secs_f64(bytes.max(0.0) / self.bytes_per_s)
    }

    /// The wire time of `op` over `ranks` ranks with `bytes` of input (the table above);
    /// `algo` is the all-reduce's algorithm.
    pub fn op_time(&self, op: OpKind, bytes: u64, ranks: usize, algo: AllReduceAlgo) -> Duration {
        let cost = op_cost(op, bytes, ranks, algo, self.topology);
        Duration::from_secs_f64(cost.seconds(self.alpha.as_secs_f64(), self.bytes_per_s))
    }

    /// Sleep until `synced + wire` (at once if it has passed).
    pub(crate) fn hold_until(synced: Instant, wire: Duration) {
        let deadline = synced + wire;
        let now = Instant::now();
        if deadline > now {
            std::thread::sleep(deadline - now);
        }
    }
}

/// The steps of `op` over `ranks` ranks with `bytes` of input on `topology` (the table
/// above), priced in α-β terms.
pub fn op_cost(
    op: OpKind,
    bytes: u64,
    ranks: usize,
    algo: AllReduceAlgo,
    topology: Topology,
) -> WireCost {
    let (b, n) = (bytes as f64, ranks.max(1));
    if n == 1 && op != OpKind::Recv {
        return WireCost::default();
    }
    // `count` steps, step j's messages from `messages(j)`.
    let steps = |count: usize, messages: &dyn Fn(usize) -> Vec<(usize, usize, f64)>| {
        let all: Vec<Vec<(usize, usize, f64)>> = (0..count).map(messages).collect();
        WireCost::of_steps(topology, n, all.iter().map(|s| s.as_slice()))
    };
    let to_next = |part: f64| move |_: usize| (0..n).map(|r| (r, (r + 1) % n, part)).collect();
    match op {
        OpKind::AllReduce => all_reduce_cost(algo, n, bytes, topology),
        OpKind::ReduceScatter => steps(n - 1, &to_next(b / n as f64)),
        OpKind::AllGather => steps(n - 1, &to_next(b)),
        OpKind::Scatter | OpKind::Gather => steps(n - 1, &|j| vec![(0, j + 1, b / n as f64)]),
        OpKind::AllToAll => steps(n - 1, &|j| {
            (0..n).map(|r| (r, (r + j + 1) % n, b / n as f64)).collect()
        }),
        OpKind::Broadcast | OpKind::Reduce => {
            // The binomial tree from root 0, highest bit first: holders v send to v + mask.
            let depth = usize::BITS as usize - (n - 1).leading_zeros() as usize; // ⌈log₂ n⌉
            steps(depth, &|j| {
                let mask = 1 << (depth - 1 - j);
                (0..n)
                    .step_by(2 * mask)
                    .filter(|v| v + mask < n)
                    .map(|v| (v, v + mask, b))
                    .collect()
            })
        }
        OpKind::Recv => steps(1, &|_| vec![(0, 1 % n, b)]),
        OpKind::Barrier => steps(1, &|_| vec![]),
        OpKind::Send => WireCost::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_all_reduce_is_two_n_minus_one_messages_of_a_block() {
        let link = LinkEmulator::new(1000.0, 1.0).unwrap(); // 1 ms, 1 GB/s
        let t = link.op_time(OpKind::AllReduce, 4_000_000, 4, AllReduceAlgo::Ring);
        // 6 steps of (1 ms + 1 MB / 1 GB/s = 1 ms)
        assert!((t.as_secs_f64() - 6.0 * 2e-3).abs() < 1e-9, "{t:?}");
        let ag = link.op_time(OpKind::AllGather, 1_000_000, 4, AllReduceAlgo::Ring);
        assert!((ag.as_secs_f64() - 3.0 * 2e-3).abs() < 1e-9, "{ag:?}");
        assert_eq!(
            link.op_time(OpKind::Send, 1 << 20, 2, AllReduceAlgo::Ring),
            Duration::ZERO
        );
    }

    #[test]
    fn on_a_ring_the_all_to_all_pays_for_distance() {
        let switch = LinkEmulator::new(0.0, 1.0).unwrap(); // 1 GB/s, no latency
        let ring = switch.on(Topology::Ring);
        // 8 ranks, 8 MB: seven steps of 1 MB to the rank j on. A switch: 7 MB on a port.
        let t = switch.op_time(OpKind::AllToAll, 8_000_000, 8, AllReduceAlgo::Ring);
        assert!((t.as_secs_f64() - 7e-3).abs() < 1e-9, "{t:?}");
        // A ring: j = 1, 2, 3 load a link with j MB, j = 4 half-way (2 MB), 5..7 as 3..1.
        let t = ring.op_time(OpKind::AllToAll, 8_000_000, 8, AllReduceAlgo::Ring);
        assert!((t.as_secs_f64() - 14e-3).abs() < 1e-9, "{t:?}");
        // The ring algorithm's neighbour steps cost the same on both.
        for op in [OpKind::AllGather, OpKind::ReduceScatter, OpKind::Barrier] {
            let s = switch.op_time(op, 8_000_000, 8, AllReduceAlgo::Ring);
            assert_eq!(s, ring.op_time(op, 8_000_000, 8, AllReduceAlgo::Ring), "{op:?}");
        }
        // The binomial broadcast on a switch: 3 steps of the whole message.
        let t = switch.op_time(OpKind::Broadcast, 1_000_000, 8, AllReduceAlgo::Ring);
        assert!((t.as_secs_f64() - 3e-3).abs() < 1e-9, "{t:?}");
    }

    #[test]
    fn a_link_without_bandwidth_is_refused() {
        let err = LinkEmulator::new(5.0, 0.0).unwrap_err().to_string();
        assert!(err.contains("bandwidth > 0 GB/s"), "{err}");
    }
}
