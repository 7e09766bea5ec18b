//! DFlash2 drafters (z-lab's `DFlash2DraftModel`): their marker and their conv and selector
//! sizes.

use serde::{Deserialize, Serialize};

use super::DrafterConfig;
use crate::CoreError;

/// `architectures` entry of z-lab's DFlash2 drafters.
pub const DFLASH2_ARCH: &str = "DFlash2DraftModel";

/// DFlash2's extra sizes (`dflash_config`): per layer two grouped dynamic causal convs of
/// `conv_kernel_size` taps whose dynamic taps are shared by `conv_group_size` channels, and a
/// candidate selector rescoring the top `selector_top_k` logits with rank-`selector_rank`
/// codebooks. The published drafters: K = 2, groups of 16, rank 256, top 16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dflash2Params {
    pub conv_kernel_size: usize,
    pub conv_group_size: usize,
    pub selector_rank: usize,
    pub selector_top_k: usize,
}

impl DrafterConfig {
    /// True for z-lab's `DFlash2DraftModel` (`architectures`).
    pub fn is_dflash2(&self) -> bool {
        self.architectures.iter().any(|a| a == DFLASH2_ARCH)
    }

    /// A DFlash2 drafter's conv and selector sizes (`dflash_config` first, then the top level,
    /// as z-lab reads them); `None` for a DFlash drafter.
    pub fn dflash2(&self) -> Result<Option<Dflash2Params>, CoreError> {
        if !self.is_dflash2() {
            return Ok(None);
        }
        let get = |name: &str| -> Result<usize, CoreError> {
            let v = self
                .dflash_config
                .extra
                .get(name)
                .or_else(|| self.extra.get(name));
            match v.and_then(|v| v.as_u64()) {
                Some(x) if x > 0 => Ok(x as usize),
                Some(_) => Err(CoreError::Config(format!("{name} must be >= 1"))),
                None => Err(CoreError::Config(format!(
                    "{DFLASH2_ARCH} needs dflash_config.{name} (a positive integer)"
                ))),
            }
        };
        let p = Dflash2Params {
            conv_kernel_size: get("conv_kernel_size")?,
            conv_group_size: get("conv_group_size")?,
            selector_rank: get("selector_rank")?,
            selector_top_k: get("selector_top_k")?,
        };
        if !self.hidden_size.is_multiple_of(p.conv_group_size) {
            return Err(CoreError::Config(format!(
                "conv_group_size {} does not divide hidden_size {}",
                p.conv_group_size, self.hidden_size
            )));
        }
        if p.selector_top_k > self.vocab_size {
            return Err(CoreError::Config(format!(
                "selector_top_k {} exceeds the vocabulary ({})",
                p.selector_top_k, self.vocab_size
            )));
        }
        Ok(Some(p))
    }
}
