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
//!
//! Each phase's wall time splits in two at the moment the host starts to wait for the device:
//!
//! ```text
//!   phase start ──── host: issuing the phase's work (and any read-back inside it) ──── wait ──── end
//!               '-------------------------------- wall --------------------------------------'
//! ```
//!
//! A phase whose host time is close to its wall time kept the device waiting for the host
//! (launch-bound) unless a read-back inside it explains the time (the forward reads the loss);
//! one whose host time is small left the host ahead, as it should be.

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

    /// `data 1.2 (host 1.1) forward 14.0 (host 3.9) ... (outside forward/backward ...)` in step
    /// order: each phase's wall time and, from `host`, the host's share of it.
    pub fn line(&self, host: &PhaseTimes) -> String {
        let mut parts: Vec<String> = StepPhase::ALL
            .iter()
            .filter_map(|p| {
                let wall = self.0.get(p)?;
                let host = host.0.get(p).copied().unwrap_or(0.0);
                Some(format!("{} {wall:.1} (host {host:.1})", name(*p)))
            })
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

/// What [`PhaseTimer`] measured in one step: per phase, the wall time and the host's share of it.
#[derive(Debug, Clone, Default)]
pub struct StepPhases {
    /// Wall time per phase, ending when the device has finished the phase's work (ms).
    pub wall: PhaseTimes,
    /// Of each phase's wall time, the host's: from its start until the wait for the device (ms).
    pub host: PhaseTimes,
}

/// Times the phases of one step: [`PhaseTimer::lap`] at the end of each phase.
pub struct PhaseTimer {
    device: Device,
    last: Instant,
    times: StepPhases,
}

impl PhaseTimer {
    /// Waits for the device, then starts the clock.
    pub fn start(device: &Device) -> candle_core::Result<Self> {
        device.synchronize()?;
        Ok(Self {
            device: device.clone(),
            last: Instant::now(),
            times: StepPhases::default(),
        })
    }

    /// Ends `phase`: waits for the device and charges the time since the last lap to it (the
    /// time until the wait began to its host share).
    pub fn lap(&mut self, phase: StepPhase) -> candle_core::Result<()> {
        let issued = Instant::now();
        self.device.synchronize()?;
        let now = Instant::now();
        let ms = |a: Instant, b: Instant| b.duration_since(a).as_secs_f64() * 1e3;
        *self.times.wall.0.entry(phase).or_default() += ms(self.last, now);
        *self.times.host.0.entry(phase).or_default() += ms(self.last, issued);
        self.last = now;
        Ok(())
    }

    /// The step's figures.
    pub fn finish(self) -> StepPhases {
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
        let StepPhases { wall: p, host } = t.finish();
        for (phase, ms) in &host.0 {
            assert!(*ms <= p.0[phase], "{phase:?}: host {ms} ms > wall {} ms", p.0[phase]);
        }
        assert!(host.0[&StepPhase::Forward] >= 6.0, "{:?}", host);
        assert!(p.0[&StepPhase::Forward] >= 6.0, "{:?}", p);
        assert!(p.0[&StepPhase::Optimizer] >= 2.0, "{:?}", p);
        assert!((p.total() - p.0.values().sum::<f64>()).abs() < 1e-12);
        assert!((p.outside_model() - (p.total() - p.0[&StepPhase::Forward] - p.0[&StepPhase::Backward])).abs() < 1e-9);
        let line = p.line(&host);
        assert!(line.starts_with("data ") && line.contains("(host "), "{line}");
        Ok(())
    }
}
