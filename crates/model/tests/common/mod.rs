//! What the model crate's integration tests share: the deterministic token batch they run.
//!
//! Each test file includes this module (`mod common;`) and uses its own subset of it.
#![allow(dead_code)]

use candle_core::{Device, Result, Tensor};
use mtrain_model::config::GptConfig;

/// A (b, t) batch of token ids and targets, both u32, fixed patterns over `cfg`'s vocabulary.
pub fn batch(cfg: &GptConfig, b: usize, t: usize) -> Result<(Tensor, Tensor)> {
    let v = cfg.vocab_size as u32;
    let idx: Vec<u32> = (0..b * t).map(|i| (i as u32 * 7 + 3) % v).collect();
    let tgt: Vec<u32> = (0..b * t).map(|i| (i as u32 * 11 + 5) % v).collect();
    Ok((
        Tensor::from_vec(idx, (b, t), &Device::Cpu)?,
        Tensor::from_vec(tgt, (b, t), &Device::Cpu)?,
    ))
}
