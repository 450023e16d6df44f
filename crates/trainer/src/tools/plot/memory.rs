//! The memory chart (`memory.svg`, from `memory.jsonl`): a panel per rank, the measured level
//! through each step's phases and the levels the analytic model predicts.

use std::path::{Path, PathBuf};

use plotters::prelude::*;
use serde_json::Value;

use super::{legend, num, palette, plot_err, value_axis, W};

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
pub(super) fn memory_chart(lines: &[Value], out: &Path) -> anyhow::Result<PathBuf> {
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
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    }
    root.present().map_err(plot_err)?;
    Ok(out.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::super::plot_run;

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
