//! The one interface between the training loop and a model, however the model is laid out
//! across ranks: forward/backward of a micro-batch, the squared gradient norm, the optimizer
//! step, checkpoint state, and what the memory and step reports need. [`crate::distributed`]
//! implements it for every layout, one device included; [`crate::train`] drives it.

use std::collections::BTreeMap;

use candle_core::Tensor;
use mtrain_model::optim::{AdamWState, GradScale};
use mtrain_model::GptConfig;

use crate::memory::{step_memory, ActivationLayout, ModelStateLayout, Phase, StepMemory, StepRun};

/// Which of an optimizer step's micro-steps a forward/backward is: `index` of `of`, the
/// loop's gradient accumulation. The loop is its only owner; the model reads it (the first
/// opens the step, the last syncs the gradients) and keeps no count of its own.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MicroStep {
    pub index: usize,
    pub of: usize,
    /// The dropout masks' step and micro-step (None: no dropout).
    pub dropout: Option<mtrain_model::StepDraw>,
}

impl MicroStep {
    /// The first micro-step of the optimizer step.
    pub fn is_first(&self) -> bool {
        self.index == 0
    }

    /// The last one: the gradients are complete after it.
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.of
    }

    /// The loss scale that makes the accumulated gradients the mean over the step: `1 / of`.
    pub fn loss_scale(&self) -> f64 {
        1.0 / self.of as f64
    }
}

/// What the loop needs from a model, however it is laid out across ranks.
pub trait TrainableModel {
    /// Forward and backward of one micro-batch `(B, T)`, micro-step `micro` of the optimizer
    /// step, adding [`MicroStep::loss_scale`] × its gradients to the accumulated ones; `mark` is
    /// called after the forward and after the backward (memory report). Returns the
    /// micro-batch's mean loss.
    fn forward_backward(
        &mut self,
        inputs: &Tensor,
        targets: &Tensor,
        micro: MicroStep,
        mark: &mut dyn FnMut(Phase),
    ) -> anyhow::Result<f64>;
    /// Mean loss of a batch without gradients.
    fn eval_loss(&mut self, inputs: &Tensor, targets: &Tensor) -> anyhow::Result<f64>;
    /// Σ g² over all accumulated gradients of the whole model (a sharded model reduces it), as
    /// one f64 on the model's device: the loop reads it once the optimizer step is queued, so
    /// on a GPU the host does not wait for the norm in between.
    fn grad_sq_norm(&mut self) -> anyhow::Result<Tensor>;
    /// Scale the gradients by `grad_scale`, take an AdamW step at `lr`, clear the gradients.
    fn optimizer_step(&mut self, lr: f64, grad_scale: GradScale) -> anyhow::Result<()>;
    /// Full parameter tensors by name (for checkpoints). Called on every rank (a sharded model
    /// gathers here); only rank 0 writes.
    fn state_dict(&self) -> anyhow::Result<BTreeMap<String, Tensor>>;
    /// Full optimizer state by parameter name (for checkpoints); called on every rank.
    fn optim_state(&self) -> anyhow::Result<AdamWState>;
    /// Restore parameters and optimizer state saved by the two methods above.
    fn load_state(
        &mut self,
        model: &BTreeMap<String, Tensor>,
        optim: AdamWState,
    ) -> anyhow::Result<()>;
    /// Parameter shapes by name, to check a checkpoint against.
    fn param_shapes(&self) -> BTreeMap<String, Vec<usize>>;
    /// The bytes-per-parameter layout this rank holds (for the memory report).
    fn memory_layout(&self) -> ModelStateLayout;
    /// What a step over `batch` rows of `seq` tokens adds to this rank's memory (activations,
    /// gathers, peak: [`crate::memory::rank_step_memory`]); the whole model's on one device.
    fn step_memory(&self, cfg: &GptConfig, batch: usize, run: StepRun) -> StepMemory {
        let layout = ActivationLayout::single_device(cfg, batch);
        step_memory(cfg, &layout, &self.memory_layout(), run)
    }
    /// Whether [`TrainableModel::step_memory`] counts the MoE rows the last step's router
    /// dispatched (then the report recomputes it after every step); false: an even split.
    fn routing_is_measured(&self) -> bool {
        false
    }
    /// Communication buffer bytes this rank holds (0 on one device).
    fn comm_bytes(&self) -> u64 {
        0
    }
    /// What the last optimizer step cost beyond the loss (communication, pipeline bubble,
    /// expert load), as a JSON object; None on one device.
    fn step_report(&self) -> Option<serde_json::Value> {
        None
    }
    /// The same as one human-readable line for the log.
    fn step_line(&self) -> Option<String> {
        None
    }
    /// The last optimizer step's pipeline timeline on this rank (spans of forward, backward,
    /// send and receive wait per micro-batch), as a JSON object; None without a pipeline.
    fn pipeline_timeline(&self) -> Option<serde_json::Value> {
        None
    }
}
