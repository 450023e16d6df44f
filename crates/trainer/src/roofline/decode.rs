//! `mtrain sample --profile-ops`: decoding with the KV cache on the roofline. The prompt's
//! prefill and the first new token (the warm-up) run unprofiled; every later token's forward
//! runs with the kernels' op profiler on ([`Gpt::generate_cached_with`]), so each row is an op
//! of one position at the sample's batch (1): a matrix-vector product per weight
//! (`gemm+bias 1×C×3C`, …, the tied head `gemm 1×C×V`), `decode attention` over the cached
//! positions, `kv cache append`, and the LayerNorms, GELUs and residual adds. The report is
//! `ops.json`'s, a "step" being one token, written beside the checkpoint's run as
//! `decode-ops.json` and drawn on the run's `roofline.svg` with the training step's ops.
//!
//! ```text
//!   one token at p cached positions    FLOPs                 bytes (compulsory)
//!   every weight's GEMV                2·N_matmul            N_matmul weights, read once
//!   attention, each of L layers        4·C·(p + 1)           K and V: 2·C·(p + 1) values
//!   intensity                          ≈ 2 / (bytes per value): 0.5 FLOP/B in f32, 1 in bf16
//! ```
//!
//! against a ridge of tens (a CPU) to hundreds (a GPU) of FLOP/B: decoding one sequence is
//! memory-bound in every op, and its time is the weights' and the cache's bytes over the
//! memory bandwidth. `N_matmul` is [`GptConfig::n_matmul_params`].
//!
//! [`Gpt::generate_cached_with`]: mtrain_model::Gpt::generate_cached_with

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use mtrain_kernels::profile::{self, OpTotals};
use mtrain_model::GptConfig;
use serde::{Deserialize, Serialize};

use super::roofs::{self, Roofs};
use super::{summarize, OpsReport, RankOps, RankRow};

/// The report's name in the run directory.
pub const DECODE_OPS: &str = "decode-ops.json";

/// What a decode report was run on.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DecodeRun {
    /// Sequences decoded at once.
    pub batch: usize,
    /// Tokens of the prompt the cache was prefilled with.
    pub prompt_tokens: usize,
}

/// The decode tokens' ops, added up as they run.
#[derive(Default)]
pub struct DecodeProfile {
    warmed_up: bool,
    rows: BTreeMap<String, OpTotals>,
    /// Each profiled token's cached positions and wall time.
    positions: Vec<u64>,
    seconds: Vec<f64>,
}

impl DecodeProfile {
    pub fn new() -> Self {
        Self::default()
    }

    /// The decoder's forward `run` at `p` cached positions: timed and profiled unless it is a
    /// prefill (p = 0) or the first new token.
    pub fn forward(
        &mut self,
        p: usize,
        run: &mut dyn FnMut() -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        if p == 0 || !self.warmed_up {
            self.warmed_up |= p > 0;
            return run();
        }
        profile::start();
        let t0 = Instant::now();
        let logits = run();
        let seconds = t0.elapsed().as_secs_f64();
        let table = profile::stop();
        let logits = logits?;
        for (name, t) in table {
            let row = self.rows.entry(name).or_default();
            row.calls += t.calls;
            row.flops += t.flops;
            row.bytes += t.bytes;
            row.seconds += t.seconds;
        }
        self.positions.push(p as u64);
        self.seconds.push(seconds);
        Ok(logits)
    }

    /// The report of the profiled tokens of `gcfg` on `device` in `dtype` (the roofs measured
    /// there), per token; None if no token was profiled (fewer than two new ones, or each a
    /// prefill past block_size).
    pub fn report(
        self,
        gcfg: &GptConfig,
        (device, kind, dtype): (&Device, &str, DType),
        run: DecodeRun,
    ) -> anyhow::Result<Option<OpsReport>> {
        if self.positions.is_empty() {
            return Ok(None);
        }
        let n = self.positions.len() as f64;
        let (l, c) = (gcfg.n_layer as f64, gcfg.n_embd as f64);
        let per_token =
            |p: &u64| 2.0 * gcfg.n_matmul_params() as f64 + 4.0 * l * c * (*p + 1) as f64;
        let model_flops = self.positions.iter().map(per_token).sum::<f64>() / n * run.batch as f64;
        let rows = self
            .rows
            .into_iter()
            .map(|(name, t)| RankRow::op(name, &t))
            .collect();
        let part = RankOps {
            rank: 0,
            steps: self.positions,
            step_seconds: self.seconds,
            rows,
        };
        let roofs = Roofs {
            measured: roofs::measure(device, dtype)?,
            presets: roofs::presets(),
        };
        let on = (kind.to_string(), format!("{dtype:?}").to_lowercase());
        let mut report = summarize(&[part], on, (gcfg, 1), model_flops, roofs);
        report.decode = Some(run);
        for row in &mut report.rows {
            // Decoding runs forward passes only.
            let fwd: Vec<&str> = row
                .layers
                .split(", ")
                .filter(|l| l.ends_with(" fwd"))
                .collect();
            row.layers = fwd.join(", ");
        }
        Ok(Some(report))
    }
}

/// Writes `report` to `run_dir`'s `decode-ops.json`; returns its path.
pub fn write(run_dir: &Path, report: &OpsReport) -> anyhow::Result<PathBuf> {
    let path = run_dir.join(DECODE_OPS);
    crate::fsio::write_synced(&path, serde_json::to_string_pretty(report)?.as_bytes())?;
    Ok(path)
}
