// Embedding gradient (see embedding.rs). Compiled after kernels.cu as one module (cuda.rs).
//
// Token embedding y[n] = wte[ids[n]] and its gradient dwte[v] = Σ_{n : ids[n] = v} dy[n]:
//
//   emb_gather_u{16,8,4,2}  one warp per token row n: copies wte row ids[n] into y row n in
//                           aligned words of 16, 8, 4 or 2 bytes (raw bits, no arithmetic)
//   emb_grad_vec            one warp per token row n: lanes read dy row n in 16-byte words
//                           (8 bf16 or 4 f32) and add them with f32 atomics into g row ids[n]
//   emb_grad_scalar         the same one element at a time, for any C and offset
//   emb_cast                g (V, C) f32 -> dwte in the element type
//
// g (V, C) f32 starts at zero. An id >= V is never read from or written to: its output row of
// y is zeros, its dy row is skipped, and the first such row is reported through `bad`, which
// starts at 0 and ends at max over bad rows n of (N - n), so that N - bad is the first bad row.
// Rows are counted in int (the host checks N, V and C fit).

__device__ __forceinline__ bool emb_id_ok(unsigned int id, int V, int n, int N,
                                          unsigned int* bad) {
    if (id < (unsigned int)V) return true;
    if ((threadIdx.x & 31) == 0) atomicMax(bad, (unsigned int)(N - n));
    return false;
}

template <typename Unit>
__device__ __forceinline__ void emb_gather(const unsigned int* __restrict__ ids,
                                           const Unit* __restrict__ wte, Unit* __restrict__ y,
                                           int N, int Cu, int V, unsigned int* bad) {
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    for (int n = blockIdx.x * warps + (threadIdx.x >> 5); n < N; n += gridDim.x * warps) {
        const unsigned int id = ids[n];
        Unit* dst = y + (long)n * Cu;
        if (emb_id_ok(id, V, n, N, bad)) {
            const Unit* src = wte + (long)id * Cu;
            for (int c = lane; c < Cu; c += 32) dst[c] = src[c];
        } else {
            const Unit zero{};
            for (int c = lane; c < Cu; c += 32) dst[c] = zero;
        }
    }
}

#define EMB_GATHER(UNIT, BYTES)                                                              \
    extern "C" __global__ void emb_gather_u##BYTES(const unsigned int* ids, const UNIT* wte, \
                                                   UNIT* y, int N, int Cu, int V,            \
                                                   unsigned int* bad) {                      \
        emb_gather<UNIT>(ids, wte, y, N, Cu, V, bad);                                        \
    }
EMB_GATHER(uint4, 16)
EMB_GATHER(uint2, 8)
EMB_GATHER(unsigned int, 4)
EMB_GATHER(unsigned short, 2)

// One 16-byte word of dy as EMB_VEC f32 values.
#if ELEM_BF16
#define EMB_VEC 8
__device__ __forceinline__ void emb_load(const elem* p, float* v) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // little endian: element 2i is the low half of word i
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
#else
#define EMB_VEC 4
__device__ __forceinline__ void emb_load(const elem* p, float* v) {
    const float4 u = *reinterpret_cast<const float4*>(p);
    v[0] = u.x;
    v[1] = u.y;
    v[2] = u.z;
    v[3] = u.w;
}
#endif

// g[0..EMB_VEC) += v, atomically; 16-byte f32 atomics on Hopper and newer.
__device__ __forceinline__ void emb_add(float* g, const float* v) {
#if __CUDA_ARCH__ >= 900
#pragma unroll
    for (int i = 0; i < EMB_VEC; i += 4)
        atomicAdd(reinterpret_cast<float4*>(g + i),
                  make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]));
#else
#pragma unroll
    for (int i = 0; i < EMB_VEC; ++i) atomicAdd(g + i, v[i]);
#endif
}

// Needs C % EMB_VEC == 0 and dy starting on a 16-byte boundary.
extern "C" __global__ void emb_grad_vec(const unsigned int* __restrict__ ids,
                                        const elem* __restrict__ dy, float* g, int N, int C,
                                        int V, unsigned int* bad) {
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    for (int n = blockIdx.x * warps + (threadIdx.x >> 5); n < N; n += gridDim.x * warps) {
        const unsigned int id = ids[n];
        if (!emb_id_ok(id, V, n, N, bad)) continue;
        const elem* src = dy + (long)n * C;
        float* dst = g + (long)id * C;
        for (int c = lane * EMB_VEC; c < C; c += 32 * EMB_VEC) {
            float v[EMB_VEC];
            emb_load(src + c, v);
            emb_add(dst + c, v);
        }
    }
}

extern "C" __global__ void emb_grad_scalar(const unsigned int* __restrict__ ids,
                                           const elem* __restrict__ dy, float* g, int N, int C,
                                           int V, unsigned int* bad) {
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    for (int n = blockIdx.x * warps + (threadIdx.x >> 5); n < N; n += gridDim.x * warps) {
        const unsigned int id = ids[n];
        if (!emb_id_ok(id, V, n, N, bad)) continue;
        const elem* src = dy + (long)n * C;
        float* dst = g + (long)id * C;
        for (int c = lane; c < C; c += 32) atomicAdd(dst + c, ld(src, c));
    }
}

// out = g in the element type (round to nearest even for bf16); g starts 16-byte aligned.
extern "C" __global__ void emb_cast(const float* __restrict__ g, elem* __restrict__ out,
                                    long n) {
    const long stride = (long)gridDim.x * blockDim.x;
    const long n4 = n / 4;
    const float4* g4 = reinterpret_cast<const float4*>(g);
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
        const float4 v = g4[i];
        st(out, 4 * i, v.x);
        st(out, 4 * i + 1, v.y);
        st(out, 4 * i + 2, v.z);
        st(out, 4 * i + 3, v.w);
    }
    for (long i = 4 * n4 + (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        st(out, i, g[i]);
}
