//! Every collective of the CPU backend against its closed form, for world sizes 1, 2, 3, 4 and
//! 8, element counts 0, 1, n-1, not divisible by n and > 16 MB, and each dtype. Rank r's input
//! element i is the small integer `value(r, i)`, so every sum is exact in f32, bf16 and f16 and
//! results are compared exactly (averages within 1e-2 relative).

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Shape, Tensor};
use mtrain_comm::{
    chunk_range, run_local, Backend, Comm, CpuOptions, DeviceMesh, GroupKind, MeshDims, ReduceOp,
};

const T: Duration = Duration::from_secs(30);
const WORLDS: [usize; 5] = [1, 2, 3, 4, 8];
const DTYPES: [DType; 5] = [DType::F32, DType::BF16, DType::F16, DType::U32, DType::I64];

/// Rank r's element i: an integer in 0..=10.
fn value(r: usize, i: usize) -> f64 {
    ((r * 7 + i * 3) % 11) as f64
}

/// Rank r's input: `rows` rows of `cols` values, element (j, c) = value(r, offset + j * cols + c).
fn input(r: usize, rows: usize, cols: usize, offset: usize, dtype: DType) -> Tensor {
    let v: Vec<f64> = (0..rows * cols).map(|i| value(r, offset + i)).collect();
    Tensor::from_vec(v, (rows, cols), &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .expect("input tensor")
}

fn to_f64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f64>())
        .expect("readable result")
}

fn counts(n: usize) -> Vec<usize> {
    let mut c = vec![0, 1, n.saturating_sub(1), 2 * n + 1, 1000];
    c.dedup();
    c
}

fn reduce_closed_form(n: usize, len: usize, op: ReduceOp, dtype: DType) -> Vec<f64> {
    (0..len)
        .map(|i| {
            let vals = (0..n).map(|r| value(r, i));
            match op {
                ReduceOp::Sum => vals.sum(),
                ReduceOp::Max => vals.fold(f64::MIN, f64::max),
                ReduceOp::Min => vals.fold(f64::MAX, f64::min),
                ReduceOp::Avg if matches!(dtype, DType::U32 | DType::I64) => {
                    (vals.sum::<f64>() / n as f64).floor()
                }
                ReduceOp::Avg => vals.sum::<f64>() / n as f64,
            }
        })
        .collect()
}

fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "{what}: element {i} is {g}, expected {w}"
        );
    }
}

fn tol(op: ReduceOp) -> f64 {
    if op == ReduceOp::Avg {
        1e-2
    } else {
        0.0
    }
}

#[test]
fn all_reduce_every_op_dtype_and_count() {
    for n in WORLDS {
        run_local(n, T, |b| {
            let w = b.world();
            let r = w.rank();
            for dtype in DTYPES {
                for len in counts(n) {
                    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                        let x = input(r, 1, len, 0, dtype).reshape(len).expect("1-d");
                        let got = w.all_reduce(&x, op).expect("all_reduce");
                        let what = format!("all_reduce {op:?} {dtype:?} len {len} n {n} rank {r}");
                        assert_eq!((got.dims(), got.dtype()), (x.dims(), dtype), "{what}");
                        assert_close(
                            &to_f64(&got),
                            &reduce_closed_form(n, len, op, dtype),
                            tol(op),
                            &what,
                        );
                    }
                }
            }
        });
    }
}

/// `all_reduce_in_place` leaves in the tensor what `all_reduce` returns, bit for bit: every
/// world size, dtype (the ring's own types in place, the half types through the copy), count
/// and op, on a tensor whose view shares its storage (the view sees the result), and after an
/// async op on the same tensor that is still queued (it finishes first, reading the old values).
#[test]
fn all_reduce_in_place_equals_all_reduce() {
    for n in WORLDS {
        run_local(n, T, |b| {
            let w = b.world();
            let r = w.rank();
            for dtype in DTYPES {
                for len in counts(n) {
                    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                        let what = format!("in place {op:?} {dtype:?} len {len} n {n} rank {r}");
                        let x = input(r, 1, len, 0, dtype).reshape(len).expect("1-d");
                        let want = w.all_reduce(&x, op).expect("all_reduce");
                        let view = x.reshape((1, len)).expect("view");
                        w.all_reduce_in_place(&x, op).expect("all_reduce_in_place");
                        assert_eq!(to_f64(&x), to_f64(&want), "{what}");
                        assert_eq!(to_f64(&view), to_f64(&want), "{what}: the view");
                    }
                }
            }
            // 18 MB through many segments, behind a queued async op on the same tensor.
            let len = 4_500_000;
            let x = input(r, 1, len, 0, DType::F32).reshape(len).expect("1-d");
            let before = w.all_reduce_async(&x, ReduceOp::Sum);
            w.all_reduce_in_place(&x, ReduceOp::Sum).expect("in place");
            let once = reduce_closed_form(n, len, ReduceOp::Sum, DType::F32);
            assert_close(
                &to_f64(&before.wait().expect("async")),
                &once,
                0.0,
                "the async op",
            );
            let twice: Vec<f64> = once.iter().map(|v| v * n as f64).collect();
            let got = to_f64(&w.all_reduce(&x, ReduceOp::Sum).expect("all_reduce"));
            assert_close(&got, &twice, 0.0, "reduced in place, then again");
        });
    }
}

/// A strided view cannot be reduced in place (the result would land in a copy): the error
/// names the op and the strides.
#[test]
fn all_reduce_in_place_refuses_a_strided_view() {
    run_local(2, T, |b| {
        let w = b.world();
        let x = input(w.rank(), 3, 4, 0, DType::F32).t().expect("transpose");
        let err = w
            .all_reduce_in_place(&x, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("all_reduce_in_place") && err.contains("contiguous"),
            "{err}"
        );
    });
}

#[test]
fn all_reduce_of_more_than_16_mb_streams_through_the_ring() {
    let len = 4_500_000; // 18 MB of f32: many 1 MiB segments per chunk
    let n = 4;
    run_local(n, T, |b| {
        let w = b.world();
        let x = input(w.rank(), 1, len, 0, DType::F32)
            .reshape(len)
            .expect("1-d");
        let got = to_f64(&w.all_reduce(&x, ReduceOp::Sum).expect("all_reduce"));
        assert_close(
            &got,
            &reduce_closed_form(n, len, ReduceOp::Sum, DType::F32),
            0.0,
            "18 MB all_reduce",
        );
        // The same size through the pipelined tree broadcast (two levels below root 1) and the
        // all-gather, in bf16 (the all-reduce's second phase then moves native bf16 bytes).
        let got = to_f64(&w.broadcast(&x, 1).expect("broadcast"));
        let want: Vec<f64> = (0..len).map(|i| value(1, i)).collect();
        assert_close(&got, &want, 0.0, "18 MB broadcast");
        let xb = x.to_dtype(DType::BF16).expect("bf16");
        let got = to_f64(&w.all_reduce(&xb, ReduceOp::Max).expect("all_reduce bf16"));
        assert_close(
            &got,
            &reduce_closed_form(n, len, ReduceOp::Max, DType::BF16),
            0.0,
            "9 MB bf16 all_reduce",
        );
    });
}

#[test]
fn reduce_scatter_and_all_gather() {
    for n in WORLDS {
        run_local(n, T, |b| {
            let w = b.world();
            let r = w.rank();
            for dtype in DTYPES {
                for rows in counts(n) {
                    let cols = 3;
                    // reduce_scatter: rows chunk_range(rows, n, r) of the sum.
                    let x = input(r, rows, cols, 0, dtype);
                    let got = w.reduce_scatter(&x, ReduceOp::Sum).expect("reduce_scatter");
                    let mine = chunk_range(rows, n, r);
                    assert_eq!(got.dims(), &[mine.len(), cols]);
                    let full = reduce_closed_form(n, rows * cols, ReduceOp::Sum, dtype);
                    let what = format!("reduce_scatter {dtype:?} rows {rows} n {n} rank {r}");
                    assert_close(
                        &to_f64(&got),
                        &full[mine.start * cols..mine.end * cols],
                        0.0,
                        &what,
                    );

                    // all_gather with a different row count on every rank: rank p has (rows + p) % 4 rows.
                    let my_rows = (rows + r) % 4;
                    let got = w
                        .all_gather(&input(r, my_rows, cols, 0, dtype))
                        .expect("all_gather");
                    let want: Vec<f64> = (0..n)
                        .flat_map(|p| (0..((rows + p) % 4) * cols).map(move |i| value(p, i)))
                        .collect();
                    assert_eq!(got.dims()[1], cols);
                    assert_close(
                        &to_f64(&got),
                        &want,
                        0.0,
                        &format!("all_gather {dtype:?} rows {rows} n {n}"),
                    );
                }
            }
        });
    }
}

/// A reduce-scatter keeps only two chunk-sized slots, reused from step to step, where the
/// all-reduce's first phase reduces into a buffer as long as the tensor: the rank's rows are
/// the all-reduce's bit for bit, in the ring's summation order (values whose sums round, f32
/// and bf16, sum and average), over several segments per chunk and uneven chunks.
#[test]
fn reduce_scatter_in_slots_sums_in_the_all_reduces_order() {
    let len = 1_300_003; // 5.2 MB of f32: two 1 MiB segments per chunk at n = 4
    for n in [2, 3, 4, 8] {
        run_local(n, T, |b| {
            let w = b.world();
            let r = w.rank();
            let v: Vec<f32> = (0..len)
                .map(|i| ((r * 7919 + i * 104_729) % 1_000_003) as f32 / 997.0 - 500.0)
                .collect();
            let x = Tensor::from_vec(v, len, &Device::Cpu).expect("input");
            let mine = chunk_range(len, n, r);
            for dtype in [DType::F32, DType::BF16] {
                let x = x.to_dtype(dtype).expect("dtype");
                for op in [ReduceOp::Sum, ReduceOp::Avg] {
                    let what = format!("{op:?} {dtype:?} n {n} rank {r}");
                    let got = w.reduce_scatter(&x, op).expect("reduce_scatter");
                    let all = w.all_reduce(&x, op).expect("all_reduce");
                    let want = all.narrow(0, mine.start, mine.len()).expect("our rows");
                    assert_eq!(to_f64(&got), to_f64(&want), "{what}");
                }
            }
        });
    }
}

#[test]
fn broadcast_and_reduce_from_every_root() {
    for n in WORLDS {
        run_local(n, T, |b| {
            let w = b.world();
            let r = w.rank();
            for dtype in [DType::F32, DType::BF16, DType::I64] {
                for len in counts(n) {
                    for root in 0..n {
                        let x = input(r, 1, len, 0, dtype);
                        let got = w.broadcast(&x, root).expect("broadcast");
                        let want: Vec<f64> = (0..len).map(|i| value(root, i)).collect();
                        assert_close(
                            &to_f64(&got),
                            &want,
                            0.0,
                            &format!("broadcast {dtype:?} len {len} root {root} n {n}"),
                        );

                        let got = w.reduce(&x, root, ReduceOp::Sum).expect("reduce");
                        let want = if r == root {
                            reduce_closed_form(n, len, ReduceOp::Sum, dtype)
                        } else {
                            (0..len).map(|i| value(r, i)).collect()
                        };
                        assert_close(
                            &to_f64(&got),
                            &want,
                            0.0,
                            &format!("reduce {dtype:?} len {len} root {root} n {n} rank {r}"),
                        );
                    }
                }
            }
        });
    }
}

#[test]
fn scatter_gather_and_all_to_all() {
    for n in WORLDS {
        run_local(n, T, |b| {
            let w = b.world();
            let r = w.rank();
            let cols = 2;
            for dtype in [DType::F32, DType::F16, DType::U32] {
                for rows in counts(n) {
                    let root = rows % n;
                    // scatter: non-roots pass a placeholder of the right dtype.
                    let x = if r == root {
                        input(root, rows, cols, 0, dtype)
                    } else {
                        input(r, 0, cols, 0, dtype)
                    };
                    let got = w.scatter(&x, root).expect("scatter");
                    let c = chunk_range(rows, n, r);
                    let want: Vec<f64> = (c.start * cols..c.end * cols)
                        .map(|i| value(root, i))
                        .collect();
                    assert_eq!(got.dims(), &[c.len(), cols]);
                    assert_close(
                        &to_f64(&got),
                        &want,
                        0.0,
                        &format!("scatter {dtype:?} rows {rows} n {n} rank {r}"),
                    );

                    // gather: rank p contributes (rows + p) % 3 rows.
                    let x = input(r, (rows + r) % 3, cols, 0, dtype);
                    let got = w.gather(&x, root).expect("gather");
                    let want: Vec<f64> = if r == root {
                        (0..n)
                            .flat_map(|p| (0..((rows + p) % 3) * cols).map(move |i| value(p, i)))
                            .collect()
                    } else {
                        to_f64(&x)
                    };
                    assert_close(
                        &to_f64(&got),
                        &want,
                        0.0,
                        &format!("gather {dtype:?} rows {rows} n {n} rank {r}"),
                    );

                    // all_to_all: rank s sends split(s, d) = (s + 2d + rows) % 3 rows to rank d;
                    // the rows s sends to d start at offset 100 * d of its input's values.
                    let split = |s: usize, d: usize| (s + 2 * d + rows) % 3;
                    let send: Vec<usize> = (0..n).map(|d| split(r, d)).collect();
                    let recv: Vec<usize> = (0..n).map(|s| split(s, r)).collect();
                    let block = |s: usize, d: usize| input(s, split(s, d), cols, 100 * d, dtype);
                    let parts: Vec<Tensor> = (0..n).map(|d| block(r, d)).collect();
                    let x = Tensor::cat(&parts, 0).expect("cat");
                    let got = w.all_to_all(&x, &send, &recv).expect("all_to_all");
                    let want: Vec<f64> = (0..n).flat_map(|s| to_f64(&block(s, r))).collect();
                    assert_close(
                        &to_f64(&got),
                        &want,
                        0.0,
                        &format!("all_to_all {dtype:?} rows {rows} n {n} rank {r}"),
                    );
                }
            }
        });
    }
}

#[test]
fn send_recv_around_the_ring_and_barrier() {
    for n in WORLDS.into_iter().filter(|n| *n > 1) {
        run_local(n, T, |b| {
            let w = b.world();
            let r = w.rank();
            for dtype in DTYPES {
                let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
                let x = input(r, 2, 3, 0, dtype);
                // Even ranks send first; the writer threads make the order irrelevant anyway.
                let sent = w.send_async(&x, next);
                let got = w.recv(prev, &Shape::from((2, 3)), dtype).expect("recv");
                sent.wait().expect("send");
                assert_close(
                    &to_f64(&got),
                    &to_f64(&input(prev, 2, 3, 0, dtype)),
                    0.0,
                    &format!("recv {dtype:?} n {n}"),
                );
            }
            w.barrier().expect("barrier");
        });
    }
}

/// A send and a blocking receive run on the caller's thread only where nothing is queued before
/// them: issued behind an async all-reduce, they still go on the wire, and are matched, in issue
/// order (a send ahead of the all-reduce would meet the peer's all-reduce header: a mismatch).
/// With nothing queued, sends larger than the socket takes at once (16 MiB, the receiver not
/// reading yet) complete at once and arrive whole, the rest carried by the writer thread.
#[test]
fn caller_run_sends_and_receives_keep_the_issue_order() {
    run_local(2, T, |b| {
        let w = b.world();
        let (r, peer) = (w.rank(), 1 - w.rank());
        let (rows, cols) = (1 << 12, 1 << 10); // 16 MiB of f32
        let shape = Shape::from((rows, cols));
        let want = |k| to_f64(&input(peer, rows, cols, k, DType::F32));

        let x = input(r, rows, cols, 0, DType::F32);
        let reduced = w.all_reduce_async(&x, ReduceOp::Sum);
        let sent = w.send_async(&x, peer);
        let got = w
            .recv(peer, &shape, DType::F32)
            .expect("recv behind the all-reduce");
        sent.wait().expect("send");
        let sum = to_f64(&reduced.wait().expect("all-reduce"));
        assert_close(
            &sum,
            &reduce_closed_form(2, rows * cols, ReduceOp::Sum, DType::F32),
            0.0,
            "sum",
        );
        assert_close(
            &to_f64(&got),
            &want(0),
            0.0,
            "message behind the all-reduce",
        );

        w.barrier().expect("barrier");
        if r == 0 {
            for k in 1..4 {
                let sent = w.send_async(&input(r, rows, cols, k, DType::F32), peer);
                assert!(
                    sent.is_done(),
                    "send {k} was left to the communication thread"
                );
                sent.wait().expect("send");
            }
        } else {
            std::thread::sleep(Duration::from_millis(200));
            for k in 1..4 {
                let got = w.recv(peer, &shape, DType::F32).expect("recv");
                assert_close(&to_f64(&got), &want(k), 0.0, &format!("message {k}"));
            }
        }
        w.barrier().expect("barrier");
    });
}

/// `sends_complete_locally`: on the CPU backend a send's `Work` completes before the receiver
/// posts anything, here three of the pipeline's activation size (128 KiB) waited one by one while
/// rank 1 has not reached its receives (it waits on a barrier of another group, which rank 0
/// joins only after them).
#[test]
fn cpu_sends_complete_before_the_receiver_posts() {
    run_local(2, T, |b| {
        let (w, side) = (b.world(), b.new_group(&[0, 1], "side").expect("group"));
        assert!(w.sends_complete_locally());
        let shape = Shape::from((128, 256));
        if w.rank() == 0 {
            for k in 0..3 {
                let x = input(k, 128, 256, 0, DType::F32);
                w.send_async(&x, 1).wait().expect("send");
            }
            side.barrier().expect("barrier");
        } else {
            side.barrier().expect("barrier");
            for k in 0..3 {
                let got = w.recv(0, &shape, DType::F32).expect("recv");
                let want = to_f64(&input(k, 128, 256, 0, DType::F32));
                assert_close(&to_f64(&got), &want, 0.0, &format!("message {k}"));
            }
        }
    });
}

#[test]
fn non_contiguous_inputs_are_read_through_their_strides() {
    run_local(3, T, |b| {
        let w = b.world();
        let r = w.rank();
        let x = input(r, 3, 4, 0, DType::F32).t().expect("transpose"); // (4, 3), strided
        assert!(!x.is_contiguous());
        let got = w.all_reduce(&x, ReduceOp::Sum).expect("all_reduce");
        let want = (0..3)
            .map(|p| input(p, 3, 4, 0, DType::F32))
            .reduce(|a, b| (a + b).expect("add"))
            .expect("sum");
        assert_close(
            &to_f64(&got),
            &to_f64(&want.t().expect("t")),
            0.0,
            "strided all_reduce",
        );
        let got = w.all_gather(&x).expect("all_gather");
        assert_eq!(got.dims(), &[12, 3]);
        let want: Vec<f64> = (0..3)
            .flat_map(|p| to_f64(&input(p, 3, 4, 0, DType::F32).t().expect("t")))
            .collect();
        assert_close(&to_f64(&got), &want, 0.0, "strided all_gather");
    });
}

#[test]
fn ring_all_reduce_sends_2_n_minus_1_over_n_of_the_data() {
    for n in [2, 3, 4] {
        let opts = CpuOptions {
            timeout: T,
            trace: true,
            ..CpuOptions::default()
        };
        mtrain_comm::cpu::run_local_with(n, opts, |b| {
            let w = b.world();
            let len = 3 * 4 * 100_000; // divisible by every n, several segments per chunk
            let x = input(w.rank(), 1, len, 0, DType::F32)
                .reshape(len)
                .expect("1-d");
            w.tracer().clear();
            let _ = w.all_reduce(&x, ReduceOp::Sum).expect("all_reduce");
            let ev = w.tracer().events().pop().expect("one traced op");
            let s = (len * 4) as u64;
            assert_eq!(ev.bytes, s);
            assert_eq!(
                ev.bytes_sent,
                2 * (n as u64 - 1) * s / n as u64,
                "bytes sent by rank {} of {n}",
                w.rank()
            );
        });
    }
}

#[test]
fn async_all_reduce_overlaps_compute() {
    let opts = CpuOptions {
        timeout: T,
        trace: true,
        ..CpuOptions::default()
    };
    mtrain_comm::cpu::run_local_with(2, opts, |b| {
        let w = b.world();
        let x = input(w.rank(), 1, 4_000_000, 0, DType::F32); // 16 MB
        let a = Tensor::ones((64, 64), DType::F32, &Device::Cpu).expect("a");
        let issued = w.tracer().now_us();
        let work = w.all_reduce_async(&x, ReduceOp::Sum);
        let mut compute_ends = Vec::new();
        let mut acc = a.clone();
        while !work.is_done() {
            acc = (acc.matmul(&a).expect("matmul") / 64.0).expect("scale");
            compute_ends.push(w.tracer().now_us());
        }
        let got = work.wait().expect("all_reduce");
        assert_eq!(got.dims(), x.dims());
        let ev = w.tracer().events().pop().expect("traced op");
        assert!(ev.start_us >= issued);
        // Several compute steps finished while the op was still in flight.
        let during = compute_ends.iter().filter(|t| **t < ev.end_us).count();
        assert!(
            during >= 2,
            "only {during} compute steps ran while the all_reduce was in flight"
        );
    });
}

/// The running totals a step's figures are read from: an op waited for while its peer is late
/// counts as blocked on the early rank (about the delay), an op already finished when waited for
/// adds nothing, and blocked time stays within busy time.
#[test]
fn trace_totals_count_busy_and_blocked_time() {
    let opts = CpuOptions {
        timeout: T,
        trace: false,
        ..CpuOptions::default()
    };
    let delay = Duration::from_millis(80);
    mtrain_comm::cpu::run_local_with(2, opts, |b| {
        let w = b.world();
        let x = input(w.rank(), 1, 1000, 0, DType::F32);
        let before = w.tracer().totals();
        // Rank 1 arrives late: rank 0 blocks for about the delay.
        if w.rank() == 1 {
            std::thread::sleep(delay);
        }
        w.all_reduce(&x, ReduceOp::Sum).expect("all_reduce");
        let late = w.tracer().totals() - before;
        assert_eq!(late.ops, 1);
        assert_eq!(late.bytes, 4000);
        assert!(late.blocked_us <= late.busy_us, "{late:?}");
        if w.rank() == 0 {
            assert!(late.blocked_us >= 60_000, "rank 0 waited for the late peer: {late:?}");
        } else {
            assert!(late.blocked_us < 60_000, "rank 1 was the late one: {late:?}");
        }
        // Waited for only after it finished: busy, not blocked.
        let before = w.tracer().totals();
        let work = w.all_reduce_async(&x, ReduceOp::Sum);
        while !work.is_done() {
            std::thread::sleep(Duration::from_millis(1));
        }
        work.wait().expect("all_reduce");
        let hidden = w.tracer().totals() - before;
        assert_eq!(hidden.ops, 1);
        assert_eq!(hidden.blocked_us, 0, "{hidden:?}");
    });
}

#[test]
fn device_mesh_groups_reduce_over_the_right_ranks() {
    let dims = MeshDims::new(2, 2, 2, 2);
    run_local(8, T, |b| {
        let mesh = DeviceMesh::new(&b, dims).expect("mesh");
        let r = mesh.rank();
        assert_eq!(mesh.coords, dims.coords(r));
        for kind in GroupKind::ALL {
            let g: &Comm = mesh.group(kind);
            let members = dims.group_of(kind, r);
            assert_eq!(g.global_ranks(), members.as_slice(), "{kind:?}");
            let x = Tensor::new(&[r as i64], &Device::Cpu).expect("x");
            let got = g
                .all_reduce(&x, ReduceOp::Sum)
                .expect("all_reduce")
                .to_vec1::<i64>()
                .expect("vec");
            assert_eq!(
                got[0],
                members.iter().sum::<usize>() as i64,
                "{kind:?} sum on rank {r}"
            );
        }
        let err = DeviceMesh::new(&b, MeshDims::new(2, 2, 1, 1))
            .expect_err("4 != 8")
            .to_string();
        assert!(
            err.contains("dp(2) * pp(2) * tp(1) = 4 != world size 8"),
            "{err}"
        );
    });
}

#[test]
fn world_of_one_needs_no_network() {
    let start = Instant::now();
    let out = run_local(1, T, |b| {
        let w = b.world();
        let x = Tensor::new(&[1f32, 2.0], &Device::Cpu).expect("x");
        let y = w.all_reduce(&x, ReduceOp::Avg).expect("all_reduce");
        let g = b.new_group(&[0], "solo").expect("group of one");
        let z = g.all_gather(&x.unsqueeze(0).expect("2d")).expect("gather");
        (to_f64(&y), z.dims().to_vec())
    });
    assert_eq!(out, vec![(vec![1.0, 2.0], vec![1, 2])]);
    assert!(
        start.elapsed() < Duration::from_millis(500),
        "took {:?}",
        start.elapsed()
    );
}
