// dflash-rs's own CUDA kernels, gathered into one compilation unit: build.rs compiles this file
// to one PTX module (`crate::cuda::ptx::PTX`), in which every kernel is found by its name. Each
// family's source sits beside the Rust module that launches it and holds its CPU twin
// (`src/ops/gemv.rs` launches `src/ops/gemv.cu`); `crate::cuda::kernel_check` compares the two.
// Device helpers more than one family uses: common.cuh (loads and stores by storage type, block
// reductions, 16-byte vectors, the total order of f32), mma.cuh (the tensor-core primitives),
// src/ops/sample_rows/pick.cuh (a block's weighted draw). Each family includes the headers it
// uses, so it also compiles alone; each is included here once (a test in dflash-eval's
// tests/docs.rs checks that every `.cu` is).
//
// Most element-wise and row kernels: one CUDA block per row, a strided loop per thread, block
// reductions through warp shuffles and one shared-memory slot per warp. Arithmetic in f32
// whatever the storage.

// training: the drafter's block softmax, the fused cross-entropy, the RMSNorm and SwiGLU
// backwards, the gradient norm, AdamW
#include "../ops/block_softmax.cu"
#include "../ops/cross_entropy.cu"
#include "../ops/rms_norm_grad.cu"
#include "../ops/silu_mul.cu"
#include "../ops/sq_sum.cu"
#include "../ops/adamw.cu"

// attention: the interval softmax, the interval and decode kernels, the tensor-core prefill,
// verify and training kernels, the masked softmax
#include "../ops/interval_softmax.cu"
#include "../ops/interval_attention.cu"
#include "../ops/mma_attention.cu"
#include "../ops/train_attention/kernels.cu"
#include "../ops/masked_softmax.cu"

// sampling: arg-max, T > 0 (probabilities, draws, verdicts, the rule's cuts), a sampled tree,
// top-k
#include "../ops/argmax.cu"
#include "../ops/sample_rows/kernels.cu"
#include "../ops/sampled_tree.cu"
#include "../ops/top_k.cu"

// Gated DeltaNet: the recurrence, the layer's prep and gated norm, the conv window's settle,
// the chunked prefill
#include "../ops/gdn_recurrence.cu"
#include "../ops/gdn_prep.cu"
#include "../ops/gdn_settle.cu"
#include "../ops/gdn_chunk.cu"
#include "../ops/gdn_chunk_tc.cu"

// the decode layer and its caches: the per-head norms, RoPE and cache writes, partial RoPE, the
// residual add
// with its RMSNorm, one-row products, indexed cache writes, a tree's kept rows, strided copies
#include "../ops/qkv_rope.cu"
#include "../ops/rope_partial.cu"
#include "../ops/add_norm.cu"
#include "../ops/gemv.cu"
#include "../ops/scatter_rows.cu"
#include "../ops/keep_rows.cu"
#include "../ops/permute.cu"
