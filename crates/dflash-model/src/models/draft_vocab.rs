//! A drafter's vocabulary subset: the tokens its proposals come from.
//!
//! Drafting reads the target's whole LM head for every drafted row (SmolLM2: 49,152 × 576
//! f32, 113 MB: on a CPU as long to read as the drafter's five layers),
//! though the target writes few of those tokens: 8,192 of them cover 99.6 % of SmolLM2's
//! regenerated responses (the bundled drafter's data). With `draft_vocab.json` beside its weights, a
//! drafter's proposals come from those tokens only (FR-Spec's frequency-ranked drafting):
//! the LM head's rows of the subset, whose logits are bit-identical to the full head's for
//! those tokens, and log-probabilities normalised over the subset. Verification is unchanged,
//! so the output is too; a token outside the subset is simply never proposed.
//!
//! Example: `{"token_ids": [2, 13, 28, 30, …]}` (ascending) → draft logits `[rows, 8192]`,
//! column 2 being token 28.
//!
//! A response repeats its prompt's words (names, numbers, a problem's nouns: "muffins" in a
//! word problem about muffins), which a subset chosen from other text may lack, so a decode
//! drafts from the subset and its prompt's tokens ([`DraftVocab::with_tokens`]): SmolLM2's
//! muffin question drafts "muffins" (token 35114, outside the bundled 8,192) seven times in
//! 128 tokens. `DFLASH_DISABLED_KERNELS=prompt-vocab` drafts from the subset alone.

use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use crate::layers::linear::Linear;
use crate::models::target::Target;

/// The file beside a drafter's `model.safetensors`.
pub const FILE: &str = "draft_vocab.json";

/// `draft_vocab.json`: the subset's token ids (ascending, unique) and how it was chosen.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DraftVocab {
    pub token_ids: Vec<u32>,
    /// How the subset was chosen, e.g. "the 8192 most frequent supervised tokens of DIR".
    #[serde(default)]
    pub source: String,
    /// The share of the source's supervised tokens that the subset holds.
    #[serde(default)]
    pub coverage: Option<f64>,
}

impl DraftVocab {
    /// `dir/draft_vocab.json` when there is one.
    pub fn read_dir(dir: &Path) -> Result<Option<Self>> {
        let p = dir.join(FILE);
        if !p.is_file() {
            return Ok(None);
        }
        let text =
            std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        let v: Self = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a draft vocabulary", p.display()))?;
        Ok(Some(v))
    }

    /// The subset with `tokens` added, ascending and unique (a request's prompt, whose words
    /// its response repeats). Example: [2, 13, 28] with [28, 5, 5] → [2, 5, 13, 28].
    pub fn with_tokens(&self, tokens: &[u32]) -> Self {
        let mut ids: Vec<u32> = self.token_ids.iter().chain(tokens).copied().collect();
        ids.sort_unstable();
        ids.dedup();
        Self {
            token_ids: ids,
            source: format!("{} and a prompt's tokens", self.source),
            coverage: None,
        }
    }

    /// Non-empty, ascending, unique, inside the target's vocabulary.
    pub fn validate(&self, vocab_size: usize) -> Result<()> {
        if self.token_ids.is_empty() {
            bail!("the draft vocabulary is empty");
        }
        if let Some(w) = self.token_ids.windows(2).find(|w| w[0] >= w[1]) {
            bail!(
                "the draft vocabulary's token ids must be ascending and unique ({} then {})",
                w[0],
                w[1]
            );
        }
        let last = *self.token_ids.last().unwrap() as usize;
        if last >= vocab_size {
            bail!("draft vocabulary token {last} is outside the target's {vocab_size} tokens");
        }
        Ok(())
    }
}

/// The LM head over a [`DraftVocab`]'s rows, built for one target (explicit state: a decode
/// builds it once and passes it to every draft).
#[derive(Debug, Clone)]
pub struct DraftHead {
    ids: Vec<u32>,
    /// `ids` on the target's device.
    ids_on_device: Tensor,
    /// Each target token's column (`ids.len()` for a token outside the subset), on the device.
    col_of_token: Tensor,
    head: Linear,
}

impl DraftHead {
    pub fn new(target: &Target, vocab: &DraftVocab) -> Result<Self> {
        vocab.validate(target.config.vocab_size)?;
        let n = vocab.token_ids.len() as u32;
        let mut col = vec![n; target.config.vocab_size];
        for (j, &t) in vocab.token_ids.iter().enumerate() {
            col[t as usize] = j as u32;
        }
        Ok(Self {
            ids: vocab.token_ids.clone(),
            ids_on_device: Tensor::new(vocab.token_ids.as_slice(), &target.device)?,
            col_of_token: Tensor::new(col.as_slice(), &target.device)?,
            head: target.lm_head_rows(&vocab.token_ids)?,
        })
    }

    /// The token of logit column `j`.
    pub fn token(&self, j: u32) -> u32 {
        self.ids[j as usize]
    }

    /// [`DraftHead::token`] of each column in `cols` (`[n]` u32), where they are: a round's
    /// drafts picked on the device. Example: ids [7, 42, 99], cols [2, 0] → [99, 7].
    pub fn tokens_of(&self, cols: &Tensor) -> Result<Tensor> {
        Ok(self.ids_on_device.index_select(cols, 0)?)
    }

    /// Rows over the subset's columns (`[n, subset]`, a draft distribution) spread over the
    /// target's vocabulary (0 elsewhere), where they are: a gather of each token's column
    /// from the rows with a zero column appended (one output value per thread on a GPU).
    /// Example: ids [1, 3], row [.4, .6], vocab 4 → [.4, .6, 0] gathered at [2, 0, 2, 1] →
    /// [0, .4, 0, .6].
    pub fn spread(&self, rows: &Tensor) -> Result<Tensor> {
        match rows.device().is_cpu() {
            // on the host a scatter of each row's columns (the same values): candle's
            // column-wise gather walks element by element
            true => scatter_columns(rows, &self.ids, self.col_of_token.dim(0)?),
            false => gather_columns(rows, &self.col_of_token),
        }
    }

    /// Logits `[.., subset]` of normalised hidden states, in the compute dtype (as
    /// [`Target::lm_head`]); rows of a drafter in another dtype than the target's are read in
    /// the target's.
    pub fn logits(&self, target: &Target, hidden: &Tensor) -> Result<Tensor> {
        target.logits_with(&self.head, &hidden.to_dtype(target.dtype)?)
    }
}

/// [`DraftHead::spread`] as a gather: `col_of_token[t]` is token t's column (`cols` for a token
/// outside the subset, read from an appended zero column).
fn gather_columns(rows: &Tensor, col_of_token: &Tensor) -> Result<Tensor> {
    let zero = Tensor::zeros((rows.dim(0)?, 1), rows.dtype(), rows.device())?;
    Ok(Tensor::cat(&[rows, &zero], 1)?.index_select(col_of_token, 1)?)
}

/// [`DraftHead::spread`] as a scatter on the host: column j of each row to token `ids[j]` of
/// `vocab`.
fn scatter_columns(rows: &Tensor, ids: &[u32], vocab: usize) -> Result<Tensor> {
    let n = rows.dim(0)?;
    let mut out = vec![0f32; n * vocab];
    for (r, row) in rows
        .to_dtype(DType::F32)?
        .to_vec2::<f32>()?
        .iter()
        .enumerate()
    {
        for (&t, &x) in ids.iter().zip(row) {
            out[r * vocab + t as usize] = x;
        }
    }
    Ok(Tensor::from_vec(out, (n, vocab), rows.device())?.to_dtype(rows.dtype())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_problem() {
        let v = |ids: Vec<u32>| DraftVocab {
            token_ids: ids,
            source: String::new(),
            coverage: None,
        };
        assert!(v(vec![2, 5, 9]).validate(10).is_ok());
        let e = v(vec![]).validate(10).unwrap_err().to_string();
        assert!(e.contains("empty"), "{e}");
        let e = v(vec![2, 9, 5]).validate(10).unwrap_err().to_string();
        assert!(e.contains("ascending") && e.contains("9 then 5"), "{e}");
        let e = v(vec![2, 2]).validate(10).unwrap_err().to_string();
        assert!(e.contains("unique"), "{e}");
        let e = v(vec![2, 10]).validate(10).unwrap_err().to_string();
        assert!(e.contains("token 10") && e.contains("10 tokens"), "{e}");
    }

    #[test]
    fn with_tokens_adds_a_prompts_tokens_once() {
        let v = DraftVocab {
            token_ids: vec![2, 13, 28],
            source: "s".into(),
            coverage: Some(0.9),
        };
        let w = v.with_tokens(&[28, 5, 5]);
        assert_eq!(w.token_ids, vec![2, 5, 13, 28]);
        assert!(w.validate(29).is_ok());
        assert_eq!(v.with_tokens(&[]).token_ids, v.token_ids);
    }

    /// The host's scatter and the device's gather spread a subset's rows alike: the doc's
    /// example, and 3 rows of a 37-token subset of 100 tokens.
    #[test]
    fn scatter_and_gather_spread_alike() {
        let dev = candle_core::Device::Cpu;
        let spread = |rows: &Tensor, ids: &[u32], vocab: usize| {
            let mut col = vec![ids.len() as u32; vocab];
            for (j, &t) in ids.iter().enumerate() {
                col[t as usize] = j as u32;
            }
            let col = Tensor::new(col, &dev).unwrap();
            let g = gather_columns(rows, &col)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let s = scatter_columns(rows, ids, vocab)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            assert_eq!(g, s);
            s
        };
        let rows = Tensor::new(&[[0.4f32, 0.6]], &dev).unwrap();
        assert_eq!(spread(&rows, &[1, 3], 4), vec![vec![0.0, 0.4, 0.0, 0.6]]);
        let ids: Vec<u32> = (0..100).filter(|t| t % 3 == 1 || t % 7 == 0).collect();
        let rows = Tensor::rand(0f32, 1.0, (3, ids.len()), &dev).unwrap();
        spread(&rows, &ids, 100);
    }
}
