#include "../cuda/common.cuh"

// RMSNorm rows (`crate::ops::add_norm`): one block per row of `width` ≤ 8 · blockDim values,
// each thread's at most 8 values held in registers (their loads issued together).
// ADD: the residual add first, y [2, rows, width]: the sums (rounded to T, as the unfused add
// stores them) then the normed rows, computed from the rounded sums; otherwise y [rows, width].
// ONE_PLUS: a zero-centred weight (qwen3_5), `norm(s) · (1 + w)` in f32 before the one cast,
// transformers' order; W is then f32 (the weight as `RmsNorm::zero_centred` keeps it).
// Example: width 4, s = [1, −1, 1, −1], eps 0: r = 1, w = [0, 0.5, 0, 0] → [1, −1.5, 1, −1].
template <typename T, typename W, bool ADD, bool ONE_PLUS>
__device__ void rms_norm_rows(const T* x, const T* h, const W* w, T* y, int width, float eps) {
    __shared__ float sh[32];
    const size_t row = blockIdx.x, rows = gridDim.x, o = row * width;
    float v[8];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int c = threadIdx.x + j * blockDim.x;
        float s = 0.0f;
        if (c < width) s = ADD ? rnd(ld(x, o + c) + ld(h, o + c), x) : ld(x, o + c);
        v[j] = s;
        ss += s * s;
    }
    float r = rsqrtf(block_sum(ss, sh) / width + eps);
    T* yn = ADD ? y + rows * width : y;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int c = threadIdx.x + j * blockDim.x;
        if (c < width) {
            if (ADD) st(y, o + c, v[j]);
            float wc = ld(w, c);
            st(yn, o + c, ONE_PLUS ? r * v[j] * (1.0f + wc) : r * v[j] * wc);
        }
    }
}

#define ADD_RMS_NORM(NAME, T)                                                                      \
    extern "C" __global__ void add_rms_norm_##NAME(const T* x, const T* h, const T* w, T* y,       \
                                                   int width, float eps) {                         \
        rms_norm_rows<T, T, true, false>(x, h, w, y, width, eps);                                  \
    }                                                                                              \
    extern "C" __global__ void add_rms_norm_1p_##NAME(const T* x, const T* h, const float* w,      \
                                                      T* y, int width, float eps) {                \
        rms_norm_rows<T, float, true, true>(x, h, w, y, width, eps);                               \
    }                                                                                              \
    extern "C" __global__ void rms_norm_1p_##NAME(const T* x, const float* w, T* y, int width,     \
                                                  float eps) {                                     \
        rms_norm_rows<T, float, false, true>(x, nullptr, w, y, width, eps);                        \
    }
ADD_RMS_NORM(f32, float)
ADD_RMS_NORM(bf16, __nv_bfloat16)
