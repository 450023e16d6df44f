//! Pipeline schedules as data: for each pipeline rank, the ordered list of forward and backward
//! passes it runs in one training step.
//!
//! A schedule says nothing about tensors or sockets. [`Schedule::actions`] hands a rank its
//! list of [`Action`]s; the executor (`executor.rs`) runs them and adds the point-to-point
//! communication each one implies: a forward of a stage that is not the first receives its
//! input activation from the previous stage and sends its output to the next one; a backward
//! receives the output gradient from the next stage and sends the input gradient back.
//!
//! Legend: P pipeline ranks, M micro-batches, v virtual stages (model chunks) per rank,
//! S = v·P model stages. Chunk c on rank r is model stage `c·P + r` (Megatron's layout: rank 0
//! holds stages 0, P, 2P, ...).
//!
//! Three schedules:
//! - **GPipe** (all-forward-all-backward): every rank runs the M forwards, then the M backwards.
//!   All M micro-batches' activations are alive at once.
//! - **1F1B** (PipeDream-Flush, Megatron's non-interleaved schedule): rank r runs
//!   `warmup = min(P − r − 1, M)` forwards, then alternates one forward and one backward, then
//!   drains the remaining `warmup` backwards. At most `warmup + 1 ≤ P − r` micro-batches are alive.
//! - **Interleaved 1F1B** (Megatron's virtual pipeline): each rank holds v chunks; forwards walk
//!   micro-batches in groups of P, chunk by chunk; `warmup = 2(P − r − 1) + (v − 1)·P`. M must be a
//!   multiple of P. The bubble shrinks by v.
//!
//! With every forward and every backward taking one tick, and a stage starting a micro-batch's
//! forward (backward) only once the previous (next) stage finished it, every rank idles for
//! 2(P − 1) ticks: GPipe and 1F1B both lose (P − 1)/(M + P − 1) of the step (1F1B wins on
//! memory, not time), interleaved 1F1B (P − 1)/(v·M + P − 1) (its passes are v times shorter).
//! [`Schedule::simulate`] runs that virtual clock; its [`Simulation::render`] drew these grids
//! (a test checks they still match the code):
//!
//! GPipe, P = 4, M = 4:
//! ```text
//! rank 0 | F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3
//! rank 1 | .  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 .
//! rank 2 | .  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .  .
//! rank 3 | .  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .  .
//! ```
//!
//! 1F1B, P = 4, M = 8:
//! ```text
//! rank 0 | F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
//! rank 1 | .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
//! rank 2 | .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
//! rank 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .
//! ```
//!
//! Interleaved 1F1B, P = 2, v = 2, M = 4 (`F1.0` = forward of micro-batch 1 through chunk 0):
//! ```text
//! rank 0 | F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 .    B2.1 .    B3.1 B2.0 B3.0
//! rank 1 | .    F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0 .
//! ```

use std::fmt;

/// Which schedule to build. Written `gpipe`, `1f1b` or `interleaved:V` (V virtual stages per
/// rank) on a command line; in TOML `"gpipe"`, `"1f1b"` or `{ interleaved_1f1b = { virtual_stages = 2 } }`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ScheduleKind {
    /// All forwards, then all backwards.
    #[serde(rename = "gpipe")]
    GPipe,
    /// One forward, one backward, after a warmup of `P − r − 1` forwards.
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// 1F1B over `virtual_stages` model chunks per rank.
    #[serde(rename = "interleaved_1f1b")]
    Interleaved1F1B { virtual_stages: usize },
}

impl ScheduleKind {
    /// Model chunks (virtual stages) each rank holds.
    pub fn virtual_stages(&self) -> usize {
        match self {
            ScheduleKind::Interleaved1F1B { virtual_stages } => *virtual_stages,
            _ => 1,
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleKind::GPipe => f.write_str("GPipe"),
            ScheduleKind::OneFOneB => f.write_str("1F1B"),
            ScheduleKind::Interleaved1F1B { virtual_stages } => {
                write!(f, "interleaved 1F1B (v = {virtual_stages})")
            }
        }
    }
}

impl std::str::FromStr for ScheduleKind {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ScheduleError::UnknownKind(s.to_string());
        match s.to_ascii_lowercase().as_str() {
            "gpipe" => Ok(ScheduleKind::GPipe),
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            other => {
                let v = other.strip_prefix("interleaved:").ok_or_else(bad)?;
                let virtual_stages = v.parse().map_err(|_| bad())?;
                Ok(ScheduleKind::Interleaved1F1B { virtual_stages })
            }
        }
    }
}

/// One unit of work on one rank: a forward or backward pass of micro-batch `mb` through the
/// rank's model chunk `chunk` (always 0 unless the schedule is interleaved).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    Forward { mb: usize, chunk: usize },
    Backward { mb: usize, chunk: usize },
}

impl Action {
    pub fn mb(&self) -> usize {
        match *self {
            Action::Forward { mb, .. } | Action::Backward { mb, .. } => mb,
        }
    }

    pub fn chunk(&self) -> usize {
        match *self {
            Action::Forward { chunk, .. } | Action::Backward { chunk, .. } => chunk,
        }
    }

    pub fn is_forward(&self) -> bool {
        matches!(self, Action::Forward { .. })
    }
}

/// Errors building or simulating a schedule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("unknown pipeline schedule `{0}` (expected gpipe, 1f1b or interleaved:V with V virtual stages per rank)")]
    UnknownKind(String),

    #[error("a pipeline needs at least one stage and one micro-batch, got P = {stages}, M = {microbatches}")]
    Empty { stages: usize, microbatches: usize },

    #[error("interleaved 1F1B needs at least one virtual stage per rank, got v = 0")]
    NoVirtualStages,

    #[error("interleaved 1F1B needs the micro-batch count to be a multiple of the pipeline size: M = {microbatches} is not a multiple of P = {stages}")]
    MicrobatchesNotMultipleOfStages { stages: usize, microbatches: usize },

    #[error("schedule deadlocks at tick {tick}: ranks are blocked at {blocked}")]
    Deadlock { tick: usize, blocked: String },
}

/// Per-rank action lists for one training step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    kind: ScheduleKind,
    stages: usize,
    microbatches: usize,
    actions: Vec<Vec<Action>>,
}

impl Schedule {
    /// Build the schedule of `kind` for `stages` pipeline ranks and `microbatches` micro-batches.
    pub fn new(
        kind: ScheduleKind,
        stages: usize,
        microbatches: usize,
    ) -> Result<Self, ScheduleError> {
        if stages == 0 || microbatches == 0 {
            return Err(ScheduleError::Empty {
                stages,
                microbatches,
            });
        }
        let actions = match kind {
            ScheduleKind::GPipe => (0..stages).map(|_| gpipe(microbatches)).collect(),
            ScheduleKind::OneFOneB => (0..stages)
                .map(|r| one_f_one_b(stages, r, microbatches))
                .collect(),
            ScheduleKind::Interleaved1F1B { virtual_stages } => {
                if virtual_stages == 0 {
                    return Err(ScheduleError::NoVirtualStages);
                }
                if !microbatches.is_multiple_of(stages) {
                    return Err(ScheduleError::MicrobatchesNotMultipleOfStages {
                        stages,
                        microbatches,
                    });
                }
                (0..stages)
                    .map(|r| interleaved(stages, r, microbatches, virtual_stages))
                    .collect()
            }
        };
        Ok(Self {
            kind,
            stages,
            microbatches,
            actions,
        })
    }

    pub fn kind(&self) -> ScheduleKind {
        self.kind
    }

    /// P, the number of pipeline ranks.
    pub fn num_ranks(&self) -> usize {
        self.stages
    }

    /// M, the number of micro-batches per step.
    pub fn num_microbatches(&self) -> usize {
        self.microbatches
    }

    /// v, the number of model chunks per rank.
    pub fn virtual_stages(&self) -> usize {
        self.kind.virtual_stages()
    }

    /// S = v·P, the number of model stages.
    pub fn num_model_stages(&self) -> usize {
        self.stages * self.virtual_stages()
    }

    /// The model stage that chunk `chunk` of pipeline rank `rank` runs: `chunk·P + rank`.
    pub fn model_stage(&self, rank: usize, chunk: usize) -> usize {
        chunk * self.stages + rank
    }

    /// The pipeline rank that runs model stage `stage`.
    pub fn rank_of_stage(&self, stage: usize) -> usize {
        stage % self.stages
    }

    /// The model stage whose result `action` on `rank` consumes: the previous stage's activation
    /// for a forward, the next stage's input gradient for a backward; `None` at the pipeline's
    /// ends (the first stage reads the batch, the last stage starts backward from its loss).
    pub fn input_stage(&self, rank: usize, action: &Action) -> Option<usize> {
        let stage = self.model_stage(rank, action.chunk());
        match action {
            Action::Forward { .. } => stage.checked_sub(1),
            Action::Backward { .. } => Some(stage + 1).filter(|&s| s < self.num_model_stages()),
        }
    }

    /// The model stage that consumes what `action` on `rank` produces: the next stage for a
    /// forward, the previous one for a backward; `None` at the pipeline's ends.
    pub fn output_stage(&self, rank: usize, action: &Action) -> Option<usize> {
        let stage = self.model_stage(rank, action.chunk());
        match action {
            Action::Forward { .. } => Some(stage + 1).filter(|&s| s < self.num_model_stages()),
            Action::Backward { .. } => stage.checked_sub(1),
        }
    }

    /// The ordered actions of pipeline rank `rank` (panics if `rank ≥ P`, a programming error).
    pub fn actions(&self, rank: usize) -> &[Action] {
        &self.actions[rank]
    }

    /// Idle fraction of a step in the ideal pipeline with equal forward and backward costs:
    /// (P − 1)/(v·M + P − 1), the textbook (P − 1)/(M + P − 1) when v = 1.
    pub fn analytic_bubble_fraction(&self) -> f64 {
        let p = self.stages as f64;
        let vm = (self.virtual_stages() * self.microbatches) as f64;
        (p - 1.0) / (vm + p - 1.0)
    }

    /// Run every rank's list on a virtual clock where each action takes one tick. A forward of
    /// micro-batch i on model stage s may start once stage s − 1 finished its forward of i (in
    /// an earlier tick); a backward once stage s + 1 finished its backward of i. A rank whose next
    /// action is not ready idles for the tick. Fails with [`ScheduleError::Deadlock`] if at some
    /// tick no rank can move although work remains.
    pub fn simulate(&self) -> Result<Simulation, ScheduleError> {
        let (p, m, s) = (self.stages, self.microbatches, self.num_model_stages());
        // finished_at[stage][mb] for forwards and backwards: the tick a pass finished in.
        let mut fwd_done = vec![vec![None::<usize>; m]; s];
        let mut bwd_done = vec![vec![None::<usize>; m]; s];
        let mut next = vec![0usize; p];
        let mut grid: Vec<Vec<Option<Action>>> = vec![Vec::new(); p];
        let mut alive = vec![0usize; p];
        let mut peak_alive = vec![0usize; p];
        let mut tick = 0;
        while (0..p).any(|r| next[r] < self.actions[r].len()) {
            let mut moved = false;
            for r in 0..p {
                let Some(&action) = self.actions[r].get(next[r]) else {
                    grid[r].push(None);
                    continue;
                };
                let stage = self.model_stage(r, action.chunk());
                let mb = action.mb();
                // Ready once the stage feeding this pass finished it in an earlier tick.
                let fed = match self.input_stage(r, &action) {
                    None => true,
                    Some(from) => {
                        let done = if action.is_forward() {
                            &fwd_done
                        } else {
                            &bwd_done
                        };
                        done[from][mb].is_some_and(|t| t < tick)
                    }
                };
                let ready = fed && (action.is_forward() || fwd_done[stage][mb].is_some());
                if !ready {
                    grid[r].push(None);
                    continue;
                }
                match action {
                    Action::Forward { .. } => {
                        fwd_done[stage][mb] = Some(tick);
                        alive[r] += 1;
                        peak_alive[r] = peak_alive[r].max(alive[r]);
                    }
                    Action::Backward { .. } => {
                        bwd_done[stage][mb] = Some(tick);
                        alive[r] -= 1;
                    }
                }
                grid[r].push(Some(action));
                next[r] += 1;
                moved = true;
            }
            if !moved {
                let blocked = (0..p)
                    .filter_map(|r| {
                        self.actions[r]
                            .get(next[r])
                            .map(|a| format!("rank {r}: {a:?}"))
                    })
                    .collect::<Vec<_>>()
                    .join(", ");
                return Err(ScheduleError::Deadlock { tick, blocked });
            }
            tick += 1;
        }
        Ok(Simulation {
            virtual_stages: self.virtual_stages(),
            grid,
            peak_alive,
        })
    }
}

/// GPipe: F0 F1 ... F(M−1) B0 B1 ... B(M−1).
fn gpipe(m: usize) -> Vec<Action> {
    let forwards = (0..m).map(|mb| Action::Forward { mb, chunk: 0 });
    let backwards = (0..m).map(|mb| Action::Backward { mb, chunk: 0 });
    forwards.chain(backwards).collect()
}

/// 1F1B on rank `r` of `p`: warmup forwards, steady (forward, backward) pairs, cooldown backwards.
fn one_f_one_b(p: usize, r: usize, m: usize) -> Vec<Action> {
    let warmup = (p - r - 1).min(m);
    let mut out = Vec::with_capacity(2 * m);
    // Warmup: fill the pipeline.
    out.extend((0..warmup).map(|mb| Action::Forward { mb, chunk: 0 }));
    // Steady state: the forward of micro-batch `warmup + i`, then the backward of micro-batch i.
    for i in 0..m - warmup {
        out.push(Action::Forward {
            mb: warmup + i,
            chunk: 0,
        });
        out.push(Action::Backward { mb: i, chunk: 0 });
    }
    // Cooldown: drain the backwards still owed.
    out.extend((m - warmup..m).map(|mb| Action::Backward { mb, chunk: 0 }));
    out
}

/// Interleaved 1F1B on rank `r` of `p` with `v` chunks (Megatron's ordering). The k-th forward
/// of a rank runs micro-batch `(k / (P·v))·P + k % P` through chunk `(k / P) % v`: groups of P
/// micro-batches go through chunk 0, then the same group through chunk 1, and so on. The k-th
/// backward walks the same micro-batches through the chunks in reverse.
fn interleaved(p: usize, r: usize, m: usize, v: usize) -> Vec<Action> {
    let total = m * v;
    let mb_of = |k: usize| (k / (p * v)) * p + k % p;
    let chunk_of = |k: usize| (k / p) % v;
    let forward = |k: usize| Action::Forward {
        mb: mb_of(k),
        chunk: chunk_of(k),
    };
    let backward = |k: usize| Action::Backward {
        mb: mb_of(k),
        chunk: v - 1 - chunk_of(k),
    };
    let warmup = if m == p {
        // Megatron runs every forward first when there is exactly one group of micro-batches.
        total
    } else {
        (2 * (p - r - 1) + (v - 1) * p).min(total)
    };
    let mut out = Vec::with_capacity(2 * total);
    out.extend((0..warmup).map(forward));
    for i in 0..total - warmup {
        out.push(forward(warmup + i));
        out.push(backward(i));
    }
    out.extend((total - warmup..total).map(backward));
    out
}

/// The outcome of [`Schedule::simulate`]: what each rank did at each tick.
#[derive(Debug, Clone)]
pub struct Simulation {
    virtual_stages: usize,
    /// grid[rank][tick]: the action run, or `None` for an idle tick (a bubble).
    grid: Vec<Vec<Option<Action>>>,
    peak_alive: Vec<usize>,
}

impl Simulation {
    /// Ticks from the first action to the last.
    pub fn num_ticks(&self) -> usize {
        self.grid.first().map_or(0, Vec::len)
    }

    /// What `rank` did at each tick (`None` = idle).
    pub fn timeline(&self, rank: usize) -> &[Option<Action>] {
        &self.grid[rank]
    }

    /// Idle ticks of `rank` over the step's ticks.
    pub fn bubble_fraction(&self, rank: usize) -> f64 {
        let idle = self.grid[rank].iter().filter(|a| a.is_none()).count();
        idle as f64 / self.num_ticks().max(1) as f64
    }

    /// Largest number of (micro-batch, chunk) pairs whose forward ran on `rank` while their
    /// backward had not: how many activation sets the rank holds at its worst moment.
    pub fn peak_in_flight(&self, rank: usize) -> usize {
        self.peak_alive[rank]
    }

    /// The time × rank grid: one row per rank, one column per tick, `F3` / `B3` for the forward /
    /// backward of micro-batch 3 (`F3.1` through chunk 1 when interleaved), `.` for a bubble.
    pub fn render(&self) -> String {
        let label = |a: &Option<Action>| match a {
            None => ".".to_string(),
            Some(a) => {
                let kind = if a.is_forward() { 'F' } else { 'B' };
                if self.virtual_stages > 1 {
                    format!("{kind}{}.{}", a.mb(), a.chunk())
                } else {
                    format!("{kind}{}", a.mb())
                }
            }
        };
        let width = self
            .grid
            .iter()
            .flatten()
            .map(|a| label(a).len())
            .max()
            .unwrap_or(1);
        let mut out = String::new();
        for (r, row) in self.grid.iter().enumerate() {
            let cells: Vec<String> = row
                .iter()
                .map(|a| format!("{:<width$}", label(a)))
                .collect();
            out.push_str(format!("rank {r} | {}", cells.join(" ")).trim_end());
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The grids in the module documentation are exactly what the code renders today.
    #[test]
    fn doc_grids_match_the_code() {
        let source = include_str!("schedule.rs");
        let cases = [
            (ScheduleKind::GPipe, 4, 4),
            (ScheduleKind::OneFOneB, 4, 8),
            (ScheduleKind::Interleaved1F1B { virtual_stages: 2 }, 2, 4),
        ];
        for (kind, p, m) in cases {
            let grid = Schedule::new(kind, p, m)
                .unwrap()
                .simulate()
                .unwrap()
                .render();
            let as_doc: String = grid.lines().map(|l| format!("//! {l}\n")).collect();
            assert!(
                source.contains(&as_doc),
                "doc grid for {kind}, P = {p}, M = {m} is stale; now:\n{grid}"
            );
        }
    }

    /// Every schedule we can build for P ≤ 8, M ≤ 16, v ≤ 4.
    fn all_schedules() -> Vec<Schedule> {
        let mut out = Vec::new();
        for p in 1..=8 {
            for m in 1..=16 {
                out.push(Schedule::new(ScheduleKind::GPipe, p, m).unwrap());
                out.push(Schedule::new(ScheduleKind::OneFOneB, p, m).unwrap());
                for v in 1..=4 {
                    if m % p == 0 {
                        let kind = ScheduleKind::Interleaved1F1B { virtual_stages: v };
                        out.push(Schedule::new(kind, p, m).unwrap());
                    }
                }
            }
        }
        out
    }

    #[test]
    fn every_pass_runs_once_and_forward_precedes_backward() {
        for s in all_schedules() {
            let (p, m, v) = (s.num_ranks(), s.num_microbatches(), s.virtual_stages());
            for r in 0..p {
                let mut fwd_at = vec![vec![None; v]; m];
                let mut bwd_at = vec![vec![None; v]; m];
                for (i, a) in s.actions(r).iter().enumerate() {
                    let slot = if a.is_forward() {
                        &mut fwd_at
                    } else {
                        &mut bwd_at
                    };
                    let seen = slot[a.mb()][a.chunk()].replace(i);
                    assert!(
                        seen.is_none(),
                        "{} P={p} M={m} rank {r}: {a:?} twice",
                        s.kind()
                    );
                }
                for mb in 0..m {
                    for c in 0..v {
                        let (f, b) = (fwd_at[mb][c], bwd_at[mb][c]);
                        assert!(
                            f.is_some() && b.is_some(),
                            "{} P={p} M={m} rank {r}: mb {mb} chunk {c} missing",
                            s.kind()
                        );
                        assert!(f < b, "{} P={p} M={m} rank {r}: backward of mb {mb} chunk {c} before its forward", s.kind());
                    }
                }
            }
        }
    }

    #[test]
    fn simulation_finds_no_deadlock_and_the_textbook_bubble() {
        for s in all_schedules() {
            let (p, m) = (s.num_ranks(), s.num_microbatches());
            let sim = s
                .simulate()
                .unwrap_or_else(|e| panic!("{} P={p} M={m}: {e}", s.kind()));
            let analytic = s.analytic_bubble_fraction();
            for r in 0..p {
                let busy = sim.timeline(r).iter().filter(|a| a.is_some()).count();
                assert_eq!(busy, s.actions(r).len());
                let simulated = sim.bubble_fraction(r);
                // Equal unit costs: every rank idles exactly 2(P − 1) of its 2(v·M + P − 1) ticks.
                assert!(
                    (simulated - analytic).abs() < 1e-12,
                    "{} P={p} M={m} rank {r}: simulated bubble {simulated} != analytic {analytic}",
                    s.kind()
                );
            }
        }
    }

    #[test]
    fn in_flight_micro_batches_are_bounded() {
        for s in all_schedules() {
            let (p, m) = (s.num_ranks(), s.num_microbatches());
            let sim = s.simulate().unwrap();
            for r in 0..p {
                let peak = sim.peak_in_flight(r);
                match s.kind() {
                    ScheduleKind::GPipe => assert_eq!(peak, m, "GPipe P={p} M={m} rank {r}"),
                    ScheduleKind::OneFOneB => {
                        assert_eq!(peak, (p - r).min(m), "1F1B P={p} M={m} rank {r}")
                    }
                    // Megatron's warmup plus the one forward of the first steady step.
                    ScheduleKind::Interleaved1F1B { virtual_stages: v } => {
                        let warmup = if m == p {
                            v * m
                        } else {
                            2 * (p - r - 1) + (v - 1) * p
                        };
                        assert_eq!(
                            peak,
                            (warmup + 1).min(v * m),
                            "{} P={p} M={m} rank {r}",
                            s.kind()
                        )
                    }
                }
            }
        }
    }

    /// The executor sends activations and gradients over one group without tags, so between
    /// two ranks messages must be consumed in exactly the order they were sent.
    #[test]
    fn point_to_point_messages_arrive_in_the_order_they_are_consumed() {
        for s in all_schedules() {
            let p = s.num_ranks();
            // sent[src][dst] and consumed[src][dst]: (is activation, mb, receiving stage) in order.
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
            let m = s.num_microbatches();
            assert_eq!(sent, consumed, "{} P={p} M={m}", s.kind());
        }
    }

    #[test]
    fn interleaving_needs_whole_groups_of_micro_batches() {
        let err =
            Schedule::new(ScheduleKind::Interleaved1F1B { virtual_stages: 2 }, 4, 6).unwrap_err();
        assert_eq!(
            err,
            ScheduleError::MicrobatchesNotMultipleOfStages {
                stages: 4,
                microbatches: 6
            }
        );
        assert!(
            err.to_string().contains("M = 6 is not a multiple of P = 4"),
            "{err}"
        );
        assert!(Schedule::new(ScheduleKind::OneFOneB, 0, 4).is_err());
        assert!(Schedule::new(ScheduleKind::Interleaved1F1B { virtual_stages: 0 }, 2, 2).is_err());
    }

    #[test]
    fn schedule_names_parse() {
        assert_eq!("gpipe".parse(), Ok(ScheduleKind::GPipe));
        assert_eq!("1F1B".parse(), Ok(ScheduleKind::OneFOneB));
        assert_eq!(
            "interleaved:3".parse(),
            Ok(ScheduleKind::Interleaved1F1B { virtual_stages: 3 })
        );
        let err = "zero-bubble".parse::<ScheduleKind>().unwrap_err();
        assert!(
            err.to_string()
                .contains("unknown pipeline schedule `zero-bubble`"),
            "{err}"
        );
    }
}
