//! The drafter's layers over the block stream: the context feature, then per layer the
//! attention over `[context | block]` (per-head norms, RoPE, the cache write), its residual and
//! norm, and the MLP; DFlash2's convs around both; a recorder keeps what the taped backward
//! reads.

use std::ops::Range;

use anyhow::{bail, Result};
use candle_core::{DType, Module, Tensor};
use dflash_core::visibility::DraftRule;

use super::{tape, DraftLayer, Drafter, KvWrite, LastRows, LayerMask};
use crate::cpu::row_attention::{self, attend_rows};
use crate::layers::attention::attend;
use crate::layers::dynamic_conv::Taps;
use crate::layers::rope::RopeTables;
use crate::ops::add_norm::add_rms_norm;
use crate::ops::block_attention::{attend_blocks, attend_blocks_saving};
use crate::ops::qkv_rope;
use crate::ops::train_attention;
use crate::ops::with_grad::Grad3;

/// Where one layer runs: its index, the `m` context rows before the block of `block` rows, the
/// rows its queries take (`trim`: the last layer on fewer rows, [`LastRows`]) and their RoPE
/// rows, every row's RoPE rows, and its mask.
struct LayerAt<'a> {
    i: usize,
    m: usize,
    block: usize,
    trim: bool,
    q_rows: Range<usize>,
    rope_q: &'a RopeTables,
    rope_kv: &'a RopeTables,
    mask: &'a LayerMask,
}

/// A layer's attention output, with what a taped backward reads of it.
struct Attention {
    /// the attention's input: `hn`, or (DFlash2) its pre-attention conv, and that conv's taps
    hn_in: Tensor,
    attn_post: Option<Taps>,
    /// `[context | block]`, the rows K and V are projected from
    kv_in: Tensor,
    /// taped: the q and k projections before their norms, and the attention's backward
    projections: Option<(Tensor, Tensor)>,
    attn_bwd: Option<Grad3>,
    /// the attention's output, `o_proj`'s, and after the post-attention conv
    o: Tensor,
    attn_raw: Tensor,
    attn_out: Tensor,
}

impl Drafter {
    /// The layers of the one drafter forward, after the host side ([`Self::forward`], or the
    /// fixed-shape inputs of [`crate::models::draft_inputs`]): `ctx_taps` `[1, m, L*h]`,
    /// `block_emb` `[1, nb, h]`, `rope_kv` the RoPE rows of the m context rows then the nb
    /// block rows, a mask per distinct layer rule, and where the new K/V go. Returns the normed
    /// block hidden states `[1, nb, h]`; a cache commits its m + nb new rows. With a recorder
    /// (a training layout on weights without a graph: [`Drafter::forward_taped`]) the
    /// activations the written backward reads are kept in it. With `last` (inference) the last
    /// layer runs its queries on those rows only and the result has only them.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layers_forward(
        &self,
        ctx_taps: &Tensor,
        block_emb: &Tensor,
        block: usize,
        rope_kv: &RopeTables,
        masks: &[(DraftRule, LayerMask)],
        mut write: KvWrite<'_>,
        mut rec: Option<&mut tape::Recorder>,
        last: Option<&LastRows>,
    ) -> Result<Tensor> {
        if last.is_some() && rec.is_some() {
            bail!("a taped forward returns every block row");
        }
        let m = ctx_taps.dim(1)?;
        let nb = block_emb.dim(1)?;
        let dtype = block_emb.dtype();
        let rope_q = rope_kv.narrow(m, nb)?;
        // 1. context feature (none at anchor 0 with an empty cache)
        let ctx = self.context_feature(ctx_taps, dtype, rec.as_deref_mut())?;
        // each residual add and the norm after it are one step (one kernel on a GPU without
        // gradients: `add_rms_norm`), the next layer's input norm (or the final norm) with this
        // layer's MLP residual
        let mut x = block_emb.clone();
        let mut hn = match self.layers.first() {
            Some(l) => l.input_layernorm.forward(&x)?,
            None => x.clone(),
        };
        let mut out = None;
        for (i, layer) in self.layers.iter().enumerate() {
            // the last layer on fewer rows: its queries, their RoPE rows and mask
            let trim = last.filter(|_| i + 1 == self.layers.len());
            let rope_last;
            let (q_rows, rope_q_layer) = match trim {
                Some(t) => {
                    rope_last = rope_kv.narrow(m + t.rows.start, t.rows.len())?;
                    (t.rows.clone(), &rope_last)
                }
                None => (0..nb, &rope_q),
            };
            let mask = match trim {
                Some(t) => &t.mask,
                None => &masks.iter().find(|(r, _)| *r == layer.rule).unwrap().1,
            };
            let at = LayerAt {
                i,
                m,
                block,
                trim: trim.is_some(),
                q_rows,
                rope_q: rope_q_layer,
                rope_kv,
                mask,
            };
            let (x1, mlp_out) =
                layer.forward(&at, &x, &hn, ctx.as_ref(), &mut write, rec.as_deref_mut())?;
            match self.layers.get(i + 1) {
                Some(next) => (x, hn) = add_rms_norm(&x1, &mlp_out, &next.input_layernorm)?,
                None => {
                    let (s, n) = add_rms_norm(&x1, &mlp_out, &self.norm)?;
                    (x, out) = (s, Some(n));
                }
            }
        }
        match write {
            KvWrite::Append(c) | KvWrite::Fixed { cache: c, .. } => c.commit(m + nb),
            KvWrite::None => {}
        }
        if let Some(r) = rec {
            r.x_last = Some(x.clone());
        }
        match out {
            Some(o) => Ok(o),
            None => Ok(self.norm.forward(&x)?),
        }
    }

    /// The context feature `hidden_norm(fc(taps))` of the context rows, `None` without any; a
    /// recorder keeps the taps (in `dtype`) and `fc`'s output.
    fn context_feature(
        &self,
        ctx_taps: &Tensor,
        dtype: DType,
        rec: Option<&mut tape::Recorder>,
    ) -> Result<Option<Tensor>> {
        let m = ctx_taps.dim(1)?;
        Ok(if m > 0 {
            let taps = ctx_taps.to_dtype(dtype)?;
            let fc_out = self.fc.forward(&taps)?;
            let c = self.hidden_norm.forward(&fc_out)?;
            if let Some(r) = rec {
                r.ctx = Some((taps, fc_out));
            }
            Some(c)
        } else {
            None
        })
    }
}

impl DraftLayer {
    /// One layer on the block stream `x` whose input norm is `hn`: the attention, its residual
    /// and norm, the MLP. Returns the residual after the attention and the MLP's output, which
    /// the caller adds and norms with the next layer's input norm; a recorder keeps the layer's
    /// tape.
    fn forward(
        &self,
        at: &LayerAt<'_>,
        x: &Tensor,
        hn: &Tensor,
        ctx: Option<&Tensor>,
        write: &mut KvWrite<'_>,
        rec: Option<&mut tape::Recorder>,
    ) -> Result<(Tensor, Tensor)> {
        let attn = self.attention(at, hn, ctx, write, rec.is_some())?;
        let x = if at.trim {
            x.narrow(1, at.q_rows.start, at.q_rows.len())?
        } else {
            x.clone()
        };
        let (x1, mn) = add_rms_norm(&x, &attn.attn_out, &self.post_attention_layernorm)?;
        let mlp_out = match rec {
            None => match &self.mlp_conv {
                Some(c) => {
                    let (y, taps) = c.prepare(&mn, at.block)?;
                    c.finish(&self.mlp.forward(&y)?, &taps)?
                }
                None => self.mlp.forward(&mn)?,
            },
            Some(r) => self.taped_mlp(at.block, &x, hn, attn, &x1, &mn, r)?,
        };
        Ok((x1, mlp_out))
    }

    /// The layer's attention (DFlash2's convs around it) on the rows `at` gives its queries:
    /// q from the block stream, K/V over `[context | block]`, per-head norms, RoPE and the cache
    /// write, then the attention under the layer's mask and `o_proj`; `taped` keeps what the
    /// written backward reads.
    fn attention(
        &self,
        at: &LayerAt<'_>,
        hn: &Tensor,
        ctx: Option<&Tensor>,
        write: &mut KvWrite<'_>,
        taped: bool,
    ) -> Result<Attention> {
        let a = &self.self_attn;
        let (hn_in, attn_post) = match &self.attention_conv {
            Some(c) => {
                let (y, post) = c.prepare(hn, at.block)?;
                (y, Some(post))
            }
            None => (hn.clone(), None),
        };
        // 2. q from the block stream only; 3. K/V over [context | block] (one product of
        // the rows stacked: proj([c; h]) = [proj(c); proj(h)])
        let kv_in = match ctx {
            Some(c) => Tensor::cat(&[c, &hn_in], 1)?,
            None => hn_in.clone(),
        };
        let q_in = if at.trim {
            hn_in.narrow(1, at.q_rows.start, at.q_rows.len())?
        } else {
            hn_in.clone()
        };
        let (q, k, v) = (
            a.q_proj.forward(&q_in)?,
            a.k_proj.forward(&kv_in)?,
            a.v_proj.forward(&kv_in)?,
        );
        let p = qkv_rope::Projections::plain(&q, &k, &v);
        let heads = qkv_rope::Heads {
            q: a.heads,
            kv: a.kv_heads,
            dim: a.head_dim,
        };
        let norms = (Some(&a.q_norm), Some(&a.k_norm));
        let tables = qkv_rope::Tables {
            q: at.rope_q,
            kv: at.rope_kv,
        };
        // the projections before their norms, for a taped backward
        let projections = taped.then(|| (q.clone(), k.clone()));
        // per-head norms, RoPE and the cache write (one kernel on a GPU)
        let (q, k, v) = match write {
            KvWrite::None => qkv_rope::heads_rotated(p, heads, norms, tables)?,
            KvWrite::Append(c) => {
                qkv_rope::apply(p, heads, norms, tables, qkv_rope::Rows::APPEND, c, at.i)?
            }
            KvWrite::Fixed { cache, index, cap } => {
                let rows = qkv_rope::Rows::fixed(index, *cap);
                qkv_rope::apply(p, heads, norms, tables, rows, cache, at.i)?
            }
        };
        let scale = 1.0 / (a.head_dim as f64).sqrt();
        let (o, attn_bwd) = attend_masked(at.mask, (&q, &k, &v), at.m, scale, taped)?;
        let attn_raw = a.o_proj.forward(&o)?;
        let attn_out = match (&self.attention_conv, &attn_post) {
            (Some(c), Some(taps)) => c.finish(&attn_raw, taps)?,
            _ => attn_raw.clone(),
        };
        Ok(Attention {
            hn_in,
            attn_post,
            kv_in,
            projections,
            attn_bwd,
            o,
            attn_raw,
            attn_out,
        })
    }

    /// Taped: the MLP's products, and each conv's input, taps and output kept, with the
    /// layer's other activations, in the recorder's tape of this layer; returns the MLP's
    /// output.
    #[allow(clippy::too_many_arguments)]
    fn taped_mlp(
        &self,
        block: usize,
        x: &Tensor,
        hn: &Tensor,
        attn: Attention,
        x1: &Tensor,
        mn: &Tensor,
        r: &mut tape::Recorder,
    ) -> Result<Tensor> {
        let (mlp_in, mlp_taps) = match &self.mlp_conv {
            Some(c) => {
                let (y, taps) = c.prepare(mn, block)?;
                (y, Some(taps))
            }
            None => (mn.clone(), None),
        };
        let p = self.mlp.forward_parts(&mlp_in)?;
        let out = match (&self.mlp_conv, &mlp_taps) {
            (Some(c), Some(taps)) => c.finish(&p.out, taps)?,
            _ => p.out.clone(),
        };
        let ((q, k), bwd) = match (attn.projections, attn.attn_bwd) {
            (Some(qk), Some(b)) => (qk, b),
            _ => bail!("a taped layer without its projections or attention backward"),
        };
        r.layers.push(tape::LayerTape {
            x: x.clone(),
            hn: hn.clone(),
            attn_in: attn.hn_in,
            attn_conv: attn.attn_post.map(|t| (t, attn.attn_raw)),
            kv_in: attn.kv_in,
            q,
            k,
            attn: bwd,
            o: attn.o,
            x1: x1.clone(),
            mn: mn.clone(),
            mlp_in,
            mlp_conv: mlp_taps.map(|t| (t, p.out.clone())),
            gate: p.gate,
            up: p.up,
            act: p.act,
        });
        Ok(out)
    }
}

/// The attention of `q` over `k` and `v` (`m` context rows first) under a layer's mask, and
/// (taped) its written backward: training's parts or fused intervals, inference's whole mask
/// (each row's key runs on the CPU where they apply).
fn attend_masked(
    mask: &LayerMask,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    m: usize,
    scale: f64,
    taped: bool,
) -> Result<(Tensor, Option<Grad3>)> {
    Ok(match (mask, taped) {
        // taped: the attention's value and its written backward, no graph
        (LayerMask::Parts { context, block }, true) => {
            let (o, b) = attend_blocks_saving(q, k, v, m, context, *block, scale)?;
            (o, Some(b))
        }
        (LayerMask::Fused(iv), true) => {
            let (o, b) = train_attention::attend_saving(q, k, v, iv, scale)?;
            (o, Some(b))
        }
        (LayerMask::Dense(..), true) => bail!("a taped forward takes a training layout"),
        (LayerMask::Dense(_, Some(runs)), false) if row_attention::applies(q) => {
            (attend_rows(q, k, v, runs, scale)?, None)
        }
        (LayerMask::Dense(mask, _), false) => (attend(q, k, v, mask, scale)?, None),
        (LayerMask::Parts { context, block }, false) => {
            (attend_blocks(q, k, v, m, context, *block, scale)?, None)
        }
        (LayerMask::Fused(iv), false) => (train_attention::attend(q, k, v, iv, scale)?, None),
    })
}
