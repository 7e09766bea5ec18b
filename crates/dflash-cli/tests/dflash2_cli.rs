//! DFlash2 drafters through the CLI: `drafter init --arch dflash2` writes one that loads and
//! decodes; z-lab's DFlash2 checkpoint (tests/fixtures/dflash2/tiny-full) decodes with `dflash`
//! and `ddtree:N` equal to AR at T = 0 and decodes at T = 1; a broken one is refused by name.

use std::process::Command;

use dflash_testkit::{fixtures, tmp};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dflash-rs"))
}

fn target() -> String {
    fixtures().join("qwen3-tiny").to_str().unwrap().to_string()
}

/// `generate` on the tiny target with `args`; must succeed; stdout as JSON.
fn generate(args: &[&str]) -> serde_json::Value {
    let t = target();
    let out = bin()
        .args([
            "generate",
            "--target",
            &t,
            "--prompt",
            "t37 t235 t140 t72 t255 t137",
        ])
        .args(["--max-new-tokens", "24", "--json"])
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "generate {args:?} failed:\n{err}");
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn zlab_dflash2_decodes_losslessly() {
    let d = fixtures().join("dflash2/tiny-full");
    let d = d.to_str().unwrap();
    for mode in ["dflash", "ddtree:4"] {
        let v = generate(&["--drafter", d, "--mode", mode, "--compare-ar"]);
        assert_eq!(v["equals_ar"], true, "{mode}: {v}");
        assert_eq!(v["new_tokens"], 24);
    }
    for mode in ["dflash", "ddtree:4"] {
        let v = generate(&[
            "--drafter",
            d,
            "--mode",
            mode,
            "--temperature",
            "1",
            "--seed",
            "3",
        ]);
        assert_eq!(v["new_tokens"], 24, "{mode} at T = 1: {v}");
    }
}

#[test]
fn drafter_init_dflash2() {
    let out_dir = tmp("dflash2-init").join("d2");
    let o = out_dir.to_str().unwrap();
    let run = bin()
        .args([
            "drafter",
            "init",
            "--arch",
            "dflash2",
            "--target",
            &target(),
            "--out",
            o,
        ])
        .args(["--layers", "1", "--block-size", "8", "--mask-token-id", "0"])
        .args(["--selector-rank", "8", "--selector-top-k", "4"])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["architectures"][0], "DFlash2DraftModel");
    assert_eq!(cfg["dflash_config"]["selector_top_k"], 4);
    assert_eq!(cfg["is_causal"], false);
    let v = generate(&["--drafter", o, "--mode", "dflash", "--compare-ar"]);
    assert_eq!(v["equals_ar"], true);
    // an unknown architecture is named
    let bad = bin()
        .args([
            "drafter",
            "init",
            "--arch",
            "dflash3",
            "--target",
            &target(),
            "--out",
            o,
        ])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown --arch 'dflash3'"));
}

/// A DFlash2 checkpoint without its selector's codebook, or without its conv sizes, is refused
/// with the missing name.
#[test]
fn broken_dflash2_is_named() {
    let src = fixtures().join("dflash2/tiny-full");
    let no_sizes = tmp("dflash2-no-sizes");
    std::fs::copy(
        src.join("model.safetensors"),
        no_sizes.join("model.safetensors"),
    )
    .unwrap();
    let cfg = std::fs::read_to_string(src.join("config.json"))
        .unwrap()
        .replace("\"conv_kernel_size\": 3,", "");
    std::fs::write(no_sizes.join("config.json"), cfg).unwrap();
    let no_book = tmp("dflash2-no-codebook");
    std::fs::copy(src.join("config.json"), no_book.join("config.json")).unwrap();
    let mut w =
        candle_core::safetensors::load(src.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    w.remove("candidate_selector.successor_codebook");
    candle_core::safetensors::save(&w, no_book.join("model.safetensors")).unwrap();
    for (dir, needle) in [
        (&no_sizes, "conv_kernel_size"),
        (&no_book, "candidate_selector.successor_codebook"),
    ] {
        let out = bin()
            .args(["generate", "--target", &target(), "--prompt", "t1 t2"])
            .args(["--drafter", dir.to_str().unwrap()])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(err.contains(needle), "expected {needle:?} in:\n{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}
