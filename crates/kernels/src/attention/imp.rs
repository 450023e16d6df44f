//! The CUDA launches of the flash kernels ([`super`] says which kernels and why): shapes,
//! buffers and argument lists; the kernels themselves are CUDA source (`kernels.cu`,
//! `flash_wide.cu`, `flash_hopper.cu`).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView};
use candle_core::{CudaDevice, CudaStorage, Layout, Result, Tensor, WithDType};

use super::super::attention_path::{hopper_shapes, HopperShape, HopperShapes};
use super::super::cuda::Kernel;
use super::super::cuda::{
    blocks, by_dtype, compute_capability, device, kernel, slice, storage, tensor, view,
};
use super::super::dropout::{attn_drop, Mask};
use super::super::msg;
use super::{path, Path, TcKernels};

const BR: usize = 64;
const LOG2E: f64 = std::f64::consts::LOG2_E;

/// Where the rows of a (B·H, T, D) operand lie (`HeadRows` in kernels.cu): row t of head bh
/// starts at element (bh / heads)·batch + (bh % heads)·head + t·row of the pointer given.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HeadRows {
    batch: i64,
    head: i64,
    row: i32,
    heads: i32,
}

// SAFETY: #[repr(C)] plain integers, the layout of kernels.cu's HeadRows.
unsafe impl DeviceRepr for HeadRows {}

impl HeadRows {
    /// Heads stored apart: (B·H, T, D) contiguous.
    fn apart(t: usize, d: usize) -> Self {
        Self {
            batch: (t * d) as i64,
            head: 0,
            row: d as i32,
            heads: 1,
        }
    }

    /// The tokens' layout: part s of (B, T, S·H·D), the pointer at its first element.
    fn tokens(t: usize, s: usize, h: usize, d: usize) -> Result<Self> {
        let row = s * h * d;
        if t.saturating_mul(row) >= i32::MAX as usize {
            return Err(msg(format!(
                "flash attention: T = {t} rows of {row} elements pass 2³¹ (the kernels' row index)"
            )));
        }
        Ok(Self {
            batch: (t * row) as i64,
            head: d as i64,
            row: row as i32,
            heads: h as i32,
        })
    }
}

/// The layouts of one call: q, k, v and their gradients (`input`), o and dO (`output`).
#[derive(Clone, Copy, Debug)]
struct Rows {
    input: HeadRows,
    output: HeadRows,
}

fn config(t: usize, bh: usize, d: usize) -> LaunchConfig {
    let split = d / d.min(32);
    blocks((t.div_ceil(BR), bh), BR * split)
}

/// The tensor-core kernels: 4 warps own 64 rows (TC_ROWS in kernels.cu).
fn tc_config(t: usize, bh: usize) -> LaunchConfig {
    blocks((t.div_ceil(64), bh), 128)
}

/// The wide kernels: 4 warps own 128 rows at D <= 64, 64 at D = 128 (WD_ROWS in
/// flash_wide.cu).
fn wide_config(t: usize, bh: usize, d: usize) -> LaunchConfig {
    let rows = if d <= 64 { 128 } else { 64 };
    blocks((t.div_ceil(rows), bh), 128)
}

/// A Hopper kernel of `shape` with `smem` bytes of dynamic shared memory (its layout's
/// HP_*_SMEM in flash_hopper.cu, which the kernel checks), allowed on `f`.
fn hopper_config(
    f: &Kernel,
    shape: HopperShape,
    t: usize,
    bh: usize,
    smem: usize,
) -> Result<LaunchConfig> {
    f.allow_dynamic_smem(smem)?;
    Ok(LaunchConfig {
        shared_mem_bytes: smem as u32,
        ..blocks((t.div_ceil(shape.rows()), bh), shape.threads())
    })
}

/// Bytes of a staged (rows, d) bf16 tile.
fn tile(rows: usize, d: usize) -> usize {
    rows * d * 2
}

/// The shapes of the Hopper kernels at head size `d`; an error where they do not take it.
fn hopper_shapes_of(d: usize) -> Result<HopperShapes> {
    hopper_shapes(d)
        .ok_or_else(|| msg(format!("the Hopper attention kernels take no head size {d}")))
}

/// The dynamic shared memory of the four Hopper kernels (HP_FWD_SMEM, HP_DQ_SMEM,
/// HP_DKDV_SMEM and HP_BWD_SMEM) of `shapes` at head size `d`: their tiles plus 1 KiB to
/// align the first to 1024 bytes.
fn hopper_smem(shapes: HopperShapes, d: usize) -> [usize; 4] {
    let fwd = tile(shapes.fwd.rows(), d) + 4 * tile(shapes.fwd_keys, d);
    let dq = 2 * tile(shapes.dq.rows(), d) + 4 * tile(64, d);
    let dkdv = 2 * tile(shapes.dkdv.rows(), d) + 4 * tile(64, d) + 4 * 64 * 4;
    // Per warpgroup K, V, 2 Q, 2 dO, 2 dSᵀ tiles and lse2, δ; a zero tile; two counters and
    // two owners.
    let bwd = shapes.bwd.warpgroups * (8 * tile(64, d) + 4 * 64 * 4) + tile(64, d) + 16;
    [fwd + 1024, dq + 1024, dkdv + 1024, bwd + 1024]
}

fn dims(l: &Layout, what: &str) -> Result<(usize, usize, usize)> {
    let (b, h, t, d) = l.shape().dims4()?;
    if !l.is_contiguous() {
        return Err(msg(format!(
            "flash_attention: {what} {:?} is not contiguous",
            l.dims()
        )));
    }
    Ok((b * h, t, d))
}

#[allow(clippy::too_many_arguments)]
pub fn forward(
    q: &CudaStorage,
    lq: &Layout,
    k: &CudaStorage,
    lk: &Layout,
    v: &CudaStorage,
    lv: &Layout,
    scale: f64,
    kernels: TcKernels,
    dropout: Option<&Mask>,
) -> Result<(CudaStorage, Tensor)> {
    let (bh, t, d) = dims(lq, "q")?;
    if dims(lk, "k")? != (bh, t, d) || dims(lv, "v")? != (bh, t, d) {
        return Err(msg(format!(
            "flash_attention: q {:?}, k {:?}, v {:?} differ",
            lq.dims(),
            lk.dims(),
            lv.dims()
        )));
    }
    by_dtype!(
        "flash_attention",
        q.dtype(),
        fwd(q, lq, k, lk, v, lv, (bh, t, d), scale, kernels, dropout)
    )
}

#[allow(clippy::too_many_arguments)]
fn fwd<T: CudaDType + DeviceRepr + WithDType>(
    q: &CudaStorage,
    lq: &Layout,
    k: &CudaStorage,
    lk: &Layout,
    v: &CudaStorage,
    lv: &Layout,
    (bh, t, d): (usize, usize, usize),
    scale: f64,
    kernels: TcKernels,
    dropout: Option<&Mask>,
) -> Result<(CudaStorage, Tensor)> {
    let dev = &q.device;
    let hl = lq.shape().dims4()?.1;
    let offsets = [lq.start_offset(), lk.start_offset(), lv.start_offset()];
    let kernels = kernels.for_mask(dropout.is_some());
    let path = path(q.dtype(), d, &offsets, compute_capability(dev)?, kernels);
    let parts = [view::<T>(q, lq)?, view::<T>(k, lk)?, view::<T>(v, lv)?];
    let apart = HeadRows::apart(t, d);
    let rows = Rows {
        input: apart,
        output: apart,
    };
    let (o, lse) = fwd_launch(dev, &parts, (bh, hl, t, d), rows, path, scale, dropout)?;
    Ok((CudaStorage::wrap_cuda_slice(o, dev.clone()), lse))
}

/// The forward of `qkv` (B, T, 3·H·D), the c_attn output, read in place by the Hopper kernels
/// (the caller checks [`takes_tokens`]): the output (B, T, H·D), ready for c_proj, and lse2
/// (B·H, T).
pub fn forward_tokens(qkv: &Tensor, h: usize, scale: f64) -> Result<(Tensor, Tensor)> {
    let (b, t, f) = qkv.dims3()?;
    let d = f / (3 * h);
    let dev = device(qkv)?;
    let (st, off) = storage(qkv, "qkv")?;
    let all = slice::<half::bf16>(&st)?;
    let hd = h * d;
    let parts = [all.slice(off..), all.slice(off + hd..), all.slice(off + 2 * hd..)];
    let rows = Rows {
        input: HeadRows::tokens(t, 3, h, d)?,
        output: HeadRows::tokens(t, 1, h, d)?,
    };
    let (o, lse) = fwd_launch(&dev, &parts, (b * h, h, t, d), rows, Path::Hopper, scale, None)?;
    Ok((tensor(&dev, o, (b, t, hd)), lse))
}

/// Whether [`forward_tokens`] and [`backward_tokens`] take `qkv` (B, T, 3·H·D) with `h` heads:
/// the Hopper path for its dtype, head size and device, no dropout mask.
pub fn takes_tokens(qkv: &Tensor, h: usize, kernels: TcKernels, masked: bool) -> Result<bool> {
    let (_, _, f) = qkv.dims3()?;
    if masked || h == 0 || f % (3 * h) != 0 || !qkv.is_contiguous() {
        return Ok(false);
    }
    let (d, hd) = (f / (3 * h), f / 3);
    let Ok(dev) = device(qkv) else {
        return Ok(false);
    };
    let (_, off) = qkv.layout().contiguous_offsets().unwrap_or((0, 0));
    let offsets = [off, off + hd, off + 2 * hd];
    Ok(path(qkv.dtype(), d, &offsets, compute_capability(&dev)?, kernels) == Path::Hopper)
}

/// One forward launch on `path` over q, k, v `parts` laid out by `rows.input`, into a fresh
/// output laid out by `rows.output` (B·H·T·D elements) and lse2 (B·H, T). `hl` is H.
fn fwd_launch<T: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    parts: &[CudaView<'_, T>; 3],
    (bh, hl, t, d): (usize, usize, usize, usize),
    rows: Rows,
    path: Path,
    scale: f64,
    dropout: Option<&Mask>,
) -> Result<(CudaSlice<T>, Tensor)> {
    let n = bh * t * d;
    // SAFETY: every element of o and lse is written by the kernel (each valid row).
    let o = unsafe { dev.alloc::<T>(n)? };
    let lse = unsafe { dev.alloc::<f32>(bh * t)? };
    let name = match path {
        Path::Hopper => "flash_hopper_fwd",
        Path::Wide => "flash_wide_fwd",
        Path::Tc => "flash_tc_fwd",
        Path::Cuda => "flash_fwd",
    };
    let ad = attn_drop(dropout, hl)?;
    let f = kernel(dev, Some(d), T::DTYPE, name)?;
    let cfg = match path {
        Path::Hopper => {
            let s = hopper_shapes_of(d)?;
            hopper_config(&f, s.fwd, t, bh, hopper_smem(s, d)[0])?
        }
        Path::Wide => wide_config(t, bh, d),
        Path::Tc => tc_config(t, bh),
        Path::Cuda => config(t, bh, d),
    };
    let (t32, qscale) = (t as i32, (scale * LOG2E) as f32);
    let mut b = f.builder();
    b.arg(&parts[0])
        .arg(&parts[1])
        .arg(&parts[2])
        .arg(&o)
        .arg(&lse)
        .arg(&t32)
        .arg(&qscale);
    if path == Path::Hopper {
        b.arg(&rows.input).arg(&rows.output);
    }
    if path.draws_mask() {
        b.arg(&ad);
    }
    // SAFETY: argument types and order match `flash_fwd`, `flash_tc_fwd` (kernels.cu, with
    // the mask last), `flash_wide_fwd` and `flash_hopper_fwd` (the layouts last, no mask).
    unsafe { b.launch(cfg) }.w()?;
    Ok((o, tensor(dev, lse, (bh, t))))
}

#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
    scale: f64,
    kernels: TcKernels,
    dropout: Option<&Mask>,
) -> Result<Tensor> {
    by_dtype!(
        "flash_attention",
        q.dtype(),
        bwd(q, k, v, out, grad_out, lse, scale, kernels, dropout)
    )
}

#[allow(clippy::too_many_arguments)]
fn bwd<T: CudaDType + DeviceRepr + WithDType>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
    scale: f64,
    kernels: TcKernels,
    dropout: Option<&Mask>,
) -> Result<Tensor> {
    let dev = device(q)?;
    let (b_, h, t, d) = q.dims4()?;
    let (gq, oq) = storage(q, "q")?;
    let (gk, ok) = storage(k, "k")?;
    let (gv, ov) = storage(v, "v")?;
    let (go, oo) = storage(out, "out")?;
    let (gd, od) = storage(grad_out, "grad_out")?;
    let (gl, ol) = storage(lse, "lse")?;
    let parts = [
        slice::<T>(&gq)?.slice(oq..),
        slice::<T>(&gk)?.slice(ok..),
        slice::<T>(&gv)?.slice(ov..),
    ];
    let os = slice::<T>(&go)?.slice(oo..);
    let ds = slice::<T>(&gd)?.slice(od..);
    let ls = slice::<f32>(&gl)?.slice(ol..);
    let kernels = kernels.for_mask(dropout.is_some());
    let path = path(T::DTYPE, d, &[oq, ok, ov, oo, od], compute_capability(&dev)?, kernels);
    let apart = HeadRows::apart(t, d);
    let rows = Rows {
        input: apart,
        output: apart,
    };
    // One buffer (3, B, H, T, D) for dq | dk | dv, so a packed input gets one gradient.
    let n = b_ * h * t * d;
    let call = BwdCall {
        dims: (b_ * h, h, t, d),
        rows,
        path,
        kernels,
        scale,
        dropout,
    };
    let dqkv = bwd_launch(&dev, &parts, [&os, &ds], &ls, [0, n, 2 * n], call)?;
    Ok(tensor(&dev, dqkv, (3, b_, h, t, d)))
}

/// The gradient (B, T, 3·H·D) of [`forward_tokens`] from its input `qkv`, output `y` and the
/// output's gradient `dy` (both (B, T, H·D)) and lse2, dq | dk | dv written in the tokens'
/// layout (c_attn's backward takes it as it is).
pub fn backward_tokens(
    qkv: &Tensor,
    y: &Tensor,
    dy: &Tensor,
    lse: &Tensor,
    h: usize,
    scale: f64,
) -> Result<Tensor> {
    let (b, t, f) = qkv.dims3()?;
    let (d, hd) = (f / (3 * h), f / 3);
    let dev = device(qkv)?;
    let (gq, oq) = storage(qkv, "qkv")?;
    let (go, oo) = storage(y, "y")?;
    let (gd, od) = storage(dy, "dy")?;
    let (gl, ol) = storage(lse, "lse")?;
    let all = slice::<half::bf16>(&gq)?;
    let parts = [all.slice(oq..), all.slice(oq + hd..), all.slice(oq + 2 * hd..)];
    let os = slice::<half::bf16>(&go)?.slice(oo..);
    let ds = slice::<half::bf16>(&gd)?.slice(od..);
    let ls = slice::<f32>(&gl)?.slice(ol..);
    let call = BwdCall {
        dims: (b * h, h, t, d),
        rows: Rows {
            input: HeadRows::tokens(t, 3, h, d)?,
            output: HeadRows::tokens(t, 1, h, d)?,
        },
        path: Path::Hopper,
        kernels: TcKernels::from_env(),
        scale,
        dropout: None,
    };
    let dqkv = bwd_launch(&dev, &parts, [&os, &ds], &ls, [0, hd, 2 * hd], call)?;
    Ok(tensor(&dev, dqkv, (b, t, f)))
}

/// What one backward launches besides its buffers: (B·H, H, T, D), the layouts, the kernels.
struct BwdCall<'a> {
    dims: (usize, usize, usize, usize),
    rows: Rows,
    path: Path,
    kernels: TcKernels,
    scale: f64,
    dropout: Option<&'a Mask>,
}

/// δ, then dq, dk, dv on `call.path` into one fresh buffer of 3·B·H·T·D elements, part i
/// (laid out by `rows.input`) from element `at[i]`: the inputs q, k, v `parts`, o and dO
/// (`od`, laid out by `rows.output`) and lse2.
fn bwd_launch<T: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    parts: &[CudaView<'_, T>; 3],
    [os, ds]: [&CudaView<'_, T>; 2],
    ls: &CudaView<'_, f32>,
    at: [usize; 3],
    call: BwdCall<'_>,
) -> Result<CudaSlice<T>> {
    let BwdCall {
        dims: (bh, h, t, d),
        rows,
        path,
        kernels,
        scale,
        dropout,
    } = call;
    let [qs, ks, vs] = parts;
    let n = bh * t * d;
    let dtype = T::DTYPE;
    let (dq_name, dkdv_name) = match path {
        Path::Hopper => ("flash_hopper_dq", "flash_hopper_dkdv"),
        Path::Wide => ("flash_wide_dq", "flash_wide_dkdv"),
        Path::Tc => ("flash_tc_dq", "flash_tc_dkdv"),
        Path::Cuda => ("flash_bwd_dq", "flash_bwd_dkdv"),
    };
    // The launch of dq (shape 0) or dkdv (shape 1) on `f`.
    let cfg = |f: &Kernel, which: usize| match path {
        Path::Hopper => {
            let s = hopper_shapes_of(d)?;
            hopper_config(f, [s.dq, s.dkdv][which], t, bh, hopper_smem(s, d)[1 + which])
        }
        Path::Wide => Ok(wide_config(t, bh, d)),
        Path::Tc => Ok(tc_config(t, bh)),
        Path::Cuda => Ok(config(t, bh, d)),
    };
    let ad = attn_drop(dropout, h)?;
    // SAFETY: every element of each buffer is written by the kernel filling it.
    let delta = unsafe { dev.alloc::<f32>(bh * t)? };
    let dqkv = unsafe { dev.alloc::<T>(3 * n)? };
    let (dq, dk, dv) = (dqkv.slice(at[0]..), dqkv.slice(at[1]..), dqkv.slice(at[2]..));
    let rows64 = (bh * t) as i64;
    let t32 = t as i32;
    let f = kernel(dev, Some(d), dtype, "flash_bwd_dot")?;
    let mut b = f.builder();
    b.arg(os).arg(ds).arg(&delta).arg(&rows64).arg(&t32).arg(&rows.output);
    // Eight threads per row, blocks of 256 (a whole number of rows and warps).
    let dot_cfg = blocks(((bh * t * 8).div_ceil(256), 1), 256);
    // SAFETY: argument types and order match `flash_bwd_dot`.
    unsafe { b.launch(dot_cfg) }.w()?;

    let (qscale, scale32) = ((scale * LOG2E) as f32, scale as f32);
    if path == Path::Hopper && kernels.one_pass() {
        // dk, dv and dq (into f32, then bf16) in one pass.
        let acc = dev.alloc_zeros::<f32>(n)?;
        let f = kernel(dev, Some(d), dtype, "flash_hopper_bwd")?;
        let mut b = f.builder();
        b.arg(qs).arg(ks).arg(vs).arg(ds).arg(ls).arg(&delta).arg(&acc);
        b.arg(&dk).arg(&dv).arg(&t32).arg(&qscale).arg(&scale32);
        b.arg(&rows.input).arg(&rows.output);
        let s = hopper_shapes_of(d)?;
        let cfg = hopper_config(&f, s.bwd, t, bh, hopper_smem(s, d)[3])?;
        // SAFETY: argument types and order match `flash_hopper_bwd`.
        unsafe { b.launch(cfg) }.w()?;
        let f = kernel(dev, Some(d), dtype, "flash_hopper_dq_out")?;
        let n64 = n as i64;
        let mut b = f.builder();
        b.arg(&acc).arg(&dq).arg(&n64).arg(&t32).arg(&rows.input);
        // SAFETY: argument types and order match `flash_hopper_dq_out`; n is a multiple of 4.
        unsafe { b.launch(blocks(((n / 4).div_ceil(256), 1), 256)) }.w()?;
        drop((dq, dk, dv));
        return Ok(dqkv);
    }
    // dq (which 0) or dk and dv (which 1), as the kernels' signatures list them.
    for (which, name) in [dq_name, dkdv_name].into_iter().enumerate() {
        let f = kernel(dev, Some(d), dtype, name)?;
        let mut b = f.builder();
        b.arg(qs).arg(ks).arg(vs).arg(ds).arg(ls).arg(&delta);
        match which {
            0 => b.arg(&dq),
            _ => b.arg(&dk).arg(&dv),
        };
        b.arg(&t32).arg(&qscale).arg(&scale32);
        if path == Path::Hopper {
            b.arg(&rows.input).arg(&rows.output);
        }
        if path.draws_mask() {
            b.arg(&ad);
        }
        // SAFETY: argument types and order match `flash_bwd_dq`/`_dkdv`, `flash_tc_dq`/`_dkdv`
        // (the mask last), `flash_wide_dq`/`_dkdv` and `flash_hopper_dq`/`_dkdv` (the layouts
        // last, no mask).
        unsafe { b.launch(cfg(&f, which)?) }.w()?;
    }
    drop((dq, dk, dv));
    Ok(dqkv)
}
