//! Fused CUDA kernels for the hot spots of a GPT training step, each a drop-in for a chain of
//! candle ops that computes the same function.
//!
//! ```text
//!   plain candle (bf16)                               fused
//!   q·kᵀ ─> f32 ─> +mask ─> softmax ─> bf16 ─> ·v      flash_attention: one pass over key tiles,
//!     (B, H, T, T) scores kept for backward               online softmax, only lse (B, H, T) kept
//!   logits ─> f32 ─> log_softmax ─> gather ─> mean     cross_entropy_rows: one block per row,
//!     (N, V) f32 copies kept for backward                 only lse (N,) kept, softmax rebuilt
//!   x ─> f32 ─> mean, var ─> normalise ─> ·w + b        layer_norm: one warp per row,
//!     ~12 kernels, (N, C) f32 copies kept                 only mean, rstd (N,) kept
//!   gelu backward: ~12 elementwise kernels              gelu: one kernel each way
//!   qkv narrow/transpose/contiguous x3, backward        split_heads: one permutation kernel,
//!     three zero-padded (B, T, 3C) gradients summed       backward one (B, T, 3C) gradient
//!   broadcast_add bias, backward a strided reduction    bias_add: coalesced column sums
//! ```
//!
//! Attention runs on tensor cores (bf16 `mma.sync`) for bf16 and head sizes 16..64, and on CUDA
//! cores otherwise (see [`flash_attention`]).
//!
//! The CUDA source (`kernels.cu` and the `.cu` files after it) is compiled by NVRTC the first
//! time a kernel is used, once per (head size, element type), and the PTX is kept for the process
//! and on disk ([`ptx_cache`]), so later processes skip NVRTC. A CPU build compiles none of
//! this: [`enabled_for`] is then always false and the layers take their plain candle path.
//!
//! [`set_enabled`] turns the fused path off for the whole process, so a benchmark can run the
//! plain path on the same device for comparison. It is on by default.

pub mod adamw;
pub mod bias;
pub mod cross_entropy;
pub mod embedding;
pub mod flash_attention;
pub mod gelu;
pub mod heads;
pub mod layer_norm;
pub mod ptx_cache;

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{DType, Tensor};

pub use adamw::{adamw_update, AdamWHyper, AdamWOut};
pub use bias::bias_add;
pub use cross_entropy::cross_entropy_rows;
pub use embedding::{embedding, embedding_grad};
pub use flash_attention::{flash_attention, flash_attention_packed};
pub use gelu::gelu;
pub use heads::{merge_heads, split_heads};
pub use layer_norm::layer_norm;

static ENABLED: AtomicBool = AtomicBool::new(true);

/// Turns the fused kernels on or off for this process (on by default).
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether [`set_enabled`] left the fused kernels on.
pub fn is_enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// True when a fused kernel can take `t`: built with CUDA, `t` on a CUDA device, f32 or bf16,
/// and the kernels enabled.
pub fn enabled_for(t: &Tensor) -> bool {
    cfg!(feature = "cuda")
        && is_enabled()
        && t.device().is_cuda()
        && matches!(t.dtype(), DType::BF16 | DType::F32)
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

/// Pieces every kernel test uses.
#[cfg(test)]
pub(crate) mod test_util {
    use candle_core::{DType, Device, Tensor};

    /// ‖a − b‖ / ‖b‖, in f64.
    pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
        let a = a.to_dtype(DType::F64).unwrap();
        let b = b.to_dtype(DType::F64).unwrap();
        let sq = |t: &Tensor| {
            t.sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        };
        (sq(&(a - &b).unwrap()) / sq(&b)).sqrt()
    }

    /// The first CUDA device, or None after saying the test is skipped (no GPU here).
    pub fn cuda() -> Option<Device> {
        match Device::new_cuda(0) {
            Ok(d) => Some(d),
            Err(_) => {
                eprintln!("skipped: no CUDA device");
                None
            }
        }
    }
}

fn msg(s: String) -> candle_core::Error {
    candle_core::Error::Msg(s)
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! NVRTC compilation, the PTX cache and the host-side launch pieces every kernel shares:
    //!
    //! ```text
    //!   by_dtype!    the bf16 | f32 choice of a generic launch function
    //!   view         a CudaStorage + Layout as the device slice a kernel reads
    //!   kernel       PTX of one instantiation ─> loaded function ─> .builder().arg(..)
    //!   blocks       a (x, y) grid of 1-D blocks; grid_stride and column_blocks the two
    //!                shapes several kernels use
    //! ```
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};

    use candle_core::cuda_backend::cudarc::driver::{
        CudaFunction, CudaSlice, CudaStream, CudaView, LaunchArgs, LaunchConfig,
    };
    use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::op::BackpropOp;
    use candle_core::{
        CudaDevice, CudaStorage, DType, Layout, Result, Shape, Storage, StorageRef, Tensor,
    };

    use super::msg;

    /// `by_dtype!("what", dtype, f(args..))` calls `f::<bf16>(args..)` or `f::<f32>(args..)`;
    /// any other dtype is the error "what: dtype .. (bf16 or f32 only)".
    macro_rules! by_dtype {
        ($what:literal, $dtype:expr, $f:ident($($arg:expr),* $(,)?)) => {
            match $dtype {
                candle_core::DType::BF16 => $f::<half::bf16>($($arg),*),
                candle_core::DType::F32 => $f::<f32>($($arg),*),
                other => Err($crate::kernels::msg(format!(
                    concat!($what, ": dtype {:?} (bf16 or f32 only)"),
                    other
                ))),
            }
        };
    }
    pub(crate) use by_dtype;

    /// The elements of `s` that layout `l` starts at, as the slice a kernel reads.
    pub fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout) -> Result<CudaView<'a, T>> {
        Ok(s.as_cuda_slice::<T>()?.slice(l.start_offset()..))
    }

    /// One loaded kernel function, launched on its device's stream.
    pub struct Kernel {
        func: CudaFunction,
        stream: Arc<CudaStream>,
    }

    impl Kernel {
        /// Starts a launch: push the arguments in the order of the kernel's signature.
        pub fn builder(&self) -> LaunchArgs<'_> {
            self.stream.launch_builder(&self.func)
        }
    }

    /// The kernel `name` of the instantiation (head_dim, dtype) on `dev`, compiled and loaded
    /// on first use (see [`ptx`]).
    pub fn kernel(
        dev: &CudaDevice,
        head_dim: Option<usize>,
        dtype: DType,
        name: &str,
    ) -> Result<Kernel> {
        let (module, code) = ptx(dev, head_dim, dtype)?;
        let f = dev.get_or_load_custom_func(name, &module, &code)?;
        Ok(Kernel {
            func: f.into_cuda_function(),
            stream: dev.cuda_stream(),
        })
    }

    /// A grid of `grid.0 × grid.1` blocks of `threads` threads each, no dynamic shared memory.
    pub fn blocks(grid: (usize, usize), threads: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (grid.0 as u32, grid.1 as u32, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// An elementwise kernel over `n` elements with a grid-stride loop: blocks of 256, enough
    /// of them to fill the card (132 SMs × 16), not one per element.
    pub fn grid_stride(n: usize) -> LaunchConfig {
        blocks((n.div_ceil(256).clamp(1, 132 * 16), 1), 256)
    }

    /// A column reduction of an (n, c) matrix: thread j of a block sums column j over `rows`
    /// rows, so a warp reads 32 neighbouring addresses of one row.
    ///
    /// ```text
    ///   grid (c / threads, n / rows)    block (threads,)
    /// ```
    pub fn column_blocks(n: usize, c: usize, rows: usize, threads: usize) -> LaunchConfig {
        blocks((c.div_ceil(threads), n.div_ceil(rows)), threads)
    }

    /// The CUDA source: the shared element helpers and the layer kernels (`kernels.cu`), then
    /// one file per later topic, compiled as one module.
    const SOURCE: &str = concat!(
        include_str!("kernels.cu"),
        include_str!("adamw.cu"),
        include_str!("embedding.cu"),
    );

    /// PTX by module name, compiled once per process.
    fn ptx_cache() -> &'static Mutex<HashMap<String, Arc<String>>> {
        static CACHE: OnceLock<Mutex<HashMap<String, Arc<String>>>> = OnceLock::new();
        CACHE.get_or_init(|| Mutex::new(HashMap::new()))
    }

    /// The module name for one instantiation of the source.
    pub fn module_name(head_dim: Option<usize>, dtype: DType) -> String {
        let bf16 = dtype == DType::BF16;
        match head_dim {
            Some(d) => format!("mtrain_kernels_d{d}_{}", if bf16 { "bf16" } else { "f32" }),
            None => format!("mtrain_kernels_{}", if bf16 { "bf16" } else { "f32" }),
        }
    }

    /// The compute capability of `dev` as `10 * major + minor` (90 on Hopper).
    pub fn compute_capability(dev: &CudaDevice) -> Result<u32> {
        let (major, minor) = dev
            .cuda_stream()
            .context()
            .compute_capability()
            .map_err(|e| msg(format!("cannot read the compute capability: {e:?}")))?;
        Ok((10 * major + minor) as u32)
    }

    /// NVRTC's `compute_XY` name for a compute capability, one static string per value seen.
    fn arch_name(cc: u32) -> Result<&'static str> {
        static NAMES: OnceLock<Mutex<HashMap<u32, &'static str>>> = OnceLock::new();
        let mut names = NAMES
            .get_or_init(|| Mutex::new(HashMap::new()))
            .lock()
            .map_err(|_| msg("kernel arch lock poisoned".into()))?;
        Ok(*names
            .entry(cc)
            .or_insert_with(|| Box::leak(format!("compute_{cc}").into_boxed_str())))
    }

    /// The module name and PTX of the instantiation (head_dim, dtype) for `dev`'s architecture,
    /// compiled on first use (the tensor-core kernels need compute capability 8.0 or newer).
    /// Load a kernel with `dev.get_or_load_custom_func(name, &module, &ptx)`.
    pub fn ptx(
        dev: &CudaDevice,
        head_dim: Option<usize>,
        dtype: DType,
    ) -> Result<(String, Arc<String>)> {
        let cc = compute_capability(dev)?;
        let module = format!("{}_sm{cc}", module_name(head_dim, dtype));
        let mut cache = ptx_cache()
            .lock()
            .map_err(|_| msg("kernel cache lock poisoned".into()))?;
        if let Some(p) = cache.get(&module) {
            return Ok((module, p.clone()));
        }
        let mut options = vec![format!("-DELEM_BF16={}", u8::from(dtype == DType::BF16))];
        if let Some(d) = head_dim {
            options.push(format!("-DHEAD_DIM={d}"));
        }
        let arch = arch_name(cc)?;
        let mut parts = vec![SOURCE, arch];
        parts.extend(options.iter().map(String::as_str));
        let key = super::ptx_cache::key(&parts);
        let dir = super::ptx_cache::dir();
        let (ptx, cached) = super::ptx_cache::get_or_compile(dir.as_deref(), &module, key, || {
            let opts = CompileOptions {
                options: options.clone(),
                arch: Some(arch),
                name: Some(format!("{module}.cu")),
                ..Default::default()
            };
            compile_ptx_with_opts(SOURCE, opts)
                .map(|p| p.to_src())
                .map_err(|e| msg(format!("NVRTC failed to compile {module}: {e:?}")))
        })?;
        tracing::debug!(module, cached, "kernel module ready");
        let ptx = Arc::new(ptx);
        cache.insert(module.clone(), ptx.clone());
        Ok((module, ptx))
    }

    /// The storage of a contiguous CUDA tensor (held for reading) and its element offset.
    pub fn storage<'a>(t: &'a Tensor, what: &str) -> Result<(StorageRef<'a>, usize)> {
        let (storage, layout) = t.storage_and_layout();
        let offset = match layout.contiguous_offsets() {
            Some((o, _)) => o,
            None => {
                return Err(msg(format!(
                    "{what}: expected a contiguous tensor, got shape {:?} strides {:?}",
                    t.dims(),
                    layout.stride()
                )))
            }
        };
        if !matches!(&*storage, Storage::Cuda(_)) {
            return Err(msg(format!("{what}: expected a CUDA tensor")));
        }
        Ok((storage, offset))
    }

    /// The device buffer of a storage returned by [`storage`], as elements of `T`.
    pub fn slice<T: CudaDType>(s: &Storage) -> Result<&CudaSlice<T>> {
        match s {
            Storage::Cuda(c) => c.as_cuda_slice::<T>(),
            _ => Err(msg("expected a CUDA tensor".into())),
        }
    }

    /// The CUDA device of a tensor.
    pub fn device(t: &Tensor) -> Result<CudaDevice> {
        match t.device() {
            candle_core::Device::Cuda(d) => Ok(d.clone()),
            other => Err(msg(format!("expected a CUDA tensor, got one on {other:?}"))),
        }
    }

    /// Wraps a device buffer as a tensor of `shape` that records no gradient.
    pub fn tensor<T: CudaDType>(
        dev: &CudaDevice,
        s: CudaSlice<T>,
        shape: impl Into<Shape>,
    ) -> Tensor {
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone()));
        Tensor::from_storage(storage, shape, BackpropOp::none(), false)
    }
}
