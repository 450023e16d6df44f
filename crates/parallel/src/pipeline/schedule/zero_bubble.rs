//! The zero-bubble orders: ZB-H1 by rule, ZB-V by a greedy run on a unit clock.
//!
//! - **ZB-H1** (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the backward split into B,
//!   the input gradient the previous stage waits for, and W, the weight gradients nobody waits
//!   for. 1F1B's order with B in the backward's place; rank r holds back its first r W's and
//!   runs one W after each B in the cooldown, so the W's fill the bubbles 1F1B leaves at the end
//!   of the step. Every rank peaks at 1F1B's peak, min(P, M) micro-batches (activations live
//!   until W). At F = B = W it idles (P − 1) of 3M + P − 1 ticks, a third of 1F1B's bubble.
//! - **ZB-V**: two chunks per rank in a V (rank r holds stages r and 2P − 1 − r, so rank 0 runs
//!   the first and the last stage and the chunks' backwards start where the forwards end), the
//!   order written down by a greedy run on a unit clock: B first, then F while the chunk (and the
//!   one it sends to) holds fewer than P micro-batches, then the oldest W owed. Peak: P per
//!   chunk, 2P half-stage activations, 1F1B's peak memory.
//!
//! On the unit clock of `schedule.rs`'s grids:
//!
//! ZB-H1, P = 4, M = 8 (`B3` is micro-batch 3's input gradient, `W3` its weight gradients):
//! ```text
//! rank 0 | F0 F1 F2 F3 .  .  .  B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7
//! rank 1 | .  F0 F1 F2 .  .  B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7
//! rank 2 | .  .  F0 F1 .  B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7
//! rank 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7
//! ```
//!
//! ZB-V, P = 2, M = 4 (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2):
//! ```text
//! rank 0 | F0.0 F1.0 .    F0.1 B0.1 F1.1 B1.1 B0.0 W0.1 B1.0 W1.1 W0.0 F2.0 W1.0 F3.0 F2.1 B2.1 F3.1 B3.1 B2.0 W2.1 B3.0 W3.1 W2.0 W3.0
//! rank 1 | .    F0.0 F0.1 F1.0 F1.1 B0.1 B0.0 B1.1 B1.0 W0.1 W0.0 W1.1 W1.0 F2.0 F2.1 F3.0 F3.1 B2.1 B2.0 B3.1 B3.0 W2.1 W2.0 W3.1 W3.0
//! ```

use std::collections::VecDeque;

use super::{one_f_one_b, Action, Schedule, ScheduleError};

/// ZB-H1 on rank `r` of `p`: 1F1B's order with each backward split into B and W, and rank r
/// holding back its first `r` W's: the last ranks, which 1F1B leaves idle at the end of the step,
/// run their owed W's there, and in the cooldown every rank runs a W after each B, in the gap
/// where it waits for the next input gradient. Rank r's peak is `warmup + 1 + r = P` micro-batches
/// (`min(P, M)`), 1F1B's peak (its rank 0's).
pub(super) fn zb_h1(p: usize, r: usize, m: usize) -> Vec<Action> {
    let cooldown = m - (p - r - 1).min(m); // 1F1B's backwards from this micro-batch on drain it
    let w = |mb| Action::WeightGrad { mb, chunk: 0 };
    let mut out = Vec::with_capacity(3 * m);
    let mut owed = VecDeque::new();
    for action in one_f_one_b(p, r, m) {
        match action {
            Action::Backward { mb, chunk } => {
                out.push(Action::InputGrad { mb, chunk });
                owed.push_back(mb);
                if mb >= cooldown || owed.len() > r {
                    out.extend(owed.pop_front().map(w));
                }
            }
            other => out.push(other),
        }
    }
    out.extend(owed.into_iter().map(w));
    out
}

/// What a greedy builder of the zero-bubble orders has placed so far, per model stage, rank and
/// chunk; `T` is when a pass happened (a tick, or a time on the costs' clock).
pub(super) struct Progress<T> {
    /// When F (B) of (stage, micro-batch) ran.
    pub f: Vec<Vec<Option<T>>>,
    pub b: Vec<Vec<Option<T>>>,
    /// The next micro-batch whose F (B) each (rank, chunk) runs.
    pub next_f: Vec<Vec<usize>>,
    pub next_b: Vec<Vec<usize>>,
    /// The W's each rank owes, (micro-batch, chunk), oldest first.
    pub owed_w: Vec<VecDeque<(usize, usize)>>,
    /// Micro-batches holding activations in each (rank, chunk): an F adds one, a W frees it.
    pub alive: Vec<Vec<usize>>,
}

impl<T: Copy> Progress<T> {
    /// Nothing placed: `n` model stages, `m` micro-batches, `p` ranks of `v` chunks.
    pub fn new(n: usize, m: usize, p: usize, v: usize) -> Self {
        Self {
            f: vec![vec![None; m]; n],
            b: vec![vec![None; m]; n],
            next_f: vec![vec![0; v]; p],
            next_b: vec![vec![0; v]; p],
            owed_w: vec![VecDeque::new(); p],
            alive: vec![vec![0; v]; p],
        }
    }

    /// Rank `r` ran `a` (micro-batch `mb` of `stage`, its chunk `c`) at `at`.
    pub fn record(&mut self, r: usize, a: Action, stage: usize, mb: usize, c: usize, at: T) {
        match a {
            Action::Forward { .. } => {
                self.f[stage][mb] = Some(at);
                self.next_f[r][c] += 1;
                self.alive[r][c] += 1;
            }
            Action::InputGrad { .. } => {
                self.b[stage][mb] = Some(at);
                self.next_b[r][c] += 1;
                self.owed_w[r].push_back((mb, c));
            }
            _ => {
                self.owed_w[r].retain(|&owed| owed != (mb, c));
                self.alive[r][c] -= 1;
            }
        }
    }
}

/// The zero-bubble orders (ZB-H1, ZB-V) of `s`'s placement, written down by running the ranks
/// on a clock where F, B and W each take one tick. At every tick each free rank picks, from
/// what is ready, in this order:
///
/// 1. a B (its input gradient is what the previous stage waits for), the lowest micro-batch
///    first, the later model stage first on a tie;
/// 2. an F, if fewer than `cap(rank)` micro-batches hold activations in that chunk of the rank
///    and of the rank it sends to, counting those already on their way (an F adds one, a W
///    frees one), the lowest micro-batch first, the later stage first;
/// 3. the oldest W still owed: W's fill what would be bubbles, and the last ones the cooldown.
///
/// Within a chunk, F's and B's go in micro-batch order. A pass that needs another rank's
/// message is ready only when that message is the next one from that rank: between two ranks
/// messages are consumed in the order they were sent, so the executor needs no tags.
pub(super) fn zero_bubble(
    s: &Schedule,
    cap: &dyn Fn(usize) -> usize,
) -> Result<Vec<Vec<Action>>, ScheduleError> {
    let (p, m, v, n) = (
        s.stages,
        s.microbatches,
        s.virtual_stages(),
        s.num_model_stages(),
    );
    // What ran, and the tick F (B) of (stage, micro-batch) ran in.
    let mut pr = Progress::<usize>::new(n, m, p, v);
    // channel[src][dst]: the messages src sent dst, in order: (is activation, mb, receiving
    // stage); read[src][dst]: how many dst consumed.
    let mut channel = vec![vec![Vec::<(bool, usize, usize)>::new(); p]; p];
    let mut read = vec![vec![0usize; p]; p];
    let mut out: Vec<Vec<Action>> = vec![Vec::with_capacity(3 * m * v); p];
    let per_rank = 3 * m * v;
    let mut tick = 0;
    while out.iter().any(|o| o.len() < per_rank) {
        // Decide every rank's pass from the state before this tick, then apply them.
        let mut chosen: Vec<Option<Action>> = vec![None; p];
        // Activations sent to each (rank, chunk) and not yet consumed: the memory they will take.
        let mut incoming = vec![vec![0usize; v]; p];
        for (src, row) in channel.iter().enumerate() {
            for (q, msgs) in row.iter().enumerate() {
                for msg in msgs[read[src][q]..].iter().filter(|msg| msg.0) {
                    incoming[q][s.chunk_of_stage(msg.2)] += 1;
                }
            }
        }
        for r in 0..p {
            // Whether the message `msg` from the rank holding stage `from` is the next to read.
            let at_head = |from: usize, msg: (bool, usize, usize)| {
                let q = s.rank_of_stage(from);
                q == r || channel[q][r].get(read[q][r]) == Some(&msg)
            };
            let before = |t: Option<usize>| t.is_some_and(|t| t < tick);
            let by_priority = |cands: &mut Vec<(usize, usize, usize)>| {
                // (mb, stage, chunk): lowest micro-batch, then the later stage.
                cands.sort_by_key(|&(mb, stage, _)| (mb, std::cmp::Reverse(stage)));
                cands.first().copied()
            };
            let mut bs = Vec::new();
            let mut fs = Vec::new();
            for c in 0..v {
                let stage = s.model_stage(r, c);
                let mb = pr.next_b[r][c];
                if mb < m && before(pr.f[stage][mb]) {
                    let fed = stage + 1 == n
                        || (before(pr.b[stage + 1][mb]) && at_head(stage + 1, (false, mb, stage)));
                    if fed {
                        bs.push((mb, stage, c));
                    }
                }
                let mb = pr.next_f[r][c];
                // Room on this rank, counting the activations already on their way to it (less
                // the one this F consumes), and on the rank it sends to: a rank never has to
                // refuse an activation at the head of a channel, so channels never block.
                let consumes = stage > 0 && s.rank_of_stage(stage - 1) != r;
                let room = pr.alive[r][c] + incoming[r][c] - usize::from(consumes) < cap(r);
                let to = (stage + 1 < n)
                    .then(|| (s.rank_of_stage(stage + 1), s.chunk_of_stage(stage + 1)));
                let room_there =
                    to.is_none_or(|(q, d)| q == r || pr.alive[q][d] + incoming[q][d] < cap(q));
                if mb < m && room && room_there {
                    let fed = stage == 0
                        || (before(pr.f[stage - 1][mb]) && at_head(stage - 1, (true, mb, stage)));
                    if fed {
                        fs.push((mb, stage, c));
                    }
                }
            }
            chosen[r] = if let Some((mb, _, chunk)) = by_priority(&mut bs) {
                Some(Action::InputGrad { mb, chunk })
            } else if let Some((mb, stage, chunk)) = by_priority(&mut fs) {
                // Reserve the room its activation takes on the next rank, for the ranks after.
                if stage + 1 < n {
                    let (q, d) = (s.rank_of_stage(stage + 1), s.chunk_of_stage(stage + 1));
                    if q != r {
                        incoming[q][d] += 1;
                    }
                }
                Some(Action::Forward { mb, chunk })
            } else {
                pr.owed_w[r]
                    .front()
                    .map(|&(mb, chunk)| Action::WeightGrad { mb, chunk })
            };
        }
        if chosen.iter().all(Option::is_none) {
            let blocked = (0..p)
                .filter(|&r| out[r].len() < per_rank)
                .map(|r| format!("rank {r} after {} passes", out[r].len()))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(ScheduleError::Deadlock {
                passes_done: out.iter().map(Vec::len).sum(),
                blocked,
            });
        }
        for (r, a) in chosen.into_iter().enumerate() {
            let Some(a) = a else { continue };
            let (mb, c) = (a.mb(), a.chunk());
            let stage = s.model_stage(r, c);
            if let Some(from) = s.input_stage(r, &a) {
                let q = s.rank_of_stage(from);
                if q != r {
                    read[q][r] += 1;
                }
            }
            if let Some(to) = s.output_stage(r, &a) {
                let q = s.rank_of_stage(to);
                if q != r {
                    channel[r][q].push((a.is_forward(), mb, to));
                }
            }
            pr.record(r, a, stage, mb, c, tick);
            out[r].push(a);
        }
        tick += 1;
    }
    Ok(out)
}
