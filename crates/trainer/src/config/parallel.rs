//! The `[parallel]` table of a config file: how the model is split over the ranks and how
//! they synchronise, one key per layout flag of the same name (`--tp 2` is `tp = 2`,
//! `--zero-stage 1` is `zero_stage = 1`).
//!
//! ```toml
//! [parallel]
//! tp = 2
//! pp = 2
//! schedule = "1f1b"
//! microbatches = 4
//! ```
//!
//! [`ParallelConfig::plan`] turns the table into the parallel crate's [`ParallelPlan`] on a
//! mesh; [`ParallelConfig::of_plan`] writes a plan back as the table a checkpoint records.

use mtrain_comm::mesh::MeshDims;
use mtrain_parallel::ddp::{DdpConfig, DdpMode};
use mtrain_parallel::fsdp::{FsdpConfig, ZeroStage};
use mtrain_parallel::parallelize::{DataParallelKind, ParallelPlan};
use mtrain_parallel::pipeline::ScheduleKind;
use mtrain_parallel::plan::pass_costs_problem;
use mtrain_parallel::tensor_parallel::TpOverlap;
use serde::{Deserialize, Serialize};

use super::ConfigError;

/// Bytes in one MiB, the unit of `bucket_mb`.
const MIB: f64 = (1u64 << 20) as f64;

/// The `[parallel]` table: how the model is split over the ranks and how they synchronise.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ParallelConfig {
    /// Data-parallel degree; inferred as world / (tp·pp) when unset.
    pub dp: Option<usize>,
    /// Tensor-parallel degree (innermost: consecutive ranks).
    pub tp: usize,
    /// Pipeline-parallel degree (number of stages).
    pub pp: usize,
    /// Expert-parallel degree, carved out of dp (must divide dp).
    pub ep: usize,
    /// Context-parallel degree: ranks that split each sequence, K and V passed around a ring.
    pub cp: usize,
    /// Shard parameters, gradients and optimizer state over dp (FSDP, the same as `zero_stage = 3`).
    pub fsdp: bool,
    /// ZeRO stage over dp: 0 = DDP, 1 = shard optimizer state, 2 = + gradients, 3 = + parameters.
    pub zero_stage: u8,
    /// Stage 3: free each segment's gathered weights right after its forward and gather them
    /// again for its backward (PyTorch FSDP's option); false keeps them until the backward.
    pub reshard_after_forward: bool,
    /// Sequence parallelism in the tensor-parallel regions (LayerNorm/dropout on T/tp).
    pub sequence_parallel: bool,
    /// How the TP layers' collectives meet their products: "none" (inline) or "chunked" (the
    /// sequences cut into chunks, each chunk's collective overlapping the next one's product).
    pub tp_overlap: TpOverlapFlag,
    /// Pipelined overlap of the MoE layers' all-to-alls (needs ep > 1): each micro-batch's
    /// tokens in parts, each part's dispatch and combine on the wire while a neighbouring
    /// part's experts compute, forward and backward.
    pub ep_overlap: bool,
    /// Pipeline schedule: "gpipe", "1f1b" or "interleaved".
    pub schedule: Schedule,
    /// Model chunks per pipeline rank under `schedule = "interleaved"` (Megatron's virtual stages).
    pub virtual_stages: usize,
    /// Blocks per model stage, e.g. `[2, 1]` for 3 layers on 2 stages; unset: as even as possible.
    pub stage_layers: Option<Vec<usize>>,
    /// Micro-batches per step through the pipeline; unset: pp.
    pub microbatches: Option<usize>,
    /// One stage's F, B and W in ms that zb-h1 and zb-v build their order for; unset: the
    /// unit-clock orders.
    pub pass_costs: Option<Vec<f64>>,
    /// Gradient all-reduce of DDP: "bucketed" or "naive".
    pub ddp_mode: DdpMode,
    /// DDP bucket size in MiB.
    pub bucket_mb: f64,
}

impl Default for ParallelConfig {
    /// One rank: every degree 1, DDP with 25 MiB buckets, 1F1B.
    fn default() -> Self {
        Self {
            dp: None,
            tp: 1,
            pp: 1,
            ep: 1,
            cp: 1,
            fsdp: false,
            zero_stage: 0,
            reshard_after_forward: true,
            sequence_parallel: false,
            tp_overlap: TpOverlapFlag::None,
            ep_overlap: false,
            schedule: Schedule::OneFOneB,
            virtual_stages: 2,
            stage_layers: None,
            microbatches: None,
            pass_costs: None,
            ddp_mode: DdpMode::Bucketed,
            bucket_mb: 25.0,
        }
    }
}

/// `tp_overlap` / `--tp-overlap`: how the TP layers' collectives meet their products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TpOverlapFlag {
    /// Each product, then its collective, waited inline.
    None,
    /// The sequences cut into chunks: a chunk's collective on the wire while the next chunk's
    /// product is computed (the row layer's forward, the column layer's input gradient).
    Chunked,
    /// With sequence parallelism: its all-gather and reduce-scatter as tp steps of
    /// send/receive around the group, each step's product on the part at hand (collective
    /// matmul).
    Ring,
}

impl TpOverlapFlag {
    fn to_plan(self) -> TpOverlap {
        match self {
            TpOverlapFlag::None => TpOverlap::None,
            TpOverlapFlag::Chunked => TpOverlap::Chunked,
            TpOverlapFlag::Ring => TpOverlap::Ring,
        }
    }

    fn of_plan(o: TpOverlap) -> Self {
        match o {
            TpOverlap::None => TpOverlapFlag::None,
            TpOverlap::Chunked => TpOverlapFlag::Chunked,
            TpOverlap::Ring => TpOverlapFlag::Ring,
        }
    }
}

/// Pipeline schedules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum Schedule {
    /// All forwards, then all backwards (GPipe / AFAB).
    #[serde(rename = "gpipe")]
    Gpipe,
    /// One forward, one backward in the steady state (PipeDream-Flush).
    #[serde(rename = "1f1b")]
    #[value(name = "1f1b")]
    OneFOneB,
    /// 1F1B over `virtual_stages` model chunks per rank: a smaller bubble for more messages.
    #[serde(rename = "interleaved")]
    Interleaved,
    /// Zero bubble at 1F1B's memory, the backward split into B (input gradient) and W (weight
    /// gradients), run as two calls on the tapes.
    #[serde(rename = "zb-h1")]
    #[value(name = "zb-h1")]
    ZbH1,
    /// Zero bubble in a V of two chunks per rank (rank r holds stages r and 2P − 1 − r), the
    /// backward split as in ZB-H1.
    #[serde(rename = "zb-v")]
    #[value(name = "zb-v")]
    ZbV,
}

impl ParallelConfig {
    /// The parallel plan this table describes on the mesh `dims`, with the run's activation
    /// checkpointing and precision; not yet checked against a model (a run's plan is checked
    /// once, by the layout module's `plan`).
    pub fn plan(
        &self,
        dims: MeshDims,
        checkpointing: bool,
        precision: mtrain_parallel::mixed_precision::MixedPrecision,
    ) -> Result<ParallelPlan, ConfigError> {
        let stage = match (self.fsdp, self.zero_stage) {
            (true, 0 | 3) => 3,
            (true, z) => {
                return Err(ConfigError::Invalid(format!(
                    "fsdp shards parameters (ZeRO stage 3) but zero_stage {z} was given; pass one of them"
                )))
            }
            (false, z) => z,
        };
        if !self.reshard_after_forward && stage != 3 {
            return Err(ConfigError::Invalid(format!(
                "reshard_after_forward = false keeps ZeRO-3's gathered weights until the \
                 backward, but the data parallelism here is {}; pass fsdp (or zero_stage = 3) \
                 or leave reshard_after_forward at its default",
                match stage {
                    0 => "DDP".to_string(),
                    z => format!("ZeRO stage {z}"),
                }
            )));
        }
        if !(self.bucket_mb.is_finite() && self.bucket_mb > 0.0) {
            return Err(ConfigError::Invalid(format!(
                "bucket_mb must be a positive number of MiB, got {}",
                self.bucket_mb
            )));
        }
        let pass_costs = match self.pass_costs.as_deref() {
            None => None,
            Some(c) => match pass_costs_problem(c) {
                Some(why) => return Err(ConfigError::Invalid(why)),
                None => Some([c[0], c[1], c[2]]),
            },
        };
        let data = match stage {
            0 => {
                let cap = (self.bucket_mb * MIB) as usize;
                DataParallelKind::Ddp(DdpConfig {
                    mode: self.ddp_mode,
                    bucket_cap_bytes: cap.max(1),
                    first_bucket_cap_bytes: cap.clamp(1, 1 << 20),
                })
            }
            z => DataParallelKind::Zero(FsdpConfig {
                stage: ZeroStage::try_from(z).map_err(|e| ConfigError::Invalid(e.to_string()))?,
                reshard_after_forward: self.reshard_after_forward,
                ..FsdpConfig::default()
            }),
        };
        Ok(ParallelPlan {
            dims,
            data,
            sequence_parallel: self.sequence_parallel,
            tp_overlap: self.tp_overlap.to_plan(),
            ep_overlap: self.ep_overlap,
            schedule: match self.schedule {
                Schedule::Gpipe => ScheduleKind::GPipe,
                Schedule::OneFOneB => ScheduleKind::OneFOneB,
                Schedule::Interleaved => ScheduleKind::Interleaved1F1B {
                    virtual_stages: self.virtual_stages,
                },
                Schedule::ZbH1 => ScheduleKind::ZeroBubbleH1,
                Schedule::ZbV => ScheduleKind::ZeroBubbleV,
            },
            microbatches: self.microbatches.unwrap_or(dims.pp),
            stage_counts: self.stage_layers.clone(),
            pass_costs,
            checkpointing,
            precision,
            // Not a layout choice: the run's `backward` key sets it (`crate::resolve`).
            backward: mtrain_model::Backward::default(),
        })
    }

    /// The table that builds `plan` again (dp written out, ZeRO as `zero_stage`): what a
    /// checkpoint records of the layout a run actually had.
    pub fn of_plan(plan: &ParallelPlan) -> Self {
        let base = Self::default();
        let (zero_stage, ddp_mode, bucket_mb) = match plan.data {
            DataParallelKind::Ddp(d) => (0, d.mode, d.bucket_cap_bytes as f64 / MIB),
            DataParallelKind::Zero(z) => (z.stage as u8, base.ddp_mode, base.bucket_mb),
        };
        let reshard_after_forward = match plan.data {
            DataParallelKind::Zero(z) => z.reshard_after_forward,
            DataParallelKind::Ddp(_) => base.reshard_after_forward,
        };
        let (schedule, virtual_stages) = match plan.schedule {
            ScheduleKind::GPipe => (Schedule::Gpipe, base.virtual_stages),
            ScheduleKind::OneFOneB => (Schedule::OneFOneB, base.virtual_stages),
            ScheduleKind::Interleaved1F1B { virtual_stages } => {
                (Schedule::Interleaved, virtual_stages)
            }
            ScheduleKind::ZeroBubbleH1 => (Schedule::ZbH1, base.virtual_stages),
            ScheduleKind::ZeroBubbleV => (Schedule::ZbV, base.virtual_stages),
        };
        Self {
            dp: Some(plan.dims.dp),
            tp: plan.dims.tp,
            pp: plan.dims.pp,
            ep: plan.dims.ep,
            cp: plan.dims.cp,
            fsdp: false,
            zero_stage,
            reshard_after_forward,
            sequence_parallel: plan.sequence_parallel,
            tp_overlap: TpOverlapFlag::of_plan(plan.tp_overlap),
            ep_overlap: plan.ep_overlap,
            schedule,
            virtual_stages,
            stage_layers: plan.stage_counts.clone(),
            microbatches: Some(plan.microbatches),
            pass_costs: plan.pass_costs.map(|c| c.to_vec()),
            ddp_mode,
            bucket_mb,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mtrain_comm::mesh::MeshDims;

    /// A table written out from a plan builds the same plan again.
    #[test]
    fn a_recorded_plan_builds_the_same_plan() {
        let precision = mtrain_parallel::mixed_precision::MixedPrecision::default();
        let tables = [
            ParallelConfig::default(),
            ParallelConfig {
                tp: 2,
                pp: 2,
                sequence_parallel: true,
                schedule: Schedule::Interleaved,
                virtual_stages: 3,
                stage_layers: Some(vec![2, 1, 1, 2, 1, 1]),
                microbatches: Some(4),
                ..Default::default()
            },
            ParallelConfig {
                pp: 2,
                schedule: Schedule::ZbV,
                pass_costs: Some(vec![12.6, 12.6, 9.8]),
                ..Default::default()
            },
            ParallelConfig {
                fsdp: true,
                ..Default::default()
            },
            ParallelConfig {
                fsdp: true,
                reshard_after_forward: false,
                ..Default::default()
            },
            ParallelConfig {
                zero_stage: 1,
                ..Default::default()
            },
            ParallelConfig {
                ddp_mode: DdpMode::Naive,
                bucket_mb: 4.0,
                schedule: Schedule::Gpipe,
                ..Default::default()
            },
        ];
        for t in tables {
            let dims = MeshDims::new(2, t.pp, t.tp, 1);
            let plan = t.plan(dims, true, precision).unwrap();
            let recorded = ParallelConfig::of_plan(&plan);
            assert_eq!(recorded.dp, Some(2));
            assert_eq!(recorded.plan(dims, true, precision).unwrap(), plan, "{t:?}");
        }
    }

    #[test]
    fn conflicting_strategy_settings_are_named() {
        let precision = mtrain_parallel::mixed_precision::MixedPrecision::default();
        let dims = MeshDims::new(2, 1, 1, 1);
        let both = ParallelConfig {
            fsdp: true,
            zero_stage: 2,
            ..Default::default()
        };
        let e = both.plan(dims, false, precision).unwrap_err().to_string();
        assert!(e.contains("fsdp") && e.contains("zero_stage 2"), "{e}");
        let bucket = ParallelConfig {
            bucket_mb: 0.0,
            ..Default::default()
        };
        let e = bucket.plan(dims, false, precision).unwrap_err().to_string();
        assert!(e.contains("bucket_mb must be a positive"), "{e}");
        let stage = ParallelConfig {
            zero_stage: 4,
            ..Default::default()
        };
        let e = stage.plan(dims, false, precision).unwrap_err().to_string();
        assert!(e.contains("zero stage must be 1, 2 or 3, got 4"), "{e}");
        let kept = ParallelConfig {
            zero_stage: 2,
            reshard_after_forward: false,
            ..Default::default()
        };
        let e = kept.plan(dims, false, precision).unwrap_err().to_string();
        assert!(e.contains("reshard_after_forward") && e.contains("ZeRO stage 2"), "{e}");
    }
}
