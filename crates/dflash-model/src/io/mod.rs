//! Files in and out: targets resolved by path or alias, GGUF and safetensors weights under
//! their HF names, the tokenizer with its chat template, atomic writes, and the check that an
//! output holds nothing a command did not write.

pub mod atomic;
pub mod gguf;
pub mod loader;
pub mod outputs;
pub mod tokenizer;
pub mod weights;
