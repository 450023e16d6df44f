//! How the rows of a batch are chosen from a split.
//!
//! **Random offsets** (the default, nanoGPT's `get_batch`): every row starts at an offset drawn
//! uniformly over the split. With several shards a shard is chosen in proportion to its tokens
//! (its `len − T` possible starts, so every start in the split is equally likely), then a start
//! in it. Each row's draw is Philox4x32-10 ([`mtrain_kernels::philox`]) keyed by the run's seed,
//! its counter the row's coordinates, (step, micro-batch, row of the global batch) flattened into
//! the row's place in the step's batch:
//!
//! ```text
//!   r       = micro · (B · dp) + row of the micro-batch's global batch     (dp rank d: d·B + i)
//!   counter = (r low 32 bits, r high 32 bits, step low 32 bits, step high 24 bits | stream << 24)
//!   stream  = 2 · split (train 0, val 1) + purpose (training 0, evaluation 1)
//!   (u64 a, u64 b) = philox(seed, counter)
//!   shard  = the one holding start a·S/2⁶⁴ of the S starts of all shards     (one shard: 0)
//!   offset = b·(len − T)/2⁶⁴ in that shard                                   rows read: T + 1 tokens
//! ```
//!
//! A row depends on nothing but its coordinates, so data-parallel rank `d` draws rows
//! `d·B .. (d+1)·B` of the same global batch one rank draws with `B·dp`, a resumed run draws
//! exactly the rows the uninterrupted one did, and evaluation batches never take draws from
//! the training sequence. Flattening the micro-batch into the row makes a step's rows the same
//! however they are split between accumulation and ranks: one rank accumulating `dp·K`
//! micro-batches of `B` rows draws what `dp` ranks draw in `K` (`mtrain parity`'s reference for
//! MoE, whose routing groups are per micro-batch).
//!
//! **Epochs** ([`Sampling::Epochs`]): the split cut into non-overlapping windows of `T + 1` tokens,
//! put in a fresh order every epoch by a permutation seeded with `(seed, epoch)`; see
//! [`super::DataLoader`].

use mtrain_kernels::philox;

/// How training batches are drawn (`sampling` in the config, `--sampling`).
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Sampling {
    /// Each row at a uniformly drawn offset of the split (nanoGPT's get_batch).
    #[default]
    Random,
    /// Non-overlapping windows, shuffled every epoch.
    Epochs,
}

/// What a draw is for: training batches and evaluation batches are separate streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// The rows of a training step.
    Train,
    /// The rows of an evaluation (nanoGPT's estimate_loss).
    Eval,
}

/// Where a row's `T + 1` tokens start: (stream index, token offset in it).
pub type RowStart = (usize, usize);

/// Uniform starts over the streams of a split for rows of `seq_len + 1` tokens.
#[derive(Debug, Clone)]
pub struct RandomOffsets {
    /// `cum[i]`: the starts of the streams before stream `i` (a stream shorter than `T + 1`
    /// tokens has none); `cum[n]` is the total.
    cum: Vec<u64>,
    seed: u64,
    /// 0 for the train split, 1 for validation.
    split_id: u32,
}

impl RandomOffsets {
    /// The starts of streams of `lens` tokens for rows of `seq_len` inputs; `None` when no
    /// stream holds `seq_len + 1` tokens.
    pub fn new(lens: &[usize], seq_len: usize, seed: u64, split_id: u32) -> Option<Self> {
        let mut cum = Vec::with_capacity(lens.len() + 1);
        let mut total = 0u64;
        for &n in lens {
            cum.push(total);
            total += n.saturating_sub(seq_len) as u64;
        }
        cum.push(total);
        (total > 0).then_some(Self {
            cum,
            seed,
            split_id,
        })
    }

    /// Every possible start of the split.
    pub fn n_starts(&self) -> u64 {
        self.cum[self.cum.len() - 1]
    }

    /// The start of row `row` of step `step`'s batch, its micro-batches' global batches one after
    /// the other (see the module docs). Steps below 2⁵⁶ (any run) give distinct counters.
    pub fn row_start(&self, purpose: Purpose, step: u64, row: u64) -> RowStart {
        let stream = 2 * self.split_id
            + match purpose {
                Purpose::Train => 0,
                Purpose::Eval => 1,
            };
        let counter = [
            row as u32,
            (row >> 32) as u32,
            step as u32,
            ((step >> 32) as u32 & 0x00FF_FFFF) | stream << 24,
        ];
        let [a, b] = philox::draw_u64x2(self.seed, counter);
        let streams = self.cum.len() - 1;
        let s = match streams {
            1 => 0,
            _ => {
                let at = philox::below(a, self.n_starts());
                self.cum.partition_point(|&c| c <= at) - 1
            }
        };
        let starts = self.cum[s + 1] - self.cum[s];
        (s, philox::below(b, starts) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream too short for one row has no starts and is never chosen.
    #[test]
    fn short_streams_are_never_drawn() {
        let o = RandomOffsets::new(&[5, 40, 3, 20], 8, 1, 0).unwrap();
        assert_eq!(o.n_starts(), 32 + 12);
        for row in 0..2000 {
            let (s, off) = o.row_start(Purpose::Train, 3, row);
            assert!(s == 1 || s == 3, "stream {s}");
            let len = [5, 40, 3, 20][s];
            assert!(
                off + 8 < len,
                "start {off} of stream {s} leaves no room for 9 tokens"
            );
        }
        assert!(RandomOffsets::new(&[5, 8], 8, 1, 0).is_none());
    }

    /// Training and evaluation, and the two splits, draw different rows at equal coordinates.
    #[test]
    fn purposes_and_splits_are_separate_streams() {
        let lens = [1 << 20];
        let train = RandomOffsets::new(&lens, 64, 9, 0).unwrap();
        let val = RandomOffsets::new(&lens, 64, 9, 1).unwrap();
        let rows = |o: &RandomOffsets, p| (0..16).map(|r| o.row_start(p, 5, r)).collect::<Vec<_>>();
        assert_ne!(rows(&train, Purpose::Train), rows(&train, Purpose::Eval));
        assert_ne!(rows(&train, Purpose::Eval), rows(&val, Purpose::Eval));
        assert_ne!(rows(&train, Purpose::Train), rows(&val, Purpose::Train));
    }
}
