//! The hand-written backward passes (`explicit`) against autograd, on CPU.
//!
//! With `explicit::set_cpu(true)` the embedding, block and head tapes run in plain candle ops
//! (`tape_ops`), so their backward wiring — which gradient feeds which layer, the residual adds,
//! the tied embedding — is checked here without a GPU. Tolerance: f32, the largest entry of each
//! difference within 1e-5 of the largest entry of the autograd gradient (the two do the same
//! arithmetic in a different order). This file is its own test binary, so switching the tapes on
//! for CPU affects no other test.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Result, Tensor};
use mtrain_model::config::GptConfig;
use mtrain_model::engine::{Engine, NoHooks};
use mtrain_model::explicit;
use mtrain_model::gpt::Gpt;
use mtrain_model::init::init_weights;
use mtrain_model::param::Grads;

fn rel_err(a: &Tensor, b: &Tensor) -> Result<f64> {
    let (a, b) = (a.to_dtype(DType::F64)?, b.to_dtype(DType::F64)?);
    let diff = (&a - &b)?.abs()?.max_all()?.to_scalar::<f64>()?;
    Ok(diff / b.abs()?.max_all()?.to_scalar::<f64>()?.max(1e-12))
}

#[test]
fn tapes_match_autograd_on_cpu() -> Result<()> {
    explicit::set_cpu(true);
    let cfg = GptConfig {
        vocab_size: 48,
        block_size: 16,
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        moe: None,
    };
    let w: BTreeMap<String, Tensor> = init_weights(&cfg, 5)?;
    let gpt = Gpt::new(cfg.clone(), &w, &Device::Cpu)?;
    let (b, t) = (3, 12); // t < block_size: the position gradient is zero-padded
    let ids = |mul: u32, add: u32| -> Result<Tensor> {
        let v: Vec<u32> = (0..(b * t) as u32).map(|i| (i * mul + add) % 48).collect();
        Tensor::from_vec(v, (b, t), &Device::Cpu)
    };
    let (idx, tgt) = (ids(7, 3)?, ids(11, 5)?);
    let x = Tensor::zeros((b, t, cfg.n_embd), DType::F32, &Device::Cpu)?;
    let last = gpt.segments.len() - 1;
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

    let whole = gpt.forward_loss(&idx, &tgt)?.loss;
    let want_loss = whole.to_scalar::<f32>()? as f64;
    let store = whole.backward()?;
    for checkpointing in [false, true] {
        let mut grads = Grads::new();
        let (loss, _) = Engine::new(checkpointing).forward_backward(
            &gpt.segments,
            &idx,
            &tgt,
            1.0,
            &mut grads,
            &mut NoHooks,
        )?;
        assert!(
            (loss - want_loss).abs() <= 1e-6 * want_loss.abs(),
            "loss {loss} through the tapes vs {want_loss} by autograd"
        );
        for p in gpt.params() {
            let want = store.get(&p.tensor()).expect("autograd gradient");
            let got = grads.get(p.name()).expect("tape gradient");
            assert_eq!(got.dims(), want.dims(), "{}", p.name());
            let e = rel_err(got, want)?;
            assert!(
                e < 1e-5,
                "{} (checkpointing {checkpointing}): relative error {e:.2e}",
                p.name()
            );
        }
    }
    explicit::set_cpu(false);
    assert!(
        gpt.segments[1].forward_taped(&x, None)?.is_none(),
        "CPU tapes are off by default"
    );
    Ok(())
}
