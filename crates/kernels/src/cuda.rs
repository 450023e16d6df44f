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

use crate::msg;

/// `by_dtype!("what", dtype, f(args..))` calls `f::<bf16>(args..)` or `f::<f32>(args..)`;
/// any other dtype is the error "what: dtype .. (bf16 or f32 only)".
macro_rules! by_dtype {
    ($what:literal, $dtype:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match $dtype {
            candle_core::DType::BF16 => $f::<half::bf16>($($arg),*),
            candle_core::DType::F32 => $f::<f32>($($arg),*),
            other => Err($crate::msg(format!(
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

    /// Lets launches give the kernel up to `bytes` of dynamic shared memory (beyond the 48 KiB
    /// a kernel gets without asking).
    pub fn allow_dynamic_smem(&self, bytes: usize) -> Result<()> {
        use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum as A;
        self.func
            .set_attribute(
                A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(|e| {
                msg(format!(
                    "cannot allow {bytes} bytes of shared memory: {e:?}"
                ))
            })
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

/// A column reduction of an (n, c) matrix: a block of `threads` sums `cols` adjacent columns
/// over `rows` rows, its warps taking every so-many row and a warp's lanes the columns, so a
/// warp reads `cols` neighbouring elements of one row.
///
/// ```text
///   grid (c / cols, n / rows)    block (threads,)
/// ```
pub fn column_blocks(n: usize, c: usize, rows: usize, threads: usize, cols: usize) -> LaunchConfig {
    blocks((c.div_ceil(cols), n.div_ceil(rows)), threads)
}

/// The CUDA source: the Philox generator the dropout masks are drawn from (`philox.cu`), the
/// shared element helpers and the layer kernels (`kernels.cu`), then one file per later topic,
/// compiled as one module.
const SOURCE: &str = concat!(
    include_str!("philox.cu"),
    include_str!("kernels.cu"),
    include_str!("adamw.cu"),
    include_str!("embedding.cu"),
    include_str!("sq_sum.cu"),
    include_str!("flash_wide.cu"),
    include_str!("flash_hopper.cu"),
    include_str!("dropout.cu"),
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

/// NVRTC's `compute_XY` name for a compute capability, one static string per value seen;
/// `compute_90a` on Hopper, whose wgmma instructions the architecture-specific target alone
/// has (`attention_path::hopper_arch`).
fn arch_name(cc: u32) -> Result<&'static str> {
    static NAMES: OnceLock<Mutex<HashMap<u32, &'static str>>> = OnceLock::new();
    let mut names = NAMES
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .map_err(|_| msg("kernel arch lock poisoned".into()))?;
    Ok(*names.entry(cc).or_insert_with(|| {
        let suffix = if crate::attention_path::hopper_arch(cc) {
            "a"
        } else {
            ""
        };
        Box::leak(format!("compute_{cc}{suffix}").into_boxed_str())
    }))
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
    let blocks = head_dim.and(wide_min_blocks());
    let module = match blocks {
        Some(b) => format!("{}_sm{cc}_b{b}", module_name(head_dim, dtype)),
        None => format!("{}_sm{cc}", module_name(head_dim, dtype)),
    };
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
    if let Some(b) = blocks {
        options.push(format!("-DWD_MIN_BLOCKS={b}"));
    }
    if let (Some(d), true) = (head_dim, crate::attention_path::hopper_arch(cc)) {
        options.extend(crate::attention_path::hopper_options(d));
    }
    let arch = arch_name(cc)?;
    let mut parts = vec![SOURCE, arch];
    parts.extend(options.iter().map(String::as_str));
    let key = crate::ptx_cache::key(&parts);
    let dir = crate::ptx_cache::dir();
    let (ptx, cached) = crate::ptx_cache::get_or_compile(dir.as_deref(), &module, key, || {
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

/// The blocks per SM the wide attention kernels' registers are fitted to
/// (`__launch_bounds__`), where the environment sets `MTRAIN_FLASH_MIN_BLOCKS` to 1..=4 to
/// time the choices against each other; None: the source's default (2). Read once.
fn wide_min_blocks() -> Option<u32> {
    static BLOCKS: OnceLock<Option<u32>> = OnceLock::new();
    *BLOCKS.get_or_init(|| {
        std::env::var("MTRAIN_FLASH_MIN_BLOCKS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|b| (1..=4).contains(b))
    })
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
pub fn tensor<T: CudaDType>(dev: &CudaDevice, s: CudaSlice<T>, shape: impl Into<Shape>) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone()));
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}
