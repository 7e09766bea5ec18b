//! dflash-core: the rules of DFlash speculative decoding as plain data, without candle.
//!
//! - [`config`]: serde mirrors of `config.json` (targets and z-lab drafters);
//! - [`taps`]: the tap convention (tap i = output of layer i = transformers' `hidden_states[i+1]`);
//! - [`visibility`]: which keys each query sees (target, draft, tree), written once;
//! - [`sampling`]: sampling parameters and the seeded sampler;
//! - [`acceptance`]: speculative sampling's acceptance rule at T > 0 (draft vs target);
//! - [`selector`]: DFlash2's candidate-selector walk (greedy, sampled, tree children);
//! - [`stats`]: τ and acceptance statistics, defined once;
//! - [`auto`]: `--mode auto`'s per-round budget from expected tokens and a round-cost model;
//! - [`segments`]: packed training rows (several sequences side by side);
//! - [`loops`]: where a response starts repeating itself (regeneration stops there, training cuts);
//! - [`runtime`]: the runtime configuration as a value (kernel plan, CPU products, tuning);
//! - [`env`]: the one registry of the `DFLASH_*` environment variables.

pub mod acceptance;
pub mod auto;
pub mod batch_policy;
pub mod config;
pub mod env;
pub mod loops;
pub mod runtime;
pub mod sampled_tree;
pub mod sampling;
pub mod segments;
pub mod selector;
pub mod stats;
pub mod taps;
pub mod tree;
pub mod visibility;

#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("invalid config: {0}")]
    Config(String),
    #[error("invalid sampling parameters: {0}")]
    Sampling(String),
}
