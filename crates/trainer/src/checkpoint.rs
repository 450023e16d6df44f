//! Checkpoints: everything needed to continue a run exactly, written so a crash never leaves a
//! half-written checkpoint that looks complete, and by every rank without gathering the model.
//!
//! ```text
//! RUN_DIR/
//!   step-00000100/
//!     rank-00000.safetensors  the pieces rank 0 stores: "w.<name>" weights (the fp32 masters
//!     rank-00001.safetensors  under mixed precision), "m.<name>", "v.<name>" AdamW's moments,
//!     ...                     each 1-D f32, as the rank holds it (tp slice, ZeRO shard)
//!     manifest.json           the layout that wrote it; per piece: parameter, full shape, runs
//!                             of the single-device tensor, rank, file, byte offset, size and
//!                             checksum of w, m, v ([`manifest`])
//!     meta.json               step, config, seed + data position (the run's whole random state),
//!                             optimizer step, and a checksum and size per file (manifest.json
//!                             and every shard file)
//!     meta.digest             size and checksum of meta.json
//!   step-00000200/ ...
//!   latest                    "step-00000200"
//! ```
//!
//! Writing (format v3): rank 0 empties `RUN_DIR/.tmp-step-N/`; after a barrier every rank writes
//! its pieces there ([`write_rank`]: one streaming pass, one piece in memory at a time) with the
//! list of what it wrote; after a second barrier rank 0 merges the lists into manifest.json,
//! checks that the pieces cover every element of every parameter exactly once, writes
//! `meta.json` (with every file's checksum) and then `meta.digest`, fsyncs the directory and
//! renames it to `step-N` in one atomic `rename`, and only then replaces `latest` (again temp
//! file + rename) ([`finish_sharded`]). A crash at any point leaves the old checkpoint set. Ranks
//! holding identical replicas write once: the replica with the lowest coordinates stores it
//! (the tp rank 0 copy of a parameter replicated over tp, dp rank 0 under DDP, the first stage's
//! tied `wte`; `mtrain_parallel::shards` states the rule).
//!
//! Loading verifies meta.json against meta.digest and manifest.json against meta.json before
//! parsing them ([`digest`]), and every shard file's size. A rank then reads only the byte
//! ranges of the pieces that meet its own part of each parameter ([`reader`], a `ParamSource`
//! for the weights and each moment), checking each piece's checksum, so any layout (another dp,
//! tp, pp, ep or ZeRO stage) resumes without a gather. A damaged file is refused with a message
//! naming it and the rank that wrote it; the previous `step-*` directories are untouched and
//! still load ([`load_latest_valid`] checks every file's checksum before choosing). A resume
//! then checks the recorded `[model]` settings against the run's ([`Checkpoint::check_model`])
//! and the shapes against the model. Nothing else in training is random: the data order is a
//! pure function of (seed, position), so `seed` and the loader position are the random state.
//!
//! Format v2 (`model.safetensors` and `optim.safetensors`: full tensors by name) still loads,
//! through the same source interface ([`save_full`] writes it).

mod architecture;
mod digest;
pub mod manifest;
pub mod reader;
pub mod shard_file;
mod writer;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use mtrain_model::optim::AdamWState;
use mtrain_model::source::{read_tensor, ParamSource};
use mtrain_model::GptConfig;
use mtrain_parallel::shards::StateKind;
use serde::{Deserialize, Serialize};

pub use digest::FileDigest;
use manifest::Manifest;
use reader::ShardedCheckpoint;
pub use writer::{finish_sharded, prepare_tmp, tmp_dir, write_rank, ShardedMeta};

use crate::config::TrainConfig;
use crate::fsio::{self, IoContext, IoError};

/// Format tag in meta.json (v3: per-rank shard files and a manifest).
pub const FORMAT: &str = "mtrain-checkpoint-v3";
/// The full-tensor format (model.safetensors, optim.safetensors), still read.
pub const FORMAT_FULL: &str = "mtrain-checkpoint-v2";
const MANIFEST_FILE: &str = "manifest.json";
const MODEL_FILE: &str = "model.safetensors";
const OPTIM_FILE: &str = "optim.safetensors";
const META_FILE: &str = "meta.json";
const META_DIGEST_FILE: &str = "meta.digest";
const LATEST_FILE: &str = "latest";

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file operation failed (the error names the operation and the path).
    #[error(transparent)]
    Io(#[from] IoError),
    /// The checkpoint is damaged or inconsistent (truncated, corrupt, wrong shapes, missing parts).
    #[error("checkpoint {dir} is unusable: {reason}")]
    Corrupt {
        /// The checkpoint directory.
        dir: PathBuf,
        /// What is wrong, naming the file or tensor.
        reason: String,
    },
    /// The checkpoint was written for a different model than the run's.
    #[error("checkpoint {dir} was written for a different model: {differences} (checkpoint vs this run); resume with the checkpoint's [model] settings or start a new run_dir")]
    Architecture {
        /// The checkpoint directory.
        dir: PathBuf,
        /// `key: checkpoint value vs run value` for each differing key, `; `-separated.
        differences: String,
    },
    /// A tensor file could not be encoded.
    #[error("cannot encode {file}: {reason}")]
    Encode {
        /// The file being written.
        file: PathBuf,
        /// The encoder's message.
        reason: String,
    },
    /// There is no checkpoint where one was asked for.
    #[error("no checkpoint found in {0} (expected step-N directories or a `latest` file)")]
    NotFound(PathBuf),
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// The contents of meta.json.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointMeta {
    /// [`FORMAT`] or [`FORMAT_FULL`].
    pub format: String,
    /// Optimizer steps completed when the checkpoint was taken.
    pub step: u64,
    /// The run's configuration.
    pub config: TrainConfig,
    /// Seed of initialisation and data order.
    pub seed: u64,
    /// Global batches the training loader had consumed.
    pub data_position: u64,
    /// AdamW's step counter (for bias correction).
    pub optimizer_step: u64,
    /// Size and checksum of each file (tensor files, manifest.json).
    pub files: BTreeMap<String, FileDigest>,
}

/// What [`save_full`] writes.
pub struct CheckpointData<'a> {
    /// Optimizer steps completed.
    pub step: u64,
    /// The run's configuration.
    pub config: &'a TrainConfig,
    /// Global batches the training loader had consumed.
    pub data_position: u64,
    /// Full parameter tensors by name.
    pub model: &'a BTreeMap<String, Tensor>,
    /// The optimizer state.
    pub optim: &'a AdamWState,
}

/// A loaded, verified checkpoint.
pub struct Checkpoint {
    /// Its directory.
    pub dir: PathBuf,
    /// meta.json.
    pub meta: CheckpointMeta,
    /// Its tensors.
    pub stored: Stored,
}

/// How a checkpoint holds its tensors.
pub enum Stored {
    /// Format v2: full tensors by name, read whole.
    Full {
        model: BTreeMap<String, Tensor>,
        optim: AdamWState,
    },
    /// Format v3: per-rank pieces, read on demand.
    Sharded(ShardedCheckpoint),
}

/// Name of the directory of step `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// Encode `tensors` as safetensors in memory, write them to `path` (fsynced) and return the
/// file's digest.
fn tensors_to_file(
    tensors: BTreeMap<String, &Tensor>,
    path: &Path,
) -> Result<FileDigest, CheckpointError> {
    let bytes = safetensors::serialize(tensors, None).map_err(|e| CheckpointError::Encode {
        file: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    fsio::write_synced(path, &bytes)?;
    Ok(FileDigest::of(&bytes))
}

/// Write a full-tensor checkpoint (format v2) for `data.step` into `run_dir`, atomically;
/// returns its directory.
pub fn save_full(run_dir: &Path, data: &CheckpointData) -> Result<PathBuf, CheckpointError> {
    fs::create_dir_all(run_dir).at("creating directory", run_dir)?;
    let name = step_dir_name(data.step);
    let tmp = run_dir.join(format!(".tmp-{name}"));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).at("removing the stale", &tmp)?;
    }
    fs::create_dir(&tmp).at("creating directory", &tmp)?;

    let model: BTreeMap<String, &Tensor> = data.model.iter().map(|(k, t)| (k.clone(), t)).collect();
    let mut optim = BTreeMap::new();
    for (k, t) in &data.optim.m {
        optim.insert(format!("m.{k}"), t);
    }
    for (k, t) in &data.optim.v {
        optim.insert(format!("v.{k}"), t);
    }
    let mut files = BTreeMap::new();
    files.insert(
        MODEL_FILE.to_string(),
        tensors_to_file(model, &tmp.join(MODEL_FILE))?,
    );
    files.insert(
        OPTIM_FILE.to_string(),
        tensors_to_file(optim, &tmp.join(OPTIM_FILE))?,
    );

    let meta = CheckpointMeta {
        format: FORMAT_FULL.to_string(),
        step: data.step,
        config: data.config.clone(),
        seed: data.config.seed,
        data_position: data.data_position,
        optimizer_step: data.optim.step,
        files,
    };
    publish(run_dir, &tmp, &meta)
}

/// Seal `tmp` with `meta` (meta.json, then meta.digest, fsynced), rename it to its `step-N`
/// and point `latest` at it.
fn publish(run_dir: &Path, tmp: &Path, meta: &CheckpointMeta) -> Result<PathBuf, CheckpointError> {
    let name = step_dir_name(meta.step);
    let encode = |file: &str, e: serde_json::Error| CheckpointError::Encode {
        file: tmp.join(file),
        reason: e.to_string(),
    };
    let json = serde_json::to_vec_pretty(meta).map_err(|e| encode(META_FILE, e))?;
    fsio::write_synced(&tmp.join(META_FILE), &json)?;
    let seal =
        serde_json::to_vec(&FileDigest::of(&json)).map_err(|e| encode(META_DIGEST_FILE, e))?;
    fsio::write_synced(&tmp.join(META_DIGEST_FILE), &seal)?;
    fsio::sync_dir(tmp)?;

    let dir = run_dir.join(&name);
    if dir.exists() {
        // Re-saving a step (e.g. after a resume): the old copy goes only after the new one is complete.
        let old = run_dir.join(format!(".old-{name}"));
        fsio::rename(&dir, &old)?;
        fsio::rename(tmp, &dir)?;
        fs::remove_dir_all(&old).at("removing the replaced", &old)?;
    } else {
        fsio::rename(tmp, &dir)?;
    }
    let latest_tmp = run_dir.join(format!(".{LATEST_FILE}.tmp"));
    fsio::write_synced(&latest_tmp, name.as_bytes())?;
    fsio::rename(&latest_tmp, &run_dir.join(LATEST_FILE))?;
    fsio::sync_dir(run_dir)?;
    Ok(dir)
}

/// Read `file` of the checkpoint `dir` and check it against `want`, before anything parses it.
fn read_verified(dir: &Path, file: &str, want: &FileDigest) -> Result<Vec<u8>, CheckpointError> {
    let path = dir.join(file);
    let data = fsio::read(&path)?;
    want.check(file, &data)
        .map_err(|reason| CheckpointError::Corrupt {
            dir: dir.to_path_buf(),
            reason,
        })?;
    Ok(data)
}

/// meta.json, verified against meta.digest, parsed.
fn read_meta(dir: &Path) -> Result<CheckpointMeta, CheckpointError> {
    let corrupt = |reason: String| CheckpointError::Corrupt {
        dir: dir.to_path_buf(),
        reason,
    };
    let seal_path = dir.join(META_DIGEST_FILE);
    let seal = match fs::read(&seal_path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(corrupt(format!(
                "{META_DIGEST_FILE} is missing, so meta.json cannot be verified (incomplete, or \
                 written in an older format than `{FORMAT}`)"
            )))
        }
        Err(cause) => {
            return Err(IoError {
                op: "reading",
                path: seal_path,
                cause,
            }
            .into())
        }
    };
    let seal: FileDigest = serde_json::from_slice(&seal)
        .map_err(|e| corrupt(format!("{META_DIGEST_FILE} does not parse: {e}")))?;
    let bytes = read_verified(dir, META_FILE, &seal)?;
    let meta: CheckpointMeta = serde_json::from_slice(&bytes)
        .map_err(|e| corrupt(format!("{META_FILE} does not parse: {e}")))?;
    if meta.format != FORMAT && meta.format != FORMAT_FULL {
        return Err(corrupt(format!(
            "format `{}` is neither `{FORMAT}` nor `{FORMAT_FULL}`",
            meta.format
        )));
    }
    Ok(meta)
}

/// Load and verify the checkpoint in `dir` (a `step-N` directory): a sharded one's manifest
/// and file sizes (its tensors are read on demand), a full one's tensors onto `device`.
pub fn load(dir: &Path, device: &Device) -> Result<Checkpoint, CheckpointError> {
    let corrupt = |reason: String| CheckpointError::Corrupt {
        dir: dir.to_path_buf(),
        reason,
    };
    let meta = read_meta(dir)?;
    if meta.format == FORMAT {
        let want = meta
            .files
            .get(MANIFEST_FILE)
            .ok_or_else(|| corrupt(format!("meta.json lists no digest for {MANIFEST_FILE}")))?;
        let bytes = read_verified(dir, MANIFEST_FILE, want)?;
        let manifest: Manifest = serde_json::from_slice(&bytes)
            .map_err(|e| corrupt(format!("{MANIFEST_FILE} does not parse: {e}")))?;
        let mut files = meta.files.clone();
        files.remove(MANIFEST_FILE);
        let sharded = ShardedCheckpoint::open(dir, manifest, files)?;
        return Ok(Checkpoint {
            dir: dir.to_path_buf(),
            meta,
            stored: Stored::Sharded(sharded),
        });
    }
    let parse = |file: &str| -> Result<std::collections::HashMap<String, Tensor>, CheckpointError> {
        let want = meta
            .files
            .get(file)
            .ok_or_else(|| corrupt(format!("meta.json lists no digest for {file}")))?;
        let bytes = read_verified(dir, file, want)?;
        candle_core::safetensors::load_buffer(&bytes, device).map_err(|e| {
            CheckpointError::Corrupt {
                dir: dir.to_path_buf(),
                reason: format!("{file}: {e}"),
            }
        })
    };
    let model: BTreeMap<String, Tensor> = parse(MODEL_FILE)?.into_iter().collect();
    let mut m = BTreeMap::new();
    let mut v = BTreeMap::new();
    for (k, t) in parse(OPTIM_FILE)? {
        match (k.strip_prefix("m."), k.strip_prefix("v.")) {
            (Some(name), _) => m.insert(name.to_string(), t),
            (_, Some(name)) => v.insert(name.to_string(), t),
            _ => {
                return Err(corrupt(format!(
                    "{OPTIM_FILE} has an unexpected tensor `{k}`"
                )))
            }
        };
    }
    for name in m.keys().chain(v.keys()) {
        let (Some(mt), Some(vt)) = (m.get(name), v.get(name)) else {
            return Err(corrupt(format!("optimizer state of `{name}` lacks m or v")));
        };
        if mt.dims() != vt.dims() {
            return Err(corrupt(format!(
                "optimizer m and v of `{name}` differ: {:?} vs {:?}",
                mt.dims(),
                vt.dims()
            )));
        }
        if let Some(p) = model.get(name) {
            if p.elem_count() != mt.elem_count() {
                return Err(corrupt(format!(
                    "optimizer state of `{name}` has {:?} but the parameter {:?}",
                    mt.dims(),
                    p.dims()
                )));
            }
        }
    }
    let optim = AdamWState {
        step: meta.optimizer_step,
        m,
        v,
    };
    Ok(Checkpoint {
        dir: dir.to_path_buf(),
        meta,
        stored: Stored::Full { model, optim },
    })
}

/// Full tensors of a v2 checkpoint, lent as a source.
struct Lent<'a>(&'a BTreeMap<String, Tensor>);

impl ParamSource for Lent<'_> {
    fn read(
        &self,
        name: &str,
        full_shape: &[usize],
        runs: &[std::ops::Range<usize>],
    ) -> candle_core::Result<Vec<f32>> {
        self.0.read(name, full_shape, runs)
    }
}

impl Checkpoint {
    /// The weights (fp32 masters under mixed precision) as a source of any region.
    pub fn weights(&self) -> Box<dyn ParamSource + '_> {
        match &self.stored {
            Stored::Full { model, .. } => Box::new(Lent(model)),
            Stored::Sharded(s) => Box::new(s.source(StateKind::Weight)),
        }
    }

    /// AdamW's first and second moments as sources, with its step count; None when the
    /// checkpoint was taken before the first optimizer step.
    pub fn moments(&self) -> Option<(Box<dyn ParamSource + '_>, Box<dyn ParamSource + '_>, u64)> {
        let step = self.meta.optimizer_step;
        match &self.stored {
            Stored::Full { optim, .. } if !optim.m.is_empty() => {
                Some((Box::new(Lent(&optim.m)), Box::new(Lent(&optim.v)), step))
            }
            Stored::Sharded(s) if s.manifest().moments => Some((
                Box::new(s.source(StateKind::FirstMoment)),
                Box::new(s.source(StateKind::SecondMoment)),
                step,
            )),
            _ => None,
        }
    }

    /// Every parameter's single-device shape, by name.
    pub fn shapes(&self) -> BTreeMap<String, Vec<usize>> {
        match &self.stored {
            Stored::Full { model, .. } => {
                model.iter().map(|(k, t)| (k.clone(), t.dims().to_vec())).collect()
            }
            Stored::Sharded(s) => s.shapes(),
        }
    }

    /// Parameter `name` read whole (f32, its single-device shape) onto `device`.
    pub fn tensor(&self, name: &str, device: &Device) -> Result<Tensor, CheckpointError> {
        let shape = self.shapes().remove(name).ok_or_else(|| CheckpointError::Corrupt {
            dir: self.dir.clone(),
            reason: format!("it holds no parameter `{name}`"),
        })?;
        let all = [0..shape.iter().product()];
        Ok(read_tensor(&*self.weights(), name, &shape, &all, &shape, device)?)
    }

    /// Every parameter read whole, by name (tools and tests over small models: this is the
    /// whole model in memory).
    pub fn full_model(&self, device: &Device) -> Result<BTreeMap<String, Tensor>, CheckpointError> {
        self.shapes()
            .into_keys()
            .map(|n| Ok((n.clone(), self.tensor(&n, device)?)))
            .collect()
    }

    /// The whole optimizer state, every moment read whole (as [`Checkpoint::full_model`]).
    pub fn full_optim(&self, device: &Device) -> Result<AdamWState, CheckpointError> {
        let mut state = AdamWState {
            step: self.meta.optimizer_step,
            m: BTreeMap::new(),
            v: BTreeMap::new(),
        };
        if let Some((m, v, _)) = self.moments() {
            for (name, shape) in self.shapes() {
                let all = [0..shape.iter().product()];
                let read = |s: &dyn ParamSource| read_tensor(s, &name, &shape, &all, &shape, device);
                state.m.insert(name.clone(), read(&*m)?);
                state.v.insert(name.clone(), read(&*v)?);
            }
        }
        Ok(state)
    }

    /// Refuse the checkpoint unless it was written for the model `run` (every `[model]` key
    /// equal); the error names each key that differs.
    pub fn check_model(&self, run: &GptConfig) -> Result<(), CheckpointError> {
        let recorded = self
            .meta
            .config
            .gpt_config()
            .map_err(|e| CheckpointError::Corrupt {
                dir: self.dir.clone(),
                reason: format!("its recorded model is unusable: {e}"),
            })?;
        let differences = architecture::differences(&recorded, run);
        if differences.is_empty() {
            Ok(())
        } else {
            Err(CheckpointError::Architecture {
                dir: self.dir.clone(),
                differences: differences.join("; "),
            })
        }
    }

    /// Check that the parameters are exactly `expected` (name → shape); the error lists every
    /// missing, extra or mis-shaped tensor.
    pub fn check_shapes(
        &self,
        expected: &BTreeMap<String, Vec<usize>>,
    ) -> Result<(), CheckpointError> {
        let mut problems = Vec::new();
        let shapes = self.shapes();
        for (name, shape) in expected {
            match shapes.get(name) {
                None => problems.push(format!("missing `{name}`")),
                Some(t) if t != shape => {
                    problems.push(format!("`{name}` is {t:?}, the model wants {shape:?}"))
                }
                Some(_) => {}
            }
        }
        for name in shapes.keys().filter(|k| !expected.contains_key(*k)) {
            problems.push(format!("unexpected `{name}`"));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(CheckpointError::Corrupt {
                dir: self.dir.clone(),
                reason: problems.join("; "),
            })
        }
    }
}

/// The `step-N` directories of `run_dir`, oldest first.
pub fn list(run_dir: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let mut found = Vec::new();
    if !run_dir.is_dir() {
        return Ok(found);
    }
    for entry in fs::read_dir(run_dir).at("listing", run_dir)? {
        let path = entry.at("listing", run_dir)?.path();
        let step = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("step-"));
        if let Some(step) = step.and_then(|s| s.parse::<u64>().ok()) {
            if path.is_dir() {
                found.push((step, path));
            }
        }
    }
    found.sort();
    Ok(found)
}

/// The newest checkpoint of `run_dir`: the one `latest` names, else the highest `step-N`.
pub fn latest(run_dir: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    if let Ok(name) = fs::read_to_string(run_dir.join(LATEST_FILE)) {
        let dir = run_dir.join(name.trim());
        if dir.is_dir() {
            return Ok(Some(dir));
        }
    }
    Ok(list(run_dir)?.pop().map(|(_, p)| p))
}

/// Resolve what `--resume` names: a checkpoint directory (has meta.json) or a run directory (its
/// newest checkpoint).
pub fn resolve(path: &Path) -> Result<PathBuf, CheckpointError> {
    if path.join(META_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    latest(path)?.ok_or_else(|| CheckpointError::NotFound(path.to_path_buf()))
}

/// Load the newest checkpoint of `run_dir` that verifies, newest first; a damaged newer one is
/// reported through `on_skip` and the previous one is used. A sharded checkpoint's files are
/// checked whole here (a buffer at a time), so every rank choosing reaches the same verdict.
pub fn load_latest_valid(
    run_dir: &Path,
    device: &Device,
    mut on_skip: impl FnMut(&CheckpointError),
) -> Result<Checkpoint, CheckpointError> {
    let mut candidates: Vec<PathBuf> = list(run_dir)?.into_iter().map(|(_, p)| p).collect();
    if let Some(l) = latest(run_dir)? {
        candidates.retain(|p| p != &l);
        candidates.push(l);
    }
    while let Some(dir) = candidates.pop() {
        let verified = load(&dir, device).and_then(|c| match &c.stored {
            Stored::Sharded(s) => s.verify_all().map(|_| c),
            Stored::Full { .. } => Ok(c),
        });
        match verified {
            Ok(c) => return Ok(c),
            Err(e) => on_skip(&e),
        }
    }
    Err(CheckpointError::NotFound(run_dir.to_path_buf()))
}
