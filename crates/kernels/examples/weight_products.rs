//! A layer's products on the CPU at one thread, the way `matmul` runs them: y = x · Wᵀ (a
//! large weight as (W · xᵀ)ᵀ below 512 rows) against (W · xᵀ)ᵀ written out, with their bits
//! compared, and the backward's dW = dyᵀ · x and dx = dy · W beside them, per row.
//!
//! `RAYON_NUM_THREADS=1 cargo run --release -p mtrain-kernels --example weight_products`

use std::time::Instant;

use candle_core::{Device, Result, Tensor};

/// The mean of 20 calls after 3 warm-ups, printed per call and per row; the last result.
fn time(name: &str, rows: usize, mut f: impl FnMut() -> Result<Tensor>) -> Result<Tensor> {
    for _ in 0..3 {
        f()?;
    }
    let n = 20;
    let t0 = Instant::now();
    for _ in 0..n {
        f()?;
    }
    let ms = t0.elapsed().as_secs_f64() * 1e3 / n as f64;
    println!("{name:36} rows {rows:4}: {ms:7.3} ms, {:.4} ms a row", ms / rows as f64);
    f()
}

fn main() -> Result<()> {
    let d = Device::Cpu;
    for (inp, out) in [(1024usize, 2048usize), (256, 768)] {
        let w = Tensor::randn(0f32, 1.0, (out, inp), &d)?; // (out, in)
        for rows in [64usize, 256, 1000] {
            let x = Tensor::randn(0f32, 1.0, (rows, inp), &d)?; // (rows, in)
            let dy = Tensor::randn(0f32, 1.0, (rows, out), &d)?; // (rows, out)
            let y = time(&format!("{inp}->{out} x·Wᵀ"), rows, || {
                mtrain_kernels::matmul(&x, &w.t()?)
            })?;
            let yt = time(&format!("{inp}->{out} (W·xᵀ)ᵀ"), rows, || {
                mtrain_kernels::matmul(&w, &x.t()?)?.t()?.contiguous()
            })?;
            let same = y.flatten_all()?.to_vec1::<f32>()? == yt.flatten_all()?.to_vec1::<f32>()?;
            println!("  the same bits: {same}");
            time(&format!("{inp}->{out} dW = dyᵀ·x"), rows, || {
                mtrain_kernels::matmul(&dy.t()?, &x)
            })?;
            time(&format!("{inp}->{out} dx = dy·W"), rows, || mtrain_kernels::matmul(&dy, &w))?;
        }
    }
    Ok(())
}
