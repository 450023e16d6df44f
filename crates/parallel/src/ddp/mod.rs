//! Distributed data parallelism (DDP): every rank holds the whole model, runs its own slice of
//! the batch, and the ranks average their gradients before the optimizer step.
//!
//! ```text
//!   rank 0: batch[0]  ─ forward ─ backward ─┐                 ┌─ AdamW (same update)
//!   rank 1: batch[1]  ─ forward ─ backward ─┼─ all-reduce avg ┼─ AdamW (same update)
//!   rank 2: batch[2]  ─ forward ─ backward ─┘   of gradients  └─ AdamW (same update)
//! ```
//!
//! Averaging the gradients of equal-sized slices gives exactly the gradient of the mean loss on
//! the concatenated batch, so N ranks take the same steps as one rank with an N times larger
//! batch, provided they start from the same weights: [`verify_same_init`] checks that with a
//! checksum of every parameter gathered from all ranks.
//!
//! # Buckets overlap the all-reduce with the backward (PyTorch's Reducer, Megatron's grad buffer)
//! Gradients become final in reverse model order: the head's first, the embedding's last. So
//! parameters are packed into buckets in that order (the first bucket small, 1 MiB by default,
//! so communication starts early; then 25 MiB each). When the block-wise engine reports that a
//! segment's gradients are final (`Hooks::post_backward`), every bucket whose parameters are now
//! all final is flattened and its all-reduce launched asynchronously; the backward continues on
//! the next segment while the bytes move:
//!
//! ```text
//!   backward:  [ head ][ h.3 ][ h.2 ][ h.1 ][ h.0 ][ emb ]
//!   comm:             [bucket 0][ bucket 1  ][ bucket 2 ]  [b3]     exposed = waiting for b3
//!                                                              ▲ wait() before the optimizer
//! ```
//!
//! Buckets are launched strictly in bucket order on every rank: collectives on a group must be
//! issued in the same order everywhere, or ranks would sum different buckets (the trace test
//! checks the sequences). A tied weight (`wte`, used by the embedding and the head) is final only
//! after the lowest segment using it, so it is bucketed where it becomes final, not where it is
//! first seen.
//!
//! With gradient accumulation the engine sums micro-step gradients locally and only the last
//! micro-step (`sync = true`) communicates. The `naive` mode all-reduces one tensor at a time
//! after the whole backward: the textbook version, kept beside the bucketed one for comparison.
//!
//! A group of one has nothing to average: its gradients are the engine's, untouched, and no
//! collective is issued.
//!
//! Every step reports backward time, communication time (how long the group was busy) and
//! exposed communication (time spent blocked in `wait()`), so the overlap is measured.
//!
//! The buckets and their launcher are DDP's one reduction: a composed plan of one stage
//! ([`crate::ParallelPlan::dp_buckets`]: the world of one, `--dp N`, tp × dp) launches them
//! from its executor's hooks ([`BucketedDpReduce`]); that is the step `--dp N` runs. The naive
//! mode and every plan the buckets do not cover (pipelines, experts) take the composed plan's
//! dp average, `ddp/average.rs`: one all-reduce per gradient (dense over dp, experts over edp),
//! after the flush, or started inside the last backward by `ddp/overlap.rs`.

pub mod average;
mod buckets;
mod overlap;
mod setup;

pub use buckets::{assign_bucket_sizes, assign_buckets, Bucket, ParamSize};
pub use overlap::{BucketedDpReduce, OverlappedDpReduce};
pub use setup::{verify_same_init, DpError, Result};
// What a strategy reports, under the API's name as well as the toolbox's.
pub use crate::toolbox::{CommStats, ModelStateBytes};

/// How DDP communicates gradients; written `bucketed` or `naive` (its [`DdpMode::name`], also
/// its serde form).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DdpMode {
    /// Buckets in reverse order, all-reduced asynchronously as the backward produces them.
    #[default]
    Bucketed,
    /// One blocking all-reduce per tensor after the whole backward.
    Naive,
}

impl DdpMode {
    /// Every mode, in the order a command line lists them.
    pub const ALL: [DdpMode; 2] = [DdpMode::Bucketed, DdpMode::Naive];

    /// How a config file and a command line write it.
    pub fn name(self) -> &'static str {
        match self {
            DdpMode::Bucketed => "bucketed",
            DdpMode::Naive => "naive",
        }
    }

    /// The mode written `name`.
    pub fn named(name: &str) -> Option<DdpMode> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }
}

/// DDP settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DdpConfig {
    pub mode: DdpMode,
    /// Size at which a bucket is closed (PyTorch: 25 MiB).
    pub bucket_cap_bytes: usize,
    /// Size at which the first bucket is closed, small so communication starts early (PyTorch: 1 MiB).
    pub first_bucket_cap_bytes: usize,
}

impl Default for DdpConfig {
    fn default() -> Self {
        Self {
            mode: DdpMode::Bucketed,
            bucket_cap_bytes: 25 << 20,
            first_bucket_cap_bytes: 1 << 20,
        }
    }
}
