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
//! Every step reports backward time, communication time (how long the group was busy) and
//! exposed communication (time spent blocked in `wait()`), so the overlap is measured.
//!
//! The [`DataParallel`] trait here is the API the trainer drives; [`crate::fsdp`] implements it too.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Tensor};
use mtrain_comm::{Comm, CommError, ReduceOp, TraceEvent, Work};
use mtrain_model::optim::{clip_coef, AdamW, OptimItem};
use mtrain_model::{Engine, Grads, Hooks, NoHooks, Param, Segment};

/// Errors of the data-parallel strategies.
#[derive(Debug, thiserror::Error)]
pub enum DpError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(
        "rank {rank} initialised parameter '{name}' differently from rank 0 \
         (checksum {theirs} vs {ours}); every rank must build the model from the same seed"
    )]
    InitMismatch {
        rank: usize,
        name: String,
        ours: String,
        theirs: String,
    },
    #[error("rank {rank} has {theirs} parameters but rank 0 has {ours}; every rank must build the same model")]
    ParamCountMismatch {
        rank: usize,
        ours: usize,
        theirs: usize,
    },
    #[error("invalid data-parallel setting: {0}")]
    Config(String),
}

pub type Result<T> = std::result::Result<T, DpError>;

/// Hooks return candle's error type; a communication error travels inside it.
pub(crate) fn hook_err(e: impl std::error::Error + Send + Sync + 'static) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// Timing and volume of one optimizer step's data-parallel communication.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CommStats {
    /// Wall time of the engine's backward passes (including launching collectives).
    pub backward_s: f64,
    /// Time the group spent running this step's collectives (from the comm trace).
    pub comm_s: f64,
    /// Time this rank sat blocked in `wait()`: the communication not hidden behind compute.
    pub exposed_comm_s: f64,
    /// Collectives issued.
    pub collectives: usize,
    /// Bytes of the inputs of those collectives on this rank.
    pub bytes: u64,
}

/// Bytes of model state one rank keeps (parameters, gradients, optimizer moments).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelStateBytes {
    pub params: usize,
    pub grads: usize,
    pub optimizer: usize,
}

impl ModelStateBytes {
    pub fn total(&self) -> usize {
        self.params + self.grads + self.optimizer
    }
}

/// The API a data-parallel strategy offers the training loop (DDP and FSDP/ZeRO alike):
///
/// ```text
///   for micro-step k in 0..K:  loss_k = dp.forward_backward(engine, x_k, y_k, 1/K, sync = k == K-1)
///   dp.optimizer_step(&mut adamw, lr, Some(max_norm))      // = clip + optimizer_items + after_optimizer_step
/// ```
pub trait DataParallel {
    /// Forward and backward of this rank's micro-batch; gradients accumulate until the optimizer
    /// step. `loss_scale` multiplies the loss (1/K for K micro-steps). `sync` marks the last
    /// micro-step, the one whose backward communicates. Returns this rank's loss (unscaled).
    fn forward_backward(
        &mut self,
        engine: &Engine,
        idx: &Tensor,
        targets: &Tensor,
        loss_scale: f64,
        sync: bool,
    ) -> Result<f64>;

    /// Σ g² of the global (averaged) gradient, the same on every rank, each element counted once.
    fn grad_norm_sq(&self) -> Result<f64>;

    /// Multiplies the gradients the optimizer will see by `factor` (gradient clipping).
    fn scale_grads(&mut self, factor: f64) -> Result<()>;

    /// What the optimizer updates: full tensors (DDP) or this rank's flat shards (ZeRO).
    fn optimizer_items(&self) -> Vec<OptimItem<'_>>;

    /// After the optimizer: drop the gradients, and for ZeRO-1/2 all-gather the updated shards.
    fn after_optimizer_step(&mut self) -> Result<()>;

    /// Every parameter as a full tensor, by name (collective under ZeRO-3: call on every rank).
    fn full_state(&self) -> Result<BTreeMap<String, Tensor>>;

    /// Every parameter's averaged gradient as a full tensor, by name (collective under ZeRO-2/3).
    /// Valid between the last micro-step and the optimizer step.
    fn full_grads(&self) -> Result<BTreeMap<String, Tensor>>;

    /// Bytes of the parameters, gradients and optimizer moments this rank holds right now.
    fn model_state_bytes(&self, opt: &AdamW) -> ModelStateBytes;

    /// Communication figures of the last completed optimizer step.
    fn comm_stats(&self) -> CommStats;

    /// Clip to `max_grad_norm` (if given), step the optimizer, finish the step. Returns the
    /// gradient norm before clipping.
    fn optimizer_step(
        &mut self,
        opt: &mut AdamW,
        lr: f64,
        max_grad_norm: Option<f64>,
    ) -> Result<f64> {
        let norm = self.grad_norm_sq()?.sqrt();
        if let Some(max) = max_grad_norm {
            let c = clip_coef(norm, max);
            if c < 1.0 {
                self.scale_grads(c)?;
            }
        }
        opt.step(lr, &self.optimizer_items())?;
        self.after_optimizer_step()?;
        Ok(norm)
    }
}

/// The segments' parameters, each name once, in model order.
pub fn unique_params(segs: &[Arc<dyn Segment>]) -> Vec<Param> {
    let mut seen = std::collections::BTreeSet::new();
    segs.iter()
        .flat_map(|s| s.params())
        .filter(|p| seen.insert(p.name().to_string()))
        .collect()
}

/// For each parameter name, the segment after whose backward its gradient is final: the
/// lowest-index segment using it (the embedding for the tied `wte`).
pub fn final_after(segs: &[Arc<dyn Segment>]) -> BTreeMap<String, usize> {
    let mut at = BTreeMap::new();
    for (i, s) in segs.iter().enumerate() {
        for p in s.params() {
            at.entry(p.name().to_string()).or_insert(i);
        }
    }
    at
}

/// nanoGPT's rule: decay matrices and embeddings (≥ 2-D), not biases or LayerNorm gains.
pub fn decays(shape: &[usize]) -> bool {
    shape.len() >= 2
}

/// Checks that every rank holds the same initial weights: each rank computes (Σx, Σx², Σ i·x) of
/// every parameter in f64, the checksums of all ranks are gathered, and any difference from rank 0
/// fails on every rank with an error naming the rank and the parameter.
pub fn verify_same_init(comm: &Comm, params: &[Param]) -> Result<()> {
    let device = comm.device().clone();
    let count = Tensor::new(&[params.len() as i64], &device)?;
    let counts = comm.all_gather(&count)?.to_vec1::<i64>()?;
    for (rank, &c) in counts.iter().enumerate() {
        if c != counts[0] {
            return Err(DpError::ParamCountMismatch {
                rank,
                ours: counts[0] as usize,
                theirs: c as usize,
            });
        }
    }
    let mut sums = Vec::with_capacity(3 * params.len());
    for p in params {
        let x = p.tensor().detach().flatten_all()?.to_dtype(DType::F64)?;
        let idx = Tensor::arange(0u32, x.elem_count() as u32, x.device())?.to_dtype(DType::F64)?;
        sums.push(x.sum_all()?.to_scalar::<f64>()?);
        sums.push(x.sqr()?.sum_all()?.to_scalar::<f64>()?);
        sums.push((&x * &idx)?.sum_all()?.to_scalar::<f64>()?);
    }
    // f64 bit patterns travel as i64 so the comparison is exact.
    let bits: Vec<i64> = sums.iter().map(|s| s.to_bits() as i64).collect();
    let n = bits.len();
    let all = comm
        .all_gather(&Tensor::from_vec(bits, n, &device)?)?
        .to_vec1::<i64>()?;
    for rank in 1..comm.size() {
        for (k, p) in params.iter().enumerate() {
            let mine = &all[3 * k..3 * k + 3];
            let theirs = &all[rank * n + 3 * k..rank * n + 3 * k + 3];
            if mine != theirs {
                let show = |s: &[i64]| {
                    format!(
                        "{:e}/{:e}",
                        f64::from_bits(s[0] as u64),
                        f64::from_bits(s[1] as u64)
                    )
                };
                return Err(DpError::InitMismatch {
                    rank,
                    name: p.name().to_string(),
                    ours: show(mine),
                    theirs: show(theirs),
                });
            }
        }
    }
    Ok(())
}

/// Measures how long a group was busy with this step's collectives, from its trace.
///
/// The trace stamps each op when issued and when finished; ops run one after another in issue
/// order, so op k is busy from max(issued_k, finished_{k-1}) to finished_k.
#[derive(Debug, Default)]
pub(crate) struct OpTimer {
    after_seq: Option<u64>,
    ops: BTreeMap<u64, TraceEvent>,
}

impl OpTimer {
    /// Starts a step: ops already in the trace are not counted.
    pub(crate) fn start(comm: &Comm) -> Self {
        let after_seq = comm.tracer().recent().iter().map(|e| e.seq).max();
        Self {
            after_seq,
            ops: BTreeMap::new(),
        }
    }

    /// Picks up the ops finished so far (call after each wait: the trace keeps only recent ops).
    pub(crate) fn collect(&mut self, comm: &Comm) {
        for e in comm.tracer().recent() {
            if self.after_seq.is_none_or(|s| e.seq > s) {
                self.ops.insert(e.seq, e);
            }
        }
    }

    pub(crate) fn busy_s(&self) -> f64 {
        let mut prev_end = 0u64;
        let mut busy = 0u64;
        for e in self.ops.values() {
            let start = e.start_us.max(prev_end);
            busy += e.end_us.saturating_sub(start);
            prev_end = prev_end.max(e.end_us);
        }
        busy as f64 * 1e-6
    }
}

/// Waits for `work`, adding the blocked time to `exposed_s`.
pub(crate) fn timed_wait<T: Send + 'static>(work: Work<T>, exposed_s: &mut f64) -> Result<T> {
    let t = Instant::now();
    let out = work.wait();
    *exposed_s += t.elapsed().as_secs_f64();
    Ok(out?)
}

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

/// A group of parameters whose gradients travel in one flat all-reduce.
#[derive(Debug, Clone, PartialEq)]
pub struct Bucket {
    /// Indices into the model's parameter list, in the order they sit in the flat buffer.
    pub params: Vec<usize>,
    /// Elements in the flat buffer.
    pub numel: usize,
    /// The bucket is complete once segment `ready_after`'s backward has finished.
    pub ready_after: usize,
}

/// Packs parameters into buckets in the order their gradients become final: segments from last
/// to first, inside a segment from its last parameter to its first. A bucket is closed once it
/// reaches its cap (the first one's cap is `first_cap`), so a parameter is never split.
pub fn assign_buckets(
    params: &[Param],
    final_after: &BTreeMap<String, usize>,
    first_cap: usize,
    cap: usize,
) -> Vec<Bucket> {
    let mut order: Vec<usize> = (0..params.len()).rev().collect();
    // Stable: keeps reverse model order inside a segment.
    order.sort_by_key(|&k| {
        std::cmp::Reverse(final_after.get(params[k].name()).copied().unwrap_or(0))
    });
    let mut buckets = Vec::new();
    let mut cur = Bucket {
        params: Vec::new(),
        numel: 0,
        ready_after: usize::MAX,
    };
    let mut cur_bytes = 0usize;
    for k in order {
        let p = &params[k];
        cur.params.push(k);
        cur.numel += p.elem_count();
        cur.ready_after = cur
            .ready_after
            .min(final_after.get(p.name()).copied().unwrap_or(0));
        cur_bytes += p.elem_count() * p.var().dtype().size_in_bytes();
        let limit = if buckets.is_empty() { first_cap } else { cap };
        if cur_bytes >= limit {
            buckets.push(std::mem::replace(
                &mut cur,
                Bucket {
                    params: Vec::new(),
                    numel: 0,
                    ready_after: usize::MAX,
                },
            ));
            cur_bytes = 0;
        }
    }
    if !cur.params.is_empty() {
        buckets.push(cur);
    }
    buckets
}

/// Concatenates the gradients of `params[ids]` into one flat tensor (zeros for a missing one).
pub(crate) fn flatten_grads(
    params: &[Param],
    ids: &[usize],
    grads: &Grads,
) -> candle_core::Result<Tensor> {
    let mut parts = Vec::with_capacity(ids.len());
    for &k in ids {
        let p = &params[k];
        parts.push(match grads.get(p.name()) {
            Some(g) => g.flatten_all()?,
            None => Tensor::zeros(p.elem_count(), p.var().dtype(), p.var().device())?,
        });
    }
    Tensor::cat(&parts, 0) // (numel,)
}

/// The hook that launches bucket all-reduces as the backward makes them complete.
struct BucketLauncher<'a> {
    comm: &'a Comm,
    params: &'a [Param],
    buckets: &'a [Bucket],
    /// Next bucket to launch; buckets go out strictly in this order.
    next: usize,
    pending: Vec<Work>,
    bytes: u64,
}

impl BucketLauncher<'_> {
    fn launch_next(&mut self, grads: &Grads) -> candle_core::Result<()> {
        let b = &self.buckets[self.next];
        let flat = flatten_grads(self.params, &b.params, grads)?; // (numel,)
        self.pending
            .push(self.comm.all_reduce_async(&flat, ReduceOp::Avg));
        self.bytes += (flat.elem_count() * flat.dtype().size_in_bytes()) as u64;
        self.next += 1;
        Ok(())
    }
}

impl Hooks for BucketLauncher<'_> {
    fn post_backward(
        &mut self,
        i: usize,
        _seg: &dyn Segment,
        grads: &mut Grads,
    ) -> candle_core::Result<()> {
        while self.next < self.buckets.len() && self.buckets[self.next].ready_after >= i {
            self.launch_next(grads)?;
        }
        Ok(())
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
            timer: None,
            current: CommStats::default(),
            last: CommStats::default(),
        })
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
        for (b, work) in self.buckets.iter().zip(pending) {
            let flat = timed_wait(work, &mut self.current.exposed_comm_s)?; // (numel,)
            if let Some(t) = self.timer.as_mut() {
                t.collect(&self.comm);
            }
            let mut off = 0;
            for &k in &b.params {
                let p = &self.params[k];
                let n = p.elem_count();
                self.grads
                    .insert(p.name(), flat.narrow(0, off, n)?.reshape(p.shape())?);
                off += n;
            }
        }
        Ok(())
    }

    /// The textbook version: after the whole backward, one blocking all-reduce per tensor.
    fn sync_naive(&mut self) -> Result<()> {
        for p in &self.params {
            let g = match self.grads.get(p.name()) {
                Some(g) => g.clone(),
                None => Tensor::zeros(p.shape(), p.var().dtype(), p.var().device())?,
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

impl DataParallel for Ddp {
    fn forward_backward(
        &mut self,
        engine: &Engine,
        idx: &Tensor,
        targets: &Tensor,
        loss_scale: f64,
        sync: bool,
    ) -> Result<f64> {
        if self.timer.is_none() {
            self.timer = Some(OpTimer::start(&self.comm));
        }
        let acts = engine.forward(&self.segments, idx, Some(targets), &mut NoHooks)?;
        let loss = acts
            .output
            .to_dtype(DType::F64)?
            .sum_all()?
            .to_scalar::<f64>()?;
        let t = Instant::now();
        if sync && self.cfg.mode == DdpMode::Bucketed {
            let mut hooks = BucketLauncher {
                comm: &self.comm,
                params: &self.params,
                buckets: &self.buckets,
                next: 0,
                pending: Vec::new(),
                bytes: 0,
            };
            engine.backward(
                &self.segments,
                acts,
                None,
                loss_scale,
                &mut self.grads,
                &mut hooks,
            )?;
            // Buckets whose segments the engine did not report (none in a full model) go now.
            while hooks.next < self.buckets.len() {
                hooks.launch_next(&self.grads)?;
            }
            let (pending, bytes) = (hooks.pending, hooks.bytes);
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
            if sync {
                self.sync_naive()?;
            }
        }
        Ok(loss)
    }

    fn grad_norm_sq(&self) -> Result<f64> {
        // The gradients are already averaged and identical on every rank.
        Ok(self.grads.sq_norm()?)
    }

    fn scale_grads(&mut self, factor: f64) -> Result<()> {
        for name in self.grads.names() {
            if let Some(g) = self.grads.get(&name) {
                let scaled = (g * factor)?;
                self.grads.insert(name, scaled);
            }
        }
        Ok(())
    }

    fn optimizer_items(&self) -> Vec<OptimItem<'_>> {
        self.params
            .iter()
            .filter_map(|p| {
                self.grads.get(p.name()).map(|g| OptimItem {
                    name: p.name(),
                    param: p,
                    grad: g,
                    decay: decays(g.dims()),
                })
            })
            .collect()
    }

    fn after_optimizer_step(&mut self) -> Result<()> {
        self.grads.clear();
        if let Some(t) = self.timer.take() {
            self.current.comm_s = t.busy_s();
        }
        self.last = std::mem::take(&mut self.current);
        Ok(())
    }

    fn full_state(&self) -> Result<BTreeMap<String, Tensor>> {
        Ok(self
            .params
            .iter()
            .map(|p| (p.name().to_string(), p.tensor().detach()))
            .collect())
    }

    fn full_grads(&self) -> Result<BTreeMap<String, Tensor>> {
        Ok(self
            .grads
            .iter()
            .map(|(n, g)| (n.clone(), g.clone()))
            .collect())
    }

    fn model_state_bytes(&self, opt: &AdamW) -> ModelStateBytes {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        ModelStateBytes {
            params: self.params.iter().map(|p| bytes(&p.tensor())).sum(),
            grads: self.grads.iter().map(|(_, g)| bytes(g)).sum(),
            optimizer: opt.state_bytes(),
        }
    }

    fn comm_stats(&self) -> CommStats {
        self.last
    }
}
