// Kernels of the IPC backend (crates/comm/src/ipc), compiled at first use by NVRTC.
//
// Every pointer in a Peers table is a device address in this process: the rank's own buffer
// or a peer's buffer mapped through CUDA IPC. bf16 values are raw 16-bit words; all arithmetic
// is f32, rounded to bf16 (nearest even) once per output element.

#define MAX_WORLD 8
struct Peers { unsigned long long p[MAX_WORLD]; };

// Reductions: 0 sum, 1 avg (sum times scale), 2 max, 3 min.
__device__ __forceinline__ float combine(int op, float a, float b) {
    return op == 2 ? fmaxf(a, b) : op == 3 ? fminf(a, b) : a + b;
}
__device__ __forceinline__ unsigned int bf16_bits(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u; // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
}
__device__ __forceinline__ float bf16_f(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

// dst[i] = reduce over ranks q < n of src_q[off + i], for i < count, f32.
// Bulk in 16-byte vectors when every address is aligned, the rest element by element.
extern "C" __global__ void reduce_f32(Peers src, int n, unsigned long long off, float* dst,
                                      unsigned long long count, int op, float scale) {
    bool vec = ((unsigned long long)dst & 15ull) == 0 && (off & 3ull) == 0;
    for (int q = 0; q < n; ++q) vec = vec && (src.p[q] & 15ull) == 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long tid = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long done = 0;
    if (vec) {
        const unsigned long long nv = count / 4;
        for (unsigned long long v = tid; v < nv; v += stride) {
            float4 a = reinterpret_cast<const float4*>((const float*)src.p[0] + off)[v];
            for (int q = 1; q < n; ++q) {
                const float4 b = reinterpret_cast<const float4*>((const float*)src.p[q] + off)[v];
                a.x = combine(op, a.x, b.x); a.y = combine(op, a.y, b.y);
                a.z = combine(op, a.z, b.z); a.w = combine(op, a.w, b.w);
            }
            if (op == 1) { a.x *= scale; a.y *= scale; a.z *= scale; a.w *= scale; }
            reinterpret_cast<float4*>(dst)[v] = a;
        }
        done = nv * 4;
    }
    for (unsigned long long i = done + tid; i < count; i += stride) {
        float a = ((const float*)src.p[0])[off + i];
        for (int q = 1; q < n; ++q) a = combine(op, a, ((const float*)src.p[q])[off + i]);
        dst[i] = op == 1 ? a * scale : a;
    }
}

// The same on bf16 words, 8 per 16-byte vector.
extern "C" __global__ void reduce_bf16(Peers src, int n, unsigned long long off,
                                       unsigned short* dst, unsigned long long count, int op,
                                       float scale) {
    bool vec = ((unsigned long long)dst & 15ull) == 0 && (off & 7ull) == 0;
    for (int q = 0; q < n; ++q) vec = vec && (src.p[q] & 15ull) == 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long tid = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long done = 0;
    if (vec) {
        const unsigned long long nv = count / 8;
        for (unsigned long long v = tid; v < nv; v += stride) {
            float a[8];
            for (int q = 0; q < n; ++q) {
                const uint4 w = reinterpret_cast<const uint4*>((const unsigned short*)src.p[q] + off)[v];
                const unsigned int u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const float lo = __uint_as_float(u[k] << 16);
                    const float hi = __uint_as_float(u[k] & 0xffff0000u);
                    a[2 * k] = q == 0 ? lo : combine(op, a[2 * k], lo);
                    a[2 * k + 1] = q == 0 ? hi : combine(op, a[2 * k + 1], hi);
                }
            }
            unsigned int o[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float lo = op == 1 ? a[2 * k] * scale : a[2 * k];
                const float hi = op == 1 ? a[2 * k + 1] * scale : a[2 * k + 1];
                o[k] = bf16_bits(lo) | (bf16_bits(hi) << 16);
            }
            reinterpret_cast<uint4*>(dst)[v] = make_uint4(o[0], o[1], o[2], o[3]);
        }
        done = nv * 8;
    }
    for (unsigned long long i = done + tid; i < count; i += stride) {
        float a = bf16_f(((const unsigned short*)src.p[0])[off + i]);
        for (int q = 1; q < n; ++q)
            a = combine(op, a, bf16_f(((const unsigned short*)src.p[q])[off + i]));
        dst[i] = (unsigned short)bf16_bits(op == 1 ? a * scale : a);
    }
}

// Thread q < n writes `value` to the flag at flags.p[q] (a peer's flag word), after a fence
// that makes every earlier write of this stream visible to the peer first.
extern "C" __global__ void signal_flags(Peers flags, int n, unsigned long long value) {
    const int q = threadIdx.x;
    if (q < n) {
        __threadfence_system();
        *(volatile unsigned long long*)flags.p[q] = value;
    }
}

static __device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Thread q < n spins until the flag at flags.p[q] (this rank's own flag word) reaches
// `target`, or `timeout_ns` passed (the host's watchdog then names the late peer).
extern "C" __global__ void wait_flags(Peers flags, int n, unsigned long long target,
                                      unsigned long long timeout_ns) {
    const int q = threadIdx.x;
    if (q >= n) return;
    const unsigned long long t0 = now_ns();
    volatile unsigned long long* f = (volatile unsigned long long*)flags.p[q];
    while (*f < target) {
        if (now_ns() - t0 > timeout_ns) return;
        __nanosleep(100);
    }
    __threadfence_system();
}
