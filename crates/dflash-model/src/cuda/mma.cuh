// The tensor-core primitives of the attention kernels (`ops/mma_attention.cu` and the training
// backward `ops/train_attention/kernels.cu`): bf16 pairs, the m16n8k16 product, cp.async and
// the span of a warp's rows' intervals.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&p);
}

__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int bytes) {
    uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}

// The union [wlo, whi) of the non-empty intervals [la, ha), [lb, hb) of a warp's rows (empty:
// wlo ≥ whi), widened into the block's `span` (two words, reset by the caller) by lane 0.
__device__ __forceinline__ void warp_span(uint32_t la, uint32_t ha, uint32_t lb, uint32_t hb,
                                          uint32_t& wlo, uint32_t& whi, uint32_t* span) {
    wlo = 0xffffffffu;
    whi = 0;
    if (la < ha) {
        wlo = la;
        whi = ha;
    }
    if (lb < hb) {
        wlo = min(wlo, lb);
        whi = max(whi, hb);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        wlo = min(wlo, __shfl_xor_sync(0xffffffffu, wlo, o));
        whi = max(whi, __shfl_xor_sync(0xffffffffu, whi, o));
    }
    if ((threadIdx.x & 31) == 0 && wlo < whi) {
        atomicMin(&span[0], wlo);
        atomicMax(&span[1], whi);
    }
}

// TRAIN (VERIFY false): four interval words per row (two intervals) and the log-sum-exp out.
