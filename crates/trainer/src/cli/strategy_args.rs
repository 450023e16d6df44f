//! The strategy flags ([`StrategyArgs`]): how the model is split and synchronised, and
//! [`parallel_overrides`], every layout or strategy flag given as the `[parallel]` key of the
//! same name, which replaces the config file's value.

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::{Args, ValueEnum};
use mtrain_parallel::ddp::DdpMode;

use super::{merged, LayoutArgs};
use crate::config::{Schedule, TpOverlapFlag};
use crate::layout::LayoutError;

/// How the model is split and synchronised (data-parallel mode, FSDP/ZeRO, pipeline schedule).
/// Unset flags keep the `[parallel]` table's values (see [`crate::config::ParallelConfig`] for the defaults).
#[derive(Debug, Clone, Default, Args)]
#[command(next_help_heading = "Strategy")]
pub struct StrategyArgs {
    /// Shard parameters, gradients and optimizer state over dp (FSDP, ZeRO-3).
    #[arg(long)]
    pub fsdp: bool,

    /// ZeRO stage for data parallelism: 0 = DDP, 1 = shard optimizer state, 2 = + gradients, 3 = + parameters.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero_stage: Option<u8>,

    /// FSDP (ZeRO-3): free each segment's gathered weights after its forward and gather them
    /// again for its backward (default true); false keeps them until the backward.
    #[arg(long, value_name = "BOOL")]
    pub reshard_after_forward: Option<bool>,

    /// Sequence parallelism in the tensor-parallel regions (LayerNorm/dropout on T/tp).
    #[arg(long)]
    pub sequence_parallel: bool,

    /// How the TP layers' collectives meet their products (default none): chunked cuts the
    /// sequences into chunks, each chunk's all-reduce (or reduce-scatter) overlapping the next
    /// chunk's product.
    #[arg(long, value_enum, value_name = "MODE")]
    pub tp_overlap: Option<TpOverlapFlag>,

    /// Pipelined overlap for expert parallelism (needs --ep 2 or more): each micro-batch's
    /// tokens in parts, each part's all-to-alls on the wire while a neighbouring part's experts
    /// compute, forward and backward.
    #[arg(long)]
    pub ep_overlap: bool,

    /// Pipeline schedule (default 1f1b): gpipe, 1f1b, interleaved (its model chunks per rank
    /// from --virtual-stages), zb-h1 or zb-v.
    #[arg(long, value_enum, alias = "pp-schedule")]
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

    /// One stage's F, B and W (ms, e.g. the pass times a run's step report measured): zb-h1
    /// and zb-v run the order built for these costs, `mtrain plan` simulates every schedule at
    /// them (the fused backward B + W, a chunk of a two-chunk schedule half of each).
    #[arg(long, value_name = "F,B,W", value_delimiter = ',')]
    pub pass_costs: Option<Vec<f64>>,

    /// Gradient all-reduce for data parallelism (default bucketed).
    #[arg(long, value_parser = ddp_modes())]
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
        let ddp_mode = |m: Option<DdpMode>| m.map(|m| m.name().to_string());
        merged(
            "--schedule",
            &schedule(self.schedule),
            &schedule(after.schedule),
        )?;
        merged(
            "--ddp-mode",
            &ddp_mode(self.ddp_mode),
            &ddp_mode(after.ddp_mode),
        )?;
        merged(
            "--stage-layers",
            &layers(&self.stage_layers),
            &layers(&after.stage_layers),
        )?;
        let costs = |v: &Option<Vec<f64>>| {
            v.as_ref()
                .map(|c| c.iter().map(f64::to_string).collect::<Vec<_>>().join(","))
        };
        merged(
            "--pass-costs",
            &costs(&self.pass_costs),
            &costs(&after.pass_costs),
        )?;
        Ok(StrategyArgs {
            fsdp: self.fsdp || after.fsdp,
            zero_stage: merged("--zero-stage", &self.zero_stage, &after.zero_stage)?,
            reshard_after_forward: merged(
                "--reshard-after-forward",
                &self.reshard_after_forward,
                &after.reshard_after_forward,
            )?,
            sequence_parallel: self.sequence_parallel || after.sequence_parallel,
            tp_overlap: after.tp_overlap.or(self.tp_overlap),
            ep_overlap: self.ep_overlap || after.ep_overlap,
            schedule: after.schedule.or(self.schedule),
            virtual_stages: merged(
                "--virtual-stages",
                &self.virtual_stages,
                &after.virtual_stages,
            )?,
            stage_layers: after
                .stage_layers
                .clone()
                .or_else(|| self.stage_layers.clone()),
            microbatches: merged("--microbatches", &self.microbatches, &after.microbatches)?,
            pass_costs: after.pass_costs.clone().or_else(|| self.pass_costs.clone()),
            ddp_mode: after.ddp_mode.or(self.ddp_mode),
            bucket_mb: merged("--bucket-mb", &self.bucket_mb, &after.bucket_mb)?,
        })
    }
}

/// `--ddp-mode`'s values: the parallel crate's modes by name, each with its help.
fn ddp_modes() -> impl TypedValueParser<Value = DdpMode> {
    let modes = [
        (
            DdpMode::Bucketed,
            "Buckets of about `bucket_mb`, all-reduced asynchronously as soon as they fill",
        ),
        (
            DdpMode::Naive,
            "One all-reduce per parameter after the whole backward",
        ),
    ];
    PossibleValuesParser::new(modes.map(|(m, help)| PossibleValue::new(m.name()).help(help)))
        .map(|name| DdpMode::named(&name).expect("one of the listed names"))
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
        ("cp", layout.cp),
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
        ("ep_overlap", strategy.ep_overlap),
    ] {
        if on {
            t.insert(key.into(), toml::Value::Boolean(true));
        }
    }
    if let Some(z) = strategy.zero_stage {
        t.insert("zero_stage".into(), int(z as usize));
    }
    if let Some(r) = strategy.reshard_after_forward {
        t.insert("reshard_after_forward".into(), toml::Value::Boolean(r));
    }
    if let Some(s) = strategy.schedule {
        t.insert(
            "schedule".into(),
            name(clap::ValueEnum::to_possible_value(&s)),
        );
    }
    if let Some(o) = strategy.tp_overlap {
        t.insert(
            "tp_overlap".into(),
            name(clap::ValueEnum::to_possible_value(&o)),
        );
    }
    if let Some(m) = strategy.ddp_mode {
        t.insert("ddp_mode".into(), toml::Value::String(m.name().into()));
    }
    if let Some(counts) = &strategy.stage_layers {
        t.insert(
            "stage_layers".into(),
            toml::Value::Array(counts.iter().map(|&c| int(c)).collect()),
        );
    }
    if let Some(costs) = &strategy.pass_costs {
        t.insert(
            "pass_costs".into(),
            toml::Value::Array(costs.iter().map(|&c| toml::Value::Float(c)).collect()),
        );
    }
    if let Some(mb) = strategy.bucket_mb {
        t.insert("bucket_mb".into(), toml::Value::Float(mb));
    }
    t
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use mtrain_comm::mesh::MeshDims;
    use mtrain_parallel::pipeline::ScheduleKind;

    use super::*;
    use crate::cli::Cli;

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
            cp: 1,
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

    /// `--ep-overlap` reaches the plan and the `[parallel]` table; the plan's check refuses it
    /// without expert parallelism, naming the flag.
    #[test]
    fn ep_overlap_reaches_the_plan_or_is_refused() {
        let cli = Cli::try_parse_from(["mtrain", "--dp", "2", "--ep", "2", "--ep-overlap"]).unwrap();
        let cfg = cli.config().unwrap();
        assert!(cfg.parallel.ep_overlap);
        let dims = MeshDims {
            dp: 2,
            pp: 1,
            tp: 1,
            ep: 2,
            cp: 1,
        };
        let plan = cfg.parallel.plan(dims, false, cfg.precision()).unwrap();
        assert!(plan.ep_overlap);
        let dense = MeshDims { ep: 1, ..dims };
        let plan = cfg.parallel.plan(dense, false, cfg.precision()).unwrap();
        let e = plan
            .validate(&mtrain_model::GptConfig::tiny(), 2, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--ep-overlap") && e.contains("--ep 2"), "{e}");
    }

    /// `--pass-costs` reaches the plan the executor builds its order from; anything but three
    /// positive costs is refused, naming the key.
    #[test]
    fn pass_costs_reach_the_plan_or_are_refused() {
        let dims = MeshDims {
            dp: 1,
            pp: 2,
            tp: 1,
            ep: 1,
            cp: 1,
        };
        let plan_of = |costs: &str| {
            let cli = Cli::try_parse_from([
                "mtrain",
                "--pp",
                "2",
                "--schedule",
                "zb-v",
                "--pass-costs",
                costs,
            ])
            .unwrap();
            let cfg = cli.config().unwrap();
            cfg.parallel.plan(dims, false, cfg.precision())
        };
        assert_eq!(
            plan_of("12.6,12.6,9.8").unwrap().pass_costs,
            Some([12.6, 12.6, 9.8])
        );
        for bad in ["12.6,12.6", "12.6,0,9.8", "1,2,3,4"] {
            let e = plan_of(bad).unwrap_err().to_string();
            assert!(e.contains("pass_costs"), "{bad}: {e}");
        }
    }
}
