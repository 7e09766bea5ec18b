//! `dflash-rs bench shape`: the costs of a target shape we have no weights for (random weights,
//! e.g. Qwen3-8B), and the speed-up they imply: one AR step, one chain verify of B rows, one
//! DDTree verify per budget, one draft block of a random drafter, against the memory floor.
//! Cost model: speed-up(τ) = τ · T_AR / (T_draft + T_verify).

use std::time::Instant;

use crate::args::DeviceArgs;
use crate::timing::{copy_bandwidth, read_bandwidth, time};

use anyhow::{Context, Result};
use candle_core::DType;
use clap::Args;
use dflash_core::config::{DrafterConfig, TargetConfig};
use dflash_core::tree::DraftTree;
use dflash_model::cuda::graphed_draft::GraphedDraft;
use dflash_model::io::weights::TensorStore;
use dflash_model::models::drafter::{BlockAt, Drafter};
use dflash_model::models::drafter_init::{drafter_config, DrafterShape};
use dflash_model::{Rows, Target};

/// Qwen/Qwen3-8B's config.json (the fields the model reads).
const QWEN3_8B: &str = r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
 "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
 "rms_norm_eps": 1e-06, "rope_theta": 1000000, "max_position_embeddings": 40960,
 "vocab_size": 151936, "tie_word_embeddings": false, "attention_bias": false,
 "torch_dtype": "bfloat16"}"#;

/// The random-weight model `bench shape` and `bench train` build.
#[derive(Args, Debug)]
pub struct ShapeArgs {
    /// `qwen3-8b`, or a config.json of any supported family.
    #[arg(long, default_value = "qwen3-8b")]
    pub shape: String,
    #[command(flatten)]
    pub run_on: DeviceArgs,
}

impl ShapeArgs {
    /// The device, the dtype and the shape's target config.
    pub fn parse(&self) -> Result<(candle_core::Device, DType, TargetConfig)> {
        let (dtype, device) = self.run_on.parse()?;
        Ok((device, dtype, shape_config(&self.shape)?))
    }
}

#[derive(Args, Debug)]
pub struct BenchShapeArgs {
    #[command(flatten)]
    pub model: ShapeArgs,
    /// Committed rows in the cache when timing.
    #[arg(long, default_value_t = 512)]
    pub cache: usize,
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    #[arg(long, default_value_t = 5)]
    pub draft_layers: usize,
    /// DDTree budgets (non-root nodes), comma-separated.
    #[arg(long, default_value = "8,16,32,64,128,256,512")]
    pub budgets: String,
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Hybrid shapes: the rows of one Gated DeltaNet layer's rule timed alone, chunked and
    /// recurrent, per length (comma-separated; empty for none).
    #[arg(long, default_value = "2048,8192")]
    pub gdn_lengths: String,
    /// The τ of the cost-model figures in `--json` rows (the paper's Qwen3-8B GSM8K τ: 6.5).
    #[arg(long, default_value_t = 6.5)]
    pub tau: f64,
    /// Also write the figures as JSON lines to this file, for `docs/bench/`: one row of the
    /// eager forwards and, on a GPU, one of the forwards replayed from CUDA graphs (`shape`,
    /// `impl`, `mode`, `ar_ms`, `verify16_ms` (the chain verify of `--block-size` rows),
    /// `draft_ms`, `read_floor_ms`, `costmodel`: `{"tau", "dflash", "ddtree_best"}`).
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Only capture the draft block, the AR step and the chain verify as CUDA graphs, replay
    /// each N times in that order inside a profiler range and exit (GPU): the run a kernel
    /// profiler reads (`ncu --profile-from-start off --graph-profiling node`,
    /// `bench/kernel_profile.py`). Prints each graph's kernel count.
    #[arg(long, default_value_t = 0)]
    pub profile_replays: usize,
    /// Only run the AR step and the chain verify eagerly (no CUDA graphs), each N times in that
    /// order inside a profiler range, and exit (GPU): what a kernel profiler reads where it
    /// cannot profile a graph's nodes (`ncu --profile-from-start off`, `bench/kernel_profile.py`).
    /// Prints each forward's kernel count.
    #[arg(long, default_value_t = 0)]
    pub profile_eager: usize,
    /// Only run one Gated DeltaNet layer's chunked rule N times at each `--gdn-lengths` inside
    /// a profiler range and exit (GPU, hybrid shapes): the run a kernel profiler reads beside
    /// fla's kernels (`bench/gdn_profile.py`). Prints the kernels of one run per length.
    #[arg(long, default_value_t = 0)]
    pub profile_gdn_rule: usize,
}

/// The cost model's speed-ups at `tau`: the chain (`t_draft + t_chain`) and the best DDTree
/// budget (`t_draft_top + t_tree`, the same τ: a lower bound, a tree's τ being higher).
/// Example: AR 10 ms, draft 1, chain 11, τ 6 → dflash 6 · 10 / 12 = 5.0.
fn costmodel(
    tau: f64,
    t_ar: f64,
    t_draft: f64,
    t_chain: f64,
    t_draft_top: f64,
    trees: &[f64],
) -> serde_json::Value {
    let best = trees
        .iter()
        .map(|t| tau * t_ar / (t_draft_top + t))
        .fold(f64::NAN, f64::max);
    serde_json::json!({
        "tau": tau,
        "dflash": tau * t_ar / (t_draft + t_chain),
        "ddtree_best": if best.is_nan() { serde_json::Value::Null } else { best.into() },
    })
}

/// A best-first tree of `budget` nodes over `depth` positions from fixed, decaying scores
/// (the shape of a confident drafter's tree: deep along rank 0, bushy near the root).
fn synthetic_tree(budget: usize, depth: usize, vocab: u32) -> DraftTree {
    let top: Vec<Vec<(u32, f32)>> = (0..depth)
        .map(|d| {
            (0..budget.min(vocab as usize))
                .map(|r| {
                    (
                        (1000 + 7 * r as u32 + d as u32) % vocab,
                        -0.3 - 1.2 * r as f32,
                    )
                })
                .collect()
        })
        .collect();
    DraftTree::build(1, &top, budget)
}

/// The target config of `--shape`: `qwen3-8b`, or a config.json of any supported family.
pub fn shape_config(shape: &str) -> Result<TargetConfig> {
    let text = if shape == "qwen3-8b" {
        QWEN3_8B.to_string()
    } else {
        std::fs::read_to_string(shape).with_context(|| {
            format!("--shape: '{shape}' is neither qwen3-8b nor a readable config.json")
        })?
    };
    serde_json::from_str(&text).with_context(|| format!("--shape {shape}: not a model config"))
}

/// `n` fixed pseudo-random token ids below `vocab`: the benchmarks' input on random weights.
pub fn bench_tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| ((17 + i * 7919) % vocab as u64) as u32)
        .collect()
}

/// A target of config `cfg` with random weights (seed 0) on `dev`, and the config of a
/// `layers`-layer drafter of its width; says how long building it took.
pub fn random_target(
    shape: &str,
    cfg: &TargetConfig,
    dtype: DType,
    dev: &candle_core::Device,
    layers: usize,
    block_size: usize,
) -> Result<(Target, DrafterConfig)> {
    let t0 = Instant::now();
    let mut target = Target::load(cfg.clone(), &TensorStore::random(dtype, dev, 0)?)?;
    target.stack_products()?;
    let dcfg = drafter_config(
        &target,
        &DrafterShape {
            layers,
            block_size,
            mask_token_id: 0,
            intermediate_size: None,
            target_layer_ids: None,
            dflash2: None,
        },
    )?;
    dev.synchronize()?;
    eprintln!(
        "random {shape} target ({} layers, hidden {}) built in {:.1} s",
        cfg.num_hidden_layers,
        cfg.hidden_size,
        t0.elapsed().as_secs_f64()
    );
    Ok((target, dcfg))
}

pub fn run(a: BenchShapeArgs) -> Result<()> {
    let (dev, dtype, cfg) = a.model.parse()?;
    if (a.profile_replays > 0 || a.profile_eager > 0) && dev.is_cpu() {
        anyhow::bail!(
            "--profile-replays and --profile-eager need a CUDA device: they count kernels in CUDA graph captures"
        );
    }
    if a.profile_gdn_rule > 0 {
        return profile_gdn_rule(&cfg, &dev, &a.gdn_lengths, a.profile_gdn_rule);
    }
    if a.block_size < 2 || a.cache == 0 || a.repeats == 0 {
        anyhow::bail!("--block-size must be >= 2, --cache and --repeats >= 1");
    }
    let budgets: Vec<usize> = a
        .budgets
        .split(',')
        .map(|b| b.trim().parse::<usize>().ok().filter(|&n| n > 0))
        .collect::<Option<_>>()
        .context("--budgets: comma-separated positive integers")?;
    let (target, dcfg) = random_target(
        &a.model.shape,
        &cfg,
        dtype,
        &dev,
        a.draft_layers,
        a.block_size,
    )?;
    let drafter = Drafter::load(dcfg, &TensorStore::random(dtype, &dev, 1)?, &target)?;
    let vocab = target.vocab_size() as u32;
    let n = a.cache;
    let ctx = bench_tokens(n, vocab as usize);
    let taps = drafter.target_layer_ids.clone();
    let mut cache = target.new_cache();
    let out = target.forward_causal(&ctx, &mut cache, &taps, &Rows::None)?;
    let ctx_feats = Target::concat_taps(&out.taps)?.unsqueeze(0)?;
    // the drafter's cache holds the context before the last row
    let mut dcache = drafter.new_cache();
    drafter.draft(
        &target,
        None,
        &mut dcache,
        &ctx_feats.narrow(1, 0, n - 1)?,
        BlockAt {
            token: 5,
            anchor: n - 1,
            block: a.block_size,
            positions: a.block_size - 1,
        },
    )?;
    if a.profile_eager > 0 {
        return profile_eager(&target, &mut cache, &taps, a.block_size, a.profile_eager);
    }
    if a.profile_replays > 0 {
        let last_row = ctx_feats.narrow(1, n - 1, 1)?;
        return profile_replays(
            &target,
            &drafter,
            (&mut cache, &mut dcache),
            &last_row,
            &taps,
            a.block_size,
            a.profile_replays,
        );
    }

    // what the loop reads back: at T = 0 one arg-max per row (picked on the device), at T > 0
    // the logits of every row
    let forward = |cache: &mut dflash_model::KvCache, tree: &DraftTree, rows: bool| -> Result<()> {
        let o = target.forward(
            &tree.tokens,
            &tree.positions(n),
            &tree.visibility(n),
            cache,
            &taps,
            &Rows::All,
        )?;
        let logits = o.logits.context("the forward returned no logits")?;
        if rows {
            let _ = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        } else {
            let _ = dflash_model::ops::argmax::argmax_rows(&logits)?;
        }
        cache.truncate(n)?;
        Ok(())
    };
    let verify = |cache: &mut dflash_model::KvCache, tree: &DraftTree| forward(cache, tree, false);
    // with DFLASH_PROFILE set: the time per phase of the AR steps and of the chain verifies
    // (the device synchronised at every phase edge: for attribution, the times above are not)
    let _ = dflash_model::profile::report();
    let t_ar = time(&dev, a.repeats, || {
        verify(&mut cache, &DraftTree::chain(1, &[]))
    })?;
    dflash_model::profile::print_report("AR step");
    let chain = DraftTree::chain(1, &vec![2u32; a.block_size - 1]);
    let t_chain = time(&dev, a.repeats, || verify(&mut cache, &chain))?;
    dflash_model::profile::print_report("chain verify");
    let t_chain_rows = time(&dev, a.repeats, || forward(&mut cache, &chain, true))?;
    let last_row = ctx_feats.narrow(1, n - 1, 1)?;
    // a draft block and what the round reads from it: 0 the chain's argmax per row, 1 DDTree-32's
    // candidates picked on the device, 2 every row's log-probabilities to the host
    let draft = |dcache: &mut dflash_model::KvCache, read: u8| -> Result<()> {
        dcache.truncate(n - 1)?;
        let l = drafter.draft(
            &target,
            None,
            dcache,
            &last_row,
            BlockAt {
                token: 5,
                anchor: n,
                block: a.block_size,
                positions: a.block_size - 1,
            },
        )?;
        match read {
            0 => drop(Drafter::argmax_rows(&l)?),
            1 => drop(dflash_model::ops::top_k::top_k_rows(
                &Drafter::log_probs(&l)?,
                32,
            )?),
            _ => drop(Drafter::log_probs(&l)?.to_vec2::<f32>()?),
        }
        Ok(())
    };
    let t_draft = time(&dev, a.repeats, || draft(&mut dcache, 0))?;
    let t_draft_top = time(&dev, a.repeats, || draft(&mut dcache, 1))?;
    let t_draft_rows = time(&dev, a.repeats, || draft(&mut dcache, 2))?;
    // the same block replayed from one CUDA graph (GPU only; `GraphedDraft`, as decoding with
    // --cuda-graphs runs it): the argmax and top-32 reads, and the replay's logits against the
    // eager draft's
    // phase profiling synchronises the device inside each forward, which a CUDA graph capture
    // cannot hold: with DFLASH_PROFILE set the replays are left out
    let graphed = !dev.is_cpu() && !dflash_model::profile::requested();
    if !dev.is_cpu() && !graphed {
        eprintln!(
            "{} is set: no CUDA-graph replays (a capture cannot synchronise)",
            dflash_core::env::PROFILE.name
        );
    }
    let draft_graph = if !graphed {
        None
    } else {
        let at = BlockAt {
            token: 5,
            anchor: n,
            block: a.block_size,
            positions: a.block_size - 1,
        };
        let mut gcache = dcache.clone();
        gcache.truncate(n - 1)?;
        let mut g = GraphedDraft::new(&mut gcache, n + 2 * a.block_size, a.block_size)?;
        let mut gdraft = |read: u8| -> Result<Option<candle_core::Tensor>> {
            gcache.truncate(n - 1)?;
            let (_, l) = g.draft_rows(&drafter, &target, None, &mut gcache, &last_row, at)?;
            Ok(match read {
                0 => {
                    drop(Drafter::argmax_rows(&l)?);
                    None
                }
                1 => {
                    drop(dflash_model::ops::top_k::top_k_rows(
                        &Drafter::log_probs(&l)?,
                        32,
                    )?);
                    None
                }
                _ => Some(l.copy()?),
            })
        };
        gdraft(0)?; // captures
        let replayed = gdraft(2)?.context("the replayed draft's logits")?;
        dcache.truncate(n - 1)?;
        let eager = drafter.draft(&target, None, &mut dcache, &last_row, at)?;
        let diff = (replayed - eager)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let t = time(&dev, a.repeats, || gdraft(0).map(drop))?;
        let t_top = time(&dev, a.repeats, || gdraft(1).map(drop))?;
        Some((t, t_top, diff))
    };
    let mut tree_rows = Vec::new();
    for &b in &budgets {
        let tree = synthetic_tree(b, a.block_size - 1, vocab);
        let t = time(&dev, a.repeats, || verify(&mut cache, &tree))?;
        tree_rows.push((b, tree.len(), t));
    }
    // the same forwards' device work, eager and as one CUDA graph (GPU only)
    let graphs = if !graphed {
        Vec::new()
    } else {
        let mut g = Vec::new();
        let mut forwards = vec![
            ("AR step".to_string(), DraftTree::chain(1, &[])),
            (
                format!("chain verify (B = {})", a.block_size),
                chain.clone(),
            ),
        ];
        // DDTree-8 and -32 verifies, when among the budgets
        for b in budgets.iter().copied().filter(|b| [8, 32].contains(b)) {
            forwards.push((
                format!("DDTree-{b} verify"),
                synthetic_tree(b, a.block_size - 1, vocab),
            ));
        }
        for (name, tree) in forwards {
            g.push((
                name,
                tree.len(),
                graph_costs(&target, &dev, &mut cache, &tree, n, &taps, a.repeats)?,
            ));
        }
        g
    };
    let gdn_rule = gdn_rule_times(&cfg, &dev, &a.gdn_lengths, a.repeats)?;
    // the floor: weight bytes at the measured read bandwidth (the copy's beside it)
    let bw = read_bandwidth(&dev)?;
    let copy_bw = copy_bandwidth(&dev)?;
    let params = cfg.forward_weight_params();
    let floor = params as f64 * dtype.size_in_bytes() as f64 / bw;

    println!(
        "random {}-shaped target on {} ({}), {}-row cache, median of {}; {:.2} B parameters, read floor {:.3} ms per forward ({:.0} GB/s read bandwidth; a copy moves {:.0} GB/s counting read + write)\n",
        a.model.shape, a.model.run_on.device, a.model.run_on.dtype, n, a.repeats, params as f64 / 1e9, floor * 1e3, bw / 1e9, copy_bw / 1e9
    );
    println!("Verifies read back what the decoding loop reads at T = 0: one arg-max per row, picked on the device.\n");
    println!("| forward | rows | ms | × floor |\n|---|---|---|---|");
    let row = |name: &str, rows: usize, t: f64| {
        println!("| {name} | {rows} | {:.3} | {:.1} |", t * 1e3, t / floor)
    };
    row("AR step", 1, t_ar);
    row(
        &format!("chain verify (B = {})", a.block_size),
        a.block_size,
        t_chain,
    );
    row(
        &format!(
            "chain verify (B = {}), every row's logits to the host (T > 0)",
            a.block_size
        ),
        a.block_size,
        t_chain_rows,
    );
    for (b, rows, t) in &tree_rows {
        row(&format!("DDTree-{b} verify"), *rows, *t);
    }
    for (read, t) in [
        ("argmax per row", t_draft),
        (
            "DDTree-32's top 32 per row picked on the device",
            t_draft_top,
        ),
        ("every row's log-probabilities to the host", t_draft_rows),
    ] {
        println!(
            "| draft block ({} layers, B = {}), {read} | {} | {:.3} | |",
            a.draft_layers,
            a.block_size,
            a.block_size,
            t * 1e3
        );
    }
    if let Some((t, t_top, diff)) = draft_graph {
        for (read, t) in [
            ("argmax per row", t),
            ("DDTree-32's top 32 per row picked on the device", t_top),
        ] {
            println!(
                "| draft block ({} layers, B = {}) replayed from a CUDA graph, {read} | {} | {:.3} | |",
                a.draft_layers,
                a.block_size,
                a.block_size,
                t * 1e3
            );
        }
        println!(
            "\nThe replayed draft block's logits against the eager draft's: max abs Δ {diff:.2e}."
        );
    }
    if !graphs.is_empty() {
        println!("\nWhere a forward's time goes (`Target::forward_prepared`: the device part, after `prepare` copied ids, RoPE rows and mask; `dflash_model::cuda::launch_profile`), median of {}. Kernels and layout uploads counted by a CUDA-graph capture that is never launched; \"param cache\": candle's device cache of small uploads, warmed by one run; host enqueue and GPU time of the same kernels enqueued behind a GPU blocker; graph replay: the forward captured (with the param cache) and relaunched.\n", a.repeats);
        println!("| forward | rows | kernels | uploads (no cache / cache) | allocs / frees | prepare ms | eager ms | eager, param cache ms | host enqueue ms | GPU ms | graph replay ms | replay × floor | replay vs eager logits, max abs Δ |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        for (name, rows, c) in &graphs {
            let (k, kc) = (&c.nodes, &c.nodes_cached);
            let split = match c.split {
                Some((h, g)) => format!("{:.3} | {:.3}", h * 1e3, g * 1e3),
                None => "host waited | —".to_string(),
            };
            println!(
                "| {name} | {rows} | {} | {} / {} | {} / {} | {:.3} | {:.3} | {:.3} | {split} | {:.3} | {:.1} | {:.2e} |",
                kc.kernels,
                k.memcpy,
                kc.memcpy,
                kc.alloc,
                kc.free,
                c.prepare * 1e3,
                c.eager * 1e3,
                c.eager_cached * 1e3,
                c.replay * 1e3,
                c.replay / floor,
                c.max_diff
            );
        }
    }
    if !gdn_rule.is_empty() {
        println!("\nOne Gated DeltaNet layer's rule alone (f32 rows of q, k, v, β, g in; o and the last state out; `dflash_model::ops::gdn_chunk` vs the recurrent kernel over the same chain), median of {}:\n", a.repeats);
        println!("| rows | chunked ms | of which the prep kernel ms | recurrent ms | recurrent / chunked |\n|---|---|---|---|---|");
        for (t, c, p, r) in &gdn_rule {
            let p = p.map_or("—".to_string(), |p| format!("{:.3}", p * 1e3));
            println!(
                "| {t} | {:.3} | {p} | {:.3} | {:.1}× |",
                c * 1e3,
                r * 1e3,
                r / c
            );
        }
    }
    println!("\nCost model, speed-up = τ · T_AR / (T_draft + T_verify):\n");
    let taus = [2.0, 3.0, 4.0, 5.0, 6.0, 7.0];
    print!("| τ |");
    for t in taus {
        print!(" {t} |");
    }
    println!("\n|---|{}", "---|".repeat(taus.len()));
    let line = |name: &str, verify: f64| {
        print!("| {name} |");
        for t in taus {
            print!(" {:.2}× |", t * t_ar / (t_draft + verify));
        }
        println!();
    };
    line("DFlash chain", t_chain);
    for (b, _, t) in &tree_rows {
        line(&format!("DDTree-{b}"), *t);
    }
    if let Some(path) = &a.json {
        // one row per timing mode: the AR step, the chain verify and the DDTree verifies of
        // that mode, the (eager) draft block beside them
        let row =
            |mode: &str, ar: f64, chain: f64, trees: &[f64], (t_draft, t_draft_top): (f64, f64)| {
                serde_json::json!({
                    "shape": a.model.shape,
                    "impl": "dflash-rs",
                    "mode": mode,
                    "device": a.model.run_on.device,
                    "dtype": a.model.run_on.dtype,
                    "cache_rows": n,
                    "block_size": a.block_size,
                    "ar_ms": ar * 1e3,
                    "verify16_ms": chain * 1e3,
                    "draft_ms": t_draft * 1e3,
                    "draft_top32_ms": t_draft_top * 1e3,
                    "read_floor_ms": floor * 1e3,
                    "costmodel": costmodel(a.tau, ar, t_draft, chain, t_draft_top, trees),
                })
            };
        let trees: Vec<f64> = tree_rows.iter().map(|r| r.2).collect();
        let mut rows = vec![row("eager", t_ar, t_chain, &trees, (t_draft, t_draft_top))];
        let replay = |name: &str| {
            graphs
                .iter()
                .find(|g| g.0.starts_with(name))
                .map(|g| g.2.replay)
        };
        if let (Some(g_ar), Some(g_chain)) = (replay("AR step"), replay("chain verify")) {
            let g_trees: Vec<f64> = ["DDTree-8 verify", "DDTree-32 verify"]
                .iter()
                .filter_map(|n| replay(n))
                .collect();
            let (mode, draft) = match draft_graph {
                Some((t, t_top, _)) => ("cuda graphs", (t, t_top)),
                None => (
                    "cuda graphs (the draft block eager)",
                    (t_draft, t_draft_top),
                ),
            };
            rows.push(row(mode, g_ar, g_chain, &g_trees, draft));
        }
        let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
        dflash_model::io::atomic::write_file(path, text.as_bytes())?;
    }
    Ok(())
}

/// `--profile-replays`: the draft block (its fixed-shape forward, as decoding replays it), the
/// AR step and the chain verify captured as CUDA graphs, then each replayed `reps` times in
/// that order, nothing launched between them: a kernel profiler's last `reps · (draft + AR +
/// chain)` kernels are these replays, in that order.
fn profile_replays(
    target: &Target,
    drafter: &Drafter,
    (cache, dcache): (&mut dflash_model::KvCache, &mut dflash_model::KvCache),
    last_row: &candle_core::Tensor,
    taps: &[usize],
    block: usize,
    reps: usize,
) -> Result<()> {
    use dflash_model::cuda::launch_profile::warm_capture;
    let dev = target.device.clone();
    let n = cache.len();
    // the draft block: anchor n after n - 1 cached context rows, as the timed drafts
    let cap = n + 2 * block;
    dcache.truncate(n - 1)?;
    dcache.reserve_exact(cap)?;
    let at = BlockAt {
        token: 5,
        anchor: n,
        block,
        positions: block - 1,
    };
    let inputs = drafter.prepare_fixed(target, last_row, at, n - 1, block, cap)?;
    let (draft, _) = warm_capture(&dev, dcache, n - 1, |c| {
        drafter.forward_fixed(target, None, &inputs, c)
    })?;
    let mut verifies = Vec::new();
    for inputs in ar_and_chain_inputs(target, n, block)? {
        let (graph, _) = warm_capture(&dev, cache, n, |c| {
            target.forward_prepared(&inputs, c, taps, &Rows::All)
        })?;
        cache.truncate(n)?;
        verifies.push(graph);
    }
    dev.synchronize()?;
    println!(
        "profile replays ({reps} each, in this order): draft block {} kernels, AR step {} kernels, chain verify (B = {block}) {} kernels",
        draft.nodes.kernels, verifies[0].nodes.kernels, verifies[1].nodes.kernels
    );
    // only the replays inside the profiler's range (`ncu --profile-from-start off`)
    dflash_model::cuda::launch_profile::profiled_range(&dev, || {
        for g in [&draft, &verifies[0], &verifies[1]] {
            for _ in 0..reps {
                g.replay()?;
            }
            dev.synchronize()?;
        }
        Ok(())
    })
}

/// The two forwards the profiling runs replay, prepared on a cache of `n` rows: an AR step
/// and a chain verify of `block` rows, in that order.
fn ar_and_chain_inputs(
    target: &Target,
    n: usize,
    block: usize,
) -> Result<Vec<dflash_model::ForwardInputs>> {
    [
        DraftTree::chain(1, &[]),
        DraftTree::chain(1, &vec![2u32; block - 1]),
    ]
    .iter()
    .map(|t| {
        let vis = t.visibility(n);
        target.prepare(
            &t.tokens,
            &t.positions(n),
            std::slice::from_ref(&vis),
            n,
            None,
        )
    })
    .collect()
}

/// `--profile-eager`: the AR step and the chain verify of `block` rows on the cache's `n` rows,
/// their inputs prepared once (`Target::prepare`: the host's uploads stay outside the counted
/// work, as in [`graph_costs`]), run eagerly with candle's param cache warm (so that they upload
/// nothing and launch exactly the kernels a capture of them counts), then each `reps` times in
/// that order inside the profiler range, the cache rolled back to `n` rows after every run.
fn profile_eager(
    target: &Target,
    cache: &mut dflash_model::KvCache,
    taps: &[usize],
    block: usize,
    reps: usize,
) -> Result<()> {
    use dflash_model::cuda::launch_profile::{count_launches, profiled_range, ParamCache};
    let dev = target.device.clone();
    let n = cache.len();
    let inputs = ar_and_chain_inputs(target, n, block)?;
    let run = |cache: &mut dflash_model::KvCache, inputs| {
        let o = target.forward_prepared(inputs, cache, taps, &Rows::All)?;
        cache.truncate(n)?;
        anyhow::Ok(o)
    };
    let _params = ParamCache::enable(&dev);
    let mut kernels = Vec::new();
    for i in &inputs {
        run(cache, i)?; // warms the param cache
        kernels.push(count_launches(&dev, || run(cache, i))?.kernels);
    }
    dev.synchronize()?;
    println!(
        "profile replays ({reps} each, in this order): AR step {} kernels, chain verify (B = {block}) {} kernels",
        kernels[0], kernels[1]
    );
    profiled_range(&dev, || {
        for i in &inputs {
            for _ in 0..reps {
                run(cache, i)?;
            }
            dev.synchronize()?;
        }
        Ok(())
    })
}

/// `(rows, chunked s, its prep kernel's s (GPU), recurrent s)`.
type GdnRuleTimes = (usize, f64, Option<f64>, f64);

/// The shape's Gated DeltaNet head sizes (`None` without linear attention).
fn gdn_dims(cfg: &TargetConfig) -> Option<dflash_model::ops::gdn_recurrence::RecurrenceDims> {
    Some(dflash_model::ops::gdn_recurrence::RecurrenceDims {
        hk: cfg.linear_num_key_heads?,
        hv: cfg.linear_num_value_heads?,
        dk: cfg.linear_key_head_dim?,
        dv: cfg.linear_value_head_dim?,
    })
}

/// `--gdn-lengths` as row counts.
fn gdn_lengths(lengths: &str) -> Result<Vec<usize>> {
    lengths
        .split(',')
        .filter(|t| !t.trim().is_empty())
        .map(|t| t.trim().parse::<usize>().ok().filter(|&n| n > 0))
        .collect::<Option<_>>()
        .context("--gdn-lengths: comma-separated positive integers")
}

/// One layer's rule inputs over a chain of `n` rows (random unit-scale q, k, β in (0, 1),
/// g < 0) and the empty state: `(rows, init)`.
fn gdn_rule_inputs(
    d: dflash_model::ops::gdn_recurrence::RecurrenceDims,
    n: usize,
    dev: &candle_core::Device,
) -> Result<(candle_core::Tensor, candle_core::Tensor)> {
    use candle_core::Tensor;
    let (kd, vd) = (d.hk * d.dk, d.hv * d.dv);
    let u = |cols: usize| Tensor::rand(0f32, 1f32, (n, cols), dev);
    let qk = u(2 * kd)?
        .affine(2.0, -1.0)?
        .affine((3.0 / d.dk as f64).sqrt(), 0.0)?;
    let v = u(vd)?.affine(2.0, -1.0)?;
    let beta = u(d.hv)?;
    let g = u(d.hv)?.affine(-0.5, 0.0)?;
    let rows = Tensor::cat(&[&qk, &v, &beta, &g], 1)?;
    let init = Tensor::zeros(d.state_len(), DType::F32, dev)?;
    Ok((rows, init))
}

/// One Gated DeltaNet layer's rule at the shape's head sizes over chains of each of `lengths`
/// rows: `(rows, chunked s, its prep kernel's s (GPU), recurrent s)`. Empty for a shape
/// without linear attention.
fn gdn_rule_times(
    cfg: &TargetConfig,
    dev: &candle_core::Device,
    lengths: &str,
    repeats: usize,
) -> Result<Vec<GdnRuleTimes>> {
    use dflash_model::ops::gdn_chunk::{gdn_chunk_prep_only, gdn_chunked};
    use dflash_model::ops::gdn_recurrence::gdn_recurrence;
    let Some(d) = gdn_dims(cfg) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for n in gdn_lengths(lengths)? {
        let (rows, init) = gdn_rule_inputs(d, n, dev)?;
        let chain: Vec<Option<usize>> = (0..n).map(|i| i.checked_sub(1)).collect();
        let tc = time(dev, repeats, || {
            gdn_chunked(&rows, &init, d)?;
            Ok(())
        })?;
        let tp = if dev.is_cpu() {
            None
        } else {
            Some(time(dev, repeats, || {
                gdn_chunk_prep_only(&rows, d)?;
                Ok(())
            })?)
        };
        let tr = time(dev, repeats, || {
            gdn_recurrence(&rows, &init, &chain, d, false)?;
            Ok(())
        })?;
        out.push((n, tc, tp, tr));
    }
    Ok(out)
}

/// `--profile-gdn-rule`: the chunked rule at each length, warmed up once, then run `reps`
/// times per length inside the profiler range, one length after another in the given order.
fn profile_gdn_rule(
    cfg: &TargetConfig,
    dev: &candle_core::Device,
    lengths: &str,
    reps: usize,
) -> Result<()> {
    use dflash_model::ops::gdn_chunk::gdn_chunked;
    if dev.is_cpu() {
        anyhow::bail!("--profile-gdn-rule needs a CUDA device: it runs the rule's kernels");
    }
    let d =
        gdn_dims(cfg).context("--profile-gdn-rule: the shape has no linear-attention layers")?;
    let lengths = gdn_lengths(lengths)?;
    if lengths.is_empty() {
        anyhow::bail!("--profile-gdn-rule needs --gdn-lengths");
    }
    let inputs = lengths
        .iter()
        .map(|&n| gdn_rule_inputs(d, n, dev))
        .collect::<Result<Vec<_>>>()?;
    for (rows, init) in &inputs {
        gdn_chunked(rows, init, d)?;
    }
    dev.synchronize()?;
    let names: Vec<String> = lengths.iter().map(|n| format!("T = {n}")).collect();
    println!(
        "gdn rule profile ({reps} runs each, in this order): {}",
        names.join(", ")
    );
    dflash_model::cuda::launch_profile::profiled_range(dev, || {
        for (rows, init) in &inputs {
            for _ in 0..reps {
                gdn_chunked(rows, init, d)?;
            }
            dev.synchronize()?;
        }
        Ok(())
    })
}

/// Where one forward's time goes on the GPU ([`dflash_model::cuda::launch_profile`]).
struct GraphCosts {
    /// Nodes of the captured forward, without and with candle's param cache.
    nodes: dflash_model::cuda::launch_profile::NodeCounts,
    nodes_cached: dflash_model::cuda::launch_profile::NodeCounts,
    /// Median seconds: the host part (`prepare`); the device part eager (synchronised), without
    /// and with the param cache; behind a blocker, the host's enqueue and the GPU's time
    /// (`None`: the host waited on the GPU); one replay of the captured graph.
    prepare: f64,
    eager: f64,
    eager_cached: f64,
    split: Option<(f64, f64)>,
    replay: f64,
    /// Max |Δ| between the logits of a graph replay and of the eager forward.
    max_diff: f32,
}

/// Profile `tree`'s forward on a cache of `n` committed rows (rolled back to `n` rows after
/// every run, so each run writes the same rows): its host part, its device part eager, its
/// kernels and uploads (a capture that is never launched), the host's and the GPU's time for
/// the same kernels, and the device part captured into a CUDA graph and replayed.
fn graph_costs(
    target: &Target,
    dev: &candle_core::Device,
    cache: &mut dflash_model::KvCache,
    tree: &DraftTree,
    n: usize,
    taps: &[usize],
    repeats: usize,
) -> Result<GraphCosts> {
    use dflash_model::cuda::launch_profile::{capture, count_launches, host_gpu_split, ParamCache};
    let (pos, vis) = (tree.positions(n), tree.visibility(n));
    let prepare = time(dev, repeats, || {
        target.prepare(&tree.tokens, &pos, std::slice::from_ref(&vis), n, None)?;
        Ok(())
    })?;
    let inputs = target.prepare(&tree.tokens, &pos, std::slice::from_ref(&vis), n, None)?;
    let logits = |o: dflash_model::TargetOutput| -> Result<Vec<f32>> {
        Ok(o.logits
            .context("the forward returned no logits")?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    };
    let run = |cache: &mut dflash_model::KvCache| -> Result<dflash_model::TargetOutput> {
        let o = target.forward_prepared(&inputs, cache, taps, &Rows::All)?;
        cache.truncate(n)?;
        Ok(o)
    };
    let eager_logits = logits(run(cache)?)?;
    let eager = time(dev, repeats, || run(cache).map(drop))?;
    let nodes = count_launches(dev, || run(cache))?;
    let _param_cache = ParamCache::enable(dev);
    run(cache)?; // warm the param cache
    let eager_cached = time(dev, repeats, || run(cache).map(drop))?;
    let nodes_cached = count_launches(dev, || run(cache))?;
    let mut splits = Vec::new();
    for _ in 0..repeats {
        match host_gpu_split(dev, 3.0 * eager + 0.01, || run(cache)) {
            Ok((s, _)) => splits.push((s.host, s.gpu)),
            Err(e) => {
                eprintln!("host/GPU split: {e:#}");
                break;
            }
        }
    }
    let split = (splits.len() == repeats).then(|| {
        (
            crate::timing::median(splits.iter().map(|s| s.0).collect()),
            crate::timing::median(splits.iter().map(|s| s.1).collect()),
        )
    });
    let (graph, out) = capture(dev, || run(cache))?;
    let replay = time(dev, repeats, || graph.replay())?;
    let graph_logits = logits(out)?;
    let max_diff = eager_logits
        .iter()
        .zip(&graph_logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    Ok(GraphCosts {
        nodes,
        nodes_cached,
        prepare,
        eager,
        eager_cached,
        split,
        replay,
        max_diff,
    })
}
