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
//! With every forward and every backward (fused, B or W) taking one tick, and a stage starting a micro-batch's
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
//!
//! The simulation also runs on measured costs ([`Schedule::simulate_with`], seconds per pass of
//! each kind on each model stage): the executor predicts each step's bubble with it
//! (`executor.rs`).

use std::collections::VecDeque;
use std::fmt;

/// Which schedule to build. Written `gpipe`, `1f1b`, `interleaved:V` (V virtual stages per
/// rank), `zb-h1` or `zb-v` on a command line; in TOML `"gpipe"`, `"1f1b"`,
/// `{ interleaved_1f1b = { virtual_stages = 2 } }`, `"zb_h1"` or `"zb_v"`.
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
    /// Zero bubble, 1F1B's memory: the backward split into B and W, the W's filling bubbles.
    #[serde(rename = "zb_h1")]
    ZeroBubbleH1,
    /// Zero bubble in a V: rank r holds model stages r and 2P − 1 − r, the backward split.
    #[serde(rename = "zb_v")]
    ZeroBubbleV,
}

impl ScheduleKind {
    /// Model chunks (virtual stages) each rank holds.
    pub fn virtual_stages(&self) -> usize {
        match self {
            ScheduleKind::Interleaved1F1B { virtual_stages } => *virtual_stages,
            ScheduleKind::ZeroBubbleV => 2,
            _ => 1,
        }
    }

    /// Whether the schedule runs the backward as two passes, B (input gradient) and W (weight
    /// gradients), instead of one fused backward.
    pub fn splits_backward(&self) -> bool {
        matches!(self, ScheduleKind::ZeroBubbleH1 | ScheduleKind::ZeroBubbleV)
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
            ScheduleKind::ZeroBubbleH1 => f.write_str("ZB-H1"),
            ScheduleKind::ZeroBubbleV => f.write_str("ZB-V"),
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
            "zb-h1" => Ok(ScheduleKind::ZeroBubbleH1),
            "zb-v" => Ok(ScheduleKind::ZeroBubbleV),
            other => {
                let v = other.strip_prefix("interleaved:").ok_or_else(bad)?;
                let virtual_stages = v.parse().map_err(|_| bad())?;
                Ok(ScheduleKind::Interleaved1F1B { virtual_stages })
            }
        }
    }
}

/// One unit of work on one rank: a pass of micro-batch `mb` through the rank's model chunk
/// `chunk` (0 unless the rank holds several).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// F: the forward.
    Forward { mb: usize, chunk: usize },
    /// The fused backward: the input gradient and the weight gradients in one pass.
    Backward { mb: usize, chunk: usize },
    /// B of a split backward: the input gradient only, the one the previous stage waits for.
    InputGrad { mb: usize, chunk: usize },
    /// W of a split backward: the weight gradients, which nobody waits for; frees the
    /// micro-batch's activations.
    WeightGrad { mb: usize, chunk: usize },
}

/// The kinds of pass, to key their costs ([`PassCosts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PassKind {
    Forward,
    Backward,
    InputGrad,
    WeightGrad,
}

impl Action {
    pub fn mb(&self) -> usize {
        match *self {
            Action::Forward { mb, .. }
            | Action::Backward { mb, .. }
            | Action::InputGrad { mb, .. }
            | Action::WeightGrad { mb, .. } => mb,
        }
    }

    pub fn chunk(&self) -> usize {
        match *self {
            Action::Forward { chunk, .. }
            | Action::Backward { chunk, .. }
            | Action::InputGrad { chunk, .. }
            | Action::WeightGrad { chunk, .. } => chunk,
        }
    }

    pub fn kind(&self) -> PassKind {
        match self {
            Action::Forward { .. } => PassKind::Forward,
            Action::Backward { .. } => PassKind::Backward,
            Action::InputGrad { .. } => PassKind::InputGrad,
            Action::WeightGrad { .. } => PassKind::WeightGrad,
        }
    }

    pub fn is_forward(&self) -> bool {
        matches!(self, Action::Forward { .. })
    }

    /// Whether the pass produces the input gradient (the fused backward or B).
    pub fn computes_input_grad(&self) -> bool {
        matches!(self, Action::Backward { .. } | Action::InputGrad { .. })
    }

    /// Whether the pass produces the weight gradients and frees the activations (the fused
    /// backward or W).
    pub fn computes_weight_grads(&self) -> bool {
        matches!(self, Action::Backward { .. } | Action::WeightGrad { .. })
    }

    /// The grid's label: `F3`, `B3` (the fused backward, or B of a split one: a grid holds one
    /// or the other), `W3`; `F3.1` through chunk 1 when a rank holds several chunks.
    fn label(&self, chunks: usize) -> String {
        let kind = match self.kind() {
            PassKind::Forward => 'F',
            PassKind::Backward | PassKind::InputGrad => 'B',
            PassKind::WeightGrad => 'W',
        };
        if chunks > 1 {
            format!("{kind}{}.{}", self.mb(), self.chunk())
        } else {
            format!("{kind}{}", self.mb())
        }
    }
}

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

    pub fn of(&self, kind: PassKind) -> f64 {
        match kind {
            PassKind::Forward => self.forward,
            PassKind::Backward => self.backward,
            PassKind::InputGrad => self.input_grad,
            PassKind::WeightGrad => self.weight_grad,
        }
    }
}

/// Errors building or simulating a schedule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("unknown pipeline schedule `{0}` (expected gpipe, 1f1b, interleaved:V with V virtual stages per rank, zb-h1 or zb-v)")]
    UnknownKind(String),

    #[error("a pipeline needs at least one stage and one micro-batch, got P = {stages}, M = {microbatches}")]
    Empty { stages: usize, microbatches: usize },

    #[error("interleaved 1F1B needs at least one virtual stage per rank, got v = 0")]
    NoVirtualStages,

    #[error("interleaved 1F1B needs the micro-batch count to be a multiple of the pipeline size: M = {microbatches} is not a multiple of P = {stages}")]
    MicrobatchesNotMultipleOfStages { stages: usize, microbatches: usize },

    #[error("schedule deadlocks after {passes_done} passes: ranks are blocked at {blocked}")]
    Deadlock { passes_done: usize, blocked: String },

    #[error(
        "the simulation needs the pass costs of each of the {expected} model stages, got {got}"
    )]
    Costs { expected: usize, got: usize },
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
        let mut s = Self {
            kind,
            stages,
            microbatches,
            actions: Vec::new(),
        };
        s.actions = match kind {
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
            // 1F1B's peak: P − r micro-batches alive on rank r.
            ScheduleKind::ZeroBubbleH1 => (0..stages)
                .map(|r| zb_h1(stages, r, microbatches))
                .collect(),
            // P per chunk: 2P half-sized activations, what 1F1B's rank 0 holds in P full ones.
            ScheduleKind::ZeroBubbleV => zero_bubble(&s, &|_| stages)?,
        };
        Ok(s)
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

    /// The placement: the model stage that chunk `chunk` of pipeline rank `rank` runs.
    /// `chunk·P + rank` (Megatron's loop), except ZB-V's V: chunk 0 is stage `rank`, chunk 1
    /// stage `2P − 1 − rank`, so rank 0 holds both the first and the last stage.
    pub fn model_stage(&self, rank: usize, chunk: usize) -> usize {
        match self.kind {
            ScheduleKind::ZeroBubbleV if chunk == 1 => 2 * self.stages - 1 - rank,
            _ => chunk * self.stages + rank,
        }
    }

    /// The pipeline rank that runs model stage `stage` (the inverse of [`Self::model_stage`]).
    pub fn rank_of_stage(&self, stage: usize) -> usize {
        let p = self.stages;
        match self.kind {
            ScheduleKind::ZeroBubbleV if stage >= p => 2 * p - 1 - stage,
            _ => stage % p,
        }
    }

    /// The chunk of its rank that model stage `stage` is.
    pub fn chunk_of_stage(&self, stage: usize) -> usize {
        stage / self.stages
    }

    /// The model stages pipeline rank `rank` holds, by chunk.
    pub fn stages_of_rank(&self, rank: usize) -> Vec<usize> {
        (0..self.virtual_stages())
            .map(|c| self.model_stage(rank, c))
            .collect()
    }

    /// The model stage whose result `action` on `rank` consumes: the previous stage's activation
    /// for a forward, the next stage's input gradient for a backward or B; `None` at the
    /// pipeline's ends (the first stage reads the batch, the last stage starts backward from its
    /// loss) and for W, which needs only this stage's own B.
    pub fn input_stage(&self, rank: usize, action: &Action) -> Option<usize> {
        let stage = self.model_stage(rank, action.chunk());
        match action {
            Action::Forward { .. } => stage.checked_sub(1),
            Action::Backward { .. } | Action::InputGrad { .. } => {
                Some(stage + 1).filter(|&s| s < self.num_model_stages())
            }
            Action::WeightGrad { .. } => None,
        }
    }

    /// The model stage that consumes what `action` on `rank` produces: the next stage for a
    /// forward, the previous one for a backward or B; `None` at the pipeline's ends and for W.
    pub fn output_stage(&self, rank: usize, action: &Action) -> Option<usize> {
        let stage = self.model_stage(rank, action.chunk());
        match action {
            Action::Forward { .. } => Some(stage + 1).filter(|&s| s < self.num_model_stages()),
            Action::Backward { .. } | Action::InputGrad { .. } => stage.checked_sub(1),
            Action::WeightGrad { .. } => None,
        }
    }

    /// The ordered actions of pipeline rank `rank` (panics if `rank ≥ P`, a programming error).
    pub fn actions(&self, rank: usize) -> &[Action] {
        &self.actions[rank]
    }

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

    /// [`Self::simulate_with`] every pass one tick ([`PassCosts::UNIT`]): the grids above.
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
        let (p, m, s) = (self.stages, self.microbatches, self.num_model_stages());
        if costs.len() != s {
            return Err(ScheduleError::Costs {
                expected: s,
                got: costs.len(),
            });
        }
        // The time each pass of (stage, micro-batch) ended.
        let mut fwd_end = vec![vec![None::<f64>; m]; s];
        let mut grad_end = vec![vec![None::<f64>; m]; s]; // the input gradient (fused or B)
        let mut next = vec![0usize; p];
        let mut free = vec![0.0f64; p];
        let mut spans: Vec<Vec<SimSpan>> = vec![Vec::new(); p];
        let mut alive = vec![0usize; p];
        let mut peak_alive = vec![0usize; p];
        loop {
            let mut moved = false;
            for r in 0..p {
                while let Some(&action) = self.actions[r].get(next[r]) {
                    let stage = self.model_stage(r, action.chunk());
                    let mb = action.mb();
                    let input = match action {
                        Action::Forward { .. } => match self.input_stage(r, &action) {
                            None => Some(0.0),
                            Some(from) => fwd_end[from][mb],
                        },
                        Action::Backward { .. } | Action::InputGrad { .. } => {
                            let own = fwd_end[stage][mb];
                            match self.input_stage(r, &action) {
                                None => own,
                                Some(from) => own.and(grad_end[from][mb]),
                            }
                        }
                        // Its own B ran earlier on this rank, or the order is wrong.
                        Action::WeightGrad { .. } => grad_end[stage][mb],
                    };
                    let Some(ready) = input else { break };
                    let start = free[r].max(ready);
                    let end = start + costs[stage].of(action.kind());
                    match action {
                        Action::Forward { .. } => fwd_end[stage][mb] = Some(end),
                        Action::Backward { .. } | Action::InputGrad { .. } => {
                            grad_end[stage][mb] = Some(end)
                        }
                        Action::WeightGrad { .. } => {}
                    }
                    if action.is_forward() {
                        alive[r] += 1;
                        peak_alive[r] = peak_alive[r].max(alive[r]);
                    } else if action.computes_weight_grads() {
                        alive[r] -= 1;
                    }
                    spans[r].push(SimSpan { action, start, end });
                    free[r] = end;
                    next[r] += 1;
                    moved = true;
                }
            }
            let remaining = (0..p).any(|r| next[r] < self.actions[r].len());
            if !remaining {
                break;
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
                return Err(ScheduleError::Deadlock {
                    passes_done: next.iter().sum(),
                    blocked,
                });
            }
        }
        // The grid's column: the shortest pass that ran.
        let unit = spans
            .iter()
            .flatten()
            .map(|sp| sp.end - sp.start)
            .filter(|&d| d > 0.0)
            .fold(f64::INFINITY, f64::min);
        Ok(Simulation {
            virtual_stages: self.virtual_stages(),
            makespan: free.iter().copied().fold(0.0, f64::max),
            unit: if unit.is_finite() { unit } else { 1.0 },
            spans,
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

/// ZB-H1 on rank `r` of `p`: 1F1B's order with each backward split into B and W, and rank r
/// holding back its first `r` W's: the last ranks, which 1F1B leaves idle at the end of the step,
/// run their owed W's there, and in the cooldown every rank runs a W after each B, in the gap
/// where it waits for the next input gradient. Rank r's peak is `warmup + 1 + r = P` micro-batches
/// (`min(P, M)`), 1F1B's peak (its rank 0's).
fn zb_h1(p: usize, r: usize, m: usize) -> Vec<Action> {
    let warmup = (p - r - 1).min(m);
    let mut out = Vec::with_capacity(3 * m);
    let mut owed = VecDeque::new();
    let w = |mb| Action::WeightGrad { mb, chunk: 0 };
    out.extend((0..warmup).map(|mb| Action::Forward { mb, chunk: 0 }));
    for i in 0..m - warmup {
        out.push(Action::Forward {
            mb: warmup + i,
            chunk: 0,
        });
        out.push(Action::InputGrad { mb: i, chunk: 0 });
        owed.push_back(i);
        if owed.len() > r {
            out.extend(owed.pop_front().map(w));
        }
    }
    for mb in m - warmup..m {
        out.push(Action::InputGrad { mb, chunk: 0 });
        owed.push_back(mb);
        out.extend(owed.pop_front().map(w));
    }
    out.extend(owed.into_iter().map(w));
    out
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
fn zero_bubble(
    s: &Schedule,
    cap: &dyn Fn(usize) -> usize,
) -> Result<Vec<Vec<Action>>, ScheduleError> {
    let (p, m, v, n) = (
        s.stages,
        s.microbatches,
        s.virtual_stages(),
        s.num_model_stages(),
    );
    // The tick F (B) of (stage, micro-batch) ran in.
    let mut f_at = vec![vec![None::<usize>; m]; n];
    let mut b_at = vec![vec![None::<usize>; m]; n];
    let mut next_f = vec![vec![0usize; v]; p];
    let mut next_b = vec![vec![0usize; v]; p];
    let mut owed_w: Vec<VecDeque<(usize, usize)>> = vec![VecDeque::new(); p];
    let mut alive = vec![vec![0usize; v]; p];
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
                let mb = next_b[r][c];
                if mb < m && before(f_at[stage][mb]) {
                    let fed = stage + 1 == n
                        || (before(b_at[stage + 1][mb]) && at_head(stage + 1, (false, mb, stage)));
                    if fed {
                        bs.push((mb, stage, c));
                    }
                }
                let mb = next_f[r][c];
                // Room on this rank, counting the activations already on their way to it (less
                // the one this F consumes), and on the rank it sends to: a rank never has to
                // refuse an activation at the head of a channel, so channels never block.
                let consumes = stage > 0 && s.rank_of_stage(stage - 1) != r;
                let room = alive[r][c] + incoming[r][c] - usize::from(consumes) < cap(r);
                let to = (stage + 1 < n)
                    .then(|| (s.rank_of_stage(stage + 1), s.chunk_of_stage(stage + 1)));
                let room_there =
                    to.is_none_or(|(q, d)| q == r || alive[q][d] + incoming[q][d] < cap(q));
                if mb < m && room && room_there {
                    let fed = stage == 0
                        || (before(f_at[stage - 1][mb]) && at_head(stage - 1, (true, mb, stage)));
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
                owed_w[r]
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
            match a {
                Action::Forward { .. } => {
                    f_at[stage][mb] = Some(tick);
                    next_f[r][c] += 1;
                    alive[r][c] += 1;
                }
                Action::InputGrad { .. } => {
                    b_at[stage][mb] = Some(tick);
                    next_b[r][c] += 1;
                    owed_w[r].push_back((mb, c));
                }
                _ => {
                    owed_w[r].pop_front();
                    alive[r][c] -= 1;
                }
            }
            out[r].push(a);
        }
        tick += 1;
    }
    Ok(out)
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
                            Some(a) => a.label(self.virtual_stages),
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
            (ScheduleKind::ZeroBubbleH1, 4, 8),
            (ScheduleKind::ZeroBubbleV, 2, 4),
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
                out.push(Schedule::new(ScheduleKind::ZeroBubbleH1, p, m).unwrap());
                out.push(Schedule::new(ScheduleKind::ZeroBubbleV, p, m).unwrap());
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

    /// Every (micro-batch, chunk) gets one F and either one fused backward or one B and one W,
    /// in the order F, then B, then W.
    #[test]
    fn every_pass_runs_once_and_forward_precedes_b_precedes_w() {
        for s in all_schedules() {
            let (p, m, v) = (s.num_ranks(), s.num_microbatches(), s.virtual_stages());
            let split = s.kind().splits_backward();
            for r in 0..p {
                // at[kind][mb][chunk]: where in the rank's list the pass is.
                let mut at = vec![vec![vec![None; v]; m]; 4];
                for (i, a) in s.actions(r).iter().enumerate() {
                    let seen = at[a.kind() as usize][a.mb()][a.chunk()].replace(i);
                    assert!(
                        seen.is_none(),
                        "{} P={p} M={m} rank {r}: {a:?} twice",
                        s.kind()
                    );
                }
                for mb in 0..m {
                    for c in 0..v {
                        let [f, fused, b, w] = [0, 1, 2, 3].map(|k| at[k][mb][c]);
                        let what = format!("{} P={p} M={m} rank {r} mb {mb} chunk {c}", s.kind());
                        assert!(f.is_some(), "{what}: no forward");
                        if split {
                            assert!(
                                fused.is_none() && b.is_some() && w.is_some(),
                                "{what}: not split"
                            );
                            assert!(f < b && b < w, "{what}: not F, B, W in order");
                        } else {
                            assert!(
                                fused.is_some() && b.is_none() && w.is_none(),
                                "{what}: not fused"
                            );
                            assert!(f < fused, "{what}: backward before its forward");
                        }
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
            if s.kind().splits_backward() {
                continue; // their bubbles: `zero_bubble_schedules_shrink_the_bubble`
            }
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
                    // 1F1B's peak (its rank 0's) on every rank, and 2P half-sized chunks for the V.
                    ScheduleKind::ZeroBubbleH1 => {
                        assert!(peak <= p.min(m), "ZB-H1 P={p} M={m} rank {r}: {peak}")
                    }
                    ScheduleKind::ZeroBubbleV => {
                        assert!(peak <= 2 * p, "ZB-V P={p} M={m} rank {r}: {peak}")
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
        assert_eq!("zb-h1".parse(), Ok(ScheduleKind::ZeroBubbleH1));
        assert_eq!("ZB-V".parse(), Ok(ScheduleKind::ZeroBubbleV));
        let err = "zero-bubble".parse::<ScheduleKind>().unwrap_err();
        assert!(
            err.to_string()
                .contains("unknown pipeline schedule `zero-bubble`"),
            "{err}"
        );
    }

    /// ZB-V's placement is a V: rank r holds stages r and 2P − 1 − r, and the placement's
    /// inverse agrees with it for every schedule.
    #[test]
    fn placement_is_a_method_of_the_schedule() {
        let v = Schedule::new(ScheduleKind::ZeroBubbleV, 4, 8).unwrap();
        assert_eq!(v.stages_of_rank(0), vec![0, 7]);
        assert_eq!(v.stages_of_rank(3), vec![3, 4]);
        let i = Schedule::new(ScheduleKind::Interleaved1F1B { virtual_stages: 2 }, 4, 8).unwrap();
        assert_eq!(i.stages_of_rank(0), vec![0, 4]);
        for s in all_schedules() {
            for r in 0..s.num_ranks() {
                for c in 0..s.virtual_stages() {
                    let stage = s.model_stage(r, c);
                    assert_eq!(s.rank_of_stage(stage), r, "{}", s.kind());
                    assert_eq!(s.chunk_of_stage(stage), c, "{}", s.kind());
                }
            }
        }
    }

    /// The virtual clock in seconds against a timeline worked out by hand: 1F1B, P = 2, M = 2,
    /// rank 0 (stage 0) F = 1, B = 2; rank 1 (stage 1, with the head) F = 3, B = 4.
    ///
    /// ```text
    ///   rank 0: F0 [0,1]  F1 [1,2]  .. B0 [8,10]  .. B1 [15,17]
    ///   rank 1: .. F0 [1,4]  B0 [4,8]  F1 [8,11]  B1 [11,15]
    /// ```
    /// Rank 0 is busy 6 of 17: bubble 11/17; rank 1 busy 14, idle 1 before its first pass and
    /// 2 after its last: 3/17 of the pipeline's step, 1/15 of its own.
    #[test]
    fn the_simulation_with_costs_matches_a_hand_computed_timeline() {
        let s = Schedule::new(ScheduleKind::OneFOneB, 2, 2).unwrap();
        let cost = |f, b| PassCosts {
            forward: f,
            backward: b,
            ..PassCosts::default()
        };
        let sim = s.simulate_with(&[cost(1.0, 2.0), cost(3.0, 4.0)]).unwrap();
        let times = |r: usize| -> Vec<(f64, f64)> {
            sim.spans(r).iter().map(|sp| (sp.start, sp.end)).collect()
        };
        assert_eq!(
            times(0),
            vec![(0.0, 1.0), (1.0, 2.0), (8.0, 10.0), (15.0, 17.0)]
        );
        assert_eq!(
            times(1),
            vec![(1.0, 4.0), (4.0, 8.0), (8.0, 11.0), (11.0, 15.0)]
        );
        assert_eq!(sim.makespan(), 17.0);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(sim.bubble_fraction(0), 11.0 / 17.0));
        assert!(close(sim.rank_bubble_fraction(0), 11.0 / 17.0));
        assert!(close(sim.bubble_fraction(1), 3.0 / 17.0));
        assert!(close(sim.rank_bubble_fraction(1), 1.0 / 15.0));
        assert!(matches!(
            s.simulate_with(&[PassCosts::UNIT]),
            Err(ScheduleError::Costs {
                expected: 2,
                got: 1
            })
        ));
    }

    /// The pipeline's bubble (rank 0) at P ranks, M = 8, with every stage costing `costs`.
    fn bubble(kind: ScheduleKind, p: usize, costs: PassCosts) -> f64 {
        let s = Schedule::new(kind, p, 8).unwrap();
        let sim = s.simulate_with(&vec![costs; s.num_model_stages()]).unwrap();
        (0..p).map(|r| sim.bubble_fraction(r)).fold(0.0, f64::max)
    }

    /// At F = B = W (the fused backward B + W) and M = 8, the worst rank's bubble:
    ///
    /// ```text
    ///          1F1B    ZB-H1   ZB-V
    ///   P = 2  0.111   0.040   0.020
    ///   P = 4  0.273   0.111   0.059
    /// ```
    /// ZB-H1 keeps at most half of 1F1B's bubble and ZB-V at most a quarter. With F : B : W =
    /// 1 : 1.6 : 0.6 (W shorter than F, as the orders do not assume) no bound is asserted; the
    /// figures (printed) are 0.072 and 0.144 at P = 2, 0.190 and 0.212 at P = 4.
    #[test]
    fn zero_bubble_schedules_shrink_the_bubble() {
        let measured_like = PassCosts {
            forward: 1.0,
            backward: 2.2,
            input_grad: 1.6,
            weight_grad: 0.6,
        };
        for costs in [PassCosts::EQUAL_SPLIT, measured_like] {
            for p in [2, 4] {
                let base = bubble(ScheduleKind::OneFOneB, p, costs);
                let h1 = bubble(ScheduleKind::ZeroBubbleH1, p, costs);
                let v = bubble(ScheduleKind::ZeroBubbleV, p, costs);
                eprintln!("P = {p}, {costs:?}: 1F1B {base:.3}, ZB-H1 {h1:.3}, ZB-V {v:.3}");
                if costs == PassCosts::EQUAL_SPLIT {
                    assert!(
                        h1 <= base / 2.0,
                        "P = {p}: ZB-H1 {h1} > half of 1F1B's {base}"
                    );
                    assert!(
                        v <= base / 4.0,
                        "P = {p}: ZB-V {v} > a quarter of 1F1B's {base}"
                    );
                }
            }
        }
    }
}
