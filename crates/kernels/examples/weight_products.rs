//! A layer's products on the CPU at one thread, per row: y = x · Wᵀ as candle multiplies it
//! (W read as a transposed right side) and as `matmul` does (a large weight by at most 256
//! rows as (W · xᵀ)ᵀ, the same bits: `rank_two_products_are_candle_bit_for_bit`), and the
//! backward's dW = dyᵀ · x and dx = dy · W beside them.
//!
//! `RAYON_NUM_THREADS=1 cargo run --release -p mtrain-kernels --example weight_products`

use std::time::Instant;

use candle_core::{Device, Result, Tensor};

/// The mean of 20 calls after 3 warm-ups, printed per call and per row.
fn time(name: &str, rows: usize, mut f: impl FnMut() -> Result<Tensor>) -> Result<()> {
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
    Ok(())
}

fn main() -> Result<()> {
    let d = Device::Cpu;
    for (inp, out) in [(1024usize, 2048usize), (256, 768)] {
        let w = Tensor::randn(0f32, 1.0, (out, inp), &d)?; // (out, in)
        for rows in [64usize, 256, 1000] {
            let x = Tensor::randn(0f32, 1.0, (rows, inp), &d)?; // (rows, in)
            let dy = Tensor::randn(0f32, 1.0, (rows, out), &d)?; // (rows, out)
            time(&format!("{inp}->{out} x·Wᵀ, candle"), rows, || x.matmul(&w.t()?))?;
            time(&format!("{inp}->{out} x·Wᵀ, matmul"), rows, || {
                mtrain_kernels::matmul(&x, &w.t()?)
            })?;
            time(&format!("{inp}->{out} dW = dyᵀ·x"), rows, || {
                mtrain_kernels::matmul(&dy.t()?, &x)
            })?;
            time(&format!("{inp}->{out} dx = dy·W"), rows, || mtrain_kernels::matmul(&dy, &w))?;
        }
    }
    Ok(())
}
