#include "../cuda/common.cuh"

// A contiguous copy of a strided view (`permute.rs`): output value i (in order) is the view's
// value at its coordinates, found with 32-bit divisions over at most 6 dimensions (candle's
// copy divides in 64 bits: ~10x slower on a head transpose). `sh` = rank, start offset, dims,
// strides (innermost last).
struct Strided6 {
    int rank, offset;
    int dims[6], strides[6];
};

template <typename T>
__device__ void strided_copy(const T* src, T* dst, unsigned int n, Strided6 sh) {
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        unsigned int r = i;
        long long o = sh.offset;
        for (int k = sh.rank - 1; k >= 0; k--) {
            unsigned int d = (unsigned int)sh.dims[k];
            o += (long long)(r % d) * sh.strides[k];
            r /= d;
        }
        dst[i] = src[o];
    }
}

extern "C" __global__ void strided_copy_f32(const float* src, float* dst, unsigned int n, Strided6 sh) {
    strided_copy<float>(src, dst, n, sh);
}
extern "C" __global__ void strided_copy_bf16(const __nv_bfloat16* src, __nv_bfloat16* dst,
    unsigned int n, Strided6 sh) {
    strided_copy<__nv_bfloat16>(src, dst, n, sh);
}
// The same walk over 16-byte vectors, for views whose innermost dimension is contiguous and
// whose vectors are whole and aligned (`permute.rs` checks; `sh` and `n` then count vectors):
// one index walk per 8 bf16 or 4 f32 values and 16-byte loads and stores. Example: a
// `[1, 8192, 32, 128]` bf16 head transpose walks 4.2 M vectors instead of 33.6 M values.
extern "C" __global__ void strided_copy_v16_f32(const uint4* src, uint4* dst, unsigned int n, Strided6 sh) {
    strided_copy<uint4>(src, dst, n, sh);
}
extern "C" __global__ void strided_copy_v16_bf16(const uint4* src, uint4* dst, unsigned int n, Strided6 sh) {
    strided_copy<uint4>(src, dst, n, sh);
}
