//! `--trace`: every collective of every process group, per rank, as JSON lines; and, when a run
//! fails, the last operations of every group on this rank.
//!
//! ```text
//!   RUN_DIR/trace-rank3.jsonl
//!   {"op":"all_reduce","group":"dp[1,3]","seq":41,"bytes":1048576,"bytes_sent":1048576,
//!    "start_us":912345,"end_us":913002,"peer":null}
//! ```
//!
//! Each group's [`Tracer`](mtrain_comm::Tracer) always keeps its last few ops; `--trace` turns on
//! recording of all of them. Sequence numbers count per group, so lining up the files of two
//! ranks shows which collective one of them never reached: on a hang or a dead peer every rank
//! prints [`recent_ops`], and the rank whose `seq` stops short is the one the others wait for.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use mtrain_comm::{Comm, TraceEvent};

/// Writes every recorded event of `groups` to `run_dir/trace-rank{rank}.jsonl`, ordered by start
/// time. Returns the file's path.
pub fn write_rank_trace(run_dir: &Path, rank: usize, groups: &[Comm]) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    let path = run_dir.join(format!("trace-rank{rank}.jsonl"));
    let mut events: Vec<TraceEvent> = groups.iter().flat_map(|g| g.tracer().events()).collect();
    events.sort_by_key(|e| (e.start_us, e.seq));
    let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    let mut out = BufWriter::new(file);
    for e in &events {
        serde_json::to_writer(&mut out, e)
            .map_err(std::io::Error::from)
            .and_then(|_| out.write_all(b"\n"))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    out.flush()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// The last operations of every group on this rank, as text (one line per op).
pub fn recent_ops(rank: usize, groups: &[Comm]) -> String {
    let mut s =
        format!("rank {rank}: last collectives per group (seq, op, bytes, start..end us)\n");
    for g in groups {
        let recent = g.tracer().recent();
        if recent.is_empty() {
            continue;
        }
        s.push_str(&format!("  rank {rank} group {}:\n", g.name()));
        for e in recent {
            let peer = e.peer.map(|p| format!(" peer {p}")).unwrap_or_default();
            s.push_str(&format!(
                "    #{} {:?} {} B{} {}..{}\n",
                e.seq, e.op, e.bytes, peer, e.start_us, e.end_us
            ));
        }
    }
    s
}

/// One trace file read back.
pub fn read_trace(path: &Path) -> anyhow::Result<Vec<serde_json::Value>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).with_context(|| format!("a line of {}", path.display())))
        .collect()
}
