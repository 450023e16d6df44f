//! The CPU backend: collectives over TCP between processes (or threads), in the spirit of gloo.
//!
//! ```text
//!              rendezvous store (rank 0)          group "tp" [0, 1]    group "dp" [0, 2]
//!   rank 0 --publishes its listener address-->       0 ----- 1            0 ----- 2
//!   rank 1 --reads the addresses of its peers         one TCP connection per pair of members,
//!   ...                                                 a communication thread per group
//! ```
//!
//! - Every process listens on one port and publishes it in the store (`cpu/addr/<rank>`).
//! - A group is a full mesh of TCP connections between its members (TCP_NODELAY), created by
//!   `new_group` on every member in the same order; the connection handshake names the job,
//!   the group and both ranks ([`conn`]).
//! - Each group runs its ops on its own communication thread, in issue order (a send, and a
//!   blocking receive, on the caller's thread where nothing is queued before them, [`group`]);
//!   every op exchanges a header that all ranks check ([`wire`]), then runs its algorithm: ring
//!   all-reduce / reduce-scatter / all-gather ([`ring`], whose transfers the communication
//!   thread drives itself with non-blocking calls, [`pump`]), binomial-tree broadcast and
//!   reduce ([`tree`]), direct scatter / gather / all-to-all / send / recv ([`direct`]).
//! - An all-reduce runs the algorithm its group's [`AlgoChoice`] picks for its size (the same
//!   on every rank, and checked in the header): the ring, a pipelined binary tree
//!   ([`binary_tree`]) or recursive halving-doubling ([`halving_doubling`]), each an
//!   algorithm's [`schedule`] of steps.
//! - Reads give up after the group's timeout; a failure poisons the group.
//! - Under `--link` every op is held until an emulated wire of α + bytes/β per step would
//!   have delivered it ([`link`]), its links a switch or a ring ([`topology`]).
//!
//! Results are new CPU tensors; inputs may be non-contiguous.

mod algorithms;
mod binary_tree;
mod conn;
mod core;
mod direct;
mod group;
mod halving_doubling;
mod link;
mod pump;
mod ring;
pub mod schedule;
mod topology;
mod tree;
mod wire;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::Device;

pub use group::CpuComm;
pub use link::{op_cost, LinkEmulator};
pub use topology::{all_reduce_cost, all_reduce_pieces, Topology, WireCost};

pub use algorithms::all_reduce_schedule;
pub use binary_tree::TREE_PIECE_BYTES;

use self::core::GroupCore;
use crate::algo::AlgoChoice;
use crate::communicator::{Backend, Comm, CommError, Result};
use crate::env::LaunchEnv;
use crate::store::{StoreClient, StoreServer};
use crate::trace::Tracer;
use conn::{Peer, Rendezvous};

/// Settings of the CPU backend.
#[derive(Debug, Clone)]
pub struct CpuOptions {
    /// How long any read from a peer (and the rendezvous) may wait before the op fails.
    pub timeout: Duration,
    /// Record every op in each group's tracer (otherwise only the last few are kept).
    pub trace: bool,
    /// Which algorithm each group's all-reduce runs (ring, tree, halving-doubling, or by size).
    pub algo: AlgoChoice,
    /// An emulated link every message crosses ([`LinkEmulator`]); `None`: loopback as it is.
    pub link: Option<LinkEmulator>,
}

impl Default for CpuOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(300),
            trace: false,
            algo: AlgoChoice::default(),
            link: None,
        }
    }
}

/// The CPU backend of one process: its store connection, its listener and its world group.
pub struct CpuBackend {
    env: LaunchEnv,
    opts: CpuOptions,
    epoch: Instant,
    store: Option<StoreClient>,
    rdv: Option<Arc<Rendezvous>>,
    /// Listener address of each global rank, read from the store once.
    addrs: Mutex<HashMap<usize, SocketAddr>>,
    /// How many groups of each (name, ranks) this process created, to tell repeats apart.
    created: Mutex<HashMap<String, usize>>,
    world: Option<Comm>,
    _server: Option<StoreServer>,
}

impl CpuBackend {
    /// Join the job described by `env`. Rank 0 also hosts the rendezvous store. Returns once the
    /// world group is connected.
    pub fn init(env: &LaunchEnv, opts: CpuOptions) -> Result<CpuBackend> {
        Self::init_inner(env, opts)
    }

    fn init_inner(env: &LaunchEnv, opts: CpuOptions) -> Result<CpuBackend> {
        env.validate()?;
        let mut backend = CpuBackend {
            env: env.clone(),
            opts: opts.clone(),
            epoch: Instant::now(),
            store: None,
            rdv: None,
            addrs: Mutex::new(HashMap::new()),
            created: Mutex::new(HashMap::new()),
            world: None,
            _server: None,
        };
        if env.world_size > 1 {
            let addr = env.store_addr();
            if env.rank == 0 && !env.store_external {
                let server = StoreServer::start_for_job(&addr, &env.job_id).map_err(|e| {
                    CommError::Store(format!("{e} ({})", env.store_port_rule()))
                })?;
                backend._server = Some(server);
            }
            let store = StoreClient::connect(&addr, &env.job_id, opts.timeout)?;
            // Listen on the interface that reaches rank 0 (loopback for a one-host job).
            let ip = store.local_addr()?.ip();
            let (rdv, _accept) = Rendezvous::start(ip, &env.job_id, env.rank)?;
            store.set(
                &format!("cpu/addr/{}", env.rank),
                rdv.addr().to_string().as_bytes(),
            )?;
            backend.store = Some(store);
            backend.rdv = Some(rdv);
        }
        let all: Vec<usize> = (0..env.world_size).collect();
        backend.world = Some(backend.create_group(&all, "world")?);
        Ok(backend)
    }

    /// This process's global rank.
    pub fn rank(&self) -> usize {
        self.env.rank
    }

    pub fn world_size(&self) -> usize {
        self.env.world_size
    }

    pub fn env(&self) -> &LaunchEnv {
        &self.env
    }

    /// The rendezvous store (absent in a one-process job).
    pub fn store(&self) -> Option<&StoreClient> {
        self.store.as_ref()
    }

    fn peer_addr(&self, rank: usize) -> Result<SocketAddr> {
        if let Some(a) = self
            .addrs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&rank)
        {
            return Ok(*a);
        }
        let store = self.store.as_ref().ok_or_else(|| {
            CommError::InvalidGroup("no rendezvous store in a one-process job".into())
        })?;
        let raw = store.get(&format!("cpu/addr/{rank}"))?;
        let text = String::from_utf8_lossy(&raw).to_string();
        let addr: SocketAddr = text.parse().map_err(|_| {
            CommError::Store(format!(
                "rank {rank} published an unreadable address {text:?}"
            ))
        })?;
        self.addrs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(rank, addr);
        Ok(addr)
    }

    fn create_group(&self, ranks: &[usize], name: &str) -> Result<Comm> {
        self.create_group_with(ranks, name, self.opts.algo.clone())
    }

    fn create_group_with(&self, ranks: &[usize], name: &str, algo: AlgoChoice) -> Result<Comm> {
        let me = self.env.rank;
        let n = self.env.world_size;
        if ranks.is_empty()
            || ranks.windows(2).any(|w| w[0] >= w[1])
            || ranks.iter().any(|r| *r >= n)
        {
            return Err(CommError::InvalidGroup(format!(
                "group '{name}' needs distinct ranks in increasing order, each below the world size {n}; got {ranks:?}"
            )));
        }
        let Some(my_index) = ranks.iter().position(|r| *r == me) else {
            return Err(CommError::InvalidGroup(format!(
                "rank {me} called new_group for '{name}' {ranks:?}, which does not contain it (only members create a group)"
            )));
        };
        let base = format!("{name}{ranks:?}");
        let occurrence = {
            let mut created = self.created.lock().unwrap_or_else(|p| p.into_inner());
            let k = created.entry(base.clone()).or_insert(0);
            *k += 1;
            *k - 1
        };
        let key = format!("{base}#{occurrence}");

        let timeout = self.opts.timeout;
        let deadline = Instant::now() + timeout;
        let mut peers: Vec<Option<Peer>> = (0..ranks.len()).map(|_| None).collect();
        if ranks.len() > 1 {
            let rdv = self.rdv.as_ref().ok_or_else(|| {
                CommError::InvalidGroup("no listener in a one-process job".into())
            })?;
            // The higher group rank connects; the lower one accepts.
            for (j, &g) in ranks.iter().enumerate().skip(my_index + 1) {
                let addr = self.peer_addr(g)?;
                let stream = conn::connect(addr, &self.env.job_id, &key, me, g, timeout)?;
                peers[j] = Some(Peer::new(
                    stream,
                    timeout,
                    format!("send-{name}-r{me}-to-r{g}"),
                )?);
            }
            for (j, &g) in ranks.iter().enumerate().take(my_index) {
                let stream = rdv.take(&key, g, deadline)?;
                peers[j] = Some(Peer::new(
                    stream,
                    timeout,
                    format!("send-{name}-r{me}-to-r{g}"),
                )?);
            }
        }
        let tracer = Tracer::new(self.epoch);
        tracer.set_recording(self.opts.trace);
        let mut core = GroupCore::new(
            my_index,
            name.to_string(),
            ranks.to_vec(),
            fnv1a(&key),
            timeout,
            peers,
            tracer,
            Arc::default(),
        );
        core.algo = algo;
        Ok(Arc::new(CpuComm::start(core, self.opts.link)?))
    }
}

impl Backend for CpuBackend {
    fn world(&self) -> Comm {
        match &self.world {
            Some(w) => w.clone(),
            None => unreachable!("the world group is created in init"),
        }
    }

    fn new_group(&self, ranks: &[usize], name: &str) -> Result<Comm> {
        self.create_group(ranks, name)
    }

    fn new_group_with_algo(
        &self,
        ranks: &[usize],
        name: &str,
        algo: AlgoChoice,
    ) -> Result<Option<Comm>> {
        self.create_group_with(ranks, name, algo).map(Some)
    }

    fn device(&self) -> Device {
        Device::Cpu
    }
}

impl Drop for CpuBackend {
    fn drop(&mut self) {
        if let Some(rdv) = &self.rdv {
            rdv.stop();
        }
    }
}

/// FNV-1a: a hash that is the same in every process, for the group id in op headers.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Run `f` once per rank of a `world_size`-rank job, each rank on its own thread of this
/// process, connected over loopback TCP through an in-process store on a free port. Returns the
/// results in rank order; a panic on any rank is re-raised here. Meant for tests and examples.
pub fn run_local<R: Send>(
    world_size: usize,
    timeout: Duration,
    f: impl Fn(CpuBackend) -> R + Sync,
) -> Vec<R> {
    run_local_with(
        world_size,
        CpuOptions {
            timeout,
            ..CpuOptions::default()
        },
        f,
    )
}

/// [`run_local`] with full options (e.g. tracing switched on).
pub fn run_local_with<R: Send>(
    world_size: usize,
    opts: CpuOptions,
    f: impl Fn(CpuBackend) -> R + Sync,
) -> Vec<R> {
    assert!(
        world_size >= 1,
        "run_local needs at least one rank, got {world_size}"
    );
    static JOBS: AtomicUsize = AtomicUsize::new(0);
    let job_id = format!(
        "local-{}-{}",
        std::process::id(),
        JOBS.fetch_add(1, Ordering::Relaxed)
    );
    let server = if world_size > 1 {
        match StoreServer::start_for_job("127.0.0.1:0", &job_id) {
            Ok(s) => Some(s),
            Err(e) => panic!("run_local: cannot start the in-process store: {e}"),
        }
    } else {
        None
    };
    let port = server.as_ref().map(|s| s.local_addr().port()).unwrap_or(0);
    let (f, opts, job_id) = (&f, &opts, &job_id);
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let env = LaunchEnv {
                    rank,
                    local_rank: rank,
                    world_size,
                    local_world_size: world_size,
                    master_addr: "127.0.0.1".into(),
                    master_port: port,
                    store_port: port,
                    job_id: job_id.clone(),
                    // The store is the in-process server started above.
                    store_external: true,
                };
                std::thread::Builder::new()
                    .name(format!("rank{rank}"))
                    .spawn_scoped(s, move || {
                        let backend = CpuBackend::init_inner(&env, opts.clone())
                            .unwrap_or_else(|e| {
                                panic!("rank {rank}: CpuBackend::init failed: {e}")
                            });
                        f(backend)
                    })
                    .unwrap_or_else(|e| {
                        panic!("run_local: cannot spawn the thread of rank {rank}: {e}")
                    })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    });
    drop(server);
    results
}
