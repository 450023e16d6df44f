//! Pipeline stages: which segments of the model each pipeline rank runs.
//!
//! The model is the segment list `[embedding, h.0, …, h.(L−1), head]`. Its L blocks are split
//! into S consecutive ranges, one per model stage (evenly by default, the first `L % S` stages
//! taking one block more, or by an explicit list of counts); the embedding joins stage 0 and the
//! head (final LayerNorm, tied LM head, loss) joins stage S − 1. Model stage s runs on pipeline
//! rank `s % P` as its chunk `s / P` (S = v·P; v > 1 for interleaved schedules), or, placed in
//! ZB-V's V ([`StageLayout::with_placement`]), stage s ≥ P on rank 2P − 1 − s:
//!
//! ```text
//!   L = 3 blocks, S = 2 stages          L = 8 blocks, P = 2 ranks, v = 2 chunks
//!   stage 0: embedding, h.0, h.1        rank 0: chunk 0 = stage 0 (emb, h.0, h.1), chunk 1 = stage 2 (h.4, h.5)
//!   stage 1: h.2, head                  rank 1: chunk 0 = stage 1 (h.2, h.3),      chunk 1 = stage 3 (h.6, h.7, head)
//! ```
//!
//! The tied weight. `wte.weight` is both the token embedding (stage 0) and the LM head (stage
//! S − 1). On one device its gradient is the sum of both uses; split across ranks, each copy only
//! sees its own use, so after the step's backwards the two ranks exchange their gradients and
//! both add them ([`PipelineStages::sync_tied_grads`]): the copies get the same gradient and
//! stay equal after the optimizer step. With one pipeline rank there is nothing to exchange.

use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Shape, Tensor};
use mtrain_comm::{chunk_range, CommError, Communicator};
use mtrain_model::{Gpt, Grads, Param, Segment};

use super::schedule::StagePlacement;
use crate::toolbox::sum_f64;
use super::{PipelineError, Result};

/// How the model's L blocks are split into S model stages, and which pipeline rank runs each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageLayout {
    n_layer: usize,
    /// Block range of each model stage.
    blocks: Vec<Range<usize>>,
    placement: StagePlacement,
}

impl StageLayout {
    /// `n_layer` blocks split as evenly as possible over `n_stages` stages.
    pub fn even(n_layer: usize, n_stages: usize) -> Result<Self> {
        if n_stages == 0 {
            return Err(PipelineError::Layout(
                "a pipeline needs at least one stage".into(),
            ));
        }
        let counts: Vec<usize> = (0..n_stages)
            .map(|s| chunk_range(n_layer, n_stages, s).len())
            .collect();
        Self::from_counts(n_layer, &counts)
    }

    /// Stage s holds `counts[s]` consecutive blocks. The counts must add up to `n_layer`, and
    /// every stage must hold something (a middle stage needs at least one block).
    pub fn from_counts(n_layer: usize, counts: &[usize]) -> Result<Self> {
        let total: usize = counts.iter().sum();
        if counts.is_empty() || total != n_layer {
            return Err(PipelineError::Layout(format!(
                "blocks per stage {counts:?} add up to {total}, but the model has {n_layer} blocks"
            )));
        }
        let last = counts.len() - 1;
        if let Some(s) = (1..last).find(|&s| counts[s] == 0) {
            return Err(PipelineError::Layout(format!(
                "stage {s} of {} would hold no block (blocks per stage {counts:?})",
                counts.len()
            )));
        }
        let mut start = 0;
        let blocks = counts
            .iter()
            .map(|&n| {
                start += n;
                start - n..start
            })
            .collect();
        Ok(Self {
            n_layer,
            blocks,
            placement: StagePlacement::Loop,
        })
    }

    /// This layout with its stages placed on the pipeline ranks by `placement` (by default
    /// Megatron's loop; ZB-V's V).
    pub fn with_placement(self, placement: StagePlacement) -> Self {
        Self { placement, ..self }
    }

    pub fn placement(&self) -> StagePlacement {
        self.placement
    }

    /// The pipeline rank of `p` that runs model stage `stage`.
    pub fn rank_of_stage(&self, stage: usize, p: usize) -> usize {
        self.placement.rank_of_stage(p.max(1), stage)
    }

    /// The model stages pipeline rank `rank` of `p` runs, by chunk.
    pub fn stages_of_rank(&self, rank: usize, p: usize) -> Vec<usize> {
        let p = p.max(1);
        (0..self.num_stages() / p)
            .map(|c| self.placement.model_stage(p, rank, c))
            .collect()
    }

    /// S, the number of model stages.
    pub fn num_stages(&self) -> usize {
        self.blocks.len()
    }

    /// The blocks `h.i` of model stage `stage`.
    pub fn blocks(&self, stage: usize) -> Range<usize> {
        self.blocks[stage].clone()
    }

    /// Indices into `[embedding, h.0, …, h.(L−1), head]` of the segments model stage `stage` runs.
    pub fn segments(&self, stage: usize) -> Range<usize> {
        let b = &self.blocks[stage];
        let start = if stage == 0 { 0 } else { b.start + 1 };
        let end = if stage + 1 == self.num_stages() {
            self.n_layer + 2
        } else {
            b.end + 1
        };
        start..end
    }
}

/// One model stage held by this rank.
pub struct StageChunk {
    /// Model stage index s (0 = embedding first, S − 1 = head last).
    pub stage: usize,
    /// Its segments, in order.
    pub segments: Vec<Arc<dyn Segment>>,
}

/// The model stages one pipeline rank runs, plus what it needs to talk to its neighbours.
pub struct PipelineStages {
    layout: StageLayout,
    rank: usize,
    num_ranks: usize,
    chunks: Vec<StageChunk>,
    /// Parameters used by both the first and the last model stage (the tied `wte.weight`).
    tied: Vec<String>,
    activation_dtype: DType,
    n_embd: usize,
    /// `(tp size, tp rank)` under sequence parallelism.
    sequence_split: Option<(usize, usize)>,
}

fn param_names(segs: &[Arc<dyn Segment>]) -> BTreeSet<String> {
    segs.iter()
        .flat_map(|s| s.params())
        .map(|p| p.name().to_string())
        .collect()
}

impl PipelineStages {
    /// Keep the segments of `model` that pipeline rank `rank` of `num_ranks` runs under `layout`.
    pub fn new(model: &Gpt, layout: StageLayout, rank: usize, num_ranks: usize) -> Result<Self> {
        Self::from_segments(
            &model.segments,
            model.cfg.n_layer,
            model.cfg.n_embd,
            layout,
            rank,
            num_ranks,
        )
    }

    /// [`PipelineStages::new`] for any segment list `[embedding, h.0, …, h.(L−1), head]` of
    /// width `n_embd` (a tensor- or expert-parallel model's segments split the same way).
    pub fn from_segments(
        segments: &[Arc<dyn Segment>],
        n_layer: usize,
        n_embd: usize,
        layout: StageLayout,
        rank: usize,
        num_ranks: usize,
    ) -> Result<Self> {
        if layout.n_layer != n_layer || segments.len() != n_layer + 2 {
            return Err(PipelineError::Layout(format!(
                "layout is for {} blocks but the model has {n_layer} blocks and {} segments",
                layout.n_layer,
                segments.len()
            )));
        }
        let s = layout.num_stages();
        let ends = |stage: usize| param_names(&segments[layout.segments(stage)]);
        let shared: Vec<String> = ends(0).intersection(&ends(s - 1)).cloned().collect();
        Self::build(n_embd, layout, rank, num_ranks, &shared, |i| {
            Ok::<_, PipelineError>(segments[i].clone())
        })
    }

    /// The stages pipeline rank `rank` of `num_ranks` runs under `layout`, creating only their
    /// segments: `segment(i)` builds segment i of `[embedding, h.0, …, h.(L−1), head]` and is
    /// called for this rank's segments alone, in order. `shared`: the parameters both the first
    /// and the last model stage use (the tied `wte.weight`), exchanged when those stages are on
    /// two ranks.
    pub fn build<E: From<PipelineError>>(
        n_embd: usize,
        layout: StageLayout,
        rank: usize,
        num_ranks: usize,
        shared: &[String],
        mut segment: impl FnMut(usize) -> std::result::Result<Arc<dyn Segment>, E>,
    ) -> std::result::Result<Self, E> {
        let s = layout.num_stages();
        if num_ranks == 0 || rank >= num_ranks || !s.is_multiple_of(num_ranks) {
            return Err(E::from(PipelineError::Layout(format!(
                "{s} model stages cannot be spread over {num_ranks} pipeline ranks as rank {rank} \
                 (the stage count must be a multiple of the rank count)"
            ))));
        }
        let mut chunks = Vec::new();
        for stage in layout.stages_of_rank(rank, num_ranks) {
            let segments = layout
                .segments(stage)
                .map(&mut segment)
                .collect::<std::result::Result<Vec<_>, E>>()?;
            chunks.push(StageChunk { stage, segments });
        }
        // Summed over the pipeline group when the first and the last stage are on two ranks;
        // on one (the V) the rank's gradients already hold both uses.
        let (first, last) = (
            layout.rank_of_stage(0, num_ranks),
            layout.rank_of_stage(s - 1, num_ranks),
        );
        let tied = match s > 1 && first != last {
            true => shared.to_vec(),
            false => Vec::new(),
        };
        let activation_dtype = chunks
            .iter()
            .flat_map(|c| &c.segments)
            .flat_map(|s| s.params())
            .next()
            .map(|p| p.var().dtype())
            .ok_or_else(|| PipelineError::Layout("the model has no parameters".into()))
            .map_err(E::from)?;
        Ok(Self {
            layout,
            rank,
            num_ranks,
            chunks,
            tied,
            activation_dtype,
            n_embd,
            sequence_split: None,
        })
    }

    /// Marks the activations between stages as sequence shards (sequence parallelism): this
    /// rank of a tp group of `tp_size` passes `chunk_range(T, tp_size, tp_rank)` of the tokens.
    pub fn with_sequence_split(mut self, tp_size: usize, tp_rank: usize) -> Self {
        self.sequence_split = Some((tp_size, tp_rank));
        self
    }

    /// `(tp size, tp rank)` when the activations between stages are sequence shards.
    pub fn sequence_split(&self) -> Option<(usize, usize)> {
        self.sequence_split
    }

    pub fn layout(&self) -> &StageLayout {
        &self.layout
    }

    /// This rank's index in the pipeline.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// P, the number of pipeline ranks.
    pub fn num_ranks(&self) -> usize {
        self.num_ranks
    }

    /// This rank's model stages, by chunk index (the layout's placement: chunk c is model
    /// stage `c·P + rank` in Megatron's loop).
    pub fn chunks(&self) -> &[StageChunk] {
        &self.chunks
    }

    /// Dtype of the activations and activation gradients passed between stages.
    pub fn activation_dtype(&self) -> DType {
        self.activation_dtype
    }

    /// Width C of the activations `(b, T, C)` passed between stages.
    pub fn n_embd(&self) -> usize {
        self.n_embd
    }

    /// The model's forward without a backward (evaluation) through this rank's chunks in
    /// stage order: a chunk's input comes from the rank of the stage before, its output goes to
    /// the rank of the stage after (a neighbour on this rank hands it over in place).
    /// `run(k, x, targets)` runs chunk k; the last stage gets the targets and returns its loss
    /// summed over the batch. Returns that sum, broadcast over `pp` from the last stage's rank.
    ///
    /// ```text
    ///   rank of stage s:   recv x (B, T/tp, C) from stage s−1 ─ run ─ send to stage s+1
    ///   rank of the last:  recv ─ run(targets) = Σ loss ─ broadcast over pp
    /// ```
    pub fn forward_only<E>(
        &self,
        pp: &dyn Communicator,
        idx: &Tensor,     // (B, T) token ids
        targets: &Tensor, // (B, T)
        mut run: impl FnMut(usize, &Tensor, Option<&Tensor>) -> std::result::Result<Tensor, E>,
    ) -> std::result::Result<f64, E>
    where
        E: From<CommError> + From<candle_core::Error>,
    {
        let (b, t) = idx.dims2()?;
        let p = self.num_ranks;
        let s_total = self.layout.num_stages();
        let t_local = match self.sequence_split {
            Some((size, r)) => chunk_range(t, size, r).len(),
            None => t,
        };
        let act_shape = Shape::from((b, t_local, self.n_embd)); // (B, T/tp, C)
        let mut x = idx.clone();
        let mut loss = 0.0;
        for (k, chunk) in self.chunks.iter().enumerate() {
            let s = chunk.stage;
            if s > 0 && self.layout.rank_of_stage(s - 1, p) != self.rank {
                let from = self.layout.rank_of_stage(s - 1, p);
                x = pp.recv(from, &act_shape, self.activation_dtype)?;
            }
            let last = s + 1 == s_total;
            let out = run(k, &x, last.then_some(targets))?;
            if last {
                loss = sum_f64(&out)?;
            } else if self.layout.rank_of_stage(s + 1, p) != self.rank {
                pp.send(&out, self.layout.rank_of_stage(s + 1, p))?;
            } else {
                x = out;
            }
        }
        if p > 1 {
            let mine = Tensor::new(&[loss], pp.device())?;
            let root = self.layout.rank_of_stage(s_total - 1, p);
            let all = pp.broadcast(&mine, root)?.to_dtype(DType::F64)?;
            loss = all.to_vec1::<f64>()?[0];
        }
        Ok(loss)
    }

    /// Names of the parameters both the first and the last model stage use.
    pub fn tied_names(&self) -> &[String] {
        &self.tied
    }

    /// Every parameter this rank holds, each name once (what its optimizer steps).
    pub fn params(&self) -> Vec<Param> {
        let mut seen = BTreeSet::new();
        self.chunks
            .iter()
            .flat_map(|c| c.segments.iter().flat_map(|s| s.params()))
            .filter(|p| seen.insert(p.name().to_string()))
            .collect()
    }

    /// Sum the tied parameters' gradients between the ranks holding the first and the last
    /// model stage, over the pipeline group `pp`; other ranks do nothing. Call once per step,
    /// after every backward. The lower rank sends first and the higher receives first, so the
    /// exchange also pairs up on backends whose sends wait for the receiver.
    pub fn sync_tied_grads(&self, pp: &dyn Communicator, grads: &mut Grads) -> Result<()> {
        let (p, s) = (self.num_ranks, self.layout.num_stages());
        let (first, last) = (
            self.layout.rank_of_stage(0, p),
            self.layout.rank_of_stage(s - 1, p),
        );
        if first == last || (self.rank != first && self.rank != last) {
            return Ok(());
        }
        let peer = if self.rank == first { last } else { first };
        for name in &self.tied {
            let mine = grads.get(name).cloned().ok_or_else(|| {
                PipelineError::Layout(format!(
                    "pipeline rank {}: no gradient for tied parameter `{name}` (did the backward run?)",
                    self.rank
                ))
            })?;
            let theirs = if self.rank == first {
                pp.send(&mine, peer)?;
                pp.recv(peer, mine.shape(), mine.dtype())?
            } else {
                let theirs = pp.recv(peer, mine.shape(), mine.dtype())?;
                pp.send(&mine, peer)?;
                theirs
            };
            grads.insert(name.clone(), (mine + theirs)?);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_split_puts_embedding_first_and_head_last() {
        let l = StageLayout::even(3, 2).unwrap();
        assert_eq!((l.blocks(0), l.blocks(1)), (0..2, 2..3));
        // Segments: 0 = embedding, 1..=3 = h.0..h.2, 4 = head.
        assert_eq!((l.segments(0), l.segments(1)), (0..3, 3..5));
        let one = StageLayout::even(4, 1).unwrap();
        assert_eq!(one.segments(0), 0..6);
    }

    #[test]
    fn bad_layouts_are_explained() {
        let e = StageLayout::from_counts(4, &[1, 2])
            .unwrap_err()
            .to_string();
        assert!(e.contains("add up to 3") && e.contains("4 blocks"), "{e}");
        let e = StageLayout::even(1, 3).unwrap_err().to_string();
        assert!(e.contains("stage 1 of 3 would hold no block"), "{e}");
        // The end stages may hold no block: they still run the embedding / the head.
        let l = StageLayout::from_counts(2, &[0, 2, 0]).unwrap();
        assert_eq!(
            (l.segments(0), l.segments(1), l.segments(2)),
            (0..1, 1..3, 3..4)
        );
    }
}
