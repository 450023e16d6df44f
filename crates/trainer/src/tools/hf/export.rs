//! `mtrain export --hf OUT [--checkpoint DIR]`: a checkpoint as a Hugging Face GPT-2 directory.
//!
//! ```text
//! OUT/
//!   config.json             GPT2Config: n_layer, n_head, n_embd, n_positions = block_size,
//!                           vocab_size = the tokenizer's, gelu_new, eps 1e-5, tied head
//!   model.safetensors       `transformer.*` in the hub's layout (the table in `hf.rs`), f32
//!   tokenizer.json          the run's tokenizer (beside its shards, or --tokenizer); for the
//!                           built-in byte corpus a byte-level one whose id of a byte is its value
//!   tokenizer_config.json   PreTrainedTokenizerFast, <|endoftext|> as bos/eos when it has one
//! ```
//!
//! Each parameter is read whole from the checkpoint's pieces (a sharded checkpoint is read
//! through its source, a byte range per piece), converted and written before the next one is
//! read, so exporting holds one parameter at a time and a run under tp 2 × pp 2 or ZeRO-3
//! exports as one on one device does. The embedding's padding rows (the vocabulary rounded up
//! to a multiple of 64) are dropped down to the tokenizer's vocabulary: no id reaches them, so
//! every logit of a real token is unchanged; `--init-from OUT` pads them back with zeros.

use std::path::PathBuf;

use anyhow::{bail, Context};
use candle_core::Device;
use mtrain_model::init::param_specs;
use serde_json::{json, Value};
use tokenizers::Tokenizer;

use super::{
    conversion, Conversion, ACTIVATION, CONFIG_FILE, LAYER_NORM_EPS, MODEL_FILE, MOE_REFUSAL,
};
use crate::checkpoint;
use crate::data::DataSource;
use crate::tools::prepare::END_OF_TEXT;

const TOKENIZER_FILE: &str = "tokenizer.json";
const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// Arguments of `mtrain export`.
#[derive(Debug, Clone, clap::Args)]
pub struct ExportArgs {
    /// Write a Hugging Face GPT-2 directory here (config.json, model.safetensors, tokenizer),
    /// loadable by transformers' `GPT2LMHeadModel.from_pretrained` and `AutoTokenizer`.
    #[arg(long, value_name = "OUT")]
    pub hf: PathBuf,
    /// A checkpoint directory (step-N) or a run directory (its newest checkpoint).
    #[arg(long, value_name = "DIR", default_value = "runs/default")]
    pub checkpoint: PathBuf,
    /// tokenizer.json to ship; default: the one beside the run's shards (a byte-level one for
    /// the built-in corpus).
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
}

/// What [`export`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportSummary {
    /// The checkpoint exported.
    pub checkpoint: PathBuf,
    /// Its step.
    pub step: u64,
    /// The exported vocabulary (the tokenizer's).
    pub vocab_size: usize,
    /// Padding rows of the embedding left out.
    pub dropped_rows: usize,
    /// Parameters written.
    pub n_params: usize,
}

/// Export the checkpoint `args.checkpoint` names into `args.hf`.
pub fn export(args: &ExportArgs) -> anyhow::Result<ExportSummary> {
    let dir = checkpoint::resolve(&args.checkpoint)?;
    let ckpt = checkpoint::load(&dir, &Device::Cpu)?;
    let cfg = ckpt
        .meta
        .config
        .gpt_config()
        .with_context(|| format!("the model recorded in {}", dir.display()))?;
    if cfg.moe.is_some() {
        bail!("cannot export {} as GPT-2: {MOE_REFUSAL}", dir.display());
    }
    let tokenizer = tokenizer_json(args, &ckpt.meta.config.data)?;
    let tok = Tokenizer::from_bytes(tokenizer.as_bytes())
        .map_err(|e| anyhow::anyhow!("the tokenizer does not load: {e}"))?;
    let vocab = tok.get_vocab_size(true);
    if vocab > cfg.vocab_size {
        bail!(
            "the tokenizer has {vocab} ids, more than the model's vocab_size {}: is it the run's tokenizer?",
            cfg.vocab_size
        );
    }
    let end_of_text = tok.token_to_id(END_OF_TEXT);

    // This model's tensors in Hugging Face's names and shapes, read from the checkpoint and
    // written one parameter at a time.
    let shapes = ckpt.shapes();
    let mut entries = Vec::new();
    let mut n_params = 0;
    for (name, shape, _) in param_specs(&cfg) {
        let stored = shapes
            .get(&name)
            .with_context(|| format!("{} has no tensor `{name}`", dir.display()))?;
        anyhow::ensure!(
            stored == &shape,
            "{}: `{name}` is {stored:?}, its model wants {shape:?}",
            dir.display()
        );
        let out_shape = match conversion(&name) {
            Conversion::Keep | Conversion::CropRows => shape.clone(),
            Conversion::Transpose => shape.iter().rev().copied().collect(), // (out, in) -> (in, out)
            Conversion::PadRows => vec![vocab, shape[1]], // (V, C) -> (vocab, C)
        };
        n_params += out_shape.iter().product::<usize>();
        entries.push((name, out_shape));
    }
    let hf_entries: Vec<(String, Vec<usize>)> = entries
        .iter()
        .map(|(n, s)| (format!("transformer.{n}"), s.clone()))
        .collect();
    let one = |i: usize| -> anyhow::Result<Vec<f32>> {
        let name = &entries[i].0;
        let t = ckpt.tensor(name, &Device::Cpu)?;
        let t = match conversion(name) {
            Conversion::Keep | Conversion::CropRows => t,
            Conversion::Transpose => t.t()?.contiguous()?,
            Conversion::PadRows => t.narrow(0, 0, vocab)?.contiguous()?,
        };
        Ok(t.flatten_all()?.to_vec1::<f32>()?)
    };

    let config = json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": Value::Null,
        "activation_function": ACTIVATION,
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "scale_attn_weights": true,
        "tie_word_embeddings": true,
        "bos_token_id": end_of_text,
        "eos_token_id": end_of_text,
        "torch_dtype": "float32",
    });
    let mut tokenizer_config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.block_size,
        "clean_up_tokenization_spaces": false,
    });
    if end_of_text.is_some() {
        tokenizer_config["bos_token"] = json!(END_OF_TEXT);
        tokenizer_config["eos_token"] = json!(END_OF_TEXT);
    }

    let out = &args.hf;
    std::fs::create_dir_all(out)
        .with_context(|| format!("creating directory {}", out.display()))?;
    let write = |file: &str, bytes: &[u8]| crate::fsio::write_synced(&out.join(file), bytes);
    checkpoint::shard_file::write_safetensors(
        &out.join(MODEL_FILE),
        &[("format", "pt")],
        &hf_entries,
        one,
    )
    .with_context(|| format!("writing {}", out.join(MODEL_FILE).display()))?;
    write(CONFIG_FILE, &pretty(&config)?)?;
    write(TOKENIZER_FILE, tokenizer.as_bytes())?;
    write(TOKENIZER_CONFIG_FILE, &pretty(&tokenizer_config)?)?;
    crate::fsio::sync_dir(out)?;
    Ok(ExportSummary {
        checkpoint: dir,
        step: ckpt.meta.step,
        vocab_size: vocab,
        dropped_rows: cfg.vocab_size - vocab,
        n_params,
    })
}

fn pretty(v: &Value) -> anyhow::Result<Vec<u8>> {
    let mut bytes = serde_json::to_vec_pretty(v)?;
    bytes.push(b'\n');
    Ok(bytes)
}

/// The text of the tokenizer.json to ship: `--tokenizer`, else the one beside the run's
/// shards, else (the built-in byte corpus) [`byte_tokenizer`].
fn tokenizer_json(args: &ExportArgs, data: &DataSource) -> anyhow::Result<String> {
    let path = match (&args.tokenizer, data) {
        (Some(p), _) => p.clone(),
        (None, DataSource::Shards(d)) => {
            let p = d.join(TOKENIZER_FILE);
            if !p.exists() {
                bail!(
                    "the run's data {} has no {TOKENIZER_FILE}; give the one its ids come from with --tokenizer",
                    d.display()
                );
            }
            p
        }
        (None, DataSource::Builtin) => return Ok(byte_tokenizer()),
    };
    crate::fsio::regular_file(&path)?;
    Ok(crate::fsio::read_to_string(&path)?)
}

/// A byte-level tokenizer.json for the built-in corpus, whose ids are bytes: GPT-2's byte-level
/// pre-tokenizer and decoder (each byte shown as one printable character, [`byte_char`]) with a
/// BPE of no merges whose vocabulary maps the character of byte `b` to id `b`.
fn byte_tokenizer() -> String {
    let vocab: serde_json::Map<String, Value> = (0..=255u8)
        .map(|b| (byte_char(b).to_string(), json!(b)))
        .collect();
    let byte_level = json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
    });
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": []
        }
    })
    .to_string()
}

/// GPT-2's printable stand-in for byte `b`: the printable Latin-1 bytes are themselves, the
/// other 68 take the code points from 256 up, in byte order (so the space is `Ġ`, U+0120).
fn byte_char(b: u8) -> char {
    let printable = |x: u8| matches!(x, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return b as char;
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).expect("a code point below 324")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_characters_are_gpt2s() {
        assert_eq!(byte_char(b'a'), 'a');
        assert_eq!(byte_char(b' '), 'Ġ');
        assert_eq!(byte_char(b'\n'), 'Ċ');
        let all: std::collections::BTreeSet<char> = (0..=255u8).map(byte_char).collect();
        assert_eq!(all.len(), 256);
    }

    #[test]
    fn the_byte_tokenizer_maps_each_byte_to_its_value_and_back() {
        let tok = Tokenizer::from_bytes(byte_tokenizer().as_bytes()).unwrap();
        let text = "the cat\n  sat, ünïcode!";
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        let bytes: Vec<u32> = text.bytes().map(u32::from).collect();
        assert_eq!(ids, bytes);
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        assert_eq!(tok.get_vocab_size(true), 256);
    }
}
