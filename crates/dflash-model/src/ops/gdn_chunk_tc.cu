#include "../cuda/common.cuh"
#include <mma.h>

// ---------------------------------------------------------------------------------------------
// The chunked gated delta rule with its block products on the tensor cores (`gdn_chunk.rs`,
// `ChunkMath::Tf32`; the algorithm and the CPU twin `chunked_host` as `gdn_chunk.cu`'s). Same
// rows, scratch layout and launch grids as `gdn_chunk_prep_f32` / `gdn_chunk_scan_f32`; the
// Gram products k·kᵀ and q·kᵀ, X = T·(β v), Y = T·(β e^c k), v' = X − Y·S, o = Q̃·S + P·v' and
// S ← e^{c_L} S + K̃ᵀ·v' are 16×16×8 TF32 MMAs with f32 accumulation (inputs rounded to 10 bits
// of mantissa, sums and the state in f32); the triangular solve stays f32 FMAs. dk a multiple
// of 16 (≤ 128), dv a multiple of 32 (≤ 256). Every row of a chunk is computed, those past a
// short last chunk as zeros (β = 0, q = k = v = 0 there), so the products need no row bounds.
// ---------------------------------------------------------------------------------------------
#define TGC 64
#define TGCP 68
#define TSP 36

namespace gtc {
using namespace nvcuda;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> ARow;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::col_major> ACol;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> BRow;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> BCol;
typedef wmma::fragment<wmma::accumulator, 16, 16, 8, float> Acc;

template <typename F>
__device__ __forceinline__ void to_tf32(F& f) {
#pragma unroll
    for (int i = 0; i < f.num_elements; ++i) f.x[i] = wmma::__float_to_tf32(f.x[i]);
}

// acc += A[16 rows from a, k in [0, kn)] · B[k in [0, kn), 16 columns from b], both row-major.
__device__ __forceinline__ void mma_rr(Acc& acc, const float* a, int lda, const float* b, int ldb,
                                       int kn) {
    ARow fa;
    BRow fb;
    for (int k = 0; k < kn; k += 8) {
        wmma::load_matrix_sync(fa, a + k, lda);
        wmma::load_matrix_sync(fb, b + (size_t)k * ldb, ldb);
        to_tf32(fa);
        to_tf32(fb);
        wmma::mma_sync(acc, fa, fb, acc);
    }
}
}  // namespace gtc

// One block of 256 threads per (key head, chunk, sequence), as gdn_chunk_prep_f32 (its shared
// layout).
extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_prep_tc_f32(
    const float* __restrict__ rows, float* __restrict__ scratch, const unsigned* __restrict__ seqs,
    int nseq, int hk, int hv, int dk,
    int dv) {
    using namespace gtc;
    extern __shared__ __align__(128) float gtc_sm[];
    const int ks = dk + 4, vs = max(dk, dv) + 4;
    float* Ks = gtc_sm;
    float* Vs = Ks + TGC * ks;
    float* sA = Vs + TGC * vs;
    float* sT = sA + TGC * TGCP;
    float* sM = sT + TGC * TGCP;
    float* cum = sM + 3 * 256;
    float* beta = cum + TGC;
    float* sx = beta + TGC;
    float* sy = sx + TGC;
    // sequence s: rows [seqs[s], seqs[s + 1]), chunks from seqs[nseq + 1 + s] of seqs[2·nseq + 1]
    const int kh = blockIdx.x, c = blockIdx.y, sq = blockIdx.z, group = hv / hk;
    const int r0 = seqs[sq], len = seqs[sq + 1] - r0, nc = seqs[2 * nseq + 1], cb = seqs[nseq + 1 + sq];
    if (c * TGC >= len) return;
    const int c0 = r0 + c * TGC, l = min(TGC, len - c * TGC);
    const int kd = hk * dk, vd = hv * dv, w = 2 * kd + vd + 2 * hv;
    const int tid = threadIdx.x, wp = tid >> 5;
    const size_t per = (size_t)TGC * (dv + 3 * dk + TGC) + TGC;
    for (int base = 0; base < TGC * dk; base += 16 * 256) {
        float kb[16], qb[16];
#pragma unroll
        for (int u = 0; u < 16; ++u) {
            const int idx = base + tid + u * 256, i = idx / dk, a = idx - i * dk;
            const bool in = idx < TGC * dk && i < l;
            const float* r = rows + (size_t)(c0 + (in ? i : 0)) * w;
            kb[u] = in ? r[kd + kh * dk + a] : 0.0f;
            qb[u] = in ? r[kh * dk + a] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 16; ++u) {
            const int idx = base + tid + u * 256, i = idx / dk, a = idx - i * dk;
            if (idx < TGC * dk) {
                Ks[i * ks + a] = kb[u];
                Vs[i * vs + a] = qb[u];
            }
        }
    }
    __syncthreads();
    // the Gram products on the tensor cores: k·kᵀ into sA, q·kᵀ into sT (tile t = 4·ti + tj of
    // each, two per warp), then into registers in gdn_chunk_prep_f32's layout
    for (int t = wp; t < 32; t += 8) {
        const int m = t & 15, ti = m >> 2, tj = m & 3;
        const float* a = (t < 16 ? Ks : Vs) + 16 * ti * (t < 16 ? ks : vs);
        const int lda = t < 16 ? ks : vs;
        Acc acc;
        wmma::fill_fragment(acc, 0.0f);
        ARow fa;
        BCol fb;
        for (int k = 0; k < dk; k += 8) {
            wmma::load_matrix_sync(fa, a + k, lda);
            wmma::load_matrix_sync(fb, Ks + 16 * tj * ks + k, ks);
            to_tf32(fa);
            to_tf32(fb);
            wmma::mma_sync(acc, fa, fb, acc);
        }
        wmma::store_matrix_sync((t < 16 ? sA : sT) + 16 * ti * TGCP + 16 * tj, acc, TGCP,
                                wmma::mem_row_major);
    }
    __syncthreads();
    const int gi = tid >> 2, j0 = tid & 3;
    float kk[16], qk[16];
#pragma unroll
    for (int u = 0; u < 16; ++u) {
        kk[u] = sA[gi * TGCP + j0 + 4 * u];
        qk[u] = sT[gi * TGCP + j0 + 4 * u];
    }
    for (int g = 0; g < group; ++g) {
        const int h = kh * group + g;
        float* X = scratch + ((size_t)h * nc + cb + c) * per;
        float* Y = X + (size_t)TGC * dv;
        float* Qt = Y + (size_t)TGC * dk;
        float* Kt = Qt + (size_t)TGC * dk;
        float* P = Kt + (size_t)TGC * dk;
        float* cumg = P + TGC * TGC;
        __syncthreads();
        if (tid < TGC) {
            const float* r = rows + (size_t)(c0 + (tid < l ? tid : 0)) * w + 2 * kd + vd;
            beta[tid] = tid < l ? r[h] : 0.0f;
            cum[tid] = tid < l ? r[hv + h] : 0.0f;
        }
        for (int base = 0; base < TGC * dv; base += 16 * 256) {
            float vb[16];
#pragma unroll
            for (int u = 0; u < 16; ++u) {
                const int idx = base + tid + u * 256, m = idx / dv, col = idx - m * dv;
                vb[u] = (idx < TGC * dv && m < l) ? rows[(size_t)(c0 + m) * w + 2 * kd + h * dv + col] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 16; ++u) {
                const int idx = base + tid + u * 256, m = idx / dv, col = idx - m * dv;
                if (idx < TGC * dv) Vs[m * vs + col] = vb[u];
            }
        }
        for (int idx = tid; idx < TGC * TGCP; idx += blockDim.x) sT[idx] = 0.0f;
        __syncthreads();
        if (tid == 0) {
            float acc = 0.0f;
            for (int i = 0; i < TGC; ++i) {
                acc += cum[i];
                cum[i] = acc;
            }
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < 16; ++u) {
            const int j = j0 + 4 * u;
            const float e = (j <= gi && gi < l) ? expf(cum[gi] - cum[j]) : 0.0f;
            sA[gi * TGCP + j] = j < gi ? beta[gi] * kk[u] * e : 0.0f;
            P[gi * TGC + j] = j <= gi ? qk[u] * e : 0.0f;
        }
        const float last = cum[l - 1];
        if (tid < TGC) {
            cumg[tid] = cum[tid];
            sT[tid * TGCP + tid] = 1.0f;
            sx[tid] = beta[tid];
            sy[tid] = beta[tid] * expf(cum[tid]);
        }
        for (int base = 0; base < TGC * dk; base += 16 * 256) {
            float qb[16];
#pragma unroll
            for (int u = 0; u < 16; ++u) {
                const int idx = base + tid + u * 256, i = idx / dk, a = idx - i * dk;
                qb[u] = (idx < TGC * dk && i < l) ? rows[(size_t)(c0 + i) * w + kh * dk + a] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 16; ++u) {
                const int idx = base + tid + u * 256, i = idx / dk, a = idx - i * dk;
                if (idx < TGC * dk) {
                    Qt[idx] = qb[u] * expf(cum[i]);
                    Kt[idx] = i < l ? Ks[i * ks + a] * expf(last - cum[i]) : 0.0f;
                }
            }
        }
        __syncthreads();
        // T = (I + A)⁻¹: the diagonal blocks by forward substitution, then the levels below
        // (gdn_chunk_prep_f32's)
        {
            const int b0 = (tid >> 6) * 16, m = (tid >> 2) & 15, part = tid & 3;
            for (int r = 1; r < 16; ++r) {
                const int i = b0 + r;
                float t = 0.0f;
                if (m < r)
                    for (int jj = m + 1 + part; jj < r; jj += 4)
                        t += sA[i * TGCP + b0 + jj] * sT[(b0 + jj) * TGCP + b0 + m];
                t += __shfl_xor_sync(0xffffffffu, t, 1);
                t += __shfl_xor_sync(0xffffffffu, t, 2);
                if (m < r && part == 0) sT[i * TGCP + b0 + m] = -sA[i * TGCP + b0 + m] - t;
                __syncthreads();
            }
        }
        for (int d = 1; d < 4; ++d) {
            const int pairs = 4 - d;
            for (int idx = tid; idx < pairs * 256; idx += blockDim.x) {
                const int J = idx >> 8, I = J + d, r = (idx >> 4) & 15, cc = idx & 15;
                float acc = 0.0f;
                for (int k = 16 * J; k < 16 * I; ++k)
                    acc += sA[(16 * I + r) * TGCP + k] * sT[k * TGCP + 16 * J + cc];
                sM[idx] = acc;
            }
            __syncthreads();
            for (int idx = tid; idx < pairs * 256; idx += blockDim.x) {
                const int J = idx >> 8, I = J + d, r = (idx >> 4) & 15, cc = idx & 15;
                float acc = 0.0f;
                for (int k = 0; k < 16; ++k)
                    acc += sT[(16 * I + r) * TGCP + 16 * I + k] * sM[(J << 8) + k * 16 + cc];
                sT[(16 * I + r) * TGCP + 16 * J + cc] = -acc;
            }
            __syncthreads();
        }
        // X = (T·diag β)·v and Y = (T·diag(β e^c))·k on the tensor cores: the scaled T in sA,
        // output tile t = ti·(width/16) + tn, warp w taking t = w, w + 8, …; T is zero above its
        // diagonal, so row block ti sums over k < 16·(ti + 1) only
        for (int pass = 0; pass < 2; ++pass) {
            const int width = pass == 0 ? dv : dk, stride = pass == 0 ? vs : ks;
            const float* src = pass == 0 ? Vs : Ks;
            const float* sc = pass == 0 ? sx : sy;
            float* dst = pass == 0 ? X : Y;
            for (int idx = tid; idx < TGC * TGC; idx += blockDim.x) {
                const int i = idx >> 6, m = idx & 63;
                sA[i * TGCP + m] = sT[i * TGCP + m] * sc[m];
            }
            __syncthreads();
            const int tw = width / 16;
            for (int t = wp; t < 4 * tw; t += 8) {
                const int ti = t / tw, tn = t - ti * tw;
                Acc acc;
                wmma::fill_fragment(acc, 0.0f);
                mma_rr(acc, sA + 16 * ti * TGCP, TGCP, src + 16 * tn, stride, 16 * (ti + 1));
                wmma::store_matrix_sync(dst + (size_t)16 * ti * width + 16 * tn, acc, width,
                                        wmma::mem_row_major);
            }
            __syncthreads();
        }
    }
}

// One block of 256 threads per (value head, 32 value columns, sequence), chunk after chunk, as
// gdn_chunk_scan_f32: warp w owns the 16×16 tile (w / 2, w % 2) of v' and of o, and the tiles
// w and w + 8 of the state S [dk][32]. Shared: S [dk][36], Y (then o) and Q̃ (then K̃)
// [GC][dk+4], P [GC][GCP], v' [GC][36].
extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_scan_tc_f32(
    const float* __restrict__ rows, const float* __restrict__ init,
    const float* __restrict__ scratch, float* __restrict__ out, const unsigned* __restrict__ seqs,
    int nseq, int hk, int hv, int dk,
    int dv) {
    using namespace gtc;
    extern __shared__ __align__(128) float gtc_sm[];
    const int ks = dk + 4, d4 = dk / 4;
    float* S = gtc_sm;
    float* Ys = S + dk * TSP;
    float* Qs = Ys + TGC * ks;
    float* Ps = Qs + TGC * ks;
    float* vn = Ps + TGC * TGCP;
    const int h = blockIdx.x, j0 = blockIdx.y * 32, sq = blockIdx.z;
    const int r0 = seqs[sq], len = seqs[sq + 1] - r0, nct = seqs[2 * nseq + 1], cb = seqs[nseq + 1 + sq];
    const int nc = seqs[nseq + 2 + sq] - cb;
    init += (size_t)sq * hv * dk * dv;
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5;
    const int vd = hv * dv, ti = wp >> 1, tn = wp & 1;
    const size_t per = (size_t)TGC * (dv + 3 * dk + TGC) + TGC;
    for (int a = wp; a < dk; a += 8) S[a * TSP + lane] = init[((size_t)h * dk + a) * dv + j0 + lane];
    for (int c = 0; c < nc; ++c) {
        const int c0 = r0 + c * TGC, l = min(TGC, len - c * TGC);
        const float* X = scratch + ((size_t)h * nct + cb + c) * per;
        const float* Y = X + (size_t)TGC * dv;
        const float* Qt = Y + (size_t)TGC * dk;
        const float* Kt = Qt + (size_t)TGC * dk;
        const float* P = Kt + (size_t)TGC * dk;
        const float last = P[TGC * TGC + l - 1], el = expf(last);
        float4 yb[8], qb[8], pb[4];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int idx = tid + u * 256;
            if (idx < TGC * d4) {
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
            if (idx < TGC * d4) {
                *(float4*)&Ys[i * ks + a] = yb[u];
                *(float4*)&Qs[i * ks + a] = qb[u];
            }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int idx = tid + u * 256;
            *(float4*)&Ps[(idx >> 4) * TGCP + (idx & 15) * 4] = pb[u];
        }
        __syncthreads();
        // v' = X − Y·S (X straight from the scratch into the accumulator) and o = Q̃·S
        Acc av, ao;
        wmma::load_matrix_sync(av, X + (size_t)16 * ti * dv + j0 + 16 * tn, dv, wmma::mem_row_major);
        wmma::fill_fragment(ao, 0.0f);
        {
            ARow fy, fq;
            BRow fs;
            for (int k = 0; k < dk; k += 8) {
                wmma::load_matrix_sync(fs, S + k * TSP + 16 * tn, TSP);
                wmma::load_matrix_sync(fy, Ys + 16 * ti * ks + k, ks);
                wmma::load_matrix_sync(fq, Qs + 16 * ti * ks + k, ks);
                to_tf32(fs);
                to_tf32(fq);
#pragma unroll
                for (int i = 0; i < fy.num_elements; ++i) fy.x[i] = -wmma::__float_to_tf32(fy.x[i]);
                wmma::mma_sync(av, fy, fs, av);
                wmma::mma_sync(ao, fq, fs, ao);
            }
        }
        wmma::store_matrix_sync(vn + 16 * ti * TSP + 16 * tn, av, TSP, wmma::mem_row_major);
        __syncthreads();
        // K̃ over Q̃ (read by every warp above), then o += P·v' (P zero above its diagonal) and
        // S ← e^{c_L} S + K̃ᵀ·v'
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int idx = tid + u * 256;
            if (idx < TGC * d4) qb[u] = *(const float4*)&Kt[(size_t)idx * 4];
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int idx = tid + u * 256, i = idx / d4, a = (idx - i * d4) * 4;
            if (idx < TGC * d4) *(float4*)&Qs[i * ks + a] = qb[u];
        }
        mma_rr(ao, Ps + 16 * ti * TGCP, TGCP, vn + 16 * tn, TSP, 16 * (ti + 1));
        if (l == TGC) {
            wmma::store_matrix_sync(out + (size_t)(c0 + 16 * ti) * vd + h * dv + j0 + 16 * tn, ao, vd,
                                    wmma::mem_row_major);
        } else {
            wmma::store_matrix_sync(Ys + 16 * ti * TSP + 16 * tn, ao, TSP, wmma::mem_row_major);
        }
        __syncthreads();
        if (l < TGC)
            for (int i = wp; i < l; i += 8) out[(size_t)(c0 + i) * vd + h * dv + j0 + lane] = Ys[i * TSP + lane];
        for (int t = wp; t < (dk / 16) * 2; t += 8) {
            const int ta = t >> 1, tb = t & 1;
            Acc acc;
            wmma::load_matrix_sync(acc, S + 16 * ta * TSP + 16 * tb, TSP, wmma::mem_row_major);
#pragma unroll
            for (int i = 0; i < acc.num_elements; ++i) acc.x[i] *= el;
            ACol fk;
            BRow fv;
            for (int m = 0; m < TGC; m += 8) {
                wmma::load_matrix_sync(fk, Qs + m * ks + 16 * ta, ks);
                wmma::load_matrix_sync(fv, vn + m * TSP + 16 * tb, TSP);
                to_tf32(fk);
                to_tf32(fv);
                wmma::mma_sync(acc, fk, fv, acc);
            }
            wmma::store_matrix_sync(S + 16 * ta * TSP + 16 * tb, acc, TSP, wmma::mem_row_major);
        }
        __syncthreads();
    }
    float* st = out + (size_t)seqs[nseq] * vd + (size_t)sq * hv * dk * dv;
    for (int a = wp; a < dk; a += 8) st[((size_t)h * dk + a) * dv + j0 + lane] = S[a * TSP + lane];
}

