//! The zero-bubble orders built for given pass costs: list scheduling on the clock of what F, B
//! and W cost on each stage (the greedy part of Qi et al. 2023's automatic scheduler).
//!
//! The unit-clock orders (`zero_bubble.rs`) assume every pass takes one tick. When W is shorter
//! than F and B (measured here: F 12.6, B 12.6, W 9.8 ms), a W put in a gap leaves part of the gap
//! empty, and a W put where a B's input is about to arrive delays that B and, through it, every
//! stage before. Here each rank runs on a clock where a pass takes its cost on its stage. Whenever
//! a rank is free at time t it takes, from what is ready at t:
//!
//! 1. a B (its input gradient is what the previous stage waits for), the lowest micro-batch
//!    first, the later model stage first on a tie;
//! 2. an F, within the schedule's memory limit, counted as in `zero_bubble.rs`: the activations
//!    this chunk holds and those already on their way to it, and the same on the rank it sends
//!    to (1 and 2 swap under [`Order::FFirst`]);
//! 3. a W: the oldest owed, or (under [`Rules::frees_memory_first`]) the oldest of the chunk
//!    whose next F waits for memory here, by one of two rules ([`WRule`]):
//!    - *fill*: whenever nothing else is ready;
//!    - *fit*: only if the W ends before the next message already on its way to this rank arrives
//!      (the gap is at least W long), or no message is on its way, or an F waits only for the
//!      memory a W frees. Otherwise the rank waits for that message.
//!
//! A rank that takes nothing waits for the next pass to end anywhere and looks again. Messages are
//! consumed in the order they were sent between two ranks, as in `zero_bubble.rs`, and those a
//! rank sends itself (the V's turn on rank P − 1) too.
//!
//! The fit rule on one rank. It is free at 10; the next input gradient arrives at 13 (F = B = 3):
//!
//! ```text
//!   W = 2:  10 [W1 ---]12 .  13 [B2 ------]16           the W fits: it runs, one unit idle
//!   W = 4:  10 .  .  .  13 [B2 ------]16 [W1 ...        it does not: the rank waits, B2 on time
//!   fill, W = 4:  10 [W1 ------]14 [B2 ------]17        B2, and every B before it, one unit late
//! ```
//!
//! [`cost_aware`] builds the order with each rank's choice of these [`Rules`] (the W rule, B or F
//! first when both are ready, and whether the W that frees the memory a waiting F needs goes
//! before older ones). [`shortest`], what [`super::Schedule::with_costs`] runs, searches them:
//! every rank by the same rules, each combination, then from the best of those one rank's rules
//! changed at a time while that shortens the step. Each order is simulated at the same costs
//! ([`Schedule::simulate_with`]); the shortest, the unit-clock order among them, is kept (the
//! unit-clock order on a tie): never worse than the unit-clock order, at any costs. [`refine`]
//! then moves single passes within their rank's order while that shortens the step, keeps the
//! messages in order and raises no rank's activation peak: the rules place each pass by what
//! is ready when its rank is free, and a move can put a W in a gap they left (at the pass costs
//! measured at width 256, P = 2, M = 8: ZB-V's step 376.1 → 374.0 ms, 0.25x → 0.20x of 1F1B's
//! bubble).
//!
//! ZB-V, P = 2, M = 2, at F = B = 2 and W = 1 per chunk (one column per unit, `-` continues a
//! pass): the unit-clock order, 23 units, and the cost-aware one, 22: rank 0 runs W1.1 in the
//! gap before B1.0's input arrives, where the unit-clock order leaves it idle.
//!
//! ```text
//! rank 0 | F0.0 -    F1.0 -    .    .    F0.1 -    B0.1 -    F1.1 -    B1.1 -    B0.0 -    W0.1 .    B1.0 -    W1.1 W0.0 W1.0
//! rank 1 | .    .    F0.0 -    F0.1 -    F1.0 -    F1.1 -    B0.1 -    B0.0 -    B1.1 -    B1.0 -    W0.1 W0.0 W1.1 W1.0 .
//! ```
//!
//! ```text
//! rank 0 | F0.0 -    F1.0 -    .    .    F0.1 -    B0.1 -    F1.1 -    B1.1 -    B0.0 -    W0.1 W1.1 B1.0 -    W0.0 W1.0
//! rank 1 | .    .    F0.0 -    F0.1 -    F1.0 -    F1.1 -    B0.1 -    B0.0 -    B1.1 -    B1.0 -    W0.1 W0.0 W1.1 W1.0
//! ```
//!
//! At the measured costs, M = 8 (the tests' `cost_aware_orders_shrink_the_bubble_at_the_measured_costs`),
//! this takes ZB-V's bubble from 0.49x, 0.37x and 0.35x of 1F1B's at P = 2, 4, 8 to 0.20x, 0.26x
//! and 0.29x, and leaves ZB-H1's at 0.47x, 0.52x and 0.60x. What is not met, and why:
//! - ZB-H1 ≤ 0.5x at P = 4 and 8. No order within its memory (min(P, M) micro-batches a rank) does
//!   better than the unit-clock one, which reaches this floor: the last rank idles (P − 1)·F before
//!   its first input; after its last B it has at most P W's owed, P·W of work, while that B still
//!   travels P − 1 stages back and the first rank's W follows, (P − 1)·B + W; so it idles at least
//!   (P − 1)(F + B − W) (the paper's ZB-H1 bubble), 46.2 ms of a 326.2 ms step at P = 4.
//! - ZB-V ≤ 0.25x at P = 4 and 8. Rank P − 1 idles (P − 1) half-stage forwards before its first
//!   input in any order, which is 0.29x at P = 8 (reached) and 0.23x at P = 4, where the search
//!   stops at 0.26x (a 301.7 ms step against the floor's 298.9: its rules leave a few gaps of
//!   1.4 ms, a chunk's F less its W, on ranks 1 to 3).

use super::zero_bubble::Progress;
use super::{Action, PassCosts, Schedule, ScheduleError, ScheduleKind};

impl Schedule {
    /// [`Self::new`], the zero-bubble orders built for `costs[stage]` (`cost_aware.rs`): of the
    /// unit-clock order and the cost-aware ones, the one whose simulation at `costs` is the
    /// shortest, the unit-clock order on a tie, then shortened by single moves of a pass. Each
    /// keeps its kind's memory limit (ZB-H1: min(P, M) micro-batches per rank, 1F1B's peak;
    /// ZB-V: P per chunk). The other kinds do not depend on costs: [`Self::new`]'s order.
    /// `mtrain plan --pass-costs F,B,W` prints it beside the unit-clock order, and training
    /// under the same flag runs it (`ParallelPlan::schedule`).
    pub fn with_costs(
        kind: ScheduleKind,
        stages: usize,
        microbatches: usize,
        costs: &[PassCosts],
    ) -> Result<Self, ScheduleError> {
        let unit = Self::new(kind, stages, microbatches)?;
        if !kind.splits_backward() {
            return Ok(unit);
        }
        let actions = refine(&unit, costs, shortest(&unit, costs, &|_| stages)?);
        Ok(Self { actions, ..unit })
    }
}

/// When a rank with nothing else ready runs a W (module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WRule {
    /// Whenever nothing else is ready.
    Fill,
    /// Only where it ends before the next message on its way arrives.
    Fit,
}

/// Which of a ready B and a ready F a rank takes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Order {
    /// The B: the previous stage waits for its input gradient.
    BFirst,
    /// The F: the next stage waits for its activation.
    FFirst,
}

/// One way of choosing: the W rule, the B/F order, and which W a rank takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Rules {
    pub w: WRule,
    pub order: Order,
    /// Take the oldest W of the chunk whose F waits for memory on this rank (the oldest W owed
    /// otherwise), instead of the oldest W owed.
    pub frees_memory_first: bool,
}

impl Rules {
    /// Every combination, for the builder to try.
    pub fn all() -> impl Iterator<Item = Rules> {
        [WRule::Fill, WRule::Fit].into_iter().flat_map(|w| {
            [Order::BFirst, Order::FFirst]
                .into_iter()
                .flat_map(move |order| {
                    [false, true].map(|frees_memory_first| Rules {
                        w,
                        order,
                        frees_memory_first,
                    })
                })
        })
    }
}

/// A message between two ranks: (is activation, micro-batch, receiving stage), and when the
/// pass that sends it ends.
#[derive(Debug, Clone, Copy)]
struct Msg {
    activation: bool,
    mb: usize,
    to: usize,
    at: f64,
}

/// Every rank's actions, in order.
type Orders = Vec<Vec<Action>>;

/// At most this many sweeps over the ranks in [`shortest`]'s search.
const SWEEPS: usize = 8;

/// Of `unit`'s order and the cost-aware ones, the one whose simulation at `costs` is the
/// shortest, `unit`'s on a tie. The cost-aware ones: every rank by the same [`Rules`], each
/// combination; then, from the best of those, one rank's rules changed at a time, a change kept
/// when it shortens the step, in sweeps over the ranks until one shortens nothing (at most
/// [`SWEEPS`]). Rules that deadlock at these costs are no candidate (the tests build every
/// uniform choice and this search's outcome on the costs they try, and check both).
pub(super) fn shortest(
    unit: &Schedule,
    costs: &[PassCosts],
    cap: &dyn Fn(usize) -> usize,
) -> Result<Orders, ScheduleError> {
    let p = unit.stages;
    let step = |actions: &Orders| {
        let s = Schedule {
            actions: actions.clone(),
            ..unit.clone()
        };
        s.simulate_with(costs).map(|sim| sim.makespan())
    };
    // The order by rank r's rules `per_rank[r]` and its step, None if it deadlocks.
    let build = |per_rank: &[Rules]| {
        let actions = cost_aware(unit, costs, cap, per_rank).ok()?;
        Some((step(&actions).ok()?, actions))
    };
    let shorter = |t: f64, than: f64| t < than * (1.0 - 1e-12);
    let mut best = (step(&unit.actions)?, unit.actions.clone());
    // The best uniform choice, and from it one rank's rules at a time.
    let mut here: Option<(f64, Vec<Rules>)> = None;
    for rules in Rules::all() {
        if let Some((t, actions)) = build(&vec![rules; p]) {
            if here.as_ref().is_none_or(|(h, _)| shorter(t, *h)) {
                here = Some((t, vec![rules; p]));
            }
            if shorter(t, best.0) {
                best = (t, actions);
            }
        }
    }
    let Some((mut at, mut per_rank)) = here else {
        return Ok(best.1);
    };
    for _sweep in 0..SWEEPS {
        let before = at;
        for r in 0..p {
            for rules in Rules::all() {
                let was = per_rank[r];
                per_rank[r] = rules;
                match build(&per_rank) {
                    Some((t, actions)) if shorter(t, at) => {
                        at = t;
                        if shorter(t, best.0) {
                            best = (t, actions);
                        }
                    }
                    _ => per_rank[r] = was,
                }
            }
        }
        if !shorter(at, before) {
            break;
        }
    }
    Ok(best.1)
}

/// At most this many passes of [`refine`] over every rank's moves.
const REFINE_PASSES: usize = 16;
/// How far [`refine`] moves a pass within its rank's order, in places either way.
const REFINE_REACH: usize = 6;
/// At most this much work in one [`refine`], counted in passes looked at by its order checks
/// and simulations (a count, not a time, so that every rank builds the same order).
const REFINE_WORK: usize = 500_000;

/// Local search from the list scheduler's order (the improvement step after the greedy start):
/// take one pass of one rank and put it up to [`REFINE_REACH`] places earlier or later in its
/// rank's order; keep the move when the step simulated at `costs` gets shorter, the messages
/// between every two ranks are still consumed in the order they are sent, and no rank holds
/// more activation sets at its peak than it did. Passes over every rank's moves until one
/// shortens nothing (at most [`REFINE_PASSES`] passes and [`REFINE_WORK`]). The rules take
/// what is ready when a rank is free; a move can start a forward earlier instead. At the costs
/// measured at width 256, P = 2, M = 8, rank 0 runs F2.0 before B1.0 (F4.0 before B3.0, F6.0
/// before B5.0) and rank 1 its F2.0 and F2.1 before W0.1, so rank 1's forwards wait less.
pub(super) fn refine(unit: &Schedule, costs: &[PassCosts], orders: Orders) -> Orders {
    let mut s = Schedule {
        actions: orders,
        ..unit.clone()
    };
    let Ok(sim) = s.simulate_with(costs) else {
        return s.actions;
    };
    let p = s.stages;
    let peaks: Vec<usize> = (0..p).map(|r| sim.peak_in_flight(r)).collect();
    let mut at = sim.makespan();
    let shorter = |t: f64, than: f64| t < than * (1.0 - 1e-12);
    let passes: usize = s.actions.iter().map(Vec::len).sum();
    let mut work = 0;
    for _pass in 0..REFINE_PASSES {
        let before = at;
        for r in 0..p {
            for i in 0..s.actions[r].len() {
                let lo = i.saturating_sub(REFINE_REACH);
                let hi = (i + REFINE_REACH).min(s.actions[r].len() - 1);
                for j in (lo..=hi).filter(|&j| j != i) {
                    if work >= REFINE_WORK {
                        return s.actions;
                    }
                    let action = move_pass(&mut s.actions[r], i, j);
                    // A W sends and consumes nothing, so moving it keeps every channel's order.
                    let is_w = matches!(action, Action::WeightGrad { .. });
                    let keeps_order = is_w || messages_keep_their_order(&s);
                    work += passes * (usize::from(!is_w) + usize::from(keeps_order));
                    let shortened = match keeps_order.then(|| s.simulate_with(costs)) {
                        Some(Ok(sim))
                            if shorter(sim.makespan(), at)
                                && (0..p).all(|q| sim.peak_in_flight(q) <= peaks[q]) =>
                        {
                            Some(sim.makespan())
                        }
                        _ => None, // a W before its own B, an input that never comes, or longer
                    };
                    if let Some(t) = shortened {
                        at = t;
                        break;
                    }
                    move_pass(&mut s.actions[r], j, i); // undo
                }
            }
        }
        if !shorter(at, before) {
            break;
        }
    }
    s.actions
}

/// Moves the pass at `from` of one rank's order to `to`, and returns it.
fn move_pass(order: &mut Vec<Action>, from: usize, to: usize) -> Action {
    let action = order.remove(from);
    order.insert(to, action);
    action
}

/// Whether every rank consumes what each other rank sends it (itself included) in the order it
/// was sent: the executor's point-to-point messages carry no tags.
pub(super) fn messages_keep_their_order(s: &Schedule) -> bool {
    let p = s.stages;
    // sent[src][dst] and consumed[src][dst]: (is activation, micro-batch, receiving stage).
    let mut sent = vec![vec![Vec::new(); p]; p];
    let mut consumed = vec![vec![Vec::new(); p]; p];
    for r in 0..p {
        for a in s.actions(r) {
            let stage = s.model_stage(r, a.chunk());
            if let Some(from) = s.input_stage(r, a) {
                consumed[s.rank_of_stage(from)][r].push((a.is_forward(), a.mb(), stage));
            }
            if let Some(to) = s.output_stage(r, a) {
                sent[r][s.rank_of_stage(to)].push((a.is_forward(), a.mb(), to));
            }
        }
    }
    sent == consumed
}

/// The split-backward order of `s`'s placement at `costs[stage]`, the activations of each chunk
/// of rank r capped at `cap(r)`, rank r's passes chosen by `rules[r]` (module doc).
pub(super) fn cost_aware(
    s: &Schedule,
    costs: &[PassCosts],
    cap: &dyn Fn(usize) -> usize,
    rules: &[Rules],
) -> Result<Vec<Vec<Action>>, ScheduleError> {
    let (p, m, v, n) = (
        s.stages,
        s.microbatches,
        s.virtual_stages(),
        s.num_model_stages(),
    );
    if costs.len() != n {
        return Err(ScheduleError::Costs {
            expected: n,
            got: costs.len(),
        });
    }
    // A time within this of another is the same time (sums of the same costs in another order).
    let eps = 1e-9
        * costs
            .iter()
            .map(|c| c.forward + c.input_grad + c.weight_grad)
            .sum::<f64>();
    // What ran, and when F (B) of (stage, micro-batch) ends.
    let mut pr = Progress::<f64>::new(n, m, p, v);
    // Activations sent to (rank, chunk) and not yet consumed: the memory they will take.
    let mut incoming = vec![vec![0usize; v]; p];
    // channel[src][dst]: what src sent dst (src itself too), in order; read[src][dst]: how many
    // dst consumed.
    let mut channel = vec![vec![Vec::<Msg>::new(); p]; p];
    let mut read = vec![vec![0usize; p]; p];
    // When each rank is free to take its next pass.
    let mut free = vec![0.0f64; p];
    let per_rank = 3 * m * v;
    let mut out: Vec<Vec<Action>> = vec![Vec::with_capacity(per_rank); p];
    while out.iter().any(|o| o.len() < per_rank) {
        let t = (0..p)
            .filter(|&r| out[r].len() < per_rank)
            .map(|r| free[r])
            .fold(f64::INFINITY, f64::min);
        let mut took = vec![false; p];
        for r in 0..p {
            if out[r].len() == per_rank || free[r] > t + eps {
                continue;
            }
            let done = |e: Option<f64>| e.is_some_and(|e| e <= t + eps);
            // Whether `(activation, mb, to)` from the rank holding stage `from` is the next to read.
            let at_head = |from: usize, activation: bool, mb: usize, to: usize| {
                let q = s.rank_of_stage(from);
                channel[q][r]
                    .get(read[q][r])
                    .is_some_and(|msg| (msg.activation, msg.mb, msg.to) == (activation, mb, to))
            };
            // (mb, stage, chunk) of the ready B's and F's.
            let mut bs = Vec::new();
            let mut fs = Vec::new();
            // The chunk whose next F is fed but waits for room on this rank.
            let mut waits_for_memory = None;
            for c in 0..v {
                let stage = s.model_stage(r, c);
                let mb = pr.next_b[r][c];
                if mb < m && done(pr.f[stage][mb]) {
                    let fed = stage + 1 == n
                        || (done(pr.b[stage + 1][mb]) && at_head(stage + 1, false, mb, stage));
                    if fed {
                        bs.push((mb, stage, c));
                    }
                }
                let mb = pr.next_f[r][c];
                let fed = mb < m
                    && (stage == 0
                        || (done(pr.f[stage - 1][mb]) && at_head(stage - 1, true, mb, stage)));
                let consumes = stage > 0 && s.rank_of_stage(stage - 1) != r;
                let room = pr.alive[r][c] + incoming[r][c] - usize::from(consumes && fed) < cap(r);
                let to = (stage + 1 < n)
                    .then(|| (s.rank_of_stage(stage + 1), s.chunk_of_stage(stage + 1)));
                let room_there =
                    to.is_none_or(|(q, d)| q == r || pr.alive[q][d] + incoming[q][d] < cap(q));
                if fed && room && room_there {
                    fs.push((mb, stage, c));
                } else if fed && !room {
                    waits_for_memory = waits_for_memory.or(Some(c));
                }
            }
            let rules = rules[r];
            let first = |cands: &mut Vec<(usize, usize, usize)>| {
                cands.sort_by_key(|&(mb, stage, _)| (mb, std::cmp::Reverse(stage)));
                cands.first().copied()
            };
            // The oldest W owed, of the chunk an F waits on for memory if there is one.
            let w = waits_for_memory
                .filter(|_| rules.frees_memory_first)
                .and_then(|c| pr.owed_w[r].iter().position(|&(_, chunk)| chunk == c))
                .or((!pr.owed_w[r].is_empty()).then_some(0));
            let b = first(&mut bs).map(|(mb, _, chunk)| Action::InputGrad { mb, chunk });
            let f = first(&mut fs).map(|(mb, _, chunk)| Action::Forward { mb, chunk });
            let action = if let Some(a) = match rules.order {
                Order::BFirst => b.or(f),
                Order::FFirst => f.or(b),
            } {
                Some(a)
            } else if let Some((mb, chunk)) = w.map(|i| pr.owed_w[r][i]) {
                let cost = costs[s.model_stage(r, chunk)].weight_grad;
                // The next message on its way here: the first unread one of each channel, if
                // it has not arrived yet.
                let arrives = (0..p)
                    .filter_map(|q| channel[q][r].get(read[q][r]).map(|msg| msg.at))
                    .filter(|&at| at > t + eps)
                    .fold(f64::INFINITY, f64::min);
                let fits = t + cost <= arrives + eps;
                (rules.w == WRule::Fill || fits || waits_for_memory.is_some())
                    .then_some(Action::WeightGrad { mb, chunk })
            } else {
                None
            };
            let Some(a) = action else { continue };
            let (mb, c) = (a.mb(), a.chunk());
            let stage = s.model_stage(r, c);
            let end = t + costs[stage].of(a.kind());
            if let Some(from) = s.input_stage(r, &a) {
                let q = s.rank_of_stage(from);
                read[q][r] += 1;
                if q != r && a.is_forward() {
                    incoming[r][c] -= 1;
                }
            }
            if let Some(to) = s.output_stage(r, &a) {
                let q = s.rank_of_stage(to);
                let activation = a.is_forward();
                channel[r][q].push(Msg {
                    activation,
                    mb,
                    to,
                    at: end,
                });
                if q != r && activation {
                    incoming[q][s.chunk_of_stage(to)] += 1;
                }
            }
            pr.record(r, a, stage, mb, c, end);
            out[r].push(a);
            free[r] = end;
            took[r] = true;
        }
        // The ranks that took nothing look again when the next pass ends.
        let next = (0..p)
            .filter(|&q| took[q] || free[q] > t + eps)
            .map(|q| free[q])
            .fold(f64::INFINITY, f64::min);
        if !next.is_finite() {
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
        for r in 0..p {
            if !took[r] && out[r].len() < per_rank && free[r] <= t + eps {
                free[r] = next;
            }
        }
    }
    Ok(out)
}
