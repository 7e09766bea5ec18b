#include "../cuda/common.cuh"
#include "gdn_mma.cuh"

// ---------------------------------------------------------------------------------------------
// The chunked gated delta rule's scan with its block products on the tensor cores
// (`gdn_chunk.rs`, `ChunkMath::Tf32`, after `gdn_chunk_prep_tc_f32` of `gdn_chunk.cu`; the
// algorithm and the CPU twin `chunked_host` as that file's). Same rows, scratch layout and grid
// as `gdn_chunk_scan_f32`; v' = X − Y·S, o = Q̃·S + P·v' and S ← e^{c_L} S + K̃ᵀ·v' are
// 16×16×8 TF32 MMAs with f32 accumulation (inputs rounded to 10 bits of mantissa, sums and the
// state in f32). dk a multiple of 16 (≤ 128), dv a multiple of 32 (≤ 256). The prep computes
// every row of a chunk, those past a short last chunk as zeros, so the products need no row
// bounds.
// ---------------------------------------------------------------------------------------------
// GC and GCP: the chunk and its padded row of gdn_chunk.cu, which kernels.cu includes first
#define TSP 36

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
    float* Qs = Ys + GC * ks;
    float* Ps = Qs + GC * ks;
    float* vn = Ps + GC * GCP;
    const int h = blockIdx.x, j0 = blockIdx.y * 32, sq = blockIdx.z;
    const GdnSeq q = gdn_seq(seqs, nseq, sq);
    const int r0 = q.r0, len = q.len, nc = q.chunks;
    init += (size_t)sq * hv * dk * dv;
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5;
    const int vd = hv * dv, ti = wp >> 1, tn = wp & 1;
    for (int a = wp; a < dk; a += 8) S[a * TSP + lane] = init[((size_t)h * dk + a) * dv + j0 + lane];
    for (int c = 0; c < nc; ++c) {
        const int c0 = r0 + c * GC, l = min(GC, len - c * GC);
        const GdnSlab<const float> b = gdn_slab(scratch, h, q, c, dk, dv);
        const float *X = b.X, *Y = b.Y, *Qt = b.Qt, *Kt = b.Kt, *P = b.P;
        const float last = b.cum[l - 1], el = expf(last);
        gdn_stage_chunk(Y, Qt, P, Ys, Qs, Ps, tid, d4, ks);
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
        gdn_stage_rows(Kt, Qs, tid, d4, ks);
        mma_rr(ao, Ps + 16 * ti * GCP, GCP, vn + 16 * tn, TSP, 16 * (ti + 1));
        if (l == GC) {
            wmma::store_matrix_sync(out + (size_t)(c0 + 16 * ti) * vd + h * dv + j0 + 16 * tn, ao, vd,
                                    wmma::mem_row_major);
        } else {
            wmma::store_matrix_sync(Ys + 16 * ti * TSP + 16 * tn, ao, TSP, wmma::mem_row_major);
        }
        __syncthreads();
        if (l < GC)
            for (int i = wp; i < l; i += 8) out[(size_t)(c0 + i) * vd + h * dv + j0 + lane] = Ys[i * TSP + lane];
        for (int t = wp; t < (dk / 16) * 2; t += 8) {
            const int ta = t >> 1, tb = t & 1;
            Acc acc;
            wmma::load_matrix_sync(acc, S + 16 * ta * TSP + 16 * tb, TSP, wmma::mem_row_major);
#pragma unroll
            for (int i = 0; i < acc.num_elements; ++i) acc.x[i] *= el;
            ACol fk;
            BRow fv;
            for (int m = 0; m < GC; m += 8) {
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

