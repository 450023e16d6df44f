//! The collectives on NCCL, each issued through `stream`'s launch: the ones NCCL has, and the
//! ones it lacks built from them (uneven all-gather and reduce-scatter, scatter, gather,
//! all-to-all as grouped send/recv).

use candle_core::cuda_backend::cudarc::nccl::sys as nccl;
use candle_core::{DType, Device, Shape, Storage, Tensor};

use super::args::{describe_header, dtype_code, reduce_op};
use super::group::{check, NcclGroup};
use crate::communicator::{chunk_range, CommError, OpKind, ReduceOp, Result, Work};

impl NcclGroup {
    #[track_caller]
    pub(super) fn all_reduce_impl(&self, x: &Tensor, op: ReduceOp) -> Result<Work> {
        let k = OpKind::AllReduce;
        let x = self.input(k, x)?;
        let ty = self.reduce_type(k, x.dtype())?;
        self.check_header(k, x.dtype(), x.elem_count(), None)?;
        let out = uninit(x.shape(), x.dtype(), x.device())?; // same shape as x, NCCL writes it all
        let (n, count, bytes) = (self.shared.size as u64, x.elem_count(), nbytes(&x));
        Ok(self.launch(
            k,
            bytes,
            2 * (n - 1) * bytes / n,
            None,
            vec![x, out.clone()],
            out,
            {
                move |comm, stream, a| {
                    // SAFETY: a[0] and a[1] address `count` elements of type `ty` on this device.
                    check(unsafe {
                        nccl::ncclAllReduce(
                            a[0] as _,
                            a[1] as _,
                            count,
                            ty,
                            reduce_op(op),
                            comm,
                            stream,
                        )
                    })
                }
            },
        ))
    }

    #[track_caller]
    pub(super) fn reduce_impl(&self, x: &Tensor, root: usize, op: ReduceOp) -> Result<Work> {
        let k = OpKind::Reduce;
        self.root_ok(k, root)?;
        let x = self.input(k, x)?;
        let ty = self.reduce_type(k, x.dtype())?;
        self.check_header(k, x.dtype(), x.elem_count(), Some(root))?;
        let is_root = self.shared.rank == root;
        // The root receives into a new tensor; the others' result is their input, unchanged.
        let out = if is_root {
            uninit(x.shape(), x.dtype(), x.device())? // NCCL writes all of it on the root
        } else {
            x.clone()
        };
        let (count, bytes) = (x.elem_count(), nbytes(&x));
        let sent = if is_root { 0 } else { bytes };
        Ok(self.launch(
            k,
            bytes,
            sent,
            Some(root),
            // A non-root's result is its input: one buffer (its storage is locked only once).
            if is_root {
                vec![x, out.clone()]
            } else {
                vec![x]
            },
            out,
            move |comm, stream, a| {
                // SAFETY: a[0] (input) and the root's a[1] (output) hold `count` elements of
                // `ty`; NCCL writes the receive buffer on the root only.
                let recv = if is_root { a[1] } else { a[0] };
                check(unsafe {
                    nccl::ncclReduce(
                        a[0] as _,
                        recv as _,
                        count,
                        ty,
                        reduce_op(op),
                        root as i32,
                        comm,
                        stream,
                    )
                })
            },
        ))
    }

    #[track_caller]
    pub(super) fn broadcast_impl(&self, x: &Tensor, root: usize) -> Result<Work> {
        let k = OpKind::Broadcast;
        self.root_ok(k, root)?;
        let x = self.input(k, x)?;
        self.check_header(k, x.dtype(), x.elem_count(), Some(root))?;
        let out = uninit(x.shape(), x.dtype(), x.device())?; // shape of x, values of the root's x
        let bytes = nbytes(&x);
        let sent = if self.shared.rank == root { bytes } else { 0 };
        Ok(self.launch(
            k,
            bytes,
            sent,
            Some(root),
            vec![x, out.clone()],
            out,
            move |comm, stream, a| {
                // SAFETY: both buffers hold `bytes` bytes; the root reads a[0], every rank writes a[1].
                unsafe { broadcast_bytes(a[0], a[1], bytes as usize, root, comm, stream) }
            },
        ))
    }

    /// Everyone's (rows, elements per row, dtype), exchanged on the host.
    ///
    /// This is a host rendezvous: the host waits until every rank issued the op and this
    /// group's earlier ops finished on the GPU. A group of one skips it.
    #[track_caller]
    pub(super) fn row_counts(
        &self,
        k: OpKind,
        x: &Tensor,
        root: Option<usize>,
    ) -> Result<Vec<usize>> {
        let (rows, per_row) = self.rows(k, x)?;
        if self.shared.size == 1 {
            return Ok(vec![rows]);
        }
        let mine = [
            k as u64,
            dtype_code(x.dtype()),
            per_row as u64,
            root.map_or(u64::MAX, |r| r as u64),
        ];
        let all = self.exchange_host(k, &[mine[0], mine[1], mine[2], mine[3], rows as u64])?;
        let mut counts = Vec::with_capacity(all.len());
        for (peer, theirs) in all.iter().enumerate() {
            if theirs[..4] != mine {
                return Err(CommError::Mismatch {
                    group: self.name().to_string(),
                    rank: self.shared.rank,
                    peer,
                    mine: format!("{} with {per_row} elements per row", describe_header(&mine)),
                    theirs: format!(
                        "{} with {} elements per row",
                        describe_header(&theirs[..4]),
                        theirs[2]
                    ),
                });
            }
            counts.push(theirs[4] as usize);
        }
        Ok(counts)
    }

    #[track_caller]
    pub(super) fn all_gather_impl(&self, x: &Tensor) -> Result<Work> {
        let k = OpKind::AllGather;
        let x = self.input(k, x)?;
        let rows = self.row_counts(k, &x, None)?;
        let (_, per_row) = self.rows(k, &x)?;
        let total: usize = rows.iter().sum();
        let out = zeros_with_rows(&x, total)?; // (Σ d_r, ...)
        let row_bytes = per_row * x.dtype().size_in_bytes();
        let bytes = nbytes(&x);
        let sent = bytes * (self.shared.size as u64 - 1);
        let even = rows.iter().all(|&r| r == rows[0]);
        Ok(self.launch(
            k,
            bytes,
            sent,
            None,
            vec![x, out.clone()],
            out,
            move |comm, stream, a| {
                if even {
                    // SAFETY: a[0] holds rows[0] rows, a[1] holds n times as many.
                    return check(unsafe {
                        nccl::ncclAllGather(
                            a[0] as _,
                            a[1] as _,
                            rows[0] * row_bytes,
                            nccl::ncclDataType_t::ncclUint8,
                            comm,
                            stream,
                        )
                    });
                }
                // Uneven: rank r broadcasts its rows straight to their offset in everyone's output.
                group(|| {
                    let mut offset = 0u64;
                    for (r, &d) in rows.iter().enumerate() {
                        // SAFETY: rank r's a[0] holds d rows; a[1] + offset has room for them.
                        unsafe {
                            broadcast_bytes(a[0], a[1] + offset, d * row_bytes, r, comm, stream)
                        }?;
                        offset += (d * row_bytes) as u64;
                    }
                    Ok(())
                })
            },
        ))
    }

    #[track_caller]
    pub(super) fn reduce_scatter_impl(&self, x: &Tensor, op: ReduceOp) -> Result<Work> {
        let k = OpKind::ReduceScatter;
        let x = self.input(k, x)?;
        let ty = self.reduce_type(k, x.dtype())?;
        self.check_header(k, x.dtype(), x.elem_count(), None)?;
        let (d, per_row) = self.rows(k, &x)?;
        let (n, me) = (self.shared.size, self.shared.rank);
        let chunk = d.div_ceil(n);
        // Pad so that chunk r starts at row r * chunk: NCCL needs equal chunks.
        let padded = if d % n == 0 {
            x.clone()
        } else {
            pad_chunks(&x, n)?
        }; // (n * chunk, ...)
        let out = zeros_with_rows(&x, chunk)?; // (chunk, ...)
        let mine = chunk_range(d, n, me);
        let result = out.narrow(0, 0, mine.len())?; // (|chunk_range(D, n, r)|, ...)
        let bytes = nbytes(&x);
        let sent = (n as u64 - 1) * bytes / n as u64;
        let count = chunk * per_row;
        Ok(self.launch(
            k,
            bytes,
            sent,
            None,
            vec![padded, out],
            result,
            move |comm, stream, a| {
                // SAFETY: a[0] holds n * count elements of `ty`, a[1] holds count.
                check(unsafe {
                    nccl::ncclReduceScatter(
                        a[0] as _,
                        a[1] as _,
                        count,
                        ty,
                        reduce_op(op),
                        comm,
                        stream,
                    )
                })
            },
        ))
    }

    #[track_caller]
    pub(super) fn scatter_impl(&self, x: &Tensor, root: usize) -> Result<Work> {
        let k = OpKind::Scatter;
        self.root_ok(k, root)?;
        let x = self.input(k, x)?;
        let (n, me) = (self.shared.size, self.shared.rank);
        // The others learn the root's shape: (op, dtype, rank count, dims...). Only the root's
        // shape matters; a root with an unusable shape still joins the exchange (rank count
        // u64::MAX), so that every rank fails together instead of waiting for it.
        let root_dims_ok = (1..=MAX_DIMS).contains(&x.rank());
        let mut header = vec![k as u64, dtype_code(x.dtype()), 0];
        if me == root {
            header[2] = if root_dims_ok {
                x.rank() as u64
            } else {
                u64::MAX
            };
            if root_dims_ok {
                header.extend(x.dims().iter().map(|&d| d as u64));
            }
        }
        header.resize(3 + MAX_DIMS, 0);
        let all = self.exchange_host(k, &header)?;
        let root_header = &all[root];
        if root_header[..2] != header[..2] {
            return Err(CommError::Mismatch {
                group: self.name().to_string(),
                rank: me,
                peer: root,
                mine: format!("{k}({:?})", x.dtype()),
                theirs: describe_header(&[root_header[0], root_header[1], 0, root as u64]),
            });
        }
        if root_header[2] == u64::MAX {
            return Err(self.invalid(
                k,
                format!("the root (rank {root}) needs a tensor of 1 to {MAX_DIMS} dimensions"),
            ));
        }
        let dims: Vec<usize> = root_header[3..3 + root_header[2] as usize]
            .iter()
            .map(|&d| d as usize)
            .collect();
        let d = dims[0];
        let row_bytes = dims[1..].iter().product::<usize>() * x.dtype().size_in_bytes();
        let mut shape = dims.clone();
        shape[0] = chunk_range(d, n, me).len();
        let out = Tensor::zeros(shape, x.dtype(), x.device())?; // rows chunk_range(D, n, r)
        let bytes = nbytes(&x);
        let sent = if me == root { bytes } else { 0 };
        Ok(self.launch(
            k,
            bytes,
            sent,
            Some(root),
            vec![x, out.clone()],
            out,
            move |comm, stream, a| {
                group(|| {
                    if me == root {
                        for p in 0..n {
                            let c = chunk_range(d, n, p);
                            let at = a[0] + (c.start * row_bytes) as u64;
                            // SAFETY: rows c of the root's input lie within a[0].
                            unsafe { send_bytes(at, c.len() * row_bytes, p, comm, stream) }?;
                        }
                    }
                    let len = chunk_range(d, n, me).len() * row_bytes;
                    // SAFETY: a[1] holds exactly this rank's chunk.
                    unsafe { recv_bytes(a[1], len, root, comm, stream) }
                })
            },
        ))
    }

    #[track_caller]
    pub(super) fn gather_impl(&self, x: &Tensor, root: usize) -> Result<Work> {
        let k = OpKind::Gather;
        self.root_ok(k, root)?;
        let x = self.input(k, x)?;
        let rows = self.row_counts(k, &x, Some(root))?;
        let (_, per_row) = self.rows(k, &x)?;
        let row_bytes = per_row * x.dtype().size_in_bytes();
        let me = self.shared.rank;
        let out = if me == root {
            zeros_with_rows(&x, rows.iter().sum())? // (Σ d_r, ...)
        } else {
            x.clone()
        };
        let bytes = nbytes(&x);
        let sent = if me == root { 0 } else { bytes };
        Ok(self.launch(
            k,
            bytes,
            sent,
            Some(root),
            if me == root {
                vec![x, out.clone()]
            } else {
                vec![x]
            },
            out,
            move |comm, stream, a| {
                group(|| {
                    // SAFETY: a[0] holds rows[me] rows.
                    unsafe { send_bytes(a[0], rows[me] * row_bytes, root, comm, stream) }?;
                    if me == root {
                        let mut offset = 0u64;
                        for (p, &d) in rows.iter().enumerate() {
                            // SAFETY: a[1] + offset has room for rank p's d rows.
                            unsafe { recv_bytes(a[1] + offset, d * row_bytes, p, comm, stream) }?;
                            offset += (d * row_bytes) as u64;
                        }
                    }
                    Ok(())
                })
            },
        ))
    }

    #[track_caller]
    pub(super) fn all_to_all_impl(
        &self,
        x: &Tensor,
        send: &[usize],
        recv: &[usize],
    ) -> Result<Work> {
        let k = OpKind::AllToAll;
        let x = self.input(k, x)?;
        let n = self.shared.size;
        let (d, per_row) = self.rows(k, &x)?;
        if send.len() != n || recv.len() != n {
            return Err(self.invalid(
                k,
                format!(
                    "{} send and {} recv splits for a group of {n}",
                    send.len(),
                    recv.len()
                ),
            ));
        }
        if send.iter().sum::<usize>() != d {
            return Err(self.invalid(
                k,
                format!("send splits {send:?} do not add up to the {d} input rows"),
            ));
        }
        self.check_header(k, x.dtype(), per_row, None)?;
        let out = zeros_with_rows(&x, recv.iter().sum())?; // (Σ recv, ...)
        let row_bytes = per_row * x.dtype().size_in_bytes();
        let me = self.shared.rank;
        let sent = send
            .iter()
            .enumerate()
            .filter(|&(p, _)| p != me)
            .map(|(_, &s)| (s * row_bytes) as u64)
            .sum();
        let (send, recv) = (send.to_vec(), recv.to_vec());
        Ok(self.launch(
            k,
            nbytes(&x),
            sent,
            None,
            vec![x, out.clone()],
            out,
            move |comm, stream, a| {
                group(|| {
                    let (mut so, mut ro) = (0u64, 0u64);
                    for p in 0..n {
                        if send[p] > 0 {
                            // SAFETY: rows [so, so + send[p]) of the input.
                            unsafe { send_bytes(a[0] + so, send[p] * row_bytes, p, comm, stream) }?;
                        }
                        if recv[p] > 0 {
                            // SAFETY: the output has room for recv[p] rows at ro.
                            unsafe { recv_bytes(a[1] + ro, recv[p] * row_bytes, p, comm, stream) }?;
                        }
                        so += (send[p] * row_bytes) as u64;
                        ro += (recv[p] * row_bytes) as u64;
                    }
                    Ok(())
                })
            },
        ))
    }

    #[track_caller]
    pub(super) fn send_impl(&self, x: &Tensor, dst: usize) -> Result<Work<()>> {
        let k = OpKind::Send;
        self.root_ok(k, dst)?;
        let x = self.input(k, x)?;
        let bytes = nbytes(&x);
        Ok(self.launch(
            k,
            bytes,
            bytes,
            Some(dst),
            vec![x],
            (),
            move |comm, stream, a| {
                // SAFETY: a[0] holds `bytes` bytes.
                unsafe { send_bytes(a[0], bytes as usize, dst, comm, stream) }
            },
        ))
    }

    #[track_caller]
    pub(super) fn recv_impl(&self, src: usize, shape: &Shape, dtype: DType) -> Result<Work> {
        let k = OpKind::Recv;
        self.root_ok(k, src)?;
        let out = uninit(shape, dtype, &self.device)?; // NCCL writes all of it
        let bytes = nbytes(&out);
        Ok(self.launch(
            k,
            bytes,
            0,
            Some(src),
            vec![out.clone()],
            out,
            move |comm, stream, a| {
                // SAFETY: a[0] has room for `bytes` bytes.
                unsafe { recv_bytes(a[0], bytes as usize, src, comm, stream) }
            },
        ))
    }
}

/// At most this many dimensions travel in a scatter's shape header.
pub(super) const MAX_DIMS: usize = 8;

pub(super) fn nbytes(x: &Tensor) -> u64 {
    (x.elem_count() * x.dtype().size_in_bytes()) as u64
}

// The byte-level point-to-point calls the ops above are made of. Every buffer is moved as raw
// bytes (`ncclUint8`): only reductions need NCCL to know the element type.

/// `ncclSend` of `len` bytes at device address `addr` to rank `peer`.
///
/// # Safety
/// `addr` must address at least `len` bytes on this communicator's device, alive until `stream`
/// has run the send.
pub(super) unsafe fn send_bytes(
    addr: u64,
    len: usize,
    peer: usize,
    comm: nccl::ncclComm_t,
    stream: nccl::cudaStream_t,
) -> std::result::Result<(), String> {
    let u8t = nccl::ncclDataType_t::ncclUint8;
    // SAFETY: the caller guarantees the buffer.
    check(unsafe { nccl::ncclSend(addr as _, len, u8t, peer as i32, comm, stream) })
}

/// `ncclRecv` of `len` bytes from rank `peer` into device address `addr`.
///
/// # Safety
/// As [`send_bytes`], with `addr` writable.
pub(super) unsafe fn recv_bytes(
    addr: u64,
    len: usize,
    peer: usize,
    comm: nccl::ncclComm_t,
    stream: nccl::cudaStream_t,
) -> std::result::Result<(), String> {
    let u8t = nccl::ncclDataType_t::ncclUint8;
    // SAFETY: the caller guarantees the buffer.
    check(unsafe { nccl::ncclRecv(addr as _, len, u8t, peer as i32, comm, stream) })
}

/// `ncclBroadcast` of `len` bytes: `root` reads them at `src`, every rank writes them at `dst`.
///
/// # Safety
/// `src` (on the root) and `dst` (on every rank) must address at least `len` bytes on this
/// communicator's device, alive until `stream` has run the broadcast.
pub(super) unsafe fn broadcast_bytes(
    src: u64,
    dst: u64,
    len: usize,
    root: usize,
    comm: nccl::ncclComm_t,
    stream: nccl::cudaStream_t,
) -> std::result::Result<(), String> {
    let u8t = nccl::ncclDataType_t::ncclUint8;
    // SAFETY: the caller guarantees the buffers.
    check(unsafe { nccl::ncclBroadcast(src as _, dst as _, len, u8t, root as i32, comm, stream) })
}

/// Run the NCCL calls `f` makes as one group (ncclGroupStart / ncclGroupEnd), so that the sends
/// and receives of one op progress together instead of deadlocking on each other.
pub(super) fn group(
    f: impl FnOnce() -> std::result::Result<(), String>,
) -> std::result::Result<(), String> {
    // SAFETY: group calls only mark the start and end of a batch on this thread.
    check(unsafe { nccl::ncclGroupStart() })?;
    let r = f();
    // The group is always closed, even after an error, or the thread's NCCL state is left open.
    let end = check(unsafe { nccl::ncclGroupEnd() });
    r.and(end)
}

/// A tensor whose every element the collective writes: allocated without the memset of
/// `Tensor::zeros`, which on a 1 GB all-reduce costs about a tenth of the transfer.
pub(crate) fn uninit(shape: &Shape, dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
    use candle_core::backend::BackendDevice;
    match device {
        Device::Cuda(d) => {
            // SAFETY: the caller hands the tensor to a collective that writes every element
            // before anything reads it (stream order: the compute stream waits on its event).
            let s = unsafe { d.alloc_uninit(shape, dtype)? };
            Ok(Tensor::from_storage(
                Storage::Cuda(s),
                shape.clone(),
                candle_core::op::BackpropOp::none(),
                false,
            ))
        }
        other => Tensor::zeros(shape, dtype, other),
    }
}

/// Zeros of `x`'s dtype, device and row shape, with `rows` rows: `(rows, ...)`.
pub(super) fn zeros_with_rows(x: &Tensor, rows: usize) -> candle_core::Result<Tensor> {
    let mut shape = x.dims().to_vec();
    shape[0] = rows;
    Tensor::zeros(shape, x.dtype(), x.device())
}

/// Rows `chunk_range(D, n, r)` of `x` moved to rows `[r * c, r * c + len)` of a zero tensor of
/// `n * c` rows, `c = ceil(D / n)`: equal chunks for NCCL's reduce-scatter.
pub(super) fn pad_chunks(x: &Tensor, n: usize) -> candle_core::Result<Tensor> {
    let d = x.dim(0)?;
    let c = d.div_ceil(n);
    let mut parts = Vec::with_capacity(2 * n);
    for r in 0..n {
        let range = chunk_range(d, n, r);
        parts.push(x.narrow(0, range.start, range.len())?); // (len_r, ...)
        if range.len() < c {
            parts.push(zeros_with_rows(x, c - range.len())?); // (c - len_r, ...)
        }
    }
    Tensor::cat(&parts, 0) // (n * c, ...)
}
