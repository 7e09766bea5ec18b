//! `dflash-rs bench regen`: data regeneration's decoding on a target shape with random weights
//! — `--slots` sequences decoded together by [`dflash_engine::batched::generate_batched`] (the
//! engine `data generate` runs), each from a prompt of `--prompt-tokens` to exactly
//! `--max-new-tokens` (no stop token), greedy. Prints the generated tokens per second and the
//! time per batched step; `bench/regen_reference.py` times HF transformers' `generate` on the
//! same shape and batch.

use std::time::Instant;

use anyhow::Result;
use clap::Args;
use dflash_core::config::TargetConfig;
use dflash_core::sampling::SamplingParams;
use dflash_engine::batched::{generate_batched, BatchedOptions, Flow};
use dflash_engine::Request;

use crate::bench_shape::{bench_tokens, random_target, ShapeArgs};

#[derive(Args, Debug)]
pub struct BenchRegenArgs {
    #[command(flatten)]
    pub model: ShapeArgs,
    /// Sequences decoded together (one batched forward per step).
    #[arg(long, default_value_t = 256)]
    pub slots: usize,
    /// Prompts in all (each a fresh sequence); default: as many as slots.
    #[arg(long)]
    pub requests: Option<usize>,
    /// Prompt length (the longest, with `--prompt-tokens-min`).
    #[arg(long, default_value_t = 256)]
    pub prompt_tokens: usize,
    /// Spread the prompt lengths over `MIN ..= --prompt-tokens` (prompt i: `MIN + 7919 i mod
    /// (span + 1)`, the same in `bench/regen_reference.py`), as real prompts are.
    #[arg(long)]
    pub prompt_tokens_min: Option<usize>,
    /// Tokens generated per prompt (no stop token ends a sequence earlier).
    #[arg(long, alias = "new-tokens", default_value_t = 512)]
    pub max_new_tokens: usize,
    /// Replay each batched step from a CUDA graph (`data generate --cuda-graphs`).
    #[arg(long)]
    pub cuda_graphs: bool,
    /// Prompts prefilled in one forward on a GPU (the engine's 16 by default).
    #[arg(long)]
    pub prefill_prompts: Option<usize>,
    /// Untimed runs first (kernel compilation, allocator warm-up).
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Also write the figures as one JSON row to this file, for `docs/bench/`.
    #[arg(long)]
    pub output_json: Option<std::path::PathBuf>,
    /// Only run, N times each inside a profiler range, one batched step of `--slots` rows
    /// replayed from a CUDA graph (every sequence holding `--prompt-tokens` rows) and one
    /// eager prefill of 16 prompts of `--prompt-tokens` tokens, and exit (GPU): what a kernel
    /// profiler reads (`ncu --profile-from-start off --graph-profiling node`,
    /// `bench/kernel_profile.py`). Prints each one's kernel count.
    #[arg(long, default_value_t = 0)]
    pub profile_replays: usize,
}

/// Prompts per prefill forward of the batched engine (`dflash_engine::batched`).
const PREFILL_PROMPTS: usize = 16;

/// `--profile-replays`: a batched step captured and replayed, then an eager prefill, `reps`
/// times each inside a profiler range (see the flag).
fn profile_replays(
    target: &dflash_model::Target,
    slots: usize,
    prompt: usize,
    reps: usize,
) -> Result<()> {
    use dflash_model::cuda::launch_profile::{count_launches, profiled_range, warm_capture};
    use dflash_model::Rows;
    let dev = target.device.clone();
    let vocab = target.vocab_size();
    // the step: `slots` sequences of `prompt` rows each, one new row each, in a cache of fixed
    // capacity (its values do not matter to the timing)
    let cap = prompt + 8;
    let mut cache = target.new_cache();
    cache.reserve_exact(cap)?;
    cache.commit(prompt);
    let tokens = bench_tokens(slots, vocab);
    let rows = vec![vec![0..prompt + 1]; slots];
    let inputs =
        target.prepare_intervals(&tokens, &vec![prompt; slots], &rows, prompt, Some(cap))?;
    let (graph, _) = warm_capture(&dev, &mut cache, prompt, |c| {
        target.forward_prepared(&inputs, c, &[], &Rows::All)
    })?;
    // the prefill: PREFILL_PROMPTS prompts of `prompt` tokens, causal, eager (as the engine)
    let n = PREFILL_PROMPTS.min(slots);
    let ptoks = bench_tokens(n * prompt, vocab);
    let ppos: Vec<usize> = (0..n).flat_map(|_| 0..prompt).collect();
    let prows: Vec<Vec<std::ops::Range<usize>>> = (0..n)
        .map(|_| (0..prompt).map(|r| 0..r + 1).collect())
        .collect();
    let prefill = || -> Result<()> {
        let mut c = target.new_cache();
        target.forward_batch_intervals(&ptoks, &ppos, &prows, &mut c, &[], &Rows::None)?;
        Ok(())
    };
    prefill()?;
    let prefill_kernels = count_launches(&dev, || {
        let mut c = target.new_cache();
        target.forward_batch_intervals(&ptoks, &ppos, &prows, &mut c, &[], &Rows::None)
    })?
    .kernels;
    dev.synchronize()?;
    println!(
        "profile replays ({reps} each, in this order): batched step ({slots} rows) {} kernels, prefill ({n} × {prompt} rows) {prefill_kernels} kernels",
        graph.nodes.kernels
    );
    profiled_range(&dev, || {
        for _ in 0..reps {
            graph.replay()?;
        }
        dev.synchronize()?;
        for _ in 0..reps {
            prefill()?;
        }
        Ok(())
    })
}

pub fn run(a: BenchRegenArgs) -> Result<()> {
    let (dev, dtype, cfg) = a.model.parse()?;
    let (requests, min) = checked(&a, &cfg, &dev)?;
    let (target, _) = random_target(&a.model.shape, &cfg, dtype, &dev, 1, 16)?;
    if a.profile_replays > 0 {
        return profile_replays(&target, a.slots, a.prompt_tokens, a.profile_replays);
    }
    let reqs = bench_requests(&a, requests, min, target.vocab_size());
    let run = || -> Result<(f64, usize)> {
        let t0 = Instant::now();
        let mut tokens = 0;
        let opts = BatchedOptions {
            cuda_graphs: a.cuda_graphs,
            prefill_prompts: a.prefill_prompts,
            ..Default::default()
        };
        generate_batched(&target, &reqs, a.slots, opts, |_, r| {
            tokens += r?.new_tokens.len();
            Ok(Flow::Continue)
        })?;
        dev.synchronize()?;
        Ok((t0.elapsed().as_secs_f64(), tokens))
    };
    for _ in 0..a.warmup {
        run()?;
    }
    let _ = dflash_model::profile::report();
    let (secs, tokens) = run()?;
    report(&a, requests, min, (secs, tokens), target.slot_state_bytes())
}

/// The flags checked against each other and the shape's context: `(requests, shortest
/// prompt)`.
fn checked(
    a: &BenchRegenArgs,
    cfg: &TargetConfig,
    dev: &candle_core::Device,
) -> Result<(usize, usize)> {
    let requests = a.requests.unwrap_or(a.slots);
    if a.slots == 0 || requests == 0 || a.prompt_tokens == 0 || a.max_new_tokens == 0 {
        anyhow::bail!("--slots, --requests, --prompt-tokens and --max-new-tokens must be >= 1");
    }
    if a.prefill_prompts == Some(0) {
        anyhow::bail!("--prefill-prompts must be >= 1");
    }
    if a.prompt_tokens + a.max_new_tokens > cfg.max_position_embeddings {
        anyhow::bail!(
            "--prompt-tokens + --max-new-tokens = {} exceeds the shape's context ({})",
            a.prompt_tokens + a.max_new_tokens,
            cfg.max_position_embeddings
        );
    }
    if a.profile_replays > 0 && dev.is_cpu() {
        anyhow::bail!("--profile-replays needs a CUDA device: it captures a CUDA graph");
    }
    let min = a.prompt_tokens_min.unwrap_or(a.prompt_tokens);
    if min == 0 || min > a.prompt_tokens {
        anyhow::bail!("--prompt-tokens-min must be in 1..=--prompt-tokens");
    }
    Ok((requests, min))
}

/// The `requests` prompts of fixed pseudo-random ids, of lengths spread over `min ..=
/// --prompt-tokens`, each decoded greedily to exactly `--max-new-tokens`.
fn bench_requests(a: &BenchRegenArgs, requests: usize, min: usize, vocab: usize) -> Vec<Request> {
    let base = bench_tokens(a.prompt_tokens + requests, vocab);
    let len = |i: usize| min + (7919 * i) % (a.prompt_tokens - min + 1);
    (0..requests)
        .map(|i| Request {
            prompt_ids: base[i..i + len(i)].to_vec(),
            max_new_tokens: a.max_new_tokens,
            sampling: SamplingParams::default(), // greedy
            stop_ids: vec![],
            loop_window: 0,
        })
        .collect()
}

/// The table row (and the `--output-json` row) of a timed run: `tokens` generated in `secs`; a hybrid
/// target's slots each hold `state_bytes` of linear-attention state beside their K/V rows.
fn report(
    a: &BenchRegenArgs,
    requests: usize,
    min: usize,
    (secs, tokens): (f64, usize),
    state_bytes: usize,
) -> Result<()> {
    let steps = requests.div_ceil(a.slots) * a.max_new_tokens;
    let tok_s = tokens as f64 / secs;
    println!(
        "| shape | slots | requests | prompt | new | seconds | tokens/s | ms per step (incl. prefill) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let prompt = match a.prompt_tokens_min {
        Some(m) if m < a.prompt_tokens => format!("{m}–{}", a.prompt_tokens),
        _ => a.prompt_tokens.to_string(),
    };
    println!(
        "| {} | {} | {requests} | {prompt} | {} | {secs:.2} | {tok_s:.0} | {:.2} |",
        a.model.shape,
        a.slots,
        a.max_new_tokens,
        1e3 * secs / steps as f64
    );
    if state_bytes > 0 {
        println!(
            "linear-attention state per slot: {:.1} KiB ({} slots: {:.2} GiB)",
            state_bytes as f64 / 1024.0,
            a.slots,
            (state_bytes * a.slots) as f64 / (1 << 30) as f64
        );
    }
    dflash_model::profile::print_report("bench regen");
    if let Some(path) = &a.output_json {
        let row = serde_json::json!({
            "shape": a.model.shape,
            "impl": "dflash-rs",
            "batch": a.slots,
            "requests": requests,
            "prompt_tokens": a.prompt_tokens,
            "prompt_tokens_min": min,
            "new_tokens": a.max_new_tokens,
            "seconds": secs,
            "new_tok_s": tok_s,
            "ms_per_step": 1e3 * secs / steps as f64,
            "cuda_graphs": a.cuda_graphs,
            "slot_state_bytes": state_bytes,
            "device": a.model.run_on.device,
            "dtype": a.model.run_on.dtype,
        });
        dflash_model::io::atomic::write_file(path, format!("{row}\n").as_bytes())?;
    }
    Ok(())
}
