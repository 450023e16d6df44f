//! Dropout on one device: the tapes' backward against autograd through the same masks, the
//! recompute of activation checkpointing against the kept forward (bit for bit), a pass split
//! into row blocks against the whole batch, and dropout off without a draw.
//!
//! Tolerances: tapes vs autograd in f32, loss rel ≤ 1e-5 and each gradient rel ≤ 1e-4 (the
//! tests of the tapes without dropout hold the same); recompute and row blocks exactly.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Result, Tensor};
use mtrain_model::config::{GptConfig, MoeConfig};
use mtrain_model::engine::{Backward, Engine, NoHooks};
use mtrain_model::gpt::Gpt;
use mtrain_model::init::init_weights;
use mtrain_model::param::Grads;
use mtrain_model::StepDraw;

mod common;
use common::batch;

fn cfg(moe: bool) -> GptConfig {
    GptConfig {
        vocab_size: 32,
        block_size: 16,
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        moe: moe.then(|| MoeConfig {
            n_experts: 4,
            top_k: 2,
            capacity_factor: 2.0,
            aux_loss_coef: 0.01,
            z_loss_coef: 0.001,
        }),
    }
}

fn model(cfg: &GptConfig) -> Result<Gpt> {
    Gpt::new(cfg.clone(), &init_weights(cfg, 3)?, &Device::Cpu)
}

fn step(p: f64, s: u64) -> StepDraw {
    StepDraw {
        p,
        seed: 11,
        step: s,
        micro: 0,
    }
}

/// Loss and gradients of rows `row ..` of a global batch of `rows`, under `engine` and `draw`.
fn run(
    gpt: &Gpt,
    engine: Engine,
    draw: Option<StepDraw>,
    (idx, tgt): (&Tensor, &Tensor),
    (row, rows): (usize, usize),
    grads: &mut Grads,
) -> Result<f64> {
    let engine = engine.with_dropout(draw.map(|d| d.rows(row, rows)));
    let (loss, _) = engine.forward_backward(&gpt.segments, idx, tgt, 1.0, grads, &mut NoHooks)?;
    Ok(loss)
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a - b).unwrap().sqr().unwrap().sum_all().unwrap();
    let n = b.sqr().unwrap().sum_all().unwrap();
    let f = |t: Tensor| t.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
    (f(d) / f(n).max(1e-30)).sqrt()
}

fn map(g: &Grads) -> BTreeMap<String, Tensor> {
    g.iter().map(|(n, t)| (n.clone(), t.clone())).collect()
}

/// The hand-written backward of every segment with dropout equals autograd through the same
/// masks (the dense block and the mixture of experts).
#[test]
fn tapes_equal_autograd_under_dropout() -> Result<()> {
    for moe in [false, true] {
        let c = cfg(moe);
        let gpt = model(&c)?;
        let (idx, tgt) = batch(&c, 4, 16)?;
        let (mut a, mut t) = (Grads::new(), Grads::new());
        let d = Some(step(0.2, 3));
        let auto = Engine::new(false).with_backward(Backward::Autograd);
        let tapes = Engine::new(false).with_backward(Backward::Tapes);
        let la = run(&gpt, auto, d, (&idx, &tgt), (0, 4), &mut a)?;
        let lt = run(&gpt, tapes, d, (&idx, &tgt), (0, 4), &mut t)?;
        assert!(
            (la - lt).abs() <= 1e-5 * la.abs(),
            "moe {moe}: loss {lt} vs {la}"
        );
        let (a, t) = (map(&a), map(&t));
        assert_eq!(a.len(), t.len());
        for (name, g) in &a {
            let e = rel(&t[name], g);
            assert!(e <= 1e-4, "moe {moe}: gradient of {name} rel {e:.2e}");
        }
        let mut plain = Grads::new();
        let l0 = run(&gpt, tapes, None, (&idx, &tgt), (0, 4), &mut plain)?;
        assert!(
            (l0 - lt).abs() > 1e-3,
            "moe {moe}: dropout changed nothing ({l0} vs {lt})"
        );
    }
    Ok(())
}

/// Activation checkpointing's recompute draws the masks again: its gradients equal the kept
/// forward's bit for bit, on the tapes and on autograd.
#[test]
fn the_recompute_draws_the_same_masks() -> Result<()> {
    let c = cfg(false);
    let gpt = model(&c)?;
    let (idx, tgt) = batch(&c, 4, 16)?;
    for backward in [Backward::Tapes, Backward::Autograd] {
        let (mut kept, mut recomputed) = (Grads::new(), Grads::new());
        let d = Some(step(0.1, 5));
        let e = |ckpt| Engine::new(ckpt).with_backward(backward);
        let l1 = run(&gpt, e(false), d, (&idx, &tgt), (0, 4), &mut kept)?;
        let l2 = run(&gpt, e(true), d, (&idx, &tgt), (0, 4), &mut recomputed)?;
        assert_eq!(l1, l2, "{backward:?}");
        let (k, r) = (map(&kept), map(&recomputed));
        for (name, g) in &k {
            let diff = (g - &r[name])?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "{backward:?}: gradient of {name}");
        }
    }
    Ok(())
}

/// A batch run as two blocks of rows (two data-parallel ranks, two micro-batches) draws the
/// masks of the whole batch: the mean of the blocks' losses and gradients equals the whole's.
/// And masks move with the step: another step, another loss.
#[test]
fn row_blocks_draw_the_whole_batch_masks() -> Result<()> {
    let c = cfg(false);
    let gpt = model(&c)?;
    let (idx, tgt) = batch(&c, 4, 16)?;
    let tapes = Engine::new(false);
    let d = Some(step(0.1, 2));
    let mut whole = Grads::new();
    let lw = run(&gpt, tapes, d, (&idx, &tgt), (0, 4), &mut whole)?;
    let mut halves = Grads::new();
    let mut lh = 0.0;
    for h in 0..2 {
        let (i, t) = (idx.narrow(0, 2 * h, 2)?, tgt.narrow(0, 2 * h, 2)?);
        let engine = tapes.with_dropout(d.map(|d| d.rows(2 * h, 4)));
        let (l, _) =
            engine.forward_backward(&gpt.segments, &i, &t, 0.5, &mut halves, &mut NoHooks)?;
        lh += l / 2.0;
    }
    assert!((lw - lh).abs() <= 1e-6 * lw, "halves {lh} vs whole {lw}");
    let (w, h) = (map(&whole), map(&halves));
    for (name, g) in &w {
        let e = rel(&h[name], g);
        assert!(e <= 1e-5, "gradient of {name} rel {e:.2e}");
    }
    let mut other = Grads::new();
    let lo = run(
        &gpt,
        tapes,
        Some(step(0.1, 3)),
        (&idx, &tgt),
        (0, 4),
        &mut other,
    )?;
    assert!(
        (lo - lw).abs() > 1e-4,
        "step 3's masks gave step 2's loss {lw}"
    );
    Ok(())
}

/// Without a draw (evaluation, sampling) nothing is dropped: the engine's loss is the plain
/// whole-graph forward's, whatever the draw of the training passes was.
#[test]
fn no_draw_no_dropout() -> Result<()> {
    let c = cfg(false);
    let gpt = model(&c)?;
    let (idx, tgt) = batch(&c, 2, 16)?;
    let plain = gpt.forward_loss(&idx, &tgt)?.loss.to_scalar::<f32>()? as f64;
    let mut g = Grads::new();
    let l = run(&gpt, Engine::new(false), None, (&idx, &tgt), (0, 2), &mut g)?;
    assert!((l - plain).abs() <= 1e-6 * plain, "{l} vs {plain}");
    let mut g = Grads::new();
    let p0 = run(
        &gpt,
        Engine::new(false),
        Some(step(0.0, 1)),
        (&idx, &tgt),
        (0, 2),
        &mut g,
    )?;
    assert_eq!(p0, l, "p = 0 drops nothing");
    Ok(())
}
