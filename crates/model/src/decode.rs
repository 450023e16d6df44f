//! Generation ([`Gpt::generate`], the whole context through the model for every token), and
//! decoding with a KV cache ([`Gpt::generate_cached`]): the prompt runs through the model once
//! (prefill), then each new token runs alone through every block, its query attending to the
//! keys and values the earlier positions left in that block's cache.
//!
//! ```text
//!   prefill  idx (B, T0) ─> wte[idx] + wpe[0..T0] ─> block i: q, k, v (B, H, T0, D)
//!                                                   y = causal attention(q, k, v)
//!                                                   cache[i] = (k, v)
//!   step     next (B, 1) ─> wte[next] + wpe[p]    ─> block i: q, k, v (B, H, 1, D)
//!            (p = cached positions)                 K, V = cache[i] ++ (k, v)   (B, H, p+1, D)
//!                                                   y = softmax(q Kᵀ · scale) V  (B, H, 1, D)
//!   both     ln_f and x · wteᵀ at the last position only ─> logits (B, V) ─> the next token
//! ```
//!
//! Without the cache ([`Gpt::generate`]) every token costs a forward over the whole context, T
//! positions through every weight; with it a token costs one position through every weight (a
//! matrix-vector product each) and attention over the p cached positions. A new position's
//! query needs no mask: every cached key is at or before it.
//!
//! Positions end at `block_size` (the rows of `wpe`). Past it [`Gpt::generate_cached`] does what
//! [`Gpt::generate`] does, as nanoGPT's `generate`: the context is cropped to its last
//! `block_size` tokens, whose positions have all moved by one, so every cached key is stale and
//! the cropped window is prefilled again, for each further token — from there on a token costs
//! a full forward, as without the cache, and gives the same token.
//!
//! A mixture of experts routes each decoded token alone, so no token of a step is dropped for
//! capacity; over a whole context a token may be (`crate::moe::capacity`), and the two paths'
//! tokens can differ for an MoE model. For a dense model they are the same up to rounding.
//!
//! Legend: `B` batch, `T` new positions, `p` cached positions, `H` heads, `D` head size,
//! `C` width, `V` vocabulary.

use candle_core::{DType, Result, Tensor};
use rand::Rng;

use crate::gpt::{Block, Embedding, Gpt, ParamStore};
use crate::layers::{CausalSelfAttention, LayerNorm, Linear};
use crate::param::Param;
use mtrain_kernels::plain::{softmax_last_dim, upcast};
use mtrain_kernels::profile::{self, Cost};

/// Each block's keys and values of the positions run so far: (B, H, p, D) each.
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

impl KvCache {
    /// An empty cache for `n_layer` blocks.
    pub fn new(n_layer: usize) -> Self {
        Self {
            layers: vec![None; n_layer],
            len: 0,
        }
    }

    /// Positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every position.
    pub fn clear(&mut self) {
        self.layers.iter_mut().for_each(|l| *l = None);
        self.len = 0;
    }

    /// Bytes the cached keys and values take.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes())
            .sum()
    }
}

/// The model's segments as decoding runs them: the embedding at any position, each block with
/// its cache, the head at the last position. They share the [`Gpt`]'s parameters.
pub struct Decoder {
    embedding: Embedding,
    blocks: Vec<Block>,
    /// The head: `ln_f`, then the product with the tied `wte`.
    ln_f: LayerNorm,
    wte: Param,
    block_size: usize,
}

impl Decoder {
    /// The decoder of `gpt` (its parameters, not copies).
    pub fn new(gpt: &Gpt) -> Result<Self> {
        let cfg = &gpt.cfg;
        let p = ParamStore::from_params(
            gpt.params()
                .into_iter()
                .map(|p| (p.name().to_string(), p))
                .collect(),
        );
        Ok(Self {
            embedding: Embedding::new(p.get("wte.weight")?, p.get("wpe.weight")?),
            blocks: (0..cfg.n_layer)
                .map(|i| Block::dense(cfg, i, &p))
                .collect::<Result<_>>()?,
            ln_f: LayerNorm::new(p.get("ln_f.weight")?, p.get("ln_f.bias")?),
            wte: p.get("wte.weight")?,
            block_size: cfg.block_size,
        })
    }

    /// An empty cache for this model.
    pub fn cache(&self) -> KvCache {
        KvCache::new(self.blocks.len())
    }

    /// Runs idx (B, T) at the positions after the cached ones, appending each block's keys and
    /// values to `cache`; returns the logits of the last position (B, V). Several positions
    /// only into an empty cache (the prefill); then one at a time.
    pub fn forward(&self, idx: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let (_, t) = idx.dims2()?;
        let first = cache.len;
        if t == 0 || (first > 0 && t != 1) {
            return Err(err(format!(
                "decode: {t} new positions after {first} cached; give the prompt (at least one \
                 position) to an empty cache, then one position at a time"
            )));
        }
        if first + t > self.block_size {
            return Err(err(format!(
                "decode: positions up to {} exceed block_size {}; crop the context and prefill \
                 again",
                first + t,
                self.block_size
            )));
        }
        let mut x = self.embed(idx, first)?; // (B, T, C)
        for (block, kv) in self.blocks.iter().zip(&mut cache.layers) {
            x = block_step(block, &x, kv)?; // (B, T, C)
        }
        cache.len += t;
        let last = layer_norm(&self.ln_f, &x.narrow(1, t - 1, 1)?)?.squeeze(1)?; // (B, C)
        let wte = self.wte.tensor(); // (V, C)
        profile::op(last.device(), || last.matmul(&wte.t()?), |z| {
            let (m, k, n) = (last.dim(0).unwrap_or(0), wte.dim(1).unwrap_or(0), z.dim(1).unwrap_or(0));
            let cost = Cost::gemm(1, (m, k, n), last.dtype().size_in_bytes());
            (profile::gemm_name("gemm", (m, k, n)), cost)
        }) // (B, V)
    }

    /// wte[idx] + wpe[first..first + T]: (B, T, C), as [`Embedding`]'s forward at positions
    /// starting from `first`.
    fn embed(&self, idx: &Tensor, first: usize) -> Result<Tensor> {
        let (b, t) = idx.dims2()?;
        let wte = self.embedding.wte.tensor();
        let c = wte.dim(1)?;
        let run = || {
            let tok = mtrain_kernels::embedding(&wte, &idx.flatten_all()?)?; // (B·T, C)
            let pos = self.embedding.wpe.tensor().narrow(0, first, t)?; // (T, C)
            tok.reshape((b, t, c))?.broadcast_add(&pos) // (B, T, C)
        };
        // The kernels' row `embedding`: the two rows read, the sum written.
        profile::op(idx.device(), run, |y| {
            let cost = Cost::elementwise(1.0, y, &[idx, y, y], &[y]);
            ("embedding".into(), cost)
        })
    }
}

/// One block as [`Block`]'s forward without dropout computes it, the attention through `kv`.
fn block_step(block: &Block, x: &Tensor, kv: &mut Option<(Tensor, Tensor)>) -> Result<Tensor> {
    let mlp = block
        .ffn
        .as_mlp()
        .ok_or_else(|| err(format!("decode: block {} is not a dense MLP", block.name)))?;
    let a = attend(&block.attn, &layer_norm(&block.ln_1, x)?, kv)?; // (B, T, C)
    let x = residual(x, &a)?;
    let h = mtrain_kernels::gelu(&linear(&*mlp.c_fc, &layer_norm(&block.ln_2, &x)?)?)?; // (B, T, 4C)
    residual(&x, &linear(&*mlp.c_proj, &h)?) // (B, T, C)
}

/// `layer`'s forward on x (.., in): the profiler's row `gemm+bias M×K×N` (M the rows of x; one
/// position at batch 1: a matrix-vector product, each weight read for 2 FLOPs), its bias add
/// part of the row.
fn linear(layer: &dyn Linear, x: &Tensor) -> Result<Tensor> {
    profile::op(x.device(), || layer.forward(x), |y| {
        let (k, n) = (x.dims().last().copied().unwrap_or(1), y.dims().last().copied().unwrap_or(1));
        let mkn = (x.elem_count() / k.max(1), k, n);
        let cost = Cost::gemm(1, mkn, x.dtype().size_in_bytes());
        (profile::gemm_name("gemm+bias", mkn), cost)
    })
}

/// `ln`'s forward on x, the profiler's row `layer_norm`.
fn layer_norm(ln: &LayerNorm, x: &Tensor) -> Result<Tensor> {
    let (w, b) = (ln.weight.tensor(), ln.bias.tensor());
    profile::elementwise("layer_norm", &[x, &w, &b], || ln.forward(x))
}

/// r + a, the profiler's row `residual` (one add per element).
fn residual(r: &Tensor, a: &Tensor) -> Result<Tensor> {
    profile::op(r.device(), || r + a, |y| {
        ("residual".into(), Cost::elementwise(1.0, y, &[r, a], &[y]))
    })
}

/// Attention of x (B, T, C) over the cached positions and its own: the prefill's causal
/// attention when `kv` is empty, else one query against the cache extended by its key and value.
fn attend(
    attn: &CausalSelfAttention,
    x: &Tensor,
    kv: &mut Option<(Tensor, Tensor)>,
) -> Result<Tensor> {
    let (h, d) = (attn.n_head, attn.head_dim);
    let scale = 1.0 / (d as f64).sqrt();
    let qkv = mtrain_kernels::split_heads(&linear(&*attn.c_attn, x)?, 3, h)?; // (3, B, H, T, D)
                                                                            // Detached: a cached key must not hold the graph of the step that made it (and through it
                                                                            // every earlier step's activations).
    let (k_new, v_new) = (qkv.get(1)?.detach(), qkv.get(2)?.detach()); // (B, H, T, D)
    let y = match kv.take() {
        None => {
            *kv = Some((k_new, v_new));
            mtrain_kernels::causal_attention(&qkv, scale, None)? // (B, H, T, D)
        }
        Some((k_past, v_past)) => {
            // The profiler's rows `kv cache append` (the cache copied into one a position
            // longer) and `decode attention` (4·H·(p + 1)·D FLOPs: the two products).
            let append = || {
                let k = Tensor::cat(&[&k_past, &k_new], 2)?; // (B, H, p + 1, D)
                let v = Tensor::cat(&[&v_past, &v_new], 2)?; // (B, H, p + 1, D)
                Ok((k, v))
            };
            let (k, v) = profile::op(x.device(), append, |(k, v)| {
                let bytes = profile::bytes(&[&k_past, &v_past, &k_new, &v_new, k, v]);
                ("kv cache append".into(), Cost { flops: 0.0, bytes })
            })?;
            let q = qkv.get(0)?; // (B, H, 1, D)
            let y = profile::op(x.device(), || {
                let s = upcast(&(&q * scale)?.matmul(&k.t()?)?)?; // (B, H, 1, p + 1) f32
                softmax_last_dim(&s)?.to_dtype(v.dtype())?.matmul(&v) // (B, H, 1, D)
            }, |y| {
                let flops = 4.0 * (k.elem_count() * q.dim(2).unwrap_or(1)) as f64;
                let bytes = profile::bytes(&[&q, &k, &v, y]);
                ("decode attention".into(), Cost { flops, bytes })
            })?;
            *kv = Some((k, v));
            y
        }
    };
    let y = mtrain_kernels::merge_heads(&y.unsqueeze(0)?)?; // (B, T, H·D)
    linear(&*attn.c_proj, &y) // (B, T, C)
}

impl Gpt {
    /// Appends `max_new_tokens` sampled tokens to idx (B, T0), running the context (at most its
    /// last `block_size` tokens) through the whole model for each; [`Gpt::generate_cached`] keeps
    /// the keys and values instead. `temperature` 0 means greedy; `top_k` keeps only the k most
    /// likely tokens.
    pub fn generate<R: Rng + ?Sized>(
        &self,
        idx: &Tensor,
        max_new_tokens: usize,
        temperature: f64,
        top_k: Option<usize>,
        rng: &mut R,
    ) -> Result<Tensor> {
        let mut idx = idx.clone();
        for _ in 0..max_new_tokens {
            let t = idx.dim(1)?;
            let cond = if t > self.cfg.block_size {
                idx.narrow(1, t - self.cfg.block_size, self.cfg.block_size)?
            } else {
                idx.clone()
            };
            let logits = self.logits(&cond)?; // (B, T, V)
            let last = logits.narrow(1, cond.dim(1)? - 1, 1)?.squeeze(1)?; // (B, V)
            let next = next_tokens(&last, temperature, top_k, rng)?; // (B, 1)
            idx = Tensor::cat(&[&idx, &next], 1)?; // (B, T + 1)
        }
        Ok(idx)
    }

    /// [`Gpt::generate`] with a KV cache ([`Decoder`]): the prompt prefilled once, then one
    /// position per new token; past `block_size`, the cropped window prefilled again for each
    /// token. The same tokens as [`Gpt::generate`] (its logits up to rounding).
    pub fn generate_cached<R: Rng + ?Sized>(
        &self,
        idx: &Tensor,
        max_new_tokens: usize,
        temperature: f64,
        top_k: Option<usize>,
        rng: &mut R,
    ) -> Result<Tensor> {
        self.generate_cached_with(idx, max_new_tokens, (temperature, top_k), rng, |_, run| run())
    }

    /// [`Gpt::generate_cached`] with each forward of the decoder run through `each`, given the
    /// cached positions before it (0: a prefill of the prompt or of the cropped window; p > 0:
    /// one new position against p cached ones) and the forward, whose logits (B, V) it returns:
    /// what `mtrain sample --profile-ops` times.
    pub fn generate_cached_with<R, F>(
        &self,
        idx: &Tensor,
        max_new_tokens: usize,
        (temperature, top_k): (f64, Option<usize>),
        rng: &mut R,
        mut each: F,
    ) -> Result<Tensor>
    where
        R: Rng + ?Sized,
        F: FnMut(usize, &mut dyn FnMut() -> Result<Tensor>) -> Result<Tensor>,
    {
        let decoder = Decoder::new(self)?;
        let mut cache = decoder.cache();
        let mut idx = idx.clone();
        for _ in 0..max_new_tokens {
            let t = idx.dim(1)?;
            let logits = if !cache.is_empty() && t <= self.cfg.block_size {
                let p = cache.len();
                let next = idx.narrow(1, t - 1, 1)?; // (B, 1)
                each(p, &mut || decoder.forward(&next, &mut cache))? // (B, V)
            } else {
                cache.clear();
                let first = t.saturating_sub(self.cfg.block_size);
                let window = idx.narrow(1, first, t - first)?; // (B, ≤ block_size)
                each(0, &mut || decoder.forward(&window, &mut cache))? // (B, V)
            };
            let next = next_tokens(&logits, temperature, top_k, rng)?; // (B, 1)
            idx = Tensor::cat(&[&idx, &next], 1)?; // (B, t + 1)
        }
        Ok(idx)
    }
}

/// The next token of each row of logits (B, V), drawn by [`sample_row`]: (B, 1) u32.
fn next_tokens<R: Rng + ?Sized>(
    logits: &Tensor,
    temperature: f64,
    top_k: Option<usize>,
    rng: &mut R,
) -> Result<Tensor> {
    let rows = logits.to_dtype(DType::F64)?.to_vec2::<f64>()?;
    let next: Vec<u32> = rows
        .iter()
        .map(|row| sample_row(row, temperature, top_k, rng))
        .collect();
    Tensor::from_vec(next, (rows.len(), 1), logits.device())
}

/// Samples one token id from a row of logits: the largest at `temperature` 0, else a draw from
/// the softmax of logits / temperature over the `top_k` largest.
fn sample_row<R: Rng + ?Sized>(
    logits: &[f64],
    temperature: f64,
    top_k: Option<usize>,
    rng: &mut R,
) -> u32 {
    let argmax = |xs: &[f64]| {
        xs.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |(i, _)| i)
    };
    if temperature <= 0.0 {
        return argmax(logits) as u32;
    }
    let mut scaled: Vec<f64> = logits.iter().map(|l| l / temperature).collect();
    if let Some(k) = top_k.filter(|&k| k > 0 && k < scaled.len()) {
        let mut sorted = scaled.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let kth = sorted[k - 1];
        scaled
            .iter_mut()
            .filter(|l| **l < kth)
            .for_each(|l| *l = f64::NEG_INFINITY);
    }
    let max = scaled.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = scaled.iter().map(|l| (l - max).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut u = rng.gen::<f64>() * total;
    for (i, w) in weights.iter().enumerate() {
        if u < *w {
            return i as u32;
        }
        u -= w;
    }
    argmax(&scaled) as u32
}

fn err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(msg)
}
