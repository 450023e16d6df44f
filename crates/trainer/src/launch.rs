//! The launcher: torchrun's contract, so one command starts a whole job.
//!
//! A process is either the *launcher* or a *worker*. It is a worker when `RANK` is set in its
//! environment (by this launcher, by torchrun, by Slurm or by hand); otherwise, for a world of
//! more than one process, it becomes the launcher of this node's workers:
//!
//! ```text
//!   mtrain --nproc-per-node 4 --tp 2 ...            (launcher, node_rank 0, nnodes 1)
//!      |-- mtrain --nproc-per-node 4 --tp 2 ...     RANK=0 LOCAL_RANK=0   } same arguments,
//!      |-- mtrain --nproc-per-node 4 --tp 2 ...     RANK=1 LOCAL_RANK=1   } same binary,
//!      |-- mtrain --nproc-per-node 4 --tp 2 ...     RANK=2 LOCAL_RANK=2   } torchrun's variables
//!      '-- mtrain --nproc-per-node 4 --tp 2 ...     RANK=3 LOCAL_RANK=3   }
//!          + WORLD_SIZE=4 LOCAL_WORLD_SIZE=4 MASTER_ADDR MASTER_PORT MTRAIN_JOB_ID
//! ```
//!
//! Node `R` of `N` (each with `nproc` workers) starts global ranks `R·nproc .. (R+1)·nproc − 1`.
//! The rendezvous store lives at `MASTER_ADDR:MASTER_PORT`. When no port is given (one node),
//! the launcher serves it itself on a port it binds before starting the workers, so no other
//! process can take that port in between; otherwise rank 0 serves it, as under torchrun.
//!
//! Threads per rank: candle runs its CPU kernels (the gemm included) on rayon's pool, which is as
//! large as the machine has cores. n ranks on c cores would then run n·c threads on c cores and
//! spend their time preempting one another, so the launcher gives each worker `max(1, c / n)`
//! threads through `RAYON_NUM_THREADS` ([`threads_per_rank`]), as torchrun sets `OMP_NUM_THREADS`
//! for PyTorch's. A value the user exported is passed on unchanged.
//!
//! Output: stderr carries the logs, every line forwarded with a `[rank N]` prefix; stdout carries
//! the job's results (bench-comm's table, `--json -`), which rank 0 alone writes, forwarded as
//! written so a program can read it. Any other rank's stdout goes to stderr, prefixed like its logs.
//!
//! Supervision, as torchrun does it: the first worker to fail (non-zero exit code or killed by a signal) takes the job
//! down — the others are killed, the launcher names the failed rank and how it failed, and exits
//! non-zero. Ctrl-C or SIGTERM to the launcher stops every worker.
//!
//! Workers never outlive their launcher, however it ends: each is started with the Linux
//! parent-death signal set to SIGKILL ([`die_with_parent`]), so the kernel kills it the moment
//! the launcher dies, even of SIGKILL. A worker started by another launcher (torchrun, Slurm, by
//! hand) or on another node watches the job's rendezvous store instead
//! ([`crate::liveness`]) and exits when the store goes away.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use mtrain_comm::store::StoreServer;

/// Set for workers whose output this launcher prefixes with `[rank N]`, so they do not add their own.
pub const LINES_PREFIXED_VAR: &str = "MTRAIN_LINES_PREFIXED";

/// Largest degree, node count or world size accepted (2^20 processes): the launcher's limit,
/// which the layout's inference (`layout.rs`, `cli::LayoutArgs::resolve`) checks against too.
pub const MAX_WORLD: usize = 1 << 20;

/// The variable that sizes rayon's pool (and so candle's CPU kernels) in each worker.
pub const THREADS_VAR: &str = "RAYON_NUM_THREADS";

/// Threads each of `nproc` workers gets on a node of `cores` cores: an equal share, at least one.
pub fn threads_per_rank(cores: usize, nproc: usize) -> usize {
    (cores / nproc.max(1)).max(1)
}

/// How often the launcher polls its workers for exit.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// What one node's launcher needs to know to start its share of a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchSpec {
    /// Workers started on this node (torchrun's `--nproc-per-node`).
    pub nproc_per_node: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index, `0..nnodes`.
    pub node_rank: usize,
    /// Address of the rendezvous store (rank 0's host).
    pub master_addr: String,
    /// Port of the rendezvous store; `None` picks a free one (single node only).
    pub master_port: Option<u16>,
}

/// Why a job did not finish cleanly.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("invalid launch: {0}")]
    Invalid(String),

    #[error("could not start rank {rank} ({program}): {source}")]
    Spawn {
        rank: usize,
        program: String,
        source: std::io::Error,
    },

    #[error("rank {rank} failed: {how}; stopped the other workers ({stopped})")]
    WorkerFailed {
        rank: usize,
        how: String,
        stopped: String,
    },

    #[error("interrupted by {signal}; stopped all {workers} workers")]
    Interrupted {
        signal: &'static str,
        workers: usize,
    },

    #[error("could not serve the rendezvous store: {0}")]
    Store(String),

    #[error("launcher i/o: {0}")]
    Io(#[from] std::io::Error),
}

impl LaunchSpec {
    /// Number of processes in the whole job.
    pub fn world_size(&self) -> usize {
        self.nproc_per_node * self.nnodes
    }

    /// The global ranks this node starts: `node_rank·nproc .. (node_rank+1)·nproc`.
    pub fn node_ranks(&self) -> std::ops::Range<usize> {
        let start = self.node_rank * self.nproc_per_node;
        start..start + self.nproc_per_node
    }

    /// Check the numbers that do not depend on the model layout.
    pub fn validate(&self) -> Result<(), LaunchError> {
        if self.nproc_per_node == 0 || self.nnodes == 0 {
            return Err(LaunchError::Invalid(format!(
                "--nproc-per-node ({}) and --nnodes ({}) must be at least 1",
                self.nproc_per_node, self.nnodes
            )));
        }
        if self.node_rank >= self.nnodes {
            return Err(LaunchError::Invalid(format!(
                "--node-rank {} is out of range for --nnodes {} (valid: 0..={})",
                self.node_rank,
                self.nnodes,
                self.nnodes - 1
            )));
        }
        if self.world_size() > MAX_WORLD {
            return Err(LaunchError::Invalid(format!(
                "--nproc-per-node {} * --nnodes {} = {} processes is above the largest supported world of {}",
                self.nproc_per_node,
                self.nnodes,
                self.world_size(),
                MAX_WORLD
            )));
        }
        if self.master_port == Some(0) {
            return Err(LaunchError::Invalid(
                "--master-port 0 names no port the ranks could meet at; give 1..=65535, or leave it out on one node to pick a free one".into(),
            ));
        }
        if self.nnodes > 1 && self.master_port.is_none() {
            return Err(LaunchError::Invalid(format!(
                "--master-port is required with --nnodes {} (every node must meet rank 0 at the same address)",
                self.nnodes
            )));
        }
        Ok(())
    }

    /// The environment of global rank `rank` (which must be one of this node's ranks).
    pub fn worker_env(
        &self,
        rank: usize,
        master_port: u16,
        job_id: &str,
    ) -> Vec<(&'static str, String)> {
        let local_rank = rank - self.node_rank * self.nproc_per_node;
        vec![
            ("RANK", rank.to_string()),
            ("LOCAL_RANK", local_rank.to_string()),
            ("WORLD_SIZE", self.world_size().to_string()),
            ("LOCAL_WORLD_SIZE", self.nproc_per_node.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", master_port.to_string()),
            ("MTRAIN_JOB_ID", job_id.to_string()),
        ]
    }
}

/// Ask the OS for a port that is free on `addr` right now.
pub fn free_port(addr: &str) -> std::io::Result<u16> {
    let listener = TcpListener::bind((addr, 0))?;
    Ok(listener.local_addr()?.port())
}

/// A job id every node of one job agrees on: `MTRAIN_JOB_ID` when the user set one, otherwise
/// derived from the rendezvous address (multi-node) or unique to this launch (single node), so a
/// stray worker of an earlier job is refused by the store.
fn job_id(spec: &LaunchSpec, port: u16) -> String {
    if let Ok(id) = std::env::var("MTRAIN_JOB_ID") {
        if !id.is_empty() {
            return id;
        }
    }
    if spec.nnodes > 1 {
        format!("mtrain-{}-{}", spec.master_addr, port)
    } else {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        format!("mtrain-{}-{}-{:08x}", std::process::id(), port, nanos)
    }
}

/// Describe how a worker ended: `exit code 3` or `killed by signal 9 (SIGKILL)`.
pub fn describe_exit(status: &ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exit code {code}");
    }
    match status.signal() {
        Some(sig) => format!("killed by signal {sig} ({})", signal_name(sig)),
        None => "ended without an exit code or signal".to_string(),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        15 => "SIGTERM",
        _ => "signal",
    }
}

/// One running worker and the threads forwarding its output.
struct Worker {
    rank: usize,
    child: Child,
    forwarders: Vec<JoinHandle<()>>,
    exited: Option<ExitStatus>,
}

/// Where a worker's stream goes: rank 0's stdout as it is, everything else to stderr, prefixed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sink {
    /// The job's stdout: rank 0's results, unprefixed.
    Stdout,
    /// The launcher's stderr, each line prefixed with `[rank N] `.
    PrefixedStderr,
}

/// The sink of `rank`'s stdout (`stdout = true`) or stderr.
fn sink(rank: usize, stdout: bool) -> Sink {
    if stdout && rank == 0 {
        Sink::Stdout
    } else {
        Sink::PrefixedStderr
    }
}

/// Copy `from` to `sink` line by line. Bytes, not strings: a worker's output need not be UTF-8.
fn forward_lines<R: Read + Send + 'static>(from: R, rank: usize, sink: Sink) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let prefix = format!("[rank {rank}] ");
        let mut reader = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    // One write per line under the stream's lock keeps lines of different ranks whole.
                    let result = match sink {
                        Sink::PrefixedStderr => {
                            let mut out = std::io::stderr().lock();
                            out.write_all(prefix.as_bytes())
                                .and_then(|_| out.write_all(&line))
                        }
                        Sink::Stdout => {
                            let mut out = std::io::stdout().lock();
                            out.write_all(&line).and_then(|_| out.flush())
                        }
                    };
                    if result.is_err() {
                        break;
                    }
                }
            }
        }
    })
}

/// Set by the Ctrl-C / SIGTERM handler; the supervision loop stops the workers when it sees it.
fn interrupt_flag() -> Arc<AtomicBool> {
    static FLAG: std::sync::OnceLock<Arc<AtomicBool>> = std::sync::OnceLock::new();
    FLAG.get_or_init(|| {
        let flag = Arc::new(AtomicBool::new(false));
        let setter = flag.clone();
        // Fails only if a handler is already installed; the launcher then relies on the
        // terminal delivering SIGINT to the workers' process group itself.
        if let Err(e) = ctrlc::set_handler(move || setter.store(true, Ordering::SeqCst)) {
            tracing::warn!("could not install the Ctrl-C handler: {e}");
        }
        flag
    })
    .clone()
}

/// Start this node's workers by re-executing the current binary with `args` and torchrun's
/// variables, forward their output, and supervise them until all exit cleanly (`Ok`) or one fails.
pub fn launch(spec: &LaunchSpec, args: &[OsString]) -> Result<(), LaunchError> {
    spec.validate()?;
    let program = std::env::current_exe()?;
    // Without a given port (one node), the launcher serves the rendezvous store itself, on a port
    // it binds and keeps: picking a free port and letting rank 0 bind it later would race with
    // every other process on the machine asking the OS for a port.
    let (port, job_id, store) = match spec.master_port {
        Some(p) => (p, job_id(spec, p), None),
        None => {
            let job_id = job_id(spec, 0);
            let server = StoreServer::start_for_job(&format!("{}:0", spec.master_addr), &job_id)
                .map_err(|e| LaunchError::Store(e.to_string()))?;
            (server.local_addr().port(), job_id, Some(server))
        }
    };
    let interrupted = interrupt_flag();
    tracing::info!(
        world_size = spec.world_size(),
        node_rank = spec.node_rank,
        "launching ranks {}..={} on this node, rendezvous at {}:{port}, job {job_id}",
        spec.node_ranks().start,
        spec.node_ranks().end - 1,
        spec.master_addr,
    );

    let threads = match std::env::var_os(THREADS_VAR) {
        Some(_) => None, // the user's choice, inherited as it is
        None => {
            let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
            Some(threads_per_rank(cores, spec.nproc_per_node))
        }
    };
    let mut workers: Vec<Worker> = Vec::with_capacity(spec.nproc_per_node);
    for rank in spec.node_ranks() {
        let mut cmd = Command::new(&program);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (key, value) in spec.worker_env(rank, port, &job_id) {
            cmd.env(key, value);
        }
        if store.is_some() {
            cmd.env("MTRAIN_STORE_EXTERNAL", "1");
        }
        cmd.env(LINES_PREFIXED_VAR, "1");
        if let Some(t) = threads {
            cmd.env(THREADS_VAR, t.to_string());
        }
        die_with_parent(&mut cmd);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(source) => {
                stop_all(&mut workers);
                return Err(LaunchError::Spawn {
                    rank,
                    program: program.display().to_string(),
                    source,
                });
            }
        };
        let mut forwarders = Vec::with_capacity(2);
        if let Some(out) = child.stdout.take() {
            forwarders.push(forward_lines(out, rank, sink(rank, true)));
        }
        if let Some(err) = child.stderr.take() {
            forwarders.push(forward_lines(err, rank, sink(rank, false)));
        }
        workers.push(Worker {
            rank,
            child,
            forwarders,
            exited: None,
        });
    }

    supervise(&mut workers, &interrupted)
}

/// Make the process `cmd` starts die (SIGKILL) as soon as this process does.
///
/// `prctl(PR_SET_PDEATHSIG)` runs in the child between fork and exec. The signal is sent when the
/// thread that forked the child ends, so workers are spawned from the launcher's main thread,
/// which lives as long as the launcher. If the launcher died before the prctl took effect, the
/// child's parent is already someone else: it exits at once instead of starting orphaned.
fn die_with_parent(cmd: &mut Command) {
    let launcher = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec and calls only prctl, getppid
    // and _exit, which are async-signal-safe; it allocates nothing and takes no locks.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != launcher {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

/// Poll the workers until every one exited with code 0, one failed, or we were interrupted.
fn supervise(workers: &mut [Worker], interrupted: &AtomicBool) -> Result<(), LaunchError> {
    loop {
        if interrupted.load(Ordering::SeqCst) {
            let n = workers.len();
            stop_all(workers);
            return Err(LaunchError::Interrupted {
                signal: "Ctrl-C/SIGTERM",
                workers: n,
            });
        }
        let mut failed: Option<(usize, String)> = None;
        for w in workers.iter_mut().filter(|w| w.exited.is_none()) {
            if let Some(status) = w.child.try_wait()? {
                w.exited = Some(status);
                if !status.success() && failed.is_none() {
                    failed = Some((w.rank, describe_exit(&status)));
                }
            }
        }
        if let Some((mut rank, mut how)) = failed {
            // A peer that loses its partner fails too, often within the same poll. A worker
            // killed by a signal is the cause, an error exit the likely effect: wait one more
            // interval and name a signal death if there is one.
            std::thread::sleep(POLL_INTERVAL);
            for w in workers.iter_mut().filter(|w| w.exited.is_none()) {
                if let Ok(Some(status)) = w.child.try_wait() {
                    w.exited = Some(status);
                }
            }
            if let Some(w) = workers
                .iter()
                .filter(|w| w.rank != rank)
                .find(|w| w.exited.is_some_and(|s| s.signal().is_some()))
            {
                if let (Some(status), false) = (w.exited, how.starts_with("killed")) {
                    rank = w.rank;
                    how = describe_exit(&status);
                }
            }
            let stopped = stop_all(workers);
            let stopped = if stopped.is_empty() {
                "none were still running".to_string()
            } else {
                format!("ranks {stopped:?}")
            };
            return Err(LaunchError::WorkerFailed { rank, how, stopped });
        }
        if workers.iter().all(|w| w.exited.is_some()) {
            join_forwarders(workers);
            return Ok(());
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// Kill every worker still running, reap all, drain their output. Returns the ranks it killed.
fn stop_all(workers: &mut [Worker]) -> Vec<usize> {
    let mut killed = Vec::new();
    for w in workers.iter_mut().filter(|w| w.exited.is_none()) {
        // Already gone between the poll and now is fine: wait() below reaps it either way.
        let _ = w.child.kill();
        killed.push(w.rank);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    for w in workers.iter_mut().filter(|w| w.exited.is_none()) {
        while Instant::now() < deadline {
            match w.child.try_wait() {
                Ok(Some(status)) => {
                    w.exited = Some(status);
                    break;
                }
                Ok(None) => std::thread::sleep(POLL_INTERVAL),
                Err(_) => break,
            }
        }
    }
    join_forwarders(workers);
    killed
}

/// Wait for the output threads so a worker's last lines are printed before the launcher's verdict.
/// A worker's own children could hold its pipes open; they are not waited on past their parent.
fn join_forwarders(workers: &mut [Worker]) {
    for w in workers.iter_mut().filter(|w| w.exited.is_some()) {
        for handle in w.forwarders.drain(..) {
            let _ = handle.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(nproc: usize, nnodes: usize, node_rank: usize, port: Option<u16>) -> LaunchSpec {
        LaunchSpec {
            nproc_per_node: nproc,
            nnodes,
            node_rank,
            master_addr: "127.0.0.1".into(),
            master_port: port,
        }
    }

    #[test]
    fn node_ranks_follow_torchrun() {
        let s = spec(4, 2, 1, Some(29500));
        assert_eq!(s.world_size(), 8);
        assert_eq!(s.node_ranks(), 4..8);
        let env = s.worker_env(6, 29500, "job");
        let get = |k: &str| {
            env.iter()
                .find(|(key, _)| *key == k)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(get("RANK").as_deref(), Some("6"));
        assert_eq!(get("LOCAL_RANK").as_deref(), Some("2"));
        assert_eq!(get("WORLD_SIZE").as_deref(), Some("8"));
        assert_eq!(get("LOCAL_WORLD_SIZE").as_deref(), Some("4"));
        assert_eq!(get("MASTER_PORT").as_deref(), Some("29500"));
        assert_eq!(get("MTRAIN_JOB_ID").as_deref(), Some("job"));
    }

    #[test]
    fn invalid_specs_are_refused_with_the_numbers() {
        let e = spec(4, 2, 2, Some(1)).validate().unwrap_err().to_string();
        assert!(
            e.contains("--node-rank 2") && e.contains("--nnodes 2"),
            "{e}"
        );
        let e = spec(4, 2, 0, None).validate().unwrap_err().to_string();
        assert!(e.contains("--master-port is required"), "{e}");
        assert!(spec(0, 1, 0, None).validate().is_err());
        let e = spec(2, 1, 0, Some(0)).validate().unwrap_err().to_string();
        assert!(e.contains("--master-port 0"), "{e}");
        let e = spec(1 << 20, 2, 0, Some(1))
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("largest supported world of 1048576"), "{e}");
        assert!(spec(2, 1, 0, None).validate().is_ok());
    }

    #[test]
    fn only_rank_0s_stdout_stays_unprefixed_on_stdout() {
        assert_eq!(sink(0, true), Sink::Stdout);
        assert_eq!(sink(0, false), Sink::PrefixedStderr);
        assert_eq!(sink(3, true), Sink::PrefixedStderr);
    }

    #[test]
    fn each_rank_gets_an_equal_share_of_the_cores() {
        assert_eq!(threads_per_rank(2, 1), 2);
        assert_eq!(threads_per_rank(2, 2), 1);
        assert_eq!(threads_per_rank(2, 4), 1); // oversubscribed: one thread each, never zero
        assert_eq!(threads_per_rank(16, 4), 4);
        assert_eq!(threads_per_rank(10, 4), 2);
    }

    #[test]
    fn exit_descriptions_name_code_or_signal() {
        assert_eq!(describe_exit(&ExitStatus::from_raw(3 << 8)), "exit code 3");
        assert_eq!(
            describe_exit(&ExitStatus::from_raw(9)),
            "killed by signal 9 (SIGKILL)"
        );
    }

    #[test]
    fn free_port_is_bindable() {
        let port = free_port("127.0.0.1").unwrap();
        assert!(port > 0);
        assert!(TcpListener::bind(("127.0.0.1", port)).is_ok());
    }
}
