//! `mtrain sample`: generate text from a checkpoint.
//!
//! The checkpoint's meta.json carries the run's config, so the model is rebuilt from it and the
//! weights are loaded by name. Ids are turned back into text with the prepared `tokenizer.json`
//! (found next to the run's token shards, or given with `--tokenizer`), with the character
//! vocabulary `chars.json` of data prepared with `--chars`, or as raw bytes for the built-in
//! byte-level corpus.
//!
//! By default the model decodes with a KV cache ([`mtrain_model::decode`]): the prompt runs once,
//! then each new token runs alone against every block's cached keys and values;
//! `--no-kv-cache` runs the whole context again for every token, as nanoGPT's `generate` does.
//! Both give the same tokens for a dense model.

use std::path::PathBuf;

use anyhow::Context;
use candle_core::{DType, Device, Tensor};
use mtrain_model::Gpt;
use rand::SeedableRng;
use tokenizers::Tokenizer;

use crate::checkpoint;
use crate::config::DeviceKind;
use crate::data::chars::{CharVocab, CHARS_FILE};
use crate::data::DataSource;
use crate::roofline::decode::{self, DecodeProfile, DecodeRun};
use crate::tools::prepare;

/// Arguments of `mtrain sample`.
#[derive(Debug, Clone, clap::Args)]
pub struct SampleArgs {
    /// A checkpoint directory (step-N) or a run directory (its newest checkpoint).
    #[arg(long, value_name = "DIR")]
    pub checkpoint: PathBuf,
    /// Text the generation continues.
    #[arg(long, default_value = "the ")]
    pub prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 200)]
    pub max_new_tokens: usize,
    /// Softmax temperature (0 = greedy).
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Sample only among the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// tokenizer.json (or a --chars directory's chars.json) to decode with; default: the one
    /// beside the run's shards, or bytes.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Where to run the model.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// Run the whole context through the model for every new token instead of decoding one
    /// position at a time against the cached keys and values.
    #[arg(long)]
    pub no_kv_cache: bool,
    /// Profile the decoding (every new token after the first, with the KV cache) op by op:
    /// decode-ops.json and the roofline.svg of the checkpoint's run directory, with the
    /// training step's ops where the run was profiled (`crate::roofline::decode`).
    #[arg(long)]
    pub profile_ops: bool,
}

/// What `sample` generated, and how fast.
pub struct Sampled {
    /// The prompt followed by the continuation.
    pub text: String,
    /// Tokens generated.
    pub new_tokens: usize,
    /// Wall time of the generation (prefill and every new token), in seconds.
    pub seconds: f64,
    /// Whether the KV cache decoded.
    pub kv_cache: bool,
    /// With `--profile-ops`: the decode report's table and the files written.
    pub ops: Option<(String, Vec<PathBuf>)>,
}

impl Sampled {
    /// `256 tokens in 3.20 s: 80.0 tokens/s (KV cache)`.
    pub fn rate_line(&self) -> String {
        format!(
            "{} tokens in {:.2} s: {:.1} tokens/s ({})",
            self.new_tokens,
            self.seconds,
            self.new_tokens as f64 / self.seconds.max(1e-9),
            if self.kv_cache { "KV cache" } else { "no KV cache" }
        )
    }
}

/// How ids and text map to each other.
enum Codec {
    Bytes,
    Bpe(Box<Tokenizer>),
    Chars(CharVocab),
}

impl Codec {
    fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        match self {
            Codec::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Codec::Bpe(t) => Ok(prepare::encode(t, text)?),
            Codec::Chars(v) => Ok(v.encode(text)?),
        }
    }

    /// Ids the codec can write.
    fn vocab_size(&self) -> usize {
        match self {
            Codec::Bytes => 256,
            Codec::Bpe(t) => t.get_vocab_size(true),
            Codec::Chars(v) => v.len(),
        }
    }

    fn decode(&self, ids: &[u32]) -> anyhow::Result<String> {
        match self {
            Codec::Bytes => Ok(String::from_utf8_lossy(
                &ids.iter().map(|&i| i as u8).collect::<Vec<_>>(),
            )
            .into_owned()),
            Codec::Bpe(t) => t
                .decode(ids, false)
                .map_err(|e| anyhow::anyhow!("decoding: {e}")),
            Codec::Chars(v) => Ok(v.decode(ids)?),
        }
    }
}

/// The device a [`DeviceKind`] names (CUDA device `ordinal`).
pub fn make_device(kind: DeviceKind, ordinal: usize) -> anyhow::Result<Device> {
    match kind {
        DeviceKind::Cpu => Ok(Device::Cpu),
        DeviceKind::Cuda => Device::new_cuda(ordinal).with_context(|| {
            format!("cannot open CUDA device {ordinal} (was mtrain built with --features cuda?)")
        }),
    }
}

/// Generate from the checkpoint: the prompt followed by the continuation, and the time it took.
pub fn sample(args: &SampleArgs) -> anyhow::Result<Sampled> {
    crate::validate::non_negative("--temperature", args.temperature).map_err(anyhow::Error::msg)?;
    crate::validate::at_most(
        "--max-new-tokens",
        args.max_new_tokens,
        crate::validate::MAX_COUNT,
    )
    .map_err(anyhow::Error::msg)?;
    if args.profile_ops && args.no_kv_cache {
        anyhow::bail!("--profile-ops profiles decoding with the KV cache; leave out --no-kv-cache");
    }
    let dir = checkpoint::resolve(&args.checkpoint)?;
    let device = make_device(args.device, 0)?;
    let ckpt = checkpoint::load(&dir, &device)?;
    let mut cfg = ckpt.meta.config.gpt_config()?;
    let mut weights = ckpt.full_model(&device)?;
    let tokenizer = match (&args.tokenizer, &ckpt.meta.config.data) {
        (Some(p), _) => Some(p.clone()),
        (None, DataSource::Shards(d)) => [d.join(CHARS_FILE), d.join("tokenizer.json")]
            .into_iter()
            .find(|p| p.exists()),
        (None, DataSource::Builtin) => None,
    };
    let codec = match tokenizer {
        Some(p) if p.file_name() == Some(CHARS_FILE.as_ref()) => Codec::Chars(CharVocab::load(&p)?),
        Some(p) => {
            crate::fsio::regular_file(&p)?;
            Codec::Bpe(Box::new(
                Tokenizer::from_file(&p)
                    .map_err(|e| anyhow::anyhow!("loading {}: {e}", p.display()))?,
            ))
        }
        None => Codec::Bytes,
    };
    // The model's vocabulary is the data's padded to a multiple of 64; the padding ids are never
    // a target, so only the data's ids are drawn: the model is built with the head's (tied
    // embedding's) first rows alone, whose logits are the full model's.
    let data_vocab = codec.vocab_size().min(cfg.vocab_size);
    if data_vocab < cfg.vocab_size {
        let wte = weights
            .get("wte.weight")
            .with_context(|| format!("{}: no wte.weight", dir.display()))?
            .narrow(0, 0, data_vocab)?; // (V_data, C)
        weights.insert("wte.weight".into(), wte);
        cfg.vocab_size = data_vocab;
    }
    let model = Gpt::new(cfg.clone(), &weights, &device)
        .with_context(|| format!("building the model from {}", dir.display()))?;
    let ids = codec.encode(&args.prompt)?;
    anyhow::ensure!(
        !ids.is_empty(),
        "the prompt is empty; give at least one character"
    );
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= cfg.vocab_size) {
        anyhow::bail!(
            "prompt token {bad} is outside the model's vocabulary of {}",
            cfg.vocab_size
        );
    }
    let n = ids.len();
    let idx = Tensor::from_vec(ids, (1, n), &device)?; // (1, T0)
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let top_k = (args.top_k > 0).then_some(args.top_k);
    let (new, temp) = (args.max_new_tokens, args.temperature);
    let mut profiled = args.profile_ops.then(DecodeProfile::new);
    let start = std::time::Instant::now();
    let out = match (args.no_kv_cache, profiled.as_mut()) {
        (false, None) => model.generate_cached(&idx, new, temp, top_k, &mut rng)?, // (1, T0 + new)
        (false, Some(p)) => model.generate_cached_with(&idx, new, (temp, top_k), &mut rng, |at, run| {
            p.forward(at, run)
        })?,
        (true, _) => model.generate(&idx, new, temp, top_k, &mut rng)?, // (1, T0 + new)
    };
    let seconds = start.elapsed().as_secs_f64();
    let out: Vec<u32> = out.squeeze(0)?.to_vec1()?;
    let ops = match profiled {
        Some(p) => {
            let dtype = weights.values().next().map_or(DType::F32, |w| w.dtype());
            let on = (&device, if device.is_cpu() { "cpu" } else { "cuda" }, dtype);
            let run = DecodeRun { batch: 1, prompt_tokens: n };
            let report = p.report(&cfg, on, run)?.with_context(|| {
                format!("--profile-ops: no token to profile; ask for at least 2 new tokens \
                         within block_size {}", cfg.block_size)
            })?;
            let run_dir = dir.parent().unwrap_or(&dir);
            let mut written = vec![decode::write(run_dir, &report)?];
            written.extend(crate::tools::plot::run_roofline(run_dir)?);
            Some((crate::roofline::table(&report), written))
        }
        None => None,
    };
    Ok(Sampled {
        text: codec.decode(&out)?,
        new_tokens: new,
        seconds,
        kv_cache: !args.no_kv_cache,
        ops,
    })
}
