//! Tensor parallelism against closed forms and the single-device model (CPU, ranks as threads).
//!
//! - `ops_*`: each differentiable collective's forward and backward against its closed form.
//! - `*_matches_dense`: each layer against its single-device counterpart: output, input gradient,
//!   weight and bias gradients (rel ≤ 1e-5).
//! - `gpt_tp*`: the whole GPT with tp = 2 and 4, with and without sequence parallelism, equals one
//!   device over 10 SGD steps (loss rel ≤ 1e-5, every gradient rel ≤ 1e-4); `*_chunked_*` the
//!   same with `--tp-overlap chunked`, `*_ring_*` with `--tp-overlap ring` (which needs
//!   sequence parallelism, and says so without it).
//! - `trace_*`: the collectives each block issues in forward and backward, that the tapes
//!   issue the same ones (kind and bytes, in order) as autograd, and that every segment issues
//!   exactly those of its mapping table (the cost model's description), in order.
//! - `tapes_*`: every tensor-parallel segment's hand-written backward against autograd, every
//!   parameter gradient and the input gradient (rel ≤ 1e-5, on the CPU and, where there is one, on a GPU), the whole model through the tapes
//!   against one device (with and without checkpointing), and at tp = 1 the block's tape
//!   giving the dense block tape's numbers exactly.

mod common;

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Duration;

use candle_core::{Device, Tensor, Var};
use mtrain_comm::cpu::run_local;
use mtrain_comm::mesh::MeshDims;
use mtrain_comm::{chunk_range, Backend, Comm, OpKind};
use mtrain_model::gpt::{Embedding, Head};
use mtrain_model::{
    init_weights, Backward, CausalSelfAttention, DenseLinear, Engine, Gpt, GptConfig, Grads, Hooks,
    LayerNorm, Linear, Mlp, NoHooks, Param, Segment,
};
use mtrain_parallel::ops::*;
use mtrain_parallel::plan::{ParallelPlan, ValidPlan};
use mtrain_parallel::tensor_parallel::{
    self, ColumnInput, ColumnParallelLinear, Placement, RowOutput, RowParallelLinear, ShardLayout,
    TpOverlap, VocabParallelEmbedding, VocabParallelHead, VocabShard,
};
use rand::{Rng, SeedableRng};

use common::{det, rel, tiny_gpt};

type R<T> = candle_core::Result<T>;

/// Runs `f` on `n` ranks (threads), handing each its world group as the tp group.
fn on_ranks<T: Send>(n: usize, f: impl Fn(Comm) -> T + Sync) -> Vec<T> {
    run_local(n, Duration::from_secs(60), |b| f(b.world()))
}

fn assert_close(what: &str, a: &Tensor, b: &Tensor, tol: f64) {
    let r = rel(a, b);
    assert!(r <= tol, "{what}: rel error {r:.3e} > {tol:.0e}");
}

/// [`assert_close`], returning the relative error.
fn close(what: &str, a: &Tensor, b: &Tensor, tol: f64) -> f64 {
    assert_close(what, a, b, tol);
    rel(a, b)
}

/// Σ (y · w) and its gradients.
fn backward_of(y: &Tensor, w: &Tensor) -> candle_core::backprop::GradStore {
    (y * w)
        .expect("mul")
        .sum_all()
        .expect("sum")
        .backward()
        .expect("backward")
}

fn grad(store: &candle_core::backprop::GradStore, t: &Tensor) -> Tensor {
    store.get(t).cloned().expect("gradient missing")
}

// ---------------------------------------------------------------------------------------------
// Differentiable collectives against closed forms.
// ---------------------------------------------------------------------------------------------

const SHAPE: [usize; 3] = [2, 6, 4]; // (B, T, C) with T = 6 split unevenly over 4 ranks
const SEEDS: u64 = 100;

/// Rank r's input x_r and upstream gradient weight w_r (of the output's shape).
fn x_of(r: usize, shape: &[usize]) -> Tensor {
    det(shape, SEEDS + r as u64)
}
fn w_of(r: usize, shape: &[usize]) -> Tensor {
    det(shape, 2 * SEEDS + r as u64)
}
fn sum_over(n: usize, f: impl Fn(usize) -> Tensor) -> Tensor {
    (1..n).fold(f(0), |acc, r| (acc + f(r)).expect("add"))
}
fn cat_over(n: usize, dim: usize, f: impl Fn(usize) -> Tensor) -> Tensor {
    Tensor::cat(&(0..n).map(f).collect::<Vec<_>>(), dim).expect("cat")
}
fn slice(t: &Tensor, dim: usize, n: usize, r: usize) -> Tensor {
    let c = chunk_range(t.dim(dim).expect("dim"), n, r);
    t.narrow(dim, c.start, c.len()).expect("narrow")
}

/// Applies `op` to rank r's `x` (a Var), backpropagates Σ(y · w_r) and returns (y, dx).
fn run_op(
    g: &Comm,
    x: Tensor,
    w_shape: impl Fn(&Tensor) -> Vec<usize>,
    op: impl Fn(&Tensor) -> R<Tensor>,
) -> (Tensor, Tensor) {
    let x = Var::from_tensor(&x).expect("var");
    let y = op(x.as_tensor()).expect("op");
    let store = backward_of(&y, &w_of(g.rank(), &w_shape(&y)));
    (y, grad(&store, x.as_tensor()))
}

#[test]
fn ops_forward_and_backward_match_closed_forms() {
    for n in [1usize, 2, 3, 4] {
        on_ranks(n, |g| {
            let r = g.rank();
            let same = |y: &Tensor| y.dims().to_vec();
            let last = SHAPE.len() - 1;
            // f: y = x_r, dx = Σ w
            let (y, dx) = run_op(&g, x_of(r, &SHAPE), same, |x| copy_to_tp_region(x, &g));
            assert_close("copy fwd", &y, &x_of(r, &SHAPE), 0.0);
            assert_close("copy bwd", &dx, &sum_over(n, |p| w_of(p, &SHAPE)), 1e-6);
            // g: y = Σ x, dx = w_r
            let (y, dx) = run_op(&g, x_of(r, &SHAPE), same, |x| reduce_from_tp_region(x, &g));
            assert_close("reduce fwd", &y, &sum_over(n, |p| x_of(p, &SHAPE)), 1e-6);
            assert_close("reduce bwd", &dx, &w_of(r, &SHAPE), 0.0);
            // gather last dim: y = cat x, dx = slice r of w_r
            let (y, dx) = run_op(&g, x_of(r, &SHAPE), same, |x| gather_from_tp_region(x, &g));
            assert_close(
                "gather fwd",
                &y,
                &cat_over(n, last, |p| x_of(p, &SHAPE)),
                0.0,
            );
            assert_close(
                "gather bwd",
                &dx,
                &slice(&w_of(r, y.dims()), last, n, r),
                0.0,
            );
            // scatter last dim (same x everywhere): y = slice r, dx = cat of every rank's w
            let full = [2, 6, 4 * n];
            let (y, dx) = run_op(&g, x_of(0, &full), same, |x| scatter_to_tp_region(x, &g));
            assert_close("scatter fwd", &y, &slice(&x_of(0, &full), last, n, r), 0.0);
            let piece = |p: usize| w_of(p, slice(&x_of(0, &full), last, n, p).dims());
            assert_close("scatter bwd", &dx, &cat_over(n, last, piece), 0.0);
            // sequence gather: y = cat_T x_r, dx = slice r of Σ w
            let sh = |p: usize| slice(&x_of(p, &SHAPE), 1, n, p); // rank p's sequence shard
            let (y, dx) = run_op(&g, sh(r), same, |x| {
                gather_from_sequence_parallel_region(x, 1, &g)
            });
            assert_close("seq gather fwd", &y, &cat_over(n, 1, sh), 0.0);
            assert_close(
                "seq gather bwd",
                &dx,
                &slice(&sum_over(n, |p| w_of(p, &SHAPE)), 1, n, r),
                1e-6,
            );
            // sequence reduce-scatter: y = slice r of Σ x, dx = cat_T w_p
            let (y, dx) = run_op(&g, x_of(r, &SHAPE), same, |x| {
                reduce_scatter_to_sequence_parallel_region(x, 1, &g)
            });
            assert_close(
                "seq rs fwd",
                &y,
                &slice(&sum_over(n, |p| x_of(p, &SHAPE)), 1, n, r),
                1e-6,
            );
            let wp = |p: usize| w_of(p, slice(&x_of(0, &SHAPE), 1, n, p).dims());
            assert_close("seq rs bwd", &dx, &cat_over(n, 1, wp), 0.0);
            // sequence scatter (same x everywhere): y = slice r, dx = cat_T w_p
            let (y, dx) = run_op(&g, x_of(0, &SHAPE), same, |x| {
                scatter_to_sequence_parallel_region(x, 1, &g)
            });
            assert_close(
                "seq scatter fwd",
                &y,
                &slice(&x_of(0, &SHAPE), 1, n, r),
                0.0,
            );
            assert_close("seq scatter bwd", &dx, &cat_over(n, 1, wp), 0.0);
        });
    }
}

#[test]
fn ops_on_untracked_input_skip_the_graph() {
    on_ranks(2, |g| {
        let x = x_of(g.rank(), &SHAPE); // a constant: no Var upstream
        let y = reduce_from_tp_region(&x, &g).expect("reduce");
        assert!(
            !y.track_op(),
            "a collective on a constant must not be recorded"
        );
        assert_close("fwd", &y, &sum_over(2, |p| x_of(p, &SHAPE)), 1e-6);
    });
}

// ---------------------------------------------------------------------------------------------
// Layers against their single-device counterparts.
// ---------------------------------------------------------------------------------------------

const LAYER_TOL: f64 = 1e-5;

/// A dense reference parameter and this rank's shard of it, registered in `layout`.
fn pair(
    layout: &mut ShardLayout,
    name: &str,
    full: &Tensor,
    placement: Placement,
) -> (Param, Param) {
    let local = layout.take(name, full, placement).expect("shard");
    (
        Param::new(name, full.clone()).expect("param"),
        Param::new(name, local).expect("param"),
    )
}

/// Checks the gradient of every reference param against the gathered gradient of its shard.
fn check_param_grads(
    g: &Comm,
    layout: &ShardLayout,
    refs: &[Param],
    ref_store: &candle_core::backprop::GradStore,
    tps: &[Param],
    store: &candle_core::backprop::GradStore,
) {
    for (rp, tp) in refs.iter().zip(tps) {
        let full = layout
            .gather_full(tp.name(), &grad(store, &tp.tensor()), g)
            .expect("gather");
        assert_close(
            &format!("grad {}", rp.name()),
            &full,
            &grad(ref_store, &rp.tensor()),
            LAYER_TOL,
        );
    }
}

#[test]
fn column_and_row_parallel_linear_match_dense() {
    for n in [2usize, 4] {
        on_ranks(n, |g| {
            let mut layout = ShardLayout::new(g.rank(), n);
            let (w, b) = (det(&[8, 12], 1), det(&[8], 2));
            let x = det(&[2, 3, 12], 3);
            let up = det(&[2, 3, 8], 4);
            let dense_ref = |w: &Param, b: &Param, x: &Tensor| {
                DenseLinear::new(w.clone(), Some(b.clone())).forward(x)
            };

            // Column, output gathered: W (8, 12) split on the output dim.
            let (rw, cw) = pair(
                &mut layout,
                "col.weight",
                &w,
                Placement::Sharded { dim: 0, blocks: 1 },
            );
            let (rb, cb) = pair(
                &mut layout,
                "col.bias",
                &b,
                Placement::Sharded { dim: 0, blocks: 1 },
            );
            let col = ColumnParallelLinear {
                weight: cw.clone(),
                bias: Some(cb.clone()),
                input: ColumnInput::Replicated,
                gather_output: true,
                group: g.clone(),
                overlap: TpOverlap::None,
            };
            let (xr, xt) = (
                Var::from_tensor(&x).expect("v"),
                Var::from_tensor(&x).expect("v"),
            );
            let y_ref = dense_ref(&rw, &rb, xr.as_tensor()).expect("ref");
            let y = col.forward(xt.as_tensor()).expect("col");
            assert_close("column out", &y, &y_ref, LAYER_TOL);
            let (s_ref, s) = (backward_of(&y_ref, &up), backward_of(&y, &up));
            assert_close(
                "column dx",
                &grad(&s, xt.as_tensor()),
                &grad(&s_ref, xr.as_tensor()),
                LAYER_TOL,
            );
            check_param_grads(&g, &layout, &[rw, rb], &s_ref, &[cw, cb], &s);

            // Row, input scattered from the full x: W (8, 12) split on the input dim, bias added once.
            let (rw, pw) = pair(
                &mut layout,
                "row.weight",
                &w,
                Placement::Sharded { dim: 1, blocks: 1 },
            );
            let (rb, pb) = pair(
                &mut layout,
                "row.bias",
                &b,
                Placement::Replicated {
                    partial_grad: false,
                },
            );
            let row = RowParallelLinear {
                weight: pw.clone(),
                bias: Some(pb.clone()),
                output: RowOutput::AllReduce,
                group: g.clone(),
                overlap: TpOverlap::None,
            };
            let (xr, xt) = (
                Var::from_tensor(&x).expect("v"),
                Var::from_tensor(&x).expect("v"),
            );
            let y_ref = dense_ref(&rw, &rb, xr.as_tensor()).expect("ref");
            let y = row
                .forward(&scatter_to_tp_region(xt.as_tensor(), &g).expect("scatter"))
                .expect("row"); // (2, 3, 8)
            assert_close("row out", &y, &y_ref, LAYER_TOL);
            let (s_ref, s) = (backward_of(&y_ref, &up), backward_of(&y, &up));
            assert_close(
                "row dx",
                &grad(&s, xt.as_tensor()),
                &grad(&s_ref, xr.as_tensor()),
                LAYER_TOL,
            );
            check_param_grads(&g, &layout, &[rw, rb], &s_ref, &[pw, pb], &s);
        });
    }
}

/// Dense and tensor-parallel attention + MLP (heads 4, C 16) built from the same full weights.
#[test]
fn attention_and_mlp_match_dense() {
    let (c, heads) = (16usize, 4usize);
    for n in [2usize, 4] {
        on_ranks(n, |g| {
            let mut layout = ShardLayout::new(g.rank(), n);
            let mut refs = Vec::new();
            let mut tps = Vec::new();
            let mut lin =
                |name: &str, out: usize, inp: usize, column: bool, blocks: usize, seed: u64| {
                    let (w, b) = (det(&[out, inp], seed), det(&[out], seed + 1));
                    let (wp, bp) = match column {
                        true => (
                            Placement::Sharded { dim: 0, blocks },
                            Placement::Sharded { dim: 0, blocks },
                        ),
                        false => (
                            Placement::Sharded { dim: 1, blocks: 1 },
                            Placement::Replicated {
                                partial_grad: false,
                            },
                        ),
                    };
                    let (rw, tw) = pair(&mut layout, &format!("{name}.weight"), &w, wp);
                    let (rb, tb) = pair(&mut layout, &format!("{name}.bias"), &b, bp);
                    refs.extend([rw.clone(), rb.clone()]);
                    tps.extend([tw.clone(), tb.clone()]);
                    let dense: Box<dyn Linear> = Box::new(DenseLinear::new(rw, Some(rb)));
                    let par: Box<dyn Linear> = match column {
                        true => Box::new(ColumnParallelLinear {
                            weight: tw,
                            bias: Some(tb),
                            input: ColumnInput::Replicated,
                            gather_output: false,
                            group: g.clone(),
                            overlap: TpOverlap::None,
                        }),
                        false => Box::new(RowParallelLinear {
                            weight: tw,
                            bias: Some(tb),
                            output: RowOutput::AllReduce,
                            group: g.clone(),
                            overlap: TpOverlap::None,
                        }),
                    };
                    (dense, par)
                };
            let (qkv_d, qkv_p) = lin("c_attn", 3 * c, c, true, 3, 10);
            let (proj_d, proj_p) = lin("c_proj", c, c, false, 1, 20);
            let (fc_d, fc_p) = lin("c_fc", 4 * c, c, true, 1, 30);
            let (fc2_d, fc2_p) = lin("c_proj2", c, 4 * c, false, 1, 40);
            let attn_d = CausalSelfAttention::new(qkv_d, proj_d, heads, c / heads);
            let attn_p = CausalSelfAttention::new(qkv_p, proj_p, heads / n, c / heads);
            let (mlp_d, mlp_p) = (Mlp::new(fc_d, fc2_d), Mlp::new(fc_p, fc2_p));

            let x = det(&[2, 5, c], 50);
            let up = det(&[2, 5, c], 51);
            let (xr, xt) = (
                Var::from_tensor(&x).expect("v"),
                Var::from_tensor(&x).expect("v"),
            );
            let y_ref = mlp_d
                .apply(&attn_d.forward(xr.as_tensor()).expect("attn"))
                .expect("mlp");
            let y = mlp_p
                .apply(&attn_p.forward(xt.as_tensor()).expect("attn"))
                .expect("mlp");
            assert_close("attn+mlp out", &y, &y_ref, LAYER_TOL);
            let (s_ref, s) = (backward_of(&y_ref, &up), backward_of(&y, &up));
            assert_close(
                "attn+mlp dx",
                &grad(&s, xt.as_tensor()),
                &grad(&s_ref, xr.as_tensor()),
                LAYER_TOL,
            );
            check_param_grads(&g, &layout, &refs, &s_ref, &tps, &s);
        });
    }
}

/// Vocab-parallel embedding and head (loss) against the dense ones, with and without SP.
#[test]
fn vocab_parallel_embedding_and_loss_match_dense() {
    let (v, t, c) = (32usize, 8usize, 16usize);
    for n in [2usize, 4] {
        for sp in [false, true] {
            on_ranks(n, |g| {
                let r = g.rank();
                let mut layout = ShardLayout::new(r, n);
                let rep = Placement::Replicated { partial_grad: sp };
                let (rwte, twte) = pair(
                    &mut layout,
                    "wte.weight",
                    &det(&[v, c], 60),
                    Placement::Sharded { dim: 0, blocks: 1 },
                );
                let (rwpe, twpe) = pair(&mut layout, "wpe.weight", &det(&[t, c], 61), rep);
                let (rlw, tlw) = pair(&mut layout, "ln_f.weight", &det(&[c], 62), rep);
                let (rlb, tlb) = pair(&mut layout, "ln_f.bias", &det(&[c], 63), rep);
                let ids: Vec<u32> = (0..2 * t as u32).map(|i| (i * 7 + 3) % v as u32).collect();
                let idx = Tensor::from_vec(ids.clone(), (2, t), &Device::Cpu).expect("ids");
                let tgt = Tensor::from_vec(
                    ids.iter()
                        .map(|i| (i * 5 + 1) % v as u32)
                        .collect::<Vec<_>>(),
                    (2, t),
                    &Device::Cpu,
                )
                .expect("tgt");

                // Embedding: compare Σ(out · up) gradients; with SP each rank checks its tokens.
                let emb_d = Embedding::new(rwte.clone(), rwpe.clone());
                let shard = VocabShard::new(g.clone(), sp);
                let emb_p = VocabParallelEmbedding::over(twte.clone(), twpe.clone(), shard);
                let y_ref = emb_d.forward(&idx, None).expect("emb").out; // (2, T, C)
                let y = emb_p.forward(&idx, None).expect("emb").out;
                let up = det(&[2, t, c], 64);
                let (y_ref_mine, up_mine) = match sp {
                    true => (slice(&y_ref, 1, n, r), slice(&up, 1, n, r)),
                    false => (y_ref.clone(), up.clone()),
                };
                assert_close("embedding out", &y, &y_ref_mine, LAYER_TOL);
                let s_ref = backward_of(&y_ref, &up);
                let s = backward_of(&y, &up_mine);
                let mut grads = Grads::new();
                for p in [&twte, &twpe] {
                    grads.insert(p.name(), grad(&s, &p.tensor()));
                }
                layout.sync_partial_grads(&mut grads, &g).expect("sync");
                let full = layout.full_grads(&grads, &g).expect("full");
                for p in [&rwte, &rwpe] {
                    assert_close(
                        &format!("embedding grad {}", p.name()),
                        full.get(p.name()).expect("g"),
                        &grad(&s_ref, &p.tensor()),
                        LAYER_TOL,
                    );
                }

                // Head: loss, input gradient, ln_f and wte gradients.
                let head_d = Head::new(LayerNorm::new(rlw.clone(), rlb.clone()), rwte.clone());
                let head_p = VocabParallelHead::over(
                    LayerNorm::new(tlw.clone(), tlb.clone()),
                    twte.clone(),
                    VocabShard::new(g.clone(), sp),
                );
                let x = det(&[2, t, c], 65);
                let x_mine = if sp { slice(&x, 1, n, r) } else { x.clone() };
                let (xr, xt) = (
                    Var::from_tensor(&x).expect("v"),
                    Var::from_tensor(&x_mine).expect("v"),
                );
                let loss_ref = head_d
                    .forward(xr.as_tensor(), Some(&tgt))
                    .expect("head")
                    .out;
                let loss = head_p
                    .forward(xt.as_tensor(), Some(&tgt))
                    .expect("head")
                    .out;
                assert_close("loss", &loss, &loss_ref, LAYER_TOL);
                let (s_ref, s) = (loss_ref.backward().expect("b"), loss.backward().expect("b"));
                let dx_ref = grad(&s_ref, xr.as_tensor());
                let dx_ref = if sp { slice(&dx_ref, 1, n, r) } else { dx_ref };
                assert_close("head dx", &grad(&s, xt.as_tensor()), &dx_ref, LAYER_TOL);
                let mut grads = Grads::new();
                for p in [&twte, &tlw, &tlb] {
                    grads.insert(p.name(), grad(&s, &p.tensor()));
                }
                layout.sync_partial_grads(&mut grads, &g).expect("sync");
                let full = layout.full_grads(&grads, &g).expect("full");
                for p in [&rwte, &rlw, &rlb] {
                    assert_close(
                        &format!("head grad {}", p.name()),
                        full.get(p.name()).expect("g"),
                        &grad(&s_ref, &p.tensor()),
                        LAYER_TOL,
                    );
                }
                // Without targets the head gives the full logits.
                let logits_ref = head_d.forward(&x, None).expect("logits").out;
                let logits = head_p.forward(&x_mine, None).expect("logits").out;
                assert_close("logits", &logits, &logits_ref, LAYER_TOL);
            });
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The whole GPT: tensor-parallel vs one device over 10 SGD steps.
// ---------------------------------------------------------------------------------------------

const STEPS: usize = 10;
const LR: f64 = 1.0;
const LOSS_TOL: f64 = 1e-5;
const GRAD_TOL: f64 = 1e-4;

fn cfg() -> GptConfig {
    tiny_gpt(2, 4, 32)
}

/// Batch `step` (two batches, alternating, so 10 steps visibly train): (idx, targets), both
/// (2, 16) u32, targets = next token.
fn batch(step: usize) -> (Tensor, Tensor) {
    let v = cfg().vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(1000 + (step % 2) as u64);
    let seq: Vec<u32> = (0..2 * 17).map(|_| rng.gen_range(0..v)).collect();
    let rows = |off: usize| -> Vec<u32> {
        (0..2)
            .flat_map(|b| seq[b * 17 + off..b * 17 + off + 16].to_vec())
            .collect()
    };
    let t = |v: Vec<u32>| Tensor::from_vec(v, (2, 16), &Device::Cpu).expect("batch");
    (t(rows(0)), t(rows(1)))
}

/// p ← p − lr · g for every parameter (shard or full) with a gradient.
fn sgd(params: &[Param], grads: &Grads) {
    for p in params {
        let g = grads.get(p.name()).expect("every parameter has a gradient");
        p.set(&(p.tensor() - (g * LR).expect("scale")).expect("step"))
            .expect("set");
    }
}

/// Single-device losses and gradients of every step (computed once for all tp layouts).
fn reference() -> &'static Vec<(f64, Grads)> {
    static REF: OnceLock<Vec<(f64, Grads)>> = OnceLock::new();
    REF.get_or_init(|| {
        let gpt =
            Gpt::new(cfg(), &init_weights(&cfg(), 7).expect("init"), &Device::Cpu).expect("gpt");
        let params = gpt.params();
        (0..STEPS)
            .map(|step| {
                let (idx, tgt) = batch(step);
                let mut grads = Grads::new();
                let (loss, _) = Engine::default()
                    .forward_backward(&gpt.segments, &idx, &tgt, 1.0, &mut grads, &mut NoHooks)
                    .expect("fwd/bwd");
                sgd(&params, &grads);
                (loss, grads)
            })
            .collect()
    })
}

fn gpt_matches_single_device(tp: usize, sequence_parallel: bool) {
    gpt_matches_single_device_by(tp, sequence_parallel, Backward::default());
}

fn gpt_matches_single_device_by(tp: usize, sequence_parallel: bool, backward: Backward) {
    gpt_matches_single_device_with(tp, sequence_parallel, backward, TpOverlap::None);
}

/// The tp model differentiated by `backward`, its collectives overlapped by `overlap`, against
/// the single-device run (autograd).
fn gpt_matches_single_device_with(
    tp: usize,
    sequence_parallel: bool,
    backward: Backward,
    overlap: TpOverlap,
) {
    let reference = reference();
    let weights: BTreeMap<String, Tensor> = init_weights(&cfg(), 7).expect("init");
    on_ranks(tp, |g| {
        let model = tensor_parallel::build(
            &cfg(),
            &weights,
            &tp_plan_sp(g.size(), sequence_parallel, overlap),
            &g,
            sequence_parallel,
            &Device::Cpu,
        )
        .expect("build");
        let params = model.params();
        let (mut worst_loss, mut worst_grad) = (0f64, 0f64);
        for (step, (loss_ref, grads_ref)) in reference.iter().enumerate() {
            let (idx, tgt) = batch(step);
            let mut grads = Grads::new();
            let (loss, _) = Engine::default()
                .with_backward(backward)
                .forward_backward(&model.segments, &idx, &tgt, 1.0, &mut grads, &mut NoHooks)
                .expect("fwd/bwd");
            model
                .layout
                .sync_partial_grads(&mut grads, &g)
                .expect("sync");
            let l = (loss - loss_ref).abs() / loss_ref.abs();
            worst_loss = worst_loss.max(l);
            assert!(l <= LOSS_TOL, "tp {tp} sp {sequence_parallel} step {step}: loss {loss} vs {loss_ref} (rel {l:.2e})");
            let full = model.layout.full_grads(&grads, &g).expect("full grads");
            assert_eq!(full.names(), grads_ref.names(), "gradient names");
            for (name, gr) in grads_ref.iter() {
                let r = rel(full.get(name).expect("grad"), gr);
                worst_grad = worst_grad.max(r);
                assert!(
                    r <= GRAD_TOL,
                    "tp {tp} sp {sequence_parallel} step {step}: grad {name} rel {r:.2e}"
                );
            }
            let norm = model.layout.global_sq_norm(&grads, &g).expect("norm");
            let norm_ref = grads_ref.sq_norm().expect("norm");
            let rn = (norm - norm_ref).abs() / norm_ref;
            assert!(
                rn <= GRAD_TOL,
                "step {step}: squared grad norm {norm} vs {norm_ref}"
            );
            sgd(&params, &grads);
        }
        if g.rank() == 0 {
            let (first, last) = (reference[0].0, reference[STEPS - 1].0);
            eprintln!("tp {tp} sp {sequence_parallel} {backward:?} overlap {}: loss {first:.4} -> {last:.4} over {STEPS} steps, worst loss rel {worst_loss:.1e}, worst grad rel {worst_grad:.1e}", overlap.name());
        }
    });
}

#[test]
fn gpt_tp2_matches_single_device() {
    gpt_matches_single_device(2, false);
}

#[test]
fn gpt_tp4_matches_single_device() {
    gpt_matches_single_device(4, false);
}

#[test]
fn gpt_tp2_sequence_parallel_matches_single_device() {
    gpt_matches_single_device(2, true);
}

#[test]
fn gpt_tp4_sequence_parallel_matches_single_device() {
    gpt_matches_single_device(4, true);
}

#[test]
fn gpt_tp2_chunked_matches_single_device() {
    gpt_matches_single_device_with(2, false, Backward::Tapes, TpOverlap::Chunked);
}

#[test]
fn gpt_tp4_chunked_matches_single_device() {
    gpt_matches_single_device_with(4, false, Backward::Tapes, TpOverlap::Chunked);
}

#[test]
fn gpt_tp2_sequence_parallel_chunked_matches_single_device() {
    gpt_matches_single_device_with(2, true, Backward::Tapes, TpOverlap::Chunked);
}

#[test]
fn gpt_tp4_sequence_parallel_chunked_matches_single_device() {
    gpt_matches_single_device_with(4, true, Backward::Tapes, TpOverlap::Chunked);
}

#[test]
fn gpt_tp2_sequence_parallel_ring_matches_single_device() {
    gpt_matches_single_device_with(2, true, Backward::Tapes, TpOverlap::Ring);
}

#[test]
fn gpt_tp4_sequence_parallel_ring_matches_single_device() {
    gpt_matches_single_device_with(4, true, Backward::Tapes, TpOverlap::Ring);
}

/// The ring's autograd form (the column layer's all-gather as a differentiable op) against one
/// device too: it is the oracle the tapes' ring is held to.
#[test]
fn gpt_tp2_sequence_parallel_ring_autograd_matches_single_device() {
    gpt_matches_single_device_with(2, true, Backward::Autograd, TpOverlap::Ring);
}

/// `--tp-overlap ring` without sequence parallelism is refused, by the plan and by the
/// builder, with what to do instead.
#[test]
fn ring_without_sequence_parallelism_is_refused() {
    let plan = ParallelPlan {
        tp_overlap: TpOverlap::Ring,
        ..ParallelPlan::new(MeshDims::new(1, 1, 2, 1))
    };
    let e = plan.validate(&cfg(), 2, 2).expect_err("ring without SP").to_string();
    assert!(e.contains("--tp-overlap ring") && e.contains("--sequence-parallel"), "{e}");
    let weights: BTreeMap<String, Tensor> = init_weights(&cfg(), 7).expect("init");
    let valid = tp_plan_sp(2, true, TpOverlap::Ring);
    on_ranks(2, |g| {
        let e = tensor_parallel::build(&cfg(), &weights, &valid, &g, false, &Device::Cpu)
            .err()
            .expect("ring built without SP")
            .to_string();
        assert!(e.contains("sequence parallelism"), "{e}");
    });
}

/// `--tp-overlap ring` replaces each block's sequence all-gathers and reduce-scatters with
/// tp − 1 steps of `PIECES` sends and receives each, carrying the same bytes; the embedding's reduce-scatter and
/// the head's all-gather stay collectives.
#[test]
fn trace_ring_passes_the_sequence_collectives_as_sends() {
    let weights: BTreeMap<String, Tensor> = init_weights(&cfg(), 7).expect("init");
    let ops = |overlap: TpOverlap| {
        on_ranks(2, |g| {
            let model = tensor_parallel::build(&cfg(), &weights, &tp_plan_sp(2, true, overlap), &g, true, &Device::Cpu)
                .expect("build");
            let (idx, tgt) = batch(0);
            g.tracer().set_recording(true);
            let before = g.tracer().events().len();
            Engine::default()
                .forward_backward(&model.segments, &idx, &tgt, 1.0, &mut Grads::new(), &mut NoHooks)
                .expect("fwd/bwd");
            let ev = g.tracer().events();
            ev[before..].iter().map(|e| (e.op, e.bytes)).collect::<Vec<_>>()
        })
        .remove(0)
    };
    let (plain, ring) = (ops(TpOverlap::None), ops(TpOverlap::Ring));
    let count = |v: &[(OpKind, u64)], k: OpKind| v.iter().filter(|e| e.0 == k).count();
    let bytes = |v: &[(OpKind, u64)], k: &[OpKind]| -> u64 {
        v.iter().filter(|e| k.contains(&e.0)).map(|e| e.1).sum()
    };
    let blocks = cfg().n_layer;
    // Per block: 2 all-gathers and 2 reduce-scatters forward, their conjugates backward.
    assert_eq!(count(&plain, OpKind::AllGather), 4 * blocks + 2, "{plain:?}");
    assert_eq!(count(&ring, OpKind::AllGather), 2, "the head's input and the embedding's gradient: {ring:?}");
    assert_eq!(count(&ring, OpKind::ReduceScatter), 2, "the embedding's sum and the head's gradient");
    let k = tensor_parallel::ring::PIECES;
    assert_eq!(count(&ring, OpKind::Send), 8 * blocks * k, "tp − 1 = 1 step of k pieces per decomposed collective");
    assert_eq!(count(&ring, OpKind::Recv), 8 * blocks * k);
    // What one rank puts on the wire at tp = 2: an all-gather's traced bytes (its input, our
    // part), half a reduce-scatter's (its input is the whole; the other part leaves).
    let wire = |v: &[(OpKind, u64)]| -> u64 {
        v.iter()
            .map(|e| match e.0 {
                OpKind::AllGather => e.1,
                OpKind::ReduceScatter => e.1 / 2,
                _ => 0,
            })
            .sum()
    };
    assert_eq!(
        bytes(&ring, &[OpKind::Send]),
        wire(&plain) - wire(&ring),
        "the decomposed collectives' bytes, sent part by part"
    );
}

/// `--tp-overlap chunked` issues each block's all-reduces once per chunk (the batch's two
/// sequences: two chunks), each carrying half the bytes; the embedding's and the head's stay
/// whole.
#[test]
fn trace_chunked_issues_each_collective_once_per_chunk() {
    let weights: BTreeMap<String, Tensor> = init_weights(&cfg(), 7).expect("init");
    let counts = |overlap: TpOverlap| {
        on_ranks(2, |g| {
            let model = tensor_parallel::build(&cfg(), &weights, &tp_plan_with(2, overlap), &g, false, &Device::Cpu)
                .expect("build");
            let (idx, tgt) = batch(0);
            g.tracer().set_recording(true);
            let before = g.tracer().events().len();
            Engine::default()
                .forward_backward(&model.segments, &idx, &tgt, 1.0, &mut Grads::new(), &mut NoHooks)
                .expect("fwd/bwd");
            let ev = g.tracer().events();
            let ar: Vec<u64> = ev[before..]
                .iter()
                .filter(|e| e.op == OpKind::AllReduce && e.bytes >= (2 * 16 * 32 * 4) / 2)
                .map(|e| e.bytes)
                .collect();
            ar
        })
        .remove(0)
    };
    let (none, chunked) = (counts(TpOverlap::None), counts(TpOverlap::Chunked));
    let total = |v: &[u64]| v.iter().sum::<u64>();
    let whole = none[0]; // (B, T, C) f32: every block all-reduce, the embedding's and the head's
    let unchunked = chunked.iter().filter(|b| **b == whole).count();
    assert_eq!(unchunked, 2, "the embedding's and the head's stay whole: {chunked:?}");
    let halves = chunked.iter().filter(|b| **b == whole / 2).count();
    assert_eq!(halves, 2 * (none.len() - 2), "{none:?} vs {chunked:?}");
    assert_eq!(total(&chunked), total(&none), "the same bytes in all");
}

/// [`tp_plan_with`] with sequence parallelism on or off.
fn tp_plan_sp(tp: usize, sequence_parallel: bool, overlap: TpOverlap) -> ValidPlan {
    ParallelPlan {
        sequence_parallel,
        tp_overlap: overlap,
        ..ParallelPlan::new(MeshDims::new(1, 1, tp, 1))
    }
    .validate(&cfg(), tp, 2)
    .expect("a tp plan")
}

/// A checked plan of `tp` ranks for [`cfg`]: what [`tensor_parallel::build`] takes.
fn tp_plan(tp: usize) -> ValidPlan {
    tp_plan_of(&cfg(), tp).expect("a tp plan")
}

fn tp_plan_with(tp: usize, overlap: TpOverlap) -> ValidPlan {
    ParallelPlan {
        tp_overlap: overlap,
        ..ParallelPlan::new(MeshDims::new(1, 1, tp, 1))
    }
    .validate(&cfg(), tp, 2)
    .expect("a tp plan")
}

fn tp_plan_of(c: &GptConfig, tp: usize) -> Result<ValidPlan, String> {
    ParallelPlan::new(MeshDims::new(1, 1, tp, 1))
        .validate(c, tp, 2)
        .map_err(|e| e.to_string())
}

#[test]
fn indivisible_layouts_are_rejected_with_the_numbers() {
    let mut c = cfg();
    c.n_head = 6;
    c.n_embd = 48;
    let err = tp_plan_of(&c, 4).expect_err("6 heads over tp 4");
    assert!(err.contains("n_head 6") && err.contains("tp 4"), "{err}");
    let mut c = cfg();
    c.vocab_size = 66;
    let err = tp_plan_of(&c, 4).expect_err("vocab 66 over tp 4");
    assert!(
        err.contains("vocab_size 66") && err.contains("tp 4"),
        "{err}"
    );
    let err = tp_plan_of(&cfg(), 3).expect_err("4 heads over tp 3");
    assert!(err.contains("n_head 4") && err.contains("tp 3"), "{err}");
    assert!(tp_plan_of(&cfg(), 4).is_ok());
}

// ---------------------------------------------------------------------------------------------
// The collectives each block issues.
// ---------------------------------------------------------------------------------------------

/// Notes the tp group's event count at each segment boundary.
struct Marks {
    group: Comm,
    fwd: Vec<usize>,
    bwd: Vec<(usize, usize, usize)>, // (segment, events before, events after)
}

impl Hooks for Marks {
    fn pre_forward(&mut self, _i: usize, _s: &dyn Segment) -> R<()> {
        self.fwd.push(self.group.tracer().events().len());
        Ok(())
    }
    fn pre_backward(&mut self, i: usize, _s: &dyn Segment) -> R<()> {
        self.bwd.push((i, self.group.tracer().events().len(), 0));
        Ok(())
    }
    fn post_backward(&mut self, _i: usize, _s: &dyn Segment, _g: &mut Grads) -> R<()> {
        if let Some(last) = self.bwd.last_mut() {
            last.2 = self.group.tracer().events().len();
        }
        Ok(())
    }
}

/// The (forward, backward) collectives of each segment (embedding, blocks, head) on rank 0, as
/// (kind, bytes sent), the model differentiated by `backward`; asserts every rank issued the
/// same.
fn segment_trace_by(sequence_parallel: bool, backward: Backward) -> Vec<(Vec<Event>, Vec<Event>)> {
    let weights = init_weights(&cfg(), 7).expect("init");
    let out = on_ranks(2, |g| {
        let model = tensor_parallel::build(
            &cfg(),
            &weights,
            &tp_plan(g.size()),
            &g,
            sequence_parallel,
            &Device::Cpu,
        )
        .expect("build");
        let (idx, tgt) = batch(0);
        g.tracer().set_recording(true);
        let mut marks = Marks {
            group: g.clone(),
            fwd: vec![],
            bwd: vec![],
        };
        let engine = Engine::default().with_backward(backward);
        let acts = engine
            .forward(&model.segments, &idx, Some(&tgt), &mut marks)
            .expect("forward");
        marks.fwd.push(g.tracer().events().len());
        let mut grads = Grads::new();
        engine
            .backward(&model.segments, acts, None, 1.0, &mut grads, &mut marks)
            .expect("backward");
        let ops: Vec<Event> = g
            .tracer()
            .events()
            .iter()
            .map(|e| (e.op, e.bytes_sent))
            .collect();
        (0..model.segments.len())
            .map(|i| {
                let fwd = ops[marks.fwd[i]..marks.fwd[i + 1]].to_vec();
                let &(_, a, b) = marks
                    .bwd
                    .iter()
                    .find(|m| m.0 == i)
                    .expect("segment backward");
                (fwd, ops[a..b].to_vec())
            })
            .collect::<Vec<_>>()
    });
    assert!(
        out.windows(2).all(|w| w[0] == w[1]),
        "ranks issued different collectives"
    );
    out.into_iter().next().expect("rank 0")
}

/// A collective as the trace tests compare it: its kind and the bytes this rank sent.
type Event = (OpKind, u64);

/// The kinds of each block's collectives in [`segment_trace_by`] under the default engine
/// (autograd on CPU).
fn block_trace(sequence_parallel: bool) -> Vec<(Vec<OpKind>, Vec<OpKind>)> {
    let kinds = |v: Vec<Event>| v.into_iter().map(|e| e.0).collect::<Vec<_>>();
    segment_trace_by(sequence_parallel, Backward::default())
        .into_iter()
        .skip(1)
        .take(cfg().n_layer)
        .map(|(f, b)| (kinds(f), kinds(b)))
        .collect()
}

/// The tapes issue the collectives autograd issues: the same kinds, sizes and order, forward
/// and backward, for every segment, with and without sequence parallelism.
#[test]
fn trace_tapes_issue_the_collectives_of_autograd() {
    for sp in [false, true] {
        let (tapes, autograd) = (
            segment_trace_by(sp, Backward::Tapes),
            segment_trace_by(sp, Backward::Autograd),
        );
        // The embedding's backward (g's conjugate, the identity) communicates only under SP.
        let quiet = |i: usize, b: &Vec<Event>| b.is_empty() && !(i == 0 && !sp);
        assert!(
            autograd
                .iter()
                .enumerate()
                .all(|(i, (f, b))| !f.is_empty() && !quiet(i, b)),
            "sp {sp}: every segment communicates: {autograd:?}"
        );
        assert_eq!(
            tapes, autograd,
            "sp {sp}: (kind, bytes) per segment, forward and backward"
        );
    }
}

/// Every segment issues exactly the collectives its mapping table describes (the table the cost
/// model counts), in order: forward the sites' forward collectives (then the head's loss
/// all-reduces), backward the sites' backward collectives last first; under autograd and the
/// tapes, with and without sequence parallelism.
#[test]
fn trace_segments_issue_the_collectives_of_their_mapping_tables() {
    use tensor_parallel::vocab::LOSS_ALL_REDUCES;
    use tensor_parallel::{BlockMappings, EmbeddingMappings, HeadMappings};
    for sp in [false, true] {
        let n = cfg().n_layer + 2;
        let described: Vec<(Vec<OpKind>, Vec<OpKind>)> = (0..n)
            .map(|i| {
                let sites = match i {
                    0 => EmbeddingMappings::new(sp).sites(),
                    i if i == n - 1 => HeadMappings::new(sp).sites(),
                    _ => BlockMappings::new(sp).sites(),
                };
                let mut fwd: Vec<OpKind> = sites
                    .iter()
                    .filter_map(|s| s.mapping.forward().map(|c| c.op()))
                    .collect();
                if i == n - 1 {
                    fwd.extend(LOSS_ALL_REDUCES.iter().map(|_| OpKind::AllReduce));
                }
                let bwd = sites
                    .iter()
                    .rev()
                    .filter_map(|s| s.mapping.backward().map(|c| c.op()))
                    .collect();
                (fwd, bwd)
            })
            .collect();
        for backward in [Backward::Autograd, Backward::Tapes] {
            let traced: Vec<(Vec<OpKind>, Vec<OpKind>)> = segment_trace_by(sp, backward)
                .into_iter()
                .map(|(f, b)| {
                    (
                        f.iter().map(|e| e.0).collect(),
                        b.iter().map(|e| e.0).collect(),
                    )
                })
                .collect();
            assert_eq!(
                traced, described,
                "sp {sp} {backward:?}: (forward, backward) kinds per segment, traced vs described"
            );
        }
    }
}

#[test]
fn trace_two_all_reduces_per_block_each_way() {
    for (fwd, bwd) in block_trace(false) {
        assert_eq!(fwd, vec![OpKind::AllReduce; 2], "forward of a block");
        assert_eq!(bwd, vec![OpKind::AllReduce; 2], "backward of a block");
    }
}

#[test]
fn trace_sequence_parallel_gathers_and_reduce_scatters_per_block() {
    use OpKind::{AllGather as AG, ReduceScatter as RS};
    for (fwd, bwd) in block_trace(true) {
        assert_eq!(
            fwd,
            vec![AG, RS, AG, RS],
            "forward of a block: gather before each sub-layer, reduce-scatter after"
        );
        assert_eq!(
            bwd,
            vec![AG, RS, AG, RS],
            "backward of a block: the conjugates, MLP first"
        );
    }
}

#[test]
fn shard_and_unshard_are_inverse_and_name_bad_splits() {
    let full = det(&[12, 8], 5);
    for (placement, dim, blocks) in [
        (Placement::Sharded { dim: 0, blocks: 3 }, 0, 3),
        (Placement::Sharded { dim: 1, blocks: 1 }, 1, 1),
    ] {
        let pieces: Vec<Tensor> = (0..2)
            .map(|r| tensor_parallel::shard::shard(&full, placement, r, 2).expect("shard"))
            .collect();
        let back = tensor_parallel::shard::unshard(
            &Tensor::cat(&pieces, dim).expect("cat"),
            dim,
            blocks,
            2,
        )
        .expect("unshard");
        assert_close("unshard(shard(w))", &back, &full, 0.0);
    }
    // q | k | v blocks: rank 1 of 2 holds rows 2..4, 6..8, 10..12.
    let p1 = tensor_parallel::shard::shard(&full, Placement::Sharded { dim: 0, blocks: 3 }, 1, 2)
        .expect("shard");
    let want = Tensor::cat(
        &[
            full.narrow(0, 2, 2).unwrap(),
            full.narrow(0, 6, 2).unwrap(),
            full.narrow(0, 10, 2).unwrap(),
        ],
        0,
    )
    .unwrap();
    assert_close("qkv shard", &p1, &want, 0.0);
    let err = ShardLayout::new(0, 3)
        .take(
            "h.0.mlp.c_proj.weight",
            &full,
            Placement::Sharded { dim: 1, blocks: 1 },
        )
        .expect_err("8 over 3");
    let msg = err.to_string();
    assert!(
        msg.contains("h.0.mlp.c_proj.weight") && msg.contains("size 8") && msg.contains("tp 3"),
        "{msg}"
    );
}

// ---------------------------------------------------------------------------------------------
// The hand-written backward of every tensor-parallel segment against autograd.
// ---------------------------------------------------------------------------------------------

/// rel ≤ 1e-5 in f32 for every gradient a tape returns.
const TAPE_TOL: f64 = 1e-5;

/// Each segment of the tp model on every rank: its tape (which it must have) against autograd
/// through the same segment, for an upstream gradient that differs per rank under sequence
/// parallelism (each rank's rows) and is the same on every rank otherwise: the output, every
/// parameter gradient by name and the input gradient. `taped` are the segment indices that
/// must have a tape. On a CUDA `dev` the ranks share the GPU and their tp group runs through the
/// CPU backend ([`mtrain_comm::staged`]).
fn segment_tapes_match_autograd(tp: usize, sequence_parallel: bool, taped: &[usize]) {
    segment_tapes_match_autograd_on(&Device::Cpu, tp, sequence_parallel, taped)
}

fn segment_tapes_match_autograd_on(
    dev: &Device,
    tp: usize,
    sequence_parallel: bool,
    taped: &[usize],
) {
    let weights = init_weights(&cfg(), 7).expect("init");
    let on = |t: Tensor| t.to_device(dev).expect("to device");
    on_ranks(tp, |g| {
        let g = if dev.is_cuda() {
            mtrain_comm::staged(g, dev)
        } else {
            g
        };
        let model = tensor_parallel::build(
            &cfg(),
            &weights,
            &tp_plan(g.size()),
            &g,
            sequence_parallel,
            dev,
        )
        .expect("build");
        let (idx, tgt) = batch(0);
        let (idx, tgt) = (on(idx), on(tgt));
        let t_local = if sequence_parallel { 16 / tp } else { 16 };
        let seed = |i: usize| {
            300 + 10 * i as u64
                + if sequence_parallel {
                    g.rank() as u64
                } else {
                    0
                }
        };
        let last = model.segments.len() - 1;
        let mut worst = 0f64;
        for &i in taped {
            let seg = &model.segments[i];
            let what = format!(
                "tp {tp} sp {sequence_parallel} rank {} {}",
                g.rank(),
                seg.name()
            );
            let x = match i {
                0 => idx.clone(),
                _ => on(det(&[2, t_local, cfg().n_embd], seed(i))),
            };
            let targets = (i == last).then_some(&tgt);
            // Autograd through the segment.
            let xv = (i > 0).then(|| Var::from_tensor(&x).expect("var"));
            let input = xv
                .as_ref()
                .map_or_else(|| x.clone(), |v| v.as_tensor().clone());
            let out = seg.forward(&input, targets).expect("forward").out;
            let dout = (out.elem_count() > 1).then(|| on(det(out.dims(), seed(i) + 5)));
            let objective = match &dout {
                Some(w) => (&out * w).expect("mul").sum_all().expect("sum"),
                None => out.clone(),
            };
            let store = objective.backward().expect("backward");
            // The tape.
            let tape = seg
                .forward_taped(&x, targets)
                .expect("taped forward")
                .unwrap_or_else(|| panic!("{what}: no tape"));
            assert_close(&format!("{what} output"), tape.output(), &out, TAPE_TOL);
            let got = tape.backward(dout.as_ref(), 1.0).expect("tape backward");
            let mut names: Vec<String> = got.params.iter().map(|(n, _)| n.clone()).collect();
            names.sort();
            let mut want: Vec<String> = seg.params().iter().map(|p| p.name().to_string()).collect();
            want.sort();
            want.dedup();
            assert_eq!(names, want, "{what}: one gradient per parameter");
            for (name, gr) in &got.params {
                let p = seg
                    .params()
                    .into_iter()
                    .find(|p| p.name() == name)
                    .expect("param");
                let want = grad(&store, &p.tensor());
                worst = worst.max(close(&format!("{what} {name}"), gr, &want, TAPE_TOL));
            }
            match (xv, got.input) {
                (None, None) => {}
                (None, Some(_)) => panic!("{what}: an input gradient for token ids"),
                (Some(xv), Some(dx)) => {
                    let want = grad(&store, xv.as_tensor());
                    worst = worst.max(close(&format!("{what} input"), &dx, &want, TAPE_TOL));
                }
                (Some(_), None) => panic!("{what}: no input gradient"),
            }
        }
        if g.rank() == 0 {
            eprintln!("tapes tp {tp} sp {sequence_parallel} segments {taped:?} on {dev:?}: worst gradient rel {worst:.1e}");
        }
    });
}

/// The blocks (Megatron's column and row linears with f and g inside the backward).
#[test]
fn tapes_tp_blocks_match_autograd() {
    for tp in [2, 4] {
        segment_tapes_match_autograd(tp, false, &[1, 2]);
    }
}

/// The sequence-parallel blocks (all-gather before the column linears, reduce-scatter after
/// the row linears; the conjugates in the backward).
#[test]
fn tapes_sequence_parallel_blocks_match_autograd() {
    for tp in [2, 4] {
        segment_tapes_match_autograd(tp, true, &[1, 2]);
    }
}

/// The vocab-parallel embedding (g, or the sequence reduce-scatter, after the lookup) and the
/// vocab-parallel head with its cross-entropy over sharded logits.
#[test]
fn tapes_vocab_parallel_embedding_and_head_match_autograd() {
    let head = cfg().n_layer + 1;
    for tp in [2, 4] {
        for sp in [false, true] {
            segment_tapes_match_autograd(tp, sp, &[0, head]);
        }
    }
}

/// Every tensor-parallel segment's tape on a GPU: the blocks, the sequence-parallel blocks, the
/// vocab-parallel embedding and head, at tp = 2 and 4, the ranks sharing the device, f32, the
/// same bound as on the CPU.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs a CUDA device: build with --features cuda")]
fn tapes_tp_segments_match_autograd_on_cuda() {
    let dev = mtrain_kernels::testing::cuda();
    let head = cfg().n_layer + 1;
    for tp in [2, 4] {
        for sp in [false, true] {
            segment_tapes_match_autograd_on(&dev, tp, sp, &[0, 1, 2, head]);
        }
    }
}

/// The engine runs the tp tapes under `Backward::Tapes`: the whole model, trained 10 steps,
/// equals one device with the tolerances of the autograd runs.
#[test]
fn tapes_gpt_tp2_matches_single_device() {
    gpt_matches_single_device_by(2, false, Backward::Tapes);
}

#[test]
fn tapes_gpt_tp4_sequence_parallel_matches_single_device() {
    gpt_matches_single_device_by(4, true, Backward::Tapes);
}

/// The engine's recompute (activation checkpointing) re-runs each tp tape in the backward: the
/// gradients equal autograd without checkpointing (rel ≤ 1e-5), with and without SP.
#[test]
fn tapes_with_checkpointing_match_autograd() {
    let weights = init_weights(&cfg(), 7).expect("init");
    for sp in [false, true] {
        on_ranks(2, |g| {
            let model =
                tensor_parallel::build(&cfg(), &weights, &tp_plan(g.size()), &g, sp, &Device::Cpu)
                    .expect("build");
            let (idx, tgt) = batch(0);
            let run = |engine: Engine| {
                let mut grads = Grads::new();
                let (loss, _) = engine
                    .forward_backward(&model.segments, &idx, &tgt, 1.0, &mut grads, &mut NoHooks)
                    .expect("fwd/bwd");
                (loss, grads)
            };
            let (loss, grads) = run(Engine::new(true).with_backward(Backward::Tapes));
            let (loss_ref, grads_ref) = run(Engine::new(false).with_backward(Backward::Autograd));
            assert!(
                (loss - loss_ref).abs() <= TAPE_TOL * loss_ref.abs(),
                "sp {sp}: loss {loss} vs {loss_ref}"
            );
            assert_eq!(grads.names(), grads_ref.names(), "sp {sp}: gradient names");
            for (name, want) in grads_ref.iter() {
                let got = grads.get(name).expect("grad");
                assert_close(
                    &format!("sp {sp} rank {} {name}", g.rank()),
                    got,
                    want,
                    TAPE_TOL,
                );
            }
        });
    }
}

/// A tensor-parallel block at tp = 1 is the dense block: its tape (the same code, collectives
/// over a group of one) gives the dense block tape's output and gradients exactly.
#[test]
fn tapes_tp1_block_is_the_dense_block() {
    let weights = init_weights(&cfg(), 7).expect("init");
    let dense = Gpt::new(cfg(), &weights, &Device::Cpu).expect("gpt");
    on_ranks(1, |g| {
        for sp in [false, true] {
            let model =
                tensor_parallel::build(&cfg(), &weights, &tp_plan(g.size()), &g, sp, &Device::Cpu)
                    .expect("build");
            let x = det(&[2, 16, cfg().n_embd], 77);
            let dout = det(&[2, 16, cfg().n_embd], 78);
            let run = |seg: &dyn Segment| {
                let tape = seg
                    .forward_taped(&x, None)
                    .expect("taped forward")
                    .expect("a tape");
                let out = tape.output().clone();
                let mut got = tape.backward(Some(&dout), 1.0).expect("backward");
                got.params.sort_by(|a, b| a.0.cmp(&b.0));
                (out, got.params, got.input.expect("input gradient"))
            };
            let (out, params, dx) = run(model.segments[1].as_ref());
            let (out_d, params_d, dx_d) = run(dense.segments[1].as_ref());
            assert_close(&format!("sp {sp} output"), &out, &out_d, 0.0);
            assert_close(&format!("sp {sp} input gradient"), &dx, &dx_d, 0.0);
            assert_eq!(params.len(), params_d.len());
            for ((n, a), (nd, b)) in params.iter().zip(&params_d) {
                assert_eq!(n, nd);
                assert_close(&format!("sp {sp} {n}"), a, b, 0.0);
            }
        }
    });
}
