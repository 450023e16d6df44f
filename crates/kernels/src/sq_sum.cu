// Σ x² of one tensor into per-block partials (see reduce.rs). Compiled after kernels.cu (cuda.rs).
//
// Block b of the grid writes out[b]: the sum of x[i]² over its grid-stride share of x[0..n),
// each square and each sum in f64, the block's 256 values then added in a fixed tree, so one
// input gives the same partials at every run. The host adds the partials of every tensor of a
// step in one pass, so the whole gradient norm costs one launch per tensor and one read-back.
//
//   thread t of block b:   i = b·256 + t, i + S, i + 2S, ...   (S = gridDim.x · 256)
//   block b:               part[0..256) ─ tree ─> out[b]
#define SQ_SUM_THREADS 256
extern "C" __global__ void sq_sum_partials(const elem* x, long n, double* out) {
    __shared__ double part[SQ_SUM_THREADS];
    double acc = 0.0;
    const long stride = (long)blockDim.x * gridDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const double v = (double)ld(x, i);
        acc += v * v;
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = part[0];
}
