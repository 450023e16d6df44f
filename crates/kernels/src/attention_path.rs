//! Which flash-attention kernels one call runs ([`path`]): the wide tensor-core kernels of
//! `flash_wide.cu`, the 16-row tensor-core kernels of `kernels.cu`, or the CUDA-core ones, from
//! the dtype, the head size, the operands' offsets, the device and the [`TcKernels`] choice.
//! The launches are in `attention.rs`; this is the rule alone, so it is tested without a GPU.

use candle_core::DType;

/// Head sizes (bf16 only) the wide tensor-core kernels take.
pub const WIDE_HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

/// Which tensor-core kernels a bf16 call may run: the wide ones where they apply, or only the
/// 16-row ones of `kernels.cu`. The default is [`TcKernels::from_env`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcKernels {
    Wide,
    Narrow,
}

impl TcKernels {
    /// `Wide`, or `Narrow` when the environment sets `MTRAIN_FLASH_KERNELS=narrow` (to time the
    /// two against each other in one process tree); read once.
    pub fn from_env() -> Self {
        static CHOICE: std::sync::OnceLock<TcKernels> = std::sync::OnceLock::new();
        *CHOICE.get_or_init(|| match std::env::var("MTRAIN_FLASH_KERNELS").as_deref() {
            Ok("narrow") => TcKernels::Narrow,
            _ => TcKernels::Wide,
        })
    }

    /// The choice for a call with (`masked`) or without a dropout mask on the probabilities:
    /// the wide kernels draw no mask, so a masked call takes the 16-row ones, which do.
    pub fn for_mask(self, masked: bool) -> Self {
        if masked {
            TcKernels::Narrow
        } else {
            self
        }
    }
}

/// The kernels one fused call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// `flash_wide_*` (flash_wide.cu).
    Wide,
    /// `flash_tc_*` (kernels.cu).
    Tc,
    /// `flash_*` on CUDA cores (kernels.cu).
    Cuda,
}

/// The kernels for a call of `dtype`, head size `d`, operands at element `offsets`, on a device
/// of compute capability `cc` (10·major + minor): mma.sync needs 8.0, 16-byte rows need
/// offsets that are multiples of 8.
pub fn path(dtype: DType, d: usize, offsets: &[usize], cc: u32, kernels: TcKernels) -> Path {
    let tc_ok = dtype == DType::BF16 && offsets.iter().all(|o| o % 8 == 0) && cc >= 80;
    if tc_ok && kernels == TcKernels::Wide && WIDE_HEAD_DIMS.contains(&d) {
        Path::Wide
    } else if tc_ok && crate::attention::uses_tensor_cores(dtype, d, offsets) {
        Path::Tc
    } else {
        Path::Cuda
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType::{BF16, F32};
    use TcKernels::{Narrow, Wide};

    #[test]
    fn wide_kernels_take_bf16_multiples_of_16_up_to_128_on_sm80() {
        assert_eq!(path(BF16, 64, &[0, 8], 90, Wide), Path::Wide);
        assert_eq!(path(BF16, 64, &[0, 8], 90, Wide.for_mask(true)), Path::Tc);
        assert_eq!(Wide.for_mask(false), Wide);
        assert_eq!(path(BF16, 128, &[0, 8], 80, Wide), Path::Wide);
        assert_eq!(path(BF16, 64, &[0, 8], 90, Narrow), Path::Tc);
        assert_eq!(path(BF16, 128, &[0, 8], 90, Narrow), Path::Cuda);
        assert_eq!(path(BF16, 64, &[0, 4], 90, Wide), Path::Cuda);
        assert_eq!(path(BF16, 64, &[0, 0], 75, Wide), Path::Cuda);
        assert_eq!(path(BF16, 8, &[0, 0], 90, Wide), Path::Cuda);
        assert_eq!(path(F32, 64, &[0, 0], 90, Wide), Path::Cuda);
    }
}
