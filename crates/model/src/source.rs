//! Where a parameter's values come from, one region at a time.
//!
//! A rank that holds a piece of a parameter asks its source for exactly that piece: the
//! elements of the single-device tensor at some row-major index ranges ("runs"), in order. A
//! tensor-parallel shard of a `(3C, C)` weight split in q | k | v blocks is three runs; a row
//! shard `(C, C/tp)` of a `(C, C)` weight is C runs of C/tp; a ZeRO shard is a flat sub-range
//! of those. So nothing outside the piece is ever materialised by the reader.
//!
//! ```text
//!   full tensor, row-major         runs = [2..4, 6..8]        read → [x2 x3 x6 x7]
//!   [x0 x1 | x2 x3]   (2 × 4)
//!   [x4 x5 | x6 x7]   rank 1 of a column split over tp = 2
//! ```
//!
//! Implementors: the full tensors of a map (weights read whole from a Hugging Face file or an
//! older checkpoint), the seeded initialisation, and a sharded checkpoint.

use std::collections::BTreeMap;
use std::ops::Range;

use candle_core::{DType, Device, Result, Tensor};

/// The values of any region of any parameter, by its single-device name and shape.
pub trait ParamSource: Send + Sync {
    /// The fp32 values of `name` (single-device shape `full_shape`) at the row-major element
    /// ranges `runs` of the full tensor, concatenated in the order given.
    fn read(&self, name: &str, full_shape: &[usize], runs: &[Range<usize>]) -> Result<Vec<f32>>;
}

/// Full tensors by name: a run is a slice of the flattened tensor.
impl ParamSource for BTreeMap<String, Tensor> {
    fn read(&self, name: &str, full_shape: &[usize], runs: &[Range<usize>]) -> Result<Vec<f32>> {
        let t = self
            .get(name)
            .ok_or_else(|| candle_core::Error::Msg(format!("no tensor named `{name}`")))?;
        if t.dims() != full_shape {
            candle_core::bail!("`{name}` has shape {:?}, expected {full_shape:?}", t.dims());
        }
        let flat = t.to_dtype(DType::F32)?.flatten_all()?;
        let mut out = Vec::with_capacity(runs_len(runs));
        for r in runs {
            out.extend(flat.narrow(0, r.start, r.len())?.to_vec1::<f32>()?);
        }
        Ok(out)
    }
}

/// A region of one parameter that a rank holds, and where it sits on the rank: the elements
/// `runs` of the single-device tensor `name` (shape `full_shape`), stored in order at elements
/// `offset..offset + runs_len(runs)` of the flattened local tensor `local` (the parameter's own
/// name, or a ZeRO shard piece such as `h.0.flat.decay`, which holds parts of several
/// parameters). A rank's pieces say what it would write of its weights, fp32 masters or
/// optimizer moments (keyed and cut alike) and what it reads back through a [`ParamSource`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub name: String,
    pub full_shape: Vec<usize>,
    pub runs: Vec<Range<usize>>,
    pub local: String,
    pub offset: usize,
}

impl Piece {
    /// Elements of the piece.
    pub fn len(&self) -> usize {
        runs_len(&self.runs)
    }

    /// Whether the piece holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Elements covered by `runs`.
pub fn runs_len(runs: &[Range<usize>]) -> usize {
    runs.iter().map(|r| r.len()).sum()
}

/// The runs covering elements `flat` of the concatenation of `runs` (a ZeRO shard of a
/// tensor-parallel piece: positions in the piece → ranges of the full tensor).
pub fn sub_runs(runs: &[Range<usize>], flat: Range<usize>) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut at = 0; // position of the current run's first element in the concatenation
    for r in runs {
        let (lo, hi) = (flat.start.max(at), flat.end.min(at + r.len()));
        if lo < hi {
            out.push(r.start + (lo - at)..r.start + (hi - at));
        }
        at += r.len();
    }
    out
}

/// `runs` of `name` from `source` as a tensor of `shape` (the piece's own shape) on `device`.
pub fn read_tensor(
    source: &dyn ParamSource,
    name: &str,
    full_shape: &[usize],
    runs: &[Range<usize>],
    shape: &[usize],
    device: &Device,
) -> Result<Tensor> {
    let data = source.read(name, full_shape, runs)?;
    Tensor::from_vec(data, shape, device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_map_reads_the_runs_it_is_asked_for() -> Result<()> {
        let t = Tensor::arange(0f32, 8., &Device::Cpu)?.reshape((2, 4))?;
        let map = BTreeMap::from([("w".to_string(), t)]);
        assert_eq!(map.read("w", &[2, 4], &[2..4, 6..8])?, vec![2., 3., 6., 7.]);
        assert!(map.read("w", &[4, 2], &[0..1]).is_err(), "wrong shape");
        assert!(map.read("v", &[2, 4], &[0..1]).is_err(), "unknown name");
        Ok(())
    }

    #[test]
    fn sub_runs_cut_the_concatenation() {
        let runs = [2..4, 6..8, 10..13];
        assert_eq!(sub_runs(&runs, 0..7), vec![2..4, 6..8, 10..13]);
        assert_eq!(sub_runs(&runs, 1..5), vec![3..4, 6..8, 10..11]);
        assert_eq!(sub_runs(&runs, 4..4), Vec::<Range<usize>>::new());
        assert_eq!(sub_runs(&runs, 5..7), vec![11..13]);
    }
}
