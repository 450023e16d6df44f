//! The layout-independent state of a composed model: every parameter, gradient and optimizer
//! moment as the one device would hold it, gathered from any plan and sliced back into any other.
//!
//! Every rank knows every name and shape from [`param_specs`]. Gathering goes down the cuts in
//! reverse: ZeRO shards are gathered over dp ([`crate::fsdp::Fsdp`]), tensor-parallel slices over tp
//! ([`crate::tensor_parallel::ShardLayout::gather_full`]), then each tensor is broadcast over the world from its owner
//! ([`crate::placement::owner_of`]: dp 0, tp 0, the pp rank of its stage, an expert's ep rank),
//! so every rank ends with the whole model. Loading slices the full tensors with the same
//! placement ([`crate::placement::tp_placement`] through the layout), then ZeRO keeps its shard
//! pieces. The optimizer moments and the fp32 masters travel the same way, so full tensors
//! gathered under one plan load under any other.
//!
//! This is its own module because it is the one part of the composed model that is not a
//! training step: parity tests use it, the loop never does. Checkpoints never gather: each rank
//! writes and reads its own pieces ([`crate::shards`]).

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};
use mtrain_model::init::param_specs;
use mtrain_model::source::{read_tensor, ParamSource, Piece};
use mtrain_model::optim::{AdamW, AdamWState};

use crate::fsdp::Region;
use crate::mixed_precision::MasterWeights;
use crate::placement::owner_of;
use crate::runtime::{FullReplicas, ParallelModel, Replicas, Result};
use crate::tensor_parallel::shard::shard;
use crate::toolbox::{set_weight, StateError};

impl ParallelModel {
    /// fp32 masters read from `fp32_weights`, cut like this rank's optimizer state (tp piece,
    /// then ZeRO shard pieces).
    pub(crate) fn attach_masters(&mut self, fp32_weights: &dyn ParamSource) -> Result<()> {
        let precision = self.plan.precision;
        if let Replicas::Zero(fsdp) = &mut self.replicas {
            fsdp.set_mixed_precision(precision, fp32_weights)?;
            return Ok(());
        }
        let mut local = BTreeMap::new();
        for p in &self.params {
            let r = self.region(p.name(), p.shape().dims());
            let device = self.world.device();
            let t = read_tensor(fp32_weights, p.name(), &r.full_shape, &r.runs, &r.shape, device)?;
            local.insert(p.name().to_string(), t);
        }
        if let Replicas::Full(f) = &mut self.replicas {
            f.masters = Some(MasterWeights::new(local)?);
        }
        Ok(())
    }

    /// Which elements of the single-device tensor `name` this rank's tensor of `shape` is: its
    /// tensor-parallel piece ([`crate::placement::Placement::runs`]), or the whole tensor.
    pub(crate) fn region(&self, name: &str, shape: &[usize]) -> Region {
        match self.layout.as_ref().and_then(|l| l.get(name)) {
            Some(spec) => Region {
                shape: shape.to_vec(),
                full_shape: spec.full_shape.clone(),
                runs: spec
                    .placement
                    .runs(&spec.full_shape, self.coords.tp, self.plan.dims.tp),
            },
            None => Region::whole(shape),
        }
    }

    /// What this rank holds, as pieces of the single-device parameters: each parameter's
    /// tensor-parallel piece (the whole tensor without tp), or under ZeRO the parts of its shard
    /// pieces. Weights, fp32 masters and AdamW moments are keyed and cut alike, so these say
    /// where each of them sits in [`ParallelModel::local_weights`] and the optimizer's state.
    pub fn pieces(&self) -> Vec<Piece> {
        if let Replicas::Zero(fsdp) = &self.replicas {
            return fsdp.pieces();
        }
        let piece = |p: &mtrain_model::Param| {
            let r = self.region(p.name(), p.shape().dims());
            Piece {
                name: p.name().to_string(),
                full_shape: r.full_shape,
                runs: r.runs,
                local: p.name().to_string(),
                offset: 0,
            }
        };
        self.params.iter().map(piece).collect()
    }

    /// This rank's weights as it holds them, keyed like [`ParallelModel::pieces`]' `local`
    /// (parameter names, or ZeRO shard pieces), in the compute dtype.
    pub fn local_weights(&self) -> BTreeMap<String, Tensor> {
        match &self.replicas {
            Replicas::Zero(fsdp) => fsdp.shard_pieces(),
            Replicas::Full(_) => self
                .params
                .iter()
                .map(|p| (p.name().to_string(), p.tensor().detach()))
                .collect(),
        }
    }

    /// From tensors of this rank's layout by name (full over dp) to every full tensor of the
    /// model on every rank: gather over tp, then one broadcast per name from its owner.
    fn assemble(&self, local: BTreeMap<String, Tensor>) -> Result<BTreeMap<String, Tensor>> {
        let mut mine = BTreeMap::new();
        for (name, t) in local {
            let full = match &self.layout {
                Some(l) => l.gather_full(&name, &t, &self.tp)?,
                None => t,
            };
            mine.insert(name, full);
        }
        let dtype = mine.values().next().map_or(DType::F32, |t| t.dtype());
        let me = self.world.rank();
        let mut out = BTreeMap::new();
        let layout = self.stages.layout();
        let n_experts = self.cfg.moe.as_ref().map_or(0, |m| m.n_experts);
        for (name, shape, _) in param_specs(&self.cfg) {
            let root = owner_of(&name, self.plan.dims, layout, n_experts);
            let x = match (root == me, mine.get(&name)) {
                (true, Some(t)) => t.to_dtype(dtype)?.contiguous()?,
                (true, None) => {
                    return Err(StateError::NotHeld {
                        rank: me,
                        name: name.clone(),
                    }
                    .into())
                }
                (false, _) => Tensor::zeros(shape, dtype, self.world.device())?,
            };
            out.insert(name, self.world.broadcast(&x, root)?);
        }
        Ok(out)
    }

    /// Every parameter as a full tensor by name, on every rank (a collective on all ranks).
    pub fn full_state(&self) -> Result<BTreeMap<String, Tensor>> {
        let local = match &self.replicas {
            Replicas::Full(FullReplicas {
                masters: Some(m), ..
            }) => m.tensors(),
            Replicas::Full(_) => self
                .params
                .iter()
                .map(|p| (p.name().to_string(), p.tensor().detach()))
                .collect(),
            Replicas::Zero(fsdp) => fsdp.full_state()?,
        };
        self.assemble(local)
    }

    /// Every parameter's reduced gradient as a full tensor by name, on every rank (a collective;
    /// valid between the last micro-step and the optimizer step).
    pub fn full_grads(&self) -> Result<BTreeMap<String, Tensor>> {
        let local = match &self.replicas {
            Replicas::Full(_) => self
                .grads
                .iter()
                .map(|(n, g)| (n.clone(), g.clone()))
                .collect(),
            Replicas::Zero(fsdp) => fsdp.full_grads()?,
        };
        self.assemble(local)
    }

    /// The optimizer state as one device would hold it (full moments by parameter name), on
    /// every rank (a collective).
    pub fn full_optimizer_state(&self, opt: &AdamW) -> Result<AdamWState> {
        let state = opt.state()?;
        if state.m.is_empty() {
            return Ok(state);
        }
        let (m, v) = match &self.replicas {
            Replicas::Full(_) => (state.m, state.v),
            Replicas::Zero(fsdp) => {
                let s = fsdp.full_optimizer_state(opt)?;
                (s.m, s.v)
            }
        };
        Ok(AdamWState {
            step: state.step,
            m: self.assemble(m)?,
            v: self.assemble(v)?,
        })
    }

    /// This rank's piece of each full tensor it holds (tp slice; ZeRO slices later).
    fn local_slices(
        &self,
        full: &BTreeMap<String, Tensor>,
        what: &'static str,
    ) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        for p in &self.params {
            let t = full.get(p.name()).ok_or_else(|| StateError::Missing {
                what,
                name: p.name().to_string(),
            })?;
            let t = match self.layout.as_ref().and_then(|l| l.get(p.name())) {
                Some(spec) => {
                    if t.dims() != spec.full_shape.as_slice() {
                        return Err(StateError::Shape {
                            what,
                            name: p.name().to_string(),
                            got: t.dims().to_vec(),
                            expected: spec.full_shape.clone(),
                        }
                        .into());
                    }
                    shard(t, spec.placement, self.coords.tp, self.plan.dims.tp)?
                }
                None => t.clone(),
            };
            out.insert(p.name().to_string(), t.to_device(self.world.device())?);
        }
        Ok(out)
    }

    /// Loads full weights by name (e.g. from [`ParallelModel::full_state`] under any plan).
    pub fn load_full_state(&mut self, full: &BTreeMap<String, Tensor>) -> Result<()> {
        let local = self.local_slices(full, "weight")?;
        match &mut self.replicas {
            Replicas::Full(f) => {
                for p in &self.params {
                    if let Some(t) = local.get(p.name()) {
                        set_weight(p, t)?;
                    }
                }
                if let Some(m) = &f.masters {
                    m.load(&local)?;
                }
            }
            Replicas::Zero(fsdp) => fsdp.load_full_state(&local)?,
        }
        Ok(())
    }

    /// Loads a full optimizer state (from [`ParallelModel::full_optimizer_state`] under any plan)
    /// into `opt`, keeping this rank's part.
    pub fn load_optimizer_state(&mut self, opt: &mut AdamW, full: &AdamWState) -> Result<()> {
        if full.m.is_empty() {
            opt.load_state(full.clone())?;
            return Ok(());
        }
        let local = AdamWState {
            step: full.step,
            m: self.local_slices(&full.m, "first moment")?,
            v: self.local_slices(&full.v, "second moment")?,
        };
        let state = match &self.replicas {
            Replicas::Full(_) => local,
            Replicas::Zero(fsdp) => fsdp.shard_optimizer_state(&local)?,
        };
        opt.load_state(state)?;
        Ok(())
    }
}
