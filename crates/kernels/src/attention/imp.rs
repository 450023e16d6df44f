//! The CUDA launches of the flash kernels ([`super`] says which kernels and why): shapes,
//! buffers and argument lists; the kernels themselves are CUDA source (`kernels.cu`,
//! `flash_wide.cu`, `flash_hopper.cu`).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, Layout, Result, Tensor};

use super::super::attention_path::{HopperShape, HOPPER_BWD, HOPPER_DKDV, HOPPER_DQ, HOPPER_FWD};
use super::super::cuda::Kernel;
use super::super::cuda::{
    blocks, by_dtype, compute_capability, device, kernel, slice, storage, tensor, view,
};
use super::super::dropout::{attn_drop, Mask};
use super::super::msg;
use super::{path, Path, TcKernels};

const BR: usize = 64;
const LOG2E: f64 = std::f64::consts::LOG2_E;

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

/// The dynamic shared memory of the four Hopper kernels (HP_FWD_SMEM, HP_DQ_SMEM,
/// HP_DKDV_SMEM and HP_BWD_SMEM): their tiles plus 1 KiB to align the first to 1024 bytes.
fn hopper_smem(d: usize) -> [usize; 4] {
    let fwd = tile(HOPPER_FWD.rows(), d) + 4 * tile(128, d);
    let dq = 2 * tile(HOPPER_DQ.rows(), d) + 4 * tile(64, d);
    let dkdv = 2 * tile(HOPPER_DKDV.rows(), d) + 4 * tile(64, d) + 4 * 64 * 4;
    // Per warpgroup K, V, 2 Q, 2 dO, 2 dSᵀ tiles and lse2, δ; a zero tile; two counters and
    // two owners.
    let bwd = HOPPER_BWD.warpgroups * (8 * tile(64, d) + 4 * 64 * 4) + tile(64, 64) + 16;
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
fn fwd<T: CudaDType + DeviceRepr>(
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
    let n = bh * t * d;
    let qs = view::<T>(q, lq)?;
    let ks = view::<T>(k, lk)?;
    let vs = view::<T>(v, lv)?;
    // SAFETY: every element of o and lse is written by the kernel (each valid row).
    let o = unsafe { dev.alloc::<T>(n)? };
    let lse = unsafe { dev.alloc::<f32>(bh * t)? };
    let offsets = [lq.start_offset(), lk.start_offset(), lv.start_offset()];
    let kernels = kernels.for_mask(dropout.is_some());
    let path = path(q.dtype(), d, &offsets, compute_capability(dev)?, kernels);
    let name = match path {
        Path::Hopper => "flash_hopper_fwd",
        Path::Wide => "flash_wide_fwd",
        Path::Tc => "flash_tc_fwd",
        Path::Cuda => "flash_fwd",
    };
    let ad = attn_drop(dropout, hl)?;
    let f = kernel(dev, Some(d), q.dtype(), name)?;
    let cfg = match path {
        Path::Hopper => hopper_config(&f, HOPPER_FWD, t, bh, hopper_smem(d)[0])?,
        Path::Wide => wide_config(t, bh, d),
        Path::Tc => tc_config(t, bh),
        Path::Cuda => config(t, bh, d),
    };
    let (t32, qscale) = (t as i32, (scale * LOG2E) as f32);
    let mut b = f.builder();
    b.arg(&qs)
        .arg(&ks)
        .arg(&vs)
        .arg(&o)
        .arg(&lse)
        .arg(&t32)
        .arg(&qscale);
    if path.draws_mask() {
        b.arg(&ad);
    }
    // SAFETY: argument types and order match `flash_fwd`, `flash_tc_fwd` (kernels.cu, with
    // the mask last), `flash_wide_fwd` and `flash_hopper_fwd` (no mask).
    unsafe { b.launch(cfg) }.w()?;
    let lse = tensor(dev, lse, (bh, t));
    Ok((CudaStorage::wrap_cuda_slice(o, dev.clone()), lse))
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
fn bwd<T: CudaDType + DeviceRepr>(
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
    let bh = b_ * h;
    let (gq, oq) = storage(q, "q")?;
    let (gk, ok) = storage(k, "k")?;
    let (gv, ov) = storage(v, "v")?;
    let (go, oo) = storage(out, "out")?;
    let (gd, od) = storage(grad_out, "grad_out")?;
    let (gl, ol) = storage(lse, "lse")?;
    let qs = slice::<T>(&gq)?.slice(oq..);
    let ks = slice::<T>(&gk)?.slice(ok..);
    let vs = slice::<T>(&gv)?.slice(ov..);
    let os = slice::<T>(&go)?.slice(oo..);
    let ds = slice::<T>(&gd)?.slice(od..);
    let ls = slice::<f32>(&gl)?.slice(ol..);
    let rows = bh * t;
    let dtype = q.dtype();
    let offsets = [oq, ok, ov, oo, od];
    let kernels = kernels.for_mask(dropout.is_some());
    let path = path(dtype, d, &offsets, compute_capability(&dev)?, kernels);
    let (dq_name, dkdv_name) = match path {
        Path::Hopper => ("flash_hopper_dq", "flash_hopper_dkdv"),
        Path::Wide => ("flash_wide_dq", "flash_wide_dkdv"),
        Path::Tc => ("flash_tc_dq", "flash_tc_dkdv"),
        Path::Cuda => ("flash_bwd_dq", "flash_bwd_dkdv"),
    };
    // The launch of dq (shape 0) or dkdv (shape 1) on `f`.
    let cfg = |f: &Kernel, which: usize| match path {
        Path::Hopper => {
            let shape = [HOPPER_DQ, HOPPER_DKDV][which];
            hopper_config(f, shape, t, bh, hopper_smem(d)[1 + which])
        }
        Path::Wide => Ok(wide_config(t, bh, d)),
        Path::Tc => Ok(tc_config(t, bh)),
        Path::Cuda => Ok(config(t, bh, d)),
    };
    let ad = attn_drop(dropout, h)?;
    // SAFETY: every element of each buffer is written by the kernel filling it.
    let delta = unsafe { dev.alloc::<f32>(rows)? };
    // One buffer (3, B, H, T, D) for dq | dk | dv, so a packed input gets one gradient.
    let dqkv = unsafe { dev.alloc::<T>(3 * rows * d)? };
    let n = rows * d;
    let (dq, dk, dv) = (
        dqkv.slice(0..n),
        dqkv.slice(n..2 * n),
        dqkv.slice(2 * n..3 * n),
    );
    let rows64 = rows as i64;
    let f = kernel(&dev, Some(d), dtype, "flash_bwd_dot")?;
    let mut b = f.builder();
    b.arg(&os).arg(&ds).arg(&delta).arg(&rows64);
    // Eight threads per row, blocks of 256 (a whole number of rows and warps).
    let dot_cfg = blocks(((rows * 8).div_ceil(256), 1), 256);
    // SAFETY: argument types and order match `flash_bwd_dot`.
    unsafe { b.launch(dot_cfg) }.w()?;

    let (t32, qscale, scale32) = (t as i32, (scale * LOG2E) as f32, scale as f32);
    if path == Path::Hopper && kernels.one_pass(t) {
        // dk, dv and dq (into f32, then bf16) in one pass.
        let acc = dev.alloc_zeros::<f32>(n)?;
        let f = kernel(&dev, Some(d), dtype, "flash_hopper_bwd")?;
        let mut b = f.builder();
        b.arg(&qs)
            .arg(&ks)
            .arg(&vs)
            .arg(&ds)
            .arg(&ls)
            .arg(&delta)
            .arg(&acc)
            .arg(&dk)
            .arg(&dv);
        b.arg(&t32).arg(&qscale).arg(&scale32);
        let cfg = hopper_config(&f, HOPPER_BWD, t, bh, hopper_smem(d)[3])?;
        // SAFETY: argument types and order match `flash_hopper_bwd`.
        unsafe { b.launch(cfg) }.w()?;
        let f = kernel(&dev, Some(d), dtype, "flash_hopper_dq_out")?;
        let n64 = n as i64;
        let mut b = f.builder();
        b.arg(&acc).arg(&dq).arg(&n64);
        // SAFETY: argument types and order match `flash_hopper_dq_out`; n is a multiple of 4.
        unsafe { b.launch(blocks(((n / 4).div_ceil(256), 1), 256)) }.w()?;
        drop((dq, dk, dv));
        return Ok(tensor(&dev, dqkv, (3, b_, h, t, d)));
    }
    let f = kernel(&dev, Some(d), dtype, dq_name)?;
    let mut b = f.builder();
    b.arg(&qs)
        .arg(&ks)
        .arg(&vs)
        .arg(&ds)
        .arg(&ls)
        .arg(&delta)
        .arg(&dq);
    b.arg(&t32).arg(&qscale).arg(&scale32);
    if path.draws_mask() {
        b.arg(&ad);
    }
    // SAFETY: argument types and order match `flash_bwd_dq`, `flash_tc_dq` (the mask last),
    // `flash_wide_dq` and `flash_hopper_dq` (no mask).
    unsafe { b.launch(cfg(&f, 0)?) }.w()?;

    let f = kernel(&dev, Some(d), dtype, dkdv_name)?;
    let mut b = f.builder();
    b.arg(&qs)
        .arg(&ks)
        .arg(&vs)
        .arg(&ds)
        .arg(&ls)
        .arg(&delta)
        .arg(&dk)
        .arg(&dv);
    b.arg(&t32).arg(&qscale).arg(&scale32);
    if path.draws_mask() {
        b.arg(&ad);
    }
    // SAFETY: argument types and order match `flash_bwd_dkdv`, `flash_tc_dkdv` (the mask
    // last), `flash_wide_dkdv` and `flash_hopper_dkdv` (no mask).
    unsafe { b.launch(cfg(&f, 1)?) }.w()?;

    drop((dq, dk, dv));
    Ok(tensor(&dev, dqkv, (3, b_, h, t, d)))
}
