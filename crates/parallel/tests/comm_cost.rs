//! The communication cost model against the CPU backend's own counts.
//!
//! - `*_bytes_match_the_trace`: each layout of the composition tests runs one optimizer step
//!   (forward/backward with sync, then the AdamW step) on threads with tracing on; for every
//!   rank and every (group, op), the number of collectives and the payload bytes the tracer
//!   counted (`bytes_sent`) equal [`step_collectives`]'s prediction exactly. The MoE token
//!   all-to-alls depend on the routing: the prediction (balanced routing, capacity factor 1) is
//!   an upper bound and the measurement must lie within a factor 2 below it.
//! - `*_ddp_buckets_match_the_trace`: DDP of one stage, whose gradients travel in buckets.
//! - `ep_overlap_prices_*`: `--ep-overlap`'s parts, the exposed 1/`PARTS` of the token rows.
//! - `worked_example_*`: the chapter's example (hidden 8192, 8 ranks, bf16, NVLink-class
//!   defaults): a decode token's all-reduce (16 KiB) is latency-bound, a prefill of 8192 tokens
//!   (128 MiB) bandwidth-bound.
//! - closed forms of the per-algorithm byte counts and times.

mod common;

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use mtrain_comm::cpu::{run_local_with, CpuOptions};
use mtrain_comm::{DeviceMesh, MeshDims, OpKind};
use mtrain_model::optim::{AdamW, AdamWConfig};
use mtrain_model::{init_weights, GptConfig};
use mtrain_parallel::analysis::comm_cost::{
    all_reduce_sent, broadcast_sent, step_collectives, Bound, CostModel, Group, StepShape,
};
use mtrain_parallel::ddp::{DdpConfig, DdpMode};
use mtrain_parallel::expert_parallel::overlap::PARTS;
use mtrain_parallel::fsdp::{FsdpConfig, ZeroStage};
use mtrain_parallel::parallelize::{parallelize, DataParallelKind, ParallelPlan};
use mtrain_parallel::plan::TpOverlap;
use mtrain_parallel::pipeline::ScheduleKind;
use rand::{Rng, SeedableRng};

use common::{cp_plan, plan, tiny_gpt, with_moe, zero};

const BATCH: usize = 8;
const SEQ: usize = 8;

fn cfg() -> GptConfig {
    tiny_gpt(4, 4, 32)
}

fn moe_cfg() -> GptConfig {
    with_moe(cfg())
}

/// (count, bytes sent) per (group, op).
type Counts = BTreeMap<(String, String), (usize, u64)>;

/// One optimizer step of `plan` with tracing on; every rank's counts per (group, op), the
/// construction's collectives excluded.
fn measure(cfg: &GptConfig, plan: &ParallelPlan) -> Vec<Counts> {
    let world = plan.dims.world_size();
    let plan = &plan.validate(cfg, world, BATCH).expect("plan validates");
    let opts = CpuOptions {
        trace: true,
        ..CpuOptions::default()
    };
    run_local_with(world, opts, |backend| {
        let mesh = DeviceMesh::new(&backend, plan.dims).expect("mesh");
        let weights = init_weights(cfg, 7).expect("init");
        let mut model = parallelize(cfg, &weights, plan, &mesh, &Device::Cpu).expect("parallelize");
        let mut groups = vec![
            &mesh.world,
            &mesh.tp,
            &mesh.pp,
            &mesh.dp,
            &mesh.ep,
            &mesh.edp,
            &mesh.mp,
        ];
        if plan.dims.cp > 1 {
            groups.extend([&mesh.cp, &mesh.dcp]); // (dcp is the dp group itself at cp 1)
        }
        for &g in &groups {
            g.tracer().clear();
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let mut draw = || -> Vec<u32> {
            (0..BATCH * SEQ)
                .map(|_| rng.gen_range(0..cfg.vocab_size as u32))
                .collect()
        };
        let idx = Tensor::from_vec(draw(), (BATCH, SEQ), &Device::Cpu).expect("idx");
        let tgt = Tensor::from_vec(draw(), (BATCH, SEQ), &Device::Cpu).expect("targets");
        let b = BATCH / plan.dims.dp;
        let d = mesh.coords.dp;
        let (i, y) = (
            idx.narrow(0, d * b, b).expect("i"),
            tgt.narrow(0, d * b, b).expect("y"),
        );
        let mut opt = AdamW::new(AdamWConfig::default());
        model.forward_backward(&i, &y, 1.0, true).expect("step");
        model
            .optimizer_step(&mut opt, 1e-3, Some(1.0))
            .expect("opt");
        let mut counts = Counts::new();
        for g in groups {
            if g.size() == 1 {
                continue;
            }
            for e in g.tracer().events() {
                let c = counts
                    .entry((e.group.clone(), e.op.to_string()))
                    .or_default();
                c.0 += 1;
                c.1 += e.bytes_sent;
            }
        }
        counts
    })
}

/// Predicted counts of every rank, plus the (group, op) keys holding an estimate.
fn predict(cfg: &GptConfig, plan: &ParallelPlan) -> (Vec<Counts>, Vec<(String, String)>) {
    let world = plan.dims.world_size();
    let plan = &plan.validate(cfg, world, BATCH).expect("plan validates");
    let shape = StepShape {
        batch: BATCH,
        seq_len: SEQ,
        dtype: DType::F32,
    };
    let mut estimates = Vec::new();
    let all = (0..plan.dims.world_size())
        .map(|r| {
            let mut counts = Counts::new();
            for c in step_collectives(cfg, plan, shape, r).expect("predict") {
                let key = (c.group.name().to_string(), c.op.to_string());
                if c.estimate && !estimates.contains(&key) {
                    estimates.push(key.clone());
                }
                let e = counts.entry(key).or_default();
                e.0 += c.count;
                e.1 += c.bytes_sent * c.count as u64;
            }
            counts
        })
        .collect();
    (all, estimates)
}

fn check(cfg: &GptConfig, plan: &ParallelPlan) {
    let measured = measure(cfg, plan);
    let (predicted, estimates) = predict(cfg, plan);
    for (r, (m, p)) in measured.iter().zip(&predicted).enumerate() {
        let keys: std::collections::BTreeSet<_> = m.keys().chain(p.keys()).collect();
        for k in keys {
            let (mc, mb) = m.get(k).copied().unwrap_or_default();
            let (pc, pb) = p.get(k).copied().unwrap_or_default();
            assert_eq!(
                mc, pc,
                "{:?} rank {r} {k:?}: {mc} ops traced, {pc} predicted (all: traced {m:?}, predicted {p:?})",
                plan.dims
            );
            if estimates.contains(k) {
                assert!(
                    mb <= pb && 2 * mb >= pb,
                    "{:?} rank {r} {k:?}: traced {mb} B outside [predicted/2, predicted] = [{}, {pb}]",
                    plan.dims,
                    pb / 2
                );
            } else {
                assert_eq!(
                    mb, pb,
                    "{:?} rank {r} {k:?}: {mb} bytes sent traced, {pb} predicted",
                    plan.dims
                );
            }
        }
    }
    let total: u64 = measured.iter().flat_map(|m| m.values()).map(|v| v.1).sum();
    println!(
        "{:?}: {total} bytes sent in one step over all ranks, as predicted",
        plan.dims
    );
}

/// The cp ring's K, V and dK, dV passes of every block, and the gradient average and loss
/// over dcp = dp × cp, as the tracer counts them: cp 4; cp 2 with tp 2 (each rank's heads),
/// with pp 2 × dp 2, and under ZeRO-3 with activation checkpointing (the recompute's ring,
/// ZeRO's gathers and reduce-scatters over dcp).
#[test]
fn cp_ring_bytes_match_the_trace() {
    check(&cfg(), &cp_plan(4, 1, 1, 1));
    check(&cfg(), &cp_plan(2, 1, 1, 2));
    check(&cfg(), &cp_plan(2, 2, 2, 1));
    let z3 = ParallelPlan {
        data: zero(ZeroStage::Three),
        checkpointing: true,
        ..cp_plan(2, 2, 1, 1)
    };
    check(&cfg(), &z3);
}

/// The ring's figures by hand, B = 8 sequences of T = 8 at C = 32, f32, cp 2, one stage: a
/// pass carries this rank's K and V, 2·B·(T/cp)·C = 2048 elements = 8192 B (dK, dV: the
/// same, f32); per block 1 forward pass, 1 + 1 backward passes and the last accumulator
/// pass home: 4 blocks → 4 K, V sends forward, 4 K, V + 8 dK, dV sends backward.
#[test]
fn cp_ring_figures_by_hand() {
    let cfg = cfg();
    let p = cp_plan(2, 1, 1, 1).validate(&cfg, 2, BATCH).expect("plan");
    let shape = StepShape {
        batch: BATCH,
        seq_len: SEQ,
        dtype: DType::F32,
    };
    let items = step_collectives(&cfg, &p, shape, 0).expect("predict");
    let ring: Vec<_> = items
        .iter()
        .filter(|c| c.group == Group::Cp && c.op == OpKind::Send)
        .map(|c| (c.what, c.phase, c.bytes_sent, c.count, c.overlappable))
        .collect();
    use mtrain_parallel::analysis::comm_cost::Phase::{Backward, Forward};
    assert_eq!(
        ring,
        vec![
            ("K, V around the ring", Forward, 8192, 4, true),
            ("K, V around the ring", Backward, 8192, 4, true),
            ("dK, dV accumulators", Backward, 8192, 4, true),
            ("dK, dV home (last pass)", Backward, 8192, 4, false),
        ]
    );
    // The loss is averaged over dcp (= cp here), not over the dp group of one.
    assert!(items.iter().any(|c| c.group == Group::Dcp && c.what == "loss"));
    assert!(items.iter().all(|c| c.group != Group::Dp));
}

#[test]
fn tp2_pp2_dp2_bytes_match_the_trace() {
    check(&cfg(), &plan(2, 2, 2, 1));
}

#[test]
fn tp4_pp2_bytes_match_the_trace() {
    let p = ParallelPlan {
        schedule: ScheduleKind::GPipe,
        ..plan(1, 2, 4, 1)
    };
    check(&cfg(), &p);
}

#[test]
fn pp2_dp2_zero3_bytes_match_the_trace() {
    let p = ParallelPlan {
        data: zero(ZeroStage::Three),
        checkpointing: true,
        ..plan(2, 2, 1, 1)
    };
    check(&cfg(), &p);
}

/// ZeRO-3 without checkpointing, the gathered weights freed after each forward and gathered
/// again for the backward, or kept until it: on one stage and under a pipeline of two
/// micro-batches (whose interleaved passes gather a freed unit again), every count and byte as
/// traced. On one stage of 6 segments (embedding, 4 blocks, head) resharding gathers 11 times:
/// the forward's 6 and the tied wte again for the head, then the backward's second gather of
/// the 4 blocks' units (the head's are still resident, the embedding's backward reads no
/// weight); kept, the 6 gathers of the forward are all.
#[test]
fn zero3_resharding_after_the_forward_gathers_again_in_the_backward() {
    let gathers = |p: &ParallelPlan| {
        let (counts, _) = predict(&cfg(), p);
        counts[0]
            .iter()
            .filter(|((g, op), _)| g.as_str() == "dp" && op.contains("gather"))
            .map(|(_, (n, _))| *n)
            .sum::<usize>()
    };
    let mut count = Vec::new();
    for reshard_after_forward in [true, false] {
        let data = DataParallelKind::Zero(FsdpConfig {
            stage: ZeroStage::Three,
            reshard_after_forward,
            ..FsdpConfig::default()
        });
        let one = ParallelPlan {
            data,
            ..plan(4, 1, 1, 1)
        };
        check(&cfg(), &one);
        count.push(gathers(&one));
        check(&cfg(), &ParallelPlan { data, ..plan(2, 2, 1, 1) });
    }
    assert_eq!(count, vec![11, 6], "all-gathers on dp, resharding then kept");
}

#[test]
fn dp2_ep2_moe_bytes_match_the_trace() {
    check(&moe_cfg(), &plan(2, 1, 1, 2));
}

/// `--ep-overlap`: every token exchange as `PARTS` all-to-alls of a part of the rows each, the
/// counts of all parts in one.
#[test]
fn dp2_ep2_moe_ep_overlap_bytes_match_the_trace() {
    let p = ParallelPlan {
        ep_overlap: true,
        ..plan(2, 1, 1, 2)
    };
    check(&moe_cfg(), &p);
}

/// Under `--ep-overlap` the same token rows cross the wire, in `PARTS` times the all-to-alls;
/// of the forward's 2·`PARTS` part exchanges all but the first dispatch and the last combine
/// are overlappable, of the backward's all but the first: three parts of each layer's four
/// exchanges are exposed, 3/(4·`PARTS`) of the inline token bytes, and on any link the exposed
/// all-to-all time is that share of the inline one's bandwidth time plus one α per exposed
/// part exchange.
#[test]
fn ep_overlap_prices_three_parts_of_the_token_exchange_as_exposed() {
    let cfg = moe_cfg();
    let shape = StepShape {
        batch: BATCH,
        seq_len: SEQ,
        dtype: DType::F32,
    };
    let tokens = |ep_overlap: bool| {
        let p = ParallelPlan {
            ep_overlap,
            ..plan(2, 1, 1, 2)
        };
        let p = p.validate(&cfg, 2, BATCH).expect("plan");
        let items: Vec<_> = step_collectives(&cfg, &p, shape, 0)
            .expect("predict")
            .into_iter()
            .filter(|c| c.group == Group::Ep && c.what != "expert counts")
            .collect();
        let sum = |f: &dyn Fn(&&mtrain_parallel::analysis::comm_cost::Collective) -> bool| {
            let hit = items.iter().filter(f);
            let ops: usize = hit.clone().map(|c| c.count).sum();
            (ops, hit.map(|c| c.bytes * c.count as u64).sum::<u64>())
        };
        let link = CostModel {
            alpha_s: 1e-5,
            beta_bytes_per_s: 1e8,
        };
        let exposed_s: f64 = items
            .iter()
            .filter(|c| !c.overlappable)
            .map(|c| link.time(OpKind::AllToAll, 2, c.bytes).total_s() * c.count as f64)
            .sum();
        (sum(&|_| true), sum(&|c| !c.overlappable), exposed_s, link)
    };
    let (all_inline, exposed_inline, s_inline, link) = tokens(false);
    let (all_over, exposed_over, s_over, _) = tokens(true);
    let layers = cfg.n_layer;
    assert_eq!(all_inline, (4 * layers, exposed_inline.1), "inline: all exposed");
    assert_eq!(exposed_inline.0, 4 * layers);
    let k = PARTS as u64;
    assert_eq!(all_over, (4 * PARTS * layers, all_inline.1), "the same rows in parts");
    let exposed = all_inline.1 / (4 * k) * 3;
    assert_eq!(exposed_over, (3 * layers, exposed), "three parts a layer exposed");
    let (alpha, n) = (link.alpha_s, layers as f64);
    let one_part = (s_inline / (4.0 * n) - alpha) / PARTS as f64; // bandwidth time, s
    let want = 3.0 * n * (alpha + one_part);
    assert!(
        (s_over - want).abs() < 1e-9,
        "exposed {s_over:.6} s, want three parts a layer, α each: {want:.6} s"
    );
}

#[test]
fn tp2_sp_dp2_zero2_bytes_match_the_trace() {
    let p = ParallelPlan {
        data: zero(ZeroStage::Two),
        sequence_parallel: true,
        ..plan(2, 1, 2, 1)
    };
    check(&cfg(), &p);
}

#[test]
fn tp2_dp2_chunked_bytes_match_the_trace() {
    let p = ParallelPlan {
        tp_overlap: TpOverlap::Chunked,
        ..plan(2, 1, 2, 1)
    };
    check(&cfg(), &p);
    let sp = ParallelPlan {
        sequence_parallel: true,
        ..p
    };
    check(&cfg(), &sp);
}

#[test]
fn tp2_sp_ring_bytes_match_the_trace() {
    let p = ParallelPlan {
        sequence_parallel: true,
        tp_overlap: TpOverlap::Ring,
        ..plan(2, 1, 2, 1)
    };
    check(&cfg(), &p);
    let tp4 = ParallelPlan {
        sequence_parallel: true,
        tp_overlap: TpOverlap::Ring,
        ..plan(1, 1, 4, 1)
    };
    check(&cfg(), &tp4);
}

/// Under `--tp-overlap chunked` a block's reducing collectives are k of a k-th of the bytes,
/// all but the last overlappable; the ring's sends are all overlappable; the whole-step bytes
/// are those of `none`.
#[test]
fn tp_overlap_modes_price_their_cut_collectives() {
    let shape = StepShape {
        batch: BATCH * 2,
        seq_len: SEQ,
        dtype: DType::F32,
    };
    let items = |mode: TpOverlap, sp: bool| {
        let p = ParallelPlan {
            sequence_parallel: sp,
            tp_overlap: mode,
            ..plan(2, 1, 2, 1)
        };
        let world = p.dims.world_size();
        let v = p.validate(&cfg(), world, shape.batch).expect("plan validates");
        step_collectives(&cfg(), &v, shape, 0).expect("collectives")
    };
    let tp_bytes = |v: &[mtrain_parallel::analysis::comm_cost::Collective], hidden: bool| -> u64 {
        v.iter()
            .filter(|c| c.group == Group::Tp && c.overlappable == hidden)
            .map(|c| c.bytes_sent * c.count as u64)
            .sum()
    };
    let none = items(TpOverlap::None, false);
    let chunked = items(TpOverlap::Chunked, false);
    assert_eq!(tp_bytes(&none, true), 0, "nothing of none's overlaps");
    // 4 blocks × (2 forward g + 2 backward f) = 16 cut all-reduces, 3 of 4 chunks hidden.
    let (hidden, exposed) = (tp_bytes(&chunked, true), tp_bytes(&chunked, false));
    let whole = tp_bytes(&none, false);
    assert_eq!(hidden + exposed, whole, "the chunks carry the same bytes");
    let block_bytes = 16 * mtrain_parallel::analysis::comm_cost::all_reduce_sent(
        shape.batch / 2 * SEQ * 32,
        DType::F32,
        2,
        0,
    );
    assert_eq!(hidden, block_bytes * 3 / 4, "3 of 4 chunks of every block collective");
    let ring = items(TpOverlap::Ring, true);
    let sends: Vec<_> = ring
        .iter()
        .filter(|c| c.group == Group::Tp && c.op == OpKind::Send)
        .collect();
    assert!(!sends.is_empty() && sends.iter().all(|c| c.overlappable));
}

#[test]
fn pp2_tp2_sp_interleaved_bytes_match_the_trace() {
    let p = ParallelPlan {
        sequence_parallel: true,
        schedule: ScheduleKind::Interleaved1F1B { virtual_stages: 2 },
        ..plan(1, 2, 2, 1)
    };
    check(&cfg(), &p);
}

/// The split backward's collectives: ZB-V with tp × sp × dp (B's conjugates, the embedding's
/// in W, the tied `wte` on rank 0 alone), ZB-H1 with ZeRO-3 and checkpointing (B's gathers, W's
/// reduce-scatters and frees), ZB-V with ZeRO-1 and ZeRO-3 (rank 0's one `wte` unit, gathered
/// by both chunks, reduced after the embedding's W).
#[test]
fn zero_bubble_bytes_match_the_trace() {
    for (stage, checkpointing) in [(ZeroStage::One, false), (ZeroStage::Three, true)] {
        let v = ParallelPlan {
            data: zero(stage),
            checkpointing,
            schedule: ScheduleKind::ZeroBubbleV,
            microbatches: 4,
            ..plan(2, 2, 1, 1)
        };
        check(&cfg(), &v);
    }
    let v = ParallelPlan {
        sequence_parallel: true,
        schedule: ScheduleKind::ZeroBubbleV,
        microbatches: 4,
        ..plan(2, 2, 2, 1)
    };
    check(&cfg(), &v);
    let h1 = ParallelPlan {
        data: zero(ZeroStage::Three),
        checkpointing: true,
        schedule: ScheduleKind::ZeroBubbleH1,
        microbatches: 4,
        ..plan(2, 2, 1, 1)
    };
    check(&cfg(), &h1);
}

/// DDP of one stage averages in buckets: small caps give several per step, each one all-reduce
/// over dp, packed by the same rule on both sides.
fn ddp_with_small_buckets(dp: usize, tp: usize) -> ParallelPlan {
    ParallelPlan {
        data: DataParallelKind::Ddp(DdpConfig {
            mode: DdpMode::Bucketed,
            bucket_cap_bytes: 16 << 10,
            first_bucket_cap_bytes: 4 << 10,
        }),
        ..plan(dp, 1, tp, 1)
    }
}

#[test]
fn dp2_ddp_buckets_match_the_trace() {
    let p = ddp_with_small_buckets(2, 1);
    let (predicted, _) = predict(&cfg(), &p);
    let buckets = predicted[0][&("dp".to_string(), "all_reduce".to_string())].0;
    assert!(
        buckets > 3,
        "small caps should give several buckets, got {buckets} all-reduces"
    );
    check(&cfg(), &p);
}

#[test]
fn tp2_dp2_ddp_buckets_match_the_trace() {
    check(&cfg(), &ddp_with_small_buckets(2, 2));
}

#[test]
fn worked_example_decode_is_latency_bound_prefill_bandwidth_bound() {
    let nv = CostModel::NVLINK_DEFAULT;
    let hidden = 8192u64;
    let decode = hidden * 2; // one token, bf16
    let prefill = 8192 * hidden * 2; // 8192 tokens
    assert_eq!(decode, 16 * 1024);
    assert_eq!(prefill, 128 * 1024 * 1024);
    let d = nv.time(OpKind::AllReduce, 8, decode);
    let p = nv.time(OpKind::AllReduce, 8, prefill);
    // 2(n-1) = 14 steps of α each; 2(n-1)/n · S / β of transfer.
    assert!((d.latency_s - 14.0 * nv.alpha_s).abs() < 1e-12);
    assert!((p.bandwidth_s - 14.0 / 8.0 * prefill as f64 / nv.beta_bytes_per_s).abs() < 1e-9);
    assert_eq!(d.bound(), Bound::Latency, "{d:?}");
    assert_eq!(p.bound(), Bound::Bandwidth, "{p:?}");
    println!(
        "decode 16 KiB: {:.1} µs latency + {:.3} µs transfer; prefill 128 MiB: {:.1} µs + {:.1} µs",
        d.latency_s * 1e6,
        d.bandwidth_s * 1e6,
        p.latency_s * 1e6,
        p.bandwidth_s * 1e6
    );
}

#[test]
fn ring_and_tree_bytes_follow_their_closed_forms() {
    // Divisible sizes: 2(n-1)/n · S per rank for f32, (n-1)/n · S · (4/2 + 1) for bf16.
    for n in [2usize, 3, 4, 8] {
        let numel = 24 * 8;
        for r in 0..n {
            assert_eq!(
                all_reduce_sent(numel, DType::F32, n, r),
                (2 * (n - 1) * numel * 4 / n) as u64
            );
            assert_eq!(
                all_reduce_sent(numel, DType::BF16, n, r),
                ((n - 1) * numel * (4 + 2) / n) as u64
            );
        }
    }
    // One element over 4 ranks: only rank 0 owns it; the reduce-scatter is sent by ranks 1..3
    // and forwarded in the all-gather by every rank but rank 3 (its right neighbour, rank 0,
    // owns it).
    let sent: Vec<u64> = (0..4)
        .map(|r| all_reduce_sent(1, DType::F64, 4, r))
        .collect();
    assert_eq!(sent, vec![8, 16, 16, 8]);
    // Binomial tree over 8 ranks from root 0: 0 → 4, 2, 1; 4 → 6, 5; 2 → 3; 6 → 7.
    let children: Vec<u64> = (0..8).map(|r| broadcast_sent(1, 8, r, 0)).collect();
    assert_eq!(children, vec![3, 0, 1, 0, 2, 0, 1, 0]);
    // Over 3 ranks from root 2 (relative 0): children at relative 1 and 2, the ranks 0 and 1.
    let children: Vec<u64> = (0..3).map(|r| broadcast_sent(1, 3, r, 2)).collect();
    assert_eq!(children, vec![0, 0, 2]);
    assert_eq!(Group::Edp.size(MeshDims::new(4, 1, 1, 2)), 2);
}
