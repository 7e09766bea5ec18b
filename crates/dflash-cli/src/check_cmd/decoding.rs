//! The decoding checks of one precision on the device: AR against the CPU's, sampled decoding
//! against the CPU's, each mode against AR and with CUDA graphs, graphs kept across
//! generations, batched decoding, train/infer parity.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use dflash_core::sampling::SamplingParams;
use dflash_engine::{generate, DecodeOptions, Generation, GraphCache, Mode, Request};
use dflash_model::io::loader::LoadedTarget;
use dflash_model::models::draft_vocab::DraftVocab;
use dflash_model::models::drafter::Drafter;

use super::{drafter_for, DeviceCheckArgs, Row};

/// The decoding checks of one precision (`name`) on the device: AR against the CPU's and the
/// sampled rows (f32), each mode against AR and with CUDA graphs, kept graphs (attention-only
/// targets), batched decoding, train/infer parity.
pub(super) fn device_rows(
    a: &DeviceCheckArgs,
    name: &str,
    lt: &LoadedTarget,
    cpu: &LoadedTarget,
    req: &Request,
    ar_cpu: &Generation,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let t = Instant::now();
    let ar = generate(&lt.target, None, Mode::Ar, req, Default::default(), None)?;
    let ar_secs = t.elapsed().as_secs_f64();
    if name == "f32" {
        rows.push((
            "AR on device = AR on CPU (T=0)".into(),
            ar.new_tokens == ar_cpu.new_tokens,
            format!("{} tokens", ar.new_tokens.len()),
        ));
        rows.push(sampled_row(lt, cpu, &a.drafter, req, false)?);
        rows.push(sampled_row(lt, cpu, &a.drafter, req, true)?);
    }
    let d = drafter_for(lt, &a.drafter)?;
    rows.extend(mode_rows(name, lt, &d, req, &ar, ar_secs)?);
    if !lt.target.is_hybrid() {
        rows.push(kept_graphs_row(lt, &a.drafter, req, name)?);
    }
    rows.extend(batched_rows(name, lt, req)?);
    if !lt.target.is_hybrid() {
        rows.extend(spec_batch_rows(name, lt, &d, req)?);
    }
    rows.push(parity_row(name, lt, &d, &req.prompt_ids)?);
    Ok(rows)
}

/// Each mode plain (speculative ones = AR, `ar` taking `ar_secs`), then with its verify
/// forwards replayed from CUDA graphs (= the plain run).
fn mode_rows(
    name: &str,
    lt: &LoadedTarget,
    d: &Drafter,
    req: &Request,
    ar: &Generation,
    ar_secs: f64,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let graphs = DecodeOptions {
        cuda_graphs: true,
        ..Default::default()
    };
    for (mode, drafter) in [
        (Mode::Ar, None),
        (
            Mode::Chain {
                block: d.block_size,
            },
            Some(d),
        ),
        (
            Mode::Tree {
                block: d.block_size,
                budget: 8,
                top_k: 0,
            },
            Some(d),
        ),
    ] {
        let plain = match drafter {
            None => ar.clone(),
            Some(d) => {
                let g = generate(&lt.target, Some(d), mode, req, Default::default(), None)?;
                rows.push(equals_ar_row(name, mode, &g, ar, ar_secs));
                g
            }
        };
        let g = generate(&lt.target, drafter, mode, req, graphs, None)?;
        rows.push(graphs_row(name, mode, &g, &plain));
    }
    Ok(rows)
}

/// A speculative mode's plain run `g` against AR's `ar` (which took `ar_secs`): equal in f32,
/// reported in bf16.
fn equals_ar_row(name: &str, mode: Mode, g: &Generation, ar: &Generation, ar_secs: f64) -> Row {
    let same = g.new_tokens == ar.new_tokens;
    (
        format!("{} = AR on device ({name})", mode.name()),
        same || name == "bf16",
        format!(
            "{}{} rounds; AR {:.2} ms/token",
            if same {
                ""
            } else {
                "differs from AR (bf16 rounds wide and narrow forwards differently; reported); "
            },
            g.rounds.len(),
            ar_secs * 1e3 / ar.new_tokens.len() as f64
        ),
    )
}

/// A mode's run `g` with its verify forwards replayed from CUDA graphs against its `plain` run:
/// equal in f32, reported in bf16.
fn graphs_row(name: &str, mode: Mode, g: &Generation, plain: &Generation) -> Row {
    let ms_per_token = |g: &Generation| g.decode_secs * 1e3 / g.new_tokens.len() as f64;
    let same = g.new_tokens == plain.new_tokens;
    (
        format!("{} with CUDA graphs = without ({name})", mode.name()),
        same || name == "bf16",
        format!(
            "{}{} rounds; {:.2} vs {:.2} ms/token decoding",
            if same {
                ""
            } else {
                "differs (bf16: attention over the fixed capacity rounds differently; reported); "
            },
            g.rounds.len(),
            ms_per_token(g),
            ms_per_token(plain)
        ),
    )
}

/// Batched decoding (data regeneration): three prompts on two slots = AR for each, and its
/// steps replayed from one CUDA graph = eager; at T > 0 (a plain temperature; top-k 20 with
/// top-p): the same draws where the logits are as AR's, seeded per request.
fn batched_rows(name: &str, lt: &LoadedTarget, req: &Request) -> Result<Vec<Row>> {
    let prompt = &req.prompt_ids;
    let mut rows = Vec::new();
    let reqs: Vec<Request> = [&prompt[..], &prompt[..prompt.len() - 3], &prompt[2..]]
        .iter()
        .map(|p| Request {
            prompt_ids: p.to_vec(),
            ..req.clone()
        })
        .collect();
    let eager = batched_tokens(lt, &reqs, false)?;
    let same_ar = equals_ar(lt, &reqs, &eager)?;
    rows.push(equal_row(
        format!("batched decoding (3 prompts, 2 slots) = AR on device ({name})"),
        same_ar,
        name,
    ));
    // a hybrid target's batched steps run without graphs (`Batch::new`)
    if !lt.target.is_hybrid() {
        let graphed = batched_tokens(lt, &reqs, true)?;
        rows.push(equal_row(
            format!("batched decoding with CUDA graphs = without ({name})"),
            graphed == eager,
            name,
        ));
    }
    let sampled: Vec<Request> = reqs
        .iter()
        .enumerate()
        .map(|(i, r)| Request {
            sampling: match i % 2 {
                0 => SamplingParams::new(0.8, 1.0, 0, 7 + i as u64),
                _ => SamplingParams::new(1.0, 0.9, 20, 7 + i as u64),
            }
            .expect("valid sampling parameters"),
            ..r.clone()
        })
        .collect();
    let same_t = equals_ar(lt, &sampled, &batched_tokens(lt, &sampled, false)?)?;
    rows.push(equal_row(
        format!("batched decoding at T > 0 (3 prompts, 2 slots) = AR on device ({name})"),
        same_t,
        name,
    ));
    Ok(rows)
}

/// The speculative batch (three prompts on two slots, every round drafting the chain) gives
/// each request AR's tokens, at T = 0 and seeded at T > 0 (the exact match's draws).
fn spec_batch_rows(name: &str, lt: &LoadedTarget, d: &Drafter, req: &Request) -> Result<Vec<Row>> {
    let p = &req.prompt_ids;
    let mut rows = Vec::new();
    for (i, sampled) in [false, true].into_iter().enumerate() {
        let reqs: Vec<Request> = [&p[..], &p[..p.len() - 3], &p[2..]]
            .iter()
            .enumerate()
            .map(|(j, p)| Request {
                prompt_ids: p.to_vec(),
                sampling: match sampled {
                    false => req.sampling,
                    true => SamplingParams::new(0.8, 0.95, 0, 11 + j as u64)
                        .expect("valid sampling parameters"),
                },
                ..req.clone()
            })
            .collect();
        let chain = Mode::Chain {
            block: d.block_size,
        };
        let gens = dflash_engine::generate_spec_batched(&lt.target, Some(d), chain, &reqs, 2)?;
        let tokens: Vec<Vec<u32>> = gens.into_iter().map(|g| g.new_tokens).collect();
        let what = ["T = 0", "T > 0, seeded"][i];
        rows.push(equal_row(
            format!("speculative batch (3 prompts, 2 slots, {what}) = AR on device ({name})"),
            equals_ar(lt, &reqs, &tokens)?,
            name,
        ));
    }
    Ok(rows)
}

/// Training-path vs inference-path drafter logits on `prompt`: ≤ 1e-4 in f32, reported in
/// bf16.
fn parity_row(name: &str, lt: &LoadedTarget, d: &Drafter, prompt: &[u32]) -> Result<Row> {
    let p = dflash_eval::doctor::parity_diff(lt, d, prompt)?;
    let agree = p.agreement_text();
    Ok(if name == "f32" {
        (
            format!("train/infer parity ({name})"),
            p.max_abs <= 1e-4,
            format!("max |Δ logits| {:.1e} (≤ 1e-4); {agree}", p.max_abs),
        )
    } else {
        (
            format!("train/infer parity ({name})"),
            true,
            format!("max |Δ logits| {:.1e}, {agree} (reported)", p.max_abs),
        )
    })
}

/// The checks' draft vocabulary: every other token, and the prompt's (the anchors' tokens are
/// drafted from).
fn check_vocab(lt: &LoadedTarget, req: &Request) -> DraftVocab {
    let mut ids: Vec<u32> = (0..lt.target.vocab_size() as u32).step_by(2).collect();
    ids.extend(&req.prompt_ids);
    ids.sort_unstable();
    ids.dedup();
    DraftVocab {
        token_ids: ids,
        source: "check device: every other token".into(),
        coverage: None,
    }
}

/// Graphs kept from one generation to the next (`generate` with a `GraphCache`, as `eval` and
/// `bench decode` run them) decode what fresh graphs decode: three prompts in turn, the drafter drafting from
/// a vocabulary subset (its head's weights made anew by each generation, while the kept draft
/// graph reads the ones it was captured with), DFlash and DDTree-8.
fn kept_graphs_row(
    lt: &LoadedTarget,
    drafter_dir: &Option<PathBuf>,
    req: &Request,
    name: &str,
) -> Result<(String, bool, String)> {
    let mut d = drafter_for(lt, drafter_dir)?;
    d.draft_vocab = Some(check_vocab(lt, req));
    let opts = DecodeOptions {
        cuda_graphs: true,
        ..Default::default()
    };
    let p = &req.prompt_ids;
    let prompts = [&p[..], &p[..p.len() / 2], &p[1..]];
    let (mut same, mut gens) = (true, 0);
    for mode in [
        Mode::Chain {
            block: d.block_size,
        },
        Mode::Tree {
            block: d.block_size,
            budget: 8,
            top_k: 0,
        },
    ] {
        let mut kept = GraphCache::default();
        for prompt in prompts {
            let r = Request {
                prompt_ids: prompt.to_vec(),
                ..req.clone()
            };
            let fresh = generate(&lt.target, Some(&d), mode, &r, opts, None)?;
            let k = generate(&lt.target, Some(&d), mode, &r, opts, Some(&mut kept))?;
            same &= k.new_tokens == fresh.new_tokens;
            gens += 1;
        }
    }
    Ok((
        format!("CUDA graphs kept across generations = fresh ones ({name})"),
        same || name == "bf16",
        format!(
            "{gens} generations, a draft vocabulary{}",
            if same {
                ""
            } else {
                "; differs (bf16: kept caches are larger, a tree's mask spans them; reported)"
            }
        ),
    ))
}

/// A DFlash chain (`tree` false) or a DDTree-8 at T = 1 (seed 7) in f32 on the device and on
/// the CPU: the same tokens, with the drafter as given and with a draft vocabulary (every other
/// token and the prompt's). Both keep their rounds on their device — the chain's draws and
/// verdicts ([`dflash_model::ops::sample_rows`]), the tree's draws and walk
/// ([`dflash_model::ops::sampled_tree`]), and their CPU twins — and draw the same uniform
/// numbers; only a draw within rounding of a boundary between two tokens could differ.
fn sampled_row(
    gpu: &LoadedTarget,
    cpu: &LoadedTarget,
    drafter_dir: &Option<PathBuf>,
    req: &Request,
    tree: bool,
) -> Result<(String, bool, String)> {
    let req = Request {
        sampling: SamplingParams::new(1.0, 1.0, 0, 7)?,
        ..req.clone()
    };
    let (mut same, mut tokens, mut rounds, mut name) = (true, 0, 0, String::new());
    for head in [false, true] {
        let run = |lt: &LoadedTarget| -> Result<(Generation, Mode)> {
            let mut d = drafter_for(lt, drafter_dir)?;
            if head {
                d.draft_vocab = Some(check_vocab(lt, &req));
            }
            let mode = match tree {
                false => Mode::Chain {
                    block: d.block_size,
                },
                true => Mode::Tree {
                    block: d.block_size,
                    budget: 8,
                    top_k: 0,
                },
            };
            Ok((
                generate(&lt.target, Some(&d), mode, &req, Default::default(), None)?,
                mode,
            ))
        };
        let ((g, mode), (c, _)) = (run(gpu)?, run(cpu)?);
        same &= g.new_tokens == c.new_tokens;
        tokens += g.new_tokens.len();
        rounds += g.rounds.len();
        name = mode.name();
    }
    Ok((
        format!("{name} at T = 1 on device = on CPU (f32, same seed)"),
        same,
        format!("{tokens} tokens in {rounds} rounds, with and without a draft vocabulary"),
    ))
}

/// A row that two runs gave the same tokens: a failure in f32, reported in bf16 (where a
/// near-tie of the logits may round either way).
fn equal_row(what: String, same: bool, dtype: &str) -> (String, bool, String) {
    let detail = if same {
        "equal"
    } else {
        "differs (bf16; reported)"
    };
    (what, same || dtype == "bf16", detail.into())
}

/// Each request's new tokens from one batched run on 2 slots (its steps replayed from one CUDA
/// graph with `cuda_graphs`).
fn batched_tokens(lt: &LoadedTarget, reqs: &[Request], cuda_graphs: bool) -> Result<Vec<Vec<u32>>> {
    let mut out = vec![Vec::new(); reqs.len()];
    let opts = dflash_engine::batched::BatchedOptions {
        cuda_graphs,
        ..Default::default()
    };
    dflash_engine::batched::generate_batched(&lt.target, reqs, 2, opts, |i, r| {
        out[i] = r?.new_tokens;
        Ok(dflash_engine::batched::Flow::Continue)
    })?;
    Ok(out)
}

/// Whether each request's `tokens` are the ones AR gives it alone.
fn equals_ar(lt: &LoadedTarget, reqs: &[Request], tokens: &[Vec<u32>]) -> Result<bool> {
    for (r, t) in reqs.iter().zip(tokens) {
        if generate(&lt.target, None, Mode::Ar, r, Default::default(), None)?.new_tokens != *t {
            return Ok(false);
        }
    }
    Ok(true)
}
