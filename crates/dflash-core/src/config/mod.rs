//! Serde mirrors of HF `config.json` files, field for field.
//!
//! [`TargetConfig`] mirrors the config of a transformers causal LM (`LlamaForCausalLM`,
//! `Qwen2ForCausalLM`, `Qwen3ForCausalLM`); [`DrafterConfig`] mirrors z-lab's
//! `DFlashDraftModel` config (a Qwen3 config plus `block_size`, `num_target_layers` and
//! `dflash_config`; z-lab's `DFlash2DraftModel` adds conv and selector sizes there, see
//! [`Dflash2Params`]). Unknown fields are kept in `extra` so a config round-trips.

mod common;
mod dflash2;
mod drafter;
mod target;

pub use common::{RopeParameters, TokenIds};
pub use dflash2::{Dflash2Params, DFLASH2_ARCH};
pub use drafter::{DFlashSection, DrafterConfig, AUX_TAP_FIELD};
pub use target::{TargetConfig, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH};
