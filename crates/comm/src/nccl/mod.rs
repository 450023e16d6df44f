//! NCCL backend: the [`Communicator`] contract on CUDA tensors, one NCCL communicator per group.
//!
//! This module is the only place in mtrain that calls NCCL. CUDA is reached only through candle
//! (`candle_core::cuda_backend::cudarc`), so there is exactly one cudarc in the build, and tensor
//! memory is read and written through candle's `CudaStorage`. Its `unsafe` is the NCCL calls
//! (each with a `SAFETY` note on the pointers it passes) and the `Send`/`Sync` of the raw handle
//! ("Send and Sync" below). Elsewhere in the workspace `unsafe` is confined to the fused
//! kernels' launches (`crates/kernels`), the CUDA IPC driver calls and kernel launches
//! (`ipc/driver.rs`, `ipc/kernels.rs`), the CUDA memory-pool attributes (`crates/kernels`,
//! `trainer/src/gpu_memory.rs`), the counting allocator (`trainer/src/memory.rs`) and the
//! memory map of token shards (`trainer/src/data/shards.rs`).
//!
//! # Layout
//! - `backend`: `NcclBackend`, its options and the NCCL unique-id exchange; groups created.
//! - `group`: one group's communicator and state, its creation, and the `Communicator` impl.
//! - `stream`: issuing an op on the communication stream, ordered against compute by events;
//!   the `Work` handle that orders compute after it.
//! - `args`: argument checks, the cross-rank header of `check_args`, NCCL's type and op codes.
//! - `collectives`: each collective, including those NCCL lacks (uneven splits, scatter, ...).
//! - `watchdog`: the thread that aborts a group whose op outlives the timeout.
//!
//! # Streams and events: how an async collective overlaps compute
//!
//! candle issues every kernel on its compute stream. Each group owns a second, *communication*
//! stream, and every op is ordered against the compute stream with two CUDA events:
//!
//! ```text
//!   compute  ──[backward blk 3]──●ready──[backward blk 2]──[backward blk 1]──⧗──[use result]──▶
//!                                 ╲                                         ╱
//!   comm     ──────────────────────⧗──[ncclAllReduce bucket 3]──●done──────╱
//!
//!   ● record an event       ⧗ the stream waits for that event (on the GPU, the host never blocks)
//! ```
//!
//! 1. issue: the result buffer is allocated on the compute stream, `ready` is recorded there and
//!    the communication stream waits for it, so the collective sees every value the compute
//!    stream produced before the call. The NCCL kernel is enqueued and `done` is recorded.
//! 2. `Work::wait()`: the *compute* stream waits for `done`. The host does not block, so the CPU
//!    keeps issuing kernels; everything issued before `wait()` overlaps the transfer. The sync
//!    forms (`all_reduce`, ...) are async + wait, so they do not block the host either.
//!
//! The [`Work`] keeps the input and output tensors alive until the compute stream is ordered
//! after `done` (in `wait()`, or in its `Drop` when a caller discards it), so the stream-ordered
//! allocator never reuses memory a collective still reads or writes. `wait()` must be called on
//! the thread that computes (candle's default CUDA stream is per thread).
//!
//! # One communicator per group
//!
//! The lowest global rank of a group creates an NCCL unique id and publishes it through the
//! rendezvous store under a key naming the group, its ranks and a creation counter; the other
//! members read it and every member calls `ncclCommInitRank`. A group of one needs no store.
//!
//! # Ops NCCL lacks
//!
//! NCCL's all-gather and reduce-scatter need equal chunks. Uneven splits (rows per
//! [`chunk_range`]) are done as:
//! - all_gather: every rank's row count is exchanged first (a tiny all-gather on the
//!   communication stream that the host waits for: a rendezvous, not a wait for compute), then
//!   one grouped broadcast per rank writes each rank's rows straight to their offset;
//! - reduce_scatter: the input is padded so each chunk occupies `ceil(D/n)` rows, reduced, and
//!   the padding dropped from the result;
//! - all_to_all, scatter, gather: grouped `ncclSend`/`ncclRecv` (gather and scatter exchange the
//!   row counts / the shape first, like all_gather).
//!
//! # Failures
//!
//! NCCL kernels of a mismatched or abandoned collective wait forever on the GPU. A watchdog
//! thread per group polls the `done` event of every op in flight; an op older than the group's
//! timeout aborts the communicator (`ncclCommAbort` makes the kernels return), and from then on
//! every op of that group fails with [`CommError::Timeout`] naming op, group, sequence number and
//! rank. With [`NcclOptions::check_args`] every op first exchanges a header (op, dtype, element
//! count, root) with the whole group and fails with [`CommError::Mismatch`] on every rank when
//! they differ, at the cost of one host rendezvous per op.
//!
//! # Send and Sync
//!
//! The only `!Send` state is the raw `ncclComm_t` handle. NCCL allows a communicator to be used
//! from any thread provided calls on it never run concurrently; every call on it here happens
//! under the group's `issue` mutex, except `ncclCommAbort`, which NCCL documents as callable from
//! another thread to unblock a hung communicator. CUDA streams and events are `Send + Sync` in
//! cudarc already.

mod args;
mod backend;
mod collectives;
mod factory;
mod group;
mod shared;
mod stream;
mod watchdog;

#[cfg(test)]
mod tests;

pub use backend::{InProcessExchange, NcclBackend};
pub(crate) use collectives::uninit;
pub(crate) use stream::with_device_addrs;
pub use factory::{IdExchange, NcclOptions};
pub use group::NcclGroup;
