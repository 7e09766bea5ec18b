//! The drafter's fingerprint of its target: the target identity hash, the kernel family and
//! precision that computed the training features, and tap statistics on fixed canary prompts,
//! computed by the trainer with the same engine, device and dtype it trained with. The doctor
//! recomputes it: a different linear-attention kernel, dtype or loading path that changes the
//! hidden states shows up here, and a different kernel family is named.

use anyhow::Result;
use candle_core::{DType, D};
use dflash_model::io::loader::{identity_hash, LoadedTarget};
use dflash_model::{Rows, Target};
use serde::{Deserialize, Serialize};

pub const CANARY_PROMPTS: &[&str] = &[
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Question: what is 12 times 7? Answer:",
];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TapStats {
    pub tap: usize,
    pub mean: f64,
    pub std: f64,
    /// The first values of the last row of the first canary prompt.
    pub head: Vec<f32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fingerprint {
    pub target_hash: String,
    pub dtype: String,
    pub device: String,
    pub canary_prompts: Vec<String>,
    pub taps: Vec<TapStats>,
    /// Absent in records written before kernel families were recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernels: Option<KernelFamily>,
}

/// What computed a target's hidden states: the linear-attention implementation (hybrid
/// targets) and the precision. Two implementations with the same `numerics` were tested
/// against the same reference and differ by rounding; other numerics differ by more (fla's
/// chunked kernels vs transformers' torch fallback: 7.6e-3 relative at tap 61 of a 64-layer
/// 27B-shaped hybrid in f32, `docs/BENCHMARKS.md`).
/// Example: dflash-rs training on an H200 in bf16 → `{linear_attention: "dflash-rs cuda (f32
/// state; prefill chunked as transformers' torch_chunk_gated_delta_rule)", numerics:
/// "transformers-torch-fallback", precision: "bf16"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelFamily {
    /// The Gated DeltaNet implementation; `None` for a target without linear attention.
    pub linear_attention: Option<String>,
    /// The reference those kernels reproduce: [`TORCH_FALLBACK`] for dflash-rs's, `"fla"`
    /// for fla's; `None` without linear attention.
    pub numerics: Option<String>,
    pub precision: String,
}

/// The numerics of transformers' `torch_chunk_gated_delta_rule` / `torch_recurrent_…`, which
/// dflash-rs's Gated DeltaNet paths (host and CUDA) are tested against.
pub const TORCH_FALLBACK: &str = "transformers-torch-fallback";

/// The kernel family `t` computes its hidden states with (its device and dtype).
pub fn kernel_family(t: &Target) -> KernelFamily {
    let linear = t.is_hybrid().then(|| {
        if t.device.is_cpu() {
            "dflash-rs host (f32; prefill chunked as transformers' torch_chunk_gated_delta_rule)"
        } else {
            "dflash-rs cuda (f32 state; prefill chunked as transformers' torch_chunk_gated_delta_rule)"
        }
    });
    KernelFamily {
        linear_attention: linear.map(String::from),
        numerics: linear.map(|_| TORCH_FALLBACK.to_string()),
        precision: format!("{:?}", t.dtype).to_lowercase(),
    }
}

/// How a kernel family stands against another (the doctor's judgement): other numerics are a
/// mismatch; the same numerics may still come from another implementation or precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelMatch {
    /// Other numerics: the hidden states differ by more than rounding.
    OtherNumerics,
    /// The same numerics; which of implementation and precision differ.
    SameNumerics {
        other_implementation: bool,
        other_precision: bool,
    },
}

impl KernelFamily {
    /// This family against `other`. Example: dflash-rs cuda bf16 against dflash-rs host f32 →
    /// `SameNumerics { other_implementation: true, other_precision: true }`; against fla →
    /// `OtherNumerics`.
    pub fn against(&self, other: &KernelFamily) -> KernelMatch {
        if self.numerics != other.numerics {
            return KernelMatch::OtherNumerics;
        }
        KernelMatch::SameNumerics {
            other_implementation: self.linear_attention != other.linear_attention,
            other_precision: self.precision != other.precision,
        }
    }

    /// `"linear attention X (numerics N), bf16"` or `"no linear attention, f32"`.
    pub fn describe(&self) -> String {
        match (&self.linear_attention, &self.numerics) {
            (Some(l), Some(n)) => {
                format!("linear attention {l} ({n} numerics), {}", self.precision)
            }
            (Some(l), None) => format!("linear attention {l}, {}", self.precision),
            _ => format!("no linear attention, {}", self.precision),
        }
    }
}

pub fn fingerprint(lt: &LoadedTarget, taps: &[usize]) -> Result<Fingerprint> {
    let t = &lt.target;
    let mut per_tap: Vec<Vec<f32>> = vec![Vec::new(); taps.len()];
    let mut heads = vec![Vec::new(); taps.len()];
    for (pi, p) in CANARY_PROMPTS.iter().enumerate() {
        let ids = lt.tokenizer.encode(p, false)?;
        let mut cache = t.new_cache();
        let out = t.forward_causal(&ids, &mut cache, taps, &Rows::None)?;
        for (i, h) in out.taps.iter().enumerate() {
            let h = h.to_dtype(DType::F32)?;
            per_tap[i].extend(h.flatten_all()?.to_vec1::<f32>()?);
            if pi == 0 {
                heads[i] = h
                    .get(ids.len() - 1)?
                    .narrow(D::Minus1, 0, 8)?
                    .to_vec1::<f32>()?;
            }
        }
    }
    let stats = taps
        .iter()
        .zip(per_tap)
        .zip(heads)
        .map(|((&tap, v), head)| {
            let n = v.len() as f64;
            let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
            let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
            TapStats {
                tap,
                mean,
                std: var.sqrt(),
                head,
            }
        })
        .collect();
    Ok(Fingerprint {
        target_hash: identity_hash(&lt.source)?,
        dtype: format!("{:?}", t.dtype).to_lowercase(),
        device: if t.device.is_cpu() {
            "cpu".into()
        } else {
            "cuda".into()
        },
        canary_prompts: CANARY_PROMPTS.iter().map(|s| s.to_string()).collect(),
        taps: stats,
        kernels: Some(kernel_family(t)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use dflash_model::io::loader::load_target;

    /// The hybrid fixture records dflash-rs's host Gated DeltaNet (torch-fallback numerics);
    /// an attention-only target records no linear attention.
    #[test]
    fn kernel_family_of_a_hybrid_and_an_attention_only_target() {
        let fixtures = dflash_testkit::fixtures();
        let hybrid = load_target(
            fixtures.join("qwen35-tiny").to_str().unwrap(),
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        let k = kernel_family(&hybrid.target);
        assert_eq!(k.numerics.as_deref(), Some(TORCH_FALLBACK));
        assert!(k.linear_attention.unwrap().starts_with("dflash-rs host"));
        assert_eq!(k.precision, "f32");
        let plain = load_target(
            fixtures.join("qwen3-tiny").to_str().unwrap(),
            DType::BF16,
            &Device::Cpu,
        )
        .unwrap();
        assert_eq!(
            kernel_family(&plain.target),
            KernelFamily {
                linear_attention: None,
                numerics: None,
                precision: "bf16".into()
            }
        );
    }
}
