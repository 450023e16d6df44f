//! Each step's communication figures, the phase tags of the trace, `plan --compare` and the
//! Chrome trace, on real `mtrain --trace` runs through the launcher (tp 2 × pp 2 and the MoE
//! preset over dp 2 × ep 2), with evaluation and a checkpoint in the run so their collectives are
//! in the trace too.
//!
//! - For every rank and step, the step report's `collectives` and `comm_bytes` (steps.jsonl)
//!   equal the count and the bytes sent of the trace's collectives tagged with that step, on the
//!   groups of more than one rank, and the exposed time is at most the communication time.
//! - `mtrain plan --compare RUN_DIR` lists only the steps' collectives: every (group, op) is both
//!   traced and predicted, with the predicted count per step, and the bytes within 2× (exact for
//!   tp × pp; the MoE all-to-alls are a balanced-routing estimate). The predicted counts of a
//!   rank add up to its step report's `collectives`.
//! - trace.json (Trace Event Format) has every rank as a process, well-formed complete events, and
//!   every step collective inside its rank's step span.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Output;

use serde_json::Value;

mod common;
use common::{run_mtrain};

const STEPS: u64 = 3;

fn ok(o: &Output, what: &str) -> String {
    let s = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{what} failed:\n{s}");
    s
}

fn json_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

/// Runs `layout` for STEPS steps with --trace, an evaluation at step 2 and the final checkpoint,
/// and checks everything the module docs list. `group_size` gives the size of a trace group name.
fn check(layout: &[&str], world: usize, group_size: impl Fn(&str) -> usize, exact_bytes: bool) {
    let dir = tempfile::tempdir().expect("tmp");
    let run = dir.path().display().to_string();
    let mut args: Vec<String> = layout.iter().map(|s| s.to_string()).collect();
    let common = [
        "--batch-size",
        "4",
        "--seq-len",
        "16",
        "--set",
        "model.n_layer=2",
    ];
    args.extend(common.iter().map(|s| s.to_string()));
    let mut train = args.clone();
    train.extend(
        [
            "--steps",
            "3",
            "--eval-every",
            "2",
            "--set",
            "eval_iters=1",
            "--trace",
            "--run-dir",
            &run,
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    ok(&run_mtrain(&train), "training");

    // (rank, step) -> (collectives, bytes sent, comm ms, exposed ms) of the step reports.
    let mut reports = BTreeMap::new();
    for line in json_lines(&dir.path().join("steps.jsonl")) {
        let r = &line["report"];
        let key = (
            line["rank"].as_u64().unwrap(),
            line["step"].as_u64().unwrap(),
        );
        let figures = (
            r["collectives"].as_u64().unwrap(),
            r["comm_bytes"].as_u64().unwrap(),
            r["comm_ms"].as_f64().unwrap(),
            r["exposed_comm_ms"].as_f64().unwrap(),
        );
        // The exposed time by group adds up to the whole, each a group of more than one rank.
        let by_group = r["exposed_by_group"].as_object().cloned().unwrap_or_default();
        let sum: f64 = by_group.values().map(|v| v.as_f64().unwrap()).sum();
        assert!((sum - figures.3).abs() < 1e-6, "{key:?}: {by_group:?} vs {}", figures.3);
        assert!(by_group.keys().all(|g| group_size(g) > 1), "{key:?}: {by_group:?}");
        reports.insert(key, figures);
    }
    assert_eq!(reports.len(), world * STEPS as usize, "{reports:?}");
    let mut other_phases = 0;
    for rank in 0..world {
        let trace = json_lines(&dir.path().join(format!("trace-rank{rank}.jsonl")));
        let mut per_step: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
        for e in &trace {
            let phase = e["phase"].as_str().expect("every event has a phase");
            if phase != "step" {
                other_phases += 1;
                continue;
            }
            if group_size(e["group"].as_str().unwrap()) <= 1 {
                continue;
            }
            let s = per_step.entry(e["step"].as_u64().unwrap()).or_default();
            s.0 += 1;
            s.1 += e["bytes_sent"].as_u64().unwrap();
        }
        for step in 0..STEPS {
            let (n, bytes, comm_ms, exposed_ms) = reports[&(rank as u64, step)];
            assert!(n > 0, "rank {rank} step {step}: no collectives");
            assert_eq!(
                per_step.get(&step).copied().unwrap_or_default(),
                (n, bytes),
                "{layout:?} rank {rank} step {step}: the report's (collectives, bytes) vs the trace's"
            );
            assert!(
                exposed_ms <= comm_ms,
                "{layout:?} rank {rank} step {step}: exposed {exposed_ms} ms > comm {comm_ms} ms"
            );
        }
    }
    assert!(
        other_phases > 0,
        "no setup / eval / checkpoint collectives traced"
    );

    // plan --compare: the steps' collectives only, each predicted, counts equal.
    let mut plan = vec!["plan".to_string()];
    plan.extend(args.iter().cloned());
    plan.extend(["--compare".to_string(), run.clone()]);
    let out = ok(&run_mtrain(&plan), "plan --compare");
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with(char::is_numeric))
        .collect();
    assert!(!rows.is_empty(), "{out}");
    let mut predicted_per_rank: BTreeMap<u64, u64> = BTreeMap::new();
    for r in &rows {
        assert!(
            !r.contains("not predicted") && !r.contains("not traced"),
            "{r}\n{out}"
        );
        assert!(!r.contains("count differs"), "{r}\n{out}");
        if exact_bytes {
            assert!(!r.contains("bytes >2x"), "{r}\n{out}");
        }
        let cols: Vec<&str> = r.split_whitespace().collect();
        let rank: u64 = cols[0].parse().unwrap();
        *predicted_per_rank.entry(rank).or_default() += cols[4].parse::<u64>().unwrap();
    }
    for (rank, predicted) in predicted_per_rank {
        assert_eq!(
            reports[&(rank, 0)].0,
            predicted,
            "{layout:?} rank {rank}: step report vs plan's prediction\n{out}"
        );
    }

    // trace.json: every rank, well-formed complete events, step collectives inside their step.
    let doc: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("trace.json")).expect("trace.json"))
            .expect("trace.json parses");
    let events = doc["traceEvents"].as_array().expect("traceEvents");
    let mut steps: BTreeMap<(u64, u64), (f64, f64)> = BTreeMap::new();
    let mut pids = std::collections::BTreeSet::new();
    for e in events {
        let ph = e["ph"].as_str().expect("ph");
        assert!(
            e["name"].is_string() && e["pid"].is_u64() && e["tid"].is_u64(),
            "{e}"
        );
        pids.insert(e["pid"].as_u64().unwrap());
        match ph {
            "M" => {}
            "X" => {
                let (ts, dur) = (
                    e["ts"].as_f64().expect("ts"),
                    e["dur"].as_f64().expect("dur"),
                );
                assert!(ts >= 0.0 && dur >= 0.0, "{e}");
                if e["cat"] == "phase" && e["args"]["phase"] == "step" {
                    let key = (
                        e["pid"].as_u64().unwrap(),
                        e["args"]["step"].as_u64().unwrap(),
                    );
                    steps.insert(key, (ts, ts + dur));
                }
            }
            other => panic!("unexpected event type {other}: {e}"),
        }
    }
    assert_eq!(pids.len(), world, "ranks in trace.json: {pids:?}");
    assert_eq!(steps.len(), world * STEPS as usize, "{steps:?}");
    let mut inside = 0;
    for e in events.iter().filter(|e| e["cat"] == "comm") {
        if e["args"]["phase"] != "step" {
            continue;
        }
        let key = (
            e["pid"].as_u64().unwrap(),
            e["args"]["step"].as_u64().unwrap(),
        );
        let (a, b) = steps[&key];
        let (ts, end) = (
            e["ts"].as_f64().unwrap(),
            e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap(),
        );
        assert!(ts >= a && end <= b, "{e} outside its step [{a}, {b}]");
        inside += 1;
    }
    assert!(inside > 0);
    assert!(
        events.iter().any(|e| e["cat"] == "compute"),
        "no compute spans"
    );
}

#[test]
fn tp2_pp2_step_figures_match_the_trace_and_the_plan() {
    // Groups: tp and pp of 2, mp (tp × pp) and world of 4, dp, ep, edp of 1.
    let size = |g: &str| match g {
        "tp" | "pp" => 2,
        "mp" | "world" => 4,
        _ => 1,
    };
    check(&["--tp", "2", "--pp", "2"], 4, size, true);
}

#[test]
fn moe_dp2_ep2_step_figures_match_the_trace_and_the_plan() {
    // Groups: dp, ep and world of 2; edp of 1.
    let size = |g: &str| match g {
        "dp" | "ep" | "world" => 2,
        _ => 1,
    };
    check(
        &["--model", "moe-tiny", "--dp", "2", "--ep", "2"],
        2,
        size,
        false,
    );
}
