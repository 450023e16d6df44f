//! A disk cache for the compiled kernels, so only the first process on a machine pays NVRTC.
//!
//! ```text
//!   key = FNV-1a 64 of (source, compile options, architecture)
//!   $MTRAIN_KERNEL_CACHE (default $XDG_CACHE_HOME/mtrain/kernels, else ~/.cache/mtrain/kernels)
//!     └── {module}-{key:016x}.ptx      written to a temporary name, then renamed (atomic)
//! ```
//!
//! Any change of the source or the options gives a new key, so a stale file is never read. The
//! cache is best effort: a directory that cannot be created or written only means compiling
//! again; `MTRAIN_KERNEL_CACHE=off` turns it off.

use std::path::{Path, PathBuf};

/// FNV-1a over the parts, with a separator byte between them (stable across builds and
/// platforms, unlike `std`'s hasher).
pub fn key(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.bytes().chain(std::iter::once(0xff)) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The cache directory from the environment, or None when caching is off or no home is known.
pub fn dir() -> Option<PathBuf> {
    match std::env::var_os("MTRAIN_KERNEL_CACHE") {
        Some(v) if v == "off" || v.is_empty() => None,
        Some(v) => Some(PathBuf::from(v)),
        None => std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))
            .map(|c| c.join("mtrain").join("kernels")),
    }
}

/// The PTX of `module` under `key`: read from `dir` when present, else `compile()`d and stored
/// there (errors storing it are ignored). Returns the PTX and whether it came from the cache.
pub fn get_or_compile<E>(
    dir: Option<&Path>,
    module: &str,
    key: u64,
    compile: impl FnOnce() -> Result<String, E>,
) -> Result<(String, bool), E> {
    let path = dir.map(|d| d.join(format!("{module}-{key:016x}.ptx")));
    if let Some(p) = &path {
        if let Ok(text) = std::fs::read_to_string(p) {
            if !text.is_empty() {
                return Ok((text, true));
            }
        }
    }
    let ptx = compile()?;
    if let (Some(d), Some(p)) = (dir, &path) {
        // A unique temporary name per process, renamed into place: concurrent ranks compiling
        // the same module never see a half-written file.
        let tmp = d.join(format!(".{module}-{key:016x}.{}.tmp", std::process::id()));
        let stored = std::fs::create_dir_all(d)
            .and_then(|_| std::fs::write(&tmp, &ptx))
            .and_then(|_| std::fs::rename(&tmp, p));
        if stored.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok((ptx, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("mtrain-ptx-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn second_lookup_reads_what_the_first_compiled() {
        let d = scratch("hit");
        let k = key(&["source", "-DELEM_BF16=1", "compute_90"]);
        let (a, cached) =
            get_or_compile::<()>(Some(&d), "m", k, || Ok("ptx text".to_string())).unwrap();
        assert_eq!((a.as_str(), cached), ("ptx text", false));
        let (b, cached) = get_or_compile::<()>(Some(&d), "m", k, || {
            panic!("compiled again although the cache holds the module")
        })
        .unwrap();
        assert_eq!((b.as_str(), cached), ("ptx text", true));
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, vec![format!("m-{k:016x}.ptx")]);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn any_change_of_source_or_options_is_a_new_key() {
        let base = key(&["source", "-DELEM_BF16=1", "compute_90"]);
        assert_ne!(base, key(&["source ", "-DELEM_BF16=1", "compute_90"]));
        assert_ne!(base, key(&["source", "-DELEM_BF16=0", "compute_90"]));
        assert_ne!(base, key(&["source", "-DELEM_BF16=1", "compute_80"]));
        // Parts are separated: moving a character across a boundary changes the key.
        assert_ne!(key(&["ab", "c"]), key(&["a", "bc"]));
        assert_eq!(base, key(&["source", "-DELEM_BF16=1", "compute_90"]));
    }

    #[test]
    fn no_directory_or_an_unwritable_one_still_compiles() {
        let (a, cached) = get_or_compile::<()>(None, "m", 1, || Ok("x".into())).unwrap();
        assert_eq!((a.as_str(), cached), ("x", false));
        // A path under a regular file cannot be a directory.
        let f = scratch("file");
        std::fs::write(&f, "not a directory").unwrap();
        let under = f.join("kernels");
        let (b, cached) = get_or_compile::<()>(Some(&under), "m", 1, || Ok("y".into())).unwrap();
        assert_eq!((b.as_str(), cached), ("y", false));
        let e = get_or_compile(Some(&under), "m", 2, || Err("nvrtc failed")).unwrap_err();
        assert_eq!(e, "nvrtc failed");
        let _ = std::fs::remove_file(&f);
    }
}
