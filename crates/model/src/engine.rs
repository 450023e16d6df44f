//! The block-wise engine: forward and backward one segment at a time.
//!
//! Running the model segment by segment gives the moments distributed training hangs on
//! (candle's `backward()` returns every gradient at the very end, with no hooks):
//!
//! ```text
//! forward:   idx ─[seg 0]─> a₁ ─[seg 1]─> a₂ ─ … ─[seg n-1]─> loss
//!                 each segment runs its graph-free forward and keeps its tape
//!
//! backward:  for i = n-1 … 0:
//!              pre_backward(i)            (FSDP: gather weights; recompute if checkpointing)
//!              gᵢ, ∂/∂params(i) = tapeᵢ.backward(gᵢ₊₁, loss_scale)    gₙ = loss_scale for the loss
//!              grads[name] += ∂/∂param    (a tied weight sums over the segments using it)
//!              post_backward(i)           (DDP: launch bucket; FSDP: reduce-scatter; PP: send gᵢ)
//!
//!            with hooks that free weights early (ZeRO-3), a tape's backward in two:
//!              gᵢ = B of tapeᵢ            (the last read of segment i's weights)
//!              weights_read(i)            (FSDP: free the gathered weights)
//!              ∂/∂params(i) = W of tapeᵢ  (dyᵀ·x products: no weight read), then as above
//!
//! forward hooks: pre_forward(i) before and post_forward(i) after each segment's forward.
//! ```
//!
//! A segment's tape is its hand-written backward ([`crate::explicit`]): the parameter gradients
//! and gᵢ autograd would give, without an autograd graph (a tape with an auxiliary loss, a
//! mixture of experts, adds that loss's gradient times `loss_scale` itself). With
//! [`Backward::Autograd`], the oracle the tests compare the tapes with, each segment's input is
//! a detached leaf Var aᵢ instead and the backward differentiates
//! `(outᵢ · gᵢ₊₁).sum() + loss_scale · auxᵢ`: by the chain rule, exactly the whole-graph gradients
//! of the segment's parameters and input.
//!
//! With `checkpointing` the forward keeps only each segment's input; the backward re-runs the
//! segment's forward (after `pre_backward`) before differentiating it: the same forward, so the
//! recompute replays its arithmetic exactly. Without it, the tape (under autograd, the recorded
//! graph) is kept until that segment's backward.
//!
//! A parameter used by several segments (the tied `wte`) is final after the backward of the
//! lowest-index segment that uses it; `post_backward` fires per segment.
//!
//! The backward can also run as two calls, for the zero-bubble pipeline schedules:
//!
//! ```text
//! B  backward_input:    for i = n-1 … 0: pre_backward(i), recompute; gᵢ from gᵢ₊₁    -> g₀, pending
//!                       (a tape's B: dx now, its weight products dyᵀ·x kept; autograd: all now;
//!                        the embedding, whose input is token ids: nothing yet)
//! W  backward_weights:  for i = n-1 … 0: form pending(i), grads[name] += …, post_backward(i)
//! ```
//! B and W together add the same gradients as [`Engine::backward`], by the same products.

use candle_core::{DType, Result, Tensor, Var};

use crate::dropout::Draw;
use crate::gpt::Segment;
use crate::moe::MoeStats;
use crate::param::Grads;
use crate::tape::{Tape, WeightGrads};
use std::sync::Arc;

/// What a hook returns: an error stops the pass.
pub type HookResult = Result<()>;

/// Callbacks around each segment; every method defaults to doing nothing.
pub trait Hooks {
    /// Before segment `i`'s forward.
    fn pre_forward(&mut self, _i: usize, _seg: &dyn Segment) -> HookResult {
        Ok(())
    }
    /// After segment `i`'s forward (FSDP may put its placeholder back here when checkpointing,
    /// since then nothing recorded holds the gathered weight).
    fn post_forward(&mut self, _i: usize, _seg: &dyn Segment) -> HookResult {
        Ok(())
    }
    /// Before segment `i`'s backward (and before its recompute under checkpointing).
    fn pre_backward(&mut self, _i: usize, _seg: &dyn Segment) -> HookResult {
        Ok(())
    }
    /// Segment `i`'s parameter gradients have been added to `grads`.
    fn post_backward(&mut self, _i: usize, _seg: &dyn Segment, _grads: &mut Grads) -> HookResult {
        Ok(())
    }
    /// Whether [`Engine::backward`] takes each tape's backward in two, input gradient (B) then
    /// weight gradients (W), calling [`Hooks::weights_read`] between them.
    fn splits_backward(&self) -> bool {
        false
    }
    /// Segment `i`'s backward has read its weights for the last time: its input gradient is
    /// formed, and its weight gradients (products of activations and output gradients, which
    /// read no weight) are not yet. Called where [`Hooks::splits_backward`] asks for it.
    fn weights_read(&mut self, _i: usize, _seg: &dyn Segment) -> HookResult {
        Ok(())
    }
}

/// Hooks that do nothing.
pub struct NoHooks;
impl Hooks for NoHooks {}

/// A segment's input as kept by the forward.
enum SavedInput {
    /// Integer token ids: nothing to differentiate.
    Tokens(Tensor),
    /// A float activation, cut from the previous segment's graph.
    Leaf(Var),
}

impl SavedInput {
    fn tensor(&self) -> &Tensor {
        match self {
            SavedInput::Tokens(t) => t,
            SavedInput::Leaf(v) => v.as_tensor(),
        }
    }
}

/// What one segment's forward leaves for its backward.
struct Saved {
    input: SavedInput,
    /// The recorded forward (None under checkpointing: recomputed in backward).
    recorded: Option<Recorded>,
}

enum Recorded {
    /// Output, auxiliary loss and the parameter tensors, for autograd.
    Graph {
        out: Tensor,
        aux: Option<Tensor>,
        params: Vec<(String, Tensor)>,
    },
    /// A hand-written backward's tape.
    Tape(Box<dyn Tape>),
}

impl Recorded {
    /// The segment's forward, taped where it has a tape and `backward` takes the tapes.
    fn run(
        seg: &dyn Segment,
        x: &Tensor,
        targets: Option<&Tensor>,
        backward: Backward,
        draw: Option<&Draw>,
    ) -> Result<(Self, Vec<MoeStats>)> {
        if backward.uses_tapes() {
            let tape = match draw {
                Some(d) => seg.forward_taped_drawn(x, targets, d)?,
                None => seg.forward_taped(x, targets)?,
            };
            if let Some(tape) = tape {
                let stats = tape.stats().into_iter().collect();
                return Ok((Recorded::Tape(tape), stats));
            }
        }
        let o = match draw {
            Some(d) => seg.forward_drawn(x, targets, d)?,
            None => seg.forward(x, targets)?,
        };
        let rec = Recorded::Graph {
            out: o.out,
            aux: o.aux_loss,
            params: param_tensors(seg),
        };
        Ok((rec, o.stats.into_iter().collect()))
    }

    fn out(&self) -> &Tensor {
        match self {
            Recorded::Graph { out, .. } => out,
            Recorded::Tape(t) => t.output(),
        }
    }

    fn aux(&self) -> Option<&Tensor> {
        match self {
            Recorded::Graph { aux, .. } => aux.as_ref(),
            Recorded::Tape(t) => t.aux_loss(),
        }
    }
}

/// The result of [`Engine::forward`]: the last segment's output and what the backward needs.
pub struct Activations {
    /// The last segment's output, detached (the scalar loss when the head got targets).
    pub output: Tensor,
    /// Sum of the segments' auxiliary losses (already times their coefficients).
    pub aux_loss: f64,
    /// Routing statistics of the MoE segments, in segment order.
    pub stats: Vec<MoeStats>,
    saved: Vec<Saved>,
    targets: Option<Tensor>,
}

impl Activations {
    /// Number of segments with saved state.
    pub fn len(&self) -> usize {
        self.saved.len()
    }

    pub fn is_empty(&self) -> bool {
        self.saved.is_empty()
    }

    /// Bytes of the tensors this object holds directly (segment inputs, and outputs without
    /// checkpointing); the graphs hanging off recorded outputs are not counted.
    pub fn held_bytes(&self) -> usize {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        self.saved
            .iter()
            .map(|s| bytes(s.input.tensor()) + s.recorded.as_ref().map_or(0, |r| bytes(r.out())))
            .sum()
    }
}

/// Whether the engine differentiates a segment by its hand-written backward (its tape,
/// [`Segment::forward_taped`]) or by autograd; a segment without a tape (a mixture of experts)
/// always takes autograd. A value of the engine, not of the process, so two engines in one
/// process (a test and its oracle) can differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backward {
    /// candle's autograd for every segment: the oracle the tapes are tested against.
    Autograd,
    /// The tapes wherever a segment has one, on every device (the default): the fused kernels
    /// on CUDA, the same algorithms on CPU (`mtrain_kernels`).
    #[default]
    Tapes,
}

impl Backward {
    /// Whether a segment that has a tape runs it.
    pub fn uses_tapes(&self) -> bool {
        match self {
            Backward::Autograd => false,
            Backward::Tapes => true,
        }
    }
}

/// Runs segments one at a time, each differentiated on its own, so that every segment's
/// [`Hooks`] fire between the others' work (candle's `backward()` alone returns every gradient
/// at the end, with no moment to overlap communication, gather weights or free them).
#[derive(Debug, Clone, Copy, Default)]
pub struct Engine {
    /// Keep only segment inputs in forward and recompute each segment in backward.
    pub checkpointing: bool,
    /// Which segments are differentiated by their hand-written backward.
    pub backward: Backward,
    /// The dropout of the passes this engine runs (a training micro-batch); None: no dropout
    /// (evaluation). A recompute under checkpointing draws the same masks from it.
    pub dropout: Option<Draw>,
}

fn is_integer(dtype: DType) -> bool {
    matches!(dtype, DType::U8 | DType::U32 | DType::I64)
}

/// Parameter tensors of a segment, each name once.
fn param_tensors(seg: &dyn Segment) -> Vec<(String, Tensor)> {
    let mut seen = std::collections::BTreeSet::new();
    seg.params()
        .into_iter()
        .filter(|p| seen.insert(p.name().to_string()))
        .map(|p| (p.name().to_string(), p.tensor()))
        .collect()
}

impl Engine {
    /// An engine with the default [`Backward`].
    pub fn new(checkpointing: bool) -> Self {
        Self {
            checkpointing,
            backward: Backward::default(),
            dropout: None,
        }
    }

    /// This engine running its passes under the dropout `draw` (None: none).
    pub fn with_dropout(self, draw: Option<Draw>) -> Self {
        Self {
            dropout: draw,
            ..self
        }
    }

    /// This engine differentiating by `backward`.
    pub fn with_backward(self, backward: Backward) -> Self {
        Self { backward, ..self }
    }

    /// Forward through `segs`, keeping what [`Engine::backward`] needs. `targets` is passed to
    /// every segment (only the head uses it).
    pub fn forward(
        &self,
        segs: &[Arc<dyn Segment>],
        input: &Tensor,
        targets: Option<&Tensor>,
        hooks: &mut dyn Hooks,
    ) -> Result<Activations> {
        let mut x = input.clone();
        let mut saved = Vec::with_capacity(segs.len());
        let mut aux_loss = 0.0;
        let mut stats = Vec::new();
        for (i, seg) in segs.iter().enumerate() {
            hooks.pre_forward(i, seg.as_ref())?;
            let input = if is_integer(x.dtype()) {
                SavedInput::Tokens(x.clone())
            } else {
                SavedInput::Leaf(Var::from_tensor(&x.detach())?)
            };
            // Under checkpointing only the output is kept (dropped with `rec` below), and the
            // backward recomputes the segment by the same forward, so both passes run the
            // same arithmetic.
            let (rec, st) = Recorded::run(
                seg.as_ref(),
                input.tensor(),
                targets,
                self.backward,
                self.dropout.as_ref(),
            )?;
            if let Some(a) = rec.aux() {
                aux_loss += a.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            }
            stats.extend(st);
            x = rec.out().detach();
            let recorded = if self.checkpointing { None } else { Some(rec) };
            saved.push(Saved { input, recorded });
            hooks.post_forward(i, seg.as_ref())?;
        }
        Ok(Activations {
            output: x,
            aux_loss,
            stats,
            saved,
            targets: targets.cloned(),
        })
    }

    /// Backward through `segs` (the same ones given to [`Engine::forward`]), in reverse.
    ///
    /// `grad_output` is the gradient w.r.t. the last segment's output; None means that output is
    /// the scalar loss, whose gradient is `loss_scale`. Auxiliary losses are scaled by `loss_scale`
    /// too. Parameter gradients are added to `grads` by name. Returns the gradient w.r.t. the
    /// input of the first segment, or None when that input is integer token ids.
    pub fn backward(
        &self,
        segs: &[Arc<dyn Segment>],
        acts: Activations,
        grad_output: Option<&Tensor>,
        loss_scale: f64,
        grads: &mut Grads,
        hooks: &mut dyn Hooks,
    ) -> Result<Option<Tensor>> {
        self.walk(
            segs,
            acts,
            grad_output,
            hooks,
            |i, seg, rec, input, g, hooks| {
                let leaf = input.leaf();
                // B, weights_read, W where the hooks ask and the segment has a tape and an input
                // gradient to form (the embedding's backward reads no weight).
                let split = hooks.splits_backward()
                    && leaf.is_some()
                    && matches!(rec, Recorded::Tape(_));
                let (weights, grad_in) = segment_backward(i, seg, rec, leaf, g, loss_scale, split)?;
                if split {
                    hooks.weights_read(i, seg)?;
                }
                add_weight_grads(i, seg, weights, grads, hooks)?;
                Ok(grad_in)
            },
        )
    }

    /// B of a split backward through `segs`: [`Engine::backward`]'s walk computing only the
    /// input gradients (`pre_backward` and any recompute run here), each segment's weight
    /// products kept in the returned [`PendingGrads`] for [`Engine::backward_weights`]. A
    /// segment whose input is token ids (the embedding) has no input gradient to compute: its
    /// whole backward waits for W.
    pub fn backward_input(
        &self,
        segs: &[Arc<dyn Segment>],
        acts: Activations,
        grad_output: Option<&Tensor>,
        loss_scale: f64,
        hooks: &mut dyn Hooks,
    ) -> Result<(Option<Tensor>, PendingGrads)> {
        let mut pending = PendingGrads {
            segs: Vec::with_capacity(segs.len()),
            loss_scale,
        };
        let grad_in = self.walk(
            segs,
            acts,
            grad_output,
            hooks,
            |i, seg, rec, input, g, _| {
                let (kept, grad_in) = match input.leaf() {
                    None => {
                        let grad_out = g.cloned();
                        (Pending::Whole { rec, grad_out }, None)
                    }
                    Some(leaf) => {
                        let split = segment_backward(i, seg, rec, Some(leaf), g, loss_scale, true)?;
                        (Pending::Weights(split.0), split.1)
                    }
                };
                pending.segs.push((i, kept));
                Ok(grad_in)
            },
        )?;
        Ok((grad_in, pending))
    }

    /// The walk both backwards take: segments last to first, each popped from `acts` (after
    /// its `pre_backward` and any recompute) and handed to `step` with the gradient of its
    /// output; `step` returns the gradient of its input, the previous segment's output.
    fn walk(
        &self,
        segs: &[Arc<dyn Segment>],
        mut acts: Activations,
        grad_output: Option<&Tensor>,
        hooks: &mut dyn Hooks,
        mut step: impl FnMut(
            usize,
            &dyn Segment,
            Recorded,
            SavedInput,
            Option<&Tensor>,
            &mut dyn Hooks,
        ) -> Result<Option<Tensor>>,
    ) -> Result<Option<Tensor>> {
        check_saved(segs, &acts)?;
        let mut grad_out: Option<Tensor> = grad_output.cloned();
        for i in (0..segs.len()).rev() {
            let seg = segs[i].as_ref();
            let (rec, input) = self.recorded(seg, &mut acts, i, hooks)?;
            grad_out = step(i, seg, rec, input, grad_out.as_ref(), hooks)?;
        }
        Ok(grad_out)
    }

    /// W of a split backward: forms the weight gradients B left in `pending` (from the last
    /// segment to the first, as the fused backward does), adds them to `grads` by name and
    /// fires `post_backward` for each segment: its gradients are final for this micro-batch.
    pub fn backward_weights(
        &self,
        segs: &[Arc<dyn Segment>],
        pending: PendingGrads,
        grads: &mut Grads,
        hooks: &mut dyn Hooks,
    ) -> Result<()> {
        let loss_scale = pending.loss_scale;
        for (i, kept) in pending.segs {
            let seg = segs.get(i).map(|s| s.as_ref()).ok_or_else(|| {
                candle_core::Error::Msg(format!("engine backward_weights: no segment {i}"))
            })?;
            let weights = match kept {
                Pending::Weights(w) => w,
                Pending::Whole { rec, grad_out } => {
                    segment_backward(i, seg, rec, None, grad_out.as_ref(), loss_scale, false)?.0
                }
            };
            add_weight_grads(i, seg, weights, grads, hooks)?;
        }
        Ok(())
    }

    /// Segment i's saved input and its recorded forward, popped from `acts` after
    /// `pre_backward(i)`, the forward recomputed under checkpointing.
    fn recorded(
        &self,
        seg: &dyn Segment,
        acts: &mut Activations,
        i: usize,
        hooks: &mut dyn Hooks,
    ) -> Result<(Recorded, SavedInput)> {
        let saved = acts
            .saved
            .pop()
            .ok_or_else(|| candle_core::Error::Msg("engine backward: no saved segment".into()))?;
        hooks.pre_backward(i, seg)?;
        let rec = match saved.recorded {
            Some(r) => r,
            None => {
                Recorded::run(
                    seg,
                    saved.input.tensor(),
                    acts.targets.as_ref(),
                    self.backward,
                    self.dropout.as_ref(),
                )?
                .0
            }
        };
        Ok((rec, saved.input))
    }

    /// Forward and backward of the whole list with the loss at the end; returns (loss, aux_loss).
    pub fn forward_backward(
        &self,
        segs: &[Arc<dyn Segment>],
        idx: &Tensor,
        targets: &Tensor,
        loss_scale: f64,
        grads: &mut Grads,
        hooks: &mut dyn Hooks,
    ) -> Result<(f64, f64)> {
        let acts = self.forward(segs, idx, Some(targets), hooks)?;
        let loss = mtrain_kernels::reduce::sum_f64(&acts.output)?;
        let aux = acts.aux_loss;
        self.backward(segs, acts, None, loss_scale, grads, hooks)?;
        Ok((loss, aux))
    }
}

/// What B of a split backward ([`Engine::backward_input`]) leaves for W
/// ([`Engine::backward_weights`]): each segment's weight gradients, from the last segment to
/// the first.
pub struct PendingGrads {
    segs: Vec<(usize, Pending)>,
    loss_scale: f64,
}

enum Pending {
    /// The weight gradients B formed, and the products it kept.
    Weights(WeightGrads),
    /// A segment whose input is token ids: its whole backward, from its output's gradient.
    Whole {
        rec: Recorded,
        grad_out: Option<Tensor>,
    },
}

impl PendingGrads {
    /// Bytes held for W: the kept products' factors, and a whole backward's output and its
    /// gradient.
    pub fn held_bytes(&self) -> usize {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        self.segs
            .iter()
            .map(|(_, p)| match p {
                Pending::Weights(w) => w.held_bytes(),
                Pending::Whole { rec, grad_out } => {
                    bytes(rec.out()) + grad_out.as_ref().map_or(0, bytes)
                }
            })
            .sum()
    }
}

impl SavedInput {
    /// The leaf whose gradient is the segment's input gradient (None for token ids).
    fn leaf(&self) -> Option<&Var> {
        match self {
            SavedInput::Tokens(_) => None,
            SavedInput::Leaf(v) => Some(v),
        }
    }
}

/// Segment i's gradients formed and added to `grads` by name; then its `post_backward`: they
/// are final for this pass.
fn add_weight_grads(
    i: usize,
    seg: &dyn Segment,
    weights: WeightGrads,
    grads: &mut Grads,
    hooks: &mut dyn Hooks,
) -> Result<()> {
    let fresh = weights.fresh();
    for (name, t) in weights.finish()? {
        match fresh {
            true => grads.accumulate_fresh(&name, t)?,
            false => grads.accumulate(&name, t)?,
        }
    }
    hooks.post_backward(i, seg, grads)
}

fn check_saved(segs: &[Arc<dyn Segment>], acts: &Activations) -> Result<()> {
    if acts.saved.len() != segs.len() {
        return Err(candle_core::Error::Msg(format!(
            "engine backward: {} segments given but the forward saved {}",
            segs.len(),
            acts.saved.len()
        )));
    }
    Ok(())
}

/// One segment's backward from its recorded forward `rec` and `grad_out`, the gradient w.r.t.
/// its output (None: the output is the scalar loss): its parameter gradients and, where its
/// input is the leaf `leaf`, the gradient w.r.t. it. A tape runs its own backward, B alone
/// when `split` (the weight products kept); autograd differentiates `(out · g).sum() + aux`
/// and forms everything at once.
fn segment_backward(
    i: usize,
    seg: &dyn Segment,
    rec: Recorded,
    leaf: Option<&Var>,
    grad_out: Option<&Tensor>,
    loss_scale: f64,
    split: bool,
) -> Result<(WeightGrads, Option<Tensor>)> {
    let mismatch = |out: &Tensor, g: &Tensor| {
        candle_core::Error::Msg(format!(
            "engine backward: segment {i} ({}) output {:?} but grad_output {:?}",
            seg.name(),
            out.dims(),
            g.dims()
        ))
    };
    let (out, aux, params) = match rec {
        Recorded::Graph { out, aux, params } => (out, aux, params),
        Recorded::Tape(tape) => {
            if let Some(g) = grad_out {
                if g.dims() != tape.output().dims() {
                    return Err(mismatch(tape.output(), g));
                }
            }
            let (weights, input) = match split {
                true => {
                    let g = tape.backward_input(grad_out, loss_scale)?;
                    (g.weights, g.input)
                }
                false => {
                    let g = tape.backward(grad_out, loss_scale)?;
                    (WeightGrads::formed(g.params), g.input)
                }
            };
            return Ok((weights, input.filter(|_| leaf.is_some())));
        }
    };
    let mut objective = match grad_out {
        Some(g) => {
            if g.dims() != out.dims() {
                return Err(mismatch(&out, g));
            }
            mtrain_kernels::reduce::sum_all(&(&out * g.to_dtype(out.dtype())?)?)?
        }
        None => {
            if out.elem_count() != 1 {
                return Err(candle_core::Error::Msg(format!(
                    "engine backward: segment {i} ({}) output {:?} is not a scalar loss and no grad_output was given",
                    seg.name(),
                    out.dims()
                )));
            }
            (out.sum_all()? * loss_scale)?
        }
    };
    if let Some(a) = &aux {
        let a = (a.to_dtype(objective.dtype())? * loss_scale)?;
        objective = (objective + a)?;
    }
    let mut store = objective.backward()?;
    let mut weights = WeightGrads::from_autograd();
    for (name, t) in &params {
        let g = match store.remove(t) {
            Some(g) => g,
            // A parameter this call did not reach (an expert that received no token).
            None => t.zeros_like()?,
        };
        weights.push((name.clone(), g));
    }
    let input = match leaf {
        None => None,
        Some(v) => Some(match store.remove(v.as_tensor()) {
            Some(g) => g,
            None => v.as_tensor().zeros_like()?,
        }),
    };
    Ok((weights, input))
}
