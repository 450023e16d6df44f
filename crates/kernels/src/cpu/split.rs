//! How the CPU loops use more than one thread: an op's output rows (or fixed spans of an
//! element-wise op) are split over rayon's pool when the op is large enough to pay for the
//! split, and a sum over rows is split by blocks of columns, each column still summed in row
//! order. Every element comes out of the same arithmetic in the same order on any number of
//! threads, so a result does not depend on the thread count, bit for bit.
//!
//! ```text
//!   an op's output (N × C)            a sum over rows (C,)
//!   ┌─────────────┐ rows  0..k  t0    cols 0..16 │ 16..32 │ ...
//!   ├─────────────┤ rows  k..2k t1         t0    │   t1   │ ...   each column: rows 0, 1, .., N−1
//!   └─────────────┘ ...                                          in order, as on one thread
//! ```
//!
//! Below [`split_min`] elements an op runs on the calling thread alone: handing half of it to
//! another thread (waking it, stealing the task, joining) costs more than the half saves. The
//! threshold is measured (docs/journal.md, "Two cores"), and [`set_split_min`] moves it for
//! such a measurement.

use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;

/// The default [`split_min`], in elements of the op's output (or of its input, for sums).
pub const DEFAULT_SPLIT_MIN: usize = 16 * 1024;
/// The fewest elements one task of a split op takes: an op is cut into pieces of at least this.
const TASK_MIN: usize = 8 * 1024;
/// The columns one task of a sum over rows takes: a 64-byte line of f32 in each row.
const COL_BLOCK: usize = 16;

static SPLIT_MIN: AtomicUsize = AtomicUsize::new(DEFAULT_SPLIT_MIN);

/// The size (elements) from which a CPU loop splits over rayon's pool.
pub fn split_min() -> usize {
    SPLIT_MIN.load(Ordering::Relaxed)
}

/// Sets [`split_min`] (0: always split; `usize::MAX`: never), for measuring where a split pays.
pub fn set_split_min(elems: usize) {
    SPLIT_MIN.store(elems, Ordering::Relaxed);
}

/// Whether an op of `elems` elements splits: at least [`split_min`], and a pool to split over.
pub(super) fn splits(elems: usize) -> bool {
    elems >= split_min() && rayon::current_num_threads() > 1
}

/// Runs `f(i, row, stat)` for each row `i` of `out` (rows of `c` elements; the last may be
/// shorter, for spans of an element-wise op) with the row's per-row output `stats[i]`.
pub(crate) fn rows<S: Send>(
    out: &mut [f32],
    c: usize,
    stats: &mut [S],
    f: impl Fn(usize, &mut [f32], &mut S) + Sync,
) {
    split_rows(out, c, stats, f);
}

/// [`rows`] into a fresh output of `n` elements: each row is zeroed by the task that then
/// writes it, on whichever worker runs it, while the row is in cache; `vec![0; n]` would be a
/// pass of its own on the calling thread before the split.
pub(crate) fn fresh_rows<S: Send>(
    n: usize,
    c: usize,
    stats: &mut [S],
    f: impl Fn(usize, &mut [f32], &mut S) + Sync,
) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::with_capacity(n);
    split_rows(&mut out.spare_capacity_mut()[..n], c, stats, |i, row, s| {
        row.fill(MaybeUninit::new(0.0));
        // SAFETY: every element of `row` was just written.
        let row = unsafe { &mut *(row as *mut [MaybeUninit<f32>] as *mut [f32]) };
        f(i, row, s)
    });
    // SAFETY: the rows cover the first n elements, and each was written.
    unsafe { out.set_len(n) };
    out
}

/// The split itself: rows of `c` elements of `out` with `stats`, over the pool from
/// [`split_min`] elements, tasks of at least [`TASK_MIN`].
fn split_rows<T: Send, S: Send>(
    out: &mut [T],
    c: usize,
    stats: &mut [S],
    f: impl Fn(usize, &mut [T], &mut S) + Sync,
) {
    debug_assert_eq!(out.len().div_ceil(c), stats.len());
    if splits(out.len()) {
        out.par_chunks_mut(c)
            .zip(stats.par_iter_mut())
            .with_min_len(TASK_MIN.div_ceil(c))
            .enumerate()
            .for_each(|(i, (row, s))| f(i, row, s));
    } else {
        out.chunks_mut(c)
            .zip(stats.iter_mut())
            .enumerate()
            .for_each(|(i, (row, s))| f(i, row, s));
    }
}

/// `K` sums over the `n` rows of an (N, C) input, each (C,): `add(cols, acc)` adds every row's
/// contribution to the columns `cols`, rows in order, into `acc[k][..cols.len()]`.
pub(crate) fn column_sums<const K: usize>(
    n: usize,
    c: usize,
    add: impl Fn(Range<usize>, &mut [Vec<f32>; K]) + Sync,
) -> [Vec<f32>; K] {
    let block = |cols: Range<usize>| {
        let mut acc: [Vec<f32>; K] = std::array::from_fn(|_| vec![0f32; cols.len()]);
        add(cols, &mut acc);
        acc
    };
    if !splits(n * c) || c <= COL_BLOCK {
        return block(0..c);
    }
    let parts: Vec<[Vec<f32>; K]> = (0..c.div_ceil(COL_BLOCK))
        .into_par_iter()
        .map(|b| block(b * COL_BLOCK..c.min((b + 1) * COL_BLOCK)))
        .collect();
    std::array::from_fn(|k| parts.iter().flat_map(|p| p[k].iter().copied()).collect())
}

/// The elements one task of a split element-wise op takes.
const SPAN: usize = TASK_MIN;

/// A fresh output of `n` elements written by `f(offset, span)` over its spans (element-wise
/// ops: `span` is `out[offset..offset + span.len()]`), as [`fresh_rows`].
pub(crate) fn fresh_spans(n: usize, f: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    fresh_each_row(n, SPAN, |i, span| f(i * SPAN, span))
}

/// [`rows`] for an op that writes nothing per row but the row itself.
pub(crate) fn each_row(out: &mut [f32], c: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    let mut none = vec![(); out.len().div_ceil(c)];
    rows(out, c, &mut none, |i, row, _| f(i, row));
}

/// [`fresh_rows`] for an op that writes nothing per row but the row itself.
pub(crate) fn fresh_each_row(n: usize, c: usize, f: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    let mut none = vec![(); n.div_ceil(c)];
    fresh_rows(n, c, &mut none, |i, row, _| f(i, row))
}

/// Runs `f(i, stat)` for each of the `stats.len()` rows of an op whose rows read `c` elements
/// each and write only the per-row `stats[i]`.
pub(crate) fn row_stats<S: Send>(c: usize, stats: &mut [S], f: impl Fn(usize, &mut S) + Sync) {
    if splits(stats.len() * c) {
        stats
            .par_iter_mut()
            .with_min_len(TASK_MIN.div_ceil(c))
            .enumerate()
            .for_each(|(i, s)| f(i, s));
    } else {
        stats.iter_mut().enumerate().for_each(|(i, s)| f(i, s));
    }
}

/// Runs `f(0) .. f(parts − 1)` on the calling thread and the pool's other workers, each part
/// claimed by whichever thread is free first, and returns once every part has run. The caller
/// waits for the last part by spinning, not by sleeping in a join.
///
/// ```text
///   next ──▶ 0  1  2  3       the caller and each helper job: i = next++; f(i) while i < parts
///   caller   ██ ██    ██      a thread slowed down (by its host, say) takes fewer parts
///   worker 1 ██████           instead of holding the others at a fixed half
/// ```
///
/// Why not a join: a split into one fixed part a thread (the gemm's own) runs at the slower
/// thread's pace, and a thread that waits in rayon's join goes to sleep after a few rounds of
/// yielding, which on a virtual machine halts its CPU until it is woken again (docs/journal.md,
/// "Where the two-thread width-256 step loses its steadiness"). A helper job that starts after
/// every part was claimed finds nothing to do and returns without touching `f`'s data.
pub(crate) fn claimed(parts: usize, f: &(dyn Fn(usize) + Sync)) {
    use std::sync::Arc;
    struct Claims {
        next: AtomicUsize,
        done: AtomicUsize,
        panicked: std::sync::atomic::AtomicBool,
    }
    let claims = Arc::new(Claims {
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        panicked: std::sync::atomic::AtomicBool::new(false),
    });
    let run = move |claims: &Claims, f: &(dyn Fn(usize) + Sync)| loop {
        let i = claims.next.fetch_add(1, Ordering::AcqRel);
        if i >= parts {
            return;
        }
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(i))).is_err() {
            claims.panicked.store(true, Ordering::Release);
        }
        claims.done.fetch_add(1, Ordering::AcqRel);
    };
    // SAFETY: a helper calls `f` only for a part it claimed below `parts`, and this function
    // returns only once `done` counts every part, so no call of `f` outlives the borrow; a
    // helper that starts later claims nothing and only reads the counters it shares.
    let f_static: &'static (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(f) };
    for _ in 1..rayon::current_num_threads().min(parts) {
        let claims = claims.clone();
        rayon::spawn(move || run(&claims, f_static));
    }
    run(&claims, f);
    let mut spins = 0u32;
    while claims.done.load(Ordering::Acquire) < parts {
        // A plain spin: a pause instruction in a loop can make the host take the CPU away.
        // Past about a millisecond the helper is off its CPU, so give ours up instead.
        spins = spins.saturating_add(1);
        if spins > 1 << 20 {
            std::thread::yield_now();
        }
    }
    assert!(
        !claims.panicked.load(Ordering::Acquire),
        "a part of a claimed split panicked"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every part runs exactly once, on one thread or several, and the call returns only after
    /// the last; a part that panics panics the caller instead of leaving it waiting.
    #[test]
    fn claimed_runs_every_part_once() {
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            for parts in [1, 2, 7, 64] {
                let runs: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
                pool.install(|| {
                    claimed(parts, &|p| {
                        std::thread::sleep(std::time::Duration::from_micros(50 * (p % 3) as u64));
                        runs[p].fetch_add(1, Ordering::Relaxed);
                    })
                });
                let counts: Vec<usize> = runs.iter().map(|r| r.load(Ordering::Relaxed)).collect();
                assert_eq!(counts, vec![1; parts], "{threads} threads, {parts} parts");
            }
            let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.install(|| claimed(4, &|p| assert_ne!(p, 2, "part 2 fails")))
            }));
            assert!(failed.is_err(), "{threads} threads: a failing part must fail the call");
        }
    }
}
