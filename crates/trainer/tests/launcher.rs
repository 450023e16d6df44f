//! The `mtrain` binary end to end: the launcher's torchrun contract and fail-fast teardown,
//! layout arithmetic, `bench-comm` correctness and `plan`'s rank grid.
//!
//! Every test runs the real binary (`CARGO_BIN_EXE_mtrain`) with real worker processes talking
//! TCP on loopback; nothing is mocked.

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{mtrain, BoundedOutput};

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn failing_worker_takes_the_job_down_and_is_named() {
    // Rank 1 exits with an error at start-up; ranks 0 and 2 would wait 60 s for it at the
    // rendezvous. The launcher must stop them long before that and name rank 1.
    let mut cmd = mtrain(&[
        "--nproc-per-node",
        "3",
        "--comm-timeout",
        "60",
        "bench-comm",
        "-b",
        "8",
        "-e",
        "8",
    ]);
    cmd.env("MTRAIN_FAIL_RANK", "1");
    let t0 = Instant::now();
    let out = cmd.bounded_output_within(Duration::from_secs(50));
    let elapsed = t0.elapsed();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr:\n{stderr}");
    assert!(
        elapsed < Duration::from_secs(30),
        "teardown took {elapsed:?}"
    );
    assert!(
        stderr.contains("[rank 1] error: MTRAIN_FAIL_RANK=1: failing on purpose"),
        "stderr:\n{stderr}"
    );
    assert!(
        stderr.contains("rank 1 failed: exit code 1"),
        "stderr:\n{stderr}"
    );
    assert!(
        stderr.contains("stopped the other workers (ranks [0, 2])"),
        "stderr:\n{stderr}"
    );
}

#[test]
fn worker_killed_by_a_signal_is_reported_with_the_signal() {
    let mut cmd = mtrain(&[
        "--nproc-per-node",
        "2",
        "--comm-timeout",
        "60",
        "bench-comm",
        "-b",
        "8",
        "-e",
        "8",
    ]);
    cmd.env("MTRAIN_FAIL_RANK", "0")
        .env("MTRAIN_FAIL_MODE", "abort");
    let t0 = Instant::now();
    let out = cmd.bounded_output_within(Duration::from_secs(50));
    let elapsed = t0.elapsed();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr:\n{stderr}");
    assert!(
        elapsed < Duration::from_secs(30),
        "teardown took {elapsed:?}"
    );
    assert!(
        stderr.contains("rank 0 failed: killed by signal 6 (SIGABRT)"),
        "stderr:\n{stderr}"
    );
}

#[test]
fn sigterm_to_the_launcher_stops_every_worker() {
    // A long benchmark; once rank 0 has printed its header, SIGTERM the launcher.
    let mut cmd = mtrain(&[
        "--nproc-per-node",
        "2",
        "bench-comm",
        "-b",
        "4M",
        "-e",
        "4M",
        "-n",
        "1000000",
        "-w",
        "0",
    ]);
    cmd.stdout(Stdio::piped()).stderr(Stdio::null());
    let mut launcher: Child = cmd.spawn().expect("spawn");
    let mut stdout = launcher.stdout.take().expect("stdout");
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while !text(&seen).contains("# mtrain bench-comm") {
        let n = stdout.read(&mut buf).expect("read");
        assert!(n > 0, "launcher closed stdout early: {}", text(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    let workers = children_of(launcher.id());
    assert_eq!(
        workers.len(),
        2,
        "expected two worker processes, found {workers:?}"
    );
    let killed = Command::new("kill")
        .args(["-TERM", &launcher.id().to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let start = Instant::now();
    let status = loop {
        if let Some(s) = launcher.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "launcher ignored SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(130));
    for pid in workers {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "worker {pid} still exists"
        );
    }
}

/// Pids whose parent is `pid` (Linux /proc).
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        // Fields after the parenthesised command name: state, ppid, ...
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r.to_string()) else {
            continue;
        };
        let ppid = rest
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push(child);
        }
    }
    out
}

#[test]
fn inconsistent_layouts_are_refused_with_the_arithmetic() {
    let out = mtrain(&["--dp", "2", "--tp", "2", "--nproc-per-node", "3"])
        .bounded_output_within(Duration::from_secs(20));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr.contains("dp(2) * pp(1) * tp(2) = 4 != world size 3 (nproc-per-node 3 * nnodes 1)"),
        "stderr:\n{stderr}"
    );
    assert!(
        !stderr.contains("[rank"),
        "nothing may be launched:\n{stderr}"
    );

    let out = mtrain(&["plan", "--tp", "4", "--nproc-per-node", "6"])
        .bounded_output_within(Duration::from_secs(20));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr.contains(
            "world size 6 (nproc-per-node 6 * nnodes 1) is not divisible by tp(4) * pp(1) = 4"
        ),
        "{stderr}"
    );

    // Started by an external launcher: WORLD_SIZE decides, and the flags must fit it.
    let mut cmd = mtrain(&["--tp", "2", "bench-comm"]);
    for (k, v) in [
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "3"),
        ("LOCAL_WORLD_SIZE", "3"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "1"),
    ] {
        cmd.env(k, v);
    }
    let out = cmd.bounded_output_within(Duration::from_secs(20));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr.contains("world size 3 (WORLD_SIZE=3) is not divisible by tp(2) * pp(1) = 2"),
        "{stderr}"
    );
}

/// A flag that acts only on CUDA GPUs, given for a run on the CPU, is refused naming the flag and
/// what it needs, before anything is launched: training, `plan` and `bench-comm` alike. `--comm
/// auto` (the default) is taken on any device, and `plan` takes `--comm ipc` with `--device cuda`.
#[test]
fn gpu_only_flags_are_refused_on_the_cpu() {
    for (args, flag) in [
        (&["--comm", "ipc", "--steps", "1"][..], "--comm ipc"),
        (&["--nproc-per-node", "2", "--comm", "staged"], "--comm staged"),
        (&["--comm", "nccl", "--device", "cpu"], "--comm nccl"),
        (&["plan", "--tp", "2", "--comm", "ipc"], "--comm ipc"),
        (&["--comm", "staged", "plan", "--tp", "2"], "--comm staged"),
        (&["--nproc-per-node", "2", "bench-comm", "--comm", "ipc"], "--comm ipc"),
    ] {
        let out = mtrain(args).bounded_output_within(Duration::from_secs(20));
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "mtrain {args:?}:\n{stderr}");
        assert!(
            stderr.contains(&format!(
                "error: {flag} needs --device cuda: it picks the collective backend of ranks on GPUs"
            )),
            "mtrain {args:?}:\n{stderr}"
        );
        assert!(!stderr.contains("[rank"), "nothing may be launched:\n{stderr}");
    }
    for args in [
        &["plan", "--tp", "2", "--comm", "auto"][..],
        &["plan", "--tp", "2", "--comm", "ipc", "--device", "cuda"],
    ] {
        let out = mtrain(args).bounded_output_within(Duration::from_secs(20));
        assert!(out.status.success(), "mtrain {args:?}:\n{}", text(&out.stderr));
    }
}

/// busbw / algbw as nccl-tests defines it, for checking the binary's arithmetic.
fn bus_factor(op: &str, n: f64) -> f64 {
    match op {
        "all-reduce" => 2.0 * (n - 1.0) / n,
        "all-gather" | "reduce-scatter" | "all-to-all" => (n - 1.0) / n,
        _ => 1.0,
    }
}

#[test]
fn bench_comm_at_two_ranks_is_correct_for_every_op() {
    let dir = tempfile::tempdir().unwrap();
    for (op, dtype) in [
        ("all-reduce", "f32"),
        ("all-reduce", "bf16"),
        ("all-gather", "f32"),
        ("reduce-scatter", "bf16"),
        ("all-to-all", "f32"),
        ("broadcast", "f32"),
        ("send-recv", "bf16"),
    ] {
        let json = dir.path().join(format!("{op}-{dtype}.json"));
        let json_arg = json.to_string_lossy().into_owned();
        let args = [
            "--nproc-per-node",
            "2",
            "bench-comm",
            "-b",
            "8",
            "-e",
            "1M",
            "-f",
            "8",
            "--op",
            op,
            "--dtype",
            dtype,
            "-n",
            "3",
            "-w",
            "1",
            "--json",
            &json_arg,
        ];
        let out = mtrain(&args).bounded_output_within(Duration::from_secs(60));
        let stdout = text(&out.stdout);
        assert!(
            out.status.success(),
            "{op} {dtype}: stdout:\n{stdout}\nstderr:\n{}",
            text(&out.stderr)
        );
        // The table comes from rank 0 only, unprefixed: stdout is the job's results.
        assert!(stdout.starts_with("# mtrain bench-comm: "), "{stdout}");
        assert!(!stdout.contains("[rank"), "{stdout}");
        assert!(stdout.contains("# Out of bounds values : 0 OK"), "{stdout}");

        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(report["world_size"], 2);
        assert_eq!(report["op"], op);
        let rows = report["rows"].as_array().unwrap();
        // 8 B, 64 B, 512 B, 4 KiB, 32 KiB, 256 KiB: six sizes.
        assert_eq!(rows.len(), 6, "{op}: {rows:?}");
        let elem = if dtype == "f32" { 4 } else { 2 };
        for row in rows {
            assert_eq!(row["wrong"], 0, "{op} {dtype}: {row}");
            let count = row["count"].as_u64().unwrap();
            assert_eq!(row["bytes"].as_u64().unwrap(), count * elem, "{row}");
            let (alg, bus) = (
                row["algbw_gbps"].as_f64().unwrap(),
                row["busbw_gbps"].as_f64().unwrap(),
            );
            assert!(
                (bus - alg * bus_factor(op, 2.0)).abs() <= 1e-9 * alg.max(1.0),
                "{row}"
            );
        }
        assert!(rows.last().unwrap()["time_us"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn workers_started_by_an_external_launcher_form_a_job() {
    // What Slurm or torchrun does: set the variables and start each rank; no mtrain launcher.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let spawn = |rank: &str| {
        let mut cmd = mtrain(&[
            "bench-comm",
            "-b",
            "1K",
            "-e",
            "1K",
            "--op",
            "all-reduce",
            "-n",
            "2",
            "-w",
            "0",
        ]);
        for (k, v) in [
            ("RANK", rank),
            ("LOCAL_RANK", rank),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", port.as_str()),
            ("MTRAIN_JOB_ID", "external-launch-test"),
        ] {
            cmd.env(k, v);
        }
        std::thread::spawn(move || cmd.bounded_output_within(Duration::from_secs(60)))
    };
    let (r0, r1) = (spawn("0"), spawn("1"));
    let (out0, out1) = (r0.join().unwrap(), r1.join().unwrap());
    assert!(
        out0.status.success() && out1.status.success(),
        "{}\n{}",
        text(&out0.stderr),
        text(&out1.stderr)
    );
    let table = text(&out0.stdout);
    assert!(table.contains("# Out of bounds values : 0 OK"), "{table}");
    assert!(text(&out1.stdout).is_empty(), "rank 1 prints no table");
}

#[test]
fn a_world_of_one_runs_in_process() {
    let out = mtrain(&["bench-comm", "-b", "64", "-e", "64", "-n", "2"])
        .bounded_output_within(Duration::from_secs(30));
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        stdout.starts_with("# mtrain bench-comm: all-reduce (sum), 1 ranks"),
        "{stdout}"
    );
    assert!(
        !stdout.contains("[rank"),
        "no workers are spawned for one rank: {stdout}"
    );
}

/// The sizes of a `bench-comm --json -` report's rows (and the table, on stderr).
fn swept_sizes(args: &[&str]) -> (Vec<u64>, String) {
    let out = mtrain(args).bounded_output_within(Duration::from_secs(60));
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{args:?}: {stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = report["rows"].as_array().unwrap().iter();
    (rows.map(|r| r["bytes"].as_u64().unwrap()).collect(), stderr)
}

#[test]
fn a_sweep_from_zero_bytes_measures_every_size_up_to_the_largest() {
    // One rank, f32 all-reduce: the smallest message is one element, 4 bytes.
    let sweep = ["bench-comm", "-b", "0", "-e", "64", "-n", "2", "--json", "-"];
    let (sizes, table) = swept_sizes(&sweep);
    assert_eq!(sizes, [0, 4, 8, 16, 32, 64], "{table}");
    assert!(
        table.contains("# -b 0: 0 B measured, then the sizes go on from 4 B"),
        "{table}"
    );
    // Two ranks, all-gather: one element per rank, 8 bytes.
    let two = ["--nproc-per-node", "2", "--op", "all-gather"];
    let (sizes, table) = swept_sizes(&[&two[..2], &sweep[..1], &two[2..], &sweep[1..]].concat());
    assert_eq!(sizes, [0, 8, 16, 32, 64], "{table}");
    assert!(table.contains("# Out of bounds values : 0 OK"), "{table}");
    // A factor that never grows the size is refused, naming the flag.
    for f in ["1", "0"] {
        let out = mtrain(&["bench-comm", "-b", "0", "-e", "64", "-f", f])
            .bounded_output_within(Duration::from_secs(30));
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "-f {f} ran: {}", text(&out.stdout));
        assert!(
            stderr.contains("-f/--stepfactor must be at least 2"),
            "{stderr}"
        );
    }
}

#[test]
fn plan_prints_the_8_rank_grid() {
    let out = mtrain(&["plan", "--dp", "2", "--pp", "2", "--tp", "2"])
        .bounded_output_within(Duration::from_secs(30));
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        stdout.starts_with("world size 8 = dp(2) * pp(2) * tp(2)"),
        "{stdout}"
    );
    // rank = (dp_idx * pp + pp_idx) * tp + tp_idx, computed here independently of the binary.
    let rank = |d: usize, p: usize, t: usize| (d * 2 + p) * 2 + t;
    let fmt = |groups: Vec<Vec<usize>>| {
        groups
            .iter()
            .map(|g| format!("{g:?}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let tp: Vec<Vec<usize>> = (0..2)
        .flat_map(|d| (0..2).map(move |p| (0..2).map(|t| rank(d, p, t)).collect()))
        .collect();
    let pp: Vec<Vec<usize>> = (0..2)
        .flat_map(|d| (0..2).map(move |t| (0..2).map(|p| rank(d, p, t)).collect()))
        .collect();
    let mut dp: Vec<Vec<usize>> = (0..2)
        .flat_map(|p| (0..2).map(move |t| (0..2).map(|d| rank(d, p, t)).collect()))
        .collect();
    dp.sort();
    for (kind, groups) in [("tp", tp), ("pp", pp), ("dp", dp)] {
        let line = format!("{kind} groups:  {}", fmt(groups));
        assert!(stdout.contains(&line), "missing `{line}` in:\n{stdout}");
    }
    for (d, p) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
        let row = format!("dp={d} pp={p}:    {}    {}", rank(d, p, 0), rank(d, p, 1));
        assert!(
            stdout.contains(&row),
            "missing grid row `{row}` in:\n{stdout}"
        );
    }
    assert!(!stdout.contains("[rank"), "plan launches nothing");
}

#[test]
fn two_nodes_on_loopback_form_one_job() {
    // Two launchers, as on two hosts: node r starts global ranks 2r and 2r+1.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let node = |node_rank: &'static str| {
        let args = [
            "--nnodes",
            "2",
            "--node-rank",
            node_rank,
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
            "bench-comm",
            "-b",
            "4K",
            "-e",
            "4K",
            "--op",
            "all-gather",
            "-n",
            "2",
            "-w",
            "0",
        ];
        let mut cmd = mtrain(&args);
        std::thread::spawn(move || cmd.bounded_output_within(Duration::from_secs(60)))
    };
    let (n0, n1) = (node("0"), node("1"));
    let (out0, out1) = (n0.join().unwrap(), n1.join().unwrap());
    let (stdout0, stdout1) = (text(&out0.stdout), text(&out1.stdout));
    assert!(
        out0.status.success() && out1.status.success(),
        "{}\n{}",
        text(&out0.stderr),
        text(&out1.stderr)
    );
    assert!(
        text(&out0.stderr).contains("launching ranks 0..=1"),
        "{}",
        text(&out0.stderr)
    );
    assert!(
        text(&out1.stderr).contains("launching ranks 2..=3"),
        "{}",
        text(&out1.stderr)
    );
    assert!(
        stdout0.starts_with("# mtrain bench-comm: all-gather, 4 ranks"),
        "{stdout0}"
    );
    assert!(
        stdout0.contains("# Out of bounds values : 0 OK"),
        "{stdout0}"
    );
    assert!(stdout1.is_empty(), "node 1 holds no rank 0: {stdout1}");
}

/// Whether `pid` is a live process (a zombie waiting to be reaped is not).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z"),
    }
}

/// Collect `pipe` into a shared buffer from a thread, so a test can wait for a line in it.
fn collect(mut pipe: impl Read + Send + 'static) -> std::sync::Arc<std::sync::Mutex<Vec<u8>>> {
    let buf = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = buf.clone();
    std::thread::spawn(move || {
        let mut chunk = [0u8; 4096];
        while let Ok(n) = pipe.read(&mut chunk) {
            if n == 0 {
                break;
            }
            sink.lock().unwrap().extend_from_slice(&chunk[..n]);
        }
    });
    buf
}

/// Wait up to `limit` for `needle` in `buf`; fails the test with what arrived otherwise.
fn wait_for(buf: &std::sync::Mutex<Vec<u8>>, needle: &str, limit: Duration) {
    let start = Instant::now();
    while !text(&buf.lock().unwrap()).contains(needle) {
        assert!(
            start.elapsed() < limit,
            "no `{needle}` within {limit:?}:\n{}",
            text(&buf.lock().unwrap())
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A training run that goes on far longer than any test (10^6 steps of the tiny model).
const LONG_TRAINING: [&str; 8] = [
    "--steps",
    "1000000",
    "--eval-every",
    "0",
    "--log-every",
    "1",
    "--batch-size",
    "2",
];

#[test]
fn no_worker_outlives_a_launcher_killed_by_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().to_str().unwrap();
    let mut args = vec!["--nproc-per-node", "2", "--run-dir", run_dir];
    args.extend(LONG_TRAINING);
    let mut cmd = mtrain(&args);
    cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    let mut launcher: Child = cmd.spawn().expect("spawn");
    let stderr = collect(launcher.stderr.take().expect("stderr"));
    // Training is under way once rank 0 logged a step.
    wait_for(&stderr, "[rank 0]", Duration::from_secs(60));
    wait_for(&stderr, "step", Duration::from_secs(60));
    let workers = children_of(launcher.id());
    assert_eq!(workers.len(), 2, "expected two workers, found {workers:?}");
    assert!(workers.iter().all(|&p| alive(p)), "workers {workers:?}");

    launcher.kill().expect("SIGKILL the launcher");
    launcher.wait().expect("reap the launcher");
    std::thread::sleep(Duration::from_secs(5));
    let survivors: Vec<u32> = workers.into_iter().filter(|&p| alive(p)).collect();
    for &p in &survivors {
        // Do not leave them running past the test, whatever it concludes.
        let _ = Command::new("kill")
            .args(["-KILL", &p.to_string()])
            .status();
    }
    assert!(
        survivors.is_empty(),
        "workers {survivors:?} still alive 5 s after SIGKILL of their launcher"
    );
}

#[test]
fn workers_of_an_external_launcher_end_when_the_store_host_dies() {
    // As under torchrun: rank 0 serves the store, no mtrain launcher ties the ranks together.
    let (_dir, mut workers) = external_pair(&[], "store-liveness-test");
    let (mut rank1, err1) = workers.pop().expect("rank 1");
    let (mut rank0, err0) = workers.pop().expect("rank 0");
    wait_for(&err0, "step", Duration::from_secs(60));
    rank0.kill().expect("SIGKILL rank 0");
    rank0.wait().expect("reap rank 0");
    let Some(status) = exit_within(&mut rank1, Duration::from_secs(5)) else {
        panic!(
            "rank 1 still running 5 s after the store's host died:\n{}",
            text(&err1.lock().unwrap())
        );
    };
    std::thread::sleep(Duration::from_millis(200)); // the last lines of its stderr
    let log = text(&err1.lock().unwrap());
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    assert!(log.contains("error:"), "a clean error is printed:\n{log}");
}

/// A rank that stops answering is named by the rank waiting for it, with the line that issued
/// the collective it waits in: ranks 0 and 1 of `--tp 2` train, rank 1 is stopped (SIGSTOP),
/// and rank 0's collective (a tensor-parallel all-reduce, mostly) times out naming rank 1, the
/// op, its sequence number and its site, then lists its last collectives, each with its site.
#[test]
fn a_timed_out_collective_names_where_it_was_issued() {
    let (_dir, mut workers) = external_pair(&["--tp", "2", "--comm-timeout", "2"], "site-test");
    let (mut rank1, _err1) = workers.pop().expect("rank 1");
    let (mut rank0, err0) = workers.pop().expect("rank 0");
    wait_for(&err0, "step", Duration::from_secs(60));
    let signal = |sig: &str, child: &Child| {
        let sent = Command::new("kill")
            .args([sig, &child.id().to_string()])
            .status()
            .expect("kill");
        assert!(sent.success(), "kill {sig}");
    };
    signal("-STOP", &rank1);
    let status = exit_within(&mut rank0, Duration::from_secs(20));
    signal("-CONT", &rank1);
    let _ = rank1.kill();
    let _ = rank1.wait();
    let Some(status) = status else {
        panic!("rank 0 still running 20 s after rank 1 stopped");
    };
    std::thread::sleep(Duration::from_millis(200)); // the last lines of its stderr
    let log = text(&err0.lock().unwrap());
    assert_eq!(status.code(), Some(1), "{log}");
    let error = log
        .lines()
        .find(|l| l.starts_with("error: ") && l.contains("timed out"))
        .unwrap_or_else(|| panic!("no timeout error in rank 0's log:\n{log}"));
    // Most of a step's collectives are the tp group's; the one the stop caught may also be the
    // step's norm (the world group's, issued by the runtime): either names its line.
    assert!(
        error.contains("waiting for rank 1") && error.contains("issued at crates/parallel/src/"),
        "the error should name rank 1 and the line that issued the collective: {error}"
    );
    if error.contains("on group 'tp'") {
        assert!(error.contains("issued at crates/parallel/src/tensor_parallel/"), "{error}");
    }
    let recent: Vec<&str> = log.lines().filter(|l| l.trim_start().starts_with('#')).collect();
    assert!(!recent.is_empty(), "no recent collectives listed:\n{log}");
    for line in recent {
        assert!(line.contains(" at crates/"), "a recent collective without its site: {line}");
    }
}

/// What a worker wrote to stderr, collected while it runs.
type Collected = std::sync::Arc<std::sync::Mutex<Vec<u8>>>;

/// Ranks 0 and 1 of one job started as torchrun starts them (rank 0 serves the store, no mtrain
/// launcher ties them together), each training `args` then [`LONG_TRAINING`] into the returned
/// temporary run directory; their stderr collected.
fn external_pair(args: &[&str], job: &str) -> (tempfile::TempDir, Vec<(Child, Collected)>) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let dir = tempfile::tempdir().unwrap();
    let workers = ["0", "1"]
        .into_iter()
        .map(|rank| {
            let mut all = args.to_vec();
            all.extend(["--run-dir", dir.path().to_str().unwrap()]);
            all.extend(LONG_TRAINING);
            let mut cmd = mtrain(&all);
            for (k, v) in [
                ("RANK", rank),
                ("LOCAL_RANK", rank),
                ("WORLD_SIZE", "2"),
                ("LOCAL_WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", port.as_str()),
                ("MTRAIN_JOB_ID", job),
            ] {
                cmd.env(k, v);
            }
            cmd.stdout(Stdio::null()).stderr(Stdio::piped());
            let mut child = cmd.spawn().expect("spawn a worker");
            let stderr = collect(child.stderr.take().expect("stderr"));
            (child, stderr)
        })
        .collect();
    (dir, workers)
}

/// The child's exit status once it exits within `limit`; None (the child killed and reaped)
/// when it is still running then.
fn exit_within(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A port `p` that is free now with `p + 1` free too (the port torchrun's store holds and the
/// one mtrain's store takes under it).
fn free_port_pair() -> u16 {
    for _ in 0..100 {
        let p = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no two consecutive free ports on loopback");
}

/// What torchrun's agent sets for worker `rank` of `world` on one node (torch 2.x,
/// `--standalone`), besides MASTER_PORT.
fn torchrun_env(rank: usize, world: usize) -> Vec<(&'static str, String)> {
    let r = rank.to_string();
    let w = world.to_string();
    vec![
        ("RANK", r.clone()),
        ("LOCAL_RANK", r.clone()),
        ("GROUP_RANK", "0".into()),
        ("ROLE_RANK", r),
        ("ROLE_NAME", "default".into()),
        ("WORLD_SIZE", w.clone()),
        ("LOCAL_WORLD_SIZE", w.clone()),
        ("ROLE_WORLD_SIZE", w),
        ("GROUP_WORLD_SIZE", "1".into()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("TORCHELASTIC_RUN_ID", "none".into()),
        ("TORCHELASTIC_RESTART_COUNT", "0".into()),
        ("TORCHELASTIC_MAX_RESTARTS", "0".into()),
        ("TORCHELASTIC_USE_AGENT_STORE", "True".into()),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1".into()),
        ("OMP_NUM_THREADS", "1".into()),
    ]
}

/// `torchrun --standalone --nproc-per-node 2 --no-python mtrain --dp 2 --steps 3`, with this test
/// standing in for torchrun: it holds MASTER_PORT as torchrun's agent store does, then starts
/// the two workers with torchrun's environment. They train together on MASTER_PORT + 1 and
/// never touch torchrun's port; without the agent-store variable rank 0 would try to bind
/// MASTER_PORT and says why it cannot.
#[test]
fn a_job_started_by_torchrun_meets_beside_torchruns_store() {
    let port = free_port_pair();
    let agent_store = std::net::TcpListener::bind(("127.0.0.1", port)).expect("hold MASTER_PORT");
    agent_store.set_nonblocking(true).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let spawn = |rank: usize| {
        let mut cmd = mtrain(&[
            "--dp",
            "2",
            "--steps",
            "3",
            "--log-every",
            "1",
            "--eval-every",
            "0",
            "--batch-size",
            "2",
            "--run-dir",
            run_dir.to_str().unwrap(),
        ]);
        for (k, v) in torchrun_env(rank, 2) {
            cmd.env(k, v);
        }
        cmd.env("MASTER_PORT", port.to_string())
            .env_remove("MTRAIN_JOB_ID")
            .env_remove("MTRAIN_STORE_PORT");
        std::thread::spawn(move || cmd.bounded_output_within(Duration::from_secs(120)))
    };
    let (r0, r1) = (spawn(0), spawn(1));
    let (out0, out1) = (r0.join().unwrap(), r1.join().unwrap());
    let (err0, err1) = (text(&out0.stderr), text(&out1.stderr));
    assert!(
        out0.status.success() && out1.status.success(),
        "rank 0:\n{err0}\nrank 1:\n{err1}"
    );
    // Nobody connected to torchrun's store.
    assert!(
        matches!(agent_store.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "a worker connected to MASTER_PORT, torchrun's own store"
    );
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 3, "{metrics}");
    // Rank 0 logs the steps; rank 1 does not.
    assert!(err0.contains("step 3/3 | loss "), "{err0}");
    assert!(!err1.contains("step 3/3"), "{err1}");

    // The same workers without torchrun's agent-store variable: rank 0 must serve the store on
    // MASTER_PORT itself, finds it taken, and names the rule and the way out.
    let mut cmd = mtrain(&["--dp", "2", "--steps", "1", "--run-dir", dir.path().join("other").to_str().unwrap()]);
    for (k, v) in torchrun_env(0, 2) {
        cmd.env(k, v);
    }
    cmd.env("MASTER_PORT", port.to_string())
        .env_remove("TORCHELASTIC_USE_AGENT_STORE");
    let out = cmd.bounded_output_within(Duration::from_secs(60));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot serve the rendezvous store on 127.0.0.1:{port}"))
            && stderr.contains("MTRAIN_STORE_PORT"),
        "{stderr}"
    );
    drop(agent_store);
}

/// `--json -` makes stdout a JSON document a program can parse, with the table on stderr;
/// nccl-tests' -d, -o and -c work; the header says how the time is taken over ranks.
#[test]
fn bench_comm_json_on_stdout_parses() {
    let args = [
        "--nproc-per-node", "2", "bench-comm", "-b", "64", "-e", "1K", "-f", "4", "-n", "2", "-w",
        "0", "-d", "bfloat16", "-o", "max", "--json", "-",
    ];
    let out = mtrain(&args).bounded_output_within(Duration::from_secs(60));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{stdout}"));
    assert_eq!(report["world_size"], 2);
    assert_eq!(report["dtype"], "bf16");
    assert_eq!(report["reduce_op"], "max");
    assert_eq!(report["time"], "max over ranks of each rank's mean");
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3, "{stdout}");
    assert!(rows.iter().all(|r| r["wrong"] == 0), "{stdout}");
    assert!(
        stderr.contains("[rank 0] # mtrain bench-comm: all-reduce (max), 2 ranks, bfloat16")
            && stderr.contains("# time: max over ranks of each rank's mean"),
        "{stderr}"
    );

    // -c 0: nothing checked, and the table says so.
    let out = mtrain(&["--nproc-per-node", "2", "bench-comm", "-b", "64", "-e", "64", "-n", "1", "-c", "0"])
        .bounded_output_within(Duration::from_secs(60));
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(stdout.contains("N/A") && stdout.contains("not checked (-c 0)"), "{stdout}");
    // A reduction for an op that does not reduce is refused.
    let out = mtrain(&["bench-comm", "--op", "all-gather", "-o", "min"])
        .bounded_output_within(Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("-o/--reduce-op min applies to all-reduce and reduce-scatter, not all-gather"), "{}", text(&out.stderr));
}

/// Under `--tp 2` (one data-parallel rank on two devices) the step lines come from rank 0, or
/// from every rank with `--log-ranks`; MFU is per device (divided by 2, not by dp = 1);
/// metrics.jsonl keeps what the line rounds.
#[test]
fn step_lines_come_from_rank_0_and_mfu_is_per_device() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let rd = run_dir.to_str().unwrap();
    let base = [
        "--tp", "2", "--steps", "2", "--log-every", "1", "--eval-every", "0", "--batch-size", "2",
        "--set", "peak_flops=1e12", "--run-dir", rd,
    ];
    let out = mtrain(&base).bounded_output_within(Duration::from_secs(120));
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let step_lines: Vec<&str> = stderr.lines().filter(|l| l.contains("step 2/2 |")).collect();
    assert_eq!(step_lines.len(), 1, "{stderr}");
    assert!(step_lines[0].starts_with("[rank 0]"), "{stderr}");
    assert!(stderr.contains("done: 2 steps") && !stderr.contains("steps=2.0"), "{stderr}");

    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    let flops_per_token = mtrain_model::GptConfig::tiny().flops_per_token(64);
    let tokens_per_s = last["tokens_per_s"].as_f64().unwrap();
    let want = flops_per_token * tokens_per_s / (1e12 * 2.0);
    let mfu = last["mfu"].as_f64().unwrap();
    assert!((mfu - want).abs() <= 1e-12 * want, "mfu {mfu} vs per-device {want}");
    // The line rounds the loss to 4 decimals; the JSON line has it whole.
    let loss = last["loss"].as_f64().unwrap();
    assert!(step_lines[0].contains(&format!("| loss {loss:.4} |")), "{}", step_lines[0]);
    assert_ne!(format!("{loss}"), format!("{loss:.4}"), "metrics.jsonl keeps full precision");

    let mut again = base.to_vec();
    again.extend(["--log-ranks", "--overwrite"]);
    let out = mtrain(&again).bounded_output_within(Duration::from_secs(120));
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    for rank in 0..2 {
        assert!(
            stderr.lines().any(|l| l.starts_with(&format!("[rank {rank}]")) && l.contains("step 2/2 |")),
            "rank {rank} logs its steps under --log-ranks:\n{stderr}"
        );
    }
}

/// A second run into a directory that holds a run is refused (once, by the launcher, before any
/// worker starts) unless it resumes or overwrites; a directory in use by a live run is refused
/// even then, and a killed run does not keep it locked.
#[test]
fn a_run_directory_belongs_to_one_run() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let rd = run_dir.to_str().unwrap();
    let short = |extra: &[&str]| {
        let steps = if extra.contains(&"--resume") { "2" } else { "1" };
        let mut args = vec!["--steps", steps, "--eval-every", "0", "--batch-size", "2", "--run-dir", rd];
        args.extend_from_slice(extra);
        mtrain(&args).bounded_output_within(Duration::from_secs(120))
    };
    let first = short(&[]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();

    for layout in [&[][..], &["--dp", "2"][..]] {
        let out = short(layout);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains(&format!("{rd} already holds a run"))
                && stderr.contains("--resume")
                && stderr.contains("--overwrite"),
            "{stderr}"
        );
        assert!(!stderr.contains("[rank"), "refused before any worker starts:\n{stderr}");
    }
    assert_eq!(std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap(), metrics, "the refused runs wrote nothing");

    // --resume continues the run: one more step, the same run id on every line.
    let out = short(&["--resume"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.iter().map(|l| l["step"].as_u64().unwrap()).collect::<Vec<_>>(), [0, 1]);
    assert!(lines[0]["run"].is_string() && lines[0]["run"] == lines[1]["run"], "{lines:?}");
    let out = mtrain(&["plot", rd]).bounded_output_within(Duration::from_secs(60));
    assert!(out.status.success(), "{}", text(&out.stderr));

    // Two runs at once: the second is refused while the first lives, even with --overwrite.
    let busy = dir.path().join("busy");
    let busy_arg = busy.to_str().unwrap();
    let mut args = vec!["--run-dir", busy_arg];
    args.extend(LONG_TRAINING);
    let mut cmd = mtrain(&args);
    cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    let mut running = cmd.spawn().expect("spawn");
    let err = collect(running.stderr.take().expect("stderr"));
    wait_for(&err, "step 1/", Duration::from_secs(60));
    let second = mtrain(&["--steps", "1", "--run-dir", busy_arg, "--overwrite"])
        .bounded_output_within(Duration::from_secs(60));
    let stderr = text(&second.stderr);
    let _ = running.kill();
    let _ = running.wait();
    assert_eq!(second.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("{busy_arg} is in use by another run (pid {}", running.id())),
        "{stderr}"
    );
    // The killed run's lock died with it.
    let third = mtrain(&["--steps", "1", "--eval-every", "0", "--batch-size", "2", "--run-dir", busy_arg, "--overwrite"])
        .bounded_output_within(Duration::from_secs(120));
    assert!(third.status.success(), "{}", text(&third.stderr));
}

/// `text` without its ANSI escape sequences (`ESC [ ... letter`).
fn strip_ansi(text: &str) -> String {
    let mut out = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            chars.next();
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// On a terminal the progress bar shows elapsed time and ETA and keeps to its own line: every
/// step line starts on a line the bar was cleared from, never after the bar's text. The test
/// gives the run a pseudo-terminal as stderr, as a shell would.
#[test]
fn on_a_terminal_no_log_line_lands_on_the_progress_bar() {
    use std::os::fd::{FromRawFd, OwnedFd};
    let (mut master, mut slave) = (0, 0);
    let size = libc::winsize {
        ws_row: 50,
        ws_col: 200,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: openpty writes two descriptors into the given integers; the other pointers are
    // null (no name) or point at `size`, which outlives the call.
    let rc = unsafe {
        libc::openpty(&mut master, &mut slave, std::ptr::null_mut(), std::ptr::null(), &size)
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors were just opened by openpty and are owned here alone.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let mut cmd = mtrain(&[
        "--steps", "60", "--log-every", "3", "--eval-every", "0", "--batch-size", "1",
        "--seq-len", "16", "--run-dir", rd.to_str().unwrap(),
    ]);
    cmd.env("TERM", "xterm").stdout(Stdio::null()).stderr(Stdio::from(slave));
    let mut child = cmd.spawn().expect("spawn");
    drop(cmd); // the parent's copy of the terminal's slave side, so reading ends with the child
    let mut terminal = std::fs::File::from(master);
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        // A pseudo-terminal's master reads EIO once the last slave is closed.
        while let Ok(n) = terminal.read(&mut buf) {
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        out
    });
    let status = child.wait().expect("wait");
    let screen = text(&reader.join().unwrap());
    assert!(status.success(), "{screen}");
    let plain = strip_ansi(&screen);
    assert!(plain.contains("steps [") && plain.contains("elapsed, ETA"), "no bar drawn:\n{plain}");
    let step_lines: Vec<&str> = screen.split('\n').filter(|l| l.contains(" | loss ")).collect();
    assert!(step_lines.len() >= 20, "{screen}");
    for line in step_lines {
        // What the terminal shows before the log line's timestamp, after the last carriage return.
        let start = line.find("202").expect("a timestamp");
        let before = line[..start].rsplit('\r').next().unwrap_or("");
        assert!(
            strip_ansi(before).trim().is_empty(),
            "a log line landed on the bar's line: {:?}",
            strip_ansi(line)
        );
    }
}
