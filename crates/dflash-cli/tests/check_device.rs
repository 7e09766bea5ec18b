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
        "| dflash = AR on device (f32) | pass |",
        "| ddtree:8 = AR on device (f32) | pass |",
        "| ddtree:8 with CUDA graphs = without (f32) | pass |",
        "| train/infer parity (f32) | pass |",
    ] {
        assert!(table.contains(row), "missing {row:?} in\n{table}");
    }
    assert!(!table.contains("FAIL"), "{table}");
}
