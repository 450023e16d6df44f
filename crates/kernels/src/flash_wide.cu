// ---------------------------------------------------------------------------------------------
// Causal flash attention on tensor cores with wide warps: bf16, f32 accumulation, HEAD_DIM
// 16..128. The same algorithm as flash_tc_* in kernels.cu (the readable path and the fallback,
// also the one that takes dropout); what differs is how much work a warp does per operand it
// reads from shared memory.
//
// In flash_tc_* a warp owns 16 rows and reads a 16x8 B fragment for every mma it issues: one
// byte of shared memory per 16 FLOP. Here a warp owns WM m-tiles (WM x 16 rows: 32 for D <= 64,
// 16 for D = 128, where the accumulators would not fit twice), and each B fragment read by
// ldmatrix feeds WM mma (one per m-tile): 32 FLOP per byte at D <= 64. A block is 4 warps, so
// 64·WM rows (128 at D <= 64):
//
//          keys (staged tiles of 64, double-buffered by cp.async) ──>
//          ┌────────┬────────┬────────┐
//  warp 0  │ m-tile 0 (16 rows) ──┐   │   every ldmatrix of a K (or V) fragment
//  32 rows │ m-tile 1 (16 rows) ──┤   │   is used by both m-tiles of the warp:
//          ├────────┼─────────────┼───┤   s[m][n] += A[m] · B[n] for m = 0, 1
//  warp 1  │        │        │  ··· │ │
//          ├────────┼────────┼──────┴─┤
//  warp 2  │        │        │        │   tiles right of a warp's last row are skipped
//          ├────────┼────────┼────────┤   by that warp (it still meets the barriers)
//  warp 3  │        │        │        │
//          └────────┴────────┴────────┘
//           block = 128 query rows (D <= 64), the longest rows' block first
//
// Forward (flash_wide_fwd): per key tile of 64, S (16·WM x 64) = Q Kᵀ with Q in registers; the
// online softmax keeps the running maximum m in the log2 domain (m = max(s)·qscale,
// qscale = scale·log2 e) so that p = 2^(s·qscale − m) is one FFMA and one ex2 per score; then
// O += P V with P straight from the accumulators, as in kernels.cu.
//
// Backward, the FA2 split with no atomics (each block writes only its own rows):
// - flash_wide_dq: 16·WM queries per warp, Q and dO in registers; each staged K/V tile is
//   walked in chunks of 16 keys, so S and dP of a chunk are 2 x WM C tiles each:
//   dS = P ∘ (dO vᵀ − δ), dQ += dS K.
// - flash_wide_dkdv: 16·WM keys per warp, K and V in registers; each staged Q/dO tile (with
//   its lse2 and δ) in chunks of 16 queries: Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, dV += Pᵀ dO, dK += dSᵀ Q.
// The chunk of 16 keeps S, dP and the two accumulators of D columns in registers at once.
//
// The fragment layouts (mma.sync m16n8k16, ldmatrix) are those written out above flash_tc_fwd
// in kernels.cu; the helpers here carry their own names (wd_*) because kernels.cu defines its
// for HEAD_DIM <= 64 only.
// ---------------------------------------------------------------------------------------------
#if defined(HEAD_DIM) && ELEM_BF16 && (HEAD_DIM % 16 == 0) && (HEAD_DIM <= 128) && \
    (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800)
#if HEAD_DIM <= 64
#define WD_WM 2  // m-tiles (16 rows) per warp
#else
#define WD_WM 1
#endif
#define WD_ROWS (64 * WD_WM)  // rows owned per block (4 warps)
#ifndef WD_MIN_BLOCKS
#define WD_MIN_BLOCKS 2       // blocks per SM the register budget is fitted to
#endif
#define WD_TILE 64            // rows of a staged tile
#define WD_LD (HEAD_DIM + 8)  // padded shared-memory row, in elements (conflict-free ldmatrix)
#define WD_KD (HEAD_DIM / 16) // k-steps over the head size
#define WD_ND (HEAD_DIM / 8)  // 16x8 C tiles across the head size

typedef unsigned int wd_u32;

__device__ __forceinline__ void wd_mma(float* c, const wd_u32* a, wd_u32 b0, wd_u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (lo, hi) as bf16x2 rounded to nearest even; lo in the low half.
__device__ __forceinline__ wd_u32 wd_pack(float lo, float hi) {
    wd_u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 2^x on the special-function unit (x = −inf gives 0).
__device__ __forceinline__ float wd_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ wd_u32 wd_saddr(const void* p) {
    wd_u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void wd_cp16(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(wd_saddr(dst)),
                 "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void wd_cp4(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(wd_saddr(dst)),
                 "l"(src), "r"(ok ? 4 : 0));
}
__device__ __forceinline__ void wd_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void wd_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void wd_ldsm_x4(wd_u32* r, const elem* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(wd_saddr(p)));
}
__device__ __forceinline__ void wd_ldsm_x2(wd_u32* r, const elem* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(wd_saddr(p)));
}
__device__ __forceinline__ void wd_ldsm_x4_t(wd_u32* r, const elem* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(wd_saddr(p)));
}

__device__ __forceinline__ float wd_quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float wd_quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Rows r0 .. r0+64 of a (T, D) matrix into a staged tile through cp.async, 16 bytes a copy
// (128 threads); rows past T are 0.
__device__ __forceinline__ void wd_stage(elem (*dst)[WD_LD], const elem* src, int r0, int T) {
    const int per_row = HEAD_DIM / 8;
#pragma unroll
    for (int i = threadIdx.x; i < WD_TILE * per_row; i += 128) {
        const int r = i / per_row, c = (i % per_row) * 8;
        const bool ok = r0 + r < T;
        wd_cp16(&dst[r][c], ok ? src + (long)(r0 + r) * HEAD_DIM + c : src, ok);
    }
}

// A fragments of the warp's rows r0 .. r0+16·WM of a (T, D) matrix; rows past T are 0.
__device__ __forceinline__ void wd_load_a(wd_u32 (*a)[WD_KD][4], const elem* src, int r0, int T) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int m = 0; m < WD_WM; ++m) {
        const int r = r0 + 16 * m + g;
        const bool v0 = r < T, v1 = r + 8 < T;
        const wd_u32* lo = reinterpret_cast<const wd_u32*>(src + (long)r * HEAD_DIM);
        const wd_u32* hi = reinterpret_cast<const wd_u32*>(src + (long)(r + 8) * HEAD_DIM);
#pragma unroll
        for (int kk = 0; kk < WD_KD; ++kk) {
            const int w = kk * 8 + t;
            a[m][kk][0] = v0 ? lo[w] : 0u;
            a[m][kk][1] = v1 ? hi[w] : 0u;
            a[m][kk][2] = v0 ? lo[w + 4] : 0u;
            a[m][kk][3] = v1 ? hi[w + 4] : 0u;
        }
    }
}

// s[m] (16 x 8·NC) = X[m] Yᵀ for each m-tile: X in A fragments, Y rows 0 .. 8·NC of a staged
// tile (y points at the first); each B fragment read serves all WM m-tiles.
template <int NC>
__device__ __forceinline__ void wd_scores(float (*s)[NC][4], const wd_u32 (*a)[WD_KD][4],
                                          const elem (*y)[WD_LD]) {
    const int l = threadIdx.x & 31, mi = l >> 3, r = l & 7;
#pragma unroll
    for (int n = 0; n < NC; ++n) {
#pragma unroll
        for (int m = 0; m < WD_WM; ++m) s[m][n][0] = s[m][n][1] = s[m][n][2] = s[m][n][3] = 0.f;
        const elem* row = y[n * 8 + r];
#if WD_KD == 1
        wd_u32 b[2];
        wd_ldsm_x2(b, row + (mi & 1) * 8);
#pragma unroll
        for (int m = 0; m < WD_WM; ++m) wd_mma(s[m][n], a[m][0], b[0], b[1]);
#else
#pragma unroll
        for (int kk = 0; kk < WD_KD; kk += 2) {
            wd_u32 b[4];
            wd_ldsm_x4(b, row + (kk + (mi >> 1)) * 16 + (mi & 1) * 8);
#pragma unroll
            for (int m = 0; m < WD_WM; ++m) {
                wd_mma(s[m][n], a[m][kk], b[0], b[1]);
                wd_mma(s[m][n], a[m][kk + 1], b[2], b[3]);
            }
        }
#endif
    }
}

// acc[m] (16 x D) += P[m] Y for each m-tile: P (16 x 8·NC) in C tiles, Y rows 0 .. 8·NC of a
// staged tile; each B fragment read (ldmatrix.trans) serves all WM m-tiles.
template <int NC>
__device__ __forceinline__ void wd_accum(float (*acc)[WD_ND][4], const float (*p)[NC][4],
                                         const elem (*y)[WD_LD]) {
    const int l = threadIdx.x & 31, mi = l >> 3, r = l & 7;
#pragma unroll
    for (int kk = 0; kk < NC / 2; ++kk) {
        wd_u32 a[WD_WM][4];
#pragma unroll
        for (int m = 0; m < WD_WM; ++m) {
            a[m][0] = wd_pack(p[m][2 * kk][0], p[m][2 * kk][1]);
            a[m][1] = wd_pack(p[m][2 * kk][2], p[m][2 * kk][3]);
            a[m][2] = wd_pack(p[m][2 * kk + 1][0], p[m][2 * kk + 1][1]);
            a[m][3] = wd_pack(p[m][2 * kk + 1][2], p[m][2 * kk + 1][3]);
        }
        const elem* row = y[kk * 16 + (mi & 1) * 8 + r];
#pragma unroll
        for (int n = 0; n < WD_ND; n += 2) {
            wd_u32 b[4];
            wd_ldsm_x4_t(b, row + (n + (mi >> 1)) * 8);
#pragma unroll
            for (int m = 0; m < WD_WM; ++m) {
                wd_mma(acc[m][n], a[m], b[0], b[1]);
                wd_mma(acc[m][n + 1], a[m], b[2], b[3]);
            }
        }
    }
}

// Rows of m-tile accumulators (16·WM x D), row h of m-tile m times mul[m][h], into a (T, D)
// matrix from row r0; rows past T are not written.
__device__ __forceinline__ void wd_store(elem* dst, const float (*acc)[WD_ND][4], int r0, int T,
                                         const float (*mul)[2]) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int m = 0; m < WD_WM; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = r0 + 16 * m + g + 8 * h;
            if (row >= T) continue;
            wd_u32* out = reinterpret_cast<wd_u32*>(dst + (long)row * HEAD_DIM);
#pragma unroll
            for (int n = 0; n < WD_ND; ++n)
                out[n * 4 + t] = wd_pack(acc[m][n][2 * h] * mul[m][h], acc[m][n][2 * h + 1] * mul[m][h]);
        }
}

__device__ __forceinline__ void wd_zero(float (*acc)[WD_ND][4]) {
#pragma unroll
    for (int m = 0; m < WD_WM; ++m)
#pragma unroll
        for (int n = 0; n < WD_ND; ++n) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.f;
}

// o = softmax(mask(q kᵀ scale)) v and lse2 per row; q, k, v, o: (BH, T, D), lse2: (BH, T).
// Grid (ceil(T / WD_ROWS), BH), 128 threads.
extern "C" __global__ void __launch_bounds__(128, WD_MIN_BLOCKS)
    flash_wide_fwd(const elem* q, const elem* k, const elem* v, elem* o, float* lse2, int T,
                   float qscale) {
    __shared__ __align__(16) elem ks[2][WD_TILE][WD_LD];
    __shared__ __align__(16) elem vs[2][WD_TILE][WD_LD];
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const long base = (long)blockIdx.y * T * HEAD_DIM;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * WD_ROWS;  // the longest rows start first
    const int r0 = q0 + (threadIdx.x >> 5) * 16 * WD_WM;   // the warp's first row
    const int wlast = r0 + 16 * WD_WM - 1;                  // and its last
    const int tiles = min(q0 + WD_ROWS, T) / WD_TILE + (min(q0 + WD_ROWS, T) % WD_TILE != 0);
    wd_stage(ks[0], k + base, 0, T);
    wd_stage(vs[0], v + base, 0, T);
    wd_commit();
    wd_u32 qa[WD_WM][WD_KD][4];
    wd_load_a(qa, q + base, r0, T);
    float acc[WD_WM][WD_ND][4];
    wd_zero(acc);
    float mrow[WD_WM][2], lrow[WD_WM][2];  // running max (·qscale, log2 domain) and Σ p
#pragma unroll
    for (int m = 0; m < WD_WM; ++m) mrow[m][0] = mrow[m][1] = NEG_INF, lrow[m][0] = lrow[m][1] = 0.f;
    for (int it = 0, buf = 0; it < tiles; ++it, buf ^= 1) {
        const int kb = it * WD_TILE;
        if (it + 1 < tiles) {  // fetch the next tile while this one is used
            wd_stage(ks[buf ^ 1], k + base, kb + WD_TILE, T);
            wd_stage(vs[buf ^ 1], v + base, kb + WD_TILE, T);
        }
        wd_commit();
        wd_wait<1>();
        __syncthreads();
        // A tile the warp computes starts at or before its first row (kb and r0 are multiples
        // of 64 and 16·WM), so every row sees key kb and its maximum is finite.
        if (kb <= wlast && r0 < T) {
            float s[WD_WM][8][4];
            wd_scores<8>(s, qa, ks[buf]);  // (16·WM, 64) raw q·k
#pragma unroll
            for (int m = 0; m < WD_WM; ++m) {
                const int rb = r0 + 16 * m;
                const bool full = kb + WD_TILE - 1 <= rb;  // no key after any row of the m-tile
                float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
                for (int n = 0; n < 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row = rb + g + 8 * (e >> 1), key = kb + n * 8 + 2 * t + (e & 1);
                        if (!full && key > row) s[m][n][e] = NEG_INF;
                        mx[e >> 1] = fmaxf(mx[e >> 1], s[m][n][e]);
                    }
                float corr[2], neg[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float mnew = fmaxf(mrow[m][h], wd_quad_max(mx[h]) * qscale);
                    corr[h] = wd_exp2(mrow[m][h] - mnew);
                    lrow[m][h] *= corr[h];
                    mrow[m][h] = mnew;
                    neg[h] = -mnew;
                }
#pragma unroll
                for (int n = 0; n < 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        s[m][n][e] = wd_exp2(fmaf(s[m][n][e], qscale, neg[e >> 1]));
                        lrow[m][e >> 1] += s[m][n][e];  // this lane's share; quad sum at the end
                    }
#pragma unroll
                for (int n = 0; n < WD_ND; ++n) {
                    acc[m][n][0] *= corr[0];
                    acc[m][n][1] *= corr[0];
                    acc[m][n][2] *= corr[1];
                    acc[m][n][3] *= corr[1];
                }
            }
            wd_accum<8>(acc, s, vs[buf]);  // (16·WM, D) += P V
        }
        __syncthreads();  // every warp is done with buf before it is refilled
    }
    float inv[WD_WM][2];
#pragma unroll
    for (int m = 0; m < WD_WM; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            lrow[m][h] = wd_quad_sum(lrow[m][h]);
            inv[m][h] = 1.f / lrow[m][h];
            const int row = r0 + 16 * m + g + 8 * h;
            if (t == 0 && row < T) lse2[(long)blockIdx.y * T + row] = mrow[m][h] + log2f(lrow[m][h]);
        }
    wd_store(o + base, acc, r0, T, inv);
}

// dq = scale · dS k with dS = P ∘ (dO vᵀ − dvec); WD_ROWS queries per block, key tiles up to
// them, each walked in chunks of 16 keys. Grid (ceil(T / WD_ROWS), BH), 128 threads.
extern "C" __global__ void __launch_bounds__(128, WD_MIN_BLOCKS)
    flash_wide_dq(const elem* q, const elem* k, const elem* v, const elem* dout,
                  const float* lse2, const float* dvec, elem* dq, int T, float qscale,
                  float scale) {
    __shared__ __align__(16) elem ks[2][WD_TILE][WD_LD];
    __shared__ __align__(16) elem vs[2][WD_TILE][WD_LD];
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const long base = (long)blockIdx.y * T * HEAD_DIM;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * WD_ROWS;
    const int r0 = q0 + (threadIdx.x >> 5) * 16 * WD_WM;
    const int wlast = r0 + 16 * WD_WM - 1;
    const int tiles = min(q0 + WD_ROWS, T) / WD_TILE + (min(q0 + WD_ROWS, T) % WD_TILE != 0);
    wd_stage(ks[0], k + base, 0, T);
    wd_stage(vs[0], v + base, 0, T);
    wd_commit();
    wd_u32 qa[WD_WM][WD_KD][4], da[WD_WM][WD_KD][4];
    wd_load_a(qa, q + base, r0, T);
    wd_load_a(da, dout + base, r0, T);
    float L[WD_WM][2], Dv[WD_WM][2];
#pragma unroll
    for (int m = 0; m < WD_WM; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = r0 + 16 * m + g + 8 * h;
            L[m][h] = row < T ? -lse2[(long)blockIdx.y * T + row] : 0.f;  // negated for the FFMA
            Dv[m][h] = row < T ? dvec[(long)blockIdx.y * T + row] : 0.f;
        }
    float acc[WD_WM][WD_ND][4];
    wd_zero(acc);
    for (int it = 0, buf = 0; it < tiles; ++it, buf ^= 1) {
        const int kb = it * WD_TILE;
        if (it + 1 < tiles) {
            wd_stage(ks[buf ^ 1], k + base, kb + WD_TILE, T);
            wd_stage(vs[buf ^ 1], v + base, kb + WD_TILE, T);
        }
        wd_commit();
        wd_wait<1>();
        __syncthreads();
        if (r0 < T) {
#pragma unroll 1
            for (int c = 0; c < WD_TILE / 16; ++c) {
                const int kc = kb + 16 * c;
                if (kc > wlast) break;  // this chunk and the later ones are after every row
                float s[WD_WM][2][4], dp[WD_WM][2][4];
                wd_scores<2>(s, qa, ks[buf] + 16 * c);   // (16·WM, 16) q·k
                wd_scores<2>(dp, da, vs[buf] + 16 * c);  // (16·WM, 16) dO·v
#pragma unroll
                for (int m = 0; m < WD_WM; ++m)
#pragma unroll
                    for (int n = 0; n < 2; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int h = e >> 1;
                            const int row = r0 + 16 * m + g + 8 * h;
                            const int key = kc + n * 8 + 2 * t + (e & 1);
                            const float p =
                                key <= row ? wd_exp2(fmaf(s[m][n][e], qscale, L[m][h])) : 0.f;
                            s[m][n][e] = p * (dp[m][n][e] - Dv[m][h]);  // dS
                        }
                wd_accum<2>(acc, s, ks[buf] + 16 * c);  // (16·WM, D) += dS k
            }
        }
        __syncthreads();
    }
    const float mul[WD_WM][2] = {{scale, scale}
#if WD_WM == 2
                                 , {scale, scale}
#endif
    };
    wd_store(dq + base, acc, r0, T, mul);
}

// dk = scale · dSᵀ q, dv = Pᵀ dO; WD_ROWS keys per block, query tiles from them to T, each
// walked in chunks of 16 queries. Grid (ceil(T / WD_ROWS), BH), 128 threads.
extern "C" __global__ void __launch_bounds__(128, WD_MIN_BLOCKS)
    flash_wide_dkdv(const elem* q, const elem* k, const elem* v, const elem* dout,
                    const float* lse2, const float* dvec, elem* dk, elem* dv, int T,
                    float qscale, float scale) {
    __shared__ __align__(16) elem qs[2][WD_TILE][WD_LD];
    __shared__ __align__(16) elem dos[2][WD_TILE][WD_LD];
    __shared__ __align__(16) float ls[2][WD_TILE], dls[2][WD_TILE];
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const long base = (long)blockIdx.y * T * HEAD_DIM;
    const int k0 = blockIdx.x * WD_ROWS;  // block 0 has the most query tiles and starts first
    const int r0 = k0 + (threadIdx.x >> 5) * 16 * WD_WM;
    const float* lrow = lse2 + (long)blockIdx.y * T;
    const float* drow = dvec + (long)blockIdx.y * T;
    // Query tile qb into buffer b: q and dO rows, and their lse2 (negated later) and dvec.
    auto stage = [&](int b, int qb) {
        wd_stage(qs[b], q + base, qb, T);
        wd_stage(dos[b], dout + base, qb, T);
        const int i = threadIdx.x & (WD_TILE - 1);
        const bool ok = qb + i < T;
        if (threadIdx.x < WD_TILE) wd_cp4(&ls[b][i], ok ? lrow + qb + i : lrow, ok);
        else wd_cp4(&dls[b][i], ok ? drow + qb + i : drow, ok);
    };
    stage(0, k0);
    wd_commit();
    wd_u32 ka[WD_WM][WD_KD][4], va[WD_WM][WD_KD][4];
    wd_load_a(ka, k + base, r0, T);
    wd_load_a(va, v + base, r0, T);
    float dka[WD_WM][WD_ND][4], dva[WD_WM][WD_ND][4];
    wd_zero(dka);
    wd_zero(dva);
    for (int qb = k0, buf = 0; qb < T; qb += WD_TILE, buf ^= 1) {
        if (qb + WD_TILE < T) stage(buf ^ 1, qb + WD_TILE);
        wd_commit();
        wd_wait<1>();
        __syncthreads();
        if (r0 < T) {
#pragma unroll 1
            for (int c = 0; c < WD_TILE / 16; ++c) {
                const int qc = qb + 16 * c;
                if (qc >= T) break;
                if (qc + 15 < r0) continue;  // every query of the chunk is before every key
                float s[WD_WM][2][4], dp[WD_WM][2][4];
                wd_scores<2>(s, ka, qs[buf] + 16 * c);    // (16·WM keys, 16 queries) k·q
                wd_scores<2>(dp, va, dos[buf] + 16 * c);  // (16·WM keys, 16 queries) v·dO
                float nl[2][2], dl[2][2];  // −lse2 and dvec of this lane's 4 queries
#pragma unroll
                for (int n = 0; n < 2; ++n)
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const int i = 16 * c + n * 8 + 2 * t + j;
                        nl[n][j] = -ls[buf][i];
                        dl[n][j] = dls[buf][i];
                    }
                const bool full = qc >= r0 + 16 * WD_WM - 1 && qc + 16 <= T;
#pragma unroll
                for (int m = 0; m < WD_WM; ++m)
#pragma unroll
                    for (int n = 0; n < 2; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int key = r0 + 16 * m + g + 8 * (e >> 1);
                            const int query = qc + n * 8 + 2 * t + (e & 1);
                            const float p = (full || (query >= key && query < T))
                                                ? wd_exp2(fmaf(s[m][n][e], qscale, nl[n][e & 1]))
                                                : 0.f;
                            s[m][n][e] = p;                                    // Pᵀ
                            dp[m][n][e] = p * (dp[m][n][e] - dl[n][e & 1]);  // dSᵀ
                        }
                wd_accum<2>(dva, s, dos[buf] + 16 * c);  // (16·WM, D) += Pᵀ dO
                wd_accum<2>(dka, dp, qs[buf] + 16 * c);  // (16·WM, D) += dSᵀ q
            }
        }
        __syncthreads();
    }
    const float mk[WD_WM][2] = {{scale, scale}
#if WD_WM == 2
                                , {scale, scale}
#endif
    };
    const float mv[WD_WM][2] = {{1.f, 1.f}
#if WD_WM == 2
                                , {1.f, 1.f}
#endif
    };
    wd_store(dk + base, dka, r0, T, mk);
    wd_store(dv + base, dva, r0, T, mv);
}
#endif  // wide tensor-core attention
