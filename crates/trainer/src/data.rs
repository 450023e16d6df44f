//! Data: where tokens come from and which of them each data-parallel rank trains on.
//!
//! A split (train or validation) is one or more token streams: the built-in corpus held in memory
//! ([`corpus`]) or memory-mapped shards ([`shards`]). A batch is a set of rows of `seq_len + 1`
//! tokens (inputs and the targets shifted by one). The *global* batch of a micro-batch has
//! `batch_size * dp_size` rows, and rank `r` takes rows `r*batch_size .. (r+1)*batch_size`:
//!
//! ```text
//! global batch (B = 2, dp = 2):  [ row0 row1 | row2 row3 ]
//!                                   rank 0      rank 1
//! ```
//!
//! so `dp` ranks together see exactly the batch one rank sees with `batch_size * dp`, which is what
//! makes a data-parallel loss series comparable to the single-device one. Where each row starts is
//! the [`sampling`] rule: by default an offset drawn uniformly over the split from a counter-based
//! generator keyed by (seed, step, micro-batch, row of the global batch), as nanoGPT's get_batch
//! draws them; or the
//! windows of an epoch-permuted cut. The loader's position is a single counter of global batches
//! consumed; checkpoints save it and resume restores it, and the rows after it follow from it
//! alone.

pub mod chars;
pub mod corpus;
pub mod sampling;
pub mod shards;

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use candle_core::{Device, Tensor};

pub use corpus::SplitMix64;
pub use sampling::Sampling;
use sampling::{Purpose, RandomOffsets, RowStart};
pub use shards::{write_shard, MappedShard, ShardHeader, TokenDtype};

/// Bytes of built-in corpus in the training split.
pub const BUILTIN_TRAIN_BYTES: usize = 1 << 20;
/// Bytes of built-in corpus in the validation split.
pub const BUILTIN_VAL_BYTES: usize = 1 << 16;
/// Seed of the built-in corpus (fixed: it is part of the corpus's definition, not of a run).
const BUILTIN_SEED: u64 = 0x6d74_7261_696e;

/// Errors of data loading.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file could not be read or written (the error names the operation and the path).
    #[error(transparent)]
    Io(#[from] crate::fsio::IoError),
    /// A file's contents are not what the format says.
    #[error("{0}")]
    Format(String),
    /// The split is too small for the batch asked for.
    #[error("the {split} split has {windows} windows of seq_len+1 = {window} tokens for epoch sampling, fewer than one global batch of batch_size({batch_size}) * dp({dp_size}) = {need}")]
    TooSmall {
        /// "train" or "val".
        split: String,
        /// Windows available.
        windows: usize,
        /// Tokens per window.
        window: usize,
        /// Micro-batch per rank.
        batch_size: usize,
        /// Data-parallel ranks.
        dp_size: usize,
        /// Windows needed.
        need: usize,
    },
    /// No stream of the split holds one row.
    #[error("the {split} split has no stream of seq_len+1 = {window} tokens (its longest has {longest}): lower seq_len or give more data")]
    TooShort {
        /// "train" or "val".
        split: String,
        /// Tokens in its longest stream.
        longest: usize,
        /// Tokens per row.
        window: usize,
    },
    /// A bad loader argument.
    #[error("{0}")]
    Invalid(String),
    /// Building a tensor failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Where training data comes from: `"builtin"` or a directory of token shards.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DataSource {
    /// The generated corpus of [`corpus`] as byte tokens (vocabulary 256).
    Builtin,
    /// A directory written by `mtrain prepare` (train_*.bin, val_*.bin, headers, tokenizer.json).
    Shards(PathBuf),
}

impl FromStr for DataSource {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "" => Err("data source is empty: use \"builtin\" or a shard directory".into()),
            "builtin" => Ok(DataSource::Builtin),
            path => Ok(DataSource::Shards(PathBuf::from(path))),
        }
    }
}

impl TryFrom<String> for DataSource {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<DataSource> for String {
    fn from(d: DataSource) -> String {
        d.to_string()
    }
}

impl fmt::Display for DataSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataSource::Builtin => write!(f, "builtin"),
            DataSource::Shards(p) => write!(f, "{}", p.display()),
        }
    }
}

/// One stream of tokens.
enum Stream {
    Memory(Vec<u32>),
    Mapped(MappedShard),
}

impl Stream {
    fn len(&self) -> usize {
        match self {
            Stream::Memory(v) => v.len(),
            Stream::Mapped(m) => m.len(),
        }
    }

    fn read(&self, start: usize, end: usize, out: &mut Vec<u32>) {
        match self {
            Stream::Memory(v) => out.extend_from_slice(&v[start..end]),
            Stream::Mapped(m) => m.read(start, end, out),
        }
    }
}

/// One split (train or validation): its streams, shared by every loader that reads it.
#[derive(Clone)]
pub struct Split {
    name: String,
    streams: Arc<Vec<Stream>>,
}

impl Split {
    /// Total tokens in the split.
    pub fn n_tokens(&self) -> usize {
        self.streams.iter().map(Stream::len).sum()
    }

    /// The split's name ("train" or "val").
    pub fn name(&self) -> &str {
        &self.name
    }

    /// 1 for the validation split, 0 for the training split: the split's part of its draws'
    /// counters ([`sampling`]).
    fn id(&self) -> u32 {
        u32::from(self.name == "val")
    }
}

/// A data set: both splits and what is needed to read its ids back as text.
pub struct Dataset {
    /// The training split.
    pub train: Split,
    /// The validation split.
    pub val: Split,
    /// Vocabulary size of the ids.
    pub vocab_size: usize,
    /// The tokenizer that produced the ids (`None` for byte tokens).
    pub tokenizer: Option<PathBuf>,
}

/// The vocabulary a model takes from prepared data: the data's size rounded up to a multiple of
/// 64, as GPT-2's 50 257 ids become 50 304 (the padding rows are never a target; a width that is
/// a multiple of 64 keeps the embedding and LM-head matrices on fast GEMM tiles).
pub fn padded_vocab(data_vocab: usize) -> usize {
    data_vocab.div_ceil(64) * 64
}

/// The vocabulary size of a source's ids without mapping the data: 256 for the built-in corpus,
/// else the first training shard's header (`Dataset::open` checks that the others agree).
pub fn source_vocab_size(source: &DataSource) -> Result<usize, DataError> {
    match source {
        DataSource::Builtin => Ok(256),
        DataSource::Shards(dir) => {
            let first = shards::list_shards(dir, "train")?.into_iter().next();
            let bin = first.ok_or_else(|| {
                DataError::Format(format!(
                    "{}: no train_*.bin shards (write them with `mtrain prepare`)",
                    dir.display()
                ))
            })?;
            Ok(shards::read_header(&bin)?.vocab_size)
        }
    }
}

impl Dataset {
    /// Open a data source: generate the built-in corpus or map a shard directory.
    pub fn open(source: &DataSource) -> Result<Self, DataError> {
        match source {
            DataSource::Builtin => {
                let bytes = |n, seed| {
                    corpus::generate(n, seed)
                        .into_iter()
                        .map(u32::from)
                        .collect()
                };
                let split = |name: &str, tokens| Split {
                    name: name.into(),
                    streams: Arc::new(vec![Stream::Memory(tokens)]),
                };
                Ok(Dataset {
                    train: split("train", bytes(BUILTIN_TRAIN_BYTES, BUILTIN_SEED)),
                    val: split("val", bytes(BUILTIN_VAL_BYTES, BUILTIN_SEED + 1)),
                    vocab_size: 256,
                    tokenizer: None,
                })
            }
            DataSource::Shards(dir) => {
                let mut vocab = None;
                let mut open_split = |name: &str| -> Result<Split, DataError> {
                    let paths = shards::list_shards(dir, name)?;
                    if paths.is_empty() {
                        return Err(DataError::Format(format!(
                            "{}: no {name}_*.bin shards (write them with `mtrain prepare`)",
                            dir.display()
                        )));
                    }
                    let mut streams = Vec::new();
                    for p in paths {
                        let shard = MappedShard::open(&p)?;
                        let v = shard.header.vocab_size;
                        if *vocab.get_or_insert(v) != v {
                            return Err(DataError::Format(format!(
                                "{}: vocab_size {v} differs from the other shards' {}",
                                p.display(),
                                vocab.unwrap_or(v)
                            )));
                        }
                        streams.push(Stream::Mapped(shard));
                    }
                    Ok(Split {
                        name: name.into(),
                        streams: Arc::new(streams),
                    })
                };
                let train = open_split("train")?;
                let val = open_split("val")?;
                let tok = dir.join("tokenizer.json");
                Ok(Dataset {
                    train,
                    val,
                    vocab_size: vocab.unwrap_or(0),
                    tokenizer: tok.exists().then_some(tok),
                })
            }
        }
    }
}

/// One rank's micro-batch: `batch_size` rows of `seq_len` input ids and the ids that follow them.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Input ids, row-major `(batch_size, seq_len)`.
    pub inputs: Vec<u32>,
    /// Target ids (inputs shifted by one), row-major `(batch_size, seq_len)`.
    pub targets: Vec<u32>,
    /// Rows.
    pub batch_size: usize,
    /// Columns.
    pub seq_len: usize,
    /// The epoch the batch was drawn in.
    pub epoch: u64,
}

impl Batch {
    /// The batch as `u32` tensors `(B, T)` on `device`: (inputs, targets).
    pub fn to_tensors(&self, device: &Device) -> Result<(Tensor, Tensor), DataError> {
        let shape = (self.batch_size, self.seq_len);
        let x = Tensor::from_slice(&self.inputs, shape, device)?; // (B, T)
        let y = Tensor::from_slice(&self.targets, shape, device)?; // (B, T)
        Ok((x, y))
    }
}

/// Deterministic per-rank batches over one split (see the module docs for the layout).
pub struct DataLoader {
    split: Split,
    seq_len: usize,
    batch_size: usize,
    dp_rank: usize,
    dp_size: usize,
    seed: u64,
    /// Micro-batches per optimizer step: global batch `p` is micro-batch `p % grad_accum` of
    /// step `p / grad_accum`.
    grad_accum: usize,
    sampling: Sampling,
    /// The uniform starts of every row drawn at random (training under `Random`, evaluation
    /// always).
    offsets: RandomOffsets,
    /// Cumulative windows per stream: `starts[i]` is the first global window index of stream `i`.
    starts: Vec<usize>,
    n_windows: usize,
    /// Global batches consumed so far (the checkpointed position).
    position: u64,
    /// The window order of `order_epoch`.
    order: Vec<u32>,
    order_epoch: Option<u64>,
}

impl DataLoader {
    /// A loader giving rank `dp_rank` of `dp_size` its `batch_size` rows of every global batch,
    /// drawn at random offsets ([`Sampling::Random`]), one micro-batch per step (see
    /// [`DataLoader::with_grad_accum`], [`DataLoader::with_sampling`]).
    pub fn new(
        split: Split,
        seq_len: usize,
        batch_size: usize,
        dp_rank: usize,
        dp_size: usize,
        seed: u64,
    ) -> Result<Self, DataError> {
        if seq_len == 0 || batch_size == 0 || dp_size == 0 || dp_rank >= dp_size {
            return Err(DataError::Invalid(format!(
                "bad loader arguments: seq_len={seq_len}, batch_size={batch_size}, dp_rank={dp_rank}, dp_size={dp_size}"
            )));
        }
        let lens: Vec<usize> = split.streams.iter().map(Stream::len).collect();
        let offsets = RandomOffsets::new(&lens, seq_len, seed, split.id()).ok_or_else(|| {
            DataError::TooShort {
                split: split.name.clone(),
                longest: lens.iter().copied().max().unwrap_or(0),
                window: seq_len + 1,
            }
        })?;
        let mut starts = Vec::with_capacity(lens.len());
        let mut n_windows = 0;
        for n in &lens {
            starts.push(n_windows);
            n_windows += n.saturating_sub(1) / seq_len;
        }
        Ok(Self {
            split,
            seq_len,
            batch_size,
            dp_rank,
            dp_size,
            seed,
            grad_accum: 1,
            sampling: Sampling::Random,
            offsets,
            starts,
            n_windows,
            position: 0,
            order: Vec::new(),
            order_epoch: None,
        })
    }

    /// The same loader drawing its training batches as `sampling` says; epochs need at least one
    /// global batch of windows.
    pub fn with_sampling(mut self, sampling: Sampling) -> Result<Self, DataError> {
        let need = self.batch_size * self.dp_size;
        if sampling == Sampling::Epochs && self.n_windows < need {
            return Err(DataError::TooSmall {
                split: self.split.name.clone(),
                windows: self.n_windows,
                window: self.seq_len + 1,
                batch_size: self.batch_size,
                dp_size: self.dp_size,
                need,
            });
        }
        if self.n_windows > u32::MAX as usize && sampling == Sampling::Epochs {
            return Err(DataError::Invalid(format!(
                "{} windows exceed the u32 index of epoch sampling",
                self.n_windows
            )));
        }
        self.sampling = sampling;
        Ok(self)
    }

    /// The same loader for steps of `grad_accum` micro-batches (the coordinates of its draws).
    pub fn with_grad_accum(mut self, grad_accum: usize) -> Result<Self, DataError> {
        if grad_accum == 0 || grad_accum > u32::MAX as usize {
            return Err(DataError::Invalid(format!(
                "grad_accum {grad_accum} must be in 1..=2^32-1"
            )));
        }
        self.grad_accum = grad_accum;
        Ok(self)
    }

    /// How this loader draws its training batches.
    pub fn sampling(&self) -> Sampling {
        self.sampling
    }

    /// Global batches per epoch: windows per global batch under `Epochs`; under `Random`, the
    /// global batches whose tokens add up to the split's (at least 1).
    pub fn batches_per_epoch(&self) -> u64 {
        let global = self.batch_size * self.dp_size;
        match self.sampling {
            Sampling::Epochs => (self.n_windows / global) as u64,
            Sampling::Random => (self.split.n_tokens() / (global * self.seq_len)).max(1) as u64,
        }
    }

    /// Global batches consumed so far.
    pub fn position(&self) -> u64 {
        self.position
    }

    /// Continue from `position` global batches (restoring a checkpoint).
    pub fn set_position(&mut self, position: u64) {
        self.position = position;
    }

    /// The epoch the next batch comes from (0-based): under `Random`, how many times the split's
    /// tokens have been drawn.
    pub fn epoch(&self) -> u64 {
        self.position / self.batches_per_epoch()
    }

    /// This rank's rows of the next global batch.
    pub fn next_batch(&mut self) -> Batch {
        let epoch = self.epoch();
        let batch = match self.sampling {
            Sampling::Random => {
                let ga = self.grad_accum as u64;
                let (step, micro) = (self.position / ga, (self.position % ga) as u32);
                self.random_batch(Purpose::Train, step, micro, epoch)
            }
            Sampling::Epochs => self.epoch_batch(epoch),
        };
        self.position += 1;
        batch
    }

    /// This rank's rows of evaluation batch `iter` at step `step`: random offsets from their own
    /// stream, whatever the training sampling; the loader's position does not move.
    pub fn eval_batch(&self, step: u64, iter: u32) -> Batch {
        self.random_batch(Purpose::Eval, step, iter, self.epoch())
    }

    fn random_batch(&self, purpose: Purpose, step: u64, micro: u32, epoch: u64) -> Batch {
        let global = (self.batch_size * self.dp_size) as u64;
        let first = u64::from(micro) * global + (self.dp_rank * self.batch_size) as u64;
        let starts = (first..first + self.batch_size as u64)
            .map(|row| self.offsets.row_start(purpose, step, row));
        self.read_rows(starts, epoch)
    }

    fn epoch_batch(&mut self, epoch: u64) -> Batch {
        let per_epoch = self.batches_per_epoch();
        let in_epoch = (self.position % per_epoch) as usize;
        if self.order_epoch != Some(epoch) {
            self.order = self.permutation(epoch);
            self.order_epoch = Some(epoch);
        }
        let global = self.batch_size * self.dp_size;
        let first = in_epoch * global + self.dp_rank * self.batch_size;
        let starts: Vec<RowStart> = self.order[first..first + self.batch_size]
            .iter()
            .map(|&w| {
                let w = w as usize;
                let stream = self.starts.partition_point(|&s| s <= w) - 1;
                (stream, (w - self.starts[stream]) * self.seq_len)
            })
            .collect();
        self.read_rows(starts.into_iter(), epoch)
    }

    /// The rows of `seq_len + 1` tokens at `starts`, as inputs and targets.
    fn read_rows(&self, starts: impl Iterator<Item = RowStart>, epoch: u64) -> Batch {
        let (t, b) = (self.seq_len, self.batch_size);
        let mut inputs = Vec::with_capacity(b * t);
        let mut targets = Vec::with_capacity(b * t);
        let mut row = Vec::with_capacity(t + 1);
        for (stream, start) in starts {
            row.clear();
            self.split.streams[stream].read(start, start + t + 1, &mut row);
            inputs.extend_from_slice(&row[..t]);
            targets.extend_from_slice(&row[1..]);
        }
        Batch {
            inputs,
            targets,
            batch_size: b,
            seq_len: t,
            epoch,
        }
    }

    /// Fisher–Yates shuffle of all windows, seeded by (seed, epoch).
    fn permutation(&self, epoch: u64) -> Vec<u32> {
        let mut rng = SplitMix64::new(self.seed ^ epoch.wrapping_mul(0xA24B_AED4_963E_E407));
        let mut order: Vec<u32> = (0..self.n_windows as u32).collect();
        for i in (1..order.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            order.swap(i, j);
        }
        order
    }
}
