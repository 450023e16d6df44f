//! Where splitting a CPU loop over the pool starts to pay: GELU's backward (element-wise spans),
//! LayerNorm's forward (rows) and backward (rows, then column sums) on (N, 64) inputs from 1 Ki
//! to 1 Mi elements, each timed on the calling thread alone and split over the pool (its other
//! workers polling, as during a training step), the median of 300 calls.
//!
//! ```text
//! RAYON_NUM_THREADS=2 cargo run --release -p mtrain-trainer --example split_threshold
//! ```

use std::time::Instant;

use candle_core::{Device, Result, Tensor};
use mtrain_kernels::{gelu, layer_norm, set_split_min};
use mtrain_trainer::compute_pool;

/// The median wall time of `f`, microseconds, after a warm-up.
fn median_us(f: &dyn Fn() -> Result<()>) -> Result<f64> {
    for _ in 0..30 {
        f()?;
    }
    let mut t = Vec::with_capacity(300);
    for _ in 0..300 {
        let t0 = Instant::now();
        f()?;
        t.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

fn main() -> Result<()> {
    compute_pool::init();
    let _hot = compute_pool::Hot::start();
    println!("threads {}", rayon::current_num_threads());
    println!("| elements | op | one thread (µs) | split (µs) | split / one |");
    println!("| ---: | --- | ---: | ---: | ---: |");
    let dev = Device::Cpu;
    let (c, eps) = (64, 1e-5);
    let w = Tensor::randn(1f32, 0.1, c, &dev)?;
    let b = Tensor::randn(0f32, 0.1, c, &dev)?;
    for log2 in 10..=20 {
        let n = 1usize << log2;
        let x = Tensor::randn(0f32, 1., (n / c, c), &dev)?;
        let dy = Tensor::randn(0f32, 1., (n / c, c), &dev)?;
        let (_, mean, rstd) = layer_norm::forward(&x, &w, &b, eps)?;
        let ops: [(&str, Box<dyn Fn() -> Result<()>>); 3] = [
            ("gelu backward", Box::new(|| gelu::backward(&x, &dy).map(drop))),
            ("layer_norm forward", Box::new(|| layer_norm::forward(&x, &w, &b, eps).map(drop))),
            (
                "layer_norm backward",
                Box::new(|| layer_norm::backward(&x, &w, &dy, &mean, &rstd).map(drop)),
            ),
        ];
        for (name, op) in &ops {
            set_split_min(usize::MAX);
            let one = median_us(op.as_ref())?;
            set_split_min(0);
            let split = median_us(op.as_ref())?;
            println!("| {n} | {name} | {one:.1} | {split:.1} | {:.2} |", split / one);
        }
    }
    Ok(())
}
