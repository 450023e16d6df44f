//! AdamW for one tensor: the whole update in one fused kernel (`adamw.cu`), the step that picks it,
//! the same formulas in candle ops ([`plain_update`]) and, for f32 tensors on the CPU, those ops'
//! arithmetic in one pass (`adamw/one_pass.rs`, the same bits).
//!
//! ```text
//!   candle path, per tensor (plain_update)            fused, per tensor
//!   g.to(f32)·clip            cast, scale              adamw_gbf16_copy reads  p, g, m, v
//!   m·β1 + g·(1-β1)           3 kernels                                writes p', m', v', p'_bf16
//!   v·β2 + g²·(1-β2)          4 kernels
//!   √(v/bc2) + ε, m/bc1, ÷    5 kernels                one pass over memory: 4+2+4+4 bytes read,
//!   p·(1-lr·wd) - lr·update   3 kernels                4+4+4+2 written per element
//!   p'.to(bf16)               cast (mixed precision)
//! ```
//!
//! The update is `torch.optim.AdamW`'s as [`plain_update`] writes it, term for term and in the same order
//! (decoupled decay, bias correction, ε added to √v̂), with all arithmetic in f32. The constants
//! (1-β1, 1/(1-β1ᵗ), 1-lr·wd, ...) are computed on the host in f64 and rounded to f32 once, as
//! candle's scalar ops round theirs, so the two paths agree to a few f32 ulps (the kernel may fuse
//! a multiply and an add).
//!
//! The gradient may be f32 or bf16 (two entry points, whatever the model's dtype): a bf16
//! gradient is widened inside the kernel, exactly as `to_dtype(F32)` would. With `bf16_copy`
//! the kernel also writes the new weights rounded to bf16 (nearest even, as candle's cast), the
//! compute copy of mixed-precision training. Every output is a fresh buffer: no tensor that
//! someone else may hold is written.

use candle_core::{DType, Result, Tensor};

use crate::msg;

mod one_pass;
pub use one_pass::step_in_place_cpu;

/// One AdamW step for one tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWHyper {
    /// Learning rate of this step.
    pub lr: f64,
    /// Decay of the first-moment average.
    pub beta1: f64,
    /// Decay of the second-moment average.
    pub beta2: f64,
    /// Added to √v̂.
    pub eps: f64,
    /// Decoupled weight decay of this tensor: 0 for one that is not decayed.
    pub weight_decay: f64,
    /// The step being taken, counted from 1 (t of the bias correction).
    pub step: u64,
    /// What the gradient is multiplied by before the update (the clip coefficient; 1 for none),
    /// in f32 after widening, so clipping costs no pass of its own.
    pub grad_scale: f64,
}

/// The new state of one tensor after [`step`]: `p` in the parameter's dtype, the moments f32.
#[derive(Debug, Clone)]
pub struct AdamWOut {
    /// The updated parameter.
    pub p: Tensor,
    /// The updated first moment.
    pub m: Tensor,
    /// The updated second moment.
    pub v: Tensor,
    /// `p` cast to the dtype asked for (the compute copy of mixed precision), when asked for.
    pub copy: Option<Tensor>,
}

/// The kernel's per-step constants (`AdamwStep` in adamw.cu, field for field).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct AdamWStep {
    beta1: f32,
    one_m_b1: f32,
    beta2: f32,
    one_m_b2: f32,
    inv_bc1: f32,
    inv_bc2: f32,
    eps: f32,
    lr: f32,
    decay: f32,
    gscale: f32,
}

impl AdamWHyper {
    /// The f32 constants the kernel multiplies by, each computed in f64 and rounded once.
    /// Refuses step 0 and betas outside [0, 1), naming the value.
    pub(crate) fn constants(&self) -> Result<AdamWStep> {
        if self.step == 0 {
            return Err(msg(
                "AdamW: step must count from 1 (the bias correction divides by 1 - β^t)".into(),
            ));
        }
        for (what, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(msg(format!("AdamW: {what} must be in [0, 1), got {b}")));
            }
        }
        let t = i32::try_from(self.step)
            .map_err(|_| msg(format!("AdamW: step {} is out of range", self.step)))?;
        Ok(AdamWStep {
            beta1: self.beta1 as f32,
            one_m_b1: (1.0 - self.beta1) as f32,
            beta2: self.beta2 as f32,
            one_m_b2: (1.0 - self.beta2) as f32,
            inv_bc1: (1.0 / (1.0 - self.beta1.powi(t))) as f32,
            inv_bc2: (1.0 / (1.0 - self.beta2.powi(t))) as f32,
            eps: self.eps as f32,
            lr: self.lr as f32,
            decay: (1.0 - self.lr * self.weight_decay) as f32,
            gscale: self.grad_scale as f32,
        })
    }
}

/// Whether [`step`] takes the fused kernel for parameter `p` with gradient `g`: `p` an f32 CUDA
/// tensor, `g` f32 or bf16 on the same device with as many elements (the moments must be f32
/// on that device too). Public so that a test can say which path ran.
pub fn fuses(p: &Tensor, g: &Tensor) -> bool {
    crate::fused_for(p)
        && p.dtype() == DType::F32
        && matches!(g.dtype(), DType::F32 | DType::BF16)
        && g.elem_count() == p.elem_count()
        && g.device().same_device(p.device())
}

/// Factor to multiply every gradient by so the global norm is at most `max_norm`:
/// `min(1, max_norm / (total_norm + 1e-6))` (as `torch.nn.utils.clip_grad_norm_`); 1 when
/// `max_norm <= 0` (clipping off).
pub fn clip_coef(total_norm: f64, max_norm: f64) -> f64 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    (max_norm / (total_norm + 1e-6)).min(1.0)
}

/// [`clip_coef`] of `√sq` (`sq` one f64, the squared global norm) as one f32 on `sq`'s device,
/// the value `clip_coef(sq.sqrt(), max_norm) as f32` bit for bit. On CUDA one launch
/// (`clip_coef_f32` in sq_sum.cu) and no read-back, so [`step_in_place`] can be queued behind
/// the norm; on the CPU the host's value as a tensor.
pub fn clip_coef_on_device(sq: &Tensor, max_norm: f64) -> Result<Tensor> {
    if sq.dtype() != DType::F64 || sq.elem_count() != 1 {
        return Err(msg(format!(
            "clip_coef_on_device: the squared norm must be one f64, got {:?} {:?}",
            sq.dtype(),
            sq.dims()
        )));
    }
    match sq.device() {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) => imp::clip_coef(sq, max_norm),
        dev => {
            let norm = sq.flatten_all()?.to_vec1::<f64>()?[0].sqrt();
            Tensor::new(clip_coef(norm, max_norm) as f32, dev)
        }
    }
}

/// One AdamW step of `p` with gradient `g` (any float dtype, read as f32) and moments `m`, `v`
/// (None on the first step: zeros); with `copy`, also the new `p` cast to that dtype. The
/// fused kernel where it applies (it writes a bf16 copy in the same pass), for f32 CPU tensors
/// the CPU loop, else candle ops with the same formulas. The inputs are only read; every
/// output is a fresh tensor.
pub fn step(
    p: &Tensor,
    g: &Tensor,
    m: Option<&Tensor>,
    v: Option<&Tensor>,
    h: &AdamWHyper,
    copy: Option<DType>,
) -> Result<AdamWOut> {
    let read: Vec<&Tensor> = [Some(p), Some(g), m, v].into_iter().flatten().collect();
    crate::profile::elementwise("adamw", &read, || {
        let state_f32 = [m, v]
            .into_iter()
            .flatten()
            .all(|s| s.dtype() == DType::F32 && s.device().same_device(p.device()));
        let mut out = if state_f32 && fuses(p, g) {
            let (m, v) = moments_or_zeros(p, m, v)?;
            fused(p, g, &m, &v, h, copy == Some(DType::BF16))?
        } else {
            let cpu_loop = crate::cpu::takes(&[p, g]) && crate::cpu::takes(&[m, v].map(|t| t.unwrap_or(p)));
            let (p32, m, v) = match cpu_loop {
                true => one_pass::update(p, g, m, v, h)?,
                false => plain_update(p, g, m, v, h)?,
            };
            AdamWOut {
                p: p32.to_dtype(p.dtype())?,
                m,
                v,
                copy: None,
            }
        };
        if let (Some(dtype), None) = (copy, &out.copy) {
            out.copy = Some(out.p.to_dtype(dtype)?);
        }
        Ok(out)
    })
}

impl crate::profile::Outputs for AdamWOut {
    fn tensors(&self) -> Vec<&Tensor> {
        [Some(&self.p), Some(&self.m), Some(&self.v), self.copy.as_ref()].into_iter().flatten().collect()
    }
}

/// The moments to update: the given ones, or on the first step (None) zeros of `p`'s shape,
/// two storages, so that each may be written in place ((0 · β + 0) + x is x for every x the
/// update makes: its `+ 0` leaves no −0).
fn moments_or_zeros(p: &Tensor, m: Option<&Tensor>, v: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
    match (m, v) {
        (Some(m), Some(v)) => Ok((m.clone(), v.clone())),
        _ => Ok((p.zeros_like()?, p.zeros_like()?)),
    }
}

/// One AdamW update in candle ops, where the fused kernel does not apply (and the reference it
/// is tested against): the new `(p, m, v)`, all f32, from `p` and `g` in any float dtype and
/// the moments (`None`: zero, the first step).
pub fn plain_update(
    p: &Tensor,
    g: &Tensor,
    m: Option<&Tensor>,
    v: Option<&Tensor>,
    h: &AdamWHyper,
) -> Result<(Tensor, Tensor, Tensor)> {
    let t = h.step as i32;
    let (b1, b2) = (h.beta1, h.beta2);
    let bc1 = 1.0 - b1.powi(t);
    let bc2 = 1.0 - b2.powi(t);
    let g = g.to_dtype(DType::F32)?;
    let g = if h.grad_scale == 1.0 {
        g
    } else {
        (g * h.grad_scale)?
    };
    let p32 = p.to_dtype(DType::F32)?;
    let m = match m {
        Some(m) => ((m * b1)? + (&g * (1.0 - b1))?)?,
        None => (&g * (1.0 - b1))?,
    };
    let g2 = g.sqr()?;
    let v = match v {
        Some(v) => ((v * b2)? + (&g2 * (1.0 - b2))?)?,
        None => (&g2 * (1.0 - b2))?,
    };
    let denom = ((&v / bc2)?.sqrt()? + h.eps)?;
    let update = ((&m / bc1)? / denom)?;
    let decayed = if h.weight_decay != 0.0 {
        (&p32 * (1.0 - h.lr * h.weight_decay))?
    } else {
        p32
    };
    let new_p = (decayed - (update * h.lr)?)?;
    Ok((new_p, m, v))
}

/// One AdamW step of `p` with gradient `g` and moments `m`, `v` (zeros on the first step), in
/// one kernel; with `bf16_copy` also the new `p` in bf16. The outputs have `p`'s shape and are
/// fresh tensors; the inputs are only read. CUDA only: see [`fuses`].
pub(crate) fn fused(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    h: &AdamWHyper,
    bf16_copy: bool,
) -> Result<AdamWOut> {
    let n = p.elem_count();
    for (what, t) in [("parameter", p), ("first moment", m), ("second moment", v)] {
        if t.dtype() != DType::F32 {
            return Err(msg(format!(
                "adamw: the {what} must be f32, got {:?}",
                t.dtype()
            )));
        }
    }
    if !matches!(g.dtype(), DType::F32 | DType::BF16) {
        return Err(msg(format!(
            "adamw: the gradient must be f32 or bf16, got {:?}",
            g.dtype()
        )));
    }
    for (what, t) in [("gradient", g), ("first moment", m), ("second moment", v)] {
        if t.elem_count() != n {
            return Err(msg(format!(
                "adamw: the {what} has shape {:?} but the parameter has {:?}",
                t.dims(),
                p.dims()
            )));
        }
    }
    let s = h.constants()?;
    if n == 0 {
        let copy = match bf16_copy {
            true => Some(p.to_dtype(DType::BF16)?),
            false => None,
        };
        let (m, v) = (m.reshape(p.shape())?, v.reshape(p.shape())?);
        return Ok(AdamWOut {
            p: p.clone(),
            m,
            v,
            copy,
        });
    }
    launch(p, g, m, v, s, bf16_copy)
}

#[cfg(not(feature = "cuda"))]
fn launch(
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: AdamWStep,
    _: bool,
) -> Result<AdamWOut> {
    Err(msg(
        "the fused adamw runs on CUDA only; the CPU path is adamw::plain_update".into(),
    ))
}

#[cfg(feature = "cuda")]
fn launch(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    s: AdamWStep,
    bf16_copy: bool,
) -> Result<AdamWOut> {
    use imp::update;
    let (p, g, m, v) = (
        p.contiguous()?,
        g.contiguous()?,
        m.contiguous()?,
        v.contiguous()?,
    );
    let dtype = g.dtype();
    super::cuda::by_dtype!(
        "adamw gradient",
        dtype,
        update(&p, &g, &m, &v, s, bf16_copy)
    )
}

#[cfg(feature = "cuda")]
mod imp {
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{DType, Result, Tensor};

    use super::super::cuda::{blocks, device, grid_stride, kernel, slice, storage, tensor};
    use super::{AdamWOut, AdamWStep};

    // SAFETY: AdamWStep is #[repr(C)] with ten f32 fields, the layout of `struct AdamwStep` in
    // adamw.cu (40 bytes, 4-byte aligned), passed by value as a kernel parameter.
    unsafe impl DeviceRepr for AdamWStep {}

    /// `clip_coef_f32` (sq_sum.cu) of the one f64 in `sq`, into a fresh one-element f32.
    pub fn clip_coef(sq: &Tensor, max_norm: f64) -> Result<Tensor> {
        let dev = device(sq)?;
        let (st, off) = storage(sq, "clip_coef squared norm")?;
        let sqs = slice::<f64>(&st)?.slice(off..);
        // SAFETY: the kernel's one thread writes the one element.
        let mut coef = unsafe { dev.alloc::<f32>(1)? };
        let f = kernel(&dev, None, DType::F32, "clip_coef_f32")?;
        let mut b = f.builder();
        b.arg(&sqs).arg(&max_norm).arg(&mut coef);
        // SAFETY: (const double* sq, double max_norm, float* coef) as in sq_sum.cu; `sqs` holds
        // the one f64 from its offset, `coef` one f32.
        unsafe { b.launch(blocks((1, 1), 32)) }.w()?;
        drop(sqs);
        drop(st);
        Ok(tensor(&dev, coef, ()))
    }

    /// Launches the entry point for gradient type `G` (f32 or bf16), with or without the copy.
    pub fn update<G: CudaDType + DeviceRepr>(
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
        s: AdamWStep,
        bf16_copy: bool,
    ) -> Result<AdamWOut> {
        let dev = device(p)?;
        let n = p.elem_count();
        let (sp, op) = storage(p, "AdamW parameter")?;
        let (sg, og) = storage(g, "AdamW gradient")?;
        let (sm, om) = storage(m, "AdamW first moment")?;
        let (sv, ov) = storage(v, "AdamW second moment")?;
        let ps = slice::<f32>(&sp)?.slice(op..);
        let gs = slice::<G>(&sg)?.slice(og..);
        let ms = slice::<f32>(&sm)?.slice(om..);
        let vs = slice::<f32>(&sv)?.slice(ov..);
        // SAFETY: every element of every output is written by the kernel's grid-stride loops.
        let (p_out, m_out, v_out) = unsafe {
            (
                dev.alloc::<f32>(n)?,
                dev.alloc::<f32>(n)?,
                dev.alloc::<f32>(n)?,
            )
        };
        let p16 = match bf16_copy {
            // SAFETY: as above.
            true => Some(unsafe { dev.alloc::<half::bf16>(n)? }),
            false => None,
        };
        let name = match (g.dtype(), bf16_copy) {
            (DType::BF16, false) => "adamw_gbf16",
            (DType::BF16, true) => "adamw_gbf16_copy",
            (_, false) => "adamw_g32",
            (_, true) => "adamw_g32_copy",
        };
        // The entry points do not depend on ELEM_BF16; load them from the bf16 instantiation
        // when the run computes in bf16 (already compiled for its layers), else the f32 one.
        let module = match g.dtype() == DType::BF16 || bf16_copy {
            true => DType::BF16,
            false => DType::F32,
        };
        let f = kernel(&dev, None, module, name)?;
        let n64 = n as i64;
        let mut b = f.builder();
        b.arg(&ps).arg(&gs).arg(&ms).arg(&vs);
        b.arg(&p_out).arg(&m_out).arg(&v_out);
        if let Some(c) = &p16 {
            b.arg(c);
        }
        b.arg(&n64).arg(&s);
        // SAFETY: argument types and order match the entry point `name` in adamw.cu; the inputs
        // hold n elements from their offsets, the outputs n elements.
        unsafe { b.launch(grid_stride(n.div_ceil(4))) }.w()?;
        drop((ps, gs, ms, vs));
        drop((sp, sg, sm, sv));
        let shape = p.shape().clone();
        Ok(AdamWOut {
            p: tensor(&dev, p_out, shape.clone()),
            m: tensor(&dev, m_out, shape.clone()),
            v: tensor(&dev, v_out, shape.clone()),
            copy: p16.map(|c| tensor(&dev, c, shape)),
        })
    }
}

/// One tensor of a [`step_in_place`] launch: the parameter, its gradient and moments, and the
/// compute copy to refresh (None: no copy).
#[derive(Debug, Clone, Copy)]
pub struct InPlace<'a> {
    /// The parameter (f32), updated in place.
    pub p: &'a Tensor,
    /// Its gradient, f32 or bf16 (the same dtype for every tensor of the launch).
    pub g: &'a Tensor,
    /// First moment (f32), updated in place.
    pub m: &'a Tensor,
    /// Second moment (f32), updated in place.
    pub v: &'a Tensor,
    /// The bf16 compute copy of `p`, written in place (Some for every tensor or for none).
    pub copy: Option<&'a Tensor>,
    /// This tensor's decoupled weight decay (0: not decayed); `AdamWHyper::weight_decay` is
    /// not used by [`step_in_place`].
    pub weight_decay: f64,
}

/// Whether [`step_in_place`] takes `items`: every tensor on one CUDA device and contiguous;
/// `p`, `m`, `v` f32 with `p`'s element count; the gradients all f32 or all bf16; a bf16 copy for
/// every tensor or for none. Public so that a caller can fall back to [`step`] otherwise.
pub fn fuses_in_place(items: &[InPlace]) -> bool {
    let Some(first) = items.first() else {
        return false;
    };
    let dev = first.p.device();
    let gdtype = first.g.dtype();
    let with_copy = first.copy.is_some();
    items.iter().all(|it| {
        let n = it.p.elem_count();
        let f32_like = |t: &Tensor| {
            crate::fused_for(t)
                && t.dtype() == DType::F32
                && t.elem_count() == n
                && t.is_contiguous()
                && t.device().same_device(dev)
        };
        f32_like(it.p)
            && f32_like(it.m)
            && f32_like(it.v)
            && crate::fused_for(it.g)
            && it.g.dtype() == gdtype
            && it.g.elem_count() == n
            && it.g.is_contiguous()
            && it.g.device().same_device(dev)
            && n > 0
            && it.copy.is_some() == with_copy
            && it.copy.is_none_or(|c| {
                c.dtype() == DType::BF16
                    && c.elem_count() == n
                    && c.is_contiguous()
                    && c.device().same_device(dev)
            })
    })
}

/// One AdamW step of every tensor of `items` in one kernel launch (PyTorch's fused AdamW does
/// the same), writing the new `p`, `m`, `v` and the bf16 copy into the tensors' own storage: no
/// allocation, no copy afterwards, one launch and a table of 64 bytes per tensor instead of a
/// launch, four fresh outputs and two copies per tensor. The arithmetic is [`step`]'s, element
/// for element (`h`'s weight decay is replaced by each item's).
///
/// The tensors must be what [`fuses_in_place`] accepts; anything else is an error.
///
/// # Safety
/// `p`, `m`, `v` and `copy` are written in place, so no one may hold them as values that stay
/// unchanged: they must be the storage of a `Var` (which `Var::set` overwrites the same way) or
/// state the optimizer owns alone, and none of them may share storage with another tensor of
/// the launch.
///
/// With `scale` (a one-element f32 tensor on the parameters' device, e.g. from
/// [`clip_coef_on_device`]), every gradient is also multiplied by its value, read by the kernel:
/// the host launches the step without waiting for the number.
pub unsafe fn step_in_place(
    items: &[InPlace],
    h: &AdamWHyper,
    scale: Option<&Tensor>,
) -> Result<()> {
    if !fuses_in_place(items) {
        return Err(msg(
            "adamw::step_in_place: the tensors are not all contiguous CUDA f32 parameters and \
             moments with f32 or bf16 gradients of one dtype (see fuses_in_place)"
                .into(),
        ));
    }
    let s = h.constants()?;
    let decays = items
        .iter()
        .map(|it| (1.0 - h.lr * it.weight_decay) as f32)
        .collect::<Vec<_>>();
    if let Some(c) = scale {
        let ok = c.dtype() == DType::F32
            && c.elem_count() == 1
            && c.device().same_device(items[0].p.device());
        if !ok {
            return Err(msg(format!(
                "adamw::step_in_place: the gradient scale must be one f32 on the parameters' \
                 device, got {:?} {:?} on {:?}",
                c.dtype(),
                c.dims(),
                c.device()
            )));
        }
    }
    crate::profile::op(items[0].p.device(), || launch_in_place(items, &decays, s, scale), |_| {
        let per = crate::profile::per_element("adamw");
        let each = items.iter().map(|it| {
            let written: Vec<&Tensor> = [it.p, it.m, it.v].into_iter().chain(it.copy).collect();
            crate::profile::Cost::elementwise(per, it.p, &[it.p, it.g, it.m, it.v], &written)
        });
        ("adamw".into(), each.sum())
    })
}

#[cfg(not(feature = "cuda"))]
fn launch_in_place(_: &[InPlace], _: &[f32], _: AdamWStep, _: Option<&Tensor>) -> Result<()> {
    Err(msg("the in-place adamw runs on CUDA only".into()))
}

#[cfg(feature = "cuda")]
fn launch_in_place(
    items: &[InPlace],
    decays: &[f32],
    s: AdamWStep,
    scale: Option<&Tensor>,
) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;

    use super::cuda::{blocks, device, kernel, slice, storage};

    /// Elements one block updates (ADAMW_CHUNK in adamw.cu).
    const CHUNK: usize = 65536;
    let dev = device(items[0].p)?;
    let stream = dev.cuda_stream();
    // The device address of element 0 of a contiguous tensor, its storage held while the
    // launch is enqueued.
    fn addr<'t>(
        t: &'t Tensor,
        what: &str,
        stream: &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
        guards: &mut Vec<candle_core::StorageRef<'t>>,
    ) -> Result<u64> {
        let (st, off) = storage(t, what)?;
        let a = match t.dtype() {
            DType::BF16 => slice::<half::bf16>(&st)?.device_ptr(stream).0 + 2 * off as u64,
            _ => slice::<f32>(&st)?.device_ptr(stream).0 + 4 * off as u64,
        };
        guards.push(st);
        Ok(a)
    }
    let mut guards = Vec::with_capacity(5 * items.len());
    let mut addr = |t, what| addr(t, what, &stream, &mut guards);
    // AdamwSlot, eight 64-bit words per tensor (the decay's f32 bits in the low half of the last).
    let mut table: Vec<u64> = Vec::with_capacity(8 * items.len());
    let mut chunks = 0usize;
    for (it, decay) in items.iter().zip(decays) {
        let n = it.p.elem_count();
        table.push(addr(it.p, "adamw parameter")?);
        table.push(addr(it.m, "adamw first moment")?);
        table.push(addr(it.v, "adamw second moment")?);
        table.push(addr(it.g, "adamw gradient")?);
        table.push(match it.copy {
            Some(c) => addr(c, "adamw compute copy")?,
            None => 0,
        });
        table.push(n as u64);
        table.push(chunks as u64);
        table.push(decay.to_bits() as u64);
        chunks += n.div_ceil(CHUNK);
    }
    let scale_at = match scale {
        Some(c) => addr(c, "adamw gradient scale")?,
        None => 0,
    };
    let slots = dev.clone_htod(&table)?;
    let name = match items[0].g.dtype() {
        DType::BF16 => "adamw_multi_gbf16",
        _ => "adamw_multi_g32",
    };
    // The entry points do not depend on ELEM_BF16: load them from the instantiation the run's
    // gradients already compiled.
    let f = kernel(&dev, None, items[0].g.dtype(), name)?;
    let count = items.len() as i32;
    let mut b = f.builder();
    b.arg(&slots).arg(&count).arg(&s).arg(&scale_at);
    // SAFETY: (const AdamwSlot* slots, int count, AdamwStep s, const float* scale) as in
    // adamw.cu; every slot's addresses hold n elements of the dtypes fuses_in_place checked,
    // `scale_at` is 0 or one f32 (checked above); one block per chunk.
    unsafe { b.launch(blocks((chunks, 1), 256)) }.w()?;
    drop(guards);
    Ok(())
}

#[cfg(test)]
mod host_tests {
    use super::*;

    /// The constants are the f64 expressions rounded once, and bad hyper-parameters are named.
    #[test]
    fn constants_are_rounded_once_and_checked() -> Result<()> {
        let h = AdamWHyper {
            lr: 3e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 3,
            grad_scale: 1.0,
        };
        let s = h.constants()?;
        assert_eq!(s.one_m_b1, (1.0f64 - 0.9) as f32);
        assert_eq!(s.inv_bc2, (1.0 / (1.0 - 0.95f64.powi(3))) as f32);
        assert_eq!(s.decay, (1.0 - 3e-4 * 0.1f64) as f32);
        let e = AdamWHyper { step: 0, ..h }.constants().unwrap_err();
        assert!(e.to_string().contains("from 1"), "{e}");
        let e = AdamWHyper { beta2: 1.0, ..h }.constants().unwrap_err();
        assert!(
            e.to_string().contains("beta2 must be in [0, 1), got 1"),
            "{e}"
        );
        Ok(())
    }

    /// On the CPU the fused path is never chosen, and calling it says where the CPU path is.
    #[test]
    fn cpu_tensors_take_the_candle_path() -> Result<()> {
        let dev = candle_core::Device::Cpu;
        let p = Tensor::zeros(8, DType::F32, &dev)?;
        let g = Tensor::zeros(8, DType::BF16, &dev)?;
        assert!(!fuses(&p, &g));
        let h = AdamWHyper {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
            step: 1,
            grad_scale: 1.0,
        };
        let bad = Tensor::zeros(7, DType::F32, &dev)?;
        let e = fused(&p, &g, &bad, &p, &h, false).unwrap_err();
        assert!(e.to_string().contains("first moment has shape [7]"), "{e}");
        Ok(())
    }
}

/// `clip_coef_on_device` gives `clip_coef(√sq) as f32` bit for bit (norms under, at and over
/// the limit, zero, infinity, NaN, clipping off) on the CPU and, where there is one, on CUDA;
/// what is not one f64 is refused.
#[cfg(test)]
mod clip_tests;

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests;
