//! Reading a sharded checkpoint as a [`ParamSource`]: any region of any parameter, from only
//! the pieces that hold it.
//!
//! ```text
//!   asked: runs R of `name`        stored pieces of `name`: P0 (rank 0), P1 (rank 1), …
//!   for each piece Pk meeting R:   stream Pk's bytes (one seek), check its checksum,
//!                                  copying R ∩ Pk into the answer on the way
//!   e.g. a tp 2 column slice [2..4, 6..8] of a (2, 4) tensor written by ZeRO on dp 2 as
//!        P0 = [0..4], P1 = [4..8]:  P0 gives 2..4, P1 gives 6..8
//! ```
//!
//! A piece is read whole, a buffer at a time (never held whole), so that its checksum covers
//! every byte used; a damaged piece is refused naming the file and the rank that wrote it. Opening
//! checks the manifest (coverage, spans) and every shard file's size, so a truncated file is
//! refused before anything is read; [`ShardedCheckpoint::verify_all`] also checks every file's
//! checksum, a buffer at a time.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use mtrain_model::source::{runs_len, ParamSource};
use mtrain_parallel::shards::StateKind;

use super::digest::FileDigest;
use super::manifest::{Manifest, PieceEntry};
use super::shard_file;
use super::CheckpointError;

/// A verified sharded checkpoint directory, read on demand.
pub struct ShardedCheckpoint {
    dir: PathBuf,
    manifest: Manifest,
    /// Piece indices of each parameter.
    by_param: BTreeMap<String, Vec<usize>>,
    /// Recorded digest of each shard file.
    files: BTreeMap<String, FileDigest>,
}

/// One kind of state of a [`ShardedCheckpoint`], as a source.
pub struct KindSource<'a> {
    ckpt: &'a ShardedCheckpoint,
    kind: StateKind,
}

impl ShardedCheckpoint {
    /// Opens `dir` with its verified `manifest`; `files` are the shard files' recorded digests.
    /// Refuses a manifest whose pieces do not cover every parameter once, and a shard file that
    /// is missing or of another size, naming it and its rank.
    pub(super) fn open(
        dir: &Path,
        manifest: Manifest,
        files: BTreeMap<String, FileDigest>,
    ) -> Result<Self, CheckpointError> {
        let corrupt = |reason: String| CheckpointError::Corrupt {
            dir: dir.to_path_buf(),
            reason,
        };
        manifest
            .check_coverage()
            .map_err(|e| corrupt(format!("manifest.json: {e}")))?;
        for p in &manifest.pieces {
            if !files.contains_key(&p.file) {
                return Err(corrupt(format!(
                    "meta.json lists no digest for {} (rank {})",
                    p.file, p.rank
                )));
            }
        }
        for (file, want) in &files {
            let path = dir.join(file);
            let rank = rank_of_file(&manifest, file);
            let len = std::fs::metadata(&path)
                .map_err(|e| corrupt(format!("{file} (written by rank {rank}): {e}")))?
                .len();
            if len != want.bytes {
                return Err(corrupt(format!(
                    "{file} (written by rank {rank}) has {len} bytes but {} were recorded \
                     (truncated or overwritten)",
                    want.bytes
                )));
            }
        }
        let by_param = manifest
            .by_param()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
            by_param,
            files,
        })
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Every parameter's single-device shape, by name.
    pub fn shapes(&self) -> BTreeMap<String, Vec<usize>> {
        self.by_param
            .iter()
            .map(|(k, v)| (k.clone(), self.manifest.pieces[v[0]].full_shape.clone()))
            .collect()
    }

    /// The source of one kind of state (weights, m, v).
    pub fn source(&self, kind: StateKind) -> KindSource<'_> {
        KindSource { ckpt: self, kind }
    }

    /// Checks every shard file's checksum (reading each once, a buffer at a time), so every
    /// rank that chooses among checkpoints reaches the same verdict.
    pub fn verify_all(&self) -> Result<(), CheckpointError> {
        for (file, want) in &self.files {
            let got = shard_file::digest_of(&self.dir.join(file))?;
            let why = if got.bytes != want.bytes {
                format!(
                    "has {} bytes but {} were recorded (truncated or overwritten)",
                    got.bytes, want.bytes
                )
            } else if got.fnv1a64 != want.fnv1a64 {
                format!(
                    "checksum {} does not match the recorded {} (corrupted or edited)",
                    got.fnv1a64, want.fnv1a64
                )
            } else {
                continue;
            };
            return Err(CheckpointError::Corrupt {
                dir: self.dir.clone(),
                reason: format!(
                    "{file} (written by rank {}) {why}",
                    rank_of_file(&self.manifest, file)
                ),
            });
        }
        Ok(())
    }

    /// Copies the parts `(to, from, n)` of kind `tag` of piece `p` into `out`, checking the
    /// piece's checksum over all of its bytes.
    fn read_parts(
        &self,
        p: &PieceEntry,
        tag: &str,
        parts: &[(usize, usize, usize)],
        out: &mut [f32],
    ) -> candle_core::Result<()> {
        let fail = |what: String| {
            candle_core::Error::Msg(format!(
                "checkpoint {} is unusable: {} (written by rank {}): {tag} of `{}`: {what}",
                self.dir.display(),
                p.file,
                p.rank,
                p.param
            ))
        };
        let span = p
            .span(tag)
            .ok_or_else(|| fail("not stored (the checkpoint has no optimizer state)".into()))?;
        match shard_file::read_span_into(&self.dir.join(&p.file), span, parts, out) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(why)) => Err(fail(why)),
            Err(e) => Err(fail(format!("{e:#}"))),
        }
    }
}

/// The rank that wrote `file`, from the manifest (for messages).
fn rank_of_file(m: &Manifest, file: &str) -> String {
    m.pieces
        .iter()
        .find(|p| p.file == file)
        .map_or("?".into(), |p| p.rank.to_string())
}

/// `(position in the answer, position in the piece, length)` of each part of `asked` that the
/// piece with runs `piece` holds. Both lists are ascending and disjoint, as placements cut them.
fn overlaps(asked: &[Range<usize>], piece: &[Range<usize>]) -> Vec<(usize, usize, usize)> {
    let mut starts = Vec::with_capacity(piece.len()); // position of each piece run in the piece
    let mut at = 0;
    for r in piece {
        starts.push(at);
        at += r.len();
    }
    let mut out = Vec::new();
    let mut pos = 0;
    for a in asked {
        let first = piece.partition_point(|r| r.end <= a.start);
        for (k, r) in piece.iter().enumerate().skip(first) {
            if r.start >= a.end {
                break;
            }
            let (lo, hi) = (a.start.max(r.start), a.end.min(r.end));
            if lo < hi {
                out.push((pos + lo - a.start, starts[k] + lo - r.start, hi - lo));
            }
        }
        pos += a.len();
    }
    out
}

impl ParamSource for KindSource<'_> {
    fn read(
        &self,
        name: &str,
        full_shape: &[usize],
        runs: &[Range<usize>],
    ) -> candle_core::Result<Vec<f32>> {
        let c = self.ckpt;
        let Some(idx) = c.by_param.get(name) else {
            candle_core::bail!("checkpoint {} holds no parameter `{name}`", c.dir.display());
        };
        let shape = &c.manifest.pieces[idx[0]].full_shape;
        if shape != full_shape {
            candle_core::bail!(
                "checkpoint {}: `{name}` is {shape:?}, the model wants {full_shape:?}",
                c.dir.display()
            );
        }
        let mut out = vec![0f32; runs_len(runs)];
        let mut filled = 0;
        for &i in idx {
            let p = &c.manifest.pieces[i];
            let parts = overlaps(runs, &p.ranges());
            if parts.is_empty() {
                continue;
            }
            c.read_parts(p, self.kind.tag(), &parts, &mut out)?;
            filled += parts.iter().map(|&(_, _, n)| n).sum::<usize>();
        }
        if filled != out.len() {
            candle_core::bail!(
                "checkpoint {}: the pieces of `{name}` hold {filled} of the {} elements asked",
                c.dir.display(),
                out.len()
            );
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::overlaps;

    #[test]
    fn overlaps_place_each_part() {
        // Asked: a column half [2..4, 6..8]; the piece holds [0..3] and [5..8] of the tensor.
        let got = overlaps(&[2..4, 6..8], &[0..3, 5..8]);
        assert_eq!(got, vec![(0, 2, 1), (2, 4, 2)]);
        assert!(overlaps(&[0..2], &[4..8]).is_empty());
    }
}
