//! IPC backend: the ranks of one node are processes, and each reads its peers' GPU memory
//! directly, mapped into its address space through CUDA IPC (`cuIpcGetMemHandle` /
//! `cuIpcOpenMemHandle`). Ranks may share one GPU (NCCL refuses that) or sit on several GPUs
//! of one node with peer access.
//!
//! # Buffers
//!
//! Every rank of a group allocates two buffers that its peers map:
//! - a *flag buffer* (`protocol`'s table: one u64 per phase and peer), written by the peers;
//! - a *data buffer* where it puts its input before the peers read it, grown (every rank at
//!   the same op) when a message does not fit; and, per peer it sends to, a *mailbox*.
//!
//! The handles of the flag and data buffers are all-gathered over the group's twin on the CPU
//! backend (`host`) when the group is created or a buffer grows; mailbox handles go through the
//! rendezvous store, from the one sender to the one receiver. Row counts of the ops whose output
//! shape depends on the peers (all_gather, gather, all_to_all, scatter) are exchanged over
//! `host` too, one small host rendezvous per such op, as the NCCL backend does for uneven splits.
//!
//! # One collective (the group's s-th), here a one-shot all-reduce on rank 0 of 3
//!
//! ```text
//!   compute ─●ready────────────────────────────────────────────────────────⧗─[use out]─▶
//!             ╲                                                           ╱
//!   comm ──────⧗─[x → data0]─[READY:=s on 1,2]─⧗READY≥s─[out = Σ data0..2]─[DONE:=s]─⧗DONE≥s─●done
//!                     │              │           ▲  ▲        ▲  ▲  ▲
//!                     ▼              ▼           │  │        │  │  └ data2 (rank 2's, mapped)
//!   rank 0's data buffer    flags of ranks 1, 2  flags of rank 0,    data1 (rank 1's, mapped)
//!                                                written by 1 and 2
//!   ● record an event    ⧗ the stream waits (event, or flag ≥ s on the GPU: no host round trip)
//! ```
//!
//! 1. The communication stream waits for the compute stream (inputs are written), copies the
//!    input into the rank's data buffer and writes `s` into its READY column of every peer's
//!    flag buffer; then it waits until every peer's READY column of its own flags reaches `s`.
//! 2. The op's kernel or copies read the peers' data buffers (mapped addresses) and write the
//!    result: one-shot all-reduce and reduce_scatter reduce n inputs; two-shot reduces chunk r of
//!    every input into the rank's chunk area, signals MID, then copies chunk q from rank q;
//!    all_gather, broadcast, all_to_all, scatter, gather copy rows from the peers' buffers.
//! 3. DONE: nobody reads a data buffer any more, so the next op may overwrite it.
//!
//! Flags only grow (collective s waits for `≥ s`), so they are never reset and a stale value
//! never lets an op pass early. `s` counts the group's collectives alone, which every rank
//! issues alike; its sends and receives, which differ between ranks (a pipeline's middle
//! stages have twice the ends' messages), are numbered per pair. send/recv use the pair's
//! mailbox instead of the data buffer: the sender waits `ACK ≥ k−1` (the receiver copied the
//! previous message out), copies message k in and sets the receiver's `SIG := k`; the receiver
//! waits `SIG ≥ k`, copies it out and sets the sender's `ACK := k`. A send does not wait for
//! its own receive, so two ranks that send to each other before receiving do not deadlock.
//!
//! Waits are `cuStreamWaitValue64` on the communication stream (the GPU's front end waits, no
//! SM spins) or, with `MTRAIN_IPC_WAIT=kernel`, a one-block kernel that spins on the flags; the
//! writes are `cuStreamWriteValue64` (after a memory barrier) or a kernel that fences, then
//! stores. Ops are ordered on the group's communication stream like NCCL's, and [`Work`] orders
//! the compute stream after the op without blocking the host (see `nccl`'s module doc).
//!
//! # Failures
//!
//! A watchdog thread per group watches the oldest op in flight. Once it is older than the
//! timeout, it reads the rank's flags, names the first peer whose flag is still short of its
//! target, poisons the group (every later op fails with [`CommError::Timeout`] naming op, seq and
//! peer; the error is also logged at once) and releases the stream's waits.
//!
//! [`Work`]: crate::communicator::Work
//! [`CommError::Timeout`]: crate::communicator::CommError::Timeout

pub mod protocol;

#[cfg(feature = "cuda")]
mod backend;
#[cfg(feature = "cuda")]
mod collectives;
#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda")]
mod group;
#[cfg(feature = "cuda")]
mod kernels;
#[cfg(feature = "cuda")]
mod phases;
#[cfg(all(test, feature = "cuda"))]
mod tests;
#[cfg(feature = "cuda")]
mod work;

#[cfg(feature = "cuda")]
pub use backend::IpcBackend;
#[cfg(feature = "cuda")]
pub use group::{IpcGroup, IpcOptions};
