//! ZeRO's shards read and written as full tensors: the layout-independent state (weights,
//! gradients, optimizer moments, each gathered whole or cut back into this rank's shard), the
//! gradient fix-ups of a composed plan, and the bytes this rank holds. Apart from the step's
//! gather → forward → free → gather → backward → reduce-scatter, which is [`super`] and
//! [`super::scheduler`].

use std::collections::{BTreeMap, BTreeSet};

use candle_core::{DType, Tensor};
use mtrain_comm::{Comm, ReduceOp};
use mtrain_kernels::reduce::sum_f64_in_pieces;
use mtrain_model::optim::{AdamW, AdamWState};

use super::unit::FlatUnit;
use super::{Fsdp, ZeroStage};
use crate::ddp::{DpError, Result};
use crate::toolbox::{CommStats, ModelStateBytes};

/// Per-rank model-state bytes the table above predicts for `n_params` fp32 parameters with Adam
/// on `dp` ranks (`None`: plain DDP), not counting the segments in flight.
pub fn analytic_model_state(
    stage: Option<ZeroStage>,
    n_params: usize,
    dp: usize,
) -> ModelStateBytes {
    let full = 4 * n_params;
    let shard = 4 * n_params.div_ceil(dp);
    match stage {
        None => ModelStateBytes {
            params: full,
            grads: full,
            optimizer: 2 * full,
        },
        Some(ZeroStage::One) => ModelStateBytes {
            params: full + shard,
            grads: full + shard,
            optimizer: 2 * shard,
        },
        Some(ZeroStage::Two) => ModelStateBytes {
            params: full + shard,
            grads: shard,
            optimizer: 2 * shard,
        },
        Some(ZeroStage::Three) => ModelStateBytes {
            params: shard,
            grads: shard,
            optimizer: 2 * shard,
        },
    }
}

impl Fsdp {
    /// Bytes of the fp32 master shards (0 without mixed precision).
    pub fn master_bytes(&self) -> usize {
        self.masters.as_ref().map_or(0, |m| m.bytes())
    }

    /// This rank's shard pieces, keyed like the optimizer's state (`<segment>.flat.decay`, ...),
    /// cut in f32 from full tensors by parameter name (moments, master weights).
    pub(super) fn slice_items(
        &self,
        full: &BTreeMap<String, Tensor>,
    ) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        if full.is_empty() {
            return Ok(out);
        }
        for u in self.units.iter().filter(|u| u.numel > 0) {
            let flat = u.flatten(DType::F32, |e| full.get(e.param.name()).cloned())?; // (padded,)
            let (decay, plain) = u.split(&u.my_slice(&flat)?)?;
            for (name, t) in u.piece_names().into_iter().zip([decay, plain]) {
                if let (Some(name), Some(t)) = (name, t) {
                    out.insert(name.to_string(), t);
                }
            }
        }
        Ok(out)
    }

    /// The reverse of [`Fsdp::slice_items`]: full f32 tensors by parameter name from shard pieces
    /// keyed like the optimizer's state (a collective over the data-parallel group).
    pub(super) fn gather_items(
        &self,
        items: &BTreeMap<String, Tensor>,
    ) -> Result<BTreeMap<String, Tensor>> {
        self.gather_full(|u| {
            let [d, p] = u.piece_names();
            let get = |n: Option<&str>| n.and_then(|n| items.get(n)).cloned();
            u.join(DType::F32, get(d), get(p))
        })
    }

    /// Bytes of unsharded state in flight at the worst moment of a step, on top of
    /// [`analytic_model_state`]: at stage 3 the gathered weights of a segment and of the one
    /// being prefetched (every unit's, kept from the forward to the backward, without
    /// `reshard_after_forward` and checkpointing); at stages 2 and 3 one unit's full gradient
    /// before its reduce-scatter.
    pub fn in_flight_bytes(&self) -> usize {
        let unit_bytes = |u: &FlatUnit| u.full_bytes();
        let mut worst = 0;
        if self.cfg.stage == ZeroStage::Three && !self.cfg.reshard_after_forward {
            worst = self.units.iter().map(unit_bytes).sum();
        } else if self.cfg.stage == ZeroStage::Three {
            for (c, i) in self
                .chunks
                .iter()
                .flat_map(|c| c.clone().map(move |i| (c, i)))
            {
                let mut live = self.needs[i].clone();
                if self.cfg.prefetch && c.contains(&(i + 1)) {
                    live.extend(&self.needs[i + 1]);
                }
                live.sort_unstable();
                live.dedup();
                worst = worst.max(live.iter().map(|&u| unit_bytes(&self.units[u])).sum());
            }
        }
        if self.cfg.stage >= ZeroStage::Two {
            worst += self.units.iter().map(unit_bytes).max().unwrap_or(0);
        }
        worst
    }

    /// Gathers each unit's shards of `shard_of` into full tensors by name (a collective).
    pub(super) fn gather_full(
        &self,
        shard_of: impl Fn(&FlatUnit) -> candle_core::Result<Tensor>,
    ) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        for u in self.units.iter().filter(|u| u.numel > 0) {
            let flat = self.comm.all_gather(&shard_of(u)?)?; // (padded,)
            for (e, t) in u.unflatten(&flat)? {
                out.insert(e.param.name().to_string(), t);
            }
        }
        Ok(out)
    }

    /// The reduced gradients of `names` as full tensors (a collective over the data-parallel
    /// group: all-gathers the units holding any of them).
    pub fn full_grads_of(&self, names: &BTreeSet<String>) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        for u in self.units.iter().filter(|u| unit_has(u, names)) {
            let flat = self.comm.all_gather(&u.grad_shard()?)?; // (padded,)
            for (e, t) in u.unflatten(&flat)? {
                if names.contains(e.param.name()) {
                    out.insert(e.param.name().to_string(), t);
                }
            }
        }
        Ok(out)
    }

    /// Adds full-tensor gradient contributions by name to this rank's gradient shards (local).
    pub fn add_full_grads(&mut self, delta: &BTreeMap<String, Tensor>) -> Result<()> {
        let names: BTreeSet<String> = delta.keys().cloned().collect();
        for u in self.units.iter_mut().filter(|u| unit_has(u, &names)) {
            let shard =
                u.my_slice(&u.flatten(u.reduce_dtype, |e| delta.get(e.param.name()).cloned())?)?; // (shard,)
            u.add_grad_shard(&shard)?;
        }
        Ok(())
    }

    /// Every parameter as a full tensor, by name (collective at stage 3: call on every rank).
    pub fn full_state(&self) -> Result<BTreeMap<String, Tensor>> {
        if let Some(m) = &self.masters {
            return self.gather_items(&m.tensors());
        }
        if self.cfg.stage == ZeroStage::Three {
            return self.gather_full(|u| u.param_shard());
        }
        let entries = self.units.iter().flat_map(|u| u.entries.iter());
        Ok(entries
            .map(|e| (e.param.name().to_string(), e.param.tensor().detach()))
            .collect())
    }

    /// Every parameter's averaged gradient as a full tensor, by name (a collective). Valid
    /// between the last micro-step and the optimizer step.
    pub fn full_grads(&self) -> Result<BTreeMap<String, Tensor>> {
        self.gather_full(|u| u.grad_shard())
    }

    /// Bytes of the parameters, gradients and optimizer moments this rank holds right now.
    pub fn model_state_bytes(&self, opt: &AdamW) -> ModelStateBytes {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let mut s = ModelStateBytes {
            params: 0,
            grads: 0,
            optimizer: opt.state_bytes() + self.masters.as_ref().map_or(0, |m| m.bytes()),
        };
        for u in &self.units {
            s.params += u
                .entries
                .iter()
                .map(|e| bytes(&e.param.tensor()))
                .sum::<usize>();
            s.params += [&u.decay_shard, &u.plain_shard]
                .into_iter()
                .flatten()
                .map(|p| bytes(&p.tensor()))
                .sum::<usize>();
            s.grads += [&u.grad_decay, &u.grad_plain]
                .into_iter()
                .flatten()
                .map(bytes)
                .sum::<usize>();
        }
        s.grads += self.grads.iter().map(|(_, g)| bytes(g)).sum::<usize>();
        s
    }

    /// Communication figures of the last completed optimizer step.
    pub fn comm_stats(&self) -> CommStats {
        self.last
    }

    /// Loads full weights by name (e.g. from a checkpoint) into this rank's shards.
    pub fn load_full_state(&mut self, weights: &BTreeMap<String, Tensor>) -> Result<()> {
        for u in self.units.iter().filter(|u| u.numel > 0) {
            for e in &u.entries {
                if !weights.contains_key(e.param.name()) {
                    return Err(DpError::Config(format!(
                        "no weight named `{}` to load",
                        e.param.name()
                    )));
                }
            }
            let flat = u.flatten(u.dtype(), |e| weights.get(e.param.name()).cloned())?; // (padded,)
            let (decay, plain) = u.split(&u.my_slice(&flat)?)?;
            for (p, t) in [(&u.decay_shard, decay), (&u.plain_shard, plain)] {
                if let (Some(p), Some(t)) = (p, t) {
                    p.set(&t)?;
                }
            }
            if self.cfg.stage != ZeroStage::Three {
                for (e, t) in u.unflatten(&flat)? {
                    e.param.set(&t)?;
                }
            }
        }
        if let Some(m) = &self.masters {
            m.load(&self.slice_items(weights)?)?;
        }
        Ok(())
    }

    /// The optimizer state as one device would hold it: every moment a full tensor under its
    /// parameter's name (a collective: call on every rank).
    pub fn full_optimizer_state(&self, opt: &AdamW) -> Result<AdamWState> {
        let state = opt.state()?;
        if state.m.is_empty() {
            // No step taken yet: nothing to gather (and nothing a single device would hold).
            return Ok(state);
        }
        Ok(AdamWState {
            step: state.step,
            m: self.gather_items(&state.m)?,
            v: self.gather_items(&state.v)?,
        })
    }

    /// This rank's part of a full optimizer state, ready for `AdamW::load_state`.
    pub fn shard_optimizer_state(&self, full: &AdamWState) -> Result<AdamWState> {
        Ok(AdamWState {
            step: full.step,
            m: self.slice_items(&full.m)?,
            v: self.slice_items(&full.v)?,
        })
    }
}

pub(super) fn unit_has(u: &FlatUnit, names: &BTreeSet<String>) -> bool {
    u.numel > 0 && u.entries.iter().any(|e| names.contains(e.param.name()))
}

/// The gradient shards seen by a composed plan: the norm's share of this rank, the sums over a
/// tensor-parallel group.
impl Fsdp {
    /// Σ w(name) · g² over this rank's reduced gradient shards (no communication): each element
    /// weighted by the weight of the parameter it belongs to. A shard is read a piece at a time
    /// ([`sum_f64_in_pieces`]): no f64 copy of it, nor a weight per element of its whole unit.
    pub fn local_grad_sq_norm(&self, weight: impl Fn(&str) -> f64) -> Result<f64> {
        let mut total = 0.0;
        for u in self.units.iter().filter(|u| u.numel > 0) {
            total += sum_f64_in_pieces(u.shard_len(), |r| {
                let w = u.shard_weights(r.clone(), &weight)?.to_dtype(DType::F64)?; // (r,)
                u.grad_shard_part(r)?.to_dtype(DType::F64)?.sqr()? * w // (r,)
            })?;
        }
        Ok(total)
    }

    /// Sums the gradient shards of `names` over `group`, leaving the others as they are (a
    /// collective over `group`, whose ranks must hold identically laid out units, as the ranks of
    /// a tensor-parallel group do).
    pub fn all_reduce_grads_of(&mut self, names: &BTreeSet<String>, group: &Comm) -> Result<()> {
        let device = self.comm.device().clone();
        for u in self.units.iter_mut().filter(|u| unit_has(u, names)) {
            let mask = u.my_slice(&u.flatten(u.reduce_dtype, |e| {
                names
                    .contains(e.param.name())
                    .then(|| Tensor::ones(e.numel, u_dtype(e), &device).ok())
                    .flatten()
            })?)?; // (shard,)
            let masked = (u.grad_shard()? * mask)?; // (shard,)
            let summed = group.all_reduce(&masked, ReduceOp::Sum)?;
            u.add_grad_shard(&(summed - masked)?)?;
        }
        Ok(())
    }
}

fn u_dtype(e: &super::unit::Entry) -> DType {
    e.param.var().dtype()
}
