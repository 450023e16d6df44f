//! Overlapping a TP sub-layer's collective with the sub-layer itself (`--tp-overlap chunked`):
//! the micro-batch's sequences are cut into k chunks, and chunk i's collective is on the wire
//! while chunk i+1 runs the whole sub-layer — c_attn, attention and c_proj's product, or c_fc,
//! GELU and c_proj's product — up to its own collective.
//!
//! ```text
//!   none      compute  [ c_attn · attention · x W_rᵀ  (all rows) ]
//!             comm                                                 [ all-reduce (all rows) ]   y
//!
//!   chunked   compute  [ sub-layer 0 ][ sub-layer 1 ][ sub-layer 2 ][ sub-layer 3 ]
//!             comm                    [ AR 0        ][ AR 1        ][ AR 2        ][ AR 3 ]
//!                                                                                  ^ exposed
//! ```
//!
//! The row-parallel layer owns the schedule: it asks the sub-layer for its input a chunk at a
//! time ([`TapedLinear::forward_from`]) and sends each chunk's sum (g's all-reduce, or under
//! sequence parallelism its reduce-scatter along T, which cut by sequences gives each rank the
//! same T/tp positions of each) before asking for the next. The column-parallel layer does the
//! same with the input gradient's all-reduce (f's conjugate) in the backward, asking the layers
//! after it for the output gradient chunk by chunk ([`TapedLinear::backward_from`]: attention's
//! backward runs per chunk), and computes its weight gradient while the last chunks are on the
//! wire. A chunk is whole sequences, so attention needs nothing from another chunk and every
//! collective sees the (b, T, F) layout it always sees; each sum is over the same ranks' values
//! (at tp > 2 the ring may add them in another order).
//!
//! Legend: `N` rows (B·T), `F` features, `k` chunks.
//!
//! [`TapedLinear::forward_from`]: mtrain_model::tape::TapedLinear::forward_from
//! [`TapedLinear::backward_from`]: mtrain_model::tape::TapedLinear::backward_from

use std::ops::Range;

use candle_core::Tensor;
use mtrain_comm::{chunk_range, Comm, ReduceOp, Work};
pub use mtrain_model::tape::rows_of;

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
