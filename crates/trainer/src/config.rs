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
//!
//! ```text
//!   config.rs           TrainConfig: the fields, their defaults, validate
//!   config/parallel.rs  the [parallel] table (ParallelConfig)
//!   config/args.rs      the training flags (TrainArgs) and the resolution order above
//!   config/merge.rs     the one TOML merge: a file's tables, `--set` on a dotted key
//! ```

use std::fmt;
use std::path::PathBuf;

use mtrain_model::GptConfig;
use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

use crate::data::{DataSource, Sampling};

mod args;
mod merge;
pub mod parallel;

pub use args::TrainArgs;
pub use parallel::{ParallelConfig, Schedule, TpOverlapFlag};

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
    /// Seed of the weight initialisation and of the data draws.
    pub seed: u64,
    /// Dropout probability of the model's dropout sites during training (nanoGPT's `dropout`,
    /// written `model.dropout`; [`mtrain_model::dropout`]); 0 turns it off.
    pub dropout: f64,
    /// How training batches are drawn: `random` (each row at a uniform offset of the split,
    /// nanoGPT's get_batch) or `epochs` (non-overlapping windows, shuffled every epoch); see
    /// [`crate::data::sampling`].
    pub sampling: Sampling,
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
    /// Evaluate every N steps and at the end (0 disables): the mean loss of `eval_iters` batches
    /// drawn at random from each split, training and validation, as nanoGPT's estimate_loss.
    pub eval_every: u64,
    /// Batches per split per evaluation.
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
    /// Time and count every op of the steps after the first (at most three): ops.json and
    /// roofline.svg in the run directory (see `roofline`).
    pub profile_ops: bool,
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
    /// Start from GPT-2 weights in Hugging Face's layout (a `.safetensors` file or a directory
    /// with one) instead of a random initialisation ([`crate::tools::hf`]); a resume's
    /// checkpoint wins.
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
            dropout: 0.0,
            sampling: Sampling::Random,
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
            profile_ops: false,
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
    /// How this run's steps run, for the memory estimate, on the backward `path`.
    pub fn step_run(&self, path: crate::memory::BackwardPath) -> crate::memory::StepRun {
        crate::memory::StepRun {
            seq: self.seq_len,
            dtype_bytes: self.dtype.candle().size_in_bytes(),
            checkpointing: self.activation_checkpointing,
            path,
            grad_accum: self.grad_accum,
        }
    }

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
        if self.profile_ops && self.backward == Some(BackwardKind::Autograd) {
            return bad("profile_ops counts the ops of the hand-written backward; autograd's run \
                 outside them: drop backward = \"autograd\" (--backward autograd)"
                .into());
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad(format!(
                "dropout {} must be a probability in [0, 1)",
                self.dropout
            ));
        }
        if self.seq_len > model.block_size {
            return bad(format!(
                "seq_len {} exceeds the model's block_size {}",
                self.seq_len, model.block_size
            ));
        }
        let cp = self.parallel.cp;
        if cp > 1 && !self.seq_len.is_multiple_of(2 * cp) {
            return bad(format!(
                "seq_len {} is not divisible by 2·cp = {}: each of the {cp} context-parallel ranks holds two equal chunks of every sequence",
                self.seq_len,
                2 * cp
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

    /// The numbers no other check covers: finite floats, counts and the model's dimensions in
    /// range ([`crate::validate`]). Whether the run fits this machine is [`Self::check_fits_host`],
    /// asked only by the commands that allocate.
    fn validate_numbers(&self, model: &GptConfig) -> Result<(), String> {
        use crate::validate::{self, MAX_COUNT};
        validate::positive("eps", self.eps)?;
        validate::non_negative("weight_decay", self.weight_decay)?;
        validate::non_negative("grad_clip", self.grad_clip)?;
        validate::at_most("grad_accum", self.grad_accum, MAX_COUNT)?;
        validate::at_most("eval_iters", self.eval_iters, MAX_COUNT)?;
        validate::at_most("batch_size", self.batch_size, MAX_COUNT)?;
        validate::model_shape(model)
    }

    /// A run that builds the model: its fp32 weights and a micro-batch's logits must fit in this
    /// machine's memory ([`crate::validate::model_size`], [`crate::validate::micro_batch`]).
    /// `mtrain plan` builds nothing and does not ask.
    pub fn check_fits_host(&self) -> Result<(), ConfigError> {
        use crate::validate;
        let model = self.gpt_config()?;
        let memory = validate::host_memory_bytes();
        validate::model_size(&model, memory).map_err(ConfigError::Invalid)?;
        // On a GPU the logits live in device memory, which is only known once the device is open.
        let host = (self.device == DeviceKind::Cpu).then_some(memory).flatten();
        validate::micro_batch(self.batch_size, self.seq_len, model.vocab_size, host)
            .map_err(ConfigError::Invalid)
    }

    /// Parse a whole config file's text (`[model]`, `[train]` and `[parallel]` tables) on top of
    /// the defaults.
    pub fn from_toml_str(text: &str, context: &str) -> Result<Self, ConfigError> {
        let mut table = toml::Table::new();
        merge::merge_file(&mut table, text, context)?;
        merge::finish(table, context)
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

#[cfg(test)]
mod tests {
    use super::args::resolve_args as resolve;
    use std::path::Path;

    use super::*;

    #[test]
    fn default_is_valid_and_tiny() {
        let c = TrainConfig::default();
        c.validate().unwrap();
        assert_eq!(c.gpt_config().unwrap(), GptConfig::tiny());
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

    /// configs/shakespeare-char.toml holds nanoGPT's shakespeare_char recipe.
    #[test]
    fn shakespeare_char_config_is_nanogpts_recipe() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/shakespeare-char.toml");
        let text = std::fs::read_to_string(&path).unwrap();
        let c = TrainConfig::from_toml_str(&text, "shakespeare-char.toml").unwrap();
        let m = c.gpt_config().unwrap();
        assert_eq!(
            (m.n_layer, m.n_head, m.n_embd, m.block_size),
            (6, 6, 384, 256)
        );
        assert_eq!(
            (c.batch_size, c.seq_len, c.grad_accum, c.steps),
            (64, 256, 1, 5000)
        );
        assert_eq!((c.lr, c.min_lr, c.warmup_steps), (1e-3, 1e-4, 100));
        assert_eq!(
            (c.beta1, c.beta2, c.weight_decay, c.grad_clip),
            (0.9, 0.99, 0.1, 1.0)
        );
        assert_eq!(
            (c.eval_every, c.eval_iters, c.sampling),
            (250, 200, Sampling::Random)
        );
        assert_eq!(c.dropout, 0.2);
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
