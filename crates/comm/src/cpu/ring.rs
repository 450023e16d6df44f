//! Ring algorithms: reduce-scatter, all-gather, and all-reduce = reduce-scatter + all-gather.
//!
//! The n ranks form a ring; each sends only to its right neighbour and receives only from its
//! left one, so every link carries the same load. The data is cut into n chunks. For n = 4,
//! rank r holding chunks a_r b_r c_r d_r:
//!
//! ```text
//!  reduce-scatter (n-1 steps): in step s rank r sends chunk (r-s-1) and adds the chunk
//!  (r-s-2) it receives into its own copy. After n-1 steps rank r holds chunk r summed over all.
//!
//!        step 0          step 1             step 2              result
//!  r0:  d0 ->r1        c3+c0 ->r1       b2+b3+b0 ->r1        a = a0+a1+a2+a3
//!  r1:  a1 ->r2        d0+d1 ->r2       c3+c0+c1 ->r2        b = ...
//!  r2:  b2 ->r3        a1+a2 ->r3       d0+d1+d2 ->r3        c = ...
//!  r3:  c3 ->r0        b2+b3 ->r0       a1+a2+a3 ->r0        d = ...
//!
//!  all-gather (n-1 steps): in step s rank r sends chunk (r-s) and keeps the chunk (r-s-1) it
//!  receives. After n-1 steps every rank holds every chunk.
//! ```
//!
//! Each rank sends (n-1)/n of the data in each phase, so all-reduce sends 2(n-1)/n * S bytes
//! per rank whatever n is: the ring is bandwidth-optimal. Large chunks are cut into segments
//! (`SEGMENT_BYTES`) and pipelined: as soon as a segment has been received and reduced in step
//! s it is queued to the right neighbour as part of step s+1, while later segments of step s are
//! still arriving. An all-reduce runs its 2(n-1) steps as one pipeline: a segment of our own
//! chunk goes out as all-gather step 0 the moment its reduction is complete, while the rest of
//! the chunk is still being reduced. The transfers are the [`pump`](super::pump)'s: segments
//! are received straight into the result, combined there with the input, and sent on from
//! where they lie, so the input is never copied whole and no segment is copied to be sent.
//! A reduce-scatter alone keeps only the chunks in flight: its result buffer is two slots of
//! one chunk each, step s's arrivals in slot s mod 2, 2/n of the tensor rather than all of it.
//!
//! The chunk each rank sends at each step is the ring's [`schedule`], the one `mtrain explain
//! ring` prints; the pump's plan is read off it.
//!
//! Reductions run in f32 for f32/bf16/f16 (partial sums of half-precision inputs travel as f32,
//! and the all-gather of a half-precision result travels in its own dtype) and exactly for
//! integers.

use std::ops::Range;

use candle_core::{DType, Tensor, WithDType};

use super::core::{segments, GroupCore};
use super::pump::{Arrival, Source};
use super::schedule::{Phase, Schedule, Step, Transfer};
use super::wire::{bytes_to_tensor, fresh_zeroed, with_elems, AccBuf, AccElem, HostBuf};
use crate::algo::AllReduceAlgo;
use crate::communicator::{chunk_range, ReduceOp, Result};

/// What rank r of a ring of n sends first and receives, in order, for a reduce-scatter over
/// `chunks` (element ranges, one per rank; `reduce`), an all-gather (`gather`), or both.
struct Plan {
    first: Vec<(Source, Range<usize>)>,
    arrivals: Vec<Arrival>,
}

impl Plan {
    /// Read off the ring's [`schedule`]: our receives in step order, and our first sends (the
    /// rest are forwarded arrivals). Each arrival lands at its own elements of a result buffer
    /// as long as the tensor, or with `slot` = w (a reduce-scatter alone) in a buffer of two
    /// slots of w elements: reduce step s's chunk at the start of slot s mod 2.
    fn new(
        r: usize,
        n: usize,
        chunks: &[Range<usize>],
        elem: usize,
        reduce: bool,
        gather: bool,
        slot: Option<usize>,
    ) -> Plan {
        let sched = schedule(n);
        let segs = |c: usize| segments(chunks[c].clone(), elem);
        // Where segment `range` of chunk c, received in reduce step s, lands.
        let at = |s: usize, c: usize, range: &Range<usize>| match slot {
            Some(w) => (s % 2) * w + (range.start - chunks[c].start),
            None => range.start,
        };
        let chunk_to = |step: &Step| step.transfers.iter().find(|t| t.to == r).map(|t| t.blocks.start);
        let chunk_from =
            |step: &Step| step.transfers.iter().find(|t| t.from == r).map(|t| t.blocks.start);
        let mut arrivals = Vec::new();
        let first = if reduce {
            // Each arrival is added to our copy; the last one is chunk r, complete. Each is
            // forwarded: as the next reduce step, or as all-gather step 0.
            for (s, step) in sched.phase(Phase::ReduceScatter).enumerate() {
                let c = chunk_to(step).unwrap_or(r);
                arrivals.extend(segs(c).map(|range| Arrival {
                    at: at(s, c, &range),
                    range,
                    reduce: true,
                    complete: s == n - 2,
                    forward: s < n - 2 || gather,
                }));
            }
            let step0 = sched.phase(Phase::ReduceScatter).next();
            segs(step0.and_then(chunk_from).unwrap_or(r))
                .map(|c| (Source::Input, c))
                .collect()
        } else {
            let step0 = sched.phase(Phase::AllGather).next();
            segs(step0.and_then(chunk_from).unwrap_or(r))
                .map(|c| (Source::Output, c))
                .collect()
        };
        if gather {
            // Each arrival is final and passed on unless it has gone round.
            for (s, step) in sched.phase(Phase::AllGather).enumerate() {
                let c = chunk_to(step).unwrap_or(r);
                arrivals.extend(segs(c).map(|range| Arrival {
                    at: range.start,
                    range,
                    reduce: false,
                    complete: false,
                    forward: s < n - 2,
                }));
            }
        }
        Plan { first, arrivals }
    }
}

/// The ring over `n` ranks as steps, the data cut into n chunks: in reduce-scatter step s
/// rank r sends chunk (r−s−1) mod n to r+1, which adds it to its own; in all-gather step s it
/// sends chunk (r−s) mod n, complete, and r+1 keeps it.
pub(crate) fn schedule(n: usize) -> Schedule {
    let step = |phase: Phase, s: usize| Step {
        phase,
        transfers: (0..n)
            .map(|r| {
                let c = match phase {
                    Phase::ReduceScatter => (r + 2 * n - s - 1) % n,
                    _ => (r + n - s) % n,
                };
                Transfer {
                    from: r,
                    to: (r + 1) % n,
                    blocks: c..c + 1,
                    reduce: phase == Phase::ReduceScatter,
                }
            })
            .collect(),
    };
    let steps = (0..n - 1)
        .map(|s| step(Phase::ReduceScatter, s))
        .chain((0..n - 1).map(|s| step(Phase::AllGather, s)))
        .collect();
    Schedule {
        algo: AllReduceAlgo::Ring,
        ranks: n,
        blocks: n,
        steps,
    }
}

impl GroupCore {
    /// Reduce-scatter `x` over `chunks` in its accumulation type `T`, then all-gather in it too
    /// when `gather`, into a new buffer; returns it and where our reduced chunk lies in it.
    ///
    /// With `gather` the buffer is as long as `x` and ends up whole. A reduce-scatter alone
    /// needs only the chunks in flight: two slots of the largest chunk's length w (one in a
    /// ring of two). Reduce step s's arrivals are combined in slot s mod 2 and forwarded from
    /// there while step s+1's land in the other slot; step s+2's reuse the first once step s+1
    /// has sent them on (the pump lands no receive where a queued send still reads). A rank
    /// held there waits on its right neighbour taking in step s+1, which can itself wait only
    /// on earlier steps: no cycle, whatever the sockets buffer. Our chunk, complete after step
    /// n−2, is in slot n mod 2.
    ///
    /// ```text
    ///   x (numel,) ──gather──────> out (numel,)       every chunk reduced over all ranks
    ///   x (numel,) ──no gather───> out (2, w)         slot n mod 2 holds chunk r (|chunk r| ≤ w)
    ///                              [ slot 0 | slot 1 ]   w = max |chunk|, 2w ≈ 2/n · numel
    /// ```
    ///
    /// Each element is summed in the ring's order either way: the same bits.
    fn reduced<T: AccElem + WithDType>(
        &mut self,
        x: &Tensor,
        chunks: &[Range<usize>],
        gather: bool,
        op: ReduceOp,
    ) -> Result<(Vec<T>, Range<usize>)> {
        let (r, n) = (self.rank, self.size);
        let (len, slot, ours) = match gather {
            true => (x.elem_count(), None, chunks[r].clone()),
            false => {
                let w = chunks.iter().map(|c| c.len()).max().unwrap_or(0);
                let at = (n % 2) * w; // slot (n − 2) mod 2
                ((n - 1).min(2) * w, Some(w), at..at + chunks[r].len())
            }
        };
        let mut out = fresh_zeroed::<T>(len);
        let plan = Plan::new(r, n, chunks, std::mem::size_of::<T>(), true, gather, slot);
        with_elems(x, |input: &[T]| {
            self.pump(Some(input), &mut out, &plan.first, &plan.arrivals, op)
        })??;
        Ok((out, ours))
    }

    /// [`reduced`](Self::reduced) for `x`'s dtype: the buffer in its accumulation type and
    /// where our reduced chunk lies in it.
    fn reduce_acc(
        &mut self,
        x: &Tensor,
        chunks: &[Range<usize>],
        gather: bool,
        op: ReduceOp,
    ) -> Result<(AccBuf, Range<usize>)> {
        Ok(match x.dtype() {
            DType::F32 | DType::BF16 | DType::F16 => {
                let (v, ours) = self.reduced(x, chunks, gather, op)?;
                (AccBuf::F32(v), ours)
            }
            DType::F64 => {
                let (v, ours) = self.reduced(x, chunks, gather, op)?;
                (AccBuf::F64(v), ours)
            }
            DType::U8 => {
                let (v, ours) = self.reduced(x, chunks, gather, op)?;
                (AccBuf::U8(v), ours)
            }
            DType::U32 => {
                let (v, ours) = self.reduced(x, chunks, gather, op)?;
                (AccBuf::U32(v), ours)
            }
            DType::I64 => {
                let (v, ours) = self.reduced(x, chunks, gather, op)?;
                (AccBuf::I64(v), ours)
            }
            other => {
                return Err(candle_core::Error::Msg(format!(
                    "dtype {other:?} cannot be reduced by the CPU backend"
                ))
                .into())
            }
        })
    }

    /// The all-gather of `buf`'s chunks (byte ranges, one per rank); ours must be in place.
    fn ring_all_gather(&mut self, buf: &mut [u8], chunks: &[Range<usize>]) -> Result<()> {
        let plan = Plan::new(self.rank, self.size, chunks, 1, false, true, None);
        self.pump(Some(&[]), buf, &plan.first, &plan.arrivals, ReduceOp::Sum)
    }

    pub(crate) fn all_reduce(&mut self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.next_collective();
        if self.size == 1 {
            return Ok(x.contiguous()?.copy()?);
        }
        let (dtype, shape) = (x.dtype(), x.dims().to_vec());
        let mut mine = self.header(dtype, &shape);
        mine.reduce = Some(op);
        mine.algo = self.algo.pick((x.elem_count() * dtype.size_in_bytes()) as u64, self.size);
        self.exchange_headers(|_| mine.clone())?;
        if mine.algo != AllReduceAlgo::Ring {
            return self.scheduled_all_reduce(x, mine.algo, op);
        }

        let numel = x.elem_count();
        let n = self.size;
        let chunks: Vec<Range<usize>> = (0..n).map(|i| chunk_range(numel, n, i)).collect();
        // When the tensor's dtype is the accumulation type the whole op is one pipeline in it
        // and the accumulator becomes the result. A half-precision result is gathered in its
        // own dtype instead, half the bytes of f32.
        let half = matches!(dtype, DType::BF16 | DType::F16);
        let (acc, ours) = self.reduce_acc(x, &chunks, !half, op)?;
        let mut out = match acc.into_native(dtype) {
            Ok(native) => return native.into_tensor(&shape),
            Err(acc) => {
                let own = chunks[self.rank].clone();
                let es = dtype.size_in_bytes();
                let mut out = HostBuf::zeros(dtype, numel)?;
                out.as_bytes_mut()[own.start * es..own.end * es]
                    .copy_from_slice(&acc.to_native_bytes(ours, dtype));
                out
            }
        };
        let es = dtype.size_in_bytes();
        let byte_chunks: Vec<Range<usize>> =
            chunks.iter().map(|c| c.start * es..c.end * es).collect();
        self.ring_all_gather(out.as_bytes_mut(), &byte_chunks)?;
        out.into_tensor(&shape)
    }

    /// All-reduce `buf`, the elements of a tensor of `dtype` and `shape` in their accumulation
    /// type, in place: one pipeline of reduce-scatter and all-gather whose receives land in
    /// `buf` (the pump's in-place mode), on the wire the same op as [`all_reduce`](Self::all_reduce).
    pub(crate) fn all_reduce_in_place<T: AccElem + WithDType>(
        &mut self,
        buf: &mut [T],
        dtype: DType,
        shape: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.next_collective();
        if self.size == 1 {
            return Ok(());
        }
        let mut mine = self.header(dtype, shape);
        mine.reduce = Some(op);
        mine.algo = self.algo.pick((buf.len() * dtype.size_in_bytes()) as u64, self.size);
        self.exchange_headers(|_| mine.clone())?;
        if mine.algo != AllReduceAlgo::Ring {
            return self.run_algo(mine.algo, buf, op);
        }
        let n = self.size;
        let chunks: Vec<Range<usize>> = (0..n).map(|i| chunk_range(buf.len(), n, i)).collect();
        let es = std::mem::size_of::<T>();
        let plan = Plan::new(self.rank, n, &chunks, es, true, true, None);
        self.pump(None, buf, &plan.first, &plan.arrivals, op)
    }

    pub(crate) fn reduce_scatter(&mut self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.next_collective();
        let shape = x.dims().to_vec();
        let Some(&rows) = shape.first() else {
            return Err(self.invalid(
                "reduce_scatter needs a tensor with at least one dimension (it splits dim 0)"
                    .into(),
            ));
        };
        if self.size == 1 {
            return Ok(x.contiguous()?.copy()?);
        }
        let dtype = x.dtype();
        let mut mine = self.header(dtype, &shape);
        mine.reduce = Some(op);
        self.exchange_headers(|_| mine.clone())?;

        let n = self.size;
        let row = shape[1..].iter().product::<usize>();
        let chunks: Vec<Range<usize>> = (0..n)
            .map(|i| {
                let c = chunk_range(rows, n, i);
                c.start * row..c.end * row
            })
            .collect();
        // Two chunk-sized slots, not the whole tensor (see `reduced`).
        let (acc, ours) = self.reduce_acc(x, &chunks, false, op)?;
        let mut out_shape = shape.clone();
        out_shape[0] = chunk_range(rows, n, self.rank).len(); // (D/n, ...)
        let bytes = acc.to_native_bytes(ours, dtype);
        drop(acc); // the slots go before the result is made from our chunk's bytes
        bytes_to_tensor(&bytes, dtype, &out_shape)
    }

    pub(crate) fn all_gather(&mut self, x: &Tensor) -> Result<Tensor> {
        self.next_collective();
        let shape = x.dims().to_vec();
        if shape.is_empty() {
            return Err(self.invalid(
                "all_gather needs a tensor with at least one dimension (it concatenates dim 0)"
                    .into(),
            ));
        }
        if self.size == 1 {
            return Ok(x.contiguous()?.copy()?);
        }
        let dtype: DType = x.dtype();
        let mine = self.header(dtype, &shape);
        let headers = self.exchange_headers(|_| mine.clone())?;

        // Every rank's row count came with its header.
        let row_bytes = shape[1..].iter().product::<usize>() * dtype.size_in_bytes();
        let mut chunks = Vec::with_capacity(self.size);
        let mut at = 0;
        for h in &headers {
            let len = h.shape[0] * row_bytes;
            chunks.push(at..at + len);
            at += len;
        }
        let mut out = HostBuf::zeros(dtype, at / dtype.size_in_bytes())?;
        out.as_bytes_mut()[chunks[self.rank].clone()]
            .copy_from_slice(HostBuf::from_tensor(x)?.as_bytes());
        self.ring_all_gather(out.as_bytes_mut(), &chunks)?;
        let mut out_shape = shape;
        out_shape[0] = headers.iter().map(|h| h.shape[0]).sum(); // (Σ d_r, ...)
        out.into_tensor(&out_shape)
    }
}
