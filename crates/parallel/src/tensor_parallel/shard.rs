//! Where each parameter of a tensor-parallel model lives, and how to go from full tensors to a
//! rank's shards and back.
//!
//! A parameter is either replicated (LayerNorms, `wpe`, the row-parallel biases) or sharded along
//! one dim, as [`crate::placement::tp_placement`] says. Sharding first views that dim as `blocks` equal blocks and gives rank r chunk r of
//! *each* block. `blocks = 1` is the plain Megatron split; `c_attn` uses `blocks = 3` because its
//! rows are q | k | v stacked, and a rank must own the same heads in all three:
//!
//! ```text
//!   c_attn.weight (3C, C), tp = 2              rank 0 keeps        rank 1 keeps
//!   ┌──────────┐                              ┌──────────┐        ┌──────────┐
//!   │ q heads 0│ ─────────────────────────►   │ q heads 0│        │ q heads 1│
//!   │ q heads 1│                              │ k heads 0│        │ k heads 1│
//!   │ k heads 0│   chunk r of each block      │ v heads 0│        │ v heads 1│
//!   │ k heads 1│                              └──────────┘        └──────────┘
//!   │ v heads 0│                               (3C/2, C)           (3C/2, C)
//!   │ v heads 1│
//!   └──────────┘
//! ```
//!
//! A rank's piece is a slice of the single-device tensor ([`shard`] cuts it from a full tensor;
//! [`Placement::runs`] names its elements, so a parameter source reads it alone), so a tp = N
//! model starts from the single-device numbers; [`ShardLayout::full_grads`] gathers a rank's gradients back into full
//! tensors by name, for comparisons and checkpoints.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};
use mtrain_comm::{Comm, ReduceOp};
use mtrain_model::Grads;

use super::{Result, TpError};
use crate::ops::{all_gather_along, comm_err};
pub use crate::placement::Placement;

/// A parameter's placement and its full shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardSpec {
    pub name: String,
    pub placement: Placement,
    pub full_shape: Vec<usize>,
}

/// The placement of every parameter of a tensor-parallel model on one rank.
#[derive(Debug, Clone, Default)]
pub struct ShardLayout {
    pub rank: usize,
    pub size: usize,
    specs: BTreeMap<String, ShardSpec>,
}

impl ShardLayout {
    pub fn new(rank: usize, size: usize) -> Self {
        Self {
            rank,
            size,
            specs: BTreeMap::new(),
        }
    }

    /// Records that `name` (single-device shape `full_shape`) is laid out by `placement`.
    pub fn register(&mut self, name: &str, full_shape: Vec<usize>, placement: Placement) {
        let name = name.to_string();
        let spec = ShardSpec {
            name: name.clone(),
            placement,
            full_shape,
        };
        self.specs.insert(name, spec);
    }

    /// Registers `name` with `placement` and returns this rank's piece of `full`.
    pub fn take(&mut self, name: &str, full: &Tensor, placement: Placement) -> Result<Tensor> {
        let local = shard(full, placement, self.rank, self.size).map_err(|e| match e {
            TpError::Candle(e) => TpError::Shard {
                name: name.to_string(),
                msg: e.to_string(),
            },
            TpError::Shard { msg, .. } => TpError::Shard {
                name: name.to_string(),
                msg,
            },
            other => other,
        })?;
        self.register(name, full.dims().to_vec(), placement);
        Ok(local)
    }

    /// The spec of `name`, if it is a parameter of this model.
    pub fn get(&self, name: &str) -> Option<&ShardSpec> {
        self.specs.get(name)
    }

    /// Every spec, in name order.
    pub fn specs(&self) -> impl Iterator<Item = &ShardSpec> {
        self.specs.values()
    }

    /// The full tensor of `name` from this rank's piece (a collective for sharded parameters:
    /// every rank of `group` must call it for the same name).
    pub fn gather_full(&self, name: &str, local: &Tensor, group: &Comm) -> Result<Tensor> {
        let spec = self
            .specs
            .get(name)
            .ok_or_else(|| TpError::UnknownParam(name.to_string()))?;
        match spec.placement {
            Placement::Replicated { .. } => Ok(local.clone()),
            Placement::Sharded { dim, blocks } => {
                let gathered = all_gather_along(group.as_ref(), local, dim)?; // rank pieces side by side
                Ok(unshard(&gathered, dim, blocks, self.size)?)
            }
        }
    }

    /// Full gradients by name from this rank's gradients (a collective over `group`, issued in
    /// name order). Replicated gradients are returned as they are: call
    /// [`ShardLayout::sync_partial_grads`] first when sequence parallelism is on.
    pub fn full_grads(&self, grads: &Grads, group: &Comm) -> Result<Grads> {
        let mut full = Grads::new();
        for (name, g) in grads.iter() {
            full.insert(name.clone(), self.gather_full(name, g, group)?);
        }
        Ok(full)
    }

    /// Σ g² over the full model's gradients (the squared global norm, for clipping), from this
    /// rank's gradients: sharded pieces are summed over `group`, replicated ones counted once.
    /// Call after [`ShardLayout::sync_partial_grads`]. A collective: every rank must call it.
    pub fn global_sq_norm(&self, grads: &Grads, group: &Comm) -> Result<f64> {
        let (mut sharded, mut replicated) = (0f64, 0f64);
        for (name, g) in grads.iter() {
            let spec = self
                .specs
                .get(name)
                .ok_or_else(|| TpError::UnknownParam(name.clone()))?;
            let sq = g
                .to_dtype(DType::F64)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f64>()?;
            match spec.placement {
                Placement::Sharded { .. } => sharded += sq,
                Placement::Replicated { .. } => replicated += sq,
            }
        }
        let local = Tensor::new(&[sharded as f32], group.device())?;
        let total = group.all_reduce(&local, ReduceOp::Sum).map_err(comm_err)?;
        Ok(total.to_vec1::<f32>()?[0] as f64 + replicated)
    }

    /// Sums over `group` the gradients that each rank holds only a part of (replicated parameters
    /// used on a sequence shard: LayerNorms, `wpe`, row-parallel biases under sequence
    /// parallelism), as Megatron does for its `sequence_parallel` parameters. One all-reduce of
    /// all of them flattened together; a no-op when there are none.
    pub fn sync_partial_grads(&self, grads: &mut Grads, group: &Comm) -> Result<()> {
        let names: Vec<String> = self
            .specs
            .values()
            .filter(|s| s.placement == Placement::Replicated { partial_grad: true })
            .filter(|s| grads.get(&s.name).is_some())
            .map(|s| s.name.clone())
            .collect();
        if names.is_empty() {
            return Ok(());
        }
        let mut flat = Vec::with_capacity(names.len());
        for n in &names {
            if let Some(g) = grads.get(n) {
                flat.push(g.flatten_all()?);
            }
        }
        let summed = group
            .all_reduce(&Tensor::cat(&flat, 0)?, ReduceOp::Sum)
            .map_err(comm_err)?;
        let mut offset = 0;
        for (n, piece) in names.iter().zip(&flat) {
            let len = piece.elem_count();
            let shape = grads
                .get(n)
                .map(|g| g.shape().clone())
                .unwrap_or_else(|| piece.shape().clone());
            grads.insert(n.clone(), summed.narrow(0, offset, len)?.reshape(shape)?);
            offset += len;
        }
        Ok(())
    }
}

/// Rank `rank`'s piece of `full` under `placement` (group of `size` ranks).
pub fn shard(full: &Tensor, placement: Placement, rank: usize, size: usize) -> Result<Tensor> {
    let (dim, blocks) = match placement {
        Placement::Replicated { .. } => return Ok(full.clone()),
        Placement::Sharded { dim, blocks } => (dim, blocks),
    };
    let len = full.dim(dim)?;
    if len % (blocks * size) != 0 {
        return Err(TpError::Shard {
            name: "(unnamed)".to_string(),
            msg: format!(
                "dim {dim} of size {len} does not split into {blocks} block(s) x tp {size}"
            ),
        });
    }
    let block = len / blocks;
    let chunk = block / size;
    let pieces = (0..blocks)
        .map(|b| full.narrow(dim, b * block + rank * chunk, chunk))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&pieces, dim)?) // (…, blocks·chunk, …)
}

/// The inverse of [`shard`]: `gathered` holds the ranks' pieces side by side along `dim`.
pub fn unshard(gathered: &Tensor, dim: usize, blocks: usize, size: usize) -> Result<Tensor> {
    let chunk = gathered.dim(dim)? / (blocks * size);
    let mut pieces = Vec::with_capacity(blocks * size);
    for b in 0..blocks {
        for r in 0..size {
            pieces.push(gathered.narrow(dim, (r * blocks + b) * chunk, chunk)?);
        }
    }
    Ok(Tensor::cat(&pieces, dim)?)
}
