//! Dropout masks that every layout draws alike: a mask element is a pure function of the run's
//! seed and the element's coordinates, drawn with Philox4x32-10 ([`crate::philox`]).
//!
//! ```text
//!   key     = seed
//!   counter = (q low 32, q high 32, step, micro | layer << 12 | site << 24)    q = index / 4
//!   word    = philox(key, counter)[index % 4]          one call covers 4 consecutive elements
//!   keep    = word >= threshold,  threshold = round(p · 2³²)      P(keep) = 1 − p to 2⁻³²
//!   mask    = keep / (1 − p)                                      inverted dropout: E[mask] = 1
//! ```
//!
//! `index` is the element's place in the activation of the *whole* global batch, row-major over
//! its global shape (for a (B, T, C) activation: `(b·T + t)·C + c`, with `b` the row of the global
//! batch). A rank holding only a block of it (a data-parallel slice of the rows, a tensor-parallel
//! slice of the columns or heads, a sequence-parallel slice of the positions, a pipeline stage's
//! layers) draws its block with [`mask_block`] and gets exactly the elements one device draws for
//! the same places; a recompute (activation checkpointing) or a backward pass regenerates the same
//! mask from the same coordinates, so no mask needs to be kept. Unlike a per-rank generator
//! state (Megatron's RNG tracker gives each TP rank its own stream), nothing depends on how the
//! tensor was split.
//!
//! On the attention probabilities (B, H, T, T), seen as (B, H, T·T), the mask `M` enters as
//!
//! ```text
//!   O = (P ∘ M) V     dV = (P ∘ M)ᵀ dO     dS = P ∘ (dP ∘ M − δ),  dP = dO Vᵀ,  δ = rowsum(dO ∘ O)
//! ```
//!
//! (δ = rowsum(P ∘ M ∘ dP) is still rowsum(dO ∘ O)). The flash kernels, tensor-core and CUDA-core,
//! draw it where each probability is in a register (`attn_mask` in kernels.cu, given an
//! `AttnDrop`); on CPU it is an f32 (B, H, T, T) tensor ([`Mask::tensor`]).
//!
//! This module is the CPU generator and [`apply`], the op that multiplies a block of an
//! activation by its mask: on CUDA the kernel `dropout_fwd` (`dropout.cu`), which computes the
//! same words from the same counters (`philox.cu`), as do the attention kernels for the mask on
//! the attention probabilities ([`crate::attention`]). Its backward is the same op on the
//! gradient: `d(x ∘ m) = dy ∘ m`.

use candle_core::{DType, Tensor};

/// Where in the model a mask is drawn (nanoGPT's three dropout sites, the residual one twice).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Site {
    /// After the token + position embeddings.
    Embedding = 0,
    /// On the attention probabilities (B, H, T, T).
    Attention = 1,
    /// On the attention block's output projection, before the residual add.
    AttentionResidual = 2,
    /// On the MLP's output projection, before the residual add.
    MlpResidual = 3,
}

/// The coordinates a mask is drawn for, all but the element index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaskKey {
    /// The run's seed.
    pub seed: u64,
    /// Optimizer step (below 2³²).
    pub step: u64,
    /// Micro-batch of the step (gradient accumulation; below 2¹²).
    pub micro: u32,
    /// Transformer block (0 for the embedding site; below 2¹²).
    pub layer: u32,
    /// The site in the block.
    pub site: Site,
}

/// Largest micro-batch and layer index a key can hold (12 bits each).
pub const MAX_FIELD: u32 = (1 << 12) - 1;

/// Why a mask could not be drawn.
#[derive(Debug, Clone, PartialEq)]
pub enum MaskError {
    /// A coordinate is outside the range the counter holds, or p is not a probability.
    Invalid(String),
}

impl std::fmt::Display for MaskError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MaskError::Invalid(m) => write!(f, "{m}"),
        }
    }
}

impl std::error::Error for MaskError {}

impl MaskKey {
    /// The key, checked: step, micro-batch and layer within their counter fields.
    pub fn new(
        seed: u64,
        step: u64,
        micro: u32,
        layer: u32,
        site: Site,
    ) -> Result<Self, MaskError> {
        if step > u64::from(u32::MAX) || micro > MAX_FIELD || layer > MAX_FIELD {
            return Err(MaskError::Invalid(format!(
                "dropout mask coordinates out of range: step {step} (< 2^32), micro-batch {micro} \
                 and layer {layer} (each <= {MAX_FIELD})"
            )));
        }
        Ok(Self {
            seed,
            step,
            micro,
            layer,
            site,
        })
    }

    fn counter(&self, quad: u64) -> [u32; 4] {
        [
            quad as u32,
            (quad >> 32) as u32,
            self.step as u32,
            self.micro | self.layer << 12 | (self.site as u32) << 24,
        ]
    }
}

/// A block of a 3-D global activation: the global shape (G0, G1, G2) and where the block
/// starts. The activations (B, T, C) are such blocks, and so are attention probabilities
/// (B, H, T, T) seen as (B, H, T·T) (their last two dimensions are never split).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub global: [usize; 3],
    pub offset: [usize; 3],
}

/// One mask: its key, its drop probability and the block of the global activation it covers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mask {
    pub key: MaskKey,
    pub p: f64,
    pub place: Place,
}

impl Mask {
    /// The mask's values for a block of shape `shape` (f32, row-major).
    pub fn values(&self, shape: [usize; 3]) -> Result<Vec<f32>, MaskError> {
        mask_block(
            &self.key,
            self.p,
            &self.place.global,
            &self.place.offset,
            &shape,
        )
    }

    /// The same mask from `first` rows further on: the mask of a chunk of the block's rows
    /// (sequences `first ..`), as one device draws it for them.
    pub fn from_row(&self, first: usize) -> Mask {
        let [r0, o1, o2] = self.place.offset;
        Mask {
            place: Place {
                offset: [r0 + first, o1, o2],
                ..self.place
            },
            ..*self
        }
    }

    /// The mask of a block (A, B, C) as an f32 tensor on `dev`.
    pub fn tensor(
        &self,
        shape: [usize; 3],
        dev: &candle_core::Device,
    ) -> candle_core::Result<Tensor> {
        let v = self.values(shape).map_err(candle_core::Error::wrap)?;
        Tensor::from_vec(v, shape.to_vec(), &candle_core::Device::Cpu)?.to_device(dev)
    }

    /// For a mask of attention probabilities (rows, H, T·T) of a sequence of `t`: the values of
    /// the block of query positions `q` = (first, count) and key positions `k` = (first, count)
    /// for `b` rows and `h` heads from the mask's offset, as a (b, h, q.1, k.1) f32 tensor on
    /// `dev` — what one device draws for those (query, key) pairs, whichever rank holds them
    /// (context parallelism's blocks of the (T, T) matrix). Seen as (rows, H, T, T), the
    /// element (r, j, tq, tk) has the index of (r, j, tq·T + tk).
    pub fn probs_block(
        &self,
        (b, h): (usize, usize),
        t: usize,
        q: (usize, usize),
        k: (usize, usize),
        dev: &candle_core::Device,
    ) -> candle_core::Result<Tensor> {
        let [rows, heads, tt] = self.place.global;
        if tt != t * t {
            return Err(candle_core::Error::Msg(format!(
                "probability mask of {tt} columns per head is not that of a sequence of {t} ({})",
                t * t
            )));
        }
        let [r0, h0, _] = self.place.offset;
        let shape = [b, h, q.1, k.1];
        let v = mask_block(
            &self.key,
            self.p,
            &[rows, heads, t, t],
            &[r0, h0, q.0, k.0],
            &shape,
        )
        .map_err(candle_core::Error::wrap)?;
        Tensor::from_vec(v, shape.to_vec(), &candle_core::Device::Cpu)?.to_device(dev)
    }

    /// The key as the kernels take it (`DropKey` in philox.cu).
    #[cfg(feature = "cuda")]
    pub(crate) fn device_key(&self) -> Result<DropKey, MaskError> {
        let k = crate::philox::key_of(self.key.seed);
        let c = self.key.counter(0);
        Ok(DropKey {
            k0: k[0],
            k1: k[1],
            step: c[2],
            tag: c[3],
            threshold: threshold(self.p)?,
            scale: (1.0 / (1.0 - self.p)) as f32,
            _pad: 0,
        })
    }
}

/// `struct DropKey` of philox.cu, field for field.
#[cfg(feature = "cuda")]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct DropKey {
    pub k0: u32,
    pub k1: u32,
    pub step: u32,
    pub tag: u32,
    pub threshold: u64,
    pub scale: f32,
    pub _pad: u32,
}

// SAFETY: #[repr(C)] plain integers and a float, the layout of `struct DropKey` in philox.cu
// (32 bytes, 8-byte aligned).
#[cfg(feature = "cuda")]
unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for DropKey {}

#[cfg(feature = "cuda")]
/// `struct AttnDrop` of kernels.cu, field for field: the mask's key and where this launch's
/// (B_l, hl) heads sit in the global (Bg, hg); a zero threshold means no dropout.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct AttnDrop {
    key: DropKey,
    hl: i32,
    hg: i32,
    b0: i32,
    h0: i32,
}

#[cfg(feature = "cuda")]
// SAFETY: #[repr(C)] of a DropKey and four i32, the layout of `struct AttnDrop` (48 bytes).
unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for AttnDrop {}

#[cfg(feature = "cuda")]
/// The kernels' dropout argument for heads (B_l, hl): none when `dropout` is None.
pub(crate) fn attn_drop(dropout: Option<&Mask>, hl: usize) -> candle_core::Result<AttnDrop> {
    let none = AttnDrop {
        key: DropKey {
            k0: 0,
            k1: 0,
            step: 0,
            tag: 0,
            threshold: 0,
            scale: 1.0,
            _pad: 0,
        },
        hl: hl as i32,
        hg: hl as i32,
        b0: 0,
        h0: 0,
    };
    let Some(m) = dropout else {
        return Ok(none);
    };
    Ok(AttnDrop {
        key: m.device_key().map_err(candle_core::Error::wrap)?,
        hg: m.place.global[1] as i32,
        b0: m.place.offset[0] as i32,
        h0: m.place.offset[1] as i32,
        ..none
    })
}

/// `x ∘ mask` for x (A, B, C), the block of the global activation `mask.place` describes:
/// inverted dropout, computed in f32 and rounded to x's dtype once. The same op is its own
/// backward (`dy ∘ mask`). p = 0 returns x.
pub fn apply(x: &Tensor, mask: &Mask) -> candle_core::Result<Tensor> {
    if mask.p == 0.0 {
        return Ok(x.clone());
    }
    let (a, b, c) = x.dims3()?;
    #[cfg(feature = "cuda")]
    if crate::fused_for(x) {
        return imp::apply(&x.contiguous()?, mask, (a, b, c));
    }
    let m = mask.tensor([a, b, c], x.device())?; // (A, B, C) f32
    (x.to_dtype(DType::F32)? * m)?.to_dtype(x.dtype())
}

#[cfg(feature = "cuda")]
mod imp {
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{Result, Tensor};

    use crate::cuda::{by_dtype, device, grid_stride, kernel, slice, storage, tensor};

    pub fn apply(x: &Tensor, mask: &super::Mask, dims: (usize, usize, usize)) -> Result<Tensor> {
        by_dtype!("dropout", x.dtype(), run(x, mask, dims))
    }

    fn run<T: CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
        x: &Tensor,
        mask: &super::Mask,
        (a, b, c): (usize, usize, usize),
    ) -> Result<Tensor> {
        let dev = device(x)?;
        let key = mask.device_key().map_err(candle_core::Error::wrap)?;
        let (sx, ox) = storage(x, "dropout x")?;
        let xs = slice::<T>(&sx)?.slice(ox..);
        let n = a * b * c;
        // SAFETY: the kernel writes every element of y.
        let y = unsafe { dev.alloc::<T>(n)? };
        let f = kernel(&dev, None, x.dtype(), "dropout_fwd")?;
        let [o0, o1, o2] = mask.place.offset.map(|v| v as i64);
        let [_, g1, g2] = mask.place.global.map(|v| v as i64);
        let (n64, t64, c64) = (n as i64, b as i64, c as i64);
        let mut l = f.builder();
        l.arg(&xs).arg(&y).arg(&n64).arg(&t64).arg(&c64);
        l.arg(&o0).arg(&o1).arg(&o2).arg(&g1).arg(&g2).arg(&key);
        // SAFETY: argument types and order match `dropout_fwd` in dropout.cu.
        unsafe { l.launch(grid_stride(n)) }.w()?;
        drop(sx);
        Ok(tensor(&dev, y, (a, b, c)))
    }
}

/// The draw threshold of drop probability `p`: a 32-bit word below it drops its element.
fn threshold(p: f64) -> Result<u64, MaskError> {
    if !(0.0..1.0).contains(&p) {
        return Err(MaskError::Invalid(format!(
            "dropout probability {p} must be in [0, 1)"
        )));
    }
    Ok((p * 4_294_967_296.0).round() as u64)
}

/// Whether element `index` is kept under drop probability `p` (its mask is `1/(1-p)` if so, else 0).
pub fn keep(key: &MaskKey, p: f64, index: u64) -> Result<bool, MaskError> {
    let t = threshold(p)?;
    let w = crate::philox::philox4x32(key.counter(index / 4), crate::philox::key_of(key.seed));
    Ok(u64::from(w[(index % 4) as usize]) >= t)
}

/// The mask values (`0` or `1/(1-p)`) of the elements `start .. start + len` of the global index.
pub fn mask_range(key: &MaskKey, p: f64, start: u64, len: usize) -> Result<Vec<f32>, MaskError> {
    let t = threshold(p)?;
    let scale = (1.0 / (1.0 - p)) as f32;
    let k = crate::philox::key_of(key.seed);
    let mut out = Vec::with_capacity(len);
    let mut quad = u64::MAX;
    let mut words = [0u32; 4];
    for index in start..start + len as u64 {
        if index / 4 != quad {
            quad = index / 4;
            words = crate::philox::philox4x32(key.counter(quad), k);
        }
        let kept = u64::from(words[(index % 4) as usize]) >= t;
        out.push(if kept { scale } else { 0.0 });
    }
    Ok(out)
}

/// The mask of a block of a global activation: `global` its shape (row-major, any rank), the
/// block starting at `offset` with shape `shape` (each `offset[d] + shape[d] <= global[d]`); the
/// block's values row-major. A rank's shard of rows, heads, columns or positions is such a block.
pub fn mask_block(
    key: &MaskKey,
    p: f64,
    global: &[usize],
    offset: &[usize],
    shape: &[usize],
) -> Result<Vec<f32>, MaskError> {
    let n = global.len();
    if offset.len() != n || shape.len() != n || (0..n).any(|d| offset[d] + shape[d] > global[d]) {
        return Err(MaskError::Invalid(format!(
            "block at {offset:?} of shape {shape:?} does not fit in the global shape {global:?}"
        )));
    }
    let total: usize = shape.iter().product();
    if n == 0 || total == 0 {
        return Ok(vec![mask_range(key, p, 0, 1)?[0]; total]);
    }
    // Strides of the global shape; the block is a set of runs of shape[n-1] contiguous elements.
    let mut stride = vec![1u64; n];
    for d in (0..n - 1).rev() {
        stride[d] = stride[d + 1] * global[d + 1] as u64;
    }
    let run = shape[n - 1];
    let mut out = Vec::with_capacity(total);
    let mut at = vec![0usize; n - 1]; // position within the block, outer dims
    loop {
        let start: u64 = (0..n - 1)
            .map(|d| (offset[d] + at[d]) as u64 * stride[d])
            .sum::<u64>()
            + offset[n - 1] as u64;
        out.extend(mask_range(key, p, start, run)?);
        // Next outer position, last outer dim fastest.
        let mut d = n - 1;
        loop {
            if d == 0 {
                return Ok(out);
            }
            d -= 1;
            at[d] += 1;
            if at[d] < shape[d] {
                break;
            }
            at[d] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(step: u64, layer: u32, site: Site) -> MaskKey {
        MaskKey::new(1337, step, 0, layer, site).unwrap()
    }

    /// The kept fraction is 1 − p within 3σ (σ = √(p(1−p)/n)) for several p, and the kept
    /// values are 1/(1−p).
    #[test]
    fn kept_fraction_is_one_minus_p_within_three_sigma() {
        let n = 1 << 20;
        for p in [0.1, 0.2, 0.5, 0.9] {
            let m = mask_range(&key(3, 2, Site::MlpResidual), p, 12_345, n).unwrap();
            let kept = m.iter().filter(|&&v| v != 0.0).count() as f64 / n as f64;
            let sigma = (p * (1.0 - p) / n as f64).sqrt();
            assert!(
                (kept - (1.0 - p)).abs() < 3.0 * sigma,
                "p {p}: kept {kept:.5}, expected {:.5} ± {:.5}",
                1.0 - p,
                3.0 * sigma
            );
            let scale = (1.0 / (1.0 - p)) as f32;
            assert!(m.iter().all(|&v| v == 0.0 || v == scale));
        }
        assert!(mask_range(&key(0, 0, Site::Embedding), 0.0, 0, 4096)
            .unwrap()
            .iter()
            .all(|&v| v == 1.0));
    }

    /// Masks differ between steps, micro-batches, layers and sites, and agree with themselves.
    #[test]
    fn masks_differ_between_steps_layers_and_sites() {
        let n = 4096;
        let m = |k: MaskKey| mask_range(&k, 0.5, 0, n).unwrap();
        let base = m(key(7, 1, Site::Attention));
        assert_eq!(
            base,
            m(key(7, 1, Site::Attention)),
            "the same coordinates draw the same mask"
        );
        let others = [
            key(8, 1, Site::Attention),
            MaskKey::new(1337, 7, 1, 1, Site::Attention).unwrap(),
            key(7, 2, Site::Attention),
            key(7, 1, Site::AttentionResidual),
            key(7, 1, Site::MlpResidual),
            MaskKey::new(1338, 7, 0, 1, Site::Attention).unwrap(),
        ];
        for k in others {
            let other = m(k);
            // Independent masks at p = 0.5 agree on half the elements: 2048 ± 32 (1σ).
            let same = base.iter().zip(&other).filter(|(a, b)| a == b).count();
            assert!((1848..2248).contains(&same), "{k:?}: {same} of {n} equal");
        }
    }

    /// A block of the global activation (a TP rank's columns, a DP rank's rows, an SP rank's
    /// positions) draws exactly the elements of the whole activation's mask at those places.
    #[test]
    fn a_shard_draws_its_part_of_the_global_mask() {
        let k = key(2, 3, Site::AttentionResidual);
        let (b, t, c) = (4, 6, 10);
        let full = mask_range(&k, 0.3, 0, b * t * c).unwrap();
        let at = |bi: usize, ti: usize, ci: usize| full[(bi * t + ti) * c + ci];
        for (offset, shape) in [
            ([0, 0, 5], [4, 6, 5]),  // tp 2, rank 1: the second half of the columns
            ([2, 0, 0], [2, 6, 10]), // dp 2, rank 1: the second half of the rows
            ([1, 3, 2], [2, 3, 3]),  // an arbitrary block
        ] {
            let block = mask_block(&k, 0.3, &[b, t, c], &offset, &shape).unwrap();
            let mut want = Vec::new();
            for bi in 0..shape[0] {
                for ti in 0..shape[1] {
                    for ci in 0..shape[2] {
                        want.push(at(offset[0] + bi, offset[1] + ti, offset[2] + ci));
                    }
                }
            }
            assert_eq!(block, want, "block at {offset:?}");
        }
        assert_eq!(keep(&k, 0.3, 17).unwrap(), full[17] != 0.0);
        let e = mask_block(&k, 0.3, &[b, t, c], &[0, 0, 6], &[4, 6, 5]).unwrap_err();
        assert!(e.to_string().contains("does not fit"), "{e}");
    }

    /// A block of (query, key) pairs of the probabilities (a context-parallel rank's queries
    /// against another rank's keys) is the whole (rows, H, T, T) mask at those places.
    #[test]
    fn a_probability_block_is_the_whole_mask_at_its_pairs() {
        let k = key(4, 1, Site::Attention);
        let (rows, heads, t) = (3, 4, 8);
        let m = Mask {
            key: k,
            p: 0.3,
            place: Place {
                global: [rows, heads, t * t],
                offset: [1, 2, 0],
            },
        };
        let full = m.values([2, 2, t * t]).unwrap(); // rows 1.., heads 2..
        let dev = candle_core::Device::Cpu;
        let (q, kk) = ((6, 2), (2, 3));
        let got = m.probs_block((2, 2), t, q, kk, &dev).unwrap();
        assert_eq!(got.dims(), &[2, 2, 2, 3]);
        let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut want = Vec::new();
        for r in 0..2 {
            for j in 0..2 {
                for tq in q.0..q.0 + q.1 {
                    for tk in kk.0..kk.0 + kk.1 {
                        want.push(full[(r * 2 + j) * t * t + tq * t + tk]);
                    }
                }
            }
        }
        assert_eq!(got, want);
        assert!(want.iter().any(|&v| v == 0.0) && want.iter().any(|&v| v != 0.0));
        let e = m.probs_block((2, 2), 7, q, kk, &dev).unwrap_err();
        assert!(e.to_string().contains("not that of a sequence of 7"), "{e}");
    }

    #[test]
    fn bad_coordinates_and_probabilities_are_refused() {
        let e = MaskKey::new(0, 1 << 32, 0, 0, Site::Embedding).unwrap_err();
        assert!(e.to_string().contains("step 4294967296"), "{e}");
        assert!(MaskKey::new(0, 0, 4096, 0, Site::Embedding).is_err());
        assert!(MaskKey::new(0, 0, 0, 4096, Site::Embedding).is_err());
        for p in [1.0, -0.1, f64::NAN] {
            let e = mask_range(&key(0, 0, Site::Embedding), p, 0, 4).unwrap_err();
            assert!(e.to_string().contains("must be in [0, 1)"), "{e}");
        }
    }
}

/// The device's masks against the host's: the elementwise kernel and the attention kernels
/// draw the same generator as [`mask_block`].
#[cfg(all(test, feature = "cuda"))]
mod gpu_tests {
    use super::*;
    use crate::testing::{cuda, rel_err};
    use candle_core::Device;

    fn mask(site: Site, p: f64, place: Place) -> Mask {
        Mask {
            key: MaskKey::new(1337, 41, 2, 3, site).unwrap(),
            p,
            place,
        }
    }

    /// `apply` on the GPU equals `apply` on the CPU bit for bit, in f32 and bf16, for a block
    /// away from the origin of a larger global activation (a dp, sp and column shard at once).
    #[test]
    fn the_kernel_draws_the_cpu_mask_bit_for_bit() {
        let dev = cuda();
        let place = Place {
            global: [8, 96, 200],
            offset: [3, 32, 8],
        };
        for p in [0.1, 0.2, 0.5] {
            let m = mask(Site::MlpResidual, p, place);
            for dtype in [DType::F32, DType::BF16] {
                let x = Tensor::randn(0f32, 1f32, (4, 48, 136), &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let cpu = apply(&x, &m).unwrap();
                let gpu = apply(&x.to_device(&dev).unwrap(), &m)
                    .unwrap()
                    .to_device(&Device::Cpu)
                    .unwrap();
                let (a, b) = (
                    cpu.to_dtype(DType::F32).unwrap().flatten_all().unwrap(),
                    gpu.to_dtype(DType::F32).unwrap().flatten_all().unwrap(),
                );
                let (a, b) = (a.to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
                let differ = a
                    .iter()
                    .zip(&b)
                    .filter(|(x, y)| x.to_bits() != y.to_bits())
                    .count();
                assert_eq!(differ, 0, "p {p} {dtype:?}: {differ} of {} differ", a.len());
                let ones = Tensor::ones((4, 48, 136), DType::F32, &dev).unwrap();
                let drawn = apply(&ones, &m)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>();
                assert_eq!(drawn.unwrap(), m.values([4, 48, 136]).unwrap(), "p {p}");
            }
        }
    }

    /// Attention with dropout on the probabilities: the flash kernels' (tensor-core and
    /// CUDA-core) output and gradients against the CPU path, which multiplies by the mask tensor of [`mask_block`] (f32).
    #[test]
    fn attention_kernels_draw_the_cpu_mask() {
        let dev = cuda();
        for (b, h, t, d, dtype, tol) in [
            (2, 3, 100, 32, DType::F32, 1e-4),  // CUDA cores
            (2, 2, 130, 64, DType::BF16, 2e-2), // tensor cores
            (1, 3, 96, 32, DType::BF16, 2e-2),  // tensor cores
            (1, 2, 70, 128, DType::BF16, 2e-2), // CUDA cores, bf16
            (1, 2, 64, 16, DType::F32, 1e-4),
        ] {
            let place = Place {
                global: [5, 7, t * t],
                offset: [1, 4, 0],
            };
            let m = mask(Site::Attention, 0.2, place);
            let qkv = Tensor::randn(0f32, 1f32, (3, b, h, t, d), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let dy = Tensor::randn(0f32, 1f32, (b, h, t, d), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let scale = 1.0 / (d as f64).sqrt();
            let run = |dev: &Device, dt: DType| {
                let (qkv, dy) = (
                    qkv.to_dtype(dt).unwrap().to_device(dev).unwrap(),
                    dy.to_dtype(dt).unwrap().to_device(dev).unwrap(),
                );
                let (y, lse) = crate::attention::forward(&qkv, scale, Some(&m)).unwrap();
                let g = crate::attention::backward(&qkv, &y, &dy, &lse, scale, Some(&m)).unwrap();
                let cpu = |t: Tensor| {
                    t.to_device(&Device::Cpu)
                        .unwrap()
                        .to_dtype(DType::F32)
                        .unwrap()
                };
                (cpu(y), cpu(g))
            };
            let (y, g) = run(&dev, dtype);
            let (y_ref, g_ref) = run(&Device::Cpu, DType::F32);
            let e = rel_err(&y, &y_ref);
            assert!(e < tol, "forward rel err {e} (T {t}, D {d}, {dtype:?})");
            for i in 0..3 {
                let e = rel_err(&g.get(i).unwrap(), &g_ref.get(i).unwrap());
                assert!(
                    e < tol,
                    "gradient {i} rel err {e} (T {t}, D {d}, {dtype:?})"
                );
            }
            // Without the mask the output differs: the kernels did drop.
            let (y0, _) =
                crate::attention::forward(&qkv.to_device(&dev).unwrap(), scale, None).unwrap();
            let e = rel_err(
                &y0.to_dtype(DType::F32)
                    .unwrap()
                    .to_device(&Device::Cpu)
                    .unwrap(),
                &y_ref,
            );
            assert!(e > 0.1, "the mask changed nothing: {e}");
        }
    }
}
