//! The IPC protocol's pure parts, the same on every machine and tested without a GPU: where
//! each flag lives in a rank's flag buffer, which value a flag must reach for an op, how
//! two-shot splits a message, how large the shared buffers grow, which all-reduce runs.
//!
//! ```text
//!   flag buffer of rank r (u64 words; MAX_WORLD columns, one per peer p)
//!   word  0 ..  8   READY[p]  p wrote its input into its data buffer      (value: op seq)
//!   word  8 .. 16   MID[p]    p finished its two-shot reduce-scatter half (value: op seq)
//!   word 16 .. 24   DONE[p]   p finished reading the peers' data buffers  (value: op seq)
//!   word 24 .. 32   SIG[p]    p put its k-th message to r in its mailbox  (value: k)
//!   word 32 .. 40   ACK[p]    p copied r's k-th message out of r's mailbox (value: k)
//! ```
//!
//! Every flag is written by the peer the column names, into this rank's buffer, and only ever
//! grows: collective `s` of a group (1, 2, ...) waits until `flag >= s`, so a flag never needs a
//! reset and a late reader of an older value only waits longer, never passes early. `s` counts
//! the group's collectives alone ([`OpNumbers`]); sends and receives number their messages per
//! pair (SIG, ACK). `protocol/interleavings.rs` runs both under every order of the ranks' steps
//! a seeded scheduler picks and checks that no read sees another op's data.

use std::ops::Range;

use crate::op_kind::OpKind;

/// Most ranks in one IPC group (the flag columns and the kernels' pointer table).
pub const MAX_WORLD: usize = 8;

/// A phase of a collective, each with its own row of flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The writer's input is in its data buffer: peers may read it.
    Ready,
    /// The writer's two-shot reduced chunk is in its data buffer.
    Mid,
    /// The writer read everything it needs from its peers: they may overwrite their buffers.
    Done,
}

/// The mailbox flags of send/recv, per ordered pair of ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mail {
    /// Written by the sender into the receiver's flags: message k is in the sender's mailbox.
    Sig,
    /// Written by the receiver into the sender's flags: message k was copied out.
    Ack,
}

/// u64 words of one rank's flag buffer.
pub const FLAG_WORDS: usize = 5 * MAX_WORLD;
/// Bytes of one rank's flag buffer.
pub const FLAG_BYTES: usize = FLAG_WORDS * 8;

/// Byte offset, in the flag buffer of the rank that waits, of the flag `writer` sets for `phase`.
pub fn phase_flag(phase: Phase, writer: usize) -> usize {
    assert!(writer < MAX_WORLD, "rank {writer} beyond MAX_WORLD");
    let row = match phase {
        Phase::Ready => 0,
        Phase::Mid => 1,
        Phase::Done => 2,
    };
    8 * (row * MAX_WORLD + writer)
}

/// Byte offset, in the flag buffer of the rank that waits, of the mailbox flag `writer` sets.
pub fn mail_flag(kind: Mail, writer: usize) -> usize {
    assert!(writer < MAX_WORLD, "rank {writer} beyond MAX_WORLD");
    let row = match kind {
        Mail::Sig => 3,
        Mail::Ack => 4,
    };
    8 * (row * MAX_WORLD + writer)
}

/// The value a collective flag must reach for op `seq` (1-based: a zeroed buffer means "none").
pub fn collective_target(seq: u64) -> u64 {
    seq
}

/// What an op of a group is numbered when it is issued.
///
/// Every rank of a group issues the same collectives in the same order, but not the same
/// sends and receives: in a 1F1B pipeline of 4 stages a middle stage sends and receives twice
/// as often as an end stage. The collective flags therefore count collectives alone; counting
/// every op would leave the ranks' targets apart after the pipeline's messages, and the next
/// collective (the executor's all-gather of the loss) would wait for a value its peers never
/// write.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpNumbers {
    /// Ops issued so far, point-to-point included (the trace's and the watchdog's seq).
    pub ops: u64,
    /// Collectives issued so far (barriers included).
    pub collectives: u64,
}

/// The numbers of one issued op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Numbered {
    /// Its place among the group's ops (1-based).
    pub seq: u64,
    /// The value its collective flags are set to and waited for ([`collective_target`] of the
    /// collectives issued so far, this one included); unused by a send or a receive.
    pub target: u64,
}

impl OpNumbers {
    /// Number the next op, of kind `op`.
    pub fn issue(&mut self, op: OpKind) -> Numbered {
        self.ops += 1;
        if !matches!(op, OpKind::Send | OpKind::Recv) {
            self.collectives += 1;
        }
        Numbered {
            seq: self.ops,
            target: collective_target(self.collectives),
        }
    }
}

/// The two waits of the k-th message (1-based) from one rank to another:
/// the sender waits `ACK >= k - 1` before it overwrites its mailbox, the receiver `SIG >= k`.
pub fn mail_targets(k: u64) -> (u64, u64) {
    assert!(k >= 1, "messages are numbered from 1");
    (k - 1, k)
}

/// Elements per 16-byte vector for an element of `elem_bytes`: two-shot chunks start on
/// such a boundary so the kernels' vector loads stay aligned.
pub fn vector_elems(elem_bytes: usize) -> usize {
    (16 / elem_bytes).max(1)
}

/// Elements `[start, end)` rank `r` of `n` reduces in a two-shot all-reduce of `count`
/// elements: equal chunks of `ceil(count / n)` rounded up to `align` elements, the last
/// ones shorter or empty.
pub fn two_shot_chunk(count: usize, n: usize, r: usize, align: usize) -> Range<usize> {
    assert!(n > 0 && r < n && align > 0);
    let chunk = count.div_ceil(n).div_ceil(align) * align;
    let start = (r * chunk).min(count);
    start..((r + 1) * chunk).min(count)
}

/// Round `bytes` up to the buffers' alignment (256 bytes, as cuMemAlloc's).
pub fn align_up(bytes: usize) -> usize {
    bytes.div_ceil(256) * 256
}

/// Where an op's data lies in a rank's data buffer: its input at 0, the two-shot reduced
/// chunk after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataLayout {
    pub input: usize,
    pub chunk: usize,
    /// Bytes the layout needs.
    pub bytes: usize,
}

impl DataLayout {
    /// The layout for an input of `input_bytes` and a reduced chunk of `chunk_bytes` (0 unless
    /// two-shot).
    pub fn new(input_bytes: usize, chunk_bytes: usize) -> Self {
        let chunk = align_up(input_bytes);
        Self {
            input: 0,
            chunk,
            bytes: chunk + align_up(chunk_bytes),
        }
    }
}

/// Smallest shared data buffer (bytes).
pub const MIN_CAPACITY: usize = 1 << 20;

/// The capacity a buffer of `current` bytes must grow to for `needed` bytes: unchanged when
/// it fits, else the next power of two (at least [`MIN_CAPACITY`]). Every rank computes it
/// from values all ranks know, so they all grow at the same op.
pub fn grown_capacity(current: usize, needed: usize) -> usize {
    match needed <= current {
        true => current,
        false => needed.next_power_of_two().max(MIN_CAPACITY),
    }
}

/// The two all-reduce algorithms over peer memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllReduceAlgo {
    /// Every rank reads all n inputs and reduces the whole tensor: one phase, n·S read per rank.
    OneShot,
    /// Rank r reduces chunk r (reduce-scatter), then every rank gathers the n chunks: two
    /// phases, 2·S read per rank.
    TwoShot,
}

/// Default largest message (bytes) of the one-shot all-reduce.
pub const ONE_SHOT_MAX: usize = 512 << 10;

/// The all-reduce for `bytes` over `n` ranks: one-shot up to `one_shot_max`, two-shot above
/// (two ranks gain nothing from two-shot: each reads 2·S either way).
pub fn choose_all_reduce(bytes: usize, n: usize, one_shot_max: usize) -> AllReduceAlgo {
    match n <= 2 || bytes <= one_shot_max {
        true => AllReduceAlgo::OneShot,
        false => AllReduceAlgo::TwoShot,
    }
}

/// Element offset, in peer p's data buffer, of the rows p sends to rank `me` in an
/// all-to-all: p's input rows are in peer order, so they start after those for ranks < me.
pub fn all_to_all_offset(peer_send_splits: &[usize], me: usize, row_elems: usize) -> usize {
    peer_send_splits[..me].iter().sum::<usize>() * row_elems
}

/// How a rank waits for its peers' flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitMode {
    /// `cuStreamWaitValue64` on the communication stream: the GPU's front end waits, no SM
    /// is held (the default).
    Stream,
    /// A one-block kernel spins on the flags (with a timeout read from the GPU clock).
    Kernel,
}

impl WaitMode {
    /// `stream` or `kernel` (the value of `MTRAIN_IPC_WAIT`).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "stream" => Ok(WaitMode::Stream),
            "kernel" => Ok(WaitMode::Kernel),
            other => Err(format!(
                "MTRAIN_IPC_WAIT={other:?}: expected 'stream' or 'kernel'"
            )),
        }
    }
}

#[cfg(test)]
mod interleavings;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_are_distinct_and_inside_the_buffer() {
        let mut seen = std::collections::HashSet::new();
        for w in 0..MAX_WORLD {
            for p in [Phase::Ready, Phase::Mid, Phase::Done] {
                assert!(seen.insert(phase_flag(p, w)));
            }
            for m in [Mail::Sig, Mail::Ack] {
                assert!(seen.insert(mail_flag(m, w)));
            }
        }
        assert_eq!(seen.len(), FLAG_WORDS);
        assert!(seen.iter().all(|o| o % 8 == 0 && o + 8 <= FLAG_BYTES));
    }

    #[test]
    #[should_panic(expected = "beyond MAX_WORLD")]
    fn a_rank_beyond_the_table_is_refused() {
        phase_flag(Phase::Ready, MAX_WORLD);
    }

    /// Sequence numbers: op s waits for s, the next op's target is larger, so a flag left
    /// at s by a finished op never lets op s + 1 pass; message k waits for ack k − 1.
    #[test]
    fn flag_targets_grow_with_the_sequence() {
        let mut last = 0;
        for seq in 1..100u64 {
            let t = collective_target(seq);
            assert!(t > last && t > 0, "a zeroed flag must not satisfy op {seq}");
            last = t;
        }
        assert_eq!(mail_targets(1), (0, 1));
        assert_eq!(mail_targets(7), (6, 7));
    }

    /// Two-shot chunks tile [0, count), start on vector boundaries, and differ by at most
    /// one vector (or are empty at the end).
    #[test]
    fn two_shot_chunks_tile_aligned() {
        for count in [0usize, 1, 3, 7, 8, 9, 31, 1000, 1 << 20, (1 << 20) + 13] {
            for n in 1..=MAX_WORLD {
                for align in [1usize, 4, 8] {
                    let mut next = 0;
                    for r in 0..n {
                        let c = two_shot_chunk(count, n, r, align);
                        assert_eq!(c.start, next, "count {count} n {n} r {r}");
                        assert!(c.start.is_multiple_of(align) || c.start == count);
                        assert!(c.len() <= count.div_ceil(n) + align);
                        next = c.end;
                    }
                    assert_eq!(next, count);
                }
            }
        }
        assert_eq!(two_shot_chunk(10, 4, 3, 4), 10..10);
        assert_eq!(two_shot_chunk(10, 4, 1, 4), 4..8);
    }

    /// The table is the picture of the module doc: READY, MID, DONE, SIG, ACK rows of
    /// MAX_WORLD words each, the column the writer's rank.
    #[test]
    fn flag_rows_follow_the_table() {
        for w in 0..MAX_WORLD {
            assert_eq!(phase_flag(Phase::Ready, w), 8 * w);
            assert_eq!(phase_flag(Phase::Mid, w), 8 * (MAX_WORLD + w));
            assert_eq!(phase_flag(Phase::Done, w), 8 * (2 * MAX_WORLD + w));
            assert_eq!(mail_flag(Mail::Sig, w), 8 * (3 * MAX_WORLD + w));
            assert_eq!(mail_flag(Mail::Ack, w), 8 * (4 * MAX_WORLD + w));
        }
    }

    #[test]
    #[should_panic(expected = "beyond MAX_WORLD")]
    fn a_mailbox_writer_beyond_the_table_is_refused() {
        mail_flag(Mail::Ack, MAX_WORLD);
    }

    #[test]
    #[should_panic(expected = "numbered from 1")]
    fn message_zero_is_refused() {
        mail_targets(0);
    }

    #[test]
    fn vectors_are_16_bytes() {
        assert_eq!([1, 2, 4, 8, 16, 32].map(vector_elems), [16, 8, 4, 2, 1, 1]);
    }

    /// Two-shot as `phases.rs` lays it out: the chunk area is sized by chunk 0, which no other
    /// rank's chunk exceeds; it starts 256-aligned after the whole input, and every chunk of
    /// the input and of the output starts on a 16-byte boundary.
    #[test]
    fn two_shot_chunks_fit_the_chunk_area_aligned() {
        for es in [2usize, 4] {
            let align = vector_elems(es);
            for count in [1usize, 5, 17, 1000, 4097, (1 << 20) + 3] {
                for n in 2..=MAX_WORLD {
                    let first = two_shot_chunk(count, n, 0, align).len();
                    let l = DataLayout::new(count * es, first * es);
                    assert!(l.chunk >= count * es && l.chunk.is_multiple_of(256));
                    assert!(l.bytes >= l.chunk + first * es);
                    for r in 0..n {
                        let c = two_shot_chunk(count, n, r, align);
                        assert!(c.len() <= first, "count {count} n {n} r {r}");
                        assert!(c.start == count || (c.start * es).is_multiple_of(16));
                    }
                }
            }
        }
    }

    #[test]
    fn layout_and_growth() {
        let l = DataLayout::new(1000, 300);
        assert_eq!((l.input, l.chunk, l.bytes), (0, 1024, 1024 + 512));
        assert_eq!(DataLayout::new(0, 0).bytes, 0);
        assert_eq!(grown_capacity(0, 1), MIN_CAPACITY);
        assert_eq!(grown_capacity(MIN_CAPACITY, MIN_CAPACITY), MIN_CAPACITY);
        assert_eq!(
            grown_capacity(MIN_CAPACITY, MIN_CAPACITY + 1),
            2 * MIN_CAPACITY
        );
        assert_eq!(grown_capacity(4 << 20, 3 << 20), 4 << 20);
    }

    #[test]
    fn algorithm_choice() {
        assert_eq!(
            choose_all_reduce(1 << 30, 2, ONE_SHOT_MAX),
            AllReduceAlgo::OneShot
        );
        assert_eq!(
            choose_all_reduce(ONE_SHOT_MAX, 4, ONE_SHOT_MAX),
            AllReduceAlgo::OneShot
        );
        assert_eq!(
            choose_all_reduce(ONE_SHOT_MAX + 1, 4, ONE_SHOT_MAX),
            AllReduceAlgo::TwoShot
        );
        assert_eq!(choose_all_reduce(0, 8, 0), AllReduceAlgo::OneShot);
    }

    #[test]
    fn all_to_all_offsets_skip_the_lower_ranks_rows() {
        let splits = [2, 0, 3, 1];
        assert_eq!(all_to_all_offset(&splits, 0, 5), 0);
        assert_eq!(all_to_all_offset(&splits, 2, 5), 10);
        assert_eq!(all_to_all_offset(&splits, 3, 5), 25);
    }

    #[test]
    fn wait_modes_parse() {
        assert_eq!(WaitMode::parse("stream"), Ok(WaitMode::Stream));
        assert_eq!(WaitMode::parse("kernel"), Ok(WaitMode::Kernel));
        assert!(WaitMode::parse("spin")
            .unwrap_err()
            .contains("MTRAIN_IPC_WAIT"));
    }
}
