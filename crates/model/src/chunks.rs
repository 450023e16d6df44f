//! The positions a rank's rows hold when context parallelism splits each sequence: 2·n chunks
//! of equal length, rank i holding chunks i and 2n−1−i, so that under the causal mask every
//! rank has the same work (an early chunk sees few keys, its partner many):
//!
//! ```text
//!   n = 2, T = 8:   positions  0 1 | 2 3 | 4 5 | 6 7
//!                   chunk        0     1     2     3
//!                   rank         0     1     1     0      rank 0 rows: 0 1 6 7
//!                                                         rank 1 rows: 2 3 4 5
//! ```
//!
//! [`Positions`] says the same for any split of the rows (one device's, sequence parallelism's
//! run, these chunks), which is where a rank's dropout masks are drawn ([`crate::dropout`]).

/// This rank's chunks of a sequence split 2·`n` ways: `i` and 2n−1−i.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequenceChunks {
    /// Ranks sharing each sequence (cp).
    pub n: usize,
    /// This rank's place among them.
    pub i: usize,
}

impl SequenceChunks {
    /// The two runs (first position, length) that this rank's `t_r` rows cover, in the order
    /// the rows hold them.
    pub fn runs(&self, t_r: usize) -> [(usize, usize); 2] {
        let c = t_r / 2;
        [(self.i * c, c), ((2 * self.n - 1 - self.i) * c, c)]
    }

    /// Each of this rank's rows' position, for `t_r` rows.
    pub fn positions(&self, t_r: usize) -> Vec<usize> {
        self.runs(t_r)
            .iter()
            .flat_map(|&(start, len)| start..start + len)
            .collect()
    }
}

/// Where a pass's rows sit in each sequence of `t` positions: runs (first position, count),
/// side by side along T in the order the rows hold them — all of `0..t` on one device, one
/// run under sequence parallelism, a rank's two chunks under context parallelism.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Positions {
    /// Positions of the whole sequence.
    pub t: usize,
    pub runs: Vec<(usize, usize)>,
}

impl Positions {
    /// Every position of a sequence of `t`.
    pub fn all(t: usize) -> Self {
        Self::run(0, t, t)
    }

    /// Positions `first .. first + count` of a sequence of `t`.
    pub fn run(first: usize, count: usize, t: usize) -> Self {
        Positions {
            t,
            runs: vec![(first, count)],
        }
    }

    /// The positions of `t_r` rows holding `chunks` of a sequence of `chunks.n · t_r`.
    pub fn chunks(chunks: SequenceChunks, t_r: usize) -> Self {
        Positions {
            t: chunks.n * t_r,
            runs: chunks.runs(t_r).to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ranks_chunks_tile_the_sequence() {
        for n in [1, 2, 3, 4] {
            let t_r = 6;
            let mut all: Vec<usize> = (0..n)
                .flat_map(|i| SequenceChunks { n, i }.positions(t_r))
                .collect();
            all.sort();
            assert_eq!(all, (0..n * t_r).collect::<Vec<_>>());
        }
        assert_eq!(SequenceChunks { n: 2, i: 0 }.positions(4), vec![0, 1, 6, 7]);
        assert_eq!(SequenceChunks { n: 2, i: 1 }.positions(4), vec![2, 3, 4, 5]);
    }
}
