//! The training flags (`TrainArgs`, flattened into the `mtrain` command) and how a run's
//! configuration is resolved from them: defaults, then `--config`, then the flags, then the
//! layout flags over the `[parallel]` table, then `--set`; validated once at the end.

use std::path::{Path, PathBuf};

use super::merge::{apply_override, deserialize, merge_file};
use super::{BackwardKind, ConfigError, DTypeKind, DeviceKind, TrainConfig};
use crate::data::Sampling;

/// Command-line flags of a training run (flattened into the `mtrain` command).
#[derive(Debug, Clone, Default, clap::Args)]
#[command(next_help_heading = "Training")]
pub struct TrainArgs {
    /// TOML file with [model], [train] and [parallel] tables.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Model preset (tiny, gpt2-124m, gpt2-350m, moe-tiny).
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,
    /// Optimizer steps.
    #[arg(long, value_parser = toml_integer::<u64>())]
    pub steps: Option<u64>,
    /// Sequences per micro-batch per data-parallel rank.
    #[arg(long, value_parser = toml_integer::<usize>())]
    pub batch_size: Option<usize>,
    /// Tokens per sequence.
    #[arg(long, value_parser = toml_integer::<usize>())]
    pub seq_len: Option<usize>,
    /// Micro-batches per optimizer step.
    #[arg(long, value_parser = toml_integer::<usize>())]
    pub grad_accum: Option<usize>,
    /// Peak learning rate.
    #[arg(long)]
    pub lr: Option<f64>,
    /// Final learning rate of the cosine decay.
    #[arg(long)]
    pub min_lr: Option<f64>,
    /// Warmup steps.
    #[arg(long, value_parser = toml_integer::<u64>())]
    pub warmup_steps: Option<u64>,
    /// Seed of initialisation and data draws.
    #[arg(long, value_parser = toml_integer::<u64>())]
    pub seed: Option<u64>,
    /// How training batches are drawn: random offsets (nanoGPT's) or epoch-shuffled windows.
    #[arg(long, value_enum, value_name = "random|epochs")]
    pub sampling: Option<Sampling>,
    /// Run directory (checkpoints, metrics.jsonl, memory.jsonl).
    #[arg(long, value_name = "DIR")]
    pub run_dir: Option<PathBuf>,
    /// "builtin" or a token-shard directory from `mtrain prepare`.
    #[arg(long, value_name = "SOURCE")]
    pub data: Option<String>,
    /// Evaluate every N steps (0 disables).
    #[arg(long, value_name = "N", value_parser = toml_integer::<u64>())]
    pub eval_every: Option<u64>,
    /// Batches per split (train and val) per evaluation.
    #[arg(long, value_name = "N", value_parser = toml_integer::<usize>())]
    pub eval_iters: Option<usize>,
    /// Checkpoint every N steps (0: only at the end).
    #[arg(long, value_name = "N", value_parser = toml_integer::<u64>())]
    pub ckpt_every: Option<u64>,
    /// Log every N steps.
    #[arg(long, value_name = "N", value_parser = toml_integer::<u64>())]
    pub log_every: Option<u64>,
    /// Every rank logs its step lines (default: rank 0 alone).
    #[arg(long)]
    pub log_ranks: bool,
    /// Replace the run already in the run directory (metrics, logs, checkpoints) instead of
    /// refusing to start; `--resume` continues it instead.
    #[arg(long)]
    pub overwrite: bool,
    /// Print and record the per-step memory report.
    #[arg(long)]
    pub mem_report: bool,
    /// Time each phase of a step (device synchronised at every boundary) and log it.
    #[arg(long)]
    pub profile_phases: bool,
    /// Time and count every op of a few steps after the first (FLOPs, bytes, intensity): the
    /// run directory's ops.json and roofline.svg, and a table.
    #[arg(long)]
    pub profile_ops: bool,
    /// Recompute activations in backward instead of storing them.
    #[arg(long)]
    pub activation_checkpointing: bool,
    /// The backward path: tapes (the hand-written backward) or autograd (candle's, the
    /// reference); default: the engine's.
    #[arg(long, value_enum, value_name = "tapes|autograd")]
    pub backward: Option<BackwardKind>,
    /// Compute device.
    #[arg(long, value_enum)]
    pub device: Option<DeviceKind>,
    /// Compute dtype.
    #[arg(long, value_enum)]
    pub dtype: Option<DTypeKind>,
    /// Dtype the gradients cross ranks in under --dtype bf16: f32 (default; the bf16 gradients
    /// are upcast before the all-reduce or reduce-scatter) or bf16 (half the bytes, summed in bf16).
    #[arg(long, value_enum, hide_possible_values = true, value_name = "f32|bf16")]
    pub grad_reduce_dtype: Option<DTypeKind>,
    /// Resume from a checkpoint directory, a run directory, or "latest" (the run directory's newest).
    #[arg(long, value_name = "CKPT", num_args = 0..=1, default_missing_value = "latest")]
    pub resume: Option<PathBuf>,
    /// Start from GPT-2 weights in Hugging Face's layout: a model.safetensors, or a directory
    /// with one and its config.json (`save_pretrained`, `mtrain export --hf`).
    #[arg(long, value_name = "PATH")]
    pub init_from: Option<PathBuf>,
    /// Override any config key, nested ones dotted, e.g. `--set lr=1e-3 --set model.n_layer=2
    /// --set model.moe.top_k=1` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

/// Parser of a flag that becomes a config integer: TOML integers are signed 64-bit, so a larger
/// value is refused here, naming the flag and the range, rather than wrapping to a negative one.
fn toml_integer<T>() -> clap::builder::RangedU64ValueParser<T>
where
    T: TryFrom<u64> + Clone + Send + Sync + 'static,
    <T as TryFrom<u64>>::Error: std::error::Error + Send + Sync + 'static,
{
    clap::builder::RangedU64ValueParser::<T>::new().range(0..=i64::MAX as u64)
}

impl TrainArgs {
    /// Defaults, then the file, then the flags, then `--set`; validated.
    pub fn resolve(&self) -> anyhow::Result<TrainConfig> {
        self.resolve_with(&toml::Table::new())
    }

    /// [`TrainArgs::resolve`] with the layout flags given on the command line: `parallel` holds
    /// them as `[parallel]` keys (`tp = 2`), each replacing the file's value of that key.
    pub fn resolve_with(&self, parallel: &toml::Table) -> anyhow::Result<TrainConfig> {
        let mut table = toml::Table::new();
        let mut context = "command line".to_string();
        if let Some(path) = &self.config {
            let text = crate::fsio::read_to_string(path).map_err(ConfigError::Read)?;
            context = path.display().to_string();
            merge_file(&mut table, &text, &context)?;
        }
        let mut put = |k: &str, v: toml::Value| {
            table.insert(k.to_string(), v);
        };
        let int = |v: u64| toml::Value::Integer(v as i64);
        let path = |p: &Path| toml::Value::String(p.display().to_string());
        if let Some(m) = &self.model {
            put("model", toml::Value::String(m.clone()));
        }
        if let Some(v) = self.steps {
            put("steps", int(v));
        }
        if let Some(v) = self.batch_size {
            put("batch_size", int(v as u64));
        }
        if let Some(v) = self.seq_len {
            put("seq_len", int(v as u64));
        }
        if let Some(v) = self.grad_accum {
            put("grad_accum", int(v as u64));
        }
        if let Some(v) = self.lr {
            put("lr", toml::Value::Float(v));
        }
        if let Some(v) = self.min_lr {
            put("min_lr", toml::Value::Float(v));
        }
        if let Some(v) = self.warmup_steps {
            put("warmup_steps", int(v));
        }
        if let Some(v) = self.seed {
            put("seed", int(v));
        }
        if let Some(v) = self.sampling {
            put(
                "sampling",
                toml::Value::String(format!("{v:?}").to_lowercase()),
            );
        }
        if let Some(v) = &self.run_dir {
            put("run_dir", path(v));
        }
        if let Some(v) = &self.data {
            put("data", toml::Value::String(v.clone()));
        }
        if let Some(v) = self.eval_every {
            put("eval_every", int(v));
        }
        if let Some(v) = self.eval_iters {
            put("eval_iters", int(v as u64));
        }
        if let Some(v) = self.ckpt_every {
            put("ckpt_every", int(v));
        }
        if let Some(v) = self.log_every {
            put("log_every", int(v));
        }
        if self.mem_report {
            put("mem_report", toml::Value::Boolean(true));
        }
        if self.log_ranks {
            put("log_ranks", toml::Value::Boolean(true));
        }
        if self.overwrite {
            put("overwrite", toml::Value::Boolean(true));
        }
        if self.profile_phases {
            put("profile_phases", toml::Value::Boolean(true));
        }
        if self.profile_ops {
            put("profile_ops", toml::Value::Boolean(true));
        }
        if self.activation_checkpointing {
            put("activation_checkpointing", toml::Value::Boolean(true));
        }
        if let Some(v) = self.backward {
            put(
                "backward",
                toml::Value::String(format!("{v:?}").to_lowercase()),
            );
        }
        if let Some(v) = self.device {
            put(
                "device",
                toml::Value::String(format!("{v:?}").to_lowercase()),
            );
        }
        if let Some(v) = self.dtype {
            put(
                "dtype",
                toml::Value::String(format!("{v:?}").to_lowercase()),
            );
        }
        if let Some(v) = self.grad_reduce_dtype {
            put(
                "grad_reduce_dtype",
                toml::Value::String(format!("{v:?}").to_lowercase()),
            );
        }
        if let Some(v) = &self.resume {
            put("resume", path(v));
        }
        if let Some(v) = &self.init_from {
            put("init_from", path(v));
        }
        if !parallel.is_empty() {
            let mut t = match table.remove("parallel") {
                Some(toml::Value::Table(t)) => t,
                _ => toml::Table::new(),
            };
            t.extend(parallel.clone());
            table.insert("parallel".into(), toml::Value::Table(t));
        }
        // Whether the vocabulary is the user's choice: a `[model]` table of the file names it, or
        // `--set model.vocab_size=N`; a preset's vocabulary yields to the data's.
        let in_file = matches!(table.get("model"), Some(toml::Value::Table(t)) if t.contains_key("vocab_size"));
        let vocab_given = in_file
            || self.overrides.iter().any(|kv| {
                let key = kv.split_once('=').map_or(kv.as_str(), |(k, _)| k).trim();
                key.strip_prefix("train.").unwrap_or(key) == "model.vocab_size"
            });
        for kv in &self.overrides {
            apply_override(&mut table, kv)?;
        }
        let mut cfg = deserialize(table, &context)?;
        cfg.fit_vocab_to_data(vocab_given)?;
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Parse `args` as the training flags and resolve them: the tests' way through the whole
/// resolution (file, flags, `--set`, validation).
#[cfg(test)]
pub(in crate::config) fn resolve_args(args: &[&str]) -> anyhow::Result<TrainConfig> {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        train: TrainArgs,
    }
    let mut argv = vec!["mtrain"];
    argv.extend_from_slice(args);
    Cli::try_parse_from(argv)?.train.resolve()
}

#[cfg(test)]
mod tests {
    use super::resolve_args as resolve;

    /// A flag value beyond a TOML integer is refused by clap with the range, not wrapped.
    #[test]
    fn integers_beyond_toml_are_refused_at_parse() {
        for flag in ["--steps", "--seed", "--batch-size", "--log-every"] {
            let e = resolve(&[flag, "18446744073709551615"])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(flag) && e.contains("0..=9223372036854775807"),
                "{e}"
            );
        }
        let cfg = resolve(&["--seed", "9223372036854775807"]).unwrap();
        assert_eq!(cfg.seed, i64::MAX as u64);
    }
}
