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
//! still arriving. Reductions run in f32 for f32/bf16/f16 (partial sums of half-precision inputs
//! travel as f32) and exactly for integers.

use std::ops::Range;

use candle_core::{DType, Tensor};

use super::core::{segments, GroupCore};
use super::wire::{bytes_to_tensor, AccBuf, HostBuf, Scratch};
use crate::communicator::{chunk_range, ReduceOp, Result};

impl GroupCore {
    fn left(&self) -> usize {
        (self.rank + self.size - 1) % self.size
    }
    fn right(&self) -> usize {
        (self.rank + 1) % self.size
    }

    /// Ring reduce-scatter of `acc`, cut at `chunks` (element ranges, one per rank). Afterwards
    /// `acc[chunks[rank]]` holds the reduction over all ranks; the rest of `acc` is scratch.
    pub(crate) fn ring_reduce_scatter(
        &mut self,
        acc: &mut AccBuf,
        chunks: &[Range<usize>],
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.size;
        let (r, left, right) = (self.rank, self.left(), self.right());
        let es = acc.elem_size();
        // Step 0 sends our own copy of chunk r-1.
        for seg in segments(chunks[(r + n - 1) % n].clone(), es) {
            self.send(right, acc.encode(seg))?;
        }
        // One receive buffer for every segment of the op, freed with it (a buffer kept past the
        // op would count as the process's memory between steps).
        let mut scratch = Scratch::default();
        for s in 0..n - 1 {
            let c = (r + 2 * n - s - 2) % n; // the chunk arriving in step s
            for seg in segments(chunks[c].clone(), es) {
                acc.recv_combine(seg.clone(), op, &mut scratch, |buf| self.recv_into(left, buf))?;
                if s + 1 < n - 1 {
                    // Forward the freshly reduced segment: it is what we send in step s+1.
                    self.send(right, acc.encode(seg))?;
                }
            }
        }
        Ok(())
    }

    /// Ring all-gather of `buf`, cut at `chunks` (byte ranges, one per rank). Our own chunk must
    /// already be in place; afterwards every chunk is.
    pub(crate) fn ring_all_gather(
        &mut self,
        buf: &mut [u8],
        chunks: &[Range<usize>],
    ) -> Result<()> {
        let n = self.size;
        let (r, left, right) = (self.rank, self.left(), self.right());
        for seg in segments(chunks[r].clone(), 1) {
            self.send(right, buf[seg].to_vec())?;
        }
        for s in 0..n - 1 {
            let c = (r + 2 * n - s - 1) % n; // the chunk arriving in step s
            for seg in segments(chunks[c].clone(), 1) {
                self.recv_into(left, &mut buf[seg.clone()])?;
                if s + 1 < n - 1 {
                    self.send(right, buf[seg].to_vec())?;
                }
            }
        }
        Ok(())
    }

    pub(crate) fn all_reduce(&mut self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.next_collective();
        if self.size == 1 {
            return Ok(x.contiguous()?.copy()?);
        }
        let (dtype, shape) = (x.dtype(), x.dims().to_vec());
        let mut mine = self.header(dtype, &shape);
        mine.reduce = Some(op);
        self.exchange_headers(|_| mine.clone())?;

        let numel = x.elem_count();
        let n = self.size;
        let chunks: Vec<Range<usize>> = (0..n).map(|i| chunk_range(numel, n, i)).collect();
        let mut acc = AccBuf::from_tensor(x)?;
        self.ring_reduce_scatter(&mut acc, &chunks, op)?;
        let own = chunks[self.rank].clone();
        acc.finish(own.clone(), op, n);

        // All-gather the reduced chunks in the tensor's own dtype. When that is the accumulation
        // type, the accumulator already holds our chunk in place and becomes the result.
        let es = dtype.size_in_bytes();
        let byte_chunks: Vec<Range<usize>> =
            chunks.iter().map(|c| c.start * es..c.end * es).collect();
        let mut out = match acc.into_native(dtype) {
            Ok(native) => native,
            Err(acc) => {
                let mut out = HostBuf::zeros(dtype, numel)?;
                out.as_bytes_mut()[byte_chunks[self.rank].clone()]
                    .copy_from_slice(&acc.to_native_bytes(own, dtype));
                out
            }
        };
        self.ring_all_gather(out.as_bytes_mut(), &byte_chunks)?;
        out.into_tensor(&shape)
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
        let mut acc = AccBuf::from_tensor(x)?;
        self.ring_reduce_scatter(&mut acc, &chunks, op)?;
        let own = chunks[self.rank].clone();
        acc.finish(own.clone(), op, n);
        let mut out_shape = shape.clone();
        out_shape[0] = chunk_range(rows, n, self.rank).len(); // (D/n, ...)
        bytes_to_tensor(&acc.to_native_bytes(own, dtype), dtype, &out_shape)
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
