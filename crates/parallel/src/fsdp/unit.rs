//! A flat unit: the parameters of one segment laid end to end in one buffer, split evenly
//! across the data-parallel ranks (ZeRO's partitioning, FSDP's FlatParameter).
//!
//! ```text
//!   flat buffer of h.0 (numel elements, padded up to a multiple of dp = 4):
//!
//!   | c_attn.w | attn.c_proj.w | c_fc.w | mlp.c_proj.w | ln_1.w ln_1.b c_attn.b … | pad |
//!   |<----------- weight-decayed (≥ 2-D) ----------->|<------ not decayed ------->|
//!   |<---- rank 0 ---->|<---- rank 1 ---->|<---- rank 2 ---->|<---- rank 3 ---->|
//!                                          ╰ decay piece ╯╰ no-decay piece ╯  ← rank 2's shard
//! ```
//!
//! Each rank keeps only its shard, as up to two [`Param`]s (the part inside the decayed region
//! and the part after it), so AdamW can update them with the right weight-decay flag and keep its
//! moments by shard name. The padding of the last shard is zeros and is never updated.
//! All-gathering the shards gives back the padded buffer; [`FlatUnit::unflatten`] cuts it into
//! the original tensors.
//!
//! A shard is read from a parameter source ([`FlatUnit::read_shard`]): each entry knows which
//! elements of its single-device tensor it is (a tensor-parallel piece: [`Region::runs`]), so
//! the shard's part of it is [`sub_runs`] of those, and no rank ever creates a full unit. At
//! stage 3 the parameters themselves may be empty placeholders from the start.
//!
//! Legend: `numel` elements of the unit, `padded` = numel rounded up to dp, `shard` = padded / dp.

use std::collections::BTreeMap;
use std::ops::Range;

use candle_core::{DType, Device, Result, Shape, Tensor};
use mtrain_comm::Comm;
use mtrain_model::source::{runs_len, sub_runs, ParamSource, Piece};
use mtrain_model::{Grads, Param};

use super::Fsdp;
use crate::ddp::DpError;
use crate::toolbox::decays;

/// What a parameter of a unit is: its shape on this rank and which elements of its
/// single-device tensor those are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Region {
    /// The shape this rank holds (a tensor-parallel piece, or the whole tensor).
    pub shape: Vec<usize>,
    /// The single-device shape.
    pub full_shape: Vec<usize>,
    /// Row-major element runs of the single-device tensor, in the local tensor's order
    /// ([`crate::placement::Placement::runs`]).
    pub runs: Vec<Range<usize>>,
}

impl Region {
    /// The whole of a tensor of `shape`.
    pub fn whole(shape: &[usize]) -> Region {
        Region {
            shape: shape.to_vec(),
            full_shape: shape.to_vec(),
            runs: vec![0..shape.iter().product()],
        }
    }
}

/// Where one parameter sits in the flat buffer, and which elements of its single-device tensor
/// it holds.
pub(crate) struct Entry {
    pub param: Param,
    pub shape: Shape,
    pub offset: usize,
    pub numel: usize,
    pub full_shape: Vec<usize>,
    pub runs: Vec<Range<usize>>,
}

/// One segment's parameters, flattened and sharded.
pub(crate) struct FlatUnit {
    /// Decayed parameters first, then the others.
    pub entries: Vec<Entry>,
    pub numel: usize,
    pub padded: usize,
    /// This rank's shard is flat elements `[start, start + shard)`: `len_decay` decayed ones,
    /// then `len_plain` others, then `pad` zeros.
    start: usize,
    shard: usize,
    len_decay: usize,
    len_plain: usize,
    pad: usize,
    dtype: DType,
    device: Device,
    /// The dtype gradients are reduce-scattered and kept in (the parameters' dtype unless
    /// mixed precision asks for f32).
    pub reduce_dtype: DType,
    /// The two pieces of this rank's shard, as parameters the optimizer updates.
    pub decay_shard: Option<Param>,
    pub plain_shard: Option<Param>,
    /// The averaged gradient of those pieces, once reduce-scattered.
    pub grad_decay: Option<Tensor>,
    pub grad_plain: Option<Tensor>,
}

impl FlatUnit {
    /// Lays out `params` (each with its [`Region`]; their values are not read, so they may be
    /// placeholders of their dtype) and keeps rank `rank`'s shard, read from `source`.
    pub fn new(
        name: &str,
        params: Vec<(Param, Region)>,
        rank: usize,
        dp: usize,
        device: &Device,
        source: &dyn ParamSource,
    ) -> Result<FlatUnit> {
        let dtype = params.first().map_or(DType::F32, |(p, _)| p.var().dtype());
        let (decayed, plain): (Vec<_>, Vec<_>) =
            params.into_iter().partition(|(_, r)| decays(&r.shape));
        let n_decay: usize = decayed.iter().map(|(_, r)| r.shape.iter().product::<usize>()).sum();
        let mut entries = Vec::new();
        let mut offset = 0;
        for (param, region) in decayed.into_iter().chain(plain) {
            let numel = region.shape.iter().product();
            if runs_len(&region.runs) != numel {
                candle_core::bail!(
                    "`{}`: runs of {} elements for a local shape {:?}",
                    param.name(),
                    runs_len(&region.runs),
                    region.shape
                );
            }
            entries.push(Entry {
                shape: Shape::from(region.shape),
                param,
                offset,
                numel,
                full_shape: region.full_shape,
                runs: region.runs,
            });
            offset += numel;
        }
        let numel = offset;
        let padded = numel.div_ceil(dp) * dp;
        let shard = padded / dp;
        let (start, end) = (rank * shard, (rank + 1) * shard);
        let len_decay = end.min(n_decay).saturating_sub(start);
        let len_plain = end.min(numel).saturating_sub(start.max(n_decay));
        let mut unit = FlatUnit {
            entries,
            numel,
            padded,
            start,
            shard,
            len_decay,
            len_plain,
            pad: shard - len_decay - len_plain,
            dtype,
            reduce_dtype: dtype,
            device: device.clone(),
            decay_shard: None,
            plain_shard: None,
            grad_decay: None,
            grad_plain: None,
        };
        let (decay, plain) = unit.split(&unit.read_shard(source, dtype)?)?;
        unit.decay_shard = decay
            .map(|t| Param::new(format!("{name}.flat.decay"), t))
            .transpose()?;
        unit.plain_shard = plain
            .map(|t| Param::new(format!("{name}.flat.no_decay"), t))
            .transpose()?;
        Ok(unit)
    }

    /// This rank's shard (shard,) in `dtype`, read from `source`: each entry's part of the
    /// shard's flat range as runs of its single-device tensor, then the padding's zeros.
    pub fn read_shard(&self, source: &dyn ParamSource, dtype: DType) -> Result<Tensor> {
        let mut data = Vec::with_capacity(self.shard);
        for (e, part) in self.shard_parts() {
            let runs = sub_runs(&e.runs, part);
            data.extend(source.read(e.param.name(), &e.full_shape, &runs)?);
        }
        data.resize(self.shard, 0.0);
        Tensor::from_vec(data, self.shard, &self.device)?.to_dtype(dtype)
    }

    /// The entries this rank's shard overlaps, each with the overlap as positions in the
    /// entry's local tensor, in shard order.
    fn shard_parts(&self) -> impl Iterator<Item = (&Entry, Range<usize>)> {
        let (lo, hi) = (self.start, self.start + self.shard);
        self.entries.iter().filter_map(move |e| {
            let (a, b) = (lo.max(e.offset), hi.min(e.offset + e.numel));
            (a < b).then(|| (e, a - e.offset..b - e.offset))
        })
    }

    /// What the shard holds as [`Piece`]s: per overlapped entry, its runs of the single-device
    /// tensor and where they sit in the decayed or the not-decayed shard piece.
    pub fn pieces(&self) -> Vec<Piece> {
        let mut out = Vec::new();
        let mut at = 0; // position in the shard
        for (e, part) in self.shard_parts() {
            let (local, offset) = match at < self.len_decay {
                true => (self.piece_names()[0], at),
                false => (self.piece_names()[1], at - self.len_decay),
            };
            out.push(Piece {
                name: e.param.name().to_string(),
                full_shape: e.full_shape.clone(),
                runs: sub_runs(&e.runs, part.clone()),
                local: local.unwrap_or_default().to_string(),
                offset,
            });
            at += part.len();
        }
        out
    }

    /// The parameters' dtype (what the shards hold and the all-gathers move).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes of the unit's full (padded) flat buffer.
    pub fn full_bytes(&self) -> usize {
        self.padded * self.dtype.size_in_bytes()
    }

    /// Names of the shard pieces (the optimizer's state keys), decayed one first.
    pub fn piece_names(&self) -> [Option<&str>; 2] {
        [
            self.decay_shard.as_ref().map(|p| p.name()),
            self.plain_shard.as_ref().map(|p| p.name()),
        ]
    }

    /// One tensor per entry, by name (zeros where `part` has none), laid out flat in `dtype`:
    /// (padded,). A tensor whose element count differs from its entry's is an error naming it.
    pub fn flatten(&self, dtype: DType, part: impl Fn(&Entry) -> Option<Tensor>) -> Result<Tensor> {
        let mut parts = Vec::with_capacity(self.entries.len() + 1);
        for e in &self.entries {
            let t = match part(e) {
                Some(t) if t.elem_count() == e.numel => t.flatten_all()?.to_dtype(dtype)?,
                Some(t) => candle_core::bail!(
                    "`{}` has shape {:?} but the model's parameter has {:?}",
                    e.param.name(),
                    t.dims(),
                    e.shape.dims()
                ),
                None => Tensor::zeros(e.numel, dtype, &self.device)?,
            };
            parts.push(t);
        }
        parts.push(Tensor::zeros(
            self.padded - self.numel,
            dtype,
            &self.device,
        )?);
        Tensor::cat(&parts, 0)
    }

    /// This rank's part of a flat buffer: (padded,) -> (shard,).
    pub fn my_slice(&self, flat: &Tensor) -> Result<Tensor> {
        flat.narrow(0, self.start, self.shard)?.copy()
    }

    /// Splits a shard (shard,) into its decayed and not-decayed pieces (the padding is dropped).
    pub fn split(&self, shard: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let decay = (self.len_decay > 0)
            .then(|| shard.narrow(0, 0, self.len_decay))
            .transpose()?;
        let plain = (self.len_plain > 0)
            .then(|| shard.narrow(0, self.len_decay, self.len_plain))
            .transpose()?;
        Ok((decay, plain))
    }

    /// Joins the two pieces (zeros for a missing one) and the padding into a shard in `dtype`:
    /// (shard,).
    pub fn join(
        &self,
        dtype: DType,
        decay: Option<Tensor>,
        plain: Option<Tensor>,
    ) -> Result<Tensor> {
        let or_zeros = |t: Option<Tensor>, n: usize| {
            t.map_or_else(
                || Tensor::zeros(n, dtype, &self.device),
                |t| t.to_dtype(dtype),
            )
        };
        let parts = [
            or_zeros(decay, self.len_decay)?,
            or_zeros(plain, self.len_plain)?,
            Tensor::zeros(self.pad, dtype, &self.device)?,
        ];
        Tensor::cat(&parts, 0)
    }

    /// This rank's shard of the parameters: (shard,).
    pub fn param_shard(&self) -> Result<Tensor> {
        let get = |p: &Option<Param>| p.as_ref().map(|p| p.tensor().detach());
        self.join(self.dtype, get(&self.decay_shard), get(&self.plain_shard))
    }

    /// This rank's shard of the averaged gradient: (shard,).
    pub fn grad_shard(&self) -> Result<Tensor> {
        self.join(
            self.reduce_dtype,
            self.grad_decay.clone(),
            self.grad_plain.clone(),
        )
    }

    /// Elements in this rank's shard, its padding included.
    pub fn shard_len(&self) -> usize {
        self.shard
    }

    /// Elements `r` of [`FlatUnit::grad_shard`], read from its pieces without joining them
    /// (zeros where nothing was reduced, and in the padding): (r,).
    pub fn grad_shard_part(&self, r: Range<usize>) -> Result<Tensor> {
        let (d, p) = (self.len_decay, self.len_plain);
        let pieces = [(0, d, &self.grad_decay), (d, p, &self.grad_plain), (d + p, self.pad, &None)];
        let mut parts = Vec::with_capacity(3);
        for (at, len, g) in pieces {
            let (a, b) = (r.start.max(at), r.end.min(at + len));
            if a < b {
                parts.push(match g {
                    Some(g) => g.narrow(0, a - at, b - a)?.to_dtype(self.reduce_dtype)?,
                    None => Tensor::zeros(b - a, self.reduce_dtype, &self.device)?,
                });
            }
        }
        Tensor::cat(&parts, 0)
    }

    /// `weight(name)` of each element `r` of this rank's shard as f32, the parameter's it
    /// belongs to (0 in the padding): (r,).
    pub fn shard_weights(&self, r: Range<usize>, weight: impl Fn(&str) -> f64) -> Result<Tensor> {
        let runs = self.shard_parts().map(|(e, part)| (part.len(), weight(e.param.name()) as f32));
        let mut parts = Vec::new();
        let mut at = 0;
        for (len, w) in runs.chain([(self.pad, 0.0)]) {
            let (a, b) = (r.start.max(at), r.end.min(at + len));
            if a < b {
                parts.push(Tensor::full(w, b - a, &self.device)?);
            }
            at += len;
        }
        Tensor::cat(&parts, 0)
    }

    /// The unit's full gradient from `grads` (zeros for a parameter without one) in the reduce
    /// dtype: (padded,).
    pub fn flat_grad(&self, grads: &Grads) -> Result<Tensor> {
        self.flatten(self.reduce_dtype, |e| grads.get(e.param.name()).cloned())
    }

    /// Adds a reduce-scattered gradient shard (shard,) to the stored pieces.
    pub fn add_grad_shard(&mut self, shard: &Tensor) -> Result<()> {
        let (decay, plain) = self.split(&shard.to_dtype(self.reduce_dtype)?)?;
        let add = |old: Option<Tensor>, new: Option<Tensor>| -> Result<Option<Tensor>> {
            match (old, new) {
                (Some(o), Some(n)) => Ok(Some((o + n)?)),
                (o, n) => Ok(n.or(o)),
            }
        };
        self.grad_decay = add(self.grad_decay.take(), decay)?;
        self.grad_plain = add(self.grad_plain.take(), plain)?;
        Ok(())
    }

    /// Cuts a gathered buffer (padded,) into the original tensors, paired with their entries.
    pub fn unflatten(&self, flat: &Tensor) -> Result<Vec<(&Entry, Tensor)>> {
        let cut = |e: &Entry| flat.narrow(0, e.offset, e.numel)?.reshape(e.shape.clone());
        self.entries.iter().map(|e| Ok((e, cut(e)?))).collect()
    }
}

impl Fsdp {
    /// What this rank's shards hold, as pieces of the single-device parameters (see
    /// [`FlatUnit::pieces`]); the optimizer's moments and the fp32 masters are keyed and cut
    /// alike.
    pub fn pieces(&self) -> Vec<Piece> {
        self.units.iter().flat_map(|u| u.pieces()).collect()
    }

    /// This rank's shard pieces by name (`<segment>.flat.decay`, `<segment>.flat.no_decay`).
    pub fn shard_pieces(&self) -> BTreeMap<String, Tensor> {
        let pieces = self.units.iter().flat_map(|u| [&u.decay_shard, &u.plain_shard]);
        pieces
            .flatten()
            .map(|p| (p.name().to_string(), p.tensor().detach()))
            .collect()
    }
}

/// That every rank of `comm` laid out the same units (element counts per unit): ranks that built
/// different models, whose shards would not fit together, are refused before any shard moves.
pub(super) fn verify_same_units(comm: &Comm, units: &[FlatUnit]) -> crate::ddp::Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    let sizes: Vec<i64> = units.iter().map(|u| u.numel as i64).collect();
    let n = sizes.len();
    let all = comm
        .all_gather(&Tensor::from_vec(sizes, n, comm.device())?)?
        .to_vec1::<i64>()?;
    for rank in 1..comm.size() {
        if let Some(u) = (0..n).find(|&u| all[rank * n + u] != all[u]) {
            return Err(DpError::Config(format!(
                "rank {rank}'s ZeRO unit {u} has {} elements but rank 0's has {}; every rank \
                 must build the same model",
                all[rank * n + u],
                all[u]
            )));
        }
    }
    Ok(())
}

/// Each parameter's [`Region`] when it is whole: its current shape, read from the values
/// themselves (`values`: the parameters' tensors by name, as a source for the shards).
pub(super) fn whole_regions(params: &[Param]) -> (BTreeMap<String, Tensor>, BTreeMap<String, Region>) {
    let values = params
        .iter()
        .map(|p| (p.name().to_string(), p.tensor().detach()))
        .collect();
    let regions = params
        .iter()
        .map(|p| (p.name().to_string(), Region::whole(p.shape().dims())))
        .collect();
    (values, regions)
}
