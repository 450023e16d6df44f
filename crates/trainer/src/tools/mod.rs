//! The `mtrain` subcommands other than training, apart from the loop: each reads the
//! configuration, a run's files or a checkpoint, and none runs inside a training step.
//!
//! - [`plan`]: `mtrain plan`, a layout's rank grid, process groups, per-rank memory and each
//!   step's communication, launching nothing; [`cost`]: the α-β model it prices that
//!   communication with (and `bench-comm --fit`'s fit of it).
//! - [`parity`]: `mtrain parity`, one rank against a layout on the same seed and global batch,
//!   the two loss series compared.
//! - [`bench_comm`]: `mtrain bench-comm`, collective bandwidth nccl-tests style, every result
//!   checked.
//! - [`explain`]: `mtrain explain ring --ranks 4`, an all-reduce algorithm walked step by
//!   step from the schedule the CPU backend runs.
//! - [`prepare`]: `mtrain prepare`, a text to token shards and its tokenizer.
//! - [`sample`]: `mtrain sample`, text generated from a checkpoint.
//! - [`hf`]: `mtrain export --hf` (a checkpoint as a Hugging Face GPT-2 directory) and the
//!   loader of `--init-from` (GPT-2 weights in that layout).
//! - [`plot`]: `mtrain plot`, a run directory's loss, memory and pipeline charts (SVG).
//! - [`gpu_fit`]: before the launcher starts ranks that share GPUs, whether they fit the GPUs'
//!   free memory.

pub mod bench_comm;
pub mod cost;
pub mod explain;
pub mod gpu_fit;
pub mod hf;
pub mod parity;
pub mod plan;
pub mod plot;
pub mod prepare;
pub mod sample;
