// Fused AdamW (see adamw.rs). Compiled after kernels.cu as one module (cuda.rs).
//
// One launch updates one tensor: it reads p, g, m, v once and writes the new p, m, v (and, in the
// `_copy` variants, the bf16 compute copy of the new p) once. The gradient is f32 (`adamw_g32*`)
// or bf16 (`adamw_gbf16*`) whatever ELEM_BF16 says; everything else is f32, and so is all
// arithmetic.
//
//   thread i of the grid, stride S = gridDim.x · blockDim.x:
//     words   i, i+S, i+2S, ...   4 elements each: 16-byte loads of p, m, v (and g when f32),
//                                 8-byte loads of g when bf16, 8-byte stores of the bf16 copy
//     tail    4·(n/4) + i, ...    the last n mod 4 elements one at a time
// A tensor that starts at an offset may not be 16-byte aligned; then every element takes the
// one-at-a-time loop.

// The per-step constants, computed on the host in f64 (see AdamWStep in adamw.rs).
struct AdamwStep {
    float beta1;     // β1
    float one_m_b1;  // 1 - β1
    float beta2;     // β2
    float one_m_b2;  // 1 - β2
    float inv_bc1;   // 1 / (1 - β1ᵗ)
    float inv_bc2;   // 1 / (1 - β2ᵗ)
    float eps;       // ε, added to √v̂
    float lr;        // learning rate
    float decay;     // 1 - lr·wd, or 1 for a tensor that is not decayed
    float gscale;    // the gradient's multiplier: the clip coefficient, or 1
};

__device__ __forceinline__ float adamw_from_bf16(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

// Round to nearest even, as candle's f32 -> bf16 cast; NaN stays NaN.
__device__ __forceinline__ unsigned short adamw_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

__device__ __forceinline__ float adamw_grad(const float* g, long i) { return g[i]; }
__device__ __forceinline__ float adamw_grad(const unsigned short* g, long i) {
    return adamw_from_bf16(g[i]);
}

// Elements 4w .. 4w+3 of g.
__device__ __forceinline__ float4 adamw_grad4(const float* g, long w) {
    return reinterpret_cast<const float4*>(g)[w];
}
__device__ __forceinline__ float4 adamw_grad4(const unsigned short* g, long w) {
    uint2 h = reinterpret_cast<const uint2*>(g)[w];  // little-endian: element 4w is h.x's low half
    return make_float4(__uint_as_float(h.x << 16), __uint_as_float(h.x & 0xffff0000u),
                       __uint_as_float(h.y << 16), __uint_as_float(h.y & 0xffff0000u));
}

// One element, in the order of adamw.rs's candle path (g already multiplied by gscale):
//   m = β1·m + (1-β1)·g      v = β2·v + (1-β2)·g²
//   p = p·(1 - lr·wd) - lr · (m/(1-β1ᵗ)) / (√(v/(1-β2ᵗ)) + ε)
__device__ __forceinline__ void adamw_one(const AdamwStep& s, float& p, float& m, float& v,
                                          float g) {
    m = s.beta1 * m + s.one_m_b1 * g;
    v = s.beta2 * v + s.one_m_b2 * (g * g);
    float denom = sqrtf(v * s.inv_bc2) + s.eps;
    p = p * s.decay - s.lr * ((m * s.inv_bc1) / denom);
}

__device__ __forceinline__ bool adamw_aligned(const void* ptr, unsigned long bytes) {
    return (reinterpret_cast<unsigned long long>(ptr) & (bytes - 1)) == 0;
}

template <typename G, bool COPY>
__device__ __forceinline__ void adamw_body(const float* __restrict__ p, const G* __restrict__ g,
                                           const float* __restrict__ m,
                                           const float* __restrict__ v, float* __restrict__ p_out,
                                           float* __restrict__ m_out, float* __restrict__ v_out,
                                           unsigned short* __restrict__ p16, long n,
                                           AdamwStep s) {
    const long stride = (long)gridDim.x * blockDim.x;
    const long tid = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool vec = adamw_aligned(p, 16) && adamw_aligned(m, 16) && adamw_aligned(v, 16) &&
                     adamw_aligned(g, 4 * sizeof(G)) && adamw_aligned(p_out, 16) &&
                     adamw_aligned(m_out, 16) && adamw_aligned(v_out, 16) &&
                     (!COPY || adamw_aligned(p16, 8));
    const long words = vec ? n / 4 : 0;
    for (long w = tid; w < words; w += stride) {
        float4 pw = reinterpret_cast<const float4*>(p)[w];
        float4 mw = reinterpret_cast<const float4*>(m)[w];
        float4 vw = reinterpret_cast<const float4*>(v)[w];
        float4 gw = adamw_grad4(g, w);
        adamw_one(s, pw.x, mw.x, vw.x, gw.x * s.gscale);
        adamw_one(s, pw.y, mw.y, vw.y, gw.y * s.gscale);
        adamw_one(s, pw.z, mw.z, vw.z, gw.z * s.gscale);
        adamw_one(s, pw.w, mw.w, vw.w, gw.w * s.gscale);
        reinterpret_cast<float4*>(p_out)[w] = pw;
        reinterpret_cast<float4*>(m_out)[w] = mw;
        reinterpret_cast<float4*>(v_out)[w] = vw;
        if (COPY) {
            uint2 h;
            h.x = (unsigned int)adamw_to_bf16(pw.x) | ((unsigned int)adamw_to_bf16(pw.y) << 16);
            h.y = (unsigned int)adamw_to_bf16(pw.z) | ((unsigned int)adamw_to_bf16(pw.w) << 16);
            reinterpret_cast<uint2*>(p16)[w] = h;
        }
    }
    for (long i = 4 * words + tid; i < n; i += stride) {
        float pi = p[i], mi = m[i], vi = v[i];
        adamw_one(s, pi, mi, vi, adamw_grad(g, i) * s.gscale);
        p_out[i] = pi;
        m_out[i] = mi;
        v_out[i] = vi;
        if (COPY) p16[i] = adamw_to_bf16(pi);
    }
}

extern "C" __global__ void adamw_g32(const float* p, const float* g, const float* m,
                                     const float* v, float* p_out, float* m_out, float* v_out,
                                     long n, AdamwStep s) {
    adamw_body<float, false>(p, g, m, v, p_out, m_out, v_out, nullptr, n, s);
}

extern "C" __global__ void adamw_gbf16(const float* p, const unsigned short* g, const float* m,
                                       const float* v, float* p_out, float* m_out, float* v_out,
                                       long n, AdamwStep s) {
    adamw_body<unsigned short, false>(p, g, m, v, p_out, m_out, v_out, nullptr, n, s);
}

extern "C" __global__ void adamw_g32_copy(const float* p, const float* g, const float* m,
                                          const float* v, float* p_out, float* m_out,
                                          float* v_out, unsigned short* p16, long n,
                                          AdamwStep s) {
    adamw_body<float, true>(p, g, m, v, p_out, m_out, v_out, p16, n, s);
}

extern "C" __global__ void adamw_gbf16_copy(const float* p, const unsigned short* g,
                                            const float* m, const float* v, float* p_out,
                                            float* m_out, float* v_out, unsigned short* p16,
                                            long n, AdamwStep s) {
    adamw_body<unsigned short, true>(p, g, m, v, p_out, m_out, v_out, p16, n, s);
}

// ---- Many tensors in one launch, in place ---------------------------------------------------
// One slot per tensor (AdamwSlot in adamw.rs, field for field). Block b updates chunk
// b - first_chunk of the slot whose chunks it falls in (a binary search over the slots'
// first_chunk), ADAMW_CHUNK elements, writing p, m, v (and the bf16 copy) where it read them:
//
//   slots:   [ tensor 0: chunks 0..c0 ][ tensor 1: chunks c0..c1 ] ... one table per step
//   block b: slot k with first_chunk(k) <= b < first_chunk(k+1),  elements
//            (b - first_chunk(k))·CHUNK .. min(+CHUNK, n_k), 16-byte words where aligned
// Every element is read and written by the same thread, so updating in place is safe.
#define ADAMW_CHUNK 65536
struct AdamwSlot {
    unsigned long long p;    // float*: the parameter (f32), updated in place
    unsigned long long m;    // float*: first moment, in place
    unsigned long long v;    // float*: second moment, in place
    unsigned long long g;    // const float* or const bf16*: the gradient, per the entry point
    unsigned long long p16;  // bf16*: the compute copy, written in place; 0 for none
    long long n;             // elements
    long long first_chunk;   // index of the slot's first chunk in the grid
    float decay;             // 1 - lr·wd, or 1
    float pad;
};

template <typename G>
__device__ __forceinline__ void adamw_slot_chunk(const AdamwSlot& t, long lo, long hi, AdamwStep s) {
    s.decay = t.decay;
    float* p = reinterpret_cast<float*>(t.p);
    float* m = reinterpret_cast<float*>(t.m);
    float* v = reinterpret_cast<float*>(t.v);
    const G* g = reinterpret_cast<const G*>(t.g);
    unsigned short* p16 = reinterpret_cast<unsigned short*>(t.p16);
    const bool vec = adamw_aligned(p, 16) && adamw_aligned(m, 16) && adamw_aligned(v, 16) &&
                     adamw_aligned(g, 4 * sizeof(G)) && (p16 == nullptr || adamw_aligned(p16, 8));
    // lo is a multiple of ADAMW_CHUNK, so the words of [lo, hi) start at lo / 4.
    const long whi = vec ? hi / 4 : lo / 4;
    for (long w = lo / 4 + threadIdx.x; w < whi; w += blockDim.x) {
        float4 pw = reinterpret_cast<const float4*>(p)[w];
        float4 mw = reinterpret_cast<const float4*>(m)[w];
        float4 vw = reinterpret_cast<const float4*>(v)[w];
        float4 gw = adamw_grad4(g, w);
        adamw_one(s, pw.x, mw.x, vw.x, gw.x * s.gscale);
        adamw_one(s, pw.y, mw.y, vw.y, gw.y * s.gscale);
        adamw_one(s, pw.z, mw.z, vw.z, gw.z * s.gscale);
        adamw_one(s, pw.w, mw.w, vw.w, gw.w * s.gscale);
        reinterpret_cast<float4*>(p)[w] = pw;
        reinterpret_cast<float4*>(m)[w] = mw;
        reinterpret_cast<float4*>(v)[w] = vw;
        if (p16 != nullptr) {
            uint2 h;
            h.x = (unsigned int)adamw_to_bf16(pw.x) | ((unsigned int)adamw_to_bf16(pw.y) << 16);
            h.y = (unsigned int)adamw_to_bf16(pw.z) | ((unsigned int)adamw_to_bf16(pw.w) << 16);
            reinterpret_cast<uint2*>(p16)[w] = h;
        }
    }
    for (long i = 4 * whi + threadIdx.x; i < hi; i += blockDim.x) {
        float pi = p[i], mi = m[i], vi = v[i];
        adamw_one(s, pi, mi, vi, adamw_grad(g, i) * s.gscale);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (p16 != nullptr) p16[i] = adamw_to_bf16(pi);
    }
}

template <typename G>
__device__ __forceinline__ void adamw_multi(const AdamwSlot* slots, int count, AdamwStep s) {
    const long b = blockIdx.x;
    int lo = 0, hi = count - 1;  // the last slot whose first_chunk <= b
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (slots[mid].first_chunk <= b) lo = mid; else hi = mid - 1;
    }
    const AdamwSlot t = slots[lo];
    const long start = (b - t.first_chunk) * (long)ADAMW_CHUNK;
    const long end = min(start + (long)ADAMW_CHUNK, (long)t.n);
    if (start < end) adamw_slot_chunk<G>(t, start, end, s);
}

// `scale`, when not null, is one f32 on the device the gradients are also multiplied by (the
// clip coefficient computed there, sq_sum.cu's clip_coef_f32): s.gscale is then 1, and 1·c = c.
extern "C" __global__ void adamw_multi_g32(const AdamwSlot* slots, int count, AdamwStep s,
                                           const float* scale) {
    if (scale != nullptr) s.gscale *= scale[0];
    adamw_multi<float>(slots, count, s);
}

extern "C" __global__ void adamw_multi_gbf16(const AdamwSlot* slots, int count, AdamwStep s,
                                             const float* scale) {
    if (scale != nullptr) s.gscale *= scale[0];
    adamw_multi<unsigned short>(slots, count, s);
}
