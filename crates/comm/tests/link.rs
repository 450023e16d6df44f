//! The link emulator: a message, and a ring all-reduce, take α + bytes/β per message on the
//! emulated wire (never less, and within a margin far below the emulated time), the wait is a
//! sleep that leaves the cores free, and compute issued after an async op overlaps its wire
//! time so that its `wait()` counts only what is left as exposed.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use mtrain_comm::cpu::{run_local_with, CpuOptions, LinkEmulator};
use mtrain_comm::{Backend, ReduceOp};

const T: Duration = Duration::from_secs(60);

/// 10 ms per message and 100 MB/s: a 2 MB message takes 30 ms, far above the scheduling noise
/// of a busy machine (a few ms).
fn slow_link() -> CpuOptions {
    CpuOptions {
        timeout: T,
        link: Some(LinkEmulator::new(10_000.0, 0.1).expect("link")),
        ..CpuOptions::default()
    }
}

const ELEMS: usize = 500_000; // 2 MB of f32
const MARGIN: Duration = Duration::from_millis(15);

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// CPU time this process has used so far.
fn process_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[test]
fn a_message_takes_alpha_plus_bytes_over_beta() {
    let expected = Duration::from_millis(30);
    let times = run_local_with(2, slow_link(), |b| {
        let w = b.world();
        let x = Tensor::ones(ELEMS, DType::F32, &Device::Cpu).expect("tensor");
        let mut took = Vec::new();
        for _ in 0..5 {
            w.barrier().expect("barrier");
            if w.rank() == 0 {
                w.send(&x, 1).expect("send");
            } else {
                let t0 = Instant::now();
                let y = w.recv(0, x.shape(), DType::F32).expect("recv");
                took.push(t0.elapsed());
                assert_eq!(y.dims(), &[ELEMS]);
            }
        }
        took
    });
    for t in &times[1] {
        assert!(
            *t >= expected,
            "a 2 MB message arrived in {t:?}, before α + B/β = {expected:?}"
        );
    }
    let m = median(times[1].clone());
    assert!(
        m < expected + MARGIN,
        "median {m:?} is not α + B/β = {expected:?} (± {MARGIN:?})"
    );
}

#[test]
fn a_ring_all_reduce_takes_its_steps_on_the_wire_not_on_a_core() {
    // 2 ranks: 2 steps of a 1 MB half, 10 ms + 10 ms each.
    let expected = Duration::from_millis(40);
    let out = run_local_with(2, slow_link(), |b| {
        let w = b.world();
        let x = Tensor::ones(ELEMS, DType::F32, &Device::Cpu).expect("tensor");
        let mut took = Vec::new();
        let mut cpu = Vec::new();
        for _ in 0..5 {
            w.barrier().expect("barrier");
            let (t0, c0) = (Instant::now(), process_cpu_time());
            let y = w.all_reduce(&x, ReduceOp::Sum).expect("all-reduce");
            took.push(t0.elapsed());
            cpu.push(process_cpu_time() - c0);
            let s: f32 = y.sum_all().and_then(|s| s.to_scalar()).expect("sum");
            assert_eq!(s, 2.0 * ELEMS as f32);
        }
        (took, cpu)
    });
    for (took, cpu) in out {
        assert!(
            took.iter().all(|t| *t >= expected),
            "{took:?} below {expected:?}"
        );
        let m = median(took);
        assert!(
            m < expected + MARGIN,
            "median {m:?} is not {expected:?} (± {MARGIN:?})"
        );
        // Both ranks of the process together burn far less than the wire time.
        let c = median(cpu);
        assert!(
            c < expected / 2,
            "the emulated wire used {c:?} of CPU for {expected:?}"
        );
    }
}

#[test]
fn compute_after_an_async_op_hides_its_wire_time() {
    let out = run_local_with(2, slow_link(), |b| {
        let w = b.world();
        let x = Tensor::ones(ELEMS, DType::F32, &Device::Cpu).expect("tensor");
        w.barrier().expect("barrier");
        let before = w.tracer().totals().blocked_us;
        let work = w.all_reduce_async(&x, ReduceOp::Sum);
        std::thread::sleep(Duration::from_millis(30)); // "compute": 30 of the 40 ms
        work.wait().expect("all-reduce");
        Duration::from_micros(w.tracer().totals().blocked_us - before)
    });
    for exposed in out {
        // 40 ms on the wire, 30 ms of it hidden: about 10 ms exposed.
        assert!(
            exposed < Duration::from_millis(10) + MARGIN,
            "exposed {exposed:?}"
        );
    }
}
