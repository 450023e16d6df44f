//! α-β tables, their least-squares fit from a bench-comm sweep, the communication section of
//! `mtrain plan`, and `mtrain plan --compare RUN_DIR` (prediction next to a `--trace` run).
//!
//! ```text
//!   mtrain --nproc-per-node 4 bench-comm -b 1K -e 16M --op all-reduce --fit configs/alpha-beta/laptop.toml
//!   mtrain plan --tp 4 --pp 2 --config configs/gpt2-124m.toml --alpha-beta configs/alpha-beta/laptop.toml
//!   mtrain plan ... --compare runs/x        # after `mtrain ... --trace` wrote runs/x/trace-rank*.jsonl
//! ```
//!
//! **Fit.** For one op over n ranks the α-β model is a straight line in the message size S:
//! `t(S) = steps·α + (steps · step_bytes / S) · S / β` (see `mtrain_parallel::analysis::comm_cost`), so an
//! least-squares line `t = a + b·S` through the sweep (weighted by 1/t², i.e. relative error,
//! so small messages pin α and large ones β) gives `α = a / steps` and
//! `β = steps · (step_bytes / S) / b`.
//!
//! **Table file** (TOML): a `default` model for ops and sizes not fitted, and one `[[fit]]` per
//! (op, ranks), with the command and date that produced it.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use candle_core::DType;
use mtrain_comm::cpu::{LinkEmulator, Topology};
use mtrain_comm::{AlgoChoice, AllReduceAlgo, AutoRule, MeshDims, OpKind};
use mtrain_model::GptConfig;
use mtrain_parallel::analysis::comm_cost::{
    algorithm_steps, default_auto_rule, human_bytes, human_time, render, step_collectives, totals,
    CostModel, Group, Phase, StepShape,
};
use mtrain_parallel::parallelize::ValidPlan;
use serde::{Deserialize, Serialize};

use crate::config::{DTypeKind, DeviceKind, TrainConfig};
use crate::layout::AlgoFlag;
use crate::fsio::IoContext;

/// Errors of the cost commands.
#[derive(Debug, thiserror::Error)]
pub enum CostError {
    #[error(transparent)]
    Io(#[from] crate::fsio::IoError),
    #[error("parsing α-β table {path}: {msg}")]
    Parse { path: String, msg: String },
    #[error("fit of {op} over {ranks} ranks: {msg}")]
    Fit {
        op: String,
        ranks: usize,
        msg: String,
    },
    #[error("{0}")]
    Model(#[from] mtrain_parallel::analysis::comm_cost::CostError),
    #[error("resolving the configuration: {0}")]
    Config(String),
    #[error("no trace-rank*.jsonl files in {0} (run training with --trace first)")]
    NoTrace(String),
}

pub type Result<T> = std::result::Result<T, CostError>;

/// One fitted line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fit {
    /// Collective, as in traces: `all_reduce`, `all_gather`, ...
    pub op: String,
    /// Group size it was measured at.
    pub ranks: usize,
    pub alpha_s: f64,
    pub beta_bytes_per_s: f64,
    /// Coefficient of determination of the line.
    pub r2: f64,
    /// Sizes measured.
    pub points: usize,
    /// The sweep that produced it, with its date.
    #[serde(default)]
    pub command: String,
}

/// An α-β table for one machine and backend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AlphaBetaTable {
    /// `cpu` or `nccl`.
    pub backend: String,
    /// What the numbers are: `default (not measured) ...` or the command and date of a fit.
    pub source: String,
    /// Used for every op and group size without a fit.
    pub default: CostModel,
    #[serde(default)]
    pub fit: Vec<Fit>,
    /// `--algo auto`'s rule per group size, measured by `bench-comm --fit` (tables written
    /// before it have none: the cost model's defaults apply).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub auto: Vec<AutoRule>,
}

impl AlphaBetaTable {
    /// The built-in defaults, labelled as such.
    pub fn cpu_default() -> Self {
        Self {
            backend: "cpu".into(),
            source: "default (not measured): CPU backend on loopback TCP".into(),
            default: CostModel::CPU_LOOPBACK_DEFAULT,
            fit: vec![],
            auto: vec![],
        }
    }

    pub fn nvlink_default() -> Self {
        Self {
            backend: "nccl".into(),
            source: "default (not measured): NVLink-class GPUs, one node".into(),
            default: CostModel::NVLINK_DEFAULT,
            fit: vec![],
            auto: vec![],
        }
    }

    pub fn load(path: &Path) -> Result<Self> {
        let text = crate::fsio::read_to_string(path)?;
        toml::from_str(&text).map_err(|e| CostError::Parse {
            path: path.display().to_string(),
            msg: e.to_string(),
        })
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).at("creating directory", dir)?;
        }
        let text = toml::to_string_pretty(self).map_err(|e| CostError::Parse {
            path: path.display().to_string(),
            msg: e.to_string(),
        })?;
        Ok(std::fs::write(path, text).at("writing", path)?)
    }

    /// The model for `op` over `n` ranks: its fit at n, else the same op's fit at the nearest
    /// size, else the default.
    pub fn model(&self, op: OpKind, n: usize) -> CostModel {
        let name = op.to_string();
        self.fit
            .iter()
            .filter(|f| f.op == name)
            .min_by_key(|f| f.ranks.abs_diff(n))
            .map_or(self.default, |f| CostModel {
                alpha_s: f.alpha_s,
                beta_bytes_per_s: f.beta_bytes_per_s,
            })
    }

    /// Replaces (or adds) the auto rule of the same group size.
    pub fn upsert_auto(&mut self, rule: AutoRule) {
        self.auto.retain(|r| r.ranks != rule.ranks);
        self.auto.push(rule);
        self.auto.sort_by_key(|r| r.ranks);
    }

    /// `--algo auto`'s rules for every group size up to `world`: the measured rule of that
    /// size, else the one this table's α-β model implies (`comm_cost::default_auto_rule`).
    pub fn auto_rules(&self, world: usize) -> Vec<AutoRule> {
        (2..=world.max(2))
            .map(|n| match self.auto.iter().find(|r| r.ranks == n) {
                Some(r) => r.clone(),
                None => default_auto_rule(&self.model(OpKind::AllReduce, n), Topology::Switch, n),
            })
            .collect()
    }

    /// Replaces (or adds) the fit of the same op and size.
    pub fn upsert(&mut self, fit: Fit) {
        self.fit
            .retain(|f| (f.op.as_str(), f.ranks) != (fit.op.as_str(), fit.ranks));
        self.fit.push(fit);
        self.fit
            .sort_by(|a, b| (a.op.as_str(), a.ranks).cmp(&(b.op.as_str(), b.ranks)));
    }
}

/// The CPU backend's all-reduce choice for `--algo flag` in a world of `world` ranks: auto's
/// rules from the table at `table` (`--algo-table`), else from the cost model on `link` (the
/// emulated link of `--link`, its α, β and topology: the sizes where the emulated times cross),
/// else from the CPU loopback defaults.
pub fn algo_choice(
    flag: AlgoFlag,
    table: Option<&Path>,
    link: Option<&LinkEmulator>,
    world: usize,
) -> Result<AlgoChoice> {
    Ok(match flag {
        AlgoFlag::Ring => AlgoChoice::Fixed(AllReduceAlgo::Ring),
        AlgoFlag::Tree => AlgoChoice::Fixed(AllReduceAlgo::Tree),
        AlgoFlag::Rhd => AlgoChoice::Fixed(AllReduceAlgo::Rhd),
        AlgoFlag::Auto => AlgoChoice::Auto(match (table, link) {
            (Some(path), _) => AlphaBetaTable::load(path)?.auto_rules(world),
            (None, Some(link)) => {
                let model = CostModel {
                    alpha_s: link.alpha.as_secs_f64(),
                    beta_bytes_per_s: link.bytes_per_s,
                };
                (2..=world.max(2))
                    .map(|n| default_auto_rule(&model, link.topology, n))
                    .collect()
            }
            (None, None) => AlphaBetaTable::cpu_default().auto_rules(world),
        }),
    })
}

/// Least-squares α and β of `op` over `n` ranks from (message bytes S, seconds) points. S is
/// bench-comm's size: the tensor for all-reduce, broadcast, send; the gathered output for
/// all-gather; one rank's input for reduce-scatter and all-to-all.
pub fn fit_alpha_beta(op: OpKind, n: usize, points: &[(f64, f64)]) -> Result<Fit> {
    let err = |msg: String| CostError::Fit {
        op: op.to_string(),
        ranks: n,
        msg,
    };
    if points.len() < 2 {
        return Err(err(format!("needs at least 2 sizes, got {}", points.len())));
    }
    // bench-comm's all-gather size is the output; the model's input is one shard of it.
    let model_bytes = |s: f64| match op {
        OpKind::AllGather => s / n as f64,
        _ => s,
    };
    let (steps, step_bytes_of_one) = algorithm_steps(op, n, model_bytes(1.0));
    if steps == 0 {
        return Err(err("a group of one rank sends nothing".into()));
    }
    // Weighted least squares with weights 1/t²: minimises the relative error of each point, so
    // the small messages (which set α) count as much as the large ones (which set β).
    let w: Vec<f64> = points
        .iter()
        .map(|p| 1.0 / p.1.max(1e-12).powi(2))
        .collect();
    let sw: f64 = w.iter().sum();
    let mx = points.iter().zip(&w).map(|(p, w)| w * p.0).sum::<f64>() / sw;
    let my = points.iter().zip(&w).map(|(p, w)| w * p.1).sum::<f64>() / sw;
    let sxx: f64 = points
        .iter()
        .zip(&w)
        .map(|(p, w)| w * (p.0 - mx).powi(2))
        .sum();
    let sxy: f64 = points
        .iter()
        .zip(&w)
        .map(|(p, w)| w * (p.0 - mx) * (p.1 - my))
        .sum();
    if sxx == 0.0 {
        return Err(err("all sizes are equal".into()));
    }
    let slope = sxy / sxx;
    let intercept = my - slope * mx;
    if slope <= 0.0 {
        return Err(err(format!(
            "time does not grow with size (slope {slope:.3e} s/byte): sweep larger sizes"
        )));
    }
    let ss_tot: f64 = points
        .iter()
        .zip(&w)
        .map(|(p, w)| w * (p.1 - my).powi(2))
        .sum();
    let ss_res: f64 = points
        .iter()
        .zip(&w)
        .map(|(p, w)| w * (p.1 - intercept - slope * p.0).powi(2))
        .sum();
    Ok(Fit {
        op: op.to_string(),
        ranks: n,
        // A negative intercept is noise around a tiny latency.
        alpha_s: (intercept / steps as f64).max(0.0),
        beta_bytes_per_s: steps as f64 * step_bytes_of_one / slope,
        r2: if ss_tot > 0.0 {
            1.0 - ss_res / ss_tot
        } else {
            1.0
        },
        points: points.len(),
        command: String::new(),
    })
}

/// The α-β model for a trace group name (`tp`, or `tp[0,1]`) of a table.
fn group_of(name: &str) -> Option<Group> {
    let base = name.split('[').next().unwrap_or(name);
    Group::ALL.into_iter().find(|g| g.name() == base)
}

/// The communication section of `mtrain plan`: for the first rank of each pipeline stage, every
/// collective of one optimizer step with its predicted time; `batch` is the global batch of one
/// micro-step (sequences), `grad_accum` micro-steps per optimizer step.
pub fn plan_section(
    cfg: &GptConfig,
    plan: &ValidPlan,
    shape: StepShape,
    grad_accum: usize,
    table: &AlphaBetaTable,
) -> Result<String> {
    let dims = plan.dims;
    let model = |_: Group, op: OpKind, n: usize| table.model(op, n);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "communication of one micro-step that ends an optimizer step (α-β {}: {}; default α = {}, β = {:.2} GB/s; {} activations):",
        table.backend,
        table.source,
        human_time(table.default.alpha_s),
        table.default.beta_bytes_per_s / 1e9,
        match shape.dtype {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            _ => "f32",
        }
    );
    if grad_accum > 1 {
        let _ = writeln!(
            s,
            "(grad_accum {grad_accum}: the [fwd] and [bwd] rows run in each of the {grad_accum} micro-steps; the gradient reduction and norm once per optimizer step)"
        );
    }
    for p in 0..dims.pp {
        let rank = dims.rank_of(0, p, 0);
        let items = step_collectives(cfg, plan, shape, rank)?;
        let _ = writeln!(s, "rank {rank} (pp stage {p}, dp 0, tp 0):");
        s.push_str(&render(&items, dims, &model));
    }
    Ok(s)
}

/// Measured figures of one (group, op) on one rank.
#[derive(Debug, Default, Clone, Copy)]
struct Measured {
    count: usize,
    bytes_sent: u64,
    busy_s: f64,
}

/// One rank's trace, measured: per (group, op) of the training steps' collectives, and how many
/// steps the trace holds.
#[derive(Debug)]
struct RankTrace {
    ops: BTreeMap<(Group, String), Measured>,
    steps: usize,
}

/// Per (group, op), the count, bytes sent and busy time of the training steps' collectives in
/// one rank's trace (JSON lines), and the number of steps.
///
/// Only collectives tagged `"phase": "step"` count (see [`crate::trace`]): startup, evaluation
/// and checkpoint traffic is not the step's. A trace without phase tags (written through the
/// library without a timeline) is taken as one step. A group runs its ops one after another, so
/// an op issued while an earlier op of its group was still running is timed from that op's end,
/// not from its issue; waiting for peers stays in.
fn measure(path: &Path, text: &str) -> Result<RankTrace> {
    let mut measured: BTreeMap<(Group, String), Measured> = BTreeMap::new();
    let mut steps = std::collections::BTreeSet::new();
    // (group name, seq, group, op, bytes sent, issued, ended, in a step)
    let mut events = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| CostError::Parse {
            path: path.display().to_string(),
            msg: e.to_string(),
        })?;
        let Some(name) = v["group"].as_str() else {
            continue;
        };
        let Some(g) = group_of(name) else {
            continue;
        };
        let op = v["op"].as_str().unwrap_or("?").to_string();
        let (a, b) = (v["start_us"].as_u64(), v["end_us"].as_u64());
        let in_step = match v.get("phase") {
            None => {
                steps.insert(0);
                true
            }
            Some(p) if p == "step" => {
                steps.insert(v["step"].as_u64().unwrap_or(0));
                true
            }
            Some(_) => false,
        };
        events.push((
            name.to_string(),
            v["seq"].as_u64().unwrap_or(0),
            g,
            op,
            v["bytes_sent"].as_u64().unwrap_or(0),
            a,
            b,
            in_step,
        ));
    }
    // A group's ops finish in the order they ran (sequence numbers count per kind of op: sends,
    // receives and collectives separately).
    events.sort_by(|x, y| (&x.0, x.6, x.5, x.1).cmp(&(&y.0, y.6, y.5, y.1)));
    let mut prev: Option<(String, u64)> = None;
    for (name, _, g, op, sent, a, b, in_step) in events {
        // Every op of the group delays the next, so the busy time sees all of them.
        let busy = match (a, b) {
            (Some(a), Some(b)) => {
                let start = match &prev {
                    Some((p, end)) if *p == name => a.max(*end),
                    _ => a,
                };
                prev = Some((name, b));
                b.saturating_sub(start) as f64 * 1e-6
            }
            _ => 0.0,
        };
        if in_step {
            let m = measured.entry((g, op)).or_default();
            m.count += 1;
            m.bytes_sent += sent;
            m.busy_s += busy;
        }
    }
    Ok(RankTrace {
        ops: measured,
        steps: steps.len(),
    })
}

/// `mtrain plan --compare RUN_DIR`: per rank and (group, op) of the training steps, the
/// collectives per step, bytes sent and time per op next to the prediction for `grad_accum`
/// micro-steps per step, flagging a different count and ratios beyond 2× either way.
pub fn compare(
    run_dir: &Path,
    cfg: &GptConfig,
    plan: &ValidPlan,
    shape: StepShape,
    grad_accum: usize,
    table: &AlphaBetaTable,
) -> Result<String> {
    let dims = plan.dims;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<5} {:<6} {:<15} {:>8} {:>8} {:>12} {:>12} {:>11} {:>11}  flag",
        "rank",
        "group",
        "op",
        "ops/step",
        "pred ops",
        "sent/op",
        "pred sent",
        "time/op",
        "pred time"
    );
    let mut found = 0;
    for rank in 0..dims.world_size() {
        let path = run_dir.join(format!("trace-rank{rank}.jsonl"));
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        found += 1;
        let RankTrace {
            ops: measured,
            steps,
        } = measure(&path, &text)?;
        let mut predicted: BTreeMap<(Group, String), (usize, u64, f64)> = BTreeMap::new();
        for c in step_collectives(cfg, plan, shape, rank)? {
            let n = c.group.size(dims);
            let t = table.model(c.op, n).time(c.op, n, c.bytes).total_s();
            // Forward and backward collectives run in every micro-step of the optimizer step.
            let count = match c.phase {
                Phase::Forward | Phase::Backward => c.count * grad_accum.max(1),
                Phase::Step => c.count,
            };
            let p = predicted.entry((c.group, c.op.to_string())).or_default();
            p.0 += count;
            p.1 += c.bytes_sent * count as u64;
            p.2 += t * count as f64;
        }
        let keys: std::collections::BTreeSet<_> =
            measured.keys().chain(predicted.keys()).cloned().collect();
        for k in keys {
            if k.0.size(dims) <= 1 {
                continue;
            }
            let m = measured.get(&k).copied().unwrap_or_default();
            let p = predicted.get(&k).copied().unwrap_or_default();
            let per = |x: f64, n: usize| if n == 0 { 0.0 } else { x / n as f64 };
            let (m_sent, p_sent) = (per(m.bytes_sent as f64, m.count), per(p.1 as f64, p.0));
            let (m_time, p_time) = (per(m.busy_s, m.count), per(p.2, p.0));
            let off = |a: f64, b: f64| a > 2.0 * b || b > 2.0 * a;
            let per_step = per(m.count as f64, steps);
            let mut flags = Vec::new();
            if m.count == 0 || p.0 == 0 {
                flags.push(if m.count == 0 {
                    "not traced"
                } else {
                    "not predicted"
                });
            } else {
                if per_step != p.0 as f64 {
                    flags.push("count differs");
                }
                if off(m_sent, p_sent) {
                    flags.push("bytes >2x off");
                }
                if off(m_time, p_time) {
                    flags.push("time >2x off");
                }
            }
            let _ = writeln!(
                s,
                "{:<5} {:<6} {:<15} {:>8} {:>8} {:>12} {:>12} {:>11} {:>11}  {}",
                rank,
                k.0.name(),
                k.1,
                format!("{per_step:.4}")
                    .trim_end_matches('0')
                    .trim_end_matches('.'),
                p.0,
                human_bytes(m_sent as u64),
                human_bytes(p_sent as u64),
                human_time(m_time),
                human_time(p_time),
                flags.join(", ")
            );
        }
    }
    if found == 0 {
        return Err(CostError::NoTrace(run_dir.display().to_string()));
    }
    let _ = writeln!(
        s,
        "(the training steps' collectives only, startup, evaluation and checkpoints left out; per-op means; measured time runs from when the group could start the op (its issue, or the end of the group's previous op) to completion, so it includes waiting for peers)"
    );
    Ok(s)
}

/// Totals of one rank, for tests and summaries.
pub fn rank_totals(
    cfg: &GptConfig,
    plan: &ValidPlan,
    shape: StepShape,
    rank: usize,
    table: &AlphaBetaTable,
) -> Result<mtrain_parallel::analysis::comm_cost::StepTotals> {
    let items = step_collectives(cfg, plan, shape, rank)?;
    Ok(totals(&items, plan.dims, &|_, op, n| table.model(op, n)))
}

/// Sizes of a mesh's groups, for a header line.
pub fn group_sizes(dims: MeshDims) -> String {
    Group::ALL
        .iter()
        .map(|g| format!("{} {}", g.name(), g.size(dims)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Today's date (UTC) as `YYYY-MM-DD`, for the provenance line of a fitted table.
pub fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = secs.div_euclid(86_400) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

/// What `mtrain plan` adds for the communication cost model: the per-step table of the run
/// configuration `cfg` under `plan`, or with `compare` the prediction next to a traced run.
/// `alpha_beta` is a table from `bench-comm --fit`; without one, the backend's defaults.
pub fn plan_report(
    cfg: &TrainConfig,
    plan: &ValidPlan,
    alpha_beta: Option<&Path>,
    compare_dir: Option<&Path>,
) -> Result<String> {
    let model = cfg
        .gpt_config()
        .map_err(|e| CostError::Config(e.to_string()))?;
    let table = match alpha_beta {
        Some(p) => AlphaBetaTable::load(p)?,
        None => match cfg.device {
            DeviceKind::Cuda => AlphaBetaTable::nvlink_default(),
            DeviceKind::Cpu => AlphaBetaTable::cpu_default(),
        },
    };
    let shape = StepShape {
        batch: cfg.batch_size * plan.dims.dp,
        seq_len: cfg.seq_len,
        dtype: match cfg.dtype {
            DTypeKind::F32 => DType::F32,
            _ => DType::BF16,
        },
    };
    match compare_dir {
        Some(dir) => compare(dir, &model, plan, shape, cfg.grad_accum, &table),
        None => plan_section(&model, plan, shape, cfg.grad_accum, &table),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two all-reduces of one group, the second issued while the first ran: the second is timed
    /// from the first's end. Another group's op overlapping them keeps its own issue time.
    #[test]
    fn an_op_queued_behind_its_group_is_timed_from_when_it_could_start() {
        let ev = |group: &str, seq: u64, op: &str, start: u64, end: u64| {
            format!(
                r#"{{"op":"{op}","group":"{group}","seq":{seq},"bytes":8,"bytes_sent":4,"start_us":{start},"end_us":{end},"peer":null}}"#
            )
        };
        let text = [
            ev("tp[0,1]", 1, "all_reduce", 100, 400), // issued at 100, queued behind seq 0
            ev("tp[0,1]", 0, "all_reduce", 0, 300),
            ev("dp[0,2]", 0, "all_reduce", 50, 250),
            ev("not-a-group", 0, "all_reduce", 0, 1_000_000),
        ]
        .join("\n");
        let m = measure(Path::new("trace-rank0.jsonl"), &text).unwrap().ops;
        let tp = m[&(Group::Tp, "all_reduce".to_string())];
        assert_eq!((tp.count, tp.bytes_sent), (2, 8));
        // 300 µs for seq 0, then 400 − 300 = 100 µs for seq 1 (not 400 − 100 = 300).
        assert!((tp.busy_s - 400e-6).abs() < 1e-12, "{}", tp.busy_s);
        let dp = m[&(Group::Dp, "all_reduce".to_string())];
        assert!((dp.busy_s - 200e-6).abs() < 1e-12, "{}", dp.busy_s);
        assert_eq!(m.len(), 2);
        let bad = measure(Path::new("t.jsonl"), "{not json").unwrap_err();
        assert!(bad.to_string().contains("t.jsonl"), "{bad}");
    }

    /// Only the collectives tagged with the step phase count, and the steps are counted; a
    /// setup or evaluation op still delays the group's next op.
    #[test]
    fn only_the_training_steps_collectives_are_measured() {
        let ev = |seq: u64, phase: &str, step: &str, start: u64, end: u64| {
            format!(
                r#"{{"op":"all_reduce","group":"tp[0,1]","seq":{seq},"bytes":8,"bytes_sent":4,"start_us":{start},"end_us":{end},"peer":null,"phase":"{phase}"{step}}}"#
            )
        };
        let text = [
            ev(0, "setup", "", 0, 100),
            ev(1, "step", r#","step":0"#, 50, 150), // queued behind the setup op: 50 µs
            ev(2, "eval", "", 200, 300),
            ev(3, "step", r#","step":1"#, 400, 420),
            ev(4, "checkpoint", "", 500, 900),
        ]
        .join("\n");
        let t = measure(Path::new("trace-rank0.jsonl"), &text).unwrap();
        assert_eq!(t.steps, 2);
        let tp = t.ops[&(Group::Tp, "all_reduce".to_string())];
        assert_eq!((tp.count, tp.bytes_sent), (2, 8));
        assert!((tp.busy_s - 70e-6).abs() < 1e-12, "{}", tp.busy_s);
    }
}
