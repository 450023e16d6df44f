//! `bench-comm --nccl-debug` on two GPUs: NCCL's log is turned on for the ranks and rank 0
//! prints the algorithm and protocol NCCL chose at every size of the sweep; on the CPU device
//! the flag is refused, naming what it needs.

mod common;
use common::run_mtrain;

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs a CUDA device: build with --features cuda"
)]
fn nccl_debug_prints_the_choice_per_size() {
    let out = run_mtrain([
        "--nproc-per-node",
        "2",
        "bench-comm",
        "--device",
        "cuda",
        "-b",
        "8",
        "-e",
        "8M",
        "-f",
        "16",
        "-n",
        "2",
        "-w",
        "1",
        "--nccl-debug",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("# NCCL's choice per size"), "{text}");
    for size in [8u64, 128, 2048, 32768, 524288, 8388608] {
        assert!(
            text.contains(&format!("{size:>12} B: algorithm ")),
            "no choice for {size} B in\n{text}"
        );
    }
}

#[test]
fn nccl_debug_on_the_cpu_device_is_refused() {
    let out = run_mtrain(["bench-comm", "-e", "8", "--nccl-debug"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("--nccl-debug needs --device cuda"), "{err}");
}
