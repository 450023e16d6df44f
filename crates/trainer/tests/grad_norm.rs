//! The global gradient norm costs one world all-reduce per optimizer step: the loop asks the
//! model for ‖g‖² once, clips with that norm, and the model's optimizer step uses the coefficient
//! it is given instead of computing the norm again.
//!
//! Checked on the comm trace (`--trace` records every op of every group) of real `mtrain` runs
//! through the launcher: for a composed plan (tp 2 × pp 2) and ZeRO-3 over dp 2, every rank's
//! world group issues exactly one all-reduce, of one f64, per step (its other ops are the final
//! checkpoint's broadcasts).

use std::path::Path;

mod common;
use common::traced_run;

const STEPS: usize = 3;

/// (op, bytes) of every all-reduce `rank`'s world group issued, from its trace file.
fn world_all_reduces(run_dir: &Path, rank: usize) -> Vec<(String, u64)> {
    let path = run_dir.join(format!("trace-rank{rank}.jsonl"));
    let s = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    s.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json line"))
        .filter(|v| v["group"].as_str() == Some("world") && v["op"].as_str() == Some("all_reduce"))
        .map(|v| {
            (
                v["op"].as_str().expect("op").to_string(),
                v["bytes"].as_u64().expect("bytes"),
            )
        })
        .collect()
}

/// Trains `STEPS` steps of the tiny model under `layout` on `world` ranks with tracing on and
/// checks every rank's world group.
fn one_norm_all_reduce_per_step(layout: &[&str], world: usize) {
    let dir = traced_run("norm", layout, "tiny.toml", STEPS, 2, 0);
    for rank in 0..world {
        let ops = world_all_reduces(dir.path(), rank);
        let norm = ("all_reduce".to_string(), 8u64); // Σ g² as one f64
        assert_eq!(
            ops,
            vec![norm; STEPS],
            "{layout:?}, rank {rank}: the world group should issue one gradient-norm \
             all-reduce per step"
        );
    }
}

#[test]
fn tp2_pp2_reduces_the_gradient_norm_once_per_step() {
    one_norm_all_reduce_per_step(&["--tp", "2", "--pp", "2"], 4);
}

#[test]
fn zero3_reduces_the_gradient_norm_once_per_step() {
    one_norm_all_reduce_per_step(&["--dp", "2", "--fsdp"], 2);
}
