// One of the GEMM calls `linear.rs` makes, alone, outside the binary: every algorithm cuBLASLt's
// heuristic offers for it and, for each that can split K, the same algorithm split 2 to 16
// ways with each reduction scheme it supports — each timed, with and without the call's
// epilogue. For finding whether a faster configuration than the heuristic's first exists; claims
// about speed come from the binary.
//
// The calls, column-major as linear.rs states them (bf16 in and out, f32 compute):
//   bias     D (m x n) = Aᵀ·B + bias          A = w (k x m, ld k), B = x (k x n)   forward
//   residual D (m x n) = Aᵀ·B + bias + C      C = r (m x n), β = 1                 forward_residual
//   dgelu    D (m x n) = gelu'(aux) ∘ (A·B)   A = w (m x k), B = dy (k x n)        input_grad_gelu
//   bgradb   D (m x n) = A·Bᵀ, db = Σ_k Bᵀ    A = x (m x k), B = dy (n x k)        weight_grad
//
//   build (here, CUDA 13):     scripts/gemm-epilogue-check.sh build-algos
//   run (on the GPU machine):  scripts/gemm-epilogue-check.sh algos KIND M N K REPS
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <cuda_runtime.h>
#include <cublasLt.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
#define LT(x) do { cublasStatus_t s = (x); if (s != CUBLAS_STATUS_SUCCESS) { printf("%s:%d cublasLt status %d\n", __FILE__, __LINE__, (int)s); exit(1);} } while (0)

struct Timed { float us; std::string what; };

static int cfg(const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoConfigAttributes_t at) {
  int v = 0; size_t w = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&a, at, &v, sizeof(v), &w);
  return v;
}

static std::string describe(const cublasLtMatmulAlgo_t& a) {
  char s[160];
  snprintf(s, sizeof s, "id %d tile %d splitk %d red %d stages %d cluster %d swizzle %d", cfg(a, CUBLASLT_ALGO_CONFIG_ID),
           cfg(a, CUBLASLT_ALGO_CONFIG_TILE_ID), cfg(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
           cfg(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME), cfg(a, CUBLASLT_ALGO_CONFIG_STAGES_ID),
           cfg(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID), cfg(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING));
  return s;
}

int main(int argc, char** argv) {
  const std::string kind = argc > 1 ? argv[1] : "bgradb";
  const long m = argc > 2 ? atol(argv[2]) : 768, n = argc > 3 ? atol(argv[3]) : 768;
  const long k = argc > 4 ? atol(argv[4]) : 8192;
  const int reps = argc > 5 ? atoi(argv[5]) : 20;
  const size_t WS = 32 << 20;
  const long big = std::max({m * n, m * k, k * n});
  void *a, *b, *c, *d, *aux, *ws, *bias;
  CK(cudaMalloc(&a, big * 2)); CK(cudaMalloc(&b, big * 2)); CK(cudaMalloc(&c, m * n * 2));
  CK(cudaMalloc(&d, m * n * 2)); CK(cudaMalloc(&aux, m * n * 2)); CK(cudaMalloc(&ws, WS));
  CK(cudaMalloc(&bias, std::max(m, n) * 4));
  // Small random bf16 values (the bits of floats in [-1, 1)), so no product overflows.
  std::vector<unsigned short> h(big);
  srand(1);
  for (auto& v : h) { float f = rand() / (float)RAND_MAX * 2.f - 1.f; unsigned u; memcpy(&u, &f, 4); v = u >> 16; }
  for (void* p : {a, b}) CK(cudaMemcpy(p, h.data(), big * 2, cudaMemcpyHostToDevice));
  for (void* p : {c, aux}) CK(cudaMemcpy(p, h.data(), m * n * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(bias, h.data(), std::max(m, n) * 2, cudaMemcpyHostToDevice));

  bool ta = false, tb = false, with_c = false;
  cublasLtEpilogue_t ep;
  if (kind == "bias" || kind == "residual") { ta = true; ep = CUBLASLT_EPILOGUE_BIAS; with_c = kind == "residual"; }
  else if (kind == "dgelu") ep = CUBLASLT_EPILOGUE_DGELU;
  else if (kind == "bgradb") { tb = true; ep = CUBLASLT_EPILOGUE_BGRADB; }
  else { printf("kind: bias, residual, dgelu or bgradb\n"); return 2; }

  cublasLtHandle_t lt; LT(cublasLtCreate(&lt));
  cublasLtMatrixLayout_t la, lb, ld;
  if (ta) LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, m, k)); else LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, m, k, m));
  if (tb) LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, n, k, n)); else LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, n, k));
  LT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, m, n, m));
  cublasLtMatmulPreference_t pref; LT(cublasLtMatmulPreferenceCreate(&pref));
  LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &WS, sizeof(WS)));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  const double flop = 2.0 * m * n * k;
  const float alpha = 1.f, beta = with_c ? 1.f : 0.f;

  for (int with_ep = 1; with_ep >= 0; --with_ep) {
    cublasLtMatmulDesc_t desc; LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const int opa = ta, opb = tb;
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
    if (with_ep) {
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof(ep)));
      if (ep == CUBLASLT_EPILOGUE_DGELU) {
        const long ldaux = m;
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ldaux, sizeof(ldaux)));
      } else {
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
      }
    }
    cublasLtMatmulHeuristicResult_t res[32];
    int found = 0;
    if (cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 32, res, &found) != CUBLAS_STATUS_SUCCESS) found = 0;
    std::vector<cublasLtMatmulAlgo_t> cands;
    std::vector<std::string> origin;
    for (int i = 0; i < found; ++i) {
      cands.push_back(res[i].algo);
      origin.push_back("heuristic #" + std::to_string(i));
      int splitk = 0; size_t w = 0; unsigned mask = 0;
      cublasLtMatmulAlgoCapGetAttribute(&res[i].algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &splitk, sizeof(splitk), &w);
      cublasLtMatmulAlgoCapGetAttribute(&res[i].algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, &mask, sizeof(mask), &w);
      if (!splitk) continue;
      for (int s : {2, 3, 4, 6, 8, 12, 16}) {
        for (unsigned r : {1u, 2u, 4u}) {
          if (!(mask & r)) continue;
          cublasLtMatmulAlgo_t x = res[i].algo;
          cublasLtMatmulAlgoConfigSetAttribute(&x, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &s, sizeof(s));
          cublasLtMatmulAlgoConfigSetAttribute(&x, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &r, sizeof(r));
          cublasLtMatmulHeuristicResult_t chk;
          if (cublasLtMatmulAlgoCheck(lt, desc, la, lb, ld, ld, &x, &chk) != CUBLAS_STATUS_SUCCESS) continue;
          if (chk.workspaceSize > WS) continue;
          cands.push_back(x);
          origin.push_back("heuristic #" + std::to_string(i) + " split");
        }
      }
    }
    std::vector<Timed> all;
    float first = 0.f;
    for (size_t i = 0; i < cands.size(); ++i) {
      auto run = [&] {
        return cublasLtMatmul(lt, desc, &alpha, a, la, b, lb, &beta, with_c ? c : d, ld, d, ld, &cands[i], ws, WS, 0);
      };
      if (run() != CUBLAS_STATUS_SUCCESS) continue;
      CK(cudaDeviceSynchronize());
      float best = 1e30f;
      for (int round = 0; round < 3; ++round) {
        cudaEventRecord(e0);
        for (int r = 0; r < reps; ++r) run();
        cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
        float ms; cudaEventElapsedTime(&ms, e0, e1);
        best = std::min(best, ms * 1e3f / reps);
      }
      if (i == 0) first = best;
      all.push_back({best, origin[i] + ": " + describe(cands[i])});
    }
    std::sort(all.begin(), all.end(), [](const Timed& x, const Timed& y) { return x.us < y.us; });
    printf("%s m %ld n %ld k %ld, %s: %d offered, %zu timed; the heuristic's first %.1f us (%.1f TFLOP/s)\n",
           kind.c_str(), m, n, k, with_ep ? "with its epilogue" : "no epilogue", found, all.size(), first,
           flop / first / 1e6);
    for (size_t i = 0; i < all.size() && i < 8; ++i)
      printf("  %8.1f us  %6.1f TFLOP/s  %s\n", all[i].us, flop / all[i].us / 1e6, all[i].what.c_str());
    cublasLtMatmulDescDestroy(desc);
  }
  return 0;
}
