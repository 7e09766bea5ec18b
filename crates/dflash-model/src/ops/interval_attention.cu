#include "../cuda/common.cuh"

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
