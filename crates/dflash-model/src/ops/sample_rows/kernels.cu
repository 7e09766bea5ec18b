#include "../../cuda/common.cuh"
#include "pick.cuh"

// Sampling at T > 0 on the device (`crate::ops::sample_rows`, launched from `kernels.rs` beside
// this file): the probabilities, the draws, the verdicts and the sampling rule's cuts.

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
// row on one SM, a walk with one load at a time waits on each load's latency.
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
// `bisect`: over a whole vocabulary the search's fewer passes win; after a top-k cut, and for
// the top-k cut itself, its 15 sums per read cost more than bisection's extra passes
// (`docs/BENCHMARKS.md`, the sampling rule's cut search).
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
