//! `bench-comm --fit` on an all-reduce of the CPU backend: the sweep's sizes timed once per
//! algorithm (ring, tree, halving-doubling, each on a group of its own), and the rule `--algo
//! auto` follows, the fastest at each size, written into the α-β table as NCCL tunes per size.
//! Then `auto` itself, following that rule, is timed over the same sizes, next to the best.
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
use mtrain_comm::{AlgoChoice, AllReduceAlgo, AutoRule, Backend, ReduceOp};

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
    let mut c = Crossover {
        ranks: world.size(),
        rows: sizes
            .iter()
            .filter(|&&s| s as usize >= dtype.size_in_bytes())
            .map(|&s| (s, [0.0; 4]))
            .collect(),
    };
    // The three algorithms, then auto under the rule they give.
    for i in 0..4 {
        let (name, choice) = match AllReduceAlgo::ALL.get(i) {
            Some(&algo) => (format!("bench-{algo}"), AlgoChoice::Fixed(algo)),
            None => ("bench-auto".to_string(), AlgoChoice::Auto(vec![c.rule()])),
        };
        let Some(comm) = backend.new_group_with_algo(&ranks, &name, choice)? else {
            return Ok(None);
        };
        for (bytes, times) in c.rows.iter_mut() {
            let count = *bytes as usize / dtype.size_in_bytes();
            let x = Tensor::ones(count, dtype, comm.device())?;
            for _ in 0..args.warmup {
                comm.all_reduce(&x, ReduceOp::Sum)?;
            }
            comm.barrier()?;
            let start = Instant::now();
            for _ in 0..args.iters {
                comm.all_reduce(&x, ReduceOp::Sum)?;
            }
            comm.barrier()?;
            let local_us = start.elapsed().as_secs_f64() * 1e6 / args.iters as f64;
            times[i] = scalar_all_reduce(&world, local_us as f32, ReduceOp::Max)? as f64;
        }
    }
    Ok(Some(c))
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
