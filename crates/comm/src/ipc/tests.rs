//! The IPC backend against the CPU backend, ranks as processes on the first GPU (without one
//! the tests fail): worlds of 2, 4 and 8. Each launcher test starts its ranks as copies of this
//! test binary running `ipc::tests::worker` with a launch environment; the worker compares
//! every op with the CPU backend's result on the same host values and exits non-zero on any
//! difference.
//!
//! Values are small integers, exact in bf16 and in any order of summation, so sum, max and
//! min must equal bit for bit; avg (a division) is compared within one bf16 ulp (2^-8 relative)
//! or 1e-6 relative in f32.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Shape, Tensor};

use super::{IpcBackend, IpcGroup, IpcOptions};
use crate::communicator::{Backend, Comm, ReduceOp};
use crate::cpu::CpuOptions;
use crate::env::LaunchEnv;

const WORKER: &str = "MTRAIN_IPC_TEST_WORKER";

/// The first GPU; without one the test fails, naming what is missing (a build with the `cuda`
/// feature runs these tests, and they never pass untested).
fn gpu() -> Device {
    Device::new_cuda(0).unwrap_or_else(|e| {
        panic!("the IPC backend's tests need a CUDA device and none could be opened (a GPU visible through CUDA_VISIBLE_DEVICES, its driver): {e}")
    })
}

/// Run `world` ranks of `worker` with `extra` environment; (exit ok, output) per rank.
fn launch(world: usize, mode: &str, extra: &[(&str, &str)]) -> Vec<(bool, String)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..world)
        .map(|r| {
            let mut c = Command::new(&exe);
            c.args([
                "ipc::tests::worker",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(WORKER, mode)
            .env("RANK", r.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("MTRAIN_JOB_ID", format!("ipc-test-{port}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
            for (k, v) in extra {
                c.env(k, v);
            }
            c.spawn().unwrap()
        })
        .collect();
    children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            (out.status.success(), text)
        })
        .collect()
}

fn check_all(world: usize, wait: &str) {
    gpu(); // here, before any rank starts: no GPU fails the test
    let t = Instant::now();
    let runs = launch(world, "check", &[("MTRAIN_IPC_WAIT", wait)]);
    for (r, (ok, text)) in runs.iter().enumerate() {
        eprintln!("--- rank {r} ---\n{text}");
        assert!(ok, "rank {r} of {world} failed");
    }
    eprintln!(
        "world {world} ({wait} waits): every op equal in {:.1} s",
        t.elapsed().as_secs_f64()
    );
}

#[test]
fn ipc_ops_equal_the_cpu_backend_world_2() {
    check_all(2, "stream");
}

#[test]
fn ipc_ops_equal_the_cpu_backend_world_4() {
    check_all(4, "stream");
}

/// The largest group (`MAX_WORLD` ranks, every column of the flag table and of the kernels'
/// pointer table in use). Run alone: eight contexts time-share the GPU.
#[test]
fn ipc_ops_equal_the_cpu_backend_world_8() {
    check_all(super::protocol::MAX_WORLD, "stream");
}

#[test]
fn ipc_ops_equal_the_cpu_backend_world_2_kernel_waits() {
    check_all(2, "kernel");
}

/// A rank that exits before an all-reduce: the other fails within the timeout, naming the op
/// and the peer.
#[test]
fn a_dead_rank_ends_the_op_within_the_timeout() {
    gpu(); // here, before any rank starts: no GPU fails the test
    let t = Instant::now();
    let runs = launch(2, "dead", &[]);
    let took = t.elapsed();
    eprintln!("--- rank 0 ---\n{}", runs[0].1);
    assert!(!runs[0].0, "rank 0 should fail");
    assert!(runs[0].1.contains("all_reduce"), "{}", runs[0].1);
    assert!(runs[0].1.contains("waiting for rank 1"), "{}", runs[0].1);
    assert!(took < Duration::from_secs(30), "took {took:?}");
}

/// The worker: does nothing unless started by a launcher test.
#[test]
fn worker() {
    let Ok(mode) = std::env::var(WORKER) else {
        return;
    };
    let env = LaunchEnv::from_env().unwrap().unwrap();
    let dev = gpu();
    match mode.as_str() {
        "check" => check_worker(&env, &dev),
        "dead" => dead_worker(&env, &dev),
        other => panic!("unknown worker mode {other}"),
    }
}

fn dead_worker(env: &LaunchEnv, dev: &Device) {
    let cpu = CpuOptions {
        timeout: Duration::from_secs(3),
        trace: false,
        ..CpuOptions::default()
    };
    let opts = IpcOptions::from_env(Duration::from_secs(3)).unwrap();
    let b = IpcBackend::init(env, dev.clone(), cpu, opts).unwrap();
    let w = b.world();
    let x = Tensor::ones(1000, DType::F32, dev).unwrap();
    w.all_reduce(&x, ReduceOp::Sum).unwrap();
    if env.rank == 1 {
        std::process::exit(0);
    }
    // This all-reduce waits for rank 1 forever; the barrier after it (which blocks the host)
    // reports the watchdog's verdict.
    let _y = w.all_reduce(&x, ReduceOp::Sum).unwrap();
    let e = w.barrier().unwrap_err();
    eprintln!("error: {e}");
    std::process::exit(1);
}

/// Host values of rank `r`: small integers.
fn values(n: usize, r: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7 + r * 13 + salt * 5) % 11) as f32) - 5.0)
        .collect()
}

fn host(n: usize, r: usize, salt: usize, dims: &[usize], dtype: DType) -> Tensor {
    Tensor::from_vec(values(n, r, salt), dims, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

struct Checker {
    wrong: Vec<String>,
    checked: usize,
}

impl Checker {
    fn same(&mut self, what: &str, got: &Tensor, want: &Tensor, rel: f32) {
        self.checked += 1;
        if got.dims() != want.dims() {
            self.wrong.push(format!(
                "{what}: shape {:?} against {:?}",
                got.dims(),
                want.dims()
            ));
            return;
        }
        let g: Vec<f32> = got
            .to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let w: Vec<f32> = want
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let bad = g
            .iter()
            .zip(&w)
            .enumerate()
            .filter(|(_, (a, b))| (*a - *b).abs() > rel * b.abs())
            .map(|(i, (a, b))| (i, *a, *b))
            .collect::<Vec<_>>();
        if let Some(first) = bad.first() {
            self.wrong.push(format!(
                "{what}: {} of {} elements differ, first at {} ({} against {})",
                bad.len(),
                w.len(),
                first.0,
                first.1,
                first.2
            ));
        }
    }
}

fn check_worker(env: &LaunchEnv, dev: &Device) {
    let cpu_opts = CpuOptions {
        timeout: Duration::from_secs(120),
        trace: false,
        ..CpuOptions::default()
    };
    let opts = IpcOptions::from_env(Duration::from_secs(120)).unwrap();
    eprintln!("waits: {:?}", opts.wait);
    let b = IpcBackend::init(env, dev.clone(), cpu_opts, opts.clone()).unwrap();
    let ipc = b.world();
    let cpu = b.host_world();
    // Groups that always run one algorithm, over the same host group.
    let algo = |max: usize, key: &str| -> Comm {
        let o = IpcOptions {
            one_shot_max: max,
            ..opts.clone()
        };
        Arc::new(IpcGroup::new(cpu.clone(), b.store(), key.into(), dev, o).unwrap())
    };
    let one_shot = algo(usize::MAX, "one-shot");
    let two_shot = algo(0, "two-shot");
    let (n, r) = (ipc.size(), ipc.rank());
    let mut c = Checker {
        wrong: vec![],
        checked: 0,
    };
    let on = |t: &Tensor| t.to_device(dev).unwrap();
    let counts = [1usize, 2, 3, 7, 31, 1000, 4097, 65537, (1 << 20) + 3];
    let t0 = Instant::now();
    for dtype in [DType::F32, DType::BF16] {
        let tol_avg = if dtype == DType::BF16 {
            1.0 / 256.0
        } else {
            1e-6
        };
        let mut big = counts.to_vec();
        big.push(1 << 26);
        for &count in &big {
            let x = host(count, r, 0, &[count], dtype);
            let xd = on(&x);
            let want = cpu.all_reduce(&x, ReduceOp::Sum).unwrap();
            for (name, g) in [
                ("default", &ipc),
                ("one-shot", &one_shot),
                ("two-shot", &two_shot),
            ] {
                let got = g.all_reduce(&xd, ReduceOp::Sum).unwrap();
                c.same(
                    &format!("all_reduce {name} sum {dtype:?} {count}"),
                    &got,
                    &want,
                    0.0,
                );
            }
            if count > 1 << 20 {
                continue;
            }
            for (op, tol) in [
                (ReduceOp::Max, 0.0),
                (ReduceOp::Min, 0.0),
                (ReduceOp::Avg, tol_avg),
            ] {
                let want = cpu.all_reduce(&x, op).unwrap();
                for (name, g) in [("one-shot", &one_shot), ("two-shot", &two_shot)] {
                    let got = g.all_reduce(&xd, op).unwrap();
                    c.same(
                        &format!("all_reduce {name} {op:?} {dtype:?} {count}"),
                        &got,
                        &want,
                        tol,
                    );
                }
            }
            // In place: the tensor itself holds the sum.
            let xi = on(&x);
            ipc.all_reduce_in_place(&xi, ReduceOp::Sum).unwrap();
            let want = cpu.all_reduce(&x, ReduceOp::Sum).unwrap();
            c.same(
                &format!("all_reduce_in_place {dtype:?} {count}"),
                &xi,
                &want,
                0.0,
            );

            // Rows of 3 elements; uneven row counts per rank for the gathers.
            let rows = count;
            let x2 = host(rows * 3, r, 1, &[rows, 3], dtype);
            let x2d = on(&x2);
            let want = cpu.reduce_scatter(&x2, ReduceOp::Sum).unwrap();
            c.same(
                &format!("reduce_scatter {dtype:?} {rows}x3"),
                &ipc.reduce_scatter(&x2d, ReduceOp::Sum).unwrap(),
                &want,
                0.0,
            );
            let mine = rows + r;
            let x3 = host(mine * 3, r, 2, &[mine, 3], dtype);
            let want = cpu.all_gather(&x3).unwrap();
            c.same(
                &format!("all_gather {dtype:?} {mine}x3"),
                &ipc.all_gather(&on(&x3)).unwrap(),
                &want,
                0.0,
            );
            let root = 1 % n;
            let want = cpu.broadcast(&x2, root).unwrap();
            c.same(
                &format!("broadcast {dtype:?} {rows}x3"),
                &ipc.broadcast(&x2d, root).unwrap(),
                &want,
                0.0,
            );
            let want = cpu.reduce(&x2, root, ReduceOp::Sum).unwrap();
            c.same(
                &format!("reduce {dtype:?} {rows}x3"),
                &ipc.reduce(&x2d, root, ReduceOp::Sum).unwrap(),
                &want,
                0.0,
            );
            let want = cpu.gather(&x3, root).unwrap();
            c.same(
                &format!("gather {dtype:?} {mine}x3"),
                &ipc.gather(&on(&x3), root).unwrap(),
                &want,
                0.0,
            );
            let want = cpu.scatter(&x2, root).unwrap();
            c.same(
                &format!("scatter {dtype:?} {rows}x3"),
                &ipc.scatter(&x2d, root).unwrap(),
                &want,
                0.0,
            );
            // All-to-all with uneven splits: (r + p + count) % 3 rows scaled by the count.
            let unit = count.div_ceil(16).max(1);
            let split = |from: usize, to: usize| ((from + to + count) % 3) * unit;
            let send: Vec<usize> = (0..n).map(|p| split(r, p)).collect();
            let recv: Vec<usize> = (0..n).map(|p| split(p, r)).collect();
            let srows: usize = send.iter().sum();
            let x4 = host(srows * 3, r, 3, &[srows, 3], dtype);
            let want = cpu.all_to_all(&x4, &send, &recv).unwrap();
            c.same(
                &format!("all_to_all {dtype:?} {send:?}"),
                &ipc.all_to_all(&on(&x4), &send, &recv).unwrap(),
                &want,
                0.0,
            );
            // Ring send/recv, both directions in flight.
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            let sent = ipc.send_async(&x2d, next);
            let got = ipc.recv(prev, &Shape::from((rows, 3)), dtype).unwrap();
            sent.wait().unwrap();
            let want = host(rows * 3, prev, 1, &[rows, 3], dtype);
            c.same(&format!("send/recv {dtype:?} {rows}x3"), &got, &want, 0.0);
            ipc.barrier().unwrap();
        }
    }
    // f64 and integer reductions go through the host group; the result is still on the GPU.
    for dtype in [DType::F64, DType::I64] {
        let x = host(1001, r, 4, &[1001], dtype);
        let want = cpu.all_reduce(&x, ReduceOp::Sum).unwrap();
        let got = ipc.all_reduce(&on(&x), ReduceOp::Sum).unwrap();
        c.checked += 1;
        if !got.device().same_device(dev) {
            c.wrong.push(format!(
                "all_reduce {dtype:?}: result on {:?}",
                got.device()
            ));
        }
        c.same(&format!("all_reduce {dtype:?} 1001"), &got, &want, 0.0);
    }
    eprintln!(
        "rank {r}: {} comparisons in {:.1} s, {} wrong",
        c.checked,
        t0.elapsed().as_secs_f64(),
        c.wrong.len()
    );
    for w in &c.wrong {
        eprintln!("WRONG {w}");
    }
    assert!(c.wrong.is_empty());
}
