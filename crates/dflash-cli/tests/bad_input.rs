//! Bad input gets a clear message that names the problem and a non-zero exit; never a panic.

use dflash_testkit::{fixtures, smollm2_gguf as smollm2, tmp as tmpdir};
use std::path::Path;
use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dflash-rs"))
}
/// Run `generate` with `args`; it must fail with a message containing `needle`.
fn fails_with(args: &[&str], needle: &str) -> String {
    let out = bin().arg("generate").args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "expected failure for {args:?}");
    assert!(
        err.contains(needle),
        "expected {needle:?} in stderr for {args:?}, got:\n{err}"
    );
    assert!(!err.contains("panicked"), "panic for {args:?}:\n{err}");
    err
}
/// A chat prompt whose greedy answer transformers computed (tests/fixtures/smollm2.json), 8
/// tokens, JSON out.
const FRANCE_JSON: &[&str] = &[
    "--prompt",
    "What is the capital of France?",
    "--chat",
    "--max-new-tokens",
    "8",
    "--json",
];
/// Run `generate` with `args`; it must succeed. Returns (stdout as JSON, stderr).
fn succeeds_json(args: &[&str]) -> (serde_json::Value, String) {
    let out = bin().arg("generate").args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{err}");
    (serde_json::from_slice(&out.stdout).unwrap(), err)
}
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn truncated_gguf() {
    let d = tmpdir("trunc");
    let bytes = std::fs::read(smollm2()).unwrap();
    let p = d.join("cut.gguf");
    std::fs::write(&p, &bytes[..bytes.len() / 3]).unwrap();
    fails_with(
        &["--target", p.to_str().unwrap(), "--prompt", "hi"],
        "truncated",
    );
}

#[test]
fn corrupt_gguf() {
    let d = tmpdir("corrupt");
    let p = d.join("x.gguf");
    std::fs::write(&p, b"this is not a gguf file at all").unwrap();
    fails_with(
        &["--target", p.to_str().unwrap(), "--prompt", "hi"],
        "not a GGUF file",
    );
    let mut bytes = b"GGUF".to_vec();
    bytes.extend_from_slice(&[0xff; 64]);
    std::fs::write(&p, &bytes).unwrap();
    fails_with(
        &["--target", p.to_str().unwrap(), "--prompt", "hi"],
        "not a readable GGUF file",
    );
}

#[test]
fn corrupt_safetensors() {
    let d = tmpdir("st");
    copy_dir(&fixtures().join("qwen3-tiny"), &d);
    std::fs::write(
        d.join("model.safetensors"),
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}",
    )
    .unwrap();
    fails_with(
        &["--target", d.to_str().unwrap(), "--prompt", "hi"],
        "not a valid safetensors file",
    );
}

#[test]
fn unknown_architecture() {
    let d = tmpdir("arch");
    copy_dir(&fixtures().join("qwen3-tiny"), &d);
    let cfg = std::fs::read_to_string(d.join("config.json"))
        .unwrap()
        .replace("\"qwen3\"", "\"mamba\"");
    std::fs::write(d.join("config.json"), cfg).unwrap();
    fails_with(
        &["--target", d.to_str().unwrap(), "--prompt", "hi"],
        "unknown architecture 'mamba'",
    );
}

#[test]
fn missing_tokenizer() {
    let d = tmpdir("notok");
    copy_dir(&fixtures().join("qwen3-tiny"), &d);
    std::fs::remove_file(d.join("tokenizer.json")).unwrap();
    fails_with(
        &["--target", d.to_str().unwrap(), "--prompt", "hi"],
        "missing tokenizer",
    );
}

#[test]
fn missing_target() {
    fails_with(
        &["--target", "/nonexistent/model.gguf", "--prompt", "hi"],
        "neither an existing path nor a known alias",
    );
}

#[test]
fn prompt_longer_than_context() {
    let long = "word ".repeat(9000);
    fails_with(
        &["--target", smollm2().to_str().unwrap(), "--prompt", &long],
        "exceeds the target's context length",
    );
}

/// A mode outside the one grammar (`ar | dflash | ddtree:N`, N >= 1), or an acceptance rule
/// other than `residual | exact-match`, is refused with the grammar.
#[test]
fn unknown_mode_or_acceptance_rule() {
    for mode in ["ddtree", "ddtree:0", "beam", "auto:0"] {
        fails_with(
            &["--target", "smollm2-135m", "--prompt", "hi", "--mode", mode],
            "ar, dflash, ddtree:N (N = the tree's node budget, >= 1) or auto",
        );
    }
    fails_with(
        &["--prompt", "hi", "--acceptance", "greedy"],
        "residual or exact-match",
    );
}

#[test]
fn invalid_sampling_parameters() {
    let t = smollm2();
    let t = t.to_str().unwrap();
    fails_with(
        &["--target", t, "--prompt", "hi", "--temperature", "-0.5"],
        "temperature must be >= 0",
    );
    fails_with(
        &[
            "--target",
            t,
            "--prompt",
            "hi",
            "--temperature",
            "1",
            "--top-p",
            "0",
        ],
        "top-p must be in (0, 1]",
    );
    fails_with(
        &["--target", t, "--prompt", "hi", "--top-p", "1.5"],
        "top-p must be in (0, 1]",
    );
    fails_with(
        &["--target", t, "--prompt", "hi", "--top-k", "-1"],
        "top-k must be >= 0",
    );
}

#[test]
fn drafter_that_does_not_fit() {
    let t = smollm2();
    let dr = fixtures().join("dflash-tiny/quiet");
    fails_with(
        &[
            "--target",
            t.to_str().unwrap(),
            "--prompt",
            "hi",
            "--drafter",
            dr.to_str().unwrap(),
        ],
        "does not fit the target's hidden_size",
    );
    let d = tmpdir("mask");
    copy_dir(&dr, &d);
    let cfg = std::fs::read_to_string(d.join("config.json"))
        .unwrap()
        .replace("\"block_size\": 8", "\"block_size\": 1");
    std::fs::write(d.join("config.json"), cfg).unwrap();
    fails_with(
        &[
            "--target",
            t.to_str().unwrap(),
            "--prompt",
            "hi",
            "--drafter",
            d.to_str().unwrap(),
        ],
        "block_size must be >= 2",
    );
}

/// A drafter's `draft_vocab.json` that is not a valid subset is refused with the file's name.
#[test]
fn bad_draft_vocabulary() {
    let t = smollm2();
    let bundled = dflash_testkit::repo_root().join("assets/drafters/smollm2-135m-b16");
    let d = tmpdir("vocab");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(bundled.join(f), d.join(f)).unwrap();
    }
    let args = [
        "--target",
        t.to_str().unwrap(),
        "--prompt",
        "hi",
        "--mode",
        "ddtree:8",
        "--drafter",
        d.to_str().unwrap(),
    ];
    for (vocab, needle) in [
        (
            r#"{"token_ids": [5, 3]}"#,
            "ascending and unique (5 then 3)",
        ),
        (
            r#"{"token_ids": [5, 49152]}"#,
            "token 49152 is outside the target's 49152 tokens",
        ),
        (r#"{"token_ids": ["#, "is not a draft vocabulary"),
    ] {
        std::fs::write(d.join("draft_vocab.json"), vocab).unwrap();
        fails_with(&args, needle);
    }
}

#[test]
fn generate_json_has_the_promised_fields() {
    let target = smollm2();
    let (v, _) = succeeds_json(&[&["--target", target.to_str().unwrap()], FRANCE_JSON].concat());
    for k in [
        "text",
        "token_ids",
        "prompt_tokens",
        "new_tokens",
        "seconds",
        "tokens_per_second",
        "mode",
        "stats",
    ] {
        assert!(v.get(k).is_some(), "missing {k}");
    }
    // transformers' greedy reference for this prompt (tests/fixtures/smollm2.json)
    assert_eq!(v["text"], "The capital of France is Paris.");
    assert_eq!(v["mode"], "ar");
}

#[test]
fn speculative_generate_uses_the_bundled_drafter_and_compares_with_ar() {
    let (v, err) = succeeds_json(
        &[
            &[
                "--target",
                "smollm2-135m",
                "--mode",
                "dflash",
                "--compare-ar",
            ],
            FRANCE_JSON,
        ]
        .concat(),
    );
    assert!(err.contains("using the bundled drafter"));
    assert_eq!(v["mode"], "dflash");
    assert_eq!(v["text"], "The capital of France is Paris.");
    assert_eq!(v["equals_ar"], true);
    assert!(v["speedup_vs_ar"].as_f64().unwrap() > 0.0);
    // a target without a shipped drafter needs --drafter, and says so and where it looked
    let err = fails_with(
        &[
            "--target",
            "qwen2.5-coder-1.5b",
            "--mode",
            "ddtree:8",
            "--prompt",
            "x",
        ],
        "needs --drafter",
    );
    assert!(
        err.contains("drafters/qwen2.5-coder-1.5b-b16 or ")
            && err.contains("assets/drafters/qwen2.5-coder-1.5b-b16"),
        "{err}"
    );
}

/// `--cuda-graphs` on the CPU runs the fixed-shape forwards (no graphs), says so, and gives
/// transformers' greedy answer like the plain loop.
#[test]
fn cuda_graphs_flag_on_the_cpu_keeps_the_output_and_says_no_graphs() {
    let (v, err) = succeeds_json(
        &[
            &[
                "--target",
                "smollm2-135m",
                "--mode",
                "dflash",
                "--compare-ar",
                "--cuda-graphs",
            ],
            FRANCE_JSON,
        ]
        .concat(),
    );
    assert!(err.contains("--cuda-graphs on the CPU"), "{err}");
    assert_eq!(v["text"], "The capital of France is Paris.");
    assert_eq!(v["equals_ar"], true);
}

/// `--cpu-products` takes `exact` or `q8` and names them otherwise; with `q8` the France
/// prompt's greedy answer is still transformers' (the integer products stay near the f32 ones:
/// crates/dflash-model/tests/gguf_targets.rs).
/// `--draft-products` takes exact or q8 (another value is refused by name); the drafter's
/// products move its drafts at most, never the output: DDTree-4 with the bundled drafter gives
/// AR's tokens (transformers' answer) with either, and says so (`--compare-ar`).
#[test]
fn draft_products_are_exact_or_q8_and_keep_the_output() {
    fails_with(
        &[
            "--target",
            "smollm2-135m",
            "--draft-products",
            "q4",
            "--prompt",
            "hi",
        ],
        "possible values: exact, q8",
    );
    let gguf = smollm2();
    let drafter = dflash_testkit::repo_root().join("assets/drafters/smollm2-135m-b16");
    for products in ["exact", "q8"] {
        let mut args = vec![
            "--target",
            gguf.to_str().unwrap(),
            "--drafter",
            drafter.to_str().unwrap(),
            "--mode",
            "ddtree:4",
            "--compare-ar",
            "--draft-products",
            products,
        ];
        args.extend_from_slice(FRANCE_JSON);
        let (out, _) = succeeds_json(&args);
        assert_eq!(out["text"], "The capital of France is Paris.", "{products}");
        assert_eq!(out["equals_ar"], true, "{products}");
    }
}

#[test]
fn cpu_products_are_exact_or_q8() {
    fails_with(
        &[
            "--target",
            "smollm2-135m",
            "--cpu-products",
            "q4",
            "--prompt",
            "hi",
        ],
        "possible values: exact, q8",
    );
    let gguf = smollm2();
    let mut args = vec!["--target", gguf.to_str().unwrap(), "--cpu-products", "q8"];
    args.extend_from_slice(FRANCE_JSON);
    let (out, _) = succeeds_json(&args);
    // transformers' greedy reference for this prompt (tests/fixtures/smollm2.json)
    assert_eq!(out["text"], "The capital of France is Paris.");
}
