//! `dflash-rs bench train`: the drafter's training step on a target shape with random weights
//! (e.g. Qwen3-8B, which we have no weights for): time of the target features and of one
//! optimizer step, block rows and supervised tokens per second, matmul FLOPs
//! (`dflash_train::flops`) and MFU against a stated peak. The step is the trainer's own:
//! `target_features`, `block_loss`, backward, `TrainableDrafter::update`.

use std::time::Instant;

use anyhow::Result;
use clap::Args;
use dflash_model::models::drafter_init::random_weights;
use dflash_model::Target;
use dflash_train::anchors;
use dflash_train::config::{LossKind, TrainConfig};
use dflash_train::data::Sequence;
use dflash_train::flops::{step_flops, RowShape};
use dflash_train::loss::{block_loss, target_features, Objective};
use dflash_train::optim::AdamW;
use dflash_train::pack::TrainingRow;
use dflash_train::trainer::TrainableDrafter;

use crate::bench_shape::{random_target, ShapeArgs};
use crate::timing::median;

#[derive(Args, Debug)]
pub struct BenchTrainArgs {
    #[command(flatten)]
    pub model: ShapeArgs,
    /// Tokens of the training row (one sequence, all supervised but the first).
    #[arg(long, default_value_t = 2048)]
    pub seq_len: usize,
    #[arg(long, default_value_t = 512)]
    pub anchors: usize,
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    #[arg(long, default_value_t = 5)]
    pub draft_layers: usize,
    /// Timed optimizer steps (after one untimed warm-up step).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Dense peak of the device in TFLOP/s at this dtype, for MFU (H200 bf16: 989).
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// Also write the figures as one JSON row (`shape`, `impl`, `features_ms`, `step_ms`,
    /// `supervised_tok_s`, `mfu_pct`, `peak_mem_gb` (GPU: the tensors' high watermark since the
    /// start, weights included), …) to this file, for `docs/bench/`.
    #[arg(long)]
    pub output_json: Option<std::path::PathBuf>,
    /// Print the nodes of the step's backward graph grouped by shape and dtype (candle's
    /// autograd zero-fills a gradient buffer for each node and adds every incoming gradient
    /// into it: the count and bytes of that traffic), once, before the timed steps.
    #[arg(long)]
    pub graph_census: bool,
    /// Run the last step's drafter part (forward, loss, backward, AdamW) between
    /// `cuProfilerStart` and `cuProfilerStop`: under `ncu --profile-from-start off` its kernels
    /// alone are recorded (`bench/train_profile.py` sums them).
    #[arg(long)]
    pub profile_step: bool,
}

pub fn run(a: BenchTrainArgs) -> Result<()> {
    let (dev, dtype, cfg) = a.model.parse()?;
    check(&a, &dev)?;
    let (target, dcfg) = random_target(
        &a.model.shape,
        &cfg,
        dtype,
        &dev,
        a.draft_layers,
        a.block_size,
    )?;
    let mut td = TrainableDrafter::new(dcfg.clone(), &random_weights(&dcfg, 0)?, &target)?;
    let tc = TrainConfig::default();
    let mut opt = AdamW::new(&td.params, tc.beta1, tc.beta2, tc.eps, tc.weight_decay)?;

    // one row of pseudo-random tokens, every token but the first supervised
    let vocab = target.vocab_size();
    let row = bench_row(a.seq_len, vocab);
    let anchors = anchors::sample(row.anchor_candidates(), a.anchors, 0);
    let taps = td.drafter.target_layer_ids.clone();
    let shape = RowShape::of(&row.segs, &anchors, a.block_size);
    let flops = step_flops(&dcfg, taps.len(), vocab, &shape);

    let inputs = StepInputs {
        target: &target,
        row: &row,
        anchors: &anchors,
        taps: &taps,
        tc: &tc,
    };
    let times = time_steps(&a, &dev, &inputs, &mut td, &mut opt)?;
    report(&a, &dev, times, anchors.len(), shape.block_rows, flops)
}

/// The flags checked; on a GPU, the fused training kernels checked against their CPU twins
/// first.
fn check(a: &BenchTrainArgs, dev: &candle_core::Device) -> Result<()> {
    if a.block_size < 2 || a.seq_len < a.block_size + 1 || a.anchors == 0 || a.steps == 0 {
        anyhow::bail!(
            "--block-size must be >= 2, --seq-len > --block-size, --anchors and --steps >= 1"
        );
    }
    if a.peak_tflops.is_some_and(|p| p.is_nan() || p <= 0.0) {
        anyhow::bail!("--peak-tflops must be > 0");
    }
    if !dev.is_cpu() {
        // the fused training kernels must match their CPU twins before their speed means anything
        crate::check_cmd::kernel_rows(dev, true)?;
    }
    Ok(())
}

/// One row of `seq_len` pseudo-random tokens below `vocab`, every token but the first
/// supervised.
fn bench_row(seq_len: usize, vocab: usize) -> TrainingRow {
    let ids = crate::bench_shape::bench_tokens(seq_len, vocab);
    let mut loss_mask = vec![1u8; seq_len];
    loss_mask[0] = 0;
    TrainingRow::single(Sequence { ids, loss_mask })
}

/// What one training step reads: the target, the row and its anchors, the taps and the
/// trainer's default hyper-parameters.
struct StepInputs<'a> {
    target: &'a Target,
    row: &'a TrainingRow,
    anchors: &'a [usize],
    taps: &'a [usize],
    tc: &'a TrainConfig,
}

/// The timed steps' seconds (the warm-up left out) and every step's loss (warm-up first).
struct StepTimes {
    feats: Vec<f64>,
    step: Vec<f64>,
    losses: Vec<f32>,
}

/// One untimed warm-up step, then `--steps` timed ones: each the target features, then the
/// drafter's forward, loss, backward and AdamW update (the last one inside a profiler range
/// with `--profile-step`).
fn time_steps(
    a: &BenchTrainArgs,
    dev: &candle_core::Device,
    s: &StepInputs,
    td: &mut TrainableDrafter,
    opt: &mut AdamW,
) -> Result<StepTimes> {
    let (target, row, anchors, tc) = (s.target, s.row, s.anchors, s.tc);
    let (mut t_feats, mut t_step, mut losses) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..=a.steps {
        dev.synchronize()?;
        let t = Instant::now();
        let feats = {
            let _p = tracing::info_span!(target: "phase", "target features").entered();
            target_features(target, s.taps, row, false)?
        };
        dev.synchronize()?;
        let tf = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let obj = Objective {
            block: a.block_size,
            gamma: tc.gamma,
            kind: LossKind::Ce,
            selector_weight: tc.selector_loss_weight,
        };
        let mut step = || -> Result<candle_core::Tensor> {
            let out = block_loss(&td.drafter, target, row, &feats, anchors, obj)?;
            if i == 0 && a.graph_census {
                print_census(&out.loss);
            }
            let g = {
                let _p = tracing::info_span!(target: "phase", "backward").entered();
                out.backward()?
            };
            td.update(
                target,
                opt,
                td.grads_of(&g),
                tc.grad_clip,
                1e-4,
                &dflash_train::collective::Single,
            )?;
            Ok(out.loss)
        };
        let loss = if a.profile_step && i == a.steps {
            dflash_model::cuda::launch_profile::profiled_range(dev, &mut step)?
        } else {
            step()?
        };
        dev.synchronize()?;
        if i > 0 {
            t_feats.push(tf);
            t_step.push(t.elapsed().as_secs_f64());
        }
        // read after the timing: the same seed gives the same curve whichever kernels run
        losses.push(loss.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?);
    }
    Ok(StepTimes {
        feats: t_feats,
        step: t_step,
        losses,
    })
}

/// The table (and the `--output-json` row): the medians, rows and tokens per second, FLOPs and MFU.
fn report(
    a: &BenchTrainArgs,
    dev: &candle_core::Device,
    times: StepTimes,
    anchors: usize,
    block_rows: usize,
    flops: f64,
) -> Result<()> {
    let (tf, ts) = (median(times.feats), median(times.step));
    let losses = times.losses;
    let tflops = flops / ts / 1e12;
    println!(
        "random {}-shaped target, {}-layer drafter (B = {}) on {} ({}): one row of {} tokens, {} anchors, median of {}\n",
        a.model.shape, a.draft_layers, a.block_size, a.model.run_on.device, a.model.run_on.dtype, a.seq_len, anchors, a.steps
    );
    println!("| quantity | value |\n|---|---|");
    println!("| target features (forward, taps) | {:.1} ms |", tf * 1e3);
    println!(
        "| drafter step (forward, loss, backward, AdamW) | {:.1} ms |",
        ts * 1e3
    );
    println!(
        "| block rows / s (drafter step) | {:.0} |",
        block_rows as f64 / ts
    );
    println!(
        "| supervised tokens / s (features + step) | {:.0} |",
        (a.seq_len - 1) as f64 / (tf + ts)
    );
    let curve: Vec<String> = losses.iter().map(|l| format!("{l:.5}")).collect();
    println!("| loss per step (warm-up first) | {} |", curve.join(", "));
    println!("| matmul FLOPs per step | {:.3} TFLOP |", flops / 1e12);
    println!("| achieved | {tflops:.2} TFLOP/s |");
    let mfu = a.peak_tflops.map(|p| 100.0 * tflops / p);
    match (a.peak_tflops, mfu) {
        (Some(p), Some(m)) => println!("| MFU (peak {p} TFLOP/s) | {m:.2} % |"),
        _ => println!("| MFU | pass --peak-tflops |"),
    }
    // a failed read costs the figure, not the row
    let peak = dflash_model::device::peak_memory(dev).unwrap_or_else(|e| {
        eprintln!("peak device memory not read: {e:#}");
        None
    });
    if let Some(p) = peak {
        println!(
            "| peak device memory (tensors / the pool's reservation) | {:.1} / {:.1} GB |",
            p.used as f64 / 1e9,
            p.reserved as f64 / 1e9
        );
    }
    dflash_model::profile::print_report("bench train");
    if let Some(path) = &a.output_json {
        let row = serde_json::json!({
            "shape": a.model.shape,
            "impl": "dflash-rs",
            "features_ms": tf * 1e3,
            "step_ms": ts * 1e3,
            "supervised_tok_s": (a.seq_len - 1) as f64 / (tf + ts),
            "mfu_pct": mfu,
            "tflop_per_step": flops / 1e12,
            "seq_len": a.seq_len,
            "anchors": anchors,
            "block_size": a.block_size,
            "draft_layers": a.draft_layers,
            "losses": losses,
            "device": a.model.run_on.device,
            "dtype": a.model.run_on.dtype,
            "peak_mem_gb": peak.map(|p| p.used as f64 / 1e9),
            "reserved_mem_gb": peak.map(|p| p.reserved as f64 / 1e9),
        });
        dflash_model::io::atomic::write_file(path, format!("{row}\n").as_bytes())?;
    }
    Ok(())
}

/// The backward graph of `loss` by node shape: `| shape | dtype | nodes | MB per node |`, the
/// largest total first. Example: 5 drafter layers whose block rows are `[1, 8192, 4096]` bf16
/// show that shape's count (each node one zero-filled buffer of 64 MB and one add per input).
fn print_census(loss: &candle_core::Tensor) {
    use std::collections::BTreeMap;
    let nodes = loss.sorted_nodes();
    let mut by: BTreeMap<(Vec<usize>, String), usize> = BTreeMap::new();
    for n in &nodes {
        *by.entry((n.dims().to_vec(), format!("{:?}", n.dtype())))
            .or_default() += 1;
    }
    let mut rows: Vec<_> = by.into_iter().collect();
    let bytes = |(d, t): &(Vec<usize>, String)| {
        d.iter().product::<usize>() as f64 * if t == "F32" { 4.0 } else { 2.0 }
    };
    rows.sort_by(|a, b| (bytes(&b.0) * b.1 as f64).total_cmp(&(bytes(&a.0) * a.1 as f64)));
    println!("backward graph: {} nodes\n", nodes.len());
    println!("| shape | dtype | nodes | MB per node |\n|---|---|---|---|");
    for (k, c) in rows {
        println!("| {:?} | {} | {c} | {:.1} |", k.0, k.1, bytes(&k) / 1e6);
    }
    println!();
}
