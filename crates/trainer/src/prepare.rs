//! `mtrain prepare`: train a byte-level BPE tokenizer on a text file and write token shards.
//!
//! Byte-level BPE (GPT-2's tokenizer) starts from the 256 byte values, so any text is encodable
//! with no unknown token, and repeatedly merges the most frequent adjacent pair until the
//! vocabulary reaches `--vocab-size`:
//!
//! ```text
//! "the cat"  bytes:  t h e Ġ c a t        (Ġ = the space byte in GPT-2's printable byte alphabet)
//! merge (t,h)     -> th e Ġ c a t
//! merge (th,e)    -> the Ġ c a t
//! merge (Ġ,c) ... -> the Ġcat
//! ```
//!
//! Output in `--out DIR`: `tokenizer.json` (loadable by the `tokenizers` crate and by Hugging Face
//! `tokenizers`), and the text's ids split into `train_000.bin` / `val_000.bin` (the last
//! `--val-fraction` of the tokens) with their JSON headers (see [`crate::data::shards`]).

use std::path::{Path, PathBuf};

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer, TokenizerBuilder};

use crate::data::{write_shard, DataError};
use crate::fsio::{IoContext, IoError};

/// The document separator added to the vocabulary (GPT-2's).
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// Why preparing failed.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// The arguments do not make sense.
    #[error("{0}")]
    Invalid(String),
    /// Reading the text or creating the output directory failed (names the operation and path).
    #[error(transparent)]
    Io(#[from] IoError),
    /// The tokenizers crate failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Writing a shard failed.
    #[error(transparent)]
    Data(#[from] DataError),
}

/// Arguments of `mtrain prepare`.
#[derive(Debug, Clone, clap::Args)]
pub struct PrepareArgs {
    /// UTF-8 text file to train the tokenizer on and to tokenize.
    #[arg(long, value_name = "FILE")]
    pub text: PathBuf,
    /// Vocabulary size (at least 257: the 256 bytes and <|endoftext|>).
    #[arg(long, default_value_t = 4096)]
    pub vocab_size: usize,
    /// Output directory for tokenizer.json and the shards.
    #[arg(long, value_name = "DIR", default_value = "data/prepared")]
    pub out: PathBuf,
    /// Fraction of the tokens (taken from the end) kept for validation.
    #[arg(long, default_value_t = 0.1)]
    pub val_fraction: f64,
}

/// What `prepare` produced.
#[derive(Debug, Clone, PartialEq)]
pub struct PrepareSummary {
    /// Vocabulary size of the trained tokenizer (with the special token).
    pub vocab_size: usize,
    /// Tokens in train_000.bin.
    pub train_tokens: usize,
    /// Tokens in val_000.bin.
    pub val_tokens: usize,
    /// Bytes of text per token (the compression BPE achieved).
    pub bytes_per_token: f64,
}

fn tok_err(e: impl std::fmt::Display) -> PrepareError {
    PrepareError::Tokenizer(e.to_string())
}

/// Train the tokenizer on `args.text`, tokenize it and write the shards into `args.out`.
pub fn prepare(args: &PrepareArgs) -> Result<PrepareSummary, PrepareError> {
    if args.vocab_size < 257 {
        return Err(PrepareError::Invalid(format!(
            "--vocab-size {} is below 257 (256 byte tokens + {END_OF_TEXT})",
            args.vocab_size
        )));
    }
    if !(0.0..1.0).contains(&args.val_fraction) {
        return Err(PrepareError::Invalid(format!(
            "--val-fraction {} must be in [0, 1)",
            args.val_fraction
        )));
    }
    crate::validate::at_most("--vocab-size", args.vocab_size, crate::validate::MAX_COUNT)
        .map_err(PrepareError::Invalid)?;
    let text = crate::fsio::read_to_string(&args.text)?;
    std::fs::create_dir_all(&args.out).at("creating directory", &args.out)?;

    let tokenizer = train_tokenizer(&args.text, args.vocab_size)?;
    let tok_path = args.out.join("tokenizer.json");
    tokenizer
        .save(&tok_path, false)
        .map_err(|e| PrepareError::Tokenizer(format!("writing {}: {e}", tok_path.display())))?;
    // Reload through the generic `Tokenizer`, exactly as `mtrain sample` will.
    let tokenizer = Tokenizer::from_file(&tok_path).map_err(tok_err)?;
    let ids = encode(&tokenizer, &text)?;
    let vocab_size = tokenizer.get_vocab_size(true);

    let n_val = ((ids.len() as f64) * args.val_fraction).round() as usize;
    let n_val = if args.val_fraction > 0.0 {
        n_val.max(2)
    } else {
        0
    };
    if n_val >= ids.len() {
        return Err(PrepareError::Invalid(format!(
            "{} gives only {} tokens, too few to split off {n_val} validation tokens",
            args.text.display(),
            ids.len()
        )));
    }
    let (train, val) = ids.split_at(ids.len() - n_val);
    write_shard(&args.out, "train_000", train, vocab_size)?;
    write_shard(&args.out, "val_000", val, vocab_size)?;
    Ok(PrepareSummary {
        vocab_size,
        train_tokens: train.len(),
        val_tokens: val.len(),
        bytes_per_token: text.len() as f64 / ids.len().max(1) as f64,
    })
}

/// A byte-level BPE tokenizer (GPT-2 style, no normalizer) trained on `text_file`.
pub fn train_tokenizer(text_file: &Path, vocab_size: usize) -> Result<Tokenizer, PrepareError> {
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
        .build();
    let mut tokenizer =
        TokenizerBuilder::<BPE, NormalizerWrapper, ByteLevel, ByteLevel, ByteLevel>::new()
            .with_model(BPE::default())
            .with_normalizer(None)
            .with_pre_tokenizer(Some(ByteLevel::new(false, true, true)))
            .with_post_processor(Some(ByteLevel::default()))
            .with_decoder(Some(ByteLevel::default()))
            .build()
            .map_err(tok_err)?;
    let file = text_file.to_str().ok_or_else(|| {
        PrepareError::Invalid(format!("{}: path is not valid UTF-8", text_file.display()))
    })?;
    tokenizer
        .train_from_files(&mut trainer, vec![file.to_string()])
        .map_err(|e| PrepareError::Tokenizer(format!("training on {file}: {e}")))?;
    Ok(Tokenizer::from(tokenizer))
}

/// Encode `text` in line-aligned chunks of about 1 MiB (the byte-level pre-tokenizer never merges
/// across a newline, so chunking at newlines gives the same ids as one call).
pub fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, PrepareError> {
    let mut ids = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let mut cut = rest.len().min(1 << 20);
        if cut < rest.len() {
            cut = rest[..cut].rfind('\n').map_or(cut, |i| i + 1);
            while !rest.is_char_boundary(cut) {
                cut += 1;
            }
        }
        let enc = tokenizer.encode(&rest[..cut], false).map_err(tok_err)?;
        ids.extend_from_slice(enc.get_ids());
        rest = &rest[cut..];
    }
    Ok(ids)
}
