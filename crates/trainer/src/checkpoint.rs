//! Checkpoints: everything needed to continue a run exactly, written so a crash never leaves a
//! half-written checkpoint that looks complete.
//!
//! ```text
//! RUN_DIR/
//!   step-00000100/
//!     model.safetensors   full parameter tensors by name ("h.0.attn.c_attn.weight", ...)
//!     optim.safetensors   AdamW moments: "m.<name>", "v.<name>"
//!     meta.json           step, config, seed + data position (the run's whole random state),
//!                         optimizer step, and a checksum and size per tensor file
//!     meta.digest         size and checksum of meta.json
//!   step-00000200/ ...
//!   latest                "step-00000200"
//! ```
//!
//! Writing: every file goes into `RUN_DIR/.tmp-step-N/`, is fsynced, `meta.json` (with the
//! checksums) and then `meta.digest` are written last, the directory is fsynced and renamed to
//! `step-N` in one atomic `rename`, and only then is `latest` replaced (again temp file +
//! rename). A crash at any point leaves either the old checkpoint set or the new one.
//!
//! Loading verifies size and checksum of every file, meta.json included, before parsing it
//! ([`digest`]), so a truncated, corrupted or edited checkpoint is refused with a message naming
//! the file; the previous `step-*` directories are untouched and still load. A resume then checks
//! the recorded `[model]` settings against the run's ([`Checkpoint::check_model`], a different
//! architecture is refused naming the keys) and the tensors' shapes against the model. Nothing
//! else in training is random: the data order is a pure function of (seed, position), so `seed`
//! and the loader position are the random state.

mod architecture;
mod digest;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use mtrain_model::optim::AdamWState;
use mtrain_model::GptConfig;
use serde::{Deserialize, Serialize};

pub use digest::FileDigest;

use crate::config::TrainConfig;
use crate::fsio::{self, IoContext, IoError};

/// Format tag in meta.json (v2: meta.json is covered by meta.digest).
pub const FORMAT: &str = "mtrain-checkpoint-v2";
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
    /// Always [`FORMAT`].
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
    /// Size and checksum of each tensor file.
    pub files: BTreeMap<String, FileDigest>,
}

/// What [`save`] writes.
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
    /// Parameter tensors by name.
    pub model: BTreeMap<String, Tensor>,
    /// Optimizer state.
    pub optim: AdamWState,
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

/// Write a checkpoint for `data.step` into `run_dir`, atomically; returns its directory.
pub fn save(run_dir: &Path, data: &CheckpointData) -> Result<PathBuf, CheckpointError> {
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
        format: FORMAT.to_string(),
        step: data.step,
        config: data.config.clone(),
        seed: data.config.seed,
        data_position: data.data_position,
        optimizer_step: data.optim.step,
        files,
    };
    let encode = |file: &str, e: serde_json::Error| CheckpointError::Encode {
        file: tmp.join(file),
        reason: e.to_string(),
    };
    let json = serde_json::to_vec_pretty(&meta).map_err(|e| encode(META_FILE, e))?;
    fsio::write_synced(&tmp.join(META_FILE), &json)?;
    let seal =
        serde_json::to_vec(&FileDigest::of(&json)).map_err(|e| encode(META_DIGEST_FILE, e))?;
    fsio::write_synced(&tmp.join(META_DIGEST_FILE), &seal)?;
    fsio::sync_dir(&tmp)?;

    let dir = run_dir.join(&name);
    if dir.exists() {
        // Re-saving a step (e.g. after a resume): the old copy goes only after the new one is complete.
        let old = run_dir.join(format!(".old-{name}"));
        fsio::rename(&dir, &old)?;
        fsio::rename(&tmp, &dir)?;
        fs::remove_dir_all(&old).at("removing the replaced", &old)?;
    } else {
        fsio::rename(&tmp, &dir)?;
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
    if meta.format != FORMAT {
        return Err(corrupt(format!(
            "format `{}` is not `{FORMAT}`",
            meta.format
        )));
    }
    Ok(meta)
}

/// Load and verify the checkpoint in `dir` (a `step-N` directory), tensors on `device`.
pub fn load(dir: &Path, device: &Device) -> Result<Checkpoint, CheckpointError> {
    let corrupt = |reason: String| CheckpointError::Corrupt {
        dir: dir.to_path_buf(),
        reason,
    };
    let meta = read_meta(dir)?;
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
        model,
        optim,
    })
}

impl Checkpoint {
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
        for (name, shape) in expected {
            match self.model.get(name) {
                None => problems.push(format!("missing `{name}`")),
                Some(t) if t.dims() != shape.as_slice() => problems.push(format!(
                    "`{name}` is {:?}, the model wants {shape:?}",
                    t.dims()
                )),
                Some(_) => {}
            }
        }
        for name in self.model.keys().filter(|k| !expected.contains_key(*k)) {
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
/// reported through `on_skip` and the previous one is used.
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
        match load(&dir, device) {
            Ok(c) => return Ok(c),
            Err(e) => on_skip(&e),
        }
    }
    Err(CheckpointError::NotFound(run_dir.to_path_buf()))
}
