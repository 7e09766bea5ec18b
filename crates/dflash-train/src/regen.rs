//! Data regeneration: the target writes the responses it will later verify, with the same
//! engine as `generate`. Each prompt is rendered with the target's chat template; the
//! sequence is prompt + response, supervised (loss mask 1) on the response only.
//!
//! Shards of `prompts_per_shard` prompts are written atomically and listed in the manifest
//! as they finish, so an interrupted run resumes by skipping finished shards.

use std::path::Path;

use anyhow::{bail, Result};
use dflash_core::sampling::SamplingParams;
use dflash_engine::{generate, Mode, Request};
use dflash_model::loader::{identity_hash, LoadedTarget};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

use crate::data::{
    read_manifest, shard_name, write_manifest, write_shard, Manifest, Sequence, ShardInfo, FORMAT,
};
use crate::prompts::Prompt;

pub struct RegenOptions {
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub prompts_per_shard: usize,
    pub source: String,
    pub target_name: String,
}

fn sha256_hex(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// One prompt → one training sequence.
pub fn regenerate_one(
    lt: &LoadedTarget,
    prompt: &Prompt,
    opts: &RegenOptions,
    seed: u64,
) -> Result<Sequence> {
    let text = lt.tokenizer.apply_chat_template(&prompt.messages)?;
    let ids = lt.tokenizer.encode(&text, false)?;
    let ctx = lt.target.config.max_position_embeddings;
    let max_new = opts.max_new_tokens.min(ctx.saturating_sub(ids.len()));
    if max_new == 0 {
        bail!(
            "prompt of {} tokens leaves no room in the context ({ctx})",
            ids.len()
        );
    }
    let mut sampling = opts.sampling;
    sampling.seed = seed;
    let req = Request {
        prompt_ids: ids.clone(),
        max_new_tokens: max_new,
        sampling,
        stop_ids: lt.tokenizer.stop_ids.clone(),
    };
    let g = generate(&lt.target, None, Mode::Ar, &req)?;
    let mut loss_mask = vec![0u8; ids.len()];
    loss_mask.extend(std::iter::repeat_n(1u8, g.new_tokens.len()));
    let mut all = ids;
    all.extend_from_slice(&g.new_tokens);
    Ok(Sequence {
        ids: all,
        loss_mask,
    })
}

/// Regenerate responses for `prompts` into `out` (resumable).
pub fn regenerate(
    lt: &LoadedTarget,
    prompts: &[Prompt],
    out: &Path,
    opts: &RegenOptions,
) -> Result<Manifest> {
    std::fs::create_dir_all(out)?;
    let target_hash = identity_hash(&lt.source)?;
    let mut manifest = match read_manifest(out) {
        Ok(m) => {
            if m.target_hash != target_hash {
                bail!(
                    "{} was written by another target (hash {} ≠ {})",
                    out.display(),
                    m.target_hash,
                    target_hash
                );
            }
            if m.prompts_per_shard != opts.prompts_per_shard || m.source != opts.source {
                bail!(
                    "{} was written with another source or shard size; use a new --out",
                    out.display()
                );
            }
            m
        }
        Err(_) => Manifest {
            format: FORMAT.into(),
            target_hash,
            target: opts.target_name.clone(),
            chat_template_sha256: lt.tokenizer.chat_template.as_deref().map(sha256_hex),
            sampling: opts.sampling,
            max_new_tokens: opts.max_new_tokens,
            source: opts.source.clone(),
            prompts_per_shard: opts.prompts_per_shard,
            shards: vec![],
        },
    };
    let n_shards = prompts.len().div_ceil(opts.prompts_per_shard);
    let done: usize = manifest.shards.len();
    let pb = ProgressBar::new(prompts.len() as u64);
    pb.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} prompts [{elapsed_precise} < {eta_precise}] {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb.set_position((done * opts.prompts_per_shard).min(prompts.len()) as u64);
    let mut tokens_done = 0usize;
    let t0 = std::time::Instant::now();
    for k in done..n_shards {
        let chunk = &prompts
            [k * opts.prompts_per_shard..((k + 1) * opts.prompts_per_shard).min(prompts.len())];
        let mut seqs = Vec::with_capacity(chunk.len());
        for (j, p) in chunk.iter().enumerate() {
            let idx = k * opts.prompts_per_shard + j;
            match regenerate_one(lt, p, opts, opts.sampling.seed.wrapping_add(idx as u64)) {
                Ok(s) => {
                    tokens_done += s.supervised();
                    seqs.push(s);
                }
                Err(e) => tracing::warn!("prompt {idx} skipped: {e:#}"),
            }
            pb.inc(1);
            pb.set_message(format!(
                "{:.1} tok/s",
                tokens_done as f64 / t0.elapsed().as_secs_f64()
            ));
        }
        let file = shard_name(k);
        write_shard(&out.join(&file), &seqs)?;
        manifest.shards.push(ShardInfo {
            file,
            sequences: seqs.len(),
            tokens: seqs.iter().map(|s| s.ids.len()).sum(),
            supervised_tokens: seqs.iter().map(|s| s.supervised()).sum(),
        });
        write_manifest(out, &manifest)?;
    }
    pb.finish_and_clear();
    Ok(manifest)
}
