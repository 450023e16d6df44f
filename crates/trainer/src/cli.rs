//! The `mtrain` command line: the layout, strategy and training flags and every subcommand's
//! options. The commands themselves live in their modules (`train`; under `tools`: `plan`,
//! `parity`, `bench_comm`, ...), which read these definitions; nothing here calls into them.
//!
//! ```text
//! mtrain [LAYOUT] [STRATEGY] [TRAIN OPTIONS]        train (the default command)
//! mtrain [LAYOUT] bench-comm [-b 8 -e 256M -f 2 --op all-reduce ...]
//! mtrain plan [LAYOUT] [--config FILE]              print the rank grid, launch nothing
//! mtrain plan --gpus 64 --gpus-per-node 8 [--search] the same on a cluster; rank the layouts
//! mtrain parity --config X --vs "--tp 2 --pp 2"     one rank vs a layout, same global batch
//! mtrain plot RUN_DIR                               loss, memory and pipeline charts (SVG)
//! mtrain explain ring --ranks 4                     an all-reduce algorithm step by step
//! mtrain prepare | sample | export --hf OUT ...     single-process tools
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
//! Numbers that do not fit are refused by the plan's one check ([`crate::resolve`]) with
//! the arithmetic shown, e.g. `dp(2) * pp(1) * tp(2) = 4 != world size 3 (nproc-per-node 3 *
//! nnodes 1)`.
//!
//! ```text
//!   cli.rs                   Cli, the subcommands and their option structs
//!   cli/layout_args.rs       LayoutArgs: how many processes, where they meet; the table above
//!   cli/strategy_args.rs     StrategyArgs: how the model is split; every flag as a [parallel] key
//! ```

mod layout_args;
mod strategy_args;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::tools::bench_comm::BenchCommArgs;
use crate::config::{TrainArgs, TrainConfig};
use crate::tools::explain::ExplainArgs;
use crate::tools::hf::ExportArgs;
use crate::layout::LayoutError;
use crate::tools::plan::PlanArgs;
use crate::tools::plot::PlotArgs;
use crate::tools::prepare::PrepareArgs;
use crate::tools::sample::SampleArgs;

pub use layout_args::LayoutArgs;
pub use strategy_args::{parallel_overrides, StrategyArgs};

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

    /// This command line with `plan --gpus N --gpus-per-node G` as the launch's `--nnodes N/G
    /// --nproc-per-node G` (a port for the rendezvous line when none is given), so the layout
    /// resolves on that world.
    pub fn with_cluster_world(&self) -> anyhow::Result<Cli> {
        let mut cli = self.clone();
        let Some(Command::Plan(p)) = &mut cli.command else {
            return Ok(cli);
        };
        let Some(gpus) = p.args.cluster.gpus else {
            return Ok(cli);
        };
        let per_node = p.args.cluster.gpus_per_node.unwrap_or(gpus.min(8));
        if per_node == 0 || !gpus.is_multiple_of(per_node) {
            anyhow::bail!("--gpus {gpus} must be a positive multiple of --gpus-per-node {per_node} (whole nodes)");
        }
        let nodes = gpus / per_node;
        for (flag, given, want) in [
            ("--nnodes", cli.layout.nnodes.or(p.layout.nnodes), nodes),
            ("--nproc-per-node", cli.layout.nproc_per_node.or(p.layout.nproc_per_node), per_node),
        ] {
            if given.is_some_and(|g| g != want) {
                anyhow::bail!("{flag} {} contradicts --gpus {gpus} --gpus-per-node {per_node} ({flag} {want}); give one or the other", given.unwrap_or(0));
            }
        }
        p.layout.nnodes = Some(nodes);
        p.layout.nproc_per_node = Some(per_node);
        if nodes > 1 && cli.layout.master_port.or(p.layout.master_port).is_none() {
            p.layout.master_port = Some(29500);
        }
        Ok(cli)
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
    /// Write a checkpoint as a Hugging Face GPT-2 directory (transformers loads it).
    Export(ExportArgs),
    /// Train one rank and a layout on the same seed and global batch; compare the loss series.
    Parity(ParityArgs),
    /// Draw a run directory's loss curve, per-rank memory timeline and pipeline timeline (SVG).
    Plot(PlotArgs),
    /// Walk an all-reduce algorithm (ring, tree, rhd) step by step: who sends what to whom,
    /// what each rank then holds, and the bytes each rank sent.
    Explain(ExplainArgs),
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

/// `args` parsed as an `mtrain` command line (the tests' way in).
#[cfg(test)]
fn parse(args: &[&str]) -> Cli {
    let mut argv = vec!["mtrain"];
    argv.extend_from_slice(args);
    Cli::try_parse_from(argv).expect("parses")
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn command_definition_is_consistent() {
        Cli::command().debug_assert();
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
        for name in ["prepare", "sample", "plot", "parity", "explain"] {
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

}
