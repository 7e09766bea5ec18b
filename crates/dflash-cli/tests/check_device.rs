//! `check device` on the CPU against the CPU (the tiny Qwen3 and z-lab's quiet drafter for it):
//! every row passes, so the checker itself, its kernels' CPU twins and the decoding modes it
//! compares run in CI; on a GPU the same command compares the device with the CPU.

use std::process::Command;

use dflash_testkit::fixtures;

#[test]
fn check_device_on_the_cpu_passes_every_row() {
    let out = Command::new(env!("CARGO_BIN_EXE_dflash-rs"))
        .args([
            "check",
            "device",
            "--device",
            "cpu",
            "--max-new-tokens",
            "12",
        ])
        .arg("--target")
        .arg(fixtures().join("qwen3-tiny"))
        .arg("--drafter")
        .arg(fixtures().join("dflash-tiny/quiet"))
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{table}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for row in [
        "| f32 logits and taps vs CPU | pass |",
        "| AR on device = AR on CPU (T=0) | pass |",
        "| dflash at T = 1 on device = on CPU (f32, same seed) | pass |",
        "| ddtree:8 at T = 1 on device = on CPU (f32, same seed) | pass |",
        "| dflash = AR on device (f32) | pass |",
        "| ddtree:8 = AR on device (f32) | pass |",
        "| ddtree:8 with CUDA graphs = without (f32) | pass |",
        "| CUDA graphs kept across generations = fresh ones (f32) | pass |",
        "| train/infer parity (f32) | pass |",
    ] {
        assert!(table.contains(row), "missing {row:?} in\n{table}");
    }
    assert!(!table.contains("FAIL"), "{table}");
}

/// `check forward` on the tiny Qwen3.5 hybrid writes transformers' logits and taps
/// (`tests/reference/hybrid_reference.py`, its full 20-token prefill); bad ids are refused by
/// name.
#[test]
fn check_forward_writes_the_logits_and_taps_transformers_computes() {
    use dflash_testkit::{ids, json, load_ref, rel_err, tmp};
    let dir = fixtures().join("qwen35-tiny");
    let meta = json(&dir.join("reference.json"));
    let work = tmp("check-forward");
    std::fs::write(
        work.join("ids.json"),
        serde_json::to_string(&ids(&meta["ids"])).unwrap(),
    )
    .unwrap();
    let run = |ids_file: &str| {
        Command::new(env!("CARGO_BIN_EXE_dflash-rs"))
            .args(["check", "forward", "--target"])
            .arg(&dir)
            .arg("--ids")
            .arg(work.join(ids_file))
            .arg("--out")
            .arg(work.join("ours.safetensors"))
            .output()
            .unwrap()
    };
    let out = run("ids.json");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ours = load_ref(&work.join("ours.safetensors"));
    let reference = load_ref(&dir.join("reference.safetensors"));
    let l = rel_err(&ours["logits"], &reference["full.logits"]);
    let t = rel_err(&ours["taps"], &reference["full.taps"]);
    assert!(l < 1e-4 && t < 1e-4, "logits {l:.1e}, taps {t:.1e}");

    std::fs::write(work.join("bad.json"), "[1, 2, 999]").unwrap();
    let out = run("bad.json");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("token id 999 is outside the target's vocabulary (256 ids)"),
        "{err}"
    );
    // the file of the first run is still there, whole
    assert_eq!(load_ref(&work.join("ours.safetensors")).len(), 2);
}
