//! What the code keeps: the bytes each segment's forward leaves for its backward, and what its
//! backward adds at its worst moment, counted tensor by tensor from the code that runs — not
//! fitted to a measurement. [`super::analytic`] sums these per rank under a plan.
//!
//! Two backward paths run segments (`model/src/engine.rs`, `Recorded::run`): a segment whose
//! `forward_taped` offers a tape runs the hand-written backward, every other one is
//! differentiated by candle's autograd.
//!
//! # Autograd (the reference, and the MoE blocks)
//!
//! candle's graph keeps every tensor an op was applied to, so a segment keeps each output of a
//! plain candle op that a later op consumed: views (`reshape` of a contiguous tensor,
//! `transpose`, `narrow`, `broadcast_as`) share storage, everything else is a new tensor. Per
//! block, in values of `N·C` (`N = b·t` rows; `w` bytes per value of the compute dtype; the
//! LayerNorm, softmax and loss statistics run in f32, so 16-bit inputs add an f32 upcast and a
//! downcast copy):
//!
//! ```text
//!   LayerNorm (×2)        x − mean, (x − mean)², ÷ std, · w, + b       5 f32 (+ up, down for 16-bit)
//!   c_attn                x Wᵀ, + b                                     3 + 3
//!   heads                 q, k, v reshaped (a strided copy), contiguous 3 + 3
//!   attention             q · scale, softmax(…) v, merge (a copy)       1 + 1 + 1
//!   scores (B, H, T, T)   q kᵀ, + mask, − max, exp, ÷ Σ                 S·(w + 4·4) (+ up, down)
//!   c_proj, residual      x Wᵀ, + b, x + a                              2 + 1
//!   MLP                   x Wᵀ + b (4C), gelu (4C), x Wᵀ + b, residual  8 + 4 + 2 + 1
//!   ─────────────────────────────────────────────────────────────────
//!   dense block           27 N·C "inside" (split by tp) + 6 N·C at the width C + 2 LayerNorms + scores
//! ```
//!
//! Tensor parallelism splits the 27 and the scores by `tp` and adds its collectives, each of
//! which keeps its result and a copy (`parallel/src/ops.rs`, `value_with_backward`): the column
//! layer's input copy (f), the row layer's all-reduce result and copy (g); sequence parallelism
//! runs the LayerNorms and residuals on `T/tp` rows and gathers (result + copy) the full sequence
//! before each column layer. The head keeps its LayerNorm, the logits (N, V) and the
//! log-softmax's `− max`, `exp` and `− lse` in f32 (`4·N·V·4` bytes in f32); the embedding the
//! looked-up rows and their sum with the positions. Every segment with a float input also keeps
//! the engine's leaf copy of that input (`Var::from_tensor` copies).
//!
//! candle's backward keeps, until the segment's `backward()` returns, the gradient of every
//! leaf and of every operand that tracks no gradient, and a gradient computed from a forward
//! tensor that tracks gradients carries its own graph until its node is processed. The worst
//! moment of a dense block is the GELU's derivative (`candle-core/src/backprop.rs`, `Gelu`):
//! the gradient of the 4C-wide input holds the 15 tensors of the formula, the zeros it was
//! added to and the incoming gradient, and the next node (the c_fc bias add) adds a sum and two
//! zero-initialised gradients: `21` tensors of `N·4C/tp`, on top of the objective `out · g`,
//! the untracked `g`'s gradient and the residual branch's gradient (3 of the output's size).
//! The softmax's worst moment (its division node: the incoming chain of 3, the numerator's
//! chain of 3, the denominator's of 5) is `11` tensors of the scores, in f32. The head's worst
//! moment is its log-softmax (`7` tensors of N·V in f32: the chain of the `exp` node, the
//! logits' gradient, the untracked max's gradient and a zero-initialised one) or its LayerNorm
//! (the normalisation's three gradient chains, 4 + 3 + 5 tensors of N·C, with the max's
//! gradient and `wte`'s).
//!
//! # Tapes (the hand-written backward, `model/src/explicit.rs`; the default on every device)
//!
//! The dense and tensor-parallel blocks, the heads and the embeddings run graph-free forwards
//! that keep exactly the tensors their `*Tape` structs name:
//!
//! ```text
//!   block   h1, h2 (gathered under sp)                           2 N·C
//!           qkv (3), ym, f (4), g (4), split by tp               12 N·C / tp
//!           x1, out on this rank's rows                          2 N·C (/ tp under sp)
//!           + 4 LayerNorm statistics per row and lse (B·H/tp·T), f32          (tp = 1: 16 N·C)
//!   head    h, logits (N, V), lse (N)      vocab-parallel: h, e^(z − max) (N, V/tp) f32, Σ, row, mask (N)
//!   embedding  out                         vocab-parallel: out, the shard's rows and mask (N)
//! ```
//!
//! (the block input is the previous segment's output, held through the engine's leaf copy) and
//! the backward frees each tensor after its last use; its worst moment is the MLP branch: the
//! incoming gradient (and its all-gather under sp), then `dg` (4C/tp wide) beside `g`, then
//! `df` beside `f`; the head's is `dh` (N, C) beside `dlogits`, which the loss writes over
//! the logits (vocab-parallel: its `dz` statement, four (N, V/tp) f32). The fused kernels
//! (CUDA) and the CPU loops (`kernels/src/cpu.rs`, f32) allocate the same tensors at the same
//! moments, one output per op; the CPU attention also materialises the (T, T) scores: its
//! backward holds at most three score tensors (f32) and four N·C gradients when 11 N·C of the
//! tape are already freed, which stays at or below the MLP moment while `H·T ≤ 4C` at f32 (the
//! tests' sizes and the tiny preset's).
//!
//! MoE blocks have a tape (`model/src/explicit/moe.rs`) but are counted on every path as
//! autograd keeps them ([`moe_block`]), which the tape's forward does not match (it keeps the
//! router's probabilities, the gates, the combined rows and each expert's MLP tensors).
//!
//! # The optimizer step
//!
//! After the backward the activations are gone and the step's level is the gradients plus
//! the optimizer's own worst moment ([`optimizer_step`]); with the tapes' smaller backward it
//! is the step's peak on a pipeline stage or a ZeRO-1/2 rank.
//!
//! Sizes are in bytes, as `f64` so the formulas read as written; callers round once.

use serde::Serialize;

/// How a segment's backward runs, and on which device (the optimizer's update differs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BackwardPath {
    /// candle's autograd over the segment's recorded graph (the oracle, and layers without a
    /// tape), on CPU.
    Autograd,
    /// The hand-written backward passes of the dense and tensor-parallel blocks, the heads and
    /// the embeddings, on the fused CUDA kernels.
    Tapes,
    /// The same tapes on CPU (`kernels/src/cpu.rs`): the same tensors kept and at the same
    /// moments, and the optimizer's update in the CPU loop.
    CpuTapes,
}

impl BackwardPath {
    /// The path a run on `backward` takes for a dense segment on a CUDA device (`cuda`) or on
    /// the CPU.
    pub fn of(backward: mtrain_model::Backward, cuda: bool) -> Self {
        match (backward, cuda) {
            (mtrain_model::Backward::Autograd, _) => BackwardPath::Autograd,
            (mtrain_model::Backward::Tapes, true) => BackwardPath::Tapes,
            (mtrain_model::Backward::Tapes, false) => BackwardPath::CpuTapes,
        }
    }

    /// Whether the segments with a tape run it.
    pub fn taped(&self) -> bool {
        matches!(self, BackwardPath::Tapes | BackwardPath::CpuTapes)
    }

    /// [`BackwardPath::of`] for `device`.
    pub fn on(backward: mtrain_model::Backward, device: &candle_core::Device) -> Self {
        Self::of(backward, device.is_cuda())
    }
}

/// The sizes one segment pass sees.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dims {
    /// Rows of the micro-batch `b`.
    pub b: f64,
    /// Sequence length `T`.
    pub t: f64,
    /// Width `C`.
    pub c: f64,
    /// Heads `H` of the whole model.
    pub h: f64,
    /// Vocabulary `V`.
    pub v: f64,
    /// Tensor-parallel degree.
    pub tp: f64,
    /// Sequence parallelism (LayerNorms and residuals on `T/tp` rows).
    pub sp: bool,
    /// Bytes per value of the compute dtype.
    pub w: f64,
}

/// f32, the dtype of every statistic.
const F32: f64 = 4.0;

impl Dims {
    /// `N·C`: one activation of the block's width.
    fn nc(&self) -> f64 {
        self.b * self.t * self.c
    }

    /// `N·C` on this rank between the linear layers (`/tp` with sequence parallelism).
    pub fn nc_local(&self) -> f64 {
        match self.sp {
            true => self.nc() / self.tp,
            false => self.nc(),
        }
    }

    /// Attention scores of this rank's heads: `b · H/tp · T²`.
    fn scores(&self) -> f64 {
        self.b * (self.h / self.tp) * self.t * self.t
    }

    /// Bytes of the f32 upcast and the downcast copy a 16-bit input adds per value.
    fn casts(&self) -> f64 {
        match self.w < F32 {
            true => F32 + self.w,
            false => 0.0,
        }
    }

    /// One LayerNorm over `rows·C` values: 5 f32 tensors (plus the casts).
    fn layer_norm(&self, values: f64) -> f64 {
        values * (5.0 * F32 + self.casts())
    }
}

/// What one segment pass costs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct SegmentCost {
    /// The engine's leaf copy of a float input (0 for token ids).
    pub input: f64,
    /// What the forward keeps for the backward, its output included.
    pub kept: f64,
    /// What the backward adds on top of `kept` at its worst moment.
    pub transient: f64,
}

/// The embedding: `wte[idx] + wpe` (autograd: the rows and the sum; tp: the vocab-parallel mask
/// product and the all-reduce's result and copy, or reduce-scatter with sp; tapes: the output,
/// and under tp the shard's rows and mask, (N,) u32 and f32).
pub fn embedding(d: &Dims, path: BackwardPath) -> SegmentCost {
    let (nc, w, n) = (d.nc(), d.w, d.b * d.t);
    let tp = d.tp > 1.0;
    let kept = match (path.taped(), tp) {
        (true, false) => nc * w,
        (true, true) => d.nc_local() * w + 2.0 * n * F32,
        (_, false) => 2.0 * nc * w,
        (_, true) => {
            // rows, · mask, then (all-reduce or reduce-scatter) result + copy, + positions
            (2.0 * nc + 3.0 * d.nc_local()) * w
        }
    };
    let transient = match (path.taped(), tp) {
        // The output's gradient, the all-gather of it (sp) and its product with the mask.
        (true, true) => (d.nc_local() + nc + sp_only(d, nc)) * w,
        // The output's gradient and its sum over the batch.
        _ => 2.0 * d.nc_local() * w,
    };
    SegmentCost {
        input: 0.0,
        kept,
        transient,
    }
}

/// `x` under sequence parallelism, else 0.
fn sp_only(d: &Dims, x: f64) -> f64 {
    match d.sp {
        true => x,
        false => 0.0,
    }
}

/// A dense block (see the module tables).
pub fn block(d: &Dims, path: BackwardPath) -> SegmentCost {
    let (nc, w, tp) = (d.nc(), d.w, d.tp);
    let (input, local) = (d.nc_local() * w, d.nc_local());
    if path.taped() {
        // h1, h2 whole (gathered under sp), the 12 between the linears split by tp, x1 and the
        // output on this rank's rows; the LayerNorm statistics of those rows, lse of its heads.
        let rows = local / d.c;
        let stats = 4.0 * rows * F32 + d.b * (d.h / tp) * d.t * F32;
        return SegmentCost {
            input,
            kept: (2.0 * nc + 12.0 * nc / tp + 2.0 * local) * w + stats,
            // The incoming gradient, its all-gather (sp), then dg (4C/tp wide) beside g, then
            // df beside f.
            transient: (local + sp_only(d, nc) + 4.0 * nc / tp) * w,
        };
    }
    let scores = d.scores() * (w + 4.0 * F32 + d.casts());
    let inside = 27.0 * nc / tp * w;
    // At the width C, per branch (attention, MLP): dense c_proj + bias and the residual (3);
    // tp: f's copy, the partial product, g's result and copy, + bias, residual (6);
    // sp: the gather's result and copy, the partial product (3 at N·C) and the reduce-scatter's
    // result and copy, + bias, residual (4 at N·C/tp).
    let width = match (tp > 1.0, d.sp) {
        (false, _) => 2.0 * 3.0 * nc,
        (true, false) => 2.0 * 6.0 * nc,
        (true, true) => 2.0 * (3.0 * nc + 4.0 * nc / tp),
    } * w;
    let norms = 2.0 * d.layer_norm(d.nc_local());
    SegmentCost {
        input,
        kept: norms + inside + width + scores,
        transient: autograd_block_transient(d, 4.0 * nc / tp),
    }
}

/// The worst moment of an autograd block's backward: the GELU's derivative over `gelu_values`
/// (21 tensors) or the softmax's division (11 f32 tensors of the scores), on top of 3 tensors
/// of the block's output size.
fn autograd_block_transient(d: &Dims, gelu_values: f64) -> f64 {
    let base = 3.0 * d.nc_local() * d.w;
    let gelu = 21.0 * gelu_values * d.w;
    let softmax = 11.0 * d.scores() * F32;
    base + gelu.max(softmax)
}

/// What the optimizer step adds above the gradients it still holds, at its worst moment:
///
/// ```text
///   update     the CPU loop (kernels/src/adamw/one_pass.rs, f32) and the fused kernel (CUDA)
///              write weights and moments in place: nothing; with fp32 masters behind a bf16
///              copy (`masters`) the CPU loop makes a new master, m and v of the tensor being
///              stepped = 3 of the largest stepped tensor (`largest` bytes, f32), the old ones
///              freed after it
///   write-back ZeRO-1/2 (parallel/src/fsdp/mod.rs, after_optimizer_step): each unit's
///              updated shard joined and all-gathered, the next unit's gather running while one
///              is written, so `gathered` = two consecutive units' full weights plus the shards
///              sent
/// ```
pub fn optimizer_step(largest: f64, gathered: f64, path: BackwardPath, masters: bool) -> f64 {
    let update = match (path, masters) {
        (BackwardPath::Tapes, _) | (_, false) => 0.0,
        (_, true) => 3.0 * largest,
    };
    update.max(gathered)
}

/// The rows one MoE layer dispatched on a rank in one pass.
///
/// How many rows the experts compute depends on where the router sends the tokens: `mtrain
/// plan` assumes every slot filled and an even split ([`Routing::even`]); the report, after a
/// step, takes the rows that step's router actually dispatched (its expert load).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Routing {
    /// Rows this rank's tokens filled (`top_k · N` less the choices dropped at capacity).
    pub sent: f64,
    /// Rows this rank's experts computed.
    pub received: f64,
    /// Rows of this rank's busiest expert.
    pub busiest: f64,
}

impl Routing {
    /// Every one of the `top_k · n_tokens` slots filled, the same rows for each of the `n_experts`
    /// experts, `n_experts / ep` on each rank.
    pub fn even(n_tokens: f64, n_experts: usize, top_k: usize, ep: usize) -> Self {
        let slots = top_k as f64 * n_tokens;
        let local = (n_experts as f64 / ep.max(1) as f64).max(1.0);
        Self {
            sent: slots,
            received: slots,
            busiest: slots / local,
        }
    }
}

/// A mixture-of-experts block as autograd keeps it (its tape's forward keeps other tensors;
/// see the module doc): attention as in [`block`], then the router and
/// the routed rows of `routing` (`S` sent, `R` received; one expert MLP per local expert):
///
/// ```text
///   ep = 1   per routed row: index_select, c_fc + b (4C + 4C), gelu (4C), c_proj + b, · gate = 16 C
///            per expert: the index_add's new (N, C), and the zeros it starts from
///   ep > 1   sent rows S:     x_perm, the combine all-to-all's result and copy, · gate (4 C)
///            received rows R: the dispatch all-to-all's result and copy, the expert-major
///                             copy, the experts (14 C), cat, the inverse gather (19 C)
///            zeros and index_add (2 N·C)
/// ```
pub fn moe_block(d: &Dims, n_experts: usize, ep: usize, routing: &Routing) -> SegmentCost {
    let (nc, w) = (d.nc(), d.w);
    let (e, ep) = (n_experts as f64, ep.max(1) as f64);
    let (sent, received) = (routing.sent * d.c, routing.received * d.c);
    let scores = d.scores() * (w + 4.0 * F32 + d.casts());
    // Attention as in the dense block: 18 N·C (c_attn 6, heads 6, scale, ·v, merge, c_proj 2,
    // residual), the MLP half replaced by the experts and the block's residual.
    let attention = 18.0 * nc * w + scores;
    let experts = match ep > 1.0 {
        false => 16.0 * received + (e + 1.0) * nc,
        true => 4.0 * sent + 19.0 * received + 2.0 * nc,
    } * w;
    // Router logits and softmax (N, E) in f32: logits, − max, exp, ÷ Σ.
    let router = 4.0 * d.b * d.t * e * F32;
    let residual = nc * w;
    let norms = 2.0 * d.layer_norm(nc);
    SegmentCost {
        input: nc * w,
        kept: norms + attention + experts + router + residual,
        // The busiest expert's GELU.
        transient: autograd_block_transient(d, 4.0 * routing.busiest * d.c),
    }
}

/// The head: final LayerNorm, logits against the tied `wte`, mean cross-entropy.
pub fn head(d: &Dims, path: BackwardPath) -> SegmentCost {
    let (nc, w, tp) = (d.nc(), d.w, d.tp);
    let nv = d.b * d.t * d.v / tp;
    let input = d.nc_local() * w;
    match (path.taped(), tp > 1.0) {
        (true, false) => {
            return SegmentCost {
                input,
                kept: nc * w + nv * w + d.b * d.t * F32,
                // dlogits written over the logits, with the row gradients (N,) and, on CPU,
                // the target ids (N,); then dh (N, C) beside them.
                transient: (2.0 * d.b * d.t * F32).max(nc * w),
            };
        }
        (true, true) => {
            // The vocab-parallel tape (`parallel/src/tensor_parallel/vocab.rs`): h (gathered
            // under sp), e^(z − max) (N, V/tp) f32, and per row Σ, the target's row and mask.
            return SegmentCost {
                input,
                kept: nc * w + nv * F32 + 3.0 * d.b * d.t * F32,
                // dz's statement: the one-hot mask, e/Σ, − mask and · s/N, all (N, V/tp) f32.
                transient: 4.0 * nv * F32,
            };
        }
        _ => {}
    }
    let norm = d.layer_norm(d.nc_local());
    // f: the copy (tp), or the sequence gather's result and copy (sp).
    let into_tp = match (tp > 1.0, d.sp) {
        (false, _) => 0.0,
        (true, false) => nc * w,
        (true, true) => 2.0 * nc * w,
    };
    // logits, the f32 upcast of 16-bit logits, then − max, exp (and − lse for the dense loss).
    let loss_tensors = match tp > 1.0 {
        true => 2.0,
        false => 3.0,
    };
    let logits = nv * (w + d.casts().min(F32) + loss_tensors * F32);
    let softmax_phase = 7.0 * nv * F32;
    let norm_phase = 12.0 * d.nc_local() * F32 + nv * F32 + d.c * d.v / tp * w;
    SegmentCost {
        input,
        kept: norm + into_tp + logits,
        transient: softmax_phase.max(norm_phase),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(c: f64, w: f64) -> Dims {
        Dims {
            b: 16.0,
            t: 64.0,
            c,
            h: 4.0,
            v: 256.0,
            tp: 1.0,
            sp: false,
            w,
        }
    }

    const MIB: f64 = (1u64 << 20) as f64;

    /// The default tiny run (16 × 64 tokens, width 64, fp32): a block keeps 43 N·C of 256 KiB
    /// and 5 score tensors of 1 MiB, the head 5 N·C and 4 N·V of 1 MiB, the embedding 2 N·C —
    /// 4 · 15.75 + 5.25 + 0.5 MiB plus the five leaf copies.
    #[test]
    fn the_tiny_runs_tensors_add_up() {
        let d = tiny(64.0, 4.0);
        let blk = block(&d, BackwardPath::Autograd);
        assert_eq!(blk.kept / MIB, 43.0 / 4.0 + 5.0);
        assert_eq!(head(&d, BackwardPath::Autograd).kept / MIB, 5.0 / 4.0 + 4.0);
        assert_eq!(embedding(&d, BackwardPath::Autograd).kept / MIB, 0.5);
        // GELU's derivative over (N, 4C): 21 · 1 MiB, on top of 3 · 256 KiB.
        assert_eq!(blk.transient / MIB, 21.0 + 0.75);
        // Tapes: 16 N·C, the statistics and lse.
        let tape = block(&d, BackwardPath::Tapes);
        assert!(
            (tape.kept / MIB - 16.0 / 4.0).abs() < 0.04,
            "{}",
            tape.kept / MIB
        );
    }

    /// Tensor parallelism at tp = 2 splits the 27 inside values and the scores, keeps the
    /// width-C tensors and adds the collectives' copies; sequence parallelism moves the
    /// LayerNorms and residuals to T/tp rows.
    #[test]
    fn tensor_and_sequence_parallel_split_what_they_split() {
        let one = tiny(64.0, 4.0);
        let tp = Dims { tp: 2.0, ..one };
        let sp = Dims { sp: true, ..tp };
        let nc = one.nc() * 4.0;
        let s = one.scores() * 20.0;
        let k = |d: &Dims| block(d, BackwardPath::Autograd).kept;
        assert_eq!(k(&one), 10.0 * nc + 27.0 * nc + 6.0 * nc + s);
        assert_eq!(k(&tp), 10.0 * nc + 13.5 * nc + 12.0 * nc + s / 2.0);
        assert_eq!(k(&sp), 5.0 * nc + 13.5 * nc + 6.0 * nc + 4.0 * nc + s / 2.0);
    }
}
