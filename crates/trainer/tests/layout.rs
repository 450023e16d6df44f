//! The layout written in a config file's `[parallel]` table: it runs the same job as the
//! same layout given as flags (through the real binary and its launcher), flags and `--set`
//! override it key by key, the launcher starts as many processes as it asks for, and the
//! checkpoint records it.

use std::path::{Path, PathBuf};

use clap::Parser;
use mtrain_trainer::cli::Cli;
use mtrain_trainer::config::Schedule;
use mtrain_trainer::resolve;
use serde_json::Value;

mod common;
use common::{losses, run_mtrain, text};

/// A short run of the tiny model: 3 steps of 4 sequences of 32 tokens, a loss every step.
const TRAIN: &str = r#"
model = "tiny"
[train]
steps = 3
batch_size = 4
seq_len = 32
log_every = 1
eval_every = 0
"#;

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write config");
    path
}

/// Runs `mtrain args --run-dir dir`, which must succeed; returns its output.
fn train(args: &[&str], dir: &Path) -> String {
    let run_dir = dir.display().to_string();
    let mut all = args.to_vec();
    all.extend(["--run-dir", &run_dir]);
    let o = run_mtrain(&all);
    let t = text(&o);
    assert!(o.status.success(), "mtrain {all:?} failed:\n{t}");
    t
}

/// The `parallel` table recorded in the run's latest checkpoint.
fn recorded_parallel(dir: &Path) -> Value {
    let latest = std::fs::read_to_string(dir.join("latest")).expect("latest checkpoint");
    let meta = std::fs::read_to_string(dir.join(latest.trim()).join("meta.json")).expect("meta");
    let meta: Value = serde_json::from_str(&meta).expect("meta.json");
    meta["config"]["parallel"].clone()
}

fn degrees(p: &Value) -> (u64, u64, u64, u64) {
    let d = |k: &str| p[k].as_u64().unwrap_or_else(|| panic!("no `{k}` in {p}"));
    (d("dp"), d("pp"), d("tp"), d("ep"))
}

#[test]
fn a_parallel_table_runs_the_same_job_as_the_flags() {
    let dir = tempfile::tempdir().expect("temp dir");
    let plain = write(dir.path(), "plain.toml", TRAIN);
    let table = write(
        dir.path(),
        "tp2-pp2.toml",
        &format!("{TRAIN}\n[parallel]\ntp = 2\npp = 2\n"),
    );
    let (from_table, from_flags) = (dir.path().join("table"), dir.path().join("flags"));
    let t = train(&["--config", &table.display().to_string()], &from_table);
    let f = train(
        &[
            "--config",
            &plain.display().to_string(),
            "--tp",
            "2",
            "--pp",
            "2",
        ],
        &from_flags,
    );
    // Four processes from the table alone: the launcher sized the world from its layout.
    for out in [&t, &f] {
        assert!(
            out.contains("layout dp=1 pp=2 tp=2 ep=1 (world 4)"),
            "no 4-rank layout line in:\n{out}"
        );
    }
    // (step, loss bits): the same job, bit for bit.
    let bits = |dir: &Path| -> Vec<(u64, u64)> {
        losses(dir).into_iter().map(|(s, l)| (s, l.to_bits())).collect()
    };
    let series = bits(&from_table);
    assert_eq!(series.len(), 3, "one loss per step");
    assert_eq!(series, bits(&from_flags), "the same job, bit for bit");
    // The checkpoint records the layout the run had, dp written out.
    for run in [&from_table, &from_flags] {
        let p = recorded_parallel(run);
        assert_eq!(degrees(&p), (1, 2, 2, 1), "{p}");
        assert_eq!(p["schedule"], "1f1b", "{p}");
        assert_eq!(p["microbatches"], 2, "{p}");
    }
}

#[test]
fn flags_and_set_override_the_table_key_by_key() {
    let dir = tempfile::tempdir().expect("temp dir");
    let table = write(
        dir.path(),
        "layout.toml",
        &format!("{TRAIN}\n[parallel]\ntp = 2\npp = 2\nschedule = \"gpipe\"\nmicrobatches = 4\n"),
    );
    let file = table.display().to_string();
    let resolve = |extra: &[&str]| {
        let mut argv = vec!["mtrain", "--config", &file];
        argv.extend_from_slice(extra);
        let cli = Cli::try_parse_from(argv).expect("parses");
        let r = resolve::resolve(&cli, None).expect("resolves");
        (r.run.cfg().clone(), r.layout, r.run.plan)
    };
    // The table alone: 4 processes on this node.
    let (cfg, l, plan) = resolve(&[]);
    assert_eq!((l.dims.dp, l.dims.pp, l.dims.tp), (1, 2, 2));
    assert_eq!((l.world_size, l.launch.nproc_per_node), (4, 4));
    assert_eq!(
        (cfg.parallel.schedule, plan.microbatches),
        (Schedule::Gpipe, 4)
    );
    // A flag replaces its key and keeps the others.
    let (cfg, l, plan) = resolve(&["--pp", "1", "--dp", "2"]);
    assert_eq!((l.dims.dp, l.dims.pp, l.dims.tp), (2, 1, 2));
    assert_eq!((l.world_size, l.launch.nproc_per_node), (4, 4));
    assert_eq!(
        (cfg.parallel.schedule, plan.microbatches),
        (Schedule::Gpipe, 4)
    );
    // So does --set, after the flags.
    let (_, l, _) = resolve(&["--tp", "1", "--set", "parallel.tp=4"]);
    assert_eq!((l.dims.pp, l.dims.tp, l.world_size), (2, 4, 8));
    // The world given by --nproc-per-node leaves dp to be inferred from the table's tp·pp.
    let (_, l, _) = resolve(&["--nproc-per-node", "8"]);
    assert_eq!(l.dims.dp, 2);
}

#[test]
fn a_bad_parallel_table_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("temp dir");
    let unknown = write(
        dir.path(),
        "unknown.toml",
        &format!("{TRAIN}\n[parallel]\ntp = 2\ntensor_parallel = 2\n"),
    );
    let o = run_mtrain(&["--config", &unknown.display().to_string()]);
    assert!(!o.status.success());
    assert!(text(&o).contains("tensor_parallel"), "{}", text(&o));
    // Numbers that do not fit are the plan's one check, with the arithmetic and the source.
    let misfit = write(
        dir.path(),
        "misfit.toml",
        &format!("{TRAIN}\n[parallel]\ndp = 2\ntp = 2\n"),
    );
    let o = run_mtrain(&[
        "--config",
        &misfit.display().to_string(),
        "--nproc-per-node",
        "3",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o)
            .contains("dp(2) * pp(1) * tp(2) = 4 != world size 3 (nproc-per-node 3 * nnodes 1)"),
        "{}",
        text(&o)
    );
}

#[test]
fn parity_compares_the_table_layout_with_one_rank() {
    let dir = tempfile::tempdir().expect("temp dir");
    let table = write(
        dir.path(),
        "tp2.toml",
        &format!("{TRAIN}\n[parallel]\ntp = 2\nschedule = \"gpipe\"\n"),
    );
    let out = dir.path().join("parity");
    let o = run_mtrain(&[
        "parity",
        "--config",
        &table.display().to_string(),
        "--vs",
        "--pp 2",
        "--steps",
        "3",
        "--out",
        &out.display().to_string(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("parity OK"), "{}", text(&o));
    // The reference is one rank whatever the file says; the layout is the table under --vs.
    assert_eq!(
        degrees(&recorded_parallel(&out.join("one-rank"))),
        (1, 1, 1, 1)
    );
    let layout = recorded_parallel(&out.join("layout"));
    assert_eq!(degrees(&layout), (1, 2, 2, 1));
    assert_eq!(layout["schedule"], "gpipe");
}

/// Every shipped configs/*.toml parses; the layout example holds the layout its comment promises.
#[test]
fn shipped_configs_parse_with_their_parallel_tables() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("configs/") {
        let path = entry.expect("entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("read");
        let cfg =
            mtrain_trainer::config::TrainConfig::from_toml_str(&text, &path.display().to_string())
                .unwrap_or_else(|e| panic!("{e}"));
        if path.ends_with("tiny-tp2-pp2.toml") {
            let p = &cfg.parallel;
            assert_eq!((p.tp, p.pp, p.microbatches), (2, 2, Some(4)));
        }
        seen += 1;
    }
    assert!(seen >= 5, "{seen} configs in {}", dir.display());
}
