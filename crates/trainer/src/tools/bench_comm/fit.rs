//! `bench-comm --fit FILE`: a sweep's least-squares α (latency per step) and β (bandwidth),
//! merged into the α-β table `mtrain plan --alpha-beta FILE` reads (`cost.rs` holds the fit
//! and the table; this file only turns a report into the fit's points and records where they
//! came from).

use std::io::Write;
use std::path::Path;

use mtrain_comm::{AutoRule, OpKind};

use super::{BenchCommArgs, BenchError, BenchOp, BenchReport};
use crate::config::DeviceKind;
use crate::tools::cost::{fit_alpha_beta, AlphaBetaTable, CostError, Fit};

/// Fit `report`'s sweep, merge it into the table at `path`, and say so on `table` (the
/// human-readable output): `--fit`'s whole effect.
pub(super) fn record(
    path: &Path,
    args: &BenchCommArgs,
    report: &BenchReport,
    auto: Option<AutoRule>,
    table: &mut dyn Write,
) -> Result<(), BenchError> {
    let backend = match args.device {
        DeviceKind::Cpu => "cpu",
        _ => "nccl",
    };
    let command = format!(
        "mtrain bench-comm --op {} -b {} -e {} -f {} -n {} --device {backend}, {} ranks, {}",
        report.op_name(),
        args.min_bytes,
        args.max_bytes,
        args.step_factor,
        args.iters,
        report.world_size,
        crate::tools::cost::today()
    );
    let fit = write_fit(path, report, backend, &command, auto)
        .map_err(|e| BenchError::Fit(e.to_string()))?;
    writeln!(
        table,
        "# fit {} over {} ranks: alpha {:.2} us per step, beta {:.3} GB/s (R^2 {:.4}) -> {}",
        fit.op,
        fit.ranks,
        fit.alpha_s * 1e6,
        fit.beta_bytes_per_s / 1e9,
        fit.r2,
        path.display()
    )?;
    Ok(())
}

/// The trace name of a bench-comm op.
pub fn op_kind(op: BenchOp) -> OpKind {
    match op {
        BenchOp::AllReduce => OpKind::AllReduce,
        BenchOp::AllGather => OpKind::AllGather,
        BenchOp::ReduceScatter => OpKind::ReduceScatter,
        BenchOp::AllToAll => OpKind::AllToAll,
        BenchOp::Broadcast => OpKind::Broadcast,
        BenchOp::SendRecv => OpKind::Send,
    }
}

/// `bench-comm --fit FILE`: fit the report's sweep and merge it into the table at `path`
/// (created with the backend's defaults if missing), with `auto`'s measured rule for its world
/// size when there is one; `command` records the sweep. Returns the fit.
pub fn write_fit(
    path: &Path,
    report: &BenchReport,
    backend: &str,
    command: &str,
    auto: Option<AutoRule>,
) -> Result<Fit, CostError> {
    let op = op_kind(report.op);
    let points: Vec<(f64, f64)> = report
        .rows
        .iter()
        .map(|r| (r.bytes as f64, r.time_us * 1e-6))
        .collect();
    let mut fit = fit_alpha_beta(op, report.world_size, &points)?;
    fit.command = command.to_string();
    let mut table = match path.exists() {
        true => AlphaBetaTable::load(path)?,
        false => match backend {
            "nccl" => AlphaBetaTable::nvlink_default(),
            _ => AlphaBetaTable::cpu_default(),
        },
    };
    table.backend = backend.to_string();
    table.source = "fitted by `mtrain bench-comm --fit` (each fit names its sweep)".into();
    table.upsert(fit.clone());
    if let Some(rule) = auto {
        table.upsert_auto(rule);
    }
    table.save(path)?;
    Ok(fit)
}
