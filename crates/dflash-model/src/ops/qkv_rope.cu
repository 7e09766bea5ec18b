#include "../cuda/common.cuh"

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
// Table row: sequence row s·rows + i when flags & 8 (one table per sequence), else i; a table row
// holds R/2 (cos, sin) pairs. Source row s·rows + i at ld values per row (q, k, v: views of one
// fused product or separate products); query head h starts at h·qhs (D, or 2·D where the queries
// are gated: [query | gate] per head, qwen3_5). Partial RoPE (R < D, qwen3_5: R = D/4) rotates
// features f < R with f ± R/2 and passes the rest through: the pairs then meet in shared memory
// (at most 256 threads a block). The normed value is rounded to T before RoPE, as the unfused
// RMSNorm's output is; the rotation is in f32, rounded once. The target: nq = n, one table; the
// drafter: nq = the block's rows, n = the context's and the block's. Example (Qwen3.6-27B's
// gated attention, D = 256, R = 64): thread e = 5 holds features 5 and 133; feature 5 becomes
// x5·cos5 − x37·sin5, feature 133 passes through.
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


template <typename T, typename W, bool ONE_PLUS>
__device__ void qkv_rope(const T* q, const T* k, const T* v, int ldq, int ldk, int ldv, int qhs,
                         const T* qcos, const T* qsin, const T* cos, const T* sin, const W* qw,
                         const W* kw, float eps, const uint32_t* index, T* qo, T* kc, T* vc,
                         int nq, int n, int hq, int hkv, int D, int R, int cap, int first,
                         int flags, int rows) {
    __shared__ float sh[32];
    // a partial rotation's rows (R < D): feature f's partner f ± R/2 is another thread's
    __shared__ float part[512];
    const int hh = blockIdx.y, kind = hh < hq ? 0 : (hh < hq + hkv ? 1 : 2);
    const int maxn = max(nq, n), f = blockIdx.x * blockDim.y + threadIdx.y;
    const int s = f / maxn, i = f % maxn, count = kind == 0 ? nq : n;
    const int row = s * count + i;
    const int half = D / 2, e = threadIdx.x;
    const bool act = e < half && f < rows && i < count;
    const int h = kind == 0 ? hh : (kind == 1 ? hh - hq : hh - hq - hkv);
    const T* src = kind == 0 ? q + (size_t)row * ldq + (size_t)h * qhs
                             : (kind == 1 ? k + (size_t)row * ldk : v + (size_t)row * ldv) +
                                   (size_t)h * D;
    float x1 = act ? ld(src, e) : 0.0f, x2 = act ? ld(src, e + half) : 0.0f;
    const bool norm = (kind == 0 && (flags & 1)) || (kind == 1 && (flags & 2));
    if (norm) {  // the same for the whole block
        const W* w = kind == 0 ? qw : kw;
        float r = rsqrtf(row_sum(x1 * x1 + x2 * x2, sh) / D + eps);
        if (act) {
            float w1 = ld(w, e), w2 = ld(w, e + half);
            x1 = rnd(ONE_PLUS ? x1 * r * (1.0f + w1) : x1 * r * w1, q);
            x2 = rnd(ONE_PLUS ? x2 * r * (1.0f + w2) : x2 * r * w2, q);
        }
    }
    if (kind < 2) {  // the same for the whole block
        const int hr = R / 2;
        const size_t t = ((flags & 8) ? (size_t)row : (size_t)i) * hr;
        const T* tc = kind == 0 ? qcos : cos;
        const T* ts = kind == 0 ? qsin : sin;
        if (R == D) {
            if (act) {
                float c = ld(tc, t + e), sn = ld(ts, t + e);
                float y1 = x1 * c - x2 * sn, y2 = x1 * sn + x2 * c;
                x1 = y1;
                x2 = y2;
            }
        } else {
            float* buf = part + threadIdx.y * 2 * blockDim.x;
            if (e < half) {
                buf[e] = x1;
                buf[e + half] = x2;
            }
            __syncthreads();
            if (act) {
                float y[2] = {x1, x2};
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int g = e + j * half, col = g % hr;
                    if (g >= R) continue;
                    const float c = ld(tc, t + col), sn = ld(ts, t + col);
                    y[j] = g < hr ? buf[g] * c - buf[g + hr] * sn : buf[g] * c + buf[g - hr] * sn;
                }
                x1 = y[0];
                x2 = y[1];
            }
        }
    }
    if (!act) return;
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

// QKV_ROPE: plain norm weights of the storage type; the _1p kernels: zero-centred weights
// (qwen3_5) kept in f32, `norm(x) · (1 + w)` as `RmsNorm::zero_centred`.
#define QKV_ROPE(NAME, T, W, ONE_PLUS)                                                             \
    extern "C" __global__ void NAME(                                                               \
        const T* q, const T* k, const T* v, int ldq, int ldk, int ldv, int qhs, const T* qcos,     \
        const T* qsin, const T* cos, const T* sin, const W* qw, const W* kw, float eps,            \
        const uint32_t* index, T* qo, T* kc, T* vc, int nq, int n, int hq, int hkv, int D, int R,  \
        int cap, int first, int flags, int rows) {                                                 \
        qkv_rope<T, W, ONE_PLUS>(q, k, v, ldq, ldk, ldv, qhs, qcos, qsin, cos, sin, qw, kw, eps,   \
                                 index, qo, kc, vc, nq, n, hq, hkv, D, R, cap, first, flags,       \
                                 rows);                                                            \
    }
QKV_ROPE(qkv_rope_f32, float, float, false)
QKV_ROPE(qkv_rope_bf16, __nv_bfloat16, __nv_bfloat16, false)
QKV_ROPE(qkv_rope_1p_f32, float, float, true)
QKV_ROPE(qkv_rope_1p_bf16, __nv_bfloat16, float, true)
