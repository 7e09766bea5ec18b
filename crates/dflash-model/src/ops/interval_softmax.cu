#include "../cuda/common.cuh"

// The interval softmax of `crate::ops::interval_softmax`.

// ---------------------------------------------------------------------------------------------
// Interval softmax (the target's attention). Scores [b, hkv, g * n, t] (each sequence's rows
// `rows_per_seq` = hkv * g * n apart); row r of sequence `bi` is query row i = r % n, which sees
// keys iv[2 (bi n + i)] .. iv[2 (bi n + i) + 1]. p = softmax(scale * s) over those keys, 0
// elsewhere, in f32 arithmetic with the accurate expf (decoding compares f32 with the CPU).
// ---------------------------------------------------------------------------------------------
template <typename T>
__device__ void interval_softmax_fwd(const T* s, T* p, const uint32_t* iv, int rows_per_seq, int n,
                                     int t, float scale) {
    __shared__ float sh[32];
    size_t row = blockIdx.x;
    size_t bi = row / rows_per_seq;
    int i = row % n;
    uint32_t lo = iv[2 * (bi * n + i)], hi = iv[2 * (bi * n + i) + 1];
    size_t o = row * (size_t)t;
    float m = NEG_INF;
    for (uint32_t j = lo + threadIdx.x; j < hi; j += blockDim.x) m = fmaxf(m, ld(s, o + j) * scale);
    m = block_max(m, sh);
    float sum = 0.0f;
    for (uint32_t j = lo + threadIdx.x; j < hi; j += blockDim.x) sum += expf(ld(s, o + j) * scale - m);
    sum = block_sum(sum, sh);
    float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (uint32_t j = threadIdx.x; j < (uint32_t)t; j += blockDim.x)
        st(p, o + j, (j >= lo && j < hi) ? expf(ld(s, o + j) * scale - m) * inv : 0.0f);
}

#define INTERVAL_SOFTMAX(NAME, T)                                                                  \
    extern "C" __global__ void interval_softmax_fwd_##NAME(const T* s, T* p, const uint32_t* iv,   \
        int rows_per_seq, int n, int t, float scale) {                                             \
        interval_softmax_fwd<T>(s, p, iv, rows_per_seq, n, t, scale);                              \
    }

INTERVAL_SOFTMAX(f32, float)
INTERVAL_SOFTMAX(bf16, __nv_bfloat16)
