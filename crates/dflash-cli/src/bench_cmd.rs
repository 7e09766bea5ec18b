//! `dflash-rs bench`: time per output token per mode, the round's time split, and one target
//! forward against its physical floor (weight bytes / measured memory bandwidth).

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use clap::Args;
use dflash_core::sampling::SamplingParams;
use dflash_core::stats::summarize;
use dflash_core::visibility::causal;
use dflash_engine::{generate, Request};
use dflash_eval::harness::{mode_specs, parse_modes, EvalDrafter};
use dflash_model::drafter::Drafter;
use dflash_model::loader::load_target;
use dflash_model::Rows;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[arg(long, default_value = "smollm2-135m")]
    pub target: String,
    /// A drafter directory (default for speculative modes: a seeded random 5-layer drafter).
    #[arg(long)]
    pub drafter: Option<std::path::PathBuf>,
    #[arg(long, default_value = "ar,dflash,ddtree:8")]
    pub modes: String,
    #[arg(long, default_value = "cpu")]
    pub device: String,
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    #[arg(long, default_value_t = 256)]
    pub new_tokens: usize,
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
}

const PROMPTS: &[&str] = &[
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that checks whether a number is prime.",
    "What are three tips for staying focused while studying?",
    "Summarise the plot of Romeo and Juliet.",
];

fn sync(d: &Device) -> Result<()> {
    d.synchronize()?;
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(a: BenchArgs) -> Result<()> {
    let dev = dflash_model::device(&a.device)?;
    let dtype = dflash_model::dtype(&a.dtype)?;
    let lt = load_target(&a.target, dtype, &dev)?;
    eprintln!("{lt}");
    let modes = parse_modes(&a.modes)?;
    let drafter = match &a.drafter {
        Some(d) => Drafter::load_dir(d, &lt.target)?,
        None => dflash_model::drafter_init::random_drafter(&lt, 5, 16, None, 0)?,
    };
    let drafters = vec![EvalDrafter {
        label: "d".into(),
        drafter,
    }];
    let specs = mode_specs(&modes, &drafters, None)?;
    println!(
        "target {} on {} ({}), {} new tokens × {} prompts, median of {}",
        a.target,
        a.device,
        a.dtype,
        a.new_tokens,
        PROMPTS.len(),
        a.repeats
    );
    println!("| mode | ms / output token | tok/s | τ pooled | draft ms/round | verify ms/round | other ms/round |");
    println!("|---|---|---|---|---|---|---|");
    for spec in &specs {
        let d = spec.drafter.map(|i| &drafters[i].drafter);
        let mut tpot = Vec::new();
        let mut last = None;
        for rep in 0..=a.repeats {
            let (mut secs, mut toks, mut rounds) = (0.0, 0usize, Vec::new());
            for p in PROMPTS {
                let ids = lt.tokenizer.prompt_ids(p, true)?;
                let req = Request {
                    prompt_ids: ids,
                    max_new_tokens: a.new_tokens,
                    sampling: SamplingParams::default(),
                    stop_ids: vec![],
                };
                sync(&dev)?;
                let g = generate(&lt.target, d, spec.mode, &req)?;
                sync(&dev)?;
                secs += g.decode_secs;
                toks += g.new_tokens.len() - 1;
                rounds.push(g.rounds);
            }
            if rep > 0 {
                tpot.push(secs / toks as f64); // rep 0 is the warm-up (PTX JIT, allocations)
                last = Some(rounds);
            }
        }
        let r = last.unwrap();
        let s = summarize(&r.iter().map(|x| x.as_slice()).collect::<Vec<_>>());
        let per = |x: f64| x * 1e3 / s.rounds.max(1) as f64;
        let t = median(tpot);
        println!(
            "| {} | {:.2} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} |",
            spec.label,
            t * 1e3,
            1.0 / t,
            s.tau_pooled,
            per(s.draft_secs),
            per(s.verify_secs),
            per(s.other_secs)
        );
    }
    // one target forward on a warm 512-row cache, against the floor
    let t = &lt.target;
    let ctx: Vec<u32> = (0..512u32)
        .map(|i| 200 + (i * 7919) % 20000 % t.vocab_size() as u32)
        .collect();
    let mut cache = t.new_cache();
    t.forward(
        &ctx,
        &(0..512).collect::<Vec<_>>(),
        &causal(0, 512),
        &mut cache,
        &[],
        &Rows::None,
    )?;
    let mut rows = Vec::new();
    for n in [1usize, 16] {
        let toks: Vec<u32> = (0..n as u32).map(|i| 300 + i).collect();
        let pos: Vec<usize> = (512..512 + n).collect();
        let mut v = Vec::new();
        for i in 0..12 {
            sync(&dev)?;
            let s = Instant::now();
            let o = t.forward(&toks, &pos, &causal(512, n), &mut cache, &[], &Rows::All)?;
            let _ = o
                .logits
                .unwrap()
                .to_dtype(DType::F32)?
                .sum_all()?
                .to_scalar::<f32>()?;
            sync(&dev)?;
            if i >= 2 {
                v.push(s.elapsed().as_secs_f64());
            }
            cache.truncate(512)?;
        }
        rows.push((n, median(v)));
    }
    // measured bandwidth: a 1 GiB device copy (read + write)
    let bytes = 1usize << 30;
    let big = Tensor::zeros(bytes / 4, DType::F32, &dev)?;
    let mut bw = Vec::new();
    for _ in 0..5 {
        sync(&dev)?;
        let s = Instant::now();
        let c = big.copy()?;
        sync(&dev)?;
        bw.push(2.0 * bytes as f64 / s.elapsed().as_secs_f64());
        drop(c);
    }
    let bw = median(bw);
    let weight_bytes = weight_bytes(&lt)?;
    let floor = weight_bytes as f64 / bw;
    println!("\nmeasured copy bandwidth {:.1} GB/s; weights {:.1} MB in {:?} → floor {:.3} ms per forward", bw / 1e9, weight_bytes as f64 / 1e6, dtype, floor * 1e3);
    for (n, s) in rows {
        println!(
            "one target forward, {n:>2} new row(s) on a 512-row cache: {:.3} ms ({:.1}× the floor)",
            s * 1e3,
            s / floor
        );
    }
    Ok(())
}

fn weight_bytes(lt: &dflash_model::loader::LoadedTarget) -> Result<usize> {
    let c = &lt.target.config;
    let (h, l, i, v) = (
        c.hidden_size,
        c.num_hidden_layers,
        c.intermediate_size,
        c.vocab_size,
    );
    let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads(), c.head_dim());
    let per_layer = h * nh * hd * 2 + 2 * h * nkv * hd + 3 * h * i + 2 * h;
    let head = if c.tie_word_embeddings { 0 } else { v * h };
    let params = l * per_layer + v * h + head + h;
    Ok(params * lt.target.dtype.size_in_bytes())
}
