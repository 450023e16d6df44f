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

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde_json::Value;

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

/// Position of a phase inside its step on the x axis: the step's start at the integer, then
/// the forward, the peak (inside the backward), the backward and the optimizer step.
fn phase_offset(phase: &str) -> f64 {
    match phase {
        "start" => 0.0,
        "after_forward" => 0.3,
        "peak" => 0.45,
        "after_backward" => 0.6,
        _ => 0.8,
    }
}

/// The marker shape of each phase, and its legend name.
const PHASES: [(&str, &str); 5] = [
    ("start", "step start"),
    ("after_forward", "after forward"),
    ("peak", "peak"),
    ("after_backward", "after backward"),
    ("after_optimizer", "after optimizer"),
];

/// One rank's measured levels and predicted levels, in MiB above its baseline.
struct RankMemorySeries {
    rank: u64,
    /// (x, MiB, phase) in step order.
    points: Vec<(f64, f64, &'static str)>,
    /// Per step: (step, predicted end of forward, predicted peak, predicted model state).
    predicted: Vec<(f64, f64, f64, f64)>,
}

fn rank_memory_series(lines: &[Value], rank: u64) -> RankMemorySeries {
    const MIB: f64 = (1u64 << 20) as f64;
    let mut points = Vec::new();
    let mut predicted = Vec::new();
    for l in lines.iter().filter(|l| l["rank"].as_u64() == Some(rank)) {
        let step = num(l, "step");
        let base = num(&l["model_state"], "baseline");
        let level = |b: f64| (b - base) / MIB;
        let mut start = None;
        for m in l["measured"].as_array().into_iter().flatten() {
            let phase = m[0].as_str().unwrap_or("");
            let Some(&(name, _)) = PHASES.iter().find(|p| p.0 == phase) else {
                continue;
            };
            let bytes = m[1].as_f64().unwrap_or(0.0);
            if name == "start" {
                start = Some(bytes);
            }
            points.push((step + phase_offset(name), level(bytes), name));
        }
        if let Some(p) = l["peak"].as_f64() {
            points.push((step + phase_offset("peak"), level(p), "peak"));
        }
        let a = &l["analytic"];
        if let Some(start) = start {
            let forward = num(a, "activations") + num(a, "gathered") + num(a, "earlier_grads");
            predicted.push((
                step,
                level(start + forward),
                level(start + num(a, "peak")),
                (num(a, "params") + num(a, "optim")) / MIB,
            ));
        }
    }
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    RankMemorySeries {
        rank,
        points,
        predicted,
    }
}

/// The memory timeline: one panel per rank (at most 8), x the step with integer ticks and
/// each step's phases at fixed offsets inside it, y MiB above the rank's baseline (the heap
/// or pool right before the model was built). The measured level is a line through the
/// phases, each phase its own marker; the predicted levels are dashed lines across each step:
/// the end of the forward, the peak, and the model state kept between steps.
fn memory_chart(lines: &[Value], out: &Path) -> anyhow::Result<PathBuf> {
    let mut ranks: Vec<u64> = lines.iter().filter_map(|l| l["rank"].as_u64()).collect();
    ranks.sort_unstable();
    ranks.dedup();
    ranks.truncate(8);
    let series: Vec<RankMemorySeries> = ranks
        .iter()
        .map(|&r| rank_memory_series(lines, r))
        .collect();
    let steps = lines
        .iter()
        .filter_map(|l| l["step"].as_u64())
        .max()
        .map_or(1, |s| s + 1);
    let height = 80 + 260 * series.len().max(1) as u32;
    let root = SVGBackend::new(out, (W, height)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let root = root
        .titled(
            "memory per rank: measured phases (markers) and predicted levels (dashed)",
            ("sans-serif", 18),
        )
        .map_err(plot_err)?;
    let panels = root.split_evenly((series.len().max(1), 1));
    // The legend sits in the first panel, right of the last step.
    let (x0, x1) = (0.0, steps as f64 * 1.35);
    for (k, (panel, s)) in panels.iter().zip(&series).enumerate() {
        let top = s
            .points
            .iter()
            .map(|p| p.1)
            .chain(s.predicted.iter().flat_map(|p| [p.1, p.2, p.3]))
            .fold(0.0f64, f64::max);
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("rank {}", s.rank), ("sans-serif", 15))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(x0..x1, value_axis(0.0, top.max(1e-3)))
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("MiB above baseline")
            .x_labels(((steps as usize).min(20) + 1) * 4 / 3)
            .x_label_formatter(
                &|x| match (x - x.round()).abs() < 1e-9 && *x <= steps as f64 {
                    true => format!("{}", x.round() as i64),
                    false => String::new(),
                },
            )
            .draw()
            .map_err(plot_err)?;
        let measured = palette(0);
        chart
            .draw_series(LineSeries::new(
                s.points.iter().map(|p| (p.0, p.1)),
                measured,
            ))
            .map_err(plot_err)?
            .label("measured")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], measured));
        for (i, (phase, name)) in PHASES.iter().enumerate() {
            let color = palette(i + 1);
            let pts = s
                .points
                .iter()
                .filter(|p| p.2 == *phase)
                .map(|p| (p.0, p.1));
            let style = color.filled();
            let drawn = match i % 3 {
                0 => chart.draw_series(pts.map(|p| Circle::new(p, 4, style))),
                1 => chart.draw_series(pts.map(|p| TriangleMarker::new(p, 5, style))),
                _ => chart.draw_series(pts.map(|p| Cross::new(p, 4, color.stroke_width(2)))),
            };
            let drawn = drawn.map_err(plot_err)?.label(*name);
            match i % 3 {
                0 => drawn.legend(move |(x, y)| Circle::new((x + 7, y), 4, color.filled())),
                1 => drawn.legend(move |(x, y)| TriangleMarker::new((x + 7, y), 5, color.filled())),
                _ => drawn.legend(move |(x, y)| Cross::new((x + 7, y), 4, color.stroke_width(2))),
            };
        }
        let lines_of = |pick: fn(&(f64, f64, f64, f64)) -> f64| {
            s.predicted
                .iter()
                .map(move |p| vec![(p.0, pick(p)), (p.0 + 0.95, pick(p))])
                .collect::<Vec<_>>()
        };
        for (name, color, pick) in [
            (
                "predicted end of forward",
                palette(2),
                (|p| p.1) as fn(&(f64, f64, f64, f64)) -> f64,
            ),
            ("predicted peak", palette(3), |p| p.2),
            ("predicted model state", palette(7), |p| p.3),
        ] {
            let mut first = true;
            for seg in lines_of(pick) {
                let drawn = chart
                    .draw_series(DashedLineSeries::new(seg, 6, 4, color.stroke_width(2)))
                    .map_err(plot_err)?;
                if std::mem::take(&mut first) {
                    drawn.label(name).legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 15, y)], color.stroke_width(2))
                    });
                }
            }
        }
        if k > 0 {
            continue;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .label_font(("sans-serif", 11))
            .draw()
            .map_err(plot_err)?;
    }
    root.present().map_err(plot_err)?;
    Ok(out.to_path_buf())
}

/// One rank's timeline of one step, read from `pipeline-rank{N}.jsonl`.
struct RankTimeline {
    rank: u64,
    /// Wall-clock start of the step (ms since the epoch).
    start_unix_ms: f64,
    /// (kind, label, start ms, end ms) from the rank's step start.
    spans: Vec<(String, String, f64, f64)>,
}

/// Each rank's timeline of the last step that every rank recorded.
fn read_timelines(run_dir: &Path) -> anyhow::Result<Option<(u64, Vec<RankTimeline>)>> {
    let mut per_rank: Vec<Vec<Value>> = Vec::new();
    let entries =
        std::fs::read_dir(run_dir).with_context(|| format!("listing {}", run_dir.display()))?;
    for e in entries {
        let path = e?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with("pipeline-rank") && name.ends_with(".jsonl") {
            per_rank.push(read_lines(&path)?);
        }
    }
    // The representative step: the last one present in every rank's file.
    let steps =
        |lines: &[Value]| -> Vec<u64> { lines.iter().filter_map(|l| l["step"].as_u64()).collect() };
    let Some(step) = per_rank
        .first()
        .map(|l| steps(l))
        .unwrap_or_default()
        .into_iter()
        .filter(|s| per_rank.iter().all(|l| steps(l).contains(s)))
        .max()
    else {
        return Ok(None);
    };
    let mut rows = Vec::new();
    for lines in &per_rank {
        let Some(l) = lines.iter().find(|l| l["step"].as_u64() == Some(step)) else {
            continue;
        };
        let spans: Vec<&Value> = l["spans"].as_array().into_iter().flatten().collect();
        let interleaved = spans.iter().any(|s| num(s, "chunk") > 0.0);
        let spans = spans
            .into_iter()
            .map(|s| {
                let kind = s["kind"].as_str().unwrap_or("").to_string();
                let mb = s["mb"].as_u64();
                let label = match (kind.as_str(), mb) {
                    ("forward", Some(mb)) | ("backward", Some(mb)) => {
                        let letter = if kind == "forward" { 'F' } else { 'B' };
                        if interleaved {
                            format!("{letter}{mb}.{}", num(s, "chunk"))
                        } else {
                            format!("{letter}{mb}")
                        }
                    }
                    _ => String::new(),
                };
                (kind, label, num(s, "start_ms"), num(s, "end_ms"))
            })
            .collect();
        rows.push(RankTimeline {
            rank: l["rank"].as_u64().unwrap_or(0),
            start_unix_ms: num(l, "start_unix_ms"),
            spans,
        });
    }
    rows.sort_by_key(|r| r.rank);
    Ok(Some((step, rows)))
}

/// The color of a span kind, and its legend text.
fn span_style(kind: &str) -> (RGBAColor, &'static str) {
    match kind {
        "forward" => (palette(0).to_rgba(), "forward F<micro-batch>"),
        "backward" => (palette(2).to_rgba(), "backward B<micro-batch>"),
        "send" => (palette(1).to_rgba(), "send issued (asynchronous)"),
        "recv_wait" => (palette(3).mix(0.45), "waiting for a receive"),
        "send_wait" => (palette(4).mix(0.45), "waiting for sends to finish"),
        _ => (palette(7).mix(0.15), "idle (no action running)"),
    }
}

/// The Gantt chart of one pipeline step: a row per rank, a box per forward (F<mb>), backward
/// (B<mb>), send, receive wait, and the idle gaps between them. Rows are aligned on the ranks'
/// wall clocks (exact on one machine; across machines, up to their clock offset).
fn pipeline_chart(step: u64, rows: &[RankTimeline], out: &Path) -> anyhow::Result<PathBuf> {
    let t0 = rows
        .iter()
        .map(|r| r.start_unix_ms)
        .fold(f64::INFINITY, f64::min);
    let offset = |r: &RankTimeline| {
        if t0.is_finite() {
            r.start_unix_ms - t0
        } else {
            0.0
        }
    };
    let x1 = rows
        .iter()
        .flat_map(|r| r.spans.iter().map(move |s| offset(r) + s.3))
        .fold(1e-3f64, f64::max);
    let n = rows.len();
    // Rank rows top to bottom: row i spans y in [n − 1 − i, n − i).
    let y_of = |i: usize| (n - 1 - i) as f64;
    let mut boxes: Vec<(String, f64, f64, f64, f64)> = Vec::new(); // (kind, x0, x1, y0, y1)
    let mut labels: Vec<(String, f64, f64)> = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let (y, off) = (y_of(i), offset(r));
        let mut t = 0.0; // covered up to, on the shared axis
        for (kind, label, a, b) in &r.spans {
            let (a, b) = (off + a, off + b);
            if a - t > x1 * 0.002 {
                boxes.push(("idle".into(), t, a, y + 0.3, y + 0.7));
            }
            t = t.max(b);
            if kind == "send" {
                // Issuing a send takes microseconds: a thin mark, wide enough to see.
                let w = (b - a).max(x1 * 0.003);
                boxes.push((kind.clone(), a, a + w, y + 0.1, y + 0.25));
            } else {
                boxes.push((kind.clone(), a, b, y + 0.15, y + 0.85));
            }
            if !label.is_empty() {
                labels.push((label.clone(), (a + b) / 2.0, y + 0.5));
            }
        }
        if x1 - t > x1 * 0.002 {
            boxes.push(("idle".into(), t, x1, y + 0.3, y + 0.7));
        }
    }

    // Rows take y in [0, n); the band above them holds the legend.
    const LEGEND_ROWS: f64 = 1.9;
    let root = SVGBackend::new(out, (W, 270 + 70 * n as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("pipeline timeline, step {step}: one row per rank"),
            ("sans-serif", 18),
        )
        .margin(15)
        .x_label_area_size(35)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..x1 * 1.02, 0.0..n as f64 + LEGEND_ROWS)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("ms from the first rank's step start")
        .y_labels(0)
        .disable_y_mesh()
        .draw()
        .map_err(plot_err)?;
    // Row names in the label area, left of each row's middle.
    let name_font = ("sans-serif", 13)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Right, VPos::Center));
    for (i, r) in rows.iter().enumerate() {
        let (px, py) = chart.backend_coord(&(0.0, y_of(i) + 0.5));
        root.draw_text(&format!("rank {}", r.rank), &name_font, (px - 8, py))
            .map_err(plot_err)?;
    }
    chart
        .draw_series(boxes.iter().map(|(kind, a, b, y0, y1)| {
            Rectangle::new([(*a, *y0), (*b, *y1)], span_style(kind).0.filled())
        }))
        .map_err(plot_err)?;
    let font = ("sans-serif", 12)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Center, VPos::Center));
    chart
        .draw_series(
            labels
                .iter()
                .map(|(l, x, y)| Text::new(l.clone(), (*x, *y), font.clone())),
        )
        .map_err(plot_err)?;
    for kind in [
        "forward",
        "backward",
        "send",
        "recv_wait",
        "send_wait",
        "idle",
    ] {
        let (color, text) = span_style(kind);
        chart
            .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())
            .map_err(plot_err)?
            .label(text)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.85))
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)?;
    Ok(out.to_path_buf())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use mtrain_comm::mesh::MeshDims;
    use mtrain_comm::run_local;

    use super::*;
    use crate::config::TrainConfig;
    use crate::train::{run_with, RunOptions};

    /// Counts the `<text>` elements of an SVG whose content is `F<digits>` (`letter` = 'F') or
    /// `B<digits>`: the forward / backward boxes' labels.
    /// Two runs in one metrics.jsonl are refused naming both; one resumed run is drawn with the
    /// resumed steps replacing the ones it re-ran; an unnamed file is one run while steps increase.
    #[test]
    fn two_runs_are_never_drawn_as_one_curve() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let parse = |text: &str| -> Vec<Value> {
            text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
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
        let unnamed = parse("{\"step\":0,\"loss\":5}\n{\"step\":10,\"loss\":4}\n{\"step\":0,\"loss\":5}");
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

    fn labels(svg: &str, letter: char) -> usize {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| Some(t.split_once('>')?.1.split_once("</text>")?.0.trim()))
            .filter(|l| {
                l.strip_prefix(letter)
                    .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
            })
            .count()
    }

    /// A pp = 2 run (ranks as threads over loopback TCP, 1F1B with 4 micro-batches, 3 steps)
    /// writes one timeline per rank per step, and the chart draws the last step: each of the 2
    /// ranks runs 4 forwards and 4 backwards, so 8 F boxes and 8 B boxes.
    #[test]
    fn pp2_run_draws_every_forward_and_backward_of_one_step() {
        let dir = tempfile::tempdir().expect("temp dir");
        let cfg = TrainConfig {
            steps: 3,
            batch_size: 4,
            seq_len: 32,
            eval_every: 0,
            log_every: 1,
            run_dir: dir.path().to_path_buf(),
            ..TrainConfig::default()
        };
        let mut opts = RunOptions::new(MeshDims::new(1, 2, 1, 1));
        opts.plan.microbatches = 4;
        for r in run_local(2, Duration::from_secs(60), |b| run_with(&cfg, &b, &opts)) {
            r.expect("pp = 2 run");
        }
        for rank in 0..2 {
            let lines = read_lines(&dir.path().join(format!("pipeline-rank{rank}.jsonl")))
                .expect("a timeline per rank");
            assert_eq!(lines.len(), 3, "rank {rank}: one line per logged step");
            for l in &lines {
                let spans = l["spans"].as_array().expect("spans");
                let count = |k: &str| spans.iter().filter(|s| s["kind"] == k).count();
                assert_eq!((count("forward"), count("backward")), (4, 4), "rank {rank}");
                // Rank 0 receives 4 gradients, rank 1 4 activations; each sends 4.
                assert_eq!((count("recv_wait"), count("send")), (4, 4), "rank {rank}");
            }
        }
        let written = plot_run(dir.path()).expect("plot");
        let svg_path = dir.path().join("pipeline.svg");
        assert!(written.contains(&svg_path), "{written:?}");
        let svg = std::fs::read_to_string(&svg_path).expect("pipeline.svg");
        assert_eq!((labels(&svg, 'F'), labels(&svg, 'B')), (8, 8));
        assert!(svg.contains("rank 0") && svg.contains("rank 1"));
        assert!(svg.contains("step 2"), "the chart shows the last step");
    }

    /// The memory chart of a 2-rank, 3-step report: a panel per rank, every phase in the
    /// legend, the predicted levels, and step ticks at the integers only.
    #[test]
    fn the_memory_chart_marks_phases_per_rank_with_integer_steps() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("metrics.jsonl"),
            "{\"step\":0,\"loss\":5.5}\n",
        )
        .unwrap();
        let mut lines = String::new();
        for step in 0..3u64 {
            for rank in 0..2u64 {
                let m = |x: u64| (x + 100) << 20;
                lines.push_str(&format!(
                    "{{\"step\":{step},\"rank\":{rank},\"probe\":\"cpu heap\",\
                     \"analytic\":{{\"params\":1048576,\"grads\":1048576,\"optim\":2097152,\
                     \"activations\":{},\"gathered\":0,\"comm\":0,\"peak\":{}}},\
                     \"measured\":[[\"start\",{}],[\"after_forward\",{}],[\"after_backward\",{}],[\"after_optimizer\",{}]],\
                     \"peak\":{},\"increments\":{{\"peak\":0}},\
                     \"model_state\":{{\"baseline\":{},\"measured\":0,\"analytic\":0}}}}\n",
                    30u64 << 20,
                    45u64 << 20,
                    m(3),
                    m(33),
                    m(4),
                    m(3),
                    m(48),
                    m(0)
                ));
            }
        }
        std::fs::write(dir.path().join("memory.jsonl"), lines).unwrap();
        plot_run(dir.path()).expect("plot");
        let svg = std::fs::read_to_string(dir.path().join("memory.svg")).expect("memory.svg");
        let texts: Vec<&str> = svg
            .split("<text")
            .skip(1)
            .filter_map(|t| Some(t.split_once('>')?.1.split_once("</text>")?.0.trim()))
            .collect();
        for want in [
            "rank 0",
            "rank 1",
            "step start",
            "after forward",
            "peak",
            "after backward",
            "after optimizer",
            "predicted end of forward",
            "predicted peak",
            "predicted model state",
        ] {
            assert!(texts.contains(&want), "no `{want}` in {texts:?}");
        }
        for tick in ["0", "1", "2", "3"] {
            assert!(texts.contains(&tick), "no step tick {tick} in {texts:?}");
        }
        assert!(
            // (the MiB axis here is labelled in whole fives)
            !texts
                .iter()
                .any(|t| t.parse::<f64>().is_ok_and(|x| x.fract() != 0.0)),
            "a fractional step tick in {texts:?}"
        );
    }
}
