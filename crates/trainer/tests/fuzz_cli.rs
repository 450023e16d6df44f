//! The command line and the config under random input: every run of the real `mtrain` binary
//! ends in exit 0 or a clean error (exit code 1 or 2 and an `error:` message), never a panic, an
//! abort, a signal or a hang.
//!
//! Flags, subcommands and the values clap knows for them are drawn from the binary's own command
//! definition (`Cli::command()`), `--set` keys from the serialized config (nested tables
//! included), values from a pool of edge cases: 0, -1, 2^32 + 1, u64::MAX, NaN, ±inf, 1e308,
//! sizes beyond any memory, empty and non-numeric strings, missing, unwritable and endless paths
//! (/proc, /dev/full, /dev/zero); every path a case can write to lies in a temporary directory. The
//! generator is seeded, so a failure is reproduced by its seed, which is printed with the command
//! line; `MTRAIN_FUZZ_SEED` and `MTRAIN_FUZZ_CASES` pick other seeds and counts.
//!
//! Training and `bench-comm` stay in one process and short (the flags that would start workers
//! or set the iteration counts are left to `plan`, which launches nothing, and `--set steps=1`
//! ends every training case), so the test takes seconds.

use std::io::Read;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use clap::CommandFactory;
use mtrain_model::GptConfig;
use mtrain_trainer::cli::Cli;
use mtrain_trainer::config::{ModelSpec, TrainConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod common;
use common::mtrain;

/// The seed CI runs.
const DEFAULT_SEED: u64 = 20_261_201;
/// Cases CI runs (4 s on two idle cores, 20 s on busy ones).
const DEFAULT_CASES: usize = 60;
/// Longest a case may run before it counts as a hang.
const CASE_LIMIT: Duration = Duration::from_secs(30);

/// Numbers at and past every edge.
const NUMBERS: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "7",
    "-1",
    "-0",
    "0.5",
    "1e-300",
    "1e308",
    "-1e308",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "4294967297",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999",
];
/// Byte sizes for bench-comm, small and far beyond memory.
const SIZES: &[&str] = &[
    "8",
    "1K",
    "64K",
    "1M",
    "9999999G",
    "17179869184G",
    "1T",
    "-8",
    "0",
];
/// Strings that are not what anything expects.
const STRINGS: &[&str] = &[
    "",
    " ",
    "x",
    "tiny",
    "moe-tiny",
    "=",
    "a=b",
    "--",
    "-",
    "2,1",
    "0,0",
    "1,2,3",
    "\u{1F600}",
];

/// Where the flags and values come from.
struct Surface {
    cli: clap::Command,
    /// Every `--set` key of the config: top-level, `model.*`, `model.moe.*`, and a few unknown.
    keys: Vec<String>,
    /// Paths: missing, unwritable, a directory, real config files, a text file.
    paths: Vec<String>,
}

impl Surface {
    fn new(tmp: &Path) -> Self {
        let mut keys = Vec::new();
        let cfg = TrainConfig {
            model: ModelSpec::Config(GptConfig::moe_tiny()),
            ..TrainConfig::default()
        };
        let table = toml::Value::try_from(&cfg).expect("the config serializes");
        flatten("", &table, &mut keys);
        for extra in [
            "peak_flops",
            "resume",
            "nope",
            "model.nope",
            "model.moe.nope.deeper",
            "train.lr",
            "model",
        ] {
            keys.push(extra.to_string());
        }
        keys.sort();
        keys.dedup();
        // Copies of the shipped configs: a case may overwrite any path it is given (--json,
        // --fit), so every writable path lies in `tmp`; the others cannot be written at all.
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        let mut paths: Vec<String> = vec![
            "".into(),
            "/proc".into(),
            "/proc/mtrain-missing/file".into(),
            "/dev/full".into(),
            "/dev/zero".into(),
            "/dev/null".into(),
            "out".into(),
            tmp.display().to_string(),
        ];
        for name in ["tiny.toml", "moe-tiny.toml"] {
            let copy = tmp.join(name);
            std::fs::copy(shipped.join(name), &copy).unwrap();
            paths.push(copy.display().to_string());
        }
        let text = tmp.join("corpus.txt");
        std::fs::write(&text, "the red fox and the blue fox\n".repeat(200)).unwrap();
        paths.push(text.display().to_string());
        Self {
            cli: Cli::command(),
            keys,
            paths,
        }
    }
}

/// Dotted paths of every leaf of `value`.
fn flatten(prefix: &str, value: &toml::Value, out: &mut Vec<String>) {
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        _ => out.push(prefix.to_string()),
    }
}

/// A value for `arg`: one of its possible values, a path for path-like args, else the pool.
fn value_for(rng: &mut StdRng, surface: &Surface, arg: &clap::Arg) -> String {
    let possible: Vec<String> = arg
        .get_possible_values()
        .iter()
        .map(|v| v.get_name().to_string())
        .collect();
    if !possible.is_empty() && rng.gen_bool(0.7) {
        return pick(rng, &possible).clone();
    }
    let names: Vec<String> = arg
        .get_value_names()
        .map(|ns| ns.iter().map(|n| n.to_string()).collect())
        .unwrap_or_default();
    let path_like = names
        .iter()
        .any(|n| ["FILE", "DIR", "PATH", "CKPT", "RUN_DIR", "SOURCE"].contains(&n.as_str()));
    if arg.get_id() == "overrides" {
        let key = pick(rng, &surface.keys).clone();
        let value = match rng.gen_range(0..3) {
            0 => pick(rng, STRINGS).to_string(),
            _ => pick(rng, NUMBERS).to_string(),
        };
        return format!("{key}={value}");
    }
    if path_like && rng.gen_bool(0.8) {
        return pick(rng, &surface.paths).clone();
    }
    if ["min_bytes", "max_bytes"].contains(&arg.get_id().as_str()) && rng.gen_bool(0.8) {
        return pick(rng, SIZES).to_string();
    }
    match rng.gen_range(0..4) {
        0 => pick(rng, STRINGS).to_string(),
        _ => pick(rng, NUMBERS).to_string(),
    }
}

fn pick<'a, T>(rng: &mut StdRng, xs: &'a [T]) -> &'a T {
    &xs[rng.gen_range(0..xs.len())]
}

/// Flags that would start workers (left to `plan`) or run long (set by the case itself).
fn excluded(subcommand: Option<&str>, id: &str) -> bool {
    const WORLD: [&str; 9] = [
        "dp",
        "tp",
        "pp",
        "ep",
        "nproc_per_node",
        "nnodes",
        "node_rank",
        "master_addr",
        "master_port",
    ];
    match subcommand {
        Some("plan") => false,
        Some("bench-comm") => WORLD.contains(&id) || ["iters", "warmup"].contains(&id),
        Some("parity") => WORLD.contains(&id) || id == "steps" || id == "vs",
        _ => WORLD.contains(&id),
    }
}

/// One random command line.
fn case(rng: &mut StdRng, surface: &Surface) -> Vec<String> {
    let subcommands: Vec<&clap::Command> = surface.cli.get_subcommands().collect();
    let sub = match rng.gen_range(0..10) {
        0..=3 => None,
        _ => Some(*pick(rng, &subcommands)),
    };
    let name = sub.map(|s| s.get_name().to_string());
    let mut args: Vec<&clap::Arg> = surface
        .cli
        .get_arguments()
        .filter(|a| sub.is_none() || a.is_global_set())
        .collect();
    if let Some(s) = sub {
        args.extend(s.get_arguments());
    }
    args.retain(|a| !excluded(name.as_deref(), a.get_id().as_str()));
    let mut argv: Vec<String> = name.iter().cloned().collect();
    let mut positionals = Vec::new();
    for _ in 0..rng.gen_range(1..=4) {
        let arg = *pick(rng, &args);
        let takes_value = arg.get_action().takes_values();
        let flag = match (arg.get_long(), arg.get_short()) {
            (Some(long), _) => Some(format!("--{long}")),
            (None, Some(short)) => Some(format!("-{short}")),
            (None, None) => None,
        };
        match flag {
            None => positionals.push(value_for(rng, surface, arg)),
            Some(flag) if takes_value => {
                let value = value_for(rng, surface, arg);
                if rng.gen_bool(0.5) {
                    argv.push(format!("{flag}={value}"));
                } else {
                    argv.push(flag);
                    argv.push(value);
                }
            }
            Some(flag) => argv.push(flag),
        }
    }
    // Required positionals and options, so most cases get past clap into mtrain's own checks.
    if let Some(s) = sub {
        for arg in s.get_arguments().filter(|a| a.is_required_set()) {
            let present = argv.iter().any(|a| {
                arg.get_long()
                    .is_some_and(|l| a.starts_with(&format!("--{l}")))
            });
            if !present && rng.gen_bool(0.9) {
                match arg.get_long() {
                    Some(l) => {
                        argv.push(format!("--{l}"));
                        argv.push(value_for(rng, surface, arg));
                    }
                    None if positionals.is_empty() => {
                        positionals.push(value_for(rng, surface, arg))
                    }
                    None => {}
                }
            }
        }
    }
    argv.extend(positionals);
    // Every fifth bench-comm case sweeps from 0 or with a factor that never grows the size.
    if name.as_deref() == Some("bench-comm") && rng.gen_range(0..5) == 0 {
        let edge = pick(rng, &[["-b", "0"], ["-f", "1"], ["-f", "0"], ["-e", "0"]]);
        argv.extend(edge.map(String::from));
    }
    match name.as_deref() {
        None => {
            for kv in ["steps=1", "eval_every=0", "ckpt_every=0", "log_every=0"] {
                argv.push("--set".into());
                argv.push(kv.into());
            }
        }
        Some("bench-comm") => argv.extend(["-n", "2", "-w", "0"].map(String::from)),
        Some("parity") => argv.extend(["--steps", "1", "--vs", "--dp 1"].map(String::from)),
        _ => {}
    }
    argv
}

/// The exit code of one run when it ended acceptably, else why not.
fn check(argv: &[String], cwd: &Path) -> Result<i32, String> {
    let mut child = mtrain(argv)
        .current_dir(cwd)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawn: {e}"))?;
    let mut pipe = child.stderr.take().expect("stderr");
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = pipe.read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
            break s;
        }
        if start.elapsed() > CASE_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("no exit within {CASE_LIMIT:?} (hang)"));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let stderr = reader.join().unwrap_or_default();
    let tail: String = {
        let lines: Vec<&str> = stderr.lines().collect();
        lines[lines.len().saturating_sub(12)..].join("\n")
    };
    for bad in [
        "panicked",
        "memory allocation of",
        "RUST_BACKTRACE",
        "stack backtrace",
    ] {
        if stderr.contains(bad) {
            return Err(format!("`{bad}` in stderr:\n{tail}"));
        }
    }
    match status.code() {
        Some(0) => Ok(0),
        Some(code @ (1 | 2)) if stderr.contains("error") => Ok(code),
        Some(code) => Err(format!("exit code {code} without a clean error:\n{tail}")),
        None => Err(format!("killed by a signal ({status}):\n{tail}")),
    }
}

#[test]
fn random_flags_and_values_end_in_success_or_a_clean_error() {
    let seed = std::env::var("MTRAIN_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SEED);
    let cases = std::env::var("MTRAIN_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_CASES);
    let tmp = tempfile::tempdir().unwrap();
    let surface = Surface::new(tmp.path());
    let mut rng = StdRng::seed_from_u64(seed);
    let start = Instant::now();
    let mut failures = Vec::new();
    let mut exit0 = 0;
    for i in 0..cases {
        let argv = case(&mut rng, &surface);
        let cwd = tmp.path().join(format!("case-{i}"));
        std::fs::create_dir_all(&cwd).unwrap();
        match check(&argv, &cwd) {
            Ok(code) => exit0 += usize::from(code == 0),
            Err(why) => failures.push(format!("case {i}: mtrain {}\n{why}", shell_words(&argv))),
        }
    }
    eprintln!(
        "{cases} cases (seed {seed}) in {:.1} s: {exit0} exit 0, {} clean errors, {} failures",
        start.elapsed().as_secs_f64(),
        cases - exit0 - failures.len(),
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "seed {seed} (MTRAIN_FUZZ_SEED={seed} MTRAIN_FUZZ_CASES={cases} to reproduce):\n\n{}",
        failures.join("\n\n")
    );
}

/// The command line quoted for a shell, to paste when reproducing.
fn shell_words(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_=./,:".contains(c))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}
