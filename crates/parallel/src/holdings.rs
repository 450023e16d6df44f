//! Who holds what: one rank's part of the model under a plan, as a table, from the model
//! configuration, the plan and the rank's coordinates alone.
//!
//! ```text
//!   Holdings::of_rank(cfg, plan, coords)
//!     chunk   model stage s = k·pp + coords.pp, k < v   (the stages PipelineStages keeps)
//!       segment  0 = embedding, 1..=L the blocks, L+1 the head, in forward order
//!         Held   name, full and local shape, placement (tp), expert (ep), stage and owner,
//!                whether its gradient is a partial sum over tp (sequence parallelism)
//! ```
//!
//! Every rule comes from [`crate::placement`]: the tensor-parallel split ([`tp_placement`]),
//! the stage of a name, the ep rank of an expert, the owner of the reference copy. The dp
//! coordinate is the data-parallel strategy's (DDP replicates what the table lists, ZeRO shards
//! each segment's flat unit, one strategy over the rank's chunks, so a parameter two chunks use
//! is sharded once), so the table lists what a rank holds before ZeRO, each name once
//! ([`Holdings::unique`]: ZB-V's rank 0 lists the tied `wte` for both its chunks' segments).
//!
//! [`crate::parallelize()`] checks that the model it builds holds exactly this table; the cost
//! model, the trainer's memory model, `mtrain plan` and the per-rank parameter counts read it
//! instead of applying the rules themselves.
//!
//! Legend: `L` blocks, `v` virtual stages per pipeline rank.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use mtrain_comm::{Coords, MeshDims};
use mtrain_model::init::param_specs;
use mtrain_model::GptConfig;

use crate::placement::{
    block_of, ep_rank_of_expert, expert_of, owner_of, tp_placement, Placement, TIED,
};
use crate::plan::{DataParallelKind, ParallelPlan, PlanError};

/// One parameter as one rank holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// Its global name (`h.3.attn.c_attn.weight`), the same on every layout.
    pub name: String,
    /// The single-device shape.
    pub full_shape: Vec<usize>,
    /// The shape on this rank: the full shape cut along the placement's dim over tp.
    pub shape: Vec<usize>,
    /// How it is laid out over the tp group ([`tp_placement`] with the plan's sequence
    /// parallelism).
    pub placement: Placement,
    /// The expert it belongs to (`h.{i}.moe.experts.{e}.…`); an expert's parameters live on
    /// one ep rank and are averaged over edp.
    pub expert: Option<usize>,
    /// The model stage whose segments own it (the tied `wte`: stage 0).
    pub stage: usize,
    /// The world rank holding its reference copy ([`owner_of`]).
    pub owner: usize,
    /// Whether this rank's gradient is only its part of the total and is summed over tp.
    pub partial_grad: bool,
}

impl Held {
    /// Elements on this rank.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// One segment of a chunk: its index in `[embedding, h.0, …, h.(L−1), head]` and what it uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentHoldings {
    pub index: usize,
    /// Its parameters in the order the segment lists them (`Segment::params`).
    pub params: Vec<Held>,
}

/// One model stage this rank runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkHoldings {
    pub stage: usize,
    pub segments: Vec<SegmentHoldings>,
}

/// The table of one rank: its chunks in the order it runs them (chunk k is model stage
/// `k·pp + pp rank`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holdings {
    pub coords: Coords,
    /// Model stages S = pp · v.
    pub num_stages: usize,
    pub n_layer: usize,
    pub chunks: Vec<ChunkHoldings>,
}

impl Holdings {
    /// What the rank at `coords` holds under `plan` for the model `cfg`. The plan's stage
    /// layout must exist (a [`crate::plan::ValidPlan`] has one).
    pub fn of_rank(
        cfg: &GptConfig,
        plan: &ParallelPlan,
        coords: Coords,
    ) -> Result<Self, PlanError> {
        let layout = plan
            .stage_layout(cfg.n_layer)
            .map_err(|e| PlanError(e.to_string()))?;
        let dims = plan.dims;
        let (pp, tp, ep) = (dims.pp.max(1), dims.tp.max(1), dims.ep.max(1));
        let sp = plan.sequence_parallel && tp > 1;
        let n_experts = cfg.moe.as_ref().map_or(0, |m| m.n_experts);
        let specs = param_specs(cfg);
        let held = |name: &str, full_shape: &[usize]| -> Held {
            let placement = tp_placement(name, sp);
            let mut shape = full_shape.to_vec();
            if let Placement::Sharded { dim, .. } = placement {
                shape[dim] /= tp;
            }
            Held {
                name: name.to_string(),
                full_shape: full_shape.to_vec(),
                shape,
                placement,
                expert: expert_of(name),
                stage: crate::placement::stage_of(name, &layout),
                owner: owner_of(name, dims, &layout, n_experts),
                partial_grad: placement == Placement::Replicated { partial_grad: true },
            }
        };
        let mine = |name: &str| match expert_of(name) {
            Some(e) => ep == 1 || ep_rank_of_expert(e, n_experts, ep) == coords.ep,
            None => true,
        };
        let spec = |name: &str| {
            let (_, shape, _) = specs
                .iter()
                .find(|s| s.0 == name)
                .expect("a name of the model's own parameter list");
            held(name, shape)
        };
        let segment = |index: usize| -> SegmentHoldings {
            let params = if index == 0 {
                vec![spec(TIED), spec("wpe.weight")]
            } else if index == cfg.n_layer + 1 {
                vec![spec("ln_f.weight"), spec("ln_f.bias"), spec(TIED)]
            } else {
                specs
                    .iter()
                    .filter(|(n, _, _)| block_of(n) == Some(index - 1) && mine(n))
                    .map(|(n, shape, _)| held(n, shape))
                    .collect()
            };
            SegmentHoldings { index, params }
        };
        let num_stages = layout.num_stages();
        let chunks = layout
            .stages_of_rank(coords.pp, pp)
            .into_iter()
            .map(|stage| ChunkHoldings {
                stage,
                segments: layout.segments(stage).map(segment).collect(),
            })
            .collect();
        Ok(Self {
            coords,
            num_stages,
            n_layer: cfg.n_layer,
            chunks,
        })
    }

    /// Every segment this rank runs, chunk after chunk.
    pub fn segments(&self) -> impl Iterator<Item = &SegmentHoldings> {
        self.chunks.iter().flat_map(|c| c.segments.iter())
    }

    /// Every parameter this rank holds, each name once, in the order the segments use them
    /// (what its optimizer steps).
    pub fn unique(&self) -> Vec<&Held> {
        let mut seen = BTreeSet::new();
        self.segments()
            .flat_map(|s| s.params.iter())
            .filter(|p| seen.insert(p.name.as_str()))
            .collect()
    }

    /// Elements this rank holds before ZeRO (each name once).
    pub fn numel(&self) -> usize {
        self.unique().iter().map(|p| p.numel()).sum()
    }

    /// Elements of model stage `stage`'s parameters on this rank, each name once (0 when the
    /// rank does not run it).
    pub fn stage_numel(&self, stage: usize) -> usize {
        let mut seen = BTreeSet::new();
        self.chunks
            .iter()
            .filter(|c| c.stage == stage)
            .flat_map(|c| c.segments.iter().flat_map(|s| s.params.iter()))
            .filter(|p| seen.insert(p.name.as_str()))
            .map(|p| p.numel())
            .sum()
    }

    /// Whether this rank runs the head (the last model stage).
    pub fn holds_head(&self) -> bool {
        self.segments().any(|s| s.index == self.n_layer + 1)
    }

    /// Elements of each segment this rank runs, in forward order, each parameter counted once:
    /// the tied `wte` with the head where the rank runs it (its backward runs first), with the
    /// embedding otherwise.
    pub fn segment_numels(&self) -> Vec<usize> {
        let head = self.holds_head();
        self.segments()
            .map(|s| {
                s.params
                    .iter()
                    .filter(|p| !(p.name == TIED && s.index == 0 && head))
                    .map(|p| p.numel())
                    .sum()
            })
            .collect()
    }

    /// Whether `built` — `(segment index, [(name, local shape)])` of every segment the built
    /// model runs here, in order — is this table; the first difference otherwise.
    pub fn check(&self, built: &[(usize, Vec<(String, Vec<usize>)>)]) -> Result<(), String> {
        let want: Vec<(usize, Vec<(String, Vec<usize>)>)> = self
            .segments()
            .map(|s| {
                let params = s.params.iter().map(|p| (p.name.clone(), p.shape.clone()));
                (s.index, params.collect())
            })
            .collect();
        if want.len() != built.len() {
            return Err(format!(
                "the table lists {} segments on this rank, the model has {}",
                want.len(),
                built.len()
            ));
        }
        for ((wi, wp), (bi, bp)) in want.iter().zip(built) {
            if wi != bi {
                return Err(format!(
                    "the table lists segment {wi} where the model has {bi}"
                ));
            }
            if wp != bp {
                return Err(format!(
                    "segment {wi}: the table lists {wp:?}, the model holds {bp:?}"
                ));
            }
        }
        Ok(())
    }
}

/// What `mtrain plan` prints beyond the mesh: the data-parallel mode and schedule, and the
/// layers and parameters per rank of each stage, read from the holdings table of the stage's
/// first rank (the trainer's memory model turns the latter into bytes, as its per-step report
/// does).
pub fn describe(cfg: &GptConfig, plan: &ParallelPlan) -> String {
    let MeshDims { pp, tp, cp, .. } = plan.dims;
    let mut s = String::new();
    let kind = plan.effective_schedule();
    let n_stages = plan.num_stages();
    let layout = match plan.stage_layout(cfg.n_layer) {
        Ok(l) => l,
        Err(e) => return format!("no stage layout: {e}\n"),
    };
    let zero = match plan.data {
        DataParallelKind::Ddp(_) => None,
        DataParallelKind::Zero(z) => Some(z.stage),
    };
    let _ = writeln!(
        s,
        "plan: {} | {} micro-batch(es), schedule {kind}{}{}",
        match zero {
            None => "DDP".to_string(),
            Some(z) => format!("ZeRO-{}", z as u8),
        },
        plan.microbatches,
        if plan.sequence_parallel && tp > 1 {
            ", sequence parallel"
        } else {
            ""
        },
        if plan.checkpointing {
            ", activation checkpointing"
        } else {
            ""
        },
    );
    for st in 0..n_stages {
        let b = layout.blocks(st);
        let mut what = Vec::new();
        if st == 0 {
            what.push("embedding".to_string());
        }
        if !b.is_empty() {
            what.push(format!("h.{}..h.{}", b.start, b.end - 1));
        }
        if st + 1 == n_stages {
            what.push("head".to_string());
        }
        let pp_rank = layout.rank_of_stage(st, pp);
        let coords = plan.dims.coords(plan.dims.rank_of(0, pp_rank, 0));
        let n = match Holdings::of_rank(cfg, plan, coords) {
            Ok(h) => h.stage_numel(st),
            Err(e) => return format!("no holdings: {e}\n"),
        };
        let _ = writeln!(
            s,
            "stage {st} (pp rank {}): {:<28} {:>10} params per rank",
            pp_rank,
            what.join(", "),
            n
        );
    }
    if cp > 1 {
        let _ = writeln!(
            s,
            "context parallel: cp {cp}, each sequence in {} chunks, cp rank i holds chunks i and {}-i; \
             K and V pass around the cp ring ({} steps a layer), gradients averaged over dp x cp",
            2 * cp,
            2 * cp - 1,
            cp - 1
        );
    }
    s
}
