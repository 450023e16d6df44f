// ---------------------------------------------------------------------------------------------
// Causal flash attention on Hopper's warpgroup tensor cores: bf16, f32 accumulation, HEAD_DIM
// 64 or 128, compiled only for sm_90a (NVRTC's compute_90a). The algorithm, the operands and the
// outputs are those of flash_wide_* (flash_wide.cu), which stay the readable path and the
// fallback; what differs is the instruction. A warpgroup (4 warps, 128 threads) issues
// wgmma.mma_async m64nNk16: one instruction multiplies a 64 x 16 A by a 16 x N B, A from
// shared memory or from registers, B from shared memory, read by the tensor cores directly
// (no ldmatrix), with the 64 x N f32 result spread over the warpgroup's registers.
//
//   a block = W warpgroups = 64·W rows (queries in fwd and dq, keys in dkdv)
//   ┌────────────────────┐  warpgroup 0: rows 0..63     each wgmma: 64 rows x N columns
//   │ 64 rows ─ wgmma    │                               (N = HP_FWD_N keys in fwd, 64 in bwd)
//   ├────────────────────┤  warpgroup 1: rows 64..127
//   │ 64 rows ─ wgmma    │  ...
//   └────────────────────┘
//   the other operand's tiles staged by cp.async, double-buffered, shared by the warpgroups
//
// Every kernel reads q, k, v and writes dq, dk, dv laid out by its `lin` (HeadRows, kernels.cu)
// and o, dO by `lout`: heads stored apart, or the rows of the linears' outputs read in place
// (attention.rs's token layout); lse2, δ and dq's f32 accumulator are (BH, T) and (BH, T, D).
//
// W, the blocks per SM the registers are fitted to and the forward's keys per staged tile come
// from the compile options (HP_{FWD,DQ,DKDV,BWD}_{WGS,BLOCKS}, HP_FWD_N: attention_path.rs's
// HopperShapes per head size, the one place they are chosen); each kernel checks that its
// launch gave it the shared memory its layout needs.
//
// Shared-memory tiles are (rows, HEAD_DIM) bf16 with the 128-byte swizzle wgmma reads: a row
// is 128 bytes (64 elements), and in each group of 8 rows (1024 bytes, 1024-aligned) the
// 16-byte chunk c of row r sits at chunk c ^ (r % 8), so that the 8 rows of a column chunk
// lie in 8 different banks. At HEAD_DIM 128 a row is two such 128-byte rows: the tile is two
// (rows, 64) halves, one after the other (swizzle atoms along D), so column chunk c of row r
// is chunk c % 8 of row r in half c / 8:
//
//   HEAD_DIM 128, R rows:  [ half 0: columns 0..63, R x 128 B ][ half 1: columns 64..127 ]
//
// One tile layout serves both operand roles through its descriptor:
// - K-major (the reduction runs along HEAD_DIM, the row): Q, K, V, dO as the A or B of
//   Q Kᵀ, dO Vᵀ, K Qᵀ, V dOᵀ; k-step kk starts 32·(kk % 4) bytes into the rows of half
//   kk / 4, 8-row groups 1024 bytes apart (the stride byte offset).
// - MN-major (the reduction runs along the rows): V, K, dO, Q as the B of P V, dS K,
//   Pᵀ dO, dSᵀ Q, with B's transpose bit set; k-step kk (16 rows) starts 2048·kk bytes in,
//   and N = HEAD_DIM 128 spans both halves, R·128 bytes apart (the leading byte offset).
// The A of those products (P, dS and their transposes) is the previous product's
// accumulator, converted to bf16 in registers: the m64nN f32 layout (warp w holds rows
// 16w..16w+15; within the warp the 16x8 C-tile layout of mma.sync per 8 columns, register
// 4j+e at row g + 8·(e / 2), column 8j + 2t + e % 2, g = lane / 4, t = lane % 4) is, two
// 8-column tiles at a time, the A-fragment layout of a 64 x 16 register operand.
//
// wgmma runs asynchronously: a warpgroup issues a batch (wgmma.fence first, since registers
// it reads were written by ordinary instructions), commits it and waits for it before
// reading the results; shared memory written by cp.async is handed to the tensor cores'
// (async) proxy with fence.proxy.async before the barrier that publishes a tile.
// ---------------------------------------------------------------------------------------------
#if defined(HEAD_DIM) && ELEM_BF16 && (HEAD_DIM == 64 || HEAD_DIM == 128) && \
    defined(HP_FWD_WGS) && \
    (defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__))
#define HP_BWD_N 64  // keys (dq) or queries (dkdv) per staged tile in the backward

// The cp.async, bf16-pack, ex2 and quad-reduction helpers are flash_wide.cu's (wd_*), compiled
// into the same module under a guard that covers this one.
typedef unsigned int hp_u32;
typedef unsigned long long hp_u64;

// The first 1024-aligned byte of the dynamic shared memory (the swizzle is a function of the
// address bits, so every tile starts on a 1024-byte boundary); launches ask for 1 KiB extra.
__device__ __forceinline__ char* hp_smem_base() {
    extern __shared__ __align__(16) char hp_smem[];
    const hp_u32 a = wd_saddr(hp_smem);
    return hp_smem + (((a + 1023u) & ~1023u) - a);
}

// Stops the kernel when its launch gave it less dynamic shared memory than `need` bytes.
__device__ __forceinline__ void hp_require_smem(hp_u32 need) {
    hp_u32 have;
    asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(have));
    if (have < need) __trap();
}

__device__ __forceinline__ void hp_cp16(hp_u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(ok ? 16 : 0));
}

// Rows r0 .. r0+R of a (T, D) matrix whose rows are `ld` elements apart into a swizzled tile
// at `dst` by THREADS threads (this one is number `tid` of them); rows past T are 0.
template <int R, int THREADS>
__device__ __forceinline__ void hp_stage(char* dst, const elem* src, int ld, int r0, int T,
                                         int tid) {
    constexpr int chunks = HEAD_DIM / 8;  // 16 bytes each, per row
    const hp_u32 d0 = wd_saddr(dst);
    static_assert(THREADS % chunks == 0, "a thread copies the same chunk of every row it takes");
    // P rows a pass; the trip count is a constant (the loop unrolls without a remainder loop),
    // and only when P does not divide R does the last pass check its row.
    constexpr int P = THREADS / chunks;
    const int c = tid % chunks, r1 = tid / chunks;
    const elem* from = src + (long)(r0 + r1) * ld + c * 8;
    const long step = (long)P * ld;
#pragma unroll
    for (int pass = 0; pass < (R + P - 1) / P; ++pass, from += step) {
        const int r = r1 + pass * P;
        if (R % P != 0 && r >= R) break;
        const bool ok = r0 + r < T;
        const hp_u32 d = d0 + (c / 8) * (R * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
        hp_cp16(d, ok ? from : src, ok);
    }
}

// A wgmma shared-memory descriptor: start address, leading and stride byte offsets, all three
// in 16-byte units, and the 128-byte swizzle (bit 62).
//
//   bits  0..13 start >> 4 | 16..29 leading >> 4 | 32..45 stride >> 4 | 62 swizzle 128 B
//
// A block's shared addresses lie below 2^18 bytes (228 KiB at most), so `start >> 4` fits its
// 14 bits without a mask, and the fields are added rather than masked and or-ed: a k-step's
// descriptor is then the tile's shifted address plus a constant, which the compiler folds into
// one add per product (the masked form cost a mask, a shift, an or and a move per descriptor,
// about a sixth of the backward's instructions).
__device__ __forceinline__ hp_u64 hp_desc16(hp_u32 start16, hp_u32 lbo16, hp_u32 sbo16) {
    return (hp_u64)(start16 + (lbo16 << 16)) | ((hp_u64)(sbo16 | (1u << 30)) << 32);
}
// K-major: k-step kk (16 columns) of a tile of `rows` rows at shared address `tile`.
__device__ __forceinline__ hp_u64 hp_desc_k(hp_u32 tile, int rows, int kk) {
    return hp_desc16((tile >> 4) + (kk / 4) * rows * 8 + (kk % 4) * 2, 1, 64);
}
// MN-major: k-step kk (16 rows) of a tile of `rows` rows at shared address `tile`.
__device__ __forceinline__ hp_u64 hp_desc_mn(hp_u32 tile, int rows, int kk) {
    return hp_desc16((tile >> 4) + kk * 128, rows * 8, 64);
}

__device__ __forceinline__ void hp_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void hp_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void hp_wait() {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
__device__ __forceinline__ void hp_fence_proxy() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving reads of the N accumulators above the wait.
template <int N>
__device__ __forceinline__ void hp_hold(float* d) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}


// The A fragments (bf16) of a 64 x N accumulator, k-step kk = columns 16kk .. 16kk+15.
template <int N>
__device__ __forceinline__ void hp_to_a(hp_u32 (*a)[4], const float* c) {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk)
#pragma unroll
        for (int j = 0; j < 4; ++j) a[kk][j] = wd_pack(c[8 * kk + 2 * j], c[8 * kk + 2 * j + 1]);
}

// Rows of a warpgroup's 64 x D accumulator times mul[h] into a (T, D) matrix whose rows are
// `ld` elements apart; `row` is the thread's first row (its second is row + 8); rows past T
// are not written.
__device__ __forceinline__ void hp_store(elem* dst, int ld, const float* acc, int row, int T,
                                         const float* mul) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row + 8 * h;
        if (r >= T) continue;
        hp_u32* out = reinterpret_cast<hp_u32*>(dst + r * ld);
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 8; ++j)
            out[j * 4 + t] = wd_pack(acc[4 * j + 2 * h] * mul[h], acc[4 * j + 2 * h + 1] * mul[h]);
    }
}

// d (64 x 64, f32) = [d +] A B, A and B in shared memory (K-major descriptors).
__device__ __forceinline__ void hp_ss64(float* d, hp_u64 da, hp_u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(accumulate));
}
// d (64 x 64, f32) = [d +] A B, A and B in shared memory, both MN-major (transposed).
__device__ __forceinline__ void hp_ss64_t(float* d, hp_u64 da, hp_u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(accumulate));
}
// d (64 x 128, f32) = [d +] A B, A and B in shared memory (K-major descriptors).
__device__ __forceinline__ void hp_ss128(float* d, hp_u64 da, hp_u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(accumulate));
}
// d (64 x 64, f32) = [d +] A B, A (64 x 16) in registers, B in shared memory (MN-major).
__device__ __forceinline__ void hp_rs64(float* d, const hp_u32* a, hp_u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}
// d (64 x 128, f32) = [d +] A B, A (64 x 16) in registers, B in shared memory (MN-major).
__device__ __forceinline__ void hp_rs128(float* d, const hp_u32* a, hp_u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}
// d (64 x 128, f32) = [d +] A B, A and B in shared memory, both MN-major (transposed).
__device__ __forceinline__ void hp_ss128_t(float* d, hp_u64 da, hp_u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(accumulate));
}
// The products whose N is the head size (B read MN-major, its columns two 64-column swizzle
// atoms apart at HEAD_DIM 128): A from registers, or A and B both transposed in shared memory.
__device__ __forceinline__ void hp_rs_d(float* d, const hp_u32* a, hp_u64 db, int accumulate) {
    if constexpr (HEAD_DIM == 64) hp_rs64(d, a, db, accumulate);
    else hp_rs128(d, a, db, accumulate);
}
__device__ __forceinline__ void hp_ss_d_t(float* d, hp_u64 da, hp_u64 db, int accumulate) {
    if constexpr (HEAD_DIM == 64) hp_ss64_t(d, da, db, accumulate);
    else hp_ss128_t(d, da, db, accumulate);
}
template <int N>
__device__ __forceinline__ void hp_ss(float* d, hp_u64 da, hp_u64 db, int accumulate) {
    if constexpr (N == 64) hp_ss64(d, da, db, accumulate);
    else hp_ss128(d, da, db, accumulate);
}
#define HP_FWD_ROWS (64 * HP_FWD_WGS)
// One staged tile of HP_FWD_N keys (from kb) for a warpgroup's 64 rows: S = Q Kᵀ (Q at qa, K at
// kt, both K-major), the online softmax on S in registers (log2 domain, as in flash_wide_fwd),
// then O += P V (P from registers, V at vt MN-major). MASK: the tile reaches past some row of the
// warpgroup, so keys after a row are masked out; the tiles wholly before the warpgroup's first
// row skip the compare and select per score (two of the integer pipe's instructions per score,
// the pipe the profile had busiest). acc: the thread's O; mrow, lrow: its two rows' running
// maximum and (lane-partial) sum; row: its first row (the second is row + 8); t: lane % 4.
template <bool MASK>
__device__ __forceinline__ void hp_fwd_tile(float* acc, float* mrow, float* lrow, hp_u32 qa,
                                            hp_u32 kt, hp_u32 vt, int kb, int row, int t,
                                            float qscale) {
    float s[HP_FWD_N / 2];
    hp_fence();
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
        hp_ss<HP_FWD_N>(s, hp_desc_k(qa, HP_FWD_ROWS, kk), hp_desc_k(kt, HP_FWD_N, kk), kk);
    hp_commit();
    hp_wait();
    hp_hold<HP_FWD_N / 2>(s);
    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int i = 0; i < HP_FWD_N / 2; ++i) {
        const int h = (i >> 1) & 1;
        if (MASK && kb + (i >> 2) * 8 + 2 * t + (i & 1) > row + 8 * h) s[i] = NEG_INF;
        mx[h] = fmaxf(mx[h], s[i]);
    }
    float corr[2], neg[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float mnew = fmaxf(mrow[h], wd_quad_max(mx[h]) * qscale);
        corr[h] = wd_exp2(mrow[h] - mnew);
        lrow[h] *= corr[h];
        mrow[h] = mnew;
        neg[h] = -mnew;
    }
#pragma unroll
    for (int i = 0; i < HP_FWD_N / 2; ++i) {
        const int h = (i >> 1) & 1;
        s[i] = wd_exp2(fmaf(s[i], qscale, neg[h]));
        lrow[h] += s[i];  // this lane's share; quad sum at the end
    }
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 2; ++i) acc[i] *= corr[(i >> 1) & 1];
    hp_u32 pa[HP_FWD_N / 16][4];
    hp_to_a<HP_FWD_N>(pa, s);
    hp_fence();
#pragma unroll
    for (int kk = 0; kk < HP_FWD_N / 16; ++kk)
        hp_rs_d(acc, pa[kk], hp_desc_mn(vt, HP_FWD_N, kk), 1);
    hp_commit();
    hp_wait();
    hp_hold<HEAD_DIM / 2>(acc);
}

// o = softmax(mask(q kᵀ scale)) v and lse2 per row, as flash_wide_fwd; q, k, v, o: (BH, T, D),
// q, k, v laid out by `lin` and o by `lout` (HeadRows, kernels.cu), lse2: (BH, T). Per staged
// tile of HP_FWD_N keys each warpgroup computes S (64 x HP_FWD_N) = Q Kᵀ (Q and K from shared
// memory), the online softmax on S in registers (log2 domain, as in
// flash_wide_fwd), then O += P V with P from registers. Grid (ceil(T / HP_FWD_ROWS), BH),
// 128·HP_FWD_WGS threads, HP_FWD_SMEM bytes of shared memory.
#define HP_FWD_SMEM ((HP_FWD_ROWS + 4 * HP_FWD_N) * HEAD_DIM * 2 + 1024)
extern "C" __global__ void __launch_bounds__(128 * HP_FWD_WGS, HP_FWD_BLOCKS)
    flash_hopper_fwd(const elem* q, const elem* k, const elem* v, elem* o, float* lse2, int T,
                     float qscale, HeadRows lin, HeadRows lout) {
    hp_require_smem(HP_FWD_SMEM);
    char* qs = hp_smem_base();                   // (64·WGS, D)
    char* ks = qs + HP_FWD_ROWS * HEAD_DIM * 2;      // 2 x (128, D)
    char* vs = ks + 2 * HP_FWD_N * HEAD_DIM * 2; // 2 x (128, D)
    constexpr int TILE = HP_FWD_N * HEAD_DIM * 2;
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, wi = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    const long bin = head_row(lin, blockIdx.y, 0);
    const int q0 = (gridDim.x - 1 - blockIdx.x) * HP_FWD_ROWS;  // the longest rows start first
    const int rw = q0 + 64 * wg;                             // the warpgroup's first row
    const int row = rw + 16 * wi + g;                        // the thread's rows: row, row + 8
    const int tiles = (min(q0 + HP_FWD_ROWS, T) + HP_FWD_N - 1) / HP_FWD_N;
    hp_stage<HP_FWD_ROWS, 128 * HP_FWD_WGS>(qs, q + bin, lin.row, q0, T, threadIdx.x);
    hp_stage<HP_FWD_N, 128 * HP_FWD_WGS>(ks, k + bin, lin.row, 0, T, threadIdx.x);
    hp_stage<HP_FWD_N, 128 * HP_FWD_WGS>(vs, v + bin, lin.row, 0, T, threadIdx.x);
    wd_commit();
    const hp_u32 qa = wd_saddr(qs) + wg * 64 * 128;
    float acc[HEAD_DIM / 2];
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 2; ++i) acc[i] = 0.f;
    float mrow[2] = {NEG_INF, NEG_INF}, lrow[2] = {0.f, 0.f};
    for (int it = 0; it < tiles; ++it) {
        const int buf = it & 1, kb = it * HP_FWD_N;
        if (it + 1 < tiles) {  // fetch the next tile while this one is used
            hp_stage<HP_FWD_N, 128 * HP_FWD_WGS>(ks + (buf ^ 1) * TILE, k + bin, lin.row, kb + HP_FWD_N, T, threadIdx.x);
            hp_stage<HP_FWD_N, 128 * HP_FWD_WGS>(vs + (buf ^ 1) * TILE, v + bin, lin.row, kb + HP_FWD_N, T, threadIdx.x);
        }
        wd_commit();
        wd_wait<1>();
        hp_fence_proxy();
        __syncthreads();
        const hp_u32 kt = wd_saddr(ks + buf * TILE), vt = wd_saddr(vs + buf * TILE);
        // kb is at or before the warpgroup's first row whenever it computes, so every row
        // sees key kb and its maximum is finite. Only the tiles that reach past the
        // warpgroup's first row (its diagonal) need the causal mask.
        if (kb + HP_FWD_N - 1 <= rw)
            hp_fwd_tile<false>(acc, mrow, lrow, qa, kt, vt, kb, row, t, qscale);
        else if (kb <= rw + 63)
            hp_fwd_tile<true>(acc, mrow, lrow, qa, kt, vt, kb, row, t, qscale);
        __syncthreads();  // both warpgroups are done with buf before it is refilled
    }
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        lrow[h] = wd_quad_sum(lrow[h]);
        inv[h] = 1.f / lrow[h];
        const int r = row + 8 * h;
        if (t == 0 && r < T) lse2[(long)blockIdx.y * T + r] = mrow[h] + log2f(lrow[h]);
    }
    hp_store(o + head_row(lout, blockIdx.y, 0), lout.row, acc, row, T, inv);
}

// The backward's two products of one tile pair, waited for: s = A0 B0ᵀ and dp = A1 B1ᵀ, every
// operand a staged tile read K-major (A0, A1 of `arows` rows, B0, B1 of HP_BWD_N): S and dP
// with queries as rows (flash_hopper_dq), Sᵀ and dPᵀ with keys as rows (hp_bwd_p_ds).
__device__ __forceinline__ void hp_bwd_s_dp(float* s, float* dp, hp_u32 a0, hp_u32 b0, hp_u32 a1,
                                            hp_u32 b1, int arows) {
    hp_fence();
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        hp_ss64(s, hp_desc_k(a0, arows, kk), hp_desc_k(b0, HP_BWD_N, kk), kk);
        hp_ss64(dp, hp_desc_k(a1, arows, kk), hp_desc_k(b1, HP_BWD_N, kk), kk);
    }
    hp_commit();
    hp_wait();
    hp_hold<HP_BWD_N / 2>(s);
    hp_hold<HP_BWD_N / 2>(dp);
}

#define HP_DQ_ROWS (64 * HP_DQ_WGS)
// One key tile of flash_hopper_dq for a warpgroup's 64 queries: S = Q Kᵀ and dP = dO Vᵀ (Q, dO
// at qa, da; K, V at kt, vt), dS = P ∘ (dP − δ) in registers, then dQ += dS K (K read MN-major).
// MASK: the tile has keys after some row of the warpgroup (its diagonal), zeroed there; the
// tiles before it skip the compare and select per score. l2, dl: the thread's two rows' lse2
// and δ; row: its first row; t: lane % 4.
template <bool MASK>
__device__ __forceinline__ void hp_dq_tile(float* acc, hp_u32 qa, hp_u32 da, hp_u32 kt, hp_u32 vt,
                                           int kb, int row, int t, const float* l2,
                                           const float* dl, float qscale) {
    float s[HP_BWD_N / 2], dp[HP_BWD_N / 2];
    hp_bwd_s_dp(s, dp, qa, kt, da, vt, HP_DQ_ROWS);
#pragma unroll
    for (int i = 0; i < HP_BWD_N / 2; ++i) {
        const int h = (i >> 1) & 1;
        float p = wd_exp2(fmaf(s[i], qscale, -l2[h]));
        if (MASK && kb + (i >> 2) * 8 + 2 * t + (i & 1) > row + 8 * h) p = 0.f;
        s[i] = p * (dp[i] - dl[h]);  // dS
    }
    hp_u32 sa[HP_BWD_N / 16][4];
    hp_to_a<HP_BWD_N>(sa, s);
    hp_fence();
#pragma unroll
    for (int kk = 0; kk < HP_BWD_N / 16; ++kk)
        hp_rs_d(acc, sa[kk], hp_desc_mn(kt, HP_BWD_N, kk), 1);
    hp_commit();
    hp_wait();
    hp_hold<HEAD_DIM / 2>(acc);
}

// dq = scale · dS k with dS = P ∘ (dO vᵀ − dvec), as flash_wide_dq; 64·HP_DQ_WGS queries per
// block (Q and dO staged once), key tiles of 64 up to them: S = Q Kᵀ and dP = dO Vᵀ (shared
// memory operands), then dQ += dS K with dS from registers. Grid (ceil(T / HP_DQ_ROWS), BH),
// 128·HP_DQ_WGS threads, HP_DQ_SMEM bytes of shared memory.
#define HP_DQ_SMEM ((2 * HP_DQ_ROWS + 4 * HP_BWD_N) * HEAD_DIM * 2 + 1024)
extern "C" __global__ void __launch_bounds__(128 * HP_DQ_WGS, HP_DQ_BLOCKS)
    flash_hopper_dq(const elem* q, const elem* k, const elem* v, const elem* dout,
                    const float* lse2, const float* dvec, elem* dq, int T, float qscale,
                    float scale, HeadRows lin, HeadRows lout) {
    hp_require_smem(HP_DQ_SMEM);
    char* qs = hp_smem_base();                    // (64·WGS, D)
    char* dos = qs + HP_DQ_ROWS * HEAD_DIM * 2;      // (64·WGS, D)
    char* ks = dos + HP_DQ_ROWS * HEAD_DIM * 2;      // 2 x (64, D)
    char* vs = ks + 2 * HP_BWD_N * HEAD_DIM * 2;  // 2 x (64, D)
    constexpr int TILE = HP_BWD_N * HEAD_DIM * 2;
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, wi = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    const long bin = head_row(lin, blockIdx.y, 0), bout = head_row(lout, blockIdx.y, 0);
    const int q0 = (gridDim.x - 1 - blockIdx.x) * HP_DQ_ROWS;
    const int rw = q0 + 64 * wg;
    const int row = rw + 16 * wi + g;
    const int tiles = (min(q0 + HP_DQ_ROWS, T) + HP_BWD_N - 1) / HP_BWD_N;
    hp_stage<HP_DQ_ROWS, 128 * HP_DQ_WGS>(qs, q + bin, lin.row, q0, T, threadIdx.x);
    hp_stage<HP_DQ_ROWS, 128 * HP_DQ_WGS>(dos, dout + bout, lout.row, q0, T, threadIdx.x);
    hp_stage<HP_BWD_N, 128 * HP_DQ_WGS>(ks, k + bin, lin.row, 0, T, threadIdx.x);
    hp_stage<HP_BWD_N, 128 * HP_DQ_WGS>(vs, v + bin, lin.row, 0, T, threadIdx.x);
    wd_commit();
    float l2[2], dl[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row + 8 * h;
        l2[h] = r < T ? lse2[(long)blockIdx.y * T + r] : 0.f;
        dl[h] = r < T ? dvec[(long)blockIdx.y * T + r] : 0.f;
    }
    const hp_u32 qa = wd_saddr(qs) + wg * 64 * 128, da = wd_saddr(dos) + wg * 64 * 128;
    float acc[HEAD_DIM / 2];
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 2; ++i) acc[i] = 0.f;
    for (int it = 0; it < tiles; ++it) {
        const int buf = it & 1, kb = it * HP_BWD_N;
        if (it + 1 < tiles) {
            hp_stage<HP_BWD_N, 128 * HP_DQ_WGS>(ks + (buf ^ 1) * TILE, k + bin, lin.row, kb + HP_BWD_N, T, threadIdx.x);
            hp_stage<HP_BWD_N, 128 * HP_DQ_WGS>(vs + (buf ^ 1) * TILE, v + bin, lin.row, kb + HP_BWD_N, T, threadIdx.x);
        }
        wd_commit();
        wd_wait<1>();
        hp_fence_proxy();
        __syncthreads();
        const hp_u32 kt = wd_saddr(ks + buf * TILE), vt = wd_saddr(vs + buf * TILE);
        // Keys after a row of the warpgroup only in the tiles that reach past its first row.
        if (kb + HP_BWD_N - 1 <= rw)
            hp_dq_tile<false>(acc, qa, da, kt, vt, kb, row, t, l2, dl, qscale);
        else if (kb <= rw + 63)
            hp_dq_tile<true>(acc, qa, da, kt, vt, kb, row, t, l2, dl, qscale);
        __syncthreads();
    }
    const float mul[2] = {scale, scale};
    hp_store(dq + bin, lin.row, acc, row, T, mul);
}

// The backward's step on one tile of 64 queries against a warpgroup's 64 keys, keys as rows:
// Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (shared-memory operands), then Pᵀ = exp2(Sᵀ·qscale − lse2), 0
// where the query is before the key or past T, and dSᵀ = Pᵀ ∘ (dPᵀ − δ), returned as the bf16
// A fragments pa (Pᵀ) and sa (dSᵀ) of the products that follow. ka, va: the warpgroup's K and
// V rows in tiles of `krows` rows; qt, dt: the staged Q and dO tiles; lt, dlt: their lse2 and
// δ; qb: the tile's first query; key: the thread's first key; t: its lane % 4.
//
// MASK: the tile holds queries before some key of the warpgroup (its diagonal tile) or past T
// (the last, when T % 64 ≠ 0), zeroed there; every other tile skips the compares and selects.
// A thread's columns come in adjacent pairs (2t, 2t + 1 of each 8), so lse2 and δ are read as
// float2, 16 loads where one per column was 32.
template <bool MASK>
__device__ __forceinline__ void hp_bwd_p_ds(hp_u32 (*pa)[4], hp_u32 (*sa)[4], hp_u32 ka, hp_u32 va,
                                            int krows, hp_u32 qt, hp_u32 dt, const float* lt,
                                            const float* dlt, int qb, int key, int t, int T,
                                            float qscale) {
    float s[HP_BWD_N / 2], dp[HP_BWD_N / 2];
    hp_bwd_s_dp(s, dp, ka, qt, va, dt, krows);
#pragma unroll
    for (int j = 0; j < HP_BWD_N / 8; ++j) {
        const float2 l = *reinterpret_cast<const float2*>(lt + 8 * j + 2 * t);
        const float2 d = *reinterpret_cast<const float2*>(dlt + 8 * j + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = 4 * j + e, h = e >> 1, qq = qb + 8 * j + 2 * t + (e & 1);
            float p = wd_exp2(fmaf(s[i], qscale, -((e & 1) ? l.y : l.x)));
            if (MASK && (qq < key + 8 * h || qq >= T)) p = 0.f;
            s[i] = p;
            dp[i] = p * (dp[i] - ((e & 1) ? d.y : d.x));  // dSᵀ
        }
    }
    hp_to_a<HP_BWD_N>(pa, s);
    hp_to_a<HP_BWD_N>(sa, dp);
}
// dV += Pᵀ dO and dK += dSᵀ Q for the fragments hp_bwd_p_ds returned (qt, dt: the same tiles,
// read MN-major); waits for both, so Pᵀ's and dSᵀ's registers are free after it.
__device__ __forceinline__ void hp_bwd_dkdv(float* dka, float* dva, const hp_u32 (*pa)[4],
                                            const hp_u32 (*sa)[4], hp_u32 qt, hp_u32 dt) {
    hp_fence();
#pragma unroll
    for (int kk = 0; kk < HP_BWD_N / 16; ++kk) {
        hp_rs_d(dva, pa[kk], hp_desc_mn(dt, HP_BWD_N, kk), 1);
        hp_rs_d(dka, sa[kk], hp_desc_mn(qt, HP_BWD_N, kk), 1);
    }
    hp_commit();
    hp_wait();
    hp_hold<HEAD_DIM / 2>(dka);
    hp_hold<HEAD_DIM / 2>(dva);
}

#define HP_DKDV_ROWS (64 * HP_DKDV_WGS)
#define HP_DKDV_SMEM ((2 * HP_DKDV_ROWS + 4 * HP_BWD_N) * HEAD_DIM * 2 + 1024 + 4 * HP_BWD_N * 4)
// dk = scale · dSᵀ q and dv = Pᵀ dO, as flash_wide_dkdv; 64·HP_DKDV_WGS keys per block (K and
// V staged once), query tiles of 64 (with their lse2 and δ) from the block's first key on:
// Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (shared memory operands), then dV += Pᵀ dO and dK += dSᵀ Q with
// Pᵀ and dSᵀ from registers. Grid (ceil(T / HP_DKDV_ROWS), BH), 128·HP_DKDV_WGS threads,
// HP_DKDV_SMEM bytes of shared memory.
extern "C" __global__ void __launch_bounds__(128 * HP_DKDV_WGS, HP_DKDV_BLOCKS)
    flash_hopper_dkdv(const elem* q, const elem* k, const elem* v, const elem* dout,
                      const float* lse2, const float* dvec, elem* dk, elem* dv, int T,
                      float qscale, float scale, HeadRows lin, HeadRows lout) {
    hp_require_smem(HP_DKDV_SMEM);
    char* ks = hp_smem_base();                    // (64·WGS, D)
    char* vs = ks + HP_DKDV_ROWS * HEAD_DIM * 2;       // (64·WGS, D)
    char* qs = vs + HP_DKDV_ROWS * HEAD_DIM * 2;       // 2 x (64, D)
    char* dos = qs + 2 * HP_BWD_N * HEAD_DIM * 2; // 2 x (64, D)
    float* ls = reinterpret_cast<float*>(dos + 2 * HP_BWD_N * HEAD_DIM * 2);  // 2 x 64
    float* dls = ls + 2 * HP_BWD_N;                                            // 2 x 64
    constexpr int TILE = HP_BWD_N * HEAD_DIM * 2;
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, wi = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    const long bin = head_row(lin, blockIdx.y, 0), bout = head_row(lout, blockIdx.y, 0);
    const float* lrow = lse2 + (long)blockIdx.y * T;
    const float* drow = dvec + (long)blockIdx.y * T;
    const int k0 = blockIdx.x * HP_DKDV_ROWS;  // block 0 has the most query tiles and starts first
    const int kw = k0 + 64 * wg;          // the warpgroup's first key
    const int key = kw + 16 * wi + g;     // the thread's keys: key, key + 8
    const int qt0 = k0 / HP_BWD_N, tiles = (T + HP_BWD_N - 1) / HP_BWD_N - qt0;
    hp_stage<HP_DKDV_ROWS, 128 * HP_DKDV_WGS>(ks, k + bin, lin.row, k0, T, threadIdx.x);
    hp_stage<HP_DKDV_ROWS, 128 * HP_DKDV_WGS>(vs, v + bin, lin.row, k0, T, threadIdx.x);
    auto stage_q = [&](int j, int b) {
        const int qb = (qt0 + j) * HP_BWD_N;
        hp_stage<HP_BWD_N, 128 * HP_DKDV_WGS>(qs + b * TILE, q + bin, lin.row, qb, T, threadIdx.x);
        hp_stage<HP_BWD_N, 128 * HP_DKDV_WGS>(dos + b * TILE, dout + bout, lout.row, qb, T, threadIdx.x);
        if (threadIdx.x < HP_BWD_N) {
            const int r = qb + threadIdx.x;
            wd_cp4(ls + b * HP_BWD_N + threadIdx.x, lrow + (r < T ? r : 0), r < T);
            wd_cp4(dls + b * HP_BWD_N + threadIdx.x, drow + (r < T ? r : 0), r < T);
        }
    };
    stage_q(0, 0);
    wd_commit();
    const hp_u32 ka = wd_saddr(ks) + wg * 64 * 128, va = wd_saddr(vs) + wg * 64 * 128;
    float dka[HEAD_DIM / 2], dva[HEAD_DIM / 2];
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 2; ++i) dka[i] = dva[i] = 0.f;
    for (int it = 0; it < tiles; ++it) {
        const int buf = it & 1, qb = (qt0 + it) * HP_BWD_N;
        if (it + 1 < tiles) stage_q(it + 1, buf ^ 1);
        wd_commit();
        wd_wait<1>();
        hp_fence_proxy();
        __syncthreads();
        if (qb + HP_BWD_N - 1 >= kw) {  // some query of the tile at or after the first key
            const hp_u32 qt = wd_saddr(qs + buf * TILE), dt = wd_saddr(dos + buf * TILE);
            hp_u32 pa[HP_BWD_N / 16][4], sa[HP_BWD_N / 16][4];
            // The mask only where the tile meets the warpgroup's keys or runs past T.
            if (qb < kw + 64 || qb + HP_BWD_N > T)
                hp_bwd_p_ds<true>(pa, sa, ka, va, HP_DKDV_ROWS, qt, dt, ls + buf * HP_BWD_N,
                                  dls + buf * HP_BWD_N, qb, key, t, T, qscale);
            else
                hp_bwd_p_ds<false>(pa, sa, ka, va, HP_DKDV_ROWS, qt, dt, ls + buf * HP_BWD_N,
                                   dls + buf * HP_BWD_N, qb, key, t, T, qscale);
            hp_bwd_dkdv(dka, dva, pa, sa, qt, dt);
        }
        __syncthreads();
    }
    const float one[2] = {1.f, 1.f}, mul[2] = {scale, scale};
    hp_store(dk + bin, lin.row, dka, key, T, mul);
    hp_store(dv + bin, lin.row, dva, key, T, one);
}

// The backward in one pass: dk = scale · dSᵀ q and dv = Pᵀ dO as flash_hopper_dkdv, and dq =
// scale · dS k added into `dqacc` (f32, (BH, T, D), zero on entry; flash_hopper_dq_out makes
// it bf16), so S and dP are computed once per tile pair: five products where the two-pass
// backward has seven. A block is HP_BWD_WGS warpgroups of 64 keys each, and each warpgroup
// runs on its own (its own staged tiles, warpgroup barriers only), over the query tiles from
// the last down to its keys' own, so the warpgroups of a block reach each tile together:
//
//   per query tile x (64 rows), per warpgroup w:
//     Sᵀ = K_w Qᵀ, dPᵀ = V_w dOᵀ → Pᵀ, dSᵀ (registers) → dV_w += Pᵀ dO, dK_w += dSᵀ Q
//     dSᵀ → shared memory, buffer x % 2 of the warpgroup (the staged tiles' swizzle)
//   warpgroup x % (those that see tile x), once all have stored their dSᵀ: dQ (64 x D) =
//   Σ_w dS_w K_w (dS read transposed), added into dqacc (one global add per block and tile,
//   not one per warpgroup); then buffer x % 2 of every warpgroup is free for tile x - 2
//
// Grid (ceil(T / HP_BWD_ROWS), BH), 128·HP_BWD_WGS threads, HP_BWD_SMEM bytes of shared memory.
#define HP_BWD_ROWS (64 * HP_BWD_WGS)
// One warpgroup's region: K, V (64 rows), Q and dO (2 x 64 rows), dSᵀ (2 x 64 x 64), lse2, δ.
#define HP_BWD_WG_BYTES (8 * 64 * HEAD_DIM * 2 + 4 * HP_BWD_N * 4)
#define HP_BWD_SMEM (HP_BWD_WGS * HP_BWD_WG_BYTES + 64 * HEAD_DIM * 2 + 4 * 4 + 1024)

// Adds a (row, 2 columns) pair of dQ into the f32 accumulator.
__device__ __forceinline__ void hp_red2(float* dst, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
}
// The barrier of warpgroup `wg` alone (barrier 0 is __syncthreads).
__device__ __forceinline__ void hp_wg_sync(int wg) {
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
}

extern "C" __global__ void __launch_bounds__(128 * HP_BWD_WGS, HP_BWD_BLOCKS)
    flash_hopper_bwd(const elem* q, const elem* k, const elem* v, const elem* dout,
                     const float* lse2, const float* dvec, float* dqacc, elem* dk, elem* dv,
                     int T, float qscale, float scale, HeadRows lin, HeadRows lout) {
    hp_require_smem(HP_BWD_SMEM);
    constexpr int TILE = 64 * HEAD_DIM * 2;
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, wi = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3, tw = threadIdx.x & 127;
    char* const region0 = hp_smem_base();  // warpgroup w's region at w·HP_BWD_WG_BYTES
    char* mine = region0 + wg * HP_BWD_WG_BYTES;
    char* ks = mine;              // (64, D)
    char* vs = ks + TILE;         // (64, D)
    char* qs = vs + TILE;         // 2 x (64, D)
    char* dos = qs + 2 * TILE;    // 2 x (64, D)
    char* dss = dos + 2 * TILE;   // 2 x (64, 64): dSᵀ of tiles x with x % 2 = 0, 1
    float* ls = reinterpret_cast<float*>(dss + 2 * TILE);  // 2 x 64
    float* dls = ls + 2 * HP_BWD_N;                        // 2 x 64
    char* zero = region0 + HP_BWD_WGS * HP_BWD_WG_BYTES;  // (64, D) zeros
    int* count = reinterpret_cast<int*>(zero + TILE);  // per buffer: dSᵀ stored
    int* owner = count + 2;    // per buffer: the tile whose dSᵀ it may take next
    const long bin = head_row(lin, blockIdx.y, 0), bout = head_row(lout, blockIdx.y, 0);
    const long abase = (long)blockIdx.y * T * HEAD_DIM;  // dqacc is (BH, T, D)
    const float* lrow = lse2 + (long)blockIdx.y * T;
    const float* drow = dvec + (long)blockIdx.y * T;
    const int k0 = blockIdx.x * HP_BWD_ROWS;  // block 0 has the most query tiles and starts first
    const int kw = k0 + 64 * wg;              // the warpgroup's first key
    const int key = kw + 16 * wi + g;         // the thread's keys: key, key + 8
    const int qt0 = k0 / HP_BWD_N, nt = (T + HP_BWD_N - 1) / HP_BWD_N;
    for (int i = threadIdx.x; i < TILE / 4; i += blockDim.x) reinterpret_cast<int*>(zero)[i] = 0;
    if (threadIdx.x < 2) {
        count[threadIdx.x] = 0;
        owner[threadIdx.x] = (nt - 1) % 2 == (int)threadIdx.x ? nt - 1 : nt - 2;
    }
    hp_fence_proxy();  // the zero tile, to the tensor cores
    __syncthreads();
    const int first = qt0 + wg;  // the warpgroup's own (diagonal) tile, its last
    if (first >= nt) return;     // keys past T: no tile, and no barrier waits for this warpgroup
    hp_stage<64, 128>(ks, k + bin, lin.row, kw, T, tw);
    hp_stage<64, 128>(vs, v + bin, lin.row, kw, T, tw);
    auto stage_q = [&](int x, int b) {
        const int qb = x * HP_BWD_N;
        hp_stage<HP_BWD_N, 128>(qs + b * TILE, q + bin, lin.row, qb, T, tw);
        hp_stage<HP_BWD_N, 128>(dos + b * TILE, dout + bout, lout.row, qb, T, tw);
        if (tw < HP_BWD_N) {
            const int r = qb + tw;
            wd_cp4(ls + b * HP_BWD_N + tw, lrow + (r < T ? r : 0), r < T);
            wd_cp4(dls + b * HP_BWD_N + tw, drow + (r < T ? r : 0), r < T);
        }
    };
    stage_q(nt - 1, 0);
    wd_commit();
    const hp_u32 ka = wd_saddr(ks), va = wd_saddr(vs);
    float dka[HEAD_DIM / 2], dva[HEAD_DIM / 2];
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 2; ++i) dka[i] = dva[i] = 0.f;
    for (int x = nt - 1, it = 0; x >= first; --x, ++it) {
        const int buf = it & 1, qb = x * HP_BWD_N, sb = x & 1;
        if (x > first) stage_q(x - 1, buf ^ 1);
        wd_commit();
        wd_wait<1>();
        hp_fence_proxy();
        hp_wg_sync(wg);
        const hp_u32 qt = wd_saddr(qs + buf * TILE), dt = wd_saddr(dos + buf * TILE);
        {
            hp_u32 pa[HP_BWD_N / 16][4], sa[HP_BWD_N / 16][4];
            // The mask only on the warpgroup's own (diagonal) tile and a last tile past T.
            if (x == first || qb + HP_BWD_N > T)
                hp_bwd_p_ds<true>(pa, sa, ka, va, 64, qt, dt, ls + buf * HP_BWD_N,
                                  dls + buf * HP_BWD_N, qb, key, t, T, qscale);
            else
                hp_bwd_p_ds<false>(pa, sa, ka, va, 64, qt, dt, ls + buf * HP_BWD_N,
                                   dls + buf * HP_BWD_N, qb, key, t, T, qscale);
            // Buffer sb is free once tile x + 2's dQ has read it.
            if (tw == 0)
                while (*reinterpret_cast<volatile int*>(owner + sb) != x) __nanosleep(20);
            hp_wg_sync(wg);
            // sa[kk][j] holds row 16·wi + g + 8·(j % 2), columns 16·kk + 8·(j / 2) + 2t, +1:
            // into the swizzled tile (chunk c of row r at c ^ (r % 8); r % 8 = g).
            char* dsw = dss + sb * TILE;
#pragma unroll
            for (int kk = 0; kk < HP_BWD_N / 16; ++kk)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int r = 16 * wi + g + 8 * (j & 1), c = 2 * kk + (j >> 1);
                    *reinterpret_cast<hp_u32*>(dsw + r * 128 + ((c ^ g) << 4) + 4 * t) = sa[kk][j];
                }
            hp_bwd_dkdv(dka, dva, pa, sa, qt, dt);  // Pᵀ's and dSᵀ's registers free before dQ's
        }
        hp_fence_proxy();  // the dSᵀ stores, to the tensor cores (of whichever warpgroup)
        __threadfence_block();
        hp_wg_sync(wg);
        if (tw == 0) atomicAdd(count + sb, 1);
        // Tile x's dQ falls to warpgroup x % seen of the `seen` whose keys the tile sees.
        const int seen = min(HP_BWD_WGS, x - qt0 + 1);
        if (wg == x % seen) {
            if (tw == 0)
                while (*reinterpret_cast<volatile int*>(count + sb) != seen) __nanosleep(20);
            hp_wg_sync(wg);
            __threadfence_block();
            float dqp[HEAD_DIM / 2];
            hp_fence();
#pragma unroll
            for (int w = 0; w < HP_BWD_WGS; ++w) {
                // A warpgroup that does not see the tile adds the zero tile's product (a
                // branch here would serialise the warpgroup's products).
                char* other = region0 + w * HP_BWD_WG_BYTES;
                const hp_u32 dsa = wd_saddr(w < seen ? other + 6 * TILE + sb * TILE : zero);
                const hp_u32 kwa = wd_saddr(w < seen ? other : zero);
#pragma unroll
                for (int kk = 0; kk < 64 / 16; ++kk)
                    hp_ss_d_t(dqp, hp_desc_mn(dsa, 64, kk), hp_desc_mn(kwa, 64, kk), w + kk);
            }
            hp_commit();
            hp_wait();
            hp_hold<HEAD_DIM / 2>(dqp);
            hp_wg_sync(wg);  // every thread's products are done: the buffers may be reused
            if (tw == 0) {
                count[sb] = 0;
                __threadfence_block();
                *reinterpret_cast<volatile int*>(owner + sb) = x - 2;
            }
            // dqp[i] is row 16·wi + g + 8·((i / 2) % 2), column 8·(i / 4) + 2t + i % 2.
#pragma unroll
            for (int i = 0; i < HEAD_DIM / 2; i += 2) {
                const int r = qb + 16 * wi + g + 8 * ((i >> 1) & 1);
                if (r < T)
                    hp_red2(dqacc + abase + (long)r * HEAD_DIM + 8 * (i >> 2) + 2 * t,
                            dqp[i] * scale, dqp[i + 1] * scale);
            }
        }
        hp_wg_sync(wg);  // buf is refilled two tiles on
    }
    const float one[2] = {1.f, 1.f}, mul[2] = {scale, scale};
    hp_store(dk + bin, lin.row, dka, key, T, mul);
    hp_store(dv + bin, lin.row, dva, key, T, one);
}

// dq (bf16, laid out by `lin`) from flash_hopper_bwd's f32 accumulator (BH, T, D) of n
// elements, four a thread; n % 4 == 0.
extern "C" __global__ void flash_hopper_dq_out(const float* acc, elem* dq, long n, int T,
                                               HeadRows lin) {
    const long i = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i >= n) return;
    const long r = i / HEAD_DIM;  // row r % T of head r / T
    const float4 a = *reinterpret_cast<const float4*>(acc + i);
    *reinterpret_cast<uint2*>(dq + head_row(lin, (int)(r / T), r % T) + i % HEAD_DIM) =
        make_uint2(wd_pack(a.x, a.y), wd_pack(a.z, a.w));
}
#endif
