//! `dflash-rs drafter init`: a seeded random z-lab-format drafter for a target (the start of
//! training, and a drafter for exercising the decoding loops).

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use dflash_core::config::DrafterConfig;
use dflash_model::io::loader::load_target;
use dflash_model::io::weights::TensorStore;
use dflash_model::models::drafter::Drafter;
use dflash_model::models::drafter_init::{
    default_mask_token, drafter_config, random_weights, save_drafter, write_drafter_into,
    DrafterShape, PUBLISHED_DFLASH2,
};

#[derive(Subcommand, Debug)]
pub enum DrafterCommand {
    /// Write a new drafter with seeded random weights.
    Init(InitArgs),
    /// Copy a drafter (e.g. a training checkpoint's `drafter/`) with its weights cast to another
    /// dtype: the shipping format (bf16 halves the f32 checkpoint).
    Export(ExportArgs),
}

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// A drafter directory: config.json + model.safetensors (+ training.json, copied).
    #[arg(long)]
    pub from: PathBuf,
    #[arg(long)]
    pub out: PathBuf,
    /// Replace what `--out` already holds (without it, an output that holds anything is
    /// refused by name).
    #[arg(long)]
    pub force: bool,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
}

#[derive(Args, Debug)]
pub struct InitArgs {
    #[arg(long, default_value = "smollm2-135m")]
    pub target: String,
    #[arg(long)]
    pub out: PathBuf,
    /// Replace what `--out` already holds (without it, an output that holds anything is
    /// refused by name).
    #[arg(long)]
    pub force: bool,
    #[arg(long, default_value_t = 5)]
    pub layers: usize,
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Mask token id (default: an unused special token of the target).
    #[arg(long)]
    pub mask_token_id: Option<u32>,
    #[arg(long)]
    pub intermediate_size: Option<usize>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// `dflash` (z-lab's DFlashDraftModel) or `dflash2` (DFlash2DraftModel: dynamic convs and
    /// a candidate selector).
    #[arg(long, default_value = "dflash")]
    pub arch: String,
    /// DFlash2: conv taps (the published drafters: 2).
    #[arg(long, default_value_t = PUBLISHED_DFLASH2.conv_kernel_size)]
    pub conv_kernel_size: usize,
    /// DFlash2: channels sharing one dynamic tap (published: 16).
    #[arg(long, default_value_t = PUBLISHED_DFLASH2.conv_group_size)]
    pub conv_group_size: usize,
    /// DFlash2: the selector codebooks' rank (published: 256).
    #[arg(long, default_value_t = PUBLISHED_DFLASH2.selector_rank)]
    pub selector_rank: usize,
    /// DFlash2: candidates the selector rescores per position (published: 16).
    #[arg(long, default_value_t = PUBLISHED_DFLASH2.selector_top_k)]
    pub selector_top_k: usize,
}

pub fn run(cmd: DrafterCommand) -> Result<()> {
    match cmd {
        DrafterCommand::Init(a) => init(a),
        DrafterCommand::Export(a) => export(a),
    }
}

fn init(a: InitArgs) -> Result<()> {
    let dflash2 = match a.arch.as_str() {
        "dflash" => None,
        "dflash2" => Some(dflash_core::config::Dflash2Params {
            conv_kernel_size: a.conv_kernel_size,
            conv_group_size: a.conv_group_size,
            selector_rank: a.selector_rank,
            selector_top_k: a.selector_top_k,
        }),
        x => anyhow::bail!("unknown --arch '{x}': dflash or dflash2"),
    };
    crate::args::OUT_REPLACEABLE.check_dir(&a.out, a.force)?;
    let loaded = load_target(
        &a.target,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )?;
    eprintln!("{loaded}");
    let mask = match a.mask_token_id {
        Some(m) => m,
        None => default_mask_token(&loaded.tokenizer)
            .context("the target has no unused special token: pass --mask-token-id")?,
    };
    let shape = DrafterShape {
        layers: a.layers,
        block_size: a.block_size,
        mask_token_id: mask,
        intermediate_size: a.intermediate_size,
        target_layer_ids: None,
        dflash2,
    };
    let cfg = drafter_config(&loaded.target, &shape)?;
    let w = random_weights(&cfg, a.seed)?;
    // load it once before writing: whatever we save must load against this target
    let store = TensorStore::new(w.clone(), candle_core::DType::F32, candle_core::Device::Cpu);
    Drafter::load(cfg.clone(), &store, &loaded.target)?;
    save_drafter(&a.out, &cfg, &w)?;
    eprintln!(
        "wrote {}: {}, {} layers, block {}, taps {:?}, mask token {mask} ({:?})",
        a.out.display(),
        cfg.architectures[0],
        a.layers,
        a.block_size,
        cfg.dflash_config.target_layer_ids.as_ref().unwrap(),
        loaded.tokenizer.inner.id_to_token(mask).unwrap_or_default()
    );
    Ok(())
}

fn export(a: ExportArgs) -> Result<()> {
    crate::args::OUT_REPLACEABLE.check_dir(&a.out, a.force)?;
    let dtype = dflash_model::dtype(&a.dtype)?;
    let cfg_path = a.from.join("config.json");
    let text = std::fs::read_to_string(&cfg_path)
        .with_context(|| format!("reading {}", cfg_path.display()))?;
    let mut value: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not JSON", cfg_path.display()))?;
    let torch_name = match dtype {
        candle_core::DType::BF16 => "bfloat16",
        candle_core::DType::F16 => "float16",
        candle_core::DType::F32 => "float32",
        other => anyhow::bail!("cannot export weights as {other:?}: use f32, bf16 or f16"),
    };
    value["torch_dtype"] = serde_json::Value::String(torch_name.into());
    let cfg: DrafterConfig = serde_json::from_value(value)
        .with_context(|| format!("{} is not a DFlash drafter config", cfg_path.display()))?;
    let st = a.from.join("model.safetensors");
    let w = candle_core::safetensors::load(&st, &candle_core::Device::Cpu)
        .with_context(|| format!("reading {}", st.display()))?;
    let w: HashMap<String, candle_core::Tensor> = w
        .into_iter()
        .map(|(n, t)| Ok((n, t.to_dtype(dtype)?)))
        .collect::<Result<_>>()?;
    // the weights and the training record in one directory, put in place atomically
    let rec = a.from.join("training.json");
    dflash_model::io::atomic::replace_dir(&a.out, |tmp| {
        write_drafter_into(tmp, &cfg, &w)?;
        if rec.exists() {
            std::fs::copy(&rec, tmp.join("training.json"))
                .with_context(|| format!("copying {}", rec.display()))?;
        }
        Ok(())
    })
    .with_context(|| format!("writing the drafter to {}", a.out.display()))?;
    let bytes = std::fs::metadata(a.out.join("model.safetensors"))?.len();
    eprintln!(
        "wrote {}: {} tensors as {torch_name}, {:.1} MB",
        a.out.display(),
        w.len(),
        bytes as f64 / 1e6
    );
    Ok(())
}
