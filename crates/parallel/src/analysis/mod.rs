//! What a layout should cost, worked out from the plan without running it: not on the training
//! step's path. [`comm_cost`] walks one step's collectives (from the schedule's actions, the
//! holdings table, ZeRO's residency rule and the tensor-parallel mappings) and prices them with
//! the α-β model; `mtrain plan` and `mtrain cost` print it and the tests compare it with what a
//! traced run sent. [`cluster`] says which link (inside a node or across nodes) each group of
//! a mesh spans on a machine of G GPUs per node, and prices the group on it.

pub mod comm_cost;
pub mod cluster;
