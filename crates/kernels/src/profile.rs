//! Per-op timing and closed-form costs of the ops in this crate (`--profile-ops`): each call of
//! an op adds its wall time, its FLOPs and the bytes it reads and writes to the row of its name.
//!
//! ```text
//!   off (the default)   op(..) = one relaxed atomic load, then the op itself
//!   on, CPU             t0 ─ op ─ t1                   row[name] += (1 call, t1 − t0, FLOPs, bytes)
//!   on, CUDA            e0 ─ op ─ e1 (events on the stream, no synchronisation); when the
//!                       profiling stops, row[name] += (1 call, e1 − e0 as the GPU ran it, …)
//! ```
//!
//! On a GPU the host only enqueues: an op's kernels run when the stream reaches them. Timing
//! them with the host's clock would need a synchronisation on both sides, which empties the
//! queue, so each op would carry a launch's latency and a kernel's tail; the two events are
//! stamped by the stream itself, around exactly the op's kernels, and the step runs as it does
//! unprofiled.
//!
//! **One rule.** Only the outermost op of a call stack is timed: an op called inside another
//! (the GEMM inside attention, the bias add inside a linear layer's CPU path) is part of the
//! outer op's row, so no time is counted twice. The costs are worked out after `t1`, the table
//! is written after `t1`: the profiler's own work stays out of the figures.
//!
//! **The counts** are closed forms of the shapes, not measurements:
//! - FLOPs: a product of (M, K) and (K, N) is 2·M·K·N; attention counts its two products per
//!   head, 4·T²·D forward and 8·T²·D backward (the full square and no softmax arithmetic, as
//!   the MFU count does); an element-wise op counts the arithmetic of its formula per element,
//!   a transcendental (exp, tanh, √) as one ([`per_element`]).
//! - bytes: the compulsory traffic, every input read once and every output written once, in
//!   its dtype. What a kernel moves beyond that (a CPU path's materialised scores, a re-read
//!   that misses the cache) is what the achieved bandwidth then shows.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use candle_core::{Device, Result, Tensor};

/// What one op kind added up to while profiling.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpTotals {
    pub calls: u64,
    pub flops: f64,
    /// Bytes read and written (the compulsory traffic).
    pub bytes: f64,
    /// Wall time, the device synchronised before and after each call.
    pub seconds: f64,
}

/// One call's closed-form cost.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Cost {
    pub flops: f64,
    pub bytes: f64,
}

impl Cost {
    /// `batch` products of (m, k) by (k, n), elements of `size` bytes.
    pub fn gemm(batch: usize, (m, k, n): (usize, usize, usize), size: usize) -> Cost {
        let (b, m, k, n) = (batch as f64, m as f64, k as f64, n as f64);
        Cost {
            flops: 2.0 * b * m * k * n,
            bytes: b * (m * k + k * n + m * n) * size as f64,
        }
    }

    /// `flops_per_element` on each element of `over`, reading `inputs` and writing `outputs`.
    pub fn elementwise(
        flops_per_element: f64,
        over: &Tensor,
        inputs: &[&Tensor],
        outputs: &[&Tensor],
    ) -> Cost {
        Cost {
            flops: flops_per_element * over.elem_count() as f64,
            bytes: bytes(inputs) + bytes(outputs),
        }
    }
}

impl std::iter::Sum for Cost {
    fn sum<I: Iterator<Item = Cost>>(iter: I) -> Cost {
        iter.fold(Cost::default(), |a, c| Cost {
            flops: a.flops + c.flops,
            bytes: a.bytes + c.bytes,
        })
    }
}

/// The row `name` of causal attention over qkv of dims (B, T, 3·H·D) or (3, B, H, T, D):
/// `per` · B·H·T²·D FLOPs (4 forward: q·kᵀ and p·v; 8 backward: four products), `bytes` moved.
pub fn attention(name: &str, qkv: &[usize], per: f64, bytes: f64) -> (String, Cost) {
    let (b, t, hd) = match qkv {
        [b, t, three_hd] => (*b, *t, three_hd / 3),
        [_, b, h, t, d] => (*b, *t, h * d),
        _ => (0, 0, 0),
    };
    let flops = per * (b * t * t * hd) as f64;
    (name.to_string(), Cost { flops, bytes })
}

/// Bytes of `ts` in their dtypes.
pub fn bytes(ts: &[&Tensor]) -> f64 {
    ts.iter()
        .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as f64)
        .sum()
}

/// FLOPs per element of each element-wise op, from the formula its kernel computes:
///
/// | op | per element | formula |
/// | --- | --- | --- |
/// | `bias` | 1 | y = x + b |
/// | `residual` | 2 | y = r + x + b |
/// | `bias grad` | 1 | db = Σ_rows dy |
/// | `gelu` | 9 | ½x(1 + tanh(√(2/π)(x + 0.044715x³))) |
/// | `gelu backward` | 18 | dy · d/dx of the above |
/// | `layer_norm` | 8 | mean, variance, (x − μ)·rstd·w + b |
/// | `layer_norm backward` | 13 | dŷ = dy·w, dw, db, the two row means, dx |
/// | `cross_entropy` | 4 | max, exp(z − max), Σ, per logit |
/// | `cross_entropy backward` | 4 | softmax rebuilt, − one-hot, · scale |
/// | `adamw` | 16 | both moments, bias corrections, √v̂ + ε, decay, update |
/// | `sq_sum` | 2 | Σ x² |
/// | `embedding` | 1 | wte row + wpe row |
/// | `embedding backward` | 1 | scatter-add of dy rows |
/// | `grad accumulate` | 1 | g = g + dg, a weight's gradient summed over passes |
pub fn per_element(op: &str) -> f64 {
    match op {
        "bias" | "bias grad" | "embedding" | "embedding backward" | "grad accumulate" => 1.0,
        "residual" | "sq_sum" => 2.0,
        "cross_entropy" | "cross_entropy backward" => 4.0,
        "layer_norm" => 8.0,
        "gelu" => 9.0,
        "layer_norm backward" => 13.0,
        "adamw" => 16.0,
        "gelu backward" => 18.0,
        _ => 0.0,
    }
}

static ON: AtomicBool = AtomicBool::new(false);
static TABLE: Mutex<BTreeMap<String, OpTotals>> = Mutex::new(BTreeMap::new());
/// While a [`section`] runs its ops on several threads: their calls, counted but not timed.
static SECTION_OPEN: AtomicBool = AtomicBool::new(false);
static SECTION: Mutex<BTreeMap<String, OpTotals>> = Mutex::new(BTreeMap::new());

thread_local! {
    /// Ops open on this thread: only a call at depth 0 is timed.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Starts profiling with an empty table.
pub fn start() {
    TABLE.lock().unwrap_or_else(|p| p.into_inner()).clear();
    ON.store(true, Ordering::SeqCst);
}

/// Stops profiling and returns the table, one row per op name (on a GPU, once the stream has
/// run every op timed).
pub fn stop() -> BTreeMap<String, OpTotals> {
    ON.store(false, Ordering::SeqCst);
    let table = std::mem::take(&mut *TABLE.lock().unwrap_or_else(|p| p.into_inner()));
    #[cfg(feature = "cuda")]
    let table = gpu::resolve(table);
    table
}

/// Whether ops are being profiled.
pub fn is_on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Leaves the depth as it was when dropped, on an error or a panic too.
struct Open;

impl Open {
    fn enter() -> (Open, bool) {
        let outer = DEPTH.with(|d| {
            let depth = d.get();
            d.set(depth + 1);
            depth == 0
        });
        (Open, outer)
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// Runs `f`, the op on `dev`; while profiling and outermost, times it (the host's clock on the
/// CPU, two events on the stream on a GPU) and adds the call to the row `what` names with the
/// cost it gives for the result (both worked out after the clock stopped). Inside a
/// [`section`] the call is counted and the section's time shared out.
pub fn op<R>(
    dev: &Device,
    f: impl FnOnce() -> Result<R>,
    what: impl FnOnce(&R) -> (String, Cost),
) -> Result<R> {
    if !ON.load(Ordering::Relaxed) {
        return f();
    }
    let (_open, outer) = Open::enter();
    if !outer {
        return f();
    }
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        let stream = d.cuda_stream();
        let start = gpu::stamp(&stream)?;
        let r = f()?;
        let end = gpu::stamp(&stream)?;
        let (name, cost) = what(&r);
        gpu::pending(gpu::Timed { name, cost, start, end });
        return Ok(r);
    }
    if !SECTION_OPEN.load(Ordering::SeqCst) {
        let t0 = Instant::now();
        let r = f()?;
        dev.synchronize()?; // a no-op on the CPU
        let seconds = t0.elapsed().as_secs_f64();
        let (name, cost) = what(&r);
        let mut table = TABLE.lock().unwrap_or_else(|p| p.into_inner());
        add(table.entry(name).or_default(), cost, seconds);
        return Ok(r);
    }
    let r = f()?;
    let (name, cost) = what(&r);
    let mut rows = SECTION.lock().unwrap_or_else(|p| p.into_inner());
    add(rows.entry(name).or_default(), cost, 0.0);
    Ok(r)
}

/// Runs `f`, which runs ops on several threads at once (the CPU's compute pool); while
/// profiling and outermost, times the whole of it and shares its wall time among the ops that
/// ran inside in proportion to their FLOPs (their bytes where none has FLOPs): concurrent ops
/// are not timed one by one, which would count the same wall time once per thread.
pub fn section<R>(dev: &Device, f: impl FnOnce() -> Result<R>) -> Result<R> {
    // Not opened on this thread: ops this thread runs inside count like the pool's.
    if !ON.load(Ordering::Relaxed) || DEPTH.with(|d| d.get()) > 0 {
        return f();
    }
    dev.synchronize()?;
    SECTION.lock().unwrap_or_else(|p| p.into_inner()).clear();
    SECTION_OPEN.store(true, Ordering::SeqCst);
    let t0 = Instant::now();
    let r = f();
    let seconds = t0.elapsed().as_secs_f64();
    SECTION_OPEN.store(false, Ordering::SeqCst);
    let rows = std::mem::take(&mut *SECTION.lock().unwrap_or_else(|p| p.into_inner()));
    let by_flops = rows.values().any(|o| o.flops > 0.0);
    let weight = |o: &OpTotals| if by_flops { o.flops } else { o.bytes };
    let total: f64 = rows.values().map(weight).sum();
    let mut table = TABLE.lock().unwrap_or_else(|p| p.into_inner());
    for (name, o) in rows.iter() {
        let share = match total > 0.0 {
            true => weight(o) / total,
            false => 1.0 / rows.len() as f64,
        };
        let row = table.entry(name.clone()).or_default();
        row.calls += o.calls;
        row.flops += o.flops;
        row.bytes += o.bytes;
        row.seconds += seconds * share;
    }
    r
}

/// CUDA events around an op's kernels.
#[cfg(feature = "cuda")]
mod gpu {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    use candle_core::cuda_backend::cudarc::driver::{sys, CudaEvent, CudaStream};
    use candle_core::Result;

    use super::{Cost, OpTotals};

    /// An op whose kernels lie between two events on the stream.
    pub struct Timed {
        pub name: String,
        pub cost: Cost,
        pub start: CudaEvent,
        pub end: CudaEvent,
    }

    /// An event recorded on `stream` now, with timing on.
    pub fn stamp(stream: &CudaStream) -> Result<CudaEvent> {
        stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(candle_core::Error::wrap)
    }

    /// Ops timed by events, added to the table when profiling stops.
    static PENDING: Mutex<Vec<Timed>> = Mutex::new(Vec::new());

    pub fn pending(t: Timed) {
        PENDING.lock().unwrap_or_else(|p| p.into_inner()).push(t);
    }

    /// `table` with every pending op added, each as the seconds the stream spent between its
    /// events (waiting for the stream to reach the last).
    pub fn resolve(mut table: BTreeMap<String, OpTotals>) -> BTreeMap<String, OpTotals> {
        for t in std::mem::take(&mut *PENDING.lock().unwrap_or_else(|p| p.into_inner())) {
            // An op whose events cannot be read (a failed stream) counts no time.
            let ms = t.start.elapsed_ms(&t.end).unwrap_or(0.0);
            super::add(table.entry(t.name).or_default(), t.cost, f64::from(ms) * 1e-3);
        }
        table
    }
}

/// One call of `cost` taking `seconds`.
fn add(row: &mut OpTotals, cost: Cost, seconds: f64) {
    row.calls += 1;
    row.flops += cost.flops;
    row.bytes += cost.bytes;
    row.seconds += seconds;
}

/// What an op returns, as the tensors it wrote.
pub trait Outputs {
    fn tensors(&self) -> Vec<&Tensor>;
}

impl Outputs for Tensor {
    fn tensors(&self) -> Vec<&Tensor> {
        vec![self]
    }
}

impl Outputs for (Tensor, Tensor) {
    fn tensors(&self) -> Vec<&Tensor> {
        vec![&self.0, &self.1]
    }
}

impl Outputs for (Tensor, Tensor, Tensor) {
    fn tensors(&self) -> Vec<&Tensor> {
        vec![&self.0, &self.1, &self.2]
    }
}

/// [`op`] for the element-wise op `name`: [`per_element`] FLOPs on each element of its first
/// input, the bytes of `inputs` and of what `f` returns.
pub fn elementwise<R: Outputs>(
    name: &'static str,
    inputs: &[&Tensor],
    f: impl FnOnce() -> Result<R>,
) -> Result<R> {
    let Some(first) = inputs.first() else {
        return f();
    };
    op(first.device(), f, |out| {
        let cost = Cost::elementwise(per_element(name), first, inputs, &out.tensors());
        (name.to_string(), cost)
    })
}

/// The name of a GEMM's row: `gemm M×K×N` (the batch folded into M), `kind` its epilogue.
pub fn gemm_name(kind: &str, (m, k, n): (usize, usize, usize)) -> String {
    format!("{kind} {m}x{k}x{n}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nested ops count once, in the outer row; off, nothing is recorded. (One test: the
    /// table is the process's.)
    #[test]
    fn only_the_outermost_op_is_timed() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::zeros((4, 8), candle_core::DType::F32, &dev)?;
        let one = |name: &str| {
            (
                name.to_string(),
                Cost {
                    flops: 10.0,
                    bytes: 4.0,
                },
            )
        };
        op(&dev, || Ok(()), |_| one("off"))?;
        start();
        op(
            &dev,
            || op(&dev, || x.exp(), |_| one("inner")),
            |_| one("outer"),
        )?;
        op(
            &dev,
            || x.exp(),
            |y| ("exp".into(), Cost::elementwise(1.0, y, &[&x], &[y])),
        )?;
        let _ = op(
            &dev,
            || Err::<(), _>(candle_core::Error::Msg("no".into())),
            |_| one("err"),
        );
        let t = stop();
        assert_eq!(t.keys().collect::<Vec<_>>(), ["exp", "outer"]);
        assert_eq!(
            (t["outer"].calls, t["outer"].flops, t["outer"].bytes),
            (1, 10.0, 4.0)
        );
        assert_eq!((t["exp"].flops, t["exp"].bytes), (32.0, 256.0));
        assert!(t["outer"].seconds > 0.0);
        assert!(!is_on() && stop().is_empty());
        assert_eq!(
            Cost::gemm(2, (3, 4, 5), 4),
            Cost {
                flops: 240.0,
                bytes: 2.0 * 47.0 * 4.0
            }
        );
        Ok(())
    }
}
