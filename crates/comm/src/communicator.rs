//! The `Communicator` trait: collectives on candle tensors over one process group.
//!
//! Every parallel strategy in mtrain talks through this trait and nothing else, so the same
//! code runs on the CPU backend (TCP, `cpu/`) and on GPUs (NCCL, `nccl/`; CUDA IPC, `ipc/`; or
//! the CPU backend staged through the host, `staged.rs`).
//!
//! Semantics shared by every backend (the tests in `tests/collectives.rs` check each one
//! against its closed form):
//!
//! | op              | input on rank r          | result on rank r                                   |
//! |-----------------|--------------------------|----------------------------------------------------|
//! | all_reduce      | x_r, shape S             | op(x_0, ..., x_{n-1}), shape S                     |
//! | reduce          | x_r, shape S             | root: op(x_0..x_{n-1}); others: x_r unchanged      |
//! | broadcast       | x_r, shape S             | x_root                                             |
//! | all_gather      | x_r, shape (d_r, ...)    | cat([x_0, ..., x_{n-1}], dim 0): (Σ d_r, ...)      |
//! | reduce_scatter  | x_r, shape (D, ...)      | rows `chunk_range(D, n, r)` of op(x_0..x_{n-1})    |
//! | scatter         | root: (D, ...)           | rows `chunk_range(D, n, r)` of x_root              |
//! | gather          | x_r, shape (d_r, ...)    | root: cat([x_0..x_{n-1}], dim 0); others: x_r      |
//! | all_to_all      | x_r, rows split by `send`| cat over peers p of the rows p sent to r           |
//! | send / recv     | tensor to peer           | tensor of the given shape and dtype from peer      |
//! | barrier         | -                        | returns once every rank entered                    |
//!
//! Uneven splits follow `chunk_range`: the first `D % n` ranks get one extra row, like
//! `numpy.array_split`. All ranks of a group must issue the same collectives in the same order;
//! a backend detects a mismatch (op, dtype, element count) and fails on every rank with a
//! [`CommError::Mismatch`] that names both sides, and a peer that dies or stalls makes the op
//! fail within the group's timeout with [`CommError::Timeout`] / [`CommError::PeerClosed`].
//!
//! Async forms return a [`Work`] that must be waited before the result is used; a backend runs
//! async ops in issue order on a side channel (CPU: a communication thread per group, NCCL: a
//! communication stream), so compute issued after them overlaps the transfer.

use std::fmt;
use std::sync::Arc;

use candle_core::{DType, Device, Shape, Tensor};

use crate::algo::AlgoChoice;
pub use crate::op_kind::OpKind;
use crate::site::Site;
use crate::trace::Tracer;

/// A shared handle to one process group.
pub type Comm = Arc<dyn Communicator>;

/// How `all_reduce`, `reduce` and `reduce_scatter` combine the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the group size.
    Avg,
    Max,
    Min,
}

/// Errors of the communication layer. Every variant that concerns a collective names the op,
/// the group, the op's sequence number in that group and the ranks involved.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("{op} on group '{group}' (seq {seq}) timed out after {timeout_ms} ms on rank {rank} waiting for rank {peer}, issued at {site}")]
    Timeout {
        op: OpKind,
        group: String,
        seq: u64,
        rank: usize,
        peer: usize,
        timeout_ms: u64,
        /// Where the op that timed out was issued.
        site: Site,
    },

    #[error("{op} on group '{group}' (seq {seq}), issued at {site}: rank {rank} lost its connection to rank {peer}: {detail}")]
    PeerClosed {
        op: OpKind,
        group: String,
        seq: u64,
        rank: usize,
        peer: usize,
        detail: String,
        /// Where the op that failed was issued.
        site: Site,
    },

    #[error("mismatched collectives on group '{group}': rank {rank} called {mine} but rank {peer} called {theirs}")]
    Mismatch {
        group: String,
        rank: usize,
        peer: usize,
        mine: String,
        theirs: String,
    },

    #[error("invalid argument to {op} on group '{group}': {msg}")]
    InvalidArgument {
        op: OpKind,
        group: String,
        msg: String,
    },

    #[error("rendezvous: {0}")]
    Store(String),

    #[error("invalid mesh: {0}")]
    InvalidMesh(String),

    #[error("invalid process group: {0}")]
    InvalidGroup(String),

    #[error("launch environment: {0}")]
    Env(String),

    #[error("group '{group}' is unusable after an earlier failure: {cause}")]
    Poisoned { group: String, cause: String },

    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),

    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, CommError>;

/// A pending asynchronous operation. Its result is only valid after [`Work::wait`].
#[must_use = "an async collective's result is only valid after wait()"]
pub struct Work<T = Tensor> {
    inner: Box<dyn PendingWork<T>>,
}

/// What a backend implements to hand out a [`Work`].
pub trait PendingWork<T>: Send {
    /// Block until the op is complete (or failed) and return its result.
    fn wait(self: Box<Self>) -> Result<T>;
    /// True once `wait` would return without blocking.
    fn is_done(&self) -> bool;
}

impl<T: Send + 'static> Work<T> {
    pub fn new(inner: Box<dyn PendingWork<T>>) -> Self {
        Self { inner }
    }

    /// A work item that is already complete (used by size-1 groups and by sync fallbacks).
    pub fn ready(value: Result<T>) -> Self {
        struct Ready<T>(Result<T>);
        impl<T: Send> PendingWork<T> for Ready<T> {
            fn wait(self: Box<Self>) -> Result<T> {
                self.0
            }
            fn is_done(&self) -> bool {
                true
            }
        }
        Self {
            inner: Box::new(Ready(value)),
        }
    }

    pub fn wait(self) -> Result<T> {
        self.inner.wait()
    }

    pub fn is_done(&self) -> bool {
        self.inner.is_done()
    }
}

/// Rows `[start, end)` that rank `r` of `n` owns when `len` rows are split as evenly as
/// possible, the first `len % n` ranks taking one extra row.
pub fn chunk_range(len: usize, n: usize, r: usize) -> std::ops::Range<usize> {
    let base = len / n;
    let extra = len % n;
    let start = r * base + r.min(extra);
    let size = base + usize::from(r < extra);
    start..start + size
}

/// The error for an in-place op on a tensor whose elements are not one contiguous run (its
/// result would land in a copy).
pub fn check_in_place(group: &str, x: &Tensor) -> Result<()> {
    match x.is_contiguous() {
        true => Ok(()),
        false => Err(CommError::InvalidArgument {
            op: OpKind::AllReduce,
            group: group.to_string(),
            msg: format!(
                "all_reduce_in_place needs a contiguous tensor, got shape {:?} with strides {:?} \
                 (reduce a .contiguous() copy instead)",
                x.dims(),
                x.stride()
            ),
        }),
    }
}

/// [`Communicator::all_reduce_in_place`] by [`Communicator::all_reduce`] and a copy of the
/// result into `x`: the trait's default, and what a backend falls back to where it cannot
/// reduce in place.
#[track_caller]
pub fn all_reduce_and_copy_back<C: Communicator + ?Sized>(
    comm: &C,
    x: &Tensor,
    op: ReduceOp,
) -> Result<()> {
    check_in_place(comm.name(), x)?;
    let y = comm.all_reduce(x, op)?;
    Ok(x.flatten_all()?.slice_set(&y.flatten_all()?, 0, 0)?)
}

/// One process group. Ranks are group ranks (0..size); `global_ranks()` maps them to the world.
///
/// The async methods are the primitives; each sync method is its async twin plus `wait()`.
/// Every collective is `#[track_caller]`: a backend records where it was issued
/// ([`Site::caller`](crate::Site::caller) in its implementation).
pub trait Communicator: Send + Sync + fmt::Debug {
    /// This process's rank within the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// Short name of the group ("world", "dp", "tp", "pp", "ep", "edp", ...), used in errors and traces.
    fn name(&self) -> &str;
    /// Global (world) rank of each group rank, indexed by group rank.
    fn global_ranks(&self) -> &[usize];
    /// Device the results are placed on (and inputs are expected on).
    fn device(&self) -> &Device;
    /// The group's trace: every op with its bytes and timing, plus the last few ops for error reports.
    fn tracer(&self) -> &Tracer;

    #[track_caller]
    fn all_reduce_async(&self, x: &Tensor, op: ReduceOp) -> Work;
    #[track_caller]
    fn reduce_async(&self, x: &Tensor, root: usize, op: ReduceOp) -> Work;
    #[track_caller]
    fn broadcast_async(&self, x: &Tensor, root: usize) -> Work;
    #[track_caller]
    fn all_gather_async(&self, x: &Tensor) -> Work;
    #[track_caller]
    fn reduce_scatter_async(&self, x: &Tensor, op: ReduceOp) -> Work;
    /// `x` is read on the root only; other ranks pass a tensor of the same dtype (its shape is ignored).
    #[track_caller]
    fn scatter_async(&self, x: &Tensor, root: usize) -> Work;
    #[track_caller]
    fn gather_async(&self, x: &Tensor, root: usize) -> Work;
    /// `send_splits[p]` rows of `x` (in order) go to peer p; `recv_splits[p]` rows come from peer p.
    #[track_caller]
    fn all_to_all_async(&self, x: &Tensor, send_splits: &[usize], recv_splits: &[usize]) -> Work;
    /// Send `x` to `dst`. A send may wait, on the backend's stream, until `dst` has received
    /// this rank's previous message to it (IPC keeps one per pair): a rank that sends to a peer
    /// twice receives from it in between, or the peer's second send waits on it too.
    #[track_caller]
    fn send_async(&self, x: &Tensor, dst: usize) -> Work<()>;
    /// Whether a send's `Work` completes once this rank has handed the data off, whatever the
    /// receiver does (the CPU backend: the bytes queued for the connection's writer thread).
    /// False where it may wait for the matching receive (NCCL): a caller that waited on such a
    /// send before its own receives could deadlock with its peer.
    fn sends_complete_locally(&self) -> bool {
        false
    }
    #[track_caller]
    fn recv_async(&self, src: usize, shape: &Shape, dtype: DType) -> Work;
    #[track_caller]
    fn barrier_async(&self) -> Work<()>;

    #[track_caller]
    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.all_reduce_async(x, op).wait()
    }
    /// All-reduce `x` into its own storage, as `torch.distributed.all_reduce` does: afterwards
    /// `x`, and every tensor that shares its storage, holds the result. Blocks until done. `x`
    /// must be contiguous. This default runs [`all_reduce`](Self::all_reduce) and copies the
    /// result back; the CPU backend reduces large tensors where the data lies instead, allocating
    /// nothing of the tensor's size.
    #[track_caller]
    fn all_reduce_in_place(&self, x: &Tensor, op: ReduceOp) -> Result<()> {
        all_reduce_and_copy_back(self, x, op)
    }
    #[track_caller]
    fn reduce(&self, x: &Tensor, root: usize, op: ReduceOp) -> Result<Tensor> {
        self.reduce_async(x, root, op).wait()
    }
    #[track_caller]
    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        self.broadcast_async(x, root).wait()
    }
    #[track_caller]
    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        self.all_gather_async(x).wait()
    }
    #[track_caller]
    fn reduce_scatter(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.reduce_scatter_async(x, op).wait()
    }
    #[track_caller]
    fn scatter(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        self.scatter_async(x, root).wait()
    }
    #[track_caller]
    fn gather(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        self.gather_async(x, root).wait()
    }
    #[track_caller]
    fn all_to_all(
        &self,
        x: &Tensor,
        send_splits: &[usize],
        recv_splits: &[usize],
    ) -> Result<Tensor> {
        self.all_to_all_async(x, send_splits, recv_splits).wait()
    }
    #[track_caller]
    fn send(&self, x: &Tensor, dst: usize) -> Result<()> {
        self.send_async(x, dst).wait()
    }
    #[track_caller]
    fn recv(&self, src: usize, shape: &Shape, dtype: DType) -> Result<Tensor> {
        self.recv_async(src, shape, dtype).wait()
    }
    #[track_caller]
    fn barrier(&self) -> Result<()> {
        self.barrier_async().wait()
    }
}

/// Creates process groups. One per process; every strategy receives the groups it needs from
/// the [`crate::mesh::DeviceMesh`] built on top of it, never from a global.
pub trait Backend: Send + Sync {
    /// The group of all ranks.
    fn world(&self) -> Comm;
    /// Create the group made of these global ranks (sorted, containing this rank). Called by the
    /// member ranks only, and by all of them in the same order.
    fn new_group(&self, ranks: &[usize], name: &str) -> Result<Comm>;
    /// [`new_group`](Self::new_group) whose all-reduce runs the algorithm `algo` picks, on a
    /// backend that runs algorithms of its own (the CPU backend); `None` where a library picks
    /// them itself (NCCL).
    fn new_group_with_algo(
        &self,
        ranks: &[usize],
        name: &str,
        algo: AlgoChoice,
    ) -> Result<Option<Comm>> {
        let _ = (ranks, name, algo);
        Ok(None)
    }
    /// The device this process computes on.
    fn device(&self) -> Device;
}

#[cfg(test)]
mod tests {
    use super::chunk_range;

    #[test]
    fn chunk_ranges_tile_the_rows() {
        for len in [0usize, 1, 3, 7, 8, 100] {
            for n in 1..=8 {
                let mut next = 0;
                for r in 0..n {
                    let c = chunk_range(len, n, r);
                    assert_eq!(c.start, next);
                    assert!(c.len() == len / n || c.len() == len / n + 1);
                    next = c.end;
                }
                assert_eq!(next, len);
            }
        }
    }
}
