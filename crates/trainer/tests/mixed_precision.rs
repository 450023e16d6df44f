//! bf16 compute with fp32 master weights under every kind of layout, through the real `mtrain`
//! binary and its launcher: each layout in bf16 trains like one rank in bf16, with gradients
//! reduced in f32 (the default) and in bf16; checkpoints hold the fp32 masters; the memory
//! report's analytic bytes follow the mixed-precision rule.
//!
//! Tolerance: the layout runs the same math as one rank, but its bf16 gradients are summed in
//! a different order (per-rank partial sums, then the reduction; tensor-parallel partial
//! matmuls), and every bf16 rounding of a different partial sum moves the result by up to one
//! bf16 ulp (2^-8 ≈ 3.9e-3 relative). Over 5 steps of the tiny model the mean losses agree to a
//! few 1e-5; the bound asserted is loss rel ≤ 2e-3, half a bf16 ulp.
//!
//! Tiny model (the built-in preset), 2 sequences of 32 tokens per dp rank, 5 steps.

use std::path::Path;

use serde_json::Value;

mod common;
use common::{run_mtrain, text, tmp};

/// `mtrain parity --dtype bf16` of `vs` against one bf16 rank over 5 steps, gradients reduced
/// in `reduce`; asserts loss rel ≤ 2e-3 and returns the largest loss difference seen.
fn bf16_parity(vs: &str, reduce: &str) -> f64 {
    let dir = tmp("bf16-parity");
    let out_dir = dir.path().display().to_string();
    let reduce = format!("grad_reduce_dtype={reduce}");
    let o = run_mtrain(&[
        "parity",
        "--vs",
        vs,
        "--steps",
        "5",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--tol",
        "2e-3",
        "--set",
        "dtype=bf16",
        "--set",
        &reduce,
        "--out",
        &out_dir,
    ]);
    let t = text(&o);
    assert!(
        o.status.success(),
        "bf16 parity `{vs}` ({reduce}) failed:\n{t}"
    );
    assert!(t.contains("parity OK"), "{t}");
    let rows: Vec<f64> = t
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 7 && f[0].parse::<u64>().is_ok()).then(|| f[3].parse::<f64>().ok())?
        })
        .collect();
    assert_eq!(rows.len(), 5, "five steps compared:\n{t}");
    let worst = rows.iter().copied().fold(0.0, f64::max);
    assert!(
        worst <= 2e-3,
        "`{vs}` ({reduce}): loss rel {worst:e} > 2e-3\n{t}"
    );
    worst
}

#[test]
fn bf16_ddp_dp2_equals_one_bf16_rank_with_f32_and_bf16_reduction() {
    bf16_parity("--dp 2", "f32");
    bf16_parity("--dp 2", "bf16");
}

#[test]
fn bf16_zero3_dp2_equals_one_bf16_rank_with_f32_and_bf16_reduction() {
    bf16_parity("--dp 2 --fsdp", "f32");
    bf16_parity("--dp 2 --fsdp", "bf16");
}

#[test]
fn bf16_tp2_and_pp2_equal_one_bf16_rank() {
    bf16_parity("--tp 2", "f32");
    bf16_parity("--pp 2", "f32");
    bf16_parity("--pp 2", "bf16");
}

#[test]
fn bf16_tp2_pp2_dp2_equals_one_bf16_rank_with_f32_and_bf16_reduction() {
    bf16_parity("--tp 2 --pp 2 --dp 2", "f32");
    bf16_parity("--tp 2 --pp 2 --dp 2", "bf16");
}

/// Trains `layout` in bf16 for `steps` steps with a checkpoint at the end; returns the run dir.
fn train_bf16(layout: &[&str], batch: &str, steps: &str, run_dir: &Path, extra: &[&str]) {
    let rd = run_dir.display().to_string();
    let mut args: Vec<&str> = layout.to_vec();
    args.extend_from_slice(&[
        "--steps",
        steps,
        "--batch-size",
        batch,
        "--seq-len",
        "32",
        "--dtype",
        "bf16",
        "--set",
        "eval_every=0",
        "--run-dir",
        &rd,
    ]);
    args.extend_from_slice(extra);
    let o = run_mtrain(&args);
    assert!(o.status.success(), "mtrain {args:?} failed:\n{}", text(&o));
}

#[test]
fn bf16_checkpoints_hold_fp32_masters_equal_to_one_rank_within_the_adam_bound() {
    use candle_core::{DType, Device};
    let (one, zero3) = (tmp("bf16-one"), tmp("bf16-zero3"));
    train_bf16(&[], "4", "3", one.path(), &[]);
    train_bf16(&["--dp", "2", "--fsdp"], "2", "3", zero3.path(), &[]);
    let load = |p: &Path| {
        let dir = mtrain_trainer::checkpoint::resolve(p).expect("a checkpoint");
        let ckpt = mtrain_trainer::checkpoint::load(&dir, &Device::Cpu).expect("load the checkpoint");
        ckpt.full_model(&Device::Cpu).expect("read its weights")
    };
    let (a, b) = (load(one.path()), load(zero3.path()));
    assert_eq!(a.len(), b.len());
    // Adam moves a weight by at most about lr per step (|m̂ / √v̂| ≤ 1 for these β), so two runs
    // that see slightly different gradients drift apart by at most 2 · Σ lr_t ≤ 2 · 3 · 6e-3.
    let bound = 2.0 * 3.0 * 6e-3;
    let mut off_grid = 0usize;
    let mut total = 0usize;
    for (name, ta) in &a {
        let tb = &b[name];
        assert_eq!(
            ta.dtype(),
            DType::F32,
            "`{name}` of one rank is {:?}",
            ta.dtype()
        );
        assert_eq!(
            tb.dtype(),
            DType::F32,
            "`{name}` of ZeRO-3 is {:?}",
            tb.dtype()
        );
        let diff = (ta - tb)
            .and_then(|d| d.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>())
            .expect("difference");
        assert!(
            f64::from(diff) <= bound,
            "`{name}`: masters differ by {diff} > {bound}"
        );
        // fp32 masters, not bf16 values stored as f32: most elements fall between bf16 values.
        let rounded = tb
            .to_dtype(DType::BF16)
            .and_then(|t| t.to_dtype(DType::F32))
            .expect("round");
        let ne = tb
            .ne(&rounded)
            .and_then(|m| m.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>())
            .expect("count");
        off_grid += ne as usize;
        total += tb.elem_count();
    }
    assert!(
        off_grid * 2 > total,
        "only {off_grid} of {total} checkpointed elements are off the bf16 grid: not fp32 masters"
    );
    // And the layout did compute in bf16: the same layout in f32 ends elsewhere.
    let f32_run = tmp("f32-zero3");
    let rd = f32_run.path().display().to_string();
    let o = run_mtrain(&[
        "--dp",
        "2",
        "--fsdp",
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--set",
        "eval_every=0",
        "--run-dir",
        &rd,
    ]);
    assert!(o.status.success(), "f32 ZeRO-3 failed:\n{}", text(&o));
    let c = load(f32_run.path());
    let moved = b.iter().any(|(name, tb)| {
        let d = (tb - &c[name])
            .and_then(|d| d.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>())
            .expect("difference");
        d > 1e-5
    });
    assert!(
        moved,
        "bf16 ZeRO-3 ended exactly where f32 ZeRO-3 did: it did not compute in bf16"
    );
}

/// The analytic model state of rank 0's last memory report: (params, grads, optim) bytes.
fn analytic(layout: &[&str], dtype: &str) -> (f64, f64, f64) {
    let dir = tmp("bf16-memory");
    let rd = dir.path().display().to_string();
    let mut args: Vec<&str> = layout.to_vec();
    args.extend_from_slice(&[
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--dtype",
        dtype,
        "--mem-report",
        "--set",
        "eval_every=0",
        "--run-dir",
        &rd,
    ]);
    let o = run_mtrain(&args);
    assert!(o.status.success(), "mtrain {args:?} failed:\n{}", text(&o));
    let s = std::fs::read_to_string(dir.path().join("memory.jsonl")).expect("memory.jsonl");
    let line: Value = s
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("a JSON line"))
        .find(|l| l["rank"].as_u64() == Some(0))
        .expect("rank 0's report");
    let a = &line["analytic"];
    let f = |k: &str| {
        a[k].as_f64()
            .unwrap_or_else(|| panic!("analytic.{k} in {line}"))
    };
    (f("params"), f("grads"), f("optim"))
}

#[test]
fn memory_report_follows_the_mixed_precision_rule() {
    // fp32 DDP: 4 + 4 + 8 bytes per parameter; bf16 DDP: 2 + 2 + (4 master + 8 Adam).
    let (p32, g32, o32) = analytic(&["--dp", "2"], "f32");
    let (p, g, o) = analytic(&["--dp", "2"], "bf16");
    let phi = p32 / 4.0;
    assert_eq!((g32, o32), (4.0 * phi, 8.0 * phi));
    assert_eq!((p, g, o), (2.0 * phi, 2.0 * phi, 12.0 * phi), "bf16 DDP");
    assert_eq!(p + g + o, 16.0 * phi);
    // ZeRO-3 over 2 ranks: all of it halved (16Φ/N).
    let (zp, zg, zo) = analytic(&["--dp", "2", "--fsdp"], "bf16");
    assert_eq!(
        (zp, zg, zo),
        (phi, phi, 6.0 * phi),
        "bf16 ZeRO-3 on 2 ranks"
    );
}
