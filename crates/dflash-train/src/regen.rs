//! Data regeneration: the target writes the responses it will later verify, with the same
//! engine as `generate`. Each prompt is rendered with the target's chat template; the
//! sequence is prompt + response, supervised (loss mask 1) on the response only.
//!
//! Shards of `prompts_per_shard` prompts are written atomically and listed in the manifest
//! as they finish, so an interrupted run resumes by skipping finished shards.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Result};
use dflash_core::sampling::SamplingParams;
use dflash_engine::batched::{generate_batched, BatchedOptions, Flow};
use dflash_engine::{generate, Mode, Request};
use dflash_model::io::loader::{identity_hash, LoadedTarget};
use sha2::{Digest, Sha256};

use crate::data::{
    read_manifest, shard_name, write_manifest, write_shard, Manifest, Sequence, ShardInfo, FORMAT,
};
use crate::progress::Progress;
use crate::prompts::Prompt;

pub struct RegenOptions {
    pub max_new_tokens: usize,
    /// End each response at its first repeated window of this many tokens (0: never).
    pub loop_window: usize,
    pub sampling: SamplingParams,
    pub prompts_per_shard: usize,
    /// Sequences decoded together (one batched forward per step); 1: one at a time.
    pub batch_size: usize,
    /// Batched steps replayed from a CUDA graph ([`dflash_engine::batched::BatchedOptions`]).
    pub cuda_graphs: bool,
    /// Stop (keeping the finished shards) once this much wall time has passed.
    pub time_limit: Option<std::time::Duration>,
    pub source: String,
    pub target_name: String,
}

fn sha256_hex(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A resumed run's prompts are the ones its shards were written from. The manifest records the
/// prompt file's path, not its content, so the last shard's first sequence must start with the
/// rendering of one of that shard's prompts (a prompt that could not be rendered leaves no
/// sequence). Example: 3 shards of 16 written, then another file at the same path: none of its
/// prompts 32..48 renders to the stored prompt → refused; the same file with prompts appended
/// → continues at prompt 48.
fn check_same_prompts(
    lt: &LoadedTarget,
    out: &Path,
    manifest: &Manifest,
    prompts: &[Prompt],
    opts: &RegenOptions,
) -> Result<()> {
    let pps = opts.prompts_per_shard;
    let last = manifest.shards.len() - 1;
    let path = out.join(&manifest.shards[last].file);
    let text =
        std::fs::read_to_string(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let seqs: Vec<Sequence> = crate::data::parse_jsonl(&text, &path)?;
    let Some(first) = seqs.first() else {
        return Ok(()); // every prompt of that shard was skipped: nothing to compare
    };
    let head = &first.ids[..first.prompt_len()];
    let range = (last * pps).min(prompts.len())..((last + 1) * pps).min(prompts.len());
    let matches = prompts[range.clone()]
        .iter()
        .any(|p| build_request(lt, p, opts, 0).is_ok_and(|r| r.prompt_ids == head));
    if !matches {
        bail!(
            "{} was not written from these prompts: its shard {last} begins with none of prompts \
             {}..{} of the {} given (a different file at the path '{}'?); continue with the \
             prompts it was written from (more may be appended), or use a new --out",
            out.display(),
            range.start,
            range.end,
            prompts.len(),
            opts.source
        );
    }
    Ok(())
}

/// Prompts `todo` decoded together (one batched forward per step over `opts.batch_size`
/// slots), each reported to `finish` as it ends; a prompt that cannot be rendered is reported
/// at once, without a sequence.
fn decode_batched(
    lt: &LoadedTarget,
    prompts: &[Prompt],
    opts: &RegenOptions,
    todo: &[usize],
    seed_of: &dyn Fn(usize) -> u64,
    admit_until: Option<std::time::Instant>,
    finish: &mut dyn FnMut(usize, Option<Regenerated>) -> Result<Flow>,
) -> Result<()> {
    // requests in prompt order
    let (mut reqs, mut index_of) = (Vec::new(), Vec::new());
    for &i in todo {
        match build_request(lt, &prompts[i], opts, seed_of(i)) {
            Ok(r) => {
                index_of.push(i);
                reqs.push(r);
            }
            Err(e) => {
                tracing::warn!("prompt {i} skipped: {e:#}");
                if finish(i, None)? == Flow::Stop {
                    return Ok(());
                }
            }
        }
    }
    let bopts = BatchedOptions {
        cuda_graphs: opts.cuda_graphs,
        admit_until,
        ..Default::default()
    };
    generate_batched(&lt.target, &reqs, opts.batch_size, bopts, |j, r| {
        let i = index_of[j];
        let seq = r
            .map(|g| Regenerated {
                seq: to_sequence(&reqs[j].prompt_ids, &g.new_tokens),
                looped: g.stopped_by_loop,
            })
            .map_err(|e| tracing::warn!("prompt {i} skipped: {e:#}"))
            .ok();
        finish(i, seq)
    })
}

/// Pending responses answer these prompts: each one's prompt tokens are its prompt's
/// rendering (another file at the same path would mix two data sets).
fn check_pending(
    lt: &LoadedTarget,
    out: &Path,
    pending: &[crate::regen_pending::Finished],
    prompts: &[Prompt],
    opts: &RegenOptions,
) -> Result<()> {
    for (i, s) in pending {
        let Some((seq, _)) = s else { continue };
        let head = &seq.ids[..seq.prompt_len()];
        if !build_request(lt, &prompts[*i], opts, 0).is_ok_and(|r| r.prompt_ids == head) {
            bail!(
                "{}/{} holds a response to prompt {i} that is not the rendering of prompt {i} \
                 of the {} given (a different file at the path '{}'?); continue with the \
                 prompts it was written from, or use a new --out",
                out.display(),
                crate::regen_pending::PENDING,
                prompts.len(),
                opts.source
            );
        }
    }
    Ok(())
}

/// The generation request of one prompt: chat template, token ids, the room left in the
/// context, the sampler seeded per prompt.
fn build_request(
    lt: &LoadedTarget,
    prompt: &Prompt,
    opts: &RegenOptions,
    seed: u64,
) -> Result<Request> {
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
    Ok(Request {
        prompt_ids: ids,
        max_new_tokens: max_new,
        sampling,
        stop_ids: lt.tokenizer.stop_ids.clone(),
        loop_window: opts.loop_window,
    })
}

/// Prompt + response, supervised on the response only.
fn to_sequence(prompt_ids: &[u32], new_tokens: &[u32]) -> Sequence {
    let mut loss_mask = vec![0u8; prompt_ids.len()];
    loss_mask.extend(std::iter::repeat_n(1u8, new_tokens.len()));
    let mut ids = prompt_ids.to_vec();
    ids.extend_from_slice(new_tokens);
    Sequence { ids, loss_mask }
}

/// One prompt → one training sequence.
pub fn regenerate_one(
    lt: &LoadedTarget,
    prompt: &Prompt,
    opts: &RegenOptions,
    seed: u64,
) -> Result<Sequence> {
    regenerate_one_ended(lt, prompt, opts, seed).map(|f| f.seq)
}

/// A regenerated sequence and whether its response ended at its first repeated window.
struct Regenerated {
    seq: Sequence,
    looped: bool,
}

fn regenerate_one_ended(
    lt: &LoadedTarget,
    prompt: &Prompt,
    opts: &RegenOptions,
    seed: u64,
) -> Result<Regenerated> {
    let req = build_request(lt, prompt, opts, seed)?;
    let g = generate(&lt.target, None, Mode::Ar, &req, Default::default(), None)?;
    Ok(Regenerated {
        seq: to_sequence(&req.prompt_ids, &g.new_tokens),
        looped: g.stopped_by_loop,
    })
}

/// Collects finished prompts (in any order) and writes shard k as soon as all of its prompts
/// are finished, in shard order, each shard and the manifest atomically. Example, 2 prompts per
/// shard: prompts finish 1, 0, 3 → shard 0 is written after the second; shard 1 waits for 2.
struct ShardWriter<'a> {
    out: &'a Path,
    manifest: &'a mut Manifest,
    pps: usize,
    next_shard: usize,
    n_prompts: usize,
    finished: BTreeMap<usize, Option<Regenerated>>,
    tokens_done: usize,
    /// Where finished prompts are recorded before their shard is complete.
    pending: Option<crate::regen_pending::Pending>,
}

impl ShardWriter<'_> {
    fn finish(&mut self, idx: usize, seq: Option<Regenerated>) -> Result<()> {
        if let Some(p) = self.pending.as_mut() {
            p.push(idx, seq.as_ref().map(|r| (&r.seq, r.looped)))?;
        }
        self.tokens_done += seq.as_ref().map_or(0, |s| s.seq.supervised());
        self.finished.insert(idx, seq);
        loop {
            let lo = self.next_shard * self.pps;
            let hi = (lo + self.pps).min(self.n_prompts);
            if lo >= hi || !(lo..hi).all(|i| self.finished.contains_key(&i)) {
                return Ok(());
            }
            let done: Vec<Regenerated> = (lo..hi)
                .filter_map(|i| self.finished.remove(&i).flatten())
                .collect();
            let ended_by_loop = done.iter().filter(|r| r.looped).count();
            let seqs: Vec<Sequence> = done.into_iter().map(|r| r.seq).collect();
            let file = shard_name(self.next_shard);
            let sha256 = write_shard(&self.out.join(&file), &seqs)?;
            self.manifest.shards.push(ShardInfo {
                file,
                sequences: seqs.len(),
                tokens: seqs.iter().map(|s| s.ids.len()).sum(),
                supervised_tokens: seqs.iter().map(|s| s.supervised()).sum(),
                ended_by_loop,
                sha256: Some(sha256),
            });
            write_manifest(self.out, self.manifest)?;
            self.next_shard += 1;
        }
    }
}

/// Regenerate responses for `prompts` into `out` (resumable: finished shards are skipped, and
/// the responses finished in shards not complete yet are kept in `pending.jsonl`,
/// [`crate::regen_pending`]). With `batch_size > 1` on an attention-only target the prompts are
/// decoded batched ([`dflash_engine::batched`]), continuously across shard boundaries; a
/// prompt's tokens do not depend on the batch size (its sampler is seeded by its index). With a
/// time limit, decoding stops at the first prompt that finishes past it; the next run decodes
/// only the prompts without a response.
pub fn regenerate(
    lt: &LoadedTarget,
    prompts: &[Prompt],
    out: &Path,
    opts: &RegenOptions,
) -> Result<Manifest> {
    crate::regen_ranks::refuse_partitioned(out)?;
    regenerate_indexed(lt, prompts, out, opts, &|i| i)
}

/// [`regenerate`] of a part of a prompt set: `prompts[i]` is prompt `global(i)` of the whole
/// set, which seeds its sampler, so that a part regenerates what the whole run would
/// ([`crate::regen_ranks`]).
pub(crate) fn regenerate_indexed(
    lt: &LoadedTarget,
    prompts: &[Prompt],
    out: &Path,
    opts: &RegenOptions,
    global: &dyn Fn(usize) -> usize,
) -> Result<Manifest> {
    std::fs::create_dir_all(out)?;
    let target_hash = identity_hash(&lt.source)?;
    let manifest = match read_manifest(out) {
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
                    "{} was written from {} with --shard-size {}, not from {} with --shard-size {}: continue it with the same prompts and shard size, or use a new --out",
                    out.display(),
                    m.source,
                    m.prompts_per_shard,
                    opts.source,
                    opts.prompts_per_shard
                );
            }
            if m.max_new_tokens != opts.max_new_tokens
                || m.sampling != opts.sampling
                || m.loop_window != opts.loop_window
            {
                bail!(
                    "{} was written with --max-new-tokens {}, --loop-window {} and sampling {:?}, not {}, {} and {:?}: continuing would mix two data sets; use the same options or a new --out",
                    out.display(),
                    m.max_new_tokens,
                    m.loop_window,
                    m.sampling,
                    opts.max_new_tokens,
                    opts.loop_window,
                    opts.sampling
                );
            }
            // a shard damaged since it was written is refused before more are added
            for sh in &m.shards {
                crate::data::read_shard(out, sh)?;
            }
            m
        }
        Err(_) => new_manifest(lt, opts, target_hash)?,
    };
    if manifest.shards.is_empty() {
        // the options are on record from the start: a rerun with others is refused before
        // its pending responses mix with theirs
        write_manifest(out, &manifest)?;
    }
    resume_and_decode(lt, prompts, out, opts, global, manifest)
}

fn new_manifest(lt: &LoadedTarget, opts: &RegenOptions, target_hash: String) -> Result<Manifest> {
    Ok(Manifest {
        format: FORMAT.into(),
        target_hash,
        target: opts.target_name.clone(),
        chat_template_sha256: lt.tokenizer.chat_template.as_deref().map(sha256_hex),
        sampling: opts.sampling,
        max_new_tokens: opts.max_new_tokens,
        loop_window: opts.loop_window,
        source: opts.source.clone(),
        prompts_per_shard: opts.prompts_per_shard,
        shards: vec![],
    })
}

/// Decode the prompts of `prompts` that have no response in `out` yet (after its shards and
/// its pending responses), writing shards as they complete.
fn resume_and_decode(
    lt: &LoadedTarget,
    prompts: &[Prompt],
    out: &Path,
    opts: &RegenOptions,
    global: &dyn Fn(usize) -> usize,
    mut manifest: Manifest,
) -> Result<Manifest> {
    let pps = opts.prompts_per_shard;
    let n_shards = prompts.len().div_ceil(pps);
    let done: usize = manifest.shards.len();
    if done > 0 {
        check_same_prompts(lt, out, &manifest, prompts, opts)?;
    }
    let first = (done * pps).min(prompts.len());
    let pending = crate::regen_pending::load(out, first, prompts.len())?;
    check_pending(lt, out, &pending, prompts, opts)?;
    let mut pb = Progress::new(prompts.len(), "data generate", "prompts");
    pb.set_position(first + pending.len());
    let t0 = std::time::Instant::now();
    let mut writer = ShardWriter {
        out,
        manifest: &mut manifest,
        pps,
        next_shard: done,
        n_prompts: prompts.len(),
        finished: BTreeMap::new(),
        tokens_done: 0,
        pending: None,
    };
    let resumed: std::collections::BTreeSet<usize> = pending.iter().map(|p| p.0).collect();
    for (i, s) in pending {
        writer.finish(i, s.map(|(seq, looped)| Regenerated { seq, looped }))?;
    }
    let keep: Vec<crate::regen_pending::Finished> = writer
        .finished
        .iter()
        .map(|(&i, r)| (i, r.as_ref().map(|r| (r.seq.clone(), r.looped))))
        .collect();
    writer.pending = Some(crate::regen_pending::Pending::open(out, &keep)?);
    let mut finish = |idx: usize, seq: Option<Regenerated>| -> Result<Flow> {
        writer.finish(idx, seq)?;
        pb.inc(
            1,
            format!(
                "{} shards written, {:.1} supervised tok/s",
                writer.next_shard,
                writer.tokens_done as f64 / t0.elapsed().as_secs_f64()
            ),
        );
        Ok(match opts.time_limit {
            Some(l) if t0.elapsed() >= l => Flow::Stop,
            _ => Flow::Continue,
        })
    };
    let seed_of = |i: usize| opts.sampling.seed.wrapping_add(global(i) as u64);
    if opts.batch_size <= 1 {
        for (i, p) in prompts.iter().enumerate().skip(first) {
            if resumed.contains(&i) {
                continue;
            }
            let seq = regenerate_one_ended(lt, p, opts, seed_of(i))
                .map_err(|e| tracing::warn!("prompt {i} skipped: {e:#}"))
                .ok();
            if finish(i, seq)? == Flow::Stop {
                break;
            }
        }
    } else {
        let todo: Vec<usize> = (first..prompts.len())
            .filter(|i| !resumed.contains(i))
            .collect();
        let admit_until = opts.time_limit.map(|l| t0 + l);
        decode_batched(lt, prompts, opts, &todo, &seed_of, admit_until, &mut finish)?;
    }
    if writer.next_shard < n_shards {
        eprintln!(
            "stopped at the time limit: {} of {n_shards} shards written, {} more responses kept \
             in {}; run again to continue",
            writer.next_shard,
            writer.finished.len(),
            crate::regen_pending::PENDING
        );
    } else {
        drop(writer);
        crate::regen_pending::remove(out)?;
    }
    pb.finish();
    Ok(manifest)
}
