//! Megatron's mappings as data: which collective each one issues in forward and in backward,
//! and which of them each tensor-parallel segment kind issues, in order.
//!
//! ```text
//!   mapping                    forward               backward
//!   f  CopyToTp                —                     all-reduce (B, T, C)
//!   g  ReduceFromTp            all-reduce (B, T, C)  —
//!      GatherFromSequence      all-gather T          reduce-scatter T
//!      ReduceScatterToSequence reduce-scatter T      all-gather T
//!
//!   segment     without SP                              with SP
//!   embedding   sum: g                                  sum: reduce-scatter T
//!   block       attention, MLP: enter f … leave g       enter all-gather T … leave reduce-scatter T
//!   head        input: f, then the loss's all-reduces   input: all-gather T, then the loss
//! ```
//!
//! The layers are built from these tables ([`EmbeddingMappings`], [`BlockMappings`],
//! [`HeadMappings`]), a tape runs a mapping from its [`Mapping::forward`] and
//! [`Mapping::backward`], and the cost model (`comm_cost/step.rs`) counts the same entries: a
//! segment's communication is written here once. A segment's backward runs the backward
//! collectives of its sites in reverse order.
//!
//! Legend: `B` batch, `T` sequence, `C` width; `T` split by `chunk_range` under SP.

use std::sync::Arc;

use candle_core::Tensor;
use mtrain_comm::{Comm, OpKind, ReduceOp};
use mtrain_model::tape::Collective;

use super::SEQ_DIM;
use crate::ops::{
    all_gather_along, comm_err, copy_to_tp_region, gather_from_sequence_parallel_region,
    reduce_from_tp_region, reduce_scatter_along, reduce_scatter_to_sequence_parallel_region,
};

/// Megatron's mappings of [`crate::ops`]: each is the autograd op of that name
/// ([`Mapping::apply`]) and, for a hand-written backward, a tape collective issuing the same
/// communication at the same place ([`Mapping::over`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapping {
    /// f, [`copy_to_tp_region`]: identity forward, all-reduce backward.
    CopyToTp,
    /// g, [`reduce_from_tp_region`]: all-reduce forward, identity backward.
    ReduceFromTp,
    /// [`gather_from_sequence_parallel_region`] along T: all-gather forward, reduce-scatter
    /// backward.
    GatherFromSequence,
    /// [`reduce_scatter_to_sequence_parallel_region`] along T: reduce-scatter forward,
    /// all-gather backward.
    ReduceScatterToSequence,
}

/// One collective a mapping issues, over the tp group, on the activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TpCollective {
    /// Sum of the whole activation (B, T, C) on every rank.
    AllReduce,
    /// (B, T/tp, C) → (B, T, C): every rank's sequence part, concatenated along T.
    AllGather,
    /// (B, T, C) → (B, T/tp, C): the sum, each rank keeping its part of T.
    ReduceScatter,
}

impl TpCollective {
    /// The communicator's name for it (what a trace records).
    pub const fn op(self) -> OpKind {
        match self {
            TpCollective::AllReduce => OpKind::AllReduce,
            TpCollective::AllGather => OpKind::AllGather,
            TpCollective::ReduceScatter => OpKind::ReduceScatter,
        }
    }

    /// Runs it on `x` over `group` (no autograd); the collective's site is the caller's line.
    #[track_caller]
    fn run(self, x: &Tensor, group: &Comm) -> candle_core::Result<Tensor> {
        match self {
            TpCollective::AllReduce => group
                .all_reduce(&x.contiguous()?, ReduceOp::Sum)
                .map_err(comm_err),
            TpCollective::AllGather => all_gather_along(group.as_ref(), x, SEQ_DIM),
            TpCollective::ReduceScatter => reduce_scatter_along(group.as_ref(), x, SEQ_DIM),
        }
    }
}

impl TpCollective {
    /// [`TpCollective::run`] on the rows (N, F) of a batch of `b` sequences, viewed as the
    /// activation (B, N/B, F): the layout a tape holds. Returns (N', F) for the N' = B·T' rows
    /// it leaves (T' = T/tp after a reduce-scatter, T after an all-gather).
    #[track_caller]
    pub fn run_rows(self, x: &Tensor, b: usize, group: &Comm) -> candle_core::Result<Tensor> {
        let (rows, f) = x.dims2()?;
        let y = self.run(&x.reshape((b, rows / b, f))?, group)?; // (B, T', F)
        let (b2, t2, f2) = y.dims3()?;
        y.reshape((b2 * t2, f2)) // (N', F)
    }
}

impl Mapping {
    /// The collective it issues in forward (`None`: the identity).
    pub const fn forward(self) -> Option<TpCollective> {
        match self {
            Mapping::CopyToTp => None,
            Mapping::ReduceFromTp => Some(TpCollective::AllReduce),
            Mapping::GatherFromSequence => Some(TpCollective::AllGather),
            Mapping::ReduceScatterToSequence => Some(TpCollective::ReduceScatter),
        }
    }

    /// The collective it issues on the gradient in backward: the forward's conjugate.
    pub const fn backward(self) -> Option<TpCollective> {
        match self {
            Mapping::CopyToTp => Some(TpCollective::AllReduce),
            Mapping::ReduceFromTp => None,
            Mapping::GatherFromSequence => Some(TpCollective::ReduceScatter),
            Mapping::ReduceScatterToSequence => Some(TpCollective::AllGather),
        }
    }

    /// The autograd op of this mapping on `x` over `group`.
    #[track_caller]
    pub fn apply(self, x: &Tensor, group: &Comm) -> candle_core::Result<Tensor> {
        match self {
            Mapping::CopyToTp => copy_to_tp_region(x, group),
            Mapping::ReduceFromTp => reduce_from_tp_region(x, group),
            Mapping::GatherFromSequence => gather_from_sequence_parallel_region(x, SEQ_DIM, group),
            Mapping::ReduceScatterToSequence => {
                reduce_scatter_to_sequence_parallel_region(x, SEQ_DIM, group)
            }
        }
    }

    /// This mapping over `group`, as a tape's collective.
    pub fn over(self, group: &Comm) -> Arc<dyn Collective> {
        Arc::new(TapedMapping {
            mapping: self,
            group: group.clone(),
        })
    }
}

struct TapedMapping {
    mapping: Mapping,
    group: Comm,
}

impl Collective for TapedMapping {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self.mapping.forward() {
            Some(c) => c.run(x, &self.group),
            None => Ok(x.clone()),
        }
    }

    fn backward(&self, dy: &Tensor) -> candle_core::Result<Tensor> {
        match self.mapping.backward() {
            Some(c) => c.run(dy, &self.group),
            None => Ok(dy.clone()),
        }
    }
}

/// A place in a segment where a mapping runs, and what its collectives carry (the cost
/// model's label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Site {
    pub mapping: Mapping,
    pub what: &'static str,
}

const fn site(mapping: Mapping, what: &'static str) -> Site {
    Site { mapping, what }
}

/// The vocab-parallel embedding's mapping: the sum of the ranks' partial lookups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddingMappings {
    pub sum: Site,
}

impl EmbeddingMappings {
    pub const fn new(sequence_parallel: bool) -> Self {
        Self {
            sum: match sequence_parallel {
                false => site(Mapping::ReduceFromTp, "embedding sum (g)"),
                true => site(Mapping::ReduceScatterToSequence, "embedding sum (SP)"),
            },
        }
    }

    /// Its sites in forward order.
    pub fn sites(&self) -> Vec<Site> {
        vec![self.sum]
    }
}

/// A tensor-parallel block's mappings: each of its [`BlockMappings::SUBLAYERS`] sub-layers
/// (attention, then the MLP) enters its column layer through `enter` and leaves its row layer
/// through `leave`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockMappings {
    /// f in the column layer, or the sequence all-gather the block runs after its LayerNorm.
    pub enter: Site,
    /// g, or the sequence reduce-scatter, in the row layer.
    pub leave: Site,
}

impl BlockMappings {
    /// Attention and the MLP.
    pub const SUBLAYERS: usize = 2;

    pub const fn new(sequence_parallel: bool) -> Self {
        match sequence_parallel {
            false => Self {
                enter: site(Mapping::CopyToTp, "block input (f)"),
                leave: site(Mapping::ReduceFromTp, "block output (g)"),
            },
            true => Self {
                enter: site(Mapping::GatherFromSequence, "block input (SP)"),
                leave: site(Mapping::ReduceScatterToSequence, "block output (SP)"),
            },
        }
    }

    /// Its sites in forward order.
    pub fn sites(&self) -> Vec<Site> {
        (0..Self::SUBLAYERS)
            .flat_map(|_| [self.enter, self.leave])
            .collect()
    }
}

/// The vocab-parallel head's mapping on its input, before the vocabulary-sharded matmul; the
/// loss's all-reduces follow it ([`super::vocab::LOSS_ALL_REDUCES`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadMappings {
    pub input: Site,
}

impl HeadMappings {
    pub const fn new(sequence_parallel: bool) -> Self {
        Self {
            input: match sequence_parallel {
                false => site(Mapping::CopyToTp, "head input (f)"),
                true => site(Mapping::GatherFromSequence, "head input (SP)"),
            },
        }
    }

    /// Its sites in forward order.
    pub fn sites(&self) -> Vec<Site> {
        vec![self.input]
    }
}
