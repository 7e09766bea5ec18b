//! Test support shared by every crate's tests (a dev-dependency only): where the fixtures and
//! the cached assets are, the tiny random targets and SmolLM2, reference tensors and error
//! metrics, data directories for the trainer, and a chi-square test.
//!
//! Tests import it as `use dflash_testkit as common;`, so `common::tiny()` reads the same
//! everywhere.

mod data;
pub mod fuzz;
pub mod http;
mod paths;
mod refs;
pub mod serve;
mod stats;
mod targets;

pub use data::{four_sequences, sequence, shard_files, tiny_data, write_data};
pub use paths::{asset, fixtures, repo_root, smollm2_gguf, tmp};
pub use refs::{assert_finite_difference, ids, json, load_ref, max_abs, rel_err};
pub use stats::{assert_distributed_alike, chi_square_p, gamma_q};
pub use targets::{
    batched_outputs, decode, fresh_block, greedy, load, loop_prompt, loop_prompt_head,
    prefill_taps, quiet, replay_zlab_generation, req, sampled_counts, sampled_counts_with,
    signal_drafter, smollm2, tiny, tiny_hybrid, tiny_prompt, tiny_target_dir,
};
