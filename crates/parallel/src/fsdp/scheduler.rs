//! When each unit's weights are gathered, prefetched and freed, and when its gradient is
//! reduce-scattered: the hooks the block-wise engine calls around every segment, running the
//! moves of the residency rule ([`super::residency`]) with real collectives.
//!
//! ```text
//!   forward   seg i:  free units of seg i-1 not used by seg i │ wait gather(i) │ start gather(i+1)
//!   backward  seg i:  wait gather(i) (its second gather; none for a backward that reads no
//!                     weight, the embedding's) │ start gather(i-1)
//!             B of its tape, then (resharding) free units of seg i not read by seg i-1:
//!                     its weight gradients, formed next, read no weight (the head's
//!                     dwte = dzᵀ·h is formed with the tied embedding unit already freed)
//!             after:  reduce-scatter unit i's flat gradient (async) │ drop its full gradient
//!                     (ZeRO-2/3)
//! ```
//! The tapes keep no weight, only its slot ([`mtrain_model::tape::SlotWeight`]), so a free
//! after the forward returns the memory, and the backward reads the weights gathered again.
//! At most two units are resident or in flight at any moment (the running segment's and the
//! prefetched one), plus the tied embedding unit while the head runs. With
//! `reshard_after_forward = false` the forward frees nothing and the backward gathers nothing
//! (the rule's second table, [`super::residency`]). Segment i is the running chunk's
//! ([`super::Fsdp::over_chunks`]); the units are numbered over all chunks.

use std::ops::Range;

use candle_core::Tensor;
use mtrain_comm::{Comm, ReduceOp, Work};
use mtrain_model::{Grads, HookResult, Hooks, Segment};

use super::residency::{self, Moves};
use super::unit::FlatUnit;
use super::ZeroStage;
use crate::ddp::Result;
use crate::toolbox::{hook_err, timed_wait, CommStats, OpTimer};

/// Whether a unit's full weights are in its parameters' slots.
pub(super) enum Residency {
    /// Only the shard exists; the slots hold empty placeholders.
    Sharded,
    /// The all-gather is running.
    Gathering(Work),
    /// The slots hold the full weights.
    Gathered,
}

/// The engine hooks of sharded data parallelism: gather, prefetch, reduce-scatter, free.
pub(super) struct Scheduler<'a> {
    pub(super) comm: &'a Comm,
    pub(super) stage: ZeroStage,
    pub(super) prefetch: bool,
    /// The forward frees each segment's weights and the backward gathers them again
    /// (`reshard_after_forward`, or activation checkpointing, whose recompute needs them).
    pub(super) reshard: bool,
    /// Reduce-scatter gradients in this backward.
    pub(super) reduce: bool,
    pub(super) units: &'a mut [FlatUnit],
    pub(super) residency: &'a mut [Residency],
    /// `needs[i]` for every segment of every chunk (unit indices are over all chunks).
    pub(super) needs: &'a [Vec<usize>],
    /// The units each of those segments' backward reads ([`residency::backward_needs`]).
    pub(super) reads: Vec<Vec<usize>>,
    /// Each chunk's segments, as a range of `needs`.
    pub(super) chunks: &'a [Range<usize>],
    /// The chunk of the pass running: the engine's segment i is `chunks[chunk].start + i`.
    pub(super) chunk: usize,
    /// Reduce-scatters in flight, in issue order: (unit, work).
    pub(super) pending: Vec<(usize, Work)>,
    /// The segment whose units [`Hooks::weights_read`] freed (its `post_backward` has nothing
    /// left to free).
    pub(super) freed_early: Option<usize>,
    pub(super) stats: &'a mut CommStats,
    pub(super) timer: &'a mut OpTimer,
}

impl Scheduler<'_> {
    fn start_gather(&mut self, u: usize) -> Result<()> {
        if matches!(self.residency[u], Residency::Sharded) {
            let shard = self.units[u].param_shard()?; // (shard,)
            self.stats.collectives += 1;
            self.stats.bytes += (shard.elem_count() * shard.dtype().size_in_bytes()) as u64;
            self.residency[u] = Residency::Gathering(self.comm.all_gather_async(&shard));
        }
        Ok(())
    }

    /// Makes unit `u`'s full weights available in its parameters' slots.
    fn ensure_gathered(&mut self, u: usize) -> Result<()> {
        self.start_gather(u)?;
        if let Residency::Gathering(work) =
            std::mem::replace(&mut self.residency[u], Residency::Gathered)
        {
            let flat = timed_wait(work, &mut self.stats.exposed_comm_s)?; // (padded,)
            self.timer.collect(self.comm);
            for (e, t) in self.units[u].unflatten(&flat)? {
                e.param.replace(t)?;
            }
        }
        Ok(())
    }

    /// Releases unit `u`'s full weights (stage 3): the slots get empty placeholders.
    pub(super) fn free(&mut self, u: usize) -> Result<()> {
        if self.stage == ZeroStage::Three && self.units[u].numel > 0 {
            for e in &self.units[u].entries {
                e.param
                    .replace(Tensor::zeros(0, e.param.var().dtype(), self.comm.device())?)?;
            }
            self.residency[u] = Residency::Sharded;
        }
        Ok(())
    }

    /// Waits for the reduce-scatters in issue order and adds each shard to its unit.
    pub(super) fn finish(mut self) -> Result<()> {
        for (u, work) in std::mem::take(&mut self.pending) {
            let shard = timed_wait(work, &mut self.stats.exposed_comm_s)?; // (shard,)
            self.timer.collect(self.comm);
            self.units[u].add_grad_shard(&shard)?;
        }
        Ok(())
    }

    /// Runs one step of the residency rule: free, then wait, then prefetch.
    fn apply(&mut self, moves: Moves) -> Result<()> {
        for u in moves.free {
            self.free(u)?;
        }
        for u in moves.wait {
            self.ensure_gathered(u)?;
        }
        for u in moves.prefetch {
            self.start_gather(u)?;
        }
        Ok(())
    }

    /// What segments of the running chunk need: the residency rule runs within one chunk.
    fn chunk_needs(&self) -> &[Vec<usize>] {
        &self.needs[self.chunks[self.chunk].clone()]
    }

    /// What the backwards of the running chunk's segments read.
    fn chunk_reads(&self) -> &[Vec<usize>] {
        &self.reads[self.chunks[self.chunk].clone()]
    }

    fn pre_forward_impl(&mut self, i: usize) -> Result<()> {
        if self.stage != ZeroStage::Three {
            return Ok(());
        }
        self.apply(residency::before_forward(
            self.chunk_needs(),
            i,
            self.prefetch,
            self.reshard,
        ))
    }

    fn pre_backward_impl(&mut self, i: usize) -> Result<()> {
        if self.stage != ZeroStage::Three {
            return Ok(());
        }
        self.apply(residency::before_backward(
            self.chunk_reads(),
            i,
            self.prefetch,
            self.reshard,
        ))
    }

    /// Frees the units segment i of the running chunk used that no earlier backward reads.
    fn free_after_backward(&mut self, i: usize) -> Result<()> {
        let free = residency::after_backward(self.chunk_needs(), self.chunk_reads(), i, self.reshard);
        for u in free {
            self.free(u)?;
        }
        Ok(())
    }

    /// After segment i of the running chunk: free the units no earlier backward reads (unless
    /// freed between its B and W), then reduce-scatter its unit (a parameter it shares with a
    /// lower segment, the head's `wte`, stays in `grads` for that segment's unit).
    fn post_backward_impl(&mut self, i: usize, grads: &mut Grads) -> Result<()> {
        // The weights go first: the flat gradient below is a unit's size too.
        if self.freed_early.take() != Some(i) {
            self.free_after_backward(i)?;
        }
        let u = self.chunks[self.chunk].start + i;
        if self.reduce && self.units[u].numel > 0 {
            // ZeRO-2/3 take the full gradients out of `grads` first: they are freed once the
            // flat copy is made, before the reduce-scatter (on the group's thread) allocates
            // its buffers, not whenever this thread next runs.
            let flat = match self.stage >= ZeroStage::Two {
                true => {
                    let mut own = Grads::new();
                    for e in &self.units[u].entries {
                        if let Some(g) = grads.remove(e.param.name()) {
                            own.insert(e.param.name(), g);
                        }
                    }
                    self.units[u].flat_grad(&own)? // (padded,)
                }
                false => self.units[u].flat_grad(grads)?, // (padded,)
            };
            self.stats.collectives += 1;
            self.stats.bytes += (flat.elem_count() * flat.dtype().size_in_bytes()) as u64;
            self.pending
                .push((u, self.comm.reduce_scatter_async(&flat, ReduceOp::Avg)));
        }
        Ok(())
    }
}

impl Hooks for Scheduler<'_> {
    fn pre_forward(&mut self, i: usize, _seg: &dyn Segment) -> HookResult {
        self.pre_forward_impl(i).map_err(hook_err)
    }
    fn pre_backward(&mut self, i: usize, _seg: &dyn Segment) -> HookResult {
        self.pre_backward_impl(i).map_err(hook_err)
    }
    fn post_backward(&mut self, i: usize, _seg: &dyn Segment, grads: &mut Grads) -> HookResult {
        self.post_backward_impl(i, grads).map_err(hook_err)
    }
    /// ZeRO-3 resharding frees a segment's gathered weights as soon as its input gradient is
    /// formed (with `reshard_after_forward = false`, at the end of its backward).
    fn splits_backward(&self) -> bool {
        self.stage == ZeroStage::Three && self.reshard
    }
    fn weights_read(&mut self, i: usize, _seg: &dyn Segment) -> HookResult {
        self.freed_early = Some(i);
        self.free_after_backward(i).map_err(hook_err)
    }
}
