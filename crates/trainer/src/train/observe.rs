//! What the loop does after each step besides the step: the evaluation, the logs (the step
//! line, `metrics.jsonl`, `steps.jsonl`, the pipeline timeline), the memory report and the
//! checkpoint. Each reads the step's outcome and the model, and none changes what is trained.
//!
//! ```text
//!   step done -> evaluation (every eval_every, and the last) -> StepMetrics
//!             -> StepLogs::record (every log_every, the last, an evaluation)
//!             -> MemoryReports::record (--mem-report) -> save_checkpoint (every ckpt_every, the last)
//! ```

use std::path::PathBuf;

use anyhow::Context;
use candle_core::Device;

use super::{evaluate, open_append, write_json_line};
use crate::config::TrainConfig;
use crate::data::DataLoader;
use crate::distributed::Distributed;
use crate::fsio::JsonLines;
use crate::memory::{checkpoint_line, AnalyticMemory, CountingAlloc, CpuProbe, MemoryProbe, MemoryTracker};
use crate::progress::{self, Progress, StepMetrics};

/// The evaluation after `step` when one is due (every `eval_every` steps and after the last):
/// (training split, validation split), each the mean loss of `eval_iters` random batches.
pub(super) fn evaluation(
    cfg: &TrainConfig,
    model: &mut Distributed,
    (train, val): (&DataLoader, &DataLoader),
    step: u64,
    device: &Device,
) -> anyhow::Result<Option<(f64, f64)>> {
    let last = step + 1 == cfg.steps;
    if cfg.eval_every == 0 || ((step + 1) % cfg.eval_every != 0 && !last) {
        return Ok(None);
    }
    let t = evaluate(model, train, step, cfg.eval_iters, device)?;
    let v = evaluate(model, val, step, cfg.eval_iters, device)?;
    Ok(Some((t, v)))
}

/// The step logs of one rank: its step line (rank 0, or every rank with `log_ranks`),
/// `metrics.jsonl` (rank 0), and, opened when a step first has one, its `steps.jsonl` report
/// and `pipeline-rank{N}.jsonl` timeline.
pub(super) struct StepLogs<'c> {
    cfg: &'c TrainConfig,
    rank: usize,
    /// Whether this rank writes the step lines.
    pub(super) logs_steps: bool,
    metrics: Option<JsonLines>,
    steps: Option<JsonLines>,
    timeline: Option<JsonLines>,
}

impl<'c> StepLogs<'c> {
    pub(super) fn open(cfg: &'c TrainConfig, rank: usize) -> anyhow::Result<Self> {
        let lead = rank == 0;
        let metrics = lead
            .then(|| open_append(&cfg.run_dir.join("metrics.jsonl")))
            .transpose()?;
        Ok(Self {
            cfg,
            rank,
            logs_steps: lead || cfg.log_ranks,
            metrics,
            steps: None,
            timeline: None,
        })
    }

    /// Step `m`'s lines: the step line, metrics and rank 0's step and phase lines at a log step
    /// (`log_now`) or an evaluation; the step report at every step that has one; the pipeline
    /// timeline at every log step and the last.
    pub(super) fn record(
        &mut self,
        m: &StepMetrics,
        model: &Distributed,
        bar: &Progress,
        log_now: bool,
    ) -> anyhow::Result<()> {
        let (rank, step, lead) = (self.rank, m.step, self.rank == 0);
        let last = step + 1 == self.cfg.steps;
        if log_now || m.val_loss.is_some() {
            if self.logs_steps {
                let line = progress::step_line(m, self.cfg.steps);
                bar.log(|| tracing::info!("{line}"));
            }
            if let Some(f) = self.metrics.as_mut() {
                write_json_line(f, m)?;
            }
            if let (true, Some(line)) = (lead, model.step_line()) {
                bar.log(|| tracing::info!(rank, step, "{line}"));
            }
            if let (true, Some(p), Some(host)) = (lead, &m.phase_ms, &m.phase_host_ms) {
                bar.log(|| tracing::info!(rank, step, "phases (ms): {}", p.line(host)));
            }
        }
        if let Some(report) = &m.parallel {
            if self.steps.is_none() {
                self.steps = Some(open_append(&self.cfg.run_dir.join("steps.jsonl"))?);
            }
            if let Some(f) = self.steps.as_mut() {
                let line = serde_json::json!({ "step": step, "rank": rank, "report": report });
                write_json_line(f, &line)?;
            }
        }
        // The pipeline timeline of every logged step (and the last), one file per rank.
        if let (true, Some(timeline)) = (log_now || last, model.pipeline_timeline()) {
            if self.timeline.is_none() {
                let path = self.cfg.run_dir.join(format!("pipeline-rank{rank}.jsonl"));
                self.timeline = Some(open_append(&path)?);
            }
            if let (Some(f), serde_json::Value::Object(mut line)) =
                (self.timeline.as_mut(), timeline)
            {
                line.insert("step".into(), step.into());
                line.insert("rank".into(), rank.into());
                write_json_line(f, &line)?;
            }
        }
        Ok(())
    }
}

/// `--mem-report`'s observer: every rank appends each step's measured memory against the
/// analytic model to `memory.jsonl`; rank 0 prints the full table at the first and the last
/// step and one line at the other log steps.
pub(super) struct MemoryReports {
    log: Option<JsonLines>,
}

impl MemoryReports {
    pub(super) fn open(cfg: &TrainConfig) -> anyhow::Result<Self> {
        let log = cfg
            .mem_report
            .then(|| open_append(&cfg.run_dir.join("memory.jsonl")))
            .transpose()?;
        Ok(Self { log })
    }

    /// Step `step`'s report from `tracker` against `analytic`; `(first, last, log_now)`: the
    /// run's first step, its last, a log step.
    pub(super) fn record(
        &mut self,
        tracker: &MemoryTracker,
        analytic: AnalyticMemory,
        (step, rank): (u64, usize),
        (first, last, log_now): (bool, bool, bool),
        bar: &Progress,
    ) -> anyhow::Result<()> {
        let report = tracker.finish(step, rank, analytic);
        if let Some(f) = self.log.as_mut() {
            write_json_line(f, &report)?;
        }
        let lead = rank == 0;
        if lead && (first || last) {
            bar.log(|| eprint!("{}", report.table()));
        } else if lead && log_now {
            bar.log(|| tracing::info!(rank, step, "{}", report.line()));
        }
        Ok(())
    }
}

/// The checkpoint after `step` when one is due (every `ckpt_every` steps and after the last):
/// every rank writes the pieces it stores, rank 0 the manifest; the directory written, on rank 0.
pub(super) fn save_checkpoint(
    cfg: &TrainConfig,
    model: &Distributed,
    loader: &DataLoader,
    step: u64,
    (rank, bar): (usize, &Progress),
) -> anyhow::Result<Option<PathBuf>> {
    let last = step + 1 == cfg.steps;
    if !(last || (cfg.ckpt_every > 0 && (step + 1) % cfg.ckpt_every == 0)) {
        return Ok(None);
    }
    let watch = HeapWatch::start();
    let (dir, written) =
        model.save_checkpoint(&cfg.run_dir, step + 1, loader.position(), cfg)?;
    watch.record(cfg, model, (rank, step + 1), "save", written)?;
    let Some(dir) = dir else { return Ok(None) };
    bar.log(|| tracing::info!(rank, step = step + 1, dir = %dir.display(), "checkpoint written"));
    Ok(Some(dir))
}

/// The host heap's rise while a checkpoint is written or read (counted by the binary's
/// [`CountingAlloc`]), appended as a line of `RUN_DIR/checkpoint-memory.jsonl` with what the rank
/// holds: the claim is that it stays within the rank's own pieces plus one piece's buffer.
pub(super) struct HeapWatch {
    before: u64,
}

impl HeapWatch {
    /// Starts a new high-water mark at the heap's current size.
    pub(super) fn start() -> Self {
        let before = CpuProbe.current();
        CpuProbe.reset_peak();
        Self { before }
    }

    /// Appends `{rank, op, step, heap_rise_bytes, heap_kept_bytes, piece_bytes,
    /// largest_piece_bytes, written_bytes}` (peak and end level over the start; nothing unless
    /// the counting allocator is installed).
    pub(super) fn record(
        self,
        cfg: &TrainConfig,
        model: &Distributed,
        (rank, step): (usize, u64),
        op: &str,
        written: u64,
    ) -> anyhow::Result<()> {
        if !CountingAlloc::installed() {
            return Ok(());
        }
        let rise = CpuProbe.peak().saturating_sub(self.before);
        let kept = CpuProbe.current().saturating_sub(self.before);
        let (pieces, largest) = model.piece_bytes();
        if cfg.mem_report {
            eprintln!("{}", checkpoint_line(rank, op, step, rise, pieces, largest));
        }
        std::fs::create_dir_all(&cfg.run_dir)
            .with_context(|| format!("creating {}", cfg.run_dir.display()))?;
        let mut f = open_append(&cfg.run_dir.join("checkpoint-memory.jsonl"))?;
        let line = serde_json::json!({
            "rank": rank, "op": op, "step": step, "heap_rise_bytes": rise, "heap_kept_bytes": kept,
            "piece_bytes": pieces, "largest_piece_bytes": largest, "written_bytes": written,
        });
        write_json_line(&mut f, &line)
    }
}
