//! Training with each all-reduce algorithm of the CPU backend (`--algo`) equals one rank
//! (`mtrain parity`, loss and gradient norm within 1e-5 over 5 steps), on a power of two and
//! off one; `--algo` on NCCL is refused, naming what it applies to.

mod common;
use common::{run_mtrain, text};

fn parity(vs: &str) {
    common::parity(&[], vs);
}

#[test]
fn every_algorithm_trains_like_one_rank() {
    for vs in [
        "--dp 3 --algo tree",
        "--dp 4 --algo rhd",
        "--dp 3 --algo rhd",
        "--dp 2 --algo auto",
    ] {
        parity(vs);
    }
}

#[test]
fn algo_on_gpus_is_refused() {
    let o = run_mtrain(["plan", "--dp", "2", "--device", "cuda", "--algo", "tree"]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(
        t.contains("--algo tree applies to the CPU backend only"),
        "{t}"
    );
}
