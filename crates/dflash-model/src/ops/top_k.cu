#include "../cuda/common.cuh"

// The top k of each row of f32 values (`crate::ops::top_k`) in the order of
// `dflash_core::tree::top_k_sorted`: value descending by the IEEE total order (Rust's `total_cmp`),
// ties by index ascending — a total order on (value, index), so the top k of a row is the top k of
// its segments' top k. Stage 1: one block per segment of TOPK_SEG values (held in shared memory)
// picks its top k in k rounds of one block reduction, every round the best element after the
// previous round's pick in that order (no marks needed). Stage 2: one block per row does the same
// over the segments' picks.

#define TOPK_SEG 4096
#define NO_INDEX 0xffffffffu

// The block's best (key, index) after (pk, pi) (any when `first`), from each thread's candidate.
__device__ void top_k_reduce(int* sk, uint32_t* si, int bk, uint32_t bi) {
    sk[threadIdx.x] = bk;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (uint32_t s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            uint32_t oi = si[threadIdx.x + s], mi = si[threadIdx.x];
            int ok = sk[threadIdx.x + s];
            if (oi != NO_INDEX && (mi == NO_INDEX || ok > sk[threadIdx.x] || (ok == sk[threadIdx.x] && oi < mi))) {
                sk[threadIdx.x] = ok;
                si[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
}

__device__ __forceinline__ bool top_k_take(int key, uint32_t c, bool first, int pk, uint32_t pi,
                                           int bk, uint32_t bi) {
    bool after = first || key < pk || (key == pk && c > pi);
    return after && (bi == NO_INDEX || key > bk || (key == bk && c < bi));
}

extern "C" __global__ void top_k_seg_f32(const float* x, uint32_t* cand, int v, int k) {
    __shared__ int keys[TOPK_SEG];
    __shared__ int sk[256];
    __shared__ uint32_t si[256];
    const uint32_t row = blockIdx.x, seg = blockIdx.y, nseg = gridDim.y;
    const uint32_t lo = seg * TOPK_SEG, hi = min((uint32_t)v, lo + TOPK_SEG);
    const float* r = x + (size_t)row * v;
    for (uint32_t c = lo + threadIdx.x; c < hi; c += blockDim.x) keys[c - lo] = total_key(r[c]);
    __syncthreads();
    uint32_t* out = cand + ((size_t)row * nseg + seg) * k;
    int pk = 0;
    uint32_t pi = NO_INDEX;
    for (int j = 0; j < k; ++j) {
        int bk = 0;
        uint32_t bi = NO_INDEX;
        for (uint32_t c = lo + threadIdx.x; c < hi; c += blockDim.x) {
            int key = keys[c - lo];
            if (top_k_take(key, c, j == 0, pk, pi, bk, bi)) { bk = key; bi = c; }
        }
        top_k_reduce(sk, si, bk, bi);
        pk = sk[0];
        pi = si[0];
        if (threadIdx.x == 0) out[j] = pi;
        __syncthreads();
        if (pi == NO_INDEX) {  // a segment shorter than k: the rest of its picks are empty
            for (int t = j + 1 + threadIdx.x; t < k; t += blockDim.x) out[t] = NO_INDEX;
            break;
        }
    }
}

extern "C" __global__ void top_k_merge_f32(const float* x, const uint32_t* cand, uint32_t* out,
                                           int v, int nc, int k) {
    __shared__ int sk[256];
    __shared__ uint32_t si[256];
    const uint32_t row = blockIdx.x;
    const float* r = x + (size_t)row * v;
    const uint32_t* cs = cand + (size_t)row * nc;
    int pk = 0;
    uint32_t pi = NO_INDEX;
    for (int j = 0; j < k; ++j) {
        int bk = 0;
        uint32_t bi = NO_INDEX;
        for (int t = threadIdx.x; t < nc; t += blockDim.x) {
            uint32_t c = cs[t];
            if (c == NO_INDEX) continue;
            int key = total_key(r[c]);
            if (top_k_take(key, c, j == 0, pk, pi, bk, bi)) { bk = key; bi = c; }
        }
        top_k_reduce(sk, si, bk, bi);
        pk = sk[0];
        pi = si[0];
        if (threadIdx.x == 0) out[(size_t)row * k + j] = pi;
        __syncthreads();
    }
}
