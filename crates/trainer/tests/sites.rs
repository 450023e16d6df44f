//! Every collective knows where it was issued, and each technique issues its own: a few steps
//! of `mtrain --trace` per layout, and every collective event of `trace.json` carries the file
//! and line that issued it (`args.site`), the technique's collectives in the technique's folder:
//!
//! ```text
//!   layout                        group  ops                          issued under
//!   --tp 2                        tp     every op                     parallel/src/tensor_parallel/
//!   --dp 2                        dp     the gradient all-reduces     parallel/src/ddp/
//!   --dp 2 --fsdp                 dp     all-gathers, reduce-scatters parallel/src/fsdp/
//!   --pp 2                        pp     sends and receives           parallel/src/pipeline/
//!   moe-tiny --dp 2 --ep 2        ep     all-to-alls                  parallel/src/expert_parallel/
//!   --cp 2                        cp     the ring's sends, receives   parallel/src/context_parallel/
//! ```
//!
//! Each run evaluates once, so the evaluation's collectives are checked with the step's; the
//! setup's checks and the checkpoint's gathers are the loop's own and are not.

use std::path::Path;

use serde_json::Value;

mod common;
use common::traced_run;

/// The collective events (category "comm") of `trace.json` after 3 steps under `layout`.
fn traced_collectives(layout: &[&str], config: &str) -> Vec<Value> {
    let dir = traced_run("sites", layout, config, 3, 4, 2);
    let path = dir.path().join("trace.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let doc: Value = serde_json::from_str(&text).expect("trace.json is JSON");
    let events: Vec<Value> = doc["traceEvents"]
        .as_array()
        .expect("traceEvents")
        .iter()
        .filter(|e| e["cat"].as_str() == Some("comm"))
        .cloned()
        .collect();
    assert!(
        !events.is_empty(),
        "{layout:?}: no collective in {}",
        path.display()
    );
    for e in &events {
        let site = e["args"]["site"].as_str().unwrap_or_default();
        let (file, line) = site.rsplit_once(':').unwrap_or_default();
        assert!(
            file.starts_with("crates/") && file.ends_with(".rs") && line.parse::<u32>().is_ok(),
            "{layout:?}: a collective without a site (file:line under crates/): {e}"
        );
        assert!(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../..")
                .join(file)
                .is_file(),
            "{layout:?}: the site {site} names no file of the repository"
        );
    }
    events
}

/// Asserts that every event of `group` that the training step or the evaluation issued, whose
/// op is one of `ops` and that `also` accepts, was issued from a file under `folder` (the setup's
/// checks and the checkpoint's gathers are the loop's).
fn issued_under(
    events: &[Value],
    group: &str,
    ops: &[&str],
    also: impl Fn(&Value) -> bool,
    folder: &str,
) {
    let chosen: Vec<&Value> = events
        .iter()
        .filter(|e| e["args"]["group"].as_str() == Some(group))
        .filter(|e| matches!(e["args"]["phase"].as_str(), Some("step" | "eval")))
        .filter(|e| ops.contains(&e["name"].as_str().unwrap_or_default()))
        .filter(|e| also(e))
        .collect();
    assert!(!chosen.is_empty(), "no {ops:?} on group {group}");
    let astray: Vec<String> = chosen
        .iter()
        .filter(|e| {
            !e["args"]["site"]
                .as_str()
                .unwrap_or_default()
                .starts_with(folder)
        })
        .map(|e| format!("{} at {}", e["name"], e["args"]["site"]))
        .collect();
    assert!(
        astray.is_empty(),
        "{} of {} {ops:?} on group {group} were not issued under {folder}: {astray:?}",
        astray.len(),
        chosen.len()
    );
}

const ANY: fn(&Value) -> bool = |_| true;

#[test]
fn tensor_parallel_collectives_are_issued_from_its_folder() {
    let events = traced_collectives(&["--tp", "2"], "tiny.toml");
    let ops = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"];
    issued_under(
        &events,
        "tp",
        &ops,
        ANY,
        "crates/parallel/src/tensor_parallel/",
    );
}

#[test]
fn ddp_bucket_all_reduces_are_issued_from_its_folder() {
    let events = traced_collectives(&["--dp", "2"], "tiny.toml");
    // The gradients' buckets; the step's loss and the evaluation's (two f64 at most) are the
    // loop's, not data parallelism's.
    let gradients = |e: &Value| e["args"]["bytes"].as_u64().unwrap_or(0) > 16;
    issued_under(
        &events,
        "dp",
        &["all_reduce"],
        gradients,
        "crates/parallel/src/ddp/",
    );
}

#[test]
fn fsdp_gathers_and_scatters_are_issued_from_its_folder() {
    let events = traced_collectives(&["--dp", "2", "--fsdp"], "tiny.toml");
    let ops = ["all_gather", "reduce_scatter"];
    issued_under(&events, "dp", &ops, ANY, "crates/parallel/src/fsdp/");
}

#[test]
fn pipeline_sends_and_receives_are_issued_from_its_folder() {
    let events = traced_collectives(&["--pp", "2"], "tiny.toml");
    issued_under(
        &events,
        "pp",
        &["send", "recv"],
        ANY,
        "crates/parallel/src/pipeline/",
    );
}

#[test]
fn expert_all_to_alls_are_issued_from_its_folder() {
    let events = traced_collectives(&["--dp", "2", "--ep", "2"], "moe-tiny.toml");
    let folder = "crates/parallel/src/expert_parallel/";
    issued_under(&events, "ep", &["all_to_all"], ANY, folder);
    // With --ep-overlap the parts' all-to-alls, issued without waiting, from the same folder.
    let events = traced_collectives(&["--dp", "2", "--ep", "2", "--ep-overlap"], "moe-tiny.toml");
    issued_under(&events, "ep", &["all_to_all"], ANY, folder);
    let site = |e: &&Value| e["args"]["site"].as_str().unwrap_or_default().to_string();
    let parts = events.iter().map(|e| site(&e)).filter(|s| s.contains("overlap.rs"));
    assert!(parts.count() > 0, "no all-to-all issued from expert_parallel/overlap.rs");
}

/// The ring's passes: each step's send and receive on the cp group, at the ring's one line for
/// each, in the forward, the backward and the evaluation.
#[test]
fn ring_attention_sends_and_receives_are_issued_from_its_folder() {
    let events = traced_collectives(&["--cp", "2"], "tiny.toml");
    let folder = "crates/parallel/src/context_parallel/";
    issued_under(&events, "cp", &["send", "recv"], ANY, folder);
}
