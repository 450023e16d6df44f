//! A linear layer's products with the elementwise work around them folded into the GEMM's
//! epilogue (cuBLASLt), graph-free, for the hand-written backward passes:
//!
//! ```text
//!   op                       computes                        epilogue (bf16 on CUDA)   else
//!   forward(x, w, b)         y = x wᵀ + b                    BIAS                      matmul, bias_add
//!   forward_residual(r,..)   y = r + x wᵀ + b                BIAS, C = r (β = 1)       matmul, residual_add
//!   forward_gelu(x, w, b)    f = x wᵀ + b,  g = gelu(f)      GELU_AUX_BIAS (aux = f)   matmul, bias_add, gelu
//!   input_grad_gelu(dy,w,f)  df = gelu'(f) ∘ (dy w)          DGELU (aux = f)           matmul, gelu::backward
//!   weight_grad(dy, x)       dW = dyᵀ x,  db = Σ_rows dy       BGRADB                    matmul, bias::grad
//!
//!   x (N, in), w (out, in), b (out,), r and y (N, out); f, g (N, out); dy (N, out) -> df (N, in)
//! ```
//!
//! `MTRAIN_EPILOGUES` = `none` runs the separate ops everywhere and `no-bgrad` all but the last
//! row's epilogue, to time them against each other; the default is all of them.
//!
//! In cuBLAS's column-major terms a row-major (N, out) matrix is (out, N): y = x wᵀ is
//! D (out × N) = op(A) · B with A = w read transposed (ld in) and B = x (ld in), and the bias,
//! one value per row of D, is broadcast along D's columns — the epilogue adds it to the f32
//! accumulator before the one rounding to bf16, where the separate kernels round the product
//! first and add after. The GELU of the epilogue is the tanh approximation, as [`crate::gelu`].
//!
//! The fused path takes bf16 (the training dtype on GPUs); f32 and the CPU run the composition
//! of the separate ops, which is the reference the fused path is tested against. Algorithms are
//! chosen by cuBLASLt's heuristic once per shape and kept; the workspace is a plain device
//! allocation outside the memory pool (like cuBLAS's own).

use candle_core::{Result, Tensor};

use crate::{bias, gelu};

/// `x wᵀ + b` for x (N, in), w (out, in), b (out,): (N, out).
pub fn forward(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if lt::takes(&[x, w, b]) {
        return fused("gemm+bias", (x, w, false), || lt::forward(x, w, b, None));
    }
    let y = crate::matmul(x, &w.t()?)?;
    crate::profile::elementwise("bias", &[&y, b], || match crate::cpu::takes(&[&y, b]) {
        true => crate::cpu::bias_add(&y, b),
        false => bias::bias_add(&y, b),
    })
}

/// `r + x wᵀ + b` for r (N, out): the layer and the residual add after it.
pub fn forward_residual(r: &Tensor, x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if lt::takes(&[r, x, w, b]) {
        return fused("gemm+residual", (x, w, false), || lt::forward(x, w, b, Some(r)));
    }
    bias::residual_add(r, &crate::matmul(x, &w.t()?)?, b)
}

/// `(f, gelu(f))` with `f = x wᵀ + b`: the MLP's first layer and its activation.
pub fn forward_gelu(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if lt::takes(&[x, w, b]) && lt::aux_fits(w.dim(0)?) {
        return fused("gemm+gelu", (x, w, false), || lt::forward_gelu(x, w, b));
    }
    let f = forward(x, w, b)?;
    let g = gelu::gelu(&f)?;
    Ok((f, g))
}

/// `gelu'(f) ∘ (dy w)` for dy (N, out), w (out, in), f (N, in): the input gradient of a layer
/// whose input was `gelu(f)`, carried through the GELU.
pub fn input_grad_gelu(dy: &Tensor, w: &Tensor, f: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if lt::takes(&[dy, w, f]) && lt::aux_fits(w.dim(1)?) {
        return fused("gemm+gelu backward", (dy, w, true), || lt::input_grad_gelu(dy, w, f));
    }
    gelu::backward(f, &crate::matmul(dy, w)?)
}

/// `(dyᵀ x, Σ_rows dy)` for dy (N, out), x (N, in): a linear layer's weight and bias gradients.
pub fn weight_grad(dy: &Tensor, x: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if lt::takes(&[dy, x, b]) && lt::bias_grad_fused() {
        return crate::profile::op(dy.device(), || lt::weight_grad(dy, x), |_| {
            let ((n, out), inp) = (dy.dims2().unwrap_or((0, 0)), x.dim(1).unwrap_or(0));
            let cost = crate::profile::Cost::gemm(1, (out, n, inp), dy.dtype().size_in_bytes());
            (crate::profile::gemm_name("gemm+bias grad", (out, n, inp)), cost)
        });
    }
    Ok((crate::matmul(&dy.t()?, x)?, bias::grad(dy, b)?))
}

/// [`crate::profile::op`] for a GEMM of cuBLASLt with the epilogue `kind`: x (N, in) · wᵀ for
/// w (out, in), or with `backward` dy (N, out) · w.
#[cfg(feature = "cuda")]
fn fused<R>(kind: &str, (x, w, backward): (&Tensor, &Tensor, bool), f: impl FnOnce() -> Result<R>) -> Result<R> {
    crate::profile::op(x.device(), f, |_| {
        let n = x.elem_count() / x.dims().last().copied().unwrap_or(1).max(1);
        let (out, inp) = w.dims2().unwrap_or((0, 0));
        let (k, m) = if backward { (out, inp) } else { (inp, out) };
        let cost = crate::profile::Cost::gemm(1, (n, k, m), x.dtype().size_in_bytes());
        (crate::profile::gemm_name(kind, (n, k, m)), cost)
    })
}

#[cfg(feature = "cuda")]
mod lt {
    use std::collections::HashMap;
    use std::ffi::c_void;
    use std::mem::size_of;
    use std::sync::{Arc, Mutex, OnceLock};

    use candle_core::cuda_backend::cudarc::cublaslt::{result as blt, sys};
    use candle_core::cuda_backend::cudarc::driver::{
        result as drv, sys as dsys, CudaSlice, DevicePtr,
    };
    use candle_core::{DType, Result, Tensor};
    use half::bf16;

    use crate::cuda::{device, slice, storage, tensor};
    use crate::msg;

    /// The workspace cuBLASLt may use (NVIDIA's advice for Hopper).
    const WORKSPACE: usize = 32 << 20;

    /// Which epilogues run (`MTRAIN_EPILOGUES`: `none`, `no-bgrad`, else all), read once.
    fn level() -> u8 {
        static LEVEL: OnceLock<u8> = OnceLock::new();
        *LEVEL.get_or_init(|| match std::env::var("MTRAIN_EPILOGUES").as_deref() {
            Ok("none") => 0,
            Ok("no-bgrad") => 1,
            _ => 2,
        })
    }

    /// Whether the bias gradient is the weight gradient's epilogue.
    pub fn bias_grad_fused() -> bool {
        level() >= 2
    }

    /// Every tensor bf16 on CUDA, and where it is contiguous already (not copied first), starting
    /// 16 bytes into an allocation's alignment (the allocations themselves are 256-aligned), as
    /// the epilogue's bias and aux pointers must.
    pub fn takes(ts: &[&Tensor]) -> bool {
        level() >= 1
            && ts.iter().all(|t| {
                t.device().is_cuda()
                    && t.dtype() == DType::BF16
                    && (!t.is_contiguous() || (t.layout().start_offset() * 2) % 16 == 0)
            })
    }

    /// The epilogue's auxiliary matrix (the pre-activation) needs a leading dimension that is a
    /// multiple of 8 elements.
    pub fn aux_fits(ld: usize) -> bool {
        ld % 8 == 0
    }

    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
    enum Epilogue {
        Bias,
        GeluAuxBias,
        DGelu,
        BGradB,
    }

    impl Epilogue {
        fn code(self) -> sys::cublasLtEpilogue_t {
            match self {
                Epilogue::Bias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
                Epilogue::GeluAuxBias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
                Epilogue::DGelu => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DGELU,
                Epilogue::BGradB => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BGRADB,
            }
        }
    }

    /// One GEMM D (m × n) = op(A) (m × k) · op(B) (k × n) [+ C] in column-major terms;
    /// `align` the smallest power-of-two alignment of the pointers (bytes).
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
    struct Shape {
        m: u64,
        n: u64,
        k: u64,
        trans_a: bool,
        trans_b: bool,
        epilogue: Epilogue,
        with_c: bool,
        align: u32,
    }

    /// A cuBLASLt handle, its workspace and the algorithm chosen for each shape, one per stream.
    struct Lt {
        handle: sys::cublasLtHandle_t,
        workspace: dsys::CUdeviceptr,
        algos: Mutex<HashMap<Shape, sys::cublasLtMatmulAlgo_t>>,
    }

    // SAFETY: the handle and workspace are used only on the one stream they belong to, whose
    // launches candle serialises; the algorithm cache is behind a mutex.
    unsafe impl Send for Lt {}
    unsafe impl Sync for Lt {}

    fn err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
        msg(format!("cuBLASLt {what}: {e:?}"))
    }

    /// The stream's handle, created on first use and kept for the process.
    fn lt_for(dev: &candle_core::CudaDevice) -> Result<Arc<Lt>> {
        static ALL: OnceLock<Mutex<HashMap<usize, Arc<Lt>>>> = OnceLock::new();
        let stream = dev.cuda_stream();
        let key = stream.cu_stream() as usize;
        let mut all = ALL
            .get_or_init(Default::default)
            .lock()
            .map_err(|_| msg("cuBLASLt handle lock poisoned".into()))?;
        if let Some(lt) = all.get(&key) {
            return Ok(lt.clone());
        }
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| err("context", e))?;
        let handle = blt::create_handle().map_err(|e| err("handle", e))?;
        // SAFETY: a plain device allocation of WORKSPACE bytes, never freed (one per stream).
        let workspace = unsafe { drv::malloc_sync(WORKSPACE) }.map_err(|e| err("workspace", e))?;
        let lt = Arc::new(Lt {
            handle,
            workspace,
            algos: Mutex::new(HashMap::new()),
        });
        all.insert(key, lt.clone());
        Ok(lt)
    }

    /// Descriptors destroyed when dropped.
    struct Layout(sys::cublasLtMatrixLayout_t);
    impl Drop for Layout {
        fn drop(&mut self) {
            // SAFETY: created by create_matrix_layout, destroyed once.
            let _ = unsafe { blt::destroy_matrix_layout(self.0) };
        }
    }
    struct Desc(sys::cublasLtMatmulDesc_t);
    impl Drop for Desc {
        fn drop(&mut self) {
            // SAFETY: created by create_matmul_desc, destroyed once.
            let _ = unsafe { blt::destroy_matmul_desc(self.0) };
        }
    }
    struct Pref(sys::cublasLtMatmulPreference_t);
    impl Drop for Pref {
        fn drop(&mut self) {
            // SAFETY: created by create_matmul_pref, destroyed once.
            let _ = unsafe { blt::destroy_matmul_pref(self.0) };
        }
    }

    fn layout(rows: u64, cols: u64, ld: u64) -> Result<Layout> {
        let l = blt::create_matrix_layout(sys::cudaDataType_t::CUDA_R_16BF, rows, cols, ld as i64)
            .map_err(|e| err("layout", e))?;
        Ok(Layout(l))
    }

    /// Sets one attribute of the matmul descriptor.
    fn set<T>(d: &Desc, attr: sys::cublasLtMatmulDescAttributes_t, v: &T) -> Result<()> {
        // SAFETY: `v` is the attribute's value type, read for size_of::<T>() bytes.
        unsafe {
            blt::set_matmul_desc_attribute(
                d.0,
                attr,
                v as *const T as *const c_void,
                size_of::<T>(),
            )
        }
        .map_err(|e| err("descriptor", e))
    }

    /// The largest power of two (≤ 256) dividing every address.
    fn alignment(ptrs: &[u64]) -> u32 {
        let bits = ptrs.iter().fold(0u64, |acc, p| acc | p);
        if bits == 0 {
            256
        } else {
            (1u64 << bits.trailing_zeros().min(8)) as u32
        }
    }

    /// The pointers of one call: A, B, C (or None), D, the bias and the aux matrix.
    struct Ptrs {
        a: u64,
        b: u64,
        c: Option<u64>,
        d: u64,
        bias: Option<u64>,
        aux: Option<(u64, u64)>,
    }

    /// Runs D = op(A) · B (+ C) with `shape`'s epilogue on the device's stream.
    fn gemm(dev: &candle_core::CudaDevice, mut shape: Shape, p: Ptrs) -> Result<()> {
        let lt = lt_for(dev)?;
        let mut ptrs = vec![p.a, p.b, p.d];
        ptrs.extend(p.c);
        shape.align = alignment(&ptrs);
        let Shape {
            m,
            n,
            k,
            trans_a,
            trans_b,
            ..
        } = shape;
        let desc = Desc(
            blt::create_matmul_desc(
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType_t::CUDA_R_32F,
            )
            .map_err(|e| err("descriptor", e))?,
        );
        use sys::cublasLtMatmulDescAttributes_t as A;
        // cublasOperation_t as cuBLASLt reads it: 1 = transposed, 0 = as stored.
        let op = |t: bool| t as i32;
        set(&desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &op(trans_a))?;
        set(&desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &op(trans_b))?;
        set(
            &desc,
            A::CUBLASLT_MATMUL_DESC_EPILOGUE,
            &shape.epilogue.code(),
        )?;
        if let Some(bias) = p.bias {
            set(&desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)?;
        }
        if let Some((aux, ld)) = p.aux {
            set(&desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux)?;
            set(&desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &(ld as i64))?;
        }
        let la = if trans_a {
            layout(k, m, k)?
        } else {
            layout(m, k, m)?
        };
        let lb = if trans_b {
            layout(n, k, n)?
        } else {
            layout(k, n, k)?
        };
        let ld = layout(m, n, m)?;
        let algo = {
            let mut algos = lt
                .algos
                .lock()
                .map_err(|_| msg("cuBLASLt cache lock poisoned".into()))?;
            match algos.get(&shape) {
                Some(a) => *a,
                None => {
                    let pref = Pref(blt::create_matmul_pref().map_err(|e| err("preference", e))?);
                    use sys::cublasLtMatmulPreferenceAttributes_t as P;
                    let pset = |attr: P, v: u64| {
                        // SAFETY: the attribute's value is a u64 (size_t / uint32 widened where
                        // cuBLASLt reads 8 bytes: workspace bytes; alignments are uint32).
                        unsafe {
                            blt::set_matmul_pref_attribute(
                                pref.0,
                                attr,
                                &v as *const u64 as *const c_void,
                                size_of::<u64>(),
                            )
                        }
                        .map_err(|e| err("preference", e))
                    };
                    pset(
                        P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                        WORKSPACE as u64,
                    )?;
                    let al = shape.align as u32;
                    for attr in [
                        P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                        P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                        P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                        P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                    ] {
                        // SAFETY: the alignment attributes are uint32.
                        unsafe {
                            blt::set_matmul_pref_attribute(
                                pref.0,
                                attr,
                                &al as *const u32 as *const c_void,
                                size_of::<u32>(),
                            )
                        }
                        .map_err(|e| err("preference", e))?;
                    }
                    // SAFETY: every descriptor is live for the call.
                    let h = unsafe {
                        blt::get_matmul_algo_heuristic(
                            lt.handle, desc.0, la.0, lb.0, ld.0, ld.0, pref.0,
                        )
                    }
                    .map_err(|e| err(&format!("no algorithm for {shape:?}"), e))?;
                    algos.insert(shape, h.algo);
                    h.algo
                }
            }
        };
        let (alpha, beta) = (1f32, if p.c.is_some() { 1f32 } else { 0f32 });
        let stream = dev.cuda_stream();
        // SAFETY: the pointers address live buffers of the shapes the layouts describe (the
        // callers check the tensors' shapes and keep them alive across the call), ordered on
        // the stream the tensors' kernels run on.
        unsafe {
            blt::matmul(
                lt.handle,
                desc.0,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                p.a as *const c_void,
                la.0,
                p.b as *const c_void,
                lb.0,
                p.c.unwrap_or(p.d) as *const c_void,
                ld.0,
                p.d as *mut c_void,
                ld.0,
                &algo,
                lt.workspace as *mut c_void,
                WORKSPACE,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| err(&format!("matmul {shape:?}"), e))
    }

    /// The device address of a contiguous bf16 tensor (its storage kept alive by the caller).
    macro_rules! addr {
        ($t:expr, $what:literal, $stream:expr) => {{
            let (s, off) = storage($t, $what)?;
            let v = slice::<bf16>(&s)?.slice(off..);
            let (p, _sync) = v.device_ptr($stream);
            p as u64
        }};
    }

    /// A fresh bf16 buffer of `len` elements and its device address: a GEMM's output, which the
    /// call writes in full before anything reads it.
    fn output(dev: &candle_core::CudaDevice, len: usize) -> Result<(CudaSlice<bf16>, u64)> {
        // SAFETY: every caller's GEMM writes all `len` elements (D, the aux matrix, the bias
        // gradient) before the buffer is read.
        let buf = unsafe { dev.alloc::<bf16>(len)? };
        let stream = dev.cuda_stream();
        let p = {
            let (p, _sync) = buf.device_ptr(&stream);
            p as u64
        };
        Ok((buf, p))
    }

    fn dims2(t: &Tensor, what: &str) -> Result<(usize, usize)> {
        t.dims2()
            .map_err(|_| msg(format!("linear: {what} must be 2-D, got {:?}", t.dims())))
    }

    /// y = x wᵀ + b (+ r): D (out × N) = wᵀ · x (+ r), BIAS.
    pub fn forward(x: &Tensor, w: &Tensor, b: &Tensor, r: Option<&Tensor>) -> Result<Tensor> {
        let (x, w, b) = (x.contiguous()?, w.contiguous()?, b.contiguous()?);
        let ((n, k), (m, k2)) = (dims2(&x, "x")?, dims2(&w, "w")?);
        if k != k2 || b.dims() != [m] || r.is_some_and(|r| r.dims() != [n, m]) {
            return Err(msg(format!(
                "linear: x {:?}, w {:?}, b {:?}, r {:?} are not (N, in), (out, in), (out,), (N, out)",
                x.dims(),
                w.dims(),
                b.dims(),
                r.map(|r| r.dims().to_vec())
            )));
        }
        let dev = device(&x)?;
        let stream = dev.cuda_stream();
        let r = r.map(|r| r.contiguous()).transpose()?;
        let (y, yp) = output(&dev, n * m)?;
        let ptrs = Ptrs {
            a: addr!(&w, "w", &stream),
            b: addr!(&x, "x", &stream),
            c: match &r {
                Some(r) => Some(addr!(r, "residual", &stream)),
                None => None,
            },
            d: yp,
            bias: Some(addr!(&b, "bias", &stream)),
            aux: None,
        };
        let shape = Shape {
            m: m as u64,
            n: n as u64,
            k: k as u64,
            trans_a: true,
            trans_b: false,
            epilogue: Epilogue::Bias,
            with_c: r.is_some(),
            align: 0,
        };
        gemm(&dev, shape, ptrs)?;
        Ok(tensor(&dev, y, (n, m)))
    }

    /// (f, g): D = gelu(wᵀ · x + b) with aux = the pre-activation, GELU_AUX_BIAS.
    pub fn forward_gelu(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
        let (x, w, b) = (x.contiguous()?, w.contiguous()?, b.contiguous()?);
        let ((n, k), (m, k2)) = (dims2(&x, "x")?, dims2(&w, "w")?);
        if k != k2 || b.dims() != [m] {
            return Err(msg(format!(
                "linear: x {:?}, w {:?}, b {:?} are not (N, in), (out, in), (out,)",
                x.dims(),
                w.dims(),
                b.dims()
            )));
        }
        let dev = device(&x)?;
        let stream = dev.cuda_stream();
        let ((f, fp), (g, gp)) = (output(&dev, n * m)?, output(&dev, n * m)?);
        let ptrs = Ptrs {
            a: addr!(&w, "w", &stream),
            b: addr!(&x, "x", &stream),
            c: None,
            d: gp,
            bias: Some(addr!(&b, "bias", &stream)),
            aux: Some((fp, m as u64)),
        };
        let shape = Shape {
            m: m as u64,
            n: n as u64,
            k: k as u64,
            trans_a: true,
            trans_b: false,
            epilogue: Epilogue::GeluAuxBias,
            with_c: false,
            align: 0,
        };
        gemm(&dev, shape, ptrs)?;
        Ok((tensor(&dev, f, (n, m)), tensor(&dev, g, (n, m))))
    }

    /// df = gelu'(f) ∘ (dy w): D (in × N) = w · dy with aux = f, DGELU.
    pub fn input_grad_gelu(dy: &Tensor, w: &Tensor, f: &Tensor) -> Result<Tensor> {
        let (dy, w, f) = (dy.contiguous()?, w.contiguous()?, f.contiguous()?);
        let ((n, k), (k2, m)) = (dims2(&dy, "dy")?, dims2(&w, "w")?);
        if k != k2 || f.dims() != [n, m] {
            return Err(msg(format!(
                "linear: dy {:?}, w {:?}, f {:?} are not (N, out), (out, in), (N, in)",
                dy.dims(),
                w.dims(),
                f.dims()
            )));
        }
        let dev = device(&dy)?;
        let stream = dev.cuda_stream();
        let (df, dp) = output(&dev, n * m)?;
        let ptrs = Ptrs {
            a: addr!(&w, "w", &stream),
            b: addr!(&dy, "dy", &stream),
            c: None,
            d: dp,
            bias: None,
            aux: Some((addr!(&f, "f", &stream), m as u64)),
        };
        let shape = Shape {
            m: m as u64,
            n: n as u64,
            k: k as u64,
            trans_a: false,
            trans_b: false,
            epilogue: Epilogue::DGelu,
            with_c: false,
            align: 0,
        };
        gemm(&dev, shape, ptrs)?;
        Ok(tensor(&dev, df, (n, m)))
    }
    /// (dW, db): D (in × out) = x · dyᵀ, which row-major is dW (out, in), with BGRADB's
    /// reduction of dyᵀ over the rows, db (out,).
    pub fn weight_grad(dy: &Tensor, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let (dy, x) = (dy.contiguous()?, x.contiguous()?);
        let ((n, o), (n2, i)) = (dims2(&dy, "dy")?, dims2(&x, "x")?);
        if n != n2 {
            return Err(msg(format!(
                "linear: dy {:?} and x {:?} are not (N, out) and (N, in)",
                dy.dims(),
                x.dims()
            )));
        }
        let dev = device(&dy)?;
        let stream = dev.cuda_stream();
        let ((dw, wp), (db, bp)) = (output(&dev, o * i)?, output(&dev, o)?);
        let ptrs = Ptrs {
            a: addr!(&x, "x", &stream),
            b: addr!(&dy, "dy", &stream),
            c: None,
            d: wp,
            bias: Some(bp),
            aux: None,
        };
        let shape = Shape {
            m: i as u64,
            n: o as u64,
            k: n as u64,
            trans_a: false,
            trans_b: true,
            epilogue: Epilogue::BGradB,
            with_c: false,
            align: 0,
        };
        gemm(&dev, shape, ptrs)?;
        Ok((tensor(&dev, dw, (o, i)), tensor(&dev, db, o)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{cuda, rel_err};
    use candle_core::DType;

    /// Each fused op against the composition of the separate ops, in f32 from the same bf16
    /// inputs, at shapes of the model's layers (a partial last tile of rows included).
    #[test]
    #[cfg_attr(not(feature = "cuda"), ignore = "needs a CUDA device: build with --features cuda")]
    fn epilogues_match_the_separate_ops_bf16() {
        let dev = cuda();
        for (n, cin, cout) in [(256, 64, 192), (130, 96, 384), (2048, 768, 3072)] {
            let r = |d: (usize, usize)| {
                Tensor::randn(0f32, 1f32, d, &dev)
                    .unwrap()
                    .to_dtype(DType::BF16)
                    .unwrap()
            };
            let (x, w, res) = (r((n, cin)), (r((cout, cin)) * 0.05).unwrap(), r((n, cout)));
            let b = r((1, cout)).squeeze(0).unwrap();
            let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let want_y = f32s(&x)
                .matmul(&f32s(&w).t().unwrap())
                .unwrap()
                .broadcast_add(&f32s(&b))
                .unwrap();
            let y = forward(&x, &w, &b).unwrap();
            assert!(
                rel_err(&y, &want_y) < 1e-2,
                "forward {n}x{cin}x{cout}: {}",
                rel_err(&y, &want_y)
            );
            let yr = forward_residual(&res, &x, &w, &b).unwrap();
            let want_r = (&want_y + f32s(&res)).unwrap();
            assert!(
                rel_err(&yr, &want_r) < 1e-2,
                "residual: {}",
                rel_err(&yr, &want_r)
            );
            let (f, g) = forward_gelu(&x, &w, &b).unwrap();
            let want_g = crate::plain::gelu(&want_y).unwrap();
            assert!(
                rel_err(&f, &want_y) < 1e-2,
                "gelu's f: {}",
                rel_err(&f, &want_y)
            );
            assert!(
                rel_err(&g, &want_g) < 1e-2,
                "gelu's g: {}",
                rel_err(&g, &want_g)
            );
            // The backward of a layer (cin -> cout) whose input was gelu(f), f (n, cin).
            let (f_in, dy) = (r((n, cin)), r((n, cout)));
            let df = input_grad_gelu(&dy, &w, &f_in).unwrap();
            let want_df =
                gelu::backward(&f32s(&f_in), &f32s(&dy).matmul(&f32s(&w)).unwrap()).unwrap();
            assert!(
                rel_err(&df, &want_df) < 1e-2,
                "dgelu {n}x{cin}x{cout}: {}",
                rel_err(&df, &want_df)
            );
            // The gradients of y = x wᵀ + b for dy (n, cout).
            let (dw, db) = weight_grad(&dy, &x, &b).unwrap();
            let want_dw = f32s(&dy).t().unwrap().matmul(&f32s(&x)).unwrap();
            let want_db = f32s(&dy).sum(0).unwrap();
            assert!(
                rel_err(&dw, &want_dw) < 1e-2,
                "dW {n}x{cin}x{cout}: {}",
                rel_err(&dw, &want_dw)
            );
            assert!(
                rel_err(&db, &want_db) < 1e-2,
                "db {n}x{cin}x{cout}: {}",
                rel_err(&db, &want_db)
            );
        }
    }
}
