//! The block-wise engine against the whole-graph backward and against finite differences.
//!
//! Tolerances: block-wise vs whole graph in f32 is held to a relative error of 1e-6 of each
//! parameter's largest gradient entry (the two runs do the same arithmetic, only cut into pieces).
//! Finite differences run in f64 with central differences, step 1e-5: truncation error ~1e-10,
//! so the analytic gradient must match within 1e-7 absolute + 1e-5 relative.

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};
use mtrain_model::config::{GptConfig, MoeConfig};
use mtrain_model::engine::{Backward, Engine, Hooks, NoHooks};
use mtrain_model::gpt::{Embedding, Gpt, Head, Segment};
use mtrain_model::init::init_weights;
use mtrain_model::layers::LayerNorm;
use mtrain_model::param::{Grads, Param};

mod common;
use common::batch;

fn small(moe: bool) -> GptConfig {
    let moe = moe.then(|| MoeConfig {
        n_experts: 4,
        top_k: 2,
        capacity_factor: 1.0,
        aux_loss_coef: 0.1,
        z_loss_coef: 0.01,
    });
    GptConfig {
        vocab_size: 32,
        block_size: 8,
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        moe,
    }
}

fn model(cfg: &GptConfig, dtype: DType) -> Result<Gpt> {
    let w: BTreeMap<String, Tensor> = init_weights(cfg, 7)?
        .into_iter()
        .map(|(k, v)| Ok((k, v.to_dtype(dtype)?)))
        .collect::<Result<_>>()?;
    Gpt::new(cfg.clone(), &w, &Device::Cpu)
}

/// Gradients of loss + aux by one candle backward over the whole graph.
fn whole_graph_grads(gpt: &Gpt, idx: &Tensor, tgt: &Tensor) -> Result<BTreeMap<String, Tensor>> {
    let store = gpt.forward_loss(idx, tgt)?.objective()?.backward()?;
    let mut out = BTreeMap::new();
    for p in gpt.params() {
        let g = store
            .get(&p.tensor())
            .cloned()
            .unwrap_or(p.tensor().zeros_like()?);
        out.insert(p.name().to_string(), g);
    }
    Ok(out)
}

fn engine_grads(gpt: &Gpt, engine: Engine, idx: &Tensor, tgt: &Tensor) -> Result<Grads> {
    let mut grads = Grads::new();
    engine.forward_backward(&gpt.segments, idx, tgt, 1.0, &mut grads, &mut NoHooks)?;
    Ok(grads)
}

/// max |a - b| / max |b| (b's scale floored at 1e-12).
fn rel_err(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_dtype(DType::F64)?;
    let b = b.to_dtype(DType::F64)?;
    let diff = (&a - &b)?.abs()?.max_all()?.to_scalar::<f64>()?;
    let scale = b.abs()?.max_all()?.to_scalar::<f64>()?.max(1e-12);
    Ok(diff / scale)
}

fn assert_same(grads: &Grads, want: &BTreeMap<String, Tensor>, tol: f64, what: &str) -> Result<()> {
    assert_eq!(
        grads.names(),
        want.keys().cloned().collect::<Vec<_>>(),
        "{what}: parameter sets differ"
    );
    for (name, w) in want {
        let g = grads.get(name).expect("present");
        let e = rel_err(g, w)?;
        assert!(e <= tol, "{what}: {name} rel err {e:e} > {tol:e}");
        assert!(
            w.abs()?
                .max_all()?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?
                > 0.0,
            "{what}: {name} has a zero gradient"
        );
    }
    Ok(())
}

#[test]
fn blockwise_equals_whole_graph_f32() -> Result<()> {
    let cfg = GptConfig::tiny();
    let gpt = model(&cfg, DType::F32)?;
    let (idx, tgt) = batch(&cfg, 2, 16)?;
    let want = whole_graph_grads(&gpt, &idx, &tgt)?;
    assert_same(
        &engine_grads(&gpt, Engine::new(false), &idx, &tgt)?,
        &want,
        1e-6,
        "block-wise",
    )?;
    assert_same(
        &engine_grads(&gpt, Engine::new(true), &idx, &tgt)?,
        &want,
        1e-6,
        "checkpointed",
    )?;
    Ok(())
}

#[test]
fn checkpointing_gives_identical_gradients() -> Result<()> {
    let cfg = small(false);
    let gpt = model(&cfg, DType::F32)?;
    let (idx, tgt) = batch(&cfg, 2, 8)?;
    let a = engine_grads(&gpt, Engine::new(false), &idx, &tgt)?;
    let b = engine_grads(&gpt, Engine::new(true), &idx, &tgt)?;
    for (name, g) in a.iter() {
        let diff = (g - b.get(name).expect("present"))?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert_eq!(
            diff, 0.0,
            "{name}: recompute must replay the same arithmetic"
        );
    }
    Ok(())
}

#[test]
fn moe_blockwise_equals_whole_graph() -> Result<()> {
    let cfg = small(true);
    let gpt = model(&cfg, DType::F32)?;
    let (idx, tgt) = batch(&cfg, 2, 8)?;
    let want = whole_graph_grads(&gpt, &idx, &tgt)?;
    let mut grads = Grads::new();
    let engine = Engine::new(false);
    let acts = engine.forward(&gpt.segments, &idx, Some(&tgt), &mut NoHooks)?;
    let whole = gpt.forward_loss(&idx, &tgt)?;
    let aux = whole
        .aux_loss
        .as_ref()
        .expect("moe has aux")
        .to_scalar::<f32>()? as f64;
    assert!(
        (acts.aux_loss - aux).abs() < 1e-6 * aux.abs().max(1.0),
        "aux {} vs {aux}",
        acts.aux_loss
    );
    assert_eq!(acts.stats, whole.stats);
    assert!(
        acts.stats.iter().any(|s| s.dropped > 0),
        "capacity factor 1 top-2 should drop: {:?}",
        acts.stats
    );
    engine.backward(&gpt.segments, acts, None, 1.0, &mut grads, &mut NoHooks)?;
    assert_same(&grads, &want, 1e-6, "moe block-wise")?;
    assert_same(
        &engine_grads(&gpt, Engine::new(true), &idx, &tgt)?,
        &want,
        1e-6,
        "moe checkpointed",
    )?;
    Ok(())
}

/// Central finite differences in f64 on a sample of coordinates of every parameter.
fn finite_difference_check(cfg: &GptConfig) -> Result<()> {
    let gpt = model(cfg, DType::F64)?;
    let (idx, tgt) = batch(cfg, 2, 6)?;
    let grads = engine_grads(&gpt, Engine::default(), &idx, &tgt)?;
    let objective = || -> Result<f64> {
        gpt.forward_loss(&idx, &tgt)?
            .objective()?
            .to_scalar::<f64>()
    };
    let eps = 1e-5;
    let mut checked = 0;
    for p in gpt.params() {
        let orig = p.tensor().flatten_all()?.to_vec1::<f64>()?;
        let g = grads
            .get(p.name())
            .expect("gradient")
            .flatten_all()?
            .to_vec1::<f64>()?;
        let n = orig.len();
        for k in [0, n / 3, (2 * n) / 3 + 1, n - 1] {
            let k = k.min(n - 1);
            let at = |delta: f64| -> Result<f64> {
                let mut v = orig.clone();
                v[k] += delta;
                p.set(&Tensor::from_vec(v, p.shape(), &Device::Cpu)?)?;
                objective()
            };
            let fd = (at(eps)? - at(-eps)?) / (2.0 * eps);
            p.set(&Tensor::from_vec(orig.clone(), p.shape(), &Device::Cpu)?)?;
            let tol = 1e-7 + 1e-5 * g[k].abs().max(fd.abs());
            assert!(
                (fd - g[k]).abs() <= tol,
                "{}[{k}]: finite difference {fd:e} vs analytic {:e}",
                p.name(),
                g[k]
            );
            checked += 1;
        }
    }
    assert!(checked >= 4 * gpt.params().len());
    Ok(())
}

#[test]
fn gradients_match_finite_differences() -> Result<()> {
    finite_difference_check(&small(false))
}

#[test]
fn moe_gradients_match_finite_differences() -> Result<()> {
    // The router's gradient comes through the gates and both auxiliary losses.
    finite_difference_check(&small(true))
}

#[test]
fn tied_embedding_gradient_is_the_sum_of_both_uses() -> Result<()> {
    let cfg = small(false);
    let gpt = model(&cfg, DType::F32)?;
    let (idx, tgt) = batch(&cfg, 2, 8)?;
    let tied = engine_grads(&gpt, Engine::default(), &idx, &tgt)?;
    // Untie: the head gets its own copy of wte (same values, separate Var).
    let by_name: BTreeMap<String, Param> = gpt
        .params()
        .into_iter()
        .map(|p| (p.name().to_string(), p))
        .collect();
    let wte_in = Param::new("wte.weight", by_name["wte.weight"].tensor().copy()?)?;
    let wte_out = Param::new("wte.weight", by_name["wte.weight"].tensor().copy()?)?;
    let mut segs: Vec<Arc<dyn Segment>> = vec![Arc::new(Embedding::new(
        wte_in.clone(),
        by_name["wpe.weight"].clone(),
    ))];
    segs.extend(gpt.segments[1..=cfg.n_layer].iter().cloned());
    let ln_f = LayerNorm::new(by_name["ln_f.weight"].clone(), by_name["ln_f.bias"].clone());
    segs.push(Arc::new(Head::new(ln_f, wte_out.clone())));
    let mut x = idx.clone();
    for s in &segs {
        x = s.forward(&x, Some(&tgt))?.out;
    }
    let store = x.backward()?;
    let g_in = store.get(&wte_in.tensor()).expect("embedding use").clone();
    let g_out = store.get(&wte_out.tensor()).expect("head use").clone();
    assert!(
        g_in.abs()?.max_all()?.to_scalar::<f32>()? > 0.0
            && g_out.abs()?.max_all()?.to_scalar::<f32>()? > 0.0
    );
    let e = rel_err(tied.get("wte.weight").expect("wte"), &(&g_in + &g_out)?)?;
    assert!(e <= 1e-6, "tied gradient vs sum of uses: rel err {e:e}");
    // The engine on the untied segments sums the two uses by name as well.
    let mut untied = Grads::new();
    Engine::default().forward_backward(&segs, &idx, &tgt, 1.0, &mut untied, &mut NoHooks)?;
    assert!(rel_err(untied.get("wte.weight").expect("wte"), &(&g_in + &g_out)?)? <= 1e-6);
    Ok(())
}

/// Records the hook calls and checks each segment's gradients are present at post_backward.
struct Recorder {
    events: Vec<String>,
}

impl Hooks for Recorder {
    fn pre_forward(&mut self, i: usize, _seg: &dyn Segment) -> Result<()> {
        self.events.push(format!("F{i}"));
        Ok(())
    }
    fn post_forward(&mut self, i: usize, _seg: &dyn Segment) -> Result<()> {
        self.events.push(format!("f{i}"));
        Ok(())
    }
    fn pre_backward(&mut self, i: usize, _seg: &dyn Segment) -> Result<()> {
        self.events.push(format!("B{i}"));
        Ok(())
    }
    fn post_backward(&mut self, i: usize, seg: &dyn Segment, grads: &mut Grads) -> Result<()> {
        for p in seg.params() {
            assert!(
                grads.get(p.name()).is_some(),
                "{} missing at post_backward of {i}",
                p.name()
            );
        }
        self.events.push(format!("P{i}"));
        Ok(())
    }
}

#[test]
fn hooks_fire_in_order_and_split_ranges_compose() -> Result<()> {
    let cfg = small(false);
    let gpt = model(&cfg, DType::F32)?;
    let (idx, tgt) = batch(&cfg, 2, 8)?;
    let engine = Engine::default();
    let mut rec = Recorder { events: Vec::new() };
    let mut full = Grads::new();
    engine.forward_backward(&gpt.segments, &idx, &tgt, 1.0, &mut full, &mut rec)?;
    assert_eq!(
        rec.events.join(" "),
        "F0 f0 F1 f1 F2 f2 F3 f3 B3 P3 B2 P2 B1 P1 B0 P0"
    );

    // Two pipeline stages: [embedding, h.0] and [h.1, head], joined by the activation and its gradient.
    for checkpointing in [false, true] {
        let engine = Engine::new(checkpointing);
        let (first, last) = gpt.segments.split_at(2);
        let mut grads = Grads::new();
        let a1 = engine.forward(first, &idx, Some(&tgt), &mut NoHooks)?;
        let a2 = engine.forward(last, &a1.output, Some(&tgt), &mut NoHooks)?;
        let g = engine
            .backward(last, a2, None, 1.0, &mut grads, &mut NoHooks)?
            .expect("float input has a gradient");
        assert_eq!(g.dims(), &[2, 8, 16]);
        let none = engine.backward(first, a1, Some(&g), 1.0, &mut grads, &mut NoHooks)?;
        assert!(none.is_none(), "token ids have no gradient");
        let want: BTreeMap<String, Tensor> =
            full.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        assert_same(&grads, &want, 1e-6, "two stages")?;
    }

    // loss_scale multiplies every gradient (pipeline micro-batches use 1/M).
    let mut half = Grads::new();
    engine.forward_backward(&gpt.segments, &idx, &tgt, 0.5, &mut half, &mut NoHooks)?;
    for (name, g) in full.iter() {
        assert!(
            rel_err(&(half.get(name).expect("present") * 2.0)?, g)? <= 1e-6,
            "{name}"
        );
    }
    Ok(())
}

/// The same gradients as `fused`, by name, to the bit.
fn assert_identical(grads: &Grads, fused: &Grads, what: &str) -> Result<()> {
    assert_eq!(grads.iter().count(), fused.iter().count(), "{what}");
    for (name, want) in fused.iter() {
        let got = grads.get(name).expect("present");
        let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0, "{what}: {name}");
    }
    Ok(())
}

/// The split backward (B, then W) adds exactly the fused backward's gradients, bit for bit, on
/// the tapes and on autograd, dense and MoE, with and without recompute; B fires every
/// `pre_backward` and no `post_backward`, W every `post_backward`; B keeps weight products for
/// W on the tapes, and a stage boundary passes B's input gradient.
#[test]
fn split_backward_gives_the_fused_gradients_exactly() -> Result<()> {
    for moe in [false, true] {
        let cfg = small(moe);
        let gpt = model(&cfg, DType::F32)?;
        let (idx, tgt) = batch(&cfg, 2, 8)?;
        for backward in [Backward::Tapes, Backward::Autograd] {
            for checkpointing in [false, true] {
                let engine = Engine::new(checkpointing).with_backward(backward);
                let what = format!("moe {moe}, {backward:?}, checkpointing {checkpointing}");
                let fused = engine_grads(&gpt, engine, &idx, &tgt)?;
                let (first, last) = gpt.segments.split_at(2);
                let mut grads = Grads::new();
                let a1 = engine.forward(first, &idx, Some(&tgt), &mut NoHooks)?;
                let a2 = engine.forward(last, &a1.output, Some(&tgt), &mut NoHooks)?;
                let mut rec = Recorder { events: Vec::new() };
                let (g, pending) = engine.backward_input(last, a2, None, 1.0, &mut rec)?;
                let g = g.expect("float input has a gradient");
                assert_eq!(rec.events.join(" "), "B1 B0", "{what}");
                if backward == Backward::Tapes {
                    assert!(pending.held_bytes() > 0, "{what}: B keeps products for W");
                }
                let (none, first_pending) =
                    engine.backward_input(first, a1, Some(&g), 1.0, &mut NoHooks)?;
                assert!(none.is_none(), "token ids have no gradient");
                engine.backward_weights(last, pending, &mut grads, &mut rec)?;
                engine.backward_weights(first, first_pending, &mut grads, &mut NoHooks)?;
                assert_eq!(rec.events.join(" "), "B1 B0 P1 P0", "{what}");
                assert_identical(&grads, &fused, &what)?;
            }
        }
    }
    Ok(())
}

/// Empties each segment's weight slots between its B and its W, as ZeRO-3 frees gathered
/// weights (but those a segment before it still reads: the embedding's recompute reads the tied
/// `wte`), and puts them back after the backward.
struct FreesBetween {
    events: Vec<String>,
    freed: Vec<(Param, Tensor)>,
    read_later: Vec<String>,
}

impl Hooks for FreesBetween {
    fn pre_backward(&mut self, i: usize, _seg: &dyn Segment) -> Result<()> {
        self.events.push(format!("B{i}"));
        Ok(())
    }
    fn post_backward(&mut self, i: usize, _seg: &dyn Segment, _grads: &mut Grads) -> Result<()> {
        self.events.push(format!("P{i}"));
        Ok(())
    }
    fn splits_backward(&self) -> bool {
        true
    }
    fn weights_read(&mut self, i: usize, seg: &dyn Segment) -> Result<()> {
        self.events.push(format!("R{i}"));
        for p in seg.params() {
            if !self.read_later.iter().any(|n| n == p.name()) {
                let placeholder = Tensor::zeros(0, p.tensor().dtype(), &Device::Cpu)?;
                self.freed.push((p.clone(), p.tensor()));
                p.replace(placeholder)?;
            }
        }
        Ok(())
    }
}

/// A backward whose hooks free every segment's weights between its input gradient (B) and its
/// weight gradients (W) forms the fused backward's gradients bit for bit: W reads no weight
/// (a read of a freed slot is an error naming the parameter).
#[test]
fn weights_freed_between_b_and_w_leave_the_gradients_exact() -> Result<()> {
    for moe in [false, true] {
        let cfg = small(moe);
        let gpt = model(&cfg, DType::F32)?;
        let (idx, tgt) = batch(&cfg, 2, 8)?;
        for checkpointing in [false, true] {
            let engine = Engine::new(checkpointing).with_backward(Backward::Tapes);
            let what = format!("moe {moe}, checkpointing {checkpointing}");
            let fused = engine_grads(&gpt, engine, &idx, &tgt)?;
            let mut hooks = FreesBetween {
                events: Vec::new(),
                freed: Vec::new(),
                read_later: match checkpointing {
                    true => vec!["wte.weight".to_string()],
                    false => vec![],
                },
            };
            let mut grads = Grads::new();
            let acts = engine.forward(&gpt.segments, &idx, Some(&tgt), &mut NoHooks)?;
            engine.backward(&gpt.segments, acts, None, 1.0, &mut grads, &mut hooks)?;
            assert_eq!(
                hooks.events.join(" "),
                "B3 R3 P3 B2 R2 P2 B1 R1 P1 B0 P0",
                "{what}: the embedding's backward reads no weight and is not split"
            );
            let freed: Vec<&str> = hooks.freed.iter().map(|(p, _)| p.name()).collect();
            assert_eq!(
                freed.contains(&"wte.weight"),
                !checkpointing,
                "{what}: the head frees the tied wte unless the embedding recomputes: {freed:?}"
            );
            for (p, t) in hooks.freed.drain(..) {
                p.replace(t)?;
            }
            assert_identical(&grads, &fused, &what)?;
        }
    }
    Ok(())
}

#[test]
fn checkpointing_keeps_only_inputs() -> Result<()> {
    let cfg = small(false);
    let gpt = model(&cfg, DType::F32)?;
    let (idx, tgt) = batch(&cfg, 2, 8)?;
    let kept = Engine::new(false).forward(&gpt.segments, &idx, Some(&tgt), &mut NoHooks)?;
    let ckpt = Engine::new(true).forward(&gpt.segments, &idx, Some(&tgt), &mut NoHooks)?;
    // Inputs: ids (2·8 u32) + 3 activations (2·8·16 f32); outputs add 3 activations and the loss.
    let act = 2 * 8 * 16 * 4;
    assert_eq!(ckpt.held_bytes(), 2 * 8 * 4 + 3 * act);
    assert_eq!(kept.held_bytes(), 2 * 8 * 4 + 3 * act + 3 * act + 4);
    assert_eq!(
        kept.output.to_scalar::<f32>()?,
        ckpt.output.to_scalar::<f32>()?
    );
    Ok(())
}

/// 16-bit weights run through the same code (softmax, LayerNorm and the loss upcast to f32) and
/// give the f32 loss within bf16 precision (8 mantissa bits: about 0.4% relative per rounding).
#[test]
fn bf16_forward_and_backward_run_close_to_f32() -> Result<()> {
    let cfg = small(true);
    let (idx, tgt) = batch(&cfg, 2, 8)?;
    let full = model(&cfg, DType::F32)?
        .forward_loss(&idx, &tgt)?
        .loss
        .to_scalar::<f32>()?;
    let half = model(&cfg, DType::BF16)?;
    let mut grads = Grads::new();
    let (loss, _) = Engine::default().forward_backward(
        &half.segments,
        &idx,
        &tgt,
        1.0,
        &mut grads,
        &mut NoHooks,
    )?;
    assert!(
        (loss - full as f64).abs() < 0.02 * full as f64,
        "bf16 loss {loss} vs f32 {full}"
    );
    assert_eq!(
        grads.get("wte.weight").map(|g| g.dtype()),
        Some(DType::BF16)
    );
    Ok(())
}

/// A residual linear map `x + x·W` (W: (C, C)) that also has a hand-written backward, so the
/// engine's tape path runs on CPU: `dx = g + g·Wᵀ`, `dW = Σ_rows xᵀ·g`.
struct TapedResidualLinear {
    w: Param,
    /// How many times the hand-written backward ran.
    backwards: Arc<std::sync::atomic::AtomicUsize>,
}

struct ResidualLinearTape {
    name: String,
    x: Tensor,
    w: Tensor,
    out: Tensor,
    backwards: Arc<std::sync::atomic::AtomicUsize>,
}

impl mtrain_model::tape::Tape for ResidualLinearTape {
    fn output(&self) -> &Tensor {
        &self.out
    }

    fn backward(
        self: Box<Self>,
        grad_out: Option<&Tensor>,
        _loss_scale: f64,
    ) -> Result<mtrain_model::tape::TapeGrads> {
        self.backwards
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let g = grad_out.expect("a block's output is not the loss");
        let (b, t, c) = g.dims3()?;
        let (g2, x2) = (g.reshape((b * t, c))?, self.x.reshape((b * t, c))?); // (N, C)
        let dx = (&g2 + g2.matmul(&self.w.t()?)?)?.reshape((b, t, c))?;
        let dw = x2.t()?.matmul(&g2)?; // (C, C)
        Ok(mtrain_model::tape::TapeGrads {
            params: vec![(self.name, dw)],
            input: Some(dx),
        })
    }
}

impl Segment for TapedResidualLinear {
    fn name(&self) -> String {
        "taped".into()
    }

    fn forward(&self, x: &Tensor, _t: Option<&Tensor>) -> Result<mtrain_model::gpt::SegmentOut> {
        let out = (x + x.broadcast_matmul(&self.w.tensor())?)?;
        Ok(mtrain_model::gpt::SegmentOut::plain(out))
    }

    fn params(&self) -> Vec<Param> {
        vec![self.w.clone()]
    }

    fn forward_taped(
        &self,
        x: &Tensor,
        _t: Option<&Tensor>,
    ) -> Result<Option<Box<dyn mtrain_model::tape::Tape>>> {
        let (x, w) = (x.detach(), self.w.tensor().detach());
        let out = (&x + x.broadcast_matmul(&w)?)?;
        Ok(Some(Box::new(ResidualLinearTape {
            name: self.w.name().to_string(),
            x,
            w,
            out,
            backwards: self.backwards.clone(),
        })))
    }
}

/// The engine runs a segment's tape instead of autograd wherever it has one: the same loss and
/// gradients (f32, 1e-6) as one autograd backward over the whole graph, with and without
/// checkpointing (which recomputes the tape), the tape's backward called once per backward.
#[test]
fn taped_segments_give_the_whole_graph_gradients() -> Result<()> {
    let cfg = small(false);
    let gpt = model(&cfg, DType::F32)?;
    let c = cfg.n_embd;
    let w: Vec<f32> = (0..c * c)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 500.0)
        .collect();
    let backwards = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let taped: Arc<dyn Segment> = Arc::new(TapedResidualLinear {
        w: Param::new("taped.weight", Tensor::from_vec(w, (c, c), &Device::Cpu)?)?,
        backwards: backwards.clone(),
    });
    // embedding, block 0, the taped map, block 1, head
    let mut segs: Vec<Arc<dyn Segment>> = gpt.segments.clone();
    segs.insert(2, taped.clone());
    let (idx, tgt) = batch(&cfg, 2, 8)?;

    let mut x = idx.clone();
    for s in &segs {
        x = s.forward(&x, Some(&tgt))?.out;
    }
    let want_loss = x.to_scalar::<f32>()? as f64;
    let store = x.backward()?;
    let mut want = BTreeMap::new();
    for s in &segs {
        for p in s.params() {
            want.insert(
                p.name().to_string(),
                store.get(&p.tensor()).unwrap().clone(),
            );
        }
    }
    for checkpointing in [false, true] {
        let before = backwards.load(std::sync::atomic::Ordering::SeqCst);
        let mut grads = Grads::new();
        let engine = Engine::new(checkpointing).with_backward(Backward::Tapes);
        let (loss, _) =
            engine.forward_backward(&segs, &idx, &tgt, 1.0, &mut grads, &mut NoHooks)?;
        assert!(
            (loss - want_loss).abs() <= 1e-6 * want_loss.abs(),
            "{loss} vs {want_loss}"
        );
        assert_same(
            &grads,
            &want,
            1e-6,
            &format!("tapes, checkpointing {checkpointing}"),
        )?;
        assert_eq!(
            backwards.load(std::sync::atomic::Ordering::SeqCst),
            before + 1
        );
    }
    Ok(())
}
