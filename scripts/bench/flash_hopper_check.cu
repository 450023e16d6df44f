// The Hopper attention kernels alone, outside the binary: flash_hopper_* against flash_wide_*
// (the outputs and the three gradients, max |difference|) and the time of each kernel, on random
// bf16 q, k, v, dO of (BH, T, 64). For choosing the kernels' shapes (HP_*_WGS, HP_*_BLOCKS) and
// finding their costs; claims about speed come from the binary (scripts/bench-gpu.sh).
//
//   build (here, nvcc of CUDA 13):  scripts/flash-hopper-check.sh build [-DHP_FWD_WGS=3 ...]
//   run (on the GPU machine):       .gpu/flash-hopper-check BH T REPS
// The candidate forward below (flash_hopper_fwd_overlap) takes -DHPO_WGS=.. -DHPO_BLOCKS=..
// (together) and -DHPO_N=64|128 on the build line.
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <cuda_runtime.h>
#define ELEM_BF16 1
#define HEAD_DIM 64
// The shapes attention_path.rs passes to NVRTC, unless the build line gives others.
#ifndef HP_FWD_WGS
#define HP_FWD_WGS 2
#define HP_FWD_BLOCKS 2
#define HP_DQ_WGS 2
#define HP_DQ_BLOCKS 2
#define HP_DKDV_WGS 1
#define HP_DKDV_BLOCKS 3
#endif
#ifndef HP_BWD_WGS
#define HP_BWD_WGS 3
#define HP_BWD_BLOCKS 1
#endif
typedef unsigned short elem;
#define NEG_INF (-__int_as_float(0x7f800000))
// kernels.cu's row layout (not included here), heads stored apart below.
struct HeadRows {
    long batch, head;
    int row, heads;
};
__device__ __forceinline__ long head_row(const HeadRows& l, int bh, long t) {
    return (long)(bh / l.heads) * l.batch + (long)(bh % l.heads) * l.head + t * l.row;
}
#include "../../crates/kernels/src/flash_wide.cu"
#include "../../crates/kernels/src/flash_hopper.cu"

// ---------------------------------------------------------------------------------------------
// A candidate forward, timed and checked here before it can replace flash_hopper_fwd: the same
// outputs, with the next tile's S = Q Kᵀ and this tile's O += P V in flight together while the
// softmax runs (flash_hopper_fwd waits for each product before the next step). Its shape comes
// from HPO_WGS / HPO_BLOCKS / HPO_N (default 3 warpgroups, one block per SM, 128 keys: 168
// registers, no spills under ptxas of CUDA 13; 2 x 2 at 128 keys spills, at HPO_N=64 it fits).
// ---------------------------------------------------------------------------------------------
#ifndef HPO_WGS
#define HPO_WGS 3
#define HPO_BLOCKS 1
#endif
#ifndef HPO_N
#define HPO_N 128
#endif
// Waits for all but the last committed batch of products.
__device__ __forceinline__ void hp_wait1() {
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}
// Keeps the A fragments of an issued product alive (their registers unused) until here.
template <int K>
__device__ __forceinline__ void hp_hold_a(hp_u32 (*a)[4]) {
#pragma unroll
    for (int i = 0; i < K; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}
// o = softmax(mask(q kᵀ scale)) v and lse2 per row, as flash_wide_fwd; q, k, v, o: (BH, T, D),
// q, k, v laid out by `lin` and o by `lout` (HeadRows, kernels.cu), lse2: (BH, T). Per staged
// tile of 128 keys each warpgroup computes S (64 x 128) = Q Kᵀ (Q and K from shared memory),
// the online softmax on S in registers (log2 domain, as in flash_wide_fwd), then O += P V with
// P from registers. The two products of neighbouring tiles overlap the softmax between them:
//
//   tile j:  issue S_{j+1} = Q K_{j+1}  ─┐ both in flight          (tensor cores)
//            issue O += P_j V_j         ─┘
//            wait for S_{j+1}; its softmax → P_{j+1}, the rescale  (while O += P_j V_j runs)
//            wait for O; O *= the rescale of tile j+1
//
// so K runs one tile ahead of V in the staging: while tile j is used, K_{j+2} and V_{j+1} are
// fetched into the two slots that K_j and V_{j-1} left. Grid (ceil(T / HPO_ROWS), BH),
// 128·HPO_WGS threads, HPO_SMEM bytes of shared memory.
#define HPO_ROWS (64 * HPO_WGS)
#define HPO_SMEM ((HPO_ROWS + 4 * HPO_N) * HEAD_DIM * 2 + 1024)
extern "C" __global__ void __launch_bounds__(128 * HPO_WGS, HPO_BLOCKS)
    flash_hopper_fwd_overlap(const elem* q, const elem* k, const elem* v, elem* o, float* lse2, int T,
                     float qscale, HeadRows lin, HeadRows lout) {
    hp_require_smem(HPO_SMEM);
    char* qs = hp_smem_base();                    // (64·WGS, D)
    char* ks = qs + HPO_ROWS * HEAD_DIM * 2;   // 2 x (128, D)
    char* vs = ks + 2 * HPO_N * HEAD_DIM * 2;  // 2 x (128, D)
    constexpr int TILE = HPO_N * HEAD_DIM * 2;
    constexpr int THREADS = 128 * HPO_WGS;
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, wi = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    const long bin = head_row(lin, blockIdx.y, 0);
    const int q0 = (gridDim.x - 1 - blockIdx.x) * HPO_ROWS;  // the longest rows start first
    const int rw = q0 + 64 * wg;                                 // the warpgroup's first row
    const int row = rw + 16 * wi + g;  // the thread's rows: row, row + 8
    const int tiles = (min(q0 + HPO_ROWS, T) + HPO_N - 1) / HPO_N;
    // A warpgroup computes tile j when its key kb = j·128 is at or before the warpgroup's last
    // row: a prefix of the tiles, and every row of it sees key kb, so its maximum is finite.
    auto computes = [&](int j) { return j < tiles && j * HPO_N <= rw + 63; };
    hp_stage<HPO_ROWS, THREADS>(qs, q + bin, lin.row, q0, T, threadIdx.x);
    hp_stage<HPO_N, THREADS>(ks, k + bin, lin.row, 0, T, threadIdx.x);
    wd_commit();  // Q, K_0
    if (tiles > 1) hp_stage<HPO_N, THREADS>(ks + TILE, k + bin, lin.row, HPO_N, T, threadIdx.x);
    hp_stage<HPO_N, THREADS>(vs, v + bin, lin.row, 0, T, threadIdx.x);
    wd_commit();  // K_1, V_0
    const hp_u32 qa = wd_saddr(qs) + wg * 64 * 128;
    float acc[HEAD_DIM / 2], s[HPO_N / 2];
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 2; ++i) acc[i] = 0.f;
    float mrow[2] = {NEG_INF, NEG_INF}, lrow[2] = {0.f, 0.f};
    // Issues S = Q K_j into d (the caller fences, commits and waits).
    auto issue_s = [&](float* d, int j) {
        const hp_u32 kt = wd_saddr(ks + (j & 1) * TILE);
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
            hp_ss<HPO_N>(d, hp_desc_k(qa, HPO_ROWS, kk), hp_desc_k(kt, HPO_N, kk), kk);
    };
    // The online softmax of tile j's S in place: P = 2^(S·qscale − m) with the rows' new
    // maximum m, lrow rescaled and summed; returns the rescale of what was summed before.
    auto softmax = [&](float* d, int j, float* corr) {
        const int kb = j * HPO_N;
        const bool full = kb + HPO_N - 1 <= rw;  // no key after any row of the warpgroup
        float mx[2] = {NEG_INF, NEG_INF}, neg[2];
#pragma unroll
        for (int i = 0; i < HPO_N / 2; ++i) {
            const int h = (i >> 1) & 1, key = kb + (i >> 2) * 8 + 2 * t + (i & 1);
            if (!full && key > row + 8 * h) d[i] = NEG_INF;
            mx[h] = fmaxf(mx[h], d[i]);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float mnew = fmaxf(mrow[h], wd_quad_max(mx[h]) * qscale);
            corr[h] = wd_exp2(mrow[h] - mnew);
            lrow[h] *= corr[h];
            mrow[h] = mnew;
            neg[h] = -mnew;
        }
#pragma unroll
        for (int i = 0; i < HPO_N / 2; ++i) {
            d[i] = wd_exp2(fmaf(d[i], qscale, neg[(i >> 1) & 1]));
            lrow[(i >> 1) & 1] += d[i];  // this lane's share; quad sum at the end
        }
    };
    wd_wait<1>();
    hp_fence_proxy();
    __syncthreads();
    {  // tile 0, which every warpgroup computes
        float corr[2];
        hp_fence();
        issue_s(s, 0);
        hp_commit();
        hp_wait();
        hp_hold<HPO_N / 2>(s);
        softmax(s, 0, corr);
    }
    for (int j = 0; j < tiles; ++j) {
        // K_j's slot and V_{j-1}'s are free (every warpgroup is past the barrier at the end
        // of tile j - 1): K_{j+2} and V_{j+1} into them.
        if (j + 2 < tiles)
            hp_stage<HPO_N, THREADS>(ks + (j & 1) * TILE, k + bin, lin.row, (j + 2) * HPO_N, T, threadIdx.x);
        if (j + 1 < tiles)
            hp_stage<HPO_N, THREADS>(vs + ((j + 1) & 1) * TILE, v + bin, lin.row, (j + 1) * HPO_N, T, threadIdx.x);
        wd_commit();
        wd_wait<1>();  // K_{j+1}, V_j
        hp_fence_proxy();
        __syncthreads();
        if (computes(j)) {
            // S_{j+1} is issued whether or not the warpgroup computes tile j + 1 (a branch
            // around it would serialise the products): past the last tile it reads a stale
            // slot, past the warpgroup's rows it is masked out, and either way unused.
            const bool next = computes(j + 1);
            hp_u32 pa[HPO_N / 16][4];
            hp_to_a<HPO_N>(pa, s);
            const hp_u32 vt = wd_saddr(vs + (j & 1) * TILE);
            float sn[HPO_N / 2], corr[2] = {1.f, 1.f};
            hp_fence();
            issue_s(sn, j + 1);
            hp_commit();
#pragma unroll
            for (int kk = 0; kk < HPO_N / 16; ++kk)
                hp_rs64(acc, pa[kk], hp_desc_mn(vt, HPO_N, kk), 1);
            hp_commit();
            hp_wait1();
            hp_hold<HPO_N / 2>(sn);
            if (next) softmax(sn, j + 1, corr);
            hp_wait();
            hp_hold<HEAD_DIM / 2>(acc);
            hp_hold_a<HPO_N / 16>(pa);  // the tensor cores read P until the wait
#pragma unroll
            for (int i = 0; i < HEAD_DIM / 2; ++i) acc[i] *= corr[(i >> 1) & 1];
#pragma unroll
            for (int i = 0; i < HPO_N / 2; ++i) s[i] = sn[i];
        }
        __syncthreads();  // every warpgroup is done with K_{j+1}'s neighbour slot and V_j
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


#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
static float bf2f(unsigned short b) { unsigned u = (unsigned)b << 16; float f; memcpy(&f, &u, 4); return f; }
static unsigned short f2bf(float f) { unsigned u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return u >> 16; }

struct Cmp { double maxabs, ref; };
static Cmp cmp(const std::vector<unsigned short>& a, const std::vector<unsigned short>& b) {
  double m = 0, r = 0;
  for (size_t i = 0; i < a.size(); ++i) { m = fmax(m, fabs(bf2f(a[i]) - bf2f(b[i]))); r = fmax(r, fabs(bf2f(b[i]))); }
  return {m, r};
}

int main(int argc, char** argv) {
  int BH = argc > 1 ? atoi(argv[1]) : 48, T = argc > 2 ? atoi(argv[2]) : 4096;
  int reps = argc > 3 ? atoi(argv[3]) : 20;
  const int D = HEAD_DIM;
  size_t n = (size_t)BH * T * D;
  std::vector<unsigned short> h(n);
  srand(1);
  elem *q, *k, *v, *o1, *o2, *dout, *dq1, *dq2, *dk1, *dk2, *dv1, *dv2;
  float *l1, *l2, *dvec;
  elem** bufs[] = {&q, &k, &v, &o1, &o2, &dout, &dq1, &dq2, &dk1, &dk2, &dv1, &dv2};
  for (auto b : bufs) CK(cudaMalloc(b, n * 2));
  float* dqacc; CK(cudaMalloc(&dqacc, n * 4));
  CK(cudaMalloc(&l1, BH * T * 4)); CK(cudaMalloc(&l2, BH * T * 4)); CK(cudaMalloc(&dvec, BH * T * 4));
  for (elem* p : {q, k, v, dout}) {
    for (auto& x : h) x = f2bf((rand() / (float)RAND_MAX - 0.5f) * 2.f);
    CK(cudaMemcpy(p, h.data(), n * 2, cudaMemcpyHostToDevice));
  }
  float scale = 1.f / sqrtf(D), qscale = scale * 1.4426950408889634f;
  const HeadRows ap{(long)T * D, 0, D, 1};
  dim3 gw((T + WD_ROWS - 1) / WD_ROWS, BH), gf((T + HP_FWD_ROWS - 1) / HP_FWD_ROWS, BH), gq((T + HP_DQ_ROWS - 1) / HP_DQ_ROWS, BH), gk((T + HP_DKDV_ROWS - 1) / HP_DKDV_ROWS, BH);
  CK(cudaFuncSetAttribute(flash_hopper_fwd, cudaFuncAttributeMaxDynamicSharedMemorySize, HP_FWD_SMEM));
  CK(cudaFuncSetAttribute(flash_hopper_dq, cudaFuncAttributeMaxDynamicSharedMemorySize, HP_DQ_SMEM));
  CK(cudaFuncSetAttribute(flash_hopper_dkdv, cudaFuncAttributeMaxDynamicSharedMemorySize, HP_DKDV_SMEM));
  CK(cudaFuncSetAttribute(flash_hopper_bwd, cudaFuncAttributeMaxDynamicSharedMemorySize, HP_BWD_SMEM));
  dim3 gb((T + HP_BWD_ROWS - 1) / HP_BWD_ROWS, BH), gc((unsigned)((n / 4 + 255) / 256));
  auto fused = [&] {
    cudaMemsetAsync(dqacc, 0, n * 4);
    flash_hopper_bwd<<<gb, 128 * HP_BWD_WGS, HP_BWD_SMEM>>>(q, k, v, dout, l1, dvec, dqacc, dk2, dv2, T, qscale, scale, ap, ap);
    flash_hopper_dq_out<<<gc, 256>>>(dqacc, dq2, (long)n, T, ap);
  };
  flash_wide_fwd<<<gw, 128>>>(q, k, v, o1, l1, T, qscale);
  flash_hopper_fwd<<<gf, 128 * HP_FWD_WGS, HP_FWD_SMEM>>>(q, k, v, o2, l2, T, qscale, ap, ap);
  CK(cudaDeviceSynchronize());
  std::vector<unsigned short> a(n), b(n);
  CK(cudaMemcpy(a.data(), o1, n * 2, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(b.data(), o2, n * 2, cudaMemcpyDeviceToHost));
  Cmp c = cmp(b, a);
  std::vector<float> la(BH * T), lb(BH * T);
  CK(cudaMemcpy(la.data(), l1, BH * T * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(lb.data(), l2, BH * T * 4, cudaMemcpyDeviceToHost));
  double ml = 0; for (int i = 0; i < BH * T; ++i) ml = fmax(ml, fabs(la[i] - lb[i]));
  printf("BH %d T %d fwd: o max|d| %.3g (max|o| %.3g), lse2 max|d| %.3g\n", BH, T, c.maxabs, c.ref, ml);
  dim3 go((T + HPO_ROWS - 1) / HPO_ROWS, BH);
  CK(cudaFuncSetAttribute(flash_hopper_fwd_overlap, cudaFuncAttributeMaxDynamicSharedMemorySize, HPO_SMEM));
  flash_hopper_fwd_overlap<<<go, 128 * HPO_WGS, HPO_SMEM>>>(q, k, v, o2, l2, T, qscale, ap, ap);
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(b.data(), o2, n * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(lb.data(), l2, BH * T * 4, cudaMemcpyDeviceToHost));
  c = cmp(b, a); ml = 0; for (int i = 0; i < BH * T; ++i) ml = fmax(ml, fabs(la[i] - lb[i]));
  printf("  overlap fwd (%d x %d, %d keys): o max|d| %.3g, lse2 max|d| %.3g\n", HPO_WGS, HPO_BLOCKS, HPO_N, c.maxabs, ml);
  // delta = rowsum(dO * O) from the reference output
  std::vector<unsigned short> hd(n); CK(cudaMemcpy(hd.data(), dout, n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> dv_(BH * T);
  for (long r = 0; r < (long)BH * T; ++r) { double s = 0; for (int j = 0; j < D; ++j) s += bf2f(a[r * D + j]) * bf2f(hd[r * D + j]); dv_[r] = s; }
  CK(cudaMemcpy(dvec, dv_.data(), BH * T * 4, cudaMemcpyHostToDevice));
  flash_wide_dq<<<gw, 128>>>(q, k, v, dout, l1, dvec, dq1, T, qscale, scale);
  flash_wide_dkdv<<<gw, 128>>>(q, k, v, dout, l1, dvec, dk1, dv1, T, qscale, scale);
  flash_hopper_dq<<<gq, 128 * HP_DQ_WGS, HP_DQ_SMEM>>>(q, k, v, dout, l1, dvec, dq2, T, qscale, scale, ap, ap);
  flash_hopper_dkdv<<<gk, 128 * HP_DKDV_WGS, HP_DKDV_SMEM>>>(q, k, v, dout, l1, dvec, dk2, dv2, T, qscale, scale, ap, ap);
  CK(cudaDeviceSynchronize());
  const char* names[] = {"dq", "dk", "dv"};
  elem* ref[] = {dq1, dk1, dv1}; elem* got[] = {dq2, dk2, dv2};
  auto compare = [&](const char* what) {
    for (int i = 0; i < 3; ++i) {
      CK(cudaMemcpy(a.data(), ref[i], n * 2, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(b.data(), got[i], n * 2, cudaMemcpyDeviceToHost));
      Cmp c = cmp(b, a); printf("  %s %s max|d| %.3g (max|ref| %.3g)\n", what, names[i], c.maxabs, c.ref);
    }
  };
  compare("two-pass");
  fused(); CK(cudaDeviceSynchronize());
  compare("one-pass");
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  double flop = 4.0 * BH * (double)T * T * D / 2;  // causal, one product pair
  auto timeit = [&](const char* name, double f, auto fn) {
    fn(); CK(cudaDeviceSynchronize());
    cudaEventRecord(e0); for (int r = 0; r < reps; ++r) fn(); cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
    float ms; cudaEventElapsedTime(&ms, e0, e1); ms /= reps;
    printf("  %-12s %8.3f ms  %6.1f TFLOP/s\n", name, ms, f / ms / 1e9);
  };
  timeit("wide fwd", flop, [&] { flash_wide_fwd<<<gw, 128>>>(q, k, v, o1, l1, T, qscale); });
  timeit("hopper fwd", flop, [&] { flash_hopper_fwd<<<gf, 128 * HP_FWD_WGS, HP_FWD_SMEM>>>(q, k, v, o2, l2, T, qscale, ap, ap); });
  timeit("overlap fwd", flop, [&] { flash_hopper_fwd_overlap<<<go, 128 * HPO_WGS, HPO_SMEM>>>(q, k, v, o2, l2, T, qscale, ap, ap); });
  timeit("wide dq", flop * 1.5, [&] { flash_wide_dq<<<gw, 128>>>(q, k, v, dout, l1, dvec, dq1, T, qscale, scale); });
  timeit("hopper dq", flop * 1.5, [&] { flash_hopper_dq<<<gq, 128 * HP_DQ_WGS, HP_DQ_SMEM>>>(q, k, v, dout, l1, dvec, dq2, T, qscale, scale, ap, ap); });
  timeit("wide dkdv", flop * 2, [&] { flash_wide_dkdv<<<gw, 128>>>(q, k, v, dout, l1, dvec, dk1, dv1, T, qscale, scale); });
  timeit("hopper dkdv", flop * 2, [&] { flash_hopper_dkdv<<<gk, 128 * HP_DKDV_WGS, HP_DKDV_SMEM>>>(q, k, v, dout, l1, dvec, dk2, dv2, T, qscale, scale, ap, ap); });
  timeit("hopper bwd", flop * 2.5, fused);
  return 0;
}
