//! 4D composition against one device (CPU, ranks as threads; a few layouts again on a GPU
//! where there is one).
//!
//! - `*_equals_one_device`: a layout from `parallelize` trains 5 AdamW steps (gradient clipping
//!   on) next to a single-device GPT run by the plain engine on the same global batches: every
//!   step's loss (rel ≤ 1e-5), full gradients (rel ≤ 1e-4 per tensor) and gradient norm
//!   (rel ≤ 1e-5), and the final weights (rel ≤ 1e-4), on every rank.
//! - `reshard_*`: the full weights and AdamW state saved under one layout, loaded under another,
//!   give the next step's loss and norm of the uninterrupted single-device run.
//! - `validate_*`: impossible layouts are refused with the arithmetic shown.
//! - `dropout_*`: the same comparison with dropout 0.1 at every site, same tolerances: each
//!   layout draws, for every element, the mask one device draws (its rows of the global batch,
//!   its heads, its positions, its stages, its recompute).

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use candle_core::{Device, Tensor};
use mtrain_comm::cpu::run_local;
use mtrain_comm::{Backend, DeviceMesh, StagedBackend};
use mtrain_model::optim::{clip_coef, AdamWState};
use mtrain_model::{init_weights, Backward, Engine, Gpt, GptConfig, Grads, NoHooks, StepDraw};
use mtrain_parallel::ddp::DdpConfig;
use mtrain_parallel::fsdp::ZeroStage;
use mtrain_parallel::holdings::Holdings;
use mtrain_parallel::parallelize::{describe, parallelize, DataParallelKind, ParallelPlan};
use mtrain_parallel::pipeline::ScheduleKind;
use mtrain_parallel::placement::Placement;
use mtrain_parallel::tensor_parallel::TpOverlap;
use rand::{Rng, SeedableRng};

use common::{adamw, cp_plan, optim_items, plan, rel, rel_f, tiny_gpt, with_moe, zero};

const STEPS: usize = 5;
const BATCH: usize = 8;
const SEQ: usize = 8;
const LR: f64 = 3e-3;
/// Low enough that clipping is active, so the global norm must be right.
const MAX_NORM: f64 = 0.5;
const SEED: u64 = 7;
/// The drop probability of the `dropout_*` tests.
const DROPOUT: f64 = 0.1;

/// Step `s`'s dropout at probability `p` (None at 0).
fn draw(p: f64, s: usize) -> Option<StepDraw> {
    (p > 0.0).then_some(StepDraw {
        p,
        seed: SEED,
        step: s as u64,
        micro: 0,
    })
}

fn cfg() -> GptConfig {
    tiny_gpt(4, 4, 32)
}

fn moe_cfg() -> GptConfig {
    with_moe(cfg())
}

/// Step `s`'s global batch (idx, targets), both (BATCH, SEQ) u32.
fn batch(cfg: &GptConfig, s: usize) -> (Tensor, Tensor) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(1000 + s as u64);
    let mut draw = || -> Vec<u32> {
        (0..BATCH * SEQ)
            .map(|_| rng.gen_range(0..cfg.vocab_size as u32))
            .collect()
    };
    let idx = Tensor::from_vec(draw(), (BATCH, SEQ), &Device::Cpu).expect("idx");
    let tgt = Tensor::from_vec(draw(), (BATCH, SEQ), &Device::Cpu).expect("targets");
    (idx, tgt)
}

/// [`batch`] on `dev`.
fn batch_on(dev: &Device, cfg: &GptConfig, s: usize) -> (Tensor, Tensor) {
    let (idx, tgt) = batch(cfg, s);
    let on = |t: Tensor| t.to_device(dev).expect("batch to device");
    (on(idx), on(tgt))
}

/// What a run records per step.
#[derive(Clone)]
struct Trace {
    losses: Vec<f64>,
    norms: Vec<f64>,
    grads: Vec<BTreeMap<String, Tensor>>,
    weights: BTreeMap<String, Tensor>,
}

/// The single-device run: the plain engine over the whole model on the plan's backward path
/// (autograd or the tapes, so the comparison is of the layout alone), each global batch cut
/// into `groups` equal slices accumulated with weight 1/groups (one routing group per dp rank
/// for MoE; for a dense model the slicing does not change the gradient).
fn one_device(
    cfg: &GptConfig,
    steps: usize,
    groups: usize,
    backward: Backward,
) -> (Trace, AdamWState) {
    one_device_on(&Device::Cpu, cfg, steps, groups, backward)
}

/// [`one_device`] on `dev`.
fn one_device_on(
    dev: &Device,
    cfg: &GptConfig,
    steps: usize,
    groups: usize,
    backward: Backward,
) -> (Trace, AdamWState) {
    one_device_dropout(dev, cfg, steps, groups, backward, 0.0)
}

/// [`one_device_on`] with dropout `p`: slice g of the global batch is rows `g·B/groups ..`.
fn one_device_dropout(
    dev: &Device,
    cfg: &GptConfig,
    steps: usize,
    groups: usize,
    backward: Backward,
    p: f64,
) -> (Trace, AdamWState) {
    let weights = init_weights(cfg, SEED).expect("init");
    let gpt = Gpt::new(cfg.clone(), &weights, dev).expect("gpt");
    let params = gpt.params();
    let engine = Engine::new(false).with_backward(backward);
    let mut opt = adamw();
    let mut t = Trace {
        losses: vec![],
        norms: vec![],
        grads: vec![],
        weights: BTreeMap::new(),
    };
    for s in 0..steps {
        let (idx, tgt) = batch_on(dev, cfg, s);
        let b = BATCH / groups;
        let mut grads = Grads::new();
        let mut loss = 0.0;
        for g in 0..groups {
            let (i, y) = (
                idx.narrow(0, g * b, b).expect("i"),
                tgt.narrow(0, g * b, b).expect("y"),
            );
            let engine = engine.with_dropout(draw(p, s).map(|d| d.rows(g * b, BATCH)));
            let (l, _) = engine
                .forward_backward(
                    &gpt.segments,
                    &i,
                    &y,
                    1.0 / groups as f64,
                    &mut grads,
                    &mut NoHooks,
                )
                .expect("fb");
            loss += l / groups as f64;
        }
        let norm = grads.sq_norm().expect("norm").sqrt();
        let c = clip_coef(norm, MAX_NORM);
        let clipped: BTreeMap<String, Tensor> = grads
            .iter()
            .map(|(n, g)| (n.clone(), (g * c).expect("clip")))
            .collect();
        assert_eq!(
            clipped.len(),
            params.len(),
            "every parameter has a gradient"
        );
        opt.step(LR, &optim_items(&params, |n| clipped.get(n)))
            .expect("adamw");
        t.losses.push(loss);
        t.norms.push(norm);
        t.grads
            .push(grads.iter().map(|(n, g)| (n.clone(), g.clone())).collect());
    }
    t.weights = params
        .iter()
        .map(|p| (p.name().to_string(), p.tensor().detach()))
        .collect();
    (t, opt.state().expect("optimizer state"))
}

/// Runs `plan` on its world of threads for `steps` steps, optionally starting from saved full
/// weights and optimizer state and from step `first`; returns every rank's trace and rank 0's
/// full optimizer state at the end.
fn run_plan(
    cfg: &GptConfig,
    plan: &ParallelPlan,
    first: usize,
    steps: usize,
    resume: Option<&(BTreeMap<String, Tensor>, AdamWState)>,
) -> Vec<(Trace, AdamWState)> {
    run_plan_on(&Device::Cpu, cfg, plan, first, steps, resume)
}

/// [`run_plan`] on `dev`: on a GPU every rank computes on it and the groups run through the
/// CPU backend ([`StagedBackend`]).
fn run_plan_on(
    dev: &Device,
    cfg: &GptConfig,
    plan: &ParallelPlan,
    first: usize,
    steps: usize,
    resume: Option<&(BTreeMap<String, Tensor>, AdamWState)>,
) -> Vec<(Trace, AdamWState)> {
    run_plan_dropout(dev, cfg, plan, first, steps, resume, 0.0)
}

/// [`run_plan_on`] with dropout `p`.
fn run_plan_dropout(
    dev: &Device,
    cfg: &GptConfig,
    plan: &ParallelPlan,
    first: usize,
    steps: usize,
    resume: Option<&(BTreeMap<String, Tensor>, AdamWState)>,
    p: f64,
) -> Vec<(Trace, AdamWState)> {
    let world = plan.dims.world_size();
    let plan = &plan.validate(cfg, world, BATCH).expect("plan validates");
    run_local(world, Duration::from_secs(120), |backend| {
        let backend: Box<dyn Backend> = match dev.is_cuda() {
            true => Box::new(StagedBackend {
                inner: backend,
                device: dev.clone(),
            }),
            false => Box::new(backend),
        };
        let mesh = DeviceMesh::new(backend.as_ref(), plan.dims).expect("mesh");
        let weights = init_weights(cfg, SEED).expect("init");
        let mut model = parallelize(cfg, &weights, plan, &mesh, dev).expect("parallelize");
        let mut opt = adamw();
        if let Some((w, st)) = resume {
            model.load_full_state(w).expect("load weights");
            model
                .load_optimizer_state(&mut opt, st)
                .expect("load optimizer");
        }
        let b = BATCH / plan.dims.dp;
        let dp_idx = mesh.coords.dp;
        let mut t = Trace {
            losses: vec![],
            norms: vec![],
            grads: vec![],
            weights: BTreeMap::new(),
        };
        for s in first..first + steps {
            let (idx, tgt) = batch_on(dev, cfg, s);
            let (i, y) = (
                idx.narrow(0, dp_idx * b, b).expect("i"),
                tgt.narrow(0, dp_idx * b, b).expect("y"),
            );
            model.set_dropout(draw(p, s));
            let out = model
                .forward_backward(&i, &y, 1.0, true)
                .expect("forward_backward");
            t.grads.push(model.full_grads().expect("full grads"));
            let norm = model
                .optimizer_step(&mut opt, LR, Some(MAX_NORM))
                .expect("step");
            t.losses.push(out.loss);
            t.norms.push(norm);
        }
        t.weights = model.full_state().expect("full state");
        let st = model.full_optimizer_state(&opt).expect("optimizer state");
        (t, st)
    })
}

/// Every rank of `plan` equals the single-device run.
fn check_equals_one_device(cfg: &GptConfig, plan: &ParallelPlan, groups: usize) {
    check_equals_one_device_on(&Device::Cpu, cfg, plan, groups)
}

/// [`check_equals_one_device`] with both runs on `dev`.
fn check_equals_one_device_on(dev: &Device, cfg: &GptConfig, plan: &ParallelPlan, groups: usize) {
    check_dropout_equals_one_device(dev, cfg, plan, groups, 0.0)
}

/// [`check_equals_one_device_on`] with dropout `p` in both runs.
fn check_dropout_equals_one_device(
    dev: &Device,
    cfg: &GptConfig,
    plan: &ParallelPlan,
    groups: usize,
    p: f64,
) {
    let (want, _) = one_device_dropout(dev, cfg, STEPS, groups, plan.backward, p);
    if p > 0.0 {
        // The masks are in both runs, not in neither: every gradient of the first step moved.
        let (plain, _) = one_device_dropout(dev, cfg, 1, groups, plan.backward, 0.0);
        for (name, g) in &plain.grads[0] {
            let d = rel(&want.grads[0][name], g);
            assert!(
                d > 1e-3,
                "dropout {p} changed the gradient of {name} by only {d:.1e}"
            );
        }
    }
    let ranks = run_plan_dropout(dev, cfg, plan, 0, STEPS, None, p);
    let (mut worst_loss, mut worst_grad, mut worst_norm) = (0f64, 0f64, 0f64);
    for (r, (got, _)) in ranks.iter().enumerate() {
        for s in 0..STEPS {
            let l = rel_f(got.losses[s], want.losses[s]);
            assert!(
                l <= 1e-5,
                "rank {r} step {s}: loss {} vs {} (rel {l:.2e})",
                got.losses[s],
                want.losses[s]
            );
            let n = rel_f(got.norms[s], want.norms[s]);
            assert!(
                n <= 1e-5,
                "rank {r} step {s}: norm {} vs {} (rel {n:.2e})",
                got.norms[s],
                want.norms[s]
            );
            assert_eq!(
                got.grads[s].len(),
                want.grads[s].len(),
                "rank {r}: gradient count"
            );
            for (name, g) in &want.grads[s] {
                let e = rel(&got.grads[s][name], g);
                assert!(
                    e <= 1e-4,
                    "rank {r} step {s}: gradient of {name} rel {e:.2e}"
                );
                worst_grad = worst_grad.max(e);
            }
            worst_loss = worst_loss.max(l);
            worst_norm = worst_norm.max(n);
        }
        for (name, w) in &want.weights {
            let e = rel(&got.weights[name], w);
            assert!(e <= 1e-4, "rank {r}: final {name} rel {e:.2e}");
        }
    }
    println!(
        "{:?}: worst rel loss {worst_loss:.1e}, grad {worst_grad:.1e}, norm {worst_norm:.1e}; losses {:?}",
        plan.dims, want.losses
    );
}

#[test]
fn tp2_pp2_dp2_equals_one_device() {
    check_equals_one_device(&cfg(), &plan(2, 2, 2, 1), 1);
}

/// `--tp-overlap chunked`: the row layers' g and the column layers' input-gradient all-reduce
/// cut into chunks of the micro-batch's sequences, same tolerances.
#[test]
fn tp2_pp2_dp2_chunked_equals_one_device() {
    let p = ParallelPlan {
        tp_overlap: TpOverlap::Chunked,
        ..plan(2, 2, 2, 1)
    };
    check_equals_one_device(&cfg(), &p, 1);
}

/// `--tp-overlap ring` with sequence parallelism: each block's sequence all-gathers and
/// reduce-scatters passed part by part around the tp ring with the products, same tolerances.
#[test]
fn tp2_pp2_dp2_sp_ring_equals_one_device() {
    let p = ParallelPlan {
        sequence_parallel: true,
        tp_overlap: TpOverlap::Ring,
        ..plan(2, 2, 2, 1)
    };
    check_equals_one_device(&cfg(), &p, 1);
}

#[test]
fn cp2_equals_one_device() {
    check_equals_one_device(&cfg(), &cp_plan(2, 1, 1, 1), 1);
}

#[test]
fn cp4_equals_one_device() {
    check_equals_one_device(&cfg(), &cp_plan(4, 1, 1, 1), 1);
}

#[test]
fn cp2_pp2_dp2_equals_one_device() {
    check_equals_one_device(&cfg(), &cp_plan(2, 2, 2, 1), 1);
}

/// The ring over each tp rank's heads: the column and row layers' collectives inside the
/// ring's blocks, the vocabulary-parallel embedding at the chunks' positions.
#[test]
fn cp2_tp2_equals_one_device() {
    check_equals_one_device(&cfg(), &cp_plan(2, 1, 1, 2), 1);
}

/// ZeRO-3 (FSDP) shards over dp × cp: 4 shards with dp 2 × cp 2.
#[test]
fn cp2_dp2_zero3_equals_one_device() {
    let p = ParallelPlan {
        data: zero(ZeroStage::Three),
        ..cp_plan(2, 2, 1, 1)
    };
    check_equals_one_device(&cfg(), &p, 1);
}

/// Dropout 0.1 at every site under context parallelism: each rank draws the embedding and
/// residual masks at its chunks' positions and, block by block of the ring, the
/// probabilities' mask at the (query, key) pairs it computes; the same tolerances.
#[test]
fn dropout_cp2_equals_one_device() {
    check_dropout_equals_one_device(&Device::Cpu, &cfg(), &cp_plan(2, 1, 1, 1), 1, DROPOUT);
}

#[test]
fn dropout_cp4_equals_one_device() {
    check_dropout_equals_one_device(&Device::Cpu, &cfg(), &cp_plan(4, 1, 1, 1), 1, DROPOUT);
}

/// Each tp rank's heads of the ring's blocks draw their heads' part of the mask.
#[test]
fn dropout_cp2_tp2_equals_one_device() {
    check_dropout_equals_one_device(&Device::Cpu, &cfg(), &cp_plan(2, 1, 1, 2), 1, DROPOUT);
}

/// The rows of each dp index, each pipeline micro-batch's, under the ring.
#[test]
fn dropout_cp2_pp2_dp2_equals_one_device() {
    check_dropout_equals_one_device(&Device::Cpu, &cfg(), &cp_plan(2, 2, 2, 1), 1, DROPOUT);
}

#[test]
fn dropout_cp2_dp2_zero3_equals_one_device() {
    let p = ParallelPlan {
        data: zero(ZeroStage::Three),
        ..cp_plan(2, 2, 1, 1)
    };
    check_dropout_equals_one_device(&Device::Cpu, &cfg(), &p, 1, DROPOUT);
}

/// What context parallelism does not take is refused with the reason.
#[test]
fn validate_refuses_what_cp_does_not_take() {
    let cfg = cfg();
    let err = |p: &ParallelPlan| p.validate(&cfg, p.dims.world_size(), BATCH).unwrap_err().to_string();
    let e = err(&cp_plan(3, 1, 1, 1));
    assert!(e.contains("block_size 16 is not divisible by 2·cp = 6"), "{e}");
    let autograd = ParallelPlan {
        backward: Backward::Autograd,
        ..cp_plan(2, 1, 1, 1)
    };
    assert!(err(&autograd).contains("needs the hand-written backward"));
    let e = cp_plan(2, 1, 1, 1).validate(&cfg, 4, BATCH).unwrap_err().to_string();
    assert!(e.contains("dp(1) * pp(1) * cp(2) * tp(1) = 2 != world size 4"), "{e}");
}

#[test]
fn tp4_pp2_equals_one_device() {
    let p = ParallelPlan {
        schedule: ScheduleKind::GPipe,
        ..plan(1, 2, 4, 1)
    };
    check_equals_one_device(&cfg(), &p, 1);
}

#[test]
fn pp2_dp2_zero3_equals_one_device() {
    let p = ParallelPlan {
        data: zero(ZeroStage::Three),
        checkpointing: true,
        ..plan(2, 2, 1, 1)
    };
    check_equals_one_device(&cfg(), &p, 1);
}

#[test]
fn dp2_ep2_moe_equals_one_device() {
    check_equals_one_device(&moe_cfg(), &plan(2, 1, 1, 2), 2);
}

/// The same plan on the hand-written backward of every segment (the MoE block's tape with its
/// dispatch and combine conjugates, the head's and the embedding's), same tolerances.
#[test]
fn dp2_ep2_moe_on_the_tapes_equals_one_device() {
    let p = ParallelPlan {
        backward: Backward::Tapes,
        ..plan(2, 1, 1, 2)
    };
    check_equals_one_device(&moe_cfg(), &p, 2);
}

/// `--ep-overlap`: each micro-batch's tokens in parts, each part's dispatch and combine on the
/// wire while a neighbouring part's experts compute, forward and backward; same tolerances.
#[test]
fn dp2_ep2_moe_ep_overlap_equals_one_device() {
    let p = ParallelPlan {
        ep_overlap: true,
        ..plan(2, 1, 1, 2)
    };
    check_equals_one_device(&moe_cfg(), &p, 2);
}

/// tp × pp on the tapes: the column/row tapes with their f/g collectives, pipeline stages.
#[test]
fn tp2_pp2_on_the_tapes_equals_one_device() {
    let p = ParallelPlan {
        backward: Backward::Tapes,
        ..plan(1, 2, 2, 1)
    };
    check_equals_one_device(&cfg(), &p, 2);
}

/// Every segment kind's tape under its layout on a GPU, against one device on the same GPU with
/// the same tolerances: tp × pp × dp (the column/row tapes, the vocab-parallel embedding and
/// head, pipeline stages, DDP), ZeRO-3 with pp and checkpointing (gather, run, reduce-scatter),
/// sequence parallelism under ZeRO-2, and dp × ep MoE (dispatch and combine). The ranks share
/// the device; their groups run through the CPU backend.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs a CUDA device: build with --features cuda")]
fn layouts_on_the_tapes_on_cuda_equal_one_device() {
    let dev = mtrain_kernels::testing::cuda();
    let tapes = |p: ParallelPlan| ParallelPlan {
        backward: Backward::Tapes,
        ..p
    };
    check_equals_one_device_on(&dev, &cfg(), &tapes(plan(2, 2, 2, 1)), 1);
    let zero3 = ParallelPlan {
        data: zero(ZeroStage::Three),
        checkpointing: true,
        ..plan(2, 2, 1, 1)
    };
    check_equals_one_device_on(&dev, &cfg(), &tapes(zero3), 1);
    let sp_zero2 = ParallelPlan {
        data: zero(ZeroStage::Two),
        sequence_parallel: true,
        ..plan(2, 1, 2, 1)
    };
    check_equals_one_device_on(&dev, &cfg(), &tapes(sp_zero2), 1);
    check_equals_one_device_on(&dev, &moe_cfg(), &tapes(plan(2, 1, 1, 2)), 2);
}

/// tp × pp × dp with dropout: TP ranks' heads, pipeline micro-batches' and dp ranks' rows,
/// the vocab-parallel embedding.
#[test]
fn dropout_tp2_pp2_dp2_equals_one_device() {
    check_dropout_equals_one_device(&Device::Cpu, &cfg(), &plan(2, 2, 2, 1), 1, DROPOUT);
}

/// Dropout with `--tp-overlap chunked`: attention and the MLP run a chunk of the micro-batch's
/// sequences at a time, each chunk drawing its own sequences' masks.
#[test]
fn dropout_tp2_pp2_dp2_chunked_equals_one_device() {
    let p = ParallelPlan {
        tp_overlap: TpOverlap::Chunked,
        ..plan(2, 2, 2, 1)
    };
    check_dropout_equals_one_device(&Device::Cpu, &cfg(), &p, 1, DROPOUT);
}

/// Dropout under ZeRO-3, pp and activation checkpointing: the recompute draws the same masks.
#[test]
fn dropout_pp2_dp2_zero3_checkpointing_equals_one_device() {
    let p = ParallelPlan {
        data: zero(ZeroStage::Three),
        checkpointing: true,
        ..plan(2, 2, 1, 1)
    };
    check_dropout_equals_one_device(&Device::Cpu, &cfg(), &p, 1, DROPOUT);
}

/// Dropout with sequence parallelism (each rank's positions of the residual branches and of the
/// embedding) and ZeRO-2.
#[test]
fn dropout_tp2_sp_dp2_zero2_equals_one_device() {
    let p = ParallelPlan {
        data: zero(ZeroStage::Two),
        sequence_parallel: true,
        ..plan(2, 1, 2, 1)
    };
    check_dropout_equals_one_device(&Device::Cpu, &cfg(), &p, 1, DROPOUT);
}

/// Dropout under expert parallelism (the MoE block's feed-forward branch dropped like the MLP's).
#[test]
fn dropout_dp2_ep2_moe_equals_one_device() {
    check_dropout_equals_one_device(&Device::Cpu, &moe_cfg(), &plan(2, 1, 1, 2), 2, DROPOUT);
}

/// Dropout on autograd's path (the recorded masks) with tp × sp × interleaved pp.
#[test]
fn dropout_pp2_tp2_sp_interleaved_autograd_equals_one_device() {
    let p = ParallelPlan {
        sequence_parallel: true,
        schedule: ScheduleKind::Interleaved1F1B { virtual_stages: 2 },
        backward: Backward::Autograd,
        ..plan(1, 2, 2, 1)
    };
    check_dropout_equals_one_device(&Device::Cpu, &cfg(), &p, 1, DROPOUT);
}

/// DDP on one stage: the dp average runs inside the last backward in DDP's buckets
/// (`BucketedDpReduce`), and the sequence-parallel partial gradients are summed over tp after it.
#[test]
fn tp2_sp_dp2_ddp_overlapped_equals_one_device() {
    let p = ParallelPlan {
        sequence_parallel: true,
        ..plan(2, 1, 2, 1)
    };
    check_equals_one_device(&cfg(), &p, 1);
}

#[test]
fn tp2_sp_dp2_zero2_equals_one_device() {
    let p = ParallelPlan {
        data: zero(ZeroStage::Two),
        sequence_parallel: true,
        ..plan(2, 1, 2, 1)
    };
    check_equals_one_device(&cfg(), &p, 1);
}

#[test]
fn pp2_tp2_sp_interleaved_equals_one_device() {
    let p = ParallelPlan {
        sequence_parallel: true,
        schedule: ScheduleKind::Interleaved1F1B { virtual_stages: 2 },
        ..plan(1, 2, 2, 1)
    };
    check_equals_one_device(&cfg(), &p, 1);
}

/// The zero-bubble schedules (the backward split into B and W) and `plan`, four micro-batches.
fn zero_bubble(kind: ScheduleKind, p: ParallelPlan) -> ParallelPlan {
    ParallelPlan {
        schedule: kind,
        microbatches: 4,
        ..p
    }
}

const ZERO_BUBBLE: [ScheduleKind; 2] = [ScheduleKind::ZeroBubbleH1, ScheduleKind::ZeroBubbleV];

/// tp × pp under ZB-H1 and ZB-V: the column/row tapes' B with their f/g conjugates, the
/// vocab-parallel head's B and W, the vocab-parallel embedding's whole backward in W.
#[test]
fn tp2_pp2_zero_bubble_equals_one_device() {
    for kind in ZERO_BUBBLE {
        check_equals_one_device(&cfg(), &zero_bubble(kind, plan(1, 2, 2, 1)), 1);
    }
}

/// dp × pp with DDP under ZB-H1 and ZB-V: the replicas' gradients, final after each chunk's
/// last W, averaged after the flush.
#[test]
fn pp2_dp2_ddp_zero_bubble_equals_one_device() {
    for kind in ZERO_BUBBLE {
        check_equals_one_device(&cfg(), &zero_bubble(kind, plan(2, 2, 1, 1)), 1);
    }
}

/// The ZeRO stages and activation checkpointing the zero-bubble ZeRO tests run.
const ZERO_CASES: [(ZeroStage, bool); 4] = [
    (ZeroStage::One, false),
    (ZeroStage::Two, false),
    (ZeroStage::Two, true),
    (ZeroStage::Three, true),
];

/// dp × pp with ZeRO under ZB-H1: each W's post-backward hook reduce-scatters the segment's
/// gradient (stage 1: the chunk's last W), with and without activation checkpointing (B
/// recomputes; stage 3 gathers there and frees after W).
#[test]
fn pp2_dp2_zero_zero_bubble_equals_one_device() {
    for (stage, checkpointing) in ZERO_CASES {
        let p = ParallelPlan {
            data: zero(stage),
            checkpointing,
            ..plan(2, 2, 1, 1)
        };
        check_equals_one_device(&cfg(), &zero_bubble(ScheduleKind::ZeroBubbleH1, p), 1);
    }
}

/// dp × pp with ZeRO under ZB-V: pipeline rank 0 runs the embedding and the tied LM head as
/// two chunks of one ZeRO strategy, so `wte` is one unit (one shard, one optimizer state)
/// whose reduce-scatter after the embedding's W carries the head's gradient too; stage 3
/// gathers it for both chunks.
#[test]
fn pp2_dp2_zero_zb_v_equals_one_device() {
    for (stage, checkpointing) in ZERO_CASES {
        let p = ParallelPlan {
            data: zero(stage),
            checkpointing,
            ..plan(2, 2, 1, 1)
        };
        check_equals_one_device(&cfg(), &zero_bubble(ScheduleKind::ZeroBubbleV, p), 1);
    }
}

/// tp × pp × dp with ZeRO-2 under ZB-V: the vocab-parallel `wte` shard of each tp rank is one
/// ZeRO unit on pipeline rank 0.
#[test]
fn tp2_pp2_dp2_zero2_zb_v_equals_one_device() {
    let p = ParallelPlan {
        data: zero(ZeroStage::Two),
        ..plan(2, 2, 2, 1)
    };
    check_equals_one_device(&cfg(), &zero_bubble(ScheduleKind::ZeroBubbleV, p), 1);
}

/// tp × pp × dp with activation checkpointing under ZB-V, without dropout and with it (the
/// recompute in B and the embedding's backward in W draw the masks one device draws).
#[test]
fn tp2_pp2_dp2_zero_bubble_checkpointing_equals_one_device() {
    let p = ParallelPlan {
        checkpointing: true,
        ..plan(2, 2, 2, 1)
    };
    let p = zero_bubble(ScheduleKind::ZeroBubbleV, p);
    for dropout in [0.0, DROPOUT] {
        check_dropout_equals_one_device(&Device::Cpu, &cfg(), &p, 1, dropout);
    }
}

/// The holdings table is the model `parallelize` builds, on every rank of the composition
/// layouts (tp × pp × dp, tp × interleaved pp with sequence parallelism, ZeRO-3 under pp,
/// ZeRO-2 under ZB-V, whose rank 0 lists the tied `wte` once for its two chunks, dp × ep MoE):
/// the same parameters by name and local shape, in the order the optimizer steps them, their
/// elements summed to the table's count, each owner a rank whose table holds the parameter,
/// the partial gradients exactly the replicated ones under sequence parallelism.
#[test]
fn the_holdings_table_is_the_model_parallelize_builds() {
    let interleaved = ParallelPlan {
        sequence_parallel: true,
        schedule: ScheduleKind::Interleaved1F1B { virtual_stages: 2 },
        ..plan(1, 2, 2, 1)
    };
    let zero3 = ParallelPlan {
        data: zero(ZeroStage::Three),
        ..plan(2, 2, 1, 1)
    };
    let zero2_v = ParallelPlan {
        data: zero(ZeroStage::Two),
        ..zero_bubble(ScheduleKind::ZeroBubbleV, plan(2, 2, 1, 1))
    };
    let layouts = [
        (cfg(), plan(2, 2, 2, 1)),
        (cfg(), interleaved),
        (cfg(), zero3),
        (cfg(), zero2_v),
        (moe_cfg(), plan(2, 1, 1, 2)),
    ];
    for (cfg, p) in layouts {
        let world = p.dims.world_size();
        let p = p.validate(&cfg, world, BATCH).expect("plan validates");
        let tables: Vec<Holdings> = (0..world)
            .map(|r| Holdings::of_rank(&cfg, &p, p.dims.coords(r)).expect("table"))
            .collect();
        let built = run_local(world, Duration::from_secs(60), |backend| {
            let mesh = DeviceMesh::new(&backend, p.dims).expect("mesh");
            let w = init_weights(&cfg, SEED).expect("init");
            let model = parallelize(&cfg, &w, &p, &mesh, &Device::Cpu).expect("parallelize");
            let held: Vec<(String, Vec<usize>)> = model
                .params()
                .iter()
                .map(|q| (q.name().to_string(), q.shape().dims().to_vec()))
                .collect();
            (mesh.coords, held)
        });
        for (r, (coords, held)) in built.into_iter().enumerate() {
            let table = &tables[r];
            assert_eq!(table.coords, coords, "{:?} rank {r}", p.dims);
            let names: Vec<&str> = held.iter().map(|h| h.0.as_str()).collect();
            let listed: Vec<&str> = table.unique().iter().map(|h| h.name.as_str()).collect();
            assert_eq!(names, listed, "{:?} rank {r}", p.dims);
            if matches!(p.data, DataParallelKind::Ddp(_)) {
                // ZeRO-3 frees the weights it shards; the builder's own check saw them whole.
                let shapes: Vec<&[usize]> = held.iter().map(|h| h.1.as_slice()).collect();
                let listed: Vec<&[usize]> =
                    table.unique().iter().map(|h| h.shape.as_slice()).collect();
                assert_eq!(shapes, listed, "{:?} rank {r}", p.dims);
                let n: usize = held.iter().map(|h| h.1.iter().product::<usize>()).sum();
                assert_eq!(n, table.numel(), "{:?} rank {r}", p.dims);
            }
            for h in table.unique() {
                let owner = &tables[h.owner];
                assert!(
                    owner.unique().iter().any(|o| o.name == h.name),
                    "{:?}: {} is owned by rank {}, which does not hold it",
                    p.dims,
                    h.name,
                    h.owner
                );
                let sp = p.sequence_parallel && p.dims.tp > 1;
                let replicated = matches!(h.placement, Placement::Replicated { .. });
                assert_eq!(
                    h.partial_grad,
                    sp && replicated && h.expert.is_none(),
                    "{}",
                    h.name
                );
            }
        }
    }
}

/// A model that differs from the table is caught with the segment and the parameter named.
#[test]
fn a_model_that_is_not_its_table_is_refused() {
    let cfg = cfg();
    let tp2 = plan(1, 1, 2, 1);
    let table = Holdings::of_rank(&cfg, &tp2, tp2.dims.coords(0)).expect("table");
    let whole = Holdings::of_rank(&cfg, &plan(1, 1, 1, 1), tp2.dims.coords(0)).expect("table");
    let as_built = |h: &Holdings| -> Vec<(usize, Vec<(String, Vec<usize>)>)> {
        h.segments()
            .map(|s| {
                let ps = s.params.iter().map(|p| (p.name.clone(), p.shape.clone()));
                (s.index, ps.collect())
            })
            .collect()
    };
    assert!(table.check(&as_built(&table)).is_ok());
    let e = table.check(&as_built(&whole)).unwrap_err();
    assert!(
        e.starts_with("segment 0:") && e.contains("wte.weight"),
        "{e}"
    );
}

/// Saves after 2 steps under `from`, resumes under `to` for one step: its loss and norm are the
/// single-device run's third step.
fn check_reshard(from: &ParallelPlan, to: &ParallelPlan) {
    let cfg = cfg();
    let (want, _) = one_device(&cfg, 3, 1, from.backward);
    let saved = run_plan(&cfg, from, 0, 2, None);
    let (t0, st0) = &saved[0];
    // Every rank gathered the same full state.
    for (r, (t, st)) in saved.iter().enumerate() {
        for (n, w) in &t0.weights {
            assert_eq!(
                rel(&t.weights[n], w),
                0.0,
                "rank {r}: {n} differs from rank 0's"
            );
        }
        assert_eq!(st.step, st0.step);
        assert_eq!(st.m.len(), st0.m.len());
    }
    assert_eq!(st0.step, 2);
    assert_eq!(
        st0.m.len(),
        t0.weights.len(),
        "one first moment per parameter"
    );
    let resumed = run_plan(&cfg, to, 2, 1, Some(&(t0.weights.clone(), st0.clone())));
    for (r, (t, _)) in resumed.iter().enumerate() {
        let l = rel_f(t.losses[0], want.losses[2]);
        let n = rel_f(t.norms[0], want.norms[2]);
        assert!(
            l <= 1e-5,
            "rank {r}: resumed loss {} vs {} (rel {l:.2e})",
            t.losses[0],
            want.losses[2]
        );
        assert!(
            n <= 1e-4,
            "rank {r}: resumed norm {} vs {} (rel {n:.2e})",
            t.norms[0],
            want.norms[2]
        );
        for (name, w) in &want.weights {
            let e = rel(&t.weights[name], w);
            assert!(
                e <= 1e-4,
                "rank {r}: weight {name} after the resumed step rel {e:.2e}"
            );
        }
    }
}

#[test]
fn reshard_tp2_pp2_to_tp4_dp2() {
    check_reshard(&plan(1, 2, 2, 1), &plan(2, 1, 4, 1));
}

#[test]
fn reshard_zero3_pp2_to_ddp_dp2() {
    let from = ParallelPlan {
        data: zero(ZeroStage::Three),
        ..plan(2, 2, 1, 1)
    };
    let to = ParallelPlan {
        data: DataParallelKind::Ddp(DdpConfig::default()),
        ..plan(2, 1, 1, 1)
    };
    check_reshard(&from, &to);
}

fn refusal(cfg: &GptConfig, p: &ParallelPlan, world: usize, batch: usize) -> String {
    p.validate(cfg, world, batch)
        .expect_err("must be refused")
        .to_string()
}

#[test]
fn validate_shows_the_arithmetic() {
    let c = cfg();
    let e = refusal(&c, &plan(2, 2, 2, 1), 4, BATCH);
    assert!(
        e.contains("dp(2) * pp(2) * tp(2) = 8 != world size 4"),
        "{e}"
    );
    let e = refusal(&c, &plan(1, 5, 1, 1), 5, BATCH);
    assert!(e.contains("pp 5 > n_layer 4"), "{e}");
    let six_heads = GptConfig {
        n_head: 8,
        n_embd: 48,
        vocab_size: 96,
        ..c.clone()
    };
    let six = GptConfig {
        n_head: 6,
        ..six_heads
    };
    let e = refusal(&six, &plan(1, 1, 4, 1), 4, BATCH);
    assert!(e.contains("n_head 6 is not divisible by tp 4"), "{e}");
    let e = refusal(&moe_cfg(), &plan(4, 1, 1, 3), 4, BATCH);
    assert!(
        e.contains("ep(3) must divide dp(4)") && e.contains("n_experts 4 is not divisible by ep 3"),
        "{e}"
    );
    let e = refusal(&c, &plan(2, 1, 1, 2), 2, BATCH);
    assert!(e.contains("--ep 2 needs an MoE model"), "{e}");
    let e = refusal(&moe_cfg(), &plan(1, 1, 2, 1), 2, BATCH);
    assert!(e.contains("tp 2 with an MoE model"), "{e}");
    let p = ParallelPlan {
        microbatches: 3,
        ..plan(2, 2, 1, 1)
    };
    let e = refusal(&c, &p, 4, BATCH);
    assert!(
        e.contains("per-rank batch 4 (batch 8 / dp 2) is not divisible by microbatches 3"),
        "{e}"
    );
    // Several problems are reported together.
    let e = refusal(&c, &plan(3, 5, 1, 1), 4, BATCH);
    assert!(
        e.contains("world size 4")
            && e.contains("pp 5 > n_layer 4")
            && e.contains("batch 8 is not divisible by dp 3"),
        "{e}"
    );
    assert!(plan(2, 2, 2, 1).validate(&c, 8, BATCH).is_ok());
}

#[test]
fn describe_lists_stages() {
    let d = describe(&cfg(), &plan(2, 2, 2, 1));
    assert!(
        d.contains("stage 0 (pp rank 0): embedding, h.0..h.1"),
        "{d}"
    );
    assert!(d.contains("stage 1 (pp rank 1): h.2..h.3, head"), "{d}");
    // Per-rank parameters of the two stages add up to the model's, less the tp split.
    let z = describe(
        &cfg(),
        &ParallelPlan {
            data: zero(ZeroStage::Three),
            ..plan(2, 2, 2, 1)
        },
    );
    assert!(z.contains("ZeRO-3") && d.contains("DDP"), "{z}");
    // The bytes per rank are the trainer's memory model (`mtrain plan` prints them; its
    // tests hold them to the memory report and to the mixed-precision table).
}

/// ZeRO-3 under a pipeline really shards: after a step each rank holds about half of its stage's
/// weights, gradients and moments (dp = 2), against the full stage under DDP; under 1F1B and
/// under ZB-V, whose pipeline rank 0 holds the tied `wte` for two chunks and keeps one shard of it.
#[test]
fn zero3_under_pp_holds_half_the_model_state() {
    for schedule in [ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleV] {
        zero3_holds_half_the_model_state_under(schedule);
    }
}

/// The forward-only loss under ZB-V's V (DDP, and ZeRO-3 gathering `wte` for both of rank 0's
/// chunks) is the single-device loss of the same weights and batch (rel ≤ 1e-5): rank 1 hands
/// its chunk 0's output to its chunk 1 in place, rank 0's head receives from rank 1.
#[test]
fn eval_loss_under_zb_v_equals_one_device() {
    let cfg = cfg();
    let (want, _) = one_device(&cfg, 1, 1, plan(2, 2, 1, 1).backward);
    for data in [
        DataParallelKind::Ddp(DdpConfig::default()),
        zero(ZeroStage::Three),
    ] {
        let p = ParallelPlan {
            data,
            ..zero_bubble(ScheduleKind::ZeroBubbleV, plan(2, 2, 1, 1))
        };
        let p = p.validate(&cfg, 4, BATCH).expect("plan validates");
        let losses = run_local(4, Duration::from_secs(60), |backend| {
            let mesh = DeviceMesh::new(&backend, p.dims).expect("mesh");
            let w = init_weights(&cfg, SEED).expect("init");
            let mut model = parallelize(&cfg, &w, &p, &mesh, &Device::Cpu).expect("parallelize");
            let (idx, tgt) = batch(&cfg, 0);
            let b = BATCH / 2;
            let (i, y) = (
                idx.narrow(0, mesh.coords.dp * b, b).expect("i"),
                tgt.narrow(0, mesh.coords.dp * b, b).expect("y"),
            );
            model.eval_loss(&i, &y).expect("eval")
        });
        for (r, l) in losses.iter().enumerate() {
            let e = rel_f(*l, want.losses[0]);
            assert!(
                e <= 1e-5,
                "{:?} rank {r}: {l} vs {} (rel {e:.1e})",
                p.data,
                want.losses[0]
            );
        }
    }
}

fn zero3_holds_half_the_model_state_under(schedule: ScheduleKind) {
    let cfg = cfg();
    let bytes = |data: DataParallelKind| {
        let p = ParallelPlan {
            data,
            schedule,
            ..plan(2, 2, 1, 1)
        };
        let p = p.validate(&cfg, 4, BATCH).expect("plan validates");
        run_local(4, Duration::from_secs(60), |backend| {
            let mesh = DeviceMesh::new(&backend, p.dims).expect("mesh");
            let w = init_weights(&cfg, SEED).expect("init");
            let mut model = parallelize(&cfg, &w, &p, &mesh, &Device::Cpu).expect("parallelize");
            let mut opt = adamw();
            let (idx, tgt) = batch(&cfg, 0);
            let b = BATCH / 2;
            let (i, y) = (
                idx.narrow(0, mesh.coords.dp * b, b).expect("i"),
                tgt.narrow(0, mesh.coords.dp * b, b).expect("y"),
            );
            model.forward_backward(&i, &y, 1.0, true).expect("fb");
            let during = model.model_state_bytes(&opt);
            model.optimizer_step(&mut opt, LR, None).expect("step");
            let after = model.model_state_bytes(&opt);
            (during.grads, after.params, after.optimizer)
        })
    };
    let ddp = bytes(DataParallelKind::Ddp(DdpConfig::default()));
    let z3 = bytes(zero(ZeroStage::Three));
    for (r, (d, z)) in ddp.iter().zip(&z3).enumerate() {
        // Shards are padded per segment: allow a few elements over one half.
        let half = |x: usize| x / 2 + 64;
        assert!(
            z.0 <= half(d.0),
            "rank {r}: ZeRO-3 gradients {} B vs DDP {} B",
            z.0,
            d.0
        );
        assert!(
            z.1 <= half(d.1),
            "rank {r}: ZeRO-3 weights {} B vs DDP {} B",
            z.1,
            d.1
        );
        assert!(
            z.2 <= half(d.2),
            "rank {r}: ZeRO-3 Adam state {} B vs DDP {} B",
            z.2,
            d.2
        );
        println!("{schedule} rank {r}: DDP (grads, weights, adam) {d:?} B, ZeRO-3 {z:?} B");
    }
}

/// `eval_loss` (forward only, through the pipeline, ZeRO-3 gathering and releasing) equals the
/// single-device loss of the same global batch on every rank.
#[test]
fn eval_loss_equals_one_device() {
    let cfg = cfg();
    let (idx, tgt) = batch(&cfg, 9);
    let w = init_weights(&cfg, SEED).expect("init");
    let gpt = Gpt::new(cfg.clone(), &w, &Device::Cpu).expect("gpt");
    let want = gpt
        .forward_loss(&idx, &tgt)
        .expect("loss")
        .loss
        .to_scalar::<f32>()
        .expect("scalar") as f64;
    let plans = [
        ParallelPlan {
            sequence_parallel: true,
            ..plan(1, 2, 2, 1)
        },
        ParallelPlan {
            data: zero(ZeroStage::Three),
            ..plan(2, 2, 1, 1)
        },
    ];
    for p in plans {
        let p = p.validate(&cfg, 4, BATCH).expect("plan validates");
        let got = run_local(4, Duration::from_secs(60), |backend| {
            let mesh = DeviceMesh::new(&backend, p.dims).expect("mesh");
            let mut model = parallelize(&cfg, &w, &p, &mesh, &Device::Cpu).expect("parallelize");
            let b = BATCH / p.dims.dp;
            let (i, y) = (
                idx.narrow(0, mesh.coords.dp * b, b).expect("i"),
                tgt.narrow(0, mesh.coords.dp * b, b).expect("y"),
            );
            let first = model.eval_loss(&i, &y).expect("eval");
            // Evaluating twice gives the same number (ZeRO-3 released its gathered weights).
            (first, model.eval_loss(&i, &y).expect("eval"))
        });
        for (r, (a, b)) in got.iter().enumerate() {
            assert!(
                rel_f(*a, want) <= 1e-5,
                "{:?} rank {r}: eval loss {a} vs {want}",
                p.dims
            );
            assert_eq!(a, b, "rank {r}: second evaluation differs");
        }
    }
}
