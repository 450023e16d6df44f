//! `mtrain plot RUN_DIR`: SVG charts of a run, drawn with plotters from its JSON lines.
//!
//! ```text
//!   metrics.jsonl  -> loss.svg       training loss (and validation points) per step
//!   memory.jsonl   -> memory.svg     a panel per rank: the measured level through each
//!                                    step's phases (start, after forward, peak, after
//!                                    backward, after optimizer; a marker each) and the
//!                                    predicted levels as dashed lines (end of forward, peak,
//!                                    model state), integer step ticks
//!   pipeline-rank{N}.jsonl           one step of the pipeline as it ran (runs with pp > 1):
//!                  -> pipeline.svg   a row per rank, a box per forward (F<mb>), backward
//!                                    (B<mb>), send, receive wait, and the idle gaps
//!
//!          0 ms                                                      step end
//!   rank 0 [F0]▮[F1]▮~~~~~~~[B0]~~~~~~~~~[B1]······
//!   rank 1 ·····~~~~[F0][B0]▮~~~[F1][B1]▮===
//!          ▮ send issued   ~ waiting for a receive   = waiting for sends   · idle
//! ```
//!
//! The chart shows the last step every rank recorded (the trainer writes the logged steps),
//! with rows aligned on the ranks' wall clocks.
//!
//! Only SVG is written: it needs no font files on the machine (the text is left to the viewer).

//!
//! Each chart is its own file: `plot/memory.rs` (the memory timeline) and `plot/pipeline.rs`
//! (the pipeline's Gantt chart); this one reads the run directory, draws the loss and holds
//! what the charts share (the palette, the value axis, reading JSON lines).

mod memory;
mod pipeline;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use plotters::prelude::*;
use serde_json::Value;

use memory::memory_chart;
use pipeline::{pipeline_chart, read_timelines};

/// Options of `mtrain plot`.
#[derive(Debug, Clone, Args)]
pub struct PlotArgs {
    /// A run directory (with metrics.jsonl; memory.jsonl with --mem-report; pipeline-rank{N}.jsonl
    /// with pp > 1).
    pub run_dir: PathBuf,
}

const W: u32 = 900;
const H: u32 = 500;

fn read_lines(path: &Path) -> anyhow::Result<Vec<Value>> {
    let s = crate::fsio::read_to_string(path)?;
    s.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).with_context(|| format!("a line of {}", path.display())))
        .collect()
}

/// The lines of one run from `path` (metrics.jsonl), in step order; a file holding more than one
/// run is refused, never drawn as one curve.
///
/// Every line names its run (`run`, see `crate::run_dir`). One run resumed from an earlier
/// checkpoint re-runs the steps after it: the later line of a step replaces the earlier. A file
/// written before lines named their run is one run only while its steps increase.
pub fn one_run(lines: Vec<Value>, path: &Path) -> anyhow::Result<Vec<Value>> {
    let id = |l: &Value| l.get("run").and_then(Value::as_str).map(str::to_string);
    let mut runs: Vec<Option<String>> = Vec::new();
    for l in &lines {
        if !runs.contains(&id(l)) {
            runs.push(id(l));
        }
    }
    if runs.len() > 1 {
        let names: Vec<String> = runs
            .iter()
            .map(|r| r.clone().unwrap_or_else(|| "(unnamed)".into()))
            .collect();
        bail!(
            "{} holds {} runs ({}); a chart draws one run: give each run its own --run-dir",
            path.display(),
            runs.len(),
            names.join(", ")
        );
    }
    let step = |l: &Value| l.get("step").and_then(Value::as_u64).unwrap_or(0);
    if runs.first().is_some_and(Option::is_none) {
        for (i, pair) in lines.windows(2).enumerate() {
            if step(&pair[1]) <= step(&pair[0]) {
                bail!(
                    "{} holds more than one run: step {} on line {} follows step {}; a chart draws one run: give each run its own --run-dir",
                    path.display(),
                    step(&pair[1]),
                    i + 2,
                    step(&pair[0])
                );
            }
        }
    }
    let mut by_step = std::collections::BTreeMap::new();
    for l in lines {
        by_step.insert(step(&l), l);
    }
    Ok(by_step.into_values().collect())
}

fn num(v: &Value, key: &str) -> f64 {
    v.get(key).and_then(Value::as_f64).unwrap_or(0.0)
}

fn plot_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("drawing: {e:?}")
}

fn palette(i: usize) -> RGBColor {
    const C: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    C[i % C.len()]
}

/// Writes every chart the run directory has data for; returns the files written.
pub fn plot_run(run_dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    let metrics = run_dir.join("metrics.jsonl");
    if !metrics.exists() {
        bail!(
            "{} has no metrics.jsonl: is it a run directory?",
            run_dir.display()
        );
    }
    // Drawing errors (plotters writes the SVG as it draws) name the file being written.
    let writing = |path: &Path| format!("writing {}", path.display());
    let loss = run_dir.join("loss.svg");
    let lines = one_run(read_lines(&metrics)?, &metrics)?;
    written.push(loss_chart(&lines, &loss).with_context(|| writing(&loss))?);
    let memory = run_dir.join("memory.jsonl");
    if memory.exists() {
        let svg = run_dir.join("memory.svg");
        written.push(memory_chart(&read_lines(&memory)?, &svg).with_context(|| writing(&svg))?);
    }
    if let Some((step, rows)) = read_timelines(run_dir)? {
        let svg = run_dir.join("pipeline.svg");
        written.push(pipeline_chart(step, &rows, &svg).with_context(|| writing(&svg))?);
    }
    Ok(written)
}

fn loss_chart(lines: &[Value], out: &Path) -> anyhow::Result<PathBuf> {
    let train: Vec<(f64, f64)> = lines
        .iter()
        .map(|l| (num(l, "step"), num(l, "loss")))
        .collect();
    let val: Vec<(f64, f64)> = lines
        .iter()
        .filter_map(|l| Some((num(l, "step"), l.get("val_loss")?.as_f64()?)))
        .collect();
    let all = train.iter().chain(&val);
    let (x1, y0, y1) = all.fold((1.0f64, f64::MAX, f64::MIN), |(x, lo, hi), &(s, v)| {
        (x.max(s), lo.min(v), hi.max(v))
    });
    let root = SVGBackend::new(out, (W, H)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("loss", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(35)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..x1, value_axis(y0, y1))
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("nats / token")
        .draw()
        .map_err(plot_err)?;
    chart
        .draw_series(LineSeries::new(train, &palette(0)))
        .map_err(plot_err)?
        .label("train")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], palette(0)));
    chart
        .draw_series(val.iter().map(|&p| Circle::new(p, 4, palette(1).filled())))
        .map_err(plot_err)?
        .label("validation")
        .legend(|(x, y)| Circle::new((x + 7, y), 4, palette(1).filled()));
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)?;
    Ok(out.to_path_buf())
}

/// The range of a value axis showing `lo..=hi` with 5% margins. A single value (a one-step run)
/// or no finite value gets a range one unit wide: plotters finds no ticks on an empty range and
/// never returns.
fn value_axis(lo: f64, hi: f64) -> std::ops::Range<f64> {
    if !(lo.is_finite() && hi.is_finite() && hi > lo) {
        let mid = if lo.is_finite() && lo <= hi { lo } else { 0.0 };
        return (mid - 0.5)..(mid + 0.5);
    }
    let pad = 0.05 * (hi - lo);
    (lo - pad)..(hi + pad)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two runs in one metrics.jsonl are refused naming both; one resumed run is drawn with the
    /// resumed steps replacing the ones it re-ran; an unnamed file is one run while steps increase.
    #[test]
    fn two_runs_are_never_drawn_as_one_curve() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let parse = |text: &str| -> Vec<Value> {
            text.lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect()
        };
        let two = parse(
            "{\"step\":0,\"run\":\"a\",\"loss\":5}\n{\"step\":1,\"run\":\"a\",\"loss\":4}\n{\"step\":0,\"run\":\"b\",\"loss\":5.5}",
        );
        let e = one_run(two, &path).unwrap_err().to_string();
        assert!(e.contains("holds 2 runs (a, b)"), "{e}");
        let resumed = parse(
            "{\"step\":0,\"run\":\"a\",\"loss\":5}\n{\"step\":1,\"run\":\"a\",\"loss\":4}\n{\"step\":1,\"run\":\"a\",\"loss\":3.9}\n{\"step\":2,\"run\":\"a\",\"loss\":3}",
        );
        let kept = one_run(resumed, &path).unwrap();
        let losses: Vec<f64> = kept.iter().map(|l| num(l, "loss")).collect();
        assert_eq!(losses, [5.0, 3.9, 3.0]);
        let unnamed =
            parse("{\"step\":0,\"loss\":5}\n{\"step\":10,\"loss\":4}\n{\"step\":0,\"loss\":5}");
        let e = one_run(unnamed, &path).unwrap_err().to_string();
        assert!(e.contains("step 0 on line 3 follows step 10"), "{e}");
    }

    /// A run of one step has one loss: the chart is drawn (it used to hang in plotters).
    #[test]
    fn a_one_step_run_is_plotted() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("metrics.jsonl"),
            "{\"step\":0,\"loss\":5.5}\n",
        )
        .unwrap();
        let written = plot_run(dir.path()).unwrap();
        assert!(
            written.iter().any(|p| p.ends_with("loss.svg")),
            "{written:?}"
        );
        // A chart that cannot be written names its file.
        std::fs::remove_file(dir.path().join("loss.svg")).unwrap();
        std::fs::create_dir(dir.path().join("loss.svg")).unwrap();
        let e = format!("{:#}", plot_run(dir.path()).unwrap_err());
        let svg = dir.path().join("loss.svg");
        assert!(
            e.starts_with(&format!("writing {}: ", svg.display())),
            "{e}"
        );
        assert_eq!(value_axis(2.0, 2.0), 1.5..2.5);
        assert_eq!(value_axis(f64::MAX, f64::MIN), -0.5..0.5);
    }
}
