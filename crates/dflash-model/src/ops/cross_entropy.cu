#include "../cuda/common.cuh"

// The fused cross-entropy of `crate::ops::cross_entropy`.

// ---------------------------------------------------------------------------------------------
// Cross-entropy over rows of logits [n, v]. Forward: for row i with label y_i, out[3i .. 3i+3] =
// (lse_i - x_i[y_i], argmax_i, lse_i) in f32 (the argmax as an exact float: v < 2^24).
// Backward: aux[4i .. 4i+4] = (loss, argmax, lse, g_i), dx_ij = g_i * (exp(x_ij - lse_i) - [j = y_i]).
// ---------------------------------------------------------------------------------------------
template <typename T>
__device__ void ce_fwd(const T* x, const uint32_t* labels, float* out, int v) {
    __shared__ float sh[32];
    __shared__ float shi[32];
    size_t row = blockIdx.x;
    const size_t o = row * (size_t)v;
    float m = NEG_INF;
    int am = 0x7fffffff;
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        float t = ld(x, o + j);
        if (t > m) { m = t; am = j; }
    }
    // arg-max: the largest value, the smallest index among equals
    for (int off = 16; off > 0; off >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffff, m, off);
        int a2 = __shfl_xor_sync(0xffffffff, am, off);
        if (m2 > m || (m2 == m && a2 < am)) { m = m2; am = a2; }
    }
    int w = threadIdx.x / 32, l = threadIdx.x % 32, nw = blockDim.x / 32;
    __syncthreads();
    if (l == 0) { sh[w] = m; shi[w] = __int_as_float(am); }
    __syncthreads();
    m = l < nw ? sh[l] : NEG_INF;
    am = l < nw ? __float_as_int(shi[l]) : 0x7fffffff;
    for (int off = 16; off > 0; off >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffff, m, off);
        int a2 = __shfl_xor_sync(0xffffffff, am, off);
        if (m2 > m || (m2 == m && a2 < am)) { m = m2; am = a2; }
    }
    float s = 0.0f;
    for (int j = threadIdx.x; j < v; j += blockDim.x) s += __expf(ld(x, o + j) - m);
    s = block_sum(s, sh);
    if (threadIdx.x == 0) {
        float lse = m + logf(s);
        uint32_t y = labels[row];
        out[3 * row] = lse - ld(x, o + y);
        out[3 * row + 1] = (float)am;
        out[3 * row + 2] = lse;
    }
}

template <typename T>
__device__ void ce_bwd(const T* x, const uint32_t* labels, const float* aux, T* dx, int v) {
    size_t row = blockIdx.x;
    const size_t o = row * (size_t)v;
    float lse = aux[4 * row + 2], g = aux[4 * row + 3];
    uint32_t y = labels[row];
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        float pr = __expf(ld(x, o + j) - lse);
        st(dx, o + j, g * (pr - (j == (int)y ? 1.0f : 0.0f)));
    }
}

#define CROSS_ENTROPY(NAME, T)                                                                     \
    extern "C" __global__ void ce_fwd_##NAME(const T* x, const uint32_t* labels, float* out, int v) {\
        ce_fwd<T>(x, labels, out, v);                                                              \
    }                                                                                              \
    extern "C" __global__ void ce_bwd_##NAME(const T* x, const uint32_t* labels, const float* aux, \
        T* dx, int v) {                                                                            \
        ce_bwd<T>(x, labels, aux, dx, v);                                                          \
    }

CROSS_ENTROPY(f32, float)
CROSS_ENTROPY(bf16, __nv_bfloat16)
