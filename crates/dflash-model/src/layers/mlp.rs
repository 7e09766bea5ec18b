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
    /// gate and up stacked into one product on a GPU ([`Mlp::stack_gate_up`]).
    pub gate_up: Option<Linear>,
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
            gate_up: None,
        })
    }

    /// On a GPU, gate and up as one stacked product ([`Linear::stack`]; both become views of
    /// it) and SwiGLU reading its halves in place. For frozen MLPs (the target's): the stacked
    /// weight is a copy that training would not update. Elsewhere nothing changes.
    pub fn stack_gate_up(&mut self) -> Result<()> {
        if let Some((gu, parts)) = Linear::stack(&[&self.gate_proj, &self.up_proj])? {
            let mut parts = parts.into_iter();
            if let (Some(g), Some(u)) = (parts.next(), parts.next()) {
                (self.gate_proj, self.up_proj, self.gate_up) = (g, u, Some(gu));
            }
        }
        Ok(())
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(gu) = &self.gate_up {
            let y = gu.forward(x)?;
            let inter = y.dim(candle_core::D::Minus1)? / 2;
            let a = tracing::info_span!(target: "phase", "mlp silu · up")
                .in_scope(|| crate::ops::silu_mul::silu_mul_stacked(&y, inter))?;
            return self.down_proj.forward(&a);
        }
        if crate::cpu::swiglu::serves(x) {
            // inference on the CPU: the gate in one pass on the calling thread
            let (g, u) = (self.gate_proj.forward(x)?, self.up_proj.forward(x)?);
            let a = tracing::info_span!(target: "phase", "mlp silu · up")
                .in_scope(|| crate::cpu::swiglu::silu_mul(&g, &u))?;
            return self.down_proj.forward(&a);
        }
        Ok(self.forward_parts(x)?.out)
    }

    /// [`Mlp::forward`] of separate gate and up products, with the products a written
    /// backward reads (the drafter's taped training forward).
    pub fn forward_parts(&self, x: &Tensor) -> Result<MlpParts> {
        let (gate, up) = (self.gate_proj.forward(x)?, self.up_proj.forward(x)?);
        let act = tracing::info_span!(target: "phase", "mlp silu · up")
            .in_scope(|| crate::ops::silu_mul::silu_mul(&gate, &up))?;
        let out = self.down_proj.forward(&act)?;
        Ok(MlpParts { gate, up, act, out })
    }
}

/// An MLP forward's products: `gate(x)`, `up(x)`, `act = silu(gate) · up` and `out = down(act)`.
#[derive(Debug, Clone)]
pub struct MlpParts {
    pub gate: Tensor,
    pub up: Tensor,
    pub act: Tensor,
    pub out: Tensor,
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
