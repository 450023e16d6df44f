//! The interface between a hand-written backward pass and the engine: a segment's graph-free
//! forward returns a [`Tape`] holding what its backward needs, and the engine calls
//! [`Tape::backward`] in place of autograd ([`crate::engine::Backward`] says where).
//! The tapes of the GPT's segments are in [`crate::explicit`]. A linear layer runs in a tape
//! as a [`TapedLinear`]: the dense one here ([`crate::explicit::DenseTape`]), tensor
//! parallelism's column and row layers with their collectives in the parallel crate. Other
//! sharded parts hand the tape their communication as values of [`Collective`] (sequence
//! parallelism's entry into a block, the vocabulary's) and [`Exchange`] (expert parallelism).
//!
//! A tape's backward can also run split in two, as zero-bubble pipeline schedules want it
//! (Qi et al. 2023): B, [`Tape::backward_input`], the input gradient the previous stage waits
//! for, which leaves the weight products `dW = dyᵀ·x` unformed in a [`WeightGrads`]; and W,
//! [`WeightGrads::finish`], which forms them later, when nobody waits:
//!
//! ```text
//!   fused:  dx, [dW₁ = dy₁ᵀ·x₁, db₁, …]            one call
//!   B:      dx, kept [(dy₁, x₁), …], formed [db₁, LayerNorm's dγ dβ, …]
//!   W:      [dy₁ᵀ·x₁, …] ++ formed                  the same products, in the same order
//! ```
//! A bias or a LayerNorm gradient comes out of the kernel that computes dx, so B forms it;
//! every matrix product that only a weight gradient needs waits for W.

use std::ops::Range;

use candle_core::{DType, Device, Result, Tensor};
use mtrain_kernels::linear;

use crate::moe::stats::MoeStats;
use crate::param::Param;

/// A parameter as a tape keeps it: its slot, not the tensor in it. The forward reads the weight
/// from the slot when it runs and the backward reads it again, so a tape never owns a weight:
/// ZeRO-3 can free a segment's gathered weights right after its forward and gather them back
/// into the slots before its backward (`parallel/src/fsdp/scheduler.rs`); everywhere else the
/// slot holds the same tensor at both reads.
///
/// ```text
///   forward   w = slot.get()  (gathered)  ──compute──>  drop w   ─ free: slot = placeholder
///   backward  gather into the slot        w = slot.get()  ──dx = dy·w──>  drop w
/// ```
#[derive(Clone)]
pub struct SlotWeight {
    param: Param,
    /// The shape, dtype and device the forward read.
    dims: Vec<usize>,
    dtype: DType,
    device: Device,
}

impl SlotWeight {
    /// The slot of `param`, remembering the weight it holds now.
    pub fn of(param: &Param) -> SlotWeight {
        let var = param.var();
        SlotWeight {
            dims: var.dims().to_vec(),
            dtype: var.dtype(),
            device: var.device().clone(),
            param: param.clone(),
        }
    }

    /// The parameter's name.
    pub fn name(&self) -> &str {
        self.param.name()
    }

    /// The dtype the forward read.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The weight in the slot now, detached; an error naming the parameter when its shape is
    /// not the one the forward read (its gathered weight was freed and not gathered again).
    pub fn get(&self) -> Result<Tensor> {
        let t = self.param.tensor().detach();
        if t.dims() != self.dims.as_slice() {
            return Err(candle_core::Error::Msg(format!(
                "`{}` holds {:?} where its forward read {:?}: a sharded weight must be gathered \
                 into its slot before the backward that reads it",
                self.param.name(),
                t.dims(),
                self.dims
            )));
        }
        Ok(t)
    }

    /// Zeros of the weight's shape and dtype, without reading the slot.
    pub fn zeros(&self) -> Result<Tensor> {
        Tensor::zeros(self.dims.as_slice(), self.dtype, &self.device)
    }
}

/// Gradients a tape's backward returns.
pub struct TapeGrads {
    /// Parameter gradients by name, in the parameters' dtype.
    pub params: Vec<(String, Tensor)>,
    /// Gradient w.r.t. the segment's input (None for integer token ids).
    pub input: Option<Tensor>,
}

/// The weight gradients of one tape's backward: formed as they come (the fused backward), or,
/// for B of a split backward, with each weight product `dW = dyᵀ·x` (out, in) kept as its two
/// factors dy (N, out) and x (N, in) until [`WeightGrads::finish`] (W) forms it.
pub struct WeightGrads {
    defer: bool,
    /// Whether the gradients may share buffers with tensors read later (autograd's store: a
    /// sum's operands get one gradient); a tape's are its own fresh results.
    shared: bool,
    /// In the order they were given; a deferred product holds its place.
    grads: Vec<(String, WeightGrad)>,
}

enum WeightGrad {
    Formed(Tensor),
    /// dyᵀ·x, not taken yet.
    Product {
        dy: Tensor,
        x: Tensor,
    },
}

impl WeightGrad {
    /// The gradient as a tensor (out, in): a kept product formed now.
    fn formed(self) -> Result<Tensor> {
        match self {
            WeightGrad::Formed(t) => Ok(t),
            WeightGrad::Product { dy, x } => mtrain_kernels::matmul(&dy.t()?, &x), // (out, in)
        }
    }

    /// The sum of one parameter's gradients from parts of its rows: kept products stay one
    /// product of the rows stacked; otherwise each is formed and they are added.
    fn sum(mut parts: Vec<WeightGrad>) -> Result<WeightGrad> {
        if parts.len() == 1 {
            return Ok(parts.remove(0));
        }
        if parts
            .iter()
            .all(|g| matches!(g, WeightGrad::Product { .. }))
        {
            let (mut dys, mut xs) = (Vec::new(), Vec::new());
            for g in parts {
                if let WeightGrad::Product { dy, x } = g {
                    dys.push(dy);
                    xs.push(x);
                }
            }
            return Ok(WeightGrad::Product {
                dy: Tensor::cat(&dys, 0)?, // (Σ N_i, out)
                x: Tensor::cat(&xs, 0)?,   // (Σ N_i, in)
            });
        }
        let mut formed = parts.into_iter().map(WeightGrad::formed);
        let first = formed
            .next()
            .ok_or_else(|| candle_core::Error::Msg("a weight gradient of no parts".into()))??;
        let total = formed.try_fold(first, |t, g| t.add(&g?))?;
        Ok(WeightGrad::Formed(total))
    }
}

impl WeightGrads {
    /// Every gradient formed when it is given: the fused backward.
    pub fn now() -> Self {
        Self {
            defer: false,
            shared: false,
            grads: Vec::new(),
        }
    }

    /// Gradients taken from autograd's store, which may share buffers with other gradients.
    pub fn from_autograd() -> Self {
        Self {
            shared: true,
            ..Self::now()
        }
    }

    /// Whether each gradient is the pass's own fresh buffer ([`crate::Grads::accumulate_fresh`]).
    pub fn fresh(&self) -> bool {
        !self.shared
    }

    /// Whether weight products are kept for later (B of a split backward) rather than formed.
    pub fn defers(&self) -> bool {
        self.defer
    }

    /// The weight products kept for later: B of a split backward.
    pub fn deferred() -> Self {
        Self {
            defer: true,
            shared: false,
            grads: Vec::new(),
        }
    }

    /// Gradients already formed (what a tape without a split backward returns).
    pub fn formed(grads: Vec<(String, Tensor)>) -> Self {
        Self {
            defer: false,
            shared: false,
            grads: grads
                .into_iter()
                .map(|(n, g)| (n, WeightGrad::Formed(g)))
                .collect(),
        }
    }

    /// A gradient formed by the pass itself (a bias, a LayerNorm's, an embedding's).
    pub fn push(&mut self, (name, g): (String, Tensor)) {
        self.grads.push((name, WeightGrad::Formed(g)));
    }

    /// The weight gradient `dyᵀ·x` (out, in) of a linear y = x Wᵀ, from dy (N, out) and x
    /// (N, in): taken now, or kept for [`WeightGrads::finish`] when deferred.
    pub fn product(&mut self, name: String, dy: &Tensor, x: &Tensor) -> Result<()> {
        let g = match self.defer {
            true => WeightGrad::Product {
                dy: dy.clone(),
                x: x.clone(),
            },
            false => WeightGrad::Formed(mtrain_kernels::matmul(&dy.t()?, x)?), // (out, in)
        };
        self.grads.push((name, g));
        Ok(())
    }

    /// A linear layer's gradients from dy (N, out) and x (N, in), dy over the rows its `bias`
    /// was added to: dW = dyᵀ·x and db = Σ_rows dy, in one GEMM (the bias gradient its
    /// epilogue, [`linear::weight_grad`]) when formed now; db now and dW kept when deferred.
    pub fn linear(
        &mut self,
        (w_name, b_name): (String, String),
        dy: &Tensor,
        x: &Tensor,
        bias: &Tensor,
    ) -> Result<()> {
        if self.defer {
            let db = mtrain_kernels::bias::grad(dy, bias)?; // (out,)
            self.product(w_name, dy, x)?;
            self.push((b_name, db));
            return Ok(());
        }
        let (dw, db) = linear::weight_grad(dy, x, bias)?; // (out, in), (out,)
        self.push((w_name, dw));
        self.push((b_name, db));
        Ok(())
    }

    /// An empty list that forms or keeps products as this one does.
    pub fn like(&self) -> Self {
        Self {
            grads: Vec::new(),
            ..*self
        }
    }

    /// Whether no gradient has been given.
    pub fn is_empty(&self) -> bool {
        self.grads.is_empty()
    }

    /// `other`'s gradients appended, those it holds twice under one name summed (a layer run
    /// on its rows in parts: dW = Σ_parts dyᵢᵀ·xᵢ, kept products as one product of the parts'
    /// rows stacked, [dy₀; dy₁]ᵀ·[x₀; x₁]), in the order each name first came; a product
    /// `other` kept is formed now where this list forms its products as they come.
    pub fn append_summed(&mut self, other: WeightGrads) -> Result<()> {
        let mut merged: Vec<(String, Vec<WeightGrad>)> = Vec::with_capacity(other.grads.len());
        for (name, g) in other.grads {
            match merged.iter_mut().find(|(n, _)| *n == name) {
                Some((_, parts)) => parts.push(g),
                None => merged.push((name, vec![g])),
            }
        }
        for (name, parts) in merged {
            let g = match (WeightGrad::sum(parts)?, self.defer) {
                (g, true) => g,
                (g, false) => WeightGrad::Formed(g.formed()?),
            };
            self.grads.push((name, g));
        }
        Ok(())
    }

    /// Bytes of the factors kept for W (0 when nothing is deferred).
    pub fn held_bytes(&self) -> usize {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        self.grads
            .iter()
            .map(|(_, g)| match g {
                WeightGrad::Formed(_) => 0,
                WeightGrad::Product { dy, x } => bytes(dy) + bytes(x),
            })
            .sum()
    }

    /// Every gradient by name, the kept products formed now (W), in the order they were given.
    pub fn finish(self) -> Result<Vec<(String, Tensor)>> {
        self.grads
            .into_iter()
            .map(|(name, g)| Ok((name, g.formed()?)))
            .collect()
    }
}

/// What B of a split backward returns: the input gradient, and the weight gradients W forms.
pub struct SplitGrads {
    /// Gradient w.r.t. the segment's input (None for integer token ids).
    pub input: Option<Tensor>,
    pub weights: WeightGrads,
}

/// What a segment's graph-free forward keeps, and the backward that consumes it.
pub trait Tape: Send {
    /// The segment's output (the scalar loss for a head given targets).
    fn output(&self) -> &Tensor;
    /// The segment's auxiliary loss (already times its coefficients; a mixture of experts'
    /// load-balancing and z-losses), whose gradient times `loss_scale` [`Tape::backward`]
    /// adds, as the engine adds `loss_scale · aux` to autograd's objective. None: no such loss.
    fn aux_loss(&self) -> Option<&Tensor> {
        None
    }
    /// Routing statistics, for a segment with a mixture of experts.
    fn stats(&self) -> Option<MoeStats> {
        None
    }
    /// Gradients for `grad_out`, the gradient w.r.t. the output; None when the output is the
    /// scalar loss, whose gradient is `loss_scale`.
    fn backward(self: Box<Self>, grad_out: Option<&Tensor>, loss_scale: f64) -> Result<TapeGrads>;
    /// B of a split backward: the input gradient now, the weight products kept in the
    /// returned [`WeightGrads`] for W. By default the fused backward, whose gradients W then
    /// only hands over (a tape that keeps nothing back).
    fn backward_input(
        self: Box<Self>,
        grad_out: Option<&Tensor>,
        loss_scale: f64,
    ) -> Result<SplitGrads> {
        let g = self.backward(grad_out, loss_scale)?;
        Ok(SplitGrads {
            input: g.input,
            weights: WeightGrads::formed(g.params),
        })
    }
}

/// A linear layer `y = x Wᵀ + b` as a tape runs it: its forward on the rows (N, in) of a batch
/// of `b` sequences, and its hand-written backward, with whatever communication its split needs
/// (none for the dense layer; f or g for tensor parallelism's column and row layers). Each
/// forward returns the product's input, which the backward takes back as `x`.
pub trait TapedLinear: Send + Sync {
    /// This rank's weight (out, in), read from its slot ([`SlotWeight`]).
    fn weight(&self) -> Result<Tensor>;
    /// x (N, in) -> (the product's input, y (N', out)).
    fn forward(&self, x: &Tensor, b: usize) -> Result<(Tensor, Tensor)>;
    /// `r + y` for r (N', out): the layer and the residual add after it, the bias added in
    /// the same pass as the residual where no collective sits between.
    fn forward_residual(&self, r: &Tensor, x: &Tensor, b: usize) -> Result<(Tensor, Tensor)>;
    /// [`TapedLinear::forward`] then GELU: (the product's input, f = y, gelu(f)).
    fn forward_gelu(&self, x: &Tensor, b: usize) -> Result<(Tensor, Tensor, Tensor)>;
    /// dx (rows of the layer's input) from the product's input x and dy (N', out); dW and db
    /// pushed to `grads`. With `gelu_of` = f, where the layer's input was gelu(f): the
    /// gradient carried through that GELU, df.
    fn backward(
        &self,
        x: &Tensor,
        dy: &Tensor,
        b: usize,
        grads: &mut WeightGrads,
        gelu_of: Option<&Tensor>,
    ) -> Result<Tensor>;
    /// Zero gradients for the weight and bias, for a layer no row reached (an expert).
    fn zero_grads(&self, grads: &mut WeightGrads) -> Result<()>;

    /// [`TapedLinear::forward`], or with `r` [`TapedLinear::forward_residual`], on an input
    /// that the sub-layer before makes a chunk of sequences at a time: `make(seqs)` gives the
    /// rows (N_i, in) of sequences `seqs` of the `b`. A layer that overlaps its collective with
    /// compute (tensor parallelism's row layer under `--tp-overlap chunked`) asks for chunk
    /// after chunk and sends each chunk's sum while the next chunk is made, so that the whole
    /// sub-layer, not only this product, hides the wire; any other asks for all `b` at once.
    /// Returns the product's input (all rows) and the output.
    fn forward_from(
        &self,
        r: Option<&Tensor>,
        b: usize,
        make: &mut dyn FnMut(Range<usize>) -> Result<Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let x = make(0..b)?; // (N, in)
        match r {
            Some(r) => self.forward_residual(r, &x, b),
            None => self.forward(&x, b),
        }
    }

    /// [`TapedLinear::backward`] (no GELU before the layer) on an output gradient made a chunk
    /// of sequences at a time, `make(seqs)` giving dy's rows of sequences `seqs`: the conjugate
    /// of [`TapedLinear::forward_from`] for a layer that reduces its input gradient (the column
    /// layer's f), whose sum of chunk i is on the wire while chunk i+1's gradient is made.
    fn backward_from(
        &self,
        x: &Tensor,
        b: usize,
        grads: &mut WeightGrads,
        make: &mut dyn FnMut(Range<usize>) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let dy = make(0..b)?; // (N', out)
        self.backward(x, &dy, b, grads, None)
    }
}

/// The rows of sequences `seqs` in a (b·T, F) activation of `b` sequences (all of it, not a
/// view, when `seqs` is every sequence).
pub fn rows_of(x: &Tensor, b: usize, seqs: &Range<usize>) -> Result<Tensor> {
    if seqs.start == 0 && seqs.end == b {
        return Ok(x.clone());
    }
    let t = x.dim(0)? / b;
    x.narrow(0, seqs.start * t, seqs.len() * t) // (len·T, F)
}

/// Chunks' rows (N_i, F) laid end to end again: (Σ N_i, F).
pub fn cat_rows(mut parts: Vec<Tensor>) -> Result<Tensor> {
    match parts.len() {
        1 => Ok(parts.remove(0)),
        _ => Tensor::cat(&parts, 0),
    }
}

/// A collective that a sharded layer puts into a tape's forward, and its conjugate, which the
/// tape's backward runs on the gradient at the same place: tensor parallelism's f and g and
/// their sequence-parallel halves. Both directions take and return activations (B, T, F). The
/// model crate knows no ranks; the parallel crate implements this for its layers.
pub trait Collective: Send + Sync {
    /// The forward communication (f: none; g: all-reduce; sequence parallelism: all-gather or
    /// reduce-scatter along T).
    fn forward(&self, x: &Tensor) -> Result<Tensor>;
    /// The conjugate on the gradient (f: all-reduce; g: none; the other sequence half).
    fn backward(&self, dy: &Tensor) -> Result<Tensor>;
}

/// Expert parallelism's row exchange, as a tape runs it: the rows of this rank's kept
/// (token, expert) pairs go to the ranks holding their experts (dispatch) and the experts'
/// outputs come back (combine). Both are one all-to-all along dim 0 with the splits swapped,
/// so the backward of a dispatch is a combine over the same counts and vice versa. The model
/// crate knows no ranks; the parallel crate implements this over its ep group.
pub trait Exchange: Send + Sync {
    /// Ranks of the group; rank p holds experts `p · E_l .. (p + 1) · E_l`.
    fn size(&self) -> usize;
    /// The counts all-to-all: `counts` (ranks · m,) are m counts for each rank (the rows this
    /// rank sends to each of its E_l experts, per part of the tokens: m = parts · E_l); returns
    /// (ranks · m,), entry `s · m + i` rank s's count i for this rank.
    fn counts(&self, counts: &[usize]) -> Result<Vec<usize>>;
    /// Into how many parts a layer cuts its tokens for [`Exchange::round_trip`]: 1, or more
    /// under the pipelined overlap (`--ep-overlap`).
    fn parts(&self) -> usize;
    /// The dispatch, the experts and the combine of each part of a layer's rows, in order:
    /// part i's rows (S_i, F) go out by its splits, `experts(i, rows)` runs on the (R_i, F)
    /// rows that came in, and its result goes back by the same splits swapped; returns each
    /// part's (S_i, F). Each all-to-all is waited where it is issued, or, under the pipelined
    /// overlap, the next part's dispatch and the previous part's combine are on the wire while
    /// `experts` computes. Then `tail()`, work that needs every part's experts but none of the
    /// rows coming back (the backward's weight products), while the last combine is on the wire
    /// under the overlap, after it inline. The forward and the backward both run through it
    /// (the backward's dispatch carries output gradients, its combine input gradients).
    fn round_trip(
        &self,
        parts: Vec<PartRows<'_>>,
        experts: &mut dyn FnMut(usize, Tensor) -> Result<Tensor>,
        tail: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Vec<Tensor>>;
    /// The dispatch as the autograd path records it: [`Exchange::rows`] of x (S, F) by the
    /// dispatch's splits, whose backward sends the gradient back the reverse way.
    fn dispatch(&self, x: &Tensor, send: &[usize], recv: &[usize]) -> Result<Tensor>;
    /// The combine, recorded likewise: y (R, F) back by the dispatch's splits swapped.
    fn combine(&self, y: &Tensor, send: &[usize], recv: &[usize]) -> Result<Tensor>;
}

/// One part of a layer's rows on their way to the experts ([`Exchange::round_trip`]): `x`
/// (S_i, F) grouped by destination rank, `send[p]` rows to rank p, `recv[s]` rows from rank s.
pub struct PartRows<'a> {
    pub x: Tensor,
    pub send: &'a [usize],
    pub recv: &'a [usize],
}

/// A block's attention over the sequence, as a tape runs it: packed q | k | v of this rank's
/// tokens (B, T_r, 3·H·D) in, the output (B, T_r, H·D) out. One device's is the causal
/// kernels over the whole sequence ([`crate::explicit::LocalAttention`]); context parallelism's
/// holds 1/cp of the sequence and brings the other ranks' keys and values around a ring (the
/// parallel crate's `context_parallel`). The model crate knows no ranks.
pub trait SequenceAttention: Send + Sync {
    /// The positions of the whole sequence that this rank's `t_r` rows hold (all of them on
    /// one device), which place the block's dropout masks.
    fn positions(&self, t_r: usize) -> crate::chunks::Positions;
    /// The output (B, T_r, H·D) of `h` heads at `scale`, the probabilities dropped by `probs`
    /// (the mask of the whole sequence's (T, T) probabilities, of which this rank draws the
    /// (query, key) pairs it computes), and what the backward needs.
    fn forward(
        &self,
        qkv: &Tensor,
        h: usize,
        scale: f64,
        probs: Option<&mtrain_kernels::dropout::Mask>,
    ) -> Result<(Tensor, Box<dyn AttentionKept>)>;
}

/// What a [`SequenceAttention`]'s forward kept for its backward.
pub trait AttentionKept: Send {
    /// dqkv (B, T_r, 3·H·D) from the forward's output `y` and its gradient `dy` (B, T_r, H·D).
    fn backward(self: Box<Self>, y: &Tensor, dy: &Tensor) -> Result<Tensor>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f32], rows: usize) -> Tensor {
        Tensor::from_vec(v.to_vec(), (rows, v.len() / rows), &Device::Cpu).unwrap()
    }

    /// A layer's gradients from two parts of its rows, appended summed to a list that forms or
    /// keeps its products: formed ones added, kept products stacked into one product (formed
    /// now by a forming list), each equal to the gradient of all rows at once.
    #[test]
    fn gradients_of_parts_append_as_their_sum() {
        let (dy0, x0) = (t(&[1., 2., 3., 4.], 2), t(&[5., 6., 7., 8., 9., 10.], 2)); // (2, 2), (2, 3)
        let (dy1, x1) = (t(&[-1., 0.5], 1), t(&[2., -3., 4.], 1)); // (1, 2), (1, 3)
        let all = Tensor::cat(&[&dy0, &dy1], 0).unwrap().t().unwrap();
        let want = all.matmul(&Tensor::cat(&[&x0, &x1], 0).unwrap()).unwrap(); // (2, 3)
        let lists = [WeightGrads::now, WeightGrads::deferred];
        for (mut grads, mut parts) in lists
            .iter()
            .flat_map(|a| lists.iter().map(move |b| (a(), b())))
        {
            parts.product("w".into(), &dy0, &x0).unwrap();
            parts.push(("b".into(), t(&[1., 1.], 1)));
            parts.product("w".into(), &dy1, &x1).unwrap();
            parts.push(("b".into(), t(&[2., 3.], 1)));
            grads.append_summed(parts).unwrap();
            if !grads.defers() {
                assert_eq!(
                    grads.held_bytes(),
                    0,
                    "a forming list holds no kept product"
                );
            }
            let got = grads.finish().unwrap();
            assert_eq!(
                got.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
                ["w", "b"]
            );
            let diff = (&got[0].1 - &want)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap();
            assert!(diff.to_scalar::<f32>().unwrap() < 1e-6);
            assert_eq!(got[1].1.to_vec2::<f32>().unwrap(), [[3., 4.]]);
        }
    }
}
