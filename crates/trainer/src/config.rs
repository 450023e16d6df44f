//! Training configuration: a typed `TrainConfig`, read from a TOML file and overridden from the
//! command line.
//!
//! A configs/*.toml file has up to three tables:
//!
//! ```toml
//! [model]            # a GptConfig (or `model = "gpt2-124m"`, a preset name, at the top level)
//! n_layer = 12
//! ...
//! [train]            # the fields of TrainConfig below
//! steps = 5000
//! lr = 6e-4
//! [parallel]         # the layout (`parallel::ParallelConfig`); the layout flags' names
//! tp = 2
//! pp = 2
//! ```
//!
//! Resolution order: defaults (the built-in tiny model on the built-in corpus, a short run, one
//! rank), then the file, then the flags (`--steps 10`, `--tp 2`), then `--set key=value` overrides
//! (`--set warmup_steps=5`, `--set model.n_layer=2`, `--set parallel.pp=2`,
//! `--set model.moe.n_experts=8`: a dotted key reaches any nested table). Every key is checked:
//! an unknown one is refused with its name. Every number is checked once the whole config is
//! merged ([`TrainConfig::validate`], [`crate::validate`]).

use std::fmt;
use std::path::{Path, PathBuf};

use mtrain_model::GptConfig;
use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

use crate::data::DataSource;

pub mod parallel;
pub use parallel::{DdpMode, ParallelConfig, Schedule};

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read (names the operation and the path).
    #[error("config: {0}")]
    Read(crate::fsio::IoError),
    /// The TOML does not parse or does not match the fields (unknown keys are named here).
    #[error("{context}: {message}")]
    Parse {
        /// Where (file name, `--set`, ...).
        context: String,
        /// The parser's message.
        message: String,
    },
    /// The values do not make sense together.
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// The model to train: a preset name or a full `GptConfig`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum ModelSpec {
    /// A name accepted by `GptConfig::preset` (`tiny`, `gpt2-124m`, `gpt2-350m`, `moe-tiny`).
    Preset(String),
    /// An explicit `[model]` table.
    Config(GptConfig),
}

impl<'de> Deserialize<'de> for ModelSpec {
    // Hand-written rather than `untagged` so that an unknown key inside `[model]` is reported by name.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ModelSpec;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(
                    f,
                    "a preset name ({}) or a [model] table",
                    GptConfig::PRESETS.join(", ")
                )
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<ModelSpec, E> {
                Ok(ModelSpec::Preset(s.to_string()))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<ModelSpec, A::Error> {
                GptConfig::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(ModelSpec::Config)
            }
        }
        d.deserialize_any(V)
    }
}

impl ModelSpec {
    /// The model configuration this spec names.
    pub fn resolve(&self) -> Result<GptConfig, ConfigError> {
        let cfg = match self {
            ModelSpec::Preset(name) => GptConfig::preset(name).ok_or_else(|| {
                ConfigError::Invalid(format!(
                    "unknown model preset `{name}`; known: {}",
                    GptConfig::PRESETS.join(", ")
                ))
            })?,
            ModelSpec::Config(c) => c.clone(),
        };
        cfg.validate()
            .map_err(|e| ConfigError::Invalid(format!("model: {e}")))?;
        Ok(cfg)
    }
}

/// Where the model computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// The CPU.
    Cpu,
    /// A CUDA GPU (the one matching the local rank).
    Cuda,
}

/// Numeric format of the forward/backward compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DTypeKind {
    /// fp32 everywhere.
    F32,
    /// bf16 weights and activations in compute, fp32 master weights and Adam state.
    Bf16,
}

/// How the backward pass of each segment is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BackwardKind {
    /// The hand-written backward of every segment (its tape) on every device.
    Tapes,
    /// candle's autograd: the plain path the tapes are tested against.
    Autograd,
}

/// Everything a training run needs to know.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// The model: a preset name or a `[model]` table.
    pub model: ModelSpec,
    /// Seed of the weight initialisation and of the data order.
    pub seed: u64,
    /// Sequences per micro-batch on each data-parallel rank.
    pub batch_size: usize,
    /// Tokens per sequence (at most the model's block_size).
    pub seq_len: usize,
    /// Micro-batches accumulated per optimizer step.
    pub grad_accum: usize,
    /// Optimizer steps to run.
    pub steps: u64,
    /// Peak learning rate (after warmup).
    pub lr: f64,
    /// Learning rate at the end of the cosine decay.
    pub min_lr: f64,
    /// Steps of linear learning-rate warmup.
    pub warmup_steps: u64,
    /// Decoupled AdamW weight decay (applied to ≥2-D weights only).
    pub weight_decay: f64,
    /// AdamW β1.
    pub beta1: f64,
    /// AdamW β2.
    pub beta2: f64,
    /// AdamW ε.
    pub eps: f64,
    /// Clip the global gradient norm to this value (0 disables clipping).
    pub grad_clip: f64,
    /// Evaluate the validation loss every N steps and at the end (0 disables).
    pub eval_every: u64,
    /// Validation batches per evaluation.
    pub eval_iters: usize,
    /// Write a checkpoint every N steps (0: only at the end).
    pub ckpt_every: u64,
    /// Directory for checkpoints, metrics.jsonl and memory.jsonl.
    pub run_dir: PathBuf,
    /// Training data: "builtin" or a directory of token shards written by `mtrain prepare`.
    pub data: DataSource,
    /// Recompute each block's forward during backward instead of keeping its activations.
    pub activation_checkpointing: bool,
    /// The backward path; unset: the engine's default ([`mtrain_model::Backward::default`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backward: Option<BackwardKind>,
    /// Print and record the per-step memory report.
    pub mem_report: bool,
    /// Time each phase of a step (data, forward, backward, gradient norm, optimizer), with the
    /// device synchronised at every boundary; logged and recorded in metrics.jsonl.
    pub profile_phases: bool,
    /// Where to compute.
    pub device: DeviceKind,
    /// Compute dtype.
    pub dtype: DTypeKind,
    /// Dtype gradients are reduced in across ranks under `dtype = "bf16"` (and what the
    /// optimizer sees): f32 upcasts the bf16 gradients before the all-reduce / reduce-scatter.
    pub grad_reduce_dtype: DTypeKind,
    /// Log a line (and a metrics record) every N steps.
    pub log_every: u64,
    /// Every rank logs its step lines, not rank 0 alone.
    pub log_ranks: bool,
    /// Replace the run already in `run_dir` (its metrics, logs and checkpoints) instead of
    /// refusing to start; see `crate::run_dir`.
    pub overwrite: bool,
    /// Peak FLOP/s of one device for the MFU figure; unset: a nominal figure for the device kind.
    pub peak_flops: Option<f64>,
    /// Continue from a checkpoint: a step-N directory, a run directory, or "latest" (this run_dir).
    pub resume: Option<PathBuf>,
    /// Start from GPT-2 weights in Hugging Face's layout (a `.safetensors` file) instead of a
    /// random initialisation ([`crate::checkpoint::hf_gpt2`]); a resume's checkpoint wins.
    pub init_from: Option<PathBuf>,
    /// The layout: the `[parallel]` table.
    pub parallel: ParallelConfig,
}

/// Nominal peak used for MFU on CPU when `peak_flops` is unset: an assumed 1e11 FLOP/s (about what
/// two modern cores reach in f32 GEMM). It is a placeholder, labelled as such in the progress line.
pub const CPU_PLACEHOLDER_PEAK_FLOPS: f64 = 1e11;
/// Nominal peak on CUDA when `peak_flops` is unset: H100/H200 SXM dense bf16, 989 TFLOP/s.
pub const CUDA_DEFAULT_PEAK_FLOPS: f64 = 989e12;

impl DTypeKind {
    /// The candle dtype of the compute copy.
    pub fn candle(self) -> candle_core::DType {
        match self {
            DTypeKind::F32 => candle_core::DType::F32,
            DTypeKind::Bf16 => candle_core::DType::BF16,
        }
    }
}

impl Default for TrainConfig {
    /// The built-in tiny model on the built-in corpus for 200 steps (well under a minute on 2 cores).
    fn default() -> Self {
        Self {
            model: ModelSpec::Preset("tiny".into()),
            seed: 1337,
            batch_size: 16,
            seq_len: 64,
            grad_accum: 1,
            steps: 200,
            lr: 6e-3,
            min_lr: 6e-4,
            warmup_steps: 20,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
            eval_every: 100,
            eval_iters: 8,
            ckpt_every: 0,
            run_dir: PathBuf::from("runs/default"),
            data: DataSource::Builtin,
            activation_checkpointing: false,
            backward: None,
            mem_report: false,
            profile_phases: false,
            device: DeviceKind::Cpu,
            dtype: DTypeKind::F32,
            grad_reduce_dtype: DTypeKind::F32,
            log_every: 10,
            log_ranks: false,
            overwrite: false,
            peak_flops: None,
            resume: None,
            init_from: None,
            parallel: ParallelConfig::default(),
        }
    }
}

impl TrainConfig {
    /// The mixed-precision setting of a parallel plan: compute in `dtype`, reduce gradients in
    /// `grad_reduce_dtype` (fp32 masters whenever `dtype` is bf16).
    pub fn precision(&self) -> mtrain_parallel::mixed_precision::MixedPrecision {
        mtrain_parallel::mixed_precision::MixedPrecision {
            param_dtype: self.dtype.candle(),
            reduce_dtype: self.grad_reduce_dtype.candle(),
        }
    }

    /// The engine's backward path for this run.
    pub fn backward(&self) -> mtrain_model::Backward {
        match self.backward {
            None => mtrain_model::Backward::default(),
            Some(BackwardKind::Tapes) => mtrain_model::Backward::Tapes,
            Some(BackwardKind::Autograd) => mtrain_model::Backward::Autograd,
        }
    }

    /// The model configuration (preset resolved, validated).
    pub fn gpt_config(&self) -> Result<GptConfig, ConfigError> {
        self.model.resolve()
    }

    /// Peak FLOP/s for MFU and whether it is the CPU placeholder.
    pub fn peak_flops(&self) -> (f64, bool) {
        match (self.peak_flops, self.device) {
            (Some(p), _) => (p, false),
            (None, DeviceKind::Cpu) => (CPU_PLACEHOLDER_PEAK_FLOPS, true),
            (None, DeviceKind::Cuda) => (CUDA_DEFAULT_PEAK_FLOPS, false),
        }
    }

    /// Check the values against each other; messages name the values.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let model = self.gpt_config()?;
        let bad = |m: String| Err(ConfigError::Invalid(m));
        for (name, v) in [
            ("batch_size", self.batch_size),
            ("seq_len", self.seq_len),
            ("grad_accum", self.grad_accum),
        ] {
            if v == 0 {
                return bad(format!("{name} must be at least 1, got 0"));
            }
        }
        if self.seq_len > model.block_size {
            return bad(format!(
                "seq_len {} exceeds the model's block_size {}",
                self.seq_len, model.block_size
            ));
        }
        if !(self.lr.is_finite() && self.lr > 0.0)
            || !(self.min_lr.is_finite() && self.min_lr >= 0.0)
        {
            return bad(format!(
                "lr {} must be > 0 and min_lr {} >= 0",
                self.lr, self.min_lr
            ));
        }
        if self.min_lr > self.lr {
            return bad(format!("min_lr {} is above lr {}", self.min_lr, self.lr));
        }
        for (name, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return bad(format!("{name} {b} must be in [0, 1)"));
            }
        }
        self.validate_numbers(&model)
            .map_err(ConfigError::Invalid)?;
        if self.eval_every > 0 && self.eval_iters == 0 {
            return bad(format!(
                "eval_every {} needs eval_iters >= 1",
                self.eval_every
            ));
        }
        if let Some(p) = self.peak_flops {
            if !(p.is_finite() && p > 0.0) {
                return bad(format!("peak_flops {p} must be a positive number"));
            }
        }
        Ok(())
    }

    /// The numbers no other check covers: finite floats, counts in range, a model and a
    /// micro-batch that fit in this machine's memory ([`crate::validate`]).
    fn validate_numbers(&self, model: &GptConfig) -> Result<(), String> {
        use crate::validate::{self, MAX_COUNT};
        validate::positive("eps", self.eps)?;
        validate::non_negative("weight_decay", self.weight_decay)?;
        validate::non_negative("grad_clip", self.grad_clip)?;
        validate::at_most("grad_accum", self.grad_accum, MAX_COUNT)?;
        validate::at_most("eval_iters", self.eval_iters, MAX_COUNT)?;
        let memory = validate::host_memory_bytes();
        validate::model_size(model, memory)?;
        // On a GPU the logits live in device memory, which is only known once the device is open.
        let host = (self.device == DeviceKind::Cpu).then_some(memory).flatten();
        validate::micro_batch(self.batch_size, self.seq_len, model.vocab_size, host)
    }

    /// Parse a whole config file's text (`[model]`, `[train]` and `[parallel]` tables) on top of
    /// the defaults.
    pub fn from_toml_str(text: &str, context: &str) -> Result<Self, ConfigError> {
        let mut table = toml::Table::new();
        merge_file(&mut table, text, context)?;
        finish(table, context)
    }
}

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
    /// Seed of initialisation and data order.
    #[arg(long, value_parser = toml_integer::<u64>())]
    pub seed: Option<u64>,
    /// Run directory (checkpoints, metrics.jsonl, memory.jsonl).
    #[arg(long, value_name = "DIR")]
    pub run_dir: Option<PathBuf>,
    /// "builtin" or a token-shard directory from `mtrain prepare`.
    #[arg(long, value_name = "SOURCE")]
    pub data: Option<String>,
    /// Evaluate every N steps (0 disables).
    #[arg(long, value_name = "N", value_parser = toml_integer::<u64>())]
    pub eval_every: Option<u64>,
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
    /// Start from GPT-2 weights in Hugging Face's layout (model.safetensors), e.g. with
    /// `--model gpt2-124m`.
    #[arg(long, value_name = "FILE")]
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
        if let Some(v) = &self.run_dir {
            put("run_dir", path(v));
        }
        if let Some(v) = &self.data {
            put("data", toml::Value::String(v.clone()));
        }
        if let Some(v) = self.eval_every {
            put("eval_every", int(v));
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

impl TrainConfig {
    /// Prepared data decides the model's vocabulary unless the user gave one: the data's size
    /// padded to a multiple of 64 ([`crate::data::padded_vocab`]), as nanoGPT takes its
    /// `meta.pkl`'s. A vocabulary the user gave must hold every id of the data.
    pub fn fit_vocab_to_data(&mut self, vocab_given: bool) -> Result<(), ConfigError> {
        if self.data == DataSource::Builtin {
            return Ok(());
        }
        let data = crate::data::source_vocab_size(&self.data)
            .map_err(|e| ConfigError::Invalid(format!("data `{}`: {e}", self.data)))?;
        let mut model = self.gpt_config()?;
        if !vocab_given {
            model.vocab_size = crate::data::padded_vocab(data);
            self.model = ModelSpec::Config(model);
        } else if data > model.vocab_size {
            return Err(ConfigError::Invalid(format!(
                "the data `{}` has a vocabulary of {data} ids but model.vocab_size is {}: set \
                 model.vocab_size to at least {data}, or leave it out to take the data's ({})",
                self.data,
                model.vocab_size,
                crate::data::padded_vocab(data)
            )));
        }
        Ok(())
    }
}

/// Merge a config file's `[model]` / `[train]` / `[parallel]` tables (or a top-level
/// `model = "preset"`) into `table`.
fn merge_file(table: &mut toml::Table, text: &str, context: &str) -> Result<(), ConfigError> {
    let parse = |message: String| ConfigError::Parse {
        context: context.to_string(),
        message,
    };
    let file: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| parse(e.to_string()))?;
    for (key, value) in file {
        match (key.as_str(), value) {
            ("model", v @ (toml::Value::Table(_) | toml::Value::String(_))) => {
                table.insert("model".into(), v);
            }
            ("train", toml::Value::Table(t)) => table.extend(t),
            ("parallel", v @ toml::Value::Table(_)) => {
                table.insert("parallel".into(), v);
            }
            ("model", _) | ("train", _) | ("parallel", _) => {
                return Err(parse(format!(
                    "`{key}` must be a table (or, for model, a preset name)"
                )))
            }
            (other, _) => {
                return Err(parse(format!(
                    "unknown top-level key `{other}`; expected [model], [train] and [parallel]"
                )))
            }
        }
    }
    Ok(())
}

/// Apply `key=value` (value parsed as TOML, else taken as a string). A dotted key reaches into
/// nested tables (`model.moe.n_experts=8`), creating a missing one; `model` given as a preset
/// name is expanded into its table first; `parallel.x` edits the layout table; a leading `train.` is optional. Keys that name no
/// field are refused by name when the table is deserialized.
fn apply_override(table: &mut toml::Table, kv: &str) -> Result<(), ConfigError> {
    let parse = |message: String| ConfigError::Parse {
        context: format!("--set {kv}"),
        message,
    };
    let (key, raw) = kv
        .split_once('=')
        .ok_or_else(|| parse("expected KEY=VALUE".into()))?;
    let key = key.trim();
    let key = key.strip_prefix("train.").unwrap_or(key);
    let path: Vec<&str> = key.split('.').map(str::trim).collect();
    if path.iter().any(|k| k.is_empty()) {
        return Err(parse(format!("`{key}` has an empty key segment")));
    }
    let value = match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.to_string())),
        Err(_) => toml::Value::String(raw.to_string()),
    };
    set_path(table, &path, value, "").map_err(parse)
}

/// Set `path` (one key per nested table) in `table` to `value`; `above` is the dotted path of
/// `table` itself, for messages.
fn set_path(
    table: &mut toml::Table,
    path: &[&str],
    value: toml::Value,
    above: &str,
) -> Result<(), String> {
    let Some((&key, rest)) = path.split_first() else {
        return Ok(());
    };
    if rest.is_empty() {
        table.insert(key.to_string(), value);
        return Ok(());
    }
    let here = if above.is_empty() {
        key.to_string()
    } else {
        format!("{above}.{key}")
    };
    let mut inner = match table.remove(key) {
        None if here == "model" => expand_preset(&TrainConfig::default().model)?,
        None => toml::Table::new(),
        Some(toml::Value::Table(t)) => t,
        Some(toml::Value::String(name)) if here == "model" => {
            expand_preset(&ModelSpec::Preset(name))?
        }
        Some(other) => {
            return Err(format!(
                "`{here}` holds a {}, not a table, so it has no key `{}`",
                other.type_str(),
                rest.join(".")
            ))
        }
    };
    set_path(&mut inner, rest, value, &here)?;
    table.insert(key.to_string(), toml::Value::Table(inner));
    Ok(())
}

/// The `[model]` table a model spec stands for (a preset name resolved to its fields).
fn expand_preset(spec: &ModelSpec) -> Result<toml::Table, String> {
    let cfg = spec.resolve().map_err(|e| e.to_string())?;
    match toml::Value::try_from(cfg) {
        Ok(toml::Value::Table(t)) => Ok(t),
        Ok(_) | Err(_) => Err("cannot expand the model preset into a table".into()),
    }
}

/// Deserialize the merged table over the defaults.
fn deserialize(table: toml::Table, context: &str) -> Result<TrainConfig, ConfigError> {
    TrainConfig::deserialize(toml::Value::Table(table)).map_err(|e| ConfigError::Parse {
        context: context.to_string(),
        message: e.to_string(),
    })
}

/// Deserialize the merged table over the defaults and validate.
fn finish(table: toml::Table, context: &str) -> Result<TrainConfig, ConfigError> {
    let cfg = deserialize(table, context)?;
    cfg.validate()?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_and_tiny() {
        let c = TrainConfig::default();
        c.validate().unwrap();
        assert_eq!(c.gpt_config().unwrap(), GptConfig::tiny());
    }

    fn resolve(args: &[&str]) -> anyhow::Result<TrainConfig> {
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

    /// `--set` reaches every key: top-level, `model.*` (expanding a preset), `model.moe.*`.
    #[test]
    fn set_reaches_nested_keys() {
        let cfg = resolve(&[
            "--model",
            "moe-tiny",
            "--set",
            "model.moe.top_k=1",
            "--set",
            "model.moe.capacity_factor=2.0",
            "--set",
            "train.lr=1e-3",
        ])
        .unwrap();
        let model = cfg.gpt_config().unwrap();
        let moe = model.moe.as_ref().unwrap();
        assert_eq!((moe.top_k, moe.capacity_factor, moe.n_experts), (1, 2.0, 4));
        assert_eq!(cfg.lr, 1e-3);
        // A table created by --set must be complete: the missing fields are named.
        let e = resolve(&["--set", "model.moe.n_experts=8"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing field"), "{e}");
        let e = format!(
            "{:#}",
            resolve(&["--model", "moe-tiny", "--set", "model.moe.bogus=1"]).unwrap_err()
        );
        assert!(e.contains("bogus"), "{e}");
        let e = format!(
            "{:#}",
            resolve(&["--lr", "0.1", "--set", "lr.x=1"]).unwrap_err()
        );
        assert!(e.contains("`lr` holds a float, not a table"), "{e}");
        let e = format!("{:#}", resolve(&["--set", "lr.x=1"]).unwrap_err());
        assert!(e.contains("invalid type: map") && e.contains("`lr`"), "{e}");
        let e = format!("{:#}", resolve(&["--set", "model..n_head=1"]).unwrap_err());
        assert!(e.contains("empty key segment"), "{e}");
    }

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

    /// Special floats and sizes too large to allocate are refused with the option's name.
    #[test]
    fn bad_numbers_are_refused_with_the_option() {
        for (set, want) in [
            ("eps=inf", "eps inf must be a finite number > 0"),
            (
                "weight_decay=nan",
                "weight_decay NaN must be a finite number >= 0",
            ),
            (
                "grad_clip=inf",
                "grad_clip inf must be a finite number >= 0",
            ),
            ("lr=nan", "lr NaN must be > 0"),
            (
                "model.vocab_size=100000000000",
                "model.vocab_size 100000000000 is above the largest supported 16777216",
            ),
            (
                "batch_size=100000000",
                "batch_size 100000000 is above the largest supported 16777216",
            ),
        ] {
            let e = format!("{:#}", resolve(&["--set", set]).unwrap_err());
            assert!(e.contains(want), "--set {set}: {e}");
        }
    }

    /// Every shipped configs/*.toml parses, and its [model] table equals the preset of that name.
    #[test]
    fn shipped_configs_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        for name in GptConfig::PRESETS {
            let path = dir.join(format!("{name}.toml"));
            let text = std::fs::read_to_string(&path).unwrap();
            let cfg = TrainConfig::from_toml_str(&text, &path.display().to_string())
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                cfg.gpt_config().unwrap(),
                GptConfig::preset(name).unwrap(),
                "{name}"
            );
        }
    }
}
