//! Which pipeline rank runs each model stage: Megatron's loop, or ZB-V's V.

use super::{Schedule, ScheduleKind};

/// Which pipeline rank runs each model stage (S = v·P stages, chunk c of rank r).
///
/// ```text
///   Loop (Megatron):  stage = c·P + r          P = 2, v = 2: rank 0 {0, 2}, rank 1 {1, 3}
///   V (ZB-V, v = 2):  stage = r, 2P − 1 − r    P = 2:        rank 0 {0, 3}, rank 1 {1, 2}
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum StagePlacement {
    #[default]
    Loop,
    V,
}

impl StagePlacement {
    /// The model stage that chunk `chunk` of pipeline rank `rank` of `p` runs.
    pub fn model_stage(self, p: usize, rank: usize, chunk: usize) -> usize {
        match self {
            StagePlacement::V if chunk == 1 => 2 * p - 1 - rank,
            _ => chunk * p + rank,
        }
    }

    /// The pipeline rank of `p` that runs model stage `stage`.
    pub fn rank_of_stage(self, p: usize, stage: usize) -> usize {
        match self {
            StagePlacement::V if stage >= p => 2 * p - 1 - stage,
            _ => stage % p,
        }
    }

    /// The chunk of its rank that model stage `stage` is (the same under both).
    pub fn chunk_of_stage(self, p: usize, stage: usize) -> usize {
        stage / p
    }
}

impl ScheduleKind {
    /// Where its model stages run: the V for ZB-V, Megatron's loop otherwise.
    pub fn placement(&self) -> StagePlacement {
        match self {
            ScheduleKind::ZeroBubbleV => StagePlacement::V,
            _ => StagePlacement::Loop,
        }
    }
}

impl Schedule {
    /// The model stage that chunk `chunk` of pipeline rank `rank` runs, by the kind's
    /// [`StagePlacement`] (under ZB-V's V rank 0 holds both the first and the last stage).
    pub fn model_stage(&self, rank: usize, chunk: usize) -> usize {
        self.kind.placement().model_stage(self.stages, rank, chunk)
    }

    /// The pipeline rank that runs model stage `stage` (the inverse of [`Self::model_stage`]).
    pub fn rank_of_stage(&self, stage: usize) -> usize {
        self.kind.placement().rank_of_stage(self.stages, stage)
    }

    /// The chunk of its rank that model stage `stage` is.
    pub fn chunk_of_stage(&self, stage: usize) -> usize {
        self.kind.placement().chunk_of_stage(self.stages, stage)
    }

    /// The model stages pipeline rank `rank` holds, by chunk.
    pub fn stages_of_rank(&self, rank: usize) -> Vec<usize> {
        (0..self.virtual_stages())
            .map(|c| self.model_stage(rank, c))
            .collect()
    }
}
