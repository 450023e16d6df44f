// CUDA kernels of mtrain-model, compiled at first use by NVRTC (see kernels/mod.rs).
//
// Compile-time parameters (passed as -D options):
//   HEAD_DIM   attention head size D (a power of two, 8..128)
//   ELEM_BF16  1: tensors are bf16 (stored as raw 16-bit words), 0: f32
// All arithmetic is f32; only loads and stores see the element type.

#if ELEM_BF16
typedef unsigned short elem;
__device__ __forceinline__ float ld(const elem* p, long i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}
// Round to nearest even, as torch and candle do.
__device__ __forceinline__ void st(elem* p, long i, float f) {
    unsigned int u = __float_as_uint(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    p[i] = (unsigned short)(u >> 16);
}
#else
typedef float elem;
__device__ __forceinline__ float ld(const elem* p, long i) { return p[i]; }
__device__ __forceinline__ void st(elem* p, long i, float f) { p[i] = f; }
#endif

#define NEG_INF (-__int_as_float(0x7f800000))

// ---------------------------------------------------------------------------------------------
// Causal flash attention (Dao et al. 2022), one head per blockIdx.y, BR rows per block.
//
// A row of Q (or K) is owned by SPLIT adjacent lanes, each holding DPT of its D features in
// registers; a dot product is a partial sum per lane plus a shuffle across the SPLIT lanes.
// Tiles of BC rows of the other operand are staged in shared memory as f32 and read by every
// lane (broadcast). Scores live in the log2 domain: s2 = (q . k) * scale * log2(e), so that
// exp(x) becomes exp2f, and the saved statistic is lse2 = log2(sum_j exp2(s2_j)).
// ---------------------------------------------------------------------------------------------
#ifdef HEAD_DIM
#define D HEAD_DIM
#if D > 32
#define DPT 32
#else
#define DPT D
#endif
#define SPLIT (D / DPT)
#define BR 64
#define BC 32
#define CH 16

__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
    for (int off = 1; off < SPLIT; off <<= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

__device__ __forceinline__ float dot_part(const float* r, const float* s) {
    const float4* s4 = reinterpret_cast<const float4*>(s);
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < DPT / 4; ++i) {
        float4 w = s4[i];
        acc += r[4 * i] * w.x + r[4 * i + 1] * w.y + r[4 * i + 2] * w.z + r[4 * i + 3] * w.w;
    }
    return acc;
}

__device__ __forceinline__ void axpy_part(float* acc, float a, const float* s) {
    const float4* s4 = reinterpret_cast<const float4*>(s);
#pragma unroll
    for (int i = 0; i < DPT / 4; ++i) {
        float4 w = s4[i];
        acc[4 * i] += a * w.x;
        acc[4 * i + 1] += a * w.y;
        acc[4 * i + 2] += a * w.z;
        acc[4 * i + 3] += a * w.w;
    }
}

// Rows r0 .. r0+BC of a (T, D) matrix into shared memory as f32; rows past T become 0.
__device__ __forceinline__ void stage(float (*dst)[D], const elem* src, int r0, int T) {
    for (int idx = threadIdx.x; idx < BC * D; idx += blockDim.x) {
        int j = idx / D, c = idx % D, r = r0 + j;
        dst[j][c] = r < T ? ld(src, (long)r * D + c) : 0.f;
    }
}

// o = softmax(mask(q k^T * scale)) v, lse2 per row. q, k, v, o: (BH, T, D); lse2: (BH, T).
extern "C" __global__ void flash_fwd(const elem* q, const elem* k, const elem* v, elem* o,
                                     float* lse2, int T, float qscale) {
    __shared__ __align__(16) float ks[BC][D];
    __shared__ __align__(16) float vs[BC][D];
    const long base = (long)blockIdx.y * T * D;
    const int row = blockIdx.x * BR + threadIdx.x / SPLIT;
    const int d0 = (threadIdx.x % SPLIT) * DPT;
    const bool valid = row < T;
    float qr[DPT], acc[DPT];
#pragma unroll
    for (int i = 0; i < DPT; ++i) {
        qr[i] = valid ? ld(q, base + (long)row * D + d0 + i) * qscale : 0.f;
        acc[i] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    const int last = min(T, (int)(blockIdx.x + 1) * BR) - 1;
    for (int kb = 0; kb <= last; kb += BC) {
        __syncthreads();
        stage(ks, k + base, kb, T);
        stage(vs, v + base, kb, T);
        __syncthreads();
        for (int c = 0; c < BC && kb + c <= last; c += CH) {
            float s[CH];
            float cmax = NEG_INF;
#pragma unroll
            for (int j = 0; j < CH; ++j) {
                float dot = group_sum(dot_part(qr, &ks[c + j][d0]));
                s[j] = (kb + c + j <= row) ? dot : NEG_INF;
                cmax = fmaxf(cmax, s[j]);
            }
            float m_new = fmaxf(m, cmax);
            float m_use = (m_new == NEG_INF) ? 0.f : m_new;
            float corr = exp2f(m - m_use);
            l *= corr;
#pragma unroll
            for (int i = 0; i < DPT; ++i) acc[i] *= corr;
#pragma unroll
            for (int j = 0; j < CH; ++j) {
                float p = exp2f(s[j] - m_use);
                l += p;
                axpy_part(acc, p, &vs[c + j][d0]);
            }
            m = m_new;
        }
    }
    if (valid) {
        float inv = 1.f / l;
#pragma unroll
        for (int i = 0; i < DPT; ++i) st(o, base + (long)row * D + d0 + i, acc[i] * inv);
        if (d0 == 0) lse2[(long)blockIdx.y * T + row] = m + log2f(l);
    }
}

// dvec = rowsum(dO * O), one thread per row of (rows, D).
extern "C" __global__ void flash_bwd_dot(const elem* o, const elem* dout, float* dvec, long rows) {
    long r = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float acc = 0.f;
    for (int i = 0; i < D; ++i) acc += ld(o, r * D + i) * ld(dout, r * D + i);
    dvec[r] = acc;
}

// dq = scale * sum_j dS_ij k_j with dS = P * (dP - dvec), dP = dO v^T; one query row per group.
extern "C" __global__ void flash_bwd_dq(const elem* q, const elem* k, const elem* v,
                                        const elem* dout, const float* lse2, const float* dvec,
                                        elem* dq, int T, float qscale, float scale) {
    __shared__ __align__(16) float ks[BC][D];
    __shared__ __align__(16) float vs[BC][D];
    const long base = (long)blockIdx.y * T * D;
    const int row = blockIdx.x * BR + threadIdx.x / SPLIT;
    const int d0 = (threadIdx.x % SPLIT) * DPT;
    const bool valid = row < T;
    float qr[DPT], dor[DPT], acc[DPT];
#pragma unroll
    for (int i = 0; i < DPT; ++i) {
        long at = base + (long)row * D + d0 + i;
        qr[i] = valid ? ld(q, at) * qscale : 0.f;
        dor[i] = valid ? ld(dout, at) : 0.f;
        acc[i] = 0.f;
    }
    const float L = valid ? lse2[(long)blockIdx.y * T + row] : 0.f;
    const float Dv = valid ? dvec[(long)blockIdx.y * T + row] : 0.f;
    const int last = min(T, (int)(blockIdx.x + 1) * BR) - 1;
    for (int kb = 0; kb <= last; kb += BC) {
        __syncthreads();
        stage(ks, k + base, kb, T);
        stage(vs, v + base, kb, T);
        __syncthreads();
        for (int j = 0; j < BC && kb + j <= last; ++j) {
            float s = group_sum(dot_part(qr, &ks[j][d0]));
            float dp = group_sum(dot_part(dor, &vs[j][d0]));
            float p = (kb + j <= row) ? exp2f(s - L) : 0.f;
            axpy_part(acc, p * (dp - Dv), &ks[j][d0]);
        }
    }
    if (valid) {
#pragma unroll
        for (int i = 0; i < DPT; ++i) st(dq, base + (long)row * D + d0 + i, acc[i] * scale);
    }
}

// dk = scale * sum_i dS_ij q_i, dv = sum_i P_ij dO_i; one key row per group, queries i >= j.
extern "C" __global__ void flash_bwd_dkdv(const elem* q, const elem* k, const elem* v,
                                          const elem* dout, const float* lse2, const float* dvec,
                                          elem* dk, elem* dv, int T, float qscale, float scale) {
    __shared__ __align__(16) float qs[BC][D];
    __shared__ __align__(16) float dos[BC][D];
    __shared__ float ls[BC], dvs[BC];
    const long base = (long)blockIdx.y * T * D;
    const int key = blockIdx.x * BR + threadIdx.x / SPLIT;
    const int d0 = (threadIdx.x % SPLIT) * DPT;
    const bool valid = key < T;
    float kr[DPT], vr[DPT], dka[DPT], dva[DPT];
#pragma unroll
    for (int i = 0; i < DPT; ++i) {
        long at = base + (long)key * D + d0 + i;
        kr[i] = valid ? ld(k, at) * qscale : 0.f;
        vr[i] = valid ? ld(v, at) : 0.f;
        dka[i] = 0.f;
        dva[i] = 0.f;
    }
    for (int qb = blockIdx.x * BR; qb < T; qb += BC) {
        __syncthreads();
        stage(qs, q + base, qb, T);
        stage(dos, dout + base, qb, T);
        for (int j = threadIdx.x; j < BC; j += blockDim.x) {
            long at = (long)blockIdx.y * T + qb + j;
            ls[j] = qb + j < T ? lse2[at] : 0.f;
            dvs[j] = qb + j < T ? dvec[at] : 0.f;
        }
        __syncthreads();
        for (int j = 0; j < BC && qb + j < T; ++j) {
            float s = group_sum(dot_part(kr, &qs[j][d0]));
            float dp = group_sum(dot_part(vr, &dos[j][d0]));
            float p = (qb + j >= key) ? exp2f(s - ls[j]) : 0.f;
            axpy_part(dva, p, &dos[j][d0]);
            axpy_part(dka, p * (dp - dvs[j]), &qs[j][d0]);
        }
    }
    if (valid) {
#pragma unroll
        for (int i = 0; i < DPT; ++i) {
            long at = base + (long)key * D + d0 + i;
            st(dk, at, dka[i] * scale);
            st(dv, at, dva[i]);
        }
    }
}
#endif  // HEAD_DIM

// ---------------------------------------------------------------------------------------------
// Softmax cross-entropy over rows of logits (N, V), one block per row. The forward keeps only
// lse (N,) in f32; the backward rebuilds softmax from it: dlogits = (softmax - onehot) * g.
// ---------------------------------------------------------------------------------------------
#define CE_THREADS 512

// Combines two (max, sum of exp(x - max)) pairs.
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
    float mm = fmaxf(m, m2);
    if (mm == NEG_INF) return;
    s = s * __expf(m - mm) + s2 * __expf(m2 - mm);
    m = mm;
}

extern "C" __global__ void ce_fwd(const elem* logits, const unsigned int* targets, float* loss,
                                  float* lse, int V) {
    __shared__ float sm[CE_THREADS / 32], ss[CE_THREADS / 32];
    const long row = blockIdx.x;
    const elem* x = logits + row * V;
    float m = NEG_INF, s = 0.f;
    for (int i = threadIdx.x; i < V; i += blockDim.x) lse_merge(m, s, ld(x, i), 1.f);
    for (int off = 16; off > 0; off >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, off);
        float s2 = __shfl_xor_sync(0xffffffffu, s, off);
        lse_merge(m, s, m2, s2);
    }
    if (threadIdx.x % 32 == 0) { sm[threadIdx.x / 32] = m; ss[threadIdx.x / 32] = s; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < blockDim.x / 32; ++w) lse_merge(m, s, sm[w], ss[w]);
        float l = m + logf(s);
        unsigned int t = targets[row];
        lse[row] = l;
        loss[row] = t < (unsigned int)V ? l - ld(x, t) : __int_as_float(0x7fc00000);
    }
}

extern "C" __global__ void ce_bwd(const elem* logits, const unsigned int* targets,
                                  const float* lse, const float* g, elem* dlogits, int V) {
    const long row = blockIdx.x;
    const float L = lse[row], gr = g[row];
    const unsigned int t = targets[row];
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        float p = __expf(ld(logits, row * V + i) - L);
        st(dlogits, row * V + i, (p - (i == (int)t ? 1.f : 0.f)) * gr);
    }
}
