//! Memory report: what the model state *should* take (analytic) next to what the process *does*
//! take (measured), per training step.
//!
//! Analytic side. Training with Adam holds, per parameter Φ:
//!
//! ```text
//!                         fp32 training         mixed precision (bf16 compute)
//! parameters              4 B                   2 B  (bf16 copy used by forward/backward)
//! gradients               4 B                   2 B
//! master weights          -                     4 B  (fp32)
//! Adam m, v               8 B                   8 B  (fp32)
//!                         ─────                 ─────
//!                         16 Φ                  16 Φ   ← the ZeRO paper's "16Φ" rule
//! ```
//!
//! A [`ModelStateLayout`] holds those bytes per parameter and what a layout divides each category
//! by: ZeRO-1 divides optimizer state (and master weights) by dp, ZeRO-2 also gradients, ZeRO-3 /
//! FSDP also parameters. Tensor and pipeline parallelism shrink Φ itself (the parameters a rank
//! owns), so they enter through `n_params`. Activations are estimated per block after Korthikanti
//! et al. (2022): `B·T·C·(34 + 5·H·T/C)` bytes at 2 bytes per value, scaled to the compute dtype,
//! or only the block inputs plus one block's worth with activation checkpointing; under a parallel
//! layout per rank ([`rank_activation_bytes`]): its stage's blocks, its micro-batches in flight,
//! the tensor-parallel split.
//!
//! Measured side. A [`MemoryProbe`] reports current and peak bytes; on CPU [`CpuProbe`] reads the
//! counters of [`CountingAlloc`], a global allocator wrapping `System` that the binary installs:
//!
//! ```ignore
//! #[global_allocator]
//! static A: mtrain_trainer::memory::CountingAlloc = mtrain_trainer::memory::CountingAlloc;
//! ```
//!
//! On a GPU, `gpu_memory::CudaMemoryProbe` (CUDA memory-pool used / high-water) implements the
//! same trait. The trainer samples
//! the probe after forward, after backward and after the optimizer step, and reports the step's
//! peak; the report is printed as a table and appended as one JSON line to `RUN_DIR/memory.jsonl`.
//!
//! Model state, measured. The whole heap mixes the model state with everything else the process
//! holds (the corpus, the mesh's sockets, logging), so the trainer also reads the probe once right
//! before the model and its optimizer are built — the *baseline* — and reports
//!
//! ```text
//!   model state (measured) = heap after the optimizer step − baseline
//!   model state (analytic) = parameters + optimizer state      (every strategy frees its
//!                                                               gradients in the step)
//!
//!   heap ▲          after backward
//!        │            ┌──┐ grads       after optimizer
//!        │   ┌────────┘  └───────────── ─ ─ ─ ─ ─ ─ ─ ─ ┐
//!        │   │ params                   params + Adam m, v │ model state (measured)
//!   base ┼───┘                                            ┘
//!        │ corpus, mesh, runtime
//!        └──────────────────────────────────────────────────▶ time
//!          build model          step 0
//! ```
//!
//! ([`ModelState`]), so a layout's sharding shows as a number of bytes that can be checked
//! against the 16Φ/N rule rather than as a small change of a large heap.

use std::alloc::{GlobalAlloc, Layout, System};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use mtrain_model::GptConfig;
use mtrain_parallel::parallelize::ParallelPlan;
use mtrain_parallel::pipeline::{Schedule, ScheduleKind, StageLayout};
use serde::Serialize;

static CURRENT: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);
static ALLOCS: AtomicU64 = AtomicU64::new(0);

/// A global allocator over [`System`] that counts live bytes and their high-water mark.
pub struct CountingAlloc;

impl CountingAlloc {
    fn grow(by: usize) {
        let now = CURRENT.fetch_add(by as u64, Ordering::Relaxed) + by as u64;
        PEAK.fetch_max(now, Ordering::Relaxed);
        ALLOCS.fetch_add(1, Ordering::Relaxed);
    }

    fn shrink(by: usize) {
        CURRENT.fetch_sub(by as u64, Ordering::Relaxed);
    }

    /// Whether this allocator is the process's global allocator (it has seen an allocation).
    pub fn installed() -> bool {
        ALLOCS.load(Ordering::Relaxed) > 0
    }
}

// SAFETY: every method forwards to `System` with the caller's layout unchanged and only updates
// counters on success, so `System`'s guarantees carry over.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            Self::grow(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            Self::grow(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        Self::shrink(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            Self::shrink(layout.size());
            Self::grow(new_size);
        }
        p
    }
}

/// Where measured memory comes from.
pub trait MemoryProbe {
    /// What is measured, for the report ("cpu heap", "cuda pool").
    fn name(&self) -> &str;
    /// Bytes in use now.
    fn current(&self) -> u64;
    /// Highest bytes in use since the last [`MemoryProbe::reset_peak`].
    fn peak(&self) -> u64;
    /// Start a new high-water mark at the current value.
    fn reset_peak(&self);
}

/// Heap bytes counted by [`CountingAlloc`] (zero unless it is the global allocator).
pub struct CpuProbe;

impl MemoryProbe for CpuProbe {
    fn name(&self) -> &str {
        "cpu heap"
    }
    fn current(&self) -> u64 {
        CURRENT.load(Ordering::Relaxed)
    }
    fn peak(&self) -> u64 {
        PEAK.load(Ordering::Relaxed)
    }
    fn reset_peak(&self) {
        PEAK.store(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

/// Bytes per parameter of each model-state category and what the layout divides each by.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ModelStateLayout {
    /// Parameters this rank owns before any ZeRO sharding (Φ after TP/PP splits).
    pub n_params: u64,
    /// Bytes per parameter of the compute copy of the weights.
    pub param_bytes: u64,
    /// Bytes per parameter of the gradients.
    pub grad_bytes: u64,
    /// Bytes per parameter of an fp32 master copy (0 when the compute copy is fp32).
    pub master_bytes: u64,
    /// Bytes per parameter of optimizer state (8 for Adam's m and v in fp32).
    pub optim_bytes: u64,
    /// Ranks the parameters are sharded over (ZeRO-3 / FSDP: dp; otherwise 1).
    pub param_shards: u64,
    /// Ranks the gradients are sharded over (ZeRO-2 and up).
    pub grad_shards: u64,
    /// Ranks optimizer state and master weights are sharded over (ZeRO-1 and up).
    pub optim_shards: u64,
}

impl ModelStateLayout {
    /// fp32 weights, fp32 gradients, Adam: 4 + 4 + 8 = 16 bytes per parameter, nothing sharded.
    pub fn fp32_adam(n_params: u64) -> Self {
        Self {
            n_params,
            param_bytes: 4,
            grad_bytes: 4,
            master_bytes: 0,
            optim_bytes: 8,
            param_shards: 1,
            grad_shards: 1,
            optim_shards: 1,
        }
    }

    /// bf16 weights and gradients, fp32 master and Adam state: 2 + 2 + 4 + 8 = 16 bytes per parameter.
    pub fn mixed_adam(n_params: u64) -> Self {
        Self {
            param_bytes: 2,
            grad_bytes: 2,
            master_bytes: 4,
            ..Self::fp32_adam(n_params)
        }
    }

    /// The same layout with ZeRO stage `stage` (0–3) over `dp` ranks.
    pub fn with_zero(mut self, stage: u8, dp: u64) -> Self {
        self.optim_shards = if stage >= 1 { dp } else { 1 };
        self.grad_shards = if stage >= 2 { dp } else { 1 };
        self.param_shards = if stage >= 3 { dp } else { 1 };
        self
    }

    /// Bytes of parameters held (rounded up per shard).
    pub fn params(&self) -> u64 {
        (self.n_params * self.param_bytes).div_ceil(self.param_shards)
    }

    /// Bytes of gradients held.
    pub fn grads(&self) -> u64 {
        (self.n_params * self.grad_bytes).div_ceil(self.grad_shards)
    }

    /// Bytes of optimizer state plus master weights held.
    pub fn optim(&self) -> u64 {
        (self.n_params * (self.optim_bytes + self.master_bytes)).div_ceil(self.optim_shards)
    }

    /// All model-state bytes held.
    pub fn total(&self) -> u64 {
        self.params() + self.grads() + self.optim()
    }
}

/// What one rank's activations depend on under a parallel layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ActivationLayout {
    /// Blocks this rank holds, summed over its model chunks.
    pub blocks: usize,
    /// Model chunks (virtual stages) this rank holds: 1 except under interleaved 1F1B.
    pub chunks: usize,
    /// Whether this rank holds the last model stage (final LayerNorm, LM head, loss).
    pub holds_head: bool,
    /// Rows of one pipeline micro-batch, `B / M`.
    pub micro_batch: usize,
    /// Peak (micro-batch, chunk) pairs whose forward ran here while their backward had not.
    pub in_flight: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Sequence parallelism inside the tp group.
    pub sequence_parallel: bool,
}

/// Why an [`ActivationLayout`] cannot be built for a plan.
#[derive(Debug, thiserror::Error)]
pub enum ActivationLayoutError {
    /// The batch does not split into the plan's micro-batches.
    #[error("batch {batch} does not split into {microbatches} equal micro-batches")]
    Microbatches { batch: usize, microbatches: usize },
    /// The stage layout or the schedule is invalid.
    #[error("pipeline layout: {0}")]
    Pipeline(String),
}

impl ActivationLayout {
    /// The whole model on one device: every block, one micro-batch of `batch` rows.
    pub fn single_device(cfg: &GptConfig, batch: usize) -> Self {
        Self {
            blocks: cfg.n_layer,
            chunks: 1,
            holds_head: true,
            micro_batch: batch,
            in_flight: 1,
            tp: 1,
            sequence_parallel: false,
        }
    }

    /// Pipeline rank `pp_rank`'s part under `plan`, for a per-rank batch of `batch` rows: its
    /// blocks from the plan's stage layout (model stage s runs on rank `s % pp`), the micro-batch
    /// `batch / M`, and the peak in flight from the schedule's simulation (1F1B: `min(P − r, M)`,
    /// GPipe: `M`).
    pub fn for_plan(
        cfg: &GptConfig,
        plan: &ParallelPlan,
        pp_rank: usize,
        batch: usize,
    ) -> Result<Self, ActivationLayoutError> {
        let pp = plan.dims.pp.max(1);
        let m = plan.microbatches.max(1);
        if !batch.is_multiple_of(m) {
            return Err(ActivationLayoutError::Microbatches {
                batch,
                microbatches: m,
            });
        }
        // A single stage has nothing to interleave: it runs its micro-batches GPipe-style.
        let kind = if pp == 1 {
            ScheduleKind::GPipe
        } else {
            plan.schedule
        };
        let v = kind.virtual_stages().max(1);
        let stages = pp * v;
        let err = |e: String| ActivationLayoutError::Pipeline(e);
        let layout = match &plan.stage_counts {
            Some(counts) => StageLayout::from_counts(cfg.n_layer, counts),
            None => StageLayout::even(cfg.n_layer, stages),
        }
        .map_err(|e| err(e.to_string()))?;
        let mine: Vec<usize> = (0..layout.num_stages())
            .filter(|s| s % pp == pp_rank)
            .collect();
        let sim = Schedule::new(kind, pp, m)
            .and_then(|s| s.simulate())
            .map_err(|e| err(e.to_string()))?;
        Ok(Self {
            blocks: mine.iter().map(|&s| layout.blocks(s).len()).sum(),
            chunks: mine.len().max(1),
            holds_head: mine.contains(&(layout.num_stages() - 1)),
            micro_batch: batch / m,
            in_flight: sim.peak_in_flight(pp_rank),
            tp: plan.dims.tp.max(1),
            sequence_parallel: plan.sequence_parallel && plan.dims.tp > 1,
        })
    }
}

/// Estimated activation bytes one rank keeps between forward and backward at its peak.
///
/// Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022),
/// §4: a transformer block stores, at 2 bytes per value, for `b` rows of `t` tokens, width `c`,
/// `h` heads and tensor-parallel degree `tp`
///
/// ```text
///   no tp                         b·t·c·(34 + 5·h·t/c)
///   tp, no sequence parallelism   b·t·c·(10 + 24/tp + 5·h·t/(c·tp))   (eq. 2: LayerNorm inputs,
///                                                                       dropout masks, residuals
///                                                                       replicated; attention and
///                                                                       MLP internals split)
///   tp with sequence parallelism  b·t·c·(34/tp + 5·h·t/(c·tp))          (eq. 3)
/// ```
///
/// scaled by `dtype_bytes / 2`. The head stores the logits, their softmax and its gradient,
/// `3·b·t·V / tp` values (vocab-parallel), on the rank holding the last stage only. The
/// embedding's output is block 0's input, already inside block 0's `34` on the first stage (its
/// backward needs only the token ids). On a rank with `L_r` blocks over `v` chunks and a peak of
/// `n` (micro-batch, chunk) pairs in flight, with `b = B / M`:
///
/// ```text
///   activations_r = n/v · (L_r · block(b) + head(b))                  (v = 1 unless interleaved;
///                                                                       for v > 1 an average chunk)
///   with checkpointing: n/v · (L_r · b·t·c·s/(tp if SP) + head(b)) + block(b)
///                       (every block's input kept, one block recomputed at a time)
/// ```
///
/// On one device (`L_r = L`, `n = v = tp = 1`, `b = B`) this is the whole model's
/// `L · block(B) + head(B)`.
pub fn rank_activation_bytes(
    cfg: &GptConfig,
    layout: &ActivationLayout,
    seq: usize,
    dtype_bytes: usize,
    checkpointing: bool,
) -> u64 {
    let (b, t, c, h) = (
        layout.micro_batch as f64,
        seq as f64,
        cfg.n_embd as f64,
        cfg.n_head as f64,
    );
    let tp = layout.tp.max(1) as f64;
    let scale = dtype_bytes as f64 / 2.0;
    let attention = 5.0 * h * t / (c * tp);
    let per_value = if layout.sequence_parallel {
        34.0 / tp + attention
    } else {
        10.0 + 24.0 / tp + attention
    };
    let per_block = b * t * c * per_value * scale;
    let head = if layout.holds_head {
        3.0 * b * t * cfg.vocab_size as f64 * dtype_bytes as f64 / tp
    } else {
        0.0
    };
    let blocks = layout.blocks as f64;
    let in_flight = layout.in_flight as f64 / layout.chunks.max(1) as f64;
    let total = if checkpointing {
        let input = b * t * c * dtype_bytes as f64;
        let input = if layout.sequence_parallel {
            input / tp
        } else {
            input
        };
        let recomputed = if layout.blocks > 0 { per_block } else { 0.0 };
        in_flight * (blocks * input + head) + recomputed
    } else {
        in_flight * (blocks * per_block + head)
    };
    total as u64
}

/// Estimated activation bytes of the whole model on one device for one batch of `batch` rows
/// ([`rank_activation_bytes`] with [`ActivationLayout::single_device`]).
pub fn activation_bytes(
    cfg: &GptConfig,
    batch: usize,
    seq: usize,
    dtype_bytes: usize,
    checkpointing: bool,
) -> u64 {
    rank_activation_bytes(
        cfg,
        &ActivationLayout::single_device(cfg, batch),
        seq,
        dtype_bytes,
        checkpointing,
    )
}

/// The analytic side of a report.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AnalyticMemory {
    /// Parameter bytes.
    pub params: u64,
    /// Gradient bytes.
    pub grads: u64,
    /// Optimizer state (and master weight) bytes.
    pub optim: u64,
    /// Activation bytes (estimate for one micro-batch).
    pub activations: u64,
    /// Communication buffers (DDP buckets, gathered FSDP blocks, pipeline messages).
    pub comm: u64,
}

impl AnalyticMemory {
    /// From a layout plus activation and communication estimates.
    pub fn new(layout: &ModelStateLayout, activations: u64, comm: u64) -> Self {
        Self {
            params: layout.params(),
            grads: layout.grads(),
            optim: layout.optim(),
            activations,
            comm,
        }
    }

    /// Sum of every category.
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optim + self.activations + self.comm
    }
}

/// A phase of the step at which the probe is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Before the first forward of the step.
    Start,
    /// After the (last micro-batch's) forward.
    AfterForward,
    /// After the (last micro-batch's) backward.
    AfterBackward,
    /// After the optimizer step.
    AfterOptimizer,
}

/// The model state this rank keeps between steps, measured against its analytic size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ModelState {
    /// Bytes in use right before the model and optimizer state were built.
    pub baseline: u64,
    /// Bytes in use after the optimizer step minus `baseline` (0 if the heap shrank below it).
    pub measured: u64,
    /// What should stay resident after the step: parameters plus optimizer state (gradients are
    /// freed by the step).
    pub analytic: u64,
}

impl ModelState {
    /// `measured / analytic` (1.0 is an exact match; infinite when nothing is expected).
    pub fn ratio(&self) -> f64 {
        self.measured as f64 / self.analytic as f64
    }
}

/// One step's report.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryReport {
    /// The step (0-based).
    pub step: u64,
    /// Global rank.
    pub rank: usize,
    /// What is measured.
    pub probe: String,
    /// Analytic bytes per category.
    pub analytic: AnalyticMemory,
    /// Bytes in use at each phase.
    pub measured: Vec<(Phase, u64)>,
    /// Highest bytes in use during the step.
    pub peak: u64,
    /// The model state after the optimizer step, when a baseline was recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_state: Option<ModelState>,
}

fn mib(b: u64) -> String {
    format!("{:>10.2} MiB", b as f64 / (1024.0 * 1024.0))
}

impl MemoryReport {
    /// The report as a table.
    pub fn table(&self) -> String {
        let a = &self.analytic;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "memory, step {} rank {} ({}):",
            self.step, self.rank, self.probe
        );
        let _ = writeln!(s, "  {:<36}measured", "analytic");
        let left = [
            ("parameters", a.params),
            ("gradients", a.grads),
            ("optimizer states", a.optim),
            ("activations (est.)", a.activations),
            ("comm buffers", a.comm),
            ("total", a.total()),
        ];
        let mut right: Vec<(String, u64)> = self
            .measured
            .iter()
            .map(|(p, b)| {
                (
                    format!("{p:?}").to_lowercase().replace("after", "after "),
                    *b,
                )
            })
            .collect();
        right.push(("peak".into(), self.peak));
        for i in 0..left.len().max(right.len()) {
            let l = left
                .get(i)
                .map(|(n, b)| format!("{n:<18}{}", mib(*b)))
                .unwrap_or_default();
            let r = right
                .get(i)
                .map(|(n, b)| format!("{n:<16}{}", mib(*b)))
                .unwrap_or_default();
            let _ = writeln!(s, "{}", format!("  {l:<36}{r}").trim_end());
        }
        if let Some(m) = &self.model_state {
            let _ = writeln!(
                s,
                "  {:<18}{}    {:<16}{}   (after optimizer − {:.2} MiB baseline)",
                "model state",
                mib(m.analytic),
                "model state",
                mib(m.measured),
                m.baseline as f64 / (1024.0 * 1024.0)
            );
        }
        s
    }

    /// One line for the log: model state measured against analytic, and the step's peak.
    pub fn line(&self) -> String {
        let m = |b: u64| format!("{:.2} MiB", b as f64 / (1024.0 * 1024.0));
        match &self.model_state {
            Some(st) => format!(
                "memory: model state {} measured / {} analytic ({:.2}x), peak {} ({})",
                m(st.measured),
                m(st.analytic),
                st.ratio(),
                m(self.peak),
                self.probe
            ),
            None => format!("memory: peak {} ({})", m(self.peak), self.probe),
        }
    }
}

/// Samples a probe through one step.
pub struct MemoryTracker<'p> {
    probe: &'p dyn MemoryProbe,
    measured: Vec<(Phase, u64)>,
    baseline: Option<u64>,
}

impl<'p> MemoryTracker<'p> {
    /// A tracker over `probe`.
    pub fn new(probe: &'p dyn MemoryProbe) -> Self {
        Self {
            probe,
            measured: Vec::new(),
            baseline: None,
        }
    }

    /// A tracker that also reports the model state as the level after the optimizer step minus
    /// `baseline`, the probe's reading right before the model was built.
    pub fn with_baseline(probe: &'p dyn MemoryProbe, baseline: u64) -> Self {
        Self {
            baseline: Some(baseline),
            ..Self::new(probe)
        }
    }

    /// Start a step: reset the peak and record the starting level.
    pub fn begin(&mut self) {
        self.measured.clear();
        self.probe.reset_peak();
        self.measured.push((Phase::Start, self.probe.current()));
    }

    /// Record the level at `phase` (a later mark of the same phase replaces the earlier one, so with
    /// gradient accumulation the last micro-batch is reported).
    pub fn mark(&mut self, phase: Phase) {
        let now = self.probe.current();
        match self.measured.iter_mut().find(|(p, _)| *p == phase) {
            Some(slot) => slot.1 = now,
            None => self.measured.push((phase, now)),
        }
    }

    /// The step's report.
    pub fn finish(&self, step: u64, rank: usize, analytic: AnalyticMemory) -> MemoryReport {
        let after_step = self
            .measured
            .iter()
            .find(|(p, _)| *p == Phase::AfterOptimizer)
            .map(|(_, b)| *b);
        let model_state = match (self.baseline, after_step) {
            (Some(baseline), Some(after)) => Some(ModelState {
                baseline,
                measured: after.saturating_sub(baseline),
                analytic: analytic.params + analytic.optim,
            }),
            _ => None,
        };
        MemoryReport {
            step,
            rank,
            probe: self.probe.name().to_string(),
            analytic,
            measured: self.measured.clone(),
            peak: self.probe.peak(),
            model_state,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sixteen_bytes_per_parameter_and_zero_division() {
        let n = 1_000_003;
        assert_eq!(ModelStateLayout::fp32_adam(n).total(), 16 * n);
        assert_eq!(ModelStateLayout::mixed_adam(n).total(), 16 * n);
        let z3 = ModelStateLayout::mixed_adam(n).with_zero(3, 8);
        assert_eq!(z3.params(), (2 * n).div_ceil(8));
        assert_eq!(z3.optim(), (12 * n).div_ceil(8));
        let z1 = ModelStateLayout::mixed_adam(n).with_zero(1, 4);
        assert_eq!(
            (z1.params(), z1.grads(), z1.optim()),
            (2 * n, 2 * n, (12 * n).div_ceil(4))
        );
    }

    /// A probe whose level the test sets by hand (the counting allocator's level moves with
    /// every allocation of the test harness, so the arithmetic is checked on fixed numbers).
    struct Level(std::cell::Cell<u64>);

    impl MemoryProbe for Level {
        fn name(&self) -> &str {
            "level"
        }
        fn current(&self) -> u64 {
            self.0.get()
        }
        fn peak(&self) -> u64 {
            self.0.get()
        }
        fn reset_peak(&self) {}
    }

    #[test]
    fn model_state_is_the_level_after_the_step_minus_the_baseline() {
        let probe = Level(std::cell::Cell::new(1000));
        let layout = ModelStateLayout::fp32_adam(10);
        let analytic = AnalyticMemory::new(&layout, 7, 3);
        let mut t = MemoryTracker::with_baseline(&probe, 400);
        t.begin();
        probe.0.set(1200);
        t.mark(Phase::AfterBackward);
        let no_step = t.finish(0, 0, analytic);
        assert_eq!(
            no_step.model_state, None,
            "no optimizer mark, no model state"
        );
        probe.0.set(1100);
        t.mark(Phase::AfterOptimizer);
        let r = t.finish(0, 0, analytic);
        let m = r.model_state.expect("model state");
        assert_eq!((m.baseline, m.measured, m.analytic), (400, 700, 40 + 80));
        assert!(r.table().contains("model state"));
        assert!(MemoryTracker::new(&probe)
            .finish(0, 0, analytic)
            .model_state
            .is_none());
    }

    /// L = 4, C = 8, H = 2, V = 16, T = 4, 2-byte activations: per block at b rows
    /// `b·4·8·(34 + 5·2·4/8) = 1248·b` bytes, head `3·b·4·16·2 = 384·b` bytes.
    fn small() -> GptConfig {
        GptConfig {
            vocab_size: 16,
            block_size: 4,
            n_layer: 4,
            n_head: 2,
            n_embd: 8,
            moe: None,
        }
    }

    #[test]
    fn single_device_estimate_is_the_whole_model() {
        let cfg = small();
        // 4 blocks · 1248·4 + 384·4 = 4992·4 + 1536 = 21504.
        assert_eq!(activation_bytes(&cfg, 4, 4, 2, false), 21_504);
        // Checkpointing: 4 block inputs of 4·4·8·2 bytes + one block + head = 1024 + 4992 + 1536.
        assert_eq!(activation_bytes(&cfg, 4, 4, 2, true), 7_552);
        // GPT-2 124M: the paper's closed form, 12·b·t·c·(34 + 5·h·t/c) + 3·b·t·V·2.
        let g = GptConfig::gpt2_124m();
        let (b, t, c, h, v) = (8.0, 1024.0, 768.0, 12.0, 50304.0);
        let closed = 12.0 * b * t * c * (34.0 + 5.0 * h * t / c) + 3.0 * b * t * v * 2.0;
        assert_eq!(activation_bytes(&g, 8, 1024, 2, false), closed as u64);
    }

    #[test]
    fn pipeline_1f1b_holds_its_stage_blocks_times_micro_batches_in_flight() {
        let cfg = small();
        let mut plan = ParallelPlan::new(mtrain_comm::MeshDims::new(1, 2, 1, 1));
        plan.microbatches = 2;
        plan.schedule = ScheduleKind::OneFOneB;
        // B = 4 rows, M = 2: micro-batch b = 2; per block 1248·2 = 2496, head 384·2 = 768.
        let r0 = ActivationLayout::for_plan(&cfg, &plan, 0, 4).expect("rank 0");
        let r1 = ActivationLayout::for_plan(&cfg, &plan, 1, 4).expect("rank 1");
        assert_eq!(
            (r0.blocks, r0.micro_batch, r0.in_flight, r0.holds_head),
            (2, 2, 2, false)
        );
        assert_eq!(
            (r1.blocks, r1.micro_batch, r1.in_flight, r1.holds_head),
            (2, 2, 1, true)
        );
        // Rank 0: min(P − 0, M) = 2 in flight · 2 blocks · 2496 = 9984.
        assert_eq!(rank_activation_bytes(&cfg, &r0, 4, 2, false), 9_984);
        // Rank 1: min(P − 1, M) = 1 in flight · (2 · 2496 + 768) = 5760.
        assert_eq!(rank_activation_bytes(&cfg, &r1, 4, 2, false), 5_760);
        // GPipe keeps all M = 2 micro-batches on the last stage too: 2 · 5760.
        plan.schedule = ScheduleKind::GPipe;
        let g1 = ActivationLayout::for_plan(&cfg, &plan, 1, 4).expect("gpipe rank 1");
        assert_eq!(rank_activation_bytes(&cfg, &g1, 4, 2, false), 11_520);
        // A batch that does not split into M micro-batches is refused, naming both.
        let e = ActivationLayout::for_plan(&cfg, &plan, 0, 3).expect_err("3 rows, M = 2");
        assert!(e.to_string().contains("batch 3") && e.to_string().contains('2'));
    }

    #[test]
    fn tensor_parallel_splits_the_sharded_part_and_sequence_parallel_the_rest() {
        let cfg = small();
        let mut plan = ParallelPlan::new(mtrain_comm::MeshDims::new(1, 1, 2, 1));
        let tp = ActivationLayout::for_plan(&cfg, &plan, 0, 4).expect("tp 2");
        // b·t·c = 128; per value 10 + 24/2 + 5·2·4/(8·2) = 24.5 → 3136 per block;
        // 4 blocks + logits 3·4·4·16·2/2 = 768: 12544 + 768.
        assert_eq!(rank_activation_bytes(&cfg, &tp, 4, 2, false), 13_312);
        plan.sequence_parallel = true;
        let sp = ActivationLayout::for_plan(&cfg, &plan, 0, 4).expect("tp 2 + sp");
        // per value 34/2 + 2.5 = 19.5 → 2496 per block; 4 · 2496 + 768.
        assert_eq!(rank_activation_bytes(&cfg, &sp, 4, 2, false), 10_752);
        // tp = 1 gives back the single-device figure.
        let one = ActivationLayout::for_plan(
            &cfg,
            &ParallelPlan::new(mtrain_comm::MeshDims::new(1, 1, 1, 1)),
            0,
            4,
        )
        .expect("one rank");
        assert_eq!(
            rank_activation_bytes(&cfg, &one, 4, 2, false),
            activation_bytes(&cfg, 4, 4, 2, false)
        );
    }

    #[test]
    fn checkpointing_shrinks_the_activation_estimate() {
        let cfg = GptConfig::gpt2_124m();
        let full = activation_bytes(&cfg, 8, 1024, 2, false);
        let ckpt = activation_bytes(&cfg, 8, 1024, 2, true);
        assert!(ckpt * 3 < full, "{ckpt} vs {full}");
    }
}
