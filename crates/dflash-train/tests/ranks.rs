//! Data-parallel training on CPU ranks (threads of one process, `ThreadGroup`): with the same
//! global batch (`grad_accum` rows per step), 2 and 4 ranks write the run one rank writes, bit
//! for bit at f32 — weights, optimizer state and loss curve — including a run stopped on 2 ranks
//! and resumed on 4 — with the gradients summed over the ranks layer by layer during the
//! backward.

use std::path::Path;

use candle_core::DType;
use dflash_model::io::loader::LoadedTarget;
use dflash_testkit::*;
use dflash_train::collective::ThreadGroup;
use dflash_train::config::TrainConfig;
use dflash_train::data::Sequence;
use dflash_train::trainer::{read_metrics, train, train_rank, TrainOptions, TrainSummary};

/// Eight sequences (so that an epoch spans two steps of four rows), one held out.
fn data(name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let seqs: Vec<Sequence> = (0..9)
        .map(|i| sequence(50 + i, 4, 12 + i as usize))
        .collect();
    tiny_data(name, &seqs)
}

/// Two drafter layers: the ranks sum their gradients in three buckets (layer 1, layer 0, the
/// rest), started during the backward.
fn config() -> TrainConfig {
    TrainConfig {
        num_draft_layers: 2,
        block_size: 4,
        intermediate_size: Some(128),
        mask_token_id: Some(255),
        target_layer_ids: Some(vec![1, 2]),
        num_anchors: 8,
        lr: 1e-2,
        warmup_ratio: 0.0,
        grad_accum: 4,
        epochs: 1,
        max_steps: Some(5),
        save_every: 100,
        val_every: 2,
        val_sequences: 1,
        ..Default::default()
    }
}

/// `world` ranks as threads, each training into `out`.
fn ranks(
    world: usize,
    lt: &LoadedTarget,
    data: &Path,
    out: &Path,
    cfg: &TrainConfig,
    opts: &TrainOptions,
) -> Vec<anyhow::Result<TrainSummary>> {
    let group = ThreadGroup::new(world);
    std::thread::scope(|s| {
        let hs: Vec<_> = group
            .iter()
            .map(|g| s.spawn(move || train_rank(lt, data, out, cfg.clone(), opts, g)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// What must be equal between two runs: the last checkpoint's weights and optimizer moments
/// (bytes) and every metrics line (f64 equality; a validation loss where both validated: a
/// time-limited stop validates at its own checkpoint).
fn assert_same_run(a: &Path, b: &Path, what: &str) {
    let ck = |d: &Path, f: &str| std::fs::read(d.join("checkpoints/step-000005").join(f)).unwrap();
    for f in ["drafter/model.safetensors", "trainer/moments.safetensors"] {
        assert!(ck(a, f) == ck(b, f), "{what}: {f} differs");
    }
    let ma = read_metrics(&a.join("metrics.jsonl")).unwrap();
    let mb = read_metrics(&b.join("metrics.jsonl")).unwrap();
    assert_eq!(ma.len(), 5, "{what}");
    for (x, y) in ma.iter().zip(&mb) {
        assert_eq!(
            (x.loss, x.grad_norm, &x.acceptance, x.supervised_tokens),
            (y.loss, y.grad_norm, &y.acceptance, y.supervised_tokens),
            "{what}: step {}",
            x.step
        );
        if let (Some(vx), Some(vy)) = (x.val_loss, y.val_loss) {
            assert_eq!(vx, vy, "{what}: validation at step {}", x.step);
        }
    }
}

#[test]
fn two_and_four_cpu_ranks_equal_one_rank_bit_for_bit_including_resume() {
    let (td, data) = data("ranks");
    let lt = load(&td, DType::F32);
    let cfg = config();
    let opts = TrainOptions::default();
    let one = tmp("ranks-one");
    train(&lt, &data, &one, cfg.clone(), &opts).unwrap();

    let two = tmp("ranks-two");
    for r in ranks(2, &lt, &data, &two, &cfg, &opts) {
        assert_eq!(r.unwrap().steps, 5);
    }
    assert_same_run(&one, &two, "2 ranks");

    let four = tmp("ranks-four");
    ranks(4, &lt, &data, &four, &cfg, &opts)
        .into_iter()
        .for_each(|r| drop(r.unwrap()));
    assert_same_run(&one, &four, "4 ranks");

    // stopped after step 1 on 2 ranks (a zero time limit: rank 0's clock decides for all),
    // resumed on 4 ranks, finished on 1
    let split = tmp("ranks-split");
    let zero = TrainOptions {
        time_limit: Some(std::time::Duration::ZERO),
        ..Default::default()
    };
    for r in ranks(2, &lt, &data, &split, &cfg, &zero) {
        let s = r.unwrap();
        assert_eq!((s.steps, s.stopped_at_time_limit), (1, true));
    }
    let resume_zero = TrainOptions {
        resume: true,
        ..zero
    };
    for r in ranks(4, &lt, &data, &split, &cfg, &resume_zero) {
        assert_eq!(r.unwrap().steps, 2);
    }
    let resume = TrainOptions {
        resume: true,
        ..Default::default()
    };
    train(&lt, &data, &split, cfg.clone(), &resume).unwrap();
    assert_same_run(&one, &split, "2 ranks, resumed on 4, finished on 1");

    // only rank 0 writes: one metrics line per step, no stray files from the other ranks
    assert!(two.join("curves.svg").exists());
}

/// With the optimizer's moments sharded, 2 and 4 ranks still write the one-rank run bit for
/// bit, each rank keeping the moments of its own parameters only; a sharded run stopped on 4
/// ranks resumes unsharded on 2 and sharded on 3 (the checkpoint's moments are the whole
/// state either way).
#[test]
fn sharded_optimizer_ranks_equal_one_rank_bit_for_bit_including_resume() {
    let (td, data) = data("ranks-sharded");
    let lt = load(&td, DType::F32);
    let cfg = config();
    let one = tmp("ranks-sharded-one");
    train(&lt, &data, &one, cfg.clone(), &TrainOptions::default()).unwrap();
    let sharded = TrainOptions {
        shard_optimizer: true,
        ..Default::default()
    };
    for world in [2, 4] {
        let out = tmp(&format!("ranks-sharded-{world}"));
        for r in ranks(world, &lt, &data, &out, &cfg, &sharded) {
            assert_eq!(r.unwrap().steps, 5);
        }
        assert_same_run(&one, &out, &format!("{world} sharded ranks"));
    }
    let split = tmp("ranks-sharded-split");
    let zero = |shard_optimizer, resume| TrainOptions {
        time_limit: Some(std::time::Duration::ZERO),
        shard_optimizer,
        resume,
        ..Default::default()
    };
    for r in ranks(4, &lt, &data, &split, &cfg, &zero(true, false)) {
        assert_eq!(r.unwrap().steps, 1);
    }
    for r in ranks(2, &lt, &data, &split, &cfg, &zero(false, true)) {
        assert_eq!(r.unwrap().steps, 2);
    }
    let resume = TrainOptions {
        resume: true,
        shard_optimizer: true,
        ..Default::default()
    };
    for r in ranks(4, &lt, &data, &split, &cfg, &resume) {
        assert_eq!(r.unwrap().steps, 5);
    }
    assert_same_run(&one, &split, "sharded on 4, unsharded on 2, sharded on 4");
}

#[test]
fn rows_that_do_not_split_evenly_over_the_ranks_are_refused_by_name() {
    let (td, data) = data("ranks-uneven");
    let lt = load(&td, DType::F32);
    let out = tmp("ranks-uneven-out");
    for r in ranks(3, &lt, &data, &out, &config(), &TrainOptions::default()) {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("grad_accum 4") && e.contains("3 ranks"), "{e}");
    }
}
