//! One rank's shard file: a safetensors file of 1-D f32 tensors written one piece at a time, and
//! verified reads of one piece's bytes.
//!
//! ```text
//!   rank-00002.safetensors
//!   | u64 header length n | header JSON (n bytes, space-padded to 8) | data ...              |
//!                           {"w.h.0.ln_1.weight": {"dtype": "F32", "shape": [16],
//!                            "data_offsets": [0, 64]}, "m.h.0.ln_1.weight": …}
//! ```
//!
//! The header is written first (every piece's size is known before its values are), then each
//! piece's values are converted and hashed a buffer at a time, so writing holds one piece at
//! most, and a reader copies the parts it needs while it checks a piece a buffer at a time.
//! The file is an ordinary safetensors file any reader opens; the manifest records each
//! tensor's absolute offset and checksum, so a reader seeks straight to the bytes it needs.

use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::Path;

use serde_json::{json, Map, Value};

use super::digest::{FileDigest, Fnv1a64};
use super::manifest::Span;
use crate::fsio::{IoContext, IoError};

/// Elements converted to bytes per write (and per read).
const CHUNK: usize = 1 << 13;

/// Writes the f32 tensors `entries` (name, shape) to the safetensors file `path` (with
/// `metadata` in its header), asking `values(i)` for entry i's values in order, one at a time;
/// fsyncs it and returns the file's digest and each entry's span.
pub fn write_safetensors(
    path: &Path,
    metadata: &[(&str, &str)],
    entries: &[(String, Vec<usize>)],
    mut values: impl FnMut(usize) -> anyhow::Result<Vec<f32>>,
) -> anyhow::Result<(FileDigest, Vec<Span>)> {
    let mut header = Map::new();
    if !metadata.is_empty() {
        let meta: Map<String, Value> = metadata
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        header.insert("__metadata__".into(), Value::Object(meta));
    }
    let mut at = 0usize;
    for (name, shape) in entries {
        let n: usize = shape.iter().product();
        header.insert(
            name.clone(),
            json!({"dtype": "F32", "shape": shape, "data_offsets": [at, at + 4 * n]}),
        );
        at += 4 * n;
    }
    let mut text = serde_json::to_vec(&Value::Object(header))?;
    while (8 + text.len()) % 8 != 0 {
        text.push(b' ');
    }
    let data_start = (8 + text.len()) as u64;
    let file = File::create(path).at("creating", path)?;
    let mut out = BufWriter::new(file);
    let mut whole = Fnv1a64::default();
    let mut put = |bytes: &[u8], h: &mut Fnv1a64| -> Result<(), IoError> {
        whole.update(bytes);
        h.update(bytes);
        out.write_all(bytes).at("writing", path)
    };
    let mut scratch = Fnv1a64::default();
    put(&(text.len() as u64).to_le_bytes(), &mut scratch)?;
    put(&text, &mut scratch)?;
    let mut spans = Vec::with_capacity(entries.len());
    let mut offset = data_start;
    let mut buf = Vec::with_capacity(4 * CHUNK);
    for (i, (name, shape)) in entries.iter().enumerate() {
        let data = values(i)?;
        let n: usize = shape.iter().product();
        anyhow::ensure!(
            data.len() == n,
            "{name} has {} values, {n} were announced",
            data.len()
        );
        let mut h = Fnv1a64::default();
        for chunk in data.chunks(CHUNK) {
            buf.clear();
            for x in chunk {
                buf.extend_from_slice(&x.to_le_bytes());
            }
            put(&buf, &mut h)?;
        }
        let d = h.digest();
        spans.push(Span {
            offset,
            bytes: d.bytes,
            fnv1a64: d.fnv1a64,
        });
        offset += d.bytes;
    }
    let file = out
        .into_inner()
        .map_err(|e| e.into_error())
        .at("writing", path)?;
    file.sync_all().at("syncing", path)?;
    Ok((whole.digest(), spans))
}

/// Reads the piece `span` of the file `path` with one seek, a buffer at a time, checking its
/// checksum over every byte, and copies the parts `(to, from, n)` (elements `from .. from + n`
/// of the piece to `out[to .. to + n]`) on the way, so only the buffer is held beyond `out`.
/// `Ok(Err(why))` when the bytes are not the recorded ones (the caller names piece, file, rank).
pub fn read_span_into(
    path: &Path,
    span: &Span,
    parts: &[(usize, usize, usize)],
    out: &mut [f32],
) -> anyhow::Result<Result<(), String>> {
    let mut f = File::open(path).at("opening", path)?;
    f.seek(SeekFrom::Start(span.offset))
        .at("seeking in", path)?;
    let mut h = Fnv1a64::default();
    let n = (span.bytes / 4) as usize;
    let mut buf = vec![0u8; 4 * CHUNK.min(n.max(1))];
    let mut at = 0; // element of the piece at buf[0]
    while at < n {
        let take = (n - at).min(CHUNK);
        if let Err(e) = f.read_exact(&mut buf[..4 * take]) {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                return Ok(Err("the file ends before the piece does (truncated)".into()));
            }
            return Err(IoError {
                op: "reading",
                path: path.to_path_buf(),
                cause: e,
            }
            .into());
        }
        h.update(&buf[..4 * take]);
        for &(to, from, len) in parts {
            let (lo, hi) = (from.max(at), (from + len).min(at + take));
            for k in lo..hi {
                let b = &buf[4 * (k - at)..4 * (k - at) + 4];
                out[to + k - from] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        at += take;
    }
    let got = h.digest();
    if got.fnv1a64 != span.fnv1a64 {
        return Ok(Err(format!(
            "checksum {} of bytes {}..{} does not match the recorded {} (corrupted or edited)",
            got.fnv1a64,
            span.offset,
            span.offset + span.bytes,
            span.fnv1a64
        )));
    }
    Ok(Ok(()))
}

/// The digest of the whole file at `path`, read a buffer at a time.
pub(super) fn digest_of(path: &Path) -> Result<FileDigest, IoError> {
    let mut f = File::open(path).at("opening", path)?;
    let mut h = Fnv1a64::default();
    let mut buf = vec![0u8; 4 * CHUNK];
    loop {
        let n = f.read(&mut buf).at("reading", path)?;
        if n == 0 {
            return Ok(h.digest());
        }
        h.update(&buf[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_file_is_safetensors_and_reads_back_by_span() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("rank-00000.safetensors");
        let a: Vec<f32> = (0..5).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..70_000).map(|i| i as f32 * 0.5).collect();
        let entries = [
            ("w.a".to_string(), vec![5]),
            ("w.b".to_string(), vec![70_000]),
        ];
        let (digest, spans) = write_safetensors(&path, &[], &entries, |i| Ok([&a, &b][i].clone()))?;
        let bytes = std::fs::read(&path)?;
        assert_eq!(digest, FileDigest::of(&bytes));
        let st = safetensors::SafeTensors::deserialize(&bytes)?;
        assert_eq!(st.tensor("w.b")?.shape(), &[70_000]);
        let read = |i: usize, n: usize| -> anyhow::Result<Result<Vec<f32>, String>> {
            let mut out = vec![0f32; n];
            Ok(read_span_into(&path, &spans[i], &[(0, 0, n)], &mut out)?.map(|_| out))
        };
        assert_eq!(read(1, b.len())?.unwrap(), b);
        assert_eq!(read(0, 5)?.unwrap(), a);
        // Parts of a piece, across buffers: b[8190..8194] and b[3..5].
        let mut out = vec![0f32; 6];
        read_span_into(&path, &spans[1], &[(0, 8190, 4), (4, 3, 2)], &mut out)?.unwrap();
        assert_eq!(out, [&b[8190..8194], &b[3..5]].concat());
        let mut bad = bytes.clone();
        bad[spans[1].offset as usize + 9] ^= 1;
        std::fs::write(&path, &bad)?;
        assert!(read(1, b.len())?.unwrap_err().contains("checksum"));
        assert_eq!(read(0, 5)?.unwrap(), a, "other pieces still read");
        Ok(())
    }
}
