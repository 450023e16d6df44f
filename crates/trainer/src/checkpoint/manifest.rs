//! manifest.json of a sharded checkpoint (format v3): the layout that wrote it and, for every
//! stored piece, which elements of which parameter it holds and where its bytes are.
//!
//! ```text
//!   { "layout": { "dp": 4, "pp": 1, "tp": 1, "ep": 1, "zero_stage": 3, "precision": "f32" },
//!     "world_size": 4, "moments": true,
//!     "pieces": [ { "param": "h.0.attn.c_attn.weight", "full_shape": [192, 64],
//!                   "runs": [[0, 3072]], "rank": 0, "file": "rank-00000.safetensors",
//!                   "w": { "offset": 2048, "bytes": 12288, "fnv1a64": "…" }, "m": …, "v": … },
//!                 … ] }
//! ```
//!
//! `runs` are row-major element ranges of the single-device tensor, in the piece's storage
//! order; `offset` is absolute in the file. Each rank writes its own list beside its shard file;
//! rank 0 merges them ([`Manifest::merge`]) and checks that the pieces of every parameter cover
//! each of its elements exactly once ([`Manifest::check_coverage`]), which a reader checks again.

use std::collections::BTreeMap;
use std::ops::Range;

use serde::{Deserialize, Serialize};

/// The layout a checkpoint was written under (informational: any layout reads it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedLayout {
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
    pub ep: usize,
    /// The ZeRO stage (1, 2, 3), or None for DDP.
    pub zero_stage: Option<u8>,
    /// "f32", or "bf16" (mixed precision: the stored weights are the fp32 masters).
    pub precision: String,
}

/// Where the bytes of one kind of a piece are, and their checksum.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Span {
    /// Absolute byte offset in the file.
    pub offset: u64,
    /// Length in bytes (4 per element: little-endian f32).
    pub bytes: u64,
    /// 64-bit FNV-1a of those bytes.
    pub fnv1a64: String,
}

/// One stored piece of one parameter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PieceEntry {
    pub param: String,
    pub full_shape: Vec<usize>,
    /// `[start, end)` element ranges of the single-device tensor, in storage order.
    pub runs: Vec<[usize; 2]>,
    /// The world rank that wrote it.
    pub rank: usize,
    /// Its shard file, in the checkpoint directory.
    pub file: String,
    /// The weights (fp32 masters under mixed precision).
    pub w: Span,
    /// AdamW's moments (absent before the first optimizer step).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub m: Option<Span>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub v: Option<Span>,
}

impl PieceEntry {
    /// The runs as ranges.
    pub fn ranges(&self) -> Vec<Range<usize>> {
        self.runs.iter().map(|r| r[0]..r[1]).collect()
    }

    /// Elements it holds.
    pub fn numel(&self) -> usize {
        self.runs.iter().map(|r| r[1] - r[0]).sum()
    }

    /// The span of kind `tag` ("w", "m", "v").
    pub fn span(&self, tag: &str) -> Option<&Span> {
        match tag {
            "w" => Some(&self.w),
            "m" => self.m.as_ref(),
            "v" => self.v.as_ref(),
            _ => None,
        }
    }
}

/// What one rank wrote: `rank-NNNNN.json` until rank 0 merges it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankList {
    pub rank: usize,
    /// Its shard file and that file's digest (None: the rank stores nothing).
    pub file: Option<(String, super::FileDigest)>,
    pub pieces: Vec<PieceEntry>,
}

/// The contents of manifest.json.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub layout: SavedLayout,
    pub world_size: usize,
    /// Whether the pieces carry AdamW's moments.
    pub moments: bool,
    pub pieces: Vec<PieceEntry>,
}

impl Manifest {
    /// The manifest of every rank's list.
    pub fn merge(layout: SavedLayout, moments: bool, lists: Vec<RankList>) -> Self {
        let world_size = lists.len();
        let pieces = lists.into_iter().flat_map(|l| l.pieces).collect();
        Self {
            layout,
            world_size,
            moments,
            pieces,
        }
    }

    /// Indices of the pieces of each parameter, by name.
    pub fn by_param(&self) -> BTreeMap<&str, Vec<usize>> {
        let mut out: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, p) in self.pieces.iter().enumerate() {
            out.entry(p.param.as_str()).or_default().push(i);
        }
        out
    }

    /// `Ok` when the pieces of every parameter agree on its shape, have the spans they should
    /// (4 bytes per element; moments iff [`Manifest::moments`]) and cover each of its elements
    /// exactly once; otherwise every problem found, naming the parameter.
    pub fn check_coverage(&self) -> Result<(), String> {
        let mut problems = Vec::new();
        for (name, idx) in self.by_param() {
            let shape = &self.pieces[idx[0]].full_shape;
            let numel: usize = shape.iter().product();
            let mut runs = Vec::new();
            for &i in &idx {
                let p = &self.pieces[i];
                if &p.full_shape != shape {
                    problems.push(format!(
                        "`{name}`: rank {} has shape {:?}, rank {} {shape:?}",
                        p.rank, p.full_shape, self.pieces[idx[0]].rank
                    ));
                }
                let bytes = 4 * p.numel() as u64;
                for (tag, span) in [("w", Some(&p.w)), ("m", p.m.as_ref()), ("v", p.v.as_ref())] {
                    match span {
                        Some(s) if s.bytes != bytes => problems.push(format!(
                            "`{name}` {tag} of rank {}: {} bytes for {} elements",
                            p.rank,
                            s.bytes,
                            p.numel()
                        )),
                        None if self.moments => {
                            problems.push(format!("`{name}` of rank {} lacks {tag}", p.rank))
                        }
                        _ => {}
                    }
                }
                runs.extend(p.runs.iter().map(|r| (r[0], r[1], p.rank)));
            }
            runs.sort_unstable();
            let mut at = 0;
            for (s, e, rank) in runs {
                if s < at {
                    problems.push(format!(
                        "`{name}`: the piece of rank {rank} at {s}..{e} overlaps another before \
                         element {at}"
                    ));
                } else if s > at {
                    problems.push(format!("`{name}`: elements {at}..{s} are in no piece"));
                }
                at = at.max(e);
            }
            if at != numel {
                problems.push(format!(
                    "`{name}`: pieces cover {at} of its {numel} elements"
                ));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(rank: usize, runs: Vec<[usize; 2]>) -> PieceEntry {
        let n: usize = runs.iter().map(|r| r[1] - r[0]).sum();
        let span = Span {
            offset: 0,
            bytes: 4 * n as u64,
            fnv1a64: String::new(),
        };
        PieceEntry {
            param: "w".into(),
            full_shape: vec![2, 4],
            runs,
            rank,
            file: format!("rank-{rank:05}.safetensors"),
            w: span,
            m: None,
            v: None,
        }
    }

    fn manifest(pieces: Vec<PieceEntry>) -> Manifest {
        let layout = SavedLayout {
            dp: 1,
            pp: 1,
            tp: 2,
            ep: 1,
            zero_stage: None,
            precision: "f32".into(),
        };
        Manifest::merge(
            layout,
            false,
            vec![RankList {
                rank: 0,
                file: None,
                pieces,
            }],
        )
    }

    #[test]
    fn pieces_must_cover_each_element_once() {
        // Column halves of a (2, 4) tensor over tp = 2.
        let ok = manifest(vec![
            piece(0, vec![[0, 2], [4, 6]]),
            piece(1, vec![[2, 4], [6, 8]]),
        ]);
        ok.check_coverage().unwrap();
        let gap = manifest(vec![piece(0, vec![[0, 2], [4, 6]]), piece(1, vec![[6, 8]])]);
        let e = gap.check_coverage().unwrap_err();
        assert!(e.contains("elements 2..4 are in no piece"), "{e}");
        let short = manifest(vec![piece(0, vec![[0, 2], [4, 6]]), piece(1, vec![[2, 4]])]);
        let e = short.check_coverage().unwrap_err();
        assert!(e.contains("pieces cover 6 of its 8 elements"), "{e}");
        let twice = manifest(vec![piece(0, vec![[0, 8]]), piece(1, vec![[2, 4], [6, 8]])]);
        let e = twice.check_coverage().unwrap_err();
        assert!(e.contains("rank 1 at 2..4 overlaps"), "{e}");
    }
}
