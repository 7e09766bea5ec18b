//! `bench shape` and `bench train` on a small random Qwen3 shape (the Qwen3-8B shape runs on
//! the GPU): every row of the tables and the cost model is printed, bad input is refused by name.

use std::path::Path;
use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dflash-rs"))
}

/// A small Qwen3 config.json in a fresh directory.
fn small_shape(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("dflash-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("config.json");
    std::fs::write(
        &cfg,
        r#"{"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000,
            "max_position_embeddings": 1024, "vocab_size": 500}"#,
    )
    .unwrap();
    cfg
}

#[test]
fn bench_shape_reports_every_forward_and_the_cost_model() {
    let cfg = small_shape("bench-shape");
    let json = cfg.with_extension("rows.jsonl");
    let o = bin()
        .args(["bench", "shape", "--shape", cfg.to_str().unwrap()])
        .args([
            "--cache",
            "32",
            "--budgets",
            "4,16",
            "--repeats",
            "1",
            "--draft-layers",
            "2",
            "--tau",
            "5",
            "--output-json",
            json.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for row in [
        "| AR step | 1 |",
        "| chain verify (B = 16) | 16 |",
        "| DDTree-4 verify | 5 |",
        "| DDTree-16 verify | 17 |",
        "| draft block (2 layers, B = 16), argmax per row |",
        "| draft block (2 layers, B = 16), DDTree-32's top 32 per row picked on the device |",
        "| chain verify (B = 16), every row's logits to the host (T > 0) | 16 |",
        "| DFlash chain |",
        "| DDTree-16 |",
    ] {
        assert!(out.contains(row), "missing {row:?} in\n{out}");
    }
    // the JSON row (the CPU: eager only) carries the figures under the names docs/bench/ uses,
    // and the cost model's chain figure is τ · AR / (draft + verify)
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&json)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 1, "{rows:?}");
    let r = &rows[0];
    assert_eq!(
        (r["impl"].as_str(), r["mode"].as_str()),
        (Some("dflash-rs"), Some("eager"))
    );
    let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k}: {r}"));
    for k in ["ar_ms", "verify16_ms", "draft_ms", "read_floor_ms"] {
        assert!(f(k) > 0.0, "{k}: {r}");
    }
    let cm = &r["costmodel"];
    assert_eq!(cm["tau"], 5.0);
    let want = 5.0 * f("ar_ms") / (f("draft_ms") + f("verify16_ms"));
    let got = cm["dflash"].as_f64().unwrap();
    assert!((got - want).abs() <= 1e-9 * want, "{got} vs {want}");
    assert!(cm["ddtree_best"].as_f64().is_some_and(|x| x > 0.0), "{cm}");
    let bad = bin()
        .args(["bench", "shape", "--shape", "/nonexistent/config.json"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--shape"));
}

#[test]
fn bench_train_reports_the_step_and_its_mfu() {
    let cfg = small_shape("bench-train");
    let run = |extra: &[&str]| {
        bin()
            .args(["bench", "train", "--shape", cfg.to_str().unwrap()])
            .args([
                "--seq-len",
                "40",
                "--block-size",
                "4",
                "--draft-layers",
                "2",
            ])
            .args(extra)
            .output()
            .unwrap()
    };
    let json = small_shape("bench-train-json").with_extension("row.json");
    let o = run(&[
        "--anchors",
        "6",
        "--steps",
        "1",
        "--peak-tflops",
        "1",
        "--output-json",
        json.to_str().unwrap(),
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // the JSON row carries the table's figures under the names docs/bench/ uses
    let row: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(row["impl"], "dflash-rs");
    assert_eq!(row["anchors"], 6);
    for k in ["features_ms", "step_ms", "supervised_tok_s", "mfu_pct"] {
        assert!(row[k].as_f64().is_some_and(|x| x > 0.0), "{k}: {row}");
    }
    let tok_s = row["supervised_tok_s"].as_f64().unwrap();
    let ms = row["features_ms"].as_f64().unwrap() + row["step_ms"].as_f64().unwrap();
    assert!((tok_s - 39.0 / (ms / 1e3)).abs() <= 1e-6 * tok_s, "{row}");
    for row in [
        "one row of 40 tokens, 6 anchors",
        "| target features (forward, taps) |",
        "| drafter step (forward, loss, backward, AdamW) |",
        "| block rows / s (drafter step) |",
        "| matmul FLOPs per step |",
        "| MFU (peak 1 TFLOP/s) |",
    ] {
        assert!(out.contains(row), "missing {row:?} in\n{out}");
    }
    for (args, needle) in [
        (&["--anchors", "0"][..], "--anchors"),
        (&["--peak-tflops=-1"][..], "--peak-tflops"),
    ] {
        let o = run(args);
        assert!(!o.status.success());
        assert!(String::from_utf8_lossy(&o.stderr).contains(needle));
    }
}

/// `bench regen` on a small shape: the JSON row carries the figures under the names docs/bench/
/// uses for regeneration (`batch`, `new_tok_s`), and the rate is the new tokens over the time.
#[test]
fn bench_regen_writes_its_row() {
    let shape = small_shape("bench-regen-json");
    let json = shape.with_extension("row.json");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_dflash-rs"))
        .args(["bench", "regen", "--shape"])
        .arg(&shape)
        .args([
            "--slots",
            "3",
            "--prompt-tokens",
            "9",
            "--prompt-tokens-min",
            "5",
        ])
        .args(["--new-tokens", "4", "--warmup", "0", "--output-json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let row: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(row["impl"], "dflash-rs");
    assert_eq!(row["batch"], 3);
    assert_eq!(row["new_tokens"], 4);
    let secs = row["seconds"].as_f64().unwrap();
    let rate = row["new_tok_s"].as_f64().unwrap();
    assert!((rate - 12.0 / secs).abs() <= 1e-6 * rate, "{row}");
    let _ = std::fs::remove_dir_all(shape.parent().unwrap());
}

/// `bench decode` at T = 0 on `cfg` (with `--cuda-graphs` when `graphs`): every mode's table
/// row and JSON row say its tokens equal AR's on all 4 prompts.
fn assert_t0_modes_equal_ar(cfg: &Path, dir: &Path, graphs: bool) {
    let json = dir.join(format!("rows-{graphs}.jsonl"));
    let mut cmd = bin();
    cmd.args(["bench", "decode", "--shape", cfg.to_str().unwrap()])
        .args(["--modes", "ar,dflash,ddtree:4", "--max-new-tokens", "20"])
        .args(["--prompt-tokens", "24", "--repeats", "1"])
        .args(["--output-json", json.to_str().unwrap()]);
    if graphs {
        cmd.arg("--cuda-graphs");
    }
    let o = cmd.output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let suffix = if graphs { "+graphs" } else { "" };
    for mode in ["ar", "dflash", "ddtree:4"] {
        let row = out
            .lines()
            .find(|l| l.starts_with(&format!("| {mode}{suffix} |")))
            .unwrap_or_else(|| panic!("no {mode}{suffix} row in\n{out}"));
        assert!(
            row.ends_with("| 4/4 |"),
            "{mode}{suffix} left AR's tokens: {row}"
        );
    }
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&json)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3, "{rows:?}");
    for r in &rows {
        assert_eq!(r["shape"], "config");
        assert_eq!(r["graphs"], graphs);
        assert_eq!(r["equal_to_ar"], "4/4");
        assert!(r["ms_per_token"].as_f64().is_some_and(|x| x > 0.0), "{r}");
        assert!(r["tau_pooled"].as_f64().is_some_and(|x| x >= 1.0), "{r}");
    }
}

/// `bench decode` at T = 1 on `cfg`: the sampling is printed and each mode's row is timed,
/// marked T > 0 rather than compared with AR's.
fn assert_sampled_modes_are_timed(cfg: &Path) {
    let o = bin()
        .args(["bench", "decode", "--shape", cfg.to_str().unwrap()])
        .args([
            "--modes",
            "ar,dflash",
            "--max-new-tokens",
            "12",
            "--prompt-tokens",
            "16",
        ])
        .args(["--repeats", "1", "--temperature", "1.0", "--seed", "3"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains("T = 1, top-p 1, top-k 0, seed 3"), "{out}");
    for mode in ["ar", "dflash"] {
        let row = out
            .lines()
            .find(|l| l.starts_with(&format!("| {mode} |")))
            .unwrap_or_else(|| panic!("no {mode} row in\n{out}"));
        assert!(row.ends_with("| T > 0 |"), "{row}");
    }
}

/// `bench decode` refuses a missing shape, a negative temperature and an empty prompt by name.
fn assert_bad_decode_input_is_refused(cfg: &Path) {
    for (args, names) in [
        (vec!["--shape", "/nonexistent/config.json"], "--shape"),
        (
            vec!["--shape", cfg.to_str().unwrap(), "--temperature", "-1"],
            "temperature",
        ),
        (
            vec!["--shape", cfg.to_str().unwrap(), "--prompt-tokens", "0"],
            "--prompt-tokens",
        ),
    ] {
        let bad = bin()
            .args(["bench", "decode"])
            .args(&args)
            .output()
            .unwrap();
        assert!(!bad.status.success());
        let err = String::from_utf8_lossy(&bad.stderr);
        assert!(err.contains(names), "{args:?}: {err}");
    }
}

/// `bench shape`'s profiling runs on `cfg` are refused without a CUDA device, by name.
fn assert_profiling_needs_a_gpu(cfg: &Path) {
    for (flag, says) in [
        (
            "--profile-gdn-rule",
            "--profile-gdn-rule needs a CUDA device",
        ),
        ("--profile-eager", "--profile-eager need a CUDA device"),
    ] {
        let bad = bin()
            .args([
                "bench",
                "shape",
                "--shape",
                cfg.to_str().unwrap(),
                flag,
                "1",
            ])
            .output()
            .unwrap();
        assert!(!bad.status.success());
        let err = String::from_utf8_lossy(&bad.stderr);
        assert!(err.contains(says), "{flag}: {err}");
    }
}

/// `bench decode --shape`: the decoding loop on random weights of a hybrid shape (the tiny
/// Qwen3.5 config: Gated DeltaNet and gated attention), every mode with and without the
/// fixed-shape forwards, each mode's tokens equal to AR's in f32 (lossless), one JSON row per
/// mode; at T > 0 timed only; a missing shape and bad input are refused by name, and the
/// profiling runs need a GPU.
#[test]
fn bench_decode_runs_every_mode_on_random_weights_of_a_hybrid_shape() {
    let cfg = dflash_testkit::fixtures().join("qwen35-tiny/config.json");
    let dir = std::env::temp_dir().join(format!("dflash-bench-decode-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for graphs in [false, true] {
        assert_t0_modes_equal_ar(&cfg, &dir, graphs);
    }
    // at T > 0 each mode samples its own tokens: timed, not compared with AR's
    assert_sampled_modes_are_timed(&cfg);
    assert_bad_decode_input_is_refused(&cfg);
    // the profiling runs need a GPU
    assert_profiling_needs_a_gpu(&cfg);
}

/// `bench regen --prefill-prompts 0` is refused by name before any model is built.
#[test]
fn bench_regen_refuses_no_prompts_per_prefill() {
    let shape = small_shape("bench-regen-prefill-0");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_dflash-rs"))
        .args(["bench", "regen", "--shape"])
        .arg(&shape)
        .args(["--slots", "2", "--prefill-prompts", "0"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--prefill-prompts must be >= 1"), "{err}");
    let _ = std::fs::remove_dir_all(shape.parent().unwrap());
}
