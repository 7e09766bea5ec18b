#include "../cuda/common.cuh"
#include "gdn_mma.cuh"

// ---------------------------------------------------------------------------------------------
// The gated delta rule over a prefill's chain, chunked (`gdn_chunk.rs`; CPU twin `chunked_host`;
// the algorithm in that module's doc). rows[i] = q | k | v | β | g as for `gdn_recurrence`;
// dk and dv multiples of 4. Several sequences at once: `seqs` holds each sequence's first row
// then the total, each one's first chunk then the total (`seq_table`); grids carry the sequence
// in z. Scratch per (value head h, chunk c of all), GC·(dv + 3·dk + GC) + GC floats:
// X [GC][dv], Y [GC][dk], Q̃ = e^c q [GC][dk], K̃ = e^{c_L−c} k [GC][dk], P [GC][GC]
// (q_i·k_j e^{c_i−c_j} for j ≤ i, zero above) and the cumulative decays c [GC]. Shared tiles
// keep rows of d + 4 floats so that a thread reads four consecutive values with one 16-byte load.
// ---------------------------------------------------------------------------------------------
#define GC 64
#define GCP 68

// The sequence table (`SeqsOnDevice` in gdn_chunk.rs): sequence s holds rows [seqs[s], seqs[s + 1])
// and chunks [seqs[nseq + 1 + s], seqs[nseq + 2 + s]) of seqs[2·nseq + 1] in all. Example: two
// sequences of 100 and 30 rows: seqs = [0, 100, 130, 0, 2, 3].
struct GdnSeq {
    int r0, len, first, chunks, all;
};
__device__ __forceinline__ GdnSeq gdn_seq(const unsigned* seqs, int nseq, int s) {
    GdnSeq q;
    q.r0 = seqs[s];
    q.len = seqs[s + 1] - q.r0;
    q.first = seqs[nseq + 1 + s];
    q.chunks = seqs[nseq + 2 + s] - q.first;
    q.all = seqs[2 * nseq + 1];
    return q;
}

// Chunk c of sequence q in head h's part of the scratch (the prep writes it, the scans read it),
// head after head and chunk after chunk: X [GC][dv], then Y, Q̃ and K̃ [GC][dk], then P [GC][GC]
// and the chunk's cumulative decays [GC] (cum).
template <typename F>
struct GdnSlab {
    F *X, *Y, *Qt, *Kt, *P, *cum;
};
template <typename F>
__device__ __forceinline__ GdnSlab<F> gdn_slab(F* scratch, int h, const GdnSeq& q, int c, int dk,
                                               int dv) {
    const size_t len = (size_t)GC * (dv + 3 * dk + GC) + GC;
    GdnSlab<F> b;
    b.X = scratch + ((size_t)h * q.all + q.first + c) * len;
    b.Y = b.X + (size_t)GC * dv;
    b.Qt = b.Y + (size_t)GC * dk;
    b.Kt = b.Qt + (size_t)GC * dk;
    b.P = b.Kt + (size_t)GC * dk;
    b.cum = b.P + GC * GC;
    return b;
}

__device__ __forceinline__ float dot4(float4 a, float4 b) {
    return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

// One block of 256 threads per (key head, chunk, sequence), all chunks at once: the Gram products k·kᵀ and
// q·kᵀ once for the key head's value heads, then per value head: A, T = (I + A)⁻¹ (the four
// 16-row diagonal blocks by forward substitution, the blocks below them by products, level by
// level), X = T·(β v), Y = T·(β e^c k), and Q̃, K̃, P, c into the scratch.
// Shared: K [GC][dk+4], q then v [GC][max(dk, dv)+4], A and T [GC][GCP], the products of a level [3][16][16].
// TC: the Gram products and X, Y as TF32 tensor-core MMAs (ChunkMath::Tf32: dk a multiple of 16,
// dv of 32), every row of a chunk computed (those past a short last chunk as zeros); else f32 FMAs.
template <bool TC>
__device__ __forceinline__ void gdn_chunk_prep(
    const float* __restrict__ rows, float* __restrict__ scratch, const unsigned* __restrict__ seqs,
    int nseq, int hk, int hv, int dk, int dv) {
    using namespace gtc;
    float* sm;
    if constexpr (TC) {
        // 32-byte aligned for the tensor-core loads
        extern __shared__ __align__(128) float gcp_tc_sm[];
        sm = gcp_tc_sm;
    } else {
        extern __shared__ float4 gcp_sm4[];
        sm = (float*)gcp_sm4;
    }
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
    const int kh = blockIdx.x, c = blockIdx.y, sq = blockIdx.z, group = hv / hk;
    const GdnSeq q = gdn_seq(seqs, nseq, sq);
    const int r0 = q.r0, len = q.len;
    if (c * GC >= len) return;
    const int c0 = r0 + c * GC, l = min(GC, len - c * GC);
    const int kd = hk * dk, vd = hv * dv, w = 2 * kd + vd + 2 * hv;
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5;
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
    if (!TC && tid < GC) {
#pragma unroll
        for (int a = 0; a < 4; ++a) Ks[tid * ks + dk + a] = 0.0f;
    }
    __syncthreads();
    const int gi = tid >> 2, j0 = tid & 3;
    float kk[16], qk[16];
    if constexpr (TC) {
        // k·kᵀ into A's tile, q·kᵀ into T's (tile t = 4·ti + tj of each, two per warp), then
        // into registers in the FMA path's layout
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
            wmma::store_matrix_sync((t < 16 ? sA : sT) + 16 * ti * GCP + 16 * tj, acc, GCP,
                                    wmma::mem_row_major);
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < 16; ++u) {
            kk[u] = sA[gi * GCP + j0 + 4 * u];
            qk[u] = sT[gi * GCP + j0 + 4 * u];
        }
    } else {
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
    }
    for (int g = 0; g < group; ++g) {
        const int h = kh * group + g;
        const GdnSlab<float> b = gdn_slab(scratch, h, q, c, dk, dv);
        float *X = b.X, *Y = b.Y, *Qt = b.Qt, *Kt = b.Kt, *P = b.P, *cumg = b.cum;
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
            if constexpr (TC) {
                // the scaled T in A's place; output tile t = ti·(width/16) + tn, warp w taking
                // t = w, w + 8, …; row block ti sums over k < 16·(ti + 1) only
                for (int idx = tid; idx < GC * GC; idx += blockDim.x) {
                    const int i = idx >> 6, m = idx & 63;
                    sA[i * GCP + m] = sT[i * GCP + m] * sc[m];
                }
                __syncthreads();
                const int tw = width / 16;
                for (int t = wp; t < 4 * tw; t += 8) {
                    const int ti = t / tw, tn = t - ti * tw;
                    Acc acc;
                    wmma::fill_fragment(acc, 0.0f);
                    mma_rr(acc, sA + 16 * ti * GCP, GCP, src + 16 * tn, stride, 16 * (ti + 1));
                    wmma::store_matrix_sync(dst + (size_t)16 * ti * width + 16 * tn, acc, width,
                                            wmma::mem_row_major);
                }
                __syncthreads();
            } else {
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
}

extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_prep_f32(
    const float* __restrict__ rows, float* __restrict__ scratch, const unsigned* __restrict__ seqs,
    int nseq, int hk, int hv, int dk, int dv) {
    gdn_chunk_prep<false>(rows, scratch, seqs, nseq, hk, hv, dk, dv);
}

extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_prep_tc_f32(
    const float* __restrict__ rows, float* __restrict__ scratch, const unsigned* __restrict__ seqs,
    int nseq, int hk, int hv, int dk, int dv) {
    gdn_chunk_prep<true>(rows, scratch, seqs, nseq, hk, hv, dk, dv);
}

// GC rows of dk from the scratch into shared memory (rows padded to `ks`), every load issued
// before the first store; no barrier (the caller's).
__device__ __forceinline__ void gdn_stage_rows(const float* src, float* dst, int tid, int d4, int ks) {
    float4 b[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
        const int idx = tid + u * 256;
        if (idx < GC * d4) b[u] = *(const float4*)&src[(size_t)idx * 4];
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
        const int idx = tid + u * 256, i = idx / d4, a = (idx - i * d4) * 4;
        if (idx < GC * d4) *(float4*)&dst[i * ks + a] = b[u];
    }
}

// A chunk's Y and Q̃ (GC rows of dk, padded to `ks` in shared memory) and P (GC × GC, rows padded
// to GCP) from the scratch into shared memory, by a block of 256 threads: every load issued
// before the first store (dk ≤ 128: ≤ 8 float4 each), a barrier before the stores (the tiles'
// last readers) and after them. Both scans' chunk step begins with it.
__device__ __forceinline__ void gdn_stage_chunk(const float* Y, const float* Qt, const float* P,
    float* Ys, float* Qs, float* Ps, int tid, int d4, int ks) {
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
}

// One block of 256 threads per (value head, 32 value columns, sequence), chunk after chunk, the state
// tile S [dk][32] in shared memory: v' = X − Y·S, o = Q̃·S + P·v', S = e^{c_L} S + K̃ᵀ·v'.
// out = o [rows, hv·dv], then each sequence's state after its last row [hv·dk·dv]. Shared: S, Y and Q̃ (then K̃)
// [GC][dk+4], P [GC][GCP], v' [GC][32].
extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_scan_f32(
    const float* __restrict__ rows, const float* __restrict__ init,
    const float* __restrict__ scratch, float* __restrict__ out, const unsigned* __restrict__ seqs,
    int nseq, int hk, int hv, int dk,
    int dv) {
    extern __shared__ float4 gc_sm4[];
    float* sm = (float*)gc_sm4;
    const int ks = dk + 4, d4 = dk / 4;
    float* S = sm;
    float* Ys = S + dk * 32;
    float* Qs = Ys + GC * ks;
    float* Ps = Qs + GC * ks;
    float* vn = Ps + GC * GCP;
    const int h = blockIdx.x, j0 = blockIdx.y * 32, sq = blockIdx.z;
    const GdnSeq q = gdn_seq(seqs, nseq, sq);
    const int r0 = q.r0, len = q.len, nc = q.chunks;
    init += (size_t)sq * hv * dk * dv;
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5;
    const int vd = hv * dv;
    const bool live = j0 + lane < dv;
    const int j = live ? j0 + lane : 0;
    for (int a = wp; a < dk; a += 8) S[a * 32 + lane] = live ? init[((size_t)h * dk + a) * dv + j] : 0.0f;
    for (int c = 0; c < nc; ++c) {
        const int c0 = r0 + c * GC, l = min(GC, len - c * GC);
        const GdnSlab<const float> b = gdn_slab(scratch, h, q, c, dk, dv);
        const float *X = b.X, *Y = b.Y, *Qt = b.Qt, *Kt = b.Kt, *P = b.P;
        const float el = expf(b.cum[l - 1]);
        float xv[8];
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            const int i = wp + 8 * r;
            xv[r] = (i < l && live) ? X[(size_t)i * dv + j] : 0.0f;
        }
        gdn_stage_chunk(Y, Qt, P, Ys, Qs, Ps, tid, d4, ks);
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
        gdn_stage_rows(Kt, Qs, tid, d4, ks);
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
    float* st = out + (size_t)seqs[nseq] * vd + (size_t)sq * hv * dk * dv;
    if (live)
        for (int a = wp; a < dk; a += 8) st[((size_t)h * dk + a) * dv + j] = S[a * 32 + lane];
}
