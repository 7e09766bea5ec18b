//! The drafter's training backward written out: one forward that keeps what its backward
//! reads (a tape), then the layers' gradients in reverse, without candle's autograd graph.
//!
//! Why: candle's backward gives every node of the graph a zero-filled gradient buffer and adds
//! each incoming gradient into it. A drafter layer traced op by op is about twenty nodes, so at
//! the Qwen3-8B shape (8,192 block rows) its activations' gradients are zero-filled and added
//! about 25 times the residual stream's size per layer (docs/BENCHMARKS.md, the kernel profile
//! of a training step). Here each gradient is produced once, by the product
//! or the fused kernel that computes it, and summed only where two paths meet (the residual
//! stream, K/V's context and block rows, gate and up).
//!
//! The forward is [`Drafter::layers_forward`] itself, run on a copy of the drafter whose
//! weights carry no graph ([`Drafter::forward_taped`]); the backward uses the same closed
//! forms as the ops' own backwards (RMSNorm, RoPE, SwiGLU, the training attention's kernels or
//! windows). Gradients come back keyed by the drafter's own weight tensors, so a trainer reads
//! them exactly as it reads candle's ([`Tape::backward`] fills a `GradStore`).
//!
//! DFlash2's dynamic convolutions have theirs written out too
//! ([`crate::layers::dynamic_conv::DynamicConv::convolve_grads`]); only zero-centred norms (no
//! drafter has them) would be refused ([`Drafter::tapes`]). Example: a 5-layer DFlash drafter,
//! 512 anchors of 16: the tape holds per layer the layer's input, its normed input, `[context |
//! block]` rows, the q/k projections, the attention's saved state and output, the
//! post-attention residual and norm, and gate, up and their product; the backward returns
//! 5 × 11 + 3 weight gradients (and a DFlash2 layer's 2 × 2 convs' more).

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};

use super::{DraftLayer, Drafter};
use crate::layers::dynamic_conv::{DynamicConv, Taps};
use crate::layers::linear::Linear;
use crate::layers::mlp::Mlp;
use crate::layers::norm::RmsNorm;
use crate::layers::rope::RopeTables;
use crate::ops::permute::swap_rows_heads;
use crate::ops::with_grad::Grad3;

/// What one layer's backward reads, kept by the forward.
pub(crate) struct LayerTape {
    /// the layer's input (the residual stream) and its input norm's output `[1, nb, h]`
    pub x: Tensor,
    pub hn: Tensor,
    /// the attention's input: `hn`, or (DFlash2) its pre-attention conv; then that conv's taps
    /// and `o_proj`'s output before the post-attention conv
    pub attn_in: Tensor,
    pub attn_conv: Option<(Taps, Tensor)>,
    /// the rows K and V are projected from: `[context | block]` `[1, m + nb, h]`
    pub kv_in: Tensor,
    /// the q and k projections before their per-head norms
    pub q: Tensor,
    pub k: Tensor,
    /// the attention's written backward and its output `[1, nb, hq·d]`
    pub attn: Grad3,
    pub o: Tensor,
    /// after the attention's residual, and its norm
    pub x1: Tensor,
    pub mn: Tensor,
    /// the MLP's input: `mn`, or (DFlash2) its pre-MLP conv; then that conv's taps and the
    /// MLP's output before the post-MLP conv
    pub mlp_in: Tensor,
    pub mlp_conv: Option<(Taps, Tensor)>,
    /// the MLP's gate and up products and `silu(gate) · up`
    pub gate: Tensor,
    pub up: Tensor,
    pub act: Tensor,
}

/// What the forward keeps: filled by [`Drafter::layers_forward`] when it is given one.
#[derive(Default)]
pub(crate) struct Recorder {
    pub layers: Vec<LayerTape>,
    /// the context taps (in the drafter's dtype) and `fc`'s output before `hidden_norm`
    pub ctx: Option<(Tensor, Tensor)>,
    /// the final norm's input
    pub x_last: Option<Tensor>,
}

/// A taped training forward's state: the weights (the drafter's own tensors, the keys of the
/// gradients), the saved activations, and the output variable whose gradient starts the
/// backward.
pub struct Tape {
    layers: Vec<DraftLayer>,
    fc: Linear,
    hidden_norm: RmsNorm,
    norm: RmsNorm,
    rec: Recorder,
    /// RoPE rotated back ([`RopeTables::inverse`]): the block rows' (queries) and the context
    /// and block rows' (keys)
    rope_q_inv: RopeTables,
    rope_kv_inv: RopeTables,
    /// context rows
    m: usize,
    /// the forward's output as a variable: the loss's backward ends here
    pub hidden: Tensor,
}

impl Drafter {
    /// Whether [`Drafter::forward_taped`] takes this drafter: plain RMSNorm weights (every
    /// DFlash and DFlash2 drafter; zero-centred norms have no written backward).
    pub fn tapes(&self) -> bool {
        self.layers.iter().all(|l| {
            ![&l.input_layernorm, &l.post_attention_layernorm]
                .iter()
                .chain([&&l.self_attn.q_norm, &&l.self_attn.k_norm])
                .any(|n| n.one_plus)
        }) && !self.norm.one_plus
            && !self.hidden_norm.one_plus
    }

    /// Whether training runs this drafter taped: it [`Drafter::tapes`], unless
    /// `DFLASH_DISABLED_KERNELS=train-tape` (candle's autograd over the traced forward: the A/B and the
    /// reference of the tests).
    pub fn trains_taped(&self) -> bool {
        self.tapes() && !dflash_core::runtime::off(dflash_core::runtime::Kernel::TrainTape)
    }

    /// [`Drafter::forward`] of a training layout on the drafter's weights without their graph,
    /// keeping what the backward reads. Returns the tape, whose `hidden` (`[1, nb, h]`, a
    /// variable) is the forward's output: build the loss on it, then [`Tape::backward`].
    pub fn forward_taped(
        &self,
        ctx_taps: &Tensor,
        block_emb: &Tensor,
        layout: super::DraftLayout<'_>,
    ) -> anyhow::Result<Tape> {
        if !self.tapes() {
            anyhow::bail!("this drafter has no written backward (zero-centred norms)");
        }
        if !matches!(layout, super::DraftLayout::Training { .. }) {
            anyhow::bail!("a taped forward takes a training layout");
        }
        let det = self.detached();
        let mut rec = Recorder::default();
        let (out, rope_kv) =
            det.forward_recorded(&ctx_taps.detach(), &block_emb.detach(), layout, &mut rec)?;
        let m = ctx_taps.dim(1)?;
        let nb = block_emb.dim(1)?;
        let rope_q_inv = rope_kv.narrow(m, nb)?.inverse()?;
        let rope_kv_inv = rope_kv.inverse()?;
        Ok(Tape {
            layers: self.layers.clone(),
            fc: self.fc.clone(),
            hidden_norm: self.hidden_norm.clone(),
            norm: self.norm.clone(),
            rec,
            rope_q_inv,
            rope_kv_inv,
            m,
            hidden: Var::from_tensor(&out)?.as_tensor().clone(),
        })
    }

    /// The drafter on the same weights without their graph ([`Linear::detached`]): only what
    /// the layers' forward reads.
    fn detached(&self) -> Drafter {
        Drafter {
            config: self.config.clone(),
            layers: self.layers.iter().map(detached_layer).collect(),
            norm: detached_norm(&self.norm),
            fc: self.fc.detached(),
            hidden_norm: detached_norm(&self.hidden_norm),
            rope: self.rope.clone(),
            target_layer_ids: self.target_layer_ids.clone(),
            mask_token_id: self.mask_token_id,
            block_size: self.block_size,
            notes: Vec::new(),
            draft_vocab: None,
            selector: None,
        }
    }
}

fn detached_norm(n: &RmsNorm) -> RmsNorm {
    RmsNorm {
        weight: n.weight.detach(),
        ..n.clone()
    }
}

fn detached_layer(l: &DraftLayer) -> DraftLayer {
    let a = &l.self_attn;
    let mut attn = a.clone();
    attn.q_proj = a.q_proj.detached();
    attn.k_proj = a.k_proj.detached();
    attn.v_proj = a.v_proj.detached();
    attn.o_proj = a.o_proj.detached();
    attn.q_norm = detached_norm(&a.q_norm);
    attn.k_norm = detached_norm(&a.k_norm);
    DraftLayer {
        input_layernorm: detached_norm(&l.input_layernorm),
        self_attn: attn,
        post_attention_layernorm: detached_norm(&l.post_attention_layernorm),
        mlp: Mlp {
            gate_proj: l.mlp.gate_proj.detached(),
            up_proj: l.mlp.up_proj.detached(),
            down_proj: l.mlp.down_proj.detached(),
            gate_up: None,
        },
        rule: l.rule,
        attention_conv: l.attention_conv.as_ref().map(DynamicConv::detached),
        mlp_conv: l.mlp_conv.as_ref().map(DynamicConv::detached),
    }
}

/// A layer's held weight `[out, in]` (a trained drafter's layers hold theirs).
fn weight_of(lin: &Linear) -> Result<&Tensor> {
    lin.held_weight()
        .ok_or_else(|| candle_core::Error::Msg("taped backward: a layer without its weight".into()))
}

/// Where the weights' gradients go: into `store`, keyed by the drafter's own tensors, added to
/// a gradient already there; weights that carry no graph (frozen) get none.
struct Sink<'a> {
    store: &'a mut GradStore,
}

impl Sink<'_> {
    fn put(&mut self, w: &Tensor, g: Tensor) -> Result<()> {
        if !w.track_op() {
            return Ok(());
        }
        let g = g.to_dtype(w.dtype())?;
        let sum = match self.store.get(w) {
            Some(old) => (old + g)?,
            None => g,
        };
        self.store.insert(w, sum);
        Ok(())
    }

    /// `y = x · Wᵀ (+ b)` for the upstream `g` (`[.., out]`): the weight's (and bias's)
    /// gradient into the store, and `dx` (`[.., in]`) returned.
    fn linear(&mut self, lin: &Linear, x: &Tensor, g: &Tensor) -> Result<Tensor> {
        self.linear_weights(lin, x, g)?;
        let w = weight_of(lin)?;
        let (out, inp) = w.dims2()?;
        let mut shape = g.dims().to_vec();
        *shape.last_mut().expect("rank ≥ 1") = inp;
        g.reshape((g.elem_count() / out.max(1), out))?
            .matmul(&w.detach())?
            .reshape(shape)
    }

    /// [`Sink::linear`] without `dx` (an input nothing trains: the target's taps).
    fn linear_weights(&mut self, lin: &Linear, x: &Tensor, g: &Tensor) -> Result<()> {
        let w = weight_of(lin)?;
        let (out, inp) = w.dims2()?;
        let rows = g.elem_count() / out.max(1);
        let g2 = g.reshape((rows, out))?;
        if w.track_op() {
            self.put(w, g2.t()?.matmul(&x.reshape((rows, inp))?)?)?;
        }
        if let Some(b) = lin.bias() {
            self.put(b, g2.sum(0)?)?;
        }
        Ok(())
    }

    /// A sublayer's post-conv backward (DFlash2; `None`: no conv, `g` passes): the gradient of
    /// the sublayer's raw output, and the post-conv's base-kernel gradient and taps' gradient
    /// for [`Sink::conv_pre`].
    fn conv_post(
        &mut self,
        conv: Option<&DynamicConv>,
        saved: &Option<(Taps, Tensor)>,
        g: &Tensor,
    ) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        match (conv, saved) {
            (Some(c), Some((taps, raw))) => {
                let (d_raw, d_base, d_post) = c.convolve_grads(raw, &taps.post, 1, g)?;
                Ok((d_raw, Some((d_base, d_post))))
            }
            (None, None) => Ok((g.clone(), None)),
            _ => Err(candle_core::Error::Msg(
                "taped backward: a conv without its saved taps".into(),
            )),
        }
    }

    /// A sublayer's pre-conv backward from its input `n` and the gradient `g` of the conv's
    /// output: the base kernel's and the taps' projection's gradients into the store (with
    /// the post-conv's, `post`), `dn` returned; without a conv `g` itself.
    fn conv_pre(
        &mut self,
        conv: Option<&DynamicConv>,
        saved: &Option<(Taps, Tensor)>,
        n: &Tensor,
        g: &Tensor,
        post: Option<(Tensor, Tensor)>,
    ) -> Result<Tensor> {
        let (c, taps, (d_base1, d_post)) = match (conv, saved, post) {
            (Some(c), Some((taps, _)), Some(p)) => (c, taps, p),
            (None, None, None) => return Ok(g.clone()),
            _ => {
                return Err(candle_core::Error::Msg(
                    "taped backward: a conv without its saved taps".into(),
                ))
            }
        };
        let (dn, d_base0, d_pre) = c.convolve_grads(n, &taps.pre, 0, g)?;
        let (base, proj) = c.weights();
        self.put(base, Tensor::stack(&[d_base0, d_base1], 0)?)?;
        // the taps were kernel_projection(n) viewed as [blocks, block, 2, K, G]
        let d_taps = Tensor::stack(&[d_pre, d_post], 2)?.reshape((1, n.dim(1)?, ()))?;
        dn + self.linear(proj, n, &d_taps)?
    }

    /// A norm's backward: the weight's gradient into the store, `dx` returned.
    fn norm(&mut self, n: &RmsNorm, x: &Tensor, g: &Tensor) -> Result<Tensor> {
        let (dx, dw) = n.grads(x, g)?;
        self.put(&n.weight, dw)?;
        Ok(dx)
    }
}

impl Tape {
    /// The backward from `d_hidden` (the loss's gradient at [`Tape::hidden`]): every trained
    /// weight's gradient into `store`, keyed by the drafter's own tensors (added to what is
    /// there).
    pub fn backward(&self, d_hidden: &Tensor, store: &mut GradStore) -> Result<()> {
        self.backward_each(d_hidden, store, &mut |_, _| Ok(()))
    }

    /// [`Tape::backward`], calling `done(i, store)` as soon as layer `i`'s weights hold their
    /// gradients, before the layers below it run: the last layer first. The final norm's
    /// gradient is in the store from the first call; `fc`'s and `hidden_norm`'s only once this
    /// returns. Example: 5 layers call `done` with 4, 3, 2, 1, 0 — a trainer starts summing
    /// layer 4's gradients over its ranks while layers 3..0 run their backward.
    pub fn backward_each(
        &self,
        d_hidden: &Tensor,
        store: &mut GradStore,
        done: &mut dyn FnMut(usize, &GradStore) -> Result<()>,
    ) -> Result<()> {
        let mut sink = Sink { store };
        let rec = &self.rec;
        let m = self.m;
        let x_last = rec
            .x_last
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("taped backward: no forward recorded".into()))?;
        let mut dx = sink.norm(&self.norm, x_last, &d_hidden.detach())?;
        let mut d_ctx: Option<Tensor> = None;
        for (i, (layer, t)) in self.layers.iter().zip(&rec.layers).enumerate().rev() {
            let a = &layer.self_attn;
            // MLP: x2 = x1 + post(down(silu(gate(y)) · up(y))), y = pre(mn) (DFlash2's convs;
            // else y = mn and no post)
            let (d_raw, post) = sink.conv_post(layer.mlp_conv.as_ref(), &t.mlp_conv, &dx)?;
            let d_act = sink.linear(&layer.mlp.down_proj, &t.act, &d_raw)?;
            let (d_gate, d_up) = crate::ops::silu_mul::grads(&t.gate, &t.up, &d_act)?;
            let d_y = (sink.linear(&layer.mlp.gate_proj, &t.mlp_in, &d_gate)?
                + sink.linear(&layer.mlp.up_proj, &t.mlp_in, &d_up)?)?;
            let d_mn = sink.conv_pre(layer.mlp_conv.as_ref(), &t.mlp_conv, &t.mn, &d_y, post)?;
            let d_x1 = (&dx + sink.norm(&layer.post_attention_layernorm, &t.x1, &d_mn)?)?;
            // attention: x1 = x + post(o_proj(attn(q, k, v))), q, k, v from pre(hn)
            let (d_raw, post) =
                sink.conv_post(layer.attention_conv.as_ref(), &t.attn_conv, &d_x1)?;
            let d_o = sink.linear(&a.o_proj, &t.o, &d_raw)?;
            let (d_qr, d_kr, d_vr) = (t.attn)(&d_o)?;
            let heads = |d: Tensor, inv: Option<&RopeTables>| -> Result<Tensor> {
                let d = match inv {
                    Some(r) => r.apply(&d)?,
                    None => d,
                };
                swap_rows_heads(&d)?.contiguous() // [1, rows, heads, dim]
            };
            let d_qh = heads(d_qr, Some(&self.rope_q_inv))?;
            let d_kh = heads(d_kr, Some(&self.rope_kv_inv))?;
            let d_vh = heads(d_vr, None)?;
            let (nb, nkv) = (t.q.dim(1)?, t.k.dim(1)?);
            let (hq, hkv, hd) = (a.heads, a.kv_heads, a.head_dim);
            let d_q = sink
                .norm(&a.q_norm, &t.q.reshape((1, nb, hq, hd))?, &d_qh)?
                .reshape((1, nb, hq * hd))?;
            let d_k = sink
                .norm(&a.k_norm, &t.k.reshape((1, nkv, hkv, hd))?, &d_kh)?
                .reshape((1, nkv, hkv * hd))?;
            let d_v = d_vh.reshape((1, nkv, hkv * hd))?;
            let d_kv = (sink.linear(&a.k_proj, &t.kv_in, &d_k)?
                + sink.linear(&a.v_proj, &t.kv_in, &d_v)?)?;
            let d_in = (sink.linear(&a.q_proj, &t.attn_in, &d_q)? + d_kv.narrow(1, m, nb)?)?;
            let d_hn = sink.conv_pre(
                layer.attention_conv.as_ref(),
                &t.attn_conv,
                &t.hn,
                &d_in,
                post,
            )?;
            if m > 0 {
                let c = d_kv.narrow(1, 0, m)?;
                d_ctx = Some(match d_ctx {
                    Some(s) => (s + c)?,
                    None => c.contiguous()?,
                });
            }
            dx = (d_x1 + sink.norm(&layer.input_layernorm, &t.x, &d_hn)?)?;
            done(i, sink.store)?;
        }
        // the block embedding is the target's (frozen): nothing further on the block stream
        if let (Some((taps, fc_out)), Some(d_ctx)) = (&rec.ctx, d_ctx) {
            let d_fc = sink.norm(&self.hidden_norm, fc_out, &d_ctx)?;
            sink.linear_weights(&self.fc, taps, &d_fc)?;
        }
        Ok(())
    }
}
