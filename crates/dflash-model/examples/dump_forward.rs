//! Dump dflash-rs logits and taps of a causal prefill, for comparisons with other stacks.
//! `cargo run --release -p dflash-model --example dump_forward -- MODEL_DIR IDS_JSON OUT.safetensors f32|bf16`
//! Writes `logits` `[n, vocab]` and `taps` `[layers-1, n, hidden]` (taps 0 … L-2), as f32.

use std::collections::HashMap;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use dflash_model::io::loader::load_hf_weights;
use dflash_model::{Rows, Target};

fn main() -> Result<()> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let dtype = dflash_model::dtype(a.get(3).map(|s| s.as_str()).unwrap_or("f32"))?;
    let (cfg, store) = load_hf_weights(std::path::Path::new(&a[0]), dtype, &Device::Cpu)?;
    let t = Target::load(cfg, &store)?;
    let ids: Vec<u32> = serde_json::from_str(&std::fs::read_to_string(&a[1])?)?;
    let taps: Vec<usize> = (0..t.num_layers() - 1).collect();
    let mut c = t.new_cache();
    let o = t.forward_causal(&ids, &mut c, &taps, &Rows::All)?;
    let mut m = HashMap::new();
    m.insert(
        "logits".to_string(),
        o.logits.unwrap().to_dtype(DType::F32)?,
    );
    m.insert(
        "taps".to_string(),
        Tensor::stack(&o.taps, 0)?.to_dtype(DType::F32)?,
    );
    candle_core::safetensors::save(&m, &a[2])?;
    Ok(())
}
