//! The state a group's communication thread owns, and the primitives every algorithm is built
//! from: send a buffer to a group rank, receive a known number of bytes from one, exchange op
//! headers with every peer. Errors raised here carry the op, group, sequence number and both
//! ranks (global ranks, so a user can find the process).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::DType;

use super::conn::{Peer, ReadFailure};
use super::wire::{Header, Scratch};
use crate::algo::AlgoChoice;
use crate::communicator::{CommError, OpKind, Result};
use crate::site::Site;
use crate::trace::Tracer;

/// Largest piece a large message is cut into, so the ring can pipeline: a segment reduced in one
/// step is already on its way to the next rank while later segments are still arriving.
pub(crate) const SEGMENT_BYTES: usize = 1 << 20;

/// Everything the communication thread of one group works with.
pub(crate) struct GroupCore {
    /// This process's rank in the group, and the group's size.
    pub rank: usize,
    pub size: usize,
    pub name: String,
    /// Global rank of every group rank.
    pub globals: Vec<usize>,
    /// Identity of the group on the wire (hash of its key).
    pub group_hash: u64,
    pub timeout: Duration,
    /// Connection to each other member, indexed by group rank (`None` at our own index).
    pub peers: Vec<Option<Peer>>,
    pub tracer: Tracer,
    /// Shared with the issuing side so later ops fail before they are queued.
    pub poison_flag: Arc<Mutex<Option<String>>>,
    coll_seq: u64,
    send_seq: Vec<u64>,
    recv_seq: Vec<u64>,
    poisoned: Option<String>,
    /// The op being run: what errors report and what the trace records.
    pub cur_op: OpKind,
    pub cur_seq: u64,
    pub cur_sent: u64,
    /// Where the op being run was issued.
    pub cur_site: Site,
    /// How this group picks its all-reduce algorithm.
    pub algo: AlgoChoice,
    /// Where the in-place ring receives every segment, kept from one op to the next (one
    /// segment, [`SEGMENT_BYTES`], and a page).
    pub scratch: Scratch,
    /// When the op being run found every rank present (its headers exchanged, or a receive's
    /// header read): where its time on an emulated link starts ([`super::link`]).
    pub synced: Option<Instant>,
}

impl GroupCore {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rank: usize,
        name: String,
        globals: Vec<usize>,
        group_hash: u64,
        timeout: Duration,
        peers: Vec<Option<Peer>>,
        tracer: Tracer,
        poison_flag: Arc<Mutex<Option<String>>>,
    ) -> Self {
        let size = globals.len();
        Self {
            rank,
            size,
            name,
            globals,
            group_hash,
            timeout,
            peers,
            tracer,
            poison_flag,
            coll_seq: 0,
            send_seq: vec![0; size],
            recv_seq: vec![0; size],
            poisoned: None,
            cur_op: OpKind::Barrier,
            cur_seq: 0,
            cur_sent: 0,
            cur_site: Site::caller(),
            algo: AlgoChoice::default(),
            scratch: Scratch::default(),
            synced: None,
        }
    }

    pub fn poisoned(&self) -> Option<CommError> {
        self.poisoned.as_ref().map(|cause| CommError::Poisoned {
            group: self.name.clone(),
            cause: cause.clone(),
        })
    }

    /// After a failure the streams are out of step: stop sending (peers see end-of-stream once
    /// what was queued is written) and fail every later op.
    pub fn poison(&mut self, err: &CommError) {
        let cause = err.to_string();
        tracing::debug!(group = %self.name, "group poisoned: {cause}");
        for p in self.peers.iter_mut().flatten() {
            p.close_send();
        }
        *self.poison_flag.lock().unwrap_or_else(|p| p.into_inner()) = Some(cause.clone());
        self.poisoned = Some(cause);
    }

    /// Start an op issued at `site`: reset the per-op counters.
    pub fn begin(&mut self, op: OpKind, site: Site) {
        self.cur_op = op;
        self.cur_site = site;
        self.cur_seq = 0;
        self.cur_sent = 0;
        self.synced = None;
    }

    /// The next collective sequence number (the same on every member when they agree).
    pub fn next_collective(&mut self) -> u64 {
        self.cur_seq = self.coll_seq;
        self.coll_seq += 1;
        self.cur_seq
    }

    /// The next sequence number of the point-to-point channel to (`send`) or from (`!send`) a peer.
    pub fn next_p2p(&mut self, peer: usize, send: bool) -> u64 {
        let counter = if send {
            &mut self.send_seq[peer]
        } else {
            &mut self.recv_seq[peer]
        };
        self.cur_seq = *counter;
        *counter += 1;
        self.cur_seq
    }

    /// A header for the current op.
    pub fn header(&self, dtype: DType, shape: &[usize]) -> Header {
        Header::new(self.cur_op, dtype, self.cur_seq, self.group_hash, shape)
    }

    pub fn invalid(&self, msg: String) -> CommError {
        CommError::InvalidArgument {
            op: self.cur_op,
            group: self.name.clone(),
            msg,
        }
    }

    /// The error for a failed read or write with group rank `peer`.
    pub(super) fn peer_failure(&self, peer: usize, f: ReadFailure) -> CommError {
        let (op, group, seq, rank, peer, site) = (
            self.cur_op,
            self.name.clone(),
            self.cur_seq,
            self.globals[self.rank],
            self.globals[peer],
            self.cur_site,
        );
        match f {
            ReadFailure::Timeout => CommError::Timeout {
                op,
                group,
                seq,
                rank,
                peer,
                timeout_ms: self.timeout.as_millis() as u64,
                site,
            },
            ReadFailure::Closed(detail) => CommError::PeerClosed {
                op,
                group,
                seq,
                rank,
                peer,
                detail,
                site,
            },
        }
    }

    fn peer(&mut self, p: usize) -> Result<&mut Peer> {
        let (rank, name) = (self.rank, self.name.clone());
        self.peers
            .get_mut(p)
            .and_then(Option::as_mut)
            .ok_or_else(|| CommError::InvalidArgument {
                op: self.cur_op,
                group: name,
                msg: format!("group rank {p} is not a peer of group rank {rank}"),
            })
    }

    /// Queue payload bytes for group rank `p` (counted in the trace as bytes sent).
    pub fn send(&mut self, p: usize, buf: Vec<u8>) -> Result<()> {
        let n = buf.len() as u64;
        let r = self.peer(p)?.send(buf);
        r.map_err(|f| self.peer_failure(p, f))?;
        self.cur_sent += n;
        Ok(())
    }

    /// An op header and its payload, from borrowed bytes (a tensor's own storage), in one
    /// write where the socket takes them (the payload counted in the trace as bytes sent).
    pub fn send_with_header(&mut self, p: usize, h: &Header, payload: &[u8]) -> Result<()> {
        let body = h.encode();
        let len = (body.len() as u32).to_le_bytes();
        let r = self.peer(p)?.send_parts(&[&len, &body, payload]);
        r.map_err(|f| self.peer_failure(p, f))?;
        self.cur_sent += payload.len() as u64;
        Ok(())
    }

    /// Wait until everything queued for group rank `p` is on the wire.
    pub fn flush(&mut self, p: usize) -> Result<()> {
        let timeout = self.timeout;
        let r = self.peer(p)?.flush(timeout);
        r.map_err(|f| self.peer_failure(p, f))
    }

    /// The socket shared with group rank `p`.
    pub fn peer_fd(&mut self, p: usize) -> Result<std::os::fd::RawFd> {
        Ok(self.peer(p)?.fd())
    }

    /// Fill `buf` with payload from group rank `p`.
    pub fn recv_into(&mut self, p: usize, buf: &mut [u8]) -> Result<()> {
        let r = self.peer(p)?.recv_into(buf);
        r.map_err(|f| self.peer_failure(p, f))
    }

    pub fn recv(&mut self, p: usize, len: usize) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; len];
        self.recv_into(p, &mut buf)?;
        Ok(buf)
    }

    /// Send an op header (not counted as payload).
    pub fn send_header(&mut self, p: usize, h: &Header) -> Result<()> {
        let body = h.encode();
        let mut msg = (body.len() as u32).to_le_bytes().to_vec();
        msg.extend_from_slice(&body);
        let r = self.peer(p)?.send(msg);
        r.map_err(|f| self.peer_failure(p, f))
    }

    pub fn recv_header(&mut self, p: usize) -> Result<Header> {
        let mut len = [0u8; 4];
        self.recv_into(p, &mut len)?;
        let len = u32::from_le_bytes(len) as usize;
        let garbled = |me: &Self| CommError::Mismatch {
            group: me.name.clone(),
            rank: me.globals[me.rank],
            peer: me.globals[p],
            mine: format!("{} (seq {}), issued at {}", me.cur_op, me.cur_seq, me.cur_site),
            theirs: "something unreadable (the ranks' streams are out of step)".into(),
        };
        if len > 4096 {
            return Err(garbled(self));
        }
        let body = self.recv(p, len)?;
        self.synced = Some(Instant::now());
        Header::decode(&body).ok_or_else(|| garbled(self))
    }

    /// Send `mine(p)` to every peer p, read every peer's header, and fail if any peer called a
    /// different collective. Every rank reads every header before judging, so all ranks see a
    /// mismatch. Returns the headers indexed by group rank (our own at our index).
    pub fn exchange_headers(&mut self, mine: impl Fn(usize) -> Header) -> Result<Vec<Header>> {
        let me = self.rank;
        for p in (0..self.size).filter(|p| *p != me) {
            self.send_header(p, &mine(p))?;
        }
        let mut all = Vec::with_capacity(self.size);
        for p in 0..self.size {
            all.push(if p == self.rank {
                mine(p)
            } else {
                self.recv_header(p)?
            });
        }
        for (p, theirs) in all.iter().enumerate() {
            let m = mine(p);
            if p != self.rank && !m.matches(theirs) {
                return Err(CommError::Mismatch {
                    group: self.name.clone(),
                    rank: self.globals[self.rank],
                    peer: self.globals[p],
                    mine: format!("{}, issued at {}", m.describe(), self.cur_site),
                    theirs: theirs.describe(),
                });
            }
        }
        self.synced = Some(Instant::now());
        Ok(all)
    }
}

/// Split `range` into pieces of at most `SEGMENT_BYTES` (given the element size).
pub(crate) fn segments(
    range: std::ops::Range<usize>,
    elem_size: usize,
) -> impl Iterator<Item = std::ops::Range<usize>> {
    let step = (SEGMENT_BYTES / elem_size.max(1)).max(1);
    (range.start..range.end)
        .step_by(step)
        .map(move |s| s..(s + step).min(range.end))
}
