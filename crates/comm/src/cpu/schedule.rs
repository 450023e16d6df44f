//! An all-reduce algorithm as data: the steps of its phases, each a list of transfers (who
//! sends which blocks of the data to whom, and whether the receiver adds them to its own or
//! keeps them). The backend runs these schedules and `mtrain explain` prints them, so what the
//! reader is shown is what the ranks do.
//!
//! ```text
//!   Schedule { ranks: 4, blocks: 4, steps: [
//!     Step { phase: ReduceScatter, transfers: [0 -> 1 blocks 3..4 reduce, 1 -> 2 blocks 0..1 reduce, ...] },
//!     ...
//!     Step { phase: AllGather,     transfers: [0 -> 1 blocks 0..1 copy, ...] } ] }
//! ```
//!
//! The data (`len` elements) is cut into `blocks` blocks by `chunk_range` (the first
//! `len % blocks` one element longer). [`GroupCore::run_schedule`] walks the steps in order:
//! in each, this rank's sends go out (they never wait for the receiver), then its receives
//! arrive, each combined into our values or copied over them. A phase may be pipelined: cut
//! into pieces and walked once per piece, so that piece k moves down the tree while piece k+1
//! is still coming up.

use std::ops::Range;

use super::core::GroupCore;
use super::wire::{combine_slice, AccElem, Scratch};
use crate::algo::AllReduceAlgo;
use crate::communicator::{chunk_range, ReduceOp, Result};

/// What a step does, in the words of the algorithm's textbook description.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Halving-doubling on a group that is not a power of two: each extra rank hands its data
    /// to a partner, which adds it to its own.
    Fold,
    ReduceScatter,
    AllGather,
    /// The partners hand the result back to the extra ranks.
    Unfold,
    /// Towards the tree's root.
    Reduce,
    /// From the tree's root.
    Broadcast,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Fold => "fold",
            Phase::ReduceScatter => "reduce-scatter",
            Phase::AllGather => "all-gather",
            Phase::Unfold => "unfold",
            Phase::Reduce => "reduce",
            Phase::Broadcast => "broadcast",
        }
    }
}

/// One message of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    pub from: usize,
    pub to: usize,
    /// Which blocks of the data (of [`Schedule::blocks`]).
    pub blocks: Range<usize>,
    /// The receiver combines them with its own values (else it keeps them as they came).
    pub reduce: bool,
}

/// Transfers that may all be in flight at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub phase: Phase,
    pub transfers: Vec<Transfer>,
}

/// An all-reduce over `ranks` ranks as steps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    pub algo: AllReduceAlgo,
    pub ranks: usize,
    /// Into how many blocks the data is cut.
    pub blocks: usize,
    pub steps: Vec<Step>,
}

impl Schedule {
    /// The steps of `phase`, in order.
    pub fn phase(&self, phase: Phase) -> impl Iterator<Item = &Step> + '_ {
        self.steps.iter().filter(move |s| s.phase == phase)
    }
}

/// The elements of `blocks` when `len` elements are cut into `of` blocks.
pub fn block_range(len: usize, of: usize, blocks: &Range<usize>) -> Range<usize> {
    if blocks.is_empty() {
        return 0..0;
    }
    chunk_range(len, of, blocks.start).start..chunk_range(len, of, blocks.end - 1).end
}

/// Piece `k` of `pieces` of `range`.
pub(crate) fn piece(range: &Range<usize>, pieces: usize, k: usize) -> Range<usize> {
    let c = chunk_range(range.len(), pieces, k);
    range.start + c.start..range.start + c.end
}

impl GroupCore {
    /// Run this rank's part of `sched` on `buf` (our values in the accumulation type; the
    /// result on return). Each phase is walked piece by piece, in pieces of about
    /// `piece_elems` elements (0: whole), so a pipelined algorithm forwards a piece as soon as
    /// it has it. `Avg` sums and divides at the end, on every rank the same sum.
    pub(crate) fn run_schedule<T: AccElem>(
        &mut self,
        sched: &Schedule,
        buf: &mut [T],
        op: ReduceOp,
        piece_elems: usize,
    ) -> Result<()> {
        let me = self.rank;
        let combine = if op == ReduceOp::Avg {
            ReduceOp::Sum
        } else {
            op
        };
        let es = std::mem::size_of::<T>();
        let len = buf.len();
        let pieces = match piece_elems {
            0 => 1,
            p => len.div_ceil(p).max(1),
        };
        let mut scratch = Scratch::default();
        for phase in sched.steps.chunk_by(|a, b| a.phase == b.phase) {
            for k in 0..pieces {
                for step in phase {
                    for t in step.transfers.iter().filter(|t| t.from == me) {
                        let range = piece(&block_range(len, sched.blocks, &t.blocks), pieces, k);
                        if !range.is_empty() {
                            self.send(t.to, bytemuck::cast_slice(&buf[range]).to_vec())?;
                        }
                    }
                    for t in step.transfers.iter().filter(|t| t.to == me) {
                        let range = piece(&block_range(len, sched.blocks, &t.blocks), pieces, k);
                        if range.is_empty() {
                            continue;
                        }
                        let bytes = scratch.bytes(range.len() * es);
                        self.recv_into(t.from, bytes)?;
                        let theirs: &[T] = bytemuck::cast_slice(bytes);
                        match t.reduce {
                            true => combine_slice(&mut buf[range], theirs, combine),
                            false => buf[range].copy_from_slice(theirs),
                        }
                    }
                }
            }
        }
        if op == ReduceOp::Avg {
            let n = self.size;
            for e in buf.iter_mut() {
                *e = e.div_n(n);
            }
        }
        Ok(())
    }
}
