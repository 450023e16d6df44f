
// ---------------------------------------------------------------------------------------------
// Dropout of a block of a global activation (dropout.rs `apply`): y = x * mask, the mask drawn
// for each element's place in the global (G0, G1, G2) activation. The block is (n / (t c), t, c)
// starting at (o0, o1, o2); element i of it sits at global index
//   ((o0 + i / (t c)) * G1 + o1 + (i / c) % t) * G2 + o2 + i % c.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void dropout_fwd(const elem* x, elem* y, long n, long t, long c, long o0,
                                       long o1, long o2, long g1, long g2, DropKey key) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x) {
        const long a = i / (t * c), b = (i / c) % t, e = i % c;
        const unsigned long long g = (unsigned long long)((o0 + a) * g1 + o1 + b) * g2 + o2 + e;
        st(y, i, ld(x, i) * drop_mask(key, g));
    }
}
