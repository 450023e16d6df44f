// The GEMM with the GELU-derivative epilogue alone, outside the binary: every algorithm
// cuBLASLt's heuristic offers for the call `linear.rs` makes (`input_grad_gelu`: column-major
// D (in x N) = w · dy, bf16 in and out, f32 compute, aux = f of (N, in), DGELU), each timed, next
// to the same product with the bias gradient of D in the epilogue too (DGELU_BGRAD, db (in,)
// in f32) and without any epilogue. For finding whether a better algorithm than the
// heuristic's first exists, and what the bias gradient adds; claims about speed come from the
// binary.
//
//   build (here, CUDA 13):     scripts/gemm-epilogue-check.sh build
//   run (on the GPU machine):  scripts/gemm-epilogue-check.sh run IN OUT N REPS   (default 3072 768 8192 20)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>
#include <cublasLt.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
#define LT(x) do { cublasStatus_t s = (x); if (s != CUBLAS_STATUS_SUCCESS) { printf("%s:%d cublasLt status %d\n", __FILE__, __LINE__, (int)s); exit(1);} } while (0)

int main(int argc, char** argv) {
  const long m = argc > 1 ? atol(argv[1]) : 3072, k = argc > 2 ? atol(argv[2]) : 768;
  const long n = argc > 3 ? atol(argv[3]) : 8192;
  const int reps = argc > 4 ? atoi(argv[4]) : 20;
  const size_t WS = 32 << 20;
  void *a, *b, *d, *aux, *ws, *db;
  CK(cudaMalloc(&db, m * 4));
  CK(cudaMalloc(&a, m * k * 2)); CK(cudaMalloc(&b, k * n * 2)); CK(cudaMalloc(&d, m * n * 2));
  CK(cudaMalloc(&aux, m * n * 2)); CK(cudaMalloc(&ws, WS));
  // Small random bf16 values (the bits of floats in [-1, 1)), so no product overflows.
  std::vector<unsigned short> h(m * n);
  srand(1);
  for (auto& v : h) { float f = rand() / (float)RAND_MAX * 2.f - 1.f; unsigned u; memcpy(&u, &f, 4); v = u >> 16; }
  CK(cudaMemcpy(a, h.data(), m * k * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(b, h.data(), k * n * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(aux, h.data(), m * n * 2, cudaMemcpyHostToDevice));
  cublasLtHandle_t lt; LT(cublasLtCreate(&lt));
  cublasLtMatrixLayout_t la, lb, ld;
  LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, m, k, m));
  LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, n, k));
  LT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, m, n, m));
  cublasLtMatmulPreference_t pref; LT(cublasLtMatmulPreferenceCreate(&pref));
  LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &WS, sizeof(WS)));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  const double flop = 2.0 * m * n * k;
  const cublasLtEpilogue_t eps[3] = {CUBLASLT_EPILOGUE_DGELU, CUBLASLT_EPILOGUE_DGELU_BGRAD,
                                     CUBLASLT_EPILOGUE_DEFAULT};
  const char* names[3] = {"DGELU", "DGELU_BGRAD", "no epilogue"};
  for (int e = 0; e < 3; ++e) {
    const int with_epilogue = eps[e] != CUBLASLT_EPILOGUE_DEFAULT;
    cublasLtMatmulDesc_t desc; LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t op = CUBLAS_OP_N;
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op, sizeof(op)));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op, sizeof(op)));
    if (with_epilogue) {
      cublasLtEpilogue_t ep = eps[e];
      const long ldaux = m;
      if (ep == CUBLASLT_EPILOGUE_DGELU_BGRAD) {
        const cudaDataType_t f32 = CUDA_R_32F;
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &db, sizeof(db)));
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &f32, sizeof(f32)));
      }
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof(ep)));
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ldaux, sizeof(ldaux)));
    }
    cublasLtMatmulHeuristicResult_t res[16];
    int found = 0;
    const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 16, res, &found);
    if (hs != CUBLAS_STATUS_SUCCESS) found = 0;
    printf("m %ld n %ld k %ld, %s: %d algorithms\n", m, n, k, names[e], found);
    const float alpha = 1.f, beta = 0.f;
    for (int i = 0; i < found; ++i) {
      auto run = [&] {
        return cublasLtMatmul(lt, desc, &alpha, a, la, b, lb, &beta, d, ld, d, ld, &res[i].algo, ws, WS, 0);
      };
      if (run() != CUBLAS_STATUS_SUCCESS) { printf("  #%-2d failed to run\n", i); continue; }
      CK(cudaDeviceSynchronize());
      cudaEventRecord(e0);
      for (int r = 0; r < reps; ++r) run();
      cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
      float ms; cudaEventElapsedTime(&ms, e0, e1); ms /= reps;
      printf("  #%-2d %8.1f us  %6.1f TFLOP/s  waves %.2f  workspace %zu\n", i, ms * 1e3, flop / ms / 1e9,
             res[i].wavesCount, res[i].workspaceSize);
    }
    cublasLtMatmulDescDestroy(desc);
  }
  return 0;
}
