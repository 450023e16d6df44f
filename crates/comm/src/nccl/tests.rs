//! These tests need a CUDA GPU: `scripts/gpu-test.sh` runs them on one. One GPU checks every
//! collective of a group of one against its closed form and the stream ordering; two or more
//! GPUs (one thread per GPU) check the multi-rank closed forms, uneven splits included.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::CudaContext;
use candle_core::{DType, Device, Shape, Tensor};

use super::collectives::pad_chunks;
use super::{IdExchange, InProcessExchange, NcclBackend, NcclOptions};
use crate::communicator::{chunk_range, Backend, OpKind, ReduceOp};

fn gpu(ordinal: usize) -> Device {
    Device::new_cuda(ordinal).expect("these tests need a CUDA GPU")
}

fn single() -> NcclBackend {
    NcclBackend::new(gpu(0), 0, 1, None, NcclOptions::default()).expect("NCCL world of one")
}

fn host(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

#[test]
fn nccl_is_loaded() {
    let v = NcclBackend::nccl_version().unwrap();
    assert!(
        v >= 21000,
        "NCCL {v} is older than 2.10 (ncclAvg needs 2.10)"
    );
}

#[test]
fn group_of_one_runs_every_collective() {
    let backend = single();
    let g = backend.world();
    let dev = backend.device();
    assert_eq!(
        (g.rank(), g.size(), g.global_ranks()),
        (0, 1, &[0usize][..])
    );
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        // (7, 3): 7 rows do not split evenly, so shapes are not trivially square.
        let x = Tensor::arange(0f32, 21., &dev)
            .unwrap()
            .reshape((7, 3))
            .unwrap();
        let x = x.to_dtype(dtype).unwrap();
        let want = host(&x);
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            assert_eq!(
                host(&g.all_reduce(&x, op).unwrap()),
                want,
                "all_reduce {op:?} {dtype:?}"
            );
            assert_eq!(
                host(&g.reduce(&x, 0, op).unwrap()),
                want,
                "reduce {op:?} {dtype:?}"
            );
            assert_eq!(
                host(&g.reduce_scatter(&x, op).unwrap()),
                want,
                "reduce_scatter {op:?}"
            );
        }
        assert_eq!(
            host(&g.broadcast(&x, 0).unwrap()),
            want,
            "broadcast {dtype:?}"
        );
        let ag = g.all_gather(&x).unwrap();
        assert_eq!(
            (ag.dims(), host(&ag)),
            (&[7usize, 3][..], want.clone()),
            "all_gather"
        );
        assert_eq!(host(&g.scatter(&x, 0).unwrap()), want, "scatter {dtype:?}");
        assert_eq!(host(&g.gather(&x, 0).unwrap()), want, "gather {dtype:?}");
        assert_eq!(
            host(&g.all_to_all(&x, &[7], &[7]).unwrap()),
            want,
            "all_to_all"
        );
        g.barrier().unwrap();
    }
    // Integer dtypes reduce exactly.
    let xi = Tensor::new(&[[1u32, 2], [3, 4]], &dev).unwrap();
    let yi = g.all_reduce(&xi, ReduceOp::Sum).unwrap();
    assert_eq!(yi.to_vec2::<u32>().unwrap(), vec![vec![1, 2], vec![3, 4]]);
    let xl = Tensor::new(&[-5i64, 1 << 40], &dev).unwrap();
    assert_eq!(
        g.all_reduce(&xl, ReduceOp::Max)
            .unwrap()
            .to_vec1::<i64>()
            .unwrap(),
        vec![-5, 1 << 40]
    );
}

#[test]
fn bad_arguments_are_named() {
    let backend = single();
    let g = backend.world();
    let x = Tensor::zeros((4, 2), DType::F32, &backend.device()).unwrap();
    let e = g.broadcast(&x, 3).unwrap_err().to_string();
    assert!(e.contains("root 3") && e.contains("world"), "{e}");
    let e = g.all_to_all(&x, &[3], &[4]).unwrap_err().to_string();
    assert!(e.contains("[3]") && e.contains("4 input rows"), "{e}");
    let cpu = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
    let e = g.all_reduce(&cpu, ReduceOp::Sum).unwrap_err().to_string();
    assert!(e.contains("Cpu"), "{e}");
}

/// The collective sees what the compute stream wrote just before it, and compute issued
/// after `wait()` sees the collective's result, with no host synchronisation in between.
#[test]
fn async_ops_are_ordered_against_the_compute_stream() {
    let backend = single();
    let g = backend.world();
    let dev = backend.device();
    let n = 1 << 24; // 64 MiB of f32: long enough for the streams to really run concurrently
    let a = Tensor::ones(n, DType::F32, &dev).unwrap();
    let mut expected = 1f32;
    let mut x = a.clone();
    for step in 0..5 {
        x = ((x * 3.0).unwrap() - 1.0).unwrap(); // written on the compute stream
        expected = expected * 3.0 - 1.0;
        let work = g.all_reduce_async(&x, ReduceOp::Sum);
        // Compute issued while the op is in flight.
        let busy = a.affine(2.0, 0.5).unwrap();
        x = work.wait().unwrap();
        let got = x.sum_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(got, expected * n as f32, "step {step}");
        assert_eq!(busy.max(0).unwrap().to_scalar::<f32>().unwrap(), 2.5);
    }
    let t = g.tracer();
    t.set_recording(true);
    let w = g.all_gather_async(&x);
    assert_eq!(w.wait().unwrap().dims(), &[n]);
    let ev = t.events();
    assert_eq!(ev.len(), 1);
    assert_eq!((ev[0].op, ev[0].bytes), (OpKind::AllGather, 4 * n as u64));
    assert!(ev[0].end_us >= ev[0].start_us);
}

#[test]
fn padding_puts_each_chunk_at_a_multiple_of_the_chunk_size() {
    let x = Tensor::arange(0f32, 7., &Device::Cpu)
        .unwrap()
        .reshape((7, 1))
        .unwrap();
    let p = pad_chunks(&x, 3).unwrap(); // chunks 3, 2, 2 -> rows of 3 each
    assert_eq!(
        p.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        vec![0., 1., 2., 3., 4., 0., 5., 6., 0.]
    );
}

/// Every GPU of the machine is a rank (one thread each). Needs two or more GPUs, so it is run
/// on request (`--include-ignored`, as scripts/gpu-test.sh does on such a machine); with fewer
/// it fails, naming how many it found.
#[test]
#[ignore = "needs 2 or more CUDA GPUs: run with --include-ignored on such a machine"]
fn ranks_on_several_gpus_match_closed_forms() {
    let n = CudaContext::device_count().unwrap_or(0) as usize;
    assert!(n >= 2, "the multi-rank test needs 2 or more CUDA GPUs; {n} visible");
    let exchange: Arc<dyn IdExchange> = Arc::new(InProcessExchange::default());
    std::thread::scope(|s| {
        for r in 0..n {
            let exchange = exchange.clone();
            s.spawn(move || {
                let b =
                    NcclBackend::new(gpu(r), r, n, Some(exchange), NcclOptions::default()).unwrap();
                let g = b.world();
                let dev = b.device();
                let rows = 2 * n + 1; // uneven over n ranks
                                      // Rank r holds r + 1 rows of value r (all_gather / gather: uneven counts).
                let mine = Tensor::full(r as f32, (r + 1, 2), &dev).unwrap();
                let want: Vec<f32> = (0..n).flat_map(|p| vec![p as f32; 2 * (p + 1)]).collect();
                assert_eq!(host(&g.all_gather(&mine).unwrap()), want, "all_gather");
                let gathered = g.gather(&mine, n - 1).unwrap();
                if r == n - 1 {
                    assert_eq!(host(&gathered), want, "gather");
                }
                let x = Tensor::arange(0f32, rows as f32, &dev)
                    .unwrap()
                    .affine(1.0, r as f64)
                    .unwrap();
                let sum: Vec<f32> = (0..rows)
                    .map(|i| (0..n).map(|p| (i + p) as f32).sum())
                    .collect();
                assert_eq!(
                    host(&g.all_reduce(&x, ReduceOp::Sum).unwrap()),
                    sum,
                    "all_reduce"
                );
                let c = chunk_range(rows, n, r);
                assert_eq!(
                    host(&g.reduce_scatter(&x, ReduceOp::Sum).unwrap()),
                    sum[c.clone()].to_vec()
                );
                let from_root: Vec<f32> = (0..rows).map(|i| i as f32).collect();
                assert_eq!(host(&g.broadcast(&x, 0).unwrap()), from_root, "broadcast");
                assert_eq!(
                    host(&g.scatter(&x, 0).unwrap()),
                    from_root[c].to_vec(),
                    "scatter"
                );
                // all_to_all: rank r sends p + 1 rows of value 10 r + p to rank p.
                let send: Vec<usize> = (0..n).map(|p| p + 1).collect();
                let recv = vec![r + 1; n];
                let parts: Vec<Tensor> = (0..n)
                    .map(|p| Tensor::full((10 * r + p) as f32, p + 1, &dev).unwrap())
                    .collect();
                let y = g
                    .all_to_all(&Tensor::cat(&parts, 0).unwrap(), &send, &recv)
                    .unwrap();
                let want: Vec<f32> = (0..n)
                    .flat_map(|p| vec![(10 * p + r) as f32; r + 1])
                    .collect();
                assert_eq!(host(&y), want, "all_to_all");
                // A ring of send/recv: even ranks send first, odd ranks receive first
                // (a send on the communication stream waits for its matching receive).
                let next = (r + 1) % n;
                let prev = (r + n - 1) % n;
                let token = Tensor::full(r as f32, 3, &dev).unwrap();
                let got = if r % 2 == 0 {
                    g.send(&token, next).unwrap();
                    g.recv(prev, &Shape::from(3), DType::F32).unwrap()
                } else {
                    let got = g.recv(prev, &Shape::from(3), DType::F32).unwrap();
                    g.send(&token, next).unwrap();
                    got
                };
                assert_eq!(host(&got), vec![prev as f32; 3], "send/recv");
                g.barrier().unwrap();
            });
        }
    });
}
