#pragma once

#include "../../cuda/common.cuh"

// ---------------------------------------------------------------------------------------------
// Sampling at T > 0 (crate::ops::sample_rows, and the sampled tree's draws and walk in
// src/ops/sampled_tree.cu): one block of 1,024 threads per row. Uniform numbers arrive as the f32
// bits of a u32 table. This header: the block's weighted draw those kernels share.
// ---------------------------------------------------------------------------------------------
// The sum of the values of the threads before this one (in thread order), and the block's total.
__device__ double block_exclusive_f64(double x, double* sh, double* total) {
    int w = threadIdx.x / 32, l = threadIdx.x % 32, nw = blockDim.x / 32;
    double inc = x;
    for (int o = 1; o < 32; o <<= 1) {
        double y = __shfl_up_sync(0xffffffff, inc, o);
        if (l >= o) inc += y;
    }
    __syncthreads();
    if (l == 31) sh[w] = inc;
    __syncthreads();
    if (w == 0) {
        double s = l < nw ? sh[l] : 0.0;
        for (int o = 1; o < 32; o <<= 1) {
            double y = __shfl_up_sync(0xffffffff, s, o);
            if (l >= o) s += y;
        }
        if (l < nw) sh[l] = s;
    }
    __syncthreads();
    double before = (w > 0 ? sh[w - 1] : 0.0) + inc - x;
    *total = sh[nw - 1];
    __syncthreads();
    return before;
}

// The token a uniform `u` picks from the weights `wt(i)`, i < v (not normalised, zeros skipped),
// as `dflash_core::acceptance::pick`: the first token whose cumulative weight (in token order)
// exceeds u · Σ w, else the last token of non-zero weight (0 if none). Each thread holds one
// contiguous chunk of tokens; the thread whose chunk spans u · Σ w walks it.
template <typename W>
__device__ uint32_t block_pick(const W& wt, int v, float u, double* sh) {
    __shared__ int found, last_nz;
    int chunk = (v + blockDim.x - 1) / blockDim.x;
    int lo = min(v, (int)threadIdx.x * chunk), hi = min(v, lo + chunk);
    double part = 0.0;
    int last = -1;
    for (int i = lo; i < hi; ++i) {
        float x = wt(i);
        if (x > 0.f) { part += (double)x; last = i; }
    }
    if (threadIdx.x == 0) { found = 0x7fffffff; last_nz = -1; }
    double total;
    double before = block_exclusive_f64(part, sh, &total);  // its barriers order the resets
    double target = (double)u * total;
    if (last >= 0) atomicMax(&last_nz, last);
    if (last >= 0 && before <= target && target < before + part) {
        // the walk's sums round apart from `part`'s: past its end, the chunk's last token
        double acc = before;
        int pick = last;
        for (int i = lo; i < hi; ++i) {
            float x = wt(i);
            if (x > 0.f) {
                acc += (double)x;
                if (target < acc) { pick = i; break; }
            }
        }
        atomicMin(&found, pick);
    }
    __syncthreads();
    int r = found != 0x7fffffff ? found : (last_nz >= 0 ? last_nz : 0);
    __syncthreads();
    return (uint32_t)r;
}

struct RowWeights {
    const float* w;
    __device__ float operator()(int i) const { return w[i]; }
};

struct Residual {
    const float* p;
    const float* q;
    __device__ float operator()(int i) const { return fmaxf(p[i] - q[i], 0.f); }
};
