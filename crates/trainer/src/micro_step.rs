//! Which micro-step of an optimizer step a forward/backward is: the loop counts them
//! ([`crate::train`]), the model reads them ([`crate::distributed::Distributed::forward_backward`]).
//! A module below both, so `train` imports `distributed` (to build and drive the model) and
//! nothing imports back.

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
