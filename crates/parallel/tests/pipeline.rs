//! Pipeline parallelism against one device: every schedule, on 2 and 4 pipeline ranks (threads
//! talking over loopback TCP), trains a tiny GPT for 10 steps of plain SGD and must match the
//! single-device run step by step — loss within 1e-5 relative, every gradient within 1e-4
//! relative (L2 norm of the difference over the L2 norm of the reference). Also checked: the
//! number of micro-batches alive on each rank equals the schedule's simulated high-water mark
//! (1F1B: min(P − r, M); GPipe: M; ZB-H1: min(P, M)), the recorded timeline (one pass span —
//! forward, backward, B or W — per action in schedule order, a receive wait per input from
//! another rank, a send per output, no overlap, idle = the waits), uneven block counts, bad
//! batches, and stages whose segments run their hand-written backward. The zero-bubble
//! schedules (ZB-H1, ZB-V: the backward split into B and W on the tapes) meet the same
//! tolerances, with and without activation checkpointing.

use std::collections::BTreeMap;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use mtrain_comm::{run_local, Backend, MeshDims};
use mtrain_model::{init_weights, Backward, Engine, Gpt, GptConfig, Grads, NoHooks, Param};
use mtrain_parallel::parallelize::ParallelPlan;
use mtrain_parallel::pipeline::executor::SpanKind;
use mtrain_parallel::pipeline::{
    Action, PipelineError, PipelineExecutor, PipelineStages, Schedule, ScheduleKind, StageLayout,
    StepReport,
};
use rand::{rngs::StdRng, Rng, SeedableRng};

const SEED: u64 = 1234;
const STEPS: usize = 10;
const LR: f64 = 0.1;
const BATCH: usize = 8;
const SEQ: usize = 8;

fn tiny(n_layer: usize) -> GptConfig {
    GptConfig {
        vocab_size: 64,
        block_size: 16,
        n_layer,
        n_head: 2,
        n_embd: 16,
        moe: None,
    }
}

/// The batch of `step`: sequences following x(t+1) = (5·x(t) + 3) mod V from random starts
/// (learnable, so the loss must fall), targets = inputs shifted by one.
fn batch(cfg: &GptConfig, step: usize) -> (Tensor, Tensor) {
    let v = cfg.vocab_size as u32;
    let mut rng = StdRng::seed_from_u64(SEED + step as u64);
    let mut toks = Vec::with_capacity(BATCH * (SEQ + 1));
    for _ in 0..BATCH {
        let mut x = rng.gen_range(0..v);
        for _ in 0..=SEQ {
            toks.push(x);
            x = (5 * x + 3) % v;
        }
    }
    let all = Tensor::from_vec(toks, (BATCH, SEQ + 1), &Device::Cpu).unwrap(); // (B, T + 1)
    (
        all.narrow(1, 0, SEQ).unwrap(),
        all.narrow(1, 1, SEQ).unwrap(),
    ) // (B, T), (B, T)
}

fn sgd(params: &[Param], grads: &Grads) {
    for p in params {
        let g = grads
            .get(p.name())
            .unwrap_or_else(|| panic!("no gradient for {}", p.name()));
        p.set(&(p.tensor().detach() - (g * LR).unwrap()).unwrap())
            .unwrap();
    }
}

/// Per step: the loss and every gradient.
type Trace = Vec<(f64, BTreeMap<String, Tensor>)>;

fn grads_map(grads: &Grads) -> BTreeMap<String, Tensor> {
    grads.iter().map(|(n, g)| (n.clone(), g.clone())).collect()
}

fn weights(params: &[Param]) -> BTreeMap<String, Tensor> {
    params
        .iter()
        .map(|p| (p.name().to_string(), p.tensor().detach()))
        .collect()
}

/// The single-device trace and the weights after the last step.
fn single_device(cfg: &GptConfig) -> (Trace, BTreeMap<String, Tensor>) {
    let model = Gpt::new(cfg.clone(), &init_weights(cfg, SEED).unwrap(), &Device::Cpu).unwrap();
    let params = model.params();
    let trace = (0..STEPS)
        .map(|step| {
            let (idx, targets) = batch(cfg, step);
            let mut grads = Grads::new();
            let (loss, _) = Engine::default()
                .forward_backward(
                    &model.segments,
                    &idx,
                    &targets,
                    1.0,
                    &mut grads,
                    &mut NoHooks,
                )
                .unwrap();
            sgd(&params, &grads);
            (loss, grads_map(&grads))
        })
        .collect();
    (trace, weights(&params))
}

/// Each pipeline rank's trace, step reports and final weights.
fn pipelined(
    cfg: &GptConfig,
    engine: Engine,
    sched: &Schedule,
    layout: &StageLayout,
) -> Vec<(Trace, Vec<StepReport>, BTreeMap<String, Tensor>)> {
    let p = sched.num_ranks();
    run_local(p, Duration::from_secs(60), |backend| {
        let pp = backend.world();
        let model = Gpt::new(cfg.clone(), &init_weights(cfg, SEED).unwrap(), &Device::Cpu).unwrap();
        let stages = PipelineStages::new(&model, layout.clone(), pp.rank(), p).unwrap();
        let params = stages.params();
        let exec = PipelineExecutor::new(sched.clone(), engine);
        let mut trace = Vec::new();
        let mut reports = Vec::new();
        for step in 0..STEPS {
            let (idx, targets) = batch(cfg, step);
            let mut grads = Grads::new();
            let report = exec
                .step(&stages, pp.as_ref(), &idx, &targets, &mut grads)
                .unwrap();
            sgd(&params, &grads);
            trace.push((report.loss, grads_map(&grads)));
            reports.push(report);
        }
        (trace, reports, weights(&params))
    })
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let norm = |t: &Tensor| {
        t.to_dtype(DType::F64)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
            .sqrt()
    };
    norm(&(a - b).unwrap()) / norm(b).max(1e-30)
}

/// Runs the pipeline and checks it against one device; returns the reports for further checks.
fn check_parity(
    cfg: &GptConfig,
    engine: Engine,
    kind: ScheduleKind,
    p: usize,
    m: usize,
    layout: StageLayout,
) -> Vec<Vec<StepReport>> {
    check_parity_of(cfg, engine, &Schedule::new(kind, p, m).unwrap(), layout)
}

/// [`check_parity`] for a given order of passes.
fn check_parity_of(
    cfg: &GptConfig,
    engine: Engine,
    sched: &Schedule,
    layout: StageLayout,
) -> Vec<Vec<StepReport>> {
    let (kind, p, m) = (sched.kind(), sched.num_ranks(), sched.num_microbatches());
    let (reference, ref_weights) = single_device(cfg);
    let ranks = pipelined(cfg, engine, sched, &layout);
    let mut covered = std::collections::BTreeSet::new();
    let (mut worst_loss, mut worst_grad, mut worst_weight) = (0.0f64, 0.0f64, 0.0f64);
    for (r, (trace, _, weights)) in ranks.iter().enumerate() {
        for (step, ((loss, grads), (ref_loss, ref_grads))) in
            trace.iter().zip(&reference).enumerate()
        {
            let loss_rel = (loss - ref_loss).abs() / ref_loss.abs();
            worst_loss = worst_loss.max(loss_rel);
            assert!(
                loss_rel <= 1e-5,
                "{kind} P={p} rank {r} step {step}: loss {loss} vs one device {ref_loss}"
            );
            for (name, g) in grads {
                let e = rel(g, &ref_grads[name]);
                worst_grad = worst_grad.max(e);
                assert!(e <= 1e-4, "{kind} P={p} rank {r} step {step}: gradient of {name} off by {e:.2e} (relative)");
                covered.insert(name.clone());
            }
        }
        // After 10 steps every weight this rank holds (both copies of the tied `wte`) is the
        // single-device weight.
        for (name, w) in weights {
            let e = rel(w, &ref_weights[name]);
            worst_weight = worst_weight.max(e);
            assert!(
                e <= 1e-5,
                "{kind} P={p} rank {r}: weight {name} off by {e:.2e} after {STEPS} steps"
            );
        }
    }
    eprintln!(
        "{kind} P={p} M={m} vs one device over {STEPS} steps: loss rel {worst_loss:.1e}, \
         gradient rel {worst_grad:.1e}, final weight rel {worst_weight:.1e}"
    );
    let all: std::collections::BTreeSet<_> = reference[0].1.keys().cloned().collect();
    assert_eq!(
        covered, all,
        "{kind} P={p}: some parameters got no gradient on any rank"
    );
    let first_loss = reference[0].0;
    let last_loss = reference[STEPS - 1].0;
    assert!(
        last_loss < first_loss,
        "training does not move: {first_loss} -> {last_loss}"
    );
    ranks.into_iter().map(|(_, reports, _)| reports).collect()
}

/// The measured activation high-water mark is the simulated one, and within the schedule's bound.
fn check_in_flight(kind: ScheduleKind, p: usize, m: usize, reports: &[Vec<StepReport>]) {
    let sim = Schedule::new(kind, p, m).unwrap().simulate().unwrap();
    for (r, rank_reports) in reports.iter().enumerate() {
        let r0 = &rank_reports[rank_reports.len() - 1];
        eprintln!(
            "{kind} P={p} M={m} rank {r}: peak in flight {}, measured bubble {:.3} (simulated {:.3}, analytic {:.3})",
            r0.peak_in_flight,
            r0.bubble_fraction,
            sim.bubble_fraction(r),
            r0.analytic_bubble_fraction
        );
        for rep in rank_reports {
            assert_eq!(
                rep.peak_in_flight,
                sim.peak_in_flight(r),
                "{kind} P={p} M={m} rank {r}"
            );
            match kind {
                ScheduleKind::GPipe => assert_eq!(rep.peak_in_flight, m),
                ScheduleKind::OneFOneB => assert!(rep.peak_in_flight <= p - r),
                ScheduleKind::ZeroBubbleH1 => assert!(rep.peak_in_flight <= p.min(m)),
                ScheduleKind::ZeroBubbleV => assert!(rep.peak_in_flight <= 2 * p),
                ScheduleKind::Interleaved1F1B { .. } => {}
            }
            assert!(
                (0.0..=1.0).contains(&rep.bubble_fraction),
                "bubble {}",
                rep.bubble_fraction
            );
        }
    }
}

/// The even layout of `n_layer` blocks over the stages of `kind` on `p` ranks, placed as `kind`
/// places them (ZB-V's V, Megatron's loop otherwise).
fn layout_of(kind: ScheduleKind, p: usize, n_layer: usize) -> StageLayout {
    StageLayout::even(n_layer, p * kind.virtual_stages())
        .unwrap()
        .with_placement(kind.placement())
}

fn run(kind: ScheduleKind, p: usize, m: usize, n_layer: usize) {
    run_with(Engine::default(), kind, p, m, n_layer);
}

fn run_with(engine: Engine, kind: ScheduleKind, p: usize, m: usize, n_layer: usize) {
    let cfg = tiny(n_layer);
    let reports = check_parity(&cfg, engine, kind, p, m, layout_of(kind, p, n_layer));
    check_in_flight(kind, p, m, &reports);
}

#[test]
fn pp2_gpipe_matches_one_device() {
    run(ScheduleKind::GPipe, 2, 4, 2);
}

#[test]
fn pp2_1f1b_matches_one_device() {
    run(ScheduleKind::OneFOneB, 2, 4, 2);
}

/// Pipeline stages whose segments run their hand-written backward (`Backward::Tapes`) against
/// the single-device autograd run, with the tolerances of the autograd runs.
#[test]
fn pp2_1f1b_through_the_tapes_matches_one_device() {
    let cfg = tiny(2);
    let layout = StageLayout::even(2, 2).unwrap();
    let engine = Engine::default().with_backward(Backward::Tapes);
    check_parity(&cfg, engine, ScheduleKind::OneFOneB, 2, 4, layout);
}

#[test]
fn pp2_interleaved_matches_one_device() {
    run(ScheduleKind::Interleaved1F1B { virtual_stages: 2 }, 2, 4, 4);
}

#[test]
fn pp4_gpipe_matches_one_device() {
    run(ScheduleKind::GPipe, 4, 8, 4);
}

#[test]
fn pp4_1f1b_matches_one_device() {
    run(ScheduleKind::OneFOneB, 4, 8, 4);
}

#[test]
fn pp4_interleaved_matches_one_device() {
    run(ScheduleKind::Interleaved1F1B { virtual_stages: 2 }, 4, 8, 8);
}

/// ZB-H1 and ZB-V at pp 2 and 4. Under ZB-V rank 0 holds the first and the last stage (the
/// tied `wte` summed on the rank itself), and each rank passes activations between its own two
/// chunks at the V's turn.
#[test]
fn zero_bubble_schedules_match_one_device() {
    for (kind, p, m, n_layer) in [
        (ScheduleKind::ZeroBubbleH1, 2, 4, 2),
        (ScheduleKind::ZeroBubbleH1, 4, 8, 4),
        (ScheduleKind::ZeroBubbleV, 2, 4, 4),
        (ScheduleKind::ZeroBubbleV, 4, 8, 8),
    ] {
        run(kind, p, m, n_layer);
    }
}

/// The orders built for measured pass costs (`--pass-costs`; F 12.6, B 12.6, W 9.8 ms, the
/// costs the pipeline measured at pp 2, and F 15.4, B 16.8, W 13.5 ms, measured at width 256)
/// train like one device at the same tolerances. The order is the plan's
/// ([`ParallelPlan::schedule`], what `mtrain plan --pass-costs` draws and what `parallelize`
/// hands the executor); each differs from its unit-clock order, and every rank's timeline runs
/// its passes exactly in that order, step after step.
#[test]
fn cost_aware_zero_bubble_orders_match_one_device() {
    // The last: the costs measured at width 256, where single moves after the rule search
    // shorten the order (the schedule's `refined_zb_v_order_is_shorter_at_the_width_256_costs`).
    for (kind, p, m, n_layer, costs) in [
        (ScheduleKind::ZeroBubbleV, 2, 8, 4, [12.6, 12.6, 9.8]),
        (ScheduleKind::ZeroBubbleV, 4, 8, 8, [12.6, 12.6, 9.8]),
        (ScheduleKind::ZeroBubbleV, 2, 8, 4, [15.4, 16.8, 13.5]),
    ] {
        let mut plan = ParallelPlan::new(MeshDims::new(1, p, 1, 1));
        (plan.schedule, plan.microbatches) = (kind, m);
        plan.pass_costs = Some(costs);
        let sched = plan.schedule().unwrap();
        assert_ne!(
            sched,
            Schedule::new(kind, p, m).unwrap(),
            "{kind} P={p} M={m}: the cost-aware order is the unit-clock one"
        );
        let cfg = tiny(n_layer);
        let reports = check_parity_of(&cfg, Engine::default(), &sched, layout_of(kind, p, n_layer));
        for (r, rank_reports) in reports.iter().enumerate() {
            let planned: Vec<_> = sched
                .actions(r)
                .iter()
                .map(|a| (SpanKind::of(a.kind()), a.mb(), a.chunk()))
                .collect();
            for (step, rep) in rank_reports.iter().enumerate() {
                let ran: Vec<_> = rep
                    .timeline
                    .iter()
                    .filter(|s| s.kind.is_pass())
                    .map(|s| (s.kind, s.mb.unwrap(), s.chunk))
                    .collect();
                assert_eq!(
                    ran, planned,
                    "{kind} P={p} rank {r} step {step}: passes run out of the plan's order"
                );
            }
        }
    }
}

/// The split backward under activation checkpointing: B recomputes the stage's forward and
/// keeps its weight products for W.
#[test]
fn zero_bubble_with_checkpointing_matches_one_device() {
    run_with(Engine::new(true), ScheduleKind::ZeroBubbleH1, 4, 8, 4);
    run_with(Engine::new(true), ScheduleKind::ZeroBubbleV, 2, 4, 4);
}

/// One rank holding two chunks passes activations to itself.
#[test]
fn pp1_interleaved_matches_one_device() {
    run(ScheduleKind::Interleaved1F1B { virtual_stages: 2 }, 1, 2, 2);
}

/// 3 blocks on 2 stages: [embedding, h.0, h.1] and [h.2, head], and the other way round.
#[test]
fn uneven_blocks_match_one_device() {
    let cfg = tiny(3);
    let even = StageLayout::even(3, 2).unwrap();
    assert_eq!((even.blocks(0), even.blocks(1)), (0..2, 2..3));
    check_parity(&cfg, Engine::default(), ScheduleKind::OneFOneB, 2, 4, even);
    let explicit = StageLayout::from_counts(3, &[1, 2]).unwrap();
    check_parity(
        &cfg,
        Engine::default(),
        ScheduleKind::OneFOneB,
        2,
        4,
        explicit,
    );
}

/// Recomputing each stage in backward gives the same numbers and keeps fewer bytes alive;
/// 1F1B keeps fewer micro-batches alive than GPipe on the first rank.
#[test]
fn checkpointing_and_1f1b_save_activation_memory() {
    let cfg = tiny(4);
    let layout = || StageLayout::even(4, 4).unwrap();
    let peak = |reports: &[Vec<StepReport>], r: usize| reports[r][0].peak_activation_bytes;
    let gpipe = check_parity(&cfg, Engine::default(), ScheduleKind::GPipe, 4, 8, layout());
    let one_f_one_b = check_parity(
        &cfg,
        Engine::default(),
        ScheduleKind::OneFOneB,
        4,
        8,
        layout(),
    );
    let recompute = check_parity(
        &cfg,
        Engine::new(true),
        ScheduleKind::OneFOneB,
        4,
        8,
        layout(),
    );
    for r in 0..4 {
        eprintln!(
            "rank {r}: peak activation KiB GPipe {:.1}, 1F1B {:.1}, 1F1B + checkpointing {:.1}",
            peak(&gpipe, r) as f64 / 1024.0,
            peak(&one_f_one_b, r) as f64 / 1024.0,
            peak(&recompute, r) as f64 / 1024.0
        );
        assert!(peak(&recompute, r) < peak(&one_f_one_b, r), "rank {r}");
        assert!(peak(&one_f_one_b, r) <= peak(&gpipe, r), "rank {r}");
    }
    assert!(
        peak(&one_f_one_b, 0) * 2 == peak(&gpipe, 0),
        "rank 0 holds 4 of 8 micro-batches under 1F1B"
    );
}

#[test]
fn a_batch_that_does_not_split_is_refused() {
    let cfg = tiny(2);
    let errs = run_local(2, Duration::from_secs(30), |backend| {
        let pp = backend.world();
        let model = Gpt::new(
            cfg.clone(),
            &init_weights(&cfg, SEED).unwrap(),
            &Device::Cpu,
        )
        .unwrap();
        let stages =
            PipelineStages::new(&model, StageLayout::even(2, 2).unwrap(), pp.rank(), 2).unwrap();
        let exec = PipelineExecutor::new(
            Schedule::new(ScheduleKind::OneFOneB, 2, 3).unwrap(),
            Engine::default(),
        );
        let (idx, targets) = batch(&cfg, 0); // 8 sequences, 3 micro-batches
        exec.step(&stages, pp.as_ref(), &idx, &targets, &mut Grads::new())
            .unwrap_err()
    });
    for e in errs {
        assert!(
            matches!(
                e,
                PipelineError::UnevenBatch {
                    batch: 8,
                    microbatches: 3
                }
            ),
            "{e}"
        );
        assert!(
            e.to_string().contains("8 sequences cannot be split into 3"),
            "{e}"
        );
    }
}

/// The timeline holds one forward or backward span per action, in the schedule's order; a
/// receive wait for every input and a send for every output that crosses to another rank; the
/// spans follow one another without overlap inside the step; the idle time is exactly the step
/// less its passes (so at least the receive waits and the final wait for sends); and the pass
/// costs behind the prediction are this rank's mean pass times.
fn check_timeline(kind: ScheduleKind, p: usize, m: usize, reports: &[Vec<StepReport>]) {
    let sched = Schedule::new(kind, p, m).unwrap();
    for (r, rank_reports) in reports.iter().enumerate() {
        let actions = sched.actions(r);
        let crosses = |stage: Option<usize>| stage.is_some_and(|s| sched.rank_of_stage(s) != r);
        let recvs = actions
            .iter()
            .filter(|a| crosses(sched.input_stage(r, a)))
            .count();
        let sends = actions
            .iter()
            .filter(|a| crosses(sched.output_stage(r, a)))
            .count();
        for rep in rank_reports {
            let t = &rep.timeline;
            let count = |k: SpanKind| t.iter().filter(|s| s.kind == k).count();
            let compute: Vec<(SpanKind, usize, usize)> = t
                .iter()
                .filter(|s| s.kind.is_pass())
                .map(|s| (s.kind, s.mb.unwrap(), s.chunk))
                .collect();
            let span_of = |a: &Action| match a {
                Action::Forward { .. } => SpanKind::Forward,
                Action::Backward { .. } => SpanKind::Backward,
                Action::InputGrad { .. } => SpanKind::InputGrad,
                Action::WeightGrad { .. } => SpanKind::WeightGrad,
            };
            let expected: Vec<(SpanKind, usize, usize)> = actions
                .iter()
                .map(|a| (span_of(a), a.mb(), a.chunk()))
                .collect();
            assert_eq!(compute, expected, "{kind} P={p} rank {r}: compute spans");
            assert_eq!(count(SpanKind::RecvWait), recvs, "{kind} P={p} rank {r}");
            assert_eq!(count(SpanKind::Send), sends, "{kind} P={p} rank {r}");
            assert!(count(SpanKind::SendWait) <= 1);
            for w in t.windows(2) {
                assert!(w[0].start <= w[0].end && w[0].end <= w[1].start, "{w:?}");
            }
            assert!(t.last().unwrap().end <= rep.step_time);
            let waited: Duration = t
                .iter()
                .filter(|s| matches!(s.kind, SpanKind::RecvWait | SpanKind::SendWait))
                .map(|s| s.end - s.start)
                .sum();
            let passes: Duration = t
                .iter()
                .filter(|s| s.kind.is_pass())
                .map(|s| s.end - s.start)
                .sum();
            assert_eq!(
                rep.idle_time,
                rep.step_time - passes,
                "{kind} P={p} rank {r}"
            );
            assert!(waited <= rep.idle_time, "{kind} P={p} rank {r}");
            assert_eq!(rep.pass_costs.len(), sched.num_model_stages());
            for c in 0..sched.virtual_stages() {
                let mean = |k: SpanKind| {
                    t.iter()
                        .filter(|s| s.kind == k && s.chunk == c)
                        .map(|s| (s.end - s.start).as_secs_f64())
                        .sum::<f64>()
                        / m as f64
                };
                let costs = rep.pass_costs[sched.model_stage(r, c)];
                let pairs = match kind.splits_backward() {
                    true => [
                        (costs.forward, mean(SpanKind::Forward)),
                        (costs.input_grad, mean(SpanKind::InputGrad)),
                        (costs.weight_grad, mean(SpanKind::WeightGrad)),
                    ],
                    false => [
                        (costs.forward, mean(SpanKind::Forward)),
                        (costs.backward, mean(SpanKind::Backward)),
                        (0.0, 0.0),
                    ],
                };
                for (got, want) in pairs {
                    assert!((got - want).abs() <= 1e-9 * want.max(1.0), "{got} {want}");
                }
            }
            assert!((0.0..=1.0).contains(&rep.predicted_bubble_fraction));
        }
    }
}

#[test]
fn timeline_records_every_action_and_wait() {
    for (kind, p, m, n_layer) in [
        (ScheduleKind::OneFOneB, 2, 4, 2),
        (ScheduleKind::GPipe, 4, 4, 4),
        (ScheduleKind::Interleaved1F1B { virtual_stages: 2 }, 2, 4, 4),
        (ScheduleKind::ZeroBubbleH1, 2, 4, 2),
        (ScheduleKind::ZeroBubbleV, 2, 4, 4),
    ] {
        let cfg = tiny(n_layer);
        let layout = layout_of(kind, p, n_layer);
        let sched = Schedule::new(kind, p, m).unwrap();
        let reports: Vec<Vec<StepReport>> = pipelined(&cfg, Engine::default(), &sched, &layout)
            .into_iter()
            .map(|(_, reports, _)| reports)
            .collect();
        check_timeline(kind, p, m, &reports);
    }
}
