//! The step time `mtrain plan` predicts for a layout on a [`Machine`]: compute from FLOPs,
//! communication from the step's collectives priced on the links their groups span, the
//! pipeline bubble from the schedule simulator.
//!
//! ```text
//!   f  = FLOPs/token / 3 · tokens of a micro-batch / (tp · pp) / (peak · mfu)   one rank's forward
//!   b  = 2f, + f with activation checkpointing (the recompute)
//!   F_s = f + (stage s's tp / ep / pp collectives in forward) / M      the passes the pipeline
//!   B_s = b + (its collectives in backward) / M                        simulator is given
//!   step = grad_accum · makespan(F, B)                                 (bubble included)
//!        + step-phase collectives that cannot overlap (norm, tied embedding, ...)
//!        + max(0, overlappable collectives − the compute they hide behind)
//! ```
//!
//! The overlappable collectives are the ones the runtime issues beside compute
//! ([`Collective::overlappable`]: DDP buckets, ZeRO's prefetched gathers and reduce-scatters):
//! DDP's buckets and ZeRO-1's reduction hide behind the last micro-batch's backward (the only
//! one that synchronises), ZeRO-2's reduce-scatters behind every backward, ZeRO-3's gathers
//! behind every forward and backward.
//! FLOPs per token are [`mtrain_model::GptConfig::flops_per_token`] (6N + 12·L·C·T, N the
//! weights a token is multiplied by, MoE: the active ones), split evenly over the stages; per rank, `f` is the same on every stage
//! (the embedding's and head's extra work is left out).

use candle_core::DType;
use mtrain_comm::OpKind;
use mtrain_parallel::analysis::comm_cost::{step_collectives, Collective, Group, Phase, StepShape};
use mtrain_parallel::parallelize::{DataParallelKind, ValidPlan};
use mtrain_parallel::pipeline::PassCosts;

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
    /// One rank's forward and backward (recompute included) of every micro-batch, no comm.
    pub compute_s: f64,
    /// Rank 0's idle fraction of the pipeline's simulated step.
    pub bubble: f64,
    pub groups: Vec<GroupComm>,
    pub step_s: f64,
    /// Tokens of the global batch per second.
    pub tokens_per_s: f64,
    /// Model FLOPs (no recompute) per second over the machine's peak.
    pub mfu: f64,
}

impl Prediction {
    /// Exposed communication of every group.
    pub fn exposed_s(&self) -> f64 {
        self.groups.iter().map(|g| g.exposed_s).sum()
    }
}

/// Seconds of one collective on the link its group spans.
fn priced(machine: &Machine, plan: &ValidPlan, c: &Collective) -> f64 {
    let n = c.group.size(plan.dims);
    let m = machine.model(plan.dims, c.group, c.op, n);
    m.time(c.op, n, c.bytes).total_s() * c.count as f64
}

/// Whether a collective runs inside the passes (tensor, expert and pipeline traffic of the
/// forward and backward), where the pipeline waits for it.
fn in_pass(c: &Collective) -> bool {
    let p2p = matches!(c.op, OpKind::Send | OpKind::Recv);
    c.phase != Phase::Step && (p2p || (!c.overlappable && matches!(c.group, Group::Tp | Group::Ep)))
}

/// The prediction for `cfg` under `plan` on `machine`; `fwd_s`, a one-rank forward of one
/// micro-batch of the whole model (measured), replaces the FLOPs at the machine's MFU: `f` is
/// its share, `fwd_s / (tp · pp)`.
pub fn predict(
    cfg: &TrainConfig,
    plan: &ValidPlan,
    machine: &Machine,
    fwd_s: Option<f64>,
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
    let whole = fwd_s.unwrap_or(fpt / 3.0 * tokens_mb / (machine.gpu.peak_flops * machine.mfu));
    let f = whole / (dims.tp * pp) as f64;
    let b = if plan.checkpointing { 3.0 * f } else { 2.0 * f };
    let shape = StepShape {
        batch: cfg.batch_size * dims.dp,
        seq_len: cfg.seq_len,
        dtype: match cfg.dtype {
            DTypeKind::F32 => DType::F32,
            _ => DType::BF16,
        },
    };
    // What the overlappable collectives hide behind: DDP's buckets and ZeRO-1's reduction run in
    // the backward of the step's last micro-batch; ZeRO-2 reduce-scatters in every backward;
    // ZeRO-3 also gathers in every forward.
    let stage = match plan.data {
        DataParallelKind::Zero(z) => z.stage as u8,
        _ => 0,
    };
    let window = match stage {
        0 | 1 => b,
        2 => ga as f64 * m as f64 * b,
        _ => ga as f64 * m as f64 * (f + b),
    };
    // Per stage: pass costs with their in-pass comm, the step-phase comm, the overlappable pool,
    // and each group's total, in-pass and pool seconds.
    // One walk per stage shape: the ranks of the same shape issue the same collectives.
    let reps = super::stage_representatives(cfg, plan)?;
    let mut stages: Vec<(f64, f64, f64, f64, Vec<(f64, f64, f64)>)> = Vec::with_capacity(pp);
    for p in 0..pp {
        if reps[p] != p {
            let same = stages[reps[p]].clone();
            stages.push(same);
            continue;
        }
        let items = step_collectives(&model, plan, shape, dims.rank_of(0, p, 0))?;
        let (mut fwd, mut bwd, mut step, mut pool) = (0.0, 0.0, 0.0, 0.0);
        let mut per_group = vec![(0.0f64, 0.0f64, 0.0f64); GROUPS.len()];
        for c in &items {
            let reps = if c.phase == Phase::Step {
                1.0
            } else {
                ga as f64
            };
            let t = priced(machine, plan, c);
            let g = GROUPS.iter().position(|&g| g == c.group).unwrap_or(0);
            per_group[g].0 += t * reps;
            if in_pass(c) {
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
        stages.push((
            f + fwd / m as f64,
            b + bwd / m as f64,
            step,
            pool,
            per_group,
        ));
    }
    let kind = plan.effective_schedule();
    let sched = plan.schedule()?;
    let costs: Vec<PassCosts> = (0..sched.num_model_stages())
        .map(|s| {
            let (fs, bs, ..) = stages[sched.rank_of_stage(s)];
            match kind.splits_backward() {
                true => PassCosts::of_stage(kind, [fs, bs / 2.0, bs / 2.0]),
                false => PassCosts::of_stage(kind, [fs, bs, 0.0]),
            }
        })
        .collect();
    let sim = sched.simulate_with(&costs)?;
    let pipeline = ga as f64 * sim.makespan();
    // The stage whose step-phase and excess overlappable comm is largest finishes last.
    let tail = |s: &(f64, f64, f64, f64, Vec<(f64, f64, f64)>)| s.2 + (s.3 - window).max(0.0);
    let worst = (0..pp)
        .max_by(|&a, &b| tail(&stages[a]).total_cmp(&tail(&stages[b])))
        .unwrap_or(0);
    let (_, _, _, pool, per_group) = &stages[worst];
    let hidden = if *pool > 0.0 {
        (pool - window).max(0.0) / pool
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
    let step_s = pipeline + tail(&stages[worst]);
    let tokens = (cfg.batch_size * dims.dp * ga * cfg.seq_len) as f64;
    Ok(Prediction {
        compute_s: ga as f64 * m as f64 * (f + b),
        bubble: sim.bubble_fraction(0),
        groups,
        step_s,
        tokens_per_s: tokens / step_s,
        mfu: fpt * tokens / step_s / (machine.gpus as f64 * machine.gpu.peak_flops),
    })
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
