//! TCP connections between ranks: one listener per process, a handshake that routes each
//! incoming connection to its group, and a writer thread per connection.
//!
//! ```text
//!   rank 1 creates group "tp:[0, 1]#0"              rank 0 (same group)
//!   connect(addr of rank 0 from the store) ------>  listener -> accept thread
//!   handshake {job, group key, from 1, to 0} ---->  checks job id, files the stream under
//!                                                   (group key, peer 1) in `incoming`
//!                            <---------- ack 0      new_group() takes it from `incoming`
//! ```
//!
//! In each group the member with the lower group rank accepts and the higher one connects, so
//! every pair of members shares exactly one connection. Each [`Peer`] owns a writer thread fed by
//! a channel: a rank never blocks in `write` while its peer is blocked in `write` towards it,
//! which is what lets a ring send and receive at the same time without deadlock. A send first
//! writes what the socket takes at once with a non-blocking call on the sending thread (while
//! the writer thread is idle, so the bytes keep their order) and queues only the rest.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::communicator::{CommError, Result};

/// Handshake magic: "MTRC".
const MAGIC: u32 = 0x4D54_5243;

/// Who a new connection is from, and for which group.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Hello {
    job_id: String,
    group: String,
    from: usize,
    to: usize,
}

/// The process's listener and the connections it has accepted but no group has claimed yet.
pub(crate) struct Rendezvous {
    job_id: String,
    my_rank: usize,
    addr: SocketAddr,
    incoming: Mutex<HashMap<(String, usize), TcpStream>>,
    arrived: Condvar,
    stop: AtomicBool,
}

impl Rendezvous {
    /// Bind a listener on `ip` (port chosen by the OS) and start accepting.
    pub fn start(
        ip: std::net::IpAddr,
        job_id: &str,
        my_rank: usize,
    ) -> Result<(Arc<Self>, JoinHandle<()>)> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))?;
        let rdv = Arc::new(Self {
            job_id: job_id.to_string(),
            my_rank,
            addr: listener.local_addr()?,
            incoming: Mutex::new(HashMap::new()),
            arrived: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let r = rdv.clone();
        let handle = std::thread::Builder::new()
            .name(format!("rank{my_rank}-accept"))
            .spawn(move || r.accept_loop(listener))?;
        Ok((rdv, handle))
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        for conn in listener.incoming() {
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            let Ok(conn) = conn else { continue };
            let me = self.clone();
            let _ = std::thread::Builder::new()
                .name("handshake".into())
                .spawn(move || me.admit(conn));
        }
    }

    /// Read a handshake, check the job id and file the stream for its group.
    fn admit(&self, mut conn: TcpStream) {
        let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
        let hello = match read_hello(&mut conn) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(
                    rank = self.my_rank,
                    "dropping a connection with a bad handshake: {e}"
                );
                return;
            }
        };
        let refuse = if hello.job_id != self.job_id {
            Some(format!(
                "rank {} belongs to job '{}', not '{}'",
                self.my_rank, self.job_id, hello.job_id
            ))
        } else if hello.to != self.my_rank {
            Some(format!(
                "this is rank {}, not rank {}",
                self.my_rank, hello.to
            ))
        } else {
            None
        };
        if let Some(msg) = refuse {
            tracing::warn!(
                rank = self.my_rank,
                from = hello.from,
                "refusing a connection: {msg}"
            );
            let _ = write_frame(&mut conn, msg.as_bytes());
            return;
        }
        if write_frame(&mut conn, b"").is_err() {
            return;
        }
        let mut map = self.incoming.lock().unwrap_or_else(|p| p.into_inner());
        map.insert((hello.group, hello.from), conn);
        self.arrived.notify_all();
    }

    /// Wait for global rank `from` to connect for `group`.
    pub fn take(&self, group: &str, from: usize, deadline: Instant) -> Result<TcpStream> {
        let key = (group.to_string(), from);
        let mut map = self.incoming.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(conn) = map.remove(&key) {
                return Ok(conn);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Store(format!(
                    "rank {} creating group '{group}': rank {from} did not connect in time (did it create the same groups in the same order?)",
                    self.my_rank
                )));
            }
            map = self
                .arrived
                .wait_timeout(map, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Stop accepting (wakes the accept thread with one last connection).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }
}

/// Connect to global rank `to` at `addr` for `group` and complete the handshake.
pub(crate) fn connect(
    addr: SocketAddr,
    job_id: &str,
    group: &str,
    from: usize,
    to: usize,
    timeout: Duration,
) -> Result<TcpStream> {
    let fail = |what: String| {
        CommError::Store(format!(
            "rank {from} connecting to rank {to} at {addr} for group '{group}': {what}"
        ))
    };
    let mut conn = TcpStream::connect_timeout(&addr, timeout).map_err(|e| fail(e.to_string()))?;
    conn.set_read_timeout(Some(timeout))?;
    let hello = Hello {
        job_id: job_id.into(),
        group: group.into(),
        from,
        to,
    };
    let body = serde_json::to_vec(&hello).map_err(|e| fail(e.to_string()))?;
    let mut msg = MAGIC.to_le_bytes().to_vec();
    msg.extend_from_slice(&(body.len() as u32).to_le_bytes());
    msg.extend_from_slice(&body);
    conn.write_all(&msg).map_err(|e| fail(e.to_string()))?;
    let reply =
        read_frame(&mut conn, 1 << 16).map_err(|e| fail(format!("no handshake reply: {e}")))?;
    if !reply.is_empty() {
        return Err(fail(format!(
            "refused: {}",
            String::from_utf8_lossy(&reply)
        )));
    }
    Ok(conn)
}

fn read_hello(conn: &mut TcpStream) -> std::io::Result<Hello> {
    let mut magic = [0u8; 4];
    conn.read_exact(&mut magic)?;
    if u32::from_le_bytes(magic) != MAGIC {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            "not an mtrain connection",
        ));
    }
    let body = read_frame(conn, 1 << 16)?;
    serde_json::from_slice(&body).map_err(|e| std::io::Error::new(ErrorKind::InvalidData, e))
}

/// A `u32` length followed by that many bytes.
pub(crate) fn write_frame(conn: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    let mut msg = (body.len() as u32).to_le_bytes().to_vec();
    msg.extend_from_slice(body);
    conn.write_all(&msg)
}

fn read_frame(conn: &mut TcpStream, max: usize) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    conn.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("frame of {len} bytes"),
        ));
    }
    let mut body = vec![0u8; len];
    conn.read_exact(&mut body)?;
    Ok(body)
}

/// How a read from a peer failed.
pub(crate) enum ReadFailure {
    /// Nothing arrived within the group's timeout.
    Timeout,
    /// The peer closed the connection or it broke.
    Closed(String),
}

/// One member of a group as seen from this rank: a socket to read from and a writer thread.
/// How long dropping a connection waits for its queued bytes to go out.
const FLUSH_ON_DROP: Duration = Duration::from_secs(5);

/// Join `thread` if it finishes within `limit`; otherwise leave it detached.
pub(crate) fn join_within(thread: JoinHandle<()>, limit: Duration) {
    let deadline = Instant::now() + limit;
    while !thread.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    if thread.is_finished() {
        let _ = thread.join();
    }
}

pub(crate) struct Peer {
    reader: TcpStream,
    writer: Option<mpsc::Sender<Vec<u8>>>,
    thread: Option<JoinHandle<()>>,
    /// Buffers handed to the writer thread so far.
    queued: u64,
    /// What the writer thread has written, for [`Peer::flush`].
    written: Arc<Written>,
}

/// How far a writer thread has got: buffers written whole, and whether it has stopped.
#[derive(Default)]
struct Written {
    state: Mutex<(u64, bool)>,
    changed: Condvar,
}

impl Written {
    fn update(&self, f: impl FnOnce(&mut (u64, bool))) {
        f(&mut self.state.lock().unwrap_or_else(|p| p.into_inner()));
        self.changed.notify_all();
    }
}

impl Peer {
    /// Wrap a connected stream; reads give up after `timeout`.
    pub fn new(stream: TcpStream, timeout: Duration, name: String) -> Result<Self> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let mut out = stream.try_clone()?;
        let (tx, rx) = mpsc::channel::<Vec<u8>>();
        let written = Arc::new(Written::default());
        let progress = written.clone();
        let thread = std::thread::Builder::new().name(name).spawn(move || {
            for buf in rx {
                if out.write_all(&buf).is_err() {
                    // The reader side will see the broken connection and report it.
                    progress.update(|s| s.1 = true);
                    let _ = out.shutdown(std::net::Shutdown::Both);
                    return;
                }
                progress.update(|s| s.0 += 1);
            }
            // Everything queued has been written: tell the peer we are done.
            progress.update(|s| s.1 = true);
            let _ = out.shutdown(std::net::Shutdown::Write);
        })?;
        Ok(Self {
            reader: stream,
            writer: Some(tx),
            thread: Some(thread),
            queued: 0,
            written,
        })
    }

    /// Send `buf` without waiting for the peer: written straight into the socket as far as it
    /// takes it now (a non-blocking call on this thread, made only while the writer thread has
    /// nothing left to write, so the bytes stay in order), the rest queued for the writer thread.
    /// Returns at once. Where the socket has room (a pipeline's activation, the op headers) the
    /// message costs one system call and no hand-off to another thread.
    pub fn send(&mut self, buf: Vec<u8>) -> std::result::Result<(), ReadFailure> {
        match self.write_now(&[&buf])? {
            0 => self.queue(buf),
            k if k < buf.len() => self.queue(buf[k..].to_vec()),
            _ => Ok(()),
        }
    }

    /// [`Peer::send`] of `parts` one after another, from borrowed bytes (a header and a
    /// tensor's own storage: one system call for both, so the peer wakes once; copied only
    /// where the socket does not take them all).
    pub fn send_parts(&mut self, parts: &[&[u8]]) -> std::result::Result<(), ReadFailure> {
        let mut at = self.write_now(parts)?;
        let mut rest = Vec::new();
        for part in parts {
            let skip = at.min(part.len());
            rest.extend_from_slice(&part[skip..]);
            at -= skip;
        }
        if !rest.is_empty() {
            self.queue(rest)?;
        }
        Ok(())
    }

    /// Write what the socket takes now of `parts` if the writer thread is idle; how many bytes.
    fn write_now(&mut self, parts: &[&[u8]]) -> std::result::Result<usize, ReadFailure> {
        let closed = || ReadFailure::Closed("the connection's writer has stopped".into());
        if self.writer.is_none() {
            return Err(ReadFailure::Closed(
                "the connection was closed after an earlier failure".into(),
            ));
        }
        let state = *self.written.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.1 {
            return Err(closed());
        }
        if state.0 < self.queued {
            return Ok(0);
        }
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut at = 0;
        while at < total {
            match send_some_of(self.fd(), parts, at) {
                Ok(k) => at += k,
                Err(Stall::Wait) => break,
                Err(Stall::Failed(f)) => return Err(f),
            }
        }
        Ok(at)
    }

    /// Hand bytes to the writer thread.
    fn queue(&mut self, buf: Vec<u8>) -> std::result::Result<(), ReadFailure> {
        match &self.writer {
            Some(tx) => {
                tx.send(buf).map_err(|_| {
                    ReadFailure::Closed("the connection's writer has stopped".into())
                })?;
                self.queued += 1;
                Ok(())
            }
            None => Err(ReadFailure::Closed(
                "the connection was closed after an earlier failure".into(),
            )),
        }
    }

    /// Wait until the writer thread has written everything queued so far, so the caller may
    /// write to the socket itself ([`super::pump`]) without interleaving with it. Gives up after
    /// `timeout` without progress (the peer stopped reading).
    pub fn flush(&self, timeout: Duration) -> std::result::Result<(), ReadFailure> {
        let mut state = self.written.state.lock().unwrap_or_else(|p| p.into_inner());
        while state.0 < self.queued {
            if state.1 {
                return Err(ReadFailure::Closed(
                    "the connection's writer has stopped".into(),
                ));
            }
            let (next, waited) = self
                .written
                .changed
                .wait_timeout(state, timeout)
                .unwrap_or_else(|p| p.into_inner());
            if waited.timed_out() && next.0 < self.queued {
                return Err(ReadFailure::Timeout);
            }
            state = next;
        }
        Ok(())
    }

    /// The socket, for the non-blocking calls of [`super::pump`] (the same stream the writer
    /// thread writes to and [`Peer::recv_into`] reads from).
    pub fn fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.reader.as_raw_fd()
    }

    /// Fill `buf` from the peer.
    pub fn recv_into(&mut self, buf: &mut [u8]) -> std::result::Result<(), ReadFailure> {
        self.reader.read_exact(buf).map_err(|e| match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => ReadFailure::Timeout,
            ErrorKind::UnexpectedEof => {
                ReadFailure::Closed("connection closed (the peer exited or failed)".into())
            }
            _ => ReadFailure::Closed(e.to_string()),
        })
    }

    /// Stop sending: queued bytes are still written, then the peer sees end-of-stream.
    pub fn close_send(&mut self) {
        self.writer = None;
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        // Closing the queue lets the writer thread flush what is queued and exit. Wait for it a
        // bounded while: a process that exits right after its last op would otherwise cut off
        // bytes a peer still needs, but a peer that stopped reading must not hold us for a whole
        // timeout.
        self.writer = None;
        let _ = self.reader.shutdown(std::net::Shutdown::Read);
        if let Some(thread) = self.thread.take() {
            join_within(thread, FLUSH_ON_DROP);
        }
    }
}

/// Why a non-blocking call moved nothing.
pub(crate) enum Stall {
    /// The socket is full (send) or empty (recv): try again after `poll`.
    Wait,
    Failed(ReadFailure),
}

#[cfg(target_os = "linux")]
const NO_SIGNAL: libc::c_int = libc::MSG_NOSIGNAL;
#[cfg(not(target_os = "linux"))]
const NO_SIGNAL: libc::c_int = 0;

/// Write what the socket takes now of `buf` (non-empty).
pub(crate) fn send_some(fd: libc::c_int, buf: &[u8]) -> std::result::Result<usize, Stall> {
    send_some_of(fd, &[buf], 0)
}

/// Write what the socket takes now of `parts` laid end to end, from byte `at` on (some left).
pub(crate) fn send_some_of(
    fd: libc::c_int,
    parts: &[&[u8]],
    at: usize,
) -> std::result::Result<usize, Stall> {
    let mut skip = at;
    let mut iov = Vec::with_capacity(parts.len());
    for part in parts {
        if skip >= part.len() {
            skip -= part.len();
            continue;
        }
        iov.push(libc::iovec {
            iov_base: part[skip..].as_ptr() as *mut libc::c_void,
            iov_len: part.len() - skip,
        });
        skip = 0;
    }
    loop {
        // SAFETY: every iovec points into a slice of `parts`, valid for reads of its length
        // for the duration of the call; the kernel only reads them.
        let k = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = iov.len() as _;
            libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | NO_SIGNAL)
        };
        if k >= 0 {
            return Ok(k as usize);
        }
        match std::io::Error::last_os_error() {
            e if e.kind() == ErrorKind::Interrupted => continue,
            e if e.kind() == ErrorKind::WouldBlock => return Err(Stall::Wait),
            e => return Err(Stall::Failed(ReadFailure::Closed(e.to_string()))),
        }
    }
}
