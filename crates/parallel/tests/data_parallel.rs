//! Data parallelism against the single-device run.
//!
//! Every test trains a tiny GPT (2 layers, width 32, vocabulary 64) from the same seed. The
//! reference is one device running the block-wise engine on the whole global batch; a dp-rank run
//! gives each rank an equal slice of that batch (ranks are threads of this process talking over
//! loopback TCP). Mean cross-entropy over equal slices averages to the loss of the whole batch,
//! so the reference loss is the mean of the ranks' losses, and the averaged gradients equal the
//! reference gradients up to float summation order.
//!
//! Tolerances: loss relative error ≤ 1e-5 at each of 10 AdamW steps; each parameter's gradient
//! ‖g - g_ref‖ / ‖g_ref‖ ≤ 1e-4 at the first step.
//! ZeRO-3 runs once more with the segments' hand-written backward (`Backward::Tapes`) against
//! the same autograd reference.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{Device, Tensor};
use mtrain_comm::{run_local, Backend, Comm, DeviceMesh, MeshDims, OpKind};
use mtrain_model::optim::AdamW;
use mtrain_model::{init_weights, Backward, Engine, Gpt, GptConfig, Grads, NoHooks, Segment};
use mtrain_parallel::ddp::{DdpConfig, DdpMode, ModelStateBytes};
use mtrain_parallel::fsdp::{analytic_model_state, Fsdp, FsdpConfig, ZeroStage};
use mtrain_parallel::parallelize::{parallelize, DataParallelKind, ParallelModel, ParallelPlan};

use common::{adamw, optim_items, rel, tiny_gpt};

const SEED: u64 = 1234;
const STEPS: usize = 10;
const LR: f64 = 3e-3;
const T: usize = 16;
const GLOBAL_BATCH: usize = 8;
const TIMEOUT: Duration = Duration::from_secs(60);

fn cfg() -> GptConfig {
    GptConfig {
        block_size: T,
        ..tiny_gpt(2, 2, 32)
    }
}

fn model() -> Gpt {
    let cfg = cfg();
    let w = init_weights(&cfg, SEED).expect("init");
    Gpt::new(cfg, &w, &Device::Cpu).expect("model")
}

/// The global batch of step `step`: (idx, targets), each (GLOBAL_BATCH, T) u32, targets = idx
/// shifted by one. Each row follows x ↦ (5x + 3) mod V from a random start, so there is a
/// bigram rule to learn and the loss falls within a few steps.
fn batch(step: usize) -> (Vec<u32>, Vec<u32>) {
    let v = cfg().vocab_size as u64;
    let mut s = 0x9e37_79b9_7f4a_7c15u64 ^ (step as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let mut idx = Vec::new();
    let mut tgt = Vec::new();
    for _ in 0..GLOBAL_BATCH {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut x = (s >> 33) % v;
        for _ in 0..T {
            idx.push(x as u32);
            x = (5 * x + 3) % v;
            tgt.push(x as u32);
        }
    }
    (idx, tgt)
}

/// Rows `[start, start + n)` of the step's global batch as tensors.
fn rows(step: usize, start: usize, n: usize) -> (Tensor, Tensor) {
    let (idx, tgt) = batch(step);
    let cut = |v: &[u32]| {
        Tensor::from_vec(v[start * T..(start + n) * T].to_vec(), (n, T), &Device::Cpu)
            .expect("batch")
    };
    (cut(&idx), cut(&tgt))
}

/// What a run produced: the loss of each step (global mean) and the gradients of the first step.
struct RunResult {
    losses: Vec<f64>,
    grads0: BTreeMap<String, Tensor>,
}

/// One device, whole batch, no parallelism: the reference.
fn single_device(steps: usize) -> RunResult {
    single_device_full(steps).0
}

/// The reference run, also returning the final weights and optimizer.
fn single_device_full(steps: usize) -> (RunResult, BTreeMap<String, Tensor>, AdamW) {
    let gpt = model();
    let params = gpt.params();
    let engine = Engine::default();
    let mut opt = adamw();
    let mut losses = Vec::new();
    let mut grads0 = BTreeMap::new();
    for step in 0..steps {
        let (x, y) = rows(step, 0, GLOBAL_BATCH);
        let mut grads = Grads::new();
        let (loss, _) = engine
            .forward_backward(&gpt.segments, &x, &y, 1.0, &mut grads, &mut NoHooks)
            .expect("fb");
        losses.push(loss);
        if step == 0 {
            grads0 = grads.iter().map(|(n, g)| (n.clone(), g.clone())).collect();
        }
        assert_eq!(grads.len(), params.len(), "every parameter has a gradient");
        opt.step(LR, &optim_items(&params, |n| grads.get(n)))
            .expect("step");
    }
    let weights = params
        .iter()
        .map(|p| (p.name().to_string(), p.tensor().detach()))
        .collect();
    (RunResult { losses, grads0 }, weights, opt)
}

/// One rank of a test: DDP is the composed model of a dp-only plan (`parallelize`, under the
/// plan's engine, the default), ZeRO's `Fsdp` runs on its own under the test's engine.
enum Strategy {
    Model(Box<ParallelModel>),
    Alone(Box<Fsdp>),
}

impl Strategy {
    fn forward_backward(
        &mut self,
        engine: &Engine,
        x: &Tensor,
        y: &Tensor,
        scale: f64,
        sync: bool,
    ) -> f64 {
        match self {
            Strategy::Model(m) => {
                m.forward_backward(x, y, scale, sync)
                    .expect("forward_backward")
                    .loss
            }
            Strategy::Alone(s) => s
                .forward_backward(engine, x, y, scale, sync)
                .expect("forward_backward"),
        }
    }

    fn full_grads(&self) -> BTreeMap<String, Tensor> {
        match self {
            Strategy::Model(m) => m.full_grads().expect("full grads"),
            Strategy::Alone(s) => s.full_grads().expect("full grads"),
        }
    }

    fn optimizer_step(&mut self, opt: &mut AdamW, lr: f64, max_norm: Option<f64>) -> f64 {
        match self {
            Strategy::Model(m) => m.optimizer_step(opt, lr, max_norm).expect("optimizer step"),
            Strategy::Alone(s) => s.optimizer_step(opt, lr, max_norm).expect("optimizer step"),
        }
    }

    /// Model-state bytes with parameters, gradients and AdamW moments all held: after one
    /// optimizer step, before the gradients are dropped.
    fn state_bytes_after_one_step(
        &mut self,
        engine: &Engine,
        x: &Tensor,
        y: &Tensor,
    ) -> ModelStateBytes {
        let mut opt = adamw();
        match self {
            Strategy::Model(m) => {
                m.forward_backward(x, y, 1.0, true)
                    .expect("forward_backward");
                let during = m.model_state_bytes(&opt);
                m.optimizer_step(&mut opt, LR, None).expect("step");
                let after = m.model_state_bytes(&opt);
                ModelStateBytes {
                    params: after.params,
                    grads: during.grads,
                    optimizer: after.optimizer,
                }
            }
            Strategy::Alone(s) => {
                s.forward_backward(engine, x, y, 1.0, true)
                    .expect("forward_backward");
                opt.step(LR, &s.optimizer_items()).expect("step");
                let bytes = s.model_state_bytes(&opt);
                s.after_optimizer_step().expect("after step");
                bytes
            }
        }
    }
}

type Make = dyn Fn(&dyn Backend) -> Strategy + Sync;

/// `dp` ranks, each training on its slice of the global batch in `micro` micro-steps.
fn data_parallel(dp: usize, micro: usize, engine: Engine, steps: usize, make: &Make) -> RunResult {
    let per_rank = GLOBAL_BATCH / dp;
    let per_micro = per_rank / micro;
    let results = run_local(dp, TIMEOUT, |backend| {
        let rank = backend.world().rank();
        let mut strategy = make(&backend);
        let mut opt = adamw();
        let mut losses = Vec::new();
        let mut grads0 = BTreeMap::new();
        for step in 0..steps {
            let mut loss = 0.0;
            for k in 0..micro {
                let (x, y) = rows(step, rank * per_rank + k * per_micro, per_micro);
                let l =
                    strategy.forward_backward(&engine, &x, &y, 1.0 / micro as f64, k + 1 == micro);
                loss += l / micro as f64;
            }
            losses.push(loss);
            if step == 0 {
                grads0 = strategy.full_grads();
            }
            strategy.optimizer_step(&mut opt, LR, None);
        }
        RunResult { losses, grads0 }
    });
    let losses = (0..steps)
        .map(|s| results.iter().map(|r| r.losses[s]).sum::<f64>() / dp as f64)
        .collect();
    // The averaged gradients must be identical on every rank.
    for r in &results[1..] {
        for (name, g) in &r.grads0 {
            assert_eq!(
                rel(g, &results[0].grads0[name]),
                0.0,
                "rank gradients differ for {name}"
            );
        }
    }
    let grads0 = results.into_iter().next().expect("rank 0").grads0;
    RunResult { losses, grads0 }
}

fn assert_matches(name: &str, got: &RunResult, want: &RunResult) {
    assert_eq!(got.losses.len(), want.losses.len());
    for (s, (g, w)) in got.losses.iter().zip(&want.losses).enumerate() {
        let rel = (g - w).abs() / w.abs();
        assert!(
            rel <= 1e-5,
            "{name}: step {s} loss {g} vs reference {w} (rel {rel:e})"
        );
    }
    assert_eq!(
        got.grads0.len(),
        want.grads0.len(),
        "{name}: gradient count"
    );
    for (p, w) in &want.grads0 {
        let g = got
            .grads0
            .get(p)
            .unwrap_or_else(|| panic!("{name}: no gradient for {p}"));
        let rel = rel(g, w);
        assert!(rel <= 1e-4, "{name}: gradient of {p} rel error {rel:e}");
    }
    // The loss must have moved, or the comparison would prove little.
    assert!(
        want.losses[STEPS - 1] < want.losses[0] - 0.05,
        "reference did not train: {:?}",
        want.losses
    );
}

/// The composed model of the dp-only plan of `backend`'s world under DDP in `mode`, built
/// from the test's weights.
fn ddp_model(backend: &dyn Backend, mode: DdpMode) -> (ParallelModel, DeviceMesh) {
    let dims = MeshDims::new(backend.world().size(), 1, 1, 1);
    let mesh = DeviceMesh::new(backend, dims).expect("mesh");
    // Small caps so the tiny model is split into several buckets.
    let plan = ParallelPlan {
        data: DataParallelKind::Ddp(DdpConfig {
            mode,
            bucket_cap_bytes: 16 << 10,
            first_bucket_cap_bytes: 4 << 10,
        }),
        ..ParallelPlan::new(dims)
    };
    let plan = plan
        .validate(&cfg(), dims.world_size(), GLOBAL_BATCH)
        .expect("plan validates");
    let w = init_weights(&cfg(), SEED).expect("init");
    let model = parallelize(&cfg(), &w, &plan, &mesh, &Device::Cpu).expect("parallelize");
    (model, mesh)
}

fn ddp(mode: DdpMode) -> impl Fn(&dyn Backend) -> Strategy + Sync {
    move |backend| Strategy::Model(Box::new(ddp_model(backend, mode).0))
}

fn zero(stage: ZeroStage) -> impl Fn(&dyn Backend) -> Strategy + Sync {
    zero_resharding(stage, true)
}

/// ZeRO at `stage`, the gathered weights freed after each forward or kept until the backward.
fn zero_resharding(stage: ZeroStage, reshard: bool) -> impl Fn(&dyn Backend) -> Strategy + Sync {
    move |backend| Strategy::Alone(fsdp_resharding(stage, reshard)(backend.world(), model().segments))
}

fn fsdp(stage: ZeroStage) -> impl Fn(Comm, Vec<Arc<dyn Segment>>) -> Box<Fsdp> {
    fsdp_resharding(stage, true)
}

fn fsdp_resharding(
    stage: ZeroStage,
    reshard_after_forward: bool,
) -> impl Fn(Comm, Vec<Arc<dyn Segment>>) -> Box<Fsdp> {
    move |comm, segs| {
        Box::new(
            Fsdp::new(
                comm,
                segs,
                FsdpConfig {
                    stage,
                    prefetch: true,
                    reshard_after_forward,
                },
            )
            .expect("fsdp"),
        )
    }
}

#[test]
fn ddp_on_2_and_4_ranks_equals_one_device() {
    let want = single_device(STEPS);
    for dp in [2, 4] {
        let got = data_parallel(dp, 1, Engine::default(), STEPS, &ddp(DdpMode::Bucketed));
        assert_matches(&format!("ddp dp={dp}"), &got, &want);
    }
}

#[test]
fn naive_ddp_equals_bucketed() {
    let bucketed = data_parallel(2, 1, Engine::default(), STEPS, &ddp(DdpMode::Bucketed));
    let naive = data_parallel(2, 1, Engine::default(), STEPS, &ddp(DdpMode::Naive));
    assert_matches("naive vs bucketed", &naive, &bucketed);
}

/// ZeRO-3 (weights gathered in the hooks around each segment) with the segments' hand-written
/// backward (`Backward::Tapes`), with and without checkpointing, the gathered weights freed
/// after each forward and gathered again for the backward or kept until it, against the
/// single-device autograd run; both ways of keeping the weights give the same numbers, bit for
/// bit (the tapes read the same gathered values from the slots).
#[test]
fn zero3_through_the_tapes_equals_one_device() {
    let want = single_device(STEPS);
    for checkpointing in [false, true] {
        let mut runs = Vec::new();
        for reshard in [true, false] {
            let engine = Engine::new(checkpointing).with_backward(Backward::Tapes);
            let got = data_parallel(
                2,
                1,
                engine,
                STEPS,
                &zero_resharding(ZeroStage::Three, reshard),
            );
            assert_matches(
                &format!("zero-3 tapes checkpointing={checkpointing} reshard={reshard}"),
                &got,
                &want,
            );
            runs.push(got);
        }
        assert_eq!(runs[0].losses, runs[1].losses, "checkpointing={checkpointing}");
        for (name, g) in &runs[0].grads0 {
            let flat = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("f32");
            assert_eq!(flat(g), flat(&runs[1].grads0[name]), "{name} checkpointing={checkpointing}");
        }
    }
}

#[test]
fn zero_stages_equal_one_device() {
    let want = single_device(STEPS);
    for (stage, dp, checkpointing) in [
        (ZeroStage::One, 2, false),
        (ZeroStage::Two, 2, false),
        (ZeroStage::Three, 4, true),
        (ZeroStage::Three, 2, false),
    ] {
        let got = data_parallel(dp, 1, Engine::new(checkpointing), STEPS, &zero(stage));
        assert_matches(
            &format!("zero-{stage:?} dp={dp} checkpointing={checkpointing}"),
            &got,
            &want,
        );
    }
}

#[test]
fn gradient_accumulation_equals_one_big_batch() {
    let want = single_device(3);
    let check = |name: &str, got: RunResult| {
        for (s, (g, w)) in got.losses.iter().zip(&want.losses).enumerate() {
            let rel = (g - w).abs() / w.abs();
            assert!(rel <= 1e-5, "{name}: step {s} loss {g} vs {w}");
        }
        for (p, w) in &want.grads0 {
            let rel = rel(&got.grads0[p], w);
            assert!(rel <= 1e-4, "{name}: gradient of {p} rel error {rel:e}");
        }
    };
    check(
        "ddp dp=2 k=2",
        data_parallel(2, 2, Engine::default(), 3, &ddp(DdpMode::Bucketed)),
    );
    check(
        "zero-1 dp=2 k=2",
        data_parallel(2, 2, Engine::default(), 3, &zero(ZeroStage::One)),
    );
    check(
        "zero-3 dp=2 k=4",
        data_parallel(2, 4, Engine::new(true), 3, &zero(ZeroStage::Three)),
    );
}

/// Model-state bytes of each rank after one step, taken after the optimizer has run and before
/// the gradients are dropped: parameters + gradients + AdamW moments all exist at that moment.
fn state_bytes(dp: usize, engine: Engine, make: &Make) -> Vec<ModelStateBytes> {
    let per_rank = GLOBAL_BATCH / dp;
    run_local(dp, TIMEOUT, |backend| {
        let rank = backend.world().rank();
        let mut s = make(&backend);
        let (x, y) = rows(0, rank * per_rank, per_rank);
        s.state_bytes_after_one_step(&engine, &x, &y)
    })
}

#[test]
fn zero3_on_4_ranks_holds_at_most_04x_of_ddp_model_state() {
    let n_params = cfg().n_params();
    let ddp_bytes = state_bytes(4, Engine::default(), &ddp(DdpMode::Bucketed));
    let zero3 = state_bytes(4, Engine::new(true), &zero(ZeroStage::Three));
    for (r, b) in ddp_bytes.iter().enumerate() {
        // DDP: a full copy of everything, as the analytic table says (16 bytes per parameter).
        assert_eq!(*b, analytic_model_state(None, n_params, 4), "ddp rank {r}");
    }
    for (r, (z, d)) in zero3.iter().zip(&ddp_bytes).enumerate() {
        let ratio = z.total() as f64 / d.total() as f64;
        assert!(
            ratio <= 0.4,
            "rank {r}: ZeRO-3 holds {z:?}, DDP {d:?}: ratio {ratio:.3} > 0.4"
        );
        // The analytic 16Φ/N, give or take one padding element per segment in each of the four
        // kinds of state (weights, gradients, m, v).
        let analytic = analytic_model_state(Some(ZeroStage::Three), n_params, 4).total();
        let slack = 16 * (cfg().n_layer + 2);
        assert!(
            z.total() <= analytic + slack,
            "rank {r}: {z:?} vs analytic {analytic} B"
        );
        assert!(
            z.total() + slack >= analytic,
            "rank {r}: {z:?} vs analytic {analytic} B"
        );
    }
    // The shards partition the model: summed over ranks, every element is held exactly once.
    let sum = |f: fn(&ModelStateBytes) -> usize| zero3.iter().map(f).sum::<usize>();
    assert_eq!(sum(|b| b.params), 4 * n_params);
    assert_eq!(sum(|b| b.grads), 4 * n_params);
    assert_eq!(sum(|b| b.optimizer), 8 * n_params);
}

#[test]
fn zero_stages_shard_what_they_promise() {
    let n_params = cfg().n_params();
    let full = 4 * n_params;
    for stage in [ZeroStage::One, ZeroStage::Two] {
        let bytes = state_bytes(2, Engine::default(), &zero(stage));
        let params: usize = bytes.iter().map(|b| b.params).sum();
        let grads: usize = bytes.iter().map(|b| b.grads).sum();
        let optimizer: usize = bytes.iter().map(|b| b.optimizer).sum();
        // Full weights on every rank plus the shards the optimizer updates.
        assert_eq!(params, 2 * full + full, "{stage:?}");
        assert_eq!(optimizer, 2 * full, "{stage:?}: Adam moments are sharded");
        let want_grads = if stage == ZeroStage::One {
            2 * full + full
        } else {
            full
        };
        assert_eq!(grads, want_grads, "{stage:?}: gradient bytes");
        let analytic = analytic_model_state(Some(stage), n_params, 2);
        assert_eq!(
            (params, grads, optimizer),
            (
                2 * analytic.params,
                2 * analytic.grads,
                2 * analytic.optimizer
            )
        );
    }
}

#[test]
fn every_rank_launches_the_same_bucket_sequence() {
    // DDP of a dp-only plan (`parallelize`), its dp group traced.
    let traces = run_local(4, TIMEOUT, |backend| {
        let rank = backend.world().rank();
        let (mut s, mesh) = ddp_model(&backend, DdpMode::Bucketed);
        let comm = mesh.dp.clone();
        let mut opt = adamw();
        comm.tracer().set_recording(true);
        for step in 0..2 {
            let (x, y) = rows(step, rank * 2, 2);
            s.forward_backward(&x, &y, 1.0, true)
                .expect("forward_backward");
            s.optimizer_step(&mut opt, LR, Some(1.0)).expect("step");
        }
        let stats = s.comm_stats();
        let events: Vec<(OpKind, u64)> = comm
            .tracer()
            .events()
            .iter()
            .map(|e| (e.op, e.bytes))
            .collect();
        (events, stats)
    });
    let (first, stats) = &traces[0];
    // Bucket sizes as configured: a small first bucket, then ≥ 16 KiB ones (the last may be short).
    let buckets: Vec<u64> = first
        .iter()
        .map(|(_, b)| *b)
        .take(stats.collectives)
        .collect();
    assert!(
        buckets.len() >= 4,
        "expected several buckets, got {buckets:?}"
    );
    assert!(
        first.iter().all(|(op, _)| *op == OpKind::AllReduce),
        "{first:?}"
    );
    assert!(
        buckets[0] < buckets[1],
        "first bucket should be the small one: {buckets:?}"
    );
    // Each step on the dp group: its buckets, then the loss's mean (two f64s) after them.
    let loss = (OpKind::AllReduce, 16);
    let step: Vec<(OpKind, u64)> = buckets
        .iter()
        .map(|&b| (OpKind::AllReduce, b))
        .chain([loss])
        .collect();
    assert_eq!(
        *first,
        [step.clone(), step].concat(),
        "two steps of bucket all-reduces, each followed by the loss"
    );
    assert_eq!(stats.bytes, buckets.iter().sum::<u64>());
    assert_eq!(
        stats.bytes,
        4 * cfg().n_params() as u64,
        "every gradient travels once"
    );
    for (r, (events, _)) in traces.iter().enumerate() {
        assert_eq!(
            events, first,
            "rank {r} launched a different sequence than rank 0"
        );
    }
    assert!(stats.backward_s > 0.0 && stats.comm_s > 0.0, "{stats:?}");
}

#[test]
fn different_initial_weights_are_refused_naming_the_rank() {
    let errors = run_local(3, TIMEOUT, |backend| {
        let dims = MeshDims::new(3, 1, 1, 1);
        let mesh = DeviceMesh::new(&backend, dims).expect("mesh");
        let mut w = init_weights(&cfg(), SEED).expect("init");
        if mesh.rank() == 2 {
            let name = "h.1.mlp.c_fc.weight";
            let bumped = (&w[name] * 1.001).expect("scale");
            w.insert(name.to_string(), bumped);
        }
        let plan = ParallelPlan::new(dims)
            .validate(&cfg(), 3, 3)
            .expect("plan validates");
        match parallelize(&cfg(), &w, &plan, &mesh, &Device::Cpu) {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    });
    for (r, e) in errors.iter().enumerate() {
        assert!(
            e.contains("rank 2") && e.contains("h.1.mlp.c_fc.weight"),
            "rank {r} got: {e:?}"
        );
    }
}

/// Wraps a segment and records, each time it runs forward (including the recompute in
/// backward), which of the model's parameters hold their full weights at that moment.
struct Probe {
    inner: Arc<dyn Segment>,
    all: Vec<mtrain_model::Param>,
    seen: Arc<std::sync::Mutex<Vec<(String, Vec<String>)>>>,
}

impl Segment for Probe {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn forward(
        &self,
        x: &Tensor,
        targets: Option<&Tensor>,
    ) -> candle_core::Result<mtrain_model::SegmentOut> {
        let live = self
            .all
            .iter()
            .filter(|p| p.elem_count() > 0)
            .map(|p| p.name().to_string())
            .collect();
        self.seen
            .lock()
            .expect("probe lock")
            .push((self.inner.name(), live));
        self.inner.forward(x, targets)
    }
    fn params(&self) -> Vec<mtrain_model::Param> {
        self.inner.params()
    }
}

#[test]
fn zero3_materialises_only_the_running_segment_and_frees_after_use() {
    let runs = run_local(2, TIMEOUT, |backend| {
        let comm = backend.world();
        let gpt = model();
        let all = gpt.params();
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let segs: Vec<Arc<dyn Segment>> = gpt
            .segments
            .iter()
            .map(|s| {
                Arc::new(Probe {
                    inner: s.clone(),
                    all: all.clone(),
                    seen: seen.clone(),
                }) as Arc<dyn Segment>
            })
            .collect();
        let own: BTreeMap<String, Vec<String>> = segs
            .iter()
            .map(|s| {
                (
                    s.name(),
                    s.params().iter().map(|p| p.name().to_string()).collect(),
                )
            })
            .collect();
        let mut s = Fsdp::new(comm.clone(), segs, FsdpConfig::default()).expect("fsdp");
        let live_between_steps =
            |all: &[mtrain_model::Param]| all.iter().filter(|p| p.elem_count() > 0).count();
        assert_eq!(
            live_between_steps(&all),
            0,
            "ZeRO-3 keeps no full weight after setup"
        );
        let mut opt = adamw();
        let (x, y) = rows(0, comm.rank() * 4, 4);
        s.forward_backward(&Engine::new(true), &x, &y, 1.0, true)
            .expect("forward_backward");
        s.optimizer_step(&mut opt, LR, None).expect("step");
        assert_eq!(
            live_between_steps(&all),
            0,
            "ZeRO-3 keeps no full weight between steps"
        );
        let seen = seen.lock().expect("probe lock").clone();
        (seen, own)
    });
    for (seen, own) in runs {
        // Forward over embedding, h.0, h.1, head, then the recompute of head, h.1, h.0, embedding.
        let order: Vec<&str> = seen.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            order,
            [
                "embedding",
                "h.0",
                "h.1",
                "head",
                "head",
                "h.1",
                "h.0",
                "embedding"
            ]
        );
        for (name, live) in &seen {
            let mut want = own[name].clone();
            if name == "head" {
                // The tied wte lives in the embedding's unit, which also holds wpe.
                want.push("wpe.weight".to_string());
            }
            want.sort();
            let mut live = live.clone();
            live.sort();
            assert_eq!(live, want, "weights held while {name} runs");
        }
    }
}

fn assert_close_maps(
    what: &str,
    got: &BTreeMap<String, Tensor>,
    want: &BTreeMap<String, Tensor>,
    tol: f64,
) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}: names"
    );
    for (name, w) in want {
        assert_eq!(got[name].dims(), w.dims(), "{what}: shape of {name}");
        let rel = rel(&got[name], w);
        assert!(rel <= tol, "{what}: {name} rel error {rel:e}");
    }
}

#[test]
fn zero3_state_gathers_to_the_single_device_state_and_resumes_under_another_layout() {
    const FIRST: usize = 3;
    let (reference, weights_ref, opt_ref) = single_device_full(FIRST + 2);
    let (_, weights_at_3, opt_at_3) = single_device_full(FIRST);

    // Train ZeRO-3 on 2 ranks, then gather weights and AdamW moments by parameter name.
    let saved = run_local(2, TIMEOUT, |backend| {
        let comm = backend.world();
        let rank = comm.rank();
        let mut s = fsdp(ZeroStage::Three)(comm, model().segments);
        let mut opt = adamw();
        for step in 0..FIRST {
            let (x, y) = rows(step, rank * 4, 4);
            s.forward_backward(&Engine::new(true), &x, &y, 1.0, true)
                .expect("forward_backward");
            s.optimizer_step(&mut opt, LR, None).expect("step");
        }
        let weights = s.full_state().expect("full state");
        let state = s.full_optimizer_state(&opt).expect("full optimizer state");
        // Sharding the full state again gives back exactly this rank's optimizer state.
        let again = s.shard_optimizer_state(&state).expect("shard");
        let mine = opt.state().expect("optimizer state");
        assert_eq!(
            again.m.keys().collect::<Vec<_>>(),
            mine.m.keys().collect::<Vec<_>>()
        );
        for (k, t) in &mine.m {
            assert_eq!(rel(&again.m[k], t), 0.0, "m of {k}");
            assert_eq!(rel(&again.v[k], &mine.v[k]), 0.0, "v of {k}");
        }
        (weights, state)
    });
    let (weights, state) = saved.into_iter().next().expect("rank 0");
    // Looser than the loss: the key bias gets a gradient that is zero in exact arithmetic
    // (softmax ignores a shift), so its float noise differs between layouts and AdamW, which
    // divides by √v, turns that noise into steps of up to lr. It moves no loss.
    assert_close_maps("weights after 3 steps", &weights, &weights_at_3, 1e-3);
    let want = opt_at_3.state().expect("optimizer state");
    assert_eq!(state.step, want.step);
    assert_close_maps("adam m after 3 steps", &state.m, &want.m, 1e-3);
    assert_close_maps("adam v after 3 steps", &state.v, &want.v, 1e-3);

    // Resume from that state under ZeRO-2 on 4 ranks, from a model built with another seed.
    let resumed = run_local(4, TIMEOUT, |backend| {
        let comm = backend.world();
        let rank = comm.rank();
        let other = Gpt::new(
            cfg(),
            &init_weights(&cfg(), SEED + 1).expect("init"),
            &Device::Cpu,
        )
        .expect("model");
        let mut s = fsdp(ZeroStage::Two)(comm, other.segments);
        s.load_full_state(&weights).expect("load weights");
        let mut opt = adamw();
        opt.load_state(s.shard_optimizer_state(&state).expect("shard"))
            .expect("load optimizer");
        let mut losses = Vec::new();
        for step in FIRST..FIRST + 2 {
            let (x, y) = rows(step, rank * 2, 2);
            losses.push(
                s.forward_backward(&Engine::default(), &x, &y, 1.0, true)
                    .expect("forward_backward"),
            );
            s.optimizer_step(&mut opt, LR, None).expect("step");
        }
        (losses, s.full_state().expect("full state"))
    });
    for k in 0..2 {
        let loss = resumed.iter().map(|(l, _)| l[k]).sum::<f64>() / 4.0;
        let want = reference.losses[FIRST + k];
        assert!(
            (loss - want).abs() / want <= 1e-5,
            "resumed step {}: {loss} vs {want}",
            FIRST + k
        );
    }
    assert_close_maps("weights after resuming", &resumed[0].1, &weights_ref, 1e-3);
    assert_eq!(opt_ref.steps_taken(), (FIRST + 2) as u64);
}
