//! A rank's compute threads on CPU: one pool, the thread that runs the step its first worker.
//!
//! candle's CPU backend reaches for threads in two places: its gemm splits a large product over
//! rayon's pool (the caller's, else the global one), and its element-wise maps of 64 Ki elements
//! or more split over a second pool of its own, whose workers spin for a while after each op
//! before they park. The tapes' CPU loops (`mtrain-kernels`, `cpu.rs`) split their rows over
//! rayon's pool too. Left alone, a rank given `n` threads runs `n` rayon workers, `n − 1` of
//! candle's and its own main thread, which hands each gemm to rayon and sleeps until it is done:
//!
//! ```text
//!   left alone (n = 2, 2 cores)                   after init()
//!   main ── gemm ──▶ queue ─┐ sleeps ┌─▶ main      main = rayon worker 0 ─┬─ its half of the gemm
//!   rayon 0, rayon 1 ◀──────┘  spin  │            rayon worker 1 ─────────┴─ the other half
//!   candle's worker (spins after every large map)  (candle's pool: no workers)
//!   4 threads for 2 cores                         2 threads for 2 cores
//! ```
//!
//! [`init`] builds rayon's global pool with the calling thread as worker 0 and gives candle's own
//! pool no workers (`CANDLE_NUM_THREADS=1` unless the user set it), so every parallel section of
//! a step runs on the same `RAYON_NUM_THREADS` threads and the thread that runs the step works
//! on each section instead of waiting for it. Below the sizes where a split pays (measured:
//! docs/journal.md, "Two cores"), an op runs on the calling thread alone.
//!
//! The same call keeps the memory a step frees for the next step ([`keep_freed_memory`]): a
//! step's activations are megabytes each, and glibc's allocator, left alone, hands a freed block
//! at the top of its heap back to the kernel and maps a fresh one on the next step, whose every
//! 4 KiB page then faults and is zeroed again (measured: 68k page faults in 60 steps of the tiny
//! preset, 10k with the memory kept, docs/journal.md).

/// The variable that sizes candle's own element-wise pool.
const CANDLE_THREADS_VAR: &str = "CANDLE_NUM_THREADS";

/// Makes the calling thread worker 0 of rayon's global pool (`RAYON_NUM_THREADS` threads, default
/// one per core) and leaves candle's element-wise pool without workers. Call it first thing in
/// `main`, before any other thread exists (it sets an environment variable).
pub fn init() {
    keep_freed_memory();
    if std::env::var_os(CANDLE_THREADS_VAR).is_none() {
        std::env::set_var(CANDLE_THREADS_VAR, "1");
    }
    // num_threads(0): rayon's own default, RAYON_NUM_THREADS or one per core.
    let built = rayon::ThreadPoolBuilder::new()
        .num_threads(0)
        .use_current_thread()
        .thread_name(|i| format!("compute-{i}"))
        .build_global();
    if let Err(e) = built {
        eprintln!("warning: the compute pool was not built ({e}); rayon's default pool runs the ops");
    }
}

/// Blocks up to glibc's largest mmap threshold (32 MiB) come from the heap, and up to 1 GiB freed
/// at its top stays there, unless the user tuned the allocator (`MALLOC_*_` or `GLIBC_TUNABLES`).
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let tuned = std::env::vars_os().any(|(k, _)| {
            let k = k.to_string_lossy();
            (k.starts_with("MALLOC_") && k.ends_with('_')) || k == "GLIBC_TUNABLES"
        });
        if !tuned {
            // SAFETY: mallopt only sets the allocator's parameters; it runs before any thread.
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
                libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
            }
        }
    }
}

/// Pins worker `i` of the pool [`init`] built to the `(local_rank · n + i) mod C`-th of the `C`
/// CPUs this process may run on (`n` its threads), unless `MTRAIN_PIN_THREADS` is `0`; returns
/// the CPUs pinned to, empty when nothing was pinned. Left to the scheduler, the two threads of
/// a 2-core rank at times share one core for a second or more, and the step takes one core's
/// time. Where the node's ranks outnumber its CPUs they wrap around, so that neighbouring
/// local ranks — the members of a tp group, the mesh's fastest axis — sit on different CPUs and
/// the ranks that share one take turns between their collectives:
///
/// ```text
///   4 ranks, 2 CPUs (tp 2 × pp 2):   CPU 0: rank 0 (stage 0, tp 0), rank 2 (stage 1, tp 0)
///                                    CPU 1: rank 1 (stage 0, tp 1), rank 3 (stage 1, tp 1)
/// ```
///
/// Left to the scheduler, both ranks of a tp pair at times share a CPU, and every all-reduce
/// between them waits for a switch (docs/results.md, the plan's checks). Called by a worker
/// once its collectives' threads exist (they keep the whole mask), never by the launcher (its
/// children would inherit a pinned mask).
pub fn pin_threads(local_rank: usize) -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        let n = rayon::current_num_threads();
        let cpus = allowed_cpus();
        let off = std::env::var("MTRAIN_PIN_THREADS").is_ok_and(|v| v == "0");
        if off || rayon::current_thread_index() != Some(0) || cpus.is_empty() {
            return Vec::new();
        }
        let mine: Vec<usize> = (local_rank * n..(local_rank + 1) * n)
            .map(|i| cpus[i % cpus.len()])
            .collect();
        rayon::broadcast(|ctx| pin_current_thread(mine[ctx.index()]));
        mine
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = local_rank;
        Vec::new()
    }
}

/// The CPUs this process may run on, in increasing order.
#[cfg(target_os = "linux")]
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let got = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if got != 0 {
        return Vec::new();
    }
    (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

/// Pins the calling thread to `cpu`.
#[cfg(target_os = "linux")]
fn pin_current_thread(cpu: usize) {
    // SAFETY: as in allowed_cpus; pid 0 is the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

thread_local! {
    /// Whether this worker is running a [`Hot`] poller.
    static POLLING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The other workers of the pool kept polling for work while this lives (a step's compute), so a
/// parallel section finds them awake: a worker that has gone to sleep takes tens of microseconds
/// to wake, about as long as the sections of a small model's step last, and a step has a hundred
/// of them. Between steps they sleep again. Only on the pool [`init`] built, with more than one
/// thread, on the thread that runs the step (its worker 0); elsewhere [`Hot::start`] is `None`.
pub struct Hot {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Hot {
    /// Wakes the pool's other workers into polling until the returned guard is dropped.
    pub fn start() -> Option<Hot> {
        use std::sync::atomic::{AtomicBool, Ordering};
        if rayon::current_num_threads() < 2 || rayon::current_thread_index() != Some(0) {
            return None;
        }
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let polling = stop.clone();
        rayon::spawn_broadcast(move |ctx| {
            if ctx.index() == 0 {
                return; // the step's own thread
            }
            // A poller's stolen work can wait in a join and, waiting, pick up the next step's
            // poller; that one would spin until its step ends, while the step waits for the
            // work beneath it. So a poller started inside another returns at once.
            if POLLING.with(|p| p.replace(true)) {
                return;
            }
            while !polling.load(Ordering::Relaxed) {
                if rayon::yield_now() != Some(rayon::Yield::Executed) {
                    std::thread::yield_now(); // nothing to steal: let the OS run anything else
                }
            }
            POLLING.with(|p| p.set(false));
        });
        Some(Hot { stop })
    }
}

impl Drop for Hot {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}
