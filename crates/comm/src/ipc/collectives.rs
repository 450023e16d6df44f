//! The `Communicator` ops of an IPC group, each one `issue` with its phases.

use candle_core::{DType, Device, Shape, Tensor};

use super::driver::{DevBuf, IpcHandle};
use super::group::{uninit, IpcGroup};
use super::kernels::Peers;
use super::protocol::{grown_capacity, mail_flag, mail_targets, Mail, Phase};
use super::work::IpcWork;
use crate::communicator::{
    check_in_place, CommError, Communicator, OpKind, ReduceOp, Result, Work,
};
use crate::site::Site;
use crate::trace::Tracer;

/// Whether the reduction kernels take `dtype` (others reduce through the host group).
pub(super) fn reduces(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16)
}

/// The rows of dim 0 and the elements per row of `x` (a 0-dim tensor is one row).
pub(super) fn rows_of(x: &Tensor) -> (usize, usize) {
    match x.dims().first() {
        Some(&d) if d > 0 => (d, x.elem_count() / d),
        Some(_) => (0, x.dims()[1..].iter().product()),
        None => (1, 1),
    }
}

pub(super) fn with_rows(x: &Tensor, rows: usize) -> Shape {
    let mut dims = x.dims().to_vec();
    match dims.first_mut() {
        Some(d) => *d = rows,
        None => dims.push(rows),
    }
    Shape::from(dims)
}

impl Communicator for IpcGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn name(&self) -> &str {
        &self.name
    }
    fn global_ranks(&self) -> &[usize] {
        &self.global_ranks
    }
    fn device(&self) -> &Device {
        &self.device
    }
    fn tracer(&self) -> &Tracer {
        &self.tracer
    }

    fn all_reduce_async(&self, x: &Tensor, op: ReduceOp) -> Work {
        if !reduces(x.dtype()) {
            return self.fallback.all_reduce_async(x, op);
        }
        Self::work(self.all_reduce_into(x, None, op))
    }

    fn all_reduce_in_place(&self, x: &Tensor, op: ReduceOp) -> Result<()> {
        if !reduces(x.dtype()) {
            return crate::communicator::all_reduce_and_copy_back(&*self.fallback, x, op);
        }
        check_in_place(&self.name, x)?;
        Work::new(Box::new(self.all_reduce_into(x, Some(x.clone()), op)?))
            .wait()
            .map(|_| ())
    }

    fn reduce_async(&self, x: &Tensor, root: usize, op: ReduceOp) -> Work {
        let site = Site::caller();
        if !reduces(x.dtype()) {
            return self.fallback.reduce_async(x, root, op);
        }
        let k = OpKind::Reduce;
        Self::work((|| {
            self.root_ok(k, root)?;
            let x = self.input(k, x)?;
            self.reduce_dtype(k, x.dtype())?;
            let is_root = self.rank == root;
            let out = match is_root {
                true => uninit(x.shape(), x.dtype(), &self.device)?,
                false => x.clone(),
            };
            let (n, count, dtype) = (self.size, x.elem_count(), x.dtype());
            let bytes = count * dtype.size_in_bytes();
            let bufs = match is_root {
                true => vec![x.clone(), out.clone()],
                false => vec![x.clone()],
            };
            self.issue(
                site,
                k,
                bytes as u64,
                bytes as u64,
                Some(root),
                bufs,
                out,
                move |is, a| {
                    is.g.ensure_data(is.st, bytes)?;
                    is.publish(a[0], bytes)?;
                    if is_root {
                        let src = Peers::of(&is.data().addr);
                        is.g.kernels
                            .reduce(&is.g.stream, dtype, src, n, 0, a[1], count, op)
                            .map_err(|e| is.g.err(e))?;
                    }
                    is.barrier(Phase::Done)
                },
            )
        })())
    }

    fn broadcast_async(&self, x: &Tensor, root: usize) -> Work {
        let site = Site::caller();
        let k = OpKind::Broadcast;
        Self::work((|| {
            self.root_ok(k, root)?;
            let x = self.input(k, x)?;
            let bytes = x.elem_count() * x.dtype().size_in_bytes();
            let out = uninit(x.shape(), x.dtype(), &self.device)?;
            let is_root = self.rank == root;
            let sent = if is_root {
                (self.size as u64 - 1) * bytes as u64
            } else {
                0
            };
            self.issue(
                site,
                k,
                bytes as u64,
                sent,
                Some(root),
                vec![x, out.clone()],
                out,
                move |is, a| {
                    is.g.ensure_data(is.st, bytes)?;
                    match is_root {
                        true => is.publish(a[0], bytes)?,
                        false => is.barrier(Phase::Ready)?,
                    }
                    let src = is.data().addr[root];
                    is.copy(a[1], src, bytes)?;
                    is.barrier(Phase::Done)
                },
            )
        })())
    }

    fn all_gather_async(&self, x: &Tensor) -> Work {
        let site = Site::caller();
        let k = OpKind::AllGather;
        Self::work((|| {
            let x = self.input(k, x)?;
            let (rows, row) = rows_of(&x);
            let es = x.dtype().size_in_bytes();
            let all = self.host_gather(&[rows as i64, row as i64])?;
            if let Some((q, r)) = all.iter().enumerate().find(|(_, r)| r[1] as usize != row) {
                return Err(self.invalid(
                    k,
                    format!(
                        "rank {q} gathers rows of {} elements, this rank of {row}",
                        r[1]
                    ),
                ));
            }
            let counts: Vec<usize> = all.iter().map(|r| r[0] as usize).collect();
            let total: usize = counts.iter().sum();
            let out = uninit(&with_rows(&x, total), x.dtype(), &self.device)?;
            let bytes = rows * row * es;
            let most = counts.iter().max().copied().unwrap_or(0) * row * es;
            let sent = (self.size as u64 - 1) * bytes as u64;
            self.issue(
                site,
                k,
                bytes as u64,
                sent,
                None,
                vec![x, out.clone()],
                out,
                move |is, a| {
                    is.g.ensure_data(is.st, most)?;
                    is.publish(a[0], bytes)?;
                    let mut off = 0;
                    for (q, c) in counts.iter().enumerate() {
                        let len = c * row * es;
                        is.copy(a[1] + off as u64, is.data().addr[q], len)?;
                        off += len;
                    }
                    is.barrier(Phase::Done)
                },
            )
        })())
    }

    fn reduce_scatter_async(&self, x: &Tensor, op: ReduceOp) -> Work {
        let site = Site::caller();
        if !reduces(x.dtype()) {
            return self.fallback.reduce_scatter_async(x, op);
        }
        let k = OpKind::ReduceScatter;
        Self::work((|| {
            let x = self.input(k, x)?;
            self.reduce_dtype(k, x.dtype())?;
            let (rows, row) = rows_of(&x);
            let (n, dtype) = (self.size, x.dtype());
            let chunk = crate::communicator::chunk_range(rows, n, self.rank);
            let out = uninit(&with_rows(&x, chunk.len()), dtype, &self.device)?;
            let bytes = rows * row * dtype.size_in_bytes();
            let sent = ((n - 1) * bytes / n) as u64;
            self.issue(
                site,
                k,
                bytes as u64,
                sent,
                None,
                vec![x, out.clone()],
                out,
                move |is, a| {
                    is.g.ensure_data(is.st, bytes)?;
                    is.publish(a[0], bytes)?;
                    let src = Peers::of(&is.data().addr);
                    is.g.kernels
                        .reduce(
                            &is.g.stream,
                            dtype,
                            src,
                            n,
                            chunk.start * row,
                            a[1],
                            chunk.len() * row,
                            op,
                        )
                        .map_err(|e| is.g.err(e))?;
                    is.barrier(Phase::Done)
                },
            )
        })())
    }

    fn scatter_async(&self, x: &Tensor, root: usize) -> Work {
        let site = Site::caller();
        let k = OpKind::Scatter;
        Self::work((|| {
            self.root_ok(k, root)?;
            let is_root = self.rank == root;
            // The root's shape, through the host (the others' x carries only the dtype).
            let mut dims = vec![0i64; 9];
            if is_root {
                dims[0] = x.rank() as i64;
                for (i, d) in x.dims().iter().enumerate().take(8) {
                    dims[i + 1] = *d as i64;
                }
            }
            let all = self.host_gather(&dims)?;
            let shape: Vec<usize> = all[root][1..=all[root][0] as usize]
                .iter()
                .map(|d| *d as usize)
                .collect();
            let x = match is_root {
                true => self.input(k, x)?,
                false => x.clone(),
            };
            let dtype = x.dtype();
            let es = dtype.size_in_bytes();
            let rows = shape.first().copied().unwrap_or(1);
            let row: usize = shape.iter().skip(1).product();
            let chunk = crate::communicator::chunk_range(rows, self.size, self.rank);
            let mut out_dims = shape.clone();
            if let Some(d) = out_dims.first_mut() {
                *d = chunk.len();
            }
            let out = uninit(&Shape::from(out_dims), dtype, &self.device)?;
            let bytes = rows * row * es;
            let bufs = match is_root {
                true => vec![out.clone(), x],
                false => vec![out.clone()],
            };
            self.issue(site, k, bytes as u64, 0, Some(root), bufs, out, move |is, a| {
                is.g.ensure_data(is.st, bytes)?;
                match is_root {
                    true => is.publish(a[1], bytes)?,
                    false => is.barrier(Phase::Ready)?,
                }
                let src = is.data().addr[root] + (chunk.start * row * es) as u64;
                is.copy(a[0], src, chunk.len() * row * es)?;
                is.barrier(Phase::Done)
            })
        })())
    }

    fn gather_async(&self, x: &Tensor, root: usize) -> Work {
        let site = Site::caller();
        let k = OpKind::Gather;
        Self::work((|| {
            self.root_ok(k, root)?;
            let x = self.input(k, x)?;
            let (rows, row) = rows_of(&x);
            let es = x.dtype().size_in_bytes();
            let all = self.host_gather(&[rows as i64])?;
            let counts: Vec<usize> = all.iter().map(|r| r[0] as usize).collect();
            let total: usize = counts.iter().sum();
            let is_root = self.rank == root;
            let out = match is_root {
                true => uninit(&with_rows(&x, total), x.dtype(), &self.device)?,
                false => x.clone(),
            };
            let bytes = rows * row * es;
            let most = counts.iter().max().copied().unwrap_or(0) * row * es;
            let bufs = match is_root {
                true => vec![x, out.clone()],
                false => vec![x],
            };
            self.issue(
                site,
                k,
                bytes as u64,
                bytes as u64,
                Some(root),
                bufs,
                out,
                move |is, a| {
                    is.g.ensure_data(is.st, most)?;
                    is.publish(a[0], bytes)?;
                    if is_root {
                        let mut off = 0;
                        for (q, c) in counts.iter().enumerate() {
                            let len = c * row * es;
                            is.copy(a[1] + off as u64, is.data().addr[q], len)?;
                            off += len;
                        }
                    }
                    is.barrier(Phase::Done)
                },
            )
        })())
    }

    fn all_to_all_async(&self, x: &Tensor, send_splits: &[usize], recv_splits: &[usize]) -> Work {
        let site = Site::caller();
        let k = OpKind::AllToAll;
        Self::work((|| {
            let n = self.size;
            if send_splits.len() != n || recv_splits.len() != n {
                return Err(self.invalid(
                    k,
                    format!(
                        "send_splits has {} entries and recv_splits {}, the group {n} ranks",
                        send_splits.len(),
                        recv_splits.len()
                    ),
                ));
            }
            let x = self.input(k, x)?;
            let (rows, row) = rows_of(&x);
            if send_splits.iter().sum::<usize>() != rows {
                return Err(self.invalid(
                    k,
                    format!("send_splits {send_splits:?} do not sum to the input's {rows} rows"),
                ));
            }
            let es = x.dtype().size_in_bytes();
            let mine: Vec<i64> = send_splits.iter().map(|s| *s as i64).collect();
            let table = self.host_gather(&mine)?;
            for (p, want) in recv_splits.iter().enumerate() {
                let sent = table[p][self.rank] as usize;
                if sent != *want {
                    return Err(CommError::Mismatch {
                        group: self.name.clone(),
                        rank: self.global_ranks[self.rank],
                        peer: self.global_ranks[p],
                        mine: format!("all_to_all expecting {want} rows from rank {p}"),
                        theirs: format!("all_to_all sending {sent} rows to rank {}", self.rank),
                    });
                }
            }
            let most = table
                .iter()
                .map(|t| t.iter().sum::<i64>() as usize)
                .max()
                .unwrap_or(0)
                * row
                * es;
            let total: usize = recv_splits.iter().sum();
            let out = uninit(&with_rows(&x, total), x.dtype(), &self.device)?;
            let bytes = rows * row * es;
            let me = self.rank;
            let recv = recv_splits.to_vec();
            let sent = (bytes - send_splits[me] * row * es) as u64;
            self.issue(
                site,
                k,
                bytes as u64,
                sent,
                None,
                vec![x, out.clone()],
                out,
                move |is, a| {
                    is.g.ensure_data(is.st, most)?;
                    is.publish(a[0], bytes)?;
                    let mut off = 0;
                    for (p, r) in recv.iter().enumerate() {
                        let splits: Vec<usize> = table[p].iter().map(|s| *s as usize).collect();
                        let from = super::protocol::all_to_all_offset(&splits, me, row) * es;
                        let len = r * row * es;
                        is.copy(a[1] + off as u64, is.data().addr[p] + from as u64, len)?;
                        off += len;
                    }
                    is.barrier(Phase::Done)
                },
            )
        })())
    }

    fn send_async(&self, x: &Tensor, dst: usize) -> Work<()> {
        let site = Site::caller();
        let k = OpKind::Send;
        Self::work((|| {
            self.peer_ok(k, dst)?;
            let x = self.input(k, x)?;
            let bytes = x.elem_count() * x.dtype().size_in_bytes();
            self.issue(
                site,
                k,
                bytes as u64,
                bytes as u64,
                Some(dst),
                vec![x],
                (),
                move |is, a| {
                    let g = is.g;
                    let me = g.rank;
                    is.st.sent[dst] += 1;
                    let m = is.st.sent[dst];
                    let (ack, _) = mail_targets(m);
                    let cap = is.st.out_box[dst].as_ref().map_or(0, |b| b.bytes());
                    let grown = grown_capacity(cap, bytes);
                    if grown != cap || is.st.out_box[dst].is_none() {
                        let b = DevBuf::alloc(&g.ctx, grown).map_err(|e| g.err(e))?;
                        let h = b.handle().map_err(|e| g.err(e))?;
                        g.store_of(k)?.set(&g.box_key(me, dst, grown), &h)?;
                        if let Some(old) = is.st.out_box[dst].replace(b) {
                            is.st.retired.push(old);
                        }
                    }
                    // The previous message to dst was copied out: the mailbox may be overwritten.
                    is.wait(&[(mail_flag(Mail::Ack, dst), dst)], ack)?;
                    let slot = is.st.out_box[dst].as_ref().map_or(0, |b| b.ptr());
                    is.copy(slot, a[0], bytes)?;
                    let sig = g.flags.addr[dst] + mail_flag(Mail::Sig, me) as u64;
                    is.write(&[sig], m)
                },
            )
        })())
    }

    fn recv_async(&self, src: usize, shape: &Shape, dtype: DType) -> Work {
        let site = Site::caller();
        let k = OpKind::Recv;
        Self::work((|| {
            self.peer_ok(k, src)?;
            let out = uninit(shape, dtype, &self.device)?;
            let bytes = shape.elem_count() * dtype.size_in_bytes();
            self.issue(
                site,
                k,
                bytes as u64,
                0,
                Some(src),
                vec![out.clone()],
                out,
                move |is, a| {
                    let g = is.g;
                    let me = g.rank;
                    is.st.received[src] += 1;
                    let m = is.st.received[src];
                    let (_, sig) = mail_targets(m);
                    let cap = is.st.in_box[src].as_ref().map_or(0, |b| b.bytes());
                    let grown = grown_capacity(cap, bytes);
                    if grown != cap || is.st.in_box[src].is_none() {
                        let raw = g.store_of(k)?.get(&g.box_key(src, me, grown))?;
                        let mut h: IpcHandle = [0; 64];
                        if raw.len() != 64 {
                            return Err(CommError::Store(format!(
                                "mailbox handle of {} bytes",
                                raw.len()
                            )));
                        }
                        h.copy_from_slice(&raw);
                        let b = DevBuf::open(&g.ctx, &h, grown).map_err(|e| g.err(e))?;
                        if let Some(old) = is.st.in_box[src].replace(b) {
                            is.st.retired.push(old);
                        }
                    }
                    is.wait(&[(mail_flag(Mail::Sig, src), src)], sig)?;
                    let slot = is.st.in_box[src].as_ref().map_or(0, |b| b.ptr());
                    is.copy(a[0], slot, bytes)?;
                    let ack = g.flags.addr[src] + mail_flag(Mail::Ack, me) as u64;
                    is.write(&[ack], m)
                },
            )
        })())
    }

    fn barrier_async(&self) -> Work<()> {
        let site = Site::caller();
        let r = self.issue(site, OpKind::Barrier, 0, 0, None, vec![], (), |is, _| {
            is.barrier(Phase::Ready)
        });
        match r {
            Ok(mut w) => {
                w.host_blocks = true;
                Work::new(Box::new(w))
            }
            Err(e) => Work::ready(Err(e)),
        }
    }
}

impl IpcGroup {
    /// All-reduce into `out` (a new tensor, or `x` itself for the in-place form).
    #[track_caller]
    pub(super) fn all_reduce_into(
        &self,
        x: &Tensor,
        out: Option<Tensor>,
        op: ReduceOp,
    ) -> Result<IpcWork<Tensor>> {
        let site = Site::caller();
        let k = OpKind::AllReduce;
        let x = self.input(k, x)?;
        self.reduce_dtype(k, x.dtype())?;
        // In place, `x` is the only buffer and the result lands in it.
        let (out, bufs) = match out {
            Some(o) => (o, vec![x.clone()]),
            None => {
                let o = uninit(x.shape(), x.dtype(), &self.device)?;
                (o.clone(), vec![x.clone(), o])
            }
        };
        let (n, count, dtype) = (self.size, x.elem_count(), x.dtype());
        let bytes = count * dtype.size_in_bytes();
        let algo = super::protocol::choose_all_reduce(bytes, n, self.opts.one_shot_max);
        self.issue(
            site,
            k,
            bytes as u64,
            (n as u64 - 1) * bytes as u64,
            None,
            bufs,
            out,
            move |is, a| {
                let (ax, ao) = (a[0], *a.last().unwrap_or(&a[0]));
                match algo {
                    super::protocol::AllReduceAlgo::OneShot => {
                        is.one_shot(ax, ao, count, dtype, op)
                    }
                    super::protocol::AllReduceAlgo::TwoShot => {
                        is.two_shot(ax, ao, count, dtype, op)
                    }
                }
            },
        )
    }
}
