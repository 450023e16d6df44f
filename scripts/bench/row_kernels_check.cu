// The row kernels of kernels.cu alone, outside the binary, on random bf16 rows: LayerNorm
// (ln_fwd, ln_bwd_dx with the residual added, ln_bwd_dwdb) over (N, C) and cross-entropy
// (ce_fwd, ce_bwd) over (N, V), against a double-precision reference on the host (max
// |difference| over max |reference|), and the time of each kernel and the bytes it moves per
// second. For finding the kernels' costs; claims about speed come from the binary.
//
//   build (here, nvcc of CUDA 13):  scripts/row-kernels-check.sh build [KERNELS_CU] [NAME]
//   run (on the GPU machine):       .gpu/row-kernels-check N C V REPS   (V 0: no cross-entropy)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>
#include <cuda_runtime.h>
#define ELEM_BF16 1
#ifndef KERNELS_CU
#define KERNELS_CU "../../crates/kernels/src/kernels.cu"
#endif
#include KERNELS_CU
// Columns per block of ln_bwd_dwdb (a build of an older kernels.cu passes its own).
#ifndef DWDB_COLS
#define DWDB_COLS (32 * VEC)
#endif

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
static float bf2f(unsigned short b) { unsigned u = (unsigned)b << 16; float f; memcpy(&f, &u, 4); return f; }
static unsigned short f2bf(float f) { unsigned u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return u >> 16; }

static double maxrel(const std::vector<double>& ref, const std::vector<float>& got) {
  double m = 0, r = 0;
  for (size_t i = 0; i < ref.size(); ++i) { m = fmax(m, fabs(ref[i] - got[i])); r = fmax(r, fabs(ref[i])); }
  return m / r;
}


// ce_fwd and ce_bwd over (N, V) logits in [-4, 4), g_n = 1 / N; the reference for the first 16
// rows.
template <typename Timer>
static void cross_entropy(int N, int V, int reps, Timer& timeit) {
  const size_t n = (size_t)N * V;
  std::vector<unsigned short> h(n);
  for (auto& v : h) v = f2bf(-4.f + 8.f * (rand() / (float)RAND_MAX));
  std::vector<unsigned int> tg(N);
  for (auto& t : tg) t = rand() % V;
  std::vector<float> g(N, 1.f / N);
  elem *x, *dx;
  unsigned int* t;
  float *loss, *lse, *gd;
  CK(cudaMalloc(&x, n * 2)); CK(cudaMalloc(&dx, n * 2)); CK(cudaMalloc(&t, N * 4));
  CK(cudaMalloc(&loss, N * 4)); CK(cudaMalloc(&lse, N * 4)); CK(cudaMalloc(&gd, N * 4));
  CK(cudaMemcpy(x, h.data(), n * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(t, tg.data(), N * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(gd, g.data(), N * 4, cudaMemcpyHostToDevice));
  auto fwd = [&] { ce_fwd<<<N, CE_THREADS>>>(x, t, loss, lse, V); };
  auto bwd = [&] { ce_bwd<<<N, CE_THREADS>>>(x, t, lse, gd, dx, V); };
  fwd(); bwd();
  CK(cudaDeviceSynchronize());
  const int R = N < 16 ? N : 16;
  std::vector<float> gl(N), gdx((size_t)R * V);
  std::vector<unsigned short> hdx((size_t)R * V);
  CK(cudaMemcpy(gl.data(), loss, N * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hdx.data(), dx, (size_t)R * V * 2, cudaMemcpyDeviceToHost));
  std::vector<double> rl(R), rdx((size_t)R * V);
  std::vector<float> gl16(R);
  for (int r = 0; r < R; ++r) {
    const size_t o = (size_t)r * V;
    double m = -1e30, s = 0;
    for (int v = 0; v < V; ++v) m = fmax(m, bf2f(h[o + v]));
    for (int v = 0; v < V; ++v) s += exp(bf2f(h[o + v]) - m);
    const double l = m + log(s);
    rl[r] = l - bf2f(h[o + tg[r]]);
    gl16[r] = gl[r];
    for (int v = 0; v < V; ++v) rdx[o + v] = (exp(bf2f(h[o + v]) - l) - (v == (int)tg[r])) / N;
  }
  for (size_t i = 0; i < gdx.size(); ++i) gdx[i] = bf2f(hdx[i]);
  printf("N %d V %d: max rel err loss %.3g dlogits %.3g\n", N, V, maxrel(rl, gl16), maxrel(rdx, gdx));
  const double nv = 2.0 * n;
  float ms = timeit("ce_fwd", nv, fwd);
  ms += timeit("ce_bwd", 2 * nv, bwd);
  printf("  %-12s %8.1f us\n", "both", ms * 1e3);
}

int main(int argc, char** argv) {
  const int N = argc > 1 ? atoi(argv[1]) : 8192, C = argc > 2 ? atoi(argv[2]) : 768;
  const int V = argc > 3 ? atoi(argv[3]) : 0, reps = argc > 4 ? atoi(argv[4]) : 50;
  const size_t n = (size_t)N * C;
  const float eps = 1e-5f;
  srand(1);
  auto rnd = [](std::vector<unsigned short>& h, float lo, float hi) {
    for (auto& v : h) v = f2bf(lo + (hi - lo) * (rand() / (float)RAND_MAX));
  };
  std::vector<unsigned short> hx(n), hdy(n), hres(n), hw(C), hb(C);
  rnd(hx, -2.f, 3.f); rnd(hdy, -1.f, 1.f); rnd(hres, -1.f, 1.f); rnd(hw, 0.5f, 1.5f); rnd(hb, -0.5f, 0.5f);
  elem *x, *dy, *res, *w, *b, *y, *dx;
  float *mean, *rstd, *dw, *db;
  for (elem** p : {&x, &dy, &res, &y, &dx}) CK(cudaMalloc(p, n * 2));
  CK(cudaMalloc(&w, C * 2)); CK(cudaMalloc(&b, C * 2));
  CK(cudaMalloc(&mean, N * 4)); CK(cudaMalloc(&rstd, N * 4));
  CK(cudaMalloc(&dw, C * 4)); CK(cudaMalloc(&db, C * 4));
  CK(cudaMemcpy(x, hx.data(), n * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dy, hdy.data(), n * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(res, hres.data(), n * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(w, hw.data(), C * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(b, hb.data(), C * 2, cudaMemcpyHostToDevice));
  // The launches of layer_norm.rs: 8 rows (warps) a block; dwdb (C / DWDB_COLS, N / LN_ROWS).
  const dim3 rows((N + 7) / 8), cols((C + DWDB_COLS - 1) / DWDB_COLS, (N + LN_ROWS - 1) / LN_ROWS);
  auto fwd = [&] { ln_fwd<<<rows, 256>>>(x, w, b, y, mean, rstd, N, C, eps); };
  auto bdx = [&] { ln_bwd_dx<<<rows, 256>>>(x, w, dy, mean, rstd, dx, N, C, res, 1); };
  auto bdwdb = [&] {
    cudaMemsetAsync(dw, 0, C * 4); cudaMemsetAsync(db, 0, C * 4);
    ln_bwd_dwdb<<<cols, 256>>>(x, dy, mean, rstd, dw, db, N, C);
  };
  fwd(); bdx(); bdwdb();
  CK(cudaDeviceSynchronize());
  // The reference, in double from the same bf16 inputs.
  std::vector<double> ry(n), rdx(n), rdw(C, 0.0), rdb(C, 0.0);
  for (int r = 0; r < N; ++r) {
    const size_t o = (size_t)r * C;
    double mu = 0, var = 0;
    for (int c = 0; c < C; ++c) mu += bf2f(hx[o + c]);
    mu /= C;
    for (int c = 0; c < C; ++c) { double d = bf2f(hx[o + c]) - mu; var += d * d; }
    const double rs = 1.0 / sqrt(var / C + eps);
    double a = 0, cc = 0;
    for (int c = 0; c < C; ++c) {
      const double xh = (bf2f(hx[o + c]) - mu) * rs, g = bf2f(hdy[o + c]), gw = g * bf2f(hw[c]);
      ry[o + c] = xh * bf2f(hw[c]) + bf2f(hb[c]);
      a += gw; cc += gw * xh;
      rdw[c] += g * xh; rdb[c] += g;
    }
    a /= C; cc /= C;
    for (int c = 0; c < C; ++c) {
      const double xh = (bf2f(hx[o + c]) - mu) * rs, gw = bf2f(hdy[o + c]) * bf2f(hw[c]);
      rdx[o + c] = rs * (gw - a - xh * cc) + bf2f(hres[o + c]);
    }
  }
  std::vector<unsigned short> h(n);
  std::vector<float> got(n), gw_(C), gb_(C);
  CK(cudaMemcpy(h.data(), y, n * 2, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; ++i) got[i] = bf2f(h[i]);
  const double ey = maxrel(ry, got);
  CK(cudaMemcpy(h.data(), dx, n * 2, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; ++i) got[i] = bf2f(h[i]);
  const double edx = maxrel(rdx, got);
  CK(cudaMemcpy(gw_.data(), dw, C * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(gb_.data(), db, C * 4, cudaMemcpyDeviceToHost));
  printf("N %d C %d: max rel err y %.3g dx %.3g dw %.3g db %.3g\n", N, C, ey, edx, maxrel(rdw, gw_), maxrel(rdb, gb_));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  auto timeit = [&](const char* name, double bytes, auto fn) {
    fn(); CK(cudaDeviceSynchronize());
    cudaEventRecord(e0); for (int r = 0; r < reps; ++r) fn(); cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
    float ms; cudaEventElapsedTime(&ms, e0, e1); ms /= reps;
    printf("  %-12s %8.1f us  %6.0f GB/s\n", name, ms * 1e3, bytes / ms / 1e6);
    return ms;
  };
  const double nc = 2.0 * n;  // bytes of one (N, C) bf16 tensor
  float t = timeit("ln_fwd", 2 * nc, fwd);        // x in, y out
  t += timeit("ln_bwd_dx", 4 * nc, bdx);          // x, dy, res in, dx out
  t += timeit("ln_bwd_dwdb", 2 * nc, bdwdb);      // x, dy in
  printf("  %-12s %8.1f us\n", "all three", t * 1e3);
  if (V > 0) cross_entropy(N, V, reps, timeit);
  return 0;
}
