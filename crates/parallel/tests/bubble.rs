//! The bubble figure on a pipeline whose passes have known costs. Each model stage is one
//! segment whose forward sleeps F, whose tape's backward (B of a split one) sleeps B, and whose
//! post-backward hook, which fires when the weight gradients are final (W, or the end of a fused
//! backward), sleeps W; the embedding costs nothing, and the head nothing or, to make the last
//! stage the slowest, a forward of its own. Sleeping takes no CPU, so the step runs at those
//! costs on a loaded machine too. On every rank the measured bubble (idle over the rank's step,
//! `executor/recorder.rs`'s module doc) agrees with the schedule simulated at the known costs, and with
//! the executor's own prediction from the pass times it measured, within 0.03, under 1F1B, ZB-H1
//! and ZB-V; its balanced figure is the schedule at the mean of the stages' known costs:
//!
//! ```text
//!   stage s = [h.s] (+ embedding on stage 0, + head on the last)    F = 30 ms, B = 30 ms, W = 15 ms
//!   fused backward = B + W                                          (P = 2, M = 4, 3 steps each)
//!   the head's forward: 0, or HEAD_F = 30 ms (the last stage's F = 60 ms)
//! ```

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Result, Tensor};
use mtrain_comm::{run_local, Backend};
use mtrain_model::tape::{Tape, TapeGrads};
use mtrain_model::{Engine, Grads, HookResult, Hooks, Param, Segment, SegmentOut};
use mtrain_parallel::pipeline::{
    PassCosts, PipelineExecutor, PipelineStages, Schedule, ScheduleKind, StageHooks, StageLayout,
};

const F_MS: u64 = 30;
const B_MS: u64 = 30;
const W_MS: u64 = 15;
/// The head's forward where the last stage is made the slowest.
const HEAD_F_MS: u64 = 30;
const C: usize = 4;
const M: usize = 4;
const P: usize = 2;
const STEPS: usize = 3;

/// Where a segment sits: the embedding takes token ids, the head returns the loss.
#[derive(Clone, Copy, PartialEq)]
enum Place {
    Embedding,
    Block,
    Head,
}

/// A segment of known cost: its forward sleeps `f`, its backward `b`.
struct Sleeper {
    name: String,
    place: Place,
    param: Param,
    f: Duration,
    b: Duration,
}

impl Sleeper {
    /// A block sleeps F and B; the embedding nothing; the head `head_f` in its forward.
    fn new(name: &str, place: Place, head_f: Duration) -> Self {
        let cost = |ms| match place {
            Place::Block => Duration::from_millis(ms),
            _ => Duration::ZERO,
        };
        let zeros = Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap();
        Self {
            name: name.to_string(),
            place,
            param: Param::new(format!("{name}.weight"), zeros).unwrap(),
            f: if place == Place::Head { head_f } else { cost(F_MS) },
            b: cost(B_MS),
        }
    }

    /// (b, T, C) zeros for ids or activations `x` of (b, T, …); the loss, a scalar, for the head.
    fn output(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t) = (x.dim(0)?, x.dim(1)?);
        match self.place {
            Place::Head => Tensor::zeros((), DType::F32, x.device()),
            _ => Tensor::zeros((b, t, C), DType::F32, x.device()),
        }
    }
}

impl Segment for Sleeper {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn forward(&self, x: &Tensor, _targets: Option<&Tensor>) -> Result<SegmentOut> {
        std::thread::sleep(self.f);
        Ok(SegmentOut::plain(self.output(x)?))
    }

    fn params(&self) -> Vec<Param> {
        vec![self.param.clone()]
    }

    fn forward_taped(&self, x: &Tensor, _t: Option<&Tensor>) -> Result<Option<Box<dyn Tape>>> {
        std::thread::sleep(self.f);
        Ok(Some(Box::new(SleepTape {
            name: self.param.name().to_string(),
            input: (self.place != Place::Embedding)
                .then(|| x.zeros_like())
                .transpose()?,
            out: self.output(x)?,
            b: self.b,
        })))
    }
}

/// The tape of a [`Sleeper`]: its backward sleeps `b` and returns zero gradients.
struct SleepTape {
    name: String,
    /// Zeros shaped like the input (None for token ids).
    input: Option<Tensor>,
    out: Tensor,
    b: Duration,
}

impl Tape for SleepTape {
    fn output(&self) -> &Tensor {
        &self.out
    }

    fn backward(self: Box<Self>, _g: Option<&Tensor>, _loss_scale: f64) -> Result<TapeGrads> {
        std::thread::sleep(self.b);
        let g = Tensor::zeros(1, DType::F32, self.out.device())?;
        Ok(TapeGrads {
            params: vec![(self.name, g)],
            input: self.input,
        })
    }
}

/// Stage hooks whose post-backward sleeps W after each block: the cost of W.
struct SleepW;

impl Hooks for SleepW {
    fn post_backward(&mut self, _i: usize, seg: &dyn Segment, _g: &mut Grads) -> HookResult {
        if seg.name().starts_with("h.") {
            std::thread::sleep(Duration::from_millis(W_MS));
        }
        Ok(())
    }
}

impl StageHooks for SleepW {
    fn hooks(&mut self, _chunk: usize, _last_backward: bool) -> &mut dyn Hooks {
        self
    }
}

/// What the executor reported on one rank for the last of [`STEPS`] steps.
struct Bubbles {
    measured: f64,
    predicted: f64,
    balanced: f64,
}

/// Each rank's bubbles, the head's forward sleeping `head_f`.
fn run(kind: ScheduleKind, head_f: Duration) -> Vec<Bubbles> {
    let s = P * kind.virtual_stages();
    run_local(P, Duration::from_secs(60), |backend| {
        let pp = backend.world();
        let zero = Duration::ZERO;
        let mut segments: Vec<Arc<dyn Segment>> =
            vec![Arc::new(Sleeper::new("emb", Place::Embedding, zero))];
        for i in 0..s {
            segments.push(Arc::new(Sleeper::new(&format!("h.{i}"), Place::Block, zero)));
        }
        segments.push(Arc::new(Sleeper::new("head", Place::Head, head_f)));
        let layout = StageLayout::even(s, s)
            .unwrap()
            .with_placement(kind.placement());
        let stages = PipelineStages::from_segments(&segments, s, C, layout, pp.rank(), P).unwrap();
        let exec = PipelineExecutor::new(Schedule::new(kind, P, M).unwrap(), Engine::default());
        let idx = Tensor::zeros((M, 2), DType::U32, &Device::Cpu).unwrap(); // (B, T)
        let mut last = None;
        for _ in 0..STEPS {
            let mut grads = Grads::new();
            let rep = exec
                .step_with_hooks(
                    &stages,
                    pp.as_ref(),
                    &idx,
                    &idx,
                    1.0,
                    &mut grads,
                    &mut SleepW,
                )
                .unwrap();
            last = Some(Bubbles {
                measured: rep.bubble_fraction,
                predicted: rep.predicted_bubble_fraction,
                balanced: rep.balanced_bubble_fraction,
            });
        }
        last.unwrap()
    })
}

/// The known costs of a block stage.
fn block_costs() -> PassCosts {
    let ms = |n: u64| n as f64 * 1e-3;
    PassCosts {
        forward: ms(F_MS),
        backward: ms(B_MS + W_MS),
        input_grad: ms(B_MS),
        weight_grad: ms(W_MS),
    }
}

#[test]
fn the_measured_bubble_is_the_simulated_one_at_known_costs() {
    for head_ms in [0, HEAD_F_MS] {
        let head_f = Duration::from_millis(head_ms);
        for kind in [
            ScheduleKind::OneFOneB,
            ScheduleKind::ZeroBubbleH1,
            ScheduleKind::ZeroBubbleV,
        ] {
            let sched = Schedule::new(kind, P, M).unwrap();
            let mut costs = vec![block_costs(); sched.num_model_stages()];
            costs.last_mut().unwrap().forward += head_f.as_secs_f64();
            let even = vec![PassCosts::mean(&costs); costs.len()];
            let sim = sched.simulate_with(&costs).unwrap();
            let sim_even = sched.simulate_with(&even).unwrap();
            for (r, b) in run(kind, head_f).into_iter().enumerate() {
                let (known, known_even) =
                    (sim.rank_bubble_fraction(r), sim_even.rank_bubble_fraction(r));
                let Bubbles {
                    measured,
                    predicted,
                    balanced,
                } = b;
                let case = format!("{kind}, head {head_ms} ms, rank {r}");
                eprintln!(
                    "{case}: measured {measured:.3}, predicted {predicted:.3}, balanced \
                     {balanced:.3}; at the known costs {known:.3}, on even stages {known_even:.3}"
                );
                assert!(
                    (measured - known).abs() <= 0.03,
                    "{case}: measured bubble {measured:.3} against {known:.3} simulated at the known costs"
                );
                assert!(
                    (measured - predicted).abs() <= 0.03,
                    "{case}: measured bubble {measured:.3} against the executor's prediction {predicted:.3}"
                );
                assert!(
                    (balanced - known_even).abs() <= 0.03,
                    "{case}: balanced bubble {balanced:.3} against {known_even:.3} simulated at the \
                     mean of the known costs"
                );
            }
        }
    }
}
