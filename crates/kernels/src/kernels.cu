// CUDA kernels of mtrain-kernels, compiled at first use by NVRTC (see cuda.rs).
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
// The bf16 bits of f, rounded to nearest even, as torch and candle do.
__device__ __forceinline__ unsigned int bf16_bits(float f) {
    unsigned int u = __float_as_uint(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
}
__device__ __forceinline__ void st(elem* p, long i, float f) { p[i] = (unsigned short)bf16_bits(f); }
#else
typedef float elem;
__device__ __forceinline__ float ld(const elem* p, long i) { return p[i]; }
__device__ __forceinline__ void st(elem* p, long i, float f) { p[i] = f; }
#endif

// Elementwise kernels move 16 bytes per access where they can: VEC elements, unpacked to f32.
#define VEC (16 / (int)sizeof(elem))
__device__ __forceinline__ bool aligned16(const void* p) {
    return ((unsigned long long)p & 15ull) == 0;
}
// Whether rows of n elements move VEC at a time: n % VEC == 0 and every pointer 16-byte aligned.
template <typename... P>
__device__ __forceinline__ bool rows_vec(long n, const P*... p) {
    return n % VEC == 0 && (aligned16(p) && ...);
}
// f[0..VEC) = p[i .. i+VEC) as f32; p + i 16-byte aligned.
__device__ __forceinline__ void ldv(const elem* p, long i, float* f) {
    const uint4 w = *reinterpret_cast<const uint4*>(p + i);
    const unsigned int u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#if ELEM_BF16
        f[2 * k] = __uint_as_float(u[k] << 16);
        f[2 * k + 1] = __uint_as_float(u[k] & 0xffff0000u);
#else
        f[k] = __uint_as_float(u[k]);
#endif
    }
}
// p[i .. i+VEC) = f[0..VEC) in the element type; p + i 16-byte aligned.
__device__ __forceinline__ void stv(elem* p, long i, const float* f) {
    unsigned int u[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#if ELEM_BF16
        u[k] = bf16_bits(f[2 * k]) | (bf16_bits(f[2 * k + 1]) << 16);
#else
        u[k] = __float_as_uint(f[k]);
#endif
    }
    *reinterpret_cast<uint4*>(p + i) = make_uint4(u[0], u[1], u[2], u[3]);
}

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

// Dropout on the attention probabilities (dropout.rs `Mask` of (B, H, T·T)): this launch's
// heads are (B_l, hl) at (b0, h0) of the global (Bg, hg); no dropout when key.threshold is 0.
struct AttnDrop {
    DropKey key;
    int hl, hg, b0, h0;
};

// The global index of element (0, 0) of head blockIdx.y's (T, T) probabilities.
__device__ __forceinline__ unsigned long long attn_base(const AttnDrop& d, int T) {
    const long b = blockIdx.y / d.hl, h = blockIdx.y % d.hl;
    return (unsigned long long)((d.b0 + b) * d.hg + d.h0 + h) * T * T;
}

// The mask of probability (row, col): 0 or 1 / (1 - p); 1 without dropout.
__device__ __forceinline__ float attn_mask(const AttnDrop& d, unsigned long long base, int T,
                                           int row, int col) {
    return d.key.threshold == 0 ? 1.f : drop_mask(d.key, base + (unsigned long long)row * T + col);
}

// o = (P ∘ M) v with P = softmax(mask(q k^T * scale)) and M the dropout mask, lse2 per row
// (of P, before dropout). q, k, v, o: (BH, T, D); lse2: (BH, T).
extern "C" __global__ void flash_fwd(const elem* q, const elem* k, const elem* v, elem* o,
                                     float* lse2, int T, float qscale, AttnDrop drop) {
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
    const unsigned long long hb = attn_base(drop, T);
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
                if (s[j] != NEG_INF) p *= attn_mask(drop, hb, T, row, kb + c + j);
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

// Where the rows of a (BH, T, D) attention operand lie: row t of head bh starts at element
// (bh / heads)·batch + (bh % heads)·head + t·row. Heads stored apart, (BH, T, D) contiguous:
// {T·D, 0, D, 1}. The tokens' layout, a linear's output (B, T, S·H·D) read in place (part s
// from element s·H·D on, the kernel given that part's first element): {T·S·H·D, D, S·H·D, H}.
// (T·row < 2³¹: attention.rs checks it.)
struct HeadRows {
    long batch, head;
    int row, heads;
};
__device__ __forceinline__ long head_row(const HeadRows& l, int bh, long t) {
    return (long)(bh / l.heads) * l.batch + (long)(bh % l.heads) * l.head + t * l.row;
}

// dvec = rowsum(dO * O) over the rows of (BH, T, D) operands laid out by `lo` (both the same
// way): 8 neighbouring lanes per row, each summing D/8 consecutive elements, so a warp reads
// 4 whole rows (coalesced); a shuffle adds the 8 parts. Launched with 8 threads per row, in
// blocks of a multiple of 32; dvec is (BH, T) contiguous.
extern "C" __global__ void flash_bwd_dot(const elem* o, const elem* dout, float* dvec, long rows,
                                         int T, HeadRows lo) {
    const long r = ((long)blockIdx.x * blockDim.x + threadIdx.x) >> 3;
    const int part = threadIdx.x & 7;
    float acc = 0.f;
    if (r < rows) {
        const long at = head_row(lo, (int)(r / T), r % T) + part * (D / 8);
#pragma unroll
        for (int i = 0; i < D / 8; ++i) acc += ld(o, at + i) * ld(dout, at + i);
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    acc += __shfl_xor_sync(0xffffffffu, acc, 4);
    if (r < rows && part == 0) dvec[r] = acc;
}

// dq = scale * sum_j dS_ij k_j with dS = P * (dP ∘ M - dvec), dP = dO v^T, M the dropout mask
// (dvec = rowsum(dO ∘ O) = rowsum(P ∘ M ∘ dP) still); one query row per group.
extern "C" __global__ void flash_bwd_dq(const elem* q, const elem* k, const elem* v,
                                        const elem* dout, const float* lse2, const float* dvec,
                                        elem* dq, int T, float qscale, float scale,
                                        AttnDrop drop) {
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
    const unsigned long long hb = attn_base(drop, T);
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
            if (p != 0.f) dp *= attn_mask(drop, hb, T, row, kb + j);
            axpy_part(acc, p * (dp - Dv), &ks[j][d0]);
        }
    }
    if (valid) {
#pragma unroll
        for (int i = 0; i < DPT; ++i) st(dq, base + (long)row * D + d0 + i, acc[i] * scale);
    }
}

// dk = scale * sum_i dS_ij q_i, dv = sum_i (P ∘ M)_ij dO_i (M the dropout mask, dS as in
// flash_bwd_dq); one key row per group, queries i >= j.
extern "C" __global__ void flash_bwd_dkdv(const elem* q, const elem* k, const elem* v,
                                          const elem* dout, const float* lse2, const float* dvec,
                                          elem* dk, elem* dv, int T, float qscale, float scale,
                                          AttnDrop drop) {
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
    const unsigned long long hb = attn_base(drop, T);
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
            const float mk = (p != 0.f && valid) ? attn_mask(drop, hb, T, qb + j, key) : 1.f;
            axpy_part(dva, p * mk, &dos[j][d0]);
            axpy_part(dka, p * (dp * mk - dvs[j]), &qs[j][d0]);
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
// Causal flash attention on tensor cores: bf16 inputs, f32 accumulation, HEAD_DIM 16..64.
//
// A block is 4 warps; each warp owns 16 of the block's 64 rows (queries in flash_tc_fwd and
// flash_tc_dq, keys in flash_tc_dkdv) and keeps them in registers as mma A fragments. Tiles of 64
// rows of the other operands are staged in shared memory as bf16, rows padded by 8 elements so
// that the fragment reads below hit 32 distinct banks. Products are mma.sync m16n8k16
// (bf16 x bf16 -> f32), with g = lane / 4 and t = lane % 4:
//
//   A 16x16 row-major   a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B 16x8  col-major   b0 (k 2t..2t+1, n g)  b1 (k 2t+8..2t+9, n g)
//   C 16x8  f32         c0 c1 (g, 2t..2t+1)   c2 c3 (g+8, 2t..2t+1)
//
// Two C tiles side by side, rounded to bf16, are exactly the A fragment of the next product
// (P V, dS K, Pᵀ dO, dSᵀ Q), so probabilities never leave registers. Dropout multiplies each
// probability by its mask where it is in a register (`attn_mask`, as the CUDA-core kernels do):
// P ∘ M into P V and Pᵀ dO, dP ∘ M into dS. The backward is the FA2
// split: flash_tc_dq walks key tiles for 64 queries, flash_tc_dkdv walks query tiles for 64 keys;
// each recomputes S and dP, and no block writes another's output.
// ---------------------------------------------------------------------------------------------
#if defined(HEAD_DIM) && ELEM_BF16 && (HEAD_DIM % 16 == 0) && (HEAD_DIM <= 64) && \
    (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800)
#define TC_ROWS 64       // rows owned per block (4 warps x 16)
#define TC_COLS 64       // rows of a staged tile
#define TC_LD (D + 8)    // padded shared-memory row, in elements
#define NT (TC_COLS / 8) // 16x8 C tiles across a score tile
#define KD (D / 16)      // k-steps over the head size
#define ND (D / 8)       // 16x8 C tiles across the head size

typedef unsigned int u32;

__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (lo, hi) as bf16x2 rounded to nearest even; lo lands in the low half (the lower column).
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The shared-memory address of p, as ldmatrix and cp.async take it.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(a) : "l"(p));
    return a;
}

// cp.async: a global -> shared copy that does not stall the thread; `bytes` 0 writes zeros.
// Copies issued since the last commit form a group; wait<N> returns when at most N groups are
// still in flight, so a tile can be fetched while the previous one is being used.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
                 "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)),
                 "l"(src), "r"(ok ? 4 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Rows r0 .. r0+64 of a (T, D) matrix into shared memory through cp.async, 16 bytes a copy;
// rows past T are 0.
__device__ __forceinline__ void tc_stage_async(elem (*dst)[TC_LD], const elem* src, int r0,
                                               int T) {
    const int per_row = D / 8;
    for (int i = threadIdx.x; i < TC_COLS * per_row; i += blockDim.x) {
        const int r = i / per_row, c = (i % per_row) * 8;
        const bool ok = r0 + r < T;
        cp_async16(&dst[r][c], ok ? src + (long)(r0 + r) * D + c : src, ok);
    }
}

// A fragments of rows r0 .. r0+16 of a (T, D) matrix for all D/16 k-steps; rows past T are 0.
__device__ __forceinline__ void tc_load_a(u32 (*a)[4], const elem* src, int r0, int T) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const bool v0 = r0 + g < T, v1 = r0 + g + 8 < T;
    const u32* lo = reinterpret_cast<const u32*>(src + (long)(r0 + g) * D);
    const u32* hi = reinterpret_cast<const u32*>(src + (long)(r0 + g + 8) * D);
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
        int w = kk * 8 + t;  // 32-bit word of columns 16kk + 2t, 16kk + 2t + 1
        a[kk][0] = v0 ? lo[w] : 0u;
        a[kk][1] = v1 ? hi[w] : 0u;
        a[kk][2] = v0 ? lo[w + 4] : 0u;
        a[kk][3] = v1 ? hi[w + 4] : 0u;
    }
}

// ldmatrix: lane l gives the address of row l % 8 of 8x8 matrix l / 8 (16 bytes of bf16); lane
// (g, t) receives, from each matrix, the pair at row g, columns 2t, 2t+1 — or, with .trans, the
// pair at rows 2t, 2t+1 of column g. Those are exactly mma B fragment words.
__device__ __forceinline__ void ldsm_x4(u32* r, const elem* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x2(u32* r, const elem* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(u32* r, const elem* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// s (16 x 64) = X Yᵀ: X in A fragments (16 x D), Y the staged tile (64 x D); the B words of
// 8 rows of Y are rows of Y, read by ldmatrix two k-steps (32 columns) at a time:
//   matrix i of x4: rows n·8 .. n·8+8, columns (kk + i/2)·16 + (i%2)·8 .. +8
__device__ __forceinline__ void tc_scores(float (*s)[4], const u32 (*a)[4],
                                          const elem (*y)[TC_LD]) {
    const int l = threadIdx.x & 31, mi = l >> 3, r = l & 7;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
        const elem* row = y[n * 8 + r];
#if KD == 1
        u32 b[2];
        ldsm_x2(b, row + (mi & 1) * 8);
        mma_bf16(s[n], a[0], b[0], b[1]);
#else
#pragma unroll
        for (int kk = 0; kk < KD; kk += 2) {
            u32 b[4];
            ldsm_x4(b, row + (kk + (mi >> 1)) * 16 + (mi & 1) * 8);
            mma_bf16(s[n], a[kk], b[0], b[1]);
            mma_bf16(s[n], a[kk + 1], b[2], b[3]);
        }
#endif
    }
}

// acc (16 x D) += P Y: P (16 x 64) in C tiles, Y the staged tile (64 x D); the B words pair two
// rows of Y in one column, read by ldmatrix.trans two column tiles (16 columns) at a time:
//   matrix i of x4: rows kk·16 + (i%2)·8 .. +8, columns (n + i/2)·8 .. +8
__device__ __forceinline__ void tc_accum(float (*acc)[4], const float (*p)[4],
                                         const elem (*y)[TC_LD]) {
    const int l = threadIdx.x & 31, mi = l >> 3, r = l & 7;
#pragma unroll
    for (int kk = 0; kk < TC_COLS / 16; ++kk) {
        const u32 a[4] = {pack_bf16(p[2 * kk][0], p[2 * kk][1]),
                          pack_bf16(p[2 * kk][2], p[2 * kk][3]),
                          pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                          pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3])};
        const elem* row = y[kk * 16 + (mi & 1) * 8 + r];
#pragma unroll
        for (int n = 0; n < ND; n += 2) {
            u32 b[4];
            ldsm_x4_trans(b, row + (n + (mi >> 1)) * 8);
            mma_bf16(acc[n], a, b[0], b[1]);
            mma_bf16(acc[n + 1], a, b[2], b[3]);
        }
    }
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Writes rows r0+g and r0+g+8 of a (16 x D) C-tile accumulator, times mul, to a (T, D) matrix.
__device__ __forceinline__ void tc_store(elem* dst, const float (*acc)[4], int r0, int T,
                                         float mul0, float mul1) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = r0 + g + 8 * h;
        if (row >= T) continue;
        const float mul = h ? mul1 : mul0;
        u32* out = reinterpret_cast<u32*>(dst + (long)row * D);
#pragma unroll
        for (int n = 0; n < ND; ++n)
            out[n * 4 + t] = pack_bf16(acc[n][2 * h] * mul, acc[n][2 * h + 1] * mul);
    }
}

// o = softmax(mask(q kᵀ scale)) v and lse2 per row; q, k, v, o: (BH, T, D), lse2: (BH, T).
extern "C" __global__ void __launch_bounds__(128)
    flash_tc_fwd(const elem* q, const elem* k, const elem* v, elem* o, float* lse2, int T,
                 float qscale, AttnDrop drop) {
    __shared__ __align__(16) elem ks[2][TC_COLS][TC_LD];  // two buffers: use one, fill the other
    __shared__ __align__(16) elem vs[2][TC_COLS][TC_LD];
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const long base = (long)blockIdx.y * T * D;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * TC_ROWS;  // the longest rows start first
    const int r0 = q0 + (threadIdx.x >> 5) * 16;
    tc_stage_async(ks[0], k + base, 0, T);
    tc_stage_async(vs[0], v + base, 0, T);
    cp_commit();
    u32 qa[KD][4];
    tc_load_a(qa, q + base, r0, T);
    float acc[ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    const unsigned long long hb = attn_base(drop, T);
    int buf = 0;
    for (int kb = 0; kb <= q0; kb += TC_COLS, buf ^= 1) {
        if (kb + TC_COLS <= q0) {  // fetch the next tile while this one is used
            tc_stage_async(ks[buf ^ 1], k + base, kb + TC_COLS, T);
            tc_stage_async(vs[buf ^ 1], v + base, kb + TC_COLS, T);
        }
        cp_commit();
        cp_wait<1>();  // this tile has landed (the next may still be in flight)
        __syncthreads();
        float s[NT][4];
        tc_scores(s, qa, ks[buf]);  // (16, 64) raw q·k
        float mx[2] = {m[0], m[1]};
        const bool full = kb + TC_COLS - 1 <= r0;  // no key of the tile is after a row of the warp
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = r0 + g + 8 * (e >> 1), key = kb + n * 8 + 2 * t + (e & 1);
                s[n][e] = (full || key <= row) ? s[n][e] * qscale : NEG_INF;
                mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
            }
        // Key kb <= q0 <= row is never masked, so the new maxima are finite.
        float corr[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = quad_max(mx[h]);
            corr[h] = exp2f(m[h] - mx[h]);
            l[h] *= corr[h];
            m[h] = mx[h];
        }
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[n][e] = exp2f(s[n][e] - m[e >> 1]);
                l[e >> 1] += s[n][e];  // this lane's share; summed over the quad at the end
                if (drop.key.threshold != 0 && s[n][e] != 0.f)
                    s[n][e] *= attn_mask(drop, hb, T, r0 + g + 8 * (e >> 1), kb + n * 8 + 2 * t + (e & 1));
            }
#pragma unroll
        for (int n = 0; n < ND; ++n) {
            acc[n][0] *= corr[0];
            acc[n][1] *= corr[0];
            acc[n][2] *= corr[1];
            acc[n][3] *= corr[1];
        }
        tc_accum(acc, s, vs[buf]);  // (16, D) += P V
        __syncthreads();            // every warp is done with buf before it is refilled
    }
    l[0] = quad_sum(l[0]);
    l[1] = quad_sum(l[1]);
    tc_store(o + base, acc, r0, T, 1.f / l[0], 1.f / l[1]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = r0 + g + 8 * h;
        if (t == 0 && row < T) lse2[(long)blockIdx.y * T + row] = m[h] + log2f(l[h]);
    }
}

// dq = scale · dS k with dS = P ∘ (dO vᵀ − dvec); 64 queries per block, key tiles up to them.
extern "C" __global__ void __launch_bounds__(128)
    flash_tc_dq(const elem* q, const elem* k, const elem* v, const elem* dout, const float* lse2,
                const float* dvec, elem* dq, int T, float qscale, float scale, AttnDrop drop) {
    __shared__ __align__(16) elem ks[2][TC_COLS][TC_LD];
    __shared__ __align__(16) elem vs[2][TC_COLS][TC_LD];
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const long base = (long)blockIdx.y * T * D;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * TC_ROWS;
    const int r0 = q0 + (threadIdx.x >> 5) * 16;
    tc_stage_async(ks[0], k + base, 0, T);
    tc_stage_async(vs[0], v + base, 0, T);
    cp_commit();
    u32 qa[KD][4], da[KD][4];
    tc_load_a(qa, q + base, r0, T);
    tc_load_a(da, dout + base, r0, T);
    float L[2], Dv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = r0 + g + 8 * h;
        L[h] = row < T ? lse2[(long)blockIdx.y * T + row] : 0.f;
        Dv[h] = row < T ? dvec[(long)blockIdx.y * T + row] : 0.f;
    }
    float acc[ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    const unsigned long long hb = attn_base(drop, T);
    int buf = 0;
    for (int kb = 0; kb <= q0; kb += TC_COLS, buf ^= 1) {
        if (kb + TC_COLS <= q0) {
            tc_stage_async(ks[buf ^ 1], k + base, kb + TC_COLS, T);
            tc_stage_async(vs[buf ^ 1], v + base, kb + TC_COLS, T);
        }
        cp_commit();
        cp_wait<1>();
        __syncthreads();
        float s[NT][4], dp[NT][4];
        tc_scores(s, qa, ks[buf]);   // (16, 64) q·k
        tc_scores(dp, da, vs[buf]);  // (16, 64) dO·v
        const bool full = kb + TC_COLS - 1 <= r0;
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int h = e >> 1;
                const int row = r0 + g + 8 * h, key = kb + n * 8 + 2 * t + (e & 1);
                const float p = (full || key <= row) ? exp2f(s[n][e] * qscale - L[h]) : 0.f;
                const float mk =
                    (drop.key.threshold != 0 && p != 0.f) ? attn_mask(drop, hb, T, row, key) : 1.f;
                s[n][e] = p * (dp[n][e] * mk - Dv[h]);  // dS
            }
        tc_accum(acc, s, ks[buf]);  // (16, D) += dS k
        __syncthreads();
    }
    tc_store(dq + base, acc, r0, T, scale, scale);
}

// dk = scale · dSᵀ q, dv = Pᵀ dO; 64 keys per block, query tiles from them to T.
extern "C" __global__ void __launch_bounds__(128)
    flash_tc_dkdv(const elem* q, const elem* k, const elem* v, const elem* dout,
                  const float* lse2, const float* dvec, elem* dk, elem* dv, int T, float qscale,
                  float scale, AttnDrop drop) {
    __shared__ __align__(16) elem qs[2][TC_COLS][TC_LD];
    __shared__ __align__(16) elem dos[2][TC_COLS][TC_LD];
    __shared__ __align__(16) float ls[2][TC_COLS], dls[2][TC_COLS];
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const long base = (long)blockIdx.y * T * D;
    const int k0 = blockIdx.x * TC_ROWS;  // block 0 has the most query tiles and starts first
    const int r0 = k0 + (threadIdx.x >> 5) * 16;
    const float* lrow = lse2 + (long)blockIdx.y * T;
    const float* drow = dvec + (long)blockIdx.y * T;
    // Query tile qb into buffer b: q and dO rows, and their lse2 and dvec entries.
    auto stage = [&](int b, int qb) {
        tc_stage_async(qs[b], q + base, qb, T);
        tc_stage_async(dos[b], dout + base, qb, T);
        const int i = threadIdx.x & (TC_COLS - 1);
        const bool ok = qb + i < T;
        if (threadIdx.x < TC_COLS) cp_async4(&ls[b][i], ok ? lrow + qb + i : lrow, ok);
        else if (threadIdx.x < 2 * TC_COLS) cp_async4(&dls[b][i], ok ? drow + qb + i : drow, ok);
    };
    stage(0, k0);
    cp_commit();
    u32 ka[KD][4], va[KD][4];
    tc_load_a(ka, k + base, r0, T);
    tc_load_a(va, v + base, r0, T);
    float dka[ND][4], dva[ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dka[n][e] = dva[n][e] = 0.f;
    const unsigned long long hb = attn_base(drop, T);
    int buf = 0;
    for (int qb = k0; qb < T; qb += TC_COLS, buf ^= 1) {
        if (qb + TC_COLS < T) stage(buf ^ 1, qb + TC_COLS);
        cp_commit();
        cp_wait<1>();
        __syncthreads();
        const float* lsb = ls[buf];
        const float* dlsb = dls[buf];
        float s[NT][4], dp[NT][4];
        tc_scores(s, ka, qs[buf]);    // (16 keys, 64 queries) k·q
        tc_scores(dp, va, dos[buf]);  // (16 keys, 64 queries) v·dO
        // Every query of the tile is at or after every key of the warp, and inside T.
        const bool full = qb >= r0 + 15 && qb + TC_COLS <= T;
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = r0 + g + 8 * (e >> 1), i = n * 8 + 2 * t + (e & 1);
                const int query = qb + i;
                const float p = (full || (query >= key && query < T))
                                    ? exp2f(s[n][e] * qscale - lsb[i])
                                    : 0.f;
                const float mk = (drop.key.threshold != 0 && p != 0.f)
                                     ? attn_mask(drop, hb, T, query, key)
                                     : 1.f;
                s[n][e] = p * mk;                          // (P ∘ M)ᵀ
                dp[n][e] = p * (dp[n][e] * mk - dlsb[i]);  // dSᵀ
            }
        tc_accum(dva, s, dos[buf]);  // (16, D) += Pᵀ dO
        tc_accum(dka, dp, qs[buf]);  // (16, D) += dSᵀ q
        __syncthreads();
    }
    tc_store(dk + base, dka, r0, T, scale, scale);
    tc_store(dv + base, dva, r0, T, 1.f, 1.f);
}
#endif  // tensor-core attention

// ---------------------------------------------------------------------------------------------
// Softmax cross-entropy over rows of logits (N, V), one block per row. The forward keeps only
// lse (N,) in f32; the backward rebuilds softmax from it: dlogits = (softmax - onehot) * g.
// A thread reads VEC logits (16 bytes) per access where rows_vec allows it (GPT-2's padded
// 50304), else one.
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
    if (rows_vec(V, logits)) {
        for (int i = threadIdx.x * VEC; i < V; i += blockDim.x * VEC) {
            float f[VEC], vm = NEG_INF, vs = 0.f;  // the vector's own (max, sum), then merged
            ldv(x, i, f);
#pragma unroll
            for (int k = 0; k < VEC; ++k) vm = fmaxf(vm, f[k]);
            if (vm == NEG_INF) continue;
#pragma unroll
            for (int k = 0; k < VEC; ++k) vs += __expf(f[k] - vm);
            lse_merge(m, s, vm, vs);
        }
    } else {
        for (int i = threadIdx.x; i < V; i += blockDim.x) lse_merge(m, s, ld(x, i), 1.f);
    }
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

// dlogits may be the logits themselves (ce_bwd_in_place): each element is read, then written,
// by the same thread.
__device__ __forceinline__ void ce_bwd_row(const elem* logits, const unsigned int* targets,
                                           const float* lse, const float* g, elem* dlogits,
                                           int V) {
    const long row = blockIdx.x;
    const float L = lse[row], gr = g[row];
    const unsigned int t = targets[row];
    if (rows_vec(V, logits, dlogits)) {
        for (int i = threadIdx.x * VEC; i < V; i += blockDim.x * VEC) {
            float f[VEC];
            ldv(logits, row * V + i, f);
#pragma unroll
            for (int k = 0; k < VEC; ++k)
                f[k] = (__expf(f[k] - L) - (i + k == (int)t ? 1.f : 0.f)) * gr;
            stv(dlogits, row * V + i, f);
        }
        return;
    }
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        float p = __expf(ld(logits, row * V + i) - L);
        st(dlogits, row * V + i, (p - (i == (int)t ? 1.f : 0.f)) * gr);
    }
}

extern "C" __global__ void ce_bwd(const elem* logits, const unsigned int* targets,
                                  const float* lse, const float* g, elem* dlogits, int V) {
    ce_bwd_row(logits, targets, lse, g, dlogits, V);
}

// The logits overwritten by their gradient.
extern "C" __global__ void ce_bwd_in_place(elem* logits, const unsigned int* targets,
                                           const float* lse, const float* g, int V) {
    ce_bwd_row(logits, targets, lse, g, logits, V);
}

// ---------------------------------------------------------------------------------------------
// LayerNorm over rows of x (N, C), one warp per row, statistics in f32:
//   y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(var + eps)   (biased variance)
// The forward keeps mean and rstd (N,); the backward rebuilds xhat = (x - mean) * rstd:
//   dx = rstd * (dy w - mean_c(dy w) - xhat * mean_c(dy w xhat)) [+ res]  (ln_bwd_dx)
//   dw = sum_n dy xhat, db = sum_n dy, per column over a chunk of rows, then f32 atomics (ln_bwd_dwdb)
// Each access moves W adjacent columns: VEC (16 bytes) where rows_vec allows it, else 1.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}
template <int W>
__device__ __forceinline__ void ldw(const elem* p, long i, float* f) {
    if constexpr (W == 1) f[0] = ld(p, i); else ldv(p, i, f);
}
template <int W>
__device__ __forceinline__ void stw(elem* p, long i, const float* f) {
    if constexpr (W == 1) st(p, i, f[0]); else stv(p, i, f);
}

template <int W>
__device__ __forceinline__ void ln_fwd_row(const elem* x, const elem* w, const elem* b, elem* y,
                                           float* mean, float* rstd, long row, int C, float eps,
                                           int lane) {
    const elem* xr = x + row * C;
    float s = 0.f, f[W];
    for (int i = lane * W; i < C; i += 32 * W) {
        ldw<W>(xr, i, f);
#pragma unroll
        for (int k = 0; k < W; ++k) s += f[k];
    }
    const float mu = warp_sum(s) / C;
    float v = 0.f;
    for (int i = lane * W; i < C; i += 32 * W) {  // the row again, from L1
        ldw<W>(xr, i, f);
#pragma unroll
        for (int k = 0; k < W; ++k) v += (f[k] - mu) * (f[k] - mu);
    }
    const float r = rsqrtf(warp_sum(v) / C + eps);
    for (int i = lane * W; i < C; i += 32 * W) {
        float g[W], h[W];
        ldw<W>(xr, i, f);
        ldw<W>(w, i, g);
        ldw<W>(b, i, h);
#pragma unroll
        for (int k = 0; k < W; ++k) f[k] = (f[k] - mu) * r * g[k] + h[k];
        stw<W>(y, row * C + i, f);
    }
    if (lane == 0) {
        mean[row] = mu;
        rstd[row] = r;
    }
}

extern "C" __global__ void ln_fwd(const elem* x, const elem* w, const elem* b, elem* y,
                                  float* mean, float* rstd, int N, int C, float eps) {
    const long row = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= N) return;
    if (rows_vec(C, x, w, b, y)) ln_fwd_row<VEC>(x, w, b, y, mean, rstd, row, C, eps, threadIdx.x % 32);
    else ln_fwd_row<1>(x, w, b, y, mean, rstd, row, C, eps, threadIdx.x % 32);
}

template <int W>
__device__ __forceinline__ void ln_bwd_dx_row(const elem* x, const elem* w, const elem* dy,
                                              const float* mean, const float* rstd, elem* dx,
                                              long row, int C, const elem* res, int add_res,
                                              int lane) {
    const elem* xr = x + row * C;
    const elem* gr = dy + row * C;
    const float mu = mean[row], r = rstd[row];
    float a = 0.f, c = 0.f, f[W], g[W], h[W];
    for (int i = lane * W; i < C; i += 32 * W) {
        ldw<W>(xr, i, f);
        ldw<W>(gr, i, g);
        ldw<W>(w, i, h);
#pragma unroll
        for (int k = 0; k < W; ++k) {
            const float gw = g[k] * h[k];
            a += gw;
            c += gw * (f[k] - mu) * r;
        }
    }
    a = warp_sum(a) / C;
    c = warp_sum(c) / C;
    for (int i = lane * W; i < C; i += 32 * W) {  // the rows again, from L1
        float e[W];
        ldw<W>(xr, i, f);
        ldw<W>(gr, i, g);
        ldw<W>(w, i, h);
        if (add_res) ldw<W>(res, row * C + i, e);
#pragma unroll
        for (int k = 0; k < W; ++k) {
            const float d = r * (g[k] * h[k] - a - (f[k] - mu) * r * c);
            f[k] = add_res ? d + e[k] : d;
        }
        stw<W>(dx, row * C + i, f);
    }
}

// With add_res, dx = res + the above (the residual branch's gradient added in the same pass,
// rounded once); res is not read otherwise.
extern "C" __global__ void ln_bwd_dx(const elem* x, const elem* w, const elem* dy,
                                     const float* mean, const float* rstd, elem* dx, int N,
                                     int C, const elem* res, int add_res) {
    const long row = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= N) return;
    const int lane = threadIdx.x % 32;
    if (rows_vec(C, x, w, dy, dx, res))
        ln_bwd_dx_row<VEC>(x, w, dy, mean, rstd, dx, row, C, res, add_res, lane);
    else
        ln_bwd_dx_row<1>(x, w, dy, mean, rstd, dx, row, C, res, add_res, lane);
}

// dw, db (C,) f32 start at 0. A block of LN_WARPS warps takes LN_ROWS rows and 32·W columns
// at a time (grid-stride over column chunks): lane l sums columns l·W .. l·W + W over the rows
// its warp takes (every LN_WARPS-th), the warps' sums meet in shared memory, and one atomic
// add per column and block goes to dw and db.
#define LN_ROWS 64
#define LN_WARPS 8
template <int W>
__device__ __forceinline__ void ln_dwdb_cols(const elem* x, const elem* dy, const float* mean,
                                             const float* rstd, float* dw, float* db, int N,
                                             int C, float (*red)[LN_WARPS][32 * VEC]) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const long r0 = (long)blockIdx.y * LN_ROWS;
    const long r1 = min((long)N, r0 + LN_ROWS);
    for (int c0 = blockIdx.x * 32 * W; c0 < C; c0 += gridDim.x * 32 * W) {
        const int col = c0 + lane * W;
        float sw[W], sb[W], f[W], g[W];
#pragma unroll
        for (int k = 0; k < W; ++k) sw[k] = sb[k] = 0.f;
        if (col < C)
            for (long r = r0 + warp; r < r1; r += LN_WARPS) {
                ldw<W>(x, r * C + col, f);
                ldw<W>(dy, r * C + col, g);
                const float mu = mean[r], rs = rstd[r];
#pragma unroll
                for (int k = 0; k < W; ++k) {
                    sw[k] += g[k] * (f[k] - mu) * rs;
                    sb[k] += g[k];
                }
            }
#pragma unroll
        for (int k = 0; k < W; ++k) {
            red[0][warp][lane * W + k] = sw[k];
            red[1][warp][lane * W + k] = sb[k];
        }
        __syncthreads();
        for (int j = threadIdx.x; j < 32 * W; j += blockDim.x)
            if (c0 + j < C) {
                float tw = 0.f, tb = 0.f;
#pragma unroll
                for (int v = 0; v < LN_WARPS; ++v) {
                    tw += red[0][v][j];
                    tb += red[1][v][j];
                }
                atomicAdd(dw + c0 + j, tw);
                atomicAdd(db + c0 + j, tb);
            }
        __syncthreads();
    }
}

extern "C" __global__ void ln_bwd_dwdb(const elem* x, const elem* dy, const float* mean,
                                       const float* rstd, float* dw, float* db, int N, int C) {
    __shared__ float red[2][LN_WARPS][32 * VEC];
    if (rows_vec(C, x, dy)) ln_dwdb_cols<VEC>(x, dy, mean, rstd, dw, db, N, C, red);
    else ln_dwdb_cols<1>(x, dy, mean, rstd, dw, db, N, C, red);
}

// ---------------------------------------------------------------------------------------------
// GELU, tanh approximation (as candle's `gelu` and GPT-2):
//   y = x/2 (1 + tanh u),  u = sqrt(2/pi) (x + 0.044715 x^3)
//   dy/dx = (1 + tanh u)/2 + x/2 (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
// ---------------------------------------------------------------------------------------------
#define GELU_K 0.7978845608028654f
#define GELU_A 0.044715f

__device__ __forceinline__ float gelu_f(float v) {
    const float th = tanhf(GELU_K * (v + GELU_A * v * v * v));
    return 0.5f * v * (1.f + th);
}
__device__ __forceinline__ float gelu_d(float v) {
    const float th = tanhf(GELU_K * (v + GELU_A * v * v * v));
    return 0.5f * (1.f + th) + 0.5f * v * (1.f - th * th) * GELU_K * (1.f + 3.f * GELU_A * v * v);
}

// Both: VEC elements per access while the pointers allow it, then one at a time for the tail.
extern "C" __global__ void gelu_fwd(const elem* x, elem* y, long n) {
    const long t0 = (long)blockIdx.x * blockDim.x + threadIdx.x, step = (long)gridDim.x * blockDim.x;
    long done = 0;
    if (aligned16(x) && aligned16(y)) {
        const long nv = n / VEC;
        for (long j = t0; j < nv; j += step) {
            float f[VEC];
            ldv(x, j * VEC, f);
#pragma unroll
            for (int k = 0; k < VEC; ++k) f[k] = gelu_f(f[k]);
            stv(y, j * VEC, f);
        }
        done = nv * VEC;
    }
    for (long i = done + t0; i < n; i += step) st(y, i, gelu_f(ld(x, i)));
}

extern "C" __global__ void gelu_bwd(const elem* x, const elem* dy, elem* dx, long n) {
    const long t0 = (long)blockIdx.x * blockDim.x + threadIdx.x, step = (long)gridDim.x * blockDim.x;
    long done = 0;
    if (aligned16(x) && aligned16(dy) && aligned16(dx)) {
        const long nv = n / VEC;
        for (long j = t0; j < nv; j += step) {
            float f[VEC], g[VEC];
            ldv(x, j * VEC, f);
            ldv(dy, j * VEC, g);
#pragma unroll
            for (int k = 0; k < VEC; ++k) f[k] = g[k] * gelu_d(f[k]);
            stv(dx, j * VEC, f);
        }
        done = nv * VEC;
    }
    for (long i = done + t0; i < n; i += step) st(dx, i, ld(dy, i) * gelu_d(ld(x, i)));
}

// ---------------------------------------------------------------------------------------------
// Head layout: (B, T, S, H, Dh) <-> (S, B, H, T, Dh), a pure permutation of elements (no
// arithmetic, so elements are moved as raw bits). S = 3 splits c_attn's output into q, k, v
// heads in one pass; S = 1 merges the attention output (B, H, T, D) back into (B, T, H·D).
// (Dh, not D: the attention modules #define D as HEAD_DIM.)
//
// A row of Dh elements is contiguous on both sides, so the copy moves rows of Dv units, a unit
// being a 16-, 8-, 4- or 2-byte word (the caller picks the widest that divides the row and the
// offset; a bf16 row of 64 is Dv = 8 units of 16 bytes). blockIdx.x names one (s, b, h)
// plane, whose T·Dv units are contiguous in the split layout and sit at a stride of S·H·Dv
// units per t in the merged layout:
//
//   split  (S, B, H, T, Dv):  plane p = (s, b, h)  [ t0: v0..v(Dv-1) | t1: ... | ... ]
//   merged (B, T, S, H, Dv):  t0: [.. (s, h) row ..]   t1: [.. (s, h) row ..]   ...
//                                   ^ base + t·S·H·Dv
//
// Consecutive threads take consecutive units j of the plane (t = j / Dv, v = j % Dv): the split
// side is one coalesced run, the merged side runs of Dv units (a 128-byte line for bf16,
// Dh = 64). The plane's coordinates are decoded once per block; per unit there is one 32-bit
// division and no 64-bit one. blockIdx.y with a grid-stride loop covers the T·Dv units.
// ---------------------------------------------------------------------------------------------
template <typename Unit, bool to_split>
__device__ __forceinline__ void heads_copy(const Unit* __restrict__ src, Unit* __restrict__ dst,
                                           int B, int T, int S, int H, int Dv) {
    const int p = blockIdx.x;  // plane (s, b, h) of the split layout
    const int h = p % H;
    const int b = (p / H) % B;
    const int s = p / (H * B);
    const long split_base = (long)p * T * Dv;                        // (s, b, h, 0, 0)
    const long merged_base = (((long)b * T * S + s) * H + h) * Dv;   // (b, 0, s, h, 0)
    const long merged_t = (long)S * H * Dv;                          // stride of t, merged
    const int n = T * Dv;
    for (int j = blockIdx.y * blockDim.x + threadIdx.x; j < n; j += gridDim.y * blockDim.x) {
        const int t = j / Dv;
        const int v = j - t * Dv;
        const long m = merged_base + t * merged_t + v;
        if (to_split) {
            dst[split_base + j] = src[m];
        } else {
            dst[m] = src[split_base + j];
        }
    }
}

#define HEADS_KERNELS(UNIT, BYTES)                                                             \
    extern "C" __global__ void heads_split_u##BYTES(const UNIT* src, UNIT* dst, int B, int T, \
                                                    int S, int H, int Dv) {                    \
        heads_copy<UNIT, true>(src, dst, B, T, S, H, Dv);                                      \
    }                                                                                          \
    extern "C" __global__ void heads_merge_u##BYTES(const UNIT* src, UNIT* dst, int B, int T, \
                                                    int S, int H, int Dv) {                    \
        heads_copy<UNIT, false>(src, dst, B, T, S, H, Dv);                                     \
    }
HEADS_KERNELS(uint4, 16)
HEADS_KERNELS(uint2, 8)
HEADS_KERNELS(unsigned int, 4)
HEADS_KERNELS(unsigned short, 2)

// ---------------------------------------------------------------------------------------------
// Bias add y = x + b over rows of C, and its bias gradient db = Σ_rows dy, f32 partial sums
// added atomically into db (C,), which starts at 0. The gradient's block is ln_bwd_dwdb's:
// LN_WARPS warps take BIAS_ROWS rows and 32·W columns at a time, lane l summing columns
// l·W .. l·W + W over its warp's rows (every LN_WARPS-th), so a warp reads 32·W adjacent
// elements of a row per access (W = VEC, 16 bytes a lane, where rows_vec allows it).
// ---------------------------------------------------------------------------------------------
// VEC elements per access where rows_vec allows it, else one at a time.
extern "C" __global__ void bias_add_fwd(const elem* x, const elem* b, elem* y, long n, int C) {
    const long t0 = (long)blockIdx.x * blockDim.x + threadIdx.x, step = (long)gridDim.x * blockDim.x;
    if (rows_vec(C, x, b, y)) {
        const int cv = C / VEC;
        for (long j = t0; j < n / VEC; j += step) {
            float f[VEC], fb[VEC];
            ldv(x, j * VEC, f);
            ldv(b, (long)(j % cv) * VEC, fb);
#pragma unroll
            for (int k = 0; k < VEC; ++k) f[k] += fb[k];
            stv(y, j * VEC, f);
        }
        return;
    }
    for (long i = t0; i < n; i += step) st(y, i, ld(x, i) + ld(b, i % C));
}

// y = r + (x + b) over rows of C: a residual add with the bias of the layer that made x.
extern "C" __global__ void bias_residual_fwd(const elem* r, const elem* x, const elem* b, elem* y,
                                             long n, int C) {
    const long t0 = (long)blockIdx.x * blockDim.x + threadIdx.x, step = (long)gridDim.x * blockDim.x;
    if (rows_vec(C, r, x, b, y)) {
        const int cv = C / VEC;
        for (long j = t0; j < n / VEC; j += step) {
            float f[VEC], fr[VEC], fb[VEC];
            ldv(x, j * VEC, f);
            ldv(r, j * VEC, fr);
            ldv(b, (long)(j % cv) * VEC, fb);
#pragma unroll
            for (int k = 0; k < VEC; ++k) f[k] = fr[k] + (f[k] + fb[k]);
            stv(y, j * VEC, f);
        }
        return;
    }
    for (long i = t0; i < n; i += step) st(y, i, ld(r, i) + (ld(x, i) + ld(b, i % C)));
}

#define BIAS_ROWS 64
template <int W>
__device__ __forceinline__ void bias_grad_cols(const elem* dy, float* db, int N, int C,
                                               float (*red)[32 * VEC]) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const long r0 = (long)blockIdx.y * BIAS_ROWS;
    const long r1 = min((long)N, r0 + BIAS_ROWS);
    for (int c0 = blockIdx.x * 32 * W; c0 < C; c0 += gridDim.x * 32 * W) {
        const int col = c0 + lane * W;
        float s[W], g[W];
#pragma unroll
        for (int k = 0; k < W; ++k) s[k] = 0.f;
        if (col < C)
            for (long r = r0 + warp; r < r1; r += LN_WARPS) {
                ldw<W>(dy, r * C + col, g);
#pragma unroll
                for (int k = 0; k < W; ++k) s[k] += g[k];
            }
#pragma unroll
        for (int k = 0; k < W; ++k) red[warp][lane * W + k] = s[k];
        __syncthreads();
        for (int j = threadIdx.x; j < 32 * W; j += blockDim.x)
            if (c0 + j < C) {
                float t = 0.f;
#pragma unroll
                for (int v = 0; v < LN_WARPS; ++v) t += red[v][j];
                atomicAdd(db + c0 + j, t);
            }
        __syncthreads();
    }
}

extern "C" __global__ void bias_grad(const elem* dy, float* db, int N, int C) {
    __shared__ float red[LN_WARPS][32 * VEC];
    if (rows_vec(C, dy)) bias_grad_cols<VEC>(dy, db, N, C, red);
    else bias_grad_cols<1>(dy, db, N, C, red);
}
