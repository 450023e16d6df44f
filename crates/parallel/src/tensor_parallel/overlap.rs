//! Overlapping a TP layer's collective with its own product (`--tp-overlap chunked`): the
//! micro-batch's sequences are cut into k chunks, and chunk i's collective is on the wire while
//! chunk i+1's product is computed.
//!
//! ```text
//!   none      compute  [ x W_rᵀ (all rows)  ]
//!             comm                           [ all-reduce (all rows) ]          y
//!
//!   chunked   compute  [ x_0 W_rᵀ ][ x_1 W_rᵀ ][ x_2 W_rᵀ ][ x_3 W_rᵀ ]
//!             comm                [ AR 0    ][ AR 1    ][ AR 2    ][ AR 3 ]     y = [y_0; …; y_3]
//!                                                                   ^ exposed: the last chunk
//! ```
//!
//! The row-parallel layer cuts its forward this way (g's all-reduce, or under sequence
//! parallelism its reduce-scatter along T, which cut by sequences gives each rank the same T/tp
//! positions of each); the column-parallel layer cuts the input gradient's all-reduce (f's
//! conjugate) and computes the weight gradient while the last chunks are on the wire. A chunk is
//! whole sequences, so every collective sees the (b, T, F) layout it always sees; each sum is
//! over the same ranks' values (at tp > 2 the ring may add them in another order).
//!
//! Legend: `N` rows (B·T), `F` features, `k` chunks.

use std::ops::Range;

use candle_core::Tensor;
use mtrain_comm::{chunk_range, Comm, ReduceOp, Work};

use super::mapping::TpCollective;
use super::SEQ_DIM;
use crate::ops::comm_err;
use crate::plan::TpOverlap;

/// Chunks of `--tp-overlap chunked` (fewer where a micro-batch has fewer sequences).
pub const CHUNKS: usize = 4;

/// The sequence ranges of a micro-batch of `b` sequences to run one after another under
/// `mode`, or None where the layer runs whole (no chunks: none, ring, or one sequence).
pub fn chunks(mode: TpOverlap, b: usize) -> Option<Vec<Range<usize>>> {
    let k = match mode {
        TpOverlap::None | TpOverlap::Ring => return None,
        TpOverlap::Chunked => CHUNKS.min(b),
    };
    (k > 1).then(|| (0..k).map(|i| chunk_range(b, k, i)).collect())
}

/// A collective of [`TpCollective::start_rows`] on the wire.
pub struct InFlight {
    work: Work,
    /// The result comes back sequence-first (T', b, F) and is laid out as rows again.
    along_t: bool,
    b: usize,
}

impl InFlight {
    /// Wait for it: the rows (b·T', F) it leaves.
    pub fn finish(self) -> candle_core::Result<Tensor> {
        let y = self.work.wait().map_err(comm_err)?;
        if !self.along_t {
            return Ok(y); // (rows, F)
        }
        let (t2, b, f) = y.dims3()?;
        debug_assert_eq!(b, self.b);
        y.transpose(0, 1)?.contiguous()?.reshape((b * t2, f)) // (b·T', F)
    }
}

impl TpCollective {
    /// [`TpCollective::run_rows`] started and not waited: the rows (N, F) of `b` sequences go
    /// on the wire now; [`InFlight::finish`] gives what `run_rows` would have.
    #[track_caller]
    pub fn start_rows(self, x: &Tensor, b: usize, group: &Comm) -> candle_core::Result<InFlight> {
        let (rows, f) = x.dims2()?;
        if self == TpCollective::AllReduce {
            let work = group.all_reduce_async(&x.contiguous()?, ReduceOp::Sum); // (N, F)
            return Ok(InFlight {
                work,
                along_t: false,
                b,
            });
        }
        let front = x
            .reshape((b, rows / b, f))?
            .transpose(0, SEQ_DIM)?
            .contiguous()?; // (T', b, F)
        let work = match self {
            TpCollective::AllGather => group.all_gather_async(&front),
            _ => group.reduce_scatter_async(&front, ReduceOp::Sum),
        };
        Ok(InFlight {
            work,
            along_t: true,
            b,
        })
    }
}

/// The rows of sequences `seqs` in a (b·T, F) activation of `b` sequences.
pub fn rows_of(x: &Tensor, b: usize, seqs: &Range<usize>) -> candle_core::Result<Tensor> {
    let t = x.dim(0)? / b;
    x.narrow(0, seqs.start * t, seqs.len() * t)
}
