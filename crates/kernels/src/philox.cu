// Philox4x32-10 and the dropout mask drawn from it: the same words as philox.rs and dropout.rs,
// so a mask element is the same on the device as on the host. Compiled ahead of kernels.cu,
// whose attention kernels draw the attention-probability mask with it.

// The four output words of Philox4x32-10 for counter c under key (k0, k1) (philox.rs).
__device__ __forceinline__ uint4 philox4x32(uint4 c, unsigned int k0, unsigned int k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned int hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const unsigned int hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

// A mask's key (dropout.rs MaskKey): the seed's words, the step, micro | layer << 12 | site << 24,
// the drop threshold round(p * 2^32) and the kept value 1 / (1 - p). Passed by value.
struct DropKey {
    unsigned int k0, k1, step, tag;
    unsigned long long threshold;
    float scale;
};

// The mask value (0 or 1 / (1 - p)) of global element `index`.
__device__ __forceinline__ float drop_mask(const DropKey& key, unsigned long long index) {
    const unsigned long long quad = index >> 2;
    const uint4 w = philox4x32(make_uint4((unsigned int)quad, (unsigned int)(quad >> 32), key.step,
                                          key.tag),
                               key.k0, key.k1);
    const unsigned int i = (unsigned int)(index & 3ull);
    const unsigned int word = i == 0 ? w.x : i == 1 ? w.y : i == 2 ? w.z : w.w;
    return (unsigned long long)word >= key.threshold ? key.scale : 0.f;
}
