//! The data-parallel gradient average of a composed plan, overlapped with the last backward.
//!
//! ```text
//!   last micro-step, backward of segment i (last segment first):
//!     post_backward(i): for every parameter whose gradient is final after segment i
//!                       (its lowest-index user: the embedding for the tied wte)
//!                         dense   dp.all_reduce_async(g, Avg)      launched now, waited at the end
//!                         expert  edp.all_reduce_async(g, Sum)     then ÷ dp, as sync_grads does
//!     ... segment i−1 computes while segment i's gradients travel ...
//!   finish: wait for every launch, put the averages back
//! ```
//!
//! The collectives are the same ones, with the same bytes, as the after-the-step
//! [`sync_grads`](super::average::sync_grads) (both start and finish each average with
//! [`start_average`] and [`finish_averages`]): one all-reduce per parameter; only
//! their start moves into the backward. Used when the plan has one pipeline stage (tp × dp,
//! dp × ep): every rank of a dp group then runs the same program, so each communicator sees its
//! operations in the same order on every rank whatever the backend's streams. Under a pipeline,
//! the stages' schedules interleave their sends differently, and the reduction stays after the
//! flush.

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use mtrain_comm::Comm;
use mtrain_model::{Grads, HookResult, Hooks, NoHooks, Segment};

use super::average::{finish_averages, start_average, Averaging};
use super::buckets::{self, Bucket, BucketLauncher};
use crate::pipeline::StageHooks;
use mtrain_model::Param;

/// Stage hooks that launch each parameter's dp average as soon as its gradient is final on the
/// last micro-step (see the module doc). One chunk only (no pipeline).
pub struct OverlappedDpReduce<'a> {
    dp: &'a Comm,
    edp: &'a Comm,
    /// The dtype gradients are reduced in (mixed precision), or None to keep theirs.
    reduce_dtype: Option<DType>,
    /// Parameter names by the segment after whose backward their gradient is final.
    final_after: BTreeMap<usize, Vec<String>>,
    /// Whether this pass is the last backward of the step's last micro-step.
    active: bool,
    pending: Vec<Averaging>,
    bytes: u64,
    idle: NoHooks,
}

impl<'a> OverlappedDpReduce<'a> {
    /// Hooks for the single chunk `segments`, averaging over `dp` (experts: summed over `edp`,
    /// then divided by dp's size).
    pub fn new(
        segments: &[Arc<dyn Segment>],
        dp: &'a Comm,
        edp: &'a Comm,
        reduce_dtype: Option<DType>,
    ) -> Self {
        let mut final_after: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        let mut seen = std::collections::BTreeSet::new();
        for (i, s) in segments.iter().enumerate() {
            for p in s.params() {
                if seen.insert(p.name().to_string()) {
                    final_after.entry(i).or_default().push(p.name().to_string());
                }
            }
        }
        Self {
            dp,
            edp,
            reduce_dtype,
            final_after,
            active: false,
            pending: Vec::new(),
            bytes: 0,
            idle: NoHooks,
        }
    }

    /// Waits for every launched average and stores it in `grads`. Returns the number of
    /// collectives and their input bytes.
    pub fn finish(self, grads: &mut Grads) -> super::Result<(usize, u64)> {
        let n = self.pending.len();
        finish_averages(self.pending, grads, self.dp)?;
        Ok((n, self.bytes))
    }
}

impl StageHooks for OverlappedDpReduce<'_> {
    fn hooks(&mut self, _chunk: usize, last_backward: bool) -> &mut dyn Hooks {
        if last_backward {
            self.active = true;
            self
        } else {
            self.active = false;
            &mut self.idle
        }
    }
}

impl Hooks for OverlappedDpReduce<'_> {
    fn post_backward(&mut self, i: usize, _seg: &dyn Segment, grads: &mut Grads) -> HookResult {
        if !self.active {
            return Ok(());
        }
        let Some(names) = self.final_after.get(&i) else {
            return Ok(());
        };
        for name in names {
            let g = grads.get(name).cloned().ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "overlapped dp reduction: no gradient for `{name}` after segment {i}"
                ))
            })?;
            let g = match self.reduce_dtype {
                Some(d) if g.dtype() != d => g.to_dtype(d)?,
                _ => g,
            };
            let g: Tensor = g.contiguous()?;
            self.bytes += (g.elem_count() * g.dtype().size_in_bytes()) as u64;
            self.pending
                .push(start_average(name, &g, self.dp, self.edp));
        }
        Ok(())
    }
}

/// Stage hooks that launch the DDP buckets ([`super::assign_buckets`]) during the last backward
/// of the step, as DDP's buckets are: one flat all-reduce per bucket instead of one per
/// parameter. Used by a composed plan of one stage whose gradients are all averaged over dp
/// (ep = 1), which is every DDP run with pp = 1: the world of one, dp, tp × dp.
pub struct BucketedDpReduce<'a> {
    launcher: BucketLauncher<'a>,
    params: &'a [Param],
    buckets: &'a [Bucket],
    /// Whether this pass is the last backward of the step's last micro-step.
    active: bool,
    idle: NoHooks,
}

impl<'a> BucketedDpReduce<'a> {
    /// Hooks averaging `buckets` of `params` over `dp` in `reduce_dtype`.
    pub fn new(dp: &'a Comm, params: &'a [Param], buckets: &'a [Bucket], reduce_dtype: DType) -> Self {
        Self {
            launcher: BucketLauncher::new(dp, params, buckets, reduce_dtype),
            params,
            buckets,
            active: false,
            idle: NoHooks,
        }
    }

    /// Launches what is left, waits for every bucket and writes the averages into `grads`
    /// (the waiting is added to `exposed_s`). Returns the number of collectives and their bytes.
    pub fn finish(self, grads: &mut Grads, exposed_s: &mut f64) -> super::Result<(usize, u64)> {
        let (pending, bytes) = self.launcher.finish(grads)?;
        let n = pending.len();
        buckets::write_back(self.params, self.buckets, pending, grads, exposed_s, &mut || {})?;
        Ok((n, bytes))
    }
}

impl StageHooks for BucketedDpReduce<'_> {
    fn hooks(&mut self, _chunk: usize, last_backward: bool) -> &mut dyn Hooks {
        self.active = last_backward;
        match last_backward {
            true => self,
            false => &mut self.idle,
        }
    }
}

impl Hooks for BucketedDpReduce<'_> {
    fn post_backward(&mut self, i: usize, seg: &dyn Segment, grads: &mut Grads) -> HookResult {
        match self.active {
            true => self.launcher.post_backward(i, seg, grads),
            false => Ok(()),
        }
    }
}
