//! Binomial-tree broadcast and reduce: log2(n) rounds, latency-optimal for the rooted ops.
//!
//! Ranks are renumbered relative to the root, v = (r - root) mod n. In the broadcast, the
//! number of ranks holding the data doubles each round, highest bit first: in the round of bit
//! `mask`, every holder (v a multiple of 2*mask) sends to v + mask. For n = 8 (root 0):
//!
//! ```text
//!   mask=4: 0 -> 4
//!   mask=2: 0 -> 2, 4 -> 6
//!   mask=1: 0 -> 1, 2 -> 3, 4 -> 5, 6 -> 7
//! ```
//!
//! The reduce is the same tree walked backwards, lowest bit first: in the round of bit `mask`, a rank whose bit
//! `mask` is set sends its partial result to v - mask and drops out; the others combine what
//! they receive from v + mask. The root ends with the reduction over all ranks. Partial results
//! travel in the accumulation type (f32 for half-precision inputs). The broadcast is pipelined:
//! large messages move in segments, and a rank forwards each segment to its children as soon as
//! it has arrived, so the tree's depth costs one segment's latency per level, not one message's.

use candle_core::Tensor;

use super::core::{segments, GroupCore};
use super::wire::{bytes_to_tensor, AccBuf, HostBuf, Scratch};
use crate::communicator::{ReduceOp, Result};

impl GroupCore {
    fn check_root(&self, root: usize) -> Result<()> {
        if root < self.size {
            Ok(())
        } else {
            Err(self.invalid(format!(
                "root {root} is not a rank of this group of {} ranks",
                self.size
            )))
        }
    }

    /// Group rank of relative rank `v`.
    fn absolute(&self, v: usize, root: usize) -> usize {
        (v + root) % self.size
    }

    pub(crate) fn broadcast(&mut self, x: &Tensor, root: usize) -> Result<Tensor> {
        self.next_collective();
        self.check_root(root)?;
        if self.size == 1 {
            return Ok(x.contiguous()?.copy()?);
        }
        let (dtype, shape) = (x.dtype(), x.dims().to_vec());
        let mut mine = self.header(dtype, &shape);
        mine.root = Some(root);
        self.exchange_headers(|_| mine.clone())?;

        let n = self.size;
        let v = (self.rank + n - root) % n;
        // Our parent is the rank that differs from us in our lowest set bit; our children are
        // v + mask for every lower bit, the largest subtree first.
        let mut parent = None;
        let mut mask = 1;
        while mask < n {
            if v & mask != 0 {
                parent = Some(self.absolute(v - mask, root));
                break;
            }
            mask <<= 1;
        }
        let mut children = Vec::new();
        mask >>= 1;
        while mask > 0 {
            if v + mask < n {
                children.push(self.absolute(v + mask, root));
            }
            mask >>= 1;
        }
        // Pipelined by segment: each segment goes on to the children as soon as it has arrived.
        let mut buf = if v == 0 {
            HostBuf::from_tensor(x)?
        } else {
            HostBuf::zeros(dtype, x.elem_count())?
        };
        let total = buf.as_bytes().len();
        for seg in segments(0..total, 1) {
            if let Some(p) = parent {
                self.recv_into(p, &mut buf.as_bytes_mut()[seg.clone()])?;
            }
            for &c in &children {
                self.send(c, buf.as_bytes()[seg.clone()].to_vec())?;
            }
        }
        buf.into_tensor(&shape)
    }

    pub(crate) fn reduce(&mut self, x: &Tensor, root: usize, op: ReduceOp) -> Result<Tensor> {
        self.next_collective();
        self.check_root(root)?;
        if self.size == 1 {
            return Ok(x.contiguous()?.copy()?);
        }
        let (dtype, shape) = (x.dtype(), x.dims().to_vec());
        let mut mine = self.header(dtype, &shape);
        mine.root = Some(root);
        mine.reduce = Some(op);
        self.exchange_headers(|_| mine.clone())?;

        let n = self.size;
        let numel = x.elem_count();
        let v = (self.rank + n - root) % n;
        let mut acc = AccBuf::from_tensor(x)?;
        let mut mask = 1;
        while mask < n {
            if v & mask == 0 {
                if v + mask < n {
                    let src = self.absolute(v + mask, root);
                    // The whole tensor arrives at once: a scratch of its size, not kept past the op.
                    let mut scratch = Scratch::default();
                    acc.recv_combine(0..numel, op, &mut scratch, |buf| self.recv_into(src, buf))?;
                }
            } else {
                let dst = self.absolute(v - mask, root);
                self.send(dst, acc.encode(0..numel))?;
                // Non-roots return their input unchanged.
                return Ok(x.contiguous()?.copy()?);
            }
            mask <<= 1;
        }
        acc.finish(0..numel, op, n);
        bytes_to_tensor(&acc.to_native_bytes(0..numel, dtype), dtype, &shape)
    }
}
