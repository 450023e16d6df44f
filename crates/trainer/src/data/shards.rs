//! Token shards: flat little-endian token files with a small JSON header beside each, memory-mapped.
//!
//! ```text
//! DIR/train_000.bin    u16 or u32 tokens, little-endian, no framing
//! DIR/train_000.json   {"dtype": "u16", "n_tokens": 1048576, "vocab_size": 4096}
//! DIR/val_000.bin      the validation split, same format
//! DIR/tokenizer.json   (optional) the tokenizer that produced the ids, for `mtrain sample`
//! ```
//!
//! Shards are mapped, not read: the operating system pages in the windows a batch touches, so a data
//! set larger than memory costs nothing up front.

use std::fs;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde::{Deserialize, Serialize};

use super::DataError;
use crate::fsio::IoContext;

/// Width of one token on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    /// Two bytes per token (vocabularies up to 65 536).
    U16,
    /// Four bytes per token.
    U32,
}

impl TokenDtype {
    /// Bytes per token.
    pub fn size(self) -> usize {
        match self {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        }
    }
}

/// The JSON header that sits beside each `.bin` shard.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardHeader {
    /// Width of one token.
    pub dtype: TokenDtype,
    /// Number of tokens in the shard.
    pub n_tokens: u64,
    /// Size of the vocabulary the ids index.
    pub vocab_size: usize,
}

/// One memory-mapped shard.
pub struct MappedShard {
    /// Path of the `.bin` file (for messages).
    pub path: PathBuf,
    /// The header read from the sibling `.json`.
    pub header: ShardHeader,
    map: Mmap,
}

impl MappedShard {
    /// Map `bin` and check it against its header `bin.with_extension("json")`.
    pub fn open(bin: &Path) -> Result<Self, DataError> {
        let json = bin.with_extension("json");
        let text = fs::read_to_string(&json).at("reading", &json)?;
        let header: ShardHeader = serde_json::from_str(&text)
            .map_err(|e| DataError::Format(format!("{}: bad shard header: {e}", json.display())))?;
        let file = fs::File::open(bin).at("opening", bin)?;
        // SAFETY: the map is read-only and the shard files are written once by `write_shard` and never
        // modified while training reads them; a concurrent truncation by another process would be a
        // misuse of the data directory.
        let map = unsafe { Mmap::map(&file) }.at("mapping", bin)?;
        let expected = header.n_tokens as usize * header.dtype.size();
        if map.len() != expected {
            return Err(DataError::Format(format!(
                "{}: header says {} tokens of {:?} ({expected} bytes) but the file has {} bytes",
                bin.display(),
                header.n_tokens,
                header.dtype,
                map.len()
            )));
        }
        Ok(Self {
            path: bin.to_path_buf(),
            header,
            map,
        })
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.header.n_tokens as usize
    }

    /// Whether the shard holds no tokens.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens `start..end` widened to `u32`.
    pub fn read(&self, start: usize, end: usize, out: &mut Vec<u32>) {
        let w = self.header.dtype.size();
        let bytes = &self.map[start * w..end * w];
        match self.header.dtype {
            TokenDtype::U16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32),
            ),
            TokenDtype::U32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
        }
    }
}

/// Write `tokens` as `DIR/NAME.bin` + `DIR/NAME.json`, as u16 when the vocabulary fits.
pub fn write_shard(
    dir: &Path,
    name: &str,
    tokens: &[u32],
    vocab_size: usize,
) -> Result<PathBuf, DataError> {
    fs::create_dir_all(dir).at("creating directory", dir)?;
    let dtype = if vocab_size <= 1 << 16 {
        TokenDtype::U16
    } else {
        TokenDtype::U32
    };
    let mut bytes = Vec::with_capacity(tokens.len() * dtype.size());
    for &t in tokens {
        if t as usize >= vocab_size {
            return Err(DataError::Format(format!(
                "token id {t} is outside the vocabulary of {vocab_size}"
            )));
        }
        match dtype {
            TokenDtype::U16 => bytes.extend_from_slice(&(t as u16).to_le_bytes()),
            TokenDtype::U32 => bytes.extend_from_slice(&t.to_le_bytes()),
        }
    }
    let bin = dir.join(format!("{name}.bin"));
    fs::write(&bin, &bytes).at("writing", &bin)?;
    let header = ShardHeader {
        dtype,
        n_tokens: tokens.len() as u64,
        vocab_size,
    };
    let json = dir.join(format!("{name}.json"));
    let text =
        serde_json::to_string_pretty(&header).map_err(|e| DataError::Format(e.to_string()))?;
    fs::write(&json, text).at("writing", &json)?;
    Ok(bin)
}

/// The `.bin` shards in `dir` whose names start with `prefix` (`"train"` or `"val"`), sorted.
pub fn list_shards(dir: &Path, prefix: &str) -> Result<Vec<PathBuf>, DataError> {
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).at("listing", dir)? {
        let path = entry.at("listing", dir)?.path();
        let is_bin = path.extension().is_some_and(|e| e == "bin");
        let matches = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(prefix));
        if is_bin && matches {
            found.push(path);
        }
    }
    found.sort();
    Ok(found)
}
