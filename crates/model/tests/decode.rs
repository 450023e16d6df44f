//! Decoding with a KV cache against the whole-context forward: the logits of every position,
//! prefill and step by step, equal those of `Gpt::logits` over the context so far; generation
//! gives the same tokens, past `block_size` too; misuse of the cache is refused by name.

use std::collections::BTreeMap;

use candle_core::{Device, Result, Tensor, D};
use mtrain_model::config::GptConfig;
use mtrain_model::gpt::Gpt;
use mtrain_model::init::init_weights;
use mtrain_model::Decoder;

/// A small model (2 layers, block 16) whose weights are the seeded init times `gain`: a gain
/// above 1 spreads the logits, so that greedy choices are not decided by rounding.
fn model(gain: f64) -> Result<Gpt> {
    let cfg = GptConfig {
        n_layer: 2,
        block_size: 16,
        ..GptConfig::tiny()
    };
    let weights: BTreeMap<String, Tensor> = init_weights(&cfg, 3)?
        .into_iter()
        .map(|(n, t)| Ok((n, (t * gain)?)))
        .collect::<Result<_>>()?;
    Gpt::new(cfg, &weights, &Device::Cpu)
}

/// max |a − b| / max |b|.
fn rel_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let d = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    let m = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    Ok(d / m)
}

#[test]
fn cached_logits_equal_the_whole_context_forward_at_every_position() -> Result<()> {
    let gpt = model(1.0)?;
    let decoder = Decoder::new(&gpt)?;
    let mut cache = decoder.cache();
    // Two rows, a prompt of 5 positions, then 11 more one at a time up to block_size 16.
    let seq: Vec<u32> = (0..32u32).map(|i| (i * 37 + 11) % 256).collect();
    let idx = Tensor::from_vec(seq, (2, 16), &Device::Cpu)?; // (B, T)
    let prompt = 5;
    let logits = decoder.forward(&idx.narrow(1, 0, prompt)?, &mut cache)?; // (B, V)
    let mut worst = 0f32;
    let mut check = |t: usize, logits: &Tensor| -> Result<()> {
        let full = gpt.logits(&idx.narrow(1, 0, t)?)?; // (B, t, V)
        let last = full.narrow(1, t - 1, 1)?.squeeze(1)?; // (B, V)
        assert_eq!(logits.dims(), last.dims());
        worst = worst.max(rel_diff(logits, &last)?);
        Ok(())
    };
    check(prompt, &logits)?;
    for t in prompt..16 {
        let logits = decoder.forward(&idx.narrow(1, t, 1)?, &mut cache)?;
        assert_eq!(cache.len(), t + 1);
        check(t + 1, &logits)?;
    }
    assert!(
        worst < 1e-5,
        "cached logits differ by {worst} of the largest"
    );
    // (B, H, p, D) keys and values per layer: 2 · 2 layers · 2 rows · 64 wide · 16 positions.
    assert_eq!(cache.bytes(), 2 * 2 * 2 * 64 * 16 * 4);

    // The cache is full: one more position, or several after the first, is refused by name.
    let one = idx.narrow(1, 0, 1)?;
    let msg = decoder
        .forward(&one, &mut cache)
        .err()
        .map(|e| e.to_string());
    assert!(
        msg.as_deref()
            .is_some_and(|m| m.contains("17") && m.contains("block_size 16")),
        "{msg:?}"
    );
    let mut short = decoder.cache();
    decoder.forward(&one, &mut short)?;
    let msg = decoder
        .forward(&idx.narrow(1, 1, 2)?, &mut short)
        .err()
        .map(|e| e.to_string());
    assert!(
        msg.as_deref()
            .is_some_and(|m| m.contains("2 new positions after 1 cached")),
        "{msg:?}"
    );
    Ok(())
}

#[test]
fn cached_generation_gives_the_same_tokens_past_block_size() -> Result<()> {
    let gpt = model(4.0)?;
    let idx = Tensor::new(&[[1u32, 2, 3], [200, 100, 50]], &Device::Cpu)?; // (B, T0)
                                                                           // 3 + 30 tokens: past block_size 16, both crop to the last 16 each step.
    let rng = || rand::rngs::mock::StepRng::new(0, 1);
    let plain = gpt.generate(&idx, 30, 0.0, None, &mut rng())?;
    let cached = gpt.generate_cached(&idx, 30, 0.0, None, &mut rng())?;
    assert_eq!(cached.dims(), &[2, 33]);
    let (plain, cached) = (plain.to_vec2::<u32>()?, cached.to_vec2::<u32>()?);
    assert_eq!(plain, cached);
    // Not a constant continuation: the comparison covers varied tokens.
    let distinct: std::collections::BTreeSet<u32> = cached[0][3..].iter().copied().collect();
    assert!(distinct.len() > 3, "{cached:?}");
    // top-k 1 at a temperature draws the largest logit too.
    let top1 = gpt.generate_cached(&idx, 30, 0.8, Some(1), &mut rng())?;
    assert_eq!(top1.to_vec2::<u32>()?, plain);
    // A prompt longer than block_size is cropped as the plain path crops it.
    let long = Tensor::arange(0u32, 40, &Device::Cpu)?.unsqueeze(0)?; // (1, 40)
    let a = gpt.generate(&long, 5, 0.0, None, &mut rng())?;
    let b = gpt.generate_cached(&long, 5, 0.0, None, &mut rng())?;
    assert_eq!(a.to_vec2::<u32>()?, b.to_vec2::<u32>()?);
    let last = b.narrow(1, 40, 5)?.max_keepdim(D::Minus1)?;
    assert!(last.flatten_all()?.to_vec1::<u32>()?[0] < 256);
    Ok(())
}
