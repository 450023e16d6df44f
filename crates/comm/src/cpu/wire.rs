//! What travels on the wire: the op header every rank checks, and tensors as little-endian bytes.
//!
//! Every op starts with a [`Header`] sent to each peer the op talks to. Collectives exchange
//! headers with *every* peer of the group, so a rank that called something different is seen by
//! all ranks at once and every rank fails with the same [`CommError::Mismatch`]:
//!
//! ```text
//!   rank 0: all_reduce(sum) f32 [1024] seq 7  --header-->  rank 1 compares: op, dtype, shape, seq...
//!   rank 1: all_gather      f32 [1024] seq 7  --header-->  rank 0 compares: mismatch, both fail
//! ```
//!
//! After the headers, payloads are raw bytes whose lengths both sides already know. Reductions run
//! in an accumulation type ([`AccBuf`]): f32 for f32/bf16/f16 (so half-precision sums are
//! accumulated in f32 and rounded once), and the exact integer type for u8/u32/i64.

use candle_core::{CpuStorage, DType, Device, Storage, Tensor, WithDType};
use half::{bf16, f16};

use crate::algo::AllReduceAlgo;
use crate::communicator::{CommError, OpKind, ReduceOp, Result};

/// Header magic: "MTRH".
const MAGIC: u32 = 0x4D54_5248;

/// Dtypes the CPU backend moves and reduces.
pub(crate) const SUPPORTED: [DType; 7] = [
    DType::F32,
    DType::BF16,
    DType::F16,
    DType::F64,
    DType::U8,
    DType::U32,
    DType::I64,
];

const OPS: [OpKind; 11] = OpKind::ALL;
const REDUCE_OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

/// The description of one op that a rank sends to its peers before any payload.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Header {
    pub op: OpKind,
    pub dtype: DType,
    pub reduce: Option<ReduceOp>,
    /// Number of the op among the group's collectives, or among the sends from one rank to another.
    pub seq: u64,
    /// Hash of the group's identity, so streams of two groups can never be confused.
    pub group: u64,
    pub root: Option<usize>,
    pub shape: Vec<usize>,
    /// all_to_all only: rows this rank sends to the receiver of the header, and rows it expects back.
    pub pair: (u64, u64),
    /// all_reduce only: the algorithm this rank runs (every rank must pick the same).
    pub algo: AllReduceAlgo,
}

impl Header {
    pub fn new(op: OpKind, dtype: DType, seq: u64, group: u64, shape: &[usize]) -> Self {
        Self {
            op,
            dtype,
            reduce: None,
            seq,
            group,
            root: None,
            shape: shape.to_vec(),
            pair: (0, 0),
            algo: AllReduceAlgo::Ring,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + 8 * self.shape.len());
        b.extend_from_slice(&MAGIC.to_le_bytes());
        b.push(OPS.iter().position(|o| *o == self.op).unwrap_or(255) as u8);
        b.push(
            SUPPORTED
                .iter()
                .position(|d| *d == self.dtype)
                .unwrap_or(255) as u8,
        );
        b.push(
            self.reduce
                .and_then(|r| REDUCE_OPS.iter().position(|o| *o == r))
                .unwrap_or(255) as u8,
        );
        b.extend_from_slice(&self.seq.to_le_bytes());
        b.extend_from_slice(&self.group.to_le_bytes());
        b.extend_from_slice(
            &self
                .root
                .map(|r| r as u64)
                .unwrap_or(u64::MAX)
                .to_le_bytes(),
        );
        b.extend_from_slice(&self.pair.0.to_le_bytes());
        b.extend_from_slice(&self.pair.1.to_le_bytes());
        b.push(AllReduceAlgo::ALL.iter().position(|a| *a == self.algo).unwrap_or(255) as u8);
        b.extend_from_slice(&(self.shape.len() as u32).to_le_bytes());
        for d in &self.shape {
            b.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        b
    }

    /// Decode a header; `None` when the bytes are not a header (the streams are out of step).
    pub fn decode(b: &[u8]) -> Option<Self> {
        let mut r = Reader { b, at: 0 };
        if r.u32()? != MAGIC {
            return None;
        }
        let op = *OPS.get(r.u8()? as usize)?;
        let dtype = *SUPPORTED.get(r.u8()? as usize)?;
        let reduce = REDUCE_OPS.get(r.u8()? as usize).copied();
        let seq = r.u64()?;
        let group = r.u64()?;
        let root = match r.u64()? {
            u64::MAX => None,
            x => Some(x as usize),
        };
        let pair = (r.u64()?, r.u64()?);
        let algo = *AllReduceAlgo::ALL.get(r.u8()? as usize)?;
        let ndims = r.u32()? as usize;
        if ndims > 64 {
            return None;
        }
        let shape = (0..ndims)
            .map(|_| r.u64().map(|d| d as usize))
            .collect::<Option<Vec<_>>>()?;
        Some(Self {
            op,
            dtype,
            reduce,
            seq,
            group,
            root,
            shape,
            pair,
            algo,
        })
    }

    /// A one-line description used in mismatch errors, e.g. `all_reduce(Sum) f32 [4, 3] (seq 2)`.
    pub fn describe(&self) -> String {
        let mut s = self.op.to_string();
        if let Some(r) = self.reduce {
            s.push_str(&format!("({r:?})"));
        }
        s.push_str(&format!(" {:?} {:?}", self.dtype, self.shape).to_lowercase());
        if self.algo != AllReduceAlgo::Ring {
            s.push_str(&format!(" by {}", self.algo));
        }
        if let Some(root) = self.root {
            s.push_str(&format!(" root {root}"));
        }
        if self.op == OpKind::AllToAll {
            s.push_str(&format!(
                " sending {} rows, expecting {} rows",
                self.pair.0, self.pair.1
            ));
        }
        s.push_str(&format!(" (seq {})", self.seq));
        s
    }

    /// Whether a peer's header describes the same collective as ours.
    pub fn matches(&self, theirs: &Header) -> bool {
        let same = self.op == theirs.op
            && self.dtype == theirs.dtype
            && self.reduce == theirs.reduce
            && self.seq == theirs.seq
            && self.group == theirs.group
            && self.root == theirs.root
            && self.algo == theirs.algo;
        same && match self.op {
            OpKind::AllReduce | OpKind::Reduce | OpKind::Broadcast | OpKind::ReduceScatter => {
                self.shape == theirs.shape
            }
            // Row counts may differ between ranks; the shape of a row may not.
            OpKind::AllGather | OpKind::Gather => self.shape.get(1..) == theirs.shape.get(1..),
            OpKind::AllToAll => {
                self.shape.get(1..) == theirs.shape.get(1..)
                    && self.pair.0 == theirs.pair.1
                    && self.pair.1 == theirs.pair.0
            }
            // Only the root's shape matters; point-to-point is checked by the receiver.
            OpKind::Scatter | OpKind::Barrier | OpKind::Send | OpKind::Recv => true,
        }
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let s = self.b.get(self.at..self.at + N)?;
        self.at += N;
        s.try_into().ok()
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take::<1>()?[0])
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take()?))
    }
}

/// Reject dtypes the backend does not carry.
pub(crate) fn check_dtype(op: OpKind, group: &str, dtype: DType) -> Result<()> {
    if SUPPORTED.contains(&dtype) {
        Ok(())
    } else {
        Err(CommError::InvalidArgument {
            op,
            group: group.to_string(),
            msg: format!(
                "dtype {dtype:?} is not supported by the CPU backend (supported: {SUPPORTED:?})"
            ),
        })
    }
}

// Payloads are the host's in-memory representation, cast to bytes; mtrain's wire format is
// little-endian, so big-endian hosts are not supported.
#[cfg(target_endian = "big")]
compile_error!("the CPU backend's wire format is little-endian");

/// A tensor's elements in host memory: typed, so it becomes a tensor again without a copy
/// ([`HostBuf::into_tensor`]), and viewable as wire bytes in place.
pub(crate) enum HostBuf {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    F64(Vec<f64>),
    U8(Vec<u8>),
    U32(Vec<u32>),
    I64(Vec<i64>),
}

macro_rules! each_host {
    ($self:expr, $v:ident => $body:expr) => {
        match $self {
            HostBuf::F32($v) => $body,
            HostBuf::BF16($v) => $body,
            HostBuf::F16($v) => $body,
            HostBuf::F64($v) => $body,
            HostBuf::U8($v) => $body,
            HostBuf::U32($v) => $body,
            HostBuf::I64($v) => $body,
        }
    };
}

impl HostBuf {
    /// Copy a tensor's elements out in row-major order (non-contiguous inputs are read through
    /// their strides).
    pub fn from_tensor(x: &Tensor) -> Result<Self> {
        let flat = x.flatten_all()?;
        Ok(match x.dtype() {
            DType::F32 => HostBuf::F32(flat.to_vec1()?),
            DType::BF16 => HostBuf::BF16(flat.to_vec1()?),
            DType::F16 => HostBuf::F16(flat.to_vec1()?),
            DType::F64 => HostBuf::F64(flat.to_vec1()?),
            DType::U8 => HostBuf::U8(flat.to_vec1()?),
            DType::U32 => HostBuf::U32(flat.to_vec1()?),
            DType::I64 => HostBuf::I64(flat.to_vec1()?),
            other => return Err(unsupported(other)),
        })
    }

    /// `len` zero elements of `dtype`, to receive into.
    pub fn zeros(dtype: DType, len: usize) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => HostBuf::F32(vec![0.0; len]),
            DType::BF16 => HostBuf::BF16(vec![bf16::ZERO; len]),
            DType::F16 => HostBuf::F16(vec![f16::ZERO; len]),
            DType::F64 => HostBuf::F64(vec![0.0; len]),
            DType::U8 => HostBuf::U8(vec![0; len]),
            DType::U32 => HostBuf::U32(vec![0; len]),
            DType::I64 => HostBuf::I64(vec![0; len]),
            other => return Err(unsupported(other)),
        })
    }

    pub fn as_bytes(&self) -> &[u8] {
        each_host!(self, v => bytemuck::cast_slice(v))
    }

    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        each_host!(self, v => bytemuck::cast_slice_mut(v))
    }

    /// The elements as a CPU tensor of `shape` (the buffer is moved, not copied).
    pub fn into_tensor(self, shape: &[usize]) -> Result<Tensor> {
        Ok(each_host!(self, v => Tensor::from_vec(v, shape, &Device::Cpu)?))
    }
}

fn unsupported(dtype: DType) -> CommError {
    candle_core::Error::Msg(format!("dtype {dtype:?} is not carried by the CPU backend")).into()
}

/// Build a CPU tensor from little-endian bytes.
pub(crate) fn bytes_to_tensor(bytes: &[u8], dtype: DType, shape: &[usize]) -> Result<Tensor> {
    Ok(Tensor::from_raw_buffer(bytes, dtype, shape, &Device::Cpu)?)
}

/// Buffers from this size on are asked to be backed by 2 MiB pages.
const HUGE_PAGE_FROM: usize = 8 << 20;

/// A tensor's elements in row-major order, in a fresh buffer of its own dtype.
///
/// The buffer becomes the op's result, so it is new memory every call. A large one is above
/// glibc's largest mmap threshold (32 MiB), so each call maps it anew and takes a page fault per
/// 4 KiB page on the first write (16,384 faults for 64 MiB), and the freed result is unmapped
/// again: on loopback these faults cost more than the reduction. Linux's transparent huge pages
/// (`MADV_HUGEPAGE`, a request the kernel may decline) cut them 512-fold, so a large buffer asks
/// for them before it is first written. Non-contiguous inputs are read through their strides.
fn host_copy<T: WithDType + bytemuck::Pod>(x: &Tensor) -> Result<Vec<T>> {
    let (storage, layout) = x.storage_and_layout();
    if let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
        let src = &T::cpu_storage_as_slice(cpu)?[start..end];
        let mut v = Vec::with_capacity(src.len());
        advise_huge_pages(v.as_ptr() as usize, std::mem::size_of_val(src));
        v.extend_from_slice(src);
        return Ok(v);
    }
    drop(storage);
    Ok(x.flatten_all()?.to_vec1()?)
}

/// Runs `f` on `x`'s elements as wire bytes: its own storage where it is a contiguous CPU
/// tensor (no copy), a host copy otherwise.
pub(crate) fn with_wire_bytes<R>(x: &Tensor, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
    let (storage, layout) = x.storage_and_layout();
    if let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
        let size = x.dtype().size_in_bytes();
        let bytes: Option<&[u8]> = match cpu {
            CpuStorage::F32(v) => Some(bytemuck::cast_slice(v)),
            CpuStorage::BF16(v) => Some(bytemuck::cast_slice(v)),
            CpuStorage::F16(v) => Some(bytemuck::cast_slice(v)),
            CpuStorage::F64(v) => Some(bytemuck::cast_slice(v)),
            CpuStorage::U8(v) => Some(v),
            CpuStorage::U32(v) => Some(bytemuck::cast_slice(v)),
            CpuStorage::I64(v) => Some(bytemuck::cast_slice(v)),
            _ => None,
        };
        if let Some(bytes) = bytes {
            return Ok(f(&bytes[start * size..end * size]));
        }
    }
    drop(storage);
    Ok(f(HostBuf::from_tensor(x)?.as_bytes()))
}

/// Ask for huge pages under the whole 2 MiB pages of `[addr, addr + bytes)` (not yet written).
fn advise_huge_pages(addr: usize, bytes: usize) {
    #[cfg(target_os = "linux")]
    if bytes >= HUGE_PAGE_FROM {
        const HUGE: usize = 2 << 20;
        let (start, end) = (
            (addr + HUGE - 1) & !(HUGE - 1),
            (addr + bytes) & !(HUGE - 1),
        );
        if end > start {
            // SAFETY: advice over memory this process owns; it changes no contents and
            // failure (e.g. huge pages turned off) only leaves the default pages.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (addr, bytes, HUGE_PAGE_FROM);
}

/// One element type in which reductions are carried out.
pub(crate) trait AccElem: bytemuck::Pod + PartialOrd + Send + 'static {
    fn add(self, other: Self) -> Self;
    fn div_n(self, n: usize) -> Self;
}

macro_rules! acc_elem {
    ($t:ty, $add:expr, $div:expr) => {
        impl AccElem for $t {
            fn add(self, o: Self) -> Self {
                $add(self, o)
            }
            fn div_n(self, n: usize) -> Self {
                $div(self, n)
            }
        }
    };
}
acc_elem!(f32, |a: f32, b: f32| a + b, |a: f32, n: usize| a / n as f32);
acc_elem!(f64, |a: f64, b: f64| a + b, |a: f64, n: usize| a / n as f64);
acc_elem!(u8, u8::wrapping_add, |a: u8, n: usize| a / n as u8);
acc_elem!(u32, u32::wrapping_add, |a: u32, n: usize| a / n as u32);
acc_elem!(i64, i64::wrapping_add, |a: i64, n: usize| a / n as i64);

/// `dst[i] = op(dst[i], src[i])`; the op is chosen once, outside the loop, so the loop vectorizes.
/// The in-place ring combines with it: our values in `dst`, the received ones in `src`, the
/// operands in [`combine_into`]'s order.
pub(crate) fn combine_slice<T: AccElem>(dst: &mut [T], src: &[T], op: ReduceOp) {
    fn each<T: AccElem>(dst: &mut [T], src: &[T], f: impl Fn(T, T) -> T) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f(*d, *s);
        }
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => each(dst, src, T::add),
        ReduceOp::Max => each(dst, src, |a, b| if b > a { b } else { a }),
        ReduceOp::Min => each(dst, src, |a, b| if b < a { b } else { a }),
    }
}

/// `recv[i] = op(mine[i], recv[i])`: [`combine_slice`] for a peer's partial result that was
/// received straight into the result buffer; the operands keep the same order (ours first).
pub(crate) fn combine_into<T: AccElem>(recv: &mut [T], mine: &[T], op: ReduceOp) {
    fn each<T: AccElem>(recv: &mut [T], mine: &[T], f: impl Fn(T, T) -> T) {
        for (r, m) in recv.iter_mut().zip(mine) {
            *r = f(*m, *r);
        }
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => each(recv, mine, T::add),
        ReduceOp::Max => each(recv, mine, |a, b| if b > a { b } else { a }),
        ReduceOp::Min => each(recv, mine, |a, b| if b < a { b } else { a }),
    }
}

/// Run `f` on a tensor's elements in row-major order as `T`: the tensor's own storage when it
/// is a contiguous CPU tensor of that dtype (no copy), else a converted copy.
pub(crate) fn with_elems<T: WithDType, R>(x: &Tensor, f: impl FnOnce(&[T]) -> R) -> Result<R> {
    {
        let (storage, layout) = x.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((start, end)), true) = (
            &*storage,
            layout.contiguous_offsets(),
            x.dtype() == T::DTYPE,
        ) {
            return Ok(f(&T::cpu_storage_as_slice(cpu)?[start..end]));
        }
    }
    let copy: Vec<T> = x.flatten_all()?.to_dtype(T::DTYPE)?.to_vec1()?;
    Ok(f(&copy))
}

/// `len` zeroed elements in new memory, asked to be backed by huge pages when large (see
/// [`host_copy`]): a fresh allocation this size comes zeroed from the kernel, untouched.
pub(crate) fn fresh_zeroed<T: bytemuck::Pod>(len: usize) -> Vec<T> {
    let v = vec![T::zeroed(); len];
    advise_huge_pages(v.as_ptr() as usize, std::mem::size_of_val(v.as_slice()));
    v
}

/// Receive a peer's partial result for `dst` through `fill` (into `scratch`, kept by the caller
/// from one segment of an op to the next so it is allocated and faulted in once per op) and
/// combine it into `dst`.
fn recv_combine<T: AccElem>(
    dst: &mut [T],
    op: ReduceOp,
    scratch: &mut Scratch,
    fill: impl FnOnce(&mut [u8]) -> Result<()>,
) -> Result<()> {
    let bytes = scratch.bytes(std::mem::size_of_val(dst));
    fill(bytes)?;
    combine_slice(dst, bytemuck::cast_slice(bytes), op);
    Ok(())
}

/// A receive buffer reused across the segments of an op, aligned for every accumulation type.
#[derive(Default)]
pub(crate) struct Scratch(Vec<u64>);

impl Scratch {
    /// `len` bytes that start half a page past a page boundary (grown, zeroed once, when asked
    /// for more than it has; the same bytes for the same `len` until then).
    ///
    /// The in-place ring receives into these. The kernel's socket buffers start at page
    /// boundaries, and a receive whose destination lies at nearly the same offset in its page
    /// as its source (a malloc'd buffer starts 16 bytes past one) copied at well under half
    /// speed on the AMD EPYC development machine (4K aliasing between the copy's loads and
    /// stores; `docs/journal.md`, the ring in place); half a page off, it does not.
    pub(crate) fn off_page(&mut self, len: usize) -> &mut [u8] {
        const PAGE: usize = 4096;
        let bytes = self.bytes(len + PAGE);
        // base + at ≡ PAGE / 2 (mod PAGE); a multiple of 8, as the base is.
        let at = (PAGE + PAGE / 2 - bytes.as_ptr() as usize % PAGE) % PAGE;
        &mut bytes[at..at + len]
    }

    /// The first `len` bytes (grown, zeroed once, when asked for more than it has).
    pub(crate) fn bytes(&mut self, len: usize) -> &mut [u8] {
        let words = len.div_ceil(8);
        if self.0.len() < words {
            self.0.resize(words, 0);
        }
        &mut bytemuck::cast_slice_mut(&mut self.0[..words])[..len]
    }
}

/// A tensor's elements in their accumulation type.
pub(crate) enum AccBuf {
    F32(Vec<f32>),
    F64(Vec<f64>),
    U8(Vec<u8>),
    U32(Vec<u32>),
    I64(Vec<i64>),
}

macro_rules! each_acc {
    ($self:expr, $v:ident => $body:expr) => {
        match $self {
            AccBuf::F32($v) => $body,
            AccBuf::F64($v) => $body,
            AccBuf::U8($v) => $body,
            AccBuf::U32($v) => $body,
            AccBuf::I64($v) => $body,
        }
    };
}

impl AccBuf {
    pub fn from_tensor(x: &Tensor) -> Result<Self> {
        Ok(match x.dtype() {
            DType::F32 => AccBuf::F32(host_copy(x)?),
            DType::BF16 | DType::F16 => AccBuf::F32(x.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?),
            DType::F64 => AccBuf::F64(host_copy(x)?),
            DType::U8 => AccBuf::U8(host_copy(x)?),
            DType::U32 => AccBuf::U32(host_copy(x)?),
            DType::I64 => AccBuf::I64(host_copy(x)?),
            other => {
                return Err(candle_core::Error::Msg(format!(
                    "dtype {other:?} cannot be reduced by the CPU backend"
                ))
                .into())
            }
        })
    }

    /// Elements `range` as wire bytes.
    pub fn encode(&self, range: std::ops::Range<usize>) -> Vec<u8> {
        each_acc!(self, v => bytemuck::cast_slice(&v[range]).to_vec())
    }

    /// `self[range] = op(self[range], peer's part)`, where `fill` writes the peer's partial
    /// result (wire bytes) into the buffer it is given.
    pub fn recv_combine(
        &mut self,
        range: std::ops::Range<usize>,
        op: ReduceOp,
        scratch: &mut Scratch,
        fill: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        each_acc!(self, v => recv_combine(&mut v[range], op, scratch, fill))
    }

    /// Turn the sum over `n` ranks into the average (for `ReduceOp::Avg`).
    pub fn finish(&mut self, range: std::ops::Range<usize>, op: ReduceOp, n: usize) {
        if op == ReduceOp::Avg {
            each_acc!(self, v => for e in &mut v[range] { *e = e.div_n(n) })
        }
    }

    /// The accumulator itself as the result buffer, when the tensor's dtype is the accumulation
    /// type (f32, f64, integers): the all-gather then fills it in place, with no extra copy.
    pub fn into_native(self, dtype: DType) -> std::result::Result<HostBuf, AccBuf> {
        match (self, dtype) {
            (AccBuf::F32(v), DType::F32) => Ok(HostBuf::F32(v)),
            (AccBuf::F64(v), DType::F64) => Ok(HostBuf::F64(v)),
            (AccBuf::U8(v), DType::U8) => Ok(HostBuf::U8(v)),
            (AccBuf::U32(v), DType::U32) => Ok(HostBuf::U32(v)),
            (AccBuf::I64(v), DType::I64) => Ok(HostBuf::I64(v)),
            (acc, _) => Err(acc),
        }
    }

    /// Elements `range` converted to `dtype` (the tensor's own type) as little-endian bytes.
    pub fn to_native_bytes(&self, range: std::ops::Range<usize>, dtype: DType) -> Vec<u8> {
        match (self, dtype) {
            (AccBuf::F32(v), DType::BF16) => bytemuck::cast_slice(
                &v[range]
                    .iter()
                    .map(|e| bf16::from_f32(*e).to_bits())
                    .collect::<Vec<u16>>(),
            )
            .to_vec(),
            (AccBuf::F32(v), DType::F16) => bytemuck::cast_slice(
                &v[range]
                    .iter()
                    .map(|e| f16::from_f32(*e).to_bits())
                    .collect::<Vec<u16>>(),
            )
            .to_vec(),
            _ => self.encode(range),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_describes_itself() {
        let mut h = Header::new(OpKind::AllToAll, DType::BF16, 7, 42, &[5, 3]);
        h.pair = (2, 3);
        assert_eq!(Header::decode(&h.encode()), Some(h.clone()));
        assert_eq!(
            h.describe(),
            "all_to_all bf16 [5, 3] sending 2 rows, expecting 3 rows (seq 7)"
        );
        let mut peer = h.clone();
        peer.pair = (3, 2);
        assert!(h.matches(&peer));
        peer.pair = (2, 3);
        assert!(!h.matches(&peer));
    }

    #[test]
    fn half_precision_accumulates_in_f32() -> Result<()> {
        // 256 + 1 is not representable in bf16, but (256 + 1) + 1 = 258 is: f32 accumulation gets it.
        let x = Tensor::new(&[256f32], &Device::Cpu)?.to_dtype(DType::BF16)?;
        let mut acc = AccBuf::from_tensor(&x)?;
        let one = 1f32.to_le_bytes();
        let mut scratch = Scratch::default();
        for _ in 0..2 {
            acc.recv_combine(0..1, ReduceOp::Sum, &mut scratch, |buf| {
                buf.copy_from_slice(&one);
                Ok(())
            })?;
        }
        let out = bytes_to_tensor(&acc.to_native_bytes(0..1, DType::BF16), DType::BF16, &[1])?;
        assert_eq!(out.to_dtype(DType::F32)?.to_vec1::<f32>()?, vec![258.0]);
        Ok(())
    }
}
