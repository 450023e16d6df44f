//! `--tp-overlap ring`: sequence parallelism's all-gather and reduce-scatter decomposed into
//! tp steps of send/receive around the group, each step's product on the part of the sequence
//! at hand while the next part is on the wire (Wang et al. 2023, "Overlap communication with
//! dependent computation via decomposition"; Transformer Engine's userbuffers ring exchange,
//! JAX's collective matmul, torchtitan's async TP).
//!
//! Rank r holds part r of every sequence (positions `chunk_range(T, tp, r)`); it sends to
//! r + 1 and receives from r − 1. The all-gather before a column-parallel product:
//!
//! ```text
//!   tp = 4, rank 0     step 0        step 1        step 2        step 3
//!   compute            x_0 W_rᵀ      x_3 W_rᵀ      x_2 W_rᵀ      x_1 W_rᵀ
//!   wire               x_0 → 1       x_3 → 1       x_2 → 1
//!                      x_3 ← 3       x_2 ← 3       x_1 ← 3        y = [y_0; y_1; y_2; y_3] along T
//! ```
//!
//! and the reduce-scatter after a row-parallel product, where what travels is a running sum:
//! the sum for part c starts at rank c + 1 and gathers one rank's partial product per hop,
//! arriving complete at rank c after tp − 1 hops:
//!
//! ```text
//!   tp = 4, rank 0     step 0        step 1              step 2              step 3
//!   compute            P_3 = x W_rᵀ|₃  P_2               P_1                 P_0
//!   wire               P_3 → 1       (P_2 + S_2) → 1     (P_1 + S_1) → 1
//!                                    S_2 ← 3             S_1 ← 3             S_0 ← 3    y_0 = S_0 + P_0
//! ```
//!
//! Each step's product is computed while the previous step's message is on the wire. A step
//! sends its part in [`PIECES`] pieces of rows, each passed on as soon as it is at hand, so the
//! product on a piece that has arrived runs while the next piece travels, and a running sum's
//! first piece leaves while the second is computed:
//!
//! ```text
//!   tp = 2, rank 0     all-gather                      reduce-scatter
//!   compute            x_0 W_rᵀ  |x_1.0 W_rᵀ|x_1.1 W_rᵀ   P_1.0|P_1.1|P_0.0 |P_0.1
//!   wire               x_0.0 x_0.1 → 1                          P_1.0 P_1.1 → 1
//!                      x_1.0|x_1.1 ← 1                          S_0.0 S_0.1 ← 1   y_0 = S_0 + P_0
//! ```
//!
//! What stays exposed is what a step's transfer takes beyond the products beside it. The
//! backward runs the conjugates the same way: the row layer's all-gather of dy with
//! dx = dy W_r on each piece and dW's term on each part once it is whole, the column layer's
//! reduce-scatter of dx = dy W_r with the weight gradient computed while the first running
//! sum travels. A part is every sequence's positions of that
//! rank, so the results are the ones the collectives give (each sum over the same ranks, added
//! in the ring's order).
//!
//! Legend: `b` sequences, `T` positions, `T_r = T/tp` a rank's part, `F` features; activations
//! are rows (b·T, F), sequence-major.

use std::ops::Range;

use candle_core::{Result, Tensor};
use mtrain_comm::{chunk_range, Comm, Work};
use mtrain_kernels::{bias, linear as fused};
use mtrain_model::explicit::DenseTape;
use mtrain_model::tape::{TapedLinear, WeightGrads};

use crate::ops::comm_err;

/// Rows (b·T_c, F) of part `c` of (b·T, F): every sequence's positions `chunk_range(T, tp, c)`.
pub fn part_rows(x: &Tensor, b: usize, tp: usize, c: usize) -> Result<Tensor> {
    let (rows, f) = x.dims2()?;
    let t = rows / b;
    let r = chunk_range(t, tp, c);
    x.reshape((b, t, f))?
        .narrow(1, r.start, r.len())?
        .contiguous()?
        .reshape((b * r.len(), f)) // (b·T_c, F)
}

/// The parts of rows (b·T, F) handed out a piece at a time, each part copied out once.
struct Parts<'a> {
    x: &'a Tensor,
    b: usize,
    tp: usize,
    held: Option<(usize, Tensor)>,
}

impl<'a> Parts<'a> {
    fn of(x: &'a Tensor, b: usize, tp: usize) -> Self {
        Self { x, b, tp, held: None }
    }

    /// The rows `rows` of part c (rows, F).
    fn piece(&mut self, c: usize, rows: &Range<usize>) -> Result<Tensor> {
        if self.held.as_ref().is_none_or(|(at, _)| *at != c) {
            self.held = Some((c, part_rows(self.x, self.b, self.tp, c)?)); // (b·T_c, F)
        }
        let (_, part) = self.held.as_ref().expect("held above");
        part.narrow(0, rows.start, rows.len())
    }
}

/// Parts (b·T_c, F) in the order c = 0, 1, … laid out as the rows (b·T, F) of whole sequences.
fn assemble(parts: &[Tensor], b: usize) -> Result<Tensor> {
    let seq = parts
        .iter()
        .map(|p| {
            let (rows, f) = p.dims2()?;
            p.reshape((b, rows / b, f)) // (b, T_c, F)
        })
        .collect::<Result<Vec<_>>>()?;
    let y = Tensor::cat(&seq, 1)?; // (b, T, F)
    let (_, t, f) = y.dims3()?;
    y.reshape((b * t, f))
}

/// The ring's neighbours of this rank: (the rank it sends to, the rank it receives from).
fn neighbours(group: &Comm) -> (usize, usize) {
    let (r, p) = (group.rank(), group.size());
    ((r + 1) % p, (r + p - 1) % p)
}

/// How many pieces a ring step cuts its part into. Each is a message of its own, so more
/// pieces hide more of a step's transfer at the cost of more messages and shorter products
/// (docs/results.md has both measured).
pub const PIECES: usize = 2;

/// The row ranges of the pieces of a part of `rows` rows.
pub fn pieces(rows: usize) -> Vec<Range<usize>> {
    let k = PIECES.min(rows).max(1);
    (0..k).map(|j| chunk_range(rows, k, j)).collect()
}

/// A piece of a part: in hand, or on the wire from the previous rank.
enum Piece {
    Held(Tensor),
    Coming(Work<Tensor>),
}

/// The all-gather of this rank's part `x_r` (b·T_r, F) around the ring, `on_piece(x_cj, c,
/// rows)` run on each piece of each part (its rows `rows` of part c) as it is at hand, our own
/// part's once all of it is on the wire. Returns the gathered rows (b·T, F) and each of
/// `on_piece`'s outputs laid out likewise.
#[track_caller]
pub fn gather_with(
    x_r: &Tensor,
    b: usize,
    group: &Comm,
    mut on_piece: impl FnMut(&Tensor, usize, Range<usize>) -> Result<Vec<Tensor>>,
) -> Result<(Tensor, Vec<Tensor>)> {
    let (r, p) = (group.rank(), group.size());
    let (next, prev) = neighbours(group);
    let x_r = x_r.contiguous()?; // (b·T_r, F), part r
    let ranges = pieces(x_r.dim(0)?);
    let mut hand: Vec<Piece> = ranges
        .iter()
        .map(|rg| Ok(Piece::Held(x_r.narrow(0, rg.start, rg.len())?)))
        .collect::<Result<_>>()?;
    let mut parts: Vec<Vec<Tensor>> = vec![Vec::new(); p];
    let mut outs: Vec<Vec<Vec<Tensor>>> = Vec::new(); // [output][part][piece]
    let mut sends = Vec::with_capacity((p - 1) * ranges.len());
    for s in 0..p {
        let c = (r + p - s) % p; // the part at hand
        let mut ready = Vec::with_capacity(ranges.len());
        let mut coming = Vec::with_capacity(ranges.len());
        for (j, piece) in std::mem::take(&mut hand).into_iter().enumerate() {
            let x = match piece {
                Piece::Held(x) => x,
                Piece::Coming(w) => w.wait().map_err(comm_err)?,
            };
            // Pass each piece on as soon as it is here: the next rank's product on it runs
            // while the rest of the part travels.
            if s + 1 < p {
                sends.push(group.send_async(&x, next));
                coming.push(Piece::Coming(group.recv_async(prev, x.shape(), x.dtype())));
            }
            ready.push(x);
            // A piece that arrived is multiplied at once; our own part goes on the wire
            // whole before its first product.
            if s > 0 {
                on_piece_at(&mut outs, &mut on_piece, &ready[j], c, p, ranges[j].clone())?;
            }
        }
        if s == 0 {
            for (x, rg) in ready.iter().zip(&ranges) {
                on_piece_at(&mut outs, &mut on_piece, x, c, p, rg.clone())?;
            }
        }
        parts[c] = ready;
        hand = coming;
    }
    for w in sends {
        w.wait().map_err(comm_err)?;
    }
    let whole = |v: Vec<Vec<Tensor>>| -> Result<Tensor> {
        let v = v
            .into_iter()
            .map(|pieces| Tensor::cat(&pieces, 0)) // (b·T_c, F)
            .collect::<Result<Vec<_>>>()?;
        assemble(&v, b)
    };
    let gathered = whole(parts)?; // (b·T, F)
    let outs = outs.into_iter().map(whole).collect::<Result<Vec<_>>>()?; // (b·T, F') each
    Ok((gathered, outs))
}

/// `on_piece`'s outputs for piece `rows` of part `c`, kept in `outs[output][c]`.
fn on_piece_at(
    outs: &mut Vec<Vec<Vec<Tensor>>>,
    on_piece: &mut impl FnMut(&Tensor, usize, Range<usize>) -> Result<Vec<Tensor>>,
    x: &Tensor,
    c: usize,
    p: usize,
    rows: Range<usize>,
) -> Result<()> {
    for (i, y) in on_piece(x, c, rows)?.into_iter().enumerate() {
        if outs.len() <= i {
            outs.push(vec![Vec::new(); p]);
        }
        outs[i][c].push(y); // (rows, F')
    }
    Ok(())
}

/// The reduce-scatter around the ring of this rank's partial product, computed piece by piece:
/// `partial(c, rows)` (rows, F) is this rank's term of the rows `rows` of part c's sum, a part
/// having `part_rows` rows, and each piece of a running sum goes on as soon as it is formed.
/// `alongside` runs once, while the first running sum travels (the column layer's weight
/// gradient). Returns this rank's part of the sum over the group (b·T_r, F).
#[track_caller]
pub fn reduce_scatter_with(
    group: &Comm,
    part_rows: usize,
    mut partial: impl FnMut(usize, Range<usize>) -> Result<Tensor>,
    alongside: impl FnOnce() -> Result<()>,
) -> Result<Tensor> {
    let (r, p) = (group.rank(), group.size());
    let (next, prev) = neighbours(group);
    let part_at = |s: usize| (r + 2 * p - 1 - s) % p; // step s works on part r − 1 − s
    let ranges = pieces(part_rows);
    let mut sends = Vec::with_capacity((p - 1) * ranges.len());
    // Each piece sent is followed at once by the receive of the piece that will come in its
    // place: the wire then carries send, receive, send, receive on every rank alike, and a
    // backend that holds one message per pair until it is received (IPC's mailboxes) never
    // has a second send waiting on a receive queued behind it.
    let mut coming = Vec::with_capacity(ranges.len());
    let mut pass_on = |sum: &Tensor, coming: &mut Vec<Work<Tensor>>| {
        sends.push(group.send_async(sum, next));
        coming.push(group.recv_async(prev, sum.shape(), sum.dtype()));
    };
    // Step 0: our terms start part r − 1's running sums, each piece sent as it is formed.
    let mut sums = Vec::with_capacity(ranges.len());
    for rg in &ranges {
        let sum = partial(part_at(0), rg.clone())?.contiguous()?; // (rows, F)
        if p > 1 {
            pass_on(&sum, &mut coming);
        }
        sums.push(sum);
    }
    let mut alongside = Some(alongside);
    for s in 1..p {
        // What arrives is part_at(s)'s running sum, piece by piece: our pieces' shapes, the
        // parts being equal.
        let incoming = std::mem::take(&mut coming);
        if let Some(f) = alongside.take() {
            f()?;
        }
        sums = Vec::with_capacity(ranges.len());
        for (rg, w) in ranges.iter().zip(incoming) {
            let mine = partial(part_at(s), rg.clone())?; // while the sum travels
            let sum = (w.wait().map_err(comm_err)? + mine)?;
            if s + 1 < p {
                pass_on(&sum, &mut coming);
            }
            sums.push(sum);
        }
    }
    if let Some(f) = alongside {
        f()?;
    }
    for w in sends {
        w.wait().map_err(comm_err)?;
    }
    Tensor::cat(&sums, 0) // part r: Σ over the group (b·T_r, F)
}

/// The column-parallel layer's forward (this rank's `W_r` (out/tp, in), `b_r` in `dense`) from
/// this rank's part x_r (N/tp, in): each part's product as it is at hand. Returns the gathered
/// input x (N, in), y = x W_rᵀ + b_r (N, out/tp) and, with `gelu`, gelu(y).
pub fn column_forward(
    dense: &DenseTape,
    x_r: &Tensor,
    b: usize,
    group: &Comm,
    gelu: bool,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let (x, mut outs) = gather_with(x_r, b, group, |x_c, _, _| match gelu {
        false => Ok(vec![dense.forward(x_c, b)?.1]), // (N/tp, out/tp)
        true => {
            let (_, f, g) = dense.forward_gelu(x_c, b)?;
            Ok(vec![f, g])
        }
    })?;
    let g = if gelu { outs.pop() } else { None };
    let y = outs.pop().expect("one product per part");
    Ok((x, y, g))
}

/// The column-parallel layer's backward: dx_r = Σ_tp dy W_r at this rank's part (N/tp, in),
/// each part's term computed while the running sums travel, and dW_r = dyᵀ x, db_r while the
/// first one does. A GELU before the layer (`gelu_of`) has no place here: its input is a
/// LayerNorm's under sequence parallelism.
pub fn column_backward(
    dense: &DenseTape,
    x: &Tensor,
    dy: &Tensor,
    b: usize,
    group: &Comm,
    grads: &mut WeightGrads,
    gelu_of: Option<&Tensor>,
) -> Result<Tensor> {
    if gelu_of.is_some() {
        return Err(candle_core::Error::Msg(
            "--tp-overlap ring: a column-parallel layer after a GELU has no sequence part to reduce-scatter into; run it with --tp-overlap none".into(),
        ));
    }
    let w = dense.weight()?; // (out/tp, in)
    let tp = group.size();
    let bias = dense.bias()?;
    let mut dy_parts = Parts::of(dy, b, tp);
    reduce_scatter_with(
        group,
        dy.dim(0)? / tp,
        |c, rows| mtrain_kernels::matmul(&dy_parts.piece(c, &rows)?, &w), // (rows, in)
        || grads.linear(dense.names(), dy, x, &bias),
    )
}

/// The row-parallel layer's forward: Σ_tp x W_rᵀ at this rank's part (N/tp, out), x (N, in/tp)
/// and `w_t` = W_rᵀ (in/tp, out); part c's running sum travels while part c − 1's product is
/// computed.
pub fn row_forward(x: &Tensor, w_t: &Tensor, b: usize, group: &Comm) -> Result<Tensor> {
    let tp = group.size();
    let mut parts = Parts::of(x, b, tp);
    // (rows, out) of part c's term
    let part = |c, rows: Range<usize>| mtrain_kernels::matmul(&parts.piece(c, &rows)?, w_t);
    reduce_scatter_with(group, x.dim(0)? / tp, part, || Ok(()))
}

/// The row-parallel layer's backward from this rank's part of dy (N/tp, out): dy's parts
/// gathered around the ring, each part's dx = dy_c W_r (through the GELU before the layer,
/// `gelu_of` = f (N, in/tp)) and, formed now, its term dy_cᵀ x_c of dW_r computed as it is at
/// hand. Returns dx (N, in/tp); dW_r (out, in/tp) and db (out,) (this rank's rows: the
/// partial gradient sequence parallelism sums) into `grads`.
pub fn row_backward(
    dense: &DenseTape,
    x: &Tensor,
    dy_r: &Tensor,
    b: usize,
    group: &Comm,
    grads: &mut WeightGrads,
    gelu_of: Option<&Tensor>,
) -> Result<Tensor> {
    let w = dense.weight()?; // (out, in/tp)
    let tp = group.size();
    let now = !grads.defers();
    let mut dw: Option<Tensor> = None;
    let mut f_parts = gelu_of.map(|f| Parts::of(f, b, tp));
    let part_len = dy_r.dim(0)?; // b·T_r rows, every part's
    let mut arrived: Vec<Tensor> = Vec::new(); // the pieces of the part at hand
    let (dy, mut dx) = gather_with(dy_r, b, group, |dy_j, c, rows| {
        let dx_j = match &mut f_parts {
            Some(f) => fused::input_grad_gelu(dy_j, &w, &f.piece(c, &rows)?)?,
            None => mtrain_kernels::matmul(dy_j, &w)?, // (rows, in/tp)
        };
        // dW's term of a part once it is whole: one product of the part's depth.
        if now {
            arrived.push(dy_j.clone());
        }
        if now && rows.end == part_len {
            let dy_c = Tensor::cat(&std::mem::take(&mut arrived), 0)?; // (b·T_r, out)
            let x_c = part_rows(x, b, tp, c)?; // (b·T_r, in/tp)
            let term = mtrain_kernels::matmul(&dy_c.t()?, &x_c)?; // (out, in/tp)
            dw = Some(match dw.take() {
                Some(acc) => (acc + term)?,
                None => term,
            });
        }
        Ok(vec![dx_j])
    })?; // dy (N, out), dx (N, in/tp)
    drop(w);
    let (w_name, b_name) = dense.names();
    let db = bias::grad(dy_r, &dense.bias()?)?; // (out,)
    match dw {
        Some(dw) => grads.push((w_name, dw)),   // Σ_parts dy_cᵀ x_c
        None => grads.product(w_name, &dy, x)?, // kept for W
    }
    grads.push((b_name, db));
    Ok(dx.remove(0))
}
