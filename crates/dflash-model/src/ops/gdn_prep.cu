#include "../cuda/common.cuh"

// ---------------------------------------------------------------------------------------------
// A Gated DeltaNet layer's prep (`gdn_prep.rs`; CPU twin `prep_host`): one block per (row i,
// segment s), the segments the row's q heads, k heads, v heads, then one for β and g, so one
// row alone (an AR step) still fills the SMs. A head's block: conv[ch] = SiLU(Σ_tap w[tap][ch]
// · buf[idx[i][tap]][ch]) (the zero row skipped), taps newest first; a q or k head then
// L2-normalised (q · dk^-½), a v head copied. The last block: β = sigmoid(b), g = neg_a ·
// softplus(a + dt_bias). out[i] = q | k | v | β | g. `more`'s rows are ldm apart and ba's ldba
// (column ranges of the layer's stacked in-projection). Example: Qwen3.6-27B (16 key heads, 48
// value heads): 16 + 16 + 48 + 1 = 81 blocks a row.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

extern "C" __global__ void gdn_prep_f32(const float* buf, const float* more, int ldm,
    uint32_t held, const float* ba, int ldba, const uint32_t* idx, const float* consts, float* out,
    int hk, int hv, int dk, int dv, int K, uint32_t zero_row) {
    __shared__ float sh[32];
    const int i = blockIdx.x, s = blockIdx.y;
    const int kd = hk * dk, vd = hv * dv, c = 2 * kd + vd, w = c + 2 * hv;
    float* o = out + (size_t)i * w;
    if (s == 2 * hk + hv) {
        const float* dt_bias = consts + (size_t)K * c;
        const float* neg_a = dt_bias + hv;
        for (int h = threadIdx.x; h < hv; h += blockDim.x) {
            const float b = ba[(size_t)i * ldba + h];
            const float a = ba[(size_t)i * ldba + hv + h] + dt_bias[h];
            o[c + h] = 1.0f / (1.0f + expf(-b));
            o[c + hv + h] = neg_a[h] * (a > 20.0f ? a : log1pf(expf(a)));
        }
        return;
    }
    const bool qk = s < 2 * hk;
    const int ch0 = qk ? s * dk : 2 * kd + (s - 2 * hk) * dv, len = qk ? dk : dv;
    // the window's rows: buf's `held` rows, then more's; zero_row (one past them) reads zeros
    // (the rows: K - 1 committed and n new for one sequence, every slot's K - 1 and its row for
    // a batched step)
    float ss = 0.0f;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        const int ch = ch0 + j;
        float acc = 0.0f;
        for (int tap = K - 1; tap >= 0; --tap) {
            const uint32_t r = idx[(size_t)i * K + tap];
            if (r == zero_row) continue;
            const float* src = r < held ? buf + (size_t)r * c : more + (size_t)(r - held) * ldm;
            acc += consts[(size_t)tap * c + ch] * src[ch];
        }
        const float v = silu_f(acc);
        o[ch] = v;
        ss += v * v;
    }
    if (!qk) return;
    // the head's Σ x², then the scale (each thread rescales the values it wrote)
    ss = block_sum(ss, sh);
    float scale = 1.0f / sqrtf(ss + 1e-6f);
    if (s < hk) scale = scale / sqrtf((float)dk);
    for (int j = threadIdx.x; j < len; j += blockDim.x) o[ch0 + j] *= scale;
}

// The gated RMSNorm (`gdn_prep.rs`; CPU twin `gated_norm_host`): one block per (row, value head)
// of dv values: out = w · (o · rsqrt(mean(o²) + eps)) · SiLU(z), in f32, rounded once to T. o is
// [rows, hv·dv] contiguous; z's rows are ldz apart (columns of the stacked in-projection).
template <typename T>
__device__ void gated_norm(const float* o, const float* z, const float* w, T* out, int dv, int hv,
                           int ldz, float eps) {
    __shared__ float sh[32];
    const size_t base = (size_t)blockIdx.x * dv;
    const float* zr = z + (size_t)(blockIdx.x / hv) * ldz + (size_t)(blockIdx.x % hv) * dv;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < dv; j += blockDim.x) ss += o[base + j] * o[base + j];
    ss = block_sum(ss, sh);
    const float inv = 1.0f / sqrtf(ss / (float)dv + eps);
    for (int j = threadIdx.x; j < dv; j += blockDim.x)
        st(out, base + j, w[j] * (o[base + j] * inv) * silu_f(zr[j]));
}
#define GATED_NORM(NAME, T)                                                                        \
    extern "C" __global__ void gated_norm_##NAME(const float* o, const float* z, const float* w,   \
                                                 T* out, int dv, int hv, int ldz, float eps) {     \
        gated_norm<T>(o, z, w, out, dv, hv, ldz, eps);                                             \
    }
GATED_NORM(f32, float)
GATED_NORM(bf16, __nv_bfloat16)
