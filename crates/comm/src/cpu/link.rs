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
//! messages the op's algorithm sends one after another. A step's messages travel at once on
//! different links, so a step costs its largest message:
//!
//! | op | messages in sequence (B: the op's input bytes, n ranks) |
//! | --- | --- |
//! | all-reduce | its algorithm's schedule ([`super::all_reduce_schedule`]): each step's largest transfer (ring: 2(n−1) of B/n) |
//! | reduce-scatter | n−1 of B/n |
//! | all-gather | n−1 of B (each rank's part) |
//! | broadcast, reduce | ⌈log₂ n⌉ of B (the binomial tree) |
//! | scatter, gather | n−1 of B/n (the root's, one after another) |
//! | all-to-all | n−1 of B/n (one to each peer, one after another) |
//! | send | none: the sender hands the bytes over and goes on |
//! | recv | one of B, held from its header's arrival |
//! | barrier | one empty message (α) |
//!
//! The hold is a sleep on the thread that runs the op (an async op's communication thread), so
//! the emulated time is spent on the wire and not on a core: compute issued after an async op
//! really overlaps it, and the caller's `wait()` counts only what is left of it as exposed. The
//! op headers ride free. Presets of real links (`nvlink4`, `pcie4`, `ib-ndr`, …) are the cost
//! model's; this backend takes plain numbers.

use std::time::{Duration, Instant};

use super::algorithms::all_reduce_schedule;
use crate::algo::AllReduceAlgo;
use crate::communicator::{CommError, OpKind, Result};

/// A point-to-point link: each message takes `alpha` plus its bytes over `bytes_per_s`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkEmulator {
    /// Latency of one message.
    pub alpha: Duration,
    /// Bandwidth, bytes per second.
    pub bytes_per_s: f64,
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
        })
    }

    /// The wire time of one message of `bytes`: α + bytes/β.
    pub fn message(&self, bytes: f64) -> Duration {
        self.alpha + Duration::from_secs_f64(bytes.max(0.0) / self.bytes_per_s)
    }

    /// `count` messages of `bytes` each, one after another.
    fn messages(&self, count: usize, bytes: f64) -> Duration {
        self.message(bytes) * count as u32
    }

    /// The wire time of `op` over `ranks` ranks with `bytes` of input (the table above);
    /// `algo` is the all-reduce's algorithm.
    pub fn op_time(&self, op: OpKind, bytes: u64, ranks: usize, algo: AllReduceAlgo) -> Duration {
        let (b, n) = (bytes as f64, ranks.max(1));
        if n == 1 && op != OpKind::Recv {
            return Duration::ZERO;
        }
        let tree_depth = usize::BITS as usize - (n - 1).leading_zeros() as usize; // ⌈log₂ n⌉
        match op {
            OpKind::AllReduce => {
                let s = all_reduce_schedule(algo, n);
                let block = b / s.blocks.max(1) as f64;
                s.steps
                    .iter()
                    .map(|step| {
                        let widest = step.transfers.iter().map(|t| t.blocks.len()).max();
                        self.message(widest.unwrap_or(0) as f64 * block)
                    })
                    .sum()
            }
            OpKind::ReduceScatter | OpKind::Scatter | OpKind::Gather | OpKind::AllToAll => {
                self.messages(n - 1, b / n as f64)
            }
            OpKind::AllGather => self.messages(n - 1, b),
            OpKind::Broadcast | OpKind::Reduce => self.messages(tree_depth, b),
            OpKind::Recv => self.message(b),
            OpKind::Barrier => self.alpha,
            OpKind::Send => Duration::ZERO,
        }
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
    fn a_link_without_bandwidth_is_refused() {
        let err = LinkEmulator::new(5.0, 0.0).unwrap_err().to_string();
        assert!(err.contains("bandwidth > 0 GB/s"), "{err}");
    }
}
