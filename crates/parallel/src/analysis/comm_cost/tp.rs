//! A block's tensor-parallel collectives in a step's tally, as `--tp-overlap` issues them.
//!
//! ```text
//!   none      every collective whole, waited inline
//!   chunked   the row layer's g forward (all-reduce, or under SP reduce-scatter) and the
//!             column layer's f conjugate backward (all-reduce; under SP the column layer
//!             issues none) as k collectives of k sequence chunks
//!             (tensor_parallel::overlap::chunks): the first k − 1 beside the next chunk's
//!             product (overlappable), the last one exposed
//!   ring      (SP) every all-gather and reduce-scatter of a block as tp − 1 sends of one part
//!             (b · T/tp rows) to the next rank, and as many receives, each beside a product
//! ```
//!
//! The embedding's and the head's collectives are not cut. (An MoE model takes no tp: the plan
//! refuses it.)

use candle_core::DType;
use mtrain_comm::OpKind;

use super::{Group, Phase, Tally};
use crate::plan::TpOverlap;
use crate::tensor_parallel::overlap::chunks;
use crate::tensor_parallel::TpCollective;

/// A micro-batch's activation (B, T, C) in `act`: the block collectives' operand.
#[derive(Debug, Clone, Copy)]
pub(super) struct Operand {
    pub b: usize,
    pub t: usize,
    pub ch: usize,
    pub act: DType,
}

/// One tensor-parallel collective `c`, in a forward (`forward`; the recompute's included) or
/// a backward: a block's under `mode` (None: not a block's), whole where the mode does not cut
/// it.
pub(super) fn collective(
    tally: &mut Tally,
    mode: Option<TpOverlap>,
    (c, forward): (TpCollective, bool),
    what: &'static str,
    phase: Phase,
    x: Operand,
) {
    if !mode.is_some_and(|m| cut(tally, m, (c, forward), what, phase, x)) {
        let Operand { b, t, ch, act } = x;
        match c {
            TpCollective::AllReduce => {
                tally.all_reduce(Group::Tp, what, phase, b * t * ch, act, false)
            }
            TpCollective::AllGather => {
                tally.all_gather(Group::Tp, what, phase, t, b * ch, act, false)
            }
            TpCollective::ReduceScatter => {
                tally.reduce_scatter(Group::Tp, what, phase, t, b * ch, act, false)
            }
        }
    }
}

/// `c` as `mode` cuts it; false where the mode issues it whole.
fn cut(
    tally: &mut Tally,
    mode: TpOverlap,
    (c, forward): (TpCollective, bool),
    what: &'static str,
    phase: Phase,
    x: Operand,
) -> bool {
    let Operand { b, t, ch, act } = x;
    let reducing = match c {
        TpCollective::AllReduce => true,
        TpCollective::ReduceScatter => forward,
        TpCollective::AllGather => false,
    };
    match mode {
        TpOverlap::None => false,
        TpOverlap::Chunked if !reducing => false,
        TpOverlap::Chunked => {
            let Some(parts) = chunks(mode, b) else {
                return false;
            };
            let last = parts.len() - 1;
            for (i, seqs) in parts.into_iter().enumerate() {
                let hidden = i < last;
                match c {
                    TpCollective::AllReduce => {
                        tally.all_reduce(Group::Tp, what, phase, seqs.len() * t * ch, act, hidden)
                    }
                    _ => tally.reduce_scatter(
                        Group::Tp,
                        what,
                        phase,
                        t,
                        seqs.len() * ch,
                        act,
                        hidden,
                    ),
                }
            }
            true
        }
        TpOverlap::Ring => {
            let tp = tally.dims.tp;
            for _ in 1..tp {
                for rows in crate::tensor_parallel::ring::pieces(b * (t / tp)) {
                    let piece = (rows.len() * ch * act.size_in_bytes()) as u64;
                    tally.push(
                        Group::Tp,
                        OpKind::Send,
                        what,
                        phase,
                        piece,
                        piece,
                        true,
                        false,
                    );
                    tally.push(Group::Tp, OpKind::Recv, what, phase, 0, 0, true, false);
                }
            }
            true
        }
    }
}
