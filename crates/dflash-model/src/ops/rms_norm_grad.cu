#include "../cuda/common.cuh"

// The RMSNorm backward of `crate::ops::rms_norm_grad`.

// ---------------------------------------------------------------------------------------------
// RMSNorm backward over rows of width h (y = x * r * w, r = 1 / sqrt(mean(x^2) + eps)), f32
// arithmetic. rms_inv: r per row. rms_dx: with aux = [w (h values, f32) | r (rows)],
// dx = (g w - x r m) r, m = r * sum(g w x) / h. rms_dw: the columns' partial sums of g x r over
// `per` rows each (part [chunks, h], chunk = blockIdx.y), summed in a fixed order afterwards.
// ---------------------------------------------------------------------------------------------
template <typename T>
__device__ void rms_inv(const T* x, float* r, int h, float eps) {
    __shared__ float sh[32];
    const size_t o = (size_t)blockIdx.x * h;
    float s = 0.0f;
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        float v = ld(x, o + j);
        s += v * v;
    }
    s = block_sum(s, sh);
    if (threadIdx.x == 0) r[blockIdx.x] = 1.0f / sqrtf(s / (float)h + eps);
}

template <typename T>
__device__ void rms_dx(const T* x, const T* g, const float* aux, T* dx, int h) {
    __shared__ float sh[32];
    const size_t o = (size_t)blockIdx.x * h;
    const float r = aux[h + blockIdx.x];
    float s = 0.0f;
    for (int j = threadIdx.x; j < h; j += blockDim.x) s += ld(g, o + j) * aux[j] * ld(x, o + j);
    s = block_sum(s, sh);
    const float m = r * s / (float)h;
    for (int j = threadIdx.x; j < h; j += blockDim.x)
        st(dx, o + j, (ld(g, o + j) * aux[j] - ld(x, o + j) * r * m) * r);
}

template <typename T>
__device__ void rms_dw(const T* x, const T* g, const float* r, float* part, int rows, int h, int per) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= h) return;
    const int lo = blockIdx.y * per, hi = min(rows, lo + per);
    float s = 0.0f;
    for (int i = lo; i < hi; i++) {
        const size_t o = (size_t)i * h + j;
        s += ld(g, o) * ld(x, o) * r[i];
    }
    part[(size_t)blockIdx.y * h + j] = s;
}

#define INSTANTIATE_RMS(NAME, T)                                                                   \
    extern "C" __global__ void rms_inv_##NAME(const T* x, float* r, int h, float eps) {            \
        rms_inv<T>(x, r, h, eps);                                                                  \
    }                                                                                              \
    extern "C" __global__ void rms_dx_##NAME(const T* x, const T* g, const float* aux, T* dx,      \
        int h) {                                                                                   \
        rms_dx<T>(x, g, aux, dx, h);                                                               \
    }                                                                                              \
    extern "C" __global__ void rms_dw_##NAME(const T* x, const T* g, const float* r, float* part,  \
        int rows, int h, int per) {                                                                \
        rms_dw<T>(x, g, r, part, rows, h, per);                                                    \
    }

INSTANTIATE_RMS(f32, float)
INSTANTIATE_RMS(bf16, __nv_bfloat16)
