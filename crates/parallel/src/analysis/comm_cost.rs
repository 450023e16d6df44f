//! Communication cost model: every collective a layout issues in one optimizer step, the bytes
//! each rank sends for it, and how long the α-β model says it takes.
//!
//! The α-β (latency-bandwidth, "Hockney") model prices one step of an algorithm at
//! `α + bytes / β`: α is the fixed cost of a message (software, synchronisation, the wire's
//! latency), β the bandwidth a link sustains. A collective is a known number of steps:
//!
//! ```text
//!   op               steps        bytes per step      time                       rank sends
//!   all_reduce       2(n-1)       S/n                 2(n-1)·α + 2(n-1)/n·S/β    2(n-1)/n·S
//!   all_gather       n-1          S_out/n             (n-1)·α + (n-1)/n·S_out/β  (n-1)/n·S_out
//!   reduce_scatter   n-1          S_in/n              (n-1)·α + (n-1)/n·S_in/β   (n-1)/n·S_in
//!   all_to_all       n-1          S/n                 (n-1)·α + (n-1)/n·S/β      (n-1)/n·S
//!   broadcast/reduce ⌈log2 n⌉     S  (binomial tree)  ⌈log2 n⌉·(α + S/β)         S per child
//!   send / recv      1            S                   α + S/β                    S
//! ```
//!
//! A collective is **latency-bound** when its α term is larger than its β term and
//! **bandwidth-bound** otherwise. With the NVLink-class defaults (α = 5 µs, β = 300 GB/s), for
//! hidden 8192 on 8 ranks in bf16 a decode step's tensor-parallel all-reduce (one token, 16 KB)
//! costs 70 µs of latency and 0.05 µs of transfer; a prefill of 8192 tokens (128 MiB) costs the
//! same 70 µs of latency and 780 µs of transfer.
//!
//! [`step_collectives`] (`comm_cost/step.rs`) walks one optimizer step of a
//! [`crate::plan::ParallelPlan`] the way the code runs it (the pipeline schedule's actions, each segment's tensor-, sequence- and expert-parallel
//! collectives in forward, recompute and backward, ZeRO's gathers and reduce-scatters as its
//! scheduler issues them, the data-parallel reduction, the tied-embedding and sequence-parallel
//! fix-ups, the loss and norm all-reduces) and counts the payload each rank sends exactly as the
//! CPU backend does (ring chunks from `chunk_range`, half-precision partial sums travelling as
//! f32, tree children, direct all-to-all rows). The only estimate is the token all-to-all of an
//! MoE layer, whose size depends on the routing: it assumes balanced routing (k·N/E tokens per
//! expert, capped by the capacity), an upper bound when the capacity factor is 1.
//!
//! Legend: `n` group size, `S` bytes of a rank's input, `B` batch, `T` sequence, `C` width,
//! `M` micro-batches, `N` tokens of a micro-batch, `E` experts.

mod algorithms;
mod moe;
mod step;
mod tp;

use std::fmt::Write as _;

use candle_core::DType;
use mtrain_comm::{chunk_range, MeshDims, OpKind};

pub use algorithms::{all_reduce_time, default_auto_rule, fastest_all_reduce};
pub use step::step_collectives;

/// Errors of the cost model.
#[derive(Debug, thiserror::Error)]
pub enum CostError {
    #[error("cost model: {0}")]
    Plan(String),
}

pub type Result<T> = std::result::Result<T, CostError>;

/// α-β parameters of one backend (and group size, when fitted).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CostModel {
    /// Seconds per message (one algorithm step).
    pub alpha_s: f64,
    /// Bytes per second one rank sustains in one step.
    pub beta_bytes_per_s: f64,
}

impl CostModel {
    /// Default for the CPU backend on loopback TCP (one host): the order of magnitude
    /// `bench-comm --fit` measures on a small machine (about 100 µs per step through the
    /// communication thread, about 1 GB/s per TCP stream); fit your own for real estimates.
    pub const CPU_LOOPBACK_DEFAULT: CostModel = CostModel {
        alpha_s: 100e-6,
        beta_bytes_per_s: 1e9,
    };
    /// Default for NVLink-class GPUs under NCCL (H100/H200 within one node): a few µs per step,
    /// a few hundred GB/s per rank.
    pub const NVLINK_DEFAULT: CostModel = CostModel {
        alpha_s: 5e-6,
        beta_bytes_per_s: 300e9,
    };

    /// Predicted time of one `op` over `n` ranks whose input is `bytes` (for an all-gather: the
    /// rank's shard; the output is n times larger).
    pub fn time(&self, op: OpKind, n: usize, bytes: u64) -> OpTime {
        let (steps, step_bytes) = algorithm_steps(op, n, bytes as f64);
        OpTime {
            latency_s: steps as f64 * self.alpha_s,
            bandwidth_s: steps as f64 * step_bytes / self.beta_bytes_per_s,
        }
    }
}

/// The two terms of a predicted time.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct OpTime {
    /// Σ α over the algorithm's steps.
    pub latency_s: f64,
    /// Σ bytes / β over the algorithm's steps.
    pub bandwidth_s: f64,
}

impl OpTime {
    pub fn total_s(&self) -> f64 {
        self.latency_s + self.bandwidth_s
    }

    /// Which term dominates.
    pub fn bound(&self) -> Bound {
        if self.latency_s >= self.bandwidth_s {
            Bound::Latency
        } else {
            Bound::Bandwidth
        }
    }
}

/// Whether α or bytes/β dominates a collective's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    Latency,
    Bandwidth,
}

impl std::fmt::Display for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Bound::Latency => "latency",
            Bound::Bandwidth => "bandwidth",
        })
    }
}

/// (number of steps, bytes per step) of the algorithm the backends run for `op`.
pub fn algorithm_steps(op: OpKind, n: usize, bytes: f64) -> (usize, f64) {
    if n <= 1 {
        return (0, 0.0);
    }
    let nf = n as f64;
    let tree_depth = usize::BITS as usize - (n - 1).leading_zeros() as usize; // ⌈log2 n⌉
    match op {
        OpKind::AllReduce => (2 * (n - 1), bytes / nf),
        OpKind::ReduceScatter => (n - 1, bytes / nf),
        // The input is this rank's shard: each step moves one shard.
        OpKind::AllGather => (n - 1, bytes),
        OpKind::AllToAll => (n - 1, bytes / nf),
        OpKind::Broadcast | OpKind::Reduce => (tree_depth, bytes),
        OpKind::Scatter | OpKind::Gather => (n - 1, bytes / nf),
        OpKind::Send | OpKind::Recv => (1, bytes),
        OpKind::Barrier => (1, 0.0),
    }
}

// ---------------------------------------------------------------------------------------------
// Exact payload bytes of the CPU backend
// ---------------------------------------------------------------------------------------------

/// Bytes per element of the partial sums a CPU-backend reduction sends (f32 for 16-bit floats).
pub fn accumulation_size(dtype: DType) -> usize {
    match dtype {
        DType::BF16 | DType::F16 => 4,
        d => d.size_in_bytes(),
    }
}

/// Payload rank `r` of `n` sends in a ring reduce-scatter of `elems` elements cut into `rows`
/// rows: every chunk but its own, in the accumulation type.
pub fn ring_reduce_scatter_sent(
    rows: usize,
    row_elems: usize,
    n: usize,
    r: usize,
    acc: usize,
) -> u64 {
    if n <= 1 {
        return 0;
    }
    ((rows - chunk_range(rows, n, r).len()) * row_elems * acc) as u64
}

/// Payload rank `r` of `n` sends in a ring all-gather whose chunks have `chunk_bytes[i]` bytes:
/// its own first, then each chunk it receives except the last one to arrive, its right
/// neighbour's (rank r+1's).
pub fn ring_all_gather_sent(chunk_bytes: &[u64], r: usize) -> u64 {
    let n = chunk_bytes.len();
    if n <= 1 {
        return 0;
    }
    let total: u64 = chunk_bytes.iter().sum();
    total - chunk_bytes[(r + 1) % n]
}

/// Payload of a ring all-reduce of `numel` elements of `dtype` from rank `r` of `n`:
/// reduce-scatter in the accumulation type, all-gather in the tensor's own.
pub fn all_reduce_sent(numel: usize, dtype: DType, n: usize, r: usize) -> u64 {
    if n <= 1 {
        return 0;
    }
    let es = dtype.size_in_bytes() as u64;
    let chunks: Vec<u64> = (0..n)
        .map(|i| chunk_range(numel, n, i).len() as u64 * es)
        .collect();
    ring_reduce_scatter_sent(numel, 1, n, r, accumulation_size(dtype))
        + ring_all_gather_sent(&chunks, r)
}

/// Payload of a binomial-tree broadcast from `root` sent by rank `r`: one copy per child.
pub fn broadcast_sent(bytes: u64, n: usize, r: usize, root: usize) -> u64 {
    if n <= 1 {
        return 0;
    }
    let v = (r + n - root) % n;
    // Children are v + m for every power of two m below v's lowest set bit (below n for the
    // root) that stays inside the group.
    let lowest = if v == 0 {
        n.next_power_of_two()
    } else {
        v & v.wrapping_neg()
    };
    let children = (0..usize::BITS)
        .map(|b| 1usize << b)
        .take_while(|&m| m < lowest)
        .filter(|&m| v + m < n)
        .count();
    bytes * children as u64
}

// ---------------------------------------------------------------------------------------------
// What one step issues
// ---------------------------------------------------------------------------------------------

/// The process groups of a mesh, named as in traces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Group {
    Tp,
    /// Context parallelism's ring: the ranks that split each sequence.
    Cp,
    Pp,
    Dp,
    /// dp × cp: the ranks that hold the same parameters, over which gradients and losses are
    /// averaged under context parallelism (the dp group's role when cp > 1).
    Dcp,
    Ep,
    Edp,
    World,
}

impl Group {
    /// Every group, in the mesh's order.
    pub const ALL: [Group; 8] = [
        Group::Tp,
        Group::Cp,
        Group::Pp,
        Group::Dp,
        Group::Dcp,
        Group::Ep,
        Group::Edp,
        Group::World,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Group::Tp => "tp",
            Group::Cp => "cp",
            Group::Pp => "pp",
            Group::Dp => "dp",
            Group::Dcp => "dcp",
            Group::Ep => "ep",
            Group::Edp => "edp",
            Group::World => "world",
        }
    }

    /// The group's size under `dims`.
    pub fn size(self, dims: MeshDims) -> usize {
        match self {
            Group::Tp => dims.tp,
            Group::Cp => dims.cp,
            Group::Pp => dims.pp,
            Group::Dp => dims.dp,
            Group::Dcp => dims.dp * dims.cp,
            Group::Ep => dims.ep,
            Group::Edp => dims.dp / dims.ep.max(1),
            Group::World => dims.world_size(),
        }
    }
}

/// What the cp ring's passes carry (`Collective::what`): this rank's K, V around the ring;
/// the dK, dV accumulators behind them in the backward; the last accumulator pass home.
pub const RING_KV: &str = "K, V around the ring";
pub const RING_DKV: &str = "dK, dV accumulators";
pub const RING_HOME: &str = "dK, dV home (last pass)";

/// When in the step a collective runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Forward,
    /// Inside the backward (recompute included).
    Backward,
    /// After the last backward: gradient reduction, fix-ups, loss, norm, ZeRO write-back.
    Step,
}

/// One kind of collective a rank issues in a step, `count` times.
#[derive(Debug, Clone, PartialEq)]
pub struct Collective {
    pub group: Group,
    pub op: OpKind,
    /// What it carries (`tp: block output (g)`, `dp: gradient`, ...).
    pub what: &'static str,
    pub phase: Phase,
    /// Size of this rank's input in bytes (what a trace event's `bytes` says).
    pub bytes: u64,
    /// Payload this rank sends per op, as the CPU backend counts it (`bytes_sent`).
    pub bytes_sent: u64,
    pub count: usize,
    /// The runtime can overlap it with compute (DDP buckets, ZeRO prefetch and reduce-scatter,
    /// pipeline sends).
    pub overlappable: bool,
    /// Its size depends on the data (MoE token routing): a balanced-routing estimate.
    pub estimate: bool,
}

/// The step being priced: global batch of one step (sequences), sequence length, activation
/// dtype.
#[derive(Debug, Clone, Copy)]
pub struct StepShape {
    pub batch: usize,
    pub seq_len: usize,
    pub dtype: DType,
}

/// Collects collectives, merging identical ones into counts.
struct Tally {
    dims: MeshDims,
    rank: usize,
    items: Vec<Collective>,
}

impl Tally {
    fn my_index(&self, g: Group) -> usize {
        let c = self.dims.coords(self.rank);
        match g {
            Group::Tp => c.tp,
            Group::Cp => c.cp,
            Group::Pp => c.pp,
            Group::Dp => c.dp,
            Group::Dcp => c.dp * self.dims.cp + c.cp,
            Group::Ep => c.ep,
            Group::Edp => c.edp,
            Group::World => self.rank,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        group: Group,
        op: OpKind,
        what: &'static str,
        phase: Phase,
        bytes: u64,
        sent: u64,
        overlappable: bool,
        estimate: bool,
    ) {
        if group.size(self.dims) <= 1 {
            return;
        }
        if let Some(c) = self.items.iter_mut().find(|c| {
            (c.group, c.op, c.what, c.phase, c.bytes, c.bytes_sent, c.overlappable)
                == (group, op, what, phase, bytes, sent, overlappable)
        }) {
            c.count += 1;
            return;
        }
        self.items.push(Collective {
            group,
            op,
            what,
            phase,
            bytes,
            bytes_sent: sent,
            count: 1,
            overlappable,
            estimate,
        });
    }

    fn all_reduce(
        &mut self,
        g: Group,
        what: &'static str,
        phase: Phase,
        numel: usize,
        dtype: DType,
        overlap: bool,
    ) {
        let (n, r) = (g.size(self.dims), self.my_index(g));
        let sent = all_reduce_sent(numel, dtype, n, r);
        self.push(
            g,
            OpKind::AllReduce,
            what,
            phase,
            (numel * dtype.size_in_bytes()) as u64,
            sent,
            overlap,
            false,
        );
    }

    /// Reduce-scatter of `rows` rows of `row_elems` elements (dim 0 after any transpose).
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &mut self,
        g: Group,
        what: &'static str,
        phase: Phase,
        rows: usize,
        row_elems: usize,
        dtype: DType,
        overlap: bool,
    ) {
        let (n, r) = (g.size(self.dims), self.my_index(g));
        let sent = ring_reduce_scatter_sent(rows, row_elems, n, r, accumulation_size(dtype));
        self.push(
            g,
            OpKind::ReduceScatter,
            what,
            phase,
            (rows * row_elems * dtype.size_in_bytes()) as u64,
            sent,
            overlap,
            false,
        );
    }

    /// All-gather where rank i contributes `chunk_range(rows, n, i)` rows of `row_elems`.
    #[allow(clippy::too_many_arguments)]
    fn all_gather(
        &mut self,
        g: Group,
        what: &'static str,
        phase: Phase,
        rows: usize,
        row_elems: usize,
        dtype: DType,
        overlap: bool,
    ) {
        let (n, r) = (g.size(self.dims), self.my_index(g));
        let es = dtype.size_in_bytes();
        let chunks: Vec<u64> = (0..n)
            .map(|i| (chunk_range(rows, n, i).len() * row_elems * es) as u64)
            .collect();
        let mine = chunks.get(r).copied().unwrap_or(0);
        self.push(
            g,
            OpKind::AllGather,
            what,
            phase,
            mine,
            ring_all_gather_sent(&chunks, r),
            overlap,
            false,
        );
    }
}

/// Totals of a rank's step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepTotals {
    pub collectives: usize,
    pub bytes_sent: u64,
    pub time: OpTime,
    /// Of `time`, what the runtime can overlap with compute.
    pub overlappable_s: f64,
}

/// Sums `items` priced with `model` (each over its own group's size under `dims`).
pub fn totals(
    items: &[Collective],
    dims: MeshDims,
    model: &dyn Fn(Group, OpKind, usize) -> CostModel,
) -> StepTotals {
    let mut s = StepTotals::default();
    for c in items {
        let n = c.group.size(dims);
        let t = model(c.group, c.op, n).time(c.op, n, c.bytes);
        s.collectives += c.count;
        s.bytes_sent += c.bytes_sent * c.count as u64;
        s.time.latency_s += t.latency_s * c.count as f64;
        s.time.bandwidth_s += t.bandwidth_s * c.count as f64;
        if c.overlappable {
            s.overlappable_s += t.total_s() * c.count as f64;
        }
    }
    s
}

/// Human-readable size: B, KiB, MiB, GiB.
pub fn human_bytes(b: u64) -> String {
    let f = b as f64;
    match b {
        0..=1023 => format!("{b} B"),
        1024..=1_048_575 => format!("{:.1} KiB", f / 1024.0),
        1_048_576..=1_073_741_823 => format!("{:.1} MiB", f / 1_048_576.0),
        _ => format!("{:.2} GiB", f / 1_073_741_824.0),
    }
}

/// Human-readable duration.
pub fn human_time(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.1} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

/// The table `mtrain plan` prints for one rank: per group, every collective with its size,
/// count, bytes sent, predicted time and bound; then the rank's totals and what can overlap.
pub fn render(
    items: &[Collective],
    dims: MeshDims,
    model: &dyn Fn(Group, OpKind, usize) -> CostModel,
) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<8} {:<15} {:<36} {:>10} {:>6} {:>12} {:>11}  bound",
        "group", "op", "what", "size", "count", "sent/rank", "time"
    );
    let mut sorted: Vec<&Collective> = items.iter().collect();
    sorted.sort_by_key(|c| (c.group, c.phase));
    for c in sorted {
        let n = c.group.size(dims);
        let t = model(c.group, c.op, n).time(c.op, n, c.bytes);
        let _ = writeln!(
            s,
            "{:<8} {:<15} {:<36} {:>10} {:>6} {:>12} {:>11}  {}{}",
            format!("{}({n})", c.group.name()),
            c.op.to_string(),
            format!(
                "{} [{}]",
                c.what,
                match c.phase {
                    Phase::Forward => "fwd",
                    Phase::Backward => "bwd",
                    Phase::Step => "step",
                }
            ),
            human_bytes(c.bytes),
            c.count,
            human_bytes(c.bytes_sent * c.count as u64),
            human_time(t.total_s() * c.count as f64),
            t.bound(),
            if c.estimate {
                " (balanced-routing estimate)"
            } else {
                ""
            }
        );
    }
    let tot = totals(items, dims, model);
    let _ = writeln!(
        s,
        "total: {} collectives, {} sent, {} predicted ({} latency, {} bandwidth); {} can overlap compute",
        tot.collectives,
        human_bytes(tot.bytes_sent),
        human_time(tot.time.total_s()),
        human_time(tot.time.latency_s),
        human_time(tot.time.bandwidth_s),
        human_time(tot.overlappable_s)
    );
    s
}
