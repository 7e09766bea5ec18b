// dflash-rs's own kernels: training (the block-masked softmax of the drafter's attention, the
// fused cross-entropy, the RMSNorm and SwiGLU backwards, AdamW), the target's attention (the
// interval softmax, the interval, decode and prefill attention kernels — the last in
// mma_attn.cuh, included at the end), the decode layer's fused kernels and the Gated DeltaNet
// rule. Compiled to PTX by build.rs (feature `cuda`), loaded through `crate::cuda::ptx`. The CPU
// twin of every kernel lives in the Rust module that launches it (`crate::ops::*`);
// `crate::cuda::kernel_check` compares the two.
//
// Most element-wise and row kernels: one CUDA block per row, a strided loop per thread, block
// reductions through warp shuffles and one shared-memory slot per warp. Arithmetic in f32
// whatever the storage.

#include <cuda_bf16.h>
#include <stdint.h>

#define NEG_INF __int_as_float(0xff800000)
#define POS_INF __int_as_float(0x7f800000)

__device__ __forceinline__ float ld(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float ld(const __nv_bfloat16* p, size_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void st(float* p, size_t i, float x) { p[i] = x; }
__device__ __forceinline__ void st(__nv_bfloat16* p, size_t i, float x) { p[i] = __float2bfloat16(x); }

// Block-wide reductions (blockDim.x a multiple of 32, at most 1024). `sh` holds 32 floats.
__device__ float block_max(float x, float* sh) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, o));
    int w = threadIdx.x / 32, l = threadIdx.x % 32, nw = blockDim.x / 32;
    __syncthreads();
    if (l == 0) sh[w] = x;
    __syncthreads();
    x = l < nw ? sh[l] : NEG_INF;
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, o));
    return x;
}

// (f32 and f64 sums; `sh` holds 32 values of the sum's type.)
template <typename F>
__device__ F block_sum(F x, F* sh) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
    int w = threadIdx.x / 32, l = threadIdx.x % 32, nw = blockDim.x / 32;
    __syncthreads();
    if (l == 0) sh[w] = x;
    __syncthreads();
    x = l < nw ? sh[l] : F(0);
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
    return x;
}

// ---------------------------------------------------------------------------------------------
// Block softmax. A window of the drafter's training attention has `rw` query rows (whole blocks
// of `bs` rows, `nbw` blocks), `hkv` K/V heads with `g` query heads each, `kw` context keys.
// Scores come in two tensors, as the matmuls produce them:
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

// ---------------------------------------------------------------------------------------------
// Cross-entropy over rows of logits [n, v]. Forward: for row i with label y_i, out[3i .. 3i+3] =
// (lse_i - x_i[y_i], argmax_i, lse_i) in f32 (the argmax as an exact float: v < 2^24).
// Backward: aux[4i .. 4i+4] = (loss, argmax, lse, g_i), dx_ij = g_i * (exp(x_ij - lse_i) - [j = y_i]).
// ---------------------------------------------------------------------------------------------
template <typename T>
__device__ void ce_fwd(const T* x, const uint32_t* labels, float* out, int v) {
    __shared__ float sh[32];
    __shared__ float shi[32];
    size_t row = blockIdx.x;
    const size_t o = row * (size_t)v;
    float m = NEG_INF;
    int am = 0x7fffffff;
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        float t = ld(x, o + j);
        if (t > m) { m = t; am = j; }
    }
    // arg-max: the largest value, the smallest index among equals
    for (int off = 16; off > 0; off >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffff, m, off);
        int a2 = __shfl_xor_sync(0xffffffff, am, off);
        if (m2 > m || (m2 == m && a2 < am)) { m = m2; am = a2; }
    }
    int w = threadIdx.x / 32, l = threadIdx.x % 32, nw = blockDim.x / 32;
    __syncthreads();
    if (l == 0) { sh[w] = m; shi[w] = __int_as_float(am); }
    __syncthreads();
    m = l < nw ? sh[l] : NEG_INF;
    am = l < nw ? __float_as_int(shi[l]) : 0x7fffffff;
    for (int off = 16; off > 0; off >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffff, m, off);
        int a2 = __shfl_xor_sync(0xffffffff, am, off);
        if (m2 > m || (m2 == m && a2 < am)) { m = m2; am = a2; }
    }
    float s = 0.0f;
    for (int j = threadIdx.x; j < v; j += blockDim.x) s += __expf(ld(x, o + j) - m);
    s = block_sum(s, sh);
    if (threadIdx.x == 0) {
        float lse = m + logf(s);
        uint32_t y = labels[row];
        out[3 * row] = lse - ld(x, o + y);
        out[3 * row + 1] = (float)am;
        out[3 * row + 2] = lse;
    }
}

template <typename T>
__device__ void ce_bwd(const T* x, const uint32_t* labels, const float* aux, T* dx, int v) {
    size_t row = blockIdx.x;
    const size_t o = row * (size_t)v;
    float lse = aux[4 * row + 2], g = aux[4 * row + 3];
    uint32_t y = labels[row];
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        float pr = __expf(ld(x, o + j) - lse);
        st(dx, o + j, g * (pr - (j == (int)y ? 1.0f : 0.0f)));
    }
}

// ---------------------------------------------------------------------------------------------
// Interval softmax (the target's attention). Scores [b, hkv, g * n, t] (each sequence's rows
// `rows_per_seq` = hkv * g * n apart); row r of sequence `bi` is query row i = r % n, which sees
// keys iv[2 (bi n + i)] .. iv[2 (bi n + i) + 1]. p = softmax(scale * s) over those keys, 0
// elsewhere, in f32 arithmetic with the accurate expf (decoding compares f32 with the CPU).
// ---------------------------------------------------------------------------------------------
template <typename T>
__device__ void interval_softmax_fwd(const T* s, T* p, const uint32_t* iv, int rows_per_seq, int n,
                                     int t, float scale) {
    __shared__ float sh[32];
    size_t row = blockIdx.x;
    size_t bi = row / rows_per_seq;
    int i = row % n;
    uint32_t lo = iv[2 * (bi * n + i)], hi = iv[2 * (bi * n + i) + 1];
    size_t o = row * (size_t)t;
    float m = NEG_INF;
    for (uint32_t j = lo + threadIdx.x; j < hi; j += blockDim.x) m = fmaxf(m, ld(s, o + j) * scale);
    m = block_max(m, sh);
    float sum = 0.0f;
    for (uint32_t j = lo + threadIdx.x; j < hi; j += blockDim.x) sum += expf(ld(s, o + j) * scale - m);
    sum = block_sum(sum, sh);
    float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (uint32_t j = threadIdx.x; j < (uint32_t)t; j += blockDim.x)
        st(p, o + j, (j >= lo && j < hi) ? expf(ld(s, o + j) * scale - m) * inv : 0.0f);
}

// ---------------------------------------------------------------------------------------------
// RMSNorm backward over rows of width h (y = x * r * w, r = 1 / sqrt(mean(x^2) + eps)), f32
// arithmetic. rms_inv: r per row. rms_dx: with aux = [w (h values, f32) | r (rows)],
// dx = (g w - x r m) r, m = r * sum(g w x) / h. rms_dw: the columns' partial sums of g x r over
// `per` rows each (part [chunks, h], chunk = blockIdx.y), summed in a fixed order afterwards.
// ---------------------------------------------------------------------------------------------
template <typename T>
__device__ void rms_inv(const T* x, float* r, int h, float eps) {
    __shared__ float sh[32];
    const size_t o = (size_t)blockIdx.x * h;
    float s = 0.0f;
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        float v = ld(x, o + j);
        s += v * v;
    }
    s = block_sum(s, sh);
    if (threadIdx.x == 0) r[blockIdx.x] = 1.0f / sqrtf(s / (float)h + eps);
}

template <typename T>
__device__ void rms_dx(const T* x, const T* g, const float* aux, T* dx, int h) {
    __shared__ float sh[32];
    const size_t o = (size_t)blockIdx.x * h;
    const float r = aux[h + blockIdx.x];
    float s = 0.0f;
    for (int j = threadIdx.x; j < h; j += blockDim.x) s += ld(g, o + j) * aux[j] * ld(x, o + j);
    s = block_sum(s, sh);
    const float m = r * s / (float)h;
    for (int j = threadIdx.x; j < h; j += blockDim.x)
        st(dx, o + j, (ld(g, o + j) * aux[j] - ld(x, o + j) * r * m) * r);
}

template <typename T>
__device__ void rms_dw(const T* x, const T* g, const float* r, float* part, int rows, int h, int per) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= h) return;
    const int lo = blockIdx.y * per, hi = min(rows, lo + per);
    float s = 0.0f;
    for (int i = lo; i < hi; i++) {
        const size_t o = (size_t)i * h + j;
        s += ld(g, o) * ld(x, o) * r[i];
    }
    part[(size_t)blockIdx.y * h + j] = s;
}

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

// SwiGLU's gate (`silu_mul.rs`): y = silu(g) · u with s = 1 / (1 + e^−g); the backward
// dg = dy · u · s · (1 + g (1 − s)), du = dy · g · s, written as d = [dg (n) | du (n)]. f32
// arithmetic, grid-stride loops.
template <typename T>
__device__ void silu_mul_fwd(const T* g, const T* u, T* y, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float gv = ld(g, i);
        float s = 1.0f / (1.0f + expf(-gv));
        st(y, i, gv * s * ld(u, i));
    }
}

template <typename T>
__device__ void silu_mul_bwd(const T* g, const T* u, const T* dy, T* d, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float gv = ld(g, i), dv = ld(dy, i);
        float s = 1.0f / (1.0f + expf(-gv));
        st(d, i, dv * ld(u, i) * s * (1.0f + gv * (1.0f - s)));
        st(d, n + i, dv * gv * s);
    }
}

// silu(g) · u of a stacked gate/up product: row r of gu is [g (inter) | u (inter)].
template <typename T>
__device__ void silu_mul_stacked(const T* gu, T* y, unsigned long long inter, unsigned long long n) {
    // column j = blockIdx.x · blockDim.x + threadIdx.x of rows blockIdx.y, + gridDim.y, …: no
    // division per value (a 64-bit one held a prefill's SwiGLU to 454 GB/s on the H200)
    const unsigned long long j = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (j >= inter) return;
    for (unsigned long long r = blockIdx.y; r * inter < n; r += gridDim.y) {
        float gv = ld(gu, 2 * inter * r + j);
        float s = 1.0f / (1.0f + expf(-gv));
        st(y, r * inter + j, gv * s * ld(gu, 2 * inter * r + inter + j));
    }
}

#define INSTANTIATE_SILU(NAME, T)                                                                  \
    extern "C" __global__ void silu_mul_fwd_##NAME(const T* g, const T* u, T* y,                   \
        unsigned long long n) {                                                                    \
        silu_mul_fwd<T>(g, u, y, n);                                                               \
    }                                                                                              \
    extern "C" __global__ void silu_mul_stacked_##NAME(const T* gu, T* y,                      \
        unsigned long long inter, unsigned long long n) {                                          \
        silu_mul_stacked<T>(gu, y, inter, n);                                                      \
    }                                                                                              \
    extern "C" __global__ void silu_mul_bwd_##NAME(const T* g, const T* u, const T* dy, T* d,      \
        unsigned long long n) {                                                                    \
        silu_mul_bwd<T>(g, u, dy, d, n);                                                           \
    }

INSTANTIATE_SILU(f32, float)
INSTANTIATE_SILU(bf16, __nv_bfloat16)

#define INSTANTIATE_RMS(NAME, T)                                                                   \
    extern "C" __global__ void rms_inv_##NAME(const T* x, float* r, int h, float eps) {            \
        rms_inv<T>(x, r, h, eps);                                                                  \
    }                                                                                              \
    extern "C" __global__ void rms_dx_##NAME(const T* x, const T* g, const float* aux, T* dx,      \
        int h) {                                                                                   \
        rms_dx<T>(x, g, aux, dx, h);                                                               \
    }                                                                                              \
    extern "C" __global__ void rms_dw_##NAME(const T* x, const T* g, const float* r, float* part,  \
        int rows, int h, int per) {                                                                \
        rms_dw<T>(x, g, r, part, rows, h, per);                                                    \
    }

INSTANTIATE_RMS(f32, float)
INSTANTIATE_RMS(bf16, __nv_bfloat16)

#define INSTANTIATE(NAME, T)                                                                       \
    extern "C" __global__ void block_softmax_fwd_##NAME(const T* ctx, const T* blk, T* p,          \
        const uint32_t* iv, int g, int rw, int kw, int bs, int nbw, float scale) {                 \
        block_softmax_fwd<T>(ctx, blk, p, iv, g, rw, kw, bs, nbw, scale);                          \
    }                                                                                              \
    extern "C" __global__ void block_softmax_bwd_##NAME(const T* p, const T* dctx, const T* dblk,  \
        T* ds, int g, int rw, int kw, int bs, int nbw, float scale) {                              \
        block_softmax_bwd<T>(p, dctx, dblk, ds, g, rw, kw, bs, nbw, scale);                        \
    }                                                                                              \
    extern "C" __global__ void ce_fwd_##NAME(const T* x, const uint32_t* labels, float* out, int v) { \
        ce_fwd<T>(x, labels, out, v);                                                              \
    }                                                                                              \
    extern "C" __global__ void ce_bwd_##NAME(const T* x, const uint32_t* labels, const float* aux, \
        T* dx, int v) {                                                                            \
        ce_bwd<T>(x, labels, aux, dx, v);                                                          \
    }                                                                                              \
    extern "C" __global__ void interval_softmax_fwd_##NAME(const T* s, T* p, const uint32_t* iv,   \
        int rows_per_seq, int n, int t, float scale) {                                             \
        interval_softmax_fwd<T>(s, p, iv, rows_per_seq, n, t, scale);                              \
    }

INSTANTIATE(f32, float)
INSTANTIATE(bf16, __nv_bfloat16)

// ---------------------------------------------------------------------------------------------
// Attention of a few query rows over a cache, each row over one interval of keys (decoding: AR
// steps of many slots, a chain's verify), in one pass over K and V: `crate::ops::interval_attention`.
// Grid (b · hkv, splits, groups), 128 threads (4 warps). The R = g · n query rows that share K/V
// head h of sequence s (g = hq / hkv; row r is query head h·g + r / n at query row r % n) are
// cut into groups of 4 · RW rows (RW = 1: R ≤ 4, one group; RW = 4: 16 rows per block, so a
// 16-row verify of 4 grouped heads spreads over 4 blocks per split instead of 1). A block holds
// group z's rows, walks split j of the union of the sequence's intervals in tiles of 64 keys (32
// when RW > 1) staged in shared memory as f32 (16-byte loads, the next tile's in registers
// during this one's math; K padded to D + 1 floats: one lane per key, no bank conflicts) and
// keeps an online softmax per row (warp w owns rows r0 + w, r0 + w + 4, …, at most RW of them;
// lane c owns output dims c, c + 32, …).
// One split: the normalised output `[b, n, hq · D]`; several: each split's (acc, m, l) to `part`
// (`[b·hkv, splits, R, D + 2]` f32), merged by interval_attn_merge. q is contiguous `[b, hq, n,
// D]`; K/V element (s, h, c, e) at s·hkv·hs + h·hs + c·D + e (a cache's buffer read in place).
template <typename T> struct Vec16;  // 16 bytes of T
template <> struct Vec16<float> {
    static constexpr int N = 4;
    __device__ static void cvt(const uint4& u, float* f) {
        f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
        f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
    }
};
template <> struct Vec16<__nv_bfloat16> {
    static constexpr int N = 8;
    __device__ static void cvt(const uint4& u, float* f) {
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            f[2 * i] = __uint_as_float(w[i] << 16);
            f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
};

template <typename T, int D, int RW>
__device__ void interval_attn(const T* q, const T* k, const T* v, const uint32_t* iv, T* out,
                              float* part, int hq, int hkv, int n, long long hs, float scale) {
    // a tile of TK keys: KL lanes per key … (one key per lane for the scores, KPL keys per lane)
    constexpr int TK = RW == 1 ? 64 : 32, KPL = TK / 32, U = D / 32;
    constexpr int VN = Vec16<T>::N, VPR = D / VN;            // 16-byte vectors per K/V row
    constexpr int LOADS = (2 * TK * VPR + 127) / 128;        // per thread per tile (K and V)
    extern __shared__ float sm[];
    float* ks = sm;                      // [TK][D + 1]
    float* vs = ks + TK * (D + 1);       // [TK][D]
    float* qs = vs + TK * D;             // [4·RW][D]: this group's rows, scaled
    const int s = blockIdx.x / hkv, h = blockIdx.x % hkv, g = hq / hkv, R = g * n;
    const int r0 = blockIdx.z * 4 * RW, RB = min(R - r0, 4 * RW);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, splits = gridDim.y;
    // the union of the sequence's intervals: the threads read the n rows' in parallel
    __shared__ uint32_t span[2];
    if (threadIdx.x == 0) {
        span[0] = 0xffffffffu;
        span[1] = 0;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        atomicMin(&span[0], iv[2 * (s * n + i)]);
        atomicMax(&span[1], iv[2 * (s * n + i) + 1]);
    }
    __syncthreads();
    uint32_t lo = span[0], hi = span[1];
    if (hi < lo) hi = lo;
    uint32_t chunk = ((hi - lo + splits - 1) / splits + TK - 1) / TK * TK;
    uint32_t c0 = min(hi, lo + blockIdx.y * chunk), c1 = min(hi, c0 + chunk);
    for (int idx = threadIdx.x; idx < RB * D; idx += blockDim.x) {
        int r = r0 + idx / D, e = idx % D;
        qs[idx] = ld(q, ((size_t)(s * hq + h * g + r / n) * n + r % n) * D + e) * scale;
    }
    float m[RW], l[RW], acc[RW][U];
    uint32_t rlo[RW], rhi[RW];
#pragma unroll
    for (int w = 0; w < RW; w++) {
        m[w] = NEG_INF;
        l[w] = 0.0f;
        for (int u = 0; u < U; u++) acc[w][u] = 0.0f;
        int r = r0 + warp + 4 * w;
        int i = r % n;
        rlo[w] = r < R ? iv[2 * (s * n + i)] : 0;
        rhi[w] = r < R ? iv[2 * (s * n + i) + 1] : 0;
    }
    const T* kb = k + (size_t)(s * hkv + h) * hs;
    const T* vb = v + (size_t)(s * hkv + h) * hs;
    // the next tile's K/V in registers while this one is computed (16-byte loads)
    uint4 buf[LOADS];
    auto fetch = [&](uint32_t t0) {
#pragma unroll
        for (int i = 0; i < LOADS; i++) {
            int idx = threadIdx.x + 128 * i;
            int kv = idx / (TK * VPR), j = (idx / VPR) % TK, e = idx % VPR;
            uint32_t c = t0 + j;
            buf[i] = make_uint4(0, 0, 0, 0);
            if (idx < 2 * TK * VPR && c < c1)
                buf[i] = reinterpret_cast<const uint4*>((kv ? vb : kb) + (size_t)c * D)[e];
        }
    };
    if (c0 < c1) fetch(c0);
    for (uint32_t t0 = c0; t0 < c1; t0 += TK) {
        __syncthreads();
#pragma unroll
        for (int i = 0; i < LOADS; i++) {
            int idx = threadIdx.x + 128 * i;
            if (idx >= 2 * TK * VPR) break;
            int kv = idx / (TK * VPR), j = (idx / VPR) % TK, e = idx % VPR;
            float f[VN];
            Vec16<T>::cvt(buf[i], f);
            float* dst = kv ? vs + j * D + e * VN : ks + j * (D + 1) + e * VN;
#pragma unroll
            for (int x = 0; x < VN; x++) dst[x] = f[x];
        }
        __syncthreads();
        if (t0 + TK < c1) fetch(t0 + TK);
#pragma unroll
        for (int w = 0; w < RW; w++) {
            int r = r0 + warp + 4 * w;
            if (r >= R) break;
            float sc[KPL], p[KPL];
            bool vis[KPL];
            float tm = NEG_INF;
#pragma unroll
            for (int x = 0; x < KPL; x++) {
                uint32_t c = t0 + lane + 32 * x;
                vis[x] = c < c1 && c >= rlo[w] && c < rhi[w];
                sc[x] = NEG_INF;
                if (vis[x]) {
                    float a = 0.0f;
                    const float* qr = qs + (r - r0) * D;
                    const float* kr = ks + (lane + 32 * x) * (D + 1);
#pragma unroll 16
                    for (int e = 0; e < D; e++) a += qr[e] * kr[e];
                    sc[x] = a;
                }
                tm = fmaxf(tm, sc[x]);
            }
            for (int o = 16; o > 0; o >>= 1) tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, o));
            float mn = fmaxf(m[w], tm);
            if (mn == NEG_INF) continue;  // nothing visible to this row yet
            float corr = expf(m[w] - mn), ps = 0.0f;
#pragma unroll
            for (int x = 0; x < KPL; x++) {
                p[x] = vis[x] ? expf(sc[x] - mn) : 0.0f;
                ps += p[x];
            }
            for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
            l[w] = l[w] * corr + ps;
            m[w] = mn;
#pragma unroll
            for (int u = 0; u < U; u++) acc[w][u] *= corr;
#pragma unroll
            for (int x = 0; x < KPL; x++)
                for (int j = 0; j < 32; j++) {
                    float pj = __shfl_sync(0xffffffffu, p[x], j);
                    const float* vr = vs + (32 * x + j) * D + lane;
#pragma unroll
                    for (int u = 0; u < U; u++) acc[w][u] += pj * vr[32 * u];
                }
        }
    }
#pragma unroll
    for (int w = 0; w < RW; w++) {
        int r = r0 + warp + 4 * w;
        if (r >= R) break;
        if (splits == 1) {
            float inv = l[w] > 0.0f ? 1.0f / l[w] : 0.0f;
            size_t o = ((size_t)(s * n + r % n) * hq + h * g + r / n) * D;
            for (int u = 0; u < U; u++) st(out, o + lane + 32 * u, acc[w][u] * inv);
        } else {
            float* pr = part + (((size_t)blockIdx.x * splits + blockIdx.y) * R + r) * (D + 2);
            for (int u = 0; u < U; u++) pr[lane + 32 * u] = acc[w][u];
            if (lane == 0) {
                pr[D] = m[w];
                pr[D + 1] = l[w];
            }
        }
    }
}

// The splits of interval_attn merged: one block of D threads per (s, h, r).
template <typename T, int D>
__device__ void interval_attn_merge(const float* part, T* out, int hq, int hkv, int n, int splits) {
    const int R = (hq / hkv) * n, g = hq / hkv;
    const int r = blockIdx.x % R, sh = blockIdx.x / R, s = sh / hkv, h = sh % hkv;
    const float* p0 = part + (size_t)sh * splits * R * (D + 2);
    float M = NEG_INF;
    for (int j = 0; j < splits; j++) M = fmaxf(M, p0[((size_t)j * R + r) * (D + 2) + D]);
    float L = 0.0f, a = 0.0f;
    if (M != NEG_INF)
        for (int j = 0; j < splits; j++) {
            const float* pr = p0 + ((size_t)j * R + r) * (D + 2);
            float f = pr[D] == NEG_INF ? 0.0f : expf(pr[D] - M);
            L += pr[D + 1] * f;
            a += pr[threadIdx.x] * f;
        }
    size_t o = ((size_t)(s * n + r % n) * hq + h * g + r / n) * D;
    st(out, o + threadIdx.x, L > 0.0f ? a / L : 0.0f);
}

#define INTERVAL_ATTN(NAME, T, D, RW)                                                              \
    extern "C" __global__ void __launch_bounds__(128) interval_attn_d##D##_r##RW##_##NAME(         \
        const T* q, const T* k, const T* v, const uint32_t* iv, T* out, float* part, int hq,      \
        int hkv, int n, long long hs, float scale) {                                               \
        interval_attn<T, D, RW>(q, k, v, iv, out, part, hq, hkv, n, hs, scale);                     \
    }
#define INTERVAL_ATTN_MERGE(NAME, T, D)                                                            \
    extern "C" __global__ void interval_attn_merge_d##D##_##NAME(const float* part, T* out,        \
        int hq, int hkv, int n, int splits) {                                                      \
        interval_attn_merge<T, D>(part, out, hq, hkv, n, splits);                                  \
    }
INTERVAL_ATTN(f32, float, 64, 1)
INTERVAL_ATTN(f32, float, 64, 4)
INTERVAL_ATTN(f32, float, 128, 1)
INTERVAL_ATTN(f32, float, 128, 4)
INTERVAL_ATTN(bf16, __nv_bfloat16, 64, 1)
INTERVAL_ATTN(bf16, __nv_bfloat16, 64, 4)
INTERVAL_ATTN(bf16, __nv_bfloat16, 128, 1)
INTERVAL_ATTN(bf16, __nv_bfloat16, 128, 4)
INTERVAL_ATTN_MERGE(f32, float, 64)
INTERVAL_ATTN_MERGE(f32, float, 128)
INTERVAL_ATTN_MERGE(bf16, __nv_bfloat16, 64)
INTERVAL_ATTN_MERGE(bf16, __nv_bfloat16, 128)

// ---------------------------------------------------------------------------------------------
// Decode attention: one query row per sequence (the AR step of a batched regeneration's slots;
// `crate::ops::interval_attention` routes a single sequence's to interval_attn), the
// g = hq / hkv ≤ G query heads of a K/V head together. A block
// of 4 warps per (sequence s, K/V head h, split j of s's interval) reads K and V rows straight
// from global memory into registers (16-byte loads; the next iteration's UN loads of K and of V
// issued before this iteration's math, so that two iterations' loads are in flight per lane): a
// key's row spreads over LPK = D / VN lanes (VN values each), one warp-load covers KPW = 32 / LPK
// consecutive keys, and each group of LPK lanes keeps its own online softmax (m, l, acc per
// query head) over the keys it reads. The queries sit in shared memory (read as float4). The
// groups of a warp merge through shuffles, the 4 warps through shared memory; one split writes
// the normalised output, several write (acc, m, l) to `part` in interval_attn's layout for
// interval_attn_merge. The kernels take interval_attn's arguments (n is 1).
// Example: SmolLM2 in bf16 (D = 64, VN = 8, g = 3 → G = 4): 8 lanes per key, 4 keys per
// warp-load, UN = 4 → a warp walks 16 keys per iteration, the block 64.
// ---------------------------------------------------------------------------------------------
template <typename T, int D, int G>
__device__ void decode_attn(const T* q, const T* k, const T* v, const uint32_t* iv, T* out,
                            float* part, int hq, int hkv, long long hs, float scale) {
    constexpr int VN = Vec16<T>::N, LPK = D / VN, KPW = 32 / LPK, UN = G <= 4 ? 4 : 2;
    constexpr int STEP = UN * KPW;  // keys per warp per iteration
    __shared__ __align__(16) float qsm[G][D];
    __shared__ float wm[4][G], wl[4][G], wa[4][G][D];
    const int s = blockIdx.x / hkv, h = blockIdx.x % hkv, g = hq / hkv, splits = gridDim.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int grp = lane / LPK, e0 = (lane % LPK) * VN;
    const uint32_t lo = iv[2 * s], hi = max(iv[2 * s + 1], lo);
    const uint32_t chunk = ((hi - lo + splits - 1) / splits + STEP - 1) / STEP * STEP;
    const uint32_t c0 = min(hi, lo + blockIdx.y * chunk), c1 = min(hi, c0 + chunk);
    const T* kb = k + (size_t)(s * hkv + h) * hs;
    const T* vb = v + (size_t)(s * hkv + h) * hs;
    // this lane's K and V vectors of the UN keys of the iteration at key c (zeros past c1)
    auto fetch = [&](uint32_t c, uint4* kr, uint4* vr) {
#pragma unroll
        for (int u = 0; u < UN; u++) {
            const uint32_t cu = c + u * KPW + grp;
            kr[u] = vr[u] = make_uint4(0, 0, 0, 0);
            if (cu < c1) {
                kr[u] = reinterpret_cast<const uint4*>(kb + (size_t)cu * D)[lane % LPK];
                vr[u] = reinterpret_cast<const uint4*>(vb + (size_t)cu * D)[lane % LPK];
            }
        }
    };
    uint32_t c = c0 + warp * STEP;
    uint4 kr[UN], vr[UN];
    fetch(c, kr, vr);  // the first loads in flight while the queries load
    for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
        const int gi = idx / D;
        qsm[gi][idx % D] = gi < g ? ld(q, ((size_t)s * hq + h * g + gi) * D + idx % D) * scale : 0.0f;
    }
    __syncthreads();
    float acc[G][VN], m[G], l[G];
#pragma unroll
    for (int gi = 0; gi < G; gi++) {
        m[gi] = NEG_INF;
        l[gi] = 0.0f;
#pragma unroll
        for (int x = 0; x < VN; x++) acc[gi][x] = 0.0f;
    }
    for (; c < c1; c += 4 * STEP) {
        uint4 kn[UN], vn[UN];
        fetch(c + 4 * STEP, kn, vn);  // the next iteration's, in flight during this one's math
        // scores of this lane group's UN keys (the partial dots summed over the group's lanes)
        float sc[UN][G];
#pragma unroll
        for (int u = 0; u < UN; u++) {
            float f[VN];
            Vec16<T>::cvt(kr[u], f);
            const bool vis = c + u * KPW + grp < c1;
#pragma unroll
            for (int gi = 0; gi < G; gi++) {
                float a = 0.0f;
                if (gi < g) {
#pragma unroll
                    for (int x = 0; x < VN; x += 4) {
                        const float4 q4 = *reinterpret_cast<const float4*>(&qsm[gi][e0 + x]);
                        a += q4.x * f[x] + q4.y * f[x + 1] + q4.z * f[x + 2] + q4.w * f[x + 3];
                    }
#pragma unroll
                    for (int o = LPK / 2; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
                }
                sc[u][gi] = vis ? a : NEG_INF;
            }
        }
        // the online softmax of each head over them: sc becomes the probabilities
#pragma unroll
        for (int gi = 0; gi < G; gi++) {
            if (gi >= g) break;
            float mn = m[gi];
#pragma unroll
            for (int u = 0; u < UN; u++) mn = fmaxf(mn, sc[u][gi]);
            const float corr = mn == NEG_INF ? 1.0f : __expf(m[gi] - mn);
            float ps = 0.0f;
#pragma unroll
            for (int u = 0; u < UN; u++) {
                sc[u][gi] = mn == NEG_INF ? 0.0f : __expf(sc[u][gi] - mn);
                ps += sc[u][gi];
            }
            l[gi] = l[gi] * corr + ps;
            m[gi] = mn;
#pragma unroll
            for (int x = 0; x < VN; x++) acc[gi][x] *= corr;
        }
#pragma unroll
        for (int u = 0; u < UN; u++) {
            float f[VN];
            Vec16<T>::cvt(vr[u], f);
#pragma unroll
            for (int gi = 0; gi < G; gi++) {
                if (gi >= g) break;
#pragma unroll
                for (int x = 0; x < VN; x++) acc[gi][x] += sc[u][gi] * f[x];
            }
        }
#pragma unroll
        for (int u = 0; u < UN; u++) {
            kr[u] = kn[u];
            vr[u] = vn[u];
        }
    }
    // the lane groups of a warp merged (lanes e and e + LPK hold the same dims of other keys)
#pragma unroll
    for (int o = LPK; o < 32; o <<= 1) {
#pragma unroll
        for (int gi = 0; gi < G; gi++) {
            if (gi >= g) break;
            const float m2 = __shfl_xor_sync(0xffffffffu, m[gi], o);
            const float l2 = __shfl_xor_sync(0xffffffffu, l[gi], o);
            const float mx = fmaxf(m[gi], m2);
            const float f1 = m[gi] == NEG_INF ? 0.0f : __expf(m[gi] - mx);
            const float f2 = m2 == NEG_INF ? 0.0f : __expf(m2 - mx);
            l[gi] = l[gi] * f1 + l2 * f2;
            m[gi] = mx;
#pragma unroll
            for (int x = 0; x < VN; x++) {
                const float a2 = __shfl_xor_sync(0xffffffffu, acc[gi][x], o);
                acc[gi][x] = acc[gi][x] * f1 + a2 * f2;
            }
        }
    }
    if (grp == 0) {
#pragma unroll
        for (int gi = 0; gi < G; gi++) {
            if (gi >= g) break;
#pragma unroll
            for (int x = 0; x < VN; x++) wa[warp][gi][e0 + x] = acc[gi][x];
            if (lane == 0) {
                wm[warp][gi] = m[gi];
                wl[warp][gi] = l[gi];
            }
        }
    }
    __syncthreads();
    // the 4 warps merged: a thread per (head, dim)
    for (int idx = threadIdx.x; idx < g * D; idx += blockDim.x) {
        const int gi = idx / D, e = idx % D;
        float M = NEG_INF;
        for (int w = 0; w < 4; w++) M = fmaxf(M, wm[w][gi]);
        float L = 0.0f, A = 0.0f;
        if (M != NEG_INF)
            for (int w = 0; w < 4; w++) {
                const float f = wm[w][gi] == NEG_INF ? 0.0f : __expf(wm[w][gi] - M);
                L += wl[w][gi] * f;
                A += wa[w][gi][e] * f;
            }
        if (splits == 1) {
            st(out, ((size_t)s * hq + h * g + gi) * D + e, L > 0.0f ? A / L : 0.0f);
        } else {
            float* pr = part + (((size_t)blockIdx.x * splits + blockIdx.y) * g + gi) * (D + 2);
            pr[e] = A;
            if (e == 0) {
                pr[D] = M;
                pr[D + 1] = L;
            }
        }
    }
}

// MINB blocks per SM: the register budget (4 where 128 registers hold the kernel without spills)
#define DECODE_ATTN(NAME, T, D, G, MINB)                                                           \
    extern "C" __global__ void __launch_bounds__(128, MINB) decode_attn_d##D##_g##G##_##NAME(     \
        const T* q, const T* k, const T* v, const uint32_t* iv, T* out, float* part, int hq,      \
        int hkv, int /* n = 1 */, long long hs, float scale) {                                     \
        decode_attn<T, D, G>(q, k, v, iv, out, part, hq, hkv, hs, scale);                          \
    }
DECODE_ATTN(f32, float, 64, 2, 4)
DECODE_ATTN(f32, float, 64, 4, 4)
DECODE_ATTN(f32, float, 64, 8, 4)
DECODE_ATTN(f32, float, 128, 2, 4)
DECODE_ATTN(f32, float, 128, 4, 4)
DECODE_ATTN(f32, float, 128, 8, 4)
DECODE_ATTN(bf16, __nv_bfloat16, 64, 2, 4)
DECODE_ATTN(bf16, __nv_bfloat16, 64, 4, 4)
DECODE_ATTN(bf16, __nv_bfloat16, 64, 8, 3)
DECODE_ATTN(bf16, __nv_bfloat16, 128, 2, 4)
DECODE_ATTN(bf16, __nv_bfloat16, 128, 4, 3)
DECODE_ATTN(bf16, __nv_bfloat16, 128, 8, 3)

// The arg-max of each row of f32 values, as the host's `dflash_core::sampling::argmax` picks it:
// the first index of the largest value, NaN never chosen, except that a row whose first value is
// NaN gives 0 (the host's scan never moves off it). One block of 256 threads per row.
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

// ---------------------------------------------------------------------------------------------
// Sampling at T > 0 (crate::ops::sample_rows): one block of 1,024 threads per row. Uniform
// numbers arrive as the f32 bits of a u32 table.
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

// Each row's softmax of x / t, as `dflash_core::sampling::dense_probs` without top-k or top-p:
// w = exp(x/t − max/t), divided by the f64 sum of w rounded to f32.
extern "C" __global__ void temperature_probs_f32(const float* x, float* out, int v, float t) {
    __shared__ float shf[32];
    __shared__ double shd[32];
    const float* row = x + (size_t)blockIdx.x * v;
    float* o = out + (size_t)blockIdx.x * v;
    float m = NEG_INF;
    for (int i = threadIdx.x; i < v; i += blockDim.x) m = fmaxf(m, row[i]);
    float mt = block_max(m, shf) / t;
    double s = 0.0;
    for (int i = threadIdx.x; i < v; i += blockDim.x) {
        float e = expf(row[i] / t - mt);
        o[i] = e;
        s += (double)e;
    }
    float sum = (float)block_sum(s, shd);
    for (int i = threadIdx.x; i < v; i += blockDim.x) o[i] = o[i] / sum;
}

// Row r of the weights drawn with uniform u[from + r].
extern "C" __global__ void draw_rows_f32(const float* w, const uint32_t* u, uint32_t* out, int v, int from) {
    __shared__ double sh[32];
    RowWeights wt{w + (size_t)blockIdx.x * v};
    uint32_t t = block_pick(wt, v, __uint_as_float(u[from + blockIdx.x]), sh);
    if (threadIdx.x == 0) out[blockIdx.x] = t;
}

// Draft d[r] judged against p (drawn from q): kept with probability min(1, p/q), decided by
// u[ua + r]; otherwise the bonus from the residual max(0, p − q) (from p when its mass is 0)
// drawn with u[ub + r]. out[2r], out[2r+1] = (1, 0) kept, (0, bonus) rejected.
extern "C" __global__ void judge_rows_f32(const float* p, const float* q, const uint32_t* d,
                                          const uint32_t* u, uint32_t* out, int v, int ua, int ub) {
    __shared__ double sh[32];
    int r = blockIdx.x;
    const float* pr = p + (size_t)r * v;
    const float* qr = q + (size_t)r * v;
    uint32_t dr = d[r];
    float pd = pr[dr], qd = qr[dr];
    bool keep = qd > 0.f && (pd >= qd || __uint_as_float(u[ua + r]) < pd / qd);
    if (keep) {  // the whole block takes this branch
        if (threadIdx.x == 0) { out[2 * r] = 1u; out[2 * r + 1] = 0u; }
        return;
    }
    Residual res{pr, qr};
    double mass = 0.0;
    for (int i = threadIdx.x; i < v; i += blockDim.x) mass += (double)res(i);
    mass = block_sum(mass, sh);
    float ubr = __uint_as_float(u[ub + r]);
    uint32_t bonus = mass > 0.0 ? block_pick(res, v, ubr, sh) : block_pick(RowWeights{pr}, v, ubr, sh);
    if (threadIdx.x == 0) { out[2 * r] = 0u; out[2 * r + 1] = bonus; }
}

// Row r's first k draws without replacement from its weights q (not normalised), draw j with
// u[from + r·k + j]: each a `block_pick` over what is left — a working copy of the row (`work`,
// [n, v]) with the drawn tokens zeroed — as `dflash_core::sampled_tree::draws_without_replacement`;
// once the row's tokens of non-zero weight are all drawn, token 0.
extern "C" __global__ void draw_distinct_rows_f32(const float* q, float* work, const uint32_t* u,
                                                  uint32_t* out, int v, int k, int from) {
    __shared__ double sh[32];
    size_t r = blockIdx.x;
    const float* row = q + r * v;
    float* w = work + r * v;
    for (int i = threadIdx.x; i < v; i += blockDim.x) w[i] = row[i] > 0.f ? row[i] : 0.f;
    __syncthreads();
    for (int j = 0; j < k; ++j) {
        uint32_t t = block_pick(RowWeights{w}, v, __uint_as_float(u[from + r * k + j]), sh);
        if (threadIdx.x == 0) {
            out[r * k + j] = t;
            w[t] = 0.f;
        }
        __syncthreads();
    }
}

// The walk down a sampled tree by recursive rejection sampling, one block
// (`dflash_core::sampled_tree::walk_judged`). `p` [n, v]: the target's distribution at each tree
// row; `q` [depths, v]: row d the draft distribution of depth d + 1; `tab`: the tree
// (`ops::sampled_tree::TreeTable`: n, first[n + 1], kids[n − 1], tokens[n], depths[n]); uniforms
// from u[from], one per judged child and one for the bonus. At a node, child k (token c) is kept
// with probability min(1, P(c) / Q(c)); on a rejection P ← max(0, P − Q) renormalised (kept when
// that is empty) and Q ← Q without c renormalised, in the working rows `pw`, `qw` (the node's
// own rows are read until the first rejection). Every child rejected: the bonus drawn from P; at
// a leaf, from its row. out = [path length, bonus, path rows…].
extern "C" __global__ void walk_tree_f32(const float* p, const float* q, const uint32_t* tab,
                                         const uint32_t* u, float* pw, float* qw, uint32_t* out,
                                         int v, int from) {
    __shared__ double sh[32];
    int n = (int)tab[0];
    const uint32_t* first = tab + 1;
    const uint32_t* kids = first + n + 1;
    const uint32_t* tokens = kids + (n - 1);
    const uint32_t* depths = tokens + n;
    int cur = 0, len = 0, ui = from;
    uint32_t bonus = 0;
    for (;;) {
        int c0 = (int)first[cur], c1 = (int)first[cur + 1];
        const float* P = p + (size_t)cur * v;
        if (c0 == c1) {
            bonus = block_pick(RowWeights{P}, v, __uint_as_float(u[ui++]), sh);
            break;
        }
        const float* Q = q + (size_t)depths[cur] * v;
        int next = -1;
        for (int k = c0; k < c1; ++k) {
            int child = (int)kids[k];
            int c = (int)tokens[child];
            float pc = P[c], qc = Q[c], uk = __uint_as_float(u[ui++]);
            if (qc > 0.f && (pc >= qc || uk < pc / qc)) {  // the whole block takes this branch
                next = child;
                break;
            }
            double mass = 0.0;
            for (int i = threadIdx.x; i < v; i += blockDim.x) mass += (double)fmaxf(P[i] - Q[i], 0.f);
            mass = block_sum(mass, sh);
            if (mass > 0.0) {
                // each thread rewrites the values it read: P may be pw itself
                for (int i = threadIdx.x; i < v; i += blockDim.x)
                    pw[i] = (float)((double)fmaxf(P[i] - Q[i], 0.f) / mass);
                P = pw;
            }
            double s = 0.0;
            for (int i = threadIdx.x; i < v; i += blockDim.x)
                if (i != c) s += (double)Q[i];
            s = block_sum(s, sh);
            for (int i = threadIdx.x; i < v; i += blockDim.x) {
                float x = i == c ? 0.f : Q[i];
                qw[i] = s > 0.0 ? (float)((double)x / s) : x;
            }
            Q = qw;
            __syncthreads();
        }
        if (next < 0) {
            bonus = block_pick(RowWeights{P}, v, __uint_as_float(u[ui++]), sh);
            break;
        }
        if (threadIdx.x == 0) out[2 + len] = (uint32_t)next;
        ++len;
        cur = next;
    }
    if (threadIdx.x == 0) {
        out[0] = (uint32_t)len;
        out[1] = bonus;
    }
}

// The top k of each row of f32 values in the order of `dflash_core::tree::top_k_sorted`: value
// descending by the IEEE total order (Rust's `total_cmp`), ties by index ascending — a total
// order on (value, index), so the top k of a row is the top k of its segments' top k. Stage 1:
// one block per segment of TOPK_SEG values (held in shared memory) picks its top k in k rounds
// of one block reduction, every round the best element after the previous round's pick in that
// order (no marks needed). Stage 2: one block per row does the same over the segments' picks.
__device__ __forceinline__ int total_key(float f) {
    int i = __float_as_int(f);
    return i ^ (int)(((unsigned)(i >> 31)) >> 1);
}

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

// ---------------------------------------------------------------------------------------------
// A sampling rule's probabilities with top-k (any k) and top-p, as
// `dflash_core::sampling::dense_probs`: the ranks (logit descending by the total order, ties by
// token id ascending) that top-k keeps, renormalised; of those, the ranks whose mass before them
// is below top-p (the first always), renormalised; 0 elsewhere. No sort: each cut is a boundary
// key b over the 2^32 keys of `total_key` — the smallest b whose count (top-k) or mass (top-p)
// strictly above it is below the cut, by bisection (32 reads of the row) or, for top-p alone,
// by a 16-way search (`key_search`, 8 or 9 reads each of 15 block sums) — then the tokens above
// b kept and, of those at b (equal logits), the first ones by token id. One block per row.
// Example: logits [0, 2, 1, -1], T = 1, top-p .7 (p = .087 .644 .237 .032): mass above key(1)
// is .644 < .7, above key(0) .881 → b = key(1); token 2 kept (.644 + 0 · .237 < .7) →
// [0, .731, .269, 0].
// ---------------------------------------------------------------------------------------------
// Σ f(i) over this thread's stride of a row (i = tid, tid + n, …), four loads in flight: one
// row on one SM, a walk with one load at a time waits on each (≈ 30 GB/s on the H200).
template <typename F>
__device__ double stride_sum(int v, const F& f) {
    const int s = blockDim.x;
    double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
    int i = threadIdx.x;
    for (; i + 3 * s < v; i += 4 * s) {
        double f0 = f(i), f1 = f(i + s), f2 = f(i + 2 * s), f3 = f(i + 3 * s);
        a0 += f0;
        a1 += f1;
        a2 += f2;
        a3 += f3;
    }
    for (; i < v; i += s) a0 += f(i);
    return (a0 + a1) + (a2 + a3);
}

struct KeyCount {  // tokens whose key is above m
    const float* x;
    int m;
    __device__ double operator()(int i) const { return total_key(x[i]) > m ? 1.0 : 0.0; }
};

struct KeyMass {  // their mass
    const float* x;
    const float* q;
    int m;
    __device__ double operator()(int i) const { return total_key(x[i]) > m ? (double)q[i] : 0.0; }
};

struct Plain {
    const float* q;
    __device__ double operator()(int i) const { return (double)q[i]; }
};

struct CountAbove {
    const float* x;
    int v;
    __device__ double operator()(int m, double* sh) const { return block_sum(stride_sum(v, KeyCount{x, m}), sh); }
};

struct MassAbove {
    const float* x;
    const float* q;
    int v;
    __device__ double operator()(int m, double* sh) const { return block_sum(stride_sum(v, KeyMass{x, q, m}), sh); }
};

// The smallest key m with above(m) < limit by bisection (`DFLASH_DISABLED_KERNELS=rule-search`, the A/B's
// reference: 32 dependent block sums of the row).
template <typename Above>
__device__ int key_bisect(const Above& above, double limit, double* sh) {
    long long lo = -2147483648LL, hi = 2147483647LL;
    while (lo < hi) {
        long long mid = lo + ((hi - lo) >> 1);
        if (above((int)mid, sh) < limit) hi = mid; else lo = mid + 1;
    }
    return (int)lo;
}

// Fifteen block sums at once (`sh` holds 32 · 15 values): each warp's by shuffles, then the
// warps' in one fixed order, so every thread gets the same sums.
__device__ void block_sum15(double (&a)[15], double* sh) {
#pragma unroll
    for (int j = 0; j < 15; ++j)
        for (int o = 16; o > 0; o >>= 1) a[j] += __shfl_xor_sync(0xffffffff, a[j], o);
    int w = threadIdx.x / 32, l = threadIdx.x % 32, nw = blockDim.x / 32;
    __syncthreads();
    if (l == 0)
        for (int j = 0; j < 15; ++j) sh[w * 15 + j] = a[j];
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 15; ++j) {
        double x = l < nw ? sh[l * 15 + j] : 0.0;
        for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
        a[j] = x;
    }
}

// The smallest key m with above(m) < limit, where above(m) sums w(i) over the tokens whose key
// is above m (w = 1 without `q`: a count; w = q[i]: a mass; nonincreasing in m and 0 at the
// largest key, limit > 0), by a 16-way search: each pass sums above at the 15 keys
// lo + ⌊d·j/16⌋ (d = hi − lo, j = 1 … 15) in one read of the row and keeps the sub-range that
// holds the answer — 8 or 9 dependent passes over the row instead of a bisection's 32. Every
// thread gets the same block sums, so the same m. `sh` holds 32 · 15 values.
__device__ int key_search(const float* x, const float* q, int v, double limit, double* sh) {
    long long lo = -2147483648LL, hi = 2147483647LL;
    while (lo < hi) {
        long long d = hi - lo;
        int t[15];
        double a[15];
#pragma unroll
        for (int j = 0; j < 15; ++j) {
            t[j] = (int)(lo + d * (j + 1) / 16);
            a[j] = 0.0;
        }
        for (int i = threadIdx.x; i < v; i += blockDim.x) {
            int key = total_key(x[i]);
            double w = q ? (double)q[i] : 1.0;
#pragma unroll
            for (int j = 0; j < 15; ++j) a[j] += key > t[j] ? w : 0.0;
        }
        block_sum15(a, sh);
        int first = 15;
        for (int j = 14; j >= 0; --j)
            if (a[j] < limit) first = j;
        if (first < 15) hi = t[first];
        if (first > 0) lo = (long long)t[first - 1] + 1;
    }
    return (int)lo;
}

// o[i] = q[i] for the tokens above key b and the first `j` tokens at b (by token id), else 0.
// Each thread walks one contiguous chunk, so the ties before it are an exclusive block scan.
__device__ void keep_prefix(const float* x, const float* q, float* o, int v, int b, double j, double* sh) {
    int chunk = (v + blockDim.x - 1) / blockDim.x;
    int lo = min(v, (int)threadIdx.x * chunk), hi = min(v, lo + chunk);
    double ties = 0.0;
    for (int i = lo; i < hi; ++i) ties += total_key(x[i]) == b ? 1.0 : 0.0;
    double total;
    double before = block_exclusive_f64(ties, sh, &total);
    for (int i = lo; i < hi; ++i) {
        int k = total_key(x[i]);
        bool keep = k > b;
        if (k == b) { keep = before < j; before += 1.0; }
        o[i] = keep ? q[i] : 0.f;
    }
    __syncthreads();
}

// p: the rows' temperature probabilities (`temperature_probs_f32` of x); k = 0: no top-k;
// top_p = 1: no top-p. The cuts by bisection, but top-p alone by the 16-way search unless
// `bisect` (on the H100 at Qwen3-8B's vocabulary, per AR token: top-p alone 1.43 against 1.60
// ms; after a top-k 20 cut, and for the top-k cut, the search's 15 sums per read were slower:
// 2.20 against 2.11 ms).
// 512 threads: the search's 15 sums and keys per thread do not fit 1,024 threads' registers.
extern "C" __global__ void __launch_bounds__(512) rule_probs_f32(const float* x, const float* p, float* out, int v,
                                                                 int k, float top_p, int bisect) {
    __shared__ double sh[32];
    __shared__ double sh15[32 * 15];
    __shared__ float shf[32];
    const float* xr = x + (size_t)blockIdx.x * v;
    const float* q = p + (size_t)blockIdx.x * v;
    float* o = out + (size_t)blockIdx.x * v;
    double mass = 1.0;
    if (k > 0 && k < v) {
        CountAbove count{xr, v};
        int b = key_bisect(count, (double)k, sh);
        keep_prefix(xr, q, o, v, b, (double)k - count(b, sh), sh);
        q = o;
        mass = block_sum(stride_sum(v, Plain{o}), sh);
    }
    if (top_p < 1.f) {
        double limit = (double)top_p * mass;
        MassAbove above{xr, q, v};
        // the search pays on a dense row (top-p alone), not after a top-k cut
        bool search = !bisect && !(k > 0 && k < v);
        int b = search ? key_search(xr, q, v, limit, sh15) : key_bisect(above, limit, sh);
        double a = above(b, sh);
        float pb = 0.f;  // the tokens at b share one logit, so one probability (0 outside top-k)
        for (int i = threadIdx.x; i < v; i += blockDim.x)
            if (total_key(xr[i]) == b) pb = fmaxf(pb, q[i]);
        pb = block_max(pb, shf);
        double j = pb > 0.f ? ceil((limit - a) / (double)pb) : (double)v;
        keep_prefix(xr, q, o, v, b, j, sh);
        mass = block_sum(stride_sum(v, Plain{o}), sh);
    } else if (!(k > 0 && k < v)) {
        for (int i = threadIdx.x; i < v; i += blockDim.x) o[i] = q[i];
        __syncthreads();
    }
    float s = (float)mass;
    for (int i = threadIdx.x; i < v; i += blockDim.x) o[i] = o[i] / s;
}

// AdamW, f32 master weights, element-wise with a grid-stride loop. Every operation is rounded
// as the CPU twin rounds it (`x * mul + add` as two IEEE operations, no fused multiply-add), so
// the two agree bit for bit. `mv` holds the first moments (n values), then the second.
__device__ __forceinline__ float aff(float x, float mul, float add) {
    return __fadd_rn(__fmul_rn(x, mul), add);
}

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


// ---------------------------------------------------------------------------------------------
// The gated delta rule's recurrence over a forward's new rows (`gdn_recurrence.rs`; its CPU
// twin `recurrence_host`). One block per (value head h, 32 value columns); 128 threads = 4
// slices of the key dimension × 32 columns; the block's state tile S[dk][32] in shared memory.
// rows[i] = q | k | v | β | g (2·hk·dk + hv·dv + 2·hv floats); parents[i] = the row whose state
// row i starts from (0xffffffff: the committed state `init`). out = o [n, hv·dv], then the
// states [n, hv·dk·dv] (keep) or the state after the last row (!keep; rows form a chain).
// Grid z: independent sequences of the same n rows and parents (a batched step): sequence z
// reads rows[z·n …] and init[z], writes o[z·n …] and, after every sequence's o, its states.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void gdn_recurrence_f32(const float* rows, const float* init,
    const uint32_t* parents, float* out, int n, int hk, int hv, int dk, int dv, int keep) {
    extern __shared__ float sm[];
    float* S = sm;
    float* q = S + dk * 32;
    float* k = q + dk;
    float* red = k + dk;
    float* dl = red + 128;
    const int h = blockIdx.x, j0 = blockIdx.y * 32;
    const int jj = threadIdx.x & 31, ta = threadIdx.x >> 5;
    const int kd = hk * dk, vd = hv * dv, w = 2 * kd + vd + 2 * hv;
    const int kh = h / (hv / hk);
    const size_t sl = (size_t)hv * dk * dv, o_len = (size_t)n * vd;
    // a column past dv (the last tile of a dv that is not a multiple of 32) computes zeros
    const bool live = j0 + jj < dv;
    const int j = live ? j0 + jj : 0;
    const size_t z = blockIdx.z;
    rows += z * n * (size_t)w;
    init += z * sl;
    float* states = out + (size_t)gridDim.z * o_len + z * (keep ? (size_t)n : 1) * sl;
    out += z * o_len;
    for (int a = ta; a < dk; a += 4) S[a * 32 + jj] = live ? init[((size_t)h * dk + a) * dv + j] : 0.0f;
    int cur = -1;
    for (int i = 0; i < n; ++i) {
        const uint32_t p = parents[i];
        const int want = p == 0xffffffffu ? -1 : (int)p;
        if (want != cur) {
            // each thread reloads exactly the cells it wrote: no other thread's writes are read
            const float* src = want < 0 ? init : states + (size_t)want * sl;
            for (int a = ta; a < dk; a += 4) S[a * 32 + jj] = live ? src[((size_t)h * dk + a) * dv + j] : 0.0f;
        }
        const float* r = rows + (size_t)i * w;
        __syncthreads();
        for (int a = threadIdx.x; a < dk; a += blockDim.x) {
            q[a] = r[kh * dk + a];
            k[a] = r[kd + kh * dk + a];
        }
        __syncthreads();
        const float beta = r[2 * kd + vd + h];
        const float decay = expf(r[2 * kd + vd + hv + h]);
        const float v = live ? r[2 * kd + h * dv + j] : 0.0f;
        float part = 0.0f;
        for (int a = ta; a < dk; a += 4) {
            float s = S[a * 32 + jj] * decay;
            S[a * 32 + jj] = s;
            part += s * k[a];
        }
        red[ta * 32 + jj] = part;
        __syncthreads();
        if (ta == 0) dl[jj] = (v - (red[jj] + red[32 + jj] + red[64 + jj] + red[96 + jj])) * beta;
        __syncthreads();
        const float d = dl[jj];
        part = 0.0f;
        for (int a = ta; a < dk; a += 4) {
            float s = S[a * 32 + jj] + k[a] * d;
            S[a * 32 + jj] = s;
            part += s * q[a];
        }
        red[ta * 32 + jj] = part;
        __syncthreads();
        if (ta == 0 && live) out[(size_t)i * vd + h * dv + j] = red[jj] + red[32 + jj] + red[64 + jj] + red[96 + jj];
        if (keep && live)
            for (int a = ta; a < dk; a += 4) states[(size_t)i * sl + ((size_t)h * dk + a) * dv + j] = S[a * 32 + jj];
        cur = i;
        __syncthreads();
    }
    if (!keep && live)
        for (int a = ta; a < dk; a += 4) states[((size_t)h * dk + a) * dv + j] = S[a * 32 + jj];
}

// ---------------------------------------------------------------------------------------------
// A Gated DeltaNet layer's prep (`gdn_prep.rs`; CPU twin `prep_host`): one block per row i.
// conv[ch] = SiLU(Σ_tap w[tap][ch] · buf[idx[i][tap]][ch]) (the zero row skipped), taps newest
// first; q, k heads L2-normalised (q · dk^-½); v copied; β = sigmoid(b), g = neg_a · softplus(a
// + dt_bias). out[i] = q | k | v | β | g; the conv goes to out first and is normalised in place.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

extern "C" __global__ void gdn_prep_f32(const float* buf, const float* ba, const uint32_t* idx,
    const float* consts, float* out, int hk, int hv, int dk, int dv, int K, uint32_t zero_row) {
    const int i = blockIdx.x;
    const int kd = hk * dk, vd = hv * dv, c = 2 * kd + vd, w = c + 2 * hv;
    // zero_row: the buffer's last row (its rows: K - 1 + n for one sequence, every slot's
    // K - 1 and its row for a batched step)
    float* o = out + (size_t)i * w;
    for (int ch = threadIdx.x; ch < c; ch += blockDim.x) {
        float acc = 0.0f;
        for (int tap = K - 1; tap >= 0; --tap) {
            const uint32_t r = idx[(size_t)i * K + tap];
            if (r == zero_row) continue;
            acc += consts[(size_t)tap * c + ch] * buf[(size_t)r * c + ch];
        }
        o[ch] = silu_f(acc);
    }
    __syncthreads();
    // one warp per (q or k, head): Σ x², then the scale
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    for (int s = warp; s < 2 * hk; s += nw) {
        float* x = o + (size_t)s * dk;  // q heads first, then k heads
        float ss = 0.0f;
        for (int j = lane; j < dk; j += 32) ss += x[j] * x[j];
        for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, off);
        float scale = 1.0f / sqrtf(ss + 1e-6f);
        if (s < hk) scale = scale / sqrtf((float)dk);
        __syncwarp();
        for (int j = lane; j < dk; j += 32) x[j] = x[j] * scale;
    }
    const float* dt_bias = consts + (size_t)K * c;
    const float* neg_a = dt_bias + hv;
    for (int h = threadIdx.x; h < hv; h += blockDim.x) {
        const float b = ba[(size_t)i * 2 * hv + h];
        const float a = ba[(size_t)i * 2 * hv + hv + h] + dt_bias[h];
        o[c + h] = 1.0f / (1.0f + expf(-b));
        o[c + hv + h] = neg_a[h] * (a > 20.0f ? a : log1pf(expf(a)));
    }
}

// The gated RMSNorm (`gdn_prep.rs`; CPU twin `gated_norm_host`): one block per (row, value head)
// of dv values: out = w · (o · rsqrt(mean(o²) + eps)) · SiLU(z).
extern "C" __global__ void gated_norm_f32(const float* o, const float* z, const float* w, float* out,
    int dv, float eps) {
    __shared__ float sh[32];
    const size_t base = (size_t)blockIdx.x * dv;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < dv; j += blockDim.x) ss += o[base + j] * o[base + j];
    ss = block_sum(ss, sh);
    const float inv = 1.0f / sqrtf(ss / (float)dv + eps);
    for (int j = threadIdx.x; j < dv; j += blockDim.x)
        out[base + j] = w[j] * (o[base + j] * inv) * silu_f(z[base + j]);
}

// ---------------------------------------------------------------------------------------------
// The gated delta rule over a prefill's chain, chunked (`gdn_chunk.rs`; CPU twin `chunked_host`;
// the algorithm in that module's doc). rows[i] = q | k | v | β | g as for `gdn_recurrence`;
// dk and dv multiples of 4. Scratch per (value head h, chunk c), GC·(dv + 3·dk + GC) + GC floats:
// X [GC][dv], Y [GC][dk], Q̃ = e^c q [GC][dk], K̃ = e^{c_L−c} k [GC][dk], P [GC][GC]
// (q_i·k_j e^{c_i−c_j} for j ≤ i, zero above) and the cumulative decays c [GC]. Shared tiles
// keep rows of d + 4 floats so that a thread reads four consecutive values with one 16-byte load.
// ---------------------------------------------------------------------------------------------
#define GC 64
#define GCP 68

__device__ __forceinline__ float dot4(float4 a, float4 b) {
    return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

// One block of 256 threads per (key head, chunk), all chunks at once: the Gram products k·kᵀ and
// q·kᵀ once for the key head's value heads, then per value head: A, T = (I + A)⁻¹ (the four
// 16-row diagonal blocks by forward substitution, the blocks below them by products, level by
// level), X = T·(β v), Y = T·(β e^c k), and Q̃, K̃, P, c into the scratch.
// Shared: K [GC][dk+4], q then v [GC][max(dk, dv)+4], A and T [GC][GCP], the products of a level [3][16][16].
extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_prep_f32(
    const float* __restrict__ rows, float* __restrict__ scratch, int n, int hk, int hv, int dk,
    int dv) {
    extern __shared__ float4 gc_sm4[];
    float* sm = (float*)gc_sm4;
    const int ks = dk + 4, vs = max(dk, dv) + 4;
    float* Ks = sm;
    float* Vs = Ks + GC * ks;
    float* sA = Vs + GC * vs;
    float* sT = sA + GC * GCP;
    float* sM = sT + GC * GCP;
    float* cum = sM + 3 * 256;
    float* beta = cum + GC;
    float* sx = beta + GC;
    float* sy = sx + GC;
    const int kh = blockIdx.x, c = blockIdx.y, nc = gridDim.y, group = hv / hk;
    const int c0 = c * GC, l = min(GC, n - c0);
    const int kd = hk * dk, vd = hv * dv, w = 2 * kd + vd + 2 * hv;
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5;
    const size_t per = (size_t)GC * (dv + 3 * dk + GC) + GC;
    // k and q of the chunk, 16 values per thread in flight (every load issued before the stores)
    for (int base = 0; base < GC * dk; base += 16 * 256) {
        float kb[16], qb[16];
#pragma unroll
        for (int u = 0; u < 16; ++u) {
            const int idx = base + tid + u * 256, i = idx / dk, a = idx - i * dk;
            const bool in = idx < GC * dk && i < l;
            const float* r = rows + (size_t)(c0 + (in ? i : 0)) * w;
            kb[u] = in ? r[kd + kh * dk + a] : 0.0f;
            qb[u] = in ? r[kh * dk + a] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 16; ++u) {
            const int idx = base + tid + u * 256, i = idx / dk, a = idx - i * dk;
            if (idx < GC * dk) {
                Ks[i * ks + a] = kb[u];
                Vs[i * vs + a] = qb[u];
            }
        }
    }
    if (tid < GC) {
#pragma unroll
        for (int a = 0; a < 4; ++a) Ks[tid * ks + dk + a] = 0.0f;
    }
    __syncthreads();
    const int gi = tid >> 2, j0 = tid & 3;
    float kk[16], qk[16];
#pragma unroll
    for (int u = 0; u < 16; ++u) kk[u] = qk[u] = 0.0f;
    for (int a = 0; a < dk; a += 4) {
        const float4 ki = *(const float4*)&Ks[gi * ks + a];
        const float4 qi = *(const float4*)&Vs[gi * vs + a];
#pragma unroll
        for (int u = 0; u < 16; ++u) {
            const float4 kj = *(const float4*)&Ks[(j0 + 4 * u) * ks + a];
            kk[u] += dot4(ki, kj);
            qk[u] += dot4(qi, kj);
        }
    }
    for (int g = 0; g < group; ++g) {
        const int h = kh * group + g;
        float* X = scratch + ((size_t)h * nc + c) * per;
        float* Y = X + (size_t)GC * dv;
        float* Qt = Y + (size_t)GC * dk;
        float* Kt = Qt + (size_t)GC * dk;
        float* P = Kt + (size_t)GC * dk;
        float* cumg = P + GC * GC;
        __syncthreads();
        // β and g loaded in parallel; the decays summed in row order by one thread (the host's)
        if (tid < GC) {
            const float* r = rows + (size_t)(c0 + (tid < l ? tid : 0)) * w + 2 * kd + vd;
            beta[tid] = tid < l ? r[h] : 0.0f;
            cum[tid] = tid < l ? r[hv + h] : 0.0f;
        }
        for (int base = 0; base < GC * dv; base += 16 * 256) {
            float vb[16];
#pragma unroll
            for (int u = 0; u < 16; ++u) {
                const int idx = base + tid + u * 256, m = idx / dv, col = idx - m * dv;
                vb[u] = (idx < GC * dv && m < l) ? rows[(size_t)(c0 + m) * w + 2 * kd + h * dv + col] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 16; ++u) {
                const int idx = base + tid + u * 256, m = idx / dv, col = idx - m * dv;
                if (idx < GC * dv) Vs[m * vs + col] = vb[u];
            }
        }
        for (int idx = tid; idx < GC * GCP; idx += blockDim.x) sT[idx] = 0.0f;
        __syncthreads();
        if (tid == 0) {
            float acc = 0.0f;
            for (int i = 0; i < GC; ++i) {
                acc += cum[i];
                cum[i] = acc;
            }
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < 16; ++u) {
            const int j = j0 + 4 * u;
            const float e = (j <= gi && gi < l) ? expf(cum[gi] - cum[j]) : 0.0f;
            sA[gi * GCP + j] = j < gi ? beta[gi] * kk[u] * e : 0.0f;
            P[gi * GC + j] = j <= gi ? qk[u] * e : 0.0f;
        }
        const float last = cum[l - 1];
        if (tid < GC) {
            cumg[tid] = cum[tid];
            sT[tid * GCP + tid] = 1.0f;
            sx[tid] = beta[tid];
            sy[tid] = beta[tid] * expf(cum[tid]);
        }
        // Q̃ = e^c q and K̃ = e^{c_L−c} k from the shared k and the rows' q
        for (int base = 0; base < GC * dk; base += 16 * 256) {
            float qb[16];
#pragma unroll
            for (int u = 0; u < 16; ++u) {
                const int idx = base + tid + u * 256, i = idx / dk, a = idx - i * dk;
                qb[u] = (idx < GC * dk && i < l) ? rows[(size_t)(c0 + i) * w + kh * dk + a] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 16; ++u) {
                const int idx = base + tid + u * 256, i = idx / dk, a = idx - i * dk;
                if (idx < GC * dk) {
                    Qt[idx] = qb[u] * expf(cum[i]);
                    Kt[idx] = i < l ? Ks[i * ks + a] * expf(last - cum[i]) : 0.0f;
                }
            }
        }
        __syncthreads();
        // T's four diagonal blocks: T_im = −A_im − Σ_{m<j<i} A_ij T_jm within a block, the sum
        // split over four lanes (tid & 3) and reduced by shuffles
        {
            const int b0 = (tid >> 6) * 16, m = (tid >> 2) & 15, part = tid & 3;
            for (int r = 1; r < 16; ++r) {
                const int i = b0 + r;
                float t = 0.0f;
                if (m < r)
                    for (int jj = m + 1 + part; jj < r; jj += 4)
                        t += sA[i * GCP + b0 + jj] * sT[(b0 + jj) * GCP + b0 + m];
                t += __shfl_xor_sync(0xffffffffu, t, 1);
                t += __shfl_xor_sync(0xffffffffu, t, 2);
                if (m < r && part == 0) sT[i * GCP + b0 + m] = -sA[i * GCP + b0 + m] - t;
                __syncthreads();
            }
        }
        // the blocks below the diagonal, level d = I − J: M = Σ_{J≤K<I} A_IK T_KJ, T_IJ = −T_II M
        for (int d = 1; d < 4; ++d) {
            const int pairs = 4 - d;
            for (int idx = tid; idx < pairs * 256; idx += blockDim.x) {
                const int J = idx >> 8, I = J + d, r = (idx >> 4) & 15, cc = idx & 15;
                float acc = 0.0f;
                for (int k = 16 * J; k < 16 * I; ++k)
                    acc += sA[(16 * I + r) * GCP + k] * sT[k * GCP + 16 * J + cc];
                sM[idx] = acc;
            }
            __syncthreads();
            for (int idx = tid; idx < pairs * 256; idx += blockDim.x) {
                const int J = idx >> 8, I = J + d, r = (idx >> 4) & 15, cc = idx & 15;
                float acc = 0.0f;
                for (int k = 0; k < 16; ++k)
                    acc += sT[(16 * I + r) * GCP + 16 * I + k] * sM[(J << 8) + k * 16 + cc];
                sT[(16 * I + r) * GCP + 16 * J + cc] = -acc;
            }
            __syncthreads();
        }
        // X = T·(β v) over dv columns, Y = T·(β e^c k) over dk columns (T unit lower triangular,
        // zero above its diagonal)
        for (int pass = 0; pass < 2; ++pass) {
            const int width = pass == 0 ? dv : dk, stride = pass == 0 ? vs : ks;
            const float* src = pass == 0 ? Vs : Ks;
            const float* sc = pass == 0 ? sx : sy;
            float* dst = pass == 0 ? X : Y;
            for (int cb = 0; cb < width; cb += 32) {
                const int col = cb + lane, cl = min(col, width - 1);
                for (int i = wp; i < l; i += 8) {
                    float x = 0.0f;
                    for (int m = 0; m <= i; m += 4) {
                        const float4 t = *(const float4*)&sT[i * GCP + m];
                        const float4 f = *(const float4*)&sc[m];
                        x += t.x * f.x * src[m * stride + cl] + t.y * f.y * src[(m + 1) * stride + cl]
                           + t.z * f.z * src[(m + 2) * stride + cl] + t.w * f.w * src[(m + 3) * stride + cl];
                    }
                    if (col < width) dst[(size_t)i * width + col] = x;
                }
            }
        }
    }
}

// One block of 256 threads per (value head, 32 value columns), chunk after chunk, the state
// tile S [dk][32] in shared memory: v' = X − Y·S, o = Q̃·S + P·v', S = e^{c_L} S + K̃ᵀ·v'.
// out = o [n, hv·dv], then the state after the last row [hv·dk·dv]. Shared: S, Y and Q̃ (then K̃)
// [GC][dk+4], P [GC][GCP], v' [GC][32].
extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_scan_f32(
    const float* __restrict__ rows, const float* __restrict__ init,
    const float* __restrict__ scratch, float* __restrict__ out, int n, int hk, int hv, int dk,
    int dv) {
    extern __shared__ float4 gc_sm4[];
    float* sm = (float*)gc_sm4;
    const int ks = dk + 4, d4 = dk / 4;
    float* S = sm;
    float* Ys = S + dk * 32;
    float* Qs = Ys + GC * ks;
    float* Ps = Qs + GC * ks;
    float* vn = Ps + GC * GCP;
    const int h = blockIdx.x, j0 = blockIdx.y * 32, nc = (n + GC - 1) / GC;
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5;
    const int vd = hv * dv;
    const bool live = j0 + lane < dv;
    const int j = live ? j0 + lane : 0;
    const size_t per = (size_t)GC * (dv + 3 * dk + GC) + GC;
    for (int a = wp; a < dk; a += 8) S[a * 32 + lane] = live ? init[((size_t)h * dk + a) * dv + j] : 0.0f;
    for (int c = 0; c < nc; ++c) {
        const int c0 = c * GC, l = min(GC, n - c0);
        const float* X = scratch + ((size_t)h * nc + c) * per;
        const float* Y = X + (size_t)GC * dv;
        const float* Qt = Y + (size_t)GC * dk;
        const float* Kt = Qt + (size_t)GC * dk;
        const float* P = Kt + (size_t)GC * dk;
        const float el = expf(P[GC * GC + l - 1]);
        float xv[8];
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            const int i = wp + 8 * r;
            xv[r] = (i < l && live) ? X[(size_t)i * dv + j] : 0.0f;
        }
        // Y, Q̃ and P: every load issued before the first store (dk ≤ 128: ≤ 8 float4 each)
        float4 yb[8], qb[8], pb[4];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int idx = tid + u * 256;
            if (idx < GC * d4) {
                yb[u] = *(const float4*)&Y[(size_t)idx * 4];
                qb[u] = *(const float4*)&Qt[(size_t)idx * 4];
            }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) pb[u] = *(const float4*)&P[(size_t)(tid + u * 256) * 4];
        __syncthreads();
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int idx = tid + u * 256, i = idx / d4, a = (idx - i * d4) * 4;
            if (idx < GC * d4) {
                *(float4*)&Ys[i * ks + a] = yb[u];
                *(float4*)&Qs[i * ks + a] = qb[u];
            }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int idx = tid + u * 256;
            *(float4*)&Ps[(idx >> 4) * GCP + (idx & 15) * 4] = pb[u];
        }
        __syncthreads();
        float av[8], ao[8];
#pragma unroll
        for (int r = 0; r < 8; ++r) av[r] = ao[r] = 0.0f;
        for (int a = 0; a < dk; a += 4) {
            const float4 s = make_float4(S[a * 32 + lane], S[(a + 1) * 32 + lane],
                                         S[(a + 2) * 32 + lane], S[(a + 3) * 32 + lane]);
#pragma unroll
            for (int r = 0; r < 8; ++r) {
                av[r] += dot4(*(const float4*)&Ys[(wp + 8 * r) * ks + a], s);
                ao[r] += dot4(*(const float4*)&Qs[(wp + 8 * r) * ks + a], s);
            }
        }
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            const int i = wp + 8 * r;
            vn[i * 32 + lane] = (i < l && live) ? xv[r] - av[r] : 0.0f;
        }
        __syncthreads();
        // o = Q̃·S + P·v' (P is zero above the diagonal); K̃ staged over Q̃ meanwhile
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            const int i = wp + 8 * r;
            if (i < l) {
                float o = ao[r];
                for (int m = 0; m <= i; m += 4) {
                    const float4 p = *(const float4*)&Ps[i * GCP + m];
                    o += p.x * vn[m * 32 + lane] + p.y * vn[(m + 1) * 32 + lane]
                       + p.z * vn[(m + 2) * 32 + lane] + p.w * vn[(m + 3) * 32 + lane];
                }
                if (live) out[(size_t)(c0 + i) * vd + h * dv + j] = o;
            }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int idx = tid + u * 256;
            if (idx < GC * d4) qb[u] = *(const float4*)&Kt[(size_t)idx * 4];
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int idx = tid + u * 256, i = idx / d4, a = (idx - i * d4) * 4;
            if (idx < GC * d4) *(float4*)&Qs[i * ks + a] = qb[u];
        }
        __syncthreads();
        // S = e^{c_L} S + K̃ᵀ v': thread → rows a = 32t + 4·wp + u of S, its column
        for (int a = 4 * wp; a < dk; a += 32) {
            float4 acc = make_float4(S[a * 32 + lane] * el, S[(a + 1) * 32 + lane] * el,
                                     S[(a + 2) * 32 + lane] * el, S[(a + 3) * 32 + lane] * el);
            for (int m = 0; m < l; ++m) {
                const float v = vn[m * 32 + lane];
                const float4 k = *(const float4*)&Qs[m * ks + a];
                acc.x += k.x * v;
                acc.y += k.y * v;
                acc.z += k.z * v;
                acc.w += k.w * v;
            }
            S[a * 32 + lane] = acc.x;
            S[(a + 1) * 32 + lane] = acc.y;
            S[(a + 2) * 32 + lane] = acc.z;
            S[(a + 3) * 32 + lane] = acc.w;
        }
    }
    __syncthreads();
    float* st = out + (size_t)n * vd;
    if (live)
        for (int a = wp; a < dk; a += 8) st[((size_t)h * dk + a) * dv + j] = S[a * 32 + lane];
}

// ---------------------------------------------------------------------------------------------
// The attention's per-head work between its projections and its attention
// (`crate::ops::qkv_rope`): grid (⌈b · max(nq, n) / RB⌉, hq + 2·hkv heads), blockDim (D/2 rounded
// up to a warp, RB rows); thread (e, y) holds features e and e + D/2 (the pair RoPE rotates) of
// row f = x·RB + y (of the `rows` = b · max(nq, n)): row i = f mod max(nq, n) of sequence s = f /
// max(nq, n), of the nq query rows for a query head (hh < hq), of the n new K/V rows for a key
// (hq ≤ hh < hq + hkv) or value head; a row past its kind's count writes nothing. Example:
// SmolLM2's prefill of 16 × 1,024 rows (D = 64): blocks of 8 rows × 32 threads, 2,048 per head. A
// query head is normed per head when flags & 1, rotated with its table (qcos, qsin), written to
// qo [b, hq, nq, D]; a key head normed when flags & 2, rotated with (cos, sin); value heads
// copied. Keys and values go to the cache buffers kc, vc [b, hkv, cap, D] at row
// index[((s·hkv)·n + i)·D] (flags & 4: the fixed layout's device index) or first + i (append).
// Table row: sequence row s·rows + i when flags & 8 (one table per sequence), else i. Source row
// s·rows + i at ld values per row (q, k, v: views of one fused product or separate products).
// The normed value is rounded to T before RoPE, as the unfused RMSNorm's output is; the rotation
// is in f32, rounded once. The target: nq = n, one table; the drafter: nq = the block's rows, n =
// the context's and the block's.
// ---------------------------------------------------------------------------------------------
// The sum of x over the blockDim.x threads of this thread's row threadIdx.y (blockDim.x a
// multiple of 32, blockDim.x · blockDim.y at most 1,024). `sh` holds 32 floats.
__device__ float row_sum(float x, float* sh) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
    const int nw = blockDim.x / 32;
    if (nw == 1) return x;
    __syncthreads();
    if (threadIdx.x % 32 == 0) sh[threadIdx.y * nw + threadIdx.x / 32] = x;
    __syncthreads();
    float t = 0.0f;
    for (int w = 0; w < nw; w++) t += sh[threadIdx.y * nw + w];
    return t;
}

__device__ __forceinline__ float rnd(float x, const float*) { return x; }
__device__ __forceinline__ float rnd(float x, const __nv_bfloat16*) {
    return __bfloat162float(__float2bfloat16(x));
}

template <typename T>
__device__ void qkv_rope(const T* q, const T* k, const T* v, int ldq, int ldk, int ldv,
                         const T* qcos, const T* qsin, const T* cos, const T* sin, const T* qw,
                         const T* kw, float eps, const uint32_t* index, T* qo, T* kc, T* vc,
                         int nq, int n, int hq, int hkv, int D, int cap, int first, int flags,
                         int rows) {
    __shared__ float sh[32];
    const int hh = blockIdx.y, kind = hh < hq ? 0 : (hh < hq + hkv ? 1 : 2);
    const int maxn = max(nq, n), f = blockIdx.x * blockDim.y + threadIdx.y;
    const int s = f / maxn, i = f % maxn, count = kind == 0 ? nq : n;
    const int row = s * count + i;
    const int half = D / 2, e = threadIdx.x;
    const bool act = e < half && f < rows && i < count;
    const int h = kind == 0 ? hh : (kind == 1 ? hh - hq : hh - hq - hkv);
    const T* src = kind == 0 ? q + (size_t)row * ldq : (kind == 1 ? k + (size_t)row * ldk
                                                                  : v + (size_t)row * ldv);
    src += (size_t)h * D;
    float x1 = act ? ld(src, e) : 0.0f, x2 = act ? ld(src, e + half) : 0.0f;
    const bool norm = (kind == 0 && (flags & 1)) || (kind == 1 && (flags & 2));
    if (norm) {  // the same for the whole block
        const T* w = kind == 0 ? qw : kw;
        float r = rsqrtf(row_sum(x1 * x1 + x2 * x2, sh) / D + eps);
        if (act) {
            x1 = rnd(x1 * r * ld(w, e), q);
            x2 = rnd(x2 * r * ld(w, e + half), q);
        }
    }
    if (!act) return;
    if (kind < 2) {
        size_t t = ((flags & 8) ? (size_t)row : (size_t)i) * half + e;
        float c = ld(kind == 0 ? qcos : cos, t), sn = ld(kind == 0 ? qsin : sin, t);
        float y1 = x1 * c - x2 * sn, y2 = x1 * sn + x2 * c;
        x1 = y1;
        x2 = y2;
    }
    if (kind == 0) {
        size_t o = (((size_t)s * hq + h) * nq + i) * D;
        st(qo, o + e, x1);
        st(qo, o + e + half, x2);
    } else {
        uint32_t r = (flags & 4) ? index[((size_t)s * hkv * n + i) * D] : (uint32_t)(first + i);
        T* dst = kind == 1 ? kc : vc;
        size_t o = (((size_t)s * hkv + h) * cap + r) * D;
        st(dst, o + e, x1);
        st(dst, o + e + half, x2);
    }
}

#define QKV_ROPE(NAME, T)                                                                          \
    extern "C" __global__ void qkv_rope_##NAME(                                                    \
        const T* q, const T* k, const T* v, int ldq, int ldk, int ldv, const T* qcos,              \
        const T* qsin, const T* cos, const T* sin, const T* qw, const T* kw, float eps,            \
        const uint32_t* index, T* qo, T* kc, T* vc, int nq, int n, int hq, int hkv, int D, int cap, \
        int first, int flags, int rows) {                                                          \
        qkv_rope<T>(q, k, v, ldq, ldk, ldv, qcos, qsin, cos, sin, qw, kw, eps, index, qo, kc, vc,  \
                    nq, n, hq, hkv, D, cap, first, flags, rows);                                   \
    }
QKV_ROPE(f32, float)
QKV_ROPE(bf16, __nv_bfloat16)

// The residual add and the RMSNorm after it (`crate::ops::add_norm`): one block per row of
// `width` ≤ 8 · blockDim values, each thread's at most 8 values held in registers (their loads
// issued together); y [2, rows, width]: the sums (rounded to T, as the unfused add stores them)
// then norm(sum) · w, the norm computed from the rounded sums.
template <typename T>
__device__ void add_rms_norm(const T* x, const T* h, const T* w, T* y, int width, float eps) {
    __shared__ float sh[32];
    const size_t row = blockIdx.x, rows = gridDim.x, o = row * width;
    float v[8];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int c = threadIdx.x + j * blockDim.x;
        v[j] = c < width ? rnd(ld(x, o + c) + ld(h, o + c), x) : 0.0f;
        ss += v[j] * v[j];
    }
    float r = rsqrtf(block_sum(ss, sh) / width + eps);
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int c = threadIdx.x + j * blockDim.x;
        if (c < width) {
            st(y, o + c, v[j]);
            st(y, rows * width + o + c, r * v[j] * ld(w, c));
        }
    }
}

#define ADD_RMS_NORM(NAME, T)                                                                      \
    extern "C" __global__ void add_rms_norm_##NAME(const T* x, const T* h, const T* w, T* y,       \
                                                   int width, float eps) {                         \
        add_rms_norm<T>(x, h, w, y, width, eps);                                                   \
    }
ADD_RMS_NORM(f32, float)
ADD_RMS_NORM(bf16, __nv_bfloat16)

// A fixed-layout cache write (`crate::ops::scatter_rows`): element i = ((bh·n + j)·d + e) of the
// new rows [b·h, n, d] goes to row index[i] of buffer bh [cap, d].
template <typename T>
__device__ void scatter_rows(const T* src, const uint32_t* index, T* dst, unsigned long long n,
                             unsigned long long d, unsigned long long cap, unsigned long long total) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned long long bh = i / (n * d), e = i % d;
        dst[(bh * cap + index[i]) * d + e] = src[i];
    }
}

#define SCATTER_ROWS(NAME, T)                                                                      \
    extern "C" __global__ void scatter_rows_##NAME(const T* src, const uint32_t* index, T* dst,    \
        unsigned long long n, unsigned long long d, unsigned long long cap,                        \
        unsigned long long total) {                                                                \
        scatter_rows<T>(src, index, dst, n, d, cap, total);                                        \
    }
SCATTER_ROWS(f32, float)
SCATTER_ROWS(bf16, __nv_bfloat16)

// A tree's kept rows moved down in every K/V buffer at once (`crate::ops::keep_rows`): `table`
// holds the `buffers` buffers' addresses, then the `m` source rows; buffer p is [bh, cap, d].
// Thread i owns column e of head row-block c of buffer p and walks the moves in order:
// row fixed + j ← row moved[j]. The rows ascend with moved[j] >= fixed + j (the host checks),
// so no row is written before a later move reads it. Example: fixed 10, moved [11, 12]:
// row 10 ← 11, then row 11 ← 12.
template <typename T>
__device__ void keep_rows(const unsigned long long* table, unsigned long long buffers,
                          unsigned long long bh, unsigned long long cap, unsigned long long d,
                          unsigned long long fixed, unsigned long long m) {
    unsigned long long total = buffers * bh * d;
    const unsigned long long* moved = table + buffers;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned long long p = i / (bh * d), c = (i / d) % bh, e = i % d;
        T* col = reinterpret_cast<T*>(table[p]) + c * cap * d + e;
        for (unsigned long long j = 0; j < m; ++j) col[(fixed + j) * d] = col[moved[j] * d];
    }
}

#define KEEP_ROWS(NAME, T)                                                                         \
    extern "C" __global__ void keep_rows_##NAME(const unsigned long long* table,                   \
        unsigned long long buffers, unsigned long long bh, unsigned long long cap,                 \
        unsigned long long d, unsigned long long fixed, unsigned long long m) {                    \
        keep_rows<T>(table, buffers, bh, cap, d, fixed, m);                                        \
    }
KEEP_ROWS(f32, float)
KEEP_ROWS(bf16, __nv_bfloat16)

// y = x · Wᵀ for one row x [K] and W [O, K] (`crate::ops::gemv`): warp o of the grid computes
// y[o]; lanes take 16-byte vectors i = lane, lane + 32, … of W's row o and of x (K a multiple
// of 8), four loads in flight; f32 sums reduced by shuffles.
template <typename T>
__device__ void gemv(const T* x, const T* w, T* y, int K, int O) {
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
    if (lane == 0) st(y, o, acc);
}

#define GEMV(NAME, T)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) gemv_##NAME(const T* x, const T* w, T* y,   \
                                                                  int K, int O) {                  \
        gemv<T>(x, w, y, K, O);                                                                    \
    }
GEMV(f32, float)
GEMV(bf16, __nv_bfloat16)

// softmax(scores · scale + mask) per row (`crate::ops::masked_softmax`): one block per score row
// of t columns; score row r of sequence s = r / per_seq uses mask row (r mod n), plus s·n when
// the mask holds one per sequence (batched). A row with nothing visible gives zeros.
template <typename T>
__device__ void masked_softmax(const T* s, const T* mask, T* p, int t, int n, int per_seq,
                               int batched, float scale) {
    __shared__ float sh[32];
    const size_t r = blockIdx.x, o = r * t;
    const size_t mo = ((batched ? (r / per_seq) * n : 0) + (r % n)) * (size_t)t;
    float mx = NEG_INF;
    for (int c = threadIdx.x; c < t; c += blockDim.x) mx = fmaxf(mx, ld(s, o + c) * scale + ld(mask, mo + c));
    mx = block_max(mx, sh);
    float sum = 0.0f;
    if (mx != NEG_INF)
        for (int c = threadIdx.x; c < t; c += blockDim.x) sum += expf(ld(s, o + c) * scale + ld(mask, mo + c) - mx);
    sum = block_sum(sum, sh);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int c = threadIdx.x; c < t; c += blockDim.x) {
        float v = mx == NEG_INF ? 0.0f : expf(ld(s, o + c) * scale + ld(mask, mo + c) - mx) * inv;
        st(p, o + c, v);
    }
}

#define MASKED_SOFTMAX(NAME, T)                                                                    \
    extern "C" __global__ void masked_softmax_##NAME(const T* s, const T* mask, T* p, int t,       \
                                                     int n, int per_seq, int batched, float scale) { \
        masked_softmax<T>(s, mask, p, t, n, per_seq, batched, scale);                              \
    }
MASKED_SOFTMAX(f32, float)
MASKED_SOFTMAX(bf16, __nv_bfloat16)

#include "mma_attn.cuh"
#include "train_attn.cuh"
