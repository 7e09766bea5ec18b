#include "../cuda/common.cuh"

// softmax(scores · scale + mask) per row (`crate::ops::masked_softmax`): one block per score row
// of t columns; score row r of sequence s = r / per_seq uses mask row (r mod n), plus s·n when
// the mask holds one per sequence (batched). A row with nothing visible gives zeros.
template <typename T>
__device__ void masked_softmax(const T* s, const T* mask, T* p, int t, int n, int per_seq,
                               int batched, float scale) {
    __shared__ float sh[32];
    const size_t r = blockIdx.x, o = r * t;
    const size_t mo = ((batched ? (r / per_seq) * n : 0) + (r % n)) * (size_t)t;
    float mx = NEG_INF;
    for (int c = threadIdx.x; c < t; c += blockDim.x) mx = fmaxf(mx, ld(s, o + c) * scale + ld(mask, mo + c));
    mx = block_max(mx, sh);
    float sum = 0.0f;
    if (mx != NEG_INF)
        for (int c = threadIdx.x; c < t; c += blockDim.x) sum += expf(ld(s, o + c) * scale + ld(mask, mo + c) - mx);
    sum = block_sum(sum, sh);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int c = threadIdx.x; c < t; c += blockDim.x) {
        float v = mx == NEG_INF ? 0.0f : expf(ld(s, o + c) * scale + ld(mask, mo + c) - mx) * inv;
        st(p, o + c, v);
    }
}

#define MASKED_SOFTMAX(NAME, T)                                                                    \
    extern "C" __global__ void masked_softmax_##NAME(const T* s, const T* mask, T* p, int t,       \
                                                     int n, int per_seq, int batched, float scale) { \
        masked_softmax<T>(s, mask, p, t, n, per_seq, batched, scale);                              \
    }
MASKED_SOFTMAX(f32, float)
MASKED_SOFTMAX(bf16, __nv_bfloat16)
