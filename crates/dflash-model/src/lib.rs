//! dflash-model: candle models for DFlash speculative decoding.
//!
//! The rooms (docs/DESIGN.md): [`models`] (the target, its families, the drafter),
//! [`layers`] (attention, Gated DeltaNet, projections, MLP, norms, RoPE), [`cache`] (KV rows
//! and linear-attention states), [`ops`] (softmax family, cross-entropy, block attention),
//! [`cpu`] (inference kernels), [`cuda`] (kernels, graphs, launch profiling), [`io`]
//! (GGUF, safetensors, tokenizer, loading), [`device`] (device and dtype names).

pub mod cache;
pub mod cpu;
pub mod cuda;
pub mod device;
pub mod io;
pub mod layers;
pub mod models;
pub mod ops;
pub mod profile;

pub use cache::kv_cache::KvCache;
pub use candle_core;
pub use device::{device, dtype};
pub use models::target::{CacheLayout, ForwardInputs, Rows, Target, TargetOutput};
