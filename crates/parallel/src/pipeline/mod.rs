//! Pipeline parallelism: the model's segments are cut into consecutive stages, one (or, when
//! interleaved, v) per pipeline rank, and micro-batches flow through them.
//!
//! ```text
//!            stage 0              stage 1              stage 2              stage 3
//!   idx ─> [emb, h.0] ─act─> [h.1, h.2] ─act─> [h.3, h.4] ─act─> [h.5, head] ─> loss
//!              <─grad─             <─grad─             <─grad─
//!   wte.weight lives on stage 0 (embedding) and stage 3 (tied LM head): its gradient is summed
//! ```
//!
//! - [`schedule`]: which passes each rank runs, in which order (GPipe, 1F1B, interleaved 1F1B,
//!   and the split-backward ZB-H1 and ZB-V, by a unit clock or built for given pass costs) and
//!   which model stages it holds, as plain data, with a virtual-clock simulation on per-stage
//!   pass costs and the grid renderer.
//! - [`stage`]: how blocks are split across stages, and the tied embedding/head gradient.
//! - [`executor`]: runs one rank's actions (a split backward's B and W as two engine calls)
//!   with asynchronous send/recv of activations and gradients (`executor/links.rs`); a recorder
//!   beside the loop (`executor/recorder.rs`) keeps the timeline and reports the loss, the
//!   measured and the predicted bubble and the activation high-water mark.

pub mod executor;
pub mod schedule;
pub mod stage;

pub use executor::{NoStageHooks, PipelineExecutor, Span, SpanKind, StageHooks, StepReport};
pub use schedule::{
    Action, PassCosts, PassKind, Schedule, ScheduleError, ScheduleKind, SimSpan, Simulation,
    StagePlacement,
};
pub use stage::{PipelineStages, StageLayout};

use mtrain_comm::CommError;

/// Errors of the pipeline: a bad layout or batch, a schedule problem, or a failure underneath.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Schedule(#[from] ScheduleError),

    #[error("pipeline layout: {0}")]
    Layout(String),

    #[error("batch of {batch} sequences cannot be split into {microbatches} equal micro-batches")]
    UnevenBatch { batch: usize, microbatches: usize },

    #[error(transparent)]
    Comm(#[from] CommError),

    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, PipelineError>;
