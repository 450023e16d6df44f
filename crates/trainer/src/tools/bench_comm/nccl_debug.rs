//! `bench-comm --nccl-debug`: which algorithm and protocol NCCL chose at each size.
//!
//! NCCL logs its choice per collective on rank 0 under `NCCL_DEBUG=INFO` with the `TUNING`
//! subsystem, in one of two forms depending on its version:
//!
//! ```text
//!   NCCL INFO AllReduce: 4096 Bytes -> Algo TREE proto LL channel{Lo..Hi}={0..1}    (2.19 on)
//!   NCCL INFO 4096 Bytes -> Algo 0 proto 0 time 12.500000                          (before)
//! ```
//!
//! (numbered: algorithms 0 Tree, 1 Ring, 2 CollNetDirect, 3 CollNetChain, 4 NVLS, 5 NVLSTree,
//! 6 PAT; protocols 0 LL, 1 LL128, 2 Simple). [`set_env`] turns the log on for this process
//! and the workers it launches, into a file per process (`NCCL_DEBUG_FILE`, `%p` the pid);
//! after the sweep rank 0 reads its own file and [`choices`] keeps one line per size.

use std::collections::BTreeMap;
use std::path::PathBuf;

/// The log file of the process with `pid`, under the pattern [`set_env`] sets.
pub fn log_path(pid: u32) -> PathBuf {
    std::env::temp_dir().join(format!("mtrain-nccl-debug.{pid}.log"))
}

/// Turn on NCCL's tuning log for this process and those it starts (read by NCCL at init).
pub fn set_env() {
    let pattern = std::env::temp_dir().join("mtrain-nccl-debug.%p.log");
    std::env::set_var("NCCL_DEBUG", "INFO");
    std::env::set_var("NCCL_DEBUG_SUBSYS", "TUNING");
    std::env::set_var("NCCL_DEBUG_FILE", pattern);
}

/// The algorithm and protocol NCCL chose per message size (bytes), from its log: the last
/// choice logged for each size.
pub fn choices(log: &str) -> BTreeMap<u64, (String, String)> {
    const ALGOS: [&str; 7] = [
        "Tree",
        "Ring",
        "CollNetDirect",
        "CollNetChain",
        "NVLS",
        "NVLSTree",
        "PAT",
    ];
    const PROTOS: [&str; 3] = ["LL", "LL128", "Simple"];
    let named = |table: &[&str], w: &str| match w.parse::<usize>() {
        Ok(i) => table
            .get(i)
            .map_or_else(|| w.to_string(), |s| s.to_string()),
        Err(_) => w.to_string(),
    };
    let mut out = BTreeMap::new();
    for line in log.lines() {
        let Some(at) = line.find(" Bytes -> Algo ") else {
            continue;
        };
        let Some(bytes) = line[..at]
            .split([' ', ':'])
            .next_back()
            .and_then(|w| w.parse().ok())
        else {
            continue;
        };
        let rest: Vec<&str> = line[at + " Bytes -> Algo ".len()..]
            .split_whitespace()
            .collect();
        if let [algo, "proto", proto, ..] = rest[..] {
            out.insert(bytes, (named(&ALGOS, algo), named(&PROTOS, proto)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_forms_of_the_log_line_are_read() {
        let log = "host:1:1 [0] NCCL INFO AllReduce: 4096 Bytes -> Algo TREE proto LL channel{Lo..Hi}={0..1}\n\
                   host:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM\n\
                   host:1:1 [0] NCCL INFO 8388608 Bytes -> Algo 1 proto 2 time 50.000000\n\
                   host:1:1 [0] NCCL INFO AllReduce: 4096 Bytes -> Algo TREE proto LL channel{Lo..Hi}={0..1}\n";
        let c = choices(log);
        assert_eq!(c.len(), 2);
        assert_eq!(c[&4096], ("TREE".to_string(), "LL".to_string()));
        assert_eq!(c[&8388608], ("Ring".to_string(), "Simple".to_string()));
    }
}
