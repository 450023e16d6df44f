//! The ring's transfers, driven from the communication thread alone: sends straight from the
//! op's own buffers, receives straight into its result, one `poll` for both neighbours.
//!
//! ```text
//!   left ──recv──> result[seg] ──combine with input[seg]──> result[seg] ──send──> right
//!                  (the kernel copies in)                   (sent from here: no copy)
//!
//!   loop { write queued segments to the right until its socket is full;
//!          read from the left until its socket is empty (a segment that completes is
//!            combined and queued, and the loop goes back to writing it);
//!          nothing moved: poll(left readable, right writable), at most the group's timeout }
//! ```
//!
//! A ring step is a dependency chain: a segment can be forwarded only once it has arrived and
//! been combined. The other ops hand buffers to a writer thread per connection ([`super::conn`]);
//! for the ring that costs a copy of every segment into a fresh buffer and, on a busy machine,
//! a context switch per segment between the thread that reduces and the thread that writes.
//! Here the communication thread does both with non-blocking calls (`MSG_DONTWAIT` on each call,
//! so the socket's blocking mode, which the writer thread and [`Peer::recv_into`] rely on, is
//! untouched): whenever the socket to the right has room it writes the oldest queued segment
//! from where it lies, whenever the left one has bytes it reads them into the result where they
//! belong. The thread sleeps only in `poll`, when neither side can move. (rabit's ring in
//! xgboost is built the same way, on `select`; gloo's ring sends from the output buffer too,
//! but receives into a two-segment scratch buffer and leaves the socket I/O to a loop thread.)
//!
//! Two rules keep it correct. The connection's writer thread is flushed first, so the op's
//! headers are on the wire before its payload. A receive never lands in a range that a queued
//! send still has to read (the ring's order already prevents it; checking makes it local).
//!
//! In place (`all_reduce_in_place`) the result buffer is the input too: every segment arrives in
//! one receive segment the group keeps, half a page past a page boundary, and is combined into
//! our values where they lie or, in the all-gather, copied there; every send reads the result
//! buffer, and the rule above covers our first, unreduced sends as well. Nothing of the
//! tensor's size is allocated, so no fresh page is touched; and the kernel's copy into a
//! destination at a page offset its source does not share runs at full speed (see
//! [`Scratch::off_page`]), which a receive straight into the tensor would not.
//!
//! [`Peer::recv_into`]: super::conn::Peer::recv_into

use std::collections::VecDeque;
use std::io::ErrorKind;
use std::ops::Range;

use super::conn::{send_some, ReadFailure, Stall};
use super::core::GroupCore;
use super::wire::{combine_into, combine_slice, AccElem, Scratch};
use crate::communicator::{ReduceOp, Result};

/// Where a queued send reads from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Source {
    /// The op's input (a reduce-scatter's first step sends our own, unreduced values); in place,
    /// the result buffer, which holds them until they are overwritten.
    Input,
    /// The result buffer (everything forwarded).
    Output,
}

/// What arrives from the left neighbour: one segment of the result, and what to do with it.
#[derive(Debug, Clone)]
pub(crate) struct Arrival {
    /// Elements of the tensor it carries (where our own values for it lie in the input).
    pub range: Range<usize>,
    /// Where it lands in the result buffer, [`place`](Self::place): `range.start` when that
    /// buffer is as long as the tensor, else an offset into a chunk-sized slot.
    pub at: usize,
    /// Combine it with our input (reduce-scatter) or keep it as it came (all-gather).
    pub reduce: bool,
    /// With `reduce`: the segment now holds the reduction over every rank (`Avg` divides here).
    pub complete: bool,
    /// Send it on to the right neighbour once it is in place.
    pub forward: bool,
}

impl Arrival {
    /// The elements of the result buffer it fills: `range.len()` of them from `at`.
    pub fn place(&self) -> Range<usize> {
        self.at..self.at + self.range.len()
    }
}

/// A send in the queue: elements `range` of `from`, `done` bytes of it written so far.
struct Queued {
    from: Source,
    range: Range<usize>,
    done: usize,
}

impl GroupCore {
    /// Run one ring op: send `first` to the right neighbour, receive `arrivals` in order from
    /// the left one, combining, completing and forwarding each as it says. `input` and `out`
    /// are in the accumulation type; `first` may read either (an `Input` range is the tensor's,
    /// an `Output` range the buffer's). Each arrival lands at its [`place`](Arrival::place) in
    /// `out` (as long as the tensor, or chunk-sized slots) and is forwarded from there.
    ///
    /// With `input` None the op runs in place: `out` starts as our input and ends as the
    /// result. Every segment then lands in the group's receive segment first (half a page off,
    /// [`Scratch::off_page`]) and is combined into `out` (reduce-scatter) or copied there
    /// (all-gather), and every send reads `out`.
    pub(crate) fn pump<T: AccElem>(
        &mut self,
        input: Option<&[T]>,
        out: &mut [T],
        first: &[(Source, Range<usize>)],
        arrivals: &[Arrival],
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.size;
        let (left, right) = ((self.rank + n - 1) % n, (self.rank + 1) % n);
        let (left_fd, right_fd) = (self.peer_fd(left)?, self.peer_fd(right)?);
        // The op's headers went through the writer threads; they must be out before our bytes.
        for p in [left, right] {
            self.flush(p)?;
        }
        let mut sends: VecDeque<Queued> = first
            .iter()
            .filter(|(_, r)| !r.is_empty())
            .map(|(from, range)| Queued {
                from: *from,
                range: range.clone(),
                done: 0,
            })
            .collect();
        let (mut next, mut got) = (0, 0); // the arrival being received, and its bytes so far
        let in_place = input.is_none();
        let es = std::mem::size_of::<T>();
        let mut scratch = match in_place {
            true => std::mem::take(&mut self.scratch),
            false => Scratch::default(),
        };
        loop {
            let mut moved = false;
            // Write the queue's oldest sends until the socket is full.
            while let Some(q) = sends.front_mut() {
                let bytes: &[u8] = match (q.from, input) {
                    (Source::Input, Some(input)) => bytemuck::cast_slice(&input[q.range.clone()]),
                    _ => bytemuck::cast_slice(&out[q.range.clone()]),
                };
                match send_some(right_fd, &bytes[q.done..]) {
                    Ok(k) => {
                        moved = true;
                        q.done += k;
                        self.cur_sent += k as u64;
                        if q.done == bytes.len() {
                            sends.pop_front();
                        }
                    }
                    Err(Wait) => break,
                    Err(Failed(f)) => return Err(self.peer_failure(right, f)),
                }
            }
            // Read the segment being received; a completed one is combined and queued, then
            // the loop goes back to writing it.
            while let Some(a) = arrivals.get(next) {
                if got == 0
                    && sends.iter().any(|q| {
                        (q.from == Source::Output || (in_place && !a.reduce))
                            && overlaps(&q.range, &a.place())
                    })
                {
                    break; // its place is still being sent from: let the send go first
                }
                let bytes: &mut [u8] = match in_place {
                    true => scratch.off_page(a.range.len() * es),
                    false => bytemuck::cast_slice_mut(&mut out[a.place()]),
                };
                match recv_some(left_fd, &mut bytes[got..]) {
                    Ok(k) => {
                        moved = true;
                        got += k;
                        if got < bytes.len() {
                            continue;
                        }
                        let mine = &mut out[a.place()];
                        match input {
                            Some(input) if a.reduce => {
                                combine_into(mine, &input[a.range.clone()], op)
                            }
                            Some(_) => {} // received where it belongs
                            None => {
                                let theirs: &[T] =
                                    bytemuck::cast_slice(scratch.off_page(a.range.len() * es));
                                match a.reduce {
                                    true => combine_slice(mine, theirs, op),
                                    false => mine.copy_from_slice(theirs),
                                }
                            }
                        }
                        if a.reduce && a.complete && op == ReduceOp::Avg {
                            for e in &mut out[a.place()] {
                                *e = e.div_n(n);
                            }
                        }
                        if a.forward {
                            sends.push_back(Queued {
                                from: Source::Output,
                                range: a.place(),
                                done: 0,
                            });
                        }
                        (next, got) = (next + 1, 0);
                        break;
                    }
                    Err(Wait) => break,
                    Err(Failed(f)) => return Err(self.peer_failure(left, f)),
                }
            }
            if sends.is_empty() && next == arrivals.len() {
                if in_place {
                    self.scratch = scratch;
                }
                return Ok(());
            }
            if moved {
                continue;
            }
            let want_recv = next < arrivals.len();
            match wait_ready(
                left_fd,
                want_recv,
                right_fd,
                !sends.is_empty(),
                self.timeout,
            ) {
                Ok(true) => {}
                // Nothing moved for a whole timeout: blame the side we were waiting on.
                Ok(false) => {
                    let stuck = if want_recv { left } else { right };
                    return Err(self.peer_failure(stuck, ReadFailure::Timeout));
                }
                Err(e) => return Err(self.peer_failure(left, ReadFailure::Closed(e.to_string()))),
            }
        }
    }
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

use Stall::{Failed, Wait};

/// Read what has arrived, up to `buf.len()` (non-empty) bytes.
fn recv_some(fd: libc::c_int, buf: &mut [u8]) -> std::result::Result<usize, Stall> {
    loop {
        // SAFETY: `buf` is valid for writes of its length for the duration of the call.
        let k = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if k > 0 {
            return Ok(k as usize);
        }
        if k == 0 {
            return Err(Failed(ReadFailure::Closed(
                "connection closed (the peer exited or failed)".into(),
            )));
        }
        match std::io::Error::last_os_error() {
            e if e.kind() == ErrorKind::Interrupted => continue,
            e if e.kind() == ErrorKind::WouldBlock => return Err(Wait),
            e => return Err(Failed(ReadFailure::Closed(e.to_string()))),
        }
    }
}

/// Sleep until `recv_fd` is readable (if `recv`) or `send_fd` writable (if `send`), at most
/// `timeout`. `Ok(false)` when the time ran out. The two may be one socket (a ring of two).
fn wait_ready(
    recv_fd: libc::c_int,
    recv: bool,
    send_fd: libc::c_int,
    send: bool,
    timeout: std::time::Duration,
) -> std::io::Result<bool> {
    // A negative fd is skipped by poll: a socket we are not waiting on (one that hung up,
    // say) must not wake us.
    let entry = |fd, wanted: bool, events| libc::pollfd {
        fd: if wanted { fd } else { -1 },
        events: if wanted { events } else { 0 },
        revents: 0,
    };
    let mut fds = if send_fd == recv_fd {
        let events = (if recv { libc::POLLIN } else { 0 }) | (if send { libc::POLLOUT } else { 0 });
        [entry(recv_fd, true, events), entry(send_fd, false, 0)]
    } else {
        [
            entry(recv_fd, recv, libc::POLLIN),
            entry(send_fd, send, libc::POLLOUT),
        ]
    };
    let count = 2;
    let ms = timeout.as_millis().min(libc::c_int::MAX as u128) as libc::c_int;
    loop {
        // SAFETY: `fds` holds `count` initialised pollfd entries.
        let k = unsafe { libc::poll(fds.as_mut_ptr(), count as libc::nfds_t, ms) };
        if k >= 0 {
            // A hang-up or error is reported as ready: the next call on the socket says which.
            return Ok(k > 0);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    use super::*;
    use crate::communicator::{CommError, OpKind};
    use crate::cpu::conn::Peer;
    use crate::trace::Tracer;

    /// Group rank 0 of a ring of two whose other member is a bare socket the test drives.
    fn ring_of_two(timeout: Duration) -> (GroupCore, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (theirs, _) = listener.accept().unwrap();
        let peer = Peer::new(ours, timeout, "test-writer".into()).unwrap();
        let mut core = GroupCore::new(
            0,
            "ring".into(),
            vec![0, 1],
            0,
            timeout,
            vec![None, Some(peer)],
            Tracer::new(Instant::now()),
            Default::default(),
        );
        core.begin(OpKind::AllReduce, crate::Site::caller());
        (core, theirs)
    }

    fn floats(bytes: &[u8]) -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    // Our half goes out from the input, theirs arrives, is averaged with ours and forwarded.
    #[test]
    fn a_segment_is_combined_in_place_and_forwarded_from_the_result() {
        let (mut core, mut theirs) = ring_of_two(Duration::from_secs(10));
        let other = std::thread::spawn(move || {
            theirs.write_all(bytemuck::cast_slice(&[5f32; 3])).unwrap();
            let mut got = [0u8; 6 * 4];
            theirs.read_exact(&mut got).unwrap();
            floats(&got)
        });
        let input = [1f32, 2., 3., 10., 20., 30.];
        let mut out = [0f32; 6];
        let arrivals = [Arrival {
            range: 0..3,
            at: 0,
            reduce: true,
            complete: true,
            forward: true,
        }];
        core.pump(
            Some(&input),
            &mut out,
            &[(Source::Input, 3..6)],
            &arrivals,
            ReduceOp::Avg,
        )
        .unwrap();
        assert_eq!(out[..3], [3., 3.5, 4.]);
        assert_eq!(other.join().unwrap(), [10., 20., 30., 3., 3.5, 4.]);
        assert_eq!(core.cur_sent, 24);
    }

    // The same op in place: our values are the buffer, theirs arrive in the receive segment and
    // are averaged into ours, and both sends read the buffer.
    #[test]
    fn in_place_a_segment_is_combined_into_our_values_and_forwarded() {
        let (mut core, mut theirs) = ring_of_two(Duration::from_secs(10));
        let other = std::thread::spawn(move || {
            theirs.write_all(bytemuck::cast_slice(&[5f32; 3])).unwrap();
            let mut got = [0u8; 6 * 4];
            theirs.read_exact(&mut got).unwrap();
            floats(&got)
        });
        let mut buf = [1f32, 2., 3., 10., 20., 30.];
        let arrivals = [Arrival {
            range: 0..3,
            at: 0,
            reduce: true,
            complete: true,
            forward: true,
        }];
        core.pump(
            None,
            &mut buf,
            &[(Source::Input, 3..6)],
            &arrivals,
            ReduceOp::Avg,
        )
        .unwrap();
        assert_eq!(buf, [3., 3.5, 4., 10., 20., 30.]);
        assert_eq!(other.join().unwrap(), [10., 20., 30., 3., 3.5, 4.]);
    }

    // A reduce-scatter into a chunk-sized slot: the segment of tensor elements 3..6 lands at
    // the slot's start, is combined with input 3..6 there, and our first send reads input 0..3.
    #[test]
    fn a_segment_lands_in_its_slot_and_is_combined_with_its_elements_of_the_input() {
        let (mut core, mut theirs) = ring_of_two(Duration::from_secs(10));
        let other = std::thread::spawn(move || {
            theirs.write_all(bytemuck::cast_slice(&[5f32; 3])).unwrap();
            let mut got = [0u8; 3 * 4];
            theirs.read_exact(&mut got).unwrap();
            floats(&got)
        });
        let input = [1f32, 2., 3., 10., 20., 30.];
        let mut slot = [0f32; 3];
        let arrivals = [Arrival {
            range: 3..6,
            at: 0,
            reduce: true,
            complete: true,
            forward: false,
        }];
        core.pump(
            Some(&input),
            &mut slot,
            &[(Source::Input, 0..3)],
            &arrivals,
            ReduceOp::Sum,
        )
        .unwrap();
        assert_eq!(slot, [15., 25., 35.]);
        assert_eq!(other.join().unwrap(), [1., 2., 3.]);
    }

    #[test]
    fn a_silent_neighbour_times_out_naming_it() {
        let timeout = Duration::from_millis(300);
        let (mut core, _theirs) = ring_of_two(timeout);
        let (input, mut out) = ([1f32; 8], [0f32; 8]);
        let arrivals = [Arrival {
            range: 0..4,
            at: 0,
            reduce: true,
            complete: true,
            forward: false,
        }];
        let start = Instant::now();
        let err = core
            .pump(
                Some(&input),
                &mut out,
                &[(Source::Input, 4..8)],
                &arrivals,
                ReduceOp::Sum,
            )
            .unwrap_err();
        assert!(matches!(err, CommError::Timeout { peer: 1, .. }), "{err}");
        assert!(start.elapsed() < timeout * 3, "took {:?}", start.elapsed());
    }

    #[test]
    fn a_neighbour_that_hangs_up_mid_segment_is_reported() {
        let (mut core, mut theirs) = ring_of_two(Duration::from_secs(10));
        theirs.write_all(&[0u8; 6]).unwrap(); // 6 of the segment's 16 bytes, then gone
        drop(theirs);
        let (input, mut out) = ([1f32; 8], [0f32; 8]);
        let arrivals = [Arrival {
            range: 0..4,
            at: 0,
            reduce: true,
            complete: true,
            forward: false,
        }];
        let err = core
            .pump(Some(&input), &mut out, &[], &arrivals, ReduceOp::Sum)
            .unwrap_err();
        assert!(
            matches!(err, CommError::PeerClosed { peer: 1, .. }),
            "{err}"
        );
    }
}
