//! Direct algorithms: every rank talks to the ranks it exchanges data with, once.
//!
//! ```text
//!   scatter (root 0)        gather (root 0)         all_to_all (3 ranks)
//!   0 --rows 1--> 1         1 --x_1--> 0            each rank r sends rows send_splits[p]
//!   0 --rows 2--> 2         2 --x_2--> 0            straight to p and reads recv_splits[p]
//!                                                   rows from each p, in rank order
//! ```
//!
//! A direct exchange moves each byte once, which for the sizes these ops carry in training
//! (activations of a pipeline stage, expert tokens) beats relaying them through a tree or a ring.
//! All sends are queued to the writer threads before any receive, so no pair of ranks can
//! deadlock waiting on each other. Point-to-point `send` / `recv` carry a header too, and the
//! receiver checks that it matches the shape and dtype it asked for.

use candle_core::{DType, Shape, Tensor};

use super::core::GroupCore;
use super::wire::{bytes_to_tensor, with_wire_bytes, HostBuf};
use crate::communicator::{chunk_range, CommError, OpKind, Result};

impl GroupCore {
    fn rows_and_row_bytes(&self, x: &Tensor) -> Result<(usize, usize)> {
        let shape = x.dims();
        let Some(&rows) = shape.first() else {
            return Err(self.invalid(format!(
                "{} needs a tensor with at least one dimension (it works on dim 0)",
                self.cur_op
            )));
        };
        Ok((
            rows,
            shape[1..].iter().product::<usize>() * x.dtype().size_in_bytes(),
        ))
    }

    pub(crate) fn scatter(&mut self, x: &Tensor, root: usize) -> Result<Tensor> {
        self.next_collective();
        if root >= self.size {
            return Err(self.invalid(format!(
                "root {root} is not a rank of this group of {} ranks",
                self.size
            )));
        }
        let is_root = self.rank == root;
        if is_root {
            self.rows_and_row_bytes(x)?;
        }
        if self.size == 1 {
            return Ok(x.contiguous()?.copy()?);
        }
        let dtype = x.dtype();
        let mut mine = self.header(dtype, if is_root { x.dims() } else { &[] });
        mine.root = Some(root);
        let headers = self.exchange_headers(|_| mine.clone())?;

        // Only the root's header carries the full shape; everyone derives its rows from it.
        let full = headers[root].shape.clone();
        let (rows, row_elems) = (full[0], full[1..].iter().product::<usize>());
        let row_bytes = row_elems * dtype.size_in_bytes();
        let mut out_shape = full.clone();
        out_shape[0] = chunk_range(rows, self.size, self.rank).len(); // (D/n, ...)
        if is_root {
            let all = HostBuf::from_tensor(x)?;
            let all = all.as_bytes();
            for p in (0..self.size).filter(|p| *p != root) {
                let c = chunk_range(rows, self.size, p);
                self.send(p, all[c.start * row_bytes..c.end * row_bytes].to_vec())?;
            }
            let c = chunk_range(rows, self.size, root);
            return bytes_to_tensor(
                &all[c.start * row_bytes..c.end * row_bytes],
                dtype,
                &out_shape,
            );
        }
        let buf = self.recv(root, out_shape[0] * row_bytes)?;
        bytes_to_tensor(&buf, dtype, &out_shape)
    }

    pub(crate) fn gather(&mut self, x: &Tensor, root: usize) -> Result<Tensor> {
        self.next_collective();
        if root >= self.size {
            return Err(self.invalid(format!(
                "root {root} is not a rank of this group of {} ranks",
                self.size
            )));
        }
        let (_, row_bytes) = self.rows_and_row_bytes(x)?;
        if self.size == 1 {
            return Ok(x.contiguous()?.copy()?);
        }
        let (dtype, shape) = (x.dtype(), x.dims().to_vec());
        let mut mine = self.header(dtype, &shape);
        mine.root = Some(root);
        let headers = self.exchange_headers(|_| mine.clone())?;

        if self.rank != root {
            self.send(root, HostBuf::from_tensor(x)?.as_bytes().to_vec())?;
            return Ok(x.contiguous()?.copy()?);
        }
        let total_rows: usize = headers.iter().map(|h| h.shape[0]).sum();
        let mut out = Vec::with_capacity(total_rows * row_bytes);
        for (p, h) in headers.iter().enumerate() {
            if p == root {
                out.extend_from_slice(HostBuf::from_tensor(x)?.as_bytes());
            } else {
                out.extend_from_slice(&self.recv(p, h.shape[0] * row_bytes)?);
            }
        }
        let mut out_shape = shape;
        out_shape[0] = total_rows; // (Σ d_r, ...)
        bytes_to_tensor(&out, dtype, &out_shape)
    }

    pub(crate) fn all_to_all(
        &mut self,
        x: &Tensor,
        send_splits: &[usize],
        recv_splits: &[usize],
    ) -> Result<Tensor> {
        self.next_collective();
        let (rows, row_bytes) = self.rows_and_row_bytes(x)?;
        let n = self.size;
        if send_splits.len() != n || recv_splits.len() != n {
            return Err(self.invalid(format!(
                "send_splits ({}) and recv_splits ({}) need one entry per rank of the group ({n})",
                send_splits.len(),
                recv_splits.len()
            )));
        }
        let sent: usize = send_splits.iter().sum();
        if sent != rows {
            return Err(self.invalid(format!(
                "send_splits {send_splits:?} add up to {sent} rows but the input has {rows}"
            )));
        }
        if send_splits[self.rank] != recv_splits[self.rank] {
            return Err(self.invalid(format!(
                "rank {} sends {} rows to itself but expects {} from itself",
                self.rank, send_splits[self.rank], recv_splits[self.rank]
            )));
        }
        let (dtype, shape) = (x.dtype(), x.dims().to_vec());
        let input = HostBuf::from_tensor(x)?;
        let input = input.as_bytes();
        let offsets: Vec<usize> = send_splits
            .iter()
            .scan(0, |at, s| {
                let o = *at;
                *at += s;
                Some(o)
            })
            .collect();
        let slice =
            |p: usize| &input[offsets[p] * row_bytes..(offsets[p] + send_splits[p]) * row_bytes];
        let mut out_shape = shape.clone();
        out_shape[0] = recv_splits.iter().sum(); // (Σ recv_splits, ...)
        if n == 1 {
            return bytes_to_tensor(slice(0), dtype, &out_shape);
        }
        let base = self.header(dtype, &shape);
        self.exchange_headers(|p| {
            let mut h = base.clone();
            h.pair = (send_splits[p] as u64, recv_splits[p] as u64);
            h
        })?;

        let me = self.rank;
        for p in (0..n).filter(|p| *p != me) {
            self.send(p, slice(p).to_vec())?;
        }
        let mut out = Vec::with_capacity(out_shape[0] * row_bytes);
        for (p, rows_from_p) in recv_splits.iter().enumerate() {
            if p == self.rank {
                out.extend_from_slice(slice(p));
            } else {
                out.extend_from_slice(&self.recv(p, rows_from_p * row_bytes)?);
            }
        }
        bytes_to_tensor(&out, dtype, &out_shape)
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.size || peer == self.rank {
            return Err(self.invalid(format!(
                "peer {peer} must be another rank of this group of {} ranks (this is rank {})",
                self.size, self.rank
            )));
        }
        Ok(())
    }

    pub(crate) fn send_to(&mut self, x: &Tensor, dst: usize) -> Result<()> {
        self.check_peer(dst)?;
        self.next_p2p(dst, true);
        let h = self.header(x.dtype(), x.dims());
        with_wire_bytes(x, |bytes| self.send_with_header(dst, &h, bytes))?
    }

    pub(crate) fn recv_from(&mut self, src: usize, shape: &Shape, dtype: DType) -> Result<Tensor> {
        self.check_peer(src)?;
        let seq = self.next_p2p(src, false);
        let theirs = self.recv_header(src)?;
        // What the sender's header must say for this recv to be its match.
        let mut expected = self.header(dtype, shape.dims());
        expected.op = OpKind::Send;
        if theirs.op != OpKind::Send
            || theirs.dtype != dtype
            || theirs.shape != shape.dims()
            || theirs.seq != seq
            || theirs.group != self.group_hash
        {
            return Err(CommError::Mismatch {
                group: self.name.clone(),
                rank: self.globals[self.rank],
                peer: self.globals[src],
                mine: format!(
                    "recv expecting {}, issued at {}",
                    expected.describe(),
                    self.cur_site
                ),
                theirs: theirs.describe(),
            });
        }
        let mut buf = HostBuf::zeros(dtype, shape.elem_count())?;
        self.recv_into(src, buf.as_bytes_mut())?;
        buf.into_tensor(shape.dims())
    }

    pub(crate) fn barrier(&mut self) -> Result<()> {
        self.next_collective();
        if self.size > 1 {
            let mine = self.header(DType::U8, &[]);
            self.exchange_headers(|_| mine.clone())?;
        }
        Ok(())
    }
}
