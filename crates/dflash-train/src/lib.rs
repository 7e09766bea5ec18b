//! dflash-train: data regeneration with the target, anchors, the block-masked loss, AdamW,
//! checkpoints with exact resume, and the training loop.

pub mod anchors;
pub mod checkpoint;
pub mod collective;
pub mod config;
pub mod curves;
pub mod data;
pub mod fingerprint;
pub mod flops;
pub mod loops;
pub mod loss;
pub mod optim;
pub mod overlap;
pub mod pack;
pub mod progress;
pub mod prompt_fields;
pub mod prompts;
pub mod regen;
mod regen_pending;
pub mod regen_ranks;
pub mod selector_loss;
pub mod shard;
pub mod sharegpt;
pub mod trainer;
pub mod vocab;
