//! What the trainer's integration tests share: the `mtrain` command, never taken for a worker;
//! running a command (mtrain, torchrun, Python) so that a hang fails the test with every
//! thread's stack instead of stalling the suite, and the same guard for work a test does in its
//! own process.
//!
//! Each test file that runs commands includes this module (`mod common;`).
#![allow(dead_code)]

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The `mtrain` binary of this build.
pub const MTRAIN: &str = env!("CARGO_BIN_EXE_mtrain");

/// What a launcher sets (torchrun's and mtrain's own) and the launcher tests' failure hooks:
/// none of it may leak from the environment the tests run in into a command they start.
const LAUNCH_VARS: [&str; 11] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MTRAIN_JOB_ID",
    "MTRAIN_STORE_PORT",
    "MTRAIN_FAIL_RANK",
    "MTRAIN_FAIL_MODE",
    "TORCHELASTIC_USE_AGENT_STORE",
];

/// `cmd` with [`LAUNCH_VARS`] removed, so that it is never taken for a worker (a test sets what
/// it means to set after this), and its stdin closed.
pub fn clean_env(cmd: &mut Command) -> &mut Command {
    for var in LAUNCH_VARS {
        cmd.env_remove(var);
    }
    cmd.stdin(Stdio::null())
}

/// `mtrain args` ([`clean_env`]): run it with [`BoundedOutput`], or spawn it.
pub fn mtrain<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new(MTRAIN);
    cmd.args(args);
    clean_env(&mut cmd);
    cmd
}

/// `mtrain args` run to its end within [`command_deadline`]; what it printed.
pub fn run_mtrain<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    mtrain(args).bounded_output()
}

/// `mtrain LAYOUT --config configs/CONFIG --trace` for `steps` steps of `batch` sequences of 32
/// tokens, evaluating every `eval_every` steps (0: never), into a fresh run directory (tagged
/// `tag`), which it returns; fails the test, with what the run printed, unless it succeeds.
pub fn traced_run(
    tag: &str,
    layout: &[&str],
    config: &str,
    steps: usize,
    batch: usize,
    eval_every: usize,
) -> tempfile::TempDir {
    let dir = tmp(tag);
    let config = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../configs")
        .join(config);
    let o = mtrain(layout)
        .args(["--config", &config.display().to_string()])
        .args([
            "--steps",
            &steps.to_string(),
            "--batch-size",
            &batch.to_string(),
        ])
        .args(["--seq-len", "32", "--eval-every", &eval_every.to_string()])
        .args(["--trace", "--run-dir"])
        .arg(dir.path())
        .bounded_output();
    assert!(
        o.status.success(),
        "{layout:?} failed:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    dir
}

/// A fresh temporary directory named `mtrain-TAG-...`, removed when dropped.
pub fn tmp(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("mtrain-{tag}-"))
        .tempdir()
        .expect("temp dir")
}

/// The (step, loss) series of a run directory's metrics.jsonl, in its order.
pub fn losses(run_dir: &Path) -> Vec<(u64, f64)> {
    let s = std::fs::read_to_string(run_dir.join("metrics.jsonl")).expect("metrics.jsonl");
    s.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            (
                v["step"].as_u64().expect("step"),
                v["loss"].as_f64().expect("loss"),
            )
        })
        .collect()
}

/// `mtrain parity [before] --vs VS` over 5 steps of batch 2 × 32 at rel ≤ 1e-5: asserts it
/// passes with one row per step and returns its report.
pub fn parity(before: &[&str], vs: &str) -> String {
    let dir = tmp("parity");
    let out_dir = dir.path().display().to_string();
    let mut args = vec!["parity"];
    args.extend_from_slice(before);
    args.extend_from_slice(&[
        "--vs",
        vs,
        "--steps",
        "5",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--tol",
        "1e-5",
        "--out",
        &out_dir,
    ]);
    let o = run_mtrain(&args);
    let t = text(&o);
    assert!(o.status.success(), "parity `{vs}` failed:\n{t}");
    assert!(t.contains("parity OK"), "{t}");
    // Five steps compared, side by side.
    let rows = t
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|w| w.parse::<u64>().is_ok())
        })
        .count();
    assert_eq!(rows, 5, "{t}");
    t
}

/// What a command printed: its stdout, then its stderr.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The longest one command of these tests may take: they take seconds, and a slow machine
/// minutes. `MTRAIN_TEST_DEADLINE_S` sets another (seconds).
pub fn command_deadline() -> Duration {
    let secs = std::env::var("MTRAIN_TEST_DEADLINE_S")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    Duration::from_secs(secs)
}

/// [`output`] and [`output_within`] as methods, in place of `Command::output`.
pub trait BoundedOutput {
    fn bounded_output(&mut self) -> Output;
    fn bounded_output_within(&mut self, limit: Duration) -> Output;
}

impl BoundedOutput for Command {
    fn bounded_output(&mut self) -> Output {
        output(self)
    }
    fn bounded_output_within(&mut self, limit: Duration) -> Output {
        output_within(self, limit)
    }
}

/// `cmd.output()`, bounded: runs `cmd` to its end and returns what it printed. A command still
/// running after [`command_deadline`] fails the test with the stacks of every thread of its
/// processes (gdb, where the machine has it) and what it printed so far, and is killed with its
/// children: a test never hangs on it.
pub fn output(cmd: &mut Command) -> Output {
    output_within(cmd, command_deadline())
}

/// [`output`] with a deadline of the test's own, `limit`: for a test whose command must end
/// sooner than any command may (a launcher that stops a failing job within seconds).
pub fn output_within(cmd: &mut Command, limit: Duration) -> Output {
    use std::io::Read;
    use std::os::unix::process::CommandExt;
    // Its own process group, so its children (torchrun's workers) are found and killed with it.
    cmd.process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd:?}: cannot start: {e}"));
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = drain(Box::new(child.stdout.take().unwrap()));
    let stderr = drain(Box::new(child.stderr.take().unwrap()));
    let t0 = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if t0.elapsed() > limit {
            let stacks = group_stacks(child.id());
            // SAFETY: kill(2) on the process group this function created; no memory is touched.
            unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
            let _ = child.kill();
            let _ = child.wait();
            let printed = format!(
                "{}{}",
                String::from_utf8_lossy(&stdout.join().unwrap()),
                String::from_utf8_lossy(&stderr.join().unwrap())
            );
            panic!(
                "{cmd:?} did not finish within {} s; killed. Its threads' stacks:\n{stacks}\nWhat it printed:\n{printed}",
                limit.as_secs_f64()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    }
}

/// Every thread's stack of every process in process group `pgid`, from gdb.
fn group_stacks(pgid: u32) -> String {
    let members: Vec<u32> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            // /proc/PID/stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces.
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                stat.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(2)?.parse::<u32>().ok())
                    == Some(pgid)
            })
        })
        .collect();
    let mut all = String::new();
    for pid in members {
        all += &stacks(pid);
    }
    all
}

/// Every thread's stack of process `pid`, from gdb, under a line naming the process.
fn stacks(pid: u32) -> String {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    let gdb = Command::new("timeout")
        .args([
            "60",
            "gdb",
            "-p",
            &pid.to_string(),
            "-batch",
            "-ex",
            "thread apply all bt 40",
        ])
        .stdin(Stdio::null())
        .output();
    let stacks = match gdb {
        Ok(o) => format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => format!("(no stacks: gdb could not run: {e})"),
    };
    format!("== process {pid}: {cmdline}\n{stacks}\n")
}

/// Guards work a test does in its own process: if the guard is still alive after
/// [`command_deadline`], the test binary prints its threads' stacks and aborts (the process
/// cannot be killed from outside and go on). Dropping the guard stands it down.
pub struct Watchdog(std::sync::mpsc::Sender<()>);

pub fn watchdog(what: &'static str) -> Watchdog {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let deadline = command_deadline();
    std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(deadline) {
            eprintln!(
                "{what} did not finish within {} s; aborting. This process's stacks:\n{}",
                deadline.as_secs(),
                stacks(std::process::id())
            );
            std::process::abort();
        }
    });
    Watchdog(tx)
}
