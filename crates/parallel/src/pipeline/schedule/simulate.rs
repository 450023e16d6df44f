//! The virtual clock: a schedule run with what each pass costs on each model stage, the
//! bubble and activation peak it gives, and the grid it draws.

use super::{Action, PassKind, Schedule, ScheduleError};

/// What one pass of each kind costs on one model stage, in seconds (or in ticks: the
/// simulation only adds them up).
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct PassCosts {
    pub forward: f64,
    pub backward: f64,
    pub input_grad: f64,
    pub weight_grad: f64,
}

impl PassCosts {
    /// Every pass one tick, the fused backward included: the grids of the module doc.
    pub const UNIT: PassCosts = PassCosts {
        forward: 1.0,
        backward: 1.0,
        input_grad: 1.0,
        weight_grad: 1.0,
    };

    /// F = B = W = 1, the fused backward B + W = 2: the zero-bubble paper's comparison.
    pub const EQUAL_SPLIT: PassCosts = PassCosts {
        forward: 1.0,
        backward: 2.0,
        input_grad: 1.0,
        weight_grad: 1.0,
    };

    /// One model stage's costs under `kind` from a whole stage's F, B and W (ms): a chunk of a
    /// schedule with v chunks per rank costs 1/v of each; the fused backward is B + W.
    pub fn of_stage(kind: super::ScheduleKind, [f, b, w]: [f64; 3]) -> PassCosts {
        let k = 1.0 / kind.virtual_stages() as f64;
        PassCosts {
            forward: f * k,
            backward: (b + w) * k,
            input_grad: b * k,
            weight_grad: w * k,
        }
    }

    /// Each pass kind's mean over `stages`.
    pub fn mean(stages: &[PassCosts]) -> PassCosts {
        let n = stages.len().max(1) as f64;
        let avg = |f: fn(&PassCosts) -> f64| stages.iter().map(f).sum::<f64>() / n;
        PassCosts {
            forward: avg(|c| c.forward),
            backward: avg(|c| c.backward),
            input_grad: avg(|c| c.input_grad),
            weight_grad: avg(|c| c.weight_grad),
        }
    }

    pub fn of(&self, kind: PassKind) -> f64 {
        match kind {
            PassKind::Forward => self.forward,
            PassKind::Backward => self.backward,
            PassKind::InputGrad => self.input_grad,
            PassKind::WeightGrad => self.weight_grad,
        }
    }
}

impl Schedule {
    /// Idle fraction of a step in the ideal pipeline with equal costs: (P − 1)/(v·M + P − 1)
    /// for the fused schedules (the textbook (P − 1)/(M + P − 1) when v = 1); for the split
    /// ones rank 0's simulated bubble at F = B = W.
    pub fn analytic_bubble_fraction(&self) -> f64 {
        if self.kind.splits_backward() {
            return self
                .simulate_with(&vec![PassCosts::EQUAL_SPLIT; self.num_model_stages()])
                .map_or(f64::NAN, |sim| sim.bubble_fraction(0));
        }
        let p = self.stages as f64;
        let vm = (self.virtual_stages() * self.microbatches) as f64;
        (p - 1.0) / (vm + p - 1.0)
    }

    /// [`Self::simulate_with`] every pass one tick ([`PassCosts::UNIT`]): the grids of
    /// `schedule.rs`.
    pub fn simulate(&self) -> Result<Simulation, ScheduleError> {
        self.simulate_with(&vec![PassCosts::UNIT; self.num_model_stages()])
    }

    /// Run every rank's list on a virtual clock, `costs[s]` giving what each pass of model
    /// stage `s` takes. A rank runs its actions in order, each as soon as the rank is free and
    /// its input exists: a forward of micro-batch i on stage s once stage s − 1 finished its
    /// forward of i; a backward or B once stage s + 1 produced the input gradient of i; a W once
    /// its own B finished. Messages take no time. Fails with [`ScheduleError::Deadlock`] if
    /// work remains that no rank can start.
    pub fn simulate_with(&self, costs: &[PassCosts]) -> Result<Simulation, ScheduleError> {
        let mut clock = Clock::new(self, costs)?;
        let p = self.stages;
        let mut free = vec![0.0f64; p];
        loop {
            let mut moved = false;
            for r in 0..p {
                while let Some(&action) = self.actions[r].get(clock.next[r]) {
                    let Some(ready) = clock.ready(self, r, &action) else { break };
                    let start = free[r].max(ready);
                    let stage = self.model_stage(r, action.chunk());
                    let end = start + costs[stage].of(action.kind());
                    clock.record(r, stage, action, start, end);
                    free[r] = end;
                    moved = true;
                }
            }
            if clock.done(self) {
                break;
            }
            if !moved {
                return Err(clock.deadlock(self));
            }
        }
        Ok(clock.finish(self))
    }

    /// [`Self::simulate_with`] on ranks that share `cores` cores: while `n` passes run at once,
    /// each advances at `min(1, cores / n)` of its own speed (processor sharing), so a pass
    /// on the critical path stretches while the other ranks are busy, and runs at full speed
    /// in the fill and the drain, where fewer ranks than cores have work.
    ///
    /// ```text
    ///   4 ranks, 2 cores:  fill: 1, 2 busy → speed 1   steady: 4 busy → speed ½   drain: speed 1
    /// ```
    ///
    /// `cores` may be fractional: a pipeline replica's part of a node whose cores several
    /// replicas share.
    pub fn simulate_shared(
        &self,
        costs: &[PassCosts],
        cores: f64,
    ) -> Result<Simulation, ScheduleError> {
        let mut clock = Clock::new(self, costs)?;
        let p = self.stages;
        // Per rank: the pass it runs, its model stage, start and work left (at full speed).
        let mut running: Vec<Option<(Action, usize, f64, f64)>> = vec![None; p];
        let mut now = 0.0f64;
        loop {
            for (r, slot) in running.iter_mut().enumerate() {
                if slot.is_some() {
                    continue;
                }
                let Some(&action) = self.actions[r].get(clock.next[r]) else { continue };
                if clock.ready(self, r, &action).is_some() {
                    let stage = self.model_stage(r, action.chunk());
                    *slot = Some((action, stage, now, costs[stage].of(action.kind())));
                }
            }
            let busy = running.iter().flatten().count();
            if busy == 0 {
                if clock.done(self) {
                    break;
                }
                return Err(clock.deadlock(self));
            }
            let speed = (cores / busy as f64).min(1.0);
            let least = running.iter().flatten().map(|x| x.3).fold(f64::INFINITY, f64::min);
            now += least / speed;
            for (r, slot) in running.iter_mut().enumerate() {
                let Some((action, stage, start, left)) = *slot else { continue };
                if left <= least * (1.0 + 1e-12) {
                    clock.record(r, stage, action, start, now);
                    *slot = None;
                } else {
                    *slot = Some((action, stage, start, left - least));
                }
            }
        }
        Ok(clock.finish(self))
    }
}

/// The state of a simulation: when each pass of (stage, micro-batch) ended, each rank's next
/// action, its passes so far and its activation sets in flight.
struct Clock {
    fwd_end: Vec<Vec<Option<f64>>>,
    /// The input gradient (fused backward or B).
    grad_end: Vec<Vec<Option<f64>>>,
    next: Vec<usize>,
    spans: Vec<Vec<SimSpan>>,
    alive: Vec<usize>,
    peak_alive: Vec<usize>,
}

impl Clock {
    fn new(sched: &Schedule, costs: &[PassCosts]) -> Result<Clock, ScheduleError> {
        let (p, m, s) = (sched.stages, sched.microbatches, sched.num_model_stages());
        if costs.len() != s {
            return Err(ScheduleError::Costs {
                expected: s,
                got: costs.len(),
            });
        }
        Ok(Clock {
            fwd_end: vec![vec![None; m]; s],
            grad_end: vec![vec![None; m]; s],
            next: vec![0; p],
            spans: vec![Vec::new(); p],
            alive: vec![0; p],
            peak_alive: vec![0; p],
        })
    }

    /// When `action`'s input exists, if it does yet: a forward of micro-batch i on stage s
    /// once stage s − 1 finished its forward of i; a backward or B once stage s + 1 produced
    /// the input gradient of i (and its own forward ran); a W once its own B finished.
    fn ready(&self, sched: &Schedule, r: usize, action: &Action) -> Option<f64> {
        let stage = sched.model_stage(r, action.chunk());
        let mb = action.mb();
        match action {
            Action::Forward { .. } => match sched.input_stage(r, action) {
                None => Some(0.0),
                Some(from) => self.fwd_end[from][mb],
            },
            Action::Backward { .. } | Action::InputGrad { .. } => {
                let own = self.fwd_end[stage][mb];
                match sched.input_stage(r, action) {
                    None => own,
                    Some(from) => own.and(self.grad_end[from][mb]),
                }
            }
            // Its own B ran earlier on this rank, or the order is wrong.
            Action::WeightGrad { .. } => self.grad_end[stage][mb],
        }
    }

    /// Rank `r` ran `action` of model stage `stage` from `start` to `end`.
    fn record(&mut self, r: usize, stage: usize, action: Action, start: f64, end: f64) {
        let mb = action.mb();
        match action {
            Action::Forward { .. } => self.fwd_end[stage][mb] = Some(end),
            Action::Backward { .. } | Action::InputGrad { .. } => {
                self.grad_end[stage][mb] = Some(end)
            }
            Action::WeightGrad { .. } => {}
        }
        if action.is_forward() {
            self.alive[r] += 1;
            self.peak_alive[r] = self.peak_alive[r].max(self.alive[r]);
        } else if action.computes_weight_grads() {
            self.alive[r] -= 1;
        }
        self.spans[r].push(SimSpan { action, start, end });
        self.next[r] += 1;
    }

    fn done(&self, sched: &Schedule) -> bool {
        (0..sched.stages).all(|r| self.next[r] >= sched.actions[r].len())
    }

    fn deadlock(&self, sched: &Schedule) -> ScheduleError {
        let blocked = (0..sched.stages)
            .filter_map(|r| {
                sched.actions[r]
                    .get(self.next[r])
                    .map(|a| format!("rank {r}: {a:?}"))
            })
            .collect::<Vec<_>>()
            .join(", ");
        ScheduleError::Deadlock {
            passes_done: self.next.iter().sum(),
            blocked,
        }
    }

    fn finish(self, sched: &Schedule) -> Simulation {
        // The grid's column: the shortest pass that ran.
        let unit = self
            .spans
            .iter()
            .flatten()
            .map(|sp| sp.end - sp.start)
            .filter(|&d| d > 0.0)
            .fold(f64::INFINITY, f64::min);
        let makespan = self
            .spans
            .iter()
            .filter_map(|s| s.last().map(|sp| sp.end))
            .fold(0.0, f64::max);
        Simulation {
            virtual_stages: sched.virtual_stages(),
            makespan,
            unit: if unit.is_finite() { unit } else { 1.0 },
            spans: self.spans,
            peak_alive: self.peak_alive,
        }
    }
}

/// One pass on the virtual clock of [`Schedule::simulate_with`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimSpan {
    pub action: Action,
    pub start: f64,
    pub end: f64,
}

/// The outcome of [`Schedule::simulate_with`]: when each rank ran each pass.
#[derive(Debug, Clone)]
pub struct Simulation {
    virtual_stages: usize,
    /// spans[rank]: the rank's passes, in order.
    spans: Vec<Vec<SimSpan>>,
    /// When the last pass of any rank ended (every rank starts at 0).
    makespan: f64,
    /// The grid's column width: the shortest pass.
    unit: f64,
    peak_alive: Vec<usize>,
}

impl Simulation {
    /// Columns of the grid from the first pass to the last (ticks, with [`PassCosts::UNIT`]).
    pub fn num_ticks(&self) -> usize {
        (self.makespan / self.unit).round() as usize
    }

    /// The step's length on the virtual clock.
    pub fn makespan(&self) -> f64 {
        self.makespan
    }

    /// `rank`'s passes with their start and end.
    pub fn spans(&self, rank: usize) -> &[SimSpan] {
        &self.spans[rank]
    }

    /// What `rank` ran in each column of the grid (`None` = idle; a pass longer than a column
    /// fills several).
    pub fn timeline(&self, rank: usize) -> Vec<Option<Action>> {
        let mut row = vec![None; self.num_ticks()];
        for sp in &self.spans[rank] {
            let from = (sp.start / self.unit).round() as usize;
            let to = ((sp.end / self.unit).round() as usize).min(row.len());
            for cell in &mut row[from..to] {
                *cell = Some(sp.action);
            }
        }
        row
    }

    fn busy(&self, rank: usize) -> f64 {
        self.spans[rank].iter().map(|sp| sp.end - sp.start).sum()
    }

    /// The bubble of the pipeline as a whole, seen from `rank`: its idle time over the step
    /// (every rank's step ends with the last pass of any rank).
    pub fn bubble_fraction(&self, rank: usize) -> f64 {
        let t = self.makespan.max(f64::MIN_POSITIVE);
        (t - self.busy(rank)) / t
    }

    /// `rank`'s own bubble: its idle time over its own step, from 0 to the end of its last
    /// pass. What [`crate::pipeline::StepReport::bubble_fraction`] measures: a rank's clock
    /// stops at its last pass (and the sends it waits for), not at the pipeline's.
    pub fn rank_bubble_fraction(&self, rank: usize) -> f64 {
        let end = self.spans[rank].last().map_or(0.0, |sp| sp.end);
        let t = end.max(f64::MIN_POSITIVE);
        (t - self.busy(rank)) / t
    }

    /// Largest number of (micro-batch, chunk) pairs whose forward ran on `rank` while their
    /// weight gradients (fused backward or W) had not: how many activation sets the rank holds
    /// at its worst moment.
    pub fn peak_in_flight(&self, rank: usize) -> usize {
        self.peak_alive[rank]
    }

    /// The time × rank grid: one row per rank, one column per shortest pass, `F3` / `B3` / `W3`
    /// for the forward / backward (or B) / W of micro-batch 3 (`F3.1` through chunk 1 when a
    /// rank holds several), `-` where a longer pass goes on, `.` for a bubble.
    pub fn render(&self) -> String {
        let rows: Vec<Vec<String>> = (0..self.spans.len())
            .map(|r| {
                let mut prev = None;
                self.timeline(r)
                    .into_iter()
                    .map(|a| {
                        let cell = match a {
                            None => ".".to_string(),
                            Some(a) if prev == Some(a) => "-".to_string(),
                            Some(a) => label(&a, self.virtual_stages),
                        };
                        prev = a;
                        cell
                    })
                    .collect()
            })
            .collect();
        let width = rows.iter().flatten().map(String::len).max().unwrap_or(1);
        let mut out = String::new();
        for (r, row) in rows.iter().enumerate() {
            let cells: Vec<String> = row.iter().map(|c| format!("{c:<width$}")).collect();
            out.push_str(format!("rank {r} | {}", cells.join(" ")).trim_end());
            out.push('\n');
        }
        out
    }
}

/// The grid's label of `a`: `F3`, `B3` (the fused backward, or B of a split one: a grid holds
/// one or the other), `W3`; `F3.1` through chunk 1 when a rank holds several chunks.
fn label(a: &Action, chunks: usize) -> String {
    let kind = match a.kind() {
        PassKind::Forward => 'F',
        PassKind::Backward | PassKind::InputGrad => 'B',
        PassKind::WeightGrad => 'W',
    };
    if chunks > 1 {
        format!("{kind}{}.{}", a.mb(), a.chunk())
    } else {
        format!("{kind}{}", a.mb())
    }
}
