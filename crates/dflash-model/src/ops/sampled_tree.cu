#include "../cuda/common.cuh"
#include "sample_rows/pick.cuh"

// A sampled tree's draws and walk on the device (`crate::ops::sampled_tree`).

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
