#include "../cuda/common.cuh"

// The sum of squares of n values in f32 (`sq_sum.rs`): each block of 256 threads sums its
// grid-stride share and writes one partial; the partials are summed after.
template <typename T>
__device__ void sq_sum(const T* x, float* partial, unsigned long long n) {
    __shared__ float sh[32];
    float acc = 0.0f;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float v = ld(x, i);
        acc += v * v;
    }
    float total = block_sum(acc, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

extern "C" __global__ void sq_sum_f32(const float* x, float* partial, unsigned long long n) {
    sq_sum<float>(x, partial, n);
}

extern "C" __global__ void sq_sum_bf16(const __nv_bfloat16* x, float* partial, unsigned long long n) {
    sq_sum<__nv_bfloat16>(x, partial, n);
}
