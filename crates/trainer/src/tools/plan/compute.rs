//! The compute time `mtrain plan` gives a rank when no run measured it: each kind of work of
//! the step at the share of its roof it reaches (the roofline of docs/gpu-memory.md), or, with
//! `--mfu F`, every FLOP at `F` of the peak.
//!
//! ```text
//!   per token of a micro-batch, whole model            forward : backward      at
//!   matmuls       6·N FLOPs  (N: the multiplied weights)      1 : 2             gemm share · peak
//!   attention     12·L·C·T FLOPs                              1 : 2             attention share · peak
//!   element-wise  12·L·C·s bytes: two LayerNorms a block      4·L·C·s : 8·L·C·s hbm share · HBM
//!                 (forward reads x, writes y; backward reads
//!                 x, dy and the residual's gradient, writes dx)
//!                 + 3·V·s: the loss (forward reads the        V·s : 2·V·s
//!                 logits; backward reads them, writes dlogits)
//!   per step, per parameter the rank updates (its optimizer shard):
//!   AdamW         24 + 2·g + c bytes: p, m, v (f32) read and written,             hbm share · HBM
//!                 the gradient read by the norm and by the update,
//!                 the compute copy of p written (c = s, none in fp32)
//!   s: bytes of the compute dtype; g = s (the gradients are kept in it); L layers, C width,
//!   T context, V vocabulary
//! ```
//!
//! The bias adds, GELU and residual adds ride in the matmuls' epilogues and dropout's masks in
//! the kernels that use them, so they are not traffic of their own. The shares are what one H100
//! reached in the `--profile-ops` table of docs/gpu-memory.md (GPT-2 124M, 8 × 1024): the
//! large GEMMs at 0.45–0.78 of the datasheet peak, the 768-wide ones at 0.2–0.3 (0.6 taken for
//! the wider models the plans are for), flash attention at 0.3–0.35 (head 64;
//! 0.4 taken, the larger heads reach more), AdamW and the loss at 0.8 of the HBM bandwidth and
//! LayerNorm at 0.25–0.3 (0.7 taken over the element-wise and optimizer bytes together).

use mtrain_model::GptConfig;

/// How the prediction prices a pass it did not measure.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ComputeRule {
    /// Every FLOP at this fraction of the peak (`--mfu`).
    Flops { mfu: f64 },
    /// Each kind of work at its share of its roof.
    Roofline(Shares),
}

/// The fractions of its roofs each kind of work reaches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shares {
    /// Of the bf16 peak, the matrix multiplies.
    pub gemm: f64,
    /// Of the bf16 peak, attention's two products.
    pub attention: f64,
    /// Of the HBM bandwidth, the memory-bound kernels (LayerNorm, the loss, AdamW).
    pub hbm: f64,
    /// The GPU's HBM bandwidth, bytes/s.
    pub hbm_bytes_per_s: f64,
}

impl Shares {
    /// The defaults (module doc) on a GPU of `hbm_bytes_per_s`.
    pub fn default_on(hbm_bytes_per_s: f64) -> Shares {
        Shares {
            gemm: 0.6,
            attention: 0.4,
            hbm: 0.7,
            hbm_bytes_per_s,
        }
    }
}

/// Seconds of one forward and one backward of `tokens` tokens through the whole model
/// (`dtype_bytes` per activation element) on a GPU of `peak_flops`.
pub fn passes(
    rule: ComputeRule,
    model: &GptConfig,
    seq_len: usize,
    tokens: f64,
    dtype_bytes: usize,
    peak_flops: f64,
) -> (f64, f64) {
    let fpt = model.flops_per_token(seq_len);
    match rule {
        ComputeRule::Flops { mfu } => {
            let f = fpt / 3.0 * tokens / (peak_flops * mfu);
            (f, 2.0 * f)
        }
        ComputeRule::Roofline(sh) => {
            let (l, c, v) = (
                model.n_layer as f64,
                model.n_embd as f64,
                model.vocab_size as f64,
            );
            let s = dtype_bytes as f64;
            let attention = 12.0 * l * c * seq_len as f64;
            let matmul = fpt - attention;
            let flops_s = |f: f64, share: f64| f * tokens / (peak_flops * share);
            let bytes_s = |b: f64| b * tokens / (sh.hbm_bytes_per_s * sh.hbm);
            let f = flops_s(matmul / 3.0, sh.gemm)
                + flops_s(attention / 3.0, sh.attention)
                + bytes_s(4.0 * l * c * s + v * s);
            let b = flops_s(2.0 * matmul / 3.0, sh.gemm)
                + flops_s(2.0 * attention / 3.0, sh.attention)
                + bytes_s(8.0 * l * c * s + 2.0 * v * s);
            (f, b)
        }
    }
}

/// Seconds of one optimizer step over `params` parameters (the rank's optimizer shard) with
/// `dtype_bytes` per compute element; none under `--mfu`, which prices FLOPs only.
pub fn optimizer(rule: ComputeRule, params: u64, dtype_bytes: usize) -> f64 {
    match rule {
        ComputeRule::Flops { .. } => 0.0,
        ComputeRule::Roofline(sh) => {
            let s = dtype_bytes as f64;
            let copy = if dtype_bytes == 4 { 0.0 } else { s };
            params as f64 * (24.0 + 2.0 * s + copy) / (sh.hbm_bytes_per_s * sh.hbm)
        }
    }
}

/// The rule as `plan` prints it.
pub fn describe(rule: ComputeRule) -> String {
    match rule {
        ComputeRule::Flops { mfu } => format!("compute at {:.0}% of peak", mfu * 100.0),
        ComputeRule::Roofline(sh) => format!(
            "compute: matmuls at {:.0}% of peak, attention at {:.0}%, element-wise and optimizer bytes at {:.0}% of {:.2} TB/s",
            sh.gemm * 100.0,
            sh.attention * 100.0,
            sh.hbm * 100.0,
            sh.hbm_bytes_per_s / 1e12
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt2(l: usize, c: usize) -> GptConfig {
        let mut m = GptConfig::gpt2_124m();
        m.n_layer = l;
        m.n_embd = c;
        m.n_head = c / 64;
        m
    }

    /// The roofline rule by hand at GPT-2 124M's shape, 8 × 1024 tokens, bf16 on an H100.
    #[test]
    fn the_roofline_rule_adds_each_kind_of_work_at_its_roof() {
        let m = gpt2(12, 768);
        let sh = Shares::default_on(3.35e12);
        let tokens = 8.0 * 1024.0;
        let (f, b) = passes(ComputeRule::Roofline(sh), &m, 1024, tokens, 2, 989e12);
        let attention = 12.0 * 12.0 * 768.0 * 1024.0;
        let matmul = 6.0 * m.n_matmul_params() as f64;
        let hbm = 3.35e12 * 0.7;
        let want_f = matmul / 3.0 * tokens / (989e12 * 0.6)
            + attention / 3.0 * tokens / (989e12 * 0.4)
            + (4.0 * 12.0 * 768.0 * 2.0 + 50304.0 * 2.0) * tokens / hbm;
        let want_b = 2.0 * matmul / 3.0 * tokens / (989e12 * 0.6)
            + 2.0 * attention / 3.0 * tokens / (989e12 * 0.4)
            + (8.0 * 12.0 * 768.0 * 2.0 + 2.0 * 50304.0 * 2.0) * tokens / hbm;
        assert!(
            (f - want_f).abs() < 1e-12 && (b - want_b).abs() < 1e-12,
            "{f} {b}"
        );
        // AdamW over 124M parameters in bf16: 30 bytes each.
        let opt = optimizer(ComputeRule::Roofline(sh), 124_000_000, 2);
        assert!((opt - 124e6 * 30.0 / hbm).abs() < 1e-12);
        // Under --mfu the passes are the FLOPs at that share and the optimizer is not priced.
        let (f, b) = passes(ComputeRule::Flops { mfu: 0.5 }, &m, 1024, tokens, 2, 989e12);
        let want = m.flops_per_token(1024) / 3.0 * tokens / (989e12 * 0.5);
        assert!((f - want).abs() < 1e-15 && (b - 2.0 * want).abs() < 1e-15);
        assert_eq!(
            optimizer(ComputeRule::Flops { mfu: 0.5 }, 124_000_000, 2),
            0.0
        );
    }

    /// A narrow model spends a larger part of its step outside the matmuls than a wide one.
    #[test]
    fn the_memory_bound_part_is_larger_in_a_narrow_model() {
        let sh = Shares::default_on(3.35e12);
        let part = |m: &GptConfig| {
            let tokens = 8192.0;
            let (f, b) = passes(ComputeRule::Roofline(sh), m, 1024, tokens, 2, 989e12);
            let flops_only = {
                let (f, b) = passes(
                    ComputeRule::Roofline(Shares {
                        hbm_bytes_per_s: f64::INFINITY,
                        ..sh
                    }),
                    m,
                    1024,
                    tokens,
                    2,
                    989e12,
                );
                f + b
            };
            1.0 - flops_only / (f + b)
        };
        let (narrow, wide) = (part(&gpt2(12, 768)), part(&gpt2(48, 1600)));
        assert!(narrow > 1.5 * wide && narrow > 0.05, "{narrow} {wide}");
    }
}
