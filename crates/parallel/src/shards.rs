//! This rank's pieces of the model state, for checkpoints that never gather: which replica
//! stores each piece ([`ParallelModel::pieces`] says what the rank holds), a piece's values
//! (the weights, as fp32 masters under mixed precision, and AdamW's two moments, all cut
//! alike), and AdamW's moments filled piece by piece from a [`ParamSource`] written under any
//! layout (the weights come from one through [`crate::parallelize()`]).
//!
//! ```text
//!   piece = (name, full shape, runs of the single-device tensor, local item, offset in it)
//!
//!   stored (written once) by the replica with the lowest coordinates:
//!     pp   the pipeline rank of the name's stage (the tied wte: the first stage's)
//!     tp   tp rank 0 for a parameter replicated over tp (LayerNorms, row biases, wpe)
//!     dp   dp rank 0 under DDP (an expert: its edp replica 0); ZeRO's shards are disjoint
//!          over dp, so every dp rank stores its own
//! ```
//!
//! So the stored pieces of all ranks cover every element of every parameter exactly once, which
//! a checkpoint's writer and reader check.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};
use mtrain_model::optim::{AdamW, AdamWState};
use mtrain_model::source::{ParamSource, Piece};

use crate::placement::{expert_of, stage_of, Placement};
use crate::runtime::{ParallelModel, Result};
use crate::toolbox::StateError;

/// What a piece's values are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum StateKind {
    /// The weights (fp32 masters under mixed precision).
    Weight,
    /// AdamW's first moment.
    FirstMoment,
    /// AdamW's second moment.
    SecondMoment,
}

impl StateKind {
    /// Every kind, weights first.
    pub const ALL: [StateKind; 3] = [
        StateKind::Weight,
        StateKind::FirstMoment,
        StateKind::SecondMoment,
    ];

    /// Its short name in a checkpoint ("w", "m", "v").
    pub fn tag(self) -> &'static str {
        match self {
            StateKind::Weight => "w",
            StateKind::FirstMoment => "m",
            StateKind::SecondMoment => "v",
        }
    }
}

impl ParallelModel {
    /// Whether this rank is the replica that stores `piece` (the module doc's rule).
    pub fn stores(&self, piece: &Piece) -> bool {
        let name = piece.name.as_str();
        let dims = self.plan.dims;
        let layout = self.stages.layout();
        let pp_ok = layout.rank_of_stage(stage_of(name, layout), dims.pp) == self.coords.pp;
        let tp_sharded = matches!(
            self.layout
                .as_ref()
                .and_then(|l| l.get(name))
                .map(|s| s.placement),
            Some(Placement::Sharded { .. })
        );
        let tp_ok = self.coords.tp == 0 || tp_sharded;
        let dp_ok = self.replicas.sharded_over_dp()
            || match expert_of(name) {
                Some(_) => self.coords.edp == 0,
                None => self.coords.dp == 0 && self.coords.cp == 0,
            };
        pp_ok && tp_ok && dp_ok
    }

    /// The values of `piece` (one of [`ParallelModel::pieces`]) of `kind`, as an f32 vector
    /// `(len,)` in the piece's order; None for a moment before the first optimizer step.
    pub fn piece_values(
        &self,
        opt: &AdamW,
        piece: &Piece,
        kind: StateKind,
    ) -> Result<Option<Tensor>> {
        let masters = self.replicas.masters();
        let item = piece.local.as_str();
        let whole = match kind {
            StateKind::Weight => {
                let w = match masters {
                    Some(m) => m.tensors().remove(item),
                    None => self.local_weights().remove(item),
                };
                Some(w.ok_or_else(|| StateError::NotHeld {
                    rank: self.world.rank(),
                    name: item.to_string(),
                })?)
            }
            StateKind::FirstMoment => opt.moments(item).map(|(m, _)| m.clone()),
            StateKind::SecondMoment => opt.moments(item).map(|(_, v)| v.clone()),
        };
        let Some(whole) = whole else { return Ok(None) };
        let flat = whole.flatten_all()?.narrow(0, piece.offset, piece.len())?;
        Ok(Some(flat.to_dtype(DType::F32)?))
    }

    /// Fills AdamW's moments of every optimizer item this rank holds from sources of the
    /// single-device moments `m` and `v`, piece by piece (each reads only its own runs), and sets
    /// its step count to `step`.
    pub fn load_moments(
        &self,
        opt: &mut AdamW,
        m: &dyn ParamSource,
        v: &dyn ParamSource,
        step: u64,
    ) -> Result<()> {
        let device = self.world.device();
        let pieces = self.pieces();
        let mut state = AdamWState {
            step,
            m: BTreeMap::new(),
            v: BTreeMap::new(),
        };
        for (item, w) in self.local_weights() {
            for (source, out) in [(m, &mut state.m), (v, &mut state.v)] {
                let mut buf = vec![0f32; w.elem_count()];
                for p in pieces.iter().filter(|p| p.local == item) {
                    let data = source.read(&p.name, &p.full_shape, &p.runs)?;
                    buf[p.offset..p.offset + data.len()].copy_from_slice(&data);
                }
                out.insert(item.clone(), Tensor::from_vec(buf, w.shape(), device)?);
            }
        }
        opt.load_state_owned(state)?;
        Ok(())
    }

    /// Waits until every rank of the world has reached this point (every shard file of a
    /// checkpoint written, before rank 0 seals it).
    pub fn barrier(&self) -> Result<()> {
        Ok(self.world.barrier()?)
    }
}
