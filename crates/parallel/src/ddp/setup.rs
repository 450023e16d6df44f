//! What every data-parallel layout shares: its error type, and the check that the replicas
//! start from the same weights.

use candle_core::{DType, Tensor};
use mtrain_comm::{Comm, CommError};
use mtrain_model::Param;

use crate::mixed_precision::PrecisionError;
use crate::toolbox::{sum_f64, StateError};

/// Errors of the data-parallel strategies.
#[derive(Debug, thiserror::Error)]
pub enum DpError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(
        "rank {rank} initialised parameter '{name}' differently from rank 0 \
         (checksum {theirs} vs {ours}); every rank must build the model from the same seed"
    )]
    InitMismatch {
        rank: usize,
        name: String,
        ours: String,
        theirs: String,
    },
    #[error("rank {rank} has {theirs} parameters but rank 0 has {ours}; every rank must build the same model")]
    ParamCountMismatch {
        rank: usize,
        ours: usize,
        theirs: usize,
    },
    #[error("invalid data-parallel setting: {0}")]
    Config(String),
    #[error(transparent)]
    State(#[from] StateError),
    #[error(transparent)]
    Precision(#[from] PrecisionError),
}

pub type Result<T> = std::result::Result<T, DpError>;

/// Checks that every rank of `comm` holds the same initial `params`, each the piece this rank
/// holds (a tensor-parallel slice, or the whole tensor; never a whole model it does not hold):
/// each rank computes (Σx, Σx², Σ i·x) of every piece in f64, the checksums of all ranks are
/// gathered, and any difference from rank 0 fails on every rank with an error naming the rank
/// and the parameter.
pub fn verify_same_init(comm: &Comm, params: &[Param]) -> Result<()> {
    if comm.size() == 1 {
        return Ok(()); // nobody to differ from
    }
    let device = comm.device().clone();
    let count = Tensor::new(&[params.len() as i64], &device)?;
    let counts = comm.all_gather(&count)?.to_vec1::<i64>()?;
    for (rank, &c) in counts.iter().enumerate() {
        if c != counts[0] {
            return Err(DpError::ParamCountMismatch {
                rank,
                ours: counts[0] as usize,
                theirs: c as usize,
            });
        }
    }
    let mut sums = Vec::with_capacity(3 * params.len());
    for p in params {
        let x = p.tensor().detach().flatten_all()?.to_dtype(DType::F64)?;
        let idx = Tensor::arange(0u32, x.elem_count() as u32, x.device())?.to_dtype(DType::F64)?;
        sums.push(sum_f64(&x)?);
        sums.push(sum_f64(&x.sqr()?)?);
        sums.push(sum_f64(&(&x * &idx)?)?);
    }
    // f64 bit patterns travel as i64 so the comparison is exact.
    let bits: Vec<i64> = sums.iter().map(|s| s.to_bits() as i64).collect();
    let n = bits.len();
    let all = comm
        .all_gather(&Tensor::from_vec(bits, n, &device)?)?
        .to_vec1::<i64>()?;
    for rank in 1..comm.size() {
        for (k, p) in params.iter().enumerate() {
            let mine = &all[3 * k..3 * k + 3];
            let theirs = &all[rank * n + 3 * k..rank * n + 3 * k + 3];
            if mine != theirs {
                let show = |s: &[i64]| {
                    format!(
                        "{:e}/{:e}",
                        f64::from_bits(s[0] as u64),
                        f64::from_bits(s[1] as u64)
                    )
                };
                return Err(DpError::InitMismatch {
                    rank,
                    name: p.name().to_string(),
                    ours: show(mine),
                    theirs: show(theirs),
                });
            }
        }
    }
    Ok(())
}
