//! `mtrain prepare`: tokenize a text file into token shards, with a byte-level BPE tokenizer trained
//! on it or an existing `tokenizer.json`.
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
//! With `--tokenizer FILE` no tokenizer is trained: the text is encoded with an existing Hugging
//! Face `tokenizer.json` (GPT-2's, say), which is copied into the output so `mtrain sample` decodes
//! with it. With `--chars` each character is a token, the vocabulary the text's characters in
//! sorted order, written as `chars.json` ([`crate::data::chars`], nanoGPT's shakespeare_char).
//!
//! Output in `--out DIR`: `tokenizer.json` (loadable by the `tokenizers` crate and by Hugging Face
//! `tokenizers`), and the text's ids split into `train_000.bin` / `val_000.bin` (the last
//! `--val-fraction` of the tokens) with their JSON headers (see [`crate::data::shards`]). A model
//! trained on them takes their vocabulary, padded to a multiple of 64
//! ([`crate::data::padded_vocab`]).

use std::path::{Path, PathBuf};

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer, TokenizerBuilder};

use crate::data::chars::{CharVocab, CHARS_FILE};
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
    /// UTF-8 text file to tokenize (and to train the tokenizer on, without --tokenizer).
    #[arg(long, value_name = "FILE")]
    pub text: PathBuf,
    /// Vocabulary size of the tokenizer to train (at least 257: the 256 bytes and
    /// <|endoftext|>) [default: 4096].
    #[arg(long, conflicts_with_all = ["tokenizer", "chars"])]
    pub vocab_size: Option<usize>,
    /// Characters as tokens: the vocabulary is the text's characters, sorted (chars.json).
    #[arg(long, conflicts_with = "tokenizer")]
    pub chars: bool,
    /// Encode with this existing Hugging Face tokenizer.json (e.g. GPT-2's) instead of training
    /// one; it is copied into --out.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
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

/// Vocabulary size `prepare` trains when `--vocab-size` is not given.
pub const DEFAULT_VOCAB_SIZE: usize = 4096;

/// Train the tokenizer on `args.text` (or load `args.tokenizer`), tokenize the text and write
/// the shards into `args.out`.
pub fn prepare(args: &PrepareArgs) -> Result<PrepareSummary, PrepareError> {
    let vocab_size = args.vocab_size.unwrap_or(DEFAULT_VOCAB_SIZE);
    if args.tokenizer.is_some() && args.vocab_size.is_some() {
        return Err(PrepareError::Invalid(
            "--vocab-size trains a tokenizer and --tokenizer uses an existing one: give one of them"
                .into(),
        ));
    }
    if args.chars && (args.tokenizer.is_some() || args.vocab_size.is_some()) {
        return Err(PrepareError::Invalid(
            "--chars makes each character a token: give neither --tokenizer nor --vocab-size"
                .into(),
        ));
    }
    if args.tokenizer.is_none() && !args.chars && vocab_size < 257 {
        return Err(PrepareError::Invalid(format!(
            "--vocab-size {vocab_size} is below 257 (256 byte tokens + {END_OF_TEXT})"
        )));
    }
    if !(0.0..1.0).contains(&args.val_fraction) {
        return Err(PrepareError::Invalid(format!(
            "--val-fraction {} must be in [0, 1)",
            args.val_fraction
        )));
    }
    crate::validate::at_most("--vocab-size", vocab_size, crate::validate::MAX_COUNT)
        .map_err(PrepareError::Invalid)?;
    let text = crate::fsio::read_to_string(&args.text)?;
    // An existing tokenizer is loaded before anything is written, so a bad file leaves no output.
    let given = match &args.tokenizer {
        Some(path) => Some(load_tokenizer(path)?),
        None => None,
    };
    std::fs::create_dir_all(&args.out).at("creating directory", &args.out)?;
    let tok_path = args.out.join("tokenizer.json");
    let chars_path = args.out.join(CHARS_FILE);
    // One vocabulary per directory: the other kind, from an earlier prepare, is removed.
    let stale = match args.chars {
        true => &tok_path,
        false => &chars_path,
    };
    if stale.exists() {
        std::fs::remove_file(stale).at("removing", stale)?;
    }
    if args.chars {
        let vocab = CharVocab::of_text(&text);
        vocab.save(&args.out)?;
        let ids = vocab.encode(&text)?;
        return write_split(args, &ids, vocab.len(), text.len());
    }
    let tokenizer = match given {
        Some(tokenizer) => tokenizer,
        None => train_tokenizer(&args.text, vocab_size)?,
    };
    tokenizer
        .save(&tok_path, false)
        .map_err(|e| PrepareError::Tokenizer(format!("writing {}: {e}", tok_path.display())))?;
    // Reload through the generic `Tokenizer`, exactly as `mtrain sample` will.
    let tokenizer = Tokenizer::from_file(&tok_path).map_err(tok_err)?;
    let ids = encode(&tokenizer, &text)?;
    write_split(args, &ids, tokenizer.get_vocab_size(true), text.len())
}

/// Write the first `1 − val_fraction` of `ids` as train_000 and the rest as val_000.
fn write_split(
    args: &PrepareArgs,
    ids: &[u32],
    vocab_size: usize,
    text_bytes: usize,
) -> Result<PrepareSummary, PrepareError> {
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
        bytes_per_token: text_bytes as f64 / ids.len().max(1) as f64,
    })
}

/// An existing Hugging Face `tokenizer.json`.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer, PrepareError> {
    crate::fsio::regular_file(path)?;
    Tokenizer::from_file(path)
        .map_err(|e| PrepareError::Tokenizer(format!("loading {}: {e}", path.display())))
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

/// Encode `text` in chunks of about 1 MiB, each cut right after a lone newline (one between two
/// characters that are not whitespace). GPT-2's pre-tokenizer pattern (the byte-level one, ours
/// and Hugging Face's) splits a lone newline off on its own and never joins it to the word
/// after it, so cutting there gives the same ids as one call; a run of whitespace such as
/// `"\n\n"` is split by what follows it, so it is never cut.
pub fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, PrepareError> {
    let mut ids = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let mut cut = rest.len().min(1 << 20);
        if cut < rest.len() {
            while !rest.is_char_boundary(cut) {
                cut += 1;
            }
            let bytes = rest.as_bytes();
            let safe = (1..cut).rev().find(|&i| {
                i >= 2
                    && bytes[i - 1] == b'\n'
                    && !bytes[i].is_ascii_whitespace()
                    && !bytes[i - 2].is_ascii_whitespace()
            });
            cut = safe.unwrap_or(cut);
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
