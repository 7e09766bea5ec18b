//! The evaluation harness: every mode on the same prompts in the same process, with the
//! product's own decoding loop (AR is that loop with block size 1, as z-lab's harness does),
//! so τ and speed-ups compare like with like.

use anyhow::{bail, Result};
use dflash_core::sampling::SamplingParams;
use dflash_core::stats::RoundOutcome;
use dflash_engine::{generate, Generation, GraphCache, Mode, ModeName, Request};
use dflash_model::io::loader::LoadedTarget;
use dflash_model::io::tokenizer::ChatMessage;
use dflash_model::models::drafter::Drafter;
use serde::{Deserialize, Serialize};

use crate::datasets::EvalItem;

/// A drafter under evaluation, with the label reports use for it.
pub struct EvalDrafter {
    pub label: String,
    pub drafter: Drafter,
}

/// One mode with one drafter (or none, for AR).
#[derive(Debug, Clone)]
pub struct ModeSpec {
    pub label: String,
    pub drafter: Option<usize>,
    pub mode: Mode,
}

/// AR once, then each speculative mode for each drafter. With several drafters the labels
/// carry the drafter's label: `dflash[ours]`, `ddtree:8[z-lab]`.
pub fn mode_specs(
    modes: &[ModeName],
    drafters: &[EvalDrafter],
    block: Option<usize>,
) -> Result<Vec<ModeSpec>> {
    let mut out = vec![ModeSpec {
        label: "ar".into(),
        drafter: None,
        mode: Mode::Ar,
    }];
    for (di, d) in drafters.iter().enumerate() {
        let b = block.unwrap_or(d.drafter.block_size);
        for m in modes.iter().filter(|m| m.is_speculative()) {
            let mode = m.with_block(b);
            let name = mode.name();
            let label = if drafters.len() > 1 {
                format!("{name}[{}]", d.label)
            } else {
                name
            };
            out.push(ModeSpec {
                label,
                drafter: Some(di),
                mode,
            });
        }
    }
    if out.len() == 1 && modes.iter().any(ModeName::is_speculative) {
        bail!("speculative modes need --drafter");
    }
    Ok(out)
}

/// One generation: a mode on one turn of one item.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Run {
    pub mode: String,
    pub item: String,
    pub turn: usize,
    pub prompt_tokens: usize,
    /// In the journal ([`crate::journal`]), not in reports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prompt_ids: Vec<u32>,
    pub tokens: Vec<u32>,
    pub rounds: Vec<RoundOutcome>,
    pub prefill_secs: f64,
    pub decode_secs: f64,
}

pub struct EvalOptions {
    pub sampling: SamplingParams,
    pub max_new_tokens: usize,
    /// Start no new item after this much wall time (the first always runs): the items
    /// finished (every mode on every turn, so modes stay comparable) make the report (e.g. a
    /// 10-minute GPU lease).
    pub time_limit: Option<std::time::Duration>,
    /// How the decoding loop runs its target forwards (CUDA graphs); not what it computes.
    pub decode: dflash_engine::DecodeOptions,
    /// Before the timed items, generate this many tokens of the first item in every mode and
    /// discard them (0: none): the first forwards on a GPU pay for PTX compilation (≈ 20 s) and
    /// allocations, which would otherwise be charged to the first mode (AR) and inflate every
    /// speed-up. E.g. 32: four modes each decode 32 untimed tokens of `gsm8k/0`.
    pub warmup_tokens: usize,
}

/// Run every mode on every item (every turn, each mode feeding back its own answers).
pub fn run(
    lt: &LoadedTarget,
    drafters: &[EvalDrafter],
    specs: &[ModeSpec],
    items: &[EvalItem],
    opts: &EvalOptions,
) -> Result<Vec<Run>> {
    run_journaled(lt, drafters, specs, items, opts, None)
}

/// [`run`], taking the items `journal` holds from it instead of decoding them and recording
/// each item it finishes there ([`crate::journal`]): an interrupted evaluation resumes.
pub fn run_journaled(
    lt: &LoadedTarget,
    drafters: &[EvalDrafter],
    specs: &[ModeSpec],
    items: &[EvalItem],
    opts: &EvalOptions,
    mut journal: Option<&mut crate::journal::Journal>,
) -> Result<Vec<Run>> {
    let total: usize = items.iter().map(|i| i.turns.len()).sum::<usize>() * specs.len();
    // each mode's fixed-shape forwards (CUDA graphs) kept from one generation to the next
    let mut graphs: Vec<GraphCache> = specs.iter().map(|_| GraphCache::default()).collect();
    let mut pb = dflash_train::progress::Progress::new(total, "eval", "generations");
    let ctx = lt.target.config.max_position_embeddings;
    let mut runs = Vec::new();
    if let (Some(first), true) = (items.first(), opts.warmup_tokens > 0) {
        warm_up(lt, drafters, specs, first, opts, &mut graphs)?;
    }
    let started = std::time::Instant::now();
    // the first item decoded here always runs, so that every resumed run advances
    let mut decoded = 0;
    for (ii, item) in items.iter().enumerate() {
        if decoded > 0 && opts.time_limit.is_some_and(|l| started.elapsed() >= l) {
            pb.finish();
            eprintln!(
                "time limit reached: {ii} of {} items done, the report covers them",
                items.len()
            );
            return Ok(runs);
        }
        if let Some(done) = journal.as_ref().and_then(|j| j.done.get(&item.id).cloned()) {
            pb.inc(done.len(), format!("{} from the journal", item.id));
            runs.extend(done);
            continue;
        }
        let before = runs.len();
        for (spec, graphs) in specs.iter().zip(graphs.iter_mut()) {
            let mut history: Vec<ChatMessage> = Vec::new();
            for (turn, text) in item.turns.iter().enumerate() {
                history.push(ChatMessage {
                    role: "user".into(),
                    content: text.clone(),
                });
                let ids = chat_ids(lt, &history)?;
                let max_new = opts.max_new_tokens.min(ctx.saturating_sub(ids.len()));
                if max_new == 0 {
                    bail!(
                        "{} turn {turn}: the prompt ({} tokens) fills the context",
                        item.id,
                        ids.len()
                    );
                }
                let mut sampling = opts.sampling;
                sampling.seed = opts.sampling.seed.wrapping_add((ii * 16 + turn) as u64);
                let g = decode_turn(lt, drafters, (spec, graphs), &ids, max_new, sampling, opts)?;
                let answer = lt.tokenizer.decode(&g.new_tokens)?;
                history.push(ChatMessage {
                    role: "assistant".into(),
                    content: answer,
                });
                let tau = dflash_core::stats::summarize(&[&g.rounds]).tau_pooled;
                pb.inc(1, format!("{} {} τ {tau:.2}", item.id, spec.label));
                runs.push(Run {
                    mode: spec.label.clone(),
                    item: item.id.clone(),
                    turn,
                    prompt_tokens: ids.len(),
                    prompt_ids: ids,
                    tokens: g.new_tokens,
                    rounds: g.rounds,
                    prefill_secs: g.prefill_secs,
                    decode_secs: g.decode_secs,
                });
            }
        }
        decoded += 1;
        if let Some(j) = journal.as_mut() {
            j.push(&item.id, &runs[before..])?;
        }
    }
    pb.finish();
    Ok(runs)
}

/// A conversation's prompt ids, as the target's chat template renders it.
fn chat_ids(lt: &LoadedTarget, history: &[ChatMessage]) -> Result<Vec<u32>> {
    let rendered = lt.tokenizer.apply_chat_template(history)?;
    lt.tokenizer.encode(&rendered, false)
}

/// One mode's generation after `ids` (the timed items and the warm-up decode alike).
fn decode_turn(
    lt: &LoadedTarget,
    drafters: &[EvalDrafter],
    (spec, graphs): (&ModeSpec, &mut GraphCache),
    ids: &[u32],
    max_new_tokens: usize,
    sampling: SamplingParams,
    opts: &EvalOptions,
) -> Result<Generation> {
    let req = Request {
        prompt_ids: ids.to_vec(),
        max_new_tokens,
        sampling,
        stop_ids: lt.tokenizer.stop_ids.clone(),
        loop_window: 0,
    };
    generate(
        &lt.target,
        spec.drafter.map(|d| &drafters[d].drafter),
        spec.mode,
        &req,
        opts.decode,
        Some(graphs),
    )
}

/// The untimed warm-up of [`EvalOptions::warmup_tokens`]: every mode on the first turn of
/// `item`, its output discarded.
fn warm_up(
    lt: &LoadedTarget,
    drafters: &[EvalDrafter],
    specs: &[ModeSpec],
    item: &EvalItem,
    opts: &EvalOptions,
    graphs: &mut [GraphCache],
) -> Result<()> {
    let Some(text) = item.turns.first() else {
        return Ok(());
    };
    let ids = chat_ids(
        lt,
        &[ChatMessage {
            role: "user".into(),
            content: text.clone(),
        }],
    )?;
    let ctx = lt.target.config.max_position_embeddings;
    let max_new = opts.warmup_tokens.min(ctx.saturating_sub(ids.len()));
    if max_new == 0 {
        return Ok(());
    }
    let t = std::time::Instant::now();
    for (spec, graphs) in specs.iter().zip(graphs.iter_mut()) {
        decode_turn(
            lt,
            drafters,
            (spec, graphs),
            &ids,
            max_new,
            opts.sampling,
            opts,
        )?;
    }
    eprintln!(
        "warm-up: {max_new} tokens of {} in {} mode(s), {:.1} s (not timed)",
        item.id,
        specs.len(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
