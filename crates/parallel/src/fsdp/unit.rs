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
//! Legend: `numel` elements of the unit, `padded` = numel rounded up to dp, `shard` = padded / dp.

use candle_core::{Device, Result, Shape, Tensor};
use mtrain_model::{Grads, Param};

use crate::ddp::decays;

/// Where one parameter sits in the flat buffer.
pub(crate) struct Entry {
    pub param: Param,
    pub shape: Shape,
    pub offset: usize,
    pub numel: usize,
}

/// One segment's parameters, flattened and sharded.
pub(crate) struct FlatUnit {
    /// Decayed parameters first, then the others.
    pub entries: Vec<Entry>,
    pub numel: usize,
    pub padded: usize,
    /// This rank's shard: up to two pieces, then `pad` zeros.
    pub decay_shard: Option<Param>,
    pub plain_shard: Option<Param>,
    pub pad: usize,
    /// The averaged gradient of this rank's pieces, once reduce-scattered.
    pub grad_decay: Option<Tensor>,
    pub grad_plain: Option<Tensor>,
}

impl FlatUnit {
    /// Lays out `params` (full tensors, identical on every rank) and keeps rank `rank`'s shard.
    pub fn new(name: &str, params: Vec<Param>, rank: usize, dp: usize) -> Result<FlatUnit> {
        let (decayed, plain): (Vec<Param>, Vec<Param>) =
            params.into_iter().partition(|p| decays(p.shape().dims()));
        let n_decay: usize = decayed.iter().map(|p| p.elem_count()).sum();
        let mut entries = Vec::new();
        let mut offset = 0;
        for param in decayed.into_iter().chain(plain) {
            let numel = param.elem_count();
            entries.push(Entry {
                shape: param.shape(),
                param,
                offset,
                numel,
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
            decay_shard: None,
            plain_shard: None,
            pad: shard - len_decay - len_plain,
            grad_decay: None,
            grad_plain: None,
        };
        if numel > 0 {
            let flat = unit.flatten(|e| Ok(e.param.tensor().detach()))?; // (padded,)
            let mine = flat.narrow(0, start, shard)?; // (shard,)
            if len_decay > 0 {
                unit.decay_shard = Some(Param::new(
                    format!("{name}.flat.decay"),
                    mine.narrow(0, 0, len_decay)?.copy()?,
                )?);
            }
            if len_plain > 0 {
                let p = mine.narrow(0, len_decay, len_plain)?.copy()?;
                unit.plain_shard = Some(Param::new(format!("{name}.flat.no_decay"), p)?);
            }
        }
        Ok(unit)
    }

    /// Concatenates one tensor per entry (flattened) plus the padding: (padded,).
    fn flatten(&self, mut part: impl FnMut(&Entry) -> Result<Tensor>) -> Result<Tensor> {
        let mut parts = Vec::with_capacity(self.entries.len() + 1);
        let mut like: Option<Tensor> = None;
        for e in &self.entries {
            let t = part(e)?.flatten_all()?;
            like.get_or_insert_with(|| t.clone());
            parts.push(t);
        }
        if self.padded > self.numel {
            if let Some(l) = &like {
                parts.push(Tensor::zeros(
                    self.padded - self.numel,
                    l.dtype(),
                    l.device(),
                )?);
            }
        }
        Tensor::cat(&parts, 0)
    }

    /// This rank's shard of the parameters as one tensor: (shard,).
    pub fn param_shard(&self, device: &Device) -> Result<Tensor> {
        let pieces = [&self.decay_shard, &self.plain_shard];
        self.shard_of(
            pieces
                .iter()
                .filter_map(|p| p.as_ref().map(|p| p.tensor().detach())),
            device,
        )
    }

    /// This rank's shard of the averaged gradient as one tensor: (shard,).
    pub fn grad_shard(&self, device: &Device) -> Result<Tensor> {
        let pieces = [&self.grad_decay, &self.grad_plain];
        self.shard_of(pieces.into_iter().flatten().cloned(), device)
    }

    fn shard_of(&self, pieces: impl Iterator<Item = Tensor>, device: &Device) -> Result<Tensor> {
        let mut parts: Vec<Tensor> = pieces.collect();
        let dtype = self
            .entries
            .first()
            .map_or(candle_core::DType::F32, |e| e.param.var().dtype());
        if self.pad > 0 || parts.is_empty() {
            parts.push(Tensor::zeros(self.pad, dtype, device)?);
        }
        Tensor::cat(&parts, 0)
    }

    /// The unit's full gradient from `grads` (zeros for a parameter without one): (padded,).
    pub fn flat_grad(&self, grads: &Grads) -> Result<Tensor> {
        self.flatten(|e| match grads.get(e.param.name()) {
            Some(g) => Ok(g.clone()),
            None => Tensor::zeros(e.numel, e.param.var().dtype(), e.param.var().device()),
        })
    }

    /// Adds a reduce-scattered gradient shard (shard,) to the stored pieces.
    pub fn add_grad_shard(&mut self, shard: &Tensor) -> Result<()> {
        let len_decay = self.decay_shard.as_ref().map_or(0, |p| p.elem_count());
        let len_plain = self.plain_shard.as_ref().map_or(0, |p| p.elem_count());
        let add = |old: &Option<Tensor>, new: Tensor| -> Result<Tensor> {
            match old {
                Some(o) => o + new,
                None => Ok(new),
            }
        };
        if len_decay > 0 {
            self.grad_decay = Some(add(&self.grad_decay, shard.narrow(0, 0, len_decay)?)?);
        }
        if len_plain > 0 {
            self.grad_plain = Some(add(
                &self.grad_plain,
                shard.narrow(0, len_decay, len_plain)?,
            )?);
        }
        Ok(())
    }

    /// Cuts a gathered buffer (padded,) into `(name, tensor)` pairs of the original shapes.
    pub fn unflatten(&self, flat: &Tensor) -> Result<Vec<(&Entry, Tensor)>> {
        self.entries
            .iter()
            .map(|e| {
                Ok((
                    e,
                    flat.narrow(0, e.offset, e.numel)?
                        .reshape(e.shape.clone())?,
                ))
            })
            .collect()
    }
}
