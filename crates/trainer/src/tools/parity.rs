//! `mtrain parity`: does a layout train exactly like one device?
//!
//! ```text
//! mtrain parity --config configs/tiny.toml --vs "--tp 2 --pp 2 --dp 2" [--steps 10] [--tol 1e-5]
//!
//!   reference:  mtrain --batch-size dp·B ...               one rank, the whole global batch
//!   layout:     mtrain --tp 2 --pp 2 --dp 2 --batch-size B  dp rank d reads rows d·B..(d+1)·B
//!               same seed, same data order, same steps: the dp slices concatenate to the
//!               reference batch, so the losses must agree up to floating-point reassociation.
//!
//!   step   loss (1 rank)   loss (layout)    rel diff   grad-norm (1)  grad-norm (layout)  rel diff
//! ```
//!
//! An MoE model routes each dp rank's micro-batch on its own (expert capacity and the balancing
//! loss are per routing group), so for MoE the reference runs the same groups one after the other
//! as gradient-accumulation micro-steps: `--batch-size B --grad-accum dp·K` (the same rows, the same
//! routing, gradients averaged the same way).
//!
//! The reference takes the `--vs` flags that decide one device's arithmetic (`--device`,
//! `--dtype`, `--backward`: [`reference_flags`]), so `--vs "--tp 2 --device cuda --comm ipc"`
//! compares against one rank on the same GPU in the same dtype; `--comm` stays the layout's
//! (one rank has no peers).
//!
//! Both runs go through this binary and its launcher (separate processes, the real TCP
//! backend), each into its own run directory, and are compared through their metrics.jsonl.
//! The command exits non-zero when the largest relative loss difference exceeds `--tol`; the
//! gradient-norm difference is printed beside it (it is more sensitive: a norm of a difference of
//! nearly equal sums).

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context};
use clap::Parser;

use crate::cli::{Cli, ParityArgs};
use crate::config::TrainArgs;

/// One step of a run's metrics.jsonl.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    pub step: u64,
    pub loss: f64,
    pub grad_norm: f64,
}

/// The comparison of two runs.
#[derive(Debug, Clone)]
pub struct Parity {
    pub reference: Vec<Point>,
    pub layout: Vec<Point>,
    /// Largest |a − b| / |a| over the loss series.
    pub max_loss_rel: f64,
    /// Largest |a − b| / |a| over the gradient-norm series.
    pub max_grad_norm_rel: f64,
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / a.abs().max(1e-30)
}

impl Parity {
    /// Compares two series step by step; they must cover the same steps.
    pub fn compare(reference: Vec<Point>, layout: Vec<Point>) -> anyhow::Result<Self> {
        let steps = |v: &[Point]| v.iter().map(|p| p.step).collect::<Vec<_>>();
        if steps(&reference) != steps(&layout) || reference.is_empty() {
            bail!(
                "the runs logged different steps: one rank {:?}, layout {:?}",
                steps(&reference),
                steps(&layout)
            );
        }
        let max = |f: fn(&Point) -> f64| {
            reference
                .iter()
                .zip(&layout)
                .map(|(a, b)| rel(f(a), f(b)))
                .fold(0.0, f64::max)
        };
        Ok(Self {
            max_loss_rel: max(|p| p.loss),
            max_grad_norm_rel: max(|p| p.grad_norm),
            reference,
            layout,
        })
    }

    /// The side-by-side table.
    pub fn table(&self, vs: &str) -> String {
        let mut s = format!(
            "{:>5} {:>14} {:>14} {:>10} {:>14} {:>14} {:>10}\n",
            "step", "loss (1 rank)", "loss (layout)", "rel", "gnorm (1)", "gnorm (layout)", "rel"
        );
        for (a, b) in self.reference.iter().zip(&self.layout) {
            s.push_str(&format!(
                "{:>5} {:>14.8} {:>14.8} {:>10.2e} {:>14.8} {:>14.8} {:>10.2e}\n",
                a.step,
                a.loss,
                b.loss,
                rel(a.loss, b.loss),
                a.grad_norm,
                b.grad_norm,
                rel(a.grad_norm, b.grad_norm)
            ));
        }
        s.push_str(&format!(
            "max relative difference vs `{vs}`: loss {:.3e}, grad norm {:.3e}\n",
            self.max_loss_rel, self.max_grad_norm_rel
        ));
        s
    }
}

/// Reads the (step, loss, grad_norm) series of a run directory's metrics.jsonl.
pub fn read_metrics(run_dir: &Path) -> anyhow::Result<Vec<Point>> {
    let path = run_dir.join("metrics.jsonl");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{} line {}", path.display(), i + 1))?;
        let num = |k: &str| {
            v.get(k)
                .and_then(|x| x.as_f64())
                .with_context(|| format!("{} line {} has no number `{k}`", path.display(), i + 1))
        };
        out.push(Point {
            step: num("step")? as u64,
            loss: num("loss")?,
            grad_norm: num("grad_norm")?,
        });
    }
    Ok(out)
}

/// The flags of the layout's command line (`--vs`) that the one-rank reference runs with too:
/// the device, the compute dtype and the backward path, as given.
pub fn reference_flags(layout: &TrainArgs) -> Vec<String> {
    fn name<T: clap::ValueEnum>(v: &T) -> String {
        v.to_possible_value()
            .map(|p| p.get_name().to_string())
            .unwrap_or_default()
    }
    let mut out = Vec::new();
    if let Some(d) = &layout.device {
        out.extend(["--device".to_string(), name(d)]);
    }
    if let Some(d) = &layout.dtype {
        out.extend(["--dtype".to_string(), name(d)]);
    }
    if let Some(b) = &layout.backward {
        out.extend(["--backward".to_string(), name(b)]);
    }
    out
}

/// Runs this binary with `args`; its output is shown only when it fails.
fn run_mtrain(args: &[String], what: &str) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("locating the mtrain binary")?;
    eprintln!("parity: {what}: mtrain {}", args.join(" "));
    let out = Command::new(&exe)
        .args(args)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("LOCAL_RANK")
        .env_remove("LOCAL_WORLD_SIZE")
        .output()
        .with_context(|| format!("starting {}", exe.display()))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(30).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "the {what} run failed ({}):\n{}",
            out.status,
            tail.join("\n")
        );
    }
    Ok(())
}

/// `mtrain parity`: run both, print the table, fail over the tolerance.
pub fn run(args: &ParityArgs) -> anyhow::Result<()> {
    crate::validate::non_negative("--tol", args.tol).map_err(anyhow::Error::msg)?;
    let vs: Vec<String> = args.vs.split_whitespace().map(str::to_string).collect();
    let mut argv = vec!["mtrain".to_string()];
    argv.extend(vs.iter().cloned());
    let cli = Cli::try_parse_from(&argv)
        .with_context(|| format!("parsing the layout flags `{}`", args.vs))?;
    if cli.command.is_some() {
        bail!(
            "--vs takes layout and strategy flags, not a subcommand: `{}`",
            args.vs
        );
    }
    // The layout run's configuration: the file (its [parallel] table too) under the --vs flags.
    let probe = crate::config::TrainArgs {
        config: args.config.clone(),
        model: args.model.clone(),
        overrides: args.overrides.clone(),
        ..Default::default()
    };
    let resolved = cli
        .config_from(&probe)
        .context("resolving the configuration")?;
    let dp = cli.layout.resolve(&resolved.parallel, None)?.dims.dp;
    let batch = args.batch_size.unwrap_or(resolved.batch_size);
    let moe = resolved.gpt_config()?.moe.is_some();

    let out = match &args.out {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("mtrain-parity-{}", std::process::id())),
    };
    let (one_dir, layout_dir) = (out.join("one-rank"), out.join("layout"));
    for d in [&one_dir, &layout_dir] {
        if d.exists() {
            std::fs::remove_dir_all(d).with_context(|| format!("clearing {}", d.display()))?;
        }
    }
    let mut common: Vec<String> = Vec::new();
    if let Some(c) = &args.config {
        common.extend(["--config".into(), c.display().to_string()]);
    }
    if let Some(m) = &args.model {
        common.extend(["--model".into(), m.clone()]);
    }
    if let Some(t) = args.seq_len {
        common.extend(["--seq-len".into(), t.to_string()]);
    }
    common.extend([
        "--steps".into(),
        args.steps.to_string(),
        "--log-every".into(),
        "1".into(),
        "--eval-every".into(),
        "0".into(),
    ]);
    for o in &args.overrides {
        common.extend(["--set".into(), o.clone()]);
    }

    let mut one = common.clone();
    one.extend(reference_flags(&cli.train));
    if moe {
        // Routing (capacity, drops, balancing loss) is per group of tokens routed together,
        // which is one dp rank's micro-batch: the reference routes the same groups, one after
        // the other, as gradient-accumulation micro-steps.
        one.extend([
            "--batch-size".into(),
            batch.to_string(),
            "--grad-accum".into(),
            (resolved.grad_accum * dp).to_string(),
        ]);
    } else {
        one.extend(["--batch-size".into(), (batch * dp).to_string()]);
    }
    // One rank whatever the file's [parallel] table says: the default layout.
    one.extend([
        "--set".into(),
        "parallel={}".into(),
        "--run-dir".into(),
        one_dir.display().to_string(),
    ]);
    run_mtrain(&one, "one-rank")?;

    let mut lay = vs.clone();
    lay.extend(common);
    lay.extend([
        "--batch-size".into(),
        batch.to_string(),
        "--run-dir".into(),
        layout_dir.display().to_string(),
    ]);
    run_mtrain(&lay, "layout")?;

    let p = Parity::compare(read_metrics(&one_dir)?, read_metrics(&layout_dir)?)?;
    print!("{}", p.table(&args.vs));
    if !(p.max_loss_rel <= args.tol) {
        bail!(
            "`{}` differs from one rank: max relative loss difference {:.3e} > tolerance {:.1e}",
            args.vs,
            p.max_loss_rel,
            args.tol
        );
    }
    println!(
        "parity OK: `{}` matches one rank within {:.1e} over {} steps",
        args.vs,
        args.tol,
        p.reference.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pts(losses: &[f64]) -> Vec<Point> {
        losses
            .iter()
            .enumerate()
            .map(|(i, &l)| Point {
                step: i as u64,
                loss: l,
                grad_norm: 2.0 * l,
            })
            .collect()
    }

    fn flags(vs: &str) -> Vec<String> {
        let argv = std::iter::once("mtrain").chain(vs.split_whitespace());
        reference_flags(&Cli::try_parse_from(argv).unwrap().train)
    }

    /// The reference runs where the layout runs and in its dtype; the layout's own flags
    /// (degrees, strategy, backend) stay the layout's.
    #[test]
    fn the_reference_takes_the_layouts_device_dtype_and_backward() {
        assert_eq!(
            flags("--tp 2 --sequence-parallel --device cuda --dtype f32 --comm ipc"),
            ["--device", "cuda", "--dtype", "f32"]
        );
        assert_eq!(
            flags("--dp 2 --dtype bf16 --backward autograd --fsdp"),
            ["--dtype", "bf16", "--backward", "autograd"]
        );
        assert!(flags("--pp 2 --schedule interleaved --virtual-stages 2").is_empty());
    }

    #[test]
    fn relative_difference_is_the_largest_over_steps() {
        let p = Parity::compare(pts(&[4.0, 2.0]), pts(&[4.0, 2.002])).unwrap();
        assert!((p.max_loss_rel - 1e-3).abs() < 1e-12, "{}", p.max_loss_rel);
        assert!((p.max_grad_norm_rel - 1e-3).abs() < 1e-12);
        assert!(Parity::compare(pts(&[1.0]), pts(&[1.0, 2.0])).is_err());
    }
}
