//! The pipeline chart (`pipeline.svg`, from `pipeline-rank{N}.jsonl`): one step as it ran, a
//! row per rank and a box per forward, backward (or a split backward's B and W), send, receive
//! wait and idle gap.

use std::path::{Path, PathBuf};

use anyhow::Context;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde_json::Value;

use super::{legend, num, palette, plot_err, read_lines, W};

/// One rank's timeline of one step, read from `pipeline-rank{N}.jsonl`.
pub(super) struct RankTimeline {
    rank: u64,
    /// Wall-clock start of the step (ms since the epoch).
    start_unix_ms: f64,
    /// (kind, label, start ms, end ms) from the rank's step start.
    spans: Vec<(String, String, f64, f64)>,
}

/// Each rank's timeline of the last step that every rank recorded.
pub(super) fn read_timelines(run_dir: &Path) -> anyhow::Result<Option<(u64, Vec<RankTimeline>)>> {
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
                    ("forward" | "backward" | "input_grad" | "weight_grad", Some(mb)) => {
                        let letter = match kind.as_str() {
                            "forward" => 'F',
                            "weight_grad" => 'W',
                            _ => 'B',
                        };
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
        "input_grad" => (
            palette(2).to_rgba(),
            "input gradient B<micro-batch> (split)",
        ),
        "weight_grad" => (
            palette(5).to_rgba(),
            "weight gradients W<micro-batch> (split)",
        ),
        "send" => (palette(1).to_rgba(), "send issued (asynchronous)"),
        "recv_wait" => (palette(3).mix(0.45), "waiting for a receive"),
        "send_wait" => (palette(4).mix(0.45), "waiting for sends to finish"),
        _ => (palette(7).mix(0.15), "idle (no action running)"),
    }
}

/// The Gantt chart of one pipeline step: a row per rank, a box per forward (F<mb>), backward
/// (B<mb>), send, receive wait, and the idle gaps between them. Rows are aligned on the ranks'
/// wall clocks (exact on one machine; across machines, up to their clock offset).
pub(super) fn pipeline_chart(
    step: u64,
    rows: &[RankTimeline],
    out: &Path,
) -> anyhow::Result<PathBuf> {
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
    let shown: std::collections::BTreeSet<&str> = rows
        .iter()
        .flat_map(|r| r.spans.iter().map(|s| s.0.as_str()))
        .collect();
    let optional = ["backward", "input_grad", "weight_grad"];
    for kind in [
        "forward",
        "backward",
        "input_grad",
        "weight_grad",
        "send",
        "recv_wait",
        "send_wait",
        "idle",
    ] {
        if optional.contains(&kind) && !shown.contains(kind) {
            continue;
        }
        let (color, text) = span_style(kind);
        chart
            .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())
            .map_err(plot_err)?
            .label(text)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], color.filled()));
    }
    legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    root.present().map_err(plot_err)?;
    Ok(out.to_path_buf())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use mtrain_comm::mesh::MeshDims;
    use mtrain_comm::run_local;
    use mtrain_parallel::parallelize::ParallelPlan;

    use super::super::{plot_run, read_lines};
    use crate::config::TrainConfig;
    use crate::train::{run_with, RunOptions};

    /// Counts the `<text>` elements of an SVG whose content is `F<digits>` (`letter` = 'F') or
    /// `B<digits>`: the forward / backward boxes' labels.
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

    /// A pp = 2 run (ranks as threads over loopback TCP, 4 micro-batches, 3 steps) writes one
    /// timeline per rank per step, and the chart draws the last step: under 1F1B each of the 2
    /// ranks runs 4 forwards and 4 backwards, so 8 F boxes and 8 B boxes; under ZB-H1 4
    /// forwards, 4 B's and 4 W's each, so 8 of each letter.
    #[test]
    fn pp2_run_draws_every_forward_and_backward_of_one_step() {
        use mtrain_parallel::pipeline::ScheduleKind;
        for kind in [ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1] {
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
            let plan = ParallelPlan {
                microbatches: 4,
                schedule: kind,
                ..ParallelPlan::new(MeshDims::new(1, 2, 1, 1))
            };
            let opts = RunOptions::of_plan(&cfg, plan).expect("a pp = 2 plan");
            for r in run_local(2, Duration::from_secs(60), |b| run_with(&b, &opts)) {
                r.expect("pp = 2 run");
            }
            let split = kind.splits_backward();
            for rank in 0..2 {
                let lines = read_lines(&dir.path().join(format!("pipeline-rank{rank}.jsonl")))
                    .expect("a timeline per rank");
                assert_eq!(lines.len(), 3, "rank {rank}: one line per logged step");
                for l in &lines {
                    let spans = l["spans"].as_array().expect("spans");
                    let count = |k: &str| spans.iter().filter(|s| s["kind"] == k).count();
                    let want = match split {
                        true => (4, 0, 4, 4),
                        false => (4, 4, 0, 0),
                    };
                    let got = (
                        count("forward"),
                        count("backward"),
                        count("input_grad"),
                        count("weight_grad"),
                    );
                    assert_eq!(got, want, "{kind} rank {rank}");
                    // Rank 0 receives 4 gradients, rank 1 4 activations; each sends 4.
                    assert_eq!((count("recv_wait"), count("send")), (4, 4), "rank {rank}");
                }
            }
            let written = plot_run(dir.path()).expect("plot");
            let svg_path = dir.path().join("pipeline.svg");
            assert!(written.contains(&svg_path), "{written:?}");
            let svg = std::fs::read_to_string(&svg_path).expect("pipeline.svg");
            let w = if split { 8 } else { 0 };
            assert_eq!(
                (labels(&svg, 'F'), labels(&svg, 'B'), labels(&svg, 'W')),
                (8, 8, w),
                "{kind}"
            );
            assert!(svg.contains("rank 0") && svg.contains("rank 1"));
            assert!(svg.contains("step 2"), "the chart shows the last step");
        }
    }
}
