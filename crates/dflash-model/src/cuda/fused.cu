// dflash-rs's own kernels: the block-masked softmax of the drafter's training attention, the
// fused cross-entropy of its loss, the interval-masked softmax of the target's attention, and
// the AdamW step (two element-wise kernels; `adamw.rs`).
// Compiled to PTX by build.rs (feature `cuda`), loaded by `crate::cuda_kernels`. The CPU twins
// of every kernel live in the Rust modules that launch them (`block_softmax.rs`,
// `cross_entropy.rs`, `interval_softmax.rs`); `crate::kernel_check` compares the two.
//
// Every kernel: one CUDA block per row, a strided loop per thread, block reductions through
// warp shuffles and one shared-memory slot per warp. Arithmetic in f32 whatever the storage.

#include <cuda_bf16.h>
#include <stdint.h>

#define NEG_INF __int_as_float(0xff800000)

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

__device__ float block_sum(float x, float* sh) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
    int w = threadIdx.x / 32, l = threadIdx.x % 32, nw = blockDim.x / 32;
    __syncthreads();
    if (l == 0) sh[w] = x;
    __syncthreads();
    x = l < nw ? sh[l] : 0.0f;
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

// AdamW, f32 master weights, element-wise with a grid-stride loop. Every operation is rounded
// as the CPU twin rounds it (`x * mul + add` as two IEEE operations, no fused multiply-add), so
// the two agree bit for bit. `mv` holds the first moments (n values), then the second.
__device__ __forceinline__ float aff(float x, float mul, float add) {
    return __fadd_rn(__fmul_rn(x, mul), add);
}

extern "C" __global__ void adamw_moments_f32(float* mv, const float* g, unsigned long long n,
    float b1, float omb1, float b2, float omb2) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float gi = g[i];
        mv[i] = __fadd_rn(aff(mv[i], b1, 0.0f), aff(gi, omb1, 0.0f));
        mv[n + i] = __fadd_rn(aff(mv[n + i], b2, 0.0f), aff(__fmul_rn(gi, gi), omb2, 0.0f));
    }
}

extern "C" __global__ void adamw_apply_f32(float* p, const float* mv, unsigned long long n,
    float inv_c1, float inv_c2, float eps, float decay, float lr) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float mhat = aff(mv[i], inv_c1, 0.0f);
        float vhat = aff(mv[n + i], inv_c2, 0.0f);
        float upd = __fdiv_rn(mhat, aff(__fsqrt_rn(vhat), 1.0f, eps));
        p[i] = __fsub_rn(aff(p[i], decay, 0.0f), aff(upd, lr, 0.0f));
    }
}

// ---------------------------------------------------------------------------------------------
// The gated delta rule's recurrence over a forward's new rows (`gdn_recurrence.rs`; its CPU
// twin `recurrence_host`). One block per (value head h, 32 value columns); 128 threads = 4
// slices of the key dimension × 32 columns; the block's state tile S[dk][32] in shared memory.
// rows[i] = q | k | v | β | g (2·hk·dk + hv·dv + 2·hv floats); parents[i] = the row whose state
// row i starts from (0xffffffff: the committed state `init`). out = o [n, hv·dv], then the
// states [n, hv·dk·dv] (keep) or the state after the last row (!keep; rows form a chain).
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
    float* states = out + o_len;
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
    const float* consts, float* out, int hk, int hv, int dk, int dv, int K) {
    const int i = blockIdx.x;
    const int kd = hk * dk, vd = hv * dv, c = 2 * kd + vd, w = c + 2 * hv;
    // the zero row is the buffer's last: (K - 1) + n, with n = gridDim.x
    const uint32_t zero_row = (uint32_t)(K - 1 + gridDim.x);
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
