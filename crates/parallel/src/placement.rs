//! Which slice of which parameter each rank holds under a plan: pure rules on GPT-2 names,
//! written once here and used by the tensor-parallel builder, the composed model's norm and
//! state, the cost model and the trainer's memory figures.
//!
//! A parameter's place has three coordinates, one per way the model is cut:
//!
//! ```text
//!   tp     tp_placement: a slice of wte (vocabulary rows), of each column layer (c_attn: the
//!          same heads of q | k | v, c_fc: output rows) or of each row layer's weight (c_proj:
//!          input columns); everything else whole on every tp rank, its gradient a partial sum
//!          under sequence parallelism (sp_partial)
//!   pp     stage_of: the model stage of its block (wte, wpe: stage 0; ln_f: the last); the
//!          tied wte is used by the last stage too (TIED)
//!   ep     expert_of: an expert lives on ep rank e / (E / ep) only
//! ```
//!
//! The dp coordinate is the strategy's (DDP replicates, ZeRO shards the flat segment), so it is
//! not a rule of names. [`owner_of`] combines the three into the world rank that holds a
//! parameter's reference copy.
//!
//! Legend: `V` vocabulary, `C` width, `E` experts, `S` model stages.

use std::ops::Range;

use mtrain_comm::MeshDims;
use mtrain_model::GptConfig;

use crate::pipeline::StageLayout;

/// The parameter both ends of the model use: the token embedding and the LM head.
pub const TIED: &str = "wte.weight";

/// How one parameter is laid out over the tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// The full tensor on every rank. `partial_grad`: each rank's gradient is only its part of the
    /// total (sequence parallelism: the rank saw 1/tp of the tokens) and must be summed over tp.
    Replicated { partial_grad: bool },
    /// Split along `dim`, which is viewed as `blocks` equal blocks; rank r holds chunk r of each.
    Sharded { dim: usize, blocks: usize },
}

impl Placement {
    /// Elements of a tensor of `numel` elements one rank of a `tp` group holds.
    pub fn local_numel(self, numel: usize, tp: usize) -> usize {
        match self {
            Placement::Sharded { .. } => numel / tp.max(1),
            Placement::Replicated { .. } => numel,
        }
    }

    /// The piece rank `rank` of a `size`-rank group holds, as row-major element ranges of the
    /// full tensor of shape `full`, in the piece's own row-major order (what
    /// [`crate::tensor_parallel::shard::shard`] cuts; a [`mtrain_model::source::ParamSource`] reads it).
    ///
    /// ```text
    ///   Sharded { dim: 0, blocks: 3 }, (6, 2), rank 1 of 2: rows 1, 3, 5 → [2..4, 6..8, 10..12]
    ///   Sharded { dim: 1, blocks: 1 }, (2, 4), rank 1 of 2: columns 2, 3 → [2..4, 6..8]
    /// ```
    pub fn runs(self, full: &[usize], rank: usize, size: usize) -> Vec<Range<usize>> {
        let numel: usize = full.iter().product();
        let (dim, blocks) = match self {
            Placement::Sharded { dim, blocks } if size > 1 => (dim, blocks),
            _ => return vec![0..numel],
        };
        let outer: usize = full[..dim].iter().product(); // index blocks before `dim`
        let inner: usize = full[dim + 1..].iter().product(); // elements of one index of `dim`
        let (block, chunk) = (full[dim] / blocks, full[dim] / blocks / size);
        let mut runs = Vec::with_capacity(outer * blocks);
        for o in 0..outer {
            for b in 0..blocks {
                let first = b * block + rank * chunk; // first index of `dim` this rank keeps
                let start = (o * full[dim] + first) * inner;
                runs.push(start..start + chunk * inner);
            }
        }
        runs
    }
}

/// The tensor-parallel split rule (Megatron's): `wte` by vocabulary rows (V/tp, C); column
/// layers by output rows, `c_attn` as three blocks q | k | v so a rank keeps the same heads of
/// each (3C/tp, C) and `c_fc` (4C/tp, C), biases alike; row layers' weights by input columns
/// (`c_proj`: (C, C/tp) and (C, 4C/tp)). Everything else, row biases included, is whole on every
/// rank, and under `sequence_parallel` its gradient is partial (the rank saw 1/tp of the tokens).
/// Experts are never tensor-parallel: expert parallelism splits them.
pub fn tp_placement(name: &str, sequence_parallel: bool) -> Placement {
    if is_expert_param(name) {
        return Placement::Replicated {
            partial_grad: false,
        };
    }
    if name == TIED {
        Placement::Sharded { dim: 0, blocks: 1 }
    } else if name.contains(".c_attn.") {
        Placement::Sharded { dim: 0, blocks: 3 }
    } else if name.contains(".c_fc.") {
        Placement::Sharded { dim: 0, blocks: 1 }
    } else if name.ends_with(".c_proj.weight") {
        Placement::Sharded { dim: 1, blocks: 1 }
    } else {
        Placement::Replicated {
            partial_grad: sequence_parallel,
        }
    }
}

/// The sizes [`tp_placement`] splits, so the ones tp must divide: the heads (c_attn's q | k | v
/// and c_proj's input), the MLP width (c_fc and its c_proj) and the vocabulary (wte).
pub fn tp_split_sizes(cfg: &GptConfig) -> [(&'static str, usize); 3] {
    [
        ("n_head", cfg.n_head),
        ("4 * n_embd", 4 * cfg.n_embd),
        ("vocab_size", cfg.vocab_size),
    ]
}

/// Every reason `cfg` does not split over `tp` ranks, empty when it does: tp divides each of
/// [`tp_split_sizes`], and the model has no experts (those are split by ep). The plan's check
/// and the tensor-parallel builder's both read it.
pub fn tp_problems(cfg: &GptConfig, tp: usize) -> Vec<String> {
    if tp == 0 {
        return vec!["tp must be at least 1, got 0".into()];
    }
    let mut why = Vec::new();
    if cfg.moe.is_some() {
        why.push(format!(
            "tp {tp} with an MoE model: expert blocks are split by --ep, not tensor parallelism"
        ));
    }
    for (what, value) in tp_split_sizes(cfg) {
        if !value.is_multiple_of(tp) {
            why.push(format!("{what} {value} is not divisible by tp {tp}"));
        }
    }
    why
}

/// Whether `name`'s gradient is a partial sum over tp under sequence parallelism (LayerNorms,
/// `wpe`, row-parallel biases): [`tp_placement`]'s replicated parameters.
pub fn sp_partial(name: &str) -> bool {
    tp_placement(name, true) == Placement::Replicated { partial_grad: true }
}

/// Whether a parameter belongs to an expert (`h.{i}.moe.experts.{e}.…`).
pub fn is_expert_param(name: &str) -> bool {
    expert_of(name).is_some()
}

/// The expert index e of an expert's parameter (`h.{i}.moe.experts.{e}.…`).
pub fn expert_of(name: &str) -> Option<usize> {
    split_expert_name(name).map(|(_, e, _)| e)
}

/// An expert's parameter name taken apart, the one parse of the expert naming:
/// `h.0.moe.experts.3.c_fc.weight` → (`h.0`, 3, `c_fc.weight`).
pub fn split_expert_name(name: &str) -> Option<(&str, usize, &str)> {
    let (block, rest) = name.split_once(".moe.experts.")?;
    let (e, field) = rest.split_once('.')?;
    Some((block, e.parse().ok()?, field))
}

/// The ep rank holding expert `e` of `n_experts` split over `ep` ranks (E/ep consecutive each).
pub fn ep_rank_of_expert(e: usize, n_experts: usize, ep: usize) -> usize {
    e / (n_experts / ep.max(1)).max(1)
}

/// The block index i of a block's parameter (`h.{i}.…`).
pub fn block_of(name: &str) -> Option<usize> {
    name.strip_prefix("h.")?.split('.').next()?.parse().ok()
}

/// The model stage whose segments hold `name`: its block's stage, stage 0 for the embedding
/// (`wte`, `wpe`), the last stage for the final LayerNorm. The tied [`TIED`] is also used by
/// the last stage ([`used_on_stage`]).
pub fn stage_of(name: &str, layout: &StageLayout) -> usize {
    let last = layout.num_stages().saturating_sub(1);
    if name.starts_with("ln_f.") {
        return last;
    }
    match block_of(name) {
        Some(i) => (0..=last)
            .find(|&s| layout.blocks(s).contains(&i))
            .unwrap_or(0),
        None => 0,
    }
}

/// Whether model stage `stage` uses `name`: its own stage, and the last one for the tied `wte`.
pub fn used_on_stage(name: &str, stage: usize, layout: &StageLayout) -> bool {
    stage_of(name, layout) == stage || (name == TIED && stage + 1 == layout.num_stages())
}

/// The world rank holding the reference copy of `name` (dp 0, tp 0, the pp rank of its stage,
/// an expert's ep rank): the root `full_state` broadcasts it from. `n_experts` is the model's
/// expert count (0 for a dense model).
pub fn owner_of(name: &str, dims: MeshDims, layout: &StageLayout, n_experts: usize) -> usize {
    let pp_idx = layout.rank_of_stage(stage_of(name, layout), dims.pp);
    let dp_idx = match (expert_of(name), dims.ep > 1 && n_experts > 0) {
        (Some(e), true) => ep_rank_of_expert(e, n_experts, dims.ep),
        _ => 0,
    };
    dims.rank_of(dp_idx, pp_idx, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_split_rule_names_every_kind_of_parameter() {
        let sharded = |dim, blocks| Placement::Sharded { dim, blocks };
        assert_eq!(tp_placement("wte.weight", false), sharded(0, 1));
        assert_eq!(tp_placement("h.3.attn.c_attn.weight", false), sharded(0, 3));
        assert_eq!(tp_placement("h.3.attn.c_attn.bias", false), sharded(0, 3));
        assert_eq!(tp_placement("h.0.mlp.c_fc.bias", false), sharded(0, 1));
        assert_eq!(tp_placement("h.0.mlp.c_proj.weight", false), sharded(1, 1));
        assert_eq!(tp_placement("h.0.attn.c_proj.weight", true), sharded(1, 1));
        let partial = Placement::Replicated { partial_grad: true };
        for name in [
            "wpe.weight",
            "h.1.ln_2.bias",
            "ln_f.weight",
            "h.1.mlp.c_proj.bias",
        ] {
            assert_eq!(tp_placement(name, true), partial, "{name}");
            assert!(sp_partial(name), "{name}");
        }
        assert!(!sp_partial("h.1.mlp.c_fc.weight"));
        assert!(!sp_partial("h.0.moe.experts.1.c_fc.weight"));
        assert_eq!(
            tp_placement("h.0.moe.experts.1.c_fc.weight", true),
            Placement::Replicated {
                partial_grad: false
            }
        );
    }

    #[test]
    fn runs_read_what_shard_cuts() -> candle_core::Result<()> {
        use candle_core::{Device, Tensor};
        use mtrain_model::source::ParamSource;
        use std::collections::BTreeMap;
        let cases = [
            (vec![12, 4], Placement::Sharded { dim: 0, blocks: 3 }, 2),
            (vec![6, 8], Placement::Sharded { dim: 1, blocks: 1 }, 4),
            (vec![12], Placement::Sharded { dim: 0, blocks: 3 }, 2),
            (vec![2, 6, 4], Placement::Sharded { dim: 1, blocks: 3 }, 2),
            (vec![5, 3], Placement::Replicated { partial_grad: false }, 2),
        ];
        for (shape, placement, size) in cases {
            let n: usize = shape.iter().product();
            let full = Tensor::arange(0f32, n as f32, &Device::Cpu)?.reshape(shape.clone())?;
            let map = BTreeMap::from([("w".to_string(), full.clone())]);
            for rank in 0..size {
                let piece = crate::tensor_parallel::shard::shard(&full, placement, rank, size)
                    .map_err(candle_core::Error::wrap)?;
                let runs = placement.runs(&shape, rank, size);
                let read = map.read("w", &shape, &runs)?;
                assert_eq!(read, piece.flatten_all()?.to_vec1::<f32>()?, "{shape:?} {placement:?} {rank}");
            }
        }
        Ok(())
    }

    #[test]
    fn stages_and_owners_follow_the_layout() {
        // 4 blocks over 2 stages: stage 0 = emb, h.0, h.1; stage 1 = h.2, h.3, head.
        let layout = StageLayout::even(4, 2).expect("layout");
        assert_eq!(stage_of("wte.weight", &layout), 0);
        assert_eq!(stage_of("h.1.ln_1.weight", &layout), 0);
        assert_eq!(stage_of("h.2.ln_1.weight", &layout), 1);
        assert_eq!(stage_of("ln_f.bias", &layout), 1);
        assert!(used_on_stage("wte.weight", 1, &layout));
        assert!(!used_on_stage("wpe.weight", 1, &layout));
        assert_eq!(expert_of("h.3.moe.experts.5.c_fc.weight"), Some(5));
        assert_eq!(expert_of("h.3.mlp.c_fc.weight"), None);
        // dp 2 x pp 2 x tp 2, ep 2: expert 3 of 4 lives on dp index 1.
        let dims = MeshDims {
            dp: 2,
            pp: 2,
            tp: 2,
            ep: 2,
            cp: 1,
        };
        assert_eq!(
            owner_of("h.3.moe.experts.3.c_fc.weight", dims, &layout, 4),
            6
        );
        assert_eq!(
            owner_of("h.3.moe.experts.1.c_fc.weight", dims, &layout, 4),
            2
        );
        assert_eq!(owner_of("ln_f.weight", dims, &layout, 0), 2);
        assert_eq!(owner_of("wte.weight", dims, &layout, 0), 0);
    }
}
