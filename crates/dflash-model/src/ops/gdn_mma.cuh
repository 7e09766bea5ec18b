// The TF32 tensor-core helpers of the chunked Gated DeltaNet kernels (`gdn_chunk.cu`'s prep,
// `gdn_chunk_tc.cu`'s scan): 16×16×8 fragments, their rounding to TF32, a row-major product.
#pragma once

#include <mma.h>

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
