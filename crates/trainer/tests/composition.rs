//! 4D composition end to end through the real `mtrain` binary and its launcher: every layout
//! trains like one rank (`mtrain parity`), a checkpoint moves between layouts, a killed worker
//! takes the job down with its name, impossible layouts are refused with the arithmetic, and
//! `--trace` writes one consistent trace per rank.
//!
//! Tiny model (4 layers, width 64), 2 sequences of 32 tokens per dp rank, 5 steps: each run is a
//! few seconds of CPU even with 8 worker processes on 2 cores.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{losses, mtrain, run_mtrain, text, tmp};

fn config(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../configs")
        .join(name)
        .display()
        .to_string()
}

/// `mtrain parity` of `vs` against one rank over 5 steps at rel ≤ 1e-5; returns the report.
fn parity(cfg: &str, vs: &str) -> String {
    common::parity(&["--config", &config(cfg)], vs)
}

#[test]
fn tp2_pp2_dp2_equals_one_rank() {
    parity("tiny.toml", "--tp 2 --pp 2 --dp 2");
}

#[test]
fn tp4_pp2_equals_one_rank() {
    parity("tiny.toml", "--tp 4 --pp 2");
}

#[test]
fn pp2_dp2_fsdp_equals_one_rank() {
    parity("tiny.toml", "--pp 2 --dp 2 --fsdp");
}

#[test]
fn dp2_ep2_moe_equals_one_rank() {
    parity("moe-tiny.toml", "--dp 2 --ep 2");
}

#[test]
fn parity_fails_when_the_layout_trains_differently() {
    // A different learning rate for the layout only cannot match: the command must say so.
    let dir = tmp("parity-bad");
    let out_dir = dir.path().display().to_string();
    let o = run_mtrain(&[
        "parity",
        "--config",
        &config("tiny.toml"),
        "--vs",
        "--dp 2 --lr 1e-2",
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--out",
        &out_dir,
    ]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("differs from one rank"), "{t}");
}

fn train(layout: &[&str], batch: &str, run_dir: &Path, extra: &[&str]) -> Output {
    let rd = run_dir.display().to_string();
    let mut args: Vec<&str> = layout.to_vec();
    args.extend([
        "--config",
        "",
        "--steps",
        "4",
        "--batch-size",
        batch,
        "--seq-len",
        "32",
        "--log-every",
        "1",
        "--eval-every",
        "0",
        "--run-dir",
        &rd,
    ]);
    let cfg = config("tiny.toml");
    let pos = args.iter().position(|a| *a == "").expect("placeholder");
    args[pos] = &cfg;
    args.extend_from_slice(extra);
    run_mtrain(&args)
}

#[test]
fn checkpoint_saved_as_tp2_pp2_resumes_as_dp2_fsdp_and_tp4() {
    // Uninterrupted: tp 2 x pp 2 (dp 1, 4 sequences), checkpoint after step 2 on the way.
    let base = tmp("reshard");
    let full = base.path().join("full");
    let o = train(
        &["--tp", "2", "--pp", "2"],
        "4",
        &full,
        &["--ckpt-every", "2"],
    );
    assert!(o.status.success(), "{}", text(&o));
    let reference = losses(&full);
    assert_eq!(reference.len(), 4);
    let ckpt = full.join("step-00000002");
    assert!(ckpt.is_dir(), "no checkpoint at {}", ckpt.display());
    let ckpt = ckpt.display().to_string();

    // Resumed under other layouts with the same global batch (dp 2 x 2 = 4 sequences).
    for (layout, batch) in [(vec!["--dp", "2", "--fsdp"], "2"), (vec!["--tp", "4"], "4")] {
        let dir = base.path().join(layout.join("_"));
        let o = train(&layout, batch, &dir, &["--resume", &ckpt]);
        assert!(o.status.success(), "{layout:?}: {}", text(&o));
        let resumed = losses(&dir);
        assert_eq!(resumed.len(), 2, "{layout:?} ran steps {resumed:?}");
        for (&(s, a), &(s2, b)) in reference[2..].iter().zip(&resumed) {
            assert_eq!(s, s2);
            let rel = (a - b).abs() / a.abs();
            assert!(
                rel <= 1e-5,
                "{layout:?} step {s}: resumed loss {b} vs uninterrupted {a} (rel {rel:.2e})"
            );
        }
    }
}

/// The lines of `RUN_DIR/checkpoint-memory.jsonl` for `op` ("save", "load"), by rank.
fn checkpoint_memory(run_dir: &Path, op: &str) -> Vec<serde_json::Value> {
    let s = std::fs::read_to_string(run_dir.join("checkpoint-memory.jsonl"))
        .expect("checkpoint-memory.jsonl");
    s.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("a JSON line"))
        .filter(|v| v["op"] == op)
        .collect()
}

/// Bytes a read holds besides what it keeps and the piece it returns: the 32 KiB buffer a
/// stored piece is checked through (`checkpoint/shard_file.rs`).
const READ_BUFFER: u64 = 32 << 10;
/// Bytes a resumed rank holds that are neither its state nor a read's buffers, all of them
/// bookkeeping whose size follows the number of tensors and pieces, not their values. Measured
/// on the tiny model resumed from the dp 4 ZeRO-3 checkpoint below (heap level after each part
/// of the load, 2026-12-07), in bytes:
///
/// ```text
///                                       tp 2 × pp 2 rank 0   one rank
///   the opened checkpoint (manifest:         48 925           48 925
///     its pieces, by-parameter index,
///     file digests; meta.json)
///   the model's non-state (parameter         19 076           22 012
///     names and handles, holdings and
///     layout tables, optimizer groups)
///   AdamW's state map (names, step)          11 632           27 768
///   the read's transient beyond the          29 572           30 076
///     largest piece (READ_BUFFER's part)
///   rise − own pieces − largest piece       109 205          128 781
/// ```
///
/// The first three together are 98 705 bytes at most, so 112 KiB (the rest of the margin for
/// paths of other lengths); the last is within READ_BUFFER. The model holds no attention mask
/// or position table.
const NOT_STATE: u64 = 112 << 10;

#[test]
fn sharded_checkpoint_from_dp4_fsdp_resumes_as_tp2_pp2_and_one_rank() {
    // Uninterrupted: dp 4 with ZeRO-3 (2 sequences each), sharded checkpoint after step 2.
    let base = tmp("sharded");
    let full = base.path().join("full");
    let o = train(&["--dp", "4", "--fsdp"], "2", &full, &["--ckpt-every", "2"]);
    assert!(o.status.success(), "{}", text(&o));
    let reference = losses(&full);
    assert_eq!(reference.len(), 4);
    let step2 = full.join("step-00000002");
    for r in 0..4 {
        assert!(step2.join(format!("rank-{r:05}.safetensors")).is_file(), "rank {r}'s shard");
    }
    assert!(!step2.join("model.safetensors").exists(), "nothing gathered");
    // Saving: no rank's heap rose by more than its own pieces plus one piece's buffer.
    let saves = checkpoint_memory(&full, "save");
    assert_eq!(saves.len(), 8, "4 ranks x 2 checkpoints");
    for s in &saves {
        let (rise, own, one) = (
            s["heap_rise_bytes"].as_u64().unwrap(),
            s["piece_bytes"].as_u64().unwrap(),
            s["largest_piece_bytes"].as_u64().unwrap(),
        );
        assert!(rise <= own + one, "save on rank {}: rose {rise} > {own} + {one}", s["rank"]);
    }
    let ckpt = step2.display().to_string();

    // Resumed as tp 2 x pp 2 (dp 1, 8 sequences) and on one rank (8 sequences).
    for layout in [vec!["--tp", "2", "--pp", "2"], vec![]] {
        let dir = base.path().join(format!("resumed{}", layout.join("_")));
        let o = train(&layout, "8", &dir, &["--resume", &ckpt]);
        assert!(o.status.success(), "{layout:?}: {}", text(&o));
        let resumed = losses(&dir);
        assert_eq!(resumed.len(), 2, "{layout:?} ran steps {resumed:?}");
        for (&(s, a), &(s2, b)) in reference[2..].iter().zip(&resumed) {
            assert_eq!(s, s2);
            let rel = (a - b).abs() / a.abs();
            assert!(
                rel <= 1e-5,
                "{layout:?} step {s}: resumed loss {b} vs uninterrupted {a} (rel {rel:.2e})"
            );
        }
        // Loading: the heap rose by the rank's own pieces (its weights and moments), one piece's
        // buffer, the read buffer and the model's buffers that are not state, no more.
        let loads = checkpoint_memory(&dir, "load");
        let world = if layout.is_empty() { 1 } else { 4 };
        assert_eq!(loads.len(), world, "one load line per rank");
        for l in &loads {
            let (rise, own, one) = (
                l["heap_rise_bytes"].as_u64().unwrap(),
                l["piece_bytes"].as_u64().unwrap(),
                l["largest_piece_bytes"].as_u64().unwrap(),
            );
            let bound = own + one + READ_BUFFER + NOT_STATE;
            assert!(rise <= bound, "{layout:?} load on rank {}: rose {rise} > {bound}", l["rank"]);
        }
    }

    // One damaged shard file: refused naming the file and the rank that wrote it; the other
    // checkpoint is untouched and still resumes.
    let victim = full.join("step-00000004").join("rank-00002.safetensors");
    let mut bytes = std::fs::read(&victim).unwrap();
    let k = bytes.len() / 2;
    bytes[k] ^= 0x10;
    std::fs::write(&victim, &bytes).unwrap();
    let bad = full.join("step-00000004").display().to_string();
    let dir = base.path().join("damaged");
    let o = train(&["--tp", "2", "--pp", "2"], "8", &dir, &["--resume", &bad]);
    let t = text(&o);
    assert!(!o.status.success(), "a damaged shard must be refused:\n{t}");
    assert!(
        t.contains("rank-00002.safetensors (written by rank 2)") && t.contains("checksum"),
        "{t}"
    );
    let dir = base.path().join("again");
    let o = train(&["--dp", "4", "--fsdp"], "2", &dir, &["--resume", &ckpt]);
    assert!(o.status.success(), "step 2 still resumes: {}", text(&o));
    assert_eq!(losses(&dir).len(), 2);
}

/// The worker processes of launcher `pid` as (rank, pid).
fn workers(pid: u32) -> Vec<(usize, u32)> {
    let children =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    children
        .split_whitespace()
        .filter_map(|c| c.parse::<u32>().ok())
        .filter_map(|c| {
            let env = std::fs::read(format!("/proc/{c}/environ")).ok()?;
            let rank = env
                .split(|&b| b == 0)
                .filter_map(|kv| std::str::from_utf8(kv).ok())
                .find_map(|kv| kv.strip_prefix("RANK="))?
                .parse()
                .ok()?;
            Some((rank, c))
        })
        .collect()
}

#[test]
fn a_worker_killed_mid_training_takes_the_job_down_naming_it() {
    let dir = tmp("kill");
    let rd = dir.path().display().to_string();
    let cfg = config("tiny.toml");
    let mut child = mtrain(&[
        "--dp",
        "2",
        "--pp",
        "2",
        "--config",
        &cfg,
        "--steps",
        "100000",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--log-every",
        "1",
        "--eval-every",
        "0",
        "--run-dir",
        &rd,
        "--comm-timeout",
        "60",
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("spawn");
    let start = Instant::now();
    // Wait until training is under way (a step logged), then SIGKILL rank 3.
    let metrics = dir.path().join("metrics.jsonl");
    while std::fs::read_to_string(&metrics).map_or(0, |s| s.lines().count()) < 1 {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "training never started"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let victim = workers(child.id())
        .into_iter()
        .find(|&(r, _)| r == 3)
        .expect("rank 3 among the launcher's children");
    let killed = Command::new("kill")
        .args(["-KILL", &victim.1.to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("the job did not stop within 60 s of a worker's death");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let o = child.wait_with_output().expect("output");
    let t = text(&o);
    assert!(!status.success(), "{t}");
    assert!(
        t.contains("rank 3") && (t.contains("SIGKILL") || t.contains("signal 9")),
        "the message should name rank 3 and how it died:\n{}",
        t.lines().rev().take(15).collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn impossible_layouts_are_refused_with_the_arithmetic() {
    let cfg = config("tiny.toml");
    let cases: [(&[&str], &str); 4] = [
        (
            &["--dp", "2", "--tp", "2", "--nproc-per-node", "3"],
            "dp(2) * pp(1) * tp(2) = 4 != world size 3",
        ),
        (&["--pp", "5"], "pp 5 > n_layer 4"),
        (&["--tp", "3"], "n_head 4 is not divisible by tp 3"),
        (&["--dp", "2", "--ep", "2"], "--ep 2 needs an MoE model"),
    ];
    for (layout, want) in cases {
        let mut args = layout.to_vec();
        args.extend(["--config", &cfg, "--steps", "1"]);
        let start = Instant::now();
        let o = run_mtrain(&args);
        let t = text(&o);
        assert!(!o.status.success(), "{layout:?} was accepted:\n{t}");
        assert!(t.contains(want), "{layout:?}: expected `{want}` in:\n{t}");
        // Refused before any worker starts.
        assert!(!t.contains("launching ranks"), "{layout:?} launched:\n{t}");
        assert!(start.elapsed() < Duration::from_secs(20));
    }
}

fn trace_ops(path: &PathBuf) -> Vec<(String, String, u64, u64)> {
    let s = std::fs::read_to_string(path).expect("trace file");
    s.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json");
            (
                v["op"].to_string(),
                v["group"].as_str().expect("group").to_string(),
                v["seq"].as_u64().expect("seq"),
                v["bytes"].as_u64().expect("bytes"),
            )
        })
        .collect()
}

#[test]
fn trace_writes_every_collective_per_rank() {
    let dir = tmp("trace");
    let o = train(&["--dp", "2", "--trace"], "2", dir.path(), &[]);
    assert!(o.status.success(), "{}", text(&o));
    let r0 = trace_ops(&dir.path().join("trace-rank0.jsonl"));
    let r1 = trace_ops(&dir.path().join("trace-rank1.jsonl"));
    assert!(!r0.is_empty());
    // The dp group issues the same collectives in the same order with the same sizes on both.
    let dp = |v: &[(String, String, u64, u64)]| {
        v.iter()
            .filter(|e| e.1 == "dp")
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(dp(&r0), dp(&r1));
    // Per group, sequence numbers run 0, 1, 2, ... without a gap.
    let seqs: Vec<u64> = dp(&r0).iter().map(|e| e.2).collect();
    assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>());
    // Four steps of DDP: at least one gradient all-reduce per step.
    let reduces = dp(&r0)
        .iter()
        .filter(|e| e.0.contains("all_reduce"))
        .count();
    assert!(reduces >= 4, "{reduces} all-reduces in {:?}", dp(&r0));
}
