//! `mtrain plan`: show what a layout means before paying for it.
//!
//! ```text
//! mtrain plan --tp 4 --pp 2 [--config FILE] [training flags]
//! ```
//!
//! The layout is resolved and its plan checked exactly as a training launch does it (same
//! flags and `[parallel]` table, same inference of dp and the world size, same error messages),
//! then this prints the rank grid and every process group from [`MeshDims::render`], the
//! model the configuration describes, the layers per stage, each pipeline rank's analytic
//! memory ([`rank_memory`]: the same model and the same numbers as the analytic column of the
//! `--mem-report` table), and the communication estimate.
//! Nothing is launched, no network is touched and the model is never built (any size plans on
//! any machine), so it answers "which ranks talk to which" on a laptop for a 1000-GPU job.
//!
//! ```text
//! mtrain plan --config configs/gpt-70b.toml --gpus 64 --gpus-per-node 8 --gpu h100-sxm --tp 8 --pp 4
//! mtrain plan --config configs/gpt-70b.toml --gpus 64 --gpus-per-node 8 --search --global-batch 1024
//! mtrain plan --collective all-reduce --bytes 128M --ranks 8 --intra nvlink4
//! ```
//!
//! With a cluster ([`machine`]: `--gpus`, `--gpu`, `--intra`, `--inter`) each group is priced on
//! the link it spans, the 16-bytes-per-parameter arithmetic and each rank's peak are set against
//! the GPU's memory, and the step time is predicted ([`predict`]); `--search` ranks every layout
//! that fits ([`search`]); `--collective` prices one collective on a link ([`arithmetic`]).

pub mod arithmetic;
pub mod compute;
pub mod machine;
pub mod predict;
pub mod search;

use clap::Args;
use mtrain_comm::mesh::MeshDims;
use mtrain_parallel::parallelize::{ParallelPlan, ValidPlan};
use mtrain_parallel::pipeline::{PassCosts, Schedule, ScheduleKind};

use crate::config::DeviceKind;
use crate::config::{TrainArgs, TrainConfig};
use crate::layout::Layout;
use crate::memory::{
    bucket_bytes, rank_checkpoint_bytes, rank_params, rank_startup_bytes, step_memory, ActivationLayout, AnalyticMemory, BackwardPath,
    ModelStateLayout,
};

/// Options of `mtrain plan`: the training flags, so `--config` and overrides resolve as in training.
#[derive(Debug, Clone, Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub train: TrainArgs,

    /// α-β table for the communication estimate (written by `bench-comm --fit`); without it,
    /// the built-in defaults of the backend (CPU loopback, or NVLink-class with --device cuda).
    #[arg(long, value_name = "FILE")]
    pub alpha_beta: Option<std::path::PathBuf>,

    /// Put the predicted traffic and time next to what a `--trace` run recorded in RUN_DIR.
    #[arg(long, value_name = "RUN_DIR")]
    pub compare: Option<std::path::PathBuf>,

    #[command(flatten)]
    pub cluster: machine::ClusterArgs,

    /// Rank every layout that fits the cluster's memory by predicted step time (the layout
    /// flags given are not used).
    #[arg(long)]
    pub search: bool,

    /// Sequences per optimizer step for --search (default: batch_size · grad_accum · dp of the
    /// resolved layout).
    #[arg(long, value_name = "SEQUENCES")]
    pub global_batch: Option<usize>,

    /// Layouts --search lists (default 10).
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub top: usize,

    /// A one-rank run's forward of one micro-batch of the whole model, measured (ms, the
    /// `forward` of `--profile-phases`): the prediction's compute instead of FLOPs at --mfu,
    /// split over the stages by their FLOPs and over tp.
    #[arg(long, value_name = "MS")]
    pub forward_ms: Option<f64>,

    /// The same run's backward (ms; default twice --forward-ms).
    #[arg(long, value_name = "MS", requires = "forward_ms")]
    pub backward_ms: Option<f64>,

    /// The fraction of the measured passes a tp rank runs whole, not split by tp (0 to 1: the
    /// LayerNorm, residual and embedding rows' share of the one-rank run's `--profile-ops`
    /// table; predict.rs `tp_rank_part`).
    #[arg(long, value_name = "F", default_value_t = 0.0, requires = "forward_ms")]
    pub tp_whole: f64,

    #[command(flatten)]
    pub collective: arithmetic::CollectiveArgs,
}

/// The plan as text: the launch, the mesh, the model and the batch.
pub fn render(cfg: &TrainConfig, layout: &Layout) -> Result<String, crate::config::ConfigError> {
    let dims: MeshDims = layout.dims;
    let spec = &layout.launch;
    let mut out = format!(
        "world size {} = dp({}) * pp({}) * {}tp({}), ep({}) inside dp; {} process(es) per node x {} node(s), rendezvous at {}:{}\n",
        layout.world_size,
        dims.dp,
        dims.pp,
        if dims.cp > 1 { format!("cp({}) * ", dims.cp) } else { String::new() },
        dims.tp,
        dims.ep,
        spec.nproc_per_node,
        spec.nnodes,
        spec.master_addr,
        spec.master_port.map_or_else(|| "<free port>".to_string(), |p| p.to_string()),
    );
    out.push_str(&dims.render());

    let model = cfg.gpt_config()?;
    out.push_str(&format!(
        "model: {} layers, {} heads, width {}, vocab {}, context {}; {:.2}M parameters{}\n",
        model.n_layer,
        model.n_head,
        model.n_embd,
        model.vocab_size,
        model.block_size,
        model.n_params() as f64 / 1e6,
        match &model.moe {
            Some(_) => format!(
                " ({:.2}M active per token)",
                model.n_active_params() as f64 / 1e6
            ),
            None => String::new(),
        },
    ));
    out.push_str(&format!(
        "batch: {} sequences x {} tokens per dp rank, x dp({}) x grad_accum({}) = {} tokens per step\n",
        cfg.batch_size,
        cfg.seq_len,
        dims.dp,
        cfg.grad_accum,
        cfg.batch_size * cfg.seq_len * dims.dp * cfg.grad_accum,
    ));
    Ok(out)
}

/// The pipeline schedule's grid at equal pass costs, with its bubble and each rank's peak of
/// (micro-batch, chunk) activation sets held at once.
pub fn render_schedule(kind: ScheduleKind, pp: usize, m: usize) -> anyhow::Result<String> {
    render_schedule_at(kind, pp, m, None)
}

/// [`render_schedule`] at `fbw`, the costs (ms) of one stage's F, B and W (None: equal): the
/// fused backward costs B + W, a chunk of a two-chunk schedule half of each. The bubble is
/// rank 0's idle over the pipeline's step, the step its simulated length.
pub fn render_schedule_at(
    kind: ScheduleKind,
    pp: usize,
    m: usize,
    fbw: Option<[f64; 3]>,
) -> anyhow::Result<String> {
    let sched = Schedule::new(kind, pp, m)?;
    let (costs, unit) = match (fbw, kind.splits_backward()) {
        (None, true) => (
            PassCosts::EQUAL_SPLIT,
            "F = B = W, one column each".to_string(),
        ),
        (None, false) => (
            PassCosts::UNIT,
            "equal forward and backward, one column each".to_string(),
        ),
        (Some(fbw), _) => (PassCosts::of_stage(kind, fbw), costs_label(fbw)),
    };
    let sim = sched.simulate_with(&vec![costs; sched.num_model_stages()])?;
    let peaks: Vec<String> = (0..pp).map(|r| sim.peak_in_flight(r).to_string()).collect();
    let step = match fbw {
        Some(_) => format!(", step {:.1} ms", sim.makespan()),
        None => String::new(),
    };
    Ok(format!(
        "pipeline schedule {kind}, pp {pp}, {m} micro-batches ({unit}): bubble {:.3}{step}, \
         peak activation sets (micro-batch x chunk) per rank [{}]\n{}",
        sim.bubble_fraction(0),
        peaks.join(", "),
        sim.render()
    ))
}

fn costs_label([f, b, w]: [f64; 3]) -> String {
    format!("F {f} ms, B {b} ms, W {w} ms per stage")
}

/// The zero-bubble order `plan` trains under its `pass_costs` ([`ParallelPlan::schedule`], the
/// one order the executor is given) beside the unit-clock one [`render_schedule_at`] draws: both
/// bubbles, each as a multiple of 1F1B's at the same costs, and the cost-aware grid. `None`
/// without `pass_costs`, or for the schedules that do not split the backward (their order does
/// not depend on costs).
pub fn render_cost_aware(plan: &ParallelPlan) -> anyhow::Result<Option<String>> {
    let (kind, pp, m) = (plan.effective_schedule(), plan.dims.pp, plan.microbatches);
    let Some(fbw) = plan.pass_costs.filter(|_| kind.splits_backward()) else {
        return Ok(None);
    };
    let bubble = |kind: ScheduleKind, sched: &Schedule| -> anyhow::Result<(f64, f64)> {
        let costs = vec![PassCosts::of_stage(kind, fbw); sched.num_model_stages()];
        let sim = sched.simulate_with(&costs)?;
        Ok((sim.bubble_fraction(0), sim.makespan()))
    };
    let unit = Schedule::new(kind, pp, m)?;
    let costs = vec![PassCosts::of_stage(kind, fbw); unit.num_model_stages()];
    let aware = plan.schedule()?;
    let base = bubble(
        ScheduleKind::OneFOneB,
        &Schedule::new(ScheduleKind::OneFOneB, pp, m)?,
    )?
    .0;
    let (u, _) = bubble(kind, &unit)?;
    let (a, step) = bubble(kind, &aware)?;
    let head = format!(
        "cost-aware {kind} order (what training runs under these --pass-costs), built for {}: \
         bubble {a:.3}, step {step:.1} ms; \
         of 1F1B's bubble {base:.3} at these costs: unit-clock {:.2}x, cost-aware {:.2}x",
        costs_label(fbw),
        u / base,
        a / base,
    );
    if aware == unit {
        return Ok(Some(format!(
            "{head} (the unit-clock order: none built for the costs is shorter)
"
        )));
    }
    let sim = aware.simulate_with(&costs)?;
    let peaks: Vec<String> = (0..pp).map(|r| sim.peak_in_flight(r).to_string()).collect();
    Ok(Some(format!(
        "{head}, peak activation sets per rank [{}]\n{}",
        peaks.join(", "),
        sim.render()
    )))
}

/// What one pipeline rank (any of its tp, dp and ep ranks alike) should hold under a plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankMemory {
    pub pp_rank: usize,
    /// Parameters, gradients and optimizer state ([`ModelStateLayout::for_plan`] of the
    /// parameters the rank owns, [`rank_params`]).
    pub state: ModelStateLayout,
    /// The report's analytic column: the model state, and what a step adds to it
    /// ([`step_memory`] on the run's backward path; the DDP buckets, [`bucket_bytes`]).
    pub analytic: AnalyticMemory,
    /// What the rank holds once its model is built, before the first step
    /// ([`rank_startup_bytes`]).
    pub startup: u64,
    /// A checkpoint's bound: (the rank's pieces, its largest piece), in bytes
    /// ([`rank_checkpoint_bytes`]).
    pub checkpoint: (u64, u64),
}

/// Each pipeline rank's analytic memory under `plan` for the run `cfg`: the report's model, fed
/// from the plan instead of from a built model.
pub fn rank_memory(cfg: &TrainConfig, plan: &ParallelPlan) -> anyhow::Result<Vec<RankMemory>> {
    rank_memory_of(cfg, plan, 0..plan.dims.pp.max(1))
}

/// For each pipeline rank, the first rank that runs stages of the same shape (as many blocks in
/// each of its chunks, the embedding and the head alike): its collectives are the same, and
/// as the first it holds the most activation sets in flight (GPipe, 1F1B, interleaved and
/// ZB-H1 hold fewer the later the rank), so it stands for the others in a peak and a step.
pub fn stage_representatives(cfg: &TrainConfig, plan: &ParallelPlan) -> anyhow::Result<Vec<usize>> {
    let model = cfg.gpt_config()?;
    let pp = plan.dims.pp.max(1);
    let layout = plan.stage_layout(model.n_layer)?;
    let last = layout.num_stages() - 1;
    let shape = |r: usize| -> Vec<(usize, bool, bool)> {
        (0..layout.num_stages())
            .filter(|&s| layout.rank_of_stage(s, pp) == r)
            .map(|s| (layout.blocks(s).len(), s == 0, s == last))
            .collect()
    };
    let shapes: Vec<_> = (0..pp).map(shape).collect();
    Ok((0..pp)
        .map(|r| (0..=r).find(|&q| shapes[q] == shapes[r]).unwrap_or(r))
        .collect())
}

/// [`rank_memory`] of the pipeline ranks `pp_ranks` only.
pub fn rank_memory_of(
    cfg: &TrainConfig,
    plan: &ParallelPlan,
    pp_ranks: impl IntoIterator<Item = usize>,
) -> anyhow::Result<Vec<RankMemory>> {
    let model = cfg.gpt_config()?;
    let path = BackwardPath::of(cfg.backward(), cfg.device == DeviceKind::Cuda);
    pp_ranks
        .into_iter()
        .map(|pp_rank| {
            let n = rank_params(&model, plan, pp_rank)?;
            let state = ModelStateLayout::for_plan(n, plan);
            let act = ActivationLayout::for_plan(&model, plan, pp_rank, cfg.batch_size)?;
            let step = step_memory(&model, &act, &state, cfg.step_run(path));
            let comm = bucket_bytes(plan, n);
            Ok(RankMemory {
                pp_rank,
                state,
                analytic: AnalyticMemory::new(&state, step, comm),
                startup: rank_startup_bytes(&model, plan, pp_rank)?,
                checkpoint: rank_checkpoint_bytes(&model, plan, pp_rank)?,
            })
        })
        .collect()
}

/// The memory section of `plan`: the precision, then one line per pipeline rank.
pub fn render_memory(plan: &ParallelPlan, ranks: &[RankMemory]) -> String {
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let precision = match plan.precision.is_mixed() {
        true => "bf16 weights and gradients, fp32 masters + Adam",
        false => "fp32 weights, gradients and Adam",
    };
    let mut out =
        format!("memory per rank (analytic, as in the --mem-report table; {precision}):\n");
    for r in ranks {
        let (s, a) = (&r.state, &r.analytic);
        out.push_str(&format!(
            "pp rank {}: {} params, startup {:.2} MiB, model state {:.2} MiB (parameters {:.2}, gradients {:.2}, optimizer states {:.2}); a step adds activations {:.2} MiB, gathered weights {:.2}, comm buffers {:.2}: after forward +{:.2}, peak +{:.2} MiB\n",
            r.pp_rank,
            s.n_params,
            mib(r.startup),
            mib(s.total()),
            mib(a.params),
            mib(a.grads),
            mib(a.optim),
            mib(a.activations),
            mib(a.gathered),
            mib(a.comm),
            mib(a.forward()),
            mib(a.peak),
        ));
        let (pieces, largest) = r.checkpoint;
        out.push_str(&format!(
            "  checkpoint: its pieces {:.2} MiB (weights, Adam m and v); writing rises by at most {:.2} MiB (one piece), \
             a resume by at most {:.2} MiB\n",
            mib(pieces),
            mib(largest),
            mib(pieces + largest),
        ));
    }
    out
}

/// `mtrain plan`: print the grid, the plan's layers per stage
/// ([`mtrain_parallel::parallelize::describe`]), each pipeline rank's memory
/// ([`rank_memory`]) and the communication section, for the run
/// configuration `cfg` on `layout` under `plan` (as [`crate::resolve::resolve`] built and checked it).
pub fn run(
    cfg: &TrainConfig,
    layout: &Layout,
    plan: &ValidPlan,
    args: &PlanArgs,
    check: &search::PlanCheck,
) -> anyhow::Result<()> {
    for (name, ms) in [("--forward-ms", args.forward_ms), ("--backward-ms", args.backward_ms)] {
        if let Some(ms) = ms {
            crate::validate::positive(name, ms).map_err(anyhow::Error::msg)?;
        }
    }
    if !(0.0..=1.0).contains(&args.tp_whole) {
        anyhow::bail!("--tp-whole {} must be a fraction from 0 to 1 (the share of the passes tp leaves whole)", args.tp_whole);
    }
    if args.search {
        let machine = args.cluster.machine(layout.world_size)?;
        if machine.gpus > search::MAX_GPUS {
            anyhow::bail!("--search ranks layouts of up to {} GPUs, not {}", search::MAX_GPUS, machine.gpus);
        }
        let batch = cfg.batch_size * cfg.grad_accum * plan.dims.dp;
        let global = args.global_batch.unwrap_or(batch);
        if global == 0 || global > crate::validate::MAX_COUNT {
            anyhow::bail!("--global-batch {global} must be between 1 and {}", crate::validate::MAX_COUNT);
        }
        let model = cfg.gpt_config()?;
        println!(
            "model: {} layers, width {}, {} heads, context {}; {:.2}B parameters; global batch {global} sequences of {} tokens",
            model.n_layer,
            model.n_embd,
            model.n_head,
            model.block_size,
            model.n_params() as f64 / 1e9,
            cfg.seq_len
        );
        print!("{}", machine.render(plan.dims, 0).lines().take(3).map(|l| format!("{l}\n")).collect::<String>());
        print!("{}", arithmetic::render_model_state(model.n_params() as u64, machine.gpu.memory_bytes));
        let (found, tried) = search::search(cfg, &machine, global, check)?;
        let config = args.train.config.as_ref().map_or("FILE".into(), |p| p.display().to_string());
        print!("{}", search::render(&found, tried, args.top, &machine, &config));
        return Ok(());
    }
    print!("{}", render(cfg, layout)?);
    print!(
        "{}",
        mtrain_parallel::parallelize::describe(&cfg.gpt_config()?, plan)
    );
    let kind = plan.effective_schedule();
    if plan.dims.pp > 1 {
        let (pp, m, fbw) = (plan.dims.pp, plan.microbatches, plan.pass_costs);
        print!("{}", render_schedule_at(kind, pp, m, fbw)?);
        print!("{}", render_cost_aware(plan)?.unwrap_or_default());
    }
    let ranks = rank_memory(cfg, plan)?;
    print!("{}", render_memory(plan, &ranks));
    if !args.cluster.given() {
        let (ab, cmp) = (args.alpha_beta.as_deref(), args.compare.as_deref());
        print!("{}", crate::tools::cost::plan_report(cfg, plan, ab, cmp)?);
        return Ok(());
    }
    let machine = args.cluster.machine(layout.world_size)?;
    let measured = args.forward_ms.map(|f| predict::Measured {
        forward_s: f / 1e3,
        backward_s: args.backward_ms.map(|b| b / 1e3),
        tp_whole: args.tp_whole,
    });
    print!("{}", render_cluster(cfg, plan, &machine, &ranks, measured)?);
    Ok(())
}

/// What a cluster adds to `plan`: the links each group spans (a tp group across nodes warned
/// about), the model-state arithmetic, each pipeline rank's peak against the GPU's memory, the
/// step's collectives priced on their links, and the predicted step.
pub fn render_cluster(
    cfg: &TrainConfig,
    plan: &ValidPlan,
    machine: &machine::Machine,
    ranks: &[RankMemory],
    measured: Option<predict::Measured>,
) -> anyhow::Result<String> {
    use mtrain_parallel::analysis::comm_cost::{render, step_collectives, StepShape};
    let model = cfg.gpt_config()?;
    let dims = plan.dims;
    let mb = cfg.batch_size / plan.microbatches.max(1);
    let act = cfg.dtype.candle().size_in_bytes();
    let block_out = (mb * cfg.seq_len * model.n_embd * act) as u64;
    let mut s = machine.render(dims, block_out);
    let card = machine.gpu.memory_bytes;
    s.push_str(&arithmetic::render_model_state(model.n_params() as u64, card));
    for r in ranks {
        let a = &r.analytic;
        let peak = a.params + a.optim + a.peak;
        s.push_str(&format!(
            "pp rank {}: peak {:.1} GB of {:.0} GB{}\n",
            r.pp_rank,
            peak as f64 / 1e9,
            card as f64 / 1e9,
            if peak as f64 > card as f64 * search::USABLE { " — does not fit" } else { "" }
        ));
    }
    let shape = StepShape {
        batch: cfg.batch_size * dims.dp,
        seq_len: cfg.seq_len,
        dtype: match cfg.dtype {
            crate::config::DTypeKind::F32 => candle_core::DType::F32,
            _ => candle_core::DType::BF16,
        },
    };
    s.push_str("communication of one micro-step that ends an optimizer step, each group on the link it spans:\n");
    let price = |g, op, n| machine.model(dims, g, op, n);
    for p in 0..dims.pp {
        let rank = dims.rank_of(0, p, 0);
        let items = step_collectives(&model, plan, shape, rank)?;
        s.push_str(&format!("rank {rank} (pp stage {p}, dp 0, tp 0):\n"));
        s.push_str(&render(&items, dims, &price));
    }
    let p = predict::predict(cfg, plan, machine, measured)?;
    s.push_str(&predict::render(&p));
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DTypeKind, ParallelConfig};
    use mtrain_parallel::pipeline::Action;

    /// Mixed precision: bf16 weights and gradients are half the fp32 figures, fp32 masters and
    /// Adam 12 bytes per parameter; the total stays 16 bytes per parameter.
    #[test]
    fn mixed_precision_halves_weights_and_gradients_at_16_bytes_per_parameter() {
        let dims = MeshDims::new(2, 2, 2, 1);
        let memory = |dtype| {
            let cfg = TrainConfig {
                dtype,
                ..TrainConfig::default()
            };
            let plan = ParallelConfig::default()
                .plan(dims, false, cfg.precision())
                .unwrap();
            let ranks = rank_memory(&cfg, &plan).unwrap();
            (render_memory(&plan, &ranks), ranks)
        };
        let (f_text, f) = memory(DTypeKind::F32);
        let (m_text, m) = memory(DTypeKind::Bf16);
        assert!(
            f_text.contains("fp32 weights, gradients and Adam"),
            "{f_text}"
        );
        assert!(
            m_text.contains("bf16 weights") && m_text.contains("fp32 masters + Adam"),
            "{m_text}"
        );
        assert_eq!(f.len(), 2);
        for (f, m) in f.iter().zip(&m) {
            let (f, m) = (&f.state, &m.state);
            assert_eq!(m.total(), f.total(), "16 bytes per parameter either way");
            assert_eq!((2 * m.params(), 2 * m.grads()), (f.params(), f.grads()));
            assert_eq!(2 * m.optim(), 3 * f.optim(), "12 bytes against 8");
            assert_eq!(f.total(), 16 * f.n_params);
        }
    }

    /// The plan of `kind` at pp 4, 8 micro-batches, built for the costs measured at pp 2.
    fn measured_plan(kind: ScheduleKind, fbw: Option<[f64; 3]>) -> ParallelPlan {
        let mut plan = ParallelPlan::new(MeshDims::new(1, 4, 1, 1));
        (plan.schedule, plan.microbatches, plan.pass_costs) = (kind, 8, fbw);
        plan
    }

    /// `--pass-costs` adds the order built for the costs: ZB-V's at pp 4 draws its grid and
    /// shrinks the bubble (0.37x of 1F1B's to 0.26x at the measured costs); ZB-H1's is its
    /// unit-clock order, already the shortest; 1F1B has none, nor a plan without costs.
    #[test]
    fn the_plan_prints_the_cost_aware_order_beside_the_unit_clock_one() {
        let measured = Some([12.6, 12.6, 9.8]);
        let v = render_cost_aware(&measured_plan(ScheduleKind::ZeroBubbleV, measured)).unwrap();
        let v = v.unwrap();
        assert!(
            v.starts_with(
                "cost-aware ZB-V order (what training runs under these --pass-costs), built for \
                 F 12.6 ms, B 12.6 ms, W 9.8 ms"
            ),
            "{v}"
        );
        assert!(
            v.contains(
                "bubble 0.072, step 301.7 ms; of 1F1B's bubble 0.273 at these costs: \
                 unit-clock 0.37x, cost-aware 0.26x"
            ),
            "{v}"
        );
        assert!(v.contains("\nrank 3 | "), "{v}");
        let h1 = render_cost_aware(&measured_plan(ScheduleKind::ZeroBubbleH1, measured)).unwrap();
        let h1 = h1.unwrap();
        assert!(
            h1.contains("unit-clock 0.52x, cost-aware 0.52x (the unit-clock order"),
            "{h1}"
        );
        for plan in [
            measured_plan(ScheduleKind::OneFOneB, measured),
            measured_plan(ScheduleKind::ZeroBubbleV, None),
        ] {
            assert!(render_cost_aware(&plan).unwrap().is_none(), "{plan:?}");
        }
    }

    /// The grid `mtrain plan --pass-costs` prints is the order the executor is given
    /// (`parallelize` builds it from [`ParallelPlan::schedule`]), drawn from the order itself:
    /// every rank's row, pass by pass, at pp 2 and 4.
    #[test]
    fn the_printed_cost_aware_grid_is_the_executors_order() {
        for pp in [2, 4] {
            let mut plan = measured_plan(ScheduleKind::ZeroBubbleV, Some([12.6, 12.6, 9.8]));
            plan.dims.pp = pp;
            let printed = render_cost_aware(&plan).unwrap().unwrap();
            let sched = plan.schedule().unwrap();
            let unit = Schedule::new(ScheduleKind::ZeroBubbleV, pp, 8).unwrap();
            assert_ne!(
                sched, unit,
                "pp {pp}: the cost-aware order is the unit-clock one"
            );
            let rows = |s: &str| -> Vec<Vec<String>> {
                s.lines()
                    .filter_map(|l| l.split_once(" | ").map(|(_, r)| r))
                    .map(|r| {
                        r.split_whitespace()
                            .filter(|c| c.len() > 1)
                            .map(String::from)
                            .collect()
                    })
                    .collect()
            };
            let runs: Vec<Vec<String>> = (0..pp)
                .map(|r| {
                    let label = |a: &Action| {
                        let k = if a.is_forward() {
                            'F'
                        } else if a.computes_weight_grads() {
                            'W'
                        } else {
                            'B'
                        };
                        format!("{k}{}.{}", a.mb(), a.chunk())
                    };
                    sched.actions(r).iter().map(label).collect()
                })
                .collect();
            assert_eq!(rows(&printed), runs, "pp {pp}: the printed grid\n{printed}");
        }
    }

    /// `mtrain plan` draws the zero-bubble grids: ZB-V at pp 4 puts stages 0 and 7 on rank 0.
    #[test]
    fn the_plan_draws_the_zero_bubble_grids() {
        let v = render_schedule(ScheduleKind::ZeroBubbleV, 4, 8).unwrap();
        assert!(
            v.starts_with("pipeline schedule ZB-V, pp 4, 8 micro-batches"),
            "{v}"
        );
        assert!(
            v.contains("rank 3 | ") && v.contains("W7.0") && v.contains("B7.1"),
            "{v}"
        );
        let h1 = render_schedule(ScheduleKind::ZeroBubbleH1, 4, 8).unwrap();
        assert!(h1.contains("bubble 0.111"), "{h1}");
        // At F = B = W given as costs the grid and the bubble are the equal-cost ones; a step
        // of 3M + P − 1 = 27 passes of 2 ms.
        let at = render_schedule_at(ScheduleKind::ZeroBubbleH1, 4, 8, Some([2.0, 2.0, 2.0]));
        let at = at.unwrap();
        assert!(at.contains("bubble 0.111, step 54.0 ms"), "{at}");
        assert_eq!(
            at.lines().skip(1).collect::<Vec<_>>(),
            h1.lines().skip(1).collect::<Vec<_>>()
        );
        assert!(
            h1.contains("rank 0 | F0 F1 F2 F3 .  .  .  B0 W0 F4"),
            "{h1}"
        );
    }
}
