#include "../cuda/common.cuh"

// ---------------------------------------------------------------------------------------------
// The gated delta rule's recurrence over a forward's new rows (`gdn_recurrence.rs`; its CPU
// twin `recurrence_host`). One block per (value head h, 32 value columns); 128 threads = 4
// slices of the key dimension × 32 columns; the block's state tile S[dk][32] in shared memory.
// rows[i] = q | k | v | β | g (2·hk·dk + hv·dv + 2·hv floats); parents[i] = the row whose state
// row i starts from (0xffffffff: the committed state `init`). out = o [n, hv·dv], then the
// states [n, hv·dk·dv] (keep) or the state after the last row (!keep; rows form a chain).
// Grid z: independent sequences of the same n rows and parents (a batched step): sequence z
// reads rows[z·n …] and init[z], writes o[z·n …] and, after every sequence's o, its states.
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
    const size_t z = blockIdx.z;
    rows += z * n * (size_t)w;
    init += z * sl;
    float* states = out + (size_t)gridDim.z * o_len + z * (keep ? (size_t)n : 1) * sl;
    out += z * o_len;
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
