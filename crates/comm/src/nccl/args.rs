//! Argument checks: the header `check_args` compares across the group before an op, the rows
//! of a dim-0 split, valid roots, and NCCL's codes for element types and reductions.

use candle_core::cuda_backend::cudarc::nccl::sys as nccl;
use candle_core::{DType, Tensor};

use super::group::NcclGroup;
use crate::communicator::{CommError, OpKind, ReduceOp, Result};

impl NcclGroup {
    /// With `check_args`, compare (op, dtype, count, root) across the group.
    #[track_caller]
    pub(super) fn check_header(
        &self,
        op: OpKind,
        dtype: DType,
        count: usize,
        root: Option<usize>,
    ) -> Result<()> {
        if !self.check_args || self.shared.size == 1 {
            return Ok(());
        }
        let mine = [
            op as u64,
            dtype_code(dtype),
            count as u64,
            root.map_or(u64::MAX, |r| r as u64),
        ];
        let all = self.exchange_host(op, &mine)?;
        for (peer, theirs) in all.iter().enumerate() {
            if theirs.as_slice() != mine {
                return Err(CommError::Mismatch {
                    group: self.name().to_string(),
                    rank: self.shared.rank,
                    peer,
                    mine: describe_header(&mine),
                    theirs: describe_header(theirs),
                });
            }
        }
        Ok(())
    }

    /// `(rows, elements per row)` of a tensor split on dim 0.
    pub(super) fn rows(&self, op: OpKind, x: &Tensor) -> Result<(usize, usize)> {
        let dims = x.dims();
        if dims.is_empty() {
            return Err(self.invalid(op, "needs a tensor with at least one dimension".into()));
        }
        let per_row = dims[1..].iter().product::<usize>();
        Ok((dims[0], per_row))
    }

    pub(super) fn reduce_type(&self, op: OpKind, dtype: DType) -> Result<nccl::ncclDataType_t> {
        reduce_type(dtype)
            .ok_or_else(|| self.invalid(op, format!("NCCL cannot reduce {dtype:?} tensors")))
    }

    pub(super) fn root_ok(&self, op: OpKind, root: usize) -> Result<()> {
        if root >= self.shared.size {
            return Err(self.invalid(
                op,
                format!(
                    "root {root} is not a rank of this group of {}",
                    self.shared.size
                ),
            ));
        }
        Ok(())
    }
}

/// NCCL's element type for reductions (data movement ships bytes and accepts every dtype).
pub(super) fn reduce_type(dtype: DType) -> Option<nccl::ncclDataType_t> {
    use nccl::ncclDataType_t as T;
    Some(match dtype {
        DType::U8 => T::ncclUint8,
        DType::U32 => T::ncclUint32,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        DType::BF16 => T::ncclBfloat16,
        DType::F16 => T::ncclFloat16,
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        _ => return None,
    })
}

pub(super) fn reduce_op(op: ReduceOp) -> nccl::ncclRedOp_t {
    match op {
        ReduceOp::Sum => nccl::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => nccl::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => nccl::ncclRedOp_t::ncclMax,
        ReduceOp::Min => nccl::ncclRedOp_t::ncclMin,
    }
}

pub(super) fn dtype_code(d: DType) -> u64 {
    DTYPES
        .iter()
        .position(|&x| x == d)
        .map_or(u64::MAX, |i| i as u64)
}

pub(super) const DTYPES: [DType; 9] = [
    DType::U8,
    DType::U32,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F64,
];

pub(super) const OPS: [OpKind; 11] = OpKind::ALL;

pub(super) fn describe_header(h: &[u64]) -> String {
    let op = OPS
        .get(h[0] as usize)
        .map_or("?".to_string(), |o| o.to_string());
    let dtype = DTYPES
        .get(h[1] as usize)
        .map_or("?".to_string(), |d| format!("{d:?}"));
    let root = if h[3] == u64::MAX {
        String::new()
    } else {
        format!(", root {}", h[3])
    };
    format!("{op}({dtype}, {} elements{root})", h[2])
}
