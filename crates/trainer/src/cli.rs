//! The `mtrain` command line: the job layout, the strategy flags and the subcommands.
//!
//! ```text
//! mtrain [LAYOUT] [STRATEGY] [TRAIN OPTIONS]        train (the default command)
//! mtrain [LAYOUT] bench-comm [-b 8 -e 256M -f 2 --op all-reduce ...]
//! mtrain plan [LAYOUT] [--config FILE]              print the rank grid, launch nothing
//! mtrain parity --config X --vs "--tp 2 --pp 2"     one rank vs a layout, same global batch
//! mtrain plot RUN_DIR                               loss, memory and pipeline charts (SVG)
//! mtrain prepare ... | mtrain sample ...            single-process tools
//! ```
//!
//! Layout flags are global (they may also follow a subcommand). The world is
//! `nproc_per_node · nnodes` processes and must equal `dp · pp · tp`; `ep` is carved out of `dp`.
//! Whatever is left out is inferred from the rest:
//!
//! | given                      | inferred                                                   |
//! |----------------------------|------------------------------------------------------------|
//! | `--nproc-per-node`, no dp  | `dp = nproc·nnodes / (tp·pp)` (must divide)                |
//! | no `--nproc-per-node`      | `nproc = dp·tp·pp / nnodes`, with `dp = 1` when omitted    |
//! | launched by torchrun/Slurm | the world is `WORLD_SIZE`; `dp = WORLD_SIZE / (tp·pp)`     |
//!
//! Numbers that do not fit are refused with the arithmetic shown, e.g.
//! `dp(2) * pp(1) * tp(2) = 4 != world size 3 (nproc-per-node 3 * nnodes 1)`.

use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use mtrain_comm::mesh::MeshDims;
use mtrain_parallel::ddp::DdpConfig;
use mtrain_parallel::fsdp::{FsdpConfig, ZeroStage};
use mtrain_parallel::parallelize::{DataParallelKind, ParallelPlan};
use mtrain_parallel::pipeline::ScheduleKind;

use crate::bench_comm::BenchCommArgs;
use crate::config::TrainArgs;
use crate::launch::LaunchSpec;
use crate::parity::ParityArgs;
use crate::plan::PlanArgs;
use crate::plot::PlotArgs;
use crate::prepare::PrepareArgs;
use crate::sample::SampleArgs;

/// mtrain: a mini distributed training framework (DDP, FSDP, TP, PP, EP on a GPT).
///
/// Without a subcommand it trains. With a world of more than one process it launches one worker
/// per rank, torchrun-style.
#[derive(Debug, Parser)]
#[command(name = "mtrain", version, about, long_about = None)]
pub struct Cli {
    #[command(flatten)]
    pub layout: LayoutArgs,

    #[command(flatten)]
    pub strategy: StrategyArgs,

    #[command(flatten)]
    pub train: TrainArgs,

    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the rank grid and every process group of a layout; launches nothing.
    Plan(PlanArgs),
    /// Measure collectives nccl-tests style (algbw, busbw, #wrong) with the job's ranks.
    BenchComm(BenchCommArgs),
    /// Train a BPE tokenizer on a text file and write token shards.
    Prepare(PrepareArgs),
    /// Generate text from a checkpoint.
    Sample(SampleArgs),
    /// Train one rank and a layout on the same seed and global batch; compare the loss series.
    Parity(ParityArgs),
    /// Draw a run directory's loss curve, per-rank memory timeline and pipeline timeline (SVG).
    Plot(PlotArgs),
}

/// How many processes, where they meet, and how they are arranged.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Layout")]
pub struct LayoutArgs {
    /// Data-parallel degree; inferred as world / (tp·pp) when omitted.
    #[arg(long, global = true, value_name = "D")]
    pub dp: Option<usize>,

    /// Tensor-parallel degree (innermost: consecutive ranks).
    #[arg(long, global = true, default_value_t = 1, value_name = "T")]
    pub tp: usize,

    /// Pipeline-parallel degree (number of stages).
    #[arg(long, global = true, default_value_t = 1, value_name = "P")]
    pub pp: usize,

    /// Expert-parallel degree, carved out of dp (must divide dp).
    #[arg(long, global = true, default_value_t = 1, value_name = "E")]
    pub ep: usize,

    /// Worker processes on this node; defaults to dp·tp·pp / nnodes.
    #[arg(long, global = true, value_name = "N")]
    pub nproc_per_node: Option<usize>,

    /// Number of nodes in the job.
    #[arg(long, global = true, default_value_t = 1, value_name = "N")]
    pub nnodes: usize,

    /// This node's index, 0..nnodes.
    #[arg(long, global = true, default_value_t = 0, value_name = "R")]
    pub node_rank: usize,

    /// Host of rank 0, which serves the rendezvous store.
    #[arg(long, global = true, default_value = "127.0.0.1", value_name = "ADDR")]
    pub master_addr: String,

    /// Port of the rendezvous store; a free port is picked on a single node when omitted.
    #[arg(long, global = true, value_name = "PORT")]
    pub master_port: Option<u16>,

    /// Seconds a collective may wait for a peer before failing with a message naming it.
    #[arg(long, global = true, default_value_t = 300.0, value_name = "SECONDS")]
    pub comm_timeout: f64,

    /// Record every collective per rank (op, group, bytes, seq, start, end) into
    /// RUN_DIR/trace-rank{N}.jsonl.
    #[arg(long, global = true)]
    pub trace: bool,
}

/// How the model is split and synchronised (data-parallel mode, FSDP/ZeRO, pipeline schedule).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Strategy")]
pub struct StrategyArgs {
    /// Shard parameters, gradients and optimizer state over dp (FSDP, ZeRO-3).
    #[arg(long, global = true)]
    pub fsdp: bool,

    /// ZeRO stage for data parallelism: 0 = DDP, 1 = shard optimizer state, 2 = + gradients, 3 = + parameters.
    #[arg(long, global = true, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero_stage: u8,

    /// Sequence parallelism in the tensor-parallel regions (LayerNorm/dropout on T/tp).
    #[arg(long, global = true)]
    pub sequence_parallel: bool,

    /// Pipeline schedule.
    #[arg(long, global = true, value_enum, default_value_t = Schedule::OneFOneB)]
    pub schedule: Schedule,

    /// Model chunks per pipeline rank for `--schedule interleaved` (Megatron's virtual stages).
    #[arg(long, global = true, default_value_t = 2, value_name = "V")]
    pub virtual_stages: usize,

    /// Blocks per model stage, e.g. `2,1` for 3 layers on 2 stages (default: as even as possible).
    #[arg(long, global = true, value_delimiter = ',', value_name = "N,N,...")]
    pub stage_layers: Option<Vec<usize>>,

    /// Micro-batches per step through the pipeline; defaults to pp.
    #[arg(long, global = true, value_name = "M")]
    pub microbatches: Option<usize>,

    /// Gradient all-reduce for data parallelism.
    #[arg(long, global = true, value_enum, default_value_t = DdpMode::Bucketed)]
    pub ddp_mode: DdpMode,

    /// DDP bucket size in MiB.
    #[arg(long, global = true, default_value_t = 25.0, value_name = "MIB")]
    pub bucket_mb: f64,
}

impl StrategyArgs {
    /// The strategy flags given with a non-default value, as they were spelled.
    pub fn non_default(&self) -> Vec<&'static str> {
        let mut set = Vec::new();
        if self.fsdp {
            set.push("--fsdp");
        }
        if self.zero_stage != 0 {
            set.push("--zero-stage");
        }
        if self.sequence_parallel {
            set.push("--sequence-parallel");
        }
        if self.schedule != Schedule::OneFOneB {
            set.push("--schedule");
        }
        if self.virtual_stages != 2 {
            set.push("--virtual-stages");
        }
        if self.stage_layers.is_some() {
            set.push("--stage-layers");
        }
        if self.microbatches.is_some() {
            set.push("--microbatches");
        }
        if self.ddp_mode != DdpMode::Bucketed {
            set.push("--ddp-mode");
        }
        if self.bucket_mb != 25.0 {
            set.push("--bucket-mb");
        }
        set
    }
}

impl StrategyArgs {
    /// The parallel plan these flags describe for `dims`: DDP (bucketed or naive) or ZeRO
    /// (`--fsdp` = stage 3, `--zero-stage N`), the schedule, micro-batches (default pp).
    pub fn plan(&self, dims: MeshDims, checkpointing: bool) -> Result<ParallelPlan, LayoutError> {
        let stage = match (self.fsdp, self.zero_stage) {
            (true, 0 | 3) => 3,
            (true, z) => {
                return Err(LayoutError::Strategy(format!(
                    "--fsdp shards parameters (ZeRO stage 3) but --zero-stage {z} was given; pass one of them"
                )))
            }
            (false, z) => z,
        };
        if !(self.bucket_mb.is_finite() && self.bucket_mb > 0.0) {
            return Err(LayoutError::Strategy(format!(
                "--bucket-mb must be a positive number of MiB, got {}",
                self.bucket_mb
            )));
        }
        let data = match stage {
            0 => {
                let cap = (self.bucket_mb * (1u64 << 20) as f64) as usize;
                DataParallelKind::Ddp(DdpConfig {
                    mode: match self.ddp_mode {
                        DdpMode::Bucketed => mtrain_parallel::ddp::DdpMode::Bucketed,
                        DdpMode::Naive => mtrain_parallel::ddp::DdpMode::Naive,
                    },
                    bucket_cap_bytes: cap.max(1),
                    first_bucket_cap_bytes: cap.clamp(1, 1 << 20),
                })
            }
            z => DataParallelKind::Zero(FsdpConfig {
                stage: ZeroStage::try_from(z).map_err(|e| LayoutError::Strategy(e.to_string()))?,
                ..FsdpConfig::default()
            }),
        };
        Ok(ParallelPlan {
            dims,
            data,
            sequence_parallel: self.sequence_parallel,
            schedule: match self.schedule {
                Schedule::Gpipe => ScheduleKind::GPipe,
                Schedule::OneFOneB => ScheduleKind::OneFOneB,
                Schedule::Interleaved => ScheduleKind::Interleaved1F1B {
                    virtual_stages: self.virtual_stages,
                },
            },
            microbatches: self.microbatches.unwrap_or(dims.pp),
            stage_counts: self.stage_layers.clone(),
            checkpointing,
            // Set from the run's --dtype and --grad-reduce-dtype when training starts.
            precision: mtrain_parallel::mixed_precision::MixedPrecision::default(),
        })
    }
}

/// Pipeline schedules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Schedule {
    /// All forwards, then all backwards (GPipe / AFAB).
    Gpipe,
    /// One forward, one backward in the steady state (PipeDream-Flush).
    #[value(name = "1f1b")]
    OneFOneB,
    /// 1F1B over `--virtual-stages` model chunks per rank: a smaller bubble for more messages.
    Interleaved,
}

/// DDP gradient synchronisation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DdpMode {
    /// Buckets of about `--bucket-mb`, all-reduced asynchronously as soon as they fill.
    Bucketed,
    /// One all-reduce per parameter after the whole backward.
    Naive,
}

/// Largest degree, node count or world size accepted (2^20 processes).
pub const MAX_WORLD: usize = 1 << 20;
/// Longest `--comm-timeout` accepted, in seconds (30 days; longer deadlines overflow a clock).
pub const MAX_COMM_TIMEOUT_S: f64 = 30.0 * 86400.0;

/// A layout that does not add up.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error("{what} must be at least 1, got 0")]
    Zero { what: &'static str },

    #[error("dp({dp}) * pp({pp}) * tp({tp}) = {product} != world size {world} ({source_desc})")]
    Mismatch {
        dp: usize,
        pp: usize,
        tp: usize,
        product: usize,
        world: usize,
        source_desc: String,
    },

    #[error("world size {world} ({source_desc}) is not divisible by tp({tp}) * pp({pp}) = {tp_pp}, so dp cannot be inferred")]
    NotDivisible {
        world: usize,
        source_desc: String,
        tp: usize,
        pp: usize,
        tp_pp: usize,
    },

    #[error("dp({dp}) * pp({pp}) * tp({tp}) = {world} processes cannot be spread evenly over {nnodes} nodes ({world} % {nnodes} = {rem}); pass --nproc-per-node")]
    Uneven {
        dp: usize,
        pp: usize,
        tp: usize,
        world: usize,
        nnodes: usize,
        rem: usize,
    },

    #[error("ep({ep}) must divide dp({dp}): experts are carved out of the data-parallel ranks ({dp} % {ep} = {rem})")]
    Expert { ep: usize, dp: usize, rem: usize },

    #[error("{what} {value} is above the largest supported world of {MAX_WORLD} processes")]
    TooLarge { what: &'static str, value: usize },

    #[error("world size {world} ({source_desc}) is above the largest supported {MAX_WORLD}")]
    WorldTooLarge { world: usize, source_desc: String },

    #[error("--comm-timeout must be a positive number of seconds up to {MAX_COMM_TIMEOUT_S} (30 days), got {0:?}")]
    Timeout(f64),

    #[error("{0}")]
    Strategy(String),

    #[error("{0}")]
    Launch(#[from] crate::launch::LaunchError),
}

/// A layout whose numbers add up: the mesh dimensions and how the world is launched.
#[derive(Debug, Clone)]
pub struct Layout {
    pub dims: MeshDims,
    pub world_size: usize,
    pub launch: LaunchSpec,
    pub comm_timeout: Duration,
    /// Record every collective (`--trace`).
    pub trace: bool,
}

impl LayoutArgs {
    /// Resolve the layout. `launched_world` is `WORLD_SIZE` when this process was started by a
    /// launcher; the flags must then agree with it.
    pub fn resolve(&self, launched_world: Option<usize>) -> Result<Layout, LayoutError> {
        for (what, v) in [
            ("--tp", Some(self.tp)),
            ("--pp", Some(self.pp)),
            ("--ep", Some(self.ep)),
            ("--nnodes", Some(self.nnodes)),
            ("--dp", self.dp),
            ("--nproc-per-node", self.nproc_per_node),
        ] {
            match v {
                Some(0) => return Err(LayoutError::Zero { what }),
                // Bounded so that every product of degrees below fits a usize.
                Some(value) if value > MAX_WORLD => {
                    return Err(LayoutError::TooLarge { what, value })
                }
                _ => {}
            }
        }
        if !(self.comm_timeout.is_finite()
            && self.comm_timeout > 0.0
            && self.comm_timeout <= MAX_COMM_TIMEOUT_S)
        {
            return Err(LayoutError::Timeout(self.comm_timeout));
        }
        let (tp, pp) = (self.tp, self.pp);

        // The world size, and a description of where it came from for error messages.
        let (world, nproc, source_desc) = match (launched_world, self.nproc_per_node) {
            (Some(w), _) => (
                w,
                self.nproc_per_node.unwrap_or(w / self.nnodes.max(1)),
                format!("WORLD_SIZE={w}"),
            ),
            (None, Some(n)) => {
                let w = n * self.nnodes;
                (w, n, format!("nproc-per-node {n} * nnodes {}", self.nnodes))
            }
            (None, None) => {
                let w = self.dp.unwrap_or(1) * tp * pp;
                if w % self.nnodes != 0 {
                    return Err(LayoutError::Uneven {
                        dp: self.dp.unwrap_or(1),
                        pp,
                        tp,
                        world: w,
                        nnodes: self.nnodes,
                        rem: w % self.nnodes,
                    });
                }
                (
                    w,
                    w / self.nnodes,
                    format!("dp * pp * tp over {} node(s)", self.nnodes),
                )
            }
        };

        if world > MAX_WORLD {
            return Err(LayoutError::WorldTooLarge { world, source_desc });
        }
        let dp = match self.dp {
            Some(dp) => dp,
            None => {
                if world % (tp * pp) != 0 {
                    return Err(LayoutError::NotDivisible {
                        world,
                        source_desc,
                        tp,
                        pp,
                        tp_pp: tp * pp,
                    });
                }
                world / (tp * pp)
            }
        };
        if dp * pp * tp != world {
            return Err(LayoutError::Mismatch {
                dp,
                pp,
                tp,
                product: dp * pp * tp,
                world,
                source_desc,
            });
        }
        if dp % self.ep != 0 {
            return Err(LayoutError::Expert {
                ep: self.ep,
                dp,
                rem: dp % self.ep,
            });
        }
        let dims = MeshDims {
            dp,
            pp,
            tp,
            ep: self.ep,
        };
        let launch = LaunchSpec {
            nproc_per_node: nproc,
            nnodes: self.nnodes,
            node_rank: self.node_rank,
            master_addr: self.master_addr.clone(),
            master_port: self.master_port,
        };
        if launched_world.is_none() {
            launch.validate()?;
        }
        Ok(Layout {
            dims,
            world_size: world,
            launch,
            comm_timeout: Duration::from_secs_f64(self.comm_timeout),
            trace: self.trace,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn layout(args: &[&str]) -> Result<Layout, LayoutError> {
        let mut argv = vec!["mtrain"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv)
            .expect("parses")
            .layout
            .resolve(None)
    }

    #[test]
    fn command_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn default_is_one_process() {
        let l = layout(&[]).unwrap();
        assert_eq!((l.dims.dp, l.dims.pp, l.dims.tp, l.dims.ep), (1, 1, 1, 1));
        assert_eq!((l.world_size, l.launch.nproc_per_node), (1, 1));
    }

    #[test]
    fn nproc_defaults_to_the_product() {
        let l = layout(&["--tp", "2", "--pp", "2"]).unwrap();
        assert_eq!(
            (l.dims.dp, l.world_size, l.launch.nproc_per_node),
            (1, 4, 4)
        );
        let l = layout(&["--dp", "2", "--tp", "2", "--pp", "2"]).unwrap();
        assert_eq!((l.world_size, l.launch.nproc_per_node), (8, 8));
        let l = layout(&[
            "--nnodes",
            "2",
            "--master-port",
            "29500",
            "--tp",
            "8",
            "--pp",
            "2",
        ])
        .unwrap();
        assert_eq!(
            (l.dims.dp, l.world_size, l.launch.nproc_per_node),
            (1, 16, 8)
        );
    }

    #[test]
    fn dp_is_inferred_from_the_world() {
        let l = layout(&["--nproc-per-node", "8", "--tp", "2"]).unwrap();
        assert_eq!((l.dims.dp, l.dims.pp, l.dims.tp), (4, 1, 2));
        let l = Cli::try_parse_from(["mtrain", "--tp", "2"])
            .unwrap()
            .layout
            .resolve(Some(6))
            .unwrap();
        assert_eq!(l.dims.dp, 3);
    }

    #[test]
    fn inconsistent_numbers_show_the_arithmetic() {
        let e = layout(&["--dp", "2", "--tp", "2", "--nproc-per-node", "3"])
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "dp(2) * pp(1) * tp(2) = 4 != world size 3 (nproc-per-node 3 * nnodes 1)"
        );
        let e = layout(&["--tp", "4", "--nproc-per-node", "6"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("world size 6") && e.contains("tp(4) * pp(1) = 4"),
            "{e}"
        );
        let e = layout(&["--dp", "3", "--ep", "2"]).unwrap_err().to_string();
        assert!(e.contains("ep(2) must divide dp(3)"), "{e}");
        let e = layout(&["--tp", "0"]).unwrap_err().to_string();
        assert!(e.contains("--tp must be at least 1"), "{e}");
        let e = layout(&["--dp", "3", "--nnodes", "2", "--master-port", "1"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("3 % 2 = 1"), "{e}");
    }

    #[test]
    fn out_of_range_numbers_are_refused_with_the_bound() {
        let e = layout(&["--tp", "4294967297"]).unwrap_err().to_string();
        assert_eq!(
            e,
            "--tp 4294967297 is above the largest supported world of 1048576 processes"
        );
        let e = layout(&["--dp", "1048576", "--tp", "1048576"])
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("world size 1099511627776 (dp * pp * tp over 1 node(s))"),
            "{e}"
        );
        for t in ["1e300", "nan", "inf", "0"] {
            let e = layout(&["--comm-timeout", t]).unwrap_err().to_string();
            assert!(
                e.contains("--comm-timeout must be a positive number of seconds up to 2592000"),
                "{e}"
            );
        }
        let e = layout(&["--comm-timeout", "1e300"])
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("got 1e300"), "{e}");
    }

    #[test]
    fn layout_flags_may_follow_a_subcommand() {
        let cli = Cli::try_parse_from(["mtrain", "plan", "--tp", "4", "--pp", "2"]).unwrap();
        assert!(matches!(cli.command, Some(Command::Plan(_))));
        let l = cli.layout.resolve(None).unwrap();
        assert_eq!(
            (l.dims.dp, l.dims.pp, l.dims.tp, l.world_size),
            (1, 2, 4, 8)
        );
    }

    #[test]
    fn strategy_flags_parse() {
        let cli = Cli::try_parse_from([
            "mtrain",
            "--fsdp",
            "--zero-stage",
            "2",
            "--schedule",
            "gpipe",
            "--ddp-mode",
            "naive",
            "--bucket-mb",
            "4",
        ])
        .unwrap();
        assert!(cli.strategy.fsdp);
        assert_eq!(cli.strategy.zero_stage, 2);
        assert_eq!(cli.strategy.schedule, Schedule::Gpipe);
        assert_eq!(cli.strategy.ddp_mode, DdpMode::Naive);
        assert!(Cli::try_parse_from(["mtrain", "--zero-stage", "4"]).is_err());
    }

    #[test]
    fn interleaved_schedule_and_stage_layers_reach_the_plan() {
        let cli = Cli::try_parse_from([
            "mtrain",
            "--pp",
            "2",
            "--schedule",
            "interleaved",
            "--virtual-stages",
            "3",
            "--stage-layers",
            "2,1,1,2,1,1",
            "--microbatches",
            "4",
        ])
        .unwrap();
        let dims = MeshDims {
            dp: 1,
            pp: 2,
            tp: 1,
            ep: 1,
        };
        let plan = cli.strategy.plan(dims, false).unwrap();
        assert_eq!(
            plan.schedule,
            ScheduleKind::Interleaved1F1B { virtual_stages: 3 }
        );
        assert_eq!(plan.stage_counts, Some(vec![2, 1, 1, 2, 1, 1]));
        assert_eq!(plan.microbatches, 4);
    }
}
