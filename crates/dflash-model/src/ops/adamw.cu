#include "../cuda/common.cuh"

// AdamW (`crate::ops::adamw`), f32 master weights, element-wise with a grid-stride loop. Every
// operation is rounded as the CPU twin rounds it (`x * mul + add` as two IEEE operations, no fused
// multiply-add), so the two agree bit for bit. `mv` holds the first moments (n values), then the
// second.
__device__ __forceinline__ float aff(float x, float mul, float add) {
    return __fadd_rn(__fmul_rn(x, mul), add);
}

// The moments, then the weights from them, in one pass; `scaled`: the gradient is first
// multiplied by the clip's factor `gs` (as `g * s` rounds); the gradient is f32 or bf16
// (widened exactly, as a cast to f32 would); with `has` the weights' bf16 compute copy too,
// rounded as a cast rounds.
template <typename G>
__device__ void adamw_fused(float* p, float* mv, const G* g, unsigned long long n, float b1,
    float omb1, float b2, float omb2, unsigned int scaled, float gs, float inv_c1, float inv_c2,
    float eps, float decay, float lr, __nv_bfloat16* copy, unsigned int has) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float g0 = ld(g, i);
        float gi = scaled ? aff(g0, gs, 0.0f) : g0;
        float m = __fadd_rn(aff(mv[i], b1, 0.0f), aff(gi, omb1, 0.0f));
        float v = __fadd_rn(aff(mv[n + i], b2, 0.0f), aff(__fmul_rn(gi, gi), omb2, 0.0f));
        mv[i] = m;
        mv[n + i] = v;
        float upd = __fdiv_rn(aff(m, inv_c1, 0.0f), aff(__fsqrt_rn(aff(v, inv_c2, 0.0f)), 1.0f, eps));
        float w = __fsub_rn(aff(p[i], decay, 0.0f), aff(upd, lr, 0.0f));
        p[i] = w;
        if (has) copy[i] = __float2bfloat16(w);
    }
}

#define ADAMW_FUSED(NAME, G)                                                                       \
    extern "C" __global__ void NAME(float* p, float* mv, const G* g, unsigned long long n,         \
        float b1, float omb1, float b2, float omb2, unsigned int scaled, float gs, float inv_c1,   \
        float inv_c2, float eps, float decay, float lr, __nv_bfloat16* copy, unsigned int has) {   \
        adamw_fused<G>(p, mv, g, n, b1, omb1, b2, omb2, scaled, gs, inv_c1, inv_c2, eps, decay,  \
            lr, copy, has);                                                                        \
    }
ADAMW_FUSED(adamw_fused_f32, float)
ADAMW_FUSED(adamw_fused_bf16, __nv_bfloat16)
