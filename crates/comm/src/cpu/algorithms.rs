//! The all-reduce's algorithm, chosen and run: the schedule of each algorithm
//! ([`ring`](super::ring), [`binary_tree`](super::binary_tree),
//! [`halving_doubling`](super::halving_doubling)) and the walk of it for an algorithm other
//! than the ring, whose own transfers are the [`pump`](super::pump)'s.

use candle_core::Tensor;

use super::binary_tree::TREE_PIECE_BYTES;
use super::core::GroupCore;
use super::schedule::Schedule;
use super::wire::{bytes_to_tensor, AccBuf, AccElem};
use crate::algo::AllReduceAlgo;
use crate::communicator::{ReduceOp, Result};

/// The schedule `algo` runs over `ranks` ranks (at least 2).
pub fn all_reduce_schedule(algo: AllReduceAlgo, ranks: usize) -> Schedule {
    match algo {
        AllReduceAlgo::Ring => super::ring::schedule(ranks),
        AllReduceAlgo::Tree => super::binary_tree::schedule(ranks),
        AllReduceAlgo::Rhd => super::halving_doubling::schedule(ranks),
    }
}

impl GroupCore {
    /// All-reduce `x` by `algo`'s schedule (the headers already exchanged), in its
    /// accumulation type; the result in `x`'s dtype.
    pub(crate) fn scheduled_all_reduce(
        &mut self,
        x: &Tensor,
        algo: AllReduceAlgo,
        op: ReduceOp,
    ) -> Result<Tensor> {
        let (dtype, shape, numel) = (x.dtype(), x.dims().to_vec(), x.elem_count());
        let mut acc = AccBuf::from_tensor(x)?;
        match &mut acc {
            AccBuf::F32(v) => self.run_algo(algo, v, op)?,
            AccBuf::F64(v) => self.run_algo(algo, v, op)?,
            AccBuf::U8(v) => self.run_algo(algo, v, op)?,
            AccBuf::U32(v) => self.run_algo(algo, v, op)?,
            AccBuf::I64(v) => self.run_algo(algo, v, op)?,
        }
        match acc.into_native(dtype) {
            Ok(native) => native.into_tensor(&shape),
            Err(acc) => bytes_to_tensor(&acc.to_native_bytes(0..numel, dtype), dtype, &shape),
        }
    }

    /// Run `algo`'s schedule over this group on `buf`, in place; the tree pipelined in pieces
    /// of [`TREE_PIECE_BYTES`].
    pub(crate) fn run_algo<T: AccElem>(
        &mut self,
        algo: AllReduceAlgo,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let piece = match algo {
            AllReduceAlgo::Tree => TREE_PIECE_BYTES / std::mem::size_of::<T>(),
            _ => 0,
        };
        let sched = all_reduce_schedule(algo, self.size);
        self.run_schedule(&sched, buf, op, piece)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::schedule::{block_range, piece};

    /// Runs a schedule on sets instead of numbers: each rank's block b starts as {rank}, a
    /// reduce is a union, a copy replaces. Every algorithm must end with every rank holding
    /// every block summed over all ranks exactly once.
    fn simulate(s: &Schedule) -> Vec<Vec<Vec<usize>>> {
        let mut held: Vec<Vec<Vec<usize>>> =
            (0..s.ranks).map(|r| vec![vec![r]; s.blocks]).collect();
        for step in &s.steps {
            let before = held.clone();
            for t in &step.transfers {
                for b in t.blocks.clone() {
                    let theirs = before[t.from][b].clone();
                    let mine = &mut held[t.to][b];
                    if t.reduce {
                        assert!(
                            theirs.iter().all(|r| !mine.contains(r)),
                            "{:?} added twice",
                            t
                        );
                        mine.extend(theirs);
                        mine.sort();
                    } else {
                        *mine = theirs;
                    }
                }
            }
        }
        held
    }

    #[test]
    fn every_schedule_sums_every_block_once_on_every_rank() {
        for algo in AllReduceAlgo::ALL {
            for n in 2..=17 {
                let s = all_reduce_schedule(algo, n);
                let all: Vec<usize> = (0..n).collect();
                for (r, blocks) in simulate(&s).iter().enumerate() {
                    for (b, ranks) in blocks.iter().enumerate() {
                        assert_eq!(ranks, &all, "{algo} n {n}: rank {r} block {b}");
                    }
                }
                // No rank sends twice to the same peer within one step.
                for step in &s.steps {
                    let mut pairs: Vec<_> = step.transfers.iter().map(|t| (t.from, t.to)).collect();
                    pairs.sort();
                    pairs.dedup();
                    assert_eq!(pairs.len(), step.transfers.len(), "{algo} n {n}");
                }
            }
        }
    }

    #[test]
    fn blocks_tile_the_data() {
        assert_eq!(block_range(10, 4, &(0..2)), 0..6);
        assert_eq!(block_range(10, 4, &(2..4)), 6..10);
        assert_eq!(block_range(3, 8, &(4..8)), 3..3);
        assert_eq!(block_range(3, 8, &(1..1)), 0..0);
        assert_eq!(piece(&(4..14), 3, 2), 11..14);
    }
}
