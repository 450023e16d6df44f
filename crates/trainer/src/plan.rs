//! `mtrain plan`: show what a layout means before paying for it.
//!
//! ```text
//! mtrain plan --tp 4 --pp 2 [--config FILE] [training flags]
//! ```
//!
//! The layout is resolved and its plan checked exactly as a training launch does it (same
//! flags and `[parallel]` table, same inference of dp and the world size, same error messages),
//! then this prints the rank grid and every process group from [`MeshDims::render`], the
//! model the configuration describes, the layers per stage, and the communication estimate.
//! Nothing is launched and no network is touched, so it answers "which ranks talk to which" on
//! a laptop for a 1000-GPU job.

use clap::Args;
use mtrain_comm::mesh::MeshDims;
use mtrain_parallel::parallelize::ParallelPlan;

use crate::config::{TrainArgs, TrainConfig};
use crate::layout::Layout;

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

/// The plan as text: the launch, the mesh, the model and the batch.
pub fn render(cfg: &TrainConfig, layout: &Layout) -> Result<String, crate::config::ConfigError> {
    let dims: MeshDims = layout.dims;
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

/// `mtrain plan`: print the grid, the plan's layers per stage and per-rank estimate
/// ([`mtrain_parallel::parallelize::describe`]) and the communication section, for the run
/// configuration `cfg` on `layout` under `plan` (as [`crate::layout::plan`] built and checked it).
pub fn run(
    cfg: &TrainConfig,
    layout: &Layout,
    plan: &ParallelPlan,
    args: &PlanArgs,
) -> anyhow::Result<()> {
    print!("{}", render(cfg, layout)?);
    print!(
        "{}",
        mtrain_parallel::parallelize::describe(&cfg.gpt_config()?, plan)
    );
    let (ab, cmp) = (args.alpha_beta.as_deref(), args.compare.as_deref());
    print!("{}", crate::cost::plan_report(cfg, plan, ab, cmp)?);
    Ok(())
}
