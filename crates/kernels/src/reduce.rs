//! Full reductions that stay fast on a GPU: Σ of every element, reduced in rows first, and the
//! sum of squares of many tensors (the gradient norm) in one launch for all of them.
//!
//! candle reduces a tensor to a scalar with one CUDA block per output element, so `sum_all` of a
//! large tensor runs on a single streaming multiprocessor: for GPT-2 124M the squared gradient
//! norm (148 tensors, 124M elements in f64) took about 90 ms of an optimizer step that way. Here
//! the elements are first summed in rows of [`ROW`] (one block per row, every multiprocessor busy),
//! and only the row sums, `n / ROW` of them, go through the one-block reduction.
//!
//! ```text
//!   x: (n,)  ->  head (n − n % ROW,) as (n / ROW, ROW) -> Σ over dim 1 -> (n / ROW,)
//!                tail (n % ROW,)                        -> Σ           -> (1,)
//!            ->  concatenated, repeated while longer than ROW, then one last Σ -> ()
//! ```
//!
//! Every step is a differentiable candle op, so [`sum_all`] can be the objective of a backward
//! pass too; its gradient is one for every element, as `sum_all`'s.
//!
//! [`sq_sum_f64_all`] is Σ x² over a list of tensors, the square of a global gradient norm. In
//! candle ops each tensor costs a cast to f64, a square and the row sums (about six kernels and
//! two f64 copies of the tensor); on CUDA one launch for the whole list (`sq_sum.cu`) reads every
//! tensor once, tensor k in blocks of its own, which write their partial sums, in f64, into one
//! buffer; a second launch of one block adds the partials in a fixed order into one f64 on the
//! device ([`sq_sum_f64_all_on_device`]), which a caller reads when it needs the number and not
//! before (the optimizer's clip coefficient is computed from it on the device too,
//! [`crate::adamw::clip_coef_on_device`]):
//!
//! ```text
//!   tensor k (n_k elements) ─ blocks o_k .. o_k + B_k of one launch ─> partials[o_k .. o_k + B_k)
//!   partials (Σ B_k f64) ─ one block, fixed order ─> Σ, a scalar on the device (o_k = B_0 + … + B_{k−1})
//! ```
//!
//! B_k depends only on n_k, so the same gradients give the same norm, bit for bit, at every run.

use std::ops::Range;

use candle_core::{DType, Device, Result, Tensor};

/// Elements each block sums in the first pass.
pub const ROW: usize = 1024;

/// Σ of every element of `t` as a scalar (rank-0) tensor of `t`'s dtype, on `t`'s device.
pub fn sum_all(t: &Tensor) -> Result<Tensor> {
    let mut x = t.flatten_all()?; // (n,)
    while x.elem_count() > ROW {
        let n = x.elem_count();
        let full = n - n % ROW;
        let rows = x.narrow(0, 0, full)?.reshape((full / ROW, ROW))?.sum(1)?; // (n / ROW,)
        x = if full == n {
            rows
        } else {
            let tail = x.narrow(0, full, n - full)?.sum_keepdim(0)?; // (1,)
            Tensor::cat(&[&rows, &tail], 0)? // (n / ROW + 1,)
        };
    }
    x.sum_all()
}

/// Σ of every element of `t`, computed in f64 and read back.
pub fn sum_f64(t: &Tensor) -> Result<f64> {
    sum_all(&t.to_dtype(DType::F64)?)?.to_scalar::<f64>()
}

/// Rows of [`ROW`] that [`sum_f64_in_pieces`] asks for at a time (2 MiB of f64).
const PIECE_ROWS: usize = 256;

/// [`sum_f64`] of a vector of `n` elements that `piece(range)` forms a range at a time, the same
/// bits as the whole vector's: [`sum_all`]'s first pass sums each row of [`ROW`] on its own, so
/// the rows are summed piece by piece ([`PIECE_ROWS`] rows at most) and the row sums, `n / ROW`
/// of them, go through the rest of it. Only one piece is held at a time.
///
/// ```text
///   piece(0..R·ROW)      ─ Σ each row ─┐
///   piece(R·ROW..2R·ROW) ─ Σ each row ─┼─ (n / ROW,) ++ Σ tail (n % ROW,) ─ sum_all ─> f64
///   …                                  ┘
/// ```
pub fn sum_f64_in_pieces(n: usize, piece: impl Fn(Range<usize>) -> Result<Tensor>) -> Result<f64> {
    if n <= ROW {
        return sum_f64(&piece(0..n)?);
    }
    let full = n - n % ROW;
    let mut sums = Vec::with_capacity(full / (PIECE_ROWS * ROW) + 2);
    for a in (0..full).step_by(PIECE_ROWS * ROW) {
        let b = (a + PIECE_ROWS * ROW).min(full);
        let x = piece(a..b)?.to_dtype(DType::F64)?; // (b − a,)
        sums.push(x.reshape(((b - a) / ROW, ROW))?.sum(1)?); // ((b − a) / ROW,)
    }
    if full < n {
        sums.push(piece(full..n)?.to_dtype(DType::F64)?.sum_keepdim(0)?); // (1,)
    }
    sum_all(&Tensor::cat(&sums, 0)?)?.to_scalar::<f64>()
}

/// Σ t² over every element of `t`, computed in f64, as a device scalar (no read-back).
pub fn sq_sum_f64_tensor(t: &Tensor) -> Result<Tensor> {
    crate::profile::elementwise("sq_sum", &[t], || sum_all(&t.to_dtype(DType::F64)?.sqr()?))
}

/// The one-launch Σx² of `tensors` (CUDA), profiled as one `sq_sum`.
fn sq_sum_fused(tensors: &[&Tensor]) -> Result<Tensor> {
    crate::profile::op(tensors[0].device(), || partials::sq_sum(tensors), |s| {
        let elems: usize = tensors.iter().map(|t| t.elem_count()).sum();
        let flops = crate::profile::per_element("sq_sum") * elems as f64;
        let bytes = crate::profile::bytes(tensors) + crate::profile::bytes(&[s]);
        ("sq_sum".into(), crate::profile::Cost { flops, bytes })
    })
}

/// Σ t² over every element of `t`, computed in f64 and read back.
pub fn sq_sum_f64(t: &Tensor) -> Result<f64> {
    sq_sum_f64_tensor(t)?.to_scalar::<f64>()
}

/// Σ x² over every element of every tensor in `tensors`, in f64, read back once.
///
/// On CUDA, where every tensor is bf16 or f32 on one device, [`sq_sum_f64_all_on_device`] and
/// one read-back of its scalar; otherwise (CPU, other dtypes) each tensor's
/// [`sq_sum_f64_tensor`] on the device (on the CPU spread over the compute pool,
/// [`crate::each_tensor`]), the scalars stacked in order and read back together.
pub fn sq_sum_f64_all<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> Result<f64> {
    let tensors: Vec<&Tensor> = tensors.into_iter().collect();
    if tensors.is_empty() {
        return Ok(0.0);
    }
    if fused_all(&tensors) {
        return sq_sum_fused(&tensors)?.to_scalar::<f64>();
    }
    let sums = crate::each_tensor(&tensors, |t| *t, |t| sq_sum_f64_tensor(t))?;
    Ok(Tensor::stack(&sums, 0)?.to_vec1::<f64>()?.into_iter().sum())
}

/// [`sq_sum_f64_all`] as an f64 scalar (rank 0) on `device`, not read back: on CUDA two
/// launches and no wait for the device, so work that depends on the norm (the clip
/// coefficient, the optimizer) is queued behind it. On the CPU the host's value as a tensor.
pub fn sq_sum_f64_all_on_device<'a>(
    tensors: impl IntoIterator<Item = &'a Tensor>,
    device: &Device,
) -> Result<Tensor> {
    let tensors: Vec<&Tensor> = tensors.into_iter().collect();
    if !tensors.is_empty() && fused_all(&tensors) && tensors[0].device().same_device(device) {
        return sq_sum_fused(&tensors);
    }
    Tensor::new(sq_sum_f64_all(tensors)?, device)
}

/// Whether the one-launch kernel takes `tensors`: every one where the fused kernels run, on
/// the first one's device.
fn fused_all(tensors: &[&Tensor]) -> bool {
    tensors
        .iter()
        .all(|t| crate::fused_for(t) && t.device().same_device(tensors[0].device()))
}

/// The blocks of 256 threads [`sq_sum_f64_all`]'s kernel gives a tensor of `n` elements: one
/// per 256 elements up to 4 per multiprocessor of an H200 (132 × 4), a function of `n` alone.
pub fn sq_sum_blocks(n: usize) -> usize {
    n.div_ceil(256).clamp(1, 132 * 4)
}

#[cfg(not(feature = "cuda"))]
mod partials {
    use candle_core::{Result, Tensor};

    pub fn sq_sum(_: &[&Tensor]) -> Result<Tensor> {
        Err(crate::msg("sq_sum_partials runs on CUDA only".into()))
    }
}

#[cfg(feature = "cuda")]
mod partials {
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, PushKernelArg, SyncOnDrop};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{DType, Result, Tensor};

    use super::sq_sum_blocks;
    use crate::cuda::{blocks, device, kernel, slice, storage, tensor};

    /// One `sq_sum_partials` launch over every tensor into one f64 buffer, then one
    /// `sq_sum_total` launch adding the partials into a scalar on the device, not read back.
    /// The tensors are bf16 or f32 on one CUDA device.
    ///
    /// The launch reads a table of the tensors' addresses, sizes, first blocks and dtypes (one
    /// small copy to the device), so the host's cost does not grow with a launch per tensor.
    pub fn sq_sum(tensors: &[&Tensor]) -> Result<Tensor> {
        let dev = device(tensors[0])?;
        let stream = dev.cuda_stream();
        let k = tensors.len();
        let tensors: Vec<Tensor> = tensors
            .iter()
            .map(|t| t.contiguous())
            .collect::<Result<_>>()?;
        let held = tensors
            .iter()
            .map(|t| storage(t, "sq_sum"))
            .collect::<Result<Vec<_>>>()?;
        // table: addresses | sizes | first blocks (k + 1) | bf16 flags, as sq_sum.cu reads it.
        let mut table = vec![0u64; 4 * k + 1];
        let mut reads: Vec<SyncOnDrop<'_>> = Vec::with_capacity(k);
        let mut total = 0usize;
        for (j, (t, (st, off))) in tensors.iter().zip(&held).enumerate() {
            let (base, read) = match t.dtype() {
                DType::BF16 => slice::<half::bf16>(st)?.device_ptr(&stream),
                DType::F32 => slice::<f32>(st)?.device_ptr(&stream),
                other => {
                    return Err(crate::msg(format!(
                        "sq_sum: dtype {other:?} (bf16 or f32 only)"
                    )))
                }
            };
            table[j] = base + (off * t.dtype().size_in_bytes()) as u64;
            table[k + j] = t.elem_count() as u64;
            table[2 * k + j] = total as u64;
            table[3 * k + 1 + j] = u64::from(t.dtype() == DType::BF16);
            total += sq_sum_blocks(t.elem_count());
            reads.push(read);
        }
        table[3 * k] = total as u64;
        let table = dev.clone_htod(&table)?;
        // SAFETY: every block writes its own slot of `out` (sq_sum.cu), so none is read unset.
        let mut out = unsafe { dev.alloc::<f64>(total)? };
        let f = kernel(&dev, None, DType::F32, "sq_sum_partials")?;
        let k32 = k as i32;
        let mut b = f.builder();
        b.arg(&table).arg(&k32).arg(&mut out);
        // SAFETY: (const u64* table, int k, double* out) as in sq_sum.cu; the table holds the
        // 4k + 1 entries it reads, each address k's n elements of the dtype its flag names, held
        // by `held` until the launch is enqueued; out holds one slot per block of the grid.
        unsafe { b.launch(blocks((total, 1), 256)) }.w()?;
        drop(reads);
        // SAFETY: the one block writes out[0] (sq_sum.cu).
        let mut sum = unsafe { dev.alloc::<f64>(1)? };
        let f = kernel(&dev, None, DType::F32, "sq_sum_total")?;
        let n = total as i64;
        let mut b = f.builder();
        b.arg(&out).arg(&n).arg(&mut sum);
        // SAFETY: (const double* parts, long n, double* out) as in sq_sum.cu: `out` holds the
        // n partials written above, `sum` one value; one block of 256 threads.
        unsafe { b.launch(blocks((1, 1), 256)) }.w()?;
        Ok(tensor(&dev, sum, ()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The row-wise sum equals the plain one at every length around the row boundaries, and its
    /// gradient is all ones.
    #[test]
    fn equals_plain_sum_at_every_boundary() -> Result<()> {
        let dev = Device::Cpu;
        for n in [
            0,
            1,
            7,
            ROW - 1,
            ROW,
            ROW + 1,
            3 * ROW + 5,
            ROW * ROW + 3,
            2 * ROW * ROW + ROW,
        ] {
            let v: Vec<f64> = (0..n)
                .map(|i| ((i * 7919) % 1000) as f64 * 0.5 - 250.0)
                .collect();
            let t = Tensor::from_vec(v.clone(), n, &dev)?;
            let want: f64 = v.iter().sum();
            let got = sum_all(&t)?.to_scalar::<f64>()?;
            assert_eq!(got, want, "n = {n}"); // integers and halves: exact in f64 in any order
            let sq: f64 = v.iter().map(|x| x * x).sum();
            assert_eq!(sq_sum_f64(&t)?, sq, "n = {n}");
        }
        let x = Var::from_tensor(&Tensor::arange(0f32, 3000., &dev)?.reshape((3, 1000))?)?;
        let g = sum_all(x.as_tensor())?.backward()?;
        let ones = g.get(x.as_tensor()).expect("gradient of x").flatten_all()?;
        assert_eq!(ones.to_vec1::<f32>()?, vec![1f32; 3000]);
        Ok(())
    }

    /// Summed a piece at a time, a vector gives the bits of its whole sum (values whose sum
    /// depends on the order: no rounding-free shortcut), at lengths around the row and piece
    /// boundaries; each piece is asked for once, in order, within the vector.
    #[test]
    fn sum_in_pieces_has_the_bits_of_the_whole_sum() -> Result<()> {
        let dev = Device::Cpu;
        let piece = PIECE_ROWS * ROW;
        for n in [0, 5, ROW, ROW + 3, piece, piece + ROW - 1, 2 * piece + 3 * ROW + 17] {
            let v: Vec<f32> = (0..n)
                .map(|i| ((i as f32 * 0.618_034).sin() * 1e3).powi(3))
                .collect();
            let t = Tensor::from_vec(v, n, &dev)?;
            let asked = std::cell::RefCell::new(Vec::new());
            let got = sum_f64_in_pieces(n, |r| {
                asked.borrow_mut().push(r.clone());
                t.narrow(0, r.start, r.len())
            })?;
            assert_eq!(got.to_bits(), sum_f64(&t)?.to_bits(), "n = {n}");
            let asked = asked.into_inner();
            let covered: Vec<usize> = asked.iter().flat_map(|r| r.clone()).collect();
            assert_eq!(covered, (0..n).collect::<Vec<_>>(), "n = {n}: pieces {asked:?}");
            assert!(asked.iter().all(|r| r.len() <= piece), "n = {n}: pieces {asked:?}");
        }
        Ok(())
    }

    /// The list form equals the per-tensor sums on the CPU (mixed dtypes, an empty tensor), and
    /// on a GPU the fused partials equal the exact sum of squares of bf16 and f32 tensors of
    /// sizes around the block boundaries, and give the same bits twice.
    #[test]
    fn sum_of_squares_of_a_list() -> Result<()> {
        let devices = crate::testing::devices();
        for dev in devices {
            let mut ts = Vec::new();
            let mut want = 0f64;
            // candle cannot allocate an empty CUDA tensor: the empty one is a CPU case only.
            let sizes = [0, 1, 255, 256, 257, 256 * 528, 256 * 528 + 7, 3_000_001];
            let from = usize::from(dev.is_cuda());
            for (k, n) in sizes.into_iter().enumerate().skip(from) {
                // Small integers: exact in bf16, and their squares' sums exact in f64.
                let v: Vec<f32> = (0..n).map(|i| ((i * 31 + k) % 17) as f32 - 8.0).collect();
                want += v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
                let t = Tensor::from_vec(v, n, &dev)?;
                ts.push(if k % 2 == 0 {
                    t.to_dtype(DType::BF16)?
                } else {
                    t
                });
            }
            let got = sq_sum_f64_all(&ts)?;
            assert_eq!(got, want, "{dev:?}");
            assert_eq!(
                sq_sum_f64_all(&ts)?.to_bits(),
                got.to_bits(),
                "{dev:?}: not deterministic"
            );
            let on = sq_sum_f64_all_on_device(&ts, &dev)?;
            assert!(
                on.device().same_device(&dev) && on.dims().is_empty(),
                "{dev:?}"
            );
            assert_eq!(on.to_scalar::<f64>()?, want, "{dev:?}: on the device");
            assert_eq!(sq_sum_f64_all(std::iter::empty::<&Tensor>())?, 0.0);
            let none = sq_sum_f64_all_on_device(std::iter::empty::<&Tensor>(), &dev)?;
            assert_eq!(none.to_scalar::<f64>()?, 0.0);
        }
        Ok(())
    }
}
