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
