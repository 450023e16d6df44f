//! The `mtrain` command line: the layout, strategy and training flags and every subcommand's
//! options. The commands themselves live in their modules (`train`, `plan`, `parity`,
//! `bench_comm`, ...), which read these definitions; nothing here calls into them.
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
//! Each subcommand takes only the flags it uses (`mtrain prepare --help` lists prepare's). The
//! layout flags are taken by training, `plan` and `bench-comm`, the strategy flags by training
//! and `plan`; they may come before the subcommand or after it ([`Cli::command_layout`] merges
//! the two; one flag given both ways with two values is refused). torchrun's underscore
//! spellings are accepted too (`--nproc_per_node`, `--node_rank`, `--master_addr`,
//! `--master_port`). Each layout or strategy flag is a key
//! of the config's `[parallel]` table under the same name (`--zero-stage 1` is
//! `zero_stage = 1`) and, when given, replaces the file's value ([`parallel_overrides`]). The
//! world is `nproc_per_node · nnodes` processes and must equal `dp · pp · tp`; `ep` is carved
//! out of `dp`. Whatever is left out is inferred from the rest ([`LayoutArgs::resolve`]):
//!
//! | given                      | inferred                                                   |
//! |----------------------------|------------------------------------------------------------|
//! | `--nproc-per-node`, no dp  | `dp = nproc·nnodes / (tp·pp)` (must divide)                |
//! | no `--nproc-per-node`      | `nproc = dp·tp·pp / nnodes`, with `dp = 1` when omitted    |
//! | launched by torchrun/Slurm | the world is `WORLD_SIZE`; `dp = WORLD_SIZE / (tp·pp)`     |
//!
//! Numbers that do not fit are refused by the plan's one check ([`crate::layout::plan`]) with
//! the arithmetic shown, e.g. `dp(2) * pp(1) * tp(2) = 4 != world size 3 (nproc-per-node 3 *
//! nnodes 1)`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use mtrain_comm::mesh::MeshDims;

use crate::bench_comm::BenchCommArgs;
use crate::config::{DdpMode, ParallelConfig, Schedule, TrainArgs, TrainConfig};
use crate::launch::{LaunchSpec, MAX_WORLD};
use crate::layout::{Layout, LayoutError, MAX_COMM_TIMEOUT_S};
use crate::plan::PlanArgs;
use crate::plot::PlotArgs;
use crate::prepare::PrepareArgs;
use crate::sample::SampleArgs;

/// mtrain: a mini distributed training framework (DDP, FSDP, TP, PP, EP on a GPT).
///
/// Without a subcommand it trains. With a world of more than one process it launches one worker
/// per rank, torchrun-style.
#[derive(Debug, Clone, Parser)]
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

impl Cli {
    /// The training configuration: defaults, `--config`, the training flags, the layout flags
    /// over its `[parallel]` table, then `--set`.
    pub fn config(&self) -> anyhow::Result<TrainConfig> {
        self.config_from(&self.train)
    }

    /// [`Cli::config`] with another command's training flags (`mtrain plan --config F`).
    pub fn config_from(&self, train: &TrainArgs) -> anyhow::Result<TrainConfig> {
        let strategy = self.command_strategy()?;
        train.resolve_with(&parallel_overrides(&self.command_layout()?, &strategy))
    }

    /// The layout flags of this command: those before the subcommand merged with those after it.
    pub fn command_layout(&self) -> Result<LayoutArgs, LayoutError> {
        match &self.command {
            Some(Command::Plan(p)) => self.layout.merge(&p.layout),
            Some(Command::BenchComm(b)) => self.layout.merge(&b.layout),
            _ => Ok(self.layout.clone()),
        }
    }

    /// The strategy flags of this command, merged the same way.
    pub fn command_strategy(&self) -> Result<StrategyArgs, LayoutError> {
        match &self.command {
            Some(Command::Plan(p)) => self.strategy.merge(&p.strategy),
            _ => Ok(self.strategy.clone()),
        }
    }
}

#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Print the rank grid and every process group of a layout; launches nothing.
    Plan(PlanCommand),
    /// Measure collectives nccl-tests style (algbw, busbw, #wrong) with the job's ranks.
    BenchComm(BenchCommand),
    /// Tokenize a text file into token shards, with a BPE tokenizer trained on it or an existing
    /// tokenizer.json.
    Prepare(PrepareArgs),
    /// Generate text from a checkpoint.
    Sample(SampleArgs),
    /// Train one rank and a layout on the same seed and global batch; compare the loss series.
    Parity(ParityArgs),
    /// Draw a run directory's loss curve, per-rank memory timeline and pipeline timeline (SVG).
    Plot(PlotArgs),
}

/// `mtrain plan`: the layout and strategy flags it plans for, and its own.
#[derive(Debug, Clone, Args)]
pub struct PlanCommand {
    #[command(flatten)]
    pub layout: LayoutArgs,
    #[command(flatten)]
    pub strategy: StrategyArgs,
    #[command(flatten)]
    pub args: PlanArgs,
}

/// `mtrain bench-comm`: the layout flags that size its world, and its own.
#[derive(Debug, Clone, Args)]
pub struct BenchCommand {
    #[command(flatten)]
    pub layout: LayoutArgs,
    #[command(flatten)]
    pub args: BenchCommArgs,
}

/// `--nnodes` when not given.
const DEFAULT_NNODES: usize = 1;
/// `--master-addr` when not given.
const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";
/// `--comm-timeout` when not given (seconds).
const DEFAULT_COMM_TIMEOUT_S: f64 = 300.0;

/// How many processes, where they meet, and how they are arranged.
#[derive(Debug, Clone, Default, Args)]
#[command(next_help_heading = "Layout")]
pub struct LayoutArgs {
    /// Data-parallel degree; inferred as world / (tp·pp) when omitted.
    #[arg(long, value_name = "D")]
    pub dp: Option<usize>,

    /// Tensor-parallel degree (innermost: consecutive ranks); default 1.
    #[arg(long, value_name = "T")]
    pub tp: Option<usize>,

    /// Pipeline-parallel degree (number of stages); default 1.
    #[arg(long, value_name = "P")]
    pub pp: Option<usize>,

    /// Expert-parallel degree, carved out of dp (must divide dp); default 1.
    #[arg(long, value_name = "E")]
    pub ep: Option<usize>,

    /// Worker processes on this node; defaults to dp·tp·pp / nnodes.
    #[arg(long, alias = "nproc_per_node", value_name = "N")]
    pub nproc_per_node: Option<usize>,

    /// Number of nodes in the job (default 1).
    #[arg(long, value_name = "N")]
    pub nnodes: Option<usize>,

    /// This node's index, 0..nnodes (default 0).
    #[arg(long, alias = "node_rank", value_name = "R")]
    pub node_rank: Option<usize>,

    /// Host of rank 0, which serves the rendezvous store (default 127.0.0.1).
    #[arg(long, alias = "master_addr", value_name = "ADDR")]
    pub master_addr: Option<String>,

    /// Port of the rendezvous store; a free port is picked on a single node when omitted.
    #[arg(long, alias = "master_port", value_name = "PORT")]
    pub master_port: Option<u16>,

    /// Seconds a collective may wait for a peer before failing with a message naming it
    /// (default 300).
    #[arg(long, value_name = "SECONDS")]
    pub comm_timeout: Option<f64>,

    /// Record every collective per rank (op, group, bytes, seq, start, end) into
    /// RUN_DIR/trace-rank{N}.jsonl.
    #[arg(long)]
    pub trace: bool,
}

/// One flag given before a subcommand (`before`) and after it (`after`): the one given, and a
/// refusal when both were given with different values.
fn merged<T: Clone + PartialEq + std::fmt::Display>(
    flag: &'static str,
    before: &Option<T>,
    after: &Option<T>,
) -> Result<Option<T>, LayoutError> {
    match (before, after) {
        (Some(a), Some(b)) if a != b => Err(LayoutError::GivenTwice {
            flag,
            before: a.to_string(),
            after: b.to_string(),
        }),
        (_, Some(b)) => Ok(Some(b.clone())),
        (a, None) => Ok(a.clone()),
    }
}

impl LayoutArgs {
    /// These flags (given before the subcommand) with `after`'s (given after it).
    pub fn merge(&self, after: &LayoutArgs) -> Result<LayoutArgs, LayoutError> {
        Ok(LayoutArgs {
            dp: merged("--dp", &self.dp, &after.dp)?,
            tp: merged("--tp", &self.tp, &after.tp)?,
            pp: merged("--pp", &self.pp, &after.pp)?,
            ep: merged("--ep", &self.ep, &after.ep)?,
            nproc_per_node: merged("--nproc-per-node", &self.nproc_per_node, &after.nproc_per_node)?,
            nnodes: merged("--nnodes", &self.nnodes, &after.nnodes)?,
            node_rank: merged("--node-rank", &self.node_rank, &after.node_rank)?,
            master_addr: merged("--master-addr", &self.master_addr, &after.master_addr)?,
            master_port: merged("--master-port", &self.master_port, &after.master_port)?,
            comm_timeout: merged("--comm-timeout", &self.comm_timeout, &after.comm_timeout)?,
            trace: self.trace || after.trace,
        })
    }
}

/// How the model is split and synchronised (data-parallel mode, FSDP/ZeRO, pipeline schedule).
/// Unset flags keep the `[parallel]` table's values (see [`ParallelConfig`] for the defaults).
#[derive(Debug, Clone, Default, Args)]
#[command(next_help_heading = "Strategy")]
pub struct StrategyArgs {
    /// Shard parameters, gradients and optimizer state over dp (FSDP, ZeRO-3).
    #[arg(long)]
    pub fsdp: bool,

    /// ZeRO stage for data parallelism: 0 = DDP, 1 = shard optimizer state, 2 = + gradients, 3 = + parameters.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero_stage: Option<u8>,

    /// Sequence parallelism in the tensor-parallel regions (LayerNorm/dropout on T/tp).
    #[arg(long)]
    pub sequence_parallel: bool,

    /// Pipeline schedule (default 1f1b).
    #[arg(long, value_enum)]
    pub schedule: Option<Schedule>,

    /// Model chunks per pipeline rank for `--schedule interleaved` (Megatron's virtual stages; default 2).
    #[arg(long, value_name = "V")]
    pub virtual_stages: Option<usize>,

    /// Blocks per model stage, e.g. `2,1` for 3 layers on 2 stages (default: as even as possible).
    #[arg(long, value_delimiter = ',', value_name = "N,N,...")]
    pub stage_layers: Option<Vec<usize>>,

    /// Micro-batches per step through the pipeline; defaults to pp.
    #[arg(long, value_name = "M")]
    pub microbatches: Option<usize>,

    /// Gradient all-reduce for data parallelism (default bucketed).
    #[arg(long, value_enum)]
    pub ddp_mode: Option<DdpMode>,

    /// DDP bucket size in MiB (default 25).
    #[arg(long, value_name = "MIB")]
    pub bucket_mb: Option<f64>,
}

impl StrategyArgs {
    /// These flags (given before the subcommand) with `after`'s (given after it).
    pub fn merge(&self, after: &StrategyArgs) -> Result<StrategyArgs, LayoutError> {
        // Enums and lists are compared by their command-line spelling.
        let spelled = |v: Option<clap::builder::PossibleValue>| v.map(|p| p.get_name().to_string());
        let layers = |v: &Option<Vec<usize>>| {
            v.as_ref()
                .map(|c| c.iter().map(usize::to_string).collect::<Vec<_>>().join(","))
        };
        let schedule = |s: Option<Schedule>| spelled(s.and_then(|s| s.to_possible_value()));
        let ddp_mode = |m: Option<DdpMode>| spelled(m.and_then(|m| m.to_possible_value()));
        merged("--schedule", &schedule(self.schedule), &schedule(after.schedule))?;
        merged("--ddp-mode", &ddp_mode(self.ddp_mode), &ddp_mode(after.ddp_mode))?;
        merged("--stage-layers", &layers(&self.stage_layers), &layers(&after.stage_layers))?;
        Ok(StrategyArgs {
            fsdp: self.fsdp || after.fsdp,
            zero_stage: merged("--zero-stage", &self.zero_stage, &after.zero_stage)?,
            sequence_parallel: self.sequence_parallel || after.sequence_parallel,
            schedule: after.schedule.or(self.schedule),
            virtual_stages: merged("--virtual-stages", &self.virtual_stages, &after.virtual_stages)?,
            stage_layers: after.stage_layers.clone().or_else(|| self.stage_layers.clone()),
            microbatches: merged("--microbatches", &self.microbatches, &after.microbatches)?,
            ddp_mode: after.ddp_mode.or(self.ddp_mode),
            bucket_mb: merged("--bucket-mb", &self.bucket_mb, &after.bucket_mb)?,
        })
    }
}

/// The layout and strategy flags that were given, as `[parallel]` keys of the same names.
pub fn parallel_overrides(layout: &LayoutArgs, strategy: &StrategyArgs) -> toml::Table {
    let mut t = toml::Table::new();
    let int = |v: usize| toml::Value::Integer(v as i64);
    // The names a ValueEnum and its serde form share ("1f1b", "naive").
    let name = |v: Option<clap::builder::PossibleValue>| {
        toml::Value::String(v.map_or_else(String::new, |p| p.get_name().to_string()))
    };
    for (key, v) in [
        ("dp", layout.dp),
        ("tp", layout.tp),
        ("pp", layout.pp),
        ("ep", layout.ep),
        ("virtual_stages", strategy.virtual_stages),
        ("microbatches", strategy.microbatches),
    ] {
        if let Some(v) = v {
            t.insert(key.into(), int(v));
        }
    }
    for (key, on) in [
        ("fsdp", strategy.fsdp),
        ("sequence_parallel", strategy.sequence_parallel),
    ] {
        if on {
            t.insert(key.into(), toml::Value::Boolean(true));
        }
    }
    if let Some(z) = strategy.zero_stage {
        t.insert("zero_stage".into(), int(z as usize));
    }
    if let Some(s) = strategy.schedule {
        t.insert(
            "schedule".into(),
            name(clap::ValueEnum::to_possible_value(&s)),
        );
    }
    if let Some(m) = strategy.ddp_mode {
        t.insert(
            "ddp_mode".into(),
            name(clap::ValueEnum::to_possible_value(&m)),
        );
    }
    if let Some(counts) = &strategy.stage_layers {
        t.insert(
            "stage_layers".into(),
            toml::Value::Array(counts.iter().map(|&c| int(c)).collect()),
        );
    }
    if let Some(mb) = strategy.bucket_mb {
        t.insert("bucket_mb".into(), toml::Value::Float(mb));
    }
    t
}

impl LayoutArgs {
    /// The layout of `parallel` (the resolved `[parallel]` table, these flags included) on this
    /// job's processes: the world size and whatever degree was left out. `launched_world` is
    /// `WORLD_SIZE` when this process was started by a launcher. Whether the numbers fit together
    /// is [`crate::layout::plan`]'s check.
    pub fn resolve(
        &self,
        parallel: &ParallelConfig,
        launched_world: Option<usize>,
    ) -> Result<Layout, LayoutError> {
        let nnodes = self.nnodes.unwrap_or(DEFAULT_NNODES);
        let comm_timeout = self.comm_timeout.unwrap_or(DEFAULT_COMM_TIMEOUT_S);
        for (what, v) in [
            ("--tp", Some(parallel.tp)),
            ("--pp", Some(parallel.pp)),
            ("--ep", Some(parallel.ep)),
            ("--nnodes", Some(nnodes)),
            ("--dp", parallel.dp),
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
        if !(comm_timeout.is_finite() && comm_timeout > 0.0 && comm_timeout <= MAX_COMM_TIMEOUT_S) {
            return Err(LayoutError::Timeout(comm_timeout));
        }
        let (tp, pp) = (parallel.tp, parallel.pp);

        // The world size, and a description of where it came from for error messages.
        let (world, nproc, world_source) = match (launched_world, self.nproc_per_node) {
            (Some(w), _) => (
                w,
                self.nproc_per_node.unwrap_or(w / nnodes.max(1)),
                format!("WORLD_SIZE={w}"),
            ),
            (None, Some(n)) => {
                let w = n * nnodes;
                (w, n, format!("nproc-per-node {n} * nnodes {nnodes}"))
            }
            (None, None) => {
                let dp = parallel.dp.unwrap_or(1);
                let w = dp * tp * pp;
                if w % nnodes != 0 {
                    return Err(LayoutError::Uneven {
                        dp,
                        pp,
                        tp,
                        world: w,
                        nnodes,
                        rem: w % nnodes,
                    });
                }
                (
                    w,
                    w / nnodes,
                    format!("dp * pp * tp over {nnodes} node(s)"),
                )
            }
        };

        if world > MAX_WORLD {
            return Err(LayoutError::WorldTooLarge {
                world,
                world_source: world_source.clone(),
            });
        }
        let dp = match parallel.dp {
            Some(dp) => dp,
            None => {
                if world % (tp * pp) != 0 {
                    return Err(LayoutError::NotDivisible {
                        world,
                        world_source,
                        tp,
                        pp,
                        tp_pp: tp * pp,
                    });
                }
                world / (tp * pp)
            }
        };
        let launch = LaunchSpec {
            nproc_per_node: nproc,
            nnodes,
            node_rank: self.node_rank.unwrap_or(0),
            master_addr: self
                .master_addr
                .clone()
                .unwrap_or_else(|| DEFAULT_MASTER_ADDR.to_string()),
            master_port: self.master_port,
        };
        if launched_world.is_none() {
            launch.validate()?;
        }
        Ok(Layout {
            dims: MeshDims {
                dp,
                pp,
                tp,
                ep: parallel.ep,
            },
            world_size: world,
            world_source,
            launch,
            comm_timeout: Duration::from_secs_f64(comm_timeout),
            trace: self.trace,
        })
    }
}

/// Options of `mtrain parity`.
#[derive(Debug, Clone, Args)]
pub struct ParityArgs {
    /// The layout to compare with one rank, as its flags in one string: "--tp 2 --pp 2 --dp 2".
    #[arg(long, value_name = "FLAGS", allow_hyphen_values = true)]
    pub vs: String,
    /// TOML file with [model], [train] and [parallel] tables (as for training).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Model preset, when no config file is given.
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,
    /// Optimizer steps to compare.
    #[arg(long, default_value_t = 10)]
    pub steps: u64,
    /// Largest allowed relative loss difference.
    #[arg(long, default_value_t = 1e-5)]
    pub tol: f64,
    /// Sequences per dp rank in the layout (the reference gets dp times as many).
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Tokens per sequence.
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Config overrides passed to both runs, e.g. `--set lr=1e-3` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Where the two run directories go (default: a fresh directory under the system temp dir).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use mtrain_parallel::pipeline::ScheduleKind;

    fn cli(args: &[&str]) -> Cli {
        let mut argv = vec!["mtrain"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).expect("parses")
    }

    /// The layout the flags resolve to (what is inferred; nothing checked against a model).
    fn layout(args: &[&str]) -> anyhow::Result<Layout> {
        let cli = cli(args);
        Ok(cli.layout.resolve(&cli.config()?.parallel, None)?)
    }

    /// The layout as a training run takes it: resolved, then its plan checked against the
    /// default model and batch ([`crate::layout::plan`]).
    fn checked(args: &[&str]) -> anyhow::Result<Layout> {
        let cli = cli(args);
        let cfg = cli.config()?;
        let layout = cli.layout.resolve(&cfg.parallel, None)?;
        crate::layout::plan(&cfg, &layout)?;
        Ok(layout)
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
        let c = cli(&["--tp", "2"]);
        let l = c
            .layout
            .resolve(&c.config().unwrap().parallel, Some(6))
            .unwrap();
        assert_eq!(l.dims.dp, 3);
    }

    #[test]
    fn inconsistent_numbers_show_the_arithmetic() {
        let e = checked(&["--dp", "2", "--tp", "2", "--nproc-per-node", "3"])
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "dp(2) * pp(1) * tp(2) = 4 != world size 3 (nproc-per-node 3 * nnodes 1)"
        );
        let e = checked(&["--tp", "4", "--nproc-per-node", "6"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("world size 6") && e.contains("tp(4) * pp(1) = 4"),
            "{e}"
        );
        // The plan's check words it `ep 2 does not divide dp 3`.
        let e = checked(&["--dp", "3", "--ep", "2"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("ep 2 does not divide dp 3"), "{e}");
        let e = checked(&["--tp", "0"]).unwrap_err().to_string();
        assert!(e.contains("--tp must be at least 1"), "{e}");
        let e = checked(&["--dp", "3", "--nnodes", "2", "--master-port", "1"])
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
        let l = cli
            .command_layout()
            .unwrap()
            .resolve(&cli.config().unwrap().parallel, None)
            .unwrap();
        assert_eq!(
            (l.dims.dp, l.dims.pp, l.dims.tp, l.world_size),
            (1, 2, 4, 8)
        );
        // Before and after the subcommand, merged; one flag with two values is refused.
        let cli = Cli::try_parse_from(["mtrain", "--tp", "2", "plan", "--pp", "2", "--fsdp"]).unwrap();
        let l = cli.command_layout().unwrap();
        assert_eq!((l.tp, l.pp), (Some(2), Some(2)));
        assert!(cli.command_strategy().unwrap().fsdp);
        let cli = Cli::try_parse_from(["mtrain", "--tp", "2", "plan", "--tp", "4"]).unwrap();
        let e = cli.command_layout().unwrap_err().to_string();
        assert_eq!(e, "--tp is given twice, 2 before the subcommand and 4 after it; give it once");
        let cli = Cli::try_parse_from(["mtrain", "--nproc-per-node", "2", "bench-comm", "-d", "bfloat16"]).unwrap();
        assert_eq!(cli.command_layout().unwrap().nproc_per_node, Some(2));
    }

    #[test]
    fn torchruns_underscore_spellings_are_accepted() {
        let cli = Cli::try_parse_from([
            "mtrain",
            "--nproc_per_node",
            "4",
            "--nnodes",
            "2",
            "--node_rank",
            "1",
            "--master_addr",
            "host0",
            "--master_port",
            "29500",
        ])
        .unwrap();
        let l = cli.layout.resolve(&cli.config().unwrap().parallel, None).unwrap();
        assert_eq!((l.world_size, l.launch.node_rank), (8, 1));
        assert_eq!((l.launch.master_addr.as_str(), l.launch.master_port), ("host0", Some(29500)));
        let cli = Cli::try_parse_from(["mtrain", "bench-comm", "--nproc_per_node", "2"]).unwrap();
        assert_eq!(cli.command_layout().unwrap().nproc_per_node, Some(2));
    }

    /// Each subcommand's help lists the flags it uses: none of the layout flags where they mean
    /// nothing, and `--grad-reduce-dtype` does not repeat `--dtype`'s values.
    #[test]
    fn each_subcommand_shows_only_its_flags() {
        let mut cmd = Cli::command();
        cmd.build();
        let flags = |name: &str| -> Vec<String> {
            let sub = cmd.find_subcommand(name).expect(name);
            sub.get_arguments().filter_map(|a| a.get_long().map(str::to_string)).collect()
        };
        for name in ["prepare", "sample", "plot", "parity"] {
            let f = flags(name);
            for layout in ["tp", "nproc-per-node", "fsdp", "zero-stage", "master-port"] {
                assert!(!f.iter().any(|l| l == layout), "`{name}` takes --{layout}: {f:?}");
            }
        }
        for layout in ["tp", "nproc-per-node", "fsdp", "master-port"] {
            assert!(flags("plan").iter().any(|l| l == layout), "plan lacks --{layout}");
        }
        assert!(flags("bench-comm").iter().any(|l| l == "nproc-per-node"));
        assert!(!flags("bench-comm").iter().any(|l| l == "fsdp"));
        let help = Cli::command().render_long_help().to_string();
        // The flag's block: its lines up to the next flag (possible values are `- name: ...`).
        let grad: Vec<&str> = help[help.find("--grad-reduce-dtype").expect("the flag")..]
            .lines()
            .enumerate()
            .take_while(|(i, l)| {
                let t = l.trim_start();
                *i == 0 || !(t.starts_with("--") || (t.starts_with('-') && t.get(2..3) == Some(",")))
            })
            .map(|(_, l)| l)
            .collect();
        let grad = grad.join("\n");
        assert!(grad.contains("f32") && !grad.contains("Adam state"), "{grad}");
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
        assert_eq!(cli.strategy.zero_stage, Some(2));
        assert_eq!(cli.strategy.schedule, Some(Schedule::Gpipe));
        assert_eq!(cli.strategy.ddp_mode, Some(DdpMode::Naive));
        // The same settings in the [parallel] table the run resolves.
        let p = cli.config().unwrap().parallel;
        assert!(p.fsdp);
        assert_eq!(
            (p.zero_stage, p.schedule, p.ddp_mode, p.bucket_mb),
            (2, Schedule::Gpipe, DdpMode::Naive, 4.0)
        );
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
        let cfg = cli.config().unwrap();
        let plan = cfg.parallel.plan(dims, false, cfg.precision()).unwrap();
        assert_eq!(
            plan.schedule,
            ScheduleKind::Interleaved1F1B { virtual_stages: 3 }
        );
        assert_eq!(plan.stage_counts, Some(vec![2, 1, 1, 2, 1, 1]));
        assert_eq!(plan.microbatches, 4);
    }
}
