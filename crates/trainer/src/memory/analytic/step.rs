//! What a step adds above the model state ([`StepMemory`]), summed per rank from what each of
//! its segments keeps (`memory/kept.rs`) over its part of the plan ([`ActivationLayout`]).

use mtrain_model::GptConfig;
use serde::Serialize;

use super::{ActivationLayout, ModelStateLayout};
use crate::memory::kept::{self, BackwardPath, Dims, Routing, SegmentCost};

/// What one rank holds through a step beyond the model state it starts the step with,
/// predicted from what the segments keep (`memory/kept.rs`): the moments the report measures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StepMemory {
    /// Held at the end of the forward (before the first backward): what every segment pass in
    /// flight keeps, the engine's leaf copies of the segment inputs included.
    pub activations: u64,
    /// ZeRO-3 weights gathered by the forward still held at its end: every segment's, kept
    /// until their backward, or (resharding after the forward, checkpointing) the last
    /// segment's.
    pub gathered: u64,
    /// Gradients already written when the reported forward ends: the earlier micro-steps'
    /// under gradient accumulation (the report reads the last micro-step's forward).
    pub earlier_grads: u64,
    /// The step's highest level above its start: the largest moment of the first backward
    /// (what is still held, the segment's backward at its worst, the gradients so far), or the
    /// end of the forward if that is higher.
    pub peak: u64,
}

/// The step memory of one rank with layout `layout`, `seq` tokens per row, `dtype_bytes` per
/// value, on the backward path `path`; `param_bytes` and `grad_bytes` per parameter of the
/// rank's model state (gathered weights, gradients written during the backward).
///
/// ```text
///   pass      = Σ over the rank's segments of (input copy + kept)          (one micro-batch, all chunks)
///   checkpointing: pass = Σ input copies, and each backward first recomputes its segment (+ kept)
///   activations = n/v · pass                   (n (micro-batch, chunk) pairs in flight over v chunks)
///   peak      = max over the first backward's segments j (last to first) of
///               activations − Σ_{i after j} (input + kept)_i / v + transient_j (+ kept_j recomputed)
///               + gradients of the segments after j and j + gathered weights not yet released
///               (ZeRO-3: + the tied wte's full gradient held from the head's backward to the
///               embedding's, three of them there; a unit's full gradient and its flat copy
///               in place of transient_j when larger)
///               (+ the two largest consecutive segments' weights, gathered again for the
///               backward when the forward released them: resharding or checkpointing, and
///               the gathered buffer of one being cut into its slots in place of transient_j
///               when that is larger)
///               (a tape's backward in two under ZeRO-3 resharding: less the smaller of j's
///               own gradients, not formed in B, and j's own gathered weights, freed before W)
///   (with M > 1 passes also the last backward: one pass in flight, every gradient written)
/// ```
///
/// On one device (`n = v = tp = 1`, `b = B`) this is the whole model's single pass.
#[allow(clippy::too_many_arguments)]
pub fn rank_step_memory(
    cfg: &GptConfig,
    layout: &ActivationLayout,
    seq: usize,
    dtype_bytes: usize,
    checkpointing: bool,
    path: BackwardPath,
    param_bytes: u64,
    grad_bytes: f64,
) -> StepMemory {
    let d = Dims {
        b: layout.micro_batch as f64,
        t: (seq / layout.cp.max(1)) as f64, // this rank's tokens of a row
        c: cfg.n_embd as f64,
        h: cfg.n_head as f64,
        v: cfg.vocab_size as f64,
        tp: layout.tp.max(1) as f64,
        sp: layout.sequence_parallel,
        w: dtype_bytes as f64,
    };
    let block_cost = |i: usize| match &cfg.moe {
        None => kept::block(&d, path),
        Some(m) => {
            let even = Routing::even(d.b * d.t, m.n_experts, m.top_k, layout.ep);
            let r = layout.routing.get(i).copied().unwrap_or(even);
            kept::moe_block(&d, m.n_experts, layout.ep, &r)
        }
    };
    let mut segs: Vec<SegmentCost> = Vec::with_capacity(layout.blocks + 2);
    if layout.holds_embedding {
        segs.push(kept::embedding(&d, path));
    }
    segs.extend((0..layout.blocks).map(block_cost));
    if layout.holds_head {
        segs.push(kept::head(&d, path));
    }
    let held = |s: &SegmentCost| match checkpointing {
        true => s.input,
        false => s.input + s.kept,
    };
    let v = layout.chunks.max(1) as f64;
    let n = layout.in_flight.max(1) as f64;
    // A stage that ends in a block also keeps its output (sent on) under checkpointing.
    let sent = match checkpointing && !layout.holds_head {
        true => d.nc_local() * d.w,
        false => 0.0,
    };
    let pass: f64 = segs.iter().map(held).sum::<f64>() + sent;
    let activations = n / v * pass;

    let params = &layout.segment_params;
    let total_params = params.iter().sum::<u64>().max(1) as f64;
    // Resharding after the forward (the tapes keep only the weights' slots; an autograd graph
    // keeps the tensors it used) or checkpointing, the forward frees each segment's weights
    // when the next one starts, so the last segment's stay (the head's: with the tied wte, the
    // embedding's whole unit, wpe too); otherwise every gathered weight is kept until its
    // backward.
    let reshards = layout.reshards_after_forward;
    let released = checkpointing || (reshards && path != BackwardPath::Autograd);
    let tied_unit = match layout.holds_embedding && layout.holds_head && params.len() > 1 {
        true => params[0],
        false => 0,
    };
    let last = params.last().copied().unwrap_or(0) + tied_unit;
    let gathered = match (layout.gathers_weights, released) {
        (true, false) => (param_bytes as f64) * total_params,
        (true, true) => (param_bytes * last) as f64,
        (false, _) => 0.0,
    };
    // Then ZeRO-3 gathers a segment again for its backward (and recompute), with the previous
    // one prefetched: the two largest consecutive segments of those the forward freed (all but
    // the last). Before a segment's backward runs, a gathered buffer is cut into its parameters'
    // slots (each a copy): that buffer beside them, a third segment, where the segment's own
    // backward transient comes later.
    let (regathered, cut) = match layout.gathers_weights && (checkpointing || reshards) {
        true => {
            let again = &params[..params.len().saturating_sub(1)];
            let largest = again.iter().copied().max().unwrap_or(0) as f64;
            let pair = again
                .windows(2)
                .map(|w| (w[0] + w[1]) as f64)
                .fold(largest, f64::max);
            (pair * param_bytes as f64, largest * param_bytes as f64)
        }
        false => (0.0, 0.0),
    };
    // ZeRO-3 reduce-scatters a unit's gradient right after its segment's backward: the full
    // gradient and its flat copy exist together while the copy is made; then the full gradient
    // is freed and the collective holds the copy, and on the CPU backend also its f32
    // accumulator, two slots of one shard each (one over two ranks), and the shard it returns:
    // the higher of the two moments. The tied wte's full gradient,
    // formed by the head's backward, is held until the embedding's unit is reduced, and the
    // embedding's backward adds its own to it: the two and their sum, or on the CPU tapes in
    // f32 the two, the sum taken in place into the embedding's (`Grads::accumulate_fresh`);
    // that sum is then the embedding unit's gradient, with wpe's.
    let cpu = path != BackwardPath::Tapes;
    let (w, k) = (param_bytes as f64, layout.zero_shards.max(1) as f64);
    let ring = |p: f64| p / k * ((k - 1.0).min(2.0) * w.max(4.0) + w);
    let unit_grads = |p: f64| match (layout.gathers_weights, cpu) {
        (false, _) => 0.0,
        (true, false) => 2.0 * p * w,
        (true, true) => p * w + (p * w).max(ring(p)),
    };
    let last = segs.len().saturating_sub(1);
    // wte's elements on a rank holding both of its ends (counted with the head, whose own unit
    // is ln_f: wte's is the embedding's).
    let tied_numel = match layout.gathers_weights && layout.holds_embedding && layout.holds_head {
        true => params.last().map_or(0.0, |&p| p as f64 - 2.0 * d.c),
        false => 0.0,
    };
    let tied = tied_numel * param_bytes as f64;
    let tied_copies = match path == BackwardPath::CpuTapes && param_bytes == 4 {
        true => 2.0,
        false => 3.0,
    };
    let split = layout.gathers_weights && (checkpointing || reshards) && path.taped();
    let mut peak = activations + gathered;
    let (mut freed, mut swept, mut done) = (0.0, 0.0, 0.0);
    for (j, s) in segs.iter().enumerate().rev() {
        let p = params.get(j).copied().unwrap_or(0) as f64;
        swept += p;
        let recomputed = if checkpointing { s.kept } else { 0.0 };
        // (wte's tables held then, and the unit reduced after the segment's backward: wte's
        // gradient shard is written with the embedding's)
        let (tied_held, unit) = match j {
            0 => (tied_copies * tied, p + tied_numel),
            j if j == last => (tied, p - tied_numel),
            _ => (tied, p),
        };
        done += unit;
        let held_then = activations - freed + tied_held + grad_bytes * done;
        // Gathered again while the backward runs (`regathered`); but the embedding's backward
        // reads no weight and has nothing before it to prefetch (unless it is recomputed).
        let again = match j {
            0 if !checkpointing => 0.0,
            _ => regathered,
        };
        // The segment's backward at its worst, then right after it (its tape dropped, its
        // weights freed) the reduce-scatter's moment.
        let computing = held_then
            + recomputed
            + s.transient.max(cut)
            + gathered * (1.0 - (swept - p) / total_params)
            + again;
        // A tape's backward in two where ZeRO-3 reshards: B with the segment's weights gathered
        // and its gradients not formed, then W with the gradients formed and the weights freed
        // (the head's: with the tied embedding's unit); the higher of the two.
        let computing = match split && j > 0 {
            true => {
                let own_grads = grad_bytes * unit + if j == last { tied } else { 0.0 };
                let own_weights = match j == last {
                    true => (p + tied_unit as f64) * param_bytes as f64,
                    false => p * param_bytes as f64,
                };
                computing - own_grads.min(own_weights)
            }
            false => computing,
        };
        // (at the embedding, wte's tables are its unit's gradient, and nothing is left to
        // gather)
        let (tables, prefetched) = match j {
            0 => (tied_held, 0.0),
            _ => (0.0, (regathered - p * param_bytes as f64).max(0.0)),
        };
        let reducing = held_then - tables - held(s) / v
            + unit_grads(unit)
            + gathered * (1.0 - swept / total_params)
            + prefetched;
        peak = peak.max(computing).max(reducing);
        freed += held(s) / v;
    }
    // The step's last backward (with M > 1 passes): one pass left in flight, every gradient of
    // the rank already written by the earlier ones (and no gathered weights of the others).
    if layout.accumulates {
        let last = pass / v;
        let (mut freed, mut done) = (0.0, 0.0);
        for (j, s) in segs.iter().enumerate().rev() {
            let p = params.get(j).copied().unwrap_or(0) as f64;
            let recomputed = if checkpointing { s.kept } else { 0.0 };
            let left = gathered / n * (1.0 - done / total_params);
            let level = last - freed
                + recomputed
                + s.transient.max(cut)
                + grad_bytes * total_params
                + left
                + regathered;
            peak = peak.max(level);
            freed += held(s) / v;
            done += p;
        }
    }
    StepMemory {
        activations: activations as u64,
        gathered: gathered as u64,
        earlier_grads: 0,
        peak: peak as u64,
    }
}

/// How a step runs, as far as its memory goes: `seq` tokens a row, activations of
/// `dtype_bytes`, recomputed or kept (`checkpointing`), the backward `path`, and `grad_accum`
/// micro-steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepRun {
    pub seq: usize,
    pub dtype_bytes: usize,
    pub checkpointing: bool,
    pub path: BackwardPath,
    pub grad_accum: usize,
}

/// [`rank_step_memory`] for a rank holding `state`: its weights' bytes per parameter for the
/// gathers, its gradient bytes spread over its parameters for the backward's gradients; with
/// `grad_accum > 1` micro-steps the later backwards run with every gradient written.
pub fn step_memory(
    cfg: &GptConfig,
    layout: &ActivationLayout,
    state: &ModelStateLayout,
    run: StepRun,
) -> StepMemory {
    let StepRun {
        seq,
        dtype_bytes,
        checkpointing,
        path,
        grad_accum,
    } = run;
    let grad_per_param = state.grads() as f64 / state.n_params.max(1) as f64;
    let layout = ActivationLayout {
        accumulates: layout.accumulates || grad_accum > 1,
        ..layout.clone()
    };
    let step = rank_step_memory(
        cfg,
        &layout,
        seq,
        dtype_bytes,
        checkpointing,
        path,
        state.param_bytes,
        grad_per_param,
    );
    // The optimizer step, after the activations are gone: the gradients and its own worst
    // moment; the largest tensor it steps is a block's widest weight (or the tied embedding),
    // or under ZeRO a block unit's decayed shard.
    let (c, tp) = (cfg.n_embd as f64, layout.tp.max(1) as f64);
    let widest = (4.0 * c * c / tp).max(cfg.vocab_size as f64 * c / tp);
    let largest = match state.optim_shards > 1 {
        true => 12.0 * c * c / tp / state.optim_shards as f64,
        false => widest,
    } * 4.0;
    let pair = layout.segment_params.windows(2).map(|w| w[0] + w[1]).max();
    let units = pair.or(layout.segment_params.first().copied()).unwrap_or(state.n_params);
    let gathered = match state.param_copy_shards {
        0 => 0.0,
        n => units as f64 * state.param_bytes as f64 * (1.0 + 1.0 / n as f64),
    };
    let masters = state.master_bytes > 0;
    let optimizer = state.grads() as f64 + kept::optimizer_step(largest, gathered, path, masters);
    StepMemory {
        earlier_grads: match grad_accum > 1 {
            true => state.grads(),
            false => 0,
        },
        peak: step.peak.max(optimizer as u64),
        ..step
    }
}

/// Estimated activation bytes one rank keeps at the end of its forward
/// ([`rank_step_memory`]'s `activations` on the autograd path).
pub fn rank_activation_bytes(
    cfg: &GptConfig,
    layout: &ActivationLayout,
    seq: usize,
    dtype_bytes: usize,
    checkpointing: bool,
) -> u64 {
    rank_step_memory(
        cfg,
        layout,
        seq,
        dtype_bytes,
        checkpointing,
        BackwardPath::Autograd,
        0,
        0.0,
    )
    .activations
}

/// The activation bytes of the whole model on one device for one batch of `batch` rows
/// ([`rank_activation_bytes`] with [`ActivationLayout::single_device`]).
pub fn activation_bytes(
    cfg: &GptConfig,
    batch: usize,
    seq: usize,
    dtype_bytes: usize,
    checkpointing: bool,
) -> u64 {
    rank_activation_bytes(
        cfg,
        &ActivationLayout::single_device(cfg, batch),
        seq,
        dtype_bytes,
        checkpointing,
    )
}

#[cfg(test)]
mod tests {
    use mtrain_parallel::parallelize::{DataParallelKind, ParallelPlan};
    use mtrain_parallel::pipeline::ScheduleKind;

    use super::*;

    fn small() -> GptConfig {
        GptConfig {
            vocab_size: 16,
            block_size: 4,
            n_layer: 4,
            n_head: 2,
            n_embd: 8,
            moe: None,
        }
    }

    fn step(cfg: &GptConfig, l: &ActivationLayout, ckpt: bool) -> StepMemory {
        rank_step_memory(cfg, l, 4, 4, ckpt, BackwardPath::Autograd, 4, 4.0)
    }

    /// One device: every segment's input copy and kept tensors, and a peak above them by at
    /// least one block's backward; each segment's parameters once (the tied `wte` once).
    #[test]
    fn single_device_holds_every_segment() {
        let cfg = small();
        let one = ActivationLayout::single_device(&cfg, 4);
        assert_eq!(
            one.segment_params.iter().sum::<u64>(),
            cfg.n_params() as u64,
            "{:?}",
            one.segment_params
        );
        assert_eq!(one.segment_params.len(), cfg.n_layer + 2);
        let d = Dims {
            b: 4.0,
            t: 4.0,
            c: 8.0,
            h: 2.0,
            v: 16.0,
            tp: 1.0,
            sp: false,
            w: 4.0,
        };
        let (e, b, h) = (
            kept::embedding(&d, BackwardPath::Autograd),
            kept::block(&d, BackwardPath::Autograd),
            kept::head(&d, BackwardPath::Autograd),
        );
        let pass = e.kept + 4.0 * (b.input + b.kept) + h.input + h.kept;
        let s = step(&cfg, &one, false);
        assert_eq!(s.activations, pass as u64);
        assert!(s.peak as f64 >= pass - h.input - h.kept + b.transient);
        assert_eq!(activation_bytes(&cfg, 4, 4, 4, false), s.activations);
        // Checkpointing keeps the five float inputs only.
        let c = step(&cfg, &one, true);
        assert_eq!(c.activations, (4.0 * b.input + h.input) as u64);
        assert!(c.peak < s.peak);
    }

    #[test]
    fn pipeline_1f1b_holds_its_stage_times_micro_batches_in_flight() {
        let cfg = small();
        let mut plan = ParallelPlan::new(mtrain_comm::MeshDims::new(1, 2, 1, 1));
        plan.microbatches = 2;
        plan.schedule = ScheduleKind::OneFOneB;
        let r0 = ActivationLayout::for_plan(&cfg, &plan, 0, 4).expect("rank 0");
        let r1 = ActivationLayout::for_plan(&cfg, &plan, 1, 4).expect("rank 1");
        assert_eq!(
            (
                r0.blocks,
                r0.micro_batch,
                r0.in_flight,
                r0.holds_head,
                r0.holds_embedding
            ),
            (2, 2, 2, false, true)
        );
        assert_eq!(
            (
                r1.blocks,
                r1.micro_batch,
                r1.in_flight,
                r1.holds_head,
                r1.holds_embedding
            ),
            (2, 2, 1, true, false)
        );
        // Rank 0 holds two micro-batches of half the rows: its pass over 2 blocks, twice.
        let half = ActivationLayout {
            in_flight: 1,
            ..r0.clone()
        };
        assert_eq!(
            step(&cfg, &r0, false).activations,
            2 * step(&cfg, &half, false).activations
        );
        // GPipe keeps all M = 2 micro-batches on the last stage too.
        plan.schedule = ScheduleKind::GPipe;
        let g1 = ActivationLayout::for_plan(&cfg, &plan, 1, 4).expect("gpipe rank 1");
        assert_eq!(
            step(&cfg, &g1, false).activations,
            2 * step(&cfg, &r1, false).activations
        );
        // A batch that does not split into M micro-batches is refused, naming both.
        let e = ActivationLayout::for_plan(&cfg, &plan, 0, 3).expect_err("3 rows, M = 2");
        assert!(e.to_string().contains("batch 3") && e.to_string().contains('2'));
    }

    /// Under `--pass-costs` the run trains under the order built for them, whose peak can be
    /// lower than the unit-clock order's: the model counts the order the run holds. At F 17.1,
    /// B 15.7, W 13.2 ms, ZB-V's cost-aware order (pp 2, M = 8) holds 3 activation sets on
    /// rank 0 where the unit-clock order holds 4.
    #[test]
    fn zero_bubble_counts_the_order_built_for_the_pass_costs() {
        let cfg = small();
        let mut plan = ParallelPlan::new(mtrain_comm::MeshDims::new(1, 2, 1, 1));
        plan.microbatches = 8;
        plan.schedule = ScheduleKind::ZeroBubbleV;
        let unit = ActivationLayout::for_plan(&cfg, &plan, 0, 16).expect("unit-clock");
        plan.pass_costs = Some([17.1, 15.7, 13.2]);
        let aware = ActivationLayout::for_plan(&cfg, &plan, 0, 16).expect("cost-aware");
        let runs = plan.schedule().unwrap().simulate().unwrap().peak_in_flight(0);
        assert_eq!((unit.in_flight, aware.in_flight, runs), (4, 3, 3));
        assert_eq!(
            4 * step(&cfg, &aware, false).activations,
            3 * step(&cfg, &unit, false).activations
        );
    }

    /// ZeRO-3 without checkpointing, the gathered weights kept until the backward: the
    /// forward's end holds every one of them (on the autograd path, its graphs hold them
    /// whatever the option says).
    #[test]
    fn fsdp_forward_holds_the_gathered_weights() {
        let cfg = small();
        let l = fsdp_layout(&cfg, false);
        assert!(l.gathers_weights && !l.reshards_after_forward);
        let s = step(&cfg, &l, false);
        assert_eq!(s.gathered, 4 * cfg.n_params() as u64);
        // With checkpointing only the last segment's weights are still gathered: the head's,
        // and with the tied wte the rest of its unit, the embedding's wpe.
        let head = l.segment_params.last().expect("a head") + l.segment_params[0];
        assert_eq!(step(&cfg, &l, true).gathered, 4 * head);
        let autograd = step(&cfg, &fsdp_layout(&cfg, true), false);
        assert_eq!(autograd.gathered, 4 * cfg.n_params() as u64);
    }

    fn fsdp_layout(cfg: &GptConfig, reshard_after_forward: bool) -> ActivationLayout {
        use mtrain_parallel::fsdp::{FsdpConfig, ZeroStage};
        let mut plan = ParallelPlan::new(mtrain_comm::MeshDims::new(2, 1, 1, 1));
        plan.data = DataParallelKind::Zero(FsdpConfig {
            stage: ZeroStage::Three,
            reshard_after_forward,
            ..FsdpConfig::default()
        });
        ActivationLayout::for_plan(cfg, &plan, 0, 4).expect("fsdp")
    }

    /// Resharding after the forward on the tapes: the forward's end holds the last segment's
    /// weights (with the tied embedding's unit) and the backward the two largest consecutive
    /// segments' gathered again, where keeping them holds every segment's: the after-forward
    /// level falls by every weight but the head's unit, and the peak falls.
    #[test]
    fn resharding_after_the_forward_drops_the_gathered_weights() {
        let cfg = GptConfig {
            n_embd: 32,
            ..small()
        };
        let (kept, freed) = (fsdp_layout(&cfg, false), fsdp_layout(&cfg, true));
        let run = |l: &ActivationLayout| {
            rank_step_memory(&cfg, l, 4, 4, false, BackwardPath::CpuTapes, 4, 4.0)
        };
        let (k, f) = (run(&kept), run(&freed));
        let p = &freed.segment_params;
        let (all, head) = (p.iter().sum::<u64>(), p.last().expect("a head") + p[0]);
        let again = &p[..p.len() - 1];
        let pair = again.windows(2).map(|w| w[0] + w[1]).max().expect("segments");
        assert_eq!(k.activations, f.activations);
        assert_eq!((k.gathered, f.gathered), (4 * all, 4 * head));
        assert_eq!(k.activations + k.gathered - (f.activations + f.gathered), 4 * (all - head));
        assert!(k.peak > f.peak, "{k:?} vs {f:?}");
        assert!(f.peak >= f.activations + f.gathered + 4 * pair, "{f:?}");
    }

    #[test]
    fn checkpointing_shrinks_the_activation_estimate() {
        let cfg = GptConfig::gpt2_124m();
        let full = activation_bytes(&cfg, 8, 1024, 2, false);
        let ckpt = activation_bytes(&cfg, 8, 1024, 2, true);
        assert!(ckpt * 3 < full, "{ckpt} vs {full}");
    }

    /// Context parallelism: a rank keeps its T/cp tokens of each row, so the activations per
    /// rank fall to about 1/cp (GPT-2 124M at T = 4096: within 15% of 1/cp for cp 2 and 4).
    #[test]
    fn context_parallelism_divides_the_activations_by_cp() {
        let cfg = GptConfig::gpt2_124m();
        let of = |cp: usize| {
            let l = ActivationLayout {
                cp,
                ..ActivationLayout::single_device(&cfg, 1)
            };
            rank_step_memory(&cfg, &l, 4096, 4, false, BackwardPath::Tapes, 4, 4.0).activations
                as f64
        };
        let one = of(1);
        for cp in [2, 4] {
            let ratio = of(cp) * cp as f64 / one;
            assert!((0.85..1.15).contains(&ratio), "cp {cp}: {ratio:.3} of 1/cp");
        }
    }
}
