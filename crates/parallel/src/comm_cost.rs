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
//! [`step_collectives`] walks one optimizer step of a [`ParallelPlan`] the way the code runs it
//! (the pipeline schedule's actions, each segment's tensor-, sequence- and expert-parallel
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

use std::collections::BTreeMap;
use std::fmt::Write as _;

use candle_core::DType;
use mtrain_comm::{chunk_range, MeshDims, OpKind};
use mtrain_model::init::param_specs;
use mtrain_model::moe::capacity;
use mtrain_model::GptConfig;

use crate::fsdp::ZeroStage;
use crate::pipeline::{Action, Schedule};
use crate::placement::{
    block_of, ep_rank_of_expert, expert_of, is_expert_param, sp_partial, tp_placement,
};
use crate::plan::{DataParallelKind, ParallelPlan};

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
    Pp,
    Dp,
    Ep,
    Edp,
    World,
}

impl Group {
    pub fn name(self) -> &'static str {
        match self {
            Group::Tp => "tp",
            Group::Pp => "pp",
            Group::Dp => "dp",
            Group::Ep => "ep",
            Group::Edp => "edp",
            Group::World => "world",
        }
    }

    /// The group's size under `dims`.
    pub fn size(self, dims: MeshDims) -> usize {
        match self {
            Group::Tp => dims.tp,
            Group::Pp => dims.pp,
            Group::Dp => dims.dp,
            Group::Ep => dims.ep,
            Group::Edp => dims.dp / dims.ep.max(1),
            Group::World => dims.world_size(),
        }
    }
}

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
            Group::Pp => c.pp,
            Group::Dp => c.dp,
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
            (c.group, c.op, c.what, c.phase, c.bytes, c.bytes_sent)
                == (group, op, what, phase, bytes, sent)
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

/// The per-parameter facts the enumeration needs: local element count on a rank.
struct ParamInfo {
    name: String,
    numel: usize,
}

/// Parameters of model segment `seg` (0 = embedding, 1..=L blocks, L+1 head) as held on a rank
/// of tp size `tp`, ep size `ep`, in the order the segment lists them.
fn segment_params(
    cfg: &GptConfig,
    seg: usize,
    tp: usize,
    ep: usize,
    ep_idx: usize,
) -> Vec<ParamInfo> {
    let l = cfg.n_layer;
    let specs = param_specs(cfg);
    let numel_of = |name: &str| {
        specs
            .iter()
            .find(|s| s.0 == name)
            .map_or(0, |s| s.1.iter().product::<usize>())
    };
    let local = |name: &str| tp_placement(name, false).local_numel(numel_of(name), tp);
    let mut names: Vec<String> = Vec::new();
    if seg == 0 {
        names = vec!["wte.weight".into(), "wpe.weight".into()];
    } else if seg == l + 1 {
        names = vec![
            "ln_f.weight".into(),
            "ln_f.bias".into(),
            "wte.weight".into(),
        ];
    } else {
        let n_experts = cfg.moe.as_ref().map_or(0, |m| m.n_experts);
        for (name, _, _) in &specs {
            if block_of(name) != Some(seg - 1) {
                continue;
            }
            match expert_of(name) {
                Some(e) if ep > 1 && ep_rank_of_expert(e, n_experts, ep) != ep_idx => continue,
                _ => names.push(name.clone()),
            }
        }
    }
    names
        .into_iter()
        .map(|n| ParamInfo {
            numel: local(&n),
            name: n,
        })
        .collect()
}

/// Every collective `rank` issues in one optimizer step of `plan` (one `forward_backward` with
/// sync, then `optimizer_step`), merged by kind and size. Groups of one rank issue nothing.
pub fn step_collectives(
    cfg: &GptConfig,
    plan: &ParallelPlan,
    shape: StepShape,
    rank: usize,
) -> Result<Vec<Collective>> {
    let dims = plan.dims;
    let world = dims.world_size();
    plan.validate(cfg, world, shape.batch)
        .map_err(|e| CostError::Plan(e.to_string()))?;
    if rank >= world {
        return Err(CostError::Plan(format!(
            "rank {rank} is not in a world of {world}"
        )));
    }
    let c = dims.coords(rank);
    let (tp, pp, dp, ep) = (dims.tp, dims.pp, dims.dp, dims.ep);
    let sp = plan.sequence_parallel && tp > 1;
    let (t, ch) = (shape.seq_len, cfg.n_embd);
    let b = shape.batch / dp / plan.microbatches; // sequences per micro-batch
    let t_loc = if sp {
        chunk_range(t, tp, c.tp).len()
    } else {
        t
    };
    let act = shape.dtype;
    let f32_ = DType::F32;
    let kind = plan.effective_schedule();
    let v = kind.virtual_stages();
    let n_stages = plan.num_stages();
    let layout = plan
        .stage_layout(cfg.n_layer)
        .map_err(|e| CostError::Plan(e.to_string()))?;
    let sched =
        Schedule::new(kind, pp, plan.microbatches).map_err(|e| CostError::Plan(e.to_string()))?;
    let mut tally = Tally {
        dims,
        rank,
        items: Vec::new(),
    };
    let l = cfg.n_layer;
    let moe = cfg.moe.clone();

    // One segment's forward collectives (also run again by the recompute in backward).
    let seg_forward = |tally: &mut Tally, seg: usize, phase: Phase| {
        if tp > 1 {
            if seg == 0 {
                match sp {
                    true => tally.reduce_scatter(
                        Group::Tp,
                        "embedding sum (SP)",
                        phase,
                        t,
                        b * ch,
                        act,
                        false,
                    ),
                    false => tally.all_reduce(
                        Group::Tp,
                        "embedding sum (g)",
                        phase,
                        b * t * ch,
                        act,
                        false,
                    ),
                }
            } else if seg == l + 1 {
                if sp {
                    tally.all_gather(Group::Tp, "head input (SP)", phase, t, b * ch, act, false);
                }
                // Vocab-parallel cross-entropy: max, Σ exp, target logit over (N, 1), f32.
                for _ in 0..3 {
                    tally.all_reduce(Group::Tp, "vocab-parallel loss", phase, b * t, f32_, false);
                }
            } else {
                for _ in 0..2 {
                    match sp {
                        true => {
                            tally.all_gather(
                                Group::Tp,
                                "block input (SP)",
                                phase,
                                t,
                                b * ch,
                                act,
                                false,
                            );
                            tally.reduce_scatter(
                                Group::Tp,
                                "block output (SP)",
                                phase,
                                t,
                                b * ch,
                                act,
                                false,
                            );
                        }
                        false => tally.all_reduce(
                            Group::Tp,
                            "block output (g)",
                            phase,
                            b * t * ch,
                            act,
                            false,
                        ),
                    }
                }
            }
        }
        if let (Some(m), true) = (&moe, ep > 1 && seg >= 1 && seg <= l) {
            let el = m.n_experts / ep;
            tally.push(
                Group::Ep,
                OpKind::AllToAll,
                "expert counts",
                phase,
                (m.n_experts * 4) as u64,
                ((ep - 1) * el * 4) as u64,
                false,
                false,
            );
            for what in ["expert dispatch", "expert combine"] {
                let (rows, sent) = balanced_rows(m, b * t_loc, ep);
                let row = (ch * act.size_in_bytes()) as u64;
                tally.push(
                    Group::Ep,
                    OpKind::AllToAll,
                    what,
                    phase,
                    rows * row,
                    sent * row,
                    false,
                    true,
                );
            }
        }
    };
    let seg_backward = |tally: &mut Tally, seg: usize| {
        let phase = Phase::Backward;
        if tp > 1 {
            if seg == 0 {
                if sp {
                    tally.all_gather(
                        Group::Tp,
                        "embedding sum (SP)",
                        phase,
                        t,
                        b * ch,
                        act,
                        false,
                    );
                }
            } else if seg == l + 1 {
                match sp {
                    true => tally.reduce_scatter(
                        Group::Tp,
                        "head input (SP)",
                        phase,
                        t,
                        b * ch,
                        act,
                        false,
                    ),
                    false => {
                        tally.all_reduce(Group::Tp, "head input (f)", phase, b * t * ch, act, false)
                    }
                }
            } else {
                for _ in 0..2 {
                    match sp {
                        true => {
                            tally.reduce_scatter(
                                Group::Tp,
                                "block input (SP)",
                                phase,
                                t,
                                b * ch,
                                act,
                                false,
                            );
                            tally.all_gather(
                                Group::Tp,
                                "block output (SP)",
                                phase,
                                t,
                                b * ch,
                                act,
                                false,
                            );
                        }
                        false => tally.all_reduce(
                            Group::Tp,
                            "block input (f)",
                            phase,
                            b * t * ch,
                            act,
                            false,
                        ),
                    }
                }
            }
        }
        if let (Some(m), true) = (&moe, ep > 1 && seg >= 1 && seg <= l) {
            for what in ["expert combine", "expert dispatch"] {
                let (rows, sent) = balanced_rows(m, b * t_loc, ep);
                let row = (ch * act.size_in_bytes()) as u64;
                tally.push(
                    Group::Ep,
                    OpKind::AllToAll,
                    what,
                    phase,
                    rows * row,
                    sent * row,
                    false,
                    true,
                );
            }
        }
    };

    // ZeRO units: one per segment of each chunk, holding the params first used there.
    let chunks: Vec<usize> = (0..v).map(|k| sched.model_stage(c.pp, k)).collect();
    let units: Vec<Vec<(Vec<ParamInfo>, Vec<usize>)>> = chunks
        .iter()
        .map(|&s| {
            let segs: Vec<usize> = layout.segments(s).collect();
            let mut owner: BTreeMap<String, usize> = BTreeMap::new();
            let all: Vec<Vec<ParamInfo>> = segs
                .iter()
                .map(|&g| segment_params(cfg, g, tp, ep, c.ep))
                .collect();
            for (i, ps) in all.iter().enumerate() {
                for p in ps {
                    owner.entry(p.name.clone()).or_insert(i);
                }
            }
            all.iter()
                .enumerate()
                .map(|(i, ps)| {
                    let mut needs: Vec<usize> = ps
                        .iter()
                        .filter_map(|p| owner.get(&p.name).copied())
                        .collect();
                    needs.sort_unstable();
                    needs.dedup();
                    let mine = ps
                        .iter()
                        .filter(|p| owner.get(&p.name) == Some(&i))
                        .map(|p| ParamInfo {
                            name: p.name.clone(),
                            numel: p.numel,
                        })
                        .collect();
                    (mine, needs)
                })
                .collect()
        })
        .collect();
    let zero = match plan.data {
        DataParallelKind::Zero(z) => Some(z.stage),
        DataParallelKind::Ddp(_) => None,
    };
    let unit_numel = |u: &(Vec<ParamInfo>, Vec<usize>)| u.0.iter().map(|p| p.numel).sum::<usize>();
    let padded = |n: usize| n.div_ceil(dp) * dp;
    let gather_unit = |tally: &mut Tally, numel: usize, phase: Phase| {
        tally.all_gather(
            Group::Dp,
            "ZeRO-3 weight gather",
            phase,
            padded(numel),
            1,
            f32_,
            true,
        );
    };
    // ZeRO-3 residency per chunk and unit (true = gathered or being gathered).
    let mut gathered: Vec<Vec<bool>> = units.iter().map(|u| vec![false; u.len()]).collect();
    let recompute = plan.checkpointing;
    let mut last_backward = BTreeMap::new();
    for (i, a) in sched.actions(c.pp).iter().enumerate() {
        if !a.is_forward() {
            last_backward.insert(a.chunk(), i);
        }
    }

    for (i, a) in sched.actions(c.pp).iter().enumerate() {
        let k = a.chunk();
        let segs: Vec<usize> = layout.segments(chunks[k]).collect();
        let us = &units[k];
        let z3 = zero == Some(ZeroStage::Three);
        let act_bytes = (b * t_loc * ch * act.size_in_bytes()) as u64;
        if let Some(from) = sched.input_stage(c.pp, a) {
            if sched.rank_of_stage(from) != c.pp {
                let what = if a.is_forward() {
                    "activation"
                } else {
                    "activation gradient"
                };
                tally.push(
                    Group::Pp,
                    OpKind::Recv,
                    what,
                    if a.is_forward() {
                        Phase::Forward
                    } else {
                        Phase::Backward
                    },
                    0,
                    0,
                    false,
                    false,
                );
            }
        }
        match a {
            Action::Forward { .. } => {
                for (j, &seg) in segs.iter().enumerate() {
                    if z3 {
                        if j > 0 {
                            for &u in &us[j - 1].1 {
                                if !us[j].1.contains(&u) {
                                    gathered[k][u] = false;
                                }
                            }
                        }
                        for &u in &us[j].1 {
                            if !gathered[k][u] {
                                gathered[k][u] = true;
                                gather_unit(&mut tally, unit_numel(&us[u]), Phase::Forward);
                            }
                        }
                        if j + 1 < us.len() {
                            for &u in &us[j + 1].1 {
                                if !gathered[k][u] {
                                    gathered[k][u] = true;
                                    gather_unit(&mut tally, unit_numel(&us[u]), Phase::Forward);
                                }
                            }
                        }
                    }
                    seg_forward(&mut tally, seg, Phase::Forward);
                }
            }
            Action::Backward { .. } => {
                let reduce = match zero {
                    Some(ZeroStage::One) => last_backward.get(&k) == Some(&i),
                    Some(_) => true,
                    None => false,
                };
                for (j, &seg) in segs.iter().enumerate().rev() {
                    if z3 && recompute {
                        for &u in &us[j].1 {
                            if !gathered[k][u] {
                                gathered[k][u] = true;
                                gather_unit(&mut tally, unit_numel(&us[u]), Phase::Backward);
                            }
                        }
                        if j > 0 {
                            for &u in &us[j - 1].1 {
                                if !gathered[k][u] {
                                    gathered[k][u] = true;
                                    gather_unit(&mut tally, unit_numel(&us[u]), Phase::Backward);
                                }
                            }
                        }
                    }
                    if recompute {
                        seg_forward(&mut tally, seg, Phase::Backward);
                    }
                    seg_backward(&mut tally, seg);
                    let n = unit_numel(&us[j]);
                    if reduce && n > 0 {
                        tally.reduce_scatter(
                            Group::Dp,
                            "ZeRO gradient reduce-scatter",
                            Phase::Backward,
                            padded(n),
                            1,
                            f32_,
                            true,
                        );
                    }
                    if z3 {
                        for &u in &us[j].1 {
                            if j == 0 || !us[j - 1].1.contains(&u) {
                                gathered[k][u] = false;
                            }
                        }
                    }
                }
            }
        }
        if let Some(to) = sched.output_stage(c.pp, a) {
            if sched.rank_of_stage(to) != c.pp {
                let what = if a.is_forward() {
                    "activation"
                } else {
                    "activation gradient"
                };
                let phase = if a.is_forward() {
                    Phase::Forward
                } else {
                    Phase::Backward
                };
                tally.push(
                    Group::Pp,
                    OpKind::Send,
                    what,
                    phase,
                    act_bytes,
                    act_bytes,
                    true,
                    false,
                );
            }
        }
    }

    // The pipeline's loss, from the last stage's rank.
    let step = Phase::Step;
    if pp > 1 {
        let root = sched.rank_of_stage(n_stages - 1);
        tally.push(
            Group::Pp,
            OpKind::Broadcast,
            "loss",
            step,
            8,
            broadcast_sent(8, pp, c.pp, root),
            false,
            false,
        );
    }

    // Gradient reduction and fix-ups (finish_grads).
    let held: Vec<ParamInfo> = {
        let mut seen = std::collections::BTreeSet::new();
        chunks
            .iter()
            .flat_map(|&s| layout.segments(s).collect::<Vec<_>>())
            .flat_map(|g| segment_params(cfg, g, tp, ep, c.ep))
            .filter(|p| seen.insert(p.name.clone()))
            .collect()
    };
    let tied_here = n_stages > 1 && held.iter().any(|p| p.name == "wte.weight");
    let wte_local = held
        .iter()
        .find(|p| p.name == "wte.weight")
        .map_or(0, |p| p.numel);
    let tied_exchange = |tally: &mut Tally| {
        let first = 0;
        let last = pp - 1;
        if first != last && (c.pp == first || c.pp == last) {
            let bytes = (wte_local * 4) as u64;
            tally.push(
                Group::Pp,
                OpKind::Send,
                "tied wte gradient",
                step,
                bytes,
                bytes,
                false,
                false,
            );
            tally.push(
                Group::Pp,
                OpKind::Recv,
                "tied wte gradient",
                step,
                0,
                0,
                false,
                false,
            );
        }
    };
    match zero {
        None => {
            if dp > 1 {
                for p in &held {
                    let g = if is_expert_param(&p.name) {
                        Group::Edp
                    } else {
                        Group::Dp
                    };
                    tally.all_reduce(g, "gradient", step, p.numel, f32_, true);
                }
            }
            if sp {
                let n: usize = held
                    .iter()
                    .filter(|p| sp_partial(&p.name))
                    .map(|p| p.numel)
                    .sum();
                if n > 0 {
                    tally.all_reduce(
                        Group::Tp,
                        "sequence-parallel partial gradients",
                        step,
                        n,
                        f32_,
                        false,
                    );
                }
            }
            if tied_here {
                tied_exchange(&mut tally);
            }
        }
        Some(_) => {
            if sp {
                for us in &units {
                    for u in us {
                        if u.0.iter().any(|p| sp_partial(&p.name)) {
                            tally.all_reduce(
                                Group::Tp,
                                "sequence-parallel partial gradients",
                                step,
                                padded(unit_numel(u)) / dp,
                                f32_,
                                false,
                            );
                        }
                    }
                }
            }
            if tied_here {
                for us in &units {
                    for u in us {
                        if u.0.iter().any(|p| p.name == "wte.weight") {
                            let n = padded(unit_numel(u));
                            tally.all_gather(
                                Group::Dp,
                                "tied wte gradient gather",
                                step,
                                n,
                                1,
                                f32_,
                                false,
                            );
                        }
                    }
                }
                tied_exchange(&mut tally);
            }
        }
    }
    // Loss and auxiliary loss (forward_backward), expert load, gradient norm (optimizer_step).
    if pp > 1 {
        tally.all_reduce(Group::Pp, "aux loss", step, 1, DType::F64, false);
    }
    tally.all_reduce(Group::Dp, "loss", step, 2, DType::F64, false);
    if let Some(m) = &moe {
        let layers: usize = chunks.iter().map(|&s| layout.blocks(s).len()).sum();
        if layers > 0 {
            tally.all_reduce(
                Group::Dp,
                "expert load",
                step,
                layers * (m.n_experts + 1),
                DType::I64,
                false,
            );
        }
    }
    tally.all_reduce(Group::World, "gradient norm", step, 1, DType::F64, false);
    if matches!(zero, Some(ZeroStage::One) | Some(ZeroStage::Two)) {
        for us in &units {
            for u in us {
                let n = unit_numel(u);
                if n > 0 {
                    tally.all_gather(
                        Group::Dp,
                        "ZeRO weight write-back",
                        step,
                        padded(n),
                        1,
                        f32_,
                        false,
                    );
                }
            }
        }
    }
    Ok(tally.items)
}

/// (rows a rank's input holds, rows it sends to other ranks) of a token all-to-all under
/// balanced routing: k·N/E tokens per expert, capped by the capacity.
fn balanced_rows(m: &mtrain_model::MoeConfig, tokens: usize, ep: usize) -> (u64, u64) {
    let cap = capacity(tokens, m.n_experts, m.top_k, m.capacity_factor);
    let per_expert = ((m.top_k * tokens) as f64 / m.n_experts as f64).round() as usize;
    let kept = per_expert.min(cap) * m.n_experts;
    let remote = kept * (ep - 1) / ep;
    (kept as u64, remote as u64)
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
