#include "../cuda/common.cuh"

// A tree's kept rows moved down in every K/V buffer at once (`crate::ops::keep_rows`): `table`
// holds the `buffers` buffers' addresses, then the `m` source rows; buffer p is [bh, cap, d].
// Thread i owns column e of head row-block c of buffer p and walks the moves in order:
// row fixed + j ← row moved[j]. The rows ascend with moved[j] >= fixed + j (the host checks),
// so no row is written before a later move reads it. Example: fixed 10, moved [11, 12]:
// row 10 ← 11, then row 11 ← 12.
template <typename T>
__device__ void keep_rows(const unsigned long long* table, unsigned long long buffers,
                          unsigned long long bh, unsigned long long cap, unsigned long long d,
                          unsigned long long fixed, unsigned long long m) {
    unsigned long long total = buffers * bh * d;
    const unsigned long long* moved = table + buffers;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned long long p = i / (bh * d), c = (i / d) % bh, e = i % d;
        T* col = reinterpret_cast<T*>(table[p]) + c * cap * d + e;
        for (unsigned long long j = 0; j < m; ++j) col[(fixed + j) * d] = col[moved[j] * d];
    }
}

#define KEEP_ROWS(NAME, T)                                                                         \
    extern "C" __global__ void keep_rows_##NAME(const unsigned long long* table,                   \
        unsigned long long buffers, unsigned long long bh, unsigned long long cap,                 \
        unsigned long long d, unsigned long long fixed, unsigned long long m) {                    \
        keep_rows<T>(table, buffers, bh, cap, d, fixed, m);                                        \
    }
KEEP_ROWS(f32, float)
KEEP_ROWS(bf16, __nv_bfloat16)
