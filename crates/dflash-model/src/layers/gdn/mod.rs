//! Gated DeltaNet (linear attention) layers of Qwen3.5-style hybrid targets, with the state
//! handling speculative decoding needs.
//!
//! Per layer: `in_proj_qkv` → depthwise causal conv1d (kernel K, no bias) + SiLU over the qkv
//! channels, with a conv state of the last K-1 inputs; q, k L2-normalised in f32
//! (`x · rsqrt(Σx² + 1e-6)`), q scaled by dk^-½; β = sigmoid(b); g = -exp(A_log) ·
//! softplus(a + dt_bias); per value head h (key head h / (Hv/Hk), as `repeat_interleave`), with
//! state S ∈ R^{dk×dv} in f32: `S ← S·exp(g_t); kv = Sᵀk_t; δ = (v_t - kv)·β_t; S ← S + k_t δᵀ;
//! o_t = Sᵀq_t`; gated RMSNorm with a plain weight `w · rmsnorm(o) · SiLU(z)`; `out_proj`.
//!
//! **Rows and parents.** A forward's new rows form a chain (prefill, AR, chain verify) or a
//! tree (DDTree verify). The parent of new row i is its nearest visible earlier new row under
//! the forward's mask (the same ancestor-only mask attention uses); a row without one starts
//! from the committed state. Each row's conv window is its ancestor chain's inputs and its
//! recurrence starts from its parent's state. Example: tree parents [-, 0, 0, 1]: row 3 runs
//! from row 1's state with conv window [.., in0, in1, in3].
//!
//! **Rollback.** The recurrent path keeps the state after every row of the last forward;
//! `KvCache::truncate` / `keep_rows` then install the state after the last committed row (a
//! chain prefix, or a root-to-node tree path). A prefill (the first forward, a chain of ≥
//! `chunk_min_rows` rows) uses the chunked algorithm of transformers'
//! `torch_chunk_gated_delta_rule` (chunk 64; [`crate::ops::gdn_chunk`]) and keeps only its
//! final state.
//!
//! **Where it runs.** On the CPU every step runs on the host in f32 (the reference). On a GPU
//! the layer stays on the device, three kernels around the projections: the prep (the conv over
//! each row's window, SiLU, q/k norms, β and g; [`crate::ops::gdn_prep`]), the rule (chunked
//! for a prefill, [`crate::ops::gdn_chunk`]; recurrent otherwise,
//! [`crate::ops::gdn_recurrence`]) and the gated norm, each with its CPU twin (the host path's
//! own steps); the states live on the device and rollback selects the kept row's state there
//! (no host round trip).

use crate::layers::linear::Linear;
use crate::ops::gdn_recurrence::RecurrenceDims;
use anyhow::Result;
use candle_core::{DType, Tensor};

use crate::io::weights::TensorStore;
use crate::layers::mlp::load_linear;

mod forward;
mod prefill;
mod slots;
mod state;
#[cfg(test)]
mod tests;

pub use forward::GdnRowsInput;
pub use slots::{slot_windows, GdnSlots};
pub use state::{GdnCache, GdnRows, GdnState};

#[derive(Debug, Clone, Copy)]
pub struct GdnDims {
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
    pub kernel: usize,
}

impl GdnDims {
    pub fn conv_dim(&self) -> usize {
        2 * self.hk * self.dk + self.hv * self.dv
    }
    fn state_len(&self) -> usize {
        self.hv * self.dk * self.dv
    }
    /// Values of one sequence's state: the conv window (`(K-1) · C`) and S.
    pub fn slot_state_len(&self) -> usize {
        (self.kernel - 1) * self.conv_dim() + self.state_len()
    }
    fn recurrence(&self) -> RecurrenceDims {
        RecurrenceDims {
            hk: self.hk,
            hv: self.hv,
            dk: self.dk,
            dv: self.dv,
        }
    }
}

#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    in_proj_qkv: Linear,
    in_proj_z: Linear,
    in_proj_b: Linear,
    in_proj_a: Linear,
    /// The four in-projections stacked into one product on a GPU (`[qkv | z | b | a]`:
    /// [`GatedDeltaNet::stack_in_projections`]); `None` keeps four.
    in_proj: Option<Linear>,
    out_proj: Linear,
    norm: Vec<f32>,
    eps: f32,
    pub dims: GdnDims,
    /// The prep's constants as one f32 tensor on the layer's device (`[K·C + 2·Hv]`: the conv
    /// tap-major, `dt_bias`, `−exp(A_log)`; [`crate::ops::gdn_prep`]) and the norm weight.
    consts: Tensor,
    norm_w: Tensor,
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}
impl GatedDeltaNet {
    pub fn load(
        store: &TensorStore,
        p: &str,
        hidden: usize,
        dims: GdnDims,
        eps: f64,
    ) -> Result<Self> {
        let c = dims.conv_dim();
        let vd = dims.hv * dims.dv;
        let f32_of = |name: &str, shape: &[usize]| -> Result<Tensor> {
            Ok(store
                .get(&format!("{p}.{name}"), shape)?
                .to_dtype(DType::F32)?)
        };
        let consts = Tensor::cat(
            &[
                f32_of("conv1d.weight", &[c, 1, dims.kernel])?
                    .reshape((c, dims.kernel))?
                    .t()?
                    .flatten_all()?,
                f32_of("dt_bias", &[dims.hv])?,
                f32_of("A_log", &[dims.hv])?.exp()?.neg()?,
            ],
            0,
        )?
        .contiguous()?;
        let norm_w = f32_of("norm.weight", &[dims.dv])?;
        Ok(Self {
            in_proj_qkv: load_linear(store, &format!("{p}.in_proj_qkv"), c, hidden, false)?,
            in_proj_z: load_linear(store, &format!("{p}.in_proj_z"), vd, hidden, false)?,
            in_proj_b: load_linear(store, &format!("{p}.in_proj_b"), dims.hv, hidden, false)?,
            in_proj_a: load_linear(store, &format!("{p}.in_proj_a"), dims.hv, hidden, false)?,
            in_proj: None,
            out_proj: load_linear(store, &format!("{p}.out_proj"), hidden, vd, false)?,
            norm: host(&store.get(&format!("{p}.norm.weight"), &[dims.dv])?)?,
            eps: eps as f32,
            dims,
            consts,
            norm_w,
        })
    }

    /// `x`: `[1, n, hidden]`; `parents[i]`: the parent row of new row i (see the module doc).
    /// On the CPU the host path, elsewhere the device path.
    pub fn forward(
        &self,
        x: &Tensor,
        rows: &GdnRowsInput,
        cache: &mut GdnCache,
        chunk_min_rows: usize,
    ) -> Result<Tensor> {
        if x.dim(0)? != 1 {
            anyhow::bail!(
                "a one-sequence linear-attention state got {} sequences (a batched forward needs a batched cache)",
                x.dim(0)?
            );
        }
        if x.device().is_cpu() {
            self.forward_host(x, &rows.parents, cache, chunk_min_rows)
        } else {
            self.forward_device(x, rows, cache, chunk_min_rows)
        }
    }

    /// Whether this forward runs the recurrence keeping every row's state: everything but a
    /// prefill (the first forward, a chain of ≥ `chunk_min_rows` rows), which keeps the last.
    fn keeps_every_state(
        parents: &[Option<usize>],
        cache: &mut GdnCache,
        chunk_min_rows: usize,
    ) -> bool {
        let is_chain = parents
            .iter()
            .enumerate()
            .all(|(i, p)| *p == i.checked_sub(1));
        let fresh = !cache.started;
        cache.started = true;
        !(is_chain && fresh && parents.len() >= chunk_min_rows)
    }

    /// The in-projections as one product where the weights allow it ([`Linear::stack`]: plain
    /// weights on a GPU): an AR step's row then costs one GEMV (written as f32) instead of four
    /// GEMVs, four casts and the b | a concatenation. Example: Qwen3.6-27B's qkv, z, b and a (`[10240,
    /// 5120]`, `[6144, 5120]`, `[48, 5120]` twice) → `[16480, 5120]`.
    pub fn stack_in_projections(&mut self) -> Result<()> {
        let parts = [
            &self.in_proj_qkv,
            &self.in_proj_z,
            &self.in_proj_b,
            &self.in_proj_a,
        ];
        if let Some((stacked, parts)) = Linear::stack(&parts)? {
            let [qkv, z, b, a]: [Linear; 4] = parts
                .try_into()
                .map_err(|_| anyhow::anyhow!("stacking the in-projections gave another count"))?;
            self.in_proj_qkv = qkv;
            self.in_proj_z = z;
            self.in_proj_b = b;
            self.in_proj_a = a;
            self.in_proj = Some(stacked);
        }
        Ok(())
    }

    /// The in-projections of `x` (`rows` rows in all), f32 (the values rounded to x's dtype,
    /// as transformers' bf16 projections): `(mixed [rows, C], z [rows, Hv·dv], b | a [rows,
    /// 2·Hv])`, from the stacked product where there is one: then all three are column ranges
    /// of its rows, which the prep, the settle and the gated norm read where they are.
    fn in_projections(&self, x: &Tensor, rows: usize) -> Result<(Tensor, Tensor, Tensor)> {
        let proj = |l: &Linear| -> Result<Tensor> { Ok(l.forward_f32(x)?.reshape((rows, ()))?) };
        let Some(stacked) = &self.in_proj else {
            let ba = Tensor::cat(&[proj(&self.in_proj_b)?, proj(&self.in_proj_a)?], 1)?;
            return Ok((proj(&self.in_proj_qkv)?, proj(&self.in_proj_z)?, ba));
        };
        let (c, vd, hv) = (
            self.dims.conv_dim(),
            self.dims.hv * self.dims.dv,
            self.dims.hv,
        );
        let y = proj(stacked)?;
        Ok((
            y.narrow(1, 0, c)?,
            y.narrow(1, c, vd)?,
            y.narrow(1, c + vd, 2 * hv)?,
        ))
    }

    /// Bytes of the projections' weights a forward reads.
    pub fn weight_bytes_read(&self) -> usize {
        [
            &self.in_proj_qkv,
            &self.in_proj_z,
            &self.in_proj_b,
            &self.in_proj_a,
            &self.out_proj,
        ]
        .iter()
        .map(|l| l.weight_bytes_read())
        .sum()
    }
}
