//! `mtrain explain ring --ranks 4` (and `tree`, `rhd`): an all-reduce walked step by step, read
//! off the schedule the CPU backend runs (`mtrain_comm::cpu::schedule`), so the text is what
//! the ranks do.
//!
//! ```text
//! ring all-reduce over 4 ranks of S = 1048576 bytes (f32), cut into 4 chunks
//! reduce-scatter: 3 steps
//!   step 1: rank 0 sends chunk 3 to rank 1, which now holds the partial sum of ranks {0, 1}
//!   ...
//!   after reduce-scatter: rank 0 holds chunk 0 summed over all 4 ranks, ...
//!   each rank has sent 786432 bytes
//! ...
//! bytes each rank sent: 1572864 = 2(p-1)/p · S
//! ```
//!
//! What a rank holds is followed as a set of ranks per block: a reduce adds the sender's set
//! to the receiver's, a copy replaces it. Bytes are those of f32 elements cut as the backend
//! cuts them (`chunk_range`).

use std::fmt::Write as _;

use clap::{Args, ValueEnum};
use mtrain_comm::cpu::schedule::{block_range, Phase, Schedule};
use mtrain_comm::cpu::{all_reduce_schedule, TREE_PIECE_BYTES};
use mtrain_comm::AllReduceAlgo;

use super::bench_comm::parse_size;

/// The most ranks `explain` walks (its text grows as p²).
pub const MAX_RANKS: usize = 64;
/// The largest message `explain` counts the bytes of (1 TiB).
pub const MAX_SIZE: u64 = 1 << 40;

/// Options of `mtrain explain`.
#[derive(Debug, Clone, Args)]
pub struct ExplainArgs {
    /// The algorithm: ring, tree or rhd (recursive halving-doubling).
    #[arg(value_enum)]
    pub algo: ExplainAlgo,
    /// Ranks in the group (2 to 64).
    #[arg(long, default_value_t = 4)]
    pub ranks: usize,
    /// Bytes of the message (f32 elements); K, M, G suffixes are powers of 1024.
    #[arg(long, default_value = "1M", value_parser = parse_size, value_name = "SIZE")]
    pub size: u64,
}

/// The algorithms `explain` walks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExplainAlgo {
    Ring,
    Tree,
    Rhd,
}

impl ExplainAlgo {
    fn algo(self) -> AllReduceAlgo {
        match self {
            ExplainAlgo::Ring => AllReduceAlgo::Ring,
            ExplainAlgo::Tree => AllReduceAlgo::Tree,
            ExplainAlgo::Rhd => AllReduceAlgo::Rhd,
        }
    }
}

/// The text `mtrain explain` prints, or what was wrong with the arguments.
pub fn explain(args: &ExplainArgs) -> Result<String, String> {
    if !(2..=MAX_RANKS).contains(&args.ranks) {
        return Err(format!(
            "--ranks must be 2 to {MAX_RANKS}, got {}",
            args.ranks
        ));
    }
    if args.size > MAX_SIZE {
        return Err(format!("--size must be at most 1T ({MAX_SIZE} bytes), got {}", args.size));
    }
    if args.size == 0 || args.size % 4 != 0 {
        return Err(format!(
            "--size must be a positive whole number of f32 elements (a multiple of 4 bytes), got {}",
            args.size
        ));
    }
    let numel = usize::try_from(args.size / 4).map_err(|_| "--size is too large".to_string())?;
    Ok(render(
        &all_reduce_schedule(args.algo.algo(), args.ranks),
        numel,
    ))
}

/// A set of ranks as `{0, 1, 3}`.
fn set(ranks: &[usize]) -> String {
    let names: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    format!("{{{}}}", names.join(", "))
}

/// What the blocks of a transfer are called.
fn blocks_name(s: &Schedule, b: &std::ops::Range<usize>) -> String {
    match (s.blocks, b.len()) {
        (1, _) => "the whole message".into(),
        (_, 1) if s.algo == AllReduceAlgo::Ring => format!("chunk {}", b.start),
        (_, 1) => format!("block {}", b.start),
        _ if b.len() == s.blocks => "all blocks".into(),
        _ => format!("blocks {}..{}", b.start, b.end - 1),
    }
}

/// The walk of `s` over a message of `numel` f32 elements.
pub fn render(s: &Schedule, numel: usize) -> String {
    let (p, bytes) = (s.ranks, numel as u64 * 4);
    let elem_bytes = |b: &std::ops::Range<usize>| block_range(numel, s.blocks, b).len() as u64 * 4;
    let all: Vec<usize> = (0..p).collect();
    let mut held: Vec<Vec<Vec<usize>>> = (0..p).map(|r| vec![vec![r]; s.blocks]).collect();
    let mut sent = vec![0u64; p];
    let mut out = String::new();
    let unit = match (s.algo, s.blocks) {
        (AllReduceAlgo::Ring, b) => format!("cut into {b} chunks"),
        (_, 1) => format!(
            "moved whole, in pipelined pieces of {TREE_PIECE_BYTES} bytes ({} here)",
            bytes.div_ceil(TREE_PIECE_BYTES as u64)
        ),
        (_, b) => format!("cut into {b} blocks"),
    };
    let _ = writeln!(
        out,
        "{} all-reduce over {p} ranks of S = {bytes} bytes (f32), {unit}",
        s.algo
    );
    let _ = writeln!(
        out,
        "(the transfers of a step run at once; \"now holds\" is after the step)"
    );
    for phase in s.steps.chunk_by(|a, b| a.phase == b.phase) {
        let name = phase[0].phase.name();
        let _ = writeln!(
            out,
            "{name}: {} step{}",
            phase.len(),
            if phase.len() == 1 { "" } else { "s" }
        );
        for (i, step) in phase.iter().enumerate() {
            let before = held.clone();
            for t in &step.transfers {
                for b in t.blocks.clone() {
                    let theirs = before[t.from][b].clone();
                    let mine = &mut held[t.to][b];
                    match t.reduce {
                        true => {
                            mine.extend(theirs);
                            mine.sort();
                        }
                        false => *mine = theirs,
                    }
                }
                sent[t.from] += elem_bytes(&t.blocks);
            }
            for t in &step.transfers {
                let now = &held[t.to][t.blocks.start];
                let what = match (now == &all, t.reduce) {
                    (true, _) => "the sum over all ranks".to_string(),
                    (false, true) => format!("the partial sum of ranks {}", set(now)),
                    (false, false) => format!("the values of ranks {}", set(now)),
                };
                let _ = writeln!(
                    out,
                    "  step {}: rank {} sends {} to rank {}, which now holds {what} there",
                    i + 1,
                    t.from,
                    blocks_name(s, &t.blocks),
                    t.to
                );
            }
        }
        if phase[0].phase == Phase::ReduceScatter {
            let mut complete = Vec::new();
            for (r, blocks) in held.iter().enumerate() {
                let done: Vec<String> = (0..s.blocks)
                    .filter(|&b| {
                        blocks[b] == all && block_range(numel, s.blocks, &(b..b + 1)).len() > 0
                    })
                    .map(|b| blocks_name(s, &(b..b + 1)))
                    .collect();
                if !done.is_empty() {
                    complete.push(format!("rank {r}: {}", done.join(", ")));
                }
            }
            let _ = writeln!(
                out,
                "  after {name}, summed over all {p} ranks: {}",
                complete.join("; ")
            );
        }
        let per_rank: Vec<String> = sent.iter().map(|b| b.to_string()).collect();
        let _ = writeln!(
            out,
            "  bytes each rank has sent so far: [{}]",
            per_rank.join(", ")
        );
    }
    let done = held.iter().all(|r| r.iter().all(|b| b == &all));
    let _ = writeln!(
        out,
        "result: {}",
        match done {
            true => "every rank holds every block summed over all ranks",
            false => "INCOMPLETE: some rank lacks a block's full sum",
        }
    );
    let formula = match s.algo {
        AllReduceAlgo::Ring => format!("2(p-1)/p · S = {}", 2 * (p as u64 - 1) * bytes / p as u64),
        AllReduceAlgo::Rhd => {
            let p2 = s.blocks as u64;
            let extra = if p2 as usize == p {
                ""
            } else {
                " (+ S for the ranks that fold or unfold)"
            };
            format!(
                "2(p'-1)/p' · S = {} with p' = {p2}{extra}",
                2 * (p2 - 1) * bytes / p2
            )
        }
        AllReduceAlgo::Tree => "S to the parent + S to each child".to_string(),
    };
    let per_rank: Vec<String> = sent.iter().map(|b| b.to_string()).collect();
    let _ = writeln!(
        out,
        "bytes each rank sent: [{}]; closed form {formula}",
        per_rank.join(", ")
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(p: usize, size: u64) -> String {
        let args = ExplainArgs {
            algo: ExplainAlgo::Ring,
            ranks: p,
            size,
        };
        explain(&args).expect("explains")
    }

    /// The seed's ring: p−1 reduce-scatter steps in which every rank sends one chunk to the
    /// next rank, who adds it to its own; after them each rank holds exactly one chunk summed
    /// over all; p−1 all-gather steps; 2(p−1)/p · S bytes sent by every rank.
    #[test]
    fn the_ring_walk_is_the_seeds() {
        for p in 2..=8 {
            let size = 4 * 840 * 16;
            let text = ring(p, size);
            for (phase, next) in [("reduce-scatter", "all-gather"), ("all-gather", "result")] {
                let start = text.find(&format!("{phase}: {} step", p - 1)).expect(phase);
                let body = &text[start..text[start..].find(next).map_or(text.len(), |e| start + e)];
                for s in 1..p {
                    for r in 0..p {
                        let line = format!("step {s}: rank {r} sends chunk ");
                        let at = body
                            .find(&line)
                            .unwrap_or_else(|| panic!("{line} in {body}"));
                        let rest = &body[at..body[at..].find('\n').map_or(body.len(), |e| at + e)];
                        assert!(
                            rest.contains(&format!("to rank {}, which", (r + 1) % p)),
                            "{rest}"
                        );
                        if phase == "reduce-scatter" {
                            let want = match s == p - 1 {
                                true => "the sum over all ranks".to_string(),
                                false => format!("the partial sum of ranks {{"),
                            };
                            assert!(rest.contains(&want), "{rest}");
                        }
                    }
                    assert_eq!(body.matches(&format!("step {s}: ")).count(), p, "{body}");
                }
                assert!(!body.contains(&format!("step {p}: ")), "{body}");
            }
            // After the reduce-scatter each rank holds exactly one complete chunk.
            let after = text
                .lines()
                .find(|l| l.contains("after reduce-scatter"))
                .expect("after");
            for r in 0..p {
                assert!(after.contains(&format!("rank {r}: chunk {r}")), "{after}");
            }
            assert_eq!(after.matches("chunk").count(), p, "{after}");
            let each = 2 * (p as u64 - 1) * size / p as u64;
            let want = format!(
                "bytes each rank sent: [{}]",
                vec![each.to_string(); p].join(", ")
            );
            assert!(text.contains(&want), "{want} in\n{text}");
            assert!(text.contains(&format!("2(p-1)/p · S = {each}")));
            assert!(text.contains("result: every rank holds every block summed over all ranks"));
        }
    }

    #[test]
    fn tree_and_halving_doubling_are_walked_too() {
        let tree = render(&all_reduce_schedule(AllReduceAlgo::Tree, 8), 1024);
        assert!(
            tree.contains("reduce: 3 steps") && tree.contains("broadcast: 3 steps"),
            "{tree}"
        );
        assert!(tree.contains("step 1: rank 7 sends the whole message to rank 3, which now holds the partial sum of ranks {3, 7}"), "{tree}");
        assert!(
            tree.contains(
                "bytes each rank sent: [8192, 12288, 12288, 8192, 4096, 4096, 4096, 4096]"
            ),
            "{tree}"
        );
        let rhd = render(&all_reduce_schedule(AllReduceAlgo::Rhd, 6), 1024);
        assert!(
            rhd.contains("fold: 1 step") && rhd.contains("unfold: 1 step"),
            "{rhd}"
        );
        assert!(rhd.contains("result: every rank holds every block summed over all ranks"));
        let err = explain(&ExplainArgs {
            algo: ExplainAlgo::Rhd,
            ranks: 1,
            size: 8,
        })
        .unwrap_err();
        assert!(err.contains("--ranks must be 2 to 64"), "{err}");
    }
}
