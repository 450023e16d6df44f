//! Weight initialisation, independent of layout.
//!
//! nanoGPT's scheme: every weight ~ N(0, 0.02), the residual projections (`*.c_proj.weight`)
//! ~ N(0, 0.02/√(2·L)) so the residual stream's variance does not grow with depth, biases 0,
//! LayerNorm weight 1 and bias 0.
//!
//! Every element is a pure function of `(seed, name, element index)`: the tensor's key is
//! [`tensor_seed`]`(seed, name)`, and element `j` of the row-major single-device tensor is one
//! of the two Box–Muller normals of the Philox4x32-10 draw at counter `j / 2` (cosine for even
//! `j`, sine for odd). So any region of any parameter is drawn without drawing the rest
//! ([`SeededInit`] is a [`ParamSource`]), and every parallel layout, each rank drawing only the
//! pieces it holds, starts from exactly the numbers of the single-device run.
//!
//! ```text
//!   counter k = j / 2 ──Philox(key = tensor_seed(seed, name))──► (x0, x1) 64-bit
//!   u1 = 1 − x0/2⁶⁴ ∈ (0, 1]   u2 = x1/2⁶⁴   r = √(−2 ln u1)
//!   element 2k = std · r · cos 2πu2      element 2k+1 = std · r · sin 2πu2
//! ```

use std::collections::BTreeMap;

use std::ops::Range;

use candle_core::{Device, Result, Tensor};
use mtrain_kernels::philox::draw_u64x2;
use rayon::prelude::*;

use crate::config::GptConfig;
use crate::source::ParamSource;

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

/// Elements `start .. start + out.len()` of a tensor initialised by `kind`, keyed by `key`
/// ([`tensor_seed`]), into `out`.
fn draw_into(key: u64, kind: InitKind, start: usize, out: &mut [f32]) {
    let std = match kind {
        InitKind::Zeros => return out.fill(0.0),
        InitKind::Ones => return out.fill(1.0),
        InitKind::Normal { std } => std,
    };
    const TWO_POW_M53: f64 = 1.0 / (1u64 << 53) as f64;
    let mut pair = usize::MAX; // the counter whose two normals `normals` holds
    let mut normals = [0f32; 2];
    for (i, o) in out.iter_mut().enumerate() {
        let j = start + i;
        if j / 2 != pair {
            pair = j / 2;
            let k = pair as u64;
            let [x0, x1] = draw_u64x2(key, [k as u32, (k >> 32) as u32, 0, 0]);
            // u1 in (0, 1] so ln(u1) is finite; 53 bits, every value exact in f64.
            let u1 = 1.0 - (x0 >> 11) as f64 * TWO_POW_M53;
            let u2 = (x1 >> 11) as f64 * TWO_POW_M53;
            let r = std * (-2.0 * u1.ln()).sqrt();
            let theta = 2.0 * std::f64::consts::PI * u2;
            normals = [(r * theta.cos()) as f32, (r * theta.sin()) as f32];
        }
        *o = normals[j % 2];
    }
}

/// Elements `run` of a tensor initialised by `kind`, keyed by `key`, appended to `out`: drawn in
/// pieces of [`PIECE`] elements over the compute pool (each element depends on its index
/// alone, so the pieces give the same numbers as one pass).
fn draw_run(key: u64, kind: InitKind, run: Range<usize>, out: &mut Vec<f32>) {
    let at = out.len();
    out.resize(at + run.len(), 0.0);
    out[at..]
        .par_chunks_mut(PIECE)
        .enumerate()
        .for_each(|(p, piece)| draw_into(key, kind, run.start + p * PIECE, piece));
}

/// Elements a task of the initialisation draws: a GPT-2 1.5B's 1.6·10⁹ elements are 24,000
/// pieces, so startup takes one core's time over the pool's cores.
const PIECE: usize = 1 << 16;

/// One tensor drawn whole (see the module doc), fp32 on the CPU.
pub fn init_tensor(seed: u64, name: &str, shape: &[usize], kind: InitKind) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut data = Vec::with_capacity(n);
    draw_run(tensor_seed(seed, name), kind, 0..n, &mut data);
    Tensor::from_vec(data, shape, &Device::Cpu)
}

/// The seeded initialisation of a model as a [`ParamSource`]: any run of any parameter, drawn
/// alone. [`init_weights`] reads every tensor whole from it.
pub struct SeededInit {
    seed: u64,
    specs: BTreeMap<String, (Vec<usize>, InitKind)>,
}

impl SeededInit {
    /// The initialisation of `cfg` under `seed` (the config is checked first).
    pub fn new(cfg: &GptConfig, seed: u64) -> Result<SeededInit> {
        cfg.validate().map_err(candle_core::Error::wrap)?;
        let specs = param_specs(cfg)
            .into_iter()
            .map(|(name, shape, kind)| (name, (shape, kind)))
            .collect();
        Ok(SeededInit { seed, specs })
    }
}

impl ParamSource for SeededInit {
    fn read(&self, name: &str, full_shape: &[usize], runs: &[Range<usize>]) -> Result<Vec<f32>> {
        let (shape, kind) = self
            .specs
            .get(name)
            .ok_or_else(|| candle_core::Error::Msg(format!("no parameter named `{name}`")))?;
        if shape.as_slice() != full_shape {
            candle_core::bail!("`{name}` has shape {shape:?}, expected {full_shape:?}");
        }
        let numel: usize = shape.iter().product();
        let mut out = Vec::with_capacity(crate::source::runs_len(runs));
        let key = tensor_seed(self.seed, name);
        for r in runs {
            if r.end > numel {
                candle_core::bail!("`{name}` has {numel} elements; run {r:?} is outside it");
            }
            draw_run(key, *kind, r.clone(), &mut out);
        }
        Ok(out)
    }
}

/// Full fp32 CPU weights of `cfg` by GPT-2 name: every tensor read whole from [`SeededInit`].
pub fn init_weights(cfg: &GptConfig, seed: u64) -> Result<BTreeMap<String, Tensor>> {
    let source = SeededInit::new(cfg, seed)?;
    param_specs(cfg)
        .into_iter()
        .map(|(name, shape, _)| {
            let n: usize = shape.iter().product();
            let data = source.read(&name, &shape, &[0..n])?;
            Ok((name, Tensor::from_vec(data, shape, &Device::Cpu)?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_run_is_the_whole_tensor_s_elements() -> Result<()> {
        let cfg = GptConfig::tiny();
        let source = SeededInit::new(&cfg, 3)?;
        let c = cfg.n_embd;
        let (shape, n) = ([3 * c, c], 3 * c * c);
        let whole = source.read("h.0.attn.c_attn.weight", &shape, &[0..n])?;
        for runs in [vec![1..2], vec![3..10, 11..12, 50..n], vec![0..0, 7..8]] {
            let got = source.read("h.0.attn.c_attn.weight", &shape, &runs)?;
            let want: Vec<f32> = runs.iter().flat_map(|r| whole[r.clone()].to_vec()).collect();
            assert_eq!(got, want, "runs {runs:?}");
        }
        assert!(source.read("h.0.attn.c_attn.weight", &[c, 3 * c], &[0..1]).is_err());
        assert!(source.read("h.0.attn.c_attn.weight", &shape, &[n - 1..n + 1]).is_err());
        let other = SeededInit::new(&cfg, 4)?.read("h.0.attn.c_attn.weight", &shape, &[0..n])?;
        assert_ne!(whole, other, "the seed keys the draw");
        Ok(())
    }

    /// Element j as the module doc writes it, one at a time.
    fn element(key: u64, std: f64, j: usize) -> f32 {
        let k = (j / 2) as u64;
        let [x0, x1] = draw_u64x2(key, [k as u32, (k >> 32) as u32, 0, 0]);
        let u1 = 1.0 - (x0 >> 11) as f64 / (1u64 << 53) as f64;
        let u2 = (x1 >> 11) as f64 / (1u64 << 53) as f64;
        let (r, theta) = ((-2.0 * u1.ln()).sqrt(), 2.0 * std::f64::consts::PI * u2);
        (std * r * if j % 2 == 0 { theta.cos() } else { theta.sin() }) as f32
    }

    #[test]
    fn pieces_drawn_on_any_number_of_threads_are_the_formula_s_elements() {
        let (key, std) = (tensor_seed(5, "h.0.mlp.c_fc.weight"), 0.02);
        // An odd start, across three pieces' boundaries, ending mid-piece.
        let run = PIECE - 3..4 * PIECE - 1001;
        let want: Vec<f32> = run.clone().map(|j| element(key, std, j)).collect();
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let mut got = vec![7.0];
            pool.install(|| draw_run(key, InitKind::Normal { std }, run.clone(), &mut got));
            assert_eq!(got[0], 7.0, "appended after what was there");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got[1..]), bits(&want), "{threads} threads");
        }
    }
}
