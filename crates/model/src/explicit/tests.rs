use std::collections::BTreeMap;

use candle_core::{DType, Device, Result, Tensor};

use mtrain_kernels::testing::{cuda, rel_err};

use candle_core::Var;

use crate::config::{GptConfig, MoeConfig};
use crate::engine::{Backward, Engine, NoHooks};
use crate::gpt::Gpt;
use crate::init::init_weights;
use crate::moe::MoeStats;
use crate::param::Grads;

/// ‖got − want‖ / ‖want‖, or ‖got‖ where want is zero (an expert no token reached).
fn gap(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.dims(), want.dims());
    let norm = |t: &Tensor| {
        t.to_dtype(DType::F64)
            .and_then(|t| t.sqr()?.sum_all()?.to_scalar::<f64>())
            .expect("norm")
            .sqrt()
    };
    match norm(want) {
        0.0 => norm(got),
        _ => rel_err(got, want),
    }
}

/// `init_weights(cfg, seed)` in `dtype`.
fn weights(cfg: &GptConfig, seed: u64, dtype: DType) -> Result<BTreeMap<String, Tensor>> {
    init_weights(cfg, seed)?
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_dtype(dtype)?)))
        .collect()
}

/// The engine's step through the tapes, with and without checkpointing (which recomputes
/// each tape), against candle's autograd over the whole graph (the same operations,
/// recorded): loss, auxiliary loss and every parameter gradient, for 2 blocks (dense, or
/// mixtures of experts with `moe`) with head size 64 (bf16 runs the tensor-core attention),
/// the head and the tied embedding.
fn check(dev: &Device, dtype: DType, moe: Option<MoeConfig>, tol: f64) -> Result<()> {
    let cfg = GptConfig {
        vocab_size: 320,
        block_size: 128,
        n_layer: 2,
        n_head: 2,
        n_embd: 128,
        moe,
    };
    let w = weights(&cfg, 7, dtype)?;
    let gpt = Gpt::new(cfg.clone(), &w, dev)?;
    let (b, t) = (3, 120); // T < block_size: the position gradient is zero-padded
    let ids = |seed: u32| -> Result<Tensor> {
        let v: Vec<u32> = (0..(b * t) as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 7) % 320)
            .collect();
        Tensor::from_vec(v, (b, t), dev)
    };
    let (idx, tgt) = (ids(1)?, ids(99)?);

    let x = Tensor::randn(0f32, 1f32, (b, t, cfg.n_embd), dev)?.to_dtype(dtype)?;
    let last = cfg.n_layer + 1;
    assert!(
        gpt.segments[0].forward_taped(&idx, None)?.is_some(),
        "embedding tape"
    );
    assert!(
        gpt.segments[1].forward_taped(&x, None)?.is_some(),
        "block tape"
    );
    assert!(
        gpt.segments[last].forward_taped(&x, Some(&tgt))?.is_some(),
        "head tape"
    );

    let whole = gpt.forward_loss(&idx, &tgt)?;
    let scalar = |t: &Tensor| t.to_dtype(DType::F64)?.to_scalar::<f64>();
    let want_loss = scalar(&whole.loss)?;
    let want_aux = whole.aux_loss.as_ref().map_or(Ok(0.0), scalar)?;
    let store = whole.objective()?.backward()?;
    for checkpointing in [false, true] {
        let mut grads = Grads::new();
        let engine = Engine::new(checkpointing).with_backward(Backward::Tapes);
        let (loss, aux) =
            engine.forward_backward(&gpt.segments, &idx, &tgt, 1.0, &mut grads, &mut NoHooks)?;
        let what = format!(
            "{:?} {dtype:?} checkpointing {checkpointing}",
            dev.location()
        );
        assert!(
            (loss - want_loss).abs() <= tol * want_loss.abs(),
            "{what}: loss {loss} through the tapes vs {want_loss} by autograd"
        );
        assert!(
            (aux - want_aux).abs() <= tol * want_aux.abs(),
            "{what}: aux loss {aux} through the tapes vs {want_aux} by autograd"
        );
        for p in gpt.params() {
            // An expert no token reached has no autograd gradient: zero.
            let want = match store.get(&p.tensor()) {
                Some(g) => g.clone(),
                None if p.name().contains(".moe.experts.") => p.tensor().zeros_like()?,
                None => panic!("autograd gave no gradient for {}", p.name()),
            };
            let got = grads
                .get(p.name())
                .unwrap_or_else(|| panic!("the tapes gave no gradient for {}", p.name()));
            assert_eq!(got.dims(), want.dims(), "{}", p.name());
            let e = gap(got, &want);
            assert!(
                e < tol,
                "{what} {}: relative error {e:.2e} >= {tol:.0e}",
                p.name()
            );
        }
    }
    Ok(())
}

#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs a CUDA device: build with --features cuda")]
fn tapes_match_autograd_f32() -> Result<()> {
    let dev = cuda();
    check(&dev, DType::F32, None, 1e-4)
}

#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs a CUDA device: build with --features cuda")]
fn tapes_match_autograd_bf16() -> Result<()> {
    let dev = cuda();
    check(&dev, DType::BF16, None, 2e-2)
}

/// On CPU the tapes run on the kernels crate's CPU versions of their ops, so the tapes'
/// backward wiring is checked without a GPU; the default engine runs the tapes everywhere.
#[test]
fn tapes_match_autograd_on_cpu() -> Result<()> {
    check(&Device::Cpu, DType::F32, None, 1e-5)?;
    assert_eq!(Engine::new(false).backward, Backward::Tapes, "the default");
    assert!(Backward::Tapes.uses_tapes());
    assert!(!Backward::Autograd.uses_tapes());
    Ok(())
}

/// 4 experts, top-2, capacity factor 1.0 (tight enough that choices are dropped), both
/// auxiliary losses on.
fn four_experts() -> MoeConfig {
    MoeConfig {
        n_experts: 4,
        top_k: 2,
        capacity_factor: 1.0,
        aux_loss_coef: 0.01,
        z_loss_coef: 0.001,
    }
}

/// 2 experts, top-2, no drops: every token goes to both, so the routing cannot differ between
/// two runs whose 16-bit activations round differently (only the order of each token's two
/// choices can, which moves the load-balancing loss's first-choice fractions by 1/N).
fn two_experts() -> MoeConfig {
    MoeConfig {
        n_experts: 2,
        top_k: 2,
        capacity_factor: 1.0,
        ..four_experts()
    }
}

/// One mixture-of-experts block's tape against autograd through the same block, given an
/// upstream gradient and `loss_scale` 0.5 (the weight of the auxiliary loss in the objective
/// `(out · dout).sum() + 0.5 · aux`): the output, the auxiliary loss, the routing, every
/// parameter gradient by name (the router, every expert's four, attention and LayerNorms)
/// and the input gradient. With `starve`, ln_2's bias and the router's first column keep the
/// last expert out of every token's top-2 (its gradients are then zero). Returns the routing.
fn moe_block_check(
    dev: &Device,
    dtype: DType,
    moe: MoeConfig,
    starve: bool,
    tol: f64,
) -> Result<MoeStats> {
    let cfg = GptConfig {
        vocab_size: 64,
        block_size: 64,
        n_layer: 1,
        n_head: 2,
        n_embd: 64,
        moe: Some(moe.clone()),
    };
    let mut w = weights(&cfg, 11, dtype)?;
    if starve {
        // ln_2's output is within ±√(C−1) < 8 per channel; +9 keeps channel 0 above 1, and the
        // last expert reads it with −4 (the others' logits stay within ±1).
        let mut bias = vec![0f32; cfg.n_embd];
        bias[0] = 9.0;
        w.insert(
            "h.0.ln_2.bias".into(),
            Tensor::from_vec(bias, cfg.n_embd, dev)?.to_dtype(dtype)?,
        );
        let name = "h.0.moe.router.weight".to_string();
        let mut router = w[&name].to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let last = router.len() - 1;
        router[last][0] = -4.0;
        let flat: Vec<f32> = router.into_iter().flatten().collect();
        w.insert(
            name,
            Tensor::from_vec(flat, (moe.n_experts, cfg.n_embd), dev)?.to_dtype(dtype)?,
        );
    }
    let gpt = Gpt::new(cfg.clone(), &w, dev)?;
    let block = gpt.segments[1].as_ref();
    let (b, t, c) = (2, 48, cfg.n_embd);
    let x = Tensor::randn(0f32, 1f32, (b, t, c), dev)?.to_dtype(dtype)?;
    let dout = Tensor::randn(0f32, 1f32, (b, t, c), dev)?.to_dtype(dtype)?;
    let loss_scale = 0.5;
    let what = format!("{:?} {dtype:?} {moe:?} starve {starve}", dev.location());

    // Autograd through the block.
    let xv = Var::from_tensor(&x)?;
    let o = block.forward(xv.as_tensor(), None)?;
    let aux = o
        .aux_loss
        .clone()
        .expect("an MoE block has an auxiliary loss");
    let objective = ((&o.out * &dout)?.sum_all()?.to_dtype(DType::F32)?
        + (aux.to_dtype(DType::F32)? * loss_scale)?)?;
    let store = objective.backward()?;

    // The tape.
    let tape = block
        .forward_taped(&x, None)?
        .unwrap_or_else(|| panic!("{what}: an MoE block has a tape"));
    let stats = tape.stats().expect("an MoE tape reports its routing");
    assert_eq!(Some(&stats), o.stats.as_ref(), "{what}: routing");
    let e = gap(tape.output(), &o.out);
    assert!(e <= tol, "{what}: output rel {e:.2e}");
    let got_aux = tape.aux_loss().expect("the tape's auxiliary loss");
    let e = gap(got_aux, &aux);
    assert!(e <= tol, "{what}: aux loss rel {e:.2e}");
    let got = tape.backward(Some(&dout), loss_scale)?;
    let mut names: Vec<&str> = got.params.iter().map(|(n, _)| n.as_str()).collect();
    names.sort();
    let params = block.params();
    let mut want: Vec<&str> = params.iter().map(|p| p.name()).collect();
    want.sort();
    assert_eq!(names, want, "{what}: one gradient per parameter");
    let mut worst = (0.0, String::new());
    for (name, g) in &got.params {
        let p = params.iter().find(|p| p.name() == name).expect("param");
        let want = match store.get(&p.tensor()) {
            Some(g) => g.clone(),
            None => p.tensor().zeros_like()?, // a parameter autograd did not reach
        };
        let e = gap(g, &want);
        assert!(e <= tol, "{what} {name}: rel {e:.2e} > {tol:.0e}");
        if e > worst.0 {
            worst = (e, name.clone());
        }
    }
    let dx = got.input.expect("the block's input gradient");
    let e = gap(
        &dx,
        store
            .get(xv.as_tensor())
            .expect("autograd's input gradient"),
    );
    assert!(e <= tol, "{what} input: rel {e:.2e} > {tol:.0e}");
    eprintln!(
        "{what}: {stats:?}, worst gradient rel {:.1e} ({})",
        worst.0, worst.1
    );
    Ok(stats)
}

/// The mixture-of-experts block's tape on one device (every expert local, no exchange)
/// against autograd on CPU, rel ≤ 1e-5: with capacity drops, with an expert no token reached,
/// and the whole MoE model through the engine (with and without checkpointing).
#[test]
fn moe_tapes_match_autograd_on_cpu() -> Result<()> {
    let dev = Device::Cpu;
    let stats = moe_block_check(&dev, DType::F32, four_experts(), false, 1e-5)?;
    assert!(stats.dropped > 0, "the test should exercise capacity drops");
    let stats = moe_block_check(&dev, DType::F32, four_experts(), true, 1e-5)?;
    assert_eq!(
        stats.tokens_per_expert[3], 0,
        "expert 3 should get no token"
    );
    check(&dev, DType::F32, Some(four_experts()), 1e-5)
}

#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs a CUDA device: build with --features cuda")]
fn moe_tapes_match_autograd_f32() -> Result<()> {
    let dev = cuda();
    let stats = moe_block_check(&dev, DType::F32, four_experts(), false, 1e-4)?;
    assert!(stats.dropped > 0, "the test should exercise capacity drops");
    moe_block_check(&dev, DType::F32, four_experts(), true, 1e-4)?;
    check(&dev, DType::F32, Some(four_experts()), 1e-4)
}

#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs a CUDA device: build with --features cuda")]
fn moe_tapes_match_autograd_bf16() -> Result<()> {
    let dev = cuda();
    moe_block_check(&dev, DType::BF16, two_experts(), false, 2e-2)?;
    check(&dev, DType::BF16, Some(two_experts()), 2e-2)
}
