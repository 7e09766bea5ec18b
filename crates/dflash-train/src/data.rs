//! Training shards: token ids + loss mask per sequence, one JSON object per line, and a
//! manifest that says which target wrote them and how.
//!
//! ```text
//! DIR/manifest.json       target identity hash, template, sampling, counts, source, shard list
//!                         (each shard with the sha256 of its bytes, checked when read)
//! DIR/shard-00000.jsonl   {"ids": [...], "loss_mask": [0, 0, …, 1, 1]}  (1 on response tokens)
//! ```
//! Example: prompt of 20 tokens and a response of 30 → 50 ids, loss_mask 20 zeros then 30 ones.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use dflash_core::sampling::SamplingParams;
use serde::{Deserialize, Serialize};

pub const FORMAT: &str = "dflash-rs-shards-v1";

/// Whether `name` is an entry `data generate` writes in its directory: the manifest, shards,
/// the responses of shards not complete yet (`pending.jsonl`), the ranks' directory, and the
/// atomic writes' temporaries. Anything else in an `--out` is
/// someone else's, and regeneration refuses to mix shards into it. Example: `shard-00003.jsonl`
/// and `.manifest.json.tmp-4711` are; `metrics.jsonl` (a training run's) is not.
pub fn is_own_entry(name: &str) -> bool {
    name == "manifest.json"
        || name == "pending.jsonl"
        || name == "ranks"
        || (name.starts_with("shard-") && name.ends_with(".jsonl"))
        || (name.starts_with('.') && name.contains(".tmp-"))
}

/// `data generate --out DIR`: missing, or a data directory of its own to continue.
pub fn check_out(dir: &Path) -> Result<()> {
    dflash_model::io::outputs::Output {
        flag: "--out",
        own: &is_own_entry,
        forceable: false,
    }
    .check_dir(dir, false)
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sequence {
    pub ids: Vec<u32>,
    pub loss_mask: Vec<u8>,
}

impl Sequence {
    pub fn supervised(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m != 0).count()
    }

    /// The prompt: the tokens before the first supervised one (at least one token; all of
    /// them when nothing is supervised). Example: loss mask `[0, 0, 0, 1, 1]` → 3.
    pub fn prompt_len(&self) -> usize {
        self.loss_mask
            .iter()
            .position(|&m| m != 0)
            .unwrap_or(self.ids.len())
            .max(1)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardInfo {
    pub file: String,
    pub sequences: usize,
    pub tokens: usize,
    pub supervised_tokens: usize,
    /// Responses that ended at their first repeated window (`--loop-window`; absent: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ended_by_loop: usize,
    /// sha256 of the shard's bytes as written (lowercase hex; absent in older manifests): a
    /// shard damaged after writing is refused by name when it is read or a run resumes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    /// sha256 of the target's files (see `dflash_model::io::loader::identity_hash`).
    pub target_hash: String,
    pub target: String,
    pub chat_template_sha256: Option<String>,
    pub sampling: SamplingParams,
    pub max_new_tokens: usize,
    /// Responses ended at their first repeated window of this many tokens
    /// ([`dflash_core::loops`]); 0 (absent in older manifests): never.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub loop_window: usize,
    pub source: String,
    pub prompts_per_shard: usize,
    pub shards: Vec<ShardInfo>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl Manifest {
    pub fn sequences(&self) -> usize {
        self.shards.iter().map(|s| s.sequences).sum()
    }
    pub fn supervised_tokens(&self) -> usize {
        self.shards.iter().map(|s| s.supervised_tokens).sum()
    }
}

/// Parse JSON Lines (blank lines skipped), naming the file and line of a bad record.
pub fn parse_jsonl<T: serde::de::DeserializeOwned>(text: &str, path: &Path) -> Result<Vec<T>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| format!("{} line {}", path.display(), i + 1))
        })
        .collect()
}

pub fn shard_name(i: usize) -> String {
    format!("shard-{i:05}.jsonl")
}

/// Write a shard; returns the sha256 of its bytes (the manifest's [`ShardInfo::sha256`]).
pub fn write_shard(path: &Path, seqs: &[Sequence]) -> Result<String> {
    let mut out = Vec::new();
    for s in seqs {
        serde_json::to_writer(&mut out, s)?;
        out.push(b'\n');
    }
    dflash_model::io::atomic::write_file(path, &out)?;
    Ok(sha256_hex(&out))
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The bytes of shard `sh` of `dir`, checked against the sha256 its manifest records (where it
/// records one). Example: a byte of `shard-00003.jsonl` flipped after writing → "data/shard-
/// 00003.jsonl does not match the sha256 manifest.json records for it (damaged after it was
/// written?)".
pub fn read_shard(dir: &Path, sh: &ShardInfo) -> Result<Vec<u8>> {
    let p = dir.join(&sh.file);
    let bytes = std::fs::read(&p).with_context(|| format!("opening shard {}", p.display()))?;
    if let Some(want) = &sh.sha256 {
        if sha256_hex(&bytes) != *want {
            bail!(
                "{} does not match the sha256 manifest.json records for it (damaged after it \
                 was written?): regenerate it (remove it and its manifest entry) or restore it",
                p.display()
            );
        }
    }
    Ok(bytes)
}

pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let p = dir.join("manifest.json");
    let text = std::fs::read_to_string(&p).with_context(|| {
        format!(
            "{} has no manifest.json: not a dflash-rs data directory",
            dir.display()
        )
    })?;
    let m: Manifest =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))?;
    if m.format != FORMAT {
        bail!(
            "{}: unknown data format '{}' (expected {FORMAT})",
            p.display(),
            m.format
        );
    }
    Ok(m)
}

pub fn write_manifest(dir: &Path, m: &Manifest) -> Result<()> {
    dflash_model::io::atomic::write_file(
        &dir.join("manifest.json"),
        (serde_json::to_string_pretty(m)? + "\n").as_bytes(),
    )
}

/// The sha256 of `dir/manifest.json` (lowercase hex): what a training record keeps to name
/// its data set (`TrainingRecord::data_manifest_sha256`), and what the doctor compares to tell
/// the training data from another set.
pub fn manifest_sha256(dir: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    let p = dir.join("manifest.json");
    let bytes = std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?;
    Ok(Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Every sequence of a data directory, shard by shard, checked.
pub fn read_sequences(dir: &Path) -> Result<(Manifest, Vec<Sequence>)> {
    let m = read_manifest(dir)?;
    let mut seqs = Vec::new();
    for sh in &m.shards {
        let p: PathBuf = dir.join(&sh.file);
        let bytes = read_shard(dir, sh)?;
        for (i, line) in bytes.as_slice().lines().enumerate() {
            let line = line.with_context(|| format!("{} line {}", p.display(), i + 1))?;
            if line.trim().is_empty() {
                continue;
            }
            let s: Sequence = serde_json::from_str(&line)
                .with_context(|| format!("{} line {}", p.display(), i + 1))?;
            if s.ids.len() != s.loss_mask.len() {
                bail!(
                    "{} line {}: {} ids but {} loss-mask entries",
                    p.display(),
                    i + 1,
                    s.ids.len(),
                    s.loss_mask.len()
                );
            }
            seqs.push(s);
        }
    }
    if seqs.is_empty() {
        bail!("{} holds no sequences (empty shards)", dir.display());
    }
    Ok((m, seqs))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shard damaged after writing is refused by name; an older manifest without checksums
    /// reads as before.
    #[test]
    fn a_damaged_shard_is_refused_by_its_checksum() {
        let dir = std::env::temp_dir().join(format!("dflash-shard-sum-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let seqs = vec![Sequence {
            ids: vec![1, 2, 3],
            loss_mask: vec![0, 1, 1],
        }];
        let sum = write_shard(&dir.join(shard_name(0)), &seqs).unwrap();
        let mut m = Manifest {
            format: FORMAT.into(),
            target_hash: "t".into(),
            target: "t".into(),
            chat_template_sha256: None,
            sampling: SamplingParams::default(),
            max_new_tokens: 2,
            loop_window: 0,
            source: "s".into(),
            prompts_per_shard: 1,
            shards: vec![ShardInfo {
                file: shard_name(0),
                sequences: 1,
                tokens: 3,
                supervised_tokens: 2,
                ended_by_loop: 0,
                sha256: Some(sum),
            }],
        };
        write_manifest(&dir, &m).unwrap();
        assert_eq!(read_sequences(&dir).unwrap().1, seqs);
        // a digit changed: still valid JSON, other tokens
        let p = dir.join(shard_name(0));
        let text = std::fs::read_to_string(&p)
            .unwrap()
            .replace("[1,2,3]", "[1,2,4]");
        std::fs::write(&p, text).unwrap();
        let e = format!("{:#}", read_sequences(&dir).unwrap_err());
        assert!(
            e.contains("shard-00000.jsonl does not match the sha256"),
            "{e}"
        );
        m.shards[0].sha256 = None;
        write_manifest(&dir, &m).unwrap();
        assert_eq!(read_sequences(&dir).unwrap().1[0].ids, [1, 2, 4]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn prompt_len_is_the_tokens_before_the_first_supervised_one() {
        let s = |mask: &[u8]| Sequence {
            ids: (0..mask.len() as u32).collect(),
            loss_mask: mask.to_vec(),
        };
        assert_eq!(s(&[0, 0, 0, 1, 1]).prompt_len(), 3);
        assert_eq!(s(&[0, 0, 1, 0, 1]).prompt_len(), 2);
        // nothing supervised: all of it; supervised from the start: still one prompt token
        assert_eq!(s(&[0, 0, 0]).prompt_len(), 3);
        assert_eq!(s(&[1, 1, 1]).prompt_len(), 1);
    }
}
