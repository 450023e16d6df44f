//! The roofs of the roofline: measured on the machine at hand, and the datasheets' presets.
//!
//! ```text
//!   FLOP/s │            ___________________ compute roof: a large GEMM's FLOP/s
//!          │          /
//!          │        /  memory roof: a copy's bytes/s × intensity
//!          │      /
//!          └────┴──────────────────────── intensity (FLOP/B)
//!             ridge = compute roof / copy bandwidth
//! ```
//!
//! Measured: on the CPU an n = 1024 product through the same GEMM the ops use and a 64 MiB
//! copy; on a GPU an n = 8192 product and a 1 GiB device-to-device copy; each the best of five
//! runs after one to warm up, the device synchronised around each. The GEMM runs in the run's
//! compute dtype (bf16 or f32), the figure a training GEMM can reach.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use mtrain_parallel::analysis::cluster::Gpu;
use serde::{Deserialize, Serialize};

/// A roof measured here.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Measured {
    /// The GEMM's FLOP/s.
    pub flops_per_s: f64,
    /// The copy's bytes/s (read + written).
    pub bytes_per_s: f64,
    /// What was run for each.
    pub gemm: String,
    pub copy: String,
}

impl Measured {
    /// The ridge point: FLOPs per byte where the two roofs meet.
    pub fn ridge(&self) -> f64 {
        self.flops_per_s / self.bytes_per_s.max(1e-9)
    }
}

/// A datasheet's roof and memory sizes ([`Gpu::PRESETS`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Preset {
    pub name: String,
    pub bf16_tflops: f64,
    pub fp32_tflops: f64,
    pub hbm_tb_s: f64,
    /// bf16 peak ÷ HBM bandwidth (FLOP/B).
    pub ridge: f64,
    pub l2_mb: f64,
    pub smem_kib: u64,
    pub regs_kib: u64,
    pub sms: u64,
    pub source: String,
}

/// The roofs `ops.json` records.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Roofs {
    pub measured: Measured,
    pub presets: Vec<Preset>,
}

/// The datasheets' presets.
pub fn presets() -> Vec<Preset> {
    Gpu::PRESETS
        .iter()
        .map(|p| Preset {
            name: p.name.into(),
            bf16_tflops: p.bf16_tflops,
            fp32_tflops: p.fp32_tflops,
            hbm_tb_s: p.hbm_tb_s,
            ridge: p.ridge(),
            l2_mb: p.l2_mb,
            smem_kib: p.smem_kib,
            regs_kib: p.regs_kib,
            sms: p.sms,
            source: p.source.into(),
        })
        .collect()
}

/// The best of five timed runs of `f` (seconds), after one untimed.
fn best_of(device: &Device, f: impl Fn() -> candle_core::Result<Tensor>) -> anyhow::Result<f64> {
    f()?;
    device.synchronize()?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t0 = Instant::now();
        let out = f()?;
        device.synchronize()?;
        best = best.min(t0.elapsed().as_secs_f64());
        drop(out);
    }
    Ok(best)
}

/// The roofs of `device` in `dtype`, measured now.
pub fn measure(device: &Device, dtype: DType) -> anyhow::Result<Measured> {
    let (n, copy_bytes) = match device.is_cpu() {
        true => (1024, 64usize << 20),
        false => (8192, 1usize << 30),
    };
    let a = Tensor::ones((n, n), DType::F32, device)?.to_dtype(dtype)?;
    let secs = best_of(device, || mtrain_kernels::matmul(&a, &a))?;
    let flops_per_s = 2.0 * (n as f64).powi(3) / secs;
    drop(a);
    // Into a buffer allocated once: the first touch of fresh pages is not the copy's cost.
    let (src, dst) = (
        Tensor::ones(copy_bytes / 4, DType::F32, device)?,
        Tensor::zeros(copy_bytes / 4, DType::F32, device)?,
    );
    // Two copies, the faster one the roof: a copy kernel into that buffer, and the storage's
    // own clone (on a GPU a device-to-device memcpy into a pooled allocation, which streams
    // faster than a copy kernel; on a CPU fresh pages, which the first copy wins).
    let kernel = best_of(device, || dst.slice_set(&src, 0, 0).map(|()| dst.clone()))?;
    let clone = best_of(device, || src.copy())?;
    let (secs, how) = match clone < kernel {
        true => (clone, "memcpy"),
        false => (kernel, "copy"),
    };
    let bytes_per_s = 2.0 * copy_bytes as f64 / secs;
    Ok(Measured {
        flops_per_s,
        bytes_per_s,
        gemm: format!("{n}x{n}x{n} {dtype:?} GEMM"),
        copy: format!("{} MiB {how}", copy_bytes >> 20),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_carry_the_datasheets_ridges() {
        let p = presets();
        let a100 = p.iter().find(|p| p.name == "a100-80gb").unwrap();
        // The chapter's 312 TFLOP/s ÷ 2 TB/s ≈ 156 FLOP/B (2.039 TB/s: 153).
        assert!((a100.ridge - 153.0).abs() < 1.0, "{}", a100.ridge);
        let h100 = p.iter().find(|p| p.name == "h100-sxm").unwrap();
        assert!((h100.ridge - 295.2).abs() < 0.5, "{}", h100.ridge);
        assert_eq!(p.len(), 3);
    }
}
