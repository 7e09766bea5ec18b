//! `data generate` and `train` through the binary on SmolLM2: data regeneration is resumable,
//! and a training run killed with SIGKILL and resumed reproduces the uninterrupted loss curve
//! bit for bit (CPU, f32).

use dflash_testkit::tmp;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dflash-rs"))
}
fn ok(c: &mut Command) {
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
/// `c` fails and its error names every one of `needles`.
fn refused(c: &mut Command, needles: &[&str]) {
    let o = c.output().unwrap();
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(needles.iter().all(|n| e.contains(n)), "{e}");
}

fn curve(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            v.as_object_mut().unwrap().remove("tokens_per_sec"); // wall-clock, not state
            v
        })
        .collect()
}

/// Five short chat prompts in `d/p.jsonl`.
fn write_prompts(d: &Path) -> PathBuf {
    let prompts = d.join("p.jsonl");
    std::fs::write(
        &prompts,
        [
            "Name a fruit.",
            "What is 3+4?",
            "Say hello in Spanish.",
            "Name a planet.",
            "Count to three.",
        ]
        .iter()
        .map(|p| format!("{{\"prompt\": \"{p}\"}}\n"))
        .collect::<String>(),
    )
    .unwrap();
    prompts
}

/// `data generate` of `prompts` into `data` on SmolLM2 (24 new tokens, batches of 2, shards of
/// `shard` prompts), with `extra` arguments.
fn generate(prompts: &Path, data: &Path, shard: &str, extra: &[&str]) -> Command {
    let mut c = bin();
    c.args([
        "data",
        "generate",
        "--target",
        "smollm2-135m",
        "--prompts",
        prompts.to_str().unwrap(),
    ])
    .args([
        "--out",
        data.to_str().unwrap(),
        "--max-new-tokens",
        "24",
        "--shard-size",
        shard,
        "--batch-size",
        "2",
    ])
    .args(extra);
    c
}

/// Generating `prompts` into `data`: a time limit stops early and says so, a rerun finishes the
/// three shards, another finds them done, and other generation options or another shard size
/// are refused by name without touching the manifest.
fn generation_resumes_and_refuses_mixing(prompts: &Path, data: &Path) {
    let gen = |extra: &[&str]| generate(prompts, data, "2", extra);
    // a time limit stops after the first finished prompt: no complete shard yet, and says so
    let o = gen(&["--time-limit", "0"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("stopped at the time limit"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    ok(&mut gen(&[]));
    let manifest = std::fs::read_to_string(data.join("manifest.json")).unwrap();
    let m: serde_json::Value = serde_json::from_str(&manifest).unwrap();
    assert_eq!(m["shards"].as_array().unwrap().len(), 3);
    // a second run finds every shard done and changes nothing
    ok(&mut gen(&[]));
    // other generation options would mix two data sets: refused, nothing written
    refused(&mut gen(&["--temperature", "0.7"]), &["mix two data sets"]);
    refused(
        &mut gen(&["--loop-window", "8"]),
        &["mix two data sets", "--loop-window 0"],
    );
    assert!(
        !manifest.contains("loop_window"),
        "0 is not written: {manifest}"
    );
    // so would another shard size: refused, naming the one to continue with
    refused(
        &mut generate(prompts, data, "3", &[]),
        &["--shard-size 2, not from", "--shard-size 3"],
    );
    assert_eq!(
        std::fs::read_to_string(data.join("manifest.json")).unwrap(),
        manifest
    );
}

/// `--loop-window 2` (in `d/looped`): recorded, every response ends at its first repeated
/// window at the latest, and the manifest counts those that ended there (some do).
fn loop_window_cuts_and_counts_repeats(d: &Path) {
    let looped = d.join("looped");
    let loop_prompts = d.join("loops.jsonl");
    std::fs::write(
        &loop_prompts,
        "{\"prompt\": \"Repeat the word ha twenty times.\"}\n{\"prompt\": \"Count to three.\"}\n",
    )
    .unwrap();
    ok(bin().args([
        "data",
        "generate",
        "--target",
        "smollm2-135m",
        "--prompts",
        loop_prompts.to_str().unwrap(),
        "--out",
        looped.to_str().unwrap(),
        "--max-new-tokens",
        "24",
        "--batch-size",
        "2",
        "--loop-window",
        "2",
    ]));
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(looped.join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(m["loop_window"], 2);
    let (mut ends_in_repeat, mut recorded) = (0, 0);
    for shard in m["shards"].as_array().unwrap() {
        let text = std::fs::read_to_string(looped.join(shard["file"].as_str().unwrap())).unwrap();
        recorded += shard["ended_by_loop"].as_u64().unwrap_or(0);
        for line in text.lines() {
            let r: serde_json::Value = serde_json::from_str(line).unwrap();
            let ids: Vec<u32> = serde_json::from_value(r["ids"].clone()).unwrap();
            let mask: Vec<u8> = serde_json::from_value(r["loss_mask"].clone()).unwrap();
            let resp = &ids[mask.iter().position(|&m| m == 1).unwrap()..];
            assert_eq!(dflash_core::loops::keep_until_loop(resp, 2), resp.len());
            // its last window repeats an earlier one: the response ended there
            let n = resp.len();
            ends_in_repeat +=
                (n > 2 && resp.windows(2).take(n - 2).any(|w| w == &resp[n - 2..])) as u64;
        }
    }
    assert_eq!(
        recorded, ends_in_repeat,
        "the manifest counts the loop-cut responses"
    );
    assert!(recorded > 0, "\"ha ha ha …\" repeats a 2-token window");
}

/// A 12-step training config (checkpoints and validation every 4 steps) in `d/cfg.json`.
fn write_train_config(d: &Path) -> PathBuf {
    let cfg = d.join("cfg.json");
    std::fs::write(
        &cfg,
        r#"{"num_draft_layers": 1, "block_size": 4, "intermediate_size": 64, "num_anchors": 8,
            "lr": 1e-3, "max_steps": 12, "save_every": 4, "val_every": 4, "val_sequences": 1, "seed": 7}"#,
    )
    .unwrap();
    cfg
}

/// `train` on SmolLM2 with `data` and `cfg` into `out`, resuming there if `resume`.
fn train(data: &Path, cfg: &Path, out: &Path, resume: bool) -> Command {
    let mut c = bin();
    c.args([
        "train",
        "--target",
        "smollm2-135m",
        "--data",
        data.to_str().unwrap(),
    ])
    .args([
        "--out",
        out.to_str().unwrap(),
        "--config",
        cfg.to_str().unwrap(),
    ]);
    if resume {
        c.arg("--resume");
    }
    c
}

/// Start `run` (writing its metrics to `out`) and SIGKILL it once it has logged 6 steps, before
/// its 12th.
fn kill_midway(mut run: Command, out: &Path) {
    let mut child = run
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        let steps = std::fs::read_to_string(out.join("metrics.jsonl"))
            .map(|s| s.lines().count())
            .unwrap_or(0);
        if steps >= 6 {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before it could be killed"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "the run made no progress"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let before = curve(out).len();
    assert!(before < 12, "killed too late ({before} steps)");
}

/// The step-12 checkpoint of `b` exported as bf16 into `bf` (the shipping format): half the
/// bytes, the same tensors rounded, a bf16 config and the training record.
fn export_is_the_bf16_rounding(b: &Path, bf: &Path) {
    ok(bin().args([
        "drafter",
        "export",
        "--from",
        b.join("checkpoints/step-000012/drafter").to_str().unwrap(),
        "--out",
        bf.to_str().unwrap(),
    ]));
    let w32 = candle_core::safetensors::load(
        b.join("checkpoints/step-000012/drafter/model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let w16 =
        candle_core::safetensors::load(bf.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    assert_eq!(w32.len(), w16.len());
    for (n, t) in &w32 {
        let u = &w16[n];
        assert_eq!(u.dtype(), candle_core::DType::BF16, "{n}");
        assert!(
            dflash_model::ops::compare::rel_err(u, t).unwrap() <= 1.0 / 128.0,
            "{n} is not its bf16 rounding"
        );
    }
    let cfg16: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(bf.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg16["torch_dtype"], "bfloat16");
    assert!(bf.join("training.json").exists());
}

/// `generate` on SmolLM2 with `drafter` runs.
fn decodes(drafter: &Path) {
    ok(bin()
        .args([
            "generate",
            "--target",
            "smollm2-135m",
            "--prompt",
            "Hi",
            "--chat",
        ])
        .args([
            "--max-new-tokens",
            "4",
            "--drafter",
            drafter.to_str().unwrap(),
        ]));
}

/// Data generation resumes and refuses to mix data sets, `--loop-window` cuts and counts
/// repeats; a training run SIGKILLed midway and resumed gives the uninterrupted run's loss curve
/// and final weights bit for bit, and its bf16 export and its f32 best checkpoint decode.
#[test]
fn killed_run_resumes_bit_for_bit() {
    let d = tmp("run");
    let prompts = write_prompts(&d);
    let data = d.join("data");
    generation_resumes_and_refuses_mixing(&prompts, &data);
    loop_window_cuts_and_counts_repeats(&d);

    let cfg = write_train_config(&d);
    let a = d.join("a");
    ok(&mut train(&data, &cfg, &a, false));
    let want = curve(&a);
    assert_eq!(want.len(), 12);

    let b = d.join("b");
    kill_midway(train(&data, &cfg, &b, false), &b);
    ok(&mut train(&data, &cfg, &b, true));
    let got = curve(&b);
    assert_eq!(got.len(), 12);
    for (x, y) in got.iter().zip(&want) {
        assert_eq!(x, y, "resumed curve differs at step {}", y["step"]);
    }
    // the resumed checkpoint is the same drafter, byte for byte
    let fa = std::fs::read(a.join("checkpoints/step-000012/drafter/model.safetensors")).unwrap();
    let fb = std::fs::read(b.join("checkpoints/step-000012/drafter/model.safetensors")).unwrap();
    assert!(fa == fb, "final weights differ");
    // exported as bf16 (the shipping format): half the bytes, same tensors, and it decodes
    let bf = d.join("bf16");
    export_is_the_bf16_rounding(&b, &bf);
    decodes(&bf);
    // and the f32 one decodes
    decodes(&b.join("best"));
}

/// `train --gpus N`: a group that cannot exist is refused by name before anything loads, and a
/// CPU build says that it has no NCCL.
#[test]
fn gpu_launcher_refuses_impossible_groups_by_name() {
    let d = tmp("launcher");
    let cfg = d.join("cfg.json");
    std::fs::write(&cfg, r#"{"grad_accum": 4}"#).unwrap();
    let run = |extra: &[&str]| {
        let o = bin()
            .args(["train", "--data", "nowhere", "--out"])
            .arg(d.join("out"))
            .arg("--config")
            .arg(&cfg)
            .args(extra)
            .output()
            .unwrap();
        assert!(!o.status.success());
        String::from_utf8_lossy(&o.stderr).to_string()
    };
    let e = run(&["--gpus", "3"]);
    assert!(e.contains("grad_accum 4") && e.contains("3 ranks"), "{e}");
    let e = run(&["--gpus", "2", "--nnodes", "2", "--node-rank", "2"]);
    assert!(e.contains("--node-rank 2"), "{e}");
    let e = run(&["--gpus", "2", "--rendezvous", "localhost"]);
    assert!(e.contains("HOST:PORT"), "{e}");
    if !cfg!(feature = "cuda") {
        let e = run(&["--gpus", "2"]);
        assert!(e.contains("needs a CUDA build"), "{e}");
        let o = bin()
            .args([
                "data",
                "generate",
                "--prompts",
                "p.jsonl",
                "--gpus",
                "2",
                "--out",
            ])
            .arg(d.join("data"))
            .output()
            .unwrap();
        assert!(!o.status.success());
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(e.contains("needs a CUDA build"), "{e}");
    }
}
