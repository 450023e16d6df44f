//! mtrain-trainer: the training loop and the `mtrain` binary's commands.

pub mod bench_comm;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod cost;
pub mod data;
pub mod distributed;
pub mod fsio;
#[cfg(feature = "cuda")]
pub mod gpu_memory;
pub mod launch;
pub mod layout;
pub mod liveness;
pub mod memory;
pub mod parity;
pub mod phases;
pub mod plan;
pub mod plot;
pub mod prepare;
pub mod progress;
pub mod run_dir;
pub mod sample;
pub mod trace;
pub mod train;
pub mod trainable;
pub mod validate;
