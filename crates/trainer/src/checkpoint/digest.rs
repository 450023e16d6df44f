//! Size and checksum of a checkpoint's files, checked before a byte of them is parsed.
//!
//! meta.json records the digest of each tensor file; meta.json's own digest is in `meta.digest`,
//! written after it. So every file of a checkpoint is covered: a truncated tensor file, a flipped
//! byte, or an edited step or data position in meta.json is refused on load, naming the file.
//!
//! A sharded checkpoint (format v3) also records the digest of every piece in its manifest, so a
//! reader that reads a few byte ranges of a shard file verifies exactly the bytes it uses.
//!
//! The checksum is 64-bit FNV-1a over the file's bytes: not cryptographic (it stops accidents
//! and hand edits, not an adversary), but any flipped or missing byte changes it.

use serde::{Deserialize, Serialize};

/// Size and checksum of one file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileDigest {
    /// Length in bytes.
    pub bytes: u64,
    /// 64-bit FNV-1a of the contents, as 16 hex digits.
    pub fnv1a64: String,
}

/// The digest of bytes fed in pieces (a file written or read a buffer at a time).
#[derive(Debug, Clone, Copy)]
pub struct Fnv1a64 {
    h: u64,
    bytes: u64,
}

impl Default for Fnv1a64 {
    fn default() -> Self {
        Self {
            h: 0xcbf2_9ce4_8422_2325,
            bytes: 0,
        }
    }
}

impl Fnv1a64 {
    /// Feeds `data`.
    pub fn update(&mut self, data: &[u8]) {
        for &b in data {
            self.h ^= b as u64;
            self.h = self.h.wrapping_mul(0x0100_0000_01b3);
        }
        self.bytes += data.len() as u64;
    }

    /// Size and checksum of everything fed so far.
    pub fn digest(&self) -> FileDigest {
        FileDigest {
            bytes: self.bytes,
            fnv1a64: format!("{:016x}", self.h),
        }
    }
}

impl FileDigest {
    /// The digest of `data`.
    pub fn of(data: &[u8]) -> Self {
        let mut h = Fnv1a64::default();
        h.update(data);
        h.digest()
    }

    /// `Ok` when `data`, the contents of `file`, has this digest; otherwise what differs.
    pub fn check(&self, file: &str, data: &[u8]) -> Result<(), String> {
        if data.len() as u64 != self.bytes {
            return Err(format!(
                "{file} has {} bytes but {} were recorded (truncated or overwritten)",
                data.len(),
                self.bytes
            ));
        }
        let got = Self::of(data);
        if got.fnv1a64 != self.fnv1a64 {
            return Err(format!(
                "{file} checksum {} does not match the recorded {} (corrupted or edited)",
                got.fnv1a64, self.fnv1a64
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a64_matches_the_reference_values() {
        // Published FNV-1a 64 test vectors: "" and "a".
        assert_eq!(FileDigest::of(b"").fnv1a64, "cbf29ce484222325");
        assert_eq!(FileDigest::of(b"a").fnv1a64, "af63dc4c8601ec8c");
    }

    #[test]
    fn any_change_is_named() {
        let d = FileDigest::of(b"{\"step\": 100}");
        assert!(d.check("meta.json", b"{\"step\": 100}").is_ok());
        let e = d.check("meta.json", b"{\"step\": 900}").unwrap_err();
        assert!(
            e.contains("meta.json checksum") && e.contains("edited"),
            "{e}"
        );
        let e = d.check("meta.json", b"{\"step\": 10}").unwrap_err();
        assert!(e.contains("truncated"), "{e}");
    }
}
