//! `bench-shape` on a small random Qwen3 shape (the Qwen3-8B shape runs on the GPU): every row
//! of the table and the cost model is printed, and a bad shape is refused by name.

use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dflash-rs"))
}

#[test]
fn bench_shape_reports_every_forward_and_the_cost_model() {
    let dir = std::env::temp_dir().join(format!("dflash-bench-shape-{}", std::process::id()));
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
    let o = bin()
        .args(["bench-shape", "--shape", cfg.to_str().unwrap()])
        .args([
            "--cache",
            "32",
            "--budgets",
            "4,16",
            "--repeats",
            "1",
            "--draft-layers",
            "2",
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
        "| draft block (2 layers, B = 16) |",
        "| DFlash chain |",
        "| DDTree-16 |",
    ] {
        assert!(out.contains(row), "missing {row:?} in\n{out}");
    }
    let bad = bin()
        .args(["bench-shape", "--shape", "/nonexistent/config.json"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--shape"));
}
