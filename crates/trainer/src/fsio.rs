//! File operations whose errors say what was being done to which path.
//!
//! `std::io::Error` carries only the OS's words ("No space left on device (os error 28)"). Every
//! file operation of the trainer goes through [`IoContext::at`] (or a helper here built on it),
//! so the error a user sees reads `writing runs/x/.tmp-step-00000100/rank-00000.safetensors: No space
//! left on device (os error 28)`.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// A file operation that failed: what was being done (`writing`, `renaming ... to`), the path and
/// the OS's error.
#[derive(Debug, thiserror::Error)]
#[error("{op} {path}: {cause}")]
pub struct IoError {
    /// The operation, as a verb phrase that reads before the path ("creating directory").
    pub op: &'static str,
    /// The file or directory it was done to.
    pub path: PathBuf,
    /// The OS's error.
    pub cause: io::Error,
}

impl IoError {
    /// The OS's error kind (e.g. to tell "not found" from other failures).
    pub fn kind(&self) -> io::ErrorKind {
        self.cause.kind()
    }
}

/// Attach the operation and the path to an `io::Result`.
pub trait IoContext<T> {
    /// `Err(e)` becomes `IoError { op, path, cause: e }`.
    fn at(self, op: &'static str, path: &Path) -> Result<T, IoError>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn at(self, op: &'static str, path: &Path) -> Result<T, IoError> {
        self.map_err(|cause| IoError {
            op,
            path: path.to_path_buf(),
            cause,
        })
    }
}

/// The contents of the regular file `path`. Anything else is refused before it is read: a
/// device such as /dev/zero would never end, a directory cannot be read.
pub fn read(path: &Path) -> Result<Vec<u8>, IoError> {
    regular_file(path)?;
    fs::read(path).at("reading", path)
}

/// The contents of the regular file `path` as UTF-8 text (see [`read`]).
pub fn read_to_string(path: &Path) -> Result<String, IoError> {
    regular_file(path)?;
    fs::read_to_string(path).at("reading", path)
}

/// `Ok` when `path` is a regular file (or a link to one).
pub fn regular_file(path: &Path) -> Result<(), IoError> {
    let meta = fs::metadata(path).at("reading", path)?;
    if meta.is_file() {
        Ok(())
    } else {
        Err(IoError {
            op: "reading",
            path: path.to_path_buf(),
            cause: io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"),
        })
    }
}

/// Write `bytes` to a new file at `path` and fsync it, so it is on disk when this returns.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), IoError> {
    let mut f = File::create(path).at("creating", path)?;
    f.write_all(bytes).at("writing", path)?;
    f.sync_all().at("syncing", path)
}

/// fsync a directory, so the entries created or renamed in it are on disk.
pub fn sync_dir(dir: &Path) -> Result<(), IoError> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .at("syncing directory", dir)
}

/// Rename `from` to `to` (atomic within one file system); the error names both.
pub fn rename(from: &Path, to: &Path) -> Result<(), IoError> {
    fs::rename(from, to).map_err(|cause| IoError {
        op: "renaming",
        path: PathBuf::from(format!("{} to {}", from.display(), to.display())),
        cause,
    })
}

/// A JSON-lines file opened for appending; every error names the file.
pub struct JsonLines {
    file: File,
    path: PathBuf,
}

impl JsonLines {
    /// Open (creating if needed) `path` for appending.
    pub fn open_append(path: &Path) -> Result<Self, IoError> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .at("opening for append", path)?;
        Ok(Self {
            file,
            path: path.to_path_buf(),
        })
    }

    /// Append `value` as one line, in one write (lines of concurrent writers stay whole).
    pub fn write(&mut self, value: &impl serde::Serialize) -> Result<(), IoError> {
        let mut line = serde_json::to_string(value)
            .map_err(io::Error::other)
            .at("encoding a line of", &self.path)?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .at("appending to", &self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full disk (Linux's /dev/full answers every write with ENOSPC) is reported with the
    /// operation and the path, not only the OS's words.
    #[test]
    fn a_full_disk_names_the_operation_and_the_path() {
        let full = Path::new("/dev/full");
        if !full.exists() {
            eprintln!("skipped: no /dev/full on this system");
            return;
        }
        let e = write_synced(full, b"checkpoint bytes")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("writing /dev/full: "), "{e}");
        assert!(e.contains("No space left on device"), "{e}");

        let mut lines = JsonLines::open_append(full).unwrap();
        let e = lines
            .write(&serde_json::json!({"step": 1}))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("appending to /dev/full: "), "{e}");
        assert!(e.contains("No space left on device"), "{e}");
    }

    /// A device or a directory given where a file is expected is refused before reading (an
    /// endless /dev/zero would otherwise be read until memory runs out).
    #[test]
    fn only_regular_files_are_read() {
        for path in ["/dev/zero", "/"] {
            let path = Path::new(path);
            if !path.exists() {
                continue;
            }
            let e = read_to_string(path).unwrap_err().to_string();
            assert_eq!(e, format!("reading {}: not a regular file", path.display()));
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a.txt");
        std::fs::write(&file, "text").unwrap();
        assert_eq!(read_to_string(&file).unwrap(), "text");
    }

    #[test]
    fn a_missing_directory_names_the_operation_and_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("no/such/dir/file.bin");
        let e = write_synced(&missing, b"x").unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("creating {}: ", missing.display())),
            "{e}"
        );
        let to = dir.path().join("b");
        let e = rename(&missing, &to).unwrap_err().to_string();
        assert!(
            e.contains("renaming")
                && e.contains(&missing.display().to_string())
                && e.contains(" to "),
            "{e}"
        );
    }
}
