#include "../cuda/common.cuh"

// The residual add and the RMSNorm after it (`crate::ops::add_norm`): one block per row of
// `width` ≤ 8 · blockDim values, each thread's at most 8 values held in registers (their loads
// issued together); y [2, rows, width]: the sums (rounded to T, as the unfused add stores them)
// then norm(sum) · w, the norm computed from the rounded sums.
template <typename T>
__device__ void add_rms_norm(const T* x, const T* h, const T* w, T* y, int width, float eps) {
    __shared__ float sh[32];
    const size_t row = blockIdx.x, rows = gridDim.x, o = row * width;
    float v[8];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int c = threadIdx.x + j * blockDim.x;
        v[j] = c < width ? rnd(ld(x, o + c) + ld(h, o + c), x) : 0.0f;
        ss += v[j] * v[j];
    }
    float r = rsqrtf(block_sum(ss, sh) / width + eps);
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int c = threadIdx.x + j * blockDim.x;
        if (c < width) {
            st(y, o + c, v[j]);
            st(y, rows * width + o + c, r * v[j] * ld(w, c));
        }
    }
}

#define ADD_RMS_NORM(NAME, T)                                                                      \
    extern "C" __global__ void add_rms_norm_##NAME(const T* x, const T* h, const T* w, T* y,       \
                                                   int width, float eps) {                         \
        add_rms_norm<T>(x, h, w, y, width, eps);                                                   \
    }
ADD_RMS_NORM(f32, float)
ADD_RMS_NORM(bf16, __nv_bfloat16)
