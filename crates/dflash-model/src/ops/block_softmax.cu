#include "../cuda/common.cuh"

// ---------------------------------------------------------------------------------------------
// Block softmax (`crate::ops::block_softmax`). A window of the drafter's training attention has
// `rw` query rows (whole blocks of `bs` rows, `nbw` blocks), `hkv` K/V heads with `g` query heads
// each, `kw` context keys. Scores come in two tensors, as the matmuls produce them:
//   ctx: [hkv, g, rw, kw]          row (h, gi, r) at ((h*g + gi)*rw + r)*kw
//   blk: [hkv, nbw, g, bs, bs]     row (h, gi, r) at (((h*nbw + r/bs)*g + gi)*bs + r%bs)*bs
// `iv[4r .. 4r+4]` = (ctx lo, ctx hi, blk lo, blk hi): the visible columns of row r in each part
// (the draft rule, `dflash_core::visibility::draft_training_parts`). The probabilities
// softmax(scale * [ctx | blk]) over the visible columns (0 elsewhere) go to `p`, the ctx part
// first (n_ctx = hkv*g*rw*kw values) then the blk part, each in its input layout.
// ---------------------------------------------------------------------------------------------
// This block's score row (h, gi, r) = blockIdx.x: r, and the offsets of its context part (a0),
// its own-block part (b0) and the size of the context part (n_ctx), in the layouts above.
struct BlockRow {
    int r;
    size_t a0, b0, n_ctx;
};

__device__ BlockRow block_row(int g, int rw, int kw, int bs, int nbw) {
    size_t row = blockIdx.x;
    int r = row % rw;
    size_t hg = row / rw;
    int gi = hg % g;
    size_t h = hg / g;
    BlockRow w;
    w.r = r;
    w.a0 = row * kw;
    w.b0 = (((h * nbw + r / bs) * g + gi) * bs + r % bs) * bs;
    w.n_ctx = (size_t)gridDim.x * kw;
    return w;
}

template <typename T>
__device__ void block_softmax_fwd(const T* ctx, const T* blk, T* p, const uint32_t* iv, int g,
                                  int rw, int kw, int bs, int nbw, float scale) {
    __shared__ float sh[32];
    const BlockRow w = block_row(g, rw, kw, bs, nbw);
    const int r = w.r;
    const size_t n_ctx = w.n_ctx, a0 = w.a0, b0 = w.b0;
    uint32_t c_lo = iv[4 * r], c_hi = iv[4 * r + 1], k_lo = iv[4 * r + 2], k_hi = iv[4 * r + 3];
    float m = NEG_INF;
    for (uint32_t i = c_lo + threadIdx.x; i < c_hi; i += blockDim.x) m = fmaxf(m, ld(ctx, a0 + i) * scale);
    for (uint32_t i = k_lo + threadIdx.x; i < k_hi; i += blockDim.x) m = fmaxf(m, ld(blk, b0 + i) * scale);
    m = block_max(m, sh);
    float s = 0.0f;
    for (uint32_t i = c_lo + threadIdx.x; i < c_hi; i += blockDim.x) s += __expf(ld(ctx, a0 + i) * scale - m);
    for (uint32_t i = k_lo + threadIdx.x; i < k_hi; i += blockDim.x) s += __expf(ld(blk, b0 + i) * scale - m);
    s = block_sum(s, sh);
    float inv = s > 0.0f ? 1.0f / s : 0.0f;
    for (uint32_t i = threadIdx.x; i < (uint32_t)kw; i += blockDim.x)
        st(p, a0 + i, (i >= c_lo && i < c_hi) ? __expf(ld(ctx, a0 + i) * scale - m) * inv : 0.0f);
    for (uint32_t i = threadIdx.x; i < (uint32_t)bs; i += blockDim.x)
        st(p, n_ctx + b0 + i, (i >= k_lo && i < k_hi) ? __expf(ld(blk, b0 + i) * scale - m) * inv : 0.0f);
}

// The backward: with P the probabilities (layout of `block_softmax_fwd`'s output) and dP their
// gradient (two tensors, the scores' layouts), dS = scale * P * (dP - sum_row(P * dP)) into `ds`
// (P's layout). Hidden columns have P = 0, hence dS = 0.
template <typename T>
__device__ void block_softmax_bwd(const T* p, const T* dctx, const T* dblk, T* ds, int g, int rw,
                                  int kw, int bs, int nbw, float scale) {
    __shared__ float sh[32];
    const BlockRow w = block_row(g, rw, kw, bs, nbw);
    const size_t n_ctx = w.n_ctx, a0 = w.a0, b0 = w.b0;
    float s = 0.0f;
    for (int i = threadIdx.x; i < kw; i += blockDim.x) s += ld(p, a0 + i) * ld(dctx, a0 + i);
    for (int i = threadIdx.x; i < bs; i += blockDim.x) s += ld(p, n_ctx + b0 + i) * ld(dblk, b0 + i);
    s = block_sum(s, sh);
    for (int i = threadIdx.x; i < kw; i += blockDim.x)
        st(ds, a0 + i, scale * ld(p, a0 + i) * (ld(dctx, a0 + i) - s));
    for (int i = threadIdx.x; i < bs; i += blockDim.x)
        st(ds, n_ctx + b0 + i, scale * ld(p, n_ctx + b0 + i) * (ld(dblk, b0 + i) - s));
}

#define BLOCK_SOFTMAX(NAME, T)                                                                     \
    extern "C" __global__ void block_softmax_fwd_##NAME(const T* ctx, const T* blk, T* p,          \
        const uint32_t* iv, int g, int rw, int kw, int bs, int nbw, float scale) {                 \
        block_softmax_fwd<T>(ctx, blk, p, iv, g, rw, kw, bs, nbw, scale);                          \
    }                                                                                              \
    extern "C" __global__ void block_softmax_bwd_##NAME(const T* p, const T* dctx, const T* dblk,  \
        T* ds, int g, int rw, int kw, int bs, int nbw, float scale) {                              \
        block_softmax_bwd<T>(p, dctx, dblk, ds, g, rw, kw, bs, nbw, scale);                        \
    }

BLOCK_SOFTMAX(f32, float)
BLOCK_SOFTMAX(bf16, __nv_bfloat16)
