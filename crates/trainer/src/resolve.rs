//! The run resolved once: the command line, the config file and `--set` become the run's
//! description, checked in one place, before anything is launched.
//!
//! ```text
//!   resolve(cli, launched world)
//!     TrainConfig   defaults -> --config -> training flags -> layout and strategy flags over
//!                   [parallel] -> --set                            (config/args.rs, validated)
//!     Layout        the world and the degrees, dp inferred if unset (cli/layout_args.rs)
//!     ValidPlan     [parallel] on the layout's mesh with the run's checkpointing, backward and
//!                   precision, checked against the model, the world and the global batch (check)
//!   -> Resolved { layout, run: RunOptions { cfg, plan, trace } }
//! ```
//!
//! [`check`] is the one place a run's plan is validated (`ParallelPlan::validate`: `dp·pp·tp =
//! world`, what tp and ep must divide, the micro-batches, ...); a plan built in code goes through
//! it too ([`RunOptions::of_plan`]). What it returns, a [`RunOptions`], is what the run takes, and
//! nothing after it checks the configuration or the plan again: the builder takes the
//! [`ValidPlan`] as given. (`bench-comm` has no model to plan for and leaves the numbers to the
//! mesh's own check, `MeshDims::validate`.)

use anyhow::Context;
use mtrain_comm::mesh::MeshDims;
use mtrain_parallel::parallelize::{ParallelPlan, ValidPlan};
use mtrain_parallel::plan::PlanError;

use crate::cli::{Cli, Command};
use crate::config::TrainConfig;
use crate::layout::{Layout, LayoutError};

/// A run with nothing left to check: its configuration (validated) and its parallel plan (checked
/// against the configuration's model, the world and the global batch). Made only by [`resolve`],
/// [`RunOptions::new`] and [`RunOptions::of_plan`].
#[derive(Debug, Clone)]
pub struct RunOptions {
    cfg: TrainConfig,
    /// The parallel plan (dims, DDP or ZeRO, schedule, micro-batches, ...).
    pub plan: ValidPlan,
    /// Record every collective of every group into `RUN_DIR/trace-rank{N}.jsonl`.
    pub trace: bool,
}

impl RunOptions {
    /// The default plan for `dims` (DDP, 1F1B with pp micro-batches) under `cfg`, no trace.
    pub fn new(cfg: &TrainConfig, dims: MeshDims) -> anyhow::Result<Self> {
        let mut plan = ParallelPlan::new(dims);
        plan.microbatches = dims.pp.max(1);
        Self::of_plan(cfg, plan)
    }

    /// `plan`, built in code, with the run's dtypes as its mixed precision, checked ([`check`])
    /// against `cfg`'s model, the plan's world and the global batch; no trace. (The backend's
    /// world is the mesh's check.)
    pub fn of_plan(cfg: &TrainConfig, mut plan: ParallelPlan) -> anyhow::Result<Self> {
        cfg.validate()?;
        cfg.check_fits_host()?;
        plan.precision = cfg.precision();
        let world = plan.dims.world_size();
        let plan = check(cfg, plan, world).context("the layout does not fit the model")?;
        Ok(Self {
            cfg: cfg.clone(),
            plan,
            trace: false,
        })
    }

    /// The run's configuration, as validated.
    pub fn cfg(&self) -> &TrainConfig {
        &self.cfg
    }
}

/// What the command line resolves to: how the job is launched and what every rank runs.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub layout: Layout,
    pub run: RunOptions,
}

/// The training configuration, the layout and the plan of the command `cli` names (training, or
/// `mtrain plan` with its own flags), each resolved and checked once. `launched_world` is the
/// world a worker was started in (None before launching).
pub fn resolve(cli: &Cli, launched_world: Option<usize>) -> anyhow::Result<Resolved> {
    let train = match &cli.command {
        Some(Command::Plan(p)) => &p.args.train,
        _ => &cli.train,
    };
    let cfg = cli
        .config_from(train)
        .context("resolving the training configuration")?;
    if !matches!(cli.command, Some(Command::Plan(_))) {
        // Training builds the model: refuse what this machine cannot hold. `plan` builds nothing.
        cfg.check_fits_host()
            .context("resolving the training configuration")?;
    }
    let layout_args = cli.command_layout()?;
    layout_args.check_device(cfg.device)?;
    let layout = layout_args.resolve(&cfg.parallel, launched_world)?;
    let mut plan = cfg
        .parallel
        .plan(layout.dims, cfg.activation_checkpointing, cfg.precision())
        .map_err(LayoutError::from)?;
    plan.backward = cfg.backward();
    let plan =
        check(&cfg, plan, layout.world_size).map_err(|PlanError(why)| LayoutError::Plan {
            why,
            world_source: layout.world_source.clone(),
        })?;
    let run = RunOptions {
        cfg,
        plan,
        trace: layout.trace,
    };
    Ok(Resolved { layout, run })
}

/// A plan built in code to be priced, not run (`mtrain plan --search`): the launch's check
/// ([`check`]) on the plan's own world, without this machine's memory.
pub fn check_plan(cfg: &TrainConfig, plan: ParallelPlan) -> Result<ValidPlan, PlanError> {
    let world = plan.dims.world_size();
    check(cfg, plan, world)
}

/// The plan's one check: `plan` against `cfg`'s model, `world` ranks and the global batch of one
/// micro-step (`batch_size · dp` sequences), so a layout that cannot work is refused with the
/// arithmetic before anything runs.
fn check(cfg: &TrainConfig, plan: ParallelPlan, world: usize) -> Result<ValidPlan, PlanError> {
    let model = cfg.gpt_config().map_err(|e| PlanError(e.to_string()))?;
    let batch = cfg.batch_size * plan.dims.dp;
    plan.validate(&model, world, batch)
}
