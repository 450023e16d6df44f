//! The rendezvous store: a small key-value server that lets the ranks of a job find each other.
//!
//! Rank 0 hosts it at `MASTER_ADDR:MASTER_PORT`; every rank (rank 0 included) connects as a
//! client. Ranks publish their listening addresses under well-known keys and wait for the keys of
//! their peers, the same way torch's `TCPStore` bootstraps gloo and NCCL.
//!
//! ```text
//!   rank 0 process                       rank 1 process            rank 2 process
//!  +--------------------+
//!  | StoreServer        |<---- TCP ---- StoreClient                StoreClient
//!  |  key -> bytes      |<---- TCP -----------------------------------'
//!  |  (Mutex + Condvar) |<---- TCP ---- StoreClient (rank 0's own)
//!  +--------------------+
//! ```
//!
//! Operations: `set`, `get` (blocks until the key exists), `wait(keys, deadline)`, `add` (atomic
//! counter) and `barrier(name, n, deadline)` built from `add` + `wait`. Every blocking call has a
//! deadline and fails with an error that names the keys it was waiting for. A client first says
//! which job it belongs to; a client of another job is turned away, so two jobs on one port
//! cannot mix.
//!
//! Wire format: each message is a little-endian `u32` length followed by that many bytes of JSON.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::communicator::{CommError, Result};

/// Largest message the store accepts (keys and values are addresses and small ids).
const MAX_MESSAGE: usize = 64 << 20;

#[derive(Debug, serde::Serialize, serde::Deserialize)]
enum Request {
    Hello { job_id: String },
    Set { key: String, value: Vec<u8> },
    Get { key: String, timeout_ms: u64 },
    Wait { keys: Vec<String>, timeout_ms: u64 },
    Add { key: String, delta: i64 },
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
enum Response {
    Ok,
    Value(Vec<u8>),
    Count(i64),
    /// The deadline passed; these keys were still missing.
    Missing(Vec<String>),
    Rejected(String),
}

fn write_msg<T: serde::Serialize>(stream: &mut TcpStream, msg: &T) -> std::io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    stream.write_all(&frame)
}

fn read_msg<T: serde::de::DeserializeOwned>(stream: &mut TcpStream) -> std::io::Result<T> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MESSAGE {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("store message of {len} bytes"),
        ));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body)?;
    serde_json::from_slice(&body)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// The key-value state shared by the server's connection threads.
#[derive(Default)]
struct State {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    /// The job this server serves; pinned by `start_for_job` or by the first client.
    job_id: Mutex<Option<String>>,
}

impl State {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<u8>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Block until every key exists or the timeout passes; returns the keys still missing.
    fn wait(&self, keys: &[String], timeout: Duration) -> Vec<String> {
        let deadline = Instant::now() + timeout;
        let mut map = self.lock();
        loop {
            let missing: Vec<String> = keys
                .iter()
                .filter(|k| !map.contains_key(*k))
                .cloned()
                .collect();
            let now = Instant::now();
            if missing.is_empty() || now >= deadline {
                return missing;
            }
            map = self
                .changed
                .wait_timeout(map, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn handle(&self, req: Request) -> Response {
        match req {
            Request::Hello { .. } => Response::Rejected("hello sent twice".into()),
            Request::Set { key, value } => {
                self.lock().insert(key, value);
                self.changed.notify_all();
                Response::Ok
            }
            Request::Get { key, timeout_ms } => {
                let missing = self.wait(
                    std::slice::from_ref(&key),
                    Duration::from_millis(timeout_ms),
                );
                if !missing.is_empty() {
                    return Response::Missing(missing);
                }
                Response::Value(self.lock().get(&key).cloned().unwrap_or_default())
            }
            Request::Wait { keys, timeout_ms } => {
                let missing = self.wait(&keys, Duration::from_millis(timeout_ms));
                if missing.is_empty() {
                    Response::Ok
                } else {
                    Response::Missing(missing)
                }
            }
            Request::Add { key, delta } => {
                let mut map = self.lock();
                let old = map
                    .get(&key)
                    .and_then(|v| std::str::from_utf8(v).ok()?.parse::<i64>().ok())
                    .unwrap_or(0);
                let new = old + delta;
                map.insert(key, new.to_string().into_bytes());
                drop(map);
                self.changed.notify_all();
                Response::Count(new)
            }
        }
    }

    /// Check a client's job id against the server's (pinning it if this is the first client).
    fn admit(&self, job_id: &str) -> std::result::Result<(), String> {
        let mut mine = self.job_id.lock().unwrap_or_else(|p| p.into_inner());
        match mine.as_deref() {
            None => {
                *mine = Some(job_id.to_string());
                Ok(())
            }
            Some(j) if j == job_id => Ok(()),
            Some(j) => Err(format!(
                "this store serves job '{j}', but the client belongs to job '{job_id}'"
            )),
        }
    }
}

/// The store server. Dropping it stops accepting new clients.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Serve on `addr` (e.g. `127.0.0.1:29500`; port 0 picks a free port, see [`Self::local_addr`]).
    /// The job id is taken from the first client that connects.
    pub fn start(addr: &str) -> Result<Self> {
        Self::start_inner(addr, None)
    }

    /// Serve on `addr` for the job `job_id` only.
    pub fn start_for_job(addr: &str, job_id: &str) -> Result<Self> {
        Self::start_inner(addr, Some(job_id.to_string()))
    }

    fn start_inner(addr: &str, job_id: Option<String>) -> Result<Self> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            CommError::Store(format!("cannot serve the rendezvous store on {addr}: {e}"))
        })?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            job_id: Mutex::new(job_id),
            ..State::default()
        });
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let accept = std::thread::Builder::new()
            .name("store-accept".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let state = state.clone();
                    // A client that disappears only ends its own thread.
                    let _ = std::thread::Builder::new()
                        .name("store-conn".into())
                        .spawn(move || serve(conn, &state));
                }
            })?;
        tracing::debug!(%addr, "rendezvous store listening");
        Ok(Self {
            addr,
            stop,
            accept: Some(accept),
        })
    }

    /// The address the server is bound to (with the real port when started on port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop with one last connection.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
    }
}

fn serve(mut conn: TcpStream, state: &State) {
    let _ = conn.set_nodelay(true);
    match read_msg::<Request>(&mut conn) {
        Ok(Request::Hello { job_id }) => {
            if let Err(msg) = state.admit(&job_id) {
                let _ = write_msg(&mut conn, &Response::Rejected(msg));
                return;
            }
            if write_msg(&mut conn, &Response::Ok).is_err() {
                return;
            }
        }
        _ => return,
    }
    while let Ok(req) = read_msg::<Request>(&mut conn) {
        if write_msg(&mut conn, &state.handle(req)).is_err() {
            return;
        }
    }
}

/// A connection to the store. Calls are serialized over one TCP connection.
pub struct StoreClient {
    conn: Mutex<TcpStream>,
    addr: String,
    job_id: String,
    timeout: Duration,
}

impl std::fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreClient")
            .field("addr", &self.addr)
            .field("job_id", &self.job_id)
            .finish()
    }
}

impl StoreClient {
    /// Connect to the store at `addr`, retrying with backoff for up to `timeout` while rank 0 is
    /// still starting. `timeout` is also the default deadline of `get`.
    pub fn connect(addr: &str, job_id: &str, timeout: Duration) -> Result<Self> {
        let start = Instant::now();
        let mut backoff = Duration::from_millis(5);
        let mut last_err;
        let mut conn = loop {
            match connect_once(addr) {
                Ok(c) => break c,
                Err(e) => last_err = e.to_string(),
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(CommError::Store(format!(
                    "could not reach the rendezvous store at {addr} within {} ms (is rank 0 running, and MASTER_ADDR/MASTER_PORT right?): {last_err}",
                    timeout.as_millis()
                )));
            }
            std::thread::sleep(backoff.min(timeout - waited));
            backoff = (backoff * 2).min(Duration::from_millis(500));
        };
        conn.set_nodelay(true)?;
        conn.set_read_timeout(Some(timeout.max(Duration::from_secs(1))))?;
        write_msg(
            &mut conn,
            &Request::Hello {
                job_id: job_id.to_string(),
            },
        )
        .map_err(|e| CommError::Store(format!("store at {addr}: {e}")))?;
        match read_msg::<Response>(&mut conn) {
            Ok(Response::Ok) => {}
            Ok(Response::Rejected(msg)) => {
                return Err(CommError::Store(format!(
                    "the store at {addr} rejected this process: {msg}"
                )))
            }
            Ok(other) => {
                return Err(CommError::Store(format!(
                    "store at {addr}: unexpected reply {other:?}"
                )))
            }
            Err(e) => {
                return Err(CommError::Store(format!(
                    "store at {addr} closed the connection during the handshake: {e}"
                )))
            }
        }
        Ok(Self {
            conn: Mutex::new(conn),
            addr: addr.to_string(),
            job_id: job_id.to_string(),
            timeout,
        })
    }

    /// The local address of this client's connection: the interface that reaches the store's host.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self
            .conn
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .local_addr()?)
    }

    pub fn job_id(&self) -> &str {
        &self.job_id
    }

    /// The default deadline of blocking calls.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn call(&self, req: Request, wait: Duration) -> Result<Response> {
        let what = format!("{req:?}");
        let what: String = what.chars().take(120).collect();
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        // The server answers a blocking request by its deadline; allow a margin for the network.
        conn.set_read_timeout(Some(wait + Duration::from_secs(5)))?;
        write_msg(&mut conn, &req)
            .and_then(|_| read_msg::<Response>(&mut conn))
            .map_err(|e| {
                CommError::Store(format!("store at {} failed during {what}: {e}", self.addr))
            })
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        match self.call(
            Request::Set {
                key: key.into(),
                value: value.to_vec(),
            },
            Duration::ZERO,
        )? {
            Response::Ok => Ok(()),
            other => Err(self.unexpected(other)),
        }
    }

    /// The value of `key`, waiting up to the client's timeout for some rank to set it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.get_timeout(key, self.timeout)
    }

    pub fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let req = Request::Get {
            key: key.into(),
            timeout_ms: ceil_ms(timeout),
        };
        match self.call(req, timeout)? {
            Response::Value(v) => Ok(v),
            Response::Missing(keys) => Err(self.timed_out("get", &keys, timeout)),
            other => Err(self.unexpected(other)),
        }
    }

    /// Block until every key exists, or fail at `deadline` naming the missing keys.
    pub fn wait(&self, keys: &[&str], deadline: Instant) -> Result<()> {
        let timeout = deadline.saturating_duration_since(Instant::now());
        let req = Request::Wait {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            timeout_ms: ceil_ms(timeout),
        };
        match self.call(req, timeout)? {
            Response::Ok => Ok(()),
            Response::Missing(keys) => Err(self.timed_out("wait", &keys, timeout)),
            other => Err(self.unexpected(other)),
        }
    }

    /// Atomically add `delta` to the counter `key` (missing = 0) and return the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        match self.call(
            Request::Add {
                key: key.into(),
                delta,
            },
            Duration::ZERO,
        )? {
            Response::Count(n) => Ok(n),
            other => Err(self.unexpected(other)),
        }
    }

    /// Block until `n` clients have entered the barrier `name`. Each name is used once.
    pub fn barrier(&self, name: &str, n: usize, deadline: Instant) -> Result<()> {
        let count_key = format!("barrier/{name}/count");
        let done_key = format!("barrier/{name}/done");
        let arrived = self.add(&count_key, 1)?;
        if arrived == n as i64 {
            self.set(&done_key, b"1")?;
        }
        self.wait(&[&done_key], deadline).map_err(|e| match e {
            CommError::Store(msg) => {
                CommError::Store(format!("barrier '{name}' of {n} clients: {msg}"))
            }
            e => e,
        })
    }

    fn timed_out(&self, what: &str, missing: &[String], timeout: Duration) -> CommError {
        CommError::Store(format!(
            "{what} timed out after {} ms waiting for keys {missing:?} (store at {}, job '{}')",
            timeout.as_millis(),
            self.addr,
            self.job_id
        ))
    }

    fn unexpected(&self, r: Response) -> CommError {
        CommError::Store(format!("store at {}: unexpected reply {r:?}", self.addr))
    }
}

/// One attempt to reach `addr`. A connection to a local port nobody listens on can meet
/// itself: when the kernel picks that same port as the connection's own (the store's port in
/// the ephemeral range, a client retrying while rank 0 starts), TCP's simultaneous open
/// connects the socket to itself, holding the port the server is about to bind. Such a
/// connection is dropped and counted as a failed attempt.
fn connect_once(addr: &str) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::new(
        std::io::ErrorKind::NotFound,
        format!("{addr} resolves to no address"),
    );
    for a in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, Duration::from_secs(2)) {
            Ok(s) if s.local_addr()? == s.peer_addr()? => {
                last = std::io::Error::new(
                    std::io::ErrorKind::ConnectionRefused,
                    format!("{a}: connected to itself (no server listening yet)"),
                );
            }
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Rendezvous for a launched job: rank 0 starts the server at `MASTER_ADDR:MASTER_PORT` (unless
/// the launcher already serves it, `store_external`), then
/// every rank (rank 0 included) connects to it. Keep the server alive as long as the job may
/// still use the store.
pub fn rendezvous(
    env: &crate::env::LaunchEnv,
    timeout: Duration,
) -> Result<(Option<StoreServer>, StoreClient)> {
    let addr = env.store_addr();
    let server = if env.rank == 0 && !env.store_external {
        Some(StoreServer::start_for_job(&addr, &env.job_id)?)
    } else {
        None
    };
    let client = StoreClient::connect(&addr, &env.job_id, timeout)?;
    Ok((server, client))
}

/// Milliseconds, rounded up, so a server never gives up before the client's deadline.
fn ceil_ms(d: Duration) -> u64 {
    d.as_micros().div_ceil(1000) as u64
}
