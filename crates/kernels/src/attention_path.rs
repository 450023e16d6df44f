//! Which flash-attention kernels one call runs ([`path`]): the warpgroup (wgmma) kernels of
//! `flash_hopper.cu` on Hopper, the wide tensor-core kernels of `flash_wide.cu`, the 16-row
//! tensor-core kernels of `kernels.cu`, or the CUDA-core ones, from the dtype, the head size,
//! the operands' offsets, the device and the [`TcKernels`] choice; whether a Hopper backward
//! runs in one pass or two ([`TcKernels::one_pass`]); and the shapes the Hopper kernels are
//! compiled for ([`hopper_options`]). The launches are in `attention/imp.rs`; this
//! is the rule alone, so it is tested without a GPU.

use candle_core::DType;

/// Head sizes (bf16 only) the wide tensor-core kernels take.
pub const WIDE_HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

/// Head sizes (bf16 only) the tensor-core kernels take; other cases use the CUDA-core kernels.
pub const TC_HEAD_DIMS: [usize; 3] = [16, 32, 64];

/// Whether a bf16 attention of head size `d` whose q, k, v start at these element offsets runs
/// on the tensor-core kernels (they read rows in 16-byte pieces, so offsets are multiples of 8).
pub fn uses_tensor_cores(dtype: DType, d: usize, offsets: &[usize]) -> bool {
    dtype == DType::BF16 && TC_HEAD_DIMS.contains(&d) && offsets.iter().all(|o| o % 8 == 0)
}

/// Head sizes (bf16 only, compute capability 9.0) the Hopper kernels take.
pub const HOPPER_HEAD_DIMS: [usize; 2] = [64, 128];

/// How one Hopper kernel is laid out: warpgroups per block (each owns 64 rows, so a block
/// owns `64 · warpgroups`), and the blocks per SM its registers are fitted to.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HopperShape {
    pub warpgroups: usize,
    pub blocks_per_sm: usize,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl HopperShape {
    /// Rows (queries, or keys for dkdv) one block owns.
    pub fn rows(self) -> usize {
        64 * self.warpgroups
    }
    /// Threads per block.
    pub fn threads(self) -> usize {
        128 * self.warpgroups
    }
}

/// The shapes of the four Hopper kernels at one head size: `flash_hopper_fwd` (and the keys
/// of its staged tiles), `flash_hopper_dq`, `flash_hopper_dkdv` and `flash_hopper_bwd` (the
/// backward in one pass).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HopperShapes {
    pub fwd: HopperShape,
    pub fwd_keys: usize,
    pub dq: HopperShape,
    pub dkdv: HopperShape,
    pub bwd: HopperShape,
}

const fn shape(warpgroups: usize, blocks_per_sm: usize) -> HopperShape {
    HopperShape {
        warpgroups,
        blocks_per_sm,
    }
}

/// D = 64, from timing the kernels on an H200 at 4 × 12 × 4096 (docs/journal.md,
/// 2026-12-03): two blocks of two warpgroups per SM for the forward and dq (128 registers a
/// thread), and for dkdv (its four accumulators need 168 registers) three blocks of one
/// warpgroup, which run unsynchronised where one block of three waits at every tile for its
/// slowest warpgroup. The one-pass backward: three warpgroups of 64 keys in a block (the
/// largest that fits its shared memory), so that dq is added to memory once per 192 keys and
/// not once per 64. The forward stages key tiles of 128.
pub const HOPPER_D64: HopperShapes = HopperShapes {
    fwd: shape(2, 2),
    fwd_keys: 128,
    dq: shape(2, 2),
    dkdv: shape(1, 3),
    bwd: shape(3, 1),
};

/// D = 128, where a warpgroup's 64 x 128 accumulator is 64 registers a thread, from timing the
/// kernels on an H100 at 48 × 4096 and 48 × 1024 (docs/BENCHMARKS.md, 2026-12-07): the forward
/// as at D = 64 but with key tiles of 64 (S and P of 128 keys would not fit 128 registers
/// beside O; 0.46 ms where one block of two or three warpgroups with tiles of 128 took 0.55);
/// dq in one block of two warpgroups (168 registers; two blocks spill); dkdv, whose two
/// accumulators alone are 128 registers, in two blocks of one warpgroup (0.81 ms, 0.85 for one
/// block of two). The one-pass backward fits one warpgroup's tiles (128 KiB) in a block; it
/// takes 2.4 ms where the two passes take 1.5, so it stays the choice of
/// `MTRAIN_FLASH_KERNELS=hopper-one-pass` alone.
pub const HOPPER_D128: HopperShapes = HopperShapes {
    fwd: shape(2, 2),
    fwd_keys: 64,
    dq: shape(2, 1),
    dkdv: shape(1, 2),
    bwd: shape(1, 1),
};

/// The shapes of the Hopper kernels at head size `d`, None where they do not take it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn hopper_shapes(d: usize) -> Option<HopperShapes> {
    match d {
        64 => Some(HOPPER_D64),
        128 => Some(HOPPER_D128),
        _ => None,
    }
}

/// The shapes at head size `d` as NVRTC options (`-DHP_FWD_WGS=2 …`), the only way the
/// kernels learn them; none where the Hopper kernels do not take `d`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn hopper_options(d: usize) -> Vec<String> {
    let Some(s) = hopper_shapes(d) else {
        return Vec::new();
    };
    let mut options: Vec<String> = [("FWD", s.fwd), ("DQ", s.dq), ("DKDV", s.dkdv), ("BWD", s.bwd)]
        .iter()
        .flat_map(|(n, s)| {
            [
                format!("-DHP_{n}_WGS={}", s.warpgroups),
                format!("-DHP_{n}_BLOCKS={}", s.blocks_per_sm),
            ]
        })
        .collect();
    options.push(format!("-DHP_FWD_N={}", s.fwd_keys));
    options
}

/// Which tensor-core kernels a bf16 call may run: the Hopper ones where they apply (else the
/// wide ones), the wide ones where they apply, or only the 16-row ones of `kernels.cu`. The
/// default is [`TcKernels::from_env`].
/// `Hopper` and `HopperTwoPass` run the two-pass backward, `HopperOnePass` the one-pass one
/// ([`TcKernels::one_pass`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcKernels {
    Hopper,
    HopperOnePass,
    HopperTwoPass,
    Wide,
    Narrow,
}

impl TcKernels {
    /// `Hopper`, or another when the environment sets `MTRAIN_FLASH_KERNELS=wide`, `=narrow`,
    /// `=hopper-one-pass` or `=hopper-two-pass` (to time them against each other in one
    /// process tree); read once.
    pub fn from_env() -> Self {
        static CHOICE: std::sync::OnceLock<TcKernels> = std::sync::OnceLock::new();
        *CHOICE.get_or_init(|| match std::env::var("MTRAIN_FLASH_KERNELS").as_deref() {
            Ok("narrow") => TcKernels::Narrow,
            Ok("wide") => TcKernels::Wide,
            Ok("hopper-one-pass") => TcKernels::HopperOnePass,
            Ok("hopper-two-pass") => TcKernels::HopperTwoPass,
            _ => TcKernels::Hopper,
        })
    }

    /// Whether the Hopper kernels are chosen (where they apply).
    pub fn hopper(self) -> bool {
        matches!(
            self,
            TcKernels::Hopper | TcKernels::HopperOnePass | TcKernels::HopperTwoPass
        )
    }

    /// Whether a Hopper backward runs in one pass (`flash_hopper_bwd`: five products, dq added
    /// into f32 atomically, so its last bits differ from run to run) rather than two
    /// (`flash_hopper_dq` then `flash_hopper_dkdv`: seven products, no atomics, the same bits
    /// every run): only when chosen (`MTRAIN_FLASH_KERNELS=hopper-one-pass`). With the kernels
    /// of 2026-12-06 on an H100 at D = 64, GPT-2 124M trains 2.5%, 2.1% and 2.0% faster with two
    /// passes at T = 2048, 4096 and 8192 (docs/journal.md); one pass was the faster one from
    /// T = 2048 on before those kernels, on an H200.
    pub fn one_pass(self) -> bool {
        self == TcKernels::HopperOnePass
    }

    /// The choice for a call with (`masked`) or without a dropout mask on the probabilities:
    /// the wide and Hopper kernels draw no mask, so a masked call takes the 16-row ones, which
    /// do.
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
    /// `flash_hopper_*` (flash_hopper.cu).
    Hopper,
    /// `flash_wide_*` (flash_wide.cu).
    Wide,
    /// `flash_tc_*` (kernels.cu).
    Tc,
    /// `flash_*` on CUDA cores (kernels.cu).
    Cuda,
}

impl Path {
    /// Whether the path's kernels take a dropout mask (the last argument of their launch).
    pub fn draws_mask(self) -> bool {
        matches!(self, Path::Tc | Path::Cuda)
    }
}

/// The kernels for a call of `dtype`, head size `d`, operands at element `offsets`, on a device
/// of compute capability `cc` (10·major + minor): mma.sync needs 8.0, wgmma exactly 9.0
/// (NVRTC's `compute_90a`, see [`hopper_arch`]), 16-byte rows need offsets that are multiples
/// of 8.
pub fn path(dtype: DType, d: usize, offsets: &[usize], cc: u32, kernels: TcKernels) -> Path {
    let tc_ok = dtype == DType::BF16 && offsets.iter().all(|o| o % 8 == 0) && cc >= 80;
    if tc_ok && kernels.hopper() && hopper_arch(cc) && HOPPER_HEAD_DIMS.contains(&d) {
        Path::Hopper
    } else if tc_ok && kernels != TcKernels::Narrow && WIDE_HEAD_DIMS.contains(&d) {
        Path::Wide
    } else if tc_ok && uses_tensor_cores(dtype, d, offsets) {
        Path::Tc
    } else {
        Path::Cuda
    }
}

/// Whether a device of compute capability `cc` runs the Hopper kernels: wgmma is an sm_90a
/// feature (compiled for `compute_90a`, which runs on 9.0 only, not on later architectures).
pub fn hopper_arch(cc: u32) -> bool {
    cc == 90
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType::{BF16, F32};
    use TcKernels::{Hopper, HopperOnePass, HopperTwoPass, Narrow, Wide};

    #[test]
    fn hopper_kernels_take_bf16_d64_and_d128_on_sm90_only() {
        assert_eq!(path(BF16, 64, &[0, 8], 90, Hopper), Path::Hopper);
        assert_eq!(path(BF16, 64, &[0, 8], 90, Hopper.for_mask(true)), Path::Tc);
        assert_eq!(path(BF16, 64, &[0, 8], 80, Hopper), Path::Wide);
        assert_eq!(path(BF16, 64, &[0, 8], 100, Hopper), Path::Wide);
        assert_eq!(path(BF16, 128, &[0, 8], 90, Hopper), Path::Hopper);
        assert_eq!(path(BF16, 128, &[0, 8], 90, Hopper.for_mask(true)), Path::Cuda);
        assert_eq!(path(BF16, 128, &[0, 8], 80, Hopper), Path::Wide);
        assert_eq!(path(BF16, 96, &[0, 8], 90, Hopper), Path::Cuda);
        assert_eq!(path(BF16, 32, &[0, 8], 90, Hopper), Path::Wide);
        assert_eq!(path(BF16, 64, &[0, 4], 90, Hopper), Path::Cuda);
        assert_eq!(path(F32, 64, &[0, 0], 90, Hopper), Path::Cuda);
        assert_eq!(path(BF16, 64, &[0, 8], 90, Wide), Path::Wide);
        assert_eq!(path(BF16, 64, &[0, 8], 90, HopperOnePass), Path::Hopper);
        assert_eq!(path(BF16, 64, &[0, 8], 90, HopperTwoPass), Path::Hopper);
        assert_eq!((HOPPER_D64.dkdv.rows(), HOPPER_D64.fwd.threads()), (64, 256));
        assert!(hopper_options(64).contains(&"-DHP_DKDV_BLOCKS=3".to_string()));
        assert!(hopper_options(64).contains(&"-DHP_BWD_WGS=3".to_string()));
        assert_eq!(hopper_options(64).len(), 9);
        assert!(hopper_options(128).contains(&"-DHP_FWD_N=64".to_string()));
        assert!(hopper_options(32).is_empty() && hopper_shapes(96).is_none());
    }

    #[test]
    fn the_hopper_backward_takes_one_pass_only_when_chosen() {
        assert!(!Hopper.one_pass() && !HopperTwoPass.one_pass());
        assert!(HopperOnePass.one_pass());
    }

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
