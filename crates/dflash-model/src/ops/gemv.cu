#include "../cuda/common.cuh"

// y = x · Wᵀ for one row x [K] and W [O, K] (`crate::ops::gemv`): warp o of the grid computes
// y[o]; lanes take 16-byte vectors i = lane, lane + 32, … of W's row o and of x (K a multiple
// of 8), four loads in flight; f32 sums reduced by shuffles. Y = T, or f32 holding the value
// rounded to T (`gemv_wide_bf16`: the product a bf16 model then widens, in one kernel).
template <typename T, typename Y>
__device__ void gemv(const T* x, const T* w, Y* y, int K, int O) {
    constexpr int VN = Vec16<T>::N;
    const int o = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (o >= O) return;
    const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)o * K);
    const uint4* xr = reinterpret_cast<const uint4*>(x);
    const int nv = K / VN;
    float acc = 0.0f;
#pragma unroll 4
    for (int i = lane; i < nv; i += 32) {
        uint4 wv = __ldg(wr + i), xv = __ldg(xr + i);
        float wf[VN], xf[VN];
        Vec16<T>::cvt(wv, wf);
        Vec16<T>::cvt(xv, xf);
#pragma unroll
        for (int j = 0; j < VN; j++) acc += wf[j] * xf[j];
    }
    for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
    if (lane != 0) return;
    if constexpr (sizeof(Y) == sizeof(T)) st(y, o, acc);
    else st(y, o, rnd(acc, x));
}

#define GEMV(NAME, T)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) gemv_##NAME(const T* x, const T* w, T* y,   \
                                                                  int K, int O) {                  \
        gemv<T, T>(x, w, y, K, O);                                                                 \
    }
GEMV(f32, float)
GEMV(bf16, __nv_bfloat16)
extern "C" __global__ void __launch_bounds__(256) gemv_wide_bf16(const __nv_bfloat16* x,
                                                                 const __nv_bfloat16* w, float* y,
                                                                 int K, int O) {
    gemv<__nv_bfloat16, float>(x, w, y, K, O);
}
