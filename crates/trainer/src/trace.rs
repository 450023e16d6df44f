//! `--trace`: every collective of every process group, per rank, as JSON lines, each tagged with
//! the part of the run that issued it; a Chrome trace of the whole job; when a run fails, the last
//! operations of every group on this rank; and, traced or not, each step's communication figures.
//!
//! ```text
//!   RUN_DIR/trace-rank3.jsonl
//!   {"op":"all_reduce","group":"dp","seq":41,"bytes":1048576,"bytes_sent":1048576,
//!    "start_us":912345,"end_us":913002,"peer":null,
//!    "site":"crates/parallel/src/ddp/buckets.rs:152","phase":"step","step":7}
//!   RUN_DIR/trace.json        Trace Event Format (chrome://tracing, ui.perfetto.dev)
//!     pid = rank             tid 0 "phase"    setup | step 0 | eval | step 1 | ... | checkpoint
//!                            tid 1 "compute"  forward / backward per micro-batch (pipeline),
//!                                             forward+backward, grad norm, optimizer, eval, gather
//!                            tid 2.. one per group ("tp [0, 1]", "pp [0, 2]", ...): its collectives,
//!                                    each with the file and line that issued it (`args.site`)
//! ```
//!
//! **Phases.** A collective belongs to the phase its rank was in when it was issued: `setup`
//! (building the model, checking the initialisation), `step` (from the step's first forward to
//! the end of its optimizer step, with the step's number: the n-th step this process ran), `eval`,
//! `checkpoint` (gathering the state) or `other`. `mtrain plan --compare` prices the `step`
//! collectives only, so startup, evaluation and checkpoint traffic is not mistaken for the step's.
//!
//! **Step figures.** Every group's [`Tracer`](mtrain_comm::Tracer) keeps running totals (ops,
//! bytes sent, busy time, time callers sat blocked); [`CommMeter`] reads them over every group of
//! the rank at the start and the end of a step, so each step's figures count every collective
//! issued in it, whichever layer issued it (tensor-parallel all-reduces, pipeline sends, expert
//! all-to-alls, the data-parallel reduction, the loss and norm reductions).
//!
//! Each group's tracer always keeps its last few ops; `--trace` turns on recording of all of them.
//! Sequence numbers count per group (collectives, and sends and receives per peer), so lining up
//! the files of two ranks shows which collective one of them never reached: on a hang or a dead
//! peer every rank prints [`recent_ops`], and the rank whose `seq` stops short is the one the
//! others wait for.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use mtrain_comm::{Comm, DeviceMesh, TraceEvent, TraceTotals};
use serde::Serialize;
use serde_json::{json, Value};

/// Every distinct group of the mesh (size-1 groups included: they cost nothing to list).
pub fn mesh_groups(mesh: &DeviceMesh) -> Vec<Comm> {
    let mut seen = std::collections::BTreeSet::new();
    [
        &mesh.world,
        &mesh.dp,
        &mesh.pp,
        &mesh.tp,
        &mesh.ep,
        &mesh.edp,
        &mesh.mp,
        &mesh.cp,
        &mesh.dcp,
    ]
    .into_iter()
    .filter(|g| seen.insert(g.name().to_string()))
    .cloned()
    .collect()
}

/// The communication of one step on one rank: the difference of the trace totals of every
/// group with more than one rank, read when the step starts and when it ends.
pub struct CommMeter {
    groups: Vec<Comm>,
    start: Option<Vec<TraceTotals>>,
}

impl CommMeter {
    /// A meter over `groups` (groups of one rank send nothing and are left out).
    pub fn new(groups: &[Comm]) -> Self {
        Self {
            groups: groups.iter().filter(|g| g.size() > 1).cloned().collect(),
            start: None,
        }
    }

    fn read(&self) -> Vec<TraceTotals> {
        self.groups.iter().map(|g| g.tracer().totals()).collect()
    }

    /// A step starts: what the groups did so far is not its.
    pub fn begin(&mut self) {
        self.start = Some(self.read());
    }

    /// The step ends: everything since [`CommMeter::begin`], summed over the groups, and each
    /// group's part by its name.
    pub fn end(&mut self) -> (TraceTotals, Vec<(String, TraceTotals)>) {
        let now = self.read();
        let start = self.start.take().unwrap_or_else(|| now.clone());
        let parts: Vec<(String, TraceTotals)> = self
            .groups
            .iter()
            .zip(now.into_iter().zip(start))
            .map(|(g, (now, start))| (g.name().to_string(), now - start))
            .collect();
        let total = parts.iter().fold(TraceTotals::default(), |acc, (_, t)| acc + *t);
        (total, parts)
    }
}

/// The part of a run a rank is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RunPhase {
    /// Building the model and checking its initialisation.
    Setup,
    /// One training step: forward/backward of every micro-batch, the norm, the optimizer step.
    Step,
    /// Validation loss.
    Eval,
    /// Gathering the full state for a checkpoint.
    Checkpoint,
    /// Anything else between steps (logging, loading a checkpoint).
    Other,
}

/// A phase and, for a step, its number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PhaseMark {
    at_us: u64,
    phase: RunPhase,
    step: Option<u64>,
}

/// A span of compute on the rank's main thread.
#[derive(Debug, Clone)]
struct ComputeSpan {
    name: String,
    start_us: u64,
    end_us: u64,
    mb: Option<usize>,
}

#[derive(Debug)]
struct TimelineInner {
    /// Unix time (µs) of the tracers' epoch: lines up the ranks of one machine.
    epoch_unix_us: f64,
    phases: Vec<PhaseMark>,
    spans: Vec<ComputeSpan>,
}

/// What a rank did when, on its tracers' clock: the phases that tag its collectives and the
/// compute spans of the Chrome trace. Cloning shares it; it records only under `--trace`.
#[derive(Debug, Clone)]
pub struct Timeline {
    clock: mtrain_comm::Tracer,
    recording: bool,
    inner: Arc<Mutex<TimelineInner>>,
}

impl Timeline {
    /// A timeline on the clock of `groups` (the tracers of one process share their epoch),
    /// starting in [`RunPhase::Setup`]; `recording` is `--trace`.
    pub fn new(groups: &[Comm], recording: bool) -> Self {
        let clock = groups
            .first()
            .map(|g| g.tracer().clone())
            .unwrap_or_default();
        let since_epoch = clock.epoch().elapsed();
        let now_unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let epoch_unix_us = now_unix.saturating_sub(since_epoch).as_secs_f64() * 1e6;
        let inner = TimelineInner {
            epoch_unix_us,
            phases: vec![PhaseMark {
                at_us: 0,
                phase: RunPhase::Setup,
                step: None,
            }],
            spans: Vec::new(),
        };
        Self {
            clock,
            recording,
            inner: Arc::new(Mutex::new(inner)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TimelineInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Microseconds on the tracers' clock.
    pub fn now_us(&self) -> u64 {
        self.clock.now_us()
    }

    /// The tracers' clock at a wall-clock instant (for spans measured with `SystemTime`).
    pub fn us_at(&self, t: SystemTime) -> u64 {
        let unix = t
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64()
            * 1e6;
        (unix - self.lock().epoch_unix_us).max(0.0) as u64
    }

    /// The rank enters `phase` now (`step` numbers a [`RunPhase::Step`]); entering the phase it
    /// is already in changes nothing.
    pub fn enter(&self, phase: RunPhase, step: Option<u64>) {
        if !self.recording {
            return;
        }
        let at_us = self.now_us();
        let mut inner = self.lock();
        if inner
            .phases
            .last()
            .is_some_and(|m| (m.phase, m.step) == (phase, step))
        {
            return;
        }
        inner.phases.push(PhaseMark { at_us, phase, step });
    }

    /// A compute span `name` (micro-batch `mb`) from `start_us` to `end_us`.
    pub fn span(&self, name: &str, mb: Option<usize>, start_us: u64, end_us: u64) {
        if !self.recording {
            return;
        }
        self.lock().spans.push(ComputeSpan {
            name: name.to_string(),
            start_us,
            end_us: end_us.max(start_us),
            mb,
        });
    }

    /// The phase (and step) at `at_us`.
    fn phase_at(phases: &[PhaseMark], at_us: u64) -> (RunPhase, Option<u64>) {
        let i = phases.partition_point(|m| m.at_us <= at_us);
        phases
            .get(i.saturating_sub(1))
            .map_or((RunPhase::Setup, None), |m| (m.phase, m.step))
    }
}

/// One line of `trace-rank{N}.jsonl`: the collective and the phase that issued it.
#[derive(Serialize)]
struct TaggedEvent<'a> {
    #[serde(flatten)]
    event: &'a TraceEvent,
    #[serde(skip_serializing_if = "Option::is_none")]
    phase: Option<RunPhase>,
    #[serde(skip_serializing_if = "Option::is_none")]
    step: Option<u64>,
}

/// Writes every recorded event of `groups` to `run_dir/trace-rank{rank}.jsonl`, ordered by start
/// time, each tagged with its phase when a `timeline` is given; with one, also this rank's part
/// of the Chrome trace, `run_dir/trace-rank{rank}.chrome.json` ([`merge_chrome_traces`] joins
/// the parts into `trace.json`). Returns the JSON-lines file's path.
pub fn write_rank_trace(
    run_dir: &Path,
    rank: usize,
    groups: &[Comm],
    timeline: Option<&Timeline>,
) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    let path = run_dir.join(format!("trace-rank{rank}.jsonl"));
    let mut events: Vec<TraceEvent> = groups.iter().flat_map(|g| g.tracer().events()).collect();
    events.sort_by_key(|e| (e.start_us, e.seq));
    let phases = timeline.map(|t| t.lock().phases.clone());
    let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    let mut out = BufWriter::new(file);
    for e in &events {
        let (phase, step) = match &phases {
            Some(p) => {
                let (phase, step) = Timeline::phase_at(p, e.start_us);
                (Some(phase), step)
            }
            None => (None, None),
        };
        let line = TaggedEvent {
            event: e,
            phase,
            step,
        };
        serde_json::to_writer(&mut out, &line)
            .map_err(std::io::Error::from)
            .and_then(|_| out.write_all(b"\n"))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    out.flush()
        .with_context(|| format!("writing {}", path.display()))?;
    if let Some(t) = timeline {
        let part = chrome_part(rank, groups, &events, t);
        let part_path = chrome_part_path(run_dir, rank);
        std::fs::write(&part_path, serde_json::to_vec(&part)?)
            .with_context(|| format!("writing {}", part_path.display()))?;
    }
    Ok(path)
}

fn chrome_part_path(run_dir: &Path, rank: usize) -> PathBuf {
    run_dir.join(format!("trace-rank{rank}.chrome.json"))
}

/// Thread ids of a rank's Chrome events.
const TID_PHASE: usize = 0;
const TID_COMPUTE: usize = 1;

/// One rank's Chrome trace: metadata naming the process and threads, then complete ("X")
/// events with `ts` and `dur` in µs of Unix time (the merge shifts them to start at 0).
fn chrome_part(rank: usize, groups: &[Comm], events: &[TraceEvent], t: &Timeline) -> Value {
    let inner = t.lock();
    let base = inner.epoch_unix_us;
    let end_us = events
        .iter()
        .map(|e| e.end_us)
        .chain(inner.spans.iter().map(|s| s.end_us))
        .chain([t.now_us()])
        .max()
        .unwrap_or(0);
    let mut out = vec![
        json!({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": format!("rank {rank}")}}),
        json!({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}),
    ];
    let mut shown: Vec<&Comm> = groups.iter().filter(|g| g.size() > 1).collect();
    shown.sort_by(|a, b| a.name().cmp(b.name()));
    let names: Vec<&str> = shown.iter().map(|g| g.name()).collect();
    let labels = shown
        .iter()
        .map(|g| format!("{} {:?}", g.name(), g.global_ranks()));
    let threads = ["phase".to_string(), "compute".to_string()]
        .into_iter()
        .chain(labels);
    for (tid, name) in threads.enumerate() {
        out.push(json!({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}}));
        out.push(json!({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}}));
    }
    let x = |name: String, cat: &str, tid: usize, start: u64, end: u64, args: Value| {
        json!({
            "ph": "X", "name": name, "cat": cat, "pid": rank, "tid": tid,
            "ts": base + start as f64, "dur": end.saturating_sub(start) as f64, "args": args,
        })
    };
    for (i, m) in inner.phases.iter().enumerate() {
        let until = inner.phases.get(i + 1).map_or(end_us, |n| n.at_us);
        let name = match (m.phase, m.step) {
            (RunPhase::Step, Some(s)) => format!("step {s}"),
            (p, _) => serde_json::to_value(p)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default(),
        };
        let args = json!({"phase": m.phase, "step": m.step});
        out.push(x(name, "phase", TID_PHASE, m.at_us, until, args));
    }
    for s in &inner.spans {
        let args = json!({"mb": s.mb});
        out.push(x(
            s.name.clone(),
            "compute",
            TID_COMPUTE,
            s.start_us,
            s.end_us,
            args,
        ));
    }
    // A group runs its ops one after another: each is drawn from when it could start (its issue,
    // or the end of the group's previous op), so the events of one thread never overlap.
    let mut prev_end: std::collections::BTreeMap<&str, u64> = Default::default();
    // In the order they ran: a group's ops finish in issue order (sequence numbers count per
    // kind of op, so they do not give it).
    let mut sorted: Vec<&TraceEvent> = events.iter().collect();
    sorted.sort_by_key(|e| (e.group.clone(), e.end_us, e.start_us));
    for e in sorted {
        let Some(i) = names.iter().position(|n| *n == e.group) else {
            continue;
        };
        let prev = prev_end.entry(e.group.as_str()).or_insert(0);
        let start = e.start_us.max(*prev);
        *prev = (*prev).max(e.end_us);
        let (phase, step) = Timeline::phase_at(&inner.phases, e.start_us);
        let args = json!({
            "group": e.group, "seq": e.seq, "bytes": e.bytes, "bytes_sent": e.bytes_sent,
            "peer": e.peer, "issued_us": base + e.start_us as f64, "phase": phase, "step": step,
            "site": e.site,
        });
        out.push(x(e.op.to_string(), "comm", 2 + i, start, e.end_us, args));
    }
    Value::Array(out)
}

/// Joins the ranks' Chrome parts (`trace-rank{N}.chrome.json`, N < `world`) into
/// `run_dir/trace.json`, time shifted so the earliest event is at 0, and removes the parts.
pub fn merge_chrome_traces(run_dir: &Path, world: usize) -> anyhow::Result<PathBuf> {
    let mut all = Vec::new();
    for rank in 0..world {
        let path = chrome_part_path(run_dir, rank);
        let text = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        let Value::Array(events) =
            serde_json::from_slice(&text).with_context(|| format!("parsing {}", path.display()))?
        else {
            anyhow::bail!("{}: not a list of trace events", path.display());
        };
        all.extend(events);
    }
    let t0 = all
        .iter()
        .filter_map(|e| e["ts"].as_f64())
        .fold(f64::INFINITY, f64::min);
    for e in &mut all {
        if let Some(ts) = e["ts"].as_f64() {
            e["ts"] = json!(ts - t0);
        }
        if let Some(ts) = e["args"]["issued_us"].as_f64() {
            e["args"]["issued_us"] = json!(ts - t0);
        }
    }
    let path = run_dir.join("trace.json");
    let doc = json!({"traceEvents": all, "displayTimeUnit": "ms"});
    std::fs::write(&path, serde_json::to_vec(&doc)?)
        .with_context(|| format!("writing {}", path.display()))?;
    for rank in 0..world {
        let part = chrome_part_path(run_dir, rank);
        std::fs::remove_file(&part).with_context(|| format!("removing {}", part.display()))?;
    }
    Ok(path)
}

/// The last operations of every group on this rank, as text (one line per op).
pub fn recent_ops(rank: usize, groups: &[Comm]) -> String {
    let mut s =
        format!("rank {rank}: last collectives per group (seq, op, bytes, start..end us, site)\n");
    for g in groups {
        let recent = g.tracer().recent();
        if recent.is_empty() {
            continue;
        }
        s.push_str(&format!("  rank {rank} group {}:\n", g.name()));
        for e in recent {
            let peer = e.peer.map(|p| format!(" peer {p}")).unwrap_or_default();
            s.push_str(&format!(
                "    #{} {:?} {} B{} {}..{} at {}\n",
                e.seq, e.op, e.bytes, peer, e.start_us, e.end_us, e.site
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A collective takes the phase in force when it was issued; before the first mark, setup.
    #[test]
    fn an_event_takes_the_phase_it_was_issued_in() {
        let mark = |at_us, phase, step| PhaseMark { at_us, phase, step };
        let phases = [
            mark(0, RunPhase::Setup, None),
            mark(100, RunPhase::Step, Some(0)),
            mark(200, RunPhase::Eval, None),
            mark(300, RunPhase::Step, Some(1)),
        ];
        let at = |us| Timeline::phase_at(&phases, us);
        assert_eq!(at(0), (RunPhase::Setup, None));
        assert_eq!(at(99), (RunPhase::Setup, None));
        assert_eq!(at(100), (RunPhase::Step, Some(0)));
        assert_eq!(at(250), (RunPhase::Eval, None));
        assert_eq!(at(10_000), (RunPhase::Step, Some(1)));
    }
}
