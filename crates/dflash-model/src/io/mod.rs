//! Files in and out: targets resolved by path or alias, GGUF and safetensors weights under
//! their HF names, the tokenizer with its chat template, and atomic writes.

pub mod atomic;
pub mod gguf;
pub mod loader;
pub mod tokenizer;
pub mod weights;
