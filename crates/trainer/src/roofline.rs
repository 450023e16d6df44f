//! `--profile-ops`: every op of a few steps on the roofline. The steps after the first (at
//! most three; the first warms up) run with the kernels' op profiler on
//! ([`mtrain_kernels::profile`]: each op timed, the device synchronised around it, its FLOPs and
//! bytes counted by closed form) and with each process group's per-op totals read around them
//! (calls, bytes sent, and the rank's time inside the collective's calls, issuing it and
//! waiting for it: [`TraceTotals::held_us`]). As soon as the last profiled step ends (before its
//! evaluation or checkpoint) each rank writes its rows; rank 0 adds them up over the ranks,
//! measures the machine's roofs ([`roofs`]) and writes `ops.json` and `roofline.svg`, and
//! prints the table, largest time first:
//!
//! ```text
//!   RUN_DIR/ops-rank{r}.json   this rank's rows, summed over the profiled steps
//!   RUN_DIR/ops.json           per step, summed over the ranks:
//!     {"model_flops": 6·N_matmul·tokens + 12·L·C·T·tokens,  (the MFU count, flops_per_token)
//!      "step_seconds": …, "op_seconds": …, "roofs": {"measured": …, "presets": […]},
//!      "rows": [{"name": "gemm 1024x64x192", "layers": "attn.qkv fwd", "calls": 4,
//!                "flops": …, "bytes": …, "intensity": flops / bytes, "seconds": …,
//!                "flops_per_s": …, "bytes_per_s": …, "bound": "compute", "share": …}, …]}
//! ```
//!
//! A row is *compute*-bound when its intensity (FLOPs per byte) is at or above the measured
//! ridge point (peak FLOP/s ÷ copy bandwidth), *memory*-bound below it; a collective's row is
//! *network* (no FLOPs counted). Times are per step and summed over ranks, so `flops_per_s` is
//! the rate of one device and `share` is the row's part of every rank's step time together.
//! A GEMM's row is named by its shape (M×K×N); `layers` lists the layer passes of that shape
//! (`fwd` x·Wᵀ, `dgrad` dy·W, `wgrad` dyᵀ·x), several where shapes coincide.

pub mod decode;
pub mod roofs;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::Context;
use candle_core::Device;
use mtrain_comm::mesh::MeshDims;
use mtrain_comm::{Comm, DeviceMesh, OpKind, TraceTotals};
use mtrain_kernels::profile::{self, OpTotals};
use mtrain_model::GptConfig;
use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use roofs::Roofs;

/// How many steps after the first are profiled, at most.
pub const PROFILED_STEPS: u64 = 3;

/// One row as a rank records it: totals over the profiled steps.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RankRow {
    pub name: String,
    pub calls: u64,
    pub flops: f64,
    pub bytes: f64,
    pub seconds: f64,
    /// Whether the row is a collective (its time is the rank's time inside its calls).
    pub collective: bool,
}

impl RankRow {
    /// The row of an op's totals over the profiled steps.
    pub fn op(name: String, t: &OpTotals) -> RankRow {
        RankRow {
            name,
            calls: t.calls,
            flops: t.flops,
            bytes: t.bytes,
            seconds: t.seconds,
            collective: false,
        }
    }
}

/// What one rank measured: `ops-rank{r}.json`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RankOps {
    pub rank: usize,
    /// The profiled steps and each one's wall time (s).
    pub steps: Vec<u64>,
    pub step_seconds: Vec<f64>,
    pub rows: Vec<RankRow>,
}

/// The op profiler of one rank's training loop.
pub struct OpsProfiler {
    groups: Vec<Comm>,
    steps: std::ops::Range<u64>,
    ops: BTreeMap<String, OpTotals>,
    comm: BTreeMap<String, TraceTotals>,
    before: Vec<HashMap<OpKind, TraceTotals>>,
    taken: RankOps,
    report: ReportInputs,
}

/// What the report needs once the profiled steps are done.
struct ReportInputs {
    cfg: TrainConfig,
    gcfg: GptConfig,
    dims: MeshDims,
    world: Comm,
    device: Device,
}

impl OpsProfiler {
    /// The profiler of a run of `gcfg` from `start_step` to `cfg.steps` on this rank of `mesh`
    /// (`groups`: its process groups), or None without `profile_ops`.
    pub fn new(
        (cfg, gcfg): (&TrainConfig, &GptConfig),
        start_step: u64,
        mesh: &DeviceMesh,
        groups: &[Comm],
        device: &Device,
    ) -> Option<Self> {
        if !cfg.profile_ops {
            return None;
        }
        // The first step warms up (allocations, first-use compilation) unless it is the only one.
        let first = (start_step + 1)
            .min(cfg.steps.saturating_sub(1))
            .max(start_step);
        let steps = first..(first + PROFILED_STEPS).min(cfg.steps);
        Some(Self {
            groups: groups.to_vec(),
            steps,
            ops: BTreeMap::new(),
            comm: BTreeMap::new(),
            before: Vec::new(),
            taken: RankOps {
                rank: mesh.rank(),
                ..RankOps::default()
            },
            report: ReportInputs {
                cfg: cfg.clone(),
                gcfg: gcfg.clone(),
                dims: mesh.dims,
                world: mesh.world.clone(),
                device: device.clone(),
            },
        })
    }

    /// Before step `step`: profiling starts if it is one of the profiled steps.
    pub fn begin(&mut self, step: u64) {
        if self.steps.contains(&step) {
            self.before = self
                .groups
                .iter()
                .map(|g| g.tracer().totals_by_op())
                .collect();
            profile::start();
        }
    }

    /// After step `step`, which took `seconds`: its ops and collectives are added up. After the
    /// last profiled step, before anything else the loop does (evaluation, checkpoint), every
    /// rank writes its rows and rank 0 the report ([`OpsProfiler::report`]); true where
    /// ops.json was written (then the caller draws roofline.svg).
    pub fn end(&mut self, step: u64, seconds: f64) -> anyhow::Result<bool> {
        if !self.steps.contains(&step) {
            return Ok(false);
        }
        for (name, t) in profile::stop() {
            let row = self.ops.entry(name).or_default();
            row.calls += t.calls;
            row.flops += t.flops;
            row.bytes += t.bytes;
            row.seconds += t.seconds;
        }
        for (g, before) in self.groups.iter().zip(&self.before) {
            for (op, after) in g.tracer().totals_by_op() {
                let d = after - before.get(&op).copied().unwrap_or_default();
                if d.ops > 0 {
                    let key = format!("{op} ({})", g.name());
                    let row = self.comm.entry(key).or_default();
                    *row = *row + d;
                }
            }
        }
        self.taken.steps.push(step);
        self.taken.step_seconds.push(seconds);
        if step + 1 == self.steps.end {
            self.write()?;
            return self.report();
        }
        Ok(false)
    }

    /// This rank's rows, written to `run_dir/ops-rank{r}.json`.
    fn write(&mut self) -> anyhow::Result<PathBuf> {
        let mut taken = std::mem::take(&mut self.taken);
        for (name, t) in std::mem::take(&mut self.ops) {
            taken.rows.push(RankRow::op(name, &t));
        }
        for (name, t) in std::mem::take(&mut self.comm) {
            taken.rows.push(RankRow {
                name,
                calls: t.ops,
                flops: 0.0,
                bytes: t.bytes_sent as f64,
                seconds: t.held_us as f64 * 1e-6,
                collective: true,
            });
        }
        let path = self.report.cfg.run_dir.join(format!("ops-rank{}.json", taken.rank));
        crate::fsio::write_synced(&path, serde_json::to_string_pretty(&taken)?.as_bytes())?;
        Ok(path)
    }

    /// Once every rank wrote its rows: rank 0 measures the roofs, adds the rows up into
    /// ops.json ([`merge`]) and prints the table; true on rank 0.
    fn report(&self) -> anyhow::Result<bool> {
        let ReportInputs {
            cfg,
            gcfg,
            dims,
            world,
            device,
        } = &self.report;
        world.barrier().context("waiting for every rank's ops")?;
        if world.rank() != 0 {
            return Ok(false);
        }
        let roofs = Roofs {
            measured: roofs::measure(device, cfg.dtype.candle())?,
            presets: roofs::presets(),
        };
        let flops = model_flops(cfg, gcfg, dims.dp);
        let world_size = dims.world_size();
        let (report, _) = merge(&cfg.run_dir, world_size, (cfg, gcfg, dims.tp), flops, roofs)?;
        eprintln!("{}", table(&report));
        Ok(true)
    }
}

/// One row of `ops.json`: per step, summed over the ranks.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OpRow {
    pub name: String,
    /// The layer passes of a GEMM's shape (empty for other ops).
    pub layers: String,
    pub calls: f64,
    pub flops: f64,
    pub bytes: f64,
    pub intensity: f64,
    pub seconds: f64,
    pub flops_per_s: f64,
    pub bytes_per_s: f64,
    /// "compute" or "memory" against the measured ridge point; "network" for a collective.
    pub bound: String,
    /// The row's part of the step time of all the ranks.
    pub share: f64,
}

/// `ops.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OpsReport {
    pub ranks: usize,
    pub steps: Vec<u64>,
    pub device: String,
    pub dtype: String,
    /// A decode run's report (`decode-ops.json`): then a "step" is one decoded token, and
    /// `steps` the cached positions each profiled token ran against.
    #[serde(default)]
    pub decode: Option<decode::DecodeRun>,
    /// The step's model FLOPs: [`GptConfig::flops_per_token`] × the step's tokens (every rank).
    pub model_flops: f64,
    /// The mean wall time of a profiled step, and the ops' time per step (both per rank).
    pub step_seconds: f64,
    pub op_seconds: f64,
    /// The same two for each rank, in rank order.
    #[serde(default)]
    pub rank_seconds: Vec<RankSeconds>,
    pub roofs: Roofs,
    /// Largest time first.
    pub rows: Vec<OpRow>,
}

/// One rank's mean wall time of a profiled step, and its ops' time per step.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankSeconds {
    pub rank: usize,
    pub step_seconds: f64,
    pub op_seconds: f64,
}

/// The step's model FLOPs: the count MFU uses, for every token of the global batch.
pub fn model_flops(cfg: &TrainConfig, gcfg: &GptConfig, dp: usize) -> f64 {
    let tokens = cfg.batch_size * cfg.seq_len * cfg.grad_accum * dp;
    gcfg.flops_per_token(cfg.seq_len) * tokens as f64
}

/// Every rank's `ops-rank{r}.json` of `run_dir` added up with the roofs into `ops.json` (and the
/// parts removed); returns the report and its path.
pub fn merge(
    run_dir: &Path,
    world: usize,
    (cfg, gcfg, tp): (&TrainConfig, &GptConfig, usize),
    model_flops: f64,
    roofs: Roofs,
) -> anyhow::Result<(OpsReport, PathBuf)> {
    let mut parts = Vec::new();
    for r in 0..world {
        let path = run_dir.join(format!("ops-rank{r}.json"));
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let part: RankOps =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        parts.push(part);
    }
    let on = (
        format!("{:?}", cfg.device).to_lowercase(),
        format!("{:?}", cfg.dtype).to_lowercase(),
    );
    let report = summarize(&parts, on, (gcfg, tp), model_flops, roofs);
    let path = run_dir.join("ops.json");
    crate::fsio::write_synced(&path, serde_json::to_string_pretty(&report)?.as_bytes())?;
    Ok((report, path))
}

/// The ranks' `parts` added up, per step, into a report of a run on `(device, dtype)` of
/// `gcfg` at tensor-parallel degree `tp` (which names the GEMMs' layers).
pub fn summarize(
    parts: &[RankOps],
    (device, dtype): (String, String),
    (gcfg, tp): (&GptConfig, usize),
    model_flops: f64,
    roofs: Roofs,
) -> OpsReport {
    let world = parts.len().max(1);
    let steps = parts.first().map(|p| p.steps.clone()).unwrap_or_default();
    let n = steps.len().max(1) as f64;
    let rank_seconds = parts
        .iter()
        .map(|p| RankSeconds {
            rank: p.rank,
            step_seconds: p.step_seconds.iter().sum::<f64>() / n,
            op_seconds: p.rows.iter().map(|r| r.seconds).sum::<f64>() / n,
        })
        .collect();
    let step_total: f64 = parts.iter().flat_map(|p| &p.step_seconds).sum::<f64>() / n;
    let mut sums: BTreeMap<String, RankRow> = BTreeMap::new();
    for row in parts.iter().flat_map(|p| &p.rows) {
        let s = sums.entry(row.name.clone()).or_insert_with(|| RankRow {
            name: row.name.clone(),
            collective: row.collective,
            ..RankRow::default()
        });
        s.calls += row.calls;
        s.flops += row.flops;
        s.bytes += row.bytes;
        s.seconds += row.seconds;
    }
    let shapes = layer_shapes(gcfg, tp);
    let ridge = roofs.measured.ridge();
    let mut rows: Vec<OpRow> = sums
        .into_values()
        .map(|r| {
            let (flops, bytes, seconds) = (r.flops / n, r.bytes / n, r.seconds / n);
            let intensity = if bytes > 0.0 { flops / bytes } else { 0.0 };
            let bound = match (r.collective, intensity >= ridge) {
                (true, _) => "network",
                (false, true) => "compute",
                (false, false) => "memory",
            };
            let rate = |x: f64| if seconds > 0.0 { x / seconds } else { 0.0 };
            OpRow {
                layers: gemm_layers(&r.name, &shapes),
                name: r.name,
                calls: r.calls as f64 / n,
                flops,
                bytes,
                intensity,
                seconds,
                flops_per_s: rate(flops),
                bytes_per_s: rate(bytes),
                bound: bound.into(),
                share: if step_total > 0.0 {
                    seconds / step_total
                } else {
                    0.0
                },
            }
        })
        .collect();
    rows.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    let op_seconds = rows.iter().map(|r| r.seconds).sum::<f64>() / world as f64;
    OpsReport {
        ranks: world,
        steps,
        device,
        dtype,
        decode: None,
        model_flops,
        step_seconds: step_total / world as f64,
        op_seconds,
        rank_seconds,
        roofs,
        rows,
    }
}

/// The (in, out) of each linear layer kind a rank of tensor-parallel degree `tp` runs: the
/// block's four (column-parallel ones split on out, row-parallel ones on in), the router and
/// the tied head (whole, or split by rows under tp).
pub fn layer_shapes(g: &GptConfig, tp: usize) -> Vec<(&'static str, usize, usize)> {
    let (c, tp) = (g.n_embd, tp.max(1));
    let mut shapes = vec![
        ("attn.qkv", c, 3 * c / tp),
        ("attn.proj", c / tp, c),
        ("mlp.fc", c, 4 * c / tp),
        ("mlp.proj", 4 * c / tp, c),
        ("lm_head", c, g.vocab_size),
    ];
    if tp > 1 {
        shapes.push(("lm_head", c, g.vocab_size.div_ceil(tp)));
    }
    if let Some(m) = &g.moe {
        shapes.push(("router", c, m.n_experts));
    }
    shapes
}

/// The layer passes a GEMM row `<kind> MxKxN` can be: fwd (K, N) = (in, out), dgrad (K, N) =
/// (out, in), wgrad (M, N) = (out, in); empty for other rows.
fn gemm_layers(name: &str, shapes: &[(&str, usize, usize)]) -> String {
    let Some(dims) = name.split(' ').nth(1).filter(|_| name.starts_with("gemm")) else {
        return String::new();
    };
    let d: Vec<usize> = dims.split('x').filter_map(|x| x.parse().ok()).collect();
    let [m, k, n] = d[..] else {
        return String::new();
    };
    let mut found: Vec<String> = Vec::new();
    for &(layer, i, o) in shapes {
        for (pass, hit) in [
            ("fwd", (k, n) == (i, o)),
            ("dgrad", (k, n) == (o, i)),
            ("wgrad", (m, n) == (o, i)),
        ] {
            let s = format!("{layer} {pass}");
            if hit && !found.contains(&s) {
                found.push(s);
            }
        }
    }
    found.join(", ")
}

/// The table, largest time first, with the roofs and how much of the step the ops cover.
pub fn table(r: &OpsReport) -> String {
    let mut out = String::new();
    let m = &r.roofs.measured;
    out += &match &r.decode {
        None => format!(
            "ops of {} step(s) {:?} on {} rank(s), {} {}: per step, summed over ranks\n",
            r.steps.len(),
            r.steps,
            r.ranks,
            r.device,
            r.dtype
        ),
        Some(d) => format!(
            "decode ops of {} token(s) at batch {} with the KV cache, positions {}..={}, {} {}: \
             per token\n",
            r.steps.len(),
            d.batch,
            r.steps.first().unwrap_or(&0),
            r.steps.last().unwrap_or(&0),
            r.device,
            r.dtype
        ),
    };
    out += &format!(
        "measured roofs: {:.1} GFLOP/s ({}), {:.1} GB/s ({}), ridge {:.1} FLOP/B\n",
        m.flops_per_s / 1e9,
        m.gemm,
        m.bytes_per_s / 1e9,
        m.copy,
        m.ridge()
    );
    for p in &r.roofs.presets {
        out += &format!(
            "  {}: {} TFLOP/s bf16, {} fp32, {} TB/s HBM, ridge {:.0} FLOP/B\n",
            p.name, p.bf16_tflops, p.fp32_tflops, p.hbm_tb_s, p.ridge
        );
    }
    out += &format!(
        "{:<28} {:>6} {:>9} {:>9} {:>7} {:>8} {:>8} {:>7} {:>7} {:>6}  {}\n",
        "op", "calls", "MFLOP", "MB", "FLOP/B", "ms", "GFLOP/s", "GB/s", "bound", "share", "layers"
    );
    for row in &r.rows {
        out += &format!(
            "{:<28} {:>6} {:>9.2} {:>9.2} {:>7.2} {:>8.3} {:>8.2} {:>7.2} {:>7} {:>5.1}%  {}\n",
            row.name,
            row.calls,
            row.flops / 1e6,
            row.bytes / 1e6,
            row.intensity,
            row.seconds * 1e3,
            row.flops_per_s / 1e9,
            row.bytes_per_s / 1e9,
            row.bound,
            row.share * 100.0,
            row.layers
        );
    }
    let gemm_attn: f64 = r
        .rows
        .iter()
        .filter(|o| o.name.starts_with("gemm") || o.name.contains("attention"))
        .map(|o| o.flops)
        .sum();
    let count = match r.decode {
        None => "flops_per_token x tokens",
        Some(_) => "2 N_matmul + 4 L C (p + 1) per token",
    };
    out += &format!(
        "GEMM + attention: {:.4e} FLOP, model {:.4e} FLOP ({count}): {:+.2}%\n",
        gemm_attn,
        r.model_flops,
        (gemm_attn / r.model_flops - 1.0) * 100.0
    );
    let step = if r.decode.is_some() { "token" } else { "step per rank" };
    out += &format!(
        "ops {:.2} ms of a {:.2} ms {step} ({:.0}%; the rest: host work between ops)",
        r.op_seconds * 1e3,
        r.step_seconds * 1e3,
        r.op_seconds / r.step_seconds.max(1e-12) * 100.0
    );
    let cover = |s: &RankSeconds| s.op_seconds / s.step_seconds.max(1e-12);
    if let Some(low) = r.rank_seconds.iter().min_by(|a, b| cover(a).total_cmp(&cover(b))) {
        if r.ranks > 1 {
            out += &format!(
                "\nleast covered: rank {}, ops {:.2} ms of a {:.2} ms step ({:.0}%)",
                low.rank,
                low.op_seconds * 1e3,
                low.step_seconds * 1e3,
                cover(low) * 100.0
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_rows_name_their_layers() {
        let shapes = layer_shapes(&GptConfig::tiny(), 1);
        assert_eq!(gemm_layers("gemm 1024x64x192", &shapes), "attn.qkv fwd");
        assert_eq!(gemm_layers("gemm 192x1024x64", &shapes), "attn.qkv wgrad");
        // tiny's vocabulary (256) is the MLP's width: fc, the head and proj's transpose share
        // one shape.
        let shared = "mlp.fc fwd, mlp.proj dgrad, lm_head fwd";
        assert_eq!(gemm_layers("gemm 1024x64x256", &shapes), shared);
        let wide = layer_shapes(&GptConfig::gpt2_124m(), 2);
        assert_eq!(gemm_layers("gemm 8192x768x25152", &wide), "lm_head fwd");
        assert_eq!(
            gemm_layers("gemm+bias 8192x768x1152", &wide),
            "attn.qkv fwd"
        );
        assert_eq!(gemm_layers("layer_norm", &shapes), "");
    }
}
