//! `mtrain plot RUN_DIR`: SVG charts of a run, drawn with plotters from its JSON lines.
//!
//! ```text
//!   metrics.jsonl  -> loss.svg       training loss (and validation points) per step
//!   memory.jsonl   -> memory.svg     measured bytes per rank through each step's phases
//!                                    (start, after backward, after optimizer), over the
//!                                    analytic model state stacked by category
//!                                    (parameters | gradients | optimizer state)
//!   steps.jsonl    -> pipeline.svg   per pipeline rank and step: compute vs idle (bubble) time,
//!                                    one bar per step, ranks stacked   (runs with pp > 1)
//! ```
//!
//! Only SVG is written: it needs no font files on the machine (the text is left to the viewer).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use plotters::prelude::*;
use serde_json::Value;

/// Options of `mtrain plot`.
#[derive(Debug, Clone, Args)]
pub struct PlotArgs {
    /// A run directory (with metrics.jsonl; memory.jsonl with --mem-report; steps.jsonl on >1 rank).
    pub run_dir: PathBuf,
}

const W: u32 = 900;
const H: u32 = 500;

fn read_lines(path: &Path) -> anyhow::Result<Vec<Value>> {
    let s = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    s.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).with_context(|| format!("a line of {}", path.display())))
        .collect()
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
    written.push(loss_chart(
        &read_lines(&metrics)?,
        &run_dir.join("loss.svg"),
    )?);
    let memory = run_dir.join("memory.jsonl");
    if memory.exists() {
        written.push(memory_chart(
            &read_lines(&memory)?,
            &run_dir.join("memory.svg"),
        )?);
    }
    let steps = run_dir.join("steps.jsonl");
    if steps.exists() {
        let lines = read_lines(&steps)?;
        if lines.iter().any(|l| l["report"].get("pipeline").is_some()) {
            written.push(pipeline_chart(&lines, &run_dir.join("pipeline.svg"))?);
        }
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
        .build_cartesian_2d(0.0..x1, (y0 - 0.05 * (y1 - y0))..(y1 + 0.05 * (y1 - y0)))
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

/// Position of a phase inside its step on the x axis.
fn phase_offset(phase: &str) -> f64 {
    match phase {
        "start" => 0.0,
        "after_forward" => 0.25,
        "after_backward" => 0.5,
        _ => 0.75,
    }
}

fn memory_chart(lines: &[Value], out: &Path) -> anyhow::Result<PathBuf> {
    const MIB: f64 = (1u64 << 20) as f64;
    let mut ranks: Vec<u64> = lines.iter().filter_map(|l| l["rank"].as_u64()).collect();
    ranks.sort_unstable();
    ranks.dedup();
    let mut series: Vec<(u64, Vec<(f64, f64)>)> = Vec::new();
    let mut top = 0.0f64;
    let mut x1 = 1.0f64;
    for &r in &ranks {
        let mut pts = Vec::new();
        for l in lines.iter().filter(|l| l["rank"].as_u64() == Some(r)) {
            let step = num(l, "step");
            for m in l["measured"].as_array().into_iter().flatten() {
                let phase = m[0].as_str().unwrap_or("");
                let bytes = m[1].as_f64().unwrap_or(0.0) / MIB;
                pts.push((step + phase_offset(phase), bytes));
                top = top.max(bytes);
            }
            x1 = x1.max(step + 1.0);
        }
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        series.push((r, pts));
    }
    // The analytic model state of the lowest rank, stacked by category.
    let first = lines
        .iter()
        .find(|l| l["rank"].as_u64() == ranks.first().copied());
    let a = first.map(|l| l["analytic"].clone()).unwrap_or(Value::Null);
    let cats = [
        ("parameters", num(&a, "params") / MIB),
        ("gradients", num(&a, "grads") / MIB),
        ("optimizer state", num(&a, "optim") / MIB),
    ];
    let state: f64 = cats.iter().map(|c| c.1).sum();
    top = top.max(state) * 1.1;

    let root = SVGBackend::new(out, (W, H)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "memory per rank (measured) over the analytic model state",
            ("sans-serif", 18),
        )
        .margin(15)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0..x1, 0.0..top.max(1e-3))
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("step (start | after backward | after optimizer)")
        .y_desc("MiB")
        .draw()
        .map_err(plot_err)?;
    let mut base = 0.0;
    for (i, (name, mib)) in cats.iter().enumerate() {
        let (lo, hi) = (base, base + mib);
        let color = palette(5 + i).mix(0.25);
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(0.0, lo), (x1, hi)],
                color.filled(),
            )))
            .map_err(plot_err)?
            .label(format!(
                "{name} (analytic, rank {})",
                ranks.first().copied().unwrap_or(0)
            ))
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], color.filled()));
        base = hi;
    }
    for (i, (r, pts)) in series.into_iter().enumerate() {
        let color = palette(i);
        chart
            .draw_series(LineSeries::new(pts, &color))
            .map_err(plot_err)?
            .label(format!("rank {r} measured"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], color));
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)?;
    Ok(out.to_path_buf())
}

fn pipeline_chart(lines: &[Value], out: &Path) -> anyhow::Result<PathBuf> {
    // (rank, step, compute ms, idle ms)
    let rows: Vec<(u64, u64, f64, f64)> = lines
        .iter()
        .filter_map(|l| {
            let p = l["report"].get("pipeline")?;
            let (step_ms, idle_ms) = (num(p, "step_ms"), num(p, "idle_ms"));
            Some((
                l["rank"].as_u64()?,
                l["step"].as_u64()?,
                step_ms - idle_ms,
                idle_ms,
            ))
        })
        .collect();
    let mut ranks: Vec<u64> = rows.iter().map(|r| r.0).collect();
    ranks.sort_unstable();
    ranks.dedup();
    let n_steps = rows.iter().map(|r| r.1).max().map_or(1, |s| s + 1);
    // Steps laid end to end per rank: x is cumulative wall time of the schedule.
    let mut bars = Vec::new();
    let mut x1 = 1.0f64;
    for (row, &r) in ranks.iter().enumerate() {
        let mut t = 0.0;
        for s in 0..n_steps {
            if let Some(&(_, _, busy, idle)) = rows.iter().find(|x| x.0 == r && x.1 == s) {
                bars.push((row, t, t + busy, true));
                bars.push((row, t + busy, t + busy + idle, false));
                t += busy + idle;
            }
        }
        x1 = x1.max(t);
    }
    let root = SVGBackend::new(out, (W, 120 + 60 * ranks.len() as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "pipeline: compute vs idle per rank, step after step",
            ("sans-serif", 18),
        )
        .margin(15)
        .x_label_area_size(35)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..x1, 0.0..ranks.len() as f64)
        .map_err(plot_err)?;
    let labels = ranks.clone();
    chart
        .configure_mesh()
        .x_desc("ms")
        .y_labels(ranks.len().max(1))
        .y_label_formatter(&|y| {
            let i = y.floor() as usize;
            labels.get(i).map_or(String::new(), |r| format!("rank {r}"))
        })
        .draw()
        .map_err(plot_err)?;
    let (busy_c, idle_c) = (palette(0), palette(3).mix(0.35));
    chart
        .draw_series(bars.iter().map(|&(row, a, b, busy)| {
            let y = row as f64;
            let style = if busy {
                busy_c.filled()
            } else {
                idle_c.filled()
            };
            Rectangle::new([(a, y + 0.15), (b, y + 0.85)], style)
        }))
        .map_err(plot_err)?;
    chart
        .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())
        .map_err(plot_err)?
        .label("compute (forward, backward, sends)")
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], busy_c.filled()));
    chart
        .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())
        .map_err(plot_err)?
        .label("idle (waiting on a neighbour: the bubble)")
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], idle_c.filled()));
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)?;
    Ok(out.to_path_buf())
}
