//! SwiGLU MLP: `down(silu(gate(x)) * up(x))`, shared by every target family and the drafter.

use crate::layers::linear::Linear;
use candle_core::Module;
use candle_core::{Result, Tensor};

use crate::io::weights::TensorStore;

#[derive(Debug, Clone)]
pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl Mlp {
    /// Load `{prefix}.gate_proj`, `up_proj`, `down_proj` (no biases).
    pub fn load(
        store: &TensorStore,
        prefix: &str,
        hidden: usize,
        inter: usize,
    ) -> anyhow::Result<Self> {
        let lin = |name: &str, o: usize, i: usize| -> anyhow::Result<Linear> {
            load_linear(store, &format!("{prefix}.{name}"), o, i, false)
        };
        Ok(Self {
            gate_proj: lin("gate_proj", inter, hidden)?,
            up_proj: lin("up_proj", inter, hidden)?,
            down_proj: lin("down_proj", hidden, inter)?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (g, u) = (self.gate_proj.forward(x)?, self.up_proj.forward(x)?);
        let a = tracing::info_span!(target: "phase", "mlp silu · up")
            .in_scope(|| crate::ops::silu_mul::silu_mul(&g, &u))?;
        self.down_proj.forward(&a)
    }
}

/// `Linear` for `{name}.weight` `[out, in]` and an optional `{name}.bias`.
pub fn load_linear(
    store: &TensorStore,
    name: &str,
    out: usize,
    inp: usize,
    bias: bool,
) -> anyhow::Result<Linear> {
    let w = format!("{name}.weight");
    let b = if bias {
        Some(store.get(&format!("{name}.bias"), &[out])?)
    } else {
        None
    };
    Ok(match store.quant(&w, &[out, inp]) {
        Some(q) => Linear::from_blocks(&q, b, || store.get(&w, &[out, inp]))?,
        None => Linear::new(store.get(&w, &[out, inp])?, b),
    })
}
