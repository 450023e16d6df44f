//! Independent per-tensor work spread over rayon's pool: the AdamW update of each parameter, the
//! squared sum of each gradient, each half of a batched product. Each piece is computed by the
//! same calls as on one thread, only on whichever worker is free, so no bit depends on the
//! thread count; the results come back in the items' order.
//!
//! ```text
//!   items (largest first)     worker 0        worker 1
//!   fc.w   262k  ──────────▶  fc.w            proj.w       each worker takes the largest
//!   proj.w 262k               c_attn.w        ln.b, ...    item left, so the two finish
//!   c_attn.w 197k ...         ...             ...          within one small item of each other
//! ```
//!
//! On one thread, off the CPU (where the device orders the work), or below
//! [`split_min`](super::split_min) elements in all, the items run in order on the calling thread.

use candle_core::{Result, Tensor};
use rayon::prelude::*;

/// `f(item)` for every item, in the items' order; `tensor(item)` is the tensor whose device and
/// size say where and in what order the item runs (see the module's comment).
pub fn each_tensor<T: Sync, R: Send>(
    items: &[T],
    tensor: impl Fn(&T) -> &Tensor + Sync,
    f: impl Fn(&T) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let on_cpu = items.iter().all(|it| tensor(it).device().is_cpu());
    let total: usize = items.iter().map(|it| tensor(it).elem_count()).sum();
    if !on_cpu || items.len() < 2 || !super::split::splits(total) {
        return items.iter().map(f).collect();
    }
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(tensor(&items[i]).elem_count()));
    // Profiled as one section: the items run at once on several threads.
    let done: Vec<(usize, Result<R>)> = crate::profile::section(&candle_core::Device::Cpu, || {
        Ok(order
            .par_iter()
            .with_max_len(1)
            .map(|&i| (i, f(&items[i])))
            .collect())
    })?;
    let mut slots: Vec<Option<Result<R>>> = (0..items.len()).map(|_| None).collect();
    for (i, r) in done {
        slots[i] = Some(r);
    }
    slots
        .into_iter()
        .map(|r| r.expect("every item ran once"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// The results come back in the items' order, the same as one after another, and an error
    /// of any item is the call's error.
    #[test]
    fn results_in_order_and_errors_kept() -> Result<()> {
        let dev = Device::Cpu;
        let sizes = [5usize, 40_000, 3, 70_000, 1, 20_000];
        let ts: Vec<Tensor> = sizes
            .iter()
            .map(|&n| Tensor::arange(0u32, n as u32, &dev)?.to_dtype(DType::F32))
            .collect::<Result<_>>()?;
        let sum = |t: &Tensor| t.sqr()?.sum_all()?.to_scalar::<f32>();
        let one: Vec<f32> = ts.iter().map(sum).collect::<Result<_>>()?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let spread = pool.install(|| each_tensor(&ts, |t| t, sum))?;
        assert_eq!(
            one.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            spread.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        let failing = pool.install(|| {
            each_tensor(
                &ts,
                |t| t,
                |t| match t.elem_count() {
                    3 => Err(crate::msg("item of 3 elements".into())),
                    _ => sum(t),
                },
            )
        });
        assert!(failing.unwrap_err().to_string().contains("item of 3"));
        Ok(())
    }
}
