//! mtrain-comm: collectives on candle tensors, with one semantics on every backend.
//!
//! # Layout
//! - [`communicator`]: the `Communicator` trait every strategy talks through, `Work` handles,
//!   `Backend` (creates groups).
//! - [`cpu`]: the CPU backend over TCP (ring all-reduce = ring reduce-scatter + ring all-gather;
//!   tree and halving-doubling beside it, [`algo`] choosing among them by size).
//! - `nccl` (feature `cuda`): the NCCL backend, one communicator and communication stream per
//!   group, split by concern like `cpu`.
//! - [`ipc`]: the ranks of one node as processes reading each other's GPU memory through
//!   CUDA IPC (the collectives are kernels and copies over peer memory; `cuda` feature; the
//!   protocol's pure parts always).
//! - [`staged`]: a group on a GPU whose collectives run through the CPU backend (ranks that
//!   share one GPU).
//! - [`store`]: the TCP rendezvous store hosted by rank 0.
//! - [`env`]: the torchrun-style launch environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).
//! - [`mesh`]: the dp x pp x tp (+ ep) rank grid and its groups.
//! - [`trace`]: per-group record of every collective, each with its [`site`] (the file and line
//!   that issued it); [`op_kind`]: the kinds of collective
//!   both the communicator and the trace name.

pub mod algo;
pub mod communicator;
pub mod op_kind;
pub mod cpu;
pub mod env;
pub mod ipc;
pub mod mesh;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod site;
pub mod staged;
pub mod store;
pub mod trace;

pub use algo::{AlgoChoice, AllReduceAlgo, AutoRule, Band};
pub use communicator::{
    chunk_range, Backend, Comm, CommError, Communicator, OpKind, PendingWork, ReduceOp, Result,
    Work,
};
pub use cpu::{run_local, CpuBackend, CpuOptions};
pub use env::LaunchEnv;
pub use mesh::{Coords, DeviceMesh, GroupKind, MeshDims};
pub use site::Site;
pub use staged::{staged, StagedBackend};
pub use trace::{TraceEvent, TraceTotals, Tracer};
