#include "../cuda/common.cuh"

// Partial RoPE (`rope_partial.rs`; CPU twin `RopeTables::apply_composed`): x [b, h, t, d]
// contiguous, tables [t, half] or [b, t, half] (batched). Features j < half rotate with j + half,
// half ≤ j < 2·half with j − half, the rest pass through; f32 arithmetic, one rounding.
// Example: d = 6, half = 1, angle 90° (cos 0, sin 1): [1, 2, 3, 4, 5, 6] → [−2, 1, 3, 4, 5, 6].
template <typename T>
__device__ void rope_partial(const T* x, const T* cos, const T* sin, T* y, unsigned int h,
                             unsigned int t, unsigned int d, unsigned int half, int batched,
                             unsigned long long total) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < total; i += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned int j = i % d;
        const unsigned long long row = i / d;  // (bi · h + hi) · t + ti
        const unsigned long long ti = row % t, bi = row / ((unsigned long long)t * h);
        const unsigned long long tab = (batched ? bi * t + ti : ti) * half;
        float v = ld(x, i);
        if (j < half) {
            v = v * ld(cos, tab + j) - ld(x, i + half) * ld(sin, tab + j);
        } else if (j < 2 * half) {
            const unsigned int k = j - half;
            v = v * ld(cos, tab + k) + ld(x, i - half) * ld(sin, tab + k);
        }
        st(y, i, v);
    }
}

#define ROPE_PARTIAL(NAME, T)                                                                      \
    extern "C" __global__ void rope_partial_##NAME(const T* x, const T* cos, const T* sin, T* y,   \
        unsigned int h, unsigned int t, unsigned int d, unsigned int half, int batched,            \
        unsigned long long total) {                                                                \
        rope_partial<T>(x, cos, sin, y, h, t, d, half, batched, total);                            \
    }
ROPE_PARTIAL(f32, float)
ROPE_PARTIAL(bf16, __nv_bfloat16)
