//! Writing a sharded checkpoint (format v3) in three steps around two barriers: rank 0 empties
//! the temporary directory ([`prepare_tmp`]); every rank writes its stored pieces and the list
//! of them ([`write_rank`]); rank 0 merges the lists into manifest.json, seals and publishes
//! the directory ([`finish_sharded`]). The module doc of [`super`] draws the result.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use mtrain_model::source::Piece;
use mtrain_parallel::shards::StateKind;

use super::manifest::{Manifest, PieceEntry, RankList, SavedLayout};
use super::{
    publish, shard_file, step_dir_name, CheckpointError, CheckpointMeta, FileDigest, FORMAT,
    MANIFEST_FILE,
};
use crate::config::TrainConfig;
use crate::fsio::{self, IoContext};

/// What rank 0 records for a sharded checkpoint.
pub struct ShardedMeta<'a> {
    /// Optimizer steps completed.
    pub step: u64,
    /// The run's configuration.
    pub config: &'a TrainConfig,
    /// Global batches the training loader had consumed.
    pub data_position: u64,
    /// AdamW's step counter (0: no moments are stored).
    pub optimizer_step: u64,
    /// The layout that wrote it.
    pub layout: SavedLayout,
    /// Ranks that wrote pieces (every rank writes its list, maybe empty).
    pub world_size: usize,
}

/// The temporary directory step `step`'s shard files go into.
pub fn tmp_dir(run_dir: &Path, step: u64) -> PathBuf {
    run_dir.join(format!(".tmp-{}", step_dir_name(step)))
}

/// Rank 0, before the first barrier: an empty [`tmp_dir`] (a stale one from a crash removed).
pub fn prepare_tmp(run_dir: &Path, step: u64) -> Result<PathBuf, CheckpointError> {
    fs::create_dir_all(run_dir).at("creating directory", run_dir)?;
    let tmp = tmp_dir(run_dir, step);
    if tmp.exists() {
        fs::remove_dir_all(&tmp).at("removing the stale", &tmp)?;
    }
    fs::create_dir(&tmp).at("creating directory", &tmp)?;
    Ok(tmp)
}

/// Every rank: writes `pieces` (those it stores) into `tmp` as `rank-NNNNN.safetensors`, with
/// the moments when `moments`, asking `values` for one piece's values at a time, and the list of
/// what it wrote as `rank-NNNNN.json`; returns the bytes of values written.
pub fn write_rank(
    tmp: &Path,
    rank: usize,
    pieces: &[Piece],
    moments: bool,
    mut values: impl FnMut(&Piece, StateKind) -> anyhow::Result<Vec<f32>>,
) -> Result<u64, CheckpointError> {
    let file = format!("rank-{rank:05}.safetensors");
    let kinds: &[StateKind] = if moments {
        &StateKind::ALL
    } else {
        &StateKind::ALL[..1]
    };
    let mut entries = Vec::new();
    for p in pieces {
        for k in kinds {
            entries.push((format!("{}.{}", k.tag(), p.name), vec![p.len()]));
        }
    }
    let failed = |path: &Path, e: anyhow::Error| CheckpointError::Encode {
        file: path.to_path_buf(),
        reason: format!("{e:#}"),
    };
    let mut list = RankList {
        rank,
        file: None,
        pieces: Vec::new(),
    };
    let mut written = 0;
    if !pieces.is_empty() {
        let path = tmp.join(&file);
        let (digest, spans) = shard_file::write_safetensors(&path, &[], &entries, |i| {
            values(&pieces[i / kinds.len()], kinds[i % kinds.len()])
        })
        .map_err(|e| failed(&path, e))?;
        written = digest.bytes;
        let mut spans = spans.into_iter();
        for p in pieces {
            let mut next = || spans.next().expect("one span per entry");
            list.pieces.push(PieceEntry {
                param: p.name.clone(),
                full_shape: p.full_shape.clone(),
                runs: p.runs.iter().map(|r| [r.start, r.end]).collect(),
                rank,
                file: file.clone(),
                w: next(),
                m: moments.then(&mut next),
                v: moments.then(&mut next),
            });
        }
        list.file = Some((file, digest));
    }
    let path = tmp.join(format!("rank-{rank:05}.json"));
    let json = serde_json::to_vec(&list).map_err(|e| failed(&path, e.into()))?;
    fsio::write_synced(&path, &json)?;
    Ok(written)
}

/// Rank 0, after the second barrier: merges every rank's list into manifest.json (checking that
/// the pieces cover every parameter once), seals and publishes `tmp` as `step-N`.
pub fn finish_sharded(
    run_dir: &Path,
    tmp: &Path,
    meta: &ShardedMeta,
) -> Result<PathBuf, CheckpointError> {
    let mut lists = Vec::with_capacity(meta.world_size);
    let mut files = BTreeMap::new();
    for rank in 0..meta.world_size {
        let path = tmp.join(format!("rank-{rank:05}.json"));
        let list: RankList =
            serde_json::from_slice(&fsio::read(&path)?).map_err(|e| CheckpointError::Encode {
                file: path.clone(),
                reason: e.to_string(),
            })?;
        if let Some((file, digest)) = list.file.clone() {
            files.insert(file, digest);
        }
        fs::remove_file(&path).at("removing", &path)?;
        lists.push(list);
    }
    let manifest = Manifest::merge(meta.layout.clone(), meta.optimizer_step > 0, lists);
    let bad = |reason: String| CheckpointError::Encode {
        file: tmp.join(MANIFEST_FILE),
        reason,
    };
    manifest.check_coverage().map_err(bad)?;
    let json = serde_json::to_vec(&manifest).map_err(|e| bad(e.to_string()))?;
    fsio::write_synced(&tmp.join(MANIFEST_FILE), &json)?;
    files.insert(MANIFEST_FILE.to_string(), FileDigest::of(&json));
    let meta = CheckpointMeta {
        format: FORMAT.to_string(),
        step: meta.step,
        config: meta.config.clone(),
        seed: meta.config.seed,
        data_position: meta.data_position,
        optimizer_step: meta.optimizer_step,
        files,
    };
    publish(run_dir, tmp, &meta)
}
