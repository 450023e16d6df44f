//! Expert parallelism against closed forms and the single-device MoE (CPU, ranks as threads).
//!
//! - `all_to_all_*`: the differentiable all-to-all moves rows as its splits say, and its
//!   backward sends every gradient row back where it came from (zero-row splits included).
//! - `ep*_matches_one_device`: a tiny MoE GPT with ep = 2 and 4 (and dp = 4 with ep = 2, where
//!   the edp group is real) equals one device over 10 AdamW steps: same routing and drops per
//!   layer, loss and aux loss rel ≤ 1e-5, every gradient rel ≤ 1e-4.
//!
//!   Capacity is per routing group, and each rank routes its own tokens. The single-device
//!   reference therefore runs the global batch as dp micro-batches (the same tokens each rank
//!   holds, gradients accumulated with weight 1/dp): both sides route the same token groups
//!   with the same capacity, so drops can be compared one for one.
//! - `ep2_with_checkpointing_*`: the same with activation recompute (all-to-alls re-run in backward).
//! - `dp4_ep2_parallel_model_*`: the composed model of a dp × ep plan (`parallelize`): gathered
//!   gradients, global norm, final weights, group expert load, optimizer-state round trip.
//! - `peer_with_zero_tokens_*`: a router biased so ep rank 1's experts receive nothing still
//!   trains and still equals one device.
//! - `aux_loss_*`: the load-balancing and z-loss of the layer against a hand computation.
//! - `tapes::*` (`tapes.rs`): the expert-parallel MoE block's hand-written backward (the dispatch and combine
//!   all-to-alls' conjugates inside it) against autograd through the same block at ep = 2 and
//!   4, every gradient and the input's rel ≤ 1e-5, with capacity drops; the whole model through
//!   the tapes (`Backward::Tapes`) against one device by the tests above, tolerances unchanged;
//!   and the tapes issuing the collectives autograd issues (kind and bytes, in order).

#[path = "../common/mod.rs"]
mod common;
mod tapes;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use mtrain_comm::cpu::run_local;
use mtrain_comm::{Backend, DeviceMesh, MeshDims};
use mtrain_model::optim::{AdamW, AdamWConfig};
use mtrain_model::{
    init_weights, Backward, DenseLinear, Engine, FeedForward, Gpt, GptConfig, Grads, Mlp,
    MoeConfig, MoeStats, NoHooks, Param, Segment,
};
use mtrain_parallel::expert_parallel::{self, all_to_all, build_segments, sync_grads};
use mtrain_parallel::parallelize::{parallelize, ParallelPlan};
use mtrain_parallel::toolbox::unique_params;
use rand::{Rng, SeedableRng};

use common::{optim_items, rel_f, tiny_gpt, try_rel, with_moe};

type Res<T> = std::result::Result<T, String>;

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

// ---------------------------------------------------------------------------------------------
// The differentiable all-to-all against its closed form.
// ---------------------------------------------------------------------------------------------

/// Rank r sends `splits[r][p]` rows to rank p; row values encode (source, destination, k).
#[test]
fn all_to_all_moves_rows_and_backward_sends_gradients_back() {
    let splits = [[1usize, 0, 2], [0, 0, 0], [3, 1, 0]]; // rank 1 sends nothing, receives 0+0+1
    let results = run_local(3, Duration::from_secs(60), |b| -> Res<()> {
        let g = b.world();
        let r = g.rank();
        let send: Vec<usize> = splits[r].to_vec();
        let recv: Vec<usize> = (0..3).map(|p| splits[p][r]).collect();
        let code = |src: usize, dst: usize, k: usize| (100 * src + 10 * dst + k) as f32;
        let rows: Vec<f32> = (0..3)
            .flat_map(|p| (0..send[p]).flat_map(move |k| [code(r, p, k), -code(r, p, k)]))
            .collect();
        let n_send = send.iter().sum::<usize>();
        let x = Var::from_tensor(&Tensor::from_vec(rows, (n_send, 2), &Device::Cpu).map_err(s)?)
            .map_err(s)?;
        let y = all_to_all(x.as_tensor(), &send, &recv, &g).map_err(s)?; // (Σ recv, 2)
        let want: Vec<f32> = (0..3)
            .flat_map(|p| (0..recv[p]).flat_map(move |k| [code(p, r, k), -code(p, r, k)]))
            .collect();
        let got = y
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(s)?;
        if got != want {
            return Err(format!("rank {r}: forward {got:?}, want {want:?}"));
        }
        // Weight each received row by a value the receiver knows: 1000·r + its position. The
        // gradient of x's row is the weight its row got on the rank it went to.
        let n_recv = y.dim(0).map_err(s)?;
        let w: Vec<f32> = (0..n_recv)
            .flat_map(|i| [(1000 * r + i) as f32, 0.5])
            .collect();
        let w = Tensor::from_vec(w, (n_recv, 2), &Device::Cpu).map_err(s)?;
        let grads = (y * w)
            .and_then(|t| t.sum_all())
            .and_then(|t| t.backward())
            .map_err(s)?;
        let dx = match grads.get(x.as_tensor()) {
            Some(t) => t
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(s)?,
            None if n_send == 0 => Vec::new(),
            None => return Err(format!("rank {r}: no gradient for x")),
        };
        // Where does row k for destination p land? After the rows other sources sent to p first.
        let mut want_dx = Vec::new();
        for p in 0..3 {
            let before: usize = (0..r).map(|q| splits[q][p]).sum();
            for k in 0..send[p] {
                want_dx.extend([(1000 * p + before + k) as f32, 0.5]);
            }
        }
        if dx != want_dx {
            return Err(format!("rank {r}: backward {dx:?}, want {want_dx:?}"));
        }
        Ok(())
    });
    for (r, res) in results.into_iter().enumerate() {
        if let Err(e) = res {
            panic!("rank {r}: {e}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Whole model: expert parallel vs one device.
// ---------------------------------------------------------------------------------------------

const B_LOCAL: usize = 2;
const T: usize = 8;
const LR: f64 = 1e-3;

fn tiny_moe() -> GptConfig {
    with_moe(tiny_gpt(2, 2, 16))
}

/// Micro-batch `m` of step `step`: (idx, targets), each (B_LOCAL, T) u32.
fn batch(step: usize, m: usize, vocab: usize) -> (Tensor, Tensor) {
    let mut rng = rand::rngs::StdRng::seed_from_u64((1000 * step + m) as u64);
    let mut draw = || -> Tensor {
        let v: Vec<u32> = (0..B_LOCAL * T)
            .map(|_| rng.gen_range(0..vocab as u32))
            .collect();
        Tensor::from_vec(v, (B_LOCAL, T), &Device::Cpu).expect("tokens")
    };
    (draw(), draw())
}

/// What one micro-batch of one step gave.
#[derive(Clone)]
struct MicroOut {
    loss: f64,
    aux: f64,
    stats: Vec<MoeStats>,
}

/// One step of the single-device reference: per micro-batch outputs and the accumulated grads.
struct RefStep {
    micro: Vec<MicroOut>,
    grads: BTreeMap<String, Tensor>,
}

/// Forward and backward of one micro-batch; returns what it gave.
fn micro_step(
    segs: &[Arc<dyn Segment>],
    idx: &Tensor,
    tgt: &Tensor,
    loss_scale: f64,
    grads: &mut Grads,
    engine: Engine,
) -> Res<MicroOut> {
    let acts = engine
        .forward(segs, idx, Some(tgt), &mut NoHooks)
        .map_err(s)?;
    let loss = acts.output.to_scalar::<f32>().map_err(s)? as f64;
    let (aux, stats) = (acts.aux_loss, acts.stats.clone());
    engine
        .backward(segs, acts, None, loss_scale, grads, &mut NoHooks)
        .map_err(s)?;
    Ok(MicroOut { loss, aux, stats })
}

/// One device, `dp` micro-batches per step (gradients accumulated with weight 1/dp), AdamW.
fn reference(
    cfg: &GptConfig,
    weights: &BTreeMap<String, Tensor>,
    dp: usize,
    steps: usize,
) -> Vec<RefStep> {
    reference_with_final(cfg, weights, dp, steps, Engine::default()).0
}

/// [`reference`], also returning the weights after the last step.
fn reference_with_final(
    cfg: &GptConfig,
    weights: &BTreeMap<String, Tensor>,
    dp: usize,
    steps: usize,
    engine: Engine,
) -> (Vec<RefStep>, BTreeMap<String, Tensor>) {
    let gpt = Gpt::new(cfg.clone(), weights, &Device::Cpu).expect("model");
    let params = gpt.params();
    let mut opt = AdamW::new(AdamWConfig::default());
    let steps = (0..steps)
        .map(|step| {
            let mut grads = Grads::new();
            let micro = (0..dp)
                .map(|m| {
                    let (idx, tgt) = batch(step, m, cfg.vocab_size);
                    micro_step(
                        &gpt.segments,
                        &idx,
                        &tgt,
                        1.0 / dp as f64,
                        &mut grads,
                        engine,
                    )
                    .expect("reference step")
                })
                .collect();
            opt.step(LR, &optim_items(&params, |n| grads.get(n)))
                .expect("adamw");
            let grads = grads.iter().map(|(n, g)| (n.clone(), g.clone())).collect();
            RefStep { micro, grads }
        })
        .collect();
    let last = params
        .iter()
        .map(|p| (p.name().to_string(), p.tensor().detach()))
        .collect();
    (steps, last)
}

/// The worst differences one rank saw against the reference.
#[derive(Debug, Default)]
struct RankReport {
    loss_rel: f64,
    aux_rel: f64,
    grad_rel: f64,
    worst_grad: String,
    dropped: usize,
    /// Tokens kept per expert over all steps and layers (this rank's routing).
    kept: Vec<usize>,
}

/// Runs `steps` AdamW steps of the expert-parallel model on dp ranks (ep of them per expert
/// group) and compares every step with `refs`.
fn ep_run(
    cfg: &GptConfig,
    weights: &BTreeMap<String, Tensor>,
    dp: usize,
    ep: usize,
    refs: &[RefStep],
    engine: Engine,
) -> Vec<Res<RankReport>> {
    run_local(dp, Duration::from_secs(120), |b| -> Res<RankReport> {
        let mesh = DeviceMesh::new(&b as &dyn Backend, MeshDims::new(dp, 1, 1, ep)).map_err(s)?;
        let segs = build_segments(cfg, weights, &mesh.ep, false, &Device::Cpu).map_err(s)?;
        let params = unique_params(&segs);
        let m = mesh.coords.dp; // this rank's micro-batch
        let mut opt = AdamW::new(AdamWConfig::default());
        let mut rep = RankReport {
            kept: vec![0; 4],
            ..RankReport::default()
        };
        for (step, want) in refs.iter().enumerate() {
            let mut grads = Grads::new();
            let (idx, tgt) = batch(step, m, cfg.vocab_size);
            let got = micro_step(&segs, &idx, &tgt, 1.0, &mut grads, engine)?;
            sync_grads(&params, &mut grads, &mesh.dp, &mesh.edp).map_err(s)?;
            let w = &want.micro[m];
            if got.stats != w.stats {
                return Err(format!(
                    "step {step}: routing differs: {:?} vs one device {:?}",
                    got.stats, w.stats
                ));
            }
            for st in &got.stats {
                rep.dropped += st.dropped;
                for (k, n) in rep.kept.iter_mut().zip(&st.tokens_per_expert) {
                    *k += n;
                }
            }
            rep.loss_rel = rep.loss_rel.max(rel_f(got.loss, w.loss));
            rep.aux_rel = rep.aux_rel.max(rel_f(got.aux, w.aux));
            for p in &params {
                let g = grads
                    .get(p.name())
                    .ok_or(format!("no grad for {}", p.name()))?;
                let r = want
                    .grads
                    .get(p.name())
                    .ok_or(format!("reference has no grad for {}", p.name()))
                    .and_then(|w| try_rel(g, w))?;
                if r > rep.grad_rel {
                    rep.grad_rel = r;
                    rep.worst_grad = format!("{} at step {step}", p.name());
                }
            }
            opt.step(LR, &optim_items(&params, |n| grads.get(n)))
                .map_err(s)?;
        }
        Ok(rep)
    })
}

fn check_against_one_device(
    cfg: &GptConfig,
    weights: &BTreeMap<String, Tensor>,
    dp: usize,
    ep: usize,
    steps: usize,
    engine: Engine,
) -> Vec<RankReport> {
    let refs = reference(cfg, weights, dp, steps);
    let reports: Vec<RankReport> = ep_run(cfg, weights, dp, ep, &refs, engine)
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("dp {dp} ep {ep} rank {r}: {e}")))
        .collect();
    for (r, rep) in reports.iter().enumerate() {
        eprintln!("dp {dp} ep {ep} rank {r}: {rep:?}");
        assert!(
            rep.loss_rel <= 1e-5,
            "rank {r}: loss rel {:.3e} > 1e-5",
            rep.loss_rel
        );
        assert!(
            rep.aux_rel <= 1e-5,
            "rank {r}: aux rel {:.3e} > 1e-5",
            rep.aux_rel
        );
        assert!(
            rep.grad_rel <= 1e-4,
            "rank {r}: grad rel {:.3e} > 1e-4 ({})",
            rep.grad_rel,
            rep.worst_grad
        );
    }
    reports
}

#[test]
fn ep2_matches_one_device() {
    let cfg = tiny_moe();
    let w = init_weights(&cfg, 7).expect("weights");
    let reps = check_against_one_device(&cfg, &w, 2, 2, 10, Engine::default());
    assert!(
        reps.iter().any(|r| r.dropped > 0),
        "the test should exercise capacity drops"
    );
}

#[test]
fn ep4_matches_one_device() {
    let cfg = tiny_moe();
    let w = init_weights(&cfg, 8).expect("weights");
    let reps = check_against_one_device(&cfg, &w, 4, 4, 10, Engine::default());
    assert!(
        reps.iter().any(|r| r.dropped > 0),
        "the test should exercise capacity drops"
    );
}

/// dp = 4, ep = 2: every expert has two replicas (edp = 2) whose gradients are averaged.
#[test]
fn dp4_ep2_matches_one_device() {
    let cfg = tiny_moe();
    let w = init_weights(&cfg, 9).expect("weights");
    check_against_one_device(&cfg, &w, 4, 2, 10, Engine::default());
}

/// Activation checkpointing re-runs each block's forward in backward, all-to-alls included: the
/// recompute issues them in the same order on every rank and still equals one device.
#[test]
fn ep2_with_checkpointing_matches_one_device() {
    let cfg = tiny_moe();
    let w = init_weights(&cfg, 12).expect("weights");
    check_against_one_device(&cfg, &w, 2, 2, 5, Engine::new(true));
}

/// Bias every block's router so that experts 2 and 3 (ep rank 1's) never win a top-2 choice:
/// ln_2's bias puts +5 on channel 0 of the router's input (LayerNorm output stays within
/// ±√(C−1) ≈ 3.9, so that channel is always ≥ 1.1), and the router reads channel 0 with
/// weight +3 for experts 0, 1 and −3 for experts 2, 3.
#[test]
fn peer_with_zero_tokens_trains_and_matches_one_device() {
    peer_with_zero_tokens(Engine::default());
}

/// [`peer_with_zero_tokens_trains_and_matches_one_device`] with the layout run by `engine`.
fn peer_with_zero_tokens(engine: Engine) {
    let cfg = tiny_moe();
    let mut w = init_weights(&cfg, 10).expect("weights");
    let c = cfg.n_embd;
    for i in 0..cfg.n_layer {
        let mut bias = vec![0f32; c];
        bias[0] = 5.0;
        w.insert(
            format!("h.{i}.ln_2.bias"),
            Tensor::from_vec(bias, c, &Device::Cpu).expect("bias"),
        );
        let name = format!("h.{i}.moe.router.weight");
        let mut router = w[&name].to_vec2::<f32>().expect("router");
        for (e, row) in router.iter_mut().enumerate() {
            row[0] = if e < 2 { 3.0 } else { -3.0 };
        }
        let flat: Vec<f32> = router.into_iter().flatten().collect();
        w.insert(
            name,
            Tensor::from_vec(flat, (4, c), &Device::Cpu).expect("router"),
        );
    }
    let reps = check_against_one_device(&cfg, &w, 2, 2, 4, engine);
    for (r, rep) in reps.iter().enumerate() {
        assert_eq!(
            rep.kept[2] + rep.kept[3],
            0,
            "rank {r}: experts 2, 3 got tokens: {:?}",
            rep.kept
        );
        assert!(
            rep.kept[0] > 0 && rep.kept[1] > 0,
            "rank {r}: {:?}",
            rep.kept
        );
    }
}

/// The composed model of a dp-only plan with experts carved out of it (`parallelize`, dp = 4,
/// ep = 2) equals one device: gathered full gradients and the global gradient norm every step, the gathered full
/// weights after 5 steps, the group's expert load, and an optimizer-state round trip. Both
/// sides run autograd: the final weights pass through five AdamW steps, and the key part of
/// `c_attn.bias` has no gradient in exact arithmetic, so its update is each side's rounding
/// noise (summed in another order over dp) divided by √v + ε; the tapes' EP parity is
/// `tapes.rs`'s, on gradients and losses.
#[test]
fn dp4_ep2_parallel_model_matches_one_device() {
    let (dp, ep, steps) = (4, 2, 5);
    let cfg = tiny_moe();
    let w = init_weights(&cfg, 11).expect("weights");
    let oracle = Engine::default().with_backward(Backward::Autograd);
    let (refs, last) = reference_with_final(&cfg, &w, dp, steps, oracle);
    let results = run_local(dp, Duration::from_secs(120), |b| -> Res<()> {
        let mesh = DeviceMesh::new(&b as &dyn Backend, MeshDims::new(dp, 1, 1, ep)).map_err(s)?;
        let plan = ParallelPlan {
            backward: Backward::Autograd,
            ..ParallelPlan::new(MeshDims::new(dp, 1, 1, ep))
        };
        let plan = plan.validate(&cfg, dp, dp).map_err(s)?;
        let mut edp = parallelize(&cfg, &w, &plan, &mesh, &Device::Cpu).map_err(s)?;
        let mut opt = AdamW::new(AdamWConfig::default());
        let m = mesh.coords.dp;
        for (step, want) in refs.iter().enumerate() {
            let (idx, tgt) = batch(step, m, cfg.vocab_size);
            let out = edp.forward_backward(&idx, &tgt, 1.0, true).map_err(s)?;
            // The composed model reports the global batch's mean loss, the same on every rank.
            let mean = want.micro.iter().map(|mo| mo.loss).sum::<f64>() / dp as f64;
            if rel_f(out.loss, mean) > 1e-5 {
                return Err(format!("step {step}: loss {} vs {mean}", out.loss));
            }
            let full = edp.full_grads().map_err(s)?;
            if full.len() != want.grads.len() {
                return Err(format!(
                    "{} full grads, one device has {}",
                    full.len(),
                    want.grads.len()
                ));
            }
            let mut want_sq = 0.0;
            for (name, g) in &want.grads {
                let r = try_rel(full.get(name).ok_or(format!("no full grad {name}"))?, g)?;
                if r > 1e-4 {
                    return Err(format!("step {step}: grad {name} rel {r:.3e}"));
                }
                want_sq += g
                    .sqr()
                    .and_then(|t| t.sum_all())
                    .and_then(|t| t.to_dtype(DType::F64))
                    .and_then(|t| t.to_scalar::<f64>())
                    .map_err(s)?;
            }
            let load = out.moe_load.ok_or("no expert load")?;
            for (layer, got) in load.iter().enumerate() {
                let mut kept = vec![0; 4];
                let mut dropped = 0;
                for mo in &want.micro {
                    for (k, n) in kept.iter_mut().zip(&mo.stats[layer].tokens_per_expert) {
                        *k += n;
                    }
                    dropped += mo.stats[layer].dropped;
                }
                if got.tokens_per_expert != kept || got.dropped != dropped {
                    return Err(format!(
                        "step {step} layer {layer}: load {got:?} vs {kept:?}, {dropped} dropped"
                    ));
                }
            }
            let norm = edp.optimizer_step(&mut opt, LR, None).map_err(s)?;
            if rel_f(norm, want_sq.sqrt()) > 1e-5 {
                return Err(format!(
                    "step {step}: grad norm {norm} vs {}",
                    want_sq.sqrt()
                ));
            }
        }
        let state = edp.full_state().map_err(s)?;
        for (name, t) in &last {
            let r = try_rel(state.get(name).ok_or(format!("no weight {name}"))?, t)?;
            if r > 1e-4 {
                return Err(format!("final weight {name} rel {r:.3e}"));
            }
        }
        let full_opt = edp.full_optimizer_state(&opt).map_err(s)?;
        if full_opt.m.len() != last.len() {
            return Err(format!(
                "full optimizer state has {} moments, want {}",
                full_opt.m.len(),
                last.len()
            ));
        }
        let mut again = AdamW::new(AdamWConfig::default());
        edp.load_optimizer_state(&mut again, &full_opt).map_err(s)?;
        let back = again.state().expect("optimizer state loaded");
        let mine = opt.state().expect("optimizer state");
        if back.m.keys().ne(mine.m.keys()) {
            return Err("optimizer state round trip changed the names".into());
        }
        for (name, t) in &mine.v {
            if try_rel(&back.v[name], t)? != 0.0 {
                return Err(format!("optimizer state round trip changed v of {name}"));
            }
        }
        Ok(())
    });
    for (r, res) in results.into_iter().enumerate() {
        if let Err(e) = res {
            panic!("rank {r}: {e}");
        }
    }
}

#[test]
fn experts_must_divide_over_ep() {
    let cfg = tiny_moe();
    let w = init_weights(&cfg, 1).expect("weights");
    let errs = run_local(3, Duration::from_secs(30), |b| {
        build_segments(&cfg, &w, &b.world(), false, &Device::Cpu)
            .err()
            .map(|e| e.to_string())
    });
    for e in errs {
        let e = e.expect("ep 3 with 4 experts must be refused");
        assert!(e.contains("n_experts (4)") && e.contains("ep (3)"), "{e}");
    }
}

// ---------------------------------------------------------------------------------------------
// Auxiliary loss against a hand computation.
// ---------------------------------------------------------------------------------------------

/// Four tokens, two experts (one per rank), top-1, router = identity on C = 2:
///
/// ```text
///   token   x        logits    probs (softmax)       top-1
///   0      [1, 0]    [1, 0]    [σ(1),  σ(-1)]        0
///   1      [0, 1]    [0, 1]    [σ(-1), σ(1)]         1
///   2      [1, 1]    [1, 1]    [1/2,   1/2]          0 (tie: lower index)
///   3      [1,-1]    [1,-1]    [σ(2),  σ(-2)]        0
///   f = [3/4, 1/4]   P = mean probs   lb = 2 · (f₀P₀ + f₁P₁)
///   z = mean_t (ln Σ_e exp logits)²
/// ```
#[test]
fn aux_loss_equals_hand_computation() {
    let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
    let probs = [
        [sig(1.0), sig(-1.0)],
        [sig(-1.0), sig(1.0)],
        [0.5, 0.5],
        [sig(2.0), sig(-2.0)],
    ];
    let p0 = probs.iter().map(|p| p[0]).sum::<f64>() / 4.0;
    let p1 = probs.iter().map(|p| p[1]).sum::<f64>() / 4.0;
    let lb = 2.0 * (0.75 * p0 + 0.25 * p1);
    let lse = |a: f64, b: f64| (a.exp() + b.exp()).ln();
    let z = [lse(1.0, 0.0), lse(0.0, 1.0), lse(1.0, 1.0), lse(1.0, -1.0)]
        .iter()
        .map(|l| l * l)
        .sum::<f64>()
        / 4.0;
    let (aux_coef, z_coef) = (1.0, 0.5);
    let want = aux_coef * lb + z_coef * z;

    let results = run_local(2, Duration::from_secs(30), |b| -> Res<(f64, MoeStats)> {
        let g = b.world();
        let dev = Device::Cpu;
        let t = |v: Vec<f32>, shape: &[usize]| Tensor::from_vec(v, shape, &dev).map_err(s);
        let router = Param::new("router", t(vec![1., 0., 0., 1.], &[2, 2])?).map_err(s)?;
        let e = g.rank();
        let lin = |name: &str, o: usize, i: usize| -> Res<Box<dyn mtrain_model::Linear>> {
            let w = t((0..o * i).map(|k| 0.1 * k as f32).collect(), &[o, i])?;
            Ok(Box::new(DenseLinear::new(
                Param::new(format!("e{e}.{name}.weight"), w).map_err(s)?,
                Some(Param::new(format!("e{e}.{name}.bias"), t(vec![0.0; o], &[o])?).map_err(s)?),
            )))
        };
        let expert = Mlp::new(lin("c_fc", 8, 2)?, lin("c_proj", 2, 8)?);
        let cfg = MoeConfig {
            n_experts: 2,
            top_k: 1,
            capacity_factor: 2.0,
            aux_loss_coef: aux_coef,
            z_loss_coef: z_coef,
        };
        let layer = expert_parallel::moe_layer(router, vec![expert], cfg, g, false).map_err(s)?;
        let x = t(vec![1., 0., 0., 1., 1., 1., 1., -1.], &[4, 2])?;
        let out = layer.forward(&x).map_err(s)?;
        let aux = out
            .aux_loss
            .ok_or("no aux loss")?
            .to_dtype(DType::F64)
            .and_then(|a| a.to_scalar::<f64>())
            .map_err(s)?;
        Ok((aux, out.stats.ok_or("no stats")?))
    });
    for (r, res) in results.into_iter().enumerate() {
        let (aux, stats) = res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(
            rel_f(aux, want) <= 1e-6,
            "rank {r}: aux {aux} vs hand {want} (lb {lb}, z {z})"
        );
        assert_eq!(stats.tokens_per_expert, vec![3, 1], "rank {r}");
        assert_eq!(stats.dropped, 0, "rank {r}");
    }
    // The is_expert_param rule the gradient sync relies on.
    assert!(expert_parallel::is_expert_param(
        "h.0.moe.experts.3.c_fc.weight"
    ));
    assert!(!expert_parallel::is_expert_param("h.0.moe.router.weight"));
}

/// The layer issues the all-to-alls of [`MOE_EXCHANGES`] (what the cost model counts) in order,
/// and its backward the reverse exchanges of [`MoeExchange::backward_order`]: ep = 2, E = 2, top-1,
/// every rank routing three tokens to expert 0 and one to expert 1, so a rank's dispatch input
/// S (4 rows) and combine input R (6 rows on rank 0, 2 on rank 1) differ and the trace's sizes
/// tell the exchanges apart.
#[test]
fn moe_layer_issues_its_described_exchanges_in_order() {
    use expert_parallel::{MoeExchange, MOE_EXCHANGES};
    use mtrain_comm::OpKind;
    let results = run_local(2, Duration::from_secs(30), |b| -> Res<()> {
        let g = b.world();
        let dev = Device::Cpu;
        let t = |v: Vec<f32>, shape: &[usize]| Tensor::from_vec(v, shape, &dev).map_err(s);
        let router = Param::new("router", t(vec![1., 0., 0., 1.], &[2, 2])?).map_err(s)?;
        let lin = |name: &str, o: usize, i: usize| -> Res<Box<dyn mtrain_model::Linear>> {
            let w = t((0..o * i).map(|k| 0.1 * k as f32).collect(), &[o, i])?;
            Ok(Box::new(DenseLinear::new(
                Param::new(format!("{name}.weight"), w).map_err(s)?,
                Some(Param::new(format!("{name}.bias"), t(vec![0.0; o], &[o])?).map_err(s)?),
            )))
        };
        let expert = Mlp::new(lin("c_fc", 8, 2)?, lin("c_proj", 2, 8)?);
        let cfg = MoeConfig {
            n_experts: 2,
            top_k: 1,
            capacity_factor: 2.0,
            aux_loss_coef: 0.0,
            z_loss_coef: 0.0,
        };
        let layer = expert_parallel::moe_layer(router, vec![expert], cfg, g.clone(), false).map_err(s)?;
        let x = Var::from_tensor(&t(vec![1., 0., 0., 1., 1., 1., 1., -1.], &[4, 2])?).map_err(s)?;
        g.tracer().set_recording(true);
        let out = layer.forward(x.as_tensor()).map_err(s)?;
        let fwd = g.tracer().events();
        out.out.sum_all().and_then(|l| l.backward()).map_err(s)?;
        let bwd = g.tracer().events()[fwd.len()..].to_vec();
        let row = 2 * 4; // C f32
        let (sent, recv) = (4 * row, if g.rank() == 0 { 6 } else { 2 } * row);
        let want_fwd: Vec<(OpKind, u64)> = MOE_EXCHANGES
            .iter()
            .map(|e| match e {
                MoeExchange::Counts => (OpKind::AllToAll, 2 * 4), // (E,) u32
                MoeExchange::Dispatch => (OpKind::AllToAll, sent),
                MoeExchange::Combine => (OpKind::AllToAll, recv),
            })
            .collect();
        // Backward: each reverse all-to-all's input is its forward's output.
        let want_bwd: Vec<(OpKind, u64)> = MoeExchange::backward_order()
            .map(|e| match e {
                MoeExchange::Combine => (OpKind::AllToAll, sent),
                _ => (OpKind::AllToAll, recv),
            })
            .collect();
        let got = |v: &[mtrain_comm::TraceEvent]| v.iter().map(|e| (e.op, e.bytes)).collect();
        let (got_fwd, got_bwd): (Vec<_>, Vec<_>) = (got(&fwd), got(&bwd));
        if (&got_fwd, &got_bwd) != (&want_fwd, &want_bwd) {
            return Err(format!(
                "rank {}: forward {got_fwd:?} / backward {got_bwd:?}, described {want_fwd:?} / {want_bwd:?}",
                g.rank()
            ));
        }
        Ok(())
    });
    for (r, res) in results.into_iter().enumerate() {
        res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}
