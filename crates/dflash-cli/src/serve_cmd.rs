//! `dflash-rs serve`: an OpenAI-compatible HTTP server (the `dflash-serve` crate).

use crate::args::{DeviceArgs, DraftProducts};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use dflash_engine::{Acceptance, DecodeOptions, ModeName};
use dflash_model::io::loader::load_target;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Target model: a GGUF file, an HF directory, or an alias (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b).
    #[arg(long, default_value = "smollm2-135m")]
    pub target: String,
    /// A z-lab-format drafter directory (default: the drafter that ships for the target).
    #[arg(long)]
    pub drafter: Option<PathBuf>,
    /// How a request decoding alone decodes: ar, dflash, ddtree:N or auto [default: auto where
    /// a drafter is given or ships for the target, else ar]. In a speculative batch (see
    /// --batch-speculation) every mode but ar drafts the drafter's chain; auto decides per round
    /// whether drafting pays at the current number of requests, dflash always drafts.
    #[arg(long)]
    pub mode: Option<ModeName>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// 0: a free port (the address is printed on stderr: `listening on http://…`).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Requests decoded together (the batch's slots).
    #[arg(long, default_value_t = 16)]
    pub max_batch: usize,
    /// How requests decoding together decode: on (each round every request's drafted chain
    /// verified in one forward, or an AR step for all where --mode auto finds drafting does not
    /// pay; attention-only targets), off (AR). Off by default: with the bundled SmolLM2 pair it
    /// loses to the AR batch at 4 and 16 requests on a GPU (docs/BENCHMARKS.md, Serving).
    #[arg(long, default_value = "off", action = clap::ArgAction::Set, hide_possible_values = true,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub batch_speculation: bool,
    /// Requests waiting for a slot beyond which new ones are refused with 503.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// `max_tokens` of a request that names none (cut to what the context leaves).
    #[arg(long, default_value_t = 512)]
    pub default_max_tokens: usize,
    /// The model name of `/v1/models` [default: the --target argument].
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// How drafts are accepted at T > 0 (dflash and ddtree modes): residual or exact-match.
    #[arg(long, default_value = "residual")]
    pub acceptance: Acceptance,
    #[command(flatten)]
    pub run_on: DeviceArgs,
    #[command(flatten)]
    pub draft: DraftProducts,
}

pub fn run(a: ServeArgs) -> Result<()> {
    if a.max_batch == 0 {
        bail!("--max-batch must be >= 1");
    }
    let (mode, drafter_dir) =
        crate::args::resolve_drafter(&a.target, a.drafter.as_deref(), a.mode)?;
    let (dtype, device) = a.run_on.parse()?;
    let loaded = load_target(&a.target, dtype, &device)?;
    eprintln!("{loaded}");
    let drafter = match &drafter_dir {
        Some(dir) if mode.is_speculative() => Some(a.draft.load_noted(dir, &loaded.target)?),
        _ => None,
    };
    let block = drafter.as_ref().map_or(1, |d| d.block_size);
    let batch_speculation = a.batch_speculation && drafter.is_some();
    if batch_speculation && loaded.target.is_hybrid() {
        bail!("--batch-speculation on takes attention-only targets: this hybrid target's linear-attention state cannot drop rejected rows");
    }
    let listener = std::net::TcpListener::bind((a.host.as_str(), a.port))
        .with_context(|| format!("binding {}:{}", a.host, a.port))?;
    let engine = dflash_serve::Engine {
        target: loaded.target,
        drafter,
        mode: mode.with_block(block),
        max_batch: a.max_batch,
        batch_speculation,
        opts: DecodeOptions {
            acceptance: a.acceptance,
            ..Default::default()
        },
    };
    let config = dflash_serve::ServeConfig {
        model: a.served_model_name.unwrap_or(a.target),
        max_queue: a.max_queue,
        default_max_tokens: a.default_max_tokens,
    };
    eprintln!(
        "serving '{}': alone {}, up to {} together ({}), queue {}",
        config.model,
        engine.mode.name(),
        a.max_batch,
        match batch_speculation {
            true => "speculative batch",
            false => "AR",
        },
        a.max_queue
    );
    dflash_serve::serve(engine, loaded.tokenizer, config, listener)?;
    // DFLASH_PROFILE: where the decoding thread's time went, once it has stopped
    dflash_model::profile::print_report("serving");
    Ok(())
}
