//! This rank's pieces of the model state, for checkpoints that never gather: which elements of
//! each single-device parameter the rank holds, their values (the weights, as fp32 masters under
//! mixed precision, and AdamW's two moments, all cut alike), and the reverse, filling every piece
//! of this rank from a [`ParamSource`] written under any layout.
//!
//! ```text
//!   piece = (name, full shape, runs: row-major element ranges of the single-device tensor)
//!     DDP, one device   the tp slice            Placement::runs(full, tp rank, tp)
//!     ZeRO 1/2/3        the part of the tp slice inside this dp rank's flat shard
//!                       [lo, hi) of the unit:   sub_runs(tp runs, lo − offset .. hi − offset)
//!
//!   stored (written once) by the replica with the lowest coordinates:
//!     pp   the pipeline rank of the name's stage (the tied wte: the first stage's)
//!     tp   tp rank 0 for a parameter replicated over tp (LayerNorms, row biases, wpe)
//!     dp   dp rank 0 under DDP (an expert: its edp replica 0); ZeRO's shards are disjoint
//!          over dp, so every dp rank stores its own
//! ```
//!
//! So the stored pieces of all ranks cover every element of every parameter exactly once, which
//! a checkpoint's reader checks.

use std::collections::BTreeMap;
use std::ops::Range;

use candle_core::{DType, Tensor};
use mtrain_model::optim::{AdamW, AdamWState};
use mtrain_model::source::{read_tensor, runs_len, sub_runs, ParamSource};

use crate::fsdp::ZeroStage;
use crate::placement::{expert_of, stage_of, Placement};
use crate::runtime::{ParallelModel, Replicas, Result};
use crate::toolbox::{set_weight, StateError};

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

/// One piece of one parameter as this rank holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// The parameter's single-device name.
    pub name: String,
    /// Its single-device shape.
    pub full_shape: Vec<usize>,
    /// The elements of the single-device tensor this piece holds, in its storage order.
    pub runs: Vec<Range<usize>>,
    /// Whether this rank is the replica that stores it (the module doc's rule).
    pub stored: bool,
    /// Where its values are on this rank.
    at: Site,
}

/// Where a piece's values live: a whole (tp-local) parameter, or part of a ZeRO shard piece.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Site {
    /// `params[i]`; the optimizer item has the parameter's name.
    Param(usize),
    /// Elements `offset .. offset + len` of the ZeRO shard piece (optimizer item) `item`.
    Shard { item: String, offset: usize },
}

impl Piece {
    /// Elements it holds.
    pub fn numel(&self) -> usize {
        runs_len(&self.runs)
    }
}

impl ParallelModel {
    /// The full shape and tp runs of this rank's tensor-parallel piece of `name`, whose local
    /// shape is `local`.
    fn tp_runs(&self, name: &str, local: &[usize]) -> (Vec<usize>, Vec<Range<usize>>) {
        match self.layout.as_ref().and_then(|l| l.get(name)) {
            Some(spec) => (
                spec.full_shape.clone(),
                spec.placement
                    .runs(&spec.full_shape, self.coords.tp, self.plan.dims.tp),
            ),
            None => (local.to_vec(), vec![0..local.iter().product()]),
        }
    }

    /// Whether this rank is the replica that stores its piece of `name` (the module doc's rule).
    fn stores(&self, name: &str, zero: bool) -> bool {
        let dims = self.plan.dims;
        let layout = self.stages.layout();
        let pp_ok = layout.rank_of_stage(stage_of(name, layout), dims.pp) == self.coords.pp;
        let tp_sharded = matches!(
            self.layout.as_ref().and_then(|l| l.get(name)).map(|s| s.placement),
            Some(Placement::Sharded { .. })
        );
        let tp_ok = self.coords.tp == 0 || tp_sharded;
        let dp_ok = zero
            || match expert_of(name) {
                Some(_) => self.coords.edp == 0,
                None => self.coords.dp == 0,
            };
        pp_ok && tp_ok && dp_ok
    }

    /// Every piece of every parameter this rank holds, each name once.
    pub fn pieces(&self) -> Vec<Piece> {
        let mut out = Vec::new();
        match &self.replicas {
            Replicas::Full(_) => {
                for (i, p) in self.params.iter().enumerate() {
                    let (full_shape, runs) = self.tp_runs(p.name(), p.shape().dims());
                    out.push(Piece {
                        name: p.name().to_string(),
                        full_shape,
                        runs,
                        stored: self.stores(p.name(), false),
                        at: Site::Param(i),
                    });
                }
            }
            Replicas::Zero(fsdp) => {
                for u in fsdp.units().iter().filter(|u| u.numel > 0) {
                    let (span, len_decay) = u.shard_span();
                    let [decay, plain] = u.piece_names();
                    for e in &u.entries {
                        let (lo, hi) = (
                            span.start.max(e.offset),
                            span.end.min(e.offset + e.numel),
                        );
                        if lo >= hi {
                            continue;
                        }
                        let at = lo - span.start; // position in this rank's shard
                        let (item, offset) = if at < len_decay {
                            (decay, at)
                        } else {
                            (plain, at - len_decay)
                        };
                        let name = e.param.name();
                        let (full_shape, tp) = self.tp_runs(name, e.shape.dims());
                        out.push(Piece {
                            name: name.to_string(),
                            full_shape,
                            runs: sub_runs(&tp, lo - e.offset..hi - e.offset),
                            stored: self.stores(name, true),
                            at: Site::Shard {
                                item: item.unwrap_or_default().to_string(),
                                offset,
                            },
                        });
                    }
                }
            }
        }
        out
    }

    /// The values of `piece` (one of [`ParallelModel::pieces`]) of `kind`, as an f32 vector
    /// `(numel,)` in the piece's order; None for a moment before the first optimizer step.
    pub fn piece_values(
        &self,
        opt: &AdamW,
        piece: &Piece,
        kind: StateKind,
    ) -> Result<Option<Tensor>> {
        let (item, tensor) = match (&piece.at, &self.replicas) {
            (Site::Param(i), Replicas::Full(f)) => {
                let p = &self.params[*i];
                let weight = match &f.masters {
                    Some(m) => m.tensors().remove(p.name()),
                    None => Some(p.tensor().detach()),
                };
                (p.name().to_string(), weight)
            }
            (Site::Shard { item, .. }, Replicas::Zero(fsdp)) => {
                let weight = match fsdp.masters() {
                    Some(m) => m.tensors().remove(item),
                    None => fsdp
                        .units()
                        .iter()
                        .flat_map(|u| [&u.decay_shard, &u.plain_shard])
                        .flatten()
                        .find(|p| p.name() == item)
                        .map(|p| p.tensor().detach()),
                };
                (item.clone(), weight)
            }
            _ => unreachable!("a piece is cut from the replicas that listed it"),
        };
        let whole = match kind {
            StateKind::Weight => tensor,
            StateKind::FirstMoment => opt.moments(&item).map(|(m, _)| m.clone()),
            StateKind::SecondMoment => opt.moments(&item).map(|(_, v)| v.clone()),
        };
        let Some(whole) = whole else {
            if kind == StateKind::Weight {
                return Err(StateError::NotHeld {
                    rank: self.world.rank(),
                    name: item,
                }
                .into());
            }
            return Ok(None);
        };
        let flat = whole.flatten_all()?;
        let flat = match &piece.at {
            Site::Shard { offset, .. } => flat.narrow(0, *offset, piece.numel())?,
            Site::Param(_) => flat,
        };
        Ok(Some(flat.to_dtype(DType::F32)?))
    }

    /// Fills every piece this rank holds from sources of the single-device tensors: `weights`,
    /// and, when given, the moments `(m, v)` with AdamW's step count. Each piece reads only its
    /// own runs, so nothing outside this rank's part is materialised.
    pub fn load_pieces(
        &mut self,
        opt: &mut AdamW,
        weights: &dyn ParamSource,
        moments: Option<(&dyn ParamSource, &dyn ParamSource, u64)>,
    ) -> Result<()> {
        let device = self.world.device().clone();
        let mut m = BTreeMap::new();
        let mut v = BTreeMap::new();
        match &self.replicas {
            Replicas::Full(f) => {
                for p in &self.params {
                    let local = p.shape().dims().to_vec();
                    let (full, runs) = self.tp_runs(p.name(), &local);
                    let read = |s: &dyn ParamSource| {
                        read_tensor(s, p.name(), &full, &runs, &local, &device)
                    };
                    let w = read(weights)?;
                    set_weight(p, &w)?;
                    if let Some(masters) = &f.masters {
                        masters.set(p.name(), &w)?;
                    }
                    if let Some((ms, vs, _)) = moments {
                        m.insert(p.name().to_string(), read(ms)?);
                        v.insert(p.name().to_string(), read(vs)?);
                    }
                }
            }
            Replicas::Zero(fsdp) => {
                let pieces = self.pieces();
                for u in fsdp.units().iter().filter(|u| u.numel > 0) {
                    let [decay, plain] = u.piece_names();
                    // One shard piece of `kind` from the source, entry by entry.
                    let shard_piece = |item: &str, len: usize, s: &dyn ParamSource| {
                        let mut buf = vec![0f32; len];
                        for p in pieces.iter().filter(|p| {
                            matches!(&p.at, Site::Shard { item: i, .. } if i == item)
                        }) {
                            let Site::Shard { offset, .. } = &p.at else { continue };
                            let data = s.read(&p.name, &p.full_shape, &p.runs)?;
                            buf[*offset..*offset + data.len()].copy_from_slice(&data);
                        }
                        Tensor::from_vec(buf, len, &device)
                    };
                    for (item, param) in [(decay, &u.decay_shard), (plain, &u.plain_shard)] {
                        let (Some(item), Some(param)) = (item, param) else { continue };
                        let len = param.elem_count();
                        let w = shard_piece(item, len, weights)?;
                        set_weight(param, &w)?;
                        if let Some(masters) = fsdp.masters() {
                            masters.set(item, &w)?;
                        }
                        if let Some((ms, vs, _)) = moments {
                            m.insert(item.to_string(), shard_piece(item, len, ms)?);
                            v.insert(item.to_string(), shard_piece(item, len, vs)?);
                        }
                    }
                    if fsdp.stage() != ZeroStage::Three {
                        // Stages 1 and 2 keep every tp-local weight whole as well.
                        for e in &u.entries {
                            let local = e.shape.dims().to_vec();
                            let (full, runs) = self.tp_runs(e.param.name(), &local);
                            let w = read_tensor(weights, e.param.name(), &full, &runs, &local, &device)?;
                            set_weight(&e.param, &w)?;
                        }
                    }
                }
            }
        }
        if let Some((_, _, step)) = moments {
            opt.load_state_owned(AdamWState { step, m, v })?;
        }
        Ok(())
    }
}

impl ParallelModel {
    /// Waits until every rank of the world has reached this point (every shard file of a
    /// checkpoint written, before rank 0 seals it).
    pub fn barrier(&self) -> Result<()> {
        Ok(self.world.barrier()?)
    }
}
