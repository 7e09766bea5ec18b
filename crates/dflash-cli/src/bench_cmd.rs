//! `dflash-rs bench decode`: time per output token per mode, the round's time split, and one target
//! forward against its physical floor (weight bytes / measured memory bandwidth).

use crate::args::DeviceArgs;
use crate::timing::{median, read_bandwidth, resident_memory, time};

use anyhow::Result;
use candle_core::DType;
use clap::Args;
use dflash_core::sampling::SamplingParams;
use dflash_core::stats::{decode_secs_per_token, summarize};
use dflash_engine::{generate_with, DecodeOptions, GraphCache, ModeName, Request};
use dflash_eval::harness::{mode_specs, EvalDrafter};
use dflash_model::io::loader::load_target;
use dflash_model::models::drafter::Drafter;
use dflash_model::Rows;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[arg(long, default_value = "smollm2-135m")]
    pub target: String,
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
    #[command(flatten)]
    pub run_on: DeviceArgs,
}

const PROMPTS: &[&str] = &[
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that checks whether a number is prime.",
    "What are three tips for staying focused while studying?",
    "Summarise the plot of Romeo and Juliet.",
];

pub fn run(a: BenchArgs) -> Result<()> {
    let (dtype, dev) = a.run_on.parse()?;
    crate::args::note_cuda_graphs(a.cuda_graphs, &dev);
    let lt = load_target(&a.target, dtype, &dev)?;
    eprintln!("{lt}");
    let drafter = match &a.drafter {
        Some(d) => Drafter::load_dir(d, &lt.target)?,
        None => dflash_model::models::drafter_init::random_drafter(&lt, 5, 16, None, 0)?,
    };
    let drafters = vec![EvalDrafter {
        label: "d".into(),
        drafter,
    }];
    let specs = mode_specs(&a.modes, &drafters, None)?;
    let loaded = resident_memory();
    println!(
        "target {} on {} ({}), {} new tokens × {} prompts, median of {}",
        a.target,
        a.run_on.device,
        a.run_on.dtype,
        a.max_new_tokens,
        PROMPTS.len(),
        a.repeats
    );
    println!("| mode | ms / output token | tok/s | τ pooled | draft ms/round | verify ms/round | other ms/round |");
    println!("|---|---|---|---|---|---|---|");
    let cuda_graphs = a.cuda_graphs;
    // with DFLASH_PROFILE set: the time per phase of each mode's decoding, then of one forward
    // of 1 and of 16 rows (to stderr)
    let _ = dflash_model::profile::report();
    for spec in &specs {
        let opts = DecodeOptions {
            cuda_graphs,
            ..Default::default()
        };
        let d = spec.drafter.map(|i| &drafters[i].drafter);
        let mut tpot = Vec::new();
        let mut last = None;
        // the mode's fixed-shape forwards (CUDA graphs) kept across its generations, as eval does
        let mut graphs = GraphCache::default();
        for rep in 0..=a.repeats {
            let (mut tpots, mut rounds) = (Vec::new(), Vec::new());
            for p in PROMPTS {
                let ids = lt.tokenizer.prompt_ids(p, true)?;
                let req = Request {
                    prompt_ids: ids,
                    max_new_tokens: a.max_new_tokens,
                    sampling: SamplingParams::default(),
                    stop_ids: vec![],
                    loop_window: 0,
                };
                dev.synchronize()?;
                let g = generate_with(&lt.target, d, spec.mode, &req, opts, &mut graphs)?;
                dev.synchronize()?;
                tpots.push(decode_secs_per_token(g.decode_secs, g.new_tokens.len()));
                rounds.push(g.rounds);
            }
            if rep > 0 {
                // mean over the prompts; rep 0 is the warm-up (PTX JIT, allocations)
                tpot.push(tpots.iter().sum::<f64>() / tpots.len() as f64);
                last = Some(rounds);
            }
        }
        let r = last.unwrap();
        let s = summarize(&r.iter().map(|x| x.as_slice()).collect::<Vec<_>>());
        let per = |x: f64| x * 1e3 / s.rounds.max(1) as f64;
        let t = median(tpot);
        println!(
            "| {}{} | {:.2} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} |",
            spec.label,
            if cuda_graphs { "+graphs" } else { "" },
            t * 1e3,
            1.0 / t,
            s.tau_pooled,
            per(s.draft_secs),
            per(s.verify_secs),
            per(s.other_secs)
        );
        dflash_model::profile::print_report(&format!("{} decoding", spec.label));
    }
    // resident memory before the floor's buffers below: the weights, caches and decoding's
    if let (Some((after_load, _)), Some((now, peak))) = (loaded, resident_memory()) {
        let mb = |b: u64| b as f64 / 1e6;
        println!(
            "\nresident memory: {:.1} MB after loading, {:.1} MB after decoding, peak (VmHWM) {:.1} MB; the target's weights hold {:.1} MB",
            mb(after_load),
            mb(now),
            mb(peak),
            mb(lt.target.weight_bytes_held() as u64)
        );
    }
    // one target forward on a warm 512-row cache, against the floor
    let t = &lt.target;
    let ctx: Vec<u32> = (0..512u32)
        .map(|i| 200 + (i * 7919) % 20000 % t.vocab_size() as u32)
        .collect();
    let mut cache = t.new_cache();
    t.forward_causal(&ctx, &mut cache, &[], &Rows::None)?;
    let mut rows = Vec::new();
    for n in [1usize, 16] {
        let _ = dflash_model::profile::report();
        let toks: Vec<u32> = (0..n as u32).map(|i| 300 + i).collect();
        let secs = time(&dev, 10, || {
            let o = t.forward_causal(&toks, &mut cache, &[], &Rows::All)?;
            let _ = o
                .logits
                .unwrap()
                .to_dtype(DType::F32)?
                .sum_all()?
                .to_scalar::<f32>()?;
            cache.truncate(512)?;
            Ok(())
        })?;
        rows.push((n, secs));
        dflash_model::profile::print_report(&format!(
            "{n}-row forward on a 512-row cache (11 runs)"
        ));
    }
    let bw = read_bandwidth(&dev)?;
    // the bytes a forward reads (quantized CPU panels at their block size)
    let weight_bytes = lt.target.weight_bytes_read();
    let floor = weight_bytes as f64 / bw;
    println!("\nmeasured read bandwidth {:.1} GB/s; weights read per forward {:.1} MB ({:?}{}) → read floor {:.3} ms per forward", bw / 1e9, weight_bytes as f64 / 1e6, dtype, if lt.target.quantized_projections() > 0 { ", GGUF blocks streamed" } else { "" }, floor * 1e3);
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
            "one target forward, {n:>2} new row(s) on a 512-row cache: {:.3} ms ({:.1}× the floor)",
            s * 1e3,
            s / floor
        );
    }
    Ok(())
}
