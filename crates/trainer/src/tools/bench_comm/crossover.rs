//! `bench-comm --fit` on an all-reduce of the CPU backend: the sweep's sizes timed once per
//! algorithm (ring, tree, halving-doubling, each on a group of its own), and the rule `--algo
//! auto` follows, the fastest at each size, written into the α-β table as NCCL tunes per size.
//! Then `auto` itself, following that rule, is timed in a second pass beside the three again;
//! its column is its time there against the best of that pass, scaled to the first pass's best.
//!
//! ```text
//!   # crossover over 8 ranks (us; the fastest in brackets)
//!   #   size(B)       ring       tree        rhd       auto  auto/best
//!            8       412.0    [150.3]      161.2      152.0      1.011
//!   ...
//!   # auto: ranks 8: up to 2048 B tree, up to 1048576 B rhd, beyond ring
//! ```

use std::io::Write;
use std::time::Instant;

use candle_core::Tensor;
use mtrain_comm::{AlgoChoice, AllReduceAlgo, AutoRule, Backend, Comm, ReduceOp};

use super::{scalar_all_reduce, BenchCommArgs, BenchError};

/// Each size's time (µs, the slowest rank's mean) under each algorithm.
#[derive(Debug, Clone)]
pub struct Crossover {
    pub ranks: usize,
    /// (bytes, time per algorithm in [`AllReduceAlgo::ALL`]'s order, then auto's).
    pub rows: Vec<(u64, [f64; 4])>,
}

impl Crossover {
    /// The fastest algorithm at each size, as `auto`'s rule.
    pub fn rule(&self) -> AutoRule {
        let best: Vec<(u64, AllReduceAlgo)> = self
            .rows
            .iter()
            .map(|(bytes, t)| {
                let i = (0..3).min_by(|&a, &b| t[a].total_cmp(&t[b])).unwrap_or(0);
                (*bytes, AllReduceAlgo::ALL[i])
            })
            .collect();
        AutoRule::from_best(self.ranks, &best)
    }

    /// The table above.
    pub fn print(&self, out: &mut dyn Write) -> std::io::Result<()> {
        writeln!(
            out,
            "# crossover over {} ranks (us; the fastest in brackets)",
            self.ranks
        )?;
        writeln!(
            out,
            "# {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "size(B)", "ring", "tree", "rhd", "auto", "auto/best"
        )?;
        for (bytes, t) in &self.rows {
            let best = (0..3).min_by(|&a, &b| t[a].total_cmp(&t[b])).unwrap_or(0);
            let cell = |i: usize| match i == best {
                true => format!("[{:.1}]", t[i]),
                false => format!("{:.1}", t[i]),
            };
            writeln!(
                out,
                "  {:>10} {:>10} {:>10} {:>10} {:>10.1} {:>10.3}",
                bytes,
                cell(0),
                cell(1),
                cell(2),
                t[3],
                t[3] / t[best]
            )?;
        }
        writeln!(out, "# auto: {}", self.rule().describe())
    }
}

/// Time `sizes` (bytes, of `args.dtype`) under each algorithm, on every rank; `None` where the
/// backend picks its algorithms itself (NCCL).
pub fn measure(
    backend: &dyn Backend,
    args: &BenchCommArgs,
    sizes: &[u64],
) -> Result<Option<Crossover>, BenchError> {
    let world = backend.world();
    let ranks: Vec<usize> = (0..world.size()).collect();
    let dtype = args.dtype.dtype();
    let sizes: Vec<u64> = sizes
        .iter()
        .copied()
        .filter(|&s| s as usize >= dtype.size_in_bytes())
        .collect();
    let mut comms = Vec::new();
    for algo in AllReduceAlgo::ALL {
        let name = format!("bench-{algo}");
        match backend.new_group_with_algo(&ranks, &name, AlgoChoice::Fixed(algo))? {
            Some(c) => comms.push(c),
            None => return Ok(None),
        }
    }
    // The first pass sets the rule; the second times auto under it beside the three again,
    // so auto is judged on numbers that did not choose it.
    let first = Crossover {
        ranks: world.size(),
        rows: time_sizes(&world, &comms, args, &sizes)?,
    };
    let auto = AlgoChoice::Auto(vec![first.rule()]);
    match backend.new_group_with_algo(&ranks, "bench-auto", auto)? {
        Some(c) => comms.push(c),
        None => return Ok(None),
    }
    let rows = time_sizes(&world, &comms, args, &sizes)?;
    Ok(Some(Crossover {
        ranks: world.size(),
        rows: rows
            .into_iter()
            .zip(&first.rows)
            .map(|((bytes, now), (_, before))| {
                // The three from the first pass (the rule's numbers), auto from the second,
                // as a share of the best of the three in the second.
                let best_now = now[..3].iter().copied().fold(f64::INFINITY, f64::min);
                let best_before = before[..3].iter().copied().fold(f64::INFINITY, f64::min);
                (
                    bytes,
                    [
                        before[0],
                        before[1],
                        before[2],
                        now[3] / best_now * best_before,
                    ],
                )
            })
            .collect(),
    }))
}

/// Each size timed on every group in turn, one op at a time (so a slow spell of a busy machine
/// falls on all of them alike), each round starting at the next group: per group, each rank's
/// median op time, then the slowest rank's.
fn time_sizes(
    world: &Comm,
    comms: &[Comm],
    args: &BenchCommArgs,
    sizes: &[u64],
) -> Result<Vec<(u64, [f64; 4])>, BenchError> {
    let dtype = args.dtype.dtype();
    let mut rows = Vec::new();
    for &bytes in sizes {
        let x = Tensor::ones(
            bytes as usize / dtype.size_in_bytes(),
            dtype,
            world.device(),
        )?;
        let mut samples = vec![Vec::with_capacity(args.iters); comms.len()];
        for it in 0..args.warmup + args.iters {
            // Each round starts one group further on, so no group always follows the same one.
            for j in 0..comms.len() {
                let g = (j + it) % comms.len();
                let start = Instant::now();
                comms[g].all_reduce(&x, ReduceOp::Sum)?;
                if it >= args.warmup {
                    samples[g].push(start.elapsed().as_secs_f64() * 1e6);
                }
            }
        }
        let mut times = [0.0; 4];
        for (t, s) in times.iter_mut().zip(samples.iter_mut()) {
            s.sort_by(f64::total_cmp);
            let median = s[s.len() / 2];
            *t = scalar_all_reduce(world, median as f32, ReduceOp::Max)? as f64;
        }
        rows.push((bytes, times));
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule_follows_the_fastest_column() {
        let c = Crossover {
            ranks: 8,
            rows: vec![
                (8, [400.0, 150.0, 160.0, 155.0]),
                (4096, [420.0, 170.0, 165.0, 170.0]),
                (1 << 20, [900.0, 2000.0, 950.0, 910.0]),
                (1 << 24, [9000.0, 30000.0, 9500.0, 9100.0]),
            ],
        };
        assert_eq!(
            c.rule().describe(),
            "ranks 8: up to 8 B tree, up to 4096 B rhd, beyond ring"
        );
        let mut out = Vec::new();
        c.print(&mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains("[150.0]") && text.contains("[9000.0]"),
            "{text}"
        );
    }
}
