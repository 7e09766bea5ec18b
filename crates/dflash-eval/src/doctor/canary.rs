//! The canary dump: everything a foreign DFlash harness must reproduce for fixed prompts,
//! written by `dflash-rs doctor --canary OUT` and read back by `doctor --against DIR`.
//!
//! Layout (format `dflash-canary/1`), a directory of two files:
//! - `canary.json`: `{format, producer, block_size, taps, mask_token_id, prompts, kernels}`;
//!   `kernels` (optional) names what computed the taps (`dflash_train::fingerprint::KernelFamily`:
//!   `{linear_attention, numerics, precision}`, e.g. fla's chunked kernels in bf16); `taps` are
//!   layer outputs (tap i = output of layer i = transformers' `hidden_states[i+1]`); each prompt
//!   is `{text, ids, rounds}` and each round one draft block at an anchor:
//!   `{anchor, anchor_token, context_rows, block_positions, visibility, drafts}` where
//!   `context_rows` counts the context feature rows the drafter was given (positions
//!   `0 .. context_rows`), `block_positions` are the position ids of the block's rows,
//!   `visibility[layer][row]` lists the key intervals `[lo, hi)` (absolute positions) that the
//!   block's row sees in that drafter layer, and `drafts` the greedy tokens after the anchor.
//!   A round may also carry `train`: what a trainer did with the same block,
//!   `{context_rows, labels, weights, loss}` (the context rows its drafter was given, the label
//!   and loss weight of each position after the anchor, the loss it computed for the block).
//! - `canary.safetensors` (f32): `p{i}.tap{L}` `[n, hidden]` the target's output of layer L on
//!   prompt i; `p{i}.r{j}.context` `[context_rows, taps · hidden]` the drafter's context input of
//!   round j (the taps concatenated in `taps` order, before `fc`); `p{i}.r{j}.logits`
//!   `[block − 1, vocab]` the block's logits for the positions after the anchor; with `train`,
//!   `p{i}.r{j}.train_context` `[train.context_rows, taps · hidden]` and
//!   `p{i}.r{j}.target_logits` `[block − 1, vocab]`, the target logits the trainer's loss
//!   targets came from (row k − 1 predicts position anchor + k: the target's logits at
//!   position anchor + k − 1).
//!
//! Example: prompt of 10 tokens, B = 8 → rounds at anchors 0, 5 and 9; the round at 5 gives the
//! drafter 5 context rows (positions 0..=4, not 5: the anchor's own feature is not context),
//! block positions 5..=12, and every block row of a full-attention layer sees `[[0, 13]]`.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use dflash_core::visibility::{draft_inference, DraftRule};
use dflash_model::io::atomic::replace_dir;
use dflash_model::io::loader::LoadedTarget;
use dflash_model::models::drafter::{BlockAt, Drafter};
use dflash_model::models::target::Rows;
use dflash_model::Target;
use dflash_train::fingerprint::{kernel_family, KernelFamily};
use serde::{Deserialize, Serialize};

pub const FORMAT: &str = "dflash-canary/1";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CanaryRound {
    pub anchor: usize,
    pub anchor_token: u32,
    pub context_rows: usize,
    pub block_positions: Vec<usize>,
    /// `[layer][row]` → key intervals `[lo, hi)` in absolute positions.
    pub visibility: Vec<Vec<Vec<[usize; 2]>>>,
    pub drafts: Vec<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train: Option<TrainRound>,
}

/// What a trainer did with a round's block (dflash-rs: `dflash_train::loss::block_loss` on the
/// prompt as one fully supervised sequence, hard CE, γ = [`GAMMA`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainRound {
    pub context_rows: usize,
    pub labels: Vec<u32>,
    pub weights: Vec<f32>,
    pub loss: f64,
}

/// The position decay of the canary's training rounds (the paper's and the default config's).
pub const GAMMA: f64 = 7.0;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CanaryPrompt {
    pub text: String,
    pub ids: Vec<u32>,
    pub rounds: Vec<CanaryRound>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CanaryMeta {
    pub format: String,
    pub producer: String,
    pub block_size: usize,
    pub taps: Vec<usize>,
    pub mask_token_id: u32,
    pub prompts: Vec<CanaryPrompt>,
    /// The kernel family that computed the taps (absent in dumps from before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernels: Option<KernelFamily>,
}

/// A canary dump in memory: the JSON part and the tensors (f32, on the CPU).
#[derive(Debug, Clone)]
pub struct Canary {
    pub meta: CanaryMeta,
    pub tensors: HashMap<String, Tensor>,
}

/// Tensor names of the layout.
pub fn tap_key(prompt: usize, layer: usize) -> String {
    format!("p{prompt}.tap{layer}")
}
pub fn context_key(prompt: usize, round: usize) -> String {
    format!("p{prompt}.r{round}.context")
}
pub fn logits_key(prompt: usize, round: usize) -> String {
    format!("p{prompt}.r{round}.logits")
}
pub fn train_context_key(prompt: usize, round: usize) -> String {
    format!("p{prompt}.r{round}.train_context")
}
pub fn target_logits_key(prompt: usize, round: usize) -> String {
    format!("p{prompt}.r{round}.target_logits")
}

/// The anchors of a prompt of `n` tokens: 0 (an empty context), the middle, the last token.
pub fn default_anchors(n: usize) -> Vec<usize> {
    let mut a = vec![0, n / 2, n.saturating_sub(1)];
    a.dedup();
    a
}

/// The intervals one block row sees in one layer, from the one draft rule
/// ([`dflash_core::visibility::draft_inference`]): columns `0 .. anchor` are context positions,
/// columns `anchor ..` the block's positions, so a column is its position.
pub fn block_visibility(rule: DraftRule, anchor: usize, block: usize) -> Vec<Vec<[usize; 2]>> {
    let v = draft_inference(rule, anchor, block);
    (0..block)
        .map(|r| {
            v.row_runs(r)
                .into_iter()
                .map(|run| [run.start, run.end])
                .collect()
        })
        .collect()
}

fn host_f32(t: &Tensor) -> Result<Tensor> {
    Ok(t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?)
}

/// The target's outputs of `layers` on `ids` (one causal forward), `[n, hidden]` each.
pub fn layer_outputs(target: &Target, ids: &[u32], layers: &[usize]) -> Result<Vec<Tensor>> {
    let mut cache = target.new_cache();
    let out = target.forward_causal(ids, &mut cache, layers, &Rows::None)?;
    out.taps.iter().map(host_f32).collect()
}

/// A prompt to capture: its text, its token ids and the anchors of its rounds.
#[derive(Debug, Clone)]
pub struct PromptAt {
    pub text: String,
    pub ids: Vec<u32>,
    pub anchors: Vec<usize>,
}

impl PromptAt {
    /// The prompts and anchors of an existing dump (what `--against` recomputes).
    pub fn of(c: &Canary) -> Vec<PromptAt> {
        c.meta
            .prompts
            .iter()
            .map(|p| PromptAt {
                text: p.text.clone(),
                ids: p.ids.clone(),
                anchors: p.rounds.iter().map(|r| r.anchor).collect(),
            })
            .collect()
    }
}

/// dflash-rs's canary for `prompts`: the taps, and per anchor the round the drafter runs in
/// decoding (`Drafter::draft` on a fresh draft cache).
pub fn capture(lt: &LoadedTarget, d: &Drafter, prompts: &[PromptAt]) -> Result<Canary> {
    let b = d.block_size;
    let rules: Vec<DraftRule> = (0..d.config.num_hidden_layers)
        .map(|i| d.config.layer_rule(i))
        .collect();
    let mut tensors = HashMap::new();
    let mut metas = Vec::new();
    for (pi, PromptAt { text, ids, anchors }) in prompts.iter().enumerate() {
        if ids.is_empty() {
            bail!("canary prompt {pi} ('{text}') has no tokens");
        }
        let mut cache = lt.target.new_cache();
        let out = lt
            .target
            .forward_causal(ids, &mut cache, &d.target_layer_ids, &Rows::All)?;
        let target_logits = out.logits.clone().context("the target gave no logits")?;
        for (t, l) in out.taps.iter().zip(&d.target_layer_ids) {
            tensors.insert(tap_key(pi, *l), host_f32(t)?);
        }
        let feats = Target::concat_taps(&out.taps)?;
        let mut rounds = Vec::new();
        for (ri, &a) in anchors.iter().enumerate() {
            if a >= ids.len() {
                bail!(
                    "canary prompt {pi}: anchor {a} is past its {} tokens",
                    ids.len()
                );
            }
            let ctx = feats.narrow(0, 0, a)?.unsqueeze(0)?;
            let logits = d.draft(
                &lt.target,
                None,
                &mut d.new_cache(),
                &ctx,
                BlockAt {
                    token: ids[a],
                    anchor: a,
                    block: b,
                    positions: b - 1,
                },
            )?;
            let logits = host_f32(&logits)?;
            let drafts = logits.argmax(1)?.to_vec1::<u32>()?;
            tensors.insert(context_key(pi, ri), host_f32(&ctx.squeeze(0)?)?);
            tensors.insert(logits_key(pi, ri), logits);
            let train = if a + 1 < ids.len() {
                let (round, tl) = train_round(lt, d, ids, &feats, &target_logits, a)?;
                tensors.insert(train_context_key(pi, ri), host_f32(&ctx.squeeze(0)?)?);
                tensors.insert(target_logits_key(pi, ri), tl);
                Some(round)
            } else {
                None
            };
            rounds.push(CanaryRound {
                anchor: a,
                anchor_token: ids[a],
                context_rows: a,
                block_positions: (a..a + b).collect(),
                visibility: rules.iter().map(|r| block_visibility(*r, a, b)).collect(),
                drafts,
                train,
            });
        }
        metas.push(CanaryPrompt {
            text: text.clone(),
            ids: ids.clone(),
            rounds,
        });
    }
    Ok(Canary {
        meta: CanaryMeta {
            format: FORMAT.into(),
            producer: format!("dflash-rs {}", env!("CARGO_PKG_VERSION")),
            block_size: b,
            taps: d.target_layer_ids.clone(),
            mask_token_id: d.mask_token_id,
            prompts: metas,
            kernels: Some(kernel_family(&lt.target)),
        },
        tensors,
    })
}

/// dflash-rs's trainer on the block at `a`: the prompt as one fully supervised sequence, its
/// labels and weights (`labels_and_weights`) and hard-CE loss (`block_loss`, the trainer's own
/// objective), and the target logits the labels are the sequence's tokens of (rows at
/// positions `a .. a + B − 1`, the last row repeated past the end).
fn train_round(
    lt: &LoadedTarget,
    d: &Drafter,
    ids: &[u32],
    feats: &Tensor,
    target_logits: &Tensor,
    a: usize,
) -> Result<(TrainRound, Tensor)> {
    use dflash_train::loss::{block_loss, labels_and_weights, Features, Objective};
    let b = d.block_size;
    let row = dflash_train::pack::TrainingRow::fully_supervised(ids);
    let (labels, weights) = labels_and_weights(&row, &[a], b, GAMMA);
    let f = Features {
        taps: feats.unsqueeze(0)?,
        target_logits: None,
    };
    let obj = Objective {
        block: b,
        gamma: GAMMA,
        kind: dflash_train::config::LossKind::Ce,
        selector_weight: 1.0,
    };
    let out = block_loss(d, &lt.target, &row, &f, &[a], obj)?;
    let rows: Vec<u32> = (1..b)
        .map(|k| (a + k - 1).min(ids.len() - 1) as u32)
        .collect();
    let idx = Tensor::new(rows.as_slice(), target_logits.device())?;
    let tl = host_f32(&target_logits.index_select(&idx, 0)?)?;
    Ok((
        TrainRound {
            context_rows: a,
            labels,
            weights,
            loss: out.loss.to_dtype(DType::F64)?.to_scalar::<f64>()?,
        },
        tl,
    ))
}

/// Hard CE and KL(target ‖ drafter) of one training round, each the weighted mean over its
/// positions (`Σ w·x / Σ w`, as `block_loss`), from the drafter's block logits `q` and the
/// target logits `p`, in f64; `None` when no position has weight.
pub fn ce_and_kl(q: &Tensor, p: &Tensor, t: &TrainRound) -> Result<Option<(f64, f64)>> {
    let q = q.to_vec2::<f32>()?;
    let p = p.to_vec2::<f32>()?;
    let logsm = |row: &[f32]| -> Vec<f64> {
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
        row.iter().map(|&x| x as f64 - lse).collect()
    };
    let (mut ce, mut kl, mut wsum) = (0.0, 0.0, 0.0);
    for (k, &w) in t.weights.iter().enumerate() {
        if w == 0.0 {
            continue;
        }
        let (lq, lp) = (logsm(&q[k]), logsm(&p[k]));
        ce += w as f64 * -lq[t.labels[k] as usize];
        kl += w as f64
            * lp.iter()
                .zip(&lq)
                .map(|(a, b)| a.exp() * (a - b))
                .sum::<f64>();
        wsum += w as f64;
    }
    Ok((wsum > 0.0).then(|| (ce / wsum, kl / wsum)))
}

/// The canary prompts of the doctor's fingerprint, tokenized by the target, at their default
/// anchors.
pub fn canary_prompts(lt: &LoadedTarget) -> Result<Vec<PromptAt>> {
    dflash_train::fingerprint::CANARY_PROMPTS
        .iter()
        .map(|p| {
            let ids = lt.tokenizer.encode(p, false)?;
            Ok(PromptAt {
                text: p.to_string(),
                anchors: default_anchors(ids.len()),
                ids,
            })
        })
        .collect()
}

impl Canary {
    /// Write `canary.json` and `canary.safetensors` into `dir` (replaced as a whole).
    pub fn write(&self, dir: &Path) -> Result<()> {
        replace_dir(dir, |tmp| {
            std::fs::write(
                tmp.join("canary.json"),
                serde_json::to_string_pretty(&self.meta)? + "\n",
            )?;
            candle_core::safetensors::save(&self.tensors, tmp.join("canary.safetensors"))?;
            Ok(())
        })
    }

    /// Read a dump, checking its format and that every tensor the JSON implies is there with
    /// the right number of rows.
    pub fn read(dir: &Path) -> Result<Self> {
        let jp = dir.join("canary.json");
        let text =
            std::fs::read_to_string(&jp).with_context(|| format!("reading {}", jp.display()))?;
        let meta: CanaryMeta = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a canary dump ({FORMAT})", jp.display()))?;
        if meta.format != FORMAT {
            bail!(
                "{}: format '{}', expected '{FORMAT}'",
                jp.display(),
                meta.format
            );
        }
        let sp = dir.join("canary.safetensors");
        let tensors = candle_core::safetensors::load(&sp, &Device::Cpu)
            .with_context(|| format!("reading {}", sp.display()))?
            .into_iter()
            .map(|(k, t)| Ok((k, t.to_dtype(DType::F32)?)))
            .collect::<Result<HashMap<_, _>>>()?;
        let c = Canary { meta, tensors };
        for (pi, p) in c.meta.prompts.iter().enumerate() {
            for l in &c.meta.taps {
                c.rows(&tap_key(pi, *l), p.ids.len())?;
            }
            for (ri, r) in p.rounds.iter().enumerate() {
                c.rows(&context_key(pi, ri), r.context_rows)?;
                c.rows(&logits_key(pi, ri), c.meta.block_size - 1)?;
                if let Some(t) = &r.train {
                    c.rows(&train_context_key(pi, ri), t.context_rows)?;
                    c.rows(&target_logits_key(pi, ri), c.meta.block_size - 1)?;
                    if t.labels.len() != c.meta.block_size - 1
                        || t.weights.len() != c.meta.block_size - 1
                    {
                        bail!("canary dump: prompt {pi}, round {ri}: train.labels and train.weights need {} entries", c.meta.block_size - 1);
                    }
                }
            }
        }
        Ok(c)
    }

    /// Prompt `pi`'s taps concatenated in `taps` order `[n, taps · hidden]`: the context
    /// features a faithful stack gives its drafter (row p is position p's).
    pub fn features(&self, pi: usize) -> Result<Tensor> {
        let n = self
            .meta
            .prompts
            .get(pi)
            .with_context(|| format!("canary dump: no prompt {pi}"))?
            .ids
            .len();
        let taps = self
            .meta
            .taps
            .iter()
            .map(|l| self.rows(&tap_key(pi, *l), n).cloned())
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&taps, 1)?)
    }

    /// Tensor `key`, which must have `rows` rows.
    pub fn rows(&self, key: &str, rows: usize) -> Result<&Tensor> {
        let t = self
            .tensors
            .get(key)
            .with_context(|| format!("canary dump: tensor '{key}' missing"))?;
        if t.dims().first() != Some(&rows) {
            bail!(
                "canary dump: '{key}' has shape {:?}, expected {rows} rows",
                t.dims()
            );
        }
        Ok(t)
    }
}
