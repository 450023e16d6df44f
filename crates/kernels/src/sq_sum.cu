// Σ x² of a list of tensors into per-block partials, in one launch (see reduce.rs). Compiled
// after kernels.cu (cuda.rs); the tensors' element types are read from the table, not ELEM_BF16.
//
// The table (u64), for k tensors:
//   [0, k)          byte address of tensor j's first element
//   [k, 2k)         n_j, its element count
//   [2k, 3k + 1)    o_j, the first block of tensor j (o_k = the grid's size)
//   [3k + 1, 4k + 1) 1 when tensor j is bf16, 0 when f32
//
// Block b finds its tensor j (o_j <= b < o_{j+1}) and sums x_j[i]² over its grid-stride share of
// x_j, as if tensor j had a grid of its own of B_j = o_{j+1} - o_j blocks; each square and each
// sum in f64, the block's 256 values then added in a fixed tree into out[b]. One input gives the
// same partials at every run.
//
//   thread t of block b = o_j + c:   i = c·256 + t, i + S, i + 2S, ...   (S = B_j · 256)
//   block b:                         part[0..256) ─ tree ─> out[b]
#define SQ_SUM_THREADS 256
extern "C" __global__ void sq_sum_partials(const unsigned long long* table, int k, double* out) {
    __shared__ double part[SQ_SUM_THREADS];
    const unsigned long long* first = table + 2 * k;
    const long b = blockIdx.x;
    int lo = 0, hi = k - 1;  // the last j with first[j] <= b
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if ((long)first[mid] <= b) lo = mid; else hi = mid - 1;
    }
    const int j = lo;
    const long n = (long)table[k + j];
    const long nb = (long)first[j + 1] - (long)first[j];
    const bool bf16 = table[3 * k + 1 + j] != 0;
    double acc = 0.0;
    const long stride = nb * blockDim.x;
    const long start = (b - (long)first[j]) * blockDim.x + threadIdx.x;
    if (bf16) {
        const unsigned short* x = reinterpret_cast<const unsigned short*>(table[j]);
        for (long i = start; i < n; i += stride) {
            const double v = (double)__uint_as_float(((unsigned int)x[i]) << 16);
            acc += v * v;
        }
    } else {
        const float* x = reinterpret_cast<const float*>(table[j]);
        for (long i = start; i < n; i += stride) {
            const double v = (double)x[i];
            acc += v * v;
        }
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[b] = part[0];
}

// The partials' total into out[0], in one block: thread t adds parts[t], parts[t + 256], ... in
// order, then the 256 sums meet in the same fixed tree as above. One input gives the same total
// at every run, and nothing but this one value ever needs to leave the device.
extern "C" __global__ void sq_sum_total(const double* parts, long n, double* out) {
    __shared__ double part[SQ_SUM_THREADS];
    double acc = 0.0;
    for (long i = threadIdx.x; i < n; i += blockDim.x) acc += parts[i];
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[0] = part[0];
}

// The clip coefficient of a squared global norm, on the device so the optimizer's launch need
// not wait for the norm to reach the host: adamw.rs's clip_coef term for term in f64 (sqrt and
// division correctly rounded, fmin passing over a NaN as f64::min does), rounded to f32 once.
extern "C" __global__ void clip_coef_f32(const double* sq, double max_norm, float* coef) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    double c = 1.0;
    if (max_norm > 0.0) c = fmin(max_norm / (sqrt(sq[0]) + 1e-6), 1.0);
    coef[0] = (float)c;
}
