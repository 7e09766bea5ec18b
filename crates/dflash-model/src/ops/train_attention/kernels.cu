#include "../../cuda/common.cuh"
#include "../../cuda/mma.cuh"

// The drafter's training attention backward on the tensor cores (the forward is train_attn_fwd_*
// in src/ops/mma_attention.cu); the twin is the written backward of
// `crate::ops::block_attention::attend_blocks`. Each query row sees two key intervals (its
// context keys and its own block's: four u32 per row in `iv`); the forward saved each row's
// log-sum-exp `lse` ([hq, n], base 2, the scale folded in), so P = exp2(s · scale · log2 e − lse)
// is recomputed tile by tile and no score is ever written. With dd = rowsum(dO ∘ O):
//   dS = P ∘ (dO·Vᵀ − dd),  dQ = scale · dS·K,  dK = scale · dSᵀ·Q,  dV = Pᵀ·dO.
// Three kernels:
// - train_attn_dot_*: dd per (query head, row), one warp each;
// - train_attn_dq_*: a block per (64-row tile, query head), as the forward: 4 warps of 16 rows,
//   Q and dO held as A fragments, K/V tiles of BC keys double-buffered by cp.async over the
//   rows' two spans; dQ accumulates in registers and is written once (no atomics);
// - train_attn_dkv_*: a block per (work item, K/V head), a work item being a 64-key tile and a
//   split of its rows (`work`, from the host): 4 warps of 16 keys, K and V of the tile in
//   shared memory, walking its split (`chunk` row tiles) of the query rows that
//   may see the tile (`key_rows`: two u32 per 64-key tile, from the host) of each of the K/V
//   head's g query heads in tiles of BC rows (Q, dO, their lse, dd and intervals
//   double-buffered), the scores computed transposed (Sᵀ = K·Qᵀ) so that dK and dV accumulate
//   in registers; each split adds its part into f32 buffers (atomics), which
//   train_attn_cast_* rounds to bf16. The splits even out the work: a context tile early in
//   the row is seen by nearly every row, an own-block tile by 64.
// Example: Qwen3-8B's drafter layer on a 2,048-token row with 512 anchors of 16 (32 / 8 heads
// of 128; 8,192 query rows over 2,048 context + 8,192 block keys): dq takes 128 × 32 blocks;
// the dkv tile of context keys 0..64 sees the rows of every block whose anchor lies past key 0
// (all 8,192), 4 heads × 256 row tiles of 32, walked by ~57 blocks of 18 row tiles.

// dd[hh · n + r] = Σ_e dO[r, hh, e] · O[r, hh, e] (O and dO `[n, hq, D]`, bf16), f32.
template <int D>
__device__ void train_dot(const __nv_bfloat16* out, const __nv_bfloat16* dout, float* dd, int hq,
                          int n) {
    const int w = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (w >= n * hq) return;
    const int r = w / hq, hh = w % hq;
    const __nv_bfloat16* o = out + (size_t)w * D;
    const __nv_bfloat16* g = dout + (size_t)w * D;
    float acc = 0.0f;
    for (int e = lane; e < D; e += 32) acc += __bfloat162float(o[e]) * __bfloat162float(g[e]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) dd[(size_t)hh * n + r] = acc;
}

// Whether key `key` lies in one of a row's two intervals (`p`: lo, hi, lo2, hi2).
__device__ __forceinline__ bool sees2(const uint32_t* p, uint32_t key) {
    return (key >= p[0] && key < p[1]) || (key >= p[2] && key < p[3]);
}

// B fragments of two n-tiles (columns j·8.., (j + 1)·8..) for k = rows kc·16..kc·16 + 16 of a
// row-major tile `t` (rows of LD values), read transposed by ldmatrix: what P·V reads of V.
template <int LD>
__device__ __forceinline__ void ldsm_trans(const __nv_bfloat16* t, int kc, int j, int lane,
                                           uint32_t& b0, uint32_t& b1, uint32_t& b2, uint32_t& b3) {
    const int mat = lane >> 3, rr = lane & 7;
    const __nv_bfloat16* p = t + (kc * 16 + (mat & 1) * 8 + rr) * LD + (mat >> 1) * 8 + j * 8;
    const uint32_t addr = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                 : "r"(addr));
}

template <int D, int BC>
__device__ void train_dq(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                         const __nv_bfloat16* dout, const float* lse, const float* dd,
                         const uint32_t* iv, __nv_bfloat16* dq, int hq, int hkv, int n,
                         long long hs, float scale) {
    constexpr int LD = D + 8, KC = D / 16, DT = D / 8, ST = BC / 8, VPR = D / 8;
    __shared__ __align__(16) __nv_bfloat16 ks[2 * BC * LD];
    __shared__ __align__(16) __nv_bfloat16 vs[2 * BC * LD];
    __shared__ uint32_t span[4];
    const int g = hq / hkv, hh = blockIdx.y, h = hh / g;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
    const int ra = blockIdx.x * 64 + warp * 16 + gr, rb = ra + 8;
    uint32_t pa4[4] = {0, 0, 0, 0}, pb4[4] = {0, 0, 0, 0};
    if (ra < n)
        for (int e = 0; e < 4; e++) pa4[e] = iv[4 * (size_t)ra + e];
    if (rb < n)
        for (int e = 0; e < 4; e++) pb4[e] = iv[4 * (size_t)rb + e];
    if (threadIdx.x == 0) {
        span[0] = span[2] = 0xffffffffu;
        span[1] = span[3] = 0;
    }
    __syncthreads();
    uint32_t wlo, whi, wlo2, whi2;
    warp_span(pa4[0], pa4[1], pb4[0], pb4[1], wlo, whi, span);
    warp_span(pa4[2], pa4[3], pb4[2], pb4[3], wlo2, whi2, span + 2);
    __syncthreads();
    const uint32_t lo = span[0], hi = span[1], lo2 = span[2], hi2 = span[3];
    const int tiles1 = lo < hi ? (int)((hi - lo + BC - 1) / BC) : 0;
    const int tiles = tiles1 + (lo2 < hi2 ? (int)((hi2 - lo2 + BC - 1) / BC) : 0);
    auto first = [&](int i) { return i < tiles1 ? lo + (uint32_t)i * BC : lo2 + (uint32_t)(i - tiles1) * BC; };
    auto last = [&](int i) { return i < tiles1 ? hi : hi2; };

    // Q and dO of this warp's rows as A fragments
    const __nv_bfloat16* qra = q + ((size_t)hh * n + ra) * D;
    const __nv_bfloat16* qrb = q + ((size_t)hh * n + rb) * D;
    const __nv_bfloat16* gra = dout + ((size_t)ra * hq + hh) * D;
    const __nv_bfloat16* grb = dout + ((size_t)rb * hq + hh) * D;
    uint32_t qa[KC][4], ga[KC][4];
#pragma unroll
    for (int kk = 0; kk < KC; kk++) {
        const int c = kk * 16 + 2 * tq;
        qa[kk][0] = ra < n ? *reinterpret_cast<const uint32_t*>(qra + c) : 0u;
        qa[kk][1] = rb < n ? *reinterpret_cast<const uint32_t*>(qrb + c) : 0u;
        qa[kk][2] = ra < n ? *reinterpret_cast<const uint32_t*>(qra + c + 8) : 0u;
        qa[kk][3] = rb < n ? *reinterpret_cast<const uint32_t*>(qrb + c + 8) : 0u;
        ga[kk][0] = ra < n ? *reinterpret_cast<const uint32_t*>(gra + c) : 0u;
        ga[kk][1] = rb < n ? *reinterpret_cast<const uint32_t*>(grb + c) : 0u;
        ga[kk][2] = ra < n ? *reinterpret_cast<const uint32_t*>(gra + c + 8) : 0u;
        ga[kk][3] = rb < n ? *reinterpret_cast<const uint32_t*>(grb + c + 8) : 0u;
    }
    const float lse_a = ra < n ? lse[(size_t)hh * n + ra] : POS_INF;
    const float lse_b = rb < n ? lse[(size_t)hh * n + rb] : POS_INF;
    const float dd_a = ra < n ? dd[(size_t)hh * n + ra] : 0.0f;
    const float dd_b = rb < n ? dd[(size_t)hh * n + rb] : 0.0f;
    float acc[DT][4];
#pragma unroll
    for (int j = 0; j < DT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    const float sl2 = scale * 1.4426950408889634f;
    const __nv_bfloat16* kb = k + (size_t)h * hs;
    const __nv_bfloat16* vb = v + (size_t)h * hs;
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
            // S = Q·Kᵀ and dP = dO·Vᵀ, 16 × BC each
            float sc[ST][4], dp[ST][4];
#pragma unroll
            for (int j = 0; j < ST; j++) {
                sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
                dp[j][0] = dp[j][1] = dp[j][2] = dp[j][3] = 0.0f;
                const __nv_bfloat16* kr = kt + (j * 8 + gr) * LD + 2 * tq;
                const __nv_bfloat16* vr = vt + (j * 8 + gr) * LD + 2 * tq;
#pragma unroll
                for (int kk = 0; kk < KC; kk++) {
                    mma_bf16(sc[j], qa[kk], *reinterpret_cast<const uint32_t*>(kr + kk * 16),
                             *reinterpret_cast<const uint32_t*>(kr + kk * 16 + 8));
                    mma_bf16(dp[j], ga[kk], *reinterpret_cast<const uint32_t*>(vr + kk * 16),
                             *reinterpret_cast<const uint32_t*>(vr + kk * 16 + 8));
                }
            }
            // dS = P ∘ (dP − dd), P recomputed from the saved log-sum-exp (0 where hidden)
#pragma unroll
            for (int j = 0; j < ST; j++) {
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    const uint32_t key = t0 + j * 8 + 2 * tq + (c & 1);
                    const bool vis = c < 2 ? sees2(pa4, key) : sees2(pb4, key);
                    const float p = vis ? exp2f(sc[j][c] * sl2 - (c < 2 ? lse_a : lse_b)) : 0.0f;
                    sc[j][c] = p * (dp[j][c] - (c < 2 ? dd_a : dd_b));
                }
            }
            // dQ += dS·K, K's B fragments read transposed
#pragma unroll
            for (int kc = 0; kc < BC / 16; kc++) {
                uint32_t a[4];
                a[0] = pack_bf16(sc[2 * kc][0], sc[2 * kc][1]);
                a[1] = pack_bf16(sc[2 * kc][2], sc[2 * kc][3]);
                a[2] = pack_bf16(sc[2 * kc + 1][0], sc[2 * kc + 1][1]);
                a[3] = pack_bf16(sc[2 * kc + 1][2], sc[2 * kc + 1][3]);
#pragma unroll
                for (int j = 0; j < DT; j += 2) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_trans<LD>(kt, kc, j, lane, b0, b1, b2, b3);
                    mma_bf16(acc[j], a, b0, b1);
                    mma_bf16(acc[j + 1], a, b2, b3);
                }
            }
        }
        __syncthreads();
    }
    __nv_bfloat16* oa = dq + ((size_t)hh * n + ra) * D;
    __nv_bfloat16* ob = dq + ((size_t)hh * n + rb) * D;
#pragma unroll
    for (int j = 0; j < DT; j++) {
        const int c = j * 8 + 2 * tq;
        if (ra < n) *reinterpret_cast<uint32_t*>(oa + c) = pack_bf16(acc[j][0] * scale, acc[j][1] * scale);
        if (rb < n) *reinterpret_cast<uint32_t*>(ob + c) = pack_bf16(acc[j][2] * scale, acc[j][3] * scale);
    }
}

// Dynamic shared memory of train_dkv (`crate::ops::train_attention::dkv_smem`): K and V of the
// 64 keys, then two buffers each of Q and dO (BC rows), then two of the rows' (lse, dd) and
// intervals.
template <int D, int BC>
__device__ void train_dkv(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                          const __nv_bfloat16* dout, const float* lse, const float* dd,
                          const uint32_t* iv, const uint32_t* key_rows, const uint32_t* work,
                          float* dk, float* dv, int hq, int hkv, int n, int t, long long hs,
                          float scale, int chunk) {
    constexpr int LD = D + 8, KC = D / 16, DT = D / 8, ST = BC / 8, VPR = D / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16* ksm = reinterpret_cast<__nv_bfloat16*>(smem);
    __nv_bfloat16* vsm = ksm + 64 * LD;
    __nv_bfloat16* qs = vsm + 64 * LD;  // [2][BC][LD]
    __nv_bfloat16* gs = qs + 2 * BC * LD;
    float* fs = reinterpret_cast<float*>(gs + 2 * BC * LD);  // [2][BC][2]: lse, dd
    uint32_t* is = reinterpret_cast<uint32_t*>(fs + 2 * BC * 2);  // [2][BC][4]
    // this block's key tile and its first row tile (`work`, from the host)
    const uint32_t kt = work[2 * blockIdx.x];
    const int g = hq / hkv, h = blockIdx.y, k0 = kt * 64;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
    const uint32_t rlo = key_rows[2 * kt], rhi = key_rows[2 * kt + 1];
    const int per = rlo < rhi ? (int)((rhi - rlo + BC - 1) / BC) : 0;
    // this split's row tiles [i0, i1) of the g · per
    const int i0 = work[2 * blockIdx.x + 1], i1 = min(g * per, i0 + chunk);
    if (i0 >= i1) return;
    const __nv_bfloat16* kb = k + (size_t)h * hs;
    const __nv_bfloat16* vb = v + (size_t)h * hs;
    // the block's K and V rows (zeros past t)
    for (int idx = threadIdx.x; idx < 2 * 64 * VPR; idx += blockDim.x) {
        const int kv = idx / (64 * VPR), j = (idx / VPR) % 64, e = idx % VPR;
        const bool in = k0 + j < t;
        const __nv_bfloat16* src = (kv ? vb : kb) + (in ? (size_t)(k0 + j) * D + e * 8 : 0);
        cp_async16((kv ? vsm : ksm) + j * LD + e * 8, src, in ? 16 : 0);
    }
    asm volatile("cp.async.commit_group;\n" ::);
    // tile i: query head h·g + i / per, rows rlo + (i % per)·BC ..; rows past rhi hidden
    auto issue = [&](int i) {
        const int hh = h * g + i / per;
        const uint32_t r0 = rlo + (uint32_t)(i % per) * BC;
        __nv_bfloat16* qd = qs + (i & 1) * BC * LD;
        __nv_bfloat16* gd = gs + (i & 1) * BC * LD;
        for (int idx = threadIdx.x; idx < 2 * BC * VPR; idx += blockDim.x) {
            const int which = idx / (BC * VPR), j = (idx / VPR) % BC, e = idx % VPR;
            const uint32_t r = r0 + j;
            const bool in = r < rhi;
            const __nv_bfloat16* src =
                which ? dout + (in ? ((size_t)r * hq + hh) * D + e * 8 : 0)
                      : q + (in ? ((size_t)hh * n + r) * D + e * 8 : 0);
            cp_async16((which ? gd : qd) + j * LD + e * 8, src, in ? 16 : 0);
        }
        for (int j = threadIdx.x; j < BC; j += blockDim.x) {
            const uint32_t r = r0 + j;
            const bool in = r < rhi;
            float* f = fs + ((i & 1) * BC + j) * 2;
            uint32_t* p = is + ((i & 1) * BC + j) * 4;
            f[0] = in ? lse[(size_t)hh * n + r] : POS_INF;
            f[1] = in ? dd[(size_t)hh * n + r] : 0.0f;
            for (int e = 0; e < 4; e++) p[e] = in ? iv[4 * (size_t)r + e] : 0u;
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    float dka[DT][4], dva[DT][4];
#pragma unroll
    for (int j = 0; j < DT; j++) {
        dka[j][0] = dka[j][1] = dka[j][2] = dka[j][3] = 0.0f;
        dva[j][0] = dva[j][1] = dva[j][2] = dva[j][3] = 0.0f;
    }
    const float sl2 = scale * 1.4426950408889634f;
    const uint32_t key_a = k0 + warp * 16 + gr, key_b = key_a + 8;
    const __nv_bfloat16* kra = ksm + (warp * 16 + gr) * LD + 2 * tq;
    const __nv_bfloat16* vra = vsm + (warp * 16 + gr) * LD + 2 * tq;
    issue(i0);
    for (int i = i0; i < i1; i++) {
        if (i + 1 < i1) {
            issue(i + 1);
            asm volatile("cp.async.wait_group 1;\n" ::);
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::);
        }
        __syncthreads();
        const __nv_bfloat16* qt = qs + (i & 1) * BC * LD;
        const __nv_bfloat16* gt = gs + (i & 1) * BC * LD;
        const float* ft = fs + (i & 1) * BC * 2;
        const uint32_t* it = is + (i & 1) * BC * 4;
        // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (16 keys × BC rows), K's and V's A fragments from shared
        float sc[ST][4], dp[ST][4];
#pragma unroll
        for (int j = 0; j < ST; j++) {
            sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
            dp[j][0] = dp[j][1] = dp[j][2] = dp[j][3] = 0.0f;
        }
#pragma unroll
        for (int kk = 0; kk < KC; kk++) {
            uint32_t ka[4], va[4];
            ka[0] = *reinterpret_cast<const uint32_t*>(kra + kk * 16);
            ka[1] = *reinterpret_cast<const uint32_t*>(kra + 8 * LD + kk * 16);
            ka[2] = *reinterpret_cast<const uint32_t*>(kra + kk * 16 + 8);
            ka[3] = *reinterpret_cast<const uint32_t*>(kra + 8 * LD + kk * 16 + 8);
            va[0] = *reinterpret_cast<const uint32_t*>(vra + kk * 16);
            va[1] = *reinterpret_cast<const uint32_t*>(vra + 8 * LD + kk * 16);
            va[2] = *reinterpret_cast<const uint32_t*>(vra + kk * 16 + 8);
            va[3] = *reinterpret_cast<const uint32_t*>(vra + 8 * LD + kk * 16 + 8);
#pragma unroll
            for (int j = 0; j < ST; j++) {
                const __nv_bfloat16* qr = qt + (j * 8 + gr) * LD + 2 * tq + kk * 16;
                const __nv_bfloat16* grr = gt + (j * 8 + gr) * LD + 2 * tq + kk * 16;
                mma_bf16(sc[j], ka, *reinterpret_cast<const uint32_t*>(qr),
                         *reinterpret_cast<const uint32_t*>(qr + 8));
                mma_bf16(dp[j], va, *reinterpret_cast<const uint32_t*>(grr),
                         *reinterpret_cast<const uint32_t*>(grr + 8));
            }
        }
        // Pᵀ and dSᵀ = Pᵀ ∘ (dPᵀ − dd) per (key, row)
        float ds[ST][4];
#pragma unroll
        for (int j = 0; j < ST; j++) {
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int col = j * 8 + 2 * tq + (c & 1);
                const bool vis = sees2(it + col * 4, c < 2 ? key_a : key_b);
                const float p = vis ? exp2f(sc[j][c] * sl2 - ft[col * 2]) : 0.0f;
                sc[j][c] = p;
                ds[j][c] = p * (dp[j][c] - ft[col * 2 + 1]);
            }
        }
        // dV += Pᵀ·dO and dK += dSᵀ·Q, dO's and Q's B fragments read transposed
#pragma unroll
        for (int kc = 0; kc < BC / 16; kc++) {
            uint32_t pa[4], sa[4];
            pa[0] = pack_bf16(sc[2 * kc][0], sc[2 * kc][1]);
            pa[1] = pack_bf16(sc[2 * kc][2], sc[2 * kc][3]);
            pa[2] = pack_bf16(sc[2 * kc + 1][0], sc[2 * kc + 1][1]);
            pa[3] = pack_bf16(sc[2 * kc + 1][2], sc[2 * kc + 1][3]);
            sa[0] = pack_bf16(ds[2 * kc][0], ds[2 * kc][1]);
            sa[1] = pack_bf16(ds[2 * kc][2], ds[2 * kc][3]);
            sa[2] = pack_bf16(ds[2 * kc + 1][0], ds[2 * kc + 1][1]);
            sa[3] = pack_bf16(ds[2 * kc + 1][2], ds[2 * kc + 1][3]);
#pragma unroll
            for (int j = 0; j < DT; j += 2) {
                uint32_t b0, b1, b2, b3;
                ldsm_trans<LD>(gt, kc, j, lane, b0, b1, b2, b3);
                mma_bf16(dva[j], pa, b0, b1);
                mma_bf16(dva[j + 1], pa, b2, b3);
                ldsm_trans<LD>(qt, kc, j, lane, b0, b1, b2, b3);
                mma_bf16(dka[j], sa, b0, b1);
                mma_bf16(dka[j + 1], sa, b2, b3);
            }
        }
        __syncthreads();
    }
    // this split's part of dK, dV `[hkv, t, D]` (f32, zeroed by the caller)
    float* dkb = dk + (size_t)h * t * D;
    float* dvb = dv + (size_t)h * t * D;
#pragma unroll
    for (int j = 0; j < DT; j++) {
        const int c = j * 8 + 2 * tq;
        if (key_a < (uint32_t)t) {
            atomicAdd(dkb + (size_t)key_a * D + c, dka[j][0] * scale);
            atomicAdd(dkb + (size_t)key_a * D + c + 1, dka[j][1] * scale);
            atomicAdd(dvb + (size_t)key_a * D + c, dva[j][0]);
            atomicAdd(dvb + (size_t)key_a * D + c + 1, dva[j][1]);
        }
        if (key_b < (uint32_t)t) {
            atomicAdd(dkb + (size_t)key_b * D + c, dka[j][2] * scale);
            atomicAdd(dkb + (size_t)key_b * D + c + 1, dka[j][3] * scale);
            atomicAdd(dvb + (size_t)key_b * D + c, dva[j][2]);
            atomicAdd(dvb + (size_t)key_b * D + c + 1, dva[j][3]);
        }
    }
}

// dst[i] = bf16(src[i]), n values (the f32 dK / dV sums).
__device__ void train_cast(const float* src, __nv_bfloat16* dst, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16(src[i]);
}

#define TRAIN_ATTN(D, BC)                                                                          \
    extern "C" __global__ void train_attn_dot_d##D##_bf16(                                         \
        const __nv_bfloat16* out, const __nv_bfloat16* dout, float* dd, int hq, int n) {           \
        train_dot<D>(out, dout, dd, hq, n);                                                        \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(128) train_attn_dq_d##D##_bf16(                   \
        const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,                    \
        const __nv_bfloat16* dout, const float* lse, const float* dd, const uint32_t* iv,          \
        __nv_bfloat16* dq, int hq, int hkv, int n, long long hs, float scale) {                    \
        train_dq<D, BC>(q, k, v, dout, lse, dd, iv, dq, hq, hkv, n, hs, scale);                    \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(128) train_attn_dkv_d##D##_bf16(                  \
        const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,                    \
        const __nv_bfloat16* dout, const float* lse, const float* dd, const uint32_t* iv,          \
        const uint32_t* key_rows, const uint32_t* work, float* dk, float* dv, int hq, int hkv,     \
        int n, int t, long long hs, float scale, int chunk) {                                      \
        train_dkv<D, BC>(q, k, v, dout, lse, dd, iv, key_rows, work, dk, dv, hq, hkv, n, t, hs,    \
                         scale, chunk);                                                            \
    }
TRAIN_ATTN(64, 32)
TRAIN_ATTN(128, 32)
extern "C" __global__ void train_attn_cast_bf16(const float* src, __nv_bfloat16* dst, long long n) {
    train_cast(src, dst, (size_t)n);
}
