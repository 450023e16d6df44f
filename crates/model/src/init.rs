//! Weight initialisation, independent of layout.
//!
//! nanoGPT's scheme: every weight ~ N(0, 0.02), the residual projections (`*.c_proj.weight`)
//! ~ N(0, 0.02/√(2·L)) so the residual stream's variance does not grow with depth, biases 0,
//! LayerNorm weight 1 and bias 0.
//!
//! Each tensor is drawn from its own RNG seeded by `(seed, name)`. A rank that builds only its
//! shard still initialises the full tensor from that seed and slices it, so every parallel layout
//! starts from exactly the numbers the single-device run starts from, whatever order the tensors
//! are created in.

use std::collections::BTreeMap;

use candle_core::{Device, Result, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::config::GptConfig;

/// Standard deviation of every weight matrix and embedding.
pub const INIT_STD: f64 = 0.02;

/// How one named tensor is initialised.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum InitKind {
    /// N(0, std²).
    Normal { std: f64 },
    /// All zeros (biases).
    Zeros,
    /// All ones (LayerNorm weights).
    Ones,
}

/// Every parameter name of `cfg` with its shape and init rule, in the model's fixed order
/// (wte, wpe, h.0 …, ln_f).
pub fn param_specs(cfg: &GptConfig) -> Vec<(String, Vec<usize>, InitKind)> {
    let (v, t, c) = (cfg.vocab_size, cfg.block_size, cfg.n_embd);
    let normal = InitKind::Normal { std: INIT_STD };
    let residual = InitKind::Normal {
        std: INIT_STD / (2.0 * cfg.n_layer as f64).sqrt(),
    };
    let mut specs = vec![
        ("wte.weight".to_string(), vec![v, c], normal),
        ("wpe.weight".to_string(), vec![t, c], normal),
    ];
    let mut push = |name: String, shape: Vec<usize>, kind| specs.push((name, shape, kind));
    for i in 0..cfg.n_layer {
        let h = format!("h.{i}");
        push(format!("{h}.ln_1.weight"), vec![c], InitKind::Ones);
        push(format!("{h}.ln_1.bias"), vec![c], InitKind::Zeros);
        push(format!("{h}.attn.c_attn.weight"), vec![3 * c, c], normal);
        push(
            format!("{h}.attn.c_attn.bias"),
            vec![3 * c],
            InitKind::Zeros,
        );
        push(format!("{h}.attn.c_proj.weight"), vec![c, c], residual);
        push(format!("{h}.attn.c_proj.bias"), vec![c], InitKind::Zeros);
        push(format!("{h}.ln_2.weight"), vec![c], InitKind::Ones);
        push(format!("{h}.ln_2.bias"), vec![c], InitKind::Zeros);
        let mlp_prefixes = match &cfg.moe {
            None => vec![format!("{h}.mlp")],
            Some(m) => {
                push(
                    format!("{h}.moe.router.weight"),
                    vec![m.n_experts, c],
                    normal,
                );
                (0..m.n_experts)
                    .map(|e| format!("{h}.moe.experts.{e}"))
                    .collect()
            }
        };
        for p in mlp_prefixes {
            push(format!("{p}.c_fc.weight"), vec![4 * c, c], normal);
            push(format!("{p}.c_fc.bias"), vec![4 * c], InitKind::Zeros);
            push(format!("{p}.c_proj.weight"), vec![c, 4 * c], residual);
            push(format!("{p}.c_proj.bias"), vec![c], InitKind::Zeros);
        }
    }
    specs.push(("ln_f.weight".to_string(), vec![c], InitKind::Ones));
    specs.push(("ln_f.bias".to_string(), vec![c], InitKind::Zeros));
    specs
}

/// The RNG seed of one tensor: a 64-bit FNV-1a hash of the name mixed with `seed` (SplitMix64).
pub fn tensor_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let mut z = h ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One tensor drawn from its own RNG (Box–Muller normals), fp32 on the CPU.
pub fn init_tensor(seed: u64, name: &str, shape: &[usize], kind: InitKind) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let data = match kind {
        InitKind::Zeros => vec![0f32; n],
        InitKind::Ones => vec![1f32; n],
        InitKind::Normal { std } => {
            let mut rng = StdRng::seed_from_u64(tensor_seed(seed, name));
            let mut out = Vec::with_capacity(n + 1);
            while out.len() < n {
                // u1 in (0, 1] so ln(u1) is finite.
                let u1: f64 = 1.0 - rng.gen::<f64>();
                let u2: f64 = rng.gen::<f64>();
                let r = (-2.0 * u1.ln()).sqrt();
                let theta = 2.0 * std::f64::consts::PI * u2;
                out.push((std * r * theta.cos()) as f32);
                out.push((std * r * theta.sin()) as f32);
            }
            out.truncate(n);
            out
        }
    };
    Tensor::from_vec(data, shape, &Device::Cpu)
}

/// Full fp32 CPU weights of `cfg` by GPT-2 name.
pub fn init_weights(cfg: &GptConfig, seed: u64) -> Result<BTreeMap<String, Tensor>> {
    cfg.validate().map_err(candle_core::Error::wrap)?;
    param_specs(cfg)
        .into_iter()
        .map(|(name, shape, kind)| {
            let t = init_tensor(seed, &name, &shape, kind)?;
            Ok((name, t))
        })
        .collect()
}
