// The Hopper attention kernels alone, outside the binary: flash_hopper_* against flash_wide_*
// (the outputs and the three gradients, max |difference|) and the time of each kernel, on random
// bf16 q, k, v, dO of (BH, T, HEAD_DIM), HEAD_DIM 64 unless the build line gives
// -DHEAD_DIM=128. For choosing the kernels' shapes (HP_*_WGS, HP_*_BLOCKS, HP_FWD_N) and
// finding their costs; claims about speed come from the binary (scripts/bench-gpu.sh).
//
//   build (here, nvcc of CUDA 13):  scripts/flash-hopper-check.sh build [-DHEAD_DIM=128]
//                                   [-DHP_FWD_WGS=3 ...]
//   run (on the GPU machine):       .gpu/flash-hopper-check BH T REPS
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <cuda_runtime.h>
#define ELEM_BF16 1
#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
// The shapes attention_path.rs passes to NVRTC, unless the build line gives others.
#ifndef HP_FWD_WGS
#if HEAD_DIM == 64
#define HP_FWD_WGS 2
#define HP_FWD_BLOCKS 2
#define HP_FWD_N 128
#define HP_DQ_WGS 2
#define HP_DQ_BLOCKS 2
#define HP_DKDV_WGS 1
#define HP_DKDV_BLOCKS 3
#else
#define HP_FWD_WGS 2
#define HP_FWD_BLOCKS 2
#define HP_FWD_N 64
#define HP_DQ_WGS 2
#define HP_DQ_BLOCKS 1
#define HP_DKDV_WGS 1
#define HP_DKDV_BLOCKS 2
#endif
#endif
#ifndef HP_BWD_WGS
#if HEAD_DIM == 64
#define HP_BWD_WGS 3
#else
#define HP_BWD_WGS 1
#endif
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
  timeit("wide dq", flop * 1.5, [&] { flash_wide_dq<<<gw, 128>>>(q, k, v, dout, l1, dvec, dq1, T, qscale, scale); });
  timeit("hopper dq", flop * 1.5, [&] { flash_hopper_dq<<<gq, 128 * HP_DQ_WGS, HP_DQ_SMEM>>>(q, k, v, dout, l1, dvec, dq2, T, qscale, scale, ap, ap); });
  timeit("wide dkdv", flop * 2, [&] { flash_wide_dkdv<<<gw, 128>>>(q, k, v, dout, l1, dvec, dk1, dv1, T, qscale, scale); });
  timeit("hopper dkdv", flop * 2, [&] { flash_hopper_dkdv<<<gk, 128 * HP_DKDV_WGS, HP_DKDV_SMEM>>>(q, k, v, dout, l1, dvec, dk2, dv2, T, qscale, scale, ap, ap); });
  timeit("hopper bwd", flop * 2.5, fused);
  return 0;
}
