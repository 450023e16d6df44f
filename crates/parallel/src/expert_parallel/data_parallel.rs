//! Data parallelism around an expert-parallel model, as a standalone [`DataParallel`] strategy.
//!
//! [`ExpertDataParallel`] runs the block-wise engine, then the data-parallel average of
//! [`crate::ddp::average`] (dense gradients over dp, an expert's over its edp replicas, launched
//! asynchronously and waited in order after the backward: the simple schedule, not overlapped
//! with it). The global gradient norm counts each expert once by summing the experts' part over
//! ep ([`grad_norm_sq`]); `full_state` and `full_grads` gather the experts from the ep group so a
//! checkpoint holds the whole model.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use mtrain_comm::{Comm, ReduceOp};
use mtrain_model::optim::{AdamW, AdamWState, OptimItem};
use mtrain_model::{Engine, Grads, MoeStats, NoHooks, Param, Segment};

use super::{is_expert_param, Result};
use crate::ddp::average::sync_grads;
use crate::ddp::{verify_same_init, DataParallel, DpError};
use crate::placement::split_expert_name;
use crate::toolbox::{
    load_replicated, named_grads, named_weights, replicated_items, replicated_state_bytes,
    sq_sum_f64, sum_f64, unique_params, CommStats, ModelStateBytes,
};

/// Σ g² of the whole model's synced gradient, the same on every rank: non-expert gradients are
/// identical everywhere and counted once; each expert lives on one rank of the ep group, so the
/// experts' part is summed over `ep`.
pub fn grad_norm_sq(grads: &Grads, ep: &Comm) -> Result<f64> {
    let (mut dense, mut expert) = (0.0f64, 0.0f64);
    for (name, g) in grads.iter() {
        let sq = sq_sum_f64(g)?;
        match is_expert_param(name) {
            true => expert += sq,
            false => dense += sq,
        }
    }
    let experts = ep.all_reduce(&Tensor::new(&[expert], ep.device())?, ReduceOp::Sum)?;
    Ok(dense + experts.to_vec1::<f64>()?[0])
}

/// The expert load of the whole dp group: tokens kept per expert and drops, summed over the
/// ranks' routing groups (one `MoeStats` per MoE layer, as the engine reports them).
pub fn total_load(stats: &[MoeStats], dp: &Comm) -> Result<Vec<MoeStats>> {
    let flat: Vec<i64> = stats
        .iter()
        .flat_map(|s| {
            s.tokens_per_expert
                .iter()
                .map(|&n| n as i64)
                .chain([s.dropped as i64])
        })
        .collect();
    let n = flat.len();
    let sum = dp
        .all_reduce(&Tensor::from_vec(flat, n, dp.device())?, ReduceOp::Sum)?
        .to_vec1::<i64>()?;
    let mut out = Vec::with_capacity(stats.len());
    let mut at = 0;
    for s in stats {
        let e = s.tokens_per_expert.len();
        out.push(MoeStats {
            tokens_per_expert: sum[at..at + e].iter().map(|&v| v as usize).collect(),
            dropped: sum[at + e] as usize,
        });
        at += e + 1;
    }
    Ok(out)
}

/// Replaces this rank's expert tensors in `local` by every expert's, gathered over `ep`: the
/// local experts of one (block, field) are stacked, all-gathered, and split by global index.
fn gather_experts(local: BTreeMap<String, Tensor>, ep: &Comm) -> Result<BTreeMap<String, Tensor>> {
    let mut out = BTreeMap::new();
    // (block, field) -> [(expert, tensor)] in expert order; BTreeMap order is the same everywhere.
    let mut groups: BTreeMap<(String, String), Vec<(usize, Tensor)>> = BTreeMap::new();
    for (name, t) in local {
        match split_expert_name(&name) {
            Some((block, e, field)) => groups
                .entry((block.to_string(), field.to_string()))
                .or_default()
                .push((e, t)),
            None => {
                out.insert(name, t);
            }
        }
    }
    for ((block, field), mut experts) in groups {
        experts.sort_by_key(|(e, _)| *e);
        let el = experts.len();
        // Row r·E_l + j of the gathered stack is rank r's j-th expert: expert r·E_l + j in the
        // builder's contiguous layout, which is checked here.
        let owned: Vec<usize> = experts.iter().map(|(e, _)| *e).collect();
        let expected: Vec<usize> = (ep.rank() * el..(ep.rank() + 1) * el).collect();
        if owned != expected {
            return Err(super::EpError::Layout(format!(
                "{block}: ep rank {} holds experts {owned:?}, expected {expected:?}",
                ep.rank()
            )));
        }
        let stacked = Tensor::stack(
            &experts.iter().map(|(_, t)| t.clone()).collect::<Vec<_>>(),
            0,
        )?; // (E_l, …)
        let all = ep.all_gather(&stacked.contiguous()?)?; // (E, …)
        for e in 0..all.dim(0)? {
            out.insert(format!("{block}.moe.experts.{e}.{field}"), all.get(e)?);
        }
    }
    Ok(out)
}

fn dp_err(e: super::EpError) -> DpError {
    match e {
        super::EpError::Comm(c) => DpError::Comm(c),
        super::EpError::Candle(c) => DpError::Candle(c),
        other => DpError::Config(other.to_string()),
    }
}

/// Data parallelism over an expert-parallel model (segments from [`super::build_segments`]).
pub struct ExpertDataParallel {
    dp: Comm,
    ep: Comm,
    edp: Comm,
    segments: Vec<Arc<dyn Segment>>,
    params: Vec<Param>,
    grads: Grads,
    stats: Vec<MoeStats>,
    current: CommStats,
    last: CommStats,
}

impl ExpertDataParallel {
    /// Wraps this rank's segments. Checks (collectively) that non-expert weights agree over
    /// `dp` and expert weights over `edp`.
    pub fn new(
        segments: Vec<Arc<dyn Segment>>,
        dp: Comm,
        ep: Comm,
        edp: Comm,
    ) -> std::result::Result<Self, DpError> {
        let params = unique_params(&segments);
        let (experts, dense): (Vec<Param>, Vec<Param>) = params
            .iter()
            .cloned()
            .partition(|p| is_expert_param(p.name()));
        verify_same_init(&dp, &dense)?;
        verify_same_init(&edp, &experts)?;
        Ok(Self {
            dp,
            ep,
            edp,
            segments,
            params,
            grads: Grads::new(),
            stats: Vec::new(),
            current: CommStats::default(),
            last: CommStats::default(),
        })
    }

    /// This rank's parameters (every non-expert one, and its own experts).
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// Routing statistics of the micro-steps since the last optimizer step, summed per layer
    /// over micro-steps (this rank's tokens; see [`total_load`] for the whole group).
    pub fn local_load(&self) -> &[MoeStats] {
        &self.stats
    }
}

impl DataParallel for ExpertDataParallel {
    fn forward_backward(
        &mut self,
        engine: &Engine,
        idx: &Tensor,
        targets: &Tensor,
        loss_scale: f64,
        sync: bool,
    ) -> std::result::Result<f64, DpError> {
        let acts = engine.forward(&self.segments, idx, Some(targets), &mut NoHooks)?;
        let loss = sum_f64(&acts.output)?;
        if self.stats.is_empty() {
            self.stats = acts.stats.clone();
        } else {
            for (acc, s) in self.stats.iter_mut().zip(&acts.stats) {
                for (a, n) in acc.tokens_per_expert.iter_mut().zip(&s.tokens_per_expert) {
                    *a += n;
                }
                acc.dropped += s.dropped;
            }
        }
        let t = Instant::now();
        engine.backward(
            &self.segments,
            acts,
            None,
            loss_scale,
            &mut self.grads,
            &mut NoHooks,
        )?;
        self.current.backward_s += t.elapsed().as_secs_f64();
        if sync {
            let t = Instant::now();
            let (n, bytes) = sync_grads(&self.params, &mut self.grads, &self.dp, &self.edp)?;
            let waited = t.elapsed().as_secs_f64();
            self.current.exposed_comm_s += waited;
            self.current.comm_s += waited;
            self.current.collectives += n;
            self.current.bytes += bytes;
        }
        Ok(loss)
    }

    fn grad_norm_sq(&self) -> std::result::Result<f64, DpError> {
        grad_norm_sq(&self.grads, &self.ep).map_err(dp_err)
    }

    fn optimizer_items(&self) -> Vec<OptimItem<'_>> {
        replicated_items(&self.params, &self.grads)
    }

    fn after_optimizer_step(&mut self) -> std::result::Result<(), DpError> {
        self.grads.clear();
        self.stats.clear();
        self.last = std::mem::take(&mut self.current);
        Ok(())
    }

    fn full_state(&self) -> std::result::Result<BTreeMap<String, Tensor>, DpError> {
        gather_experts(named_weights(&self.params), &self.ep).map_err(dp_err)
    }

    fn full_grads(&self) -> std::result::Result<BTreeMap<String, Tensor>, DpError> {
        gather_experts(named_grads(&self.grads), &self.ep).map_err(dp_err)
    }

    fn model_state_bytes(&self, opt: &AdamW) -> ModelStateBytes {
        replicated_state_bytes(&self.params, &self.grads, opt)
    }

    fn comm_stats(&self) -> CommStats {
        self.last
    }

    fn load_full_state(
        &mut self,
        weights: &BTreeMap<String, Tensor>,
    ) -> std::result::Result<(), DpError> {
        Ok(load_replicated(&self.params, weights)?)
    }

    fn full_optimizer_state(&self, opt: &AdamW) -> std::result::Result<AdamWState, DpError> {
        let st = opt.state()?;
        Ok(AdamWState {
            step: st.step,
            m: gather_experts(st.m, &self.ep).map_err(dp_err)?,
            v: gather_experts(st.v, &self.ep).map_err(dp_err)?,
        })
    }

    fn shard_optimizer_state(&self, full: &AdamWState) -> std::result::Result<AdamWState, DpError> {
        let mine = |moments: &BTreeMap<String, Tensor>| -> BTreeMap<String, Tensor> {
            self.params
                .iter()
                .filter_map(|p| {
                    moments
                        .get(p.name())
                        .map(|t| (p.name().to_string(), t.clone()))
                })
                .collect()
        };
        Ok(AdamWState {
            step: full.step,
            m: mine(&full.m),
            v: mine(&full.v),
        })
    }
}
