//! `dflash-rs check forward`: one causal prefill's logits and taps written to a safetensors
//! file, to set dflash-rs beside another stack on the same weights and tokens
//! (`bench/fla_gap.py`, `bench/gdn_parity.py`).
//!
//! Written, as f32: `logits` `[n, vocab]` (or the last `--last-logits` rows) and `taps`
//! `[L−1, n, hidden]`, tap i = the output of layer i = transformers' `hidden_states[i + 1]`
//! (the last layer's output is left out: transformers returns it after the final norm).
//! Example: a 5-layer target and 64 ids → `taps` `[4, 64, hidden]`.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Args;

use crate::args::DeviceArgs;
use dflash_model::io::loader::load_hf_weights;
use dflash_model::{Rows, Target};

#[derive(Args, Debug)]
pub struct ForwardArgs {
    /// A model directory (config.json + safetensors; no tokenizer needed).
    #[arg(long)]
    pub target: PathBuf,
    /// A JSON list of token ids, the prompt of the prefill.
    #[arg(long)]
    pub ids: PathBuf,
    /// The safetensors file to write (replaced atomically).
    #[arg(long)]
    pub out: PathBuf,
    /// Keep only the logits of the last N rows (all by default).
    #[arg(long)]
    pub last_logits: Option<usize>,
    #[command(flatten)]
    pub run_on: DeviceArgs,
}

pub fn run(a: ForwardArgs) -> Result<()> {
    let (dtype, dev) = a.run_on.parse()?;
    let text = std::fs::read_to_string(&a.ids)
        .with_context(|| format!("reading token ids from {}", a.ids.display()))?;
    let ids: Vec<u32> = serde_json::from_str(&text).with_context(|| {
        format!(
            "{}: expected a JSON list of token ids, e.g. [1, 2, 3]",
            a.ids.display()
        )
    })?;
    if ids.is_empty() {
        bail!("{}: the list of token ids is empty", a.ids.display());
    }
    let (cfg, store) = load_hf_weights(&a.target, dtype, &dev)?;
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= cfg.vocab_size) {
        bail!(
            "{}: token id {bad} is outside the target's vocabulary ({} ids)",
            a.ids.display(),
            cfg.vocab_size
        );
    }
    let mut t = Target::load(cfg, &store)?;
    drop(store);
    t.stack_products()?;
    let taps: Vec<usize> = (0..t.num_layers() - 1).collect();
    let mut cache = t.new_cache();
    let o = t.forward_causal(&ids, &mut cache, &taps, &Rows::All)?;
    let mut logits = o.logits.context("the forward returned no logits")?;
    if let Some(k) = a.last_logits {
        let n = logits.dim(0)?;
        logits = logits.narrow(0, n - k.min(n), k.min(n))?;
    }
    let mut m = HashMap::new();
    let host =
        |t: Tensor| -> Result<Tensor> { Ok(t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?) };
    m.insert("logits".to_string(), host(logits)?);
    m.insert("taps".to_string(), host(Tensor::stack(&o.taps, 0)?)?);
    dflash_model::io::atomic::write_file_with(&a.out, |tmp| {
        Ok(candle_core::safetensors::save(&m, tmp)?)
    })?;
    eprintln!(
        "{} ids through {} layers ({dtype:?} on {}): logits and {} taps → {}",
        ids.len(),
        t.num_layers(),
        a.run_on.device,
        taps.len(),
        a.out.display()
    );
    Ok(())
}
