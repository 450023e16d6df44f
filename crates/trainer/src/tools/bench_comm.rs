//! `mtrain bench-comm`: collective bandwidth in the style of nccl-tests, with a correctness check.
//!
//! ```text
//! mtrain --nproc-per-node 4 bench-comm -b 8 -e 256M -f 2 --op all-reduce
//! ```
//!
//! For each message size S (from `-b` to `-e`, times `-f` each step; a sweep from 0 measures 0 and
//! goes on from the smallest message, `sweep_sizes`) every rank runs `-w` warm-up
//! and `-n` timed iterations of the op; the time is the slowest rank's mean (each rank's mean
//! over the timed iterations, then the maximum over ranks; the header says so). As in nccl-tests:
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
//! ranks. A healthy backend prints 0 in every row. nccl-tests' `-d` (element type), `-o`
//! (reduction of all-reduce and reduce-scatter) and `-c 0` (skip the check) are taken too.
//!
//! stdout holds the results only: the table, or with `--json -` the JSON alone (the table then
//! goes to stderr), so `mtrain --nproc-per-node 2 bench-comm --json - | jq` works.
//!
//! The correctness check (the closed forms and the comparison) is `bench_comm/check.rs`; the α-β
//! fit a sweep can be merged into (`--fit`) is `bench_comm/fit.rs`.

mod check;
mod crossover;
mod fit;
pub mod nccl_debug;

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use candle_core::{DType, Tensor};
use clap::{Args, ValueEnum};
use mtrain_comm::{Backend, Comm, CommError, ReduceOp};
use serde::Serialize;

use crate::config::DeviceKind;
use crate::fsio::IoContext;

pub use fit::{op_kind, write_fit};

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

    /// Element type of the messages (nccl-tests' `-d`; `float` and `bfloat16` are accepted too).
    #[arg(short = 'd', long, value_enum, default_value_t = BenchDtype::F32)]
    pub dtype: BenchDtype,

    /// Reduction of all-reduce and reduce-scatter (nccl-tests' `-o`; default sum).
    #[arg(short = 'o', long = "reduce-op", value_enum, value_name = "OP")]
    pub reduce_op: Option<BenchReduce>,

    /// Check every result element by element (1, the default) or not (0), as nccl-tests' `-c`.
    #[arg(short = 'c', long = "check", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1), value_name = "0|1")]
    pub check: u8,

    /// All-reduce in place (`Communicator::all_reduce_in_place`, as `torch.distributed.all_reduce`
    /// and nccl-tests' in-place column): the timed iterations reduce one working copy of the
    /// input over and over; the check runs one more call on a fresh copy, untimed.
    #[arg(long)]
    pub in_place: bool,

    /// Where the messages live: `cpu` (TCP backend) or `cuda` (the backend `--comm` picks:
    /// NCCL with one GPU per rank, CUDA IPC, or staged through the host).
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,

    /// Also write the results as JSON to this file (rank 0; `-` for stdout).
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,

    /// Least-squares fit α (latency per step) and β (bandwidth) of this op and world size to the
    /// sweep and merge them into this α-β table (TOML, e.g. configs/alpha-beta/<machine>.toml),
    /// which `mtrain plan --alpha-beta FILE` reads. For an all-reduce on the CPU backend, also
    /// time each algorithm (ring, tree, rhd) at every size and write the fastest per size as
    /// the table's `auto` rule for this world size, which `--algo auto --algo-table FILE` follows.
    #[arg(long, value_name = "FILE")]
    pub fit: Option<PathBuf>,

    /// A link's peak bandwidth (GB/s): the table shows busbw as a share of it (`%peak`).
    #[arg(long, value_name = "GB/S")]
    pub peak_gbps: Option<f64>,

    /// With --device cuda: set NCCL_DEBUG=INFO and NCCL_DEBUG_SUBSYS=TUNING for the ranks and
    /// print the algorithm and protocol NCCL chose at each size.
    #[arg(long)]
    pub nccl_debug: bool,
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
    #[value(alias = "float")]
    F32,
    #[value(alias = "bfloat16")]
    Bf16,
}

/// Reductions of all-reduce and reduce-scatter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BenchReduce {
    Sum,
    Avg,
    Max,
    Min,
}

impl BenchReduce {
    fn op(self) -> ReduceOp {
        match self {
            BenchReduce::Sum => ReduceOp::Sum,
            BenchReduce::Avg => ReduceOp::Avg,
            BenchReduce::Max => ReduceOp::Max,
            BenchReduce::Min => ReduceOp::Min,
        }
    }

    fn name(self) -> &'static str {
        match self {
            BenchReduce::Sum => "sum",
            BenchReduce::Avg => "avg",
            BenchReduce::Max => "max",
            BenchReduce::Min => "min",
        }
    }
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

    /// Ops that reduce (and take `-o`).
    fn reduces(self) -> bool {
        matches!(self, BenchOp::AllReduce | BenchOp::ReduceScatter)
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
    /// The slowest rank's mean over the timed iterations (µs).
    pub time_us: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
    /// Wrong elements over all ranks; null under `-c 0`.
    pub wrong: Option<u64>,
    /// busbw as a share of `--peak-gbps` (0..1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_share: Option<f64>,
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
    /// The reduction (all-reduce and reduce-scatter only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reduce_op: Option<BenchReduce>,
    /// How `time_us` is taken over ranks: "max over ranks of each rank's mean".
    pub time: &'static str,
    pub world_size: usize,
    pub iters: usize,
    pub warmup: usize,
    /// Whether the op ran in place (`--in-place`).
    pub in_place: bool,
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

/// Run the op once on this rank's input.
fn run_op(comm: &Comm, op: BenchOp, redop: ReduceOp, x: &Tensor) -> Result<Tensor, CommError> {
    let (n, r) = (comm.size(), comm.rank());
    match op {
        BenchOp::AllReduce => comm.all_reduce(x, redop),
        BenchOp::AllGather => comm.all_gather(x),
        BenchOp::ReduceScatter => comm.reduce_scatter(x, redop),
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

/// Run the benchmark over the world group. Every rank returns the same report; rank 0 prints it:
/// the table on stdout, or on stderr when the JSON goes to stdout (`--json -`).
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
    if let Some(p) = args.peak_gbps.filter(|p| !(p.is_finite() && *p > 0.0)) {
        return Err(BenchError::Invalid(format!("--peak-gbps must be a positive number of GB/s, got {p}")));
    }
    if args.nccl_debug && args.device != DeviceKind::Cuda {
        return Err(BenchError::Invalid("--nccl-debug needs --device cuda: it shows what NCCL chose".into()));
    }
    if let (Some(o), false) = (args.reduce_op, args.op.reduces()) {
        return Err(BenchError::Invalid(format!(
            "-o/--reduce-op {} applies to all-reduce and reduce-scatter, not {}",
            o.name(),
            args.op.name()
        )));
    }
    let redop = args.reduce_op.unwrap_or(BenchReduce::Sum);
    let check = args.check == 1;
    let comm = backend.world();
    let (n, r) = (comm.size(), comm.rank());
    if args.in_place && args.op != BenchOp::AllReduce {
        return Err(BenchError::Invalid(format!(
            "--in-place: only all-reduce has an in-place form, not {}",
            args.op.name()
        )));
    }
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
    let tol = check::tolerance(args.op, redop, dtype);

    let json_to_stdout = args.json.as_deref().is_some_and(|p| p.as_os_str() == "-");
    // The human-readable table: stdout, unless stdout carries the JSON.
    let mut table: Box<dyn Write> = if json_to_stdout {
        Box::new(std::io::stderr())
    } else {
        Box::new(std::io::stdout())
    };
    if r == 0 {
        let reduction = match args.op.reduces() {
            true => format!(" ({})", redop.name()),
            false => String::new(),
        };
        writeln!(
            table,
            "# mtrain bench-comm: {}{reduction}{}, {n} ranks, {}, {} warm-up + {} timed iterations per size",
            args.op.name(),
            if args.in_place { ", in place" } else { "" },
            args.dtype.nccl_name(),
            args.warmup,
            args.iters
        )?;
        writeln!(
            table,
            "# time: {} ({} timed iterations); #wrong: {}",
            TIME_OVER_RANKS,
            args.iters,
            if check {
                "elements differing from the closed form, over all ranks"
            } else {
                "not checked (-c 0)"
            }
        )?;
        if let Some(p) = args.peak_gbps {
            writeln!(table, "# %peak: busbw as a share of the link's peak, {p} GB/s")?;
        }
        writeln!(
            table,
            "# {:>12} {:>12} {:>9} {:>12} {:>12} {:>12} {:>8}{}",
            "size(B)", "count", "type", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong",
            if args.peak_gbps.is_some() { "    %peak" } else { "" }
        )?;
        table.flush()?;
    }

    let smallest = smallest_message(args.op, elem, n);
    if r == 0 && args.min_bytes < smallest {
        writeln!(
            table,
            "# -b {}: {}the sizes go on from {smallest} B, the smallest {} message of {} over {n} ranks",
            args.min_bytes,
            if args.min_bytes == 0 { "0 B measured, then " } else { "less than one element per rank, so " },
            args.op.name(),
            args.dtype.nccl_name(),
        )?;
    }
    let mut rows = Vec::new();
    let sizes = sweep_sizes(args.min_bytes, args.max_bytes, args.step_factor, smallest);
    for &size in &sizes {
        let mut count = (size as usize) / elem;
        if args.op.splits_by_rank() {
            count -= count % n;
        }
        let case = check::make_case(args.op, redop, count, n, r, dtype, &device)?;
        let work = match args.in_place {
            true => Some(case.input.copy()?),
            false => None,
        };
        let once = |result: &mut Option<Tensor>| -> Result<(), BenchError> {
            match &work {
                Some(w) => comm.all_reduce_in_place(w, redop.op())?,
                None => *result = Some(run_op(&comm, args.op, redop.op(), &case.input)?),
            }
            Ok(())
        };
        let mut result = None;
        for _ in 0..args.warmup {
            once(&mut result)?;
        }
        comm.barrier()?;
        let start = Instant::now();
        for _ in 0..args.iters {
            once(&mut result)?;
        }
        // On a GPU an op returns once it is queued on the stream; the barrier returns only after
        // the group's earlier ops have finished, so the clock stops when the bytes have moved.
        comm.barrier()?;
        let local_us = start.elapsed().as_secs_f64() * 1e6 / args.iters as f64;
        if args.in_place && check {
            // The working copy has been reduced many times over: check one call on a fresh one.
            let fresh = case.input.copy()?;
            comm.all_reduce_in_place(&fresh, redop.op())?;
            result = Some(fresh);
        }
        // The slowest rank's time and the wrong elements of all ranks.
        let time_us = scalar_all_reduce(&comm, local_us as f32, ReduceOp::Max)? as f64;
        let wrong = match (&result, check) {
            (Some(t), true) => {
                let local = check::count_wrong(t, &case.expected, tol)?;
                Some(scalar_all_reduce(&comm, local as f32, ReduceOp::Sum)? as u64)
            }
            (None, true) => Some(0),
            (_, false) => None,
        };

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
            peak_share: args.peak_gbps.map(|p| algbw * args.op.bus_factor(n) / p),
        };
        if r == 0 {
            write!(
                table,
                "  {:>12} {:>12} {:>9} {:>12.1} {:>12.3} {:>12.3} {:>8}",
                row.bytes,
                row.count,
                args.dtype.nccl_name(),
                row.time_us,
                row.algbw_gbps,
                row.busbw_gbps,
                row.wrong
                    .map_or_else(|| "N/A".to_string(), |w| w.to_string())
            )?;
            if let Some(share) = row.peak_share {
                write!(table, " {:>8.1}%", share * 100.0)?;
            }
            writeln!(table)?;
            table.flush()?;
        }
        rows.push(row);
    }

    let avg = if rows.is_empty() {
        0.0
    } else {
        rows.iter().map(|r| r.busbw_gbps).sum::<f64>() / rows.len() as f64
    };
    let report = BenchReport {
        op: args.op,
        dtype: args.dtype,
        reduce_op: args.op.reduces().then_some(redop),
        time: TIME_OVER_RANKS,
        world_size: n,
        iters: args.iters,
        warmup: args.warmup,
        in_place: args.in_place,
        rows,
        avg_busbw_gbps: avg,
    };
    let crossover = match (&args.fit, args.op, n > 1) {
        (Some(_), BenchOp::AllReduce, true) => crossover::measure(backend, args, &sizes)?,
        _ => None,
    };
    if r == 0 {
        if args.nccl_debug {
            let path = nccl_debug::log_path(std::process::id());
            let log = std::fs::read_to_string(&path).unwrap_or_default();
            writeln!(table, "# NCCL's choice per size (rank 0's log {}):", path.display())?;
            let choices = nccl_debug::choices(&log);
            if choices.is_empty() {
                let why = if n == 1 {
                    "a group of one rank runs no algorithm; run with 2 or more ranks"
                } else {
                    "no tuning line in the log; this NCCL may log its choice in another form"
                };
                writeln!(table, "#   none logged: {why}")?;
            }
            for (bytes, (algo, proto)) in choices {
                writeln!(table, "#   {bytes:>12} B: algorithm {algo}, protocol {proto}")?;
            }
        }
        if check {
            let total_wrong: u64 = report.rows.iter().filter_map(|r| r.wrong).sum();
            writeln!(
                table,
                "# Out of bounds values : {total_wrong} {}",
                if total_wrong == 0 { "OK" } else { "FAILED" }
            )?;
        } else {
            writeln!(table, "# Out of bounds values : not checked (-c 0)")?;
        }
        writeln!(
            table,
            "# Avg bus bandwidth    : {:.3} GB/s",
            report.avg_busbw_gbps
        )?;
        table.flush()?;
        if let Some(path) = &args.json {
            let text = serde_json::to_string_pretty(&report)?;
            if json_to_stdout {
                let mut out = std::io::stdout().lock();
                writeln!(out, "{text}")?;
                out.flush()?;
            } else {
                std::fs::write(path, text + "\n").at("writing", path)?;
            }
        }
        if let Some(path) = &args.fit {
            if let Some(c) = &crossover {
                c.print(&mut table)?;
            }
            let rule = crossover.as_ref().map(|c| c.rule());
            fit::record(path, args, &report, rule, &mut table)?;
        }
    }
    Ok(report)
}

/// The smallest non-empty message of `op`: one element, or one element per rank for the ops that
/// split their buffer by rank.
fn smallest_message(op: BenchOp, elem: usize, n: usize) -> u64 {
    (elem * if op.splits_by_rank() { n } else { 1 }) as u64
}

/// The sizes a sweep measures, as nccl-tests' `-b`, `-e`, `-f`: from `min` up to `max`, times
/// `factor` (≥ 2) each step. 0 is measured once and the sweep goes on from `smallest` (0 · f would
/// stay 0); a non-zero `min` below `smallest` (no element on some rank) starts at `smallest`.
///
/// ```text
///   -b 0 -e 64, f32 all-reduce:     0, 4, 8, 16, 32, 64
///   -b 0 -e 64, f32 all-gather, n 2: 0, 8, 16, 32, 64
/// ```
fn sweep_sizes(min: u64, max: u64, factor: u64, smallest: u64) -> Vec<u64> {
    let mut sizes = Vec::new();
    let mut size = min;
    if size == 0 {
        sizes.push(0);
        size = smallest;
    }
    size = size.max(smallest);
    while size <= max {
        sizes.push(size);
        size = match size.checked_mul(factor) {
            Some(next) => next,
            None => break,
        };
    }
    sizes
}

/// How the time column is taken over ranks (the header and the JSON say it).
pub const TIME_OVER_RANKS: &str = "max over ranks of each rank's mean";

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
    fn a_sweep_from_zero_goes_on_from_the_smallest_message() {
        assert_eq!(sweep_sizes(0, 64, 2, 4), [0, 4, 8, 16, 32, 64]);
        assert_eq!(sweep_sizes(0, 64, 2, 8), [0, 8, 16, 32, 64]);
        assert_eq!(sweep_sizes(0, 0, 2, 4), [0]);
        assert_eq!(sweep_sizes(0, 3, 2, 4), [0]);
        assert_eq!(sweep_sizes(1, 64, 4, 4), [4, 16, 64]);
        assert_eq!(sweep_sizes(8, 8, 2, 4), [8]);
        assert_eq!(sweep_sizes(1 << 63, u64::MAX, 2, 4), [1 << 63]);
        assert_eq!(smallest_message(BenchOp::AllReduce, 4, 2), 4);
        assert_eq!(smallest_message(BenchOp::AllGather, 4, 2), 8);
        assert_eq!(smallest_message(BenchOp::AllToAll, 2, 8), 16);
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
}
