//! `mtrain plan --search`: every layout of a model on a cluster for a global batch that fits in
//! the GPUs' memory, ranked by predicted step time.
//!
//! ```text
//!   for tp in 1, 2, 4, ... ≤ 2 · GPUs per node     (past one node only to be flagged)
//!    for pp dividing GPUs / tp, ≤ layers;  dp = GPUs / (tp · pp) dividing the global batch
//!     for ep dividing dp and the experts (MoE only)
//!      for ZeRO stage 0..3 (0 = DDP; dp > 1 only), checkpointing off / on,
//!       for micro-batches of 1, 2, 4 sequences, schedule 1F1B / interleaved / ZB-H1 (pp > 1)
//!         plan checked as a launch checks it (ParallelPlan::validate)
//!         model state ≤ memory?  (16 bytes per parameter over tp · pp, ZeRO's share: cheap)
//!         peak per pipeline rank ≤ memory?  (the analytic memory model, `rank_memory`, on
//!                                             one rank per stage shape: stage_representatives)
//!         predicted step (predict.rs)
//! ```
//!
//! Memory is one GPU's (decimal GB), less 5% for the CUDA context and the allocator's slack.
//! The pipeline takes the whole per-dp-rank batch as micro-batches of one step (grad_accum 1);
//! without a pipeline the micro-batches are accumulated (grad_accum = batch / micro-batch).

use std::fmt::Write as _;

use clap::ValueEnum;
use mtrain_comm::MeshDims;
use mtrain_parallel::analysis::comm_cost::human_time;

use super::machine::Machine;
use super::predict::{predict, Prediction};
use mtrain_parallel::parallelize::{ParallelPlan, ValidPlan};
use mtrain_parallel::plan::PlanError;

use crate::config::{ParallelConfig, Schedule, TrainConfig};

/// The check a plan built here passes before it is priced: the launch's
/// (`mtrain_trainer::resolve::check_plan`, given by the caller).
pub type PlanCheck = dyn Fn(&TrainConfig, ParallelPlan) -> Result<ValidPlan, PlanError>;

/// Most GPUs `--search` enumerates layouts for.
pub const MAX_GPUS: usize = 1 << 16;

/// Fraction of a GPU's memory a layout may plan to use.
pub const USABLE: f64 = 0.95;

/// One layout of the search: the run configuration that trains it and what it costs.
#[derive(Debug, Clone)]
pub struct Found {
    pub cfg: TrainConfig,
    pub dims: MeshDims,
    /// Highest peak of any pipeline rank, bytes.
    pub peak_bytes: u64,
    pub prediction: Prediction,
    /// tp spans more than one node.
    pub tp_crosses: bool,
}

impl Found {
    /// The training flags of this layout (after `mtrain --config FILE`).
    pub fn flags(&self, machine: &Machine) -> String {
        let (c, p, d) = (&self.cfg, &self.cfg.parallel, self.dims);
        let mut f = format!(
            "--nnodes {} --nproc-per-node {} --dp {} --tp {} --pp {}",
            machine.gpus / machine.gpus_per_node,
            machine.gpus_per_node,
            d.dp,
            d.tp,
            d.pp
        );
        if d.ep > 1 {
            let _ = write!(f, " --ep {}", d.ep);
        }
        if p.zero_stage > 0 {
            let _ = write!(f, " --zero-stage {}", p.zero_stage);
        }
        if c.activation_checkpointing {
            f.push_str(" --activation-checkpointing");
        }
        let _ = write!(
            f,
            " --batch-size {} --grad-accum {}",
            c.batch_size, c.grad_accum
        );
        if d.pp > 1 {
            let name = p
                .schedule
                .to_possible_value()
                .map(|v| v.get_name().to_string());
            let _ = write!(
                f,
                " --microbatches {} --schedule {}",
                p.microbatches.unwrap_or(d.pp),
                name.unwrap_or_default()
            );
        }
        f
    }
}

/// The layouts of `cfg`'s model on `machine` for `global_batch` sequences that fit, fastest
/// first, and how many were considered (those past a micro-batch that did not fit are not
/// built: memory grows with the micro-batch, and checkpointing only lowers it).
pub fn search(
    cfg: &TrainConfig,
    machine: &Machine,
    global_batch: usize,
    check: &PlanCheck,
) -> anyhow::Result<(Vec<Found>, usize)> {
    let model = cfg.gpt_config()?;
    let world = machine.gpus;
    let memory = machine.gpu.memory_bytes as f64 * USABLE;
    let n_params = model.n_params() as f64;
    let mut found = Vec::new();
    let mut tried = 0;
    let divisors = |n: usize| (1..=n).filter(move |d| n.is_multiple_of(*d));
    let tps = (0..)
        .map(|k| 1usize << k)
        .take_while(|&t| t <= world && t <= 2 * machine.gpus_per_node);
    for tp in tps {
        for pp in divisors(world / tp).filter(|&pp| pp <= model.n_layer) {
            let dp = world / (tp * pp);
            if !global_batch.is_multiple_of(dp) {
                continue;
            }
            let per_rank = global_batch / dp;
            let eps: Vec<usize> = match &model.moe {
                Some(m) => divisors(dp)
                    .filter(|e| m.n_experts.is_multiple_of(*e))
                    .collect(),
                None => vec![1],
            };
            for ep in eps {
                for zero in 0..=if dp > 1 { 3u8 } else { 0 } {
                    // Model state alone: 16 bytes per parameter, ZeRO's stages shard 12, 14, 16 of them.
                    let sharded = [0.0, 12.0, 14.0, 16.0][zero as usize];
                    let state =
                        n_params / (tp * pp) as f64 * (16.0 - sharded + sharded / dp as f64);
                    if state > memory {
                        continue;
                    }
                    let schedules: &[Schedule] = match pp {
                        1 => &[Schedule::OneFOneB],
                        _ => &[Schedule::OneFOneB, Schedule::Interleaved, Schedule::ZbH1],
                    };
                    for &schedule in schedules {
                        // Memory grows with the micro-batch and checkpointing lowers it: past
                        // the first micro-batch that does not fit with checkpointing, nothing
                        // larger fits, with or without it.
                        let mut too_big_from = usize::MAX;
                        for ac in [true, false] {
                            let mbs = [1, 2, 4]
                                .into_iter()
                                .filter(|b| per_rank.is_multiple_of(*b));
                            for mb in mbs {
                                tried += 1;
                                if mb >= too_big_from {
                                    break;
                                }
                                let mut c = cfg.clone();
                                c.activation_checkpointing = ac;
                                (c.batch_size, c.grad_accum) = match pp {
                                    1 => (mb, per_rank / mb),
                                    _ => (per_rank, 1),
                                };
                                c.parallel = ParallelConfig {
                                    dp: Some(dp),
                                    tp,
                                    pp,
                                    ep,
                                    zero_stage: zero,
                                    schedule,
                                    microbatches: (pp > 1).then_some(per_rank / mb),
                                    ..ParallelConfig::default()
                                };
                                match evaluate(&c, machine, memory, check)? {
                                    Outcome::Fits(f) => found.push(*f),
                                    Outcome::Invalid => {}
                                    Outcome::TooBig => {
                                        if ac {
                                            too_big_from = mb;
                                        }
                                        break;
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    found.sort_by(|a, b| a.prediction.step_s.total_cmp(&b.prediction.step_s));
    Ok((found, tried))
}

/// What one candidate of the search came to.
enum Outcome {
    /// The plan's check refused it (a degree that does not divide, too few micro-batches, ...).
    Invalid,
    /// A pipeline rank's peak is above the memory.
    TooBig,
    Fits(Box<Found>),
}

/// `c`'s layout if its plan is valid and every pipeline rank's peak fits in `memory` bytes.
fn evaluate(
    c: &TrainConfig,
    machine: &Machine,
    memory: f64,
    check: &PlanCheck,
) -> anyhow::Result<Outcome> {
    let p = &c.parallel;
    let dims = MeshDims::new(p.dp.unwrap_or(1), p.pp, p.tp, p.ep);
    let Ok(mut plan) = p.plan(dims, c.activation_checkpointing, c.precision()) else {
        return Ok(Outcome::Invalid);
    };
    plan.backward = c.backward();
    if dims.world_size() != machine.gpus {
        return Ok(Outcome::Invalid);
    }
    let Ok(plan) = check(c, plan) else {
        return Ok(Outcome::Invalid);
    };
    let Ok(reps) = super::stage_representatives(c, &plan) else {
        return Ok(Outcome::Invalid);
    };
    let mut distinct = reps.clone();
    distinct.dedup();
    distinct.sort_unstable();
    distinct.dedup();
    let Ok(ranks) = super::rank_memory_of(c, &plan, distinct) else {
        return Ok(Outcome::Invalid);
    };
    let peak = ranks
        .iter()
        .map(|r| r.analytic.params + r.analytic.optim + r.analytic.peak)
        .max()
        .unwrap_or(0);
    if peak as f64 > memory {
        return Ok(Outcome::TooBig);
    }
    let prediction = predict(c, &plan, machine, None)?;
    Ok(Outcome::Fits(Box::new(Found {
        cfg: c.clone(),
        dims,
        peak_bytes: peak,
        prediction,
        tp_crosses: machine
            .span(dims, mtrain_parallel::analysis::comm_cost::Group::Tp)
            .crosses(),
    })))
}

/// The ranked table: the `top` fastest layouts, the fastest one that puts tp across nodes
/// (flagged) when it is not among them, and the launch flags of the fastest.
pub fn render(
    found: &[Found],
    tried: usize,
    top: usize,
    machine: &Machine,
    config: &str,
) -> String {
    let mut s = format!(
        "search: {tried} layouts considered, {} fit in {:.0} GB x {:.0}% per GPU; fastest first:\n",
        found.len(),
        machine.gpu.memory_bytes as f64 / 1e9,
        USABLE * 100.0
    );
    let _ = writeln!(
        s,
        "{:>3}  {:>3} {:>3} {:>3} {:>3} {:>4} {:>3} {:>3} {:>5} {:<11} {:>8} {:>6} {:>10} {:>10} {:>10} {:>6}  note",
        "#", "dp", "tp", "pp", "ep", "zero", "ac", "mb", "m", "schedule", "peak GB", "bubble", "exposed", "step", "tokens/s", "MFU"
    );
    let row = |i: usize, f: &Found| {
        let (c, p, d) = (&f.cfg, &f.cfg.parallel, f.dims);
        let m = p.microbatches.unwrap_or(1);
        let pr = &f.prediction;
        let sched = match d.pp {
            1 => "-".to_string(),
            _ => p
                .schedule
                .to_possible_value()
                .map(|v| v.get_name().to_string())
                .unwrap_or_default(),
        };
        format!(
            "{:>3}  {:>3} {:>3} {:>3} {:>3} {:>4} {:>3} {:>3} {:>5} {:<11} {:>8.1} {:>6.3} {:>10} {:>10} {:>10.0} {:>5.1}%  {}\n",
            i + 1,
            d.dp,
            d.tp,
            d.pp,
            d.ep,
            p.zero_stage,
            if c.activation_checkpointing { "on" } else { "off" },
            c.batch_size / m,
            m * c.grad_accum,
            sched,
            f.peak_bytes as f64 / 1e9,
            pr.bubble,
            human_time(pr.exposed_s()),
            human_time(pr.step_s),
            pr.tokens_per_s,
            pr.mfu * 100.0,
            if f.tp_crosses { "FLAGGED: tp spans nodes" } else { "" }
        )
    };
    for (i, f) in found.iter().enumerate().take(top) {
        s.push_str(&row(i, f));
    }
    if let Some(i) = found
        .iter()
        .position(|f| f.tp_crosses)
        .filter(|&i| i >= top)
    {
        s.push_str("  ...\n");
        s.push_str(&row(i, &found[i]));
    }
    let crossing = found.iter().filter(|f| f.tp_crosses).count();
    if crossing > 0 {
        let _ = writeln!(
            s,
            "{crossing} fitting layout(s) put a tp group across nodes of {} GPUs: every block's all-reduce then leaves NVLink",
            machine.gpus_per_node
        );
    }
    if let Some(best) = found.first() {
        let _ = writeln!(
            s,
            "(mb: sequences per micro-batch; m: micro-batches per step; exposed: communication the step waits for)\nlaunch the fastest: mtrain --config {config} {} --master-addr HOST0 --master-port 29500 --node-rank R",
            best.flags(machine)
        );
    }
    s
}
