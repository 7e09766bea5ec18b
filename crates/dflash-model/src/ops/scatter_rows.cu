#include "../cuda/common.cuh"

// A fixed-layout cache write (`crate::ops::scatter_rows`): element i = ((bh·n + j)·d + e) of the
// new rows [b·h, n, d] goes to row index[i] of buffer bh [cap, d].
template <typename T>
__device__ void scatter_rows(const T* src, const uint32_t* index, T* dst, unsigned long long n,
                             unsigned long long d, unsigned long long cap, unsigned long long total) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned long long bh = i / (n * d), e = i % d;
        dst[(bh * cap + index[i]) * d + e] = src[i];
    }
}

#define SCATTER_ROWS(NAME, T)                                                                      \
    extern "C" __global__ void scatter_rows_##NAME(const T* src, const uint32_t* index, T* dst,    \
        unsigned long long n, unsigned long long d, unsigned long long cap,                        \
        unsigned long long total) {                                                                \
        scatter_rows<T>(src, index, dst, n, d, cap, total);                                        \
    }
SCATTER_ROWS(f32, float)
SCATTER_ROWS(bf16, __nv_bfloat16)
