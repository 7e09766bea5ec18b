#include "../cuda/common.cuh"

// The arg-max of each row of f32 values (`crate::ops::argmax`), as the host's
// `dflash_core::sampling::argmax` picks it: the first index of the largest value, NaN never chosen,
// except that a row whose first value is NaN gives 0 (the host's scan never moves off it). One
// block of 256 threads per row.
__device__ __forceinline__ bool better(float av, uint32_t ai, float bv, uint32_t bi) {
    if (isnan(av)) return false;
    return isnan(bv) || av > bv || (av == bv && ai < bi);
}

extern "C" __global__ void argmax_rows_f32(const float* x, uint32_t* out, int v) {
    __shared__ float sv[256];
    __shared__ uint32_t si[256];
    const float* row = x + (size_t)blockIdx.x * v;
    float bv = NAN;
    uint32_t bi = 0xffffffffu;
    for (uint32_t j = threadIdx.x; j < (uint32_t)v; j += blockDim.x) {
        float t = row[j];
        if (better(t, j, bv, bi)) { bv = t; bi = j; }
    }
    sv[threadIdx.x] = bv;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (uint32_t s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s && better(sv[threadIdx.x + s], si[threadIdx.x + s], sv[threadIdx.x], si[threadIdx.x])) {
            sv[threadIdx.x] = sv[threadIdx.x + s];
            si[threadIdx.x] = si[threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = (isnan(row[0]) || si[0] == 0xffffffffu) ? 0u : si[0];
}
