//! bench-comm's correctness check: every input is a closed form of (rank, index), so each
//! rank knows element by element what the op must return, and `#wrong` counts the elements
//! that differ.
//!
//! ```text
//!   value(r, i)          = (r + 1) + i mod 7           every op's input on rank r
//!   block_value(s, d, i) = (31 s + 7 d + i) mod 199    the block rank s sends rank d (all-to-all)
//! ```
//!
//! Both are small integers, so any sum over up to 16 ranks is exact in bf16 and in any order
//! of summation: the expected result does not depend on the backend's reduction order.

use candle_core::{DType, Device, Tensor};

use super::{BenchOp, BenchReduce};

impl BenchReduce {
    /// Element `i` of the reduction over `n` ranks of [`value`]: (r + 1) + i mod 7 for r in 0..n.
    pub(super) fn of_values(self, n: usize, i: usize) -> f32 {
        let k = (i % 7) as f32;
        let n = n as f32;
        match self {
            BenchReduce::Sum => n * (n + 1.0) / 2.0 + n * k,
            BenchReduce::Avg => (n + 1.0) / 2.0 + k,
            BenchReduce::Max => n + k,
            BenchReduce::Min => 1.0 + k,
        }
    }
}

/// Closed-form inputs: small integers, exact in bf16 and in any summation order.
fn value(rank: usize, i: usize) -> f32 {
    ((rank + 1) + i % 7) as f32
}
/// The block rank `src` sends to rank `dst` in all-to-all.
fn block_value(src: usize, dst: usize, i: usize) -> f32 {
    ((src * 31 + dst * 7 + i) % 199) as f32
}

/// One size's input on this rank and the result it must produce.
pub(super) struct Case {
    pub(super) input: Tensor,
    pub(super) expected: Vec<f32>,
}

fn tensor(values: Vec<f32>, dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
    let n = values.len();
    Tensor::from_vec(values, n, device)?.to_dtype(dtype)
}

pub(super) fn make_case(
    op: BenchOp,
    redop: BenchReduce,
    count: usize,
    n: usize,
    r: usize,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<Case> {
    let m = count / n; // rows per rank for the split ops
    let (input, expected): (Vec<f32>, Vec<f32>) = match op {
        BenchOp::AllReduce => (
            (0..count).map(|i| value(r, i)).collect(),
            (0..count).map(|i| redop.of_values(n, i)).collect(),
        ),
        BenchOp::AllGather => (
            (0..m).map(|i| value(r, i)).collect(),
            (0..m * n).map(|j| value(j / m, j % m)).collect(),
        ),
        BenchOp::ReduceScatter => (
            (0..count).map(|i| value(r, i)).collect(),
            (r * m..(r + 1) * m)
                .map(|i| redop.of_values(n, i))
                .collect(),
        ),
        BenchOp::AllToAll => (
            (0..m * n).map(|j| block_value(r, j / m, j % m)).collect(),
            (0..m * n).map(|j| block_value(j / m, r, j % m)).collect(),
        ),
        BenchOp::Broadcast => (
            (0..count)
                .map(|i| if r == 0 { value(0, i) } else { -1.0 })
                .collect(),
            (0..count).map(|i| value(0, i)).collect(),
        ),
        BenchOp::SendRecv => {
            let prev = (r + n - 1) % n;
            (
                (0..count).map(|i| value(r, i)).collect(),
                (0..count).map(|i| value(prev, i)).collect(),
            )
        }
    };
    Ok(Case {
        input: tensor(input, dtype, device)?,
        expected,
    })
}

/// Elements of `result` differing from `expected` by more than `tol` relative (0: exactly).
pub(super) fn count_wrong(result: &Tensor, expected: &[f32], tol: f32) -> candle_core::Result<u64> {
    let got = result
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    if got.len() != expected.len() {
        return Ok(expected.len().max(got.len()) as u64);
    }
    Ok(got
        .iter()
        .zip(expected)
        .filter(|(a, b)| (*a - *b).abs() > tol * b.abs() || a.is_nan())
        .count() as u64)
}

/// The relative tolerance of a result: the average may be taken as a scaled sum (NCCL's avg on
/// floats), so a few units in the last place of the dtype are allowed there; every other
/// result is exact.
pub(super) fn tolerance(op: BenchOp, redop: BenchReduce, dtype: DType) -> f32 {
    match (redop, op.reduces()) {
        (BenchReduce::Avg, true) => 4.0 * f32::powi(2.0, -(mantissa_bits(dtype) as i32)),
        _ => 0.0,
    }
}

/// Explicit mantissa bits of `dtype` (its unit in the last place relative to 1).
fn mantissa_bits(dtype: DType) -> u32 {
    match dtype {
        DType::BF16 => 7,
        DType::F16 => 10,
        _ => 23,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn to_vec(t: &Tensor) -> Vec<f32> {
        t.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()
    }

    /// The expected results are the op applied by hand to every rank's input.
    #[test]
    fn expected_results_equal_the_op_simulated_on_all_inputs() {
        let ops = [
            BenchOp::AllReduce,
            BenchOp::AllGather,
            BenchOp::ReduceScatter,
            BenchOp::AllToAll,
            BenchOp::Broadcast,
            BenchOp::SendRecv,
        ];
        for op in ops {
            for n in 1..=4usize {
                let count = 12 * n;
                let cases: Vec<Case> = (0..n)
                    .map(|r| {
                        make_case(op, BenchReduce::Sum, count, n, r, DType::BF16, &Device::Cpu)
                            .unwrap()
                    })
                    .collect();
                let inputs: Vec<Vec<f32>> = cases.iter().map(|c| to_vec(&c.input)).collect();
                let sum: Vec<f32> = (0..inputs[0].len())
                    .map(|i| inputs.iter().map(|x| x[i]).sum())
                    .collect();
                let m = count / n;
                for (r, case) in cases.iter().enumerate() {
                    let want: Vec<f32> = match op {
                        BenchOp::AllReduce => sum.clone(),
                        BenchOp::AllGather => inputs.concat(),
                        BenchOp::ReduceScatter => sum[r * m..(r + 1) * m].to_vec(),
                        BenchOp::AllToAll => (0..n)
                            .flat_map(|p| inputs[p][r * m..(r + 1) * m].to_vec())
                            .collect(),
                        BenchOp::Broadcast => inputs[0].clone(),
                        BenchOp::SendRecv => inputs[(r + n - 1) % n].clone(),
                    };
                    assert_eq!(case.expected, want, "{op:?} n={n} rank {r}");
                }
            }
        }
    }

    /// Every reduction's closed form is the reduction applied by hand to every rank's input.
    #[test]
    fn expected_reductions_equal_the_reduction_of_all_inputs() {
        for redop in [
            BenchReduce::Sum,
            BenchReduce::Avg,
            BenchReduce::Max,
            BenchReduce::Min,
        ] {
            for n in 1..=5usize {
                let count = 14 * n;
                let inputs: Vec<Vec<f32>> = (0..n)
                    .map(|r| {
                        let c = make_case(
                            BenchOp::AllReduce,
                            redop,
                            count,
                            n,
                            r,
                            DType::F32,
                            &Device::Cpu,
                        )
                        .unwrap();
                        to_vec(&c.input)
                    })
                    .collect();
                let want: Vec<f32> = (0..count)
                    .map(|i| {
                        let col = inputs.iter().map(|x| x[i]);
                        match redop {
                            BenchReduce::Sum => col.sum(),
                            BenchReduce::Avg => col.sum::<f32>() / n as f32,
                            BenchReduce::Max => col.fold(f32::MIN, f32::max),
                            BenchReduce::Min => col.fold(f32::MAX, f32::min),
                        }
                    })
                    .collect();
                let case = make_case(
                    BenchOp::AllReduce,
                    redop,
                    count,
                    n,
                    0,
                    DType::F32,
                    &Device::Cpu,
                )
                .unwrap();
                assert_eq!(case.expected, want, "{redop:?} n={n}");
            }
        }
    }

    #[test]
    fn wrong_elements_are_counted() {
        let expected = vec![1.0, 2.0, 3.0, 4.0];
        let good = Tensor::new(&[1f32, 2., 3., 4.], &Device::Cpu).unwrap();
        let bad = Tensor::new(&[1f32, 2.5, 3., 0.], &Device::Cpu).unwrap();
        assert_eq!(count_wrong(&good, &expected, 0.0).unwrap(), 0);
        assert_eq!(count_wrong(&bad, &expected, 0.0).unwrap(), 2);
        // 2.5 is 25% off 2.0: inside a 30% tolerance, 0.0 is not.
        assert_eq!(count_wrong(&bad, &expected, 0.3).unwrap(), 1);
        let short = Tensor::new(&[1f32, 2.], &Device::Cpu).unwrap();
        assert_eq!(count_wrong(&short, &expected, 0.0).unwrap(), 4);
    }

    #[test]
    fn closed_forms_are_exact_in_bf16() {
        // Every value an input or an expected result can take for up to 16 ranks.
        let n = 16usize;
        let max_sum = (n * (n + 1) / 2 + n * 6) as f32;
        for v in [max_sum, 198.0, value(n - 1, 6)] {
            let t = Tensor::new(&[v], &Device::Cpu)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            assert_eq!(
                t.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()[0],
                v
            );
        }
    }
}
