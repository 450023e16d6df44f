//! `roofline.svg`: the ops of `ops.json` on the roofline of the machine they ran on.
//!
//! ```text
//!   FLOP/s (log)                ______________ measured compute roof (a GEMM)
//!        │    ● gemm         __/               - - datasheet roofs (GPU runs)
//!        │               __/  ● attention
//!        │  ·ln      __/                       ● an op: (its intensity, its FLOP/s),
//!        │       __/ memory roof (a copy)        area ∝ its share of the step
//!        └──────────────────────────── intensity, FLOP/B (log)
//! ```
//!
//! Collectives have no FLOPs and are left off (they are in the table). A decode report
//! (`decode-ops.json`, one token at batch 1 with the KV cache) is drawn on the same axes, its
//! ops as triangles, sized by their share of the token.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use super::{palette, plot_err, W};
use crate::roofline::OpsReport;

/// Draws the ops of `reports` (a training step's and a decode token's, or either) on the roofs
/// of the first into `out`.
pub fn roofline_chart(reports: &[&OpsReport], out: &Path) -> anyhow::Result<PathBuf> {
    let Some(report) = reports.first() else {
        anyhow::bail!("no ops to draw into {}", out.display());
    };
    let points: Vec<_> = reports
        .iter()
        .flat_map(|r| r.rows.iter().map(move |row| (r.decode.is_some(), row)))
        .filter(|(_, r)| r.flops > 0.0 && r.bytes > 0.0 && r.seconds > 0.0)
        .collect();
    let m = &report.roofs.measured;
    let gpu = report.device != "cpu";
    let presets: Vec<_> = report.roofs.presets.iter().filter(|_| gpu).collect();
    let peak = presets
        .iter()
        .map(|p| p.bf16_tflops * 1e12)
        .fold(m.flops_per_s, f64::max);
    let ridges = presets.iter().map(|p| p.ridge).fold(m.ridge(), f64::max);
    let xs = points.iter().map(|p| p.1.intensity);
    let x_lo = xs.clone().fold(m.ridge(), f64::min) / 4.0;
    let x_hi = xs.fold(ridges, f64::max) * 4.0;
    let y_lo = points
        .iter()
        .map(|p| p.1.flops_per_s)
        .fold(m.bytes_per_s * x_lo, f64::min)
        / 4.0;
    let root = SVGBackend::new(out, (W, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let title = match reports.iter().find(|r| r.decode.is_none()) {
        Some(t) => format!(
            "{} ops per step on {} {} rank(s){}; ridge {:.1} FLOP/B",
            t.rows.len(),
            t.ranks,
            t.device,
            if reports.len() > 1 { ", decode (triangles)" } else { "" },
            m.ridge()
        ),
        None => format!(
            "{} ops per decoded token on {}; ridge {:.1} FLOP/B",
            report.rows.len(),
            report.device,
            m.ridge()
        ),
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d((x_lo..x_hi).log_scale(), (y_lo..peak * 2.0).log_scale())
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("arithmetic intensity (FLOP/byte)")
        .y_desc("achieved FLOP/s")
        .y_label_formatter(&|y| format!("{y:.0e}"))
        .x_label_formatter(&|x| format!("{x}"))
        .draw()
        .map_err(plot_err)?;
    // A roof: bandwidth × intensity up to the ridge, the peak after it.
    let roof = |flops: f64, bw: f64| {
        let ridge = flops / bw;
        vec![(x_lo, bw * x_lo), (ridge, flops), (x_hi, flops)]
    };
    chart
        .draw_series(LineSeries::new(
            roof(m.flops_per_s, m.bytes_per_s),
            BLACK.stroke_width(2),
        ))
        .map_err(plot_err)?
        .label(format!("measured: {} / {}", m.gemm, m.copy))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], BLACK.stroke_width(2)));
    for (i, p) in presets.iter().enumerate() {
        let colour = palette(i + 3);
        let line = roof(p.bf16_tflops * 1e12, p.hbm_tb_s * 1e12);
        chart
            .draw_series(DashedLineSeries::new(line, 6, 4, colour.stroke_width(1)))
            .map_err(plot_err)?
            .label(format!("{} datasheet, bf16", p.name))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], colour));
    }
    for (i, &(decode, r)) in points.iter().enumerate() {
        let colour = palette(i);
        let radius = (3.0 + 30.0 * r.share.max(0.0).sqrt()) as i32;
        let at = (r.intensity, r.flops_per_s);
        let style = colour.mix(0.5).filled();
        let series = match decode {
            false => chart.draw_series([Circle::new(at, radius, style)]),
            true => chart.draw_series([TriangleMarker::new(at, radius, style)]),
        };
        let what = if decode { "decode: " } else { "" };
        series
            .map_err(plot_err)?
            .label(format!("{what}{} ({:.0}%)", r.name, r.share * 100.0))
            .legend(move |(x, y)| Circle::new((x + 7, y), 4, colour.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .label_font(("sans-serif", 11))
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)?;
    Ok(out.to_path_buf())
}
