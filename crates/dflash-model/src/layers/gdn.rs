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
//! `torch_chunk_gated_delta_rule` (chunk 64) and keeps only its final state.
//!
//! The recurrence runs on the host in f32 (one implementation for every device).

use crate::layers::linear::Linear;
use anyhow::{bail, Result};
use candle_core::Module;
use candle_core::{DType, Tensor};

use crate::io::weights::TensorStore;
use crate::layers::mlp::load_linear;

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
}

/// The committed state of one layer: conv inputs of the last K-1 rows (oldest first) and S.
#[derive(Debug, Clone)]
pub struct GdnState {
    pub conv: Vec<f32>,
    pub rec: Vec<f32>,
}

/// The last forward's rows, kept for rollback.
#[derive(Debug, Clone)]
pub struct GdnRows {
    pub inputs: Vec<f32>,
    pub parents: Vec<Option<usize>>,
    /// State after each row (recurrent path), or only after the last (chunked path).
    pub states: Vec<Vec<f32>>,
    pub per_row: bool,
}

#[derive(Debug, Clone)]
pub struct GdnCache {
    pub dims: GdnDims,
    pub committed: GdnState,
    pub last: Option<GdnRows>,
    /// False until the first forward (a prefill from the empty state).
    pub started: bool,
}

impl GdnCache {
    pub fn new(dims: GdnDims) -> Self {
        Self {
            dims,
            committed: GdnState {
                conv: vec![0.0; (dims.kernel - 1) * dims.conv_dim()],
                rec: vec![0.0; dims.state_len()],
            },
            last: None,
            started: false,
        }
    }

    /// Rows appended by the last forward that are not settled yet.
    pub fn pending(&self) -> usize {
        self.last.as_ref().map(|l| l.parents.len()).unwrap_or(0)
    }

    /// Keep the root-to-node path `path` (indices into the last forward's rows, each the
    /// child of the one before, the first a root) and drop the other rows.
    pub fn settle_path(&mut self, path: &[usize]) -> Result<()> {
        let Some(rows) = self.last.take() else {
            if path.is_empty() {
                return Ok(());
            }
            bail!("linear-attention state: no pending rows to keep");
        };
        if path.is_empty() {
            return Ok(());
        }
        for (j, &r) in path.iter().enumerate() {
            let want = if j == 0 { None } else { Some(path[j - 1]) };
            if r >= rows.parents.len() || rows.parents[r] != want {
                bail!("linear-attention state: kept rows {path:?} are not a root-to-node path of the last forward");
            }
        }
        let end = *path.last().unwrap();
        let rec = if rows.per_row {
            rows.states[end].clone()
        } else if end + 1 == rows.parents.len() {
            rows.states.last().unwrap().clone()
        } else {
            bail!("linear-attention state: cannot roll back into a chunked (prefill) forward");
        };
        let c = self.dims.conv_dim();
        let mut window: Vec<&[f32]> = self.committed.conv.chunks(c).collect();
        window.extend(path.iter().map(|&r| &rows.inputs[r * c..(r + 1) * c]));
        let k1 = self.dims.kernel - 1;
        let conv: Vec<f32> = window[window.len() - k1..].concat();
        self.committed = GdnState { conv, rec };
        Ok(())
    }

    /// Keep the first `keep` rows of the last forward (a chain prefix).
    pub fn settle_prefix(&mut self, keep: usize) -> Result<()> {
        let path: Vec<usize> = (0..keep).collect();
        self.settle_path(&path)
    }

    /// Before a new forward: all pending rows become committed (they must form a chain).
    fn settle_all(&mut self) -> Result<()> {
        let n = self.pending();
        if n > 0
            && !self
                .last
                .as_ref()
                .unwrap()
                .parents
                .iter()
                .enumerate()
                .all(|(i, p)| *p == i.checked_sub(1))
        {
            bail!("a tree verify must be compacted (keep_rows) before the next forward");
        }
        self.settle_prefix(n)
    }
}

#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    in_proj_qkv: Linear,
    in_proj_z: Linear,
    in_proj_b: Linear,
    in_proj_a: Linear,
    out_proj: Linear,
    conv: Vec<f32>, // [conv_dim, K]
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    norm: Vec<f32>,
    eps: f32,
    pub dims: GdnDims,
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
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
        Ok(Self {
            in_proj_qkv: load_linear(store, &format!("{p}.in_proj_qkv"), c, hidden, false)?,
            in_proj_z: load_linear(store, &format!("{p}.in_proj_z"), vd, hidden, false)?,
            in_proj_b: load_linear(store, &format!("{p}.in_proj_b"), dims.hv, hidden, false)?,
            in_proj_a: load_linear(store, &format!("{p}.in_proj_a"), dims.hv, hidden, false)?,
            out_proj: load_linear(store, &format!("{p}.out_proj"), hidden, vd, false)?,
            conv: host(&store.get(&format!("{p}.conv1d.weight"), &[c, 1, dims.kernel])?)?,
            a_log: host(&store.get(&format!("{p}.A_log"), &[dims.hv])?)?,
            dt_bias: host(&store.get(&format!("{p}.dt_bias"), &[dims.hv])?)?,
            norm: host(&store.get(&format!("{p}.norm.weight"), &[dims.dv])?)?,
            eps: eps as f32,
            dims,
        })
    }

    /// `x`: `[1, n, hidden]`; `parents[i]`: the parent row of new row i (see the module doc).
    pub fn forward(
        &self,
        x: &Tensor,
        parents: &[Option<usize>],
        cache: &mut GdnCache,
        chunk_min_rows: usize,
    ) -> Result<Tensor> {
        cache.settle_all()?;
        let d = self.dims;
        let (n, c, k1) = (parents.len(), d.conv_dim(), d.kernel - 1);
        let mixed = host(&self.in_proj_qkv.forward(x)?)?; // n × C
        let z = host(&self.in_proj_z.forward(x)?)?; // n × Hv·dv
        let b = host(&self.in_proj_b.forward(x)?)?; // n × Hv
        let a = host(&self.in_proj_a.forward(x)?)?;
        // 1. causal depthwise conv along each row's ancestor chain, SiLU
        let mut conv_out = vec![0f32; n * c];
        for i in 0..n {
            let mut chain = vec![i];
            while chain.len() < d.kernel {
                match parents[*chain.last().unwrap()] {
                    Some(p) => chain.push(p),
                    None => break,
                }
            }
            // window slot K-1 is the row itself, K-2 its parent, …; older slots from the committed conv
            for (back, slot) in (0..d.kernel).rev().enumerate() {
                let src: &[f32] = if back < chain.len() {
                    &mixed[chain[back] * c..(chain[back] + 1) * c]
                } else {
                    let old = back - chain.len(); // 0 = newest committed input
                    if old >= k1 {
                        continue;
                    }
                    let r = k1 - 1 - old;
                    &cache.committed.conv[r * c..(r + 1) * c]
                };
                for ch in 0..c {
                    conv_out[i * c + ch] += self.conv[ch * d.kernel + slot] * src[ch];
                }
            }
            for v in &mut conv_out[i * c..(i + 1) * c] {
                *v = silu(*v);
            }
        }
        // 2. q, k (L2-normalised, q scaled), v, β, g
        let (kd, vd) = (d.hk * d.dk, d.hv * d.dv);
        let mut q = vec![0f32; n * kd];
        let mut k = vec![0f32; n * kd];
        let mut v = vec![0f32; n * vd];
        for i in 0..n {
            let row = &conv_out[i * c..(i + 1) * c];
            for h in 0..d.hk {
                for (dst, off) in [(&mut q, 0usize), (&mut k, kd)] {
                    let src = &row[off + h * d.dk..off + (h + 1) * d.dk];
                    let inv = 1.0 / (src.iter().map(|x| x * x).sum::<f32>() + 1e-6).sqrt();
                    let scale = if off == 0 {
                        inv / (d.dk as f32).sqrt()
                    } else {
                        inv
                    };
                    for (j, x) in src.iter().enumerate() {
                        dst[i * kd + h * d.dk + j] = x * scale;
                    }
                }
            }
            v[i * vd..(i + 1) * vd].copy_from_slice(&row[2 * kd..]);
        }
        let beta: Vec<f32> = b.iter().map(|x| 1.0 / (1.0 + (-x).exp())).collect();
        let g: Vec<f32> = (0..n * d.hv)
            .map(|j| -self.a_log[j % d.hv].exp() * softplus(a[j] + self.dt_bias[j % d.hv]))
            .collect();
        // 3. the recurrence
        // the chunked algorithm keeps no per-row states: only for a prefill (a chain from the
        // empty state), which is never rolled back; verifies and trees run the recurrence
        let is_chain = parents
            .iter()
            .enumerate()
            .all(|(i, p)| *p == i.checked_sub(1));
        let fresh = !cache.started;
        cache.started = true;
        let (out, states, per_row) = if is_chain && fresh && n >= chunk_min_rows {
            let (o, s) = self.chunked(&q, &k, &v, &beta, &g, n, &cache.committed.rec);
            (o, vec![s], false)
        } else {
            let (o, s) = self.recurrent(&q, &k, &v, &beta, &g, parents, &cache.committed.rec);
            (o, s, true)
        };
        // 4. gated RMSNorm per (row, value head), then out_proj
        let mut normed = vec![0f32; n * vd];
        for i in 0..n {
            for h in 0..d.hv {
                let base = i * vd + h * d.dv;
                let o = &out[base..base + d.dv];
                let inv =
                    1.0 / (o.iter().map(|x| x * x).sum::<f32>() / d.dv as f32 + self.eps).sqrt();
                for j in 0..d.dv {
                    normed[base + j] = self.norm[j] * (o[j] * inv) * silu(z[base + j]);
                }
            }
        }
        cache.last = Some(GdnRows {
            inputs: mixed,
            parents: parents.to_vec(),
            states,
            per_row,
        });
        let t = Tensor::from_vec(normed, (1, n, vd), x.device())?.to_dtype(x.dtype())?;
        Ok(self.out_proj.forward(&t)?)
    }

    /// Key head of value head `h` (`repeat_interleave` grouping).
    fn kh(&self, h: usize) -> usize {
        h / (self.dims.hv / self.dims.hk)
    }

    #[allow(clippy::too_many_arguments)]
    fn recurrent(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        beta: &[f32],
        g: &[f32],
        parents: &[Option<usize>],
        init: &[f32],
    ) -> (Vec<f32>, Vec<Vec<f32>>) {
        let d = self.dims;
        let (n, kd, vd) = (parents.len(), d.hk * d.dk, d.hv * d.dv);
        let mut out = vec![0f32; n * vd];
        let mut states: Vec<Vec<f32>> = Vec::with_capacity(n);
        for i in 0..n {
            let mut s = match parents[i] {
                Some(p) => states[p].clone(),
                None => init.to_vec(),
            };
            for h in 0..d.hv {
                let kh = self.kh(h);
                let qt = &q[i * kd + kh * d.dk..i * kd + (kh + 1) * d.dk];
                let kt = &k[i * kd + kh * d.dk..i * kd + (kh + 1) * d.dk];
                let vt = &v[i * vd + h * d.dv..i * vd + (h + 1) * d.dv];
                let st = &mut s[h * d.dk * d.dv..(h + 1) * d.dk * d.dv];
                let decay = g[i * d.hv + h].exp();
                st.iter_mut().for_each(|x| *x *= decay);
                let b = beta[i * d.hv + h];
                let mut delta = vec![0f32; d.dv];
                for (j, dl) in delta.iter_mut().enumerate() {
                    let kv: f32 = (0..d.dk).map(|a| st[a * d.dv + j] * kt[a]).sum();
                    *dl = (vt[j] - kv) * b;
                }
                for a in 0..d.dk {
                    for j in 0..d.dv {
                        st[a * d.dv + j] += kt[a] * delta[j];
                    }
                }
                for j in 0..d.dv {
                    out[i * vd + h * d.dv + j] = (0..d.dk).map(|a| st[a * d.dv + j] * qt[a]).sum();
                }
            }
            states.push(s);
        }
        (out, states)
    }

    /// transformers' `torch_chunk_gated_delta_rule` (chunk 64), for a chain of rows.
    #[allow(clippy::too_many_arguments)]
    fn chunked(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        beta: &[f32],
        g: &[f32],
        n: usize,
        init: &[f32],
    ) -> (Vec<f32>, Vec<f32>) {
        const CHUNK: usize = 64;
        let d = self.dims;
        let (kd, vd, dk, dv) = (d.hk * d.dk, d.hv * d.dv, d.dk, d.dv);
        let mut out = vec![0f32; n * vd];
        let mut state = init.to_vec();
        for h in 0..d.hv {
            let kh = self.kh(h);
            let s = &mut state[h * dk * dv..(h + 1) * dk * dv];
            let qr = |t: usize| &q[t * kd + kh * dk..t * kd + (kh + 1) * dk];
            let kr = |t: usize| &k[t * kd + kh * dk..t * kd + (kh + 1) * dk];
            let vr = |t: usize| &v[t * vd + h * dv..t * vd + (h + 1) * dv];
            let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(a, b)| a * b).sum::<f32>();
            for c0 in (0..n).step_by(CHUNK) {
                let l = CHUNK.min(n - c0);
                let t = |i: usize| c0 + i;
                let mut cum = vec![0f32; l];
                let mut acc = 0f32;
                for (i, cm) in cum.iter_mut().enumerate() {
                    acc += g[t(i) * d.hv + h];
                    *cm = acc;
                }
                let bt = |i: usize| beta[t(i) * d.hv + h];
                // A[i][j] = β_i (k_i·k_j) e^{cum_i - cum_j}, j < i; solve (I + A) X = β v and
                // (I + A) Y = β k e^{cum} by forward substitution
                let mut x = vec![vec![0f32; dv]; l];
                let mut y = vec![vec![0f32; dk]; l];
                for i in 0..l {
                    let mut xi: Vec<f32> = vr(t(i)).iter().map(|a| a * bt(i)).collect();
                    let e = cum[i].exp();
                    let mut yi: Vec<f32> = kr(t(i)).iter().map(|a| a * bt(i) * e).collect();
                    for j in 0..i {
                        let aij = bt(i) * dot(kr(t(i)), kr(t(j))) * (cum[i] - cum[j]).exp();
                        for (u, w) in xi.iter_mut().zip(&x[j]) {
                            *u -= aij * w;
                        }
                        for (u, w) in yi.iter_mut().zip(&y[j]) {
                            *u -= aij * w;
                        }
                    }
                    x[i] = xi;
                    y[i] = yi;
                }
                // v_new = X - Y S
                let vnew: Vec<Vec<f32>> = (0..l)
                    .map(|i| {
                        (0..dv)
                            .map(|jv| {
                                x[i][jv] - (0..dk).map(|a| y[i][a] * s[a * dv + jv]).sum::<f32>()
                            })
                            .collect()
                    })
                    .collect();
                for i in 0..l {
                    let e = cum[i].exp();
                    for jv in 0..dv {
                        let inter: f32 = (0..dk).map(|a| qr(t(i))[a] * e * s[a * dv + jv]).sum();
                        let intra: f32 = (0..=i)
                            .map(|j| {
                                dot(qr(t(i)), kr(t(j))) * (cum[i] - cum[j]).exp() * vnew[j][jv]
                            })
                            .sum();
                        out[t(i) * vd + h * dv + jv] = inter + intra;
                    }
                }
                let last = cum[l - 1];
                let el = last.exp();
                s.iter_mut().for_each(|w| *w *= el);
                for j in 0..l {
                    let f = (last - cum[j]).exp();
                    for a in 0..dk {
                        let ka = kr(t(j))[a] * f;
                        for jv in 0..dv {
                            s[a * dv + jv] += ka * vnew[j][jv];
                        }
                    }
                }
            }
        }
        (out, state)
    }
}
