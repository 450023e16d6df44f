//! The step time `mtrain plan` predicts for a layout on a [`Machine`]: compute from FLOPs or
//! from a one-rank run's measured passes, communication from the step's collectives priced on
//! the links their groups span, the pipeline bubble from the schedule simulator, and on CPU
//! nodes the cores the node's ranks share.
//!
//! ```text
//!   f, b = one rank's forward and backward of one micro-batch of the whole model: measured
//!          (--forward-ms, --backward-ms; b = 2f if only f is given), else priced by the
//!          machine's compute rule (compute.rs: the roofline rule, or FLOPs at --mfu)
//!   w_s  = model stage s's share of the FLOPs: its blocks', and the head's on the last stage
//!   u    = the part of measured passes a tp rank does whole (--tp-whole; 0 when priced, and
//!          with sequence parallelism, which splits that work over tp too)
//!   f_s  = f · w_s · (u + (1 − u)/tp) / cp      b_s likewise, + f_s with activation checkpointing
//!   F_s = f_s + (its rank's tp / ep / pp collectives in forward + p_f) / (M · chunks)   the passes
//!   B_s = b_s + (its collectives in backward + p_b) / (M · chunks)          the simulator runs
//!   p_f, p_b = the rank's expert-parallel permutations in forward and backward (below)
//!   pipeline = grad_accum · makespan(F, B)                              (bubble included)
//!              on a node of G ranks and K < G cores: the passes share the cores
//!   step = pipeline
//!        + the optimizer's pass over the rank's shard (the roofline rule only)
//!        + step-phase collectives that cannot overlap (norm, tied embedding, ...)
//!        + max(0, overlappable collectives − the compute they hide behind)
//! ```
//!
//! **The cp ring** (context parallelism) hides behind attention, not behind the step: each K, V
//! pass runs beside one block of the ring's attention (B·(C/tp)·2c² query-key products of a
//! rank, c = T/(2·cp) the chunk, 4 FLOPs each per head dimension forward, twice that backward;
//! their time is that fraction of f and b), and a backward step's K, V and dK, dV passes beside
//! one block's gradient. What a step's passes take beyond its block is exposed, in the pass:
//!
//! ```text
//!   a_f = f · 8·B·(C/tp)·c² / (f's FLOPs)      a_b = b · 16·B·(C/tp)·c² / (b's FLOPs)
//!   forward, per K, V pass:     max(0, kv − a_f)
//!   backward, per block:        max(0, kv − a_b) + (cp−2)·max(0, kv + dkv − a_b) + max(0, dkv − a_b)
//!                               (step 0 sends K, V; the middle steps both; the last dK, dV)
//!   recompute, per K, V pass:   max(0, kv − a_f)
//! ```
//!
//! The last accumulator pass, after the last block, is exposed whole; a pass's receive runs with
//! its send and is priced with it.
//!
//! The overlappable collectives are the ones the runtime issues beside compute
//! ([`Collective::overlappable`]: DDP buckets, ZeRO's prefetched gathers and reduce-scatters):
//! DDP's buckets and ZeRO-1's reduction hide behind the last micro-batch's backward (the only
//! one that synchronises), ZeRO-2's reduce-scatters behind every backward, ZeRO-3's gathers
//! behind every forward and backward.
//! FLOPs per token are [`mtrain_model::GptConfig::flops_per_token`] (6N + 12·L·C·T, N the weights
//! a token is multiplied by, MoE: the active ones): the head's 6·V·C on the last stage (the tied embedding's lookup does
//! none), the rest an equal part per block, so a stage holding the head is the slower one.
//!
//! **Expert-parallel permutations** (ep > 1): a one-rank run's MoE layer has every expert at
//! home, so the rows it receives are already in expert order; a rank of an ep group receives
//! them by source rank and gathers them into expert order before its experts (sort) and back
//! into source order after them (unsort), in the forward and again on the gradients in the
//! backward: one gather of the rows of each token all-to-all (dispatch, combine, and their
//! conjugates), which the measured passes do not hold. A gather reads and writes its rows, at
//! the machine's copy bandwidth ([`Machine::copy_bytes_per_s`]):
//!
//! ```text
//!   p = Σ over the rank's token all-to-alls of the pass   2 · rows · C · s / copy bandwidth
//!     = 8 · k·N · C · s per MoE layer and micro-batch (forward and backward; N tokens, top-k k,
//!       rows the cost model's balanced-routing estimate)
//! ```
//!
//! **Shared cores** (`--cores-per-node`, a CPU node): a node of `G` ranks on `K < G` cores
//! runs them at `K / G` of a core each when all are busy: the schedule runs with each pass at
//! `min(1, k / busy)` of its speed ([`mtrain_parallel::pipeline::Schedule::simulate_shared`],
//! `k = K · pp / G` the cores of one pipeline replica), so the fill and the drain run at full
//! speed and the steady state at the cores' share. On any CPU node (`K ≥ G` too, each rank then
//! computing on `K / G` threads) no core is idle to hide a collective behind (the CPU backend's
//! collectives are work of the same cores: copies and sums over loopback), so the overlappable
//! collectives are all exposed. A one-rank run that
//! measures `f` and `b` runs on as many threads as a rank of the layout gets.

use candle_core::DType;
use mtrain_comm::OpKind;
use mtrain_model::GptConfig;
use mtrain_parallel::analysis::comm_cost::{
    step_collectives, Collective, Group, Phase, StepShape, RING_DKV,
};
use mtrain_parallel::parallelize::{DataParallelKind, ValidPlan};
use mtrain_parallel::pipeline::{PassCosts, StageLayout};

use super::compute;
use super::machine::{Machine, GROUPS};
use crate::config::{DTypeKind, TrainConfig};

/// One group's communication in a step of the busiest pipeline stage.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupComm {
    pub group: Group,
    /// Every collective of the group, priced on its link.
    pub total_s: f64,
    /// Of that, what the step waits for.
    pub exposed_s: f64,
    /// The group spans more than one node.
    pub crosses: bool,
}

/// What `plan` predicts for one optimizer step.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// The busiest rank's forward and backward (recompute included) of every micro-batch, no
    /// comm.
    pub compute_s: f64,
    /// Rank 0's idle fraction of the pipeline's simulated step.
    pub bubble: f64,
    pub groups: Vec<GroupComm>,
    /// The expert-parallel permutations of a step on the busiest rank (in `compute_s` too).
    pub permute_s: f64,
    pub step_s: f64,
    /// Tokens of the global batch per second.
    pub tokens_per_s: f64,
    /// Model FLOPs (no recompute) per second over the machine's peak.
    pub mfu: f64,
}

impl Prediction {
    /// Exposed communication of every group.
    pub fn exposed_s(&self) -> f64 {
        // A fold from +0.0: an empty f64 sum is −0.0, printed as "-0.0 µs".
        self.groups.iter().fold(0.0, |a, g| a + g.exposed_s)
    }
}

/// Seconds of one collective on the link its group spans.
fn priced(machine: &Machine, plan: &ValidPlan, c: &Collective) -> f64 {
    let n = c.group.size(plan.dims);
    let m = machine.model(plan.dims, c.group, c.op, n);
    m.time(c.op, n, c.bytes).total_s() * c.count as f64
}

/// Whether a collective runs inside the passes (tensor, expert and pipeline traffic of the
/// forward and backward), where the pipeline waits for it; tensor and expert traffic an
/// overlap mode puts beside a product (`--tp-overlap`'s chunks and ring steps) does not.
fn in_pass(c: &Collective) -> bool {
    let p2p = matches!(c.op, OpKind::Send | OpKind::Recv) && c.group != Group::Tp;
    let blocking = !c.overlappable && matches!(c.group, Group::Tp | Group::Ep);
    c.phase != Phase::Step && (p2p || blocking)
}

/// Seconds of the expert side's gather of collective `c`'s rows, if it is a token all-to-all
/// of an MoE layer (module doc): it reads and writes them once.
fn permutation(machine: &Machine, c: &Collective) -> f64 {
    let tokens = c.group == Group::Ep && c.op == OpKind::AllToAll && c.estimate;
    match (tokens, machine.copy_bytes_per_s) {
        (true, Some(bw)) => 2.0 * c.bytes as f64 * c.count as f64 / bw,
        _ => 0.0,
    }
}

/// A one-rank run's passes of one micro-batch of the whole model, measured, in seconds: the
/// prediction's compute instead of FLOPs at the machine's MFU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measured {
    pub forward_s: f64,
    /// None: twice the forward.
    pub backward_s: Option<f64>,
    /// The fraction of the passes that tensor parallelism leaves whole on every tp rank
    /// ([`tp_rank_part`]).
    pub tp_whole: f64,
}

/// The part of a one-rank pass one tp rank of a group of `tp` runs: tp splits the blocks'
/// matrix multiplies (column- and row-parallel), attention (by heads), the GELU between them,
/// the head and the loss (by vocabulary), but without sequence parallelism every rank runs the
/// LayerNorms, the residual adds and the position embedding on the whole activations, so the
/// fraction `whole` of the pass that is such work is not divided:
///
/// ```text
///   tp rank's pass = pass · (whole + (1 − whole) / tp)        tp 2, whole 0.13: 0.565 of it
/// ```
///
/// With sequence parallelism those ops run on 1/tp of the sequence: every part is divided.
/// `whole` is measured from a one-rank run's `--profile-ops` table (the LayerNorm, residual
/// and embedding rows' share of the passes' op time; `scripts/check-plan.sh`).
pub fn tp_rank_part(tp: usize, whole: f64, sequence_parallel: bool) -> f64 {
    let tp = tp.max(1) as f64;
    let whole = if sequence_parallel {
        0.0
    } else {
        whole.clamp(0.0, 1.0)
    };
    whole + (1.0 - whole) / tp
}

/// Each model stage's share of the model's FLOPs per token (they sum to 1): its blocks' equal
/// parts of everything but the head, and the head's 6·V·C on the last stage.
pub fn stage_shares(model: &GptConfig, layout: &StageLayout, seq_len: usize) -> Vec<f64> {
    let total = model.flops_per_token(seq_len);
    let head = 6.0 * (model.vocab_size * model.n_embd) as f64;
    let block = (total - head) / model.n_layer.max(1) as f64;
    let last = layout.num_stages().saturating_sub(1);
    (0..layout.num_stages())
        .map(|s| {
            let own = layout.blocks(s).len() as f64 * block;
            (own + if s == last { head } else { 0.0 }) / total
        })
        .collect()
}

/// The prediction for `cfg` under `plan` on `machine`; `measured`, a one-rank run's passes,
/// replaces the FLOPs at the machine's MFU.
pub fn predict(
    cfg: &TrainConfig,
    plan: &ValidPlan,
    machine: &Machine,
    measured: Option<Measured>,
) -> anyhow::Result<Prediction> {
    let model = cfg.gpt_config()?;
    let dims = plan.dims;
    let (pp, m, ga) = (
        dims.pp.max(1),
        plan.microbatches.max(1),
        cfg.grad_accum.max(1),
    );
    let tokens_mb = (cfg.batch_size / m * cfg.seq_len) as f64;
    let fpt = model.flops_per_token(cfg.seq_len);
    let (whole_f, whole_b) = match measured {
        Some(x) => (x.forward_s, x.backward_s.unwrap_or(2.0 * x.forward_s)),
        None => compute::passes(
            machine.compute,
            &model,
            cfg.seq_len,
            tokens_mb,
            cfg.dtype.candle().size_in_bytes(),
            machine.gpu.peak_flops,
        ),
    };
    let layout = plan.stage_layout(model.n_layer)?;
    // Per model stage: one micro-batch's forward and backward compute on one of its tp ranks.
    let whole = measured.map_or(0.0, |x| x.tp_whole);
    let part = tp_rank_part(dims.tp, whole, plan.sequence_parallel) / dims.cp as f64;
    let passes: Vec<(f64, f64)> = stage_shares(&model, &layout, cfg.seq_len)
        .iter()
        .map(|w| {
            let (f, b) = (whole_f * w * part, whole_b * w * part);
            (f, if plan.checkpointing { b + f } else { b })
        })
        .collect();
    // Per pipeline rank: the forward and backward compute of one micro-batch, all its chunks.
    let rank_passes: Vec<(f64, f64)> = (0..pp)
        .map(|r| {
            let stages = layout.stages_of_rank(r, pp);
            let sum = |pick: fn(&(f64, f64)) -> f64| stages.iter().map(|&s| pick(&passes[s])).sum();
            (sum(|p| p.0), sum(|p| p.1))
        })
        .collect();
    let chunks = (layout.num_stages() / pp).max(1) as f64;
    let shape = StepShape {
        batch: cfg.batch_size * dims.dp,
        seq_len: cfg.seq_len,
        dtype: match cfg.dtype {
            DTypeKind::F32 => DType::F32,
            _ => DType::BF16,
        },
    };
    // What the overlappable collectives hide behind, on pipeline rank r: DDP's buckets and
    // ZeRO-1's reduction run in the backward of the step's last micro-batch; ZeRO-2
    // reduce-scatters in every backward; ZeRO-3 also gathers in every forward. On a CPU node,
    // nothing: its ranks' compute threads fill its cores, and the collectives are work of the
    // same cores.
    let stage = match plan.data {
        DataParallelKind::Zero(z) => z.stage as u8,
        _ => 0,
    };
    let shared = machine.shared_cores(dims.world_size());
    let cpu_node = machine.cores_per_node.is_some();
    let window = |r: usize| {
        let (f, b) = rank_passes[r];
        match (cpu_node, stage) {
            (true, _) => 0.0,
            (false, 0 | 1) => b,
            (false, 2) => ga as f64 * m as f64 * b,
            (false, _) => ga as f64 * m as f64 * (f + b),
        }
    };
    // Per pipeline rank: its comm inside the passes (forward, backward; per micro-step), the
    // step-phase comm, the overlappable pool, and each group's total, in-pass and pool seconds.
    // One walk per stage shape: the ranks of the same shape issue the same collectives.
    let ring = RingWindows::new(&model, cfg, dims, tokens_mb, fpt, (whole_f, whole_b), m);
    let reps = super::stage_representatives(cfg, plan)?;
    let mut comm: Vec<RankComm> = Vec::with_capacity(pp);
    for p in 0..pp {
        if reps[p] != p {
            let same = comm[reps[p]].clone();
            comm.push(same);
            continue;
        }
        let items = step_collectives(&model, plan, shape, dims.rank_of(0, p, 0))?;
        let (mut fwd, mut bwd, mut step, mut pool) = (0.0, 0.0, 0.0, 0.0);
        let mut permute = (0.0, 0.0);
        let mut per_group = vec![(0.0f64, 0.0f64, 0.0f64); GROUPS.len()];
        let mut beside = RingPasses::default();
        for c in &items {
            let reps = if c.phase == Phase::Step {
                1.0
            } else {
                ga as f64
            };
            if c.group == Group::Cp && c.op == OpKind::Recv {
                continue; // with its send
            }
            let t = priced(machine, plan, c);
            match c.phase {
                Phase::Forward => permute.0 += permutation(machine, c),
                Phase::Backward => permute.1 += permutation(machine, c),
                Phase::Step => {}
            }
            let g = GROUPS.iter().position(|&g| g == c.group).unwrap_or(0);
            per_group[g].0 += t * reps;
            if c.group == Group::Cp && c.overlappable {
                beside.add(c, t);
            } else if in_pass(c) {
                match c.phase {
                    Phase::Forward => fwd += t,
                    _ => bwd += t,
                }
                per_group[g].1 += t * reps;
            } else if c.overlappable {
                pool += t * reps;
                per_group[g].2 += t * reps;
            } else {
                step += t * reps;
                per_group[g].1 += t * reps;
            }
        }
        let (ring_f, ring_b) = beside.exposed(&ring, dims.cp);
        let g = GROUPS.iter().position(|&g| g == Group::Cp).unwrap_or(0);
        per_group[g].1 += (ring_f + ring_b) * ga as f64;
        comm.push(RankComm {
            forward: fwd + ring_f,
            backward: bwd + ring_b,
            step,
            pool,
            per_group,
            permute,
        });
    }
    let kind = plan.effective_schedule();
    let sched = plan.schedule()?;
    // Model stage s: its compute, and its rank's in-pass comm shared over the rank's chunks.
    let stage_costs: Vec<(f64, f64)> = (0..sched.num_model_stages())
        .map(|s| {
            let c = &comm[sched.rank_of_stage(s)];
            let per = m as f64 * chunks;
            let (fwd, bwd) = (c.forward + c.permute.0, c.backward + c.permute.1);
            (passes[s].0 + fwd / per, passes[s].1 + bwd / per)
        })
        .collect();
    // Each model stage's own costs (a chunk's already): B split evenly into B and W where the
    // schedule splits the backward.
    let split = kind.splits_backward();
    let costs: Vec<PassCosts> = stage_costs
        .iter()
        .map(|&(fs, bs)| PassCosts {
            forward: fs,
            backward: bs,
            input_grad: if split { bs / 2.0 } else { bs },
            weight_grad: if split { bs / 2.0 } else { 0.0 },
        })
        .collect();
    // On shared cores a pipeline replica's ranks get their part of the node's cores, and
    // their passes stretch while more of them run than it has.
    let sim = match shared {
        None => sched.simulate_with(&costs)?,
        Some(cores) => {
            let per_node = machine.ranks_per_node(dims.world_size()) as f64;
            sched.simulate_shared(&costs, cores as f64 * pp as f64 / per_node)?
        }
    };
    let pipeline = ga as f64 * sim.makespan();
    // The rank whose step-phase and excess overlappable comm is largest finishes last.
    let tail = |r: usize| comm[r].step + (comm[r].pool - window(r)).max(0.0);
    let worst = (0..pp)
        .max_by(|&a, &b| tail(a).total_cmp(&tail(b)))
        .unwrap_or(0);
    let RankComm {
        pool, per_group, ..
    } = &comm[worst];
    let hidden = if *pool > 0.0 {
        (pool - window(worst)).max(0.0) / pool
    } else {
        0.0
    };
    let groups: Vec<GroupComm> = GROUPS
        .iter()
        .zip(per_group)
        .filter(|(_, t)| t.0 > 0.0)
        .map(|(&group, &(total, exposed, pooled))| GroupComm {
            group,
            total_s: total,
            exposed_s: exposed + pooled * hidden,
            crosses: machine.span(dims, group).crosses(),
        })
        .collect();
    // The optimizer's pass over the largest shard a rank updates (ZeRO: its dp part).
    let mut optimizer = 0.0f64;
    if measured.is_none() {
        for p in 0..pp {
            let params = crate::memory::rank_params(&model, plan, p)?;
            let shard = if stage > 0 {
                params.div_ceil(dims.dp as u64)
            } else {
                params
            };
            let s = compute::optimizer(machine.compute, shard, cfg.dtype.candle().size_in_bytes());
            optimizer = optimizer.max(s);
        }
    }
    let step_s = pipeline + optimizer + tail(worst);
    let tokens = (cfg.batch_size * dims.dp * ga * cfg.seq_len) as f64;
    // Per pipeline rank: its passes of every micro-batch of a micro-step, and its permutations.
    let busiest = (0..pp)
        .map(|r| {
            let (f, b) = rank_passes[r];
            let (pf, pb) = comm[r].permute;
            (m as f64 * (f + b) + pf + pb, pf + pb)
        })
        .fold((0.0, 0.0), |a, x| if x.0 > a.0 { x } else { a });
    Ok(Prediction {
        compute_s: ga as f64 * busiest.0,
        bubble: sim.bubble_fraction(0),
        groups,
        permute_s: ga as f64 * busiest.1,
        step_s,
        tokens_per_s: tokens / step_s,
        mfu: fpt * tokens / step_s / (machine.gpus as f64 * machine.gpu.peak_flops),
    })
}

/// One pipeline rank's communication in a step (per micro-step unless said), and its
/// expert-parallel permutations.
#[derive(Debug, Clone)]
struct RankComm {
    /// Collectives inside the forward passes (the cp ring's exposed part included).
    forward: f64,
    /// Collectives inside the backward passes.
    backward: f64,
    /// Step-phase collectives that cannot overlap, per step.
    step: f64,
    /// Overlappable collectives, per step.
    pool: f64,
    /// Per group of [`GROUPS`]: (total, in-pass or exposed, pooled) seconds per step.
    per_group: Vec<(f64, f64, f64)>,
    /// (forward, backward) seconds of the permutations around the token all-to-alls.
    permute: (f64, f64),
}

/// The attention compute one cp ring pass hides behind, per micro-batch: a block of the
/// ring's forward (a_f) and of its backward (a_b), in seconds (module doc).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RingWindows {
    pub forward_s: f64,
    pub backward_s: f64,
}

impl RingWindows {
    /// From the whole model's passes `(f, b)` of one micro-batch of `tokens_mb` tokens at
    /// `fpt` FLOPs per token (forward a third), `m` micro-batches of the rank's batch.
    pub fn new(
        model: &GptConfig,
        cfg: &TrainConfig,
        dims: mtrain_comm::MeshDims,
        tokens_mb: f64,
        fpt: f64,
        (f, b): (f64, f64),
        m: usize,
    ) -> RingWindows {
        let c = (cfg.seq_len / (2 * dims.cp)) as f64;
        let seqs = (cfg.batch_size / m.max(1)) as f64;
        let block = 8.0 * seqs * (model.n_embd / dims.tp) as f64 * c * c; // forward FLOPs
        let forward_flops = fpt / 3.0 * tokens_mb;
        RingWindows {
            forward_s: f * block / forward_flops,
            backward_s: b * 2.0 * block / (2.0 * forward_flops),
        }
    }
}

/// A rank's cp passes that run beside attention, by kind: their priced seconds and count.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RingPasses {
    pub forward: (f64, usize),
    /// K, V passes in the backward: the backward's and the recompute's forward ring.
    pub backward_kv: (f64, usize),
    /// The dK, dV accumulators' passes beside the blocks' gradients.
    pub backward_dkv: (f64, usize),
}

impl RingPasses {
    fn add(&mut self, c: &Collective, t: f64) {
        let kind = match (c.phase, c.what) {
            (Phase::Forward, _) => &mut self.forward,
            (_, RING_DKV) => &mut self.backward_dkv,
            _ => &mut self.backward_kv,
        };
        *kind = (kind.0 + t, kind.1 + c.count);
    }

    /// (forward, backward) seconds the passes of a ring of `n` take beyond the attention
    /// beside them, step by step: forward, each K, V pass beside a block (a_f); a block's
    /// backward, K, V beside step 0, both beside steps 1 … n−2, dK, dV beside step n−1 (a_b
    /// each); the recompute's K, V passes beside its forward blocks.
    pub fn exposed(&self, w: &RingWindows, n: usize) -> (f64, f64) {
        let each = |(s, k): (f64, usize)| if k == 0 { 0.0 } else { s / k as f64 };
        let (f, kv, dkv) = (
            each(self.forward),
            each(self.backward_kv),
            each(self.backward_dkv),
        );
        let over = |x: f64, a: f64| (x - a).max(0.0);
        let (a_f, a_b) = (w.forward_s, w.backward_s);
        let forward = self.forward.1 as f64 * over(f, a_f);
        let blocks = self.backward_dkv.1 as f64 / n.saturating_sub(1).max(1) as f64;
        let block =
            over(kv, a_b) + n.saturating_sub(2) as f64 * over(kv + dkv, a_b) + over(dkv, a_b);
        let recompute = self.backward_kv.1.saturating_sub(self.backward_dkv.1) as f64;
        (forward, blocks * block + recompute * over(kv, a_f))
    }
}

/// The prediction as `plan` prints it.
pub fn render(p: &Prediction) -> String {
    use mtrain_parallel::analysis::comm_cost::human_time;
    let mut s = format!(
        "predicted step: {} (compute {} per rank, pipeline bubble {:.3}, exposed communication {}); {:.0} tokens/s, MFU {:.1}%\n",
        human_time(p.step_s),
        human_time(p.compute_s),
        p.bubble,
        human_time(p.exposed_s()),
        p.tokens_per_s,
        p.mfu * 100.0
    );
    if p.permute_s > 0.0 {
        s.push_str(&format!(
            "  ep permutations (the expert side's sort and unsort of the token rows) {} per step, in the passes\n",
            human_time(p.permute_s)
        ));
    }
    for g in &p.groups {
        s.push_str(&format!(
            "  {:<5} communication {} per step, {} exposed{}\n",
            g.group.name(),
            human_time(g.total_s),
            human_time(g.exposed_s),
            if g.crosses { " (across nodes)" } else { "" }
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ring of 4, per pass: K, V 1 µs, dK, dV 2 µs; blocks of 0.5 µs forward, 2.5 µs backward.
    /// One block's passes: forward 3 × (1 − 0.5) = 1.5 µs; backward step 0 max(0, 1 − 2.5) = 0,
    /// steps 1-2 2 × max(0, 1 + 2 − 2.5) = 1 µs, step 3 max(0, 2 − 2.5) = 0; with a recompute,
    /// its 3 K, V passes 3 × 0.5 = 1.5 µs more.
    #[test]
    fn ring_passes_hide_step_by_step() {
        let us = 1e-6;
        let w = RingWindows {
            forward_s: 0.5 * us,
            backward_s: 2.5 * us,
        };
        let one_block = RingPasses {
            forward: (3.0 * us, 3),
            backward_kv: (3.0 * us, 3),
            backward_dkv: (6.0 * us, 3),
        };
        let (f, b) = one_block.exposed(&w, 4);
        assert!(
            (f - 1.5 * us).abs() < 1e-15 && (b - 1.0 * us).abs() < 1e-15,
            "{f} {b}"
        );
        let recomputed = RingPasses {
            backward_kv: (6.0 * us, 6),
            ..one_block
        };
        let (_, b) = recomputed.exposed(&w, 4);
        assert!((b - 2.5 * us).abs() < 1e-15, "{b}");
        // Two blocks expose twice one's.
        let two = RingPasses {
            forward: (6.0 * us, 6),
            backward_kv: (6.0 * us, 6),
            backward_dkv: (12.0 * us, 6),
        };
        let (f2, b2) = two.exposed(&w, 4);
        assert!((f2 - 3.0 * us).abs() < 1e-15 && (b2 - 2.0 * us).abs() < 1e-15);
    }
}
