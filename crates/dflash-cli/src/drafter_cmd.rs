//! `dflash-rs drafter init`: a seeded random z-lab-format drafter for a target (the start of
//! training, and a drafter for exercising the decoding loops).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use dflash_model::drafter::Drafter;
use dflash_model::drafter_init::{
    default_mask_token, drafter_config, random_weights, save_drafter, DrafterShape,
};
use dflash_model::loader::load_target;
use dflash_model::weights::TensorStore;

#[derive(Subcommand, Debug)]
pub enum DrafterCommand {
    /// Write a new drafter with seeded random weights.
    Init(InitArgs),
}

#[derive(Args, Debug)]
pub struct InitArgs {
    #[arg(long, default_value = "smollm2-135m")]
    pub target: String,
    #[arg(long)]
    pub out: PathBuf,
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
}

pub fn run(cmd: DrafterCommand) -> Result<()> {
    match cmd {
        DrafterCommand::Init(a) => init(a),
    }
}

fn init(a: InitArgs) -> Result<()> {
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
    };
    let cfg = drafter_config(&loaded.target, &shape)?;
    let w = random_weights(&cfg, a.seed)?;
    // load it once before writing: whatever we save must load against this target
    let store = TensorStore::new(w.clone(), candle_core::DType::F32, candle_core::Device::Cpu);
    Drafter::load(cfg.clone(), &store, &loaded.target)?;
    save_drafter(&a.out, &cfg, &w)?;
    eprintln!(
        "wrote {}: {} layers, block {}, taps {:?}, mask token {mask} ({:?})",
        a.out.display(),
        a.layers,
        a.block_size,
        cfg.dflash_config.target_layer_ids.as_ref().unwrap(),
        loaded.tokenizer.inner.id_to_token(mask).unwrap_or_default()
    );
    Ok(())
}
