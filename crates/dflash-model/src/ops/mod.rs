//! Tensor ops of our own, each with its closed-form backward where training needs one and a
//! CPU twin for every CUDA kernel: the softmax family, the fused cross-entropy, the drafter's
//! block attention, the target's interval softmax, the decode layer's fused kernels (the
//! per-head norms, RoPE and cache writes, the residual add with its RMSNorm, the masked
//! softmax, one-row products, indexed cache writes), sampling at T > 0 on the device (probabilities,
//! draws, speculative verdicts, a sampled tree's draws and walk), and the comparison every parity check
//! uses.

// Every kernel of ours that replaces composed ops can be turned off to compare the two paths:
// `dflash_core::runtime::off(Kernel::…)`, from `--disable-kernels` / `DFLASH_DISABLED_KERNELS`.

pub mod adamw;
pub mod add_norm;
pub mod argmax;
pub mod block_attention;
pub mod block_softmax;
pub mod compare;
pub mod cross_entropy;
pub mod gdn_chunk;
pub mod gdn_prep;
pub mod gdn_recurrence;
pub mod gdn_settle;
pub mod gemv;
pub mod interval_attention;
pub mod interval_softmax;
pub mod keep_rows;
pub(crate) mod kernel_io;
pub mod log_softmax;
pub mod masked_softmax;
pub mod permute;
pub mod prefill_attention;
pub mod qkv_rope;
pub mod rms_norm_grad;
pub mod rope_partial;
pub mod sample_rows;
pub mod sampled_tree;
pub mod scatter_rows;
pub mod silu_mul;
pub mod softmax;
pub mod sq_sum;
pub mod top_k;
pub mod train_attention;
pub mod with_grad;
