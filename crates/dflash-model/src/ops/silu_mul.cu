#include "../cuda/common.cuh"

// SwiGLU's gate (`silu_mul.rs`): y = silu(g) · u with s = 1 / (1 + e^−g); the backward
// dg = dy · u · s · (1 + g (1 − s)), du = dy · g · s, written as d = [dg (n) | du (n)]. f32
// arithmetic, grid-stride loops.
template <typename T>
__device__ void silu_mul_fwd(const T* g, const T* u, T* y, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float gv = ld(g, i);
        float s = 1.0f / (1.0f + expf(-gv));
        st(y, i, gv * s * ld(u, i));
    }
}

template <typename T>
__device__ void silu_mul_bwd(const T* g, const T* u, const T* dy, T* d, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float gv = ld(g, i), dv = ld(dy, i);
        float s = 1.0f / (1.0f + expf(-gv));
        st(d, i, dv * ld(u, i) * s * (1.0f + gv * (1.0f - s)));
        st(d, n + i, dv * gv * s);
    }
}

// silu(g) · u of a stacked gate/up product: row r of gu is [g (inter) | u (inter)].
template <typename T>
__device__ void silu_mul_stacked(const T* gu, T* y, unsigned long long inter, unsigned long long n) {
    // column j = blockIdx.x · blockDim.x + threadIdx.x of rows blockIdx.y, + gridDim.y, …: no
    // division per value (a 64-bit one per value makes the kernel bound by it, not by memory)
    const unsigned long long j = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (j >= inter) return;
    for (unsigned long long r = blockIdx.y; r * inter < n; r += gridDim.y) {
        float gv = ld(gu, 2 * inter * r + j);
        float s = 1.0f / (1.0f + expf(-gv));
        st(y, r * inter + j, gv * s * ld(gu, 2 * inter * r + inter + j));
    }
}

#define INSTANTIATE_SILU(NAME, T)                                                                  \
    extern "C" __global__ void silu_mul_fwd_##NAME(const T* g, const T* u, T* y,                   \
        unsigned long long n) {                                                                    \
        silu_mul_fwd<T>(g, u, y, n);                                                               \
    }                                                                                              \
    extern "C" __global__ void silu_mul_stacked_##NAME(const T* gu, T* y,                      \
        unsigned long long inter, unsigned long long n) {                                          \
        silu_mul_stacked<T>(gu, y, inter, n);                                                      \
    }                                                                                              \
    extern "C" __global__ void silu_mul_bwd_##NAME(const T* g, const T* u, const T* dy, T* d,      \
        unsigned long long n) {                                                                    \
        silu_mul_bwd<T>(g, u, dy, d, n);                                                           \
    }

INSTANTIATE_SILU(f32, float)
INSTANTIATE_SILU(bf16, __nv_bfloat16)
