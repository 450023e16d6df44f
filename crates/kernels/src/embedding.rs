//! Token embedding `y[n] = wte[ids[n]]` with a scatter-add gradient kernel.
//!
//! ```text
//!   forward   ids (N,) ──> y (N, C): row n of y is row ids[n] of wte (V, C)
//!   backward  dwte[v] = Σ_{n : ids[n] = v} dy[n]
//!
//!        dy (N, C)                                  g (V, C) f32, zeroed
//!   n=0  ████████  ids[0] = 7  ── atomicAdd ──>  row 7  ████████
//!   n=1  ████████  ids[1] = 2  ── atomicAdd ──>  row 2  ████████
//!   n=2  ████████  ids[2] = 7  ── atomicAdd ──>  row 7  (same row: the atomics add up)
//!        one warp per token row, lanes over C in 16-byte words; then g ──> dwte in dy's dtype
//! ```
//!
//! candle's `index_select` backward is `index_add`, one thread per column looping over all N
//! tokens: for GPT-2 (N = 16384, C = 768) only 768 threads run, and it took 8.4 ms of a bf16
//! step on an H200. Here every token row is one warp, the reads of dy are coalesced, and the
//! sum is kept in f32 whatever dy's dtype, so a frequent token's many rows lose nothing to bf16
//! rounding before the single final conversion.
//!
//! Ids are checked: an id >= V is never read or written (its output row is zeros, its dy row
//! is skipped) and the call fails with an error naming the first such id and its position.
//! The check costs one 4-byte read-back, which waits for the kernel: the forward pays it once,
//! and the backward trusts the ids the forward checked.
//!
//! On CPU the op runs a plain Rust loop (the reference algorithm), so the graph-free
//! [`forward`] and [`backward`] and their checks work everywhere; the differentiable
//! [`embedding`] takes candle's `index_select` wherever the CUDA kernels do not apply.
//! Legend: `N` tokens, `V` vocabulary, `C` width.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::msg;

/// Whether the CUDA kernels take this table and these ids: `wte` (V, C) on CUDA in bf16 or
/// f32, `idx` (N,) u32 on the same device.
fn fuses(wte: &Tensor, idx: &Tensor) -> bool {
    crate::fused_for(wte)
        && wte.rank() == 2
        && idx.rank() == 1
        && idx.dtype() == DType::U32
        && idx.device().same_device(wte.device())
}

/// `wte.index_select(idx, 0)`: rows of `wte` (V, C) picked by `idx` (N,), giving (N, C),
/// differentiable in `wte`: the gather and scatter-add kernels on CUDA (ids checked), else
/// candle's `index_select`.
pub fn embedding(wte: &Tensor, idx: &Tensor) -> Result<Tensor> {
    if fuses(wte, idx) {
        op(wte, idx)
    } else {
        wte.index_select(idx, 0)
    }
}

/// Rows of `wte` (V, C) picked by `idx` (N,) u32, recording no graph; an id >= V is an error.
/// The CUDA kernel, or on CPU the reference loop.
pub fn forward(wte: &Tensor, idx: &Tensor) -> Result<Tensor> {
    let run = || {
        check_op_args(wte, idx)?;
        wte.contiguous()?
            .apply_op2_no_bwd(&idx.contiguous()?, &Embedding)
    };
    // The rows read are the rows written: the ids and twice the output move.
    crate::profile::op(wte.device(), run, |y| {
        let bytes = crate::profile::bytes(&[idx, y, y]);
        ("embedding".into(), crate::profile::Cost { flops: 0.0, bytes })
    })
}

/// The table gradient (vocab, C) of rows `idx` (N,) for dy (N, C), recording no graph, for ids
/// that [`forward`] checked (no read-back): the scatter-add kernel, or on CPU the reference loop.
pub fn backward(idx: &Tensor, dy: &Tensor, vocab: usize) -> Result<Tensor> {
    crate::profile::op(dy.device(), || {
        check_grad_args(idx, dy)?;
        grad(&idx.contiguous()?, &dy.contiguous()?, vocab, false)
    }, |dw| {
        let cost = crate::profile::Cost::elementwise(1.0, dy, &[idx, dy], &[dw]);
        ("embedding backward".into(), cost)
    })
}

/// The op itself, under autograd: the CUDA kernels, or on CPU the reference loop; ids checked,
/// its gradient the scatter-add of [`embedding_grad`]'s algorithm.
pub(crate) fn op(wte: &Tensor, idx: &Tensor) -> Result<Tensor> {
    check_op_args(wte, idx)?;
    wte.contiguous()?.apply_op2(&idx.contiguous()?, Embedding)
}

/// The table must be (V, C) bf16 or f32 and the ids u32 (N,) on its device.
fn check_op_args(wte: &Tensor, idx: &Tensor) -> Result<()> {
    let (v, c) = wte.dims2().map_err(|_| {
        msg(format!(
            "embedding: the table must be (V, C), got {:?}",
            wte.dims()
        ))
    })?;
    check_ids(idx, wte, "embedding")?;
    if !matches!(wte.dtype(), DType::BF16 | DType::F32) {
        return Err(msg(format!(
            "embedding: table ({v}, {c}) has dtype {:?} (bf16 or f32 only)",
            wte.dtype()
        )));
    }
    Ok(())
}

/// The gradient of [`op`] for a table of `vocab` rows: `dwte[v] = Σ_{idx[n] = v} dy[n]`,
/// (vocab, C) in dy's dtype, summed in f32. `idx` (N,) u32, `dy` (N, C) bf16 or f32.
/// An id >= vocab is an error naming it (one read-back of a flag on CUDA). The tests' entry to
/// the gradient alone.
#[cfg(test)]
pub(crate) fn embedding_grad(idx: &Tensor, dy: &Tensor, vocab: usize) -> Result<Tensor> {
    check_grad_args(idx, dy)?;
    grad(&idx.contiguous()?, &dy.contiguous()?, vocab, true)
}

fn check_ids(idx: &Tensor, other: &Tensor, what: &str) -> Result<usize> {
    if idx.rank() != 1 || idx.dtype() != DType::U32 {
        return Err(msg(format!(
            "{what}: ids must be u32 (N,), got {:?} {:?}",
            idx.dtype(),
            idx.dims()
        )));
    }
    if !idx.device().same_device(other.device()) {
        return Err(msg(format!(
            "{what}: ids on {:?} but the other operand on {:?}",
            idx.device().location(),
            other.device().location()
        )));
    }
    Ok(idx.dim(0)?)
}

/// `idx` (N,) u32 and `dy` (N, C) bf16 or f32 on one device.
fn check_grad_args(idx: &Tensor, dy: &Tensor) -> Result<()> {
    let n = check_ids(idx, dy, "embedding_grad")?;
    match dy.dims() {
        [rows, _] if *rows == n => {}
        other => {
            return Err(msg(format!(
                "embedding_grad: dy must be ({n}, C) for {n} ids, got {other:?}"
            )))
        }
    }
    if !matches!(dy.dtype(), DType::BF16 | DType::F32) {
        return Err(msg(format!(
            "embedding_grad: dy has dtype {:?} (bf16 or f32 only)",
            dy.dtype()
        )));
    }
    Ok(())
}

/// The out-of-range error, shared by every path.
fn bad_id(what: &str, id: u32, pos: usize, vocab: usize) -> candle_core::Error {
    msg(format!(
        "{what}: token id {id} at position {pos} is out of range for a vocabulary of {vocab}"
    ))
}

/// dwte (vocab, C) from contiguous, checked-shape `idx` and `dy`; `check_ids` false skips the
/// read-back of the bad-id flag on CUDA (the kernel still never touches an id >= vocab).
fn grad(idx: &Tensor, dy: &Tensor, vocab: usize, check_ids: bool) -> Result<Tensor> {
    if dy.device().is_cuda() {
        #[cfg(feature = "cuda")]
        return imp::grad(idx, dy, vocab, check_ids);
    }
    let _ = check_ids;
    cpu_grad(idx, dy, vocab)
}

/// The reference algorithm, one row at a time in f32.
fn cpu_grad(idx: &Tensor, dy: &Tensor, vocab: usize) -> Result<Tensor> {
    let (n, c) = dy.dims2()?;
    let ids = idx.to_vec1::<u32>()?;
    let rows = dy.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut g = vec![0f32; vocab * c];
    for (pos, &id) in ids.iter().enumerate().take(n) {
        let v = id as usize;
        if v >= vocab {
            return Err(bad_id("embedding_grad", id, pos, vocab));
        }
        let src = &rows[pos * c..(pos + 1) * c];
        for (acc, x) in g[v * c..(v + 1) * c].iter_mut().zip(src) {
            *acc += x;
        }
    }
    Tensor::from_vec(g, (vocab, c), dy.device())?.to_dtype(dy.dtype())
}

/// Rows of `table` (V, C) picked by `ids`, on the host.
fn cpu_gather<T: Copy>(table: &[T], c: usize, ids: &[u32]) -> Result<Vec<T>> {
    let vocab = table.len() / c.max(1);
    let mut y = Vec::with_capacity(ids.len() * c);
    for (pos, &id) in ids.iter().enumerate() {
        let v = id as usize;
        if v >= vocab {
            return Err(bad_id("embedding", id, pos, vocab));
        }
        y.extend_from_slice(&table[v * c..(v + 1) * c]);
    }
    Ok(y)
}

/// The recorded op: forward gathers rows, backward scatters dy into dwte.
struct Embedding;

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn cpu_fwd(
        &self,
        wte: &CpuStorage,
        lw: &Layout,
        idx: &CpuStorage,
        li: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (Some((w0, w1)), Some((i0, i1))) = (lw.contiguous_offsets(), li.contiguous_offsets())
        else {
            return Err(msg("embedding: inputs must be contiguous".into()));
        };
        let &[_, c] = lw.dims() else {
            return Err(msg(format!(
                "embedding: the table must be (V, C), got {:?}",
                lw.dims()
            )));
        };
        let ids = match idx {
            CpuStorage::U32(v) => &v[i0..i1],
            _ => return Err(msg("embedding: ids must be u32".into())),
        };
        let y = match wte {
            CpuStorage::BF16(w) => CpuStorage::BF16(cpu_gather(&w[w0..w1], c, ids)?),
            CpuStorage::F32(w) => CpuStorage::F32(cpu_gather(&w[w0..w1], c, ids)?),
            _ => return Err(msg("embedding: table must be bf16 or f32".into())),
        };
        Ok((y, Shape::from((ids.len(), c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        wte: &candle_core::CudaStorage,
        lw: &Layout,
        idx: &candle_core::CudaStorage,
        li: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        imp::forward(wte, lw, idx, li)
    }

    fn bwd(
        &self,
        wte: &Tensor,
        idx: &Tensor,
        _y: &Tensor,
        grad_y: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // The forward checked these ids, so the backward skips the read-back.
        let dw = grad(idx, &grad_y.contiguous()?, wte.dim(0)?, false)?;
        Ok((Some(dw), None))
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape, Tensor};

    use super::super::cuda::{
        blocks, by_dtype, device, grid_stride, kernel, slice, storage, tensor, view,
    };
    use super::super::msg;
    use super::bad_id;

    /// Threads per block: 8 warps, one token row each at a time.
    const THREADS: usize = 256;

    /// Blocks of 8 warps with a grid-stride loop over the N rows.
    fn rows_grid(n: usize) -> LaunchConfig {
        blocks(
            ((n.div_ceil(THREADS / 32)).clamp(1, MAX_BLOCKS), 1),
            THREADS,
        )
    }
    const MAX_BLOCKS: usize = 132 * 16;

    /// `v` as the kernels' 32-bit count, with room for one grid stride past it.
    fn int(v: usize, what: &str) -> Result<i32> {
        if v + MAX_BLOCKS * THREADS > i32::MAX as usize {
            return Err(msg(format!(
                "embedding: {what} = {v} exceeds the kernels' 32-bit row and column counts"
            )));
        }
        Ok(v as i32)
    }

    /// The widest word (16, 8, 4 or 2 bytes) dividing a row and the byte offset of the table.
    fn unit_bytes(row_bytes: usize, offset_bytes: usize) -> usize {
        [16, 8, 4, 2]
            .into_iter()
            .find(|u| row_bytes % u == 0 && offset_bytes % u == 0)
            .unwrap_or(2)
    }

    /// Fails naming the first id >= vocab if the kernel raised `bad` (see embedding.cu).
    fn check_flag(
        what: &str,
        dev: &CudaDevice,
        bad: &CudaSlice<u32>,
        ids: &CudaView<u32>,
        n: usize,
        vocab: usize,
    ) -> Result<()> {
        let flag = dev.clone_dtoh(bad)?.first().copied().unwrap_or(0) as usize;
        if flag == 0 || flag > n {
            return Ok(());
        }
        let pos = n - flag;
        let id = dev
            .clone_dtoh(&ids.slice(pos..pos + 1))?
            .first()
            .copied()
            .unwrap_or(u32::MAX);
        Err(bad_id(what, id, pos, vocab))
    }

    pub fn forward(
        wte: &CudaStorage,
        lw: &Layout,
        idx: &CudaStorage,
        li: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        if !lw.is_contiguous()
            || !li.is_contiguous()
            || lw.dims().len() != 2
            || li.dims().len() != 1
        {
            return Err(msg(format!(
                "embedding: table {:?} and ids {:?} must be contiguous, (V, C) and (N,)",
                lw.dims(),
                li.dims()
            )));
        }
        let y = by_dtype!("embedding", wte.dtype(), gather(wte, lw, idx, li))?;
        Ok((y, Shape::from((li.dims()[0], lw.dims()[1]))))
    }

    fn gather<T: CudaDType + DeviceRepr>(
        wte: &CudaStorage,
        lw: &Layout,
        idx: &CudaStorage,
        li: &Layout,
    ) -> Result<CudaStorage> {
        let dev = &wte.device;
        let (v, c) = (lw.dims()[0], lw.dims()[1]);
        let n = li.dims()[0];
        let esize = std::mem::size_of::<T>();
        // CUDA allocations are 256-byte aligned, so the table's offset decides the word size.
        let unit = unit_bytes(c * esize, lw.start_offset() * esize);
        let ws = view::<T>(wte, lw)?;
        let is = view::<u32>(idx, li)?;
        // SAFETY: every row is written by the kernel (a copy of a wte row, or zeros).
        let y = unsafe { dev.alloc::<T>(n * c)? };
        if n * c > 0 {
            let bad = dev.alloc_zeros::<u32>(1)?;
            let f = kernel(dev, None, wte.dtype(), &format!("emb_gather_u{unit}"))?;
            let (n32, cu32, v32) = (
                int(n, "N ids")?,
                int(c * esize / unit, "C words")?,
                int(v, "V")?,
            );
            let mut b = f.builder();
            b.arg(&is)
                .arg(&ws)
                .arg(&y)
                .arg(&n32)
                .arg(&cu32)
                .arg(&v32)
                .arg(&bad);
            // SAFETY: argument order matches `emb_gather_u{unit}` in embedding.cu; the table
            // view starts on a `unit`-byte boundary and holds v rows of c elements, y n rows.
            unsafe { b.launch(rows_grid(n)) }.w()?;
            check_flag("embedding", dev, &bad, &is, n, v)?;
        }
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    }

    pub fn grad(idx: &Tensor, dy: &Tensor, vocab: usize, check_ids: bool) -> Result<Tensor> {
        by_dtype!(
            "embedding_grad",
            dy.dtype(),
            scatter(idx, dy, vocab, check_ids)
        )
    }

    fn scatter<T: CudaDType + DeviceRepr>(
        idx: &Tensor,
        dy: &Tensor,
        vocab: usize,
        check_ids: bool,
    ) -> Result<Tensor> {
        let dev = device(dy)?;
        let (n, c) = dy.dims2()?;
        let (gi, oi) = storage(idx, "embedding_grad ids")?;
        let (gd, od) = storage(dy, "embedding_grad dy")?;
        let is = slice::<u32>(&gi)?.slice(oi..);
        let ds = slice::<T>(&gd)?.slice(od..);
        let g = dev.alloc_zeros::<f32>(vocab * c)?; // (V, C)
        if n * c > 0 {
            let bad = dev.alloc_zeros::<u32>(1)?;
            // 16-byte words of dy (8 bf16 or 4 f32) when every row starts on a word boundary.
            let per_word = 16 / std::mem::size_of::<T>();
            let name = if c % per_word == 0 && od % per_word == 0 {
                "emb_grad_vec"
            } else {
                "emb_grad_scalar"
            };
            let f = kernel(&dev, None, dy.dtype(), name)?;
            let (n32, c32, v32) = (int(n, "N ids")?, int(c, "C")?, int(vocab, "V")?);
            let mut b = f.builder();
            b.arg(&is)
                .arg(&ds)
                .arg(&g)
                .arg(&n32)
                .arg(&c32)
                .arg(&v32)
                .arg(&bad);
            // SAFETY: argument order matches `emb_grad_{vec,scalar}` in embedding.cu; dy holds
            // n rows of c elements, g vocab rows, and no id >= vocab is read or written.
            unsafe { b.launch(rows_grid(n)) }.w()?;
            if check_ids {
                check_flag("embedding_grad", &dev, &bad, &is, n, vocab)?;
            }
        }
        drop(is);
        drop(gi);
        drop(ds);
        drop(gd);
        if dy.dtype() == DType::F32 {
            return Ok(tensor(&dev, g, (vocab, c)));
        }
        let len = vocab * c;
        // SAFETY: every element is written by the grid-stride loop of `emb_cast`.
        let out = unsafe { dev.alloc::<T>(len)? };
        if len > 0 {
            let f = kernel(&dev, None, dy.dtype(), "emb_cast")?;
            let len64 = len as i64;
            let mut b = f.builder();
            b.arg(&g).arg(&out).arg(&len64);
            // SAFETY: argument order matches `emb_cast` in embedding.cu; g and out hold len
            // elements, g from a fresh (16-byte aligned) allocation.
            unsafe { b.launch(grid_stride(len.div_ceil(4))) }.w()?;
        }
        Ok(tensor(&dev, out, (vocab, c)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::rel_err;
    use candle_core::{Device, Var};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// `n` ids over 0..vocab, skewed towards small ids (id = ⌊u² · V⌋) so that a few rows
    /// receive many tokens, as frequent words do.
    fn skewed_ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                let u: f64 = rng.gen();
                ((u * u * vocab as f64) as usize).min(vocab - 1) as u32
            })
            .collect()
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// y and dwte of [`embedding`] against `index_select` and its autograd (`index_add`).
    /// The table is rounded to `dtype`; the reference runs in f32 on the same values, so the
    /// forward must match exactly and the gradient within `tol` (bf16: one final rounding).
    fn check_op(dev: &Device, n: usize, v: usize, c: usize, dtype: DType, tol: f64) {
        let ids = Tensor::new(skewed_ids(n, v, 7), dev).unwrap();
        let w = Tensor::randn(0f32, 1f32, (v, c), dev).unwrap();
        let g = Tensor::randn(0f32, 1f32, (n, c), dev).unwrap();
        let run = |fused: bool, dt: DType| {
            let cast = |t: &Tensor| t.to_dtype(dtype).unwrap().to_dtype(dt).unwrap();
            let wv = Var::from_tensor(&cast(&w)).unwrap();
            let y = if fused {
                op(wv.as_tensor(), &ids).unwrap()
            } else {
                wv.as_tensor().index_select(&ids, 0).unwrap()
            };
            let grads = (&y * cast(&g))
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            (y, grads.get(wv.as_tensor()).unwrap().clone())
        };
        let (y, dw) = run(true, dtype);
        let (y_ref, dw_ref) = run(false, DType::F32);
        assert_eq!(y.dims(), &[n, c]);
        assert_eq!(y.dtype(), dtype);
        let d = max_abs_diff(&y, &y_ref);
        assert_eq!(
            d, 0.0,
            "forward differs from index_select by {d} ({n}x{c}, {dtype:?})"
        );
        assert_eq!(dw.dims(), &[v, c]);
        assert_eq!(dw.dtype(), dtype);
        let e = rel_err(&dw, &dw_ref);
        assert!(
            e < tol,
            "dwte rel err {e} >= {tol} ({n} ids, V {v}, C {c}, {dtype:?})"
        );
    }

    #[test]
    fn cpu_matches_index_select() {
        check_op(&Device::Cpu, 500, 30, 12, DType::F32, 1e-6);
        check_op(&Device::Cpu, 500, 30, 12, DType::BF16, 1e-2);
    }

    #[test]
    fn errors_name_the_bad_values() {
        let dev = Device::Cpu;
        let wte = Tensor::zeros((10, 4), DType::F32, &dev).unwrap();
        let ids = Tensor::new(&[1u32, 2, 10, 3], &dev).unwrap();
        let e = op(&wte, &ids).unwrap_err().to_string();
        assert!(e.contains("token id 10 at position 2"), "{e}");
        let dy = Tensor::zeros((4, 4), DType::F32, &dev).unwrap();
        let e = embedding_grad(&ids, &dy, 10).unwrap_err().to_string();
        assert!(e.contains("token id 10 at position 2"), "{e}");
        let dy3 = Tensor::zeros((3, 4), DType::F32, &dev).unwrap();
        let e = embedding_grad(&ids, &dy3, 10).unwrap_err().to_string();
        assert!(e.contains("(4, C) for 4 ids, got [3, 4]"), "{e}");
        let ids_i64 = Tensor::new(&[1i64], &dev).unwrap();
        let e = op(&wte, &ids_i64).unwrap_err().to_string();
        assert!(e.contains("ids must be u32 (N,), got I64 [1]"), "{e}");
        assert!(
            !fuses(&wte, &ids),
            "CPU tensors never take the CUDA kernels"
        );
    }

    #[test]
    fn cpu_empty_ids() {
        check_empty(&Device::Cpu, DType::F32);
    }

    /// N = 0: the forward is (0, C) and the gradient is all zeros (V, C).
    fn check_empty(dev: &Device, dtype: DType) {
        let (v, c) = (7, 100);
        let ids = Tensor::zeros(0, DType::U32, dev).unwrap();
        let wte = Tensor::randn(0f32, 1f32, (v, c), dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let y = op(&wte, &ids).unwrap();
        assert_eq!(y.dims(), &[0, c]);
        let dy = Tensor::zeros((0, c), dtype, dev).unwrap();
        let dw = embedding_grad(&ids, &dy, v).unwrap();
        assert_eq!(dw.dims(), &[v, c]);
        assert_eq!(dw.dtype(), dtype);
        let s = dw
            .to_dtype(DType::F32)
            .unwrap()
            .abs()
            .unwrap()
            .sum_all()
            .unwrap();
        assert_eq!(s.to_scalar::<f32>().unwrap(), 0.0);
    }

    #[cfg(feature = "cuda")]
    mod gpu {
        use super::*;
        use crate::testing::cuda;

        #[test]
        fn op_matches_index_select() {
            let dev = cuda();
            // 5000 skewed ids over 300 rows: row 0 alone gets about 290 tokens.
            check_op(&dev, 5000, 300, 768, DType::BF16, 1e-2);
            check_op(&dev, 5000, 300, 768, DType::F32, 1e-5);
            // C = 100: 200 bytes per bf16 row (8-byte words in the gather, scalar gradient).
            check_op(&dev, 5000, 300, 100, DType::BF16, 1e-2);
            check_op(&dev, 5000, 300, 100, DType::F32, 1e-5);
        }

        /// embedding_grad on its own, with dy and the table starting off a 16-byte boundary
        /// (narrowed one element into a flat buffer): the scalar gradient kernel and 2- or
        /// 4-byte gather words.
        #[test]
        fn unaligned_inputs_match_index_select() {
            let dev = cuda();
            let (n, v, c) = (2000, 300, 768);
            let ids = Tensor::new(skewed_ids(n, v, 11), &dev).unwrap();
            for (dtype, tol) in [(DType::BF16, 1e-2), (DType::F32, 1e-5)] {
                let flat = Tensor::randn(0f32, 1f32, n * c + 1, &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let dy = flat.narrow(0, 1, n * c).unwrap().reshape((n, c)).unwrap();
                let dw = embedding_grad(&ids, &dy, v).unwrap();
                let dw_ref = Tensor::zeros((v, c), DType::F32, &dev)
                    .unwrap()
                    .index_add(&ids, &dy.to_dtype(DType::F32).unwrap(), 0)
                    .unwrap();
                let e = rel_err(&dw, &dw_ref);
                assert!(e < tol, "unaligned dy: rel err {e} >= {tol} ({dtype:?})");

                let table = Tensor::randn(0f32, 1f32, v * c + 1, &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let wte = table.narrow(0, 1, v * c).unwrap().reshape((v, c)).unwrap();
                let y = op(&wte, &ids).unwrap();
                let d = max_abs_diff(&y, &wte.index_select(&ids, 0).unwrap());
                assert_eq!(
                    d, 0.0,
                    "unaligned table: forward differs by {d} ({dtype:?})"
                );
            }
        }

        #[test]
        fn out_of_range_id_is_an_error() {
            let dev = cuda();
            let (v, c) = (300, 768);
            let mut host = skewed_ids(64, v, 3);
            host[7] = v as u32;
            host[40] = u32::MAX;
            let ids = Tensor::new(host, &dev).unwrap();
            for dtype in [DType::BF16, DType::F32] {
                let wte = Tensor::zeros((v, c), dtype, &dev).unwrap();
                let e = op(&wte, &ids).unwrap_err().to_string();
                assert!(e.contains("token id 300 at position 7"), "{e}");
                let dy = Tensor::ones((64, c), dtype, &dev).unwrap();
                let e = embedding_grad(&ids, &dy, v).unwrap_err().to_string();
                assert!(e.contains("token id 300 at position 7"), "{e}");
            }
        }

        #[test]
        fn empty_ids() {
            let dev = cuda();
            check_empty(&dev, DType::BF16);
            check_empty(&dev, DType::F32);
        }

        #[test]
        fn supported_on_cuda() {
            let dev = cuda();
            let wte = Tensor::zeros((10, 4), DType::BF16, &dev).unwrap();
            let ids = Tensor::new(&[1u32, 2], &dev).unwrap();
            assert!(fuses(&wte, &ids));
            let ids_cpu = Tensor::new(&[1u32, 2], &Device::Cpu).unwrap();
            assert!(!fuses(&wte, &ids_cpu));
        }
    }
}
