//! What a run shows a person while it trains: the step line and the progress bar, and the
//! step's figures they show ([`StepMetrics`], a line of metrics.jsonl).
//!
//! ```text
//! step 10/200 | loss 4.0144 | lr 3.14e-03 | norm 1.70 | 8.2 ms | 7,783 tok/s | mfu 11.8%
//! ████████░░░░░░░░░░░░░░░░░░░░░░ 54/200 steps [00:00:03 elapsed, ETA 00:00:09] loss 3.2101
//! ```
//!
//! The step line is llm.c's: one line per logged step, rounded for reading (metrics.jsonl keeps
//! every figure at full precision). MFU is per device: the model FLOPs the job computes per
//! second over the peak of all its devices (dp · tp · pp of them), so it reads the same under
//! any layout. Rank 0 prints it; `--log-ranks` makes every rank print its own.
//!
//! The bar is drawn on rank 0's stderr when it is a terminal (hidden otherwise, so logs piped to
//! a file or through the launcher hold no bar). Every line the loop logs while the bar is up goes
//! through [`Progress::log`], which clears the bar, writes the line and redraws the bar below it,
//! so no line lands on the bar's line.

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::phases::PhaseTimes;

/// One line of metrics.jsonl, and what the step line is made from.
#[derive(Debug, Clone, Serialize)]
pub struct StepMetrics {
    /// Optimizer step (0-based).
    pub step: u64,
    /// The run's id (`crate::run_dir`): one run directory, one id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    /// Mean training loss over the step's micro-batches (nats per token).
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Wall time of the step (ms).
    pub step_ms: f64,
    /// Tokens per second over all data-parallel ranks.
    pub tokens_per_s: f64,
    /// Model FLOPs utilisation per device: the job's model FLOP/s over `peak_flops` times the
    /// number of devices (see `TrainConfig::peak_flops`).
    pub mfu: f64,
    /// Epoch of the training data.
    pub epoch: u64,
    /// The training split's loss over `eval_iters` random batches, when evaluated at this step
    /// (nanoGPT's estimate_loss "train").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub train_eval_loss: Option<f64>,
    /// Validation loss over `eval_iters` random batches, when evaluated at this step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// Rank 0's communication, pipeline and expert figures (see `distributed::StepReport`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parallel: Option<serde_json::Value>,
    /// Milliseconds per phase of the step, under `profile_phases` (see [`crate::phases`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase_ms: Option<PhaseTimes>,
    /// Of each phase's milliseconds, the host's own: until it waited for the device.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase_host_ms: Option<PhaseTimes>,
}

/// The bar's layout: position, elapsed time and the estimated time left.
const BAR_TEMPLATE: &str =
    "{bar:30} {pos}/{len} steps [{elapsed_precise} elapsed, ETA {eta_precise}] {msg}";

/// The progress bar of one run, and the way every line logged under it is written.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    /// A bar over `total` steps starting at `start` (a resumed run), drawn when `visible`.
    pub fn new(total: u64, start: u64, visible: bool) -> Self {
        let bar = if visible {
            ProgressBar::new(total)
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template(BAR_TEMPLATE)
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_position(start);
        // The ETA is the rate of the steps this run executes, not of the jump to `start`.
        bar.reset_eta();
        Self { bar }
    }

    /// Step `step` (0-based) is done.
    pub fn step_done(&self, step: u64, loss: f64) {
        self.bar.set_position(step + 1);
        self.bar.set_message(format!("loss {loss:.4}"));
    }

    /// Run `write` (which logs or prints to stderr) with the bar cleared, then redraw the bar.
    pub fn log(&self, write: impl FnOnce()) {
        self.bar.suspend(write);
    }

    /// Remove the bar at the end of the run.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// The step line of `m` in a run of `total` steps, the step having taken `step_ms`.
pub fn step_line(m: &StepMetrics, total: u64) -> String {
    let mut line = format!(
        "step {}/{total} | loss {:.4} | lr {} | norm {:.2} | {:.1} ms | {} tok/s | mfu {:.1}%",
        m.step + 1,
        m.loss,
        sci(m.lr),
        m.grad_norm,
        m.step_ms,
        thousands(m.tokens_per_s),
        100.0 * m.mfu
    );
    if let Some(t) = m.train_eval_loss {
        line.push_str(&format!(" | eval train {t:.4}"));
    }
    if let Some(v) = m.val_loss {
        line.push_str(&format!(" | val {v:.4}"));
    }
    line
}

/// The last line of a run: `done: 200 steps, final loss 0.6493 (val 0.6742), 5,058 tok/s`.
pub fn done_line(steps: u64, loss: Option<f64>, val: Option<f64>, tokens_per_s: f64) -> String {
    let mut line = format!("done: {steps} steps");
    if let Some(l) = loss {
        line.push_str(&format!(", final loss {l:.4}"));
    }
    if let Some(v) = val {
        line.push_str(&format!(" (val {v:.4})"));
    }
    line.push_str(&format!(", {} tok/s", thousands(tokens_per_s)));
    line
}

/// `x` in scientific notation with three significant digits and a two-digit exponent (`3.14e-03`).
pub fn sci(x: f64) -> String {
    let s = format!("{x:.2e}");
    match s.split_once('e') {
        Some((mantissa, exp)) => {
            let (sign, digits) = match exp.strip_prefix('-') {
                Some(d) => ("-", d),
                None => ("+", exp),
            };
            format!("{mantissa}e{sign}{digits:0>2}")
        }
        None => s, // NaN, inf
    }
}

/// `x` rounded to an integer with thousands separated by commas (`7,783`).
pub fn thousands(x: f64) -> String {
    if !x.is_finite() {
        return format!("{x}");
    }
    let digits = format!("{:.0}", x.abs());
    let mut out = String::with_capacity(digits.len() + digits.len() / 3 + 1);
    if x < 0.0 && digits != "0" {
        out.push('-');
    }
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_for_reading() {
        assert_eq!(sci(0.003142857142857143), "3.14e-03");
        assert_eq!(sci(6e-4), "6.00e-04");
        assert_eq!(sci(12.5), "1.25e+01");
        assert_eq!(thousands(7783.488642309049), "7,783");
        assert_eq!(thousands(999.4), "999");
        assert_eq!(thousands(1_234_567.0), "1,234,567");
        assert_eq!(thousands(0.2), "0");
    }

    #[test]
    fn the_step_line_is_llm_cs() {
        let m = StepMetrics {
            step: 9,
            run: None,
            loss: 4.014428615570068,
            lr: 0.003142857142857143,
            grad_norm: 1.6953209761548143,
            step_ms: 8.21,
            tokens_per_s: 7783.488642309049,
            mfu: 0.1182990644976354,
            epoch: 0,
            train_eval_loss: None,
            val_loss: None,
            parallel: None,
            phase_ms: None,
            phase_host_ms: None,
        };
        assert_eq!(
            step_line(&m, 200),
            "step 10/200 | loss 4.0144 | lr 3.14e-03 | norm 1.70 | 8.2 ms | 7,783 tok/s | mfu 11.8%"
        );
        let v = StepMetrics {
            train_eval_loss: Some(4.125),
            val_loss: Some(4.25),
            ..m
        };
        assert!(step_line(&v, 200).ends_with("| mfu 11.8% | eval train 4.1250 | val 4.2500"));
        assert_eq!(
            done_line(200, Some(0.64926), None, 5058.4),
            "done: 200 steps, final loss 0.6493, 5,058 tok/s"
        );
    }
}
