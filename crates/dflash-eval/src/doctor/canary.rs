//! The canary dump: everything a foreign DFlash harness must reproduce for fixed prompts,
//! written by `dflash-rs doctor --canary OUT` and read back by `doctor --against DIR`.
//!
//! Layout (format `dflash-canary/1`), a directory of two files:
//! - `canary.json`: `{format, producer, block_size, taps, mask_token_id, prompts}`; `taps` are
//!   layer outputs (tap i = output of layer i = transformers' `hidden_states[i+1]`); each prompt
//!   is `{text, ids, rounds}` and each round one draft block at an anchor:
//!   `{anchor, anchor_token, context_rows, block_positions, visibility, drafts}` where
//!   `context_rows` counts the context feature rows the drafter was given (positions
//!   `0 .. context_rows`), `block_positions` are the position ids of the block's rows,
//!   `visibility[layer][row]` lists the key intervals `[lo, hi)` (absolute positions) that the
//!   block's row sees in that drafter layer, and `drafts` the greedy tokens after the anchor.
//! - `canary.safetensors` (f32): `p{i}.tap{L}` `[n, hidden]` the target's output of layer L on
//!   prompt i; `p{i}.r{j}.context` `[context_rows, taps · hidden]` the drafter's context input of
//!   round j (the taps concatenated in `taps` order, before `fc`); `p{i}.r{j}.logits`
//!   `[block − 1, vocab]` the block's logits for the positions after the anchor.
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
}

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
        .map(|i| DraftRule::for_layer(d.config.layer_window(i)))
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
            .forward_causal(ids, &mut cache, &d.target_layer_ids, &Rows::None)?;
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
            rounds.push(CanaryRound {
                anchor: a,
                anchor_token: ids[a],
                context_rows: a,
                block_positions: (a..a + b).collect(),
                visibility: rules.iter().map(|r| block_visibility(*r, a, b)).collect(),
                drafts,
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
        },
        tensors,
    })
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
            }
        }
        Ok(c)
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
