// Device helpers the kernel families share (src/cuda/kernels.cu gathers the families into one
// unit; each family includes what it uses, so it also compiles alone).
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#define NEG_INF __int_as_float(0xff800000)
#define POS_INF __int_as_float(0x7f800000)

// f32 arithmetic whatever the storage: loads widen to f32, stores round to T.
__device__ __forceinline__ float ld(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float ld(const __nv_bfloat16* p, size_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void st(float* p, size_t i, float x) { p[i] = x; }
__device__ __forceinline__ void st(__nv_bfloat16* p, size_t i, float x) { p[i] = __float2bfloat16(x); }

// Block-wide reductions (blockDim.x a multiple of 32, at most 1024). `sh` holds 32 floats.
__device__ float block_max(float x, float* sh) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, o));
    int w = threadIdx.x / 32, l = threadIdx.x % 32, nw = blockDim.x / 32;
    __syncthreads();
    if (l == 0) sh[w] = x;
    __syncthreads();
    x = l < nw ? sh[l] : NEG_INF;
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, o));
    return x;
}

// (f32 and f64 sums; `sh` holds 32 values of the sum's type.)
template <typename F>
__device__ F block_sum(F x, F* sh) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
    int w = threadIdx.x / 32, l = threadIdx.x % 32, nw = blockDim.x / 32;
    __syncthreads();
    if (l == 0) sh[w] = x;
    __syncthreads();
    x = l < nw ? sh[l] : F(0);
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
    return x;
}

// x rounded to the storage type of the pointer (a store and a load of T), for the kernels
// that keep f32 values but must round where the unfused ops would store.
__device__ __forceinline__ float rnd(float x, const float*) { return x; }
__device__ __forceinline__ float rnd(float x, const __nv_bfloat16*) {
    return __bfloat162float(__float2bfloat16(x));
}

// 16 bytes of T as floats: the vector loads of the attention kernels and the one-row product.
template <typename T> struct Vec16;
template <> struct Vec16<float> {
    static constexpr int N = 4;
    __device__ static void cvt(const uint4& u, float* f) {
        f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
        f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
    }
};
template <> struct Vec16<__nv_bfloat16> {
    static constexpr int N = 8;
    __device__ static void cvt(const uint4& u, float* f) {
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            f[2 * i] = __uint_as_float(w[i] << 16);
            f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
};

// The IEEE total order of an f32 (Rust's `total_cmp`) as an int, compared as ints: the key
// of the top-k and of the sampling rule's cuts.
__device__ __forceinline__ int total_key(float f) {
    int i = __float_as_int(f);
    return i ^ (int)(((unsigned)(i >> 31)) >> 1);
}
