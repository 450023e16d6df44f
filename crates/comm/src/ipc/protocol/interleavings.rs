//! The protocol under interleavings of the ranks' steps: each rank's stream runs its program of
//! ops step by step, in an order a seeded scheduler picks, over simulated flag, data and
//! mailbox buffers addressed and numbered as the GPU path does it (`phase_flag`, `mail_flag`,
//! [`OpNumbers`], `mail_targets`; the steps of each op are those `phases.rs` and
//! `collectives.rs` enqueue). Every read of a peer's buffer must see the op it belongs to from
//! its first to its last byte (a read is two steps, begin and end, with the other ranks' steps
//! in between), every flag write must not lower the flag, and every program must finish: a
//! state where no rank can step but some have steps left is a hang, reported with the wait.
//!
//! ```text
//!   one-shot    publish  signal READY  wait READY  [read inputs]  signal DONE  wait DONE
//!   two-shot    publish  signal READY  wait READY  [read inputs]  write chunk
//!               signal MID  wait MID  [read chunks]  signal DONE  wait DONE
//!   barrier     signal READY  wait READY
//!   send k      wait ACK >= k-1  copy into the mailbox  set SIG := k
//!   recv k      wait SIG >= k  [copy out of the mailbox]  set ACK := k
//! ```

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    OneShot,
    TwoShot,
    Barrier,
    Send(usize),
    Recv(usize),
}

impl Op {
    fn kind(self) -> OpKind {
        match self {
            Op::OneShot | Op::TwoShot => OpKind::AllReduce,
            Op::Barrier => OpKind::Barrier,
            Op::Send(_) => OpKind::Send,
            Op::Recv(_) => OpKind::Recv,
        }
    }
}

/// One step of a rank's stream; `t` is the op's collective target, `k` a message number.
#[derive(Debug, Clone, Copy)]
enum Step {
    Publish { t: u64 },
    Signal { phase: Phase, t: u64 },
    Wait { phase: Phase, t: u64 },
    ReadInputs { t: u64, end: bool },
    WriteChunk { t: u64 },
    ReadChunks { t: u64, end: bool },
    WaitAck { dst: usize, k: u64 },
    CopyIn { dst: usize, k: u64 },
    SetSig { dst: usize, k: u64 },
    WaitSig { src: usize, k: u64 },
    CopyOut { src: usize, k: u64, end: bool },
    SetAck { src: usize, k: u64 },
}

/// How the programs are turned into steps: as the GPU path does it, or with one rule of the
/// protocol left out, to show that the checks find what that rule prevents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rules {
    Protocol,
    /// Collective targets count every op, sends and receives included.
    TargetsCountEveryOp,
    /// No DONE barrier at the end of an all-reduce.
    NoDoneBarrier,
}

/// Each rank's steps for its program of ops.
fn compile(programs: &[Vec<Op>], rules: Rules) -> Vec<Vec<Step>> {
    let n = programs.len();
    programs
        .iter()
        .map(|ops| {
            let mut numbers = OpNumbers::default();
            let (mut sent, mut received) = (vec![0u64; n], vec![0u64; n]);
            let mut steps = Vec::new();
            for &op in ops {
                let numbered = numbers.issue(op.kind());
                let t = match rules {
                    Rules::TargetsCountEveryOp => collective_target(numbered.seq),
                    _ => numbered.target,
                };
                let done = |steps: &mut Vec<Step>| {
                    if rules != Rules::NoDoneBarrier {
                        steps.push(Step::Signal {
                            phase: Phase::Done,
                            t,
                        });
                        steps.push(Step::Wait {
                            phase: Phase::Done,
                            t,
                        });
                    }
                };
                match op {
                    Op::OneShot | Op::TwoShot => {
                        steps.push(Step::Publish { t });
                        steps.push(Step::Signal {
                            phase: Phase::Ready,
                            t,
                        });
                        steps.push(Step::Wait {
                            phase: Phase::Ready,
                            t,
                        });
                        steps.push(Step::ReadInputs { t, end: false });
                        steps.push(Step::ReadInputs { t, end: true });
                        if op == Op::TwoShot {
                            steps.push(Step::WriteChunk { t });
                            steps.push(Step::Signal {
                                phase: Phase::Mid,
                                t,
                            });
                            steps.push(Step::Wait {
                                phase: Phase::Mid,
                                t,
                            });
                            steps.push(Step::ReadChunks { t, end: false });
                            steps.push(Step::ReadChunks { t, end: true });
                        }
                        done(&mut steps);
                    }
                    Op::Barrier => {
                        steps.push(Step::Signal {
                            phase: Phase::Ready,
                            t,
                        });
                        steps.push(Step::Wait {
                            phase: Phase::Ready,
                            t,
                        });
                    }
                    Op::Send(dst) => {
                        sent[dst] += 1;
                        let k = sent[dst];
                        steps.push(Step::WaitAck { dst, k });
                        steps.push(Step::CopyIn { dst, k });
                        steps.push(Step::SetSig { dst, k });
                    }
                    Op::Recv(src) => {
                        received[src] += 1;
                        let k = received[src];
                        steps.push(Step::WaitSig { src, k });
                        steps.push(Step::CopyOut { src, k, end: false });
                        steps.push(Step::CopyOut { src, k, end: true });
                        steps.push(Step::SetAck { src, k });
                    }
                }
            }
            steps
        })
        .collect()
}

/// The buffers every rank shares: flag words, and what each data buffer and mailbox holds.
struct Buffers {
    n: usize,
    flags: Vec<[u64; FLAG_WORDS]>,
    /// The collective whose input is in rank r's data buffer (0: none yet).
    input: Vec<u64>,
    /// The collective whose two-shot reduced chunk is in rank r's chunk area.
    chunk: Vec<u64>,
    /// The message in rank a's mailbox to rank b.
    mailbox: Vec<Vec<u64>>,
}

impl Buffers {
    fn flag(&self, owner: usize, offset: usize) -> u64 {
        self.flags[owner][offset / 8]
    }

    fn set(&mut self, owner: usize, offset: usize, v: u64) -> Result<(), String> {
        let w = &mut self.flags[owner][offset / 8];
        if v < *w {
            return Err(format!(
                "flag {offset} of rank {owner} lowered from {w} to {v}"
            ));
        }
        *w = v;
        Ok(())
    }

    /// Whether rank `me` may take `step` now (only waits can hold a rank).
    fn can(&self, me: usize, step: &Step) -> bool {
        match *step {
            Step::Wait { phase, t } => (0..self.n)
                .filter(|q| *q != me)
                .all(|q| self.flag(me, phase_flag(phase, q)) >= t),
            Step::WaitAck { dst, k } => {
                self.flag(me, mail_flag(Mail::Ack, dst)) >= mail_targets(k).0
            }
            Step::WaitSig { src, k } => {
                self.flag(me, mail_flag(Mail::Sig, src)) >= mail_targets(k).1
            }
            _ => true,
        }
    }

    /// Take `step` on rank `me`; an error is a read that saw another op's data.
    fn take(&mut self, me: usize, step: &Step) -> Result<(), String> {
        let peers: Vec<usize> = (0..self.n).filter(|q| *q != me).collect();
        match *step {
            Step::Publish { t } => self.input[me] = t,
            Step::Signal { phase, t } => {
                for &q in &peers {
                    self.set(q, phase_flag(phase, me), t)?;
                }
            }
            Step::Wait { .. } | Step::WaitAck { .. } | Step::WaitSig { .. } => {}
            Step::ReadInputs { t, end } => {
                if let Some(q) = (0..self.n).find(|q| self.input[*q] != t) {
                    return Err(format!(
                        "rank {me} read rank {q}'s input of collective {} for collective {t} ({})",
                        self.input[q],
                        if end {
                            "overwritten while read"
                        } else {
                            "read too early"
                        }
                    ));
                }
            }
            Step::WriteChunk { t } => self.chunk[me] = t,
            Step::ReadChunks { t, end } => {
                if let Some(q) = (0..self.n).find(|q| self.chunk[*q] != t) {
                    return Err(format!(
                        "rank {me} read rank {q}'s chunk of collective {} for collective {t} (end {end})",
                        self.chunk[q]
                    ));
                }
            }
            Step::CopyIn { dst, k } => self.mailbox[me][dst] = k,
            Step::SetSig { dst, k } => self.set(dst, mail_flag(Mail::Sig, me), k)?,
            Step::CopyOut { src, k, end } => {
                let held = self.mailbox[src][me];
                if held != k {
                    return Err(format!(
                        "rank {me} copied message {held} from rank {src} for message {k} (end {end})"
                    ));
                }
            }
            Step::SetAck { src, k } => self.set(src, mail_flag(Mail::Ack, me), k)?,
        }
        Ok(())
    }
}

/// xorshift64*: the scheduler's choices, reproducible from the seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    }
}

/// Run the steps to the end in the order `seed` picks; the first violation or hang.
fn run(steps: &[Vec<Step>], seed: u64) -> Result<(), String> {
    let n = steps.len();
    let mut b = Buffers {
        n,
        flags: vec![[0; FLAG_WORDS]; n],
        input: vec![0; n],
        chunk: vec![0; n],
        mailbox: vec![vec![0; n]; n],
    };
    let mut pc = vec![0usize; n];
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    loop {
        let ready: Vec<usize> = (0..n)
            .filter(|&r| pc[r] < steps[r].len() && b.can(r, &steps[r][pc[r]]))
            .collect();
        if ready.is_empty() {
            return match (0..n).find(|&r| pc[r] < steps[r].len()) {
                None => Ok(()),
                Some(r) => Err(format!("hang: rank {r} waits at {:?}", steps[r][pc[r]])),
            };
        }
        let r = ready[rng.below(ready.len())];
        b.take(r, &steps[r][pc[r]])
            .map_err(|e| format!("seed {seed}: {e}"))?;
        pc[r] += 1;
    }
}

const SEEDS: u64 = 300;

/// The first failure over the seeds, if any.
fn first_failure(programs: &[Vec<Op>], rules: Rules) -> Option<String> {
    let steps = compile(programs, rules);
    (0..SEEDS).find_map(|seed| run(&steps, seed).err())
}

fn collectives(n: usize) -> Vec<Vec<Op>> {
    let ops = [
        Op::OneShot,
        Op::TwoShot,
        Op::Barrier,
        Op::TwoShot,
        Op::OneShot,
        Op::OneShot,
        Op::TwoShot,
    ];
    vec![ops.to_vec(); n]
}

/// Every rank sends to the next and receives from the previous (both in flight), then an
/// all-reduce, three times over.
fn ring(n: usize) -> Vec<Vec<Op>> {
    (0..n)
        .map(|r| {
            let mut ops = Vec::new();
            for _ in 0..3 {
                ops.extend([
                    Op::Send((r + 1) % n),
                    Op::Recv((r + n - 1) % n),
                    Op::OneShot,
                ]);
            }
            ops
        })
        .collect()
}

/// A pipeline of `pp` stages over `m` micro-batches (all forwards, then all backwards), then
/// the executor's collective over the stages: the middle stages send and receive twice as
/// often as the ends.
fn pipeline(pp: usize, m: usize) -> Vec<Vec<Op>> {
    (0..pp)
        .map(|s| {
            let mut ops = Vec::new();
            for _ in 0..m {
                if s > 0 {
                    ops.push(Op::Recv(s - 1));
                }
                if s + 1 < pp {
                    ops.push(Op::Send(s + 1));
                }
            }
            for _ in 0..m {
                if s + 1 < pp {
                    ops.push(Op::Recv(s + 1));
                }
                if s > 0 {
                    ops.push(Op::Send(s - 1));
                }
            }
            ops.extend([Op::OneShot, Op::TwoShot]);
            ops
        })
        .collect()
}

#[test]
fn collectives_read_only_their_own_data_under_every_order() {
    for n in [2, 3, 4, MAX_WORLD] {
        assert_eq!(
            first_failure(&collectives(n), Rules::Protocol),
            None,
            "n {n}"
        );
    }
}

#[test]
fn messages_and_collectives_interleave_in_a_ring() {
    for n in [2, 3, 4] {
        assert_eq!(first_failure(&ring(n), Rules::Protocol), None, "n {n}");
    }
}

/// Two ranks that each send to the other before receiving both finish (a send waits only for
/// the previous message's ACK); a second message sent before the first is received waits.
#[test]
fn a_send_does_not_wait_for_its_receive() {
    let both = vec![
        vec![Op::Send(1), Op::Recv(1), Op::Send(1), Op::Recv(1)],
        vec![Op::Send(0), Op::Recv(0), Op::Send(0), Op::Recv(0)],
    ];
    assert_eq!(first_failure(&both, Rules::Protocol), None);
    let two_ahead = vec![
        vec![Op::Send(1), Op::Send(1), Op::Recv(1)],
        vec![Op::Send(0), Op::Send(0), Op::Recv(0)],
    ];
    let e = first_failure(&two_ahead, Rules::Protocol).expect("two sends ahead must wait");
    assert!(e.starts_with("hang") && e.contains("WaitAck"), "{e}");
}

/// Pipelines of 3 and 4 stages, then collectives over the stages: they run because the targets
/// count collectives alone. Counting every op, the ends' targets fall behind the middles': an
/// end passes its READY wait at once (a middle's flag is already past it) and reads the
/// middle's input of another collective, or a middle waits for a value an end never writes.
#[test]
fn collectives_after_uneven_pipeline_messages_complete() {
    for pp in [2, 3, 4] {
        assert_eq!(
            first_failure(&pipeline(pp, 3), Rules::Protocol),
            None,
            "pp {pp}"
        );
    }
    assert_eq!(
        first_failure(&pipeline(2, 3), Rules::TargetsCountEveryOp),
        None
    );
    for pp in [3, 4] {
        let e = first_failure(&pipeline(pp, 3), Rules::TargetsCountEveryOp)
            .unwrap_or_else(|| panic!("pp {pp}: counting every op must fail"));
        assert!(
            e.contains("collective") || e.starts_with("hang"),
            "pp {pp}: {e}"
        );
    }
}

/// Without the DONE barrier a fast rank publishes the next input while a peer still reads the
/// last one: the checks see it.
#[test]
fn the_done_barrier_keeps_inputs_until_every_peer_read_them() {
    let e = first_failure(&collectives(3), Rules::NoDoneBarrier)
        .expect("an all-reduce without its DONE barrier must be caught");
    assert!(e.contains("collective"), "{e}");
}

#[test]
fn op_numbers_count_collectives_apart_from_messages() {
    let mut n = OpNumbers::default();
    let kinds = [
        OpKind::AllReduce,
        OpKind::Send,
        OpKind::Recv,
        OpKind::Barrier,
        OpKind::Send,
        OpKind::AllGather,
    ];
    let got: Vec<(u64, u64)> = kinds
        .iter()
        .map(|k| {
            let x = n.issue(*k);
            (x.seq, x.target)
        })
        .collect();
    assert_eq!(got, [(1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (6, 3)]);
    assert_eq!(
        n,
        OpNumbers {
            ops: 6,
            collectives: 3
        }
    );
}
