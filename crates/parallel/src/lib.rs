//! mtrain-parallel: the five ways a model is split across devices, one file each.
//!
//! # Layout
//! - [`ops`]: differentiable collectives (Megatron's f and g, gather/scatter, sequence-parallel pairs).
//! - [`ddp`]: data parallelism with bucketed all-reduce overlapping backward.
//! - [`fsdp`]: ZeRO-1/2/3 sharding of optimizer state, gradients and parameters.
//! - [`mixed_precision`]: bf16 compute, fp32 master weights, configurable gradient-reduction dtype.
//! - [`tensor_parallel`]: Megatron column/row layers, vocab-parallel embedding and loss.
//! - [`pipeline`]: schedules as data, stages and the executor.
//! - [`expert_parallel`]: MoE with all-to-all token dispatch.
//! - [`parallelize`]: applies TP -> PP -> EP -> FSDP/DDP to a model from a validated plan.
//! - [`comm_cost`]: the α-β model of what a layout sends per step and how long it should take.

pub mod comm_cost;
pub mod ddp;
pub mod expert_parallel;
pub mod fsdp;
pub mod mixed_precision;
pub mod ops;
pub mod parallelize;
pub mod pipeline;
pub mod tensor_parallel;
