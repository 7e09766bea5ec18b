#include "../cuda/common.cuh"

// ---------------------------------------------------------------------------------------------
// A Gated DeltaNet layer's prep (`gdn_prep.rs`; CPU twin `prep_host`): one block per row i.
// conv[ch] = SiLU(Σ_tap w[tap][ch] · buf[idx[i][tap]][ch]) (the zero row skipped), taps newest
// first; q, k heads L2-normalised (q · dk^-½); v copied; β = sigmoid(b), g = neg_a · softplus(a
// + dt_bias). out[i] = q | k | v | β | g; the conv goes to out first and is normalised in place.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

extern "C" __global__ void gdn_prep_f32(const float* buf, const float* ba, const uint32_t* idx,
    const float* consts, float* out, int hk, int hv, int dk, int dv, int K, uint32_t zero_row) {
    const int i = blockIdx.x;
    const int kd = hk * dk, vd = hv * dv, c = 2 * kd + vd, w = c + 2 * hv;
    // zero_row: the buffer's last row (its rows: K - 1 + n for one sequence, every slot's
    // K - 1 and its row for a batched step)
    float* o = out + (size_t)i * w;
    for (int ch = threadIdx.x; ch < c; ch += blockDim.x) {
        float acc = 0.0f;
        for (int tap = K - 1; tap >= 0; --tap) {
            const uint32_t r = idx[(size_t)i * K + tap];
            if (r == zero_row) continue;
            acc += consts[(size_t)tap * c + ch] * buf[(size_t)r * c + ch];
        }
        o[ch] = silu_f(acc);
    }
    __syncthreads();
    // one warp per (q or k, head): Σ x², then the scale
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    for (int s = warp; s < 2 * hk; s += nw) {
        float* x = o + (size_t)s * dk;  // q heads first, then k heads
        float ss = 0.0f;
        for (int j = lane; j < dk; j += 32) ss += x[j] * x[j];
        for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, off);
        float scale = 1.0f / sqrtf(ss + 1e-6f);
        if (s < hk) scale = scale / sqrtf((float)dk);
        __syncwarp();
        for (int j = lane; j < dk; j += 32) x[j] = x[j] * scale;
    }
    const float* dt_bias = consts + (size_t)K * c;
    const float* neg_a = dt_bias + hv;
    for (int h = threadIdx.x; h < hv; h += blockDim.x) {
        const float b = ba[(size_t)i * 2 * hv + h];
        const float a = ba[(size_t)i * 2 * hv + hv + h] + dt_bias[h];
        o[c + h] = 1.0f / (1.0f + expf(-b));
        o[c + hv + h] = neg_a[h] * (a > 20.0f ? a : log1pf(expf(a)));
    }
}

// The gated RMSNorm (`gdn_prep.rs`; CPU twin `gated_norm_host`): one block per (row, value head)
// of dv values: out = w · (o · rsqrt(mean(o²) + eps)) · SiLU(z).
extern "C" __global__ void gated_norm_f32(const float* o, const float* z, const float* w, float* out,
    int dv, float eps) {
    __shared__ float sh[32];
    const size_t base = (size_t)blockIdx.x * dv;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < dv; j += blockDim.x) ss += o[base + j] * o[base + j];
    ss = block_sum(ss, sh);
    const float inv = 1.0f / sqrtf(ss / (float)dv + eps);
    for (int j = threadIdx.x; j < dv; j += blockDim.x)
        out[base + j] = w[j] * (o[base + j] * inv) * silu_f(z[base + j]);
}
