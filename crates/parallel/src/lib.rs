//! mtrain-parallel: the five ways a model is split across devices, one file each, and the one
//! function that composes them.
//!
//! # Layout
//! The techniques, each readable on its own:
//! - [`ops`]: differentiable collectives (Megatron's f and g, gather/scatter, sequence-parallel pairs).
//! - [`ddp`]: data parallelism: bucketed all-reduce overlapping backward, the check that the
//!   replicas start equal, and the composed plan's dp average
//!   ([`ddp::average`], dense over dp, experts over edp), after the flush or inside the last
//!   backward. All data parallelism lives here, whatever model it averages.
//! - [`fsdp`]: ZeRO-1/2/3 sharding of optimizer state, gradients and parameters.
//! - [`mixed_precision`]: bf16 compute, fp32 master weights, configurable gradient-reduction dtype.
//! - [`tensor_parallel`]: Megatron column/row layers, vocab-parallel embedding and loss.
//! - [`pipeline`]: schedules as data, stages and the executor.
//! - [`expert_parallel`]: MoE with all-to-all token dispatch.
//! - [`context_parallel`]: each sequence split over the cp ranks, K and V around a ring.
//!
//! The composition, top-down:
//! - [`plan`]: [`plan::ParallelPlan`], validated once (the only place the dp·pp·tp = world check
//!   is written), its stage layout as public data, and `describe` for `mtrain plan`. A plan is
//!   data every other part reads, so it depends on no runtime.
//! - [`placement`]: which slice of which parameter each rank holds (the tensor-parallel split
//!   rule, sequence-parallel partial gradients, the stage of a name, an expert's rank, the owner
//!   of a reference copy). Pure rules on names, below the builder, the runtime, the state, the
//!   cost model and the trainer, so none of them restates one.
//! - [`holdings`]: who holds what, as a table of (model config, plan, coordinates): per
//!   segment and parameter the local shape, placement, stage, owner and whether its gradient is
//!   partial. The builder checks the model it builds against it; the cost model, the trainer's
//!   memory model, `describe` and the per-rank counts read it.
//! - [`parallelize`]: the builder, TP -> PP split -> EP -> DDP/ZeRO from a plan, on one screen.
//! - [`runtime`]: [`runtime::ParallelModel`]'s training step (micro-steps through the pipeline
//!   executor, one global norm, the optimizer step), and `runtime/grad_sync.rs`, the one
//!   gradient-sync interface every kind of data parallelism answers (hooks, the fix-ups after
//!   the dp average, the norm's count, the optimizer's items).
//! - [`state`]: the layout-independent state (gather to full tensors, reshard into any plan);
//!   apart from the step because checkpoints and parity checks use it and the loop does not.
//! - [`shards`]: the same state without gathering: the pieces this rank holds (which elements
//!   of each single-device tensor), their values, and filling them from any source: what a
//!   sharded checkpoint writes and reads.
//! - [`analysis`]: what a layout should cost, apart from the step: the α-β model of what it sends
//!   per step and how long that should take ([`analysis::comm_cost`]).
//! - [`toolbox`]: helpers every technique uses (parameter order, f64 sums, replicated-parameter
//!   bookkeeping, communication figures); at the root so that no technique imports another for
//!   them.

pub mod analysis;
pub mod context_parallel;
pub mod ddp;
pub mod expert_parallel;
pub mod fsdp;
pub mod holdings;
pub mod mixed_precision;
pub mod ops;
pub mod parallelize;
pub mod pipeline;
pub mod placement;
pub mod plan;
pub mod runtime;
pub mod shards;
pub mod state;
pub mod tensor_parallel;
pub mod toolbox;
