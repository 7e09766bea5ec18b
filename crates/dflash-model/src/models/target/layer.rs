//! The device side of a forward ([`Target::forward_prepared`]): the decoder layers (softmax
//! attention or Gated DeltaNet, then the MLP), the cache writes, the taps and the logits.

use anyhow::{bail, Context, Result};
use candle_core::{Module, Tensor};

use super::inputs::{AttnMask, CacheLayout, ForwardInputs, Keys};
use super::{Rows, Target, TargetOutput};
use crate::cache::kv_cache::KvCache;
use crate::cpu::row_attention::{self, attend_rows};
use crate::layers::attention::{attend, attend_intervals};
use crate::layers::gdn::GatedDeltaNet;
use crate::layers::linear::Linear;
use crate::layers::mlp::Mlp;
use crate::layers::norm::RmsNorm;
use crate::layers::rope::RopeTables;
use crate::ops::add_norm::add_rms_norm;
use crate::ops::interval_attention;
use crate::ops::qkv_rope;

#[derive(Debug, Clone)]
pub(super) struct Attention {
    pub(super) q_proj: Linear,
    pub(super) k_proj: Linear,
    pub(super) v_proj: Linear,
    pub(super) o_proj: Linear,
    /// q, k and v stacked into one product on a GPU ([`Attention::stack_projections`]).
    pub(super) qkv: Option<Linear>,
    pub(super) q_norm: Option<RmsNorm>,
    pub(super) k_norm: Option<RmsNorm>,
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
    pub(super) gated: bool,
}

impl Attention {
    /// On a GPU, q, k and v as one stacked product ([`Linear::stack`]; the three projections
    /// become views of it). Elsewhere nothing changes.
    pub(super) fn stack_projections(&mut self) -> Result<()> {
        if let Some((qkv, parts)) = Linear::stack(&[&self.q_proj, &self.k_proj, &self.v_proj])? {
            let [q, k, v]: [Linear; 3] = parts
                .try_into()
                .map_err(|_| anyhow::anyhow!("stacking q, k and v gave another count"))?;
            (self.q_proj, self.k_proj, self.v_proj, self.qkv) = (q, k, v, Some(qkv));
        }
        Ok(())
    }

    pub(super) fn forward(
        &self,
        x: &Tensor,
        rope: &RopeTables,
        keys: Keys,
        layout: &CacheLayout,
        cache: &mut KvCache,
        layer: usize,
    ) -> Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        let hd = self.heads * self.head_dim;
        // 1. projections [b, n, h · d]: one stacked product (GPU) or three
        let (qg, k, v) = match &self.qkv {
            Some(qkv) => {
                let y = qkv.forward(x)?;
                let (qw, kvw) = (
                    y.dim(2)? - 2 * self.kv_heads * self.head_dim,
                    self.kv_heads * self.head_dim,
                );
                (
                    y.narrow(2, 0, qw)?,
                    y.narrow(2, qw, kvw)?,
                    y.narrow(2, qw + kvw, kvw)?,
                )
            }
            None => (
                self.q_proj.forward(x)?,
                self.k_proj.forward(x)?,
                self.v_proj.forward(x)?,
            ),
        };
        // q_proj yields [query | gate] per head where gated: qkv_rope reads the queries
        let heads = qkv_rope::Heads {
            q: self.heads,
            kv: self.kv_heads,
            dim: self.head_dim,
        };
        let gate = match self.gated {
            true => Some(qkv_rope::gates(&qg, heads)?),
            false => None,
        };
        // 2. per-head norms (qwen3), RoPE at each row's own position, the cache write:
        // [cache rows | new rows] (fixed layout: all `cap` rows)
        let phase = tracing::info_span!(target: "phase", "rope + cache").entered();
        let rows = match layout {
            CacheLayout::Append => qkv_rope::Rows::APPEND,
            CacheLayout::Fixed { index, cap } => qkv_rope::Rows::fixed(index, *cap),
        };
        let (q, k, v) = qkv_rope::apply(
            qkv_rope::Projections {
                q: &qg,
                k: &k,
                v: &v,
                gated: self.gated,
            },
            heads,
            (self.q_norm.as_ref(), self.k_norm.as_ref()),
            qkv_rope::Tables { q: rope, kv: rope },
            rows,
            cache,
            layer,
        )?;
        drop(phase);
        // 3. masked attention, grouped K/V
        let phase = tracing::info_span!(target: "phase", "attention").entered();
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let o = match (keys.runs, keys.mask) {
            (Some(r), _) if row_attention::applies(&q) => attend_rows(&q, &k, &v, r, scale)?,
            (_, AttnMask::Intervals(iv)) => attend_intervals(&q, &k, &v, iv, scale)?,
            (_, AttnMask::Additive(m)) => attend(&q, &k, &v, m, scale)?,
            (_, AttnMask::Tree { additive, iv }) => {
                match interval_attention::tree_switched_on()
                    && interval_attention::serves_tree(&q, &k, &v)
                {
                    true => interval_attention::fused_tree(&q, &k, &v, iv, scale)?,
                    false => attend(&q, &k, &v, additive, scale)?,
                }
            }
        };
        let o = match gate {
            // the gate a strided view [b, n, heads, dim]: sigmoid reads it where it is
            Some(g) => (o.reshape((b, n, self.heads, self.head_dim))?
                * candle_nn::ops::sigmoid(&g)?)?
            .reshape((b, n, hd))?,
            None => o,
        };
        drop(phase);
        Ok(self.o_proj.forward(&o)?)
    }
}

/// The token mixer of a layer: softmax attention or Gated DeltaNet (hybrid targets).
#[derive(Debug, Clone)]
pub(super) enum Mixer {
    Attention(Attention),
    GatedDeltaNet(GatedDeltaNet),
}

#[derive(Debug, Clone)]
pub(super) struct DecoderLayer {
    pub(super) input_layernorm: RmsNorm,
    pub(super) mixer: Mixer,
    pub(super) post_attention_layernorm: RmsNorm,
    pub(super) mlp: Mlp,
}

impl Target {
    /// The device side of [`Target::forward_batch`]: the layers, the cache writes, the taps
    /// and the logits of `rows` from prepared inputs. Copies nothing from the host except
    /// the row index of [`Rows::These`].
    pub fn forward_prepared(
        &self,
        inputs: &ForwardInputs,
        cache: &mut KvCache,
        taps: &[usize],
        rows: &Rows,
    ) -> Result<TargetOutput> {
        let ForwardInputs {
            ids,
            rope,
            mask,
            runs,
            gdn,
            b,
            n,
            cache_len,
            layout,
        } = inputs;
        let (b, n) = (*b, *n);
        if cache.len() != *cache_len {
            bail!(
                "inputs prepared for a {cache_len}-row cache, the cache has {} rows",
                cache.len()
            );
        }
        if let Some(&bad) = taps.iter().find(|&&t| t >= self.layers.len()) {
            bail!(
                "tap {bad} is out of range: the target has {} layers",
                self.layers.len()
            );
        }
        let phase = tracing::info_span!(target: "phase", "embed").entered();
        let mut x = self
            .embed_tokens
            .lookup(ids)?
            .reshape((b, n, self.config.hidden_size))?;
        drop(phase);
        let mut tap_out = vec![None; taps.len()];
        // phases for DFLASH_PROFILE: the projections record theirs by weight format
        // (`Linear`), a Gated DeltaNet layer its own steps
        let norms = || tracing::info_span!(target: "phase", "norms + residuals");
        // each residual add and the norm after it are one step (one kernel on a GPU:
        // `add_rms_norm`), the next layer's input norm with this layer's MLP residual
        let mut hn = match self.layers.first() {
            Some(l) => norms().in_scope(|| l.input_layernorm.forward(&x))?,
            None => x.clone(),
        };
        for (i, layer) in self.layers.iter().enumerate() {
            let h = match &layer.mixer {
                Mixer::Attention(a) => a.forward(
                    &hn,
                    rope,
                    Keys {
                        mask,
                        runs: runs.as_ref(),
                    },
                    layout,
                    cache,
                    i,
                )?,
                Mixer::GatedDeltaNet(g) => {
                    let rows = gdn.as_ref().context("linear-attention rows not prepared")?;
                    match cache.gdn_slots_mut(i) {
                        Some(slots) => {
                            g.forward_slots(&hn, rows, slots, self.gdn_chunk_min_rows)?
                        }
                        None => g.forward(&hn, rows, cache.gdn_mut(i)?, self.gdn_chunk_min_rows)?,
                    }
                }
            };
            let (x1, xn) =
                norms().in_scope(|| add_rms_norm(&x, &h, &layer.post_attention_layernorm))?;
            let m = layer.mlp.forward(&xn)?;
            match self.layers.get(i + 1) {
                Some(next) => {
                    (x, hn) = norms().in_scope(|| add_rms_norm(&x1, &m, &next.input_layernorm))?;
                }
                None => x = norms().in_scope(|| x1 + m)?,
            }
            for (slot, _) in taps.iter().enumerate().filter(|(_, &t)| t == i) {
                tap_out[slot] = Some(x.clone());
            }
        }
        cache.commit(n);
        let logits = self.logits_of(&x, rows, n)?;
        Ok(TargetOutput {
            logits,
            taps: tap_out.into_iter().map(|t| t.unwrap()).collect(),
        })
    }

    /// The logits of `rows` of the last layer's output `x` (`[b, n, hidden]`): the final norm
    /// and the LM head on those rows only.
    fn logits_of(&self, x: &Tensor, rows: &Rows, n: usize) -> Result<Option<Tensor>> {
        let sel = match rows {
            Rows::None => return Ok(None),
            Rows::All => x.clone(),
            Rows::Last => x.narrow(1, n - 1, 1)?,
            Rows::These(r) => {
                if let Some(&bad) = r.iter().find(|&&i| i >= n) {
                    bail!("logit row {bad} is out of range for {n} rows");
                }
                let idx = Tensor::from_vec(
                    r.iter().map(|&i| i as u32).collect::<Vec<_>>(),
                    r.len(),
                    &self.device,
                )?;
                x.index_select(&idx, 1)?
            }
        };
        let normed = tracing::info_span!(target: "phase", "norms + residuals")
            .in_scope(|| self.norm.forward(&sel))?;
        Ok(Some(self.lm_head(&normed)?))
    }
}
