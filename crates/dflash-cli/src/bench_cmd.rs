//! `dflash-rs bench decode`: time per output token per mode, the round's time split, and one target
//! forward against its physical floor (weight bytes / measured memory bandwidth). With
//! `--shape`, the same decoding loop on random weights of any shape (e.g. the 64-layer
//! Qwen3.6-27B hybrid): fixed pseudo-random prompts, a seeded random drafter, and each mode's
//! tokens compared with AR's (a random drafter accepts almost nothing, so the rows measure the
//! loop's costs, not a speed-up).

use crate::args::{DeviceArgs, SamplingArgs};
use crate::bench_shape::{bench_tokens, random_target, shape_config};
use crate::timing::{median, read_bandwidth, resident_memory, time};

use anyhow::{Context, Result};
use candle_core::DType;
use clap::Args;
use dflash_core::sampling::SamplingParams;
use dflash_core::stats::{decode_secs_per_token, summarize, RoundOutcome};
use dflash_engine::{generate, DecodeOptions, GraphCache, ModeName, Request};
use dflash_eval::harness::{mode_specs, EvalDrafter, ModeSpec};
use dflash_model::io::loader::load_target;
use dflash_model::io::weights::TensorStore;
use dflash_model::models::drafter::Drafter;
use dflash_model::{Rows, Target};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[arg(long, default_value = "smollm2-135m")]
    pub target: String,
    /// Decode on random weights of this shape instead of `--target`: `qwen3-8b` or a
    /// config.json of any supported family (prompts of `--prompt-tokens` fixed pseudo-random
    /// ids; the default drafter is a seeded random one of the shape's width).
    #[arg(long)]
    pub shape: Option<String>,
    /// With `--shape`: the length of each of the four prompts.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// A drafter directory (default for speculative modes: a seeded random 5-layer drafter).
    #[arg(long)]
    pub drafter: Option<std::path::PathBuf>,
    /// Comma-separated: ar, dflash, ddtree:N.
    #[arg(long, value_delimiter = ',', default_value = "ar,dflash,ddtree:8")]
    pub modes: Vec<ModeName>,
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Replay the verify forwards and the draft block from CUDA graphs (see `generate
    /// --cuda-graphs`), each mode's graphs kept from one prompt to the next; the rows are
    /// marked "+graphs".
    #[arg(long)]
    pub cuda_graphs: bool,
    /// Also write one JSON row per mode to this file, for `docs/bench/` (`shape`, `impl`,
    /// `mode`, `graphs`, `dtype`, `ms_per_token`, `tau_pooled`, the round's `draft_ms`,
    /// `verify_ms`, `other_ms`, `temperature`, `acceptance`, and `equal_to_ar`: the prompts whose tokens
    /// equal AR's, at T = 0; `null` at T > 0).
    #[arg(long)]
    pub output_json: Option<std::path::PathBuf>,
    /// The target's sampling rule (greedy by default). At T > 0 each mode's tokens are its own
    /// draws (the `= AR` column compares them only at T = 0) and a round samples where
    /// `generate`'s does: on the device under every rule, for AR, chains, the target's draws of
    /// a tree under the exact match and the residual rule's sampled DDTree trees.
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// How drafts are accepted at T > 0 (`generate --acceptance`): residual or exact-match.
    #[arg(long, default_value = "residual")]
    pub acceptance: dflash_engine::Acceptance,
    #[command(flatten)]
    pub run_on: DeviceArgs,
    #[command(flatten)]
    pub draft: crate::args::DraftProducts,
}

const PROMPTS: &[&str] = &[
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that checks whether a number is prime.",
    "What are three tips for staying focused while studying?",
    "Summarise the plot of Romeo and Juliet.",
];

/// What is decoded: the target, the drafter and the prompts' ids.
struct Subject {
    name: String,
    target: Target,
    drafter: Drafter,
    prompts: Vec<Vec<u32>>,
}

/// `--target` (a real model, the chat prompts above) or `--shape` (random weights, prompts of
/// pseudo-random ids: prompt i is ids `i·len .. (i+1)·len` of [`bench_tokens`]).
fn subject(a: &BenchArgs, dtype: DType, dev: &candle_core::Device) -> Result<Subject> {
    let Some(shape) = &a.shape else {
        let lt = load_target(&a.target, dtype, dev)?;
        eprintln!("{lt}");
        let q8 = a.draft.draft_products == "q8";
        let drafter = match &a.drafter {
            Some(d) => a.draft.load(d, &lt.target)?,
            None => dflash_model::cpu::q8::with_choice(q8, || {
                dflash_model::models::drafter_init::random_drafter(&lt, 5, 16, None, 0)
            })?,
        };
        let prompts = PROMPTS
            .iter()
            .map(|p| lt.tokenizer.prompt_ids(p, true))
            .collect::<Result<_>>()?;
        return Ok(Subject {
            name: a.target.clone(),
            target: lt.target,
            drafter,
            prompts,
        });
    };
    if a.prompt_tokens == 0 {
        anyhow::bail!("--prompt-tokens must be >= 1");
    }
    let cfg = shape_config(shape)?;
    let (target, dcfg) = random_target(shape, &cfg, dtype, dev, 5, 16)?;
    let drafter = match &a.drafter {
        Some(d) => a.draft.load(d, &target)?,
        None => dflash_model::cpu::q8::with_choice(a.draft.draft_products == "q8", || {
            Drafter::load(dcfg, &TensorStore::random(dtype, dev, 1)?, &target)
        })
        .context("a random drafter for the shape")?,
    };
    let n = a.prompt_tokens;
    let ids = bench_tokens(n * PROMPTS.len(), target.vocab_size());
    let name = std::path::Path::new(shape)
        .file_stem()
        .map_or(shape.clone(), |s| s.to_string_lossy().into_owned());
    Ok(Subject {
        name,
        target,
        drafter,
        prompts: ids.chunks(n).map(<[u32]>::to_vec).collect(),
    })
}

pub fn run(a: BenchArgs) -> Result<()> {
    let sampling = a.sampling.params()?;
    let (dtype, dev) = a.run_on.parse()?;
    crate::args::note_cuda_graphs(a.cuda_graphs, &dev);
    let Subject {
        name,
        target,
        drafter,
        prompts,
    } = subject(&a, dtype, &dev)?;
    let drafters = vec![EvalDrafter {
        label: "d".into(),
        drafter,
    }];
    let specs = mode_specs(&a.modes, &drafters, None)?;
    let loaded = resident_memory();
    print_header(&a, &name, prompts.len(), &sampling);
    let mut json_rows = Vec::new();
    // AR's tokens per prompt (the first spec is AR): what every mode's output is compared with
    let mut ar_tokens: Option<Vec<Vec<u32>>> = None;
    // with DFLASH_PROFILE set: the time per phase of each mode's decoding, then of one forward
    // of 1 and of 16 rows (to stderr)
    let _ = dflash_model::profile::report();
    for spec in &specs {
        let d = spec.drafter.map(|i| &drafters[i].drafter);
        let timed = decode_mode(&a, &target, d, spec, &prompts, sampling, &dev)?;
        let ar = ar_tokens.get_or_insert_with(|| timed.tokens.clone());
        // at T > 0 a mode's draws are its own: only greedy decoding must equal AR's tokens
        let equal = sampling.is_greedy().then(|| {
            let n = timed
                .tokens
                .iter()
                .zip(ar.iter())
                .filter(|(x, y)| x == y)
                .count();
            format!("{n}/{}", timed.tokens.len())
        });
        json_rows.push(mode_row(&a, &name, &spec.label, timed, equal, &sampling));
        dflash_model::profile::print_report(&format!("{} decoding", spec.label));
    }
    if let Some(path) = &a.output_json {
        let text: String = json_rows.iter().map(|r| format!("{r}\n")).collect();
        dflash_model::io::atomic::write_file(path, text.as_bytes())
            .with_context(|| format!("--json {}", path.display()))?;
    }
    print_memory(loaded, &target);
    forward_against_floor(&target, dtype, &dev)
}

/// The run's first line (target, device, sampling rule) and the table's header.
fn print_header(a: &BenchArgs, name: &str, prompts: usize, sampling: &SamplingParams) {
    let rule = if sampling.is_greedy() {
        "greedy".to_string()
    } else {
        format!(
            "T = {}, top-p {}, top-k {}, seed {}, {} acceptance",
            sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed, a.acceptance
        )
    };
    println!(
        "target {name} on {} ({}), {} new tokens × {} prompts, {rule}, median of {}",
        a.run_on.device, a.run_on.dtype, a.max_new_tokens, prompts, a.repeats
    );
    println!("| mode | ms / output token | tok/s | τ pooled | draft ms/round | verify ms/round | other ms/round | = AR |");
    println!("|---|---|---|---|---|---|---|---|");
}

/// One mode's timed decoding: the median over the repeats of the mean time per output token
/// over the prompts, and the last repeat's rounds and tokens per prompt.
struct ModeTimes {
    tpot: f64,
    rounds: Vec<Vec<RoundOutcome>>,
    tokens: Vec<Vec<u32>>,
}

/// Every prompt decoded `--repeats` + 1 times in `spec`'s mode (the first: the warm-up), the
/// mode's fixed-shape forwards (CUDA graphs) kept across its generations, as eval does.
fn decode_mode(
    a: &BenchArgs,
    target: &Target,
    d: Option<&Drafter>,
    spec: &ModeSpec,
    prompts: &[Vec<u32>],
    sampling: SamplingParams,
    dev: &candle_core::Device,
) -> Result<ModeTimes> {
    let opts = DecodeOptions {
        cuda_graphs: a.cuda_graphs,
        acceptance: a.acceptance,
        ..Default::default()
    };
    let mut tpot = Vec::new();
    let mut last = None;
    let mut graphs = GraphCache::default();
    for rep in 0..=a.repeats {
        let (mut tpots, mut rounds, mut tokens) = (Vec::new(), Vec::new(), Vec::new());
        for ids in prompts {
            let req = Request {
                prompt_ids: ids.clone(),
                max_new_tokens: a.max_new_tokens,
                sampling,
                stop_ids: vec![],
                loop_window: 0,
            };
            dev.synchronize()?;
            let g = generate(target, d, spec.mode, &req, opts, Some(&mut graphs))?;
            dev.synchronize()?;
            tpots.push(decode_secs_per_token(g.decode_secs, g.new_tokens.len()));
            rounds.push(g.rounds);
            tokens.push(g.new_tokens);
        }
        if rep > 0 {
            // mean over the prompts; rep 0 is the warm-up (PTX JIT, allocations)
            tpot.push(tpots.iter().sum::<f64>() / tpots.len() as f64);
            last = Some((rounds, tokens));
        }
    }
    let (rounds, tokens) = last.context("no timed repeat")?;
    Ok(ModeTimes {
        tpot: median(tpot),
        rounds,
        tokens,
    })
}

/// The mode's table row (printed) and its `--output-json` row; `equal`: the prompts whose tokens
/// equal AR's (`None` at T > 0).
fn mode_row(
    a: &BenchArgs,
    name: &str,
    label: &str,
    timed: ModeTimes,
    equal: Option<String>,
    sampling: &SamplingParams,
) -> serde_json::Value {
    let cuda_graphs = a.cuda_graphs;
    let r = timed.rounds;
    let s = summarize(&r.iter().map(|x| x.as_slice()).collect::<Vec<_>>());
    let per = |x: f64| x * 1e3 / s.rounds.max(1) as f64;
    let t = timed.tpot;
    println!(
        "| {}{} | {:.2} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} | {} |",
        label,
        if cuda_graphs { "+graphs" } else { "" },
        t * 1e3,
        1.0 / t,
        s.tau_pooled,
        per(s.draft_secs),
        per(s.verify_secs),
        per(s.other_secs),
        equal.as_deref().unwrap_or("T > 0")
    );
    serde_json::json!({
        "shape": name,
        "impl": "dflash-rs",
        "mode": label,
        "graphs": cuda_graphs,
        "dtype": a.run_on.dtype,
        "device": a.run_on.device,
        "new_tokens": a.max_new_tokens,
        "ms_per_token": t * 1e3,
        "tau_pooled": s.tau_pooled,
        "draft_ms": per(s.draft_secs),
        "verify_ms": per(s.verify_secs),
        "other_ms": per(s.other_secs),
        "temperature": sampling.temperature,
        "acceptance": a.acceptance,
        "equal_to_ar": equal,
    })
}

/// Resident memory before the floor's buffers: the weights, caches and decoding's.
fn print_memory(loaded: Option<(u64, u64)>, target: &Target) {
    if let (Some((after_load, _)), Some((now, peak))) = (loaded, resident_memory()) {
        let mb = |b: u64| b as f64 / 1e6;
        println!(
            "\nresident memory: {:.1} MB after loading, {:.1} MB after decoding, peak (VmHWM) {:.1} MB; the target's weights hold {:.1} MB",
            mb(after_load),
            mb(now),
            mb(peak),
            mb(target.weight_bytes_held() as u64)
        );
    }
}

/// One target forward of 1 and of 16 rows on a warm cache of 512 rows (fewer when the context
/// is shorter), against the floor (weight bytes read / measured read bandwidth).
fn forward_against_floor(target: &Target, dtype: DType, dev: &candle_core::Device) -> Result<()> {
    let t = target;
    let warm = 512
        .min(t.config.max_position_embeddings.saturating_sub(16))
        .max(1);
    let ctx = bench_tokens(warm, t.vocab_size());
    let mut cache = t.new_cache();
    t.forward_causal(&ctx, &mut cache, &[], &Rows::None)?;
    let mut rows = Vec::new();
    for n in [1usize, 16] {
        let _ = dflash_model::profile::report();
        let toks = bench_tokens(n, t.vocab_size());
        let secs = time(dev, 10, || {
            let o = t.forward_causal(&toks, &mut cache, &[], &Rows::All)?;
            let _ = o
                .logits
                .unwrap()
                .to_dtype(DType::F32)?
                .sum_all()?
                .to_scalar::<f32>()?;
            cache.truncate(warm)?;
            Ok(())
        })?;
        rows.push((n, secs));
        dflash_model::profile::print_report(&format!(
            "{n}-row forward on a {warm}-row cache (11 runs)"
        ));
    }
    let bw = read_bandwidth(dev)?;
    // the bytes a forward reads (quantized CPU panels at their block size)
    let weight_bytes = target.weight_bytes_read();
    let floor = weight_bytes as f64 / bw;
    println!("\nmeasured read bandwidth {:.1} GB/s; weights read per forward {:.1} MB ({:?}{}) → read floor {:.3} ms per forward", bw / 1e9, weight_bytes as f64 / 1e6, dtype, if target.quantized_projections() > 0 { ", GGUF blocks streamed" } else { "" }, floor * 1e3);
    if dflash_model::profile::requested() {
        let by: Vec<String> = t
            .bytes_read_by_format()
            .iter()
            .map(|(f, b)| format!("{f} {:.1} MB", *b as f64 / 1e6))
            .collect();
        println!("weights read per forward by format: {}", by.join(", "));
    }
    for (n, s) in rows {
        println!(
            "one target forward, {n:>2} new row(s) on a {warm}-row cache: {:.3} ms ({:.1}× the floor)",
            s * 1e3,
            s / floor
        );
    }
    Ok(())
}
