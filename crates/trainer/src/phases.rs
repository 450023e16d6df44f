//! Where an optimizer step's time goes (`--profile-phases`): wall time per phase, with the device
//! synchronised at every boundary so that each phase is charged its own GPU work.
//!
//! ```text
//!   step:  data | forward | backward | data | forward | backward | ... | grad_norm | optimizer
//!          '---------------- grad_accum micro-steps ---------------'
//!   outside forward and backward = data + grad_norm + optimizer  (the step's fixed cost)
//! ```
//!
//! Without the flag nothing is synchronised beyond what the step itself reads back (the loss,
//! the gradient norm), so a GPU keeps running ahead of the host; with it, every boundary waits
//! for the device, which costs a little throughput and makes the figures exact.

use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::Device;
use serde::Serialize;

/// The phases of a step, in the order they happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepPhase {
    /// Reading the batch and copying it to the device.
    Data,
    /// The forward pass, the loss read back.
    Forward,
    /// The backward pass (and, under a layout, the communication it waits for).
    Backward,
    /// The global gradient norm.
    GradNorm,
    /// Clipping, the optimizer update and the compute copy of the weights.
    Optimizer,
}

impl StepPhase {
    /// Every phase, in step order.
    pub const ALL: [StepPhase; 5] = [
        StepPhase::Data,
        StepPhase::Forward,
        StepPhase::Backward,
        StepPhase::GradNorm,
        StepPhase::Optimizer,
    ];

    /// Whether the phase is part of the model's forward or backward.
    pub fn is_model(self) -> bool {
        matches!(self, StepPhase::Forward | StepPhase::Backward)
    }
}

/// Milliseconds per phase of one step (phases of the micro-steps summed).
#[derive(Debug, Clone, Default, Serialize)]
pub struct PhaseTimes(pub BTreeMap<StepPhase, f64>);

impl PhaseTimes {
    /// The step's total (ms).
    pub fn total(&self) -> f64 {
        self.0.values().sum()
    }

    /// Time outside the forward and backward (ms).
    pub fn outside_model(&self) -> f64 {
        self.0.iter().filter(|(p, _)| !p.is_model()).map(|(_, ms)| ms).sum()
    }

    /// `data 1.2 forward 14.0 ... ms` in step order.
    pub fn line(&self) -> String {
        let mut parts: Vec<String> = StepPhase::ALL
            .iter()
            .filter_map(|p| self.0.get(p).map(|ms| format!("{} {ms:.1}", name(*p))))
            .collect();
        parts.push(format!(
            "(outside forward/backward {:.1} of {:.1} ms)",
            self.outside_model(),
            self.total()
        ));
        parts.join(" ")
    }
}

fn name(p: StepPhase) -> &'static str {
    match p {
        StepPhase::Data => "data",
        StepPhase::Forward => "forward",
        StepPhase::Backward => "backward",
        StepPhase::GradNorm => "grad_norm",
        StepPhase::Optimizer => "optimizer",
    }
}

/// Times the phases of one step: [`PhaseTimer::lap`] at the end of each phase.
pub struct PhaseTimer {
    device: Device,
    last: Instant,
    times: PhaseTimes,
}

impl PhaseTimer {
    /// Waits for the device, then starts the clock.
    pub fn start(device: &Device) -> candle_core::Result<Self> {
        device.synchronize()?;
        Ok(Self {
            device: device.clone(),
            last: Instant::now(),
            times: PhaseTimes::default(),
        })
    }

    /// Ends `phase`: waits for the device and charges the time since the last lap to it.
    pub fn lap(&mut self, phase: StepPhase) -> candle_core::Result<()> {
        self.device.synchronize()?;
        let now = Instant::now();
        let ms = now.duration_since(self.last).as_secs_f64() * 1e3;
        *self.times.0.entry(phase).or_default() += ms;
        self.last = now;
        Ok(())
    }

    /// The step's figures.
    pub fn finish(self) -> PhaseTimes {
        self.times
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_add_up_and_split_model_from_the_rest() -> candle_core::Result<()> {
        let mut t = PhaseTimer::start(&Device::Cpu)?;
        for _ in 0..2 {
            t.lap(StepPhase::Data)?;
            std::thread::sleep(std::time::Duration::from_millis(3));
            t.lap(StepPhase::Forward)?;
            t.lap(StepPhase::Backward)?;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
        t.lap(StepPhase::Optimizer)?;
        let p = t.finish();
        assert!(p.0[&StepPhase::Forward] >= 6.0, "{:?}", p);
        assert!(p.0[&StepPhase::Optimizer] >= 2.0, "{:?}", p);
        assert!((p.total() - p.0.values().sum::<f64>()).abs() < 1e-12);
        assert!((p.outside_model() - (p.total() - p.0[&StepPhase::Forward] - p.0[&StepPhase::Backward])).abs() < 1e-9);
        assert!(p.line().starts_with("data "), "{}", p.line());
        Ok(())
    }
}
