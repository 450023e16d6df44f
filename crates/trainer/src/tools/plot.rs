//! `mtrain plot RUN_DIR [RUN_DIR...]`: SVG charts of a run, drawn with plotters from its JSON
//! lines; given several runs, also one chart of their losses side by side.
//!
//! ```text
//!   metrics.jsonl  -> loss.svg       training loss (and validation points) per step
//!   several runs   -> compare.svg    in the first run directory: each run's evaluated losses
//!                                    (val solid, train dashed; the training loss where a run
//!                                    has no evaluation), one colour a run, named by directory
//!   memory.jsonl   -> memory.svg     a panel per rank: the measured level through each
//!                                    step's phases (start, after forward, peak, after
//!                                    backward, after optimizer; a marker each) and the
//!                                    predicted levels as dashed lines (end of forward, peak,
//!                                    model state), integer step ticks
//!   ops.json       -> roofline.svg   every op of a `--profile-ops` run at (FLOP/byte, FLOP/s)
//!                                    under the measured roofs, sized by its share of the step
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
//! Each chart is its own file: `plot/memory.rs` (the memory timeline), `plot/pipeline.rs`
//! (the pipeline's Gantt chart) and `plot/roofline.rs` (the roofline); this one reads the run directory, draws the loss and holds
//! what the charts share (the palette, the value axis, reading JSON lines).

mod memory;
mod pipeline;
mod roofline;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use plotters::prelude::*;
use serde_json::Value;

use memory::memory_chart;
use pipeline::{pipeline_chart, read_timelines};
pub use roofline::roofline_chart;

/// Options of `mtrain plot`.
#[derive(Debug, Clone, Args)]
pub struct PlotArgs {
    /// Run directories (with metrics.jsonl; memory.jsonl with --mem-report; pipeline-rank{N}.jsonl
    /// with pp > 1). With more than one, compare.svg in the first compares their losses.
    #[arg(required = true, num_args = 1..)]
    pub run_dirs: Vec<PathBuf>,
}

/// Every run's charts, then with several runs their comparison; returns the files written.
pub fn plot(args: &PlotArgs) -> anyhow::Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for dir in &args.run_dirs {
        written.extend(plot_run(dir)?);
    }
    if let [first, _, ..] = args.run_dirs.as_slice() {
        let out = first.join("compare.svg");
        let runs = args
            .run_dirs
            .iter()
            .map(|d| {
                let metrics = d.join("metrics.jsonl");
                Ok((run_name(d), one_run(read_lines(&metrics)?, &metrics)?))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let path =
            compare_chart(&runs, &out).with_context(|| format!("writing {}", out.display()))?;
        written.push(path);
    }
    Ok(written)
}

/// A run's name in the comparison's legend: its directory's last component.
fn run_name(dir: &Path) -> String {
    let canonical = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    canonical.file_name().map_or_else(
        || dir.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

/// The (step, value) points of `key` in a run's lines.
fn series(lines: &[Value], key: &str) -> Vec<(f64, f64)> {
    lines
        .iter()
        .filter_map(|l| Some((num(l, "step"), l.get(key)?.as_f64()?)))
        .collect()
}

/// Several runs' losses on one chart: per run its validation curve (solid) and its training
/// split's evaluation (dashed), or its training loss where it has no evaluation.
fn compare_chart(runs: &[(String, Vec<Value>)], out: &Path) -> anyhow::Result<PathBuf> {
    // (run, legend, points, solid): one colour a run.
    let mut curves: Vec<(usize, String, Vec<(f64, f64)>, bool)> = Vec::new();
    for (run, (name, lines)) in runs.iter().enumerate() {
        let (val, train_eval) = (series(lines, "val_loss"), series(lines, "train_eval_loss"));
        if val.is_empty() && train_eval.is_empty() {
            curves.push((run, format!("{name} train"), series(lines, "loss"), true));
            continue;
        }
        curves.push((run, format!("{name} val"), val, true));
        if !train_eval.is_empty() {
            curves.push((run, format!("{name} train (eval)"), train_eval, false));
        }
    }
    let root = SVGBackend::new(out, (W, H)).into_drawing_area();
    let mut chart = loss_axes(&root, curves.iter().flat_map(|(_, _, pts, _)| pts))?;
    for (run, name, pts, solid) in curves {
        let colour = palette(run);
        let drawn = match solid {
            true => chart.draw_series(LineSeries::new(pts, &colour)),
            false => chart.draw_series(DashedLineSeries::new(pts, 6, 4, colour.into())),
        };
        drawn
            .map_err(plot_err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], colour));
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)?;
    Ok(out.to_path_buf())
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
    written.extend(run_roofline(run_dir)?);
    if let Some((step, rows)) = read_timelines(run_dir)? {
        let svg = run_dir.join("pipeline.svg");
        written.push(pipeline_chart(step, &rows, &svg).with_context(|| writing(&svg))?);
    }
    Ok(written)
}

/// `run_dir`'s roofline.svg from its ops.json and decode-ops.json (either may be missing);
/// None where neither is there.
pub fn run_roofline(run_dir: &Path) -> anyhow::Result<Option<PathBuf>> {
    let mut reports = Vec::new();
    for name in ["ops.json", crate::roofline::decode::DECODE_OPS] {
        let path = run_dir.join(name);
        if path.exists() {
            let text = crate::fsio::read_to_string(&path)?;
            let report: crate::roofline::OpsReport = serde_json::from_str(&text)
                .with_context(|| format!("parsing {}", path.display()))?;
            reports.push(report);
        }
    }
    if reports.is_empty() {
        return Ok(None);
    }
    let svg = run_dir.join("roofline.svg");
    let all: Vec<_> = reports.iter().collect();
    let drawn = roofline_chart(&all, &svg).with_context(|| format!("writing {}", svg.display()))?;
    Ok(Some(drawn))
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
    let root = SVGBackend::new(out, (W, H)).into_drawing_area();
    let mut chart = loss_axes(&root, train.iter().chain(&val))?;
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

/// A loss chart's axes on a white `root`: steps from 0 to the last of `points`, nats per token
/// over their range.
fn loss_axes<'a, 'b, 'p>(
    root: &'a DrawingArea<SVGBackend<'b>, plotters::coord::Shift>,
    points: impl Iterator<Item = &'p (f64, f64)>,
) -> anyhow::Result<
    ChartContext<
        'a,
        SVGBackend<'b>,
        Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
    >,
> {
    let (x1, y0, y1) = points.fold((1.0f64, f64::MAX, f64::MIN), |(x, lo, hi), &(s, v)| {
        (x.max(s), lo.min(v), hi.max(v))
    });
    root.fill(&WHITE).map_err(plot_err)?;
    let mut chart = ChartBuilder::on(root)
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
    Ok(chart)
}

/// The legend of a chart whose series are told apart by their marks: framed, on a light
/// backdrop, at `position` (away from where its data lies).
fn legend<'a, 'b: 'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, SVGBackend<'b>, CT>,
    position: SeriesLabelPosition,
) -> anyhow::Result<()> {
    chart
        .configure_series_labels()
        .position(position)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.85))
        .label_font(("sans-serif", 11))
        .draw()
        .map_err(plot_err)
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

    /// Several runs: each its own charts, and compare.svg in the first with a curve per
    /// evaluated split of each run (its training loss where it has none), named by directory.
    #[test]
    fn several_runs_are_compared_on_one_chart() {
        let root = tempfile::tempdir().unwrap();
        let (a, b) = (root.path().join("mtrain"), root.path().join("torch"));
        for (dir, text) in [
            (&a, "{\"step\":0,\"loss\":5}\n{\"step\":9,\"loss\":3,\"train_eval_loss\":3.1,\"val_loss\":3.2}\n"),
            (&b, "{\"step\":0,\"loss\":5.1}\n{\"step\":9,\"loss\":2.9}\n"),
        ] {
            std::fs::create_dir(dir).unwrap();
            std::fs::write(dir.join("metrics.jsonl"), text).unwrap();
        }
        let args = PlotArgs {
            run_dirs: vec![a.clone(), b.clone()],
        };
        let written = plot(&args).unwrap();
        assert_eq!(
            written,
            [
                a.join("loss.svg"),
                b.join("loss.svg"),
                a.join("compare.svg")
            ]
        );
        let svg = std::fs::read_to_string(a.join("compare.svg")).unwrap();
        for label in ["mtrain val", "mtrain train (eval)", "torch train"] {
            assert!(svg.contains(label), "{label} missing from compare.svg");
        }
        assert!(!svg.contains("torch val"), "torch has no evaluation");
        // One run: no comparison.
        let one = plot(&PlotArgs {
            run_dirs: vec![b.clone()],
        })
        .unwrap();
        assert_eq!(one, [b.join("loss.svg")]);
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
