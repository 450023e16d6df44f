//! Every collective one rank issues in one optimizer step of a plan, walked the way the code
//! runs it, from the same data the code runs on:
//!
//! ```text
//!   schedule    Schedule::actions(pp rank): the executor's actions, with input_stage /
//!               output_stage deciding each receive and send
//!   holdings    which parameters each segment holds on this rank and their local sizes
//!               (the holdings table of the plan and the rank's coordinates)
//!   ZeRO        units and needs by the engine's "first user owns it" rule over all the rank's
//!               chunks (ZB-V's tied wte: one unit), gathers and frees by fsdp::residency
//!               within each chunk, the moves the scheduler runs: resharding after the
//!               forward (or recomputing) gathers a unit a second time in the backward
//!   per segment the tensor-, sequence- and expert-parallel collectives its layers describe
//!               (tensor_parallel::mapping's tables, vocab::LOSS_ALL_REDUCES, MOE_EXCHANGES)
//!               in forward, recompute and backward; a block's cut as --tp-overlap cuts
//!               them (tp.rs)
//!   cp ring     each block's K, V passes around the cp ring, and in the backward the dK, dV
//!               accumulators behind them (context_parallel::ring; below)
//!   after       runtime::finish_grads (dp average, Σ tp partial, tied wte), loss, expert load,
//!               the gradient norm, ZeRO's write-back
//! ```
//!
//! Under context parallelism a rank holds T/cp of each sequence (its activations, its tp
//! collectives, its pipeline transfers), and the data-parallel work (the gradient average,
//! ZeRO's shards, the loss) runs over dcp = dp × cp. A block's ring, per micro-batch, with
//! `S_kv = 2·B·(T/cp)·(C/tp)` elements (this rank's K and V, its heads) — each pass a send to
//! rank i+1 and a receive from i−1 at once, the bytes counted on the send:
//!
//! ```text
//!   forward    cp−1 passes of K, V (activation dtype), each beside a block's attention
//!   backward   cp−1 passes of K, V, and cp−1 of the dK, dV accumulators (f32) beside the
//!              blocks' gradients; one more accumulator pass, after the last block, brings
//!              each rank's dK, dV home with nothing to hide behind
//! ```
//!
//! Payloads are counted exactly as the CPU backend sends them (see the parent module); the MoE
//! token all-to-alls assume balanced routing.

use std::collections::BTreeMap;
use std::ops::Range;

use candle_core::DType;
use mtrain_comm::{chunk_range, Coords, MeshDims, OpKind};
use mtrain_model::{GptConfig, MoeConfig};

use super::{ring_all_gather_sent, Collective, CostError, Group, Phase, Result, StepShape, Tally};
use super::tp;
use super::{RING_DKV, RING_HOME, RING_KV};
use crate::ddp::{assign_bucket_sizes, DdpConfig, ParamSize};
use crate::expert_parallel::{MoeExchange, MOE_EXCHANGES};
use crate::fsdp::{residency, ZeroStage};
use crate::holdings::{ChunkHoldings, Held, Holdings};
use crate::pipeline::executor::gathered_f64s;
use crate::pipeline::{Action, StagePlacement};
use crate::placement::TIED;
use crate::plan::{DataParallelKind, ParallelPlan, TpOverlap, ValidPlan};
use crate::tensor_parallel::vocab::LOSS_ALL_REDUCES;
use crate::tensor_parallel::{BlockMappings, EmbeddingMappings, HeadMappings, Site, TpCollective};
use crate::toolbox::final_after_names;

/// Every collective `rank` issues in one optimizer step of `plan` (one `forward_backward` with
/// sync, then the gradient norm and `scaled_step`), merged by kind and size. Groups of one rank
/// issue nothing. The plan comes checked (a [`ValidPlan`]: against `cfg`'s model and the
/// batch of `shape`), as the run takes it.
pub fn step_collectives(
    cfg: &GptConfig,
    plan: &ValidPlan,
    shape: StepShape,
    rank: usize,
) -> Result<Vec<Collective>> {
    let dims = plan.dims;
    let world = dims.world_size();
    if rank >= world {
        return Err(CostError::Plan(format!(
            "rank {rank} is not in a world of {world}"
        )));
    }
    let mut walk = Walk::new(cfg, plan, shape, rank)?;
    let sched = plan
        .schedule()
        .map_err(|e| CostError::Plan(e.to_string()))?;
    let me = walk.c.pp;
    let remote = |s: usize| sched.rank_of_stage(s) != me;
    let actions = sched.actions(me);
    let last_backward = sched.last_backwards(me);
    for (i, a) in actions.iter().enumerate() {
        if sched.input_stage(me, a).is_some_and(remote) {
            walk.pipeline_transfer(OpKind::Recv, a);
        }
        match a {
            Action::Forward { .. } => walk.forward(a.chunk()),
            Action::Backward { .. } | Action::InputGrad { .. } | Action::WeightGrad { .. } => {
                let reduce = match walk.zero {
                    Some(ZeroStage::One) => last_backward[a.chunk()] == Some(i),
                    Some(_) => true,
                    None => false,
                };
                let (input, weights) = (a.computes_input_grad(), a.computes_weight_grads());
                walk.backward(a.chunk(), input, weights, reduce);
            }
        }
        if sched.output_stage(me, a).is_some_and(remote) {
            walk.pipeline_transfer(OpKind::Send, a);
        }
    }
    if dims.pp > 1 {
        // The loss and every rank's pass times, gathered over the pipeline group.
        let row = (8 * gathered_f64s(sched.virtual_stages())) as u64;
        let sent = ring_all_gather_sent(&vec![row; dims.pp], walk.c.pp);
        walk.tally.push(
            Group::Pp,
            OpKind::AllGather,
            "loss and pass times",
            Phase::Step,
            row,
            sent,
            false,
            false,
        );
    }
    walk.finish_grads();
    walk.step_end();
    Ok(walk.tally.items)
}

/// One ZeRO unit of the rank: the parameters its segment is the first user of.
struct Unit {
    params: Vec<Held>,
    numel: usize,
}

/// One model stage this rank runs.
struct Chunk {
    /// Indices into `[embedding, h.0, …, head]`.
    segments: Range<usize>,
    /// Its segment j is the rank's segment `first + j` (the chunks' segments numbered one
    /// after the other), whose unit is `units[first + j]`.
    first: usize,
    /// `needs[j]`: the units the chunk's segment j uses.
    needs: Vec<Vec<usize>>,
    /// `reads[j]`: those its backward reads (none for the embedding's, unless recomputed).
    reads: Vec<Vec<usize>>,
}

/// The step being walked on one rank.
struct Walk {
    tally: Tally,
    c: Coords,
    dims: MeshDims,
    n_layer: usize,
    moe: Option<MoeConfig>,
    /// `--ep-overlap`: each token exchange in `expert_parallel::overlap::PARTS` parts.
    ep_overlap: bool,
    zero: Option<ZeroStage>,
    prefetch: bool,
    recompute: bool,
    /// ZeRO-3 frees each segment's weights after its forward and gathers them again for its
    /// backward (`reshard_after_forward`, or the recompute).
    reshard: bool,
    sp: bool,
    tp_overlap: TpOverlap,
    /// The group gradients, losses and ZeRO shards go over: dp, or dcp under cp.
    dpg: Group,
    /// Sequences per micro-batch, this rank's positions of a sequence (T/cp), its local part
    /// under sequence parallelism, width.
    b: usize,
    t: usize,
    t_loc: usize,
    ch: usize,
    act: DType,
    chunks: Vec<Chunk>,
    /// The rank's ZeRO units, one per segment of every chunk.
    units: Vec<Unit>,
    /// ZeRO-3: whether each unit's weights are resident (or being gathered).
    gathered: Vec<bool>,
    /// DDP's bucket caps when the gradients travel in buckets ([`ParallelPlan::dp_buckets`]).
    dp_buckets: Option<DdpConfig>,
    /// Bytes per parameter element (the buckets' caps count the compute copy).
    param_bytes: usize,
    /// Where the schedule places the model stages (the tied `wte`'s two ends).
    placement: StagePlacement,
}

impl Walk {
    fn new(cfg: &GptConfig, plan: &ParallelPlan, shape: StepShape, rank: usize) -> Result<Self> {
        let dims = plan.dims;
        let c = dims.coords(rank);
        let sp = plan.sequence_parallel && dims.tp > 1;
        let t = shape.seq_len / dims.cp;
        let table = Holdings::of_rank(cfg, plan, c).map_err(|e| CostError::Plan(e.to_string()))?;
        let (chunks, units) = zero_units(table.chunks, plan.checkpointing);
        let gathered = units.iter().map(|u| u.numel == 0).collect();
        let (zero, prefetch, reshard) = match plan.data {
            DataParallelKind::Zero(z) => (Some(z.stage), z.prefetch, z.reshard_after_forward),
            DataParallelKind::Ddp(_) => (None, false, false),
        };
        Ok(Self {
            placement: plan.effective_schedule().placement(),
            tally: Tally {
                dims,
                rank,
                items: Vec::new(),
            },
            c,
            dims,
            n_layer: cfg.n_layer,
            moe: cfg.moe.clone(),
            ep_overlap: plan.ep_overlap,
            zero,
            prefetch,
            recompute: plan.checkpointing,
            reshard: plan.checkpointing || reshard,
            sp,
            tp_overlap: plan.tp_overlap,
            dpg: if dims.cp > 1 { Group::Dcp } else { Group::Dp },
            b: shape.batch / dims.dp / plan.microbatches,
            t,
            t_loc: if sp {
                chunk_range(t, dims.tp, c.tp).len()
            } else {
                t
            },
            ch: cfg.n_embd,
            act: shape.dtype,
            chunks,
            units,
            gathered,
            dp_buckets: plan.dp_buckets(),
            param_bytes: plan.precision.param_dtype.size_in_bytes(),
        })
    }

    /// A pipeline receive or send of one micro-batch's activation (forward) or its gradient.
    fn pipeline_transfer(&mut self, op: OpKind, a: &Action) {
        let (what, phase) = match a.is_forward() {
            true => ("activation", Phase::Forward),
            false => ("activation gradient", Phase::Backward),
        };
        let bytes = match op {
            OpKind::Send => (self.b * self.t_loc * self.ch * self.act.size_in_bytes()) as u64,
            _ => 0,
        };
        let overlap = op == OpKind::Send;
        self.tally
            .push(Group::Pp, op, what, phase, bytes, bytes, overlap, false);
    }

    /// ZeRO-3 all-gathers of `units` that are not resident yet.
    fn gather(&mut self, units: &[usize], phase: Phase) {
        for &u in units {
            if !self.gathered[u] {
                self.gathered[u] = true;
                let n = self.padded(self.units[u].numel);
                let what = "ZeRO-3 weight gather";
                self.tally
                    .all_gather(self.dpg, what, phase, n, 1, DType::F32, true);
            }
        }
    }

    /// ZeRO-3 frees (a unit without parameters is never freed, as in the scheduler).
    fn free(&mut self, units: &[usize]) {
        for &u in units {
            if self.units[u].numel > 0 {
                self.gathered[u] = false;
            }
        }
    }

    fn z3(&self) -> bool {
        self.zero == Some(ZeroStage::Three)
    }

    fn padded(&self, n: usize) -> usize {
        let g = self.dpg.size(self.dims);
        n.div_ceil(g) * g
    }

    /// One micro-batch's forward through chunk `k`.
    fn forward(&mut self, k: usize) {
        for (j, seg) in self.chunks[k].segments.clone().enumerate() {
            if self.z3() {
                let needs = &self.chunks[k].needs;
                let m = residency::before_forward(needs, j, self.prefetch, self.reshard);
                self.free(&m.free);
                self.gather(&m.wait, Phase::Forward);
                self.gather(&m.prefetch, Phase::Forward);
            }
            self.segment_forward(seg, Phase::Forward);
        }
    }

    /// One micro-batch's backward through chunk `k`; `reduce`: ZeRO reduce-scatters after each
    /// segment.
    /// Chunk k's backward: with `input` the input-gradient walk (the fused backward's, or B's:
    /// ZeRO-3's gathers, the recompute, each segment's conjugate collectives), with `weights`
    /// what follows each segment's weight gradients (the fused backward's, or W's: the
    /// reduce-scatter when `reduce`, ZeRO-3's frees).
    fn backward(&mut self, k: usize, input: bool, weights: bool, reduce: bool) {
        let segments = self.chunks[k].segments.clone();
        for (j, seg) in segments.enumerate().rev() {
            if input {
                self.backward_input(k, j, seg);
            }
            if weights {
                self.backward_weights(k, j, reduce);
            }
        }
    }

    fn backward_input(&mut self, k: usize, j: usize, seg: usize) {
        if self.z3() {
            let reads = &self.chunks[k].reads;
            let m = residency::before_backward(reads, j, self.prefetch, self.reshard);
            self.gather(&m.wait, Phase::Backward);
            self.gather(&m.prefetch, Phase::Backward);
        }
        if self.recompute {
            self.segment_forward(seg, Phase::Backward);
        }
        self.segment_backward(seg);
    }

    fn backward_weights(&mut self, k: usize, j: usize, reduce: bool) {
        let n = self.units[self.chunks[k].first + j].numel;
        if reduce && n > 0 {
            let what = "ZeRO gradient reduce-scatter";
            let rows = self.padded(n);
            self.tally
                .reduce_scatter(self.dpg, what, Phase::Backward, rows, 1, DType::F32, true);
        }
        if self.z3() {
            let c = &self.chunks[k];
            let free = residency::after_backward(&c.needs, &c.reads, j, self.reshard);
            self.free(&free);
        }
    }

    /// The collectives of segment `seg`'s forward (also run by the recompute in backward), as
    /// its layers describe them: the tp mappings of its sites in order, the head's loss, the
    /// MoE layer's exchanges.
    fn segment_forward(&mut self, seg: usize, phase: Phase) {
        for site in self.tp_sites(seg) {
            if let Some(c) = site.mapping.forward() {
                self.tp_collective(seg, (c, true), site.what, phase);
            }
        }
        if self.dims.tp > 1 && seg == self.n_layer + 1 {
            for _ in LOSS_ALL_REDUCES {
                let n = self.b * self.t;
                let what = "vocab-parallel loss";
                self.tally
                    .all_reduce(Group::Tp, what, phase, n, DType::F32, false);
            }
        }
        if self.is_moe_block(seg) {
            for e in MOE_EXCHANGES {
                self.exchange(e, phase, e == MoeExchange::Dispatch);
            }
        }
        if self.is_cp_block(seg) {
            self.ring(phase, false);
        }
    }

    fn is_cp_block(&self, seg: usize) -> bool {
        self.dims.cp > 1 && (1..=self.n_layer).contains(&seg)
    }

    /// One block's passes around the cp ring (module doc): K, V in the forward (and the
    /// recompute); in the `backward` also the dK, dV accumulators, the last pass exposed.
    fn ring(&mut self, phase: Phase, backward: bool) {
        let n = self.dims.cp;
        let elems = 2 * self.b * self.t * (self.ch / self.dims.tp);
        let (kv, dkv) = ((elems * self.act.size_in_bytes()) as u64, (elems * 4) as u64);
        let mut pass = |what, bytes, hidden| {
            let (send, recv) = (OpKind::Send, OpKind::Recv);
            self.tally.push(Group::Cp, send, what, phase, bytes, bytes, hidden, false);
            self.tally.push(Group::Cp, recv, what, phase, 0, 0, hidden, false);
        };
        for _ in 1..n {
            pass(RING_KV, kv, true);
            if backward {
                pass(RING_DKV, dkv, true);
            }
        }
        if backward {
            pass(RING_HOME, dkv, false);
        }
    }

    /// The collectives of segment `seg`'s backward: each forward collective's conjugate, last
    /// first (the loss's all-reduces have none).
    fn segment_backward(&mut self, seg: usize) {
        let phase = Phase::Backward;
        for site in self.tp_sites(seg).into_iter().rev() {
            if let Some(c) = site.mapping.backward() {
                self.tp_collective(seg, (c, false), site.what, phase);
            }
        }
        if self.is_moe_block(seg) {
            for e in MoeExchange::backward_order() {
                self.exchange(e, phase, e == MoeExchange::Combine);
            }
        }
        if self.is_cp_block(seg) {
            self.ring(phase, true);
        }
    }

    /// The tensor-parallel mappings of segment `seg` in forward order, from the tables its
    /// layers are built from.
    fn tp_sites(&self, seg: usize) -> Vec<Site> {
        if self.dims.tp == 1 {
            Vec::new()
        } else if seg == 0 {
            EmbeddingMappings::new(self.sp).sites()
        } else if seg == self.n_layer + 1 {
            HeadMappings::new(self.sp).sites()
        } else {
            BlockMappings::new(self.sp).sites()
        }
    }

    /// One mapping's collective of segment `seg` (in its forward or its backward) on a
    /// micro-batch's activation (B, T, C), split along T; a block's as `--tp-overlap` cuts it
    /// ([`tp::collective`]).
    fn tp_collective(
        &mut self,
        seg: usize,
        c: (TpCollective, bool),
        what: &'static str,
        phase: Phase,
    ) {
        let block = (1..=self.n_layer).contains(&seg);
        let mode = block.then_some(self.tp_overlap);
        let x = tp::Operand { b: self.b, t: self.t, ch: self.ch, act: self.act };
        tp::collective(&mut self.tally, mode, c, what, phase, x);
    }

    fn is_moe_block(&self, seg: usize) -> bool {
        self.moe.is_some() && self.dims.ep > 1 && (1..=self.n_layer).contains(&seg)
    }

    /// One exchange of an MoE layer ([`super::moe::exchange`]); `first`: its pass's first.
    fn exchange(&mut self, e: MoeExchange, phase: Phase, first: bool) {
        let Some(m) = &self.moe else { return };
        let (tokens, row) = (self.b * self.t_loc, (self.ch * self.act.size_in_bytes()) as u64);
        super::moe::exchange(&mut self.tally, m, (e, first), phase, tokens, row, self.ep_overlap);
    }

    /// `ParallelModel::finish_grads`: the dp average (DDP), then the sequence-parallel partial
    /// sums and the tied `wte` exchange, on full gradients or ZeRO shards.
    fn finish_grads(&mut self) {
        let step = Phase::Step;
        let mut seen = std::collections::BTreeSet::new();
        let held: Vec<Held> = self
            .units
            .iter()
            .flat_map(|u| u.params.iter())
            .filter(|p| seen.insert(p.name.clone()))
            .cloned()
            .collect();
        let (pp, n_stages) = (self.dims.pp, self.dims.pp * self.chunks.len());
        let (first, last) = (
            self.placement.rank_of_stage(pp, 0),
            self.placement.rank_of_stage(pp, n_stages - 1),
        );
        let wte_local = held.iter().find(|p| p.name == TIED).map(|p| p.numel());
        // Summed between two pipeline ranks; in the V both ends are this rank's.
        let tied_here = n_stages > 1 && first != last && wte_local.is_some();
        match self.zero {
            None if self.dpg.size(self.dims) > 1 && self.dp_buckets.is_some() => {
                for numel in self.bucket_numels() {
                    self.tally.all_reduce(
                        self.dpg,
                        "gradient bucket",
                        step,
                        numel,
                        DType::F32,
                        true,
                    );
                }
                self.sp_partial_sums(&held);
            }
            None => {
                if self.dpg.size(self.dims) > 1 {
                    for p in &held {
                        let g = match p.expert {
                            Some(_) => Group::Edp,
                            None => self.dpg,
                        };
                        self.tally
                            .all_reduce(g, "gradient", step, p.numel(), DType::F32, true);
                    }
                }
                self.sp_partial_sums(&held);
            }
            Some(_) => {
                let units: Vec<(bool, bool, usize)> = self
                    .units
                    .iter()
                    .map(|u| {
                        let has = |f: &dyn Fn(&Held) -> bool| u.params.iter().any(f);
                        (has(&|p| p.partial_grad), has(&|p| p.name == TIED), u.numel)
                    })
                    .collect();
                if self.sp {
                    for &(partial, _, numel) in &units {
                        if partial {
                            let what = "sequence-parallel partial gradients";
                            let n = self.padded(numel) / self.dpg.size(self.dims);
                            self.tally
                                .all_reduce(Group::Tp, what, step, n, DType::F32, false);
                        }
                    }
                }
                if tied_here {
                    for &(_, tied, numel) in &units {
                        if tied {
                            let (what, n) = ("tied wte gradient gather", self.padded(numel));
                            self.tally
                                .all_gather(self.dpg, what, step, n, 1, DType::F32, false);
                        }
                    }
                }
            }
        }
        if tied_here && (self.c.pp == first || self.c.pp == last) {
            let bytes = (wte_local.unwrap_or(0) * 4) as u64;
            let what = "tied wte gradient";
            self.tally.push(
                Group::Pp,
                OpKind::Send,
                what,
                step,
                bytes,
                bytes,
                false,
                false,
            );
            self.tally
                .push(Group::Pp, OpKind::Recv, what, step, 0, 0, false, false);
        }
    }

    /// The sequence-parallel partial gradients' one sum over tp, after the dp average.
    fn sp_partial_sums(&mut self, held: &[Held]) {
        let partial: usize = held
            .iter()
            .filter(|p| p.partial_grad)
            .map(|p| p.numel())
            .sum();
        if self.sp && partial > 0 {
            let what = "sequence-parallel partial gradients";
            self.tally
                .all_reduce(Group::Tp, what, Phase::Step, partial, DType::F32, false);
        }
    }

    /// Elements of each DDP bucket of the one stage, packed by the runtime's rule
    /// ([`assign_bucket_sizes`]) from this rank's parameters in model order, each final after
    /// the segment that first uses it.
    fn bucket_numels(&self) -> Vec<usize> {
        let Some(d) = self.dp_buckets else {
            return Vec::new();
        };
        let mut final_after = BTreeMap::new();
        let mut sizes = Vec::new();
        for (j, u) in self.units.iter().enumerate() {
            for p in &u.params {
                final_after.insert(p.name.clone(), j);
                let numel = p.numel();
                let bytes = numel * self.param_bytes;
                sizes.push(ParamSize {
                    name: &p.name,
                    numel,
                    bytes,
                });
            }
        }
        let (first, cap) = (d.first_bucket_cap_bytes, d.bucket_cap_bytes);
        assign_bucket_sizes(&sizes, &final_after, first, cap)
            .iter()
            .map(|b| b.numel)
            .collect()
    }

    /// After the reduction: the loss and auxiliary loss, the expert load, the gradient norm
    /// (one world all-reduce) and ZeRO-1/2's write-back of the updated shards.
    fn step_end(&mut self) {
        let step = Phase::Step;
        if self.dims.pp > 1 {
            self.tally
                .all_reduce(Group::Pp, "aux loss", step, 1, DType::F64, false);
        }
        self.tally
            .all_reduce(self.dpg, "loss", step, 2, DType::F64, false);
        if let Some(m) = &self.moe {
            let layers: usize = self
                .chunks
                .iter()
                .map(|k| {
                    k.segments
                        .clone()
                        .filter(|&s| s >= 1 && s <= self.n_layer)
                        .count()
                })
                .sum();
            if layers > 0 {
                let n = layers * (m.n_experts + 1);
                self.tally
                    .all_reduce(Group::Dp, "expert load", step, n, DType::I64, false);
            }
        }
        self.tally
            .all_reduce(Group::World, "gradient norm", step, 1, DType::F64, false);
        if matches!(self.zero, Some(ZeroStage::One) | Some(ZeroStage::Two)) {
            let sizes: Vec<usize> = self
                .units
                .iter()
                .map(|u| u.numel)
                .filter(|&n| n > 0)
                .collect();
            for n in sizes {
                let (what, rows) = ("ZeRO weight write-back", self.padded(n));
                self.tally
                    .all_gather(self.dpg, what, step, rows, 1, DType::F32, false);
            }
        }
    }
}

/// The chunks of the holdings table as the walk needs them, and the rank's ZeRO units: the
/// segments of all chunks numbered one after the other, their parameters grouped into units by
/// first use over that numbering (`Fsdp::over_chunks`), and what each segment needs.
fn zero_units(tables: Vec<ChunkHoldings>, recompute: bool) -> (Vec<Chunk>, Vec<Unit>) {
    let segs: Vec<_> = tables.iter().flat_map(|t| t.segments.iter()).collect();
    let uses: Vec<Vec<String>> = segs
        .iter()
        .map(|s| s.params.iter().map(|p| p.name.clone()).collect())
        .collect();
    let owner = final_after_names(&uses);
    let needs = residency::needs(&uses, &owner);
    // The embedding (segment 0 of the model) is the one segment whose backward reads no weight.
    let reads_params: Vec<bool> = segs.iter().map(|s| s.index != 0).collect();
    let reads = residency::backward_needs(&needs, &reads_params, recompute);
    let units = segs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let params: Vec<Held> = s
                .params
                .iter()
                .filter(|p| owner[&p.name] == i)
                .cloned()
                .collect();
            let numel = params.iter().map(|p| p.numel()).sum();
            Unit { params, numel }
        })
        .collect();
    let mut first = 0;
    let chunks = tables
        .iter()
        .map(|t| {
            let start = t.segments.first().map_or(0, |s| s.index);
            let n = t.segments.len();
            first += n;
            Chunk {
                segments: start..start + n,
                first: first - n,
                needs: needs[first - n..first].to_vec(),
                reads: reads[first - n..first].to_vec(),
            }
        })
        .collect();
    (chunks, units)
}
