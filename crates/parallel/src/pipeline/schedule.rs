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
//! The schedules:
//! - **GPipe** (all-forward-all-backward): every rank runs the M forwards, then the M backwards.
//!   All M micro-batches' activations are alive at once.
//! - **1F1B** (PipeDream-Flush, Megatron's non-interleaved schedule): rank r runs
//!   `warmup = min(P − r − 1, M)` forwards, then alternates one forward and one backward, then
//!   drains the remaining `warmup` backwards. At most `warmup + 1 ≤ P − r` micro-batches are alive.
//! - **Interleaved 1F1B** (Megatron's virtual pipeline): each rank holds v chunks; forwards walk
//!   micro-batches in groups of P, chunk by chunk; `warmup = 2(P − r − 1) + (v − 1)·P`. M must be a
//!   multiple of P. The bubble shrinks by v.
//! - **ZB-H1** and **ZB-V**, the zero-bubble family: the backward split into B (the input
//!   gradient) and W (the weight gradients), the W's filling the bubbles (`zero_bubble.rs`, with
//!   their grids; [`Schedule::with_costs`] builds their orders for given pass costs,
//!   `cost_aware.rs`).
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
//! The simulation also runs on measured costs ([`Schedule::simulate_with`], seconds per pass of
//! each kind on each model stage, `simulate.rs`): the executor predicts each step's bubble with it.

mod cost_aware;
mod names;
mod placement;
mod simulate;
#[cfg(test)]
mod tests;
mod zero_bubble;

#[cfg(test)]
use cost_aware::{cost_aware, Rules};
pub use placement::StagePlacement;
pub use simulate::{PassCosts, SimSpan, Simulation};
use zero_bubble::{zb_h1, zero_bubble};

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

    /// For each chunk of rank `rank`, the index in [`Schedule::actions`] of its last backward
    /// (fused, or W): the chunk's gradients are final for the step after it.
    pub fn last_backwards(&self, rank: usize) -> Vec<Option<usize>> {
        let mut last = vec![None; self.virtual_stages()];
        for (i, a) in self.actions(rank).iter().enumerate() {
            if a.computes_weight_grads() {
                last[a.chunk()] = Some(i);
            }
        }
        last
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
