//! `mtrain bench-comm`: collective bandwidth in the style of nccl-tests, with a correctness check.
//!
//! ```text
//! mtrain --nproc-per-node 4 bench-comm -b 8 -e 256M -f 2 --op all-reduce
//! ```
//!
//! For each message size S (from `-b` to `-e`, times `-f` each step) every rank runs `-w` warm-up
//! and `-n` timed iterations of the op; the time is the slowest rank's mean. As in nccl-tests:
//!
//! ```text
//!   algbw = S / time
//!   busbw = algbw · factor      the bytes one link must carry, comparable across ops and n
//!
//!   op              S is                    factor
//!   all-reduce      the tensor              2(n−1)/n   (reduce-scatter + all-gather, each (n−1)/n)
//!   all-gather      the gathered output     (n−1)/n
//!   reduce-scatter  the full input          (n−1)/n
//!   all-to-all      one rank's input        (n−1)/n
//!   broadcast       the tensor              1
//!   send-recv       the message             1          (rank r sends to r+1, receives from r−1)
//! ```
//!
//! Every input is filled from a closed form of (rank, index) whose values are small integers, exact
//! in bf16 and in any summation order, so the result of the last timed iteration is compared
//! element by element with what it must be; `#wrong` is the number of differing elements over all
//! ranks. A healthy backend prints 0 in every row.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use clap::{Args, ValueEnum};
use mtrain_comm::{Backend, Comm, CommError, OpKind, ReduceOp};
use serde::Serialize;

use crate::config::DeviceKind;
use crate::cost::{fit_alpha_beta, AlphaBetaTable, CostError, Fit};
use crate::fsio::IoContext;

/// Options of `mtrain bench-comm` (nccl-tests' short flags).
#[derive(Debug, Clone, Args)]
pub struct BenchCommArgs {
    /// Smallest message size in bytes; K, M, G suffixes are powers of 1024.
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_size, value_name = "SIZE")]
    pub min_bytes: u64,

    /// Largest message size in bytes; K, M, G suffixes are powers of 1024.
    #[arg(short = 'e', long = "maxbytes", default_value = "32M", value_parser = parse_size, value_name = "SIZE")]
    pub max_bytes: u64,

    /// Multiply the size by this factor at each step (at least 2).
    #[arg(
        short = 'f',
        long = "stepfactor",
        default_value_t = 2,
        value_name = "F"
    )]
    pub step_factor: u64,

    /// The collective to measure.
    #[arg(long, value_enum, default_value_t = BenchOp::AllReduce)]
    pub op: BenchOp,

    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20, value_name = "N")]
    pub iters: usize,

    /// Untimed warm-up iterations per size.
    #[arg(
        short = 'w',
        long = "warmup-iters",
        default_value_t = 5,
        value_name = "N"
    )]
    pub warmup: usize,

    /// Element type of the messages.
    #[arg(long, value_enum, default_value_t = BenchDtype::F32)]
    pub dtype: BenchDtype,

    /// Where the messages live: `cpu` (TCP backend) or `cuda` (NCCL, one GPU per rank).
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,

    /// Also write the results as JSON to this file (rank 0; `-` for stdout).
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,

    /// Least-squares fit α (latency per step) and β (bandwidth) of this op and world size to the
    /// sweep and merge them into this α-β table (TOML, e.g. configs/alpha-beta/<machine>.toml),
    /// which `mtrain plan --alpha-beta FILE` reads.
    #[arg(long, value_name = "FILE")]
    pub fit: Option<PathBuf>,
}

/// The collectives bench-comm can measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BenchOp {
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Broadcast,
    SendRecv,
}

/// Message element types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BenchDtype {
    F32,
    Bf16,
}

impl BenchDtype {
    fn dtype(self) -> DType {
        match self {
            BenchDtype::F32 => DType::F32,
            BenchDtype::Bf16 => DType::BF16,
        }
    }
    /// The name nccl-tests prints in its `type` column.
    fn nccl_name(self) -> &'static str {
        match self {
            BenchDtype::F32 => "float",
            BenchDtype::Bf16 => "bfloat16",
        }
    }
}

impl BenchOp {
    /// The name on the command line, e.g. `all-reduce`.
    pub fn name(self) -> &'static str {
        match self {
            BenchOp::AllReduce => "all-reduce",
            BenchOp::AllGather => "all-gather",
            BenchOp::ReduceScatter => "reduce-scatter",
            BenchOp::AllToAll => "all-to-all",
            BenchOp::Broadcast => "broadcast",
            BenchOp::SendRecv => "send-recv",
        }
    }

    /// busbw / algbw for a group of `n` ranks (nccl-tests' PERFORMANCE.md).
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            BenchOp::AllReduce => 2.0 * (n - 1.0) / n,
            BenchOp::AllGather | BenchOp::ReduceScatter | BenchOp::AllToAll => (n - 1.0) / n,
            BenchOp::Broadcast | BenchOp::SendRecv => 1.0,
        }
    }

    /// Ops whose size must split evenly into one block per rank.
    fn splits_by_rank(self) -> bool {
        matches!(
            self,
            BenchOp::AllGather | BenchOp::ReduceScatter | BenchOp::AllToAll
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("bench-comm: {0}")]
    Invalid(String),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("writing results: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    File(#[from] crate::fsio::IoError),
    #[error("writing JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("--fit: {0}")]
    Fit(String),
}

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    pub bytes: u64,
    pub count: usize,
    pub time_us: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
    pub wrong: u64,
}

impl BenchReport {
    /// The op as spelled on the command line.
    pub fn op_name(&self) -> &'static str {
        self.op.name()
    }
}

/// Everything one bench-comm run measured.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub op: BenchOp,
    pub dtype: BenchDtype,
    pub world_size: usize,
    pub iters: usize,
    pub warmup: usize,
    pub rows: Vec<BenchRow>,
    /// Mean busbw over the rows, as nccl-tests' "Avg bus bandwidth".
    pub avg_busbw_gbps: f64,
}

/// Parse `8`, `64K`, `256M`, `1G` (powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (digits, mult) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("size {s:?} is not a number with an optional K, M or G suffix"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

/// Closed-form inputs: small integers, exact in bf16 and in any summation order.
fn value(rank: usize, i: usize) -> f32 {
    ((rank + 1) + i % 7) as f32
}
/// The block rank `src` sends to rank `dst` in all-to-all.
fn block_value(src: usize, dst: usize, i: usize) -> f32 {
    ((src * 31 + dst * 7 + i) % 199) as f32
}

/// One size's input on this rank and the result it must produce.
struct Case {
    input: Tensor,
    expected: Vec<f32>,
}

fn tensor(values: Vec<f32>, dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
    let n = values.len();
    Tensor::from_vec(values, n, device)?.to_dtype(dtype)
}

fn make_case(
    op: BenchOp,
    count: usize,
    n: usize,
    r: usize,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<Case> {
    let m = count / n; // rows per rank for the split ops
    let (input, expected): (Vec<f32>, Vec<f32>) = match op {
        BenchOp::AllReduce => {
            let sum_ranks = (n * (n + 1) / 2) as f32;
            (
                (0..count).map(|i| value(r, i)).collect(),
                (0..count)
                    .map(|i| sum_ranks + (n * (i % 7)) as f32)
                    .collect(),
            )
        }
        BenchOp::AllGather => (
            (0..m).map(|i| value(r, i)).collect(),
            (0..m * n).map(|j| value(j / m, j % m)).collect(),
        ),
        BenchOp::ReduceScatter => {
            let sum_ranks = (n * (n + 1) / 2) as f32;
            (
                (0..count).map(|i| value(r, i)).collect(),
                (r * m..(r + 1) * m)
                    .map(|i| sum_ranks + (n * (i % 7)) as f32)
                    .collect(),
            )
        }
        BenchOp::AllToAll => (
            (0..m * n).map(|j| block_value(r, j / m, j % m)).collect(),
            (0..m * n).map(|j| block_value(j / m, r, j % m)).collect(),
        ),
        BenchOp::Broadcast => (
            (0..count)
                .map(|i| if r == 0 { value(0, i) } else { -1.0 })
                .collect(),
            (0..count).map(|i| value(0, i)).collect(),
        ),
        BenchOp::SendRecv => {
            let prev = (r + n - 1) % n;
            (
                (0..count).map(|i| value(r, i)).collect(),
                (0..count).map(|i| value(prev, i)).collect(),
            )
        }
    };
    Ok(Case {
        input: tensor(input, dtype, device)?,
        expected,
    })
}

/// Run the op once on this rank's input.
fn run_op(comm: &Comm, op: BenchOp, x: &Tensor) -> Result<Tensor, CommError> {
    let (n, r) = (comm.size(), comm.rank());
    match op {
        BenchOp::AllReduce => comm.all_reduce(x, ReduceOp::Sum),
        BenchOp::AllGather => comm.all_gather(x),
        BenchOp::ReduceScatter => comm.reduce_scatter(x, ReduceOp::Sum),
        BenchOp::AllToAll => {
            let splits = vec![x.dims()[0] / n; n];
            comm.all_to_all(x, &splits, &splits)
        }
        BenchOp::Broadcast => comm.broadcast(x, 0),
        BenchOp::SendRecv => {
            // Both directions in flight at once, like ncclSend + ncclRecv in one group call.
            let sent = comm.send_async(x, (r + 1) % n);
            let got = comm.recv((r + n - 1) % n, x.shape(), x.dtype());
            sent.wait()?;
            got
        }
    }
}

fn count_wrong(result: &Tensor, expected: &[f32]) -> candle_core::Result<u64> {
    let got = result
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    if got.len() != expected.len() {
        return Ok(expected.len().max(got.len()) as u64);
    }
    Ok(got.iter().zip(expected).filter(|(a, b)| a != b).count() as u64)
}

/// Run the benchmark over the world group. Every rank returns the same report; rank 0 prints it.
pub fn run(args: &BenchCommArgs, backend: &dyn Backend) -> Result<BenchReport, BenchError> {
    if args.step_factor < 2 {
        return Err(BenchError::Invalid(format!(
            "-f/--stepfactor must be at least 2, got {}",
            args.step_factor
        )));
    }
    if args.min_bytes > args.max_bytes {
        return Err(BenchError::Invalid(format!(
            "-b/--minbytes ({}) is larger than -e/--maxbytes ({})",
            args.min_bytes, args.max_bytes
        )));
    }
    if args.iters == 0 {
        return Err(BenchError::Invalid("-n/--iters must be at least 1".into()));
    }
    let comm = backend.world();
    let (n, r) = (comm.size(), comm.rank());
    if args.op == BenchOp::SendRecv && n < 2 {
        return Err(BenchError::Invalid(format!(
            "send-recv needs at least 2 ranks, the job has {n}"
        )));
    }
    let dtype = args.dtype.dtype();
    let elem = dtype.size_in_bytes();
    let device = comm.device().clone();
    // Per rank: the input, the result (n times the input for all-gather) and the expected values
    // (f32, up to twice the input's bytes in bf16), all of the largest size at once.
    let per_rank = args.max_bytes as u128 * (n as u128 + 3);
    let memory = device
        .is_cpu()
        .then(crate::validate::host_memory_bytes)
        .flatten();
    crate::validate::fits_in_memory(
        &format!("-e/--maxbytes {} over {n} ranks", args.max_bytes),
        per_rank,
        memory,
    )
    .map_err(BenchError::Invalid)?;

    if r == 0 {
        println!(
            "# mtrain bench-comm: {}, {n} ranks, {}, {} warm-up + {} timed iterations per size",
            args.op.name(),
            args.dtype.nccl_name(),
            args.warmup,
            args.iters
        );
        println!(
            "# {:>12} {:>12} {:>9} {:>12} {:>12} {:>12} {:>8}",
            "size(B)", "count", "type", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"
        );
    }

    let mut rows = Vec::new();
    let mut size = args.min_bytes;
    while size <= args.max_bytes {
        let mut count = (size as usize) / elem;
        if args.op.splits_by_rank() {
            count -= count % n;
        }
        let case = make_case(args.op, count, n, r, dtype, &device)?;
        for _ in 0..args.warmup {
            run_op(&comm, args.op, &case.input)?;
        }
        comm.barrier()?;
        let start = Instant::now();
        let mut result = None;
        for _ in 0..args.iters {
            result = Some(run_op(&comm, args.op, &case.input)?);
        }
        // On a GPU an op returns once it is queued on the stream; the barrier returns only after
        // the group's earlier ops have finished, so the clock stops when the bytes have moved.
        comm.barrier()?;
        let local_us = start.elapsed().as_secs_f64() * 1e6 / args.iters as f64;
        let wrong_local = match &result {
            Some(t) => count_wrong(t, &case.expected)?,
            None => 0,
        };
        // The slowest rank's time and the wrong elements of all ranks.
        let time_us = scalar_all_reduce(&comm, local_us as f32, ReduceOp::Max)? as f64;
        let wrong = scalar_all_reduce(&comm, wrong_local as f32, ReduceOp::Sum)? as u64;

        let bytes = (count * elem) as u64;
        let algbw = if time_us > 0.0 {
            bytes as f64 / (time_us * 1e-6) / 1e9
        } else {
            0.0
        };
        let row = BenchRow {
            bytes,
            count,
            time_us,
            algbw_gbps: algbw,
            busbw_gbps: algbw * args.op.bus_factor(n),
            wrong,
        };
        if r == 0 {
            println!(
                "  {:>12} {:>12} {:>9} {:>12.1} {:>12.3} {:>12.3} {:>8}",
                row.bytes,
                row.count,
                args.dtype.nccl_name(),
                row.time_us,
                row.algbw_gbps,
                row.busbw_gbps,
                row.wrong
            );
            std::io::stdout().flush()?;
        }
        rows.push(row);
        size = match size.checked_mul(args.step_factor) {
            Some(next) if next > 0 => next,
            _ => break,
        };
    }

    let avg = if rows.is_empty() {
        0.0
    } else {
        rows.iter().map(|r| r.busbw_gbps).sum::<f64>() / rows.len() as f64
    };
    let report = BenchReport {
        op: args.op,
        dtype: args.dtype,
        world_size: n,
        iters: args.iters,
        warmup: args.warmup,
        rows,
        avg_busbw_gbps: avg,
    };
    if r == 0 {
        let total_wrong: u64 = report.rows.iter().map(|r| r.wrong).sum();
        println!(
            "# Out of bounds values : {total_wrong} {}",
            if total_wrong == 0 { "OK" } else { "FAILED" }
        );
        println!("# Avg bus bandwidth    : {:.3} GB/s", report.avg_busbw_gbps);
        if let Some(path) = &args.json {
            let text = serde_json::to_string_pretty(&report)?;
            if path.as_os_str() == "-" {
                println!("{text}");
            } else {
                std::fs::write(path, text + "\n").at("writing", path)?;
            }
        }
        if let Some(path) = &args.fit {
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
                n,
                crate::cost::today()
            );
            let fit = write_fit(path, &report, backend, &command)
                .map_err(|e| BenchError::Fit(e.to_string()))?;
            println!(
                "# fit {} over {} ranks: alpha {:.2} us per step, beta {:.3} GB/s (R^2 {:.4}) -> {}",
                fit.op,
                fit.ranks,
                fit.alpha_s * 1e6,
                fit.beta_bytes_per_s / 1e9,
                fit.r2,
                path.display()
            );
        }
    }
    Ok(report)
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
/// (created with the backend's defaults if missing); `command` records the sweep. Returns the fit.
pub fn write_fit(
    path: &Path,
    report: &BenchReport,
    backend: &str,
    command: &str,
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
    table.save(path)?;
    Ok(fit)
}

fn scalar_all_reduce(comm: &Comm, v: f32, op: ReduceOp) -> Result<f32, BenchError> {
    let t = Tensor::new(&[v], comm.device())?;
    Ok(comm.all_reduce(&t, op)?.to_vec1::<f32>()?[0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("8"), Ok(8));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("256M"), Ok(256 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert!(parse_size("12X").unwrap_err().contains("12X"));
    }

    #[test]
    fn bus_factors_match_nccl_tests() {
        assert_eq!(BenchOp::AllReduce.bus_factor(4), 1.5);
        assert_eq!(BenchOp::AllGather.bus_factor(4), 0.75);
        assert_eq!(BenchOp::ReduceScatter.bus_factor(2), 0.5);
        assert_eq!(BenchOp::AllToAll.bus_factor(8), 0.875);
        assert_eq!(BenchOp::Broadcast.bus_factor(8), 1.0);
        assert_eq!(BenchOp::SendRecv.bus_factor(2), 1.0);
    }

    fn to_vec(t: &Tensor) -> Vec<f32> {
        t.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()
    }

    /// The expected results are the op applied by hand to every rank's input.
    #[test]
    fn expected_results_equal_the_op_simulated_on_all_inputs() {
        let ops = [
            BenchOp::AllReduce,
            BenchOp::AllGather,
            BenchOp::ReduceScatter,
            BenchOp::AllToAll,
            BenchOp::Broadcast,
            BenchOp::SendRecv,
        ];
        for op in ops {
            for n in 1..=4usize {
                let count = 12 * n;
                let cases: Vec<Case> = (0..n)
                    .map(|r| make_case(op, count, n, r, DType::BF16, &Device::Cpu).unwrap())
                    .collect();
                let inputs: Vec<Vec<f32>> = cases.iter().map(|c| to_vec(&c.input)).collect();
                let sum: Vec<f32> = (0..inputs[0].len())
                    .map(|i| inputs.iter().map(|x| x[i]).sum())
                    .collect();
                let m = count / n;
                for (r, case) in cases.iter().enumerate() {
                    let want: Vec<f32> = match op {
                        BenchOp::AllReduce => sum.clone(),
                        BenchOp::AllGather => inputs.concat(),
                        BenchOp::ReduceScatter => sum[r * m..(r + 1) * m].to_vec(),
                        BenchOp::AllToAll => (0..n)
                            .flat_map(|p| inputs[p][r * m..(r + 1) * m].to_vec())
                            .collect(),
                        BenchOp::Broadcast => inputs[0].clone(),
                        BenchOp::SendRecv => inputs[(r + n - 1) % n].clone(),
                    };
                    assert_eq!(case.expected, want, "{op:?} n={n} rank {r}");
                }
            }
        }
    }

    #[test]
    fn wrong_elements_are_counted() {
        let expected = vec![1.0, 2.0, 3.0, 4.0];
        let good = Tensor::new(&[1f32, 2., 3., 4.], &Device::Cpu).unwrap();
        let bad = Tensor::new(&[1f32, 2.5, 3., 0.], &Device::Cpu).unwrap();
        assert_eq!(count_wrong(&good, &expected).unwrap(), 0);
        assert_eq!(count_wrong(&bad, &expected).unwrap(), 2);
        let short = Tensor::new(&[1f32, 2.], &Device::Cpu).unwrap();
        assert_eq!(count_wrong(&short, &expected).unwrap(), 4);
    }

    #[test]
    fn closed_forms_are_exact_in_bf16() {
        // Every value an input or an expected result can take for up to 16 ranks.
        let n = 16usize;
        let max_sum = (n * (n + 1) / 2 + n * 6) as f32;
        for v in [max_sum, 198.0, value(n - 1, 6)] {
            let t = Tensor::new(&[v], &Device::Cpu)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            assert_eq!(
                t.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()[0],
                v
            );
        }
    }
}
