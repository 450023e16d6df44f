//! The job's layout: the [`Layout`] the `[parallel]` table (`crate::config::ParallelConfig`)
//! resolves to on this job's processes, and the errors of a layout that cannot run.
//!
//! ```text
//!   defaults -> [parallel] of --config -> layout flags -> --set parallel.KEY=VALUE   (TrainConfig)
//!            -> Layout (cli::LayoutArgs::resolve: the world, dp inferred if unset)
//! ```
//!
//! [`Layout`] only infers what was left out; whether the numbers fit together and fit the model
//! (`dp · pp · tp = world`, ...) is the plan's one check, in [`crate::resolve`]. A run records the
//! plan it ran (`ParallelConfig::of_plan`) in its checkpoints.

use std::time::Duration;

use mtrain_comm::mesh::MeshDims;

use crate::launch::{LaunchSpec, MAX_WORLD};

/// A layout that cannot run.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    /// A degree or a process count of zero (nothing can be inferred from it).
    #[error("{what} must be at least 1, got 0 (the flag or the [parallel] table)")]
    Zero { what: &'static str },

    /// dp is unset and the world does not split into tp·pp groups.
    #[error("world size {world} ({world_source}) is not divisible by {tp} * pp({pp}) = {tp_pp}, so dp cannot be inferred")]
    NotDivisible {
        world: usize,
        world_source: String,
        /// `tp(T)`, or `cp(C) * tp(T)`.
        tp: String,
        pp: usize,
        tp_pp: usize,
    },

    /// The world does not spread evenly over the nodes.
    #[error("dp({dp}) * pp({pp}) * {tp} = {world} processes cannot be spread evenly over {nnodes} nodes ({world} % {nnodes} = {rem}); pass --nproc-per-node")]
    Uneven {
        dp: usize,
        pp: usize,
        /// `tp(T)`, or `cp(C) * tp(T)`.
        tp: String,
        world: usize,
        nnodes: usize,
        rem: usize,
    },

    #[error("{what} {value} is above the largest supported world of {MAX_WORLD} processes")]
    TooLarge { what: &'static str, value: usize },

    #[error("world size {world} ({world_source}) is above the largest supported {MAX_WORLD}")]
    WorldTooLarge { world: usize, world_source: String },

    /// A layout flag given before a subcommand and after it, with two values.
    #[error(
        "{flag} is given twice, {before} before the subcommand and {after} after it; give it once"
    )]
    GivenTwice {
        flag: &'static str,
        before: String,
        after: String,
    },

    #[error("--comm-timeout must be a positive number of seconds up to {MAX_COMM_TIMEOUT_S} (30 days), got {0:?}")]
    Timeout(f64),

    /// A flag that acts only on CUDA GPUs, given for a run on another device.
    #[error("{flag} needs --device cuda: {why}")]
    NeedsCuda { flag: String, why: &'static str },

    /// A flag that acts only on the CPU backend, given for a run whose collectives it is not.
    #[error("{flag} applies to the CPU backend only: {why}")]
    NeedsCpu { flag: String, why: &'static str },

    /// The plan's check's reasons (`ParallelPlan::validate`), with where the world size came from.
    #[error("{why} ({world_source})")]
    Plan { why: String, world_source: String },

    #[error("--link {given:?}: {why}; give ALPHA_US,GBPS (e.g. 20000,0.05) or a link preset, then optionally ,switch or ,ring")]
    Link { given: String, why: String },

    #[error("{0}")]
    Config(#[from] crate::config::ConfigError),

    #[error("{0}")]
    Launch(#[from] crate::launch::LaunchError),
}

/// Longest `--comm-timeout` accepted, in seconds (30 days; longer deadlines overflow a clock).
pub const MAX_COMM_TIMEOUT_S: f64 = 30.0 * 86400.0;

/// A layout with nothing left to infer: the mesh dimensions and how the world is launched.
/// Whether the numbers fit together and fit the model is the plan's check
/// (`crate::resolve`).
#[derive(Debug, Clone)]
pub struct Layout {
    pub dims: MeshDims,
    pub world_size: usize,
    /// Where the world size came from, for messages: `nproc-per-node 4 * nnodes 1`, `WORLD_SIZE=8`.
    pub world_source: String,
    pub launch: LaunchSpec,
    pub comm_timeout: Duration,
    /// Which backend runs the collectives on GPUs (`--comm`).
    pub comm: CommChoice,
    /// Record every collective (`--trace`).
    pub trace: bool,
    /// The CPU backend's all-reduce algorithm (`--algo`).
    pub algo: AlgoFlag,
    /// The α-β table whose fitted thresholds `--algo auto` reads (`--algo-table`).
    pub algo_table: Option<std::path::PathBuf>,
    /// The emulated link of the CPU backend (`--link`).
    pub link: Option<mtrain_comm::cpu::LinkEmulator>,
}

/// The CPU backend's all-reduce algorithm (`--algo`); every rank picks the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum AlgoFlag {
    /// Ring reduce-scatter + ring all-gather: bandwidth-optimal, 2(p−1) steps.
    #[default]
    Ring,
    /// Binary-tree reduce then broadcast, pipelined: 2·log2 p steps.
    Tree,
    /// Recursive halving-doubling: the ring's bytes in 2·log2 p steps.
    Rhd,
    /// By message size and group size: the thresholds of --algo-table, else the cost model's.
    Auto,
}

impl std::fmt::Display for AlgoFlag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AlgoFlag::Ring => "ring",
            AlgoFlag::Tree => "tree",
            AlgoFlag::Rhd => "rhd",
            AlgoFlag::Auto => "auto",
        })
    }
}

/// The collective backend on GPUs (`--comm`); the CPU device always uses the CPU backend, and
/// any value but `auto` is refused there ([`crate::cli::LayoutArgs::check_device`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum CommChoice {
    /// NCCL with one GPU per rank, CUDA IPC where ranks share a GPU.
    #[default]
    Auto,
    /// NCCL (one GPU per rank).
    Nccl,
    /// The ranks of the node read each other's GPU memory through CUDA IPC.
    Ipc,
    /// The CPU backend, every tensor staged through the host.
    Staged,
}

impl std::fmt::Display for CommChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CommChoice::Auto => "auto",
            CommChoice::Nccl => "nccl",
            CommChoice::Ipc => "ipc",
            CommChoice::Staged => "staged",
        })
    }
}
