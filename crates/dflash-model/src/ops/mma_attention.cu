#include "../cuda/common.cuh"
#include "../cuda/mma.cuh"

// Interval attention on the tensor cores (the primitives in src/cuda/mma.cuh), scores never
// written to memory; the twin is the matmuls around the interval softmax
// (`crate::layers::attention::attend_intervals_unfused`). Launched through
// `crate::ops::interval_attention` (`crate::ops::prefill_attention` decides the prefill) and
// `crate::ops::train_attention`. Four kernels share one body:
// - prefill_attn_*: many query rows of a sequence, each over one interval of keys (a target's
//   causal prefill, a training row's packed segments, a regeneration's batched prefill). A block
//   takes 64 query rows of one query head of one sequence.
// - verify_attn_*: at most 64 query rows per K/V head (a chain's verify: 16 rows × the query
//   heads of a K/V head). A block takes all R = g · n rows of one K/V head of one sequence as
//   "virtual rows" (row r is query head h·g + r / n, query row r % n, as interval_attn numbers
//   them), so a K/V tile feeds every grouped head, and one split of the keys: one split writes
//   the normalised output, several write (acc, m, l) to `part` in interval_attn's layout for
//   interval_attn_merge.
// - verify_tree_attn_*_w4 / _w8: verify_attn for a tree's verify (DDTree): each row sees its
//   interval [lo, hi) and the columns hi + i whose bit i is set in its 64-bit window (its
//   ancestors past the interval, `dflash_core::visibility::Visibility::row_window`), four words
//   per row; 4 warps for up to 64 virtual rows, 8 for up to 128. The twin is the interval
//   softmax over the same words on the CPU.
// - train_attn_fwd_*: the drafter's training attention (`crate::ops::train_attention`, whose twin
//   is `crate::ops::block_attention::attend_blocks`): as prefill_attn, but each row sees two
//   intervals (its context keys and its own block's), walked as two spans of tiles, and the
//   row's log-sum-exp (base 2, the scale folded in) is written to `part` for the backward
//   (`train_attention/kernels.cu`).
//
// A block of 4 warps (each 16 of its 64 rows; 8 warps and 128 rows in verify_tree_attn_*_w8) walks the union of its rows' intervals (its split
// of it) in tiles of BC keys, double-buffered in shared memory by cp.async. Per tile a warp
// computes S = Q·Kᵀ (16 × BC) with mma.sync m16n8k16 (bf16 in, f32 accumulate), hides the keys
// outside each row's interval, updates its rows' online softmax (base 2, the scale folded in)
// and accumulates O += P·V with P rounded to bf16 straight from the S fragments and V's
// fragments read transposed by ldmatrix. K/V are read in place (`[b, hkv, t, D]`, rows of D
// values, heads `hs` apart); query head hh reads K/V head hh / g. Rows with an empty interval
// write zeros, as the twin does.
//
// Fragment layout of m16n8k16 (lane = 4·gr + tq): A row gr / gr + 8, columns 2tq, 2tq + 1 (and
// + 8); B column gr, rows 2tq, 2tq + 1 (and + 8); C row gr / gr + 8, columns 2tq, 2tq + 1.
// Examples: Qwen3-8B's target features on a 2,048-token row (32 / 8 heads of 128): 32 row tiles
// × 32 heads = 1,024 prefill blocks; the block of rows 960..1024 walks keys 0..1024 in 32 tiles
// of 32. Its 16-row verify after 512 cached rows: R = 4 · 16 = 64 virtual rows per K/V head,
// 8 heads × 16 splits = 128 verify blocks, each over 33 or 34 keys of the 528 (two tiles).

// VERIFY = false: prefill_attn's block (grid: row tiles × query heads × sequences); true:
// verify_attn's (grid: sequences · K/V heads × splits).
// TREE (VERIFY true): four words per row, an interval and a window of 64 columns from its end.
template <int D, int BC, bool VERIFY, bool TRAIN = false, bool TREE = false>
__device__ void mma_attn(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                         const uint32_t* iv, __nv_bfloat16* out, float* part, int hq, int hkv,
                         int n, long long hs, float scale) {
    constexpr int LD = D + 8;       // shared row stride in values (16-byte pad: no bank conflicts)
    constexpr int KC = D / 16;      // k-chunks of Q·Kᵀ
    constexpr int DT = D / 8;       // n-tiles of O
    constexpr int ST = BC / 8;      // n-tiles of S
    constexpr int VPR = D / 8;      // 16-byte vectors per K/V row
    __shared__ __align__(16) __nv_bfloat16 ks[2 * BC * LD];
    __shared__ __align__(16) __nv_bfloat16 vs[2 * BC * LD];
    __shared__ uint32_t span[4];
    constexpr int IW = TRAIN || TREE ? 4 : 2;  // interval words per row
    const int g = hq / hkv;
    const int s = VERIFY ? blockIdx.x / hkv : blockIdx.z;
    const int h = VERIFY ? blockIdx.x % hkv : blockIdx.y / g;
    const int r0 = VERIFY ? 0 : blockIdx.x * 64;
    const int R = VERIFY ? g * n : n;  // the rows this block numbers (virtual rows when VERIFY)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
    const int ra = r0 + warp * 16 + gr, rb = ra + 8;
    // row r's query head and query row
    auto head = [&](int r) { return VERIFY ? h * g + r / n : (int)blockIdx.y; };
    auto row = [&](int r) { return VERIFY ? r % n : r; };
    // row ra's and rb's intervals: [lo, hi) and (TRAIN) [lo2, hi2)
    uint32_t lo_a = 0, hi_a = 0, lo_b = 0, hi_b = 0, lo2_a = 0, hi2_a = 0, lo2_b = 0, hi2_b = 0;
    uint64_t bits_a = 0, bits_b = 0;  // TREE: the windows past hi_a, hi_b
    if (ra < R) {
        const uint32_t* p = iv + IW * ((size_t)s * n + row(ra));
        lo_a = p[0];
        hi_a = p[1];
        if constexpr (TRAIN) {
            lo2_a = p[2];
            hi2_a = p[3];
        }
        if constexpr (TREE) bits_a = (uint64_t)p[2] | (uint64_t)p[3] << 32;
    }
    if (rb < R) {
        const uint32_t* p = iv + IW * ((size_t)s * n + row(rb));
        lo_b = p[0];
        hi_b = p[1];
        if constexpr (TRAIN) {
            lo2_b = p[2];
            hi2_b = p[3];
        }
        if constexpr (TREE) bits_b = (uint64_t)p[2] | (uint64_t)p[3] << 32;
    }
    // the union of the block's non-empty intervals, and of this warp's (per interval)
    if (threadIdx.x == 0) {
        span[0] = span[2] = 0xffffffffu;
        span[1] = span[3] = 0;
    }
    __syncthreads();
    uint32_t wlo, whi, wlo2 = 0, whi2 = 0;
    if constexpr (TREE) {
        // a row's keys lie in [lo, hi) ∪ [hi, hi + the window's highest bit + 1)
        const uint32_t ea = bits_a ? hi_a + 64 - __clzll((long long)bits_a) : hi_a;
        const uint32_t eb = bits_b ? hi_b + 64 - __clzll((long long)bits_b) : hi_b;
        warp_span(lo_a < hi_a ? lo_a : hi_a, ea, lo_b < hi_b ? lo_b : hi_b, eb, wlo, whi, span);
    } else {
        warp_span(lo_a, hi_a, lo_b, hi_b, wlo, whi, span);
    }
    if constexpr (TRAIN) warp_span(lo2_a, hi2_a, lo2_b, hi2_b, wlo2, whi2, span + 2);
    __syncthreads();
    // this block's keys: the union [lo, hi) of its rows' intervals, or its split's whole tiles
    // of it (split j of `splits` takes tiles j·per .. (j + 1)·per; the last may end at hi);
    // TRAIN: then the union [lo2, hi2) of the second intervals
    uint32_t lo = span[0], hi = span[1];
    const uint32_t lo2 = TRAIN ? span[2] : 0, hi2 = TRAIN ? span[3] : 0;
    if (VERIFY && lo < hi) {
        const uint32_t per = ((hi - lo + BC - 1) / BC + gridDim.y - 1) / gridDim.y;
        const uint32_t c0 = min(hi, lo + blockIdx.y * per * BC);
        hi = min(hi, c0 + per * BC);
        lo = c0;
    }
    const int tiles1 = lo < hi ? (int)((hi - lo + BC - 1) / BC) : 0;
    const int tiles = tiles1 + (TRAIN && lo2 < hi2 ? (int)((hi2 - lo2 + BC - 1) / BC) : 0);
    // tile i's first key and the end of its span
    auto first = [&](int i) { return i < tiles1 ? lo + (uint32_t)i * BC : lo2 + (uint32_t)(i - tiles1) * BC; };
    auto last = [&](int i) { return i < tiles1 ? hi : hi2; };

    // this warp's queries as A fragments, straight from global memory
    const __nv_bfloat16* qra = q + (((size_t)s * hq + head(ra)) * n + row(ra)) * D;
    const __nv_bfloat16* qrb = q + (((size_t)s * hq + head(rb)) * n + row(rb)) * D;
    uint32_t qa[KC][4];
#pragma unroll
    for (int kk = 0; kk < KC; kk++) {
        const int c = kk * 16 + 2 * tq;
        qa[kk][0] = ra < R ? *reinterpret_cast<const uint32_t*>(qra + c) : 0u;
        qa[kk][1] = rb < R ? *reinterpret_cast<const uint32_t*>(qrb + c) : 0u;
        qa[kk][2] = ra < R ? *reinterpret_cast<const uint32_t*>(qra + c + 8) : 0u;
        qa[kk][3] = rb < R ? *reinterpret_cast<const uint32_t*>(qrb + c + 8) : 0u;
    }
    float o[DT][4];
#pragma unroll
    for (int j = 0; j < DT; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;
    const float sl2 = scale * 1.4426950408889634f;
    const __nv_bfloat16* kb = k + ((size_t)s * hkv + h) * hs;
    const __nv_bfloat16* vb = v + ((size_t)s * hkv + h) * hs;

    // tile i's K and V rows into buffer i & 1 (rows at or past hi zero-filled)
    auto issue = [&](int i) {
        const uint32_t t0 = first(i), end = last(i);
        __nv_bfloat16* kd = ks + (i & 1) * BC * LD;
        __nv_bfloat16* vd = vs + (i & 1) * BC * LD;
        for (int idx = threadIdx.x; idx < 2 * BC * VPR; idx += blockDim.x) {
            const int kv = idx / (BC * VPR), j = (idx / VPR) % BC, e = idx % VPR;
            const uint32_t c = t0 + j;
            const bool in = c < end;
            const __nv_bfloat16* src = (kv ? vb : kb) + (in ? (size_t)c * D + e * 8 : 0);
            cp_async16((kv ? vd : kd) + j * LD + e * 8, src, in ? 16 : 0);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    if (tiles > 0) issue(0);
    for (int i = 0; i < tiles; i++) {
        if (i + 1 < tiles) {
            issue(i + 1);
            asm volatile("cp.async.wait_group 1;\n" ::);
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::);
        }
        __syncthreads();
        const uint32_t t0 = first(i);
        const bool warp_sees = i < tiles1 ? (t0 < whi && t0 + BC > wlo) : (t0 < whi2 && t0 + BC > wlo2);
        if (warp_sees) {
            const __nv_bfloat16* kt = ks + (i & 1) * BC * LD;
            const __nv_bfloat16* vt = vs + (i & 1) * BC * LD;
            float sc[ST][4];
#pragma unroll
            for (int j = 0; j < ST; j++) {
                sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
                const __nv_bfloat16* kr = kt + (j * 8 + gr) * LD + 2 * tq;
#pragma unroll
                for (int kk = 0; kk < KC; kk++) {
                    const uint32_t b0 = *reinterpret_cast<const uint32_t*>(kr + kk * 16);
                    const uint32_t b1 = *reinterpret_cast<const uint32_t*>(kr + kk * 16 + 8);
                    mma_bf16(sc[j], qa[kk], b0, b1);
                }
            }
            // each row's interval, scaled to base 2; the row maxima over the quad
            float mx_a = NEG_INF, mx_b = NEG_INF;
#pragma unroll
            for (int j = 0; j < ST; j++) {
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    const uint32_t key = t0 + j * 8 + 2 * tq + (c & 1);
                    bool vis = c < 2 ? (key >= lo_a && key < hi_a) : (key >= lo_b && key < hi_b);
                    if constexpr (TRAIN)
                        vis = vis || (c < 2 ? (key >= lo2_a && key < hi2_a) : (key >= lo2_b && key < hi2_b));
                    if constexpr (TREE) {
                        const uint32_t off = key - (c < 2 ? hi_a : hi_b);  // wraps below hi
                        vis = vis || (off < 64u && (((c < 2 ? bits_a : bits_b) >> off) & 1ull));
                    }
                    sc[j][c] = vis ? sc[j][c] * sl2 : NEG_INF;
                }
                mx_a = fmaxf(mx_a, fmaxf(sc[j][0], sc[j][1]));
                mx_b = fmaxf(mx_b, fmaxf(sc[j][2], sc[j][3]));
            }
#pragma unroll
            for (int off = 1; off < 4; off <<= 1) {
                mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, off));
                mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, off));
            }
            const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
            // a row that has seen no key yet keeps 0 as its reference (no inf − inf)
            const float ref_a = mn_a == NEG_INF ? 0.0f : mn_a;
            const float ref_b = mn_b == NEG_INF ? 0.0f : mn_b;
            const float al_a = exp2f(m_a - ref_a), al_b = exp2f(m_b - ref_b);
            m_a = mn_a;
            m_b = mn_b;
            float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
            for (int j = 0; j < ST; j++) {
                sc[j][0] = exp2f(sc[j][0] - ref_a);
                sc[j][1] = exp2f(sc[j][1] - ref_a);
                sc[j][2] = exp2f(sc[j][2] - ref_b);
                sc[j][3] = exp2f(sc[j][3] - ref_b);
                sum_a += sc[j][0] + sc[j][1];
                sum_b += sc[j][2] + sc[j][3];
            }
            l_a = l_a * al_a + sum_a;  // this lane's part; the quad sums at the end
            l_b = l_b * al_b + sum_b;
#pragma unroll
            for (int j = 0; j < DT; j++) {
                o[j][0] *= al_a;
                o[j][1] *= al_a;
                o[j][2] *= al_b;
                o[j][3] *= al_b;
            }
            // O += P·V, 16 keys at a time; ldmatrix.trans gives V's B fragments of two n-tiles
            const int mat = lane >> 3, rr = lane & 7;
#pragma unroll
            for (int kc = 0; kc < BC / 16; kc++) {
                uint32_t pa[4];
                pa[0] = pack_bf16(sc[2 * kc][0], sc[2 * kc][1]);
                pa[1] = pack_bf16(sc[2 * kc][2], sc[2 * kc][3]);
                pa[2] = pack_bf16(sc[2 * kc + 1][0], sc[2 * kc + 1][1]);
                pa[3] = pack_bf16(sc[2 * kc + 1][2], sc[2 * kc + 1][3]);
                const __nv_bfloat16* vr = vt + (kc * 16 + (mat & 1) * 8 + rr) * LD + (mat >> 1) * 8;
#pragma unroll
                for (int j = 0; j < DT; j += 2) {
                    uint32_t b0, b1, b2, b3;
                    const uint32_t addr = (uint32_t)__cvta_generic_to_shared(vr + j * 8);
                    asm volatile(
                        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                        : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                        : "r"(addr));
                    mma_bf16(o[j], pa, b0, b1);
                    mma_bf16(o[j + 1], pa, b2, b3);
                }
            }
        }
        __syncthreads();  // the buffer is refilled two tiles on
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        l_a += __shfl_xor_sync(0xffffffffu, l_a, off);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, off);
    }
    if (VERIFY && gridDim.y > 1) {
        // this split's (acc, m, l) per row: m in natural-log units, as interval_attn writes it
        const float ln2 = 0.6931471805599453f;
        float* pa = part + (((size_t)blockIdx.x * gridDim.y + blockIdx.y) * R + ra) * (D + 2);
        float* pb = pa + 8 * (D + 2);
#pragma unroll
        for (int j = 0; j < DT; j++) {
            const int c = j * 8 + 2 * tq;
            if (ra < R) {
                pa[c] = o[j][0];
                pa[c + 1] = o[j][1];
            }
            if (rb < R) {
                pb[c] = o[j][2];
                pb[c + 1] = o[j][3];
            }
        }
        if (tq == 0) {
            if (ra < R) {
                pa[D] = m_a == NEG_INF ? NEG_INF : m_a * ln2;
                pa[D + 1] = l_a;
            }
            if (rb < R) {
                pb[D] = m_b == NEG_INF ? NEG_INF : m_b * ln2;
                pb[D + 1] = l_b;
            }
        }
        return;
    }
    if constexpr (TRAIN) {
        // each row's log-sum-exp in base 2 (scaled scores), [hq, n]; +inf for an empty row
        if (tq == 0) {
            if (ra < R) part[(size_t)head(ra) * n + row(ra)] = l_a > 0.0f ? m_a + log2f(l_a) : POS_INF;
            if (rb < R) part[(size_t)head(rb) * n + row(rb)] = l_b > 0.0f ? m_b + log2f(l_b) : POS_INF;
        }
    }
    const float inv_a = l_a > 0.0f ? 1.0f / l_a : 0.0f;
    const float inv_b = l_b > 0.0f ? 1.0f / l_b : 0.0f;
    __nv_bfloat16* oa = out + (((size_t)s * n + row(ra)) * hq + head(ra)) * D;
    __nv_bfloat16* ob = out + (((size_t)s * n + row(rb)) * hq + head(rb)) * D;
#pragma unroll
    for (int j = 0; j < DT; j++) {
        const int c = j * 8 + 2 * tq;
        if (ra < R)
            *reinterpret_cast<uint32_t*>(oa + c) = pack_bf16(o[j][0] * inv_a, o[j][1] * inv_a);
        if (rb < R)
            *reinterpret_cast<uint32_t*>(ob + c) = pack_bf16(o[j][2] * inv_b, o[j][3] * inv_b);
    }
}

#define MMA_ATTN(D, BC)                                                                            \
    extern "C" __global__ void __launch_bounds__(128) prefill_attn_d##D##_bf16(                     \
        const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,                    \
        const uint32_t* iv, __nv_bfloat16* out, float* part, int hq, int hkv, int n,               \
        long long hs, float scale) {                                                               \
        mma_attn<D, BC, false>(q, k, v, iv, out, part, hq, hkv, n, hs, scale);                     \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(128) verify_attn_d##D##_bf16(                      \
        const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,                    \
        const uint32_t* iv, __nv_bfloat16* out, float* part, int hq, int hkv, int n,               \
        long long hs, float scale) {                                                               \
        mma_attn<D, BC, true>(q, k, v, iv, out, part, hq, hkv, n, hs, scale);                      \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(128) train_attn_fwd_d##D##_bf16(                  \
        const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,                    \
        const uint32_t* iv, __nv_bfloat16* out, float* lse, int hq, int hkv, int n, long long hs,  \
        float scale) {                                                                             \
        mma_attn<D, BC, false, true>(q, k, v, iv, out, lse, hq, hkv, n, hs, scale);                \
    }
MMA_ATTN(64, 64)
MMA_ATTN(128, 32)

// verify_tree_attn_d{D}_w{W}_bf16: the tree's verify with W warps (16 rows each) per block
#define TREE_ATTN(D, BC, W)                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * W) verify_tree_attn_d##D##_w##W##_bf16(       \
        const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,                    \
        const uint32_t* iv, __nv_bfloat16* out, float* part, int hq, int hkv, int n,               \
        long long hs, float scale) {                                                               \
        mma_attn<D, BC, true, false, true>(q, k, v, iv, out, part, hq, hkv, n, hs, scale);         \
    }
TREE_ATTN(64, 64, 4)
TREE_ATTN(64, 64, 8)
TREE_ATTN(128, 32, 4)
TREE_ATTN(128, 32, 8)
