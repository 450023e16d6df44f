//! `mtrain plan`: show what a layout means before paying for it.
//!
//! ```text
//! mtrain plan --tp 4 --pp 2 [--config FILE] [training flags]
//! ```
//!
//! Resolves the layout exactly as a training launch would (same flags, same inference of dp and
//! the world size, same error messages), then prints the rank grid and every process group from
//! [`MeshDims::render`], and the model the configuration describes. Nothing is launched and no
//! network is touched, so it answers "which ranks talk to which" on a laptop for a 1000-GPU job.

use clap::Args;
use mtrain_comm::mesh::MeshDims;

use crate::cli::{Layout, LayoutArgs, LayoutError};
use crate::config::TrainArgs;

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
}

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Mesh(#[from] mtrain_comm::CommError),
    #[error("resolving the training configuration: {0:#}")]
    Config(anyhow::Error),
}

/// The plan as text: the launch, the mesh and the model.
pub fn render(layout: &Layout, args: &PlanArgs) -> Result<String, PlanError> {
    let dims: MeshDims = layout.dims;
    dims.validate(layout.world_size)?;
    let spec = &layout.launch;
    let mut out = format!(
        "world size {} = dp({}) * pp({}) * tp({}), ep({}) inside dp; {} process(es) per node x {} node(s), rendezvous at {}:{}\n",
        layout.world_size,
        dims.dp,
        dims.pp,
        dims.tp,
        dims.ep,
        spec.nproc_per_node,
        spec.nnodes,
        spec.master_addr,
        spec.master_port.map_or_else(|| "<free port>".to_string(), |p| p.to_string()),
    );
    out.push_str(&dims.render());

    let cfg = args.train.resolve().map_err(PlanError::Config)?;
    let model = cfg.gpt_config().map_err(|e| PlanError::Config(e.into()))?;
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

/// The parallel plan of the strategy flags, checked against the model and batch (refused with
/// the arithmetic), then its layers per stage and per-rank memory estimate
/// ([`mtrain_parallel::parallelize::describe`]).
pub fn describe_plan(
    layout: &Layout,
    strategy: &crate::cli::StrategyArgs,
    args: &PlanArgs,
) -> Result<String, PlanError> {
    let cfg = args.train.resolve().map_err(PlanError::Config)?;
    let model = cfg.gpt_config().map_err(|e| PlanError::Config(e.into()))?;
    let mut plan = strategy.plan(layout.dims, cfg.activation_checkpointing)?;
    // The run's dtypes decide the plan's mixed precision, as in training.
    plan.precision = cfg.precision();
    plan.validate(&model, layout.world_size, cfg.batch_size * layout.dims.dp)
        .map_err(|e| PlanError::Config(e.into()))?;
    Ok(mtrain_parallel::parallelize::describe(&model, &plan))
}

/// `mtrain plan`: resolve and print.
pub fn run(
    layout: &LayoutArgs,
    strategy: &crate::cli::StrategyArgs,
    args: &PlanArgs,
) -> Result<(), PlanError> {
    let layout = layout.resolve(None)?;
    print!("{}", render(&layout, args)?);
    print!("{}", describe_plan(&layout, strategy, args)?);
    let (ab, cmp) = (args.alpha_beta.as_deref(), args.compare.as_deref());
    let comm = crate::cost::plan_report(layout.dims, strategy, &args.train, ab, cmp)
        .map_err(|e| PlanError::Config(e.into()))?;
    print!("{comm}");
    Ok(())
}
