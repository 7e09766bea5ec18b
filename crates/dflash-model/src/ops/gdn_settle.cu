#include "../cuda/common.cuh"

// A Gated DeltaNet layer's conv window after a forward's rows are kept (`gdn_settle.rs`; CPU
// twin: the composed index_select, concatenation and copy): in place, conv [k1, C] becomes the
// last k1 rows of [conv | inputs[t0], …, inputs[t(m-1)]] (inputs' rows ld apart: a column range
// of the layer's stacked in-projection). One thread per channel holds the channel's k1 old
// values, so no thread reads a row another overwrites. Example: k1 = 3, one row kept (m = 1,
// t0 = 0): conv ← [conv1, conv2, inputs0].
extern "C" __global__ void gdn_settle_conv_f32(float* conv, const float* inputs, int ld, int C,
    int k1, int m, int t0, int t1, int t2, int t3, int t4, int t5, int t6, int t7) {
    const int t[8] = {t0, t1, t2, t3, t4, t5, t6, t7};
    for (int ch = blockIdx.x * blockDim.x + threadIdx.x; ch < C; ch += gridDim.x * blockDim.x) {
        float old[8];
        for (int j = 0; j < k1; j++) old[j] = conv[(size_t)j * C + ch];
        for (int j = 0; j < k1; j++) {
            const int w = m + j;
            conv[(size_t)j * C + ch] = w < k1 ? old[w] : inputs[(size_t)t[w - k1] * ld + ch];
        }
    }
}
