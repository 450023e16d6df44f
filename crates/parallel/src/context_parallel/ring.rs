//! Ring attention over the cp group, forward and backward, as the step issues it (the picture
//! and the chunk layout are in [`super`]).
//!
//! Each step issues the next block's transfer (send to the next rank, receive from the
//! previous) before it computes on the block it holds, and waits for it after: the transfer is
//! in flight while the block's attention runs. Even ranks send first and odd ranks receive
//! first, so that where a send waits for its receiver (NCCL) the ring cannot deadlock.
//!
//! **Dropout** on the probabilities: each block's probabilities are multiplied by the mask one
//! device draws for the same (query, key) positions of the whole (T, T) matrix
//! ([`Mask::probs_block`], drawn again in the backward), and the blocks merge as without it
//! (`(P ∘ M) v` is linear in each block's `(P_b ∘ M_b) v_b`; the rule in
//! [`attention::full_forward`]'s module). The causal kernels draw a mask at the places of the
//! sequence they are given, so under dropout the diagonal block runs through the same
//! materialised path as the others, with the causal mask.
//!
//! Legend: `B` batch, `H` heads, `T_r` this rank's rows (two chunks of `c`), `D` head size.

use candle_core::{DType, Device, Result, Tensor};
use mtrain_comm::{Comm, Work};
use mtrain_kernels::attention::{self, BlockMask};
use mtrain_kernels::dropout::Mask;
use mtrain_model::chunks::Positions;
use mtrain_model::tape::{AttentionKept, SequenceAttention};
use mtrain_model::SequenceChunks;

/// Causal attention of the cp group's sequence, this rank holding `chunks`.
pub struct RingAttention {
    group: Comm,
    chunks: SequenceChunks,
}

impl RingAttention {
    /// The ring over `group`; this rank holds chunks `group.rank()` and 2n−1−rank.
    pub fn new(group: Comm) -> RingAttention {
        let chunks = super::chunks_of(&group);
        RingAttention { group, chunks }
    }
}

/// One step's transfer around the ring: `x` to the next rank, the previous rank's block in.
struct Pass {
    send: Work<()>,
    recv: Work,
}

impl Pass {
    /// Issues the send of `x` to rank i+1 and the receive from rank i−1 (even ranks send first).
    fn issue(group: &Comm, x: &Tensor) -> Result<Pass> {
        let (n, i) = (group.size(), group.rank());
        let (next, prev) = ((i + 1) % n, (i + n - 1) % n);
        let x = x.contiguous()?;
        let (send, recv) = match i % 2 {
            0 => {
                let send = group.send_async(&x, next);
                (send, group.recv_async(prev, x.shape(), x.dtype()))
            }
            _ => {
                let recv = group.recv_async(prev, x.shape(), x.dtype());
                (group.send_async(&x, next), recv)
            }
        };
        Ok(Pass { send, recv })
    }

    /// The previous rank's block, once both halves are done.
    fn wait(self) -> Result<Tensor> {
        self.send.wait().map_err(candle_core::Error::wrap)?;
        self.recv.wait().map_err(candle_core::Error::wrap)
    }
}

/// One ring step: issues the pass of each of `sends` around the ring, runs `compute` (the
/// block's attention) while they are in flight, then waits for them; returns what arrived
/// from rank i−1, in the order of `sends`, and what `compute` returned.
pub fn overlapped<T>(
    group: &Comm,
    sends: &[&Tensor],
    compute: impl FnOnce() -> Result<T>,
) -> Result<(Vec<Tensor>, T)> {
    let passes: Vec<Pass> = sends
        .iter()
        .map(|x| Pass::issue(group, x))
        .collect::<Result<_>>()?;
    let out = compute()?;
    let arrived = passes.into_iter().map(Pass::wait).collect::<Result<_>>()?;
    Ok((arrived, out))
}

/// Which of this rank's query rows attend to the block of rank `j` at step `step`, and to which
/// of its key rows: all to all on the diagonal (causal), all queries to j's early chunk when
/// j < i, the late query chunk to both of j's chunks when j > i.
#[derive(Clone, Copy, PartialEq)]
enum Block {
    Diagonal,
    EarlyKeys,
    LateQueries,
}

fn key_block_at(step: usize, chunks: SequenceChunks) -> Block {
    let j = (chunks.i + chunks.n - step) % chunks.n;
    match step {
        0 => Block::Diagonal,
        _ if j < chunks.i => Block::EarlyKeys,
        _ => Block::LateQueries,
    }
}

/// The dropout of this rank's blocks of the probabilities: the mask of the whole sequence's
/// (B, H, T·T), of which each block draws its (query, key) pairs.
struct Drops<'a> {
    mask: &'a Mask,
    chunks: SequenceChunks,
    /// (B, H) of this rank's heads, this rank's rows T_r.
    b: usize,
    h: usize,
    t_r: usize,
}

impl Drops<'_> {
    /// The mask (B, H, Tq, Tk) f32 of the block at `step`: this rank's query positions against
    /// the positions of the keys it holds then (rank i − step's), as [`Block`] selects them.
    fn at(&self, step: usize, dev: &Device) -> Result<Tensor> {
        let SequenceChunks { n, i } = self.chunks;
        let mine = self.chunks.runs(self.t_r);
        let theirs = SequenceChunks { n, i: (i + n - step) % n }.runs(self.t_r);
        let (q, k): (&[_], &[_]) = match key_block_at(step, self.chunks) {
            Block::Diagonal => (&mine, &mine),
            Block::EarlyKeys => (&mine, &theirs[..1]),
            Block::LateQueries => (&mine[1..], &theirs),
        };
        let t = n * self.t_r;
        let rows = q
            .iter()
            .map(|&qr| {
                let cols = k
                    .iter()
                    .map(|&kr| self.mask.probs_block((self.b, self.h), t, qr, kr, dev))
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&cols, 3) // (B, H, run of q, Tk)
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&rows, 2) // (B, H, Tq, Tk)
    }
}

/// The diagonal's mask under dropout: causal, and the block's draw.
fn diagonal(drop: &Tensor) -> BlockMask<'_> {
    BlockMask {
        causal: true,
        drop: Some(drop),
    }
}

/// 2^x for f32 tensors.
fn exp2(x: &Tensor) -> Result<Tensor> {
    (x * std::f64::consts::LN_2)?.exp()
}

/// The running output (B, H, T_r, D) f32 and lse2 (B, H, T_r) with a block's (yb, lb) over
/// rows `from..` merged in: lse2 = log₂(2^a + 2^b), y = y·2^(a−lse2) + yb·2^(b−lse2).
fn merge(
    y: &Tensor,
    lse2: &Tensor,
    yb: &Tensor,
    lb: &Tensor,
    from: usize,
) -> Result<(Tensor, Tensor)> {
    let rows = lse2.dim(2)? - from;
    let (ya, la) = (y.narrow(2, from, rows)?, lse2.narrow(2, from, rows)?);
    let m = la.maximum(lb)?;
    let new =
        (&m + ((exp2(&(&la - &m)?)? + exp2(&(lb - &m)?)?)?.log()? * std::f64::consts::LOG2_E)?)?;
    let wa = exp2(&(&la - &new)?)?.unsqueeze(3)?; // (B, H, rows, 1)
    let wb = exp2(&(lb - &new)?)?.unsqueeze(3)?;
    let ym = (ya.broadcast_mul(&wa)? + yb.broadcast_mul(&wb)?)?;
    match from {
        0 => Ok((ym, new)),
        _ => Ok((
            Tensor::cat(&[&y.narrow(2, 0, from)?, &ym], 2)?,
            Tensor::cat(&[&lse2.narrow(2, 0, from)?, &new], 2)?,
        )),
    }
}

impl SequenceAttention for RingAttention {
    /// This rank's two chunks of a sequence of n · T_r.
    fn positions(&self, t_r: usize) -> Positions {
        Positions::chunks(self.chunks, t_r)
    }

    fn forward(
        &self,
        qkv: &Tensor,
        h: usize,
        scale: f64,
        probs: Option<&Mask>,
    ) -> Result<(Tensor, Box<dyn AttentionKept>)> {
        let (b, t_r, _) = qkv.dims3()?;
        let (chunks, group) = (self.chunks, &self.group);
        if t_r % 2 != 0 {
            return Err(candle_core::Error::Msg(format!(
                "ring attention: {t_r} rows per rank cannot be two equal chunks"
            )));
        }
        let c = t_r / 2;
        let heads = mtrain_kernels::split_heads(qkv, 3, h)?.contiguous()?; // (3, B, H, T_r, D)
        let q = heads.get(0)?; // (B, H, T_r, D)
        let kv = heads.narrow(0, 1, 2)?; // (2, B, H, T_r, D): this rank's keys and values
        let first = if chunks.n > 1 { vec![&kv] } else { vec![] };
        let drops = probs.map(|mask| Drops { mask, chunks, b, h, t_r });
        let dev = qkv.device();
        // Step 0, the diagonal (causal) block, while this rank's K, V go to rank i+1.
        let (mut arrived, (y, lse2)) = overlapped(group, &first, || match &drops {
            None => attention::forward(&heads, scale, None), // (B, H, T_r, D), lse2
            Some(d) => {
                let (k, v) = (heads.get(1)?, heads.get(2)?);
                attention::full_forward(&q, &k, &v, scale, diagonal(&d.at(0, dev)?))
            }
        })?;
        let lse_dims = lse2.dims().to_vec();
        let (mut y, mut lse2) = (y.to_dtype(DType::F32)?, lse2.reshape((b, h, t_r))?);
        for step in 1..chunks.n {
            let kv = arrived.remove(0); // rank (i − step)'s K, V
            let sends = if step + 1 < chunks.n {
                vec![&kv]
            } else {
                vec![]
            };
            let (k, v) = (kv.get(0)?, kv.get(1)?);
            (arrived, (y, lse2)) = overlapped(group, &sends, || {
                let drop = drops.as_ref().map(|d| d.at(step, dev)).transpose()?;
                let mask = BlockMask {
                    causal: false,
                    drop: drop.as_ref(),
                };
                match key_block_at(step, chunks) {
                    Block::EarlyKeys => {
                        let (k0, v0) = (k.narrow(2, 0, c)?, v.narrow(2, 0, c)?);
                        let (yb, lb) = attention::full_forward(&q, &k0, &v0, scale, mask)?;
                        merge(&y, &lse2, &yb, &lb, 0)
                    }
                    _ => {
                        let ql = q.narrow(2, c, c)?;
                        let (yb, lb) = attention::full_forward(&ql, &k, &v, scale, mask)?;
                        merge(&y, &lse2, &yb, &lb, c)
                    }
                }
            })?;
        }
        let out = y.to_dtype(qkv.dtype())?; // (B, H, T_r, D)
        let out = mtrain_kernels::merge_heads(&out.unsqueeze(0)?)?; // (B, T_r, H·D)
        let kept = RingKept {
            group: self.group.clone(),
            chunks,
            heads,
            lse2,
            lse_dims,
            h,
            scale,
            probs: probs.cloned(),
        };
        Ok((out, Box::new(kept)))
    }
}

/// What the ring's forward kept: this rank's q | k | v and the merged lse2.
struct RingKept {
    group: Comm,
    chunks: SequenceChunks,
    /// (3, B, H, T_r, D)
    heads: Tensor,
    /// (B, H, T_r) f32, every block merged
    lse2: Tensor,
    /// lse2's shape as the causal kernels return it.
    lse_dims: Vec<usize>,
    h: usize,
    scale: f64,
    /// The probabilities' dropout, drawn again block by block.
    probs: Option<Mask>,
}

impl AttentionKept for RingKept {
    /// The blocks' gradients, step by step as in the forward: dq stays here; each block's dk
    /// and dv are added to an accumulator that travels with the keys and values and, after n
    /// passes, arrives at the rank that holds them.
    fn backward(self: Box<Self>, y: &Tensor, dy: &Tensor) -> Result<Tensor> {
        let RingKept {
            group,
            chunks,
            heads,
            lse2,
            lse_dims,
            h,
            scale,
            probs,
        } = *self;
        let apart =
            |t: &Tensor| -> Result<Tensor> { mtrain_kernels::split_heads(t, 1, h)?.squeeze(0) };
        let (yh, dyh) = (apart(y)?, apart(dy)?); // (B, H, T_r, D)
        let (b, t_r) = (yh.dim(0)?, lse2.dim(2)?);
        let c = t_r / 2;
        let q = heads.get(0)?;
        let kv = heads.narrow(0, 1, 2)?; // (2, B, H, T_r, D)
        let first = if chunks.n > 1 { vec![&kv] } else { vec![] };
        let drops = probs.as_ref().map(|mask| Drops { mask, chunks, b, h, t_r });
        let dev = heads.device();
        // Step 0, the diagonal: the causal kernels' backward with the merged y and lse2.
        let (mut arrived, g) = overlapped(&group, &first, || match &drops {
            None => {
                let lse = lse2.reshape(lse_dims.as_slice())?;
                attention::backward(&heads, &yh, &dyh, &lse, scale, None)?.to_dtype(DType::F32)
            }
            Some(d) => {
                let (k, v) = (heads.get(1)?, heads.get(2)?);
                let drop = d.at(0, dev)?;
                let (dq, dk, dv) =
                    attention::full_backward(&q, &k, &v, &yh, &dyh, &lse2, scale, diagonal(&drop))?;
                Tensor::stack(&[dq, dk, dv], 0)
            }
        })?; // g: (3, B, H, T_r, D)
        let mut dq = g.get(0)?;
        let mut dkv = g.narrow(0, 1, 2)?; // for this rank's keys
        for step in 1..chunks.n {
            let kv = arrived.remove(0); // rank (i − step)'s K, V
                                        // The accumulator follows its keys: dkv goes on to i+1, i−1's comes in.
            let mut sends = vec![&dkv];
            if step + 1 < chunks.n {
                sends.push(&kv);
            }
            let (k, v) = (kv.get(0)?, kv.get(1)?);
            let drop = drops.as_ref().map(|d| d.at(step, dev)).transpose()?;
            let mask = BlockMask {
                causal: false,
                drop: drop.as_ref(),
            };
            let (got, block) = overlapped(&group, &sends, || match key_block_at(step, chunks) {
                Block::EarlyKeys => {
                    let (k0, v0) = (k.narrow(2, 0, c)?, v.narrow(2, 0, c)?);
                    let (dqb, dk, dv) =
                        attention::full_backward(&q, &k0, &v0, &yh, &dyh, &lse2, scale, mask)?;
                    let late = Tensor::zeros(dk.dims(), DType::F32, dk.device())?;
                    let pad = |t: &Tensor| Tensor::cat(&[t, &late], 2); // (B, H, T_r, D)
                    Ok((dqb, Tensor::stack(&[pad(&dk)?, pad(&dv)?], 0)?))
                }
                _ => {
                    let rows = |t: &Tensor| t.narrow(2, c, c);
                    let (ql, yl, dyl, ll) = (rows(&q)?, rows(&yh)?, rows(&dyh)?, rows(&lse2)?);
                    let (dqb, dk, dv) =
                        attention::full_backward(&ql, &k, &v, &yl, &dyl, &ll, scale, mask)?;
                    let early = Tensor::zeros(dqb.dims(), DType::F32, dqb.device())?;
                    let dqb = Tensor::cat(&[&early, &dqb], 2)?; // (B, H, T_r, D)
                    Ok((dqb, Tensor::stack(&[dk, dv], 0)?))
                }
            })?;
            let mut got = got.into_iter();
            let carried = got.next().expect("the accumulator of rank i−1"); // for KV_(i−step)
            arrived = got.collect();
            dq = (dq + block.0)?;
            dkv = (carried + block.1)?;
        }
        if chunks.n > 1 {
            // The n-th pass brings this rank's own accumulator home.
            dkv = overlapped(&group, &[&dkv], || Ok(()))?.0.remove(0);
        }
        let dqkv = Tensor::cat(&[&dq.unsqueeze(0)?, &dkv], 0)?.to_dtype(heads.dtype())?;
        mtrain_kernels::merge_heads(&dqkv) // (B, T_r, 3·H·D)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use mtrain_comm::cpu::run_local;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    /// The transfer of a step is in flight during its block's attention: rank 0's `compute`
    /// does not return until rank 1 holds the block rank 0 is sending, so it passes only if the
    /// send was issued before the compute (issuing it after would never end the wait).
    #[test]
    fn a_steps_transfer_is_in_flight_during_its_attention() {
        let arrived_at_1 = AtomicBool::new(false);
        let ok = run_local(2, Duration::from_secs(60), |backend| {
            let group = mtrain_comm::Backend::world(&backend);
            let rank = group.rank();
            let x = Tensor::new(&[rank as f32 + 10.0], &Device::Cpu)?;
            let (got, during) = overlapped(&group, &[&x], || match rank {
                0 => {
                    let start = Instant::now();
                    while !arrived_at_1.load(Ordering::SeqCst) {
                        if start.elapsed() > Duration::from_secs(20) {
                            return Ok(false);
                        }
                        std::thread::yield_now();
                    }
                    Ok(true) // rank 1 received while this block was computing
                }
                _ => Ok(true),
            })?;
            if rank == 1 {
                arrived_at_1.store(true, Ordering::SeqCst);
            }
            let from = got[0].to_vec1::<f32>()?[0];
            Ok::<_, candle_core::Error>(during && from == (1 - rank) as f32 + 10.0)
        });
        for (rank, r) in ok.into_iter().enumerate() {
            assert!(
                r.expect("ring step"),
                "rank {rank}: the transfer was not in flight"
            );
        }
    }
}
