//! The IPC kernels (`kernels.cu`): compiled by NVRTC once per process, loaded once per
//! context, launched on the group's communication stream with a table of device addresses.

use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use candle_core::DType;

use super::protocol::MAX_WORLD;
use crate::communicator::ReduceOp;

/// Device addresses, one per rank (unused entries 0): the kernels' `Peers` struct.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Peers(pub [u64; MAX_WORLD]);

// SAFETY: a plain array of u64, laid out as the kernels' `struct Peers`.
unsafe impl DeviceRepr for Peers {}

impl Peers {
    pub fn of(addrs: &[u64]) -> Self {
        let mut p = [0u64; MAX_WORLD];
        p[..addrs.len()].copy_from_slice(addrs);
        Peers(p)
    }
}

/// The loaded kernels of one context.
pub struct Kernels {
    reduce_f32: CudaFunction,
    reduce_bf16: CudaFunction,
    signal: CudaFunction,
    wait: CudaFunction,
}

fn ptx() -> Result<Ptx, String> {
    static PTX: OnceLock<Result<String, String>> = OnceLock::new();
    PTX.get_or_init(|| {
        let opts = CompileOptions {
            arch: Some("compute_75"),
            name: Some("mtrain_ipc.cu".into()),
            ..Default::default()
        };
        compile_ptx_with_opts(include_str!("kernels.cu"), opts)
            .map(|p| p.to_src())
            .map_err(|e| format!("NVRTC failed to compile the IPC kernels: {e:?}"))
    })
    .clone()
    .map(Ptx::from_src)
}

impl Kernels {
    /// The kernels on `ctx`, loaded on first use.
    pub fn get(ctx: &Arc<CudaContext>) -> Result<Arc<Kernels>, String> {
        static LOADED: OnceLock<Mutex<Vec<(usize, Arc<Kernels>)>>> = OnceLock::new();
        let mut loaded = LOADED
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some((_, k)) = loaded.iter().find(|(o, _)| *o == ctx.ordinal()) {
            return Ok(k.clone());
        }
        let module = ctx.load_module(ptx()?).map_err(|e| format!("{e:?}"))?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| format!("IPC kernel {name}: {e:?}"))
        };
        let k = Arc::new(Kernels {
            reduce_f32: f("reduce_f32")?,
            reduce_bf16: f("reduce_bf16")?,
            signal: f("signal_flags")?,
            wait: f("wait_flags")?,
        });
        loaded.push((ctx.ordinal(), k.clone()));
        Ok(k)
    }

    /// Enqueue `dst[i] = op_q src[q][off + i]` for `i < count` over the `n` sources.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce(
        &self,
        stream: &CudaStream,
        dtype: DType,
        src: Peers,
        n: usize,
        off: usize,
        dst: u64,
        count: usize,
        op: ReduceOp,
    ) -> Result<(), String> {
        if count == 0 {
            return Ok(());
        }
        let func = match dtype {
            DType::F32 => &self.reduce_f32,
            DType::BF16 => &self.reduce_bf16,
            other => {
                return Err(format!(
                    "the IPC reduction takes bf16 or f32, got {other:?}"
                ))
            }
        };
        let code: i32 = match op {
            ReduceOp::Sum => 0,
            ReduceOp::Avg => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
        };
        let scale = 1.0f32 / n as f32;
        let (n32, off64, count64) = (n as i32, off as u64, count as u64);
        let per_block = 256 * 16 / dtype.size_in_bytes();
        let cfg = LaunchConfig {
            grid_dim: (count.div_ceil(per_block).clamp(1, 132 * 8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(func);
        b.arg(&src)
            .arg(&n32)
            .arg(&off64)
            .arg(&dst)
            .arg(&count64)
            .arg(&code)
            .arg(&scale);
        // SAFETY: the arguments match reduce_f32 / reduce_bf16's signature; every address in
        // `src` holds `off + count` elements and `dst` `count`, alive until the stream ran.
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(|e| format!("{e:?}"))
    }

    /// Enqueue: write `value` to each of the `n` flag addresses.
    pub fn signal(
        &self,
        stream: &CudaStream,
        flags: Peers,
        n: usize,
        value: u64,
    ) -> Result<(), String> {
        let n32 = n as i32;
        let mut b = stream.launch_builder(&self.signal);
        b.arg(&flags).arg(&n32).arg(&value);
        // SAFETY: `flags` holds `n` addresses of flag words that live as long as the group.
        unsafe { b.launch(one_block()) }
            .map(|_| ())
            .map_err(|e| format!("{e:?}"))
    }

    /// Enqueue: spin until each of the `n` flag addresses reaches `target` (or the timeout).
    pub fn wait(
        &self,
        stream: &CudaStream,
        flags: Peers,
        n: usize,
        target: u64,
        timeout_ns: u64,
    ) -> Result<(), String> {
        let n32 = n as i32;
        let mut b = stream.launch_builder(&self.wait);
        b.arg(&flags).arg(&n32).arg(&target).arg(&timeout_ns);
        // SAFETY: as in `signal`.
        unsafe { b.launch(one_block()) }
            .map(|_| ())
            .map_err(|e| format!("{e:?}"))
    }
}

fn one_block() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (MAX_WORLD as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}
