//! Measured memory: a [`MemoryProbe`] reports current and peak bytes; on CPU [`CpuProbe`] reads
//! the counters of [`CountingAlloc`], a global allocator wrapping `System` that the binary
//! installs:
//!
//! ```ignore
//! #[global_allocator]
//! static A: mtrain_trainer::memory::CountingAlloc = mtrain_trainer::memory::CountingAlloc;
//! ```
//!
//! On a GPU, `gpu_memory::CudaMemoryProbe` (CUDA memory-pool used / high-water) implements the
//! same trait.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

static CURRENT: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);
/// The high-water mark of the whole process, never reset.
static LIFETIME_PEAK: AtomicU64 = AtomicU64::new(0);
static ALLOCS: AtomicU64 = AtomicU64::new(0);

/// A global allocator over [`System`] that counts live bytes and their high-water mark.
pub struct CountingAlloc;

impl CountingAlloc {
    fn grow(by: usize) {
        let now = CURRENT.fetch_add(by as u64, Ordering::Relaxed) + by as u64;
        PEAK.fetch_max(now, Ordering::Relaxed);
        LIFETIME_PEAK.fetch_max(now, Ordering::Relaxed);
        ALLOCS.fetch_add(1, Ordering::Relaxed);
    }

    fn shrink(by: usize) {
        CURRENT.fetch_sub(by as u64, Ordering::Relaxed);
    }

    /// The most heap bytes the process has held at once, since it started.
    pub fn lifetime_peak() -> u64 {
        LIFETIME_PEAK.load(Ordering::Relaxed)
    }

    /// Whether this allocator is the process's global allocator (it has seen an allocation).
    pub fn installed() -> bool {
        ALLOCS.load(Ordering::Relaxed) > 0
    }
}

// SAFETY: every method forwards to `System` with the caller's layout unchanged and only updates
// counters on success, so `System`'s guarantees carry over.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            Self::grow(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            Self::grow(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        Self::shrink(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            Self::shrink(layout.size());
            Self::grow(new_size);
        }
        p
    }
}

/// Where measured memory comes from.
pub trait MemoryProbe {
    /// What is measured, for the report ("cpu heap", "cuda pool").
    fn name(&self) -> &str;
    /// Bytes in use now.
    fn current(&self) -> u64;
    /// Highest bytes in use since the last [`MemoryProbe::reset_peak`].
    fn peak(&self) -> u64;
    /// Start a new high-water mark at the current value.
    fn reset_peak(&self);
    /// Wait until the figures include every allocation and free already issued (a GPU's
    /// asynchronous frees); a no-op where they always do.
    fn settle(&self) {}
}

/// Heap bytes counted by [`CountingAlloc`] (zero unless it is the global allocator).
pub struct CpuProbe;

impl MemoryProbe for CpuProbe {
    fn name(&self) -> &str {
        "cpu heap"
    }
    fn current(&self) -> u64 {
        CURRENT.load(Ordering::Relaxed)
    }
    fn peak(&self) -> u64 {
        PEAK.load(Ordering::Relaxed)
    }
    fn reset_peak(&self) {
        PEAK.store(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

/// The process's peak resident memory (Linux's `VmHWM`, in bytes): the host memory it has held
/// at most, heap, stacks and mapped code included. `None` where `/proc` does not say.
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
