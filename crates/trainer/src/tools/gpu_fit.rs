//! Before launch: do the ranks the launcher places on each GPU fit in its free memory?
//!
//! With fewer GPUs than local ranks the workers share the GPUs round-robin (local rank r on
//! GPU r mod G). Each rank then holds its own copy of everything a rank needs, so a layout
//! that fits one rank per GPU may not fit four on one; the launcher checks before any worker
//! starts, so the answer is one message rather than a worker's out-of-memory stack trace.
//!
//! ```text
//!   GPU g holds local ranks { r : r mod G = g }            (3 ranks on 2 GPUs: {0, 2}, {1})
//!   need(r)  = predicted(r) + CONTEXT_ALLOWANCE
//!   predicted(r) = parameters + optimizer state + the step's peak above its start
//!                  (the memory report's analytic figures for r's pipeline stage,
//!                   `plan::rank_memory`, which `mtrain plan` prints)
//!   refuse when  Σ_{r on g} need(r) > free(g)   (cuMemGetInfo, read by the launcher)
//! ```
//!
//! The free figure is read while the launcher itself holds a context on the GPU, which it
//! releases before the workers start, so the check errs on the side of refusing.
//! `MTRAIN_NO_MEMORY_CHECK=1` launches anyway.

use std::fmt::Write as _;

use mtrain_parallel::parallelize::ParallelPlan;

use crate::config::TrainConfig;
use crate::launch::LaunchSpec;

/// What a rank takes beyond the memory model's prediction: its CUDA context, cuBLAS's
/// workspace, the compiled kernels and the collectives' shared buffers (an allowance, not a
/// figure the model computes).
pub const CONTEXT_ALLOWANCE: u64 = 512 << 20;

/// The variable that skips the check.
pub const SKIP_VAR: &str = "MTRAIN_NO_MEMORY_CHECK";

/// Whether the user asked to skip the check (`MTRAIN_NO_MEMORY_CHECK=1`).
pub fn skipped() -> bool {
    std::env::var(SKIP_VAR).as_deref() == Ok("1")
}

/// One GPU's memory as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuFree {
    /// CUDA ordinal.
    pub gpu: usize,
    /// The device's name (`NVIDIA H200`).
    pub name: String,
    /// Free bytes now.
    pub free: u64,
    /// Bytes in total.
    pub total: u64,
}

/// The ranks that do not fit, one line per GPU that is short, and what to do about it.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DoesNotFit(pub String);

/// The local ranks on each of `gpus` GPUs under round-robin placement.
pub fn placement(local_ranks: usize, gpus: usize) -> Vec<Vec<usize>> {
    (0..gpus)
        .map(|g| (g..local_ranks).step_by(gpus.max(1)).collect())
        .collect()
}

/// The memory model's prediction for each of this node's ranks (`launch`'s local ranks, in
/// order): parameters + optimizer state + the step's peak of the rank's pipeline stage.
pub fn predicted_per_rank(
    cfg: &TrainConfig,
    plan: &ParallelPlan,
    launch: &LaunchSpec,
) -> anyhow::Result<Vec<u64>> {
    let stages = crate::tools::plan::rank_memory(cfg, plan)?;
    Ok(launch
        .node_ranks()
        .map(|rank| {
            let a = &stages[plan.dims.coords(rank).pp].analytic;
            a.params + a.optim + a.peak
        })
        .collect())
}

fn bytes(b: u64) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    const MIB: f64 = (1u64 << 20) as f64;
    match b >= 1 << 30 {
        true => format!("{:.2} GiB", b as f64 / GIB),
        false => format!("{:.1} MiB", b as f64 / MIB),
    }
}

/// `4 × 1.20 GiB` when the figures are equal, else `1.20 GiB + 1.10 GiB`; one alone as it is.
fn sum_of(figures: &[u64]) -> String {
    match (figures.len(), figures.windows(2).all(|w| w[0] == w[1])) {
        (1, _) => bytes(figures[0]),
        (n, true) => format!("{n} × {}", bytes(figures[0])),
        (_, false) => figures
            .iter()
            .map(|b| bytes(*b))
            .collect::<Vec<_>>()
            .join(" + "),
    }
}

/// Check that the ranks placed on each GPU of `gpus` fit its free memory, given the
/// prediction for each local rank (`predicted[r]`, as [`predicted_per_rank`] computes it).
pub fn check(predicted: &[u64], gpus: &[GpuFree]) -> Result<(), DoesNotFit> {
    let mut short = String::new();
    for (ranks, gpu) in placement(predicted.len(), gpus.len()).iter().zip(gpus) {
        if ranks.is_empty() {
            continue;
        }
        let pred: Vec<u64> = ranks.iter().map(|&r| predicted[r]).collect();
        let need: u64 = pred.iter().map(|p| p + CONTEXT_ALLOWANCE).sum();
        if need <= gpu.free {
            continue;
        }
        let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
        let (s, held) = match ranks.len() {
            1 => ("", "it needs"),
            _ => ("s", "they need"),
        };
        let _ = writeln!(
            short,
            "GPU {} ({}) holds {} rank{s} (local rank{s} {}): {held} {}, but {} of {} is free \
             (per rank: {} predicted by the memory model, parameters + optimizer state + the \
             step's peak, and {} for its CUDA context and buffers)",
            gpu.gpu,
            gpu.name,
            ranks.len(),
            list.join(", "),
            match ranks.len() {
                1 => bytes(need),
                _ => format!(
                    "{} = {}",
                    sum_of(
                        &pred
                            .iter()
                            .map(|p| p + CONTEXT_ALLOWANCE)
                            .collect::<Vec<_>>()
                    ),
                    bytes(need)
                ),
            },
            bytes(gpu.free),
            bytes(gpu.total),
            sum_of(&pred),
            bytes(CONTEXT_ALLOWANCE),
        );
    }
    if short.is_empty() {
        return Ok(());
    }
    Err(DoesNotFit(format!(
        "{} ranks on {} GPU(s) do not fit in the GPUs' free memory; nothing was launched:\n{short}\
         Run fewer ranks per GPU (smaller --dp, --tp or --pp, or more GPUs), a smaller micro-batch \
         (--batch-size, with --grad-accum for the same global batch) or --activation-checkpointing; \
         `mtrain plan` with the same flags prints each rank's prediction ({SKIP_VAR}=1 launches anyway)",
        predicted.len(),
        gpus.len()
    )))
}

/// [`check`] for the run `cfg` under `plan`, launched as `launch`, on GPUs with `free` memory
/// (as the launcher reads it: every visible GPU, in ordinal order).
pub fn check_launch(
    cfg: &TrainConfig,
    plan: &ParallelPlan,
    launch: &LaunchSpec,
    free: &[GpuFree],
) -> anyhow::Result<()> {
    // A plan the model cannot predict is not refused for it: the check is skipped, and says so.
    let predicted = match predicted_per_rank(cfg, plan, launch) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(
                "no memory prediction per rank ({e:#}): the GPUs' free memory is not checked"
            );
            return Ok(());
        }
    };
    check(&predicted, free)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn h200(gpu: usize, free: u64) -> GpuFree {
        GpuFree {
            gpu,
            name: "NVIDIA H200".into(),
            free,
            total: 140 * GIB,
        }
    }

    #[test]
    fn ranks_go_round_robin() {
        assert_eq!(placement(4, 1), vec![vec![0, 1, 2, 3]]);
        assert_eq!(placement(3, 2), vec![vec![0, 2], vec![1]]);
        assert_eq!(
            placement(8, 4),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        assert_eq!(placement(1, 2), vec![vec![0], vec![]]);
    }

    #[test]
    fn ranks_that_fit_launch() {
        // 4 × (1 GiB + the allowance) = 6 GiB on a GPU with 6 GiB free: fits exactly.
        let need = 4 * (GIB + CONTEXT_ALLOWANCE);
        assert!(check(&[GIB; 4], &[h200(0, need)]).is_ok());
    }

    #[test]
    fn ranks_that_do_not_fit_are_refused_with_the_figures_and_what_to_do() {
        let e = check(&[GIB; 4], &[h200(0, 5 * GIB)])
            .unwrap_err()
            .to_string();
        for part in [
            "GPU 0 (NVIDIA H200)",
            "4 ranks on 1 GPU(s) do not fit",
            "holds 4 ranks (local ranks 0, 1, 2, 3): they need 4 × 1.50 GiB = 6.00 GiB",
            "5.00 GiB of 140.00 GiB is free",
            "per rank: 4 × 1.00 GiB predicted",
            "512.0 MiB for its CUDA context",
            "nothing was launched",
            "fewer ranks per GPU",
            "--batch-size",
            "--activation-checkpointing",
            "MTRAIN_NO_MEMORY_CHECK=1",
        ] {
            assert!(e.contains(part), "missing {part:?} in:\n{e}");
        }
    }

    /// 3 ranks on 2 GPUs: GPU 0 holds ranks 0 and 2, GPU 1 rank 1. Each GPU is checked
    /// against its own ranks: here GPU 0 is short, GPU 1 is not, and uneven predictions
    /// (pipeline stages of different sizes) are listed one by one.
    #[test]
    fn an_uneven_placement_is_checked_per_gpu() {
        let pred = [GIB, 3 * GIB, 2 * GIB];
        let half = CONTEXT_ALLOWANCE;
        // GPU 0 needs 1.5 + 2.5 = 4 GiB, GPU 1 needs 3.5 GiB.
        let fits = [h200(0, 4 * GIB), h200(1, 3 * GIB + half)];
        assert!(check(&pred, &fits).is_ok());
        let e = check(&pred, &[h200(0, 4 * GIB - 1), h200(1, 40 * GIB)])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("3 ranks on 2 GPU(s)"), "{e}");
        assert!(
            e.contains("GPU 0 (NVIDIA H200) holds 2 ranks (local ranks 0, 2)"),
            "{e}"
        );
        assert!(
            e.contains("they need 1.50 GiB + 2.50 GiB = 4.00 GiB"),
            "{e}"
        );
        assert!(e.contains("per rank: 1.00 GiB + 2.00 GiB predicted"), "{e}");
        assert!(!e.contains("GPU 1"), "{e}");
        let e = check(&pred, &[h200(0, 40 * GIB), h200(1, 3 * GIB)])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("GPU 1 (NVIDIA H200) holds 1 rank (local rank 1): it needs 3.50 GiB"),
            "{e}"
        );
        assert!(!e.contains("GPU 0"), "{e}");
    }

    /// The prediction per local rank is its pipeline stage's: tp 2 × pp 2 puts ranks 0, 1 on
    /// stage 0 and 2, 3 on stage 1 (rank = (dp·pp + pp_idx)·tp + tp_idx), and it is the
    /// report's analytic parameters + optimizer state + peak.
    #[test]
    fn each_rank_is_predicted_by_its_stage() {
        use crate::config::ParallelConfig;
        use mtrain_comm::mesh::MeshDims;
        let cfg = TrainConfig::default();
        let plan = ParallelConfig::default()
            .plan(MeshDims::new(1, 2, 2, 1), false, cfg.precision())
            .unwrap();
        let launch = LaunchSpec {
            nproc_per_node: 4,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: None,
        };
        let got = predicted_per_rank(&cfg, &plan, &launch).unwrap();
        let stages = crate::tools::plan::rank_memory(&cfg, &plan).unwrap();
        let of = |s: usize| {
            let a = &stages[s].analytic;
            a.params + a.optim + a.peak
        };
        assert_eq!(got, vec![of(0), of(0), of(1), of(1)]);
        // On one GPU: room for the four ranks, and one byte less.
        let need = 2 * of(0) + 2 * of(1) + 4 * CONTEXT_ALLOWANCE;
        assert!(check_launch(&cfg, &plan, &launch, &[h200(0, need)]).is_ok());
        let e = check_launch(&cfg, &plan, &launch, &[h200(0, need - 1)]).unwrap_err();
        assert!(e.to_string().starts_with("4 ranks on 1 GPU(s)"), "{e}");
        assert!(of(0) > 0 && of(0) != of(1), "{got:?}");
    }
}
