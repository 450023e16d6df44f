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
//! FSDP also parameters, and ZeRO-1/2 keep a shard copy beside the full tensors
//! ([`ModelStateLayout::for_plan`]). Tensor and pipeline parallelism shrink Φ itself (the
//! parameters a rank owns), so they enter through `n_params`: read from the rank's holdings
//! table (`mtrain_parallel::holdings`) for the report and, through [`rank_params`], for
//! `mtrain plan`, which prints the same figures.
//!
//! What a step adds ([`StepMemory`], [`rank_step_memory`]) is counted from what the code keeps
//! (`memory/kept.rs`): each segment's recorded graph or tape tensor by tensor, the engine's
//! leaf copy of each segment input, and the worst moment of each segment's backward from
//! candle's backward rules — no constant is fitted to a measurement. Per rank: its stage's
//! segments, its micro-batches in flight, the tp/sp splits and their collectives' copies, the
//! ZeRO-3 weights the forward still holds (all, or the last segment's when it reshards) and
//! those the backward gathers again, the MoE rows dispatched; the peak is the largest
//! moment of the first backward (and, with several passes per step, of the last, when every
//! gradient exists), or the end of the forward.
//!
//! The analytic model is `memory/analytic.rs` with `memory/kept.rs`, the probes
//! `memory/measured.rs`; this file is the report and the tracker that samples a probe through a
//! step.
//!
//! Measured side. A [`MemoryProbe`] reports current and peak bytes; on CPU [`CpuProbe`] reads the
//! counters of [`CountingAlloc`], a global allocator wrapping `System` that the binary installs:
//!
//! ```ignore
//! #[global_allocator]
//! static A: mtrain_trainer::memory::CountingAlloc = mtrain_trainer::memory::CountingAlloc;
//! ```
//!
//! On a GPU, `gpu_memory::CudaMemoryProbe` (CUDA memory-pool used / high-water, read after a
//! device synchronisation) implements the same trait. The trainer samples the probe at the
//! step's start, after the forward (a pipeline: right before the rank's first backward), after
//! the backward and after the optimizer step, and reports each phase against the step's start
//! ([`Increments`], a textbook profile) beside what the model predicts for it; the report is
//! printed as a table and appended as one JSON line to `RUN_DIR/memory.jsonl`.
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

mod analytic;
mod kept;
mod measured;

use std::fmt::Write as _;

use serde::Serialize;

pub use analytic::{
    activation_bytes, bucket_bytes, checkpoint_bytes, rank_activation_bytes, rank_checkpoint_bytes, rank_params, rank_startup_bytes,
    rank_step_memory, startup_bytes, step_memory, ActivationLayout, ActivationLayoutError,
    ModelStateLayout, StepMemory, StepRun,
};
pub use kept::{BackwardPath, Dims, Routing, SegmentCost};
pub use measured::{peak_rss, CountingAlloc, CpuProbe, MemoryProbe};

/// The startup line of `--mem-report`, printed by every rank once its model is built: what it
/// should hold ([`startup_bytes`]) beside the probe's peak while building, above the baseline,
/// and the process's resident high-water mark so far.
pub fn startup_line(rank: usize, analytic: u64, measured: u64, probe: &str) -> String {
    let rss = peak_rss().map_or("unknown".into(), |b| mib(b).trim().to_string());
    let (analytic, measured) = (mib(analytic), mib(measured));
    format!(
        "rank {rank} startup: analytic {}, measured peak {} ({probe}, above the baseline); \
         process peak RSS {rss}",
        analytic.trim(),
        measured.trim()
    )
}

/// The checkpoint line of `--mem-report`, printed by every rank after it writes (`op` "save")
/// or reads ("load") a checkpoint: the heap's rise while doing it beside what it should be
/// bounded by: one piece's buffer when writing (the pieces are written from where they live,
/// one at a time), the rank's own pieces plus one piece's buffer when reading (the model is
/// built from the files). `pieces` and `largest` are the bytes of the rank's pieces (weights or
/// fp32 masters, Adam m and v) and of its largest piece of one kind.
pub fn checkpoint_line(
    rank: usize,
    op: &str,
    step: u64,
    measured: u64,
    pieces: u64,
    largest: u64,
) -> String {
    let (bound, what) = match op {
        "save" => (largest, "one piece"),
        _ => (pieces + largest, "its own pieces + one piece"),
    };
    format!(
        "rank {rank} checkpoint {op} at step {step}: heap rise {} measured, {} analytic ({what}; \
         pieces {}, largest {})",
        mib(measured).trim(),
        mib(bound).trim(),
        mib(pieces).trim(),
        mib(largest).trim()
    )
}

/// A line of `--mem-report` on every rank: the most host memory the process has held since it
/// started, up to `when` (after the last step, before its checkpoint; at the end of the run),
/// as heap ([`CountingAlloc::lifetime_peak`], when it is the allocator) and as resident memory
/// ([`peak_rss`]).
pub fn run_peak_line(rank: usize, when: &str) -> String {
    let rss = peak_rss().map_or("unknown".into(), |b| mib(b).trim().to_string());
    let heap = match CountingAlloc::installed() {
        true => mib(CountingAlloc::lifetime_peak()).trim().to_string(),
        false => "not counted".into(),
    };
    format!("rank {rank} peak {when}: heap {heap}, process peak RSS {rss}")
}

/// The analytic side of a report: the model state by category and what the step adds to it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AnalyticMemory {
    /// Parameter bytes.
    pub params: u64,
    /// Gradient bytes.
    pub grads: u64,
    /// Optimizer state (and master weight) bytes.
    pub optim: u64,
    /// Of those, the moments the first optimizer step allocates.
    pub moments: u64,
    /// Activation bytes held at the end of the forward ([`StepMemory::activations`]).
    pub activations: u64,
    /// ZeRO-3 weights the forward gathered and still holds at its end.
    pub gathered: u64,
    /// Gradients the earlier micro-steps wrote before the reported forward ended.
    pub earlier_grads: u64,
    /// Communication buffers (DDP buckets).
    pub comm: u64,
    /// The step's highest level above its start: [`StepMemory::peak`], or the end of the
    /// backward with every gradient and bucket held, whichever is higher.
    pub peak: u64,
}

impl AnalyticMemory {
    /// From a layout, the step's prediction and the communication buffers.
    pub fn new(layout: &ModelStateLayout, step: StepMemory, comm: u64) -> Self {
        Self {
            params: layout.params(),
            grads: layout.grads(),
            optim: layout.optim(),
            moments: layout.moments(),
            activations: step.activations,
            gathered: step.gathered,
            earlier_grads: step.earlier_grads,
            comm,
            peak: step.peak.max(layout.grads() + comm),
        }
    }

    /// The level the end of the forward adds to the step's start: activations, gathers, and
    /// under gradient accumulation the earlier micro-steps' gradients.
    pub fn forward(&self) -> u64 {
        self.activations + self.gathered + self.earlier_grads
    }

    /// Sum of the model-state categories, the forward's increment and the buffers.
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optim + self.forward() + self.comm
    }

    /// The phases this predicts for a step (`first`: the run's first, whose optimizer step
    /// allocates the moments): the forward's level, the gradients the backward leaves, the
    /// optimizer step freeing them, the peak.
    pub fn increments(&self, first: bool) -> Increments {
        let moments = if first { self.moments } else { 0 };
        Increments {
            forward: Some(self.forward() as i64),
            gradients: Some(self.grads as i64),
            optimizer: Some(moments as i64 - self.grads as i64),
            peak: self.peak,
        }
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

/// A step's measured phases as a textbook memory profile: what each phase adds to the level the
/// step started at (signed: the backward frees activations, the optimizer step the gradients).
///
/// ```text
///   level ▲          peak
///         │         ╭─╮
///         │   fwd  ╱   ╲  bwd          forward   = after forward  − start
///         │  ╱          ╲___           gradients = after backward − start
///   start ┼─╯               ╲____      optimizer = after optimizer − after backward
///         │ parameters (+ optimizer state)           peak      = highest level − start
///         └──────────────────────────────▶
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Increments {
    /// After the forward (the last micro-batch's; a pipeline's: before its first backward).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forward: Option<i64>,
    /// After the backward: the gradients (and whatever the backward left).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gradients: Option<i64>,
    /// What the optimizer step adds after the backward (its first step allocates the moments;
    /// every step frees the gradients).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<i64>,
    /// The step's highest level above its start.
    pub peak: u64,
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
    /// The phases relative to the step's start, measured.
    pub increments: Increments,
    /// The same phases as the analytic model predicts them.
    pub predicted: Increments,
    /// The parameters measured: the level at the start of this run's first step minus the
    /// baseline (the model as built, before any optimizer state), when a baseline was recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<u64>,
    /// The model state after the optimizer step, when a baseline was recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_state: Option<ModelState>,
}

fn mib(b: u64) -> String {
    format!("{:>10.2} MiB", b as f64 / (1024.0 * 1024.0))
}

fn signed_mib(b: i64) -> String {
    format!("{:>+10.2} MiB", b as f64 / (1024.0 * 1024.0))
}

fn signed(b: Option<i64>) -> String {
    b.map(signed_mib).unwrap_or_default()
}

impl MemoryReport {
    /// The report as a table: each analytic figure beside the measured one it predicts.
    pub fn table(&self) -> String {
        let (a, p, m) = (&self.analytic, &self.predicted, &self.increments);
        let mut s = String::new();
        let _ = writeln!(
            s,
            "memory, step {} rank {} ({}):",
            self.step, self.rank, self.probe
        );
        let _ = writeln!(s, "  {:<18}{:>14}  {:>14}", "", "analytic", "measured");
        let row = |s: &mut String, name: &str, a: String, m: Option<String>, note: &str| {
            let m = m.unwrap_or_default();
            let line = format!("  {name:<18}{a:>14}  {m:>14}  {note}");
            let _ = writeln!(s, "{}", line.trim_end());
        };
        let inc = |b: Option<i64>| b.map(signed_mib);
        row(
            &mut s,
            "parameters",
            mib(a.params),
            self.parameters.map(mib),
            "(first step's start − baseline)",
        );
        row(&mut s, "gradients", mib(a.grads), None, "");
        row(
            &mut s,
            "optimizer states",
            mib(a.optim),
            None,
            "(Adam moments, fp32 masters)",
        );
        row(
            &mut s,
            "activations",
            mib(a.activations),
            None,
            "(held at the end of the forward)",
        );
        if a.gathered > 0 {
            row(
                &mut s,
                "gathered weights",
                mib(a.gathered),
                None,
                "(ZeRO-3, held at the end of the forward)",
            );
        }
        if a.comm > 0 {
            row(&mut s, "comm buffers", mib(a.comm), None, "(DDP buckets)");
        }
        row(
            &mut s,
            "after forward",
            signed(p.forward),
            inc(m.forward),
            "(− step start)",
        );
        row(
            &mut s,
            "after backward",
            signed(p.gradients),
            inc(m.gradients),
            "(− step start: the gradients)",
        );
        row(
            &mut s,
            "optimizer step",
            signed(p.optimizer),
            inc(m.optimizer),
            "(after optimizer − after backward)",
        );
        row(
            &mut s,
            "peak",
            signed_mib(p.peak as i64),
            Some(signed_mib(m.peak as i64)),
            "(highest level − step start)",
        );
        if let Some(st) = &self.model_state {
            row(
                &mut s,
                "model state",
                mib(st.analytic),
                Some(mib(st.measured)),
                &format!(
                    "(after optimizer − {:.2} MiB baseline)",
                    st.baseline as f64 / (1024.0 * 1024.0)
                ),
            );
        }
        s
    }

    /// One line for the log: model state measured against analytic, and the step's peak.
    pub fn line(&self) -> String {
        let m = |b: u64| format!("{:.2} MiB", b as f64 / (1024.0 * 1024.0));
        let peak = format!(
            "peak +{} measured / +{} analytic above the step's start",
            m(self.increments.peak),
            m(self.analytic.peak)
        );
        match &self.model_state {
            Some(st) => format!(
                "memory: model state {} measured / {} analytic ({:.2}x), {peak} ({})",
                m(st.measured),
                m(st.analytic),
                st.ratio(),
                self.probe
            ),
            None => format!("memory: {peak} ({})", self.probe),
        }
    }
}

/// Samples a probe through one step.
pub struct MemoryTracker<'p> {
    probe: &'p dyn MemoryProbe,
    measured: Vec<(Phase, u64)>,
    baseline: Option<u64>,
    /// The level at the start of the first step this tracker saw.
    first_start: Option<u64>,
    /// Steps begun.
    steps: u64,
    /// The high-water mark read at the optimizer step's mark (what follows in the loop, an
    /// evaluation or a checkpoint, is not the step's).
    step_peak: Option<u64>,
}

impl<'p> MemoryTracker<'p> {
    /// A tracker over `probe`.
    pub fn new(probe: &'p dyn MemoryProbe) -> Self {
        Self {
            probe,
            measured: Vec::new(),
            baseline: None,
            first_start: None,
            steps: 0,
            step_peak: None,
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
        self.step_peak = None;
        self.probe.settle();
        self.probe.reset_peak();
        let now = self.probe.current();
        self.first_start.get_or_insert(now);
        self.steps += 1;
        self.measured.push((Phase::Start, now));
    }

    /// Record the level at `phase` (a later mark of the same phase replaces the earlier one, so with
    /// gradient accumulation the last micro-batch is reported).
    pub fn mark(&mut self, phase: Phase) {
        self.probe.settle();
        let now = self.probe.current();
        if phase == Phase::AfterOptimizer {
            self.step_peak = Some(self.probe.peak());
        }
        self.record(phase, now);
    }

    /// Record `level`, read earlier, as the level at `phase` (a pipeline reads the level
    /// before its first backward, inside the step).
    pub fn record(&mut self, phase: Phase, level: u64) {
        match self.measured.iter_mut().find(|(p, _)| *p == phase) {
            Some(slot) => slot.1 = level,
            None => self.measured.push((phase, level)),
        }
    }

    fn level(&self, phase: Phase) -> Option<u64> {
        self.measured
            .iter()
            .find(|(p, _)| *p == phase)
            .map(|(_, b)| *b)
    }

    /// The step's report.
    pub fn finish(&self, step: u64, rank: usize, analytic: AnalyticMemory) -> MemoryReport {
        let after_step = self.level(Phase::AfterOptimizer);
        let model_state = match (self.baseline, after_step) {
            (Some(baseline), Some(after)) => Some(ModelState {
                baseline,
                measured: after.saturating_sub(baseline),
                analytic: analytic.params + analytic.optim,
            }),
            _ => None,
        };
        let start = self.level(Phase::Start).unwrap_or(0);
        let diff = |a: Option<u64>, b: Option<u64>| Some(a? as i64 - b? as i64);
        let backward = self.level(Phase::AfterBackward);
        let peak = self.step_peak.unwrap_or_else(|| self.probe.peak());
        MemoryReport {
            step,
            rank,
            probe: self.probe.name().to_string(),
            analytic,
            measured: self.measured.clone(),
            peak,
            predicted: analytic.increments(self.steps == 1),
            increments: Increments {
                forward: diff(self.level(Phase::AfterForward), Some(start)),
                gradients: diff(backward, Some(start)),
                optimizer: diff(after_step, backward),
                peak: peak.saturating_sub(start),
            },
            parameters: match (self.baseline, self.first_start) {
                (Some(b), Some(s)) => Some(s.saturating_sub(b)),
                _ => None,
            },
            model_state,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let analytic = AnalyticMemory::new(
            &layout,
            StepMemory {
                activations: 7,
                gathered: 0,
                earlier_grads: 0,
                peak: 9,
            },
            3,
        );
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
        // Phases against the step's start (1000): +200 after the backward, −100 by the
        // optimizer; the parameters against the baseline; the first step's optimizer step is
        // predicted to allocate the moments (80) and free the gradients (40).
        assert_eq!(
            (r.increments.gradients, r.increments.optimizer, r.parameters),
            (Some(200), Some(-100), Some(600))
        );
        assert_eq!(r.predicted.optimizer, Some(80 - 40));
        assert_eq!((r.predicted.forward, r.predicted.peak), (Some(7), 40 + 3));
        assert!(MemoryTracker::new(&probe)
            .finish(0, 0, analytic)
            .model_state
            .is_none());
    }
}
