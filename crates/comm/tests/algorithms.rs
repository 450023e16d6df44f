//! The all-reduce algorithms of the CPU backend against the ring: the tree and recursive
//! halving-doubling give the ring's result (integers exactly, floats within the bound of a
//! different summation order) for counts from 1 to 2^22, odd ones among them, over 2, 3, 4, 5
//! and 8 ranks; each rank sends the bytes of its algorithm's closed form; `auto` picks by size;
//! and ranks that would run different algorithms fail with a mismatch instead.

use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use mtrain_comm::cpu::{run_local_with, CpuBackend, CpuOptions};
use mtrain_comm::{AlgoChoice, AllReduceAlgo, AutoRule, Backend, Comm, CommError, ReduceOp};

const T: Duration = Duration::from_secs(60);
const WORLDS: [usize; 5] = [2, 3, 4, 5, 8];

fn opts() -> CpuOptions {
    CpuOptions {
        timeout: T,
        trace: true,
        ..CpuOptions::default()
    }
}

/// A group of every rank whose all-reduce runs `algo`.
fn group(b: &CpuBackend, algo: AllReduceAlgo) -> Comm {
    let all: Vec<usize> = (0..b.world_size()).collect();
    b.new_group_with_algo(&all, algo.name(), AlgoChoice::Fixed(algo))
        .expect("group")
        .expect("the CPU backend runs its own algorithms")
}

/// Rank r's element i: a float of varied magnitude and sign, so the order of a sum shows.
fn float_value(r: usize, i: usize) -> f32 {
    let h = (r as u64 * 0x9E37_79B9 + i as u64 * 0x85EB_CA6B) % 1_000_003;
    (h as f32 / 1_000_003.0 - 0.5) * (1 + (i % 7) * 100) as f32
}

fn floats(r: usize, len: usize) -> Tensor {
    let v: Vec<f32> = (0..len).map(|i| float_value(r, i)).collect();
    Tensor::from_vec(v, len, &Device::Cpu).expect("tensor")
}

fn ints(r: usize, len: usize) -> Tensor {
    let v: Vec<i64> = (0..len)
        .map(|i| ((r * 1_000_003 + i * 7919) % 65_536) as i64 - 30_000)
        .collect();
    Tensor::from_vec(v, len, &Device::Cpu).expect("tensor")
}

/// Two sums of the same n terms in different orders differ by at most 2·(n−1)·ε·Σ|x| (each is
/// within (n−1)·ε·Σ|x| of the exact sum, to first order).
fn assert_within_order_bound(got: &[f32], ring: &[f32], n: usize, len: usize, what: &str) {
    for (i, (g, w)) in got.iter().zip(ring).enumerate() {
        let abs_sum: f32 = (0..n).map(|r| float_value(r, i % len).abs()).sum();
        let bound = 2.0 * (n - 1) as f32 * f32::EPSILON * abs_sum;
        assert!(
            (g - w).abs() <= bound,
            "{what}: element {i} is {g}, the ring's {w} (bound {bound})"
        );
    }
}

#[test]
fn every_algorithm_equals_the_ring() {
    for n in WORLDS {
        run_local_with(n, opts(), |b| {
            let r = b.rank();
            let ring = group(&b, AllReduceAlgo::Ring);
            let others = [
                group(&b, AllReduceAlgo::Tree),
                group(&b, AllReduceAlgo::Rhd),
            ];
            let mut counts = vec![1, 2, 7, 1023, 100_003];
            if n == 4 {
                counts.push(1 << 22);
            }
            for len in counts {
                let (x, k) = (floats(r, len), ints(r, len));
                let want_f = ring.all_reduce(&x, ReduceOp::Sum).expect("ring");
                let want_i = ring.all_reduce(&k, ReduceOp::Sum).expect("ring");
                for g in &others {
                    let what = format!("{} n {n} len {len} rank {r}", g.name());
                    let got = g.all_reduce(&k, ReduceOp::Sum).expect("all_reduce");
                    assert_eq!(
                        got.to_vec1::<i64>().unwrap(),
                        want_i.to_vec1::<i64>().unwrap(),
                        "{what}: i64"
                    );
                    let got = g.all_reduce(&x, ReduceOp::Sum).expect("all_reduce");
                    let (got, want) = (
                        got.to_vec1::<f32>().unwrap(),
                        want_f.to_vec1::<f32>().unwrap(),
                    );
                    assert_within_order_bound(&got, &want, n, len, &what);
                }
            }
            // The other reductions, half precision, and the in-place form, on one odd count.
            let len = 1001;
            let x = floats(r, len);
            for op in [ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg] {
                let want = ring.all_reduce(&x, op).unwrap().to_vec1::<f32>().unwrap();
                for g in &others {
                    let got = g.all_reduce(&x, op).unwrap().to_vec1::<f32>().unwrap();
                    let what = format!("{} {op:?} n {n} rank {r}", g.name());
                    match op {
                        ReduceOp::Avg => {
                            let scaled: Vec<f32> = got.iter().map(|v| v * n as f32).collect();
                            let ring_scaled: Vec<f32> = want.iter().map(|v| v * n as f32).collect();
                            assert_within_order_bound(&scaled, &ring_scaled, n + 1, len, &what)
                        }
                        _ => assert_eq!(got, want, "{what}"),
                    }
                }
            }
            let xb = ints(r, len).to_dtype(DType::BF16).unwrap();
            let want = ring.all_reduce(&xb, ReduceOp::Sum).unwrap();
            for g in &others {
                let got = g.all_reduce(&xb, ReduceOp::Sum).unwrap();
                assert_eq!(got.dtype(), DType::BF16);
                let (got, want) = (
                    got.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap(),
                    want.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap(),
                );
                assert_eq!(
                    got,
                    want,
                    "{} bf16 (f32 partial sums, rounded once)",
                    g.name()
                );
                let y = floats(r, len);
                let out = g
                    .all_reduce(&y, ReduceOp::Sum)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                g.all_reduce_in_place(&y, ReduceOp::Sum).unwrap();
                assert_eq!(y.to_vec1::<f32>().unwrap(), out, "{} in place", g.name());
            }
        });
    }
}

/// Bytes rank `r` of `n` sends in an all-reduce of `s` bytes (divisible by n's power of two).
fn closed_form(algo: AllReduceAlgo, n: usize, r: usize, s: u64) -> u64 {
    match algo {
        AllReduceAlgo::Ring => 2 * (n as u64 - 1) * s / n as u64,
        // N to the parent, N to each child: N per level of the tree the rank takes part in.
        AllReduceAlgo::Tree => {
            let children = [2 * r + 1, 2 * r + 2].iter().filter(|&&c| c < n).count() as u64;
            s * (u64::from(r != 0) + children)
        }
        AllReduceAlgo::Rhd => {
            let p2 = 1usize << (usize::BITS - 1 - n.leading_zeros());
            let extra = n - p2;
            let halving_doubling = 2 * (p2 as u64 - 1) * s / p2 as u64;
            match r < 2 * extra {
                true if r % 2 == 0 => s,      // folds into r+1, receives the result
                true => halving_doubling + s, // and hands the result back to r-1
                false => halving_doubling,
            }
        }
    }
}

#[test]
fn each_rank_sends_its_algorithms_closed_form() {
    for n in WORLDS {
        run_local_with(n, opts(), |b| {
            // Divisible by 2..=8; 336,000 bytes: two pipeline pieces of the tree.
            let len = 84_000;
            let x = floats(b.rank(), len);
            let s = (len * 4) as u64;
            for algo in AllReduceAlgo::ALL {
                let g = group(&b, algo);
                g.tracer().clear();
                g.all_reduce(&x, ReduceOp::Sum).expect("all_reduce");
                let ev = g.tracer().events().pop().expect("one traced op");
                assert_eq!(
                    ev.bytes_sent,
                    closed_form(algo, n, g.rank(), s),
                    "{algo}: bytes sent by rank {} of {n}",
                    g.rank()
                );
                if n.is_power_of_two() && algo == AllReduceAlgo::Rhd {
                    assert_eq!(ev.bytes_sent, 2 * s * (n as u64 - 1) / n as u64);
                }
            }
        });
    }
}

#[test]
fn auto_picks_by_message_size() {
    run_local_with(4, opts(), |b| {
        let all: Vec<usize> = (0..4).collect();
        let rule = AutoRule::from_best(
            4,
            &[
                (64, AllReduceAlgo::Tree),
                (4096, AllReduceAlgo::Rhd),
                (1 << 20, AllReduceAlgo::Ring),
            ],
        );
        let g = b
            .new_group_with_algo(&all, "auto", AlgoChoice::Auto(vec![rule]))
            .unwrap()
            .unwrap();
        for (len, algo) in [
            (16, AllReduceAlgo::Tree),
            (1000, AllReduceAlgo::Rhd),
            (4000, AllReduceAlgo::Ring),
        ] {
            g.tracer().clear();
            g.all_reduce(&floats(b.rank(), len), ReduceOp::Sum).unwrap();
            let ev = g.tracer().events().pop().unwrap();
            let s = (len * 4) as u64;
            assert_eq!(
                ev.bytes_sent,
                closed_form(algo, 4, g.rank(), s),
                "{len} elements: {algo}"
            );
        }
    });
}

#[test]
fn ranks_that_pick_different_algorithms_fail_with_a_mismatch() {
    run_local_with(3, opts(), |b| {
        let all: Vec<usize> = (0..3).collect();
        let algo = if b.rank() == 0 {
            AllReduceAlgo::Tree
        } else {
            AllReduceAlgo::Ring
        };
        let g = b
            .new_group_with_algo(&all, "mixed", AlgoChoice::Fixed(algo))
            .unwrap()
            .unwrap();
        let err = g
            .all_reduce(&floats(b.rank(), 10), ReduceOp::Sum)
            .unwrap_err();
        assert!(matches!(err, CommError::Mismatch { .. }), "{err}");
        assert!(err.to_string().contains("by tree"), "{err}");
    });
}
