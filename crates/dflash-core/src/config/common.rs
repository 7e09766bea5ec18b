//! What both configs share: RoPE parameters, token id fields, defaults and the RoPE checks.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::CoreError;

/// `rope_parameters` as transformers 5 writes it (`rope_theta` moved in here).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct RopeParameters {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_type: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A token id field that may be a single id or a list (`eos_token_id: [1, 2]`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(t) => vec![*t],
            TokenIds::Many(v) => v.clone(),
        }
    }
}

pub(super) fn default_eps() -> f64 {
    1e-6
}
pub(super) fn default_max_pos() -> usize {
    32768
}

/// RoPE theta from `rope_theta` or `rope_parameters.rope_theta`; 10000 when neither is set.
pub(super) fn rope_theta_of(rope_theta: Option<f64>, params: &Option<RopeParameters>) -> f64 {
    rope_theta
        .or_else(|| params.as_ref().and_then(|p| p.rope_theta))
        .unwrap_or(10_000.0)
}

/// Rejects RoPE scaling we do not implement instead of silently computing something else.
pub(super) fn check_rope_scaling(
    scaling: &Option<Value>,
    params: &Option<RopeParameters>,
) -> Result<(), CoreError> {
    let kind = scaling
        .as_ref()
        .and_then(|v| v.get("rope_type").or_else(|| v.get("type")))
        .and_then(|v| v.as_str())
        .map(str::to_string)
        .or_else(|| params.as_ref().and_then(|p| p.rope_type.clone()));
    match kind.as_deref() {
        None | Some("default") => Ok(()),
        Some(other) => Err(CoreError::Config(format!(
            "rope scaling type '{other}' is not supported (only plain RoPE)"
        ))),
    }
}
