//! mtrain-trainer: the training loop and the `mtrain` binary's commands.
//!
//! # Layout
//! The run, in the order it happens:
//! - [`cli`]: the command line, every flag and each subcommand's options (a command's own
//!   options struct may live in the command's module; only `parity`, which parses `--vs` as a
//!   command line, imports `cli` back). [`config`]: the typed TOML (`[model]`, `[train]`,
//!   `[parallel]`) merged with the flags and `--set`.
//! - [`launch`]: the torchrun-style launcher (one worker per rank, the rendezvous store;
//!   before ranks share GPUs, `tools::gpu_fit` checks they fit the GPUs' free memory);
//!   [`liveness`]: a worker's watch on its job.
//! - [`layout`]: the resolved [`layout::Layout`]; [`resolve`]: the command line, config file and
//!   `--set` resolved once into the run's description (`RunOptions`), the one place a run's
//!   `ParallelPlan` is built and checked.
//! - [`data`]: the built-in corpus, token shards, each data-parallel rank's slice.
//! - [`train`]: the loop; [`distributed`]: the model it drives, over any layout;
//!   [`micro_step`]: which micro-step of an optimizer step the loop passes it.
//! - [`checkpoint`], [`run_dir`]: what a run keeps, and the directory that belongs to one run.
//!
//! What a run measures and shows: [`progress`] (the step line), [`memory`] (the per-step
//! report: analytic next to measured; `gpu_memory`, its CUDA probe), [`phases`]
//! (`--profile-phases`), [`roofline`] (`--profile-ops`: every op's FLOPs, bytes and time on the
//! roofline), [`trace`] (`--trace`'s files and a step's communication figures).
//!
//! [`tools`]: the other subcommands, apart from the loop: `plan` (with `cost`'s α-β model),
//! `parity`, `bench-comm`, `prepare`, `sample`, `export` and `--init-from` (`hf`: Hugging
//! Face's GPT-2 layout), `plot`, and the launcher's GPU fit (`gpu_fit`).
//!
//! Shared rules: [`validate`] (every number a user gives), [`fsio`] (file errors that name the
//! operation and the path).

pub mod checkpoint;
pub mod cli;
pub mod compute_pool;
pub mod config;
pub mod data;
pub mod distributed;
pub mod fsio;
#[cfg(feature = "cuda")]
pub mod gpu_memory;
pub mod launch;
pub mod layout;
pub mod liveness;
pub mod memory;
pub mod micro_step;
pub mod phases;
pub mod progress;
pub mod resolve;
pub mod roofline;
pub mod run_dir;
pub mod tools;
pub mod trace;
pub mod train;
pub mod validate;
