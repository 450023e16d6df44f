//! Distributed data parallelism (DDP): every rank holds the whole model, runs its own slice of
//! the batch, and the ranks average their gradients before the optimizer step.
//!
//! ```text
//!   rank 0: batch[0]  ─ forward ─ backward ─┐                 ┌─ AdamW (same update)
//!   rank 1: batch[1]  ─ forward ─ backward ─┼─ all-reduce avg ┼─ AdamW (same update)
//!   rank 2: batch[2]  ─ forward ─ backward ─┘   of gradients  └─ AdamW (same update)
//! ```
//!
//! Averaging the gradients of equal-sized slices gives exactly the gradient of the mean loss on
//! the concatenated batch, so N ranks take the same steps as one rank with an N times larger
//! batch, provided they start from the same weights: [`verify_same_init`] checks that with a
//! checksum of every parameter gathered from all ranks.
//!
//! # Buckets overlap the all-reduce with the backward (PyTorch's Reducer, Megatron's grad buffer)
//! Gradients become final in reverse model order: the head's first, the embedding's last. So
//! parameters are packed into buckets in that order (the first bucket small, 1 MiB by default,
//! so communication starts early; then 25 MiB each). When the block-wise engine reports that a
//! segment's gradients are final (`Hooks::post_backward`), every bucket whose parameters are now
//! all final is flattened and its all-reduce launched asynchronously; the backward continues on
//! the next segment while the bytes move:
//!
//! ```text
//!   backward:  [ head ][ h.3 ][ h.2 ][ h.1 ][ h.0 ][ emb ]
//!   comm:             [bucket 0][ bucket 1  ][ bucket 2 ]  [b3]     exposed = waiting for b3
//!                                                              ▲ wait() before the optimizer
//! ```
//!
//! Buckets are launched strictly in bucket order on every rank: collectives on a group must be
//! issued in the same order everywhere, or ranks would sum different buckets (the trace test
//! checks the sequences). A tied weight (`wte`, used by the embedding and the head) is final only
//! after the lowest segment using it, so it is bucketed where it becomes final, not where it is
//! first seen.
//!
//! With gradient accumulation the engine sums micro-step gradients locally and only the last
//! micro-step (`sync = true`) communicates. The `naive` mode all-reduces one tensor at a time
//! after the whole backward: the textbook version, kept beside the bucketed one for comparison.
//!
//! A group of one has nothing to average: its gradients are the engine's, untouched, and no
//! collective is issued.
//!
//! Every step reports backward time, communication time (how long the group was busy) and
//! exposed communication (time spent blocked in `wait()`), so the overlap is measured.
//!
//! The buckets and their launcher are DDP's one reduction: [`Ddp`] runs them over a whole model
//! on its own, and a composed plan of one stage ([`crate::ParallelPlan::dp_buckets`]: the
//! world of one, `--dp N`, tp × dp) launches the same buckets from its executor's hooks
//! ([`BucketedDpReduce`]), which is the step the trainer runs. The [`DataParallel`] trait
//! (`ddp/strategy.rs`) is the API of each strategy on its own, which the tests drive;
//! [`crate::fsdp`] implements it too. `ddp/average.rs` is the
//! composed plan's dp average (dense over dp, experts over edp), run after the flush or started
//! inside the last backward by `ddp/overlap.rs`.

pub mod average;
mod buckets;
mod overlap;
mod strategy;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Tensor};
use mtrain_comm::{Comm, ReduceOp, Work};
use mtrain_model::optim::{AdamW, AdamWState, OptimItem};
use mtrain_model::{Engine, Grads, NoHooks, Param, Segment};

use buckets::BucketLauncher;
pub use buckets::{assign_bucket_sizes, assign_buckets, Bucket, ParamSize};
pub use overlap::{BucketedDpReduce, OverlappedDpReduce};
pub use strategy::{verify_same_init, DataParallel, DpError, Result};
// What a strategy reports, under the API's name as well as the toolbox's.
use crate::mixed_precision::{MasterWeights, MixedPrecision};
use crate::toolbox::{
    final_after, load_replicated, named_grads, named_weights, replicated_items,
    replicated_state_bytes, sum_f64, timed_wait, unique_params, OpTimer,
};
pub use crate::toolbox::{CommStats, ModelStateBytes};

/// How DDP communicates gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DdpMode {
    /// Buckets in reverse order, all-reduced asynchronously as the backward produces them.
    #[default]
    Bucketed,
    /// One blocking all-reduce per tensor after the whole backward.
    Naive,
}

/// DDP settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DdpConfig {
    pub mode: DdpMode,
    /// Size at which a bucket is closed (PyTorch: 25 MiB).
    pub bucket_cap_bytes: usize,
    /// Size at which the first bucket is closed, small so communication starts early (PyTorch: 1 MiB).
    pub first_bucket_cap_bytes: usize,
}

impl Default for DdpConfig {
    fn default() -> Self {
        Self {
            mode: DdpMode::Bucketed,
            bucket_cap_bytes: 25 << 20,
            first_bucket_cap_bytes: 1 << 20,
        }
    }
}

/// Data parallelism over a replicated model.
pub struct Ddp {
    comm: Comm,
    cfg: DdpConfig,
    segments: Vec<Arc<dyn Segment>>,
    params: Vec<Param>,
    buckets: Vec<Bucket>,
    grads: Grads,
    /// fp32 masters under mixed precision ([`Ddp::with_mixed_precision`]).
    masters: Option<MasterWeights>,
    /// The dtype gradients are all-reduced in (and the optimizer sees).
    reduce_dtype: DType,
    timer: Option<OpTimer>,
    current: CommStats,
    last: CommStats,
}

impl Ddp {
    /// Wraps the model's segments; `comm` is the data-parallel group. Verifies that every rank
    /// starts from the same weights (a collective: every rank of `comm` must call it).
    pub fn new(comm: Comm, segments: Vec<Arc<dyn Segment>>, cfg: DdpConfig) -> Result<Ddp> {
        if cfg.bucket_cap_bytes == 0 || cfg.first_bucket_cap_bytes == 0 {
            return Err(DpError::Config(format!(
                "bucket caps must be positive, got first {} B and {} B",
                cfg.first_bucket_cap_bytes, cfg.bucket_cap_bytes
            )));
        }
        let params = unique_params(&segments);
        verify_same_init(&comm, &params)?;
        let buckets = assign_buckets(
            &params,
            &final_after(&segments),
            cfg.first_bucket_cap_bytes,
            cfg.bucket_cap_bytes,
        );
        Ok(Ddp {
            comm,
            cfg,
            segments,
            params,
            buckets,
            grads: Grads::new(),
            masters: None,
            reduce_dtype: DType::F32,
            timer: None,
            current: CommStats::default(),
            last: CommStats::default(),
        })
    }

    /// Mixed precision: the segments compute in `precision.param_dtype` (they were built from
    /// weights of that dtype) and AdamW updates fp32 masters copied from `fp32_weights` (the
    /// full weights by name, before the cast); gradients are all-reduced in
    /// `precision.reduce_dtype`. Without mixed precision this changes nothing.
    pub fn with_mixed_precision(
        mut self,
        precision: MixedPrecision,
        fp32_weights: &BTreeMap<String, Tensor>,
    ) -> Result<Ddp> {
        precision.validate()?;
        if !precision.is_mixed() {
            return Ok(self);
        }
        let mut masters = BTreeMap::new();
        for p in &self.params {
            let w = fp32_weights.get(p.name()).ok_or_else(|| {
                DpError::Config(format!(
                    "no fp32 weight named `{}` for its master",
                    p.name()
                ))
            })?;
            masters.insert(p.name().to_string(), w.to_device(p.var().device())?);
        }
        self.masters = Some(MasterWeights::new(masters)?);
        self.reduce_dtype = precision.reduce_dtype;
        Ok(self)
    }

    /// The buckets, in launch order.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// The parameters, in model order (bucket indices point into this list).
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// The gradients accumulated so far (averaged over dp after the last micro-step).
    pub fn grads(&self) -> &Grads {
        &self.grads
    }

    /// Waits for the launched buckets in order and writes the averages back into `grads`.
    fn finish_bucketed(&mut self, pending: Vec<Work>) -> Result<()> {
        let (timer, comm) = (&mut self.timer, &self.comm);
        buckets::write_back(
            &self.params,
            &self.buckets,
            pending,
            &mut self.grads,
            &mut self.current.exposed_comm_s,
            &mut || {
                if let Some(t) = timer.as_mut() {
                    t.collect(comm);
                }
            },
        )
    }

    /// The textbook version: after the whole backward, one blocking all-reduce per tensor.
    fn sync_naive(&mut self) -> Result<()> {
        for p in &self.params {
            let g = match self.grads.get(p.name()) {
                Some(g) => g.to_dtype(self.reduce_dtype)?,
                None => Tensor::zeros(p.shape(), self.reduce_dtype, p.var().device())?,
            };
            let work = self.comm.all_reduce_async(&g, ReduceOp::Avg);
            let avg = timed_wait(work, &mut self.current.exposed_comm_s)?;
            self.current.collectives += 1;
            self.current.bytes += (g.elem_count() * g.dtype().size_in_bytes()) as u64;
            if let Some(t) = self.timer.as_mut() {
                t.collect(&self.comm);
            }
            self.grads.insert(p.name(), avg);
        }
        Ok(())
    }
}

impl Ddp {
    /// [`DataParallel::forward_backward`], calling `before_backward` between the forward and
    /// the backward (where the memory report reads the forward's level).
    pub fn forward_backward_observed(
        &mut self,
        engine: &Engine,
        idx: &Tensor,
        targets: &Tensor,
        loss_scale: f64,
        sync: bool,
        before_backward: &mut dyn FnMut(),
    ) -> Result<f64> {
        if self.timer.is_none() {
            self.timer = Some(OpTimer::start(&self.comm));
        }
        let acts = engine.forward(&self.segments, idx, Some(targets), &mut NoHooks)?;
        let loss = sum_f64(&acts.output)?;
        before_backward();
        let t = Instant::now();
        let average = sync && self.comm.size() > 1;
        if average && self.cfg.mode == DdpMode::Bucketed {
            let mut hooks =
                BucketLauncher::new(&self.comm, &self.params, &self.buckets, self.reduce_dtype);
            engine.backward(
                &self.segments,
                acts,
                None,
                loss_scale,
                &mut self.grads,
                &mut hooks,
            )?;
            let (pending, bytes) = hooks.finish(&self.grads)?;
            self.current.backward_s += t.elapsed().as_secs_f64();
            self.current.collectives += pending.len();
            self.current.bytes += bytes;
            self.finish_bucketed(pending)?;
        } else {
            engine.backward(
                &self.segments,
                acts,
                None,
                loss_scale,
                &mut self.grads,
                &mut NoHooks,
            )?;
            self.current.backward_s += t.elapsed().as_secs_f64();
            if average {
                self.sync_naive()?;
            }
        }
        Ok(loss)
    }
}

impl DataParallel for Ddp {
    fn forward_backward(
        &mut self,
        engine: &Engine,
        idx: &Tensor,
        targets: &Tensor,
        loss_scale: f64,
        sync: bool,
    ) -> Result<f64> {
        self.forward_backward_observed(engine, idx, targets, loss_scale, sync, &mut || {})
    }

    fn grad_norm_sq(&self) -> Result<f64> {
        // The gradients are already averaged and identical on every rank.
        Ok(self.grads.sq_norm()?)
    }

    fn optimizer_items(&self) -> Vec<OptimItem<'_>> {
        replicated_items(&self.params, &self.grads)
    }

    fn after_optimizer_step(&mut self) -> Result<()> {
        self.grads.clear();
        if let Some(t) = self.timer.take() {
            self.current.comm_s = t.busy_s();
        }
        self.last = std::mem::take(&mut self.current);
        Ok(())
    }

    fn masters(&self) -> Option<&MasterWeights> {
        self.masters.as_ref()
    }

    fn full_state(&self) -> Result<BTreeMap<String, Tensor>> {
        Ok(match &self.masters {
            Some(m) => m.tensors(),
            None => named_weights(&self.params),
        })
    }

    fn full_grads(&self) -> Result<BTreeMap<String, Tensor>> {
        Ok(named_grads(&self.grads))
    }

    fn model_state_bytes(&self, opt: &AdamW) -> ModelStateBytes {
        let mut s = replicated_state_bytes(&self.params, &self.grads, opt);
        s.optimizer += self.masters.as_ref().map_or(0, |m| m.bytes());
        s
    }

    fn comm_stats(&self) -> CommStats {
        self.last
    }

    fn load_full_state(&mut self, weights: &BTreeMap<String, Tensor>) -> Result<()> {
        load_replicated(&self.params, weights)?;
        if let Some(m) = &self.masters {
            m.load(weights)?;
        }
        Ok(())
    }

    fn full_optimizer_state(&self, opt: &AdamW) -> Result<AdamWState> {
        Ok(opt.state()?)
    }

    fn shard_optimizer_state(&self, full: &AdamWState) -> Result<AdamWState> {
        Ok(full.clone())
    }
}
