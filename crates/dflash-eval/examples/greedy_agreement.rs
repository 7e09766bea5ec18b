//! How far the target's greedy choices here agree with the stored responses of a data
//! directory: one causal forward over each sequence, the arg-max at every response position
//! against the stored next token. Stored responses regenerated in another dtype (bf16 on a GPU)
//! diverge from this target's (f32 on the CPU) at the first disagreement, and `doctor --data`
//! then decodes other text than the trainer simulated on.
//!
//! `cargo run --release -p dflash-eval --example greedy_agreement -- DATA_DIR [last_n=32] [target=smollm2-135m]`
//!
//! Example output line: `seq 9088: 612 response tokens, first disagreement at 41, agreement 93.1 %`.

use anyhow::Result;
use candle_core::{DType, Device};
use dflash_model::io::loader::load_target;
use dflash_model::Rows;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = args
        .get(1)
        .ok_or_else(|| anyhow::anyhow!("usage: greedy_agreement DATA_DIR [last_n] [target]"))?;
    let last_n: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(32);
    let target = args.get(3).map(String::as_str).unwrap_or("smollm2-135m");
    let lt = load_target(target, DType::F32, &Device::Cpu)?;
    let (_, seqs) = dflash_train::data::read_sequences(std::path::Path::new(dir))?;
    let (mut agree_all, mut total_all, mut firsts) = (0usize, 0usize, Vec::new());
    for (i, s) in seqs
        .iter()
        .enumerate()
        .skip(seqs.len().saturating_sub(last_n))
    {
        let p = s.prompt_len();
        if p + 1 >= s.ids.len() {
            continue;
        }
        let mut cache = lt.target.new_cache();
        let out = lt
            .target
            .forward_causal(&s.ids, &mut cache, &[], &Rows::All)?;
        let pred: Vec<u32> = out
            .logits
            .unwrap()
            .argmax(candle_core::D::Minus1)?
            .to_vec1()?;
        // row r predicts token r + 1: the response tokens p..n from rows p-1..n-1
        let hits: Vec<bool> = (p..s.ids.len()).map(|t| pred[t - 1] == s.ids[t]).collect();
        let first = hits.iter().position(|&h| !h).unwrap_or(hits.len());
        let agree = hits.iter().filter(|&&h| h).count();
        println!(
            "seq {i}: {} response tokens, first disagreement at {first}, agreement {:.1} %",
            hits.len(),
            100.0 * agree as f64 / hits.len() as f64
        );
        agree_all += agree;
        total_all += hits.len();
        firsts.push(first);
    }
    firsts.sort_unstable();
    println!(
        "{} sequences: agreement {:.1} % of {total_all} response tokens; first disagreement median {} (min {}, max {})",
        firsts.len(),
        100.0 * agree_all as f64 / total_all.max(1) as f64,
        firsts.get(firsts.len() / 2).copied().unwrap_or(0),
        firsts.first().copied().unwrap_or(0),
        firsts.last().copied().unwrap_or(0)
    );
    Ok(())
}
