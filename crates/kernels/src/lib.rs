//! mtrain-kernels: the fused CUDA kernels of a GPT training step and the operations they back,
//! each with its plain candle version. Nothing here knows about models or ranks.
//!
//! An op picks its own implementation: the fused kernel when its tensors are on a CUDA device in
//! a dtype and shape the kernel takes, else candle ops (on CPU, and for shapes no kernel covers).
//! Callers call [`layer_norm`], [`causal_attention`], ... and never ask which one ran.
//!
//! ```text
//!   plain candle (bf16)                               fused
//!   q·kᵀ ─> f32 ─> +mask ─> softmax ─> bf16 ─> ·v      attention: one pass over key tiles,
//!     (B, H, T, T) scores kept for backward               online softmax, only lse (B, H, T) kept
//!   logits ─> f32 ─> log_softmax ─> gather ─> mean     cross_entropy: one block per row,
//!     (N, V) f32 copies kept for backward                 only lse (N,) kept, softmax rebuilt
//!   x ─> f32 ─> mean, var ─> normalise ─> ·w + b        layer_norm: one warp per row,
//!     ~12 kernels, (N, C) f32 copies kept                 only mean, rstd (N,) kept
//!   gelu backward: ~12 elementwise kernels              gelu: one kernel each way
//!   qkv narrow/transpose/contiguous x3, backward        split_heads: one permutation kernel,
//!     three zero-padded (B, T, 3C) gradients summed       backward one (B, T, 3C) gradient
//!   broadcast_add bias, backward a strided reduction    bias_add: coalesced column sums
//!   AdamW: about 15 elementwise kernels per tensor      adamw: one kernel per tensor, the
//!     and one more to scale by the clip coefficient       clip coefficient applied inside
//!   Σ g² per tensor: cast, square, row sums (~6 kernels)  sq_sum: one kernel per tensor,
//!                                                         one read-back for the whole norm
//! ```
//!
//! Each op comes in two forms:
//! - **differentiable** (`layer_norm`, `gelu`, `bias_add`, `split_heads`, `merge_heads`,
//!   `causal_attention`, `embedding`, `cross_entropy`): recorded by candle's autograd, the fused
//!   kernel's backward registered as the op's `bwd`; the plain version is [`plain`], the
//!   reference the kernels and the hand-written backward passes are tested against.
//! - **graph-free** (`layer_norm::forward` / `backward`, `attention::forward` / `backward`, ...):
//!   a forward that returns what its backward needs and a backward that takes it, for the
//!   hand-written backward passes of the model crate; on CPU each runs as a loop over rows in
//!   f32 (`cpu`, the fused kernels' counterparts) or, in other dtypes, in candle ops next to its
//!   kernel, so the same tape runs and is tested on either device.
//!
//! The CUDA source (`kernels.cu` and the `.cu` files after it) is compiled by NVRTC the first
//! time a kernel is used, once per (head size, element type), and the PTX is kept for the process
//! and on disk ([`ptx_cache`]), so later processes skip NVRTC. A CPU build compiles none of it.
//!
//! # Layout
//! - [`plain`]: the candle-ops versions (softmax, LayerNorm, causal attention, cross-entropy).
//! - `cpu`: the graph-free ops' f32 CPU loops (one pass where candle ops make several).
//! - [`layer_norm`], [`gelu`], [`bias`], [`heads`], [`attention`], [`embedding`],
//!   [`cross_entropy`], [`adamw`]: one op each, its kernel launch and its dispatch;
//!   [`linear`] the layer's GEMM with its bias, residual or GELU in cuBLASLt's epilogue;
//!   `attention_path` the rule that picks attention's kernels.
//! - `cuda` (feature `cuda`): NVRTC compilation and the launch pieces the kernels share.
//! - [`reduce`]: Σ of a tensor in rows first, and Σ x² of a list of tensors (the gradient norm).
//! - [`philox`]: Philox4x32-10, the counter-based generator of draws named by their coordinates;
//!   [`dropout`]: dropout masks drawn from it by (seed, step, micro-batch, layer, site, element).
//! - [`ptx_cache`]: compiled PTX on disk, keyed by source, options and architecture.
//! - [`testing`]: the relative error and the CUDA device helpers the kernel and tape tests share.
//!
//! `unsafe` here is confined to kernel launches (`launch_builder(..).launch(..)`, each with its
//! argument list next to the kernel's signature), uninitialised output buffers the kernel
//! writes in full, the CUDA memory-pool attribute of [`retain_pool_memory`] and the stream
//! ordering of [`order_by_stream`].

pub mod adamw;
pub mod attention;
mod attention_path;
pub mod bias;
mod cpu;
pub use cpu::{each_tensor, matmul, set_split_min, split_min, DEFAULT_SPLIT_MIN};
pub mod cross_entropy;
#[cfg(feature = "cuda")]
mod cuda;
pub mod dropout;
pub mod embedding;
pub mod gelu;
pub mod heads;
pub mod layer_norm;
pub mod linear;
pub mod philox;
pub mod profile;
pub mod plain;
pub mod ptx_cache;
pub mod readback;
pub mod reduce;

use candle_core::{DType, Tensor};

pub use adamw::{AdamWHyper, AdamWOut};
pub use attention::causal_attention;
pub use bias::bias_add;
pub use cross_entropy::cross_entropy;
pub use embedding::embedding;
pub use gelu::gelu;
pub use heads::{merge_heads, split_heads};
pub use layer_norm::layer_norm;

/// True when a fused kernel can take `t` at all: built with CUDA, `t` on a CUDA device, f32 or
/// bf16. Each op adds its own shape conditions.
pub(crate) fn fused_for(t: &Tensor) -> bool {
    cfg!(feature = "cuda") && t.device().is_cuda() && matches!(t.dtype(), DType::BF16 | DType::F32)
}

/// The CUDA settings a training process makes once for `dev`, before its first tensor there:
/// freed memory stays in the pool ([`retain_pool_memory`]) and work is ordered by the stream
/// alone ([`order_by_stream`]). A no-op on CPU.
pub fn configure_device(dev: &candle_core::Device) -> candle_core::Result<()> {
    retain_pool_memory(dev)?;
    order_by_stream(dev);
    Ok(())
}

/// Tensors created on `dev` after this call are ordered by the stream they run on, without
/// cudarc's per-buffer CUDA events. By default every allocation creates a read and a write event
/// and every kernel launch records and waits on the events of each argument, so that a buffer
/// used from several streams is safe: a dozen driver calls per launch, which in an optimizer
/// step of 148 small launches is most of its time. mtrain needs none of it: every kernel of a
/// training step runs on the device's one compute stream, and the NCCL backend orders its
/// communication streams against it with its own events and keeps an op's buffers alive until
/// the compute stream has waited for the op (`comm/src/nccl/stream.rs`). A no-op on CPU.
pub fn order_by_stream(dev: &candle_core::Device) {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(c) = dev {
        // SAFETY: the contract above: one compute stream; other streams ordered by explicit
        // events, their buffers held until the compute stream waits for them.
        unsafe { c.disable_event_tracking() };
    }
    let _ = dev;
}

/// Keeps memory freed into the CUDA default pool of `dev` reserved for reuse instead of
/// returning it to the driver at every synchronise (the pool's release threshold defaults to 0,
/// so a step that synchronises once would unmap and map its activations again each step).
/// Peak *used* memory is unchanged. A no-op on CPU.
pub fn retain_pool_memory(dev: &candle_core::Device) -> candle_core::Result<()> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(c) = dev {
        use candle_core::cuda_backend::cudarc::driver::{result, sys};
        let ctx = c.cuda_stream().context().clone();
        ctx.bind_to_thread()
            .map_err(|e| msg(format!("retain_pool_memory: {e:?}")))?;
        // SAFETY: the device handle comes from a live context.
        let pool = unsafe { result::device::get_default_mem_pool(ctx.cu_device()) }
            .map_err(|e| msg(format!("retain_pool_memory: no default pool: {e:?}")))?;
        let mut keep: u64 = u64::MAX;
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
        // SAFETY: RELEASE_THRESHOLD is a cuuint64_t read from `keep`.
        let r = unsafe { sys::cuMemPoolSetAttribute(pool, attr, &mut keep as *mut u64 as *mut _) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(msg(format!(
                "retain_pool_memory: cuMemPoolSetAttribute gave {r:?}"
            )));
        }
    }
    let _ = dev;
    Ok(())
}

/// Helpers the kernel tests and the model's tape tests share; not for training code.
pub mod testing {
    use candle_core::{DType, Device, Tensor};

    /// ‖a − b‖ / ‖b‖, in f64. Panics (naming the step) if a tensor cannot be read.
    pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
        let f64s = |t: &Tensor| t.to_dtype(DType::F64).expect("rel_err: cast to f64");
        let (a, b) = (f64s(a), f64s(b));
        let sq = |t: &Tensor| {
            t.sqr()
                .and_then(|s| s.sum_all())
                .and_then(|s| s.to_scalar::<f64>())
                .expect("rel_err: sum of squares")
        };
        (sq(&(a - &b).expect("rel_err: difference")) / sq(&b)).sqrt()
    }

    /// The first CUDA device, for a test that needs one (ignored on a build without the `cuda`
    /// feature: `#[cfg_attr(not(feature = "cuda"), ignore = "needs a CUDA device: build with
    /// --features cuda")]`). Without one (a CPU-only build, no GPU visible, no driver) the test
    /// fails, naming what is missing: it never passes untested.
    pub fn cuda() -> Device {
        Device::new_cuda(0).unwrap_or_else(|e| {
            panic!(
                "this test needs a CUDA device and none could be opened (a build with --features cuda, a GPU visible through CUDA_VISIBLE_DEVICES, its driver): {e}"
            )
        })
    }

    /// The devices a test that runs everywhere checks: the CPU, and on a build with the `cuda`
    /// feature the first CUDA device too ([`cuda`]: a GPU missing there fails the test).
    pub fn devices() -> Vec<Device> {
        let mut devices = vec![Device::Cpu];
        if cfg!(feature = "cuda") {
            devices.push(cuda());
        }
        devices
    }
}

fn msg(s: String) -> candle_core::Error {
    candle_core::Error::Msg(s)
}
