//! A run directory belongs to one run.
//!
//! ```text
//!   RUN_DIR/run.json   {"run_id": "...", "started_unix_s": ...}   written when a run claims the directory
//!   RUN_DIR/.lock      flock'ed by rank 0 for as long as the run lives (its pid inside, for the message)
//!
//!   the directory            without flags        --resume                 --overwrite
//!   missing or empty         new run              new run                  new run
//!   holds a run              refused              continues it (same id)   its files removed, new run
//!   locked by a live run     refused              refused                  refused
//! ```
//!
//! "Holds a run" means it has any file a run writes: run.json, metrics.jsonl, memory.jsonl,
//! steps.jsonl, a per-rank trace or pipeline timeline, a `step-N` checkpoint. `--overwrite`
//! removes those and nothing else (a file of the user's in the directory stays). The lock is an
//! advisory `flock`: the kernel releases it when its process ends, however it ends, so a killed
//! run never leaves its directory locked.
//!
//! Rank 0 claims the directory ([`claim`]) before it joins the other ranks, which wait for it at
//! the run's first barrier, so no rank writes into a directory that is then refused or cleared.
//! The mtrain launcher checks the same rules before it starts any worker ([`check`]), so a
//! refusal is printed once. Every metrics.jsonl line carries its run's id (`run`), and
//! `mtrain plot` refuses a file that holds more than one run.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::fsio::{IoContext, IoError};

/// The file naming the run a directory belongs to.
pub const RUN_FILE: &str = "run.json";
/// The lock file rank 0 holds while the run lives.
pub const LOCK_FILE: &str = ".lock";
/// Files a run writes at the top of its directory.
const RUN_FILES: [&str; 10] = [
    RUN_FILE,
    "metrics.jsonl",
    "memory.jsonl",
    "steps.jsonl",
    "latest",
    "loss.svg",
    "memory.svg",
    "pipeline.svg",
    "ops.json",
    "roofline.svg",
];
/// Prefixes of the other files and directories a run writes: per-rank traces, timelines and op
/// tables, checkpoints and checkpoints being written.
const RUN_PREFIXES: [&str; 6] = [
    "trace-rank",
    "trace.",
    "pipeline-rank",
    "ops-rank",
    "step-",
    ".tmp-step-",
];

/// Why a run may not use its directory.
#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    #[error("{dir} already holds a run ({found}); pass --resume to continue it or --overwrite to replace it, or choose another --run-dir")]
    Occupied { dir: PathBuf, found: String },

    #[error("{dir} is in use by another run ({holder}, holding {lock}); two runs cannot share a run directory")]
    Locked {
        dir: PathBuf,
        holder: String,
        lock: PathBuf,
    },

    #[error("--resume continues the run in the directory and --overwrite replaces it: give one of them")]
    ResumeAndOverwrite,

    #[error(transparent)]
    Io(#[from] IoError),

    #[error("{path}: {why}")]
    RunFile { path: PathBuf, why: String },
}

/// What `run.json` records.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunInfo {
    /// Unique per run; kept when the run is resumed.
    pub run_id: String,
    /// When the run first started (seconds since the epoch).
    pub started_unix_s: u64,
}

/// A claimed run directory: the lock is held until this is dropped.
#[derive(Debug)]
pub struct Claim {
    _lock: File,
    /// The run's id (also in `run.json` and in every metrics.jsonl line).
    pub run_id: String,
}

/// Whether `name` (an entry of a run directory) is something a run writes.
fn is_run_file(name: &str) -> bool {
    RUN_FILES.contains(&name) || RUN_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// The entries of `dir` a run wrote, sorted (empty when `dir` does not exist).
fn run_files(dir: &Path) -> Result<Vec<String>, IoError> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).at("listing", dir),
    };
    let mut found = Vec::new();
    for entry in entries {
        let name = entry.at("listing", dir)?.file_name();
        let name = name.to_string_lossy();
        if is_run_file(&name) {
            found.push(name.into_owned());
        }
    }
    found.sort();
    Ok(found)
}

/// `a, b, c` or `a, b, c and 4 more`.
fn summary(found: &[String]) -> String {
    const SHOWN: usize = 3;
    let head = found[..found.len().min(SHOWN)].join(", ");
    match found.len().saturating_sub(SHOWN) {
        0 => head,
        more => format!("{head} and {more} more"),
    }
}

/// Take `dir`'s lock without waiting; `Locked` names the process that holds it.
fn lock(dir: &Path) -> Result<File, RunDirError> {
    let path = dir.join(LOCK_FILE);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .at("opening", &path)?;
    // SAFETY: flock on a file descriptor this function owns; no memory is passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let holder = fs::read_to_string(&path)
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .map_or_else(|| "another process".to_string(), |pid| format!("pid {pid}"));
            return Err(RunDirError::Locked {
                dir: dir.to_path_buf(),
                holder,
                lock: path,
            });
        }
        return Err(RunDirError::Io(IoError {
            op: "locking",
            path,
            cause: err,
        }));
    }
    Ok(file)
}

/// The rules of the module doc, checked without claiming anything: the launcher runs this
/// before it starts workers.
pub fn check(cfg: &TrainConfig) -> Result<(), RunDirError> {
    if cfg.resume.is_some() && cfg.overwrite {
        return Err(RunDirError::ResumeAndOverwrite);
    }
    let dir = &cfg.run_dir;
    if dir.join(LOCK_FILE).is_file() {
        // Taken and released at once: only whether a live run holds it matters here.
        drop(lock(dir)?);
    }
    let found = run_files(dir)?;
    if !found.is_empty() && cfg.resume.is_none() && !cfg.overwrite {
        return Err(RunDirError::Occupied {
            dir: dir.clone(),
            found: summary(&found),
        });
    }
    Ok(())
}

/// Claim `cfg.run_dir` for this run (rank 0): lock it, apply `--overwrite` or `--resume`, and
/// write `run.json`. Refused as the module doc says.
pub fn claim(cfg: &TrainConfig) -> Result<Claim, RunDirError> {
    if cfg.resume.is_some() && cfg.overwrite {
        return Err(RunDirError::ResumeAndOverwrite);
    }
    let dir = &cfg.run_dir;
    fs::create_dir_all(dir).at("creating directory", dir)?;
    let mut file = lock(dir)?;
    let lock_path = dir.join(LOCK_FILE);
    file.set_len(0).at("writing", &lock_path)?;
    writeln!(file, "{}", std::process::id()).at("writing", &lock_path)?;

    let found = run_files(dir)?;
    let previous = match (found.is_empty(), cfg.resume.is_some(), cfg.overwrite) {
        (true, _, _) => None,
        (false, true, _) => read_run_info(dir)?,
        (false, false, true) => {
            remove_run_files(dir, &found)?;
            None
        }
        (false, false, false) => {
            return Err(RunDirError::Occupied {
                dir: dir.clone(),
                found: summary(&found),
            })
        }
    };
    let info = match previous {
        Some(info) => info,
        None => {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default();
            let info = RunInfo {
                run_id: format!(
                    "{}-{}-{:08x}",
                    now.as_secs(),
                    std::process::id(),
                    now.subsec_nanos()
                ),
                started_unix_s: now.as_secs(),
            };
            let path = dir.join(RUN_FILE);
            let text = serde_json::to_string_pretty(&info).map_err(|e| RunDirError::RunFile {
                path: path.clone(),
                why: e.to_string(),
            })?;
            crate::fsio::write_synced(&path, format!("{text}\n").as_bytes())?;
            info
        }
    };
    Ok(Claim {
        _lock: file,
        run_id: info.run_id,
    })
}

/// The run `dir` belongs to, from its `run.json` (None for a directory without one).
pub fn read_run_info(dir: &Path) -> Result<Option<RunInfo>, RunDirError> {
    let path = dir.join(RUN_FILE);
    if !path.is_file() {
        return Ok(None);
    }
    let text = crate::fsio::read_to_string(&path)?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| RunDirError::RunFile {
            path,
            why: format!("not a run file of mtrain ({e})"),
        })
}

/// Remove the run's `found` entries of `dir` (files and checkpoint directories).
fn remove_run_files(dir: &Path, found: &[String]) -> Result<(), RunDirError> {
    for name in found {
        let path = dir.join(name);
        if path.is_dir() {
            fs::remove_dir_all(&path).at("removing", &path)?;
        } else {
            fs::remove_file(&path).at("removing", &path)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(dir: &Path) -> TrainConfig {
        TrainConfig {
            run_dir: dir.to_path_buf(),
            ..TrainConfig::default()
        }
    }

    #[test]
    fn a_directory_with_a_run_is_refused_unless_resumed_or_overwritten() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        let first = claim(&cfg(&dir)).expect("a missing directory is claimed");
        fs::write(dir.join("metrics.jsonl"), "{}\n").unwrap();
        fs::create_dir(dir.join("step-00000002")).unwrap();
        fs::write(dir.join("notes.txt"), "mine").unwrap();
        // Held by a live run: refused, whatever the flags.
        let e = claim(&TrainConfig {
            overwrite: true,
            ..cfg(&dir)
        })
        .unwrap_err();
        assert!(
            matches!(e, RunDirError::Locked { .. }) && e.to_string().contains(&format!("pid {}", std::process::id())),
            "{e}"
        );
        assert!(matches!(check(&cfg(&dir)), Err(RunDirError::Locked { .. })));
        let id = first.run_id.clone();
        drop(first);

        let e = claim(&cfg(&dir)).unwrap_err().to_string();
        assert!(
            e.contains("already holds a run (metrics.jsonl, run.json, step-00000002)")
                && e.contains("--resume")
                && e.contains("--overwrite"),
            "{e}"
        );
        assert!(check(&cfg(&dir)).is_err());
        let resumed = TrainConfig {
            resume: Some("latest".into()),
            ..cfg(&dir)
        };
        check(&resumed).unwrap();
        assert_eq!(claim(&resumed).unwrap().run_id, id, "a resumed run keeps its id");

        let over = TrainConfig {
            overwrite: true,
            ..cfg(&dir)
        };
        check(&over).unwrap();
        let new = claim(&over).unwrap();
        assert_ne!(new.run_id, id);
        assert!(!dir.join("metrics.jsonl").exists() && !dir.join("step-00000002").exists());
        assert_eq!(fs::read_to_string(dir.join("notes.txt")).unwrap(), "mine");
        assert!(matches!(
            check(&TrainConfig {
                overwrite: true,
                resume: Some("latest".into()),
                ..cfg(&dir)
            }),
            Err(RunDirError::ResumeAndOverwrite)
        ));
    }
}
