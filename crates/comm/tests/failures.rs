//! No silent hangs: mismatched collectives, a dead rank and a stalled rank all fail within the
//! group's timeout, with errors that name the op, group, sequence number and ranks.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Shape, Tensor};
use mtrain_comm::{run_local, Backend, CommError, ReduceOp};

/// Short timeout for failure tests; a test passing within it proves there was no hang.
const T: Duration = Duration::from_secs(2);

fn ones(len: usize) -> Tensor {
    Tensor::ones(len, DType::F32, &Device::Cpu).expect("ones")
}

#[test]
fn different_ops_give_mismatch_on_every_rank() {
    let start = Instant::now();
    let errs = run_local(3, T, |b| {
        let w = b.world();
        // A good op first, so the mismatch is at seq 1.
        w.all_reduce(&ones(4), ReduceOp::Sum)
            .expect("first op agrees");
        let (r, line) = if w.rank() == 2 {
            (w.all_gather(&ones(4)), line!())
        } else {
            (w.all_reduce(&ones(4), ReduceOp::Sum), line!())
        };
        let err = r.expect_err("mismatched collectives must fail");
        // The group is poisoned: later ops fail at once.
        let later = w.barrier().expect_err("poisoned group");
        assert!(matches!(later, CommError::Poisoned { .. }), "{later}");
        (err, line)
    });
    assert!(start.elapsed() < T, "took {:?}", start.elapsed());
    for (rank, (e, line)) in errs.iter().enumerate() {
        let msg = e.to_string();
        // Each rank names the line of its own call.
        let site = format!("issued at crates/comm/tests/failures.rs:{line}");
        assert!(msg.contains(&site), "rank {rank}: {msg}\nshould name: {site}");
        assert!(
            matches!(e, CommError::Mismatch { .. }),
            "rank {rank}: {msg}"
        );
        assert!(
            msg.contains("all_reduce(Sum) f32 [4] (seq 1)")
                && msg.contains("all_gather f32 [4] (seq 1)"),
            "rank {rank}: {msg}"
        );
        assert!(msg.contains("group 'world'"), "{msg}");
    }
}

#[test]
fn different_counts_give_mismatch_on_every_rank() {
    let errs = run_local(4, T, |b| {
        let w = b.world();
        let len = if w.rank() == 1 { 5 } else { 4 };
        let err = w.all_reduce(&ones(len), ReduceOp::Sum);
        (err.expect_err("mismatched counts must fail"), line!() - 1)
    });
    for (rank, (e, line)) in errs.iter().enumerate() {
        let msg = e.to_string();
        // Each rank names the line of its own call.
        let site = format!("issued at crates/comm/tests/failures.rs:{line}");
        assert!(msg.contains(&site), "rank {rank}: {msg}\nshould name: {site}");
        assert!(
            matches!(e, CommError::Mismatch { .. }),
            "rank {rank}: {msg}"
        );
        assert!(
            msg.contains("[5]") && msg.contains("[4]"),
            "rank {rank}: {msg}"
        );
    }
}

#[test]
fn all_to_all_with_inconsistent_splits_is_a_mismatch() {
    let errs = run_local(2, T, |b| {
        let w = b.world();
        // Rank 0 sends 2 rows to rank 1, but rank 1 expects 1.
        let (send, recv) = if w.rank() == 0 {
            ([1, 2], [1, 1])
        } else {
            ([1, 1], [1, 1])
        };
        let x =
            Tensor::zeros((send.iter().sum::<usize>(), 2), DType::F32, &Device::Cpu).expect("x");
        w.all_to_all(&x, &send, &recv).map(|_| ())
    });
    assert!(
        matches!(errs[0], Err(CommError::Mismatch { .. })),
        "{:?}",
        errs[0]
    );
    assert!(
        matches!(errs[1], Err(CommError::Mismatch { .. })),
        "{:?}",
        errs[1]
    );
}

#[test]
fn recv_checks_shape_and_dtype() {
    let out = run_local(2, T, |b| {
        let w = b.world();
        if w.rank() == 0 {
            w.send(
                &Tensor::zeros((2, 3), DType::F32, &Device::Cpu).expect("x"),
                1,
            )
            .map(|_| String::new())
        } else {
            w.recv(0, &Shape::from((3, 2)), DType::F32)
                .map(|_| String::new())
        }
    });
    let err = out[1]
        .as_ref()
        .expect_err("recv of the wrong shape")
        .to_string();
    assert!(
        err.contains("recv expecting send f32 [3, 2]") && err.contains("send f32 [2, 3]"),
        "{err}"
    );
}

#[test]
fn a_dead_rank_fails_the_others_within_the_timeout() {
    let start = Instant::now();
    let errs = run_local(3, T, |b| {
        if b.rank() == 2 {
            drop(b); // rank 2 exits without taking part
            return None;
        }
        let w = b.world();
        Some(
            w.all_reduce(&ones(1000), ReduceOp::Sum)
                .expect_err("rank 2 is gone"),
        )
    });
    assert!(
        start.elapsed() < T + Duration::from_secs(1),
        "took {:?}",
        start.elapsed()
    );
    for e in errs.iter().take(2).flatten() {
        let msg = e.to_string();
        assert!(
            matches!(
                e,
                CommError::PeerClosed { peer: 2, .. } | CommError::Timeout { peer: 2, .. }
            ),
            "{msg}"
        );
        assert!(
            msg.contains("all_reduce on group 'world' (seq 0)") && msg.contains("rank 2"),
            "{msg}"
        );
    }
}

#[test]
fn a_stalled_rank_times_out_naming_op_group_seq_peer_and_site() {
    let timeout = Duration::from_millis(500);
    let errs = run_local(3, timeout, |b| {
        let w = b.world();
        w.barrier().expect("everyone is here at first");
        if w.rank() == 1 {
            std::thread::sleep(timeout * 3); // stalls past the others' timeout
            return None;
        }
        let start = Instant::now();
        let e = w.broadcast(&ones(10), 0).expect_err("rank 1 stalls");
        Some((e, start.elapsed(), line!() - 1))
    });
    assert_eq!(errs.iter().flatten().count(), 2, "ranks 0 and 2 wait for rank 1");
    for (e, took, line) in errs.into_iter().flatten() {
        let msg = e.to_string();
        assert!(
            matches!(
                e,
                CommError::Timeout {
                    peer: 1,
                    seq: 1,
                    ..
                }
            ),
            "{msg}"
        );
        assert!(
            msg.contains("broadcast on group 'world' (seq 1) timed out after 500 ms"),
            "{msg}"
        );
        // Each waiting rank names the line that issued the op it waits in.
        let site = format!("issued at crates/comm/tests/failures.rs:{line}");
        assert!(msg.ends_with(&site), "{msg}\nshould end with: {site}");
        assert!(took < timeout * 2, "failed after {took:?}");
    }
}

#[test]
fn invalid_arguments_are_reported_by_name() {
    run_local(1, T, |b| {
        let w = b.world();
        let e = w
            .broadcast(&ones(3), 1)
            .expect_err("root 1 of a group of 1")
            .to_string();
        assert!(
            e.contains("root 1 is not a rank of this group of 1 ranks"),
            "{e}"
        );
        let e = b
            .new_group(&[0, 3], "bad")
            .expect_err("rank 3 does not exist")
            .to_string();
        assert!(e.contains("[0, 3]"), "{e}");
    });
}
