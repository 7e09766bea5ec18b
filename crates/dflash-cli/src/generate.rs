//! `dflash-rs generate`: one prompt, AR or DFlash, text or JSON out.

use crate::args::{DeviceArgs, SamplingArgs};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use dflash_core::stats::summarize;
use dflash_engine::{generate, Acceptance, DecodeOptions, Mode, ModeName, Request};
use dflash_model::io::loader::load_target;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Target model: a GGUF file, an HF directory, or an alias (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b).
    #[arg(long, default_value = "smollm2-135m")]
    pub target: String,
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt as a user turn in the target's chat template.
    #[arg(long)]
    pub chat: bool,
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Decoding mode: ar, dflash, ddtree:N (N = the tree's node budget) or auto (each round
    /// the budget, from an AR step to a tree of the block's drafts, with the most expected
    /// tokens for its measured cost; auto:N caps the tree at N nodes); the speculative modes
    /// use --drafter, or the drafter that ships for the target [default: auto where a drafter
    /// is given or ships for the target, else ar].
    #[arg(long)]
    pub mode: Option<ModeName>,
    /// A z-lab-format drafter directory (config.json + model.safetensors).
    #[arg(long)]
    pub drafter: Option<PathBuf>,
    /// Block size for DFlash/DDTree (default: the drafter's).
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Also decode with AR and report the speed-up over it (decode time per token) and, at
    /// T = 0, whether the output is the same.
    #[arg(long)]
    pub compare_ar: bool,
    /// Replay the verify forwards and the draft block from CUDA graphs (fixed-shape caches of
    /// prompt + max-new-tokens rows and one forward's). Also for the AR of --compare-ar.
    #[arg(long)]
    pub cuda_graphs: bool,
    /// How drafts are accepted at T > 0: residual (a chain's drafts sampled from the
    /// drafter, kept with probability min(1, p/q), the bonus from the residual; a DDTree's
    /// tokens drawn without replacement, each node's children judged in turn against the
    /// residual) or exact-match (greedy drafts, a tree of the top-K, kept while they equal the
    /// target's sample). Both are lossless.
    #[arg(long, default_value = "residual")]
    pub acceptance: Acceptance,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub run_on: DeviceArgs,
    #[command(flatten)]
    pub draft: crate::args::DraftProducts,
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let sampling = a.sampling.params()?;
    let (mode, drafter_dir) =
        crate::args::resolve_drafter(&a.target, a.drafter.as_deref(), a.mode)?;
    if mode.is_speculative() && matches!(a.block_size, Some(0) | Some(1)) {
        bail!("--block-size must be >= 2 for speculative modes");
    }
    let (dtype, device) = a.run_on.parse()?;
    crate::args::note_cuda_graphs(a.cuda_graphs, &device);
    let loaded = load_target(&a.target, dtype, &device)?;
    eprintln!("{loaded}");
    let drafter = match &drafter_dir {
        Some(dir) if mode.is_speculative() => Some(a.draft.load_noted(dir, &loaded.target)?),
        _ => None,
    };
    let block = a
        .block_size
        .unwrap_or_else(|| drafter.as_ref().map(|d| d.block_size).unwrap_or(1));
    let engine_mode = mode.with_block(block);
    let prompt_ids = loaded.tokenizer.prompt_ids(&a.prompt, a.chat)?;
    let req = Request {
        prompt_ids: prompt_ids.clone(),
        max_new_tokens: a.max_new_tokens,
        sampling,
        stop_ids: loaded.tokenizer.stop_ids.clone(),
        loop_window: 0,
    };
    let t = Instant::now();
    let opts = DecodeOptions {
        cuda_graphs: a.cuda_graphs,
        acceptance: a.acceptance,
        ..Default::default()
    };
    let g = generate(
        &loaded.target,
        drafter.as_ref(),
        engine_mode,
        &req,
        opts,
        None,
    )?;
    let seconds = t.elapsed().as_secs_f64();
    let text = loaded.tokenizer.decode(&g.new_tokens)?;
    // the AR baseline: the same request, the same loop with block 1
    let vs_ar = if a.compare_ar && mode.is_speculative() {
        let ar = generate(&loaded.target, None, Mode::Ar, &req, opts, None)?;
        let per_token = |x: &dflash_engine::Generation| {
            dflash_core::stats::decode_secs_per_token(x.decode_secs, x.new_tokens.len())
        };
        Some((
            per_token(&ar) / per_token(&g),
            (req.sampling.is_greedy()).then_some(ar.new_tokens == g.new_tokens),
        ))
    } else {
        None
    };
    let out = Outcome {
        g: &g,
        text: &text,
        prompt_tokens: prompt_ids.len(),
        seconds,
        mode,
        block,
        vs_ar,
    };
    match a.json {
        true => println!("{}", serde_json::to_string(&out.json())?),
        false => out.print(),
    }
    Ok(())
}

/// What `generate` prints: the generation and how it was run.
struct Outcome<'a> {
    g: &'a dflash_engine::Generation,
    text: &'a str,
    prompt_tokens: usize,
    seconds: f64,
    mode: ModeName,
    block: usize,
    /// The speed-up over AR and, at T = 0, whether the output equals AR's.
    vs_ar: Option<(f64, Option<bool>)>,
}

impl Outcome<'_> {
    /// `--json`: one object.
    fn json(&self) -> serde_json::Value {
        let (g, seconds) = (self.g, self.seconds);
        let stats = summarize(&[&g.rounds]);
        serde_json::json!({
            "text": self.text,
            "token_ids": g.new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": g.new_tokens.len(),
            "seconds": seconds,
            "prefill_seconds": g.prefill_secs,
            "decode_seconds": g.decode_secs,
            "tokens_per_second": g.new_tokens.len() as f64 / seconds,
            "mode": self.mode.with_block(self.block).name(),
            "block_size": self.block,
            "budget": match self.mode {
                ModeName::Ddtree(n) => Some(n),
                _ => None,
            },
            "auto": g.auto,
            "stopped_by_token": g.stopped_by_token,
            "speedup_vs_ar": self.vs_ar.map(|v| v.0),
            "equals_ar": self.vs_ar.and_then(|v| v.1),
            "stats": {
                "tau_pooled": stats.tau_pooled,
                "tau_mean_of_means": stats.tau_mean_of_means,
                "rounds": stats.rounds,
                "committed": stats.committed,
                "per_position_acceptance": stats.per_position_acceptance,
                "tau_histogram": stats.tau_histogram,
                "draft_seconds": stats.draft_secs,
                "verify_seconds": stats.verify_secs,
                "other_seconds": stats.other_secs,
                "per_round": g.rounds,
            },
        })
    }

    /// The text on stdout, the figures on stderr.
    fn print(&self) {
        let (g, seconds) = (self.g, self.seconds);
        let stats = summarize(&[&g.rounds]);
        let mode_name = self.mode.with_block(self.block).name();
        println!("{}", self.text);
        eprintln!(
            "[{mode_name}] {} new tokens in {:.2}s ({:.1} tok/s), prompt {} tokens, {} rounds, tau {:.2}",
            g.new_tokens.len(),
            seconds,
            g.new_tokens.len() as f64 / seconds,
            self.prompt_tokens,
            stats.rounds,
            stats.tau_pooled
        );
        if let Some((speedup, same)) = self.vs_ar {
            eprintln!(
                "[{mode_name}] speed-up over AR {speedup:.2}× (decode time per token){}",
                match same {
                    Some(true) => ", output identical to AR",
                    Some(false) => ", OUTPUT DIFFERS FROM AR",
                    None => "",
                }
            );
        }
    }
}
