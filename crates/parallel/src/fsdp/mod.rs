//! Sharded data parallelism: ZeRO stages 1, 2 and 3 (stage 3 is FSDP).
//!
//! DDP keeps on every rank 16 bytes per parameter of model state (fp32 here: 4 for the weight,
//! 4 for its gradient, 8 for Adam's two moments). ZeRO removes the redundancy step by step; each
//! rank keeps 1/N of what is sharded (N = dp size, Φ = parameter count, bytes per rank):
//!
//! ```text
//!   stage   sharded                      weights      grads     Adam m, v   fp32 total
//!   DDP     nothing                      4Φ           4Φ        8Φ          16Φ
//!   1       optimizer state              4Φ (+4Φ/N)   4Φ (+4Φ/N) 8Φ/N
//!   2       + gradients                  4Φ (+4Φ/N)   4Φ/N      8Φ/N
//!   3       + parameters (FSDP)          4Φ/N         4Φ/N      8Φ/N        16Φ/N
//! ```
//! (+4Φ/N: the shard the optimizer updates and its reduced gradient, next to the full copies;
//! the weight shard is the analogue of ZeRO's fp32 master copy. Stage 3 also holds the gathered
//! weights of the segments in flight, at most two at a time when they are freed after each
//! forward ([`Fsdp::in_flight_bytes`]). With
//! mixed precision ([`Fsdp::set_mixed_precision`]) the shards and gathers are bf16, the fp32
//! master shards sit next to Adam's moments and are sharded like them, and the same table reads
//! 2+2+12 bytes per parameter: 16Φ/N at stage 3. Gradients are reduce-scattered in the reduce
//! dtype: f32 by default, so the kept gradient shard is then 4Φ/N rather than 2Φ/N. Shards
//! are padded per segment, so a rank may hold up to one element per segment more than Φ/N.)
//!
//! The unit of sharding is a segment of the block-wise engine: its parameters are laid out in one
//! flat buffer and every rank keeps one contiguous shard of it (see [`unit`]). A parameter used by
//! several segments (the tied `wte`) belongs to the lowest one, where its gradient becomes final.
//!
//! Under a pipeline one strategy covers every chunk (model stage) of its rank, their segments
//! numbered one after the other ([`Fsdp::over_chunks`]); a pass's hooks are one chunk's, and
//! ZeRO-3's residency rule runs within it. So the rule above holds across chunks: ZB-V's rank 0
//! runs the embedding (chunk 0) and the tied head (chunk 1), and `wte` is one embedding unit
//! (one shard, one optimizer state). The head's passes gather it (stage 3) and leave their
//! `wte` gradient in the caller's [`Grads`] for the unit's next reduce-scatter, after the
//! embedding's backward: right while the embedding's chunk runs the step's last backward of the
//! two, which the caller checks ([`Fsdp::shared_across_chunks`]).
//!
//! # One training step at stage 3 (the engine's hooks drive it)
//! ```text
//!   pre_forward(i)    free segment i-1's gathered weights; wait for segment i's all-gather;
//!                     start segment i+1's all-gather (prefetch, overlaps segment i's forward)
//!   pre_backward(i)   gather segment i again (its second all-gather; the last segment's are
//!                     still resident), start segment i-1's (prefetch)
//!   weights_read(i)   segment i's input gradient is formed: free its weights before its weight
//!                     gradients, which read none, are formed
//!   post_backward(i)  reduce-scatter segment i's flat gradient (async); drop the full gradient
//!   optimizer         AdamW on this rank's shards only (decay flag per piece)
//!
//!   gathered weights held, embedding + 4 blocks + head:
//!     resharding after the forward   forward ▂▂▂▂▂▂ │ backward ▂▂▂▂▂▂     two segments at most
//!     kept until the backward        forward ▁▂▃▄▅▆ │ backward ▆▅▄▃▂▁     the whole model
//! ```
//! Stages 1 and 2 keep full weights in place, so no gathers run in forward/backward; after the
//! optimizer updates the shards, an all-gather per unit writes the new weights back. Stage 1
//! keeps full gradients and reduce-scatters only on the last micro-step (like DDP); stages 2 and 3
//! reduce-scatter after every micro-step's backward and accumulate the shard, so full gradients
//! never outlive one segment.
//!
//! A segment's tape (what its forward keeps for the backward) holds its parameters' slots, not
//! their weights ([`mtrain_model::tape::SlotWeight`]): the forward's free returns the memory,
//! and the backward reads what `pre_backward` gathered into the slots again. That is PyTorch
//! FSDP's `reshard_after_forward`, the default here ([`FsdpConfig::reshard_after_forward`]),
//! and where ZeRO-3's memory drop comes from: each unit is gathered twice per pass (the last
//! segment's once), and the forward ends holding the last segment's weights only. With
//! `reshard_after_forward = false` the forward frees nothing and the backward gathers nothing:
//! one gather per unit, every gathered block held at the end of the forward, freed after its
//! backward (its weight gradients formed beside it). Activation checkpointing keeps only each segment's input and always frees the
//! weights; its recompute reads them gathered again. (On the autograd path, the tests' oracle,
//! the recorded graph holds the tensors it used whatever the option says.)

pub mod residency;
mod scheduler;
mod state;
mod unit;

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Tensor};
use mtrain_comm::{Comm, ReduceOp, Work};
use mtrain_model::optim::{AdamW, OptimItem};
use mtrain_model::source::ParamSource;
use mtrain_model::{Engine, Grads, HookResult, Hooks, Param, Segment};

use crate::ddp::{verify_same_init, DpError, Result};
use crate::mixed_precision::{MasterWeights, MixedPrecision};
use crate::toolbox::{
    clipped_step, final_after, sq_sum_f64, sum_f64, timed_wait, unique_params, CommStats,
    OpTimer,
};
use scheduler::{Residency, Scheduler};
pub use state::analytic_model_state;
use unit::FlatUnit;
pub use unit::Region;

/// Which model state is sharded across the data-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ZeroStage {
    /// Optimizer state.
    One = 1,
    /// Optimizer state and gradients.
    Two = 2,
    /// Optimizer state, gradients and parameters (FSDP).
    Three = 3,
}

impl TryFrom<u8> for ZeroStage {
    type Error = DpError;
    fn try_from(v: u8) -> Result<ZeroStage> {
        match v {
            1 => Ok(ZeroStage::One),
            2 => Ok(ZeroStage::Two),
            3 => Ok(ZeroStage::Three),
            _ => Err(DpError::Config(format!(
                "zero stage must be 1, 2 or 3, got {v}"
            ))),
        }
    }
}

/// FSDP / ZeRO settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FsdpConfig {
    pub stage: ZeroStage,
    /// Start the next segment's all-gather before the current segment computes (stage 3).
    pub prefetch: bool,
    /// Stage 3: free each segment's gathered weights right after its forward and gather them
    /// again (prefetched) for its backward (PyTorch FSDP's option of this name, its default);
    /// false keeps them from the forward to the backward: one gather per unit and pass, for
    /// speed where memory allows. Activation checkpointing always frees them (its recompute
    /// gathers them again).
    pub reshard_after_forward: bool,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        Self {
            stage: ZeroStage::Three,
            prefetch: true,
            reshard_after_forward: true,
        }
    }
}


/// Sharded data parallelism over the segments of a model.
pub struct Fsdp {
    comm: Comm,
    cfg: FsdpConfig,
    /// The segments of every chunk, one after the other.
    segments: Vec<Arc<dyn Segment>>,
    /// Chunk k's segments: `segments[chunks[k]]`.
    chunks: Vec<Range<usize>>,
    /// One unit per segment (`units[i]` holds the parameters whose gradient is final after segment i).
    units: Vec<FlatUnit>,
    residency: Vec<Residency>,
    /// `needs[i]`: the units segment i uses.
    needs: Vec<Vec<usize>>,
    /// Whether segment i's backward reads its weights ([`Segment::backward_reads_params`]).
    reads_params: Vec<bool>,
    grads: Grads,
    /// fp32 master shards under mixed precision ([`Fsdp::with_mixed_precision`]).
    masters: Option<MasterWeights>,
    timer: Option<OpTimer>,
    current: CommStats,
    last: CommStats,
}

impl Fsdp {
    /// Shards the model's segments over `comm` (the data-parallel group). Every rank must have
    /// built the same full model (checked); at stage 3 the full weights are released here.
    pub fn new(comm: Comm, segments: Vec<Arc<dyn Segment>>, cfg: FsdpConfig) -> Result<Fsdp> {
        Self::over_chunks(comm, vec![segments], cfg)
    }

    /// [`Fsdp::new`] over the segments of several chunks (the model stages one pipeline rank
    /// runs, in chunk order), numbered one after the other: a parameter two chunks use is one
    /// unit, its lowest user's.
    pub fn over_chunks(
        comm: Comm,
        chunks: Vec<Vec<Arc<dyn Segment>>>,
        cfg: FsdpConfig,
    ) -> Result<Fsdp> {
        let params = unique_params(&chunks.concat());
        let (values, regions) = unit::whole_regions(&params);
        Self::over_chunks_from(comm, chunks, cfg, &values, &regions)
    }

    /// [`Fsdp::over_chunks`] reading every shard from `source`: `regions[name]` says which
    /// elements of the single-device tensor each parameter is (a tensor-parallel piece). The
    /// parameters' values are not read, so at stage 3 they may be empty placeholders and no
    /// rank ever creates a full unit; those that hold values (stages 1 and 2) are checked equal
    /// over `comm`, and every rank's units must have the same sizes.
    pub fn over_chunks_from(
        comm: Comm,
        chunks: Vec<Vec<Arc<dyn Segment>>>,
        cfg: FsdpConfig,
        source: &dyn ParamSource,
        regions: &BTreeMap<String, Region>,
    ) -> Result<Fsdp> {
        let mut ranges = Vec::with_capacity(chunks.len());
        for c in &chunks {
            let start = ranges.last().map_or(0, |r: &Range<usize>| r.end);
            ranges.push(start..start + c.len());
        }
        let segments: Vec<Arc<dyn Segment>> = chunks.into_iter().flatten().collect();
        let params = unique_params(&segments);
        let region = |p: &Param| {
            regions.get(p.name()).cloned().ok_or_else(|| {
                DpError::Config(format!("no region given for parameter `{}`", p.name()))
            })
        };
        let mut with_values = Vec::new();
        for p in &params {
            if p.elem_count() == region(p)?.shape.iter().product::<usize>() {
                with_values.push(p.clone());
            }
        }
        verify_same_init(&comm, &with_values)?;
        let owner = final_after(&segments);
        let (rank, dp) = (comm.rank(), comm.size());
        let mut units = Vec::with_capacity(segments.len());
        for (i, seg) in segments.iter().enumerate() {
            let mine = params
                .iter()
                .filter(|p| owner.get(p.name()) == Some(&i))
                .map(|p| Ok((p.clone(), region(p)?)))
                .collect::<Result<Vec<_>>>()?;
            let device = comm.device();
            units.push(FlatUnit::new(&seg.name(), mine, rank, dp, device, source)?);
        }
        unit::verify_same_units(&comm, &units)?;
        let uses: Vec<Vec<String>> = segments
            .iter()
            .map(|s| s.params().iter().map(|p| p.name().to_string()).collect())
            .collect();
        let needs = residency::needs(&uses, &owner);
        let reads_params = segments.iter().map(|s| s.backward_reads_params()).collect();
        let residency = units.iter().map(|_| Residency::Gathered).collect();
        let mut fsdp = Fsdp {
            comm,
            cfg,
            segments,
            chunks: ranges,
            units,
            residency,
            needs,
            reads_params,
            grads: Grads::new(),
            masters: None,
            timer: None,
            current: CommStats::default(),
            last: CommStats::default(),
        };
        if cfg.stage == ZeroStage::Three {
            let mut sched = fsdp.scheduler(false, false);
            for u in 0..sched.units.len() {
                sched.free(u)?;
            }
            fsdp.timer = None;
        }
        Ok(fsdp)
    }

    /// Mixed precision (call right after [`Fsdp::new`]): the segments compute in
    /// `precision.param_dtype` (they were built from weights of that dtype, so the shards and all-gathers are in it too), AdamW updates fp32
    /// master shards read from `fp32_weights` (the weights before the cast, by the regions the
    /// units were built with) exactly as the optimizer moments are cut, and gradients are
    /// reduce-scattered and kept in `precision.reduce_dtype`. Without mixed precision this
    /// changes nothing.
    pub fn set_mixed_precision(
        &mut self,
        precision: MixedPrecision,
        fp32_weights: &dyn ParamSource,
    ) -> Result<()> {
        precision.validate()?;
        if !precision.is_mixed() {
            return Ok(());
        }
        let mut shards = BTreeMap::new();
        for u in self.units.iter().filter(|u| u.numel > 0) {
            let (decay, plain) = u.split(&u.read_shard(fp32_weights, DType::F32)?)?;
            for (name, t) in u.piece_names().into_iter().zip([decay, plain]) {
                if let (Some(name), Some(t)) = (name, t) {
                    shards.insert(name.to_string(), t);
                }
            }
        }
        self.masters = Some(MasterWeights::new(shards)?);
        for u in &mut self.units {
            u.reduce_dtype = precision.reduce_dtype;
        }
        Ok(())
    }




    /// The hooks for one forward/backward, borrowing this strategy's state.
    fn scheduler(&mut self, recompute: bool, reduce: bool) -> Scheduler<'_> {
        Scheduler {
            comm: &self.comm,
            stage: self.cfg.stage,
            prefetch: self.cfg.prefetch,
            reshard: recompute || self.cfg.reshard_after_forward,
            reduce,
            units: &mut self.units,
            residency: &mut self.residency,
            needs: &self.needs,
            reads: residency::backward_needs(&self.needs, &self.reads_params, recompute),
            chunks: &self.chunks,
            chunk: 0,
            pending: Vec::new(),
            freed_early: None,
            stats: &mut self.current,
            timer: self.timer.get_or_insert_with(OpTimer::default),
        }
    }


}

/// The engine hooks of an engine pass driven from outside [`Fsdp`] (a pipeline's passes):
/// gather, prefetch and free the units, and reduce-scatter the gradients when `reduce` is set.
/// Gradients accumulate in the caller's [`Grads`]; at stages 2 and 3 the reduced entries are
/// removed from it. [`FsdpHooks::finish`] waits for the reduce-scatters and stores the shards.
pub struct FsdpHooks<'a> {
    sched: Scheduler<'a>,
}

impl FsdpHooks<'_> {
    /// Whether the following backward passes reduce-scatter their gradients.
    pub fn set_reduce(&mut self, reduce: bool) {
        self.sched.reduce = reduce;
    }

    /// The chunk the following passes run over ([`Fsdp::over_chunks`]; 0 with one).
    pub fn set_chunk(&mut self, chunk: usize) {
        self.sched.chunk = chunk;
    }

    /// Waits for the reduce-scatters in flight and adds each shard to its unit.
    pub fn finish(self) -> Result<()> {
        self.sched.finish()
    }
}

impl Hooks for FsdpHooks<'_> {
    fn pre_forward(&mut self, i: usize, seg: &dyn Segment) -> HookResult {
        self.sched.pre_forward(i, seg)
    }
    fn pre_backward(&mut self, i: usize, seg: &dyn Segment) -> HookResult {
        self.sched.pre_backward(i, seg)
    }
    fn post_backward(&mut self, i: usize, seg: &dyn Segment, grads: &mut Grads) -> HookResult {
        self.sched.post_backward(i, seg, grads)
    }
    fn splits_backward(&self) -> bool {
        self.sched.splits_backward()
    }
    fn weights_read(&mut self, i: usize, seg: &dyn Segment) -> HookResult {
        self.sched.weights_read(i, seg)
    }
}

/// Pieces for composing sharded data parallelism with other strategies (`crate::parallelize`):
/// externally driven passes, and linear fix-ups applied to the reduced gradient shards.
impl Fsdp {
    /// The ZeRO stage.
    pub fn stage(&self) -> ZeroStage {
        self.cfg.stage
    }

    /// Hooks for engine passes over this strategy's segments (`recompute`: the engine runs with
    /// activation checkpointing). They start with `reduce` off.
    pub fn hooks(&mut self, recompute: bool) -> FsdpHooks<'_> {
        if self.timer.is_none() {
            self.timer = Some(OpTimer::start(&self.comm));
        }
        FsdpHooks {
            sched: self.scheduler(recompute, false),
        }
    }

    /// The units more than one chunk uses, each as (its owner's chunk, every chunk using it,
    /// ascending). A unit's reduction after its owner's backward holds every chunk's gradient
    /// only if, in each step, its owner's chunk runs the last backward of them.
    pub fn shared_across_chunks(&self) -> Vec<(usize, Vec<usize>)> {
        residency::shared_across_chunks(&self.needs, &self.chunks)
    }

    /// At stage 3, frees every unit's gathered weights (after a forward-only pass).
    pub fn release(&mut self) -> Result<()> {
        let mut sched = self.scheduler(false, false);
        for u in 0..sched.units.len() {
            sched.free(u)?;
        }
        Ok(())
    }
}

/// The strategy on its own: one chunk's forward and backward, the norm, the optimizer step.
///
/// ```text
///   for micro-step k in 0..K:  loss_k = fsdp.forward_backward(engine, x_k, y_k, 1/K, k == K-1)
///   fsdp.optimizer_step(&mut adamw, lr, Some(max_norm))   // clip, AdamW on the shards, write-back
/// ```
impl Fsdp {
    /// Forward and backward of this rank's micro-batch over the one chunk's segments, driven by
    /// this strategy's hooks; gradients accumulate until the optimizer step. `loss_scale`
    /// multiplies the loss (1/K for K micro-steps); `sync` marks the last micro-step, the one
    /// whose backward reduces at stage 1. Returns this rank's loss (unscaled).
    pub fn forward_backward(
        &mut self,
        engine: &Engine,
        idx: &Tensor,
        targets: &Tensor,
        loss_scale: f64,
        sync: bool,
    ) -> Result<f64> {
        if self.chunks.len() != 1 {
            return Err(DpError::Config(format!(
                "a forward and backward over {} chunks at once: drive each chunk's passes \
                 through Fsdp::hooks",
                self.chunks.len()
            )));
        }
        if self.timer.is_none() {
            self.timer = Some(OpTimer::start(&self.comm));
        }
        let reduce = sync || self.cfg.stage >= ZeroStage::Two;
        let segments = self.segments.clone();
        let mut grads = std::mem::take(&mut self.grads);
        let mut sched = self.scheduler(engine.checkpointing, reduce);
        let acts = engine.forward(&segments, idx, Some(targets), &mut sched)?;
        let loss = sum_f64(&acts.output)?;
        let t = Instant::now();
        engine.backward(&segments, acts, None, loss_scale, &mut grads, &mut sched)?;
        sched.stats.backward_s += t.elapsed().as_secs_f64();
        sched.finish()?;
        self.grads = grads;
        Ok(loss)
    }

    /// Σ g² of the global (averaged) gradient, the same on every rank, each element counted
    /// once: the shards' sums, all-reduced.
    pub fn grad_norm_sq(&self) -> Result<f64> {
        let mut local = 0.0f64;
        for u in &self.units {
            for g in [&u.grad_decay, &u.grad_plain].into_iter().flatten() {
                local += sq_sum_f64(g)?;
            }
        }
        let t = Tensor::new(&[local as f32], self.comm.device())?;
        let total = self.comm.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f32>()?;
        Ok(total.first().copied().unwrap_or(0.0) as f64)
    }

    /// Starts the all-gather of unit `k`'s updated shard (ZeRO-1/2's write-back).
    fn write_back_gather(&mut self, k: usize) -> Result<Work> {
        let shard = self.units[k].param_shard()?; // (shard,)
        self.current.collectives += 1;
        self.current.bytes += (shard.elem_count() * shard.dtype().size_in_bytes()) as u64;
        Ok(self.comm.all_gather_async(&shard))
    }

    /// What the optimizer updates: this rank's flat shards, each with its decay flag.
    pub fn optimizer_items(&self) -> Vec<OptimItem<'_>> {
        let mut items = Vec::new();
        for u in &self.units {
            for (p, g, decay) in [
                (&u.decay_shard, &u.grad_decay, true),
                (&u.plain_shard, &u.grad_plain, false),
            ] {
                if let (Some(p), Some(g)) = (p, g) {
                    items.push(OptimItem {
                        name: p.name(),
                        param: p,
                        grad: g,
                        decay,
                    });
                }
            }
        }
        items
    }

    /// After the optimizer: at stages 1 and 2 all-gather the updated shards back into every
    /// rank's full weights; drop the gradients; close the step's communication figures.
    pub fn after_optimizer_step(&mut self) -> Result<()> {
        if self.cfg.stage != ZeroStage::Three {
            // Write the updated shards back into every rank's full weights, the next unit's
            // all-gather running while one is written: two units' weights gathered at most.
            let units: Vec<usize> =
                (0..self.units.len()).filter(|&k| self.units[k].numel > 0).collect();
            let mut next = None;
            for (i, &k) in units.iter().enumerate() {
                let work = match next.take() {
                    Some(work) => work,
                    None => self.write_back_gather(k)?,
                };
                if let Some(&after) = units.get(i + 1) {
                    next = Some(self.write_back_gather(after)?);
                }
                let flat = timed_wait(work, &mut self.current.exposed_comm_s)?; // (padded,)
                for (e, t) in self.units[k].unflatten(&flat)? {
                    e.param.set(&t)?;
                }
            }
        }
        self.grads.clear();
        for u in &mut self.units {
            u.grad_decay = None;
            u.grad_plain = None;
        }
        if let Some(mut t) = self.timer.take() {
            t.collect(&self.comm);
            self.current.comm_s = t.busy_s();
        }
        self.last = std::mem::take(&mut self.current);
        Ok(())
    }

    /// The fp32 master shards the optimizer updates under mixed precision (None: it updates
    /// the shards of [`Fsdp::optimizer_items`] themselves).
    pub fn masters(&self) -> Option<&MasterWeights> {
        self.masters.as_ref()
    }








    /// Clip to `max_grad_norm` (if given), step the optimizer, finish the step. Returns the
    /// gradient norm before clipping: [`Fsdp::grad_norm_sq`] once, then [`Fsdp::scaled_step`]
    /// with its clip coefficient.
    pub fn optimizer_step(
        &mut self,
        opt: &mut AdamW,
        lr: f64,
        max_grad_norm: Option<f64>,
    ) -> Result<f64> {
        clipped_step(self.grad_norm_sq()?, max_grad_norm, |clip| {
            self.scaled_step(opt, lr, clip)
        })
    }

    /// Steps the optimizer with the gradients multiplied by `grad_scale` (the clip coefficient
    /// of a norm the caller already has, used as given; 1 leaves them alone) inside the update,
    /// and finishes the step. No norm is computed here.
    pub fn scaled_step(&mut self, opt: &mut AdamW, lr: f64, grad_scale: f64) -> Result<()> {
        match self.masters() {
            Some(m) => m.step(opt, lr, grad_scale, &self.optimizer_items())?,
            None => {
                opt.step_with_copies(lr, grad_scale, &self.optimizer_items(), None)?;
            }
        }
        self.after_optimizer_step()
    }
}
